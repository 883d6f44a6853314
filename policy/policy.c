/*
 * policy.c: the tier policy engine. It owns the per-tier accounting, the victim queues, the
 * reuse model of the cost-aware policy, and every decision to promote, demote or drop a block;
 * the executor behind kvt_policy_ops_t carries the decisions out.
 *
 * Victims
 * -------
 * Because a node's tiers never get faster with depth, a node holds at most one run per tier:
 *
 *     node blocks:  [ hbm hbm hbm | dram dram | nvme nvme nvme ]
 *                                 ^ run of dram = [3, 5); its boundary block is index 4
 *
 * The candidate for tier T in a node is the deepest block of its T run: demoting it (and a few
 * before it) keeps the order, and when the run is the leaf's tail it can be dropped. Each tier
 * has a min-heap of (node, key) with the key of that boundary block, where a lower key means a
 * better victim. Keys go stale; a popped entry is checked against the live key and pushed back
 * when it has grown. A key that shrinks (the oracle's next use after a hit, a "finished" hint)
 * is pushed anew at once. Leased nodes are left out (a popped one is not pushed back). The
 * heaps are rebuilt from a scan of every node when they run dry after enough has changed since
 * the last scan (pushes, deaths, ended leases: a 1/64 of the nodes' count), when the cost model
 * has been refreshed, or when the tree lost blocks behind the engine's back.
 * Nodes the engine empties are remembered (with a sequence number) until the next rebuild, so
 * that stale entries naming them are skipped even if the allocator reuses the address.
 *
 * In a tree of more than sweep_above nodes, the rebuild a refreshed model asks for is a sweep
 * instead: new heaps are filled a slice of nodes per kvt_policy_step from a copy of the tree's
 * node registry taken when the sweep began (its nodes freed since are known by their recorded
 * deaths, as heap entries are; nodes made since are pushed by the hooks), while the old heaps go
 * on serving and every push goes to both; the new ones take over at the copy's end. A whole
 * rebuild of a million nodes held the caller for a fifth of a second. Sweeps need every node
 * death reported (reports_node_frees); without, the walk stays whole (after_insert says when a
 * sweep begins).
 *
 * The oracle (the replay's, with the trace's next uses as keys) places with bypass unless
 * conf.oracle_demand: a page enters a tier only past victims used later than it (p->bar), so a
 * new page may go straight to a lower tier or nowhere, a hit is promoted to the fastest tier it
 * beats, and a victim goes to the fastest tier below that it beats, else it is dropped. Without
 * it, every hit on a page used far ahead pushed pages used sooner down a tier (docs/policy.md).
 *
 * The cost policy's reuse model
 * -----------------------------
 * Blocks fall into classes: how often they were hit (log-bucketed; a block that comes back
 * after the engine dropped it counts one hit more, found in a table of the prefix hashes of
 * dropped blocks, the "ghosts" of ARC and S3-FIFO) x how far from the end of the prompt that
 * added them they sat (the last few hundred tokens of a prompt are the turn's own text and come
 * back far less often). Per class the engine counts, with exponential decay,
 * the hits its blocks got and the times they left a tier (demoted or dropped), which gives the
 * probability that a block of the class is hit before it next has to move: P(c). The expected
 * time to its next use grows with the time since its last use, so the hit rate of a block is
 * about P(c) / (age + A0). Its value is that rate x the seconds a hit saves by having the
 * block in its tier instead of where it would go next (the next tier down, or recomputation at
 * its depth, whichever is cheaper) x 2^(priority / 100). Hints replace the rate ("paused": a
 * hit is expected when the session is back) or scale it down ("finished").
 *
 * Experts
 * -------
 * Which signal predicts reuse differs by workload: recency for agents and chat, frequency for a
 * few hot system prompts, the learned per-class rate for bursts of users who never return. The
 * cost policy keeps five experts, each an order of victims: its value above (EXP_COST), LRU's
 * (EXP_RECENT), LFU's (EXP_FREQ), the value's in the tiers above the lowest with LRU's in
 * the lowest (EXP_SPLIT: agents and chat lose less to a drop by recency than by the value),
 * and a hit density learned from the ages at which pages were used again or left (EXP_HD, as
 * LHD: a page's chance of a use soon need not fall with its age); one of them orders the heaps
 * at a time. Which one is learned online by miniature simulations (Waldspurger et al., ATC'17;
 * the sampling of SHARDS): the pages whose prefix hash falls in 1/32 of the hash space go
 * through five small copies of the tier hierarchy, 1/32 of each tier's size, one per expert,
 * each evicting by its expert's order (in LRU's, exactly the least recent page; in the others,
 * the best of 8 entries drawn at random, 16 for the density) and moving victims down a
 * tier as the engine does. Each use costs each copy what it would cost the engine: the load time
 * of the tier it is found in, or the recompute time of the page at its depth. The expert whose copy
 * cost least lately (decayed sums over about 5,000 sampled uses) takes over at the next refresh of
 * the model, by a margin of 1 % over the one in charge, and the heaps are built again with its keys
 * (a rebuild, or a sweep in a large tree). A copy misjudges its own order by a few per cent, so
 * a switch also needs the copies' seconds to agree once each is corrected by what its order
 * really cost over what its copy said while it was in charge (kvt__policy_pick_expert). Ghost hits
 * per expert (LeCaR) were tried first and judged the experts poorly: each judged only its own
 * victims, and a switch to LFU for a while left blocks entrenched by their counts for good
 * (docs/policy.md).
 */
#include "policy.h"
#include "policy_test.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define CHUNK_PAGES     8 /* pages moved or dropped per victim visit */
#define NHITC           6 /* hit-count classes */
#define NPOSC           6 /* classes of distance from the end of the prompt that added it */
#define NCLASS          (NHITC * NPOSC)
#define POS_SHIFT       4 /* the position class lives in flags bits 4..6 (KVT_BLOCK_USER0..) */
#define POS_MASK        (7u << POS_SHIFT)
#define GHOST_FLAG      (1u << 7) /* re-admitted after a drop that followed reuse */
#define GHOST_BITS      22        /* ghost table: 2^22 remembered drops, 32 MiB */
#define AGE0            1000.0    /* clock units added to every age: one second of ms */
#define REFRESH_EVERY   64    /* inserts between refreshes of the cost model (and heap rebuilds) */
#define SWEEP_ABOVE     16384 /* default sweep_above: larger trees rebuild their heaps in slices */
#define SWEEP_SLICE     2048  /* default sweep_slice: nodes a sweep visits per kvt_policy_step */
#define SWEEP_EVERY     64    /* a sweep begins at most once per 1/64 of the nodes in inserts */
#define HIST_DECAY      0.97
#define PROMO_QUEUE     64
#define PARK_MAX        64 /* promotions parked for readers' leases; the oldest goes first */
#define ROOM_TRIES      3  /* times a queued promotion makes room again, its room gone elsewhere */
#define PRIO_MASK       0x03ffu
#define PAUSE_SHIFT     10
#define PAUSE_FINISHED  63u
#define BLOCK_CACHE_NS  16
#define INF_KEY         1e300
#define FINISHED_FACTOR 0.01
#define BYPASS_TRIES    8 /* ORACLE: victims that could not go tried per placement in a tier */
#define PAUSED_P        0.9
/* The cost policy's experts (see "Experts" at the top): each orders victims by its own signal. */
#define NEXP         KVT_POLICY_EXPERTS
#define EXP_COST     0          /* learned reuse rate per class x saving */
#define EXP_RECENT   1          /* LRU: recency, deeper first on ties */
#define EXP_FREQ     2          /* LFU: hit count, recency on ties */
#define EXP_SPLIT    3          /* EXP_COST's order above the lowest tier, EXP_RECENT's in it */
#define EXP_HD       4          /* LHD: the hit density learned per tier, hit class and age */
#define NAGE         32         /* EXP_HD's age buckets: half octaves from 256 ms (age_bucket) */
#define HD_SAMPLE    16         /* entries drawn per eviction in EXP_HD's miniature cache */
#define RUN_GAIN     0.05       /* smoothing of the pages a match loads from a tier */
#define MS_SHIFT     5          /* the miniature simulations see 1 page in 2^5 */
#define MS_MAX       (1u << 14) /* sampled pages a miniature tier holds at most (768 KiB table) */
#define MS_SAMPLE    8          /* entries drawn per eviction in a miniature cache */
#define MS_DRAWS_MAX (HD_SAMPLE > MS_SAMPLE ? HD_SAMPLE : MS_SAMPLE)
#define MS_DECAY     0.9998 /* each sampled use ages the simulated costs: about 5,000 uses */
/* Another expert takes over when its simulated cost is this much lower: 1 % since the recency
 * copies evict exactly (ms_victim); 0.5 % before, when their sampled victims made them err. */
#define EXP_MARGIN 0.01
/* Sampled uses an expert must have ordered the victims for before what its copy misjudges of its
 * real cost counts (choose_expert): a tenth of the simulations' window. */
#define HELD_USES   500.0
#define PAUSED_HITS 64.0 /* EXP_FREQ: hits a paused session's pages count as until it is back */
#define FINISHED_AGE                                                                               \
    600000.0 /* EXP_RECENT: a finished session's pages count as this much older                    \
              */

typedef struct key {
    double a, b; /* compared lexicographically; lower is a better victim */
} vkey_t;

typedef struct hent {
    kvt_radix_node_t *n;
    vkey_t k;
    uint64_t seq; /* push sequence: older than a recorded death means stale */
} hent_t;

typedef struct heap {
    hent_t *v;
    size_t len, cap;
} heap_t;

typedef struct dead {
    kvt_radix_node_t **keys;
    uint64_t *seqs;
    size_t cap, len;
} dead_t;

typedef struct pmove {
    kvt_radix_node_t *n;
    uint32_t depth, npages;
    kvt_tier_id_t from, to;
    uint64_t lease;
    uint64_t bytes;      /* payload bytes of the run */
    uint64_t charge_to;  /* reserved in `to` */
    uint64_t charge_frm; /* given back by `from` when the move lands */
    int place;           /* its cause's tag: a promotion refused at its switch is parked with it */
} pmove_t;

/* One sampled page in an expert's miniature simulation (see "Experts" at the top). */
typedef struct msent {
    uint64_t hash; /* the page's prefix hash; 0 = an empty slot */
    uint32_t last; /* clock of its last use */
    uint32_t hits;
    /* 24 bytes, not 32: the tables are most of the simulations' cache misses. The depth only
     * breaks LRU's ties (a deeper page is capped at MS_DEPTH_MAX); redo is from the real one. */
    uint32_t depth : 24;
    uint32_t pos : 8; /* position class */
    float redo;       /* seconds to recompute it */
} msent_t;
#define MS_DEPTH_MAX ((1u << 24) - 1)
_Static_assert(sizeof(msent_t) == 24, "a miniature tier's slot is 24 bytes");

/* An entry of a miniature tier's recency heap: the page (by hash) and the use it was pushed for,
 * a stale entry (the page gone, or used again since) being skipped when it comes up. */
typedef struct msrec {
    uint64_t hash;
    /* its key (ms_lru_key: last use, deeper first on ties, the real heaps' LRU key) is
     * computed from these at each comparison, the same double: 16 bytes, not 24 with the key
     * kept, the recency heaps being a third of the simulations' memory */
    uint32_t last, depth;
} msrec_t;
_Static_assert(sizeof(msrec_t) == 16, "a recency heap's entry is 16 bytes");

/* One tier of an expert's miniature hierarchy: the sampled pages it would hold there, in open
 * addressing (linear probing, at most half full). A tier in LRU's order also keeps its pages in
 * a min-heap by recency (lru), so that its victim is exactly the least recent, as the engine's
 * heaps take it, not the best of a few drawn at random. */
typedef struct msim {
    msent_t *v;
    /* bit i: slot i holds a page. A victim draw finds the first page at or after the slot drawn
     * in it with one count of trailing zeros; scanning the slots, it mispredicted the end of the
     * scan half the time (the table is half full at most), two to four times per eviction. */
    uint64_t *occ;
    uint32_t mask, len, max;
    msrec_t *lru;        /* NULL in a tier not in LRU's order */
    uint32_t nlru, clru; /* entries (stale ones included) and room */
} msim_t;

typedef struct promo {
    kvt_radix_node_t *n;
    uint32_t node_pages;
    uint64_t seq;
    uint64_t foreign; /* p->foreign when queued: a foreign free since may have taken n */
    int place;        /* kvt_policy_set_place's tag when queued */
    uint32_t rooms;   /* times it made room in the top tier that it did not get (park_room) */
} promo_t;

/* A promotion the executor refused because a lease's holder may read the run in place
 * (KVT_EBUSY, kvt_policy_ops_t.move): the path as it was to be promoted, and the node whose
 * leases refused it (the path's shallowest refused node: a lease anywhere below counts on it).
 * Or, with room set, a queued promotion that stopped at node `at` for room in the top tier still
 * on its way (park_room): it waits for moves to land, not for a lease to end. */
typedef struct parked {
    promo_t q;
    kvt_radix_node_t *at;
    int room;
} parked_t;

struct kvt_policy {
    kvt_radix_t *t;
    kvt_policy_conf_t c;
    uint64_t cap[KVT_TIER_COUNT], high[KVT_TIER_COUNT], low[KVT_TIER_COUNT];
    uint64_t used[KVT_TIER_COUNT];        /* resident + reserved for moves + held (hold) */
    uint64_t pending_out[KVT_TIER_COUNT]; /* bytes leaving the tier when pending moves finish */
    uint64_t held[KVT_TIER_COUNT];        /* bytes the executor holds for its own writes */
    kvt_tier_id_t lower[KVT_TIER_COUNT];  /* next configured tier down; NONE at the bottom */
    kvt_tier_id_t top;                    /* the admission tier */
    kvt_policy_stats_t st;

    heap_t heap[KVT_TIER_COUNT];
    int nexp; /* experts: NEXP for COST, 1 otherwise */
    dead_t dead;
    uint64_t seq;          /* bumped on every push and every death */
    uint64_t rebuild_seq;  /* seq at the last rebuild */
    uint64_t releases;     /* the tree's lease releases at the last rebuild */
    uint64_t foreign_seen; /* foreign frees at the last rebuild */
    uint64_t foreign;      /* blocks freed by someone else than the engine */
    int in_drop;
    int stale;     /* rebuild before the next victim: the cost model changed a while ago */
    int dead_lost; /* a node death could not be recorded: only a rebuild is safe */
    /* Nodes left out of the heaps while leased or protected (see orphan_add), and whether one
     * could not be recorded (then every node ending a lease or a promotion is pushed). */
    dead_t orph;
    int orph_lost;
    uint64_t inserts_since_rebuild;
    /* The sweep (see the top): heaps being filled, the copy of the registry and how far into it,
     * and the seq it began at (deaths before it concern no entry of the new heaps). */
    int sweeping;
    heap_t next[KVT_TIER_COUNT];
    kvt_radix_node_t **sweep_nodes;
    size_t sweep_n, sweep_cap, sweep_at;
    uint64_t sweep_seq;

    pmove_t *pend; /* moves in flight, each holding a lease on its node */
    size_t npend, pend_cap;

    promo_t promo[PROMO_QUEUE];
    uint32_t npromo;
    /* Promotions parked until no lease holds their node (park_run), looked at again whenever
     * a lease of the tree has ended since the last look (park_releases). */
    parked_t park[PARK_MAX];
    uint32_t npark;
    uint64_t park_releases;
    int place; /* kvt_policy_set_place */

    /* cost model state */
    uint32_t queued[KVT_TIER_COUNT];    /* moves in flight from or to each tier: its queue */
    double run_pages[KVT_TIER_COUNT];   /* pages a match loads from each tier, smoothed */
    double page_load_s[KVT_TIER_COUNT]; /* per page of the most common page size, no latency */
    uint32_t model_page_size;
    double class_hits[NCLASS]; /* decayed counts of hits, and of moves out of a tier */
    double class_ends[NCLASS];
    double class_p[NCLASS]; /* P(hit before the next move), as of the last refresh */
    /* EXP_HD (LHD): per tier and hit class, decayed counts of the ages (since the last use) at
     * which pages in the tier were used again and at which their residency there ended without
     * a use, in half-octave buckets, and the hit density (expected hits per ms of residency
     * left) of a page of each age, as of the last refresh. 19 KiB, whatever the tree's size. */
    double hd_hits[KVT_TIER_COUNT][NHITC][NAGE];
    double hd_ends[KVT_TIER_COUNT][NHITC][NAGE];
    float hd[KVT_TIER_COUNT][NHITC][NAGE];
    uint32_t inserts_since_refresh;

    /* Ghosts (as in ARC and S3-FIFO): the prefix hashes of reused blocks the engine dropped, so
     * that a block coming back is known to have been reused before. Direct-mapped. */
    kvt_ghosts_t *ghost;
    int own_ghost; /* made here (conf.ghosts NULL): destroyed with the engine */

