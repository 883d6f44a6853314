/*
 * bench_policy.c: what renewing the cost policy's victim heaps costs the caller in a large tree,
 * the sweep (a slice of nodes per kvt_policy_step) against the simple version, one walk over
 * every node (sweep_above set past the tree's size), in the same run.
 *
 * The load is the policy's side of a PUT in kvtierd: kvt_radix_insert of a prompt of --pages
 * pages, kvt_policy_on_insert, kvt_policy_step, with DRAM and NVMe full so that every step
 * demotes or drops. The prompts are random (each its own leaf under the root, one in four
 * sharing its first page with an earlier one), so the tree reaches the sizes a busy daemon's
 * index does; the Mooncake traces' trees stay under the 65,536 nodes where sweeps begin
 * (docs/policy.md). --prompts prompts fill the tree, as many more are timed one by one: the mean,
 * the 99.9th percentile and the longest, and how many took over a millisecond (the event loop
 * serves nobody else meanwhile). One JSON object on stdout.
 *
 * usage: bench_policy [--prompts N] [--pages N]
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "policy.h"
#include "bench_stats.h"

#define PAGE_TOKENS 16

typedef struct load {
    kvt_policy_t *pol;
    uint64_t used[KVT_TIER_COUNT];
    uint64_t page_bytes;
} load_t;

static int ex_move(void *arg, const kvt_policy_cause_t *why, kvt_radix_node_t *n, uint32_t depth,
                   uint32_t npages, kvt_tier_id_t from, kvt_tier_id_t to)
{
    load_t *l = arg;
    (void)why;
    (void)n;
    (void)depth;
    l->used[from] -= npages * l->page_bytes;
    l->used[to] += npages * l->page_bytes;
    return 0;
}

static int ex_admit(void *arg, kvt_radix_node_t *n, uint32_t depth, uint32_t npages,
                    kvt_tier_id_t tier)
{
    load_t *l = arg;
    (void)n;
    (void)depth;
    l->used[tier] += npages * l->page_bytes;
    return 0;
}

static void ex_free(void *arg, uint32_t ns, kvt_block_t *b, kvt_radix_why_t why)
{
    (void)why;
    load_t *l = arg;
    if (b->tier != KVT_TIER_NONE)
        l->used[b->tier] -= b->size;
    kvt_policy_on_free(l->pol, ns, b);
}

static void ex_node_free(void *arg, kvt_radix_node_t *n, kvt_radix_why_t why)
{
    (void)why;
    kvt_policy_on_node_free(((load_t *)arg)->pol, n);
}

static const kvt_policy_ops_t ops = {ex_move, ex_admit, NULL};

typedef struct result {
    size_t nodes;
    double mean_us, p999_us, max_ms;
    long over_1ms;
    uint64_t sweeps, rebuilds;
} result_t;

static uint64_t xorshift(uint64_t *x)
{
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    return *x;
}

static int run(long prompts, uint32_t pages, int whole, result_t *res)
{
    load_t l = {0};
    kvt_radix_t *t;
    kvt_radix_conf_t rc = {.free_cb = ex_free, .node_free_cb = ex_node_free, .free_arg = &l};
    if (kvt_radix_create(&t, &rc) != 0)
        return -1;
    uint32_t ns;
    kvt_policy_conf_t c;
    memset(&c, 0, sizeof c);
    c.kind = KVT_POLICY_COST;
    if (kvt_radix_ns_open(t, "bench", NULL, NULL, PAGE_TOKENS, &ns) != 0 ||
        kvt_model_profile_get("llama-3-70b", &c.model) != 0 ||
        kvt_hw_profile_get("h200-node", &c.hw) != 0) {
        kvt_radix_destroy(t);
        return -1;
    }
    l.page_bytes = kvt_cost_kv_bytes(&c.model, PAGE_TOKENS);
    /* Room for a third of the prompts' pages in DRAM and as many again in NVMe. */
    c.tiers[KVT_TIER_DRAM].capacity = (uint64_t)prompts * pages / 3 * l.page_bytes;
    c.tiers[KVT_TIER_NVME].capacity = (uint64_t)prompts * pages / 3 * l.page_bytes;
    c.ops = &ops;
    c.ops_arg = &l;
    c.reports_node_frees = 1;
    c.sweep_above = whole ? SIZE_MAX : 0;
    if (kvt_policy_create(&l.pol, t, &c) != 0) {
        kvt_radix_destroy(t);
        return -1;
    }
    size_t ntok = (size_t)pages * PAGE_TOKENS;
    uint32_t *tok = malloc(ntok * sizeof *tok), *first = malloc(PAGE_TOKENS * sizeof *first);
    double *lat = malloc((size_t)prompts * sizeof *lat);
    uint64_t x = 0x9E3779B97F4A7C15ull, sum = 0;
    int rc_ = tok && first && lat ? 0 : -1;
    *res = (result_t){0};
    for (long i = 0; i < 2 * prompts && rc_ == 0; i++) {
        kvt_radix_set_clock(t, (uint32_t)(i / 16)); /* 16 prompts per clock unit (ms) */
        for (size_t j = 0; j < ntok; j++)
            tok[j] = (uint32_t)(xorshift(&x) % 151936);
        if (i > 0 && xorshift(&x) % 4 == 0)
            memcpy(tok, first, PAGE_TOKENS * sizeof *tok);
        else
            memcpy(first, tok, PAGE_TOKENS * sizeof *tok);
        kvt_insert_t ins;
        uint64_t t0 = kvt_now_ns();
        if (kvt_radix_insert(t, ns, tok, ntok, &ins) != 0 ||
            kvt_policy_on_insert(l.pol, &ins, NULL) < 0 || kvt_policy_step(l.pol, 64) < 0) {
            rc_ = -1;
            break;
        }
        uint64_t dt = kvt_now_ns() - t0;
        if (i >= prompts) {
            lat[i - prompts] = (double)dt;
            sum += dt;
            res->over_1ms += dt > 1000000;
        }
    }
    if (rc_ == 0) {
        kvt_policy_stats_t st;
        kvt_policy_stats(l.pol, &st);
        res->nodes = kvt_radix_node_count(t);
        res->sweeps = st.sweeps;
        res->rebuilds = st.rebuilds;
        res->mean_us = (double)sum / (double)prompts / 1e3;
        qsort(lat, (size_t)prompts, sizeof *lat, bench_cmp_double);
        res->p999_us = lat[(size_t)((double)prompts * 0.999)] / 1e3;
        res->max_ms = lat[prompts - 1] / 1e6;
    }
    free(tok);
    free(first);
    free(lat);
    kvt_radix_destroy(t);
    kvt_policy_destroy(l.pol);
    return rc_;
}

