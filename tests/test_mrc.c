/*
 * test_mrc.c: the miss-ratio curves of issue 41.
 *
 * The estimator (server/mrc.c) against an exact LRU cache simulated here on its own, on a
 * synthetic stream of prefix lookups (Zipf-popular documents, each looked up to a random depth).
 * At rate 1 the estimate may differ from the exact hit ratio only by the histogram's
 * interpolation; at the default rate (0.1) by the sampling error that docs/server.md states.
 * Also: the fixed-size bound (the tracked pages never pass max_keys, the rate falls), the
 * argument checks, and the tier segments (a range (lo, hi] is the difference of two caches).
 *
 * The daemon's curve: the first requests of the conversation trace into a real kvtierd (MATCH,
 * then PUT of the pages not matched, as an engine does), its kvtier_mrc_hit_ratio per tier and
 * scale against `kvtier replay --policy lru` of the same requests with that tier at scale x the
 * daemon's size in blocks, the others as they are: within 0.05 of its hit ratio at each size.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mrc.h"
#include "policy.h"
#include "replay.h"
#include "test_server_harness.h"
#include "trace.h"

#define DOCS  4000
#define DEPTH 64 /* pages per document */
#define PAGE  16 /* tokens per page */
#define BYTES 4096
#define NCAPS 7

/* ---- the reference: an LRU cache of whole pages, one linked list ------------------------- */

typedef struct lru {
    uint32_t *prev, *next; /* over page ids + 1 (0: the list head) */
    uint8_t *in;
    uint64_t cap, n; /* in pages */
} lru_t;

static void lru_init(lru_t *l, uint64_t cap)
{
    size_t n = (size_t)DOCS * DEPTH + 1;
    l->prev = calloc(n, sizeof *l->prev);
    l->next = calloc(n, sizeof *l->next);
    l->in = calloc(n, 1);
    cr_assert(l->prev && l->next && l->in);
    l->cap = cap;
    l->n = 0;
}

static void lru_unlink(lru_t *l, uint32_t x)
{
    l->next[l->prev[x]] = l->next[x];
    l->prev[l->next[x]] = l->prev[x];
}

/* Looks page id up (a hit when cached) and puts it on top. */
static int lru_access(lru_t *l, uint32_t id)
{
    uint32_t x = id + 1;
    int hit = l->in[x];
    if (hit) {
        lru_unlink(l, x);
    } else {
        l->in[x] = 1;
        if (++l->n > l->cap) {
            uint32_t victim = l->prev[0];
            lru_unlink(l, victim);
            l->in[victim] = 0;
            l->n--;
        }
    }
    l->next[x] = l->next[0];
    l->prev[x] = 0;
    l->prev[l->next[0]] = x;
    l->next[0] = x;
    return hit;
}

static void lru_free(lru_t *l)
{
    free(l->prev);
    free(l->next);
    free(l->in);
}

/* ---- the stream ----------------------------------------------------------------------------- */

