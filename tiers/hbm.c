/*
 * hbm.c: the HBM tier. A pool of memory allocated once at creation and carved into fixed-size
 * slots by a bitmap; a block takes a run of whole slots (first fit from a rotating hint), and
 * its location is its first slot + 1. Two backends share the pool logic and the batching:
 *
 * Batches. A read or write is not copied when it is submitted: it joins its direction's queue
 * (to the device, to the host), and the queue goes out as batches of at most `batch` copies (and
 * about HBM_BATCH_BYTES), each submitted with one call, when it is full or on the tier's next
 * kvt_tier_process (a submit makes the tier's fd readable, so the loop comes back at once).
 * Requests queued together in one turn of the caller's loop thus go out as one batch: a CUDA
 * call and an event per batch instead of per block, which at 256 KiB cost as much as the copy
 * itself. When writes go out, the reads queued before them go first: a slot a queued read still
 * reads may have been freed and handed to one of those writes. The grouping is the same code for
 * both backends, so that machines without a GPU test it too. batch 1 submits each copy at once.
 *
 *   cuda  the pool is cudaMalloc'd device memory. A batch is one cudaMemcpyBatchAsync (CUDA
 *         12.8 and later; where the driver refuses it, and for batches of one, a
 *         cudaMemcpyAsync per copy) on one of the direction's streams (half of them each way,
 *         round robin), then one cudaEventRecord; the batch waits in a FIFO until its event is
 *         done. The tier's fd is a timerfd armed (every 20 us) only while copies are in flight;
 *         the poll op queries the events and completes what is done. No thread of ours runs:
 *         the loop that owns the tier harvests everything. A copy that stages on its way to or
 *         from this backend stages through pinned memory (the copy code's cache, tier.c), so
 *         that its copy is a real asynchronous DMA.
 *   host  the pool is ordinary memory and a batch is a memcpy per copy, completed at once:
 *         four-tier behaviour on machines without a GPU. Chosen only by explicit configuration,
 *         and it says so in its log line and in kvt_tier_backend().
 *
 * IPC export. Because the cuda pool is one cudaMalloc allocation, one cudaIpcMemHandle maps all
 * of it in a local client's process (kvt_tier_hbm_ipc), and a block is named to that client by
 * its byte offset in the pool (kvt_tier_hbm_offset, which the host backend answers too, so that
 * the daemon's side is tested without a GPU). The handle is taken once and kept: CUDA gives the
 * same handle for the same allocation every time.
 *
 * Several devices. The tier may hold one pool per device (conf->devices): one bitmap numbers
 * the slots of all of them, pool after pool, so a location (global slot + 1) names its pool too
 * and every pool keeps the one-pool logic (its own hint, queues, streams, events, fence and IPC
 * handle). A write goes to the pool of the device it names (the first pool for a device it has
 * none on), else (full, or -1: none named) to the pool with the most free slots: the owner's
 * accounting sees one capacity, the sum, and a write fails only when no pool can take it. A batch
 * never mixes pools: a stream and an event belong to one device.
 *
 * Only the CUDA runtime API is used (never libcuda); in a build without CUDA the cuda backend
 * reports KVT_EUNAVAIL.
 */
#include "tier_impl.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/timerfd.h>
#include <unistd.h>

#include "config.h"
#if KVT_HAVE_CUDA
#include <cuda_runtime_api.h>

_Static_assert(KVT_HBM_IPC_HANDLE == sizeof(cudaIpcMemHandle_t),
               "KVT_HBM_IPC_HANDLE (tier.h) is the size of a cudaIpcMemHandle_t");
#endif

#define HBM_MAX_STREAMS   16
#define HBM_POLL_NS       20000
#define HBM_BATCH_DEFAULT 16
#define HBM_BATCH_MAX     256
/* A batch closes at this many bytes too: all of a batch's copies complete together, so a batch
 * of large blocks would hold its first ones back for long (16 MiB: about 0.3 ms over PCIe 5). */
#define HBM_BATCH_BYTES (16u << 20)

/* One direction's requests waiting to go out, linked through priv[1]. */
typedef struct hbm_queue {
    kvt_tier_io_t *head, *tail;
    uint32_t n;
    uint64_t bytes;
} hbm_queue_t;

typedef struct hbm_pool hbm_pool_t;

#if KVT_HAVE_CUDA
/* A batch submitted to a stream: its requests (linked through priv[1]) and the event after it. */
typedef struct hbm_batch {
    struct hbm_batch *next;
    kvt_tier_io_t *head;
    cudaEvent_t ev;
    hbm_pool_t *pool;
    int to_device;
} hbm_batch_t;
#endif

/* One device's pool: slots [first, first + nslots) of the tier's bitmap. */
struct hbm_pool {
    int device;
    uint8_t *base; /* device memory (cuda) or host memory (host) */
    uint64_t first, nslots;
    uint64_t hint;       /* where the next search starts (a global slot) */
    uint64_t used_slots; /* slots its blocks hold */
    uint64_t blocks;
    hbm_queue_t q[2]; /* [0]: reads (to the host), [1]: writes (to the device) */
#if KVT_HAVE_CUDA
    cudaStream_t streams[HBM_MAX_STREAMS];
    uint32_t nstreams;
    uint32_t next_stream[2];
    uint32_t read_batches; /* batches of reads submitted and not yet done */
    int fence; /* slots were freed while reads were out: the next writes wait for those reads */
    cudaEvent_t *events; /* free events (an event belongs to its device) */
    size_t nevents, events_cap;
    int ipc_ok; /* ipc holds the pool's handle (taken on the first export) */
    cudaIpcMemHandle_t ipc;
#endif
};

