/*
 * test_replay.c: the replay on the first 200 requests of the conversation trace, against counts
 * a simple reference computes here on its own: an unlimited cache of page-prefix hashes (no
 * radix tree, no policy) gives the exact hit and miss tokens, and the cost functions give the
 * exact prefill seconds. Also the replay's invariant checks over a small-tier run, and its usage
 * errors. On generated traces where documents sit behind different prefixes (written here, in
 * the Mooncake format): the oracle's notion of a page, the working set that percentages are
 * shares of, and ids that start at 10,000,000. On an agent trace: the hint events its records
 * carry reach the cost policy (--trace-hints).
 */
#include <criterion/criterion.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "policy.h"
#include "test_rss.h"
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

/* ---- documents behind different prefixes ------------------------------------------------- */

static uint64_t mix(uint64_t *s)
{
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/*
 * Writes a Mooncake trace of nreq requests where 40 documents (2-6 blocks each) are pasted
 * behind 30 conversation prefixes (1-4 blocks each), then one block of question: the same
 * document ids behind different prefixes, as a retrieval workload sends them. Document
 * popularity is heavy-tailed (document d with probability about 1/((d+1)(d+2))). Ids start at
 * base. Returns the path (static storage).
 */
static const char *doc_trace(uint64_t base, uint64_t seed, int nreq)
{
    static char path[4096];
    const char *tmp = getenv("TMPDIR");
    snprintf(path, sizeof(path), "%s/kvt-doc-trace-XXXXXX.jsonl", tmp && *tmp ? tmp : "/tmp");
    int fd = mkstemps(path, 6);
    cr_assert_geq(fd, 0);
    FILE *f = fdopen(fd, "w");
    cr_assert_not_null(f);
    enum { NDOC = 40, NCONV = 30 };
    uint64_t s = seed, next = base;
    uint64_t doc_first[NDOC], conv_first[NCONV];
    int doc_len[NDOC], conv_len[NCONV];
    for (int d = 0; d < NDOC; d++) {
        doc_len[d] = 2 + (int)(mix(&s) % 5);
        doc_first[d] = next;
        next += (uint64_t)doc_len[d];
    }
    for (int c = 0; c < NCONV; c++) {
        conv_len[c] = 1 + (int)(mix(&s) % 4);
        conv_first[c] = next;
        next += (uint64_t)conv_len[c];
    }
    uint64_t ts = 0;
    for (int i = 0; i < nreq; i++) {
        int c = (int)(mix(&s) % NCONV);
        double u = ((double)(mix(&s) >> 11) + 1) * 0x1.0p-53; /* (0, 1] */
        double dd = floor(1.0 / u) - 1;
        int d = dd >= NDOC - 1 ? NDOC - 1 : (int)dd;
        int nb = conv_len[c] + doc_len[d] + 1;
        uint32_t len = (uint32_t)(512 * nb) - (uint32_t)(mix(&s) % 400);
        fprintf(f,
                "{\"timestamp\": %llu, \"input_length\": %u, \"output_length\": 10, "
                "\"hash_ids\": [",
                (unsigned long long)ts, len);
        for (int b = 0; b < conv_len[c]; b++)
            fprintf(f, "%llu, ", (unsigned long long)(conv_first[c] + (uint64_t)b));
        for (int b = 0; b < doc_len[d]; b++)
            fprintf(f, "%llu, ", (unsigned long long)(doc_first[d] + (uint64_t)b));
        fprintf(f, "%llu]}\n", (unsigned long long)next++);
        ts += 10 + mix(&s) % 490;
    }
    cr_assert_eq(fclose(f), 0);
    return path;
}

/* Distinct whole pages of the trace counted by their token prefix (the FNV set of the
 * reference above, which knows nothing of hash ids), in tokens: what the tree would hold with
 * every tier unlimited. */
static uint64_t prefix_pages_tokens(const char *path, size_t nreq)
{
    kvt_trace_t *tr;
    cr_assert_eq(kvt_trace_load(&tr, path), 0);
    if (nreq == 0 || nreq > tr->nreqs)
        nreq = tr->nreqs;
    set_t s = {calloc(1u << 22, sizeof(uint64_t)), 1u << 22, 0};
    uint32_t *tok = malloc((tr->max_input_length + 1) * sizeof(uint32_t));
    for (size_t i = 0; i < nreq; i++) {
        kvt_trace_tokens(&tr->reqs[i], tok);
        uint64_t h = 0xcbf29ce484222325ull;
        for (uint32_t p = 0; p < tr->reqs[i].input_length / PSZ; p++) {
            for (uint32_t j = 0; j < PSZ; j++) {
                h ^= tok[p * PSZ + j];
                h *= 0x100000001b3ull;
            }
            set_add(&s, h ? h : 1);
        }
    }
    uint64_t n = s.len * PSZ;
    free(tok);
    free(s.v);
    kvt_trace_free(tr);
    return n;
}

static double total_of(const char *out, const char *pol)
{
    char *l = line_of(out, pol);
    cr_assert_not_null(l, "no %s line in %s", pol, out);
    double v = num(l, "prefill_seconds_total");
    free(l);
    return v;
}

/*
 * Belady needs the right notion of "the same page": a document's pages behind conversation A
 * are other pages of the tree than the same document behind B. Keyed by hash id, the oracle
 * kept pages whose "next use" was the document's use behind another prefix, and lost to LFU on
 * every seed; keyed by prefix it is at least as good as LRU and LFU, on one tier and on three.
 */
Test(replay_prefix, oracle_beats_lru_and_lfu_on_documents_behind_prefixes)
{
    for (uint64_t seed = 0; seed < 2; seed++) {
        const char *path = doc_trace(0, seed, 1500);
        static char *const caps[][6] = {
            {"--hbm", "2G", "--dram", "8G", "--nvme", "16G"},
            {"--hbm", "16G", "--dram", "0", "--nvme", "0"},
            {"--hbm", "1", "--dram", "4", "--nvme", "15"},
        };
        for (size_t c = 0; c < sizeof(caps) / sizeof(caps[0]); c++) {
            char *argv[] = {"kvtier-replay", "--no-progress", "--verify", caps[c][0],
                            caps[c][1],      caps[c][2],      caps[c][3], caps[c][4],
                            caps[c][5],      (char *)path,    NULL};
            int rc;
            char *out = run_replay(10, argv, &rc);
            cr_assert_eq(rc, 0, "%s", out);
            double oracle = total_of(out, "oracle"), lru = total_of(out, "lru"),
                   lfu = total_of(out, "lfu");
            cr_assert_leq(oracle, lru, "seed %llu %s %s: oracle %.3f s, LRU %.3f s",
                          (unsigned long long)seed, caps[c][0], caps[c][1], oracle, lru);
            cr_assert_leq(oracle, lfu, "seed %llu %s %s: oracle %.3f s, LFU %.3f s",
                          (unsigned long long)seed, caps[c][0], caps[c][1], oracle, lfu);
            free(out);
        }
        unlink(path);
    }
}

/* "--hbm 10" is 10 % of the pages the radix tree holds, counted by prefix: on the document
 * trace that is about twice what counting hash ids gives (each document is held once per
 * prefix it appears behind), and on the conversation trace partial pages, which the tree never
 * holds, no longer count. With --requests N they are shares of what those N requests touch,
 * not of the whole trace (docs/policy.md, "The replay"): the conversation case replays 200. */
Test(replay_prefix, percentages_are_shares_of_the_pages_the_tree_holds)
{
    find_trace();
    const char *doc = doc_trace(0, 7, 1500);
    char docpath[4096];
    snprintf(docpath, sizeof(docpath), "%s", doc);
    struct {
        const char *path, *reqs;
    } cases[] = {{docpath, "1500"}, {trace_path, "200"}};
    for (size_t k = 0; k < 2; k++) {
        uint64_t unique = prefix_pages_tokens(cases[k].path, (size_t)atoi(cases[k].reqs));
        char *argv[] = {"kvtier-replay",
                        "--no-progress",
                        "--policy",
                        "lru",
                        "--requests",
                        (char *)cases[k].reqs,
                        "--hbm",
                        "10",
                        "--dram",
                        "100",
                        "--nvme",
                        "0",
                        "--remote",
                        "0",
                        (char *)cases[k].path,
                        NULL};
        int rc;
        char *out = run_replay(15, argv, &rc);
        cr_assert_eq(rc, 0, "%s", out);
        char *l = line_of(out, "lru");
        cr_assert_not_null(l);
        cr_assert_eq((uint64_t)num(l, "working_set_tokens"), unique, "%s", l);
        unsigned long long toks[4];
        per_tier(l, "capacity_tokens", toks);
        uint64_t want[2] = {(uint64_t)(10 / 100.0 * (double)unique), unique};
        for (int t = 0; t < 2; t++) {
            want[t] -= want[t] % PSZ;
            cr_assert_eq(toks[t], want[t], "%s tier %d: %llu tokens, %llu by prefix", cases[k].path,
                         t, toks[t], (unsigned long long)want[t]);
        }
        /* DRAM holds the whole working set: nothing is dropped */
        cr_assert_eq(num(l, "dropped_bytes"), 0, "%s", l);
        free(l);
        free(out);
    }
    unlink(docpath);
}

/* A trace whose ids start at 10,000,000 replays like the same trace with ids from 0: the same
 * figures, in about the same time and memory (the future table was sized by the largest id:
 * 1.3 GB and seconds before the first request). */
Test(replay_prefix, sparse_ids_cost_what_dense_ones_do)
{
    char dense[4096], sparse[4096];
    snprintf(dense, sizeof(dense), "%s", doc_trace(0, 3, 1500));
    snprintf(sparse, sizeof(sparse), "%s", doc_trace(10000000, 3, 1500));
    char *outs[2];
    long grew[2];
    double secs[2];
    for (int k = 0; k < 2; k++) {
        char *argv[] = {"kvtier-replay",
                        "--no-progress",
                        "--policy",
                        "lru,oracle",
                        "--hbm",
                        "2G",
                        "--dram",
                        "8G",
                        "--nvme",
                        "0",
                        k ? sparse : dense,
                        NULL};
        long before = peak_kib(1);
        uint64_t t0 = kvt_now_ns();
        int rc;
        outs[k] = run_replay(11, argv, &rc);
        secs[k] = (double)(kvt_now_ns() - t0) / 1e9;
        grew[k] = peak_kib(0) - before;
        cr_assert_eq(rc, 0, "%s", outs[k]);
    }
    cr_log_info("dense ids: %.2f s, +%ld KiB; sparse ids: %.2f s, +%ld KiB", secs[0], grew[0],
                secs[1], grew[1]);
    for (int p = 0; p < 2; p++) {
        const char *pol = p ? "oracle" : "lru";
        cr_assert_eq(total_of(outs[0], pol), total_of(outs[1], pol), "%s", pol);
    }
    cr_assert_lt(grew[1], grew[0] + 64 * 1024, "sparse ids: +%ld KiB, dense +%ld KiB", grew[1],
                 grew[0]);
    cr_assert_lt(secs[1], 3 * secs[0] + 0.5, "sparse ids: %.2f s, dense %.2f s", secs[1], secs[0]);
    free(outs[0]);
    free(outs[1]);
    unlink(dense);
    unlink(sparse);
}

/* ---- hint events in the trace ------------------------------------------------------------ */

/*
 * Writes an agent trace (static path): 40 sessions of 8 blocks start a second apart, each
 * pauses for a 60-second tool call and comes back with one block more, while one-shot requests
 * of 4 fresh blocks arrive every 200 ms. With hints, a session's first request says
 * hint_pause_ms (the tool's expected duration, as an engine knows it) and its second
 * hint_finished; bad_hint writes a pause of 0 into one record instead.
 */
static const char *agent_trace(int hints, int bad_hint)
{
    static char path[4096];
    const char *tmp = getenv("TMPDIR");
    snprintf(path, sizeof(path), "%s/kvt-agent-trace-XXXXXX.jsonl", tmp && *tmp ? tmp : "/tmp");
    int fd = mkstemps(path, 6);
    cr_assert_geq(fd, 0);
    FILE *f = fdopen(fd, "w");
    cr_assert_not_null(f);
    enum { NSESS = 40, NONESHOT = 500 };
    uint64_t next = 0, sess_first[NSESS];
    for (int s = 0; s < NSESS; s++) {
        sess_first[s] = next;
        next += 9;
    }
    /* Merged in time order: session s at s*1000 and s*1000 + 60000, one-shots every 200 ms. */
    int s0 = 0, s1 = 0, k = 0;
    while (s0 < NSESS || s1 < NSESS || k < NONESHOT) {
        uint64_t t0 = s0 < NSESS ? (uint64_t)s0 * 1000 : UINT64_MAX;
        uint64_t t1 = s1 < NSESS ? (uint64_t)s1 * 1000 + 60000 : UINT64_MAX;
        uint64_t tk = k < NONESHOT ? (uint64_t)k * 200 : UINT64_MAX;
        if (t0 <= t1 && t0 <= tk) {
            fprintf(f, "{\"timestamp\": %llu, \"input_length\": 4096, \"hash_ids\": [",
                    (unsigned long long)t0);
            for (int b = 0; b < 8; b++)
                fprintf(f, "%s%llu", b ? ", " : "", (unsigned long long)(sess_first[s0] + b));
            fprintf(f, "]%s}\n",
                    bad_hint && s0 == 7 ? ", \"hint_pause_ms\": 0"
                    : hints             ? ", \"hint_pause_ms\": 60000"
                                        : "");
            s0++;
        } else if (t1 <= tk) {
            fprintf(f, "{\"timestamp\": %llu, \"input_length\": 4608, \"hash_ids\": [",
                    (unsigned long long)t1);
            for (int b = 0; b < 9; b++)
                fprintf(f, "%s%llu", b ? ", " : "", (unsigned long long)(sess_first[s1] + b));
            fprintf(f, "]%s}\n", hints ? ", \"hint_finished\": true" : "");
            s1++;
        } else {
            fprintf(f,
                    "{\"timestamp\": %llu, \"input_length\": 2048, \"hash_ids\": [%llu, %llu, "
                    "%llu, %llu]}\n",
                    (unsigned long long)tk, (unsigned long long)next, (unsigned long long)next + 1,
                    (unsigned long long)next + 2, (unsigned long long)next + 3);
            next += 4;
            k++;
        }
    }
    cr_assert_eq(fclose(f), 0);
    return path;
}

/* The line carrying pat in out (a copy to free), or NULL. */
static char *line_with(const char *out, const char *pat)
{
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

static double trace_hint_total(const char *out)
{
    char *l = line_with(out, "\"hint_source\":\"trace\"");
    cr_assert_not_null(l, "no trace-hint line in %s", out);
    cr_assert_not_null(strstr(l, "\"policy\":\"cost\""), "%s", l);
    double v = num(l, "prefill_seconds_total");
    free(l);
    return v;
}

/* --trace-hints runs the cost policy with the hint events the records carry: paused agents
 * keep their pages under a stream of one-shot requests and come back to hits (less prefill
 * than the same policy without them); a trace without hint fields gives exactly the run
 * without hints; a malformed hint refuses the trace and prints nothing. */
Test(replay_hints, trace_hint_events_reach_the_policy)
{
    char hinted[4096], plain[4096];
    snprintf(hinted, sizeof hinted, "%s", agent_trace(1, 0));
    snprintf(plain, sizeof plain, "%s", agent_trace(0, 0));
    const char *paths[] = {hinted, plain};
    double cost[2], with[2];
    for (int k = 0; k < 2; k++) {
        char *argv[] = {"kvtier-replay",  "--no-progress",
                        "--verify",       "--trace-hints",
                        "--policy",       "cost,lru",
                        "--hbm",          "1",
                        "--dram",         "4",
                        "--nvme",         "15",
                        (char *)paths[k], NULL};
        int rc;
        char *out = run_replay(13, argv, &rc);
        cr_assert_eq(rc, 0, "%s", out);
        cost[k] = total_of(out, "cost");
        with[k] = trace_hint_total(out);
        free(out);
    }
    cr_log_info("hinted trace: cost %.3f s, with its hints %.3f s; plain: %.3f s, %.3f s", cost[0],
                with[0], cost[1], with[1]);
    cr_assert_eq(cost[0], cost[1], "the hint fields changed the run without hints");
    cr_assert_lt(with[0], 0.97 * cost[0], "hints: %.3f s, without %.3f s", with[0], cost[0]);
    cr_assert_eq(with[1], cost[1], "no hint events, yet the hint run differs");

    const char *bad = agent_trace(1, 1);
    char *argv[] = {"kvtier-replay", "--no-progress", "--trace-hints", (char *)bad, NULL};
    int rc;
    char *out = run_replay(4, argv, &rc);
    cr_assert_eq(rc, 1);
    cr_assert_eq(out[0], '\0', "%s", out);
    free(out);
    unlink(bad);
    unlink(hinted);
    unlink(plain);
}

/*
 * The reference lru-dead-first (docs/policy.md, section 4, "What each part of the gap is"): LRU's
 * order with the pages no later request uses first. On the agent trace without hints, 40
 * sessions pause for 60 s while 300 one-shot requests of 2,048 tokens each arrive per session's
 * pause: LRU, which sees only recency, has pushed every paused session out of a cache of a fifth
 * of the working set when it comes back (the one-shots are more recent). The one-shots' pages and
 * the sessions' pages after their second request are dead, and going first they leave the
 * paused sessions in place: all 40 returns hit their whole first request (8 blocks of 512
 * tokens), and nothing else can hit. On the document traces and on the agent trace at other
 * sizes, it is never worse than LRU.
 */
Test(replay_reference, lru_dead_first_drops_dead_pages_first_and_never_loses_to_lru)
{
    char agent[4096];
    snprintf(agent, sizeof agent, "%s", agent_trace(0, 0));
    char *argv[] = {"kvtier-replay",
                    "--no-progress",
                    "--verify",
                    "--policy",
                    "lru,lru-dead-first",
                    "--hbm",
                    "20",
                    "--dram",
                    "0",
                    "--nvme",
                    "0",
                    agent,
                    NULL};
    int rc;
    char *out = run_replay(12, argv, &rc);
    cr_assert_eq(rc, 0, "%s", out);
    char *ref = line_of(out, "lru-dead-first"), *lru = line_of(out, "lru");
    cr_assert_not_null(ref, "%s", out);
    cr_assert_not_null(strstr(ref, "\"reference\":true"), "%s", ref);
    unsigned long long h[4], hl[4];
    hits(ref, h);
    hits(lru, hl);
    cr_log_info("agent, HBM 20%%: LRU %llu hit tokens, lru-dead-first %llu", hl[0], h[0]);
    cr_assert_eq(h[0], 40ull * 4096, "dead-first hits %llu tokens: %s", h[0], ref);
    cr_assert_lt(hl[0], h[0] / 2, "LRU hits %llu tokens", hl[0]);
    cr_assert_lt(num(ref, "prefill_seconds_total"), num(lru, "prefill_seconds_total"));
    free(ref);
    free(lru);
    free(out);

    static char *const caps[][6] = {
        {"--hbm", "2G", "--dram", "8G", "--nvme", "16G"},
        {"--hbm", "0.5", "--dram", "2", "--nvme", "7.5"},
        {"--hbm", "1", "--dram", "4", "--nvme", "15"},
    };
    for (int t = 0; t < 3; t++) {
        char path[4096];
        snprintf(path, sizeof path, "%s", t < 2 ? doc_trace(0, (uint64_t)t, 1500) : agent);
        for (size_t c = 0; c < sizeof(caps) / sizeof(caps[0]); c++) {
            char *av[] = {"kvtier-replay", "--no-progress", "--policy", "lru,lru-dead-first",
                          caps[c][0],      caps[c][1],      caps[c][2], caps[c][3],
                          caps[c][4],      caps[c][5],      path,       NULL};
            out = run_replay(11, av, &rc);
            cr_assert_eq(rc, 0, "%s", out);
            double l = total_of(out, "lru"), d = total_of(out, "lru-dead-first");
            cr_log_info("trace %d %s %s: LRU %.3f s, lru-dead-first %.3f s", t, caps[c][0],
                        caps[c][1], l, d);
            cr_assert_leq(d, l, "trace %d %s %s: lru-dead-first %.3f s, LRU %.3f s", t, caps[c][0],
                          caps[c][1], d, l);
            free(out);
        }
        if (t < 2)
            unlink(path);
    }
    unlink(agent);
}
