/*
 * store.c: KV bytes in the tiers, as the daemon moves them. It owns the tiers' creation from the
 * configuration (HBM when a GPU is usable, DRAM, NVMe in the data directory with its warm-restart
 * recovery, the remote Valkey/Redis server), the tier policy (policy/) and the executor that
 * carries out its decisions, the radix free callback that gives a leaving block's bytes back to
 * its tier, and the asynchronous paths of a request: PUT (write each new page's payload to the
 * fastest tier that takes it, then hand the blocks to the policy), GET (read a leased path's
 * blocks in bounded batches straight into the reply) and PREFETCH (ask the policy to promote a
 * path up to a tier). All of it runs on the loop: submits never block, completions come back
 * through the tiers' fds.
 *
 * The policy decides, store.c acts
 * --------------------------------
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
 * (kvt_busy_*): a block being read is never moved, so a move never frees a location under a read.
 */
#include "server.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <xxhash.h>

#define KVT_GET_BATCH_BYTES (8u << 20) /* GET reads at most this much ahead of the socket */
#define KVT_STEP_PAGES      256        /* pages the policy may act on per loop iteration */
/* The index is trimmed from above 98% of index-bytes down to 95%, at most KVT_TRIM_PAGES pages
 * per loop iteration; a request that finds it full trims up to KVT_TRIM_INLINE pages itself. */
#define KVT_INDEX_HIGH_PCT 98
#define KVT_INDEX_LOW_PCT  95
#define KVT_TRIM_PAGES     4096
#define KVT_TRIM_INLINE    65536

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
    kvt__move_t *prev, *next; /* s->moves, for the teardown */
    kvt_srv_t *srv;
    kvt__req_t *req; /* the PREFETCH it reports to, or NULL */
    kvt_radix_node_t *node;
    uint32_t depth, npages, started, left;
    uint8_t from, to;
    int status;
    kvt__mpage_t pages[];
};

static void kvt_free_loc(kvt_srv_t *s, uint8_t tier, uint64_t loc, uint32_t len, uint64_t hash,
                         int discard);

/* Frees a tier location; discard: for good, the block must not come back at a restart either
 * (kvt_tier_discard: a REMOVE's). */
static void kvt_free_now(kvt_srv_t *s, uint8_t tier, uint64_t loc, uint32_t len, int discard)
{
    if (!s->tiers[tier])
        return;
    if (discard)
        kvt_tier_discard(s->tiers[tier], loc, len);
    else
        kvt_tier_free(s->tiers[tier], loc, len);
}

/* ---- reads in flight, per block hash (open addressing, backward-shift deletion) ---- */

#define kvt_busy_tab (s->busy)
#define kvt_busy_cap (s->busy_cap)
#define kvt_busy_n   (s->busy_n)

static size_t kvt_busy_slot(uint64_t h, size_t cap)
{
    return (size_t)(h * 0x9E3779B97F4A7C15ull >> 20) & (cap - 1);
}

static uint32_t kvt_busy_get(const kvt_srv_t *s, uint64_t h)
{
    if (!kvt_busy_cap || !h)
        return 0;
    for (size_t i = kvt_busy_slot(h, kvt_busy_cap);; i = (i + 1) & (kvt_busy_cap - 1)) {
        if (kvt_busy_tab[i].hash == h)
            return kvt_busy_tab[i].count;
        if (!kvt_busy_tab[i].hash)
            return 0;
    }
}

static int kvt_busy_inc(kvt_srv_t *s, uint64_t h)
{
    if (!h)
        return 0;
    if ((kvt_busy_n + 1) * 2 > kvt_busy_cap) {
        size_t cap = kvt_busy_cap ? kvt_busy_cap * 2 : 1024;
        kvt__busy_t *t = calloc(cap, sizeof *t);
        if (!t)
            return KVT_ENOMEM;
        for (size_t i = 0; i < kvt_busy_cap; i++) {
            if (!kvt_busy_tab[i].hash)
                continue;
            size_t j = kvt_busy_slot(kvt_busy_tab[i].hash, cap);
            while (t[j].hash)
                j = (j + 1) & (cap - 1);
            t[j] = kvt_busy_tab[i];
        }
        free(kvt_busy_tab);
        kvt_busy_tab = t;
        kvt_busy_cap = cap;
    }
    size_t i = kvt_busy_slot(h, kvt_busy_cap);
    while (kvt_busy_tab[i].hash && kvt_busy_tab[i].hash != h)
        i = (i + 1) & (kvt_busy_cap - 1);
    if (!kvt_busy_tab[i].hash) {
        kvt_busy_tab[i] = (kvt__busy_t){.hash = h};
        kvt_busy_n++;
    }
    kvt_busy_tab[i].count++;
    return 0;
}

static void kvt_busy_dec(kvt_srv_t *s, uint64_t h)
{
    if (!kvt_busy_cap || !h)
        return;
    size_t mask = kvt_busy_cap - 1, i = kvt_busy_slot(h, kvt_busy_cap);
    while (kvt_busy_tab[i].hash != h) {
        if (!kvt_busy_tab[i].hash)
            return;
        i = (i + 1) & mask;
    }
    if (--kvt_busy_tab[i].count > 0)
        return;
    kvt_busy_n--;
    /* The block's last read is done: the old locations a move left behind can go now. */
    for (size_t k = 0; k < s->ndfree;) {
        kvt__dfree_t *d = &s->dfree[k];
        if (d->hash != h) {
            k++;
            continue;
        }
        kvt_free_now(s, d->tier, d->loc, d->len, d->discard);
        *d = s->dfree[--s->ndfree];
    }
    for (size_t j = (i + 1) & mask;; j = (j + 1) & mask) {
        kvt_busy_tab[i] = (kvt__busy_t){0}; /* count too: the next one placed here starts at 0 */
        if (!kvt_busy_tab[j].hash)
            return;
        size_t home = kvt_busy_slot(kvt_busy_tab[j].hash, kvt_busy_cap);
        /* Move j back into the hole at i unless its home lies cyclically in (i, j]. */
        if ((j > i && (home <= i || home > j)) || (j < i && home <= i && home > j)) {
            kvt_busy_tab[i] = kvt_busy_tab[j];
            i = j;
        }
    }
}

/* Frees a tier location now, or once the reads of its block in flight are done (kvt_free_now). */
static void kvt_free_loc(kvt_srv_t *s, uint8_t tier, uint64_t loc, uint32_t len, uint64_t hash,
                         int discard)
{
    if (!s->tiers[tier])
        return;
    if (kvt_busy_get(s, hash) == 0) {
        kvt_free_now(s, tier, loc, len, discard);
        return;
    }
    if (s->ndfree == s->cap_dfree) {
        size_t cap = s->cap_dfree ? 2 * s->cap_dfree : 16;
        kvt__dfree_t *d = realloc(s->dfree, cap * sizeof *d);
        if (!d) {
            /* Cannot wait: leak the location rather than free it under a read. */
            kvt_log(KVT_LOG_ERROR, "kvtierd: out of memory deferring a %s free",
                    kvt_tier_name((kvt_tier_id_t)tier));
            return;
        }
        s->dfree = d;
        s->cap_dfree = cap;
    }
    s->dfree[s->ndfree++] = (kvt__dfree_t){
        .hash = hash, .loc = loc, .len = len, .tier = tier, .discard = (uint8_t)discard};
}

/* ---- the policy's executor ---- */

static uint64_t kvt_exec_footprint(void *arg, kvt_tier_id_t tier, uint32_t size)
{
    kvt_srv_t *s = arg;
    return s->tiers[tier] ? kvt_tier_footprint(s->tiers[tier], size) : size;
}

static void kvt_move_free(kvt_srv_t *s, kvt__move_t *m)
{
    if (m->prev)
        m->prev->next = m->next;
    else
        s->moves = m->next;
    if (m->next)
        m->next->prev = m->prev;
    free(m);
}

static void kvt_prefetch_moved(kvt_srv_t *s, kvt__req_t *r);

/*
 * Whether node n is leased by someone other than the policy's moves in flight (each holds one
 * lease on its node's path): a MATCH's lease, or a request's pin. Walks the moves only when n has
 * more leases than the one of the move asking.
 */
static int kvt_leased_by_others(kvt_srv_t *s, kvt_radix_node_t *n)
{
    uint32_t all = kvt_radix_node_leases(n), own = 0;
    if (all <= 1)
        return 0;
    uint32_t d = kvt_radix_node_depth(n);
    for (kvt__move_t *mm = s->moves; mm && own < all; mm = mm->next)
        own += kvt_radix_node_holding(mm->node, d) == n; /* n is on mm's path */
    return all > own;
}