    /* Experts (COST): the one choosing victims now, their miniature simulations, and how many
     * sampled pages those hold (0 until the first sampled page sizes them). */
    int xcur;  /* the expert whose keys order heap[] */
    int xnext; /* and next[], while a sweep fills it */
    int xwant; /* the one the simulations chose: it takes over at the next rebuild or sweep */
    msim_t ms[NEXP][KVT_TIER_COUNT];
    double ms_cost[NEXP]; /* decayed seconds the sampled pages cost each one's hierarchy */
    /* and what they cost the real hierarchy, decayed alike: beside the copy of the expert in
     * charge, how far that copy's figure is from what its order really did (issue 40) */
    double ms_real;
    /* The same, per expert, over the sampled uses while it was in charge only, beside what its
     * own copy charged those uses and their count (decayed alike, and only then): how far each
     * copy misjudges what its order really does (choose_expert). 120 bytes. */
    double held_real[NEXP], held_copy[NEXP], held_n[NEXP];
    double ms_load[KVT_TIER_COUNT]; /* seconds to load a sampled page from each tier */
    int ms_state;                   /* 0 not sized yet, 1 running, -1 off (no memory) */
    uint64_t ms_rng;

    uint32_t bb_ns[BLOCK_CACHE_NS], bb_ps[BLOCK_CACHE_NS];
    kvt_radix_node_t **path; /* scratch: nodes of a path */
    size_t path_cap;
    size_t protect; /* while promoting: path[0, protect) are no victims */
    /* ORACLE: the key of the page being placed (admitted, promoted or demoted into a tier);
     * only victims strictly worse than it may make room for it (bar_on). */
    vkey_t bar;
    int bar_on;
};

static const char *const kind_names[KVT_POLICY_KIND_COUNT] = {"cost", "lru", "lfu", "oracle"};

const char *kvt_policy_kind_name(kvt_policy_kind_t k)
{
    return (unsigned)k < KVT_POLICY_KIND_COUNT ? kind_names[k] : "unknown";
}

int kvt_policy_kind_parse(const char *s, kvt_policy_kind_t *out)
{
    if (!s || !out)
        return KVT_EINVAL;
    for (int i = 0; i < KVT_POLICY_KIND_COUNT; i++) {
        if (strcmp(s, kind_names[i]) == 0) {
            *out = (kvt_policy_kind_t)i;
            return 0;
        }
    }
    return KVT_EINVAL;
}

/* ---- small helpers -------------------------------------------------------------------------- */

static int tier_ok(kvt_tier_id_t t)
{
    return t > KVT_TIER_NONE && t < KVT_TIER_COUNT;
}

/* Order of tiers inside a node: faster first, index-only blocks (NONE) last. */
static unsigned tier_rank(uint8_t t)
{
    return t == KVT_TIER_NONE ? 255u : t;
}

static uint32_t now_clock(const kvt_policy_t *p)
{
    return kvt_radix_clock(p->t);
}

uint64_t kvt_policy_block_bytes(const kvt_policy_t *p, uint32_t ns)
{
    uint32_t ps = kvt_radix_ns_page_size(p->t, ns);
    return kvt_cost_kv_bytes(&p->c.model, ps);
}

static uint32_t block_bytes(kvt_policy_t *p, uint32_t ns)
{
    uint32_t slot = ns % BLOCK_CACHE_NS;
    if (p->bb_ps[slot] == 0 || p->bb_ns[slot] != ns) {
        uint64_t b = kvt_policy_block_bytes(p, ns);
        p->bb_ns[slot] = ns;
        p->bb_ps[slot] = b > UINT32_MAX ? UINT32_MAX : (uint32_t)b;
    }
    return p->bb_ps[slot];
}

void kvt_policy_forget_ns(kvt_policy_t *p, uint32_t ns)
{
    if (p && p->bb_ns[ns % BLOCK_CACHE_NS] == ns)
        p->bb_ps[ns % BLOCK_CACHE_NS] = 0;
}

/* The run [*a, *b) of node-local indices of blocks in tier t (empty when *a == *b). */
static void node_run(kvt_radix_node_t *n, uint8_t t, uint32_t *a, uint32_t *b)
{
    const kvt_block_t *bl = kvt_radix_node_blocks(n);
    uint32_t np = kvt_radix_node_pages(n);
    unsigned r = tier_rank(t);
    uint32_t lo = 0, hi = np;
    while (lo < hi) { /* first index with rank >= r */
        uint32_t mid = lo + (hi - lo) / 2;
        if (tier_rank(bl[mid].tier) < r)
            lo = mid + 1;
        else
            hi = mid;
    }
    *a = lo;
    hi = np;
    while (lo < hi) { /* first index with rank > r */
        uint32_t mid = lo + (hi - lo) / 2;
        if (tier_rank(bl[mid].tier) <= r)
            lo = mid + 1;
        else
            hi = mid;
    }
    *b = lo;
}

static int key_lt(vkey_t x, vkey_t y)
{
    return x.a < y.a || (x.a == y.a && x.b < y.b);
}

/* ---- heaps and the dead set ----------------------------------------------------------------- */

/* Heap order: the key, then the older push. Keys tie often (the cost policy's are computed when
 * pushed, so the leaves of one class pushed at age 0 all weigh the same until a rebuild): in
 * push order they go oldest first, where the heap's own order among equals put the newest
 * first as soon as one pop moved the last entry up. */
static int ent_lt(const hent_t *x, const hent_t *y)
{
    return key_lt(x->k, y->k) || (!key_lt(y->k, x->k) && x->seq < y->seq);
}

static int heap_push(kvt_policy_t *p, heap_t *h, kvt_radix_node_t *n, vkey_t k)
{
    if (h->len == h->cap) {
        size_t nc = h->cap ? 2 * h->cap : 256;
        hent_t *v = realloc(h->v, nc * sizeof(*v));
        if (!v)
            return KVT_ENOMEM;
        h->v = v;
        h->cap = nc;
    }
    size_t i = h->len++;
    hent_t e = {n, k, ++p->seq};
    while (i > 0) {
        size_t up = (i - 1) / 2;
        if (!ent_lt(&e, &h->v[up]))
            break;
        h->v[i] = h->v[up];
        i = up;
    }
    h->v[i] = e;
    return 0;
}

static hent_t heap_pop(heap_t *h)
{
    hent_t top = h->v[0];
    hent_t last = h->v[--h->len];
    size_t i = 0, n = h->len;
    for (;;) {
        size_t l = 2 * i + 1, r = l + 1, m = i;
        const hent_t *mk = &last;
        if (l < n && ent_lt(&h->v[l], mk)) {
            m = l;
            mk = &h->v[l];
        }
        if (r < n && ent_lt(&h->v[r], mk))
            m = r;
        if (m == i)
            break;
        h->v[i] = h->v[m];
        i = m;
    }
    if (n > 0)
        h->v[i] = last;
    return top;
}

static size_t ptr_slot(const dead_t *d, const kvt_radix_node_t *n)
{
    uint64_t x = (uint64_t)(uintptr_t)n;
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    return (size_t)x & (d->cap - 1);
}

/* Moves d's deaths recorded at seq `from` or later into a new table of cap slots (a power of
 * two). 0, or KVT_ENOMEM with d unchanged. */
static int dead_rehash(dead_t *d, size_t cap, uint64_t from)
{
    dead_t nd = {0};
    nd.cap = cap;
    nd.keys = calloc(nd.cap, sizeof(*nd.keys));
    nd.seqs = calloc(nd.cap, sizeof(*nd.seqs));
    if (!nd.keys || !nd.seqs) {
        free(nd.keys);
        free(nd.seqs);
        return KVT_ENOMEM;
    }
    for (size_t i = 0; i < d->cap; i++) {
        if (!d->keys[i] || d->seqs[i] < from)
            continue;
        size_t s = ptr_slot(&nd, d->keys[i]);
        while (nd.keys[s])
            s = (s + 1) & (nd.cap - 1);
        nd.keys[s] = d->keys[i];
        nd.seqs[s] = d->seqs[i];
        nd.len++;
    }
    free(d->keys);
    free(d->seqs);
    *d = nd;
    return 0;
}

/* n's record in d (added if new) set to seq; d has room. */
static void dead_put(dead_t *d, kvt_radix_node_t *n, uint64_t seq)
{
    size_t s = ptr_slot(d, n);
    while (d->keys[s] && d->keys[s] != n)
        s = (s + 1) & (d->cap - 1);
    if (!d->keys[s])
        d->len++;
    d->keys[s] = n;
    d->seqs[s] = seq;
}

static int dead_add(kvt_policy_t *p, kvt_radix_node_t *n)
{
    dead_t *d = &p->dead;
    if (2 * (d->len + 1) > d->cap && dead_rehash(d, d->cap ? 2 * d->cap : 256, 0) < 0) {
        p->dead_lost = 1; /* only a whole rebuild is safe now */
        return KVT_ENOMEM;
    }
    dead_put(d, n, ++p->seq);
    return 0;
}

/* Whether an entry pushed at seq for node n names a node that has since died. */
static int dead_after(const kvt_policy_t *p, const kvt_radix_node_t *n, uint64_t seq)
{
    const dead_t *d = &p->dead;
    if (d->len == 0)
        return 0;
    size_t s = ptr_slot(d, n);
    while (d->keys[s]) {
        if (d->keys[s] == n)
            return d->seqs[s] > seq;
        s = (s + 1) & (d->cap - 1);
    }
    return 0;
}

/*
 * The nodes left out of the heaps: a popped entry of a leased or protected node is not pushed
 * back, and a rebuild or a sweep passes leased nodes by. The end of a move's lease
 * (kvt_policy_move_done) and of a promotion's protection push such a node again, and only
 * such a node: pushing every node of the path there grew the heaps by the path's length per
 * move until a rebuild. A record whose node died names at worst a new node at the same
 * address, which is then pushed once more than needed. A seq of 0 marks a record taken.
 */
static void orphan_add(kvt_policy_t *p, kvt_radix_node_t *n)
{
    dead_t *d = &p->orph;
    if (2 * (d->len + 1) > d->cap && dead_rehash(d, d->cap ? 2 * d->cap : 256, 1) < 0) {
        p->orph_lost = 1; /* until the next rebuild, every such node is pushed */
        return;
    }
    dead_put(d, n, p->seq + 1); /* after every entry pushed so far, at or after a sweep's start */
}

/* Whether n was left out of the heaps since it was last pushed; forgets the record (the caller
 * pushes n). */
static int orphan_take(kvt_policy_t *p, const kvt_radix_node_t *n)
{
    dead_t *d = &p->orph;
    if (p->orph_lost)
        return 1;
    if (d->len == 0)
        return 0;
    size_t s = ptr_slot(d, n);
    while (d->keys[s]) {
        if (d->keys[s] == n) {
            int was = d->seqs[s] != 0;
            d->seqs[s] = 0;
            return was;
        }
        s = (s + 1) & (d->cap - 1);
    }
    return 0;
}

/*
 * Parked promotions. The executor refuses to move a run out of a tier its readers read in place
 * while a lease holds the node (KVT_EBUSY): the switch would free the copy under them. Nothing
 * else would try the promotion again once they are done (an engine MATCHes each path with a
 * lease, so the promotion its MATCH queued always found that lease), so it is parked here and run
 * again by the first step after the last lease on its node ended. PARK_MAX entries, one per path
 * end; when full, the oldest is forgotten (the next MATCH of its path queues it again). An entry
 * names nodes as the queue does (seq, foreign): one that may have died since is dropped.
 * Meanwhile a queued promotion that reaches a node where one waits joins it instead of starting
 * (park_waits_at): an engine MATCHes a hot path at every step, and each of those promotions made
 * room in the top tier, demoting other blocks, for a move the executor then refused.
 *
 * The same entries hold queued promotions that made room in the top tier and found it still on
 * its way (park_room): kvtierd's moves out land later, and nothing else would try the promotion
 * again once they have. Returns the entry, marked as a lease's; it keeps the count of rooms made
 * (promo_t.rooms) of the entry it replaces for the same path end.
 */
static parked_t *park_put(kvt_policy_t *p, kvt_radix_node_t *n, uint32_t node_pages,
                          kvt_radix_node_t *at, int place)
{
    uint32_t k = 0, rooms = 0;
    while (k < p->npark && p->park[k].q.n != n)
        k++;
    if (k == PARK_MAX) { /* full: the oldest goes */
        k = 0;
        for (uint32_t i = 1; i < p->npark; i++)
            if (p->park[i].q.seq < p->park[k].q.seq)
                k = i;
    } else if (k == p->npark) {
        p->npark++;
    } else {
        rooms = p->park[k].q.rooms; /* a MATCH again does not start the count again */
        if (p->park[k].q.node_pages > node_pages)
            node_pages = p->park[k].q.node_pages; /* parked again for another run of the path */
    }
    p->park[k] = (parked_t){{n, node_pages, p->seq, p->foreign, place, rooms}, at, 0};
    return &p->park[k];
}

/* A promotion the executor refused at node `at` (KVT_EBUSY). */
static void park(kvt_policy_t *p, kvt_radix_node_t *n, uint32_t node_pages, kvt_radix_node_t *at,
                 int place)
{
    park_put(p, n, node_pages, at, place);
    p->st.parked++;
}

/* Whether e's nodes are still the ones it was parked for. */
static int park_valid(const kvt_policy_t *p, const parked_t *e)
{
    return !p->dead_lost && !dead_after(p, e->q.n, e->q.seq) && !dead_after(p, e->at, e->q.seq) &&
           (p->c.reports_node_frees || p->foreign == e->q.foreign);
}

/* Whether a promotion parked at node x still waits there: a lease holds x as it did when the
 * executor refused the move. Another promotion through x would make room for its move (moving
 * other blocks out of the top tier) only to be refused again. One waiting for room stops none:
 * the room on its way counts for the others too (make_room). */
static int park_waits_at(const kvt_policy_t *p, const kvt_radix_node_t *x)
{
    for (uint32_t i = 0; i < p->npark; i++)
        if (p->park[i].at == x && !p->park[i].room && park_valid(p, &p->park[i]))
            return kvt_radix_node_leased(x);
    return 0;
}

/* Before the record of the deaths so far is forgotten (a rebuild, a sweep's end): the entries
 * that may name a dead node go, and the others are stamped now, so that only deaths from here
 * on concern them. */
static void park_renew(kvt_policy_t *p)
{
    uint32_t kept = 0;
    for (uint32_t i = 0; i < p->npark; i++) {
        if (!park_valid(p, &p->park[i]))
            continue;
        p->park[kept] = p->park[i];
        p->park[kept++].q.seq = p->seq;
    }
    p->npark = kept;
}

/* ---- the cost model's reuse estimate ------------------------------------------------------- */

/* A constant expression, so that on_match's table of classes (class_of) is made from it too. */
#define HIT_CLASS(h) ((h) == 0 ? 0 : (h) == 1 ? 1 : (h) == 2 ? 2 : (h) < 5 ? 3 : (h) < 9 ? 4 : 5)

static unsigned hit_class(uint32_t hits)
{
    return HIT_CLASS(hits);
}

/* The block's class: hit count x where it sat in the prompt that added it. */
static unsigned block_class(uint32_t hits, uint8_t flags)
{
    return hit_class(hits + ((flags & GHOST_FLAG) != 0)) * NPOSC +
           ((flags & POS_MASK) >> POS_SHIFT);
}

/* Tokens between a page and the end of the prompt that added it, log-bucketed: a prompt's last
 * few hundred tokens (the turn's own text) come back far less often than what precedes them. */
static unsigned pos_class(uint64_t tokens_from_end)
{
    uint64_t x = tokens_from_end / 128;
    unsigned c = 0;
    while (x) {
        c++;
        x >>= 1;
    }
    return c < NPOSC ? c : NPOSC - 1;
}

/* EXP_HD's bucket of an age in clock units (ms): 0 below 256 ms, then half octaves (256, 384,
 * 512, 768 ms, ...), the last from 2.3 hours on. */
static unsigned age_bucket(uint32_t age)
{
    uint32_t x = age >> 7;
    if (x < 2)
        return 0;
    unsigned o = 31 - (unsigned)__builtin_clz(x);
    unsigned b = 2 * o - 1 + ((x >> (o - 1)) & 1);
    return b < NAGE ? b : NAGE - 1;
}

/* The youngest age of bucket b (age_bucket's inverse). */
static double age_lo(unsigned b)
{
    if (b == 0)
        return 0;
    unsigned o = (b + 1) >> 1;
    return 128.0 * (double)(1u << o) * ((b + 1) & 1 ? 1.5 : 1.0);
}

