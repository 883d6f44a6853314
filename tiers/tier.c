/*
 * tier.c: what every tier shares, written once. It owns the location index (which locations a
 * tier holds, for which block, at what charge), the capacity accounting (a write's footprint is
 * reserved when it is submitted, so that usage never exceeds capacity even with writes in
 * flight, and given back when the write fails or the block is freed), the completion queue with
 * its eventfd and the epoll fd the caller's loop watches, the usage counters, and copies between
 * two tiers with their staging buffers (pinned ones from a cache while a CUDA tier is open).
 * Backends (dram.c, nvme.c, hbm.c, remote.c) only move bytes.
 *
 * Completion path: a backend calls kvt__tier_complete() (from its submit op or its poll op);
 * that appends the request to done_head..done_tail and makes efd readable; kvt_tier_process()
 * drains efd, lets the backend harvest (poll op), then detaches the list and runs the callbacks.
 * A callback that submits again queues into a fresh list, run by the next process call.
 */
#include "tier_impl.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#if KVT_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

/* ---- the location index ---- */

static uint64_t tier_mix(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    x ^= x >> 33;
    return x;
}

static kvt__tier_ent_t *tier_find(const kvt_tier_t *t, uint64_t loc)
{
    if (!t->ents)
        return NULL;
    size_t mask = t->ents_cap - 1;
    for (size_t i = tier_mix(loc) & mask;; i = (i + 1) & mask) {
        kvt__tier_ent_t *e = &t->ents[i];
        if (!e->used)
            return NULL;
        if (e->loc == loc)
            return e;
    }
}

static void tier_place(kvt__tier_ent_t *ents, size_t cap, const kvt__tier_ent_t *src)
{
    size_t mask = cap - 1;
    size_t i = tier_mix(src->loc) & mask;
    while (ents[i].used)
        i = (i + 1) & mask;
    ents[i] = *src;
}

/* Makes room for `more` entries beyond those indexed and writes in flight, keeping the load
 * under 3/4, so that a write's completion can always be indexed. */
static int tier_index_reserve(kvt_tier_t *t, uint64_t more)
{
    uint64_t need = t->usage.blocks + t->pending_writes + more;
    if (t->ents && need * 4 <= (uint64_t)t->ents_cap * 3)
        return 0;
    size_t cap = t->ents_cap ? t->ents_cap : 64;
    while (need * 4 > (uint64_t)cap * 3)
        cap *= 2;
    kvt__tier_ent_t *ents = calloc(cap, sizeof(*ents));
    if (!ents)
        return KVT_ENOMEM;
    for (size_t i = 0; i < t->ents_cap; i++)
        if (t->ents[i].used)
            tier_place(ents, cap, &t->ents[i]);
    free(t->ents);
    t->ents = ents;
    t->ents_cap = cap;
    return 0;
}

static void tier_index_add(kvt_tier_t *t, uint64_t loc, const kvt_block_key_t *key, uint32_t len,
                           uint64_t charge)
{
    kvt_assert(t->ents && (t->usage.blocks + 1) * 4 <= (uint64_t)t->ents_cap * 3);
    kvt_assert(loc != 0 && !tier_find(t, loc));
    kvt__tier_ent_t e = {.loc = loc,
                         .hash = key->hash,
                         .ns_seed = key->ns_seed,
                         .charge = charge,
                         .len = len,
                         .used = 1};
    tier_place(t->ents, t->ents_cap, &e);
    t->usage.blocks++;
}

/* Backward-shift deletion keeps probe chains intact without tombstones. */
static void tier_index_del(kvt_tier_t *t, kvt__tier_ent_t *e)
{
    size_t mask = t->ents_cap - 1;
    size_t hole = (size_t)(e - t->ents);
    size_t i = hole;
    t->ents[hole].used = 0;
    for (;;) {
        i = (i + 1) & mask;
        if (!t->ents[i].used)
            break;
        size_t home = tier_mix(t->ents[i].loc) & mask;
        /* Move entry i into the hole unless its home lies cyclically in (hole, i]. */
        int stays = hole <= i ? (home > hole && home <= i) : (home > hole || home <= i);
        if (!stays) {
            t->ents[hole] = t->ents[i];
            t->ents[i].used = 0;
            hole = i;
        }
    }
    kvt_assert(t->usage.blocks > 0);
    t->usage.blocks--;
}

