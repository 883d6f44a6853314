/*
 * test_server_e2e.c: kvtierd end to end through libkvtier: byte-exact PUT/GET round trips,
 * index-only use, leases (held, released, released on disconnect), DRAM spilling to NVMe,
 * PREFETCH and GET promotions, warm restart with the NVMe tier recovered (also after a SIGKILL
 * amid PUTs: every page a reply said was stored comes back), many concurrent clients, AUTH,
 * defaults in the working directory, clean shutdown and exit codes.
 */
#include <pthread.h>

#include "config.h"

#include "common.h"
#include "proto.h"
#include "test_raw_frames.h"
#include "test_server_harness.h"
#include "test_thp.h"

#define PAGE 16
#define BB   8192

static void put_pages(kvt_client_t *c, const uint32_t *tok, uint32_t ntok, uint32_t first,
                      uint32_t n, uint32_t bb, uint32_t seed, kvt_client_put_t *r)
{
    uint8_t *payload = malloc((size_t)n * bb);
    for (uint32_t p = 0; p < n; p++)
        kvd_fill(payload + (size_t)p * bb, bb, seed + first + p);
    int rc = kvt_client_put(c, tok, ntok, first, n, payload, NULL, r);
    cr_assert_eq(rc, 0, "put: %s %s", kvt_client_strerror(rc), kvt_client_errmsg(c));
    free(payload);
}

/* REMOVE waits up to a second for the policy's moves on its prefix, then answers EBUSY (a busy
 * machine can take longer): retry for up to 5 s. */
static int remove_retry(kvt_client_t *c, const uint32_t *tok, uint32_t n)
{
    int rc = 0;
    for (int i = 0; i < 1000; i++) {
        if ((rc = kvt_client_remove(c, tok, n)) != KVT_CLIENT_EBUSY)
            break;
        usleep(5000);
    }
    return rc;
}

/* Matches until every page is in `tier` (promotions are asynchronous), up to 5 s. */
static int match_until(kvt_client_t *c, const uint32_t *tok, uint32_t ntok, uint8_t *tiers,
                       uint32_t pages, uint8_t tier)
{
    kvt_client_match_t m = {.tiers = tiers, .tiers_cap = pages};
    for (int i = 0; i < 1000; i++) {
        cr_assert_eq(kvt_client_match(c, tok, ntok, 0, 0, NULL, &m), 0);
        uint32_t k = 0;
        while (k < m.pages && tiers[k] == tier)
            k++;
        if (m.pages == pages && k == pages)
            return 1;
        usleep(5000);
    }
    return 0;
}

/* A MATCH's tier per page over a path of four nodes (3, 5, 1 and 4 pages: a PUT that extended
 * it and splits made by two other prompts) whose pages lie in two tiers: MATCH reads the tiers
 * node by node, four pages a step and the rest one by one, and must leave none out or shifted
 * at a node's edge. */
Test(server_e2e, a_match_reports_each_pages_tier_across_nodes)
{
    kvd_t d = {0};
    kvd_start(&d, NULL);
    kvt_client_t *c = kvd_client(&d, "llama", PAGE, BB);
    uint32_t x[13 * PAGE], y[13 * PAGE];
    kvd_tokens(x, 13 * PAGE, 100);
    kvt_client_put_t r;
    put_pages(c, x, 8 * PAGE, 0, 8, BB, 1, &r); /* pages 0-7 stored */
    cr_assert_eq(r.stored, 8);
    put_pages(c, x, 13 * PAGE, 0, 0, BB, 0, &r); /* pages 8-12 index-only */
    cr_assert_eq(r.new_pages, 5);
    for (uint32_t cut = 3; cut <= 9; cut += 6) { /* splits after pages 3 and 9 */
        memcpy(y, x, sizeof y);
        kvd_tokens(y + cut * PAGE, (13 - cut) * PAGE, 900000 + cut);
        put_pages(c, y, 13 * PAGE, 0, 0, BB, 0, &r);
        cr_assert_eq(r.new_pages, 13 - cut);
    }
    uint8_t tiers[16];
    kvt_client_match_t m = {.tiers = tiers, .tiers_cap = 16};
    cr_assert_eq(kvt_client_match(c, x, 13 * PAGE, 0, 0, NULL, &m), 0);
    cr_assert_eq(m.pages, 13);
    for (int i = 0; i < 13; i++) {
        uint8_t want = i < 8 ? KVT_CLIENT_TIER_DRAM : KVT_CLIENT_TIER_NONE;
        cr_expect_eq(tiers[i], want, "page %d in tier %u, not %u", i, tiers[i], want);
    }
    kvt_client_close(c);
    kvd_cleanup(&d);
}

Test(server_e2e, put_get_byte_exact)
{
    kvd_t d = {0};
    kvd_start(&d, NULL);
    kvt_client_t *c = kvd_client(&d, "llama", PAGE, BB);
    uint32_t tok[8 * PAGE + 5];
    kvd_tokens(tok, 8 * PAGE + 5, 100);
    kvt_client_put_t r;
    put_pages(c, tok, 8 * PAGE + 5, 0, 8, BB, 1, &r);
    cr_expect_eq(r.pages, 8);
    cr_expect_eq(r.new_pages, 8);
    cr_expect_eq(r.stored, 8);
    cr_expect_eq(r.skipped, 0);

    uint8_t tiers[16];
    kvt_client_match_t m = {.tiers = tiers, .tiers_cap = 16};
    cr_assert_eq(kvt_client_match(c, tok, 8 * PAGE + 5, KVT_CLIENT_LEASE, 0, NULL, &m), 0);
    cr_expect_eq(m.pages, 8);
    cr_expect_eq(m.tokens, 8 * PAGE);
    cr_assert_neq(m.lease, 0);
    for (int i = 0; i < 8; i++)
        cr_expect_eq(tiers[i], KVT_CLIENT_TIER_DRAM, "page %d in tier %u", i, tiers[i]);
    kvd_check_get(c, m.lease, 0, 8, BB, 1, NULL);
    kvd_check_get(c, m.lease, 3, 2, BB, 1, NULL); /* a middle range */

    /* PUT again: everything is held, nothing is rewritten, the bytes stay the first ones. */
    put_pages(c, tok, 8 * PAGE, 0, 8, BB, 99, &r);
    cr_expect_eq(r.new_pages, 0);
    cr_expect_eq(r.stored, 0);
    cr_expect_eq(r.skipped, 8);
    kvd_check_get(c, m.lease, 0, 8, BB, 1, NULL);

    /* Out of the leased range, unknown lease: errors, and the connection goes on. */
    uint8_t one[BB];
    cr_expect_eq(kvt_client_get(c, m.lease, 8, 1, one, sizeof one, NULL, NULL), KVT_CLIENT_EINVAL);
    cr_expect_eq(kvt_client_get(c, m.lease + 1000, 0, 1, one, sizeof one, NULL, NULL),
                 KVT_CLIENT_ENOENT);
    int released = -1;
    cr_expect_eq(kvt_client_release(c, m.lease, &released), 0);
    cr_expect_eq(released, 1);
    cr_expect_eq(kvt_client_release(c, m.lease, &released), 0, "a second release is harmless");
    cr_expect_eq(released, 0);
    cr_expect_eq(kvt_client_get(c, m.lease, 0, 1, one, sizeof one, NULL, NULL), KVT_CLIENT_ENOENT);
    cr_expect_eq(kvt_client_ping(c, NULL), 0);
    kvt_client_close(c);
    kvd_cleanup(&d);
}

/* kvtier_dram_arena_mapped_bytes: the DRAM region's memory, which holds what the tier stores
 * (its used bytes, in jemalloc's size classes) and keeps it when the pages go. */
Test(server_e2e, dram_arena_mapped_bytes_hold_the_stored_pages)
{
    kvd_t d = {0};
    kvd_start(&d, NULL);
    kvt_client_t *c = kvd_client(&d, "llama", PAGE, BB);
    double m0 = kvd_metric(&d, "kvtier_dram_arena_mapped_bytes");
    cr_assert_gt(m0, 0, "the series is there: %f", m0);
    uint32_t tok[256 * PAGE];
    kvd_tokens(tok, 256 * PAGE, 300);
    kvt_client_put_t r;
    put_pages(c, tok, 256 * PAGE, 0, 256, BB, 1, &r);
    cr_assert_eq(r.stored, 256);
    double used = kvd_metric(&d, "kvtier_tier_used_bytes{tier=\"dram\"}");
    double m1 = kvd_metric(&d, "kvtier_dram_arena_mapped_bytes");
    cr_assert_geq(used, 256.0 * BB);
    cr_assert_geq(m1, used, "mapped %f, used %f", m1, used);
    cr_assert_geq(m1, m0);
    cr_expect_eq(kvd_stat(c, "dram_arena_mapped_bytes"), (uint64_t)m1, "STATS says the same");
    cr_assert_eq(kvt_client_remove(c, tok, PAGE), 0); /* the first page and all beneath it */
    cr_assert_eq(kvd_metric(&d, "kvtier_dram_arena_mapped_bytes"), m1,
                 "the region keeps its pages for reuse");
    kvt_client_close(c);
    kvd_cleanup(&d);
}

/* A GET whose stream stops at a page with no bytes: the pages before it arrive whole, the
 * status says why it stopped, and the message says where (the end frame's body is the count
 * of pages sent, which the client once took for the message: 65 pages read as "A"). */
Test(server_e2e, a_get_stopped_mid_stream_says_where)
{
    kvd_t d = {0};
    kvd_start(&d, NULL);
    kvt_client_t *c = kvd_client(&d, "m", PAGE, 512);
    uint32_t tok[66 * PAGE];
    kvd_tokens(tok, 66 * PAGE, 5);
    kvt_client_put_t r;
    put_pages(c, tok, 66 * PAGE, 0, 65, 512, 3, &r);
    cr_assert_eq(r.stored, 65);
    kvt_client_match_t m = {0};
    cr_assert_eq(kvt_client_match(c, tok, 66 * PAGE, KVT_CLIENT_LEASE, 0, NULL, &m), 0);
    cr_assert_eq(m.pages, 66);
    static uint8_t buf[66 * 512];
    uint32_t got = 0;
    int rc = kvt_client_get(c, m.lease, 0, 66, buf, sizeof buf, &got, NULL);
    cr_expect_eq(rc, KVT_CLIENT_ENOENT, "%s", kvt_client_strerror(rc));
    cr_expect_eq(got, 65);
    cr_expect_str_eq(kvt_client_errmsg(c),
                     "the stream stopped after 65 pages (the daemon's log says why)");
    uint8_t want[512];
    for (uint32_t p = 0; p < 65; p++) {
        kvd_fill(want, 512, 3 + p);
        cr_assert(memcmp(buf + (size_t)p * 512, want, 512) == 0, "page %u differs", p);
    }
    cr_expect_eq(kvt_client_ping(c, NULL), 0);
    cr_expect_str_eq(kvt_client_errmsg(c), "", "a later success clears it");
    kvt_client_close(c);
    kvd_cleanup(&d);
}

Test(server_e2e, put_in_two_steps_and_prefix_sharing)
{
    kvd_t d = {0};
    kvd_start(&d, NULL);
    kvt_client_t *c = kvd_client(&d, "llama", PAGE, BB);
    uint32_t tok[8 * PAGE];
    kvd_tokens(tok, 8 * PAGE, 7);
    kvt_client_put_t r;
    put_pages(c, tok, 4 * PAGE, 0, 4, BB, 10, &r);
    cr_expect_eq(r.stored, 4);
    /* The engine matched 4 pages and computed the rest: it sends pages 4..7 only. */
    kvt_client_match_t m = {0};
    cr_assert_eq(kvt_client_match(c, tok, 8 * PAGE, 0, 0, NULL, &m), 0);
    cr_expect_eq(m.pages, 4);
    put_pages(c, tok, 8 * PAGE, 4, 4, BB, 10, &r);
    cr_expect_eq(r.pages, 8);
    cr_expect_eq(r.new_pages, 4);
    cr_expect_eq(r.stored, 4);
    /* A second prompt sharing the first 2 pages. */
    uint32_t tok2[6 * PAGE];
    memcpy(tok2, tok, 2 * PAGE * 4);
    kvd_tokens(tok2 + 2 * PAGE, 4 * PAGE, 5000);
    put_pages(c, tok2, 6 * PAGE, 2, 4, BB, 20, &r);
    cr_expect_eq(r.new_pages, 4);
    cr_assert_eq(kvt_client_match(c, tok, 8 * PAGE, KVT_CLIENT_LEASE, 0, NULL, &m), 0);
    cr_assert_eq(m.pages, 8);
    kvd_check_get(c, m.lease, 0, 8, BB, 10, NULL);
    kvt_client_match_t m2 = {0};
    cr_assert_eq(kvt_client_match(c, tok2, 6 * PAGE, KVT_CLIENT_LEASE, 0, NULL, &m2), 0);
    cr_assert_eq(m2.pages, 6);
    kvd_check_get(c, m2.lease, 0, 2, BB, 10, NULL);
    kvd_check_get(c, m2.lease, 2, 4, BB, 20, NULL);
    /* Another namespace sees nothing of it. */
    kvt_client_t *o = kvd_client(&d, "other-model", PAGE, BB);
    kvt_client_match_t mo = {0};
    cr_assert_eq(kvt_client_match(o, tok, 8 * PAGE, 0, 0, NULL, &mo), 0);
    cr_expect_eq(mo.pages, 0);
    kvt_client_close(o);
    kvt_client_close(c);
    kvd_cleanup(&d);
}

Test(server_e2e, index_only_namespace)
{
    kvd_t d = {0};
    kvd_start(&d, NULL);
    kvt_client_t *c = kvd_client(&d, "idx", PAGE, 0);
    uint32_t tok[5 * PAGE];
    kvd_tokens(tok, 5 * PAGE, 1);
    kvt_client_put_t r;
    cr_assert_eq(kvt_client_put(c, tok, 5 * PAGE, 0, 0, NULL, NULL, &r), 0);
    cr_expect_eq(r.new_pages, 5);
    cr_expect_eq(r.stored, 0);
    uint8_t tiers[8];
    kvt_client_match_t m = {.tiers = tiers, .tiers_cap = 8};
    cr_assert_eq(kvt_client_match(c, tok, 5 * PAGE, KVT_CLIENT_LEASE, 0, NULL, &m), 0);
    cr_expect_eq(m.pages, 5);
    cr_expect_eq(tiers[0], KVT_CLIENT_TIER_NONE);
    uint8_t buf[64];
    cr_expect_eq(kvt_client_get(c, m.lease, 0, 1, buf, sizeof buf, NULL, NULL), KVT_CLIENT_EINVAL);
    cr_expect_eq(kvt_client_remove(c, tok, 5 * PAGE), KVT_CLIENT_EBUSY, "leased");
    cr_expect_eq(kvt_client_release(c, m.lease, NULL), 0);
    cr_expect_eq(kvt_client_remove(c, tok, 3 * PAGE), 0);
    cr_assert_eq(kvt_client_match(c, tok, 5 * PAGE, 0, 0, NULL, &m), 0);
    cr_expect_eq(m.pages, 2);
    cr_expect_eq(kvt_client_remove(c, tok, 4 * PAGE), KVT_CLIENT_ENOENT);
    kvt_client_close(c);
    kvd_cleanup(&d);
}

