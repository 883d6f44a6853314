/*
 * hbm.c: the HBM tier. A pool of memory allocated once at creation and carved into fixed-size
 * slots by a bitmap; a block takes a run of whole slots (first fit from a rotating hint), and
 * its location is its first slot + 1. Two backends share the pool logic:
 *
 *   cuda  the pool is cudaMalloc'd device memory. A write or read is one cudaMemcpyAsync on one
 *         of a few streams (round robin) followed by a cudaEventRecord; the request waits in a
 *         FIFO until its event is done. The tier's fd is a timerfd armed (every 20 us) only
 *         while copies are in flight; the poll op queries the events and completes what is
 *         done. No thread of ours runs: the loop that owns the tier harvests everything.
 *         A copy that stages on its way to or from this backend stages through pinned memory
 *         (kvt__pinned_get below), so that its cudaMemcpyAsync is a real asynchronous DMA.
 *   host  the pool is ordinary memory and copies are memcpy, completed at once: four-tier
 *         behaviour on machines without a GPU. Chosen only by explicit configuration, and it
 *         says so in its log line and in kvt_tier_backend().
 *
 * Only the CUDA runtime API is used (never libcuda); in a build without CUDA the cuda backend
 * reports KVT_EUNAVAIL.
 */
#include "tier_impl.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/timerfd.h>
#include <unistd.h>

#include "config.h"
#if KVT_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

#define HBM_MAX_STREAMS 16
#define HBM_POLL_NS     20000

typedef struct hbm {
    int cuda;
    uint8_t *base; /* device memory (cuda) or host memory (host) */
    uint64_t pool_bytes;
    uint64_t nslots;
    uint32_t slot_bytes;
    uint32_t slot_shift;
    uint64_t *bitmap; /* 1 = slot in use */
    uint64_t hint;    /* where the next search starts */
#if KVT_HAVE_CUDA
    int device;
    cudaStream_t streams[HBM_MAX_STREAMS];
    uint32_t nstreams, next_stream;
    int tfd;
    int armed;
    int pinned;                           /* counted in pin_tiers */
    kvt_tier_io_t *pend_head, *pend_tail; /* linked through priv[1] */
    cudaEvent_t *events;                  /* free events */
    size_t nevents, events_cap;
#endif
} hbm_t;

#if KVT_HAVE_CUDA
static void pin_close(void);
#endif

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

static int hbm_alloc(hbm_t *h, uint64_t n, uint64_t *slot)
{
    uint64_t s = hbm_search(h, h->hint, h->nslots, n);
    if (s >= h->nslots) {
        uint64_t lim = KVT_MIN(h->nslots, h->hint + n);
        s = hbm_search(h, 0, lim, n);
        if (s >= lim)
            return KVT_ENOSPC;
    }
    bits_set(h->bitmap, s, n, 1);
    h->hint = s + n < h->nslots ? s + n : 0;
    *slot = s;
    return 0;
}

static uint64_t hbm_slots(const hbm_t *h, uint32_t len)
{
    return ((uint64_t)len + h->slot_bytes - 1) >> h->slot_shift;
}

static void hbm_release(hbm_t *h, uint64_t loc, uint32_t len)
{
    uint64_t s = loc - 1, n = hbm_slots(h, len);
    kvt_assert(s + n <= h->nslots && bit_get(h->bitmap, s));
    bits_set(h->bitmap, s, n, 0);
}

static uint64_t hbm_footprint(const kvt_tier_t *t, uint32_t len)
{
    const hbm_t *h = t->impl;
    return hbm_slots(h, len) << h->slot_shift;
}

static uint8_t *hbm_addr(const hbm_t *h, uint64_t loc)
{
    return h->base + ((loc - 1) << h->slot_shift);
}

static void hbm_free(kvt_tier_t *t, uint64_t loc, uint32_t len)
{
    hbm_release(t->impl, loc, len);
}

/* ---- host backend ---- */