const kvt__tier_ent_t *kvt__tier_lookup(const kvt_tier_t *t, uint64_t loc)
{
    return tier_find(t, loc);
}

kvt__tier_ent_t *kvt__tier_entry(kvt_tier_t *t, uint64_t loc)
{
    return tier_find(t, loc);
}

/* ---- bytes per namespace (quotas) ---- */

static struct kvt__tier_ns *ns_find(const kvt_tier_t *t, uint64_t seed)
{
    if (!t->nss_cap)
        return NULL;
    size_t mask = t->nss_cap - 1;
    for (size_t i = tier_mix(seed) & mask;; i = (i + 1) & mask) {
        if (!t->nss[i].bytes)
            return NULL;
        if (t->nss[i].seed == seed)
            return &t->nss[i];
    }
}

static uint64_t ns_bytes(const kvt_tier_t *t, uint64_t seed)
{
    const struct kvt__tier_ns *n = ns_find(t, seed);
    return n ? n->bytes : 0;
}

/* Counts bytes more for seed. Returns 0 or KVT_ENOMEM (the table could not grow). */
static int ns_charge(kvt_tier_t *t, uint64_t seed, uint64_t bytes)
{
    struct kvt__tier_ns *n = ns_find(t, seed);
    if (n) {
        n->bytes += bytes;
        return 0;
    }
    if ((t->nss_n + 1) * 4 > t->nss_cap * 3) {
        size_t cap = t->nss_cap ? t->nss_cap * 2 : 16;
        struct kvt__tier_ns *v = calloc(cap, sizeof(*v));
        if (!v)
            return KVT_ENOMEM;
        for (size_t i = 0; i < t->nss_cap; i++) {
            if (!t->nss[i].bytes)
                continue;
            size_t j = tier_mix(t->nss[i].seed) & (cap - 1);
            while (v[j].bytes)
                j = (j + 1) & (cap - 1);
            v[j] = t->nss[i];
        }
        free(t->nss);
        t->nss = v;
        t->nss_cap = cap;
    }
    size_t mask = t->nss_cap - 1, i = tier_mix(seed) & mask;
    while (t->nss[i].bytes)
        i = (i + 1) & mask;
    t->nss[i] = (struct kvt__tier_ns){.seed = seed, .bytes = bytes};
    t->nss_n++;
    return 0;
}

static void ns_uncharge(kvt_tier_t *t, uint64_t seed, uint64_t bytes)
{
    struct kvt__tier_ns *n = ns_find(t, seed);
    kvt_assert(n && n->bytes >= bytes);
    if ((n->bytes -= bytes) > 0)
        return;
    size_t mask = t->nss_cap - 1, hole = (size_t)(n - t->nss), i = hole;
    t->nss_n--;
    for (;;) {
        i = (i + 1) & mask;
        if (!t->nss[i].bytes)
            break;
        size_t home = tier_mix(t->nss[i].seed) & mask;
        int stays = hole <= i ? (home > hole && home <= i) : (home > hole || home <= i);
        if (!stays) {
            t->nss[hole] = t->nss[i];
            t->nss[i].bytes = 0;
            hole = i;
        }
    }
}

/* Gives back a charge taken by tier_reserve. */
static void tier_uncharge(kvt_tier_t *t, uint64_t seed, uint64_t charge)
{
    kvt_assert(t->usage.used_bytes >= charge);
    t->usage.used_bytes -= charge;
    ns_uncharge(t, seed, charge);
}

