/*
 * test_tier_nvme_recover.c: the NVMe tier's warm restart. Reopening a data directory finds the
 * blocks written before; a child process writing blocks is killed with SIGKILL and the parent
 * finds every block the child saw completed; a torn last write and an overwritten prefix are
 * skipped; the newest copy of a block wins; and kvt_store_nvme_recover() rebuilds the radix
 * entries of recovered prefixes by following parent hashes, freeing blocks whose ancestors are
 * gone; a block behind a gap comes back after the path recorded for it (DIR/kvtier.paths), whose
 * damaged records are skipped and which is compacted as it grows; segments of 256 MiB recover in
 * a few MiB of memory; records whose checksums were made ahead of the write (a PUT's) recover and
 * are checked as the others.
 */
#include "test_tier_util.h"
#include "test_rss.h"

#include "radix.h"
#include "server.h" /* kvt_store_nvme_recover: the daemon feeds what the tier yields to the tree */

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>

static kvt_tier_t *open_tier(const char *dir)
{
    kvt_tier_t *t = NULL;
    kvt_tier_nvme_conf_t c = {
        .dir = dir, .capacity_bytes = 16u << 20, .segment_bytes = 2u << 20, .queue_depth = 8};
    int rc = kvt_tier_nvme_create(&t, &c);
    cr_assert_eq(rc, 0, "open %s: %s", dir, kvt_strerror(rc));
    return t;
}

/* The tier on dir opened again, and what its recovery scan found in r. */
static kvt_tier_t *reopen(const char *dir, kvt_tier_nvme_recovery_t *r)
{
    kvt_tier_t *t = open_tier(dir);
    kvt_tier_nvme_recovery(t, r);
    return t;
}

static uint32_t len_of(int i)
{
    return 40000 + 7919u * (uint32_t)i;
}

/* Checks blocks 0 .. n-1 written by write_blocks: those whose bit is set in gone are not there,
 * the others read back byte-exact. */
static void check_blocks(kvt_tier_t *t, int n, uint32_t (*tok)[16], const uint64_t *locs,
                         uint32_t gone)
{
    uint8_t *buf = tu_aligned(len_of(n));
    for (int i = 0; i < n; i++) {
        kvt_block_key_t k = tu_key((uint64_t)i, tok[i], 16);
        int lost = (gone >> i) & 1;
        cr_assert_eq(kvt_tier_valid(t, locs[i], &k), !lost, "block %d", i);
        if (lost)
            continue;
        cr_assert_eq(tu_read(t, &k, locs[i], buf, len_of(i)), 0, "block %d", i);
        cr_assert(tu_same(buf, len_of(i), (uint64_t)i), "block %d", i);
    }
    free(buf);
}

/* The SIGKILL test's blocks: TOTAL of them, each buffer BLOCK_MAX bytes (4 KiB-aligned) for the
 * longest, len_of(TOTAL - 1). */
enum { TOTAL = 48, BLOCK_MAX = 412u << 10 };
_Static_assert(40000 + 7919u * (TOTAL - 1) <= BLOCK_MAX, "a buffer holds the longest block");

Test(tier_nvme_recover, reopening_finds_the_blocks_again)
{
    char dir[4096];
    tu_tmpdir(dir, sizeof(dir), "nvrec");
    kvt_tier_t *t = open_tier(dir);
    enum { N = 24 };
    uint32_t tok[N][16];
    uint64_t locs[N];
    uint8_t *buf = tu_aligned(len_of(N));
    for (int i = 0; i < N; i++) {
        kvt_block_key_t k = tu_key((uint64_t)i, tok[i], 16);
        tu_fill(buf, len_of(i), (uint64_t)i);
        cr_assert_eq(tu_write(t, &k, buf, len_of(i), &locs[i]), 0);
    }
    kvt_tier_usage_t before;
    kvt_tier_usage(t, &before);
    kvt_tier_destroy(t);

    kvt_tier_nvme_recovery_t r;
    t = reopen(dir, &r);
    cr_assert_eq(r.scanned, N);
    cr_assert_eq(r.recovered, N);
    cr_assert_eq(r.torn + r.stale + r.gaps, 0);
    kvt_tier_usage_t u;
    kvt_tier_usage(t, &u);
    cr_assert_eq(u.blocks, N);
    cr_assert_eq(u.used_bytes, before.used_bytes, "the same charge as before the restart");
    for (int i = 0; i < N; i++) {
        kvt_block_key_t k = tu_key((uint64_t)i, tok[i], 16);
        cr_assert_eq(kvt_tier_valid(t, locs[i], &k), 1);
        cr_assert_eq(tu_read(t, &k, locs[i], buf, len_of(i)), 0);
        cr_assert(tu_same(buf, len_of(i), (uint64_t)i), "block %d after restart", i);
    }
    /* New writes go to a fresh segment and survive the next restart as well. */
    kvt_block_key_t k = tu_key(1000, tok[0], 16);
    tu_fill(buf, 5000, 1000);
    uint64_t loc = 0;
    cr_assert_eq(tu_write(t, &k, buf, 5000, &loc), 0);
    kvt_tier_destroy(t);
    t = reopen(dir, &r);
    cr_assert_eq(r.recovered, N + 1);
    cr_assert_eq(tu_read(t, &k, loc, buf, 5000), 0);
    cr_assert(tu_same(buf, 5000, 1000));
    free(buf);
    kvt_tier_destroy(t);
    tu_rmrf(dir);
}

typedef struct done_rec {
    int32_t i;
    uint64_t loc;
} done_rec_t;

/* One request slot of the child, with its own buffer and key. */
typedef struct child_slot {
    kvt_tier_io_t io;
    uint32_t tok[16];
    int busy;
    int index;
    int fd;
} child_slot_t;

static void child_cb(kvt_tier_io_t *io)
{
    child_slot_t *s = io->data;
    if (io->status != 0)
        _exit(5);
    done_rec_t d = {s->index, io->loc};
    if (write(s->fd, &d, sizeof(d)) != (ssize_t)sizeof(d))
        _exit(3);
    s->busy = 0;
}

/* The child: writes 48 blocks with 4 in flight, reports each completion on fd, then waits to
 * be killed. */
static void child_main(const char *dir, int fd)
{
    kvt_tier_t *t = NULL;
    kvt_tier_nvme_conf_t c = {
        .dir = dir, .capacity_bytes = 16u << 20, .segment_bytes = 2u << 20, .queue_depth = 8};
    if (kvt_tier_nvme_create(&t, &c) != 0)
        _exit(2);
    enum { K = 4 };
    static child_slot_t slots[K];
    uint8_t *bufs = NULL;
    if (posix_memalign((void **)&bufs, 4096, (size_t)K * BLOCK_MAX) != 0)
        _exit(2);
    int next = 0;
    uint64_t deadline = kvt_now_ns() + 15ull * 1000000000ull;
    for (;;) {
        for (int k = 0; k < K && next < TOTAL; k++) {
            child_slot_t *s = &slots[k];
            if (s->busy)
                continue;
            uint8_t *b = bufs + (size_t)k * BLOCK_MAX;
            tu_fill(b, len_of(next), (uint64_t)next);
            s->index = next;
            s->fd = fd;
            s->io = (kvt_tier_io_t){.key = tu_key((uint64_t)next, s->tok, 16),
                                    .buf = b,
                                    .len = len_of(next),
                                    .cb = child_cb,
                                    .data = s};
            if (kvt_tier_write(t, &s->io) != 0)
                _exit(4);
            s->busy = 1;
            next++;
        }
        if (kvt_tier_wait(t, 100) < 0)
            _exit(6);
        if (kvt_now_ns() > deadline)
            _exit(7);
        int idle = next >= TOTAL;
        for (int k = 0; k < K; k++)
            idle = idle && !slots[k].busy;
        if (idle)
            pause(); /* everything written: wait for the kill */
    }
}