/* The last copy of a move has landed (or failed): switch the blocks over, or undo. */
static void kvt_move_finish(kvt_srv_t *s, kvt__move_t *m)
{
    for (uint32_t i = 0; i < m->npages; i++) {
        kvt_block_t *b = kvt_radix_block_at(m->node, m->depth + i);
        kvt_assert(b);
        b->flags &= (uint8_t)~KVT_BLOCK_BUSY;
    }
    int status = m->status;
    if (status == 0 && m->started < m->npages)
        status = KVT_EIO; /* a copy did not start: the run stays where it was */
    /* A demotion into NVMe whose node was leased while it ran: the lease pinned the blocks'
     * NVMe locations it saw (none of these), so the log's reclaim could drop them under a GET
     * the MATCH promised. The run stays where the lease found it; the policy may move it once
     * the lease is gone. */
    if (status == 0 && m->to == KVT_TIER_NVME && kvt_leased_by_others(s, m->node))
        status = KVT_EBUSY;
    int rc = kvt_policy_move_done(s->policy, m->node, m->depth, m->npages, (kvt_tier_id_t)m->from,
                                  (kvt_tier_id_t)m->to, status);
    int ok = status == 0 && rc == 0;
    for (uint32_t i = 0; i < m->started; i++) {
        kvt_tier_copy_t *c = &m->pages[i].copy;
        kvt_block_t *b = kvt_radix_block_at(m->node, m->depth + i);
        kvt_tier_pin(s->tiers[m->from], c->src_loc, -1);
        if (ok) {
            uint64_t old = b->loc;
            b->loc = c->dst_loc;
            /* A read of the old copy may still be in flight (a GET): it keeps it till done. */
            kvt_free_loc(s, m->from, old, b->size, b->hash, 0);
        } else if (c->status == 0) {
            kvt_tier_free(s->tiers[m->to], c->dst_loc, c->len);
        }
    }
    if (ok) {
        kvt__metric_add(s->metrics, KVT_M_BLOCKS_MOVED, kvt__pair(m->from, m->to), m->npages);
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
    s->moves_landed = 1;
    kvt__req_t *r = m->req;
    if (r) {
        if (ok && m->to < m->from)
            r->moved += m->npages;
        if (ok)
            r->progress = 1;
        r->pending--;
        if (r->conn)
            r->conn->inflight--;
    }
    kvt_move_free(s, m);
    if (r)
        kvt_prefetch_moved(s, r);
}

static void kvt_move_copied(kvt_tier_copy_t *c)
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
        kvt_move_finish(s, m);
}

/*
 * The policy's move: copy pages [depth, depth + npages) of node n from `from` to `to`. Every
 * copy is asynchronous (a tier never completes inside the submitting call), so a move that
 * starts is always KVT_POLICY_PENDING; the engine holds a lease on n meanwhile.
 */
static int kvt_exec_move(void *arg, kvt_radix_node_t *n, uint32_t depth, uint32_t npages,
                         kvt_tier_id_t from, kvt_tier_id_t to)
{
    kvt_srv_t *s = arg;
    if (!s->tiers[from] || !s->tiers[to] || s->stopping)
        return KVT_EUNAVAIL;
    for (uint32_t i = 0; i < npages; i++) {
        kvt_block_t *b = kvt_radix_block_at(n, depth + i);
        if (!b || b->tier != from || (b->flags & KVT_BLOCK_BUSY) || !b->size)
            return KVT_EBUSY;
    }
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
        pg->copy.cb = kvt_move_copied;
        pg->copy.data = pg;
        pg->start_ns = kvt_now_ns();
        /* The source stays where it is until the move ends, even after the copy has read it: a
         * MATCH meanwhile reports the block there, and its GET may read it there. */
        if ((rc = kvt_tier_pin(s->tiers[from], b->loc, 1)) < 0)
            break; /* already gone (an NVMe reclaim the index has not seen yet) */
        if ((rc = kvt_tier_copy(&pg->copy)) < 0) {
            kvt_tier_pin(s->tiers[from], b->loc, -1);
            break;
        }
        b->flags |= KVT_BLOCK_BUSY;
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
            kvt_radix_block_at(n, depth + i)->flags |= KVT_BLOCK_BUSY;
    }
    m->left = m->started;
    m->next = s->moves;
    if (s->moves)
        s->moves->prev = m;
    s->moves = m;
    if (s->move_req) {
        /* A PREFETCH's promotion, or a demotion that makes room for it: the PREFETCH waits for
         * it (and counts the promoted pages). */
        m->req = s->move_req;
        m->req->pending++;
        if (m->req->conn)
            m->req->conn->inflight++;
    }
    return KVT_POLICY_PENDING;
}

/* A move's pin may grow the lease table: within index-bytes, as a client's lease (no trim here,
 * inside the policy's step). */
static int kvt_exec_index_room(void *arg, uint64_t bytes)
{
    return kvt__index_fits(arg, bytes);
}

static const kvt_policy_ops_t kvt_exec_ops = {
    .move = kvt_exec_move,
    .footprint = kvt_exec_footprint,
    .index_room = kvt_exec_index_room,
};

void kvt__policy_hint(const kvt_proto_hints_t *w, uint32_t from_page, kvt_policy_hint_t *out)
{
    *out = (kvt_policy_hint_t){
        .priority = w->priority,
        .finished = (w->flags & KVT_HINT_FINISHED) != 0,
        .paused_ms = (w->flags & KVT_HINT_PAUSED) ? KVT_MAX(w->resume_ms, 1u) : 0,
        .from_page = from_page,
    };
}

void kvt__policy_match(kvt_srv_t *s, const kvt_match_t *m, const kvt_proto_hints_t *w)
{
    if (!s->policy || !m->pages)
        return;
    /* Hints name the request's own part of the path: the deepest node's pages. What lies
     * above it is shared with other requests (a split made it a node of its own). */
    kvt_policy_hint_t h;
    int any = w && (w->priority || (w->flags & (KVT_HINT_PAUSED | KVT_HINT_FINISHED)));
    if (any)
        kvt__policy_hint(w, kvt_radix_node_depth(m->node), &h);
    kvt_policy_on_match(s->policy, m, any ? &h : NULL);
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
                b->loc = 0;
                b->size = 0;
            }
        }
        from = end;
    }
    return adopted;
}

static uint64_t kvt_index_bytes(const kvt_srv_t *s)
{
    kvt_radix_stats_t rs;
    kvt_radix_stats(s->radix, &rs);
    return rs.bytes;
}

static int kvt_trim_evict(void *arg, kvt_radix_node_t *n, uint32_t npages)
{
    kvt_srv_t *s = arg;
    int rc = kvt_radix_evict(s->radix, n, npages);
    return rc < 0 ? rc : (int)npages;
}

uint32_t kvt__index_trim(kvt_srv_t *s, uint64_t target, uint32_t budget)
{
    if (s->policy) {
        uint32_t n = kvt_policy_trim_index(s->policy, target, budget);
        if (n >= budget || kvt_index_bytes(s) <= target)
            return n;
        /* Index-only pages were not enough: pages with bytes go too, oldest first, rather than
         * every new page being refused for good (index-bytes too small for what the tiers hold,
         * or lowered across a warm restart). */
        uint32_t d = kvt_policy_trim_index_bytes(s->policy, target, budget - n);
        if (d > 0) {
            static kvt_log_limit_t lim;
            kvt_log_limited(&lim, KVT_LOG_WARN,
                            "kvtierd: index-bytes (%llu) is full of pages that hold bytes: "
                            "dropped the %u least recently used; the tiers hold more than the "
                            "index may (raise index-bytes to keep them)",
                            (unsigned long long)s->conf->index_bytes, d);
        }
        return n + d;
    }
    /* No tier, so no policy: every page is index-only and nothing else tracks the nodes. */
    return kvt_radix_trim(s->radix, target, budget, kvt_radix_index_only, kvt_trim_evict, s);
}

int kvt__index_fits(const kvt_srv_t *s, uint64_t need)
{
    uint64_t cap = s->conf->index_bytes;
    return !cap || !need || (need <= cap && kvt_index_bytes(s) <= cap - need);
}

int kvt__index_fit(kvt_srv_t *s, uint64_t need)
{
    uint64_t cap = s->conf->index_bytes;
    if (kvt__index_fits(s, need))
        return 0;
    if (need > cap)
        return KVT_ENOSPC;
    kvt__index_trim(s, KVT_MIN(cap / 100 * KVT_INDEX_LOW_PCT, cap - need), KVT_TRIM_INLINE);
    return kvt__index_fits(s, need) ? 0 : KVT_ENOSPC;
}

