/*
 * op_remove.c: REMOVE. A prefix leased by a client is refused at once; one held only by the
 * daemon's own work (a move, a request's I/O) waits for it, retried as moves land and every tick,
 * for at most KVT_REMOVE_WAIT_MS.
 */
#include "server.h"

#include <errno.h>

#define KVT_REMOVE_WAIT_MS 1000

/*
 * Whether a connection's lease holds what removing tokens[0, n) would remove: the node holding
 * its last whole page, or one below it. Such a REMOVE is refused (EBUSY) at once; one held only by
 * the daemon's own work (a move, a request's I/O) waits for it instead.
 */
static int remove_leased(kvt_srv_t *s, uint32_t ns, const uint32_t *tokens, uint32_t n)
{
    kvt__path_t p;
    uint32_t pages = n / kvt__ns_page_size(s, ns);
    if (kvt__path_seek(s, &p, ns, tokens, n, KVT_MATCH_NOTOUCH) < 0 || pages == 0 ||
        p.m.pages < pages)
        return 0;
    kvt_radix_node_t *top = kvt__path_holder(p.m.node, pages - 1);
    uint32_t d = kvt__node_depth(top);
    for (kvt__conn_t *c = s->clients.list; c; c = c->next)
        for (size_t i = 0; i < c->nleases; i++)
            if (kvt__path_holder(c->leases[i].node, d) == top) /* top on the lease's path */
                return 1;
    return 0;
}

static int remove_path(kvt_srv_t *s, uint32_t ns, const uint32_t *tokens, uint32_t n)
{
    return kvt__store_remove(s, ns, tokens, n);
}

static void remove_reply(kvt__req_t *r, int rc)
{
    r->status = rc;
    kvt__req_reply(r, NULL, 0);
    kvt__req_finish(r);
}

int kvt__remove_retry(kvt__req_t *r, uint64_t now)
{
    kvt_srv_t *s = r->srv;
    const uint32_t *tokens = (const uint32_t *)(void *)r->payload;
    int rc = remove_path(s, r->ns, tokens, r->pages);
    if (rc == KVT_EBUSY && now < r->deadline_ns && !remove_leased(s, r->ns, tokens, r->pages))
        return 0;
    remove_reply(r, rc);
    return 1;
}

int kvt__h_remove(kvt__conn_t *c, const kvt_proto_hdr_t *h, const uint8_t *body, uint64_t t0)
{
    kvt_srv_t *s = c->srv;
    uint32_t n;
    const uint8_t *tok;
    if ((h->flags & ~KVT_REMOVE_F_ALL) || kvt_proto_remove_decode(body, h->body_len, &n, &tok) < 0)
        return kvt__bad_body(c, h, t0, "REMOVE");
    if (kvt__need_hello(c, h, t0) < 0)
        return 0;
    if (kvt__tokens(c, tok, n) < 0)
        return kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_ENOMEM, "out of memory");
    int rc = remove_path(s, c->ns, c->tok, n);
    if (rc == KVT_EBUSY && (h->flags & KVT_REMOVE_F_NOWAIT))
        return kvt__reply_error(c, h->opcode, h->request_id, t0, rc, "remove of %u tokens: %s", n,
                                remove_leased(s, c->ns, c->tok, n)
                                    ? "a lease holds them"
                                    : "busy with moves or requests in flight (NOWAIT)");
    if (rc == KVT_EBUSY && !remove_leased(s, c->ns, c->tok, n)) {
        /* Held by moves or requests in flight, which end soon: wait for them (retried when
         * moves land and every tick) rather than answer "try again". For at most
         * KVT_REMOVE_WAIT_MS: the policy may keep starting moves under it (demotions into a
         * remote tier that is down fail and start again), and the connection's later replies
         * wait behind it. */
        kvt__req_t *r = kvt__req_new(c, KVT_REQ_REMOVE, h->opcode, h->request_id, t0);
        if (r && kvt__req_hold(r, c->tok, (size_t)n * sizeof(uint32_t)) == 0) {
            kvt__req_ns(r, c->ns);
            r->pages = n; /* tokens, for a REMOVE */
            r->deadline_ns = kvt_now_ns() + KVT_REMOVE_WAIT_MS * 1000000ull;
            s->reqs_waiting = 1;
            return 0;
        }
        if (r) {
            remove_reply(r, KVT_ENOMEM);
            return 0;
        }
        rc = KVT_ENOMEM;
    }
    if (rc < 0)
        return kvt__reply_error(c, h->opcode, h->request_id, t0, rc, "remove of %u tokens", n);
    return kvt__reply(c, h->opcode, h->request_id, t0, 0, NULL, 0);
}
