/*
 * exec.c: the policy's executor, the one place that acts on the tiers for the policy (policy/):
 * moves (a run of pages copied from one tier to another, switched over when the last copy lands),
 * adopting blocks into the policy's accounting, freeing tier locations (deferred while reads of
 * the block are in flight: the busy table), the radix free callbacks that give a leaving block's
 * bytes back to its tier, the ghost table of evicted blocks, and blocks a tier lost by itself.
 *
 * The policy decides, exec.c acts
 * -------------------------------
 * Every change of a block's tier goes through the policy engine, which keeps each tier's
 * accounting (in the tiers' own footprints, so its capacities are the tiers') and the order of
 * tiers inside a node. Blocks enter it by kvt_policy_adopt (a PUT's writes once they landed,
 * blocks a remote probe found, NVMe blocks recovered at start-up). It leaves them by the tree's
 * free callback. In between it moves them: kvt_policy_step (after every batch of events) runs
 * the promotions that MATCH queued and, above a tier's high watermark, demotes or drops its
 * lowest-value blocks; the move operation below copies each page with kvt_tier_copy, and when
 * the last copy lands, kvt_policy_move_done() switches the blocks over and the old locations are
 * freed:
 *
 *     MATCH ─> on_match ─┐                          ┌─> kvt_tier_copy per page ─> ... ─┐
 *     PREFETCH ─> promote┼─> step/promote ─> move() ┤  (blocks BUSY, node leased)      │
 *     DRAM > high ───────┘                          └─ move_done(): tier, loc, free old┘
 *
 * A block is named by (node, page depth) while I/O runs: the request holds a lease on the node
 * (so nothing on the path is evicted) and resolves the block again with kvt_radix_block_at() on
 * completion, because a split may have moved it. Reads in flight are counted per block hash
 * (kvt__busy_*: the write path's table, and each loop's for its GETs planned under the shared
 * lock, summed by the frees). A move may start on a block being read (it only reads the page too),
 * but the old location's free waits for those reads (kvt__dfree_t below), so no location is freed
 * under one.
 */
#include "server.h"

#include <stdlib.h>
#define KVT_STEP_PAGES 256 /* pages the policy may act on per loop iteration */

/* A tier location whose free waits for the reads of its block still in flight. */
typedef struct kvt__dfree {
    uint64_t hash, loc;
    uint32_t len;
    uint8_t tier;
    uint8_t discard; /* kvt_tier_discard: a REMOVE's */
} kvt__dfree_t;

/* One page of a move: its copy and the tokens its key borrows. */
typedef struct kvt__mpage {
    kvt_tier_copy_t copy;
    kvt__move_t *move;
    uint64_t start_ns;
    uint32_t *tokens;
} kvt__mpage_t;

/* A run of pages the policy moves from one tier to another. */
struct kvt__move {
    kvt__move_t *prev, *next; /* s->exec.moves, for the teardown */
    kvt_srv_t *srv;
    kvt__req_t *req; /* the PREFETCH it reports to, or NULL */
    kvt_radix_node_t *node;
    uint32_t depth, npages, started, left;
    uint8_t from, to;
    int status;
    kvt__mpage_t pages[];
};

/* Frees a tier location; discard: for good, the block must not come back at a restart either
 * (kvt_tier_discard: a REMOVE's). */
static void free_now(kvt_srv_t *s, uint8_t tier, uint64_t loc, uint32_t len, int discard)
{
    if (!s->tiers[tier])
        return;
    if (discard)
        kvt_tier_discard(s->tiers[tier], loc, len);
    else
        kvt_tier_free(s->tiers[tier], loc, len);
}

/* ---- reads in flight, per block hash (open addressing, backward-shift deletion) ---- */

static size_t busy_slot(uint64_t h, size_t cap)
{
    return (size_t)(h * 0x9E3779B97F4A7C15ull >> 20) & (cap - 1);
}

static uint32_t tab_get(const kvt__busytab_t *t, uint64_t h)
{
    if (!t->cap || !h)
        return 0;
    for (size_t i = busy_slot(h, t->cap);; i = (i + 1) & (t->cap - 1)) {
        if (t->tab[i].hash == h)
            return t->tab[i].count;
        if (!t->tab[i].hash)
            return 0;
    }
}

static int tab_inc(kvt__busytab_t *t, uint64_t h)
{
    if ((t->n + 1) * 2 > t->cap) {
        size_t cap = t->cap ? t->cap * 2 : 1024;
        kvt__busy_t *g = calloc(cap, sizeof *g);
        if (!g)
            return KVT_ENOMEM;
        for (size_t i = 0; i < t->cap; i++) {
            if (!t->tab[i].hash)
                continue;
            size_t j = busy_slot(t->tab[i].hash, cap);
            while (g[j].hash)
                j = (j + 1) & (cap - 1);
            g[j] = t->tab[i];
        }
        free(t->tab);
        t->tab = g;
        t->cap = cap;
    }
    size_t i = busy_slot(h, t->cap);
    while (t->tab[i].hash && t->tab[i].hash != h)
        i = (i + 1) & (t->cap - 1);
    if (!t->tab[i].hash) {
        t->tab[i] = (kvt__busy_t){.hash = h};
        t->n++;
    }
    t->tab[i].count++;
    return 0;
}

/* Drops one read of h; returns 1 when it was h's last in t. */
static int tab_dec(kvt__busytab_t *t, uint64_t h)
{
    if (!t->cap || !h)
        return 0;
    size_t mask = t->cap - 1, i = busy_slot(h, t->cap);
    while (t->tab[i].hash != h) {
        if (!t->tab[i].hash)
            return 0;
        i = (i + 1) & mask;
    }
    if (--t->tab[i].count > 0)
        return 0;
    t->n--;
    for (size_t j = (i + 1) & mask;; j = (j + 1) & mask) {
        t->tab[i] = (kvt__busy_t){0}; /* count too: the next one placed here starts at 0 */
        if (!t->tab[j].hash)
            return 1;
        size_t home = busy_slot(t->tab[j].hash, t->cap);
        /* Move j back into the hole at i unless its home lies cyclically in (i, j]. */
        if ((j > i && (home <= i || home > j)) || (j < i && home <= i && home > j)) {
            t->tab[i] = t->tab[j];
            i = j;
        }
    }
}

