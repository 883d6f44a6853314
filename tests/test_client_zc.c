/*
 * test_client_zc.c: libkvtier's zero-copy path against the real daemon. A client on the Unix
 * socket maps its namespace's DRAM arena and one over TCP does not (and still works); pages put
 * through RESERVE/COMMIT come back byte-exact to other clients, mapped or not; get_cb hands out
 * pointers into the mapping and get_loc the offsets; an aborted reservation, an unknown one and
 * a client that dies mid-write leave nothing visible and the DRAM usage back; a PUT of pages
 * already held sends no payload; a GET whose lease may have run out before the mapped bytes were
 * read fails with ETIMEDOUT; plain and zero-copy PUTs answer alike.
 */
#include <stdint.h>
#include <time.h>

#include "test_server_harness.h"

#define PAGE 16
#define BB   65536 /* block bytes */

static kvt_client_t *zc_client(const kvd_t *d, const char *model, int zero_copy)
{
    return kvd_client_map(d, model, PAGE, BB, zero_copy);
}

static void zc_start(kvd_t *d)
{
    kvd_start(d, NULL);
}

/* The tier of each of the first n pages of tokens (probe: no use counted). */
static void tiers_of(kvt_client_t *c, const uint32_t *tok, uint32_t ntok, uint8_t *tiers,
                     uint32_t n)
{
    kvt_client_match_t m = {.tiers = tiers, .tiers_cap = n};
    memset(tiers, 0xff, n);
    cr_assert_eq(kvt_client_match(c, tok, ntok, KVT_CLIENT_PROBE, 0, NULL, &m), 0);
    cr_assert_eq(m.pages, n, "%u pages in the index, not %u", m.pages, n);
}

static uint8_t *block_buf(uint32_t pages, uint32_t seed)
{
    uint8_t *p = malloc((size_t)pages * BB);
    cr_assert(p);
    kvd_fill(p, (size_t)pages * BB, seed);
    return p;
}

Test(client_zc, unix_maps_tcp_falls_back_and_both_work)
{
    kvd_t d = {0};
    zc_start(&d);
    kvt_client_t *u = zc_client(&d, "m", 1);
    uint64_t bytes;
    const void *map = kvt_client_mapping(u, &bytes);
    cr_expect(map != NULL && bytes >= BB, "a mapping of %llu bytes", (unsigned long long)bytes);
    cr_expect_str_empty(kvt_client_zero_copy_reason(u));

    kvt_client_conf_t conf = {.tcp = d.tcp,
                              .model = "m",
                              .page_size = PAGE,
                              .block_bytes = BB,
                              .timeout_ms = 10000,
                              .zero_copy = 1};
    kvt_client_t *t = NULL;
    cr_assert_eq(kvt_client_connect(&t, &conf), 0);
    cr_expect_eq(kvt_client_zero_copy(t), 0);
    cr_expect(strstr(kvt_client_zero_copy_reason(t), "TCP") != NULL, "reason: %s",
              kvt_client_zero_copy_reason(t));
    cr_expect_null(kvt_client_mapping(t, NULL));
    /* RESERVE without a mapping is refused by libkvtier itself. */
    void *ptr;
    kvt_client_resv_t rv = {.ptrs = &ptr};
    uint32_t tok[2 * PAGE];
    kvd_tokens(tok, 2 * PAGE, 100);
    cr_expect_eq(kvt_client_reserve(t, tok, 2 * PAGE, 0, 1, NULL, &rv), KVT_CLIENT_EINVAL);

    /* The TCP client works on the socket path: put there, read back through the mapping. */
    uint8_t *src = block_buf(2, 1), *back = calloc(2, BB);
    kvt_client_put_t pr;
    cr_assert_eq(kvt_client_put(t, tok, 2 * PAGE, 0, 2, src, NULL, &pr), 0);
    cr_expect_eq(pr.stored, 2);
    kvt_client_match_t m = {0};
    cr_assert_eq(kvt_client_match(t, tok, 2 * PAGE, KVT_CLIENT_LEASE, 0, NULL, &m), 0);
    uint32_t got;
    cr_assert_eq(kvt_client_get(t, m.lease, 0, 2, back, 2 * BB, &got, NULL), 0);
    cr_expect_eq(got, 2);
    cr_expect(memcmp(src, back, 2 * BB) == 0);
    cr_assert_eq(kvt_client_release(t, m.lease, NULL), 0);

    /* An index-only client and one that asked for no zero-copy say why they did not map. */
    kvt_client_t *ix = NULL, *off = NULL;
    conf =
        (kvt_client_conf_t){.unix_path = d.sock, .model = "m", .page_size = PAGE, .zero_copy = 1};
    cr_assert_eq(kvt_client_connect(&ix, &conf), 0);
    cr_expect_eq(kvt_client_zero_copy(ix), 0);
    cr_expect(strstr(kvt_client_zero_copy_reason(ix), "block_bytes") != NULL);
    off = zc_client(&d, "m", 0);
    cr_expect_eq(kvt_client_zero_copy(off), 0);
    cr_expect(strstr(kvt_client_zero_copy_reason(off), "off") != NULL);
    kvt_client_close(ix);
    kvt_client_close(off);
    kvt_client_close(t);
    kvt_client_close(u);
    free(src);
    free(back);
    kvd_cleanup(&d);
}