typedef struct hbm {
    int cuda;
    pthread_t owner; /* the creating thread: the one that processes the tier (hbm_enqueue) */
    uint32_t batch_max;
    int kicked;            /* the tier's fd was made readable for the queues */
    kvt_tier_io_t **batch; /* batch_max entries: the batch going out */
    kvt_tier_hbm_stats_t st;
    uint64_t pool_bytes; /* each pool's */
    uint64_t nslots;     /* all pools' */
    uint32_t slot_bytes;
    uint32_t slot_shift;
    uint64_t *bitmap; /* 1 = slot in use */
    uint32_t npools;
    hbm_pool_t pools[KVT_HBM_MAX_DEVICES];
#if KVT_HAVE_CUDA
    int tfd;
    int armed;
    int pinned;                         /* counted by kvt__pinned_open */
    int batch_api;                      /* cudaMemcpyBatchAsync not refused so far */
    hbm_batch_t *pend_head, *pend_tail; /* submitted, in order */
    hbm_batch_t *spare;                 /* free batch records */
    void **dsts;                        /* batch_max entries each: the arguments of a batch */
    const void **srcs;
    size_t *sizes;
#endif
} hbm_t;

/* ---- the slot allocator ---- */

static int bit_get(const uint64_t *bm, uint64_t i)
{
    return (int)((bm[i >> 6] >> (i & 63)) & 1);
}

static void bits_set(uint64_t *bm, uint64_t from, uint64_t n, int on)
{
    for (uint64_t i = from; i < from + n; i++) {
        if (on)
            bm[i >> 6] |= 1ull << (i & 63);
        else
            bm[i >> 6] &= ~(1ull << (i & 63));
    }
}

/* The first slot at or after i whose bit equals `on`, or nslots. Skips whole words. */
static uint64_t bits_next(const uint64_t *bm, uint64_t nslots, uint64_t i, int on)
{
    while (i < nslots) {
        uint64_t w = bm[i >> 6];
        if (!on)
            w = ~w;
        w &= ~0ull << (i & 63);
        if (w) {
            uint64_t r = (i & ~63ull) + (uint64_t)__builtin_ctzll(w);
            return r < nslots ? r : nslots;
        }
        i = (i & ~63ull) + 64;
    }
    return nslots;
}

/* A run of n free slots between lo and hi, or hi. */
static uint64_t hbm_search(const hbm_t *h, uint64_t lo, uint64_t hi, uint64_t n)
{
    uint64_t i = lo;
    while (i < hi) {
        i = bits_next(h->bitmap, hi, i, 0);
        if (i >= hi || hi - i < n)
            return hi;
        uint64_t end = bits_next(h->bitmap, i + n, i, 1);
        if (end >= i + n)
            return i;
        i = end;
    }
    return hi;
}

/* A run of n slots in pool p: first fit from its hint, then from its start. */
static int pool_alloc(hbm_t *h, hbm_pool_t *p, uint64_t n, uint64_t *slot)
{
    uint64_t end = p->first + p->nslots;
    uint64_t s = hbm_search(h, p->hint, end, n);
    if (s >= end) {
        uint64_t lim = KVT_MIN(end, p->hint + n);
        s = hbm_search(h, p->first, lim, n);
        if (s >= lim)
            return KVT_ENOSPC;
    }
    bits_set(h->bitmap, s, n, 1);
    p->hint = s + n < end ? s + n : p->first;
    p->used_slots += n;
    p->blocks++;
    *slot = s;
    return 0;
}

static hbm_pool_t *pool_of_device(hbm_t *h, int device)
{
    for (uint32_t i = 0; i < h->npools; i++)
        if (h->pools[i].device == device)
            return &h->pools[i];
    return NULL;
}

/* The pool holding global slot s (s < nslots). */
static hbm_pool_t *pool_of_slot(const hbm_t *h, uint64_t s)
{
    for (uint32_t i = 1; i < h->npools; i++)
        if (s < h->pools[i].first)
            return (hbm_pool_t *)&h->pools[i - 1];
    return (hbm_pool_t *)&h->pools[h->npools - 1];
}

static hbm_pool_t *pool_of_loc(const hbm_t *h, uint64_t loc)
{
    return pool_of_slot(h, loc - 1);
}

/* n slots in the pool of `device` (the first pool for a device without one: an old client's,
 * which names none), else in the others, most free slots first; device -1 wants none. */
static int hbm_alloc(hbm_t *h, int device, uint64_t n, uint64_t *slot)
{
    hbm_pool_t *want = device < 0 ? NULL : pool_of_device(h, device);
    if (device >= 0 && !want)
        want = &h->pools[0];
    if (want && pool_alloc(h, want, n, slot) == 0)
        return 0;
    uint32_t tried = want ? 1u << (want - h->pools) : 0;
    for (;;) {
        hbm_pool_t *best = NULL;
        for (uint32_t i = 0; i < h->npools; i++) {
            hbm_pool_t *p = &h->pools[i];
            if (!(tried & (1u << i)) && p->nslots - p->used_slots >= n &&
                (!best || p->nslots - p->used_slots > best->nslots - best->used_slots))
                best = p;
        }
        if (!best)
            return KVT_ENOSPC;
        if (pool_alloc(h, best, n, slot) == 0)
            return 0;
        tried |= 1u << (best - h->pools); /* free slots, but no run of n: fragmentation */
    }
}