void kvt__busy_free(kvt__busytab_t *t)
{
    free(t->tab);
    *t = (kvt__busytab_t){0};
}

/* Every table's reads of h: the write path's and each loop's (under the write lock). */
static uint32_t busy_get(const kvt_srv_t *s, uint64_t h)
{
    uint32_t n = tab_get(&s->exec.busy, h);
    for (unsigned i = 0; s->loops && i < s->nloops; i++)
        n += tab_get(&s->loops[i].busy, h);
    return n;
}

uint32_t kvt__busy_reads(const kvt_srv_t *s, uint64_t h)
{
    return busy_get(s, h);
}

int kvt__busy_inc(kvt_srv_t *s, uint64_t h)
{
    return h ? tab_inc(&s->exec.busy, h) : 0;
}

int kvt__busy_inc_loop(kvt__loop_t *l, uint64_t h)
{
    return h ? tab_inc(&l->busy, h) : 0;
}

/* Under the write lock: the frees that waited for reads of h (0: of any block) and that no read
 * holds any more. */
static void frees_done(kvt_srv_t *s, uint64_t h)
{
    for (size_t k = 0; k < s->exec.ndfree;) {
        kvt__dfree_t *d = &s->exec.dfree[k];
        if ((h && d->hash != h) || busy_get(s, d->hash)) {
            k++;
            continue;
        }
        free_now(s, d->tier, d->loc, d->len, d->discard);
        *d = s->exec.dfree[--s->exec.ndfree];
    }
}

void kvt__busy_dec(kvt_srv_t *s, uint64_t h)
{
    /* The block's last read is done: the old locations a move left behind can go now. */
    if (tab_dec(&s->exec.busy, h))
        frees_done(s, h);
}

void kvt__busy_dec_loop(kvt__loop_t *l, uint64_t h)
{
    kvt_srv_t *s = l->srv;
    if (!tab_dec(&l->busy, h))
        return;
    if (l->held != KVT_HELD_SHARED || kvt__loop_self() != l) {
        frees_done(s, h); /* the write lock: as kvt__busy_dec */
        return;
    }
    /* The shared lock: s->exec.dfree changes only under the write lock, so it may be read, but a
     * free writes the tier's allocator. */
    for (size_t k = 0; k < s->exec.ndfree && !l->frees_due; k++)
        l->frees_due = s->exec.dfree[k].hash == h;
}

void kvt__busy_settle(kvt_srv_t *s)
{
    int due = 0;
    for (unsigned i = 0; s->loops && i < s->nloops; i++) {
        due |= s->loops[i].frees_due;
        s->loops[i].frees_due = 0;
    }
    if (due)
        frees_done(s, 0);
}

/* Frees a tier location now, or once the reads of its block in flight are done (free_now). */
void kvt__free_loc(kvt_srv_t *s, uint8_t tier, uint64_t loc, uint32_t len, uint64_t hash,
                   int discard)
{
    if (!s->tiers[tier])
        return;
    if (busy_get(s, hash) == 0) {
        free_now(s, tier, loc, len, discard);
        return;
    }
    if (kvt_reserve(&s->exec.dfree, &s->exec.cap_dfree, s->exec.ndfree + 1, sizeof *s->exec.dfree,
                    16) < 0) {
        /* Cannot wait: leak the location rather than free it under a read. */
        kvt_log(KVT_LOG_ERROR, "kvtierd: out of memory deferring a %s free",
                kvt_tier_name((kvt_tier_id_t)tier));
        return;
    }
    s->exec.dfree[s->exec.ndfree++] = (kvt__dfree_t){
        .hash = hash, .loc = loc, .len = len, .tier = tier, .discard = (uint8_t)discard};
}

/* ---- the block record: every write of a block's tier, location, size and flags in server/ ---- */

void kvt__block_busy(kvt_block_t *b, int busy)
{
    if (busy)
        b->flags |= KVT_BLOCK_BUSY;
    else
        b->flags &= (uint8_t)~KVT_BLOCK_BUSY;
}

void kvt__block_place(kvt_block_t *b, uint64_t loc, uint32_t size)
{
    b->tier = KVT_TIER_NONE;
    b->loc = loc;
    b->size = size;
}

void kvt__block_relocate(kvt_block_t *b, uint64_t loc)
{
    b->loc = loc;
}

void kvt__block_recovered(kvt_block_t *b, kvt_tier_id_t tier, uint64_t loc, uint32_t size)
{
    b->tier = (uint8_t)tier;
    b->loc = loc;
    b->size = size;
}

void kvt__block_tier(kvt_block_t *b, kvt_tier_id_t tier)
{
    b->tier = (uint8_t)tier;
}

void kvt__block_drop(kvt_block_t *b)
{
    b->tier = KVT_TIER_NONE;
    b->size = 0;
    b->loc = 0;
    b->flags &= (uint8_t)~KVT_BLOCK_DIRTY;
}

/* ---- the policy's executor ---- */

static uint64_t exec_footprint(void *arg, kvt_tier_id_t tier, uint32_t size)
{
    kvt_srv_t *s = arg;
    return s->tiers[tier] ? kvt_tier_footprint(s->tiers[tier], size) : size;
}

static void move_free(kvt_srv_t *s, kvt__move_t *m)
{
    if (m->prev)
        m->prev->next = m->next;
    else
        s->exec.moves = m->next;
    if (m->next)
        m->next->prev = m->prev;
    free(m);
}

/*
 * Whether node n is leased by someone who may be reading its pages: anyone but the policy's
 * moves in flight (each holds one lease on its node's path; m, the move asking, if it has
 * started) and req, the PREFETCH a move is for (its pin keeps the path, it reads nothing). So a
 * MATCH's lease (its holder may read the pages in place, through a location LOCATE gave it) or
 * another request's pin. Walks the moves only when n has more leases than those.
 */
static int leased_by_others(kvt_srv_t *s, kvt_radix_node_t *n, const kvt__move_t *m,
                            const kvt__req_t *req)
{
    uint32_t all = kvt_radix_node_leases(n), d = kvt_radix_node_depth(n);
    uint32_t own = m != NULL;
    own += req && req->lease && kvt_radix_node_holding(req->node, d) == n;
    for (kvt__move_t *mm = s->exec.moves; mm && own < all; mm = mm->next)
        own += mm != m && kvt_radix_node_holding(mm->node, d) == n; /* n is on mm's path */
    return all > own;
}