Test(client_zc, reserve_commit_then_get_from_other_clients)
{
    kvd_t d = {0};
    zc_start(&d);
    kvt_client_t *w = zc_client(&d, "m", 1), *r = zc_client(&d, "m", 1),
                 *plain = zc_client(&d, "m", 0);
    enum { N = 4 };
    uint32_t tok[N * PAGE];
    kvd_tokens(tok, N * PAGE, 200);
    uint8_t *src = block_buf(N, 2), *back = calloc(N, BB);
    void *ptrs[N];
    kvt_client_resv_t rv = {.ptrs = ptrs};
    cr_assert_eq(kvt_client_reserve(w, tok, N * PAGE, 0, N, NULL, &rv), 0, "%s",
                 kvt_client_errmsg(w));
    cr_expect_eq(rv.pages, N);
    cr_expect_eq(rv.new_pages, N);
    cr_assert_eq(rv.nreserved, N);
    cr_assert_neq(rv.id, 0);
    uint64_t bytes;
    const uint8_t *map = kvt_client_mapping(w, &bytes);
    for (int i = 0; i < N; i++) {
        cr_assert(ptrs[i] != NULL);
        cr_expect((const uint8_t *)ptrs[i] >= map && (const uint8_t *)ptrs[i] + BB <= map + bytes,
                  "page %d's room lies in the mapping", i);
        memcpy(ptrs[i], src + (size_t)i * BB, BB);
    }
    /* Before the commit the pages are index-only to everyone. */
    uint8_t tiers[N];
    tiers_of(r, tok, N * PAGE, tiers, N);
    for (int i = 0; i < N; i++)
        cr_expect_eq(tiers[i], KVT_CLIENT_TIER_NONE, "page %d before commit: tier %u", i, tiers[i]);
    kvt_client_put_t cr;
    cr_assert_eq(kvt_client_commit(w, rv.id, &cr), 0, "%s", kvt_client_errmsg(w));
    cr_expect_eq(cr.stored, N);
    tiers_of(r, tok, N * PAGE, tiers, N);
    for (int i = 0; i < N; i++)
        cr_expect_eq(tiers[i], KVT_CLIENT_TIER_DRAM);

    kvt_client_t *readers[] = {r, plain};
    for (int k = 0; k < 2; k++) {
        memset(back, 0, (size_t)N * BB);
        kvt_client_match_t m = {0};
        cr_assert_eq(kvt_client_match(readers[k], tok, N * PAGE, KVT_CLIENT_LEASE, 0, NULL, &m), 0);
        cr_assert_eq(m.pages, N);
        uint32_t got;
        uint8_t gt[N];
        cr_assert_eq(kvt_client_get(readers[k], m.lease, 0, N, back, (size_t)N * BB, &got, gt), 0,
                     "%s", kvt_client_errmsg(readers[k]));
        cr_expect_eq(got, N);
        cr_expect(memcmp(src, back, (size_t)N * BB) == 0, "reader %d reads the bytes written", k);
        cr_expect_eq(gt[0], KVT_CLIENT_TIER_DRAM);
        cr_assert_eq(kvt_client_release(readers[k], m.lease, NULL), 0);
    }
    cr_expect_eq(kvd_stat(plain, "leases"), 0);
    kvt_client_close(w);
    kvt_client_close(r);
    kvt_client_close(plain);
    free(src);
    free(back);
    kvd_cleanup(&d);
}

