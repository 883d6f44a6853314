/*
 * test_policy_decisions.c: each decision of the policy engine on a real radix tree with a test
 * executor that keeps its own per-tier byte counts: demote, drop, promote, prefetch, never move
 * a leased block, never orphan a cached child, drop when recomputing is cheaper, NVMe admission,
 * hints, pending moves, removals behind the engine's back, and bad input. A tiny model makes a
 * page of 4 tokens weigh exactly 1024 bytes, so capacities read in pages.
 */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "policy.h"
#include "policy_test.h"

#define PS   4
#define PAGE 1024u

typedef struct exec {
    uint64_t used[KVT_TIER_COUNT];
    uint64_t moves, admits;
    uint64_t pending_pages; /* pages of the moves answered KVT_POLICY_PENDING */
    int pending;            /* answer moves with KVT_POLICY_PENDING */
    int fail;               /* answer moves with KVT_EIO */
    kvt_policy_t *pol;
    /* the last move answered KVT_POLICY_PENDING, for land_last() */
    kvt_radix_node_t *last_n;
    uint32_t last_depth, last_npages;
    kvt_tier_id_t last_from, last_to;
} exec_t;

static kvt_radix_t *tree;
static kvt_policy_t *pol;
static exec_t ex;
static uint32_t ns;
static uint32_t clk;

static uint64_t run_bytes(kvt_radix_node_t *n, uint32_t depth, uint32_t npages)
{
    kvt_block_t *b = kvt_radix_node_blocks(n) + (depth - kvt_radix_node_depth(n));
    uint64_t s = 0;
    for (uint32_t i = 0; i < npages; i++)
        s += b[i].size;
    return s;
}

static int ex_move(void *arg, const kvt_policy_cause_t *why, kvt_radix_node_t *n, uint32_t depth,
                   uint32_t npages, kvt_tier_id_t from, kvt_tier_id_t to)
{
    exec_t *e = arg;
    cr_assert_not_null(why);
    cr_assert(!kvt_radix_node_leased(n) || to < from, "a leased node was demoted");
    if (e->fail)
        return KVT_EIO;
    uint64_t b = run_bytes(n, depth, npages);
    cr_assert_geq(e->used[from], b);
    e->moves++;
    if (e->pending) {
        kvt_block_t *bl = kvt_radix_node_blocks(n) + (depth - kvt_radix_node_depth(n));
        for (uint32_t i = 0; i < npages; i++)
            bl[i].flags |= KVT_BLOCK_BUSY;
        e->pending_pages += npages;
        e->last_n = n;
        e->last_depth = depth;
        e->last_npages = npages;
        e->last_from = from;
        e->last_to = to;
        return KVT_POLICY_PENDING;
    }
    e->used[from] -= b;
    e->used[to] += b;
    return 0;
}

static int ex_admit(void *arg, kvt_radix_node_t *n, uint32_t depth, uint32_t npages,
                    kvt_tier_id_t tier)
{
    (void)n;
    (void)depth;
    exec_t *e = arg;
    e->used[tier] += (uint64_t)npages * PAGE;
    e->admits++;
    return 0;
}

static void ex_free(void *arg, uint32_t nsid, kvt_block_t *b, kvt_radix_why_t why)
{
    (void)why;
    exec_t *e = arg;
    if (b->tier != KVT_TIER_NONE) {
        cr_assert_geq(e->used[b->tier], b->size);
        e->used[b->tier] -= b->size;
    }
    if (e->pol)
        kvt_policy_on_free(e->pol, nsid, b);
}

static const kvt_policy_ops_t ops = {ex_move, ex_admit};

static kvt_model_profile_t tiny_model(void)
{
    kvt_model_profile_t m = {"tiny", 1, 1, 64, 2, 1, 64, 1e6};
    return m;
}

static kvt_hw_profile_t flat_hw(void)
{
    /* everything loads far faster than it recomputes */
    kvt_hw_profile_t hw = {"flat", 1e9, {0, 1e12, 1e11, 1e10, 1e9}, {0, 0, 0, 0, 0}};
    return hw;
}

static kvt_policy_conf_t base_conf(kvt_policy_kind_t kind, uint32_t hbm, uint32_t dram,
                                   uint32_t nvme)
{
    kvt_policy_conf_t c;
    memset(&c, 0, sizeof(c));
    c.kind = kind;
    c.model = tiny_model();
    c.hw = flat_hw();
    uint32_t pages[KVT_TIER_COUNT] = {0, hbm, dram, nvme, 0};
    for (int t = KVT_TIER_HBM; t < KVT_TIER_COUNT; t++) {
        c.tiers[t].capacity = (uint64_t)pages[t] * PAGE;
        c.tiers[t].high = 1.0f;
        c.tiers[t].low = 1.0f;
    }
    c.ops = &ops;
    c.ops_arg = &ex;
    return c;
}

static void start(const kvt_policy_conf_t *c)
{
    memset(&ex, 0, sizeof(ex));
    kvt_radix_conf_t rc = {.free_cb = ex_free, .free_arg = &ex};
    cr_assert_eq(kvt_radix_create(&tree, &rc), 0);
    cr_assert_eq(kvt_radix_ns_open(tree, "tiny", NULL, NULL, PS, &ns), 0);
    cr_assert_eq(kvt_policy_create(&pol, tree, c), 0);
    ex.pol = pol;
    clk = 0;
    cr_assert_eq(kvt_policy_block_bytes(pol, ns), PAGE);
}

static void check(void)
{
    kvt_policy_stats_t st;
    kvt_policy_stats(pol, &st);
    cr_assert_eq(kvt_policy_verify(pol), 0);
    cr_assert_eq(kvt_radix_verify(tree), 0);
    for (int t = KVT_TIER_HBM; t < KVT_TIER_COUNT; t++) {
        cr_assert_leq(st.used[t], st.capacity[t], "tier %d over capacity", t);
        if (!ex.pending)
            cr_assert_eq(st.used[t], ex.used[t], "tier %d: policy %llu, executor %llu", t,
                         (unsigned long long)st.used[t], (unsigned long long)ex.used[t]);
    }
}

static void stop(void)
{
    check();
    kvt_radix_destroy(tree); /* frees every block through the policy */
    for (int t = 0; t < KVT_TIER_COUNT; t++)
        cr_assert_eq(ex.used[t], 0);
    kvt_policy_destroy(pol);
    tree = NULL;
    pol = NULL;
}

static uint32_t *seq(uint32_t n, uint32_t base)
{
    uint32_t *s = malloc((n + 1) * sizeof(uint32_t));
    for (uint32_t i = 0; i < n; i++)
        s[i] = base + i;
    return s;
}

/* One request as the service runs it. Returns the pages matched. */
static uint32_t request(const uint32_t *tok, uint32_t n, const kvt_policy_hint_t *hint)
{
    kvt_radix_set_clock(tree, ++clk);
    kvt_match_t m;
    cr_assert_eq(kvt_radix_match(tree, ns, tok, n, 0, &m), 0);
    kvt_policy_on_match(pol, &m, hint);
    kvt_insert_t ins;
    cr_assert_eq(kvt_radix_insert_matched(tree, &m, tok, n, &ins), 0);
    cr_assert_geq(kvt_policy_on_insert(pol, &ins, hint), 0);
    cr_assert_geq(kvt_policy_step(pol, 0), 0);
    check();
    return m.pages;
}

/* The tier of page `page` of tok, or -1 when it is not cached. */
static int tier_of(const uint32_t *tok, uint32_t page)
{
    kvt_match_t m;
    cr_assert_eq(kvt_radix_match(tree, ns, tok, (size_t)(page + 1) * PS, KVT_MATCH_NOTOUCH, &m), 0);
    if (m.pages < page + 1)
        return -1;
    return kvt_radix_block_at(m.node, page)->tier;
}

static void all_in(const uint32_t *tok, uint32_t pages, int tier)
{
    for (uint32_t i = 0; i < pages; i++)
        cr_assert_eq(tier_of(tok, i), tier, "page %u: tier %d, want %d", i, tier_of(tok, i), tier);
}

Test(policy_decisions, demote_the_least_recent_when_full)
{
    kvt_policy_conf_t c = base_conf(KVT_POLICY_LRU, 4, 100, 0);
    start(&c);
    uint32_t *a = seq(16, 1000), *b = seq(16, 2000);
    request(a, 16, NULL);
    all_in(a, 4, KVT_TIER_HBM);
    request(b, 16, NULL);
    all_in(b, 4, KVT_TIER_HBM);
    all_in(a, 4, KVT_TIER_DRAM);
    kvt_policy_stats_t st;
    kvt_policy_stats(pol, &st);
    cr_assert_eq(st.moved_bytes[KVT_TIER_HBM][KVT_TIER_DRAM], 4 * PAGE);
    cr_assert_eq(st.dropped_blocks, 0);
    free(a);
    free(b);
    stop();
}

/* A split makes a new node above the old one, holding the old node's head pages (radix.h). That
 * node is a victim as any other from then on: it joins the heaps at once rather than at their
 * next rebuild. Here LRU must demote a's head (used at clock 2) before e (clock 3): the split
 * head was left out of the heap, and e's tail went first. */
Test(policy_decisions, a_split_head_is_a_victim_at_once)
{
    kvt_policy_conf_t c = base_conf(KVT_POLICY_LRU, 8, 100, 0);
    start(&c);
    uint32_t *a = seq(16, 1000), *e = seq(16, 2000), *f = seq(16, 3000);
    uint32_t *a2 = seq(16, 5000);
    memcpy(a2, a, 8 * sizeof(uint32_t)); /* a's first 2 pages, then 2 of its own */
    request(a, 16, NULL);                /* clock 1: [A B C D] */
    request(a2, 16, NULL);               /* clock 2: [A B] -> [C D], [A B] -> [X Y] */
    all_in(a2, 4, KVT_TIER_HBM);
    request(e, 16, NULL); /* clock 3: room for 4 by demoting C D, the oldest */
    cr_assert_eq(tier_of(a, 2), KVT_TIER_DRAM);
    all_in(a2, 4, KVT_TIER_HBM);
    request(f, 16, NULL); /* clock 4: room for 4: X Y (clock 2, deeper), then A B (clock 2) */
    all_in(a, 4, KVT_TIER_DRAM);
    all_in(a2, 4, KVT_TIER_DRAM);
    all_in(e, 4, KVT_TIER_HBM);
    all_in(f, 4, KVT_TIER_HBM);
    free(a);
    free(a2);
    free(e);
    free(f);
    stop();
}

/* The same for a split outside an insert (kvtierd's PUT with gaps): its caller hands the new
 * node to the engine. a's head (clock 1) goes before e (clock 2). */
Test(policy_decisions, a_split_at_head_is_a_victim_once_handed_over)
{
    kvt_policy_conf_t c = base_conf(KVT_POLICY_LRU, 6, 100, 0);
    start(&c);
    uint32_t *a = seq(16, 1000), *e = seq(16, 2000), *f = seq(16, 3000);
    request(a, 16, NULL); /* clock 1: [A B C D] */
    kvt_match_t m;
    cr_assert_eq(kvt_radix_match(tree, ns, a, 16, KVT_MATCH_NOTOUCH, &m), 0);
    cr_assert_eq(kvt_radix_split_at(tree, m.node, 2), 0); /* [A B] -> [C D] */
    kvt_radix_node_t *head = kvt_radix_node_parent(m.node);
    cr_assert_eq(kvt_radix_node_pages(head), 2);
    kvt_policy_on_split(pol, head);
    kvt_policy_on_split(pol, NULL); /* a no-op */
    request(e, 16, NULL); /* clock 2: room for 4 by demoting C D (clock 1, deeper than A B) */
    cr_assert_eq(tier_of(a, 2), KVT_TIER_DRAM);
    cr_assert_eq(tier_of(a, 0), KVT_TIER_HBM);
    request(f, 16, NULL); /* clock 3: room for 4: A B (clock 1), then e's tail */
    all_in(a, 4, KVT_TIER_DRAM);
    all_in(e, 2, KVT_TIER_HBM);
    cr_assert_eq(tier_of(e, 3), KVT_TIER_DRAM);
    all_in(f, 4, KVT_TIER_HBM);
    free(a);
    free(e);
    free(f);
    stop();
}

/* Victims of equal keys go oldest first. The cost policy computes a key when it pushes it, so
 * the leaves of one class pushed at age 0 weigh the same until the heaps are rebuilt; the heap
 * took the newest of them first as soon as a pop had moved its last entry up (kvtierd dropped
 * the chains just stored and kept the oldest). Chains share a prefix, each adds 2 pages of its
 * own, and the tier holds 20 pages: the 3 oldest chains' pages go. */
Test(policy_decisions, equal_victims_go_oldest_first)
{
    kvt_policy_conf_t c = base_conf(KVT_POLICY_COST, 0, 20, 0);
    start(&c);
    enum { N = 12 };
    uint32_t *tok[N];
    for (uint32_t i = 0; i < N; i++) {
        tok[i] = seq(16, 1000 * (i + 2));
        for (uint32_t k = 0; k < 8; k++)
            tok[i][k] = 100 + k; /* the shared 2 pages */
        request(tok[i], 16, NULL);
    }
    for (uint32_t i = 0; i < N; i++) {
        int want = i < 3 ? -1 : KVT_TIER_DRAM;
        cr_expect_eq(tier_of(tok[i], 3), want, "chain %u: tier %d, want %d", i, tier_of(tok[i], 3),
                     want);
    }
    for (uint32_t i = 0; i < N; i++)
        free(tok[i]);
    stop();
}

/* An insert that finds some room left in the top tier makes room there for all of its pages,
 * not for the shortfall alone: make_room's need is the free bytes wanted, and passing it what
 * was missing beyond the free room freed too little (with 2 pages free for 4, nothing at all),
 * so part of the newest prompt landed one tier down while colder pages kept the top tier. Every
 * kind, and the oracle on both of its schedules (b is used sooner than a). */