/*
 * EXP_HD's hit densities (Beckmann et al., "LHD: maximizing cache hit rate by maximizing hit
 * density", NSDI'18), per tier and hit class: of the residencies in the tier that reached age a
 * (since the last use), the share that ended in a use, over the mean time they had left beyond
 * a: the hits a page of age a is expected to bring per ms of room it holds from now on. Unlike
 * the value's P(c) / (age + A0) it need not fall with age: an agent's page past its short tools
 * waits for a longer one and is worth more than its age says, a page past every tool's pause
 * belongs to a finished session. A weak prior (a tenth of a hit over the value's age + A0)
 * stands in where a class has no data. Per hit class only: the value's position classes split
 * the counts six ways for nothing (agent and chat, seeds 0-1: 0.008 of the gap pinned against
 * 0.019 without them); per tier, because a tier's residencies end at its own ages (pooled over
 * the tiers, ended by drops alone, with the saving and the position classes: -0.217).
 */
static void refresh_density(kvt_policy_t *p)
{
    for (int t = KVT_TIER_HBM; t < KVT_TIER_COUNT; t++) {
        if (!p->cap[t])
            continue;
        for (int c = 0; c < NHITC; c++) {
            double *h = p->hd_hits[t][c], *e = p->hd_ends[t][c];
            double hits = 0, ends = 0, end_age = 0; /* over the buckets from b up */
            for (int b = NAGE - 1; b >= 0; b--) {
                double lo = age_lo((unsigned)b);
                double mid = b == NAGE - 1 ? 1.5 * lo : 0.5 * (lo + age_lo((unsigned)b + 1));
                hits += h[b];
                ends += h[b] + e[b];
                end_age += (h[b] + e[b]) * mid;
                double left = end_age - ends * lo; /* residency left beyond lo, summed */
                p->hd[t][c][b] = (float)((hits + 0.1) / (left + lo + AGE0));
                h[b] *= HIST_DECAY;
                e[b] *= HIST_DECAY;
            }
        }
    }
}

/* Refreshes P(c) from the counts and ages the counts. */
static void refresh_model(kvt_policy_t *p)
{
    for (int c = 0; c < NCLASS; c++) {
        /* a weak prior (one hit in ten) for classes without data */
        p->class_p[c] = (p->class_hits[c] + 0.1) / (p->class_hits[c] + p->class_ends[c] + 1.0);
        p->class_hits[c] *= HIST_DECAY;
        p->class_ends[c] *= HIST_DECAY;
    }
    refresh_density(p);
}

static double recompute_page_s(const kvt_policy_t *p, uint32_t depth, uint32_t ps)
{
    return kvt_cost_recompute_s(&p->c.model, &p->c.hw, (uint64_t)depth * ps, ps);
}

static double page_load_s(const kvt_policy_t *p, kvt_tier_id_t t, uint32_t bytes)
{
    if (!tier_ok(t) || p->c.hw.bw[t] <= 0)
        return INFINITY;
    return (double)bytes / p->c.hw.bw[t];
}

/*
 * Seconds to load a page of `bytes` back from tier t under the load the engine sees now: its
 * bytes over the bandwidth, and its share of the round trips of the request that loads it (the
 * tier's latency, longer by the queue of the moves in flight on the tier, kvt_cost_load_queued_s,
 * over the pages a match loads from the tier at once, as matches lately did). A remote page is
 * not worth its bytes alone when each hit on it waits a round trip behind a busy queue.
 */
static double reload_s(const kvt_policy_t *p, kvt_tier_id_t t, uint32_t bytes)
{
    double s = page_load_s(p, t, bytes);
    if (!isfinite(s) || p->c.hw.latency_s[t] <= 0)
        return s;
    double rt = kvt_cost_load_queued_s(&p->c.hw, t, 1, p->queued[t]) - page_load_s(p, t, 1);
    return s + rt / KVT_MAX(p->run_pages[t], 1.0);
}

/* Where a block of namespace ns and size bytes goes when it leaves tier t: the next configured
 * tier down that can hold it at all (ops->holds: a page larger than an NVMe record passes NVMe by
 * for the remote tier), or KVT_TIER_NONE (dropped). */
static kvt_tier_id_t lower_for(const kvt_policy_t *p, kvt_tier_id_t t, uint32_t ns, uint32_t size)
{
    kvt_tier_id_t lo = p->lower[t];
    while (lo != KVT_TIER_NONE && p->c.ops->holds && !p->c.ops->holds(p->c.ops_arg, lo, ns, size))
        lo = p->lower[lo];
    return lo;
}

/* Seconds a hit on this block (of namespace ns) saves by its being in tier t rather than where it
 * goes next. */
static double keep_benefit(const kvt_policy_t *p, kvt_tier_id_t t, uint32_t ns, uint32_t depth,
                           uint32_t ps, uint32_t bytes)
{
    double here = reload_s(p, t, bytes);
    double redo = recompute_page_s(p, depth, ps);
    kvt_tier_id_t lo = lower_for(p, t, ns, bytes);
    double next = lo ? reload_s(p, lo, bytes) : redo;
    if (!p->c.no_cost_drop && redo < next)
        next = redo;
    double d = next - here;
    return d > 1e-12 ? d : 1e-12;
}

static uint32_t decode_pause(unsigned code)
{
    return (uint32_t)(exp2((code - 1) / 2.0) - 1.0);
}

static unsigned encode_pause(uint32_t ms)
{
    unsigned c = 1 + (unsigned)lround(2.0 * log2(1.0 + (double)ms));
    return c > 62 ? 62 : c;
}

/* ---- keys ----------------------------------------------------------------------------------- */

/*
 * The order EXP_SPLIT uses in tier t: LRU's in the lowest configured tier, whose victims are
 * dropped, and the value's in the tiers above it, whose victims move down. On agent sessions and
 * chat the value's order missed 2.5 % more tokens than LRU's (agent seed 0 at 5 %: 12.73 M
 * against 12.42 M) while serving more of its hits from HBM and DRAM; the miniature simulations,
 * judging each order as a whole, could not tell it from LRU's (issue 40). As a fourth expert
 * with a simulation of its own it is chosen where the two halves are each the better.
 */
static int split_expert(const kvt_policy_t *p, kvt_tier_id_t t)
{
    return tier_ok(t) && p->lower[t] == KVT_TIER_NONE ? EXP_RECENT : EXP_COST;
}

/*
 * The key of block i of n for expert e (COST; the other kinds have one expert, their own). The
 * cost policy's experts: its value (EXP_COST: the class's learned reuse rate over the age, times
 * the seconds a hit saves by the block's staying in its tier), LRU's order (EXP_RECENT) and
 * LFU's (EXP_FREQ), each reading the hints its own way. Recency and frequency are left without
 * the saving factor: weighting LRU by the recompute cost of a page's depth made it lose to plain
 * LRU on agent sessions (458.2 s against 452.4 on agent seed 0 at 10 %). The choice between
 * experts is what is cost-aware: their miniature hierarchies are judged in seconds.
 */
static vkey_t block_key(kvt_policy_t *p, kvt_radix_node_t *n, uint32_t i, int e)
{
    const kvt_block_t *b = &kvt_radix_node_blocks(n)[i];
    if (e == EXP_SPLIT)
        e = split_expert(p, (kvt_tier_id_t)b->tier);
    uint32_t depth = kvt_radix_node_depth(n) + i;
    vkey_t k = {0, -(double)depth};
    switch (p->c.kind) {
    case KVT_POLICY_LRU:
        k.a = b->last_access;
        break;
    case KVT_POLICY_LFU:
        k.a = b->hits;
        k.b = b->last_access - depth * 1e-6;
        break;
    case KVT_POLICY_ORACLE:
        k.a = b->policy == UINT32_MAX ? -INF_KEY : -(double)b->policy;
        break;
    case KVT_POLICY_COST:
    default: {
        uint32_t now = now_clock(p);
        uint32_t age = now - b->policy;
        kvt_tier_id_t t = (kvt_tier_id_t)b->tier;
        unsigned pause = b->prio >> PAUSE_SHIFT;
        int finished = pause == PAUSE_FINISHED, paused = 0;
        uint32_t back = 0;
        if (pause && !finished) {
            back = decode_pause(pause);
            paused = age <= 2 * back + 1000;
        }
        if (e == EXP_RECENT) {
            /* LRU, leaves first: it bets on a next use as far ahead as the last one is behind
             * (at now + age), so a key of last_access orders by that bet. A finished session's
             * pages count as used long ago; a paused one's take the key of its expected return,
             * 2 now - (last + pause), where that is sooner than LRU's bet (the key grows with
             * now, as a heap key may: a popped entry is pushed back with its live key). Taking
             * it also where it is later (Belady on the engine's word) did worse on agents:
             * 627.5 and 452.6 s against 623.5 and 438.4 (seed 0 at 5% and 10%). */
            k.a = (double)b->last_access;
            if (finished) {
                k.a -= FINISHED_AGE;
            } else if (paused) {
                double key = 2.0 * now - ((double)b->policy + back);
                if (key > k.a)
                    k.a = key;
            }
            break;
        }
        if (e == EXP_FREQ) {
            /* LFU, then LRU; a block back after a drop counts the hit its return is (the ghosts),
             * or a hot prefix that was once pushed out would never be kept again */
            k.a = b->hits + ((b->flags & GHOST_FLAG) != 0);
            k.b = b->last_access - depth * 1e-6;
            if (finished) {
                k.a *= FINISHED_FACTOR;
            } else if (paused) {
                k.a += PAUSED_HITS;
                k.b = -((double)b->policy + back); /* the one back sooner stays */
            }
            break;
        }
        unsigned c = block_class(b->hits, b->flags);
        double dens = e == EXP_HD ? p->hd[t][c / NPOSC][age_bucket(age)]
                                  : p->class_p[c] / ((double)age + AGE0);
        if (finished) {
            dens *= FINISHED_FACTOR;
        } else if (paused) {
            double left = back > age ? (double)(back - age) : 1.0;
            double hd = PAUSED_P / (left + 1.0);
            if (hd > dens)
                dens = hd;
        }
        /* EXP_HD without the saving: with it, agent and chat (seeds 0-1) lost 0.017 of the gap
         * to LRU pinned, without it they gained 0.008 */
        double v =
            e == EXP_HD
                ? dens
                : dens * keep_benefit(p, t, kvt_radix_node_ns(n), depth,
                                      kvt_radix_ns_page_size(p->t, kvt_radix_node_ns(n)), b->size);
        unsigned prio = b->prio & PRIO_MASK;
        if (prio)
            v *= exp2(prio / 100.0);
        k.a = v;
        break;
    }
    }
    return k;
}

/* Pushes n's block i, the boundary of its run in tier t, into that tier's heap with the key of
 * the expert choosing now, and into the one a sweep is filling with its expert's key (only
 * there with next_only). */
static void push_entry(kvt_policy_t *p, uint8_t t, kvt_radix_node_t *n, uint32_t i, int next_only)
{
    if (!next_only)
        heap_push(p, &p->heap[t], n, block_key(p, n, i, p->xcur));
    if (p->sweeping)
        heap_push(p, &p->next[t], n, block_key(p, n, i, p->xnext));
}

/* Pushes n into the heaps of every tier it has a run in; with next_only, only into the heaps a
 * sweep is filling. */
static void push_runs(kvt_policy_t *p, kvt_radix_node_t *n, int next_only)
{
    const kvt_block_t *bl = kvt_radix_node_blocks(n);
    uint32_t np = kvt_radix_node_pages(n);
    uint32_t i = 0;
    if (np == 0 || bl[0].tier == KVT_TIER_NONE)
        return; /* index-only: tiers run fastest first, so the first page says */
    while (i < np) {
        uint8_t t = bl[i].tier;
        uint32_t a, b;
        node_run(n, t, &a, &b);
        if (b <= i)
            break; /* out of order: verify reports it */
        if (tier_ok((kvt_tier_id_t)t) && p->cap[t])
            push_entry(p, t, n, b - 1, next_only);
        i = b;
    }
}

static void push_node(kvt_policy_t *p, kvt_radix_node_t *n)
{
    push_runs(p, n, 0);
}

/* Pushes n into the heaps of tier t when it has a run there. */
static void push_tier(kvt_policy_t *p, kvt_radix_node_t *n, uint8_t t)
{
    uint32_t a, b;
    if (!tier_ok((kvt_tier_id_t)t) || !p->cap[t] || kvt_radix_node_pages(n) == 0)
        return;
    node_run(n, t, &a, &b);
    if (a < b)
        push_entry(p, t, n, b - 1, 0);
}

/* After n lost its tail: the tail may now be droppable where it was not. */
static void push_tail(kvt_policy_t *p, kvt_radix_node_t *n)
{
    uint32_t np = kvt_radix_node_pages(n);
    if (np && kvt_radix_node_children(n) == 0 && !kvt_radix_node_leased(n))
        push_tier(p, n, kvt_radix_node_blocks(n)[np - 1].tier);
}

/* A node's run in one tier before a change: whether it had one, and its boundary's key. */
typedef struct runkey {
    int had;
    vkey_t k;
} runkey_t;

static runkey_t run_key(kvt_policy_t *p, kvt_radix_node_t *n, kvt_tier_id_t t)
{
    uint32_t a, b;
    if (!tier_ok(t) || !p->cap[t])
        return (runkey_t){0, {0, 0}};
    node_run(n, (uint8_t)t, &a, &b);
    return a < b ? (runkey_t){1, block_key(p, n, b - 1, p->xcur)} : (runkey_t){0, {0, 0}};
}

/* After pages joined or left n's run in tier t: pushes n into t's heap when its entry there no
 * longer serves, that is when the run is new, or its boundary's key fell below the one before in
 * value (not just in the depth that breaks ties). A key that grew the pop corrects itself, by
 * pushing the entry back; one that fell would leave the run a victim later than it should be. */
static void push_changed(kvt_policy_t *p, kvt_radix_node_t *n, kvt_tier_id_t t, runkey_t was)
{
    uint32_t a, b;
    if (!tier_ok(t) || !p->cap[t])
        return;
    node_run(n, (uint8_t)t, &a, &b);
    if (a < b && (!was.had || block_key(p, n, b - 1, p->xcur).a < was.k.a))
        push_entry(p, (uint8_t)t, n, b - 1, 0);
}

static void sweep_stop(kvt_policy_t *p)
{
    p->sweeping = 0;
    for (int t = 0; t < KVT_TIER_COUNT; t++)
        p->next[t].len = 0;
}

static void rebuild(kvt_policy_t *p)
{
    sweep_stop(p); /* this one is whole */
    p->st.rebuilds++;
    p->xcur = p->xwant; /* the expert the model chose takes over here */
    for (int t = 0; t < KVT_TIER_COUNT; t++)
        p->heap[t].len = 0;
    if (p->orph.cap)
        memset(p->orph.keys, 0, p->orph.cap * sizeof(*p->orph.keys));
    p->orph.len = 0;
    p->orph_lost = 0;
    size_t nn = kvt_radix_node_count(p->t);
    for (size_t i = 0; i < nn; i++) {
        kvt_radix_node_t *n = kvt_radix_node_at(p->t, i);
        if (!kvt_radix_node_leased(n))
            push_node(p, n);
        else
            orphan_add(p, n);
    }
    /* Queued promotions may name nodes that died before this rebuild: keep the record until
     * they have run. Parked ones are checked against it now. */
    if (p->dead_lost)
        p->npark = 0; /* a death went unrecorded: any of them may name a dead node */
    if (p->dead.cap && p->npromo == 0) {
        park_renew(p);
        memset(p->dead.keys, 0, p->dead.cap * sizeof(*p->dead.keys));
        p->dead.len = 0;
    }
    p->rebuild_seq = ++p->seq;
    p->releases = kvt_radix_lease_releases(p->t);
    p->foreign_seen = p->foreign;
    p->stale = p->dead_lost = 0;
    p->inserts_since_rebuild = 0;
}

/* Starts a sweep; 0, or KVT_ENOMEM for no room for the registry's copy. */
static int sweep_start(kvt_policy_t *p)
{
    size_t nn = kvt_radix_node_count(p->t);
    if (nn > p->sweep_cap) {
        size_t cap = nn + nn / 4; /* the tree grows between sweeps */
        kvt_radix_node_t **v = realloc(p->sweep_nodes, cap * sizeof(*v));
        if (!v)
            return KVT_ENOMEM;
        p->sweep_nodes = v;
        p->sweep_cap = cap;
    }
    if (nn)
        memcpy(p->sweep_nodes, kvt_radix_nodes(p->t), nn * sizeof(*p->sweep_nodes));
    sweep_stop(p);
    p->sweeping = 1;
    p->xnext = p->xwant;
    p->sweep_n = nn;
    p->sweep_at = 0;
    p->sweep_seq = ++p->seq;
    p->inserts_since_rebuild = 0;
    return 0;
}

