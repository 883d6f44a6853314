/*
 * nvme.c: the NVMe tier. One preallocated data file, DIR/kvtier.data, used as a log of
 * fixed-size segments and driven by io_uring with O_DIRECT (buffered where the file system
 * refuses O_DIRECT, logged once). This file owns the on-disk layout, the segment table, the
 * io_uring request slots, and the recovery scan that runs at creation; nvme_recover.c hands the
 * recovered blocks to the owner of the index.
 *
 * On disk
 * -------
 *   kvtier.data:  | segment 0 | segment 1 | ... | segment n-1 |       (segment_bytes each)
 *   a segment:    | record | record | ... | (unused tail) |
 *   a record:     | prefix 32 | block header + tokens | pad | payload | pad |
 *                 '--------- header region: 4 or 8 KiB ------''- len rounded to 4 KiB -'
 *
 *   kvtier.live:  | header 4 KiB | entry 0 | entry 1 | ... | entry n-1 | (pad to 4 KiB)
 *   an entry:     | stamp 8 | bitmap: one bit per 4 KiB sector of the segment |
 *   kvtier.meta:  "kvtier-nvme v2 segment_bytes=S segments=N\n"
 *
 * The 32-byte prefix holds a magic, the record's size in sectors, the header region's size,
 * and the stamp of the segment's current use (64 random bits drawn when the segment was opened
 * for writing), with its own checksum. The block header (blockhdr.c) carries the namespace,
 * prefix hash, parent hash, tokens, payload length, a sequence number and the XXH3 checksum of
 * it all; a PUT has it computed on its own loop with no lock held (kvt_tier_write_prepare), so
 * that the write's start under the lock only encodes the header. The payload starts on a sector
 * boundary so that a 4 KiB-aligned caller buffer is read and written in place (readv/writev: header
 * region, the buffer, and a bounce sector for a partial last sector).
 *
 * Segments and locations
 * ----------------------
 * Writes append to the open segment. A full segment becomes FREE again when its last live block
 * is freed; when no segment is free, the full one with the fewest live bytes (and no I/O in
 * flight) is reclaimed whole: its live blocks are dropped (usage.reclaimed) and its generation
 * bumps. A location packs segment, generation, sector offset and header-region size, so a
 * location from an earlier use of a segment reads as a miss:
 *
 *   63        40 39        20 19    18 17          0
 *   | gen (24)  | segment(20)| hdr(2) | sector (18) |
 *
 * Live blocks
 * -----------
 * A record outlives its block: a free (the policy's drop, a move's old copy, a REMOVE) and a
 * segment reclaim leave its bytes where they are until the segment is written again. What says
 * which records hold live blocks is kvtier.live, mapped shared into memory. Each segment has an
 * entry: the stamp of its current use (0: none) and a bit for every sector that starts the
 * record of a live block (bit k of byte k / 8, least significant first). A write's bit is set
 * when it has completed, before its callback runs; a free clears it; a segment's entry is zeroed
 * when the segment is freed or reclaimed and takes the new stamp when it is opened. Those are
 * stores to memory, no system call on any path, and the mapped pages are the kernel's page
 * cache: a process that dies (SIGKILL) leaves the live set of its last instant. The kernel
 * writes the pages back in its own time; destroying the tier msyncs them. (memcached's extstore
 * keeps a page version in each location and checks it against the page; here the page's entry
 * keeps which of its locations are live, because after a restart nothing else is left to ask.)
 * The header: "KVTLIVE1", u32 version 1, u32 segment bytes, u32 segments, u32 entry bytes, u64
 * XXH3 of the 24 bytes before it, all little-endian; kvtier.meta's v2 says the map exists.
 *
 * Recovery
 * --------
 * Opening a directory whose data file has the recorded geometry (DIR/kvtier.meta) scans every
 * segment whose kvtier.live entry has a live bit, from its start: records follow one another
 * while their prefix is intact and carries the entry's stamp; only those whose bit is set are
 * read (the others' blocks were dropped before the stop), and one whose block checksum fails (a
 * torn write) is skipped. Where the records stop, the rest of the segment is searched sector by
 * sector for a prefix with the same stamp (recovery's gaps): writes complete out of order, and a
 * crash cancels the ones still queued, so a record may be missing with later ones intact. That
 * search reads the unused tail of every partly filled segment; the open segment's first record
 * is the one a scan cannot do without (a segment whose first record never landed is empty to
 * it), so no other write starts in a segment until its first record has completed, and a
 * segment whose first record failed takes no other (the next write opens another). When one
 * block was written several times, the highest sequence number wins. Recovered segments are not
 * appended to again until they are reclaimed. The map is rebuilt from what was adopted.
 *
 * A directory from before kvtier.live (kvtier.meta v1) is recovered as it was then: every
 * intact record (the first record's stamp names the segment's use; records a REMOVE marked
 * with a discarded flag are stepped over), the newest copy of each block, adopted newest first
 * until the tier is full. It is then given its map and kvtier.meta becomes v2. Blocks freed
 * before that stop may come back that once, as they always did.
 *
 * Durability is that of a cache: writes are not fdatasync'd, so a process crash (SIGKILL) loses
 * nothing that completed, while a power cut may lose recent writes (which recovery then skips)
 * and, where the map's pages had not reached the disk, bring back blocks dropped shortly before.
 */
#define _GNU_SOURCE
#define XXH_STATIC_LINKING_ONLY
#include "nvme_impl.h"

#include <errno.h>
#include <fcntl.h>
#include <liburing.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#define SECTOR        4096u
#define PREFIX_BYTES  32u
#define PREFIX_MAGIC  0x5254564bu /* "KVTR" */
#define HDR_MAX_BYTES (2 * SECTOR)
#define META_VERSION  2u /* kvtier.meta's: 2 since kvtier.live */
#define LIVE_MAGIC    "KVTLIVE1"
#define LIVE_HDR      SECTOR
/* The recovery scan reads a segment through one buffer of HDR_MAX_BYTES + SCAN_CHUNK bytes,
 * whatever the segment size (up to 1 GiB): a longer record's payload, or a longer stretch
 * searched for the next record, is read a chunk at a time, so that recovery's memory stays
 * about 1 MiB. */
#define SCAN_CHUNK (1u << 20)

_Static_assert(SECTOR == KVT_TIER_DIRECT_ALIGN, "a caller's aligned buffer is read in place");

/* The smallest segment, and what segment sizes are multiples of. The fuzz build (meson.build)
 * lowers it to 64 KiB so that the NVMe harnesses' data file is small enough to be laid out and
 * scanned thousands of times a second: nothing in the layout depends on it. */
#ifndef KVT_NVME_SEG_MIN
#define KVT_NVME_SEG_MIN (1u << 20)
#endif

static uint32_t round_sector(uint64_t n)
{
    return (uint32_t)((n + SECTOR - 1) & ~(uint64_t)(SECTOR - 1));
}

static uint32_t hdr_region(uint32_t ntokens)
{
    return round_sector(PREFIX_BYTES + kvt__blockhdr_size(ntokens));
}

uint64_t kvt__nvme_loc(uint32_t seg, uint32_t gen, uint32_t hdr_sectors, uint32_t sector)
{
    return (uint64_t)(gen & 0xffffffu) << 40 | (uint64_t)seg << 20 | (uint64_t)hdr_sectors << 18 |
           sector;
}

static uint32_t loc_seg(uint64_t loc)
{
    return (uint32_t)(loc >> 20) & 0xfffffu;
}

static uint32_t loc_gen(uint64_t loc)
{
    return (uint32_t)(loc >> 40) & 0xffffffu;
}

static uint32_t loc_hdr(uint64_t loc)
{
    return ((uint32_t)(loc >> 18) & 3u) * SECTOR;
}

static uint64_t loc_off(const nvme_t *n, uint64_t loc)
{
    return (uint64_t)loc_seg(loc) * n->seg_bytes + (uint64_t)(loc & 0x3ffffu) * SECTOR;
}

static uint32_t rec_bytes(uint32_t hdr, uint32_t len)
{
    return hdr + round_sector(len);
}

/* ---- the record prefix ---- */

/* flags: the record's block was removed (a tombstone, written by versions before kvtier.live;
 * still stepped over in the logs they left) */
#define PREFIX_DISCARDED 1u

static void prefix_encode(uint8_t *p, uint32_t rec, uint32_t hdr, uint64_t stamp, uint32_t flags)
{
    kvt_put_u32(p, PREFIX_MAGIC);
    kvt_put_u32(p + 4, rec / SECTOR);
    kvt_put_u64(p + 8, stamp);
    kvt_put_u32(p + 16, hdr / SECTOR);
    kvt_put_u32(p + 20, flags);
    kvt_put_u64(p + 24, XXH3_64bits(p, 24));
}

/* Returns 0 and the record and header sizes, 1 and the same for the intact prefix of a
 * discarded record, or -1 when p is not an intact prefix. */
