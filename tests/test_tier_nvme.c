/*
 * test_tier_nvme.c: the NVMe tier on real files through io_uring: round trips of varied sizes
 * with aligned and unaligned buffers, O_DIRECT where the file system takes it and the buffered
 * fallback where it does not (a ramfs mounted in a private mount namespace), capacity
 * exhaustion, free and segment reuse, reclaim of a fragmented log, many requests in flight
 * through a small queue, checksum mismatches from bytes flipped in the data file (found at
 * completion, or by the caller a read left its payload's checksum to), a file system
 * that is full (a tiny tmpfs), and bad configuration. Every test works under its own directory
 * in $TMPDIR and removes it.
 */
#include "test_tier_util.h"

#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <sys/mount.h>

static kvt_tier_t *mk(const char *dir, uint64_t cap, uint32_t seg, uint32_t qd)
{
    kvt_tier_t *t = NULL;
    kvt_tier_nvme_conf_t c = {
        .dir = dir, .capacity_bytes = cap, .segment_bytes = seg, .queue_depth = qd};
    int rc = kvt_tier_nvme_create(&t, &c);
    cr_assert_eq(rc, 0, "nvme create in %s: %s", dir, kvt_strerror(rc));
    cr_assert_eq(kvt_tier_kind(t), KVT_TIER_NVME);
    return t;
}

static int odirect_works(const char *dir)
{
    char p[4200];
    snprintf(p, sizeof(p), "%s/.odirect-probe", dir);
    int fd = open(p, O_RDWR | O_CREAT | O_DIRECT, 0600);
    if (fd >= 0)
        close(fd);
    unlink(p);
    return fd >= 0;
}

/* A private mount namespace for this test process, so that a mount made here disappears with
 * it. Returns 0, or skips the test where that is not allowed. */
static void private_mounts(void)
{
    if (unshare(CLONE_NEWNS) != 0 || mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) != 0)
        cr_skip_test("cannot make a private mount namespace (%s): needs root", strerror(errno));
}

static void round_trips(kvt_tier_t *t)
{
    static const uint32_t sizes[] = {
        1, 511, 4096, 4097, 65536, 100000, 256u << 10, (256u << 10) + 1, 2u << 20, (2u << 20) - 5};
    uint64_t locs[2][KVT_ARRAY_LEN(sizes)];
    uint32_t tok[2][KVT_ARRAY_LEN(sizes)][16];
    for (int aligned = 0; aligned < 2; aligned++) {
        for (size_t i = 0; i < KVT_ARRAY_LEN(sizes); i++) {
            uint64_t id = (uint64_t)aligned * 100 + i;
            kvt_block_key_t k = tu_key(id, tok[aligned][i], 16);
            uint8_t *mem = tu_aligned(sizes[i] + 64);
            uint8_t *buf = aligned ? mem : mem + 8;
            tu_fill(buf, sizes[i], id);
            cr_assert_eq(tu_write(t, &k, buf, sizes[i], &locs[aligned][i]), 0, "write %u",
                         sizes[i]);
            cr_assert_neq(locs[aligned][i], 0);
            free(mem);
        }
    }
    for (int aligned = 0; aligned < 2; aligned++) {
        for (size_t i = 0; i < KVT_ARRAY_LEN(sizes); i++) {
            uint64_t id = (uint64_t)aligned * 100 + i;
            kvt_block_key_t k = tu_key(id, tok[aligned][i], 16);
            uint8_t *mem = tu_aligned(sizes[i] + 64);
            uint8_t *buf = aligned ? mem : mem + 8;
            memset(buf, 0xee, sizes[i]);
            cr_assert_eq(tu_read(t, &k, locs[aligned][i], buf, sizes[i]), 0, "read %u", sizes[i]);
            cr_assert(tu_same(buf, sizes[i], id), "bytes of %u (aligned %d)", sizes[i], aligned);
            cr_assert_eq(kvt_tier_valid(t, locs[aligned][i], &k), 1);
            free(mem);
        }
    }
    kvt_tier_usage_t u;
    kvt_tier_usage(t, &u);
    cr_assert_eq(u.blocks, 2 * KVT_ARRAY_LEN(sizes));
    cr_assert_eq(u.corrupt + u.errors + u.misses, 0);
    cr_assert_leq(u.used_bytes, u.capacity_bytes);
    for (int aligned = 0; aligned < 2; aligned++)
        for (size_t i = 0; i < KVT_ARRAY_LEN(sizes); i++)
            kvt_tier_free(t, locs[aligned][i], sizes[i]);
    kvt_tier_usage(t, &u);
    cr_assert_eq(u.blocks, 0);
    cr_assert_eq(u.used_bytes, 0);
}

Test(tier_nvme, round_trips_with_odirect)
{
    char dir[4096];
    tu_tmpdir(dir, sizeof(dir), "nvme");
    kvt_tier_t *t = mk(dir, 32u << 20, 4u << 20, 16);
    cr_assert_str_eq(kvt_tier_backend(t), "io_uring");
    cr_assert_eq(kvt_tier_nvme_direct(t), odirect_works(dir));
    round_trips(t);
    kvt_tier_destroy(t);
    tu_rmrf(dir);
}