/* A client may read a page of tier t in place, with nothing the daemon sees: DRAM through its
 * zero-copy mapping of the arena (GET or MATCH with LOCATE), HBM through the pool's IPC handle. */
static int tier_mapped(kvt_tier_id_t t)
{
    return t == KVT_TIER_DRAM || t == KVT_TIER_HBM;
}

/*
 * A move whose writes into its tier failed (not its source: a block the source lost is settled
 * below) pauses the moves into that tier: 100 ms, doubling with each failure in a row up to 2 s,
 * so that a full file system costs a few failed writes a second instead of the policy retrying
 * at every step (tests/faults.py, fullfs), while the policy drops what it cannot demote and new
 * PUTs still find room. The first move that lands there ends the pause.
 */
#define KVT_WRITE_PAUSE_MIN_NS (100ull * 1000 * 1000)
#define KVT_WRITE_PAUSE_MAX_NS (2000ull * 1000 * 1000)

static void write_outcome(kvt_srv_t *s, kvt_tier_id_t to, int status)
{
    kvt__exec_t *e = &s->exec;
    if (status == 0) {
        if (e->write_failures[to])
            kvt_log(KVT_LOG_INFO, "kvtierd: moves into %s resumed", kvt_tier_name(to));
        e->write_failures[to] = 0;
        e->write_paused_until[to] = 0;
        return;
    }
    uint32_t n = e->write_failures[to] < 16 ? ++e->write_failures[to] : 16;
    uint64_t pause = KVT_WRITE_PAUSE_MIN_NS << (n - 1);
    if (pause > KVT_WRITE_PAUSE_MAX_NS)
        pause = KVT_WRITE_PAUSE_MAX_NS;
    e->write_paused_until[to] = kvt_now_ns() + pause;
    if (n == 1)
        kvt_log(KVT_LOG_WARN,
                "kvtierd: a write into %s failed (%s): moves into it pause, up to 2 s at a time, "
                "until one lands",
                kvt_tier_name(to), kvt_strerror(status));
}

/* ---- kept copies: promotions out of DRAM switched under a lease ---- */

/*
 * A lease's holder may read its pages in place in DRAM (tier_mapped) with nothing the daemon
 * sees until its RELEASE. A run such a lease holds is promoted into HBM all the same: the switch
 * gives its blocks their HBM locations, which every lease taken from then on is given, and keeps
 * the old DRAM copy allocated here until no lease taken before the switch runs through the node
 * that held the run's first page (each lease's path includes it): released, expired, or gone
 * with its connection. Refused instead (as moves out of HBM and demotions still are), a prefix
 * leased all the time, a shared system prompt under overlapping engine steps, stayed in DRAM for
 * good, though it is the hottest of all.
 *
 *     switch (seq = next lease number)       step after a lease ended
 *     block: DRAM loc ─> HBM loc             no lease < seq through node?
 *     kept:  {node, seq, old DRAM loc} ────> free the DRAM loc, give the hold back
 *
 * The kept bytes stay in the policy's DRAM accounting (kvt_policy_hold), so that PUTs and
 * demotions into DRAM see the room there really is, and are capped at promote-keep-share of
 * dram-bytes: past it, such a promotion is refused and parked as before. A node the tree frees
 * has no lease left: its kept copies go with it.
 */
typedef struct kvt__kept {
    kvt_radix_node_t *node; /* the node holding the run's first page at the switch */
    uint64_t seq;           /* the leases numbered below it were taken before the switch */
    uint64_t hash, loc;
    uint32_t len; /* the block's size: what kvt_policy_hold charged */
} kvt__kept_t;

static uint64_t dram_footprint(kvt_srv_t *s, uint32_t size)
{
    return exec_footprint(s, KVT_TIER_DRAM, size);
}

/* Whether the run may be switched under a lease, its old copy kept: a promotion out of DRAM
 * whose copy fits under promote-keep-share. */
static int keep_fits(kvt_srv_t *s, kvt_radix_node_t *n, uint32_t depth, uint32_t npages,
                     kvt_tier_id_t from, kvt_tier_id_t to)
{
    if (from != KVT_TIER_DRAM || to != KVT_TIER_HBM || !s->policy)
        return 0;
    uint64_t cap = (uint64_t)(s->conf->promote_keep_share * (double)s->conf->dram_bytes);
    uint64_t bytes = s->exec.kept_bytes;
    for (uint32_t i = 0; i < npages; i++)
        bytes += dram_footprint(s, kvt_radix_block_at(n, depth + i)->size);
    return bytes <= cap;
}

static void kept_metrics(kvt_srv_t *s)
{
    kvt__metric_set(s->metrics, KVT_M_LEASED_PROMO_COPIES, 0, (double)s->exec.nkept);
    kvt__metric_set(s->metrics, KVT_M_LEASED_PROMO_BYTES, 0, (double)s->exec.kept_bytes);
}

/* Block b, just switched to its new location, leaves its old DRAM copy at loc for the leases
 * numbered below seq through node. Room in the list was reserved before the switch. */
static void keep_old(kvt_srv_t *s, kvt_radix_node_t *node, uint64_t seq, const kvt_block_t *b,
                     uint64_t loc)
{
    kvt__exec_t *e = &s->exec;
    /* kvt_policy_move_done has just taken these bytes out of DRAM's accounting: they fit. */
    int rc = kvt_policy_hold(s->policy, KVT_TIER_DRAM, b->size, 0);
    kvt_assert(rc == 0);
    e->kept[e->nkept++] =
        (kvt__kept_t){.node = node, .seq = seq, .hash = b->hash, .loc = loc, .len = b->size};
    e->kept_bytes += dram_footprint(s, b->size);
}

/* Frees kept copy k (after a read of its block in flight, as any old location). */
static void kept_free(kvt_srv_t *s, size_t k)
{
    kvt__exec_t *e = &s->exec;
    kvt__kept_t *x = &e->kept[k];
    kvt__free_loc(s, KVT_TIER_DRAM, x->loc, x->len, x->hash, 0);
    kvt_policy_unhold(s->policy, KVT_TIER_DRAM, x->len);
    e->kept_bytes -= dram_footprint(s, x->len);
    *x = e->kept[--e->nkept];
}