static int prefix_decode(const uint8_t *p, uint32_t *rec, uint32_t *hdr, uint64_t *stamp)
{
    if (kvt_get_u32(p) != PREFIX_MAGIC || kvt_get_u64(p + 24) != XXH3_64bits(p, 24))
        return -1;
    *rec = kvt_get_u32(p + 4) * SECTOR;
    *hdr = kvt_get_u32(p + 16) * SECTOR;
    *stamp = kvt_get_u64(p + 8);
    if (*hdr == 0 || *hdr > HDR_MAX_BYTES || *rec < *hdr)
        return -1;
    return (kvt_get_u32(p + 20) & PREFIX_DISCARDED) != 0;
}

/* ---- kvtier.live: which records hold live blocks ---- */

static uint8_t *live_entry(const nvme_t *n, uint32_t seg)
{
    return n->live + LIVE_HDR + (size_t)seg * n->live_entry;
}

/* Marks the record at loc as a live block's (on) or not. */
static void live_mark(nvme_t *n, uint64_t loc, int on)
{
    uint32_t sector = (uint32_t)(loc & 0x3ffffu);
    uint8_t *bits = live_entry(n, loc_seg(loc)) + 8, bit = (uint8_t)(1u << (sector & 7));
    if (on)
        bits[sector >> 3] |= bit;
    else
        bits[sector >> 3] &= (uint8_t)~bit;
}

static int live_bit(const nvme_t *n, uint32_t seg, uint32_t sector)
{
    return (live_entry(n, seg)[8 + (sector >> 3)] >> (sector & 7)) & 1;
}

/* Whether the entry of seg has any live record. */
static int live_any(const nvme_t *n, uint32_t seg)
{
    const uint8_t *bits = live_entry(n, seg) + 8;
    for (uint32_t i = 0; i < n->live_entry - 8; i++)
        if (bits[i])
            return 1;
    return 0;
}

/* A segment's entry for a new use (stamp) or for none (0): no live record in it. */
static void live_reset(nvme_t *n, uint32_t seg, uint64_t stamp)
{
    uint8_t *e = live_entry(n, seg);
    memset(e + 8, 0, n->live_entry - 8);
    kvt_put_u64(e, stamp);
}

/* ---- segments ---- */

static uint64_t new_stamp(void)
{
    uint64_t s = 0;
    while (s == 0) {
        if (getrandom(&s, sizeof(s), 0) != (ssize_t)sizeof(s))
            s = kvt_now_ns() ^ ((uint64_t)getpid() << 32);
    }
    return s;
}

static void seg_set_free(nvme_t *n, uint32_t i)
{
    nvme_seg_t *s = &n->segs[i];
    kvt_assert(s->live_blocks == 0 && s->inflight == 0);
    s->state = SEG_FREE;
    s->head = 0;
    s->live_bytes = 0;
    s->pins = 0; /* pins of freed blocks: their unpins see another generation */
    s->nlocs = 0;
    s->gen = (s->gen + 1) & 0xffffffu;
    if (s->gen == 0)
        s->gen = 1;
    live_reset(n, i, 0); /* its blocks, freed or reclaimed, never come back */
}

/* A FULL segment whose blocks are all gone and whose I/O is done is free again. */
static void seg_maybe_free(nvme_t *n, uint32_t i)
{
    nvme_seg_t *s = &n->segs[i];
    if (s->state == SEG_FULL && s->live_blocks == 0 && s->inflight == 0)
        seg_set_free(n, i);
}

static int seg_note_loc(nvme_seg_t *s, uint64_t loc)
{
    if (s->nlocs == s->locs_cap) {
        uint32_t cap = s->locs_cap ? s->locs_cap * 2 : 64;
        uint64_t *nl = realloc(s->locs, cap * sizeof(*nl));
        if (!nl)
            return KVT_ENOMEM;
        s->locs = nl;
        s->locs_cap = cap;
    }
    s->locs[s->nlocs++] = loc;
    return 0;
}

static void seg_live_add(nvme_t *n, uint64_t loc, uint32_t len)
{
    nvme_seg_t *s = &n->segs[loc_seg(loc)];
    s->live_blocks++;
    s->live_bytes += rec_bytes(loc_hdr(loc), len);
}

static void seg_live_sub(nvme_t *n, uint64_t loc, uint32_t len)
{
    nvme_seg_t *s = &n->segs[loc_seg(loc)];
    kvt_assert(s->live_blocks > 0);
    s->live_blocks--;
    s->live_bytes -= rec_bytes(loc_hdr(loc), len);
}

/* Reclaims the full segment with the fewest live bytes, no I/O in flight and no pins. */
static int seg_reclaim(nvme_t *n)
{
    uint32_t best = UINT32_MAX;
    for (uint32_t i = 0; i < n->nsegs; i++) {
        const nvme_seg_t *s = &n->segs[i];
        if (s->state == SEG_FULL && s->inflight == 0 && s->pins == 0 &&
            (best == UINT32_MAX || s->live_bytes < n->segs[best].live_bytes))
            best = i;
    }
    if (best == UINT32_MAX)
        return KVT_EAGAIN;
    nvme_seg_t *s = &n->segs[best];
    for (uint32_t k = 0; k < s->nlocs; k++) {
        const kvt__tier_ent_t *e = kvt__tier_lookup(n->tier, s->locs[k]);
        if (e) {
            uint64_t loc = e->loc, ns_seed = e->ns_seed, hash = e->hash;
            seg_live_sub(n, e->loc, e->len);
            kvt__tier_drop(n->tier, loc);
            if (n->reclaim_cb)
                n->reclaim_cb(n->reclaim_arg, loc, ns_seed, hash);
        }
    }
    seg_set_free(n, best);
    return 0;
}

static int seg_open_next(nvme_t *n)
{
    uint32_t pick = UINT32_MAX;
    for (uint32_t k = 0; k < n->nsegs; k++) {
        uint32_t i = (n->next_free + k) % n->nsegs;
        if (n->segs[i].state == SEG_FREE) {
            pick = i;
            break;
        }
    }
    if (pick == UINT32_MAX) {
        int rc = seg_reclaim(n);
        if (rc < 0)
            return rc;
        return seg_open_next(n);
    }
    nvme_seg_t *s = &n->segs[pick];
    s->state = SEG_OPEN;
    s->stamp = new_stamp();
    s->head = 0;
    live_reset(n, pick, s->stamp);
    n->cur = pick;
    n->next_free = (pick + 1) % n->nsegs;
    return 0;
}

/* Space for a record of rec bytes: fills *seg and *off (bytes into the segment). */
static int seg_alloc(nvme_t *n, uint32_t rec, uint32_t *seg, uint32_t *off)
{
    if (n->cur == UINT32_MAX || n->segs[n->cur].head + (uint64_t)rec > n->seg_bytes) {
        if (n->cur != UINT32_MAX) {
            uint32_t old = n->cur;
            n->segs[old].state = SEG_FULL;
            n->cur = UINT32_MAX;
            seg_maybe_free(n, old);
        }
        int rc = seg_open_next(n);
        if (rc < 0)
            return rc;
    }
    nvme_seg_t *s = &n->segs[n->cur];
    *seg = n->cur;
    *off = s->head;
    s->head += rec;
    return 0;
}

/* ---- request slots and io_uring ---- */

/* A slot for a request counted in flight (the window is the number of slots, so there is one). */
static nvme_req_t *req_get(nvme_t *n)
{
    kvt__ioq_link_t *l = kvt__ioq_slot_get(&n->q);
    kvt_assert(l);
    return KVT__IOQ_OF(l, nvme_req_t, link);
}

/* Gives the slot back and ends the request's count in flight. */
static void req_put(nvme_t *n, nvme_req_t *r)
{
    free(r->bounce);
    r->bounce = NULL;
    r->io = NULL;
    kvt__ioq_slot_put(&n->q, &r->link);
    kvt__ioq_finished(&n->q);
}

static int req_submit(nvme_t *n, nvme_req_t *r)
{
    struct io_uring_sqe *sqe = io_uring_get_sqe(&n->ring);
    kvt_assert(sqe != NULL); /* one sqe per slot, and there are as many slots as entries */
    if (r->io->op == KVT_IO_WRITE)
        io_uring_prep_writev(sqe, n->fd, r->iov + r->iov_at, r->niov - r->iov_at, r->off + r->done);
    else
        io_uring_prep_readv(sqe, n->fd, r->iov + r->iov_at, r->niov - r->iov_at, r->off + r->done);
    io_uring_sqe_set_data(sqe, r);
    int rc = io_uring_submit(&n->ring);
    if (rc < 0) {
        kvt_log(KVT_LOG_ERROR, "nvme tier: io_uring_submit: %s", strerror(-rc));
        return KVT_EIO;
    }
    return 0;
}

