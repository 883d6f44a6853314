/*
 * test_trace.c: the Mooncake trace reader and the canonical hash-id-to-token mapping, checked
 * against an independent transcription of traces/README.md and against the figures
 * that README gives for the real traces.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "radix.h"
#include "trace.h"

static char *trace_path(const char *name)
{
    static char buf[4096];
    /* KVT_TRACE_DIR: meson's `traces` option, set for every test. */
    const char *dir = getenv("KVT_TRACE_DIR");
    snprintf(buf, sizeof(buf), "%s/%s", dir ? dir : "traces", name);
    return buf;
}

static char *write_tmp(const char *text)
{
    static char path[4096];
    const char *dir = getenv("TMPDIR");
    snprintf(path, sizeof(path), "%s/kvt-trace-XXXXXX", dir ? dir : "/tmp");
    int fd = mkstemp(path);
    cr_assert_geq(fd, 0);
    cr_assert_eq(write(fd, text, strlen(text)), (ssize_t)strlen(text));
    close(fd);
    return path;
}

/* The README's pseudo-code, transcribed separately from trace.c. */
static uint32_t readme_token(uint64_t h, int i)
{
    uint64_t state, z;
#define MIX(x)                                                                                     \
    (z = (x), z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull,                                         \
     z = (z ^ (z >> 27)) * 0x94D049BB133111EBull, z ^ (z >> 31))
    state = MIX(h + 1);
    uint64_t out = 0;
    for (int k = 0; k <= i; k++) {
        state = state + 0x9E3779B97F4A7C15ull;
        out = MIX(state) % 151936;
    }
#undef MIX
    return (uint32_t)out;
}

Test(trace, canonical_tokens_follow_the_readme)
{
    uint32_t tok[KVT_TRACE_BLOCK_TOKENS];
    uint64_t ids[] = {0, 1, 46, 182789, 1ull << 40};
    for (size_t j = 0; j < sizeof(ids) / sizeof(ids[0]); j++) {
        kvt_trace_block_tokens(ids[j], tok);
        for (int i = 0; i < KVT_TRACE_BLOCK_TOKENS; i += 37)
            cr_assert_eq(tok[i], readme_token(ids[j], i), "id %llu token %d",
                         (unsigned long long)ids[j], i);
        for (int i = 0; i < KVT_TRACE_BLOCK_TOKENS; i++)
            cr_assert_lt(tok[i], KVT_TRACE_VOCAB);
    }
}

Test(trace, records_parse_and_prompts_are_cut_to_input_length)
{
    char *p = write_tmp("{\"timestamp\": 5, \"input_length\": 600, \"output_length\": 7, "
                        "\"hash_ids\": [3, 9]}\n"
                        "\n"
                        "{\"hash_ids\":[3],\"input_length\":512,\"timestamp\":6,"
                        "\"output_length\":1}\n");
    kvt_trace_t *tr;
    cr_assert_eq(kvt_trace_load(&tr, p), 0);
    cr_assert_eq(tr->nreqs, 2);
    cr_expect_eq(tr->reqs[0].timestamp_ms, 5);
    cr_expect_eq(tr->reqs[0].input_length, 600);
    cr_expect_eq(tr->reqs[0].output_length, 7);
    cr_expect_eq(tr->reqs[0].nhash, 2);
    cr_expect_eq(tr->reqs[0].hash_ids[1], 9);
    cr_expect_eq(tr->reqs[1].hash_ids[0], 3);
    cr_expect_eq(tr->total_tokens, 1112);
    uint32_t tok[600], blk[KVT_TRACE_BLOCK_TOKENS];
    kvt_trace_tokens(&tr->reqs[0], tok);
    kvt_trace_block_tokens(9, blk);
    cr_expect_eq(memcmp(tok + 512, blk, 88 * sizeof(uint32_t)), 0);
    char name[64];
    cr_expect_str_eq(kvt_trace_name(tr, name, sizeof(name)), strrchr(p, '/') + 1);
    kvt_trace_free(tr);
    unlink(p);
}

