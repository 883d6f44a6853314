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
 *
 * Shared arenas (zero-copy local clients, tier.h): a namespace may get an arena of its own over
 * a memfd instead of the anonymous region, same hooks and flags, except that freed extents are
 * purged by punching holes in the memfd, once the tier's footprint passes its capacity
 * (dram_trim). Per namespace so that a client mapping it sees only its
 * own tenant's blocks. Which arena a block lies in is an address-range check, which is how a free
 * finds the arena whose live-block count it lowers.
 *
 *   main region   [ anonymous, 2 MiB aligned, maybe pinned ..................... ]
 *   ns A arena    [ memfd "kvtier-ns-<A>", MAP_SHARED, sparse, holes punched .... ]  client A maps
 *   ns B arena    [ memfd "kvtier-ns-<B>" ...................................... ]  client B maps
 */
#define _GNU_SOURCE /* memfd_create, fallocate's FALLOC_FL_PUNCH_HOLE */
#include "tier_impl.h"

#include <errno.h>
#include <fcntl.h>
#include <jemalloc/jemalloc.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "config.h"
#define XXH_STATIC_LINKING_ONLY
#include <xxhash.h>
#if defined(__x86_64__)
/* The widest vector unit the CPU has (blockhdr.c says why): a seal is on a zero-copy COMMIT's
 * path, 24 us per 2 MiB with AVX-512 against 106 with the SSE2 entry point. */
#include <xxh_x86dispatch.h>
#endif
#if KVT_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

/* A mapped region and the bump pointer its arena's extent hooks hand it out with: the main
 * region, or a shared arena's memfd mapping. */
/* How often kvt_tier_dram_decay checks each arena's memfd for pages no live block holds (a
 * client's writes or fallocate outside its blocks) and punches them (dram_shared_scan). */
#define KVT_DRAM_SCAN_NS (1000ull * 1000 * 1000)

typedef struct dram_space {
    extent_hooks_t hooks; /* first: the hooks get &hooks and find the rest from it */
    pthread_mutex_t mu;   /* the hooks run in whichever thread jemalloc calls them from */
    uint8_t *base;
    size_t bytes;
    size_t bump;
    int fd; /* a shared arena's memfd; -1 for the main region */
    unsigned arena;
    int arena_made;
    int warned_full;
} dram_space_t;

/* A namespace's shared arena (tier.h). */
typedef struct dram_shared {
    dram_space_t sp; /* first: its hooks find it */
    uint64_t seed;
    uint32_t refs;         /* kvt_tier_dram_share calls not yet unshared */
    uint64_t blocks;       /* allocations in it, orphans too: destroyed only once both are 0 */
    uint64_t orphan_bytes; /* charge of its orphans (kvt_tier_dram_orphan): allocated, not live */
    uint64_t used_seq;     /* dram_t.seq at its last write or free: the trim's oldest first */
    uint64_t purged_seq;   /* used_seq when dram_trim last purged it */
    uint64_t dirty;        /* its freed pages' bytes, as dram_trim last read them */
} dram_shared_t;

typedef struct dram {
    dram_space_t sp; /* the main region */
    int pinned;
    uint64_t pin_ns; /* how long cudaHostRegister took */
    /* The shared arenas, nshared of them in no order. A table scanned linearly: max_shared is
     * the number of namespaces with zero-copy clients on this host, a handful, and a write
     * costs a memcpy of kilobytes to megabytes beside which the scan is noise. */
    dram_shared_t **shared;
    uint32_t nshared, max_shared;
    uint64_t scan_at; /* when kvt_tier_dram_decay scans the arenas' memfds next */
    uint64_t punched; /* bytes the scans punched: touched by a client, held by no block */
    uint64_t scans;   /* arenas scanned (their resident bytes exceeded what jemalloc holds) */
    uint64_t scan_ns; /* time those scans took */
    uint64_t seq;     /* bumped by each write and free in a shared arena (used_seq) */
    /* The main region's live blocks' charges, and the end (offset) of the highest block it ever
     * held: the pages below it are the ones its blocks touched, resident for good (its purges
     * are refused), so hw - main_live bounds its freed-but-kept bytes (dram_trim). */
    uint64_t main_live, main_hw;
    uint64_t trims;             /* arenas dram_trim purged */
    uint64_t trimmed_bytes;     /* bytes those purges gave back (the memfds' resident bytes) */
    uint64_t scribbles;         /* sealed blocks found changed (kvt_tier_dram_check) */
    uint64_t sealed, sealed_as; /* seals hashed here; seals given by the caller (seal_as) */
    /* Seals under way (kvt_tier_dram_seal_later), oldest first from seal_head; the first one's
     * hash state, seal_done bytes into it. Each names its block by location and by the ticket
     * its index entry holds in sum while sealed is 2, so that a block freed (and its address
     * reused) meanwhile is passed over. */
    struct dram_seal {
        uint64_t loc, ticket;
    } * seals;
    size_t nseals, seal_head, seal_cap;
    XXH3_state_t *seal_st;
    uint32_t seal_done;
    uint64_t seal_ticket;
    kvt_tier_t *tier; /* the tier this is the impl of: the scan walks its location index */
} dram_t;

static dram_space_t *space_of_hooks(extent_hooks_t *h)
{
    return (dram_space_t *)(void *)h;
}

/* Bump allocation, aligned on the address (a memfd mapping is only page-aligned, and jemalloc
 * asks for 2 MiB-aligned chunks for its metadata). */