/* Two clients of namespace "m" on d, and a 4-page prompt (tok) a has stored. */
static void two_clients_one_prompt(const kvd_t *d, kvt_client_t **a, kvt_client_t **b,
                                   uint32_t tok[4 * PAGE])
{
    *a = kvd_client(d, "m", PAGE, BB);
    *b = kvd_client(d, "m", PAGE, BB);
    kvd_tokens(tok, 4 * PAGE, 3);
    kvt_client_put_t r;
    put_pages(*a, tok, 4 * PAGE, 0, 4, BB, 0, &r);
}

Test(server_e2e, leases_released_on_disconnect)
{
    kvd_t d = {0};
    kvd_start(&d, NULL);
    kvt_client_t *a, *b;
    uint32_t tok[4 * PAGE];
    two_clients_one_prompt(&d, &a, &b, tok);
    kvt_client_match_t m = {0};
    for (int i = 0; i < 3; i++)
        cr_assert_eq(kvt_client_match(a, tok, 4 * PAGE, KVT_CLIENT_LEASE, 60000, NULL, &m), 0);
    cr_expect_eq(kvd_stat(b, "leases"), 3);
    cr_expect_eq(kvt_client_remove(b, tok, 4 * PAGE), KVT_CLIENT_EBUSY);
    /* b cannot use or release a's lease */
    uint8_t buf[BB];
    cr_expect_eq(kvt_client_get(b, m.lease, 0, 1, buf, sizeof buf, NULL, NULL), KVT_CLIENT_ENOENT);
    kvt_client_close(a);
    uint64_t leases = 1;
    for (int i = 0; i < 1000 && leases; i++) { /* up to 5 s */
        usleep(5000);
        leases = kvd_stat(b, "leases");
    }
    cr_expect_eq(leases, 0, "leases of a closed connection are released");
    cr_expect_eq(kvt_client_remove(b, tok, 4 * PAGE), 0);
    kvt_client_close(b);
    kvd_cleanup(&d);
}

/* max-leases 3: a fourth lease on the connection is refused with ENOSPC (saying why) until one
 * is released; lookups without a lease and other connections are not held back by it. */
Test(server_e2e, leases_per_connection_are_bounded)
{
    kvd_t d = {0};
    kvd_start(&d, "--max-leases", "3", NULL);
    kvt_client_t *a, *b;
    uint32_t tok[4 * PAGE];
    two_clients_one_prompt(&d, &a, &b, tok);
    kvt_client_match_t m[4];
    for (int i = 0; i < 3; i++) {
        m[i] = (kvt_client_match_t){0};
        cr_assert_eq(kvt_client_match(a, tok, 4 * PAGE, KVT_CLIENT_LEASE, 60000, NULL, &m[i]), 0);
    }
    m[3] = (kvt_client_match_t){0};
    cr_assert_eq(kvt_client_match(a, tok, 4 * PAGE, KVT_CLIENT_LEASE, 60000, NULL, &m[3]),
                 KVT_CLIENT_ENOSPC);
    cr_expect(strstr(kvt_client_errmsg(a), "max-leases"), "%s", kvt_client_errmsg(a));
    cr_expect_eq(kvd_stat(b, "leases"), 3);
    kvt_client_match_t q = {0};
    cr_assert_eq(kvt_client_match(a, tok, 4 * PAGE, 0, 0, NULL, &q), 0);
    cr_expect_eq(q.pages, 4, "a lookup without a lease is answered");
    cr_assert_eq(kvt_client_match(b, tok, 4 * PAGE, KVT_CLIENT_LEASE, 60000, NULL, &q), 0);
    cr_assert_eq(kvt_client_release(a, m[1].lease, NULL), 0);
    cr_assert_eq(kvt_client_match(a, tok, 4 * PAGE, KVT_CLIENT_LEASE, 60000, NULL, &m[3]), 0);
    uint8_t buf[BB];
    cr_expect_eq(kvt_client_get(a, m[3].lease, 0, 1, buf, sizeof buf, NULL, NULL), 0);
    kvt_client_close(a);
    kvt_client_close(b);
    kvd_cleanup(&d);
}

/* Connects to namespace `model` (index-only), or returns the refusal. */
static int ns_connect(const kvd_t *d, const char *model, kvt_client_t **out)
{
    kvt_client_conf_t conf = {.unix_path = d->sock, .model = model, .page_size = PAGE};
    *out = NULL;
    return kvt_client_connect(out, &conf);
}

/*
 * max-namespaces 4: tenants come and go for ever without the daemon filling up. A HELLO of a new
 * namespace when four are open closes the empty ones no client uses (m4 here) and takes an id;
 * namespaces holding pages (m3) or declared by a connected client (m1, m2) stay. When every one
 * is in use, the HELLO is refused with ENOSPC, saying why, and nothing changes (one holding pages
 * that nobody uses would have them evicted instead: test_server_abuse.c).
 * (Namespaces used to stay open for the daemon's life: the 65,537th tenant ever was refused.)
 */
Test(server_e2e, idle_empty_namespaces_make_room_for_new_ones)
{
    kvd_t d = {0};
    kvd_start(&d, "--max-namespaces", "4", NULL);
    kvt_client_t *m1, *m2, *m3, *m4, *m5, *x;
    cr_assert_eq(ns_connect(&d, "m1", &m1), 0);
    cr_assert_eq(ns_connect(&d, "m2", &m2), 0);
    cr_assert_eq(ns_connect(&d, "m3", &m3), 0);
    cr_assert_eq(ns_connect(&d, "m4", &m4), 0);
    uint32_t tok[4 * PAGE];
    for (uint32_t i = 0; i < 4 * PAGE; i++)
        tok[i] = 7 * i + 1;
    kvt_client_put_t p;
    cr_assert_eq(kvt_client_put(m3, tok, 4 * PAGE, 0, 0, NULL, NULL, &p), 0);
    cr_assert_eq(kvd_stat(m1, "namespaces"), 4);
    cr_assert_eq(ns_connect(&d, "m5", &m5), KVT_CLIENT_ENOSPC, "all four in use");
    kvt_client_close(m3);
    kvt_client_close(m4);
    /* Until the daemon has seen both closes: with several loops, m3's may be seen before the
     * HELLO below and m4's after it, and then m3 is the one namespace nobody uses (it holds
     * pages: they would be evicted to make room, as test_server_abuse.c shows). */
    for (int i = 0; i < 500 && kvd_stat(m1, "connections") > 2; i++)
        usleep(10000);
    cr_assert_eq(kvd_stat(m1, "connections"), 2, "m1 and m2");
    int rc = -1;
    for (int i = 0; i < 200 && rc < 0; i++)
        if ((rc = ns_connect(&d, "m5", &m5)) < 0)
            usleep(10000);
    cr_assert_eq(rc, 0, "m4 is closed for m5: %s", kvt_client_strerror(rc));
    cr_expect_eq(kvd_stat(m1, "namespaces"), 4, "m1, m2, m3 (pages) and m5");
    cr_assert_eq(ns_connect(&d, "m3", &m3), 0, "a namespace open already");
    cr_assert_eq(ns_connect(&d, "m6", &x), KVT_CLIENT_ENOSPC, "every one is used");
    /* m3 kept its pages; m4 comes back empty in m5's place once m5's client is gone. */
    kvt_client_match_t q = {0};
    cr_assert_eq(kvt_client_match(m3, tok, 4 * PAGE, 0, 0, NULL, &q), 0);
    cr_expect_eq(q.pages, 4);
    kvt_client_close(m5);
    rc = -1;
    for (int i = 0; i < 200 && rc < 0; i++)
        if ((rc = ns_connect(&d, "m4", &m4)) < 0)
            usleep(10000);
    cr_assert_eq(rc, 0, "%s", kvt_client_strerror(rc));
    cr_assert_eq(kvt_client_match(m4, tok, 4 * PAGE, 0, 0, NULL, &q), 0);
    cr_expect_eq(q.pages, 0, "m4 starts afresh");
    cr_assert_eq(kvt_client_put(m4, tok, 4 * PAGE, 0, 0, NULL, NULL, &p), 0);
    cr_assert_eq(kvt_client_match(m4, tok, 4 * PAGE, 0, 0, NULL, &q), 0);
    cr_expect_eq(q.pages, 4);
    kvt_client_close(m1);
    kvt_client_close(m2);
    kvt_client_close(m3);
    kvt_client_close(m4);
    kvd_cleanup(&d);
}

/*
 * An engine's connection holding thousands of leases: each GET and RELEASE finds its own, in any
 * order, as leases come and go around it; a released id, and another connection's lease, are not
 * found. STATS counts every one, and closing the connection releases what is left.
 */
Test(server_e2e, thousands_of_leases_on_one_connection)
{
    enum { N = 3000 };
    kvd_t d = {0};
    kvd_start(&d, NULL);
    kvt_client_t *a, *b;
    uint32_t tok[4 * PAGE];
    two_clients_one_prompt(&d, &a, &b, tok);
    static uint64_t lease[N];
    for (int i = 0; i < N; i++) {
        kvt_client_match_t m = {0};
        cr_assert_eq(kvt_client_match(a, tok, 4 * PAGE, KVT_CLIENT_LEASE, 60000, NULL, &m), 0);
        lease[i] = m.lease;
    }
    kvt_client_match_t mb = {0};
    cr_assert_eq(kvt_client_match(b, tok, 4 * PAGE, KVT_CLIENT_LEASE, 60000, NULL, &mb), 0);
    cr_expect_eq(kvd_stat(b, "leases"), N + 1);
    /* Every other lease released, in a shuffled order, each once. */
    static int order[N / 2];
    for (int i = 0; i < N / 2; i++)
        order[i] = 2 * i;
    uint64_t x = 88172645463325252ull;
    for (int i = N / 2 - 1; i > 0; i--) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        int j = (int)(x % (uint64_t)(i + 1)), t = order[i];
        order[i] = order[j];
        order[j] = t;
    }
    int released = 0;
    for (int i = 0; i < N / 2; i++) {
        cr_assert_eq(kvt_client_release(a, lease[order[i]], &released), 0);
        cr_assert_eq(released, 1, "lease %d", order[i]);
    }
    cr_expect_eq(kvd_stat(b, "leases"), N / 2 + 1);
    uint8_t buf[BB];
    for (int i = 0; i < N; i += 97) {
        int want = i % 2 ? 0 : KVT_CLIENT_ENOENT;
        cr_expect_eq(kvt_client_get(a, lease[i], 1, 1, buf, sizeof buf, NULL, NULL), want,
                     "GET with lease %d", i);
        cr_assert_eq(kvt_client_release(a, lease[i], &released), 0);
        cr_expect_eq(released, i % 2, "RELEASE of lease %d", i);
        if (i % 2)
            cr_assert_eq(kvt_client_release(a, lease[i], &released), 0);
        cr_expect_eq(released, 0, "a second RELEASE of lease %d", i);
    }
    /* a's leases are not b's, and b's is not a's. */
    cr_expect_eq(kvt_client_get(b, lease[1], 0, 1, buf, sizeof buf, NULL, NULL), KVT_CLIENT_ENOENT);
    cr_assert_eq(kvt_client_release(b, lease[3], &released), 0);
    cr_expect_eq(released, 0);
    cr_assert_eq(kvt_client_release(a, mb.lease, &released), 0);
    cr_expect_eq(released, 0);
    cr_expect_eq(kvt_client_get(a, lease[3], 0, 1, buf, sizeof buf, NULL, NULL), 0);
    cr_expect_eq(kvt_client_get(b, mb.lease, 0, 1, buf, sizeof buf, NULL, NULL), 0);
    /* A GET's pin counts as gone once its reply is on its way (op_get.c get_send): with several
     * loops the reply is written with the lock let go, and b's STATS right after it, on another
     * loop, must not find a's GET still pinned (server_loops'
     * stats_after_a_gets_reply_never_counts_its_pin). */
    uint64_t held = kvd_stat(b, "leases");
    cr_expect_eq(held, N / 2 + 1 - (N + 96) / 97 / 2, "%llu", (unsigned long long)held);
    kvt_client_close(a);
    uint64_t leases = held;
    for (int i = 0; i < 1000 && leases > 1; i++) {
        usleep(5000);
        leases = kvd_stat(b, "leases");
    }
    cr_expect_eq(leases, 1, "a's leases are released when it closes, b's stays");
    kvt_client_close(b);
    kvd_cleanup(&d);
}

Test(server_e2e, lease_time_limit)
{
    kvd_t d = {0};
    kvd_start(&d, NULL);
    kvt_client_t *c = kvd_client(&d, "m", PAGE, BB);
    uint32_t tok[2 * PAGE];
    kvd_tokens(tok, 2 * PAGE, 3);
    kvt_client_put_t r;
    put_pages(c, tok, 2 * PAGE, 0, 2, BB, 0, &r);
    kvt_client_match_t m = {0};
    cr_assert_eq(kvt_client_match(c, tok, 2 * PAGE, KVT_CLIENT_LEASE, 100, NULL, &m), 0);
    cr_expect_eq(kvd_stat(c, "leases"), 1);
    uint64_t leases = 1, t0 = kvt_now_ns();
    while (leases && kvt_now_ns() - t0 < 3000000000ull) {
        usleep(20 * 1000);
        leases = kvd_stat(c, "leases");
    }
    cr_expect_eq(leases, 0, "the lease expired after 100 ms");
    cr_expect_geq(kvt_now_ns() - t0, 80000000ull, "not long before its time");
    uint8_t buf[BB];
    cr_expect_eq(kvt_client_get(c, m.lease, 0, 1, buf, sizeof buf, NULL, NULL), KVT_CLIENT_ENOENT);
    kvt_client_close(c);
    kvd_cleanup(&d);
}

