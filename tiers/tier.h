/*
 * tier.h: the places a block's KV bytes can live (HBM, DRAM, NVMe, remote Valkey/Redis) behind
 * one interface.
 *
 * A tier stores opaque payloads of up to a few MiB, each named by a block key (namespace seed,
 * prefix hash, parent hash, the page's tokens). Every tier has a capacity in bytes that it never
 * exceeds: a write that does not fit fails with KVT_ENOSPC and changes nothing. What a block
 * costs against the capacity is its footprint: the payload rounded up to what the tier really
 * uses for it (a jemalloc size class, whole 4 KiB sectors plus the stored header, whole HBM
 * slots); kvt_tier_footprint() says how much before anything is written.
 *
 * Asynchronous I/O
 * ----------------
 * Reads and writes are submitted with caller-allocated kvt_tier_io_t requests and complete
 * later, always through the tier's completion path, even for memory tiers: the callback never
 * runs inside the submitting call. A tier exposes one file descriptor (kvt_tier_fd) that becomes
 * readable when completions are ready; the caller's event loop polls it and then calls
 * kvt_tier_process(), which runs the callbacks of every ready request. A tier owns no event loop
 * and no thread that touches the caller's data; tests with no loop call kvt_tier_wait().
 * A submit that returns an error has not started anything: the callback will not run.
 *
 * Locations
 * ---------
 * A successful write fills io->loc, the tier-specific location that later reads and frees
 * name. kvt_tier_valid() says whether a location still holds that block (a reclaimed NVMe
 * segment, a key the Redis server evicted on its own): an invalid location reads as a miss.
 *
 * Threads: a tier is used by one thread at a time (the service's event loop).
 */
#ifndef KVT_TIER_H
#define KVT_TIER_H

#include <stddef.h>
#include <stdint.h>

#include "common.h"

typedef struct kvt_tier kvt_tier_t;

/* A block's name and the content its stored header carries and verifies. */
typedef struct kvt_block_key {
    uint64_t ns_seed;       /* the block's namespace seed (kvt_ns_seed_of, common.h) */
    uint64_t hash;          /* the block's prefix hash */
    uint64_t parent;        /* the parent block's hash; ns_seed for the first page */
    const uint32_t *tokens; /* the page's tokens, borrowed until completion */
    uint32_t ntokens;       /* the page size (0..KVT_PAGE_MAX) */
} kvt_block_key_t;

typedef enum { KVT_IO_READ = 1, KVT_IO_WRITE = 2 } kvt_io_op_t;

typedef struct kvt_tier_io kvt_tier_io_t;
typedef void (*kvt_tier_cb)(kvt_tier_io_t *io);

/* The largest payload any tier takes. */
#define KVT_TIER_MAX_BLOCK (64u << 20)

/* The alignment of an I/O buffer that the NVMe tier reads and writes in place (O_DIRECT). */
#define KVT_TIER_DIRECT_ALIGN 4096u

/*
 * One read or write. The caller owns the struct and the buffer until the callback has run.
 * status on completion: 0; KVT_ENOENT (a miss: not there, evicted, invalid location);
 * KVT_ECORRUPT (checksum or header mismatch: also a miss, counted apart); KVT_ENOSPC;
 * KVT_EIO; KVT_EUNAVAIL (backend down); KVT_ETIMEDOUT.
 * For a read, key.hash must be the block's hash (its stored header is checked against the whole
 * key where the tier stores one) and len the payload length that was written.
 * The NVMe tier moves bytes straight between the disk and buf when buf is KVT_TIER_DIRECT_ALIGN
 * aligned; any other buffer goes through a bounce buffer (an allocation and an extra copy of the
 * payload, counted in usage.bounced_bytes).
 */
struct kvt_tier_io {
    kvt_block_key_t key;
    uint64_t loc; /* read: where to read; write: filled on success */
    /* Host memory; for an HBM tier read/write it is the host side of the copy. A write to a
     * DRAM tier may leave it NULL: the block is allocated and charged but nothing is copied (its
     * bytes are whatever the memory holds), the reservation of a zero-copy PUT that a local
     * client fills through its mapping (kvt_tier_dram_share) before the daemon makes it visible.
     * Every other tier, and every read, refuses NULL with KVT_EINVAL. */
    void *buf;
    uint32_t len; /* payload bytes (read: the buffer must hold len bytes) */
    kvt_tier_cb cb;
    void *data; /* the caller's */
    int status;
    /* 1: a client waits for this read (a GET's), so where a tier queues requests (NVMe for its
     * request slots, the remote tier for its window) it goes ahead of those queued without it
     * (the policy's moves), behind only other urgent ones. Reads only: writes keep their order
     * (the remote tier's undo of a failed SET must not be overtaken). */
    int urgent;
    /* An HBM write with a pool on several devices: the CUDA device (ordinal) whose pool should
     * take the block (the engine's that stored it); the first pool for a device the tier has no
     * pool on. Where that pool has no room, or for -1 (none wanted), the pool with the most room
     * takes it. Other tiers, reads and one-pool HBM tiers ignore it. */
    int device;
    /* A read's: 1 lets the tier complete it with its payload's checksum not taken where that is
     * a cost of its own (NVMe, remote: an XXH3 over the whole payload), so that the caller takes
     * it on a thread of its choice; every other check of the record (location, header, key) is
     * made. Needs key.tokens (the stored header is rebuilt from the key). Other tiers ignore it. */
    uint8_t check_later;
    /* A read's: 1 when its submitter is not the thread that processes the tier (a GET planned
     * under the daemon's shared lock on a loop other than the tier's): the tier only queues it
     * and makes its fd readable (kvt__tier_kick), and does none of its work inline, which stays
     * with kvt_tier_process on the owning thread (HBM: a full queue's batch, with its CUDA calls
     * and the device they select). Tiers whose submission is their whole work ignore it (NVMe:
     * the ring's submission, whose eventfd wakes the owner; remote: its wait queue). */
    uint8_t queue_only;
    /* Set by the tier when such a read completed with status 0 and its payload unchecked: no
     * byte of buf may be used before kvt_tier_read_check has said 0. */
    uint8_t unchecked;

    /* Private to tiers/. */
    kvt_io_op_t op;
    kvt_tier_t *tier;
    kvt_tier_io_t *next;
    uint64_t submit_ns;
    uint64_t charge; /* footprint reserved by a write */
    /* kvt_tier_write_prepare's record sequence number and checksum (NVMe), for the next
     * kvt_tier_write of this io; prepared 0: made when the write starts. */
    uint64_t prep_seq, prep_sum;
    uint8_t prepared;
    /* A read's: which of its backend's servers answered it (the remote tier's node index), for
     * the backend's part of kvt_tier_read_corrupt. */
    uint32_t src;
    struct kvt__ioq_link {
        struct kvt__ioq_link *next;
        uint64_t deadline_ns; /* 0: none */
    } wait;                   /* where a tier holds it back (tiers/ioq.c) */
    uint64_t priv[4];
};

