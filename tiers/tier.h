/*
 * tier.h: the places a block's KV bytes can live (HBM, DRAM, NVMe, remote Valkey/Redis) behind
 * one interface.
 *
 * A tier stores opaque payloads of up to a few MiB, each named by a block key (namespace seed,
 * prefix hash, parent hash, the page's tokens). Every tier has a capacity in bytes that it never
 * exceeds: a write that does not fit fails with KVT_ENOSPC and changes nothing.
 *
 * Asynchronous I/O
 * ----------------
 * Reads and writes are submitted with caller-allocated kvt_tier_io_t requests and complete
 * later, always through the tier's completion path, even for memory tiers: the callback never
 * runs inside the submitting call. A tier exposes one file descriptor (kvt_tier_fd) that becomes
 * readable when completions are ready; the caller's event loop polls it and then calls
 * kvt_tier_process(), which runs the callbacks of every ready request. A tier owns no event loop
 * and no thread that touches the caller's data; tests with no loop call kvt_tier_wait().
 *
 * Locations
 * ---------
 * A successful write fills io->loc, the tier-specific location that later reads and frees
 * name. kvt_tier_valid() says whether a location still holds that block (a reclaimed NVMe
 * segment, a key the Redis server evicted on its own): an invalid location reads as a miss.
 */
#ifndef KVT_TIER_H
#define KVT_TIER_H

#include <stddef.h>
#include <stdint.h>

#include "../common/common.h"
#include "../radix/radix.h"

typedef struct kvt_tier kvt_tier_t;

/* A block's name and the content its stored header carries and verifies. */
typedef struct kvt_block_key {
    uint64_t ns_seed;       /* kvt_radix_ns_seed() of the block's namespace */
    uint64_t hash;          /* the block's prefix hash */
    uint64_t parent;        /* the parent block's hash; ns_seed for the first page */
    const uint32_t *tokens; /* the page's tokens, borrowed until completion */
    uint32_t ntokens;       /* the page size */
} kvt_block_key_t;

typedef enum { KVT_IO_READ = 1, KVT_IO_WRITE = 2 } kvt_io_op_t;

typedef struct kvt_tier_io kvt_tier_io_t;
typedef void (*kvt_tier_cb)(kvt_tier_io_t *io);

/*
 * One read or write. The caller owns the struct and the buffer until the callback has run.
 * status on completion: 0; KVT_ENOENT (a miss: not there, evicted, invalid location);
 * KVT_ECORRUPT (checksum or header mismatch: also a miss, counted apart); KVT_ENOSPC;
 * KVT_EIO; KVT_EUNAVAIL (backend down); KVT_ETIMEDOUT.
 */
struct kvt_tier_io {
    kvt_block_key_t key;
    uint64_t loc; /* read: where to read; write: filled on success */
    void *buf;    /* host memory; for an HBM tier read/write it is the host side of the copy */
    uint32_t len; /* payload bytes (read: the buffer must hold len bytes) */
    kvt_tier_cb cb;
    void *data; /* the caller's */
    int status;

    /* Private to tiers/. */
    kvt_io_op_t op;
    kvt_tier_t *tier;
    kvt_tier_io_t *next;
    uint64_t submit_ns;
    uint64_t priv[4];
};

typedef struct kvt_tier_usage {
    uint64_t capacity_bytes;
    uint64_t used_bytes; /* never above capacity_bytes */
    uint64_t blocks;
    uint64_t reads, writes, read_bytes, written_bytes;
    uint64_t misses, corrupt, errors, timeouts;
    uint64_t inflight;
} kvt_tier_usage_t;

/* Which tier kind this is, and its name in logs and metrics ("dram", "nvme", ...). */
kvt_tier_id_t kvt_tier_kind(const kvt_tier_t *t);
const char *kvt_tier_backend(const kvt_tier_t *t); /* "cuda", "host", "jemalloc", ... */

int kvt_tier_read(kvt_tier_t *t, kvt_tier_io_t *io);
int kvt_tier_write(kvt_tier_t *t, kvt_tier_io_t *io);
/* Frees a location written earlier; freeing an unknown or already freed location is a no-op. */
void kvt_tier_free(kvt_tier_t *t, uint64_t loc, uint32_t len);
int kvt_tier_valid(kvt_tier_t *t, uint64_t loc, const kvt_block_key_t *key);
/* Host pointer to a stored payload for memory tiers (DRAM, HBM's host backend); NULL for the
 * others. Valid until the location is freed. */
void *kvt_tier_ptr(kvt_tier_t *t, uint64_t loc);
void kvt_tier_usage(const kvt_tier_t *t, kvt_tier_usage_t *u);

int kvt_tier_fd(kvt_tier_t *t);
/* Runs the callbacks of ready completions; returns how many ran, or a negative error. */
int kvt_tier_process(kvt_tier_t *t);
/* Blocks up to timeout_ms for at least one completion, then processes: for tests and tools,
 * never for the service's loop. */
int kvt_tier_wait(kvt_tier_t *t, int timeout_ms);

void kvt_tier_destroy(kvt_tier_t *t);

#endif
