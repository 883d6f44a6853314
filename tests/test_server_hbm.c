/*
 * test_server_hbm.c: kvtierd with an HBM tier, through the client library and /metrics. Each
 * behaviour runs with the `host` backend (ordinary memory standing in for HBM: every machine)
 * and with the `cuda` backend where a GPU is usable (skipped otherwise, with the reason on
 * stderr as well, since Criterion prints it only with --verbose): pages land in HBM first,
 * a full HBM spills to DRAM and is brought down to its low watermark by demotions, a PREFETCH
 * brings pages back up to HBM (demoting others to make room), every GET returns the bytes PUT,
 * and the HBM metrics count it all.
 */
#include "test_server_harness.h"

#include "tier.h"

#define PAGE 16
#define BLK  65536 /* one 64 KiB HBM slot per page: 1 MiB of HBM holds 16 pages */

static void need_backend(const char *backend)
{
    if (!strcmp(backend, "cuda") && !kvt_tier_cuda_usable()) {
        const char *why = "no usable CUDA device (or no CUDA in this build): the cuda backend "
                          "is tested on GPU hosts";
        fprintf(stderr, "SKIP %s::%s: %s\n", criterion_current_test->category,
                criterion_current_test->name, why);
        cr_skip_test("%s", why);
    }
}

static void start(kvd_t *d, const char *backend, const char *high, const char *low)
{
    kvd_start(d, "--hbm-backend", backend, "--hbm-bytes", "1M", "--dram-bytes", "8M",
              "--nvme-bytes", "0", "--policy-high", high, "--policy-low", low, "--log-level",
              "info", NULL);
}

/* Pages [0, n) of a prompt, page i's bytes from seed + i. */
static void put_prompt(kvt_client_t *c, const uint32_t *tok, uint32_t n, uint32_t seed)
{
    uint8_t *buf = malloc((size_t)n * BLK);
    for (uint32_t i = 0; i < n; i++)
        kvd_fill(buf + (size_t)i * BLK, BLK, seed + i);
    kvt_client_put_t r;
    cr_assert_eq(kvt_client_put(c, tok, n * PAGE, 0, n, buf, NULL, &r), 0);
    cr_expect_eq(r.stored, n, "stored %u of %u pages", r.stored, n);
    free(buf);
}

/* MATCHes the prompt (every page cached), GETs every page and checks its bytes; the tier each
 * page was in for the MATCH goes to tiers, the one each was read from to from. */
static void get_prompt(kvt_client_t *c, const uint32_t *tok, uint32_t n, uint32_t seed,
                       uint8_t *tiers, uint8_t *from)
{
    kvt_client_match_t m = {.tiers = tiers, .tiers_cap = n};
    cr_assert_eq(kvt_client_match(c, tok, n * PAGE, KVT_CLIENT_LEASE, 0, NULL, &m), 0);
    cr_assert_eq(m.pages, n);
    uint8_t *buf = malloc((size_t)n * BLK), *want = malloc(BLK);
    uint32_t got = 0;
    cr_assert_eq(kvt_client_get(c, m.lease, 0, n, buf, (size_t)n * BLK, &got, from), 0);
    cr_assert_eq(got, n);
    for (uint32_t i = 0; i < n; i++) {
        kvd_fill(want, BLK, seed + i);
        cr_assert(!memcmp(buf + (size_t)i * BLK, want, BLK), "page %u (seed %u) differs", i,
                  seed + i);
    }
    cr_expect_eq(kvt_client_release(c, m.lease, NULL), 0);
    free(buf);
    free(want);
}

/* Waits up to 5 s for the gauges (refreshed every tick) to show what STATS shows now (a MATCH
 * that hit DRAM may have started promotions, which the policy may then undo). */
static void wait_gauges(const kvd_t *d, kvt_client_t *c)
{
    uint64_t deadline = kvt_now_ns() + 5000000000ull;
    while (kvd_metric(d, "kvtier_tier_blocks{tier=\"hbm\"}") != (double)kvd_stat(c, "hbm_blocks") &&
           kvt_now_ns() < deadline)
        usleep(10000);
}

