/*
 * test_replay.c: the replay on the first 200 requests of the conversation trace, against counts
 * a simple reference computes here on its own: an unlimited cache of page-prefix hashes (no
 * radix tree, no policy) gives the exact hit and miss tokens, and the cost functions give the
 * exact prefill seconds. Also the replay's invariant checks over a small-tier run, and its usage
 * errors.
 */
#include <criterion/criterion.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "policy.h"
#include "replay.h"
#include "trace.h"

#define NREQ 200
#define PSZ  16

static char trace_path[4096];

static void find_trace(void)
{
    /* KVT_TRACE_DIR: meson's `traces` option, set for every test. */
    const char *dir = getenv("KVT_TRACE_DIR");
    snprintf(trace_path, sizeof(trace_path), "%s/mooncake-conversation.jsonl",
             dir ? dir : "traces");
    if (access(trace_path, R_OK) != 0)
        cr_skip_test("no trace at %s", trace_path);
}

/* ---- the reference: a set of 64-bit FNV-1a hashes of every cached page prefix -------------- */

typedef struct set {
    uint64_t *v;
    size_t cap, len;
} set_t;

static int set_has(const set_t *s, uint64_t k)
{
    for (size_t i = k & (s->cap - 1); s->v[i]; i = (i + 1) & (s->cap - 1))
        if (s->v[i] == k)
            return 1;
    return 0;
}

static void set_add(set_t *s, uint64_t k)
{
    if (2 * (s->len + 1) >= s->cap) /* one check per page: report failures only */
        cr_assert_fail("reference set full");
    size_t i = k & (s->cap - 1);
    for (; s->v[i]; i = (i + 1) & (s->cap - 1))
        if (s->v[i] == k)
            return;
    s->v[i] = k;
    s->len++;
}

typedef struct ref {
    uint64_t input, hit, unique_blocks;
    double no_cache_s, total_s;
} ref_t;

static void reference(ref_t *r, const kvt_model_profile_t *m, const kvt_hw_profile_t *hw)
{
    kvt_trace_t *tr;
    cr_assert_eq(kvt_trace_load(&tr, trace_path), 0);
    cr_assert_geq(tr->nreqs, NREQ);
    set_t s = {calloc(1u << 22, sizeof(uint64_t)), 1u << 22, 0};
    uint32_t *tok = malloc((tr->max_input_length + 1) * sizeof(uint32_t));
    memset(r, 0, sizeof(*r));
    uint64_t page_bytes = kvt_cost_kv_bytes(m, PSZ);
    for (size_t i = 0; i < NREQ; i++) {
        const kvt_trace_req_t *q = &tr->reqs[i];
        kvt_trace_tokens(q, tok);
        uint32_t n = q->input_length, pages = n / PSZ;
        uint64_t h = 0xcbf29ce484222325ull;
        uint32_t k = 0;
        int matching = 1;
        for (uint32_t p = 0; p < pages; p++) {
            for (uint32_t j = 0; j < PSZ; j++) {
                h ^= tok[p * PSZ + j];
                h *= 0x100000001b3ull;
            }
            uint64_t key = h ? h : 1;
            if (matching && set_has(&s, key))
                k++;
            else
                matching = 0;
            set_add(&s, key);
        }
        uint64_t hit = (uint64_t)k * PSZ;
        r->input += n;
        r->hit += hit;
        r->no_cache_s += kvt_cost_recompute_s(m, hw, 0, n);
        r->total_s += kvt_cost_load_s(hw, KVT_TIER_HBM, (uint64_t)k * page_bytes) +
                      kvt_cost_recompute_s(m, hw, hit, n - hit);
    }
    r->unique_blocks = s.len;
    free(tok);
    free(s.v);
    kvt_trace_free(tr);
}

/* ---- running the replay and reading its JSON --------------------------------------------- */

static char *run_replay(int argc, char **argv, int *rc)
{
    const char *tmp = getenv("TMPDIR");
    char path[4096];
    snprintf(path, sizeof(path), "%s/kvt-replay-test-XXXXXX", tmp && *tmp ? tmp : "/tmp");
    int fd = mkstemp(path);
    cr_assert_geq(fd, 0);
    fflush(stdout);
    int saved = dup(1);
    dup2(fd, 1);
    *rc = kvt_replay_main(argc, argv);
    fflush(stdout);
    dup2(saved, 1);
    close(saved);
    off_t len = lseek(fd, 0, SEEK_END);
    char *out = calloc((size_t)len + 1, 1);
    cr_assert_eq(pread(fd, out, (size_t)len, 0), len);
    close(fd);
    unlink(path);
    return out;
}

