/*
 * op_prefetch.c: PREFETCH. It pins the matched path and asks the policy to promote it up to a
 * tier in rounds, waits for moves others started on its path, and answers with what moved when
 * they land or at its deadline (or as soon as they started, with START).
 */
#include "server.h"

/* ---- PREFETCH ---- */

/* Pages of r's path at its target tier or faster; *busy gets those below it that a move has in
 * flight (a GET's promotion, another PREFETCH's, the policy's). */
static uint32_t prefetch_count(kvt__req_t *r, uint32_t *busy)
{
    uint32_t at = 0;
    *busy = 0;
    kvt_match_t m = {
        .node = r->node,
        .node_pages = r->pages - kvt__node_depth(r->node),
        .pages = r->pages,
    };
    kvt__path_t p;
    for (kvt__path_walk(&p, &m); p.run.node; kvt__path_step(&p))
        for (uint32_t i = 0; i < p.run.n; i++) {
            const kvt_block_t *b = &p.run.blocks[i];
            if (b->tier != KVT_TIER_NONE && b->tier <= r->prefetch.target)
                at++;
            else if (b->tier != KVT_TIER_NONE && (b->flags & KVT_BLOCK_BUSY))
                (*busy)++;
        }
    return at;
}

static void prefetch_reply(kvt_srv_t *s, kvt__req_t *r)
{
    (void)s;
    uint32_t moved = r->prefetch.moved;
    if (r->prefetch.start_only && r->status == 0) {
        /* On their way: at the target since the count before the round, or in a move up. */
        uint32_t busy, at = prefetch_count(r, &busy);
        moved = (at > r->prefetch.resident ? at - r->prefetch.resident : 0) + busy;
    }
    uint32_t failed = r->pages - KVT_MIN(r->pages, r->prefetch.resident + moved);
    kvt_proto_prefetch_reply_t p = {
        .pages = r->pages,
        .moved = moved,
        .resident = r->prefetch.resident,
        .failed = failed,
    };
    uint8_t w[sizeof(kvt_wire_prefetch_reply_t)];
    kvt_proto_prefetch_reply_encode(w, &p);
    r->prefetch.replied = 1;
    kvt__req_reply(r, w, r->status < 0 ? 0 : sizeof w);
}

#define KVT_PREFETCH_ROUNDS 16

