/*
 * conn.c: client connections. It owns the socket, the input buffer and the frame boundaries (a
 * frame is handed to dispatch.c only when whole), the reply queue of server.h and its writing,
 * back-pressure (a connection with too much output queued or too many tier I/Os in flight stops
 * being read until it drains), and the framing errors that end a connection: wrong magic or
 * version, a body over max-frame, a peer that closes in the middle of a frame. Each of those
 * gets an error reply when the socket still takes one, a log line and a counter, and touches no
 * other connection.
 *
 * With several loops (loops.c) a connection belongs to the loop that accepted it: only that loop
 * parses its frames, writes its replies and frees it; any other kicks or closes it by posting it
 * there. Its loop lets s->lock go for the socket's read and for a write of finished replies, and
 * only at the top of the loop (the connection's own event): there nothing is half done, the
 * input buffer is touched by no one else, and the bytes written belong to requests that no other
 * loop changes any more (done, or a reply source that says its bytes may go apart: a GET's batch
 * of DRAM pages and read buffers; no I/O in flight, no descriptor to pass). There too it frames
 * the input with the lock held shared, answers the run of MATCHes, GETs and RELEASEs at its front
 * in that one hold (kvt__conn_ops_t.shared), and writes and frees their replies, taking the lock
 * for writing only for the frames that need it and going back to shared after them (conn_frames):
 * every other thread that reads the connection's fields (loop 0's tick and completions) holds it
 * for writing.
 */
#define _GNU_SOURCE /* accept4 */
#include "server.h"

#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <malloc.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#define KVT_READ_CHUNK (256u << 10)
#define KVT_IOV_MAX    64
/* A connection's input buffer between big frames: a frame that does not fit gets a buffer of its
 * own size (within max-client-bytes), which goes back to this size once the frame is handled. */
#define KVT_IN_BASE (2 * KVT_READ_CHUNK)
/* Token scratch (misaligned frames) above this many tokens is freed after its frame. */
#define KVT_TOKENS_KEEP (64u << 10)

/* The part of an input buffer of cap bytes that counts in the clients' memory. */
static size_t in_counted(size_t cap)
{
    return cap > KVT_IN_BASE ? cap - KVT_IN_BASE : 0;
}

/* c's input buffer becomes cap bytes (its content kept up to cap). */
static int in_resize(kvt__conn_t *c, size_t cap)
{
    uint8_t *p = realloc(c->in, cap);
    if (!p)
        return KVT_ENOMEM;
    /* Only a frame's own buffer counts: the base one, made with the lock shared, changes nothing */
    int64_t d = (int64_t)in_counted(cap) - (int64_t)in_counted(c->in_cap);
    if (d)
        kvt__clients_add(c, d);
    c->in = p;
    c->in_cap = cap;
    return 0;
}

/* The kept big-frame buffer goes back to the allocator. */
static void spare_drop(kvt_srv_t *s)
{
    if (s->clients.kept) {
        free(s->clients.kept);
        s->clients.kept = NULL;
        s->clients.kept_bytes = 0;
    }
}

/*
 * c's input buffer, growing for a frame of want bytes (room for them in max-client-bytes already
 * checked), becomes the kept buffer of an earlier big frame when that one's allocation holds
 * want: its pages are resident, where a fresh buffer's were faulted and zeroed every frame
 * (jemalloc purges a freed allocation of 8 MiB or more at once: PUTs of 8 x 2 MiB pages cost
 * the daemon 0.63-0.68 s of CPU per GiB, most of it page faults, against 0.16-0.19 for 2 MiB
 * PUTs; 0.20-0.25 with this). Returns 1 when it did; 0, the spare dropped, otherwise (the fresh
 * buffer takes its place in memory).
 */
static int spare_take(kvt__conn_t *c, size_t want)
{
    kvt_srv_t *s = c->srv;
    uint8_t *p = s->clients.kept;
    if (!p || malloc_usable_size(p) < want) {
        spare_drop(s);
        return 0;
    }
    memcpy(p, c->in, c->in_len);
    free(c->in);
    s->clients.bytes -= in_counted(c->in_cap);
    s->clients.bytes += in_counted(want);
    s->clients.kept = NULL;
    s->clients.kept_bytes = 0;
    c->in = p;
    c->in_cap = want;
    kvt__metric_add(s->metrics, KVT_M_FRAME_BUFFERS_REUSED, 0, 1);
    return 1;
}

static void mem_wait_end(kvt__conn_t *c)
{
    if (c->mem_wait) {
        c->mem_wait = 0;
        c->srv->clients.mem_waiting--;
    }
}

/* max-client-bytes reached: a connection with replies queued or tier I/O in flight takes no new
 * request until they drain (they free memory, and kick it when they do). One with nothing may
 * still take one: a frame in its base buffer, so that every client gets served. */
static int mem_full(const kvt__conn_t *c)
{
    kvt_srv_t *s = c->srv;
    /* A buffer kept for speed never holds a client back; with the lock shared it is another
     * loop's too, and goes at the next check under the write lock (it is not in the count). */
    if (s->clients.bytes + s->clients.kept_bytes >= s->conf->max_client_bytes &&
        c->loop->held != KVT_HELD_SHARED)
        spare_drop(s);
    return s->clients.bytes >= s->conf->max_client_bytes && (c->out_bytes > 0 || c->inflight > 0);
}

/* Back-pressure: c takes no new request while it has max-inflight tier I/Os in flight, max-output
 * reply bytes queued, or work out with the clients' memory full; nor while its AUTH waits its
 * turn (auth.c: reading on would tell a guesser how its guess went). */
static int conn_held(const kvt__conn_t *c)
{
    const kvt_srv_conf_t *cf = c->srv->conf;
    return c->inflight >= cf->max_inflight || c->out_bytes >= cf->max_output || mem_full(c) ||
           c->auth_wait;
}

void kvt__proto_error(kvt_srv_t *s, kvt_proto_err_t kind)
{
    kvt__metric_add(s->metrics, KVT_M_PROTOCOL_ERRORS, kind, 1);
}

static void conn_on_event(kvt_srv_t *s, kvt__ev_t *ev, uint32_t events);

int kvt__accept(kvt_srv_t *s, int lfd, const char *what)
{
    for (int refused = 0; refused < 64;) { /* then the loop's other work gets its turn */
        int fd = accept4(lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd >= 0)
            return fd;
        if (errno == EINTR || errno == ECONNABORTED)
            continue;
        if ((errno == EMFILE || errno == ENFILE) && s->clients.spare_fd >= 0) {
            /* The connection stays in the backlog, and the socket readable, until it is taken:
             * take it with the spare descriptor's slot and close it. */
            close(s->clients.spare_fd);
            int x = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
            if (x >= 0)
                close(x);
            s->clients.spare_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
            struct rlimit rl = {0};
            getrlimit(RLIMIT_NOFILE, &rl);
            kvt__metric_add(s->metrics, KVT_M_CONNECTIONS_REFUSED, 0, 1);
            static kvt_log_limit_t lim;
            kvt_log_limited(&lim, KVT_LOG_WARN,
                            "kvtierd: refusing a %s connection: no file descriptor left (open-file "
                            "limit %llu, %u client connections)",
                            what, (unsigned long long)rl.rlim_cur, s->clients.n);
            if (x >= 0) {
                refused++;
                continue;
            }
        } else if (errno != EAGAIN) {
            static kvt_log_limit_t lim;
            kvt_log_limited(&lim, KVT_LOG_WARN, "kvtierd: accept (%s): %s", what, strerror(errno));
        }
        return -1;
    }
    return -1;
}

/*
 * At max-conns a new connection takes the place of the connection idle the longest (no byte from
 * it for evict-idle-ms or more) that holds no lease, has no request queued or in flight and
 * waits for nothing: connections that only connected, or said HELLO and went quiet, cannot keep
 * every slot. An engine's sidecar connection that holds leases, or is being answered, is never
 * the one closed. One walk over the connections, only when every slot is taken.
 */
static int conn_evict(kvt_srv_t *s, uint64_t now)
{
    uint64_t idle = (uint64_t)s->conf->evict_idle_ms * 1000000;
    if (idle == 0)
        return 0;
    kvt__conn_t *victim = NULL;
    for (kvt__conn_t *c = s->clients.list; c; c = c->next) {
        if (c->closing || c->dead || c->nleases || c->head || c->inflight || c->mem_wait ||
            kvt_ns_since(now, c->rx_ns) < idle)
            continue;
        if (!victim || c->rx_ns < victim->rx_ns)
            victim = c;
    }
    if (!victim)
        return 0;
    static kvt_log_limit_t lim;
    kvt_log_limited(&lim, KVT_LOG_INFO,
                    "kvtierd: max-conns reached: connection %llu, idle for %llu ms with no lease "
                    "and no request, closed for a new one (evict-idle-ms)",
                    (unsigned long long)victim->id,
                    (unsigned long long)(kvt_ns_since(now, victim->rx_ns) / 1000000));
    kvt__metric_add(s->metrics, KVT_M_CONNECTIONS_EVICTED, 0, 1);
    kvt__conn_close(victim);
    return 1;
}

static __thread kvt__loop_t *loop_self;

kvt__loop_t *kvt__loop_self(void)
{
    return loop_self;
}

void kvt__loop_set_self(kvt__loop_t *l)
{
    loop_self = l;
}

kvt__loop_t *kvt__loop_pick(kvt_srv_t *s)
{
    kvt__loop_t *best = &s->loops[0];
    unsigned n = s->loops_running ? s->nloops : 1;
    for (unsigned i = 1; i < n; i++)
        if (s->loops[i].conns < best->conns)
            best = &s->loops[i];
    return best;
}