Test(trace, malformed_records_are_refused)
{
    const char *bad[] = {
        "{\"timestamp\": 1, \"input_length\": 10}\n",                     /* no hash_ids */
        "{\"timestamp\": 1, \"input_length\": 600, \"hash_ids\": [1]}\n", /* too few ids */
        "{\"timestamp\": -1, \"input_length\": 1, \"hash_ids\": [1]}\n",  /* negative */
        "{\"timestamp\": 1, \"input_length\": 1, \"hash_ids\": [1,]}\n",  /* trailing comma */
        "[1, 2, 3]\n",
        "{\"timestamp\": 1, \"input_length\": 1, \"hash_ids\": [1], \"x\": [2}\n", /* bad skip */
        "{\"timestamp\": 1, \"input_length\": 1, \"hash_ids\": [1], \"x\": nope}\n",
        "{\"timestamp\": 1, \"input_length\": 1, \"hash_ids\": [1], \"x\": \"open}\n",
        "{\"timestamp\": 1., \"input_length\": 1, \"hash_ids\": [1]}\n",  /* no fraction */
        "{\"timestamp\": 1, \"input_length\": 1.5, \"hash_ids\": [1]}\n", /* only timestamps */
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        char *p = write_tmp(bad[i]);
        kvt_trace_t *tr = (kvt_trace_t *)1;
        cr_expect_eq(kvt_trace_load(&tr, p), KVT_EPROTO, "case %zu", i);
        cr_expect_null(tr);
        unlink(p);
    }
    kvt_trace_t *tr;
    cr_expect_lt(kvt_trace_load(&tr, "/nonexistent/trace.jsonl"), 0);
    cr_expect_eq(kvt_trace_load(NULL, "x"), KVT_EINVAL);
}

/* Traces written by other tools: extra keys of any JSON shape are skipped, and a timestamp may
 * carry a fraction of a millisecond, which is dropped. */
Test(trace, unknown_keys_are_skipped_and_timestamps_may_be_fractional)
{
    char *p = write_tmp(
        "{\"id\": \"r-1\", \"timestamp\": 12.75, \"input_length\": 600, \"output_length\": 7, "
        "\"hash_ids\": [3, 9], \"meta\": {\"tenant\": \"a\\\"b}\", \"tags\": [1, -2.5e3, true, "
        "null, [], {}]}, \"ok\": false}\n"
        "{\"timestamp\": 1700000000123.5, \"hash_ids\": [4], \"input_length\": 3, "
        "\"output_length\": 1, \"score\": -0.25}\n");
    kvt_trace_t *tr;
    cr_assert_eq(kvt_trace_load(&tr, p), 0);
    cr_assert_eq(tr->nreqs, 2);
    cr_expect_eq(tr->reqs[0].timestamp_ms, 12);
    cr_expect_eq(tr->reqs[0].input_length, 600);
    cr_expect_eq(tr->reqs[0].output_length, 7);
    cr_expect_eq(tr->reqs[0].nhash, 2);
    cr_expect_eq(tr->reqs[0].hash_ids[1], 9);
    cr_expect_eq(tr->reqs[1].timestamp_ms, 1700000000123ull);
    cr_expect_eq(tr->reqs[1].hash_ids[0], 4);
    kvt_trace_free(tr);
    unlink(p);
}

/* Engine hints in a record (traces/README.md, "Engine hints"): a tool-call pause in ms, or the
 * session's end; a record without them has neither. */
