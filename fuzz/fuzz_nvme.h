/*
 * fuzz_nvme.h: what the two NVMe harnesses (fuzz_nvme_recover.c, fuzz_live.c) share. A template
 * data directory is made once by the real tier: 2 segments of 64 KiB (the fuzz build allows
 * segments that small: tiers/nvme.c's KVT_NVME_SEG_MIN; the daemon's smallest is 1 MiB, and 2 of
 * those made every run read and scan 2 MiB), one namespace, a chain of blocks; its files are kept
 * in memory. Each run lays a directory out from the template and the
 * input, opens the tier on it (the recovery scan), hands what it found to a stand-in index (every
 * other path taken, as an index out of room would), ends recovery, writes one new block and
 * reads it back. Directories live under $TMPDIR; the data file is buffered (direct = 2): tmpfs
 * refuses O_DIRECT, and the layout is the same.
 *
 * The run directory's data file is not written anew for each input: writing and truncating it
 * was a third of each run. It is made once, mapped shared here, and kept equal to
 * the template between runs by copying the template back over what changed: the bytes an input
 * laid over it (fz_run_lay) and the record the run's tier wrote (fz_recover_and_use knows its
 * location). Where that is not known (a write that failed on its way) the whole file is copied
 * back, and a data file replaced or resized is made again. Every FZ_VERIFY_EVERY runs the whole
 * file is compared with the template after the restore, and a difference aborts: it would be a
 * write outside the record the tier named, or a restore that missed a byte (inputs depending on
 * earlier ones).
 */
#ifndef KVT_FUZZ_NVME_H
#define KVT_FUZZ_NVME_H

#define _GNU_SOURCE
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tier.h"

#define FZ_SEG          (64u << 10) /* the fuzz build's KVT_NVME_SEG_MIN (meson.build) */
#define FZ_NSEGS        2u
#define FZ_PAGE         16u
#define FZ_BLOCKS       4u
#define FZ_LEN          1000u /* payload bytes: records of 8 KiB */
#define FZ_SECTOR       4096u
#define FZ_VERIFY_EVERY 1024u
#define FZ_DIRTY_MAX    8u

typedef struct fz_file {
    uint8_t *p;
    size_t n;
} fz_file_t;

typedef struct fz_template {
    fz_file_t data, meta, live, ns;
} fz_template_t;

static char fz_dir[4096];

typedef struct fz_range {
    size_t off, n;
} fz_range_t;

/* The run directory and its data file: what of it may differ from the template. */
typedef struct fz_run {
    char dir[4200], data[4300];
    const fz_file_t *tpl;
    int fd;
    uint8_t *map;
    struct stat st;
    fz_range_t dirty[FZ_DIRTY_MAX];
    uint32_t ndirty, runs;
    int all; /* 1: anything may differ (the next restore copies the whole file) */
} fz_run_t;

static fz_run_t fz_run;

static void fz_die(const char *what)
{
    fprintf(stderr, "fuzz: %s\n", what);
    abort();
}

static void fz_put(const char *dir, const char *name, const void *p, size_t n)
{
    char path[4200];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0 || (n && write(fd, p, n) != (ssize_t)n))
        fz_die(path);
    close(fd);
}

static void fz_get(const char *dir, const char *name, fz_file_t *f)
{
    char path[4200];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0)
        fz_die(path);
    f->n = (size_t)st.st_size;
    f->p = malloc(f->n ? f->n : 1);
    if (!f->p || (f->n && pread(fd, f->p, f->n, 0) != (ssize_t)f->n))
        fz_die(path);
    close(fd);
}

/* Notes that [off, off + n) of the data file may differ from the template. */
static void fz_run_dirty(size_t off, size_t n)
{
    size_t size = fz_run.tpl->n;
    if (off >= size || n == 0)
        return;
    n = n < size - off ? n : size - off;
    fz_range_t *last = fz_run.ndirty ? &fz_run.dirty[fz_run.ndirty - 1] : NULL;
    if (last && last->off + last->n == off)
        last->n += n; /* fz_run_zero's sectors, one after another */
    else if (fz_run.ndirty == FZ_DIRTY_MAX)
        fz_run.all = 1;
    else
        fz_run.dirty[fz_run.ndirty++] = (fz_range_t){.off = off, .n = n};
}

