/*
 * test_policy_random.c: every policy kind against random traffic (shared prefixes, repeats,
 * leases held across requests, removals behind the engine's back, pending moves), checked after
 * every operation against a simple reference: the executor's own per-tier byte counts, a full
 * scan of the tree (kvt_policy_verify), and the capacities, which must never be exceeded.
 */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "policy.h"

/* Checks in the loop report only failures: with --full-stats every cr_assert is an event. */
#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        if (!(cond))                                                                               \
            cr_assert_fail(__VA_ARGS__);                                                           \
    } while (0)

#define PS    4
#define PAGE  1024u
#define NPREF 6

typedef struct pend {
    kvt_radix_node_t *n;
    uint32_t depth, npages;
    kvt_tier_id_t from, to;
} pend_t;

typedef struct exec {
    uint64_t used[KVT_TIER_COUNT];
    kvt_policy_t *pol;
    pend_t pend[64];
    int npend;
    int pending_mode;
    kvt_radix_why_t call; /* the tree call running: the cause its frees must carry */
} exec_t;

static uint64_t rng = 0x1234567;

static uint32_t rnd(uint32_t n)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)(rng % n);
}

static kvt_block_t *run_at(kvt_radix_node_t *n, uint32_t depth)
{
    return kvt_radix_node_blocks(n) + (depth - kvt_radix_node_depth(n));
}

static int ex_move(void *arg, const kvt_policy_cause_t *why, kvt_radix_node_t *n, uint32_t depth,
                   uint32_t npages, kvt_tier_id_t from, kvt_tier_id_t to)
{
    exec_t *e = arg;
    CHECK(why && !why->req && why->tag == -1, "a move no caller asked for has no cause");
    CHECK(!kvt_radix_node_leased(n) || to < from, "a leased node was demoted");
    kvt_block_t *b = run_at(n, depth); /* a fresh (node, depth): the run is inside n */
    uint64_t bytes = 0;
    for (uint32_t i = 0; i < npages; i++) {
        CHECK(b[i].tier == from, "move of a block not in from");
        CHECK(!(b[i].flags & KVT_BLOCK_BUSY), "move of a busy block");
        bytes += b[i].size;
    }
    if (e->pending_mode && e->npend < 64 && to > from) {
        for (uint32_t i = 0; i < npages; i++)
            b[i].flags |= KVT_BLOCK_BUSY;
        e->pend[e->npend++] = (pend_t){n, depth, npages, from, to};
        e->used[to] += bytes; /* the copy's destination is written first */
        return KVT_POLICY_PENDING;
    }
    e->used[from] -= bytes;
    e->used[to] += bytes;
    return 0;
}

static int ex_admit(void *arg, kvt_radix_node_t *n, uint32_t depth, uint32_t npages,
                    kvt_tier_id_t tier)
{
    (void)n;
    (void)depth;
    ((exec_t *)arg)->used[tier] += (uint64_t)npages * PAGE;
    return 0;
}

static void ex_free(void *arg, uint32_t ns, kvt_block_t *b, kvt_radix_why_t why)
{
    exec_t *e = arg;
    CHECK(why == e->call, "a block freed with cause %d inside a call of cause %d", why, e->call);
    CHECK(!(b->flags & KVT_BLOCK_BUSY), "a block with a copy in flight was freed");
    if (b->tier != KVT_TIER_NONE)
        e->used[b->tier] -= b->size;
    if (e->pol)
        kvt_policy_on_free(e->pol, ns, b);
}

static void ex_node_free(void *arg, kvt_radix_node_t *n, kvt_radix_why_t why)
{
    (void)why;
    exec_t *e = arg;
    if (e->pol)
        kvt_policy_on_node_free(e->pol, n);
}

static const kvt_policy_ops_t ops = {ex_move, ex_admit};

