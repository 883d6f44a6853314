/*
 * radix.h: the prefix index. A radix tree over uint32_t token ids, page-granular, one root per
 * namespace, whose every cached page is a block (kvt_block_t) that names where its KV bytes live.
 *
 * Pages and blocks
 * ----------------
 * A namespace has a page size P (1..1024 tokens). Only whole pages are cached: a request of
 * n tokens covers floor(n / P) pages and the rest is never indexed. Node boundaries fall on page
 * boundaries, so a node holds a run of whole pages and one block per page.
 *
 * Compressed edges and splits
 * ---------------------------
 * A node holds a run of pages. Children are keyed by a hash of their first page, which is
 * unique under their parent, kept sorted for binary search up to 64 of them and in a hash table
 * past that, so a node with a million continuations (a shared system prompt) still finds, adds
 * and removes one in constant time:
 *
 *     insert "A B C D" (one page per letter)        then "A B X"
 *
 *        (root)                                       (root)
 *          |                                            |
 *      [A B C D]                                      [A B]       <- new parent node
 *                                                    /     \
 *                                               [C D]       [X]
 *                                     (the old node, kept)  (new leaf)
 *
 * A split always creates the new node above the old one: the old node keeps its address, its
 * tail pages, its children and its leases, and the new parent takes the head pages. That keeps
 * kvt_radix_node_t pointers held by leases and by in-flight tier I/O valid across inserts.
 * Block pointers are not stable: a split moves blocks. Code that needs a block after other tree
 * operations keeps (node, page depth) and calls kvt_radix_block_at(), which finds the block in
 * the node or in the ancestors that splits carved out of it; holding a lease on the node keeps
 * that pair valid.
 *
 * The prefix hash
 * ---------------
 * The namespace seed is XXH3_64bits over the bytes "kvtier-ns-v1\0" model "\0" adapter "\0"
 * salt "\0" followed by the page size as a little-endian uint32. The hash of the block at page i
 * is XXH3_64bits_withSeed(tokens of page i as little-endian uint32, 4 * P bytes, seed) where the
 * seed is the hash of the block at page i - 1, or the namespace seed for page 0; a result of 0
 * is replaced by 1, so that 0 can mean "not computed". Two processes computing it for the same
 * prefix get the same value; shared tiers name blocks by it.
 *
 * The tree computes these chain hashes lazily: an index-only insert does not pay for hashing
 * every page. kvt_block_t.hash is 0 until kvt_radix_block_hash() computes
 * it; from then on it is cached in the block. Computed hashes always form a prefix of
 * every path. Children are found by a different, seedless key: XXH3_64bits of the child's first
 * page, which is unique among siblings because siblings differ in their first page.
 *
 * Leases
 * ------
 * A lease pins every node on a matched path (the deepest node whole, even if the match ended
 * inside it): nothing pinned is evicted or removed. Leases have a 64-bit owner (a connection id,
 * say) and can all be released by owner; releasing a lease twice is harmless.
 *
 * Threads: a tree is used by one thread at a time (the service's event loop). No call blocks.
 */
#ifndef KVT_RADIX_H
#define KVT_RADIX_H

#include <stddef.h>
#include <stdint.h>

#include "common.h"

/*
 * One cached page. 40 bytes. The tree fills hash (lazily) and the counters; tier, loc, size, flags
 * and policy belong to whoever stores the bytes (tiers/ and policy/): the tree never reads them
 * except to hand them to the free callback and to the predicate its caller gives kvt_radix_trim.
 */
typedef struct kvt_block {
    uint64_t hash;        /* prefix hash (see above), 0 until computed: use kvt_radix_block_hash */
    uint64_t loc;         /* tier-specific location (offset, pool slot, ...) */
    uint32_t size;        /* bytes of KV payload; 0 for index-only blocks */
    uint32_t hits;        /* matches that reached this block (saturates) */
    uint32_t last_access; /* tree clock (kvt_radix_set_clock) at the last match or insert */
    float freq;           /* hits decayed with the configured half-life, as of last_access */
    uint8_t tier;         /* kvt_tier_id_t (common.h) */
    uint8_t flags;        /* KVT_BLOCK_* */
    uint16_t prio;        /* retention priority hint; 0 = none */
    uint32_t policy;      /* policy-private word */
} kvt_block_t;