/* (Re)makes the run directory's data file from the template and maps it. */
static void fz_run_map(void)
{
    if (fz_run.map)
        munmap(fz_run.map, fz_run.tpl->n);
    if (fz_run.fd >= 0)
        close(fz_run.fd);
    fz_put(fz_run.dir, "kvtier.data", fz_run.tpl->p, fz_run.tpl->n);
    fz_run.fd = open(fz_run.data, O_RDWR | O_CLOEXEC);
    if (fz_run.fd < 0 || fstat(fz_run.fd, &fz_run.st) != 0)
        fz_die(fz_run.data);
    fz_run.map = mmap(NULL, fz_run.tpl->n, PROT_READ | PROT_WRITE, MAP_SHARED, fz_run.fd, 0);
    if (fz_run.map == MAP_FAILED)
        fz_die("mmap");
    fz_run.ndirty = 0;
    fz_run.all = 0;
}

static void fz_run_init(const char *dir, const fz_file_t *tpl)
{
    snprintf(fz_run.dir, sizeof fz_run.dir, "%s", dir);
    snprintf(fz_run.data, sizeof fz_run.data, "%s/kvtier.data", dir);
    if (mkdir(dir, 0755) != 0)
        fz_die(dir);
    fz_run.tpl = tpl;
    fz_run.fd = -1;
    fz_run_map();
}

/*
 * Brings the data file back to the template before a run. A data file that is no longer the one
 * mapped (removed, replaced, resized by a tier) is made again; one where a byte differs outside
 * what was noted dirty aborts, as that would be a harness that no longer runs what it says.
 */
static void fz_run_reset(void)
{
    struct stat st;
    if (stat(fz_run.data, &st) != 0 || st.st_ino != fz_run.st.st_ino ||
        st.st_dev != fz_run.st.st_dev || (size_t)st.st_size != fz_run.tpl->n) {
        fz_run_map();
        return;
    }
    const uint8_t *tp = fz_run.tpl->p;
    if (fz_run.all) {
        memcpy(fz_run.map, tp, fz_run.tpl->n);
    } else {
        for (uint32_t i = 0; i < fz_run.ndirty; i++)
            memcpy(fz_run.map + fz_run.dirty[i].off, tp + fz_run.dirty[i].off, fz_run.dirty[i].n);
    }
    if (++fz_run.runs % FZ_VERIFY_EVERY == 0 && memcmp(fz_run.map, tp, fz_run.tpl->n) != 0)
        fz_die("the data file differs from the template where no run wrote: a missed restore");
    fz_run.ndirty = 0;
    fz_run.all = 0;
}

/* Lays n bytes over the data file at off (the run's own changes to it), noting them. */
static void fz_run_lay(size_t off, const void *p, size_t n)
{
    size_t size = fz_run.tpl->n;
    if (off >= size)
        return;
    n = n < size - off ? n : size - off;
    memcpy(fz_run.map + off, p, n);
    fz_run_dirty(off, n);
}

/* Zeroes the data file where the template is not zero (whole sectors), noting them. */
static inline void fz_run_zero(void) /* fuzz_nvme_recover only */
{
    static const uint8_t zero[FZ_SECTOR];
    const uint8_t *tp = fz_run.tpl->p;
    for (size_t off = 0; off + FZ_SECTOR <= fz_run.tpl->n; off += FZ_SECTOR)
        if (memcmp(tp + off, zero, FZ_SECTOR) != 0)
            fz_run_lay(off, zero, FZ_SECTOR);
}

/* Opens the tier on dir. Sparse: the run's data file is whole already (every byte of it the
 * harness's), and preallocating it again walked its pages on each run (8 % of the time); the
 * template's reads back the same either way. */
static int fz_open(const char *dir, kvt_tier_t **t)
{
    kvt_tier_nvme_conf_t c = {.dir = dir,
                              .capacity_bytes = (uint64_t)FZ_SEG * FZ_NSEGS,
                              .segment_bytes = FZ_SEG,
                              .queue_depth = 4,
                              .direct = 2,
                              .sparse = 1};
    return kvt_tier_nvme_create(t, &c);
}

static void fz_count(kvt_tier_io_t *io)
{
    (*(int *)io->data)++;
}

/* Block i of the template's chain: its tokens and key. */
static kvt_block_key_t fz_key(uint64_t seed, uint32_t i, uint32_t *tok)
{
    for (uint32_t k = 0; k < FZ_PAGE; k++)
        tok[k] = i * 1000 + k;
    return (kvt_block_key_t){.ns_seed = seed,
                             .hash = 0x1000 + i,
                             .parent = i == 0 ? seed : 0x1000 + i - 1,
                             .tokens = tok,
                             .ntokens = FZ_PAGE};
}

/* Runs io (a read or a write) to its end; 0 or its status, or KVT_ETIMEDOUT. A write submitted
 * to the run directory's tier notes the record it writes (tiers/nvme.c, "Segments and
 * locations": segment, header sectors and first sector in the location; the record is the
 * header region and the payload in whole sectors). */