/* Forgets the deaths recorded before seq: no heap entry is older than it any more. */
static void dead_forget_before(kvt_policy_t *p, uint64_t seq)
{
    dead_t *d = &p->dead;
    size_t live = 0;
    for (size_t i = 0; i < d->cap; i++)
        live += d->keys[i] && d->seqs[i] >= seq;
    if (live < d->len && dead_rehash(d, d->cap, seq) < 0)
        p->dead_lost = 1; /* a whole rebuild before the next victim */
}

/* One slice of the sweep: up to SWEEP_SLICE nodes into the new heaps; at the copy's end they
 * replace the old ones. */
static void sweep_some(kvt_policy_t *p)
{
    if (p->dead_lost) {
        sweep_stop(p); /* a freed node may not be known: the next victim rebuilds whole */
        return;
    }
    for (uint32_t k = 0; k < p->c.sweep_slice && p->sweep_at < p->sweep_n; k++) {
        kvt_radix_node_t *n = p->sweep_nodes[p->sweep_at++];
        if (dead_after(p, n, p->sweep_seq))
            continue;
        if (!kvt_radix_node_leased(n))
            push_runs(p, n, 1);
        else
            orphan_add(p, n);
    }
    if (p->sweep_at < p->sweep_n)
        return;
    for (int t = 0; t < KVT_TIER_COUNT; t++) {
        heap_t old = p->heap[t];
        p->heap[t] = p->next[t];
        p->next[t] = old;
        p->next[t].len = 0;
    }
    p->xcur = p->xnext;
    p->sweeping = 0;
    p->st.sweeps++;
    /* Every entry now was pushed after the sweep began: older deaths name none of them.
     * Queued promotions may still name nodes that died before: keep the record until they ran. */
    if (p->npromo == 0) {
        park_renew(p);
        dead_forget_before(p, p->sweep_seq);
    }
    /* The nodes left out of the old heaps were walked into the new ones, unless left out of
     * those too (recorded again since). */
    if (p->orph.len && dead_rehash(&p->orph, p->orph.cap, p->sweep_seq) < 0)
        p->orph_lost = 1;
}

/* ---- acting --------------------------------------------------------------------------------- */

/* The tier of blocks [depth, depth + cnt) of the path ending at n, through the executor when it
 * owns the block record (kvt_policy_ops_t.set_tier). */
static void tier_run(kvt_policy_t *p, kvt_radix_node_t *n, uint32_t depth, uint32_t cnt,
                     kvt_tier_id_t to)
{
    if (p->c.ops->set_tier) {
        p->c.ops->set_tier(p->c.ops_arg, n, depth, cnt, to);
        return;
    }
    for (uint32_t i = 0; i < cnt; i++)
        kvt_radix_block_at(n, depth + i)->tier = (uint8_t)to;
}

/* The same for blocks [i0, i0 + cnt) of node n itself. */
static void set_tier(kvt_policy_t *p, kvt_radix_node_t *n, uint32_t i0, uint32_t cnt,
                     kvt_tier_id_t to)
{
    tier_run(p, n, kvt_radix_node_depth(n) + i0, cnt, to);
}

static uint64_t run_bytes(kvt_radix_node_t *n, uint32_t i0, uint32_t cnt)
{
    const kvt_block_t *bl = kvt_radix_node_blocks(n);
    uint64_t s = 0;
    for (uint32_t i = i0; i < i0 + cnt; i++)
        s += bl[i].size;
    return s;
}

/* What a block of size bytes costs against tier t's capacity. */
static uint64_t charge(const kvt_policy_t *p, kvt_tier_id_t t, uint32_t size)
{
    if (!size)
        return 0;
    return p->c.ops->footprint ? p->c.ops->footprint(p->c.ops_arg, t, size) : size;
}

/* The bytes tier t can still take under its capacity. */
static uint64_t room_left(const kvt_policy_t *p, kvt_tier_id_t t)
{
    return p->cap[t] > p->used[t] ? p->cap[t] - p->used[t] : 0;
}

static uint64_t run_charge(const kvt_policy_t *p, kvt_radix_node_t *n, uint32_t i0, uint32_t cnt,
                           kvt_tier_id_t t)
{
    const kvt_block_t *bl = kvt_radix_node_blocks(n);
    uint64_t s = 0;
    for (uint32_t i = i0; i < i0 + cnt; i++)
        s += charge(p, t, bl[i].size);
    return s;
}

static int run_busy(kvt_radix_node_t *n, uint32_t i0, uint32_t cnt)
{
    const kvt_block_t *bl = kvt_radix_node_blocks(n);
    for (uint32_t i = i0; i < i0 + cnt; i++)
        if (bl[i].flags & KVT_BLOCK_BUSY)
            return 1;
    return 0;
}

/* Blocks leaving a tier (demoted or dropped) end a residency without a hit. */
static void record_end(kvt_policy_t *p, kvt_radix_node_t *n, uint32_t i0, uint32_t cnt)
{
    if (p->c.kind != KVT_POLICY_COST)
        return;
    const kvt_block_t *bl = kvt_radix_node_blocks(n);
    uint32_t now = now_clock(p);
    for (uint32_t i = i0; i < i0 + cnt; i++) {
        unsigned c = block_class(bl[i].hits, bl[i].flags);
        p->class_ends[c] += 1;
        if (bl[i].tier < KVT_TIER_COUNT)
            p->hd_ends[bl[i].tier][c / NPOSC][age_bucket(now - bl[i].policy)] += 1;
    }
}

/* The cause of the moves no caller asked for (the step's demotions, admissions making room). */
static const kvt_policy_cause_t no_cause = {.req = NULL, .tag = -1};

static int make_room(kvt_policy_t *p, kvt_tier_id_t t, uint64_t need, int depth,
                     const kvt_policy_cause_t *why);

/* The oracle's schedule with bypass (kvt_policy_conf_t.oracle_demand off). */
static int bypass(const kvt_policy_t *p)
{
    return p->c.kind == KVT_POLICY_ORACLE && !p->c.oracle_demand;
}

static int protected(const kvt_policy_t *p, const kvt_radix_node_t *n)
{
    for (size_t i = 0; i < p->protect; i++)
        if (p->path[i] == n)
            return 1;
    return 0;
}

/* Room for one more move in flight. */
static int pend_reserve(kvt_policy_t *p)
{
    if (p->npend < p->pend_cap)
        return 0;
    size_t nc = p->pend_cap ? 2 * p->pend_cap : 16;
    pmove_t *v = realloc(p->pend, nc * sizeof(*v));
    if (!v)
        return KVT_ENOMEM;
    p->pend = v;
    p->pend_cap = nc;
    return 0;
}

/* Moves node-local [i0, i0 + cnt) of n from `from` to `to`, for why (handed to ops->move).
 * Returns cnt, or a negative error (nothing changed). */
static int do_move(kvt_policy_t *p, kvt_radix_node_t *n, uint32_t i0, uint32_t cnt,
                   kvt_tier_id_t from, kvt_tier_id_t to, int depth, const kvt_policy_cause_t *why)
{
    if (p->c.ops->fits && !p->c.ops->fits(p->c.ops_arg, n, kvt_radix_node_depth(n) + i0, cnt, to))
        return KVT_ENOSPC;
    uint64_t bytes = run_bytes(n, i0, cnt);
    uint64_t cto = run_charge(p, n, i0, cnt, to), cfrom = run_charge(p, n, i0, cnt, from);
    int rc = make_room(p, to, cto, depth + 1, why);
    if (rc < 0)
        return rc;
    /* make_room may have dropped blocks after the run in this very node: indices before them
     * are unchanged, but the run must still be there. */
    const kvt_block_t *bl = kvt_radix_node_blocks(n);
    uint32_t np = kvt_radix_node_pages(n);
    if (i0 + cnt > np || bl[i0].tier != from || bl[i0 + cnt - 1].tier != from)
        return KVT_EAGAIN;
    /* making room may have started copies that lease this node (an ancestor of theirs) */
    if (to > from && kvt_radix_node_leased(n))
        return KVT_EAGAIN;
    /* the node's order must survive the move (make_room may have moved its neighbours) */
    if ((i0 > 0 && tier_rank(bl[i0 - 1].tier) > tier_rank((uint8_t)to)) ||
        (i0 + cnt < np && tier_rank(bl[i0 + cnt].tier) < tier_rank((uint8_t)to)))
        return KVT_EAGAIN;
    /* What a pending move needs, before it starts: its pin's lease slot (the index's memory,
     * within what the executor allows) and its entry. */
    uint64_t grow = kvt_radix_lease_need(p->t);
    if (grow && p->c.ops->index_room && !p->c.ops->index_room(p->c.ops_arg, grow)) {
        p->st.pin_refusals++;
        return KVT_ENOSPC;
    }
    if (kvt_radix_lease_reserve(p->t) < 0 || pend_reserve(p) < 0)
        return KVT_ENOMEM;
    uint32_t ta, tb;
    node_run(n, (uint8_t)to, &ta, &tb);
    rc = p->c.ops->move(p->c.ops_arg, why, n, kvt_radix_node_depth(n) + i0, cnt, from, to);
    if (rc < 0)
        return rc;
    if (to > from)
        record_end(p, n, i0, cnt);
    p->used[to] += cto;
    if (rc == KVT_POLICY_PENDING) {
        /* The lease keeps (n, depth) valid until kvt_policy_move_done, whatever inserts split
         * or evictions happen meanwhile. */
        kvt_match_t m = {n, i0 + cnt, kvt_radix_node_depth(n) + i0 + cnt, kvt_radix_node_ns(n), 0};
        uint64_t lease = 0;
        /* cannot fail: the slot and the entry were reserved before the move started */
        kvt_assert(kvt_radix_lease(p->t, &m, KVT_POLICY_LEASE_OWNER, &lease) == 0);
        kvt_assert(p->npend < p->pend_cap);
        p->pend[p->npend++] = (pmove_t){
            n, kvt_radix_node_depth(n) + i0, cnt, from, to, lease, bytes, cto, cfrom, why->tag};
        p->pending_out[from] += cfrom;
        p->queued[from]++;
        p->queued[to]++;
        p->st.pending_moves++;
    } else {
        set_tier(p, n, i0, cnt, to);
        p->used[from] -= cfrom;
        p->st.blocks[from] -= cnt;
        p->st.blocks[to] += cnt;
        p->st.moved_bytes[from][to] += bytes;
        if (ta == tb) /* a new run in `to`: a run that grew keeps its boundary or goes stale */
            push_tier(p, n, (uint8_t)to);
    }
    if (to > from)
        p->st.demotions++;
    else
        p->st.promotions++;
    return (int)cnt;
}

/*
 * Hashes blocks [i0, i0 + cnt) of n in one walk and asks for their ghost slots without waiting:
 * each is a miss into a 32 MiB table, which the page loop that follows (admitting the pages and
 * flagging the ones seen dropped before) would otherwise wait for one after the other. A replay
 * of the conversation trace spent most of its time there.
 */
static void ghost_warm(kvt_policy_t *p, kvt_radix_node_t *n, uint32_t i0, uint32_t cnt)
{
    if (!p->ghost || cnt == 0)
        return;
    (void)kvt_radix_block_hash(p->t, n, kvt_radix_node_depth(n) + i0 + cnt - 1);
    const kvt_block_t *bl = kvt_radix_node_blocks(n);
    for (uint32_t i = i0; i < i0 + cnt; i++)
        kvt_ghosts_prefetch(p->ghost, bl[i].hash);
}

/* Drops the last cnt blocks of leaf n. Returns cnt or a negative error. */
static int do_drop(kvt_policy_t *p, kvt_radix_node_t *n, uint32_t cnt, kvt_tier_id_t from)
{
    uint32_t np = kvt_radix_node_pages(n);
    uint64_t bytes = run_bytes(n, np - cnt, cnt);
    kvt_radix_node_t *parent = kvt_radix_node_parent(n);
    if (from != KVT_TIER_NONE) /* index-only pages never counted hits for the model */
        record_end(p, n, np - cnt, cnt);
    if (p->ghost) {
        for (uint32_t i = np - cnt; i < np; i++) {
            uint64_t h = kvt_radix_block_hash(p->t, n, kvt_radix_node_depth(n) + i);
            kvt_ghosts_add(p->ghost, h);
        }
    }
    p->in_drop = 1;
    int rc = kvt_radix_evict(p->t, n, cnt);
    p->in_drop = 0;
    if (rc < 0)
        return rc;
    p->st.dropped_bytes[from] += bytes;
    p->st.dropped_blocks += cnt;
    if (cnt == np) {
        dead_add(p, n);
        if (parent)
            push_tail(p, parent);
    } else {
        push_tail(p, n);
    }
    return (int)cnt;
}

/* ---- the experts' miniature simulations (COST) ---------------------------------------------- */

static int ms_sampled(uint64_t h)
{
    return h && ((h * 0x9E3779B97F4A7C15ull) >> (64 - MS_SHIFT)) == 0;
}

static uint32_t ms_home(const msim_t *m, uint64_t h)
{
    return (uint32_t)(h ^ (h >> 32)) & m->mask;
}

static uint32_t ms_find(const msim_t *m, uint64_t h)
{
    uint32_t i = ms_home(m, h);
    while (m->v[i].hash && m->v[i].hash != h)
        i = (i + 1) & m->mask;
    return i;
}

/* Removes slot i, shifting back the entries of its probe run (no tombstones). */
static void ms_remove(msim_t *m, uint32_t i)
{
    uint32_t j = i;
    m->v[i].hash = 0;
    for (;;) {
        j = (j + 1) & m->mask;
        if (!m->v[j].hash)
            break;
        uint32_t home = ms_home(m, m->v[j].hash);
        /* j may move to i unless its home lies cyclically in (i, j] */
        if (i <= j ? (home > i && home <= j) : (home > i || home <= j))
            continue;
        m->v[i] = m->v[j];
        m->v[j].hash = 0;
        i = j;
    }
    /* the entries shifted back each filled the hole the previous one left: the last is empty */
    m->occ[i >> 6] &= ~(1ull << (i & 63));
    m->len--;
}

/* Lower = a better victim for expert e in tier t: the orders of the experts' heaps, on the
 * sampled page alone (hints aside). */
static double ms_key(const kvt_policy_t *p, int e, kvt_tier_id_t t, const msent_t *x, uint32_t now)
{
    if (e == EXP_SPLIT)
        e = split_expert(p, t);
    if (e == EXP_RECENT)
        return (double)x->last - x->depth * 1e-6;
    if (e == EXP_FREQ)
        return (double)x->hits * 4294967296.0 + x->last;
    uint32_t age = now - x->last;
    if (e == EXP_HD)
        return p->hd[t][hit_class(x->hits)][age_bucket(age)];
    double rate = p->class_p[hit_class(x->hits) * NPOSC + x->pos] / ((double)age + AGE0);
    /* keep_benefit's sum, from the load times of the sampled page size ms_init kept */
    double redo = x->redo, next = p->lower[t] ? p->ms_load[p->lower[t]] : redo;
    if (!p->c.no_cost_drop && redo < next)
        next = redo;
    return rate * KVT_MAX(next - p->ms_load[t], 1e-12);
}

static double ms_lru_key(const msrec_t *r)
{
    return (double)r->last - r->depth * 1e-6;
}

static msrec_t ms_rec(const msent_t *x)
{
    return (msrec_t){x->hash, x->last, x->depth};
}

static void ms_lru_sift(msrec_t *h, uint32_t n, uint32_t i)
{
    double ki = ms_lru_key(&h[i]); /* the entry sifted down keeps its key */
    for (;;) {
        uint32_t l = 2 * i + 1, b = i;
        double kb = ki;
        if (l < n) {
            double k = ms_lru_key(&h[l]);
            if (k < kb) {
                b = l;
                kb = k;
            }
        }
        if (l + 1 < n && ms_lru_key(&h[l + 1]) < kb)
            b = l + 1;
        if (b == i)
            return;
        msrec_t tmp = h[i];
        h[i] = h[b];
        h[b] = tmp;
        i = b;
    }
}

/* Pushes page x, just put into tier m, on m's recency heap. A full heap (mostly stale entries:
 * at most m->max are live) is built again from the pages the tier holds instead, x among them. */
static void ms_lru_push(msim_t *m, const msent_t *x)
{
    msrec_t *h = m->lru;
    if (m->nlru == m->clru) {
        m->nlru = 0;
        for (uint32_t i = 0; i <= m->mask; i++)
            if (m->v[i].hash)
                h[m->nlru++] = ms_rec(&m->v[i]);
        for (uint32_t i = m->nlru / 2; i-- > 0;)
            ms_lru_sift(h, m->nlru, i);
        return;
    }
    uint32_t i = m->nlru++;
    h[i] = ms_rec(x);
    double k = ms_lru_key(&h[i]);
    while (i && ms_lru_key(&h[(i - 1) / 2]) > k) {
        msrec_t tmp = h[i];
        h[i] = h[(i - 1) / 2];
        h[(i - 1) / 2] = tmp;
        i = (i - 1) / 2;
    }
}

