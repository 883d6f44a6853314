/*
 * loops.c: the event loops beyond loop 0 (the loops setting): their threads, epoll sets and
 * eventfds, their start and stop, their CPU time. What moves connections between loops lives
 * with the connections in conn.c (the hand-off at accept, kvt__loop_pick; the posted kicks,
 * kvt__loop_post); the work after each batch is loop.c's, which each thread calls through
 * s->loop_after.
 *
 * Issue 42 (docs/architecture.md, "Event loops"): the store and everything above the sockets
 * stay behind one lock, s->lock; what runs in parallel is each connection's socket reads and its
 * writes of finished replies (conn.c), the kernel's part of a request, as in Redis 6's I/O
 * threads, and (steps 2-4) the framing and the MATCHes without a lease, which walk, count (each
 * loop in its own metric table, merged on scrape) and answer under the lock taken shared (a
 * reader-writer lock, op_match.c): every loop, 0 included, holds it shared from each wake, and
 * for writing only for what writes (a frame, an event of loop 0's own), going back to shared after
 * it. The accept is a hand-off from loop 0, not SO_REUSEPORT or
 * EPOLLEXCLUSIVE: both of those leave the choice to the kernel (a hash of the peer's address, the
 * first loop idle in epoll_wait), which on the few long-lived connections of a serving node's
 * engines can put them all on one loop; the hand-off costs loop 0 an accept4 and an epoll_ctl per
 * connection, and an engine connects once (bench_accept: the same CPU per accept as
 * SO_REUSEPORT, and the only one of the three that always spreads a handful of connections
 * evenly). The Unix socket and TCP are handed off the same way.
 *
 *     loop 0 (main thread)              loop i (thread)
 *     listeners, signals, tiers,        [epoll: its connections, its eventfd]
 *     metrics port, tick                     ^ posted kick: c on loop i's list, eventfd += 1
 *     accept -> kvt__loop_pick -> epoll_ctl(loop i's set, c)
 */
#define _GNU_SOURCE /* sched_getaffinity, CPU_COUNT */
#include "server.h"

#include <errno.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

/* loops = 0: one loop per CPU the process may run on, at most this many. */
#define KVT_LOOPS_AUTO_MAX 8

unsigned kvt__loops_auto(void)
{
    cpu_set_t set;
    long n = 0;
    if (sched_getaffinity(0, sizeof set, &set) == 0)
        n = CPU_COUNT(&set);
    if (n <= 0)
        n = sysconf(_SC_NPROCESSORS_ONLN);
    return n <= 1 ? 1u : (unsigned)KVT_MIN(n, KVT_LOOPS_AUTO_MAX);
}

/* The eventfd's count only wakes the loop: the posted list is emptied at its reap. */
static void on_wake(kvt_srv_t *s, kvt__ev_t *ev, uint32_t events)
{
    (void)s;
    (void)events;
    uint64_t v;
    while (read(ev->fd, &v, sizeof v) == sizeof v)
        ;
}

int kvt__loops_open(kvt_srv_t *s)
{
    unsigned n = s->conf->loops ? s->conf->loops : kvt__loops_auto();
    s->loops = calloc(n, sizeof *s->loops);
    if (!s->loops)
        return KVT_ENOMEM;
    /* Writers first: with readers preferred (glibc's default), loops that MATCH all the time
     * would keep loop 0's tier completions and tick, and every PUT, waiting for good. */
    pthread_rwlockattr_t attr;
    pthread_rwlockattr_init(&attr);
    pthread_rwlockattr_setkind_np(&attr, PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP);
    int rc = pthread_rwlock_init(&s->lock, &attr);
    pthread_rwlockattr_destroy(&attr);
    if (!rc && (rc = pthread_mutex_init(&s->submit, NULL)))
        pthread_rwlock_destroy(&s->lock);
    if (!rc && (rc = pthread_mutex_init(&s->lease_mu, NULL))) {
        pthread_mutex_destroy(&s->submit);
        pthread_rwlock_destroy(&s->lock);
    }
    if (rc) {
        free(s->loops);
        s->loops = NULL;
        return -rc;
    }
    s->nloops = n;
    for (unsigned i = 0; i < n; i++) {
        s->loops[i].srv = s;
        s->loops[i].id = i;
        s->loops[i].wake.fd = s->loops[i].epfd = -1;
    }
    for (unsigned i = 0; i < n; i++)
        if (!(s->loops[i].hits = calloc(KVT_LOOP_HITS, sizeof *s->loops[i].hits)))
            return KVT_ENOMEM;
    for (unsigned i = 0; i < n; i++) {
        kvt__loop_t *l = &s->loops[i];
        l->epfd = i == 0 ? s->epfd : epoll_create1(EPOLL_CLOEXEC);
        if (l->epfd < 0)
            return -errno;
        l->wake.fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
        l->wake.cb = on_wake;
        l->wake.shared = 1; /* it only wakes the loop: the posted kicks are the reap's */
        if (l->wake.fd < 0)
            return -errno;
        if ((rc = kvt__ev_ctl(l->epfd, EPOLL_CTL_ADD, &l->wake, EPOLLIN)) < 0)
            return rc;
    }
    return 0;
}

/* A batch of events that did not take s->lock for writing leaves work that needs it only when
 * there are kicks posted, connections to free, frees that waited for its GETs' reads, moves
 * landed, connections waiting for memory or seals. The policy's step is left to the next batch that
 * writes (loop 0's tick at the latest): a run of MATCHes changed nothing for it to do but their
 * deferred hits, which that writer applies. */
