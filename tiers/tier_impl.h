/*
 * tier_impl.h: how a backend plugs into tier.c. Internal to tiers/ (kvt__ names).
 *
 * The shared part, written once in tier.c: the index of stored locations (location -> block
 * hash, namespace, length, footprint), capacity accounting (reserve a write's footprint at
 * submit, give it back on failure or free), the completion queue and its eventfd, the epoll fd
 * the caller polls, usage counters, and copies between tiers. A backend only moves bytes: it
 * implements the ops below, and reports each finished request with kvt__tier_complete(), from
 * inside its poll op or from the submitting call (tier.c then delivers it on the next
 * kvt_tier_process, never inside the submit).
 *
 * Locations are never 0 (0 means "none" to callers). tier.c calls a backend's read only for a
 * location its index holds with the right hash and length (unless the backend sets
 * unindexed_reads: a remote server may hold blocks another process stored), and its free only
 * for an indexed location, once.
 */
#ifndef KVT_TIER_IMPL_H
#define KVT_TIER_IMPL_H

#include "config.h"
#include "tier.h"

typedef struct kvt_tier_ops {
    const char *backend;
    /* Reads of locations the index does not hold go to the backend instead of missing. */
    int unindexed_reads;
    /* The backend drops a block that a read finds corrupt itself (kvt__tier_drop, counted in
     * usage.reclaimed), so kvt_tier_dropped leaves usage.corrupt out: the remote tier, where the
     * block would count twice, and a re-read of a value already dropped (unindexed_reads) once
     * more with nothing dropped. */
    int drops_corrupt;
    /* A copy that stages through host memory on its way to or from this tier stages through
     * pinned memory (tier.c's cache): a CUDA copy from pageable memory is synchronous and
     * bounces through the driver's own buffer. */
    int pinned_staging;
    /* Bytes charged for a payload of len bytes (1 .. KVT_TIER_MAX_BLOCK), whatever the page
     * size: room for the largest page's header where the tier stores one. NULL: len. */
    uint64_t (*footprint)(const kvt_tier_t *t, uint32_t len);
    /* Start a write of io->len bytes from io->buf; fill io->loc (never 0, not a live location)
     * before completing with 0. Capacity has already been reserved by tier.c. Return 0
     * (completion comes later) or a negative error (nothing was started, nothing is kept). */
    int (*write)(kvt_tier_t *t, kvt_tier_io_t *io);
    /* Start a read of io->loc into io->buf. Same contract as write. */
    int (*read)(kvt_tier_t *t, kvt_tier_io_t *io);
    /* kvt_tier_write_prepare: the CPU work of a write's start done ahead, from any thread. May be
     * NULL: nothing to do ahead. */
    int (*prepare)(kvt_tier_t *t, kvt_tier_io_t *io);
    /* Forget an indexed location (tier.c has already unindexed and uncharged it). */
    void (*free)(kvt_tier_t *t, uint64_t loc, uint32_t len);
    /* kvt_tier_discard: free, and make sure a restart does not bring the block back (NVMe). May
     * be NULL: free is enough. */
    void (*discard)(kvt_tier_t *t, uint64_t loc, uint32_t len);
    /* kvt_tier_read_corrupt: what the backend's own completion does for a read that fails its
     * payload checksum there, for a read that completed 0 with the checksum left to its caller
     * (check_later) and failed it since; tier.c has already moved the usage counts. May be
     * NULL: nothing besides the counts. */
    void (*read_corrupt)(kvt_tier_t *t, const kvt_tier_io_t *io);
    /* Extra validity check after the index said yes (a stale NVMe generation). May be NULL. */
    int (*valid)(kvt_tier_t *t, uint64_t loc, const kvt_block_key_t *key);
    void *(*ptr)(kvt_tier_t *t, uint64_t loc); /* may be NULL */
    /* kvt_tier_pin for a tier that drops blocks by itself; tier.c has checked that loc is
     * indexed for a +1. May be NULL. */
    int (*pin)(kvt_tier_t *t, uint64_t loc, int delta);
    /* The backend's own pollable fd (io_uring's eventfd, an epoll fd over sockets), or -1 when
     * the backend completes everything through kvt__tier_complete() at submit time. May be
     * NULL (the same as -1). Asked once, right after kvt__tier_init. */
    int (*fd)(kvt_tier_t *t);
    /* Harvest whatever is ready without blocking; call kvt__tier_complete for each. May be
     * NULL. Returns >= 0 or a negative error. */
    int (*poll)(kvt_tier_t *t);
    /* Called by kvt_tier_destroy once nothing is in flight; frees impl and its resources. */
    void (*destroy)(kvt_tier_t *t);
} kvt_tier_ops_t;