_Static_assert(sizeof(kvt_block_t) == 40, "kvt_block_t is 40 bytes");

enum {
    KVT_BLOCK_BUSY = 1u << 0,  /* a tier copy is in flight: not to be moved or freed */
    KVT_BLOCK_DIRTY = 1u << 1, /* written here but not yet to the lower tiers */
    KVT_BLOCK_USER0 = 1u << 4, /* bits 4..7 are free for policy/ */
};

typedef struct kvt_radix kvt_radix_t;
typedef struct kvt_radix_node kvt_radix_node_t;

/* Why blocks and nodes leave the tree: the call that freed them, handed to the free callbacks
 * as an argument (a caller needs no state of its own set around the call to tell them apart). */
typedef enum kvt_radix_why {
    KVT_RADIX_EVICT = 0,   /* kvt_radix_evict, kvt_radix_trim, kvt_radix_ns_clear */
    KVT_RADIX_REMOVE = 1,  /* kvt_radix_remove */
    KVT_RADIX_DESTROY = 2, /* kvt_radix_destroy */
} kvt_radix_why_t;

/* Called for every block that leaves the tree, before its memory goes, so that the tier holding
 * its bytes can free them; why: the call that freed it. Must not call back into the tree. */
typedef void (*kvt_block_free_cb)(void *arg, uint32_t ns, kvt_block_t *b, kvt_radix_why_t why);
/* Called for every node the tree frees (after its blocks' free_cb), with free_arg: whoever keeps
 * pointers to nodes learns that this one is gone. */
typedef void (*kvt_node_free_cb)(void *arg, kvt_radix_node_t *n, kvt_radix_why_t why);

typedef struct kvt_radix_conf {
    float freq_half_life; /* in clock units; 0 picks 600000 (ten minutes in ms) */
    kvt_block_free_cb free_cb;
    kvt_node_free_cb node_free_cb; /* NULL for none */
    void *free_arg;
    /* Child tables of at least this many slots grow a step at a time rather than in one rehash
     * (radix.c, "growing a big table"); 0 picks 65536. */
    uint32_t step_table_slots;
    /* Namespaces open at once, at most KVT_RADIX_NS_MAX; 0 picks KVT_RADIX_NS_MAX. */
    uint32_t max_namespaces;
    /* The most bytes the node arena maps (radix.c, "the node arena"): nodes, page storage and
     * child arrays come from chunks mapped and pre-faulted in large steps, reused and never given
     * back to the kernel while the tree lives. Past it they come from malloc. kvtierd passes
     * index-bytes; 0 means no limit. */
    size_t arena_bytes;
    /* Bytes of arena mapped and pre-faulted when the tree is made (at most arena_bytes), so that
     * the first requests touch no new page: the kernel zeroes it at start-up instead. It is on
     * transparent huge pages where the kernel allows them (madvise), which costs more at start
     * (0.55-0.6 s of CPU a GiB) and less in every walk after. 0 for none: the arena grows as the
     * tree does, on small pages. */
    size_t arena_reserve;
} kvt_radix_conf_t;

/* Creates an empty tree. conf may be NULL for defaults. Returns 0, KVT_EINVAL or KVT_ENOMEM. */
int kvt_radix_create(kvt_radix_t **out, const kvt_radix_conf_t *conf);
/* Frees the tree, calling free_cb for every block. NULL is a no-op. */
void kvt_radix_destroy(kvt_radix_t *t);

