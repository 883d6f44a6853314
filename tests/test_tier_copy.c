/*
 * test_tier_copy.c: kvt_tier_copy between every pair of local tiers (DRAM, NVMe, HBM through
 * its host backend): a memory source written straight from its memory, any other source staged,
 * the callback from the destination's completion path, the source left as it was, a full
 * destination refused up front with nothing changed, an unknown source refused, and a tier
 * destroyed with a staged copy in flight on it (as source or destination) freeing the staging
 * buffer and giving the reservation back.
 */
#include "test_tier_util.h"

typedef struct tiers {
    kvt_tier_t *dram, *nvme, *hbm;
    char dir[4096];
} tiers_t;

static void open_all(tiers_t *ts, uint64_t dram_cap)
{
    kvt_tier_dram_conf_t dc = {.capacity_bytes = dram_cap, .pin = 2};
    cr_assert_eq(kvt_tier_dram_create(&ts->dram, &dc), 0);
    tu_tmpdir(ts->dir, sizeof(ts->dir), "copy");
    kvt_tier_nvme_conf_t nc = {
        .dir = ts->dir, .capacity_bytes = 32u << 20, .segment_bytes = 4u << 20};
    cr_assert_eq(kvt_tier_nvme_create(&ts->nvme, &nc), 0);
    kvt_tier_hbm_conf_t hc = {.backend = "host", .capacity_bytes = 32u << 20};
    cr_assert_eq(kvt_tier_hbm_create(&ts->hbm, &hc), 0);
}

static void close_all(tiers_t *ts)
{
    kvt_tier_destroy(ts->dram);
    kvt_tier_destroy(ts->nvme);
    kvt_tier_destroy(ts->hbm);
    tu_rmrf(ts->dir);
}

static void copy_cb(kvt_tier_copy_t *c)
{
    (*(int *)c->data)++;
}

/* Copies (key, loc, len) from src to dst and waits; returns the status, *out the new loc. */
static int copy_sync(kvt_tier_t *src, kvt_tier_t *dst, const kvt_block_key_t *k, uint64_t loc,
                     uint32_t len, uint64_t *out)
{
    int done = 0;
    kvt_tier_copy_t c = {.src = src,
                         .dst = dst,
                         .src_loc = loc,
                         .key = *k,
                         .len = len,
                         .cb = copy_cb,
                         .data = &done};
    int rc = kvt_tier_copy(&c);
    if (rc < 0)
        return rc;
    cr_assert_eq(done, 0, "the callback never runs inside the call");
    uint64_t deadline = kvt_now_ns() + 20ull * 1000000000ull;
    while (!done && kvt_now_ns() < deadline) {
        kvt_tier_wait(src, 10);
        kvt_tier_wait(dst, 10);
    }
    cr_assert_eq(done, 1);
    *out = c.dst_loc;
    return c.status;
}

Test(tier_copy, every_pair_of_local_tiers)
{
    tiers_t ts;
    open_all(&ts, 64u << 20);
    kvt_tier_t *all[3] = {ts.dram, ts.nvme, ts.hbm};
    const uint32_t len = (256u << 10) + 100;
    uint8_t *buf = tu_aligned(len);
    uint32_t tok[16];
    int id = 0;
    for (int s = 0; s < 3; s++) {
        for (int d = 0; d < 3; d++) {
            if (s == d)
                continue;
            kvt_block_key_t k = tu_key((uint64_t)id, tok, 16);
            tu_fill(buf, len, (uint64_t)id);
            uint64_t sloc = 0, dloc = 0;
            cr_assert_eq(tu_write(all[s], &k, buf, len, &sloc), 0);
            int rc = copy_sync(all[s], all[d], &k, sloc, len, &dloc);
            cr_assert_eq(rc, 0, "%s -> %s: %s", kvt_tier_name(kvt_tier_kind(all[s])),
                         kvt_tier_name(kvt_tier_kind(all[d])), kvt_strerror(rc));
            cr_assert_neq(dloc, 0);
            memset(buf, 0, len);
            cr_assert_eq(tu_read(all[d], &k, dloc, buf, len), 0);
            cr_assert(tu_same(buf, len, (uint64_t)id), "copied bytes %d -> %d", s, d);
            cr_assert_eq(kvt_tier_valid(all[s], sloc, &k), 1, "the source is left as it was");
            kvt_tier_free(all[s], sloc, len);
            kvt_tier_free(all[d], dloc, len);
            id++;
        }
    }
    for (int i = 0; i < 3; i++) {
        kvt_tier_usage_t u;
        kvt_tier_usage(all[i], &u);
        cr_assert_eq(u.used_bytes, 0);
        cr_assert_eq(u.inflight, 0);
    }
    free(buf);
    close_all(&ts);
}