/* c on its loop's posted list, once: 1 when it was not there yet. */
static int posted_push(kvt__conn_t *c)
{
    if (c->posted)
        return 0;
    c->posted = 1;
    c->posted_next = c->loop->posted;
    c->loop->posted = c;
    return 1;
}

void kvt__loop_post(kvt__conn_t *c)
{
    kvt__loop_t *l = c->loop;
    if (!posted_push(c))
        return;
    kvt__metric_add(c->srv->metrics, KVT_M_LOOP_KICKS_POSTED, l->id, 1);
    uint64_t one = 1;
    if (write(l->wake.fd, &one, sizeof one) < 0) {
        /* EAGAIN only: the count is at its maximum, and the loop is woken already. */
    }
}

void kvt__kicks_defer(kvt__loop_t *l)
{
    l->deferring = 1;
}

void kvt__kicks_keep(kvt__loop_t *l)
{
    l->deferring = 0;
}

void kvt__kicks_flush(kvt__loop_t *l)
{
    /* Kicked as the completions' kicks were, with the lock held throughout (l->top is not
     * set), and before the reap: a connection closed meanwhile is still there, marked gone, and
     * its kick does nothing. Another loop's posts on the list get their kick here instead.
     * Kicks these kicks make (a request one finishes at once on another connection) are not
     * deferred. */
    l->deferring = 0;
    while (l->posted) {
        kvt__conn_t *c = l->posted;
        l->posted = c->posted_next;
        c->posted_next = NULL;
        c->posted = 0;
        kvt__conn_kick(c);
    }
}

/* sndbuf_log of a TCP connection whose peer is on another host: socket-send-budget leaves it to
 * the kernel's tuning. */
#define KVT_SNDBUF_TUNED 0xff

/* The address of a as IPv6, an IPv4 one v4-mapped (::ffff:a.b.c.d), so that a dual-stack
 * listener's IPv4 peers and the interfaces' IPv4 addresses compare alike: 0 for another family. */
static int addr_v6(const struct sockaddr *a, struct in6_addr *out)
{
    if (a->sa_family == AF_INET6) {
        *out = ((const struct sockaddr_in6 *)a)->sin6_addr;
        return 1;
    }
    if (a->sa_family != AF_INET)
        return 0;
    memset(out, 0, sizeof *out);
    out->s6_addr[10] = out->s6_addr[11] = 0xff;
    memcpy(out->s6_addr + 12, &((const struct sockaddr_in *)a)->sin_addr, 4);
    return 1;
}

#define KVT_HOST_ADDRS_AGE_NS 1000000000ull

/* Looks up the host's addresses again when the last look is a second old: an address added
 * since is missed for at most that long (its peers keep the kernel's tuning meanwhile). A
 * failed look keeps the last list, and is not retried before the second is over either. */
static void host_addrs_fresh(kvt_srv_t *s)
{
    kvt__clients_t *cl = &s->clients;
    uint64_t now = kvt_now_ns();
    if (cl->host_addrs_ns && now - cl->host_addrs_ns < KVT_HOST_ADDRS_AGE_NS)
        return;
    cl->host_addrs_ns = now;
    struct ifaddrs *ifs = NULL;
    if (getifaddrs(&ifs) < 0)
        return;
    size_t n = 0;
    for (struct ifaddrs *i = ifs; i; i = i->ifa_next) {
        struct in6_addr a;
        if (!i->ifa_addr || !addr_v6(i->ifa_addr, &a))
            continue;
        if (kvt_reserve(&cl->host_addrs, &cl->host_addrs_cap, n + 1, sizeof a, 8) < 0)
            break; /* out of memory: the ones so far */
        cl->host_addrs[n++] = a;
    }
    cl->host_naddrs = n;
    freeifaddrs(ifs);
}

static int addr_loopback(const struct in6_addr *a)
{
    return IN6_IS_ADDR_LOOPBACK(a) || (IN6_IS_ADDR_V4MAPPED(a) && a->s6_addr[12] == 127);
}

/* Whether a TCP connection's peer runs on this host: a loopback address, the address it reached
 * (a client on the node connecting to the node's own address gets that as its source), or one
 * of the host's interfaces' addresses (host_addrs_fresh), an IPv4 peer of a dual-stack listener
 * (v4-mapped) included. */
static int peer_on_host(kvt_srv_t *s, int fd)
{
    struct sockaddr_storage ps, ss;
    socklen_t pl = sizeof ps, sl = sizeof ss;
    struct in6_addr peer, self;
    if (getpeername(fd, (struct sockaddr *)&ps, &pl) < 0 ||
        getsockname(fd, (struct sockaddr *)&ss, &sl) < 0 ||
        !addr_v6((struct sockaddr *)&ps, &peer) || !addr_v6((struct sockaddr *)&ss, &self))
        return 0;
    if (addr_loopback(&peer) || IN6_ARE_ADDR_EQUAL(&peer, &self))
        return 1;
    host_addrs_fresh(s);
    for (size_t i = 0; i < s->clients.host_naddrs; i++)
        if (IN6_ARE_ADDR_EQUAL(&peer, &s->clients.host_addrs[i]))
            return 1;
    return 0;
}

/* The size socket-send-budget gives back to a connection once its share is over it: a Unix
 * socket's SO_SNDBUF as the kernel makes it (net.core.wmem_default). A TCP socket starts at
 * tcp_wmem's default instead and grows, so for a daemon with only TCP clients it is read off a
 * Unix socket made for the purpose. */
static int sndbuf_default(int fd, int tcp)
{
    int v = 0, u = -1;
    socklen_t len = sizeof v;
    if (tcp && (fd = u = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0)) < 0)
        return 0;
    if (getsockopt(fd, SOL_SOCKET, SO_SNDBUF, &v, &len) < 0)
        v = 0;
    if (u >= 0)
        close(u);
    return v;
}

/*
 * socket-turns: per event loop, only so many connections may have a reply too big for the
 * socket in the kernel at once. With 64 connections each pipelining 256 KiB GETs every socket
 * held its send buffer's worth (64 x 208 KiB), past the CPU caches, and each copy into and out
 * of it cost the server and its clients 10-15 % more per GET than at 8 connections; cutting the
 * buffers (socket-send-budget) took half of that and made each write smaller. With turns the
 * writes stay full size and only a few sockets hold bytes (docs/benchmarks.md, "Turns").
 *
 * A connection without a turn writes at once what is at most KVT_TURN_FREE bytes (a MATCH's,
 * a PING's, an error's reply: small replies do not wait behind big GETs); a bigger write, or a
 * small one the socket did not take whole, needs a turn. Without one free it waits in its
 * loop's queue, its socket without EPOLLOUT and its replies in kvtierd (max-output still
 * pauses its reads); waiting with an empty socket does not count against reply-timeout-ms. A
 * turn is kept until the connection's queue is all in the kernel (kvt__conn_kick), its socket
 * stalls while others wait (kvt__turns_step), or it closes, and goes to the first waiter, whose
 * EPOLLOUT is armed: its write is retried from its own event. Each loop grants its own turns (a
 * connection's writes are its loop's only), so no lock or cross-loop kick is needed. A TCP peer
 * on another host (KVT_SNDBUF_TUNED) is left out: its bytes leave by the network, at its pace.
 * With reply-timeout-ms 0 (a client that stops reading is never closed) turns are off.
 */
#define KVT_TURN_NONE 0
#define KVT_TURN_HELD 1
#define KVT_TURN_WAIT 2
#define KVT_TURN_FREE (64u << 10)

static uint32_t turns_max(const kvt_srv_t *s)
{
    const kvt_srv_conf_t *cf = s->conf;
    return cf->reply_timeout_ms ? cf->socket_turns : 0;
}

static void turnq_push(kvt__turnq_t *q, kvt__conn_t *c)
{
    c->turn_next = NULL;
    c->turn_prev = q->tail;
    if (q->tail)
        q->tail->turn_next = c;
    else
        q->head = c;
    q->tail = c;
    q->n++;
}

static void turnq_unlink(kvt__turnq_t *q, kvt__conn_t *c)
{
    if (c->turn_prev)
        c->turn_prev->turn_next = c->turn_next;
    else
        q->head = c->turn_next;
    if (c->turn_next)
        c->turn_next->turn_prev = c->turn_prev;
    else
        q->tail = c->turn_prev;
    c->turn_next = c->turn_prev = NULL;
    q->n--;
}

static void turn_hold(kvt__loop_t *l, kvt__conn_t *c)
{
    c->turn = KVT_TURN_HELD;
    c->turn_read = 0;
    c->turn_ms = (uint32_t)(kvt_now_ns() / 1000000);
    turnq_push(&l->turn_held, c);
}

/* A turn for c (which has none): 1 when it holds one, 0 when it waits. A waiter's
 * reply-timeout-ms clock runs only while its socket holds bytes it does not take (it gave its
 * turn on stalled, or a small write filled it): its EPOLLOUT, watched for then, stops it. */
static int turn_take(kvt__conn_t *c)
{
    kvt__loop_t *l = c->loop;
    if (l->turn_held.n < turns_max(c->srv)) {
        turn_hold(l, c);
        return 1;
    }
    c->turn = KVT_TURN_WAIT;
    turnq_push(&l->turn_wait, c);
    return 0;
}

/* The first waiters get the turns free (every waiter, with turns turned off meanwhile by a
 * reload); their EPOLLOUT is armed: each retries its write from its own event. */