/*
 * Namespaces. A namespace is (model, adapter, tenant salt, page size); adapter and salt may be
 * NULL or "". Opening the same description twice returns the same id. Ids are small integers
 * (0, 1, ...) valid until the namespace is closed; a closed id is given to a later namespace.
 * Strings are copied; each is at most 255 bytes. At most conf.max_namespaces (KVT_RADIX_NS_MAX)
 * are open at once: a client making up tenant salts cannot grow the tree without bound. Returns
 * 0, KVT_EINVAL, KVT_ENOSPC (that many are open) or KVT_ENOMEM.
 */
#define KVT_RADIX_NS_MAX 65536
int kvt_radix_ns_open(kvt_radix_t *t, const char *model, const char *adapter, const char *salt,
                      uint32_t page_size, uint32_t *ns_out);
/* Sets conf.max_namespaces (0: KVT_RADIX_NS_MAX). Namespaces open past a lowered limit stay;
 * new ones are refused until enough have closed. */
void kvt_radix_set_max_namespaces(kvt_radix_t *t, uint32_t max);
/* Closes an empty namespace (nothing inserted, or all of it removed or evicted): its id and
 * memory go back, and a later open of the same description starts afresh, maybe under another
 * id. Whoever keeps state by namespace id must drop it first. Returns 0, KVT_EINVAL (not open)
 * or KVT_EBUSY (it holds pages). */
int kvt_radix_ns_close(kvt_radix_t *t, uint32_t ns);
/* Drops every page of namespace ns, as many kvt_radix_evict() calls would (free_cb for each block,
 * node_free_cb for each node), so that kvt_radix_ns_close() can then close it: for a caller that
 * must free a namespace that still holds pages. Returns 0, KVT_EINVAL (not open) or KVT_EBUSY
 * (and changes nothing) when a node of it is leased or holds a KVT_BLOCK_BUSY block. Costs
 * O(its pages). */
int kvt_radix_ns_clear(kvt_radix_t *t, uint32_t ns);
/* The pages namespace ns holds (0 if ns is unknown): what kvt_radix_ns_clear() would drop. */
uint64_t kvt_radix_ns_blocks(const kvt_radix_t *t, uint32_t ns);
/* Opens a namespace known only by its seed (as stored in a tier's block headers): the same id as
 * kvt_radix_ns_open() of the description that hashes to that seed. Returns 0, KVT_EINVAL
 * (page_size differs from the one the namespace has) or KVT_ENOMEM. */
int kvt_radix_ns_open_seed(kvt_radix_t *t, uint64_t seed, uint32_t page_size, uint32_t *ns_out);
/* At most the bytes kvt_radix_ns_open() of this description adds to the tree's count: 0 for a
 * namespace already open by that name (or a description it refuses), so that a caller with a
 * memory limit can make room first, or refuse. */
uint64_t kvt_radix_ns_need(const kvt_radix_t *t, const char *model, const char *adapter,
                           const char *salt, uint32_t page_size);
/* The seed kvt_radix_ns_open() gives this description, in any tree; 0 for one it refuses. */
uint64_t kvt_radix_ns_seed_of(const char *model, const char *adapter, const char *salt,
                              uint32_t page_size);
uint32_t kvt_radix_ns_page_size(const kvt_radix_t *t, uint32_t ns); /* 0 if ns is unknown */
uint64_t kvt_radix_ns_seed(const kvt_radix_t *t, uint32_t ns);      /* 0 if ns is unknown */

/* The tree clock: any monotonic unit the caller likes (ms of wall or simulated time). Counters
 * bumped by match and insert are stamped with it. */
void kvt_radix_set_clock(kvt_radix_t *t, uint32_t now);
uint32_t kvt_radix_clock(const kvt_radix_t *t);

/* The prefix hashes of pages [0, npages) of tokens, computed without touching the tree: what a
 * remote probe asks for beyond the local match. Returns 0 or KVT_EINVAL. */
int kvt_radix_hash_pages(const kvt_radix_t *t, uint32_t ns, const uint32_t *tokens, size_t npages,
                         uint64_t *hashes);
/* The same chain continued from parent, the hash of the page before tokens[0] (the namespace's
 * seed when tokens[0] starts page 0): what follows a matched path of which only the last page's
 * hash is known (kvt_radix_block_hash), without hashing the path again. 0 or KVT_EINVAL. */