/* 64 KiB blocks in 1 MiB of DRAM: what does not fit goes to NVMe. Watermarks at 100% keep the
 * policy from demoting in the background, so that where each PUT lands is known. */
#define BIG 65536

Test(server_e2e, dram_full_spills_to_nvme_and_prefetch_promotes)
{
    kvd_t d = {0};
    kvd_start(&d, "--dram-bytes", "1M", "--policy-high", "1", "--policy-low", "1", NULL);
    kvt_client_t *c = kvd_client(&d, "m", PAGE, BIG);
    uint32_t a[24 * PAGE], b[8 * PAGE];
    kvd_tokens(a, 24 * PAGE, 1);
    kvd_tokens(b, 8 * PAGE, 900000);
    kvt_client_put_t r;
    put_pages(c, a, 24 * PAGE, 0, 24, BIG, 100, &r);
    cr_expect_eq(r.stored, 24);
    put_pages(c, b, 8 * PAGE, 0, 8, BIG, 200, &r);
    cr_expect_eq(r.stored, 8);
    uint64_t dram_used = kvd_stat(c, "dram_used_bytes"),
             dram_cap = kvd_stat(c, "dram_capacity_bytes");
    cr_expect_leq(dram_used, dram_cap, "DRAM never above its capacity");
    cr_expect_gt(kvd_stat(c, "nvme_blocks"), 0);

    uint8_t tiers[24];
    kvt_client_match_t m = {.tiers = tiers, .tiers_cap = 24};
    cr_assert_eq(kvt_client_match(c, b, 8 * PAGE, KVT_CLIENT_LEASE, 0, NULL, &m), 0);
    cr_assert_eq(m.pages, 8);
    for (int i = 0; i < 8; i++)
        cr_expect_eq(tiers[i], KVT_CLIENT_TIER_NVME, "b's page %d in %u", i, tiers[i]);
    kvd_check_get(c, m.lease, 0, 8, BIG, 200, NULL); /* from NVMe (or DRAM, promoted meanwhile) */
    cr_expect_eq(kvt_client_release(c, m.lease, NULL), 0);

    /* PREFETCH b up to DRAM: the policy demotes a's blocks to make room, then promotes b. */
    kvt_client_prefetch_t pf;
    cr_assert_eq(kvt_client_prefetch(c, b, 8 * PAGE, KVT_CLIENT_TIER_DRAM, 5000, &pf), 0);
    cr_expect_eq(pf.pages, 8);
    cr_expect_eq(pf.moved + pf.resident, 8, "moved %u resident %u", pf.moved, pf.resident);
    cr_expect_eq(pf.failed, 0);
    cr_assert_eq(remove_retry(c, a, PAGE), 0);
    cr_assert_eq(kvt_client_match(c, b, 8 * PAGE, KVT_CLIENT_LEASE, 0, NULL, &m), 0);
    for (int i = 0; i < 8; i++)
        cr_expect_eq(tiers[i], KVT_CLIENT_TIER_DRAM, "b's page %d in %u after prefetch", i,
                     tiers[i]);
    uint8_t from[8];
    kvd_check_get(c, m.lease, 0, 8, BIG, 200, from);
    for (int i = 0; i < 8; i++)
        cr_expect_eq(from[i], KVT_CLIENT_TIER_DRAM);
    cr_expect_eq(kvd_stat(c, "nvme_blocks"), 0, "moved blocks left NVMe");
    kvt_client_close(c);
    kvd_cleanup(&d);
}

/* A daemon with 1 MiB of DRAM and no maintenance (watermarks at 100%), DRAM filled by a's 16
 * pages of BIG bytes (seeds from sa), then b's 4 pages (tokens from b_base, seeds from sb), which
 * find no room there and go to NVMe. */
static kvt_client_t *dram_full_b_in_nvme(kvd_t *d, uint32_t *a, uint32_t *b, uint32_t b_base,
                                         uint32_t sa, uint32_t sb)
{
    kvd_start(d, "--dram-bytes", "1M", "--policy-high", "1", "--policy-low", "1", NULL);
    kvt_client_t *c = kvd_client(d, "m", PAGE, BIG);
    kvd_tokens(a, 16 * PAGE, 1);
    kvd_tokens(b, 4 * PAGE, b_base);
    kvt_client_put_t r;
    put_pages(c, a, 16 * PAGE, 0, 16, BIG, sa, &r);
    put_pages(c, b, 4 * PAGE, 0, 4, BIG, sb, &r);
    return c;
}

/*
 * Reads in flight are counted per block (store.c) so that a block's old location is freed only
 * after its last read. Many GETs come and go through that count; afterwards nothing may still
 * count as being read: removing every prompt gives DRAM all its bytes back. (A slot emptied by
 * the count table's deletion once kept its old count, and a block later placed there stayed
 * "read" forever: its location was never freed.)
 */
Test(server_e2e, reads_done_leave_nothing_busy)
{
    kvd_t d = {0};
    kvd_start(&d, "--nvme-bytes", "0", NULL);
    kvt_client_t *c = kvd_client(&d, "m", PAGE, BB);
    enum { N = 16, P = 64 };
    static uint32_t tok[N][P * PAGE];
    kvt_client_put_t r;
    for (int k = 0; k < N; k++) {
        kvd_tokens(tok[k], P * PAGE, 1000000u * (k + 1));
        put_pages(c, tok[k], P * PAGE, 0, P, BB, 10 * k, &r);
        cr_assert_eq(r.stored, P);
    }
    for (int round = 0; round < 3; round++)
        for (int k = 0; k < N; k++) {
            kvt_client_match_t m = {0};
            cr_assert_eq(kvt_client_match(c, tok[k], P * PAGE, KVT_CLIENT_LEASE, 0, NULL, &m), 0);
            cr_assert_eq(m.pages, P);
            kvd_check_get(c, m.lease, 0, P, BB, 10 * k, NULL);
            cr_assert_eq(kvt_client_release(c, m.lease, NULL), 0);
        }
    for (int k = 0; k < N; k++)
        cr_assert_eq(remove_retry(c, tok[k], PAGE), 0);
    cr_expect_eq(kvd_stat(c, "dram_blocks"), 0);
    cr_expect_eq(kvd_stat(c, "dram_used_bytes"), 0, "every location was freed");
    kvt_client_close(c);
    kvd_cleanup(&d);
}

/*
 * A REMOVE of blocks the daemon is busy with (a PREFETCH moving them, in the same write, so that
 * nothing has completed yet) waits for that work and then removes, where it used to answer
 * EBUSY; a REMOVE of what a connection's lease holds is still refused at once.
 */
Test(server_e2e, remove_waits_for_moves_not_for_leases)
{
    kvd_t d = {0};
    uint32_t a[16 * PAGE], b[4 * PAGE];
    kvt_client_t *c = dram_full_b_in_nvme(&d, a, b, 900000, 100, 200);
    cr_assert_eq(kvd_stat(c, "nvme_blocks"), 4);
    kvt_batch_t *bt;
    cr_assert_eq(kvt_batch_create(&bt, c), 0);
    kvt_client_prefetch_t pf;
    int sp, sr;
    cr_assert_eq(kvt_batch_prefetch(bt, b, 4 * PAGE, KVT_CLIENT_TIER_DRAM, 5000, &pf, &sp), 0);
    cr_assert_eq(kvt_batch_remove(bt, b, PAGE, &sr), 0);
    cr_assert_eq(kvt_batch_run(bt), 0);
    cr_expect_eq(sp, 0);
    cr_expect_eq(sr, 0, "the REMOVE waited for the PREFETCH's moves: %d", sr);
    kvt_client_match_t m = {0};
    cr_assert_eq(kvt_client_match(c, b, 4 * PAGE, 0, 0, NULL, &m), 0);
    cr_expect_eq(m.pages, 0, "b is gone");
    /* Held by a lease: refused at once, and nothing removed. */
    cr_assert_eq(kvt_client_match(c, a, 16 * PAGE, KVT_CLIENT_LEASE, 0, NULL, &m), 0);
    cr_assert_eq(m.pages, 16);
    cr_expect_eq(kvt_client_remove(c, a, 8 * PAGE), KVT_CLIENT_EBUSY);
    cr_assert_eq(kvt_client_release(c, m.lease, NULL), 0);
    kvt_client_match_t m2 = {0};
    cr_assert_eq(kvt_client_match(c, a, 16 * PAGE, 0, 0, NULL, &m2), 0);
    cr_expect_eq(m2.pages, 16);
    cr_expect_eq(kvt_client_remove(c, a, 8 * PAGE), 0);
    kvt_batch_destroy(bt);
    kvt_client_close(c);
    kvd_cleanup(&d);
}

Test(server_e2e, get_promotes_from_nvme)
{
    kvd_t d = {0};
    uint32_t a[16 * PAGE], b[4 * PAGE];
    kvt_client_t *c = dram_full_b_in_nvme(&d, a, b, 700000, 1, 2);
    cr_assert_eq(remove_retry(c, a, PAGE), 0);
    uint8_t tiers[4], from[4];
    kvt_client_match_t m = {.tiers = tiers, .tiers_cap = 4};
    cr_assert_eq(kvt_client_match(c, b, 4 * PAGE, KVT_CLIENT_LEASE, 0, NULL, &m), 0);
    cr_expect_eq(tiers[0], KVT_CLIENT_TIER_NVME);
    kvd_check_get(c, m.lease, 0, 4, BIG, 2, from); /* wherever the promotion has got to */
    cr_expect(match_until(c, b, 4 * PAGE, tiers, 4, KVT_CLIENT_TIER_DRAM),
              "the hit in NVMe promoted the path to DRAM");
    cr_assert_eq(kvt_client_match(c, b, 4 * PAGE, KVT_CLIENT_LEASE, 0, NULL, &m), 0);
    kvd_check_get(c, m.lease, 0, 4, BIG, 2, from);
    cr_expect_eq(from[0], KVT_CLIENT_TIER_DRAM);
    kvt_client_close(c);
    kvd_cleanup(&d);
}

/* A GET reads an NVMe page straight into its own buffer: one allocated with malloc's alignment
 * went through the tier's bounce buffer, an allocation and a copy of every page more
 * (docs/benchmarks.md, "CPU per NVMe GET"). PUTs may bounce: only the GET's reads are counted. */
Test(server_e2e, a_get_reads_nvme_pages_in_place)
{
    kvd_t d = {0};
    kvd_start(&d, "--dram-bytes", "0", NULL);
    kvt_client_t *c = kvd_client(&d, "m", PAGE, BIG);
    uint32_t a[4 * PAGE];
    kvd_tokens(a, 4 * PAGE, 1);
    kvt_client_put_t r;
    put_pages(c, a, 4 * PAGE, 0, 4, BIG, 3, &r);
    cr_assert_eq(r.stored, 4);
    uint8_t tiers[4], from[4];
    kvt_client_match_t m = {.tiers = tiers, .tiers_cap = 4};
    cr_assert_eq(kvt_client_match(c, a, 4 * PAGE, KVT_CLIENT_LEASE, 0, NULL, &m), 0);
    cr_assert_eq(m.pages, 4);
    double before = kvd_metric(&d, "kvtier_nvme_bounced_bytes_total");
    cr_assert_geq(before, 0, "the metric is exported");
    kvd_check_get(c, m.lease, 0, 4, BIG, 3, from);
    for (int i = 0; i < 4; i++)
        cr_assert_eq(from[i], KVT_CLIENT_TIER_NVME, "page %d came from NVMe", i);
    cr_expect_eq(kvd_metric(&d, "kvtier_nvme_bounced_bytes_total"), before,
                 "the GET's reads bounced %.0f bytes",
                 kvd_metric(&d, "kvtier_nvme_bounced_bytes_total") - before);
    kvt_client_close(c);
    kvd_cleanup(&d);
}

Test(server_e2e, restart_recovers_nvme)
{
    kvd_t d = {0};
    kvd_start(&d, "--dram-bytes", "0", NULL);
    kvt_client_t *c = kvd_client(&d, "llama", PAGE, BB);
    uint32_t tok[6 * PAGE];
    kvd_tokens(tok, 6 * PAGE, 42);
    kvt_client_put_t r;
    put_pages(c, tok, 6 * PAGE, 0, 6, BB, 77, &r);
    cr_expect_eq(r.stored, 6);
    /* A SIGHUP (a reload, or the terminal went away) leaves the daemon serving. */
    cr_assert_eq(kill(d.pid, SIGHUP), 0);
    usleep(50000);
    cr_expect_eq(kvt_client_ping(c, NULL), 0, "serving after SIGHUP");
    kvt_client_close(c);
    cr_assert_eq(kvd_stop(&d), 0, "clean shutdown");
    struct stat st;
    cr_expect(stat(d.sock, &st) < 0, "the socket is removed at exit");

    kvd_startv(&d, (const char *const[]){"--dram-bytes", "0", NULL});
    c = kvd_client(&d, "llama", PAGE, BB);
    uint8_t tiers[6];
    kvt_client_match_t m = {.tiers = tiers, .tiers_cap = 6};
    cr_assert_eq(kvt_client_match(c, tok, 6 * PAGE, KVT_CLIENT_LEASE, 0, NULL, &m), 0);
    cr_assert_eq(m.pages, 6, "the index was rebuilt from the NVMe tier");
    cr_expect_eq(tiers[5], KVT_CLIENT_TIER_NVME);
    kvd_check_get(c, m.lease, 0, 6, BB, 77, NULL);
    /* What the recovery did, in STATS and on /metrics. */
    cr_expect_eq(kvd_stat(c, "nvme_recovery_blocks_inserted"), 6);
    cr_expect_eq(kvd_stat(c, "nvme_recovery_blocks_torn") +
                     kvd_stat(c, "nvme_recovery_blocks_stale") +
                     kvd_stat(c, "nvme_recovery_blocks_orphan") + kvd_stat(c, "nvme_recovery_gaps"),
                 0);
    static char body[1 << 20];
    cr_assert_eq(kvd_http_get(&d, "/metrics", body, sizeof body), 200);
    cr_expect(strstr(body, "\nkvtier_nvme_recovery_blocks{outcome=\"inserted\"} 6\n"), "%s", body);
    cr_expect(strstr(body, "\nkvtier_nvme_recovery_blocks{outcome=\"torn\"} 0\n"));
    cr_expect(strstr(body, "\nkvtier_nvme_recovery_gaps 0\n"));
    kvt_client_close(c);
    kvd_cleanup(&d);
}

