/*
 * op_match.c: MATCH. It reads the tree (kvt__path_seek), counts hits and misses by tier and
 * reason, tells the policy of the use, and answers with a tier per page and, if asked, a lease.
 * A MATCH with REMOTE may wait for the remote probe (op_probe.c) before answering.
 *
 * It also prices the hit with the cost model (policy-model on policy-hw): per tier, the prefill
 * the matched pages held there spare (recompute seconds at their depth) minus loading them from
 * that tier (bandwidth and the tier's fixed latency, once per MATCH), never below 0. Pages in no
 * tier (index-only, or lost) are left out: nothing of kvtier's loads them.
 *
 * Two flags save an engine's step a round trip each (docs/protocol.md, MATCH). LOCATE answers,
 * with the lease, where each matched page lies in the connection's mapping, as a GET with LOCATE
 * would: the GET's round trip is gone. KEEP keeps the MATCH's tokens under a handle (a small
 * per-connection table owned here), which the PUT after it names instead of sending the whole
 * prompt again.
 */
#include "server.h"

#include <stdlib.h>
#include <string.h>

/* The seconds saved by the hits of one MATCH: recompute[t] and bytes[t] summed over its runs in
 * tier t, then each tier's load subtracted once. */
static void count_saved(kvt_srv_t *s, kvt_metrics_t *mt, unsigned ns_slot, const double *recompute,
                        const uint64_t *bytes)
{
    double all = 0;
    for (int t = KVT_TIER_HBM; t < KVT_TIER_COUNT; t++) {
        if (!bytes[t])
            continue;
        double saved = recompute[t] - kvt_cost_load_s(&s->cost_hw, (kvt_tier_id_t)t, bytes[t]);
        if (!(saved > 0)) /* no path from that tier (INFINITY), or loading costs more */
            continue;
        kvt__metric_add(mt, KVT_M_SECONDS_SAVED, (unsigned)t, saved);
        all += saved;
    }
    if (all > 0)
        kvt__metric_ns_add(mt, KVT_M_NS_SECONDS_SAVED, ns_slot, all);
}

/* Why the pages after m were not found: the first one not matched names the reason for the
 * whole rest (was it ever here?). Only meaningful when m is shorter than the lookup. */
static kvt_miss_reason_t match_why(kvt_srv_t *s, const kvt_match_t *m, const uint32_t *tokens,
                                   uint32_t page, int remote_down)
{
    if (remote_down)
        return KVT_MISS_REMOTE_UNREACHABLE;
    uint64_t next = 0;
    kvt__path_keys(s, m->ns, kvt__path_tail(s, m), tokens + (size_t)m->pages * page, 1, &next);
    return kvt__ghost_seen(s, next) ? KVT_MISS_EVICTED : KVT_MISS_NEVER_SEEN;
}

/* The counters of one lookup of ntokens tokens of which pages whole pages matched, in tiers[],
 * added to mt (s->metrics, or under the shared lock the loop's own): reads neither the tree nor
 * the tiers (why: match_why's, when pages < the lookup's whole). */
static void count_match(kvt_srv_t *s, kvt_metrics_t *mt, unsigned ns_slot, uint32_t pages,
                        uint32_t ntokens, uint32_t page, const uint8_t *tiers,
                        kvt_miss_reason_t why)
{
    double recompute[KVT_TIER_COUNT] = {0};
    uint64_t bytes[KVT_TIER_COUNT] = {0};
    kvt__metric_add(mt, KVT_M_LOOKUPS, 0, 1);
    kvt__metric_add(mt, KVT_M_LOOKUP_TOKENS, 0, ntokens);
    /* Runs of one tier (a path is mostly one or two runs): no per-page counter updates. A run
     * is followed eight pages at a time. */
    for (uint32_t i = 0, run; i < pages; i += run) {
        uint64_t all = 0x0101010101010101ull * tiers[i], w;
        for (run = 1; i + run + 8 <= pages; run += 8) {
            memcpy(&w, tiers + i + run, 8);
            if (w != all)
                break;
        }
        for (; i + run < pages && tiers[i + run] == tiers[i]; run++)
            ;
        kvt__metric_add(mt, KVT_M_HIT_TOKENS, tiers[i] < KVT_TIER_COUNT ? tiers[i] : 0,
                        (double)run * page);
        if (tiers[i] != KVT_TIER_NONE && tiers[i] < KVT_TIER_COUNT) {
            recompute[tiers[i]] += kvt_cost_recompute_s(&s->cost_model, &s->cost_hw,
                                                        (uint64_t)i * page, (uint64_t)run * page);
            bytes[tiers[i]] += kvt_cost_kv_bytes(&s->cost_model, (uint64_t)run * page);
        }
    }
    count_saved(s, mt, ns_slot, recompute, bytes);
    kvt__metric_add(mt, KVT_M_PREFILL_SAVED, 0,
                    (double)pages * page / s->conf->prefill_tokens_per_s);
    uint32_t whole = ntokens / page;
    if (ntokens % page)
        kvt__metric_add(mt, KVT_M_MISS_TOKENS, KVT_MISS_SHORT_PAGE, ntokens % page);
    if (whole > pages)
        kvt__metric_add(mt, KVT_M_MISS_TOKENS, why, (double)(whole - pages) * page);
}