/* The step's part: the kept copies no lease taken before their switch holds any more go. Looked
 * at only once a lease of the tree has ended since the last look; the copies of one run share
 * their node and seq, and are looked up once. That look reads a count on the node (the switch
 * marked it), but for a run whose node was marked again by a later switch: that one walks the
 * tree's leases (kvt_radix_node_leased_before). */
static void kept_settle(kvt_srv_t *s)
{
    kvt__exec_t *e = &s->exec;
    uint64_t releases = kvt_radix_lease_releases(s->radix);
    if (e->nkept == 0 || releases == e->kept_releases)
        return;
    e->kept_releases = releases;
    const kvt_radix_node_t *node = NULL;
    uint64_t seq = 0;
    int held = 0;
    for (size_t k = 0; k < e->nkept;) {
        const kvt__kept_t *x = &e->kept[k];
        if (x->node != node || x->seq != seq) {
            node = x->node;
            seq = x->seq;
            held = kvt_radix_node_leased_before(s->radix, node, seq);
        }
        if (held)
            k++;
        else
            kept_free(s, k);
    }
    kept_metrics(s);
}

/* Node n leaves the tree (nothing leases it): its kept copies go now, before n can be reused. */
static void kept_node_gone(kvt_srv_t *s, const kvt_radix_node_t *n)
{
    size_t before = s->exec.nkept;
    for (size_t k = 0; k < s->exec.nkept;) {
        if (s->exec.kept[k].node == n)
            kept_free(s, k);
        else
            k++;
    }
    if (s->exec.nkept != before)
        kept_metrics(s);
}

/* The last copy of a move has landed (or failed): switch the blocks over, or undo. */
static void move_finish(kvt_srv_t *s, kvt__move_t *m)
{
    for (uint32_t i = 0; i < m->npages; i++) {
        kvt_block_t *b = kvt_radix_block_at(m->node, m->depth + i);
        kvt_assert(b);
        kvt__block_busy(b, 0);
    }
    int status = m->status;
    if (status == 0 && m->started < m->npages)
        status = KVT_EIO; /* a copy did not start: the run stays where it was */
    /* A move whose node was leased while it ran stays where the lease found it (the policy may
     * move it once the lease is gone; a promotion refused so, KVT_EBUSY, it parks until then):
     * - into NVMe: the lease pinned the blocks' NVMe locations it saw (none of these), so the
     *   log's reclaim could drop them under a GET the MATCH promised;
     * - out of DRAM or HBM, down or up: a client may read the leased pages in place (tier_mapped)
     *   with nothing the daemon can see; freeing the old copy at the switch let another block
     *   land there under that read, and the client served that block's bytes (bench_fleet
     *   caught it for demotions: 5 of 12 shared-tier replays, 0 of 12 with this;
     *   server_zc's zero-copy reader tests for promotions into HBM).
     * But for a promotion out of DRAM within promote-keep-share: it switches, and its old copy
     * is kept for the leases taken before the switch ("Kept copies" above). The MATCH that
     * queued a promotion counts among the others: its holder may have been given the pages'
     * DRAM locations (LOCATE), and only its RELEASE says it read them. exec_move refuses such
     * a move at its start already; this catches the leases taken while it ran. */
    int keep = 0;
    if (status == 0 && (m->to == KVT_TIER_NVME || tier_mapped((kvt_tier_id_t)m->from)) &&
        leased_by_others(s, m->node, m, m->req)) {
        keep = keep_fits(s, m->node, m->depth, m->npages, (kvt_tier_id_t)m->from,
                         (kvt_tier_id_t)m->to) &&
               kvt_reserve(&s->exec.kept, &s->exec.cap_kept, s->exec.nkept + m->npages,
                           sizeof *s->exec.kept, 16) == 0;
        if (!keep)
            status = KVT_EBUSY;
    }
    /* Taken before kvt_policy_move_done, which ends the move's own lease: every lease that may
     * have seen the old locations is numbered below seq. The mark lets kept_settle read whether
     * one still holds the run from a count on its node. */
    kvt_radix_node_t *first = kvt_radix_node_holding(m->node, m->depth);
    uint64_t seq = kvt_radix_node_mark(s->radix, keep ? first : NULL);
    int rc = kvt_policy_move_done(s->policy, m->node, m->depth, m->npages, (kvt_tier_id_t)m->from,
                                  (kvt_tier_id_t)m->to, status);
    int ok = status == 0 && rc == 0;
    if (m->status == 0)
        write_outcome(s, (kvt_tier_id_t)m->to, 0);
    else if (m->status != KVT_ENOENT && m->status != KVT_ECORRUPT && m->status != KVT_EBUSY)
        write_outcome(s, (kvt_tier_id_t)m->to, m->status);
    for (uint32_t i = 0; i < m->started; i++) {
        kvt_tier_copy_t *c = &m->pages[i].copy;
        kvt_block_t *b = kvt_radix_block_at(m->node, m->depth + i);
        kvt_tier_pin(s->tiers[m->from], c->src_loc, -1);
        if (ok) {
            uint64_t old = b->loc;
            kvt__block_relocate(b, c->dst_loc);
            /* A read of the old copy may still be in flight (a GET): it keeps it till done. */
            if (keep)
                keep_old(s, first, seq, b, old);
            else
                kvt__free_loc(s, m->from, old, b->size, b->hash, 0);
        } else if (c->status == 0) {
            kvt_tier_free(s->tiers[m->to], c->dst_loc, c->len);
        }
    }
    if (ok) {
        kvt__metric_add(s->metrics, KVT_M_BLOCKS_MOVED, kvt__pair(m->from, m->to), m->npages);
        if (keep) {
            kvt__metric_add(s->metrics, KVT_M_LEASED_PROMOTIONS, 0, 1);
            kept_metrics(s);
        }
        if (m->to == KVT_TIER_NVME)
            kvt__metric_add(s->metrics, KVT_M_NVME_WRITTEN, 0,
                            (double)m->npages * m->pages[0].copy.len);
    } else {
        kvt_log(KVT_LOG_DEBUG, "kvtierd: move of %u pages %s -> %s not done: %s", m->npages,
                kvt_tier_name((kvt_tier_id_t)m->from), kvt_tier_name((kvt_tier_id_t)m->to),
                status < 0 ? kvt_strerror(status) : "the policy kept them");
    }
    /* A source the tier lost by itself (reclaimed, evicted, corrupt): index-only from there, so
     * the policy does not try to move it again. */
    for (uint32_t i = 0; !ok && i < m->started; i++) {
        int cs = m->pages[i].copy.status;
        if (cs == KVT_ENOENT || cs == KVT_ECORRUPT) {
            kvt__store_lost(s, m->node, m->depth + i);
            break;
        }
    }
    s->exec.moves_landed = 1;
    kvt__req_t *r = m->req;
    uint32_t promoted = ok && m->to < m->from ? m->npages : 0;
    if (r) {
        r->pending--;
        if (r->conn)
            r->conn->inflight--;
    }
    move_free(s, m);
    if (r && r->on_move)
        r->on_move(s, r, ok, promoted);
}

