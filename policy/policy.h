/*
 * policy.h: the cost model (what a block weighs and what recomputing or loading it costs) and the
 * tier policy engine that decides where every cached block lives: which blocks move down a tier,
 * which are dropped, which are promoted.
 *
 * Decide here, act elsewhere
 * --------------------------
 * The engine never touches KV bytes. It decides, and an executor acts through the small table of
 * operations in kvt_policy_ops_t: the replay (replay/) charges simulated bytes and time, kvtierd
 * copies real bytes between real tiers. Blocks are named by (node, page depth) because block
 * pointers move when the radix tree splits a node (see radix.h); kvt_radix_block_at() resolves
 * the pair.
 *
 *      request ──> kvt_radix_match ──> kvt_policy_on_match     (hot path: O(path) counters)
 *              ──> kvt_radix_insert ──> kvt_policy_on_insert   (admits the new blocks to a tier)
 *      loop    ──> kvt_policy_step(budget)                      (promotions, demotions, drops:
 *                                                               bounded work, calls ops->move,
 *                                                               ops->admit, kvt_radix_evict)
 *      tree free_cb ──> kvt_policy_on_free                      (every block that leaves)
 *
 * Invariants the engine keeps (kvt_policy_verify checks them):
 *  - every configured tier's used bytes stay at or below its capacity, and equal the sum of the
 *    charges (ops->footprint of the size, or the size) of the blocks whose tier field names it,
 *    plus what the executor holds there for its own writes (kvt_policy_hold);
 *  - within one node, tiers never get faster with depth (the head of a node is in the same or a
 *    faster tier than its tail), so a node's blocks form at most one run per tier;
 *  - a leased node's blocks never move and are never dropped; neither are KVT_BLOCK_BUSY blocks;
 *  - a block is dropped only as the tail of a leaf node (kvt_radix_evict), so no cached block
 *    ever loses an ancestor. Demotion may run in any order across nodes.
 *
 * Ownership: the policy borrows the tree and copies the configuration. No call but
 * kvt_policy_destroy() may come after the tree is destroyed, and destroy reads nothing of the
 * tree, so either may go first. While both exist, the tree's free callback must call
 * kvt_policy_on_free() for every block it frees, except in kvt_radix_destroy (KVT_RADIX_DESTROY),
 * where nothing is left to keep order for; a policy destroyed first must no longer be called.
 *
 * Threads: one thread at a time, the same one that uses the tree. No call blocks.
 */
#ifndef KVT_POLICY_H
#define KVT_POLICY_H

#include <stddef.h>
#include <stdint.h>

#include "common.h"
#include "radix.h"

/* ---------------------------------------------------------------------------------------------
 * Cost model
 * ------------------------------------------------------------------------------------------- */

#define KVT_PROFILE_NAME_MAX 48

/*
 * A model, as far as the KV cache cares. KV bytes of t tokens = 2 x layers x t x kv_heads x
 * head_dim x bytes_per_elem. Recompute FLOPs of tokens at 0-based positions [p0, p0 + t):
 *     linear:    2 x params x t              (params: active parameters per token)
 *     attention: 4 x layers x q_heads x head_dim x sum over p in [p0, p0 + t) of (p + 1)
 * (QK^T and AV each cost 2 x head_dim FLOPs per query head per attended token; the token at
 * position p attends to p + 1 tokens). docs/policy.md derives both and cites the numbers.
 */
typedef struct kvt_model_profile {
    char name[KVT_PROFILE_NAME_MAX];
    uint32_t layers;
    uint32_t kv_heads;
    uint32_t head_dim;
    uint32_t bytes_per_elem; /* 2 for bf16/fp16, 1 for fp8 */
    uint32_t q_heads;
    uint32_t hidden;
    double params; /* active parameters per token (an MoE counts its routed experts only) */
} kvt_model_profile_t;

/*
 * The serving hardware: the effective prefill FLOP/s of one model instance (all its GPUs
 * together) and, per tier, the bandwidth and fixed latency of loading KV bytes from that tier
 * into HBM. bw[KVT_TIER_HBM] is HBM read bandwidth (a hit already in HBM). bw 0 = no such path.
 */