int kvt_radix_hash_chain(const kvt_radix_t *t, uint32_t ns, uint64_t parent, const uint32_t *tokens,
                         size_t npages, uint64_t *hashes);

/*
 * The result of a match: the deepest node reached and how far. The path is every page of the
 * node's ancestors plus the first node_pages pages of node; walk it with kvt_path_iter_*.
 * Valid until the next insert, remove or evict.
 */
typedef struct kvt_match {
    kvt_radix_node_t *node; /* deepest node with a matched page; NULL when pages == 0 */
    uint32_t node_pages;    /* pages matched inside node (1..node's page count) */
    uint32_t pages;         /* total matched pages */
    uint32_t ns;
    uint64_t epoch; /* the tree's shape when matched, for kvt_radix_insert_matched */
} kvt_match_t;

enum {
    KVT_MATCH_NOTOUCH = 1u << 0, /* do not bump hit counters (a probe, a test) */
};

/*
 * Finds the longest cached prefix of tokens[0, ntokens). Only bumps counters (hits,
 * last_access, freq) of the matched blocks, unless KVT_MATCH_NOTOUCH. ntokens may be 0 or less
 * than a page: the match is then empty. Returns 0 (with m->pages possibly 0) or KVT_EINVAL.
 */
int kvt_radix_match(kvt_radix_t *t, uint32_t ns, const uint32_t *tokens, size_t ntokens,
                    unsigned flags, kvt_match_t *m);
/* Bumps the counters of m's matched blocks as kvt_radix_match without KVT_MATCH_NOTOUCH would
 * have: for a match made with it whose use is counted later (several threads match at once,
 * none writes the tree; the counting comes under the caller's exclusive lock). m must be
 * current (no insert, remove or evict since it was made). */
void kvt_radix_touch(kvt_radix_t *t, const kvt_match_t *m);

/*
 * Warms the CPU cache for matches about to be made: n token runs (at most KVT_WARM_MAX are
 * looked at) follow the path each would take down the tree, all of them in step, one level at a
 * time, and every node on the way has its header, tokens, blocks and child keys asked for
 * without waiting for them. A match waits for one cache miss after the other, node by node; here
 * the misses of many runs are in flight at once, so that the matches that follow find their
 * paths in the cache. Changes nothing and reports nothing: a run that leaves the tree, or whose
 * tokens differ from a node's behind an equal first page, only stops being followed. Tokens are
 * host-order uint32_t ids, read as bytes (they need not be aligned).
 */
#define KVT_WARM_MAX 64

typedef struct kvt_token_run {
    const void *tokens;
    size_t ntokens;
} kvt_token_run_t;

void kvt_radix_warm(const kvt_radix_t *t, uint32_t ns, const kvt_token_run_t *runs, size_t n);

/*
 * The same in two steps, so that a batch's transfers overlap the work on its matches instead of
 * all waiting before the first: kvt_radix_warm_plan follows every run's path in step as
 * kvt_radix_warm does (the node headers and child keys, whose misses depend on each other, asked
 * for at once) but only notes where each run's pages' tokens and blocks lie; kvt_radix_warm_run
 * asks for run i's, a few matches before run i's match. A plan holds addresses only: it reads
 * nothing of the tree, so a plan gone stale (the tree changed) only asks for useless lines.
 * Spans past KVT_WARM_SPANS nodes of a run are asked for at once by the plan. Caller-allocated
 * (some 19 KB); n and the runs as for kvt_radix_warm, run i the i-th of runs (0 spans for a run
 * not followed). i >= plan->n is ignored.
 */
#define KVT_WARM_SPANS 12

typedef struct kvt_warm_span {
    const void *tokens, *blocks;
    uint32_t token_bytes, block_bytes;
} kvt_warm_span_t;

typedef struct kvt_warm_plan {
    size_t n;
    uint8_t nspans[KVT_WARM_MAX];
    kvt_warm_span_t span[KVT_WARM_MAX][KVT_WARM_SPANS];
} kvt_warm_plan_t;