static void turns_grant(kvt__loop_t *l)
{
    uint32_t max = turns_max(l->srv);
    while (l->turn_wait.head && (l->turn_held.n < max || max == 0)) {
        kvt__conn_t *w = l->turn_wait.head;
        turnq_unlink(&l->turn_wait, w);
        turn_hold(l, w);
        w->events |= EPOLLOUT;
        kvt__ev_ctl(l->epfd, EPOLL_CTL_MOD, &w->ev, w->events);
    }
}

/* c gives up its turn, or its place in the queue; a turn given up goes to the first waiter. */
static void turn_end(kvt__conn_t *c)
{
    kvt__loop_t *l = c->loop;
    if (c->turn == KVT_TURN_NONE)
        return;
    int held = c->turn == KVT_TURN_HELD;
    turnq_unlink(held ? &l->turn_held : &l->turn_wait, c);
    c->turn = KVT_TURN_NONE;
    if (held)
        turns_grant(l);
}

/* How long c, holding a turn, has left before it passes it on: 0 when its socket has taken
 * nothing for its slice, counted from when it got the turn at the earliest (one that gave it on
 * stalled and got it back has a whole slice again); UINT64_MAX while its socket takes bytes (an
 * event comes). The slice is socket-turn-stall-ms while its client has read none of this turn's
 * bytes (a client reading another connection first), KVT_TURN_SLICE_NS once it has (one that
 * reads, but lags: its thread not yet scheduled on a busy host, which a short slice would take
 * for a stall, and pass its turn on, and leave one more socket full). */
#define KVT_TURN_SLICE_NS (50ull * 1000000)

static uint64_t turn_left_ns(const kvt__conn_t *c, uint64_t now)
{
    if (c->stuck_ns == 0)
        return UINT64_MAX;
    uint64_t slice =
        c->turn_read ? KVT_TURN_SLICE_NS : (uint64_t)c->srv->conf->socket_turn_stall_ms * 1000000;
    uint64_t held = (uint64_t)((uint32_t)(now / 1000000) - c->turn_ms) * 1000000;
    uint64_t since = KVT_MIN(kvt_ns_since(now, c->stuck_ns), held);
    return since < slice ? slice - since : 0;
}

/*
 * A turn's holder whose socket has taken none of its bytes for socket-turn-stall-ms while others
 * wait (its client stopped reading, or reads another connection first: a client reading its
 * connections one after another would wait on itself until reply-timeout-ms) gives the turn to
 * the first waiter and waits at the back, its reply-timeout-ms clock running on. Such a socket
 * sends no event, and the waiter's client, blocked on a read, sends none either: each loop
 * looks at its holders after every wake (kvt__turns_step), and sleeps no longer than the first
 * of them has left. The check was at loop 0's tick (every tick-ms, 50 ms) with a slice of 50 ms:
 * a client reading its connections one after another waited up to a tick per handover
 * (docs/benchmarks.md, "Turns"). A reader that only lags (its thread not yet scheduled) costs
 * one handover: its socket keeps its bytes, and it gets a turn again at the head of the queue.
 */
int kvt__turns_step(kvt__loop_t *l)
{
    if (!l->turn_wait.head)
        return -1;
    turns_grant(l); /* turns a reload added (socket-turns raised) */
    uint64_t now = kvt_now_ns(), next = UINT64_MAX;
    kvt__conn_t *c = l->turn_held.head, *after;
    for (; c && l->turn_wait.head; c = after) {
        after = c->turn_next; /* c may go to the back of the queue */
        uint64_t left = turn_left_ns(c, now);
        if (left > 0) {
            next = KVT_MIN(next, left);
            continue;
        }
        turn_end(c);
        turn_take(c);
        kvt__metric_add(l->metrics ? l->metrics : l->srv->metrics, KVT_M_LOOP_SOCKET_TURN_STALLS,
                        l->id, 1);
    }
    return next == UINT64_MAX || !l->turn_wait.head ? -1 : (int)(next / 1000000) + 1;
}

void kvt__turns_reload(kvt_srv_t *s)
{
    for (unsigned i = 0; i < s->nloops; i++)
        if (s->loops[i].turn_wait.head)
            kvt__conn_kick(s->loops[i].turn_wait.head); /* wakes its loop: its step grants */
}

/* The queued reply bytes are summed here, at a scrape or a tick, rather than kept per loop: a
 * reply's bytes change its connection's out_bytes several times on their way (frames appended,
 * each write), and a loop-wide sum would add to every one of them. */
void kvt__loops_gauges(kvt_srv_t *s)
{
    for (unsigned i = 0; i < s->nloops; i++) {
        const kvt__loop_t *l = &s->loops[i];
        kvt__metric_set(s->metrics, KVT_M_LOOP_SOCKET_TURNS, i, l->turn_held.n);
        kvt__metric_set(s->metrics, KVT_M_LOOP_SOCKET_TURN_WAITERS, i, l->turn_wait.n);
        kvt__metric_set(s->metrics, KVT_M_LOOP_QUEUED_REQUESTS, i, l->queued);
        kvt__metric_set(s->metrics, KVT_M_LOOP_QUEUED_BYTES, i, 0);
    }
    for (const kvt__conn_t *c = s->clients.list; c; c = c->next)
        if (c->out_bytes)
            kvt__metric_add(s->metrics, KVT_M_LOOP_QUEUED_BYTES, c->loop->id, (double)c->out_bytes);
}

void kvt__conn_accept(kvt_srv_t *s, int lfd, int tcp)
{
    for (int k = 0; k < 64; k++) {
        int fd = kvt__accept(s, lfd, tcp ? "tcp" : "unix");
        if (fd < 0)
            return;
        uint64_t now = kvt_now_ns();
        if (s->stopping || (s->clients.n >= s->conf->max_conns && !conn_evict(s, now))) {
            kvt__metric_add(s->metrics, KVT_M_CONNECTIONS_REFUSED, 0, 1);
            static kvt_log_limit_t lim;
            kvt_log_limited(&lim, KVT_LOG_WARN, "kvtierd: refusing a connection: %s",
                            s->stopping ? "shutting down" : "max-conns reached");
            close(fd);
            continue;
        }
        kvt__conn_t *c = calloc(1, sizeof *c);
        if (!c) {
            close(fd);
            continue;
        }
        kvt__loop_t *l = kvt__loop_pick(s);
        if (tcp) {
            int one = 1;
            setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
            /* A peer across a network keeps the kernel's tuning: see sndbuf_fit. */
            if (!peer_on_host(s, fd))
                c->sndbuf_log = KVT_SNDBUF_TUNED;
        }
        if (s->clients.sndbuf_default == 0)
            s->clients.sndbuf_default = sndbuf_default(fd, tcp);
        c->ev.fd = fd;
        c->ev.cb = conn_on_event;
        c->ev.shared = 1;
        c->srv = s;
        c->loop = l;
        c->id = s->clients.next_id++;
        c->tcp = tcp;
        c->authed = !*s->conf->secret;
        c->events = EPOLLIN;
        c->born_ns = c->rx_ns = c->mark_ns = now;
        if (kvt__ev_ctl(l->epfd, EPOLL_CTL_ADD, &c->ev, c->events) < 0) {
            close(fd);
            free(c);
            continue;
        }
        c->next = s->clients.list;
        if (s->clients.list)
            s->clients.list->prev = c;
        s->clients.list = c;
        s->clients.n++;
        l->conns++;
        kvt__metric_add(s->metrics, KVT_M_CONNECTIONS_ACCEPTED, 0, 1);
        kvt__metric_set(s->metrics, KVT_M_CONNECTIONS, 0, s->clients.n);
        kvt__metric_set(s->metrics, KVT_M_LOOP_CONNECTIONS, l->id, l->conns);
        kvt_log(KVT_LOG_DEBUG, "kvtierd: connection %llu (%s)", (unsigned long long)c->id,
                tcp ? "tcp" : "unix");
    }
}

/* r's payload goes (r is done with it): kept for the next big frame, or freed. */
static void held_release(kvt__req_t *r)
{
    if (r->held) {
        kvt__clients_t *cl = &r->srv->clients;
        cl->bytes -= r->held_bytes;
        if (r->conn && r->held_bytes > KVT_IN_BASE &&
            cl->bytes + r->held_bytes < r->srv->conf->max_client_bytes) {
            spare_drop(r->srv); /* the newest is kept: the next big frame is most like it */
            cl->kept = r->held; /* for the next big frame (spare_take) */
            cl->kept_bytes = r->held_bytes;
        } else {
            free(r->held);
        }
        r->held = r->payload = NULL;
        r->held_bytes = 0;
    }
}

void kvt__req_free(kvt__req_t *r)
{
    kvt_assert(!r->src); /* a reply source gave back what it held (its abort, or its end) */
    held_release(r);
    if (r->ns_held)
        kvt__ns_unuse(r->srv, r->ns);
    if (r->has_fd)
        close(r->pass_fd);
    free(r->extra);
    if (r->out != r->out_inline)
        free(r->out);
    free(r);
}

kvt__handle_t *kvt__conn_handles(kvt__conn_t *c)
{
    if (!c->handles)
        c->handles = calloc(KVT_MATCH_HANDLES, sizeof *c->handles);
    return c->handles;
}

void kvt__req_ns(kvt__req_t *r, uint32_t ns)
{
    if (r->ns_held)
        kvt__ns_unuse(r->srv, r->ns);
    r->ns = ns;
    r->ns_held = 1;
    kvt__ns_use(r->srv, ns);
}

