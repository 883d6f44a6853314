/*
 * dram.c: the DRAM tier. Block memory comes from a jemalloc arena of its own (arenas.create with
 * extent hooks), and that arena gets its pages from one region this file maps at creation and
 * hands out front to back. One region means one cudaHostRegister call pins all of it when a GPU
 * is usable, instead of a costly registration per block, and it bounds how much memory the tier
 * can ever take. jemalloc keeps freed extents for reuse (our dalloc opts out), so the bump
 * pointer only grows until the arena's working set is mapped.
 *
 * A block's footprint is nallocx() of its length: the size class jemalloc really uses, so
 * usage.used_bytes equals what the arena reports allocated (tests check it). Allocations skip the
 * thread cache so that a free goes back to the arena at once. Blocks of 4 KiB or more are 4 KiB
 * aligned, so that the NVMe tier moves them with O_DIRECT without a bounce buffer.
 */
#include "tier_impl.h"

#include <errno.h>
#include <jemalloc/jemalloc.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "config.h"
#if KVT_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

typedef struct dram {
    extent_hooks_t hooks; /* first: the hooks get &hooks and find the rest from it */
    pthread_mutex_t mu;
    uint8_t *region;
    size_t region_bytes;
    size_t bump;
    unsigned arena;
    int arena_made;
    int pinned;
    uint64_t pin_ns; /* how long cudaHostRegister took */
    int warned_full;
} dram_t;

static dram_t *dram_of_hooks(extent_hooks_t *h)
{
    return (dram_t *)(void *)h;
}

static void *dram_ext_alloc(extent_hooks_t *h, void *new_addr, size_t size, size_t alignment,
                            bool *zero, bool *commit, unsigned arena_ind)
{
    (void)arena_ind;
    dram_t *d = dram_of_hooks(h);
    void *ret = NULL;
    pthread_mutex_lock(&d->mu);
    size_t at = (d->bump + alignment - 1) & ~(alignment - 1);
    if (at <= d->region_bytes && size <= d->region_bytes - at &&
        (!new_addr || new_addr == d->region + at)) {
        ret = d->region + at;
        d->bump = at + size;
    }
    pthread_mutex_unlock(&d->mu);
    if (ret) {
        *zero = true; /* never handed out before: still the zero pages of the mapping */
        *commit = true;
    }
    return ret;
}

/* Opt out of giving extents back: jemalloc retains and reuses them. */
static bool dram_ext_dalloc(extent_hooks_t *h, void *addr, size_t size, bool committed,
                            unsigned arena_ind)
{
    (void)h, (void)addr, (void)size, (void)committed, (void)arena_ind;
    return true;
}

static void dram_ext_destroy(extent_hooks_t *h, void *addr, size_t size, bool committed,
                             unsigned arena_ind)
{
    (void)h, (void)addr, (void)size, (void)committed, (void)arena_ind;
}

static bool dram_ext_commit(extent_hooks_t *h, void *addr, size_t size, size_t offset,
                            size_t length, unsigned arena_ind)
{
    (void)h, (void)addr, (void)size, (void)offset, (void)length, (void)arena_ind;
    return false; /* always committed */
}

static bool dram_ext_decommit(extent_hooks_t *h, void *addr, size_t size, size_t offset,
                              size_t length, unsigned arena_ind)
{
    (void)h, (void)addr, (void)size, (void)offset, (void)length, (void)arena_ind;
    return true; /* refused: pages stay committed */
}

/* Purging is refused: the region's pages stay resident (and pinned ones stay registered), so
 * a freed extent goes straight to jemalloc's retained set, where it coalesces with its
 * neighbours, and reusing it takes no page fault. */
static bool dram_ext_purge(extent_hooks_t *h, void *addr, size_t size, size_t offset, size_t length,
                           unsigned arena_ind)
{
    (void)h, (void)addr, (void)size, (void)offset, (void)length, (void)arena_ind;
    return true;
}

/* The region is one mapping, so any split or merge of extents inside it is valid. */
static bool dram_ext_split(extent_hooks_t *h, void *addr, size_t size, size_t size_a, size_t size_b,
                           bool committed, unsigned arena_ind)
{
    (void)h, (void)addr, (void)size, (void)size_a, (void)size_b, (void)committed, (void)arena_ind;
    return false;
}

static bool dram_ext_merge(extent_hooks_t *h, void *addr_a, size_t size_a, void *addr_b,
                           size_t size_b, bool committed, unsigned arena_ind)
{
    (void)h, (void)addr_a, (void)size_a, (void)addr_b, (void)size_b, (void)committed,
        (void)arena_ind;
    return false;
}