static uint64_t rng(uint64_t *s)
{
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* A document by a Zipf(0.9)-like law: the inverse of a power CDF over [1, DOCS]. */
static uint32_t pick_doc(uint64_t *s)
{
    double u = (double)(rng(s) >> 11) * 0x1.0p-53;
    double d = pow(u, 1 / (1 - 0.9) / 4.0) * DOCS; /* skewed towards 0 */
    return d >= DOCS ? DOCS - 1 : (uint32_t)d;
}

static uint64_t key_of(uint32_t id)
{
    uint64_t s = id * 0x2545F4914F6CDD1Dull + 1;
    return rng(&s) | 1;
}

typedef struct run {
    double exact[NCAPS], est[NCAPS];
    uint64_t tokens;
} run_t;

static const uint64_t caps[NCAPS] = {256, 1024, 4096, 8192, 16384, 32768, 65536}; /* pages */

/* Feeds nreq lookups to an estimator of the given rate and to one exact LRU per capacity. */
static void run(double rate, uint32_t max_keys, uint32_t nreq, run_t *out, kvt__mrc_stats_t *st)
{
    kvt__mrc_t *m = NULL;
    kvt__mrc_conf_t conf = {.rate = rate, .max_keys = max_keys};
    cr_assert_eq(kvt__mrc_create(&m, &conf), 0);
    lru_t l[NCAPS];
    uint64_t hits[NCAPS] = {0};
    for (int c = 0; c < NCAPS; c++)
        lru_init(&l[c], caps[c]);
    uint64_t s = 42, tokens = 0;
    uint32_t ids[DEPTH];
    for (uint32_t r = 0; r < nreq; r++) {
        uint32_t doc = pick_doc(&s);
        uint32_t pages = 1 + (uint32_t)(rng(&s) % DEPTH);
        uint32_t ntok = pages * PAGE + (uint32_t)(rng(&s) % PAGE); /* a partial page too */
        uint64_t *keys = kvt__mrc_scratch(m, pages);
        cr_assert_not_null(keys);
        for (uint32_t p = 0; p < pages; p++) {
            ids[p] = doc * DEPTH + p;
            keys[p] = key_of(ids[p]);
        }
        kvt__mrc_lookup(m, keys, pages, PAGE, BYTES, ntok);
        tokens += ntok;
        for (int c = 0; c < NCAPS; c++)
            for (uint32_t p = pages; p-- > 0;) /* deepest first, as the estimator takes them */
                hits[c] += (uint64_t)lru_access(&l[c], ids[p]) * PAGE;
    }
    for (int c = 0; c < NCAPS; c++) {
        out->exact[c] = (double)hits[c] / (double)tokens;
        out->est[c] = kvt__mrc_hit_tokens(m, 0, (double)caps[c] * BYTES) / (double)tokens;
        lru_free(&l[c]);
    }
    out->tokens = tokens;
    kvt__mrc_stats(m, st);
    cr_assert_eq(st->lookup_tokens, tokens);
    kvt__mrc_destroy(m);
}

Test(mrc, exact_at_rate_one)
{
    run_t r;
    kvt__mrc_stats_t st;
    run(1.0, 1u << 20, 20000, &r, &st);
    for (int c = 0; c < NCAPS; c++) {
        cr_log_info("rate 1: %llu pages: exact %.4f estimate %.4f", (unsigned long long)caps[c],
                    r.exact[c], r.est[c]);
        cr_expect(fabs(r.exact[c] - r.est[c]) < 0.005, "%llu pages: exact %.4f, estimate %.4f",
                  (unsigned long long)caps[c], r.exact[c], r.est[c]);
    }
    cr_expect_eq(st.rate, 1.0);
    /* the curve is not flat: the test would pass a constant estimator otherwise */
    cr_expect(r.exact[NCAPS - 1] - r.exact[0] > 0.2, "%.3f .. %.3f", r.exact[0],
              r.exact[NCAPS - 1]);
}

Test(mrc, default_rate_within_its_documented_error)
{
    run_t r;
    kvt__mrc_stats_t st;
    run(0.1, 65536, 40000, &r, &st);
    double worst = 0;
    for (int c = 0; c < NCAPS; c++) {
        double e = fabs(r.exact[c] - r.est[c]);
        worst = e > worst ? e : worst;
        cr_log_info("rate 0.1: %llu pages: exact %.4f estimate %.4f", (unsigned long long)caps[c],
                    r.exact[c], r.est[c]);
    }
    cr_log_info("rate 0.1: worst error %.4f, %llu pages tracked", worst,
                (unsigned long long)st.keys);
    cr_expect(worst < 0.025, "worst absolute error %.4f", worst);
}

Test(mrc, memory_stays_bounded)
{
    run_t r;
    kvt__mrc_stats_t st;
    /* rate 1 into 1,024 keys over ~150,000 distinct pages: the rate must fall */
    run(1.0, 1024, 20000, &r, &st);
    cr_expect_leq(st.keys, 1024);
    cr_expect_lt(st.rate, 0.05);
    cr_expect_gt(st.rate, 0);
    cr_expect_lt(st.bytes, 200000, "%llu bytes", (unsigned long long)st.bytes);
    /* still a curve: the large caches' estimates within a sampling error of the truth */
    for (int c = 3; c < NCAPS; c++)
        cr_expect(fabs(r.exact[c] - r.est[c]) < 0.06, "%llu pages: exact %.4f estimate %.4f",
                  (unsigned long long)caps[c], r.exact[c], r.est[c]);
}

Test(mrc, segments_are_differences)
{
    kvt__mrc_t *m = NULL;
    kvt__mrc_conf_t conf = {.rate = 1, .max_keys = 4096};
    cr_assert_eq(kvt__mrc_create(&m, &conf), 0);
    /* pages a, b, c looked up in turn, then a again: its distance is 3 pages (b, c, a). The
     * bounds are read between whole pages: inside a bucket the histogram interpolates. */
    uint64_t k[3] = {11, 22, 33};
    for (int i = 0; i < 3; i++)
        kvt__mrc_lookup(m, &k[i], 1, PAGE, BYTES, PAGE);
    kvt__mrc_lookup(m, &k[0], 1, PAGE, BYTES, PAGE);
    /* 4 lookups of one page each, 64 tokens: one hit at 3 pages */
    cr_expect_eq(kvt__mrc_hit_tokens(m, 0, 2.5 * BYTES), 0);
    cr_expect(fabs(kvt__mrc_hit_tokens(m, 0, 3.5 * BYTES) - PAGE) < 1e-9);
    cr_expect(fabs(kvt__mrc_hit_tokens(m, 2.5 * BYTES, 3.5 * BYTES) - PAGE) < 1e-9);
    cr_expect_eq(kvt__mrc_hit_tokens(m, 3.5 * BYTES, 100.0 * BYTES), 0);
    /* one lookup of the path [a, b]: b, deeper, is taken first (distance 3: c, a, b), then a
     * (distance 2: b, a), so that a stays the more recent */
    uint64_t path[2] = {11, 22};
    kvt__mrc_lookup(m, path, 2, PAGE, BYTES, 2 * PAGE);
    cr_expect(fabs(kvt__mrc_hit_tokens(m, 0, 2.5 * BYTES) - PAGE) < 1e-9);
    cr_expect(fabs(kvt__mrc_hit_tokens(m, 2.5 * BYTES, 3.5 * BYTES) - 2 * PAGE) < 1e-9);
    /* a lookup whose block size is unknown is no tier's: not counted at all */
    kvt__mrc_lookup(m, path, 2, PAGE, 0, 2 * PAGE);
    cr_expect(fabs(kvt__mrc_hit_tokens(m, 0, 3.5 * BYTES) - 3 * PAGE) < 1e-9);
    kvt__mrc_stats_t st;
    kvt__mrc_stats(m, &st);
    cr_expect_eq(st.keys, 3);
    cr_expect_eq(st.lookup_tokens, 6 * PAGE);
    kvt__mrc_destroy(m);
}

Test(mrc, bad_settings_are_refused)
{
    kvt__mrc_t *m = NULL;
    kvt__mrc_conf_t bad[] = {{0, 1024}, {1.5, 1024}, {-0.1, 1024}, {NAN, 1024}, {0.1, 10}};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++)
        cr_expect_eq(kvt__mrc_create(&m, &bad[i]), KVT_EINVAL, "case %zu", i);
    cr_expect_null(m);
}