typedef struct kvt_tier_usage {
    uint64_t capacity_bytes;
    uint64_t used_bytes; /* sum of live blocks' footprints; never above capacity_bytes */
    uint64_t blocks;
    uint64_t reads, writes, read_bytes, written_bytes; /* successful operations */
    uint64_t misses, corrupt, errors, timeouts;
    uint64_t reclaimed;     /* live blocks dropped by the tier itself (NVMe segment reclaim) */
    uint64_t bounced_bytes; /* NVMe: payload bytes copied through a bounce buffer (a buffer not
                               KVT_TIER_DIRECT_ALIGN aligned) */
    uint64_t inflight;
    uint64_t quota_refused; /* writes, copies, adoptions and kvt_tier_ns_fits refused by a
                               namespace's quota */
} kvt_tier_usage_t;

/* Which tier kind this is, and its name in logs and metrics ("dram", "nvme", ...). */
kvt_tier_id_t kvt_tier_kind(const kvt_tier_t *t);
const char *kvt_tier_backend(const kvt_tier_t *t); /* "cuda", "host", "jemalloc", ... */

/* Submit a read or write. Returns 0 (the callback will run from kvt_tier_process), or an error
 * with nothing started: KVT_EINVAL (bad arguments, len 0 or above KVT_TIER_MAX_BLOCK), KVT_ENOSPC
 * (a write that does not fit the capacity), KVT_ETOOBIG (a block larger than the tier's unit:
 * an NVMe segment), KVT_EAGAIN (NVMe: no segment can be reclaimed while I/O is in flight on all of
 * them), KVT_EUNAVAIL, KVT_ENOMEM. A read of a location the tier does not hold is not an error
 * here: it completes with KVT_ENOENT. */
int kvt_tier_read(kvt_tier_t *t, kvt_tier_io_t *io);
int kvt_tier_write(kvt_tier_t *t, kvt_tier_io_t *io);
/*
 * Does ahead of io's kvt_tier_write the CPU work its start would do, so that the start (later,
 * from the tier's queue, under whatever lock its caller holds there) only lays the write out and
 * submits it. Safe from any thread, with no lock, while the tier serves others: it reads io and
 * its buffer and takes a number from an atomic counter. The NVMe tier takes the record's sequence
 * number and computes its checksum over the header and the payload (the same record as
 * without it); other tiers have nothing to do. io->key, buf and len must be as the write will
 * have them; it holds for io's next kvt_tier_write only. The sequence number is taken here, not
 * at the start: a write of the same block started between the two would win over this one at a
 * restart, so prepare only a write that no other write of its block can overtake (a PUT's, whose
 * page is BUSY). Returns 0, or KVT_EINVAL (nothing done: the start hashes as without it).
 */
int kvt_tier_write_prepare(kvt_tier_t *t, kvt_tier_io_t *io);
/* Takes the payload checksum that a read left unchecked (io->unchecked: check_later), after its
 * callback has run: 0, or KVT_ECORRUPT with io->status set to it and buf zeroed, as if the read
 * had failed. Reads io, its key's tokens and its buffer only: any thread may call it, with
 * nothing of the tier's held, while no one else uses io. Any other io: its status. */
int kvt_tier_read_check(kvt_tier_io_t *io);
/* Counts io, a read of t that failed kvt_tier_read_check, as t counts a corrupt read
 * (usage.corrupt) instead of a read (usage.reads, read_bytes), and leaves t as a read that failed
 * its check at completion would have: the remote tier counts the read as an error of the node
 * that answered it instead of a hit, and drops io->loc, if it still names the block, as a value
 * the server holds corrupt (usage.reclaimed, kvt_tier_remote_stats_t.evicted; no DEL). Once,
 * under whatever serialises the calls into t. Any other io (not a read of t, not unchecked, not
 * failed): nothing. */
void kvt_tier_read_corrupt(kvt_tier_t *t, const kvt_tier_io_t *io);
/* Frees a location written earlier; freeing an unknown or already freed location is a no-op.
 * A read of it already in flight still completes (with the data or a miss). */
void kvt_tier_free(kvt_tier_t *t, uint64_t loc, uint32_t len);
/* kvt_tier_free for a block that must not come back at a restart (a client removed it). The
 * NVMe tier now keeps that promise for every free (its DIR/kvtier.live), so for it this is a
 * free; kept as the call that says so. */
void kvt_tier_discard(kvt_tier_t *t, uint64_t loc, uint32_t len);
/* 1 when loc holds the block named key->hash (and key->ns_seed), 0 when not. */
int kvt_tier_valid(kvt_tier_t *t, uint64_t loc, const kvt_block_key_t *key);
/* Keeps (delta > 0) or stops keeping (delta < 0) the bytes at loc from being dropped by the tier
 * itself: an NVMe segment holding a pinned location is not reclaimed (a write that finds every
 * full segment pinned or busy fails with KVT_EAGAIN). Pins count; each +1 wants its -1. Tiers
 * that never drop blocks by themselves ignore it. Returns 0, or KVT_ENOENT (for +1) when loc does
 * not hold a block. Unpinning a location freed or reclaimed since is harmless. */
int kvt_tier_pin(kvt_tier_t *t, uint64_t loc, int delta);
/* Host pointer to a stored payload for memory tiers (DRAM, HBM's host backend); NULL for the
 * others. Valid until the location is freed. */
void *kvt_tier_ptr(kvt_tier_t *t, uint64_t loc);
/* Bytes a payload of len bytes would be charged (0 for len 0 or above KVT_TIER_MAX_BLOCK): the
 * same for every page size (a tier that stores the tokens charges room for the largest page). */
uint64_t kvt_tier_footprint(const kvt_tier_t *t, uint32_t len);
void kvt_tier_usage(const kvt_tier_t *t, kvt_tier_usage_t *u);
/* Blocks the tier has dropped by itself (reclaimed segments' and corrupt records' blocks), each
 * once: usage.reclaimed + usage.corrupt, but for the remote tier, which drops a value it finds
 * corrupt itself (usage.reclaimed, as one it no longer has), usage.reclaimed alone. Unlike a copy
 * of kvt_tier_usage, readable under the daemon's lock shared: these two counts move only under its
 * write lock, while inflight and misses move with reads that other loops submit. */
uint64_t kvt_tier_dropped(const kvt_tier_t *t);

/*
 * Quotas per namespace. Every charge (a block's footprint, a write or copy in flight) counts
 * against the namespace of its key (key.ns_seed) as well as the capacity; with a quota set, a
 * write, copy or adoption that would take a namespace past it fails with KVT_ENOSPC like one
 * over capacity (usage.quota_refused counts them), so no namespace ever holds more than the
 * quota in this tier, whatever the others hold. Lowering the quota drops nothing: a namespace
 * over it takes no more until its own blocks go.
 *   set_ns_quota  the bytes each namespace may hold; 0 for no quota. 0 or KVT_EINVAL.
 *   ns_used       what ns_seed holds now (footprints, writes in flight included).
 *   ns_fits       1 when ns_seed may take n more payloads of len bytes under its quota (the
 *                 capacity is not asked), 0 when not (counted as a refusal): for a caller that
 *                 would otherwise make room for a write the quota refuses.
 *   ns_top        up to max namespaces holding the most, largest first; returns how many.
 * Costs: a hash lookup per charge; memory: 16 bytes per namespace holding bytes.
 */