static void *dram_ext_alloc(extent_hooks_t *h, void *new_addr, size_t size, size_t alignment,
                            bool *zero, bool *commit, unsigned arena_ind)
{
    (void)arena_ind;
    dram_space_t *sp = space_of_hooks(h);
    void *ret = NULL;
    pthread_mutex_lock(&sp->mu);
    uintptr_t b = (uintptr_t)sp->base;
    size_t at = (size_t)(((b + sp->bump + alignment - 1) & ~(uintptr_t)(alignment - 1)) - b);
    if (at <= sp->bytes && size <= sp->bytes - at && (!new_addr || new_addr == sp->base + at)) {
        ret = sp->base + at;
        sp->bump = at + size;
    }
    pthread_mutex_unlock(&sp->mu);
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

/*
 * A shared arena purges for real: its pages would otherwise stay resident after its namespace's
 * blocks go, and memory stranded in one namespace's arena is memory no other namespace (nor the
 * main region) can use, so the tier's footprint would grow past its capacity as namespaces come
 * and go. A hole punched in the memfd gives the pages back to the kernel (a mere MADV_DONTNEED
 * would not: the shmem pages belong to the file, and clients map it too) and reads as zeros
 * afterwards, which is what jemalloc assumes of a forced purge. Both kinds punch: a lazy purge
 * that happens to zero is still a valid lazy purge.
 */
static bool dram_ext_punch(extent_hooks_t *h, void *addr, size_t size, size_t offset, size_t length,
                           unsigned arena_ind)
{
    (void)size, (void)arena_ind;
    dram_space_t *sp = space_of_hooks(h);
    uint8_t *p = addr;
    if (p < sp->base || p >= sp->base + sp->bytes)
        return true; /* metadata memory (dram_ext_alloc_shared): not ours to punch */
    off_t at = (off_t)(p - sp->base + offset);
    return fallocate(sp->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, at, (off_t)length) != 0;
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
static uint8_t *dram_map_aligned(size_t bytes, size_t align)
{
    uint8_t *m = mmap(NULL, bytes + align, PROT_READ | PROT_WRITE,
                      MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED)
        return NULL;
    uint8_t *r = (uint8_t *)(((uintptr_t)m + align - 1) & ~(uintptr_t)(align - 1));
    if (r > m)
        munmap(m, (size_t)(r - m));
    if (r + bytes < m + bytes + align)
        munmap(r + bytes, (size_t)(m + bytes + align - (r + bytes)));
    return r;
}

static uint8_t *dram_map_huge(size_t bytes)
{
    uint8_t *r = dram_map_aligned(bytes, 2u << 20);
    if (!r)
        return NULL;
    if (madvise(r, bytes, MADV_HUGEPAGE) != 0)
        kvt_log(KVT_LOG_DEBUG, "dram tier: no transparent huge pages for the region: %s",
                strerror(errno));
    return r;
}

static int space_holds(const dram_space_t *sp, uint64_t loc)
{
    uintptr_t p = (uintptr_t)loc, b = (uintptr_t)sp->base;
    return p >= b && p - b < sp->bytes;
}

/*
 * A shared arena's jemalloc metadata (the arena itself, its extent records, its bins) must not
 * live in the memfd: a client maps all of it read-write and could then corrupt the daemon's
 * allocator. jemalloc asks the hooks for metadata through base_map, always 2 MiB aligned with no
 * address wanted; block extents come PAGE aligned (this file never asks for more than 4 KiB
 * alignment). So 2 MiB-aligned requests get private anonymous memory, which dalloc (base_unmap,
 * when the arena is destroyed) unmaps. A block extent fresh from the memfd is not reported
 * zeroed: a client may have written anywhere in its mapping, even where no block was yet.
 */
static void *dram_ext_alloc_shared(extent_hooks_t *h, void *new_addr, size_t size, size_t alignment,
                                   bool *zero, bool *commit, unsigned arena_ind)
{
    if (!new_addr && alignment >= (2u << 20)) {
        void *m = dram_map_aligned(size, alignment);
        if (m) {
            *zero = true;
            *commit = true;
        }
        return m;
    }
    bool want_zero = *zero;
    void *p = dram_ext_alloc(h, new_addr, size, alignment, zero, commit, arena_ind);
    if (p) {
        if (want_zero)
            memset(p, 0, size);
        *zero = want_zero;
    }
    return p;
}

static bool dram_ext_dalloc_shared(extent_hooks_t *h, void *addr, size_t size, bool committed,
                                   unsigned arena_ind)
{
    (void)committed, (void)arena_ind;
    if (space_holds(space_of_hooks(h), (uint64_t)(uintptr_t)addr))
        return true; /* a block extent: retained, like the main region's */
    munmap(addr, size);
    return false;
}

static int dram_flags(unsigned arena, uint32_t len)
{
    int f = MALLOCX_ARENA(arena) | MALLOCX_TCACHE_NONE;
    if (len >= 4096)
        f |= MALLOCX_ALIGN(4096);
    return f;
}

static uint64_t dram_footprint(const kvt_tier_t *t, uint32_t len)
{
    const dram_t *d = t->impl;
    /* Size classes are the same in every arena, so a shared arena's block costs the same. */
    return nallocx(len, dram_flags(d->sp.arena, len));
}

static dram_shared_t *dram_shared_find(const dram_t *d, uint64_t seed)
{
    for (uint32_t i = 0; i < d->nshared; i++)
        if (d->shared[i]->seed == seed)
            return d->shared[i];
    return NULL;
}

/* The shared arena loc lies in, or NULL for the main region. */
static dram_shared_t *dram_shared_at(const dram_t *d, uint64_t loc)
{
    if (space_holds(&d->sp, loc))
        return NULL;
    for (uint32_t i = 0; i < d->nshared; i++)
        if (space_holds(&d->shared[i]->sp, loc))
            return d->shared[i];
    return NULL;
}

/* Gives every freed page of sp's arena back (jemalloc's dirty pages: our hooks punch them). */
static void space_purge(dram_space_t *sp)
{
    char name[64];
    snprintf(name, sizeof(name), "arena.%u.purge", sp->arena);
    (void)mallctl(name, NULL, NULL, NULL, 0);
}

/* A block of charge bytes at p placed in the main region (dram_t.main_live, main_hw). */
static void dram_main_add(dram_t *d, const void *p, uint64_t charge)
{
    uint64_t end = (uint64_t)((const uint8_t *)p - d->sp.base) + charge;
    d->main_live += charge;
    if (end > d->main_hw)
        d->main_hw = end;
}

static int dram_write(kvt_tier_t *t, kvt_tier_io_t *io)
{
    dram_t *d = t->impl;
    /* An arena nobody references any more only drains: new blocks of its namespace go to the
     * main region, so that its last block can go and the arena with it. */
    dram_shared_t *s = d->nshared ? dram_shared_find(d, io->key.ns_seed) : NULL;
    if (s && s->refs == 0)
        s = NULL;
    dram_space_t *sp = s ? &s->sp : &d->sp;
    void *p = mallocx(io->len, dram_flags(sp->arena, io->len));
    if (!p && s) {
        /* Its freed pages stay dirty until dram_trim, and dirty extents under 16 KiB coalesce
         * only once purged: purging them now may make the room this block needs. */
        space_purge(sp);
        p = mallocx(io->len, dram_flags(sp->arena, io->len));
    }
    if (!p) {
        if (!sp->warned_full) {
            if (s)
                kvt_log(KVT_LOG_WARN,
                        "dram tier: the %zu-byte shared arena of namespace %016llx is exhausted "
                        "by fragmentation below capacity",
                        sp->bytes, (unsigned long long)s->seed);
            else
                kvt_log(KVT_LOG_WARN,
                        "dram tier: its %zu-byte region is exhausted by fragmentation below "
                        "capacity",
                        sp->bytes);
            sp->warned_full = 1;
        }
        return KVT_ENOSPC;
    }
    kvt_assert(sallocx(p, dram_flags(sp->arena, io->len)) == io->charge);
    /* No buf: a zero-copy PUT's reservation, filled by the client through its mapping. */
    if (io->buf)
        memcpy(p, io->buf, io->len);
    if (s) {
        s->blocks++;
        s->used_seq = ++d->seq;
    } else {
        dram_main_add(d, p, io->charge);
    }
    io->loc = (uint64_t)(uintptr_t)p;
    kvt__tier_complete(t, io, 0);
    return 0;
}

/* Entry states (kvt__tier_ent_t.sealed): no checksum, sum is the payload's, sum is the ticket
 * of a seal under way. */
enum { DRAM_UNSEALED = 0, DRAM_SEALED = 1, DRAM_SEALING = 2 };

/* A seal under way finished now, in one pass (the block is about to leave). */
static void dram_seal_now(dram_t *d, kvt__tier_ent_t *e)
{
    d->sealed++;
    e->sum = XXH3_64bits((const void *)(uintptr_t)e->loc, e->len);
    e->sealed = DRAM_SEALED;
}

/* 1 when e is sealed and its payload no longer has the sealed checksum (counted). A seal still
 * under way is finished first: the bytes leave as they are now, and are what it seals. */
static int dram_scribbled(dram_t *d, kvt__tier_ent_t *e)
{
    if (e->sealed == DRAM_SEALING) {
        dram_seal_now(d, e);
        return 0;
    }
    if (!e->sealed || XXH3_64bits((const void *)(uintptr_t)e->loc, e->len) == e->sum)
        return 0;
    d->scribbles++;
    static kvt_log_limit_t lim;
    kvt_log_limited(&lim, KVT_LOG_WARN,
                    "dram tier: a %u-byte block of namespace %016llx changed after it was sealed "
                    "(written over through a client's mapping)",
                    e->len, (unsigned long long)e->ns_seed);
    return 1;
}

static int dram_read(kvt_tier_t *t, kvt_tier_io_t *io)
{
    kvt__tier_ent_t *e = kvt__tier_entry(t, io->loc);
    if (e && dram_scribbled(t->impl, e)) {
        kvt__tier_complete(t, io, KVT_ECORRUPT);
        return 0;
    }
    memcpy(io->buf, (const void *)(uintptr_t)io->loc, io->len);
    kvt__tier_complete(t, io, 0);
    return 0;
}

/* Destroys the arena first (it may still call the hooks, which use the mapping), then the
 * mapping and the memfd. Blocks left in the arena are gone with it. */
static void space_arena_destroy(dram_space_t *sp)
{
    if (sp->arena_made) {
        char name[64];
        snprintf(name, sizeof(name), "arena.%u.destroy", sp->arena);
        if (mallctl(name, NULL, NULL, NULL, 0) != 0)
            kvt_log(KVT_LOG_WARN, "dram tier: jemalloc refused to destroy arena %u", sp->arena);
        sp->arena_made = 0;
    }
}

static void space_release(dram_space_t *sp)
{
    space_arena_destroy(sp);
    if (sp->base)
        munmap(sp->base, sp->bytes);
    sp->base = NULL;
    if (sp->fd >= 0)
        close(sp->fd);
    sp->fd = -1;
    pthread_mutex_destroy(&sp->mu);
}

static void dram_shared_destroy(dram_shared_t *s)
{
    if (s->sp.arena_made)
        kvt_log(KVT_LOG_INFO, "dram tier: shared arena of namespace %016llx destroyed",
                (unsigned long long)s->seed);
    /* A client may keep its mapping after its connection went (the mapping is its to unmap),
     * which keeps the memfd alive after our close: whatever pages are left would stay out of
     * every count but that client's. */
    if (s->sp.fd >= 0 && s->sp.bytes)
        (void)fallocate(s->sp.fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0,
                        (off_t)s->sp.bytes);
    space_release(&s->sp);
    free(s);
}

/* Takes s out of the table and destroys it (no reference, no block left). */
static void dram_shared_drop(dram_t *d, dram_shared_t *s)
{
    for (uint32_t i = 0; i < d->nshared; i++) {
        if (d->shared[i] == s) {
            d->shared[i] = d->shared[--d->nshared];
            break;
        }
    }
    dram_shared_destroy(s);
}

/* Takes s out of the table and destroys it when nothing keeps it: no reference, no block. */
static void dram_shared_maybe_drop(dram_t *d, dram_shared_t *s)
{
    if (s->blocks == 0 && s->refs == 0)
        dram_shared_drop(d, s);
}

static void dram_free(kvt_tier_t *t, uint64_t loc, uint32_t len)
{
    dram_t *d = t->impl;
    dram_shared_t *s = d->nshared ? dram_shared_at(d, loc) : NULL;
    dallocx((void *)(uintptr_t)loc, dram_flags(s ? s->sp.arena : d->sp.arena, len));
    if (s) {
        kvt_assert(s->blocks > 0);
        s->blocks--;
        s->used_seq = ++d->seq;
        dram_shared_maybe_drop(d, s);
    } else {
        uint64_t charge = dram_footprint(t, len);
        kvt_assert(d->main_live >= charge);
        d->main_live -= charge;
    }
}

static void *dram_ptr(kvt_tier_t *t, uint64_t loc)
{
    (void)t;
    return (void *)(uintptr_t)loc;
}

static void dram_release(dram_t *d)
{
    free(d->seals);
    XXH3_freeState(d->seal_st);
    for (uint32_t i = 0; i < d->nshared; i++)
        dram_shared_destroy(d->shared[i]);
    free(d->shared);
    space_arena_destroy(&d->sp); /* before unregistering the memory it still describes */
#if KVT_HAVE_CUDA
    if (d->pinned)
        cudaHostUnregister(d->sp.base);
#endif
    space_release(&d->sp);
    free(d);
}

static void dram_free_block(void *arg, const kvt__tier_ent_t *e)
{
    dram_t *d = arg;
    dram_shared_t *s = d->nshared ? dram_shared_at(d, e->loc) : NULL;
    dallocx((void *)(uintptr_t)e->loc, dram_flags(s ? s->sp.arena : d->sp.arena, e->len));
    if (s)
        s->blocks--;
}

/* Blocks still stored when the tier goes are freed before the arenas are destroyed. */
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
    return t && t->ops == &dram_ops ? ((const dram_t *)t->impl)->sp.arena : 0;
}

uint64_t kvt_tier_dram_mapped(const kvt_tier_t *t)
{
    if (!t || t->ops != &dram_ops)
        return 0;
    dram_space_t *sp = &((dram_t *)t->impl)->sp;
    pthread_mutex_lock(&sp->mu); /* the extent hooks move it from any thread jemalloc runs in */
    size_t bump = sp->bump;
    pthread_mutex_unlock(&sp->mu);
    return bump;
}

int kvt_tier_dram_pinned(const kvt_tier_t *t)
{
    return t && t->ops == &dram_ops ? ((const dram_t *)t->impl)->pinned : 0;
}

/* Slack for size classes (up to a quarter above the request), alignment and the arena's own
 * metadata. A shared arena's region is as large as the main one: a namespace may hold the
 * whole capacity, and the memfd is sparse, so the size costs address space only. */
static size_t dram_region_bytes(uint64_t capacity)
{
    uint64_t bytes = capacity + capacity / 4 + (64u << 20);
    return (size_t)((bytes + (2u << 20) - 1) & ~(uint64_t)((2u << 20) - 1));
}

static void space_init(dram_space_t *sp, int shared)
{
    pthread_mutex_init(&sp->mu, NULL);
    sp->fd = -1;
    sp->hooks = (extent_hooks_t){
        .alloc = shared ? dram_ext_alloc_shared : dram_ext_alloc,
        .dalloc = shared ? dram_ext_dalloc_shared : dram_ext_dalloc,
        .destroy = dram_ext_destroy,
        .commit = dram_ext_commit,
        .decommit = dram_ext_decommit,
        .purge_lazy = shared ? dram_ext_punch : dram_ext_purge,
        .purge_forced = shared ? dram_ext_punch : dram_ext_purge,
        .split = dram_ext_split,
        .merge = dram_ext_merge,
    };
}

/* Creates sp's jemalloc arena over its hooks. Returns 0 or KVT_EIO. */
static int space_arena(dram_space_t *sp)
{
    extent_hooks_t *hp = &sp->hooks;
    size_t sz = sizeof(sp->arena);
    if (mallctl("arenas.create", &sp->arena, &sz, &hp, sizeof(hp)) != 0) {
        kvt_log(KVT_LOG_ERROR, "dram tier: jemalloc arenas.create failed");
        return KVT_EIO;
    }
    sp->arena_made = 1;
    /* Freed extents leave the dirty set at once: with purging refused (the main region) they
     * land in the retained set, which jemalloc coalesces eagerly (dirty extents coalesce only
     * when they decay), so a mix of block sizes does not fragment the region.
     * A shared arena keeps its freed pages dirty instead (no decay: -1), for its next blocks to
     * reuse: a hole punched at every free made every new block fresh pages, faulted and zeroed
     * by the kernel in the daemon and again in each client that touches it (bench_client: a
     * zero-copy PUT of 2 MiB ran at a third of a socket PUT into the main region), and a decay
     * of a second did the same to an engine whose stores came a second after its removals
     * (bench_lmcache --pause-ms 1200: 16,384 faults a 64 MiB save). They go back only when
     * the tier's footprint passes its capacity (dram_trim, every tick of the daemon) or the
     * arena's namespace stops using it. */
    ssize_t now = 0, shared_decay = -1;
    char name[64];
    snprintf(name, sizeof(name), "arena.%u.dirty_decay_ms", sp->arena);
    (void)mallctl(name, NULL, NULL, sp->fd >= 0 ? &shared_decay : &now, sizeof(now));
    snprintf(name, sizeof(name), "arena.%u.muzzy_decay_ms", sp->arena);
    (void)mallctl(name, NULL, NULL, &now, sizeof(now));
    /* jemalloc grows its retained memory geometrically; from a fixed region that would strand
     * up to half of it in one last oversized request. Small steps keep the slack bounded. */
    size_t grow = 8u << 20;
    snprintf(name, sizeof(name), "arena.%u.retain_grow_limit", sp->arena);
    if (mallctl(name, NULL, NULL, &grow, sizeof(grow)) != 0)
        kvt_log(KVT_LOG_WARN, "dram tier: jemalloc refused retain_grow_limit");
    return 0;
}

static int dram_err(int e)
{
    return e == ENOMEM ? KVT_ENOMEM : KVT_EIO;
}

/*
 * A shared arena: a memfd as large as the main region, sparse until touched, mapped MAP_SHARED
 * (a client maps the same pages) without a swap reservation. Sealed against shrinking and
 * growing: a client holds the fd too, and a shrink would turn the tier's own accesses past the
 * new end into SIGBUS; holes (our purges, or a client's) stay possible and read as zeros. The
 * seals are sealed too, so that no client adds a write seal that would make our purges fail. Not
 * registered with CUDA, unlike the main region: that would touch and lock every page.
 */
static int dram_shared_make(dram_t *d, uint64_t seed, dram_shared_t **out)
{
    dram_shared_t *s = calloc(1, sizeof(*s));
    if (!s)
        return KVT_ENOMEM;
    s->seed = seed;
    space_init(&s->sp, 1);
    s->sp.bytes = d->sp.bytes;
    char name[32];
    snprintf(name, sizeof(name), "kvtier-ns-%016llx", (unsigned long long)seed);
    int rc = 0;
    const char *what = "memfd_create";
    s->sp.fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (s->sp.fd < 0)
        goto fail;
    what = "ftruncate";
    if (ftruncate(s->sp.fd, (off_t)s->sp.bytes) != 0)
        goto fail;
    what = "sealing";
    if (fcntl(s->sp.fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0)
        goto fail;
    what = "mmap";
    void *m =
        mmap(NULL, s->sp.bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, s->sp.fd, 0);
    if (m == MAP_FAILED)
        goto fail;
    s->sp.base = m;
    if ((rc = space_arena(&s->sp)) < 0) {
        dram_shared_destroy(s);
        return rc;
    }
    kvt_log(KVT_LOG_INFO,
            "dram tier: shared arena of namespace %016llx: jemalloc arena %u, memfd of %zu bytes",
            (unsigned long long)seed, s->sp.arena, s->sp.bytes);
    *out = s;
    return 0;
fail:
    rc = dram_err(errno);
    kvt_log(KVT_LOG_ERROR, "dram tier: shared arena of namespace %016llx: %s failed: %s",
            (unsigned long long)seed, what, strerror(errno));
    dram_shared_destroy(s);
    return rc;
}

int kvt_tier_dram_share(kvt_tier_t *t, uint64_t ns_seed, int *fd, uint64_t *map_bytes)
{
    if (!t || t->ops != &dram_ops || !fd || !map_bytes)
        return KVT_EINVAL;
    dram_t *d = t->impl;
    dram_shared_t *s = dram_shared_find(d, ns_seed);
    if (!s) {
        if (d->nshared >= d->max_shared)
            return KVT_ENOSPC;
        int rc = dram_shared_make(d, ns_seed, &s);
        if (rc < 0)
            return rc;
        d->shared[d->nshared++] = s;
    }
    s->refs++;
    *fd = s->sp.fd;
    *map_bytes = s->sp.bytes;
    return 0;
}

void kvt_tier_dram_unshare(kvt_tier_t *t, uint64_t ns_seed)
{
    if (!t || t->ops != &dram_ops)
        return;
    dram_t *d = t->impl;
    dram_shared_t *s = dram_shared_find(d, ns_seed);
    if (!s || s->refs == 0)
        return;
    s->refs--;
    dram_shared_maybe_drop(d, s);
}

int kvt_tier_dram_offset(const kvt_tier_t *t, uint64_t ns_seed, uint64_t loc, uint64_t *off)
{
    if (!t || t->ops != &dram_ops)
        return KVT_ENOENT;
    const dram_shared_t *s = dram_shared_find(t->impl, ns_seed);
    if (!s || !space_holds(&s->sp, loc))
        return KVT_ENOENT;
    if (off)
        *off = loc - (uint64_t)(uintptr_t)s->sp.base;
    return 0;
}

uint32_t kvt_tier_dram_shared(const kvt_tier_t *t)
{
    return t && t->ops == &dram_ops ? ((const dram_t *)t->impl)->nshared : 0;
}

/*
 * What a client can touch. A client maps all of its arena's memfd read-write, so it can make any
 * page of it resident (write it, or fallocate the fd), not only its blocks' pages: up to the
 * memfd's whole size, 1.25 x capacity + 64 MiB, outside the tier's capacity and outside the
 * daemon's RSS (shmem belongs to the file, and the file outlives the client while the daemon
 * holds it). So once a second each arena's resident bytes (the memfd's st_blocks) are compared
 * with what jemalloc can account for (its active and dirty pages, less the orphans, which hold
 * no bytes worth keeping); an arena over that is scanned: every gap between its live blocks'
 * page-rounded extents is punched. Pages shared by a live block and something else are kept
 * whole (punching part of a page zeroes that part). Dirty pages are punched too by such a scan:
 * their contents are garbage to jemalloc, and a hole reads as zeros. The check costs one fstat
 * per arena and one jemalloc stats refresh a second; a scan costs a walk of the tier's location
 * index, a sort of the arena's blocks and one punch per gap (measured in docs/tiers.md).
 */
typedef struct dram_run {
    uint64_t off, end; /* page-rounded, within the memfd */
} dram_run_t;

typedef struct dram_scan {
    const dram_shared_t *s;
    dram_run_t *runs;
    size_t n, cap;
    int failed;
    uint64_t page;
} dram_scan_t;

static void dram_scan_collect(void *arg, const kvt__tier_ent_t *e)
{
    dram_scan_t *sc = arg;
    if (sc->failed || !space_holds(&sc->s->sp, e->loc))
        return;
    if (sc->n == sc->cap) {
        size_t cap = sc->cap ? sc->cap * 2 : 256;
        dram_run_t *r = realloc(sc->runs, cap * sizeof(*r));
        if (!r) {
            sc->failed = 1;
            return;
        }
        sc->runs = r;
        sc->cap = cap;
    }
    uint64_t off = e->loc - (uint64_t)(uintptr_t)sc->s->sp.base;
    sc->runs[sc->n++] = (dram_run_t){.off = off & ~(sc->page - 1),
                                     .end = (off + e->len + sc->page - 1) & ~(sc->page - 1)};
}

static int dram_run_cmp(const void *a, const void *b)
{
    uint64_t x = ((const dram_run_t *)a)->off, y = ((const dram_run_t *)b)->off;
    return x < y ? -1 : x > y;
}

static int dram_punch(const dram_shared_t *s, uint64_t off, uint64_t len)
{
    return fallocate(s->sp.fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)off, (off_t)len);
}

/* The bytes s's memfd holds in memory. */
static uint64_t dram_shared_resident(const dram_shared_t *s)
{
    struct stat st;
    return fstat(s->sp.fd, &st) == 0 ? (uint64_t)st.st_blocks * 512 : 0;
}

/* Punches every page of s's memfd that no live block holds; returns the bytes that went (the
 * resident bytes before and after: a punch of a hole costs little, but says nothing). The gaps
 * between blocks are punched whole rather than found with SEEK_DATA: shmem reports a page that
 * fallocate made resident but nobody wrote as a hole. */
static uint64_t dram_shared_scan(dram_t *d, dram_shared_t *s, uint64_t page)
{
    dram_scan_t sc = {.s = s, .page = page};
    kvt__tier_foreach(d->tier, dram_scan_collect, &sc);
    if (sc.failed) {
        free(sc.runs);
        return 0; /* out of memory: the next scan tries again */
    }
    if (sc.n)
        qsort(sc.runs, sc.n, sizeof(*sc.runs), dram_run_cmp);
    uint64_t before = dram_shared_resident(s), cur = 0;
    for (size_t i = 0; i <= sc.n; i++) {
        uint64_t stop = i < sc.n ? sc.runs[i].off : s->sp.bytes;
        if (stop > cur)
            (void)dram_punch(s, cur, stop - cur);
        if (i < sc.n && sc.runs[i].end > cur)
            cur = sc.runs[i].end;
    }
    free(sc.runs);
    uint64_t after = dram_shared_resident(s);
    return before > after ? before - after : 0;
}

/* The bytes jemalloc accounts for in s: its active and dirty pages, less the orphans'. */
static uint64_t dram_shared_expected(const dram_shared_t *s, uint64_t page)
{
    size_t active = 0, dirty = 0, sz = sizeof(size_t);
    char name[64];
    snprintf(name, sizeof(name), "stats.arenas.%u.pactive", s->sp.arena);
    if (mallctl(name, &active, &sz, NULL, 0) != 0)
        return 0; /* no stats: scan every time */
    snprintf(name, sizeof(name), "stats.arenas.%u.pdirty", s->sp.arena);
    sz = sizeof(size_t);
    if (mallctl(name, &dirty, &sz, NULL, 0) != 0)
        return 0;
    uint64_t bytes = ((uint64_t)active + dirty) * page;
    return bytes > s->orphan_bytes ? bytes - s->orphan_bytes : 0;
}

static void dram_scan_all(dram_t *d)
{
    uint64_t t0 = kvt_now_ns(), page = (uint64_t)sysconf(_SC_PAGESIZE);
    uint64_t epoch = 1;
    size_t esz = sizeof(epoch);
    (void)mallctl("epoch", &epoch, &esz, &epoch, esz); /* refresh the arenas' stats */
    for (uint32_t i = 0; i < d->nshared; i++) {
        dram_shared_t *s = d->shared[i];
        if (dram_shared_resident(s) <= dram_shared_expected(s, page))
            continue;
        uint64_t got = dram_shared_scan(d, s, page);
        d->scans++;
        d->punched += got;
        if (got) {
            static kvt_log_limit_t lim;
            kvt_log_limited(&lim, KVT_LOG_INFO,
                            "dram tier: %llu bytes of namespace %016llx's memfd held no live "
                            "block (written by a client outside its blocks): punched",
                            (unsigned long long)got, (unsigned long long)s->seed);
        }
    }
    d->scan_ns += kvt_now_ns() - t0;
}

/* Bytes of freed pages s's arena keeps (jemalloc's dirty pages), from the stats of the last
 * epoch; UINT64_MAX when jemalloc has no stats (then every arena is purged, as if over). */
static uint64_t dram_shared_dirty(const dram_shared_t *s, uint64_t page)
{
    size_t dirty = 0, sz = sizeof(size_t);
    char name[64];
    snprintf(name, sizeof(name), "stats.arenas.%u.pdirty", s->sp.arena);
    if (mallctl(name, &dirty, &sz, NULL, 0) != 0)
        return UINT64_MAX;
    return (uint64_t)dirty * page;
}

/* Purges s (counted in d->trims, trimmed_bytes: what its memfd held before and holds after). */
static void dram_trim_one(dram_t *d, dram_shared_t *s)
{
    uint64_t before = dram_shared_resident(s);
    space_purge(&s->sp);
    uint64_t after = dram_shared_resident(s);
    s->purged_seq = s->used_seq;
    s->dirty = 0;
    d->trims++;
    d->trimmed_bytes += before > after ? before - after : 0;
}

/* The main region's freed-but-kept bytes: the pages its blocks ever touched (below main_hw; the
 * region is handed out front to back and jemalloc reuses the lowest free extents first, so few
 * pages below it were never touched) less its live blocks. Resident for good: see dram_trim. */
static uint64_t dram_main_kept(const dram_t *d)
{
    return d->main_hw > d->main_live ? d->main_hw - d->main_live : 0;
}

/*
 * The tier's footprint is its live blocks (usage.used_bytes, every arena's and the main
 * region's, never above the capacity) plus the freed pages kept for reuse: the main region's
 * (dram_main_kept) and the shared arenas' (their dirty pages). While that is within the
 * capacity the shared arenas keep theirs, however long, so that a namespace whose stores come
 * long after its removals reuses them without a page fault; past it, whole arenas give theirs
 * back, the least recently written or freed first, until it is within again or none has any
 * left. The main region's kept pages count but are never given back: its purges are refused
 * (reuse without a fault, and eager coalescing in jemalloc's retained set, dram_ext_purge), and
 * a pinned region's pages stay registered with CUDA, which a MADV_DONTNEED would break. So
 * after the main region peaked the shared arenas keep that much less; the footprint exceeds the
 * capacity only by what the main region alone keeps beyond it (bounded by its size, 1.25 x
 * capacity + 64 MiB). Whole arenas: jemalloc purges an arena's dirty pages all at once or by
 * its decay clock, not by a byte count. Oldest first rather than a share of each: an arena
 * nobody wrote or freed in for longest is the least likely to reuse its pages soon, and the busy
 * namespaces keep theirs. An arena nobody references any more takes no new blocks (dram_write),
 * so its freed pages can never be reused: they go at once, over capacity or not. Called every
 * tick, so the footprint passes the capacity for a tick at most (blocks written into fresh
 * pages meanwhile).
 *
 * Cost: an fstat per arena; jemalloc's stats (an epoch refresh, 37 us with a dozen arenas here)
 * only when the live blocks, the main region's kept pages and the memfds' resident bytes
 * together pass the capacity, an upper bound of the footprint (an arena's resident bytes hold
 * its dirty pages and its live blocks).
 */
static void dram_trim(dram_t *d)
{
    const kvt_tier_usage_t *u = &d->tier->usage;
    uint64_t upper = u->used_bytes + dram_main_kept(d), cap = u->capacity_bytes;
    for (uint32_t i = 0; i < d->nshared; i++) {
        dram_shared_t *s = d->shared[i];
        if (s->refs == 0 && s->used_seq != s->purged_seq)
            dram_trim_one(d, s); /* something was freed in it since its last purge */
        upper += dram_shared_resident(s);
    }
    if (upper <= cap || d->nshared == 0)
        return;
    uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE), epoch = 1;
    size_t esz = sizeof(epoch);
    (void)mallctl("epoch", &epoch, &esz, &epoch, esz); /* refresh the arenas' stats */
    uint64_t foot = u->used_bytes + dram_main_kept(d);
    for (uint32_t i = 0; i < d->nshared; i++) {
        dram_shared_t *s = d->shared[i];
        s->dirty = dram_shared_dirty(s, page);
        foot = s->dirty > UINT64_MAX - foot ? UINT64_MAX : foot + s->dirty;
    }
    /* Without stats foot stays UINT64_MAX and every arena is purged. */
    while (foot > cap) {
        dram_shared_t *best = NULL;
        for (uint32_t i = 0; i < d->nshared; i++) {
            dram_shared_t *s = d->shared[i];
            if (s->dirty && (!best || s->used_seq < best->used_seq))
                best = s;
        }
        if (!best)
            break; /* nothing left to give back: the rest is live blocks and the main region's */
        if (foot != UINT64_MAX)
            foot -= best->dirty;
        dram_trim_one(d, best);
    }
}

