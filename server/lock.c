/*
 * lock.c: the store's lock, s->lock (issue 42, docs/architecture.md "Event loops"), a
 * reader-writer lock. Everything above the sockets takes it for writing; a MATCH without a lease
 * takes it shared (op_match.c) for its walk, its counters (its loop's own table) and its reply.
 * What such a MATCH would have written to the store (the hit, the curve's sample, the clients'
 * memory) waits in its loop's hit (struct kvt__loop) and is applied by the next writer as soon as
 * it has the lock, before it can change the tree: the hook s->lock_settle (loop.c sets it to
 * op_match.c's kvt__match_settle),
 * called through a pointer so that the lock, used by conn.c and the operations alike, calls up
 * into none of them.
 */
#include "server.h"

void kvt__srv_lock(kvt_srv_t *s)
{
    pthread_rwlock_wrlock(&s->lock);
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