/* A REMOVE holds across a restart: the NVMe tier marks the removed blocks' records, so recovery
 * steps over them instead of giving them back. */
Test(server_e2e, removed_pages_stay_removed_after_a_restart)
{
    kvd_t d = {0};
    kvd_start(&d, "--dram-bytes", "0", NULL);
    kvt_client_t *c = kvd_client(&d, "llama", PAGE, BB);
    uint32_t tok[6 * PAGE];
    kvd_tokens(tok, 6 * PAGE, 43);
    kvt_client_put_t r;
    put_pages(c, tok, 6 * PAGE, 0, 6, BB, 78, &r);
    cr_expect_eq(r.stored, 6);
    cr_assert_eq(remove_retry(c, tok, 5 * PAGE), 0, "pages 4 and 5 go");
    kvt_client_close(c);
    cr_assert_eq(kvd_stop(&d), 0);

    kvd_startv(&d, (const char *const[]){"--dram-bytes", "0", NULL});
    c = kvd_client(&d, "llama", PAGE, BB);
    kvt_client_match_t m = {0};
    cr_assert_eq(kvt_client_match(c, tok, 6 * PAGE, KVT_CLIENT_LEASE, 0, NULL, &m), 0);
    cr_assert_eq(m.pages, 4, "the removed pages came back: %u pages", m.pages);
    kvd_check_get(c, m.lease, 0, 4, BB, 78, NULL);
    cr_expect_eq(kvd_stat(c, "nvme_recovery_blocks_inserted"), 4);
    cr_expect_eq(kvd_stat(c, "nvme_recovery_blocks_removed"), 2);
    kvt_client_close(c);
    kvd_cleanup(&d);
}

/* With nvme-recover off the NVMe tier starts empty: the blocks found in the data file are
 * dropped, where they used to stay charged to the tier with nothing in the index naming them,
 * and they do not come back at the next restart either. */
Test(server_e2e, a_start_without_recovery_drops_what_nvme_holds)
{
    kvd_t d = {0};
    kvd_start(&d, "--dram-bytes", "0", NULL);
    kvt_client_t *c = kvd_client(&d, "llama", PAGE, BB);
    uint32_t tok[4 * PAGE];
    kvd_tokens(tok, 4 * PAGE, 44);
    kvt_client_put_t r;
    put_pages(c, tok, 4 * PAGE, 0, 4, BB, 79, &r);
    cr_assert_eq(r.stored, 4);
    kvt_client_close(c);
    cr_assert_eq(kvd_stop(&d), 0);

    kvd_startv(&d, (const char *const[]){"--dram-bytes", "0", "--nvme-recover", "no", NULL});
    c = kvd_client(&d, "llama", PAGE, BB);
    cr_expect_eq(kvd_stat(c, "nvme_blocks"), 0);
    cr_expect_eq(kvd_stat(c, "nvme_used_bytes"), 0);
    kvt_client_match_t m = {0};
    cr_assert_eq(kvt_client_match(c, tok, 4 * PAGE, 0, 0, NULL, &m), 0);
    cr_expect_eq(m.pages, 0);
    kvt_client_close(c);
    cr_assert_eq(kvd_stop(&d), 0);

    kvd_startv(&d, (const char *const[]){"--dram-bytes", "0", NULL});
    c = kvd_client(&d, "llama", PAGE, BB);
    cr_assert_eq(kvt_client_match(c, tok, 4 * PAGE, 0, 0, NULL, &m), 0);
    cr_expect_eq(m.pages, 0, "dropped blocks came back");
    cr_expect_eq(kvd_stat(c, "nvme_blocks"), 0);
    kvt_client_close(c);
    kvd_cleanup(&d);
}

/* The first line of the daemon's log holding every one of the given strings (NULL-terminated),
 * copied into line; 0 when none does. */
static int log_line_with(const kvd_t *d, char *line, size_t cap, ...)
{
    static char log[1 << 16];
    kvd_slurp(d, "kvtierd.log", log, sizeof log);
    for (char *p = log; *p;) {
        char *end = strchr(p, '\n');
        size_t n = end ? (size_t)(end - p) : strlen(p);
        snprintf(line, cap, "%.*s", (int)n, p);
        int all = 1;
        va_list ap;
        va_start(ap, cap);
        for (const char *want; all && (want = va_arg(ap, const char *));)
            all = strstr(line, want) != NULL;
        va_end(ap);
        if (all)
            return 1;
        p += n + (end != NULL);
    }
    return 0;
}

/* kvtier.data removed while kvtier.meta and kvtier.live remain: the daemon starts empty, as it
 * did, but says so in a warning that names the file and how many blocks were lost (it used to
 * say only, at info level, that it recovered 0 blocks). */
Test(server_e2e, a_missing_data_file_is_a_warning_that_counts_the_lost_blocks)
{
    kvd_t d = {0};
    kvd_start(&d, "--dram-bytes", "0", NULL);
    kvt_client_t *c = kvd_client(&d, "llama", PAGE, BB);
    uint32_t tok[5 * PAGE];
    kvd_tokens(tok, 5 * PAGE, 45);
    kvt_client_put_t r;
    put_pages(c, tok, 5 * PAGE, 0, 5, BB, 80, &r);
    cr_assert_eq(r.stored, 5);
    kvt_client_close(c);
    cr_assert_eq(kvd_stop(&d), 0);
    char path[700];
    snprintf(path, sizeof path, "%s/kvtier-data/kvtier.data", d.dir);
    cr_assert_eq(unlink(path), 0, "%s: %s", path, strerror(errno));

    kvd_startv(&d, (const char *const[]){"--dram-bytes", "0", NULL});
    c = kvd_client(&d, "llama", PAGE, BB);
    cr_expect_eq(kvd_stat(c, "nvme_blocks"), 0);
    char line[1024];
    int found =
        log_line_with(&d, line, sizeof line, " warn ", "kvtier-data/kvtier.data", "is missing",
                      "the 5 blocks kvtier.live lists as live are lost", NULL);
    if (!found)
        kvd_log_tail(&d, 4096);
    cr_expect(found, "no warning naming the lost data file and its 5 blocks");
    /* The tier made a new data file and works: a restart now is a plain one. */
    put_pages(c, tok, 5 * PAGE, 0, 5, BB, 80, &r);
    cr_expect_eq(r.stored, 5);
    kvt_client_close(c);
    cr_assert_eq(kvd_stop(&d), 0);
    kvd_startv(&d, (const char *const[]){"--dram-bytes", "0", NULL});
    c = kvd_client(&d, "llama", PAGE, BB);
    cr_expect_eq(kvd_stat(c, "nvme_recovery_blocks_inserted"), 5);
    kvt_client_close(c);
    kvd_cleanup(&d);
}

/* A kvtier.data that is not a regular file (here a directory): the daemon refuses to start with
 * a message that names it, where it used to say only "Is a directory", and leaves it alone. */
Test(server_e2e, a_data_file_that_is_a_directory_stops_the_start_naming_it)
{
    kvd_t d = {0};
    kvd_mkdir(&d);
    char path[700];
    snprintf(path, sizeof path, "%s/kvtier-data", d.dir);
    cr_assert_eq(mkdir(path, 0700), 0);
    snprintf(path, sizeof path, "%s/kvtier-data/kvtier.data", d.dir);
    cr_assert_eq(mkdir(path, 0700), 0);
    char cmd[2048];
    snprintf(cmd, sizeof cmd,
             "cd '%s' && '%s' --unix x.sock --tcp '' --metrics '' --hbm-bytes 0 --dram-bytes 16M "
             "--nvme-bytes 8M --nvme-segment-bytes 1M >/dev/null 2>kvtierd.log",
             d.dir, kvd_binary());
    int st = system(cmd);
    cr_expect(WIFEXITED(st) && WEXITSTATUS(st) != 0, "kvtierd started: exit %d", WEXITSTATUS(st));
    char line[1024];
    int found = log_line_with(&d, line, sizeof line, " error ", "kvtier-data/kvtier.data",
                              "is not a regular file (a directory)", NULL);
    if (!found)
        kvd_log_tail(&d, 4096);
    cr_expect(found, "no error naming the data file that is a directory");
    struct stat sb;
    cr_expect(stat(path, &sb) == 0 && S_ISDIR(sb.st_mode), "the directory was left alone");
    kvd_cleanup(&d);
}

/* Clients that PUT while the daemon is killed (SIGKILL): every page a PUT reply said was stored
 * comes back after the restart, byte-exact, from the NVMe tier. The writers keep several PUTs'
 * writes in flight at the kill, completing out of order. */
typedef struct killed_writer {
    const kvd_t *d;
    int id;
    int *stored_total;
    int stored; /* PUTs [0, stored) had all their pages stored */
} killed_writer_t;

/* 4 x 400 PUTs of 4 pages (12 KiB records) fill 79 MB of the 128 MB NVMe tier at most: below
 * the policy's watermarks, so no page goes for room; the kill comes after 40. */
enum { KW_THREADS = 4, KW_PUTS = 400, KW_PAGES = 4 };

static void kw_tokens(uint32_t *tok, int id, int k)
{
    kvd_tokens(tok, KW_PAGES * PAGE, (uint32_t)(id * 1000000 + k * 1000));
}

static void *killed_writer_main(void *arg)
{
    killed_writer_t *w = arg;
    kvt_client_conf_t conf = {
        .unix_path = w->d->sock, .model = "llama", .page_size = PAGE, .block_bytes = BB};
    kvt_client_t *c;
    if (kvt_client_connect(&c, &conf) < 0)
        return NULL;
    uint32_t tok[KW_PAGES * PAGE];
    uint8_t *payload = malloc((size_t)KW_PAGES * BB);
    for (int k = 0; k < KW_PUTS; k++) {
        kw_tokens(tok, w->id, k);
        for (uint32_t p = 0; p < KW_PAGES; p++)
            kvd_fill(payload + (size_t)p * BB, BB, (uint32_t)(w->id * 100000 + k * 100) + p);
        kvt_client_put_t r;
        if (kvt_client_put(c, tok, KW_PAGES * PAGE, 0, KW_PAGES, payload, NULL, &r) < 0 ||
            r.stored != KW_PAGES)
            break; /* the daemon is gone (or skipped pages: stop counting there) */
        w->stored = k + 1;
        __atomic_fetch_add(w->stored_total, 1, __ATOMIC_RELAXED);
    }
    free(payload);
    kvt_client_close(c);
    return NULL;
}

Test(server_e2e, pages_stored_before_a_sigkill_come_back)
{
    kvd_t d = {0};
    const char *flags[] = {"--dram-bytes", "0", "--nvme-bytes", "128M", NULL};
    kvd_startv(&d, flags);
    int total = 0;
    pthread_t th[KW_THREADS];
    killed_writer_t w[KW_THREADS];
    for (int i = 0; i < KW_THREADS; i++) {
        w[i] = (killed_writer_t){.d = &d, .id = i, .stored_total = &total};
        pthread_create(&th[i], NULL, killed_writer_main, &w[i]);
    }
    for (int i = 0; i < 20000 && __atomic_load_n(&total, __ATOMIC_RELAXED) < KW_THREADS * 10; i++)
        usleep(1000);
    cr_assert_eq(kill(d.pid, SIGKILL), 0);
    int st;
    cr_assert_eq(waitpid(d.pid, &st, 0), d.pid);
    d.pid = 0;
    fclose(d.out);
    d.out = NULL;
    int stored = 0;
    for (int i = 0; i < KW_THREADS; i++) {
        pthread_join(th[i], NULL);
        stored += w[i].stored;
    }
    cr_assert_geq(stored, KW_THREADS * 10, "the kill came after %d PUTs", stored);
    cr_assert_lt(stored, KW_THREADS * KW_PUTS, "the kill came after the last PUT");

    kvd_startv(&d, flags);
    kvt_client_t *c = kvd_client(&d, "llama", PAGE, BB);
    uint32_t tok[KW_PAGES * PAGE];
    uint8_t tiers[KW_PAGES];
    uint8_t *buf = malloc((size_t)KW_PAGES * BB), *want = malloc(BB);
    for (int i = 0; i < KW_THREADS; i++) {
        for (int k = 0; k < w[i].stored; k++) {
            kw_tokens(tok, i, k);
            kvt_client_match_t m = {.tiers = tiers, .tiers_cap = KW_PAGES};
            cr_assert_eq(kvt_client_match(c, tok, KW_PAGES * PAGE, KVT_CLIENT_LEASE, 0, NULL, &m),
                         0);
            cr_assert_eq(m.pages, KW_PAGES, "writer %d PUT %d: %u pages back", i, k, m.pages);
            uint32_t got = 0;
            cr_assert_eq(
                kvt_client_get(c, m.lease, 0, KW_PAGES, buf, (size_t)KW_PAGES * BB, &got, NULL), 0);
            cr_assert_eq(got, KW_PAGES);
            for (uint32_t p = 0; p < KW_PAGES; p++) {
                kvd_fill(want, BB, (uint32_t)(i * 100000 + k * 100) + p);
                cr_assert(memcmp(buf + (size_t)p * BB, want, BB) == 0, "writer %d PUT %d page %u",
                          i, k, p);
            }
            cr_assert_eq(kvt_client_release(c, m.lease, NULL), 0);
        }
    }
    free(buf);
    free(want);
    kvt_client_close(c);
    kvd_cleanup(&d);
}

/*
 * The NVMe tier's live set, exactly, across a restart once the log has wrapped. An NVMe-only
 * daemon (8 MiB in 1 MiB segments: 128 records of 4 KiB pages to a segment, 682 pages charged
 * at most) takes more than it holds: segment reclaims drop the live blocks left in old segments,
 * the policy drops pages for room, REMOVE drops more. The pages each prompt has stored (MATCH's
 * leading run in NVMe) and their bytes must be the same after a SIGTERM and a restart, and again
 * after another round, a SIGKILL and a restart: a block the tier dropped never comes back, and
 * none that was live is missing. Recovery used to adopt every record still on disk, in hash
 * order until the tier was full.
 */
enum { LW_PAGES = 4, LW_BB = 4096, LW_ROUND = 400 };

static void lw_tokens(uint32_t *tok, uint32_t i)
{
    kvd_tokens(tok, LW_PAGES * PAGE, 5000000u + 1000u * i);
}

