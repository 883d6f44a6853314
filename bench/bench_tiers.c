/*
 * bench_tiers.c: write and read bandwidth of each tier for 256 KiB and 2 MiB blocks, each next
 * to its ceiling measured in the same run:
 *
 *   dram    the tier's writes and reads (jemalloc block + copy + completion) vs plain memcpy of
 *           the same blocks between the same kind of buffers
 *   nvme    the tier (io_uring, O_DIRECT, header + checksum per block, queue depth --qd) vs
 *           fio with ioengine=io_uring, direct=1, the same block size and iodepth, on the same
 *           file system (--dir). fio's io_uring options are spelled out at their defaults, which
 *           is how the tier submits too: one sqe per request, submitted at once
 *           (iodepth_batch_submit=1), plain user buffers (fixedbufs=0), no registered file
 *           (registerfiles=0), no SQ polling thread, interrupt-driven completions (hipri=0).
 *           Both move the same payload: n blocks of the block size, read back in the order
 *           written. The tier's figure counts payload bytes only; its 4 KiB header region per
 *           record (1.6% at 256 KiB, 0.2% at 2 MiB) is its own overhead and counts against it.
 *           The tier writes from and reads into blocks of a DRAM tier, as kvtierd's demotions
 *           and promotions do (huge pages where the kernel has them: tiers/dram.c); fio uses
 *           its own buffers, on 4 KiB pages. The memory decides how many bios an O_DIRECT I/O
 *           becomes on a virtio disk, so each rep also runs the tier from one 4 KiB-page area
 *           like fio's, reported as gbps_4k_pages and ratio_4k_pages beside the main figure.
 *           Each timed phase starts after an untimed syncfs, so that the disk's host has
 *           flushed the writes of the phase before (whichever side ran after a fast writer
 *           otherwise paid for it).
 *   hbm     only where a GPU is usable: the tier's copies between pinned DRAM-tier blocks and
 *           the device, writes (to the device), reads (back) and both at once (--qd requests in
 *           flight each way), vs the machine's ceiling measured in the same run: one large
 *           pinned copy each way (--ceiling-mib, 1 GiB by default), and those two at once on
 *           two streams. Each block size runs at several batch sizes (the tier's hbm-batch: 1 is
 *           a cudaMemcpyAsync per copy, larger ones a cudaMemcpyBatchAsync per batch), so that
 *           one run says which comes nearest the ceiling.
 *   remote  bench_remote_run() (bench/bench_remote.c) against --redis HOST:PORT, or a throwaway
 *           redis-server, vs redis-benchmark; then bench_remote_cluster_run() against a
 *           throwaway Redis Cluster (3 primaries, 3 replicas), the tier in cluster mode vs
 *           redis-benchmark --cluster (--no-cluster: not; --only cluster: this alone)
 *
 * Each case runs --reps times interleaved with its baseline (taking turns at going first), and
 * the median of each side is reported, which keeps a noisy disk's drift from landing on one side
 * only. The NVMe case first runs one untimed round of both sides, so that neither pays alone for
 * first writes into a fresh file's unwritten extents.
 * Output: one JSON object per tier, block size and op on stdout (GB/s are 1e9 bytes per second);
 * progress on stderr.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "bench_stats.h"
#include "config.h"
#include "tier.h"
#if KVT_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif
#include "bench_remote.h"

typedef struct opts {
    const char *dir;
    const char *redis;
    uint64_t volume; /* bytes per case */
    uint32_t qd;
    uint64_t ceiling; /* bytes of the hbm ceiling's one large copy */
    int reps;
    int only_dram, only_nvme, no_remote, no_cluster;
} opts_t;

static double now_s(void)
{
    return (double)kvt_now_ns() / 1e9;
}

static void emit(const char *tier, size_t bs, const char *op, double gbps, const char *base,
                 double base_gbps)
{
    printf("{\"tier\":\"%s\",\"block_bytes\":%zu,\"op\":\"%s\",\"gbps\":%.3f,\"baseline\":\"%s\","
           "\"baseline_gbps\":%.3f,\"ratio\":%.3f}\n",
           tier, bs, op, gbps, base, base_gbps, base_gbps > 0 ? gbps / base_gbps : 0.0);
    fflush(stdout);
}

/* n bytes, faulted in. huge: like the DRAM tier's region (tiers/dram.c), 2 MiB aligned with
 * transparent huge pages asked for; otherwise 4 KiB aligned on ordinary pages. */