Test(tier_copy, a_full_destination_is_refused_up_front)
{
    tiers_t ts;
    open_all(&ts, 3u << 20);
    const uint32_t len = 1u << 20;
    uint8_t *buf = tu_aligned(len);
    uint32_t tok[16];
    uint64_t locs[4];
    tu_write_n(ts.nvme, 4, buf, len, tok, locs);
    uint64_t dloc;
    for (int i = 0; i < 3; i++) {
        kvt_block_key_t k = tu_key((uint64_t)i, tok, 16);
        cr_assert_eq(copy_sync(ts.nvme, ts.dram, &k, locs[i], len, &dloc), 0);
    }
    kvt_tier_usage_t before, after;
    kvt_tier_usage(ts.dram, &before);
    kvt_block_key_t k = tu_key(3, tok, 16);
    cr_assert_eq(copy_sync(ts.nvme, ts.dram, &k, locs[3], len, &dloc), KVT_ENOSPC);
    kvt_tier_usage(ts.dram, &after);
    cr_assert_eq(after.used_bytes, before.used_bytes);
    cr_assert_eq(after.blocks, before.blocks);
    /* Unknown source locations and mismatched keys are refused. */
    cr_assert_eq(copy_sync(ts.nvme, ts.hbm, &k, 12345, len, &dloc), KVT_ENOENT);
    kvt_block_key_t wrong = tu_key(77, tok, 16);
    cr_assert_eq(copy_sync(ts.nvme, ts.hbm, &wrong, locs[3], len, &dloc), KVT_ENOENT);
    kvt_tier_copy_t bad = {
        .src = ts.nvme, .dst = ts.nvme, .src_loc = locs[3], .key = k, .len = len};
    cr_assert_eq(kvt_tier_copy(&bad), KVT_EINVAL);
    free(buf);
    close_all(&ts);
}

Test(tier_copy, a_failed_source_read_reaches_the_callback)
{
    tiers_t ts;
    open_all(&ts, 16u << 20);
    const uint32_t len = 100000;
    uint8_t *buf = tu_aligned(len);
    uint32_t tok[16];
    kvt_block_key_t k = tu_key(1, tok, 16);
    tu_fill(buf, len, 1);
    uint64_t sloc = 0, dloc = 0;
    cr_assert_eq(tu_write(ts.nvme, &k, buf, len, &sloc), 0);
    /* Corrupt the stored payload behind the tier's back. */
    char p[4200];
    snprintf(p, sizeof(p), "%s/kvtier.data", ts.dir);
    FILE *f = fopen(p, "r+");
    cr_assert_not_null(f);
    fseek(f, 4096 + 10, SEEK_SET);
    fputc(0xAB ^ buf[10], f);
    fclose(f);
    kvt_tier_usage_t before, after;
    kvt_tier_usage(ts.dram, &before);
    cr_assert_eq(copy_sync(ts.nvme, ts.dram, &k, sloc, len, &dloc), KVT_ECORRUPT);
    kvt_tier_usage(ts.dram, &after);
    cr_assert_eq(after.used_bytes, before.used_bytes, "the reservation is given back");
    cr_assert_eq(after.blocks, 0);
    free(buf);
    close_all(&ts);
}