typedef struct cb_check {
    const uint8_t *map, *src;
    uint64_t bytes;
    uint32_t first, n, inside, located, with_data;
    int64_t last_off;
} cb_check_t;

static int check_block(void *arg, uint32_t page, unsigned tier, const void *data, uint32_t len)
{
    cb_check_t *k = arg;
    const uint8_t *p = data;
    cr_expect_eq(len, BB);
    cr_expect_eq(tier, KVT_CLIENT_TIER_DRAM);
    if (p >= k->map && p + len <= k->map + k->bytes)
        k->inside++;
    cr_expect(memcmp(p, k->src + (size_t)(page - k->first) * BB, len) == 0, "page %u's bytes",
              page);
    k->n++;
    return 0;
}

static int check_loc(void *arg, uint32_t page, unsigned tier, const void *host, uint64_t off,
                     uint32_t len, const void *data)
{
    cb_check_t *k = arg;
    cr_expect_eq(len, BB);
    if (host) {
        cr_expect_eq(tier, KVT_CLIENT_TIER_DRAM);
        cr_expect_eq((const uint8_t *)host, k->map + off, "host_ptr is the mapping + offset");
        cr_expect_leq(off + len, k->bytes);
        cr_expect_null(data);
        k->located++;
        cr_expect(memcmp(host, k->src + (size_t)(page - k->first) * BB, len) == 0);
    } else {
        cr_expect_not_null(data);
        k->with_data++;
    }
    k->n++;
    return 0;
}

Test(client_zc, get_cb_points_into_the_mapping_and_get_loc_gives_offsets)
{
    kvd_t d = {0};
    zc_start(&d);
    kvt_client_t *c = zc_client(&d, "m", 1);
    enum { N = 3 };
    uint32_t tok[N * PAGE];
    kvd_tokens(tok, N * PAGE, 300);
    uint8_t *src = block_buf(N, 3);
    kvt_client_put_t pr;
    cr_assert_eq(kvt_client_put(c, tok, N * PAGE, 0, N, src, NULL, &pr), 0);
    cr_expect_eq(pr.stored, N);
    uint64_t gets = kvd_stat(c, "requests_put");
    cr_expect_eq(gets, 0, "a mapped PUT with room sends no PUT frame (%llu)",
                 (unsigned long long)gets);
    kvt_client_match_t m = {0};
    cr_assert_eq(kvt_client_match(c, tok, N * PAGE, KVT_CLIENT_LEASE, 0, NULL, &m), 0);
    cb_check_t k = {.src = src};
    k.map = kvt_client_mapping(c, &k.bytes);
    uint32_t got;
    cr_assert_eq(kvt_client_get_cb(c, m.lease, 0, 0, check_block, &k, &got), 0, "%s",
                 kvt_client_errmsg(c));
    cr_expect_eq(got, N);
    cr_expect_eq(k.inside, N, "%u of %u blocks handed over where they lie in the mapping", k.inside,
                 N);
    /* From page 1: the raw locations. */
    k = (cb_check_t){.src = src + BB, .first = 1};
    k.map = kvt_client_mapping(c, &k.bytes);
    cr_assert_eq(kvt_client_get_loc(c, m.lease, 1, 2, check_loc, &k), 0, "%s",
                 kvt_client_errmsg(c));
    cr_expect_eq(k.n, 2);
    cr_expect_eq(k.located, 2);
    cr_expect_eq(kvd_stat(c, "zero_copy_pages_get"), N + 2, "the daemon answered by location");
    cr_expect_eq(kvd_stat(c, "zero_copy_pages_reserve"), N);
    cr_assert_eq(kvt_client_release(c, m.lease, NULL), 0);
    kvt_client_close(c);
    free(src);
    kvd_cleanup(&d);
}