static void insert_fills_the_top_tier(kvt_policy_kind_t kind, int oracle_demand)
{
    kvt_policy_conf_t c = base_conf(kind, 6, 100, 0);
    c.oracle_demand = oracle_demand;
    start(&c);
    uint32_t *a = seq(16, 1000), *b = seq(16, 2000);
    uint32_t na[4] = {100, 100, 100, 100}, nb[4] = {10, 10, 10, 10};
    kvt_policy_hint_t ha = {.next_use = na, .nnext = 4}, hb = {.next_use = nb, .nnext = 4};
    int oracle = kind == KVT_POLICY_ORACLE;
    request(a, 16, oracle ? &ha : NULL);
    all_in(a, 4, KVT_TIER_HBM); /* 2 pages of HBM left */
    request(b, 16, oracle ? &hb : NULL);
    all_in(b, 4, KVT_TIER_HBM);
    kvt_policy_stats_t st;
    kvt_policy_stats(pol, &st);
    cr_assert_eq(st.blocks[KVT_TIER_HBM], 6);
    cr_assert_eq(st.blocks[KVT_TIER_DRAM], 2, "a's 2 pages that left HBM went to DRAM");
    cr_assert_eq(st.rejected, 0);
    free(a);
    free(b);
    stop();
}

Test(policy_decisions, insert_makes_room_for_all_its_pages_lru)
{
    insert_fills_the_top_tier(KVT_POLICY_LRU, 0);
}

Test(policy_decisions, insert_makes_room_for_all_its_pages_lfu)
{
    insert_fills_the_top_tier(KVT_POLICY_LFU, 0);
}

Test(policy_decisions, insert_makes_room_for_all_its_pages_cost)
{
    insert_fills_the_top_tier(KVT_POLICY_COST, 0);
}

Test(policy_decisions, insert_makes_room_for_all_its_pages_oracle)
{
    insert_fills_the_top_tier(KVT_POLICY_ORACLE, 1);
    insert_fills_the_top_tier(KVT_POLICY_ORACLE, 0);
}

Test(policy_decisions, drop_when_no_lower_tier)
{
    kvt_policy_conf_t c = base_conf(KVT_POLICY_LRU, 4, 0, 0);
    start(&c);
    uint32_t *a = seq(16, 1000), *b = seq(16, 2000);
    request(a, 16, NULL);
    request(b, 16, NULL);
    all_in(b, 4, KVT_TIER_HBM);
    cr_assert_eq(tier_of(a, 0), -1, "the older request should have been dropped");
    kvt_policy_stats_t st;
    kvt_policy_stats(pol, &st);
    cr_assert_eq(st.dropped_blocks, 4);
    cr_assert_eq(st.dropped_bytes[KVT_TIER_HBM], 4 * PAGE);
    free(a);
    free(b);
    stop();
}

Test(policy_decisions, watermarks_bound_the_steady_state)
{
    kvt_policy_conf_t c = base_conf(KVT_POLICY_LRU, 10, 100, 0);
    c.tiers[KVT_TIER_HBM].high = 0.8f; /* 8 pages */
    c.tiers[KVT_TIER_HBM].low = 0.5f;  /* 5 pages */
    start(&c);
    uint32_t *a = seq(36, 1000);
    request(a, 36, NULL); /* 9 pages: above high after admission, demoted to low */
    kvt_policy_stats_t st;
    kvt_policy_stats(pol, &st);
    cr_assert_eq(st.used[KVT_TIER_HBM], 5 * PAGE); /* exactly what the low mark asks for */
    cr_assert_eq(st.used[KVT_TIER_HBM] + st.used[KVT_TIER_DRAM], 9 * PAGE);
    /* the head of the prompt stays fast, its tail went down */
    cr_assert_eq(tier_of(a, 0), KVT_TIER_HBM);
    cr_assert_eq(tier_of(a, 8), KVT_TIER_DRAM);
    free(a);
    stop();
}

/* A daemon's reload hands new watermarks to the running engine: its next step works to them. */
Test(policy_decisions, tuned_watermarks_take_effect_at_the_next_step)
{
    kvt_policy_conf_t c = base_conf(KVT_POLICY_LRU, 10, 100, 0);
    start(&c); /* marks at 1.0: the tier may fill */
    uint32_t *a = seq(36, 1000);
    request(a, 36, NULL); /* 9 pages, all in HBM */
    kvt_policy_stats_t st;
    kvt_policy_stats(pol, &st);
    cr_assert_eq(st.used[KVT_TIER_HBM], 9 * PAGE);
    cr_assert_eq(kvt_policy_tune(pol, 0.5f, 0.8f, 0), KVT_EINVAL, "low above high");
    cr_assert_eq(kvt_policy_tune(pol, 1.5f, 0.5f, 0), KVT_EINVAL, "high above 1");
    cr_assert_eq(kvt_policy_tune(NULL, 0.8f, 0.5f, 0), KVT_EINVAL);
    cr_assert_geq(kvt_policy_step(pol, 0), 0);
    kvt_policy_stats(pol, &st);
    cr_assert_eq(st.used[KVT_TIER_HBM], 9 * PAGE, "a refused tune changed nothing");
    cr_assert_eq(kvt_policy_tune(pol, 0.8f, 0.5f, 0), 0);
    cr_assert_geq(kvt_policy_step(pol, 0), 0);
    check();
    kvt_policy_stats(pol, &st);
    cr_assert_eq(st.used[KVT_TIER_HBM], 5 * PAGE, "brought down to the new low mark");
    cr_assert_eq(st.used[KVT_TIER_DRAM], 4 * PAGE);
    free(a);
    stop();
}

Test(policy_decisions, promote_a_hit_in_a_lower_tier)
{
    kvt_policy_conf_t c = base_conf(KVT_POLICY_LRU, 4, 100, 0);
    start(&c);
    uint32_t *a = seq(16, 1000), *b = seq(16, 2000);
    request(a, 16, NULL);
    request(b, 16, NULL);
    all_in(a, 4, KVT_TIER_DRAM);
    cr_assert_eq(request(a, 16, NULL), 4);
    all_in(a, 4, KVT_TIER_HBM);
    all_in(b, 4, KVT_TIER_DRAM);
    kvt_policy_stats_t st;
    kvt_policy_stats(pol, &st);
    cr_assert_eq(st.moved_bytes[KVT_TIER_DRAM][KVT_TIER_HBM], 4 * PAGE);
    cr_assert_eq(st.promotions, 1);
    free(a);
    free(b);
    stop();
}

/* The tag kvt_policy_set_place gave when a MATCH queued a promotion reaches the executor's move
 * op as its cause's tag (kvtierd: the HBM pool of the device of the client that matched), and
 * kvt_policy_promote's cause (tag and request) reaches it as given; the step's demotions carry
 * none. */
static int promo_tags[8], npromo_tags, demote_tags[8], ndemote_tags;
static void *promo_reqs[8];

static int ex_move_tagged(void *arg, const kvt_policy_cause_t *why, kvt_radix_node_t *n,
                          uint32_t depth, uint32_t npages, kvt_tier_id_t from, kvt_tier_id_t to)
{
    if (to < from && npromo_tags < 8) {
        promo_reqs[npromo_tags] = why->req;
        promo_tags[npromo_tags++] = why->tag;
    } else if (to > from && ndemote_tags < 8) {
        demote_tags[ndemote_tags++] = why->tag;
    }
    return ex_move(arg, why, n, depth, npages, from, to);
}

static const kvt_policy_ops_t placed_ops = {.move = ex_move_tagged, .admit = ex_admit};

Test(policy_decisions, a_match_s_place_tag_reaches_its_promotions)
{
    kvt_policy_conf_t c = base_conf(KVT_POLICY_LRU, 4, 100, 0);
    c.ops = &placed_ops;
    start(&c);
    uint32_t *a = seq(16, 1000), *b = seq(16, 2000);
    request(a, 16, NULL);
    request(b, 16, NULL);
    all_in(a, 4, KVT_TIER_DRAM);
    cr_assert_eq(npromo_tags, 0);
    ndemote_tags = 0;
    kvt_policy_set_place(pol, 5);
    cr_assert_eq(request(a, 16, NULL), 4);
    kvt_policy_set_place(pol, -1);
    all_in(a, 4, KVT_TIER_HBM);
    cr_assert_eq(npromo_tags, 1);
    cr_assert_eq(promo_tags[0], 5, "the promotion ran under the MATCH's tag");
    cr_assert_null(promo_reqs[0], "a MATCH's promotion has no request");
    cr_assert_eq(ndemote_tags, 1);
    cr_assert_eq(demote_tags[0], 5, "the demotion that made room for it too");
    ndemote_tags = 0;
    cr_assert_eq(request(b, 16, NULL), 4); /* queued with no tag set */
    all_in(b, 4, KVT_TIER_HBM);
    cr_assert_eq(npromo_tags, 2);
    cr_assert_eq(promo_tags[1], -1);
    cr_assert_eq(ndemote_tags, 1);
    cr_assert_eq(demote_tags[0], -1);
    /* A promotion asked for directly (kvtierd: a PREFETCH) carries its caller's cause, to the
     * moves that make room for it too. */
    all_in(a, 4, KVT_TIER_DRAM);
    int req;
    kvt_policy_cause_t why = {.req = &req, .tag = 3};
    kvt_match_t m;
    cr_assert_eq(kvt_radix_match(tree, ns, a, 16, KVT_MATCH_NOTOUCH, &m), 0);
    ndemote_tags = 0;
    cr_assert_eq(kvt_policy_promote(pol, m.node, m.node_pages, KVT_TIER_HBM, &why), 4);
    all_in(a, 4, KVT_TIER_HBM);
    cr_assert_eq(npromo_tags, 3);
    cr_assert_eq(promo_tags[2], 3);
    cr_assert_eq(promo_reqs[2], &req);
    cr_assert_eq(ndemote_tags, 1);
    cr_assert_eq(demote_tags[0], 3);
    kvt_policy_set_place(NULL, 1); /* harmless */
    free(a);
    free(b);
    stop();
}

Test(policy_decisions, prefetch_promotes_ahead_of_a_request)
{
    kvt_policy_conf_t c = base_conf(KVT_POLICY_LRU, 4, 100, 0);
    start(&c);
    uint32_t *a = seq(16, 1000), *b = seq(16, 2000);
    request(a, 16, NULL);
    request(b, 16, NULL);
    kvt_match_t m;
    cr_assert_eq(kvt_radix_match(tree, ns, a, 8, KVT_MATCH_NOTOUCH, &m), 0);
    cr_assert_eq(m.pages, 2);
    cr_assert_eq(kvt_policy_prefetch(pol, m.node, m.node_pages), 2);
    cr_assert_eq(tier_of(a, 0), KVT_TIER_HBM);
    cr_assert_eq(tier_of(a, 1), KVT_TIER_HBM);
    cr_assert_eq(tier_of(a, 2), KVT_TIER_DRAM); /* only what was asked for */
    cr_assert_eq(kvt_policy_prefetch(pol, m.node, 0), KVT_EINVAL);
    cr_assert_eq(kvt_policy_prefetch(NULL, m.node, 1), KVT_EINVAL);
    check();
    free(a);
    free(b);
    stop();
}

Test(policy_decisions, leased_blocks_never_move)
{
    kvt_policy_conf_t c = base_conf(KVT_POLICY_LRU, 4, 100, 0);
    start(&c);
    uint32_t *a = seq(16, 1000), *b = seq(16, 2000), *d = seq(16, 3000);
    request(a, 16, NULL);
    kvt_match_t m;
    cr_assert_eq(kvt_radix_match(tree, ns, a, 16, KVT_MATCH_NOTOUCH, &m), 0);
    uint64_t lease;
    cr_assert_eq(kvt_radix_lease(tree, &m, 7, &lease), 0);
    /* HBM is full of leased blocks: the new request goes one tier down instead */
    request(b, 16, NULL);
    all_in(a, 4, KVT_TIER_HBM);
    all_in(b, 4, KVT_TIER_DRAM);
    cr_assert_eq(kvt_radix_release(tree, lease), 0);
    request(d, 16, NULL);
    all_in(d, 4, KVT_TIER_HBM);
    all_in(a, 4, KVT_TIER_DRAM);
    free(a);
    free(b);
    free(d);
    stop();
}

Test(policy_decisions, leased_blocks_are_never_dropped)
{
    kvt_policy_conf_t c = base_conf(KVT_POLICY_LRU, 4, 0, 0);
    start(&c);
    uint32_t *a = seq(16, 1000), *b = seq(16, 2000);
    request(a, 16, NULL);
    kvt_match_t m;
    cr_assert_eq(kvt_radix_match(tree, ns, a, 16, KVT_MATCH_NOTOUCH, &m), 0);
    uint64_t lease;
    cr_assert_eq(kvt_radix_lease(tree, &m, 7, &lease), 0);
    request(b, 16, NULL); /* fits nowhere: rejected, the leased request stays */
    all_in(a, 4, KVT_TIER_HBM);
    cr_assert_eq(tier_of(b, 0), -1);
    kvt_policy_stats_t st;
    kvt_policy_stats(pol, &st);
    cr_assert_eq(st.rejected, 4);
    cr_assert_eq(st.dropped_blocks, 0);
    kvt_radix_release(tree, lease);
    free(a);
    free(b);
    stop();
}

/* The oracle is told the shared prefix is never used again but its children are: it must still
 * drop the children first, since a block is never dropped while a cached child depends on it. */
Test(policy_decisions, never_orphan_a_cached_child)
{
    kvt_policy_conf_t c = base_conf(KVT_POLICY_ORACLE, 6, 0, 0);
    start(&c);
    uint32_t *x = seq(16, 1000), *y = seq(16, 1000), *z = seq(16, 5000);
    y[8] = 99999; /* x and y share pages 0-1, then differ */
    uint32_t nx[4] = {UINT32_MAX, UINT32_MAX, 5, 5};
    kvt_policy_hint_t h = {.next_use = nx, .nnext = 4};
    request(x, 16, &h);
    request(y, 16, &h);
    cr_assert_eq(tier_of(x, 0), KVT_TIER_HBM);
    uint32_t nz[4] = {3, 3, 3, 3};
    kvt_policy_hint_t hz = {.next_use = nz, .nnext = 4};
    request(z, 16, &hz); /* needs 4 pages of 6: x's and y's tails go, the shared head stays */
    all_in(z, 4, KVT_TIER_HBM);
    cr_assert_eq(tier_of(x, 0), KVT_TIER_HBM);
    cr_assert_eq(tier_of(x, 1), KVT_TIER_HBM);
    cr_assert_eq(tier_of(x, 2), -1);
    cr_assert_eq(tier_of(y, 2), -1);
    free(x);
    free(y);
    free(z);
    stop();
}