void kvt_tier_dram_decay(kvt_tier_t *t)
{
    if (!t || t->ops != &dram_ops)
        return;
    dram_t *d = t->impl;
    dram_trim(d);
    uint64_t now = kvt_now_ns();
    if (d->nshared && now >= d->scan_at) {
        d->scan_at = now + KVT_DRAM_SCAN_NS;
        dram_scan_all(d);
    }
}

int kvt_tier_dram_scan(kvt_tier_t *t)
{
    if (!t || t->ops != &dram_ops)
        return KVT_EINVAL;
    dram_t *d = t->impl;
    d->scan_at = kvt_now_ns() + KVT_DRAM_SCAN_NS;
    dram_scan_all(d);
    return 0;
}

int kvt_tier_dram_seal(kvt_tier_t *t, uint64_t loc)
{
    if (!t || t->ops != &dram_ops)
        return KVT_EINVAL;
    kvt__tier_ent_t *e = kvt__tier_entry(t, loc);
    if (!e)
        return KVT_ENOENT;
    dram_seal_now(t->impl, e);
    return 0;
}

int kvt_tier_dram_seal_as(kvt_tier_t *t, uint64_t loc, uint64_t sum)
{
    if (!t || t->ops != &dram_ops)
        return KVT_EINVAL;
    kvt__tier_ent_t *e = kvt__tier_entry(t, loc);
    if (!e)
        return KVT_ENOENT;
    /* A seal still queued for this block names it by the ticket in sum: overwritten here, so
     * that seal_step skips it. */
    e->sum = sum;
    e->sealed = DRAM_SEALED;
    ((dram_t *)t->impl)->sealed_as++;
    return 0;
}