Test(tier_nvme_recover, blocks_written_before_sigkill_are_found_again)
{
    char dir[4096];
    tu_tmpdir(dir, sizeof(dir), "nvkill");
    int p[2];
    cr_assert_eq(pipe(p), 0);
    pid_t pid = fork();
    if (pid == 0) {
        /* No Criterion call in here: its messages must come from the test process only. The
         * child dies with its parent, and on its own after a minute at the latest, so that a
         * failing parent never leaves it holding the test's output open. */
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        alarm(60);
        close(p[0]);
        child_main(dir, p[1]);
        _exit(0);
    }
    cr_assert_geq(pid, 0);
    close(p[1]);
    done_rec_t recs[64];
    int n = 0;
    /* Kill it mid-run, with writes still in flight. */
    while (n < 20) {
        ssize_t got = read(p[0], &recs[n], sizeof(recs[n]));
        cr_assert_eq(got, (ssize_t)sizeof(recs[n]), "the child died early");
        n++;
    }
    cr_assert_eq(kill(pid, SIGKILL), 0);
    int st;
    cr_assert_eq(waitpid(pid, &st, 0), pid);
    cr_assert(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL);
    /* Completions reported before the kill landed, whatever the parent had not read yet. */
    ssize_t got;
    while (n < 64 && (got = read(p[0], &recs[n], sizeof(recs[n]))) == (ssize_t)sizeof(recs[n]))
        n++;
    close(p[0]);

    kvt_tier_nvme_recovery_t r;
    kvt_tier_t *t = reopen(dir, &r);
    cr_assert_geq(r.recovered, (uint64_t)n, "recovered %llu, %d were complete",
                  (unsigned long long)r.recovered, n);
    uint8_t *buf = tu_aligned(BLOCK_MAX);
    uint32_t tok[16];
    for (int k = 0; k < n; k++) {
        kvt_block_key_t key = tu_key((uint64_t)recs[k].i, tok, 16);
        cr_assert_eq(kvt_tier_valid(t, recs[k].loc, &key), 1, "block %d", recs[k].i);
        cr_assert_eq(tu_read(t, &key, recs[k].loc, buf, len_of(recs[k].i)), 0);
        cr_assert(tu_same(buf, len_of(recs[k].i), (uint64_t)recs[k].i), "block %d", recs[k].i);
    }
    free(buf);
    kvt_tier_destroy(t);
    tu_rmrf(dir);
}

/* The data file of the tier in dir, opened with flags. */
static int data_open(const char *dir, int flags)
{
    char p[4200];
    snprintf(p, sizeof(p), "%s/kvtier.data", dir);
    int fd = open(p, flags);
    cr_assert_geq(fd, 0, "%s: %s", p, strerror(errno));
    return fd;
}

/* Writes len bytes of buf (zeros when NULL) at off of the data file in dir. */
static void overwrite_with(const char *dir, uint64_t off, const void *buf, size_t len)
{
    int fd = data_open(dir, O_RDWR);
    uint8_t *z = buf ? NULL : calloc(1, len);
    cr_assert_eq(pwrite(fd, buf ? buf : z, len, (off_t)off), (ssize_t)len);
    cr_assert_eq(fsync(fd), 0);
    free(z);
    close(fd);
}

static void overwrite(const char *dir, uint64_t off, size_t len)
{
    overwrite_with(dir, off, NULL, len);
}

/* Records of blocks written one after another from the start of segment 0. */
static uint64_t rec_size(uint32_t len)
{
    return 4096 + ((uint64_t)len + 4095) / 4096 * 4096;
}

/* Writes blocks 0 .. n-1 (block i: len_of(i) bytes of seed i under tu_key(i)) one after another;
 * their locations in locs, and, when offs is not NULL, their records' offsets from the start of
 * a fresh tier's first segment in offs[0 .. n] (offs[n]: where the next would go). */
static void write_blocks(kvt_tier_t *t, int n, uint32_t (*tok)[16], uint64_t *locs, uint64_t *offs)
{
    uint8_t *buf = tu_aligned(len_of(n));
    if (offs)
        offs[0] = 0;
    for (int i = 0; i < n; i++) {
        kvt_block_key_t k = tu_key((uint64_t)i, tok[i], 16);
        tu_fill(buf, len_of(i), (uint64_t)i);
        cr_assert_eq(tu_write(t, &k, buf, len_of(i), &locs[i]), 0);
        if (offs)
            offs[i + 1] = offs[i] + rec_size(len_of(i));
    }
    free(buf);
}

Test(tier_nvme_recover, a_torn_last_write_is_skipped)
{
    char dir[4096];
    tu_tmpdir(dir, sizeof(dir), "nvtorn");
    kvt_tier_t *t = open_tier(dir);
    enum { N = 5 };
    uint32_t tok[N][16];
    uint64_t locs[N], off = 0, last_off = 0;
    uint8_t *buf = tu_aligned(len_of(N));
    for (int i = 0; i < N; i++) {
        kvt_block_key_t k = tu_key((uint64_t)i, tok[i], 16);
        tu_fill(buf, len_of(i), (uint64_t)i);
        cr_assert_eq(tu_write(t, &k, buf, len_of(i), &locs[i]), 0);
        last_off = off;
        off += rec_size(len_of(i));
    }
    kvt_tier_destroy(t);
    /* The last record lost its final sectors: header intact, payload short. */
    overwrite(dir, off - 8192, 8192);
    kvt_tier_nvme_recovery_t r;
    t = reopen(dir, &r);
    cr_assert_eq(r.recovered, N - 1);
    cr_assert_eq(r.torn, 1);
    kvt_block_key_t k = tu_key(N - 1, tok[N - 1], 16);
    cr_assert_eq(kvt_tier_valid(t, locs[N - 1], &k), 0);
    cr_assert_eq(tu_read(t, &k, locs[N - 1], buf, len_of(N - 1)), KVT_ENOENT);
    for (int i = 0; i < N - 1; i++) {
        kvt_block_key_t ki = tu_key((uint64_t)i, tok[i], 16);
        cr_assert_eq(tu_read(t, &ki, locs[i], buf, len_of(i)), 0);
        cr_assert(tu_same(buf, len_of(i), (uint64_t)i));
    }
    kvt_tier_destroy(t);
    /* The last record's first sector gone too: the scan ends before it, nothing torn counted. */
    overwrite(dir, last_off, 4096);
    t = reopen(dir, &r);
    cr_assert_eq(r.recovered, N - 1);
    cr_assert_eq(r.torn, 0);
    cr_assert_eq(r.gaps, 0, "the end of the records is no gap");
    free(buf);
    kvt_tier_destroy(t);
    tu_rmrf(dir);
}

/*
 * Records whose checksums were made ahead of their writes (kvt_tier_write_prepare, as a PUT's
 * NVMe pages are, with no lock held), every other one, from aligned and unaligned buffers: each
 * reads back and is found again by a restart's scan, which verifies its checksum, as the others
 * are; one whose payload is damaged on the disk is caught there (torn) and never read back.
 */