void kvt_radix_warm_plan(const kvt_radix_t *t, uint32_t ns, const kvt_token_run_t *runs, size_t n,
                         kvt_warm_plan_t *plan);
void kvt_radix_warm_run(const kvt_warm_plan_t *plan, size_t i);

/*
 * A ghost table: the chain hashes of blocks recently evicted from the tree, in a direct-mapped
 * array of 2^bits slots (a newer hash takes an older one's slot). One is shared by whoever asks
 * "was this block here before?": kvtierd's miss reasons and the cost policy's reuse signal.
 * create returns 0 or KVT_EINVAL (bits not in 1..30) or KVT_ENOMEM; the table is the caller's
 * to destroy. add ignores a hash of 0 (not computed); seen is 0 for it. prefetch asks the memory
 * for a hash's slot without waiting (a loop over many blocks).
 */
typedef struct kvt_ghosts kvt_ghosts_t;
int kvt_ghosts_create(kvt_ghosts_t **out, unsigned bits);
void kvt_ghosts_destroy(kvt_ghosts_t *g);
void kvt_ghosts_add(kvt_ghosts_t *g, uint64_t hash);
int kvt_ghosts_seen(const kvt_ghosts_t *g, uint64_t hash);
void kvt_ghosts_prefetch(const kvt_ghosts_t *g, uint64_t hash);

/*
 * The result of an insert: the pages that were not cached before, all in one new leaf node at
 * pages [first_page, first_page + new_pages) of the request. new_pages == 0 when everything was
 * already cached (node is then the deepest node of the path, as in a match).
 */
typedef struct kvt_insert {
    kvt_radix_node_t *node;
    uint32_t first_page; /* page depth of the first new block */
    uint32_t new_pages;
    uint32_t pages; /* whole pages of the request, all cached now */
    /* The node a split made for the insert (node's parent: the head pages of the node the new
     * pages branch off inside), or NULL: a node no one has seen yet, with cached pages. */
    kvt_radix_node_t *split;
} kvt_insert_t;

/*
 * Caches every whole page of tokens[0, ntokens), adding the missing ones as blocks with tier
 * KVT_TIER_NONE, zeroed fields (hash too: computed lazily), hits 0, freq 1 and last_access now.
 * Pages already cached are left as they are: the match that preceded the insert counted the hit.
 * Returns 0, KVT_EINVAL, KVT_ENOMEM (the tree is then as before), or KVT_EEXIST when a page's
 * 64-bit hash collides with a different page already cached under the same parent (nothing is added
 * from that page on).
 */
int kvt_radix_insert(kvt_radix_t *t, uint32_t ns, const uint32_t *tokens, size_t ntokens,
                     kvt_insert_t *res);

/*
 * kvt_radix_insert() for the tokens a kvt_radix_match() just matched: when the tree has not
 * changed shape since (no insert, remove or evict: m->epoch says), it starts from the match's
 * end instead of walking the path again. tokens and ntokens must be the ones given to the match;
 * otherwise, or when the tree changed, it is a plain kvt_radix_insert(). Same returns.
 */
int kvt_radix_insert_matched(kvt_radix_t *t, const kvt_match_t *m, const uint32_t *tokens,
                             size_t ntokens, kvt_insert_t *res);

/*
 * Removes the block of the last whole page of tokens and every block beneath it, so that a
 * later match of tokens stops before that page. Returns 0, KVT_ENOENT when those pages are not
 * all cached, KVT_EBUSY (and changes nothing) when any affected node is leased or holds a
 * KVT_BLOCK_BUSY block, or KVT_EINVAL.
 */
int kvt_radix_remove(kvt_radix_t *t, uint32_t ns, const uint32_t *tokens, size_t ntokens);