void kvt__tier_foreach(const kvt_tier_t *t, void (*fn)(void *arg, const kvt__tier_ent_t *e),
                       void *arg)
{
    for (size_t i = 0; i < t->ents_cap; i++)
        if (t->ents[i].used)
            fn(arg, &t->ents[i]);
}

/* ---- construction ---- */

int kvt__tier_init(kvt_tier_t **out, kvt_tier_id_t kind, const kvt_tier_ops_t *ops, void *impl,
                   uint64_t capacity_bytes)
{
    if (!out || !ops || !ops->write || !ops->read || !ops->free || !ops->destroy)
        return KVT_EINVAL;
    kvt_tier_t *t = calloc(1, sizeof(*t));
    if (!t)
        return KVT_ENOMEM;
    t->ops = ops;
    t->kind = kind;
    t->impl = impl;
    t->usage.capacity_bytes = capacity_bytes;
    t->efd = t->pfd = t->bfd = -1;
    t->delivered = 1;
    int rc = tier_index_reserve(t, 0);
    if (rc < 0)
        goto fail;
    t->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    t->pfd = epoll_create1(EPOLL_CLOEXEC);
    if (t->efd < 0 || t->pfd < 0) {
        rc = -errno;
        goto fail;
    }
    struct epoll_event ev = {.events = EPOLLIN, .data.fd = t->efd};
    if (epoll_ctl(t->pfd, EPOLL_CTL_ADD, t->efd, &ev) < 0) {
        rc = -errno;
        goto fail;
    }
    if (ops->fd) {
        int bfd = ops->fd(t);
        if (bfd >= 0 && (rc = kvt__tier_watch_fd(t, bfd)) < 0)
            goto fail;
    }
    *out = t;
    return 0;
fail:
    if (t->efd >= 0)
        close(t->efd);
    if (t->pfd >= 0)
        close(t->pfd);
    free(t->ents);
    free(t);
    return rc;
}

int kvt__tier_watch_fd(kvt_tier_t *t, int fd)
{
    struct epoll_event ev = {.events = EPOLLIN, .data.fd = fd};
    if (epoll_ctl(t->pfd, EPOLL_CTL_ADD, fd, &ev) < 0)
        return -errno;
    t->bfd = fd;
    return 0;
}

/* ---- completions ---- */

static void tier_count(kvt_tier_t *t, kvt_tier_io_t *io)
{
    kvt_tier_usage_t *u = &t->usage;
    switch (io->status) {
    case 0:
        if (io->op == KVT_IO_READ) {
            u->reads++;
            u->read_bytes += io->len;
        } else {
            u->writes++;
            u->written_bytes += io->len;
        }
        break;
    case KVT_ENOENT:
        u->misses++;
        break;
    case KVT_ECORRUPT:
        u->corrupt++;
        break;
    case KVT_ETIMEDOUT:
        u->timeouts++;
        break;
    default:
        u->errors++;
        break;
    }
}

void kvt__tier_complete(kvt_tier_t *t, kvt_tier_io_t *io, int status)
{
    kvt_assert(io->tier == t);
    io->status = status;
    if (status)
        io->unchecked = 0; /* a tier may fail a read after its header passed (remote: a drop) */
    if (io->op == KVT_IO_WRITE) {
        kvt_assert(t->pending_writes > 0);
        t->pending_writes--;
        if (status == 0) {
            tier_index_add(t, io->loc, &io->key, io->len, io->charge);
        } else {
            tier_uncharge(t, io->key.ns_seed, io->charge);
            io->loc = 0;
        }
    }
    tier_count(t, io);
    io->next = NULL;
    int was_empty = t->done_head == NULL;
    if (t->done_tail)
        t->done_tail->next = io;
    else
        t->done_head = io;
    t->done_tail = io;
    if (was_empty) {
        uint64_t one = 1;
        /* An eventfd write only fails when the counter would overflow: it is readable then. */
        ssize_t n = write(t->efd, &one, sizeof(one));
        (void)n;
    }
}