Test(tier_nvme_recover, records_written_with_a_prepared_checksum_verify_as_any)
{
    char dir[4096];
    tu_tmpdir(dir, sizeof(dir), "nvprep");
    kvt_tier_t *t = open_tier(dir);
    enum { N = 6, BAD = 2 };
    uint32_t tok[N][16];
    uint64_t locs[N], offs[N + 1] = {0};
    uint8_t *buf = tu_aligned(len_of(N) + 1);
    for (int i = 0; i < N; i++) {
        kvt_block_key_t k = tu_key((uint64_t)i, tok[i], 16);
        uint8_t *from = buf + (i % 4 >= 2); /* two aligned, two not, ... */
        tu_fill(from, len_of(i), (uint64_t)i);
        cr_assert_eq(tu_write_as(t, &k, from, len_of(i), &locs[i], i % 2 == 0), 0, "block %d", i);
        offs[i + 1] = offs[i] + rec_size(len_of(i));
    }
    check_blocks(t, N, tok, locs, 0);
    kvt_tier_destroy(t);
    kvt_tier_nvme_recovery_t r;
    t = reopen(dir, &r);
    cr_assert_eq(r.recovered, N);
    cr_assert_eq(r.torn + r.stale, 0);
    check_blocks(t, N, tok, locs, 0);
    kvt_tier_destroy(t);
    /* A byte in the middle of a prepared record's payload. */
    uint64_t at = offs[BAD] + 4096 + len_of(BAD) / 2;
    uint8_t flip = 0;
    int fd = data_open(dir, O_RDONLY);
    cr_assert_eq(pread(fd, &flip, 1, (off_t)at), 1);
    close(fd);
    flip ^= 0x40;
    overwrite_with(dir, at, &flip, 1);
    t = reopen(dir, &r);
    cr_assert_eq(r.recovered, N - 1);
    cr_assert_eq(r.torn, 1);
    check_blocks(t, N, tok, locs, 1u << BAD);
    free(buf);
    kvt_tier_destroy(t);
    tu_rmrf(dir);
}

/* Whether the data file in dir holds anything but zeros in the sector at off. */
static int sector_written(const char *dir, uint64_t off)
{
    int fd = data_open(dir, O_RDONLY);
    uint8_t b[4096];
    cr_assert_eq(pread(fd, b, sizeof(b), (off_t)off), (ssize_t)sizeof(b));
    close(fd);
    for (size_t i = 0; i < sizeof(b); i++)
        if (b[i])
            return 1;
    return 0;
}

/* The scan reads a segment from its first record, so none of the segment's other records may
 * reach the disk without it: they start only once it has completed. */
Test(tier_nvme_recover, a_segment_takes_no_record_before_its_first_has_landed)
{
    char dir[4096];
    tu_tmpdir(dir, sizeof(dir), "nvfirst");
    kvt_tier_t *t = open_tier(dir);
    enum { N = 3, LEN = 40000 };
    kvt_tier_io_t ios[N];
    uint32_t toks[N][16];
    uint8_t *bufs = tu_aligned((size_t)N * LEN);
    int done = 0;
    tu_write_burst(t, ios, toks, bufs, N, LEN, 500, &done);
    /* Nothing processed yet: the first write is with the kernel, the other two wait for its
     * completion to be seen. */
    usleep(300 * 1000);
    cr_assert_eq(sector_written(dir, rec_size(LEN)), 0, "the second record started early");
    cr_assert_eq(sector_written(dir, 2 * rec_size(LEN)), 0, "the third record started early");
    cr_assert(tu_drive(t, &done, N));
    for (int i = 0; i < N; i++) {
        cr_assert_eq(ios[i].status, 0);
        cr_assert(sector_written(dir, (uint64_t)i * rec_size(LEN)), "record %d", i);
    }

    /* A write that opens the next segment does not wait for this one's first record: A opens
     * segment 1 (segment 0 has no room left for it) and leaves it too little for B, which opens
     * segment 2 while A is in flight. */
    uint32_t big = (2u << 20) - 2 * 4096;
    uint8_t *b = tu_aligned(big);
    tu_fill(b, big, 7);
    uint32_t tok2[2][16];
    int done2 = 0;
    kvt_tier_io_t w[2] = {
        {.key = tu_key(600, tok2[0], 16), .buf = b, .len = big, .cb = tu_count_cb, .data = &done2},
        {.key = tu_key(601, tok2[1], 16), .buf = b, .len = LEN, .cb = tu_count_cb, .data = &done2},
    };
    cr_assert_eq(kvt_tier_write(t, &w[0]), 0);
    cr_assert_eq(kvt_tier_write(t, &w[1]), 0);
    uint64_t seg2 = 2 * (2u << 20);
    for (int k = 0; k < 500 && !sector_written(dir, seg2); k++)
        usleep(10 * 1000); /* not processed meanwhile */
    cr_assert(sector_written(dir, seg2), "the next segment's first record was held back");
    cr_assert(tu_drive(t, &done2, 2));
    cr_assert_eq(w[0].status, 0);
    cr_assert_eq(w[1].status, 0);
    free(b);
    free(bufs);
    kvt_tier_destroy(t);

    kvt_tier_nvme_recovery_t r;
    t = reopen(dir, &r);
    cr_assert_eq(r.recovered, N + 2);
    cr_assert_eq(r.torn + r.gaps, 0);
    kvt_tier_destroy(t);
    tu_rmrf(dir);
}

/* Writes complete out of order, and SIGKILL cancels writes still queued in io_uring: a record can
 * be missing with completed ones after it. The scan finds those. */
Test(tier_nvme_recover, records_after_one_that_never_landed_are_found)
{
    char dir[4096];
    tu_tmpdir(dir, sizeof(dir), "nvgap");
    kvt_tier_t *t = open_tier(dir);
    enum { N = 7 };
    uint32_t tok[N][16];
    uint64_t locs[N], offs[N + 1];
    uint8_t *buf = tu_aligned(len_of(N));
    write_blocks(t, N, tok, locs, offs);
    cr_assert_lt(offs[N], 2u << 20, "all in segment 0");
    kvt_tier_destroy(t);
    /* Record 2 never written at all; records 4 and 5 neither, back to back. */
    overwrite(dir, offs[2], offs[3] - offs[2]);
    overwrite(dir, offs[4], offs[6] - offs[4]);
    kvt_tier_nvme_recovery_t r;
    t = reopen(dir, &r);
    cr_assert_eq(r.recovered, N - 3);
    cr_assert_eq(r.gaps, 2);
    cr_assert_eq(r.torn + r.stale, 0);
    check_blocks(t, N, tok, locs, 1u << 2 | 1u << 4 | 1u << 5);
    kvt_tier_destroy(t);

    /* An intact record of another use of a segment (another stamp: here, another directory's) in
     * the gap is not taken for one of this use. */
    char other[4096];
    tu_tmpdir(other, sizeof(other), "nvgap2");
    t = open_tier(other);
    uint32_t otok[16];
    kvt_block_key_t ok = tu_key(99, otok, 16);
    tu_fill(buf, 60000, 99);
    uint64_t oloc = 0;
    cr_assert_eq(tu_write(t, &ok, buf, 60000, &oloc), 0);
    kvt_tier_destroy(t);
    size_t olen = rec_size(60000);
    cr_assert_leq(olen, offs[6] - offs[4]);
    uint8_t *orec = malloc(olen);
    int fd = data_open(other, O_RDONLY);
    cr_assert_eq(pread(fd, orec, olen, 0), (ssize_t)olen);
    close(fd);
    overwrite_with(dir, offs[4], orec, olen);
    free(orec);
    t = reopen(dir, &r);
    cr_assert_eq(r.recovered, N - 3);
    cr_assert_eq(r.gaps, 2);
    cr_assert_eq(r.torn, 0);
    cr_assert_eq(kvt_tier_valid(t, oloc, &ok), 0);
    kvt_tier_usage_t u;
    kvt_tier_usage(t, &u);
    cr_assert_eq(u.blocks, N - 3);
    free(buf);
    kvt_tier_destroy(t);
    tu_rmrf(other);
    tu_rmrf(dir);
}

/* A block discarded (a client removed it) or only freed (the policy dropped it, or moved it to
 * another tier) stays gone after a restart, the first record of a segment included: kvtier.live
 * no longer marks it live. Freed blocks used to come back. */