static void finish_pending(exec_t *e, kvt_policy_t *pol)
{
    for (int i = 0; i < e->npend; i++) {
        pend_t *q = &e->pend[i];
        uint64_t bytes = 0;
        for (uint32_t j = 0; j < q->npages; j++) {
            /* the node may have been split since: find each page through its ancestors */
            kvt_block_t *b = kvt_radix_block_at(q->n, q->depth + j);
            CHECK(b != NULL, "pending page gone");
            b->flags &= (uint8_t)~KVT_BLOCK_BUSY;
            bytes += b->size;
        }
        int ok = rnd(4) != 0; /* one in four copies fails */
        int r =
            kvt_policy_move_done(pol, q->n, q->depth, q->npages, q->from, q->to, ok ? 0 : KVT_EIO);
        CHECK(r == 0 || (ok && r == KVT_EAGAIN), "move_done: %d", r);
        if (r == KVT_EAGAIN)
            ok = 0; /* kept in `from`: the copy in `to` is freed */
        if (ok)
            e->used[q->from] -= bytes;
        else
            e->used[q->to] -= bytes;
    }
    e->npend = 0;
}

static void check(kvt_radix_t *t, kvt_policy_t *pol, exec_t *e)
{
    kvt_policy_stats_t st;
    kvt_policy_stats(pol, &st);
    for (int k = KVT_TIER_HBM; k < KVT_TIER_COUNT; k++) {
        CHECK(st.used[k] <= st.capacity[k], "tier %d over capacity", k);
        CHECK(st.used[k] == e->used[k], "tier %d: engine %llu, executor %llu", k,
              (unsigned long long)st.used[k], (unsigned long long)e->used[k]);
    }
    CHECK(kvt_policy_verify(pol) == 0, "policy verify");
    CHECK(kvt_radix_verify(t) == 0, "radix verify");
}

/*
 * The new pages of ins written by the executor itself, as kvtierd's PUT does: the path pinned,
 * each page's room held in the fastest tier that has it (made, on a second pass, as for an
 * insert), maintenance running while the writes are in flight, then the holds given back and the
 * pages adopted by runs of one tier (a run the node's order refuses is freed). Returns the pages
 * adopted; *made counts the holds that needed room made.
 */
static uint32_t executor_writes(kvt_radix_t *t, kvt_policy_t *pol, exec_t *e, uint32_t ns,
                                const kvt_insert_t *ins, uint32_t *made)
{
    if (ins->new_pages == 0)
        return 0;
    kvt_radix_node_t *n = ins->node;
    kvt_match_t pin = {n, kvt_radix_node_pages(n),
                       kvt_radix_node_depth(n) + kvt_radix_node_pages(n), ns};
    uint64_t lease;
    CHECK(kvt_radix_lease(t, &pin, 77, &lease) == 0, "pin");
    uint8_t held[64] = {0};
    uint32_t np = KVT_MIN(ins->new_pages, 64u);
    for (uint32_t j = 0; j < np; j++)
        for (int room = 0; room < 2 && held[j] == KVT_TIER_NONE; room++)
            for (int k = KVT_TIER_HBM; k < KVT_TIER_COUNT && held[j] == KVT_TIER_NONE; k++) {
                int rc = kvt_policy_hold(pol, (kvt_tier_id_t)k, PAGE, room);
                CHECK(rc == 0 || rc == KVT_EINVAL || rc == KVT_ENOSPC || rc == KVT_EAGAIN,
                      "hold: %d", rc);
                if (rc == 0) {
                    held[j] = (uint8_t)k;
                    e->used[k] += PAGE;
                    *made += (uint32_t)room;
                }
            }
    check(t, pol, e);
    if (rnd(2)) {
        CHECK(kvt_policy_step(pol, 0) >= 0, "step with writes in flight");
        check(t, pol, e);
    }
    uint32_t adopted = 0;
    for (uint32_t j = 0; j < np; j++)
        if (held[j] != KVT_TIER_NONE)
            kvt_policy_unhold(pol, (kvt_tier_id_t)held[j], PAGE);
    for (uint32_t j = 0; j < np;) {
        uint32_t k = j + 1;
        while (k < np && held[k] == held[j])
            k++;
        if (held[j] != KVT_TIER_NONE) {
            uint32_t d = ins->first_page + j;
            for (uint32_t q = j; q < k; q++)
                kvt_radix_block_at(n, ins->first_page + q)->size = PAGE;
            int rc = kvt_policy_adopt(pol, kvt_radix_node_holding(n, d), d, k - j,
                                      (kvt_tier_id_t)held[j], ins->pages, NULL);
            CHECK(rc == (int)(k - j) || rc == KVT_EAGAIN, "adopt: %d", rc);
            if (rc > 0) {
                adopted += (uint32_t)rc;
            } else { /* the executor frees what it wrote */
                for (uint32_t q = j; q < k; q++)
                    kvt_radix_block_at(n, ins->first_page + q)->size = 0;
                e->used[held[j]] -= (uint64_t)(k - j) * PAGE;
            }
        }
        j = k;
    }
    CHECK(kvt_radix_release(t, lease) == 0, "unpin");
    check(t, pol, e);
    return adopted;
}