Test(tier_nvme, buffered_when_asked)
{
    char dir[4096];
    tu_tmpdir(dir, sizeof(dir), "nvme");
    kvt_tier_t *t = NULL;
    kvt_tier_nvme_conf_t c = {
        .dir = dir, .capacity_bytes = 32u << 20, .segment_bytes = 4u << 20, .direct = 2};
    cr_assert_eq(kvt_tier_nvme_create(&t, &c), 0);
    cr_assert_eq(kvt_tier_nvme_direct(t), 0);
    round_trips(t);
    kvt_tier_destroy(t);
    tu_rmrf(dir);
}

Test(tier_nvme, falls_back_to_buffered_where_odirect_is_refused)
{
    private_mounts();
    char dir[4096];
    tu_tmpdir(dir, sizeof(dir), "ramfs");
    /* ramfs has no O_DIRECT (tmpfs gained it in Linux 6.6). */
    cr_assert_eq(mount("ramfs", dir, "ramfs", 0, NULL), 0, "mount ramfs: %s", strerror(errno));
    cr_assert_eq(odirect_works(dir), 0, "ramfs should refuse O_DIRECT");
    kvt_tier_t *t = NULL;
    kvt_tier_nvme_conf_t c = {
        .dir = dir, .capacity_bytes = 16u << 20, .segment_bytes = 4u << 20, .direct = 1};
    cr_assert_eq(kvt_tier_nvme_create(&t, &c), KVT_EUNAVAIL, "direct = 1 insists on O_DIRECT");
    c.direct = 0;
    cr_assert_eq(kvt_tier_nvme_create(&t, &c), 0);
    cr_assert_eq(kvt_tier_nvme_direct(t), 0);
    round_trips(t);
    kvt_tier_destroy(t);
    umount(dir);
    tu_rmrf(dir);
}

Test(tier_nvme, capacity_exhaustion_fails_cleanly)
{
    char dir[4096];
    tu_tmpdir(dir, sizeof(dir), "nvme");
    kvt_tier_t *t = mk(dir, 8u << 20, 1u << 20, 8);
    /* Records of 4 KiB header + 248 KiB: four fill a 1 MiB segment exactly, and the charge
     * (8 KiB header room + 248 KiB) runs out with the last segment. */
    const uint32_t len = 248u << 10;
    uint8_t *buf = tu_aligned(len);
    tu_fill(buf, len, 3);
    uint32_t tok[16];
    uint64_t locs[64];
    int n = 0;
    uint64_t fp = kvt_tier_footprint(t, len);
    for (;; n++) {
        cr_assert_lt(n, 64);
        kvt_block_key_t k = tu_key((uint64_t)n, tok, 16);
        kvt_tier_usage_t before, after;
        kvt_tier_usage(t, &before);
        int rc = tu_write(t, &k, buf, len, &locs[n]);
        kvt_tier_usage(t, &after);
        if (rc == KVT_ENOSPC) {
            cr_assert_eq(after.used_bytes, before.used_bytes);
            cr_assert_eq(after.blocks, before.blocks);
            cr_assert_gt(before.used_bytes + fp, before.capacity_bytes);
            break;
        }
        cr_assert_eq(rc, 0);
        cr_assert_leq(after.used_bytes, after.capacity_bytes);
    }
    cr_assert_eq((uint64_t)n, (8u << 20) / fp, "blocks that fit: %d", n);
    kvt_tier_usage_t u;
    kvt_tier_usage(t, &u);
    cr_assert_eq(u.reclaimed, 0);
    for (int i = 0; i < n; i++) {
        kvt_block_key_t k = tu_key((uint64_t)i, tok, 16);
        cr_assert_eq(tu_read(t, &k, locs[i], buf, len), 0);
        cr_assert(tu_same(buf, len, 3));
    }
    free(buf);
    kvt_tier_destroy(t);
    tu_rmrf(dir);
}

Test(tier_nvme, freed_segments_come_back_and_old_locations_miss)
{
    char dir[4096];
    tu_tmpdir(dir, sizeof(dir), "nvme");
    kvt_tier_t *t = mk(dir, 4u << 20, 1u << 20, 8);
    const uint32_t len = 200u << 10;
    uint8_t *buf = tu_aligned(len);
    uint32_t tok[16];
    uint64_t first_loc = 0;
    kvt_block_key_t first = tu_key(0, tok, 16);
    /* Write and free far more than the capacity: whole segments must come back. */
    for (int i = 0; i < 200; i++) {
        kvt_block_key_t k = tu_key((uint64_t)i, tok, 16);
        tu_fill(buf, len, (uint64_t)i);
        uint64_t loc = 0;
        cr_assert_eq(tu_write(t, &k, buf, len, &loc), 0, "write %d", i);
        if (i == 0) {
            first_loc = loc;
            first = k;
        }
        kvt_tier_free(t, loc, len);
    }
    kvt_tier_usage_t u;
    kvt_tier_usage(t, &u);
    cr_assert_eq(u.blocks, 0);
    cr_assert_eq(u.used_bytes, 0);
    cr_assert_eq(u.reclaimed, 0, "freed blocks leave nothing to reclaim");
    cr_assert_eq(kvt_tier_valid(t, first_loc, &first), 0);
    cr_assert_eq(tu_read(t, &first, first_loc, buf, len), KVT_ENOENT);
    free(buf);
    kvt_tier_destroy(t);
    tu_rmrf(dir);
}

static void count_reclaim(void *arg, uint64_t loc, uint64_t ns_seed, uint64_t hash)
{
    (void)hash;
    cr_assert_neq(loc, 0);
    cr_assert_eq(ns_seed, TU_NS_SEED);
    (*(uint64_t *)arg)++;
}