int kvt_tier_dram_seal_later(kvt_tier_t *t, uint64_t loc)
{
    if (!t || t->ops != &dram_ops)
        return KVT_EINVAL;
    dram_t *d = t->impl;
    kvt__tier_ent_t *e = kvt__tier_entry(t, loc);
    if (!e)
        return KVT_ENOENT;
    if (!d->seal_st && !(d->seal_st = XXH3_createState()))
        return KVT_ENOMEM;
    if (d->seal_head == d->nseals)
        d->seal_head = d->nseals = 0;
    if (kvt_reserve(&d->seals, &d->seal_cap, d->nseals + 1, sizeof(*d->seals), 64) < 0)
        return KVT_ENOMEM;
    e->sealed = DRAM_SEALING;
    e->sum = ++d->seal_ticket;
    d->seals[d->nseals++] = (struct dram_seal){.loc = loc, .ticket = e->sum};
    return 0;
}

size_t kvt_tier_dram_seal_step(kvt_tier_t *t, size_t budget)
{
    if (!t || t->ops != &dram_ops)
        return 0;
    dram_t *d = t->impl;
    while (d->seal_head < d->nseals && budget > 0) {
        struct dram_seal *q = &d->seals[d->seal_head];
        kvt__tier_ent_t *e = kvt__tier_entry(t, q->loc);
        if (!e || e->sealed != DRAM_SEALING || e->sum != q->ticket) {
            d->seal_head++; /* freed, moved, or finished by a departure meanwhile */
            d->seal_done = 0;
            continue;
        }
        if (d->seal_done == 0)
            (void)XXH3_64bits_reset(d->seal_st);
        uint32_t n = (uint32_t)KVT_MIN((size_t)(e->len - d->seal_done), budget);
        (void)XXH3_64bits_update(d->seal_st, (const uint8_t *)(uintptr_t)e->loc + d->seal_done, n);
        d->seal_done += n;
        budget -= n;
        if (d->seal_done == e->len) {
            e->sum = XXH3_64bits_digest(d->seal_st);
            e->sealed = DRAM_SEALED;
            d->sealed++;
            d->seal_head++;
            d->seal_done = 0;
        }
    }
    if (d->seal_head == d->nseals)
        d->seal_head = d->nseals = 0;
    return d->nseals - d->seal_head;
}