int kvt__index_room(kvt_srv_t *s, uint32_t ns, const uint32_t *tokens, size_t ntokens, int pin,
                    kvt_match_t *at)
{
    if (at)
        at->ns = UINT32_MAX; /* no walk yet */
    if (!s->conf->index_bytes)
        return 0;
    /* Admitted only when the insert's worst case fits: the index never passes index-bytes. The
     * tree-wide bound first (no walk); near the cap, what this insert can add to the tree as it
     * is (a walk), which does not reserve room for the largest child table's growth when this
     * insert cannot grow it. A pin is a lease, which may grow the lease table. */
    uint64_t lease = pin ? kvt_radix_lease_need(s->radix) : 0;
    if (kvt__index_fits(s, kvt_radix_insert_bound(s->radix, ns, ntokens) + lease))
        return 0;
    uint64_t need = kvt_radix_insert_need(s->radix, ns, tokens, ntokens, at) + lease;
    if (kvt__index_fits(s, need))
        return 0;
    if (kvt__index_fit(s, need) < 0) /* trims */
        return KVT_ENOSPC;
    /* The trim changed the tree, and with it what the insert adds. */
    need = kvt_radix_insert_need(s->radix, ns, tokens, ntokens, at) + lease;
    return kvt__index_fits(s, need) ? 0 : KVT_ENOSPC;
}

/*
 * A client that makes up a namespace per request (a salt each time) and leaves one page in each
 * fills max-namespaces with namespaces that are neither empty nor used, which kvt__ns_reclaim
 * cannot close and index-bytes never evicts (their pages are few): every new tenant would then be
 * refused for good, long after that client left. So a new namespace frees one as index-bytes
 * pressure frees pages: the namespace whose pages are worth least goes, here the one holding the
 * fewest (freeing a namespace costs all of its pages), then the one unused longest. A namespace a
 * connection has declared, a request names or a connection's lease holds is never chosen. The
 * KVT_NS_EVICT_TRIES cheapest are tried: one fails only while the policy is moving a block of it.
 */
#define KVT_NS_EVICT_TRIES 16

typedef struct kvt_ns_victim {
    uint64_t blocks, idle_ns;
    uint32_t id;
} kvt_ns_victim_t;

static int kvt_ns_victim_before(const kvt_ns_victim_t *a, const kvt_ns_victim_t *b)
{
    return a->blocks != b->blocks ? a->blocks < b->blocks : a->idle_ns < b->idle_ns;
}

int kvt__ns_evict(kvt_srv_t *s)
{
    kvt_ns_victim_t best[KVT_NS_EVICT_TRIES];
    uint32_t n = 0;
    /* One pass over the ids keeps the cheapest few, in order (an insertion into a short list). */
    for (uint32_t id = 0; id < KVT_RADIX_NS_MAX; id++) {
        if (!kvt_radix_ns_page_size(s->radix, id))
            continue;
        kvt_ns_victim_t v = {.blocks = kvt_radix_ns_blocks(s->radix, id), .id = id};
        if (id < s->nns) {
            if (s->ns[id].users || s->ns[id].leases)
                continue;
            v.idle_ns = s->ns[id].idle_ns;
        }
        if (n == KVT_NS_EVICT_TRIES && !kvt_ns_victim_before(&v, &best[n - 1]))
            continue;
        uint32_t i = n < KVT_NS_EVICT_TRIES ? n++ : n - 1;
        for (; i > 0 && kvt_ns_victim_before(&v, &best[i - 1]); i--)
            best[i] = best[i - 1];
        best[i] = v;
    }
    for (uint32_t i = 0; i < n; i++) {
        uint32_t id = best[i].id;
        if (kvt_radix_ns_clear(s->radix, id) < 0) /* KVT_EBUSY: a move holds a block of it */
            continue;
        kvt_policy_forget_ns(s->policy, id);
        if (kvt_radix_ns_close(s->radix, id) < 0)
            continue; /* cannot be: it is empty now */
        if (id < s->nns)
            s->ns[id] = (kvt__ns_t){0};
        kvt__metric_add(s->metrics, KVT_M_NAMESPACES_EVICTED, 0, 1);
        static kvt_log_limit_t lim; /* a HELLO flood of new namespaces would repeat it */
        kvt_log_limited(&lim, KVT_LOG_INFO,
                        "kvtierd: max-namespaces (%u) are open and none is empty: evicted the %llu "
                        "pages of an unused one for a new one",
                        s->conf->max_namespaces, (unsigned long long)best[i].blocks);
        return 1;
    }
    return 0;
}

void kvt__store_step(kvt_srv_t *s)
{
    uint64_t cap = s->conf->index_bytes;
    if (cap && !s->stopping && kvt_index_bytes(s) > cap / 100 * KVT_INDEX_HIGH_PCT)
        kvt__index_trim(s, cap / 100 * KVT_INDEX_LOW_PCT, KVT_TRIM_PAGES);
    if (!s->policy || s->stopping)
        return;
    int rc = kvt_policy_step(s->policy, KVT_STEP_PAGES);
    static kvt_log_limit_t lim; /* runs after every batch of events */
    if (rc < 0)
        kvt_log_limited(&lim, KVT_LOG_WARN, "kvtierd: policy step: %s", kvt_strerror(rc));
}

/* The NVMe blocks recovery put back into the tree join the policy's accounting. */
static void kvt_adopt_recovered(kvt_srv_t *s)
{
    size_t n = kvt_radix_node_count(s->radix), refused = 0;
    for (size_t i = 0; i < n; i++) {
        kvt_radix_node_t *node = kvt_radix_node_at(s->radix, i);
        kvt_block_t *b = kvt_radix_node_blocks(node);
        uint32_t np = kvt_radix_node_pages(node), d0 = kvt_radix_node_depth(node);
        for (uint32_t j = 0; j < np;) {
            uint8_t t = b[j].tier;
            uint32_t k = j;
            while (k < np && b[k].tier == t)
                k++;
            if (t != KVT_TIER_NONE) {
                for (uint32_t q = j; q < k; q++)
                    b[q].tier = KVT_TIER_NONE;
                uint32_t got =
                    kvt__policy_adopt(s, node, d0 + j, d0 + k, (kvt_tier_id_t)t, 0, NULL);
                refused += (k - j) - got;
                b = kvt_radix_node_blocks(node);
            }
            j = k;
        }
    }
    if (refused)
        kvt_log(KVT_LOG_WARN,
                "kvtierd: %zu recovered blocks did not fit the policy's accounting "
                "and were freed",
                refused);
}

static int kvt_policy_open(kvt_srv_t *s)
{
    kvt_srv_conf_t *c = s->conf;
    kvt_policy_conf_t pc = {.ops = &kvt_exec_ops,
                            .ops_arg = s,
                            .nvme_min_hits = c->nvme_min_hits,
                            .reports_node_frees = 1};
    if (kvt_policy_kind_parse(c->policy, &pc.kind) < 0 ||
        kvt_model_profile_get(c->policy_model, &pc.model) < 0 ||
        kvt_hw_profile_get(c->policy_hw, &pc.hw) < 0)
        return KVT_EINVAL; /* kvt__conf_finish checked them: not reached */
    for (int i = 1; i < KVT_TIER_COUNT; i++) {
        if (!s->tiers[i])
            continue;
        kvt_tier_usage_t u;
        kvt_tier_usage(s->tiers[i], &u);
        pc.tiers[i] = (kvt_policy_tier_conf_t){.capacity = u.capacity_bytes,
                                               .high = (float)c->policy_high,
                                               .low = (float)c->policy_low};
    }
    int rc = kvt_policy_create(&s->policy, s->radix, &pc);
    if (rc < 0) {
        kvt_log(KVT_LOG_ERROR, "kvtierd: policy %s: %s", c->policy, kvt_strerror(rc));
        return rc;
    }
    kvt_adopt_recovered(s);
    kvt_log(KVT_LOG_INFO,
            "kvtierd: policy %s (%s on %s): tiers above %.0f%% of capacity are brought down to "
            "%.0f%% by demoting or dropping their lowest-value blocks",
            c->policy, c->policy_model, c->policy_hw, c->policy_high * 100, c->policy_low * 100);
    return 0;
}

/* ---- tiers ---- */

static const kvt_tier_id_t kvt_order[] = {KVT_TIER_HBM, KVT_TIER_DRAM, KVT_TIER_NVME,
                                          KVT_TIER_REMOTE};

static void kvt_recovered_sizes(kvt_srv_t *s)
{
    size_t n = kvt_radix_node_count(s->radix);
    for (size_t i = 0; i < n; i++) {
        kvt_radix_node_t *node = kvt_radix_node_at(s->radix, i);
        kvt_block_t *b = kvt_radix_node_blocks(node);
        uint32_t ns = kvt_radix_node_ns(node);
        kvt__ns_t *e;
        if (b->size && kvt__ns_get(s, ns, &e) == 0 && !e->block_bytes) {
            e->block_bytes = b->size;
            e->page_size = kvt_radix_ns_page_size(s->radix, ns);
            e->seed = kvt_radix_ns_seed(s->radix, ns);
        }
    }
}