/* Polls STATS until name reads want (the daemon sees a closed connection on its own time). */
static int stat_becomes(kvt_client_t *c, const char *name, uint64_t want)
{
    for (int i = 0; i < 200; i++) {
        if (kvd_stat(c, name) == want)
            return 1;
        usleep(10000);
    }
    return 0;
}

Test(client_zc, abort_and_unknown_ids_leave_nothing_visible)
{
    kvd_t d = {0};
    zc_start(&d);
    kvt_client_t *c = zc_client(&d, "m", 1);
    uint64_t used0 = kvd_stat(c, "dram_used_bytes");
    enum { N = 2 };
    uint32_t tok[N * PAGE];
    kvd_tokens(tok, N * PAGE, 400);
    void *ptrs[N];
    kvt_client_resv_t rv = {.ptrs = ptrs};
    cr_assert_eq(kvt_client_reserve(c, tok, N * PAGE, 0, N, NULL, &rv), 0);
    cr_assert_eq(rv.nreserved, N);
    memset(ptrs[0], 0x77, BB);
    cr_assert_eq(kvt_client_abort(c, rv.id), 0, "%s", kvt_client_errmsg(c));
    uint8_t tiers[N];
    tiers_of(c, tok, N * PAGE, tiers, N);
    cr_expect_eq(tiers[0], KVT_CLIENT_TIER_NONE);
    cr_expect_eq(tiers[1], KVT_CLIENT_TIER_NONE);
    cr_expect_eq(kvd_stat(c, "dram_used_bytes"), used0, "the room is given back");
    /* Committed already (aborted), never made: ENOENT, and the client goes on. */
    kvt_client_put_t cr;
    cr_expect_eq(kvt_client_commit(c, rv.id, &cr), KVT_CLIENT_ENOENT);
    cr_expect_eq(kvt_client_commit(c, 0x123456789ull, &cr), KVT_CLIENT_ENOENT);
    cr_expect_eq(kvt_client_abort(c, 0x123456789ull), KVT_CLIENT_ENOENT);
    /* Another connection's reservation is not this one's to commit. */
    kvt_client_t *o = zc_client(&d, "m", 1);
    cr_assert_eq(kvt_client_reserve(o, tok, N * PAGE, 0, N, NULL, &rv), 0);
    cr_assert_eq(rv.nreserved, N);
    cr_expect_eq(kvt_client_commit(c, rv.id, &cr), KVT_CLIENT_ENOENT);
    cr_assert_eq(kvt_client_commit(o, rv.id, &cr), 0);
    cr_expect_eq(cr.stored, N);
    cr_assert_eq(kvt_client_ping(c, NULL), 0);
    kvt_client_close(o);
    kvt_client_close(c);
    kvd_cleanup(&d);
}

