/*
 * slow_dns.c: an LD_PRELOAD shim for the remote tier's name-lookup tests (test_server_remote.c),
 * a resolver that is slow to answer without a DNS server to make slow. It interposes getaddrinfo:
 * a lookup of the name "localhost" first appends a line to the file $KVT_SLOW_DNS_LOG (when set)
 * and sleeps $KVT_SLOW_DNS_MS milliseconds (2000 when unset), then goes on to libc's; every other
 * name, an address literal among them, goes straight to libc's. Whichever thread makes the call
 * sleeps: the daemon's event loop if the lookup is on its path, a thread of the tier's own if not.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <netdb.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef int (*gai_fn)(const char *, const char *, const struct addrinfo *, struct addrinfo **);

static gai_fn real_gai;

/* Looked up before any thread can call getaddrinfo. */
__attribute__((constructor)) static void slow_dns_init(void)
{
    real_gai = (gai_fn)dlsym(RTLD_NEXT, "getaddrinfo");
}

int getaddrinfo(const char *node, const char *service, const struct addrinfo *hints,
                struct addrinfo **res)
{
    if (node && !strcmp(node, "localhost")) {
        const char *log = getenv("KVT_SLOW_DNS_LOG");
        const char *ms = getenv("KVT_SLOW_DNS_MS");
        long wait = ms && *ms ? strtol(ms, NULL, 10) : 2000;
        if (log && *log) {
            int fd = open(log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
            if (fd >= 0) {
                ssize_t w = write(fd, "localhost\n", 10);
                (void)w;
                close(fd);
            }
        }
        struct timespec ts = {.tv_sec = wait / 1000, .tv_nsec = (wait % 1000) * 1000000};
        while (nanosleep(&ts, &ts) < 0)
            ;
    }
    return real_gai(node, service, hints, res);
}