static void *xalloc(size_t n, int huge)
{
    void *p = NULL;
    if (posix_memalign(&p, huge ? 2u << 20 : 4096, n) != 0) {
        fprintf(stderr, "bench_tiers: out of memory\n");
        exit(1);
    }
    if (huge)
        (void)madvise(p, n, MADV_HUGEPAGE);
    memset(p, 0x5a, n);
    return p;
}

static void *xalign(size_t n)
{
    return xalloc(n, 0);
}

static void fill(uint8_t *p, size_t n, uint64_t seed)
{
    for (size_t i = 0; i + 8 <= n; i += 8) {
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        memcpy(p + i, &seed, 8);
    }
}

/* The two lines of a case from its reps: runs holds reps figures each of the tier's writes, the
 * baseline's writes, the tier's reads and the baseline's reads, in that order. */
static void emit_runs(const char *tier, size_t bs, double *runs, int reps, const char *base)
{
    emit(tier, bs, "write", bench_median(runs, reps), base, bench_median(runs + reps, reps));
    emit(tier, bs, "read", bench_median(runs + 2 * reps, reps), base,
         bench_median(runs + 3 * reps, reps));
}

/* ---- driving a tier with a window of requests in flight ---- */

typedef struct pump {
    kvt_tier_t *t;
    kvt_tier_io_t *ios;
    uint8_t **bufs;
    uint32_t window;
    uint64_t *locs;
    uint32_t n;    /* requests to run */
    uint32_t next; /* next to submit */
    uint32_t done;
    int failed;
    kvt_io_op_t op;
    uint32_t bs;
    uint32_t tok[16];
} pump_t;

static int pump_submit(pump_t *p, kvt_tier_io_t *io)
{
    uint32_t i = p->next++;
    io->key = (kvt_block_key_t){
        .ns_seed = 7, .hash = 1000 + i, .parent = 7, .tokens = p->tok, .ntokens = 16};
    io->len = p->bs;
    io->loc = p->op == KVT_IO_READ ? p->locs[i] : 0;
    io->status = 0;
    int rc = p->op == KVT_IO_WRITE ? kvt_tier_write(p->t, io) : kvt_tier_read(p->t, io);
    if (rc < 0) {
        fprintf(stderr, "bench_tiers: submit %u: %s\n", i, kvt_strerror(rc));
        p->failed = 1;
    }
    return rc;
}

static void pump_cb(kvt_tier_io_t *io)
{
    pump_t *p = io->data;
    uint32_t slot = (uint32_t)(io - p->ios);
    if (io->status < 0) {
        fprintf(stderr, "bench_tiers: %s failed: %s\n", p->op == KVT_IO_WRITE ? "write" : "read",
                kvt_strerror(io->status));
        p->failed = 1;
    }
    if (p->op == KVT_IO_WRITE)
        p->locs[io->key.hash - 1000] = io->loc;
    p->done++;
    if (p->next < p->n && !p->failed)
        pump_submit(p, &p->ios[slot]);
}

/* Submits the first `window` of n writes or reads of bs bytes; completions submit the rest.
 * Returns 0 or -1. */
static int pump_start(pump_t *p, kvt_io_op_t op, uint32_t n)
{
    p->op = op;
    p->n = n;
    p->next = p->done = 0;
    p->failed = 0;
    for (uint32_t w = 0; w < p->window && p->next < n; w++) {
        p->ios[w].buf = p->bufs[w];
        p->ios[w].cb = pump_cb;
        p->ios[w].data = p;
        if (pump_submit(p, &p->ios[w]) < 0)
            return -1;
    }
    return 0;
}

static int pump_busy(const pump_t *p)
{
    return p->done < p->next && !p->failed;
}

/* Runs n writes or reads of bs bytes with `window` in flight; returns seconds, or -1. */
static double pump_run(pump_t *p, kvt_io_op_t op, uint32_t n)
{
    double t0 = now_s();
    if (pump_start(p, op, n) < 0)
        return -1;
    while (pump_busy(p))
        if (kvt_tier_wait(p->t, 1000) < 0)
            return -1;
    double dt = now_s() - t0;
    return p->failed ? -1 : dt;
}

static void pump_init(pump_t *p, kvt_tier_t *t, uint32_t window, uint32_t bs, uint32_t nmax,
                      uint8_t **bufs)
{
    memset(p, 0, sizeof(*p));
    p->t = t;
    p->window = window;
    p->bs = bs;
    p->ios = calloc(window, sizeof(*p->ios));
    p->locs = calloc(nmax, sizeof(*p->locs));
    p->bufs = bufs;
    for (int i = 0; i < 16; i++)
        p->tok[i] = (uint32_t)i;
}