static void move_copied(kvt_tier_copy_t *c)
{
    kvt__mpage_t *pg = c->data;
    kvt__move_t *m = pg->move;
    kvt_srv_t *s = m->srv;
    s->inflight--;
    unsigned series = kvt__tier_io(m->to, 1);
    kvt__metric_observe(s->metrics, KVT_M_TIER_IO_SECONDS, series, kvt_now_ns() - pg->start_ns);
    if (c->status < 0) {
        kvt__metric_add(s->metrics, KVT_M_TIER_IO_ERRORS, series, 1);
        if (m->status == 0)
            m->status = c->status;
    }
    if (--m->left == 0)
        move_finish(s, m);
}

static void settle_later(kvt_srv_t *s, kvt_radix_node_t *node, uint32_t depth, uint32_t ns);

/*
 * Whether the run's DRAM pages still hold the bytes their zero-copy COMMIT sealed
 * (zero-copy-checksum): a page a client wrote over since is not copied anywhere (its NVMe or
 * remote copy would carry a valid checksum of the scribbled bytes). The move is refused and the
 * page, with the rest of its node, made index-only by the next step, as a lost block is.
 */
static int move_source_intact(kvt_srv_t *s, kvt_radix_node_t *n, uint32_t depth, uint32_t npages)
{
    if (!s->conf->zc_checksum)
        return 1;
    for (uint32_t i = 0; i < npages; i++) {
        kvt_block_t *b = kvt_radix_block_at(n, depth + i);
        if (kvt_tier_dram_check(s->tiers[KVT_TIER_DRAM], b->loc) == KVT_ECORRUPT) {
            settle_later(s, n, depth + i, kvt_radix_node_ns(n));
            return 0;
        }
    }
    return 1;
}

/*
 * The policy's move: copy pages [depth, depth + npages) of node n from `from` to `to`. Every
 * copy is asynchronous (a tier never completes inside the submitting call), so a move that
 * starts is always KVT_POLICY_PENDING; the engine holds a lease on n meanwhile.
 */
static int exec_move(void *arg, const kvt_policy_cause_t *why, kvt_radix_node_t *n, uint32_t depth,
                     uint32_t npages, kvt_tier_id_t from, kvt_tier_id_t to)
{
    kvt_srv_t *s = arg;
    if (!s->tiers[from] || !s->tiers[to] || s->stopping)
        return KVT_EUNAVAIL;
    if (s->exec.write_paused_until[to] && kvt_now_ns() < s->exec.write_paused_until[to])
        return KVT_ENOSPC; /* its writes are failing: the policy drops instead, or waits */
    for (uint32_t i = 0; i < npages; i++) {
        kvt_block_t *b = kvt_radix_block_at(n, depth + i);
        if (!b || b->tier != from || (b->flags & KVT_BLOCK_BUSY) || !b->size)
            return KVT_EBUSY;
    }
    if (from == KVT_TIER_DRAM && !move_source_intact(s, n, depth, npages))
        return KVT_ECORRUPT;
    /* A reader in place would lose its pages at the switch, which move_finish refuses then
     * (but for a promotion out of DRAM whose old copy it may keep): no copy for nothing.
     * KVT_EBUSY: the policy parks a promotion refused so, and makes it once no lease holds n. */
    if (tier_mapped(from) && leased_by_others(s, n, NULL, why->req) &&
        !keep_fits(s, n, depth, npages, from, to))
        return KVT_EBUSY;
    uint32_t page = kvt_radix_ns_page_size(s->radix, kvt_radix_node_ns(n));
    size_t sz = sizeof(kvt__move_t) + npages * (sizeof(kvt__mpage_t) + page * sizeof(uint32_t));
    kvt__move_t *m = calloc(1, sz);
    if (!m)
        return KVT_ENOMEM;
    uint32_t *tok = (uint32_t *)(void *)&m->pages[npages];
    m->srv = s;
    m->node = n;
    m->depth = depth;
    m->npages = npages;
    m->from = (uint8_t)from;
    m->to = (uint8_t)to;
    int rc = 0;
    for (uint32_t i = 0; i < npages; i++) {
        kvt__mpage_t *pg = &m->pages[i];
        kvt_block_t *b = kvt_radix_block_at(n, depth + i);
        pg->move = m;
        pg->tokens = tok + (size_t)i * page;
        kvt__block_key(s, n, depth + i, pg->tokens, &pg->copy.key);
        pg->copy.src = s->tiers[from];
        pg->copy.dst = s->tiers[to];
        pg->copy.src_loc = b->loc;
        pg->copy.len = b->size;
        pg->copy.dst_device = why->tag; /* HBM: the pool of the client's device, -1 any */
        pg->copy.cb = move_copied;
        pg->copy.data = pg;
        pg->start_ns = kvt_now_ns();
        /* The source stays where it is until the move ends, even after the copy has read it: a
         * MATCH meanwhile reports the block there, and its GET may read it there. */
        if ((rc = kvt_tier_pin(s->tiers[from], b->loc, 1)) < 0)
            break; /* already gone (an NVMe reclaim the index has not seen yet) */
        if ((rc = kvt_tier_copy(&pg->copy)) < 0) {
            kvt_tier_pin(s->tiers[from], b->loc, -1);
            kvt__metric_add(s->metrics, KVT_M_MOVE_FAILURES, to, 1);
            break;
        }
        if (i == 0 && to == KVT_TIER_NVME) /* a window behind a gap going down */
            kvt__nvme_gap_path(s, n, depth, &pg->copy.key);
        kvt__block_busy(b, 1);
        m->started++;
        s->inflight++;
    }
    if (m->started == 0) {
        free(m);
        return rc;
    }
    if (m->started < npages) {
        /* What started finishes, then the move is undone. The pages that did not start are
         * still the move's until then: busy, so that nothing (a tier losing them, a REMOVE)
         * changes them under it. */
        m->status = rc;
        for (uint32_t i = m->started; i < npages; i++)
            kvt__block_busy(kvt_radix_block_at(n, depth + i), 1);
    }
    m->left = m->started;
    m->next = s->exec.moves;
    if (s->exec.moves)
        s->exec.moves->prev = m;
    s->exec.moves = m;
    if (why->req) {
        /* A PREFETCH's promotion, or a demotion that makes room for it: the PREFETCH waits for
         * it (and counts the promoted pages). */
        m->req = why->req;
        m->req->pending++;
        if (m->req->conn)
            m->req->conn->inflight++;
    }
    return KVT_POLICY_PENDING;
}