static uint64_t hbm_slots(const hbm_t *h, uint32_t len)
{
    return ((uint64_t)len + h->slot_bytes - 1) >> h->slot_shift;
}

static void hbm_release(hbm_t *h, uint64_t loc, uint32_t len)
{
    uint64_t s = loc - 1, n = hbm_slots(h, len);
    hbm_pool_t *p = pool_of_loc(h, loc);
    kvt_assert(s >= p->first && s + n <= p->first + p->nslots && bit_get(h->bitmap, s));
    bits_set(h->bitmap, s, n, 0);
    p->used_slots -= n;
    p->blocks--;
}

static uint64_t hbm_footprint(const kvt_tier_t *t, uint32_t len)
{
    const hbm_t *h = t->impl;
    return hbm_slots(h, len) << h->slot_shift;
}

/* loc's byte offset in its pool. */
static uint64_t hbm_off(const hbm_t *h, uint64_t loc)
{
    return (loc - 1 - pool_of_loc(h, loc)->first) << h->slot_shift;
}

static uint8_t *hbm_addr(const hbm_t *h, uint64_t loc)
{
    return pool_of_loc(h, loc)->base + hbm_off(h, loc);
}

static void hbm_free(kvt_tier_t *t, uint64_t loc, uint32_t len)
{
    hbm_t *h = t->impl;
#if KVT_HAVE_CUDA
    /* A read of these slots may still be queued or on its way, and a write may be given them
     * next: queued reads go out before writes (hbm_enqueue), but on the device the two
     * directions run on different streams, so that write must also wait for the reads. Only
     * this pool's: the slots can go only to a write to it. */
    hbm_pool_t *p = pool_of_loc(h, loc);
    if (h->cuda && (p->q[0].head || p->read_batches))
        p->fence = 1;
#endif
    hbm_release(h, loc, len);
}

/* ---- batches (both backends) ---- */

#if KVT_HAVE_CUDA
static void cuda_batch(kvt_tier_t *t, hbm_pool_t *p, kvt_tier_io_t **ios, uint32_t n,
                       int to_device);
#endif

static void host_batch(kvt_tier_t *t, kvt_tier_io_t **ios, uint32_t n, int to_device)
{
    hbm_t *h = t->impl;
    for (uint32_t i = 0; i < n; i++) {
        kvt_tier_io_t *io = ios[i];
        if (to_device)
            memcpy(hbm_addr(h, io->loc), io->buf, io->len);
        else
            memcpy(io->buf, hbm_addr(h, io->loc), io->len);
        kvt__tier_complete(t, io, 0);
    }
}

/* Sends out everything queued for pool p in one direction, as batches of at most batch_max
 * copies and about HBM_BATCH_BYTES, in the order they were submitted. */
static void pool_flush(kvt_tier_t *t, hbm_pool_t *p, int to_device)
{
    hbm_t *h = t->impl;
    hbm_queue_t *q = &p->q[to_device];
    if (!q->head)
        return; /* (and a fence stays for the writes still to come) */
    while (q->head) {
        uint32_t n = 0;
        uint64_t bytes = 0;
        while (q->head && n < h->batch_max && bytes < HBM_BATCH_BYTES) {
            kvt_tier_io_t *io = q->head;
            q->head = (kvt_tier_io_t *)(uintptr_t)io->priv[1];
            h->batch[n++] = io;
            bytes += io->len;
        }
        h->st.batches++;
        h->st.copies += n;
        if (n > h->st.largest)
            h->st.largest = n;
#if KVT_HAVE_CUDA
        if (h->cuda) {
            cuda_batch(t, p, h->batch, n, to_device);
            continue;
        }
#endif
        host_batch(t, h->batch, n, to_device);
    }
    *q = (hbm_queue_t){0};
#if KVT_HAVE_CUDA
    if (to_device)
        p->fence = 0; /* every write that may have been given freed slots went out behind it */
#endif
}

static void hbm_flush(kvt_tier_t *t, int to_device)
{
    hbm_t *h = t->impl;
    for (uint32_t i = 0; i < h->npools; i++)
        pool_flush(t, &h->pools[i], to_device);
}

/* Queues a request; a full queue goes out now, anything else on the next kvt_tier_process. Only
 * the owner (the thread that created the tier and processes it: the daemon's loop 0) sends a
 * full queue from a submission. Any other thread only queues and kicks, as a read marked
 * queue_only (tier.h) always does: every batch, with its CUDA calls (and their cudaSetDevice) and
 * its completions, stays on the owner's thread, and the queue may pass batch_max until the
 * owner's next process cuts it into batches as usual. A queue_only read is for the owner's own
 * thread too (it holds the daemon's shared lock, under which nothing may complete). The kick is an
 * eventfd write, which wakes the owner's loop from any thread; h->kicked and the queues are the
 * caller's to serialise (the daemon: its write lock, or its shared lock with s->submit held for a
 * queue_only read). */