Test(tier_nvme, a_fragmented_log_reclaims_whole_segments)
{
    char dir[4096];
    tu_tmpdir(dir, sizeof(dir), "nvme");
    uint64_t reclaim_calls = 0;
    kvt_tier_t *t = NULL;
    kvt_tier_nvme_conf_t c = {.dir = dir,
                              .capacity_bytes = 4u << 20,
                              .segment_bytes = 1u << 20,
                              .queue_depth = 8,
                              .reclaim_cb = count_reclaim,
                              .reclaim_arg = &reclaim_calls};
    cr_assert_eq(kvt_tier_nvme_create(&t, &c), 0);
    const uint32_t len = 300u << 10; /* three records per 1 MiB segment */
    uint8_t *buf = tu_aligned(len);
    uint32_t tok[16];
    enum { N = 40 };
    uint64_t locs[N] = {0};
    int live[N] = {0};
    /* Keep one block in three: every segment stays partly live, so new writes need a whole
     * segment reclaimed. */
    for (int i = 0; i < N; i++) {
        kvt_block_key_t k = tu_key((uint64_t)i, tok, 16);
        tu_fill(buf, len, (uint64_t)i);
        int rc = tu_write(t, &k, buf, len, &locs[i]);
        cr_assert_eq(rc, 0, "write %d: %s", i, kvt_strerror(rc));
        live[i] = 1;
        if (i % 3 != 0) {
            kvt_tier_free(t, locs[i], len);
            live[i] = 0;
        }
    }
    kvt_tier_usage_t u;
    kvt_tier_usage(t, &u);
    cr_assert_gt(u.reclaimed, 0, "some live blocks were reclaimed with their segment");
    cr_assert_eq(reclaim_calls, u.reclaimed);
    cr_assert_leq(u.used_bytes, u.capacity_bytes);
    uint64_t valid = 0;
    for (int i = 0; i < N; i++) {
        if (!live[i])
            continue;
        kvt_block_key_t k = tu_key((uint64_t)i, tok, 16);
        int v = kvt_tier_valid(t, locs[i], &k);
        int rc = tu_read(t, &k, locs[i], buf, len);
        if (v) {
            cr_assert_eq(rc, 0);
            cr_assert(tu_same(buf, len, (uint64_t)i), "block %d intact", i);
            valid++;
        } else {
            cr_assert_eq(rc, KVT_ENOENT, "a reclaimed block reads as a miss");
        }
    }
    cr_assert_eq(valid, u.blocks);
    free(buf);
    kvt_tier_destroy(t);
    tu_rmrf(dir);
}

/* The same fragmented log with one kept block pinned (a leased path's block, in kvtierd): no
 * reclaim drops it, while others still are; unpinned, it is fair game again. */
Test(tier_nvme, a_pinned_block_survives_reclaim)
{
    char dir[4096];
    tu_tmpdir(dir, sizeof(dir), "nvme");
    kvt_tier_t *t = mk(dir, 4u << 20, 1u << 20, 8);
    const uint32_t len = 300u << 10;
    uint8_t *buf = tu_aligned(len);
    uint32_t tok[16];
    enum { N = 40 };
    uint64_t locs[N] = {0};
    uint32_t tok0[16];
    kvt_block_key_t k0 = tu_key(0, tok0, 16);
    for (int i = 0; i < N; i++) {
        kvt_block_key_t k = tu_key((uint64_t)i, tok, 16);
        tu_fill(buf, len, (uint64_t)i);
        int rc = tu_write(t, &k, buf, len, &locs[i]);
        cr_assert_eq(rc, 0, "write %d: %s", i, kvt_strerror(rc));
        if (i == 0)
            cr_assert_eq(kvt_tier_pin(t, locs[0], 1), 0);
        else if (i % 3 != 0)
            kvt_tier_free(t, locs[i], len);
    }
    kvt_tier_usage_t u;
    kvt_tier_usage(t, &u);
    cr_assert_gt(u.reclaimed, 0, "other live blocks were reclaimed");
    cr_assert_eq(kvt_tier_valid(t, locs[0], &k0), 1, "the pinned block was not");
    int rc0 = tu_read(t, &k0, locs[0], buf, len);
    cr_assert_eq(rc0, 0, "read: %s", kvt_strerror(rc0));
    cr_assert(tu_same(buf, len, 0), "and reads back intact");
    cr_assert_eq(kvt_tier_pin(t, 12345, 1), KVT_ENOENT, "no pin on a location never written");
    cr_assert_eq(kvt_tier_pin(t, locs[0], -1), 0);
    /* Unpinned and never freed: more writes (kept live) reclaim its segment like any other. */
    for (int i = 0; i < N && kvt_tier_valid(t, locs[0], &k0); i++) {
        kvt_block_key_t k = tu_key((uint64_t)(100 + i), tok, 16);
        uint64_t loc = 0;
        tu_fill(buf, len, (uint64_t)(100 + i));
        cr_assert_eq(tu_write(t, &k, buf, len, &loc), 0);
    }
    cr_assert_eq(kvt_tier_valid(t, locs[0], &k0), 0, "unpinned, it was reclaimed in the end");
    cr_assert_eq(kvt_tier_pin(t, locs[0], -1), KVT_ENOENT, "a stale unpin is harmless");
    free(buf);
    kvt_tier_destroy(t);
    tu_rmrf(dir);
}