Test(policy_decisions, oracle_drops_the_furthest_next_use)
{
    kvt_policy_conf_t c = base_conf(KVT_POLICY_ORACLE, 8, 0, 0);
    start(&c);
    uint32_t *a = seq(16, 1000), *b = seq(16, 2000), *d = seq(16, 3000);
    uint32_t na[4] = {100, 100, 100, 100}, nb[4] = {10, 10, 10, 10};
    kvt_policy_hint_t ha = {.next_use = na, .nnext = 4}, hb = {.next_use = nb, .nnext = 4};
    request(a, 16, &ha);
    request(b, 16, &hb);
    request(d, 16, &hb);
    all_in(b, 4, KVT_TIER_HBM); /* used sooner than a, though older than d */
    cr_assert_eq(tier_of(a, 0), -1);
    free(a);
    free(b);
    free(d);
    stop();
}

/* Four requests of 4 pages each (tokens from 1000, 2000, 3000, 4000) on a fresh engine of conf c,
 * checked and stopped: the engine's stats at their end. */
static kvt_policy_stats_t four_requests(const kvt_policy_conf_t *c)
{
    start(c);
    uint32_t *r[4];
    for (int i = 0; i < 4; i++) {
        r[i] = seq(16, 1000 * (uint32_t)(i + 1));
        request(r[i], 16, NULL);
    }
    kvt_policy_stats_t st;
    kvt_policy_stats(pol, &st);
    for (int i = 0; i < 4; i++)
        free(r[i]);
    stop();
    return st;
}

Test(policy_decisions, cost_drops_when_recompute_beats_the_next_tier)
{
    /* NVMe so slow that recomputing a page is cheaper than loading it back */
    kvt_policy_conf_t c = base_conf(KVT_POLICY_COST, 4, 4, 100);
    c.hw.bw[KVT_TIER_NVME] = 1e3;
    kvt_policy_stats_t st = four_requests(&c);
    cr_assert_eq(st.moved_bytes[KVT_TIER_DRAM][KVT_TIER_NVME], 0);
    cr_assert_eq(st.used[KVT_TIER_NVME], 0);
    cr_assert_gt(st.cost_drops, 0);
    cr_assert_eq(st.dropped_bytes[KVT_TIER_DRAM], 8 * PAGE); /* r0 and r1 */

    /* the same with the rule off, and LRU: both demote to NVMe */
    c.no_cost_drop = 1;
    for (int k = 0; k < 2; k++) {
        if (k == 1) {
            c.kind = KVT_POLICY_LRU;
            c.no_cost_drop = 0;
        }
        st = four_requests(&c);
        cr_assert_eq(st.moved_bytes[KVT_TIER_DRAM][KVT_TIER_NVME], 8 * PAGE);
        cr_assert_eq(st.cost_drops, 0);
    }
}

/* Issue 40: a reload costs its round trip too, not only its bytes. NVMe moves a page in 0.1 us
 * but answers each request after a second: recomputing a page (8 ms) beats loading it back,
 * so the cost policy drops DRAM's victims where a price of bytes alone demoted them. */
Test(policy_decisions, cost_drops_when_the_reload_round_trip_beats_the_bytes)
{
    kvt_policy_conf_t c = base_conf(KVT_POLICY_COST, 4, 4, 100);
    c.hw.latency_s[KVT_TIER_NVME] = 1.0;
    kvt_policy_stats_t st = four_requests(&c);
    cr_assert_eq(st.moved_bytes[KVT_TIER_DRAM][KVT_TIER_NVME], 0);
    cr_assert_gt(st.cost_drops, 0);

    /* a round trip of 1 us is worth keeping the pages: they are demoted */
    c.hw.latency_s[KVT_TIER_NVME] = 1e-6;
    st = four_requests(&c);
    cr_assert_eq(st.moved_bytes[KVT_TIER_DRAM][KVT_TIER_NVME], 8 * PAGE);
    cr_assert_eq(st.cost_drops, 0);
}

/* An executor whose NVMe tier holds no block of this test's size (kvtierd's pages larger than an
 * NVMe record): ops->holds refuses NVMe, everything else is as ops. */
static int ex_holds_no_nvme(void *arg, kvt_tier_id_t tier, uint32_t nsid, uint32_t size)
{
    (void)arg;
    cr_assert_eq(nsid, ns);
    cr_assert_eq(size, PAGE);
    return tier != KVT_TIER_NVME;
}

static const kvt_policy_ops_t ops_no_nvme = {ex_move, ex_admit, .holds = ex_holds_no_nvme};

/* four_requests through 4 pages of HBM and 4 of DRAM, NVMe and the remote tier below, where NVMe
 * holds no page (ops_no_nvme); remote_bw is the remote tier's bandwidth. */
static kvt_policy_stats_t past_nvme(kvt_policy_kind_t kind, double remote_bw)
{
    kvt_policy_conf_t c = base_conf(kind, 4, 4, 100);
    c.tiers[KVT_TIER_REMOTE].capacity = 100 * PAGE;
    c.tiers[KVT_TIER_REMOTE].high = c.tiers[KVT_TIER_REMOTE].low = 1.0f;
    c.hw.bw[KVT_TIER_REMOTE] = remote_bw;
    c.ops = &ops_no_nvme;
    kvt_policy_stats_t st = four_requests(&c);
    cr_assert_eq(st.moved_bytes[KVT_TIER_DRAM][KVT_TIER_NVME], 0, "NVMe was asked to hold a page");
    cr_assert_eq(st.used[KVT_TIER_NVME], 0);
    return st;
}

/* A tier that cannot hold a block (ops->holds) is passed by: DRAM's victims go on to the remote
 * tier, where the cost rule judges them against a load from there. A page recomputes in 8 ms; it
 * loads back from a remote tier of 1 GB/s in 1 us (kept there) or of 1 kB/s in 1 s (dropped,
 * although NVMe, which cannot take it, would load it back in 0.1 us). */
Test(policy_decisions, a_tier_that_cannot_hold_a_block_is_passed_by)
{
    kvt_policy_stats_t st = past_nvme(KVT_POLICY_COST, 1e9);
    cr_expect_eq(st.moved_bytes[KVT_TIER_DRAM][KVT_TIER_REMOTE], 8 * PAGE);
    cr_expect_eq(st.dropped_blocks, 0);
    st = past_nvme(KVT_POLICY_LRU, 1e9);
    cr_expect_eq(st.moved_bytes[KVT_TIER_DRAM][KVT_TIER_REMOTE], 8 * PAGE);
    cr_expect_eq(st.dropped_blocks, 0);
    st = past_nvme(KVT_POLICY_COST, 1e3);
    cr_expect_eq(st.moved_bytes[KVT_TIER_DRAM][KVT_TIER_REMOTE], 0);
    cr_expect_eq(st.dropped_bytes[KVT_TIER_DRAM], 8 * PAGE);
    cr_expect_gt(st.cost_drops, 0);
}

Test(policy_decisions, nvme_admission_needs_reuse)
{
    kvt_policy_conf_t c = base_conf(KVT_POLICY_LRU, 4, 4, 100);
    c.nvme_min_hits = 1;
    start(&c);
    uint32_t *a = seq(16, 1000), *b = seq(16, 2000), *d = seq(16, 3000), *e = seq(16, 4000);
    request(a, 16, NULL);
    request(a, 16, NULL); /* a is reused once: hits 1 */
    request(b, 16, NULL); /* one-off */
    request(d, 16, NULL); /* pushes a (DRAM) to NVMe: allowed */
    request(e, 16, NULL); /* pushes b out of DRAM: dropped, not written */
    all_in(a, 4, KVT_TIER_NVME);
    cr_assert_eq(tier_of(b, 0), -1);
    kvt_policy_stats_t st;
    kvt_policy_stats(pol, &st);
    cr_assert_eq(st.moved_bytes[KVT_TIER_DRAM][KVT_TIER_NVME], 4 * PAGE);
    cr_assert_eq(st.dropped_bytes[KVT_TIER_DRAM], 4 * PAGE);
    free(a);
    free(b);
    free(d);
    free(e);
    stop();
}

Test(policy_decisions, finished_hint_goes_first)
{
    kvt_policy_conf_t c = base_conf(KVT_POLICY_COST, 8, 0, 0);
    start(&c);
    uint32_t *a = seq(16, 1000), *b = seq(16, 2000), *d = seq(16, 3000);
    request(b, 16, NULL); /* older, no hint */
    kvt_policy_hint_t fin = {.finished = 1};
    request(a, 16, &fin); /* newer, but its session ended */
    request(d, 16, NULL);
    all_in(b, 4, KVT_TIER_HBM);
    cr_assert_eq(tier_of(a, 0), -1);
    free(a);
    free(b);
    free(d);
    stop();
}

/* A session's end, sent as kvtierd sends it: a MATCH of the whole prompt whose hint starts at the
 * deepest matched node. That node holds the last turn only; the session's earlier turns are the
 * ancestors nothing else branches from, and "finished" covers them too, not the system prompt
 * another session shares. On the deepest node alone the earlier turn stayed (as recent as the
 * MATCH made it) and the other session's turn, idle since, went instead. */
Test(policy_decisions, a_finished_hint_covers_the_session_s_earlier_turns)
{
    /* the value and recency experts (LFU's order keeps a block never hit below any other) */
    static const int experts[] = {KVT_POLICY_EXPERT_COST, KVT_POLICY_EXPERT_RECENT};
    for (int e = 0; e < 2; e++) {
        kvt_policy_conf_t c = base_conf(KVT_POLICY_COST, 8, 0, 0);
        c.expert = 1 + experts[e];
        start(&c);
        /* S: a shared system prompt (2 pages); A1, A2: session A's turns; B1: session B's */
        uint32_t a[24], b[16];
        for (uint32_t i = 0; i < 24; i++)
            a[i] = i < 8 ? 100 + i : 1000 + i;
        for (uint32_t i = 0; i < 16; i++)
            b[i] = i < 8 ? 100 + i : 2000 + i;
        request(a, 16, NULL); /* S A1 */
        request(b, 16, NULL); /* S B1: S now has two children */
        request(a, 24, NULL); /* S A1 A2: A2 a child of A1; the tier is full */
        kvt_radix_set_clock(tree, ++clk);
        kvt_match_t m;
        cr_assert_eq(kvt_radix_match(tree, ns, a, 24, 0, &m), 0);
        cr_assert_eq(m.pages, 6);
        cr_assert_eq(kvt_radix_node_depth(m.node), 4, "A2 is a node of its own");
        kvt_policy_hint_t fin = {.finished = 1, .from_page = kvt_radix_node_depth(m.node)};
        kvt_policy_on_match(pol, &m, &fin);
        cr_assert_geq(kvt_policy_step(pol, 0), 0);
        uint32_t *d = seq(16, 5000); /* 4 new pages: 4 must go */
        request(d, 16, NULL);
        all_in(d, 4, KVT_TIER_HBM);
        all_in(b, 4, KVT_TIER_HBM); /* S and B1 */
        cr_assert_eq(tier_of(a, 2), -1, "expert %d: session A's first turn outlived its end", e);
        cr_assert_eq(tier_of(a, 4), -1);
        free(d);
        stop();
    }
}

Test(policy_decisions, priority_hint_keeps_a_prefix)
{
    kvt_policy_conf_t c = base_conf(KVT_POLICY_COST, 8, 0, 0);
    start(&c);
    uint32_t *a = seq(16, 1000), *b = seq(16, 2000), *d = seq(16, 3000);
    kvt_policy_hint_t pin = {.priority = 1000};
    request(a, 16, &pin); /* oldest, but pinned by priority */
    request(b, 16, NULL);
    request(d, 16, NULL);
    all_in(a, 4, KVT_TIER_HBM);
    cr_assert_eq(tier_of(b, 0), -1);
    free(a);
    free(b);
    free(d);
    stop();
}

/* Issue 40: the cost policy's fourth expert orders the tiers above the lowest by the value and
 * the lowest, whose victims are dropped, by LRU. A priority hint is what the value reads and LRU
 * does not: of an older prompt with priority and a newer one without, the value keeps the first
 * and LRU the second. Runs a (priority), b, then more 4-page prompts, and returns 1 when a was
 * the victim in tier `t` (checked `after` prompts), 0 when b was. */
static int priority_prompt_goes(int expert, uint32_t hbm, uint32_t dram, uint32_t after,
                                kvt_tier_id_t t)
{
    kvt_policy_conf_t c = base_conf(KVT_POLICY_COST, hbm, dram, 0);
    c.expert = 1 + expert;
    start(&c);
    kvt_policy_hint_t pin = {.priority = 1000};
    uint32_t *a = seq(16, 1000), *b = seq(16, 2000);
    request(a, 16, &pin);
    request(b, 16, NULL);
    for (uint32_t r = 0; r < after; r++) {
        uint32_t *x = seq(16, 3000 + 100 * r);
        request(x, 16, NULL);
        free(x);
    }
    /* the victim left tier t: demoted below it, or dropped from it */
    int ta = tier_of(a, 0), tb = tier_of(b, 0);
    int a_went = ta == -1 || ta > (int)t, b_went = tb == -1 || tb > (int)t;
    cr_assert_neq(a_went, b_went, "expert %d: a in %d, b in %d", expert, ta, tb);
    free(a);
    free(b);
    stop();
    return a_went;
}