static void spill_and_prefetch(const char *backend)
{
    need_backend(backend);
    kvd_t d = {0};
    /* Watermarks at 100%: no maintenance in the background, so where each page goes is known. */
    start(&d, backend, "1", "1");
    kvt_client_t *c = kvd_client(&d, "m", PAGE, BLK);
    uint32_t a[16 * PAGE], b[8 * PAGE];
    kvd_tokens(a, 16 * PAGE, 1);
    kvd_tokens(b, 8 * PAGE, 900000);
    uint8_t tiers[16], from[16];

    /* a's 16 pages fill HBM exactly; b's 8 find no room there and land in DRAM. */
    put_prompt(c, a, 16, 100);
    cr_expect_eq(kvd_stat(c, "hbm_blocks"), 16);
    cr_expect_eq(kvd_stat(c, "hbm_used_bytes"), kvd_stat(c, "hbm_capacity_bytes"));
    put_prompt(c, b, 8, 200);
    cr_expect_eq(kvd_stat(c, "dram_blocks"), 8);
    get_prompt(c, a, 16, 100, tiers, from);
    for (int i = 0; i < 16; i++) {
        cr_expect_eq(tiers[i], KVT_CLIENT_TIER_HBM, "a's page %d in %u", i, tiers[i]);
        cr_expect_eq(from[i], KVT_CLIENT_TIER_HBM, "a's page %d read from %u", i, from[i]);
    }
    get_prompt(c, b, 8, 200, tiers, from);
    for (int i = 0; i < 8; i++)
        cr_expect_eq(tiers[i], KVT_CLIENT_TIER_DRAM, "b's page %d in %u", i, tiers[i]);

    /* PREFETCH b up to HBM: the policy demotes eight of a's pages to DRAM to make room, then
     * promotes b's. */
    kvt_client_prefetch_t pf;
    cr_assert_eq(kvt_client_prefetch(c, b, 8 * PAGE, KVT_CLIENT_TIER_HBM, 5000, &pf), 0);
    cr_expect_eq(pf.pages, 8);
    cr_expect_eq(pf.moved + pf.resident, 8, "moved %u resident %u failed %u", pf.moved, pf.resident,
                 pf.failed);
    cr_expect_eq(pf.failed, 0);
    get_prompt(c, b, 8, 200, tiers, from);
    for (int i = 0; i < 8; i++) {
        cr_expect_eq(tiers[i], KVT_CLIENT_TIER_HBM, "b's page %d in %u after PREFETCH", i,
                     tiers[i]);
        cr_expect_eq(from[i], KVT_CLIENT_TIER_HBM, "b's page %d read from %u", i, from[i]);
    }
    get_prompt(c, a, 16, 100, tiers, from);
    int in_hbm = 0, in_dram = 0;
    for (int i = 0; i < 16; i++) {
        in_hbm += tiers[i] == KVT_CLIENT_TIER_HBM;
        in_dram += tiers[i] == KVT_CLIENT_TIER_DRAM;
    }
    cr_expect_eq(in_hbm + in_dram, 16);
    cr_expect_geq(in_dram, 8, "a's pages demoted to DRAM: %d", in_dram);
    cr_expect_leq(kvd_stat(c, "hbm_used_bytes"), kvd_stat(c, "hbm_capacity_bytes"));

    /* The metrics: the moves both ways, the tier's gauges, the hits, the copies' batches. */
    wait_gauges(&d, c);
    cr_expect_geq(kvd_metric(&d, "kvtier_blocks_moved_total{from=\"hbm\",to=\"dram\"}"), 8);
    cr_expect_geq(kvd_metric(&d, "kvtier_blocks_moved_total{from=\"dram\",to=\"hbm\"}"), 8);
    double hbm_blocks = kvd_metric(&d, "kvtier_tier_blocks{tier=\"hbm\"}");
    cr_expect(hbm_blocks >= 8 && hbm_blocks <= 16, "kvtier_tier_blocks{tier=\"hbm\"} %g",
              hbm_blocks);
    cr_expect_eq(kvd_metric(&d, "kvtier_tier_capacity_bytes{tier=\"hbm\"}"), 1 << 20);
    cr_expect_gt(kvd_metric(&d, "kvtier_hit_tokens_total{tier=\"hbm\"}"), 0);
    double copies = kvd_metric(&d, "kvtier_hbm_copies_total");
    double batches = kvd_metric(&d, "kvtier_hbm_copy_batches_total");
    /* a's 16 writes and b's 8 promotions at least (the host backend's GETs and demotions read
     * its memory directly; the cuda backend's copy it out too): a PUT's pages, and a PREFETCH's,
     * are queued in one turn and go out together. */
    fprintf(stderr, "%s: %g HBM copies in %g batches\n", backend, copies, batches);
    cr_expect_geq(copies, 16 + 8, "copies %g", copies);
    cr_expect_gt(batches, 0);
    cr_expect_lt(batches, copies, "copies went out in batches: %g batches, %g copies", batches,
                 copies);
    kvt_client_close(c);
    kvd_cleanup(&d);
}