int main(int argc, char **argv)
{
    long prompts = 50000;
    uint32_t pages = 4;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--prompts") && i + 1 < argc)
            prompts = atol(argv[++i]);
        else if (!strcmp(argv[i], "--pages") && i + 1 < argc)
            pages = (uint32_t)atol(argv[++i]);
        else {
            fprintf(stderr, "usage: bench_policy [--prompts N] [--pages N]\n");
            return 2;
        }
    }
    if (prompts < 1000 || prompts > 10000000 || pages < 1 || pages > 64) {
        fprintf(stderr, "bench_policy: 1000..10000000 prompts of 1..64 pages\n");
        return 2;
    }
    result_t s, w;
    if (run(prompts, pages, 0, &s) < 0 || run(prompts, pages, 1, &w) < 0) {
        fprintf(stderr, "bench_policy: the load failed\n");
        return 1;
    }
    printf("{\"bench\":\"policy_sweep\",\"policy\":\"cost\",\"prompts\":%ld,\"pages\":%u,"
           "\"nodes\":%zu,\"mean_us\":%.2f,\"p999_us\":%.1f,\"max_ms\":%.2f,\"over_1ms\":%ld,"
           "\"sweeps\":%llu,\"rebuilds\":%llu,\"baseline\":\"one walk over every node\","
           "\"baseline_mean_us\":%.2f,\"baseline_p999_us\":%.1f,\"baseline_max_ms\":%.2f,"
           "\"baseline_over_1ms\":%ld,\"baseline_rebuilds\":%llu,\"ratio_max\":%.2f,"
           "\"ratio_mean\":%.3f}\n",
           prompts, pages, s.nodes, s.mean_us, s.p999_us, s.max_ms, s.over_1ms,
           (unsigned long long)s.sweeps, (unsigned long long)s.rebuilds, w.mean_us, w.p999_us,
           w.max_ms, w.over_1ms, (unsigned long long)w.rebuilds, w.max_ms / s.max_ms,
           w.mean_us / s.mean_us);
    return 0;
}
