/*
 * op_probe.c: a MATCH's remote probe. It asks the remote tier whether it holds the pages after
 * the local match; the blocks it finds join this index as remote blocks (read by key), and the
 * MATCH is answered in its place in the reply queue once the probe has answered.
 */
#include "server.h"

#include <stdlib.h>
#include <string.h>

/* A MATCH waiting for the remote tier's answer about the pages after the local match. */
typedef struct kvt_rprobe {
    kvt_tier_probe_t probe;
    kvt__req_t *req;
    kvt_proto_hdr_t hdr;
    kvt__match_q_t q;
    kvt_proto_hints_t hints; /* for the policy, told once the probe has answered */
    uint32_t local_pages;
    uint32_t *tokens;
    kvt_block_key_t keys[KVT_TIER_PROBE_MAX];
    kvt__match_answer_fn answer;
} kvt_rprobe_t;

static void probe_done(kvt_tier_probe_t *p)
{
    kvt_rprobe_t *x = p->data;
    kvt__req_t *r = x->req;
    kvt_srv_t *s = r->srv;
    r->pending--;
    s->inflight--;
    kvt__conn_t *c = r->conn;
    if (!c) {
        kvt__req_finish(r);
        return;
    }
    c->inflight--;
    /* x->q's namespace, not c's: a HELLO since may have switched the connection to another. */
    uint32_t page = x->q.page, found = p->status == 0 ? p->found : 0;
    int down = p->status == KVT_EUNAVAIL || p->status == KVT_ETIMEDOUT;
    static kvt_log_limit_t lim; /* every MATCH with REMOTE while the server is down */
    if (p->status < 0)
        kvt_log_limited(&lim, KVT_LOG_INFO, "kvtierd: remote probe: %s", kvt_strerror(p->status));
    kvt__ns_t *ns;
    if (found > 0 && kvt__ns_get(s, r->ns, &ns) == 0 && ns->block_bytes) {
        /* The blocks another daemon stored join this index, held by the remote tier: a GET
         * reads them by key (location 0), promoting them to DRAM. */
        kvt_insert_t res;
        if (kvt__index_room(s, r->ns, x->tokens, (size_t)(x->local_pages + found) * page, 0,
                            NULL) == 0 &&
            kvt__path_insert(s, r->ns, NULL, x->tokens, (size_t)(x->local_pages + found) * page,
                             &res) == 0) {
            /* Runs of index-only pages join the policy as remote blocks (location 0: read by
             * key); pages that hold bytes here already, or are being written, stay as they are.
             * With the path pinned, a remote tier full in the policy's accounting makes room for
             * them as for a PUT's pages (its lowest-value blocks dropped): a fleet's daemon whose
             * share of the server is full would otherwise never take a run of found blocks
             * larger than its watermarks' headroom. */
            uint64_t pin = 0;
            if (kvt__pin(s, res.node, r->ns, &pin) < 0)
                pin = 0;
            for (uint32_t i = x->local_pages; i < res.pages;) {
                kvt_block_t *b = kvt__path_block(res.node, i);
                if (!b || b->tier != KVT_TIER_NONE || (b->flags & KVT_BLOCK_BUSY)) {
                    i++;
                    continue;
                }
                uint32_t j = i, held = 0;
                for (; j < res.pages; j++) {
                    kvt_block_t *e = kvt__path_block(res.node, j);
                    if (!e || e->tier != KVT_TIER_NONE || (e->flags & KVT_BLOCK_BUSY))
                        break;
                }
                while (pin && held < j - i &&
                       kvt_policy_hold(s->policy, KVT_TIER_REMOTE, ns->block_bytes, 1) == 0)
                    held++;
                for (uint32_t k = 0; k < held; k++)
                    kvt_policy_unhold(s->policy, KVT_TIER_REMOTE, ns->block_bytes);
                uint32_t end = pin ? i + held : j; /* unpinned: as many as fit, as before */
                for (uint32_t k = i; k < end; k++) {
                    kvt_block_t *e = kvt__path_block(res.node, k);
                    kvt__block_place(e, 0, ns->block_bytes); /* read by key */
                }
                if (end > i)
                    kvt__policy_adopt(s, res.node, i, end, KVT_TIER_REMOTE, res.pages, NULL);
                i = j;
            }
            if (pin)
                kvt__path_unpin(s, pin);
        } else {
            found = 0;
        }
    }
    kvt__path_t at;
    if (kvt__path_seek(s, &at, r->ns, x->tokens, x->q.ntokens, KVT_MATCH_NOTOUCH) < 0)
        memset(&at.m, 0, sizeof at.m);
    kvt_match_t m = at.m;
    kvt__store_check_path(s, &m, &x->q.lost); /* NVMe may have dropped blocks meanwhile */
    /* The policy hears of this use once, for the whole path: the local pages and the blocks
     * found remote (a hit too: promote them). */
    if (!(x->q.flags & KVT_MATCH_F_PROBE))
        kvt__policy_match(s, &m, &x->hints, r->conn ? r->conn->device : -1);
    uint32_t remote = m.pages > x->local_pages ? m.pages - x->local_pages : 0;
    x->answer(c, r, &x->hdr, r->t0, &x->q, &m, remote, down); /* kicks c */
}