static void fill_and_demote(const char *backend)
{
    need_backend(backend);
    kvd_t d = {0};
    /* Maintenance above 90% of a tier, down to 75%: a full HBM of 16 pages gives up 4. */
    start(&d, backend, "0.9", "0.75");
    kvt_client_t *c = kvd_client(&d, "m", PAGE, BLK);
    uint32_t a[16 * PAGE];
    kvd_tokens(a, 16 * PAGE, 7);
    put_prompt(c, a, 16, 300);
    uint64_t t0 = kvt_now_ns(), deadline = t0 + 5000000000ull;
    while (kvd_stat(c, "hbm_blocks") > 12 && kvt_now_ns() < deadline)
        usleep(10000);
    fprintf(stderr, "%s: HBM at %llu blocks after %.3f s\n", backend,
            (unsigned long long)kvd_stat(c, "hbm_blocks"), (double)(kvt_now_ns() - t0) / 1e9);
    cr_expect_leq(kvd_stat(c, "hbm_blocks"), 12, "HBM brought down to its low watermark");
    cr_expect_geq(kvd_stat(c, "dram_blocks"), 4, "the demoted pages are in DRAM");
    cr_expect_eq(kvd_stat(c, "hbm_blocks") + kvd_stat(c, "dram_blocks"), 16);
    uint8_t tiers[16], from[16];
    get_prompt(c, a, 16, 300, tiers, from);
    for (int i = 1; i < 16; i++)
        cr_expect_geq(tiers[i], tiers[i - 1], "faster tiers first along the path");
    wait_gauges(&d, c);
    cr_expect_geq(kvd_metric(&d, "kvtier_blocks_moved_total{from=\"hbm\",to=\"dram\"}"), 4);
    kvt_client_close(c);
    kvd_cleanup(&d);
}

Test(server_hbm, host_spill_to_dram_and_prefetch_back)
{
    spill_and_prefetch("host");
}

Test(server_hbm, cuda_spill_to_dram_and_prefetch_back)
{
    spill_and_prefetch("cuda");
}

Test(server_hbm, host_full_hbm_demotes_to_dram)
{
    fill_and_demote("host");
}

Test(server_hbm, cuda_full_hbm_demotes_to_dram)
{
    fill_and_demote("cuda");
}

typedef struct hbm_locs {
    uint32_t n, in_hbm;
    uint64_t pool;
    int bad;
} hbm_locs_t;

static int hbm_loc(void *arg, uint32_t page, unsigned tier, const void *host_ptr, uint64_t offset,
                   uint32_t len, const void *data)
{
    hbm_locs_t *l = arg;
    (void)page;
    l->n++;
    if (tier == KVT_CLIENT_TIER_HBM) {
        l->in_hbm++;
        /* A location in the device pool: no host pointer, no bytes, inside the pool. */
        if (host_ptr || data || len != BLK || offset % BLK || offset + len > l->pool)
            l->bad++;
    }
    return 0;
}

/* A local client that maps the HBM pool (hbm-ipc yes) gets its 64-byte CUDA IPC handle, and a
 * GET by location answers the HBM pages with offsets in that pool (a client process opens the
 * handle with cudaIpcOpenMemHandle and copies from there; tier_hbm reads a block that way in a
 * separate process). */
