/*
 * test_server_tenants.c: quotas per tenant (issue 36). A tenant is a namespace (model, adapter,
 * salt, page size); tenant-<tier>-bytes caps what one holds in each tier. Two tenants share a
 * real kvtierd: one fills its share and keeps writing, and the other's blocks must stay where
 * they were, byte-exact; the heavy one's pages go down a tier, get no room, are dropped instead
 * of demoted, or stay where they are instead of being promoted, each path (PUT, RESERVE, the
 * policy's demotions and promotions) checked against the per-tenant gauge on /metrics.
 */
#include <criterion/criterion.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include <signal.h>

#include "test_server_harness.h"

#define PAGE 4
#define BB   (64u << 10) /* block bytes: 64 KiB in DRAM, 72 KiB on NVMe (4 KiB header room) */

static kvd_t d;

static void teardown(void)
{
    kvd_cleanup(&d);
}

static kvt_client_t *tenant(const char *salt, int zero_copy)
{
    kvt_client_conf_t conf = {.unix_path = d.sock,
                              .model = "m",
                              .salt = salt,
                              .page_size = PAGE,
                              .block_bytes = BB,
                              .zero_copy = zero_copy,
                              .timeout_ms = 10000};
    kvt_client_t *c = NULL;
    int rc = kvt_client_connect(&c, &conf);
    cr_assert_eq(rc, 0, "connect: %s", kvt_client_strerror(rc));
    return c;
}

/* A series' value on /metrics, or -1 when it is not there. */
static double metric(const char *series)
{
    static char body[1 << 18];
    cr_assert_eq(kvd_http_get(&d, "/metrics", body, sizeof body), 200);
    size_t n = strlen(series);
    for (char *l = body; l && *l; l = strchr(l, '\n') ? strchr(l, '\n') + 1 : NULL)
        if (strncmp(l, series, n) == 0 && l[n] == ' ')
            return strtod(l + n + 1, NULL);
    return -1;
}

/* What tenant c holds in tier (kvtier_tenant_used_bytes; 0 when it has no row). */
static double held(kvt_client_t *c, const char *tier)
{
    char s[128];
    snprintf(s, sizeof s, "kvtier_tenant_used_bytes{tenant=\"%016" PRIx64 "\",tier=\"%s\"}",
             kvt_client_ns_seed(c), tier);
    double v = metric(s);
    return v < 0 ? 0 : v;
}

static void put(kvt_client_t *c, const uint32_t *t, uint32_t pages, uint32_t seed,
                kvt_client_put_t *pr)
{
    uint8_t *pay = malloc((size_t)pages * BB);
    kvd_fill(pay, (size_t)pages * BB, seed);
    cr_assert_eq(kvt_client_put(c, t, pages * PAGE, 0, pages, pay, NULL, pr), 0, "PUT: %s",
                 kvt_client_errmsg(c));
    free(pay);
}

/* The tier of each page of t (at most 64), by MATCH without a lease. */
static uint32_t tiers_of(kvt_client_t *c, const uint32_t *t, uint32_t pages, uint8_t *tiers)
{
    kvt_client_match_t m = {.tiers = tiers, .tiers_cap = 64};
    cr_assert_eq(kvt_client_match(c, t, pages * PAGE, 0, 0, NULL, &m), 0);
    return m.pages;
}

#define ANY_TIER 0xff

/* Every page of t is in tier `want` (or any, ANY_TIER) and reads back as PUT with seed. */
static void all_in(kvt_client_t *c, const uint32_t *t, uint32_t pages, uint32_t seed, uint8_t want,
                   const char *who)
{
    uint8_t tiers[64];
    kvt_client_match_t m = {.tiers = tiers, .tiers_cap = 64};
    cr_assert_eq(kvt_client_match(c, t, pages * PAGE, KVT_CLIENT_LEASE, 0, NULL, &m), 0);
    cr_assert_eq(m.pages, pages, "%s: %u pages matched of %u", who, m.pages, pages);
    for (uint32_t i = 0; i < pages; i++)
        cr_expect(want == ANY_TIER || tiers[i] == want, "%s: page %u in tier %u", who, i, tiers[i]);
    uint8_t *got = malloc((size_t)pages * BB), *exp = malloc((size_t)pages * BB);
    cr_assert_eq(kvt_client_get(c, m.lease, 0, pages, got, (size_t)pages * BB, NULL, NULL), 0);
    kvd_fill(exp, (size_t)pages * BB, seed);
    cr_expect(memcmp(got, exp, (size_t)pages * BB) == 0, "%s: bytes changed", who);
    kvt_client_release(c, m.lease, NULL);
    free(got);
    free(exp);
}