int kvt__loop_busy(const kvt__loop_t *l)
{
    const kvt_srv_t *s = l->srv;
    return l->posted || l->gone || l->sealing || l->frees_due || s->exec.moves_landed ||
           s->clients.mem_waiting;
}

/* Loop i > 0: its connections' events, and the kicks other loops post to it. Holds s->lock shared
 * from each wake, for writing only for the frames and events that write (conn.c goes back to
 * shared after them), and not at all in epoll_wait and its connections' socket I/O. */
static void *loop_main(void *arg)
{
    kvt__loop_t *l = arg;
    kvt_srv_t *s = l->srv;
    kvt__loop_set_self(l);
    struct epoll_event evs[256];
    kvt__loop_hold(l, KVT_HELD_SHARED);
    while (!s->loops_exit) {
        int turns = kvt__turns_step(l);                   /* the next stall of a turn's holder */
        int timeout = l->sealing || l->apart ? 0 : turns; /* or PUTs' copies the kicks queued */
        kvt__loop_hold(l, KVT_HELD_NONE);
        if (l->sealing)
            sched_yield();
        int n = epoll_wait(l->epfd, evs, (int)KVT_ARRAY_LEN(evs), timeout);
        int err = errno;
        l->wrote = 0;
        kvt__loop_hold(l, KVT_HELD_SHARED);
        if (n < 0) {
            if (err != EINTR)
                kvt_log(KVT_LOG_ERROR, "kvtierd: loop %u: epoll_wait: %s", l->id, strerror(err));
            continue;
        }
        for (int i = 0; i < n; i++) {
            kvt__ev_t *ev = evs[i].data.ptr;
            if (!ev->shared)
                kvt__loop_hold(l, KVT_HELD_WRITE);
            ev->cb(s, ev, evs[i].events);
        }
        kvt__put_apart(l);
        kvt__posted_shared(l); /* completions of GETs planned shared: no write lock for them */
        if (l->wrote || kvt__loop_busy(l)) {
            kvt__loop_hold(l, KVT_HELD_WRITE);
            s->loop_after(l);
            kvt__conns_reap(l); /* no event or walk holds one of its connections here */
        }
    }
    kvt__put_apart(l); /* queued by the last batch's step: their requests count in flight */
    kvt__loop_hold(l, KVT_HELD_NONE);
    return NULL;
}

int kvt__loops_start(kvt_srv_t *s, void (*after)(kvt__loop_t *l))
{
    s->loop_after = after;
    for (unsigned i = 0; i < s->nloops; i++) /* NULL (no memory for them): the main table */
        s->loops[i].metrics = kvt__metrics_loop(s->metrics, i);
    kvt__loop_set_self(&s->loops[0]);
    s->loops[0].thread = pthread_self();
    s->loops[0].started = 1;
    kvt__metric_set(s->metrics, KVT_M_LOOPS, 0, s->nloops);
    if (s->nloops < 2)
        return 0;
    s->loops_running = 1;
    for (unsigned i = 1; i < s->nloops; i++) {
        int rc = pthread_create(&s->loops[i].thread, NULL, loop_main, &s->loops[i]);
        if (rc) {
            /* Connections go only to the loops that run (kvt__loop_pick). */
            kvt_log(KVT_LOG_WARN, "kvtierd: loop %u not started (%s): serving with %u loop%s", i,
                    strerror(rc), i, i == 1 ? "" : "s");
            s->nloops = i;
            break;
        }
        s->loops[i].started = 1;
    }
    if (s->nloops < 2)
        s->loops_running = 0;
    kvt__metric_set(s->metrics, KVT_M_LOOPS, 0, s->nloops);
    return 0;
}

void kvt__loops_stop(kvt_srv_t *s)
{
    if (!s->loops_running)
        return;
    s->loops_exit = 1;
    uint64_t one = 1;
    for (unsigned i = 1; i < s->nloops; i++)
        if (write(s->loops[i].wake.fd, &one, sizeof one) < 0) {
            /* EAGAIN only: woken already */
        }
    kvt__srv_unlock(s);
    s->loops[0].started = 0;
    for (unsigned i = 1; i < s->nloops; i++)
        if (s->loops[i].started) {
            pthread_join(s->loops[i].thread, NULL);
            s->loops[i].started = 0;
        }
    kvt__srv_lock(s);
    s->loops[0].write_at = s->lock_at; /* its hold starts again here, not at its first take */
    s->loops_running = 0;
}

void kvt__loops_cpu(kvt_srv_t *s)
{
    for (unsigned i = 0; i < s->nloops; i++) {
        clockid_t id;
        struct timespec ts;
        if (s->loops[i].started && pthread_getcpuclockid(s->loops[i].thread, &id) == 0 &&
            clock_gettime(id, &ts) == 0)
            kvt__metric_set(s->metrics, KVT_M_LOOP_CPU, i, (double)ts.tv_sec + ts.tv_nsec / 1e9);
    }
}

void kvt__loops_close(kvt_srv_t *s)
{
    if (!s->loops)
        return;
    for (unsigned i = 0; i < s->nloops; i++) {
        kvt__loop_t *l = &s->loops[i];
        kvt__conns_reap(l);
        free(l->hits);
        free(l->keys);
        kvt__busy_free(&l->busy);
        if (l->wake.fd >= 0)
            close(l->wake.fd);
        if (i > 0 && l->epfd >= 0)
            close(l->epfd);
    }
    pthread_rwlock_destroy(&s->lock);
    pthread_mutex_destroy(&s->submit);
    pthread_mutex_destroy(&s->lease_mu);
    free(s->loops);
    s->loops = NULL;
}