static void hbm_enqueue(kvt_tier_t *t, kvt_tier_io_t *io, int to_device)
{
    hbm_t *h = t->impl;
    hbm_pool_t *p = pool_of_loc(h, io->loc);
    hbm_queue_t *q = &p->q[to_device];
    io->priv[1] = 0;
    if (q->tail)
        q->tail->priv[1] = (uint64_t)(uintptr_t)io;
    else
        q->head = io;
    q->tail = io;
    q->n++;
    q->bytes += io->len;
    if (!io->queue_only && (q->n >= h->batch_max || q->bytes >= HBM_BATCH_BYTES) &&
        pthread_equal(pthread_self(), h->owner)) {
        if (to_device)
            pool_flush(t, p, 0); /* the reads queued before these writes (see the top) */
        pool_flush(t, p, to_device);
    } else if (!h->kicked) {
        h->kicked = 1;
        kvt__tier_kick(t);
    }
}

static int hbm_write(kvt_tier_t *t, kvt_tier_io_t *io)
{
    hbm_t *h = t->impl;
    uint64_t slot;
    int rc = hbm_alloc(h, io->device, hbm_slots(h, io->len), &slot);
    if (rc < 0)
        return rc;
    io->loc = slot + 1;
    hbm_enqueue(t, io, 1);
    return 0;
}

static int hbm_read(kvt_tier_t *t, kvt_tier_io_t *io)
{
    hbm_enqueue(t, io, 0);
    return 0;
}

#if KVT_HAVE_CUDA
static int cuda_harvest(kvt_tier_t *t);
#endif

static int hbm_poll(kvt_tier_t *t)
{
    hbm_t *h = t->impl;
    kvt_assert(pthread_equal(pthread_self(), h->owner)); /* tier.h: the creator processes it */
    h->kicked = 0;
    hbm_flush(t, 0);
    hbm_flush(t, 1);
#if KVT_HAVE_CUDA
    if (h->cuda)
        return cuda_harvest(t);
#endif
    return 0;
}

/* ---- host backend ---- */

static void *host_ptr(kvt_tier_t *t, uint64_t loc)
{
    return hbm_addr(t->impl, loc);
}

static void hbm_dealloc(hbm_t *h)
{
#if KVT_HAVE_CUDA
    if (h->cuda) {
        kvt_assert(!h->pend_head); /* kvt_tier_destroy waited for every request */
        while (h->spare) {
            hbm_batch_t *b = h->spare;
            h->spare = b->next;
            free(b);
        }
        free(h->dsts);
        free(h->srcs);
        free(h->sizes);
        for (uint32_t k = 0; k < h->npools; k++) {
            hbm_pool_t *p = &h->pools[k];
            if ((p->base || p->nstreams || p->nevents) && cudaSetDevice(p->device) == cudaSuccess) {
                for (size_t i = 0; i < p->nevents; i++)
                    cudaEventDestroy(p->events[i]);
                for (uint32_t i = 0; i < p->nstreams; i++)
                    cudaStreamDestroy(p->streams[i]);
                if (p->base)
                    cudaFree(p->base);
            } /* else never opened, or the device went away: the process's exit frees it */
            free(p->events);
        }
        if (h->tfd >= 0)
            close(h->tfd);
        if (h->pinned)
            kvt__pinned_close();
    }
#endif
    for (uint32_t k = 0; k < h->npools && !h->cuda; k++)
        if (h->pools[k].base)
            munmap(h->pools[k].base, h->pool_bytes);
    free(h->batch);
    free(h->bitmap);
    free(h);
}

static void hbm_destroy(kvt_tier_t *t)
{
    hbm_dealloc(t->impl);
}

static const kvt_tier_ops_t host_ops = {
    .backend = "host",
    .footprint = hbm_footprint,
    .write = hbm_write,
    .read = hbm_read,
    .free = hbm_free,
    .ptr = host_ptr,
    .poll = hbm_poll,
    .destroy = hbm_destroy,
};

/* ---- cuda backend ---- */

#if KVT_HAVE_CUDA
static pthread_once_t cuda_once = PTHREAD_ONCE_INIT;
static int cuda_ndev;
static cudaError_t cuda_probe_err;

static void cuda_probe(void)
{
    int n = 0;
    cuda_probe_err = cudaGetDeviceCount(&n);
    cuda_ndev = cuda_probe_err == cudaSuccess ? n : 0;
}

int kvt_tier_cuda_usable(void)
{
    pthread_once(&cuda_once, cuda_probe);
    return cuda_ndev > 0;
}

static void cuda_arm(hbm_t *h, int on)
{
    if (h->armed == on)
        return;
    struct itimerspec its = {0};
    if (on) {
        its.it_value.tv_nsec = HBM_POLL_NS;
        its.it_interval.tv_nsec = HBM_POLL_NS;
    }
    if (timerfd_settime(h->tfd, 0, &its, NULL) == 0)
        h->armed = on;
}

static int cuda_event_get(hbm_pool_t *p, cudaEvent_t *ev)
{
    if (p->nevents > 0) {
        *ev = p->events[--p->nevents];
        return 0;
    }
    return cudaEventCreateWithFlags(ev, cudaEventDisableTiming) == cudaSuccess ? 0 : KVT_ENOMEM;
}

static void cuda_event_put(hbm_pool_t *p, cudaEvent_t ev)
{
    if (p->nevents == p->events_cap) {
        size_t cap = p->events_cap ? p->events_cap * 2 : 16;
        cudaEvent_t *ne = realloc(p->events, cap * sizeof(*ne));
        if (!ne) {
            cudaEventDestroy(ev);
            return;
        }
        p->events = ne;
        p->events_cap = cap;
    }
    p->events[p->nevents++] = ev;
}

