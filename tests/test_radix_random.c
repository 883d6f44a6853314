/*
 * test_radix_random.c: long random sequences of inserts, matches, removes, evictions and leases
 * against a simple reference model, checking every answer and the tree's invariants after
 * every step.
 *
 * The model is a list of inserted sequences, each with how many of its pages are still cached.
 * A prefix of q is cached when some sequence shares it and still caches that many pages, so:
 *   match(q)       = max over sequences i of min(cached_i, lcp(i, q))
 *   insert(q)      appends q, all of its pages cached
 *   remove(p, n)   every i with lcp(i, p) >= n keeps at most n - 1 pages
 *   evict(leaf)    the leaf's path P loses pages from depth d on: every i with lcp(i, P) > d
 *                  keeps at most d pages
 * Tokens come from a tiny alphabet so that sequences share prefixes and split nodes often.
 */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "radix.h"

#define MAXSEQ   400
#define MAXPAGES 24

typedef struct model_seq {
    uint32_t tok[MAXPAGES * 16];
    uint32_t npages;
    uint32_t cached;
} model_seq_t;

typedef struct model {
    model_seq_t seq[MAXSEQ];
    uint32_t n;
    uint32_t ps;
} model_t;

static uint64_t rng_state;

static uint32_t rnd(uint32_t n)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state % n);
}

static uint32_t lcp_pages(const uint32_t *a, uint32_t na, const uint32_t *b, uint32_t nb,
                          uint32_t ps)
{
    uint32_t n = na < nb ? na : nb, i = 0;
    while (i < n && memcmp(a + i * ps, b + i * ps, ps * sizeof(uint32_t)) == 0)
        i++;
    return i;
}

static uint32_t model_match(const model_t *m, const uint32_t *q, uint32_t np)
{
    uint32_t best = 0;
    for (uint32_t i = 0; i < m->n; i++) {
        uint32_t l = lcp_pages(m->seq[i].tok, m->seq[i].npages, q, np, m->ps);
        if (l > m->seq[i].cached)
            l = m->seq[i].cached;
        if (l > best)
            best = l;
    }
    return best;
}

static void model_cut(model_t *m, const uint32_t *p, uint32_t np, uint32_t from)
{
    for (uint32_t i = 0; i < m->n; i++) {
        uint32_t l = lcp_pages(m->seq[i].tok, m->seq[i].npages, p, np, m->ps);
        if (l > from && m->seq[i].cached > from)
            m->seq[i].cached = from;
    }
}

/* Distinct cached page-prefixes: what the tree's block count must be. */
static uint64_t model_blocks(const model_t *m)
{
    uint64_t n = 0;
    for (uint32_t i = 0; i < m->n; i++) {
        for (uint32_t l = 1; l <= m->seq[i].cached; l++) {
            int dup = 0;
            for (uint32_t j = 0; j < i && !dup; j++)
                dup = m->seq[j].cached >= l &&
                      lcp_pages(m->seq[i].tok, l, m->seq[j].tok, l, m->ps) >= l;
            n += !dup;
        }
    }
    return n;
}

/* A new query: a random existing sequence's prefix with a random tail, or fresh. */
static uint32_t make_query(const model_t *m, uint32_t *q, uint32_t alphabet)
{
    uint32_t np = 1 + rnd(MAXPAGES), keep = 0;
    if (m->n > 0 && rnd(4) != 0) {
        const model_seq_t *s = &m->seq[rnd(m->n)];
        keep = rnd(s->npages + 1);
        if (keep > np)
            keep = np;
        memcpy(q, s->tok, keep * m->ps * sizeof(uint32_t));
    }
    for (uint32_t i = keep * m->ps; i < np * m->ps; i++)
        q[i] = rnd(alphabet);
    return np;
}

typedef struct lease_rec {
    uint64_t id;
    uint64_t owner;
} lease_rec_t;