typedef struct kvt_tier_ns_usage {
    uint64_t ns_seed;
    uint64_t bytes;
} kvt_tier_ns_usage_t;
int kvt_tier_set_ns_quota(kvt_tier_t *t, uint64_t bytes);
uint64_t kvt_tier_ns_used(const kvt_tier_t *t, uint64_t ns_seed);
int kvt_tier_ns_fits(kvt_tier_t *t, uint64_t ns_seed, uint32_t len, uint32_t n);
size_t kvt_tier_ns_top(const kvt_tier_t *t, kvt_tier_ns_usage_t *out, size_t max);

int kvt_tier_fd(kvt_tier_t *t);
/* Runs the callbacks of ready completions; returns how many ran, or a negative error. */
int kvt_tier_process(kvt_tier_t *t);
/* Blocks up to timeout_ms (-1: no limit) for at least one completion, then processes: for tests
 * and tools, never for the service's loop. Returns how many callbacks ran (0 on timeout). */
int kvt_tier_wait(kvt_tier_t *t, int timeout_ms);

/* Destroys the tier. Requests still in flight are waited for (their callbacks do not run);
 * every stored block is freed (the NVMe data stays on disk for a warm restart). A copy whose
 * read from this tier (as src) or write to it (as dst) is in flight ends without its callback:
 * its staging buffer is freed, its reservation in dst given back, and its status says
 * KVT_ECLOSED (or the request's own error); the other tier must still exist. NULL: no-op. */
void kvt_tier_destroy(kvt_tier_t *t);

/*
 * Copies between tiers
 * --------------------
 * One call moves a block's bytes from a location in src to a new location in dst, written once
 * here for every pair of tiers: a memory source is written from its own memory, any other source
 * is read into a staging buffer first (pinned host memory when either side is a CUDA HBM tier,
 * so that the device copy is a real asynchronous DMA; sector-aligned memory otherwise). The caller
 * keeps the source location alive (and the block marked KVT_BLOCK_BUSY) until the callback, which
 * runs from kvt_tier_process() of dst (or of src when the read from src fails); status is 0 with
 * dst_loc filled, or the first error. The source is left as it was: freeing it (a move) is the
 * caller's choice.
 */
typedef struct kvt_tier_copy kvt_tier_copy_t;
typedef void (*kvt_tier_copy_cb)(kvt_tier_copy_t *c);

struct kvt_tier_copy {
    kvt_tier_t *src, *dst;
    uint64_t src_loc;
    kvt_block_key_t key; /* tokens borrowed until the callback */
    uint32_t len;
    kvt_tier_copy_cb cb;
    void *data;
    int status;
    uint64_t dst_loc;
    int dst_device; /* an HBM dst with several pools: the device wanted (kvt_tier_io_t.device) */

    /* Private to tiers/. */
    kvt_tier_io_t io;
    void *staging;
    int staging_pinned;
};

/* Returns 0 (the callback will run) or an error with nothing started (KVT_EINVAL, KVT_ENOSPC
 * when dst cannot take len bytes, KVT_ENOMEM). */
int kvt_tier_copy(kvt_tier_copy_t *c);

/* --- DRAM (tiers/dram.c) ---
 * Blocks are jemalloc allocations from an arena of their own whose memory comes from one region
 * mapped at creation (capacity plus a quarter for size-class and fragmentation slack). When a
 * CUDA device is usable the region is registered with cudaHostRegister, so copies to and from
 * HBM run from pinned memory. Locations are the payload's address. */
typedef struct kvt_tier_dram_conf {
    uint64_t capacity_bytes; /* > 0 */
    int pin;                 /* 0: register when a GPU is usable; 1: must register
                                (KVT_EUNAVAIL without a GPU); 2: never */
    uint32_t max_shared; /* shared arenas at most (0: none; kvt_tier_dram_share then KVT_ENOSPC) */
} kvt_tier_dram_conf_t;

/* Returns 0, KVT_EINVAL, KVT_ENOMEM, KVT_EUNAVAIL (pin = 1 without a GPU) or KVT_EIO (jemalloc
 * refused the arena). */
int kvt_tier_dram_create(kvt_tier_t **out, const kvt_tier_dram_conf_t *conf);
/* The tier's jemalloc arena index, for tests and metrics that read jemalloc's own stats. */
unsigned kvt_tier_dram_arena(const kvt_tier_t *t);
/* 1 when the DRAM region is registered with CUDA (pinned), 0 otherwise. Shared arenas (below)
 * are never pinned: registering would touch every page of their sparse memfds. A copy between
 * one and an HBM tier is still correct, only a synchronous copy from pageable memory. */
int kvt_tier_dram_pinned(const kvt_tier_t *t);
/* Bytes of the main region its arena has taken so far (blocks' extents and jemalloc's own
 * metadata): they stay mapped, never given back (fault-free reuse; a pinned region cannot
 * shrink), so this bounds what the region holds in memory. The shared arenas' memfds are
 * kvt_tier_dram_shared_stats' resident_bytes. 0 for another tier. */
uint64_t kvt_tier_dram_mapped(const kvt_tier_t *t);

/*
 * Shared arenas, for zero-copy local clients. A namespace (by its seed) may get an arena of its
 * own, backed by a memfd that the daemon passes to local clients of that namespace: from then on
 * every new DRAM block of that namespace (any write whose key.ns_seed is it, copies and
 * promotions included) is allocated there, so a client that maps the memfd sees its own
 * namespace's blocks and nobody else's. Blocks written before the arena existed stay where they
 * are (kvt_tier_dram_offset tells). The arenas count in the tier's one capacity.
 *
 * While an arena has no reference left but still holds blocks, it takes no new blocks (they go
 * to the main region again) and waits for its last block to be freed; sharing the namespace
 * again before that revives it. It keeps its slot (of max_shared) until it is destroyed. The
 * memfd is sealed against shrinking and growing (a client's ftruncate must not turn the tier's
 * own accesses into SIGBUS) and holds no allocator metadata; a client may still write any byte
 * of its namespace's blocks. The fd is valid only while the arena exists: send it (or dup it)
 * before the unshare that may destroy it. A write with buf NULL outside a shared arena (the
 * namespace not shared) leaves whatever a freed block of any namespace left there: make such a
 * block visible only once it has been filled.
 */
/* Creates ns_seed's arena, or finds it, and takes a reference on it. *fd is the tier's descriptor
 * (the caller must not close it; send it with SCM_RIGHTS or dup it), *map_bytes the length to
 * mmap (MAP_SHARED, offset 0). Returns 0, KVT_ENOSPC (max_shared arenas exist), KVT_EINVAL,
 * KVT_ENOMEM or KVT_EIO (memfd_create, ftruncate, mmap or jemalloc failed; logged). */
int kvt_tier_dram_share(kvt_tier_t *t, uint64_t ns_seed, int *fd, uint64_t *map_bytes);
/* Drops a reference. An arena with no reference and no block left is destroyed (at once, or
 * when its last block is freed): its memfd is closed and its region unmapped, so its slot and
 * memory are free for another namespace. */
void kvt_tier_dram_unshare(kvt_tier_t *t, uint64_t ns_seed);
/* 0 with *off set when loc (a location of this DRAM tier) lies in ns_seed's shared arena: the
 * payload starts *off bytes into the memfd. KVT_ENOENT when it does not (the main region, another
 * namespace's arena, no such arena, or t is not a DRAM tier). */