/* ---- the daemon against the replay ----------------------------------------------------------- */

#define TNREQ  1000 /* requests of the trace: about 107,000 page lookups, 43,000 pages */
#define TPAGE  256  /* tokens per page */
#define TBLOCK 512  /* bytes per block */

static const char *const scale_names[5] = {"0.25", "0.5", "1", "2", "4"};
static const double scale_of[5] = {0.25, 0.5, 1, 2, 4};

/* Runs the replay in-process (its JSON on stdout, into a file) and returns its output. */
static char *replay_out(char **argv, int argc)
{
    const char *tmp = getenv("TMPDIR");
    char path[4096];
    snprintf(path, sizeof(path), "%s/kvt-mrc-test-XXXXXX", tmp && *tmp ? tmp : "/tmp");
    int fd = mkstemp(path);
    cr_assert_geq(fd, 0);
    fflush(stdout);
    int saved = dup(1);
    dup2(fd, 1);
    int rc = kvt_replay_main(argc, argv);
    fflush(stdout);
    dup2(saved, 1);
    close(saved);
    cr_assert_eq(rc, 0, "replay exit status %d", rc);
    off_t len = lseek(fd, 0, SEEK_END);
    char *out = calloc((size_t)len + 1, 1);
    cr_assert_eq(pread(fd, out, (size_t)len, 0), len);
    close(fd);
    unlink(path);
    return out;
}