Test(trace, hint_fields_are_read)
{
    char *p = write_tmp("{\"timestamp\": 1, \"input_length\": 1, \"output_length\": 1, "
                        "\"hash_ids\": [1], \"hint_pause_ms\": 45000}\n"
                        "{\"hint_finished\": true, \"timestamp\": 2, \"input_length\": 1, "
                        "\"output_length\": 1, \"hash_ids\": [1]}\n"
                        "{\"timestamp\": 3, \"input_length\": 1, \"output_length\": 1, "
                        "\"hash_ids\": [1], \"hint_finished\": 0}\n"
                        "{\"timestamp\": 4, \"input_length\": 1, \"output_length\": 1, "
                        "\"hash_ids\": [1], \"hint_finished\": 1}\n"
                        "{\"timestamp\": 5, \"input_length\": 1, \"output_length\": 1, "
                        "\"hash_ids\": [1]}\n");
    kvt_trace_t *tr;
    cr_assert_eq(kvt_trace_load(&tr, p), 0);
    cr_assert_eq(tr->nreqs, 5);
    uint32_t pause[] = {45000, 0, 0, 0, 0};
    uint8_t fin[] = {0, 1, 0, 1, 0};
    for (int i = 0; i < 5; i++) {
        cr_expect_eq(tr->reqs[i].hint_pause_ms, pause[i], "record %d", i);
        cr_expect_eq(tr->reqs[i].hint_finished, fin[i], "record %d", i);
    }
    kvt_trace_free(tr);
    unlink(p);
}

Test(trace, bad_hint_fields_are_refused)
{
    const char *bad[] = {
        "\"hint_pause_ms\": 0",                           /* a pause of nothing */
        "\"hint_pause_ms\": -5",                          /* negative */
        "\"hint_pause_ms\": 4294967295",                  /* past u32 - 1 */
        "\"hint_pause_ms\": 1.5",                         /* not an integer */
        "\"hint_pause_ms\": \"10\"",                      /* a string */
        "\"hint_finished\": 2",                           /* not a flag */
        "\"hint_finished\": truex",                       /* not a literal */
        "\"hint_finished\": null",                        /* not a flag */
        "\"hint_finished\": 10",                          /* not a flag */
        "\"hint_pause_ms\": 10, \"hint_finished\": true", /* paused and finished */
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        char line[256];
        snprintf(line, sizeof line,
                 "{\"timestamp\": 1, \"input_length\": 1, \"hash_ids\": [1], %s}\n", bad[i]);
        char *p = write_tmp(line);
        kvt_trace_t *tr = (kvt_trace_t *)1;
        cr_expect_eq(kvt_trace_load(&tr, p), KVT_EPROTO, "case %zu: %s", i, bad[i]);
        cr_expect_null(tr);
        unlink(p);
    }
}

/* The README's table (request and block counts), and the index at 512-token pages (a page is
 * then one of the trace's own blocks) against the trace's hash ids: a request's leading full
 * blocks whose ids were seen as full blocks before are exactly what the index must match. */
static int seen_has(const uint64_t *set, size_t cap, uint64_t id)
{
    for (size_t i = (id * 0x9E3779B97F4A7C15ull) & (cap - 1); set[i]; i = (i + 1) & (cap - 1))
        if (set[i] == id + 1)
            return 1;
    return 0;
}

static void seen_add(uint64_t *set, size_t cap, uint64_t id)
{
    size_t i = (id * 0x9E3779B97F4A7C15ull) & (cap - 1);
    while (set[i] && set[i] != id + 1)
        i = (i + 1) & (cap - 1);
    set[i] = id + 1;
}

