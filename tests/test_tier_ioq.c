/*
 * test_tier_ioq.c: the request queue the NVMe and remote tiers share (tiers/ioq.c). Urgent
 * requests leave before the rest and each class keeps its order; nothing leaves while the window
 * is full; a new request queues behind its class; expire() hands back what passed its deadline
 * or is dead, steps over requests without a deadline and reports the next deadline; the slot pool
 * gives back what it was given; and a random run agrees with a simple reference model.
 */
#include "test_tier_util.h"
#include "tier_impl.h"

typedef struct ent {
    kvt__ioq_link_t link;
    int id;
    int urgent;
    int dead;
} ent_t;

static ent_t *ent_of(kvt__ioq_link_t *l)
{
    return l ? KVT__IOQ_OF(l, ent_t, link) : NULL;
}

static int id_of(kvt__ioq_link_t *l)
{
    return l ? ent_of(l)->id : -1;
}

Test(tier_ioq, urgent_requests_pass_the_rest_and_each_class_keeps_its_order)
{
    kvt__ioq_t q;
    kvt__ioq_init(&q, 100);
    ent_t e[6];
    int urgent[6] = {0, 1, 0, 1, 0, 1};
    for (int i = 0; i < 6; i++) {
        e[i] = (ent_t){.id = i};
        kvt__ioq_push(&q, &e[i].link, urgent[i]);
    }
    cr_assert_eq(kvt__ioq_waiting(&q), 6);
    int want[6] = {1, 3, 5, 0, 2, 4};
    for (int i = 0; i < 6; i++)
        cr_assert_eq(id_of(kvt__ioq_pop(&q)), want[i]);
    cr_assert_null(kvt__ioq_pop(&q));
    cr_assert_eq(q.inflight, 6);
    for (int i = 0; i < 6; i++)
        kvt__ioq_finished(&q);
    cr_assert_eq(q.inflight, 0);
}

Test(tier_ioq, nothing_leaves_while_the_window_is_full)
{
    kvt__ioq_t q;
    kvt__ioq_init(&q, 2);
    ent_t e[4];
    for (int i = 0; i < 4; i++) {
        e[i] = (ent_t){.id = i};
        kvt__ioq_push(&q, &e[i].link, 0);
    }
    cr_assert_eq(id_of(kvt__ioq_pop(&q)), 0);
    cr_assert_eq(kvt__ioq_start(&q), 1, "a request that never waited takes the last place");
    cr_assert_null(kvt__ioq_next(&q));
    cr_assert_null(kvt__ioq_pop(&q));
    cr_assert_eq(kvt__ioq_start(&q), 0);
    cr_assert_eq(id_of(kvt__ioq_head(&q)), 1, "the head is known, window or not");
    kvt__ioq_finished(&q);
    cr_assert_eq(id_of(kvt__ioq_next(&q)), 1);
    cr_assert_eq(id_of(kvt__ioq_pop(&q)), 1);
    cr_assert_null(kvt__ioq_pop(&q));
    /* take() ignores the window; started() counts whatever the window. */
    cr_assert_eq(id_of(kvt__ioq_take(&q)), 2);
    kvt__ioq_started(&q);
    cr_assert_eq(q.inflight, 3);
}

Test(tier_ioq, a_new_request_queues_behind_its_class)
{
    kvt__ioq_t q;
    kvt__ioq_init(&q, 8);
    cr_assert_eq(kvt__ioq_behind(&q, 0), 0);
    cr_assert_eq(kvt__ioq_behind(&q, 1), 0);
    ent_t a = {.id = 1}, b = {.id = 2};
    kvt__ioq_push(&q, &a.link, 0);
    cr_assert_eq(kvt__ioq_behind(&q, 0), 1);
    cr_assert_eq(kvt__ioq_behind(&q, 1), 0, "an urgent request passes the others");
    kvt__ioq_push(&q, &b.link, 1);
    cr_assert_eq(kvt__ioq_behind(&q, 1), 1);
}

static int ent_dead(const kvt__ioq_link_t *l)
{
    return KVT__IOQ_OF(l, const ent_t, link)->dead;
}

typedef struct dropped {
    int ids[4096], expired[4096], n;
} dropped_t;

static void ent_drop(void *arg, kvt__ioq_link_t *l, int expired)
{
    dropped_t *d = arg;
    d->ids[d->n] = id_of(l);
    d->expired[d->n++] = expired;
}

Test(tier_ioq, expire_hands_back_what_passed_its_deadline_or_is_dead)
{
    kvt__ioq_t q;
    kvt__ioq_init(&q, 8);
    /* normal: 0 (no deadline), 1 (@10), 2 (dead, @30), 3 (@20: not in order, stays behind 2)
     * urgent: 4 (@5), 5 (@40) */
    ent_t e[6] = {{.id = 0}, {.id = 1}, {.id = 2, .dead = 1}, {.id = 3}, {.id = 4}, {.id = 5}};
    uint64_t dl[6] = {0, 10, 30, 20, 5, 40};
    int urgent[6] = {0, 0, 0, 0, 1, 1};
    for (int i = 0; i < 6; i++) {
        e[i].link.deadline_ns = dl[i];
        kvt__ioq_push(&q, &e[i].link, urgent[i]);
    }
    dropped_t d = {0};
    cr_assert_eq(kvt__ioq_expire(&q, 4, ent_dead, ent_drop, &d), 5);
    cr_assert_eq(d.n, 0, "the walk stops at the first deadline to come: 2 is not reached");
    cr_assert_eq(kvt__ioq_expire(&q, 12, ent_dead, ent_drop, &d), 20);
    cr_assert_eq(d.n, 3);
    cr_assert_eq(d.ids[0], 4);
    cr_assert_eq(d.expired[0], 1);
    cr_assert_eq(d.ids[1], 1);
    cr_assert_eq(d.expired[1], 1);
    cr_assert_eq(d.ids[2], 2);
    cr_assert_eq(d.expired[2], 0, "a dead request is not a timeout");
    cr_assert_eq(kvt__ioq_waiting(&q), 3);
    d.n = 0;
    cr_assert_eq(kvt__ioq_expire(&q, 100, NULL, ent_drop, &d), UINT64_MAX);
    cr_assert_eq(d.n, 2);
    cr_assert_eq(kvt__ioq_waiting(&q), 1);
    cr_assert_eq(id_of(kvt__ioq_pop(&q)), 0, "a request without a deadline never expires");
}