int kvt_tier_dram_offset(const kvt_tier_t *t, uint64_t ns_seed, uint64_t loc, uint64_t *off);
/* Shared arenas that exist now. */
uint32_t kvt_tier_dram_shared(const kvt_tier_t *t);
/* A shared arena keeps freed pages for its namespace's next blocks (no page faults, no zeroing)
 * while the tier's live blocks and every arena's kept pages, the main region's included, fit in
 * its capacity; this gives back
 * (holes punched in the memfd) what is over, the least recently written or freed arena's first,
 * and at once an unreferenced arena's: call it every tick. Once a second it also checks
 * each arena's memfd for pages a client made resident where no live block is (a write through
 * its mapping, an fallocate of the fd) and punches them. No-op for other tiers. */
void kvt_tier_dram_decay(kvt_tier_t *t);
/* That check and punch, now, whatever the time (tests). Returns 0 or KVT_EINVAL. */
int kvt_tier_dram_scan(kvt_tier_t *t);

typedef struct kvt_tier_dram_shared_stats {
    uint32_t arenas;         /* shared arenas that exist now (kvt_tier_dram_shared) */
    uint64_t scribbles;      /* kvt_tier_dram_check calls that found a sealed block changed */
    uint64_t sealed;         /* blocks sealed by hashing them here (seal, seal_later) */
    uint64_t sealed_as;      /* blocks sealed with a checksum the caller gave (seal_as) */
    uint64_t resident_bytes; /* bytes their memfds hold in memory now (st_blocks) */
    uint64_t punched_bytes;  /* bytes the checks punched: resident, held by no live block */
    uint64_t scans;          /* arenas the checks scanned (resident beyond what jemalloc holds) */
    uint64_t scan_ns;        /* time the checks took, scans included */
    uint64_t trims;         /* arenas kvt_tier_dram_decay purged (over capacity, or unreferenced) */
    uint64_t trimmed_bytes; /* bytes those purges gave back (their memfds' resident bytes) */
    /* Freed pages the tier keeps for reuse now: the shared arenas' (jemalloc's dirty pages) and
     * the main region's (touched by blocks since freed; never given back), not counted in
     * usage.used_bytes. kvt_tier_dram_decay keeps used_bytes plus this within the capacity while
     * the shared arenas have some to give back. */
    uint64_t kept_bytes;
} kvt_tier_dram_shared_stats_t;
/* Returns 0 with *st filled, or KVT_EINVAL (not a DRAM tier). */
int kvt_tier_dram_shared_stats(const kvt_tier_t *t, kvt_tier_dram_shared_stats_t *st);

/*
 * Scribbles. A client that maps its namespace's arena can still write over blocks it committed
 * (the namespace is the trust boundary for what it reads by location), which would change what
 * every later reader gets and what a demotion writes to NVMe or the remote tier, whose own
 * checksum would then cover the scribbled bytes. kvt_tier_dram_seal takes the XXH3-64 of a
 * block's payload as it is now (a zero-copy COMMIT); kvt_tier_dram_check compares the payload
 * with it when the block is about to leave (a demotion's copy, a GET through the socket). The
 * checksum follows the block when kvt_tier_dram_move_out moves it. Both return 0, KVT_ENOENT (no
 * block at loc) or KVT_EINVAL (not a DRAM tier); check also KVT_ECORRUPT when a sealed block's
 * bytes changed since (counted in kvt_tier_dram_shared_stats' scribbles and usage.corrupt). An
 * unsealed block always checks out. A read (kvt_tier_read) of a sealed block checks it too and
 * completes with KVT_ECORRUPT. Cost: one pass over the payload each (about 24 us per 2 MiB with
 * AVX-512, docs/tiers.md). */
int kvt_tier_dram_seal(kvt_tier_t *t, uint64_t loc);
int kvt_tier_dram_check(kvt_tier_t *t, uint64_t loc);
/* kvt_tier_dram_check without its writes, for a reader that may not change the tier (under a lock
 * held shared): 1 when the check would pass now and change nothing, 0 when it must run (a seal
 * under way, a sealed block's bytes changed, no block at loc, not a DRAM tier). */
int kvt_tier_dram_intact(const kvt_tier_t *t, uint64_t loc);
/* A seal taken a step at a time, so that the caller's loop never stalls for a whole block:
 * seal_later queues the block (0, KVT_ENOENT, KVT_EINVAL or KVT_ENOMEM) and marks it sealing;
 * seal_step hashes up to budget bytes of the queued blocks, oldest first, and returns how many
 * are still queued. A block that leaves while its seal is under way (check, read, move_out)
 * has it finished first, so its bytes leave as sealed; what a client writes between
 * seal_later and the seal's last step is sealed in, not detected. */
int kvt_tier_dram_seal_later(kvt_tier_t *t, uint64_t loc);
size_t kvt_tier_dram_seal_step(kvt_tier_t *t, size_t budget);
/* A seal whose checksum the caller has (XXH3-64 of the payload, seed 0): a client that hashed
 * each page as it copied it in and sent the sums with COMMIT. Nothing is read; a sum that is not
 * the payload's makes the block fail its first check, as a scribble does. Returns as
 * kvt_tier_dram_seal. */
int kvt_tier_dram_seal_as(kvt_tier_t *t, uint64_t loc, uint64_t sum);

/* An expired zero-copy reservation's block (loc, len in a shared arena) stops being a stored
 * block: unindexed and uncharged (others may use the capacity), its pages punched now and by
 * every check after, but its room stays allocated so that no other block is placed where a slow
 * client may still write. kvt_tier_dram_orphan_free frees the room. Returns 0, KVT_EINVAL or
 * KVT_ENOENT (not an indexed block of a shared arena). */
int kvt_tier_dram_orphan(kvt_tier_t *t, uint64_t loc, uint32_t len);
void kvt_tier_dram_orphan_free(kvt_tier_t *t, uint64_t loc, uint32_t len);
/* The namespace of an arena no reference holds (the one with the fewest blocks): 0, or
 * KVT_ENOENT when every arena is shared, KVT_EINVAL. */
int kvt_tier_dram_idle(const kvt_tier_t *t, uint64_t *ns_seed);
/* Moves the block at *loc out of its shared arena, which no reference may hold, into the main
 * region (same charge), and sets *loc to where it is now; the arena goes with its last block.
 * The caller makes sure no read of the old address is in flight. Returns 0, KVT_ENOENT (not a
 * block of a shared arena), KVT_EBUSY (the arena is shared), KVT_ENOSPC (the main region has no
 * room: fragmentation) or KVT_EINVAL. */
int kvt_tier_dram_move_out(kvt_tier_t *t, uint64_t *loc);

/* --- NVMe (tiers/nvme.c, tiers/nvme_recover.c) ---
 * One data file, DIR/kvtier.data, preallocated to capacity_bytes (rounded down to whole
 * segments) and used as a log of segments; see tiers/nvme.c for the layout. Opening a directory
 * that already holds a data file of the same geometry recovers the blocks in it (a warm
 * restart), which the owner of the index then takes back (below, "Recovery into an index").
 *
 * A block is charged its payload rounded up to 4 KiB plus 8 KiB of header room. Space on disk
 * comes back by whole segments: a segment is free again when its last block is freed. When the
 * log has no free segment left (live blocks scattered over all of them, or the ends of segments
 * too short for the next record), the write that needs space reclaims the full segment with the
 * fewest live bytes: its blocks are dropped (usage.reclaimed, reclaim_cb) and read as misses
 * from then on. Blocks of one size that divides the segment evenly never trigger that before
 * capacity is reached. A restart brings back exactly the blocks live at the stop: DIR/kvtier.live
 * marks them (docs/tiers.md); a block freed, discarded or reclaimed never comes back. A missing
 * or damaged side file (kvtier.meta, kvtier.live) or a data file of the wrong length fails the
 * creation with KVT_ECORRUPT and a log line naming the file. */
