/*
 * fuzz_nvme.h: what the two NVMe harnesses (fuzz_nvme_recover.c, fuzz_live.c) share. A template
 * data directory is made once by the real tier: 2 segments of 1 MiB, one namespace, a chain of
 * blocks; its files are kept in memory. Each run lays a directory out from the template and the
 * input, opens the tier on it (the recovery scan), hands what it found to a stand-in index (every
 * other path taken, as an index out of room would), ends recovery, writes one new block and
 * reads it back. Directories live under $TMPDIR; the data file is buffered (direct = 2): tmpfs
 * refuses O_DIRECT, and the layout is the same.
 */
#ifndef KVT_FUZZ_NVME_H
#define KVT_FUZZ_NVME_H

#define _GNU_SOURCE
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tier.h"

#define FZ_SEG    (1u << 20)
#define FZ_NSEGS  2u
#define FZ_PAGE   16u
#define FZ_BLOCKS 4u
#define FZ_LEN    1000u /* payload bytes: records of 8 KiB */

typedef struct fz_file {
    uint8_t *p;
    size_t n;
} fz_file_t;

typedef struct fz_template {
    fz_file_t data, meta, live, ns;
} fz_template_t;

static char fz_dir[4096];

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

static int fz_open(const char *dir, kvt_tier_t **t)
{
    kvt_tier_nvme_conf_t c = {.dir = dir,
                              .capacity_bytes = (uint64_t)FZ_SEG * FZ_NSEGS,
                              .segment_bytes = FZ_SEG,
                              .queue_depth = 4,
                              .direct = 2};
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

/* Runs io (a read or a write) to its end; 0 or its status, or KVT_ETIMEDOUT. */
static int fz_io(kvt_tier_t *t, kvt_tier_io_t *io, int write)
{
    int done = 0;
    io->cb = fz_count;
    io->data = &done;
    int rc = write ? kvt_tier_write(t, io) : kvt_tier_read(t, io);
    if (rc < 0)
        return rc;
    for (int i = 0; i < 500 && !done; i++)
        if (kvt_tier_wait(t, 10) < 0)
            break;
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