/*
 * Makes page `depth` of the path that ends in node n begin a node: the node holding it is split
 * there, as an insert splits one (the drawing above: the head pages go to a new node above it,
 * which inherits its leases; n and every node keep their addresses). A split changes no block,
 * no match and no lease; it only lets the pages on either side of it be told apart by node, as
 * kvtierd's PUT with gaps needs (a node's tiers never get faster with depth, so a page with
 * bytes after one without needs a node of its own). The new node is the parent of
 * kvt_radix_node_holding(n, depth) afterwards; whoever queues nodes (policy/) is to be told of it.
 * Returns 0 (also when a node begins there already), KVT_EINVAL (depth not on n's path), or
 * KVT_ENOMEM (the tree is then as before).
 */
int kvt_radix_split_at(kvt_radix_t *t, kvt_radix_node_t *n, uint32_t depth);
/* At most the bytes kvt_radix_split_at(t, n, depth) adds to the tree's count (0 when it would
 * split nothing), for a caller that bounds the tree's memory. */
uint64_t kvt_radix_split_need(const kvt_radix_t *t, kvt_radix_node_t *n, uint32_t depth);

/* Leases. owner is any non-zero value. The lease id is never 0. */
int kvt_radix_lease(kvt_radix_t *t, const kvt_match_t *m, uint64_t owner, uint64_t *lease_out);
/* Releases one lease. Returns 0, or KVT_ENOENT for an id that is not (any longer) held: a
 * second release of the same id is harmless. */
int kvt_radix_release(kvt_radix_t *t, uint64_t lease);
/* Releases every lease of owner; returns how many. Walks every lease slot of the tree. */
size_t kvt_radix_release_owner(kvt_radix_t *t, uint64_t owner);
size_t kvt_radix_lease_count(const kvt_radix_t *t);
/* Leases ended so far (released, or dropped with their owner): a count that only grows, for
 * callers that skipped leased nodes and want to know whether to look at them again. */
uint64_t kvt_radix_lease_releases(const kvt_radix_t *t);
/* Leases are numbered in the order they are taken: the number the next one gets. */
uint64_t kvt_radix_lease_seq(const kvt_radix_t *t);
/* Marks n: returns kvt_radix_lease_seq(t), and from now on n counts the leases through it
 * numbered below that (those held now), so that kvt_radix_node_leased_before(t, n, that number)
 * reads a count. A later mark of n replaces it. NULL n only returns the number. */
uint64_t kvt_radix_node_mark(kvt_radix_t *t, kvt_radix_node_t *n);
/* Whether a lease numbered below seq (taken before kvt_radix_lease_seq returned seq) still runs
 * through node n. For seq, n's mark (kvt_radix_node_mark): reads n's count. For another number:
 * walks every lease slot of the tree and each such lease's path, unless n has no lease at all. */
int kvt_radix_node_leased_before(const kvt_radix_t *t, const kvt_radix_node_t *n, uint64_t seq);
/* At most the bytes the next kvt_radix_lease adds to the tree's count: 0 while a lease slot is
 * free, else the growth of the lease table. */
uint64_t kvt_radix_lease_need(const kvt_radix_t *t);
/* Makes the lease table grow now, when no slot is free, so that the next kvt_radix_lease
 * allocates nothing and cannot fail for memory. Returns 0 or KVT_ENOMEM (nothing changed). */
int kvt_radix_lease_reserve(kvt_radix_t *t);
/* A lease's slot: no two leases held at once share one, and slots are reused, so the slots in use
 * stay below the most leases ever held at once. For tables of the caller's own, by lease. */
static inline uint32_t kvt_radix_lease_slot(uint64_t lease)
{
    return (uint32_t)lease;
}

/*
 * Nodes. Pointers stay valid until the node is evicted or removed (never across a split).
 */