static int host_write(kvt_tier_t *t, kvt_tier_io_t *io)
{
    hbm_t *h = t->impl;
    uint64_t slot;
    int rc = hbm_alloc(h, hbm_slots(h, io->len), &slot);
    if (rc < 0)
        return rc;
    io->loc = slot + 1;
    memcpy(hbm_addr(h, io->loc), io->buf, io->len);
    kvt__tier_complete(t, io, 0);
    return 0;
}

static int host_read(kvt_tier_t *t, kvt_tier_io_t *io)
{
    memcpy(io->buf, hbm_addr(t->impl, io->loc), io->len);
    kvt__tier_complete(t, io, 0);
    return 0;
}

static void *host_ptr(kvt_tier_t *t, uint64_t loc)
{
    return hbm_addr(t->impl, loc);
}

static void hbm_dealloc(hbm_t *h)
{
#if KVT_HAVE_CUDA
    if (h->cuda) {
        for (size_t i = 0; i < h->nevents; i++)
            cudaEventDestroy(h->events[i]);
        free(h->events);
        for (uint32_t i = 0; i < h->nstreams; i++)
            cudaStreamDestroy(h->streams[i]);
        if (h->base)
            cudaFree(h->base);
        if (h->tfd >= 0)
            close(h->tfd);
        if (h->pinned)
            pin_close();
    }
#endif
    if (!h->cuda && h->base)
        munmap(h->base, h->pool_bytes);
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
    .write = host_write,
    .read = host_read,
    .free = hbm_free,
    .ptr = host_ptr,
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

/* ---- pinned staging for copies (kvt__pinned_get) ----
 * cudaHostAlloc pins pages at a cost of a millisecond or more for megabytes, so freed staging
 * buffers wait in a small cache, by size rounded up to a power of two, while any CUDA tier is
 * open; the last one to close empties it. A buffer handed back after that is freed at once. */
#define PIN_CACHE_SLOTS 16
#define PIN_CACHE_BYTES (128ull << 20)

static pthread_mutex_t pin_lock = PTHREAD_MUTEX_INITIALIZER;
static unsigned pin_tiers; /* CUDA tiers open */
static void *pin_buf[PIN_CACHE_SLOTS];
static size_t pin_len[PIN_CACHE_SLOTS];
static unsigned pin_n;
static uint64_t pin_bytes;

static size_t pin_round(size_t sz)
{
    size_t r = 64u << 10;
    while (r < sz)
        r <<= 1;
    return r;
}

void *kvt__pinned_get(size_t sz)
{
    size_t want = pin_round(sz);
    void *p = NULL;
    pthread_mutex_lock(&pin_lock);
    for (unsigned i = 0; i < pin_n; i++) {
        if (pin_len[i] == want) {
            p = pin_buf[i];
            pin_bytes -= want;
            pin_n--;
            pin_buf[i] = pin_buf[pin_n];
            pin_len[i] = pin_len[pin_n];
            break;
        }
    }
    pthread_mutex_unlock(&pin_lock);
    if (!p && cudaHostAlloc(&p, want, cudaHostAllocPortable) != cudaSuccess)
        p = NULL;
    return p;
}

void kvt__pinned_put(void *p, size_t sz)
{
    size_t len = pin_round(sz);
    pthread_mutex_lock(&pin_lock);
    int keep = pin_tiers > 0 && pin_n < PIN_CACHE_SLOTS && pin_bytes + len <= PIN_CACHE_BYTES;
    if (keep) {
        pin_buf[pin_n] = p;
        pin_len[pin_n] = len;
        pin_n++;
        pin_bytes += len;
    }
    pthread_mutex_unlock(&pin_lock);
    if (!keep)
        cudaFreeHost(p);
}

static void pin_open(void)
{
    pthread_mutex_lock(&pin_lock);
    pin_tiers++;
    pthread_mutex_unlock(&pin_lock);
}

static void pin_close(void)
{
    void *drop[PIN_CACHE_SLOTS];
    unsigned n = 0;
    pthread_mutex_lock(&pin_lock);
    kvt_assert(pin_tiers > 0);
    if (--pin_tiers == 0) {
        n = pin_n;
        memcpy(drop, pin_buf, n * sizeof(drop[0]));
        pin_n = 0;
        pin_bytes = 0;
    }
    pthread_mutex_unlock(&pin_lock);
    for (unsigned i = 0; i < n; i++)
        cudaFreeHost(drop[i]);
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

_Static_assert(sizeof(cudaEvent_t) <= sizeof(uint64_t), "an event handle fits in priv[0]");

static int cuda_event_get(hbm_t *h, cudaEvent_t *ev)
{
    if (h->nevents > 0) {
        *ev = h->events[--h->nevents];
        return 0;
    }
    return cudaEventCreateWithFlags(ev, cudaEventDisableTiming) == cudaSuccess ? 0 : KVT_ENOMEM;
}

static void cuda_event_put(hbm_t *h, cudaEvent_t ev)
{
    if (h->nevents == h->events_cap) {
        size_t cap = h->events_cap ? h->events_cap * 2 : 16;
        cudaEvent_t *ne = realloc(h->events, cap * sizeof(*ne));
        if (!ne) {
            cudaEventDestroy(ev);
            return;
        }
        h->events = ne;
        h->events_cap = cap;
    }
    h->events[h->nevents++] = ev;
}

static int cuda_submit(kvt_tier_t *t, kvt_tier_io_t *io, int to_device)
{
    hbm_t *h = t->impl;
    cudaEvent_t ev;
    if (cudaSetDevice(h->device) != cudaSuccess)
        return KVT_EUNAVAIL;
    int rc = cuda_event_get(h, &ev);
    if (rc < 0)
        return rc;
    cudaStream_t s = h->streams[h->next_stream];
    h->next_stream = (h->next_stream + 1) % h->nstreams;
    uint8_t *dev = hbm_addr(h, io->loc);
    cudaError_t ce = to_device ? cudaMemcpyAsync(dev, io->buf, io->len, cudaMemcpyHostToDevice, s)
                               : cudaMemcpyAsync(io->buf, dev, io->len, cudaMemcpyDeviceToHost, s);
    if (ce == cudaSuccess)
        ce = cudaEventRecord(ev, s);
    if (ce != cudaSuccess) {
        kvt_log(KVT_LOG_ERROR, "hbm tier: cudaMemcpyAsync failed: %s", cudaGetErrorString(ce));
        cuda_event_put(h, ev);
        return KVT_EIO;
    }
    io->priv[0] = (uint64_t)(uintptr_t)ev;
    io->priv[1] = 0;
    if (h->pend_tail)
        h->pend_tail->priv[1] = (uint64_t)(uintptr_t)io;
    else
        h->pend_head = io;
    h->pend_tail = io;
    cuda_arm(h, 1);
    return 0;
}

static int cuda_write(kvt_tier_t *t, kvt_tier_io_t *io)
{
    hbm_t *h = t->impl;
    uint64_t slot, n = hbm_slots(h, io->len);
    int rc = hbm_alloc(h, n, &slot);
    if (rc < 0)
        return rc;
    io->loc = slot + 1;
    rc = cuda_submit(t, io, 1);
    if (rc < 0) {
        bits_set(h->bitmap, slot, n, 0);
        io->loc = 0;
    }
    return rc;
}

static int cuda_read(kvt_tier_t *t, kvt_tier_io_t *io)
{
    return cuda_submit(t, io, 0);
}

static int cuda_fd(kvt_tier_t *t)
{
    return ((hbm_t *)t->impl)->tfd;
}

static int cuda_poll(kvt_tier_t *t)
{
    hbm_t *h = t->impl;
    uint64_t ticks;
    ssize_t n = read(h->tfd, &ticks, sizeof(ticks));
    (void)n;
    int done = 0;
    kvt_tier_io_t *prev = NULL, *io = h->pend_head;
    while (io) {
        kvt_tier_io_t *next = (kvt_tier_io_t *)(uintptr_t)io->priv[1];
        cudaEvent_t ev = (cudaEvent_t)(uintptr_t)io->priv[0];
        cudaError_t ce = cudaEventQuery(ev);
        if (ce == cudaErrorNotReady) {
            prev = io;
            io = next;
            continue;
        }
        if (prev)
            prev->priv[1] = (uint64_t)(uintptr_t)next;
        else
            h->pend_head = next;
        if (h->pend_tail == io)
            h->pend_tail = prev;
        cuda_event_put(h, ev);
        int status = 0;
        if (ce != cudaSuccess) {
            kvt_log(KVT_LOG_ERROR, "hbm tier: copy failed: %s", cudaGetErrorString(ce));
            status = KVT_EIO;
            if (io->op == KVT_IO_WRITE)
                hbm_release(h, io->loc, io->len);
        }
        kvt__tier_complete(t, io, status);
        done++;
        io = next;
    }
    if (!h->pend_head)
        cuda_arm(h, 0);
    return done;
}

static const kvt_tier_ops_t cuda_ops = {
    .backend = "cuda",
    .pinned_staging = 1,
    .footprint = hbm_footprint,
    .write = cuda_write,
    .read = cuda_read,
    .free = hbm_free,
    .fd = cuda_fd,
    .poll = cuda_poll,
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
    if (conf->device < 0 || conf->device >= cuda_ndev) {
        kvt_log(KVT_LOG_ERROR, "hbm tier: CUDA device %d does not exist (%d found)", conf->device,
                cuda_ndev);
        return KVT_EINVAL;
    }
    h->device = conf->device;
    cudaError_t ce = cudaSetDevice(h->device);
    void *base = NULL;
    if (ce == cudaSuccess)
        ce = cudaMalloc(&base, h->pool_bytes);
    if (ce != cudaSuccess) {
        kvt_log(KVT_LOG_ERROR, "hbm tier: cudaMalloc of %llu bytes on device %d failed: %s",
                (unsigned long long)h->pool_bytes, h->device, cudaGetErrorString(ce));
        return ce == cudaErrorMemoryAllocation ? KVT_ENOMEM : KVT_EUNAVAIL;
    }
    h->base = base;
    h->nstreams = conf->streams ? conf->streams : 4;
    for (uint32_t i = 0; i < h->nstreams; i++) {
        if (cudaStreamCreateWithFlags(&h->streams[i], cudaStreamNonBlocking) != cudaSuccess) {
            h->nstreams = i;
            return KVT_EUNAVAIL;
        }
    }
    h->tfd = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
    if (h->tfd < 0)
        return -errno;
    pin_open();
    h->pinned = 1;
    return 0;
}
#else
int kvt_tier_cuda_usable(void)
{
    return 0;
}
#endif

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
    if (slot < 4096 || slot > (16u << 20) || (slot & (slot - 1)) || conf->streams > HBM_MAX_STREAMS)
        return KVT_EINVAL;
    uint64_t nslots = conf->capacity_bytes / slot;
    if (nslots == 0 || conf->capacity_bytes > (1ull << 46))
        return KVT_EINVAL;
    hbm_t *h = calloc(1, sizeof(*h));
    if (!h)
        return KVT_ENOMEM;
    h->slot_bytes = slot;
    h->slot_shift = (uint32_t)__builtin_ctz(slot);
    h->nslots = nslots;
    h->pool_bytes = nslots * slot;
    h->bitmap = calloc((nslots + 63) / 64, sizeof(uint64_t));
    if (!h->bitmap) {
        hbm_dealloc(h);
        return KVT_ENOMEM;
    }
    const kvt_tier_ops_t *ops = &host_ops;
    int rc = 0;
    if (host) {
        void *p = mmap(NULL, h->pool_bytes, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (p == MAP_FAILED) {
            hbm_dealloc(h);
            return KVT_ENOMEM;
        }
        h->base = p;
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
        rc = kvt__tier_init(out, KVT_TIER_HBM, ops, h, h->pool_bytes);
    if (rc < 0) {
        hbm_dealloc(h);
        return rc;
    }
    if (host)
        kvt_log(KVT_LOG_WARN,
                "hbm tier: backend \"host\": %llu bytes of ordinary memory stand in for HBM "
                "(testing only, no GPU involved)",
                (unsigned long long)h->pool_bytes);
    else
        kvt_log(KVT_LOG_INFO, "hbm tier: backend \"cuda\": %llu bytes on device %d",
                (unsigned long long)h->pool_bytes, conf->device);
    return 0;
}