/* One indexed location. */
typedef struct kvt__tier_ent {
    uint64_t loc;
    uint64_t hash;
    uint64_t ns_seed;
    uint64_t charge;
    uint32_t len;
    uint32_t used; /* 0: empty slot */
    /* DRAM: XXH3-64 of the payload when sealed (kvt_tier_dram_seal), checked as it leaves. */
    uint64_t sum;
    uint32_t sealed;
} kvt__tier_ent_t;

struct kvt_tier {
    const kvt_tier_ops_t *ops;
    kvt_tier_id_t kind;
    void *impl; /* the backend's state */
    kvt_tier_usage_t usage;
    int efd;       /* eventfd for completions queued by kvt__tier_complete */
    int pfd;       /* epoll fd over efd and the backend's fd: what kvt_tier_fd returns */
    int bfd;       /* the backend's fd, or -1 */
    int delivered; /* 0 while destroying: completions are dropped, not called back */
    kvt_tier_io_t *done_head, *done_tail;
    /* The location index: open addressing, linear probing, backward-shift deletion. */
    kvt__tier_ent_t *ents;
    size_t ents_cap; /* power of two */
    uint64_t pending_writes;
    /* Bytes charged per namespace (blocks and writes in flight), open addressing by seed with
     * backward-shift deletion (an entry whose bytes fall to 0 goes), and the quota each may
     * hold (0: none). */
    struct kvt__tier_ns {
        uint64_t seed, bytes; /* bytes 0: empty slot */
    } * nss;
    size_t nss_cap, nss_n;
    uint64_t ns_quota;
};

#if KVT_HAVE_CUDA
/* A CUDA tier opens (kvt__pinned_open) and closes (kvt__pinned_close): while any is open, the
 * copy code (tier.c) keeps the pinned staging buffers of finished copies in a small cache for
 * the next ones; the last close frees them. Thread-safe. */
void kvt__pinned_open(void);
void kvt__pinned_close(void);
#endif

/*
 * The request queue (tiers/ioq.c), for a backend that holds requests back: two FIFOs (urgent
 * reads a client waits for, and the rest), a window of requests in flight, deadlines, and a free
 * list of the backend's own request structs (its slots). Whatever is queued embeds a
 * kvt__ioq_link_t (a kvt_tier_io_t has one: wait); KVT__IOQ_OF gets the struct back. Not
 * thread-safe: a tier is used by one thread.
 */
typedef struct kvt__ioq_link kvt__ioq_link_t; /* tier.h: next, deadline_ns (0: none) */

#define KVT__IOQ_OF(link, type, member) ((type *)(void *)((char *)(link)-offsetof(type, member)))

typedef struct kvt__ioq_fifo {
    kvt__ioq_link_t *head, *tail;
    uint32_t n;
} kvt__ioq_fifo_t;

typedef struct kvt__ioq {
    kvt__ioq_fifo_t wait[2]; /* [1] urgent, [0] the rest */
    uint32_t window;         /* most requests in flight */
    uint32_t inflight;       /* started (kvt__ioq_pop, kvt__ioq_start) and not finished */
    kvt__ioq_link_t *free;   /* the slots not in use */
} kvt__ioq_t;