Test(tier_ioq, fifos_prepend_and_the_slot_pool_gives_back_what_it_got)
{
    kvt__ioq_fifo_t f = {0}, front = {0};
    ent_t e[4] = {{.id = 0}, {.id = 1}, {.id = 2}, {.id = 3}};
    kvt__ioq_fifo_push(&f, &e[2].link);
    kvt__ioq_fifo_push(&f, &e[3].link);
    kvt__ioq_fifo_push(&front, &e[0].link);
    kvt__ioq_fifo_push(&front, &e[1].link);
    kvt__ioq_fifo_prepend(&f, &front);
    cr_assert_eq(front.n, 0);
    cr_assert_null(front.head);
    cr_assert_eq(f.n, 4);
    for (int i = 0; i < 4; i++)
        cr_assert_eq(id_of(kvt__ioq_fifo_pop(&f)), i);
    cr_assert_null(f.tail);
    kvt__ioq_fifo_t g = {0};
    kvt__ioq_fifo_prepend(&g, &front); /* both empty */
    cr_assert_eq(g.n, 0);

    kvt__ioq_t q;
    kvt__ioq_init(&q, 4);
    cr_assert_null(kvt__ioq_slot_get(&q));
    for (int i = 0; i < 4; i++)
        kvt__ioq_slot_put(&q, &e[i].link);
    int seen = 0;
    kvt__ioq_link_t *l;
    while ((l = kvt__ioq_slot_get(&q)))
        seen |= 1 << id_of(l);
    cr_assert_eq(seen, 0xf);
}

/* The reference: every request with its class, deadline and submit number; the next to leave is
 * the oldest urgent one, else the oldest other one. */
Test(tier_ioq, a_random_run_agrees_with_a_reference_model)
{
    enum { N = 4000 };
    static ent_t e[N];
    static int state[N]; /* 0 unused, 1 waiting, 2 in flight, 3 done */
    static uint64_t dl[N];
    kvt__ioq_t q;
    kvt__ioq_init(&q, 5);
    uint64_t s = 42, now = 0;
    int made = 0, inflight = 0;
    for (int step = 0; step < 20000; step++) {
        uint64_t r = tu_rand(&s) % 100;
        now += tu_rand(&s) % 3;
        if (r < 40 && made < N) {
            int i = made++;
            e[i] = (ent_t){.id = i, .urgent = (int)(tu_rand(&s) % 3 == 0)};
            dl[i] = tu_rand(&s) % 4 ? now + 50 : 0; /* every deadline: now + one timeout */
            e[i].link.deadline_ns = dl[i];
            int behind = 0;
            for (int j = 0; j < made - 1; j++)
                if (state[j] == 1 && (e[j].urgent || !e[i].urgent))
                    behind = 1;
            cr_assert_eq(kvt__ioq_behind(&q, e[i].urgent), behind);
            kvt__ioq_push(&q, &e[i].link, e[i].urgent);
            state[i] = 1;
        } else if (r < 75) {
            int want = -1;
            for (int c = 1; c >= 0 && want < 0; c--)
                for (int j = 0; j < made && want < 0; j++)
                    if (state[j] == 1 && e[j].urgent == c)
                        want = j;
            if (inflight >= 5)
                want = -1;
            int got = id_of(kvt__ioq_pop(&q));
            cr_assert_eq(got, want, "step %d", step);
            if (got >= 0) {
                state[got] = 2;
                inflight++;
            }
        } else if (r < 90) {
            if (inflight > 0) {
                for (int j = 0; j < made; j++) {
                    if (state[j] == 2) {
                        state[j] = 3;
                        break;
                    }
                }
                kvt__ioq_finished(&q);
                inflight--;
            }
        } else {
            static dropped_t d;
            d.n = 0;
            uint64_t want_next = UINT64_MAX;
            int want_n = 0;
            for (int j = 0; j < made; j++) {
                if (state[j] != 1 || !dl[j])
                    continue;
                if (dl[j] <= now)
                    want_n++;
                else
                    want_next = KVT_MIN(want_next, dl[j]);
            }
            cr_assert_eq(kvt__ioq_expire(&q, now, NULL, ent_drop, &d), want_next);
            cr_assert_eq(d.n, want_n);
            for (int k = 0; k < d.n; k++) {
                cr_assert(dl[d.ids[k]] && dl[d.ids[k]] <= now);
                cr_assert_eq(state[d.ids[k]], 1);
                state[d.ids[k]] = 3;
            }
        }
        cr_assert_eq(q.inflight, (uint32_t)inflight);
        size_t waiting = 0;
        for (int j = 0; j < made; j++)
            waiting += state[j] == 1;
        cr_assert_eq(kvt__ioq_waiting(&q), waiting);
    }
}