typedef struct kvt_hw_profile {
    char name[KVT_PROFILE_NAME_MAX];
    double prefill_flops;             /* FLOP/s actually reached in prefill */
    double bw[KVT_TIER_COUNT];        /* bytes/s from the tier into HBM */
    double latency_s[KVT_TIER_COUNT]; /* seconds, paid once per request that loads from it */
    /* Requests the tier serves at once (NVMe queue depth, remote round trips in flight): a load
     * behind q others waits floor(q / qd) round trips of latency_s more. 0 = no queueing. */
    uint32_t qd[KVT_TIER_COUNT];
} kvt_hw_profile_t;

/* Built-in profiles by name: models "llama-3-8b", "llama-3-70b", "qwen2.5-7b", "mixtral-8x22b";
 * hardware "h200-node" (8 x H200, the default), "h200-1gpu". Returns 0 or KVT_ENOENT. */
int kvt_model_profile_get(const char *name, kvt_model_profile_t *out);
int kvt_hw_profile_get(const char *name, kvt_hw_profile_t *out);
/* The names of the built-in profiles, NULL-terminated, static. */
const char *const *kvt_model_profile_names(void);
const char *const *kvt_hw_profile_names(void);

/*
 * Custom profiles from text: lines of key=value, '#' starts a comment, blank lines ignored.
 * Model keys: name, base (a built-in to start from), layers, kv_heads, head_dim,
 * bytes_per_elem, q_heads, hidden, params (e.g. 7.6e9). Hardware keys: name, base,
 * prefill_flops, and per tier (hbm, dram, nvme, remote) <tier>_bw (bytes/s),
 * <tier>_latency_us and <tier>_qd (requests served at once; 0 = no queueing). An unknown key, a
 * malformed number or a profile left incomplete gives KVT_EINVAL, logs the line, and leaves *out
 * untouched. Returns 0 or KVT_EINVAL.
 */
int kvt_model_profile_parse(const char *text, kvt_model_profile_t *out);
int kvt_hw_profile_parse(const char *text, kvt_hw_profile_t *out);
/* Checks a profile for sane values: 0 or KVT_EINVAL. */
int kvt_model_profile_check(const kvt_model_profile_t *m);
int kvt_hw_profile_check(const kvt_hw_profile_t *hw);

/* KV bytes of ntokens tokens. */
uint64_t kvt_cost_kv_bytes(const kvt_model_profile_t *m, uint64_t ntokens);
/* FLOPs to recompute the tokens at positions [first, first + ntokens) given the ones before. */
double kvt_cost_recompute_flops(const kvt_model_profile_t *m, uint64_t first, uint64_t ntokens);
/* Seconds for the same on hw. */
double kvt_cost_recompute_s(const kvt_model_profile_t *m, const kvt_hw_profile_t *hw,
                            uint64_t first, uint64_t ntokens);
/* Seconds to load bytes from tier into HBM, fixed latency included (0 bytes cost 0). A tier
 * with no path (bw 0) returns INFINITY. */
double kvt_cost_load_s(const kvt_hw_profile_t *hw, kvt_tier_id_t tier, uint64_t bytes);
/* The same behind `queued` requests already in flight on the tier: floor(queued / qd) more round
 * trips of its latency (none when qd is 0). */
double kvt_cost_load_queued_s(const kvt_hw_profile_t *hw, kvt_tier_id_t tier, uint64_t bytes,
                              uint32_t queued);

/* ---------------------------------------------------------------------------------------------
 * Policy engine
 * ------------------------------------------------------------------------------------------- */

typedef enum {
    KVT_POLICY_COST = 0,   /* value = predicted reuse x saving per byte (see docs/policy.md) */
    KVT_POLICY_LRU = 1,    /* least recently used first, leaves first (SGLang, HiCache) */
    KVT_POLICY_LFU = 2,    /* least (decayed) frequently used first, then LRU */
    KVT_POLICY_ORACLE = 3, /* Belady: the block used furthest in the future first. Needs
                              hint->next_use on every call (the replay knows the future). */
    KVT_POLICY_KIND_COUNT = 4
} kvt_policy_kind_t;

const char *kvt_policy_kind_name(kvt_policy_kind_t k); /* "cost", "lru", "lfu", "oracle" */
int kvt_policy_kind_parse(const char *s, kvt_policy_kind_t *out); /* 0 or KVT_EINVAL */