Test(tier_nvme, many_requests_in_flight_through_a_small_queue)
{
    enum { N = 96, LEN = 128u << 10 };
    char dir[4096];
    tu_tmpdir(dir, sizeof(dir), "nvme");
    kvt_tier_t *t = mk(dir, 32u << 20, 2u << 20, 4);
    static kvt_tier_io_t ios[N];
    static uint32_t toks[N][16];
    uint8_t *bufs = tu_aligned((size_t)N * LEN);
    int done = 0;
    for (int i = 0; i < N; i++) {
        tu_fill(bufs + (size_t)i * LEN, LEN, (uint64_t)i);
        ios[i] = (kvt_tier_io_t){.key = tu_key((uint64_t)i, toks[i], 16),
                                 .buf = bufs + (size_t)i * LEN,
                                 .len = LEN - (uint32_t)i, /* most end in a partial sector */
                                 .cb = tu_count_cb,
                                 .data = &done};
        cr_assert_eq(kvt_tier_write(t, &ios[i]), 0);
    }
    cr_assert_eq(done, 0);
    kvt_tier_usage_t u;
    kvt_tier_usage(t, &u);
    cr_assert_eq(u.inflight, N);
    cr_assert(tu_drive(t, &done, N));
    memset(bufs, 0, (size_t)N * LEN);
    done = 0;
    for (int i = 0; i < N; i++) {
        cr_assert_eq(ios[i].status, 0, "write %d: %s", i, kvt_strerror(ios[i].status));
        cr_assert_eq(kvt_tier_read(t, &ios[i]), 0);
    }
    cr_assert(tu_drive(t, &done, N));
    for (int i = 0; i < N; i++) {
        cr_assert_eq(ios[i].status, 0);
        cr_assert(tu_same(bufs + (size_t)i * LEN, LEN - (size_t)i, (uint64_t)i), "block %d", i);
    }
    kvt_tier_usage(t, &u);
    cr_assert_eq(u.writes, N);
    cr_assert_eq(u.reads, N);
    cr_assert_eq(u.inflight, 0);
    free(bufs);
    kvt_tier_destroy(t);
    tu_rmrf(dir);
}

/*
 * A burst of 16 reads of 256 KiB (4 MiB, eight of the poll's verify budgets), check_later as
 * given, every one finished on the device before one process call harvests them. Checked by the
 * tier, they are verified 512 KiB at a time: that call runs the callbacks of the first two and
 * leaves the tier's fd readable for the rest, so that a caller can submit again between
 * checksums. Left to their caller, they cost the budget nothing: that call hands over all 16.
 * Either way every read completes byte-exact (kvt_tier_read_check: its status for a read the tier
 * checked).
 */
static void burst_handover(uint64_t seed, int check_later)
{
    enum { N = 16, LEN = 256u << 10 };
    char dir[4096];
    tu_tmpdir(dir, sizeof(dir), "nvme");
    kvt_tier_t *t = mk(dir, 32u << 20, 8u << 20, N);
    static kvt_tier_io_t ios[N];
    static uint32_t toks[N][16];
    uint8_t *bufs = tu_aligned((size_t)N * LEN);
    int done = 0;
    tu_write_burst(t, ios, toks, bufs, N, LEN, seed, &done);
    cr_assert(tu_drive(t, &done, N));
    memset(bufs, 0, (size_t)N * LEN);
    done = 0;
    for (int i = 0; i < N; i++) {
        ios[i].check_later = (uint8_t)check_later;
        cr_assert_eq(kvt_tier_read(t, &ios[i]), 0);
    }
    usleep(200000);
    struct pollfd pf = {.fd = kvt_tier_fd(t), .events = POLLIN};
    cr_assert_eq(poll(&pf, 1, 5000), 1);
    cr_assert_geq(kvt_tier_process(t), 0);
    if (check_later) {
        cr_expect_eq(done, N, "one process call ran %d read callbacks", done);
    } else {
        cr_expect_leq(done, 2, "one process call ran %d read callbacks", done);
        cr_expect_eq(poll(&pf, 1, 0), 1, "the fd stays readable while reads wait to be verified");
    }
    cr_assert(tu_drive(t, &done, N));
    for (int i = 0; i < N; i++) {
        int rc = kvt_tier_read_check(&ios[i]);
        cr_assert_eq(rc, 0, "read %d: %s", i, kvt_strerror(rc));
        cr_assert(tu_same(bufs + (size_t)i * LEN, LEN, (uint64_t)i + seed), "block %d", i);
    }
    free(bufs);
    kvt_tier_destroy(t);
    tu_rmrf(dir);
}

Test(tier_nvme, a_burst_of_reads_is_handed_over_a_few_at_a_time)
{
    burst_handover(50, 0);
}

Test(tier_nvme, reads_checked_by_their_caller_are_handed_over_at_once)
{
    burst_handover(60, 1);
}

/* Flips one byte of the data file at off, with a plain descriptor of its own. */
static void flip(const char *dir, uint64_t off)
{
    char p[4200];
    snprintf(p, sizeof(p), "%s/kvtier.data", dir);
    int fd = open(p, O_RDWR);
    cr_assert_geq(fd, 0);
    uint8_t b;
    cr_assert_eq(pread(fd, &b, 1, (off_t)off), 1);
    b ^= 0x40;
    cr_assert_eq(pwrite(fd, &b, 1, (off_t)off), 1);
    cr_assert_eq(fsync(fd), 0);
    close(fd);
}