/* The line of policy `pol` in out (a copy to free), or NULL. */
static char *line_of(const char *out, const char *pol)
{
    char pat[64];
    snprintf(pat, sizeof(pat), "\"policy\":\"%s\"", pol);
    const char *p = strstr(out, pat);
    if (!p)
        return NULL;
    const char *s = p;
    while (s > out && s[-1] != '\n')
        s--;
    const char *e = strchr(p, '\n');
    size_t n = e ? (size_t)(e - s) : strlen(s);
    char *l = malloc(n + 1);
    memcpy(l, s, n);
    l[n] = '\0';
    return l;
}

static double num(const char *line, const char *key)
{
    char pat[128];
    snprintf(pat, sizeof(pat), "\"%s\":", key);
    const char *p = strstr(line, pat);
    cr_assert_not_null(p, "no %s in %s", key, line);
    return strtod(p + strlen(pat), NULL);
}

/* The four tiers' numbers of the object `key` ({"hbm":..,"dram":..,"nvme":..,"remote":..}). */
static void per_tier(const char *line, const char *key, unsigned long long v[4])
{
    char pat[64];
    snprintf(pat, sizeof(pat), "\"%s\":{", key);
    const char *p = strstr(line, pat);
    cr_assert_not_null(p, "no %s in %s", key, line);
    cr_assert_eq(sscanf(p + strlen(pat), "\"hbm\":%llu,\"dram\":%llu,\"nvme\":%llu,\"remote\":%llu",
                        &v[0], &v[1], &v[2], &v[3]),
                 4, "%s", line);
}

static void hits(const char *line, unsigned long long h[4])
{
    per_tier(line, "hit_tokens", h);
}

static const char *const policies[] = {"cost", "lru", "lfu", "oracle"};

Test(replay_slice, unlimited_cache_matches_the_reference)
{
    find_trace();
    kvt_model_profile_t m;
    kvt_hw_profile_t hw;
    kvt_model_profile_get("llama-3-70b", &m);
    kvt_hw_profile_get("h200-node", &hw);
    ref_t ref;
    reference(&ref, &m, &hw);
    cr_assert_gt(ref.hit, 0);

    char *argv[] = {"kvtier-replay", "--no-progress",
                    "--requests",    "200",
                    "--hbm",         "1000",
                    "--dram",        "0",
                    "--nvme",        "0",
                    trace_path,      NULL};
    int rc;
    char *out = run_replay(11, argv, &rc);
    cr_assert_eq(rc, 0, "%s", out);
    for (int k = 0; k < 4; k++) {
        char *l = line_of(out, policies[k]);
        cr_assert_not_null(l, "no %s line in %s", policies[k], out);
        unsigned long long h[4];
        hits(l, h);
        cr_assert_eq(h[0], ref.hit, "%s: hbm hits %llu, reference %llu", policies[k], h[0],
                     (unsigned long long)ref.hit);
        cr_assert_eq(h[1] + h[2] + h[3], 0);
        cr_assert_eq((unsigned long long)num(l, "input_tokens"), ref.input);
        cr_assert_eq((unsigned long long)num(l, "miss_tokens"), ref.input - ref.hit);
        cr_assert_eq((unsigned long long)num(l, "requests"), NREQ);
        cr_assert_eq(num(l, "nvme_written_bytes"), 0);
        cr_assert_eq(num(l, "dropped_bytes"), 0);
        /* printed with 3 decimals */
        cr_assert_lt(fabs(num(l, "prefill_seconds_no_cache") - ref.no_cache_s), 0.0011);
        cr_assert_lt(fabs(num(l, "prefill_seconds_total") - ref.total_s), 0.0011);
        free(l);
    }
    free(out);
}

Test(replay_slice, two_tiers_lose_nothing_and_count_moves)
{
    find_trace();
    kvt_model_profile_t m;
    kvt_hw_profile_t hw;
    kvt_model_profile_get("llama-3-70b", &m);
    kvt_hw_profile_get("h200-node", &hw);
    ref_t ref;
    reference(&ref, &m, &hw);
    /* a small HBM over an unlimited DRAM: blocks move down and back up, none is dropped */
    char *argv[] = {
        "kvtier-replay", "--no-progress", "--requests", "200",      "--hbm",    "2", "--dram",
        "1000",          "--nvme",        "0",          "--verify", trace_path, NULL};
    int rc;
    char *out = run_replay(12, argv, &rc);
    cr_assert_eq(rc, 0, "%s", out);
    for (int k = 0; k < 4; k++) {
        char *l = line_of(out, policies[k]);
        cr_assert_not_null(l);
        unsigned long long h[4];
        hits(l, h);
        cr_assert_eq(h[0] + h[1], ref.hit, "%s", policies[k]);
        cr_assert_gt(h[1], 0, "%s: some hits come from DRAM", policies[k]);
        cr_assert_gt(num(l, "hbm->dram"), 0);
        cr_assert_eq(num(l, "dropped_bytes"), 0);
        /* DRAM hits cost more than HBM hits: slower than the all-HBM reference */
        cr_assert_geq(num(l, "prefill_seconds_total"), ref.total_s - 0.0011);
        free(l);
    }
    free(out);
}