static hbm_batch_t *cuda_batch_get(hbm_t *h)
{
    hbm_batch_t *b = h->spare;
    if (b) {
        h->spare = b->next;
        return b;
    }
    return malloc(sizeof(*b));
}

static void cuda_batch_put(hbm_t *h, hbm_batch_t *b)
{
    b->next = h->spare;
    h->spare = b;
}

/* Enqueues the copies of one batch on stream s of pool p. */
static cudaError_t cuda_copies(hbm_t *h, hbm_pool_t *p, kvt_tier_io_t **ios, uint32_t n,
                               int to_device, cudaStream_t s)
{
    for (uint32_t i = 0; i < n; i++) {
        uint8_t *dev = hbm_addr(h, ios[i]->loc);
        h->dsts[i] = to_device ? (void *)dev : ios[i]->buf;
        h->srcs[i] = to_device ? (const void *)ios[i]->buf : (const void *)dev;
        h->sizes[i] = ios[i]->len;
    }
#if CUDART_VERSION >= 12080
    if (h->batch_api && n > 1) {
        /* Every copy in stream order (the host side is pinned DRAM-tier or staging memory, or
         * pageable memory that stays put until the callback: a client's buffer, a block in a
         * DRAM shared arena); the location hints matter only for managed or pageable memory. */
        struct cudaMemcpyAttributes attr;
        memset(&attr, 0, sizeof(attr));
        attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
        attr.srcLocHint.type = to_device ? cudaMemLocationTypeHost : cudaMemLocationTypeDevice;
        attr.srcLocHint.id = to_device ? 0 : p->device;
        attr.dstLocHint.type = to_device ? cudaMemLocationTypeDevice : cudaMemLocationTypeHost;
        attr.dstLocHint.id = to_device ? p->device : 0;
        size_t first = 0;
#if CUDART_VERSION >= 13000
        cudaError_t ce = cudaMemcpyBatchAsync(h->dsts, h->srcs, h->sizes, n, &attr, &first, 1, s);
#else
        size_t fail_idx = 0; /* 12.8 and 12.9 name the copy that failed */
        cudaError_t ce = cudaMemcpyBatchAsync((void **)h->dsts, (void **)h->srcs, h->sizes, n,
                                              &attr, &first, 1, &fail_idx, s);
#endif
        if (ce == cudaSuccess)
            return ce;
        /* Refused (an older driver, memory it will not batch): the same copies one call each,
         * from now on. Copying a block again that the failed call may have copied is
         * harmless. */
        (void)cudaGetLastError();
        kvt_log(KVT_LOG_WARN,
                "hbm tier: cudaMemcpyBatchAsync of %u copies failed (%s): copies go out one "
                "cudaMemcpyAsync each from now on",
                n, cudaGetErrorString(ce));
        h->batch_api = 0;
    }
#endif
    for (uint32_t i = 0; i < n; i++) {
        cudaError_t ce =
            cudaMemcpyAsync(h->dsts[i], h->srcs[i], h->sizes[i],
                            to_device ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost, s);
        if (ce != cudaSuccess)
            return ce;
    }
    return cudaSuccess;
}

/* A copy's completion with an error: a write's slots go back to the pool. */
static void cuda_fail(kvt_tier_t *t, kvt_tier_io_t *io, int status)
{
    if (io->op == KVT_IO_WRITE)
        hbm_release(t->impl, io->loc, io->len);
    kvt__tier_complete(t, io, status);
}

static void cuda_batch(kvt_tier_t *t, hbm_pool_t *p, kvt_tier_io_t **ios, uint32_t n, int to_device)
{
    hbm_t *h = t->impl;
    /* Half the streams carry copies to the device and half copies back, so that the two
     * directions' copy engines overlap; round robin within a direction. */
    uint32_t down = p->nstreams > 1 ? p->nstreams / 2 : 1;
    uint32_t first = to_device || p->nstreams == 1 ? 0 : down;
    uint32_t count = p->nstreams == 1 ? 1 : to_device ? down : p->nstreams - down;
    cudaStream_t s = p->streams[first + p->next_stream[to_device]++ % count];
    cudaEvent_t ev = NULL;
    hbm_batch_t *b = cuda_batch_get(h);
    cudaError_t ce = b ? cudaSetDevice(p->device) : cudaErrorMemoryAllocation;
    if (ce == cudaSuccess && cuda_event_get(p, &ev) < 0)
        ce = cudaErrorMemoryAllocation;
    if (ce == cudaSuccess && to_device && p->fence) {
        /* After a free while reads were out (hbm_free): the writes of this flush start once
         * every read batch of this pool submitted so far is done. Rare: the daemon frees a block
         * only when no read of it is in flight, unless a client removes it. */
        for (hbm_batch_t *r = h->pend_head; r && ce == cudaSuccess; r = r->next)
            if (!r->to_device && r->pool == p)
                ce = cudaStreamWaitEvent(s, r->ev, 0);
    }
    if (ce == cudaSuccess)
        ce = cuda_copies(h, p, ios, n, to_device, s);
    if (ce == cudaSuccess)
        ce = cudaEventRecord(ev, s);
    if (ce != cudaSuccess) {
        kvt_log(KVT_LOG_ERROR, "hbm tier: submitting %u copies failed: %s", n,
                cudaGetErrorString(ce));
        if (ev)
            cuda_event_put(p, ev);
        if (b)
            cuda_batch_put(h, b);
        for (uint32_t i = 0; i < n; i++)
            cuda_fail(t, ios[i], KVT_EIO);
        return;
    }
    for (uint32_t i = 0; i < n; i++)
        ios[i]->priv[1] = i + 1 < n ? (uint64_t)(uintptr_t)ios[i + 1] : 0;
    b->head = ios[0];
    b->ev = ev;
    b->pool = p;
    b->to_device = to_device;
    b->next = NULL;
    p->read_batches += !to_device;
    if (h->pend_tail)
        h->pend_tail->next = b;
    else
        h->pend_head = b;
    h->pend_tail = b;
    cuda_arm(h, 1);
}

