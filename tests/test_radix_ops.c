/*
 * test_radix_ops.c: every radix operation and its edge cases, one behaviour per test, each
 * ending with kvt_radix_verify() and, where it matters, the tree's byte count.
 */
#include <criterion/criterion.h>
#include <malloc.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "radix.h"

#define PS 4

static kvt_radix_t *tree;
static uint32_t ns;
static uint64_t freed_blocks;
static uint64_t freed_by[3], nodes_freed_by[3]; /* by kvt_radix_why_t */

static void count_free(void *arg, uint32_t nsid, kvt_block_t *b, kvt_radix_why_t why)
{
    (void)arg;
    (void)nsid;
    (void)b;
    freed_blocks++;
    cr_assert_leq((unsigned)why, KVT_RADIX_DESTROY);
    freed_by[why]++;
}

static void count_node_free(void *arg, kvt_radix_node_t *n, kvt_radix_why_t why)
{
    (void)arg;
    (void)n;
    cr_assert_leq((unsigned)why, KVT_RADIX_DESTROY);
    nodes_freed_by[why]++;
}

static void setup(void)
{
    kvt_radix_conf_t conf = {.free_cb = count_free};
    freed_blocks = 0;
    cr_assert_eq(kvt_radix_create(&tree, &conf), 0);
    cr_assert_eq(kvt_radix_ns_open(tree, "llama", NULL, NULL, PS, &ns), 0);
}

static void teardown(void)
{
    cr_assert_eq(kvt_radix_verify(tree), 0);
    kvt_radix_destroy(tree);
    tree = NULL;
}

/* A sequence of n tokens where token i is base + i, so sequences with different bases differ
 * from their first token. */
static uint32_t *seq(uint32_t n, uint32_t base)
{
    uint32_t *s = malloc((n + 1) * sizeof(uint32_t));
    for (uint32_t i = 0; i < n; i++)
        s[i] = base + i;
    return s;
}

static uint32_t match_pages(const uint32_t *tok, size_t n)
{
    kvt_match_t m;
    cr_assert_eq(kvt_radix_match(tree, ns, tok, n, KVT_MATCH_NOTOUCH, &m), 0);
    return m.pages;
}

static kvt_insert_t insert(const uint32_t *tok, size_t n)
{
    kvt_insert_t r;
    cr_assert_eq(kvt_radix_insert(tree, ns, tok, n, &r), 0);
    cr_assert_eq(kvt_radix_verify(tree), 0);
    return r;
}

TestSuite(radix_ops, .init = setup, .fini = teardown);

Test(radix_ops, bad_arguments_return_einval)
{
    kvt_radix_t *t2;
    uint32_t tok[8] = {0}, id;
    kvt_match_t m;
    kvt_insert_t r;
    cr_expect_eq(kvt_radix_create(NULL, NULL), KVT_EINVAL);
    kvt_radix_conf_t bad = {.freq_half_life = -1};
    cr_expect_eq(kvt_radix_create(&t2, &bad), KVT_EINVAL);
    cr_expect_eq(kvt_radix_ns_open(tree, NULL, NULL, NULL, PS, &id), KVT_EINVAL);
    cr_expect_eq(kvt_radix_ns_open(tree, "m", NULL, NULL, 0, &id), KVT_EINVAL);
    cr_expect_eq(kvt_radix_ns_open(tree, "m", NULL, NULL, KVT_PAGE_MAX + 1, &id), KVT_EINVAL);
    char longname[300];
    memset(longname, 'x', sizeof(longname) - 1);
    longname[sizeof(longname) - 1] = '\0';
    cr_expect_eq(kvt_radix_ns_open(tree, longname, NULL, NULL, PS, &id), KVT_EINVAL);
    cr_expect_eq(kvt_radix_match(tree, ns + 7, tok, 8, 0, &m), KVT_EINVAL);
    cr_expect_eq(kvt_radix_match(tree, ns, NULL, 8, 0, &m), KVT_EINVAL);
    cr_expect_eq(kvt_radix_match(NULL, ns, tok, 8, 0, &m), KVT_EINVAL);
    cr_expect_eq(kvt_radix_match(tree, ns, tok, 8, 0, NULL), KVT_EINVAL);
    cr_expect_eq(kvt_radix_insert(tree, ns + 7, tok, 8, &r), KVT_EINVAL);
    cr_expect_eq(kvt_radix_insert(tree, ns, NULL, 8, &r), KVT_EINVAL);
    cr_expect_eq(kvt_radix_remove(tree, ns, tok, 0), KVT_EINVAL);
    cr_expect_eq(kvt_radix_remove(tree, ns, NULL, 8), KVT_EINVAL);
    cr_expect_eq(kvt_radix_evict(tree, NULL, 1), KVT_EINVAL);
    cr_expect_eq(kvt_radix_lease(tree, NULL, 1, NULL), KVT_EINVAL);
    cr_expect_eq(kvt_radix_release(NULL, 1), KVT_EINVAL);
    cr_expect_eq(kvt_radix_hash_pages(tree, ns + 7, tok, 1, NULL), KVT_EINVAL);
    cr_expect_str_eq(kvt_strerror(KVT_EINVAL), "invalid argument");
    kvt_radix_stats_t st;
    kvt_radix_stats(tree, &st);
    cr_expect_eq(st.blocks, 0);
}

Test(radix_ops, empty_and_short_inputs_cache_nothing)
{
    uint32_t *s = seq(PS - 1, 1);
    cr_expect_eq(match_pages(s, 0), 0);
    cr_expect_eq(match_pages(s, PS - 1), 0);
    kvt_insert_t r = insert(s, 0);
    cr_expect_eq(r.new_pages, 0);
    r = insert(s, PS - 1);
    cr_expect_eq(r.new_pages, 0);
    cr_expect_eq(r.pages, 0);
    kvt_radix_stats_t st;
    kvt_radix_stats(tree, &st);
    cr_expect_eq(st.blocks, 0);
    cr_expect_eq(st.nodes, 0);
    free(s);
}

Test(radix_ops, tokens_past_the_last_full_page_are_not_cached)
{
    uint32_t *s = seq(3 * PS + 2, 100);
    kvt_insert_t r = insert(s, 3 * PS + 2);
    cr_expect_eq(r.new_pages, 3);
    cr_expect_eq(r.first_page, 0);
    cr_expect_eq(match_pages(s, 3 * PS + 2), 3);
    /* The partial page's tokens were never stored: changing them changes nothing. */
    s[3 * PS] = 9999;
    cr_expect_eq(match_pages(s, 3 * PS + 2), 3);
    kvt_radix_stats_t st;
    kvt_radix_stats(tree, &st);
    cr_expect_eq(st.cached_tokens, 3 * PS);
    free(s);
}

Test(radix_ops, insert_is_idempotent_and_extends)
{
    uint32_t *s = seq(8 * PS, 1);
    cr_expect_eq(insert(s, 4 * PS).new_pages, 4);
    cr_expect_eq(insert(s, 4 * PS).new_pages, 0);
    kvt_insert_t r = insert(s, 8 * PS);
    cr_expect_eq(r.new_pages, 4);
    cr_expect_eq(r.first_page, 4);
    cr_expect_eq(kvt_radix_node_depth(r.node), 4);
    cr_expect_eq(match_pages(s, 8 * PS), 8);
    cr_expect_eq(match_pages(s, 6 * PS + 1), 6);
    free(s);
}

/* Two sequences of n pages sharing their first k pages and then diverging at token `at` inside
 * page k: for every k and every position in the page, both match fully afterwards and share
 * exactly k pages. */
Test(radix_ops, split_at_every_position)
{
    const uint32_t n = 6;
    for (uint32_t k = 0; k <= n; k++) {
        for (uint32_t at = 0; at < PS; at++) {
            kvt_radix_t *t;
            uint32_t id;
            cr_assert_eq(kvt_radix_create(&t, NULL), 0);
            cr_assert_eq(kvt_radix_ns_open(t, "m", NULL, NULL, PS, &id), 0);
            uint32_t *a = seq(n * PS, 10), *b = seq(n * PS, 10);
            if (k < n)
                b[k * PS + at] += 1000;
            kvt_insert_t r;
            kvt_match_t m;
            cr_assert_eq(kvt_radix_insert(t, id, a, n * PS, &r), 0);
            cr_assert_eq(kvt_radix_match(t, id, b, n * PS, 0, &m), 0);
            cr_expect_eq(m.pages, k, "k=%u at=%u: matched %u", k, at, m.pages);
            cr_assert_eq(kvt_radix_insert(t, id, b, n * PS, &r), 0);
            cr_expect_eq(r.new_pages, n - k);
            cr_expect_eq(r.first_page, k);
            cr_assert_eq(kvt_radix_verify(t), 0, "k=%u at=%u", k, at);
            cr_assert_eq(kvt_radix_match(t, id, a, n * PS, 0, &m), 0);
            cr_expect_eq(m.pages, n);
            cr_assert_eq(kvt_radix_match(t, id, b, n * PS, 0, &m), 0);
            cr_expect_eq(m.pages, n);
            kvt_radix_stats_t st;
            kvt_radix_stats(t, &st);
            cr_expect_eq(st.blocks, 2 * n - k);
            /* A split leaves at most three nodes: shared head, two tails. */
            cr_expect_leq(st.nodes, 3);
            free(a);
            free(b);
            kvt_radix_destroy(t);
        }
    }
}

Test(radix_ops, namespaces_are_isolated)
{
    uint32_t other, same, bysalt, byps;
    cr_assert_eq(kvt_radix_ns_open(tree, "llama", "lora-1", NULL, PS, &other), 0);
    cr_assert_eq(kvt_radix_ns_open(tree, "llama", NULL, NULL, PS, &same), 0);
    cr_assert_eq(kvt_radix_ns_open(tree, "llama", NULL, "tenant-a", PS, &bysalt), 0);
    cr_assert_eq(kvt_radix_ns_open(tree, "llama", NULL, NULL, 2 * PS, &byps), 0);
    cr_expect_eq(same, ns);
    cr_expect_neq(other, ns);
    cr_expect_neq(bysalt, ns);
    cr_expect_neq(byps, ns);
    cr_expect_neq(kvt_radix_ns_seed(tree, other), kvt_radix_ns_seed(tree, ns));
    cr_expect_neq(kvt_radix_ns_seed(tree, bysalt), kvt_radix_ns_seed(tree, ns));
    cr_expect_eq(kvt_radix_ns_page_size(tree, byps), 2 * PS);

    uint32_t *s = seq(8 * PS, 1);
    insert(s, 8 * PS);
    kvt_match_t m;
    uint32_t others[] = {other, bysalt, byps};
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(kvt_radix_match(tree, others[i], s, 8 * PS, 0, &m), 0);
        cr_expect_eq(m.pages, 0, "namespace %u sees another's prefix", others[i]);
    }
    /* The same tokens in another namespace hash to other block names. */
    uint64_t h1[8], h2[8];
    cr_assert_eq(kvt_radix_hash_pages(tree, ns, s, 8, h1), 0);
    cr_assert_eq(kvt_radix_hash_pages(tree, bysalt, s, 8, h2), 0);
    for (int i = 0; i < 8; i++)
        cr_expect_neq(h1[i], h2[i]);
    free(s);
}

Test(radix_ops, namespace_opened_by_seed_is_the_same_namespace)
{
    uint64_t seed = kvt_radix_ns_seed(tree, ns);
    uint32_t id;
    cr_assert_eq(kvt_radix_ns_open_seed(tree, seed, PS, &id), 0);
    cr_expect_eq(id, ns);
    cr_expect_eq(kvt_radix_ns_open_seed(tree, seed, PS + 1, &id), KVT_EINVAL);
    /* Learnt by seed first (a recovering tier), named later (a client's HELLO). */
    kvt_radix_t *t;
    cr_assert_eq(kvt_radix_create(&t, NULL), 0);
    uint32_t a, b;
    cr_assert_eq(kvt_radix_ns_open_seed(t, seed, PS, &a), 0);
    cr_assert_eq(kvt_radix_ns_open(t, "llama", NULL, NULL, PS, &b), 0);
    cr_expect_eq(a, b);
    cr_expect_eq(kvt_radix_verify(t), 0);
    kvt_radix_destroy(t);
}