/* The slot of the least recent page of tier m (which holds at least one), its stale entries
 * popped on the way. */
static uint32_t ms_lru_victim(msim_t *m)
{
    for (;;) {
        msrec_t top = m->lru[0];
        m->lru[0] = m->lru[--m->nlru];
        ms_lru_sift(m->lru, m->nlru, 0);
        uint32_t i = ms_find(m, top.hash);
        if (m->v[i].hash && m->v[i].last == top.last)
            return i;
    }
}

static int ms_occupied(const msim_t *m, uint32_t i)
{
    return (m->occ[i >> 6] >> (i & 63)) & 1;
}

/* The first slot at or after i holding a page (in m, which holds one), as a scan finds it. */
static uint32_t ms_next(const msim_t *m, uint32_t i)
{
    for (;;) {
        uint64_t w = m->occ[i >> 6] >> (i & 63);
        if (w) /* no bit above mask is set: a table under 64 slots has one word */
            return i + (uint32_t)__builtin_ctzll(w);
        i = ((i | 63) + 1) & m->mask;
    }
}

/* The first empty slot at or after i in m (at most half full), where ms_find ends for a page m
 * lacks: the slot a page put into m takes, without the scan's mispredicted end. */
static uint32_t ms_hole(const msim_t *m, uint32_t i)
{
    for (;;) {
        uint64_t w = ~m->occ[i >> 6] >> (i & 63);
        if (w) {
            uint32_t r = i + (uint32_t)__builtin_ctzll(w);
            if (r <= m->mask)
                return r;
            i = 0; /* past the end of a table under 64 slots */
            continue;
        }
        i = ((i | 63) + 1) & m->mask;
    }
}

/* Entries expert e draws per eviction in its miniature tier m (see ms_victim). */
static int ms_ndraws(const msim_t *m, int e)
{
    return m->lru ? 0 : e == EXP_HD ? HD_SAMPLE : MS_SAMPLE;
}

/*
 * Expert e's victim in its miniature tier t. In LRU's order, exactly the least recent page (the
 * recency heap), as the engine's heaps take it; in the others, the best of the ms_ndraws entries
 * drawn at random (slot: the slots drawn, by ms_plan), as Redis approximates LRU, so that no key
 * is kept up per use (the value's keys change with age). The best of 8 drawn for LRU's order
 * too made its copy miss pages LRU keeps, so the simulations preferred the value's order on
 * agents and chat where LRU's is really the better (issue 40, session 23: 102 of the 120 runs of
 * docs/policy.md section 5 never worse than min(LRU, LFU); 108 with the exact victim and a
 * margin of 1 %). EXP_HD draws 16: its keys rise and fall with age, and 8 drawn made its copy
 * cost 1.8 % more than LRU's on agent seed 0 at 10 % where it is really 0.13 % cheaper (pinned).
 */
static uint32_t ms_victim(kvt_policy_t *p, int e, kvt_tier_id_t t, uint32_t now,
                          const uint32_t *slot)
{
    msim_t *m = &p->ms[e][t];
    if (m->lru)
        return ms_lru_victim(m);
    uint32_t best = 0;
    double bk = 0;
    /* one call of ms_key: inlined, its tests of the expert and tier hoisted out of the loop */
    for (int k = 0, draws = ms_ndraws(m, e); k < draws; k++) {
        uint32_t i = ms_next(m, slot[k]);
        double key = ms_key(p, e, t, &m->v[i], now);
        /* the first of the lowest, as before, without a branch the keys would mispredict */
        int lt = k == 0 || key < bk;
        best = lt ? i : best;
        bk = lt ? key : bk;
    }
    return best;
}

/*
 * Before any copy admits the used page: the evictions each expert's admission will make (every
 * full tier from the admission tier down to the first with room, as ms_admit goes), their
 * entries drawn now, in the order ms_admit used to draw them (expert by expert, tier by tier:
 * the same draws, the same victims), and every slot they name asked for at once, the recency
 * heaps' least recent pages' homes too. Drawn eviction by eviction, one copy after the other,
 * each eviction waited for its own misses into the tables, 10-20 times per sampled use, most of
 * the simulations' time (session 24, issue 40: perf on agent seed 0).
 */
static void ms_plan(kvt_policy_t *p, uint32_t slot[][KVT_TIER_COUNT][MS_DRAWS_MAX])
{
    for (int e = 0; e < p->nexp; e++) {
        for (kvt_tier_id_t t = p->top; t != KVT_TIER_NONE; t = p->lower[t]) {
            msim_t *m = &p->ms[e][t];
            if (!m->v)
                continue;
            if (m->len < m->max)
                break;
            if (m->lru) {
                if (m->nlru)
                    __builtin_prefetch(&m->v[ms_home(m, m->lru[0].hash)], 0, 3);
                continue;
            }
            for (int k = 0, draws = ms_ndraws(m, e); k < draws; k++) {
                uint64_t z = (p->ms_rng += 0x9E3779B97F4A7C15ull);
                z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
                z ^= z >> 27;
                slot[e][t][k] = (uint32_t)z & m->mask;
                __builtin_prefetch(&m->v[slot[e][t][k]], 0, 3);
            }
        }
    }
}

/* Puts x into expert e's miniature admission tier, each full tier on the way passing its victim
 * (among the entries ms_plan drew for it, slot) to the next one down and the lowest dropping it,
 * as the engine moves blocks. */
static void ms_admit(kvt_policy_t *p, int e, msent_t x, uint32_t now,
                     const uint32_t slot[][MS_DRAWS_MAX])
{
    for (kvt_tier_id_t t = p->top; t != KVT_TIER_NONE; t = p->lower[t]) {
        msim_t *m = &p->ms[e][t];
        if (!m->v)
            continue;
        msent_t out = {0};
        if (m->len >= m->max) {
            uint32_t v = ms_victim(p, e, t, now, slot[t]);
            out = m->v[v];
            ms_remove(m, v);
        }
        /* x is in none of e's tiers: the lookup in ms_use took it out of the one that held it */
        uint32_t i = ms_hole(m, ms_home(m, x.hash));
        m->v[i] = x;
        m->occ[i >> 6] |= 1ull << (i & 63);
        m->len++;
        if (m->lru)
            ms_lru_push(m, &x);
        if (!out.hash)
            return;
        x = out;
    }
}

/* Sizes the miniature tiers by the first sampled page: 1/2^MS_SHIFT of each tier's pages. 0, or
 * KVT_ENOMEM (the simulations are off and the cost expert chooses). */
static int ms_init(kvt_policy_t *p, uint32_t bytes)
{
    for (int t = KVT_TIER_HBM; t < KVT_TIER_COUNT; t++)
        p->ms_load[t] = page_load_s(p, (kvt_tier_id_t)t, bytes);
    for (int e = 0; e < p->nexp; e++) {
        for (int t = KVT_TIER_HBM; t < KVT_TIER_COUNT; t++) {
            if (!p->cap[t])
                continue;
            uint64_t pages = p->cap[t] / (bytes ? bytes : 1) >> MS_SHIFT;
            uint32_t max = (uint32_t)KVT_MAX(2, KVT_MIN(pages, (uint64_t)MS_MAX));
            uint32_t slots = 4;
            while (slots < 2 * max)
                slots *= 2;
            msim_t *m = &p->ms[e][t];
            m->v = calloc(slots, sizeof(*m->v));
            m->occ = calloc((slots + 63) / 64, sizeof(*m->occ));
            if (!m->v || !m->occ)
                return KVT_ENOMEM;
            m->mask = slots - 1;
            m->max = max;
            int order = e == EXP_SPLIT ? split_expert(p, (kvt_tier_id_t)t) : e;
            if (order == EXP_RECENT) {
                /* room for 3 stale entries per live one between rebuilds */
                m->clru = 4 * max;
                m->lru = malloc(m->clru * sizeof(*m->lru));
                if (!m->lru)
                    return KVT_ENOMEM;
            }
        }
    }
    return 0;
}

/* A page (prefix hash h, at depth, with the flags of its block; in the real hierarchy found in
 * tier `real`, KVT_TIER_NONE when it was not) is used: every expert's miniature hierarchy
 * serves it (from a tier: its load time; missed: its recompute time), then holds it in its
 * admission tier as the engine promotes hits, and the real hierarchy's figure is charged alike
 * (expert_real_s); the expert of the lowest decayed cost (by a margin over the one choosing
 * now: switching back and forth costs more than either) chooses the victims from now on. Only
 * pages whose hash falls in 1/2^MS_SHIFT of the space are simulated, in tiers of that share of
 * the real ones (SHARDS' spatial sampling), so the cost is a few table probes per 2^MS_SHIFT
 * pages used. */
static void ms_use(kvt_policy_t *p, uint64_t h, uint32_t depth, uint8_t flags, uint32_t ps,
                   uint32_t bytes, uint8_t real)
{
    if (p->ms_state == 0)
        p->ms_state = !p->c.expert && ms_init(p, bytes) == 0 ? 1 : -1;
    if (p->ms_state < 0)
        return;
    uint32_t now = now_clock(p);
    /* every copy's tiers are probed for the page, their slots asked for at once; a tier whose
     * home slot for it is empty lacks it, known from the occupancy bits without the slot */
    uint32_t home[NEXP][KVT_TIER_COUNT];
    for (int e = 0; e < p->nexp; e++)
        for (int t = KVT_TIER_HBM; t < KVT_TIER_COUNT; t++) {
            msim_t *m = &p->ms[e][t];
            home[e][t] = m->v && ms_occupied(m, ms_home(m, h)) ? ms_home(m, h) : UINT32_MAX;
            if (home[e][t] != UINT32_MAX)
                __builtin_prefetch(&m->v[home[e][t]], 0, 3);
            else if (m->v && t == (int)p->top) /* where the page is put (ms_admit) */
                __builtin_prefetch(&m->v[ms_home(m, h)], 1, 3);
        }
    double redo = recompute_page_s(p, depth, ps);
    /* charged as the copies charge: the page's load from its tier, or its recompute */
    int found = real != KVT_TIER_NONE && real < KVT_TIER_COUNT;
    double real_s = found ? KVT_MIN(redo, p->ms_load[real]) : redo;
    p->ms_real = p->ms_real * MS_DECAY + real_s;
    p->st.expert_uses[p->xcur]++;
    msent_t xs[NEXP];
    for (int e = 0; e < p->nexp; e++) {
        double s = redo;
        /* a page back after the engine dropped it starts with the hit its return is, as in
         * block_class and the LFU expert's key */
        msent_t x = {h,
                     now,
                     (flags & GHOST_FLAG) != 0,
                     depth < MS_DEPTH_MAX ? depth : MS_DEPTH_MAX,
                     (flags & POS_MASK) >> POS_SHIFT,
                     (float)redo};
        for (int t = KVT_TIER_HBM; t < KVT_TIER_COUNT; t++) {
            msim_t *m = &p->ms[e][t];
            if (home[e][t] == UINT32_MAX)
                continue;
            uint32_t i = ms_find(m, h);
            if (!m->v[i].hash)
                continue;
            s = KVT_MIN(redo, p->ms_load[t]);
            x = m->v[i];
            x.hits++;
            x.last = now;
            ms_remove(m, i);
            break;
        }
        p->ms_cost[e] = p->ms_cost[e] * MS_DECAY + s;
        if (e == p->xcur) { /* a use its order really served: its copy's error on it */
            p->held_real[e] = p->held_real[e] * MS_DECAY + real_s;
            p->held_copy[e] = p->held_copy[e] * MS_DECAY + s;
            p->held_n[e] = p->held_n[e] * MS_DECAY + 1;
        }
        xs[e] = x;
    }
    /* each copy's admission only after every copy's lookup: ms_plan needs their tiers' fill */
    uint32_t slot[NEXP][KVT_TIER_COUNT][MS_DRAWS_MAX];
    ms_plan(p, slot);
    for (int e = 0; e < p->nexp; e++)
        ms_admit(p, e, xs[e], now, slot[e]);
}

/* Expert e's copy's seconds corrected by what its order really cost over what its copy said
 * while it was in charge; one in charge for fewer than HELD_USES sampled uses takes the mean
 * correction of those that were (the copies all err one way: taken as exact, an expert never in
 * charge looked cheaper than the ones measured). */
static double held_cost(const kvt__policy_experts_t *x, int e)
{
    double sum = 0;
    int k = 0;
    for (int i = 0; i < x->nexp; i++)
        if (x->held_n[i] >= HELD_USES && x->held_copy[i] > 0) {
            if (i == e)
                return x->copy_s[e] * x->held_real[e] / x->held_copy[e];
            sum += x->held_real[i] / x->held_copy[i];
            k++;
        }
    return k ? x->copy_s[e] * sum / k : x->copy_s[e];
}

int kvt__policy_pick_expert(const kvt__policy_experts_t *x, int cur)
{
    for (int e = 0; e < x->nexp; e++)
        if (x->copy_s[e] < x->copy_s[cur] * (1 - EXP_MARGIN) &&
            held_cost(x, e) < held_cost(x, cur) * (1 - EXP_MARGIN))
            cur = e;
    return cur;
}

/* Every REFRESH_EVERY inserts: the expert whose miniature hierarchy cost least lately is to
 * order the victims (by a margin over the one ordering them now or about to: switching costs a
 * rebuild of the heaps, and back and forth costs more than either expert), unless the real costs
 * of the sampled uses say the copies misjudge the two (kvt__policy_pick_expert). Returns whether
 * the choice changed. */
static int choose_expert(kvt_policy_t *p)
{
    if (p->nexp == 1 || p->ms_state <= 0)
        return 0;
    kvt__policy_experts_t x = {p->nexp, p->ms_cost, p->held_real, p->held_copy, p->held_n};
    int cur = kvt__policy_pick_expert(&x, p->xwant);
    if (cur == p->xwant)
        return 0;
    p->xwant = cur;
    p->st.expert_switches++;
    return 1;
}

/*
 * Takes the best victim of tier t and demotes or drops up to CHUNK_PAGES of it, no more than
 * the pages that free `want` bytes. Returns the pages acted on, 0 when tier t has no victim
 * left, or a negative error.
 */