Test(policy_decisions, the_split_expert_demotes_by_value_and_drops_by_recency)
{
    enum { V = KVT_POLICY_EXPERT_COST, R = KVT_POLICY_EXPERT_RECENT };
    const int S = KVT_POLICY_EXPERT_COST_RECENT;
    /* HBM above DRAM, both of 8 pages: one prompt goes down to DRAM */
    cr_assert_eq(priority_prompt_goes(V, 8, 8, 1, KVT_TIER_HBM), 0);
    cr_assert_eq(priority_prompt_goes(R, 8, 8, 1, KVT_TIER_HBM), 1);
    cr_assert_eq(priority_prompt_goes(S, 8, 8, 1, KVT_TIER_HBM), 0, "demoted by the value");
    /* HBM of 4 pages above DRAM of 8: a and b meet in DRAM, the lowest tier, and the third
     * prompt pushed down drops one */
    cr_assert_eq(priority_prompt_goes(V, 4, 8, 2, KVT_TIER_DRAM), 0);
    cr_assert_eq(priority_prompt_goes(R, 4, 8, 2, KVT_TIER_DRAM), 1);
    cr_assert_eq(priority_prompt_goes(S, 4, 8, 2, KVT_TIER_DRAM), 1, "dropped by LRU's order");
    /* HBM alone is the lowest tier: LRU's order there */
    cr_assert_eq(priority_prompt_goes(V, 8, 0, 1, KVT_TIER_HBM), 0);
    cr_assert_eq(priority_prompt_goes(R, 8, 0, 1, KVT_TIER_HBM), 1);
    cr_assert_eq(priority_prompt_goes(S, 8, 0, 1, KVT_TIER_HBM), 1, "dropped by LRU's order");
}

Test(policy_decisions, paused_hint_keeps_a_session)
{
    kvt_policy_conf_t c = base_conf(KVT_POLICY_COST, 8, 0, 0);
    start(&c);
    uint32_t *a = seq(16, 1000), *b = seq(16, 2000), *d = seq(16, 3000);
    kvt_policy_hint_t pause = {.paused_ms = 1000};
    request(a, 16, &pause); /* oldest, but its session is back in a second */
    request(b, 16, NULL);
    request(d, 16, NULL);
    all_in(a, 4, KVT_TIER_HBM);
    cr_assert_eq(tier_of(b, 0), -1);
    free(a);
    free(b);
    free(d);
    stop();
}

/* Issue 40 (COST under LFU's order): a hit on a path larger than the room the top tier can make
 * moves it as far up as it fits instead of leaving it where it was. A hot prefix larger than HBM
 * that fell to NVMe while another expert's order chose stayed there for good after LFU's took
 * over (sysprompt at 5 %, seed 1: 225.1 s against LFU's 182.6). Under LRU's order (the cost
 * policy's recency expert, and the LRU kind) the rest stays where it was, as before. */
Test(policy_decisions, a_hit_path_larger_than_the_top_tier_rises_as_far_as_it_fits)
{
    static const struct {
        kvt_policy_kind_t kind;
        int expert, rises;
    } cases[] = {
        {KVT_POLICY_COST, 1 + KVT_POLICY_EXPERT_FREQUENT, 1},
        {KVT_POLICY_COST, 1 + KVT_POLICY_EXPERT_RECENT, 0},
        {KVT_POLICY_LRU, 0, 0},
        {KVT_POLICY_LFU, 0, 0},
    };
    for (size_t k = 0; k < sizeof(cases) / sizeof(cases[0]); k++) {
        kvt_policy_conf_t c = base_conf(cases[k].kind, 4, 16, 100);
        c.expert = cases[k].expert;
        start(&c);
        uint32_t *a = seq(32, 1000);
        request(a, 32, NULL);
        for (uint32_t r = 0; r < 4; r++) { /* four more 8-page prompts push a to NVMe */
            uint32_t *f = seq(32, 5000 + 100 * r);
            request(f, 32, NULL);
            free(f);
        }
        all_in(a, 8, KVT_TIER_NVME);
        cr_assert_eq(request(a, 32, NULL), 8);
        /* its node's 8 pages are one run, larger than HBM: DRAM takes it, making room there */
        for (uint32_t i = 0; i < 8; i++)
            cr_assert_eq(tier_of(a, i), cases[k].rises ? KVT_TIER_DRAM : KVT_TIER_NVME,
                         "case %zu: page %u in tier %d", k, i, tier_of(a, i));
        free(a);
        stop();
    }
}

/*
 * Two prompts come back every fourth request, between one-off prompts, in a cache of three
 * prompts: LRU has always just dropped the one that comes back. The cost policy remembers what
 * it dropped (ghosts), learns that such blocks come back and one-offs do not, and keeps them.
 */
/* Each expert reads a paused session's hint: of two paused sessions, the one back sooner stays.
 * The LRU expert once keyed paused pages by their expected return (last use + pause), which
 * kept the session back in ten minutes over the one back in ten seconds: with the trace's hints
 * the cost policy took 83% more prefill time on agent sessions than without them. */
Test(policy_decisions, every_expert_keeps_the_session_back_soonest)
{
    for (int e = 0; e < KVT_POLICY_EXPERTS; e++) {
        kvt_policy_conf_t c = base_conf(KVT_POLICY_COST, 8, 0, 0);
        c.expert = e + 1;
        start(&c);
        uint32_t *soon = seq(16, 1000), *late = seq(16, 2000), *d = seq(16, 3000);
        kvt_policy_hint_t back_soon = {.paused_ms = 20000}, back_late = {.paused_ms = 600000};
        request(soon, 16, &back_soon); /* the clock is in ms: 10 s apart */
        clk += 10000;
        request(late, 16, &back_late);
        clk += 10000;
        request(d, 16, NULL);
        all_in(soon, 4, KVT_TIER_HBM);
        cr_assert_eq(tier_of(late, 0), -1, "expert %d kept the session back in ten minutes", e);
        kvt_policy_stats_t st;
        kvt_policy_stats(pol, &st);
        cr_assert_eq(st.expert, (uint32_t)e);
        free(soon);
        free(late);
        free(d);
        stop();
    }
    kvt_policy_conf_t c = base_conf(KVT_POLICY_COST, 8, 0, 0);
    start(&c);
    kvt_policy_t *other = NULL;
    c.expert = KVT_POLICY_EXPERTS + 1;
    cr_assert_eq(kvt_policy_create(&other, tree, &c), KVT_EINVAL);
    c.expert = -1;
    cr_assert_eq(kvt_policy_create(&other, tree, &c), KVT_EINVAL);
    cr_assert_null(other);
    stop();
}

Test(policy_decisions, ghosts_learn_what_comes_back)
{
    uint32_t hits[2] = {0, 0};
    for (int k = 0; k < 2; k++) {
        kvt_policy_conf_t c = base_conf(k ? KVT_POLICY_LRU : KVT_POLICY_COST, 12, 0, 0);
        start(&c);
        uint32_t *x[2] = {seq(16, 100000), seq(16, 200000)};
        for (uint32_t r = 0; r < 600; r++) {
            uint32_t *f = seq(16, 1000000 + 100 * r);
            request(f, 16, NULL);
            free(f);
            uint32_t got = request(x[r % 2], 16, NULL);
            if (r >= 500)
                hits[k] += got;
        }
        free(x[0]);
        free(x[1]);
        stop();
    }
    cr_assert_eq(hits[1], 0, "LRU should never hit here (got %u pages)", hits[1]);
    cr_assert_gt(hits[0], 300, "cost: %u of 400 pages hit in the last 100 rounds", hits[0]);
}

/* Ends the pending move of the first 4 pages of tok with status, as the executor would. */
static void land_move(const uint32_t *tok, kvt_tier_id_t from, kvt_tier_id_t to, int status)
{
    kvt_match_t m;
    cr_assert_eq(kvt_radix_match(tree, ns, tok, 16, KVT_MATCH_NOTOUCH, &m), 0);
    kvt_block_t *bl = kvt_radix_node_blocks(m.node);
    for (int i = 0; i < 4; i++)
        bl[i].flags &= (uint8_t)~KVT_BLOCK_BUSY;
    cr_assert_eq(kvt_policy_move_done(pol, m.node, 0, 4, from, to, status), 0);
    if (status == 0) {
        ex.used[from] -= 4 * PAGE;
        ex.used[to] += 4 * PAGE;
    }
    ex.pending = 0;
}

/* Lands the pending HBM -> DRAM move of the first 4 pages of tok. */
static void land_demotion(const uint32_t *tok)
{
    land_move(tok, KVT_TIER_HBM, KVT_TIER_DRAM, 0);
}

/* A promotion into a tier whose room is only on its way (moves out of it still in flight) moves
 * nothing and says so with KVT_EAGAIN, so that a caller (kvtierd's PREFETCH) waits and asks
 * again instead of reporting the pages as failed; once the move lands, it promotes. */
Test(policy_decisions, promote_into_room_still_on_its_way_is_eagain)
{
    kvt_policy_conf_t c = base_conf(KVT_POLICY_LRU, 4, 100, 0);
    start(&c);
    uint32_t *a = seq(16, 1000), *b = seq(16, 2000);
    request(a, 16, NULL);
    ex.pending = 1;
    request(b, 16, NULL); /* a's demotion out of HBM is in flight; b lands in DRAM */
    all_in(b, 4, KVT_TIER_DRAM);
    kvt_match_t mb;
    cr_assert_eq(kvt_radix_match(tree, ns, b, 16, KVT_MATCH_NOTOUCH, &mb), 0);
    cr_assert_eq(kvt_policy_promote(pol, mb.node, mb.node_pages, KVT_TIER_HBM, NULL), KVT_EAGAIN);
    all_in(b, 4, KVT_TIER_DRAM);
    land_demotion(a);
    cr_assert_eq(kvt_radix_match(tree, ns, b, 16, KVT_MATCH_NOTOUCH, &mb), 0);
    cr_assert_eq(kvt_policy_promote(pol, mb.node, mb.node_pages, KVT_TIER_HBM, NULL), 4);
    all_in(b, 4, KVT_TIER_HBM);
    free(a);
    free(b);
    stop();
}

Test(policy_decisions, pending_moves_hold_their_reservation)
{
    kvt_policy_conf_t c = base_conf(KVT_POLICY_LRU, 4, 100, 0);
    start(&c);
    uint32_t *a = seq(16, 1000), *b = seq(16, 2000);
    request(a, 16, NULL);
    ex.pending = 1;
    request(b, 16, NULL); /* a's demotion is in flight: b lands in DRAM meanwhile */
    kvt_policy_stats_t st;
    kvt_policy_stats(pol, &st);
    cr_assert_eq(st.pending_moves, 1);
    cr_assert_eq(st.used[KVT_TIER_HBM], 4 * PAGE);             /* a, until the copy is done */
    cr_assert_eq(st.used[KVT_TIER_DRAM], 4 * PAGE + 4 * PAGE); /* b + a's reservation */
    all_in(b, 4, KVT_TIER_DRAM);
    /* complete it as the executor would */
    kvt_match_t m;
    cr_assert_eq(kvt_radix_match(tree, ns, a, 16, KVT_MATCH_NOTOUCH, &m), 0);
    cr_assert_eq(kvt_policy_move_done(pol, m.node, 0, 4, KVT_TIER_DRAM, KVT_TIER_HBM, 0),
                 KVT_EINVAL); /* wrong direction */
    land_demotion(a);
    kvt_policy_stats(pol, &st);
    cr_assert_eq(st.pending_moves, 0);
    cr_assert_eq(st.used[KVT_TIER_HBM], 0);
    all_in(a, 4, KVT_TIER_DRAM);
    free(a);
    free(b);
    stop();
}

/* The executor's say on the index's memory (kvt_policy_ops_t.index_room). */
static int room_ok;
static uint64_t room_asked;

static int ex_index_room(void *arg, uint64_t bytes)
{
    (void)arg;
    room_asked = bytes;
    return room_ok;
}

static const kvt_policy_ops_t ops_room = {ex_move, ex_admit, NULL, ex_index_room};

/* A move in flight pins its node with a lease, and a lease may grow the lease table: the engine
 * asks the executor whether the index has room for that first, and starts no move it refuses.
 * Refused, the least recent run is dropped instead (the only way left to make room for the
 * new one), with no lease taken and the table not grown; allowed, the move starts under its
 * lease. */
Test(policy_decisions, a_move_starts_only_when_the_index_has_room_for_its_pin)
{
    kvt_policy_conf_t c = base_conf(KVT_POLICY_LRU, 4, 100, 0);
    c.ops = &ops_room;
    start(&c);
    uint32_t *a = seq(16, 1000), *b = seq(16, 2000), *d = seq(16, 3000);
    request(a, 16, NULL);
    ex.pending = 1;
    room_ok = 0;
    room_asked = 0;
    uint64_t need = kvt_radix_lease_need(tree);
    cr_assert_gt(need, 0, "no lease slot yet");
    kvt_radix_stats_t before, after;
    kvt_radix_stats(tree, &before);
    request(b, 16, NULL); /* a must leave HBM for b */
    cr_assert_eq(room_asked, need, "asked for the lease table's growth");
    cr_assert_eq(ex.moves, 0, "no move started");
    cr_assert_eq(kvt_radix_lease_count(tree), 0);
    cr_assert_eq(kvt_radix_lease_need(tree), need, "the lease table did not grow");
    kvt_radix_stats(tree, &after);
    cr_assert_leq(after.bytes, before.bytes + 16 * 64, "b's new node only");
    cr_assert_eq(tier_of(a, 0), -1, "a was dropped to make room");
    all_in(b, 4, KVT_TIER_HBM);
    kvt_policy_stats_t st;
    kvt_policy_stats(pol, &st);
    cr_assert_eq(st.pin_refusals, 1);
    cr_assert_eq(st.pending_moves, 0);
    /* With room, b's demotion starts and holds a lease until it lands (d goes to DRAM
     * meanwhile, as in pending_moves_hold_their_reservation). */
    room_ok = 1;
    request(d, 16, NULL);
    cr_assert_eq(ex.moves, 1);
    cr_assert_eq(kvt_radix_lease_count(tree), 1);
    land_demotion(b);
    cr_assert_eq(kvt_radix_lease_count(tree), 0);
    all_in(b, 4, KVT_TIER_DRAM);
    all_in(d, 4, KVT_TIER_DRAM);
    free(a);
    free(b);
    free(d);
    stop();
}