/*
 * The lookup's whole pages for the miss-ratio curve (mrc.h), named by their chain hashes: those
 * of the matched pages are the tree's own (cached in the blocks once computed; count_match needs
 * the last one anyway), the rest are hashed on from there, one XXH3 of a page's tokens each.
 */
static void mrc_match(kvt_srv_t *s, const kvt_match_t *m, const kvt__match_q_t *q)
{
    uint32_t whole = q->ntokens / q->page;
    uint64_t *keys = kvt__mrc_scratch(s->mrc, whole ? whole : 1);
    if (!keys)
        return;
    uint64_t parent = kvt__path_tail(s, m);
    kvt__path_t p;
    for (kvt__path_walk(&p, m); p.run.node; kvt__path_step(&p))
        for (uint32_t i = 0; i < p.run.n; i++)
            keys[p.run.depth + i] = p.run.blocks[i].hash;
    if (whole > m->pages && kvt__path_keys(s, m->ns, parent, q->tokens + (size_t)m->pages * q->page,
                                           whole - m->pages, keys + m->pages) < 0)
        return;
    kvt__mrc_lookup(s->mrc, keys, whole, q->page, q->block_bytes, q->ntokens);
}

/* How long a lease (and a KEEP's handle) lasts when the client asks for asked ms: lease-ms when
 * it asks for nothing, at most lease-ms-max. */
static uint32_t lease_ms(const kvt_srv_t *s, uint32_t asked)
{
    return asked ? KVT_MIN(asked, s->conf->lease_ms_max) : s->conf->lease_ms;
}

/* The block size for the miss-ratio curve: c's, or the namespace's when c declared none (a
 * lookup-only client of a namespace that others fill); 0 when neither is known (the curve then
 * counts nothing for the lookup). */
static uint32_t curve_block(const kvt__conn_t *c)
{
    const kvt_srv_t *s = c->srv;
    return c->block_bytes ? c->block_bytes : c->ns < s->nns ? s->ns[c->ns].block_bytes : 0;
}

/* The tiers of a path's pages into out, node by node (each node's blocks read in place). Eight
 * pages a step, counted down from the run's length: this runs over every page of every MATCH;
 * the plain loop's index arithmetic was 7 instructions a page, four a step with the pointers'
 * distance recomputed 3.5, this 2.5. */
static void path_tiers(const kvt_match_t *m, uint8_t *out)
{
    kvt__path_t p;
    for (kvt__path_walk(&p, m); p.run.node; kvt__path_step(&p)) {
        const kvt_block_t *b = p.run.blocks;
        uint8_t *o = out + p.run.depth;
        uint32_t n = p.run.n;
        for (; n >= 8; n -= 8, b += 8, o += 8) {
            o[0] = b[0].tier;
            o[1] = b[1].tier;
            o[2] = b[2].tier;
            o[3] = b[3].tier;
            o[4] = b[4].tier;
            o[5] = b[5].tier;
            o[6] = b[6].tier;
            o[7] = b[7].tier;
        }
        for (; n > 0; n--)
            *o++ = (b++)->tier;
    }
}

/* ---- Handles (KEEP) ---- */

/* The clients' memory as c's loop sees it: the count settled at the last write lock, and what c's
 * loop has added since with the lock shared (kvt__clients_add; 0 under the write lock, which
 * settled it). Other loops' additions since are not in it. */
static int64_t clients_now(const kvt__conn_t *c)
{
    return (int64_t)c->srv->clients.bytes + c->loop->clients_bytes;
}

/* Whether a KEEP of ntokens tokens fits in max-client-bytes as c's loop sees it, before any of
 * c's handles makes room (handle_keep drops some first: it can only fit better then). */
static int handle_fits(const kvt__conn_t *c, uint32_t ntokens)
{
    return clients_now(c) + (int64_t)ntokens * 4 <= (int64_t)c->srv->conf->max_client_bytes;
}

static void handle_drop(kvt__conn_t *c, kvt__handle_t *k)
{
    kvt__clients_add(c, -(int64_t)k->ntokens * 4);
    c->handle_bytes -= (uint64_t)k->ntokens * 4;
    free(k->tokens);
    memset(k, 0, sizeof *k);
}