/* Moves the iovec cursor past `bytes` transferred by a short I/O. */
static void req_advance(nvme_req_t *r, uint32_t bytes)
{
    r->done += bytes;
    while (bytes > 0) {
        struct iovec *v = &r->iov[r->iov_at];
        if (bytes >= v->iov_len) {
            bytes -= (uint32_t)v->iov_len;
            r->iov_at++;
        } else {
            v->iov_base = (uint8_t *)v->iov_base + bytes;
            v->iov_len -= bytes;
            bytes = 0;
        }
    }
}

/* Lays out header region, payload and tail as iovecs over r's buffers. */
static int req_layout(nvme_t *n, nvme_req_t *r, kvt_tier_io_t *io, uint32_t hdr, int writing)
{
    uint32_t body = round_sector(io->len);
    r->niov = 0;
    r->iov_at = 0;
    r->done = 0;
    r->total = hdr + body;
    r->iov[r->niov++] = (struct iovec){r->hdr, hdr};
    if (((uintptr_t)io->buf & (SECTOR - 1)) == 0) {
        uint32_t whole = io->len & ~(SECTOR - 1);
        if (whole)
            r->iov[r->niov++] = (struct iovec){io->buf, whole};
        if (whole < io->len) {
            if (writing) {
                memcpy(r->tail, (uint8_t *)io->buf + whole, io->len - whole);
                memset(r->tail + (io->len - whole), 0, SECTOR - (io->len - whole));
            }
            r->iov[r->niov++] = (struct iovec){r->tail, SECTOR};
        }
        r->payload_direct = 1;
    } else {
        if (posix_memalign((void **)&r->bounce, SECTOR, body) != 0) {
            r->bounce = NULL;
            return KVT_ENOMEM;
        }
        if (writing) {
            memcpy(r->bounce, io->buf, io->len);
            memset(r->bounce + io->len, 0, body - io->len);
        }
        r->iov[r->niov++] = (struct iovec){r->bounce, body};
        r->payload_direct = 0;
        n->tier->usage.bounced_bytes += io->len;
    }
    return 0;
}

/*
 * Whether io, a write, must wait for the first record of the open segment to land: the recovery
 * scan reads a segment from that record on (its stamp names the segment's current use), and a
 * crash cancels writes still queued in io_uring, so no later record of the segment may start
 * before it has completed. A write that would open a new segment does not wait.
 */
static int write_waits(const nvme_t *n, const kvt_tier_io_t *io)
{
    if (io->op != KVT_IO_WRITE || n->cur == UINT32_MAX || !n->segs[n->cur].opening)
        return 0;
    uint32_t rec = rec_bytes(hdr_region(io->key.ntokens), io->len);
    return n->segs[n->cur].head + (uint64_t)rec <= n->seg_bytes;
}

/* The first record of segment seg did not land: nothing more goes there (the scan would not
 * find it), and the segment is free again once its I/O is over. */
static void first_failed(nvme_t *n, uint32_t seg)
{
    n->segs[seg].opening = 0;
    if (n->cur == seg) {
        n->segs[seg].state = SEG_FULL;
        n->cur = UINT32_MAX;
    }
}

/* The next record's sequence number. Atomic: kvt_tier_write_prepare takes one with no lock held
 * while a write starts under its caller's lock. */
static uint64_t nvme_next_seq(nvme_t *n)
{
    return __atomic_add_fetch(&n->seq, 1, __ATOMIC_RELAXED);
}

/* kvt_tier_write_prepare: the number and the checksum taken now, from the caller's thread, so that
 * nvme_start_write only encodes the header; it reads nothing else of the tier. */
static int nvme_prepare(kvt_tier_t *t, kvt_tier_io_t *io)
{
    io->prep_seq = nvme_next_seq(t->impl);
    io->prep_sum = kvt__blockhdr_sum(&io->key, io->buf, io->len, io->prep_seq);
    io->prepared = 1;
    return 0;
}

static int nvme_start_write(nvme_t *n, nvme_req_t *r, kvt_tier_io_t *io)
{
    uint32_t hdr = hdr_region(io->key.ntokens);
    uint32_t rec = rec_bytes(hdr, io->len);
    uint32_t seg, off;
    int rc = req_layout(n, r, io, hdr, 1);
    if (rc < 0)
        return rc;
    if ((rc = seg_alloc(n, rec, &seg, &off)) < 0) {
        free(r->bounce);
        r->bounce = NULL;
        return rc;
    }
    nvme_seg_t *s = &n->segs[seg];
    r->io = io;
    r->seg = seg;
    r->off = (uint64_t)seg * n->seg_bytes + off;
    r->first = off == 0;
    s->opening |= r->first;
    memset(r->hdr, 0, hdr);
    prefix_encode(r->hdr, rec, hdr, s->stamp, 0);
    uint8_t *h = r->hdr + PREFIX_BYTES;
    if (io->prepared)
        kvt__blockhdr_encode_summed(h, &io->key, io->len, io->prep_seq, io->prep_sum);
    else
        kvt__blockhdr_encode(h, &io->key, io->buf, io->len, nvme_next_seq(n));
    io->prepared = 0; /* a write started again is hashed again */
    io->loc = kvt__nvme_loc(seg, s->gen, hdr / SECTOR, off / SECTOR);
    s->inflight++;
    if ((rc = req_submit(n, r)) < 0) {
        s->inflight--;
        if (r->first)
            first_failed(n, seg);
        seg_maybe_free(n, seg);
        free(r->bounce);
        r->bounce = NULL;
        io->loc = 0;
        return rc;
    }
    return 0;
}

static int nvme_start_read(nvme_t *n, nvme_req_t *r, kvt_tier_io_t *io)
{
    uint32_t seg = loc_seg(io->loc);
    r->io = io;
    r->seg = seg;
    r->first = 0;
    r->off = loc_off(n, io->loc);
    int rc = req_layout(n, r, io, loc_hdr(io->loc), 0);
    if (rc < 0)
        return rc;
    n->segs[seg].inflight++;
    if ((rc = req_submit(n, r)) < 0) {
        n->segs[seg].inflight--;
        free(r->bounce);
        r->bounce = NULL;
        return rc;
    }
    return 0;
}

static int nvme_start(nvme_t *n, nvme_req_t *r, kvt_tier_io_t *io)
{
    return io->op == KVT_IO_WRITE ? nvme_start_write(n, r, io) : nvme_start_read(n, r, io);
}

/* Requests wait for a slot in the tier's queue (ioq.c): urgent reads (io->urgent) go ahead of
 * the rest. */
static int io_urgent(const kvt_tier_io_t *io)
{
    return io->urgent && io->op == KVT_IO_READ;
}

static kvt_tier_io_t *io_of(kvt__ioq_link_t *l)
{
    return l ? KVT__IOQ_OF(l, kvt_tier_io_t, wait) : NULL;
}

static int nvme_submit(kvt_tier_t *t, kvt_tier_io_t *io)
{
    nvme_t *n = t->impl;
    if (io->op == KVT_IO_WRITE && rec_bytes(hdr_region(io->key.ntokens), io->len) > n->seg_bytes)
        return KVT_ETOOBIG; /* a record never spans segments */
    /* Keep submission order within the request's class (urgent reads pass the others). */
    if (kvt__ioq_behind(&n->q, io_urgent(io)) || write_waits(n, io) || !kvt__ioq_start(&n->q)) {
        io->wait.deadline_ns = 0;
        kvt__ioq_push(&n->q, &io->wait, io_urgent(io));
        return 0;
    }
    nvme_req_t *r = req_get(n);
    int rc = nvme_start(n, r, io);
    if (rc < 0)
        req_put(n, r);
    return rc;
}

static int nvme_err(nvme_t *n, int res)
{
    if (res == -ENOSPC || res == -EDQUOT) {
        if (!n->warned_nospc) {
            kvt_log(KVT_LOG_ERROR, "nvme tier: the file system under %s is full", n->dir);
            n->warned_nospc = 1;
        }
        return KVT_ENOSPC;
    }
    static kvt_log_limit_t lim; /* a failing device fails every request */
    kvt_log_limited(&lim, KVT_LOG_ERROR, "nvme tier: I/O error on %s: %s", n->path, strerror(-res));
    return KVT_EIO;
}

/* A finished read: verify header and checksum (or leave the checksum to the caller:
 * kvt__tier_read_verify) before a single byte counts as returned. */