static void lw_put(kvt_client_t *c, uint32_t i)
{
    uint32_t tok[LW_PAGES * PAGE];
    kvt_client_put_t r;
    lw_tokens(tok, i);
    put_pages(c, tok, LW_PAGES * PAGE, 0, LW_PAGES, LW_BB, 16 * i, &r);
}

/*
 * A round of prompts [from, from + LW_ROUND): the first 128 (four segments' worth, below the
 * policy's watermark on a fresh tier) all but one in 32 removed, which leaves those segments
 * full with a few live blocks each; the rest then need those segments again, and reclaim them
 * with their live blocks. Every fourth of the later prompts, newest first, loses pages 2.. by
 * REMOVE where it still has them stored, ten at most. Returns how many REMOVEs dropped pages.
 */
static uint32_t lw_fill(kvt_client_t *c, uint32_t from)
{
    uint32_t tok[LW_PAGES * PAGE], removed = 0, to = from + LW_ROUND;
    for (uint32_t i = from; i < from + 128; i++)
        lw_put(c, i);
    for (uint32_t i = from; i < from + 128; i++) {
        if ((i - from) % 32 == 0)
            continue;
        lw_tokens(tok, i);
        int rc = remove_retry(c, tok, PAGE);
        cr_assert(rc == 0 || rc == KVT_CLIENT_ENOENT, "remove: %s", kvt_client_strerror(rc));
    }
    for (uint32_t i = from + 128; i < to; i++)
        lw_put(c, i);
    /* Up to ten of them, newest first: on a loaded machine the newest may not all have their
     * pages stored (skipped while every page the tier could drop was busy with a write), so the
     * search goes back as far as it must rather than giving up after the last 40. */
    for (uint32_t i = to - 4; i >= from + 128 && removed < 10; i -= 4) {
        uint8_t tiers[LW_PAGES];
        kvt_client_match_t m = {.tiers = tiers, .tiers_cap = LW_PAGES};
        lw_tokens(tok, i);
        cr_assert_eq(kvt_client_match(c, tok, LW_PAGES * PAGE, KVT_CLIENT_PROBE, 0, NULL, &m), 0);
        if (m.pages < 3 || tiers[2] != KVT_CLIENT_TIER_NVME)
            continue;
        cr_assert_eq(remove_retry(c, tok, 3 * PAGE), 0);
        removed++;
    }
    return removed;
}

/* The leading run of pages in NVMe of prompts [0, n), into stored. */
static void lw_snapshot(kvt_client_t *c, uint32_t n, uint8_t *stored)
{
    uint32_t tok[LW_PAGES * PAGE];
    uint8_t tiers[LW_PAGES];
    for (uint32_t i = 0; i < n; i++) {
        kvt_client_match_t m = {.tiers = tiers, .tiers_cap = LW_PAGES};
        lw_tokens(tok, i);
        cr_assert_eq(kvt_client_match(c, tok, LW_PAGES * PAGE, KVT_CLIENT_PROBE, 0, NULL, &m), 0);
        uint32_t k = 0;
        while (k < m.pages && tiers[k] == KVT_CLIENT_TIER_NVME)
            k++;
        stored[i] = (uint8_t)k;
    }
}

/* lw_snapshot once the daemon has settled: the policy works in bounded steps between events, so
 * a drop may still be under way when the last reply has come; two snapshots in a row agree. */
static void lw_snapshot_settled(kvt_client_t *c, uint32_t n, uint8_t *stored)
{
    static uint8_t again[2 * LW_ROUND];
    lw_snapshot(c, n, stored);
    for (int k = 0; k < 100; k++) {
        lw_snapshot(c, n, again);
        if (!memcmp(stored, again, n))
            return;
        memcpy(stored, again, n);
        usleep(20000);
    }
    cr_assert_fail("the daemon's stored pages kept changing");
}

/* A restart's snapshot against the one before it, and the bytes of every stored page. */
static void lw_compare(kvt_client_t *c, uint32_t n, const uint8_t *before, const char *how)
{
    static uint8_t after[2 * LW_ROUND];
    lw_snapshot(c, n, after);
    uint32_t lost = 0, back = 0, live = 0, first_bad = UINT32_MAX;
    for (uint32_t i = 0; i < n; i++) {
        live += before[i];
        lost += before[i] > after[i] ? before[i] - after[i] : 0;
        back += after[i] > before[i] ? after[i] - before[i] : 0;
        if (before[i] != after[i] && first_bad == UINT32_MAX)
            first_bad = i;
    }
    cr_assert_eq(lost + back, 0,
                 "after a %s: %u of %u live pages lost, %u dropped pages back (first: prompt %u, "
                 "%u pages before, %u after)",
                 how, lost, live, back, first_bad, first_bad < n ? before[first_bad] : 0,
                 first_bad < n ? after[first_bad] : 0);
    uint32_t tok[LW_PAGES * PAGE];
    for (uint32_t i = 0; i < n; i++) {
        if (!after[i])
            continue;
        kvt_client_match_t m = {0};
        lw_tokens(tok, i);
        cr_assert_eq(kvt_client_match(c, tok, LW_PAGES * PAGE, KVT_CLIENT_LEASE | KVT_CLIENT_PROBE,
                                      0, NULL, &m),
                     0);
        kvd_check_get(c, m.lease, 0, after[i], LW_BB, 16 * i, NULL);
        cr_assert_eq(kvt_client_release(c, m.lease, NULL), 0);
    }
}

static uint64_t lw_metric(const kvd_t *d, const char *line)
{
    static char body[1 << 20];
    cr_assert_eq(kvd_http_get(d, "/metrics", body, sizeof body), 200);
    const char *p = strstr(body, line);
    return p ? strtoull(p + strlen(line), NULL, 10) : 0;
}

Test(server_e2e, nvme_live_set_survives_restarts_after_the_log_wrapped)
{
    kvd_t d = {0};
    /* The sizes and watermarks lw_fill counts on, whatever the harness's defaults. */
    const char *flags[] = {"--dram-bytes",
                           "0",
                           "--nvme-bytes",
                           "8M",
                           "--nvme-segment-bytes",
                           "1M",
                           "--policy-high",
                           "0.95",
                           "--policy-low",
                           "0.90",
                           NULL};
    kvd_startv(&d, flags);
    kvt_client_t *c = kvd_client(&d, "llama", PAGE, LW_BB);
    static uint8_t before[2 * LW_ROUND];
    const char *lost = "\nkvtier_tier_lost_blocks_total{tier=\"nvme\"} ";
    const char *dropped = "\nkvtier_blocks_dropped_total{tier=\"nvme\"} ";
    cr_assert_gt(lw_fill(c, 0), 0, "REMOVE dropped stored pages");
    cr_assert_gt(lw_metric(&d, lost), 0, "the log wrapped: reclaims dropped live blocks");
    cr_assert_gt(lw_metric(&d, dropped), 0, "the policy dropped blocks for room");
    lw_snapshot_settled(c, LW_ROUND, before);
    kvt_client_close(c);
    cr_assert_eq(kvd_stop(&d), 0, "clean shutdown");

    kvd_startv(&d, flags);
    c = kvd_client(&d, "llama", PAGE, LW_BB);
    lw_compare(c, LW_ROUND, before, "SIGTERM");

    /* Another round on the recovered log, then SIGKILL once every request has its reply. */
    cr_assert_gt(lw_fill(c, LW_ROUND), 0);
    cr_assert_gt(lw_metric(&d, lost), 0);
    cr_assert_gt(lw_metric(&d, dropped), 0);
    lw_snapshot_settled(c, 2 * LW_ROUND, before);
    kvt_client_close(c);
    cr_assert_eq(kill(d.pid, SIGKILL), 0);
    int st;
    cr_assert_eq(waitpid(d.pid, &st, 0), d.pid);
    d.pid = 0;
    fclose(d.out);
    d.out = NULL;

    kvd_startv(&d, flags);
    c = kvd_client(&d, "llama", PAGE, LW_BB);
    lw_compare(c, 2 * LW_ROUND, before, "SIGKILL");
    kvt_client_close(c);
    kvd_cleanup(&d);
}

/* Three tenants' blocks in NVMe, then a restart with max-namespaces 2: recovery frees none of
 * them (the limit applies after it), every tenant finds its pages, and a new tenant is refused
 * while all three hold pages. */
Test(server_e2e, a_lowered_namespace_limit_keeps_what_nvme_recovers)
{
    kvd_t d = {0};
    kvd_start(&d, "--dram-bytes", "0", NULL);
    const char *tenants[3] = {"t1", "t2", "t3"};
    uint32_t tok[3][2 * PAGE];
    kvt_client_put_t r;
    for (int i = 0; i < 3; i++) {
        kvt_client_t *c = kvd_client(&d, tenants[i], PAGE, BB);
        kvd_tokens(tok[i], 2 * PAGE, 100 + (uint32_t)i);
        put_pages(c, tok[i], 2 * PAGE, 0, 2, BB, 30 + (uint32_t)i, &r);
        cr_assert_eq(r.stored, 2);
        kvt_client_close(c);
    }
    cr_assert_eq(kvd_stop(&d), 0, "clean shutdown");
    kvd_startv(&d, (const char *const[]){"--dram-bytes", "0", "--max-namespaces", "2", NULL});
    for (int i = 0; i < 3; i++) {
        kvt_client_t *c = kvd_client(&d, tenants[i], PAGE, BB);
        kvt_client_match_t m = {0};
        cr_assert_eq(kvt_client_match(c, tok[i], 2 * PAGE, KVT_CLIENT_LEASE, 0, NULL, &m), 0);
        cr_assert_eq(m.pages, 2, "tenant %d's pages came back", i + 1);
        kvd_check_get(c, m.lease, 0, 2, BB, 30 + (uint32_t)i, NULL);
        kvt_client_close(c);
    }
    kvt_client_t *n = NULL;
    cr_assert_eq(ns_connect(&d, "t4", &n), KVT_CLIENT_ENOSPC);
    kvd_cleanup(&d);
}

/*
 * A warm restart with index-bytes lowered below what NVMe brings back: the daemon drops the least
 * recently used recovered pages until the index is under the limit (counted, and freed in NVMe)
 * instead of refusing every new page for good, as it did. What is left reads back byte-exact,
 * and new prompts with payload keep being stored with the index under its limit.
 */
Test(server_e2e, a_lowered_index_limit_drops_what_nvme_recovers_past_it)
{
    enum { N = 40, P = 48, CAP = 96 << 10 };
    kvd_t d = {0};
    kvd_start(&d, "--dram-bytes", "0", "--nvme-bytes", "32M", NULL);
    kvt_client_t *c = kvd_client(&d, "m", PAGE, BB);
    static uint32_t tok[N][P * PAGE];
    kvt_client_put_t r;
    for (int i = 0; i < N; i++) {
        kvd_tokens(tok[i], P * PAGE, 300000u + 10000u * (uint32_t)i);
        put_pages(c, tok[i], P * PAGE, 0, P, BB, 1000u * (uint32_t)i, &r);
        cr_assert_eq(r.stored, P);
    }
    uint64_t before = kvd_stat(c, "index_bytes");
    cr_assert_gt(before, 2 * CAP, "the index to come back (%llu) is well over the new limit",
                 (unsigned long long)before);
    kvt_client_close(c);
    cr_assert_eq(kvd_stop(&d), 0, "clean shutdown");

    kvd_startv(&d, (const char *const[]){"--dram-bytes", "0", "--nvme-bytes", "32M",
                                         "--index-bytes", "96K", NULL});
    c = kvd_client(&d, "m", PAGE, BB);
    uint64_t bytes = UINT64_MAX;
    for (int i = 0; i < 500 && (bytes = kvd_stat(c, "index_bytes")) > CAP; i++)
        usleep(10000); /* the loop trims after its events and every tick */
    cr_assert_leq(bytes, (uint64_t)CAP, "the index came under index-bytes (%llu)",
                  (unsigned long long)bytes);
    uint64_t dropped = kvd_stat(c, "policy_index_drops"), left = kvd_stat(c, "nvme_blocks");
    cr_expect_gt(dropped, 0);
    cr_expect_eq(left + dropped, (uint64_t)N * P, "%llu left, %llu dropped",
                 (unsigned long long)left, (unsigned long long)dropped);
    uint32_t stored = 0;
    uint8_t tiers[P];
    for (int i = 0; i < N; i++) {
        kvt_client_match_t m = {.tiers = tiers, .tiers_cap = P};
        cr_assert_eq(
            kvt_client_match(c, tok[i], P * PAGE, KVT_CLIENT_LEASE | KVT_CLIENT_PROBE, 0, NULL, &m),
            0);
        uint32_t k = 0;
        while (k < m.pages && tiers[k] == KVT_CLIENT_TIER_NVME)
            k++;
        if (k > 0)
            kvd_check_get(c, m.lease, 0, k, BB, 1000u * (uint32_t)i, NULL);
        stored += k;
        if (m.lease)
            cr_assert_eq(kvt_client_release(c, m.lease, NULL), 0);
    }
    cr_expect_gt(stored, 0, "recovered pages still read back");
    for (int i = 0; i < N; i++) {
        uint32_t fresh[P * PAGE];
        kvd_tokens(fresh, P * PAGE, 900000u + 10000u * (uint32_t)i);
        put_pages(c, fresh, P * PAGE, 0, P, BB, 77, &r);
        cr_expect_eq(r.stored, P, "new prompt %d stored", i);
        cr_assert_leq(kvd_stat(c, "index_bytes"), (uint64_t)CAP);
    }
    kvt_client_close(c);
    kvd_cleanup(&d);
}

/* A data directory with nothing in it to recover (the first run stored no block): the second
 * start scans it, finds nothing, and serves. Sorting the empty list of what it found passed NULL
 * to qsort, which the ASan+UBSan build stopped the daemon on. */
Test(server_e2e, restart_on_a_data_dir_with_nothing_to_recover)
{
    kvd_t d = {0};
    kvd_start(&d, NULL);
    kvt_client_t *c = kvd_client(&d, "llama", PAGE, 0);
    cr_assert_eq(kvt_client_ping(c, NULL), 0);
    kvt_client_close(c);
    cr_assert_eq(kvd_stop(&d), 0, "clean shutdown");
    kvd_startv(&d, NULL);
    c = kvd_client(&d, "llama", PAGE, BB);
    uint32_t tok[2 * PAGE];
    kvd_tokens(tok, 2 * PAGE, 5);
    kvt_client_put_t r;
    put_pages(c, tok, 2 * PAGE, 0, 2, BB, 9, &r);
    cr_expect_eq(r.stored, 2);
    kvt_client_close(c);
    kvd_cleanup(&d);
}