/*
 * The cause of a move, handed by the call that caused it down to ops->move as an argument (the
 * executor keeps no state set around the call): the request kvt_policy_promote was given (kvtierd:
 * the PREFETCH that waits for the moves it started, those that make room for it included; NULL for
 * the engine's own moves), and the place tag (kvt_policy_set_place's when a MATCH queued the
 * promotion, kvt_policy_promote's own; -1: none; the engine gives it no meaning).
 */
typedef struct kvt_policy_cause {
    void *req;
    int tag;
} kvt_policy_cause_t;

/*
 * What the executor does for the engine. arg is kvt_policy_conf_t.ops_arg. The blocks named are
 * always a run inside one node: pages [depth, depth + npages) of node n, all in tier `from`.
 */
typedef struct kvt_policy_ops {
    /*
     * Copy the run from `from` to `to` and free it in `from`. Return 0 when done (the engine
     * then sets the blocks' tier and moves the accounting), KVT_POLICY_PENDING when started
     * (the executor marks the blocks KVT_BLOCK_BUSY and calls kvt_policy_move_done() later; the
     * engine reserves the bytes in `to` meanwhile), or a negative error (nothing changed; the
     * engine tries other blocks). KVT_EBUSY refusing a promotion says the run is in use where it
     * lies (kvtierd: a lease's holder may read it in place): the engine parks the promotion of
     * the path (64 at most, the oldest forgotten) and queues it again at the first
     * kvt_policy_step after no lease holds n. While a move is in flight the engine holds a lease on
     * n (owner KVT_POLICY_LEASE_OWNER), so n and depth stay valid for the executor. why: its cause,
     * never NULL, valid for the call. Required.
     */
    int (*move)(void *arg, const kvt_policy_cause_t *why, kvt_radix_node_t *n, uint32_t depth,
                uint32_t npages, kvt_tier_id_t from, kvt_tier_id_t to);
    /*
     * New blocks (just inserted, tier still KVT_TIER_NONE) are to be stored in `tier`. Return 0
     * when the executor holds (or will hold) their bytes there, or a negative error (the engine
     * then tries the next tier down or drops them). NULL: accepted without a call.
     */
    int (*admit)(void *arg, kvt_radix_node_t *n, uint32_t depth, uint32_t npages,
                 kvt_tier_id_t tier);
    /*
     * What a block of size bytes costs against tier's capacity (kvt_tier_footprint: a tier
     * rounds up and stores a header). The engine accounts used bytes and watermarks in these
     * units, so that its capacity can be the tier's own. NULL: the size itself (the replay).
     */
    uint64_t (*footprint)(void *arg, kvt_tier_id_t tier, uint32_t size);
    /*
     * Whether the index may grow by `bytes`: the lease table's growth, when a move is about to
     * start with no lease slot free for its pin. Return nonzero if it may; zero refuses the
     * move (KVT_ENOSPC: the engine tries other blocks, drops the run where it is the only way
     * to free its tier, or leaves a promotion where it is). NULL: it may.
     */
    int (*index_room)(void *arg, uint64_t bytes);
    /*
     * The blocks [depth, depth + npages) of the path ending at n hold their bytes in tier now
     * (adopted, or a move landed): set their tier. The executor owns the block record (kvtierd
     * writes it in one place); NULL: the engine writes the tier itself (the replay, and blocks
     * kvt_policy_on_insert admits).
     */
    void (*set_tier)(void *arg, kvt_radix_node_t *n, uint32_t depth, uint32_t npages,
                     kvt_tier_id_t tier);
    /*
     * Whether the blocks [depth, depth + npages) of the path ending at n may go into `to` at
     * all (kvtierd: their tenant's quota there). Zero refuses the move before any room is made
     * for it (KVT_ENOSPC: a demotion's run is then dropped where that is the only way to free
     * its tier, a promotion stays where it is), so that no other block goes for a move that
     * cannot happen. NULL: they may.
     */
    int (*fits)(void *arg, kvt_radix_node_t *n, uint32_t depth, uint32_t npages, kvt_tier_id_t to);
    /*
     * Whether tier can ever hold a block of `size` bytes of namespace ns, however much room it
     * has (kvtierd: an NVMe record holds a page whole and never spans segments). Zero: a block
     * leaving the tier above passes it by, for the next tier down that can hold it (its
     * demotion and the cost rule's drop are judged against that tier; dropped where there is
     * none). Unlike fits, which says whether a run may go in now (a quota), this is a property
     * of the block's size that never changes. NULL: every tier can hold every block.
     */
    int (*holds)(void *arg, kvt_tier_id_t tier, uint32_t ns, uint32_t size);
} kvt_policy_ops_t;