Test(radix_ops, chain_hashes_are_lazy_and_match_hash_pages)
{
    uint32_t *a = seq(10 * PS, 1), *b = seq(10 * PS, 1);
    b[6 * PS] = 77777;
    insert(a, 10 * PS);
    kvt_insert_t rb = insert(b, 10 * PS);
    uint64_t ha[10], hb[10];
    cr_assert_eq(kvt_radix_hash_pages(tree, ns, a, 10, ha), 0);
    cr_assert_eq(kvt_radix_hash_pages(tree, ns, b, 10, hb), 0);
    for (int i = 0; i < 6; i++)
        cr_expect_eq(ha[i], hb[i]);
    for (int i = 6; i < 10; i++)
        cr_expect_neq(ha[i], hb[i]);
    /* Not computed by the insert... */
    cr_expect_eq(kvt_radix_block_at(rb.node, 9)->hash, 0);
    /* ...computed on demand, deepest first, and cached with everything above it. */
    cr_expect_eq(kvt_radix_block_hash(tree, rb.node, 9), hb[9]);
    for (uint32_t d = 0; d < 10; d++)
        cr_expect_eq(kvt_radix_block_at(rb.node, d)->hash, hb[d]);
    cr_expect_eq(kvt_radix_block_hash(tree, rb.node, 10), 0);
    kvt_match_t m;
    cr_assert_eq(kvt_radix_match(tree, ns, a, 10 * PS, 0, &m), 0);
    cr_expect_eq(kvt_radix_block_hash(tree, m.node, 9), ha[9]);
    /* A chain continued from a known page's hash is the same chain. */
    uint64_t hc[4];
    cr_assert_eq(kvt_radix_hash_chain(tree, ns, hb[5], b + 6 * PS, 4, hc), 0);
    for (int i = 0; i < 4; i++)
        cr_expect_eq(hc[i], hb[6 + i]);
    cr_expect_eq(kvt_radix_hash_chain(tree, ns + 7, 0, b, 1, hc), KVT_EINVAL);
    /* Two trees in two processes name the same prefix the same way. */
    kvt_radix_t *t;
    uint32_t id;
    cr_assert_eq(kvt_radix_create(&t, NULL), 0);
    cr_assert_eq(kvt_radix_ns_open(t, "llama", NULL, NULL, PS, &id), 0);
    kvt_insert_t r;
    cr_assert_eq(kvt_radix_insert(t, id, b, 10 * PS, &r), 0);
    cr_expect_eq(kvt_radix_block_hash(t, r.node, 7), hb[7]);
    kvt_radix_destroy(t);
    free(a);
    free(b);
}

Test(radix_ops, match_bumps_counters_only)
{
    uint32_t *s = seq(4 * PS, 1);
    kvt_radix_set_clock(tree, 1000);
    kvt_insert_t r = insert(s, 4 * PS);
    kvt_block_t *b = kvt_radix_node_blocks(r.node);
    cr_expect_eq(b[0].hits, 0);
    cr_expect_float_eq(b[0].freq, 1.0f, 1e-6);
    cr_expect_eq(b[0].last_access, 1000);
    kvt_radix_stats_t before, after;
    kvt_radix_stats(tree, &before);
    kvt_radix_set_clock(tree, 1000 + 600000); /* one default half-life later */
    kvt_match_t m;
    cr_assert_eq(kvt_radix_match(tree, ns, s, 2 * PS, 0, &m), 0);
    kvt_radix_stats(tree, &after);
    cr_expect_eq(before.bytes, after.bytes);
    cr_expect_eq(before.nodes, after.nodes);
    b = kvt_radix_node_blocks(r.node);
    cr_expect_eq(b[0].hits, 1);
    cr_expect_eq(b[1].hits, 1);
    cr_expect_eq(b[2].hits, 0, "an unmatched block was touched");
    cr_expect_float_eq(b[0].freq, 1.5f, 1e-4);
    cr_expect_eq(b[0].last_access, 601000);
    cr_expect_eq(b[2].last_access, 1000);
    cr_assert_eq(kvt_radix_match(tree, ns, s, 2 * PS, KVT_MATCH_NOTOUCH, &m), 0);
    cr_expect_eq(b[0].hits, 1);
    free(s);
}

/* A match's path whose blocks were last used at different times (runs of one age, ages that
 * alternate, one used this very tick, a hit count at its ceiling): each block decays by its own
 * age, once, and counts its hit. The touch works a run of equal ages at a time. */
Test(radix_ops, match_decays_each_block_by_its_own_age)
{
    enum { N = 9 };
    uint32_t *s = seq(N * PS, 1);
    kvt_radix_set_clock(tree, 1000);
    kvt_insert_t r = insert(s, N * PS);
    cr_assert_eq(r.new_pages, N);
    kvt_block_t *b = kvt_radix_node_blocks(r.node);
    const uint32_t now = 1000 + 600000;
    /* One default half-life (600,000 ticks) old, two, none, ... */
    const uint32_t age[N] = {600000, 600000, 1200000, 600000, 1200000, 0, 0, 300000, 600000};
    const float freq[N] = {1, 2, 4, 8, 3, 5, 7, 1, 2};
    for (int i = 0; i < N; i++) {
        b[i].last_access = now - age[i];
        b[i].freq = freq[i];
        b[i].hits = i == 4 ? UINT32_MAX : (uint32_t)i;
    }
    kvt_radix_set_clock(tree, now);
    kvt_match_t m;
    cr_assert_eq(kvt_radix_match(tree, ns, s, N * PS, 0, &m), 0);
    cr_assert_eq(m.pages, N);
    b = kvt_radix_node_blocks(r.node);
    for (int i = 0; i < N; i++) {
        float want = freq[i] * exp2f(-(float)age[i] / 600000.0f) + 1.0f;
        cr_expect_float_eq(b[i].freq, want, 1e-4, "block %d: freq %f, want %f", i, b[i].freq, want);
        cr_expect_eq(b[i].last_access, now, "block %d", i);
        cr_expect_eq(b[i].hits, i == 4 ? UINT32_MAX : (uint32_t)i + 1, "block %d: %u hits", i,
                     b[i].hits);
    }
    free(s);
}

Test(radix_ops, insert_matched_equals_insert)
{
    uint32_t *a = seq(8 * PS, 1), *b = seq(8 * PS, 1);
    b[3 * PS + 1] = 4242;
    insert(a, 8 * PS);
    kvt_match_t m;
    kvt_insert_t r;
    cr_assert_eq(kvt_radix_match(tree, ns, b, 8 * PS, 0, &m), 0);
    cr_expect_eq(m.pages, 3);
    cr_assert_eq(kvt_radix_insert_matched(tree, &m, b, 8 * PS, &r), 0);
    cr_expect_eq(r.new_pages, 5);
    cr_expect_eq(r.first_page, 3);
    cr_assert_eq(kvt_radix_verify(tree), 0);
    /* A stale match (the tree changed since) falls back to a full insert. */
    uint32_t *c = seq(8 * PS, 1);
    c[5 * PS] = 1;
    cr_assert_eq(kvt_radix_match(tree, ns, c, 8 * PS, 0, &m), 0);
    uint32_t *d = seq(4 * PS, 900);
    insert(d, 4 * PS);
    cr_assert_eq(kvt_radix_insert_matched(tree, &m, c, 8 * PS, &r), 0);
    cr_expect_eq(r.new_pages, 3);
    cr_expect_eq(r.first_page, 5);
    /* Other tokens than were matched: detected, and inserted correctly anyway. */
    cr_assert_eq(kvt_radix_match(tree, ns, a, 8 * PS, 0, &m), 0);
    uint32_t *e = seq(9 * PS, 5000);
    cr_assert_eq(kvt_radix_insert_matched(tree, &m, e, 9 * PS, &r), 0);
    cr_expect_eq(r.new_pages, 9);
    cr_expect_eq(match_pages(e, 9 * PS), 9);
    cr_expect_eq(match_pages(a, 8 * PS), 8);
    free(a);
    free(b);
    free(c);
    free(d);
    free(e);
}

Test(radix_ops, thousands_of_children)
{
    /* A shared system prompt of 8 pages with 3000 continuations of 2 pages each. */
    const uint32_t n = 3000;
    uint32_t *s = seq(10 * PS, 1);
    for (uint32_t i = 0; i < n; i++) {
        s[8 * PS] = 100000 + i;
        insert(s, 10 * PS);
    }
    kvt_radix_stats_t st;
    kvt_radix_stats(tree, &st);
    cr_expect_eq(st.blocks, 8 + 2 * n);
    for (uint32_t i = 0; i < n; i++) {
        s[8 * PS] = 100000 + i;
        cr_assert_eq(match_pages(s, 10 * PS), 10);
    }
    s[8 * PS] = 99;
    cr_expect_eq(match_pages(s, 10 * PS), 8);
    free(s);
}

/* Warming only reads: whatever the runs (on the path, off it, past its end, diverging inside
 * a node, shorter than a page, misaligned, more than it looks at, NULL), the tree, its counters
 * and every later match are as they were. */
Test(radix_ops, warming_changes_nothing)
{
    uint32_t *s = seq(40 * PS, 1), *t = seq(40 * PS, 1);
    kvt_radix_set_clock(tree, 5);
    for (uint32_t i = 0; i < 100; i++) { /* 8 shared pages, then 100 continuations of 2 */
        s[8 * PS] = 100000 + i;
        insert(s, 10 * PS);
    }
    insert(t, 40 * PS);
    t[20 * PS + 1] = 7; /* diverges inside the 32-page node */
    uint8_t *odd = malloc(40 * PS * sizeof(uint32_t) + 1);
    memcpy(odd + 1, s, 40 * PS * sizeof(uint32_t));
    kvt_token_run_t runs[KVT_WARM_MAX + 8];
    for (size_t i = 0; i < KVT_ARRAY_LEN(runs); i++)
        runs[i] = (kvt_token_run_t){.tokens = s, .ntokens = 40 * PS};
    runs[0] = (kvt_token_run_t){.tokens = t, .ntokens = 40 * PS};
    runs[1] = (kvt_token_run_t){.tokens = odd + 1, .ntokens = 10 * PS};
    runs[2] = (kvt_token_run_t){.tokens = s, .ntokens = PS - 1};
    runs[3] = (kvt_token_run_t){.tokens = NULL, .ntokens = 10 * PS};
    runs[4] = (kvt_token_run_t){.tokens = s, .ntokens = 0};
    uint32_t *miss = seq(10 * PS, 555555);
    runs[5] = (kvt_token_run_t){.tokens = miss, .ntokens = 10 * PS};

    kvt_radix_stats_t before, after;
    kvt_radix_stats(tree, &before);
    kvt_match_t m;
    cr_assert_eq(kvt_radix_match(tree, ns, t, 40 * PS, KVT_MATCH_NOTOUCH, &m), 0);
    kvt_block_t *b = kvt_radix_node_blocks(m.node), b0 = b[0];
    kvt_radix_set_clock(tree, 9);
    kvt_radix_warm(tree, ns, runs, KVT_ARRAY_LEN(runs));
    kvt_radix_warm(tree, ns + 1, runs, KVT_ARRAY_LEN(runs)); /* no such namespace */
    kvt_radix_warm(tree, ns, NULL, 3);
    kvt_radix_warm(NULL, ns, runs, 3);
    kvt_radix_stats(tree, &after);
    cr_expect_eq(memcmp(&before, &after, sizeof before), 0);
    b = kvt_radix_node_blocks(m.node);
    cr_expect_eq(memcmp(&b[0], &b0, sizeof b0), 0, "warming touched a block's counters");
    cr_expect_eq(match_pages(t, 40 * PS), 20);
    s[8 * PS] = 100000 + 99;
    cr_expect_eq(match_pages(s, 10 * PS), 10);
    cr_expect_eq(match_pages(miss, 10 * PS), 0);
    free(miss);
    free(odd);
    free(s);
    free(t);
}

/* A warming plan notes, for each run, the tokens and blocks of each node on its path, as far as
 * the run goes in it (run by run, in the runs' order; none for a run that leaves the tree at once
 * or is shorter than a page), asks for none of them until kvt_radix_warm_run, and changes nothing;
 * a plan gone stale (its nodes freed) is still safe to run: it holds addresses only. */