typedef struct worker {
    const kvd_t *d;
    int id;
    int errors;
} worker_t;

static void *worker_main(void *arg)
{
    worker_t *w = arg;
    kvt_client_conf_t conf = {
        .unix_path = w->d->sock, .model = "m", .page_size = PAGE, .block_bytes = 1024};
    if (w->id % 2)
        conf.unix_path = NULL, conf.tcp = w->d->tcp;
    kvt_client_t *c;
    if (kvt_client_connect(&c, &conf) < 0) {
        w->errors++;
        return NULL;
    }
    uint32_t tok[4 * PAGE];
    uint8_t payload[4 * 1024], back[4 * 1024];
    for (int k = 0; k < 50; k++) {
        kvd_tokens(tok, 4 * PAGE, (uint32_t)(w->id * 100000 + k * 1000));
        kvd_fill(payload, sizeof payload, (uint32_t)(w->id * 1000 + k));
        kvt_client_put_t r;
        kvt_client_match_t m = {0};
        uint32_t got = 0;
        if (kvt_client_put(c, tok, 4 * PAGE, 0, 4, payload, NULL, &r) < 0 ||
            kvt_client_match(c, tok, 4 * PAGE, KVT_CLIENT_LEASE, 0, NULL, &m) < 0 || m.pages != 4 ||
            kvt_client_get(c, m.lease, 0, 4, back, sizeof back, &got, NULL) < 0 || got != 4 ||
            memcmp(back, payload, sizeof back) != 0 || kvt_client_release(c, m.lease, NULL) < 0)
            w->errors++;
    }
    kvt_client_close(c);
    return NULL;
}

Test(server_e2e, many_concurrent_clients)
{
    kvd_t d = {0};
    kvd_start(&d, NULL);
    enum { N = 24 };
    pthread_t th[N];
    worker_t w[N];
    for (int i = 0; i < N; i++) {
        w[i] = (worker_t){.d = &d, .id = i};
        pthread_create(&th[i], NULL, worker_main, &w[i]);
    }
    int errors = 0;
    for (int i = 0; i < N; i++) {
        pthread_join(th[i], NULL);
        errors += w[i].errors;
    }
    cr_expect_eq(errors, 0, "%d failed round trips", errors);
    kvt_client_t *c = kvd_client(&d, "m", PAGE, 1024);
    cr_expect_eq(kvd_stat(c, "index_blocks"), N * 50 * 4);
    cr_expect_eq(kvd_stat(c, "leases"), 0);
    kvt_client_close(c);
    kvd_cleanup(&d);
}

Test(server_e2e, shared_secret)
{
    kvd_t d = {0};
    kvd_start(&d, "--secret", "s3cret", NULL);
    kvt_client_conf_t conf = {.unix_path = d.sock, .model = "m", .page_size = PAGE};
    kvt_client_t *c = NULL;
    cr_expect_eq(kvt_client_connect(&c, &conf), KVT_CLIENT_EAUTH, "no AUTH first");
    conf.secret = "wrong";
    cr_expect_eq(kvt_client_connect(&c, &conf), KVT_CLIENT_EAUTH);
    conf.secret = "s3cret";
    cr_assert_eq(kvt_client_connect(&c, &conf), 0);
    cr_expect_eq(kvt_client_ping(c, NULL), 0);
    kvt_client_close(c);
    kvd_cleanup(&d);
}

/* TCP on every interface with no secret: the daemon starts, and warns that anyone who reaches
 * the port can use the cache; with a secret, or on loopback, it does not. */
Test(server_e2e, tcp_beyond_loopback_without_a_secret_is_warned_about)
{
    const char *warn = "reachable from other machines and no secret is set";
    char log[16384];
    kvd_t d = {0};
    kvd_start(&d, "--tcp", "0.0.0.0:0", NULL);
    kvd_slurp(&d, "kvtierd.log", log, sizeof log);
    cr_expect(strstr(log, warn), "%s", log);
    kvd_cleanup(&d);
    kvd_t e = {0};
    kvd_start(&e, "--tcp", "0.0.0.0:0", "--secret", "s3cret", NULL);
    kvd_slurp(&e, "kvtierd.log", log, sizeof log);
    cr_expect(!strstr(log, warn), "%s", log);
    kvd_cleanup(&e);
    kvd_t f = {0};
    kvd_start(&f, NULL); /* the test default, 127.0.0.1 */
    kvd_slurp(&f, "kvtierd.log", log, sizeof log);
    cr_expect(!strstr(log, warn), "%s", log);
    kvd_cleanup(&f);
}

Test(server_e2e, cli_reaches_default_socket_in_working_dir)
{
    kvd_t d = {0};
    kvd_start(&d, "--tcp", "", "--metrics", "", NULL);
    char cmd[2048];
    const char *root = kvd_build_root();
    snprintf(cmd, sizeof cmd,
             "cd '%s' && '%s/client/kvtier' --block-bytes 64 put 1-64 >out.txt 2>&1 && "
             "'%s/client/kvtier' match 1-70 >>out.txt 2>&1 && '%s/client/kvtier' ping >>out.txt && "
             "'%s/client/kvtier' stats >>out.txt",
             d.dir, root, root, root, root);
    cr_expect_eq(system(cmd), 0, "kvtier with no address flags reaches the daemon");
    char text[16384]; /* the counters STATS lists, then the hit-rate line */
    kvd_slurp(&d, "out.txt", text, sizeof text);
    cr_expect(strstr(text, "put 4 pages: 4 new, 4 stored"), "%s", text);
    cr_expect(strstr(text, "matched 64 of 70 tokens (4 pages)"), "%s", text);
    cr_expect(strstr(text, "pong"), "%s", text);
    cr_expect(strstr(text, "hit rate: 91.4% of 70 looked-up tokens (hbm 0.0%, dram 91.4%"), "%s",
              text);
    /* Options after the command, as people type them (bad numbers: cli_runs_the_benchmarks). */
    snprintf(cmd, sizeof cmd,
             "cd '%s' && '%s/client/kvtier' get 1-64 --block-bytes 64 --out got.bin >/dev/null",
             d.dir, root);
    cr_expect_eq(system(cmd), 0);
    uint8_t got[512];
    size_t n = 0;
    char path[700];
    snprintf(path, sizeof path, "%s/got.bin", d.dir);
    FILE *f = fopen(path, "rb");
    if (f) {
        n = fread(got, 1, sizeof got, f);
        fclose(f);
    }
    cr_expect_eq(n, 4 * 64, "four 64-byte pages read back");
    for (size_t i = 0; i < n; i++)
        cr_assert_eq(got[i], 0xab, "byte %zu", i);
    /* PREFETCH (with and without START) of pages in DRAM already, a bad tier name, and REMOVE
     * with --nowait of idle pages. */
    snprintf(cmd, sizeof cmd,
             "cd '%s' && K='%s/client/kvtier' && $K prefetch 1-64 >out.txt 2>&1 && "
             "$K prefetch 1-64 --start --deadline-ms 500 >>out.txt 2>&1 && "
             "! $K prefetch 1-64 --tier gpu >>out.txt 2>&1 && $K remove 1-64 --nowait >>out.txt "
             "2>&1 && $K match 1-64 >>out.txt 2>&1",
             d.dir, root);
    cr_expect_eq(system(cmd), 0);
    kvd_slurp(&d, "out.txt", text, sizeof text);
    cr_expect(strstr(text, "prefetch 4 pages to dram: 0 moved, 4 resident, 0 failed"), "%s", text);
    cr_expect(strstr(text, "prefetch 4 pages to dram: 0 on their way, 4 resident, 0 failed"), "%s",
              text);
    cr_expect(strstr(text, "--tier is hbm, dram or nvme, not 'gpu'"), "%s", text);
    cr_expect(strstr(text, "removed\nmatched 48 of 64 tokens (3 pages)"), "%s", text);
    kvd_cleanup(&d);
}

/* The command line's habits: --help and --version anywhere, unknown options named, -s/--socket
 * and --host/--port (the old --unix and --tcp still work), --json for stats and match (checked by
 * Python's own JSON parser), and stats every --interval for --count rounds. */
Test(server_e2e, cli_follows_common_habits)
{
    kvd_t d = {0};
    kvd_start(&d, "--metrics", "", NULL);
    char cmd[8192], text[16384];
    const char *root = kvd_build_root();
    const char *port = strrchr(d.tcp, ':') + 1;
    snprintf(
        cmd, sizeof cmd,
        "cd '%s' && K='%s/client/kvtier' && $K --version >out.txt && "
        "$K match 1-4 --version >>out.txt && $K stats -h >>out.txt && "
        "$K --block-bytes=64 -s '%s' put 1-64 >>out.txt && "
        "$K --socket '%s' match 1-70 --json >match.json && "
        "$K --unix '%s' -j stats >stats.json && "
        "$K -p %s ping >>out.txt && $K --host 127.0.0.1 --port=%s ping >>out.txt && "
        "$K --tcp %s ping >>out.txt && "
        "$K -s '%s' stats --interval 0.05 --count 3 --json >rounds.json && "
        "$K -s '%s' watch -i 0.05 -n 2 >>out.txt && "
        "python3 -c 'import json; m = json.load(open(\"match.json\")); "
        "assert m == {\"tokens\": 70, \"matched_tokens\": 64, \"pages\": 4, "
        "\"tiers\": [\"dram\"] * 4}, m; s = json.load(open(\"stats.json\")); "
        "assert s[\"lookup_tokens\"] == 70 and abs(s[\"hit_rate\"][\"dram\"] - 64 / 70) < 1e-5, "
        "s; r = [json.loads(l) for l in open(\"rounds.json\")]; "
        "assert len(r) == 3 and all(x[\"lookup_tokens\"] == 70 for x in r), r' 2>>out.txt",
        d.dir, root, d.sock, d.sock, d.sock, port, port, d.tcp, d.sock, d.sock);
    int st = system(cmd);
    kvd_slurp(&d, "out.txt", text, sizeof text);
    cr_expect_eq(st, 0, "%s", text);
    const char *head = "kvtier " KVT_VERSION "\nkvtier " KVT_VERSION "\nusage: kvtier";
    cr_expect(!strncmp(text, head, strlen(head)), "--version and -h anywhere: %s", text);
    cr_expect(strstr(text, "put 4 pages: 4 new, 4 stored"), "%s", text);
    const char *pong = strstr(text, "pong");
    cr_expect(pong && (pong = strstr(pong + 1, "pong")) && strstr(pong + 1, "pong"),
              "three pings over TCP: %s", text);
    const char *round = strstr(text, "\n--- ");
    cr_expect(round && strstr(round + 1, "\n--- ") && strstr(text, "hit rate: 91.4%"),
              "watch: two rounds, each with a time line: %s", text);
    /* Usage errors: named, exit 2, before any daemon is asked. */
    static const struct {
        const char *args, *says;
    } bad[] = {
        {"--frobnicate ping", "unknown option '--frobnicate'"},
        {"ping -x", "unknown option '-x'"},
        {"ping --block-bytes", "--block-bytes needs a value"},
        {"-b abc ping", "-b takes a number"},
        {"ping --json", "--json is for stats, watch and match"},
        {"stats --interval 0", "--interval takes seconds"},
        {"stats --count 2", "--count goes with --interval"},
        {"ping --interval 1", "--interval and --count are for stats and watch"},
        {"--tcp 127.0.0.1:1 -p 2 ping", "not both"},
    };
    for (size_t k = 0; k < sizeof bad / sizeof *bad; k++) {
        snprintf(cmd, sizeof cmd, "cd '%s' && '%s/client/kvtier' %s >/dev/null 2>err.txt", d.dir,
                 root, bad[k].args);
        st = system(cmd);
        kvd_slurp(&d, "err.txt", text, sizeof text);
        cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 2, "kvtier %s: exit %d", bad[k].args,
                  WEXITSTATUS(st));
        cr_expect(strstr(text, bad[k].says), "kvtier %s: %s", bad[k].args, text);
    }
    kvd_cleanup(&d);
}

/* kvtier bench NAME runs bench/'s benchmark of that name: here the radix one on a three-prompt
 * trace, whose hit tokens are known (the second prompt repeats the first's 1,000 tokens, 62
 * whole pages of 16), and the NVMe restart one on 300 blocks. */
Test(server_e2e, cli_runs_the_benchmarks)
{
    kvd_t d = {0};
    kvd_mkdir(&d);
    char path[700], cmd[2048], text[8192] = "";
    snprintf(path, sizeof path, "%s/tiny.jsonl", d.dir);
    FILE *f = fopen(path, "w");
    cr_assert(f);
    fputs(
        "{\"timestamp\": 0, \"input_length\": 1000, \"output_length\": 10, \"hash_ids\": [0, 1]}\n"
        "{\"timestamp\": 5, \"input_length\": 1500, \"output_length\": 10, \"hash_ids\": [0, 1, "
        "2]}\n"
        "{\"timestamp\": 9, \"input_length\": 700, \"output_length\": 10, \"hash_ids\": [3, 4]}\n",
        f);
    fclose(f);
    const char *root = kvd_build_root();
    snprintf(cmd, sizeof cmd,
             "cd '%s' && '%s/client/kvtier' bench radix tiny.jsonl --page-size 16 --passes 1 "
             ">out.json 2>err.txt",
             d.dir, root);
    cr_assert_eq(system(cmd), 0, "kvtier bench radix runs bench_radix");
    kvd_slurp(&d, "out.json", text, sizeof text);
    cr_expect(strstr(text, "\"trace\":\"tiny\""), "%s", text);
    cr_expect(strstr(text, "\"requests\":3,"), "%s", text);
    cr_expect(strstr(text, "\"hit_tokens\":992,"), "%s", text);
    cr_expect(strstr(text, "\"ratio\":"), "%s", text);
    /* And the NVMe warm restart one, small. */
    snprintf(cmd, sizeof cmd,
             "cd '%s' && '%s/client/kvtier' bench recover --dir . --blocks 300 --idle 200 "
             "--rounds 1 >out.json 2>err.txt",
             d.dir, root);
    cr_assert_eq(system(cmd), 0, "kvtier bench recover runs bench_recover");
    kvd_slurp(&d, "out.json", text, sizeof text);
    cr_expect(strstr(text, "\"bench\":\"nvme_recover\",\"blocks\":300,"), "%s", text);
    cr_expect(strstr(text, "\"ratio\":"), "%s", text);

    snprintf(cmd, sizeof cmd, "'%s/client/kvtier' bench nosuch >/dev/null 2>&1", root);
    int st = system(cmd);
    cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 2, "unknown benchmark: exit %d", WEXITSTATUS(st));
    /* Usage errors are told before any daemon is asked (none listens at this socket). */
    static const char *const bad[] = {"match",
                                      "put 1-x",
                                      "frob",
                                      "--page abc match 1-4",
                                      "match 1-4 --block-bytes -1",
                                      "ping x",
                                      "put 1-16 --fill 300"};
    for (size_t k = 0; k < sizeof bad / sizeof *bad; k++) {
        snprintf(cmd, sizeof cmd, "'%s/client/kvtier' --unix /nonexistent.sock %s >/dev/null 2>&1",
                 root, bad[k]);
        st = system(cmd);
        cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 2, "kvtier %s: exit %d", bad[k],
                  WEXITSTATUS(st));
    }
    kvd_cleanup(&d);
}