int kvt_tier_dram_check(kvt_tier_t *t, uint64_t loc)
{
    if (!t || t->ops != &dram_ops)
        return KVT_EINVAL;
    kvt__tier_ent_t *e = kvt__tier_entry(t, loc);
    if (!e)
        return KVT_ENOENT;
    if (!dram_scribbled(t->impl, e))
        return 0;
    t->usage.corrupt++;
    return KVT_ECORRUPT;
}

int kvt_tier_dram_intact(const kvt_tier_t *t, uint64_t loc)
{
    if (!t || t->ops != &dram_ops)
        return 0;
    const kvt__tier_ent_t *e = kvt__tier_entry((kvt_tier_t *)t, loc);
    if (!e || e->sealed == DRAM_SEALING)
        return 0; /* dram_scribbled would seal it now */
    return !e->sealed || XXH3_64bits((const void *)(uintptr_t)e->loc, e->len) == e->sum;
}

int kvt_tier_dram_shared_stats(const kvt_tier_t *t, kvt_tier_dram_shared_stats_t *st)
{
    if (!t || t->ops != &dram_ops || !st)
        return KVT_EINVAL;
    const dram_t *d = t->impl;
    *st = (kvt_tier_dram_shared_stats_t){.arenas = d->nshared,
                                         .scribbles = d->scribbles,
                                         .sealed = d->sealed,
                                         .sealed_as = d->sealed_as,
                                         .punched_bytes = d->punched,
                                         .scans = d->scans,
                                         .scan_ns = d->scan_ns};
    st->trims = d->trims;
    st->trimmed_bytes = d->trimmed_bytes;
    st->kept_bytes = dram_main_kept(d);
    uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE), epoch = 1;
    size_t esz = sizeof(epoch);
    if (d->nshared)
        (void)mallctl("epoch", &epoch, &esz, &epoch, esz); /* the arenas' dirty pages, now */
    for (uint32_t i = 0; i < d->nshared; i++) {
        uint64_t dirty = dram_shared_dirty(d->shared[i], page);
        st->resident_bytes += dram_shared_resident(d->shared[i]);
        st->kept_bytes += dirty == UINT64_MAX ? 0 : dirty;
    }
    return 0;
}