/* A tree of one namespace of PS-token pages whose frees go to e (and to e's policy). */
static kvt_radix_t *new_tree(exec_t *e, int reports, uint32_t *ns)
{
    kvt_radix_t *t;
    kvt_radix_conf_t rc = {
        .free_cb = ex_free, .node_free_cb = reports ? ex_node_free : NULL, .free_arg = e};
    cr_assert_eq(kvt_radix_create(&t, &rc), 0);
    cr_assert_eq(kvt_radix_ns_open(t, "tiny", NULL, NULL, PS, ns), 0);
    return t;
}

/* A policy of the tiny model (a page of PS tokens weighs PAGE bytes) on flat hardware, executed
 * by e; no tier configured yet. */
static kvt_policy_conf_t tiny_conf(kvt_policy_kind_t kind, exec_t *e, int reports)
{
    kvt_policy_conf_t c;
    memset(&c, 0, sizeof(c));
    c.kind = kind;
    c.model = (kvt_model_profile_t){"tiny", 1, 1, 64, 2, 1, 64, 1e6};
    c.hw = (kvt_hw_profile_t){"flat", 1e9, {0, 1e12, 1e11, 1e4, 1e9}, {0, 0, 0, 0, 0}};
    c.ops = &ops;
    c.ops_arg = e;
    c.reports_node_frees = reports;
    return c;
}

/* reports: the tree tells the engine of every node it frees (as kvtierd and the replay do), so
 * frees the engine did not ask for cost no rebuild of its heaps: with ASan, a heap entry left
 * naming a freed node would show. Returns the pages with bytes dropped for the index: whether a
 * run's byte trims meet such a page depends on the index's byte counts (the trims aim at
 * fractions of them), so each test asserts that its runs together dropped some (one run of
 * node_frees_reported_need_no_rebuild drops 27 of them on malloc'd nodes and none in the arena's
 * slots, another 13 against 27). */