void kvt__ioq_init(kvt__ioq_t *q, uint32_t window);
/* The FIFOs themselves, for a backend's other lists too (the remote tier's sent requests). */
void kvt__ioq_fifo_push(kvt__ioq_fifo_t *f, kvt__ioq_link_t *e);
kvt__ioq_link_t *kvt__ioq_fifo_pop(kvt__ioq_fifo_t *f);
/* Removes e, which follows prev (NULL: e is the head). */
void kvt__ioq_fifo_unlink(kvt__ioq_fifo_t *f, kvt__ioq_link_t *prev, kvt__ioq_link_t *e);
/* Moves all of front ahead of f's entries; front is left empty. */
void kvt__ioq_fifo_prepend(kvt__ioq_fifo_t *f, kvt__ioq_fifo_t *front);

/* Queues e at the tail of its class. */
void kvt__ioq_push(kvt__ioq_t *q, kvt__ioq_link_t *e, int urgent);
/* 1 when a request of this class submitted now must queue behind the ones waiting, to keep
 * submission order within its class (urgent ones wait only for urgent ones). */
int kvt__ioq_behind(const kvt__ioq_t *q, int urgent);
/* The request that leaves next (urgent first), window or not; NULL when none waits. */
kvt__ioq_link_t *kvt__ioq_head(const kvt__ioq_t *q);
/* The same while the window is open, else NULL. */
kvt__ioq_link_t *kvt__ioq_next(const kvt__ioq_t *q);
/* Removes kvt__ioq_next's request and counts it in flight; NULL when none may leave. */
kvt__ioq_link_t *kvt__ioq_pop(kvt__ioq_t *q);
/* Removes the head (urgent first) without counting it: for a backend that counts in flight
 * where its requests go out (kvt__ioq_started), requests of its own included. */
kvt__ioq_link_t *kvt__ioq_take(kvt__ioq_t *q);
size_t kvt__ioq_waiting(const kvt__ioq_t *q);
/* Counts a request that never waited in flight: 1, or 0 when the window is full (queue it). */
int kvt__ioq_start(kvt__ioq_t *q);
/* Counts a request in flight whatever the window (one the backend sends by itself). */
void kvt__ioq_started(kvt__ioq_t *q);
/* A request counted in flight is done (answered, completed, or given up). */
void kvt__ioq_finished(kvt__ioq_t *q);
/*
 * Hands back the waiting requests whose deadline (deadline_ns, absolute kvt_now_ns time) has
 * passed, and those dead() (may be NULL) says nobody waits for any more: each is unlinked, then
 * drop(arg, e, expired) runs, expired being 1 for a deadline and 0 for a dead one. Requests
 * without a deadline are stepped over. Returns the earliest deadline left (UINT64_MAX: none).
 * drop must not change the queue.
 */
uint64_t kvt__ioq_expire(kvt__ioq_t *q, uint64_t now, int (*dead)(const kvt__ioq_link_t *e),
                         void (*drop)(void *arg, kvt__ioq_link_t *e, int expired), void *arg);
/* The slot pool: a free list of the backend's request structs, through their links. */
kvt__ioq_link_t *kvt__ioq_slot_get(kvt__ioq_t *q); /* NULL when every slot is in use */
void kvt__ioq_slot_put(kvt__ioq_t *q, kvt__ioq_link_t *e);

/* Makes a tier around a backend; on success the tier owns impl (ops->destroy frees it). Returns
 * 0, KVT_EINVAL, KVT_ENOMEM or a negated errno (eventfd, epoll). On failure impl is untouched:
 * the caller frees it. */
int kvt__tier_init(kvt_tier_t **out, kvt_tier_id_t kind, const kvt_tier_ops_t *ops, void *impl,
                   uint64_t capacity_bytes);
/* Adds the backend's fd to the tier's epoll set (for backends whose fd exists only after
 * kvt__tier_init). Returns 0 or a negated errno. */
int kvt__tier_watch_fd(kvt_tier_t *t, int fd);
/* Makes the tier's fd readable, so that the caller's loop calls kvt_tier_process (and the
 * backend's poll op) soon: for a backend holding requests back to submit them together. */