void kvt__conn_close(kvt__conn_t *c)
{
    kvt_srv_t *s = c->srv;
    if (c->gone)
        return;
    if (s->loops_running && kvt__loop_self() != c->loop) {
        c->dead = 1; /* its loop may be in its socket's read or write: it closes it */
        kvt__loop_post(c);
        return;
    }
    turn_end(c);
    s->conn_ops->closing(c);
    kvt__req_t *r = c->head;
    while (r) {
        kvt__req_t *next = r->next;
        r->next = NULL;
        c->loop->queued -= r->replies;
        if (r->pending > 0) {
            r->conn = NULL; /* an orphan: frees itself when its I/O completes */
        } else {
            if (r->src && !r->done)
                r->src->abort(r); /* a GET's batch waiting for the socket, say */
            if (r->lease)         /* a PREFETCH waiting for others' moves still pins its path */
                kvt__path_unpin(s, r->lease);
            kvt__req_free(r);
        }
        r = next;
    }
    c->head = c->tail = NULL;
    if (c->hello)
        kvt__ns_unuse(s, c->ns);
    mem_wait_end(c);
    /* MATCHes' kept tokens (op_match.c) go with the connection: freed here, below op_match.c. */
    if (c->handles) {
        for (int i = 0; i < KVT_MATCH_HANDLES; i++)
            free(c->handles[i].tokens);
        free(c->handles);
        c->handles = NULL;
    }
    s->clients.bytes -= c->handle_bytes;
    c->handle_bytes = 0;
    s->clients.bytes -= in_counted(c->in_cap) + c->out_bytes + c->tokens_cap * sizeof(uint32_t);
    kvt__ev_ctl(c->loop->epfd, EPOLL_CTL_DEL, &c->ev, 0);
    close(c->ev.fd);
    if (c->prev)
        c->prev->next = c->next;
    else
        s->clients.list = c->next;
    if (c->next)
        c->next->prev = c->prev;
    s->clients.n--;
    c->loop->conns--;
    kvt__metric_set(s->metrics, KVT_M_LOOP_CONNECTIONS, c->loop->id, c->loop->conns);
    if (s->clients.n == 0)
        spare_drop(s); /* nobody left to send a big frame; and none leaks at shutdown */
    kvt__metric_set(s->metrics, KVT_M_CONNECTIONS, 0, s->clients.n);
    kvt_log(KVT_LOG_DEBUG, "kvtierd: connection %llu closed", (unsigned long long)c->id);
    free(c->in);
    free(c->leases);
    free(c->tokens);
    c->in = NULL;
    c->leases = NULL;
    c->tokens = NULL;
    c->in_len = c->in_cap = c->nleases = c->cap_leases = c->tokens_cap = 0;
    c->gone = 1;
    c->gone_next = c->loop->gone;
    c->loop->gone = c;
}

void kvt__conns_reap(kvt__loop_t *l)
{
    /* A closed connection may still be on the posted list: the list is emptied first (a gone
     * one's kick does nothing), with no let-go of the lock between it and the frees. */
    for (;;) {
        while (l->posted) {
            kvt__conn_t *c = l->posted;
            l->posted = c->posted_next;
            c->posted_next = NULL;
            c->posted = 0;
            l->top = c;
            kvt__conn_kick(c);
            l->top = NULL;
            /* The kick may have gone back to shared (conn_frames): the list is other loops' to
             * write under the write lock. */
            kvt__loop_hold(l, KVT_HELD_WRITE);
        }
        if (!l->gone)
            return;
        while (l->gone && !l->posted) {
            kvt__conn_t *c = l->gone;
            l->gone = c->gone_next;
            free(c);
        }
    }
}

static int queue_plain(const kvt__conn_t *c);

/* Other loops write the posted list only under the write lock, which no shared holder shares, so
 * its owner may take from it shared. Each connection is taken from the head, so that what a writer
 * posts meanwhile (the kick's socket write lets the lock go) is kicked too; one that may not be
 * kicked shared (closed, or something in its queue that needs the write lock: queue_plain) is set
 * aside, looked at once, and put back for the reap: one pass over the list. */
void kvt__posted_shared(kvt__loop_t *l)
{
    kvt__conn_t *aside = NULL, **tail = &aside;
    while (l->held == KVT_HELD_SHARED && l->posted) {
        kvt__conn_t *c = l->posted;
        l->posted = c->posted_next;
        c->posted_next = NULL;
        if (c->dead || c->closing || c->gone || !queue_plain(c)) {
            *tail = c; /* still marked posted: no one links it elsewhere meanwhile */
            tail = &c->posted_next;
            continue;
        }
        c->posted = 0;
        l->top = c;
        kvt__conn_kick(c);
        l->top = NULL;
    }
    *tail = l->posted; /* held shared or for writing: no writer runs */
    l->posted = aside;
}

/* A reply starts in the request's own out_inline, and moves to the heap only when it outgrows it
 * (a long MATCH, a pipeline's replies sharing one buffer): a one-page GET's 64 bytes of frames
 * took a 4 KiB buffer of their own before, 512 of them at 64 connections x 8 in flight, each in
 * the same cache sets (page-aligned) as the others' (docs/architecture.md, "Connections"). */
int kvt__req_out_reserve(kvt__req_t *r, size_t need)
{
    if (need <= r->out_cap)
        return 0;
    if (r->out != r->out_inline)
        return kvt_reserve(&r->out, &r->out_cap, need, 1, 4096);
    uint8_t *p = NULL; /* the first heap buffer: sized as kvt_reserve grows any, then filled */
    size_t cap = 0;
    if (kvt_reserve(&p, &cap, need, 1, 4096) < 0)
        return KVT_ENOMEM;
    memcpy(p, r->out, r->out_len);
    r->out = p;
    r->out_cap = cap;
    return 0;
}

int kvt__req_append(kvt__req_t *r, const void *p, size_t len)
{
    if (r->out_off > 0 && r->out_off == r->out_len) {
        r->out_off = r->out_len = 0;
    }
    if (kvt__req_out_reserve(r, r->out_len + len) < 0)
        return KVT_ENOMEM;
    memcpy(r->out + r->out_len, p, len);
    r->out_len += len;
    if (r->conn)
        kvt__out_add(r->conn, (int64_t)len);
    return 0;
}

int kvt__req_reply(kvt__req_t *r, const void *body, uint32_t len)
{
    uint8_t hdr[KVT_PROTO_HDR];
    kvt_proto_frame(hdr, r->op | KVT_OP_REPLY, 0, r->id, r->status, len);
    if (!r->conn)
        return 0; /* an orphan: nobody to answer */
    if (kvt__req_append(r, hdr, sizeof hdr) < 0 || (len && kvt__req_append(r, body, len) < 0)) {
        r->conn->dead = 1; /* a reply lost would break the order of the rest */
        return KVT_ENOMEM;
    }
    return 0;
}

int kvt__req_hold(kvt__req_t *r, const void *src, size_t bytes)
{
    void *p = malloc(bytes ? bytes : 1);
    if (!p)
        return KVT_ENOMEM;
    memcpy(p, src, bytes);
    r->held = r->payload = p;
    r->held_bytes = bytes;
    r->srv->clients.bytes += bytes;
    return 0;
}

void *kvt__conn_take_frame(kvt__conn_t *c, const uint8_t *body, uint32_t body_len, size_t *bytes)
{
    if (c->in_cap <= KVT_IN_BASE || body != c->in + KVT_PROTO_HDR ||
        c->in_len != KVT_PROTO_HDR + (size_t)body_len)
        return NULL;
    void *p = c->in;
    /* Counted whole from now on: the base part is no longer the connection's. */
    c->srv->clients.bytes += c->in_cap - in_counted(c->in_cap);
    *bytes = c->in_cap;
    c->in = NULL;
    c->in_len = c->in_cap = 0;
    return p;
}

kvt__req_t *kvt__req_new(kvt__conn_t *c, kvt__req_kind_t kind, uint8_t op, uint64_t id, uint64_t t0)
{
    kvt__req_t *r = malloc(sizeof *r);
    if (!r)
        return NULL;
    memset(r, 0, offsetof(kvt__req_t, get_slot_inline)); /* the rest is written before read */
    r->conn = c;
    r->srv = c->srv;
    r->out = r->out_inline;
    r->out_cap = sizeof r->out_inline;
    r->kind = kind;
    r->op = op;
    r->id = id;
    r->t0 = t0;
    r->replies = 1;
    c->loop->queued++;
    if (c->tail)
        c->tail->next = r;
    else
        c->head = r;
    c->tail = r;
    return r;
}

static void count_reply(kvt__conn_t *c, uint8_t op, uint64_t t0, int status)
{
    if (op == 0 || op >= KVT_OP_COUNT)
        return;
    /* The loop's own table (merged on scrape): a MATCH answered under the lock shared counts
     * while other loops count theirs. */
    kvt_metrics_t *mt = c->loop->metrics ? c->loop->metrics : c->srv->metrics;
    kvt__metric_add(mt, KVT_M_LOOP_REQUESTS, c->loop->id, 1);
    kvt__metric_add(mt, KVT_M_REQUESTS, op, 1);
    if (status < 0)
        kvt__metric_add(mt, KVT_M_REQUEST_ERRORS, op, 1);
    kvt__metric_observe(mt, KVT_M_REQUEST_SECONDS, op, kvt_now_ns() - t0);
}