uint32_t kvt_radix_node_pages(const kvt_radix_node_t *n);
uint32_t kvt_radix_node_depth(const kvt_radix_node_t *n); /* page depth of its first page */
uint32_t kvt_radix_node_ns(const kvt_radix_node_t *n);
kvt_radix_node_t *kvt_radix_node_parent(const kvt_radix_node_t *n); /* NULL under the root */
uint32_t kvt_radix_node_children(const kvt_radix_node_t *n);
int kvt_radix_node_leased(const kvt_radix_node_t *n);
/* How many leases run through the node (each lease counts on every node of its path). */
uint32_t kvt_radix_node_leases(const kvt_radix_node_t *n);
/* The node's blocks, node_pages of them, valid until the next insert, remove or evict. */
kvt_block_t *kvt_radix_node_blocks(kvt_radix_node_t *n);
/* The tokens of the node's page i (page_size of them). */
const uint32_t *kvt_radix_node_tokens(const kvt_radix_node_t *n, uint32_t i);

/*
 * The block at absolute page depth `depth` on the path that ends in node n: in n itself or in
 * one of its ancestors. NULL when depth is past the end of n.
 */
kvt_block_t *kvt_radix_block_at(kvt_radix_node_t *n, uint32_t depth);
/* The node holding that block: n or the ancestor of n that does. NULL when depth is past the end
 * of n. */
kvt_radix_node_t *kvt_radix_node_holding(kvt_radix_node_t *n, uint32_t depth);

/*
 * The chain hash of the block at page depth `depth` on the path ending in node n (as in
 * kvt_radix_block_at), computing and caching it and any missing hashes above it. 0 when depth is
 * past the end of n.
 */
uint64_t kvt_radix_block_hash(kvt_radix_t *t, kvt_radix_node_t *n, uint32_t depth);

/* Walks a match's path from the root down, one block at a time, on the caller's stack. */
typedef struct kvt_path_iter {
    kvt_radix_node_t *path[64]; /* nodes from root down, when the path is at most 64 deep */
    kvt_radix_node_t *deep;
    uint32_t depth; /* page depth of the next block */
    uint32_t end;   /* total pages on the path */
    uint32_t level; /* index into path[] of the current node */
    uint32_t nlevels;
} kvt_path_iter_t;

void kvt_path_iter_init(kvt_path_iter_t *it, kvt_radix_node_t *node, uint32_t node_pages);
/* The next block, or NULL at the end. *node_out (if not NULL) gets the node holding it. */
kvt_block_t *kvt_path_iter_next(kvt_path_iter_t *it, kvt_radix_node_t **node_out);

/*
 * The same path node by node, from its deepest node up to the root, each step one node's blocks
 * on the path as the array they are (for loops over every page of a path that do not care about
 * the order):
 *
 *     for (kvt_path_run_t r = kvt_path_run_first(m->node, m->node_pages); r.node;
 *          kvt_path_run_next(&r))
 *         ... r.blocks[0 .. r.n), at page depths r.depth ...
 */
typedef struct kvt_path_run {
    kvt_radix_node_t *node; /* NULL once past the top node */
    kvt_block_t *blocks;
    uint32_t depth; /* page depth of blocks[0] */
    uint32_t n;     /* blocks of node on the path */
} kvt_path_run_t;

kvt_path_run_t kvt_path_run_first(kvt_radix_node_t *node, uint32_t node_pages);
void kvt_path_run_next(kvt_path_run_t *r);

/*
 * Evictable blocks: the last block of every leaf node that is not leased. Evicting a block makes
 * the one before it evictable, and emptying a leaf may make its parent a leaf. The iteration
 * order is unspecified (the policy orders). Iterating while evicting is allowed only through
 * kvt_radix_evict() on the node just returned, after which iteration restarts from the first.
 */
kvt_radix_node_t *kvt_radix_evictable_first(kvt_radix_t *t);
kvt_radix_node_t *kvt_radix_evictable_next(kvt_radix_t *t, kvt_radix_node_t *n);
size_t kvt_radix_evictable_count(const kvt_radix_t *t);

/*
 * Drops the last npages blocks of node n, which must be an unleased leaf (KVT_EBUSY otherwise,
 * also when one of them is KVT_BLOCK_BUSY). Calls free_cb for each. The node is freed when it
 * empties (n is then dangling). Returns 0, KVT_EBUSY or KVT_EINVAL.
 */