static int cuda_fd(kvt_tier_t *t)
{
    return ((hbm_t *)t->impl)->tfd;
}

/* Completes every batch whose event is done. */
static int cuda_harvest(kvt_tier_t *t)
{
    hbm_t *h = t->impl;
    uint64_t ticks;
    ssize_t n = read(h->tfd, &ticks, sizeof(ticks));
    (void)n;
    int done = 0;
    hbm_batch_t *prev = NULL, *b = h->pend_head;
    while (b) {
        hbm_batch_t *next = b->next;
        cudaError_t ce = cudaEventQuery(b->ev);
        if (ce == cudaErrorNotReady) {
            prev = b;
            b = next;
            continue;
        }
        if (prev)
            prev->next = next;
        else
            h->pend_head = next;
        if (h->pend_tail == b)
            h->pend_tail = prev;
        b->pool->read_batches -= !b->to_device;
        cuda_event_put(b->pool, b->ev);
        if (ce != cudaSuccess)
            kvt_log(KVT_LOG_ERROR, "hbm tier: copy failed: %s", cudaGetErrorString(ce));
        for (kvt_tier_io_t *io = b->head, *inext; io; io = inext) {
            inext = (kvt_tier_io_t *)(uintptr_t)io->priv[1];
            if (ce != cudaSuccess)
                cuda_fail(t, io, KVT_EIO);
            else
                kvt__tier_complete(t, io, 0);
            done++;
        }
        cuda_batch_put(h, b);
        b = next;
    }
    if (!h->pend_head)
        cuda_arm(h, 0);
    return done;
}

static const kvt_tier_ops_t cuda_ops = {
    .backend = "cuda",
    .pinned_staging = 1,
    .footprint = hbm_footprint,
    .write = hbm_write,
    .read = hbm_read,
    .free = hbm_free,
    .fd = cuda_fd,
    .poll = hbm_poll,
    .destroy = hbm_destroy,
};

static int cuda_open(hbm_t *h, const kvt_tier_hbm_conf_t *conf)
{
    h->cuda = 1;
    h->tfd = -1;
    if (!kvt_tier_cuda_usable()) {
        kvt_log(KVT_LOG_WARN,
                "hbm tier: no usable CUDA device (cudaGetDeviceCount: %s): HBM tier unavailable, "
                "running on the other tiers",
                cuda_probe_err == cudaSuccess ? "0 devices" : cudaGetErrorString(cuda_probe_err));
        return KVT_EUNAVAIL;
    }
    for (uint32_t k = 0; k < h->npools; k++) {
        hbm_pool_t *p = &h->pools[k];
        if (p->device >= cuda_ndev) {
            kvt_log(KVT_LOG_ERROR, "hbm tier: CUDA device %d does not exist (%d found)", p->device,
                    cuda_ndev);
            return KVT_EINVAL;
        }
        cudaError_t ce = cudaSetDevice(p->device);
        void *base = NULL;
        if (ce == cudaSuccess)
            ce = cudaMalloc(&base, h->pool_bytes);
        if (ce != cudaSuccess) {
            (void)cudaGetLastError();
            kvt_log(KVT_LOG_ERROR, "hbm tier: cudaMalloc of %llu bytes on device %d failed: %s",
                    (unsigned long long)h->pool_bytes, p->device, cudaGetErrorString(ce));
            return ce == cudaErrorMemoryAllocation ? KVT_ENOMEM : KVT_EUNAVAIL;
        }
        p->base = base;
        uint32_t want = conf->streams ? conf->streams : 4;
        for (uint32_t i = 0; i < want; i++) {
            if (cudaStreamCreateWithFlags(&p->streams[i], cudaStreamNonBlocking) != cudaSuccess)
                return KVT_EUNAVAIL;
            p->nstreams = i + 1;
        }
    }
    h->tfd = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
    if (h->tfd < 0)
        return -errno;
    h->dsts = calloc(h->batch_max, sizeof(*h->dsts));
    h->srcs = calloc(h->batch_max, sizeof(*h->srcs));
    h->sizes = calloc(h->batch_max, sizeof(*h->sizes));
    if (!h->dsts || !h->srcs || !h->sizes)
        return KVT_ENOMEM;
    h->batch_api = CUDART_VERSION >= 12080;
    kvt__pinned_open();
    h->pinned = 1;
    return 0;
}
#else
int kvt_tier_cuda_usable(void)
{
    return 0;
}
#endif

static int hbm_is_cuda(const kvt_tier_t *t)
{
#if KVT_HAVE_CUDA
    return t->ops == &cuda_ops;
#else
    (void)t;
    return 0;
#endif
}

/* How a batch of more than one copy goes out. */
static const char *hbm_api(const hbm_t *h)
{
#if KVT_HAVE_CUDA
    if (h->cuda)
        return h->batch_api && h->batch_max > 1 ? "cudaMemcpyBatchAsync" : "cudaMemcpyAsync";
#endif
    (void)h;
    return "memcpy";
}