/*
 * Maps the region on a 2 MiB boundary and asks for transparent huge pages (where the kernel has
 * them on, even only for madvise). A block then sits on one or two physically contiguous pages:
 * a copy of it takes one TLB entry instead of 64 per 256 KiB, and an O_DIRECT write of it to the
 * NVMe tier is one bio of a few segments instead of one per 4 KiB page. Measured: bench_tiers'
 * 2 MiB NVMe writes ran at 5.5-5.7 GB/s from such buffers against 3.2-3.4 from 32 separately
 * allocated 4 KiB-page buffers in alternating runs (the block layer split those records into
 * several bios each; docs/tiers.md).
 */
static uint8_t *dram_map_huge(size_t bytes)
{
    const size_t huge = 2u << 20;
    uint8_t *m = mmap(NULL, bytes + huge, PROT_READ | PROT_WRITE,
                      MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED)
        return NULL;
    uint8_t *r = (uint8_t *)(((uintptr_t)m + huge - 1) & ~(uintptr_t)(huge - 1));
    if (r > m)
        munmap(m, (size_t)(r - m));
    if (r + bytes < m + bytes + huge)
        munmap(r + bytes, (size_t)(m + bytes + huge - (r + bytes)));
    if (madvise(r, bytes, MADV_HUGEPAGE) != 0)
        kvt_log(KVT_LOG_DEBUG, "dram tier: no transparent huge pages for the region: %s",
                strerror(errno));
    return r;
}

static int dram_flags(const dram_t *d, uint32_t len)
{
    int f = MALLOCX_ARENA(d->arena) | MALLOCX_TCACHE_NONE;
    if (len >= 4096)
        f |= MALLOCX_ALIGN(4096);
    return f;
}

static uint64_t dram_footprint(const kvt_tier_t *t, uint32_t len)
{
    const dram_t *d = t->impl;
    return nallocx(len, dram_flags(d, len));
}

static int dram_write(kvt_tier_t *t, kvt_tier_io_t *io)
{
    dram_t *d = t->impl;
    void *p = mallocx(io->len, dram_flags(d, io->len));
    if (!p) {
        if (!d->warned_full) {
            kvt_log(KVT_LOG_WARN,
                    "dram tier: its %zu-byte region is exhausted by fragmentation below capacity",
                    d->region_bytes);
            d->warned_full = 1;
        }
        return KVT_ENOSPC;
    }
    kvt_assert(sallocx(p, dram_flags(d, io->len)) == io->charge);
    memcpy(p, io->buf, io->len);
    io->loc = (uint64_t)(uintptr_t)p;
    kvt__tier_complete(t, io, 0);
    return 0;
}

static int dram_read(kvt_tier_t *t, kvt_tier_io_t *io)
{
    memcpy(io->buf, (const void *)(uintptr_t)io->loc, io->len);
    kvt__tier_complete(t, io, 0);
    return 0;
}

static void dram_free(kvt_tier_t *t, uint64_t loc, uint32_t len)
{
    dram_t *d = t->impl;
    dallocx((void *)(uintptr_t)loc, dram_flags(d, len));
}

static void *dram_ptr(kvt_tier_t *t, uint64_t loc)
{
    (void)t;
    return (void *)(uintptr_t)loc;
}

static void dram_release(dram_t *d)
{
    if (d->arena_made) {
        char name[64];
        snprintf(name, sizeof(name), "arena.%u.destroy", d->arena);
        if (mallctl(name, NULL, NULL, NULL, 0) != 0)
            kvt_log(KVT_LOG_WARN, "dram tier: jemalloc refused to destroy arena %u", d->arena);
    }
#if KVT_HAVE_CUDA
    if (d->pinned)
        cudaHostUnregister(d->region);
#endif
    if (d->region)
        munmap(d->region, d->region_bytes);
    pthread_mutex_destroy(&d->mu);
    free(d);
}

static void dram_free_block(void *arg, const kvt__tier_ent_t *e)
{
    dram_t *d = arg;
    dallocx((void *)(uintptr_t)e->loc, dram_flags(d, e->len));
}

/* Blocks still stored when the tier goes are freed before the arena is destroyed. */
static void dram_destroy_all(kvt_tier_t *t)
{
    kvt__tier_foreach(t, dram_free_block, t->impl);
    dram_release(t->impl);
}

static const kvt_tier_ops_t dram_ops = {
    .backend = "jemalloc",
    .footprint = dram_footprint,
    .write = dram_write,
    .read = dram_read,
    .free = dram_free,
    .ptr = dram_ptr,
    .destroy = dram_destroy_all,
};

unsigned kvt_tier_dram_arena(const kvt_tier_t *t)
{
    return t && t->ops == &dram_ops ? ((const dram_t *)t->impl)->arena : 0;
}

int kvt_tier_dram_pinned(const kvt_tier_t *t)
{
    return t && t->ops == &dram_ops ? ((const dram_t *)t->impl)->pinned : 0;
}