#define FLIPPED_LEN 100000u

/* A tier in a fresh dir holding blocks 0..2 of FLIPPED_LEN bytes, keyed tu_key(i) over tok, their
 * locations in locs (buf: a buffer of FLIPPED_LEN for the writes), with a payload byte of block 0
 * and a token in block 1's header flipped in the data file. */
static kvt_tier_t *flipped_three(char *dir, size_t dir_size, uint8_t *buf, uint32_t *tok,
                                 uint64_t *locs)
{
    tu_tmpdir(dir, dir_size, "nvme");
    kvt_tier_t *t = mk(dir, 8u << 20, 1u << 20, 8);
    /* Blocks 0..2 land at the start of segment 0, one after another: header region 4 KiB, then
     * the payload rounded up to whole sectors. */
    tu_write_n(t, 3, buf, FLIPPED_LEN, tok, locs);
    uint64_t rec = 4096 + ((FLIPPED_LEN + 4095) / 4096) * 4096;
    flip(dir, 0 * rec + 4096 + 5000); /* block 0: payload */
    flip(dir, 1 * rec + 32 + 64 + 8); /* block 1: a token in the header */
    return t;
}

Test(tier_nvme, flipped_bytes_read_as_a_counted_miss)
{
    char dir[4096];
    const uint32_t len = FLIPPED_LEN;
    uint8_t *buf = tu_aligned(len);
    uint32_t tok[16];
    uint64_t locs[3];
    kvt_tier_t *t = flipped_three(dir, sizeof dir, buf, tok, locs);
    for (int i = 0; i < 3; i++) {
        kvt_block_key_t k = tu_key((uint64_t)i, tok, 16);
        memset(buf, 0x55, len);
        int rc = tu_read(t, &k, locs[i], buf, len);
        if (i < 2) {
            cr_assert_eq(rc, KVT_ECORRUPT, "block %d: %s", i, kvt_strerror(rc));
            uint8_t *zero = calloc(1, len);
            cr_assert_eq(memcmp(buf, zero, len), 0, "a corrupt block hands out no bytes");
            free(zero);
        } else {
            cr_assert_eq(rc, 0);
            cr_assert(tu_same(buf, len, 2));
        }
    }
    kvt_tier_usage_t u;
    kvt_tier_usage(t, &u);
    cr_assert_eq(u.corrupt, 2);
    cr_assert_eq(u.reads, 1);
    /* A key that does not match the stored header is refused the same way. */
    kvt_block_key_t k2 = tu_key(2, tok, 16);
    tok[3] ^= 1;
    cr_assert_eq(tu_read(t, &k2, locs[2], buf, len), KVT_ECORRUPT);
    free(buf);
    kvt_tier_destroy(t);
    tu_rmrf(dir);
}

/* A read through io (check_later as given) of block key at loc into buf; its status. */
static int read_io(kvt_tier_t *t, kvt_tier_io_t *io, const kvt_block_key_t *key, uint64_t loc,
                   void *buf, uint32_t len, int check_later)
{
    int done = 0;
    *io = (kvt_tier_io_t){.key = *key,
                          .loc = loc,
                          .buf = buf,
                          .len = len,
                          .cb = tu_count_cb,
                          .data = &done,
                          .check_later = (uint8_t)check_later};
    cr_assert_eq(kvt_tier_read(t, io), 0);
    cr_assert(tu_drive(t, &done, 1));
    return io->status;
}

/* A read whose caller takes the payload's checksum (check_later: the daemon's GET on its own
 * loop) completes with every other check made: a flipped payload byte completes 0, unchecked,
 * and fails kvt_tier_read_check (the buffer zeroed), which kvt_tier_read_corrupt then counts as
 * the tier counts a corrupt read; a flipped token in the header fails at completion as before;
 * an intact block passes, byte-exact. Without check_later the same payload fails at completion. */
Test(tier_nvme, a_read_leaves_its_payload_checksum_to_the_caller)
{
    char dir[4096];
    const uint32_t len = FLIPPED_LEN;
    uint8_t *buf = tu_aligned(len), *zero = calloc(1, len);
    uint32_t tok[16];
    uint64_t locs[3];
    kvt_tier_t *t = flipped_three(dir, sizeof dir, buf, tok, locs);
    kvt_tier_io_t io;
    kvt_block_key_t k0 = tu_key(0, tok, 16);
    cr_assert_eq(read_io(t, &io, &k0, locs[0], buf, len, 1), 0, "the payload is not checked");
    cr_assert(io.unchecked);
    cr_assert_eq(kvt_tier_read_check(&io), KVT_ECORRUPT);
    cr_assert_eq(io.status, KVT_ECORRUPT);
    cr_assert_eq(memcmp(buf, zero, len), 0, "a corrupt block hands out no bytes");
    kvt_tier_usage_t u;
    kvt_tier_usage(t, &u);
    cr_assert_eq(u.reads, 1, "counted a read at completion");
    kvt_tier_read_corrupt(t, &io);
    kvt_tier_usage(t, &u);
    cr_assert_eq(u.reads, 0);
    cr_assert_eq(u.read_bytes, 0);
    cr_assert_eq(u.corrupt, 1);
    cr_assert_eq(kvt_tier_dropped(t), 1);
    kvt_block_key_t k1 = tu_key(1, tok, 16);
    cr_assert_eq(read_io(t, &io, &k1, locs[1], buf, len, 1), KVT_ECORRUPT, "the header");
    cr_assert(!io.unchecked);
    kvt_block_key_t k2 = tu_key(2, tok, 16);
    cr_assert_eq(read_io(t, &io, &k2, locs[2], buf, len, 1), 0);
    cr_assert(io.unchecked);
    cr_assert_eq(kvt_tier_read_check(&io), 0);
    cr_assert(tu_same(buf, len, 2));
    cr_assert_eq(read_io(t, &io, &k0, locs[0], buf, len, 0), KVT_ECORRUPT, "checked here");
    cr_assert(!io.unchecked);
    kvt_tier_usage(t, &u);
    cr_assert_eq(u.corrupt, 3);
    cr_assert_eq(u.reads, 1);
    free(zero);
    free(buf);
    kvt_tier_destroy(t);
    tu_rmrf(dir);
}