Test(server_e2e, bad_configuration_exit_codes)
{
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "'%s' --dram-bytes lots >/dev/null 2>&1", kvd_binary());
    int st = system(cmd);
    cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 64, "bad value: exit %d", WEXITSTATUS(st));
    snprintf(cmd, sizeof cmd, "'%s' --no-such-setting 1 >/dev/null 2>&1", kvd_binary());
    st = system(cmd);
    cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 64, "unknown flag: exit %d", WEXITSTATUS(st));
    kvd_t d = {0};
    kvd_mkdir(&d);
    char conf[700];
    snprintf(conf, sizeof conf, "%s/bad.conf", d.dir);
    FILE *f = fopen(conf, "w");
    fprintf(f, "# a comment\ndram-bytes = 1M\nthis line has no equals sign\n");
    fclose(f);
    snprintf(cmd, sizeof cmd, "cd '%s' && '%s' --config bad.conf 2>err.txt >/dev/null", d.dir,
             kvd_binary());
    st = system(cmd);
    cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 64, "bad file: exit %d", WEXITSTATUS(st));
    /* A port in use: 69, and nothing left behind. */
    kvd_t a = {0};
    kvd_start(&a, NULL);
    snprintf(cmd, sizeof cmd,
             "cd '%s' && '%s' --unix x.sock --nvme-bytes 0 --hbm-bytes 0 --metrics '' --tcp '%s' "
             ">/dev/null 2>&1",
             d.dir, kvd_binary(), a.tcp);
    st = system(cmd);
    cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 69, "port in use: exit %d", WEXITSTATUS(st));
    char sock[700];
    snprintf(sock, sizeof sock, "%s/x.sock", d.dir);
    struct stat sb;
    cr_expect(stat(sock, &sb) < 0, "no socket left after a failed start");
    /* A second daemon on a running one's data-dir (another socket, no ports): 69, and it says
     * why; the first goes on serving. */
    snprintf(cmd, sizeof cmd,
             "cd '%s' && '%s' --unix y.sock --metrics '' --tcp '' --dram-bytes 16M "
             "--nvme-bytes 8M --nvme-segment-bytes 1M --hbm-bytes 0 2>err2.txt >/dev/null",
             a.dir, kvd_binary());
    st = system(cmd);
    cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 69, "data-dir in use: exit %d", WEXITSTATUS(st));
    char err[4096];
    kvd_slurp(&a, "err2.txt", err, sizeof err);
    cr_expect(strstr(err, "in use by another process"), "%s", err);
    kvt_client_t *c = kvd_client(&a, "m", 16, 0);
    cr_expect_eq(kvt_client_ping(c, NULL), 0);
    kvt_client_close(c);
    kvd_cleanup(&a);
    kvd_rmrf(d.dir);
}

/* Replaces data-dir file `name` of d with len bytes of content (at offset 0 over what is there
 * when keep is set), or removes it when content is NULL. */
static void damage(const kvd_t *d, const char *name, const char *content, size_t len, int keep)
{
    char path[700];
    snprintf(path, sizeof path, "%s/kvtier-data/%s", d->dir, name);
    if (!content) {
        cr_assert_eq(unlink(path), 0, "%s: %s", path, strerror(errno));
        return;
    }
    int fd = open(path, O_WRONLY | O_CREAT | (keep ? 0 : O_TRUNC), 0600);
    cr_assert(fd >= 0, "%s: %s", path, strerror(errno));
    cr_assert_eq(pwrite(fd, content, len, 0), (ssize_t)len);
    close(fd);
}

/*
 * A damaged side file of the NVMe tier stops the daemon (69) with a message that names the file,
 * says what is wrong with it and how to start afresh: an empty, garbled or missing kvtier.meta, a
 * damaged or missing kvtier.live, a data file truncated to zero. They used to end in "nvme-bytes
 * must hold at least 2 segments", with settings that were fine.
 */
Test(server_e2e, damaged_nvme_side_files_are_named)
{
    kvd_t d = {0};
    kvd_start(&d, NULL);
    cr_assert_eq(kvd_stop(&d), 0);
    char meta[256], cmd[2048], err[8192];
    kvd_slurp(&d, "kvtier-data/kvtier.meta", meta, sizeof meta);
    static const struct {
        const char *file, *content;
        size_t len;
        int keep;
        const char *says;
    } cases[] = {
        {"kvtier.meta", "", 0, 0, "kvtier.meta is empty"},
        {"kvtier.meta", "\x01kvtier-nvme v2 junk\n", 20, 0, "kvtier.meta is damaged"},
        {"kvtier.meta", NULL, 0, 0, "kvtier.meta is missing"},
        {"kvtier.data", "", 0, 0, "kvtier.data is 0 bytes long"},
        /* These three in this order: each damages what the one before left. */
        {"kvtier.live", "garbage!", 8, 1, "kvtier.live is damaged"},
        {"kvtier.live", "garbage!", 8, 0, "kvtier.live is 8 bytes long"},
        {"kvtier.live", NULL, 0, 0, "kvtier.live is missing"},
    };
    char data[700];
    snprintf(data, sizeof data, "%s/kvtier-data/kvtier.data", d.dir);
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
        /* What the case before damaged is whole again (the data file's size, at least). */
        damage(&d, "kvtier.meta", meta, strlen(meta), 0);
        cr_assert_eq(truncate(data, 8 << 20), 0);
        damage(&d, cases[k].file, cases[k].content, cases[k].len, cases[k].keep);
        snprintf(cmd, sizeof cmd,
                 "cd '%s' && timeout -s KILL 20 '%s' --unix x.sock --tcp '' --metrics '' "
                 "--dram-bytes 16M --nvme-bytes 8M --nvme-segment-bytes 1M --hbm-bytes 0 2>err.txt "
                 ">/dev/null",
                 d.dir, kvd_binary());
        int st = system(cmd); /* a daemon that starts is killed after 20 s: exit 137 */
        cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 69, "%s: exit %d", cases[k].says,
                  WEXITSTATUS(st));
        kvd_slurp(&d, "err.txt", err, sizeof err);
        cr_expect(strstr(err, cases[k].says), "wanted \"%s\" in: %s", cases[k].says, err);
        cr_expect(strstr(err, "To start afresh"), "%s", err);
        cr_expect(strstr(err, "kvtier.live from kvtier-data"), "the directory is named: %s", err);
        cr_expect(!strstr(err, "at least 2 segments"), "%s", err);
    }
    /* Whole files made with other settings: those are named, and no hint about the size. */
    damage(&d, "kvtier.meta", meta, strlen(meta), 0);
    snprintf(cmd, sizeof cmd,
             "cd '%s' && timeout -s KILL 20 '%s' --unix x.sock --tcp '' --metrics '' "
             "--dram-bytes 16M --nvme-bytes 16M --nvme-segment-bytes 1M --hbm-bytes 0 2>err.txt "
             ">/dev/null",
             d.dir, kvd_binary());
    int st = system(cmd);
    cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 69, "other geometry: exit %d", WEXITSTATUS(st));
    kvd_slurp(&d, "err.txt", err, sizeof err);
    cr_expect(strstr(err, "was made with 8 segments of 1048576 bytes, not the 16"), "%s", err);
    cr_expect(!strstr(err, "at least 2 segments"), "%s", err);
    kvd_cleanup(&d);
}

Test(server_e2e, example_configuration_starts)
{
    char conf[1024];
    /* meson test sets $KVT_SOURCE_ROOT; run by hand, the test finds the source tree it was
     * configured from (config.h). */
    const char *src = getenv("KVT_SOURCE_ROOT");
    snprintf(conf, sizeof conf, "%s/kvtierd.conf.example", src && *src ? src : KVT_SOURCE_ROOT);
    kvd_t d = {0};
    /* The example at its defaults, but on free ports and with small tiers for a test. */
    kvd_start(&d, "--config", conf, "--tcp", "127.0.0.1:0", "--metrics", "127.0.0.1:0",
              "--dram-bytes", "8M", "--nvme-bytes", "4M", "--nvme-segment-bytes", "1M", NULL);
    kvt_client_t *c = kvd_client(&d, "m", PAGE, 0);
    cr_expect_eq(kvt_client_ping(c, NULL), 0);
    cr_expect_eq(kvd_stat(c, "dram_capacity_bytes"), 8 << 20, "the flag beats the file");
    kvt_client_close(c);
    kvd_cleanup(&d);
}

Test(server_e2e, four_tiers_with_host_hbm)
{
    /* HBM's host backend (ordinary memory standing in for device memory): blocks fill HBM,
     * then DRAM, then NVMe, each within its capacity, and all read back. */
    kvd_t d = {0};
    kvd_start(&d, "--hbm-backend", "host", "--hbm-bytes", "512K", "--dram-bytes", "512K", NULL);
    kvt_client_t *c = kvd_client(&d, "m", PAGE, BIG);
    enum { N = 24 };
    uint32_t tok[N * PAGE];
    kvd_tokens(tok, N * PAGE, 5);
    kvt_client_put_t r;
    put_pages(c, tok, N * PAGE, 0, N, BIG, 9, &r);
    cr_expect_eq(r.stored, N);
    uint8_t tiers[N], from[N];
    kvt_client_match_t m = {.tiers = tiers, .tiers_cap = N};
    cr_assert_eq(kvt_client_match(c, tok, N * PAGE, KVT_CLIENT_LEASE, 0, NULL, &m), 0);
    cr_assert_eq(m.pages, N);
    cr_expect_eq(tiers[0], KVT_CLIENT_TIER_HBM);
    cr_expect_eq(tiers[N - 1], KVT_CLIENT_TIER_NVME);
    int seen[5] = {0};
    for (int i = 0; i < N; i++)
        seen[tiers[i] < 5 ? tiers[i] : 0]++;
    cr_expect(seen[KVT_CLIENT_TIER_HBM] > 0 && seen[KVT_CLIENT_TIER_DRAM] > 0 &&
              seen[KVT_CLIENT_TIER_NVME] > 0);
    for (int i = 1; i < N; i++)
        cr_expect_geq(tiers[i], tiers[i - 1], "faster tiers first along the path");
    cr_expect_leq(kvd_stat(c, "hbm_used_bytes"), kvd_stat(c, "hbm_capacity_bytes"));
    cr_expect_leq(kvd_stat(c, "dram_used_bytes"), kvd_stat(c, "dram_capacity_bytes"));
    kvd_check_get(c, m.lease, 0, N, BIG, 9, from);
    cr_expect_eq(from[0], KVT_CLIENT_TIER_HBM);
    kvt_client_close(c);
    kvd_cleanup(&d);
}

Test(server_e2e, large_get_in_batches_and_disconnect_mid_get)
{
    /* 40 pages of 256 KiB = 10 MiB in one GET: more than one 8 MiB batch. */
    enum { N = 40, B = 256 << 10 };
    kvd_t d = {0};
    kvd_start(&d, "--dram-bytes", "64M", NULL);
    kvt_client_t *c = kvd_client(&d, "m", PAGE, B);
    uint32_t tok[N * PAGE];
    kvd_tokens(tok, N * PAGE, 77);
    kvt_client_put_t r;
    put_pages(c, tok, N * PAGE, 0, N, B, 3, &r);
    cr_assert_eq(r.stored, N);
    kvt_client_match_t m = {0};
    cr_assert_eq(kvt_client_match(c, tok, N * PAGE, KVT_CLIENT_LEASE, 0, NULL, &m), 0);
    kvd_check_get(c, m.lease, 0, N, B, 3, NULL);
    kvd_check_get(c, m.lease, 0, N, B, 3, NULL);

    /* A client that asks for all of it and goes away without reading: the daemon drops the
     * GET, its lease and its read counts, and the blocks can be removed afterwards. */
    for (int k = 0; k < 3; k++) {
        int fd = kvd_raw(&d);
        uint8_t f[KVT_PROTO_HDR + sizeof(kvt_wire_match_t) + N * PAGE * 4];
        kvt_wire_hello_t hw = {.min_version = 1,
                               .max_version = 1,
                               .page_size = PAGE,
                               .block_bytes = B,
                               .model_len = 1};
        kvt_proto_frame(f, KVT_OP_HELLO, 0, 1, 0, sizeof hw + 1);
        memcpy(f + KVT_PROTO_HDR, &hw, sizeof hw);
        f[KVT_PROTO_HDR + sizeof hw] = 'm';
        cr_assert(write(fd, f, KVT_PROTO_HDR + sizeof hw + 1) > 0);
        kvt_wire_match_t mw = {.ntokens = N * PAGE};
        kvt_proto_frame(f, KVT_OP_MATCH, KVT_MATCH_F_LEASE, 2, 0, sizeof mw + N * PAGE * 4);
        memcpy(f + KVT_PROTO_HDR, &mw, sizeof mw);
        memcpy(f + KVT_PROTO_HDR + sizeof mw, tok, sizeof tok);
        cr_assert(write(fd, f, sizeof f) == (ssize_t)sizeof f);
        /* The HELLO reply (48 bytes) and the MATCH reply (24 + 24 + N) carry the lease. */
        uint8_t in[48 + 48 + N];
        size_t got = 0;
        while (got < sizeof in) {
            ssize_t n = read(fd, in + got, sizeof in - got);
            cr_assert(n > 0);
            got += (size_t)n;
        }
        uint64_t lease = kvt_get_u64(in + 48 + KVT_PROTO_HDR + 8);
        cr_assert_neq(lease, 0);
        kvt_wire_get_t gw = {.lease = lease};
        kvt_proto_frame(f, KVT_OP_GET, 0, 3, 0, sizeof gw);
        memcpy(f + KVT_PROTO_HDR, &gw, sizeof gw);
        cr_assert(write(fd, f, KVT_PROTO_HDR + sizeof gw) > 0);
        usleep(20000 * (k + 1)); /* the daemon is blocked on this socket by now */
        close(fd);
    }
    cr_assert_eq(kvt_client_release(c, m.lease, NULL), 0);
    uint64_t leases = 1;
    for (int i = 0; i < 1000 && leases; i++) { /* up to 5 s */
        usleep(5000);
        leases = kvd_stat(c, "leases");
    }
    cr_expect_eq(leases, 0, "no lease left behind by the abandoned GETs");
    cr_expect_eq(kvt_client_remove(c, tok, PAGE), 0, "nothing pins the blocks any more");
    kvt_client_close(c);
    kvd_cleanup(&d);
}