int kvt_tier_dram_create(kvt_tier_t **out, const kvt_tier_dram_conf_t *conf)
{
    if (!out || !conf || conf->capacity_bytes == 0 || conf->capacity_bytes > (1ull << 46) ||
        conf->pin < 0 || conf->pin > 2)
        return KVT_EINVAL;
    int want_pin = conf->pin != 2 && kvt_tier_cuda_usable();
    if (conf->pin == 1 && !want_pin) {
        kvt_log(KVT_LOG_ERROR, "dram tier: pinning required but no CUDA device is usable");
        return KVT_EUNAVAIL;
    }
    dram_t *d = calloc(1, sizeof(*d));
    if (!d)
        return KVT_ENOMEM;
    pthread_mutex_init(&d->mu, NULL);
    d->hooks = (extent_hooks_t){
        .alloc = dram_ext_alloc,
        .dalloc = dram_ext_dalloc,
        .destroy = dram_ext_destroy,
        .commit = dram_ext_commit,
        .decommit = dram_ext_decommit,
        .purge_lazy = dram_ext_purge,
        .purge_forced = dram_ext_purge,
        .split = dram_ext_split,
        .merge = dram_ext_merge,
    };
    /* Slack for size classes (up to a quarter above the request), alignment and the arena's
     * own metadata. */
    uint64_t bytes = conf->capacity_bytes + conf->capacity_bytes / 4 + (64u << 20);
    d->region_bytes = (size_t)((bytes + (2u << 20) - 1) & ~(uint64_t)((2u << 20) - 1));
    d->region = dram_map_huge(d->region_bytes);
    if (!d->region) {
        dram_release(d);
        return KVT_ENOMEM;
    }
#if KVT_HAVE_CUDA
    if (want_pin) {
        /* Pinning touches and locks every page of the region (1.4 s for 4 GiB on an H200
         * host): the log says how long, since it delays the start-up. */
        uint64_t t0 = kvt_now_ns();
        cudaError_t ce = cudaHostRegister(d->region, d->region_bytes, cudaHostRegisterDefault);
        d->pin_ns = kvt_now_ns() - t0;
        if (ce != cudaSuccess) {
            kvt_log(conf->pin == 1 ? KVT_LOG_ERROR : KVT_LOG_WARN,
                    "dram tier: cudaHostRegister of %zu bytes failed: %s", d->region_bytes,
                    cudaGetErrorString(ce));
            if (conf->pin == 1) {
                dram_release(d);
                return KVT_EUNAVAIL;
            }
        } else {
            d->pinned = 1;
        }
    }
#endif
    extent_hooks_t *hp = &d->hooks;
    size_t sz = sizeof(d->arena);
    if (mallctl("arenas.create", &d->arena, &sz, &hp, sizeof(hp)) != 0) {
        kvt_log(KVT_LOG_ERROR, "dram tier: jemalloc arenas.create failed");
        dram_release(d);
        return KVT_EIO;
    }
    d->arena_made = 1;
    /* Freed extents leave the dirty set at once: with purging refused they land in the
     * retained set, which jemalloc coalesces eagerly (dirty extents coalesce only when they
     * decay), so a mix of block sizes does not fragment the region. */
    ssize_t now = 0;
    char name[64];
    snprintf(name, sizeof(name), "arena.%u.dirty_decay_ms", d->arena);
    (void)mallctl(name, NULL, NULL, &now, sizeof(now));
    snprintf(name, sizeof(name), "arena.%u.muzzy_decay_ms", d->arena);
    (void)mallctl(name, NULL, NULL, &now, sizeof(now));
    /* jemalloc grows its retained memory geometrically; from a fixed region that would strand
     * up to half of it in one last oversized request. Small steps keep the slack bounded. */
    size_t grow = 8u << 20;
    snprintf(name, sizeof(name), "arena.%u.retain_grow_limit", d->arena);
    if (mallctl(name, NULL, NULL, &grow, sizeof(grow)) != 0)
        kvt_log(KVT_LOG_WARN, "dram tier: jemalloc refused retain_grow_limit");
    int rc = kvt__tier_init(out, KVT_TIER_DRAM, &dram_ops, d, conf->capacity_bytes);
    if (rc < 0) {
        dram_release(d);
        return rc;
    }
    if (d->pinned)
        kvt_log(KVT_LOG_INFO,
                "dram tier: %llu bytes, jemalloc arena %u, pinned for CUDA (%zu bytes registered "
                "in %.3f s)",
                (unsigned long long)conf->capacity_bytes, d->arena, d->region_bytes,
                (double)d->pin_ns / 1e9);
    else
        kvt_log(KVT_LOG_INFO, "dram tier: %llu bytes, jemalloc arena %u, not pinned",
                (unsigned long long)conf->capacity_bytes, d->arena);
    return 0;
}