/* A tmpfs of `size` (mount's size= option) on a new directory dir, in this test's own mount
 * namespace; sub: dir/data, for the tier (not yet made). */
static void tiny_fs(char *dir, size_t dir_size, const char *name, const char *size, char *sub,
                    size_t sub_size)
{
    private_mounts();
    tu_tmpdir(dir, dir_size, name);
    char opt[64];
    snprintf(opt, sizeof(opt), "size=%s", size);
    cr_assert_eq(mount("tmpfs", dir, "tmpfs", 0, opt), 0, "mount: %s", strerror(errno));
    snprintf(sub, sub_size, "%s/data", dir);
}

Test(tier_nvme, a_full_file_system_gives_a_clear_error_and_changes_nothing)
{
    char dir[4096], sub[4200];
    tiny_fs(dir, sizeof(dir), "tinyfs", "4m", sub, sizeof(sub));
    /* Preallocation that cannot fit: refused, and nothing is left behind. */
    kvt_tier_t *t = NULL;
    kvt_tier_nvme_conf_t c = {.dir = sub, .capacity_bytes = 16u << 20, .segment_bytes = 1u << 20};
    cr_assert_eq(kvt_tier_nvme_create(&t, &c), KVT_ENOSPC);
    char data[4300];
    snprintf(data, sizeof(data), "%s/kvtier.data", sub);
    cr_assert_neq(access(data, F_OK), 0, "no data file left behind");
    /* Sparse: the file system fills up under writes. */
    c.sparse = 1;
    cr_assert_eq(kvt_tier_nvme_create(&t, &c), 0);
    const uint32_t len = 256u << 10;
    uint8_t *buf = tu_aligned(len);
    uint32_t tok[16];
    uint64_t locs[64];
    int n = 0, rc = 0;
    for (; n < 64; n++) {
        kvt_block_key_t k = tu_key((uint64_t)n, tok, 16);
        tu_fill(buf, len, (uint64_t)n);
        kvt_tier_usage_t before, after;
        kvt_tier_usage(t, &before);
        rc = tu_write(t, &k, buf, len, &locs[n]);
        kvt_tier_usage(t, &after);
        if (rc != 0) {
            cr_assert_eq(after.used_bytes, before.used_bytes, "a failed write changes nothing");
            cr_assert_eq(after.blocks, before.blocks);
            cr_assert_eq(locs[n], 0);
            break;
        }
    }
    cr_assert_eq(rc, KVT_ENOSPC, "got %s after %d blocks", kvt_strerror(rc), n);
    cr_assert_gt(n, 4);
    for (int i = 0; i < n; i++) {
        kvt_block_key_t k = tu_key((uint64_t)i, tok, 16);
        cr_assert_eq(tu_read(t, &k, locs[i], buf, len), 0);
        cr_assert(tu_same(buf, len, (uint64_t)i));
    }
    kvt_tier_usage_t u;
    kvt_tier_usage(t, &u);
    cr_assert_eq(u.blocks, (uint64_t)n);
    /* Room again: the next write lands, and a restart finds every block (what the failed write
     * left on disk is skipped as torn). */
    cr_assert_eq(mount(NULL, dir, NULL, MS_REMOUNT, "size=8m"), 0, "remount: %s", strerror(errno));
    kvt_block_key_t kx = tu_key(1000, tok, 16);
    tu_fill(buf, len, 1000);
    uint64_t lx = 0;
    cr_assert_eq(tu_write(t, &kx, buf, len, &lx), 0);
    kvt_tier_destroy(t);
    cr_assert_eq(kvt_tier_nvme_create(&t, &c), 0);
    kvt_tier_nvme_recovery_t r;
    kvt_tier_nvme_recovery(t, &r);
    cr_assert_eq(r.recovered, (uint64_t)n + 1, "recovered %llu of %d",
                 (unsigned long long)r.recovered, n + 1);
    kx = tu_key(1000, tok, 16);
    cr_assert_eq(tu_read(t, &kx, lx, buf, len), 0);
    cr_assert(tu_same(buf, len, 1000));
    free(buf);
    kvt_tier_destroy(t);
    umount(dir);
    tu_rmrf(dir);
}

typedef struct ordered_io {
    kvt_tier_io_t io;
    uint32_t tok[16];
    int *next; /* the order counter */
    int at;    /* 1 + how many completed before it */
} ordered_io_t;

static void ordered_cb(kvt_tier_io_t *io)
{
    ordered_io_t *o = io->data;
    o->at = ++*o->next;
}