/* Starts a remote probe for the pages after m; returns 1 when the reply will come later. */
int kvt__probe_start(kvt__conn_t *c, const kvt_proto_hdr_t *h, uint64_t t0, const kvt__match_q_t *q,
                     const kvt_match_t *m, const kvt_proto_hints_t *hints,
                     kvt__match_answer_fn answer, int *down)
{
    kvt_srv_t *s = c->srv;
    kvt_tier_t *remote = s->tiers[KVT_TIER_REMOTE];
    uint32_t page = q->page, whole = q->ntokens / page;
    kvt__ns_t *nsr; /* blocks found there are read by the namespace's size (probe_done) */
    if (!remote || whole <= m->pages || kvt__ns_get(s, c->ns, &nsr) < 0 || !nsr->block_bytes)
        return 0;
    uint32_t n = KVT_MIN(whole - m->pages, KVT_TIER_PROBE_MAX);
    kvt_rprobe_t *x = calloc(1, sizeof *x + (size_t)q->ntokens * 4);
    kvt__req_t *r = x ? kvt__req_new(c, KVT_REQ_PLAIN, h->opcode, h->request_id, t0) : NULL;
    if (!r) {
        free(x);
        return 0;
    }
    r->extra = x;
    kvt__req_ns(r, c->ns);
    x->req = r;
    x->answer = answer;
    x->hdr = *h;
    x->q = *q;
    x->hints = *hints;
    x->local_pages = m->pages;
    x->tokens = (uint32_t *)(x + 1);
    memcpy(x->tokens, q->tokens, (size_t)q->ntokens * 4);
    x->q.tokens = x->tokens;
    uint64_t seed = kvt__ns_seed(s, c->ns);
    uint64_t prev = kvt__path_tail(s, m);
    uint64_t hashes[KVT_TIER_PROBE_MAX];
    kvt__path_keys(s, c->ns, prev, x->tokens + (size_t)m->pages * page, n, hashes);
    for (uint32_t i = 0; i < n; i++) {
        x->keys[i] = (kvt_block_key_t){.ns_seed = seed,
                                       .hash = hashes[i],
                                       .parent = i ? hashes[i - 1] : prev,
                                       .tokens = x->tokens + (size_t)(m->pages + i) * page,
                                       .ntokens = page};
    }
    x->probe.keys = x->keys;
    x->probe.n = n;
    x->probe.cb = probe_done;
    x->probe.data = x;
    int rc = kvt__tier_probe(s, &x->probe);
    if (rc < 0) {
        /* Not started: answer from the local match in this request's slot. */
        *down = rc == KVT_EUNAVAIL || rc == KVT_ETIMEDOUT;
        if (!(q->flags & KVT_MATCH_F_PROBE))
            kvt__policy_match(s, m, hints, c->device);
        kvt_match_t lm = *m;
        answer(c, r, h, t0, &x->q, &lm, 0, *down);
        return 1;
    }
    r->pending++;
    s->inflight++;
    c->inflight++;
    return 1;
}