void kvt__tier_kick(kvt_tier_t *t)
{
    uint64_t one = 1;
    ssize_t n = write(t->efd, &one, sizeof(one)); /* fails only when already readable */
    (void)n;
}

static void copy_abandon(kvt_tier_io_t *io);
static void copy_read_done(kvt_tier_io_t *io);
static void copy_write_done(kvt_tier_io_t *io);

int kvt_tier_process(kvt_tier_t *t)
{
    if (!t)
        return KVT_EINVAL;
    uint64_t v;
    ssize_t n = read(t->efd, &v, sizeof(v));
    (void)n;
    if (t->ops->poll) {
        int rc = t->ops->poll(t);
        if (rc < 0)
            return rc;
    }
    kvt_tier_io_t *io = t->done_head;
    t->done_head = t->done_tail = NULL;
    int ran = 0;
    while (io) {
        kvt_tier_io_t *next = io->next;
        kvt_assert(t->usage.inflight > 0);
        t->usage.inflight--;
        io->next = NULL;
        if (t->delivered && io->cb)
            io->cb(io);
        else if (io->cb == copy_read_done || io->cb == copy_write_done)
            copy_abandon(io);
        ran++;
        io = next;
    }
    return ran;
}

int kvt_tier_wait(kvt_tier_t *t, int timeout_ms)
{
    if (!t)
        return KVT_EINVAL;
    if (!t->done_head) {
        struct epoll_event ev;
        int n;
        do {
            n = epoll_wait(t->pfd, &ev, 1, timeout_ms);
        } while (n < 0 && errno == EINTR);
        if (n < 0)
            return -errno;
    }
    return kvt_tier_process(t);
}

int kvt_tier_fd(kvt_tier_t *t)
{
    return t ? t->pfd : KVT_EINVAL;
}

/* ---- submission ---- */

static int tier_key_ok(const kvt_block_key_t *k)
{
    return k->ntokens <= KVT_PAGE_MAX && (k->ntokens == 0 || k->tokens);
}

uint64_t kvt_tier_footprint(const kvt_tier_t *t, uint32_t len)
{
    if (!t || len == 0 || len > KVT_TIER_MAX_BLOCK)
        return 0;
    return t->ops->footprint ? t->ops->footprint(t, len) : len;
}

static void tier_io_start(kvt_tier_t *t, kvt_tier_io_t *io, kvt_io_op_t op)
{
    io->op = op;
    io->tier = t;
    io->next = NULL;
    io->status = 0;
    io->unchecked = 0;
    io->submit_ns = kvt_now_ns();
}

/* A write whose footprint `charge` is already counted in used_bytes. On error the charge is
 * given back. */
static int tier_write_charged(kvt_tier_t *t, kvt_tier_io_t *io, uint64_t charge)
{
    int rc = tier_index_reserve(t, 1);
    if (rc == 0) {
        tier_io_start(t, io, KVT_IO_WRITE);
        io->charge = charge;
        io->loc = 0;
        t->pending_writes++;
        t->usage.inflight++;
        rc = t->ops->write(t, io);
        if (rc < 0) {
            t->pending_writes--;
            t->usage.inflight--;
            io->tier = NULL;
        }
    }
    if (rc < 0)
        tier_uncharge(t, io->key.ns_seed, charge);
    return rc;
}

/* Charges a payload of len bytes of namespace seed: within the capacity and the namespace's
 * quota (KVT_ENOSPC otherwise, a quota's refusal counted). */
static int tier_reserve(kvt_tier_t *t, uint64_t seed, uint32_t len, uint64_t *charge)
{
    uint64_t fp = kvt_tier_footprint(t, len);
    if (fp == 0)
        return KVT_EINVAL;
    if (fp > t->usage.capacity_bytes - t->usage.used_bytes)
        return KVT_ENOSPC;
    if (t->ns_quota && ns_bytes(t, seed) + fp > t->ns_quota) {
        t->usage.quota_refused++;
        return KVT_ENOSPC;
    }
    if (ns_charge(t, seed, fp) < 0)
        return KVT_ENOMEM;
    t->usage.used_bytes += fp;
    *charge = fp;
    return 0;
}