/* With every request slot taken, a read a client waits for (io->urgent) gets the next free slot
 * ahead of the writes queued before it; a plain read waits its turn behind them. */
Test(tier_nvme, urgent_reads_pass_queued_writes)
{
    char dir[4096];
    tu_tmpdir(dir, sizeof(dir), "nvurgent");
    kvt_tier_t *t = mk(dir, 16u << 20, 2u << 20, 2);
    enum { N = 32, LEN = 64 << 10, RLEN = 5000 };
    uint8_t *rbuf = tu_aligned(RLEN), *wbuf = tu_aligned(LEN);
    uint32_t rtok[16];
    kvt_block_key_t rk = tu_key(7000, rtok, 16);
    tu_fill(rbuf, RLEN, 7000);
    uint64_t rloc = 0;
    cr_assert_eq(tu_write(t, &rk, rbuf, RLEN, &rloc), 0);
    tu_fill(wbuf, LEN, 1);
    ordered_io_t *o = calloc(N + 2, sizeof(*o));
    uint8_t *back = tu_aligned(2 * RLEN);
    int next = 0;
    for (int i = 0; i < N + 2; i++) {
        int rd = i >= N; /* the last two: reads of rk's block, urgent then plain */
        o[i].io = (kvt_tier_io_t){.key = tu_key(rd ? 7000 : (uint64_t)i, o[i].tok, 16),
                                  .buf = rd ? back + (size_t)(i - N) * RLEN : wbuf,
                                  .len = rd ? RLEN : LEN,
                                  .loc = rd ? rloc : 0,
                                  .urgent = i == N,
                                  .cb = ordered_cb,
                                  .data = &o[i]};
        o[i].next = &next;
        cr_assert_eq(rd ? kvt_tier_read(t, &o[i].io) : kvt_tier_write(t, &o[i].io), 0);
    }
    for (int k = 0; k < 2000 && next < N + 2; k++)
        kvt_tier_wait(t, 10);
    cr_assert_eq(next, N + 2, "%d of %d completed", next, N + 2);
    for (int i = 0; i < N + 2; i++)
        cr_assert_eq(o[i].io.status, 0, "request %d: %s", i, kvt_strerror(o[i].io.status));
    cr_assert_leq(o[N].at, 2 * 2 + 1, "the urgent read came back %d-th", o[N].at);
    cr_assert_geq(o[N + 1].at, N, "the plain read came back %d-th", o[N + 1].at);
    cr_assert(tu_same(back, RLEN, 7000) && tu_same(back + RLEN, RLEN, 7000));
    free(o);
    free(back);
    free(wbuf);
    free(rbuf);
    kvt_tier_destroy(t);
    tu_rmrf(dir);
}

/* Fills the file system under dir; returns the path of the file that fills it. */
static void fill_fs(const char *dir, char *path, size_t size)
{
    snprintf(path, size, "%s/filler", dir);
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    cr_assert_geq(fd, 0);
    static uint8_t z[4096];
    while (write(fd, z, sizeof(z)) == (ssize_t)sizeof(z))
        ;
    close(fd);
}

/* A segment's first record that failed with nothing written leaves the segment unusable: the
 * scan reads a segment from its first record, so anything written after it there would be lost
 * at the next restart. The tier opens another segment instead. */
Test(tier_nvme, a_segment_whose_first_record_failed_takes_no_other)
{
    char dir[4096], sub[4200], filler[4300];
    tiny_fs(dir, sizeof(dir), "firstfail", "8m", sub, sizeof(sub));
    kvt_tier_t *t = NULL;
    kvt_tier_nvme_conf_t c = {
        .dir = sub, .capacity_bytes = 4u << 20, .segment_bytes = 1u << 20, .sparse = 1};
    cr_assert_eq(kvt_tier_nvme_create(&t, &c), 0);
    const uint32_t len = 256u << 10; /* three records fill a segment */
    uint8_t *buf = tu_aligned(len);
    uint32_t tok[16];
    uint64_t locs[4];
    tu_write_n(t, 3, buf, len, tok, locs);
    fill_fs(dir, filler, sizeof(filler));
    kvt_block_key_t k3 = tu_key(3, tok, 16);
    tu_fill(buf, len, 3);
    cr_assert_eq(tu_write(t, &k3, buf, len, &locs[3]), KVT_ENOSPC, "segment 1's first record");
    cr_assert_eq(unlink(filler), 0);
    cr_assert_eq(tu_write(t, &k3, buf, len, &locs[3]), 0);
    kvt_tier_destroy(t);
    cr_assert_eq(kvt_tier_nvme_create(&t, &c), 0);
    kvt_tier_nvme_recovery_t r;
    kvt_tier_nvme_recovery(t, &r);
    cr_assert_eq(r.recovered, 4, "recovered %llu of 4", (unsigned long long)r.recovered);
    for (int i = 0; i < 4; i++) {
        kvt_block_key_t k = tu_key((uint64_t)i, tok, 16);
        cr_assert_eq(tu_read(t, &k, locs[i], buf, len), 0, "block %d", i);
        cr_assert(tu_same(buf, len, (uint64_t)i), "block %d", i);
    }
    free(buf);
    kvt_tier_destroy(t);
    umount(dir);
    tu_rmrf(dir);
}