Test(client_zc, a_client_that_dies_mid_write_leaves_nothing_half_visible)
{
    kvd_t d = {0};
    zc_start(&d);
    kvt_client_t *c = zc_client(&d, "m", 1);
    uint64_t used0 = kvd_stat(c, "dram_used_bytes");
    enum { N = 2 };
    uint32_t tok[N * PAGE];
    kvd_tokens(tok, N * PAGE, 500);
    int pipefd[2];
    cr_assert(pipe(pipefd) == 0);
    pid_t pid = fork();
    cr_assert(pid >= 0);
    if (pid == 0) {
        /* The child: its own connection and mapping; it writes half a page and dies. No
         * Criterion assertions here (its IPC is not the child's). */
        kvt_client_conf_t conf = {.unix_path = d.sock,
                                  .model = "m",
                                  .page_size = PAGE,
                                  .block_bytes = BB,
                                  .zero_copy = 1};
        kvt_client_t *k = NULL;
        void *ptrs[N];
        kvt_client_resv_t rv = {.ptrs = ptrs};
        char ok = 0;
        if (kvt_client_connect(&k, &conf) == 0 && kvt_client_zero_copy(k) &&
            kvt_client_reserve(k, tok, N * PAGE, 0, N, NULL, &rv) == 0 && rv.nreserved == N) {
            memset(ptrs[0], 0x55, BB / 2);
            ok = 1;
        }
        if (write(pipefd[1], &ok, 1) != 1)
            _exit(2);
        _exit(ok ? 0 : 1);
    }
    close(pipefd[1]);
    char ok = 0;
    cr_assert_eq(read(pipefd[0], &ok, 1), 1);
    close(pipefd[0]);
    int st;
    cr_assert_eq(waitpid(pid, &st, 0), pid);
    cr_assert(ok && WIFEXITED(st) && WEXITSTATUS(st) == 0, "the child reserved its pages");
    uint8_t tiers[N];
    tiers_of(c, tok, N * PAGE, tiers, N);
    cr_expect_eq(tiers[0], KVT_CLIENT_TIER_NONE, "the half-written page is not visible");
    cr_expect_eq(tiers[1], KVT_CLIENT_TIER_NONE);
    cr_expect(stat_becomes(c, "dram_used_bytes", used0), "the dead client's room comes back");
    /* The pages can be stored by someone else, whole. */
    uint8_t *src = block_buf(N, 5), *back = calloc(N, BB);
    kvt_client_put_t pr;
    cr_assert_eq(kvt_client_put(c, tok, N * PAGE, 0, N, src, NULL, &pr), 0);
    cr_expect_eq(pr.stored, N);
    kvt_client_match_t m = {0};
    cr_assert_eq(kvt_client_match(c, tok, N * PAGE, KVT_CLIENT_LEASE, 0, NULL, &m), 0);
    uint32_t got;
    cr_assert_eq(kvt_client_get(c, m.lease, 0, N, back, (size_t)N * BB, &got, NULL), 0);
    cr_expect(memcmp(src, back, (size_t)N * BB) == 0);
    kvt_client_close(c);
    free(src);
    free(back);
    kvd_cleanup(&d);
}

Test(client_zc, put_answers_as_a_socket_put_and_held_pages_send_no_payload)
{
    kvd_t d = {0};
    zc_start(&d);
    kvt_client_t *z = zc_client(&d, "zc", 1), *s = zc_client(&d, "sock", 0);
    enum { N = 4 };
    uint32_t tok[N * PAGE + 3];
    kvd_tokens(tok, N * PAGE + 3, 600);
    uint8_t *src = block_buf(N, 6);
    /* The same sequence of PUTs on both (each in its own namespace): pages 0..1, then 1..3 (1
     * held), then all again (all held), then index only. */
    struct {
        uint32_t first, n;
    } steps[] = {{0, 2}, {1, 3}, {0, 4}, {0, 0}};
    for (size_t i = 0; i < sizeof steps / sizeof *steps; i++) {
        kvt_client_put_t a, b;
        const uint8_t *p = steps[i].n ? src + (size_t)steps[i].first * BB : NULL;
        cr_assert_eq(kvt_client_put(z, tok, N * PAGE + 3, steps[i].first, steps[i].n, p, NULL, &a),
                     0, "%s", kvt_client_errmsg(z));
        cr_assert_eq(kvt_client_put(s, tok, N * PAGE + 3, steps[i].first, steps[i].n, p, NULL, &b),
                     0);
        cr_expect(a.pages == b.pages && a.new_pages == b.new_pages && a.stored == b.stored &&
                      a.skipped == b.skipped,
                  "step %zu: zero-copy %u/%u/%u/%u, socket %u/%u/%u/%u", i, a.pages, a.new_pages,
                  a.stored, a.skipped, b.pages, b.new_pages, b.stored, b.skipped);
    }
    /* Pages held already: one RESERVE round trip, no PUT frame (the only one with a payload). */
    uint64_t puts = kvd_stat(z, "requests_put"), resv = kvd_stat(z, "requests_reserve");
    kvt_client_put_t a;
    cr_assert_eq(kvt_client_put(z, tok, N * PAGE, 0, N, src, NULL, &a), 0);
    cr_expect_eq(a.stored, 0);
    cr_expect_eq(a.skipped, N);
    cr_expect_eq(kvd_stat(z, "requests_put"), puts, "no payload went through the socket");
    cr_expect_eq(kvd_stat(z, "requests_reserve"), resv + 1);
    cr_expect_eq(kvd_stat(z, "requests_commit"), 2,
                 "only the two PUTs that got room committed (nothing reserved: no COMMIT)");
    kvt_client_close(z);
    kvt_client_close(s);
    free(src);
    kvd_cleanup(&d);
}