static void pump_free_all(pump_t *p, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++)
        kvt_tier_free(p->t, p->locs[i], p->bs);
}

static void pump_fini(pump_t *p)
{
    free(p->ios);
    free(p->locs);
}

/* ---- DRAM vs memcpy ---- */

static int bench_dram(const opts_t *o, size_t bs)
{
    const uint64_t cap = 256u << 20;
    uint32_t per_round = (uint32_t)(cap / (bs + 4096)); /* blocks that fit, size classes aside */
    uint32_t rounds =
        (uint32_t)((o->volume + (uint64_t)per_round * bs - 1) / ((uint64_t)per_round * bs));
    kvt_tier_t *t;
    kvt_tier_dram_conf_t c = {.capacity_bytes = cap, .pin = 2};
    if (kvt_tier_dram_create(&t, &c) < 0)
        return -1;
    uint8_t *src = xalign(bs), *dst = xalign(bs);
    fill(src, bs, 1);
    /* Writes copy from src and reads land in dst, as the baseline's memcpy does. */
    uint8_t **bufs = calloc(o->qd, sizeof(*bufs));
    /* The baseline's destination, faulted in, on the same kind of pages as the tier's region. */
    uint8_t *area = xalloc((size_t)per_round * bs, 1);
    pump_t p;
    pump_init(&p, t, o->qd, (uint32_t)bs, per_round, bufs);
    for (uint32_t i = 0; i < o->qd; i++)
        bufs[i] = src;
    /* Warm-up: the arena's pages are faulted in once, like the baseline's area. */
    if (pump_run(&p, KVT_IO_WRITE, per_round) < 0)
        return -1;
    pump_free_all(&p, per_round);

    double *runs = calloc(4 * (size_t)o->reps, sizeof(*runs));
    for (int rep = 0; rep < o->reps; rep++) {
        double tw = 0, tr = 0, bw = 0, br = 0;
        for (uint32_t r = 0; r < rounds; r++) {
            for (uint32_t i = 0; i < o->qd; i++)
                bufs[i] = src;
            double dt = pump_run(&p, KVT_IO_WRITE, per_round);
            if (dt < 0)
                return -1;
            tw += dt;
            for (uint32_t i = 0; i < o->qd; i++)
                bufs[i] = dst;
            if ((dt = pump_run(&p, KVT_IO_READ, per_round)) < 0)
                return -1;
            tr += dt;
            pump_free_all(&p, per_round);

            double t0 = now_s();
            for (uint32_t i = 0; i < per_round; i++)
                memcpy(area + (size_t)i * bs, src, bs);
            bw += now_s() - t0;
            t0 = now_s();
            for (uint32_t i = 0; i < per_round; i++) {
                memcpy(dst, area + (size_t)i * bs, bs);
                __asm__ volatile("" : : "r"(dst) : "memory");
            }
            br += now_s() - t0;
        }
        double bytes = (double)rounds * per_round * bs;
        runs[0 * o->reps + rep] = bytes / tw / 1e9;
        runs[1 * o->reps + rep] = bytes / bw / 1e9;
        runs[2 * o->reps + rep] = bytes / tr / 1e9;
        runs[3 * o->reps + rep] = bytes / br / 1e9;
    }
    emit_runs("dram", bs, runs, o->reps, "memcpy");
    free(runs);
    pump_fini(&p);
    kvt_tier_destroy(t);
    free(area);
    free(bufs);
    free(src);
    free(dst);
    return 0;
}

/* ---- NVMe vs fio ---- */

static void sync_cb(kvt_tier_io_t *io)
{
    *(int *)io->data = 1;
}

/* n blocks of bs bytes stored in a DRAM tier (*dram), each filled: kvtierd writes NVMe blocks from
 * and reads them into DRAM-tier blocks, whose memory (huge pages where the kernel has them,
 * tiers/dram.c) decides how many bios an O_DIRECT I/O of them takes. Returns the blocks' addresses,
 * or NULL. */
