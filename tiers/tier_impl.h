/*
 * tier_impl.h: how a backend plugs into tier.c. Internal to tiers/ (kvt__ names).
 *
 * The shared part, written once in tier.c: capacity accounting (reserve before a write, give
 * back on free or failure), the completion queue and its eventfd, usage counters, and copies
 * between tiers. A backend only moves bytes: it implements the ops below, and reports each
 * finished request with kvt__tier_complete(), from inside its poll op or from the submitting
 * call (tier.c then delivers it on the next kvt_tier_process, never inside the submit).
 */
#ifndef KVT_TIER_IMPL_H
#define KVT_TIER_IMPL_H

#include "tier.h"

typedef struct kvt_tier_ops {
    const char *backend;
    /* Start a write of io->len bytes from io->buf; fill io->loc before completing. Capacity has
     * already been reserved by tier.c. Return 0 (completion comes later) or a negative error
     * (nothing was started, nothing is kept). */
    int (*write)(kvt_tier_t *t, kvt_tier_io_t *io);
    /* Start a read of io->loc into io->buf. Same contract as write. */
    int (*read)(kvt_tier_t *t, kvt_tier_io_t *io);
    void (*free)(kvt_tier_t *t, uint64_t loc, uint32_t len);
    int (*valid)(kvt_tier_t *t, uint64_t loc, const kvt_block_key_t *key);
    void *(*ptr)(kvt_tier_t *t, uint64_t loc); /* may be NULL */
    /* The backend's own pollable fd (io_uring's eventfd, an epoll fd over sockets), or -1 when
     * the backend completes everything through kvt__tier_complete() at submit time. */
    int (*fd)(kvt_tier_t *t);
    /* Harvest whatever is ready without blocking; call kvt__tier_complete for each. */
    int (*poll)(kvt_tier_t *t);
    void (*destroy)(kvt_tier_t *t);
} kvt_tier_ops_t;

struct kvt_tier {
    const kvt_tier_ops_t *ops;
    kvt_tier_id_t kind;
    void *impl; /* the backend's state */
    kvt_tier_usage_t usage;
    int efd; /* eventfd for completions queued by kvt__tier_complete */
    int pfd; /* epoll fd over efd and the backend's fd: what kvt_tier_fd returns */
    kvt_tier_io_t *done_head, *done_tail;
};

/* Makes a tier around a backend. Returns 0, KVT_ENOMEM or a negated errno. */
int kvt__tier_init(kvt_tier_t **out, kvt_tier_id_t kind, const kvt_tier_ops_t *ops, void *impl,
                   uint64_t capacity_bytes);
/* Queues io as finished with status; its callback runs in the next kvt_tier_process. */
void kvt__tier_complete(kvt_tier_t *t, kvt_tier_io_t *io, int status);

/*
 * The stored block format, shared by NVMe and remote (tiers/blockhdr.c; owned by the tiers work,
 * the remote backend uses it). A stored block is a fixed little-endian header, the page's tokens,
 * then the payload, with a checksum over all of it, so that a reader verifies the namespace,
 * prefix hash, parent hash and tokens it expects before trusting a single payload byte.
 */
size_t kvt__blockhdr_size(uint32_t ntokens); /* header + tokens, bytes */
/* Writes header and tokens for key/len into dst (kvt__blockhdr_size bytes); the checksum covers
 * the payload too, so payload must be the bytes that will follow. */
void kvt__blockhdr_encode(void *dst, const kvt_block_key_t *key, const void *payload, uint32_t len,
                          uint64_t seq);
/* Checks a stored block of avail bytes against key (NULL: any key, as in recovery). Returns 0,
 * KVT_ECORRUPT (bad magic, checksum, or a different key) or KVT_EINVAL. *len_out gets the
 * payload length, *payload_out its address inside src. */
int kvt__blockhdr_check(const void *src, size_t avail, const kvt_block_key_t *key,
                        uint32_t *len_out, const void **payload_out);

#endif
