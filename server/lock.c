/*
 * lock.c: the store's lock, s->lock (issue 42, docs/architecture.md "Event loops"), a
 * reader-writer lock. Everything above the sockets takes it for writing; a loop's framing and a
 * run of MATCHes without a lease take it shared, on every loop, 0 included, and after a frame that
 * wrote too (conn.c, op_match.c): their walks, their counters
 * (the loop's own table) and their replies. What such a MATCH would have written to the store (the
 * hit, the curve's sample, the clients' memory) waits in its loop's hits (struct kvt__loop) and is
 * applied by the next writer as soon as it has the lock, before it can change the tree: the hook
 * s->lock_settle (loop.c sets it to op_match.c's kvt__match_settle), called through a pointer so
 * that the lock, used by conn.c and the operations alike, calls up into none of them.
 */
#include "server.h"

void kvt__srv_lock(kvt_srv_t *s)
{
    pthread_rwlock_wrlock(&s->lock);
    s->lock_at = kvt_now_ns();
    if (s->lock_settle) /* before anything can change the tree: the hits' paths are there */
        s->lock_settle(s);
}

void kvt__srv_lock_shared(kvt_srv_t *s)
{
    pthread_rwlock_rdlock(&s->lock);
}

void kvt__srv_unlock(kvt_srv_t *s)
{
    pthread_rwlock_unlock(&s->lock);
}

/* The times are the loop's own series (kvtier_loop_*_lock_*_seconds), observed with the lock held,
 * as its other counters are written: a hold just before it is let go, a wait just after the lock
 * was granted. The write lock's wait ends where kvt__srv_lock was granted it: the settle after is
 * the hold's (the work of the loops' deferred hits, done by whoever writes next). */
void kvt__loop_hold(kvt__loop_t *l, int held)
{
    kvt_srv_t *s = l->srv;
    if (l->held == held)
        return;
    kvt_metrics_t *m = l->metrics ? l->metrics : s->metrics;
    uint64_t now = kvt_now_ns();
    /* l->held changes only while the lock is held, so that a writer reads every loop's as it is
     * (kvt__clients_add of another loop's connection). */
    if (l->held != KVT_HELD_NONE) {
        if (l->held == KVT_HELD_WRITE)
            kvt__metric_observe(m, KVT_M_LOOP_WRITE_LOCK_HOLD, l->id, now - l->write_at);
        l->held = KVT_HELD_NONE;
        kvt__srv_unlock(s);
    }
    if (held == KVT_HELD_SHARED) {
        kvt__srv_lock_shared(s);
        l->held = KVT_HELD_SHARED;
        kvt__metric_observe(m, KVT_M_LOOP_SHARED_LOCK_WAIT, l->id, kvt_now_ns() - now);
    } else if (held == KVT_HELD_WRITE) {
        kvt__srv_lock(s);
        l->held = KVT_HELD_WRITE;
        l->wrote = 1;
        l->write_at = s->lock_at;
        kvt__metric_add(m, KVT_M_LOOP_WRITE_LOCKS, l->id, 1);
        kvt__metric_observe(m, KVT_M_LOOP_WRITE_LOCK_WAIT, l->id, s->lock_at - now);
    }
}