Test(server_hbm, cuda_map_hbm_answers_pool_offsets)
{
    need_backend("cuda");
    kvd_t d = {0};
    kvd_start(&d, "--hbm-backend", "cuda", "--hbm-bytes", "1M", "--dram-bytes", "8M",
              "--nvme-bytes", "0", "--hbm-ipc", "yes", NULL);
    kvt_client_conf_t conf = {.unix_path = d.sock,
                              .model = "m",
                              .page_size = PAGE,
                              .block_bytes = BLK,
                              .timeout_ms = 10000,
                              .zero_copy = 1};
    kvt_client_t *c = NULL;
    cr_assert_eq(kvt_client_connect(&c, &conf), 0);
    uint8_t handle[64];
    hbm_locs_t l = {0};
    cr_assert_eq(kvt_client_map_hbm(c, handle, &l.pool), 0, "%s", kvt_client_errmsg(c));
    cr_expect_eq(l.pool, 1u << 20);
    uint32_t tok[4 * PAGE];
    kvd_tokens(tok, 4 * PAGE, 4242);
    put_prompt(c, tok, 4, 50);
    kvt_client_match_t m = {0};
    cr_assert_eq(kvt_client_match(c, tok, 4 * PAGE, KVT_CLIENT_LEASE, 0, NULL, &m), 0);
    cr_assert_eq(m.pages, 4);
    cr_assert_eq(kvt_client_get_loc(c, m.lease, 0, 4, hbm_loc, &l), 0);
    cr_expect(l.n == 4 && l.in_hbm == 4 && l.bad == 0, "%u pages, %u in HBM, %d bad", l.n, l.in_hbm,
              l.bad);
    kvt_client_release(c, m.lease, NULL);
    kvt_client_close(c);
    kvd_cleanup(&d);
}

/* ---- a pool per device: the host backend standing in for two GPUs (hbm-devices 0,1) ---- */

static kvt_client_t *client_on(const kvd_t *d, int device)
{
    kvt_client_conf_t conf = {.unix_path = d->sock,
                              .model = "m",
                              .page_size = PAGE,
                              .block_bytes = BLK,
                              .timeout_ms = 10000,
                              .device = device};
    kvt_client_t *c = NULL;
    int rc = kvt_client_connect(&c, &conf);
    cr_assert_eq(rc, 0, "connect: %s", kvt_client_strerror(rc));
    return c;
}

/* Waits up to 5 s for the gauges of both pools (refreshed every tick) to read b0 and b1 blocks,
 * and checks that each pool holds no more than its capacity and that they sum to the tier. */
static void pools_hold(const kvd_t *d, kvt_client_t *c, double b0, double b1)
{
    uint64_t deadline = kvt_now_ns() + 5000000000ull;
    while ((kvd_metric(d, "kvtier_hbm_pool_blocks{device=\"0\"}") != b0 ||
            kvd_metric(d, "kvtier_hbm_pool_blocks{device=\"1\"}") != b1) &&
           kvt_now_ns() < deadline)
        usleep(10000);
    cr_expect_eq(kvd_metric(d, "kvtier_hbm_pool_blocks{device=\"0\"}"), b0,
                 "device 0 pool: %g want %g", kvd_metric(d, "kvtier_hbm_pool_blocks{device=\"0\"}"),
                 b0);
    cr_expect_eq(kvd_metric(d, "kvtier_hbm_pool_blocks{device=\"1\"}"), b1,
                 "device 1 pool: %g want %g", kvd_metric(d, "kvtier_hbm_pool_blocks{device=\"1\"}"),
                 b1);
    double u0 = kvd_metric(d, "kvtier_hbm_pool_used_bytes{device=\"0\"}");
    double u1 = kvd_metric(d, "kvtier_hbm_pool_used_bytes{device=\"1\"}");
    cr_expect_eq(u0, b0 * BLK);
    cr_expect_eq(u1, b1 * BLK);
    cr_expect_leq(u0, kvd_metric(d, "kvtier_hbm_pool_capacity_bytes{device=\"0\"}"));
    cr_expect_leq(u1, kvd_metric(d, "kvtier_hbm_pool_capacity_bytes{device=\"1\"}"));
    cr_expect_eq((uint64_t)(u0 + u1), kvd_stat(c, "hbm_used_bytes"));
}

/* Pages PUT by a client on device 1 land in device 1's pool, an old-style client's (device 0)
 * in device 0's; either client MATCHes and GETs the other's pages; a full pool spills to the
 * other before anything goes to DRAM, and no pool ever holds more than its own 1 MiB. */