static uint8_t **dram_blocks(kvt_tier_t **dram, uint32_t n, size_t bs)
{
    kvt_tier_dram_conf_t c = {.capacity_bytes = (uint64_t)n * (bs + bs / 4 + 4096)};
    if (kvt_tier_dram_create(dram, &c) < 0)
        return NULL;
    uint8_t **bufs = calloc(n, sizeof(*bufs));
    uint8_t *tmp = xalign(bs);
    for (uint32_t i = 0; bufs && i < n; i++) {
        fill(tmp, bs, i);
        int done = 0;
        kvt_tier_io_t io = {.key = {.ns_seed = 7, .hash = 1 + i},
                            .buf = tmp,
                            .len = (uint32_t)bs,
                            .cb = sync_cb,
                            .data = &done};
        if (kvt_tier_write(*dram, &io) < 0)
            goto fail;
        while (!done)
            if (kvt_tier_wait(*dram, 1000) < 0)
                goto fail;
        if (io.status < 0)
            goto fail;
        bufs[i] = kvt_tier_ptr(*dram, io.loc);
    }
    free(tmp);
    return bufs;
fail:
    fprintf(stderr, "bench_tiers: cannot stage %u blocks of %zu bytes in a dram tier\n", n, bs);
    free(tmp);
    free(bufs);
    kvt_tier_destroy(*dram);
    *dram = NULL;
    return NULL;
}

/* Runs fio once; returns GB/s of op ("write" or "read"), or -1. */
static double fio_run(const char *dir, const char *op, size_t bs, uint32_t qd, uint64_t volume)
{
    char cmd[2048];
    snprintf(cmd, sizeof(cmd),
             "fio --name=kvt-bench --directory='%s' --filename=fio.data --rw=%s --bs=%zu "
             "--iodepth=%u --direct=1 --ioengine=io_uring --size=%llu --numjobs=1 "
             "--iodepth_batch_submit=1 --iodepth_batch_complete_min=1 --fixedbufs=0 "
             "--registerfiles=0 --sqthread_poll=0 --hipri=0 --output-format=json 2>/dev/null",
             dir, op, bs, qd, (unsigned long long)volume);
    FILE *f = popen(cmd, "r");
    if (!f)
        return -1;
    size_t cap = 1 << 20, len = 0;
    char *out = malloc(cap);
    size_t got;
    while ((got = fread(out + len, 1, cap - 1 - len, f)) > 0)
        len += got;
    out[len] = 0;
    int rc = pclose(f);
    double gbps = -1;
    char key[32];
    snprintf(key, sizeof(key), "\"%s\" : {", op);
    char *sec = strstr(out, key);
    char *bw = sec ? strstr(sec, "\"bw_bytes\" : ") : NULL;
    if (rc == 0 && bw)
        gbps = strtod(bw + strlen("\"bw_bytes\" : "), NULL) / 1e9;
    else
        fprintf(stderr, "bench_tiers: fio failed (exit %d): is fio installed?\n", rc);
    free(out);
    return gbps;
}

/* Before each timed phase, untimed: syncfs makes the virtual disk flush what its host still
 * holds of the previous phase's writes, so that no side pays for the one before it. */
static void settle(const char *dir)
{
    int fd = open(dir, O_RDONLY | O_DIRECTORY);
    if (fd >= 0) {
        (void)syncfs(fd);
        close(fd);
    }
}