void kvt__tier_kick(kvt_tier_t *t);
/* Queues io as finished with status; its callback runs in the next kvt_tier_process. */
void kvt__tier_complete(kvt_tier_t *t, kvt_tier_io_t *io, int status);
/* Indexes and charges a block the backend found by itself (NVMe recovery, a remote block stored
 * by another process). Returns 0, KVT_EEXIST, KVT_ENOSPC (over capacity: not adopted) or
 * KVT_ENOMEM. */
int kvt__tier_adopt(kvt_tier_t *t, uint64_t loc, const kvt_block_key_t *key, uint32_t len);
/* The backend lost a block by itself (segment reclaimed, server evicted it): unindexes and
 * uncharges it, counted in usage.reclaimed; ops->free is not called. Unknown loc: no-op. */
void kvt__tier_drop(kvt_tier_t *t, uint64_t loc);
/* The backend keeps the block's memory but it is no longer a stored block (the DRAM tier's
 * orphans): unindexed and uncharged, not counted as reclaimed; ops->free is not called. */
void kvt__tier_forget(kvt_tier_t *t, uint64_t loc);
/* The backend moved an indexed block from loc to `to` (not indexed): the entry follows, with its
 * key and charge. */
void kvt__tier_relocate(kvt_tier_t *t, uint64_t loc, uint64_t to);
/* The index entry of loc, or NULL. Valid until the next index change. */
const kvt__tier_ent_t *kvt__tier_lookup(const kvt_tier_t *t, uint64_t loc);
/* The same, for the backend to write its own fields (sum, sealed). */
kvt__tier_ent_t *kvt__tier_entry(kvt_tier_t *t, uint64_t loc);
/* Calls fn for every indexed location (the callback must not change the index). */
void kvt__tier_foreach(const kvt_tier_t *t, void (*fn)(void *arg, const kvt__tier_ent_t *e),
                       void *arg);

/*
 * The stored block format, shared by NVMe and remote (tiers/blockhdr.c; owned by the tiers work,
 * the remote backend uses it). A stored block is a fixed little-endian header, the page's tokens,
 * then the payload, with a checksum (XXH3-64) over all of it, so that a reader verifies the
 * namespace, prefix hash, parent hash and tokens it expects before trusting a single payload
 * byte.
 *
 *   offset  size  field
 *        0     4  magic "KVTB"
 *        4     2  version (1)
 *        6     2  header bytes (64)
 *        8     4  ntokens
 *       12     4  payload length
 *       16     8  namespace seed
 *       24     8  prefix hash
 *       32     8  parent hash
 *       40     8  seq (writer's sequence number: the newest copy of a block wins)
 *       48     8  reserved (0)
 *       56     8  checksum of bytes 0..55, then the tokens (uint32 LE each), then the payload
 *       64  4*nt  tokens
 */
#define KVT_BLOCKHDR_BYTES 64u

size_t kvt__blockhdr_size(uint32_t ntokens); /* header + tokens, bytes */
/* Writes header and tokens for key/len into dst (kvt__blockhdr_size bytes); the checksum covers
 * the payload too, so payload must be the bytes that will follow. */
void kvt__blockhdr_encode(void *dst, const kvt_block_key_t *key, const void *payload, uint32_t len,
                          uint64_t seq);
/* The checksum kvt__blockhdr_encode would store for key/payload/len/seq, made apart from the
 * encoding (kvt_tier_write_prepare: with no lock held), and the encoding with that checksum
 * given: together the same bytes as kvt__blockhdr_encode. */
uint64_t kvt__blockhdr_sum(const kvt_block_key_t *key, const void *payload, uint32_t len,
                           uint64_t seq);
void kvt__blockhdr_encode_summed(void *dst, const kvt_block_key_t *key, uint32_t len, uint64_t seq,
                                 uint64_t sum);