/* step_slots: the tree's step_table_slots (0: its default). */
/* With drain, the second half of the run only removes and evicts: tables shrink. */
static void run_conf(uint64_t seed, uint32_t ps, uint32_t steps, uint32_t alphabet,
                     uint32_t step_slots, int drain)
{
    static model_t m;
    memset(&m, 0, sizeof(m));
    m.ps = ps;
    rng_state = seed;
    kvt_radix_t *t;
    uint32_t ns, ns_other;
    kvt_radix_conf_t conf = {.step_table_slots = step_slots};
    cr_assert_eq(kvt_radix_create(&t, &conf), 0);
    cr_assert_eq(kvt_radix_ns_open(t, "model", NULL, NULL, ps, &ns), 0);
    cr_assert_eq(kvt_radix_ns_open(t, "model", NULL, "other", ps, &ns_other), 0);
    lease_rec_t leases[64];
    uint32_t nleases = 0;
    uint32_t q[MAXPAGES * 16 + 16]; /* room for a ragged tail of up to a page */

    for (uint32_t step = 0; step < steps; step++) {
        uint32_t op = drain && step >= steps / 2 ? 83 + rnd(17) : rnd(100);
        uint32_t np = make_query(&m, q, alphabet);
        /* Sometimes a ragged tail that never gets cached. */
        uint32_t extra = rnd(4) == 0 ? rnd(ps) : 0;
        for (uint32_t i = 0; i < extra; i++)
            q[np * ps + i] = rnd(alphabet);
        size_t ntok = (size_t)np * ps + extra;
        kvt_radix_set_clock(t, step);

        if (op < 45 && m.n < MAXSEQ) { /* match, then insert */
            kvt_match_t mt;
            kvt_insert_t r;
            cr_assert_eq(kvt_radix_match(t, ns, q, ntok, 0, &mt), 0);
            uint32_t want = model_match(&m, q, np);
            cr_assert_eq(mt.pages, want, "step %u: match %u, model %u", step, mt.pages, want);
            kvt_radix_stats_t before, after;
            kvt_radix_stats(t, &before);
            uint64_t bound = kvt_radix_insert_bound(t, ns, ntok);
            kvt_match_t at;
            uint64_t need = kvt_radix_insert_need(t, ns, q, ntok, &at);
            cr_assert_leq(need, bound, "step %u", step);
            cr_assert(at.node == mt.node && at.pages == mt.pages && at.node_pages == mt.node_pages,
                      "step %u: the need's walk stops where the match does", step);
            unsigned how = rnd(3); /* from the match, from the need's walk, or a plain insert */
            int rc = how == 0   ? kvt_radix_insert_matched(t, &mt, q, ntok, &r)
                     : how == 1 ? kvt_radix_insert_matched(t, &at, q, ntok, &r)
                                : kvt_radix_insert(t, ns, q, ntok, &r);
            cr_assert_eq(rc, 0, "step %u: insert: %s", step, kvt_strerror(rc));
            kvt_radix_stats(t, &after);
            cr_assert_leq(after.bytes, before.bytes + need,
                          "step %u: the insert added %lld bytes, over its need of %llu", step,
                          (long long)(after.bytes - before.bytes), (unsigned long long)need);
            cr_assert_eq(r.new_pages, np - want, "step %u: new pages", step);
            model_seq_t *s = &m.seq[m.n++];
            memcpy(s->tok, q, (size_t)np * ps * sizeof(uint32_t));
            s->npages = s->cached = np;
        } else if (op < 65) { /* match only, also in the other namespace */
            kvt_match_t mt;
            cr_assert_eq(kvt_radix_match(t, ns, q, ntok, 0, &mt), 0);
            cr_assert_eq(mt.pages, model_match(&m, q, np), "step %u", step);
            if (mt.pages > 0) { /* a lazy chain hash somewhere on the path, as hash_pages has it */
                uint32_t d = rnd(mt.pages);
                uint64_t want[MAXPAGES];
                cr_assert_eq(kvt_radix_hash_pages(t, ns, q, d + 1, want), 0);
                cr_assert_eq(kvt_radix_block_hash(t, mt.node, d), want[d], "step %u", step);
            }
            cr_assert_eq(kvt_radix_match(t, ns_other, q, ntok, 0, &mt), 0);
            cr_assert_eq(mt.pages, 0);
        } else if (op < 75) { /* lease what matches */
            kvt_match_t mt;
            cr_assert_eq(kvt_radix_match(t, ns, q, ntok, 0, &mt), 0);
            uint64_t id;
            int rc = kvt_radix_lease(t, &mt, 1 + rnd(3), &id);
            if (mt.pages == 0) {
                cr_assert_eq(rc, KVT_ENOENT);
            } else if (nleases < 64) {
                cr_assert_eq(rc, 0);
                if (step % 3 == 0) { /* as a kept copy's switch; verify checks the count */
                    uint64_t mark = kvt_radix_node_mark(t, mt.node);
                    cr_assert(kvt_radix_node_leased_before(t, mt.node, mark), "step %u", step);
                }
                leases[nleases].id = id;
                leases[nleases].owner = 0;
                nleases++;
            } else {
                cr_assert_eq(rc, 0);
                cr_assert_eq(kvt_radix_release(t, id), 0);
            }
        } else if (op < 83) { /* release one, sometimes twice, or all of an owner */
            if (nleases > 0 && rnd(5) != 0) {
                uint32_t i = rnd(nleases);
                cr_assert_eq(kvt_radix_release(t, leases[i].id), 0);
                cr_assert_eq(kvt_radix_release(t, leases[i].id), KVT_ENOENT);
                leases[i] = leases[--nleases];
            } else {
                size_t n = kvt_radix_release_owner(t, 1 + rnd(3));
                /* We do not track owners in the model: count what is left instead. */
                size_t left = kvt_radix_lease_count(t);
                uint32_t kept = 0;
                for (uint32_t i = 0; i < nleases; i++) {
                    if (kvt_radix_release(t, leases[i].id) == KVT_ENOENT)
                        continue; /* released by owner */
                    leases[kept++] = leases[i];
                }
                cr_assert_eq(kept, left, "released %zu by owner", n);
                /* Those still held were just released by id above; take them back. */
                nleases = 0;
                (void)kept;
            }
        } else if (op < 90) { /* remove a prefix of an inserted sequence */
            if (m.n == 0)
                continue;
            const model_seq_t *s = &m.seq[rnd(m.n)];
            uint32_t n = 1 + rnd(s->npages);
            uint32_t cached = model_match(&m, s->tok, n);
            kvt_radix_stats_t before;
            kvt_radix_stats(t, &before);
            int rc = kvt_radix_remove(t, ns, s->tok, (size_t)n * ps);
            if (cached < n) {
                cr_assert_eq(rc, KVT_ENOENT, "step %u", step);
            } else if (rc == KVT_EBUSY) {
                cr_assert_gt(nleases, 0, "step %u: busy with no lease held", step);
                kvt_radix_stats_t after;
                kvt_radix_stats(t, &after);
                cr_assert_eq(before.blocks, after.blocks, "a refused remove changed the tree");
            } else {
                cr_assert_eq(rc, 0, "step %u: remove: %s", step, kvt_strerror(rc));
                uint32_t tmp[MAXPAGES * 16];
                memcpy(tmp, s->tok, (size_t)n * ps * sizeof(uint32_t));
                model_cut(&m, tmp, n, n - 1);
            }
        } else { /* evict a few pages of a random evictable leaf */
            size_t ne = kvt_radix_evictable_count(t);
            if (ne == 0)
                continue;
            kvt_radix_node_t *leaf = kvt_radix_evictable_first(t);
            for (uint32_t i = rnd((uint32_t)ne); i > 0 && leaf; i--)
                leaf = kvt_radix_evictable_next(t, leaf);
            cr_assert_not_null(leaf);
            cr_assert_eq(kvt_radix_node_children(leaf), 0);
            cr_assert(!kvt_radix_node_leased(leaf));
            uint32_t pages = kvt_radix_node_pages(leaf), depth = kvt_radix_node_depth(leaf);
            uint32_t k = 1 + rnd(pages);
            /* The leaf's whole path, read back through the iterator. */
            uint32_t path[MAXPAGES * 16];
            kvt_path_iter_t it;
            kvt_path_iter_init(&it, leaf, pages);
            kvt_radix_node_t *holder;
            uint32_t d = 0;
            while (kvt_path_iter_next(&it, &holder) != NULL) {
                memcpy(path + d * ps,
                       kvt_radix_node_tokens(holder, d - kvt_radix_node_depth(holder)),
                       ps * sizeof(uint32_t));
                d++;
            }
            cr_assert_eq(d, depth + pages);
            cr_assert_eq(kvt_radix_evict(t, leaf, k), 0);
            model_cut(&m, path, d, d - k);
        }

        cr_assert_eq(kvt_radix_verify(t), 0, "step %u: invariants", step);
        if (step % 16 == 0) {
            kvt_radix_stats_t st;
            kvt_radix_stats(t, &st);
            cr_assert_eq(st.blocks, model_blocks(&m), "step %u: block count", step);
            cr_assert_eq(st.cached_tokens, st.blocks * ps);
            /* Every inserted sequence matches what the model says. */
            for (uint32_t i = 0; i < m.n; i++) {
                kvt_match_t mt;
                cr_assert_eq(kvt_radix_match(t, ns, m.seq[i].tok, (size_t)m.seq[i].npages * ps,
                                             KVT_MATCH_NOTOUCH, &mt),
                             0);
                cr_assert_eq(mt.pages, model_match(&m, m.seq[i].tok, m.seq[i].npages),
                             "step %u: sequence %u", step, i);
            }
        }
    }
    for (uint32_t i = 0; i < nleases; i++)
        cr_assert_eq(kvt_radix_release(t, leases[i].id), 0);
    cr_assert_eq(kvt_radix_lease_count(t), 0);
    kvt_radix_destroy(t);
}