int kvt__reply(kvt__conn_t *c, uint8_t op, uint64_t id, uint64_t t0, int status, const void *body,
               uint32_t len)
{
    count_reply(c, op, t0, status);
    /* Replies answered at once share the tail's buffer when it is complete, so that a pipeline
     * of small requests leaves in one write; not while that buffer may be in a write. */
    kvt__req_t *r = c->tail;
    if (!r || !r->done || r->kind != KVT_REQ_PLAIN || c->writing) {
        r = kvt__req_new(c, KVT_REQ_PLAIN, op, id, t0);
        if (!r)
            return KVT_ENOMEM;
        r->done = 1;
    } else {
        r->replies++;
        c->loop->queued++;
    }
    uint8_t hdr[KVT_PROTO_HDR];
    kvt_proto_frame(hdr, op | KVT_OP_REPLY, 0, id, status, len);
    if (kvt__req_append(r, hdr, sizeof hdr) < 0 || (len && kvt__req_append(r, body, len) < 0))
        return KVT_ENOMEM;
    return 0;
}

int kvt__reply_error(kvt__conn_t *c, uint8_t op, uint64_t id, uint64_t t0, int status,
                     const char *fmt, ...)
{
    char msg[KVT_PROTO_ERRMSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (n < 0)
        n = 0;
    if ((size_t)n >= sizeof msg)
        n = sizeof msg - 1;
    /* Not found and busy are answers a client asks for by the thousand (REMOVE of what was
     * evicted, RELEASE of an expired lease): debug only; kvtier_request_errors_total counts them.
     * The rest are worth a line at the default level. */
    int level = status == KVT_ENOENT || status == KVT_EBUSY ? KVT_LOG_DEBUG : KVT_LOG_INFO;
    /* A client can make every request an error: log-rate lines a second per operation, so that
     * one flooding one kind does not hide the others (the rest are counted). */
    static kvt_log_limit_t lim[KVT_OP_COUNT + 1];
    kvt_log_limited(&lim[op < KVT_OP_COUNT ? op : KVT_OP_COUNT], level,
                    "kvtierd: connection %llu: %s request %llu: %s (%s)", (unsigned long long)c->id,
                    kvt_proto_op_name(op) ? kvt_proto_op_name(op) : "unknown",
                    (unsigned long long)id, msg, kvt_strerror(status));
    return kvt__reply(c, op, id, t0, status, msg, (uint32_t)n);
}

void kvt__req_finish(kvt__req_t *r)
{
    if (!r->conn) {
        if (r->pending == 0)
            kvt__req_free(r);
        return;
    }
    if (!r->done)
        kvt__req_count(r);
    r->done = 1;
    kvt__conn_kick(r->conn);
}

void kvt__req_count(kvt__req_t *r)
{
    if (r->counted || !r->conn)
        return;
    r->counted = 1;
    count_reply(r->conn, r->op, r->t0, r->status);
}

/* Lets s->lock go for c's socket I/O where that is safe (the file's opening paragraph): c's own
 * event or posted kick at the top of its loop, with other loops to run meanwhile. Returns how the
 * loop held it (KVT_HELD_NONE: it was not let go); kvt__conn_relock takes it back so. */
int kvt__conn_unlock(kvt__conn_t *c)
{
    kvt__loop_t *l = c->loop;
    int held = l->held;
    if (!c->srv->loops_running || l->top != c)
        return KVT_HELD_NONE;
    kvt__loop_hold(l, KVT_HELD_NONE);
    return held;
}

void kvt__conn_relock(kvt__conn_t *c, int held)
{
    if (held != KVT_HELD_NONE)
        kvt__loop_hold(c->loop, held);
}

/* A GET planned under the shared lock whose batch is still being read: its source offers nothing
 * until the reads are done (get_iov), so a write of c's queue stops there. */
static int reading_shared(const kvt__req_t *r)
{
    return r->pending && r->src && r->src->shares && r->src->shares(r);
}

/*
 * Whether every request in c's queue that a write can reach now is a finished plain reply
 * (MATCH's, PING's, an error's), or a GET planned under the shared lock (its source shares, or it
 * is done with it): nothing in it then is anyone's but c's and its loop's, and it may be written,
 * and freed, with s->lock shared. The write stops at a GET planned shared that is still reading
 * (reading_shared), and touches nothing past it: that part is not looked at, so that a pipeline
 * of such GETs sends the finished ones at its front shared while the later ones read. The GET
 * itself is only read there (pending, its batch's state): its completion, on loop 0, writes it,
 * c's counts and the posted list only under the write lock, which no shared holder shares. When
 * the lock is let go for a socket write that completion may come meanwhile and open the way past
 * it, so conn_write looks again before each write.
 */
static int queue_plain(const kvt__conn_t *c)
{
    for (const kvt__req_t *r = c->head; r; r = r->next) {
        if (reading_shared(r))
            return 1;
        if (r->has_fd || r->pending || r->held || r->ns_held)
            return 0;
        if (r->src ? !r->src->shares || !r->src->shares(r)
                   : !r->done || (r->kind != KVT_REQ_PLAIN && r->kind != KVT_REQ_GET))
            return 0;
    }
    return 1;
}

/* writev with r's descriptor attached (SCM_RIGHTS), given up once a byte has gone with it. */
static ssize_t send_fd(int sock, struct iovec *iov, int n, kvt__req_t *r)
{
    union {
        struct cmsghdr h;
        char buf[CMSG_SPACE(sizeof(int))];
    } ctl;
    memset(&ctl, 0, sizeof ctl);
    struct msghdr m = {
        .msg_iov = iov,
        .msg_iovlen = (size_t)n,
        .msg_control = ctl.buf,
        .msg_controllen = sizeof ctl.buf,
    };
    struct cmsghdr *cm = CMSG_FIRSTHDR(&m);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(cm), &r->pass_fd, sizeof(int));
    ssize_t w = sendmsg(sock, &m, MSG_NOSIGNAL);
    if (w > 0) {
        close(r->pass_fd);
        r->has_fd = 0;
        r->conn->fd_queued = 0;
    }
    return w;
}

/* Writes from the head of the queue as far as the socket takes it. Returns 0 or -1 when the
 * connection is broken. */
/*
 * socket-send-budget: a Unix socket's send buffer, or a TCP one's whose peer is on this host, is
 * cut to its share of the budget once there are so many connections that their default buffers
 * would hold more. With 64 connections each pipelining 256 KiB GETs, the replies the kernel held
 * (64 x 208 KiB) were past the CPU caches, and every copy into and out of them cost the server,
 * the raw one-thread server as much, 10-15 % more per GET than at 8 connections
 * (docs/benchmarks.md, "8 -> 64 connections"). A power of two, so that a connection count that
 * moves by a few does not reset every socket; applied at the connection's next write (one
 * compare when nothing changes). A TCP socket's buffer grows
 * with its traffic (tcp_wmem) until SO_SNDBUF is set, and the kernel keeps it fixed after: a
 * peer across a network needs its bandwidth times its round trip, so it keeps the tuning. Over
 * loopback (a sidecar's engine talking TCP to kvtierd on its node) the buffers only hold the
 * copies between two processes, as a Unix socket's do; once cut, such a socket gets the Unix
 * default back, not the tuning.
 */
#define KVT_SNDBUF_MIN_LOG 16 /* 64 KiB: smaller writes cost more calls than the cache saves */

static void sndbuf_fit(kvt__conn_t *c)
{
    const kvt_srv_t *s = c->srv;
    uint64_t budget = s->conf->sock_send_budget, def = (uint64_t)s->clients.sndbuf_default;
    if (def == 0 || c->sndbuf_log == KVT_SNDBUF_TUNED || (budget == 0 && c->sndbuf_log == 0))
        return;
    /* With turns the sockets keep the kernel's default: the few with bytes in the kernel write
     * full size (a socket cut before turns came on, by a reload, gets it back). */
    if (turns_max(s))
        budget = 0;
    uint64_t share = budget / KVT_MAX(s->clients.n, 1u);
    uint8_t want = 0; /* the kernel's default */
    if (budget && share < def) {
        want = KVT_SNDBUF_MIN_LOG;
        while (want < 30 && (2ull << want) <= share)
            want++;
        if ((1ull << want) >= def)
            want = 0;
    }
    if (want == c->sndbuf_log)
        return;
    /* The kernel doubles what it is given (its own bookkeeping): half, so that it holds this. */
    int v = (int)((want ? 1ull << want : def) / 2);
    if (setsockopt(c->ev.fd, SOL_SOCKET, SO_SNDBUF, &v, sizeof v) == 0)
        c->sndbuf_log = want;
}

/*
 * The head of c's queue, its reply all written, leaves it. One still waiting on I/O (PREFETCH
 * answered at its deadline) goes on as an orphan and frees itself; its I/O no longer counts
 * against the connection (which its completions, seeing no connection, would never give back: 64
 * such PREFETCHes used to leave the connection unread for good).
 */
static void queue_pop(kvt__conn_t *c)
{
    kvt__req_t *r = c->head;
    c->head = r->next;
    if (!c->head)
        c->tail = NULL;
    r->next = NULL;
    c->loop->queued -= r->replies;
    if (r->pending == 0) {
        kvt__req_free(r);
    } else {
        kvt_assert(c->inflight >= r->pending);
        c->inflight -= r->pending;
        r->conn = NULL;
    }
}

/*
 * Whether c's queue may be written with the lock as c's loop holds it: with the lock shared only
 * finished plain replies are written (queue_plain; a source's hooks, a payload given back, a
 * descriptor: the write lock's), and the write lock is taken for the rest. 0 when none of the
 * queue can go: a head waiting on its I/O, with nothing out yet (a PUT before a run of MATCHes,
 * a write-path GET whose batch is being read), whose completion kicks c.
 */