typedef struct kvt_tier_nvme_conf {
    const char *dir;         /* the data directory; created if missing */
    uint64_t capacity_bytes; /* data file size; at least 2 segments */
    uint32_t segment_bytes;  /* 0: 64 MiB; a multiple of 1 MiB, 1 MiB .. 1 GiB */
    uint32_t queue_depth;    /* io_uring entries; 0: 64; 2 .. 4096 */
    int direct;              /* 0: O_DIRECT, buffered where refused (logged once);
                                1: O_DIRECT or fail (KVT_EUNAVAIL); 2: buffered */
    int sparse;              /* 1: do not preallocate (a disk may then fill up under writes) */
    /* Called for each live block a segment reclaim drops, from inside the write that needed
     * the space, so that the owner of the index can forget it. Must not call into this tier.
     * May be NULL. */
    void (*reclaim_cb)(void *arg, uint64_t loc, uint64_t ns_seed, uint64_t hash);
    void *reclaim_arg;
} kvt_tier_nvme_conf_t;

/* Returns 0, KVT_EINVAL (also: the directory holds another geometry), KVT_ENOMEM, KVT_ENOSPC
 * (the file system cannot hold the data file: nothing is left behind), KVT_ECORRUPT (a side
 * file is missing or damaged, or the data file has the wrong length: logged, naming the file and
 * how to start afresh), KVT_EBUSY (another process has the directory), KVT_EUNAVAIL (direct = 1
 * refused, io_uring unavailable), KVT_EIO, or a negated errno from opening the directory. */
int kvt_tier_nvme_create(kvt_tier_t **out, const kvt_tier_nvme_conf_t *conf);
/* 1 when the data file is open with O_DIRECT. */
int kvt_tier_nvme_direct(const kvt_tier_t *t);
/* The largest payload a block of a page of page_size tokens can have here: a record (its header,
 * which holds the page's tokens, then the payload) never spans segments, so a larger write fails
 * with KVT_ETOOBIG whatever room is free. 0 when t is not an NVMe tier. */
uint32_t kvt_tier_nvme_max_block(const kvt_tier_t *t, uint32_t page_size);

typedef struct kvt_tier_nvme_recovery {
    uint64_t scanned;   /* records found on disk with a valid header */
    uint64_t recovered; /* blocks kept after the scan (tier usage counts them) */
    uint64_t torn;      /* records whose checksum failed during the scan, skipped */
    uint64_t stale;     /* older copies of a block written again later, skipped */
    uint64_t gaps;      /* stretches with no record and intact records after them (a crash) */
    uint64_t discarded; /* records of blocks dropped before the stop (freed, removed, or
                           reclaimed in a segment still holding live blocks), stepped over */
    uint64_t inserted;  /* blocks the index took back (marked indexed during recovery) */
    uint64_t orphans;   /* blocks whose namespace or ancestors were not found: freed */
} kvt_tier_nvme_recovery_t;

/* What the scan at creation found (inserted/orphans stay 0 until kvt_tier_nvme_recover_end). */
void kvt_tier_nvme_recovery(const kvt_tier_t *t, kvt_tier_nvme_recovery_t *out);

/*
 * Records a namespace description in DIR/namespaces so that a later recovery can name it again
 * (kvt_tier_nvme_ns_t). Strings follow kvt_ns_describe (adapter and salt may be NULL) and
 * must not hold tabs or newlines. Recording the same namespace twice is a no-op: the file is
 * read once, on the first call, and the descriptions it holds are kept as a set of hashes (8-16
 * bytes each), so a call costs a hash lookup and, for a new one, an append. The append is not
 * fsync'd (the name is all it adds: blocks come back by seed without it). When the file reaches
 * 4,096 lines, and each time it doubles from what the last compaction left, it is rewritten to
 * the namespaces that hold blocks in the tier (one pass over the tier's location index), so it
 * stays as big as what is on disk however many tenants come and go; a tenant dropped while it
 * had no block is listed again at its next call. Returns 0, KVT_EINVAL or a negated errno.
 */
int kvt_tier_nvme_add_ns(kvt_tier_t *t, const char *model, const char *adapter, const char *salt,
                         uint32_t page_size);

/*
 * Recovery into an index
 * ----------------------
 * The tier does not know the index: it yields what the scan found as token paths, and the owner
 * of the index puts them back (kvtierd: kvt_store_nvme_recover in server/store.c). Call once,
 * after creation and before any write:
 *
 *   kvt_tier_nvme_recover_begin()   the namespaces of the blocks on disk, each with its
 *                                   description where kvt_tier_nvme_add_ns recorded one; the
 *                                   caller opens them (by name, else by seed) and sets `named`
 *                                   on those it opened by their description
 *   kvt_tier_nvme_recover_next()    one token path at a time: the deepest blocks (those no other
 *                                   block names as parent), each rebuilt by following parent
 *                                   hashes back to the namespace seed, with the block of every
 *                                   page on it; the caller indexes them and sets `indexed` on
 *                                   each block its index now names at its location
 *   kvt_tier_nvme_recover_end()     frees, for good, every block not indexed (orphans: their
 *                                   chain of ancestors is incomplete on disk, their page size is
 *                                   not their namespace's, their namespace could not be opened,
 *                                   or the index holds their page elsewhere), rewrites
 *                                   DIR/namespaces to the lines of the namespaces opened by name,
 *                                   and fills the counts
 *
 * Pointers handed out stay valid until kvt_tier_nvme_recover_end (paths: until the next
 * kvt_tier_nvme_recover_next).
 */
typedef struct kvt_tier_nvme_ns {
    uint64_t seed;
    uint32_t page_size; /* the namespace's: blocks of another page size are orphans */
    /* Its description in DIR/namespaces (adapter and salt "" when absent), or model NULL when
     * only the seed is known: open it with its seed then. */
    const char *model, *adapter, *salt;
    int named; /* set by the caller: opened by this description, whose line is kept */
} kvt_tier_nvme_ns_t;

/*
 * Window blocks behind a gap (docs/protocol.md, "Chains with gaps"). Recovery finds a block by
 * its chain of parents' records; a block whose parent page holds no bytes (a sliding window's
 * first page after pages stored index-only) has none. Its owner, writing such a block to this
 * tier, records the path in front of it: tokens holds the npages x key->ntokens tokens of pages
 * [0, npages) from the namespace's root, the block being page npages (key as the block's write
 * has it: ns_seed, hash, parent, ntokens the page size). A recovery that finds the block gives
 * its path back with those pages index-only (kvt_tier_nvme_path_t: blocks[i] NULL). Kept in
 * DIR/kvtier.paths (an append, not synced; compacted to the blocks the tier holds when it has
 * doubled since the last compaction, from 1 MiB; a directory without it recovers as before).
 * Returns 0, KVT_EINVAL (not NVMe, npages 0, a path over KVT_NVME_PATH_MAX_TOKENS tokens: not
 * recorded, the window is an orphan after a restart), KVT_ENOMEM or a negated errno.
 */