static uint64_t random_run(kvt_policy_kind_t kind, int pending, int reports)
{
    exec_t e;
    memset(&e, 0, sizeof(e));
    e.pending_mode = pending;
    uint32_t ns;
    kvt_radix_t *t = new_tree(&e, reports, &ns);
    kvt_policy_conf_t c = tiny_conf(kind, &e, reports);
    uint32_t pages[KVT_TIER_COUNT] = {0, 5 + rnd(10), 10 + rnd(20), 20 + rnd(40), rnd(2) * 30};
    for (int k = KVT_TIER_HBM; k < KVT_TIER_COUNT; k++) {
        c.tiers[k].capacity = (uint64_t)pages[k] * PAGE;
        c.tiers[k].high = 0.9f;
        c.tiers[k].low = 0.7f;
    }
    c.nvme_min_hits = rnd(2);
    kvt_policy_t *pol;
    cr_assert_eq(kvt_policy_create(&pol, t, &c), 0);
    e.pol = pol;

    /* prompts: one of a few shared prefixes, then a random tail; some repeat exactly */
    uint32_t tok[256], prev[256], prevn = 0;
    uint64_t leases[8] = {0};
    uint32_t nextu[64];
    uint64_t trimmed = 0, dropped = 0;
    uint32_t self_adopted = 0, room_made = 0;
    for (int i = 0; i < 3000; i++) {
        kvt_radix_set_clock(t, (uint32_t)i * 10);
        uint32_t n;
        if (prevn && rnd(3) == 0) {
            n = prevn;
            memcpy(tok, prev, n * sizeof(uint32_t));
            n = KVT_MIN(n + rnd(3) * PS, 200u); /* a follow-up turn */
            for (uint32_t j = prevn; j < n; j++)
                tok[j] = 500000 + rnd(1000);
        } else {
            uint32_t pre = rnd(NPREF), plen = 4 + rnd(24);
            n = plen + rnd(100);
            for (uint32_t j = 0; j < plen; j++)
                tok[j] = pre * 1000 + j;
            for (uint32_t j = plen; j < n; j++)
                tok[j] = 100000 + rnd(50000);
        }
        memcpy(prev, tok, n * sizeof(uint32_t));
        prevn = n;

        kvt_match_t m;
        CHECK(kvt_radix_match(t, ns, tok, n, 0, &m) == 0, "match");
        kvt_policy_hint_t h;
        memset(&h, 0, sizeof(h));
        for (uint32_t j = 0; j < 64; j++)
            nextu[j] = rnd(4) ? (uint32_t)i * 10 + rnd(5000) : UINT32_MAX;
        h.next_use = nextu;
        h.nnext = 64;
        h.priority = (uint16_t)(rnd(8) == 0 ? rnd(1001) : 0);
        h.finished = rnd(10) == 0;
        h.paused_ms = rnd(10) == 0 ? rnd(100000) : 0;
        h.from_page = rnd(4);
        CHECK(kvt_policy_verify(pol) == 0, "before match %d", i);
        kvt_policy_on_match(pol, &m, &h);
        CHECK(kvt_policy_verify(pol) == 0, "after on_match %d", i);
        int slot = (int)rnd(8);
        if (leases[slot]) {
            kvt_radix_release(t, leases[slot]);
            leases[slot] = 0;
        }
        if (m.pages && rnd(3) == 0)
            CHECK(kvt_radix_lease(t, &m, 1 + (uint64_t)slot, &leases[slot]) == 0, "lease");
        kvt_insert_t ins;
        int r = kvt_radix_insert_matched(t, &m, tok, n, &ins);
        CHECK(r == 0 || r == KVT_EEXIST, "insert: %d", r);
        CHECK(kvt_policy_verify(pol) == 0, "after insert %d", i);
        if (rnd(4) == 0)
            ; /* an index-only PUT: the pages stay in no tier */
        else if (rnd(3) == 0 && r == 0)
            self_adopted += executor_writes(t, pol, &e, ns, &ins, &room_made);
        else
            CHECK(kvt_policy_on_insert(pol, &ins, &h) >= 0, "on_insert");
        CHECK(kvt_policy_verify(pol) == 0, "after on_insert %d", i);
        check(t, pol, &e);
        CHECK(kvt_policy_step(pol, rnd(2) ? 0 : 1 + rnd(16)) >= 0, "step");
        CHECK(kvt_policy_verify(pol) == 0, "after step %d", i);
        check(t, pol, &e);
        if (rnd(20) == 0) { /* the index over its memory limit: index-only pages go, no other */
            kvt_radix_stats_t rs;
            kvt_radix_stats(t, &rs);
            uint64_t used[KVT_TIER_COUNT];
            memcpy(used, e.used, sizeof used);
            uint32_t got = kvt_policy_trim_index(pol, rs.bytes / 100 * (50 + rnd(50)), rnd(64));
            trimmed += got;
            CHECK(memcmp(used, e.used, sizeof used) == 0, "a trim freed tier bytes");
            CHECK(kvt_policy_verify(pol) == 0, "after trim %d", i);
            check(t, pol, &e);
        }
        if (rnd(40) == 0) { /* index-only pages not enough: pages with bytes go too, freed */
            kvt_radix_stats_t rs;
            kvt_radix_stats(t, &rs);
            kvt_policy_stats_t before;
            kvt_policy_stats(pol, &before);
            uint32_t got =
                kvt_policy_trim_index_bytes(pol, rs.bytes / 100 * (50 + rnd(50)), 1 + rnd(64));
            kvt_policy_stats_t after;
            kvt_policy_stats(pol, &after);
            dropped += after.pages_dropped_for_index - before.pages_dropped_for_index;
            trimmed += after.index_trimmed - before.index_trimmed;
            CHECK(got == (after.pages_dropped_for_index - before.pages_dropped_for_index) +
                             (after.index_trimmed - before.index_trimmed),
                  "trim %d: %u pages counted", i, got);
            CHECK(kvt_policy_verify(pol) == 0, "after byte trim %d", i);
            check(t, pol, &e);
        }
        if (rnd(50) == 0) { /* a removal the engine did not ask for */
            uint32_t cut = PS * (1 + rnd(n / PS + 1));
            e.call = KVT_RADIX_REMOVE;
            int rr = kvt_radix_remove(t, ns, tok, KVT_MIN(cut, n));
            e.call = KVT_RADIX_EVICT;
            CHECK(rr == 0 || rr == KVT_ENOENT || rr == KVT_EBUSY || rr == KVT_EINVAL, "remove: %d",
                  rr);
            check(t, pol, &e);
        }
        if (e.npend && rnd(3) == 0) {
            finish_pending(&e, pol);
            check(t, pol, &e);
        }
    }
    finish_pending(&e, pol);
    for (int k = 0; k < 8; k++)
        if (leases[k])
            kvt_radix_release(t, leases[k]);
    e.pending_mode = 0;
    cr_assert_geq(kvt_policy_step(pol, 0), 0);
    check(t, pol, &e);
    kvt_policy_stats_t st;
    kvt_policy_stats(pol, &st);
    cr_assert_gt(st.demotions + st.dropped_blocks, 0, "the test must exercise eviction");
    cr_assert_eq(st.index_trimmed, trimmed);
    cr_assert_gt(trimmed, 0, "the test must exercise the index trim");
    cr_assert_eq(st.pages_dropped_for_index, dropped);
    cr_assert_gt(self_adopted, 0, "the test must adopt pages the executor wrote");
    cr_assert_gt(room_made, 0, "the test must make room for them");
    e.call = KVT_RADIX_DESTROY;
    kvt_radix_destroy(t);
    for (int k = 0; k < KVT_TIER_COUNT; k++)
        cr_assert_eq(e.used[k], 0);
    cr_assert_eq(st.sweeps, 0, "no tree here is large enough for sweeps");
    kvt_policy_destroy(pol);
    return dropped;
}