static double json_num(const char *line, const char *key)
{
    char pat[128];
    snprintf(pat, sizeof(pat), "\"%s\":", key);
    const char *p = strstr(line, pat);
    cr_assert_not_null(p, "no %s in %s", key, line);
    return strtod(p + strlen(pat), NULL);
}

/* The replay's token hit ratio of the tier (by its name) and of all tiers, with dram and nvme
 * holding those many pages (no HBM, no remote). */
static void replay_ratio(const char *trace, uint64_t dram_pages, uint64_t nvme_pages,
                         const char *tier, double *tier_ratio, double *all_ratio)
{
    kvt_model_profile_t mp;
    cr_assert_eq(kvt_model_profile_get("llama-3-70b", &mp), 0);
    uint64_t per_page = kvt_cost_kv_bytes(&mp, TPAGE); /* the replay sizes pages by the model */
    cr_assert_eq(per_page % 1024, 0);
    char dram[32], nvme[32], reqs[16], page[16];
    snprintf(dram, sizeof dram, "%lluK", (unsigned long long)(dram_pages * per_page / 1024));
    snprintf(nvme, sizeof nvme, "%lluK", (unsigned long long)(nvme_pages * per_page / 1024));
    snprintf(reqs, sizeof reqs, "%d", TNREQ);
    snprintf(page, sizeof page, "%d", TPAGE);
    char *argv[] = {"kvtier-replay",   "--no-progress",
                    "--policy",        "lru",
                    "--model",         "llama-3-70b",
                    "--requests",      reqs,
                    "--page-size",     page,
                    "--hbm",           "0",
                    "--dram",          dram,
                    "--nvme",          nvme,
                    "--nvme-min-hits", "0",
                    (char *)trace};
    char *out = replay_out(argv, (int)(sizeof argv / sizeof *argv));
    double in = json_num(out, "input_tokens");
    const char *h = strstr(out, "\"hit_tokens\":{");
    cr_assert_not_null(h, "%s", out);
    unsigned long long v[4];
    cr_assert_eq(sscanf(h,
                        "\"hit_tokens\":{\"hbm\":%llu,\"dram\":%llu,\"nvme\":%llu,\"remote\":%llu",
                        &v[0], &v[1], &v[2], &v[3]),
                 4, "%s", out);
    *tier_ratio = (double)(strcmp(tier, "dram") ? v[2] : v[1]) / in;
    *all_ratio = (double)(v[0] + v[1] + v[2] + v[3]) / in;
    free(out);
}