/* PUT: a tenant at its DRAM share sends its next pages to NVMe, and at its NVMe share gets
 * no_room; the other tenant's DRAM blocks stay, and the gauge shows each one's bytes. */
Test(server_tenants, put_keeps_each_tenant_to_its_share, .fini = teardown)
{
    kvd_start(&d, "--dram-bytes", "2M", "--tenant-dram-bytes", "512K", "--tenant-nvme-bytes",
              "720K", NULL);
    kvt_client_t *a = tenant("tenant-a", 0), *b = tenant("tenant-b", 0);
    uint32_t ta[32 * PAGE], tb[8 * PAGE];
    kvd_tokens(ta, 32 * PAGE, 1000);
    kvd_tokens(tb, 8 * PAGE, 5000);
    kvt_client_put_t pr;
    put(b, tb, 8, 2, &pr);
    cr_assert_eq(pr.stored, 8);
    put(a, ta, 32, 1, &pr);
    /* 8 of 64 KiB fill 512K of DRAM, 10 of 72 KiB the 720K of NVMe; the other 14 find none. */
    cr_expect_eq(pr.stored, 18, "stored %u", pr.stored);
    cr_expect_eq(pr.skipped, 14, "skipped %u", pr.skipped);
    cr_expect_eq(held(a, "dram"), 512 * 1024);
    cr_expect_eq(held(a, "nvme"), 720 * 1024);
    cr_expect_eq(held(b, "dram"), 8 * BB);
    cr_expect_eq(held(b, "nvme"), 0);
    uint8_t tiers[64];
    cr_assert_eq(tiers_of(a, ta, 32, tiers), 32);
    for (uint32_t i = 0; i < 32; i++)
        cr_expect_eq(tiers[i],
                     i < 8    ? KVT_CLIENT_TIER_DRAM
                     : i < 18 ? KVT_CLIENT_TIER_NVME
                              : KVT_CLIENT_TIER_NONE,
                     "a's page %u in tier %u", i, tiers[i]);
    all_in(b, tb, 8, 2, KVT_CLIENT_TIER_DRAM, "b");
    cr_expect_gt(metric("kvtier_tenant_quota_refusals_total{tier=\"dram\"}"), 0);
    cr_expect_gt(metric("kvtier_tenant_quota_refusals_total{tier=\"nvme\"}"), 0);
    cr_expect_eq(metric("kvtier_tenant_quota_bytes{tier=\"dram\"}"), 512 * 1024);
    cr_expect_eq(kvd_stat(a, "put_pages_no_room"), 14);
    kvt_client_close(a);
    kvt_client_close(b);
}

/* RESERVE: a mapped tenant gets room in its arena up to its DRAM share only. */
Test(server_tenants, reserve_gets_room_up_to_the_share, .fini = teardown)
{
    kvd_start(&d, "--tenant-dram-bytes", "256K", NULL);
    kvt_client_t *a = tenant("tenant-a", 1);
    cr_assert(kvt_client_zero_copy(a), "no mapping: %s", kvt_client_zero_copy_reason(a));
    uint32_t t[8 * PAGE];
    kvd_tokens(t, 8 * PAGE, 9000);
    void *ptrs[8];
    kvt_client_resv_t r = {.ptrs = ptrs};
    cr_assert_eq(kvt_client_reserve(a, t, 8 * PAGE, 0, 8, NULL, &r), 0);
    cr_expect_eq(r.nreserved, 4, "reserved %u pages under a 4-page share", r.nreserved);
    for (uint32_t i = 0; i < 8; i++) {
        cr_expect_eq(ptrs[i] != NULL, i < 4, "page %u", i);
        if (ptrs[i])
            kvd_fill(ptrs[i], BB, 30 + i);
    }
    cr_expect_eq(held(a, "dram"), 256 * 1024, "the reservation counts in the share");
    kvt_client_put_t pr;
    cr_assert_eq(kvt_client_commit(a, r.id, &pr), 0);
    cr_expect_eq(pr.stored, 4);
    /* The share is full: a second RESERVE gets nothing. */
    uint32_t u[2 * PAGE];
    kvd_tokens(u, 2 * PAGE, 9900);
    r = (kvt_client_resv_t){.ptrs = ptrs};
    cr_assert_eq(kvt_client_reserve(a, u, 2 * PAGE, 0, 2, NULL, &r), 0);
    cr_expect_eq(r.nreserved, 0);
    cr_expect_eq(held(a, "dram"), 256 * 1024);
    kvt_client_close(a);
}