static void run(uint64_t seed, uint32_t ps, uint32_t steps, uint32_t alphabet)
{
    run_conf(seed, ps, steps, alphabet, 0, 0);
}

Test(radix_random, page_size_1_small_alphabet)
{
    run(0x9E3779B97F4A7C15ull, 1, 3000, 3);
}

Test(radix_random, page_size_4)
{
    run(12345, 4, 3000, 2);
}

Test(radix_random, page_size_16)
{
    run(777, 16, 2000, 2);
}

Test(radix_random, page_size_3_many_seeds)
{
    for (uint64_t seed = 1; seed <= 8; seed++)
        run(seed * 0x2545F4914F6CDD1Dull, 3, 600, 3);
}

/* A large alphabet: most first pages differ, so the roots (and nodes under shared prefixes) get
 * hundreds of children and keep them in a hash table, grown, probed and shrunk by removals and
 * evictions (backward-shift deletion) at every step of the run. */
Test(radix_random, wide_fan_out)
{
    run(4242, 1, 3000, 1000);
    run(99, 2, 2000, 40);
}

/* The same with every table of 256 slots or more growing a step at a time (4 slots of the old
 * table moved per insert, removal or eviction): lookups, splits and deletions meet children in
 * the old table, and kvt_radix_verify checks both tables at every step. */
Test(radix_random, wide_fan_out_tables_grow_a_step_at_a_time)
{
    run_conf(4242, 1, 3000, 1000, 256, 0);
    run_conf(99, 2, 2000, 40, 256, 0);
    run_conf(7, 1, 3000, 5000, 256, 0);
}

/* Wide fan-out built up, then only removals and evictions: tables shrink, at once and (tables
 * of 256 slots or more) a step at a time, with lookups meeting children in both tables. */
Test(radix_random, wide_fan_out_tables_shrink_as_children_go)
{
    run_conf(4242, 1, 6000, 1000, 0, 1);
    run_conf(7, 1, 6000, 5000, 256, 1);
    run_conf(31, 2, 4000, 3000, 256, 1);
}