Test(mrc_daemon, curve_matches_the_lru_replay, .timeout = 300)
{
    const char *dir = getenv("KVT_TRACE_DIR");
    char trace_path[4096];
    snprintf(trace_path, sizeof trace_path, "%s/mooncake-conversation.jsonl", dir ? dir : "traces");
    if (access(trace_path, R_OK) != 0)
        cr_skip_test("no trace at %s", trace_path);
    kvt_trace_t *tr = NULL;
    cr_assert_eq(kvt_trace_load(&tr, trace_path), 0);
    cr_assert_geq(tr->nreqs, TNREQ);

    kvd_t d = {0};
    kvd_start(&d, "--policy", "lru", "--mrc-sample-rate", "1", "--mrc-max-keys", "65536",
              "--dram-bytes", "2M", "--nvme-bytes", "128M", "--nvme-sparse", "yes", NULL);
    kvt_client_t *c = kvd_client(&d, "llama-3-70b", TPAGE, TBLOCK);
    uint32_t *tokens = malloc(((size_t)tr->max_input_length + 1) * sizeof *tokens);
    uint8_t *payload = malloc(((size_t)tr->max_input_length / TPAGE + 1) * TBLOCK);
    cr_assert(tokens && payload);
    for (size_t i = 0; i < TNREQ; i++) {
        const kvt_trace_req_t *r = &tr->reqs[i];
        kvt_trace_tokens(r, tokens);
        kvt_client_match_t m = {0};
        int rc = kvt_client_match(c, tokens, r->input_length, 0, 0, NULL, &m);
        cr_assert_eq(rc, 0, "MATCH %zu: %s", i, kvt_client_strerror(rc));
        uint32_t whole = r->input_length / TPAGE;
        if (whole <= m.pages)
            continue;
        kvd_fill(payload, (size_t)(whole - m.pages) * TBLOCK, (uint32_t)i);
        kvt_client_put_t p;
        rc =
            kvt_client_put(c, tokens, r->input_length, m.pages, whole - m.pages, payload, NULL, &p);
        cr_assert_eq(rc, 0, "PUT %zu: %s", i, kvt_client_strerror(rc));
    }
    /* Each tier's size in blocks: its capacity over what it charges a block (NVMe adds a
     * header and the page's tokens). */
    uint64_t pages[2];
    const char *tiers[2] = {"dram", "nvme"};
    for (int t = 0; t < 2; t++) {
        char name[64];
        snprintf(name, sizeof name, "%s_blocks", tiers[t]);
        uint64_t blocks = kvd_stat(c, name);
        cr_assert_gt(blocks, 0, "nothing reached %s: the test exercises no such tier", tiers[t]);
        snprintf(name, sizeof name, "%s_used_bytes", tiers[t]);
        uint64_t fp = kvd_stat(c, name) / blocks;
        snprintf(name, sizeof name, "%s_capacity_bytes", tiers[t]);
        pages[t] = kvd_stat(c, name) / fp;
        cr_log_info("%s: %llu blocks of %llu bytes", tiers[t], (unsigned long long)pages[t],
                    (unsigned long long)fp);
    }
    cr_expect_eq(kvd_stat(c, "mrc_sampling_ratio_ppm"), 1000000);
    double worst = 0, all_est = (double)kvd_stat(c, "mrc_hierarchy_hit_ratio_ppm") / 1e6;
    for (int t = 0; t < 2; t++) {
        for (int k = 0; k < 5; k++) {
            char name[96];
            snprintf(name, sizeof name, "mrc_hit_ratio_%s_%s_ppm", tiers[t], scale_names[k]);
            double est = (double)kvd_stat(c, name) / 1e6, want, all;
            uint64_t dp = t == 0 ? (uint64_t)(pages[0] * scale_of[k]) : pages[0];
            uint64_t np = t == 1 ? (uint64_t)(pages[1] * scale_of[k]) : pages[1];
            replay_ratio(trace_path, dp, np, tiers[t], &want, &all);
            cr_log_info("%s x%s: daemon %.4f, replay %.4f", tiers[t], scale_names[k], est, want);
            cr_expect(fabs(est - want) <= 0.05, "%s at %s x its size: daemon %.4f, replay %.4f",
                      tiers[t], scale_names[k], est, want);
            worst = fabs(est - want) > worst ? fabs(est - want) : worst;
            if (k == 2) {
                cr_log_info("all tiers: daemon %.4f, replay %.4f", all_est, all);
                cr_expect(fabs(all_est - all) <= 0.05, "all tiers: daemon %.4f, replay %.4f",
                          all_est, all);
            }
        }
    }
    cr_log_info("worst difference %.4f", worst);
    /* /metrics: the configured tiers' series, none of the others */
    static char body[1 << 20];
    cr_assert_eq(kvd_http_get(&d, "/metrics", body, sizeof body), 200);
    cr_expect_not_null(strstr(body, "kvtier_mrc_hit_ratio{tier=\"dram\",scale=\"2\"} 0."));
    cr_expect_not_null(strstr(body, "kvtier_mrc_prefill_saved_seconds{tier=\"nvme\",scale=\"4\"}"));
    cr_expect_null(strstr(body, "kvtier_mrc_hit_ratio{tier=\"hbm\""));
    cr_expect_null(strstr(body, "kvtier_mrc_hit_ratio{tier=\"remote\""));
    /* kvtier stats: the curve as a table, a row per configured tier, and in --json */
    char want[256], cmd[8192];
    int w = snprintf(want, sizeof want, "\n  dram    ");
    for (int k = 0; k < 5; k++) {
        char name[96];
        snprintf(name, sizeof name, "mrc_hit_ratio_dram_%s_ppm", scale_names[k]);
        w += snprintf(want + w, sizeof want - (size_t)w, " %7.1f%%",
                      (double)kvd_stat(c, name) / 1e4);
    }
    const char *root = kvd_build_root();
    snprintf(cmd, sizeof cmd,
             "'%s/client/kvtier' --unix '%s' stats >'%s/out.txt' 2>&1 && '%s/client/kvtier' "
             "--unix '%s' stats --json >>'%s/out.txt' 2>&1",
             root, d.sock, d.dir, root, d.sock, d.dir);
    cr_assert_eq(system(cmd), 0, "%s", cmd);
    static char text[65536];
    kvd_slurp(&d, "out.txt", text, sizeof text);
    cr_expect_not_null(strstr(text, "if a tier were s x its size (LRU estimate"), "%s", text);
    cr_expect_not_null(strstr(text, want), "no '%s' in %s", want, text);
    cr_expect_not_null(strstr(text, "\n  nvme    "), "%s", text);
    cr_expect_null(strstr(text, "\n  hbm     "), "%s", text);
    cr_expect_not_null(strstr(text, ",\"mrc\":{\"all\":0."), "%s", text);
    cr_expect_not_null(strstr(text, "\"dram\":{\"0.25\":0."), "%s", text);
    kvt_client_close(c);
    free(tokens);
    free(payload);
    kvt_trace_free(tr);
    kvd_cleanup(&d);
}