int kvt__store_open(kvt_srv_t *s)
{
    kvt_srv_conf_t *c = s->conf;
    int rc;
    if (c->hbm_bytes) {
        kvt_tier_hbm_conf_t hc = {.backend = c->hbm_backend,
                                  .capacity_bytes = c->hbm_bytes,
                                  .device = c->hbm_device,
                                  .batch = c->hbm_batch};
        rc = kvt_tier_hbm_create(&s->tiers[KVT_TIER_HBM], &hc);
        if (rc == KVT_EUNAVAIL && !strcmp(c->hbm_backend, "auto")) {
            kvt_log(KVT_LOG_INFO, "kvtierd: HBM tier unavailable (no usable GPU): continuing "
                                  "with DRAM and below");
            s->tiers[KVT_TIER_HBM] = NULL;
        } else if (rc < 0) {
            kvt_log(KVT_LOG_ERROR, "kvtierd: HBM tier (%s backend): %s", c->hbm_backend,
                    kvt_strerror(rc));
            return rc;
        }
    }
    if (c->dram_bytes) {
        kvt_tier_dram_conf_t dc = {.capacity_bytes = c->dram_bytes};
        if ((rc = kvt_tier_dram_create(&s->tiers[KVT_TIER_DRAM], &dc)) < 0) {
            kvt_log(KVT_LOG_ERROR, "kvtierd: DRAM tier of %llu bytes: %s",
                    (unsigned long long)c->dram_bytes, kvt_strerror(rc));
            return rc;
        }
    }
#if KVT_HAVE_NVME
    if (c->nvme_bytes) {
        if (mkdir(c->data_dir, 0700) < 0 && errno != EEXIST) {
            rc = -errno;
            kvt_log(KVT_LOG_ERROR, "kvtierd: data-dir %s: %s", c->data_dir, kvt_strerror(rc));
            return rc;
        }
        kvt_tier_nvme_conf_t nc = {.dir = c->data_dir,
                                   .capacity_bytes = c->nvme_bytes,
                                   .segment_bytes = (uint32_t)c->nvme_segment_bytes,
                                   .sparse = c->nvme_sparse};
        if ((rc = kvt_tier_nvme_create(&s->tiers[KVT_TIER_NVME], &nc)) < 0) {
            /* The tier names what it found wrong on disk; the settings can only be short. */
            uint64_t segb = c->nvme_segment_bytes ? c->nvme_segment_bytes : 64u << 20;
            kvt_log(KVT_LOG_ERROR, "kvtierd: NVMe tier in %s: %s%s", c->data_dir, kvt_strerror(rc),
                    rc == KVT_EINVAL && c->nvme_bytes / segb < 2
                        ? " (nvme-bytes must hold at least 2 segments of "
                          "nvme-segment-bytes, 64M by default)"
                        : "");
            return rc;
        }
        if (c->nvme_recover) {
            kvt_tier_nvme_recovery_t rec;
            rc = kvt_tier_nvme_recover(s->tiers[KVT_TIER_NVME], s->radix, &rec);
            if (rc < 0) {
                kvt_log(KVT_LOG_ERROR, "kvtierd: NVMe recovery: %s", kvt_strerror(rc));
                return rc;
            }
            kvt_recovered_sizes(s);
            kvt_metrics_t *m = s->metrics;
            kvt__metric_set(m, KVT_M_NVME_RECOVERY, KVT_RECOVERY_INSERTED, (double)rec.inserted);
            kvt__metric_set(m, KVT_M_NVME_RECOVERY, KVT_RECOVERY_TORN, (double)rec.torn);
            kvt__metric_set(m, KVT_M_NVME_RECOVERY, KVT_RECOVERY_STALE, (double)rec.stale);
            kvt__metric_set(m, KVT_M_NVME_RECOVERY, KVT_RECOVERY_ORPHAN, (double)rec.orphans);
            kvt__metric_set(m, KVT_M_NVME_RECOVERY, KVT_RECOVERY_DISCARDED, (double)rec.discarded);
            kvt__metric_set(m, KVT_M_NVME_RECOVERY_GAPS, 0, (double)rec.gaps);
            kvt_log(KVT_LOG_INFO,
                    "kvtierd: NVMe recovery: %llu blocks back in the index (%llu scanned, %llu "
                    "torn, %llu stale, %llu gaps, %llu orphans, %llu removed)",
                    (unsigned long long)rec.inserted, (unsigned long long)rec.scanned,
                    (unsigned long long)rec.torn, (unsigned long long)rec.stale,
                    (unsigned long long)rec.gaps, (unsigned long long)rec.orphans,
                    (unsigned long long)rec.discarded);
        } else {
            /* Left in the tier, they would hold its capacity with nothing naming them. */
            long dropped = kvt_tier_nvme_drop_recovered(s->tiers[KVT_TIER_NVME]);
            if (dropped > 0)
                kvt_log(KVT_LOG_INFO,
                        "kvtierd: nvme-recover is off: the %ld blocks found in %s were dropped",
                        dropped, c->data_dir);
        }
    }
#else
    if (c->nvme_bytes)
        kvt_log(KVT_LOG_WARN, "kvtierd: this build has no NVMe tier: nvme-bytes ignored");
#endif
#if KVT_HAVE_REMOTE
    if (*c->remote) {
        char host[256];
        uint16_t port;
        if (kvt_tier_remote_parse_addr(c->remote, host, sizeof host, &port) < 0) {
            kvt_log(KVT_LOG_ERROR, "kvtierd: bad remote address '%s'", c->remote);
            return KVT_EINVAL;
        }
        kvt_tier_remote_conf_t rcf = {.host = host,
                                      .port = port,
                                      .key_prefix = c->remote_prefix,
                                      .capacity_bytes = c->remote_bytes,
                                      .password = *c->remote_password ? c->remote_password : NULL,
                                      .db = c->remote_db,
                                      .ttl_s = c->remote_ttl_s,
                                      .timeout_ms = c->remote_timeout_ms,
                                      .keep_on_free = 1};
        if ((rc = kvt_tier_remote_create(&s->tiers[KVT_TIER_REMOTE], &rcf)) < 0) {
            kvt_log(KVT_LOG_ERROR, "kvtierd: remote tier %s: %s", c->remote, kvt_strerror(rc));
            return rc;
        }
    }
#else
    if (*c->remote) {
        kvt_log(KVT_LOG_ERROR, "kvtierd: this build has no remote tier");
        return KVT_EUNAVAIL;
    }
#endif
    int any = 0;
    for (int i = 1; i < KVT_TIER_COUNT; i++) {
        if (!s->tiers[i])
            continue;
        kvt_tier_usage_t u;
        kvt_tier_usage(s->tiers[i], &u);
        kvt_log(KVT_LOG_INFO, "kvtierd: %s tier: %llu bytes (%s)", kvt_tier_name((kvt_tier_id_t)i),
                (unsigned long long)u.capacity_bytes, kvt_tier_backend(s->tiers[i]));
        any = 1;
    }
    if (!any) {
        /* Every tier disabled: an index-only sidecar. PUT payloads are kept as index-only pages
         * (counted as skipped); there is nothing for a policy to place. */
        kvt_log(KVT_LOG_INFO, "kvtierd: no tier configured: the index only, no KV bytes kept");
        return 0;
    }
    return kvt_policy_open(s);
}

void kvt__store_close(kvt_srv_t *s)
{
    for (int i = 0; i < KVT_TIER_COUNT; i++) {
        kvt_tier_destroy(s->tiers[i]);
        s->tiers[i] = NULL;
    }
    /* Destroyed tiers run no callbacks: moves still in flight are dropped here. */
    while (s->moves)
        kvt_move_free(s, s->moves);
    kvt_policy_destroy(s->policy);
    s->policy = NULL;
    free(s->dfree);
    s->dfree = NULL;
    s->ndfree = s->cap_dfree = 0;
    free(s->busy);
    s->busy = NULL;
    s->busy_cap = s->busy_n = 0;
}

int kvt__ghost_seen(const kvt_srv_t *s, uint64_t hash)
{
    return hash && s->ghosts[hash & (s->nghosts - 1)] == hash;
}