static int bench_nvme(const opts_t *o, size_t bs)
{
    kvt_tier_t *dram;
    uint8_t **bufs = dram_blocks(&dram, o->qd, bs);
    if (!bufs)
        return -1;
    char dir[4096];
    snprintf(dir, sizeof(dir), "%s/kvt-bench-nvme-XXXXXX", o->dir);
    if (!mkdtemp(dir)) {
        fprintf(stderr, "bench_tiers: cannot make a directory under %s: %s\n", o->dir,
                strerror(errno));
        kvt_tier_destroy(dram);
        free(bufs);
        return -1;
    }
    uint32_t n = (uint32_t)(o->volume / bs);
    uint64_t seg = 64u << 20;
    uint64_t need = (uint64_t)n * (bs + 8192);
    uint64_t cap = ((need + need / 16) / seg + 2) * seg;
    kvt_tier_t *t;
    kvt_tier_nvme_conf_t c = {.dir = dir, .capacity_bytes = cap, .queue_depth = o->qd};
    int rc = kvt_tier_nvme_create(&t, &c);
    if (rc < 0) {
        fprintf(stderr, "bench_tiers: nvme tier in %s: %s\n", dir, kvt_strerror(rc));
        rmdir(dir);
        kvt_tier_destroy(dram);
        free(bufs);
        return -1;
    }
    if (!kvt_tier_nvme_direct(t))
        fprintf(stderr, "bench_tiers: %s refuses O_DIRECT: the nvme figures are buffered\n", dir);
    pump_t p;
    pump_init(&p, t, o->qd, (uint32_t)bs, n, bufs);
    /* The same tier fed from plain memory like fio's: one area of qd blocks on 4 KiB pages. */
    uint8_t *area = xalign((size_t)o->qd * bs);
    uint8_t **small = calloc(o->qd, sizeof(*small));
    for (uint32_t i = 0; i < o->qd; i++) {
        small[i] = area + (size_t)i * bs;
        fill(small[i], bs, i);
    }
    pump_t q;
    pump_init(&q, t, o->qd, (uint32_t)bs, n, small);
    double *runs = calloc(6 * (size_t)o->reps, sizeof(*runs));
    /* rep -1 is the untimed warm-up round. */
    for (int rep = -1; rep < o->reps && rc == 0; rep++) {
        /* Each side reads what it has just written (a virtual disk's host may cache recent
         * writes), and the two sides take turns going first. */
        double dw = 0, dr = 0, sw = 0, sr = 0, fw = 0, fr = 0;
        for (int side = 0; side < 2; side++) {
            if ((side == 0) == ((rep & 1) == 0)) {
                settle(dir);
                dw = pump_run(&p, KVT_IO_WRITE, n);
                settle(dir);
                dr = dw > 0 ? pump_run(&p, KVT_IO_READ, n) : -1;
                pump_free_all(&p, n);
                settle(dir);
                sw = dr > 0 ? pump_run(&q, KVT_IO_WRITE, n) : -1;
                settle(dir);
                sr = sw > 0 ? pump_run(&q, KVT_IO_READ, n) : -1;
                pump_free_all(&q, n);
            } else {
                settle(dir);
                fw = fio_run(dir, "write", bs, o->qd, (uint64_t)n * bs);
                settle(dir);
                fr = fio_run(dir, "read", bs, o->qd, (uint64_t)n * bs);
            }
        }
        if (dw < 0 || dr < 0 || sw < 0 || sr < 0 || fw < 0 || fr < 0) {
            rc = -1;
            break;
        }
        double bytes = (double)n * bs;
        fprintf(stderr,
                "bench_tiers: nvme %zu %s %d: write %.3f (4k pages %.3f, fio %.3f) read %.3f "
                "(4k pages %.3f, fio %.3f)\n",
                bs, rep < 0 ? "warm-up" : "rep", rep, bytes / dw / 1e9, bytes / sw / 1e9, fw,
                bytes / dr / 1e9, bytes / sr / 1e9, fr);
        if (rep < 0)
            continue;
        runs[0 * o->reps + rep] = bytes / dw / 1e9;
        runs[1 * o->reps + rep] = fw;
        runs[2 * o->reps + rep] = bytes / dr / 1e9;
        runs[3 * o->reps + rep] = fr;
        runs[4 * o->reps + rep] = bytes / sw / 1e9;
        runs[5 * o->reps + rep] = bytes / sr / 1e9;
    }
    if (rc == 0) {
        for (int k = 0; k < 2; k++) {
            double g = bench_median(runs + 2 * k * o->reps, o->reps);
            double f = bench_median(runs + (2 * k + 1) * o->reps, o->reps);
            double g4 = bench_median(runs + (4 + k) * o->reps, o->reps);
            printf("{\"tier\":\"nvme\",\"block_bytes\":%zu,\"op\":\"%s\",\"gbps\":%.3f,"
                   "\"baseline\":\"fio\",\"baseline_gbps\":%.3f,\"ratio\":%.3f,"
                   "\"buffers\":\"dram tier\",\"gbps_4k_pages\":%.3f,\"ratio_4k_pages\":%.3f}\n",
                   bs, k ? "read" : "write", g, f, f > 0 ? g / f : 0.0, g4, f > 0 ? g4 / f : 0.0);
        }
        fflush(stdout);
    }
    pump_fini(&q);
    free(small);
    free(area);
    free(runs);
    pump_fini(&p);
    kvt_tier_destroy(t);
    kvt_tier_destroy(dram);
    free(bufs);
    char path[4200];
    const char *files[] = {"kvtier.data", "kvtier.meta", "kvtier.lock", "fio.data"};
    for (size_t i = 0; i < KVT_ARRAY_LEN(files); i++) {
        snprintf(path, sizeof(path), "%s/%s", dir, files[i]);
        unlink(path);
    }
    rmdir(dir);
    return rc;
}

/* ---- HBM vs the copy ceiling (only with a usable GPU) ---- */

