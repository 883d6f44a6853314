/*
 * http.c: the metrics endpoint. A minimal HTTP/1.0-style server on its own port inside the same
 * event loop: it reads one request head (at most 8 KiB), answers GET /metrics with the Prometheus
 * text rendering and GET /healthz with "ok", a request line that is not HTTP's with 400 (as soon
 * as it shows), anything else with 404 or 405, and closes. A scrape renders from the live
 * counters; nothing is cached and nothing blocks. When all KVT_HTTP_MAX_CONNS are open, a new
 * connection closes the oldest one not yet answered: clients that connect and say nothing (or
 * connect, wait and close, again and again) cannot keep a scrape out.
 */
#define _GNU_SOURCE /* accept4 */
#include "server.h"

#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#define KVT_HTTP_HEAD_MAX  8192
#define KVT_HTTP_MAX_CONNS 64
/* A scrape's connection gets this long for its request and the reply; then it is closed, so
 * that clients that connect and say nothing cannot take all KVT_HTTP_MAX_CONNS for good. */
#define KVT_HTTP_TIMEOUT_NS (5000ull * 1000000)

struct kvt_http_conn {
    kvt__ev_t ev;
    struct kvt_http_conn *next, **pprev;
    uint64_t deadline_ns;
    char head[KVT_HTTP_HEAD_MAX];
    size_t head_len;
    char *out;
    size_t out_len, out_off;
};

/* Closes h's socket and takes it off the list. */
static void http_unlink(kvt_srv_t *s, kvt_http_conn_t *h)
{
    kvt__ev_del(s, &h->ev);
    close(h->ev.fd);
    *h->pprev = h->next;
    if (h->next)
        h->next->pprev = h->pprev;
    s->http.n--;
}

static void http_free(kvt_srv_t *s, kvt_http_conn_t *h)
{
    http_unlink(s, h);
    free(h->out);
    free(h);
}

/* The callback of a connection closed while the batch of events epoll_wait returned may still
 * hold one for it. */
static void http_on_gone(kvt_srv_t *s, kvt__ev_t *ev, uint32_t events)
{
    (void)s;
    (void)ev;
    (void)events;
}

static void http_reap(kvt_srv_t *s)
{
    while (s->http.gone) {
        kvt_http_conn_t *h = s->http.gone;
        s->http.gone = h->next;
        free(h->out);
        free(h);
    }
}

static void http_respond(kvt_http_conn_t *h, const char *status, const char *type, const char *body,
                         size_t len)
{
    char hdr[256];
    int n = snprintf(hdr, sizeof hdr,
                     "HTTP/1.1 %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\nConnection: "
                     "close\r\n\r\n",
                     status, type, len);
    h->out = malloc((size_t)n + len);
    if (!h->out)
        return;
    memcpy(h->out, hdr, (size_t)n);
    memcpy(h->out + n, body, len);
    h->out_len = (size_t)n + len;
}

/* Whether the first len bytes of a request can begin an HTTP/1 request line: a method of capital
 * letters, a target, "HTTP/" and a version, then the line's end. Another protocol's bytes (TLS, a
 * kvtier frame, text) fail as soon as they show, and get their 400 without a wait for a blank line
 * that may never come. */
static int http_line_ok(const char *p, size_t len)
{
    size_t i = 0, n = 0;
    while (i < len && p[i] >= 'A' && p[i] <= 'Z' && n < 15) {
        i++;
        n++;
    }
    if (i == len)
        return 1;
    if (n == 0 || p[i++] != ' ')
        return 0;
    for (n = 0; i < len && p[i] > ' ' && p[i] < 0x7f; i++)
        n++;
    if (i == len)
        return 1;
    if (n == 0 || p[i++] != ' ')
        return 0;
    static const char version[] = "HTTP/0.0"; /* '0': a digit */
    for (n = 0; version[n] && i < len; n++, i++)
        if (version[n] == '0' ? !isdigit((unsigned char)p[i]) : p[i] != version[n])
            return 0;
    if (i < len && p[i] == '\r')
        i++;
    return i == len || p[i] == '\n';
}

static void http_route(kvt_srv_t *s, kvt_http_conn_t *h, kvt__http_req_t req, int head)
{
    if (req == KVT__HTTP_BAD) {
        http_respond(h, "400 Bad Request", "text/plain", "bad request\n", 12);
    } else if (req == KVT__HTTP_TOO_LARGE) {
        http_respond(h, "431 Request Header Fields Too Large", "text/plain", "too large\n", 10);
    } else if (req == KVT__HTTP_METRICS) {
        kvt__tier_metrics(s);
        kvt__loops_gauges(s);
        kvt__metrics_process(s->metrics);
        char *body;
        size_t len;
        if (kvt__metrics_render(s->metrics, &body, &len) < 0) {
            http_respond(h, "500 Internal Server Error", "text/plain", "out of memory\n", 14);
            return;
        }
        http_respond(h, "200 OK", "text/plain; version=0.0.4; charset=utf-8", body, head ? 0 : len);
        free(body);
    } else if (req == KVT__HTTP_HEALTHZ) {
        /* A load balancer or an engine's health check stops sending here while it drains. */
        const char *msg = s->stopping ? "stopping\n" : s->draining ? "draining\n" : "ok\n";
        int down = s->stopping || s->draining;
        http_respond(h, down ? "503 Service Unavailable" : "200 OK", "text/plain", msg,
                     head ? 0 : strlen(msg));
    } else if (req == KVT__HTTP_NOT_ALLOWED) {
        http_respond(h, "405 Method Not Allowed", "text/plain", "GET only\n", 9);
    } else {
        http_respond(h, "404 Not Found", "text/plain", "not found\n", 10);
    }
}