/*
 * Moves in flight count as room on its way (kvtierd's moves are all asynchronous): above the high
 * mark, steps move out what takes the tier to the low mark once, not again in every step until
 * those land; and a PUT into a full tier has its room made once, its pages going lower while it
 * is on its way, instead of the tier's every block being moved out for it.
 */
Test(policy_decisions, moves_in_flight_count_as_room_on_its_way)
{
    kvt_policy_conf_t c = base_conf(KVT_POLICY_LRU, 0, 128, 1000);
    c.tiers[KVT_TIER_DRAM].high = 0.9375f; /* 120 pages */
    c.tiers[KVT_TIER_DRAM].low = 0.875f;   /* 112 pages */
    start(&c);
    ex.pending = 1;
    uint32_t *p[31];
    for (int i = 0; i < 31; i++) { /* 124 pages: over the high mark at the last one */
        p[i] = seq(16, 1000 * (uint32_t)(i + 1));
        request(p[i], 16, NULL);
    }
    cr_assert_eq(ex.pending_pages, 12, "%llu pages moved out for 12",
                 (unsigned long long)ex.pending_pages);
    for (int k = 0; k < 20; k++)
        cr_assert_geq(kvt_policy_step(pol, 0), 0);
    cr_assert_eq(ex.pending_pages, 12, "steps moved out more while the first 12 were in flight");
    all_in(p[30], 4, KVT_TIER_DRAM);
    for (int i = 0; i < 31; i++)
        free(p[i]);
    stop();

    c = base_conf(KVT_POLICY_LRU, 0, 100, 1000); /* watermarks at 100%: no background moves */
    start(&c);
    for (int i = 0; i < 25; i++) {
        p[i] = seq(16, 1000 * (uint32_t)(i + 1));
        request(p[i], 16, NULL);
    }
    cr_assert_eq(ex.pending_pages, 0, "100 pages fit");
    ex.pending = 1;
    uint32_t *q = seq(16, 500000), *r = seq(16, 600000);
    request(q, 16, NULL); /* room for 4 pages made: they leave, q goes to NVMe meanwhile */
    cr_assert_eq(ex.pending_pages, 4, "%llu pages moved out for a 4-page PUT",
                 (unsigned long long)ex.pending_pages);
    all_in(q, 4, KVT_TIER_NVME);
    request(r, 16, NULL); /* the room on its way is taken into account: nothing more leaves */
    cr_assert_eq(ex.pending_pages, 4);
    all_in(r, 4, KVT_TIER_NVME);
    for (int i = 0; i < 25; i++)
        free(p[i]);
    free(q);
    free(r);
    stop();
}

/* Inserts tok index-only, as kvtierd's PUT does before it writes the pages' bytes itself. */
static kvt_radix_node_t *stored_by_executor(const uint32_t *tok)
{
    kvt_insert_t ins;
    cr_assert_eq(kvt_radix_insert(tree, ns, tok, 16, &ins), 0);
    cr_assert_eq(ins.new_pages, 4);
    return ins.node;
}

static uint64_t lease_path(const uint32_t *tok)
{
    kvt_match_t m;
    uint64_t id;
    cr_assert_eq(kvt_radix_match(tree, ns, tok, 16, KVT_MATCH_NOTOUCH, &m), 0);
    cr_assert_eq(kvt_radix_lease(tree, &m, 7, &id), 0);
    return id;
}

/* Holds room in tier for k pages the executor writes (counted as the executor's from then on),
 * with or without making room; the first refusal's error, or 0 when all are held. */
static int hold(kvt_tier_id_t tier, int k, int room)
{
    for (int i = 0; i < k; i++) {
        int rc = kvt_policy_hold(pol, tier, PAGE, room);
        if (rc < 0)
            return rc;
        ex.used[tier] += PAGE;
    }
    return 0;
}

/* The executor's 4 written pages of n join the engine: their holds given back, then adopted. */
static void unhold_and_adopt(kvt_radix_node_t *n, kvt_tier_id_t tier)
{
    kvt_block_t *bl = kvt_radix_node_blocks(n);
    for (int i = 0; i < 4; i++) {
        bl[i].size = PAGE;
        bl[i].loc = 1 + (uint64_t)i;
        kvt_policy_unhold(pol, tier, PAGE);
    }
    cr_assert_eq(kvt_policy_adopt(pol, n, 0, 4, tier, 4, NULL), 4);
}

/* Room for blocks the executor writes by itself into a full tier: kvt_policy_hold refuses it, or
 * with make_room frees it from the lowest tier by dropping the least recently used blocks, never
 * a leased path's; says so when nothing may go; finds a path again once its lease ends. Held
 * room counts as used (verify agrees) until given back for the adoption. */
/* The executor's refusal of a promotion while a lease holds the node (kvtierd: its holder may
 * read the run in place, and the switch would free it). */
static int refusals;

static int ex_move_read_in_place(void *arg, const kvt_policy_cause_t *why, kvt_radix_node_t *n,
                                 uint32_t depth, uint32_t npages, kvt_tier_id_t from,
                                 kvt_tier_id_t to)
{
    if (to < from && kvt_radix_node_leased(n)) {
        refusals++;
        return KVT_EBUSY;
    }
    return ex_move(arg, why, n, depth, npages, from, to);
}

static const kvt_policy_ops_t read_in_place_ops = {.move = ex_move_read_in_place,
                                                   .admit = ex_admit};

/* Starts an LRU engine over an HBM of 4 pages and a DRAM of 100, with `with` (NULL: the plain
 * executor's), and returns a, its 4 pages in DRAM under an empty HBM: a went down for b, then b
 * was removed. */
static uint32_t *a_below_an_empty_hbm(const kvt_policy_ops_t *with)
{
    kvt_policy_conf_t c = base_conf(KVT_POLICY_LRU, 4, 100, 0);
    if (with)
        c.ops = with;
    start(&c);
    uint32_t *a = seq(16, 1000), *b = seq(16, 2000);
    request(a, 16, NULL);
    request(b, 16, NULL);
    cr_assert_eq(kvt_radix_remove(tree, ns, b, PS), 0); /* its first page and all beneath */
    free(b);
    all_in(a, 4, KVT_TIER_DRAM);
    kvt_policy_stats_t st;
    kvt_policy_stats(pol, &st);
    cr_assert_eq(st.used[KVT_TIER_HBM], 0);
    return a;
}

static void parked_and_unparked(uint64_t parked, uint64_t unparked)
{
    kvt_policy_stats_t st;
    kvt_policy_stats(pol, &st);
    cr_assert_eq(st.parked, parked);
    cr_assert_eq(st.unparked, unparked);
}

/* a's lease ends, and the next step makes its parked promotion. */
static void made_once_released(uint32_t *a, uint64_t lease)
{
    cr_assert_eq(kvt_radix_release(tree, lease), 0);
    cr_assert_eq(kvt_policy_step(pol, 0), 4);
    all_in(a, 4, KVT_TIER_HBM);
    parked_and_unparked(1, 1);
    free(a);
    stop();
}

/* A hit's promotion refused under a lease (an engine's MATCH holds one on what it matched) is
 * parked: not tried again while a lease holds the node, though others end, and made at the
 * first step after the last one on it ended. */
Test(policy_decisions, a_promotion_refused_for_a_lease_is_made_once_it_ends)
{
    refusals = 0;
    uint32_t *a = a_below_an_empty_hbm(&read_in_place_ops), *e = seq(16, 3000);
    uint64_t lease = lease_path(a);
    cr_assert_eq(request(a, 16, NULL), 4);
    cr_assert_eq(refusals, 1);
    all_in(a, 4, KVT_TIER_DRAM);
    parked_and_unparked(1, 0);
    request(e, 16, NULL);
    cr_assert_eq(kvt_radix_release(tree, lease_path(e)), 0); /* another path's lease ends */
    free(e);
    cr_assert_eq(kvt_policy_step(pol, 0), 0);
    cr_assert_eq(refusals, 1, "tried again under its lease");
    all_in(a, 4, KVT_TIER_DRAM);
    made_once_released(a, lease);
}

/* While a's promotion waits parked, its MATCHes start no other: none makes room in HBM (d,
 * which filled it since, stays there) for a move the executor would refuse again. The promotion
 * is made once the lease ends. */
Test(policy_decisions, a_parked_promotion_is_not_started_again_while_its_lease_holds)
{
    refusals = 0;
    uint32_t *a = a_below_an_empty_hbm(&read_in_place_ops), *d = seq(16, 3000);
    uint64_t lease = lease_path(a);
    request(a, 16, NULL);
    request(d, 16, NULL);
    all_in(d, 4, KVT_TIER_HBM);
    kvt_policy_stats_t was, st;
    kvt_policy_stats(pol, &was);
    for (int i = 0; i < 3; i++)
        cr_assert_eq(request(a, 16, NULL), 4);
    kvt_policy_stats(pol, &st);
    cr_expect_eq(refusals, 1, "started again under its lease: %d refusals", refusals);
    cr_expect_eq(st.demotions, was.demotions, "room made for a move refused: %llu demotions",
                 (unsigned long long)(st.demotions - was.demotions));
    cr_expect_eq(st.park_waits, 3);
    all_in(d, 4, KVT_TIER_HBM);
    all_in(a, 4, KVT_TIER_DRAM);
    free(d);
    made_once_released(a, lease);
}

/* The same for a promotion the executor refused at its switch, for a lease taken while its
 * copies ran. */
Test(policy_decisions, a_promotion_refused_at_its_switch_is_made_once_the_lease_ends)
{
    uint32_t *a = a_below_an_empty_hbm(NULL);
    ex.pending = 1;
    request(a, 16, NULL); /* its promotion is in flight */
    uint64_t lease = lease_path(a);
    land_move(a, KVT_TIER_DRAM, KVT_TIER_HBM, KVT_EBUSY);
    all_in(a, 4, KVT_TIER_DRAM);
    parked_and_unparked(1, 0);
    cr_assert_eq(kvt_policy_step(pol, 0), 0); /* the move's own lease ended: a's holds it */
    all_in(a, 4, KVT_TIER_DRAM);
    made_once_released(a, lease);
}

/* Moves out of HBM land later (kvtierd's): for a, in DRAM below an HBM that d filled, a queued
 * promotion makes room by moving d out, and finds that room still on its way. */
static uint32_t *a_below_a_full_hbm(uint32_t **d)
{
    uint32_t *a = a_below_an_empty_hbm(&read_in_place_ops);
    *d = seq(16, 3000);
    request(*d, 16, NULL);
    all_in(*d, 4, KVT_TIER_HBM);
    ex.pending = 1;
    return a;
}

static kvt_policy_stats_t stats(void)
{
    kvt_policy_stats_t st;
    kvt_policy_stats(pol, &st);
    return st;
}

/* a's promotion, refused under its lease and parked, is queued again once the lease ends into an
 * HBM that d filled meanwhile: it moves d out, and is made at the first step after d landed, with
 * no MATCH of a after. While d is on its way it moves nothing else out. Before, it was dropped
 * once it had made the room, until a's next MATCH. */
Test(policy_decisions, a_parked_promotion_into_a_full_tier_is_made_once_its_room_lands)
{
    refusals = 0;
    uint32_t *a = a_below_an_empty_hbm(&read_in_place_ops), *d = seq(16, 3000);
    uint64_t lease = lease_path(a);
    request(a, 16, NULL);
    parked_and_unparked(1, 0);
    request(d, 16, NULL);
    all_in(d, 4, KVT_TIER_HBM);
    ex.pending = 1;
    cr_assert_eq(kvt_radix_release(tree, lease), 0);
    uint64_t demotions = stats().demotions;
    cr_assert_eq(kvt_policy_step(pol, 0), 0); /* the room is on its way */
    parked_and_unparked(1, 1);
    cr_assert_eq(stats().demotions, demotions + 1);
    cr_assert_eq(stats().pending_moves, 1);
    cr_assert_eq(kvt_policy_step(pol, 0), 0);
    cr_assert_eq(stats().demotions, demotions + 1, "more room made while it is on its way");
    land_demotion(d);
    cr_assert_eq(kvt_policy_step(pol, 0), 4, "not made once its room landed");
    all_in(a, 4, KVT_TIER_HBM);
    all_in(d, 4, KVT_TIER_DRAM);
    cr_assert_eq(stats().demotions, demotions + 1);
    cr_assert_eq(refusals, 1);
    cr_expect_eq(stats().room_waits, 1);
    cr_expect_eq(stats().room_gaveups, 0);
    free(d);
    free(a);
    stop();
}

/* The same for the promotion a leased MATCH queues into a full HBM: it is not even refused, only
 * makes room; once the room landed it is refused under the lease and parked, and made once the
 * lease ends. Before, nothing was left to make it. */
Test(policy_decisions, a_leased_match_into_a_full_tier_is_promoted_once_room_and_lease_allow)
{
    refusals = 0;
    uint32_t *d, *a = a_below_a_full_hbm(&d);
    uint64_t lease = lease_path(a);
    request(a, 16, NULL);
    cr_assert_eq(refusals, 0);
    cr_assert_eq(stats().pending_moves, 1, "no room made");
    land_demotion(d);
    cr_assert_eq(kvt_policy_step(pol, 0), 0);
    cr_assert_eq(refusals, 1, "not tried once its room landed");
    parked_and_unparked(1, 0);
    all_in(a, 4, KVT_TIER_DRAM);
    free(d);
    made_once_released(a, lease);
}

/* A queued promotion whose room never comes (every move out of HBM fails: d stays) makes it at
 * its first try and at ROOM_TRIES (3) more, then is dropped: it does not move others out forever.
 * Its path's next MATCH queues it again. */