#if KVT_HAVE_CUDA
/* The machine's ceiling: one large copy from pinned memory to the device, one back, and the two
 * at once on two streams (the copy engines of both directions busy), each as fast as the DMA
 * goes with no per-copy cost. */
typedef struct ceiling {
    size_t bytes;
    void *host[2], *dev[2];
    cudaStream_t s[2];
} ceiling_t;

static int ceiling_open(ceiling_t *c, size_t bytes)
{
    memset(c, 0, sizeof(*c));
    c->bytes = bytes;
    for (int i = 0; i < 2; i++) {
        if (cudaHostAlloc(&c->host[i], bytes, cudaHostAllocDefault) != cudaSuccess ||
            cudaMalloc(&c->dev[i], bytes) != cudaSuccess ||
            cudaStreamCreateWithFlags(&c->s[i], cudaStreamNonBlocking) != cudaSuccess) {
            fprintf(stderr, "bench_tiers: cannot set up the hbm ceiling's %zu-byte copies\n",
                    bytes);
            return -1;
        }
        memset(c->host[i], 0x5a, bytes);
    }
    return 0;
}

static void ceiling_close(ceiling_t *c)
{
    for (int i = 0; i < 2; i++) {
        if (c->s[i])
            cudaStreamDestroy(c->s[i]);
        if (c->dev[i])
            cudaFree(c->dev[i]);
        if (c->host[i])
            cudaFreeHost(c->host[i]);
    }
}

/* GB/s of one copy to the device, one back, and both at once; returns 0 or -1. */
static int ceiling_run(ceiling_t *c, double *h2d, double *d2h, double *both)
{
    cudaError_t ce = cudaSuccess;
    double t0 = now_s();
    ce = cudaMemcpyAsync(c->dev[0], c->host[0], c->bytes, cudaMemcpyHostToDevice, c->s[0]);
    if (ce == cudaSuccess)
        ce = cudaStreamSynchronize(c->s[0]);
    double t1 = now_s();
    if (ce == cudaSuccess)
        ce = cudaMemcpyAsync(c->host[1], c->dev[1], c->bytes, cudaMemcpyDeviceToHost, c->s[1]);
    if (ce == cudaSuccess)
        ce = cudaStreamSynchronize(c->s[1]);
    double t2 = now_s();
    if (ce == cudaSuccess)
        ce = cudaMemcpyAsync(c->dev[0], c->host[0], c->bytes, cudaMemcpyHostToDevice, c->s[0]);
    if (ce == cudaSuccess)
        ce = cudaMemcpyAsync(c->host[1], c->dev[1], c->bytes, cudaMemcpyDeviceToHost, c->s[1]);
    if (ce == cudaSuccess)
        ce = cudaStreamSynchronize(c->s[0]);
    if (ce == cudaSuccess)
        ce = cudaStreamSynchronize(c->s[1]);
    double t3 = now_s();
    if (ce != cudaSuccess) {
        fprintf(stderr, "bench_tiers: ceiling copy failed: %s\n", cudaGetErrorString(ce));
        return -1;
    }
    *h2d = (double)c->bytes / (t1 - t0) / 1e9;
    *d2h = (double)c->bytes / (t2 - t1) / 1e9;
    *both = 2.0 * (double)c->bytes / (t3 - t2) / 1e9;
    return 0;
}

static void emit_hbm(size_t bs, const char *op, const opts_t *o, uint32_t batch,
                     const kvt_tier_hbm_stats_t *st, double gbps, const char *base,
                     double base_gbps)
{
    printf("{\"tier\":\"hbm\",\"block_bytes\":%zu,\"op\":\"%s\",\"qd\":%u,\"batch\":%u,"
           "\"api\":\"%s\",\"copies_per_batch\":%.2f,\"gbps\":%.3f,\"baseline\":\"%s\","
           "\"baseline_gbps\":%.3f,\"ratio\":%.3f}\n",
           bs, op, o->qd, batch, st->api,
           st->batches ? (double)st->copies / (double)st->batches : 0.0, gbps, base, base_gbps,
           base_gbps > 0 ? gbps / base_gbps : 0.0);
    fflush(stdout);
}

/* One batch size: --reps rounds of the ceiling, then the tier's writes, reads, and reads and
 * writes at once, from and into pinned DRAM-tier blocks as when the policy moves blocks. */