Test(radix_ops, a_warming_plan_notes_each_runs_pages_along_its_path)
{
    uint32_t *a = seq(20 * PS, 1), *b = seq(20 * PS, 1), *miss = seq(4 * PS, 777777);
    insert(a, 20 * PS);
    b[12 * PS] = 5; /* a's first 12 pages, then 3 of its own: a split at 12 */
    insert(b, 15 * PS);
    kvt_match_t ma, mb;
    cr_assert_eq(kvt_radix_match(tree, ns, a, 20 * PS, KVT_MATCH_NOTOUCH, &ma), 0);
    cr_assert_eq(kvt_radix_match(tree, ns, b, 15 * PS, KVT_MATCH_NOTOUCH, &mb), 0);
    kvt_radix_node_t *head = kvt_radix_node_parent(ma.node);
    cr_assert(head && head == kvt_radix_node_parent(mb.node));
    kvt_radix_stats_t before, after;
    kvt_radix_stats(tree, &before);

    static kvt_warm_plan_t plan;
    kvt_token_run_t runs[] = {
        {.tokens = a, .ntokens = 18 * PS + 3}, /* 12 pages in head, 6 of a's 8 */
        {.tokens = miss, .ntokens = 4 * PS},   /* not in the tree */
        {.tokens = b, .ntokens = PS - 1},      /* shorter than a page */
        {.tokens = b, .ntokens = 15 * PS},     /* head, then b's 3 */
    };
    kvt_radix_warm_plan(tree, ns, runs, KVT_ARRAY_LEN(runs), &plan);
    cr_assert_eq(plan.n, 4);
    cr_assert_eq(plan.nspans[0], 2);
    cr_expect_eq(plan.nspans[1], 0);
    cr_expect_eq(plan.nspans[2], 0);
    cr_assert_eq(plan.nspans[3], 2);
    const size_t pb = PS * sizeof(uint32_t);
    cr_expect(plan.span[0][0].tokens == kvt_radix_node_tokens(head, 0) &&
              plan.span[0][0].blocks == kvt_radix_node_blocks(head) &&
              plan.span[0][0].token_bytes == 12 * pb &&
              plan.span[0][0].block_bytes == 12 * sizeof(kvt_block_t));
    cr_expect(plan.span[0][1].tokens == kvt_radix_node_tokens(ma.node, 0) &&
              plan.span[0][1].blocks == kvt_radix_node_blocks(ma.node) &&
              plan.span[0][1].token_bytes == 6 * pb);
    cr_expect(plan.span[3][1].tokens == kvt_radix_node_tokens(mb.node, 0) &&
              plan.span[3][1].token_bytes == 3 * pb &&
              plan.span[3][1].block_bytes == 3 * sizeof(kvt_block_t));
    for (size_t i = 0; i < KVT_WARM_MAX + 2; i++)
        kvt_radix_warm_run(&plan, i);
    kvt_radix_warm_run(NULL, 0);
    kvt_radix_stats(tree, &after);
    cr_expect_eq(memcmp(&before, &after, sizeof before), 0);

    /* No namespace, no runs: an empty plan. */
    kvt_radix_warm_plan(tree, ns + 1, runs, KVT_ARRAY_LEN(runs), &plan);
    cr_expect_eq(plan.n, 0);
    kvt_radix_warm_plan(tree, ns, runs, KVT_ARRAY_LEN(runs), &plan);
    cr_assert_eq(kvt_radix_remove(tree, ns, a, PS), 0); /* every node of the plan goes */
    for (size_t i = 0; i < plan.n; i++)
        kvt_radix_warm_run(&plan, i);
    cr_expect_eq(match_pages(a, 20 * PS), 0);
    cr_expect_eq(match_pages(b, 15 * PS), 0);
    free(a);
    free(b);
    free(miss);
}

static uint64_t trim_hashed; /* dropped blocks whose chain hash was known when they went */

static int trim_drop(void *arg, kvt_radix_node_t *n, uint32_t npages)
{
    kvt_block_t *b = kvt_radix_node_blocks(n);
    for (uint32_t i = kvt_radix_node_pages(n) - npages; i < kvt_radix_node_pages(n); i++)
        trim_hashed += b[i].hash != 0;
    int rc = kvt_radix_evict(arg, n, npages);
    return rc < 0 ? rc : (int)npages;
}

/* Trimming takes the tails of unleased leaves that the predicate accepts, oldest first as far as
 * sampling sees, down to the target: 100 prompts last used at clock 1, then 10 used at clock
 * 1000; a leased old one, and one whose last page holds bytes, stay. */
Test(radix_ops, trim_takes_the_least_recently_used_accepted_tails)
{
    enum { OLD = 100, NEW = 10, PAGES = 4 };
    uint32_t *s = seq(PAGES * PS, 1);
    kvt_radix_set_clock(tree, 1);
    for (uint32_t i = 0; i < OLD + NEW; i++) {
        if (i == OLD)
            kvt_radix_set_clock(tree, 1000);
        s[0] = 1000000 + i; /* every prompt its own leaf under the root */
        insert(s, PAGES * PS);
    }
    kvt_match_t m;
    s[0] = 1000000 + 0;
    cr_assert_eq(kvt_radix_match(tree, ns, s, PAGES * PS, KVT_MATCH_NOTOUCH, &m), 0);
    uint64_t lease;
    cr_assert_eq(kvt_radix_lease(tree, &m, 7, &lease), 0);
    s[0] = 1000000 + 1;
    cr_assert_eq(kvt_radix_match(tree, ns, s, PAGES * PS, KVT_MATCH_NOTOUCH, &m), 0);
    kvt_radix_node_blocks(m.node)[PAGES - 1].tier = KVT_TIER_DRAM; /* holds bytes: not taken */

    kvt_radix_stats_t st;
    kvt_radix_stats(tree, &st);
    uint64_t full = st.bytes;
    freed_blocks = trim_hashed = 0;
    cr_expect_eq(kvt_radix_trim(tree, 0, 0, kvt_radix_index_only, trim_drop, tree), 0, "no budget");
    cr_expect_eq(kvt_radix_trim(tree, full, 100, kvt_radix_index_only, trim_drop, tree), 0,
                 "at the target already");
    /* Down to about half: the old prompts go, the recent ones stay. */
    uint64_t target = full / 2;
    uint32_t got = kvt_radix_trim(tree, target, 100000, kvt_radix_index_only, trim_drop, tree);
    kvt_radix_stats(tree, &st);
    cr_expect_leq(st.bytes, target);
    cr_expect_gt(got, 0);
    cr_expect_eq(freed_blocks, got, "every page trimmed went through the free callback");
    cr_expect_eq(trim_hashed, got, "with its chain hash computed");
    for (uint32_t i = OLD; i < OLD + NEW; i++) {
        s[0] = 1000000 + i;
        cr_expect_eq(match_pages(s, PAGES * PS), PAGES, "recent prompt %u was trimmed", i);
    }
    /* Everything it may take: only the leased prompt and the one with bytes at its tail stay. */
    kvt_radix_trim(tree, 0, 100000, kvt_radix_index_only, trim_drop, tree);
    kvt_radix_stats(tree, &st);
    cr_expect_eq(st.blocks, 2 * PAGES);
    s[0] = 1000000 + 0;
    cr_expect_eq(match_pages(s, PAGES * PS), PAGES, "the leased prompt stays");
    s[0] = 1000000 + 1;
    cr_expect_eq(match_pages(s, PAGES * PS), PAGES, "a tail with bytes stays");
    kvt_radix_node_blocks(m.node)[PAGES - 1].tier = KVT_TIER_NONE;
    cr_assert_eq(kvt_radix_release(tree, lease), 0);
    free(s);
}

Test(radix_ops, remove_a_prefix_and_its_continuations)
{
    uint32_t *a = seq(8 * PS, 1), *b = seq(8 * PS, 1), *c = seq(8 * PS, 1);
    b[5 * PS] = 555;
    c[2 * PS] = 222;
    insert(a, 8 * PS);
    insert(b, 8 * PS);
    insert(c, 8 * PS);
    uint64_t before = freed_blocks;
    /* Removing a's first 4 pages drops page 3 and everything under it: a's and b's tails. */
    cr_assert_eq(kvt_radix_remove(tree, ns, a, 4 * PS + 1), 0);
    cr_assert_eq(kvt_radix_verify(tree), 0);
    cr_expect_eq(match_pages(a, 8 * PS), 3);
    cr_expect_eq(match_pages(b, 8 * PS), 3);
    cr_expect_eq(match_pages(c, 8 * PS), 8);
    cr_expect_eq(freed_blocks - before, (8 - 3) + (8 - 5));
    cr_expect_eq(kvt_radix_remove(tree, ns, a, 4 * PS), KVT_ENOENT);
    /* Remove at a node's first page takes the whole node. */
    cr_assert_eq(kvt_radix_remove(tree, ns, c, 3 * PS), 0);
    cr_expect_eq(match_pages(c, 8 * PS), 2);
    cr_expect_eq(match_pages(a, 8 * PS), 3);
    cr_assert_eq(kvt_radix_remove(tree, ns, a, PS), 0);
    kvt_radix_stats_t st;
    kvt_radix_stats(tree, &st);
    cr_expect_eq(st.blocks, 0);
    cr_expect_eq(st.nodes, 0);
    cr_expect_eq(kvt_radix_evictable_count(tree), 0);
    free(a);
    free(b);
    free(c);
}

Test(radix_ops, lease_then_remove_is_refused)
{
    uint32_t *a = seq(6 * PS, 1);
    insert(a, 6 * PS);
    kvt_match_t m;
    uint64_t lease;
    cr_assert_eq(kvt_radix_match(tree, ns, a, 6 * PS, 0, &m), 0);
    cr_assert_eq(kvt_radix_lease(tree, &m, 7, &lease), 0);
    cr_expect_neq(lease, 0);
    kvt_radix_stats_t before, after;
    kvt_radix_stats(tree, &before);
    cr_expect_eq(kvt_radix_remove(tree, ns, a, 3 * PS), KVT_EBUSY);
    cr_expect_eq(kvt_radix_evict(tree, m.node, 1), KVT_EBUSY);
    kvt_radix_stats(tree, &after);
    cr_expect_eq(before.blocks, after.blocks);
    cr_expect_eq(match_pages(a, 6 * PS), 6);
    cr_expect_eq(kvt_radix_evictable_count(tree), 0);
    cr_expect_eq(kvt_radix_release(tree, lease), 0);
    cr_expect_eq(kvt_radix_release(tree, lease), KVT_ENOENT, "a second release is harmless");
    cr_expect_eq(kvt_radix_release(tree, 12345), KVT_ENOENT);
    cr_expect_eq(kvt_radix_lease_count(tree), 0);
    cr_expect_eq(kvt_radix_remove(tree, ns, a, 3 * PS), 0);
    cr_expect_eq(match_pages(a, 6 * PS), 2);
    free(a);
}

Test(radix_ops, leases_survive_splits_and_release_by_owner)
{
    uint32_t *a = seq(8 * PS, 1), *b = seq(8 * PS, 1), *c = seq(8 * PS, 1);
    b[4 * PS] = 4444;
    c[2 * PS] = 2222;
    insert(a, 8 * PS);
    kvt_match_t m;
    uint64_t l1, l2, l3;
    cr_assert_eq(kvt_radix_match(tree, ns, a, 8 * PS, 0, &m), 0);
    cr_assert_eq(kvt_radix_lease(tree, &m, 1, &l1), 0);
    cr_assert_eq(kvt_radix_lease(tree, &m, 2, &l2), 0);
    kvt_radix_node_t *leased = m.node;
    /* Splits above the leased node: it keeps its address and its pin. */
    insert(b, 8 * PS);
    insert(c, 8 * PS);
    cr_expect(kvt_radix_node_leased(leased));
    cr_expect_eq(kvt_radix_node_depth(leased), 4);
    cr_expect(kvt_radix_node_leased(kvt_radix_node_parent(leased)));
    cr_assert_eq(kvt_radix_match(tree, ns, c, 8 * PS, 0, &m), 0);
    cr_assert_eq(kvt_radix_lease(tree, &m, 1, &l3), 0);
    cr_expect_eq(kvt_radix_lease_count(tree), 3);
    cr_expect_eq(kvt_radix_lease_releases(tree), 0);
    cr_expect_eq(kvt_radix_release_owner(tree, 1), 2);
    cr_expect_eq(kvt_radix_release(tree, l1), KVT_ENOENT);
    cr_expect_eq(kvt_radix_release(tree, l3), KVT_ENOENT);
    cr_expect_eq(kvt_radix_lease_releases(tree), 2, "ends by owner count, failed releases do not");
    cr_expect(kvt_radix_node_leased(leased));
    cr_expect_eq(kvt_radix_release_owner(tree, 1), 0);
    cr_expect_eq(kvt_radix_release(tree, l2), 0);
    cr_expect_eq(kvt_radix_lease_releases(tree), 3);
    cr_expect_eq(kvt_radix_lease_releases(NULL), 0);
    cr_expect(!kvt_radix_node_leased(leased));
    cr_expect_eq(kvt_radix_evictable_count(tree), 3);
    kvt_match_t empty = {0};
    cr_expect_eq(kvt_radix_lease(tree, &empty, 1, &l1), KVT_ENOENT);
    cr_expect_eq(kvt_radix_lease(tree, &m, 0, &l1), KVT_EINVAL);
    free(a);
    free(b);
    free(c);
}