static kvt__handle_t *handle_at(kvt__conn_t *c, uint32_t id)
{
    for (int i = 0; id && c->handles && i < KVT_MATCH_HANDLES; i++) {
        kvt__handle_t *k = &c->handles[i];
        if (k->id != id)
            continue;
        if (k->expires_ns <= kvt_now_ns()) {
            handle_drop(c, k); /* the same answer as a handle never made: ENOENT */
            return NULL;
        }
        return k;
    }
    return NULL;
}

const kvt__handle_t *kvt__handle_find(kvt__conn_t *c, uint32_t id)
{
    return handle_at(c, id);
}

/*
 * Keeps tokens under a new handle of c and returns its id, or 0 when none is kept: more tokens
 * than a connection may keep, or max-client-bytes reached (the client then sends the tokens
 * with its PUT, as before). Room is made by dropping expired handles, then the oldest: a MATCH
 * that needs no PUT after it (a whole hit) leaves its handle to be replaced. Everything it
 * writes is c's own but the clients' memory, which kvt__clients_add defers to c's loop while the
 * lock is shared: so it runs under the write lock or, for kvt__h_match_shared, shared.
 */
static uint32_t handle_keep(kvt__conn_t *c, const uint32_t *tokens, uint32_t ntokens, uint32_t ms)
{
    uint64_t bytes = (uint64_t)ntokens * 4, now = kvt_now_ns();
    if (bytes > KVT_MATCH_HANDLE_BYTES || !kvt__conn_handles(c))
        return 0; /* the table is made on the first KEEP (conn.c) */
    kvt__handle_t *slot = NULL;
    for (;;) {
        kvt__handle_t *oldest = NULL;
        for (int i = 0; i < KVT_MATCH_HANDLES; i++) {
            kvt__handle_t *k = &c->handles[i];
            if (k->id && k->expires_ns <= now)
                handle_drop(c, k);
            if (!k->id)
                slot = slot ? slot : k;
            else if (!oldest || k->made_ns < oldest->made_ns)
                oldest = k;
        }
        if (slot && c->handle_bytes + bytes <= KVT_MATCH_HANDLE_BYTES)
            break;
        handle_drop(c, oldest); /* one is there: a full table, or the bytes over the bound */
        slot = NULL;
    }
    if (!handle_fits(c, ntokens))
        return 0;
    uint32_t *copy = malloc(bytes ? bytes : 1);
    if (!copy)
        return 0;
    memcpy(copy, tokens, bytes);
    if (++c->handle_next == 0) /* 0 means none on the wire */
        c->handle_next = 1;
    *slot = (kvt__handle_t){.id = c->handle_next,
                            .ns = c->ns,
                            .page = c->page_size,
                            .ntokens = ntokens,
                            .made_ns = now,
                            .expires_ns = now + (uint64_t)ms * 1000000,
                            .tokens = copy};
    c->handle_bytes += bytes;
    kvt__clients_add(c, (int64_t)bytes);
    return slot->id;
}

/* LOCATE's part of the reply at out: the head, then an offset per page (under the lease just
 * taken, so that they stay valid as GET's locations do), the located pages counted in mt
 * (s->metrics, or under the shared lock the loop's own). It only reads the tree, c's mapping
 * and the DRAM tier's arena table (kvt__store_locate). Returns the pages located. */
static uint32_t match_locate(kvt__conn_t *c, kvt_metrics_t *mt, const kvt_match_t *m,
                             const uint8_t *tiers, uint32_t lease_ms, uint8_t *out)
{
    kvt_srv_t *s = c->srv;
    uint8_t *offs = out + sizeof(kvt_wire_match_locs_t);
    uint32_t located = 0;
    kvt__path_t pr;
    for (kvt__path_walk(&pr, m); pr.run.node; kvt__path_step(&pr))
        for (uint32_t i = 0; i < pr.run.n; i++) {
            uint32_t p = pr.run.depth + i;
            uint64_t off = KVT_MATCH_NO_LOC;
            /* A page reported index-only (lost) is not offered: its bytes are not the block's. */
            if (tiers[p] != KVT_TIER_NONE &&
                !kvt__store_locate(s, c, m->ns, &pr.run.blocks[i], &off))
                off = KVT_MATCH_NO_LOC;
            located += off != KVT_MATCH_NO_LOC;
            kvt_proto_match_loc_encode(offs + (size_t)p * 8, off);
        }
    kvt_proto_match_locs_encode(out, m->pages ? lease_ms : 0, located);
    if (located)
        kvt__metric_add(mt, KVT_M_ZC_PAGES, KVT_OP_GET, located);
    return located;
}

/*
 * Answers a MATCH for m: tiers per page, counters, the lease if asked for. r is NULL for an
 * answer given at once (appended to the connection's queue) or the request that waited for the
 * remote probe (its reply goes in its own slot).
 */