Test(policy_decisions, a_promotion_whose_room_never_comes_makes_room_a_bounded_number_of_times)
{
    uint32_t *d, *a = a_below_a_full_hbm(&d);
    uint64_t demotions = stats().demotions;
    request(a, 16, NULL);
    for (int i = 0; i < 8 && stats().pending_moves == 1; i++) {
        land_move(d, KVT_TIER_HBM, KVT_TIER_DRAM, KVT_EIO);
        ex.pending = 1;
        cr_assert_geq(kvt_policy_step(pol, 0), 0);
    }
    cr_assert_eq(stats().pending_moves, 0, "still making room");
    cr_expect_eq(stats().demotions - demotions, 4, "room made %llu times",
                 (unsigned long long)(stats().demotions - demotions));
    cr_expect_eq(stats().room_gaveups, 1, "dropped once, at the bound");
    cr_expect_eq(stats().room_waits, 3, "waited for each room made within the bound");
    all_in(d, 4, KVT_TIER_HBM);
    all_in(a, 4, KVT_TIER_DRAM);
    request(a, 16, NULL);
    cr_expect_eq(stats().demotions - demotions, 5, "its next MATCH made no room");
    land_move(d, KVT_TIER_HBM, KVT_TIER_DRAM, 0);
    cr_assert_eq(kvt_policy_step(pol, 0), 4, "not made once its room landed");
    all_in(a, 4, KVT_TIER_HBM);
    free(d);
    free(a);
    stop();
}

Test(policy_decisions, hold_makes_room_in_the_lowest_tier)
{
    kvt_policy_conf_t c = base_conf(KVT_POLICY_LRU, 0, 8, 0);
    start(&c);
    uint32_t *a = seq(16, 1000), *b = seq(16, 2000), *n = seq(16, 3000), *o = seq(16, 4000);
    request(a, 16, NULL);
    request(b, 16, NULL);        /* DRAM full: 8 pages of 8 */
    uint64_t la = lease_path(a); /* the least recent, but leased: b must go instead */
    kvt_radix_node_t *nn = stored_by_executor(n);
    cr_assert_eq(hold(KVT_TIER_DRAM, 1, 0), KVT_ENOSPC);
    cr_assert_eq(hold(KVT_TIER_DRAM, 4, 1), 0);
    check();
    cr_assert_eq(tier_of(b, 0), -1, "b made the room");
    unhold_and_adopt(nn, KVT_TIER_DRAM);
    check();
    all_in(n, 4, KVT_TIER_DRAM);
    all_in(a, 4, KVT_TIER_DRAM);
    /* Both paths leased: nothing may go, and nothing does. */
    uint64_t ln = lease_path(n);
    kvt_radix_node_t *on = stored_by_executor(o);
    cr_assert_eq(hold(KVT_TIER_DRAM, 1, 1), KVT_ENOSPC);
    cr_assert_eq(kvt_policy_hold(pol, KVT_TIER_DRAM, 9 * PAGE, 1), KVT_ENOSPC, "over capacity");
    all_in(a, 4, KVT_TIER_DRAM);
    all_in(n, 4, KVT_TIER_DRAM);
    cr_assert_eq(kvt_policy_hold(NULL, KVT_TIER_DRAM, PAGE, 1), KVT_EINVAL);
    cr_assert_eq(kvt_policy_hold(pol, KVT_TIER_NVME, PAGE, 1), KVT_EINVAL, "not configured");
    cr_assert_eq(kvt_policy_hold(pol, KVT_TIER_DRAM, 0, 1), KVT_EINVAL);
    kvt_policy_unhold(NULL, KVT_TIER_DRAM, PAGE); /* harmless */
    check();
    /* n's lease ends with nothing else changing: the search that passed n, leased, finds it. */
    cr_assert_eq(kvt_radix_release(tree, ln), 0);
    cr_assert_eq(hold(KVT_TIER_DRAM, 4, 1), 0);
    unhold_and_adopt(on, KVT_TIER_DRAM);
    cr_assert_eq(tier_of(n, 0), -1, "n, released, made the room");
    all_in(o, 4, KVT_TIER_DRAM);
    cr_assert_eq(kvt_radix_release(tree, la), 0);
    free(a);
    free(b);
    free(n);
    free(o);
    stop();
}

/* A tier whose every victim is leased runs its heap dry at every search for room, and an
 * engine ends and takes leases all the time: the heap is walked again for the paths whose
 * leases ended only once a 1/64 of the nodes in leases have ended, not at every search. */
Test(policy_decisions, a_dry_heap_of_leased_victims_is_not_walked_at_every_release)
{
    enum { N = 1000 };
    kvt_policy_conf_t c = base_conf(KVT_POLICY_LRU, 0, 4 * N, 0);
    start(&c);
    static uint32_t *tok[N];
    static uint64_t lease[N];
    for (int i = 0; i < N; i++) {
        tok[i] = seq(16, 1000 * (uint32_t)(i + 1));
        request(tok[i], 16, NULL);
        lease[i] = lease_path(tok[i]);
    }
    kvt_policy_stats_t before, after;
    kvt_policy_stats(pol, &before);
    for (int k = 0; k < 500; k++) { /* one request ends, another begins: all stay leased */
        cr_assert_eq(kvt_radix_release(tree, lease[k % N]), 0);
        lease[k % N] = lease_path(tok[k % N]);
        cr_assert_eq(hold(KVT_TIER_DRAM, 1, 1), KVT_ENOSPC);
    }
    kvt_policy_stats(pol, &after);
    uint64_t walks = after.rebuilds - before.rebuilds;
    cr_assert_leq(walks, 500 / (N / 64) + 1, "%llu walks of the tree for 500 lease ends",
                  (unsigned long long)walks);
    cr_assert_geq(walks, 1, "the ended leases are looked at again");
    for (int i = 0; i < N; i++) {
        cr_assert_eq(kvt_radix_release(tree, lease[i]), 0);
        free(tok[i]);
    }
    stop();
}

/* Above the lowest tier the room is made by moves down: while they are in flight it is only on
 * its way (KVT_EAGAIN, and asking again starts no more), the tier below takes the write
 * meanwhile, and once the move lands the tier has room again. */
Test(policy_decisions, hold_above_the_lowest_tier_waits_for_its_moves)
{
    kvt_policy_conf_t c = base_conf(KVT_POLICY_LRU, 0, 8, 100);
    start(&c);
    uint32_t *a = seq(16, 1000), *b = seq(16, 2000);
    request(a, 16, NULL);
    request(b, 16, NULL);
    ex.pending = 1;
    cr_assert_eq(hold(KVT_TIER_DRAM, 1, 1), KVT_EAGAIN);
    cr_assert_eq(ex.pending_pages, 1, "one page of a on its way down");
    cr_assert_eq(hold(KVT_TIER_DRAM, 1, 1), KVT_EAGAIN);
    cr_assert_eq(ex.pending_pages, 1, "asking again moves nothing more");
    cr_assert_eq(hold(KVT_TIER_NVME, 1, 0), 0);
    kvt_match_t m;
    cr_assert_eq(kvt_radix_match(tree, ns, a, 16, KVT_MATCH_NOTOUCH, &m), 0);
    kvt_radix_node_blocks(m.node)[3].flags &= (uint8_t)~KVT_BLOCK_BUSY;
    cr_assert_eq(kvt_policy_move_done(pol, m.node, 3, 1, KVT_TIER_DRAM, KVT_TIER_NVME, 0), 0);
    ex.used[KVT_TIER_DRAM] -= PAGE;
    ex.used[KVT_TIER_NVME] += PAGE;
    ex.pending = 0;
    cr_assert_eq(hold(KVT_TIER_DRAM, 1, 0), 0);
    check();
    kvt_policy_unhold(pol, KVT_TIER_DRAM, PAGE); /* both writes failed after all */
    kvt_policy_unhold(pol, KVT_TIER_NVME, PAGE);
    ex.used[KVT_TIER_DRAM] -= PAGE;
    ex.used[KVT_TIER_NVME] -= PAGE;
    check();
    free(a);
    free(b);
    stop();
}

/* Writes in flight count toward a tier's watermarks: held room past the high mark makes the
 * maintenance step move blocks down to the low mark, as blocks already there would. */
Test(policy_decisions, held_room_counts_toward_the_watermarks)
{
    kvt_policy_conf_t c = base_conf(KVT_POLICY_LRU, 0, 10, 100);
    c.tiers[KVT_TIER_DRAM].high = 0.8f; /* 8 pages */
    c.tiers[KVT_TIER_DRAM].low = 0.6f;  /* 6 pages */
    start(&c);
    uint32_t *a = seq(16, 1000);
    request(a, 16, NULL);
    cr_assert_eq(hold(KVT_TIER_DRAM, 5, 0), 0); /* 9 pages of 10 */
    cr_assert_geq(kvt_policy_step(pol, 0), 0);
    kvt_policy_stats_t st;
    kvt_policy_stats(pol, &st);
    cr_assert_eq(st.moved_bytes[KVT_TIER_DRAM][KVT_TIER_NVME], 3 * PAGE, "down to 6 pages");
    cr_assert_eq(st.used[KVT_TIER_DRAM], 6 * PAGE);
    check();
    for (int i = 0; i < 5; i++)
        kvt_policy_unhold(pol, KVT_TIER_DRAM, PAGE);
    ex.used[KVT_TIER_DRAM] -= 5 * PAGE;
    free(a);
    stop();
}

/* A page of a pending move that a tier lost meanwhile (kvtierd: a GET found it gone, and it went
 * index-only through kvt_policy_on_free) ends the move as failed, whatever status the copies had:
 * the move's reservation and lease are given back instead of being held forever. */
Test(policy_decisions, pending_move_with_a_lost_page_still_ends)
{
    static const int statuses[] = {0, KVT_EIO};
    for (size_t k = 0; k < KVT_ARRAY_LEN(statuses); k++) {
        int status = statuses[k];
        kvt_policy_conf_t c = base_conf(KVT_POLICY_LRU, 4, 100, 0);
        start(&c);
        uint32_t *a = seq(16, 1000), *b = seq(16, 2000);
        request(a, 16, NULL);
        ex.pending = 1;
        request(b, 16, NULL); /* a's 4 pages: HBM -> DRAM in flight */
        kvt_match_t m;
        cr_assert_eq(kvt_radix_match(tree, ns, a, 16, KVT_MATCH_NOTOUCH, &m), 0);
        kvt_block_t *bl = kvt_radix_node_blocks(m.node);
        for (int i = 0; i < 4; i++)
            bl[i].flags &= (uint8_t)~KVT_BLOCK_BUSY;
        /* page 2 lost: kvt__store_lost makes it and the rest of its node index-only */
        for (int i = 2; i < 4; i++) {
            ex_free(&ex, ns, &bl[i], KVT_RADIX_EVICT);
            bl[i].tier = KVT_TIER_NONE;
            bl[i].size = 0;
        }
        cr_assert_eq(kvt_policy_move_done(pol, m.node, 0, 4, KVT_TIER_HBM, KVT_TIER_DRAM, status),
                     KVT_EINVAL);
        kvt_policy_stats_t st;
        kvt_policy_stats(pol, &st);
        cr_assert_eq(st.pending_moves, 0, "status %d: the move is over", status);
        cr_assert_eq(st.used[KVT_TIER_HBM], 2 * PAGE, "status %d: a's other pages stay", status);
        cr_assert_eq(st.used[KVT_TIER_DRAM], 4 * PAGE, "status %d: only b, nothing reserved",
                     status);
        cr_assert_not(kvt_radix_node_leased(m.node), "status %d: the lease is given back", status);
        cr_assert_eq(tier_of(a, 0), KVT_TIER_HBM);
        cr_assert_eq(tier_of(a, 1), KVT_TIER_HBM);
        ex.pending = 0;
        free(a);
        free(b);
        stop();
    }
}

Test(policy_decisions, failed_moves_change_nothing)
{
    kvt_policy_conf_t c = base_conf(KVT_POLICY_LRU, 4, 100, 0);
    start(&c);
    uint32_t *a = seq(16, 1000), *b = seq(16, 2000);
    request(a, 16, NULL);
    ex.fail = 1;
    /* a cannot move down: it stays where it was until the engine, out of room, drops it */
    request(b, 16, NULL);
    ex.fail = 0;
    all_in(b, 4, KVT_TIER_HBM);
    cr_assert_eq(tier_of(a, 0), -1);
    cr_assert_eq(ex.moves, 0);
    free(a);
    free(b);
    stop();
}

Test(policy_decisions, removal_behind_the_engine_is_accounted)
{
    kvt_policy_conf_t c = base_conf(KVT_POLICY_COST, 8, 8, 0);
    start(&c);
    uint32_t *a = seq(16, 1000), *b = seq(16, 2000);
    request(a, 16, NULL);
    request(b, 16, NULL);
    cr_assert_eq(kvt_radix_remove(tree, ns, a, 8), 0); /* pages 1.. of a */
    check();
    kvt_policy_stats_t st;
    kvt_policy_stats(pol, &st);
    cr_assert_eq(st.used[KVT_TIER_HBM] + st.used[KVT_TIER_DRAM], 5 * PAGE);
    request(a, 16, NULL); /* re-admitted */
    free(a);
    free(b);
    stop();
}