#define KVT_POLICY_PENDING 1

/* The cost policy's experts (docs/policy.md, "Experts"), the indices of kvt_policy_stats_t's
 * expert arrays: its value (the learned reuse rate per class x the saving), LRU's order, LFU's,
 * the value's order in every tier but the lowest with LRU's in the lowest (what it drops), and
 * the hit density learned per tier, hit class and age (LHD; not times the saving). */
#define KVT_POLICY_EXPERT_COST        0
#define KVT_POLICY_EXPERT_RECENT      1
#define KVT_POLICY_EXPERT_FREQUENT    2
#define KVT_POLICY_EXPERT_COST_RECENT 3
#define KVT_POLICY_EXPERT_DENSITY     4
#define KVT_POLICY_EXPERTS            5

/* The owner of the leases the engine holds on the nodes of moves in flight (so that their
 * (node, depth) names stay valid): callers must not release leases of this owner. */
#define KVT_POLICY_LEASE_OWNER 0x6b76742d706f6c69ull

typedef struct kvt_policy_tier_conf {
    uint64_t capacity; /* bytes; 0 = the tier is not configured */
    float high;        /* maintenance starts above high x capacity; 0 picks 0.95 */
    float low;         /* and demotes until at or below low x capacity; 0 picks 0.90 */
} kvt_policy_tier_conf_t;

typedef struct kvt_policy_conf {
    kvt_policy_kind_t kind;
    kvt_model_profile_t model;
    kvt_hw_profile_t hw;
    kvt_policy_tier_conf_t tiers[KVT_TIER_COUNT]; /* indexed by kvt_tier_id_t; [NONE] unused */
    kvt_tier_id_t admit_tier; /* where new blocks go first; 0 picks the fastest configured */
    /* Demotion into NVMe needs at least this many hits (tree counter); a block below it is
     * dropped instead when it can be (a leaf tail). 0 = no requirement. */
    uint32_t nvme_min_hits;
    /* COST only: drop instead of demoting when loading from the next tier would cost more than
     * recomputing (default on; 0 keeps the rule off, to compare). */
    int no_cost_drop;
    /* COST: 0 learns online which expert orders the victims (the default); 1 + an expert's index
     * (KVT_POLICY_EXPERT_*) pins that one, to compare or to test it. */
    int expert;
    /* ORACLE: 0 places a page only past victims used later than it (Belady with bypass: a page
     * not worth the admission tier goes to a lower one or nowhere, a hit is promoted to the
     * fastest tier it beats); 1 admits and promotes to the fastest tier as the other kinds do
     * (per-tier Belady on demand). The replay runs both and keeps the better. */
    int oracle_demand;
    /* The caller calls kvt_policy_on_node_free for every node the tree frees (the tree's
     * node_free_cb): frees by others (REMOVE, a tier losing blocks) then need no rebuild of the
     * engine's heaps, which costs a walk over every node. 0: every such free costs one. */
    int reports_node_frees;
    /* COST: a tree of more nodes than this renews its victim heaps for a refreshed model a slice
     * at a time, in kvt_policy_step, instead of in one walk over every node (about 0.2 s at a
     * million nodes). 0 picks 16384. */
    size_t sweep_above;
    uint32_t sweep_slice; /* nodes a sweep visits per kvt_policy_step; 0 picks 2048 */
    const kvt_policy_ops_t *ops;
    void *ops_arg;
    /* COST: the ghost table the engine records its drops in and reads (radix.h), borrowed: the
     * caller's, shared with whoever else asks about evicted blocks, and outliving the engine.
     * NULL: the engine makes its own (2^22 slots). */
    kvt_ghosts_t *ghosts;
} kvt_policy_conf_t;

/*
 * Per-request hints from the engine, all optional (pass NULL for none). They cover the pages
 * [from_page, end) of the request's path: the part that belongs to this session, not a shared
 * system prompt before it.
 */