/* A block's bytes leave the policy's books and their tier; dropped: count it as a drop. */
static void kvt_block_gone(kvt_srv_t *s, uint32_t ns, kvt_block_t *b, int dropped)
{
    if (s->policy)
        kvt_policy_on_free(s->policy, ns, b);
    if (b->tier != KVT_TIER_NONE && s->tiers[b->tier])
        kvt_free_loc(s, b->tier, b->loc, b->size, b->hash, s->removing);
    if (dropped)
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
        kvt_block_gone(s, ns, b, 1);
        b->tier = KVT_TIER_NONE;
        b->size = 0;
        b->loc = 0;
        b->flags &= (uint8_t)~KVT_BLOCK_DIRTY;
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

uint32_t kvt__store_check_path(kvt_srv_t *s, const kvt_match_t *m)
{
    kvt_tier_t *t = s->tiers[KVT_TIER_NVME];
    uint32_t gone = UINT32_MAX;
    if (!t || !m->pages)
        return gone;
    kvt_tier_usage_t u;
    kvt_tier_usage(t, &u);
    if (u.reclaimed == 0 && u.corrupt == 0)
        return gone; /* nothing was ever dropped by the tier: every location is good */
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
            /* A busy one belongs to a move (which fails for it and settles it): it is only not
             * reported stored. The others become index-only, with the rest of their node. */
            if ((b->flags & KVT_BLOCK_BUSY) || kvt__store_lost(s, r.node, r.depth + i) == 0)
                gone = KVT_MIN(gone, r.depth + i);
            break;
        }
    }
    return gone;
}

void kvt__store_free_cb(void *arg, uint32_t ns, kvt_block_t *b)
{
    kvt_srv_t *s = arg;
    /* Tearing down, the tiers are destroyed next and free everything themselves. A REMOVE is no
     * drop: no ghost, not counted. */
    if (s->tearing_down)
        return;
    if (!s->removing)
        s->ghosts[b->hash & (s->nghosts - 1)] = b->hash;
    kvt_block_gone(s, ns, b, !s->removing);
}

void kvt__store_node_free_cb(void *arg, kvt_radix_node_t *n)
{
    kvt_srv_t *s = arg;
    if (!s->tearing_down && s->policy)
        kvt_policy_on_node_free(s->policy, n);
}

void kvt__tier_metrics(kvt_srv_t *s)
{
    for (int i = 1; i < KVT_TIER_COUNT; i++) {
        if (!s->tiers[i])
            continue;
        kvt_tier_usage_t u;
        kvt_tier_usage(s->tiers[i], &u);
        kvt__metric_set(s->metrics, KVT_M_TIER_USED, (unsigned)i, (double)u.used_bytes);
        kvt__metric_set(s->metrics, KVT_M_TIER_CAPACITY, (unsigned)i, (double)u.capacity_bytes);
        kvt__metric_set(s->metrics, KVT_M_TIER_BLOCKS, (unsigned)i, (double)u.blocks);
        kvt__metric_set(s->metrics, KVT_M_TIER_LOST, (unsigned)i, (double)u.reclaimed);
    }
    kvt_tier_hbm_stats_t hs;
    if (s->tiers[KVT_TIER_HBM] && kvt_tier_hbm_stats(s->tiers[KVT_TIER_HBM], &hs) == 0) {
        kvt__metric_set(s->metrics, KVT_M_HBM_BATCHES, 0, (double)hs.batches);
        kvt__metric_set(s->metrics, KVT_M_HBM_COPIES, 0, (double)hs.copies);
    }
    kvt_radix_stats_t rs;
    kvt_radix_stats(s->radix, &rs);
    kvt__metric_set(s->metrics, KVT_M_INDEX_BLOCKS, 0, (double)rs.blocks);
    kvt__metric_set(s->metrics, KVT_M_INDEX_BYTES, 0, (double)rs.bytes);
    kvt__metric_set(s->metrics, KVT_M_INDEX_CAPACITY, 0, (double)s->conf->index_bytes);
    kvt__metric_set(s->metrics, KVT_M_INDEX_NODES, 0, (double)rs.nodes);
    kvt__metric_set(s->metrics, KVT_M_INDEX_CACHED_TOKENS, 0, (double)rs.cached_tokens);
    kvt__metric_set(s->metrics, KVT_M_UPTIME, 0, (double)(kvt_now_ns() - s->started_ns) / 1e9);
    kvt__metric_set(s->metrics, KVT_M_LOG_SUPPRESSED, 0, (double)kvt_log_suppressed());
#if KVT_HAVE_REMOTE
    if (s->tiers[KVT_TIER_REMOTE]) {
        kvt_tier_remote_stats_t st;
        kvt_tier_remote_stats(s->tiers[KVT_TIER_REMOTE], &st);
        kvt__metric_set(s->metrics, KVT_M_REMOTE_CONNECTS, 0, (double)st.connects);
        kvt__metric_set(s->metrics, KVT_M_REMOTE_DISCONNECTS, 0, (double)st.disconnects);
        kvt__metric_set(s->metrics, KVT_M_REMOTE_TIMEOUTS, 0, (double)st.timeouts);
        kvt__metric_set(s->metrics, KVT_M_REMOTE_OVERSIZED, 0, (double)st.oversized);
    }
#endif
    if (s->policy) {
        kvt_policy_stats_t ps;
        kvt_policy_stats(s->policy, &ps);
        kvt__metric_set(s->metrics, KVT_M_PIN_REFUSALS, 0, (double)ps.pin_refusals);
        kvt__metric_set(s->metrics, KVT_M_POLICY_REBUILDS, 0, (double)ps.rebuilds);
        kvt__metric_set(s->metrics, KVT_M_POLICY_SWEEPS, 0, (double)ps.sweeps);
        kvt__metric_set(s->metrics, KVT_M_POLICY_INDEX_DROPS, 0,
                        (double)ps.pages_dropped_for_index);
    }
    kvt__metric_set(s->metrics, KVT_M_LEASES, 0, (double)rs.leases);
    kvt__metric_set(s->metrics, KVT_M_NAMESPACES, 0, (double)rs.namespaces);
    kvt__metric_set(s->metrics, KVT_M_CLIENT_BYTES, 0, (double)s->client_bytes);
}

void kvt__block_key(kvt_srv_t *s, kvt_radix_node_t *node, uint32_t depth, uint32_t *tok,
                    kvt_block_key_t *key)
{
    uint32_t ns = kvt_radix_node_ns(node);
    uint32_t page = kvt_radix_ns_page_size(s->radix, ns);
    key->ns_seed = kvt_radix_ns_seed(s->radix, ns);
    key->hash = kvt_radix_block_hash(s->radix, node, depth); /* computed here if not yet */
    kvt_assert(key->hash);
    key->parent = depth ? kvt_radix_block_hash(s->radix, node, depth - 1) : key->ns_seed;
    kvt_radix_node_t *n = node;
    while (depth < kvt_radix_node_depth(n))
        n = kvt_radix_node_parent(n);
    memcpy(tok, kvt_radix_node_tokens(n, depth - kvt_radix_node_depth(n)), page * sizeof *tok);
    key->tokens = tok;
    key->ntokens = page;
}

static kvt__io_t *kvt_io_new(kvt_srv_t *s, kvt__req_t *r, uint32_t depth)
{
    uint32_t page = kvt_radix_ns_page_size(s->radix, r->ns);
    kvt__io_t *x = calloc(1, sizeof *x + page * sizeof(uint32_t));
    if (!x)
        return NULL;
    x->req = r;
    x->node = r->node;
    x->depth = depth;
    kvt__block_key(s, r->node, depth, x->tokens, &x->io.key);
    x->io.data = x;
    x->copy.data = x;
    x->start_ns = kvt_now_ns();
    return x;
}

static void kvt_io_started(kvt_srv_t *s, kvt__req_t *r)
{
    r->pending++;
    s->inflight++;
    if (r->conn)
        r->conn->inflight++;
}

/* Accounts one finished I/O; returns 1 when it was the request's last. */
static int kvt_io_finished(kvt_srv_t *s, kvt__io_t *x, int status, int write)
{
    kvt__req_t *r = x->req;
    unsigned series = kvt__tier_io(x->tier, write);
    kvt__metric_observe(s->metrics, KVT_M_TIER_IO_SECONDS, series, kvt_now_ns() - x->start_ns);
    if (status < 0)
        kvt__metric_add(s->metrics, KVT_M_TIER_IO_ERRORS, series, 1);
    r->pending--;
    s->inflight--;
    if (r->conn)
        r->conn->inflight--;
    return r->pending == 0;
}

static void kvt_unpin(kvt_srv_t *s, kvt__req_t *r)
{
    if (r->lease) {
        kvt_radix_release(s->radix, r->lease);
        r->lease = 0;
    }
}

/* ---- PUT ---- */

/* Where a PUT's page landed, until the whole PUT is done and hands its blocks to the policy. */
typedef struct kvt__landed {
    uint64_t loc;
    uint32_t len;
    uint8_t tier;    /* KVT_TIER_NONE: not written */
    uint8_t started; /* a write was submitted: the block is BUSY */
    uint8_t held;    /* the tier whose policy accounting holds room for the write, or NONE */
} kvt__landed_t;