#define KVT_NVME_PATH_MAX_TOKENS (1u << 20)
int kvt_tier_nvme_add_path(kvt_tier_t *t, const kvt_block_key_t *key, const uint32_t *tokens,
                           uint32_t npages);

typedef struct kvt_tier_nvme_block {
    uint64_t loc;
    uint64_t hash; /* its prefix hash: the index's block at this page must have it */
    uint32_t len;  /* payload bytes */
    int indexed;   /* set by the caller: the index names this block at loc */
} kvt_tier_nvme_block_t;

typedef struct kvt_tier_nvme_path {
    size_t ns;              /* index in the array kvt_tier_nvme_recover_begin gave */
    uint32_t npages;        /* pages on the path, >= 1 */
    const uint32_t *tokens; /* npages * page_size tokens, from the namespace's root */
    /* blocks[i]: the block of page i. A block shared by several paths comes in each of them.
     * NULL: page i has no block here, only its tokens (a gap kvt_tier_nvme_add_path recorded):
     * index it without bytes. */
    kvt_tier_nvme_block_t *const *blocks;
} kvt_tier_nvme_path_t;

/* Returns 0 with *ns (NULL when no block was found) and *nns set, KVT_EINVAL, KVT_ENOMEM, or
 * KVT_EBUSY (called after kvt_tier_nvme_recover_begin or kvt_tier_nvme_drop_recovered). */
int kvt_tier_nvme_recover_begin(kvt_tier_t *t, kvt_tier_nvme_ns_t **ns, size_t *nns);
/* Fills *p with the next path. Returns 1, 0 when there is none left, KVT_ENOMEM, or KVT_EINVAL
 * (not between begin and end). */
int kvt_tier_nvme_recover_next(kvt_tier_t *t, kvt_tier_nvme_path_t *p);
/* Ends recovery. failed != 0 (the caller gave up half-way: its error is what counts) skips
 * freeing the blocks not indexed. out (may be NULL) gets the counts, inserted being the blocks
 * marked indexed. Returns 0, or KVT_EINVAL (not after begin). */
int kvt_tier_nvme_recover_end(kvt_tier_t *t, int failed, kvt_tier_nvme_recovery_t *out);
/* Instead of recovery, for a start that does not recover: frees every block the
 * scan found, for good, so that they neither hold the tier's capacity with no index naming them
 * nor come back at a later restart. Returns how many, or KVT_EINVAL or KVT_EBUSY (called after
 * either of the two). */
long kvt_tier_nvme_drop_recovered(kvt_tier_t *t);

/* --- HBM (tiers/hbm.c) ---
 * A pool of device memory allocated once and carved into slots (a bitmap allocator; a block
 * takes a run of whole slots). backend "cuda": cudaMalloc'd memory, copies in batches (one
 * cudaMemcpyBatchAsync each, cudaMemcpyAsync per copy where that is refused) on a few streams per
 * direction, completions through CUDA events polled from the tier's fd (a timerfd armed while
 * copies are in flight); needs a usable GPU, else creation fails with KVT_EUNAVAIL and logs why.
 * "auto" is "cuda". "host": the same pool in ordinary memory, for testing four tiers on machines
 * without a GPU; chosen only explicitly, logged, and named by kvt_tier_backend().
 *
 * Batches, both backends: a read or write submitted is queued, and what was queued goes out in
 * batches on the tier's next kvt_tier_process (the submit makes kvt_tier_fd readable), or at
 * once when its direction has `batch` copies queued and the submitter is the thread that created
 * the tier. Requests submitted together in one turn of the caller's loop thus complete together,
 * one batch per direction (tiers/hbm.c). Every copy (and every CUDA call but the IPC export's)
 * is made by kvt_tier_process or a submission on the creating thread, which must be the one that
 * processes the tier: a submission from another thread (under the caller's serialisation) only
 * queues and kicks. */
typedef struct kvt_tier_hbm_conf {
    const char *backend;     /* "cuda", "host" or "auto"; NULL: "auto" */
    uint64_t capacity_bytes; /* each pool's size, rounded down to whole slots */
    uint32_t slot_bytes;     /* 0: 64 KiB; a power of two, 4 KiB .. 16 MiB */
    int device;              /* CUDA device ordinal of the one pool (ndevices 0) */
    uint32_t streams;        /* 0: 4 (half each way); 1 .. 16, per pool */
    uint32_t batch;          /* most copies in one batch; 0: 16; 1: each copy at once; .. 256 */
    /* One pool per device listed (distinct ordinals >= 0, at most KVT_HBM_MAX_DEVICES), each of
     * capacity_bytes; the tier's capacity is their sum. ndevices 0: one pool on `device`. The
     * host backend takes the list too: ordinary memory per "device", for testing. Borrowed for
     * the call. */
    const int *devices;
    uint32_t ndevices;
} kvt_tier_hbm_conf_t;

/* How the tier's copies went out: batches (one call each) and the copies in them. */
typedef struct kvt_tier_hbm_stats {
    uint64_t batches;
    uint64_t copies;
    uint32_t largest;   /* copies in the largest batch so far */
    uint32_t batch_max; /* the configured most */
    const char *api;    /* "cudaMemcpyBatchAsync", "cudaMemcpyAsync" (batch 1, or refused),
                           "memcpy" (host); static */
} kvt_tier_hbm_stats_t;

/* Returns 0, or KVT_EINVAL when t is not an HBM tier. */
int kvt_tier_hbm_stats(const kvt_tier_t *t, kvt_tier_hbm_stats_t *out);

/*
 * Several devices. An HBM tier may hold one pool per CUDA device of the node (conf->devices).
 * To its owner it is still one tier whose capacity is the sum: a write goes to the pool of the
 * device it names (kvt_tier_io_t.device) and, where that pool is full, to the pool with the most
 * room, so a write fails with KVT_ENOSPC only when no pool has room, as for one pool, and the
 * policy's accounting of one capacity stays exact. A device the tier has no pool on wants the
 * first pool. Each pool never holds more than its own
 * capacity. A location names its pool: kvt_tier_hbm_device() says which.
 */
#define KVT_HBM_MAX_DEVICES 16
typedef struct kvt_tier_hbm_pool {
    int device;              /* its CUDA device ordinal (the host backend's stand-in number) */
    uint64_t capacity_bytes; /* the pool's size */
    uint64_t used_bytes;     /* whole slots held by its blocks (writes in flight included) */
    uint64_t blocks;         /* blocks in it (writes in flight included) */
} kvt_tier_hbm_pool_t;
/* Fills out[0 .. min(n, pools) - 1] in the order the devices were configured and returns the
 * number of pools, or KVT_EINVAL when t is not an HBM tier (out may be NULL when n is 0). */
int kvt_tier_hbm_pools(const kvt_tier_t *t, kvt_tier_hbm_pool_t *out, uint32_t n);
/* The device of the pool holding loc, or KVT_ENOENT when loc is no live location of this tier
 * (KVT_EINVAL when t is not an HBM tier). */