static int read_finish(nvme_t *n, nvme_req_t *r)
{
    kvt_tier_io_t *io = r->io;
    uint32_t hdr = loc_hdr(io->loc);
    if (r->payload_direct) {
        uint32_t whole = io->len & ~(SECTOR - 1);
        if (whole < io->len)
            memcpy((uint8_t *)io->buf + whole, r->tail, io->len - whole);
    } else {
        memcpy(io->buf, r->bounce, io->len);
    }
    int st = 0;
    uint32_t rec, h;
    uint64_t stamp;
    const nvme_seg_t *s = &n->segs[r->seg];
    if (loc_gen(io->loc) != s->gen) {
        st = KVT_ENOENT;
    } else if (prefix_decode(r->hdr, &rec, &h, &stamp) != 0 || h != hdr || stamp != s->stamp ||
               kvt__tier_read_verify(io, r->hdr + PREFIX_BYTES, hdr - PREFIX_BYTES, io->buf) < 0) {
        st = KVT_ECORRUPT;
    }
    if (st < 0)
        memset(io->buf, 0, io->len); /* a miss never hands out bytes */
    return st;
}

static void req_done(nvme_t *n, nvme_req_t *r, int status)
{
    kvt_tier_io_t *io = r->io;
    nvme_seg_t *s = &n->segs[r->seg];
    kvt_assert(s->inflight > 0);
    s->inflight--;
    if (io->op == KVT_IO_WRITE) {
        if (status == 0) {
            if (seg_note_loc(s, io->loc) < 0) {
                status = KVT_ENOMEM;
            } else {
                seg_live_add(n, io->loc, io->len);
                live_mark(n, io->loc, 1); /* before anyone is told it is stored */
            }
        }
    } else if (status == 0) {
        status = read_finish(n, r);
    }
    if (io->op == KVT_IO_WRITE && status < 0)
        io->loc = 0;
    if (r->first) {
        if (status < 0)
            first_failed(n, r->seg);
        s->opening = 0;
    }
    seg_maybe_free(n, r->seg);
    req_put(n, r);
    kvt__tier_complete(n->tier, io, status);
}

/* Starts waiting requests while slots are free. */
static void nvme_drain_wait(nvme_t *n)
{
    kvt_tier_io_t *io;
    while ((io = io_of(kvt__ioq_next(&n->q))) && !write_waits(n, io)) {
        kvt__ioq_pop(&n->q);
        nvme_req_t *r = req_get(n);
        int rc = nvme_start(n, r, io);
        if (rc < 0) {
            req_put(n, r);
            kvt__tier_complete(n->tier, io, rc);
        }
    }
}

/* Payload bytes one poll verifies before it hands the completions over. A read's checksum is
 * the tier's one large cost per read; verifying a whole burst of completions before any callback
 * runs leaves the disk without new requests meanwhile, which capped reads below fio. A read
 * whose caller takes the checksum itself (check_later) costs the poll a header and counts
 * nothing. */
#define POLL_VERIFY_BUDGET (512u << 10)

static int nvme_poll(kvt_tier_t *t)
{
    nvme_t *n = t->impl;
    uint64_t v;
    ssize_t got = read(n->efd, &v, sizeof(v));
    (void)got;
    int done = 0;
    uint64_t verified = 0;
    struct io_uring_cqe *cqe;
    while (io_uring_peek_cqe(&n->ring, &cqe) == 0) {
        if (verified >= POLL_VERIFY_BUDGET) {
            /* The rest waits for the next process call, after this batch's callbacks (which
             * submit again): the eventfd is made readable so that the caller's loop comes back
             * at once. */
            v = 1;
            got = write(n->efd, &v, sizeof(v));
            (void)got;
            break;
        }
        nvme_req_t *r = io_uring_cqe_get_data(cqe);
        int res = cqe->res;
        io_uring_cqe_seen(&n->ring, cqe);
        if (res == -EAGAIN || res == -EINTR) {
            if (req_submit(n, r) < 0)
                req_done(n, r, KVT_EIO);
            continue;
        }
        if (res < 0) {
            req_done(n, r, nvme_err(n, res));
            done++;
            continue;
        }
        if (res == 0) { /* end of file: the data file is shorter than its geometry */
            kvt_log(KVT_LOG_ERROR, "nvme tier: unexpected end of %s", n->path);
            req_done(n, r, KVT_EIO);
            done++;
            continue;
        }
        req_advance(r, (uint32_t)res);
        if (r->done < r->total) {
            if (req_submit(n, r) < 0) {
                req_done(n, r, KVT_EIO);
                done++;
            }
            continue;
        }
        if (r->io->op == KVT_IO_READ && !kvt__tier_checks_later(r->io))
            verified += r->io->len;
        req_done(n, r, 0);
        done++;
    }
    nvme_drain_wait(n);
    return done;
}

static uint64_t nvme_footprint(const kvt_tier_t *t, uint32_t len)
{
    (void)t;
    return (uint64_t)HDR_MAX_BYTES + round_sector(len);
}

static void nvme_free(kvt_tier_t *t, uint64_t loc, uint32_t len)
{
    nvme_t *n = t->impl;
    uint32_t seg = loc_seg(loc);
    kvt_assert(seg < n->nsegs && loc_gen(loc) == n->segs[seg].gen);
    live_mark(n, loc, 0); /* gone for good: a restart does not bring it back */
    seg_live_sub(n, loc, len);
    seg_maybe_free(n, seg);
}

static int nvme_valid(kvt_tier_t *t, uint64_t loc, const kvt_block_key_t *key)
{
    (void)key;
    nvme_t *n = t->impl;
    uint32_t seg = loc_seg(loc);
    return seg < n->nsegs && loc_gen(loc) == n->segs[seg].gen;
}

static int nvme_pin(kvt_tier_t *t, uint64_t loc, int delta)
{
    nvme_t *n = t->impl;
    uint32_t seg = loc_seg(loc);
    if (seg >= n->nsegs || loc_gen(loc) != n->segs[seg].gen)
        return KVT_ENOENT; /* freed or reclaimed since: nothing left to keep */
    nvme_seg_t *s = &n->segs[seg];
    if (delta > 0)
        s->pins++;
    else if (s->pins > 0)
        s->pins--;
    return 0;
}

static int nvme_fd(kvt_tier_t *t)
{
    return ((nvme_t *)t->impl)->efd;
}

static void nvme_dealloc(nvme_t *n)
{
    if (n->live) {
        /* The kernel has every change already (a crash loses none); this is for a power cut
         * after a clean stop. */
        if (msync(n->live, n->live_size, MS_SYNC) != 0)
            kvt_log(KVT_LOG_WARN, "nvme tier: msync of %s/kvtier.live: %s", n->dir,
                    strerror(errno));
        munmap(n->live, n->live_size);
    }
    if (n->livefd >= 0)
        close(n->livefd);
    if (n->ring_ok)
        io_uring_queue_exit(&n->ring);
    if (n->efd >= 0)
        close(n->efd);
    if (n->fd >= 0)
        close(n->fd);
    if (n->lockfd >= 0)
        close(n->lockfd); /* and with it the lock */
    if (n->reqs) {
        for (uint32_t i = 0; i < n->qd; i++) {
            free(n->reqs[i].hdr);
            free(n->reqs[i].tail);
            free(n->reqs[i].bounce);
        }
        free(n->reqs);
    }
    if (n->segs) {
        for (uint32_t i = 0; i < n->nsegs; i++)
            free(n->segs[i].locs);
        free(n->segs);
    }
    kvt__nvme_recovered_free(n);
    free(n->ns_set);
    free(n->dir);
    free(n->path);
    free(n);
}

static void nvme_destroy(kvt_tier_t *t)
{
    /* Requests still waiting for a slot never started: nobody is called back for them. */
    nvme_dealloc(t->impl);
}

const kvt_tier_ops_t kvt__nvme_ops = {
    .backend = "io_uring",
    .footprint = nvme_footprint,
    .write = nvme_submit,
    .read = nvme_submit,
    .prepare = nvme_prepare,
    .free = nvme_free, /* and kvt_tier_discard: every free is for good (kvtier.live) */
    .valid = nvme_valid,
    .pin = nvme_pin,
    .fd = nvme_fd,
    .poll = nvme_poll,
    .destroy = nvme_destroy,
};

int kvt_tier_nvme_direct(const kvt_tier_t *t)
{
    return t && t->ops == &kvt__nvme_ops ? ((const nvme_t *)t->impl)->direct : 0;
}

uint32_t kvt_tier_nvme_max_block(const kvt_tier_t *t, uint32_t page_size)
{
    if (!t || t->ops != &kvt__nvme_ops)
        return 0;
    const nvme_t *n = t->impl;
    uint32_t hdr = hdr_region(page_size);
    return n->seg_bytes > hdr ? n->seg_bytes - hdr : 0;
}

void kvt_tier_nvme_recovery(const kvt_tier_t *t, kvt_tier_nvme_recovery_t *out)
{
    if (!out)
        return;
    memset(out, 0, sizeof(*out));
    if (t && t->ops == &kvt__nvme_ops)
        *out = ((const nvme_t *)t->impl)->rec;
}

/* ---- side files: kvtier.meta, kvtier.live ---- */

/*
 * A side file that is missing, empty or damaged, or a data file of the wrong size, stops the
 * tier with a message that names the file, says what is wrong with it and how to start afresh:
 * the data file cannot be read without them (its geometry, which of its records are live).
 */