int kvt__match_answer(kvt__conn_t *c, kvt__req_t *r, const kvt_proto_hdr_t *h, uint64_t t0,
                      const kvt__match_q_t *q, kvt_match_t *m, uint32_t remote_pages,
                      int remote_down)
{
    kvt_srv_t *s = c->srv;
    uint8_t stackbuf[sizeof(kvt_wire_match_reply_t) + 512];
    int locate = (q->flags & KVT_MATCH_F_LOCATE) != 0;
    size_t len = sizeof(kvt_wire_match_reply_t) + m->pages;
    if (locate)
        len += sizeof(kvt_wire_match_locs_t) + (size_t)m->pages * 8;
    uint8_t *out = len <= sizeof stackbuf ? stackbuf : malloc(len);
    int rc = 0;
    if (!out)
        return kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_ENOMEM, "out of memory");
    uint8_t *tiers = out + sizeof(kvt_wire_match_reply_t);
    path_tiers(m, tiers);
    /* Blocks NVMe dropped by itself are not reported stored (exec.c settles them later). */
    for (uint32_t k = 0; k < q->lost.n; k++)
        if (q->lost.from[k] < m->pages)
            memset(tiers + q->lost.from[k], KVT_TIER_NONE,
                   KVT_MIN(q->lost.to[k], m->pages) - q->lost.from[k]);
    if (q->lost.gone < m->pages)
        memset(tiers + q->lost.gone, KVT_TIER_NONE, m->pages - q->lost.gone);
    if (!(q->flags & KVT_MATCH_F_PROBE)) {
        kvt_miss_reason_t why = q->ntokens / q->page > m->pages
                                    ? match_why(s, m, q->tokens, q->page, remote_down)
                                    : KVT_MISS_NEVER_SEEN;
        count_match(s, s->metrics, c->metric_ns, m->pages, q->ntokens, q->page, tiers, why);
        /* No block size, no page of the curve (kvt__mrc_lookup counts nothing): the keys of
         * every page would be gathered and hashed for nothing. */
        if (s->mrc && q->block_bytes)
            mrc_match(s, m, q);
    }
    uint64_t lease = 0;
    uint32_t ms = lease_ms(s, q->lease_ms);
    int leasing = (q->flags & KVT_MATCH_F_LEASE) && m->pages > 0, full = 0;
    if (leasing && c->nleases >= s->conf->max_leases) {
        rc = KVT_ENOSPC; /* refused below, saying why */
    } else if (leasing && !kvt__index_fits(s, kvt__pin_need(s))) {
        rc = KVT_ENOSPC; /* the lease table would grow past index-bytes */
        full = 1;
    } else if (leasing) {
        rc = kvt__path_pin(s, m, c->id, &lease);
        kvt__lease_t l = {
            .id = lease,
            .node = m->node,
            .pages = m->pages,
            .ns = m->ns,
            .expires_ns = kvt_now_ns() + (uint64_t)ms * 1000000,
            .engine_id = q->engine_id,
        };
        if (rc == 0)
            kvt__nvme_pin(s, &l.pins, m->node, m->pages);
        if (rc == 0 && (rc = kvt__lease_add(c, &l)) < 0) {
            kvt__nvme_unpin(s, &l.pins);
            kvt__path_unpin(s, lease);
        }
        if (rc < 0)
            lease = 0;
    }
    kvt_proto_match_reply_t w = {
        .tokens = m->pages * q->page,
        .pages = m->pages,
        .lease = lease,
        .remote_pages = remote_pages,
        .handle = q->handle,
    };
    kvt_proto_match_reply_encode(out, &w);
    if (rc == 0 && locate)
        match_locate(c, s->metrics, m, tiers, ms, tiers + m->pages);
    if (rc < 0) {
        kvt__handle_t *k = handle_at(c, q->handle);
        if (k) /* the client never hears of it */
            handle_drop(c, k);
        if (!r && full)
            rc = kvt__reply_error(c, h->opcode, h->request_id, t0, rc,
                                  "no room for one more lease in the index: it is at index-bytes "
                                  "(%llu) and every page it could evict is leased or busy with I/O",
                                  (unsigned long long)s->conf->index_bytes);
        else if (!r && rc == KVT_ENOSPC)
            rc = kvt__reply_error(c, h->opcode, h->request_id, t0, rc,
                                  "this connection holds max-leases (%u) leases: release some",
                                  s->conf->max_leases);
        else if (!r)
            rc = kvt__reply_error(c, h->opcode, h->request_id, t0, rc, "cannot lease");
        len = 0;
    } else if (!r) {
        rc = kvt__reply(c, h->opcode, h->request_id, t0, 0, out, (uint32_t)len);
    }
    if (r) {
        r->status = rc;
        kvt__req_reply(r, out, (uint32_t)len);
        kvt__req_finish(r);
        rc = 0;
    }
    if (out != stackbuf)
        free(out);
    return rc;
}