int kvt_tier_write(kvt_tier_t *t, kvt_tier_io_t *io)
{
    /* buf NULL only for DRAM: a zero-copy PUT's reservation (tier.h). */
    if (!t || !io || (!io->buf && t->kind != KVT_TIER_DRAM) || !tier_key_ok(&io->key))
        return KVT_EINVAL;
    uint64_t charge;
    int rc = tier_reserve(t, io->key.ns_seed, io->len, &charge);
    if (rc < 0)
        return rc;
    return tier_write_charged(t, io, charge);
}

int kvt_tier_write_prepare(kvt_tier_t *t, kvt_tier_io_t *io)
{
    if (!t || !io || !io->buf || io->len == 0 || io->len > KVT_TIER_MAX_BLOCK ||
        !tier_key_ok(&io->key))
        return KVT_EINVAL;
    return t->ops->prepare ? t->ops->prepare(t, io) : 0;
}

int kvt_tier_read(kvt_tier_t *t, kvt_tier_io_t *io)
{
    if (!t || !io || !io->buf || io->len == 0 || io->len > KVT_TIER_MAX_BLOCK ||
        !tier_key_ok(&io->key))
        return KVT_EINVAL;
    const kvt__tier_ent_t *e = tier_find(t, io->loc);
    tier_io_start(t, io, KVT_IO_READ);
    if (!t->ops->unindexed_reads || e) {
        if (!e || e->hash != io->key.hash || e->ns_seed != io->key.ns_seed) {
            /* A miss, delivered like any completion. */
            t->usage.inflight++;
            kvt__tier_complete(t, io, KVT_ENOENT);
            return 0;
        }
        if (e->len != io->len) {
            io->tier = NULL;
            return KVT_EINVAL;
        }
    }
    t->usage.inflight++;
    int rc = t->ops->read(t, io);
    if (rc < 0) {
        t->usage.inflight--;
        io->tier = NULL;
    }
    return rc;
}

int kvt__tier_checks_later(const kvt_tier_io_t *io)
{
    return io->check_later && io->key.tokens;
}

int kvt__tier_read_verify(kvt_tier_io_t *io, const void *hdr, size_t hdr_avail, const void *payload)
{
    if (!kvt__tier_checks_later(io)) {
        uint32_t len = 0;
        int rc = kvt__blockhdr_verify(hdr, hdr_avail, payload, io->len, &io->key, &len);
        return rc == 0 && len == io->len ? 0 : KVT_ECORRUPT;
    }
    kvt__blockhdr_kept_t kept;
    if (kvt__blockhdr_verify_head(hdr, hdr_avail, &io->key, io->len, &kept) < 0)
        return KVT_ECORRUPT;
    memcpy(io->priv, &kept, sizeof kept);
    io->unchecked = 1;
    return 0;
}

int kvt_tier_read_check(kvt_tier_io_t *io)
{
    if (!io)
        return KVT_EINVAL;
    if (!io->unchecked || io->status < 0)
        return io->status;
    kvt__blockhdr_kept_t kept;
    memcpy(&kept, io->priv, sizeof kept); /* the tier's completion put it there */
    if (kvt__blockhdr_verify_kept(&kept, &io->key, io->buf, io->len) < 0) {
        memset(io->buf, 0, io->len); /* a miss never hands out bytes */
        io->status = KVT_ECORRUPT;
    }
    return io->status;
}

void kvt_tier_read_corrupt(kvt_tier_t *t, const kvt_tier_io_t *io)
{
    if (!t || !io || io->tier != t || io->op != KVT_IO_READ || !io->unchecked ||
        io->status != KVT_ECORRUPT)
        return;
    t->usage.reads--;
    t->usage.read_bytes -= io->len;
    t->usage.corrupt++;
    if (t->ops->read_corrupt)
        t->ops->read_corrupt(t, io);
}