Test(replay_slice, small_tiers_keep_every_invariant)
{
    find_trace();
    char *argv[] = {"kvtier-replay",
                    "--no-progress",
                    "--requests",
                    "200",
                    "--hbm",
                    "1",
                    "--dram",
                    "2",
                    "--nvme",
                    "4",
                    "--remote",
                    "4",
                    "--hints",
                    "0.5,1",
                    "--verify",
                    trace_path,
                    NULL};
    int rc;
    char *out = run_replay(16, argv, &rc);
    cr_assert_eq(rc, 0, "%s", out);
    char *l = line_of(out, "oracle");
    cr_assert_not_null(l);
    cr_assert_gt(num(l, "dropped_bytes"), 0, "tiers this small must drop");
    double oracle = num(l, "prefill_seconds_total");
    free(l);
    l = line_of(out, "lru");
    cr_assert_geq(num(l, "prefill_seconds_total"), oracle);
    cr_assert_lt(num(l, "prefill_seconds_total"), num(l, "prefill_seconds_no_cache"));
    free(l);
    cr_assert_not_null(strstr(out, "\"hint_accuracy\":1.00"));
    free(out);
}

/* A capacity planner thinks in bytes: a tier flag with a unit is the KV bytes the tier holds,
 * rounded down to whole pages of the model's KV; a bare number stays a percentage. */
Test(replay_slice, capacities_in_bytes)
{
    find_trace();
    char *argv[] = {
        "kvtier-replay", "--no-progress", "--requests", "50", "--policy", "lru", "--hbm",    "1G",
        "--dram",        "64GiB",         "--nvme",     "0",  "--remote", "2",   trace_path, NULL};
    int rc;
    char *out = run_replay(15, argv, &rc);
    cr_assert_eq(rc, 0, "%s", out);
    char *l = line_of(out, "lru");
    cr_assert_not_null(l);
    kvt_model_profile_t m;
    kvt_model_profile_get("llama-3-70b", &m);
    uint64_t per_token = kvt_cost_kv_bytes(&m, 1);
    unsigned long long toks[4], bytes[4];
    per_tier(l, "capacity_tokens", toks);
    per_tier(l, "capacity_bytes", bytes);
    uint64_t want[2] = {(1ull << 30) / per_token, (64ull << 30) / per_token};
    for (int t = 0; t < 2; t++) {
        want[t] -= want[t] % PSZ;
        cr_assert_eq(toks[t], want[t], "tier %d: %llu tokens", t, toks[t]);
        cr_assert_eq(bytes[t], want[t] * per_token);
        cr_assert_leq(bytes[t], t ? 64ull << 30 : 1ull << 30);
    }
    cr_assert_eq(toks[2], 0);
    cr_assert_gt(toks[3], 0, "the remote's 2 is a percentage");
    cr_assert_eq(bytes[3], toks[3] * per_token);
    free(l);
    free(out);
}

Test(replay_usage, bad_arguments_are_refused)
{
    find_trace();
    struct {
        int argc;
        char *argv[8];
        int rc;
    } cases[] = {
        {1, {"r"}, 2},
        {3, {"r", "--policy", "arc"}, 2},
        {4, {"r", "--hbm", "lots", trace_path}, 2},
        {4, {"r", "--dram", "12X", trace_path}, 2},
        {4, {"r", "--dram", "1.5G", trace_path}, 2},
        {4, {"r", "--page-size", "0", trace_path}, 2},
        {4, {"r", "--model", "/nonexistent/model.conf", trace_path}, 2},
        {3, {"r", "--frobnicate", trace_path}, 2},
        {2, {"r", "--requests"}, 2},
        {4, {"r", "--hints", "1.5", trace_path}, 2},
        {3, {"r", "--no-progress", "/nonexistent/trace.jsonl"}, 1},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        int rc;
        char *out = run_replay(cases[i].argc, cases[i].argv, &rc);
        cr_assert_eq(rc, cases[i].rc, "case %zu: rc %d", i, rc);
        cr_assert_eq(out[0], '\0', "case %zu printed results", i);
        free(out);
    }
}