/* kvt_radix_node_leased_before (kvtierd's kept copies): only the leases taken before a number
 * count, on every node of their path, a split's new parent included; those taken after it, on
 * the same node, do not. */
Test(radix_ops, leases_taken_before_a_number_are_told_from_later_ones)
{
    uint32_t *a = seq(8 * PS, 1), *b = seq(8 * PS, 1), *c = seq(2 * PS, 500);
    b[4 * PS] = 4444;
    insert(a, 8 * PS);
    insert(c, 2 * PS);
    kvt_match_t m, mc;
    uint64_t before, after, other;
    cr_assert_eq(kvt_radix_match(tree, ns, a, 8 * PS, 0, &m), 0);
    cr_assert_eq(kvt_radix_match(tree, ns, c, 2 * PS, 0, &mc), 0);
    kvt_radix_node_t *n = m.node;
    cr_assert_eq(kvt_radix_lease(tree, &m, 1, &before), 0);
    uint64_t mark = kvt_radix_lease_seq(tree);
    cr_assert_eq(kvt_radix_lease(tree, &m, 1, &after), 0);
    cr_assert_eq(kvt_radix_lease(tree, &mc, 1, &other), 0);
    cr_expect_eq(kvt_radix_lease_seq(tree), mark + 2);
    cr_expect(kvt_radix_node_leased_before(tree, n, mark));
    insert(b, 8 * PS); /* splits n: its head goes to a new parent, which the leases run through */
    kvt_radix_node_t *head = kvt_radix_node_parent(n);
    cr_assert_not_null(head);
    cr_expect(kvt_radix_node_leased_before(tree, head, mark));
    cr_expect(!kvt_radix_node_leased_before(tree, mc.node, mark), "another path's later lease");
    cr_expect_eq(kvt_radix_release(tree, before), 0);
    cr_expect(kvt_radix_node_leased(n));
    cr_expect(!kvt_radix_node_leased_before(tree, n, mark), "only a later lease holds it");
    cr_expect(!kvt_radix_node_leased_before(tree, head, mark));
    cr_expect(kvt_radix_node_leased_before(tree, n, mark + 1));
    cr_expect(!kvt_radix_node_leased_before(NULL, n, mark));
    cr_expect_eq(kvt_radix_release(tree, after), 0);
    cr_expect_eq(kvt_radix_release(tree, other), 0);
    cr_expect(!kvt_radix_node_leased_before(tree, n, UINT64_MAX));
    free(a);
    free(b);
    free(c);
}

/* kvt_radix_node_mark (kvtierd's kept copies): the marked node counts the leases through it
 * taken before the mark, and answers leased_before for the mark's number from that count, as the
 * walk would, through releases by id and by owner and a split above it; kvt_radix_verify checks
 * the count against the leases. A second mark leaves the first number to the walk. */
Test(radix_ops, a_marked_node_counts_the_leases_taken_before_its_mark)
{
    uint32_t *a = seq(8 * PS, 1), *b = seq(8 * PS, 1);
    b[2 * PS] = 4444;
    insert(a, 8 * PS);
    kvt_match_t m, head_m;
    cr_assert_eq(kvt_radix_match(tree, ns, a, 8 * PS, 0, &m), 0);
    cr_assert_eq(kvt_radix_match(tree, ns, a, 2 * PS, 0, &head_m), 0);
    kvt_radix_node_t *n = m.node;
    uint64_t l1, l2, l3, l4;
    cr_assert_eq(kvt_radix_lease(tree, &m, 1, &l1), 0);
    cr_assert_eq(kvt_radix_lease(tree, &head_m, 2, &l2), 0); /* two pages of n: through it */
    uint64_t mark = kvt_radix_node_mark(tree, n);
    cr_expect_eq(mark, kvt_radix_lease_seq(tree));
    cr_assert_eq(kvt_radix_lease(tree, &m, 1, &l3), 0);
    cr_expect(kvt_radix_node_leased_before(tree, n, mark));
    cr_expect_eq(kvt_radix_verify(tree), 0);
    insert(b, 8 * PS); /* splits n after 2 pages: the head's new node is unmarked */
    kvt_radix_node_t *head = kvt_radix_node_parent(n);
    cr_assert_not_null(head);
    cr_expect_eq(kvt_radix_verify(tree), 0);
    cr_expect(kvt_radix_node_leased_before(tree, head, mark), "the walk, for the head");
    cr_expect_eq(kvt_radix_release(tree, l1), 0);
    cr_expect(kvt_radix_node_leased_before(tree, n, mark), "l2 still runs through n");
    cr_expect_eq(kvt_radix_release_owner(tree, 2), 1);
    cr_expect(!kvt_radix_node_leased_before(tree, n, mark), "only l3, taken after the mark");
    cr_expect(!kvt_radix_node_leased_before(tree, head, mark));
    cr_expect_eq(kvt_radix_verify(tree), 0);
    /* Marked again while l3 holds: the new number counts it, the first is left to the walk. */
    uint64_t again = kvt_radix_node_mark(tree, n);
    cr_assert_eq(kvt_radix_lease(tree, &m, 1, &l4), 0);
    cr_expect(kvt_radix_node_leased_before(tree, n, again));
    cr_expect(!kvt_radix_node_leased_before(tree, n, mark));
    cr_expect_eq(kvt_radix_release(tree, l3), 0);
    cr_expect(!kvt_radix_node_leased_before(tree, n, again));
    cr_expect(kvt_radix_node_leased(n));
    cr_expect_eq(kvt_radix_verify(tree), 0);
    cr_expect_eq(kvt_radix_release(tree, l4), 0);
    cr_expect_eq(kvt_radix_node_mark(NULL, n), 0);
    cr_expect_eq(kvt_radix_node_mark(tree, NULL), kvt_radix_lease_seq(tree));
    free(a);
    free(b);
}

/* kvt_radix_split_at (kvtierd's PUT with gaps): the page begins a node; blocks, matches and
 * leases are as before, the split node keeps its address, and the head goes once the tail has. */
Test(radix_ops, split_at_a_page_changes_only_the_grouping)
{
    uint32_t *a = seq(8 * PS, 1);
    kvt_insert_t r = insert(a, 8 * PS);
    kvt_block_t *bl = kvt_radix_node_blocks(r.node);
    for (uint32_t i = 0; i < 8; i++)
        bl[i].loc = 100 + i;
    kvt_match_t m;
    uint64_t lease;
    cr_assert_eq(kvt_radix_match(tree, ns, a, 8 * PS, 0, &m), 0);
    cr_assert_eq(kvt_radix_lease(tree, &m, 1, &lease), 0);
    size_t nodes = kvt_radix_node_count(tree);
    cr_expect_eq(kvt_radix_split_at(tree, r.node, 0), 0, "a node begins there already");
    cr_expect_eq(kvt_radix_node_count(tree), nodes);
    cr_expect_eq(kvt_radix_split_at(tree, r.node, 8), KVT_EINVAL, "past the path");
    cr_expect_eq(kvt_radix_split_at(NULL, r.node, 1), KVT_EINVAL);
    cr_expect_eq(kvt_radix_split_at(tree, NULL, 1), KVT_EINVAL);
    cr_expect_eq(kvt_radix_split_need(tree, r.node, 0), 0);
    uint64_t need = kvt_radix_split_need(tree, r.node, 5);
    cr_expect_gt(need, 0);
    kvt_radix_stats_t before, after;
    kvt_radix_stats(tree, &before);
    cr_assert_eq(kvt_radix_split_at(tree, r.node, 5), 0);
    cr_assert_eq(kvt_radix_verify(tree), 0);
    kvt_radix_stats(tree, &after);
    cr_expect_leq(after.bytes, before.bytes + need, "the split added no more than its need");
    cr_expect_eq(kvt_radix_split_need(tree, r.node, 5), 0, "split there already");
    cr_expect_eq(kvt_radix_node_count(tree), nodes + 1);
    cr_expect_eq(kvt_radix_node_depth(r.node), 5, "the tail keeps the node's address");
    cr_expect_eq(kvt_radix_node_pages(r.node), 3);
    kvt_radix_node_t *head = kvt_radix_node_parent(r.node);
    cr_expect_eq(kvt_radix_node_pages(head), 5);
    cr_expect(kvt_radix_node_leased(head), "the head inherits the lease");
    for (uint32_t i = 0; i < 8; i++)
        cr_expect_eq(kvt_radix_block_at(r.node, i)->loc, 100 + i, "page %u", i);
    cr_expect_eq(match_pages(a, 8 * PS), 8);
    cr_expect_eq(kvt_radix_split_at(tree, r.node, 5), 0, "split there already");
    cr_expect_eq(kvt_radix_node_count(tree), nodes + 1);
    cr_expect_eq(kvt_radix_evict(tree, head, 1), KVT_EBUSY, "not a leaf");
    cr_expect_eq(kvt_radix_release(tree, lease), 0);
    cr_assert_eq(kvt_radix_evict(tree, r.node, 3), 0);
    cr_expect_eq(match_pages(a, 8 * PS), 5, "the head is a leaf now");
    cr_assert_eq(kvt_radix_evict(tree, head, 5), 0);
    cr_expect_eq(match_pages(a, 8 * PS), 0);
    cr_expect_eq(freed_blocks, 8);
    free(a);
}

Test(radix_ops, evictable_blocks_are_leaves_first)
{
    uint32_t *a = seq(6 * PS, 1), *b = seq(6 * PS, 1);
    b[3 * PS] = 3333;
    insert(a, 6 * PS);
    insert(b, 6 * PS);
    /* Head [0,3) with two leaves [3,6): only the leaves are evictable. */
    cr_expect_eq(kvt_radix_evictable_count(tree), 2);
    kvt_radix_node_t *n = kvt_radix_evictable_first(tree);
    cr_assert_not_null(n);
    cr_expect_eq(kvt_radix_node_depth(n), 3);
    cr_expect_eq(kvt_radix_node_children(n), 0);
    kvt_radix_node_t *head = kvt_radix_node_parent(n);
    cr_expect_eq(kvt_radix_evict(tree, head, 1), KVT_EBUSY, "a block with a cached child");
    /* Evict one leaf block by block; the last one frees the node. */
    cr_assert_eq(kvt_radix_evict(tree, n, 1), 0);
    cr_assert_eq(kvt_radix_verify(tree), 0);
    cr_assert_eq(kvt_radix_evict(tree, n, 2), 0);
    cr_assert_eq(kvt_radix_verify(tree), 0);
    cr_expect_eq(kvt_radix_evictable_count(tree), 1);
    n = kvt_radix_evictable_first(tree);
    cr_assert_eq(kvt_radix_evict(tree, n, 3), 0);
    /* The head is a leaf now. */
    cr_expect_eq(kvt_radix_evictable_count(tree), 1);
    cr_expect_eq(kvt_radix_evictable_first(tree), head);
    cr_expect_eq(kvt_radix_evict(tree, head, 4), KVT_EINVAL);
    cr_assert_eq(kvt_radix_evict(tree, head, 3), 0);
    cr_expect_eq(kvt_radix_evictable_count(tree), 0);
    cr_expect_eq(freed_blocks, 9);
    cr_expect_eq(match_pages(a, 6 * PS), 0);
    free(a);
    free(b);
}