kvt__http_req_t kvt__http_parse(const char *head, size_t len, int full, int *head_only)
{
    *head_only = 0;
    if (!http_line_ok(head, len))
        return KVT__HTTP_BAD;
    if (!strstr(head, "\r\n\r\n") && !strstr(head, "\n\n"))
        return full ? KVT__HTTP_TOO_LARGE : KVT__HTTP_MORE;
    char method[16], path[256];
    if (sscanf(head, "%15s %255s", method, path) != 2)
        return KVT__HTTP_BAD;
    char *q = strchr(path, '?');
    if (q)
        *q = 0;
    int get = !strcmp(method, "GET");
    *head_only = !strcmp(method, "HEAD");
    int known = !strcmp(path, "/metrics") || !strcmp(path, "/healthz");
    if (known && !get && !*head_only)
        return KVT__HTTP_NOT_ALLOWED;
    if (!known)
        return KVT__HTTP_NOT_FOUND;
    return path[1] == 'm' ? KVT__HTTP_METRICS : KVT__HTTP_HEALTHZ;
}

static void http_on_conn(kvt_srv_t *s, kvt__ev_t *ev, uint32_t events)
{
    kvt_http_conn_t *h = (kvt_http_conn_t *)ev;
    if (!h->out && (events & EPOLLIN)) {
        ssize_t n = read(ev->fd, h->head + h->head_len, sizeof h->head - 1 - h->head_len);
        if (n <= 0) {
            if (n == 0 || (errno != EAGAIN && errno != EINTR))
                http_free(s, h);
            return;
        }
        h->head_len += (size_t)n;
        h->head[h->head_len] = 0;
        int head = 0;
        kvt__http_req_t req =
            kvt__http_parse(h->head, h->head_len, h->head_len == sizeof h->head - 1, &head);
        if (req == KVT__HTTP_MORE)
            return;
        http_route(s, h, req, head);
        if (!h->out) {
            http_free(s, h);
            return;
        }
        kvt__ev_mod(s, &h->ev, EPOLLOUT);
    }
    if (h->out && (events & (EPOLLOUT | EPOLLIN))) {
        while (h->out_off < h->out_len) {
            ssize_t n = write(ev->fd, h->out + h->out_off, h->out_len - h->out_off);
            if (n < 0) {
                if (errno == EAGAIN || errno == EINTR)
                    return;
                break;
            }
            h->out_off += (size_t)n;
        }
        http_free(s, h);
        return;
    }
    if (events & (EPOLLERR | EPOLLHUP))
        http_free(s, h);
}

/* Every slot is taken: the oldest connection not yet answered goes (or, if all are being
 * answered, the oldest). A scrape sends its request as it connects and is answered within an
 * iteration of the loop, so it is never the oldest for long; a burst of connections from others
 * can only push out what came before it. */
static int http_evict(kvt_srv_t *s)
{
    kvt_http_conn_t *victim = NULL;
    for (kvt_http_conn_t *h = s->http.conns; h; h = h->next) {
        if (!victim || (!h->out && victim->out) ||
            (!h->out == !victim->out && h->deadline_ns < victim->deadline_ns))
            victim = h;
    }
    if (!victim)
        return 0;
    kvt__metric_add(s->metrics, KVT_M_SCRAPES_EVICTED, 0, 1);
    /* Freed at the next tick: an event for it may come later in this batch. */
    http_unlink(s, victim);
    victim->ev.cb = http_on_gone;
    victim->next = s->http.gone;
    s->http.gone = victim;
    return 1;
}

static void http_on_accept(kvt_srv_t *s, kvt__ev_t *ev, uint32_t events)
{
    (void)events;
    for (int k = 0; k < 16; k++) {
        int fd = kvt__accept(s, ev->fd, "metrics");
        if (fd < 0)
            return;
        if (s->http.n >= KVT_HTTP_MAX_CONNS && !http_evict(s)) {
            close(fd);
            continue;
        }
        kvt_http_conn_t *h = calloc(1, sizeof *h);
        if (!h) {
            close(fd);
            continue;
        }
        h->ev.fd = fd;
        h->ev.cb = http_on_conn;
        h->deadline_ns = kvt_now_ns() + KVT_HTTP_TIMEOUT_NS;
        if (kvt__ev_add(s, &h->ev, EPOLLIN) < 0) {
            close(fd);
            free(h);
            continue;
        }
        h->next = s->http.conns;
        if (h->next)
            h->next->pprev = &h->next;
        h->pprev = &s->http.conns;
        s->http.conns = h;
        s->http.n++;
    }
}

int kvt__http_listen(kvt_srv_t *s, const char *addr)
{
    int fd = kvt__listen_tcp(addr, s->http_addr, sizeof s->http_addr);
    if (fd < 0)
        return fd;
    s->http_ev.fd = fd;
    s->http_ev.cb = http_on_accept;
    int rc = kvt__ev_add(s, &s->http_ev, EPOLLIN);
    if (rc < 0) {
        close(fd);
        s->http_ev.fd = -1;
    }
    return rc;
}

void kvt__http_tick(kvt_srv_t *s, uint64_t now)
{
    http_reap(s);
    kvt_http_conn_t *next;
    for (kvt_http_conn_t *h = s->http.conns; h; h = next) {
        next = h->next;
        if (now >= h->deadline_ns)
            http_free(s, h);
    }
}

void kvt__http_close(kvt_srv_t *s)
{
    while (s->http.conns)
        http_free(s, s->http.conns);
    http_reap(s);
    if (s->http_ev.fd >= 0) {
        kvt__ev_del(s, &s->http_ev);
        close(s->http_ev.fd);
        s->http_ev.fd = -1;
    }
}