typedef struct kvt_policy_hint {
    uint16_t priority;  /* retention priority: 0 none, 1..1000; doubles value per 100 */
    uint8_t finished;   /* the session ended: these pages will not be needed by it again */
    uint32_t paused_ms; /* the session pauses (tool call) and is expected back in this many
                           clock units; 0 = not paused */
    /* The first page of the path the hint covers. A MATCH's hint whose from_page is the depth
     * of the deepest matched node (kvtierd's) covers the session's own part: it is lowered to
     * the top of the chain of ancestors that have that one child (nothing else branches from
     * them: the session's earlier turns). Any other from_page is taken as given. */
    uint32_t from_page;
    /* ORACLE only: next_use[i] = the clock at which page i of the request is next used,
     * UINT32_MAX for never; nnext entries, borrowed for the call. */
    const uint32_t *next_use;
    uint32_t nnext;
} kvt_policy_hint_t;

typedef struct kvt_policy kvt_policy_t;

/*
 * Creates an engine over tree t. conf is copied. The tree clock (kvt_radix_set_clock) is the
 * engine's time: ages and paused_ms are in its units. Capacities of 0 leave a tier out; at least
 * one tier must be configured; high and low must satisfy 0 < low <= high <= 1. Returns 0,
 * KVT_EINVAL or KVT_ENOMEM.
 */
int kvt_policy_create(kvt_policy_t **out, kvt_radix_t *t, const kvt_policy_conf_t *conf);
void kvt_policy_destroy(kvt_policy_t *p); /* NULL is a no-op; frees nothing in the tree */

/*
 * Changes the knobs a running engine may take (a daemon's reload): the watermarks of every
 * configured tier (0 < low <= high <= 1) and the hits NVMe
 * demotion needs. The next kvt_policy_step works to the new marks. Returns 0 or KVT_EINVAL
 * (nothing changed).
 */
int kvt_policy_tune(kvt_policy_t *p, float high, float low, uint32_t nvme_min_hits);

/*
 * Hot path: a request matched m (from kvt_radix_match, best with KVT_MATCH_NOTOUCH when an
 * insert of the same request follows and bumps the tree counters). Updates the engine's
 * counters of the matched blocks, applies hints, and queues a promotion of every matched block
 * that is in a tier below the admission tier; kvt_policy_step() carries it out. The caller keeps
 * m->node alive until that step (a lease does). O(path); never moves anything.
 */
void kvt_policy_on_match(kvt_policy_t *p, const kvt_match_t *m, const kvt_policy_hint_t *hint);
/* The tag the promotions kvt_policy_on_match queues from now on carry to their moves' cause
 * (kvt_policy_cause_t.tag; -1, the initial value: none). kvtierd sets it around each MATCH to the
 * client's device (whose HBM pool the pages should go to). */
void kvt_policy_set_place(kvt_policy_t *p, int tag);

/*
 * The new blocks of an insert (res from kvt_radix_insert) are admitted: to the admission tier
 * if it has room, making room by demoting other blocks there if needed (bounded by the size of
 * the insert), else to the next configured tier down. Blocks that fit nowhere are dropped from
 * the tree (the tail of the new leaf). Sets each admitted block's tier and size. Returns the
 * number of pages admitted (>= 0) or KVT_EINVAL.
 */
int kvt_policy_on_insert(kvt_policy_t *p, const kvt_insert_t *res, const kvt_policy_hint_t *hint);
/* A split outside an insert (kvt_radix_split_at) made node head above an old node: its pages
 * become victims as the old node's were (an insert's split, res->split, on_insert sees itself).
 * NULL is a no-op. */
void kvt_policy_on_split(kvt_policy_t *p, kvt_radix_node_t *head);

/*
 * Blocks the executor stored by itself are handed to the engine: pages [depth, depth + npages)
 * of node n (all inside n), index-only until now (tier KVT_TIER_NONE) with their size and
 * location already set, whose bytes now sit in `tier` (kvtierd wrote a PUT's payload, a remote
 * probe found them, recovery read them off NVMe). prompt_pages is the length of the request
 * that added them (for the reuse model; 0 when unknown), hint as for on_insert. The engine sets
 * their tier and starts counting them. Returns npages, or with nothing changed: KVT_ENOSPC (the
 * tier's capacity would be passed), KVT_EAGAIN (the node's order would break: a block before
 * them is slower, or one after them faster, than `tier`), KVT_EINVAL (bad arguments, a tier
 * that is not configured, a block not index-only).
 */
int kvt_policy_adopt(kvt_policy_t *p, kvt_radix_node_t *n, uint32_t depth, uint32_t npages,
                     kvt_tier_id_t tier, uint32_t prompt_pages, const kvt_policy_hint_t *hint);
