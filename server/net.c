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

/*
 * A host in brackets ("[::]:7390", "[fd00::2]:7390") is an IPv6 address; "[::]" listens on both
 * families (IPV6_V6ONLY off whatever net.ipv6.bindv6only says: its IPv4 peers come v4-mapped,
 * ::ffff:a.b.c.d). Any other host is looked up as IPv4 only, as it always was: "localhost" does
 * not turn into ::1.
 */
int kvt__listen_tcp(const char *addr, char *bound, size_t boundlen)
{
    char host[256];
    uint16_t port;
    if (kvt__parse_hostport(addr, host, sizeof host, &port) < 0)
        return KVT_EINVAL;
    size_t hl = strlen(host);
    int v6 = hl >= 2 && host[0] == '[' && host[hl - 1] == ']';
    if (v6) {
        memmove(host, host + 1, hl - 2);
        host[hl - 2] = 0;
    }
    struct addrinfo hints = {.ai_family = v6 ? AF_INET6 : AF_INET,
                             .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_NUMERICSERV | AI_PASSIVE};
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
    int one = 1, zero = 0;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (v6)
        setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
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
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    if (getsockname(fd, (struct sockaddr *)&ss, &sl) == 0)
        snprintf(bound, boundlen, v6 ? "[%s]:%u" : "%s:%u", host,
                 ntohs(v6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                          : ((struct sockaddr_in *)&ss)->sin_port));
    return fd;
}

/* Whether listening socket fd takes connections from loopback only (127.0.0.0/8, ::1). */
int kvt__listen_loopback(int fd)
{
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    if (getsockname(fd, (struct sockaddr *)&ss, &sl) < 0)
        return 0;
    if (ss.ss_family == AF_INET)
        return (ntohl(((struct sockaddr_in *)&ss)->sin_addr.s_addr) >> 24) == 127;
    return ss.ss_family == AF_INET6 &&
           IN6_IS_ADDR_LOOPBACK(&((struct sockaddr_in6 *)&ss)->sin6_addr);
}