Test(mrc_daemon, off_shows_no_curve)
{
    kvd_t d = {0};
    kvd_start(&d, "--mrc", "no", NULL);
    static char body[1 << 20];
    cr_assert_eq(kvd_http_get(&d, "/metrics", body, sizeof body), 200);
    cr_expect_null(strstr(body, "kvtier_mrc_hit_ratio{"));
    cr_expect_not_null(strstr(body, "kvtier_mrc_tracked_pages 0"));
    kvd_cleanup(&d);
}

Test(mrc_daemon, bad_settings_are_refused)
{
    static const char *const bad[][2] = {
        {"--mrc-sample-rate", "0"}, {"--mrc-sample-rate", "1.5"},   {"--mrc-sample-rate", "-1"},
        {"--mrc-max-keys", "10"},   {"--mrc-max-keys", "99999999"}, {"--mrc", "maybe"},
    };
    kvd_t d = {0};
    kvd_mkdir(&d);
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        char cmd[2048];
        snprintf(cmd, sizeof cmd,
                 "cd '%s' && '%s' --unix s.sock --tcp '' --metrics '' %s %s >out.txt 2>&1", d.dir,
                 kvd_binary(), bad[i][0], bad[i][1]);
        int st = system(cmd);
        cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 64, "%s %s: status %d", bad[i][0], bad[i][1],
                  st);
        char text[4096];
        kvd_slurp(&d, "out.txt", text, sizeof text);
        cr_expect_not_null(strstr(text, bad[i][0] + 2), "%s", text);
        char sock[1024];
        snprintf(sock, sizeof sock, "%s/s.sock", d.dir);
        cr_expect_neq(access(sock, F_OK), 0, "%s %s: it listened", bad[i][0], bad[i][1]);
    }
    kvd_cleanup(&d);
}