Test(policy_decisions, bad_input)
{
    memset(&ex, 0, sizeof(ex));
    kvt_radix_t *t;
    cr_assert_eq(kvt_radix_create(&t, NULL), 0);
    kvt_policy_t *p = (kvt_policy_t *)0x1;
    kvt_policy_conf_t c = base_conf(KVT_POLICY_LRU, 4, 4, 0);
    cr_assert_eq(kvt_policy_create(NULL, t, &c), KVT_EINVAL);
    cr_assert_eq(kvt_policy_create(&p, NULL, &c), KVT_EINVAL);
    kvt_policy_conf_t bad = c;
    bad.ops = NULL;
    cr_assert_eq(kvt_policy_create(&p, t, &bad), KVT_EINVAL);
    bad = base_conf(KVT_POLICY_LRU, 0, 0, 0);
    cr_assert_eq(kvt_policy_create(&p, t, &bad), KVT_EINVAL); /* no tier */
    bad = c;
    bad.tiers[KVT_TIER_DRAM].low = 0.9f;
    bad.tiers[KVT_TIER_DRAM].high = 0.5f;
    cr_assert_eq(kvt_policy_create(&p, t, &bad), KVT_EINVAL); /* low > high */
    bad = c;
    bad.kind = (kvt_policy_kind_t)9;
    cr_assert_eq(kvt_policy_create(&p, t, &bad), KVT_EINVAL);
    bad = c;
    bad.hw.bw[KVT_TIER_DRAM] = 0;
    cr_assert_eq(kvt_policy_create(&p, t, &bad), KVT_EINVAL); /* a tier with no load path */
    bad = c;
    bad.admit_tier = KVT_TIER_NVME;
    cr_assert_eq(kvt_policy_create(&p, t, &bad), KVT_EINVAL); /* not configured */
    bad = c;
    bad.model.layers = 0;
    cr_assert_eq(kvt_policy_create(&p, t, &bad), KVT_EINVAL);
    cr_assert_eq(p, (kvt_policy_t *)0x1, "a failed create must leave *out alone");

    cr_assert_eq(kvt_policy_create(&p, t, &c), 0);
    cr_assert_eq(kvt_policy_on_insert(p, NULL, NULL), KVT_EINVAL);
    kvt_insert_t none = {0};
    cr_assert_eq(kvt_policy_on_insert(p, &none, NULL), 0);
    cr_assert_eq(kvt_policy_step(NULL, 0), KVT_EINVAL);
    cr_assert_eq(kvt_policy_move_done(p, NULL, 0, 1, KVT_TIER_HBM, KVT_TIER_DRAM, 0), KVT_EINVAL);
    kvt_policy_on_match(p, NULL, NULL); /* harmless */
    kvt_policy_kind_t k;
    cr_assert_eq(kvt_policy_kind_parse("oracle", &k), 0);
    cr_assert_eq(k, KVT_POLICY_ORACLE);
    cr_assert_eq(kvt_policy_kind_parse("arc", &k), KVT_EINVAL);
    cr_assert_str_eq(kvt_policy_kind_name(KVT_POLICY_LFU), "lfu");
    kvt_policy_destroy(p);
    kvt_policy_destroy(NULL);
    kvt_radix_destroy(t);
}

/*
 * Issue 40: which signal predicts reuse changes with the workload, and the cost policy learns it
 * online (its experts, judged by miniature simulations: policy.c, "Experts"). Two workloads
 * where one of LRU and LFU is blind, each replayed under LRU, LFU and the cost policy; returns
 * the pages hit in the part measured, and leaves the last policy's stats in *st.
 *
 * "recency": 40 prompts are reused twenty times each (their pages earn many hits), then never
 * again, while each new prompt comes back once, 20 prompts later. LFU keeps the dead, much-hit
 * prompts and loses every new one. Measured: the last 1,000 second uses.
 * "frequency": 16 hot prompts, used ten times each, then come back in turn, each behind 16
 * one-shot prompts. The scans between two uses of a hot prompt are four times the cache: LRU
 * loses every hot prompt.
 * Measured: the last 1,000 hot uses.
 */
static uint32_t signal_workload(kvt_policy_kind_t kind, int frequency, kvt_policy_stats_t *st)
{
    kvt_policy_conf_t c = base_conf(kind, 1024, 0, 0);
    start(&c);
    uint32_t *keep[40];
    for (uint32_t k = 0; k < 40; k++)
        keep[k] = seq(64, 100000 + 1000 * k);
    uint32_t hits = 0;
    if (frequency) {
        for (uint32_t r = 0; r < 160; r++) /* they are hot before the scans begin */
            request(keep[r % 16], 64, NULL);
        for (uint32_t r = 0; r < 3000; r++) {
            for (uint32_t s = 0; s < 16; s++) {
                uint32_t *f = seq(64, 10000000 + 1000 * (16 * r + s));
                request(f, 64, NULL);
                free(f);
            }
            uint32_t got = request(keep[r % 16], 64, NULL);
            if (r >= 2000)
                hits += got;
        }
    } else {
        for (uint32_t r = 0; r < 800; r++)
            request(keep[r % 40], 64, NULL);
        const uint32_t rounds = 3000, gap = 20;
        for (uint32_t r = 0; r < rounds + gap; r++) {
            if (r < rounds) {
                uint32_t *f = seq(64, 10000000 + 1000 * r);
                request(f, 64, NULL);
                free(f);
            }
            if (r >= gap) {
                uint32_t *f = seq(64, 10000000 + 1000 * (r - gap));
                uint32_t got = request(f, 64, NULL);
                if (r - gap >= rounds - 1000)
                    hits += got;
                free(f);
            }
        }
    }
    for (uint32_t k = 0; k < 40; k++)
        free(keep[k]);
    kvt_policy_stats(pol, st);
    stop();
    return hits;
}

static void signal_case(int frequency)
{
    kvt_policy_stats_t st;
    uint32_t lru = signal_workload(KVT_POLICY_LRU, frequency, &st);
    uint32_t lfu = signal_workload(KVT_POLICY_LFU, frequency, &st);
    uint32_t cost = signal_workload(KVT_POLICY_COST, frequency, &st);
    uint32_t best = KVT_MAX(lru, lfu), blind = KVT_MIN(lru, lfu);
    cr_assert_gt(best, 3 * blind, "the workload should blind one of them: LRU %u, LFU %u pages",
                 lru, lfu);
    cr_assert_geq(cost, best * 9 / 10,
                  "cost %u pages against LRU's %u and LFU's %u (expert %u, %llu switches, "
                  "simulated %.3f / %.3f / %.3f s)",
                  cost, lru, lfu, st.expert, (unsigned long long)st.expert_switches,
                  st.expert_miss_s[0], st.expert_miss_s[1], st.expert_miss_s[2]);
    /* the expert of the blind signal cost most in its miniature hierarchy, and does not choose */
    int blind_exp = lru < lfu ? 1 : 2;
    cr_assert_neq(st.expert, (uint32_t)blind_exp, "the blind expert (%d) chooses", blind_exp);
    for (int e = 0; e < KVT_POLICY_EXPERTS; e++)
        if (e == KVT_POLICY_EXPERT_COST_RECENT && blind_exp == KVT_POLICY_EXPERT_RECENT)
            /* one tier, the lowest: the split expert is LRU's order, as blind as it */
            cr_assert_gt(st.expert_miss_s[e], st.expert_miss_s[st.expert],
                         "the split expert simulated %.3f s, the chosen one %.3f",
                         st.expert_miss_s[e], st.expert_miss_s[st.expert]);
        else if (e != blind_exp)
            cr_assert_gt(st.expert_miss_s[blind_exp], st.expert_miss_s[e],
                         "expert %d simulated %.3f s, the blind one %.3f", e, st.expert_miss_s[e],
                         st.expert_miss_s[blind_exp]);
    cr_assert_gt(st.expert_choices[st.expert], 0);
}

Test(policy_decisions, experts_follow_recency_where_hit_counts_mislead)
{
    signal_case(0);
}

Test(policy_decisions, experts_follow_frequency_where_scans_flush_recency)
{
    signal_case(1);
}

/*
 * Issue 40, session 23: the recency expert's miniature hierarchy takes the least recent page as
 * its victim, as the engine's heaps do under LRU's order. It took the best of 8 pages drawn at
 * random, and so missed pages that LRU keeps: its copy cost more than the order it stood for,
 * and the simulations chose the value's order on agents and chat where LRU's is really the
 * better (docs/policy.md, section 5). Here HOT prompts come back every round, each round ending
 * with a prompt used once: exact LRU's victim is always the oldest of those, so on one tier the
 * recency copy misses only the pages it has never seen, as LRU misses nothing else (checked on
 * the LRU kind), while the copies that draw their victims take a hot page now and then. With
 * the drawn victim the recency copy simulated 0.8924 s and the split one 0.8832 (both LRU's
 * order here), against 0.8491 for both exact and 0.8660 for LFU's drawn order.
 */
static uint32_t rounds_of_hot_prompts(kvt_policy_kind_t kind, uint32_t hot, kvt_policy_stats_t *st)
{
    kvt_policy_conf_t c = base_conf(kind, 1024, 0, 0);
    start(&c);
    uint32_t missed = 0;
    for (uint32_t r = 0; r < 400; r++) {
        for (uint32_t k = 0; k < hot; k++) {
            uint32_t *h = seq(64, 100000 + 1000 * k);
            uint32_t got = request(h, 64, NULL);
            if (r > 0)
                missed += 16 - got;
            free(h);
        }
        uint32_t *once = seq(64, 10000000 + 1000 * r);
        request(once, 64, NULL);
        free(once);
    }
    kvt_policy_stats(pol, st);
    stop();
    return missed;
}

Test(policy_decisions, the_recency_experts_copy_evicts_exactly_the_least_recent)
{
    kvt_policy_stats_t st;
    const uint32_t hot = 56;
    cr_assert_eq(rounds_of_hot_prompts(KVT_POLICY_LRU, hot, &st), 0, "LRU lost a hot page");
    rounds_of_hot_prompts(KVT_POLICY_COST, hot, &st);
    const double *s = st.expert_miss_s;
    /* one tier, the lowest: the split expert orders it as LRU does, decision for decision */
    cr_assert_eq(s[KVT_POLICY_EXPERT_RECENT], s[KVT_POLICY_EXPERT_COST_RECENT],
                 "recency %.4f s, split %.4f", s[KVT_POLICY_EXPERT_RECENT],
                 s[KVT_POLICY_EXPERT_COST_RECENT]);
    /* the density expert learns that the pages used once never come back (their hit class has
     * no use at any age): its best of 16 drawn is one of them, and its copy costs what exact
     * LRU's does (0.8491 s), not more */
    cr_assert_leq(s[KVT_POLICY_EXPERT_RECENT], s[KVT_POLICY_EXPERT_DENSITY] * 1.001,
                  "recency's copy simulated %.4f s, the density expert's %.4f",
                  s[KVT_POLICY_EXPERT_RECENT], s[KVT_POLICY_EXPERT_DENSITY]);
    for (int e = 0; e < KVT_POLICY_EXPERTS; e++)
        if (e != KVT_POLICY_EXPERT_RECENT && e != KVT_POLICY_EXPERT_COST_RECENT &&
            e != KVT_POLICY_EXPERT_DENSITY)
            cr_assert_lt(s[KVT_POLICY_EXPERT_RECENT], s[e] * 0.99,
                         "recency's copy simulated %.4f s, expert %d's %.4f",
                         s[KVT_POLICY_EXPERT_RECENT], e, s[e]);
}

/*
 * Issue 40, session 25: the stats give what the sampled pages cost the real hierarchy
 * (expert_real_s) beside each miniature copy's figure, and the sampled uses each expert was in
 * charge for (expert_uses), so that a replay shows how far the copy of the expert in charge is
 * from what its order really does (docs/policy.md, section 5: on agent seed 0 with the remote
 * tier the density copy's figure was 4 % below the real one, the others' 1-3 %). Where nothing
 * is ever evicted, neither from the real tiers nor from the copies, every sampled page is missed
 * once and then found in the top tier by all of them: the real figure is each copy's, to the
 * last bit. Pinned, the engine simulates nothing and reports nothing.
 */
Test(policy_decisions, the_real_hierarchy_is_judged_on_the_sampled_pages_as_the_copies)
{
    for (int pinned = 0; pinned < 2; pinned++) {
        kvt_policy_conf_t c = base_conf(KVT_POLICY_COST, 1024, 4096, 0);
        c.expert = pinned ? 1 + KVT_POLICY_EXPERT_RECENT : 0;
        start(&c);
        for (uint32_t r = 0; r < 400; r++) { /* 40 prompts of 16 pages, 640 pages in all */
            uint32_t *h = seq(64, 100000 + 1000 * (r % 40));
            request(h, 64, NULL);
            free(h);
        }
        kvt_policy_stats_t st;
        kvt_policy_stats(pol, &st);
        cr_assert_eq(st.demotions + st.dropped_blocks + st.rejected, 0,
                     "the test needs a cache that evicts nothing");
        uint64_t uses = 0;
        for (int e = 0; e < KVT_POLICY_EXPERTS; e++)
            uses += st.expert_uses[e];
        if (pinned) {
            cr_assert_eq(uses, 0);
            cr_assert_eq(st.expert_real_s, 0);
        } else {
            /* 1 page in 32 of 640, used 10 times each: some 200 sampled uses */
            cr_assert_gt(uses, 50, "%llu sampled uses", (unsigned long long)uses);
            cr_assert_eq(st.expert_uses[st.expert], uses, "no switch here: one expert in charge");
            cr_assert_gt(st.expert_real_s, 0);
            for (int e = 0; e < KVT_POLICY_EXPERTS; e++)
                cr_assert_eq(st.expert_real_s, st.expert_miss_s[e],
                             "the real hierarchy %.6f s, expert %d's copy %.6f", st.expert_real_s,
                             e, st.expert_miss_s[e]);
        }
        stop();
    }
}

/*
 * Issue 40, session 29: a copy misjudges its own order (session 25: the density copy's figure 4 %
 * below the real one on agent seed 0 with the remote tier, the others' 1-3 %), so a copy 1 %
 * cheaper than the one in charge need not be. Another expert takes over only when its copy is
 * cheaper and still is once each copy's seconds are corrected by what its order really cost over
 * what its copy said while it was in charge; one never in charge long enough takes the mean of
 * the others' corrections.
 */