/* Reads one frame's header and body (up to cap bytes of it) from fd. */
static void read_frame(int fd, kvt_proto_hdr_t *h, uint8_t *body, size_t cap)
{
    uint8_t hdr[KVT_PROTO_HDR];
    cr_assert_eq(read_full(fd, hdr, sizeof hdr), 0, "the reply ended early");
    kvt_proto_hdr_decode(hdr, h);
    cr_assert_leq(h->body_len, cap);
    cr_assert_eq(read_full(fd, body, h->body_len), 0, "the reply ended early");
}

/* A pipeline of GETs whose pages are in memory leaves in a few writev calls, not one or two per
 * GET (conn.c: a GET's last batch goes with its final frame, and the replies after it join the
 * same write), with every reply whole and in order, an error reply and a PING's among them. */
Test(server_e2e, a_pipeline_of_gets_leaves_in_a_few_writes)
{
    enum { N = 16, BAD = 8 };
    kvd_t d = {0};
    kvd_start(&d, NULL);
    kvt_client_t *c = kvd_client(&d, "m", PAGE, BB);
    uint32_t tok[N * PAGE];
    kvd_tokens(tok, N * PAGE, 91);
    kvt_client_put_t pr;
    put_pages(c, tok, N * PAGE, 0, N, BB, 9, &pr);
    cr_assert_eq(pr.stored, N);

    int fd = kvd_raw(&d);
    uint8_t f[KVT_PROTO_HDR + sizeof(kvt_wire_match_t) + N * PAGE * 4];
    kvt_wire_hello_t hw = {
        .min_version = 1, .max_version = 1, .page_size = PAGE, .block_bytes = BB, .model_len = 1};
    kvt_proto_frame(f, KVT_OP_HELLO, 0, 1, 0, sizeof hw + 1);
    memcpy(f + KVT_PROTO_HDR, &hw, sizeof hw);
    f[KVT_PROTO_HDR + sizeof hw] = 'm';
    cr_assert(write(fd, f, KVT_PROTO_HDR + sizeof hw + 1) > 0);
    kvt_wire_match_t mw = {.ntokens = N * PAGE};
    kvt_proto_frame(f, KVT_OP_MATCH, KVT_MATCH_F_LEASE, 2, 0, sizeof mw + N * PAGE * 4);
    memcpy(f + KVT_PROTO_HDR, &mw, sizeof mw);
    memcpy(f + KVT_PROTO_HDR + sizeof mw, tok, sizeof tok);
    cr_assert(write(fd, f, sizeof f) == (ssize_t)sizeof f);
    static uint8_t body[BB + 4096];
    kvt_proto_hdr_t h;
    read_frame(fd, &h, body, sizeof body); /* HELLO's */
    read_frame(fd, &h, body, sizeof body); /* MATCH's, with the lease */
    cr_assert_eq(h.status, 0);
    uint64_t lease = kvt_get_u64(body + 8);
    cr_assert_neq(lease, 0);

    /* N GETs of one page each (one with a lease this connection does not hold), then a PING,
     * in one write. */
    uint8_t frames[(N + 1) * (KVT_PROTO_HDR + sizeof(kvt_wire_get_t))];
    size_t len = 0;
    for (uint32_t i = 0; i < N; i++) {
        kvt_wire_get_t gw = {
            .lease = i == BAD ? lease + 1000 : lease, .first_page = i, .npages = 1};
        kvt_proto_frame(frames + len, KVT_OP_GET, 0, 100 + i, 0, sizeof gw);
        memcpy(frames + len + KVT_PROTO_HDR, &gw, sizeof gw);
        len += KVT_PROTO_HDR + sizeof gw;
    }
    kvt_proto_frame(frames + len, KVT_OP_PING, 0, 200, 0, 0);
    len += KVT_PROTO_HDR;
    double before = kvd_metric(&d, "kvtier_socket_writes_total");
    cr_assert_geq(before, 1, "kvtier_socket_writes_total is served");
    cr_assert_eq(write(fd, frames, len), (ssize_t)len);

    uint8_t *want = malloc(BB);
    for (uint32_t i = 0; i < N; i++) {
        read_frame(fd, &h, body, sizeof body);
        cr_assert_eq(h.request_id, 100 + i, "replies in request order");
        if (i == BAD) {
            cr_assert_eq(h.status, KVT_ENOENT, "GET %u: the lease is not held", i);
            continue;
        }
        cr_assert_eq(h.status, 0);
        cr_assert(h.flags & KVT_RF_MORE, "GET %u: a data frame first", i);
        cr_assert_eq(h.body_len, sizeof(kvt_wire_get_data_t) + BB);
        cr_assert_eq(kvt_get_u32(body), i, "GET %u: its page", i);
        kvd_fill(want, BB, 9 + i);
        cr_assert(memcmp(body + sizeof(kvt_wire_get_data_t), want, BB) == 0, "page %u differs", i);
        read_frame(fd, &h, body, sizeof body);
        cr_assert_eq(h.request_id, 100 + i);
        cr_assert_eq(h.status, 0);
        cr_assert_eq(h.flags & KVT_RF_MORE, 0, "GET %u: then its final frame", i);
        cr_assert_eq(h.body_len, sizeof(kvt_wire_get_end_t));
        cr_assert_eq(kvt_get_u32(body), 1, "GET %u: one page sent", i);
    }
    read_frame(fd, &h, body, sizeof body);
    cr_assert_eq(h.request_id, 200, "the PING's reply last");
    cr_assert_eq(h.opcode, KVT_OP_PING | KVT_OP_REPLY);
    free(want);
    /* 15 GETs of 8 KiB, an error and a PING: 47 pieces, 124 KiB, one writev when the socket
     * takes it all (its buffer is 208 KiB); a few when the reader lags. One per GET before. */
    double writes = kvd_metric(&d, "kvtier_socket_writes_total") - before;
    cr_expect_leq(writes, 4, "%g writes for %d GETs", writes, N);
    cr_expect_geq(writes, 1);
    close(fd);
    kvt_client_close(c);
    kvd_cleanup(&d);
}

/* A GET of more than one 8 MiB batch with a PING and a one-page GET behind it in the same write:
 * a batch that is not the last stops the write (its next one is built when the socket has taken
 * it), and the replies after the last one follow whole and in order. */
Test(server_e2e, a_multi_batch_get_then_more_requests_in_one_write)
{
    enum { N = 40, B = 256 << 10 };
    kvd_t d = {0};
    kvd_start(&d, "--dram-bytes", "64M", NULL);
    kvt_client_t *c = kvd_client(&d, "m", PAGE, B);
    static uint32_t tok[N * PAGE];
    kvd_tokens(tok, N * PAGE, 55);
    kvt_client_put_t pr;
    put_pages(c, tok, N * PAGE, 0, N, B, 4, &pr);
    cr_assert_eq(pr.stored, N);

    int fd = kvd_raw(&d);
    static uint8_t f[KVT_PROTO_HDR + sizeof(kvt_wire_match_t) + N * PAGE * 4];
    kvt_wire_hello_t hw = {
        .min_version = 1, .max_version = 1, .page_size = PAGE, .block_bytes = B, .model_len = 1};
    kvt_proto_frame(f, KVT_OP_HELLO, 0, 1, 0, sizeof hw + 1);
    memcpy(f + KVT_PROTO_HDR, &hw, sizeof hw);
    f[KVT_PROTO_HDR + sizeof hw] = 'm';
    cr_assert(write(fd, f, KVT_PROTO_HDR + sizeof hw + 1) > 0);
    kvt_wire_match_t mw = {.ntokens = N * PAGE};
    kvt_proto_frame(f, KVT_OP_MATCH, KVT_MATCH_F_LEASE, 2, 0, sizeof mw + N * PAGE * 4);
    memcpy(f + KVT_PROTO_HDR, &mw, sizeof mw);
    memcpy(f + KVT_PROTO_HDR + sizeof mw, tok, sizeof tok);
    cr_assert(write(fd, f, sizeof f) == (ssize_t)sizeof f);
    static uint8_t body[B + 4096];
    kvt_proto_hdr_t h;
    read_frame(fd, &h, body, sizeof body);
    read_frame(fd, &h, body, sizeof body);
    cr_assert_eq(h.status, 0);
    uint64_t lease = kvt_get_u64(body + 8);
    cr_assert_neq(lease, 0);

    /* All N pages (two batches), a PING, then page 3 alone. */
    uint8_t frames[3 * (KVT_PROTO_HDR + sizeof(kvt_wire_get_t))];
    size_t len = 0;
    kvt_wire_get_t all = {.lease = lease}, one = {.lease = lease, .first_page = 3, .npages = 1};
    kvt_proto_frame(frames, KVT_OP_GET, 0, 10, 0, sizeof all);
    memcpy(frames + KVT_PROTO_HDR, &all, sizeof all);
    len += KVT_PROTO_HDR + sizeof all;
    kvt_proto_frame(frames + len, KVT_OP_PING, 0, 11, 0, 0);
    len += KVT_PROTO_HDR;
    kvt_proto_frame(frames + len, KVT_OP_GET, 0, 12, 0, sizeof one);
    memcpy(frames + len + KVT_PROTO_HDR, &one, sizeof one);
    len += KVT_PROTO_HDR + sizeof one;
    cr_assert_eq(write(fd, frames, len), (ssize_t)len);

    uint8_t *want = malloc(B);
    for (uint32_t p = 0; p < N; p++) {
        read_frame(fd, &h, body, sizeof body);
        cr_assert_eq(h.request_id, 10);
        cr_assert_eq(h.status, 0);
        cr_assert(h.flags & KVT_RF_MORE);
        cr_assert_eq(kvt_get_u32(body), p, "pages in order");
        kvd_fill(want, B, 4 + p);
        cr_assert(memcmp(body + sizeof(kvt_wire_get_data_t), want, B) == 0, "page %u differs", p);
    }
    read_frame(fd, &h, body, sizeof body);
    cr_assert_eq(h.request_id, 10);
    cr_assert_eq(h.flags & KVT_RF_MORE, 0, "the final frame after the last page");
    cr_assert_eq(kvt_get_u32(body), N);
    read_frame(fd, &h, body, sizeof body);
    cr_assert_eq(h.request_id, 11, "then the PING's reply");
    read_frame(fd, &h, body, sizeof body);
    cr_assert_eq(h.request_id, 12);
    cr_assert_eq(kvt_get_u32(body), 3);
    kvd_fill(want, B, 4 + 3);
    cr_assert(memcmp(body + sizeof(kvt_wire_get_data_t), want, B) == 0);
    read_frame(fd, &h, body, sizeof body);
    cr_assert_eq(h.request_id, 12);
    cr_assert_eq(h.flags & KVT_RF_MORE, 0);
    cr_assert_eq(kvt_get_u32(body), 1);
    free(want);
    close(fd);
    kvt_client_close(c);
    kvd_cleanup(&d);
}

/* Anonymous huge pages kvtierd holds (AnonHugePages of its smaps_rollup), in kB. */
static long kvd_huge_kb(const kvd_t *d)
{
    char path[64], line[256];
    snprintf(path, sizeof path, "/proc/%d/smaps_rollup", (int)d->pid);
    FILE *f = fopen(path, "r");
    cr_assert(f, "%s: %s", path, strerror(errno));
    long huge_kb = -1;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "AnonHugePages: %ld kB", &huge_kb) == 1)
            break;
    fclose(f);
    return huge_kb;
}

/* Puts ~2M tokens of index (tens of MiB) into d and returns its log. */
static void kvd_fill_index(kvd_t *d, char *log, size_t cap)
{
    kvt_client_t *c = kvd_client(d, "thp", PAGE, 0);
    enum { PROMPT = 128 * PAGE };
    static uint32_t tok[PROMPT];
    kvt_client_put_t r;
    for (uint32_t i = 0; i < 1000; i++) {
        kvd_tokens(tok, PROMPT, 1000 + i);
        cr_assert_eq(kvt_client_put(c, tok, PROMPT, 0, 0, NULL, NULL, &r), 0);
    }
    kvt_client_close(c);
    kvd_slurp(d, "kvtierd.log", log, cap);
}

/* kvtierd's heap (the index's memory) follows the kernel's transparent huge page setting and
 * says so at start-up (server/main.c): huge pages faulted in as the index grew stopped the loop
 * for tens of ms. */
Test(server_e2e, index_heap_follows_the_kernel)
{
    static char log[16384];
    kvd_t d = {0};
    cr_assert_eq(unsetenv("MALLOC_CONF"), 0);
    kvd_start(&d, "--log-level", "info", NULL);
    kvd_fill_index(&d, log, sizeof log);
    cr_expect(strstr(log, "heap: jemalloc, transparent huge pages default"), "log:\n%s", log);
    kvd_cleanup(&d);
}

/* MALLOC_CONF=thp:always opts in: after a few MiB of index the daemon holds anonymous huge
 * pages. Skipped where the kernel has them off. */
Test(server_e2e, index_heap_on_huge_pages_when_asked)
{
    thp_skip_unless_on();
    static char log[16384];
    kvd_t d = {0};
    cr_assert_eq(setenv("MALLOC_CONF", "thp:always", 1), 0);
    kvd_start(&d, "--log-level", "info", NULL);
    cr_assert_eq(unsetenv("MALLOC_CONF"), 0);
    kvd_fill_index(&d, log, sizeof log);
    cr_expect(strstr(log, "heap: jemalloc, transparent huge pages always"), "log:\n%s", log);
    long huge_kb = kvd_huge_kb(&d);
    cr_expect_gt(huge_kb, 0, "kvtierd holds %ld kB of anonymous huge pages", huge_kb);
    kvd_cleanup(&d);
}