Test(tier_nvme_recover, freed_and_discarded_blocks_stay_gone_after_a_restart)
{
    char dir[4096];
    tu_tmpdir(dir, sizeof(dir), "nvdiscard");
    kvt_tier_t *t = open_tier(dir);
    enum { N = 5 };
    uint32_t tok[N][16];
    uint64_t locs[N];
    write_blocks(t, N, tok, locs, NULL);
    kvt_tier_discard(t, locs[0], len_of(0));
    kvt_tier_discard(t, locs[2], len_of(2));
    kvt_tier_free(t, locs[3], len_of(3));
    kvt_tier_usage_t u;
    kvt_tier_usage(t, &u);
    cr_assert_eq(u.blocks, N - 3);
    kvt_tier_destroy(t);

    kvt_tier_nvme_recovery_t r;
    t = reopen(dir, &r);
    cr_assert_eq(r.discarded, 3);
    cr_assert_eq(r.recovered, N - 3, "blocks 1 and 4");
    cr_assert_eq(r.torn + r.gaps, 0);
    check_blocks(t, N, tok, locs, 1u << 0 | 1u << 2 | 1u << 3);
    kvt_tier_destroy(t);
    tu_rmrf(dir);
}

Test(tier_nvme_recover, the_newest_copy_of_a_block_wins)
{
    char dir[4096];
    tu_tmpdir(dir, sizeof(dir), "nvdup");
    kvt_tier_t *t = open_tier(dir);
    uint32_t tok[16];
    kvt_block_key_t k = tu_key(9, tok, 16);
    uint8_t buf[20000];
    uint64_t old_loc = 0, new_loc = 0;
    tu_fill(buf, sizeof(buf), 1);
    cr_assert_eq(tu_write(t, &k, buf, sizeof(buf), &old_loc), 0);
    tu_fill(buf, sizeof(buf), 2);
    cr_assert_eq(tu_write(t, &k, buf, sizeof(buf), &new_loc), 0);
    kvt_tier_destroy(t);
    kvt_tier_nvme_recovery_t r;
    t = reopen(dir, &r);
    cr_assert_eq(r.scanned, 2);
    cr_assert_eq(r.recovered, 1);
    cr_assert_eq(r.stale, 1);
    cr_assert_eq(kvt_tier_valid(t, old_loc, &k), 0);
    cr_assert_eq(tu_read(t, &k, new_loc, buf, sizeof(buf)), 0);
    cr_assert(tu_same(buf, sizeof(buf), 2));
    kvt_tier_destroy(t);
    tu_rmrf(dir);
}

/* A restart: the tier and the tree go, a new, empty tree and the tier reopened on dir come back,
 * and recovery gives the blocks found to the tree (it must succeed). Returns the tier. */
static kvt_tier_t *restart(const char *dir, kvt_tier_t *t, kvt_radix_t **tree,
                           kvt_tier_nvme_recovery_t *r)
{
    kvt_tier_destroy(t);
    kvt_radix_destroy(*tree);
    cr_assert_eq(kvt_radix_create(tree, NULL), 0);
    t = open_tier(dir);
    cr_assert_eq(kvt_store_nvme_recover(*tree, t, r), 0);
    return t;
}

/* Writes every block of the first `pages` pages of toks (already inserted in tree) to t. */
static void write_path(kvt_radix_t *tree, kvt_tier_t *t, uint32_t ns, const uint32_t *toks,
                       uint32_t pages, uint32_t skip_below)
{
    kvt_match_t m;
    cr_assert_eq(kvt_radix_match(tree, ns, toks, (size_t)pages * 16, KVT_MATCH_NOTOUCH, &m), 0);
    cr_assert_eq(m.pages, pages);
    uint64_t parent = kvt_radix_ns_seed(tree, ns);
    uint8_t buf[70000];
    for (uint32_t d = 0; d < pages; d++) {
        uint64_t h = kvt_radix_block_hash(tree, m.node, d);
        kvt_block_key_t k = {.ns_seed = kvt_radix_ns_seed(tree, ns),
                             .hash = h,
                             .parent = parent,
                             .tokens = toks + (size_t)d * 16,
                             .ntokens = 16};
        parent = h;
        if (d < skip_below)
            continue;
        tu_fill(buf, 60000 + d, h);
        uint64_t loc = 0;
        cr_assert_eq(tu_write(t, &k, buf, 60000 + d, &loc), 0);
    }
}

/* Prompt i of one page: its tokens. */
static void one_page(uint32_t *tok, uint32_t i)
{
    for (uint32_t k = 0; k < 16; k++)
        tok[k] = 1000000u + i * 16 + k;
}

/* Writes prompt i's one block (len bytes of its hash's fill) to t; its location and hash. */
static void write_one(kvt_radix_t *tree, kvt_tier_t *t, uint32_t ns, uint32_t i, uint32_t len,
                      uint64_t *loc, uint64_t *hash)
{
    uint32_t tok[16];
    one_page(tok, i);
    kvt_insert_t ins;
    cr_assert_eq(kvt_radix_insert(tree, ns, tok, 16, &ins), 0);
    kvt_match_t m;
    cr_assert_eq(kvt_radix_match(tree, ns, tok, 16, KVT_MATCH_NOTOUCH, &m), 0);
    uint64_t seed = kvt_radix_ns_seed(tree, ns);
    *hash = kvt_radix_block_hash(tree, m.node, 0);
    kvt_block_key_t k = {
        .ns_seed = seed, .hash = *hash, .parent = seed, .tokens = tok, .ntokens = 16};
    uint8_t *buf = tu_aligned(len);
    tu_fill(buf, len, *hash);
    cr_assert_eq(tu_write(t, &k, buf, len, loc), 0, "prompt %u", i);
    free(buf);
}

/*
 * Blocks a segment reclaim dropped stay gone after a restart, though their records lie intact on
 * disk until the segment is written again, and so do blocks freed or discarded meanwhile; every
 * block live at the stop comes back, byte-exact. Recovery used to bring back every intact record.
 */