/*
 * Orphans: an expired reservation's room (server/op_put.c). Its block leaves the location index
 * and the capacity (other namespaces' writes may have the bytes) but stays allocated in the
 * arena, so that jemalloc places nothing there that the slow client's late bytes could land
 * in; its pages are punched now and by every scan after (a client writing there again makes
 * the arena's memfd exceed what jemalloc holds). Blocks under a page share their pages with
 * others: those are punched by the scan once no live block holds them.
 */
int kvt_tier_dram_orphan(kvt_tier_t *t, uint64_t loc, uint32_t len)
{
    if (!t || t->ops != &dram_ops)
        return KVT_EINVAL;
    dram_t *d = t->impl;
    dram_shared_t *s = dram_shared_at(d, loc);
    const kvt__tier_ent_t *e = kvt__tier_lookup(t, loc);
    if (!s || !e || e->len != len)
        return KVT_ENOENT;
    uint64_t charge = e->charge, off = loc - (uint64_t)(uintptr_t)s->sp.base;
    kvt__tier_forget(t, loc);
    s->orphan_bytes += charge;
    uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE);
    if ((off & (page - 1)) == 0 && (charge & (page - 1)) == 0)
        (void)dram_punch(s, off, charge);
    return 0;
}

void kvt_tier_dram_orphan_free(kvt_tier_t *t, uint64_t loc, uint32_t len)
{
    if (!t || t->ops != &dram_ops)
        return;
    dram_t *d = t->impl;
    dram_shared_t *s = dram_shared_at(d, loc);
    if (!s || kvt__tier_lookup(t, loc))
        return; /* not an orphan */
    uint64_t charge = dram_footprint(t, len);
    kvt_assert(s->blocks > 0 && s->orphan_bytes >= charge);
    dallocx((void *)(uintptr_t)loc, dram_flags(s->sp.arena, len));
    s->orphan_bytes -= charge;
    s->blocks--;
    s->used_seq = ++d->seq;
    dram_shared_maybe_drop(d, s);
}