/* Checks a stored block of avail bytes against key (NULL: any key, as in recovery). Returns 0,
 * KVT_ECORRUPT (bad magic, checksum, or a different key) or KVT_EINVAL. *len_out gets the
 * payload length, *payload_out its address inside src. In a key, tokens == NULL skips comparing
 * the tokens and parent == 0 skips comparing the parent; ns_seed and hash are always compared. */
int kvt__blockhdr_check(const void *src, size_t avail, const kvt_block_key_t *key,
                        uint32_t *len_out, const void **payload_out);
/* The same check when header+tokens (hdr, hdr_avail bytes) and payload (payload_avail bytes) are
 * in separate buffers. */
int kvt__blockhdr_verify(const void *hdr, size_t hdr_avail, const void *payload,
                         size_t payload_avail, const kvt_block_key_t *key, uint32_t *len_out);

/* The same check, keyless (as in recovery), for a payload too large to hold at once: next(arg,
 * &piece, &n) hands out the payload's next n > 0 bytes (n may run past its end: the rest is not
 * looked at), valid until the next call, or fails with a negative code, which is returned as it
 * is; it is called until the header's payload length has come. KVT_ECORRUPT: the header or the
 * checksum does not hold. */
int kvt__blockhdr_verify_pieces(const void *hdr, size_t hdr_avail,
                                int (*next)(void *arg, const uint8_t **piece, size_t *n), void *arg,
                                uint32_t *len_out);

/* What a stored header holds besides the key and the payload length (its bytes 32..63): with
 * them, kvt__blockhdr_verify_kept rebuilds the header a read checked and takes its checksum. */
typedef struct kvt__blockhdr_kept {
    uint64_t parent, seq, reserved, sum;
} kvt__blockhdr_kept_t;
_Static_assert(sizeof(kvt__blockhdr_kept_t) <= sizeof(((kvt_tier_io_t *)0)->priv),
               "an unchecked read keeps its header's fields in io->priv");
/* kvt__blockhdr_verify without the checksum, against a key with its tokens and a payload of len
 * bytes: 0 with *kept filled, or KVT_ECORRUPT (KVT_EINVAL: no tokens in key). */
int kvt__blockhdr_verify_head(const void *hdr, size_t hdr_avail, const kvt_block_key_t *key,
                              uint32_t len, kvt__blockhdr_kept_t *kept);
/* The checksum of the block that key, len and kept (from kvt__blockhdr_verify_head) describe,
 * with payload's len bytes: 0 when it is the stored one, else KVT_ECORRUPT. Reads only its
 * arguments. */
int kvt__blockhdr_verify_kept(const kvt__blockhdr_kept_t *kept, const kvt_block_key_t *key,
                              const void *payload, uint32_t len);
/* Whether a read's payload checksum is its caller's to take (kvt_tier_io_t.check_later: it
 * needs the key's tokens). */
int kvt__tier_checks_later(const kvt_tier_io_t *io);
/* A read's stored header and tokens (hdr, hdr_avail bytes) and its payload (io->len bytes at
 * payload) against io->key: 0 or KVT_ECORRUPT. The payload's checksum is not taken where io's
 * caller takes it (kvt__tier_checks_later): then what kvt_tier_read_check needs of
 * the header goes in io->priv and io->unchecked is set, payload is not read, and the tier must
 * leave io->len payload bytes in io->buf before it completes io. */
int kvt__tier_read_verify(kvt_tier_io_t *io, const void *hdr, size_t hdr_avail,
                          const void *payload);

/* A stored header's fields, parsed without verifying the checksum (recovery reads the header
 * first to learn how much follows). */
typedef struct kvt__blockhdr_info {
    uint64_t ns_seed, hash, parent, seq;
    uint32_t ntokens, len;
    size_t hdr_bytes; /* kvt__blockhdr_size(ntokens) */
} kvt__blockhdr_info_t;

/* Returns 0, or KVT_ECORRUPT when avail bytes do not start with a plausible header. */
int kvt__blockhdr_peek(const void *src, size_t avail, kvt__blockhdr_info_t *info);

#endif