/* A move's pin may grow the lease table: within index-bytes, as a client's lease (no trim here,
 * inside the policy's step). */
static int exec_index_room(void *arg, uint64_t bytes)
{
    return kvt__index_fits(arg, bytes);
}

/* The policy placed a run's bytes in tier (adopted, or a move landed). */
static void exec_set_tier(void *arg, kvt_radix_node_t *n, uint32_t depth, uint32_t npages,
                          kvt_tier_id_t tier)
{
    (void)arg;
    for (uint32_t i = 0; i < npages; i++)
        kvt__block_tier(kvt_radix_block_at(n, depth + i), tier);
}

/*
 * Whether `tier` can ever hold a page of namespace ns and size bytes: NVMe's records never span
 * segments, so a page larger than a segment less its record's header (nvme-segment-bytes) fails
 * its write with KVT_ETOOBIG however much room is free. The policy passes NVMe by for such pages,
 * demoting them from DRAM to the remote tier (or dropping them where there is none), without
 * asking NVMe's tenant quota (exec_fits) about a page that never enters it.
 */
static int exec_holds(void *arg, kvt_tier_id_t tier, uint32_t ns, uint32_t size)
{
    return kvt__tier_holds(arg, tier, ns, size);
}

/* Every page of the run fits a record of `to`: refused here, before the policy makes room in
 * NVMe, a move that could not start (kvtier_policy_move_failures_total). The policy already
 * passes such tiers by for its demotions (exec_holds); a promotion's target is checked here. */
static int record_fits(kvt_srv_t *s, kvt_radix_node_t *n, uint32_t depth, uint32_t npages,
                       kvt_tier_id_t to)
{
    uint32_t ns = kvt_radix_node_ns(n);
    for (uint32_t i = 0; i < npages; i++) {
        const kvt_block_t *b = kvt_radix_block_at(n, depth + i);
        if (b && !kvt__tier_holds(s, to, ns, b->size))
            return 0;
    }
    return 1;
}

/* The run may go into `to`: its pages fit the tier's records, and its tenant may take it there
 * (tenant-<tier>-bytes; store.c kvt__store_quotas). */
static int exec_fits(void *arg, kvt_radix_node_t *n, uint32_t depth, uint32_t npages,
                     kvt_tier_id_t to)
{
    kvt_srv_t *s = arg;
    const kvt_block_t *b = kvt_radix_block_at(n, depth);
    if (!s->tiers[to] || !b)
        return 1;
    if (!record_fits(s, n, depth, npages, to))
        return 0;
    uint64_t seed = kvt_radix_ns_seed(s->radix, kvt_radix_node_ns(n));
    return kvt_tier_ns_fits(s->tiers[to], seed, b->size, npages);
}

const kvt_policy_ops_t kvt__exec_ops = {
    .set_tier = exec_set_tier,
    .fits = exec_fits,
    .holds = exec_holds,
    .move = exec_move,
    .footprint = exec_footprint,
    .index_room = exec_index_room,
};

void kvt__count_hints(kvt_metrics_t *mt, const kvt_proto_hints_t *w)
{
    if (w->flags & KVT_HINT_PAUSED)
        kvt__metric_add(mt, KVT_M_HINTS, KVT_HINTK_PAUSED, 1);
    if (w->flags & KVT_HINT_FINISHED)
        kvt__metric_add(mt, KVT_M_HINTS, KVT_HINTK_FINISHED, 1);
    if (w->priority)
        kvt__metric_add(mt, KVT_M_HINTS, KVT_HINTK_PRIORITY, 1);
}

void kvt__policy_hint(const kvt_proto_hints_t *w, uint32_t from_page, kvt_policy_hint_t *out)
{
    *out = (kvt_policy_hint_t){
        .priority = w->priority,
        .finished = (w->flags & KVT_HINT_FINISHED) != 0,
        .paused_ms = (w->flags & KVT_HINT_PAUSED) ? KVT_MAX(w->resume_ms, 1u) : 0,
        .from_page = from_page,
    };
}

void kvt__policy_match(kvt_srv_t *s, const kvt_match_t *m, const kvt_proto_hints_t *w, int device)
{
    if (!s->policy || !m->pages)
        return;
    /* Hints name the request's own part of the path: the deepest node's pages. What lies
     * above it is shared with other requests (a split made it a node of its own). */
    kvt_policy_hint_t h;
    int any = w && (w->priority || (w->flags & (KVT_HINT_PAUSED | KVT_HINT_FINISHED)));
    if (any)
        kvt__policy_hint(w, kvt_radix_node_depth(m->node), &h);
    kvt_policy_set_place(s->policy, device); /* the promotions it queues: to its device */
    kvt_policy_on_match(s->policy, m, any ? &h : NULL);
    kvt_policy_set_place(s->policy, -1);
}