static int bench_hbm_batch(const opts_t *o, size_t bs, uint32_t batch, ceiling_t *ceil,
                           uint8_t **wbufs, uint8_t **rbufs)
{
    uint32_t n = (uint32_t)(o->volume / bs);
    kvt_tier_t *h;
    /* Room for n blocks, and n more written while the first n are read back. */
    kvt_tier_hbm_conf_t hc = {.backend = "cuda", .capacity_bytes = 2ull * n * bs, .batch = batch};
    if (kvt_tier_hbm_create(&h, &hc) < 0)
        return -1;
    pump_t p, q;
    pump_init(&p, h, o->qd, (uint32_t)bs, n, wbufs);
    pump_init(&q, h, o->qd, (uint32_t)bs, n, rbufs);
    double *runs = calloc(6 * (size_t)o->reps, sizeof(*runs));
    int rc = 0;
    for (int rep = 0; rep < o->reps && rc == 0; rep++) {
        double c_h2d, c_d2h, c_both;
        if (ceiling_run(ceil, &c_h2d, &c_d2h, &c_both) < 0) {
            rc = -1;
            break;
        }
        double dw = pump_run(&p, KVT_IO_WRITE, n);
        p.bufs = rbufs; /* reads land in the other blocks */
        double dr = dw > 0 ? pump_run(&p, KVT_IO_READ, n) : -1;
        /* Both at once: p reads its n blocks back while q writes n new ones. */
        double db = -1;
        if (dr > 0) {
            double t0 = now_s();
            q.bufs = wbufs;
            if (pump_start(&p, KVT_IO_READ, n) == 0 && pump_start(&q, KVT_IO_WRITE, n) == 0) {
                while (pump_busy(&p) || pump_busy(&q))
                    if (kvt_tier_wait(h, 1000) < 0)
                        break;
                if (!p.failed && !q.failed && p.done == n && q.done == n)
                    db = now_s() - t0;
            }
            q.bufs = rbufs;
        }
        p.bufs = wbufs;
        if (dw < 0 || dr < 0 || db < 0) {
            rc = -1;
            break;
        }
        pump_free_all(&p, n);
        pump_free_all(&q, n);
        double bytes = (double)n * bs;
        runs[0 * o->reps + rep] = bytes / dw / 1e9;
        runs[1 * o->reps + rep] = c_h2d;
        runs[2 * o->reps + rep] = bytes / dr / 1e9;
        runs[3 * o->reps + rep] = c_d2h;
        runs[4 * o->reps + rep] = 2 * bytes / db / 1e9;
        runs[5 * o->reps + rep] = c_both;
        fprintf(stderr,
                "bench_tiers: hbm %zu batch %u rep %d: write %.3f (ceiling %.3f) read %.3f "
                "(%.3f) both %.3f (%.3f)\n",
                bs, batch, rep, runs[0 * o->reps + rep], c_h2d, runs[2 * o->reps + rep], c_d2h,
                runs[4 * o->reps + rep], c_both);
    }
    if (rc == 0) {
        kvt_tier_hbm_stats_t st;
        kvt_tier_hbm_stats(h, &st);
        char base[64];
        snprintf(base, sizeof(base), "one %llu MiB pinned copy",
                 (unsigned long long)(ceil->bytes >> 20));
        const char *ops[3] = {"write", "read", "read+write"};
        char both[128];
        snprintf(both, sizeof(both), "%s each way at once", base);
        for (int k = 0; k < 3; k++)
            emit_hbm(bs, ops[k], o, batch, &st, bench_median(runs + 2 * k * o->reps, o->reps),
                     k == 2 ? both : base, bench_median(runs + (2 * k + 1) * o->reps, o->reps));
    } else {
        fprintf(stderr, "bench_tiers: hbm %zu batch %u failed\n", bs, batch);
    }
    free(runs);
    pump_fini(&p);
    pump_fini(&q);
    kvt_tier_destroy(h);
    return rc;
}