Test(tier_nvme_recover, reclaimed_blocks_stay_gone_after_a_restart)
{
    /* Records of 200 KiB: ten to a 2 MiB segment, 80 in the 16 MiB tier. */
    enum { N = 110, LEN = 200000 };
    char dir[4096];
    tu_tmpdir(dir, sizeof(dir), "nvreclaim");
    kvt_radix_t *tree = NULL;
    cr_assert_eq(kvt_radix_create(&tree, NULL), 0);
    uint32_t ns;
    cr_assert_eq(kvt_radix_ns_open(tree, "m", NULL, NULL, 16, &ns), 0);
    kvt_tier_t *t = open_tier(dir);
    cr_assert_eq(kvt_tier_nvme_add_ns(t, "m", NULL, NULL, 16), 0);
    uint64_t seed = kvt_radix_ns_seed(tree, ns);
    static uint64_t locs[N], hashes[N];
    /* The tier full, every other block freed (no segment empties), then 30 more: each segment
     * they need is reclaimed with the live blocks it still holds. */
    for (uint32_t i = 0; i < 80; i++)
        write_one(tree, t, ns, i, LEN, &locs[i], &hashes[i]);
    for (uint32_t i = 1; i < 80; i += 2)
        kvt_tier_free(t, locs[i], LEN);
    for (uint32_t i = 80; i < N; i++)
        write_one(tree, t, ns, i, LEN, &locs[i], &hashes[i]);
    kvt_tier_free(t, locs[85], LEN);
    kvt_tier_free(t, locs[40], LEN);
    kvt_tier_discard(t, locs[42], LEN);
    kvt_tier_usage_t u;
    kvt_tier_usage(t, &u);
    cr_assert_geq(u.reclaimed, 10, "segment reclaims dropped live blocks (%llu)",
                  (unsigned long long)u.reclaimed);
    static int live[N];
    uint64_t nlive = 0;
    for (uint32_t i = 0; i < N; i++) {
        uint32_t tok[16];
        one_page(tok, i);
        kvt_block_key_t k = {.ns_seed = seed, .hash = hashes[i], .tokens = tok, .ntokens = 16};
        live[i] = kvt_tier_valid(t, locs[i], &k);
        nlive += (uint64_t)live[i];
    }
    cr_assert_eq(nlive, u.blocks);

    kvt_tier_nvme_recovery_t r;
    t = restart(dir, t, &tree, &r);
    cr_assert_eq(r.recovered, nlive, "%llu blocks back, %llu were live",
                 (unsigned long long)r.recovered, (unsigned long long)nlive);
    cr_assert_eq(r.inserted, nlive);
    cr_assert_eq(r.torn + r.orphans, 0);
    cr_assert_eq(kvt_radix_ns_open(tree, "m", NULL, NULL, 16, &ns), 0);
    uint8_t *buf = tu_aligned(LEN);
    for (uint32_t i = 0; i < N; i++) {
        uint32_t tok[16];
        one_page(tok, i);
        kvt_match_t m;
        cr_assert_eq(kvt_radix_match(tree, ns, tok, 16, KVT_MATCH_NOTOUCH, &m), 0);
        cr_assert_eq(m.pages, (uint32_t)live[i], "block %u: %s", i,
                     live[i] ? "live at the stop, lost" : "dropped before the stop, back");
        if (!live[i])
            continue;
        kvt_block_t *b = kvt_radix_block_at(m.node, 0);
        cr_assert_eq(b->tier, KVT_TIER_NVME);
        kvt_block_key_t k = {.ns_seed = seed, .hash = hashes[i], .tokens = tok, .ntokens = 16};
        cr_assert_eq(tu_read(t, &k, b->loc, buf, LEN), 0, "block %u", i);
        cr_assert(tu_same(buf, LEN, hashes[i]), "block %u", i);
    }
    free(buf);
    kvt_tier_destroy(t);
    kvt_radix_destroy(tree);
    tu_rmrf(dir);
}

/* Makes dir look as a kvtierd before kvtier.live left it: no map, kvtier.meta v1. */
static void make_v1(const char *dir)
{
    char p[4200];
    snprintf(p, sizeof(p), "%s/kvtier.live", dir);
    cr_assert(unlink(p) == 0 || errno == ENOENT, "%s: %s", p, strerror(errno));
    snprintf(p, sizeof(p), "%s/kvtier.meta", dir);
    FILE *f = fopen(p, "w");
    cr_assert(f);
    fprintf(f, "kvtier-nvme v1 segment_bytes=%u segments=%u\n", 2u << 20, 8u);
    fclose(f);
}

/*
 * A directory written before kvtier.live (kvtier.meta v1) is recovered as it was then, from every
 * intact record, but the newest first while they fit: here the log holds 2,048 records of 4 KiB
 * blocks, 683 of them freed, and the tier takes 1,365 (12 KiB charged each): the newest 1,365 are
 * exactly the live ones. Recovery used to take them in hash order. The directory then has a map
 * and kvtier.meta v2: from the next restart on, a freed block stays gone.
 */
Test(tier_nvme_recover, a_directory_from_before_the_live_map_is_recovered_and_upgraded)
{
    enum { N = 2048, FREED = 683, LEN = 4096 };
    char dir[4096], p[4200], meta[128] = {0};
    tu_tmpdir(dir, sizeof(dir), "nvv1");
    kvt_tier_t *t = open_tier(dir);
    static uint64_t locs[N];
    uint32_t tok[16];
    uint8_t *buf = tu_aligned(LEN);
    tu_write_n(t, N - FREED, buf, LEN, tok, locs);
    for (int i = 0; i < FREED; i++)
        kvt_tier_free(t, locs[i], LEN);
    for (int i = N - FREED; i < N; i++) {
        kvt_block_key_t k = tu_key((uint64_t)i, tok, 16);
        tu_fill(buf, LEN, (uint64_t)i);
        cr_assert_eq(tu_write(t, &k, buf, LEN, &locs[i]), 0, "block %d", i);
    }
    kvt_tier_usage_t u;
    kvt_tier_usage(t, &u);
    cr_assert_eq(u.reclaimed, 0, "every record is still on disk");
    kvt_tier_destroy(t);
    make_v1(dir);

    kvt_tier_nvme_recovery_t r;
    t = reopen(dir, &r);
    cr_assert_eq(r.scanned, N);
    cr_assert_eq(r.recovered, N - FREED);
    for (int i = 0; i < N; i++) {
        kvt_block_key_t k = tu_key((uint64_t)i, tok, 16);
        cr_assert_eq(kvt_tier_valid(t, locs[i], &k), i >= FREED, "block %d", i);
    }
    kvt_block_key_t k = tu_key(N - 1, tok, 16);
    cr_assert_eq(tu_read(t, &k, locs[N - 1], buf, LEN), 0);
    cr_assert(tu_same(buf, LEN, N - 1));
    snprintf(p, sizeof(p), "%s/kvtier.meta", dir);
    FILE *f = fopen(p, "r");
    cr_assert(f);
    cr_assert(fgets(meta, sizeof(meta), f));
    fclose(f);
    cr_assert_str_eq(meta, "kvtier-nvme v2 segment_bytes=2097152 segments=8\n");
    kvt_tier_free(t, locs[N - 1], LEN);
    kvt_tier_destroy(t);

    t = reopen(dir, &r);
    cr_assert_eq(r.recovered, N - FREED - 1);
    cr_assert_eq(kvt_tier_valid(t, locs[N - 1], &k), 0, "freed after the upgrade: gone");
    k = tu_key(N - 2, tok, 16);
    cr_assert_eq(tu_read(t, &k, locs[N - 2], buf, LEN), 0);
    cr_assert(tu_same(buf, LEN, N - 2));
    free(buf);
    kvt_tier_destroy(t);
    tu_rmrf(dir);
}