static uint32_t hbm_nstreams(const hbm_t *h)
{
#if KVT_HAVE_CUDA
    return h->pools[0].nstreams;
#else
    (void)h;
    return 0;
#endif
}

int kvt_tier_hbm_offset(const kvt_tier_t *t, uint64_t loc, uint64_t *off)
{
    if (!t || !off || t->kind != KVT_TIER_HBM)
        return KVT_EINVAL;
    if (!kvt__tier_lookup(t, loc))
        return KVT_ENOENT;
    *off = hbm_off(t->impl, loc);
    return 0;
}

int kvt_tier_hbm_device(const kvt_tier_t *t, uint64_t loc)
{
    if (!t || t->kind != KVT_TIER_HBM)
        return KVT_EINVAL;
    if (!kvt__tier_lookup(t, loc))
        return KVT_ENOENT;
    return pool_of_loc(t->impl, loc)->device;
}

int kvt_tier_hbm_pools(const kvt_tier_t *t, kvt_tier_hbm_pool_t *out, uint32_t n)
{
    if (!t || t->kind != KVT_TIER_HBM || (n && !out))
        return KVT_EINVAL;
    const hbm_t *h = t->impl;
    for (uint32_t i = 0; i < h->npools && i < n; i++) {
        const hbm_pool_t *p = &h->pools[i];
        out[i] = (kvt_tier_hbm_pool_t){.device = p->device,
                                       .capacity_bytes = h->pool_bytes,
                                       .used_bytes = p->used_slots << h->slot_shift,
                                       .blocks = p->blocks};
    }
    return (int)h->npools;
}

int kvt_tier_hbm_ipc(kvt_tier_t *t, int device, uint8_t handle[KVT_HBM_IPC_HANDLE],
                     uint64_t *pool_bytes)
{
    if (!t || !handle || !pool_bytes || t->kind != KVT_TIER_HBM)
        return KVT_EINVAL;
    if (!hbm_is_cuda(t))
        return KVT_EUNAVAIL; /* host memory: nothing another process could open */
#if KVT_HAVE_CUDA
    hbm_t *h = t->impl;
    hbm_pool_t *p = pool_of_device(h, device);
    if (!p)
        p = &h->pools[0];
    if (!p->ipc_ok) {
        cudaError_t ce = cudaSetDevice(p->device);
        if (ce == cudaSuccess)
            ce = cudaIpcGetMemHandle(&p->ipc, p->base);
        if (ce != cudaSuccess) {
            (void)cudaGetLastError(); /* not sticky: the tier's copies go on */
            kvt_log(KVT_LOG_ERROR,
                    "hbm tier: cudaIpcGetMemHandle of the pool (%llu bytes on device %d) failed: "
                    "%s",
                    (unsigned long long)h->pool_bytes, p->device, cudaGetErrorString(ce));
            return KVT_EIO;
        }
        p->ipc_ok = 1;
    }
    memcpy(handle, &p->ipc, KVT_HBM_IPC_HANDLE);
    *pool_bytes = h->pool_bytes;
    return p->device;
#else
    return KVT_EUNAVAIL;
#endif
}

int kvt_tier_hbm_ipc_open(const uint8_t handle[KVT_HBM_IPC_HANDLE], int device, void **base)
{
    if (!handle || !base || device < 0)
        return KVT_EINVAL;
    *base = NULL;
#if KVT_HAVE_CUDA
    if (!kvt_tier_cuda_usable())
        return KVT_EUNAVAIL;
    if (device >= cuda_ndev)
        return KVT_EINVAL;
    cudaIpcMemHandle_t ih;
    memcpy(&ih, handle, sizeof(ih));
    void *p = NULL;
    /* The mapping goes to `device`; the caller's thread keeps the device it had (an engine's
     * own code relies on it). */
    int prev = -1;
    cudaError_t ce = cudaGetDevice(&prev);
    if (ce == cudaSuccess)
        ce = cudaSetDevice(device);
    if (ce == cudaSuccess) {
        ce = cudaIpcOpenMemHandle(&p, ih, cudaIpcMemLazyEnablePeerAccess);
        if (prev != device)
            (void)cudaSetDevice(prev);
    }
    if (ce != cudaSuccess) {
        (void)cudaGetLastError();
        kvt_log(KVT_LOG_ERROR, "hbm ipc: cudaIpcOpenMemHandle on device %d failed: %s", device,
                cudaGetErrorString(ce));
        return KVT_EIO;
    }
    *base = p;
    return 0;
#else
    return KVT_EUNAVAIL;
#endif
}

int kvt_tier_hbm_ipc_close(void *base)
{
    if (!base)
        return KVT_EINVAL;
#if KVT_HAVE_CUDA
    cudaError_t ce = cudaIpcCloseMemHandle(base);
    if (ce != cudaSuccess) {
        (void)cudaGetLastError();
        kvt_log(KVT_LOG_ERROR, "hbm ipc: cudaIpcCloseMemHandle failed: %s", cudaGetErrorString(ce));
        return KVT_EIO;
    }
    return 0;
#else
    return KVT_EUNAVAIL;
#endif
}

void *kvt_tier_hbm_devptr(kvt_tier_t *t, uint64_t loc)
{
    if (!t || t->kind != KVT_TIER_HBM || !kvt__tier_lookup(t, loc))
        return NULL;
    return hbm_addr(t->impl, loc);
}