/* n one-page prompts (each its own leaf, so that the policy may drop it), tokens from base. */
static uint32_t put_singles(kvt_client_t *c, uint32_t base, uint32_t n, uint32_t seed)
{
    uint32_t stored = 0;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t t[PAGE];
        kvd_tokens(t, PAGE, base + 100 * i);
        kvt_client_put_t pr;
        put(c, t, 1, seed + i, &pr);
        stored += pr.stored;
    }
    return stored;
}

/* The policy's demotions: past a tenant's NVMe share its DRAM blocks are dropped instead of
 * demoted there. DRAM's watermarks at a half and a quarter: a's ninth page takes it over the high
 * one, and the maintenance moves five of a's blocks out, four to NVMe (its share, 72 KiB each),
 * the fifth dropped. b's blocks, written after, all stay. */
Test(server_tenants, demotions_stop_at_the_nvme_share, .fini = teardown)
{
    kvd_start(&d, "--dram-bytes", "1M", "--policy", "lru", "--policy-high", "0.5", "--policy-low",
              "0.25", "--tenant-nvme-bytes", "288K", NULL);
    kvt_client_t *a = tenant("tenant-a", 0), *b = tenant("tenant-b", 0);
    cr_assert_eq(put_singles(a, 10000, 12, 1), 12);
    for (int i = 0; i < 100 && kvd_stat(a, "leases") > 0; i++)
        usleep(10000); /* moves in flight */
    cr_expect_eq(held(a, "nvme"), 288 * 1024, "a's NVMe share is not what it holds");
    cr_expect_gt(metric("kvtier_blocks_dropped_total{tier=\"dram\"}"), 0,
                 "a's blocks past its NVMe share were not dropped");
    cr_expect_gt(metric("kvtier_tenant_quota_refusals_total{tier=\"nvme\"}"), 0);
    cr_assert_eq(put_singles(b, 20000, 4, 50), 4);
    for (int i = 0; i < 100 && kvd_stat(a, "leases") > 0; i++)
        usleep(10000);
    cr_expect_eq(held(a, "nvme"), 288 * 1024);
    for (uint32_t i = 0; i < 4; i++) {
        uint32_t t[PAGE];
        kvd_tokens(t, PAGE, 20000 + 100 * i);
        all_in(b, t, 1, 50 + i, ANY_TIER, "b");
    }
    kvt_client_close(a);
    kvt_client_close(b);
}

/* The policy's promotions: a tenant's NVMe pages that a MATCH asks up stay in NVMe while its
 * DRAM share is full, and no room is made for them: DRAM is full of three other tenants' blocks
 * (each at its share too), every one of which stays there. (policy-high 1: no watermark moves of
 * their own.) */
Test(server_tenants, promotions_stop_at_the_dram_share, .fini = teardown)
{
    kvd_start(&d, "--dram-bytes", "1M", "--tenant-dram-bytes", "256K", "--policy-high", "1",
              "--policy-low", "1", NULL);
    kvt_client_t *a = tenant("tenant-a", 0), *o[3];
    uint32_t ta[8 * PAGE], to[3][4 * PAGE];
    kvd_tokens(ta, 8 * PAGE, 400);
    kvt_client_put_t pr;
    for (int k = 0; k < 3; k++) {
        char salt[16];
        snprintf(salt, sizeof salt, "other-%d", k);
        o[k] = tenant(salt, 0);
        kvd_tokens(to[k], 4 * PAGE, 500 + 100 * (uint32_t)k);
        put(o[k], to[k], 4, 10 + (uint32_t)k, &pr);
        cr_assert_eq(pr.stored, 4);
    }
    put(a, ta, 8, 4, &pr); /* 4 in DRAM (its share; DRAM full), 4 in NVMe */
    cr_assert_eq(pr.stored, 8);
    uint8_t tiers[64];
    for (int k = 0; k < 10; k++) { /* each MATCH queues the promotion of the NVMe part */
        cr_assert_eq(tiers_of(a, ta, 8, tiers), 8);
        usleep(30000);
    }
    cr_expect_eq(held(a, "dram"), 256 * 1024, "a promotion took a past its DRAM share");
    for (uint32_t i = 0; i < 8; i++)
        cr_expect_eq(tiers[i], i < 4 ? KVT_CLIENT_TIER_DRAM : KVT_CLIENT_TIER_NVME,
                     "a's page %u in tier %u", i, tiers[i]);
    cr_expect_gt(metric("kvtier_tenant_quota_refusals_total{tier=\"dram\"}"), 0);
    for (int k = 0; k < 3; k++) {
        all_in(o[k], to[k], 4, 10 + (uint32_t)k, KVT_CLIENT_TIER_DRAM, "another tenant");
        kvt_client_close(o[k]);
    }
    all_in(a, ta, 8, 4, ANY_TIER, "a");
    kvt_client_close(a);
}