/*
 * Room for a block the executor writes into tier by itself before adopting it (kvtierd's PUT):
 * the charge of size bytes is held in the tier's accounting until kvt_policy_unhold gives it
 * back, so that the tier's used bytes and its watermarks count writes in flight. Without room
 * in the tier: KVT_ENOSPC, or with make_room, room is made as for the policy's own inserts (the
 * tier's lowest-value blocks are moved down, or dropped where the tier is the lowest configured
 * or the cost rule says so; never a leased or busy path's). Returns 0 (held); KVT_EAGAIN (the
 * room is on its way: moves out of the tier in flight will free it when they land); KVT_ENOSPC
 * (nothing there may go, or the block would not fit even in the empty tier); KVT_EINVAL.
 */
int kvt_policy_hold(kvt_policy_t *p, kvt_tier_id_t tier, uint32_t size, int make_room);
/* Gives back what kvt_policy_hold held for a block of size bytes in tier: before adopting the
 * block (kvt_policy_adopt then finds the room), or when its write failed. */
void kvt_policy_unhold(kvt_policy_t *p, kvt_tier_id_t tier, uint32_t size);

/*
 * Bounds the index's memory: evicts index-only pages (tier KVT_TIER_NONE, no bytes anywhere,
 * not busy) from the tails of unleased leaves, least recently used first as far as sampling
 * finds them (kvt_radix_trim), until the tree has allocated at most target bytes or budget
 * pages went. Pages with bytes are left to the tiers' capacities. Returns the pages evicted.
 */
uint32_t kvt_policy_trim_index(kvt_policy_t *p, uint64_t target, uint32_t budget);
/*
 * The same for when index-only pages are not enough: drops pages that hold bytes too (not busy,
 * on unleased leaves' tails, the trailing run of one tier at a time), least recently used first,
 * freeing them in their tiers. For an index-bytes too small for what the tiers hold (a warm
 * restart with a lowered limit): rather than refuse every new page for good, the oldest go.
 * Returns the pages dropped; counted in pages_dropped_for_index.
 */
uint32_t kvt_policy_trim_index_bytes(kvt_policy_t *p, uint64_t target, uint32_t budget);

/* Every block that leaves the tree (the tree's free callback forwards it here). */
void kvt_policy_on_free(kvt_policy_t *p, uint32_t ns, const kvt_block_t *b);
/* Every node the tree frees (the tree's node_free_cb forwards it here), when the engine was
 * created with reports_node_frees. */
void kvt_policy_on_node_free(kvt_policy_t *p, kvt_radix_node_t *n);

/*
 * Promotes the path that ends at node n (its first node_pages pages, all ancestors whole)
 * into the admission tier now, making room there; leased nodes on the path are promoted too
 * (the lease protects against demotion and drops, not against being made faster). Returns the
 * pages promoted or a negative error.
 */
int kvt_policy_prefetch(kvt_policy_t *p, kvt_radix_node_t *n, uint32_t node_pages);
/* The same up to tier `to` (a configured tier) instead of the admission tier, the moves it starts
 * (those that make room included) for why (NULL: none): blocks already in `to` or faster stay
 * where they are. KVT_EAGAIN when nothing moved because `to` has no room
 * until moves already in flight out of it land (ask again after kvt_policy_move_done). */
int kvt_policy_promote(kvt_policy_t *p, kvt_radix_node_t *n, uint32_t node_pages, kvt_tier_id_t to,
                       const kvt_policy_cause_t *why);

/*
 * Maintenance: runs queued promotions, then, for every tier above its high watermark, moves or
 * drops its lowest-value blocks until it is at its low watermark, at most budget pages in all
 * (0 = no limit). Returns the pages moved or dropped (>= 0), or a negative error.
 */
int kvt_policy_step(kvt_policy_t *p, uint32_t budget);

/* Completes a move an executor answered with KVT_POLICY_PENDING, named by the n and depth the
 * move was given (an insert may have split the run across n and its ancestors since: the engine
 * finds every page). The executor clears KVT_BLOCK_BUSY. status 0 moves the blocks' tier and
 * accounting; an error gives the reservation in `to` back (KVT_EBUSY for a promotion parks it,
 * as ops->move's refusal does). Returns 0; KVT_EAGAIN when the engine
 * kept the blocks in `from` after all (promotions meanwhile made the pages after the run faster
 * than `to`; the executor frees the copy it made in `to`); or KVT_EINVAL: no such move (nothing
 * changes), or a page of the run is no longer in `from` (lost meanwhile: the move is ended as
 * failed, its reservation and lease given back, and the executor frees its copies). */