static void tier_free(kvt_tier_t *t, uint64_t loc, uint32_t len, int discard)
{
    if (!t)
        return;
    kvt__tier_ent_t *e = tier_find(t, loc);
    if (!e || (len && e->len != len))
        return;
    uint32_t elen = e->len;
    tier_uncharge(t, e->ns_seed, e->charge);
    tier_index_del(t, e);
    if (discard && t->ops->discard)
        t->ops->discard(t, loc, elen);
    else
        t->ops->free(t, loc, elen);
}

void kvt_tier_free(kvt_tier_t *t, uint64_t loc, uint32_t len)
{
    tier_free(t, loc, len, 0);
}

void kvt_tier_discard(kvt_tier_t *t, uint64_t loc, uint32_t len)
{
    tier_free(t, loc, len, 1);
}

int kvt__tier_adopt(kvt_tier_t *t, uint64_t loc, const kvt_block_key_t *key, uint32_t len)
{
    if (loc == 0)
        return KVT_EINVAL;
    if (tier_find(t, loc))
        return KVT_EEXIST;
    uint64_t charge;
    int rc = tier_reserve(t, key->ns_seed, len, &charge);
    if (rc < 0)
        return rc;
    if ((rc = tier_index_reserve(t, 1)) < 0) {
        tier_uncharge(t, key->ns_seed, charge);
        return rc;
    }
    tier_index_add(t, loc, key, len, charge);
    return 0;
}

void kvt__tier_drop(kvt_tier_t *t, uint64_t loc)
{
    kvt__tier_ent_t *e = tier_find(t, loc);
    if (!e)
        return;
    tier_uncharge(t, e->ns_seed, e->charge);
    tier_index_del(t, e);
    t->usage.reclaimed++;
}

void kvt__tier_forget(kvt_tier_t *t, uint64_t loc)
{
    kvt__tier_ent_t *e = tier_find(t, loc);
    if (!e)
        return;
    tier_uncharge(t, e->ns_seed, e->charge);
    tier_index_del(t, e);
}

void kvt__tier_relocate(kvt_tier_t *t, uint64_t loc, uint64_t to)
{
    kvt__tier_ent_t *e = tier_find(t, loc);
    kvt_assert(e && to != 0 && !tier_find(t, to));
    kvt__tier_ent_t moved = *e;
    moved.loc = to;
    tier_index_del(t, e);
    tier_place(t->ents, t->ents_cap, &moved); /* a slot just freed: no growth needed */
    t->usage.blocks++;
}

int kvt_tier_valid(kvt_tier_t *t, uint64_t loc, const kvt_block_key_t *key)
{
    if (!t || !key)
        return 0;
    const kvt__tier_ent_t *e = tier_find(t, loc);
    if (!e || e->hash != key->hash || e->ns_seed != key->ns_seed)
        return 0;
    return t->ops->valid ? t->ops->valid(t, loc, key) : 1;
}

int kvt_tier_pin(kvt_tier_t *t, uint64_t loc, int delta)
{
    if (!t || !t->ops->pin || delta == 0)
        return 0;
    if (delta > 0 && !tier_find(t, loc))
        return KVT_ENOENT;
    return t->ops->pin(t, loc, delta);
}

void *kvt_tier_ptr(kvt_tier_t *t, uint64_t loc)
{
    if (!t || !t->ops->ptr || !tier_find(t, loc))
        return NULL;
    return t->ops->ptr(t, loc);
}

int kvt_tier_set_ns_quota(kvt_tier_t *t, uint64_t bytes)
{
    if (!t)
        return KVT_EINVAL;
    t->ns_quota = bytes;
    return 0;
}