static int fz_io(kvt_tier_t *t, kvt_tier_io_t *io, int write)
{
    int done = 0;
    io->cb = fz_count;
    io->data = &done;
    int rc = write ? kvt_tier_write(t, io) : kvt_tier_read(t, io);
    if (rc < 0)
        return rc;
    if (write && fz_run.tpl) {
        uint64_t seg = io->loc >> 20 & 0xfffff, hdr = io->loc >> 18 & 3, sector = io->loc & 0x3ffff;
        fz_run_dirty(seg * FZ_SEG + sector * FZ_SECTOR,
                     hdr * FZ_SECTOR + (io->len + FZ_SECTOR - 1) / FZ_SECTOR * FZ_SECTOR);
    }
    for (int i = 0; i < 500 && !done; i++)
        if (kvt_tier_wait(t, 10) < 0)
            break;
    if (write && fz_run.tpl && !(done && io->status == 0))
        fz_run.all = 1; /* a write that failed on its way: check it all next time */
    return done ? io->status : KVT_ETIMEDOUT;
}

/* The template directory, made by the tier itself, in memory. */
static void fz_template(fz_template_t *tp)
{
    const char *tmp = getenv("TMPDIR");
    snprintf(fz_dir, sizeof fz_dir, "%s/kvt-fuzz-nvme.XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(fz_dir))
        fz_die("mkdtemp");
    char tdir[4200];
    snprintf(tdir, sizeof tdir, "%s/template", fz_dir);
    if (mkdir(tdir, 0755) != 0)
        fz_die(tdir);
    kvt_tier_t *t;
    if (fz_open(tdir, &t) != 0)
        fz_die("template tier");
    if (kvt_tier_nvme_add_ns(t, "m", "", "", FZ_PAGE) != 0)
        fz_die("add_ns");
    uint64_t seed = kvt_ns_seed_of("m", "", "", FZ_PAGE);
    static uint8_t buf[FZ_LEN];
    uint32_t tok[FZ_PAGE];
    for (uint32_t i = 0; i < FZ_BLOCKS; i++) {
        memset(buf, (int)(0x40 + i), sizeof buf);
        kvt_tier_io_t io = {.key = fz_key(seed, i, tok), .buf = buf, .len = FZ_LEN};
        if (fz_io(t, &io, 1) != 0)
            fz_die("template write");
        if (i == 2)
            kvt_tier_free(t, io.loc, FZ_LEN); /* one dropped block: its record stays */
    }
    kvt_tier_destroy(t);
    fz_get(tdir, "kvtier.data", &tp->data);
    fz_get(tdir, "kvtier.meta", &tp->meta);
    fz_get(tdir, "kvtier.live", &tp->live);
    fz_get(tdir, "namespaces", &tp->ns);
}

/* Recovery as the daemon runs it, with an index that takes every other path; then one new block
 * written and read back, and the tier closed. */
static void fz_recover_and_use(kvt_tier_t *t)
{
    kvt_tier_nvme_ns_t *ns;
    size_t nns;
    if (kvt_tier_nvme_recover_begin(t, &ns, &nns) != 0)
        return;
    for (size_t i = 0; i < nns; i++)
        ns[i].named = ns[i].model != NULL;
    kvt_tier_nvme_path_t p;
    int take = 1, rc;
    while ((rc = kvt_tier_nvme_recover_next(t, &p)) == 1) {
        if (p.ns >= nns || p.npages == 0)
            abort();
        volatile uint32_t sink = 0;
        for (size_t k = 0; k < (size_t)p.npages * ns[p.ns].page_size; k++)
            sink ^= p.tokens[k];
        (void)sink;
        for (uint32_t k = 0; take && k < p.npages; k++)
            if (p.blocks[k]) /* NULL: a gap's page, no block */
                p.blocks[k]->indexed = 1;
        take = !take;
    }
    kvt_tier_nvme_recovery_t r;
    if (kvt_tier_nvme_recover_end(t, rc < 0, &r) != 0)
        abort();
    if (r.inserted > r.recovered)
        abort();
    uint64_t seed = kvt_ns_seed_of("m", "", "", FZ_PAGE);
    static uint8_t buf[FZ_LEN], back[FZ_LEN];
    uint32_t tok[FZ_PAGE];
    memset(buf, 0x77, sizeof buf);
    kvt_tier_io_t io = {.key = fz_key(seed, 9, tok), .buf = buf, .len = FZ_LEN};
    if (fz_io(t, &io, 1) == 0) {
        kvt_tier_io_t rd = {.key = io.key, .loc = io.loc, .buf = back, .len = FZ_LEN};
        if (fz_io(t, &rd, 0) != 0 || memcmp(back, buf, FZ_LEN) != 0)
            abort(); /* a block written after any recovery reads back */
    }
}

#endif