Test(radix_ops, busy_blocks_are_not_evicted)
{
    uint32_t *a = seq(3 * PS, 1);
    kvt_insert_t r = insert(a, 3 * PS);
    kvt_radix_node_blocks(r.node)[2].flags |= KVT_BLOCK_BUSY;
    cr_expect_eq(kvt_radix_evict(tree, r.node, 1), KVT_EBUSY);
    cr_expect_eq(kvt_radix_remove(tree, ns, a, PS), KVT_EBUSY);
    kvt_radix_node_blocks(r.node)[2].flags &= (uint8_t)~KVT_BLOCK_BUSY;
    cr_expect_eq(kvt_radix_evict(tree, r.node, 1), 0);
    free(a);
}

Test(radix_ops, path_iterator_walks_blocks_in_order)
{
    /* A conversation: each turn extends the last, making a chain of 100 nodes (past the
     * iterator's 64-level cache). */
    const uint32_t turns = 100;
    uint32_t *s = seq(turns * PS, 1);
    for (uint32_t i = 1; i <= turns; i++)
        insert(s, i * PS);
    kvt_match_t m;
    cr_assert_eq(kvt_radix_match(tree, ns, s, turns * PS, 0, &m), 0);
    cr_expect_eq(m.pages, turns);
    uint64_t h[100];
    cr_assert_eq(kvt_radix_hash_pages(tree, ns, s, turns, h), 0);
    cr_expect_eq(kvt_radix_block_hash(tree, m.node, turns - 1), h[turns - 1]);
    kvt_path_iter_t it;
    kvt_path_iter_init(&it, m.node, m.node_pages);
    kvt_radix_node_t *holder;
    kvt_block_t *b;
    uint32_t d = 0;
    while ((b = kvt_path_iter_next(&it, &holder)) != NULL) {
        cr_assert_eq(b->hash, h[d]);
        cr_assert_eq(kvt_radix_node_tokens(holder, d - kvt_radix_node_depth(holder))[0], s[d * PS]);
        cr_assert_eq(kvt_radix_block_at(m.node, d), b);
        cr_assert_eq(kvt_radix_node_holding(m.node, d), holder);
        d++;
    }
    cr_expect_eq(d, turns);
    cr_expect_null(kvt_radix_node_holding(m.node, turns));
    /* Node by node, from the deepest up: the same blocks, each at its depth, each once. */
    uint32_t seen = 0, top = turns;
    for (kvt_path_run_t r = kvt_path_run_first(m.node, m.node_pages); r.node;
         kvt_path_run_next(&r)) {
        cr_assert_eq(r.depth + r.n, top, "runs are contiguous, deepest first");
        for (uint32_t i = 0; i < r.n; i++)
            cr_assert_eq(r.blocks[i].hash, h[r.depth + i]);
        seen += r.n;
        top = r.depth;
    }
    cr_expect_eq(seen, turns);
    cr_expect_eq(top, 0);
    cr_expect_null(kvt_path_run_first(NULL, 0).node);
    /* A short path uses the cached levels. */
    cr_assert_eq(kvt_radix_match(tree, ns, s, 5 * PS, 0, &m), 0);
    kvt_path_iter_init(&it, m.node, m.node_pages);
    for (d = 0; (b = kvt_path_iter_next(&it, NULL)) != NULL; d++)
        cr_assert_eq(b->hash, h[d]);
    cr_expect_eq(d, 5);
    kvt_path_iter_init(&it, NULL, 0);
    cr_expect_null(kvt_path_iter_next(&it, NULL));
    free(s);
}

/* Hashes asked for one page after the other along a long node, as kvtierd keys a PUT's new pages
 * (each page and its parent): every one right, the computed ones still a prefix. The cost, which
 * used to grow with the page's place in its node, is measured by bench_radix (block_hash_*). */
Test(radix_ops, block_hash_in_order_along_a_long_node)
{
    const uint32_t pages = 1000;
    uint32_t *s = seq(pages * PS, 1);
    insert(s, 10 * PS);
    kvt_insert_t r;
    cr_assert_eq(kvt_radix_insert(tree, ns, s, pages * PS, &r), 0);
    cr_assert_eq(r.first_page, 10);
    cr_assert_eq(r.new_pages, pages - 10);
    uint64_t *h = malloc(pages * sizeof(uint64_t));
    cr_assert_not_null(h);
    cr_assert_eq(kvt_radix_hash_pages(tree, ns, s, pages, h), 0);
    for (uint32_t d = 10; d < pages; d++) {
        cr_assert_eq(kvt_radix_block_hash(tree, r.node, d), h[d], "depth %u", d);
        cr_assert_eq(kvt_radix_block_hash(tree, r.node, d - 1), h[d - 1], "depth %u", d - 1);
        if (d + 1 < pages)
            cr_assert_eq(kvt_radix_block_at(r.node, d + 1)->hash, 0, "nothing past %u yet", d);
    }
    cr_assert_eq(kvt_radix_verify(tree), 0);
    free(h);
    free(s);
}

/* Hashes asked for out of order on a path of 150 nodes of 3 pages each (more than the 64 nodes
 * kvt_radix_block_hash gathers per round), from inside a node, above what is hashed, below. */
Test(radix_ops, block_hash_on_a_deep_path_in_any_order)
{
    const uint32_t turns = 150, per = 3, pages = turns * per;
    uint32_t *s = seq(pages * PS, 1);
    for (uint32_t i = 1; i <= turns; i++)
        insert(s, i * per * PS);
    uint64_t *h = malloc(pages * sizeof(uint64_t));
    cr_assert_not_null(h);
    cr_assert_eq(kvt_radix_hash_pages(tree, ns, s, pages, h), 0);
    kvt_match_t m;
    cr_assert_eq(kvt_radix_match(tree, ns, s, pages * PS, KVT_MATCH_NOTOUCH, &m), 0);
    cr_assert_eq(m.pages, pages);
    const uint32_t order[] = {4, 301, 2, 302, 300, 449, 0, 448, 65 * 3 + 1};
    for (size_t i = 0; i < KVT_ARRAY_LEN(order); i++) {
        uint32_t d = order[i];
        cr_expect_eq(kvt_radix_block_hash(tree, m.node, d), h[d], "depth %u", d);
        cr_expect_eq(kvt_radix_block_at(m.node, d)->hash, h[d], "depth %u", d);
        cr_assert_eq(kvt_radix_verify(tree), 0); /* computed hashes are still a prefix */
    }
    /* Nothing below the deepest asked for is hashed yet on a fresh branch. */
    uint32_t *b = seq(pages * PS, 1);
    b[200 * PS] = 7; /* a branch at page 200, inside a node */
    kvt_insert_t r;
    cr_assert_eq(kvt_radix_insert(tree, ns, b, pages * PS, &r), 0);
    cr_assert_eq(r.first_page, 200);
    cr_expect_eq(kvt_radix_block_at(r.node, 200)->hash, 0);
    uint64_t *hb = malloc(pages * sizeof(uint64_t));
    cr_assert_not_null(hb);
    cr_assert_eq(kvt_radix_hash_pages(tree, ns, b, pages, hb), 0);
    cr_expect_eq(kvt_radix_block_hash(tree, r.node, 260), hb[260]);
    cr_expect_eq(kvt_radix_block_at(r.node, 261)->hash, 0);
    cr_expect_eq(kvt_radix_block_hash(tree, r.node, 199), h[199]);
    cr_assert_eq(kvt_radix_verify(tree), 0);
    free(hb);
    free(b);
    free(h);
    free(s);
}

Test(radix_ops, destroy_frees_every_block)
{
    uint32_t *a = seq(7 * PS, 1), *b = seq(7 * PS, 1);
    b[2 * PS] = 5;
    insert(a, 7 * PS);
    insert(b, 7 * PS);
    kvt_radix_t *t = tree;
    cr_assert_eq(kvt_radix_verify(t), 0);
    kvt_radix_destroy(t);
    cr_expect_eq(freed_blocks, 12);
    setup(); /* for the teardown */
    free(a);
    free(b);
}

/* Every free callback names the call that freed the block or node (kvt_radix_why_t), so that a
 * caller tells a REMOVE from an eviction without state of its own set around the call. */
Test(radix_ops, every_free_names_the_call_that_caused_it)
{
    kvt_radix_destroy(tree);
    kvt_radix_conf_t conf = {.free_cb = count_free, .node_free_cb = count_node_free};
    cr_assert_eq(kvt_radix_create(&tree, &conf), 0);
    cr_assert_eq(kvt_radix_ns_open(tree, "llama", NULL, NULL, PS, &ns), 0);
    uint32_t *a = seq(6 * PS, 1), *b = seq(6 * PS, 1), *c = seq(4 * PS, 900);
    b[2 * PS] = 5; /* a and b share 2 pages, then fork: a node of 2 with two leaves of 4 */
    insert(a, 6 * PS);
    insert(b, 6 * PS);
    insert(c, 4 * PS);
    /* An eviction of a leaf's last page. */
    kvt_match_t m;
    cr_assert_eq(kvt_radix_match(tree, ns, a, 6 * PS, KVT_MATCH_NOTOUCH, &m), 0);
    cr_assert_eq(kvt_radix_evict(tree, m.node, 1), 0);
    cr_expect_eq(freed_by[KVT_RADIX_EVICT], 1);
    cr_expect_eq(freed_by[KVT_RADIX_REMOVE] + freed_by[KVT_RADIX_DESTROY], 0);
    /* A removal of b from its fourth page: its 3 last pages and its node. */
    cr_assert_eq(kvt_radix_remove(tree, ns, b, 3 * PS), 0);
    cr_expect_eq(freed_by[KVT_RADIX_REMOVE], 4);
    cr_expect_eq(nodes_freed_by[KVT_RADIX_REMOVE], 1);
    cr_expect_eq(freed_by[KVT_RADIX_EVICT], 1);
    /* Dropping a namespace is evictions. */
    uint32_t ns2;
    cr_assert_eq(kvt_radix_ns_open(tree, "other", NULL, NULL, PS, &ns2), 0);
    kvt_insert_t r;
    cr_assert_eq(kvt_radix_insert(tree, ns2, c, 4 * PS, &r), 0);
    cr_assert_eq(kvt_radix_ns_clear(tree, ns2), 0);
    cr_expect_eq(freed_by[KVT_RADIX_EVICT], 1 + 4);
    cr_expect_eq(nodes_freed_by[KVT_RADIX_EVICT], 1);
    /* The rest goes with the tree: a's 2 + 3 pages, c's 4. */
    kvt_radix_destroy(tree);
    cr_expect_eq(freed_by[KVT_RADIX_DESTROY], 2 + 3 + 4);
    cr_expect_eq(nodes_freed_by[KVT_RADIX_DESTROY], 3);
    cr_expect_eq(freed_by[KVT_RADIX_REMOVE], 4, "no other cause changed");
    cr_expect_eq(freed_by[KVT_RADIX_EVICT], 5);
    setup(); /* for the teardown */
    free(a);
    free(b);
    free(c);
}

/* The tree's own byte count against the allocators': glibc's in-use bytes (plus its per-chunk
 * header, 8 bytes on 64-bit) and the node arena's slots in use grow by what the tree says. */
Test(radix_ops, byte_count_matches_the_allocator)
{
#if defined(__SANITIZE_ADDRESS__)
    cr_skip_test("AddressSanitizer replaces malloc: mallinfo2 does not see its heap");
#endif
    kvt_radix_stats_t st0, st1;
    /* 150 one-page prompts first: the node registry then has room for the chain below, so that
     * no realloc meets a chunk glibc's tcache holds (counted in use before it is reused). */
    for (uint32_t i = 0; i < 150; i++) {
        uint32_t *d = seq(PS, 100000 + i * PS);
        kvt_insert_t r;
        cr_assert_eq(kvt_radix_insert(tree, ns, d, PS, &r), 0);
        free(d);
    }
    kvt_radix_stats(tree, &st0);
    uint32_t *a = seq(64 * PS, 1);
    struct mallinfo2 m0 = mallinfo2();
    size_t chunks = 0;
    for (uint32_t i = 1; i <= 64; i++) {
        a[(i - 1) * PS] = 1000 + i; /* each extends the last by a page: a chain of nodes */
        kvt_insert_t r;
        cr_assert_eq(kvt_radix_insert(tree, ns, a, (size_t)i * PS, &r), 0);
    }
    struct mallinfo2 m1 = mallinfo2();
    kvt_radix_stats(tree, &st1);
    chunks = st1.nodes * 3 + 4; /* node, storage, children; registry and growth */
    int64_t alloc_delta =
        (int64_t)(m1.uordblks - m0.uordblks) + (int64_t)((st1.arena_bytes - st1.arena_free_bytes) -
                                                         (st0.arena_bytes - st0.arena_free_bytes));
    int64_t tree_delta = (int64_t)(st1.bytes - st0.bytes);
    cr_expect_geq(alloc_delta, tree_delta, "allocators grew %lld bytes, tree counts %lld",
                  (long long)alloc_delta, (long long)tree_delta);
    cr_expect_leq(alloc_delta, tree_delta + (int64_t)(16 * chunks),
                  "allocator grew %lld bytes, tree counts %lld", (long long)alloc_delta,
                  (long long)tree_delta);
    /* 8 bytes per cached token at page size 16 is the budget; at page size 4 the per-block
     * metadata weighs four times more, so check the layout instead: 40 bytes + tokens. */
    cr_expect_leq(st1.bytes, st1.blocks * (sizeof(kvt_block_t) + PS * 4) + st1.nodes * 256 + 4096);
    free(a);
}

