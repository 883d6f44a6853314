/*
 * ioq.c: the request queue written once for the tiers that hold requests back (NVMe: its
 * io_uring slots; remote: its window of unanswered commands). A backend embeds a
 * kvt__ioq_link_t in whatever it queues and only moves bytes; this file owns the order in which
 * requests leave, how many are out at once, when a waiting one has waited too long, and the free
 * list of the backend's request structs.
 *
 *   submit --+--> wait[1]: urgent (a client waits) --+
 *            |                                       +--(inflight < window)--> the backend
 *            +--> wait[0]: the rest -----------------+    starts it; done: finished()
 *                   |
 *                   +-- deadline passed, or nobody waits any more: expire() hands it back
 *
 * Within a class requests leave in submission order; urgent ones pass the rest. Every deadline
 * is the submit time plus one timeout, so each FIFO is in deadline order too and expire() stops
 * at the first deadline still to come.
 */
#include "tier_impl.h"

void kvt__ioq_init(kvt__ioq_t *q, uint32_t window)
{
    *q = (kvt__ioq_t){.window = window};
}

void kvt__ioq_fifo_push(kvt__ioq_fifo_t *f, kvt__ioq_link_t *e)
{
    e->next = NULL;
    if (f->tail)
        f->tail->next = e;
    else
        f->head = e;
    f->tail = e;
    f->n++;
}

kvt__ioq_link_t *kvt__ioq_fifo_pop(kvt__ioq_fifo_t *f)
{
    kvt__ioq_link_t *e = f->head;
    if (e) {
        f->head = e->next;
        if (!f->head)
            f->tail = NULL;
        f->n--;
        e->next = NULL;
    }
    return e;
}

void kvt__ioq_fifo_unlink(kvt__ioq_fifo_t *f, kvt__ioq_link_t *prev, kvt__ioq_link_t *e)
{
    if (prev)
        prev->next = e->next;
    else
        f->head = e->next;
    if (f->tail == e)
        f->tail = prev;
    f->n--;
    e->next = NULL;
}

void kvt__ioq_fifo_prepend(kvt__ioq_fifo_t *f, kvt__ioq_fifo_t *front)
{
    if (!front->head)
        return;
    front->tail->next = f->head;
    if (!f->head)
        f->tail = front->tail;
    f->head = front->head;
    f->n += front->n;
    *front = (kvt__ioq_fifo_t){0};
}

void kvt__ioq_push(kvt__ioq_t *q, kvt__ioq_link_t *e, int urgent)
{
    kvt__ioq_fifo_push(&q->wait[urgent != 0], e);
}

int kvt__ioq_behind(const kvt__ioq_t *q, int urgent)
{
    return q->wait[1].head || (!urgent && q->wait[0].head);
}

kvt__ioq_link_t *kvt__ioq_head(const kvt__ioq_t *q)
{
    return q->wait[1].head ? q->wait[1].head : q->wait[0].head;
}

kvt__ioq_link_t *kvt__ioq_next(const kvt__ioq_t *q)
{
    return q->inflight < q->window ? kvt__ioq_head(q) : NULL;
}

kvt__ioq_link_t *kvt__ioq_take(kvt__ioq_t *q)
{
    return kvt__ioq_fifo_pop(&q->wait[q->wait[1].head != NULL]);
}

kvt__ioq_link_t *kvt__ioq_pop(kvt__ioq_t *q)
{
    if (q->inflight >= q->window)
        return NULL;
    kvt__ioq_link_t *e = kvt__ioq_take(q);
    if (e)
        q->inflight++;
    return e;
}

size_t kvt__ioq_waiting(const kvt__ioq_t *q)
{
    return (size_t)q->wait[0].n + q->wait[1].n;
}

int kvt__ioq_start(kvt__ioq_t *q)
{
    if (q->inflight >= q->window)
        return 0;
    q->inflight++;
    return 1;
}

void kvt__ioq_started(kvt__ioq_t *q)
{
    q->inflight++;
}

void kvt__ioq_finished(kvt__ioq_t *q)
{
    kvt_assert(q->inflight > 0);
    q->inflight--;
}

uint64_t kvt__ioq_expire(kvt__ioq_t *q, uint64_t now, int (*dead)(const kvt__ioq_link_t *e),
                         void (*drop)(void *arg, kvt__ioq_link_t *e, int expired), void *arg)
{
    uint64_t next = UINT64_MAX;
    for (int c = 1; c >= 0; c--) {
        kvt__ioq_fifo_t *f = &q->wait[c];
        kvt__ioq_link_t *prev = NULL;
        for (kvt__ioq_link_t *e = f->head, *nx; e; e = nx) {
            nx = e->next;
            int gone = dead && dead(e);
            if (gone || (e->deadline_ns && e->deadline_ns <= now)) {
                kvt__ioq_fifo_unlink(f, prev, e);
                drop(arg, e, !gone);
                continue;
            }
            if (e->deadline_ns) {
                next = KVT_MIN(next, e->deadline_ns);
                break;
            }
            prev = e;
        }
    }
    return next;
}

kvt__ioq_link_t *kvt__ioq_slot_get(kvt__ioq_t *q)
{
    kvt__ioq_link_t *e = q->free;
    if (e) {
        q->free = e->next;
        e->next = NULL;
    }
    return e;
}

void kvt__ioq_slot_put(kvt__ioq_t *q, kvt__ioq_link_t *e)
{
    e->next = q->free;
    q->free = e;
}