static int prefetch_round(kvt_srv_t *s, kvt__req_t *r)
{
    uint32_t node_pages = r->pages - kvt__node_depth(r->node);
    r->prefetch.progress = 0;
    r->prefetch.rounds++;
    int rc = kvt__store_promote(s, r->node, node_pages, (kvt_tier_id_t)r->prefetch.target, r,
                                r->conn ? r->conn->device : -1);
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
static int prefetch_wait(kvt__req_t *r, int rc)
{
    uint32_t busy;
    if (r->pending > 0 || r->prefetch.replied || !r->conn || kvt_now_ns() >= r->deadline_ns)
        return 0;
    uint32_t at = prefetch_count(r, &busy);
    r->prefetch.waiting = at < r->pages && (busy > 0 || rc == KVT_EAGAIN);
    if (r->prefetch.waiting) {
        kvt_srv_t *s = r->conn->srv;
        s->reqs_waiting = 1;
        if (!r->prefetch.waited)
            kvt__metric_add(s->metrics, KVT_M_PREFETCH_WAITS, 0, 1);
        r->prefetch.waited = 1;
    }
    return r->prefetch.waiting;
}

/*
 * A move a PREFETCH waits for has finished (kvt_move_finish counted it). When they all have and
 * pages are still below the target (the target tier had to be emptied first: its demotions were
 * among the moves), the next round promotes what now fits, until the deadline.
 */
static void prefetch_moved(kvt_srv_t *s, kvt__req_t *r, int ok, uint32_t promoted)
{
    r->prefetch.moved += promoted;
    if (ok)
        r->prefetch.progress = 1;
    if (r->pending > 0)
        return;
    /* START: answered already, its rounds go on as its moves land, connection or not. */
    int more = r->prefetch.start_only || (!r->prefetch.replied && r->conn);
    if (more && r->prefetch.progress && r->prefetch.resident + r->prefetch.moved < r->pages &&
        r->prefetch.rounds < KVT_PREFETCH_ROUNDS && kvt_now_ns() < r->deadline_ns) {
        int rc = prefetch_round(s, r);
        if (r->pending > 0 || prefetch_wait(r, rc))
            return;
    }
    kvt__unpin(s, r);
    if (!r->prefetch.replied)
        prefetch_reply(s, r);
    kvt__req_finish(r);
}

/*
 * The policy promotes the path up to r->prefetch.target (making room there by demoting others if it
 * must); the moves it starts for this path report to r, which answers when they are done or at
 * its deadline, whichever comes first.
 */
int kvt__store_prefetch(kvt_srv_t *s, kvt__req_t *r)
{
    r->on_move = prefetch_moved;
    if (r->status == 0 && s->policy) {
        uint32_t busy;
        r->prefetch.resident = prefetch_count(r, &busy);
        if (r->prefetch.resident < r->pages) {
            int rc = prefetch_round(s, r);
            if (!r->prefetch.start_only && prefetch_wait(r, rc))
                return 0;
        }
    }
    if (r->prefetch.start_only && r->pending > 0) {
        /* START: answered now with what is on its way; more rounds start as those moves land
         * (prefetch_moved), until the deadline, with no further reply. */
        prefetch_reply(s, r);
        kvt__req_finish(r);
        return 0;
    }
    if (r->pending == 0) {
        kvt__unpin(s, r);
        prefetch_reply(s, r);
        kvt__req_finish(r);
    }
    return 0;
}

int kvt__h_prefetch(kvt__conn_t *c, const kvt_proto_hdr_t *h, const uint8_t *body, uint64_t t0)
{
    kvt_srv_t *s = c->srv;
    kvt_proto_prefetch_t q;
    if ((h->flags & ~KVT_PREFETCH_F_ALL) || kvt_proto_prefetch_decode(body, h->body_len, &q) < 0)
        return kvt__bad_body(c, h, t0, "PREFETCH");
    if (kvt__need_hello(c, h, t0) < 0)
        return 0;
    if (q.tier != KVT_TIER_HBM && q.tier != KVT_TIER_DRAM && q.tier != KVT_TIER_NVME)
        return kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_EINVAL,
                                "PREFETCH moves up to hbm (1), dram (2) or nvme (3), not %u",
                                q.tier);
    if (!s->tiers[q.tier])
        return kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_EUNAVAIL,
                                "the %s tier is not configured", kvt_tier_name(q.tier));
    if (kvt__tokens(c, q.tokens, q.ntokens) < 0)
        return kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_ENOMEM, "out of memory");
    kvt__index_fit(s, kvt__pin_need(s)); /* room for the pin, before the match */
    kvt__path_t p;
    int rc = kvt__path_seek(s, &p, c->ns, c->tok, q.ntokens, KVT_MATCH_NOTOUCH);
    if (rc < 0)
        return kvt__reply_error(c, h->opcode, h->request_id, t0, rc, "match failed");
    if (p.m.pages == 0) {
        uint8_t w[sizeof(kvt_wire_prefetch_reply_t)];
        kvt_proto_prefetch_reply_encode(w, &(kvt_proto_prefetch_reply_t){0});
        return kvt__reply(c, h->opcode, h->request_id, t0, 0, w, sizeof w);
    }
    kvt__req_t *r = kvt__req_new(c, KVT_REQ_PREFETCH, h->opcode, h->request_id, t0);
    if (!r)
        return kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_ENOMEM, "out of memory");
    kvt__req_ns(r, c->ns);
    r->node = p.m.node;
    r->pages = p.m.pages;
    r->prefetch.target = q.tier;
    r->prefetch.start_only = (h->flags & KVT_PREFETCH_F_START) != 0;
    r->deadline_ns = t0 + (uint64_t)(q.deadline_ms ? q.deadline_ms : s->conf->lease_ms) * 1000000;
    kvt__ns_t *ns;
    kvt__ns_get(s, c->ns, &ns);
    r->block_bytes = ns->block_bytes;
    if ((rc = kvt__pin(s, p.m.node, c->ns, &r->lease)) < 0)
        r->status = rc;
    kvt__store_prefetch(s, r); /* replies at once when nothing moves */
    return 0;
}

int kvt__prefetch_deadline(kvt__req_t *r, uint64_t now)
{
    kvt_srv_t *s = r->srv;
    if (r->prefetch.waiting && r->pending == 0) {
        uint32_t busy, at = prefetch_count(r, &busy);
        if (busy > 0 && now < r->deadline_ns) {
            s->reqs_waiting = 1;
            return 0; /* the other moves are still running */
        }
        /* They landed (or failed): what reached the target without this request's own moves
         * is resident; what did not gets one more round, if there is time. */
        r->prefetch.waiting = 0;
        r->prefetch.resident = at > r->prefetch.moved ? at - r->prefetch.moved : 0;
        if (now < r->deadline_ns && r->prefetch.resident + r->prefetch.moved < r->pages) {
            int rc = prefetch_round(s, r);
            if (r->pending > 0 || prefetch_wait(r, rc))
                return 0;
        }
        kvt__unpin(s, r);
        prefetch_reply(s, r);
        kvt__req_finish(r);
        s->reqs_waiting = 1; /* others after it: looked at next time */
        return 1;
    }
    if (!r->prefetch.replied && r->pending > 0 && now >= r->deadline_ns) {
        prefetch_reply(s, r);
        kvt__req_finish(r);
        return 1;
    }
    return 0;
}