static void disk_error(const nvme_t *n, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void disk_error(const nvme_t *n, const char *fmt, ...)
{
    char what[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof(what), fmt, ap);
    va_end(ap);
    kvt_log(KVT_LOG_ERROR,
            "nvme tier: %s. To start afresh (the blocks cached in %s are lost), remove "
            "kvtier.data, kvtier.meta and kvtier.live from %s",
            what, n->dir, n->dir);
}

/* Reads kvtier.meta of a directory that holds a data file: its version into *version when the
 * geometry is the one asked. KVT_EINVAL for another geometry, KVT_ECORRUPT when it is missing,
 * empty or not a geometry line, or a negated errno. */
static int meta_read(nvme_t *n, uint32_t *version)
{
    char path[4096], have[128];
    snprintf(path, sizeof(path), "%s/kvtier.meta", n->dir);
    FILE *f = fopen(path, "re");
    if (!f) {
        int e = errno;
        if (e != ENOENT) {
            kvt_log(KVT_LOG_ERROR, "nvme tier: cannot read %s: %s", path, strerror(e));
            return -e;
        }
        disk_error(n,
                   "%s is missing: it records the geometry of %s, which cannot be read without it",
                   path, n->path);
        return KVT_ECORRUPT;
    }
    size_t got = fread(have, 1, sizeof(have) - 1, f);
    int err = ferror(f);
    fclose(f);
    if (err) {
        kvt_log(KVT_LOG_ERROR, "nvme tier: cannot read %s", path);
        return KVT_EIO;
    }
    have[got] = 0;
    unsigned v = 0, segb = 0, nsegs = 0;
    int end = -1;
    if (got == 0) {
        disk_error(n,
                   "%s is empty (a crash while it was written?): it should record the geometry "
                   "of %s",
                   path, n->path);
        return KVT_ECORRUPT;
    }
    if (sscanf(have, "kvtier-nvme v%u segment_bytes=%u segments=%u\n%n", &v, &segb, &nsegs, &end) !=
            3 ||
        end < 0 || (size_t)end != got || have[got - 1] != '\n' || strlen(have) != got) {
        char shown[KVT_LOG_STR_CAP(40)];
        kvt_log_str(shown, sizeof shown, have, got, 40);
        disk_error(n,
                   "%s is damaged: it starts with \"%s\" where a line \"kvtier-nvme v%u "
                   "segment_bytes=... segments=...\" should record the geometry of %s",
                   path, shown, META_VERSION, n->path);
        return KVT_ECORRUPT;
    }
    if (v == 0 || v > META_VERSION) {
        disk_error(n, "%s says format v%u; this kvtierd reads v1 and v%u", path, v, META_VERSION);
        return KVT_ECORRUPT;
    }
    if (segb != n->seg_bytes || nsegs != n->nsegs) {
        kvt_log(
            KVT_LOG_ERROR,
            "nvme tier: %s was made with %u segments of %u bytes, not the %u of %u bytes asked: "
            "start with the settings it was made with, or remove the directory's kvtier.* "
            "files to start afresh",
            n->path, nsegs, segb, n->nsegs, n->seg_bytes);
        return KVT_EINVAL;
    }
    *version = v;
    return 0;
}

/* Writes kvtier.meta (the current version): a new file, synced, renamed over the old. */
static int meta_write(nvme_t *n)
{
    char path[4096], want[128];
    snprintf(path, sizeof(path), "%s/kvtier.meta", n->dir);
    snprintf(want, sizeof(want), "kvtier-nvme v%u segment_bytes=%u segments=%u\n", META_VERSION,
             n->seg_bytes, n->nsegs);
    char tmp[4200];
    snprintf(tmp, sizeof(tmp), "%s.tmp", path);
    FILE *f = fopen(tmp, "w");
    if (!f)
        return -errno;
    int ok = fputs(want, f) >= 0;
    ok = fflush(f) == 0 && ok;
    ok = fsync(fileno(f)) == 0 && ok;
    ok = fclose(f) == 0 && ok;
    if (!ok || rename(tmp, path) != 0) {
        int e = errno ? -errno : KVT_EIO;
        unlink(tmp);
        return e;
    }
    return 0;
}

static void live_header(const nvme_t *n, uint8_t *h)
{
    memset(h, 0, 32);
    memcpy(h, LIVE_MAGIC, 8);
    kvt_put_u32(h + 8, 1);
    kvt_put_u32(h + 12, n->seg_bytes);
    kvt_put_u32(h + 16, n->nsegs);
    kvt_put_u32(h + 20, n->live_entry);
    kvt_put_u64(h + 24, XXH3_64bits(h, 24));
}

/*
 * Opens kvtier.live and maps it: made afresh (no live block) when make is set, else checked
 * against the geometry (KVT_ECORRUPT when missing, of another size or header). Its blocks are
 * allocated (posix_fallocate), so that a store into the mapping never meets a full disk (which
 * would be a SIGBUS).
 */
static int live_open(nvme_t *n, int make)
{
    char path[4096];
    snprintf(path, sizeof(path), "%s/kvtier.live", n->dir);
    n->live_entry = 8 + n->seg_bytes / SECTOR / 8;
    uint64_t size = LIVE_HDR + (uint64_t)n->nsegs * n->live_entry;
    size = (size + SECTOR - 1) & ~(uint64_t)(SECTOR - 1);
    uint8_t want[32], have[32];
    live_header(n, want);
    int fd = open(path, O_RDWR | O_CLOEXEC | (make ? O_CREAT | O_TRUNC : 0), 0644);
    if (fd < 0) {
        int e = errno;
        if (e == ENOENT) {
            disk_error(n, "%s is missing: it says which records in %s hold live blocks", path,
                       n->path);
            return KVT_ECORRUPT;
        }
        kvt_log(KVT_LOG_ERROR, "nvme tier: cannot open %s: %s", path, strerror(e));
        return -e;
    }
    struct stat st;
    int rc = 0;
    if (fstat(fd, &st) != 0) {
        rc = -errno;
    } else if (make) {
        if (ftruncate(fd, (off_t)size) != 0 || pwrite(fd, want, sizeof(want), 0) != sizeof(want))
            rc = errno ? -errno : KVT_EIO;
    } else if ((uint64_t)st.st_size != size) {
        disk_error(n, "%s is %lld bytes long, where %u segments of %u bytes need %llu", path,
                   (long long)st.st_size, n->nsegs, n->seg_bytes, (unsigned long long)size);
        rc = KVT_ECORRUPT;
    } else if (pread(fd, have, sizeof(have), 0) != sizeof(have) ||
               memcmp(have, want, sizeof(want)) != 0) {
        disk_error(n,
                   "%s is damaged: its header is not that of a live-block map for %u segments "
                   "of %u bytes",
                   path, n->nsegs, n->seg_bytes);
        rc = KVT_ECORRUPT;
    }
    if (rc == 0) {
        int e = posix_fallocate(fd, 0, (off_t)size);
        if (e == ENOSPC || e == EDQUOT) {
            kvt_log(KVT_LOG_ERROR, "nvme tier: the file system under %s cannot hold %s", n->dir,
                    path);
            rc = KVT_ENOSPC;
        } else if (e != 0) {
            rc = -e;
        }
    }
    void *m = MAP_FAILED;
    if (rc == 0 &&
        (m = mmap(NULL, (size_t)size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)) == MAP_FAILED)
        rc = -errno;
    if (rc < 0) {
        if (rc != KVT_ECORRUPT && rc != KVT_ENOSPC)
            kvt_log(KVT_LOG_ERROR, "nvme tier: %s: %s", path, kvt_strerror(rc));
        close(fd);
        if (make)
            unlink(path);
        return rc;
    }
    n->livefd = fd;
    n->live = m;
    n->live_size = (size_t)size;
    return 0;
}

/* A directory from before kvtier.live has been recovered and its map built: the map is synced
 * before kvtier.meta says v2, so that a crash meanwhile leaves a v1 directory, recovered the old
 * way again. */
static int live_upgrade(nvme_t *n)
{
    int rc = 0;
    if (msync(n->live, n->live_size, MS_SYNC) != 0 || fsync(n->livefd) != 0)
        rc = -errno;
    if (rc == 0)
        rc = meta_write(n);
    if (rc < 0) {
        kvt_log(KVT_LOG_ERROR, "nvme tier: cannot record the live-block map of %s: %s", n->path,
                kvt_strerror(rc));
        return rc;
    }
    kvt_log(KVT_LOG_WARN,
            "nvme tier: %s was written by an earlier kvtierd (kvtier.meta v1, no kvtier.live): "
            "its blocks were recovered from every intact record, the newest first, so blocks "
            "freed before that stop may have come back this once; from now on kvtier.live says "
            "which are live (kvtier.meta v%u)",
            n->path, META_VERSION);
    return 0;
}

/* ---- creation ---- */

/*
 * One process at a time per directory: a second daemon given the same data-dir would write into
 * segments the first thinks its own. An exclusive flock on kvtier.lock, taken before anything in
 * the directory is looked at and held until the tier is destroyed (the kernel drops it when the
 * process dies, so a crash leaves nothing to clean up). The holder's pid is written in it for
 * the message of the next one.
 */
static int lock_dir(nvme_t *n)
{
    char path[4096], pid[32];
    snprintf(path, sizeof(path), "%s/kvtier.lock", n->dir);
    n->lockfd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (n->lockfd < 0) {
        int e = errno;
        kvt_log(KVT_LOG_ERROR, "nvme tier: cannot open %s: %s", path, strerror(e));
        return -e;
    }
    if (flock(n->lockfd, LOCK_EX | LOCK_NB) != 0) {
        int e = errno;
        ssize_t got = pread(n->lockfd, pid, sizeof(pid) - 1, 0);
        pid[got > 0 ? got : 0] = 0;
        pid[strcspn(pid, "\n")] = 0;
        if (e != EWOULDBLOCK) {
            kvt_log(KVT_LOG_ERROR, "nvme tier: cannot lock %s: %s", path, strerror(e));
            return -e;
        }
        kvt_log(KVT_LOG_ERROR,
                "nvme tier: %s is in use by another process (pid %s): one kvtierd per data-dir",
                n->dir, pid[0] ? pid : "unknown");
        return KVT_EBUSY;
    }
    int len = snprintf(pid, sizeof(pid), "%ld\n", (long)getpid());
    if (ftruncate(n->lockfd, 0) != 0 || pwrite(n->lockfd, pid, (size_t)len, 0) != len)
        kvt_log(KVT_LOG_WARN, "nvme tier: cannot write the pid into %s: %s", path, strerror(errno));
    return 0;
}

/*
 * How many live blocks kvtier.live lists, read by its own header (the geometry asked for now may
 * differ): for the warning of a data file gone while its side files remain. -1 when the map is
 * missing or not one (a v1 directory has none), so the count is unknown.
 */
static long long live_count(const nvme_t *n)
{
    char path[4096];
    snprintf(path, sizeof(path), "%s/kvtier.live", n->dir);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    uint8_t h[32], buf[64 << 10];
    struct stat st;
    long long count = -1;
    if (fstat(fd, &st) != 0 || pread(fd, h, sizeof(h), 0) != sizeof(h) ||
        memcmp(h, LIVE_MAGIC, 8) != 0 || kvt_get_u32(h + 8) != 1 ||
        kvt_get_u64(h + 24) != XXH3_64bits(h, 24))
        goto out;
    uint32_t segb = kvt_get_u32(h + 12), nsegs = kvt_get_u32(h + 16), entry = kvt_get_u32(h + 20);
    if (segb < SECTOR || entry != 8 + segb / SECTOR / 8 || entry > sizeof(buf) ||
        (uint64_t)st.st_size < LIVE_HDR + (uint64_t)nsegs * entry)
        goto out;
    count = 0;
    uint32_t per = (uint32_t)(sizeof(buf) / entry);
    for (uint32_t s = 0; s < nsegs; s += per) {
        uint32_t k = KVT_MIN(per, nsegs - s);
        off_t off = (off_t)LIVE_HDR + (off_t)s * entry;
        if (pread(fd, buf, (size_t)k * entry, off) != (ssize_t)((size_t)k * entry)) {
            count = -1;
            break;
        }
        for (uint32_t i = 0; i < k; i++) {
            const uint8_t *e = buf + (size_t)i * entry;
            if (kvt_get_u64(e) == 0)
                continue; /* the segment is not in use: its bits mean nothing */
            for (uint32_t b = 8; b < entry; b++)
                count += __builtin_popcount(e[b]);
        }
    }
out:
    close(fd);
    return count;
}

/*
 * The data file is made when it is missing. When its side files remain, it was removed (or
 * never copied) on its own: what kvtier.live lists as live is lost, said loudly since the tier
 * then starts empty. A data file that is not a regular file (a directory, a device) stops the
 * tier, named: the layout is that of a preallocated file.
 */
static int check_data(const nvme_t *n, int *fresh)
{
    struct stat st;
    if (stat(n->path, &st) == 0) {
        *fresh = 0;
        if (S_ISREG(st.st_mode))
            return 0;
        kvt_log(KVT_LOG_ERROR,
                "nvme tier: %s is not a regular file (%s): the NVMe tier keeps its blocks in one "
                "preallocated file there; move it away, or give another data-dir",
                n->path,
                S_ISDIR(st.st_mode)    ? "a directory"
                : S_ISBLK(st.st_mode)  ? "a block device"
                : S_ISCHR(st.st_mode)  ? "a character device"
                : S_ISFIFO(st.st_mode) ? "a FIFO"
                : S_ISSOCK(st.st_mode) ? "a socket"
                                       : "of another kind");
        return KVT_EINVAL;
    }
    *fresh = 1;
    if (errno != ENOENT)
        return 0; /* opening it says what is wrong */
    char meta[4096], live[4096];
    snprintf(meta, sizeof(meta), "%s/kvtier.meta", n->dir);
    snprintf(live, sizeof(live), "%s/kvtier.live", n->dir);
    int has_meta = access(meta, F_OK) == 0, has_live = access(live, F_OK) == 0;
    if (!has_meta && !has_live)
        return 0;
    const char *left = has_meta && has_live ? "kvtier.meta and kvtier.live remain"
                       : has_meta           ? "kvtier.meta remains"
                                            : "kvtier.live remains";
    long long lost = live_count(n);
    if (lost >= 0)
        kvt_log(KVT_LOG_WARN,
                "nvme tier: %s is missing while %s: the %lld blocks kvtier.live lists as live "
                "are lost; the tier starts empty with a new data file",
                n->path, left, lost);
    else
        kvt_log(KVT_LOG_WARN,
                "nvme tier: %s is missing while %s: the blocks it held are lost (how many is "
                "unknown: no readable kvtier.live); the tier starts empty with a new data file",
                n->path, left);
    return 0;
}

static int open_data(nvme_t *n, int direct_mode, int *fresh)
{
    int rc = check_data(n, fresh);
    if (rc < 0)
        return rc;
    int flags = O_RDWR | O_CREAT | O_CLOEXEC;
    n->fd = -1;
    if (direct_mode != 2) {
        n->fd = open(n->path, flags | O_DIRECT, 0644);
        if (n->fd >= 0) {
            n->direct = 1;
        } else if (errno == EINVAL) {
            if (direct_mode == 1) {
                kvt_log(KVT_LOG_ERROR, "nvme tier: the file system under %s refuses O_DIRECT",
                        n->dir);
                return KVT_EUNAVAIL;
            }
            static int logged;
            if (!logged++)
                kvt_log(KVT_LOG_WARN,
                        "nvme tier: the file system under %s refuses O_DIRECT: using buffered "
                        "I/O",
                        n->dir);
        } else {
            return -errno;
        }
    }
    if (n->fd < 0) {
        n->fd = open(n->path, flags, 0644);
        if (n->fd < 0)
            return -errno;
    }
    return 0;
}

static int size_data(nvme_t *n, int fresh, int sparse)
{
    uint64_t size = (uint64_t)n->nsegs * n->seg_bytes;
    struct stat st;
    if (fstat(n->fd, &st) != 0)
        return -errno;
    if (!fresh && (uint64_t)st.st_size != size) {
        disk_error(n,
                   "%s is %lld bytes long, where its geometry (%s/kvtier.meta: %u segments of %u "
                   "bytes) needs %llu: it was truncated or replaced",
                   n->path, (long long)st.st_size, n->dir, n->nsegs, n->seg_bytes,
                   (unsigned long long)size);
        return KVT_ECORRUPT;
    }
    if (!sparse) {
        int rc = posix_fallocate(n->fd, 0, (off_t)size);
        if (rc == ENOSPC || rc == EDQUOT) {
            kvt_log(KVT_LOG_ERROR,
                    "nvme tier: the file system under %s cannot hold a %llu-byte data file", n->dir,
                    (unsigned long long)size);
            return KVT_ENOSPC;
        }
        if (rc != 0)
            return -rc;
    } else if (ftruncate(n->fd, (off_t)size) != 0) {
        return -errno;
    }
    return 0;
}

int kvt_tier_nvme_create(kvt_tier_t **out, const kvt_tier_nvme_conf_t *conf)
{
    if (!out || !conf || !conf->dir || !conf->dir[0] || strlen(conf->dir) > 3000 ||
        conf->direct < 0 || conf->direct > 2)
        return KVT_EINVAL;
    uint32_t segb = conf->segment_bytes ? conf->segment_bytes : 64u << 20;
    uint32_t qd = conf->queue_depth ? conf->queue_depth : 64;
    if (segb < KVT_NVME_SEG_MIN || segb > (1u << 30) || segb % KVT_NVME_SEG_MIN || qd < 2 ||
        qd > 4096)
        return KVT_EINVAL;
    uint64_t nsegs = conf->capacity_bytes / segb;
    if (nsegs < 2 || nsegs > 0xfffff)
        return KVT_EINVAL;

    nvme_t *n = calloc(1, sizeof(*n));
    if (!n)
        return KVT_ENOMEM;
    n->fd = n->efd = n->lockfd = n->livefd = -1;
    n->meta_version = META_VERSION;
    n->cur = UINT32_MAX;
    n->seg_bytes = segb;
    n->nsegs = (uint32_t)nsegs;
    n->qd = qd;
    kvt__ioq_init(&n->q, qd);
    n->reclaim_cb = conf->reclaim_cb;
    n->reclaim_arg = conf->reclaim_arg;
    n->dir = strdup(conf->dir);
    n->path = malloc(strlen(conf->dir) + 16);
    n->segs = calloc(n->nsegs, sizeof(*n->segs));
    n->reqs = calloc(qd, sizeof(*n->reqs));
    int rc = KVT_ENOMEM;
    if (!n->dir || !n->path || !n->segs || !n->reqs)
        goto fail;
    sprintf(n->path, "%s/kvtier.data", conf->dir);
    for (uint32_t i = 0; i < n->nsegs; i++)
        n->segs[i].gen = 1;
    for (uint32_t i = 0; i < qd; i++) {
        nvme_req_t *r = &n->reqs[i];
        if (posix_memalign((void **)&r->hdr, SECTOR, HDR_MAX_BYTES) != 0 ||
            posix_memalign((void **)&r->tail, SECTOR, SECTOR) != 0)
            goto fail;
        kvt__ioq_slot_put(&n->q, &r->link);
    }

    if (mkdir(conf->dir, 0755) != 0 && errno != EEXIST) {
        rc = -errno;
        kvt_log(KVT_LOG_ERROR, "nvme tier: cannot make %s: %s", conf->dir, strerror(errno));
        goto fail;
    }
    int fresh = 0;
    if ((rc = lock_dir(n)) < 0)
        goto fail;
    rc = open_data(n, conf->direct, &fresh);
    if (rc == 0 && !fresh)
        rc = meta_read(n, &n->meta_version);
    if (rc == 0)
        rc = size_data(n, fresh, conf->sparse);
    if (rc == 0) /* a fresh map for a fresh data file, and for one from before the map */
        rc = live_open(n, fresh || n->meta_version < 2);
    if (rc == 0 && fresh) /* last: a data file is only used once its side files are complete */
        rc = meta_write(n);
    if (rc < 0) {
        if (fresh) /* a data file that could not be set up leaves nothing behind */
            unlink(n->path);
        goto fail;
    }

    n->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (n->efd < 0) {
        rc = -errno;
        goto fail;
    }
    rc = io_uring_queue_init(qd, &n->ring, 0);
    if (rc < 0) {
        kvt_log(KVT_LOG_ERROR, "nvme tier: io_uring_queue_init(%u): %s", qd, strerror(-rc));
        rc = KVT_EUNAVAIL;
        goto fail;
    }
    n->ring_ok = 1;
    if ((rc = io_uring_register_eventfd(&n->ring, n->efd)) < 0) {
        rc = KVT_EUNAVAIL;
        goto fail;
    }

    kvt_tier_t *t;
    if ((rc = kvt__tier_init(&t, KVT_TIER_NVME, &kvt__nvme_ops, n,
                             (uint64_t)n->nsegs * n->seg_bytes)) < 0)
        goto fail;
    n->tier = t;
    if (!fresh && ((rc = kvt__nvme_scan(n)) < 0 ||
                   (n->meta_version < META_VERSION && (rc = live_upgrade(n)) < 0))) {
        kvt_tier_destroy(t);
        return rc;
    }
    kvt_log(KVT_LOG_INFO,
            "nvme tier: %s, %u segments of %u bytes, queue depth %u, %s%s; recovered %llu blocks "
            "(%llu torn, %llu stale, %llu gaps, %llu discarded)",
            n->path, n->nsegs, n->seg_bytes, qd, n->direct ? "O_DIRECT" : "buffered",
            conf->sparse ? ", sparse" : "", (unsigned long long)n->rec.recovered,
            (unsigned long long)n->rec.torn, (unsigned long long)n->rec.stale,
            (unsigned long long)n->rec.gaps, (unsigned long long)n->rec.discarded);
    *out = t;
    return 0;
fail:
    nvme_dealloc(n);
    return rc;
}

/* ---- the recovery scan ---- */

static int pread_all(int fd, void *buf, size_t len, uint64_t off)
{
    size_t got = 0;
    while (got < len) {
        ssize_t r = pread(fd, (uint8_t *)buf + got, len - got, (off_t)(off + got));
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return r < 0 ? -errno : KVT_EIO;
        got += (size_t)r;
    }
    return 0;
}

static int rec_cmp(const void *a, const void *b)
{
    const nvme_recovered_t *x = a, *y = b;
    if (x->hash != y->hash)
        return x->hash < y->hash ? -1 : 1;
    if (x->ns_seed != y->ns_seed)
        return x->ns_seed < y->ns_seed ? -1 : 1;
    return x->seq > y->seq ? -1 : x->seq < y->seq; /* newest first */
}

static int rec_push(nvme_t *n, const nvme_recovered_t *r)
{
    if (n->nrecovered == n->recovered_cap) {
        size_t cap = n->recovered_cap ? n->recovered_cap * 2 : 256;
        nvme_recovered_t *nr = realloc(n->recovered, cap * sizeof(*nr));
        if (!nr)
            return KVT_ENOMEM;
        n->recovered = nr;
        n->recovered_cap = cap;
    }
    n->recovered[n->nrecovered++] = *r;
    return 0;
}

/* The offset of the first sector after off, in segment s at base, that starts an intact prefix
 * of the segment's current use: 0 when there is none, or a negated errno. Reads the rest of the
 * segment SCAN_CHUNK bytes at a time into buf. */
static int64_t next_record(nvme_t *n, const nvme_seg_t *s, uint64_t base, uint32_t off,
                           uint8_t *buf)
{
    for (uint32_t from = off + SECTOR; from < n->seg_bytes;) {
        uint32_t len = KVT_MIN(SCAN_CHUNK, n->seg_bytes - from);
        int rc = pread_all(n->fd, buf, len, base + from);
        if (rc < 0)
            return rc;
        for (uint32_t p = from; p < from + len; p += SECTOR) {
            uint32_t rec, hdr;
            uint64_t stamp;
            if (prefix_decode(buf + (p - from), &rec, &hdr, &stamp) >= 0 && stamp == s->stamp &&
                rec <= n->seg_bytes - p)
                return p;
        }
        from += len;
    }
    return 0;
}

/* A record's payload handed to kvt__blockhdr_verify_pieces: first the bytes the scan read with
 * the header, then the rest SCAN_CHUNK bytes at a time, read into the buffer after the header. */
typedef struct scan_payload {
    int fd;
    uint8_t *chunk;      /* SCAN_CHUNK bytes, sector-aligned */
    const uint8_t *held; /* payload bytes already read, nheld of them */
    uint32_t nheld;
    uint64_t at, end; /* file offsets: the next byte not handed out, the record's end */
} scan_payload_t;

static int scan_payload_next(void *arg, const uint8_t **piece, size_t *n)
{
    scan_payload_t *sp = arg;
    if (sp->nheld) {
        *piece = sp->held;
        *n = sp->nheld;
        sp->nheld = 0;
        return 0;
    }
    if (sp->at >= sp->end)
        return KVT_ECORRUPT; /* not reached: the record's size was checked against the header */
    size_t len = (size_t)KVT_MIN((uint64_t)SCAN_CHUNK, sp->end - sp->at);
    int rc = pread_all(sp->fd, sp->chunk, len, sp->at);
    if (rc < 0)
        return rc;
    sp->at += len;
    *piece = sp->chunk;
    *n = len;
    return 0;
}

/* Reads the rest of the record at off in segment seg (its first `first` bytes are in buf, its
 * prefix intact; HDR_MAX_BYTES + SCAN_CHUNK bytes of room) and appends its block to
 * n->recovered, or counts it torn. Returns 0 or an error. */
static int scan_record(nvme_t *n, uint32_t seg, uint32_t off, uint32_t rec, uint32_t hdr,
                       uint8_t *buf, uint32_t first)
{
    const nvme_seg_t *s = &n->segs[seg];
    uint64_t base = (uint64_t)seg * n->seg_bytes;
    int rc;
    kvt__blockhdr_info_t in;
    uint32_t len;
    if (kvt__blockhdr_peek(buf + PREFIX_BYTES, hdr - PREFIX_BYTES, &in) < 0 ||
        rec_bytes(hdr, in.len) != rec || hdr_region(in.ntokens) != hdr) {
        n->rec.torn++;
        return 0;
    }
    /* hdr <= first: hdr is at most HDR_MAX_BYTES and lies within rec, inside the segment */
    scan_payload_t sp = {.fd = n->fd,
                         .chunk = buf + HDR_MAX_BYTES,
                         .held = buf + hdr,
                         .nheld = KVT_MIN(first, rec) - hdr,
                         .at = base + off + KVT_MIN(first, rec),
                         .end = base + off + rec};
    rc = kvt__blockhdr_verify_pieces(buf + PREFIX_BYTES, hdr - PREFIX_BYTES, scan_payload_next, &sp,
                                     &len);
    if (rc == KVT_ECORRUPT) {
        n->rec.torn++;
        return 0;
    }
    if (rc < 0)
        return rc;
    nvme_recovered_t r = {
        .loc = kvt__nvme_loc(seg, s->gen, hdr / SECTOR, off / SECTOR),
        .ns_seed = in.ns_seed,
        .hash = in.hash,
        .parent = in.parent,
        .seq = in.seq,
        .len = in.len,
        .ntokens = in.ntokens,
    };
    if (in.ntokens) {
        r.tokens = malloc((size_t)4 * in.ntokens);
        if (!r.tokens)
            return KVT_ENOMEM;
        const uint8_t *tp = buf + PREFIX_BYTES + KVT_BLOCKHDR_BYTES;
        for (uint32_t i = 0; i < in.ntokens; i++)
            r.tokens[i] = kvt_get_u32(tp + 4 * i);
    }
    if ((rc = rec_push(n, &r)) < 0) {
        free(r.tokens);
        return rc;
    }
    n->rec.scanned++;
    if (in.seq > n->seq)
        n->seq = in.seq;
    return 0;
}

/* Scans one segment, appending its intact records of live blocks to n->recovered. */
static int scan_segment(nvme_t *n, uint32_t seg, uint8_t *buf)
{
    nvme_seg_t *s = &n->segs[seg];
    uint64_t base = (uint64_t)seg * n->seg_bytes;
    uint32_t off = 0;
    /* With kvtier.live (v2), its entry names the segment's use and which records are live; a
     * segment with none is not even read. Before it (v1), the first record names the use. */
    int mapped = n->meta_version >= 2;
    if (mapped) {
        if (!live_any(n, seg))
            return 0;
        s->stamp = kvt_get_u64(live_entry(n, seg));
    }
    while (off + SECTOR <= n->seg_bytes) {
        uint32_t first = KVT_MIN(HDR_MAX_BYTES, n->seg_bytes - off);
        int rc = pread_all(n->fd, buf, first, base + off);
        if (rc < 0)
            return rc;
        uint32_t rec, hdr;
        uint64_t stamp;
        int discarded = prefix_decode(buf, &rec, &hdr, &stamp);
        if (discarded < 0 || rec > n->seg_bytes - off ||
            ((off > 0 || mapped) && stamp != s->stamp)) {
            if (off == 0 && !mapped)
                break; /* no record of a current use: nothing to look for */
            /* The end of the records, or a record that never landed with later ones that did
             * (writes complete out of order, and a crash cancels those still queued). */
            int64_t next = next_record(n, s, base, off, buf);
            if (next <= 0)
                return next < 0 ? (int)next : 0;
            n->rec.gaps++;
            off = (uint32_t)next;
            s->head = off;
            continue;
        }
        if (off == 0 && !mapped)
            s->stamp = stamp;
        if (discarded || (mapped && !live_bit(n, seg, off / SECTOR)))
            n->rec.discarded++; /* a dropped block: stepped over, its bytes not even read */
        else if ((rc = scan_record(n, seg, off, rec, hdr, buf, first)) < 0)
            return rc;
        off += rec;
        s->head = off;
        s->state = SEG_FULL;
    }
    return 0;
}

/* A recovered block's place in the order of adoption: newest first. */
typedef struct seq_ix {
    uint64_t seq;
    size_t i;
} seq_ix_t;

static int seq_ix_cmp(const void *a, const void *b)
{
    const seq_ix_t *x = a, *y = b;
    return x->seq > y->seq ? -1 : x->seq < y->seq;
}

/*
 * Indexes the recovered blocks (one copy each, n->recovered sorted by hash) in the tier, the
 * newest first: a v2 map never holds more than the tier did, but a v1 log holds every record
 * still on disk, and those that do not fit should be the oldest. Those not adopted are dropped
 * from n->recovered, which stays sorted.
 */
static int adopt_newest_first(nvme_t *n)
{
    size_t nr = n->nrecovered;
    seq_ix_t *order = malloc((nr ? nr : 1) * sizeof(*order));
    uint8_t *taken = calloc(nr ? nr : 1, 1);
    if (!order || !taken) {
        free(order);
        free(taken);
        return KVT_ENOMEM;
    }
    for (size_t i = 0; i < nr; i++)
        order[i] = (seq_ix_t){.seq = n->recovered[i].seq, .i = i};
    if (nr > 0)
        qsort(order, nr, sizeof(*order), seq_ix_cmp);
    for (size_t k = 0; k < nr; k++) {
        const nvme_recovered_t *r = &n->recovered[order[k].i];
        kvt_block_key_t key = {.ns_seed = r->ns_seed,
                               .hash = r->hash,
                               .parent = r->parent,
                               .tokens = r->tokens,
                               .ntokens = r->ntokens};
        nvme_seg_t *s = &n->segs[loc_seg(r->loc)];
        if (seg_note_loc(s, r->loc) < 0) {
            n->rec.stale++;
            continue;
        }
        if (kvt__tier_adopt(n->tier, r->loc, &key, r->len) < 0) {
            s->nlocs--;
            n->rec.stale++;
            continue;
        }
        seg_live_add(n, r->loc, r->len);
        taken[order[k].i] = 1;
    }
    size_t keep = 0;
    for (size_t i = 0; i < nr; i++) {
        if (taken[i])
            n->recovered[keep++] = n->recovered[i];
        else
            free(n->recovered[i].tokens);
    }
    n->nrecovered = keep;
    free(order);
    free(taken);
    return 0;
}

/* After the scan, kvtier.live holds exactly the blocks adopted (torn records and older copies
 * lose their bits; a v1 directory gets its map). Each entry is built aside and copied over, so
 * that a crash meanwhile leaves every bit as it was or as it is to be. */
static int live_rebuild(nvme_t *n)
{
    uint8_t *e = malloc(n->live_entry);
    if (!e)
        return KVT_ENOMEM;
    for (uint32_t i = 0; i < n->nsegs; i++) {
        const nvme_seg_t *s = &n->segs[i];
        memset(e, 0, n->live_entry);
        if (s->state != SEG_FREE) {
            kvt_put_u64(e, s->stamp);
            for (uint32_t k = 0; k < s->nlocs; k++) {
                uint32_t sector = (uint32_t)(s->locs[k] & 0x3ffffu);
                e[8 + (sector >> 3)] |= (uint8_t)(1u << (sector & 7));
            }
        }
        memcpy(live_entry(n, i), e, n->live_entry);
    }
    free(e);
    return 0;
}

int kvt__nvme_scan(nvme_t *n)
{
    uint8_t *buf;
    if (posix_memalign((void **)&buf, SECTOR, HDR_MAX_BYTES + SCAN_CHUNK) != 0)
        return KVT_ENOMEM;
    int rc = 0;
    for (uint32_t i = 0; i < n->nsegs && rc == 0; i++)
        rc = scan_segment(n, i, buf);
    free(buf);
    if (rc < 0)
        return rc;
    if (n->nrecovered > 0) /* none found: the array is NULL, which qsort may not be given */
        qsort(n->recovered, n->nrecovered, sizeof(*n->recovered), rec_cmp);
    size_t keep = 0;
    for (size_t i = 0; i < n->nrecovered; i++) {
        nvme_recovered_t *r = &n->recovered[i];
        if (keep > 0 && n->recovered[keep - 1].hash == r->hash &&
            n->recovered[keep - 1].ns_seed == r->ns_seed) {
            n->rec.stale++;
            free(r->tokens);
            continue;
        }
        n->recovered[keep++] = *r;
    }
    n->nrecovered = keep;
    if ((rc = adopt_newest_first(n)) < 0)
        return rc;
    n->rec.recovered = n->nrecovered;
    for (uint32_t i = 0; i < n->nsegs; i++)
        seg_maybe_free(n, i);
    return live_rebuild(n);
}

void kvt__nvme_recovered_free(nvme_t *n)
{
    kvt__nvme_replay_free(n);
    for (size_t i = 0; i < n->nrecovered; i++)
        free(n->recovered[i].tokens);
    free(n->recovered);
    n->recovered = NULL;
    n->nrecovered = n->recovered_cap = 0;
}