/*
 * Thousands of children under one node: 3,000 prompts that share one page and then differ, and
 * 3,000 that differ from their first page (children of the root). Their child tables grow
 * (rehashing as they do), every prompt is found, a split of a child in the table keeps it
 * findable, and removals in a scattered order and evictions empty the tables again, with the
 * tree's invariants (every child where a lookup of its key goes) checked along the way.
 */
Test(radix_ops, thousands_of_children_under_one_node)
{
    enum { N = 3000, P = 3 };
    static uint32_t tok[2][N][P * PS];
    for (uint32_t i = 0; i < N; i++)
        for (uint32_t j = 0; j < P * PS; j++) {
            tok[0][i][j] = j < PS ? 7 + j : 1000000 + i * 1000 + j;
            tok[1][i][j] = 5000000 + i * 1000 + j;
        }
    for (uint32_t i = 0; i < N; i++)
        for (int w = 0; w < 2; w++) {
            kvt_insert_t r;
            cr_assert_eq(kvt_radix_insert(tree, ns, tok[w][i], P * PS, &r), 0);
            cr_assert_eq(r.new_pages, w == 0 && i == 0 ? P : w == 0 ? P - 1 : P);
        }
    cr_assert_eq(kvt_radix_verify(tree), 0);
    for (uint32_t i = 0; i < N; i++)
        for (int w = 0; w < 2; w++)
            cr_assert_eq(match_pages(tok[w][i], P * PS), P, "prompt %u of %d", i, w);
    /* A split of a child in the table: a prompt sharing two pages with prompt 17. */
    uint32_t fork[P * PS];
    memcpy(fork, tok[1][17], sizeof fork);
    fork[2 * PS] += 1;
    kvt_insert_t r = insert(fork, P * PS);
    cr_assert_eq(r.new_pages, 1);
    cr_assert_eq(match_pages(tok[1][17], P * PS), P);
    cr_assert_eq(match_pages(fork, P * PS), P);
    /* Remove every other prompt, in a scattered order. */
    for (uint32_t k = 0; k < N; k++) {
        uint32_t i = (k * 7919u) % N;
        if (i % 2)
            continue;
        /* From the second page on (the first is everyone's), and the whole prompt. */
        cr_assert_eq(kvt_radix_remove(tree, ns, tok[0][i], 2 * PS), 0);
        cr_assert_eq(kvt_radix_remove(tree, ns, tok[1][i], PS), 0);
    }
    cr_assert_eq(kvt_radix_verify(tree), 0);
    for (uint32_t i = 0; i < N; i++)
        for (int w = 0; w < 2; w++) {
            uint32_t want = i % 2 ? P : w == 0 ? 1 : 0;
            cr_assert_eq(match_pages(tok[w][i], P * PS), want, "prompt %u of %d", i, w);
        }
    /* Evict every leaf until the tree is empty. */
    kvt_radix_node_t *leaf;
    while ((leaf = kvt_radix_evictable_first(tree)) != NULL)
        cr_assert_eq(kvt_radix_evict(tree, leaf, kvt_radix_node_pages(leaf)), 0);
    cr_assert_eq(kvt_radix_verify(tree), 0);
    kvt_radix_stats_t st;
    kvt_radix_stats(tree, &st);
    cr_assert_eq(st.blocks, 0);
    cr_assert_eq(st.nodes, 0);
}

/* Namespaces are never freed: a tree holds at most KVT_RADIX_NS_MAX of them, and the one past
 * that is refused (KVT_ENOSPC) while the ones open stay usable. */
Test(radix_ops, namespaces_are_bounded)
{
    char salt[32];
    uint32_t id = 0;
    for (uint32_t i = 1; i < KVT_RADIX_NS_MAX; i++) { /* the fixture opened one */
        snprintf(salt, sizeof salt, "tenant-%u", i);
        cr_assert_eq(kvt_radix_ns_open(tree, "llama", NULL, salt, PS, &id), 0, "namespace %u", i);
    }
    cr_assert_eq(id, KVT_RADIX_NS_MAX - 1);
    cr_assert_eq(kvt_radix_ns_open(tree, "llama", NULL, "one-more", PS, &id), KVT_ENOSPC);
    cr_assert_eq(kvt_radix_ns_open(tree, "llama", NULL, "tenant-7", PS, &id), 0);
    cr_assert_eq(id, 7);
    uint32_t *s = seq(4 * PS, 1);
    kvt_insert_t r;
    cr_assert_eq(kvt_radix_insert(tree, id, s, 4 * PS, &r), 0);
    cr_assert_eq(r.new_pages, 4);
    free(s);
}

/* A child table of at least step_table_slots slots grows a step at a time (radix.c): its old
 * table stays while inserts, removals and evictions move 1/64 of step_table_slots slots each.
 * Here tables of 256 slots or more do (4 slots a step). While the root's table is moving,
 * matches, splits and removals meet children still in the old table; then a second table (under
 * prompt 1's first page) grows, which ends the root's move first, and its own move meets
 * removals, evictions and blocks in copy; the tree is destroyed with that move under way. The tree
 * is checked after every change. */
static void step_check(kvt_radix_t *t, uint32_t id, const uint32_t *tok, uint32_t n, uint32_t want)
{
    kvt_match_t m;
    cr_assert_eq(kvt_radix_verify(t), 0);
    cr_assert_eq(kvt_radix_match(t, id, tok, n, KVT_MATCH_NOTOUCH, &m), 0);
    cr_assert_eq(m.pages, want);
}

Test(radix_ops, a_big_table_grows_a_step_at_a_time)
{
    kvt_radix_t *t;
    kvt_radix_conf_t conf = {.free_cb = count_free, .step_table_slots = 256};
    cr_assert_eq(kvt_radix_create(&t, &conf), 0);
    uint32_t id;
    cr_assert_eq(kvt_radix_ns_open(t, "m", NULL, NULL, PS, &id), 0);
    enum { N = 129, P = 3 };
    static uint32_t tok[N][P * PS], fork[P * PS], sub[N - 1][2 * PS];
    kvt_insert_t r;
    kvt_match_t m;
    for (uint32_t i = 0; i < N; i++)
        for (uint32_t j = 0; j < P * PS; j++)
            tok[i][j] = 1000 * (i + 1) + j;
    for (uint32_t i = 0; i < N - 1; i++) {
        memcpy(sub[i], tok[1], PS * sizeof(uint32_t));
        for (uint32_t j = PS; j < 2 * PS; j++)
            sub[i][j] = 900000 + 10 * i + j;
    }
    /* 128 children under the root, 128 under prompt 1's first page: both tables full. */
    for (uint32_t i = 0; i < N - 1; i++)
        cr_assert_eq(kvt_radix_insert(t, id, tok[i], P * PS, &r), 0);
    for (uint32_t i = 0; i < N - 2; i++)
        cr_assert_eq(kvt_radix_insert(t, id, sub[i], 2 * PS, &r), 0);
    cr_assert_eq(kvt_radix_verify(t), 0);

    /* The 129th root child: the root's move starts. */
    cr_assert_eq(kvt_radix_insert(t, id, tok[N - 1], P * PS, &r), 0);
    for (uint32_t i = 0; i < N; i++)
        step_check(t, id, tok[i], P * PS, P);
    for (uint32_t i = 8; i < N; i += 8) { /* splits: forks sharing two pages */
        memcpy(fork, tok[i], sizeof fork);
        fork[2 * PS] = 7;
        cr_assert_eq(kvt_radix_insert(t, id, fork, P * PS, &r), 0);
        cr_assert_eq(r.new_pages, 1);
        step_check(t, id, tok[i], P * PS, P);
    }
    for (uint32_t i = 3; i < N; i += 8) { /* removals of whole root children */
        cr_assert_eq(kvt_radix_remove(t, id, tok[i], PS), 0);
        step_check(t, id, tok[i], P * PS, 0);
    }

    /* The 128th child under prompt 1's page: that table grows, the root's move ends first. */
    cr_assert_eq(kvt_radix_insert(t, id, sub[N - 2], 2 * PS, &r), 0);
    for (uint32_t i = 0; i < N - 1; i++)
        step_check(t, id, sub[i], 2 * PS, 2);
    /* A block in copy below: the removal looks at the children in both tables. */
    for (uint32_t i = 0; i < N - 1; i++) {
        cr_assert_eq(kvt_radix_match(t, id, sub[i], 2 * PS, KVT_MATCH_NOTOUCH, &m), 0);
        kvt_radix_node_blocks(m.node)[0].flags |= KVT_BLOCK_BUSY;
        cr_assert_eq(kvt_radix_remove(t, id, tok[1], PS), KVT_EBUSY, "sub %u is busy", i);
        kvt_radix_node_blocks(m.node)[0].flags &= (uint8_t)~KVT_BLOCK_BUSY;
    }
    for (uint32_t i = 5; i < N - 1; i += 8) { /* removals and evictions of its children */
        cr_assert_eq(kvt_radix_remove(t, id, sub[i], 2 * PS), 0);
        step_check(t, id, sub[i], 2 * PS, 1);
        cr_assert_eq(kvt_radix_match(t, id, sub[i + 1], 2 * PS, KVT_MATCH_NOTOUCH, &m), 0);
        cr_assert_eq(kvt_radix_evict(t, m.node, 1), 0);
        step_check(t, id, sub[i + 1], 2 * PS, 1);
    }
    for (uint32_t i = 0; i < N; i++)
        step_check(t, id, tok[i], P * PS, i % 8 == 3 ? 0 : P);
    kvt_radix_destroy(t); /* with the second move under way: ASan sees no leak */
}

/* Past 1 MiB (131,072 nodes) the node registry is a mapping of its own, grown with mremap: the
 * nodes stay reachable by index through the change to a mapping and the growth after it, the
 * byte count follows, and removals and tear-down work over it. */
Test(radix_ops, a_big_registry_grows_as_a_mapping)
{
    enum { N = 140000 };
    uint32_t tok[2 * PS];
    for (uint32_t i = 0; i < N; i++) {
        for (uint32_t j = 0; j < 2 * PS; j++)
            tok[j] = 10 * i + j + 1;
        kvt_insert_t r;
        cr_assert_eq(kvt_radix_insert(tree, ns, tok, 2 * PS, &r), 0);
    }
    cr_assert_eq(kvt_radix_verify(tree), 0);
    kvt_radix_stats_t st;
    kvt_radix_stats(tree, &st);
    cr_assert_eq(st.nodes, N);
    cr_assert_geq(st.bytes, (uint64_t)262144 * sizeof(void *), "the registry counts");
    cr_assert_eq(kvt_radix_node_count(tree), N);
    for (size_t i = 0; i < N; i += 997)
        cr_assert_eq(kvt_radix_node_pages(kvt_radix_node_at(tree, i)), 2);
    for (uint32_t i = 0; i < N; i += 2) {
        for (uint32_t j = 0; j < 2 * PS; j++)
            tok[j] = 10 * i + j + 1;
        cr_assert_eq(kvt_radix_remove(tree, ns, tok, PS), 0);
    }
    cr_assert_eq(kvt_radix_verify(tree), 0);
    cr_assert_eq(kvt_radix_node_count(tree), N / 2);
}