int kvt_tier_dram_idle(const kvt_tier_t *t, uint64_t *ns_seed)
{
    if (!t || t->ops != &dram_ops || !ns_seed)
        return KVT_EINVAL;
    const dram_t *d = t->impl;
    const dram_shared_t *best = NULL;
    for (uint32_t i = 0; i < d->nshared; i++) {
        const dram_shared_t *s = d->shared[i];
        if (s->refs == 0 && (!best || s->blocks < best->blocks))
            best = s;
    }
    if (!best)
        return KVT_ENOENT;
    *ns_seed = best->seed;
    return 0;
}

/*
 * Moves a block out of an arena nobody maps into the main region, so that the arena can go and
 * its slot serve another namespace: same charge (size classes are the same in every arena), so
 * the capacity does not change; the location index follows the block. The caller makes sure no
 * read of the old copy is in flight, and updates its own record of the location.
 */
int kvt_tier_dram_move_out(kvt_tier_t *t, uint64_t *loc)
{
    if (!t || t->ops != &dram_ops || !loc)
        return KVT_EINVAL;
    dram_t *d = t->impl;
    dram_shared_t *s = dram_shared_at(d, *loc);
    const kvt__tier_ent_t *e = kvt__tier_lookup(t, *loc);
    if (!s || !e)
        return KVT_ENOENT;
    if (s->refs)
        return KVT_EBUSY;          /* mapped: a client may read it where it lies */
    if (e->sealed == DRAM_SEALING) /* its queued seal names the old address */
        dram_seal_now(d, kvt__tier_entry(t, *loc));
    uint32_t len = e->len;
    void *p = mallocx(len, dram_flags(d->sp.arena, len));
    if (!p)
        return KVT_ENOSPC;
    memcpy(p, (const void *)(uintptr_t)*loc, len);
    dram_main_add(d, p, e->charge);
    kvt__tier_relocate(t, *loc, (uint64_t)(uintptr_t)p);
    dallocx((void *)(uintptr_t)*loc, dram_flags(s->sp.arena, len));
    *loc = (uint64_t)(uintptr_t)p;
    kvt_assert(s->blocks > 0);
    s->blocks--;
    s->used_seq = ++d->seq;
    dram_shared_maybe_drop(d, s);
    return 0;
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
    space_init(&d->sp, 0);
    d->max_shared = conf->max_shared;
    if (d->max_shared && !(d->shared = calloc(d->max_shared, sizeof(*d->shared)))) {
        dram_release(d);
        return KVT_ENOMEM;
    }
    d->sp.bytes = dram_region_bytes(conf->capacity_bytes);
    d->sp.base = dram_map_huge(d->sp.bytes);
    if (!d->sp.base) {
        dram_release(d);
        return KVT_ENOMEM;
    }
#if KVT_HAVE_CUDA
    if (want_pin) {
        /* Pinning touches and locks every page of the region (1.4 s for 4 GiB on an H200
         * host): the log says how long, since it delays the start-up. */
        uint64_t t0 = kvt_now_ns();
        cudaError_t ce = cudaHostRegister(d->sp.base, d->sp.bytes, cudaHostRegisterDefault);
        d->pin_ns = kvt_now_ns() - t0;
        if (ce != cudaSuccess) {
            kvt_log(conf->pin == 1 ? KVT_LOG_ERROR : KVT_LOG_WARN,
                    "dram tier: cudaHostRegister of %zu bytes failed: %s", d->sp.bytes,
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
    int rc = space_arena(&d->sp);
    if (rc == 0)
        rc = kvt__tier_init(out, KVT_TIER_DRAM, &dram_ops, d, conf->capacity_bytes);
    if (rc < 0) {
        dram_release(d);
        return rc;
    }
    d->tier = *out;
    if (d->pinned)
        kvt_log(KVT_LOG_INFO,
                "dram tier: %llu bytes, jemalloc arena %u, pinned for CUDA (%zu bytes registered "
                "in %.3f s)",
                (unsigned long long)conf->capacity_bytes, d->sp.arena, d->sp.bytes,
                (double)d->pin_ns / 1e9);
    else
        kvt_log(KVT_LOG_INFO, "dram tier: %llu bytes, jemalloc arena %u, not pinned",
                (unsigned long long)conf->capacity_bytes, d->sp.arena);
    return 0;
}