Test(tier_nvme_recover, rebuilds_radix_entries_from_parent_hashes)
{
    char dir[4096];
    tu_tmpdir(dir, sizeof(dir), "nvradix");
    kvt_radix_t *tree = NULL;
    cr_assert_eq(kvt_radix_create(&tree, NULL), 0);
    uint32_t ns;
    cr_assert_eq(kvt_radix_ns_open(tree, "llama-70b", NULL, "tenant-a", 16, &ns), 0);
    /* Two prompts sharing three pages, and a third whose first pages never reach the disk. */
    uint32_t a[5 * 16], b[5 * 16], c[4 * 16];
    uint64_t s = 5;
    for (int i = 0; i < 5 * 16; i++)
        a[i] = b[i] = (uint32_t)tu_rand(&s) % 50000;
    for (int i = 3 * 16; i < 5 * 16; i++)
        b[i] = (uint32_t)tu_rand(&s) % 50000;
    for (int i = 0; i < 4 * 16; i++)
        c[i] = (uint32_t)tu_rand(&s) % 50000 + 60000;
    kvt_insert_t ins;
    cr_assert_eq(kvt_radix_insert(tree, ns, a, 5 * 16, &ins), 0);
    cr_assert_eq(kvt_radix_insert(tree, ns, b, 5 * 16, &ins), 0);
    cr_assert_eq(kvt_radix_insert(tree, ns, c, 4 * 16, &ins), 0);
    kvt_tier_t *t = open_tier(dir);
    cr_assert_eq(kvt_tier_nvme_add_ns(t, "llama-70b", NULL, "tenant-a", 16), 0);
    cr_assert_eq(kvt_tier_nvme_add_ns(t, "llama-70b", NULL, "tenant-a", 16), 0);
    cr_assert_eq(kvt_tier_nvme_add_ns(t, "bad\tname", NULL, NULL, 16), KVT_EINVAL);
    write_path(tree, t, ns, a, 5, 0);
    write_path(tree, t, ns, b, 5, 3); /* its first three pages are a's */
    write_path(tree, t, ns, c, 4, 2); /* pages 2, 3 only: their ancestors are missing */
    uint64_t seed = kvt_radix_ns_seed(tree, ns);
    kvt_tier_nvme_recovery_t r;
    t = restart(dir, t, &tree, &r);
    cr_assert_eq(r.recovered, 9);
    cr_assert_eq(r.inserted, 7);
    cr_assert_eq(r.orphans, 2);
    cr_assert_eq(kvt_store_nvme_recover(tree, t, &r), KVT_EBUSY);
    kvt_tier_usage_t u;
    kvt_tier_usage(t, &u);
    cr_assert_eq(u.blocks, 7, "orphans are freed");
    cr_assert_eq(kvt_radix_verify(tree), 0);
    /* The namespace came back under its name. */
    uint32_t ns2;
    cr_assert_eq(kvt_radix_ns_open(tree, "llama-70b", NULL, "tenant-a", 16, &ns2), 0);
    cr_assert_eq(kvt_radix_ns_seed(tree, ns2), seed);
    const uint32_t *prompts[2] = {a, b};
    uint8_t buf[70000];
    for (int p = 0; p < 2; p++) {
        kvt_match_t m;
        cr_assert_eq(kvt_radix_match(tree, ns2, prompts[p], 5 * 16, KVT_MATCH_NOTOUCH, &m), 0);
        cr_assert_eq(m.pages, 5, "prompt %d matches whole", p);
        for (uint32_t d = 0; d < 5; d++) {
            kvt_block_t *blk = kvt_radix_block_at(m.node, d);
            cr_assert_eq(blk->tier, KVT_TIER_NVME);
            cr_assert_eq(blk->size, 60000 + d);
            uint64_t h = kvt_radix_block_hash(tree, m.node, d);
            kvt_block_key_t k = {
                .ns_seed = seed, .hash = h, .tokens = prompts[p] + (size_t)d * 16, .ntokens = 16};
            cr_assert_eq(tu_read(t, &k, blk->loc, buf, blk->size), 0);
            cr_assert(tu_same(buf, blk->size, h));
        }
    }
    kvt_match_t m;
    cr_assert_eq(kvt_radix_match(tree, ns2, c, 4 * 16, KVT_MATCH_NOTOUCH, &m), 0);
    cr_assert_eq(m.pages, 0, "a prefix with missing ancestors is not indexed");
    kvt_tier_destroy(t);
    kvt_radix_destroy(tree);
    tu_rmrf(dir);
}

/* Lines of DIR/namespaces, and how many of them are exactly want (NULL: none asked). */
static int ns_lines(const char *dir, const char *want, int *matching)
{
    char path[4200], line[1100];
    snprintf(path, sizeof(path), "%s/namespaces", dir);
    FILE *f = fopen(path, "r");
    cr_assert(f, "%s: %s", path, strerror(errno));
    int n = 0;
    *matching = 0;
    while (fgets(line, sizeof(line), f)) {
        n++;
        *matching += want && strcmp(line, want) == 0;
    }
    fclose(f);
    return n;
}

Test(tier_nvme_recover, each_namespace_is_listed_once)
{
    char dir[4096];
    tu_tmpdir(dir, sizeof(dir), "nvnslist");
    kvt_tier_t *t = open_tier(dir);
    int same;
    /* Many, as a fleet of tenants makes: each new one appends its line, an old one none. */
    for (int round = 0; round < 2; round++)
        for (int i = 0; i < 3000; i++) {
            char salt[32];
            snprintf(salt, sizeof(salt), "tenant-%d", i);
            cr_assert_eq(kvt_tier_nvme_add_ns(t, "llama-70b", NULL, salt, 16), 0);
        }
    cr_assert_eq(ns_lines(dir, "v1\tllama-70b\t\ttenant-2999\t16\n", &same), 3000);
    cr_assert_eq(same, 1);
    /* The page size is part of the description. */
    cr_assert_eq(kvt_tier_nvme_add_ns(t, "llama-70b", "", "tenant-7", 32), 0);
    cr_assert_eq(ns_lines(dir, "v1\tllama-70b\t\ttenant-7\t32\n", &same), 3001);
    cr_assert_eq(same, 1);
    kvt_tier_destroy(t);

    /* A restart knows the list from the file: nothing is added twice. A line that is not a
     * namespace's (damage) is passed over. */
    char path[4200];
    snprintf(path, sizeof(path), "%s/namespaces", dir);
    FILE *f = fopen(path, "a");
    cr_assert(f);
    fputs("v1\ttorn", f);
    fclose(f);
    t = open_tier(dir);
    cr_assert_eq(kvt_tier_nvme_add_ns(t, "llama-70b", NULL, "tenant-7", 16), 0);
    cr_assert_eq(kvt_tier_nvme_add_ns(t, "llama-70b", NULL, "tenant-7", 32), 0);
    cr_assert_eq(ns_lines(dir, NULL, &same), 3001 + 1);
    cr_assert_eq(kvt_tier_nvme_add_ns(t, "mistral-7b", NULL, NULL, 16), 0);
    cr_assert_eq(ns_lines(dir, "v1\tmistral-7b\t\t\t16\n", &same), 3001 + 2);
    cr_assert_eq(same, 1, "a line of its own, not the torn one's end");
    kvt_tier_destroy(t);
    tu_rmrf(dir);
}

Test(tier_nvme_recover, namespaces_known_only_by_seed_come_back_too)
{
    char dir[4096];
    tu_tmpdir(dir, sizeof(dir), "nvseed");
    kvt_radix_t *tree = NULL;
    cr_assert_eq(kvt_radix_create(&tree, NULL), 0);
    uint32_t ns;
    cr_assert_eq(kvt_radix_ns_open(tree, "mistral", "lora-7", NULL, 16, &ns), 0);
    uint32_t a[3 * 16];
    for (int i = 0; i < 3 * 16; i++)
        a[i] = (uint32_t)i * 31;
    kvt_insert_t ins;
    cr_assert_eq(kvt_radix_insert(tree, ns, a, 3 * 16, &ins), 0);
    kvt_tier_t *t = open_tier(dir);
    write_path(tree, t, ns, a, 3, 0); /* no kvt_tier_nvme_add_ns */
    kvt_tier_nvme_recovery_t r;
    t = restart(dir, t, &tree, &r);
    cr_assert_eq(r.inserted, 3);
    cr_assert_eq(kvt_radix_ns_open(tree, "mistral", "lora-7", NULL, 16, &ns), 0);
    kvt_match_t m;
    cr_assert_eq(kvt_radix_match(tree, ns, a, 3 * 16, KVT_MATCH_NOTOUCH, &m), 0);
    cr_assert_eq(m.pages, 3);
    cr_assert_eq(kvt_store_nvme_recover(tree, NULL, &r), KVT_EINVAL);
    kvt_tier_destroy(t);
    kvt_radix_destroy(tree);
    tu_rmrf(dir);
}

/*
 * A namespaces file that grew over many runs (here 70,000 tenants that left nothing on disk)
 * crowds out nothing: recovery opens only the namespaces whose blocks it found (the tree holds
 * at most KVT_RADIX_NS_MAX), by name where the file has one, and rewrites the file to those
 * lines. (Recovery used to open every line first: the namespaces with blocks, listed last, found
 * the tree full, and their blocks were freed as orphans.)
 */