Test(policy_random, cost_never_exceeds_capacity)
{
    cr_assert_gt(random_run(KVT_POLICY_COST, 0, 0), 0, "pages with bytes dropped for the index");
}

Test(policy_random, lru_never_exceeds_capacity)
{
    cr_assert_gt(random_run(KVT_POLICY_LRU, 0, 0), 0, "pages with bytes dropped for the index");
}

Test(policy_random, lfu_never_exceeds_capacity)
{
    cr_assert_gt(random_run(KVT_POLICY_LFU, 0, 0), 0, "pages with bytes dropped for the index");
}

Test(policy_random, oracle_never_exceeds_capacity)
{
    cr_assert_gt(random_run(KVT_POLICY_ORACLE, 0, 0), 0, "pages with bytes dropped for the index");
}

Test(policy_random, pending_moves_keep_the_accounting)
{
    uint64_t dropped = random_run(KVT_POLICY_COST, 1, 0);
    dropped += random_run(KVT_POLICY_LRU, 1, 0);
    cr_assert_gt(dropped, 0, "pages with bytes dropped for the index");
}

Test(policy_random, node_frees_reported_need_no_rebuild)
{
    uint64_t dropped = random_run(KVT_POLICY_COST, 0, 1);
    dropped += random_run(KVT_POLICY_COST, 1, 1);
    dropped += random_run(KVT_POLICY_LFU, 1, 1);
    cr_assert_gt(dropped, 0, "pages with bytes dropped for the index");
}

/*
 * A tree counted as large (sweep_above 256): a refreshed cost model renews the victim heaps by
 * sweeps of 16 nodes per step, with inserts, splits, hits, leases, drops and removals the engine
 * did not ask for between the slices. Checked after every step against the executor's counts
 * and capacities; ASan would show a swept node that had been freed. Without node deaths
 * reported, the registry's copy cannot be trusted and the rebuild stays whole.
 */