/* ---- MATCH under the shared lock (several loops) ---- */

void kvt__match_settle(kvt_srv_t *s)
{
    for (unsigned i = 0; s->loops && i < s->nloops; i++) {
        kvt__loop_t *l = &s->loops[i];
        if (l->clients_bytes) { /* its replies' bytes, queued with the lock shared */
            s->clients.bytes += (uint64_t)l->clients_bytes;
            l->clients_bytes = 0;
        }
        /* In the order they were answered: nothing changed the tree since (this is the first
         * thing a writer does), so each hit's match is still current. */
        if (l->nhits)
            kvt__metric_add(s->metrics, KVT_M_LOOP_DEFERRED_HITS, l->id, l->nhits);
        for (uint32_t k = 0; k < l->nhits; k++) {
            kvt__hit_t *hit = &l->hits[k];
            if (hit->sample)
                kvt__mrc_lookup(s->mrc, l->keys + hit->keys_at, hit->whole, hit->page, hit->block,
                                hit->ntokens);
            if (!hit->pending)
                continue;
            /* What the seek, match_why and the policy call of a MATCH under the write lock do. */
            kvt__path_touch(s, &hit->m);
            if (hit->cache_tail)
                kvt__path_tail(s, &hit->m);
            kvt__policy_match(s, &hit->m, &hit->hints, hit->device);
        }
        l->nhits = 0;
        l->nkeys = 0;
    }
}

/* Whether the NVMe tier has ever dropped a block by itself (reclaimed, corrupt): a path may then
 * hold lost blocks, which kvt__store_check_path queues for the step (a write). Never again 0. */
static int nvme_dropped(kvt_srv_t *s)
{
    return kvt__tier_dropped(s, KVT_TIER_NVME) != 0;
}

/* Page keys kept on the stack; a longer lookup's are allocated. */
#define KVT_SHARED_KEYS 64

/* Under the shared lock: the miss reason of a lookup m is shorter than (whole pages), from the
 * cached last hash or hashed from the namespace's seed (then cache_tail: cache it later). */
static kvt_miss_reason_t shared_why(kvt_srv_t *s, const kvt_match_t *m, const uint32_t *tok,
                                    uint32_t page, int *cache_tail)
{
    uint64_t stackkeys[KVT_SHARED_KEYS], *keys = stackkeys, next = 0;
    const kvt_block_t *tail = m->pages ? kvt__path_block(m->node, m->pages - 1) : NULL;
    *cache_tail = 0;
    if (tail && tail->hash) {
        kvt__path_keys(s, m->ns, tail->hash, tok + (size_t)m->pages * page, 1, &next);
    } else {
        if (m->pages + 1 > KVT_SHARED_KEYS && !(keys = malloc((m->pages + 1) * sizeof *keys)))
            return KVT_MISS_NEVER_SEEN; /* out of memory: as the shared MATCH's own */
        kvt__path_keys(s, m->ns, kvt__ns_seed(s, m->ns), tok, m->pages + 1, keys);
        next = keys[m->pages];
        *cache_tail = tail != NULL;
        if (keys != stackkeys)
            free(keys);
    }
    return kvt__ghost_seen(s, next) ? KVT_MISS_EVICTED : KVT_MISS_NEVER_SEEN;
}

/* Under the shared lock: the keys of a lookup's whole pages for the curve, those of m's pages
 * read from its blocks when the tree has them all (it caches them as a prefix of the path: the
 * last one cached means all are), the rest hashed on from there; else all hashed from the
 * namespace's seed (then cache_tail: cache them later). */
static void shared_keys(kvt_srv_t *s, const kvt_match_t *m, const uint32_t *tok, uint32_t page,
                        uint32_t whole, uint64_t *keys, int *cache_tail)
{
    const kvt_block_t *tail = m->pages ? kvt__path_block(m->node, m->pages - 1) : NULL;
    *cache_tail = 0;
    if (tail && tail->hash) {
        kvt__path_t p;
        for (kvt__path_walk(&p, m); p.run.node; kvt__path_step(&p))
            for (uint32_t i = 0; i < p.run.n; i++)
                keys[p.run.depth + i] = p.run.blocks[i].hash;
        if (whole > m->pages)
            kvt__path_keys(s, m->ns, tail->hash, tok + (size_t)m->pages * page, whole - m->pages,
                           keys + m->pages);
    } else {
        kvt__path_keys(s, m->ns, kvt__ns_seed(s, m->ns), tok, whole, keys);
        *cache_tail = tail != NULL;
    }
}