int kvt_tier_hbm_create(kvt_tier_t **out, const kvt_tier_hbm_conf_t *conf)
{
    if (!out || !conf)
        return KVT_EINVAL;
    const char *be = conf->backend ? conf->backend : "auto";
    int host = strcmp(be, "host") == 0;
    if (!host && strcmp(be, "cuda") != 0 && strcmp(be, "auto") != 0) {
        kvt_log(KVT_LOG_ERROR, "hbm tier: unknown backend \"%s\" (cuda, host, auto)", be);
        return KVT_EINVAL;
    }
    uint32_t slot = conf->slot_bytes ? conf->slot_bytes : 64u << 10;
    if (slot < 4096 || slot > (16u << 20) || (slot & (slot - 1)) ||
        conf->streams > HBM_MAX_STREAMS || conf->batch > HBM_BATCH_MAX)
        return KVT_EINVAL;
    uint64_t nslots = conf->capacity_bytes / slot;
    if (nslots == 0 || conf->capacity_bytes > (1ull << 46))
        return KVT_EINVAL;
    /* The devices: distinct ordinals, or the one `device`. */
    int one = conf->device;
    const int *devs = conf->ndevices ? conf->devices : &one;
    uint32_t ndev = conf->ndevices ? conf->ndevices : 1;
    if (!devs || ndev > KVT_HBM_MAX_DEVICES) {
        kvt_log(KVT_LOG_ERROR, "hbm tier: a device list names 1 to %d devices (%u given%s)",
                KVT_HBM_MAX_DEVICES, ndev, devs ? "" : ", but no list");
        return KVT_EINVAL;
    }
    for (uint32_t i = 0; i < ndev; i++) {
        int twice = 0;
        for (uint32_t j = 0; j < i; j++)
            twice |= devs[j] == devs[i];
        if (devs[i] < 0 || twice) {
            kvt_log(KVT_LOG_ERROR, "hbm tier: device %d %s", devs[i],
                    twice ? "listed twice" : "is no CUDA device ordinal");
            return KVT_EINVAL;
        }
    }
    hbm_t *h = calloc(1, sizeof(*h));
    if (!h)
        return KVT_ENOMEM;
    h->owner = pthread_self();
    h->slot_bytes = slot;
    h->slot_shift = (uint32_t)__builtin_ctz(slot);
    h->npools = ndev;
    for (uint32_t i = 0; i < ndev; i++) {
        hbm_pool_t *p = &h->pools[i];
        p->device = devs[i];
        p->first = p->hint = (uint64_t)i * nslots;
        p->nslots = nslots;
    }
    h->nslots = nslots * ndev;
    h->pool_bytes = nslots * slot;
    h->batch_max = conf->batch ? conf->batch : HBM_BATCH_DEFAULT;
    h->st.batch_max = h->batch_max;
    h->bitmap = calloc((h->nslots + 63) / 64, sizeof(uint64_t));
    h->batch = calloc(h->batch_max, sizeof(*h->batch));
    if (!h->bitmap || !h->batch) {
        hbm_dealloc(h);
        return KVT_ENOMEM;
    }
    const kvt_tier_ops_t *ops = &host_ops;
    int rc = 0;
    if (host) {
        for (uint32_t i = 0; i < ndev; i++) {
            void *p = mmap(NULL, h->pool_bytes, PROT_READ | PROT_WRITE,
                           MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
            if (p == MAP_FAILED) {
                hbm_dealloc(h);
                return KVT_ENOMEM;
            }
            h->pools[i].base = p;
        }
    } else {
#if KVT_HAVE_CUDA
        ops = &cuda_ops;
        rc = cuda_open(h, conf);
#else
        kvt_log(KVT_LOG_WARN, "hbm tier: this build has no CUDA: HBM tier unavailable");
        rc = KVT_EUNAVAIL;
#endif
    }
    if (rc == 0)
        rc = kvt__tier_init(out, KVT_TIER_HBM, ops, h, h->pool_bytes * ndev);
    if (rc < 0) {
        hbm_dealloc(h);
        return rc;
    }
    char list[KVT_HBM_MAX_DEVICES * 12] = "";
    for (uint32_t i = 0, o = 0; i < ndev && o < sizeof(list); i++)
        o += (uint32_t)snprintf(list + o, sizeof(list) - o, "%s%d", i ? "," : "", devs[i]);
    if (host)
        kvt_log(KVT_LOG_WARN,
                "hbm tier: backend \"host\": %llu bytes of ordinary memory per device (%s) stand "
                "in for HBM (testing only, no GPU involved); copies in batches of up to %u",
                (unsigned long long)h->pool_bytes, list, h->batch_max);
    else
        kvt_log(KVT_LOG_INFO,
                "hbm tier: backend \"cuda\": %llu bytes on each device (%s), copies in batches of "
                "up to %u (%s) on %u streams each",
                (unsigned long long)h->pool_bytes, list, h->batch_max, hbm_api(h), hbm_nstreams(h));
    return 0;
}

int kvt_tier_hbm_stats(const kvt_tier_t *t, kvt_tier_hbm_stats_t *out)
{
    if (!t || !out || (t->ops != &host_ops && !hbm_is_cuda(t)))
        return KVT_EINVAL;
    const hbm_t *h = t->impl;
    *out = h->st;
    out->api = hbm_api(h);
    return 0;
}