static int evict_one(kvt_policy_t *p, kvt_tier_id_t t, int depth, uint64_t want,
                     const kvt_policy_cause_t *why)
{
    heap_t *h = &p->heap[t];
    int rebuilt = 0, fails = 0;
    for (size_t guard = 0; guard < 1000000; guard++) {
        /* Entries may name freed nodes after others' frees, unless their deaths are reported;
         * the dead set and stale entries are bounded by the tree's size. */
        size_t nodes = kvt_radix_node_count(p->t);
        if ((p->foreign != p->foreign_seen && !p->c.reports_node_frees) || p->stale ||
            p->dead_lost || h->len > 4 * nodes + 4096 || p->dead.len > nodes + 4096 ||
            p->orph.len > nodes + 4096) {
            rebuild(p);
            rebuilt = 1;
        }
        if (h->len == 0) {
            /* Empty: walk the tree again when it may hold victims the heap lacks, once enough
             * has happened since the last walk (pushes, deaths, ended leases: leased nodes are
             * left out of the heap) to be worth a walk, a 1/64 of the nodes' count of events. A
             * tier whose every victim is leased runs its heap dry at every search for room, and
             * an engine ends leases and adds pages all the time: a walk at each would cost
             * O(tree) per step; this costs 64 node visits an event at most. */
            uint64_t events =
                p->seq - p->rebuild_seq + kvt_radix_lease_releases(p->t) - p->releases;
            if (rebuilt || events == 0 || events < nodes / 64)
                return 0;
            rebuild(p);
            rebuilt = 1;
            continue;
        }
        hent_t e = heap_pop(h);
        kvt_radix_node_t *n = e.n;
        if (dead_after(p, n, e.seq))
            continue;
        if (kvt_radix_node_leased(n) || protected(p, n)) {
            orphan_add(p, n); /* the end of its move's lease or of promote_path pushes it */
            continue;
        }
        uint32_t a, b;
        node_run(n, (uint8_t)t, &a, &b);
        if (a == b)
            continue;
        vkey_t live = block_key(p, n, b - 1, p->xcur);
        if (key_lt(e.k, live) && h->len > 0 && key_lt(h->v[0].k, live)) {
            heap_push(p, h, n, live);
            if (p->sweeping)
                heap_push(p, &p->next[t], n, block_key(p, n, b - 1, p->xnext));
            continue;
        }
        if (p->bar_on && !key_lt(live, p->bar)) {
            /* ORACLE: every victim left is used sooner than the page to be placed: it does not
             * come in (Belady with bypass; see "The oracle" in docs/policy.md) */
            heap_push(p, h, n, live);
            return 0;
        }
        uint32_t cnt = KVT_MIN(b - a, (uint32_t)CHUNK_PAGES);
        uint64_t sz = charge(p, t, kvt_radix_node_blocks(n)[b - 1].size);
        if (sz && want / sz + (want % sz != 0) < cnt)
            cnt = (uint32_t)KVT_MAX(1, want / sz + (want % sz != 0));
        uint32_t i0 = b - cnt;
        if (run_busy(n, i0, cnt)) {
            orphan_add(p, n);
            continue;
        }
        const kvt_block_t *last = &kvt_radix_node_blocks(n)[b - 1];
        uint32_t np = kvt_radix_node_pages(n);
        /* The run ends the leaf, or only index-only pages follow it (they go with it). */
        int droppable = kvt_radix_node_children(n) == 0 &&
                        (b == np || kvt_radix_node_blocks(n)[b].tier == KVT_TIER_NONE);
        uint32_t tail = np - b;
        kvt_tier_id_t lo = lower_for(p, t, kvt_radix_node_ns(n), last->size);
        int drop = !lo, cost_drop = 0;
        if (lo && droppable) {
            if (lo == KVT_TIER_NVME && p->c.nvme_min_hits && last->hits < p->c.nvme_min_hits)
                drop = 1;
            if (p->c.kind == KVT_POLICY_COST && !p->c.no_cost_drop) {
                uint32_t ps = kvt_radix_ns_page_size(p->t, kvt_radix_node_ns(n));
                uint32_t dep = kvt_radix_node_depth(n) + b - 1;
                if (recompute_page_s(p, dep, ps) < reload_s(p, lo, last->size))
                    drop = cost_drop = 1;
            }
        }
        if (drop && !droppable)
            continue; /* a cached child depends on it: it stays until the child goes */
        int rc;
        if (drop) {
            rc = do_drop(p, n, cnt + tail, t);
        } else if (bypass(p)) {
            /* The victim goes to the fastest tier below with a page used later than it (or
             * free room); below all of them, it is dropped where it can be. */
            vkey_t bar = p->bar;
            int bar_on = p->bar_on;
            p->bar = live;
            p->bar_on = 1;
            rc = KVT_ENOSPC;
            for (kvt_tier_id_t to = lo; to != KVT_TIER_NONE && rc == KVT_ENOSPC; to = p->lower[to])
                rc = do_move(p, n, i0, cnt, t, to, depth, why);
            p->bar = bar;
            p->bar_on = bar_on;
            if (rc > 0) {
                push_tier(p, n, (uint8_t)t);
            } else if (droppable && rc == KVT_ENOSPC) {
                node_run(n, (uint8_t)t, &a, &b);
                np = kvt_radix_node_pages(n);
                if (b > a && kvt_radix_node_children(n) == 0 &&
                    (b == np || kvt_radix_node_blocks(n)[b].tier == KVT_TIER_NONE))
                    rc = do_drop(p, n, KVT_MIN(b - a, cnt) + (np - b), t);
            }
            if (rc <= 0 && rc != KVT_ENOMEM && ++fails >= BYPASS_TRIES)
                return 0; /* a bounded search: they nest per tier, and each may walk the tree */
        } else {
            rc = do_move(p, n, i0, cnt, t, lo, depth, why);
            if (rc > 0) {
                push_tier(p, n, (uint8_t)t); /* what is left of its run */
            } else if (droppable) {
                /* no room below: dropping is the only way to free this tier (do_drop pushes
                 * what is left of the node; n may be gone after it) */
                node_run(n, (uint8_t)t, &a, &b);
                np = kvt_radix_node_pages(n);
                if (b > a && kvt_radix_node_children(n) == 0 &&
                    (b == np || kvt_radix_node_blocks(n)[b].tier == KVT_TIER_NONE))
                    rc = do_drop(p, n, KVT_MIN(b - a, cnt) + (np - b), t);
            }
        }
        if (rc > 0) {
            if (drop && cost_drop)
                p->st.cost_drops += (uint64_t)rc;
            p->st.expert_choices[p->xcur] += (uint64_t)rc;
            return rc;
        }
        if (rc == KVT_ENOMEM)
            return rc;
    }
    return 0;
}

/* Whether t lacks room for need more bytes now, but has it once its moves out in flight land. */
static int room_coming(const kvt_policy_t *p, kvt_tier_id_t t, uint64_t need)
{
    uint64_t room = p->cap[t] - p->used[t];
    return room < need && room + p->pending_out[t] >= need;
}

/* Frees room in t until need more bytes fit under its capacity. 0, KVT_ENOSPC (no victim
 * left), or KVT_EAGAIN (pending moves will free it later). Bytes already on their way out count
 * as room to come: a tier whose moves are all asynchronous (kvtierd's) would otherwise have
 * every victim it has moved out for one PUT, since no move lowers its count before it lands.
 * why: the cause of the moves it starts (the promotion it makes room for, or none). */
static int make_room(kvt_policy_t *p, kvt_tier_id_t t, uint64_t need, int depth,
                     const kvt_policy_cause_t *why)
{
    if (!tier_ok(t) || !p->cap[t] || need > p->cap[t])
        return KVT_ENOSPC;
    if (depth > KVT_TIER_COUNT)
        return KVT_ENOSPC;
    while (p->cap[t] - p->used[t] < need) {
        if (room_coming(p, t, need))
            return KVT_EAGAIN;
        uint64_t coming = p->cap[t] - p->used[t] + p->pending_out[t];
        int rc = evict_one(p, t, depth, need - coming, why);
        if (rc < 0)
            return rc;
        if (rc == 0)
            return KVT_ENOSPC;
    }
    return 0;
}

/* ---- create / destroy ----------------------------------------------------------------------- */

int kvt_policy_tune(kvt_policy_t *p, float high, float low, uint32_t nvme_min_hits)
{
    if (!p || !(high > 0 && high <= 1 && low > 0 && low <= high))
        return KVT_EINVAL;
    for (int i = KVT_TIER_HBM; i < KVT_TIER_COUNT; i++) {
        kvt_policy_tier_conf_t *tc = &p->c.tiers[i];
        tc->high = high;
        tc->low = low;
        p->high[i] = (uint64_t)((double)p->cap[i] * high);
        p->low[i] = (uint64_t)((double)p->cap[i] * low);
    }
    p->c.nvme_min_hits = nvme_min_hits;
    return 0;
}

int kvt_policy_create(kvt_policy_t **out, kvt_radix_t *t, const kvt_policy_conf_t *conf)
{
    if (!out || !t || !conf || (unsigned)conf->kind >= KVT_POLICY_KIND_COUNT || !conf->ops ||
        !conf->ops->move)
        return KVT_EINVAL;
    if (kvt_model_profile_check(&conf->model) < 0 || kvt_hw_profile_check(&conf->hw) < 0)
        return KVT_EINVAL;
    int any = 0;
    for (int i = KVT_TIER_HBM; i < KVT_TIER_COUNT; i++) {
        const kvt_policy_tier_conf_t *tc = &conf->tiers[i];
        float hi = tc->high ? tc->high : 0.95f, lo = tc->low ? tc->low : 0.90f;
        if (!(hi > 0 && hi <= 1 && lo > 0 && lo <= hi))
            return KVT_EINVAL;
        if (tc->capacity && conf->hw.bw[i] <= 0)
            return KVT_EINVAL; /* a tier with no load path cannot serve hits */
        any |= tc->capacity != 0;
    }
    if (!any || conf->tiers[KVT_TIER_NONE].capacity)
        return KVT_EINVAL;
    if (conf->admit_tier && (!tier_ok(conf->admit_tier) || !conf->tiers[conf->admit_tier].capacity))
        return KVT_EINVAL;
    if (conf->expert < 0 || conf->expert > KVT_POLICY_EXPERTS)
        return KVT_EINVAL;
    kvt_policy_t *p = calloc(1, sizeof(*p));
    if (!p)
        return KVT_ENOMEM;
    p->t = t;
    p->c = *conf;
    p->place = -1;
    if (!p->c.sweep_above)
        p->c.sweep_above = SWEEP_ABOVE;
    if (!p->c.sweep_slice)
        p->c.sweep_slice = SWEEP_SLICE;
    kvt_tier_id_t below = KVT_TIER_NONE;
    for (int i = KVT_TIER_COUNT - 1; i >= KVT_TIER_HBM; i--) {
        const kvt_policy_tier_conf_t *tc = &conf->tiers[i];
        float hi = tc->high ? tc->high : 0.95f, lo = tc->low ? tc->low : 0.90f;
        p->cap[i] = tc->capacity;
        p->high[i] = (uint64_t)((double)tc->capacity * hi);
        p->low[i] = (uint64_t)((double)tc->capacity * lo);
        p->st.capacity[i] = tc->capacity;
        p->lower[i] = below;
        if (tc->capacity) {
            below = (kvt_tier_id_t)i;
            p->top = (kvt_tier_id_t)i;
        }
    }
    if (conf->admit_tier)
        p->top = conf->admit_tier;
    for (int i = 0; i < KVT_TIER_COUNT; i++)
        p->run_pages[i] = CHUNK_PAGES; /* until matches say: a victim's run */
    p->nexp = 1;
    if (p->c.kind == KVT_POLICY_COST) {
        p->nexp = NEXP;
        if (conf->expert) /* pinned: no simulations, one order */
            p->xcur = p->xnext = p->xwant = conf->expert - 1;
        p->ghost = conf->ghosts;
        if (!p->ghost) {
            if (kvt_ghosts_create(&p->ghost, GHOST_BITS) < 0) {
                free(p);
                return KVT_ENOMEM;
            }
            p->own_ghost = 1;
        }
    }
    refresh_model(p);
    *out = p;
    return 0;
}

void kvt_policy_destroy(kvt_policy_t *p)
{
    if (!p)
        return;
    for (int t = 0; t < KVT_TIER_COUNT; t++) {
        free(p->heap[t].v);
        free(p->next[t].v);
    }
    for (int e = 0; e < NEXP; e++)
        for (int t = 0; t < KVT_TIER_COUNT; t++) {
            free(p->ms[e][t].v);
            free(p->ms[e][t].occ);
            free(p->ms[e][t].lru);
        }
    free(p->sweep_nodes);
    free(p->dead.keys);
    free(p->dead.seqs);
    free(p->orph.keys);
    free(p->orph.seqs);
    free(p->path);
    free(p->pend);
    if (p->own_ghost)
        kvt_ghosts_destroy(p->ghost);
    free(p);
}

/* ---- hooks ---------------------------------------------------------------------------------- */

/* Every REFRESH_EVERY inserts the cost model learns from the hits and ends counted since; the
 * heaps' keys were computed with the old one. They are all computed again (a walk over every
 * node) at most once per 1/1024 of the tree's nodes in inserts: every 64 inserts up to 65,536
 * nodes. Until then new keys use the new model and old ones keep theirs. Past sweep_above nodes
 * (16,384: the replays of docs/policy.md stay below, and decide exactly as before) the walk is a
 * sweep, a slice per kvt_policy_step (see the top), begun at most once per 1/64 of the nodes in
 * inserts: 64 node visits per insert, where once per 1/1024 cost 1,024 (bench_policy: 184 us per
 * insert at 40,000 nodes, 21 with sweeps). Forced on the replays' trees, sweeps moved their
 * prefill totals by 0.4% at most (docs/policy.md). */
static void after_insert(kvt_policy_t *p)
{
    p->inserts_since_rebuild++;
    if (++p->inserts_since_refresh < REFRESH_EVERY || p->c.kind != KVT_POLICY_COST)
        return;
    refresh_model(p);
    p->inserts_since_refresh = 0;
    size_t nodes = kvt_radix_node_count(p->t);
    int sweep = nodes > p->c.sweep_above && p->c.reports_node_frees;
    if (choose_expert(p)) { /* another expert orders the victims: new keys for every node */
        if (!sweep)
            p->stale = 1;
        else if (!p->sweeping && sweep_start(p) < 0)
            p->stale = 1;
        return;
    }
    if (p->inserts_since_rebuild < nodes / (sweep ? SWEEP_EVERY : 1024))
        return;
    if (!sweep)
        p->stale = 1;
    else if (!p->sweeping && sweep_start(p) < 0)
        p->stale = 1; /* no room for the sweep: the walk is whole */
}

/* The prio word a hint gives each page it covers (those from its from_page on). */
static uint16_t hint_prio(const kvt_policy_hint_t *h)
{
    unsigned prio = h->priority > 1000 ? 1000 : h->priority;
    unsigned pause = h->finished ? PAUSE_FINISHED : h->paused_ms ? encode_pause(h->paused_ms) : 0;
    return (uint16_t)(prio | (pause << PAUSE_SHIFT));
}

static void apply_hint(kvt_block_t *b, const kvt_policy_hint_t *h, uint32_t depth)
{
    if (!h || depth < h->from_page)
        return;
    b->prio = hint_prio(h);
}

/*
 * block_class as a table for a block the match has counted a hit of, indexed by its hit count
 * with that hit (0 and 1 alike: none before it; 10 and more alike: hit_class gives 9 hits before
 * and more its top class, with the ghost's hit or without) and the flags' top four bits (the
 * ghost bit and the position class): the chain of compares in hit_class was a third of a
 * MATCH's work per page in kvt_policy_on_match.
 */
#define CL(h, f) (HIT_CLASS((h) + ((f) >> 3)) * NPOSC + ((f)&7))
#define CLROW(h)                                                                                   \
    {                                                                                              \
        CL(h, 0), CL(h, 1), CL(h, 2), CL(h, 3), CL(h, 4), CL(h, 5), CL(h, 6), CL(h, 7), CL(h, 8),  \
            CL(h, 9), CL(h, 10), CL(h, 11), CL(h, 12), CL(h, 13), CL(h, 14), CL(h, 15)             \
    }
#define CLASS_HITS 11
static const uint8_t class_of[CLASS_HITS][16] = {CLROW(0), CLROW(0), CLROW(1), CLROW(2),
                                                 CLROW(3), CLROW(4), CLROW(5), CLROW(6),
                                                 CLROW(7), CLROW(8), CLROW(9)};
_Static_assert(GHOST_FLAG == 1u << 7 && POS_SHIFT == 4, "class_of reads the flags' top nibble");

static unsigned matched_class(const kvt_block_t *b)
{
    uint32_t h = b->hits < CLASS_HITS - 1 ? b->hits : CLASS_HITS - 1;
    return class_of[h][(unsigned)b->flags >> 4];
}

/* on_match's run of hits: class in the low bits, then the tier, then EXP_HD's age bucket. */
#define RUN_TIER 6
#define RUN_AGE  9
_Static_assert(NCLASS <= 1 << RUN_TIER && KVT_TIER_COUNT <= 1 << (RUN_AGE - RUN_TIER),
               "on_match's run key packs class, tier and age bucket");

static void count_hits(kvt_policy_t *p, unsigned run_key, uint32_t run)
{
    unsigned c = run_key & ((1u << RUN_TIER) - 1);
    p->class_hits[c] += run;
    p->hd_hits[(run_key >> RUN_TIER) & ((1u << (RUN_AGE - RUN_TIER)) - 1)][c / NPOSC]
              [run_key >> RUN_AGE] += run;
}

/* The first block of [b, e) that is in a tier, or e. A path's pages are mostly all index-only
 * or all stored: in an index-only namespace (bench_server's MATCHes) every page is skipped, eight
 * to a test (13 instructions; four to a test took 10), instead of one loop turn each (12
 * instructions a page: most of on_match's). */
_Static_assert(KVT_TIER_NONE == 0, "index-only blocks are found by OR-ing their tiers");
static kvt_block_t *skip_index_only(kvt_block_t *b, kvt_block_t *e)
{
    for (ptrdiff_t n = e - b; n >= 8 && (b[0].tier | b[1].tier | b[2].tier | b[3].tier | b[4].tier |
                                         b[5].tier | b[6].tier | b[7].tier) == KVT_TIER_NONE;
         n -= 8)
        b += 8;
    while (b < e && b->tier == KVT_TIER_NONE)
        b++;
    return b;
}