/* Room for n more page keys in l's deferred keys (at most KVT_LOOP_KEYS, grown as needed); 0 when
 * there is none. */
static int keys_room(kvt__loop_t *l, size_t n)
{
    if (l->nkeys + n <= l->keys_cap)
        return 1;
    if (l->nkeys + n > KVT_LOOP_KEYS)
        return 0;
    size_t cap = KVT_MAX(l->keys_cap * 2, KVT_MAX(l->nkeys + n, (size_t)1024));
    uint64_t *k = realloc(l->keys, KVT_MIN(cap, (size_t)KVT_LOOP_KEYS) * sizeof *k);
    if (!k)
        return 0;
    l->keys = k;
    l->keys_cap = KVT_MIN(cap, (size_t)KVT_LOOP_KEYS);
    return 1;
}

/*
 * Under the shared lock: c's lease on m's path, taken as kvt__match_answer takes it, its id in
 * *lease. Everything it writes that is not c's own goes through s->lease_mu, which every other
 * writer of it excludes by holding the write lock:
 *
 *   the tree's lease table, the pins on the   kvt__path_pin (kvt_radix_lease: the table may grow,
 *   path's nodes and the evictable list       and the index's bytes with it), under lease_mu; the
 *                                             shared paths read none of it (the walks read the
 *                                             nodes' shape and blocks, which a pin leaves alone)
 *   the room it needs in the index            kvt__index_fits, read under lease_mu: no other
 *                                             shared holder grows the index
 *   the NVMe segments' pins                   kvt__nvme_pin, under lease_mu (a shared GET's read,
 *                                             under s->submit, writes the segments' in-flight
 *                                             counts, not their pins)
 *   the namespace's lease count               kvt__lease_add, under lease_mu; read only by a
 *                                             HELLO's kvt__ns_evict, under the write lock
 *   c's lease list and its table by id        c's own: a GET on c's loop finds its lease there
 *                                             (kvt__lease_find), no other loop reads it
 *
 * The leases gauge is set under the write lock, by the scrape and STATS. Returns 0, or a negative
 * code when it took no lease and the write path is to answer (its reply says why): c holds
 * max-leases, the lease table would grow past index-bytes, no memory.
 */
static int shared_lease(kvt__conn_t *c, const kvt_match_t *m, const kvt_proto_match_t *q,
                        uint64_t *lease)
{
    kvt_srv_t *s = c->srv;
    if (c->nleases >= s->conf->max_leases)
        return KVT_ENOSPC;
    uint32_t ms = lease_ms(s, q->lease_ms);
    kvt__lease_t l = {
        .node = m->node,
        .pages = m->pages,
        .ns = m->ns,
        .expires_ns = kvt_now_ns() + (uint64_t)ms * 1000000,
        .engine_id = q->hints.engine_request_id,
    };
    pthread_mutex_lock(&s->lease_mu);
    int rc = kvt__index_fits(s, kvt__pin_need(s)) ? kvt__path_pin(s, m, c->id, &l.id) : KVT_ENOSPC;
    if (rc == 0) {
        kvt__nvme_pin(s, &l.pins, m->node, m->pages);
        if ((rc = kvt__lease_add(c, &l)) < 0) {
            kvt__nvme_unpin(s, &l.pins);
            kvt__path_unpin(s, l.id);
        }
    }
    pthread_mutex_unlock(&s->lease_mu);
    if (rc == 0)
        *lease = l.id;
    return rc;
}

/*
 * A MATCH without REMOTE, with LEASE or without, with KEEP, and with LOCATE under a lease, under
 * the lock shared: conn.c's framing hands it a run of them on c's own event (several loops), all
 * in one hold, and other loops' MATCHes and GETs run at the same time. Its walk only reads the
 * tree; what it writes is its loop's alone, c's own, or the lease's, under s->lease_mu
 * (shared_lease):
 *
 *   its counters and the reply's request metrics   the loop's table (l->metrics), merged on scrape;
 *   LOCATE's located pages                         so are they (match_locate's mt)
 *   the blocks' hits, the policy's use, a path's   l->hits, applied by the next write lock before
 *   last hash; the miss-ratio curve's sample       the tree can change (kvt__match_settle)
 *   the reply (c's queue: c is this loop's)        c's requests; the clients' memory it adds waits
 *                                                  in l->clients_bytes (kvt__out_add while shared)
 *   KEEP's handle: c's table, the tokens' copy,    c's own (only its loop's MATCHes and PUTs, and
 *   c->handle_bytes, c->handle_next                its close under the write lock, touch them)
 *   KEEP's share of the clients' memory            in l->clients_bytes too (kvt__clients_add)
 *
 * LOCATE's locations are read as a shared GET with LOCATE reads them (kvt__store_locate: c's
 * mapping and the DRAM tier's arena table, which change only under the write lock), in the hold
 * that took the lease that keeps them. The keys of the pages (the miss reason, the curve) are
 * hashed from the tokens when the tree has not cached them: caching is a write.
 *
 * Returns 1 when answered, 0 when it did nothing and the write path answers instead: a flag that
 * needs it (REMOTE; LOCATE without LEASE, which the write path refuses), no HELLO (the error
 * reply's log limiter is shared), the NVMe tier has dropped blocks (checking a path for them may
 * queue work, kvt__store_check_path), the loop's hits are full (the write lock applies them), the
 * seek failed (the write path reports it), no memory for the reply, the loop has no table of its
 * own, a LOCATE with a page in the HBM pool c mapped, a KEEP the clients' memory may refuse as
 * this loop sees it (the write path sees every loop's share of it), or a lease refused
 * (shared_lease: the write path's reply says why). Nothing is counted, kept or deferred before the
 * lease is taken, so the write path then answers the MATCH whole.
 */