uint64_t kvt_tier_ns_used(const kvt_tier_t *t, uint64_t ns_seed)
{
    return t ? ns_bytes(t, ns_seed) : 0;
}

int kvt_tier_ns_fits(kvt_tier_t *t, uint64_t ns_seed, uint32_t len, uint32_t n)
{
    if (!t)
        return 0;
    if (!t->ns_quota ||
        ns_bytes(t, ns_seed) + (uint64_t)n * kvt_tier_footprint(t, len) <= t->ns_quota)
        return 1;
    t->usage.quota_refused++;
    return 0;
}

size_t kvt_tier_ns_top(const kvt_tier_t *t, kvt_tier_ns_usage_t *out, size_t max)
{
    size_t n = 0;
    for (size_t i = 0; t && max && i < t->nss_cap; i++) {
        if (!t->nss[i].bytes)
            continue;
        kvt_tier_ns_usage_t u = {.ns_seed = t->nss[i].seed, .bytes = t->nss[i].bytes};
        if (n == max && u.bytes <= out[n - 1].bytes)
            continue;
        size_t j = n < max ? n++ : n - 1; /* insertion into the sorted list, largest first */
        while (j > 0 && out[j - 1].bytes < u.bytes) {
            out[j] = out[j - 1];
            j--;
        }
        out[j] = u;
    }
    return n;
}

void kvt_tier_usage(const kvt_tier_t *t, kvt_tier_usage_t *u)
{
    if (t && u)
        *u = t->usage;
}

uint64_t kvt_tier_dropped(const kvt_tier_t *t)
{
    if (!t)
        return 0;
    return t->usage.reclaimed + (t->ops->drops_corrupt ? 0 : t->usage.corrupt);
}

kvt_tier_id_t kvt_tier_kind(const kvt_tier_t *t)
{
    return t ? t->kind : KVT_TIER_NONE;
}

const char *kvt_tier_backend(const kvt_tier_t *t)
{
    return t ? t->ops->backend : "none";
}

void kvt_tier_destroy(kvt_tier_t *t)
{
    if (!t)
        return;
    /* Let in-flight requests finish without calling anyone back: their buffers may already be
     * gone, but the backend must not be torn down under the kernel or the device. */
    t->delivered = 0;
    while (t->usage.inflight > 0) {
        if (!t->done_head) {
            struct epoll_event ev;
            (void)epoll_wait(t->pfd, &ev, 1, 10);
        }
        if (kvt_tier_process(t) < 0)
            break;
    }
    t->ops->destroy(t);
    close(t->efd);
    close(t->pfd);
    free(t->ents);
    free(t->nss);
    free(t);
}

/* ---- copies between tiers ---- */

#if KVT_HAVE_CUDA
/* Pinned staging. cudaHostAlloc pins pages at a cost of a millisecond or more for megabytes, so
 * freed staging buffers wait in a small cache, by size rounded up to a power of two, while any
 * CUDA tier is open (kvt__pinned_open); the last one to close empties it. A buffer handed back
 * after that is freed at once. Thread-safe: tiers of different threads share it. */
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

static void *pinned_get(size_t sz)
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

static void pinned_put(void *p, size_t sz)
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

void kvt__pinned_open(void)
{
    pthread_mutex_lock(&pin_lock);
    pin_tiers++;
    pthread_mutex_unlock(&pin_lock);
}

void kvt__pinned_close(void)
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
#endif

/* The staging buffer for a copy whose source has no memory to write from: sector-aligned so
 * that an NVMe side moves it without a bounce, and pinned when either side is a CUDA tier. */
static size_t copy_staging_size(const kvt_tier_copy_t *c)
{
    return ((size_t)c->len + 4095) & ~(size_t)4095;
}