int kvt_policy_move_done(kvt_policy_t *p, kvt_radix_node_t *n, uint32_t depth, uint32_t npages,
                         kvt_tier_id_t from, kvt_tier_id_t to, int status);

typedef struct kvt_policy_stats {
    uint64_t used[KVT_TIER_COUNT];     /* bytes held now, per tier (reservations included) */
    uint64_t capacity[KVT_TIER_COUNT]; /* as configured */
    uint64_t blocks[KVT_TIER_COUNT];   /* blocks held now */
    uint64_t moved_bytes[KVT_TIER_COUNT][KVT_TIER_COUNT]; /* [from][to], promotions included */
    uint64_t admitted_bytes[KVT_TIER_COUNT];              /* new blocks written per tier */
    uint64_t dropped_bytes[KVT_TIER_COUNT]; /* dropped by the engine, per tier they were in */
    uint64_t dropped_blocks;
    uint64_t cost_drops;              /* drops chosen because recompute beat loading from below */
    uint64_t demotions;               /* runs moved down */
    uint64_t promotions;              /* runs moved up */
    uint64_t rejected;                /* new pages that fit in no tier */
    uint64_t pending_moves;           /* moves in flight */
    uint64_t index_trimmed;           /* index-only pages evicted by kvt_policy_trim_index */
    uint64_t pages_dropped_for_index; /* pages with bytes dropped by kvt_policy_trim_index_bytes */
    uint64_t rebuilds;                /* victim heaps rebuilt in one walk over every node */
    uint64_t sweeps;                  /* and renewed by a sweep (sweep_above) */
    uint64_t pin_refusals;            /* moves not started: the index had no room for their pin */
    /* Promotions the executor refused for a lease's readers (KVT_EBUSY), parked until no lease
     * holds the node, and those queued again once none did. */
    uint64_t parked, unparked;
    /* Queued promotions (a MATCH's) not started, since a parked one waits on their path: no
     * room made for them, no move refused. */
    uint64_t park_waits;
    /* Queued promotions that found their room in the top tier still on its way and wait for it
     * (parked till a move lands), and those dropped after ROOM_TRIES rooms went elsewhere. */
    uint64_t room_waits, room_gaveups;
    /* COST: its experts (KVT_POLICY_EXPERT_*; docs/policy.md, "Experts"): the one chosen (it
     * orders the victims from the next rebuild or sweep of the heaps on), the seconds of loads
     * and recomputes each one's miniature hierarchy spent on the sampled pages lately (decayed;
     * the lowest is chosen; 0 with conf.expert set: no simulations), and the pages each one's
     * choices moved down or out. 0 for the other kinds. */
    uint32_t expert;
    uint64_t expert_switches; /* times another expert was chosen */
    double expert_miss_s[KVT_POLICY_EXPERTS];
    uint64_t expert_choices[KVT_POLICY_EXPERTS];
    /* What the same sampled pages cost the real hierarchy (loads from the tier each was found
     * in, or recomputes), decayed as expert_miss_s: beside the figure of the expert in charge,
     * how far its miniature copy is from what its order really does. And the sampled pages used
     * while each expert ordered the victims (the time each was in charge, in sampled uses). */
    double expert_real_s;
    uint64_t expert_uses[KVT_POLICY_EXPERTS];
} kvt_policy_stats_t;

void kvt_policy_stats(const kvt_policy_t *p, kvt_policy_stats_t *st);

/* Bytes of one block of namespace ns (its page size through the model profile). */
uint64_t kvt_policy_block_bytes(const kvt_policy_t *p, uint32_t ns);
/* Forgets what the policy keeps by namespace id, before the tree closes that namespace (its id
 * may then name another). */
void kvt_policy_forget_ns(kvt_policy_t *p, uint32_t ns);

/* Walks the tree and checks the invariants above against the engine's accounting. O(tree):
 * tests and debug builds. Returns 0 or KVT_ECORRUPT (logging what broke). */
int kvt_policy_verify(const kvt_policy_t *p);

#endif