void kvt_policy_on_match(kvt_policy_t *p, const kvt_match_t *m, const kvt_policy_hint_t *hint)
{
    if (!p || !m || !m->node || m->pages == 0)
        return;
    kvt_policy_hint_t own;
    if (hint && (hint->finished || hint->paused_ms) && !hint->next_use &&
        hint->from_page == kvt_radix_node_depth(m->node)) {
        /* A hint from the deepest matched node on (kvtierd's, the replay's trace events) covers
         * the session's own part, which reaches up through the ancestors nothing else branches
         * from: its earlier turns, each a node its next turn added below. On the deepest node
         * alone, "finished" left every earlier turn of the session as recent as it was and
         * "paused" protected the last turn only (agent, 5 %: 623.5 s against 516.2). */
        const kvt_radix_node_t *x = m->node;
        for (const kvt_radix_node_t *up; (up = kvt_radix_node_parent(x)) &&
                                         kvt_radix_node_children(up) == 1 &&
                                         kvt_radix_node_depth(x) > 0;)
            x = up;
        if (kvt_radix_node_depth(x) < hint->from_page) {
            own = *hint;
            own.from_page = kvt_radix_node_depth(x);
            hint = &own;
        }
    }
    uint32_t now = now_clock(p);
    int promote = 0, repush = p->c.kind == KVT_POLICY_ORACLE || (hint && hint->finished);
    int cost = p->c.kind == KVT_POLICY_COST, sim = p->nexp > 1;
    int oracle = p->c.kind == KVT_POLICY_ORACLE && hint && hint->next_use;
    unsigned top = tier_rank((uint8_t)p->top);
    uint16_t hprio = hint ? hint_prio(hint) : 0; /* its encode_pause once, not once a page */
    /* Hits per class are counted in runs (a path's pages mostly share one) and added to the
     * decayed doubles once per run: one += per page made every page wait for the last. */
    unsigned run_class = 0;
    uint32_t run = 0;
    uint32_t per_tier[KVT_TIER_COUNT] = {0}; /* pages this match loads from each tier */
    uint8_t maxt = KVT_TIER_NONE;            /* the slowest tier a stored page is in */
    /* Node by node (this runs on every MATCH; a path iterator steps block by block). */
    for (kvt_path_run_t r = kvt_path_run_first(m->node, m->node_pages); r.node;
         kvt_path_run_next(&r)) {
        kvt_block_t *b = r.blocks, *e = r.blocks + r.n;
        if (oracle) { /* every page, in a tier or not, takes its next use */
            for (uint32_t i = 0; i < r.n; i++) {
                promote |= b[i].tier != KVT_TIER_NONE && tier_rank(b[i].tier) > top;
                if (r.depth + i < hint->nnext)
                    b[i].policy = hint->next_use[r.depth + i];
            }
            b = e;
        }
        /* Index-only pages count nothing: no hit class, no load, no promotion. */
        for (; b < e; b++) {
            if (b->tier == KVT_TIER_NONE && (b = skip_index_only(b, e)) == e)
                break;
            uint8_t t = b->tier;
            if (t > maxt) /* the promotion's test once a MATCH (tier_rank(t) is t here) */
                maxt = t;
            if (!cost || t >= KVT_TIER_COUNT)
                continue;
            per_tier[t]++;
            if (sim && ms_sampled(b->hash))
                ms_use(p, b->hash, r.depth + (uint32_t)(b - r.blocks), b->flags,
                       kvt_radix_ns_page_size(p->t, kvt_radix_node_ns(r.node)), b->size, t);
            /* the run's class, tier and age bucket (EXP_HD's use ages): a path's pages mostly
             * share all three */
            unsigned k =
                matched_class(b) | (unsigned)t << RUN_TIER | age_bucket(now - b->policy) << RUN_AGE;
            if (k != run_class && run > 0) {
                count_hits(p, run_class, run);
                run = 0;
            }
            run_class = k;
            run++;
            b->policy = now;
        }
        if (hint)
            for (uint32_t i = hint->from_page > r.depth ? hint->from_page - r.depth : 0; i < r.n;
                 i++)
                r.blocks[i].prio = hprio;
        if (repush && !kvt_radix_node_leased(r.node))
            push_node(p, r.node);
    }
    if (run > 0)
        count_hits(p, run_class, run);
    promote |= maxt > top;
    for (int t = KVT_TIER_HBM; t < KVT_TIER_COUNT; t++)
        if (per_tier[t])
            p->run_pages[t] += RUN_GAIN * ((double)per_tier[t] - p->run_pages[t]);
    if (promote && p->npromo < PROMO_QUEUE)
        p->promo[p->npromo++] = (promo_t){m->node, m->node_pages, p->seq, p->foreign, p->place};
}

void kvt_policy_set_place(kvt_policy_t *p, int tag)
{
    if (p)
        p->place = tag;
}

int kvt_policy_on_insert(kvt_policy_t *p, const kvt_insert_t *res, const kvt_policy_hint_t *hint)
{
    if (!p || !res || (res->new_pages && !res->node))
        return KVT_EINVAL;
    if (res->new_pages == 0)
        return 0;
    kvt_radix_node_t *n = res->node;
    if (kvt_radix_node_depth(n) != res->first_page || kvt_radix_node_pages(n) < res->new_pages)
        return KVT_EINVAL;
    kvt_policy_on_split(p, res->split);
    kvt_block_t *bl = kvt_radix_node_blocks(n);
    uint32_t i0 = kvt_radix_node_pages(n) - res->new_pages; /* the new pages end the leaf */
    for (uint32_t i = i0; i < i0 + res->new_pages; i++)
        if (bl[i].tier != KVT_TIER_NONE)
            return KVT_EINVAL;
    uint32_t size = block_bytes(p, kvt_radix_node_ns(n));
    uint32_t ps = kvt_radix_ns_page_size(p->t, kvt_radix_node_ns(n));
    uint32_t now = now_clock(p);
    uint32_t done = 0;
    kvt_tier_id_t t = p->top;
    while (done < res->new_pages && t != KVT_TIER_NONE) {
        uint32_t want = res->new_pages - done;
        uint64_t one = charge(p, t, size);
        uint64_t free_b = room_left(p, t);
        if (bypass(p) && free_b < (uint64_t)want * one) {
            /* Page by page (their next uses grow with depth): room is made for a page only by
             * victims used later than it; the rest go to a tier below, or nowhere. */
            uint32_t k = 0;
            while (k < want) {
                uint64_t need = (uint64_t)(k + 1) * one;
                if (room_left(p, t) < need) {
                    uint32_t depth = kvt_radix_node_depth(n) + i0 + done + k;
                    uint32_t nu = hint && hint->next_use && depth < hint->nnext
                                      ? hint->next_use[depth]
                                      : UINT32_MAX;
                    p->bar = (vkey_t){nu == UINT32_MAX ? -INF_KEY : -(double)nu, 0};
                    p->bar_on = 1;
                    (void)make_room(p, t, need, 0, &no_cause);
                    p->bar_on = 0;
                    if (room_left(p, t) < need)
                        break;
                }
                k++;
            }
            bl = kvt_radix_node_blocks(n);
            free_b = room_left(p, t);
            want = k;
        } else if (free_b < (uint64_t)want * one) {
            /* make_room's need is the free room wanted, not what is missing beyond it: the
             * shortfall alone freed too little whenever some room was left (none at all with
             * half of it free), and the rest of the prompt went one tier down. */
            uint64_t need = (uint64_t)want * one;
            if (need > p->cap[t])
                need = p->cap[t] - (p->cap[t] % one);
            (void)make_room(p, t, need, 0, &no_cause);
            bl = kvt_radix_node_blocks(n);
            free_b = room_left(p, t);
        }
        uint32_t fit = (uint32_t)KVT_MIN((uint64_t)want, free_b / one);
        if (fit > 0 && p->c.ops->admit &&
            p->c.ops->admit(p->c.ops_arg, n, res->first_page + done, fit, t) < 0)
            fit = 0;
        ghost_warm(p, n, i0 + done, fit);
        bl = kvt_radix_node_blocks(n);
        for (uint32_t i = i0 + done; i < i0 + done + fit; i++) {
            kvt_block_t *b = &bl[i];
            uint32_t depth = kvt_radix_node_depth(n) + i;
            b->tier = (uint8_t)t;
            b->size = size;
            b->flags = (uint8_t)((b->flags & ~(POS_MASK | GHOST_FLAG)) |
                                 (pos_class((uint64_t)(res->pages - depth) * ps) << POS_SHIFT));
            if (p->ghost) {
                uint64_t h = kvt_radix_block_hash(p->t, n, depth);
                bl = kvt_radix_node_blocks(n);
                b = &bl[i];
                if (kvt_ghosts_seen(p->ghost, h))
                    b->flags |= GHOST_FLAG;
                if (p->nexp > 1 && ms_sampled(h))
                    ms_use(p, h, depth, b->flags, ps, size, KVT_TIER_NONE);
            }
            if (p->c.kind == KVT_POLICY_ORACLE)
                b->policy = hint && hint->next_use && depth < hint->nnext ? hint->next_use[depth]
                                                                          : UINT32_MAX;
            else
                b->policy = now;
            apply_hint(b, hint, depth);
        }
        if (fit) {
            p->used[t] += (uint64_t)fit * one;
            p->st.blocks[t] += fit;
            p->st.admitted_bytes[t] += (uint64_t)fit * size;
        }
        done += fit;
        t = p->lower[t];
    }
    if (done < res->new_pages) {
        uint32_t rest = res->new_pages - done;
        p->st.rejected += rest;
        uint32_t np_before = kvt_radix_node_pages(n);
        p->in_drop = 1;
        int erc = kvt_radix_evict(p->t, n, rest); /* leased: they stay, index-only */
        p->in_drop = 0;
        if (erc == 0 && rest == np_before) {
            dead_add(p, n);
            n = NULL; /* freed */
        }
    }
    if (n && done)
        push_node(p, n);
    after_insert(p);
    return (int)done;
}

void kvt_policy_on_split(kvt_policy_t *p, kvt_radix_node_t *head)
{
    /* The head took the old node's first pages, which left the old node's heap entries (their
     * runs are read live) and are in no entry of their own until the next rebuild, nor in the
     * registry's copy a sweep walks: without this push they were no victim meanwhile. */
    if (p && head)
        push_node(p, head);
}

int kvt_policy_adopt(kvt_policy_t *p, kvt_radix_node_t *n, uint32_t depth, uint32_t npages,
                     kvt_tier_id_t tier, uint32_t prompt_pages, const kvt_policy_hint_t *hint)
{
    if (!p || !n || npages == 0 || !tier_ok(tier) || !p->cap[tier])
        return KVT_EINVAL;
    uint32_t d0 = kvt_radix_node_depth(n), np = kvt_radix_node_pages(n);
    if (depth < d0 || depth - d0 > np || npages > np - (depth - d0))
        return KVT_EINVAL;
    uint32_t i0 = depth - d0;
    kvt_block_t *bl = kvt_radix_node_blocks(n);
    uint64_t need = 0;
    for (uint32_t i = i0; i < i0 + npages; i++) {
        if (bl[i].tier != KVT_TIER_NONE || bl[i].size == 0)
            return KVT_EINVAL;
        need += charge(p, tier, bl[i].size);
    }
    if (i0 > 0 && tier_rank(bl[i0 - 1].tier) > tier_rank((uint8_t)tier))
        return KVT_EAGAIN;
    if (i0 + npages < np && tier_rank(bl[i0 + npages].tier) < tier_rank((uint8_t)tier))
        return KVT_EAGAIN;
    if (need > room_left(p, tier))
        return KVT_ENOSPC;
    /* The run in tier the pages join, if n has one: the heap entry pushed when it began reads
     * the run live, so it is pushed again only for a new boundary whose key is lower in its
     * value, not just in the depth that breaks ties (a higher one the pop pushes back itself).
     * A push per adoption grew the heap by an entry per PUT's pages of a node until a rebuild. */
    uint32_t ra, rb;
    node_run(n, (uint8_t)tier, &ra, &rb);
    vkey_t was = ra < rb ? block_key(p, n, rb - 1, p->xcur) : (vkey_t){0, 0};
    uint32_t ps = kvt_radix_ns_page_size(p->t, kvt_radix_node_ns(n));
    uint32_t now = now_clock(p);
    ghost_warm(p, n, i0, npages);
    bl = kvt_radix_node_blocks(n);
    for (uint32_t i = i0; i < i0 + npages; i++) {
        uint32_t d = d0 + i;
        uint64_t from_end = prompt_pages > d ? (uint64_t)(prompt_pages - d) * ps : 0;
        uint8_t flags = (uint8_t)((bl[i].flags & ~(POS_MASK | GHOST_FLAG)) |
                                  (pos_class(from_end) << POS_SHIFT));
        if (p->ghost) {
            uint64_t h = kvt_radix_block_hash(p->t, n, d);
            bl = kvt_radix_node_blocks(n);
            if (kvt_ghosts_seen(p->ghost, h))
                flags |= GHOST_FLAG;
        }
        bl[i].flags = flags;
        bl[i].policy = now;
        apply_hint(&bl[i], hint, d);
    }
    set_tier(p, n, i0, npages, tier);
    p->used[tier] += need;
    p->st.blocks[tier] += npages;
    p->st.admitted_bytes[tier] += run_bytes(n, i0, npages);
    if (ra == rb || (i0 >= rb && block_key(p, n, i0 + npages - 1, p->xcur).a < was.a))
        push_tier(p, n, (uint8_t)tier); /* leased now, it is skipped until the next rebuild */
    after_insert(p);
    return (int)npages;
}

int kvt_policy_hold(kvt_policy_t *p, kvt_tier_id_t tier, uint32_t size, int room)
{
    if (!p || !tier_ok(tier) || !p->cap[tier] || size == 0)
        return KVT_EINVAL;
    uint64_t need = charge(p, tier, size);
    if (need > room_left(p, tier)) {
        if (!room)
            return KVT_ENOSPC;
        int rc = make_room(p, tier, need, 0, &no_cause);
        if (rc < 0)
            return rc;
    }
    p->used[tier] += need;
    p->held[tier] += need;
    return 0;
}

void kvt_policy_unhold(kvt_policy_t *p, kvt_tier_id_t tier, uint32_t size)
{
    if (!p || !tier_ok(tier) || !p->cap[tier] || size == 0)
        return;
    uint64_t c = charge(p, tier, size);
    kvt_assert(p->held[tier] >= c && p->used[tier] >= c);
    p->held[tier] -= c;
    p->used[tier] -= c;
}

void kvt_policy_on_node_free(kvt_policy_t *p, kvt_radix_node_t *n)
{
    /* The engine's own drops (in_drop) record their nodes' deaths themselves, after the evict. */
    if (p && n && !p->in_drop)
        dead_add(p, n); /* out of memory, it makes the next victim rebuild the heaps whole */
}

void kvt_policy_on_free(kvt_policy_t *p, uint32_t ns, const kvt_block_t *b)
{
    (void)ns;
    if (!p || !b)
        return;
    if (!p->in_drop)
        p->foreign++;
    if (tier_ok((kvt_tier_id_t)b->tier) && p->cap[b->tier]) {
        uint64_t c = charge(p, (kvt_tier_id_t)b->tier, b->size);
        kvt_assert(p->used[b->tier] >= c);
        p->used[b->tier] -= c;
        p->st.blocks[b->tier]--;
    }
}

/* Drops the trailing run of one tier of the npages kvt_radix_trim found droppable (all of them
 * when they are index-only, as kvt_policy_trim_index takes). */
static int trim_drop(void *arg, kvt_radix_node_t *n, uint32_t npages)
{
    kvt_policy_t *p = arg;
    const kvt_block_t *bl = kvt_radix_node_blocks(n);
    uint32_t np = kvt_radix_node_pages(n), k = 1;
    uint8_t t = bl[np - 1].tier;
    while (k < npages && bl[np - 1 - k].tier == t)
        k++;
    int rc = do_drop(p, n, k, (kvt_tier_id_t)t);
    if (rc > 0 && t == KVT_TIER_NONE)
        p->st.index_trimmed += (uint64_t)rc;
    else if (rc > 0)
        p->st.pages_dropped_for_index += (uint64_t)rc;
    return rc;
}

uint32_t kvt_policy_trim_index(kvt_policy_t *p, uint64_t target, uint32_t budget)
{
    return p ? kvt_radix_trim(p->t, target, budget, kvt_radix_index_only, trim_drop, p) : 0;
}

static int trim_any(void *arg, const kvt_block_t *b)
{
    (void)arg;
    return !(b->flags & KVT_BLOCK_BUSY);
}

uint32_t kvt_policy_trim_index_bytes(kvt_policy_t *p, uint64_t target, uint32_t budget)
{
    return p ? kvt_radix_trim(p->t, target, budget, trim_any, trim_drop, p) : 0;
}

/*
 * A queued promotion q stopped at node `at` for room in the top tier still on its way (its moves
 * out in flight, make_room's KVT_EAGAIN; made: this try started some of them). It is parked until
 * a move lands (park_run) and goes again then, as its path's next MATCH would queue it: before, it
 * was dropped, and a parked one queued again into a full tier only made room for others. Room
 * made that went elsewhere (a move out failed, other pages took it first) is made again at the
 * next try, at most ROOM_TRIES times after the first: then it is dropped, until its path's next
 * MATCH, so that a promotion the tier never keeps room for does not move others out forever.
 */