/* A payload page of r not stored, and why. */
static void kvt_put_skip(kvt_srv_t *s, kvt__req_t *r, kvt_put_outcome_t why, uint32_t pages)
{
    r->skipped += pages;
    kvt__metric_add(s->metrics, KVT_M_PUT_PAGES, why, pages);
}

/*
 * Every write of the PUT is done: its blocks join the policy in page order, runs of one tier
 * at a time (the order of tiers inside a node must hold, so the policy may refuse a page that
 * landed in a faster tier than the one before it; its bytes are then freed and it stays
 * index-only, counted as skipped).
 */
static void kvt_put_adopt(kvt_srv_t *s, kvt__req_t *r)
{
    kvt__landed_t *l = r->extra;
    if (!l)
        return;
    uint32_t n = r->end - r->first;
    for (uint32_t i = 0; i < n; i++) {
        if (l[i].held != KVT_TIER_NONE) /* the room the policy held is the adoption's to take */
            kvt_policy_unhold(s->policy, (kvt_tier_id_t)l[i].held, r->block_bytes);
        l[i].held = KVT_TIER_NONE;
        if (!l[i].started)
            continue;
        kvt_block_t *b = kvt_radix_block_at(r->node, r->first + i);
        b->flags &= (uint8_t)~KVT_BLOCK_BUSY;
        if (l[i].tier == KVT_TIER_NONE)
            continue;
        b->loc = l[i].loc;
        b->size = l[i].len;
    }
    for (uint32_t i = 0; i < n;) {
        uint32_t j = i + 1;
        if (l[i].tier == KVT_TIER_NONE) {
            i = j;
            continue;
        }
        while (j < n && l[j].tier == l[i].tier)
            j++;
        kvt_tier_id_t t = (kvt_tier_id_t)l[i].tier;
        uint32_t got = kvt__policy_adopt(
            s, r->node, r->first + i, r->first + j, t, r->pages,
            r->hint.priority || r->hint.finished || r->hint.paused_ms ? &r->hint : NULL);
        r->stored += got;
        kvt__metric_add(s->metrics, KVT_M_PUT_PAGES, KVT_PUT_STORED, got);
        if (got < j - i) /* refused: the node's tier order */
            kvt_put_skip(s, r, KVT_PUT_NO_ROOM, (j - i) - got);
        if (t == KVT_TIER_NVME)
            kvt__metric_add(s->metrics, KVT_M_NVME_WRITTEN, 0, (double)(j - i) * l[i].len);
        i = j;
    }
    free(r->extra);
    r->extra = NULL;
}

static void kvt_put_reply(kvt_srv_t *s, kvt__req_t *r)
{
    kvt_put_adopt(s, r);
    kvt_unpin(s, r);
    kvt_proto_put_reply_t p = {
        .pages = r->pages,
        .new_pages = r->new_pages,
        .stored = r->stored,
        .skipped = r->skipped,
    };
    uint8_t w[sizeof(kvt_wire_put_reply_t)];
    kvt_proto_put_reply_encode(w, &p);
    kvt__req_reply(r, w, r->status < 0 ? 0 : sizeof w);
    kvt__req_finish(r);
}

/* A tier that answers a write so gives it up to the next one down: full, unable to place it for
 * now (an NVMe log whose full segments are all pinned), or down (the remote). */
static int kvt_put_passes_on(int rc)
{
    return rc == KVT_ENOSPC || rc == KVT_EAGAIN || rc == KVT_EUNAVAIL;
}

/*
 * Writes a PUT's page into the first tier of kvt_order[from ..] that takes it, holding room for
 * it in that tier's policy accounting until the PUT is adopted, so that the tier's watermarks see
 * the writes in flight (x->tier and the page's held say which). A first pass takes only room
 * there is; when no tier has any, a second makes room as the policy's own inserts do (the lowest
 * tier's least valuable pages go), so that a full cache takes new pages instead of refusing every
 * run larger than its watermarks' headroom. Returns 0, or the refusal of the last one asked
 * (x->tier then as it was).
 */
static int kvt_put_write(kvt_srv_t *s, kvt__io_t *x, size_t from)
{
    kvt__req_t *r = x->req;
    kvt__landed_t *l = (kvt__landed_t *)r->extra + (x->depth - r->first);
    uint8_t was = x->tier;
    int rc = KVT_ENOSPC;
    for (int room = 0; room < 2 && kvt_put_passes_on(rc); room++) {
        rc = KVT_ENOSPC;
        for (size_t i = from; i < KVT_ARRAY_LEN(kvt_order) && kvt_put_passes_on(rc); i++) {
            kvt_tier_id_t id = kvt_order[i];
            if (!s->tiers[id] || (rc = kvt_policy_hold(s->policy, id, x->io.len, room)) < 0)
                continue;
            x->tier = (uint8_t)id;
            if ((rc = kvt_tier_write(s->tiers[id], &x->io)) < 0) {
                kvt_policy_unhold(s->policy, id, x->io.len);
                continue;
            }
            l->held = (uint8_t)id;
            if (room)
                kvt__metric_add(s->metrics, KVT_M_PUT_ROOM, 0, 1);
        }
    }
    if (rc < 0)
        x->tier = was;
    return rc;
}

static void kvt_put_done(kvt_tier_io_t *io)
{
    kvt__io_t *x = io->data;
    kvt__req_t *r = x->req;
    kvt_srv_t *s = x->req->srv;
    kvt__landed_t *l = (kvt__landed_t *)r->extra + (x->depth - r->first);
    if (io->status < 0 && kvt_put_passes_on(io->status)) {
        /* Refused after it was taken (the tier queued it): the tiers below may take it. The
         * refused write counts as that tier's failed I/O; the request keeps waiting. */
        uint8_t failed = x->tier;
        uint64_t now = kvt_now_ns();
        size_t i = 0;
        kvt_policy_unhold(s->policy, (kvt_tier_id_t)failed, x->io.len);
        l->held = KVT_TIER_NONE;
        while (i < KVT_ARRAY_LEN(kvt_order) && kvt_order[i] != failed)
            i++;
        if (kvt_put_write(s, x, i + 1) == 0) {
            unsigned series = kvt__tier_io(failed, 1);
            kvt__metric_observe(s->metrics, KVT_M_TIER_IO_SECONDS, series, now - x->start_ns);
            kvt__metric_add(s->metrics, KVT_M_TIER_IO_ERRORS, series, 1);
            x->start_ns = now;
            return;
        }
    }
    if (io->status == 0) {
        l->tier = x->tier;
        l->loc = io->loc;
        l->len = io->len;
    } else {
        static kvt_log_limit_t lim; /* a full tier fails every write */
        kvt_log_limited(&lim, KVT_LOG_WARN, "kvtierd: %s tier write failed: %s",
                        kvt_tier_name(x->tier), kvt_strerror(io->status));
        kvt_put_skip(s, r, kvt_put_passes_on(io->status) ? KVT_PUT_NO_ROOM : KVT_PUT_FAILED, 1);
    }
    int last = kvt_io_finished(s, x, io->status, 1);
    free(x);
    if (last)
        kvt_put_reply(s, r);
}

int kvt__store_put(kvt_srv_t *s, kvt__req_t *r)
{
    uint32_t end = r->status < 0 ? r->first : KVT_MIN(r->end, r->pages);
    if (end > r->first) {
        r->end = end;
        r->extra = calloc(end - r->first, sizeof(kvt__landed_t));
        if (!r->extra) {
            r->status = KVT_ENOMEM;
            end = r->first;
        }
    }
    for (uint32_t p = r->first; p < end; p++) {
        kvt_block_t *b = kvt_radix_block_at(r->node, p);
        if (!b || b->tier != KVT_TIER_NONE || (b->flags & KVT_BLOCK_BUSY)) {
            kvt_put_skip(s, r, KVT_PUT_CACHED, 1); /* held already, or another PUT writes it */
            continue;
        }
        kvt__io_t *x = kvt_io_new(s, r, p);
        if (!x) {
            r->status = KVT_ENOMEM;
            break;
        }
        x->io.buf = r->payload + (size_t)(p - r->first) * r->block_bytes;
        x->io.len = r->block_bytes;
        x->io.cb = kvt_put_done;
        int rc = kvt_put_write(s, x, 0);
        if (rc < 0) {
            free(x);
            kvt_put_skip(s, r, kvt_put_passes_on(rc) ? KVT_PUT_NO_ROOM : KVT_PUT_FAILED, 1);
            continue;
        }
        b->flags |= KVT_BLOCK_BUSY;
        ((kvt__landed_t *)r->extra)[p - r->first].started = 1;
        kvt_io_started(s, r);
    }
    if (r->pending == 0)
        kvt_put_reply(s, r); /* nothing to write (all held already), or it failed to start */
    return 0;
}