int kvt_tier_hbm_device(const kvt_tier_t *t, uint64_t loc);

/* Returns 0, KVT_EINVAL, KVT_ENOMEM, or KVT_EUNAVAIL (no usable GPU, or no CUDA in this build). */
int kvt_tier_hbm_create(kvt_tier_t **out, const kvt_tier_hbm_conf_t *conf);
/* The device address of a stored block (an engine's kernels read it), or NULL for an unknown
 * location. For the host backend it is the host address. Valid until the location is freed. */
void *kvt_tier_hbm_devptr(kvt_tier_t *t, uint64_t loc);
/* 1 when a CUDA device is usable by this process (counts devices once and caches it). */
int kvt_tier_cuda_usable(void);

/*
 * CUDA IPC export of the HBM pool, for zero-copy local clients. The pool is one cudaMalloc
 * allocation, so one handle opens all of it: kvtierd exports it only where every local client
 * is one tenant (its hbm-ipc setting). A client opens the handle with cudaIpcOpenMemHandle in
 * its own process (not the daemon's: CUDA refuses a handle in the process that made it) and
 * reads a block at its offset while its lease holds.
 */
#define KVT_HBM_IPC_HANDLE 64 /* sizeof(cudaIpcMemHandle_t) */
/* Fills handle and *pool_bytes for the pool on `device`, or the first pool where the tier has
 * none on it, and returns the device of the pool exported (>= 0). KVT_EUNAVAIL with the host
 * backend or a build without CUDA, KVT_EIO when cudaIpcGetMemHandle fails (logged), KVT_EINVAL
 * when t is not an HBM tier. */
int kvt_tier_hbm_ipc(kvt_tier_t *t, int device, uint8_t handle[KVT_HBM_IPC_HANDLE],
                     uint64_t *pool_bytes);
/* 0 with *off the payload's byte offset in its pool (kvt_tier_hbm_device names it) when loc is
 * a live location of this HBM tier; KVT_ENOENT otherwise (KVT_EINVAL when t is not an HBM
 * tier). Works for both backends. */
int kvt_tier_hbm_offset(const kvt_tier_t *t, uint64_t loc, uint64_t *off);
/* The client's side, in the client's process: maps a handle received from kvtierd (made by
 * kvt_tier_hbm_ipc) on CUDA device `device` (the pool's, or one with peer access to it, enabled
 * lazily) and sets *base to the pool's first byte there; a block's payload is at *base + its
 * offset, for copies and kernels on that device, and its bytes stay put while its lease holds.
 * The mapping stays until kvt_tier_hbm_ipc_close, best called before the daemon frees its pool
 * (CUDA leaves a mapping of freed memory undefined). Returns 0, KVT_EINVAL, KVT_EUNAVAIL (a build
 * without CUDA, or no usable device) or KVT_EIO (CUDA refused the handle, logged: in the process
 * that made it, for one). */
int kvt_tier_hbm_ipc_open(const uint8_t handle[KVT_HBM_IPC_HANDLE], int device, void **base);
/* Unmaps what kvt_tier_hbm_ipc_open mapped. Returns 0, KVT_EINVAL (base NULL), KVT_EUNAVAIL (a
 * build without CUDA) or KVT_EIO (CUDA refused, logged: base was no such mapping, for one). */
int kvt_tier_hbm_ipc_close(void *base);

/* --- remote (tiers/remote.c) ---
 * Blocks as string values in a Valkey or Redis server (hiredis, plain TCP, optional AUTH and
 * SELECT). The key is "<key_prefix>:<ns_seed as 16 hex>:<hash as 16 hex>", so every kvtierd
 * pointed at the same server finds the blocks another one stored; the value is the stored block
 * header, the tokens and the payload, checked on every read (a mismatch is a KVT_ECORRUPT miss).
 * Reads go by key: a read with loc 0 (or any location this tier did not hand out) asks the
 * server for io->key all the same, which is how a block stored by another process is found.
 * Locations handed out by writes name the key for kvt_tier_free, which DELs it (unless
 * keep_on_free: then the tier deletes no key at all, neither on a free nor after a write that
 * timed out and landed late, since other processes may rely on a shared key). A block the server
 * dropped by itself (maxmemory eviction, ttl) reads as KVT_ENOENT and its charge is given back
 * (usage.reclaimed).
 *
 * Charge: a block costs len + kvt__blockhdr_size(KVT_PAGE_MAX) bytes (the payload plus the
 * largest stored header, which also covers the server's per-key overhead): usage never passes
 * capacity_bytes, and a write that does not fit fails with KVT_ENOSPC. The server's own limit is
 * separate: a server that answers a SET with an OOM error completes it with KVT_ENOSPC.
 *
 * Non-blocking: one connection, pipelined (up to max_inflight requests unanswered), driven from
 * the tier's fd; connecting, the handshake and reconnecting never block the caller. A host
 * name is looked up on a thread of the tier's own, at creation (which does not wait for it) and
 * again before reconnecting after a connection to its address failed or was lost; while a lookup
 * runs the server counts as down. A lookup that fails is logged and retried with the backoff
 * (connecting meanwhile to the last address found, if any). An address literal is never looked
 * up. A request not answered within timeout_ms completes with KVT_ETIMEDOUT (a write that
 * lands after its timeout is deleted again, unless keep_on_free). When the server goes away, every
 * request in flight and every request submitted before the next connection is up fails with
 * KVT_EUNAVAIL (submit returns it while the tier waits out its backoff); the tier reconnects by
 * itself with exponential backoff, from backoff_min_ms doubling up to backoff_max_ms (each wait
 * +-25% at random). A connection that has answered nothing for twice timeout_ms is closed and
 * retried. The timers run from kvt_tier_process, so the caller's loop keeps polling the fd while
 * the server is down. kvt_tier_destroy leaves stored blocks on the server (they serve the fleet, or
 * the next run); DELs still queued get up to 200 ms to go out.
 *
 * Cluster mode (cluster = 1): a Redis or Valkey Cluster, reached through seeds, a list of any
 * of its nodes. The tier learns the slot map (CLUSTER SLOTS) from the first node that answers,
 * sends each key to the primary owning its hash slot (CRC16 of the whole key, as the server
 * computes it: kvt_tier_remote_key_slot), one connection per primary, each pipelined as above
 * (max_inflight and the timeouts are per node). A MOVED reply re-routes the request and
 * refreshes the map, an ASK sends it once more with ASKING, at most 5 redirects per request
 * (then KVT_EIO). A lost node, a timeout or a redirect refreshes the map (at most every 100 ms,
 * and for as long as a node owning slots is down), so that a replica promoted in a failover is
 * found without a restart. Requests to a node that is down fail with KVT_EUNAVAIL as above, each
 * node with its own backoff. The password is sent to every node; db must be 0 and the prefix
 * may not hold braces (a hash tag would put every key in one slot).
 */