Test(server_hbm, host_pool_per_device_puts_on_the_client_s_device)
{
    kvd_t d = {0};
    kvd_start(&d, "--hbm-backend", "host", "--hbm-devices", "0,1", "--hbm-bytes", "1M",
              "--dram-bytes", "8M", "--nvme-bytes", "0", "--policy-high", "1", "--policy-low", "1",
              NULL);
    kvt_client_t *c1 = client_on(&d, 1);
    kvt_client_t *c0 = kvd_client(&d, "m", PAGE, BLK); /* a zeroed conf: device 0 */
    cr_expect_eq(kvd_stat(c0, "hbm_capacity_bytes"), 2u << 20, "hbm-bytes per device");
    cr_expect_eq(kvd_metric(&d, "kvtier_hbm_pool_capacity_bytes{device=\"0\"}"), 1 << 20);
    cr_expect_eq(kvd_metric(&d, "kvtier_hbm_pool_capacity_bytes{device=\"1\"}"), 1 << 20);
    cr_expect_eq(kvd_metric(&d, "kvtier_hbm_pool_blocks{device=\"2\"}"), -1, "no pool, no series");

    uint32_t a[8 * PAGE], b[4 * PAGE], e[12 * PAGE], f[8 * PAGE];
    kvd_tokens(a, 8 * PAGE, 11);
    kvd_tokens(b, 4 * PAGE, 22000);
    kvd_tokens(e, 12 * PAGE, 33000);
    kvd_tokens(f, 8 * PAGE, 44000);
    uint8_t tiers[16], from[16];
    put_prompt(c1, a, 8, 100);
    pools_hold(&d, c0, 0, 8);
    put_prompt(c0, b, 4, 200);
    pools_hold(&d, c0, 4, 8);
    /* Across devices: each reads the other's pages, from HBM. */
    get_prompt(c0, a, 8, 100, tiers, from);
    for (int i = 0; i < 8; i++)
        cr_expect_eq(from[i], KVT_CLIENT_TIER_HBM, "a's page %d read from %u", i, from[i]);
    get_prompt(c1, b, 4, 200, tiers, from);
    for (int i = 0; i < 4; i++)
        cr_expect_eq(from[i], KVT_CLIENT_TIER_HBM, "b's page %d read from %u", i, from[i]);
    /* 12 more from device 1: 8 fill its pool, 4 spill to device 0's, all still HBM. */
    put_prompt(c1, e, 12, 300);
    pools_hold(&d, c0, 8, 16);
    cr_expect_eq(kvd_stat(c0, "dram_blocks"), 0);
    /* 8 more from device 1: device 0's pool takes them; then HBM is full, and the next go to
     * DRAM. */
    put_prompt(c1, f, 8, 400);
    pools_hold(&d, c0, 16, 16);
    uint32_t g[2 * PAGE];
    kvd_tokens(g, 2 * PAGE, 55000);
    put_prompt(c1, g, 2, 500);
    pools_hold(&d, c0, 16, 16);
    cr_expect_eq(kvd_stat(c0, "dram_blocks"), 2);
    get_prompt(c0, e, 12, 300, tiers, from);
    get_prompt(c1, f, 8, 400, tiers, from);
    get_prompt(c1, g, 2, 500, tiers, from);
    for (int i = 0; i < 2; i++)
        cr_expect_eq(tiers[i], KVT_CLIENT_TIER_DRAM);
    kvt_client_close(c0);
    kvt_client_close(c1);
    kvd_cleanup(&d);
}

/*
 * Both prefetch tests start alike: two 1M host pools, a and b fill them (b on device 1, where
 * device 0's pool has no room left), e goes to DRAM, then a and b are removed: both pools are
 * empty, with the same room, and e's 4 pages wait in DRAM. c1 names device 1. k keeps each test's
 * tokens apart.
 */
static void two_empty_pools_e_in_dram(kvd_t *d, kvt_client_t **c0, kvt_client_t **c1,
                                      uint32_t e[4 * PAGE], uint32_t k)
{
    kvd_start(d, "--hbm-backend", "host", "--hbm-devices", "0,1", "--hbm-bytes", "1M",
              "--dram-bytes", "8M", "--nvme-bytes", "0", "--policy-high", "1", "--policy-low", "1",
              NULL);
    *c0 = kvd_client(d, "m", PAGE, BLK);
    *c1 = client_on(d, 1);
    uint32_t a[16 * PAGE], b[16 * PAGE];
    kvd_tokens(a, 16 * PAGE, k * 10 + 1);
    kvd_tokens(b, 16 * PAGE, k * 10000 + 2000);
    kvd_tokens(e, 4 * PAGE, k * 10000 + 3000);
    put_prompt(*c0, a, 16, 100);
    put_prompt(*c0, b, 16, 200); /* device 0's pool is full: device 1's takes b */
    put_prompt(*c0, e, 4, 300);  /* HBM is full: DRAM */
    pools_hold(d, *c0, 16, 16);
    cr_expect_eq(kvd_stat(*c0, "dram_blocks"), 4);
    cr_assert_eq(kvt_client_remove(*c0, a, PAGE), 0); /* the first page and all beneath */
    cr_assert_eq(kvt_client_remove(*c0, b, PAGE), 0);
    pools_hold(d, *c0, 0, 0);
}