uint32_t kvt__policy_adopt(kvt_srv_t *s, kvt_radix_node_t *node, uint32_t from, uint32_t to,
                           kvt_tier_id_t tier, uint32_t prompt_pages, const kvt_policy_hint_t *h)
{
    uint32_t adopted = 0;
    while (from < to) {
        /* The part of [from, to) that lies in one node. */
        kvt_radix_node_t *x = kvt_radix_node_holding(node, from);
        uint32_t end = KVT_MIN(to, kvt_radix_node_depth(x) + kvt_radix_node_pages(x));
        int rc = kvt_policy_adopt(s->policy, x, from, end - from, tier, prompt_pages, h);
        if (rc > 0) {
            adopted += (uint32_t)rc;
        } else {
            kvt_log(KVT_LOG_DEBUG, "kvtierd: policy refused %u pages in %s: %s", end - from,
                    kvt_tier_name(tier), kvt_strerror(rc));
            for (uint32_t p = from; p < end; p++) {
                kvt_block_t *b = kvt_radix_block_at(x, p);
                if (tier != KVT_TIER_REMOTE || b->loc)
                    kvt_tier_free(s->tiers[tier], b->loc, b->size);
                kvt__block_place(b, 0, 0);
            }
        }
        from = end;
    }
    return adopted;
}

int kvt__ghost_seen(const kvt_srv_t *s, uint64_t hash)
{
    return kvt_ghosts_seen(s->exec.ghosts, hash);
}

/* A block's bytes leave the policy's books and their tier. removed: a REMOVE's, discarded for
 * good (no warm restart brings it back) and no drop; otherwise counted as a drop. */
static void block_gone(kvt_srv_t *s, uint32_t ns, kvt_block_t *b, int removed)
{
    if (s->policy)
        kvt_policy_on_free(s->policy, ns, b);
    if (b->tier != KVT_TIER_NONE && s->tiers[b->tier])
        kvt__free_loc(s, b->tier, b->loc, b->size, b->hash, removed);
    if (!removed)
        kvt__metric_add(s->metrics, KVT_M_BLOCKS_DROPPED, b->tier, 1);
}

uint32_t kvt__store_lost(kvt_srv_t *s, kvt_radix_node_t *n, uint32_t depth)
{
    n = kvt_radix_node_holding(n, depth);
    if (!n)
        return 0;
    kvt_block_t *bl = kvt_radix_node_blocks(n);
    uint32_t np = kvt_radix_node_pages(n), ns = kvt_radix_node_ns(n), changed = 0;
    uint32_t i0 = depth - kvt_radix_node_depth(n);
    uint8_t lost_tier = bl[i0].tier;
    for (uint32_t i = i0; i < np; i++)
        if (bl[i].flags & KVT_BLOCK_BUSY)
            return 0;
    for (uint32_t i = i0; i < np; i++) {
        kvt_block_t *b = &bl[i];
        if (b->tier == KVT_TIER_NONE)
            continue;
        /* A reclaimed or evicted one is no longer in its tier (freeing it frees nothing); a
         * corrupt one and the rest are. */
        block_gone(s, ns, b, 0);
        kvt__block_drop(b);
        changed++;
    }
    static kvt_log_limit_t lim; /* an NVMe log under pressure reclaims all the time */
    if (changed)
        kvt_log_limited(&lim, KVT_LOG_INFO,
                        "kvtierd: the %s tier lost the block at page %u (reclaimed, evicted or "
                        "corrupt): %u pages of its node are index-only now",
                        kvt_tier_name((kvt_tier_id_t)lost_tier), depth, changed);
    return changed;
}

/* A lost block a MATCH found, left for the step: its node pinned by an internal lease. */
typedef struct kvt__settle {
    kvt_radix_node_t *node;
    uint32_t depth;
    uint64_t lease;
} kvt__settle_t;

#define KVT_SETTLE_MAX 256 /* queued at most; the next MATCH of the path finds the rest again */

static void settle_later(kvt_srv_t *s, kvt_radix_node_t *node, uint32_t depth, uint32_t ns)
{
    kvt__exec_t *e = &s->exec;
    for (size_t k = 0; k < e->nsettle; k++)
        if (e->settle[k].node == node && e->settle[k].depth == depth)
            return;
    uint64_t lease;
    if (e->nsettle >= KVT_SETTLE_MAX ||
        kvt_reserve(&e->settle, &e->cap_settle, e->nsettle + 1, sizeof *e->settle, 16) < 0 ||
        kvt__pin(s, node, ns, &lease) < 0)
        return;
    e->settle[e->nsettle++] = (kvt__settle_t){.node = node, .depth = depth, .lease = lease};
}

/* The step's part: the lost blocks MATCHes found become index-only (a move that holds one by
 * now settles it itself). */
static void settle_lost(kvt_srv_t *s)
{
    kvt__exec_t *e = &s->exec;
    for (size_t k = 0; k < e->nsettle; k++) {
        kvt__store_lost(s, e->settle[k].node, e->settle[k].depth);
        kvt_radix_release(s->radix, e->settle[k].lease);
    }
    e->nsettle = 0;
}

void kvt__store_check_path(kvt_srv_t *s, const kvt_match_t *m, kvt__lost_t *lost)
{
    kvt_tier_t *t = s->tiers[KVT_TIER_NVME];
    lost->n = 0;
    lost->gone = UINT32_MAX;
    if (!t || !m->pages)
        return;
    if (kvt_tier_dropped(t) == 0)
        return; /* nothing was ever dropped by the tier: every location is good */
    uint64_t seed = kvt_radix_ns_seed(s->radix, m->ns);
    for (kvt_path_run_t r = kvt_path_run_first(m->node, m->node_pages); r.node;
         kvt_path_run_next(&r)) {
        for (uint32_t i = 0; i < r.n; i++) {
            const kvt_block_t *b = &r.blocks[i];
            if (b->tier != KVT_TIER_NVME)
                continue;
            kvt_block_key_t key = {.ns_seed = seed, .hash = b->hash};
            if (kvt_tier_valid(t, b->loc, &key))
                continue;
            /* A busy one on the rest of the node belongs to a move (which fails for it and
             * settles it): from there the path is only not reported stored. The others become
             * index-only with the rest of their node, at the next step. */
            const kvt_block_t *all = kvt_radix_node_blocks(r.node);
            uint32_t np = kvt_radix_node_pages(r.node), d0 = kvt_radix_node_depth(r.node);
            int busy = 0;
            for (uint32_t k = r.depth + i - d0; k < np && !busy; k++)
                busy = (all[k].flags & KVT_BLOCK_BUSY) != 0;
            if (busy || lost->n == KVT_LOST_RUNS) {
                lost->gone = KVT_MIN(lost->gone, r.depth + i);
            } else {
                lost->from[lost->n] = r.depth + i;
                lost->to[lost->n++] = r.depth + r.n;
                settle_later(s, r.node, r.depth + i, m->ns);
            }
            break;
        }
    }
}