/* ---- GET ---- */

static void kvt_get_read_done(kvt_tier_io_t *io)
{
    kvt__io_t *x = io->data;
    kvt__req_t *r = x->req;
    kvt_srv_t *s = x->req->srv;
    kvt_busy_dec(s, io->key.hash);
    if (io->status == KVT_ECORRUPT)
        kvt__metric_add(s->metrics, KVT_M_MISS_TOKENS, KVT_MISS_CHECKSUM, io->key.ntokens);
    if (io->status == KVT_ECORRUPT || io->status == KVT_ENOENT)
        kvt__store_lost(s, x->node, x->depth); /* later MATCHes say so; this GET ends here */
    /* Promotion is the policy's: the MATCH that leased this path queued it. */
    if (kvt_io_finished(s, x, io->status, 0))
        kvt__store_get_batch(s, r);
}

/*
 * A GET goes out in batches of frames that reference the bytes where they are:
 *
 *     r->out:   [hdr 0][hdr 1][hdr 2] ...          32 bytes each (frame header + page, tier)
 *     r->segs:  hdr 0, payload 0, hdr 1, payload 1, ...
 *                        |                 |
 *                 DRAM/HBM-host memory   a read buffer (NVMe, remote: read first)
 *
 * Memory tiers are sent from their own memory (kvt_tier_ptr): no copy, no I/O. The block cannot
 * go meanwhile: the request's lease pins the path against eviction and removal, and its read
 * count (kvt_busy) keeps moves off it until the batch is written. Other tiers are read into
 * buffers of the batch first. The batch is written when every read is done; when the socket has
 * taken all of it, the source's drained hook builds the next one. At most
 * KVT_GET_BATCH_BYTES are referenced at a time.
 *
 * Called with nothing in flight: after the request is set up, when the batch's last read (or
 * promotion) completes, and when conn.c has written the batch.
 */
static void kvt_get_release_batch(kvt_srv_t *s, kvt__req_t *r)
{
    for (uint32_t i = 0; i < r->batch; i++) {
        kvt__io_t *x = r->ios[i];
        if (x->zero_copy)
            kvt_busy_dec(s, x->io.key.hash);
        free(x->buf);
        free(x);
    }
    free(r->ios);
    r->ios = NULL;
    r->batch = 0;
    free(r->segs);
    r->segs = NULL;
    r->nsegs = r->seg_i = r->seg_off = 0;
    r->segs_ready = 0;
    r->src = NULL;
}

/* The GET as a reply source (server.h): its batch's frames from where their bytes are. */
static int kvt_get_iov(kvt__req_t *r, struct iovec *iov, int max)
{
    int n = 0;
    if (!r->segs_ready)
        return 0; /* reads still in flight */
    for (uint32_t k = r->seg_i; k < r->nsegs && n < max; k++) {
        const kvt__seg_t *g = &r->segs[k];
        size_t skip = k == r->seg_i ? r->seg_off : 0;
        iov[n].iov_base = (uint8_t *)(g->ptr ? g->ptr : r->out + g->off) + skip;
        iov[n].iov_len = g->len - skip;
        n++;
    }
    return n;
}

static void kvt_get_wrote(kvt__req_t *r, size_t left)
{
    while (left > 0 && r->seg_i < r->nsegs) {
        size_t t = KVT_MIN(r->segs[r->seg_i].len - r->seg_off, left);
        r->seg_off += t;
        left -= t;
        if (r->seg_off == r->segs[r->seg_i].len) {
            r->seg_i++;
            r->seg_off = 0;
        }
    }
}

static int kvt_get_drained(kvt__req_t *r)
{
    if (!r->segs_ready || r->seg_i < r->nsegs)
        return 0;
    kvt__store_get_batch(r->srv, r); /* the batch is out: the next one, or the end frame */
    return 1;
}

static void kvt_get_abort(kvt__req_t *r)
{
    if (r->ios)
        kvt_get_release_batch(r->srv, r);
    kvt_unpin(r->srv, r);
}

static const kvt__reply_src_t kvt_get_src = {
    .iov = kvt_get_iov,
    .wrote = kvt_get_wrote,
    .drained = kvt_get_drained,
    .abort = kvt_get_abort,
};

/* A tier's error as a client reads it in a GET's end frame: the remote tier's EPROTO (its server
 * answered something malformed) would tell the client that its own frame was malformed; to it,
 * that is a failed I/O. */
static int kvt_tier_failure(int rc)
{
    return rc == KVT_EPROTO ? KVT_EIO : rc;
}

int kvt__store_get_batch(kvt_srv_t *s, kvt__req_t *r)
{
    kvt_assert(r->pending == 0);
    if (r->ios && !r->segs_ready) {
        /* The batch's reads are done: it may go out up to its first failure. */
        uint32_t good = 0;
        for (; good < r->batch; good++) {
            kvt__io_t *x = r->ios[good];
            if (!x->zero_copy && x->io.status < 0) {
                r->status = x->io.status;
                static kvt_log_limit_t lim; /* a remote tier down fails every GET */
                kvt_log_limited(&lim, KVT_LOG_INFO, "kvtierd: GET page %u from %s: %s", x->depth,
                                kvt_tier_name(x->tier), kvt_strerror(x->io.status));
                break;
            }
        }
        r->nsegs = 2 * good;
        r->segs_ready = 1;
        size_t bytes = 0;
        for (uint32_t i = 0; i < r->nsegs; i++)
            bytes += r->segs[i].len;
        r->sent += good;
        if (r->conn && r->nsegs) {
            kvt__out_add(r->conn, (int64_t)bytes);
            kvt__conn_kick(r->conn);
            return 0; /* drained calls back when the socket has taken it */
        }
    }
    if (r->ios)
        kvt_get_release_batch(s, r);
    if (!r->conn) {
        kvt_unpin(s, r);
        kvt__req_finish(r);
        return 0;
    }
    size_t hdr = KVT_PROTO_HDR + sizeof(kvt_wire_get_data_t);
    if (r->status == 0 && r->cur < r->end) {
        uint32_t n = (uint32_t)KVT_MIN((size_t)(r->end - r->cur),
                                       KVT_MAX(1, KVT_GET_BATCH_BYTES / (hdr + r->block_bytes)));
        r->out_off = r->out_len = 0;
        if (kvt_reserve(&r->out, &r->out_cap, n * hdr, 1, 4096) < 0) {
            r->status = KVT_ENOMEM;
            goto end;
        }
        r->ios = calloc(n, sizeof *r->ios);
        r->segs = calloc(2 * (size_t)n, sizeof *r->segs);
        r->src = &kvt_get_src;
        if (!r->ios || !r->segs) {
            r->status = KVT_ENOMEM;
            goto end;
        }
        for (uint32_t i = 0; i < n; i++, r->cur++) {
            kvt_block_t *b = kvt_radix_block_at(r->node, r->cur);
            if (!b || b->tier == KVT_TIER_NONE || !s->tiers[b->tier] || b->size != r->block_bytes) {
                r->status = KVT_ENOENT;
                break;
            }
            kvt__io_t *x = kvt_io_new(s, r, r->cur);
            if (!x) {
                r->status = KVT_ENOMEM;
                break;
            }
            uint8_t *f = r->out + (size_t)i * hdr;
            kvt_proto_frame(f, r->op | KVT_OP_REPLY, KVT_RF_MORE, r->id, 0,
                            (uint32_t)(hdr - KVT_PROTO_HDR + r->block_bytes));
            kvt_proto_get_data_encode(f + KVT_PROTO_HDR, r->cur, b->tier);
            r->segs[2 * i] = (kvt__seg_t){.off = (size_t)i * hdr, .len = hdr};
            x->tier = b->tier;
            int rc = kvt_busy_inc(s, x->io.key.hash);
            const uint8_t *ptr = rc == 0 ? kvt_tier_ptr(s->tiers[b->tier], b->loc) : NULL;
            if (ptr) {
                x->zero_copy = 1;
                r->segs[2 * i + 1] = (kvt__seg_t){.ptr = ptr, .len = b->size};
                r->ios[r->batch++] = x;
                kvt__metric_observe(s->metrics, KVT_M_TIER_IO_SECONDS, kvt__tier_io(b->tier, 0),
                                    kvt_now_ns() - x->start_ns);
                continue;
            }
            x->buf = rc == 0 ? malloc(b->size) : NULL;
            if (x->buf) {
                x->io.buf = x->buf;
                x->io.len = b->size;
                x->io.loc = b->loc;
                x->io.cb = kvt_get_read_done;
                x->io.urgent = 1; /* the client waits: ahead of queued moves */
                rc = kvt_tier_read(s->tiers[b->tier], &x->io);
            } else {
                rc = KVT_ENOMEM;
            }
            if (rc < 0) {
                if (rc != KVT_ENOMEM || x->buf)
                    kvt_busy_dec(s, x->io.key.hash);
                free(x->buf);
                free(x);
                r->status = rc;
                break;
            }
            r->segs[2 * i + 1] = (kvt__seg_t){.ptr = x->buf, .len = b->size};
            r->ios[r->batch++] = x;
            kvt_io_started(s, r);
        }
        if (r->batch > 0) {
            if (r->pending == 0)
                return kvt__store_get_batch(s, r); /* all from memory: out it goes */
            return 0;
        }
        kvt_get_release_batch(s, r);
    }
end:;
    /* The final frame: status, and how many pages went out before it. */
    if (r->ios)
        kvt_get_release_batch(s, r);
    uint8_t e[sizeof(kvt_wire_get_end_t)];
    kvt_proto_get_end_encode(e, r->sent);
    r->status = kvt_tier_failure(r->status);
    kvt_unpin(s, r);
    r->out_off = r->out_len = 0;
    kvt__req_reply(r, e, sizeof e);
    kvt__req_finish(r);
    return 0;
}