static int copy_stage(kvt_tier_copy_t *c)
{
    size_t sz = copy_staging_size(c);
    c->staging = NULL;
    c->staging_pinned = 0;
#if KVT_HAVE_CUDA
    if (c->src->ops->pinned_staging || c->dst->ops->pinned_staging) {
        c->staging = pinned_get(sz);
        if (!c->staging)
            return KVT_ENOMEM;
        c->staging_pinned = 1;
        return 0;
    }
#endif
    if (posix_memalign(&c->staging, 4096, sz) != 0) {
        c->staging = NULL;
        return KVT_ENOMEM;
    }
    return 0;
}

static void copy_unstage(kvt_tier_copy_t *c)
{
    if (!c->staging)
        return;
#if KVT_HAVE_CUDA
    if (c->staging_pinned)
        pinned_put(c->staging, copy_staging_size(c));
    else
        free(c->staging);
#else
    free(c->staging);
#endif
    c->staging = NULL;
    c->staging_pinned = 0;
}

static void copy_finish(kvt_tier_copy_t *c, int status)
{
    copy_unstage(c);
    c->status = status;
    c->dst_loc = status == 0 ? c->io.loc : 0;
    if (c->cb)
        c->cb(c);
}

static void copy_write_done(kvt_tier_io_t *io)
{
    copy_finish(io->data, io->status);
}

static void copy_read_done(kvt_tier_io_t *io)
{
    kvt_tier_copy_t *c = io->data;
    uint64_t charge = io->charge;
    if (io->status < 0) {
        tier_uncharge(c->dst, c->key.ns_seed, charge);
        copy_finish(c, io->status);
        return;
    }
    io->cb = copy_write_done;
    int rc = tier_write_charged(c->dst, io, charge);
    if (rc < 0)
        copy_finish(c, rc);
}

int kvt_tier_copy(kvt_tier_copy_t *c)
{
    if (!c || !c->src || !c->dst || c->src == c->dst || c->len == 0 ||
        c->len > KVT_TIER_MAX_BLOCK || !tier_key_ok(&c->key))
        return KVT_EINVAL;
    const kvt__tier_ent_t *e = tier_find(c->src, c->src_loc);
    if (!c->src->ops->unindexed_reads &&
        (!e || e->hash != c->key.hash || e->ns_seed != c->key.ns_seed || e->len != c->len))
        return KVT_ENOENT;
    uint64_t charge;
    int rc = tier_reserve(c->dst, c->key.ns_seed, c->len, &charge);
    if (rc < 0)
        return rc;
    c->status = 0;
    c->dst_loc = 0;
    c->staging = NULL;
    memset(&c->io, 0, sizeof(c->io));
    c->io.key = c->key;
    c->io.len = c->len;
    c->io.data = c;
    c->io.device = c->dst_device;

    void *src_mem = kvt_tier_ptr(c->src, c->src_loc);
    if (src_mem) {
        c->io.buf = src_mem;
        c->io.cb = copy_write_done;
        return tier_write_charged(c->dst, &c->io, charge);
    }
    if ((rc = copy_stage(c)) < 0) {
        tier_uncharge(c->dst, c->key.ns_seed, charge);
        return rc;
    }
    c->io.buf = c->staging;
    c->io.loc = c->src_loc;
    c->io.cb = copy_read_done;
    c->io.charge = charge; /* the dst reservation, carried across the read */
    rc = kvt_tier_read(c->src, &c->io);
    if (rc < 0) {
        copy_unstage(c);
        tier_uncharge(c->dst, c->key.ns_seed, charge);
    }
    return rc;
}

/* A copy's request finished while the tier it ran on is being destroyed: no callback runs, but
 * the staging buffer is freed and, when it was the read from src, the reservation in dst is
 * given back (dst outlives the copy: see tier.h). */
static void copy_abandon(kvt_tier_io_t *io)
{
    kvt_tier_copy_t *c = io->data;
    if (io->cb == copy_read_done)
        tier_uncharge(c->dst, c->key.ns_seed, io->charge);
    copy_unstage(c);
    c->status = io->status < 0 ? io->status : KVT_ECLOSED;
    c->dst_loc = 0;
}
