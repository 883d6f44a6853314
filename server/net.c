/*
 * net.c: host:port parsing and listening TCP sockets, for the client port and the metrics port.
 */
#include "server.h"

#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

int kvt__parse_hostport(const char *s, char *host, size_t hostlen, uint16_t *port)
{
    const char *colon = strrchr(s, ':');
    if (!colon || colon == s || (size_t)(colon - s) >= hostlen)
        return KVT_EINVAL;
    char *end;
    long p = strtol(colon + 1, &end, 10);
    if (!colon[1] || *end || p < 0 || p > 65535)
        return KVT_EINVAL;
    memcpy(host, s, (size_t)(colon - s));
    host[colon - s] = 0;
    *port = (uint16_t)p;
    return 0;
}

int kvt__listen_tcp(const char *addr, char *bound, size_t boundlen)
{
    char host[256];
    uint16_t port;
    if (kvt__parse_hostport(addr, host, sizeof host, &port) < 0)
        return KVT_EINVAL;
    struct addrinfo hints = {
        .ai_family = AF_INET, .ai_socktype = SOCK_STREAM, .ai_flags = AI_NUMERICSERV | AI_PASSIVE};
    struct addrinfo *ai;
    char ps[8];
    snprintf(ps, sizeof ps, "%u", port);
    if (getaddrinfo(host, ps, &hints, &ai) != 0)
        return KVT_EINVAL;
    int fd = socket(ai->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        freeaddrinfo(ai);
        return -errno;
    }
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    /* The kernel's most (net.core.somaxconn caps it): a burst of connects while the loop is off
     * the CPU queues here. With 512, a client past it had its SYN dropped and retried a second
     * later, which held a connect storm to a tenth of the rate the loop keeps up with
     * (docs/benchmarks.md, "How the loops take connections"). */
    if (bind(fd, ai->ai_addr, ai->ai_addrlen) < 0 || listen(fd, SOMAXCONN) < 0) {
        int e = -errno;
        freeaddrinfo(ai);
        close(fd);
        return e;
    }
    freeaddrinfo(ai);
    struct sockaddr_in sin;
    socklen_t sl = sizeof sin;
    if (getsockname(fd, (struct sockaddr *)&sin, &sl) == 0)
        snprintf(bound, boundlen, "%s:%u", host, ntohs(sin.sin_port));
    return fd;
}