static void park_room(kvt_policy_t *p, const promo_t *q, kvt_radix_node_t *at, int made)
{
    uint32_t rooms = q->rooms + (made != 0);
    if (rooms > ROOM_TRIES) {
        p->st.room_gaveups++;
        return;
    }
    p->st.room_waits++;
    parked_t *e = park_put(p, q->n, q->node_pages, at, q->place);
    e->room = 1;
    e->q.rooms = KVT_MAX(e->q.rooms, rooms);
}

/* Promotes the path ending at node n (first node_pages pages) into tier `to`. q: the queued
 * promotion (a MATCH's, or a parked one's), which stops where a parked one waits and waits for
 * room on its way; NULL for a caller's (a PREFETCH's own lease does not refuse it). */
static int promote_path(kvt_policy_t *p, kvt_radix_node_t *n, uint32_t node_pages, kvt_tier_id_t to,
                        const promo_t *q, const kvt_policy_cause_t *why, int *stop)
{
    *stop = 0;
    size_t len = 0;
    for (kvt_radix_node_t *x = n; x; x = kvt_radix_node_parent(x)) {
        if (len == p->path_cap) {
            size_t nc = p->path_cap ? 2 * p->path_cap : 64;
            kvt_radix_node_t **v = realloc(p->path, nc * sizeof(*v));
            if (!v)
                return KVT_ENOMEM;
            p->path = v;
            p->path_cap = nc;
        }
        p->path[len++] = x;
    }
    int total = 0;
    p->protect = len;                /* making room must not demote the path being promoted */
    for (size_t k = len; k-- > 0;) { /* root first: a shortage leaves the shallow part fast */
        kvt_radix_node_t *x = p->path[k];
        uint32_t end =
            x == n ? KVT_MIN(node_pages, kvt_radix_node_pages(x)) : kvt_radix_node_pages(x);
        for (;;) {
            const kvt_block_t *bl = kvt_radix_node_blocks(x);
            /* the first block slower than `to` within [0, end) */
            uint32_t a, b;
            node_run(x, (uint8_t)to, &a, &b);
            uint32_t s = b;
            while (s < end && bl[s].tier == KVT_TIER_NONE)
                s++;
            if (s >= end)
                break;
            kvt_tier_id_t from = (kvt_tier_id_t)bl[s].tier;
            uint32_t ra, rb;
            node_run(x, (uint8_t)from, &ra, &rb);
            uint32_t cnt = KVT_MIN(rb, end) - s;
            if (!tier_ok(from) || run_busy(x, s, cnt))
                break;
            if (q && park_waits_at(p, x)) {
                park_put(p, n, node_pages, x, why->tag); /* this path end goes up with it */
                p->st.park_waits++;
                *stop = KVT_EBUSY;
                goto done;
            }
            cnt = KVT_MIN(cnt, 64u);
            if (bypass(p)) {
                /* the pages used next as soon as the first, and only past victims used later */
                uint32_t same = 1;
                while (same < cnt && bl[s + same].policy == bl[s].policy)
                    same++;
                cnt = same;
                p->bar = block_key(p, x, s, 0);
                p->bar_on = 1;
            }
            runkey_t was = run_key(p, x, to);
            uint64_t out = p->pending_out[to];
            int rc = do_move(p, x, s, cnt, from, to, 0, why);
            p->bar_on = 0;
            if (rc == KVT_ENOSPC && bypass(p) && p->lower[to] != KVT_TIER_NONE &&
                tier_rank(p->lower[to]) < tier_rank(from)) {
                to = p->lower[to]; /* used later than all there: the fastest tier it beats */
                continue;
            }
            if (rc == KVT_ENOSPC && p->c.kind == KVT_POLICY_COST && p->xcur == EXP_FREQ &&
                p->lower[to] != KVT_TIER_NONE && tier_rank(p->lower[to]) < tier_rank(from)) {
                /* COST under LFU's order: a hit path larger than the room the top tier can make
                 * goes as far up as it fits. Left where it was, a hot prefix that fell to NVMe
                 * while another order chose stayed there for good (sysprompt, 5 %, seed 1:
                 * 225.1 s after a start on the value's order, 178.9 now, LFU 182.6). Under the
                 * other orders the rest stays, as under LRU (rising there too cost the agent and
                 * chat rows up to 0.5 %). */
                to = p->lower[to];
                continue;
            }
            if (rc == KVT_EBUSY) /* read in place under a lease: again once it goes */
                park(p, n, node_pages, x, why->tag);
            if (rc == KVT_EAGAIN && q && room_coming(p, to, run_charge(p, x, s, cnt, to)))
                park_room(p, q, x, p->pending_out[to] > out);
            if (rc < 0) {
                *stop = rc;
                goto done; /* no room: the rest stays where it is */
            }
            total += rc;
            if (kvt_radix_node_blocks(x)[s].tier != to)
                break; /* pending: the executor finishes it */
            /* The run in `to` grew at its end (do_move pushed a new one); the run the pages
             * left lost its head, which leaves its boundary where it was. */
            if (was.had)
                push_changed(p, x, to, was);
        }
    }
done:
    p->protect = 0;
    /* Only the path's nodes a victim search left out while protected go back into the heaps;
     * the others kept their entries. */
    for (size_t k = 0; k < len; k++)
        if (!kvt_radix_node_leased(p->path[k]) && orphan_take(p, p->path[k]))
            push_node(p, p->path[k]);
    return total;
}

int kvt_policy_prefetch(kvt_policy_t *p, kvt_radix_node_t *n, uint32_t node_pages)
{
    if (!p || !n || node_pages == 0 || node_pages > kvt_radix_node_pages(n))
        return KVT_EINVAL;
    int stop;
    return promote_path(p, n, node_pages, p->top, NULL, &no_cause, &stop);
}

int kvt_policy_promote(kvt_policy_t *p, kvt_radix_node_t *n, uint32_t node_pages, kvt_tier_id_t to,
                       const kvt_policy_cause_t *why)
{
    if (!p || !n || node_pages == 0 || node_pages > kvt_radix_node_pages(n) || !tier_ok(to) ||
        !p->cap[to])
        return KVT_EINVAL;
    int stop, total = promote_path(p, n, node_pages, to, NULL, why ? why : &no_cause, &stop);
    return total == 0 && stop == KVT_EAGAIN ? KVT_EAGAIN : total;
}

/* Tier t's bytes net of those its moves in flight take out. A page of such a move that the tier
 * lost meanwhile has left the count already but not the pending bytes: never below 0. */
static uint64_t level(const kvt_policy_t *p, int t)
{
    return p->used[t] > p->pending_out[t] ? p->used[t] - p->pending_out[t] : 0;
}

/* The parked promotions whose node no lease holds any more join the queue, once a lease of the
 * tree has ended since the last look (the end of the last lease on a node is one). The leases of
 * the engine's own moves count too: each ends as its move lands, so those waiting for room join
 * it then, leased or not (a lease that refuses the move parks them for it). They run from the
 * queue, which keeps the record of deaths while it holds entries (see rebuild), since making room
 * for one may drop another's node. */
static void park_run(kvt_policy_t *p)
{
    uint64_t releases = kvt_radix_lease_releases(p->t);
    if (p->npark == 0 || releases == p->park_releases)
        return;
    uint32_t kept = 0;
    int full = 0;
    for (uint32_t i = 0; i < p->npark; i++) {
        const parked_t *e = &p->park[i];
        if (!park_valid(p, e))
            continue;
        int ready = e->room || !kvt_radix_node_leased(e->at);
        if (ready && p->npromo < PROMO_QUEUE) {
            p->promo[p->npromo++] = e->q;
            p->st.unparked += !e->room;
            continue;
        }
        full |= ready;
        p->park[kept++] = *e;
    }
    p->npark = kept;
    if (!full) /* else the rest are looked at again next step */
        p->park_releases = releases;
}

int kvt_policy_step(kvt_policy_t *p, uint32_t budget)
{
    if (!p)
        return KVT_EINVAL;
    int total = 0;
    if (p->sweeping)
        sweep_some(p);
    park_run(p);
    for (uint32_t i = 0; i < p->npromo; i++) {
        promo_t *q = &p->promo[i];
        if (p->dead_lost || dead_after(p, q->n, q->seq) ||
            (!p->c.reports_node_frees && p->foreign != q->foreign))
            continue;
        kvt_policy_cause_t why = {.req = NULL, .tag = q->place}; /* the MATCH's tag */
        int stop, rc = promote_path(p, q->n, q->node_pages, p->top, q, &why, &stop);
        if (rc < 0)
            return rc;
        total += rc;
    }
    p->npromo = 0;
    /* A tier's level net of what its moves in flight take out: those bytes are leaving already
     * (counting them, every step until they land would move out as much again). */
    for (int t = KVT_TIER_HBM; t < KVT_TIER_COUNT; t++) {
        if (!p->cap[t] || level(p, t) <= p->high[t])
            continue;
        while (level(p, t) > p->low[t] && (budget == 0 || (uint32_t)total < budget)) {
            int rc = evict_one(p, (kvt_tier_id_t)t, 0, level(p, t) - p->low[t], &no_cause);
            if (rc < 0)
                return rc;
            if (rc == 0)
                break;
            total += rc;
        }
    }
    return total;
}

int kvt_policy_move_done(kvt_policy_t *p, kvt_radix_node_t *n, uint32_t depth, uint32_t npages,
                         kvt_tier_id_t from, kvt_tier_id_t to, int status)
{
    if (!p || !n)
        return KVT_EINVAL;
    size_t k = 0;
    while (k < p->npend &&
           !(p->pend[k].n == n && p->pend[k].depth == depth && p->pend[k].npages == npages &&
             p->pend[k].from == from && p->pend[k].to == to))
        k++;
    if (k == p->npend)
        return KVT_EINVAL; /* no such move in flight */
    pmove_t mv = p->pend[k];
    /* An insert may have split the node since the move began: the pages are then in n and in
     * the ancestors the split carved out of it. A page no longer in `from` (a tier lost it, and
     * it went index-only through kvt_policy_on_free) undoes the move: it is still ended here,
     * its reservation and lease given back, or they would be held forever. */
    int changed = 0;
    for (uint32_t i = 0; i < npages; i++) {
        kvt_block_t *b = kvt_radix_block_at(n, depth + i);
        changed |= !b || b->tier != from;
    }
    if (changed && status >= 0)
        status = KVT_EINVAL;
    /* Promotions may have made the pages after the run faster than `to` meanwhile: moving the
     * run now would break the node's order, so the engine keeps it where it is. */
    int conflict = 0;
    if (status >= 0) {
        for (int end = 0; end < 2; end++) {
            uint32_t d = end ? depth + npages - 1 : depth;
            kvt_radix_node_t *x = n;
            while (kvt_radix_node_depth(x) > d)
                x = kvt_radix_node_parent(x);
            uint32_t i = d - kvt_radix_node_depth(x), np = kvt_radix_node_pages(x);
            const kvt_block_t *bl = kvt_radix_node_blocks(x);
            if (end && i + 1 < np && tier_rank(bl[i + 1].tier) < tier_rank((uint8_t)to))
                conflict = 1;
            if (!end && i > 0 && tier_rank(bl[i - 1].tier) > tier_rank((uint8_t)to))
                conflict = 1;
        }
    }
    if (status == KVT_EBUSY && tier_rank((uint8_t)to) < tier_rank((uint8_t)from)) {
        /* a promotion refused at its switch for a lease taken while it ran (the path up to the
         * run's end, as a split may have left it) */
        kvt_radix_node_t *e = kvt_radix_node_holding(n, depth + npages - 1);
        park(p, e, depth + npages - kvt_radix_node_depth(e), kvt_radix_node_holding(n, depth),
             mv.place);
    }
    p->pend[k] = p->pend[--p->npend];
    p->pending_out[from] -= mv.charge_frm;
    p->queued[from]--;
    p->queued[to]--;
    p->st.pending_moves--;
    int lands = status >= 0 && !conflict;
    if (!lands) {
        p->used[to] -= mv.charge_to;
    } else {
        p->used[from] -= mv.charge_frm;
        p->st.blocks[from] -= npages;
        p->st.blocks[to] += npages;
        p->st.moved_bytes[from][to] += mv.bytes;
    }
    kvt_radix_release(p->t, mv.lease);
    /* Node by node up the path the lease held: the pages land in n and in the ancestors a split
     * carved out of it, each part's runs in `from` and `to` pushed where they changed (see
     * push_changed). A node goes back into the heaps whole only where a victim search left it
     * out while leased (orphan_take): the others kept their entries. Pushing every node of the
     * path at every landed move grew the heaps by the path's length a move until a rebuild. */
    uint32_t end = depth + npages;
    for (kvt_radix_node_t *x = n; x; x = kvt_radix_node_parent(x)) {
        uint32_t lo = KVT_MAX(kvt_radix_node_depth(x), depth);
        int part = lands && lo < end; /* x holds pages [lo, end) of the run */
        runkey_t was_from = {0, {0, 0}}, was_to = {0, {0, 0}};
        if (part) {
            was_from = run_key(p, x, from);
            was_to = run_key(p, x, to);
            tier_run(p, x, lo, end - lo, to);
            end = lo;
        }
        if (kvt_radix_node_leased(x)) {
            if (part) /* another move's lease: its landing pushes x whole */
                orphan_add(p, x);
            continue;
        }
        if (orphan_take(p, x)) {
            push_node(p, x);
        } else if (part) {
            push_changed(p, x, from, was_from);
            push_changed(p, x, to, was_to);
        }
    }
    return changed ? KVT_EINVAL : conflict ? KVT_EAGAIN : 0;
}

size_t kvt__policy_heap_len(const kvt_policy_t *p, kvt_tier_id_t t)
{
    return p && tier_ok(t) ? p->heap[t].len : 0;
}

void kvt_policy_stats(const kvt_policy_t *p, kvt_policy_stats_t *st)
{
    if (!p || !st)
        return;
    *st = p->st;
    for (int t = 0; t < KVT_TIER_COUNT; t++)
        st->used[t] = p->used[t];
    st->expert = (uint32_t)p->xwant;
    for (int e = 0; e < KVT_POLICY_EXPERTS; e++)
        st->expert_miss_s[e] = e < p->nexp && p->nexp > 1 ? p->ms_cost[e] : 0;
    st->expert_real_s = p->nexp > 1 ? p->ms_real : 0;
}

int kvt_policy_verify(const kvt_policy_t *p)
{
    if (!p)
        return KVT_EINVAL;
    uint64_t used[KVT_TIER_COUNT] = {0}, blocks[KVT_TIER_COUNT] = {0};
    int bad = 0;
    size_t nn = kvt_radix_node_count(p->t);
    for (size_t i = 0; i < nn; i++) {
        kvt_radix_node_t *n = kvt_radix_node_at(p->t, i);
        const kvt_block_t *bl = kvt_radix_node_blocks(n);
        uint32_t np = kvt_radix_node_pages(n);
        for (uint32_t j = 0; j < np; j++) {
            if (j && tier_rank(bl[j].tier) < tier_rank(bl[j - 1].tier)) {
                kvt_log(KVT_LOG_ERROR,
                        "policy verify: node depth %u page %u is in a faster tier "
                        "than the page before it",
                        kvt_radix_node_depth(n), j);
                bad = 1;
            }
            if (bl[j].tier >= KVT_TIER_COUNT) {
                bad = 1;
                continue;
            }
            used[bl[j].tier] += bl[j].tier == KVT_TIER_NONE
                                    ? bl[j].size
                                    : charge(p, (kvt_tier_id_t)bl[j].tier, bl[j].size);
            blocks[bl[j].tier]++;
        }
    }
    for (int t = KVT_TIER_HBM; t < KVT_TIER_COUNT; t++) {
        /* Pending moves hold reservations no block's tier shows yet: compare when idle. */
        if (p->st.pending_moves == 0 && p->used[t] != used[t] + p->held[t]) {
            kvt_log(KVT_LOG_ERROR, "policy verify: %s holds %llu bytes, engine counts %llu",
                    kvt_tier_name((kvt_tier_id_t)t), (unsigned long long)used[t],
                    (unsigned long long)p->used[t]);
            bad = 1;
        }
        if (p->st.pending_moves == 0 && p->st.blocks[t] != blocks[t]) {
            kvt_log(KVT_LOG_ERROR, "policy verify: %s holds %llu blocks, engine counts %llu",
                    kvt_tier_name((kvt_tier_id_t)t), (unsigned long long)blocks[t],
                    (unsigned long long)p->st.blocks[t]);
            bad = 1;
        }
        if (p->used[t] > p->cap[t]) {
            kvt_log(KVT_LOG_ERROR, "policy verify: %s over capacity", kvt_tier_name(t));
            bad = 1;
        }
    }
    if (used[KVT_TIER_NONE] != 0) {
        kvt_log(KVT_LOG_ERROR, "policy verify: index-only blocks carry a size");
        bad = 1;
    }
    return bad ? KVT_ECORRUPT : 0;
}