int kvt_radix_evict(kvt_radix_t *t, kvt_radix_node_t *n, uint32_t npages);

/*
 * Trims the tree toward `target` bytes by evicting leaf tails, the least recently used first as
 * far as sampling finds them (as Redis approximates LRU): each victim is the one, of 16 nodes
 * drawn at random, that is an unleased leaf whose last block `evictable` accepts and whose last
 * block was matched or inserted longest ago. Its trailing run of accepted blocks (no more than
 * what is left of budget) goes to drop(arg, node, pages), which must evict exactly those pages
 * with kvt_radix_evict() along with any bookkeeping of its own, and return the pages evicted or
 * a negative error. Their chain hashes are computed first, so that the free callback sees them.
 * Stops at target, after budget pages, at a drop error, or when 8 draws in a row find no
 * victim. Returns the pages evicted.
 */
typedef int (*kvt_block_pred_t)(void *arg, const kvt_block_t *b);
typedef int (*kvt_trim_drop_t)(void *arg, kvt_radix_node_t *n, uint32_t npages);
/* The predicate for bounding the index: a block with no bytes anywhere (KVT_TIER_NONE) and no
 * copy in flight (not KVT_BLOCK_BUSY). */
int kvt_radix_index_only(void *arg, const kvt_block_t *b);
uint32_t kvt_radix_trim(kvt_radix_t *t, uint64_t target, uint32_t budget,
                        kvt_block_pred_t evictable, kvt_trim_drop_t drop, void *arg);

/* Every node, for scans that must see all blocks (the policy's demotion pass). Index order is
 * unspecified and changes when nodes go. */
size_t kvt_radix_node_count(const kvt_radix_t *t);
kvt_radix_node_t *kvt_radix_node_at(const kvt_radix_t *t, size_t i);
/* The same nodes as one array (kvt_radix_node_count of them), valid until the tree next changes:
 * for a copy taken at once. */
kvt_radix_node_t *const *kvt_radix_nodes(const kvt_radix_t *t);

/* The most kvt_radix_insert of ntokens tokens in namespace ns can add to the tree's bytes now:
 * its new nodes, a split and its copies, a child array's and the node registry's growth, each
 * rounded up as the allocator does. For admission against a bound on the index's memory. */
uint64_t kvt_radix_insert_bound(const kvt_radix_t *t, uint32_t ns, size_t ntokens);
/* The same for inserting these tokens into the tree as it is now (a walk): only the child array
 * this insert would grow counts, not the largest one anywhere; 0 when it adds nothing. Valid
 * until the tree next changes. at, when not NULL, receives where the walk stopped, as
 * kvt_radix_match (with KVT_MATCH_NOTOUCH) gives it: kvt_radix_insert_matched then goes on from
 * there instead of walking again. */
uint64_t kvt_radix_insert_need(kvt_radix_t *t, uint32_t ns, const uint32_t *tokens, size_t ntokens,
                               kvt_match_t *at);

/* Statistics. */
typedef struct kvt_radix_stats {
    uint64_t bytes; /* every byte the tree has allocated: arena slots, malloc_usable_size */
    uint64_t nodes;
    uint64_t blocks;        /* cached pages */
    uint64_t cached_tokens; /* blocks x page size, summed over namespaces */
    uint64_t leases;
    uint64_t namespaces;
    uint64_t arena_bytes;      /* mapped by the node arena (radix.c, "the node arena") */
    uint64_t arena_free_bytes; /* of those, what no node holds: free slots, room to grow */
} kvt_radix_stats_t;

void kvt_radix_stats(const kvt_radix_t *t, kvt_radix_stats_t *st);

/* Walks the whole tree and checks every invariant (hash chain, child order, parent links, page
 * depths, lease counts, leaf list, byte count). Returns 0 or KVT_ECORRUPT, logging what broke.
 * Costs O(tree): tests and debug builds only. */
int kvt_radix_verify(const kvt_radix_t *t);

#endif