typedef struct kvt_tier_remote_conf {
    const char *host;        /* address literal or host name; copied */
    uint16_t port;           /* 0: 6379 */
    const char *password;    /* AUTH password; NULL: none; copied */
    int db;                  /* SELECT index (0 .. 65535); 0: no SELECT */
    const char *key_prefix;  /* NULL: "kvt"; 1 .. 64 bytes, no spaces or control bytes */
    uint64_t capacity_bytes; /* > 0 */
    uint32_t ttl_s;          /* SET ... EX ttl_s; 0: no expiry */
    uint32_t timeout_ms;     /* per request; 0: 2000 */
    uint32_t backoff_min_ms; /* first reconnect delay; 0: 50 */
    uint32_t backoff_max_ms; /* 0: 5000 */
    uint32_t max_inflight;   /* requests sent and unanswered; 0: 64 */
    int keep_on_free;        /* 1: kvt_tier_free only forgets (the ttl or eviction clears it) */
    int cluster;             /* 1: a Redis/Valkey Cluster: seeds, not host and port */
    const char *seeds;       /* cluster: "HOST:PORT[,HOST:PORT...]", any of its nodes; parsed */
} kvt_tier_remote_conf_t;

/* Returns 0, KVT_EINVAL, KVT_ENOMEM or a negated errno (epoll, timerfd, eventfd). A server that
 * is down is not an error here: the tier starts disconnected and keeps trying. */
int kvt_tier_remote_create(kvt_tier_t **out, const kvt_tier_remote_conf_t *conf);

/* 1 once the connection is up and the handshake (AUTH, SELECT or PING) was answered; in
 * cluster mode, once the slot map is known and every node owning slots is up. */
int kvt_tier_remote_connected(const kvt_tier_t *t);

/* Formats the server key of (ns_seed, hash) into buf; returns its length, or KVT_EINVAL (not a
 * remote tier, or cap too small: KVT_TIER_REMOTE_KEY_MAX always fits). */
#define KVT_TIER_REMOTE_KEY_MAX 100
int kvt_tier_remote_key(const kvt_tier_t *t, uint64_t ns_seed, uint64_t hash, char *buf,
                        size_t cap);

/* The cluster hash slot (0 .. 16383) of a key of len bytes: CRC16 of the key, or of its hash
 * tag (the bytes between the first '{' and the next '}', when not empty), modulo 16384. */
uint16_t kvt_tier_remote_key_slot(const char *key, size_t len);

/* Parses "HOST:PORT" or "[V6]:PORT" into host (cap bytes) and port. Returns 0 or KVT_EINVAL. */
int kvt_tier_remote_parse_addr(const char *s, char *host, size_t cap, uint16_t *port);

/* Connection-level counters (request outcomes are in kvt_tier_usage). */
typedef struct kvt_tier_remote_stats {
    uint64_t connect_attempts, connects, connect_failures, disconnects, auth_failures;
    uint64_t unavailable;  /* requests and probes failed with KVT_EUNAVAIL */
    uint64_t timeouts;     /* requests and probes failed with KVT_ETIMEDOUT */
    uint64_t late_replies; /* replies that came after their request timed out */
    uint64_t undone;       /* DELs sent for writes that may have landed after failing */
    uint64_t undo_kept;    /* such writes left in place instead: keep_on_free (shared keys) */
    uint64_t evicted;      /* our blocks the server no longer had (or held corrupt) */
    uint64_t probes;
    uint64_t oversized;     /* GET values longer than the block asked for, refused unbuffered */
    uint64_t skipped_bytes; /* their bytes, read off the socket and dropped */
    uint64_t direct_reads;  /* GET values read from the socket straight into the caller's buffer */
    uint64_t direct_copied; /* their payload bytes that came in another read, copied from there */
    /* Host names (a host given as an address is never looked up). */
    uint64_t lookups;         /* each on a thread of its own, off the caller's */
    uint64_t lookup_failures; /* lookups that found no address */
    /* Cluster mode. */
    uint64_t moved, asks;     /* MOVED and ASK replies */
    uint64_t redirect_errors; /* redirects not followed (bad address, too many): KVT_EIO */
    uint64_t map_refreshes;   /* slot maps applied */
    uint64_t map_errors;      /* slot-map replies refused as malformed (the map kept) */
    uint64_t failovers;       /* primaries lost whose slots a refreshed map gave another node */
    uint64_t nodes;           /* primaries the map names (a gauge; 1 for a single server) */
} kvt_tier_remote_stats_t;

void kvt_tier_remote_stats(const kvt_tier_t *t, kvt_tier_remote_stats_t *out);

/*
 * One server's counters: the single server, or each cluster node the tier knows (its seeds,
 * the primaries its maps named, the nodes redirects named; a node is never forgotten, so an
 * index names the same node for the tier's life). Requests are counted on the node that answered
 * them or that they failed on (after a redirect, on the node that took them).
 */
#define KVT_TIER_REMOTE_ADDR_MAX 264 /* "host:port": host up to 255 bytes */
typedef struct kvt_tier_remote_node_stats {
    char addr[KVT_TIER_REMOTE_ADDR_MAX];
    uint32_t slots;  /* hash slots the map gives it now (0: no primary now; 16384 for one server) */
    int up;          /* its connection is up (handshake answered) */
    uint64_t hits;   /* GETs it answered with a block that checked out */
    uint64_t misses; /* GETs it answered with nil (never stored, evicted, expired, lost) */
    uint64_t errors; /* requests that failed there: an error reply, a timeout, a lost connection,
                        a value refused as corrupt */
    uint64_t moved, asks;   /* redirects it answered */
    uint64_t map_refreshes; /* slot maps it sent that were applied */
    uint64_t failovers;     /* times it was lost and a refreshed map gave its slots to another */
} kvt_tier_remote_node_stats_t;

/* Fills *out with node i's counters when i is below the number of nodes known; returns that
 * number (1 for a single server), or KVT_EINVAL (not a remote tier, out NULL). */
int kvt_tier_remote_node_stats(const kvt_tier_t *t, uint32_t i, kvt_tier_remote_node_stats_t *out);

/*
 * The longest-prefix probe: given the keys of the next n blocks of a prefix, asks the server
 * whether each exists, all in one pipelined round trip (one EXISTS per key), and reports how many
 * consecutive ones from keys[0] exist. Only ns_seed and hash of each key are used. The caller
 * owns p and keys until the callback, which runs from kvt_tier_process (never inside this call);
 * status is 0 with found set, or KVT_EUNAVAIL, KVT_ETIMEDOUT, KVT_EAUTH, KVT_EIO (found 0).
 * Existence is a hint: a block may still be evicted before it is read.
 */
#define KVT_TIER_PROBE_MAX 256
typedef struct kvt_tier_probe kvt_tier_probe_t;
typedef void (*kvt_tier_probe_cb)(kvt_tier_probe_t *p);

struct kvt_tier_probe {
    const kvt_block_key_t *keys;
    uint32_t n; /* 1 .. KVT_TIER_PROBE_MAX */
    kvt_tier_probe_cb cb;
    void *data; /* the caller's */
    int status;
    uint32_t found;

    /* Private to tiers/. */
    uint32_t pending, first_missing;
    kvt_tier_probe_t *next;
};

/* Returns 0 (the callback will run) or, with nothing started: KVT_EINVAL (not a remote tier, n
 * out of range, no cb), KVT_EUNAVAIL (the server is down), KVT_ENOMEM. Destroying the tier with
 * a probe in flight drops its callback. */
int kvt_tier_remote_probe(kvt_tier_t *t, kvt_tier_probe_t *p);

#endif