/* ---- PREFETCH ---- */

/* Pages of r's path at its target tier or faster; *busy gets those below it that a move has in
 * flight (a GET's promotion, another PREFETCH's, the policy's). */
static uint32_t kvt_prefetch_count(kvt__req_t *r, uint32_t *busy)
{
    uint32_t at = 0;
    *busy = 0;
    kvt_path_iter_t it;
    kvt_path_iter_init(&it, r->node, r->pages - kvt_radix_node_depth(r->node));
    kvt_block_t *b;
    while ((b = kvt_path_iter_next(&it, NULL))) {
        if (b->tier != KVT_TIER_NONE && b->tier <= r->target)
            at++;
        else if (b->tier != KVT_TIER_NONE && (b->flags & KVT_BLOCK_BUSY))
            (*busy)++;
    }
    return at;
}

static void kvt_prefetch_reply(kvt_srv_t *s, kvt__req_t *r)
{
    (void)s;
    uint32_t moved = r->moved;
    if (r->start_only && r->status == 0) {
        /* On their way: at the target since the count before the round, or in a move up. */
        uint32_t busy, at = kvt_prefetch_count(r, &busy);
        moved = (at > r->resident ? at - r->resident : 0) + busy;
    }
    uint32_t failed = r->pages - KVT_MIN(r->pages, r->resident + moved);
    kvt_proto_prefetch_reply_t p = {
        .pages = r->pages,
        .moved = moved,
        .resident = r->resident,
        .failed = failed,
    };
    uint8_t w[sizeof(kvt_wire_prefetch_reply_t)];
    kvt_proto_prefetch_reply_encode(w, &p);
    r->replied = 1;
    kvt__req_reply(r, w, r->status < 0 ? 0 : sizeof w);
}

#define KVT_PREFETCH_ROUNDS 16

static int kvt_prefetch_round(kvt_srv_t *s, kvt__req_t *r)
{
    uint32_t node_pages = r->pages - kvt_radix_node_depth(r->node);
    r->progress = 0;
    r->rounds++;
    s->move_req = r;
    int rc = kvt_policy_promote(s->policy, r->node, node_pages, (kvt_tier_id_t)r->target);
    s->move_req = NULL;
    if (rc < 0 && rc != KVT_ENOSPC && rc != KVT_EAGAIN)
        kvt_log(KVT_LOG_DEBUG, "kvtierd: PREFETCH promotion: %s", kvt_strerror(rc));
    return rc;
}

/*
 * A round (whose kvt_policy_promote returned rc) started no move of its own: when pages of the
 * path are in a move already (a GET that promotes them, say), or the target tier has no room
 * until moves in flight out of it land (KVT_EAGAIN: the policy demoting after a PUT), the
 * request waits, and kvt__store_deadlines tries again when moves land (kvt__conns_deadlines) and
 * every tick, until the deadline, instead of answering at once that the pages failed. Returns 1
 * when it waits.
 */
static int kvt_prefetch_wait(kvt__req_t *r, int rc)
{
    uint32_t busy;
    if (r->pending > 0 || r->replied || !r->conn || kvt_now_ns() >= r->deadline_ns)
        return 0;
    uint32_t at = kvt_prefetch_count(r, &busy);
    r->waiting = at < r->pages && (busy > 0 || rc == KVT_EAGAIN);
    if (r->waiting) {
        kvt_srv_t *s = r->conn->srv;
        s->reqs_waiting = 1;
        if (!r->waited)
            kvt__metric_add(s->metrics, KVT_M_PREFETCH_WAITS, 0, 1);
        r->waited = 1;
    }
    return r->waiting;
}

/*
 * A move a PREFETCH waits for has finished (kvt_move_finish counted it). When they all have and
 * pages are still below the target (the target tier had to be emptied first: its demotions were
 * among the moves), the next round promotes what now fits, until the deadline.
 */
static void kvt_prefetch_moved(kvt_srv_t *s, kvt__req_t *r)
{
    if (r->pending > 0)
        return;
    /* START: answered already, its rounds go on as its moves land, connection or not. */
    int more = r->start_only || (!r->replied && r->conn);
    if (more && r->progress && r->resident + r->moved < r->pages &&
        r->rounds < KVT_PREFETCH_ROUNDS && kvt_now_ns() < r->deadline_ns) {
        int rc = kvt_prefetch_round(s, r);
        if (r->pending > 0 || kvt_prefetch_wait(r, rc))
            return;
    }
    kvt_unpin(s, r);
    if (!r->replied)
        kvt_prefetch_reply(s, r);
    kvt__req_finish(r);
}

/*
 * The policy promotes the path up to r->target (making room there by demoting others if it
 * must); the moves it starts for this path report to r, which answers when they are done or at
 * its deadline, whichever comes first.
 */
int kvt__store_prefetch(kvt_srv_t *s, kvt__req_t *r)
{
    if (r->status == 0 && s->policy) {
        uint32_t busy;
        r->resident = kvt_prefetch_count(r, &busy);
        if (r->resident < r->pages) {
            int rc = kvt_prefetch_round(s, r);
            if (!r->start_only && kvt_prefetch_wait(r, rc))
                return 0;
        }
    }
    if (r->start_only && r->pending > 0) {
        /* START: answered now with what is on its way; more rounds start as those moves land
         * (kvt_prefetch_moved), until the deadline, with no further reply. */
        kvt_prefetch_reply(s, r);
        kvt__req_finish(r);
        return 0;
    }
    if (r->pending == 0) {
        kvt_unpin(s, r);
        kvt_prefetch_reply(s, r);
        kvt__req_finish(r);
    }
    return 0;
}

void kvt__store_deadlines(kvt__conn_t *c, uint64_t now)
{
    kvt_srv_t *s = c->srv;
    for (kvt__req_t *r = c->head; r; r = r->next) {
        if (r->kind == KVT_REQ_REMOVE && !r->done) {
            if (!kvt__remove_retry(r, now)) {
                s->reqs_waiting = 1;
                continue;
            }
            s->reqs_waiting = 1; /* others after it: looked at next time */
            return;              /* the kick may have freed the connection */
        }
        if (r->kind == KVT_REQ_PREFETCH && r->waiting && !r->done && r->pending == 0) {
            uint32_t busy, at = kvt_prefetch_count(r, &busy);
            if (busy > 0 && now < r->deadline_ns) {
                s->reqs_waiting = 1;
                continue; /* the other moves are still running */
            }
            /* They landed (or failed): what reached the target without this request's own moves
             * is resident; what did not gets one more round, if there is time. */
            r->waiting = 0;
            r->resident = at > r->moved ? at - r->moved : 0;
            if (now < r->deadline_ns && r->resident + r->moved < r->pages) {
                int rc = kvt_prefetch_round(s, r);
                if (r->pending > 0 || kvt_prefetch_wait(r, rc))
                    continue;
            }
            kvt_unpin(s, r);
            kvt_prefetch_reply(s, r);
            kvt__req_finish(r);
            s->reqs_waiting = 1; /* others after it: looked at next time */
            return;              /* the kick may have freed the connection */
        }
        if (r->kind == KVT_REQ_PREFETCH && !r->done && !r->replied && r->pending > 0 &&
            now >= r->deadline_ns) {
            kvt_prefetch_reply(c->srv, r);
            kvt__req_finish(r);
            return; /* the kick may have freed the connection */
        }
    }
}