Test(tier_nvme, bad_configuration_is_refused)
{
    char dir[4096];
    tu_tmpdir(dir, sizeof(dir), "nvme");
    kvt_tier_t *t = NULL;
    kvt_tier_nvme_conf_t c = {.dir = dir, .capacity_bytes = 1u << 20, .segment_bytes = 1u << 20};
    cr_assert_eq(kvt_tier_nvme_create(&t, &c), KVT_EINVAL, "one segment is not a log");
    c = (kvt_tier_nvme_conf_t){.dir = dir, .capacity_bytes = 8u << 20, .segment_bytes = 12345};
    cr_assert_eq(kvt_tier_nvme_create(&t, &c), KVT_EINVAL);
    c = (kvt_tier_nvme_conf_t){.dir = dir, .capacity_bytes = 8u << 20, .queue_depth = 1};
    cr_assert_eq(kvt_tier_nvme_create(&t, &c), KVT_EINVAL);
    c = (kvt_tier_nvme_conf_t){.dir = NULL, .capacity_bytes = 8u << 20};
    cr_assert_eq(kvt_tier_nvme_create(&t, &c), KVT_EINVAL);
    c = (kvt_tier_nvme_conf_t){.dir = dir, .capacity_bytes = 8u << 20, .direct = 5};
    cr_assert_eq(kvt_tier_nvme_create(&t, &c), KVT_EINVAL);
    /* A data file made with another geometry is left alone. */
    c = (kvt_tier_nvme_conf_t){.dir = dir, .capacity_bytes = 8u << 20, .segment_bytes = 1u << 20};
    cr_assert_eq(kvt_tier_nvme_create(&t, &c), 0);
    uint32_t tok[16];
    kvt_block_key_t k = tu_key(1, tok, 16);
    uint8_t buf[1000];
    tu_fill(buf, sizeof(buf), 1);
    uint64_t loc = 0;
    cr_assert_eq(tu_write(t, &k, buf, sizeof(buf), &loc), 0);
    kvt_tier_destroy(t);
    c.segment_bytes = 2u << 20;
    cr_assert_eq(kvt_tier_nvme_create(&t, &c), KVT_EINVAL);
    c.segment_bytes = 1u << 20;
    c.capacity_bytes = 16u << 20;
    cr_assert_eq(kvt_tier_nvme_create(&t, &c), KVT_EINVAL);
    c.capacity_bytes = 8u << 20;
    cr_assert_eq(kvt_tier_nvme_create(&t, &c), 0);
    /* A block whose record would not fit one segment is refused up front. */
    uint8_t *big = tu_aligned(1u << 20);
    kvt_block_key_t kb = tu_key(2, tok, 16);
    kvt_tier_usage_t before, after;
    kvt_tier_usage(t, &before);
    cr_assert_eq(tu_write(t, &kb, big, 1u << 20, NULL), KVT_ETOOBIG);
    kvt_tier_usage(t, &after);
    cr_assert_eq(after.used_bytes, before.used_bytes);
    cr_assert_eq(after.blocks, before.blocks);
    free(big);
    kvt_block_key_t k1 = tu_key(1, tok, 16);
    k = k1;
    memset(buf, 0, sizeof(buf));
    cr_assert_eq(tu_read(t, &k, loc, buf, sizeof(buf)), 0, "the block survived the refusals");
    cr_assert(tu_same(buf, sizeof(buf), 1));
    kvt_tier_destroy(t);
    tu_rmrf(dir);
}

/* One tier per directory: a second one on the same data-dir (another kvtierd given the same
 * directory) is refused with EBUSY, names the holder's pid, and touches nothing: the first
 * reads back what it wrote, and once it is gone the directory opens again, its block found. */
Test(tier_nvme, a_second_tier_on_the_same_directory_is_refused)
{
    char dir[4096];
    tu_tmpdir(dir, sizeof(dir), "nvme");
    kvt_tier_t *t = mk(dir, 4u << 20, 1u << 20, 8);
    const uint32_t len = 64u << 10;
    uint8_t *buf = tu_aligned(len);
    uint32_t tok[16];
    kvt_block_key_t k = tu_key(7, tok, 16);
    tu_fill(buf, len, 7);
    uint64_t loc = 0;
    cr_assert_eq(tu_write(t, &k, buf, len, &loc), 0);
    kvt_tier_t *t2 = NULL;
    kvt_tier_nvme_conf_t c = {.dir = dir, .capacity_bytes = 4u << 20, .segment_bytes = 1u << 20};
    cr_assert_eq(kvt_tier_nvme_create(&t2, &c), KVT_EBUSY);
    cr_assert_null(t2);
    char lock[4200], pid[32] = {0};
    snprintf(lock, sizeof(lock), "%s/kvtier.lock", dir);
    FILE *f = fopen(lock, "r");
    cr_assert(f && fgets(pid, sizeof(pid), f));
    fclose(f);
    cr_expect_eq(atol(pid), (long)getpid(), "the lock file names its holder");
    memset(buf, 0, len);
    cr_assert_eq(tu_read(t, &k, loc, buf, len), 0);
    cr_assert(tu_same(buf, len, 7), "the refused tier touched nothing");
    kvt_tier_destroy(t);
    t2 = mk(dir, 4u << 20, 1u << 20, 8);
    kvt_tier_usage_t u;
    kvt_tier_usage(t2, &u);
    cr_expect_eq(u.blocks, 1, "the block is recovered once the directory is free");
    kvt_tier_destroy(t2);
    free(buf);
    tu_rmrf(dir);
}
