/*
 * mrc.h: an online miss-ratio curve of the lookups (SHARDS, Waldspurger et al., FAST 2015), so
 * that the daemon can answer "what would twice the DRAM buy me" from the traffic it serves.
 * Internal to server/ (kvt__ names).
 *
 * The access stream is the whole pages of every MATCH, named by their chain hash (radix.h), each
 * as many bytes as its namespace's block. A page's reuse distance is the bytes of the distinct
 * pages looked up since its last lookup, itself included: in an LRU stack of C bytes it hits iff
 * its distance is at most C. Tiers under an LRU policy (a hit promotes to the top, demotion moves
 * the least recent down) are consecutive segments of that one stack:
 *
 *     distance 0 ..... C_hbm ......... C_hbm + C_dram .......... + C_nvme ...... + C_remote
 *              [ hbm  ][      dram      ][          nvme          ][    remote    ]  miss
 *
 * so the hits tier k would have at s times its size (the others as they are) are the pages with
 * a distance in (C_above, C_above + s C_k]. The pages of one lookup are taken deepest first, so
 * that a page is never more recent than its parent (leaf-first LRU, as the tree evicts): the
 * pages within C of the top are a prefix of every path, and their tokens are the hit tokens.
 *
 * Sampling: a page is tracked when a hash of its key falls under a threshold T of 2^24 (rate
 * R = T / 2^24); a sampled page's distance is the bytes of the sampled pages looked up since,
 * over R. Those pages' last-lookup times index a Fenwick tree of their bytes, so a distance costs
 * O(log n). At most max_keys pages are tracked: past it T is lowered by an eighth and the pages
 * now over it forgotten (SHARDS' fixed-size variant), so memory is bounded whatever the traffic.
 * Each sampled lookup adds its tokens / R to a histogram of distances with 32 linear buckets per
 * doubling (at most 3.1% of the distance wide, read with linear interpolation inside a bucket).
 * The sampled weight is corrected to the known count of looked-up page tokens (SHARDS-adj).
 */
#ifndef KVT_SERVER_MRC_H
#define KVT_SERVER_MRC_H

#include <stddef.h>
#include <stdint.h>

#include "common.h"

typedef struct kvt__mrc kvt__mrc_t;

typedef struct kvt__mrc_conf {
    double rate;       /* the first sampling rate, (0, 1] */
    uint32_t max_keys; /* pages tracked at most, >= 64 */
} kvt__mrc_conf_t;

typedef struct kvt__mrc_stats {
    uint64_t keys;                       /* pages tracked now */
    uint64_t bytes;                      /* memory the estimator allocated (fixed at create) */
    double rate;                         /* the sampling rate now */
    uint64_t lookup_tokens, page_tokens; /* tokens of the lookups seen; of their whole pages */
} kvt__mrc_stats_t;

/* Makes an estimator; destroy frees it. Returns 0, KVT_EINVAL or KVT_ENOMEM. */
int kvt__mrc_create(kvt__mrc_t **out, const kvt__mrc_conf_t *conf);
void kvt__mrc_destroy(kvt__mrc_t *m);

/* A scratch array of at least n page keys for the caller to fill and hand to kvt__mrc_lookup;
 * valid until the next call. NULL when out of memory (the lookup then goes uncounted). */
uint64_t *kvt__mrc_scratch(kvt__mrc_t *m, size_t n);

/* One lookup of ntokens tokens: its whole pages' keys in path order (keys[0] is the first page),
 * each page_tokens tokens and block_bytes bytes (0: unknown, the lookup is not counted). */
void kvt__mrc_lookup(kvt__mrc_t *m, const uint64_t *keys, uint32_t npages, uint32_t page_tokens,
                     uint32_t block_bytes, uint32_t ntokens);

/* The estimated tokens of the lookups so far whose pages had a reuse distance in (lo, hi] bytes:
 * what a stack segment from lo to hi bytes would have served. 0 before any sampled page. */
double kvt__mrc_hit_tokens(const kvt__mrc_t *m, double lo, double hi);

/* The bytes of the last block looked up (to convert a tier's capacity to blocks); 0 for none. */
uint32_t kvt__mrc_block_bytes(const kvt__mrc_t *m);

void kvt__mrc_stats(const kvt__mrc_t *m, kvt__mrc_stats_t *out);

/* The daemon's curve: kvtier_mrc_* gauges of every configured tier at KVT_MRC_SCALES sizes
 * (metrics.h), from s->mrc and the tiers' capacities; with no estimator (mrc = no), no series.
 * Called with the other gauges (kvt__tier_metrics). */
struct kvt_srv;
void kvt__mrc_metrics(struct kvt_srv *s);

#endif