static int write_hold(kvt__conn_t *c)
{
    if (c->loop->held != KVT_HELD_SHARED || queue_plain(c))
        return 1;
    const kvt__req_t *r = c->head;
    if (!r->done && (!r->src || r->pending) && !r->has_fd && r->out_off == r->out_len)
        return 0;
    kvt__loop_hold(c->loop, KVT_HELD_WRITE);
    return 1;
}

static int conn_write(kvt__conn_t *c)
{
    if (c->turn == KVT_TURN_WAIT)
        return 0; /* its turn arms EPOLLOUT */
    if (c->head)
        sndbuf_fit(c);
    while (c->head) {
        /* Before each write: the one before may have let the lock go (kvt__conn_unlock), and what a
         * completion finished meanwhile may be the write lock's (queue_plain). */
        if (!write_hold(c))
            return 0;
        struct iovec iov[KVT_IOV_MAX];
        int n = 0;
        kvt__req_t *fd_req = NULL, *last = NULL;
        /* Every byte offered is a finished reply's, or a source's that its owner alone changes
         * (apart), and no other loop touches any of it any more. */
        int quiet = 1;
        for (kvt__req_t *r = c->head; r && n < KVT_IOV_MAX; r = r->next) {
            last = r;
            if (r->pending || r->has_fd || (r->src ? !r->src->apart(r) : !r->done))
                quiet = 0;
            if (r->has_fd) {
                /* A descriptor goes with its reply's first byte, in a write of its own that
                 * starts there: the client reads that reply with recvmsg. */
                if (n > 0)
                    break;
                fd_req = r;
            }
            if (r->src) {
                /* What it has ready; the replies after it too when that is the whole rest of
                 * its reply (a GET's last batch with its final frame): a pipeline of GETs then
                 * leaves in one writev instead of one each (over TCP each write is a push
                 * through the loopback, docs/benchmarks.md). */
                int k = r->src->iov(r, iov + n, KVT_IOV_MAX - n);
                n += k;
                if (k == 0 || !r->src->ends(r, k))
                    break;
                continue;
            }
            if (r->out_len > r->out_off) {
                iov[n].iov_base = r->out + r->out_off;
                iov[n].iov_len = r->out_len - r->out_off;
                n++;
            }
            if (!r->done)
                break;
        }
        if (n == 0) {
            kvt__req_t *r = c->head;
            if (r && r->src && r->src->drained(r))
                continue; /* its next part, or its final frame, is there now */
            if (r && r->done && !r->src && !r->has_fd && r->out_off == r->out_len) {
                queue_pop(c); /* a GET whose final frame went with its last batch */
                continue;
            }
            break;
        }
        size_t total = 0;
        for (int i = 0; i < n; i++)
            total += iov[i].iov_len;
        int turns =
            c->turn == KVT_TURN_NONE && c->sndbuf_log != KVT_SNDBUF_TUNED && turns_max(c->srv);
        if (turns && total > KVT_TURN_FREE && !turn_take(c))
            return 0;
        ssize_t w;
        int unlocked = 0, early = 0;
        /* Counted before the call, under the lock: a write made with the lock let go may reach
         * the client, and its scrape another loop, before this loop takes the lock back. */
        kvt__metric_add(c->loop->metrics ? c->loop->metrics : c->srv->metrics, KVT_M_SOCKET_WRITES,
                        0, 1);
        if (fd_req) {
            w = send_fd(c->ev.fd, iov, n, fd_req);
        } else {
            /* Written with the lock let go, the replies count as gone from the start: a client
             * that has its reply may ask another loop (STATS) before this one takes the lock
             * back, and must find neither the reply's bytes nor its request's payload held. */
            /* So do the answered requests among them in the loop's queue (a GET's with its final
             * frame in this write counted as answered already: get_send); they count again
             * once the lock is back, and leave as the bytes that went say. */
            uint32_t answered = 0;
            if (quiet && c->loop->top == c && c->srv->loops_running) {
                for (kvt__req_t *r = c->head; r; r = r == last ? NULL : r->next) {
                    if (r->done)
                        held_release(r);
                    if (r->done || r->counted)
                        answered += r->replies;
                }
                kvt__out_add(c, -(int64_t)total);
                c->loop->queued -= answered;
                c->writing = early = 1;
                unlocked = kvt__conn_unlock(c);
            }
            w = writev(c->ev.fd, iov, n);
            int err = errno;
            if (early) {
                kvt__conn_relock(c, unlocked);
                c->writing = 0;
                c->loop->queued += answered;
                kvt__out_add(c, (int64_t)total - (w > 0 ? w : 0)); /* what did not go */
            }
            errno = err;
        }
        if (w < 0) {
            if (errno != EAGAIN && errno != EINTR)
                return -1;
            if (errno == EAGAIN && c->stuck_ns == 0)
                c->stuck_ns = kvt_now_ns(); /* the tick closes it if this lasts (reply-timeout) */
            if (errno == EAGAIN && turns && c->turn == KVT_TURN_NONE)
                turn_take(c); /* a small write the socket had no room for */
            return 0;
        }
        c->stuck_ns = 0;
        if (!early)
            kvt__out_add(c, -(int64_t)w);
        size_t left = (size_t)w;
        for (;;) {
            kvt__req_t *r = c->head;
            if (!r)
                break;
            if (r->src) {
                left = r->src->wrote(r, left);
                if (left == 0)
                    break; /* when all it offered is out, drained (at the top of the loop) says
                              more */
                /* The write went past it: its whole reply is out, and it ends now. */
                r->src->drained(r);
                kvt_assert(!r->src && r->done);
            }
            size_t take = KVT_MIN(r->out_len - r->out_off, left);
            r->out_off += take;
            left -= take;
            if (r->out_off < r->out_len || !r->done)
                break;
            queue_pop(c);
        }
        if ((size_t)w < total) {
            /* The socket is full: from now it takes none until its EPOLLOUT, which may never
             * come (a client that stopped reading): reply-timeout-ms and kvt__turns_step count from
             * here. */
            c->stuck_ns = kvt_now_ns();
            if (turns && c->turn == KVT_TURN_NONE)
                turn_take(c); /* a small write the socket took part of: the rest needs a turn */
            return 0;
        }
    }
    return 0;
}

/* The frame whose header starts at off in c's input (at least a header's bytes there): 1 when
 * the whole frame is in, 0 when its body is not yet, or kvt_proto_hdr_check's error. */
static int frame_at(const kvt__conn_t *c, size_t off, kvt_proto_hdr_t *h)
{
    kvt_proto_hdr_decode(c->in + off, h);
    int rc = kvt_proto_hdr_check(h, (uint32_t)c->srv->conf->max_frame);
    if (rc < 0)
        return rc;
    return c->in_len - off - KVT_PROTO_HDR >= h->body_len;
}

/* After a frame: a token scratch grown past KVT_TOKENS_KEEP by a long prompt goes back (counted
 * as the lock held allows: kvt__clients_add). */
static void tokens_trim(kvt__conn_t *c)
{
    if (c->tokens_cap <= KVT_TOKENS_KEEP)
        return;
    kvt__clients_add(c, -(int64_t)(c->tokens_cap * sizeof(uint32_t)));
    free(c->tokens);
    c->tokens = NULL;
    c->tokens_cap = 0;
}

/* Whether the loop, holding the lock for writing in c's framing, may let it go and take it back
 * shared for the frame at the front (h, whole): c's own event or kick at the top of its loop
 * (nothing half done, as for its socket I/O), and a frame the shared path answers. */
static int may_share(const kvt__conn_t *c, const kvt_proto_hdr_t *h)
{
    const kvt__conn_ops_t *ops = c->srv->conn_ops;
    return c->srv->loops_running && c->loop->top == c && c->loop->held == KVT_HELD_WRITE &&
           c->authed && ops->shared && ops->shares && ops->shares(h);
}

/* Hands every whole frame in the input buffer to the handlers, while the connection is allowed
 * more work. With share, it stops after a frame it handled when the next one may be answered
 * under the lock shared (may_share), and returns 1: conn_frames goes back to shared for it.
 * Returns 0 otherwise. */