/* A PUT past its tenant's share with no tier below: its pages get no_room, and no room is made
 * for them, which would have dropped the other tenant's blocks for writes that cannot happen. */
Test(server_tenants, no_room_is_made_past_the_share, .fini = teardown)
{
    kvd_start(&d, "--dram-bytes", "1M", "--nvme-bytes", "0", "--tenant-dram-bytes", "512K",
              "--policy-high", "1", "--policy-low", "1", NULL);
    kvt_client_t *a = tenant("tenant-a", 0), *b = tenant("tenant-b", 0);
    uint32_t ta[12 * PAGE], tb[8 * PAGE];
    kvd_tokens(ta, 12 * PAGE, 600);
    kvd_tokens(tb, 8 * PAGE, 700);
    kvt_client_put_t pr;
    put(b, tb, 8, 6, &pr);
    cr_assert_eq(pr.stored, 8);
    put(a, ta, 12, 7, &pr);
    cr_expect_eq(pr.stored, 8);
    cr_expect_eq(pr.skipped, 4);
    cr_expect_eq(kvd_stat(a, "put_pages_no_room"), 4);
    cr_expect_eq(metric("kvtier_blocks_dropped_total{tier=\"dram\"}"), 0, "blocks were dropped");
    all_in(b, tb, 8, 6, KVT_CLIENT_TIER_DRAM, "b");
    kvt_client_close(a);
    kvt_client_close(b);
}

/* A bad value stops the start with the setting named; a reload (SIGHUP) changes a share, which
 * a tenant over the new one keeps (nothing is dropped) but cannot grow. */
Test(server_tenants, settings_checked_and_reloaded, .fini = teardown)
{
    char cmd[1200], out[512] = "";
    snprintf(cmd, sizeof cmd, "%s --tenant-nvme-bytes lots 2>&1", kvd_binary());
    FILE *p = popen(cmd, "r");
    cr_assert(p);
    size_t n = fread(out, 1, sizeof out - 1, p);
    out[n] = 0;
    int st = pclose(p);
    cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 64, "bad value: exit %d", WEXITSTATUS(st));
    cr_expect(strstr(out, "tenant-nvme-bytes"), "the setting is named: %s", out);

    kvd_mkdir(&d);
    char conf[700];
    snprintf(conf, sizeof conf, "%s/kvtierd.conf", d.dir);
    FILE *f = fopen(conf, "w");
    cr_assert(f);
    fputs("tenant-dram-bytes = 512K\n", f);
    fclose(f);
    kvd_start(&d, "--config", conf, NULL);
    cr_expect_eq(metric("kvtier_tenant_quota_bytes{tier=\"dram\"}"), 512 * 1024);
    cr_expect_eq(metric("kvtier_tenant_quota_bytes{tier=\"nvme\"}"), 0);
    kvt_client_t *a = tenant("tenant-a", 0);
    uint32_t t[8 * PAGE], u[2 * PAGE];
    kvd_tokens(t, 8 * PAGE, 700);
    kvd_tokens(u, 2 * PAGE, 800);
    kvt_client_put_t pr;
    put(a, t, 8, 7, &pr);
    cr_assert_eq(held(a, "dram"), 512 * 1024);
    f = fopen(conf, "w");
    cr_assert(f);
    fputs("tenant-dram-bytes = 128K\n", f);
    fclose(f);
    cr_assert_eq(kill(d.pid, SIGHUP), 0);
    for (int i = 0; i < 500 && kvd_stat(a, "config_reloads") < 1; i++)
        usleep(10000);
    cr_expect_eq(metric("kvtier_tenant_quota_bytes{tier=\"dram\"}"), 128 * 1024);
    put(a, u, 2, 8, &pr);
    cr_expect_eq(held(a, "dram"), 512 * 1024, "over its new share, a kept its blocks, no more");
    uint8_t tiers[64];
    cr_assert_eq(tiers_of(a, u, 2, tiers), 2);
    cr_expect(tiers[0] == KVT_CLIENT_TIER_NVME && tiers[1] == KVT_CLIENT_TIER_NVME);
    kvt_client_close(a);
}