int kvt__match_shares(const kvt_proto_hdr_t *h)
{
    unsigned f = h->flags;
    return !(f & ~(unsigned)KVT_MATCH_F_ALL) && !(f & KVT_MATCH_F_REMOTE) &&
           (!(f & KVT_MATCH_F_LOCATE) || (f & KVT_MATCH_F_LEASE));
}

int kvt__h_match_shared(kvt__conn_t *c, const kvt_proto_hdr_t *h, const uint8_t *body, uint64_t t0)
{
    kvt_srv_t *s = c->srv;
    kvt__loop_t *l = c->loop;
    kvt_proto_match_t q;
    uint32_t page = c->page_size;
    if (!kvt__match_shares(h) || !c->hello || !page || !l->metrics || l->nhits >= KVT_LOOP_HITS ||
        nvme_dropped(s) || kvt_proto_match_decode(body, h->body_len, &q) < 0 ||
        kvt__tokens(c, q.tokens, q.ntokens) < 0)
        return 0;
    int probe = (h->flags & KVT_MATCH_F_PROBE) != 0;
    uint32_t whole = q.ntokens / page, block = curve_block(c);
    /* The curve's keys for every whole page wait in the loop's keys with the sample: with no room
     * there, the write path counts the lookup (it applies the waiting samples first). */
    int curve = !probe && s->mrc && block;
    if (curve && !keys_room(l, whole))
        return 0;
    kvt__path_t p;
    if (kvt__path_seek(s, &p, c->ns, c->tok, q.ntokens, KVT_MATCH_NOTOUCH) < 0)
        return 0;
    kvt_match_t m = p.m;
    int locate = (h->flags & KVT_MATCH_F_LOCATE) != 0, keep = (h->flags & KVT_MATCH_F_KEEP) != 0;
    uint8_t stackbuf[sizeof(kvt_wire_match_reply_t) + 512];
    size_t len = sizeof(kvt_wire_match_reply_t) + m.pages;
    if (locate)
        len += sizeof(kvt_wire_match_locs_t) + (size_t)m.pages * 8;
    uint8_t *out = len <= sizeof stackbuf ? stackbuf : malloc(len);
    if (!out)
        return 0;
    uint8_t *tiers = out + sizeof(kvt_wire_match_reply_t);
    path_tiers(&m, tiers);
    /* A page in the HBM pool c mapped would be located by the HBM tier, which the shared paths
     * leave alone (a GET with an HBM page goes to the write path too). A KEEP the clients' memory
     * may refuse is left to the write path, which sees every loop's share of it. */
    if ((locate && c->zc_hbm && memchr(tiers, KVT_TIER_HBM, m.pages)) ||
        (keep && q.ntokens <= KVT_MATCH_HANDLE_BYTES / 4 && !handle_fits(c, q.ntokens))) {
        if (out != stackbuf)
            free(out);
        return 0;
    }
    /* The lease last of what may send the MATCH to the write path, and first of what it does. */
    uint64_t lease = 0;
    if ((h->flags & KVT_MATCH_F_LEASE) && m.pages > 0 && shared_lease(c, &m, &q, &lease) < 0) {
        if (out != stackbuf)
            free(out);
        return 0;
    }
    uint32_t ms = lease_ms(s, q.lease_ms);
    uint32_t handle = keep ? handle_keep(c, c->tok, q.ntokens, ms) : 0;
    kvt__hit_t *hit = &l->hits[l->nhits];
    kvt__count_hints(l->metrics, &q.hints);
    /* Keys: the curve's for every whole page (above); else only the reason's (shared_why). */
    uint32_t nkeys = curve ? whole : 0;
    kvt_miss_reason_t why = KVT_MISS_NEVER_SEEN;
    int cache_tail = 0;
    if (nkeys) {
        uint64_t *keys = l->keys + l->nkeys;
        shared_keys(s, &m, c->tok, page, whole, keys, &cache_tail);
        if (whole > m.pages)
            why = kvt__ghost_seen(s, keys[m.pages]) ? KVT_MISS_EVICTED : KVT_MISS_NEVER_SEEN;
    } else if (!probe && !curve && whole > m.pages) {
        why = shared_why(s, &m, c->tok, page, &cache_tail);
    }
    *hit = (kvt__hit_t){0};
    if (!probe) {
        count_match(s, l->metrics, c->metric_ns, m.pages, q.ntokens, page, tiers, why);
        if (s->mrc && (nkeys || !whole)) {
            hit->sample = 1;
            hit->whole = whole;
            hit->page = page;
            hit->block = block;
            hit->ntokens = q.ntokens;
            hit->keys_at = l->nkeys;
            l->nkeys += nkeys;
        }
    }
    if (!probe && m.pages) {
        hit->pending = 1;
        hit->cache_tail = cache_tail;
        hit->device = c->device;
        hit->m = m;
        hit->hints = q.hints;
    }
    if (hit->sample || hit->pending)
        l->nhits++;
    kvt__metric_add(l->metrics, KVT_M_LOOP_SHARED_MATCHES, l->id, 1);
    kvt_proto_match_reply_t w = {
        .tokens = m.pages * page, .pages = m.pages, .lease = lease, .handle = handle};
    kvt_proto_match_reply_encode(out, &w);
    if (locate)
        match_locate(c, l->metrics, &m, tiers, ms, tiers + m.pages);
    /* Out of memory for the reply closes the connection, as a handler's error does under the
     * write lock: the replies after it would answer the wrong requests. */
    if (kvt__reply(c, h->opcode, h->request_id, t0, 0, out, (uint32_t)len) < 0)
        c->closing = 1;
    if (out != stackbuf)
        free(out);
    return 1;
}