/* A PREFETCH up to HBM puts the pages in the pool of the device of the client that asked, even
 * where another pool has as much room (where nobody names a device, the first would). */
Test(server_hbm, host_prefetch_promotes_to_the_client_s_device)
{
    kvd_t d = {0};
    kvt_client_t *c0, *c1;
    uint32_t e[4 * PAGE];
    uint8_t tiers[16], from[16];
    two_empty_pools_e_in_dram(&d, &c0, &c1, e, 6);
    kvt_client_prefetch_t pf;
    cr_assert_eq(kvt_client_prefetch(c1, e, 4 * PAGE, KVT_CLIENT_TIER_HBM, 5000, &pf), 0);
    cr_expect_eq(pf.moved, 4, "moved %u resident %u failed %u", pf.moved, pf.resident, pf.failed);
    pools_hold(&d, c0, 0, 4);
    get_prompt(c0, e, 4, 300, tiers, from);
    for (int i = 0; i < 4; i++)
        cr_expect_eq(from[i], KVT_CLIENT_TIER_HBM, "e's page %d read from %u", i, from[i]);
    kvt_client_close(c0);
    kvt_client_close(c1);
    kvd_cleanup(&d);
}

/* The promotions a MATCH makes the policy queue (pages below HBM, room in it) go to the pool of
 * the device of the client that matched, even where another pool has as much room. */
Test(server_hbm, host_match_promotes_to_the_client_s_device)
{
    kvd_t d = {0};
    kvt_client_t *c0, *c1;
    uint32_t e[4 * PAGE];
    uint8_t tiers[16], from[16];
    two_empty_pools_e_in_dram(&d, &c0, &c1, e, 7);
    kvt_client_match_t m = {.tiers = tiers, .tiers_cap = 4};
    cr_assert_eq(kvt_client_match(c1, e, 4 * PAGE, 0, 0, NULL, &m), 0);
    cr_assert_eq(m.pages, 4);
    cr_expect_eq(tiers[0], KVT_CLIENT_TIER_DRAM, "in DRAM when matched");
    pools_hold(&d, c0, 0, 4); /* the policy's next step promotes them */
    get_prompt(c0, e, 4, 300, tiers, from);
    for (int i = 0; i < 4; i++)
        cr_expect_eq(tiers[i], KVT_CLIENT_TIER_HBM, "e's page %d in %u", i, tiers[i]);
    kvt_client_close(c0);
    kvt_client_close(c1);
    kvd_cleanup(&d);
}

/* hbm-devices that are no list of distinct device numbers stop the daemon at start-up (exit
 * 64), with the setting named on stderr. */
Test(server_hbm, bad_hbm_devices_are_refused)
{
    static const char *const bad[] = {"0,0", "1,", "x", "-1", "0;1", "70000", ",1", " 1"};
    kvd_t d = {0};
    kvd_mkdir(&d);
    for (size_t i = 0; i < KVT_ARRAY_LEN(bad); i++) {
        char cmd[2048], path[700], err[1024] = "";
        snprintf(cmd, sizeof cmd,
                 "cd '%s' && '%s' --unix x.sock --tcp 127.0.0.1:0 --metrics '' --nvme-bytes 0 "
                 "--hbm-backend host --hbm-devices '%s' >/dev/null 2>err.txt",
                 d.dir, kvd_binary(), bad[i]);
        int st = system(cmd);
        snprintf(path, sizeof path, "%s/err.txt", d.dir);
        FILE *f = fopen(path, "r");
        if (f) {
            err[fread(err, 1, sizeof err - 1, f)] = 0;
            fclose(f);
        }
        cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 64, "hbm-devices \"%s\": status %d", bad[i],
                  st);
        cr_expect(strstr(err, "hbm-devices") != NULL, "hbm-devices \"%s\": stderr '%s'", bad[i],
                  err);
    }
    kvd_cleanup(&d);
}