Test(tier_nvme_recover, a_long_namespace_list_crowds_out_no_blocks)
{
    enum { IDLE = 70000 };
    char dir[4096], path[4200];
    tu_tmpdir(dir, sizeof(dir), "nvnsmany");
    kvt_radix_t *tree = NULL;
    cr_assert_eq(kvt_radix_create(&tree, NULL), 0);
    uint32_t named, unnamed, a[3 * 16], b[2 * 16];
    cr_assert_eq(kvt_radix_ns_open(tree, "llama-70b", NULL, "tenant-busy", 16, &named), 0);
    cr_assert_eq(kvt_radix_ns_open(tree, "mistral", NULL, NULL, 16, &unnamed), 0);
    for (int i = 0; i < 3 * 16; i++)
        a[i] = (uint32_t)i * 7 + 1;
    for (int i = 0; i < 2 * 16; i++)
        b[i] = (uint32_t)i * 11 + 3;
    kvt_insert_t ins;
    cr_assert_eq(kvt_radix_insert(tree, named, a, 3 * 16, &ins), 0);
    cr_assert_eq(kvt_radix_insert(tree, unnamed, b, 2 * 16, &ins), 0);
    kvt_tier_t *t = open_tier(dir);
    write_path(tree, t, named, a, 3, 0);
    write_path(tree, t, unnamed, b, 2, 0);
    snprintf(path, sizeof(path), "%s/namespaces", dir);
    FILE *f = fopen(path, "w");
    cr_assert(f);
    for (int i = 0; i < IDLE; i++)
        fprintf(f, "v1\tllama-70b\t\ttenant-%d\t16\n", i);
    fputs("v1\tllama-70b\t\ttenant-busy\t16\n", f);
    fputs("v1\tllama-70b\t\ttenant-busy\t16\n", f); /* twice, as two daemons could */
    cr_assert_eq(fclose(f), 0);
    kvt_tier_nvme_recovery_t r;
    t = restart(dir, t, &tree, &r);
    cr_assert_eq(r.inserted, 5, "every block back (%llu orphans)", (unsigned long long)r.orphans);
    cr_assert_eq(r.orphans, 0);
    cr_assert_eq(kvt_radix_ns_page_size(tree, 2), 0, "two namespaces open, not %d", IDLE + 2);
    uint32_t ns;
    kvt_match_t m;
    cr_assert_eq(kvt_radix_ns_open(tree, "llama-70b", NULL, "tenant-busy", 16, &ns), 0);
    cr_assert_lt(ns, 2, "opened by recovery, by its name");
    cr_assert_eq(kvt_radix_match(tree, ns, a, 3 * 16, KVT_MATCH_NOTOUCH, &m), 0);
    cr_assert_eq(m.pages, 3);
    cr_assert_eq(kvt_radix_ns_open(tree, "mistral", NULL, NULL, 16, &ns), 0);
    cr_assert_lt(ns, 2, "opened by recovery, by its seed");
    cr_assert_eq(kvt_radix_match(tree, ns, b, 2 * 16, KVT_MATCH_NOTOUCH, &m), 0);
    cr_assert_eq(m.pages, 2);
    cr_assert_eq(kvt_radix_verify(tree), 0);
    int same;
    cr_assert_eq(ns_lines(dir, "v1\tllama-70b\t\ttenant-busy\t16\n", &same), 1,
                 "the file keeps the namespaces with blocks");
    cr_assert_eq(same, 1);
    /* The set follows the new file: an idle tenant coming back is listed again, once. */
    cr_assert_eq(kvt_tier_nvme_add_ns(t, "llama-70b", NULL, "tenant-5", 16), 0);
    cr_assert_eq(kvt_tier_nvme_add_ns(t, "llama-70b", NULL, "tenant-5", 16), 0);
    cr_assert_eq(kvt_tier_nvme_add_ns(t, "llama-70b", NULL, "tenant-busy", 16), 0);
    cr_assert_eq(ns_lines(dir, "v1\tllama-70b\t\ttenant-5\t16\n", &same), 2);
    cr_assert_eq(same, 1);
    kvt_tier_destroy(t);
    kvt_radix_destroy(tree);
    tu_rmrf(dir);
}

/*
 * Tenants that come and go (each HELLO of a new one appends its line) do not grow the list for
 * ever: once it reaches 4,096 lines it is rewritten to the namespaces that hold blocks in the
 * tier, and again each time it doubles from there. A namespace with blocks keeps its line
 * through every compaction and comes back by name after a restart.
 */
Test(tier_nvme_recover, the_namespace_list_is_compacted_as_tenants_come_and_go)
{
    enum { TENANTS = 10000 };
    char dir[4096];
    tu_tmpdir(dir, sizeof(dir), "nvnscompact");
    kvt_radix_t *tree = NULL;
    cr_assert_eq(kvt_radix_create(&tree, NULL), 0);
    uint32_t ns, a[2 * 16];
    cr_assert_eq(kvt_radix_ns_open(tree, "llama-70b", NULL, "tenant-busy", 16, &ns), 0);
    for (int i = 0; i < 2 * 16; i++)
        a[i] = (uint32_t)i * 13 + 5;
    kvt_insert_t ins;
    cr_assert_eq(kvt_radix_insert(tree, ns, a, 2 * 16, &ins), 0);
    kvt_tier_t *t = open_tier(dir);
    cr_assert_eq(kvt_tier_nvme_add_ns(t, "llama-70b", NULL, "tenant-busy", 16), 0);
    write_path(tree, t, ns, a, 2, 0);
    int same, most = 0;
    char salt[32], want[64];
    for (int i = 0; i < TENANTS; i++) {
        snprintf(salt, sizeof salt, "idle-%d", i);
        cr_assert_eq(kvt_tier_nvme_add_ns(t, "llama-70b", NULL, salt, 16), 0);
        if (i % 500 == 0 || i == TENANTS - 1) {
            int lines = ns_lines(dir, "v1\tllama-70b\t\ttenant-busy\t16\n", &same);
            cr_assert_eq(same, 1, "after %d tenants", i + 1);
            most = lines > most ? lines : most;
        }
    }
    snprintf(want, sizeof want, "v1\tllama-70b\t\tidle-%d\t16\n", TENANTS - 1);
    int lines = ns_lines(dir, want, &same);
    cr_assert_eq(same, 1, "the newest tenant is listed");
    cr_assert_leq(lines, 4096, "%d lines for %d tenants", lines, TENANTS + 1);
    cr_assert_leq(most, 4096);
    /* A tenant listed before a compaction and dropped by it is listed again when it comes back. */
    cr_assert_eq(kvt_tier_nvme_add_ns(t, "llama-70b", NULL, "idle-0", 16), 0);
    cr_assert_eq(ns_lines(dir, "v1\tllama-70b\t\tidle-0\t16\n", &same), lines + 1);
    cr_assert_eq(same, 1);
    kvt_tier_nvme_recovery_t r;
    t = restart(dir, t, &tree, &r);
    cr_assert_eq(r.inserted, 2);
    cr_assert_eq(ns_lines(dir, NULL, &same), 1, "the restart keeps the busy tenant's line only");
    uint32_t id;
    cr_assert_eq(kvt_radix_ns_open(tree, "llama-70b", NULL, "tenant-busy", 16, &id), 0);
    cr_assert_eq(id, 0, "opened by recovery");
    kvt_tier_destroy(t);
    kvt_radix_destroy(tree);
    tu_rmrf(dir);
}