static int bench_hbm(const opts_t *o, size_t bs)
{
    /* The host side of every copy is a pinned DRAM-tier block: qd to write from, qd to read
     * into. */
    kvt_tier_t *d;
    kvt_tier_dram_conf_t dc = {.capacity_bytes = 2ull * o->qd * (bs + (64u << 10)), .pin = 1};
    if (kvt_tier_dram_create(&d, &dc) < 0)
        return -1;
    uint8_t **bufs = calloc(2 * (size_t)o->qd, sizeof(*bufs));
    uint8_t *src = xalign(bs);
    int rc = 0;
    for (uint32_t i = 0; i < 2 * o->qd && rc == 0; i++) {
        fill(src, bs, i);
        int done = 0;
        kvt_tier_io_t io = {.key = {.ns_seed = 7, .hash = 1 + i, .parent = 7},
                            .buf = src,
                            .len = (uint32_t)bs,
                            .cb = sync_cb,
                            .data = &done};
        if (kvt_tier_write(d, &io) < 0)
            rc = -1;
        while (rc == 0 && !done)
            if (kvt_tier_wait(d, 1000) < 0)
                rc = -1;
        if (rc == 0 && io.status < 0)
            rc = -1;
        if (rc == 0)
            bufs[i] = kvt_tier_ptr(d, io.loc);
    }
    ceiling_t ceil;
    memset(&ceil, 0, sizeof(ceil));
    if (rc == 0)
        rc = ceiling_open(&ceil, (size_t)o->ceiling);
    /* 1: a cudaMemcpyAsync per copy (what the tier did before batches); 16: the daemon's
     * default hbm-batch; 64: larger batches. */
    static const uint32_t batches[] = {1, 16, 64};
    for (size_t i = 0; rc == 0 && i < KVT_ARRAY_LEN(batches); i++)
        rc = bench_hbm_batch(o, bs, batches[i], &ceil, bufs, bufs + o->qd);
    ceiling_close(&ceil);
    kvt_tier_destroy(d);
    free(bufs);
    free(src);
    return rc;
}
#endif

static void usage(void)
{
    fprintf(stderr,
            "usage: bench_tiers [--dir DIR] [--redis HOST:PORT] [--mib-per-case N] [--qd N]\n"
            "                   [--reps N] [--only dram|nvme|hbm|remote|cluster] [--no-remote]\n"
            "                   [--no-cluster] [--ceiling-mib N]\n");
    exit(2);
}

int main(int argc, char **argv)
{
    opts_t o = {.volume = 1ull << 30, .qd = 32, .ceiling = 1ull << 30, .reps = 5};
    const char *only = NULL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--dir") && v)
            o.dir = v, i++;
        else if (!strcmp(a, "--redis") && v)
            o.redis = v, i++;
        else if (!strcmp(a, "--mib-per-case") && v)
            o.volume = strtoull(v, NULL, 10) << 20, i++;
        else if (!strcmp(a, "--ceiling-mib") && v)
            o.ceiling = strtoull(v, NULL, 10) << 20, i++;
        else if (!strcmp(a, "--qd") && v)
            o.qd = (uint32_t)strtoul(v, NULL, 10), i++;
        else if (!strcmp(a, "--reps") && v)
            o.reps = atoi(v), i++;
        else if (!strcmp(a, "--only") && v)
            only = v, i++;
        else if (!strcmp(a, "--no-remote"))
            o.no_remote = 1;
        else if (!strcmp(a, "--no-cluster"))
            o.no_cluster = 1;
        else
            usage();
    }
    if (o.volume < (16u << 20) || o.qd < 2 || o.qd > 1024 || o.reps < 1 || o.ceiling < (1u << 20))
        usage();
    if (!o.dir) {
        o.dir = getenv("KVT_BENCH_DIR");
        if (!o.dir)
            o.dir = getenv("TMPDIR");
        if (!o.dir || !*o.dir)
            o.dir = "/tmp";
    }
    kvt_log_set_level(KVT_LOG_WARN);
    static const size_t sizes[] = {256u << 10, 2u << 20};
    int rc = 0;
    for (size_t i = 0; i < KVT_ARRAY_LEN(sizes); i++) {
        if (!only || !strcmp(only, "dram"))
            rc |= bench_dram(&o, sizes[i]) < 0;
        if (!only || !strcmp(only, "nvme"))
            rc |= bench_nvme(&o, sizes[i]) < 0;
#if KVT_HAVE_CUDA
        if ((!only || !strcmp(only, "hbm")) && kvt_tier_cuda_usable())
            rc |= bench_hbm(&o, sizes[i]) < 0;
#endif
    }
#if KVT_HAVE_CUDA
    if ((!only || !strcmp(only, "hbm")) && !kvt_tier_cuda_usable())
        fprintf(stderr, "bench_tiers: no usable GPU: hbm not measured\n");
#endif
    if ((!only || !strcmp(only, "remote")) && !o.no_remote)
        rc |= bench_remote_run(o.redis, sizes, (int)KVT_ARRAY_LEN(sizes)) < 0;
    if ((!only || !strcmp(only, "remote") || !strcmp(only, "cluster")) && !o.no_remote &&
        !o.no_cluster)
        rc |= bench_remote_cluster_run(sizes, (int)KVT_ARRAY_LEN(sizes)) < 0;
    return rc ? 1 : 0;
}