/* kvt_client_putv: one buffer per page, scattered in memory. A mapped client copies each
 * straight into its reserved room (no PUT frame, no gathering); the socket client gathers them.
 * Both store the same bytes with the same results. */
Test(client_zc, putv_blocks_go_straight_into_the_mapping)
{
    kvd_t d = {0};
    zc_start(&d);
    kvt_client_t *z = zc_client(&d, "zc", 1), *s = zc_client(&d, "sock", 0);
    cr_assert(kvt_client_zero_copy(z));
    enum { N = 5 };
    uint32_t tok[N * PAGE];
    kvd_tokens(tok, N * PAGE, 900);
    uint8_t *one[N];
    const void *blocks[N];
    for (int i = 0; i < N; i++)
        blocks[i] = one[i] = block_buf(1, 40 + (uint32_t)i);
    uint64_t puts = kvd_stat(z, "requests_put");
    kvt_client_put_t a, b;
    cr_assert_eq(kvt_client_putv(z, tok, N * PAGE, 0, N, blocks, NULL, &a), 0, "%s",
                 kvt_client_errmsg(z));
    cr_assert_eq(kvt_client_putv(s, tok, N * PAGE, 0, N, blocks, NULL, &b), 0);
    cr_expect(a.pages == b.pages && a.new_pages == b.new_pages && a.stored == N && b.stored == N &&
                  a.skipped == 0 && b.skipped == 0,
              "zero-copy %u/%u/%u/%u, socket %u/%u/%u/%u", a.pages, a.new_pages, a.stored,
              a.skipped, b.pages, b.new_pages, b.stored, b.skipped);
    cr_expect_eq(kvd_stat(z, "requests_put"), puts + 1, "only the socket client sent a PUT");
    uint8_t *got = malloc((size_t)N * BB);
    kvt_client_t *cs[2] = {z, s};
    for (int k = 0; k < 2; k++) {
        kvt_client_match_t m = {0};
        cr_assert_eq(kvt_client_match(cs[k], tok, N * PAGE, KVT_CLIENT_LEASE, 0, NULL, &m), 0);
        cr_assert_eq(m.pages, N);
        cr_assert_eq(kvt_client_get(cs[k], m.lease, 0, N, got, (size_t)N * BB, NULL, NULL), 0);
        for (int i = 0; i < N; i++)
            cr_expect(memcmp(got + (size_t)i * BB, one[i], BB) == 0, "client %d page %d", k, i);
        kvt_client_release(cs[k], m.lease, NULL);
    }
    const void *bad[2] = {one[0], NULL};
    cr_expect_eq(kvt_client_putv(z, tok, 2 * PAGE, 0, 2, bad, NULL, &a), KVT_CLIENT_EINVAL);
    free(got);
    for (int i = 0; i < N; i++)
        free(one[i]);
    kvt_client_close(z);
    kvt_client_close(s);
    kvd_cleanup(&d);
}

static int sleepy_block(void *arg, uint32_t page, unsigned tier, const void *data, uint32_t len)
{
    (void)page, (void)tier, (void)data, (void)len;
    struct timespec ts = {.tv_nsec = (long)*(int *)arg * 1000000L};
    nanosleep(&ts, NULL);
    return 0;
}