/* The path in front of a window behind a gap (kvt_tier_nvme_add_path, DIR/kvtier.paths): the
 * block comes back at the end of a path whose first pages have no block (NULL) and carry the
 * recorded tokens; a record cut short is skipped and counted as torn, its block an orphan; the
 * log is compacted, as it grows, to the records of blocks the tier holds. */
Test(tier_nvme_recover, a_window_behind_a_gap_comes_back_after_its_path)
{
    char dir[4096], paths[4200];
    tu_tmpdir(dir, sizeof(dir), "nvpath");
    snprintf(paths, sizeof paths, "%s/kvtier.paths", dir);
    kvt_tier_t *t = open_tier(dir);
    uint32_t tok[2][16], gap[3 * 16];
    for (uint32_t i = 0; i < 3 * 16; i++)
        gap[i] = 1000 + i;
    uint8_t *buf = tu_aligned(8192);
    kvt_block_key_t k[2];
    for (int i = 0; i < 2; i++) {
        k[i] = tu_key((uint64_t)i + 1, tok[i], 16); /* parents no record names */
        tu_fill(buf, 8192, (uint64_t)i);
        cr_assert_eq(tu_write(t, &k[i], buf, 8192, NULL), 0);
        cr_assert_eq(kvt_tier_nvme_add_path(t, &k[i], gap, 3), 0);
    }
    cr_expect_eq(kvt_tier_nvme_add_path(t, &k[0], gap, 0), KVT_EINVAL);
    /* Records of a block the tier does not hold, until the log passes 1 MiB: the next record
     * compacts it to the two above (and that one). */
    kvt_block_key_t stray = k[0];
    stray.hash ^= 0x5555;
    static uint32_t big[64 * 16];
    struct stat sb;
    int compacted = 0;
    for (int i = 0; i < 400 && !compacted; i++) {
        off_t before = stat(paths, &sb) == 0 ? sb.st_size : 0;
        cr_assert_eq(kvt_tier_nvme_add_path(t, &stray, big, 64), 0);
        cr_assert_eq(stat(paths, &sb), 0);
        compacted = sb.st_size < before;
    }
    cr_assert(compacted, "the log was compacted");
    cr_expect_lt(sb.st_size, 3 * (56 + 64 * 16 * 4) + 8 + 1, "%ld bytes left", (long)sb.st_size);
    kvt_tier_destroy(t);
    /* k[1]'s record, the last but the stray one, cut short: the stray one's cut off whole. */
    FILE *f = fopen(paths, "r+");
    cr_assert(f);
    long keep = 8 + 2 * (56 + 3 * 16 * 4) - 10;
    cr_assert_eq(ftruncate(fileno(f), keep), 0);
    fclose(f);

    kvt_tier_nvme_recovery_t r;
    t = reopen(dir, &r);
    kvt_tier_nvme_ns_t *ns;
    size_t nns;
    cr_assert_eq(kvt_tier_nvme_recover_begin(t, &ns, &nns), 0);
    cr_assert_eq(nns, 1);
    ns[0].page_size = 16;
    kvt_tier_nvme_path_t p;
    int found = 0;
    while (kvt_tier_nvme_recover_next(t, &p) == 1) {
        cr_assert_eq(p.npages, 4, "the gap's 3 pages, then the block");
        for (int d = 0; d < 3; d++)
            cr_expect_null(p.blocks[d]);
        cr_expect(memcmp(p.tokens, gap, sizeof gap) == 0, "the gap's tokens");
        cr_expect(memcmp(p.tokens + 48, tok[0], sizeof tok[0]) == 0, "the block's tokens");
        cr_assert_not_null(p.blocks[3]);
        cr_expect_eq(p.blocks[3]->hash, k[0].hash);
        p.blocks[3]->indexed = 1;
        found++;
    }
    cr_expect_eq(found, 1, "k[1]'s path was cut short: an orphan");
    cr_assert_eq(kvt_tier_nvme_recover_end(t, 0, &r), 0);
    cr_expect_eq(r.inserted, 1);
    cr_expect_eq(r.orphans, 1);
    cr_expect_eq(r.torn, 1);
    /* Rewritten to the one path that came back. */
    cr_assert_eq(stat(paths, &sb), 0);
    cr_expect_eq(sb.st_size, 8 + 56 + 3 * 16 * 4);
    kvt_tier_destroy(t);
    free(buf);
    tu_rmrf(dir);
}

/* Recovery reads a segment through a buffer of about 1 MiB whatever the segment size (it read
 * each segment whole into one buffer of its size: up to 1 GiB). With 256 MiB segments, a block
 * of 40 MiB between two small ones comes back byte-exact, a byte flipped 30 MiB into its payload
 * is caught as torn, and reopening raises the peak resident set by a few MiB, not by the
 * segment's unused tail that the scan searches for more records. */
Test(tier_nvme_recover, large_segments_recover_in_bounded_memory)
{
    char dir[4096];
    tu_tmpdir(dir, sizeof(dir), "nvbig");
    kvt_tier_nvme_conf_t c = {.dir = dir,
                              .capacity_bytes = 512u << 20,
                              .segment_bytes = 256u << 20,
                              .queue_depth = 8,
                              .sparse = 1};
    kvt_tier_t *t = NULL;
    cr_assert_eq(kvt_tier_nvme_create(&t, &c), 0);
    enum { N = 3 };
    const uint32_t lens[N] = {40000, (40u << 20) + 123, 60000};
    uint32_t tok[N][16];
    uint64_t locs[N];
    uint8_t *buf = tu_aligned(lens[1]);
    for (int i = 0; i < N; i++) {
        kvt_block_key_t k = tu_key((uint64_t)i, tok[i], 16);
        tu_fill(buf, lens[i], (uint64_t)i);
        cr_assert_eq(tu_write(t, &k, buf, lens[i], &locs[i]), 0, "block %d", i);
    }
    kvt_tier_destroy(t);
    free(buf); /* a mapping of its own: given back, out of the peak measured next */

    long before = peak_kib(1);
    kvt_tier_nvme_recovery_t r;
    cr_assert_eq(kvt_tier_nvme_create(&t, &c), 0);
    long grew = peak_kib(0) - before;
    kvt_tier_nvme_recovery(t, &r);
    cr_assert_eq(r.recovered, N);
    cr_assert_eq(r.torn + r.stale + r.gaps, 0);
    cr_assert_lt(grew, 16 << 10, "reopening raised the peak RSS by %ld KiB", grew);
    buf = tu_aligned(lens[1]);
    for (int i = 0; i < N; i++) {
        kvt_block_key_t k = tu_key((uint64_t)i, tok[i], 16);
        cr_assert_eq(tu_read(t, &k, locs[i], buf, lens[i]), 0, "block %d", i);
        cr_assert(tu_same(buf, lens[i], (uint64_t)i), "block %d", i);
    }
    kvt_tier_destroy(t);

    /* Block 1's record starts after block 0's; its payload after its 4 KiB header. */
    uint8_t x;
    int fd = data_open(dir, O_RDONLY);
    uint64_t at = rec_size(lens[0]) + 4096 + (30u << 20);
    cr_assert_eq(pread(fd, &x, 1, (off_t)at), 1);
    close(fd);
    x ^= 0x40;
    overwrite_with(dir, at, &x, 1);
    cr_assert_eq(kvt_tier_nvme_create(&t, &c), 0);
    kvt_tier_nvme_recovery(t, &r);
    cr_assert_eq(r.torn, 1);
    cr_assert_eq(r.recovered, N - 1);
    for (int i = 0; i < N; i++) {
        kvt_block_key_t k = tu_key((uint64_t)i, tok[i], 16);
        cr_assert_eq(kvt_tier_valid(t, locs[i], &k), i != 1, "block %d", i);
    }
    kvt_tier_destroy(t);
    free(buf);
    tu_rmrf(dir);
}