Test(trace, conversation_trace_matches_its_readme, .timeout = 120)
{
    kvt_trace_t *tr;
    int rc = kvt_trace_load(&tr, trace_path("mooncake-conversation.jsonl"));
    if (rc != 0)
        cr_skip_test("shared traces not found (KVT_TRACE_DIR, meson option traces)");
    cr_assert_eq(tr->nreqs, 12031);
    kvt_radix_t *t;
    uint32_t ns;
    cr_assert_eq(kvt_radix_create(&t, NULL), 0);
    cr_assert_eq(kvt_radix_ns_open(t, "m", NULL, NULL, 512, &ns), 0);
    uint32_t *tok = malloc((tr->max_input_length + 1) * sizeof(uint32_t));
    size_t cap = 1 << 20;
    uint64_t *seen = calloc(cap, sizeof(uint64_t));
    uint64_t blocks = 0, hit = 0;
    for (size_t i = 0; i < tr->nreqs; i++) {
        const kvt_trace_req_t *r = &tr->reqs[i];
        uint32_t full = r->input_length / 512, want = 0;
        while (want < full && seen_has(seen, cap, r->hash_ids[want]))
            want++;
        kvt_trace_tokens(r, tok);
        kvt_match_t m;
        kvt_insert_t ins;
        cr_assert_eq(kvt_radix_match(t, ns, tok, r->input_length, 0, &m), 0);
        cr_assert_eq(m.pages, want, "request %zu: matched %u blocks, the ids say %u", i, m.pages,
                     want);
        cr_assert_eq(kvt_radix_insert(t, ns, tok, r->input_length, &ins), 0);
        for (uint32_t b = 0; b < full; b++)
            seen_add(seen, cap, r->hash_ids[b]);
        blocks += r->nhash;
        hit += m.pages;
    }
    cr_expect_eq(blocks, 288500);
    cr_expect_gt(hit, 0);
    cr_expect_eq(kvt_radix_verify(t), 0);
    free(seen);
    free(tok);
    kvt_radix_destroy(t);
    kvt_trace_free(tr);
}

/* A field named twice is refused (found by fuzz/fuzz_trace.c): a second "hash_ids" used to add
 * its ids to the trace's store after the first's while the request pointed at the first's, so
 * every later request read another's ids. */
Test(trace, a_field_named_twice_is_refused)
{
    const char *bad[] = {
        "{\"timestamp\": 0, \"input_length\": 1000, \"output_length\": 10, \"hash_ids\": [0, 1], "
        "\"input_length\": 512, \"hash_ids\": [7]}\n",
        "{\"timestamp\": 0, \"timestamp\": 1, \"input_length\": 1, \"hash_ids\": [1]}\n",
        "{\"output_length\": 1, \"timestamp\": 0, \"output_length\": 2, \"input_length\": 1, "
        "\"hash_ids\": [1]}\n",
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        char *p = write_tmp(bad[i]);
        kvt_trace_t *tr = (kvt_trace_t *)1;
        cr_expect_eq(kvt_trace_load(&tr, p), KVT_EPROTO, "case %zu", i);
        cr_expect_null(tr);
        unlink(p);
    }
}

/* A trace whose prompts are all empty has no hash id at all (found by fuzz/fuzz_trace.c under
 * UBSan: each request's ids were set to NULL + 0, undefined behaviour); its requests have none. */
Test(trace, a_trace_of_empty_prompts_has_no_ids)
{
    char *p = write_tmp("{\"timestamp\": 1, \"input_length\": 0, \"output_length\": 3, "
                        "\"hash_ids\": []}\n"
                        "{\"timestamp\": 2, \"input_length\": 0, \"output_length\": 4, "
                        "\"hash_ids\": []}\n");
    kvt_trace_t *tr;
    cr_assert_eq(kvt_trace_load(&tr, p), 0);
    cr_assert_eq(tr->nreqs, 2);
    cr_expect_eq(tr->nids, 0);
    for (size_t i = 0; i < tr->nreqs; i++) {
        cr_expect_eq(tr->reqs[i].nhash, 0);
        cr_expect_null(tr->reqs[i].hash_ids);
        kvt_trace_tokens(&tr->reqs[i], NULL); /* no token to write */
    }
    cr_expect_eq(tr->total_tokens, 0);
    kvt_trace_free(tr);
    unlink(p);
}

/* The block cache against the plain expansion, its reference model: random prompts over a few
 * dozen ids through a cache of 8 blocks (four sets of two), so that blocks are evicted and
 * expanded again, with last blocks cut anywhere. Every prompt must come out the same tokens. */