Test(policy_decisions, a_switch_needs_the_real_costs_to_agree_with_the_copies)
{
    /* expert 1's copy is 2 % cheaper than expert 0's, which is in charge */
    double copy[KVT_POLICY_EXPERTS] = {100, 98, 200, 200, 200};
    double real[KVT_POLICY_EXPERTS] = {100, 105, 0, 0, 0}; /* per 100 s of its copy's */
    double held[KVT_POLICY_EXPERTS] = {100, 100, 0, 0, 0};
    double n[KVT_POLICY_EXPERTS] = {1000, 1000, 0, 0, 0};
    kvt__policy_experts_t x = {KVT_POLICY_EXPERTS, copy, real, held, n};
    /* its order really cost 5 % more than its copy said, expert 0's what its copy said */
    cr_assert_eq(kvt__policy_pick_expert(&x, 0), 0, "a copy that underrates its order won");
    real[1] = 100;
    cr_assert_eq(kvt__policy_pick_expert(&x, 0), 1, "the cheaper order, rightly judged, lost");
    /* in charge for too few uses: its correction is unknown, and the known one's is taken */
    real[1] = 105;
    n[1] = 100;
    cr_assert_eq(kvt__policy_pick_expert(&x, 0), 1);
    /* never in charge: the mean of the corrections known, here expert 0's and expert 2's */
    n[1] = 0;
    real[2] = held[2] = n[2] = 1000;
    real[2] = 1100;
    cr_assert_eq(kvt__policy_pick_expert(&x, 0), 0, "98 x 1.05 s is not 1 %% below 100 s");
    real[2] = 1000;
    cr_assert_eq(kvt__policy_pick_expert(&x, 0), 1);
    /* the copies alone still have to agree: a correction never makes a switch */
    copy[1] = 99.5;
    real[0] = 110;
    cr_assert_eq(kvt__policy_pick_expert(&x, 0), 0, "a switch by the corrections alone");
}

/*
 * Issue 40, session 24: the density expert (LHD) learns from the ages at which pages were used
 * again and at which they left without a use, and need not rank a page lower for being older.
 * Every second prompt comes back once, 20 s after it was sent; the tier holds 12 prompts. While
 * prompts come every 4 s all fit, and the engine sees the returns at 20 s and the rest leave
 * older; then they come every second. LRU's order (and the value's, which falls with age too)
 * keeps the newest 12 s and never sees a return; the density expert keeps pages on the way to
 * the age of their return over newer ones, and drops the ones past it first. Returns the pages
 * hit by returns in the second phase, of the 4 x 40 it has (the density expert: 32).
 */
static uint32_t returns_hit(int expert)
{
    kvt_policy_conf_t c = base_conf(KVT_POLICY_COST, 48, 0, 0);
    c.expert = 1 + expert;
    start(&c);
    enum { N1 = 60, N2 = 100 };
    uint32_t back_at[N1 + N2], hit = 0, t = 0, k = 0;
    for (uint32_t i = 0; i < N1 + N2; i++)
        back_at[i] = UINT32_MAX;
    for (uint32_t i = 0; i < N1 + N2; i++) {
        t += i < N1 ? 4000 : 1000;
        /* the returns due by now, then the new prompt */
        for (; k < i && (back_at[k] == UINT32_MAX || back_at[k] <= t); k++) {
            if (back_at[k] == UINT32_MAX)
                continue;
            uint32_t *r = seq(16, 1000 + 100 * k);
            clk = back_at[k] - 1;
            uint32_t got = request(r, 16, NULL);
            if (k >= N1)
                hit += got;
            free(r);
        }
        uint32_t *x = seq(16, 1000 + 100 * i);
        clk = t - 1;
        request(x, 16, NULL);
        free(x);
        if (i % 2 == 0)
            back_at[i] = t + 20000;
    }
    stop();
    return hit;
}

Test(policy_decisions, the_density_expert_keeps_a_page_until_its_likely_reuse)
{
    uint32_t density = returns_hit(KVT_POLICY_EXPERT_DENSITY);
    uint32_t recent = returns_hit(KVT_POLICY_EXPERT_RECENT);
    uint32_t value = returns_hit(KVT_POLICY_EXPERT_COST);
    cr_assert_eq(recent, 0, "LRU's order kept a page 20 s old (%u pages hit)", recent);
    cr_assert_eq(value, 0, "the value's order kept a page 20 s old (%u pages hit)", value);
    cr_assert_geq(density, 16, "the density expert: %u of 160 pages hit", density);
}

/* A PUT's pages join a node's run a few at a time as their writes land (kvtierd adopts each
 * completed stretch): the run's one heap entry reads it live, so the heap does not take an
 * entry per adoption (it took one each, up to a rebuild: 64 here). The node is still a victim:
 * room asked for in the full tier is made from its pages. Under LRU, LFU and the cost policy. */
Test(policy_decisions, pages_joining_a_run_do_not_grow_the_heap)
{
    const kvt_policy_kind_t kinds[] = {KVT_POLICY_LRU, KVT_POLICY_LFU, KVT_POLICY_COST};
    for (size_t k = 0; k < sizeof(kinds) / sizeof(kinds[0]); k++) {
        enum { NP = 64 };
        kvt_policy_conf_t c = base_conf(kinds[k], 0, NP, 0);
        start(&c);
        uint32_t *tok = seq(NP * PS, 5000);
        kvt_radix_set_clock(tree, ++clk);
        kvt_insert_t ins;
        cr_assert_eq(kvt_radix_insert(tree, ns, tok, NP * PS, &ins), 0);
        cr_assert_eq(ins.new_pages, NP);
        kvt_radix_node_t *n = ins.node;
        size_t before = kvt__policy_heap_len(pol, KVT_TIER_DRAM);
        for (uint32_t i = 0; i < NP; i++) {
            kvt_block_t *b = &kvt_radix_node_blocks(n)[i];
            b->size = PAGE;
            b->loc = 1 + i;
            ex.used[KVT_TIER_DRAM] += PAGE;
            cr_assert_eq(kvt_policy_adopt(pol, n, i, 1, KVT_TIER_DRAM, NP, NULL), 1, "page %u", i);
        }
        check();
        size_t grew = kvt__policy_heap_len(pol, KVT_TIER_DRAM) - before;
        cr_assert_leq(grew, 2, "kind %d: %zu heap entries for one node's run", kinds[k], grew);
        all_in(tok, NP, KVT_TIER_DRAM);
        /* The tier is full: room for 8 more pages comes from the node's tail. */
        cr_assert_eq(hold(KVT_TIER_DRAM, 8, 1), 0, "kind %d", kinds[k]);
        cr_assert_eq(tier_of(tok, NP - 1), -1, "kind %d: the run's tail made the room", kinds[k]);
        for (int i = 0; i < 8; i++) {
            kvt_policy_unhold(pol, KVT_TIER_DRAM, PAGE);
            ex.used[KVT_TIER_DRAM] -= PAGE;
        }
        free(tok);
        stop();
    }
}

/* Lands the executor's last pending move, as kvtierd's I/O completion does. */
static void land_last(void)
{
    for (uint32_t i = 0; i < ex.last_npages; i++)
        kvt_radix_block_at(ex.last_n, ex.last_depth + i)->flags &= (uint8_t)~KVT_BLOCK_BUSY;
    uint64_t b = run_bytes(ex.last_n, ex.last_depth, ex.last_npages);
    cr_assert_eq(kvt_policy_move_done(pol, ex.last_n, ex.last_depth, ex.last_npages, ex.last_from,
                                      ex.last_to, 0),
                 0);
    ex.used[ex.last_from] -= b;
    ex.used[ex.last_to] += b;
}

/* A path of nodes of 2 pages each: the prompts of 2, 4, ... pages of tok one after the other,
 * each adding a node below the last, up to its `pages` (the last node of 1 page when odd). */
static void chain(const uint32_t *tok, uint32_t pages)
{
    for (uint32_t k = 2; k < pages + 2; k += 2)
        request(tok, (k < pages ? k : pages) * PS, NULL);
}

static size_t heap_entries(void)
{
    size_t n = 0;
    for (int t = KVT_TIER_HBM; t < KVT_TIER_COUNT; t++)
        n += kvt__policy_heap_len(pol, (kvt_tier_id_t)t);
    return n;
}

/* Prompt j of a family: the 14 pages of the shared prefix, then one page of its own. */
static uint32_t *branch(uint32_t j)
{
    uint32_t *t = seq(15 * PS, 7000);
    for (uint32_t i = 0; i < PS; i++)
        t[14 * PS + i] = 500000 + PS * j + i;
    return t;
}

/* A landed move (kvt_policy_move_done) pushes into the heaps only a run it made or whose
 * boundary's key fell, not every node of the path its lease held: those kept their entries, as
 * no victim search met them leased. A shared prefix of 7 nodes stays hot in HBM while the 16
 * one-page leaves below it leave the full HBM one at a time through moves in flight; the heaps
 * grow by about an entry a move (they took the path's 8 nodes a move, up to a rebuild: 119
 * entries here). The nodes are still victims: no rebuild was needed to find them, and the full
 * DRAM makes room from a leaf. Under LRU, LFU and the cost policy. */
Test(policy_decisions, landed_moves_push_only_what_changed)
{
    const kvt_policy_kind_t kinds[] = {KVT_POLICY_LRU, KVT_POLICY_LFU, KVT_POLICY_COST};
    for (size_t k = 0; k < sizeof(kinds) / sizeof(kinds[0]); k++) {
        kvt_policy_conf_t c = base_conf(kinds[k], 30, 16, 0);
        start(&c);
        uint32_t *leaf[16];
        for (uint32_t j = 0; j < 16; j++)
            leaf[j] = branch(j);
        chain(leaf[0], 15); /* the prefix's 7 nodes, and leaf 0 */
        for (uint32_t j = 1; j < 16; j++)
            request(leaf[j], 15 * PS, NULL);
        all_in(leaf[15], 15, KVT_TIER_HBM);
        kvt_policy_stats_t st0, st;
        kvt_policy_stats(pol, &st0);
        size_t before = heap_entries();
        for (int r = 0; r < 16; r++) {
            ex.pending = 1;
            /* one page of room: its move starts, and the room is on its way */
            cr_assert_eq(kvt_policy_hold(pol, KVT_TIER_HBM, PAGE, 1), KVT_EAGAIN, "kind %d, %d",
                         kinds[k], r);
            ex.pending = 0;
            land_last();
            cr_assert_eq(hold(KVT_TIER_HBM, 1, 0), 0); /* the landed room, kept held */
            check();
        }
        all_in(leaf[15], 14, KVT_TIER_HBM);
        for (uint32_t j = 0; j < 16; j++)
            cr_assert_eq(tier_of(leaf[j], 14), KVT_TIER_DRAM, "kind %d, leaf %u", kinds[k], j);
        size_t grew = heap_entries() - before;
        cr_assert_leq(grew, 32, "kind %d: the heaps grew by %zu entries in 16 moves", kinds[k],
                      grew);
        kvt_policy_stats(pol, &st);
        cr_assert_eq(st.rebuilds, st0.rebuilds, "kind %d: a victim was lost", kinds[k]);
        cr_assert_eq(hold(KVT_TIER_DRAM, 1, 1), 0, "kind %d", kinds[k]);
        uint32_t gone = 0;
        for (uint32_t j = 0; j < 16; j++)
            gone += tier_of(leaf[j], 14) == -1;
        cr_assert_eq(gone, 1, "kind %d: a leaf made the room", kinds[k]);
        for (int i = 0; i < 16; i++)
            kvt_policy_unhold(pol, KVT_TIER_HBM, PAGE);
        kvt_policy_unhold(pol, KVT_TIER_DRAM, PAGE);
        ex.used[KVT_TIER_HBM] -= 16 * PAGE;
        ex.used[KVT_TIER_DRAM] -= PAGE;
        for (uint32_t j = 0; j < 16; j++)
            free(leaf[j]);
        stop();
    }
}

/* A promotion pushes into the heaps the runs it made or whose boundary's key fell, and the
 * nodes of its path a victim search met while they were protected, not the whole path at
 * every call: a path of 8 nodes promoted a node a call, then prefetched whole 8 times where
 * nothing is left to move (the old way pushed its 8 nodes at each of those calls: 100 entries
 * under LRU). The path's nodes are still victims in HBM. Under LRU, LFU and the cost policy. */
Test(policy_decisions, promotions_push_only_what_changed)
{
    const kvt_policy_kind_t kinds[] = {KVT_POLICY_LRU, KVT_POLICY_LFU, KVT_POLICY_COST};
    for (size_t k = 0; k < sizeof(kinds) / sizeof(kinds[0]); k++) {
        kvt_policy_conf_t c = base_conf(kinds[k], 16, 32, 0);
        start(&c);
        uint32_t *tok = seq(16 * PS, 7000), *other = seq(16 * PS, 90000);
        chain(tok, 16);
        request(other, 16 * PS, NULL); /* takes HBM: the path goes to DRAM */
        all_in(tok, 16, KVT_TIER_DRAM);
        kvt_policy_stats_t st0, st;
        kvt_policy_stats(pol, &st0);
        size_t before = heap_entries();
        kvt_match_t m;
        for (uint32_t n = 1; n <= 8; n++) {
            cr_assert_eq(kvt_radix_match(tree, ns, tok, 2 * n * PS, KVT_MATCH_NOTOUCH, &m), 0);
            cr_assert_eq(kvt_policy_promote(pol, m.node, m.node_pages, KVT_TIER_HBM, NULL), 2,
                         "kind %d, node %u", kinds[k], n);
            check();
        }
        all_in(tok, 16, KVT_TIER_HBM);
        for (int r = 0; r < 8; r++)
            cr_assert_eq(kvt_policy_prefetch(pol, m.node, m.node_pages), 0);
        size_t grew = heap_entries() - before;
        cr_assert_leq(grew, 16, "kind %d: the heaps grew by %zu entries", kinds[k], grew);
        kvt_policy_stats(pol, &st);
        cr_assert_eq(st.rebuilds, st0.rebuilds, "kind %d: a victim was lost", kinds[k]);
        /* the path is a victim still: its pages make room in HBM */
        cr_assert_eq(hold(KVT_TIER_HBM, 2, 1), 0, "kind %d", kinds[k]);
        cr_assert_neq(tier_of(tok, 15), KVT_TIER_HBM, "kind %d", kinds[k]);
        for (int i = 0; i < 2; i++)
            kvt_policy_unhold(pol, KVT_TIER_HBM, PAGE);
        ex.used[KVT_TIER_HBM] -= 2 * PAGE;
        free(tok);
        free(other);
        stop();
    }
}
