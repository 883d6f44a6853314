/*
 * lease.c: the leases a connection holds on matched paths (MATCH with LEASE), found by id at
 * once however many it holds, expired by the tick, pinned against NVMe segment reclaim
 * (tierio.c kvt__nvme_pin), and all released when the connection closes; RELEASE.
 */
#include "server.h"

#include <stdlib.h>

/*
 * Leases. A connection keeps its leases in a list (the tick walks it for expiry); the server's
 * lease_pos says where in its owner's list each one is, by the tree's lease slot, so a GET or
 * RELEASE finds its lease at once among the thousands an engine's connection may hold.
 */

/* Leases by namespace: one a lease holds keeps its pages (kvt__ns_evict passes it by). Every
 * leased namespace was declared by a HELLO, which made its entry. */
static void lease_ns(kvt_srv_t *s, uint32_t ns, int delta)
{
    kvt_assert(ns < s->nns && (delta > 0 || s->ns[ns].leases > 0));
    s->ns[ns].leases += (uint32_t)delta;
}

int kvt__lease_add(kvt__conn_t *c, const kvt__lease_t *l)
{
    kvt_srv_t *s = c->srv;
    uint32_t slot = kvt__lease_slot(l->id);
    if (kvt_reserve(&s->leases.pos, &s->leases.pos_cap, (size_t)slot + 1, sizeof *s->leases.pos,
                    64) < 0 ||
        kvt_reserve(&c->leases, &c->cap_leases, c->nleases + 1, sizeof *c->leases, 8) < 0)
        return KVT_ENOMEM;
    s->leases.pos[slot] = (uint32_t)c->nleases;
    c->leases[c->nleases++] = *l;
    lease_ns(s, l->ns, 1);
    if (c->nleases == 1 || l->expires_ns < c->lease_next_ns)
        c->lease_next_ns = l->expires_ns;
    kvt__metric_set(c->srv->metrics, KVT_M_LEASES, 0, (double)kvt__lease_count(c->srv));
    return 0;
}

/* c's lease id, or NULL: a stale id, or another connection's lease, is not found (the entry at
 * its slot's position, if any, has another id). */
kvt__lease_t *kvt__lease_find(kvt__conn_t *c, uint64_t id)
{
    const kvt_srv_t *s = c->srv;
    uint32_t slot = kvt__lease_slot(id);
    if (slot >= s->leases.pos_cap)
        return NULL;
    uint32_t i = s->leases.pos[slot];
    return i < c->nleases && c->leases[i].id == id ? &c->leases[i] : NULL;
}

static void lease_del(kvt__conn_t *c, kvt__lease_t *l)
{
    /* Before the path goes: its GETs' later batches. One of them may keep the lease's pin. */
    if (!c->srv->conn_ops->lease_ends(c, l->node, l->id))
        kvt__path_unpin(c->srv, l->id);
    kvt__nvme_unpin(c->srv, &l->pins);
    lease_ns(c->srv, l->ns, -1);
    *l = c->leases[--c->nleases];
    if (l != c->leases + c->nleases) /* the last one moved into l's place */
        c->srv->leases.pos[kvt__lease_slot(l->id)] = (uint32_t)(l - c->leases);
    kvt__metric_set(c->srv->metrics, KVT_M_LEASES, 0, (double)kvt__lease_count(c->srv));
}

void kvt__lease_drop_all(kvt__conn_t *c)
{
    /* Every lease the connection owns is in its list (a MATCH releases one it cannot list). */
    size_t n = c->nleases;
    for (size_t i = 0; i < c->nleases; i++) {
        kvt__path_unpin(c->srv, c->leases[i].id);
        kvt__nvme_unpin(c->srv, &c->leases[i].pins);
        lease_ns(c->srv, c->leases[i].ns, -1);
    }
    if (n)
        kvt_log(KVT_LOG_DEBUG, "kvtierd: connection %llu: released %zu leases on close",
                (unsigned long long)c->id, n);
    c->nleases = 0;
    kvt__metric_set(c->srv->metrics, KVT_M_LEASES, 0, (double)kvt__lease_count(c->srv));
}

void kvt__lease_expire(kvt__conn_t *c, uint64_t now)
{
    /* Every tick, over every connection: the list is walked only when one of its leases is due
     * (a connection may hold max-leases of them). */
    if (c->nleases == 0 || now < c->lease_next_ns)
        return;
    uint64_t next = UINT64_MAX;
    for (size_t i = 0; i < c->nleases;) {
        if (c->leases[i].expires_ns <= now) {
            kvt_log(KVT_LOG_DEBUG,
                    "kvtierd: connection %llu: lease %llu (engine request %llu) "
                    "expired",
                    (unsigned long long)c->id, (unsigned long long)c->leases[i].id,
                    (unsigned long long)c->leases[i].engine_id);
            kvt__metric_add(c->srv->metrics, KVT_M_LEASES_EXPIRED, 0, 1);
            lease_del(c, &c->leases[i]);
        } else {
            next = KVT_MIN(next, c->leases[i].expires_ns);
            i++;
        }
    }
    c->lease_next_ns = next;
}

int kvt__h_release(kvt__conn_t *c, const kvt_proto_hdr_t *h, const uint8_t *body, uint64_t t0)
{
    uint64_t id;
    if (h->flags || kvt_proto_release_decode(body, h->body_len, &id) < 0)
        return kvt__bad_body(c, h, t0, "RELEASE");
    kvt__lease_t *l = kvt__lease_find(c, id);
    if (l)
        lease_del(c, l);
    uint8_t w[sizeof(kvt_wire_release_reply_t)];
    kvt_proto_release_reply_encode(w, l ? 1 : 0);
    return kvt__reply(c, h->opcode, h->request_id, t0, 0, w, sizeof w);
}