static kvt_policy_stats_t sweep_run(int reports)
{
    exec_t e;
    memset(&e, 0, sizeof(e));
    uint32_t ns;
    kvt_radix_t *t = new_tree(&e, reports, &ns);
    kvt_policy_conf_t c = tiny_conf(KVT_POLICY_COST, &e, reports);
    c.tiers[KVT_TIER_DRAM].capacity = 1500ull * PAGE;
    c.tiers[KVT_TIER_NVME].capacity = 3000ull * PAGE;
    c.sweep_above = 256;
    c.sweep_slice = 16;
    kvt_policy_t *pol;
    cr_assert_eq(kvt_policy_create(&pol, t, &c), 0);
    e.pol = pol;
    enum { N = 6000, LEN = 3 * PS };
    static uint32_t prompts[N][LEN];
    uint64_t leases[16] = {0};
    for (int i = 0; i < N; i++) {
        kvt_radix_set_clock(t, (uint32_t)i * 10);
        uint32_t *tok = prompts[i];
        if (i > 0 && rnd(3) == 0) { /* shares a page or two with an earlier one: a split */
            uint32_t keep = PS * (1 + rnd(2));
            memcpy(tok, prompts[rnd((uint32_t)i)], keep * sizeof(uint32_t));
            for (uint32_t j = keep; j < LEN; j++)
                tok[j] = 1 + rnd(1u << 30);
        } else {
            for (uint32_t j = 0; j < LEN; j++)
                tok[j] = 1 + rnd(1u << 30);
        }
        kvt_insert_t ins;
        int r = kvt_radix_insert(t, ns, tok, LEN, &ins);
        CHECK(r == 0 || r == KVT_EEXIST, "insert: %d", r);
        CHECK(kvt_policy_on_insert(pol, &ins, NULL) >= 0, "on_insert");
        const uint32_t *old = prompts[rnd((uint32_t)i + 1)];
        kvt_match_t m;
        CHECK(kvt_radix_match(t, ns, old, LEN, 0, &m) == 0, "match");
        kvt_policy_on_match(pol, &m, NULL);
        int slot = (int)rnd(16);
        if (leases[slot]) {
            kvt_radix_release(t, leases[slot]);
            leases[slot] = 0;
        }
        if (m.pages && rnd(4) == 0)
            CHECK(kvt_radix_lease(t, &m, 1 + (uint64_t)slot, &leases[slot]) == 0, "lease");
        if (rnd(40) == 0) { /* a removal the engine did not ask for */
            e.call = KVT_RADIX_REMOVE;
            int rr = kvt_radix_remove(t, ns, prompts[rnd((uint32_t)i + 1)], LEN);
            e.call = KVT_RADIX_EVICT;
            CHECK(rr == 0 || rr == KVT_ENOENT || rr == KVT_EBUSY || rr == KVT_EINVAL, "remove: %d",
                  rr);
        }
        CHECK(kvt_policy_step(pol, 0) >= 0, "step");
        check(t, pol, &e);
    }
    for (int k = 0; k < 16; k++)
        if (leases[k])
            kvt_radix_release(t, leases[k]);
    kvt_policy_stats_t st;
    kvt_policy_stats(pol, &st);
    cr_assert_gt(st.demotions, 0, "the test must exercise eviction");
    cr_assert_gt(st.dropped_blocks, 0);
    e.call = KVT_RADIX_DESTROY;
    kvt_radix_destroy(t);
    for (int k = 0; k < KVT_TIER_COUNT; k++)
        cr_assert_eq(e.used[k], 0);
    kvt_policy_destroy(pol);
    return st;
}

Test(policy_random, large_trees_renew_their_heaps_by_sweeps)
{
    kvt_policy_stats_t st = sweep_run(1);
    cr_assert_gt(st.sweeps, 10, "%llu sweeps, %llu whole rebuilds", (unsigned long long)st.sweeps,
                 (unsigned long long)st.rebuilds);
    cr_expect_lt(st.rebuilds, st.sweeps, "%llu sweeps, %llu whole rebuilds",
                 (unsigned long long)st.sweeps, (unsigned long long)st.rebuilds);
    st = sweep_run(0);
    cr_assert_eq(st.sweeps, 0);
    cr_assert_gt(st.rebuilds, 0);
}