static int conn_parse(kvt__conn_t *c, int share)
{
    kvt_srv_t *s = c->srv;
    size_t off = 0;
    int handled = 0, stop = 0;
    s->conn_ops->batch(c, c->in, c->in_len);
    while (!c->closing && !c->dead && c->in_len - off >= KVT_PROTO_HDR) {
        if (conn_held(c)) {
            if (c->inflight >= s->conf->max_inflight)
                break; /* their completions kick the connection */
            /* The replies of the frames before may leave at once. If they do, this frame goes
             * on: stopping here would leave it waiting for an event that may never come (its
             * client, having sent all it has, waits for these very replies). If they do not,
             * the socket's EPOLLOUT kicks the connection when they can. */
            if (conn_write(c) < 0) {
                c->dead = 1;
                break;
            }
            if (conn_held(c))
                break;
        }
        kvt_proto_hdr_t h;
        int rc = frame_at(c, off, &h);
        if (rc < 0) {
            /* The framing cannot be trusted past this header: answer and close. */
            kvt_proto_err_t kind = rc == KVT_ETOOBIG            ? KVT_PERR_TOO_BIG
                                   : h.magic != KVT_PROTO_MAGIC ? KVT_PERR_BAD_MAGIC
                                                                : KVT_PERR_BAD_VERSION;
            kvt__proto_error(s, kind);
            if (rc == KVT_ETOOBIG)
                kvt__reply_error(c, h.opcode, h.request_id, kvt_now_ns(), rc,
                                 "frame body of %u bytes is over max-frame (%llu)", h.body_len,
                                 (unsigned long long)s->conf->max_frame);
            else if (h.magic != KVT_PROTO_MAGIC)
                kvt__reply_error(c, 0, h.request_id, kvt_now_ns(), KVT_EPROTO, "bad magic 0x%08x",
                                 h.magic);
            else
                kvt__reply_error(c, h.opcode, h.request_id, kvt_now_ns(), KVT_EPROTO,
                                 "unsupported protocol version %u (this server speaks %u)",
                                 h.version, KVT_PROTO_VERSION);
            c->closing = 1;
            break;
        }
        size_t frame = KVT_PROTO_HDR + (size_t)h.body_len;
        if (rc == 0)
            break; /* the rest of it is still to come */
        if (share && handled && may_share(c, &h)) {
            stop = 1;
            break;
        }
        c->frames++;
        handled = 1;
        if (s->conn_ops->frame(c, &h, c->in + off + KVT_PROTO_HDR) < 0)
            c->closing = 1;
        if (!c->in) { /* a PUT took the buffer with its frame (kvt__conn_take_frame) */
            off = 0;
            break;
        }
        off += frame;
        tokens_trim(c);
    }
    if (off > 0) {
        memmove(c->in, c->in + off, c->in_len - off);
        c->in_len -= off;
    }
    if (c->dead || c->closing)
        return 0;
    /* The frame at the front, whole or not, handled later. */
    kvt_proto_hdr_t h;
    size_t want = c->in_len >= KVT_PROTO_HDR && frame_at(c, 0, &h) >= 0
                      ? KVT_PROTO_HDR + (size_t)h.body_len
                      : 0;
    if (want > c->in_cap) {
        /* A frame bigger than the buffer: a buffer of its size, if the clients' memory has room
         * for it; else the connection waits (unread) until it has (kvt__conns_mem_retry). */
        size_t base = KVT_MAX(c->in_cap, (size_t)KVT_IN_BASE);
        size_t grow = want > base ? want - base : 0; /* counted beyond the base buffer */
        if (s->clients.bytes + grow > s->conf->max_client_bytes) {
            spare_drop(s); /* its memory is worth more to the frames that wait */
            if (!c->mem_wait) {
                c->mem_wait = 1;
                s->clients.mem_waiting++;
                kvt__metric_add(s->metrics, KVT_M_CLIENT_MEMORY_WAITS, 0, 1);
                static kvt_log_limit_t lim;
                kvt_log_limited(&lim, KVT_LOG_INFO,
                                "kvtierd: connection %llu waits for max-client-bytes (%llu of "
                                "%llu held) to take a frame of %zu bytes",
                                (unsigned long long)c->id, (unsigned long long)s->clients.bytes,
                                (unsigned long long)s->conf->max_client_bytes, want);
            }
            c->mem_need = grow;
        } else {
            mem_wait_end(c);
            if (!spare_take(c, want) && in_resize(c, want) < 0)
                c->dead = 1;
        }
    } else if (c->in_cap > KVT_IN_BASE && want <= KVT_IN_BASE && c->in_len <= KVT_IN_BASE) {
        /* The big frame is handled: back to the base buffer. */
        if (in_resize(c, KVT_IN_BASE) < 0)
            c->dead = 1;
    }
    return stop && !c->dead;
}

/* Under s->lock shared: the run of whole frames at the front of c's input that the operations
 * answer there (kvt__conn_ops_t.shared: a MATCH, a GET, a RELEASE), all in this one hold. It stops
 * at the first frame that needs the write lock, one not whole or with a bad header (conn_parse's
 * business), and at back-pressure. What it writes is c's (its input, its frame count, its queue),
 * its loop's (the metric table, the deferred hits and clients' memory) or nobody's: the only
 * others who read c's fields (loop 0's tick and completions) hold the lock for writing. Returns
 * how many frames it answered. */
static size_t conn_parse_shared(kvt__conn_t *c)
{
    kvt_srv_t *s = c->srv;
    size_t off = 0, n = 0;
    if (!s->conn_ops->shared)
        return 0;
    s->conn_ops->batch(c, c->in, c->in_len);
    while (!c->closing && !c->dead && c->in_len - off >= KVT_PROTO_HDR && !conn_held(c)) {
        kvt_proto_hdr_t h;
        if (frame_at(c, off, &h) <= 0 || !s->conn_ops->shared(c, &h, c->in + off + KVT_PROTO_HDR))
            break;
        c->frames++;
        n++;
        off += KVT_PROTO_HDR + (size_t)h.body_len;
        tokens_trim(c);
    }
    if (off > 0) {
        memmove(c->in, c->in + off, c->in_len - off);
        c->in_len -= off;
    }
    return n;
}

/* Whether conn_parse would do nothing with c's input now: no whole frame at the front (a part of
 * one that fits the buffer), and no buffer to grow or give back. */
static int parse_idle(const kvt__conn_t *c)
{
    if (c->closing || c->dead)
        return 1;
    size_t want = 0;
    if (c->in_len >= KVT_PROTO_HDR) {
        kvt_proto_hdr_t h;
        if (frame_at(c, 0, &h) != 0)
            return 0; /* a whole frame, or a header to answer and close on */
        want = KVT_PROTO_HDR + (size_t)h.body_len;
    }
    if (want > c->in_cap)
        return 0;
    return !(c->in_cap > KVT_IN_BASE && want <= KVT_IN_BASE && c->in_len <= KVT_IN_BASE);
}

/*
 * c's whole frames to their handlers: with the lock shared, the run that needs no more; the write
 * lock only for the frames that need it, and back to shared after them for the next such run
 * (conn_parse stops there). A pthread rwlock has no downgrade: the loop lets the lock go and takes
 * it shared, and a writer may come between (another loop's PUT, REMOVE or eviction, loop 0's
 * tick or completions). The frames after see the store as that writer left it, as if they had
 * come in the next read: the frame before is whole and answered or waiting on its I/O, c's queue
 * keeps their replies in order, and a writer that closes or kicks c meanwhile only marks it and
 * posts it to c's loop. A frame the shared path refuses (the loop's deferred hits full, which the
 * write lock applies; the NVMe tier lost blocks) is handled under the write lock, and the frames
 * after it go back to shared; when the shared path answers nothing twice in a row (the refusal
 * lasts), the rest goes to the write path, so that no frame costs a let-go each.
 */
static void conn_frames(kvt__conn_t *c)
{
    int share = 1, refused = 0;
    for (;;) {
        if (c->loop->held == KVT_HELD_SHARED) {
            size_t n = conn_parse_shared(c);
            if (parse_idle(c))
                return;
            kvt__loop_hold(c->loop, KVT_HELD_WRITE);
            refused = n ? 0 : refused + 1;
            share = refused < 2;
        }
        if (!conn_parse(c, share))
            return;
        kvt__loop_hold(c->loop, KVT_HELD_SHARED);
    }
}

/* How a loop takes the lock back after a read of n bytes into c's input (c's own, read here with
 * no lock held): shared when the frame at the front may be answered so (a MATCH, a GET, a
 * RELEASE; conn_frames takes it for writing if not) or is not whole yet; for writing
 * when that frame needs it anyway (a PUT, a REMOVE: taken shared first, it would cost a let-go
 * more each) or the peer closed (its close). */
static int read_held(const kvt__conn_t *c, ssize_t n)
{
    const kvt__conn_ops_t *ops = c->srv->conn_ops;
    if (n == 0)
        return KVT_HELD_WRITE;
    size_t len = c->in_len + (n > 0 ? (size_t)n : 0);
    if (len < KVT_PROTO_HDR)
        return KVT_HELD_SHARED;
    kvt_proto_hdr_t h;
    kvt_proto_hdr_decode(c->in, &h);
    if (kvt_proto_hdr_check(&h, (uint32_t)c->srv->conf->max_frame) < 0 || !ops->shares ||
        (len - KVT_PROTO_HDR >= h.body_len && !ops->shares(&h)))
        return KVT_HELD_WRITE;
    return KVT_HELD_SHARED;
}

static void conn_read(kvt__conn_t *c)
{
    for (int k = 0; k < 16 && !c->dead && !c->closing && !c->mem_wait; k++) {
        if (c->in_cap < KVT_IN_BASE && in_resize(c, KVT_IN_BASE) < 0) {
            c->dead = 1;
            return;
        }
        size_t room = c->in_cap - c->in_len;
        if (room == 0)
            return; /* parse grows it for a bigger frame, or back-pressure holds it */
        int unlocked = kvt__conn_unlock(c) != KVT_HELD_NONE;
        ssize_t n = read(c->ev.fd, c->in + c->in_len, room);
        int err = errno;
        if (unlocked)
            kvt__conn_relock(c, read_held(c, n));
        errno = err;
        if (n == 0) {
            if (c->in_len > 0) {
                kvt__proto_error(c->srv, KVT_PERR_TRUNCATED);
                static kvt_log_limit_t lim; /* a client can do it per connection */
                kvt_log_limited(&lim, KVT_LOG_INFO,
                                "kvtierd: connection %llu closed in the middle of a frame (%zu "
                                "bytes)",
                                (unsigned long long)c->id, c->in_len);
            }
            c->dead = 1;
            return;
        }
        if (n < 0) {
            if (errno != EAGAIN && errno != EINTR)
                c->dead = 1;
            return;
        }
        c->in_len += (size_t)n;
        c->rx_bytes += (uint64_t)n;
        c->rx_ns = kvt_now_ns();
        conn_frames(c);
        if (conn_held(c))
            return;
        /* A short read took all the socket had: the next read would only say EAGAIN. Bytes
         * that arrive meanwhile wake epoll again (level-triggered), so none wait. */
        if ((size_t)n < room)
            return;
    }
}