/* Starts a staged copy of a fresh NVMe block into dst; the copy is in flight on return. */
static void start_staged_copy(tiers_t *ts, kvt_tier_t *dst, kvt_tier_copy_t *c, int *done,
                              uint32_t *tok, uint8_t *buf, uint32_t len)
{
    kvt_block_key_t k = tu_key(7, tok, 16);
    tu_fill(buf, len, 7);
    uint64_t sloc = 0;
    cr_assert_eq(tu_write(ts->nvme, &k, buf, len, &sloc), 0);
    *c = (kvt_tier_copy_t){.src = ts->nvme,
                           .dst = dst,
                           .src_loc = sloc,
                           .key = k,
                           .len = len,
                           .cb = copy_cb,
                           .data = done};
    cr_assert_eq(kvt_tier_copy(c), 0);
    cr_assert_not_null(c->staging, "an NVMe source is staged");
}

Test(tier_copy, destroying_the_source_mid_read_frees_the_staging)
{
    tiers_t ts;
    open_all(&ts, 16u << 20);
    const uint32_t len = 300000;
    uint8_t *buf = tu_aligned(len);
    uint32_t tok[16];
    kvt_tier_usage_t before, after;
    kvt_tier_usage(ts.dram, &before);
    int done = 0;
    kvt_tier_copy_t c;
    start_staged_copy(&ts, ts.dram, &c, &done, tok, buf, len);
    kvt_tier_destroy(ts.nvme); /* the read from src is in flight */
    ts.nvme = NULL;
    cr_assert_eq(done, 0, "no callback runs for a destroyed tier's requests");
    cr_assert_null(c.staging, "the staging buffer is freed (ASan: no leak)");
    cr_assert_eq(c.status, KVT_ECLOSED);
    cr_assert_eq(c.dst_loc, 0);
    kvt_tier_usage(ts.dram, &after);
    cr_assert_eq(after.used_bytes, before.used_bytes, "the reservation in dst is given back");
    cr_assert_eq(after.blocks, 0);
    free(buf);
    close_all(&ts);
}

Test(tier_copy, destroying_the_destination_mid_write_frees_the_staging)
{
    tiers_t ts;
    open_all(&ts, 16u << 20);
    char dir2[4096];
    tu_tmpdir(dir2, sizeof(dir2), "copy-dst");
    kvt_tier_nvme_conf_t nc = {.dir = dir2, .capacity_bytes = 32u << 20, .segment_bytes = 4u << 20};
    kvt_tier_t *dst;
    cr_assert_eq(kvt_tier_nvme_create(&dst, &nc), 0);
    const uint32_t len = 300000;
    uint8_t *buf = tu_aligned(len);
    uint32_t tok[16];
    int done = 0;
    kvt_tier_copy_t c;
    start_staged_copy(&ts, dst, &c, &done, tok, buf, len);
    /* Run the read's completion only: it submits the write to dst. */
    kvt_tier_usage_t su, du;
    uint64_t deadline = kvt_now_ns() + 20ull * 1000000000ull;
    do {
        kvt_tier_wait(ts.nvme, 10);
        kvt_tier_usage(ts.nvme, &su);
    } while (su.inflight > 0 && kvt_now_ns() < deadline);
    cr_assert_eq(su.inflight, 0);
    kvt_tier_usage(dst, &du);
    cr_assert_eq(du.inflight, 1, "the write to dst is in flight");
    cr_assert_not_null(c.staging);
    kvt_tier_destroy(dst);
    cr_assert_eq(done, 0, "no callback runs for a destroyed tier's requests");
    cr_assert_null(c.staging, "the staging buffer is freed (ASan: no leak)");
    cr_assert_eq(c.status, KVT_ECLOSED);
    cr_assert_eq(c.dst_loc, 0);
    free(buf);
    tu_rmrf(dir2);
    close_all(&ts);
}