void kvt__store_step(kvt_srv_t *s)
{
    settle_lost(s);
    kept_settle(s);
    kvt__index_step(s);
    if (!s->policy || s->stopping)
        return;
    int rc = kvt_policy_step(s->policy, KVT_STEP_PAGES);
    static kvt_log_limit_t lim; /* runs after every batch of events */
    if (rc < 0)
        kvt_log_limited(&lim, KVT_LOG_WARN, "kvtierd: policy step: %s", kvt_strerror(rc));
}

/* The tree's free callbacks: why is the tree's call that freed the block (kvt__store_remove's
 * kvt_radix_remove, an eviction, or kvt__srv_close's kvt_radix_destroy). */
void kvt__store_free_cb(void *arg, uint32_t ns, kvt_block_t *b, kvt_radix_why_t why)
{
    kvt_srv_t *s = arg;
    /* Tearing down, the tiers are destroyed next and free everything themselves. A REMOVE is no
     * drop: no ghost, not counted. */
    if (why == KVT_RADIX_DESTROY)
        return;
    if (why != KVT_RADIX_REMOVE)
        kvt_ghosts_add(s->exec.ghosts, b->hash);
    block_gone(s, ns, b, why == KVT_RADIX_REMOVE);
}

void kvt__store_node_free_cb(void *arg, kvt_radix_node_t *n, kvt_radix_why_t why)
{
    kvt_srv_t *s = arg;
    if (why == KVT_RADIX_DESTROY)
        return;
    kept_node_gone(s, n);
    if (s->policy)
        kvt_policy_on_node_free(s->policy, n);
}

void kvt__exec_close(kvt_srv_t *s)
{
    /* Destroyed tiers run no callbacks: moves still in flight are dropped here. */
    while (s->exec.moves)
        move_free(s, s->exec.moves);
    free(s->exec.settle); /* their leases go with the tree */
    s->exec.settle = NULL;
    s->exec.nsettle = s->exec.cap_settle = 0;
    free(s->exec.kept); /* their DRAM goes with the tier */
    s->exec.kept = NULL;
    s->exec.nkept = s->exec.cap_kept = 0;
    s->exec.kept_bytes = 0;
    free(s->exec.dfree);
    s->exec.dfree = NULL;
    s->exec.ndfree = s->exec.cap_dfree = 0;
    kvt__busy_free(&s->exec.busy);
}

/*
 * The door's removals and promotions (store.h). Their cause travels as an argument all the way
 * down, with no state set around the call: a removal's is the tree's call itself
 * (kvt_radix_remove hands KVT_RADIX_REMOVE to kvt__store_free_cb), a promotion's is the
 * kvt_policy_cause_t the policy hands to exec_move (the request that waits, the device).
 */
int kvt__store_remove(kvt_srv_t *s, uint32_t ns, const uint32_t *tokens, size_t n)
{
    return kvt_radix_remove(s->radix, ns, tokens, n);
}

int kvt__store_promote(kvt_srv_t *s, kvt_radix_node_t *node, uint32_t pages, kvt_tier_id_t target,
                       kvt__req_t *r, int device)
{
    kvt_policy_cause_t why = {.req = r, .tag = device};
    return kvt_policy_promote(s->policy, node, pages, target, &why);
}

/*
 * MAP (op_map.c) at zero-copy-arenas: empties the arena of a namespace no connection maps (the one
 * with the fewest blocks) into the main region. A block whose bytes are in use stays: one a copy
 * reads (BUSY), one a GET's reply is being written from (kvt__busy_reads), one under a lease (a
 * client may hold its location). Returns 0 when the arena went, KVT_ENOSPC when there was none or
 * something stayed.
 */
int kvt__store_free_arena(kvt_srv_t *s)
{
    kvt_tier_t *t = s->tiers[KVT_TIER_DRAM];
    if (!t)
        return KVT_ENOSPC;
    uint64_t seed;
    if (kvt_tier_dram_idle(t, &seed) < 0)
        return KVT_ENOSPC;
    uint32_t before = kvt_tier_dram_shared(t), moved = 0, stayed = 0;
    size_t n = kvt_radix_node_count(s->radix);
    for (size_t i = 0; i < n && kvt_tier_dram_shared(t) == before; i++) {
        kvt_radix_node_t *node = kvt_radix_node_at(s->radix, i);
        if (kvt_radix_ns_seed(s->radix, kvt_radix_node_ns(node)) != seed)
            continue;
        kvt_block_t *b = kvt_radix_node_blocks(node);
        uint32_t np = kvt_radix_node_pages(node), d0 = kvt_radix_node_depth(node);
        int leased = kvt_radix_node_leased(node);
        for (uint32_t j = 0; j < np; j++) {
            uint64_t loc = b[j].loc;
            if (b[j].tier != KVT_TIER_DRAM || kvt_tier_dram_offset(t, seed, loc, NULL) < 0)
                continue;
            if (leased || (b[j].flags & KVT_BLOCK_BUSY) ||
                kvt__busy_reads(s, kvt_radix_block_hash(s->radix, node, d0 + j)) ||
                kvt_tier_dram_move_out(t, &loc) < 0) {
                stayed++;
                continue;
            }
            kvt__block_relocate(&b[j], loc);
            moved++;
        }
    }
    int gone = kvt_tier_dram_shared(t) < before;
    kvt_log(gone ? KVT_LOG_INFO : KVT_LOG_WARN,
            "kvtierd: zero-copy-arenas full: namespace %016llx's arena, mapped by no connection, "
            "%s (%u blocks moved to the main region, %u in use)",
            (unsigned long long)seed, gone ? "gave way" : "could not give way yet", moved, stayed);
    return gone ? 0 : KVT_ENOSPC;
}