void kvt__conn_kick(kvt__conn_t *c)
{
    kvt_srv_t *s = c->srv;
    if (c->gone)
        return;
    if (s->loops_running && kvt__loop_self() != c->loop) {
        kvt__loop_post(c); /* another loop's: it may be in its socket's read or write */
        return;
    }
    if (c->in_handler)
        return; /* the frame loop that is running kicks when it is done */
    if (c->loop->deferring) {
        /* Its loop delivers a batch of completions: the replies the rest of the batch finishes
         * go in the same write (32 pipelined RESERVEs' DRAM writes: one writev, not 32). The
         * posted list serves, without the eventfd: kvt__kicks_flush empties it. */
        posted_push(c);
        return;
    }
    c->in_handler = 1;
    if (!c->dead && conn_write(c) < 0)
        c->dead = 1;
    /* Frames held back by back-pressure get their turn when it eases. */
    if (!c->dead && !c->closing && c->in_len >= KVT_PROTO_HDR && !conn_held(c)) {
        conn_frames(c);
        if (conn_write(c) < 0)
            c->dead = 1;
    }
    c->in_handler = 0;
    int idle = c->head == NULL;
    if (c->dead || (c->closing && idle)) {
        if (c->loop->held == KVT_HELD_SHARED)
            kvt__loop_hold(c->loop, KVT_HELD_WRITE);
        kvt__conn_close(c);
        return;
    }
    uint32_t want = 0;
    if (!c->closing && !c->mem_wait && !conn_held(c))
        want |= EPOLLIN;
    int unsent = 0;
    for (kvt__req_t *r = c->head; r; r = r->next) {
        if (r->src) {
            struct iovec one;
            unsent = r->src->iov(r, &one, 1) > 0;
            break;
        }
        if (r->out_len > r->out_off) {
            unsent = 1;
            break;
        }
        if (!r->done)
            break;
    }
    /* A waiter's socket is watched only while its clock runs: its EPOLLOUT stops the clock. */
    if (unsent && (c->turn != KVT_TURN_WAIT || c->stuck_ns))
        want |= EPOLLOUT;
    if (!unsent && c->turn == KVT_TURN_HELD)
        turn_end(c); /* its queue is all in the kernel */
    if (want != c->events) {
        c->events = want;
        kvt__ev_ctl(c->loop->epfd, EPOLL_CTL_MOD, &c->ev, want);
    }
}

static void conn_on_event(kvt_srv_t *s, kvt__ev_t *ev, uint32_t events)
{
    (void)s;
    kvt__conn_t *c = (kvt__conn_t *)ev;
    kvt__loop_t *l = c->loop;
    if (c->gone)
        return; /* closed by an earlier event of the same batch */
    /* Any loop comes here holding the lock shared (or for writing, after an event that wrote);
     * the socket I/O lets it go and takes it back as what follows needs (read_held, conn_frames),
     * and the loop goes on as the event left it. */
    if (events & (EPOLLERR | EPOLLHUP) && !(events & EPOLLIN))
        c->dead = 1;
    /* Its socket took bytes: not stuck (a connection that gave its turn on stalled and waits, or
     * has just got a turn back, kvt__turns_step, is not stalled any more). */
    if (events & EPOLLOUT) {
        c->turn_read |= c->stuck_ns != 0; /* room in a socket that was full: its client reads */
        c->stuck_ns = 0;
    }
    c->in_handler = 1;
    l->top = c;
    if (!c->dead && (events & EPOLLIN))
        conn_read(c);
    c->in_handler = 0;
    kvt__conn_kick(c);
    l->top = NULL;
}

void kvt__conns_deadlines(kvt_srv_t *s, uint64_t now)
{
    kvt__conn_t *next;
    s->reqs_waiting = 0; /* set again by the deadlines of those still waiting */
    for (kvt__conn_t *c = s->clients.list; c; c = next) {
        next = c->next; /* a closed one keeps its link until the reap */
        if (!c->gone)
            s->conn_ops->deadlines(c, now);
    }
}

void kvt__conns_mem_retry(kvt_srv_t *s)
{
    kvt__conn_t *next;
    for (kvt__conn_t *c = s->clients.list; c && s->clients.mem_waiting; c = next) {
        next = c->next; /* a closed one (its mem_wait cleared by the close) keeps its link */
        if (c->mem_wait && s->clients.bytes + c->mem_need <= s->conf->max_client_bytes)
            kvt__conn_kick(c); /* parses again: takes its buffer, or waits on */
    }
}

/* A client that stopped reading holds its replies, its leases and its share of max-client-bytes
 * for as long as it stays connected; past reply-timeout-ms it is closed, as Redis closes a client
 * over its output buffer limit. Any reply byte the socket takes starts the time again. */
static int conn_timed_out(kvt__conn_t *c, uint64_t now)
{
    uint64_t limit = (uint64_t)c->srv->conf->reply_timeout_ms * 1000000;
    if (limit == 0 || c->stuck_ns == 0 || kvt_ns_since(now, c->stuck_ns) < limit)
        return 0;
    static kvt_log_limit_t lim; /* many clients may stop reading at once */
    kvt_log_limited(&lim, KVT_LOG_WARN,
                    "kvtierd: connection %llu took none of its replies for %u ms (%zu bytes "
                    "queued, %zu leases): closed (reply-timeout-ms)",
                    (unsigned long long)c->id, c->srv->conf->reply_timeout_ms, c->out_bytes,
                    c->nleases);
    kvt__metric_add(c->srv->metrics, KVT_M_CONNECTIONS_TIMED_OUT, 0, 1);
    kvt__conn_close(c);
    return 1;
}

/*
 * Clients too slow to send what they began: a connection must have sent a whole first
 * frame within hello-timeout-ms of connecting, and a frame once begun must be whole within
 * frame-timeout-ms or have at least frame-min-rate x frame-timeout-ms of its bytes arrive in
 * every frame-timeout-ms, measured from tick to tick. Otherwise the connection is closed, and
 * with it the input buffer a big frame's header reserved in max-client-bytes (a frame one byte
 * short would hold it for good). Time in which the daemon does not read the connection
 * (back-pressure, a wait for max-client-bytes) does not count against it.
 */
static int conn_too_slow(kvt__conn_t *c, uint64_t now)
{
    const kvt_srv_conf_t *cf = c->srv->conf;
    uint64_t hello = (uint64_t)cf->hello_timeout_ms * 1000000;
    if (hello && c->frames == 0 && kvt_ns_since(now, c->born_ns) >= hello) {
        static kvt_log_limit_t lim;
        kvt_log_limited(&lim, KVT_LOG_INFO,
                        "kvtierd: connection %llu sent no whole frame in its first %u ms (%zu "
                        "bytes): closed (hello-timeout-ms)",
                        (unsigned long long)c->id, cf->hello_timeout_ms, c->in_len);
        kvt__metric_add(c->srv->metrics, KVT_M_CONNECTIONS_HELLO_TIMED_OUT, 0, 1);
        kvt__conn_close(c);
        return 1;
    }
    uint64_t window = (uint64_t)cf->frame_timeout_ms * 1000000;
    if (window == 0)
        return 0;
    if (c->in_len == 0 || c->mem_wait || c->closing || !(c->events & EPOLLIN) ||
        (uint32_t)c->frames != c->mark_frames) {
        /* Between frames, held by the daemon, or a frame finished since: a new period. */
        c->mark_ns = now;
        c->mark_rx = c->rx_bytes;
        c->mark_frames = (uint32_t)c->frames;
        return 0;
    }
    if (kvt_ns_since(now, c->mark_ns) < window)
        return 0;
    uint64_t need = cf->frame_min_rate * cf->frame_timeout_ms / 1000;
    uint64_t got = c->rx_bytes - c->mark_rx;
    if (got >= KVT_MAX(need, 1)) {
        c->mark_ns = now;
        c->mark_rx = c->rx_bytes;
        return 0;
    }
    static kvt_log_limit_t lim;
    kvt_log_limited(&lim, KVT_LOG_INFO,
                    "kvtierd: connection %llu sent %llu bytes of a frame in %llu ms (%zu of it "
                    "buffered, %zu reserved): closed (frame-timeout-ms, frame-min-rate)",
                    (unsigned long long)c->id, (unsigned long long)got,
                    (unsigned long long)(kvt_ns_since(now, c->mark_ns) / 1000000), c->in_len,
                    c->in_cap);
    kvt__metric_add(c->srv->metrics, KVT_M_CONNECTIONS_FRAME_TIMED_OUT, 0, 1);
    kvt__conn_close(c);
    return 1;
}

void kvt__conns_tick(kvt_srv_t *s, uint64_t now)
{
    kvt__conn_t *next;
    for (kvt__conn_t *c = s->clients.list; c; c = next) {
        next = c->next;
        /* Dead: closed by its own loop (posted there by an earlier close) before it is again. */
        if (!c->gone && !c->dead && !conn_too_slow(c, now) && !conn_timed_out(c, now)) {
            s->conn_ops->tick(c, now);
        }
    }
    kvt__conns_deadlines(s, now);
}