/* kvt_radix_insert_need counts the growth of the one child array an insert can grow, where
 * kvt_radix_insert_bound counts the largest anywhere: under a root with a 512-slot table, an
 * insert deeper down needs a few hundred bytes, not that table's 8 KiB; the insert that grows
 * the root's table needs its growth; and each stays within what it says. */
static uint64_t tree_bytes(void)
{
    kvt_radix_stats_t st;
    kvt_radix_stats(tree, &st);
    return st.bytes;
}

static void insert_within_need(const uint32_t *tok, size_t n, uint64_t *need)
{
    *need = kvt_radix_insert_need(tree, ns, tok, n, NULL);
    uint64_t before = tree_bytes();
    insert(tok, n);
    cr_assert_leq(tree_bytes() - before, *need);
}

Test(radix_ops, an_insert_needs_room_only_for_the_table_it_grows)
{
    uint32_t tok[5 * PS];
    uint64_t need;
    for (uint32_t i = 0; i < 256; i++) { /* 256 children: the 512-slot table is half full */
        for (uint32_t j = 0; j < 3 * PS; j++)
            tok[j] = 1000 * (i + 1) + j;
        insert_within_need(tok, 3 * PS, &need);
    }
    cr_assert_eq(kvt_radix_node_count(tree), 256);
    /* Under prompt 255 (its node has no children yet): a one-slot array. */
    for (uint32_t j = 3 * PS; j < 5 * PS; j++)
        tok[j] = 7 + j;
    uint64_t bound = kvt_radix_insert_bound(tree, ns, 5 * PS);
    insert_within_need(tok, 5 * PS, &need);
    cr_assert_lt(need + 512 * 16, bound, "need %llu, bound %llu", (unsigned long long)need,
                 (unsigned long long)bound);
    /* Already cached: nothing. */
    cr_assert_eq(kvt_radix_insert_need(tree, ns, tok, 5 * PS, NULL), 0);
    /* The 257th child grows the root's table to 1,024 slots: 8 KiB more. */
    for (uint32_t j = 0; j < 3 * PS; j++)
        tok[j] = 999999 + j;
    insert_within_need(tok, 3 * PS, &need);
    cr_assert_geq(need, 512 * 16);
}

/* The node registry (8 bytes a node, for sampling) gives back what a tree that shrank no longer
 * needs: from 300,000 nodes (a registry of 4 MiB) down to 100, the tree holds what one that only
 * ever had those 100 holds, but for a registry of 1 MiB (a mapping of its own, which stays) and
 * a few KiB of table. */
Test(radix_ops, the_node_registry_gives_memory_back)
{
    enum { NODES = 300000, KEEP = 100 };
    uint32_t tok[PS];
    kvt_insert_t r;
    for (uint32_t i = 0; i < NODES; i++) {
        for (uint32_t j = 0; j < PS; j++)
            tok[j] = (i + 1) * PS + j;
        cr_assert_eq(kvt_radix_insert(tree, ns, tok, PS, &r), 0);
    }
    uint64_t full = tree_bytes();
    for (uint32_t i = NODES; i-- > KEEP;) {
        for (uint32_t j = 0; j < PS; j++)
            tok[j] = (i + 1) * PS + j;
        cr_assert_eq(kvt_radix_remove(tree, ns, tok, PS), 0, "node %u", i);
    }
    cr_assert_eq(kvt_radix_node_count(tree), KEEP);
    cr_assert_eq(kvt_radix_verify(tree), 0, "the byte count follows the registry");
    kvt_radix_t *fresh;
    uint32_t fns;
    cr_assert_eq(kvt_radix_create(&fresh, NULL), 0);
    cr_assert_eq(kvt_radix_ns_open(fresh, "llama", NULL, NULL, PS, &fns), 0);
    for (uint32_t i = 0; i < KEEP; i++) {
        for (uint32_t j = 0; j < PS; j++)
            tok[j] = (i + 1) * PS + j;
        cr_assert_eq(kvt_radix_insert(fresh, fns, tok, PS, &r), 0);
    }
    kvt_radix_stats_t st;
    kvt_radix_stats(fresh, &st);
    kvt_radix_destroy(fresh);
    uint64_t left = tree_bytes();
    cr_assert_leq(left, st.bytes + (1u << 20) + (16u << 10),
                  "%llu bytes left of %llu, %llu in a fresh tree", (unsigned long long)left,
                  (unsigned long long)full, (unsigned long long)st.bytes);
    /* and it grows again */
    for (uint32_t i = KEEP; i < 200000; i++) {
        for (uint32_t j = 0; j < PS; j++)
            tok[j] = (i + 1) * PS + j;
        cr_assert_eq(kvt_radix_insert(tree, ns, tok, PS, &r), 0);
    }
    cr_assert_eq(kvt_radix_verify(tree), 0);
    for (uint32_t i = 0; i < 200000; i += 997) {
        for (uint32_t j = 0; j < PS; j++)
            tok[j] = (i + 1) * PS + j;
        cr_assert_eq(match_pages(tok, PS), 1, "node %u", i);
    }
}

/* What a lease or a new namespace adds to the byte count is never more than its need: 0 while a
 * lease slot is free or the namespace is open by that name, the table's growth otherwise. Through
 * 5,000 leases (the table is made, then doubles seven times) and 3,000 namespaces, one learnt by
 * seed first. */
Test(radix_ops, leases_and_namespaces_add_no_more_than_their_need)
{
    uint32_t *s = seq(4 * PS, 1);
    insert(s, 4 * PS);
    kvt_match_t m;
    cr_assert_eq(kvt_radix_match(tree, ns, s, 4 * PS, KVT_MATCH_NOTOUCH, &m), 0);
    uint32_t grew = 0;
    static uint64_t ids[5000];
    for (uint32_t i = 0; i < 5000; i++) {
        uint64_t need = kvt_radix_lease_need(tree), before = tree_bytes();
        cr_assert_eq(kvt_radix_lease(tree, &m, 1, &ids[i]), 0);
        uint64_t added = tree_bytes() - before;
        cr_assert_leq(added, need, "lease %u added %llu bytes, need %llu", i,
                      (unsigned long long)added, (unsigned long long)need);
        grew += need > 0;
        cr_assert(need > 0 || added == 0, "lease %u", i);
    }
    cr_assert_eq(grew, 8, "made with 64 slots, then 128, ... 8,192");
    cr_assert_eq(kvt_radix_release(tree, ids[17]), 0);
    cr_assert_eq(kvt_radix_lease_need(tree), 0, "a slot given back is taken first");
    /* A reservation with a slot free changes nothing; with none, it grows the table by its need
     * now, and the lease after it adds nothing. */
    uint64_t at = tree_bytes();
    cr_assert_eq(kvt_radix_lease_reserve(tree), 0);
    cr_assert_eq(tree_bytes(), at);
    cr_assert_eq(kvt_radix_lease(tree, &m, 1, &ids[17]), 0);
    for (uint32_t i = 5000; kvt_radix_lease_need(tree) == 0; i++) {
        uint64_t more;
        cr_assert_eq(kvt_radix_lease(tree, &m, 1, &more), 0, "lease %u", i);
    }
    uint64_t grow = kvt_radix_lease_need(tree);
    at = tree_bytes();
    cr_assert_eq(kvt_radix_lease_reserve(tree), 0);
    cr_assert_leq(tree_bytes() - at, grow);
    cr_assert_gt(tree_bytes(), at);
    cr_assert_eq(kvt_radix_lease_need(tree), 0, "a slot is free now");
    at = tree_bytes();
    uint64_t last;
    cr_assert_eq(kvt_radix_lease(tree, &m, 1, &last), 0);
    cr_assert_eq(tree_bytes(), at, "the reserved slot");
    cr_assert_eq(kvt_radix_lease_reserve(NULL), KVT_EINVAL);
    cr_assert_eq(kvt_radix_release_owner(tree, 1), 8193);

    char salt[32];
    uint32_t id;
    cr_assert_eq(kvt_radix_ns_need(tree, "llama", NULL, NULL, PS), 0, "the fixture's namespace");
    cr_assert_eq(kvt_radix_ns_need(tree, "llama", NULL, "", PS), 0, "the same description");
    kvt_radix_t *elsewhere; /* namespace 100's seed, as another tree (a block header) has it */
    cr_assert_eq(kvt_radix_create(&elsewhere, NULL), 0);
    cr_assert_eq(kvt_radix_ns_open(elsewhere, "llama", NULL, "tenant-100", PS, &id), 0);
    uint64_t seed = kvt_radix_ns_seed(elsewhere, id);
    kvt_radix_destroy(elsewhere);
    for (uint32_t i = 0; i < 3000; i++) {
        snprintf(salt, sizeof salt, "tenant-%u", i);
        uint64_t need = kvt_radix_ns_need(tree, "llama", NULL, salt, PS), before = tree_bytes();
        cr_assert_gt(need, 0);
        if (i == 100) { /* learnt by seed (as NVMe recovery does), then by name */
            cr_assert_eq(kvt_radix_ns_open_seed(tree, seed, PS, &id), 0);
            cr_assert_leq(tree_bytes() - before, need);
            need = kvt_radix_ns_need(tree, "llama", NULL, salt, PS);
            cr_assert_gt(need, 0, "its name is not kept yet");
            before = tree_bytes();
        }
        cr_assert_eq(kvt_radix_ns_open(tree, "llama", NULL, salt, PS, &id), 0);
        cr_assert_leq(tree_bytes() - before, need, "namespace %u", i);
        cr_assert_eq(kvt_radix_ns_need(tree, "llama", NULL, salt, PS), 0, "now open");
    }
    free(s);
}

/* An empty namespace closes: its id goes back (the last closed is reused first), everything by
 * that id is refused until then, the memory it took is given back, and one holding pages stays. */
Test(radix_ops, an_empty_namespace_closes_and_its_id_is_reused)
{
    uint32_t a, b, c, id;
    cr_assert_eq(kvt_radix_ns_open(tree, "llama", NULL, "a", PS, &a), 0);
    cr_assert_eq(kvt_radix_ns_open(tree, "llama", NULL, "b", PS, &b), 0);
    cr_assert_eq(kvt_radix_ns_open(tree, "llama", NULL, "c", PS, &c), 0);
    uint64_t seed_a = kvt_radix_ns_seed(tree, a);
    uint32_t *s = seq(3 * PS, 5);
    kvt_insert_t r;
    cr_assert_eq(kvt_radix_insert(tree, b, s, 3 * PS, &r), 0);
    cr_assert_eq(kvt_radix_ns_close(tree, b), KVT_EBUSY, "it holds pages");
    cr_assert_eq(kvt_radix_ns_close(tree, a), 0);
    cr_assert_eq(kvt_radix_ns_close(tree, a), KVT_EINVAL, "closed already");
    cr_assert_eq(kvt_radix_ns_page_size(tree, a), 0);
    cr_assert_eq(kvt_radix_ns_seed(tree, a), 0);
    kvt_match_t m;
    cr_assert_eq(kvt_radix_match(tree, a, s, 3 * PS, 0, &m), KVT_EINVAL);
    cr_assert_eq(kvt_radix_insert(tree, a, s, 3 * PS, &r), KVT_EINVAL);
    cr_assert_eq(kvt_radix_verify(tree), 0);
    kvt_radix_stats_t st;
    kvt_radix_stats(tree, &st);
    cr_assert_eq(st.namespaces, 3, "the fixture's, b and c");
    /* b and c still found by their descriptions. */
    cr_assert_eq(kvt_radix_ns_open(tree, "llama", NULL, "b", PS, &id), 0);
    cr_assert_eq(id, b);
    cr_assert_eq(kvt_radix_ns_open(tree, "llama", NULL, "c", PS, &id), 0);
    cr_assert_eq(id, c);
    /* c goes too; the next two opens take c's id, then a's. */
    cr_assert_eq(kvt_radix_ns_close(tree, c), 0);
    cr_assert_eq(kvt_radix_ns_open(tree, "llama", NULL, "d", PS, &id), 0);
    cr_assert_eq(id, c);
    cr_assert_eq(kvt_radix_ns_open(tree, "llama", NULL, "a", PS, &id), 0);
    cr_assert_eq(id, a);
    cr_assert_eq(kvt_radix_ns_seed(tree, id), seed_a, "the same description, the same seed");
    cr_assert_eq(kvt_radix_match(tree, a, s, 3 * PS, 0, &m), 0);
    cr_assert_eq(m.pages, 0, "reopened empty");
    /* Emptied by a removal, b closes; its memory goes back. */
    cr_assert_eq(kvt_radix_remove(tree, b, s, PS), 0);
    cr_assert_eq(kvt_radix_ns_close(tree, b), 0);
    cr_assert_eq(kvt_radix_ns_close(tree, c), 0);
    cr_assert_eq(kvt_radix_ns_close(tree, a), 0);
    cr_assert_eq(kvt_radix_verify(tree), 0);
    uint64_t closed = tree_bytes();
    cr_assert_eq(kvt_radix_ns_open(tree, "llama", NULL, "e", PS, &id), 0);
    cr_assert_eq(kvt_radix_ns_close(tree, id), 0);
    cr_assert_eq(tree_bytes(), closed, "its root and name went back");
    free(s);
}