Test(trace, cached_tokens_are_the_plain_tokens)
{
    kvt_trace_cache_t *c;
    cr_assert_eq(kvt_trace_cache_create(&c, 8), 0);
    enum { MAXB = 6 };
    uint64_t ids[MAXB];
    static uint32_t got[MAXB * KVT_TRACE_BLOCK_TOKENS], want[MAXB * KVT_TRACE_BLOCK_TOKENS];
    uint64_t rng = 7, blocks = 0;
    for (int round = 0; round < 2000; round++) {
        rng = rng * 6364136223846793005ull + 1442695040888963407ull;
        uint32_t nb = 1 + (uint32_t)(rng >> 33) % MAXB;
        for (uint32_t b = 0; b < nb; b++) {
            rng = rng * 6364136223846793005ull + 1442695040888963407ull;
            /* a few large ids too: the set comes from the mixed id, not its low bits */
            ids[b] = (rng >> 40) % 40 + (b % 3 == 2 ? (1ull << 40) : 0);
        }
        rng = rng * 6364136223846793005ull + 1442695040888963407ull;
        uint32_t len = (nb - 1) * KVT_TRACE_BLOCK_TOKENS + 1 + (uint32_t)(rng >> 35) % 512;
        kvt_trace_req_t r = {.input_length = len, .nhash = nb, .hash_ids = ids};
        memset(got, 0xff, sizeof(got));
        memset(want, 0xff, sizeof(want));
        kvt_trace_tokens_cached(c, &r, got);
        kvt_trace_tokens(&r, want);
        cr_assert_eq(memcmp(got, want, sizeof(got)), 0, "round %d", round);
        blocks += nb;
    }
    uint64_t lookups, hits;
    kvt_trace_cache_stats(c, &lookups, &hits);
    cr_expect_eq(lookups, blocks);
    cr_expect_gt(hits, 0);
    cr_expect_lt(hits, lookups); /* 80 ids do not fit in 8 blocks */
    kvt_trace_cache_free(c);
}

/* A block used again finds its tokens in the cache, in either way of its set, and the sizes
 * outside the documented range are refused. */
Test(trace, a_repeated_block_is_a_hit)
{
    kvt_trace_cache_t *c;
    cr_expect_eq(kvt_trace_cache_create(NULL, 8), KVT_EINVAL);
    cr_expect_eq(kvt_trace_cache_create(&c, ((size_t)1 << 24) + 1), KVT_EINVAL);
    cr_assert_eq(kvt_trace_cache_create(&c, 0), 0); /* one set of two ways */
    uint64_t ids[2] = {5, 1ull << 50};
    kvt_trace_req_t r = {.input_length = 2 * KVT_TRACE_BLOCK_TOKENS, .nhash = 2, .hash_ids = ids};
    uint32_t tok[2 * KVT_TRACE_BLOCK_TOKENS], blk[KVT_TRACE_BLOCK_TOKENS];
    for (int k = 0; k < 3; k++)
        kvt_trace_tokens_cached(c, &r, tok);
    uint64_t lookups, hits;
    kvt_trace_cache_stats(c, &lookups, &hits);
    cr_expect_eq(lookups, 6);
    cr_expect_eq(hits, 4);
    kvt_trace_block_tokens(ids[1], blk);
    cr_expect_eq(memcmp(tok + KVT_TRACE_BLOCK_TOKENS, blk, sizeof(blk)), 0);
    /* a third id evicts the one used least recently (5), not the one just read */
    uint64_t third = 77;
    kvt_trace_req_t r3 = {.input_length = 10, .nhash = 1, .hash_ids = &third};
    kvt_trace_tokens_cached(c, &r3, tok);
    kvt_trace_req_t r1 = {.input_length = 10, .nhash = 1, .hash_ids = &ids[1]};
    kvt_trace_tokens_cached(c, &r1, tok);
    kvt_trace_cache_stats(c, &lookups, &hits);
    cr_expect_eq(lookups, 8);
    cr_expect_eq(hits, 5);
    kvt_trace_block_tokens(ids[1], blk);
    cr_expect_eq(memcmp(tok, blk, 10 * sizeof(uint32_t)), 0);
    kvt_trace_cache_free(c);
    kvt_trace_cache_free(NULL);
}