int kvt__h_match(kvt__conn_t *c, const kvt_proto_hdr_t *h, const uint8_t *body, uint64_t t0)
{
    kvt_srv_t *s = c->srv;
    kvt_proto_match_t q;
    if ((h->flags & ~(unsigned)KVT_MATCH_F_ALL) ||
        kvt_proto_match_decode(body, h->body_len, &q) < 0)
        return kvt__bad_body(c, h, t0, "MATCH");
    if (kvt__need_hello(c, h, t0) < 0)
        return 0;
    if ((h->flags & KVT_MATCH_F_LOCATE) && !(h->flags & KVT_MATCH_F_LEASE))
        return kvt__reply_error(
            c, h->opcode, h->request_id, t0, KVT_EINVAL,
            "MATCH with LOCATE needs LEASE: a location holds only under a lease");
    kvt__count_hints(s->metrics, &q.hints);
    if (kvt__tokens(c, q.tokens, q.ntokens) < 0)
        return kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_ENOMEM, "out of memory");
    /* A lookup only reads the tree and counts: no trim for the lease's room here (the
     * maintenance step keeps the index under its high mark; a lease that does not fit now is
     * refused, ENOSPC), and lost blocks are only reported, settled by the step. */
    kvt__path_t p;
    int rc = kvt__path_seek(s, &p, c->ns, c->tok, q.ntokens,
                            (h->flags & KVT_MATCH_F_PROBE) ? KVT_MATCH_NOTOUCH : 0);
    kvt_match_t m = p.m;
    if (rc < 0)
        return kvt__reply_error(c, h->opcode, h->request_id, t0, rc, "match failed");
    uint32_t block = curve_block(c);
    kvt__match_q_t mq = {.flags = h->flags,
                         .lease_ms = q.lease_ms,
                         .engine_id = q.hints.engine_request_id,
                         .ntokens = q.ntokens,
                         .page = c->page_size,
                         .block_bytes = block,
                         .tokens = c->tok};
    if (h->flags & KVT_MATCH_F_KEEP)
        mq.handle = handle_keep(c, c->tok, q.ntokens, lease_ms(s, q.lease_ms));
    kvt__store_check_path(s, &m, &mq.lost); /* blocks NVMe dropped are not reported stored */
    int down = 0;
    if ((h->flags & KVT_MATCH_F_REMOTE) &&
        kvt__probe_start(c, h, t0, &mq, &m, &q.hints, kvt__match_answer, &down))
        return 0; /* the probe's answer tells the policy */
    if (!(h->flags & KVT_MATCH_F_PROBE))
        kvt__policy_match(s, &m, &q.hints, c->device);
    return kvt__match_answer(c, NULL, h, t0, &mq, &m, 0, down);
}