/* The namespace index under closes: 30,000 random opens and closes over 2,000 descriptions (a
 * namespace holding a page refuses to close until the page is removed), checked against a model
 * of which are open and under which ids, and the tree verified at every step (every open one
 * found by its seed). */
Test(radix_ops, namespaces_open_and_close_at_random)
{
    enum { DESC = 2000, STEPS = 30000 };
    uint32_t ids[DESC];
    uint8_t open[DESC] = {0}, full[DESC] = {0};
    char salt[32];
    uint64_t x = 88172645463325252ull;
    uint32_t *s = seq(PS, 1);
    for (int step = 0; step < STEPS; step++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        uint32_t d = (uint32_t)(x % DESC), id;
        snprintf(salt, sizeof salt, "t%u", d);
        if (open[d] && (x >> 32) % 3 == 0) {
            int rc = kvt_radix_ns_close(tree, ids[d]);
            if (full[d]) {
                cr_assert_eq(rc, KVT_EBUSY);
                cr_assert_eq(kvt_radix_remove(tree, ids[d], s, PS), 0);
                full[d] = 0;
                continue;
            }
            cr_assert_eq(rc, 0, "step %d", step);
            open[d] = 0;
            continue;
        }
        cr_assert_eq(kvt_radix_ns_open(tree, "m", NULL, salt, PS, &id), 0);
        if (open[d])
            cr_assert_eq(id, ids[d], "step %d: an open namespace keeps its id", step);
        for (uint32_t e = 0; e < DESC && !open[d]; e++)
            cr_assert(!open[e] || ids[e] != id, "step %d: id %u given twice", step, id);
        ids[d] = id;
        open[d] = 1;
        if (!full[d] && (x >> 40) % 4 == 0) {
            kvt_insert_t r;
            cr_assert_eq(kvt_radix_insert(tree, id, s, PS, &r), 0);
            full[d] = 1;
        }
        cr_assert_eq(kvt_radix_verify(tree), 0, "step %d", step);
    }
    uint32_t n = 1;
    for (uint32_t d = 0; d < DESC; d++)
        n += open[d];
    kvt_radix_stats_t st;
    kvt_radix_stats(tree, &st);
    cr_assert_eq(st.namespaces, n);
    free(s);
}

/* At the limit, a close makes room for exactly one more. */
Test(radix_ops, a_closed_namespace_makes_room_at_the_limit)
{
    char salt[32];
    uint32_t id = 0, seven = 0;
    for (uint32_t i = 1; i < KVT_RADIX_NS_MAX; i++) { /* the fixture opened one */
        snprintf(salt, sizeof salt, "tenant-%u", i);
        cr_assert_eq(kvt_radix_ns_open(tree, "llama", NULL, salt, PS, &id), 0, "namespace %u", i);
        if (i == 7)
            seven = id;
    }
    cr_assert_eq(kvt_radix_ns_open(tree, "llama", NULL, "one-more", PS, &id), KVT_ENOSPC);
    cr_assert_eq(kvt_radix_ns_close(tree, seven), 0);
    cr_assert_eq(kvt_radix_ns_open(tree, "llama", NULL, "one-more", PS, &id), 0);
    cr_assert_eq(id, seven);
    cr_assert_eq(kvt_radix_ns_open(tree, "llama", NULL, "tenant-7", PS, &id), KVT_ENOSPC);
    cr_assert_eq(kvt_radix_verify(tree), 0);
}

/* A node's child table gives memory back as its children go: 3,000 children under the root (a
 * table of 8,192 slots), removed down to 300 (a table a quarter full), then to 20 (the sorted
 * array again); what is left is found all along, and the table grows again as children come. */
Test(radix_ops, a_child_table_shrinks_as_children_go)
{
    enum { KIDS = 3000 };
    uint32_t tok[2 * PS];
    for (uint32_t i = 0; i < KIDS; i++) {
        for (uint32_t j = 0; j < 2 * PS; j++)
            tok[j] = 100000 * (i + 1) + j;
        insert(tok, 2 * PS);
    }
    uint64_t full = tree_bytes();
    for (uint32_t i = KIDS; i-- > 20;) {
        for (uint32_t j = 0; j < 2 * PS; j++)
            tok[j] = 100000 * (i + 1) + j;
        cr_assert_eq(kvt_radix_remove(tree, ns, tok, PS), 0, "child %u", i);
        if (i % 97 == 0 || i < 40) {
            cr_assert_eq(kvt_radix_verify(tree), 0, "at %u children", i);
            for (uint32_t k = 0; k < i; k += 1 + i / 50) {
                for (uint32_t j = 0; j < 2 * PS; j++)
                    tok[j] = 100000 * (k + 1) + j;
                cr_assert_eq(match_pages(tok, 2 * PS), 2, "child %u at %u children", k, i);
            }
        }
    }
    uint64_t few = tree_bytes();
    cr_assert_eq(kvt_radix_node_count(tree), 20);
    /* As much as a tree that only ever had those 20, but for the node registry (4,096 slots of
     * 8 bytes, which stays): the 8,192-slot table (128 KiB) went. */
    kvt_radix_t *fresh;
    uint32_t fns;
    cr_assert_eq(kvt_radix_create(&fresh, NULL), 0);
    cr_assert_eq(kvt_radix_ns_open(fresh, "llama", NULL, NULL, PS, &fns), 0);
    for (uint32_t i = 0; i < 20; i++) {
        for (uint32_t j = 0; j < 2 * PS; j++)
            tok[j] = 100000 * (i + 1) + j;
        kvt_insert_t r;
        cr_assert_eq(kvt_radix_insert(fresh, fns, tok, 2 * PS, &r), 0);
    }
    kvt_radix_stats_t st;
    kvt_radix_stats(fresh, &st);
    kvt_radix_destroy(fresh);
    cr_assert_lt(few, st.bytes + 4096 * 8 + 4096, "%llu bytes left, %llu in a fresh tree",
                 (unsigned long long)few, (unsigned long long)st.bytes);
    cr_assert_lt(few, full);
    for (uint32_t i = 20; i < KIDS; i++) {
        for (uint32_t j = 0; j < 2 * PS; j++)
            tok[j] = 100000 * (i + 1) + j;
        insert(tok, 2 * PS);
    }
    cr_assert_gt(tree_bytes(), few);
    for (uint32_t j = 0; j < 2 * PS; j++)
        tok[j] = 100000 * KIDS + j;
    cr_assert_eq(match_pages(tok, 2 * PS), 2);
}

/* A big table (here tables of 256 slots or more step) shrinks a step at a time, as it grew: the
 * root's 3,000 children (8,192 slots) removed, evicted or left, down to 40, the tree verified
 * after each change and every child left found, a new child added and one removed during a
 * shrink. At the end the 8,192-slot table (128 KiB) is gone: the tree holds what one that only
 * had those children holds, but for the node registry and a 512-slot table (one that steps
 * shrinks again only when at most 1/64 full). */
Test(radix_ops, a_big_table_shrinks_a_step_at_a_time)
{
    enum { KIDS = 3000, LEFT = 40 };
    kvt_radix_t *t;
    kvt_radix_conf_t conf = {.free_cb = count_free, .step_table_slots = 256};
    cr_assert_eq(kvt_radix_create(&t, &conf), 0);
    uint32_t id;
    cr_assert_eq(kvt_radix_ns_open(t, "m", NULL, NULL, PS, &id), 0);
    static uint32_t tok[KIDS + 2][2 * PS];
    kvt_insert_t r;
    for (uint32_t i = 0; i < KIDS + 2; i++)
        for (uint32_t j = 0; j < 2 * PS; j++)
            tok[i][j] = 100000 * (i + 1) + j;
    for (uint32_t i = 0; i < KIDS; i++)
        cr_assert_eq(kvt_radix_insert(t, id, tok[i], 2 * PS, &r), 0);
    kvt_radix_stats_t st;
    kvt_radix_stats(t, &st);
    uint64_t full = st.bytes;
    for (uint32_t i = KIDS; i-- > LEFT;) {
        if (i % 3 == 0) { /* an eviction of the whole child (its two pages) */
            kvt_match_t m;
            cr_assert_eq(kvt_radix_match(t, id, tok[i], 2 * PS, KVT_MATCH_NOTOUCH, &m), 0);
            cr_assert_eq(kvt_radix_evict(t, m.node, 2), 0, "child %u", i);
        } else {
            cr_assert_eq(kvt_radix_remove(t, id, tok[i], PS), 0, "child %u", i);
        }
        if (i == 60) { /* during the last shrinks: a child comes and one goes */
            cr_assert_eq(kvt_radix_insert(t, id, tok[KIDS], 2 * PS, &r), 0);
            cr_assert_eq(kvt_radix_remove(t, id, tok[KIDS], PS), 0);
        }
        cr_assert_eq(kvt_radix_verify(t), 0, "at %u children", i);
        if (i % 101 == 0 || i < 80)
            for (uint32_t k = 0; k < i; k += 1 + i / 40) {
                kvt_match_t m;
                cr_assert_eq(kvt_radix_match(t, id, tok[k], 2 * PS, KVT_MATCH_NOTOUCH, &m), 0);
                cr_assert_eq(m.pages, 2, "child %u at %u children", k, i);
            }
    }
    /* Inserts and removals of one more child finish the move (4 of the old table's 8,192 slots a
     * step with these tables) and give the old table back. */
    for (int k = 0; k < 2000; k++) {
        cr_assert_eq(kvt_radix_insert(t, id, tok[KIDS + 1], 2 * PS, &r), 0);
        cr_assert_eq(kvt_radix_remove(t, id, tok[KIDS + 1], PS), 0);
    }
    cr_assert_eq(kvt_radix_verify(t), 0);
    kvt_radix_stats(t, &st);
    uint64_t few = st.bytes;
    kvt_radix_t *fresh;
    cr_assert_eq(kvt_radix_create(&fresh, &conf), 0);
    cr_assert_eq(kvt_radix_ns_open(fresh, "m", NULL, NULL, PS, &id), 0);
    for (uint32_t i = 0; i < LEFT; i++)
        cr_assert_eq(kvt_radix_insert(fresh, id, tok[i], 2 * PS, &r), 0);
    kvt_radix_stats(fresh, &st);
    kvt_radix_destroy(fresh);
    cr_assert_lt(few, st.bytes + 4096 * 8 + 512 * 16 + 4096,
                 "%llu bytes left of %llu, %llu in a fresh tree", (unsigned long long)few,
                 (unsigned long long)full, (unsigned long long)st.bytes);
    kvt_radix_destroy(t);
}

/* The ghost table the daemon and the cost policy share: a hash added is seen until a newer one
 * takes its slot; 0 (a hash never computed) is neither added nor seen. */
Test(radix_ops, ghosts_remember_evicted_hashes_by_slot)
{
    kvt_ghosts_t *g;
    cr_assert_eq(kvt_ghosts_create(&g, 0), KVT_EINVAL);
    cr_assert_eq(kvt_ghosts_create(&g, 4), 0);
    cr_expect_not(kvt_ghosts_seen(g, 0x35));
    kvt_ghosts_add(g, 0x35);
    cr_expect(kvt_ghosts_seen(g, 0x35));
    cr_expect_not(kvt_ghosts_seen(g, 0x45), "another hash of the same slot");
    kvt_ghosts_add(g, 0x45);
    cr_expect(kvt_ghosts_seen(g, 0x45));
    cr_expect_not(kvt_ghosts_seen(g, 0x35), "the newer one took the slot");
    kvt_ghosts_add(g, 0);
    cr_expect_not(kvt_ghosts_seen(g, 0));
    kvt_ghosts_destroy(g);
}