Test(client_zc, a_get_that_may_outlive_its_lease_fails)
{
    kvd_t d = {0};
    zc_start(&d);
    kvt_client_t *c = zc_client(&d, "m", 1), *plain = zc_client(&d, "m", 0);
    uint32_t tok[PAGE];
    kvd_tokens(tok, PAGE, 700);
    uint8_t *src = block_buf(1, 7);
    cr_assert_eq(kvt_client_put(c, tok, PAGE, 0, 1, src, NULL, NULL), 0);
    /* A lease of 600 ms, and a callback that takes 650 ms over the located page: the end frame
     * says the lease had at most 600 ms left, so the read may have outlived it, whatever the
     * machine's load (only a faster clock could make it pass). */
    kvt_client_match_t m = {0};
    cr_assert_eq(kvt_client_match(c, tok, PAGE, KVT_CLIENT_LEASE, 600, NULL, &m), 0);
    int ms = 650;
    uint32_t got;
    cr_expect_eq(kvt_client_get_cb(c, m.lease, 0, 1, sleepy_block, &ms, &got), KVT_CLIENT_ETIMEDOUT,
                 "%s", kvt_client_errmsg(c));
    cr_expect(strstr(kvt_client_errmsg(c), "lease") != NULL, "errmsg: %s", kvt_client_errmsg(c));
    /* The connection stays usable; a quick read under a long lease passes; bytes that came
     * through the socket are not subject to the check (they were copied out). */
    cr_assert_eq(kvt_client_ping(c, NULL), 0);
    cr_assert_eq(kvt_client_match(c, tok, PAGE, KVT_CLIENT_LEASE, 10000, NULL, &m), 0);
    ms = 0;
    cr_expect_eq(kvt_client_get_cb(c, m.lease, 0, 1, sleepy_block, &ms, &got), 0);
    cr_assert_eq(kvt_client_match(plain, tok, PAGE, KVT_CLIENT_LEASE, 600, NULL, &m), 0);
    ms = 650;
    cr_expect_eq(kvt_client_get_cb(plain, m.lease, 0, 1, sleepy_block, &ms, &got), 0);
    /* A lease that expired before the GET came: the daemon itself refuses it. */
    cr_assert_eq(kvt_client_match(c, tok, PAGE, KVT_CLIENT_LEASE, 50, NULL, &m), 0);
    usleep(100000);
    ms = 0;
    cr_expect_eq(kvt_client_get_cb(c, m.lease, 0, 1, sleepy_block, &ms, &got), KVT_CLIENT_ENOENT);
    kvt_client_close(c);
    kvt_client_close(plain);
    free(src);
    kvd_cleanup(&d);
}

Test(client_zc, map_hbm_is_refused_without_an_exportable_pool)
{
    /* No HBM tier; then the host backend (ordinary memory: nothing a CUDA IPC handle can name).
     * Either way EUNAVAIL, and the connection keeps its DRAM zero-copy. The GPU case (a handle
     * that cudaIpcOpenMemHandle opens) needs a CUDA device and hbm-ipc: tests/test_server_hbm.c's
     * territory. */
    for (int host = 0; host < 2; host++) {
        kvd_t d = {0};
        if (host)
            kvd_start(&d, "--hbm-backend", "host", "--hbm-bytes", "4M", NULL);
        else
            zc_start(&d);
        kvt_client_t *c = zc_client(&d, "m", 1);
        uint8_t handle[64];
        uint64_t pool = 7;
        cr_expect_eq(kvt_client_map_hbm(c, handle, &pool), KVT_CLIENT_EUNAVAIL, "%s: %s",
                     host ? "host backend" : "no HBM tier", kvt_client_errmsg(c));
        cr_expect_eq(kvt_client_zero_copy(c), 1);
        cr_assert_eq(kvt_client_ping(c, NULL), 0);
        if (host) { /* a GET may promote into the host-backed HBM: no DRAM read to check */
            kvt_client_close(c);
            kvd_cleanup(&d);
            continue;
        }
        uint32_t tok[PAGE];
        kvd_tokens(tok, PAGE, 800);
        uint8_t *src = block_buf(1, 8);
        cb_check_t k = {.src = src};
        k.map = kvt_client_mapping(c, &k.bytes);
        cr_assert_eq(kvt_client_put(c, tok, PAGE, 0, 1, src, NULL, NULL), 0);
        kvt_client_match_t m = {0};
        cr_assert_eq(kvt_client_match(c, tok, PAGE, KVT_CLIENT_LEASE, 0, NULL, &m), 0);
        uint32_t got;
        cr_expect_eq(kvt_client_get_cb(c, m.lease, 0, 1, check_block, &k, &got), 0);
        cr_expect_eq(k.inside, 1, "still read where the block lies");
        kvt_client_close(c);
        free(src);
        kvd_cleanup(&d);
    }
}
