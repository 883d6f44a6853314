/*
 * lease.c: the leases a connection holds on matched paths (MATCH with LEASE), found by id at
 * once however many it holds, expired by the tick, pinned against NVMe segment reclaim
 * (tierio.c kvt__nvme_pin), and all released when the connection closes; RELEASE.
 *
 * A lease is added by c's loop, with the lock for writing or shared (op_match.c, a MATCH with
 * LEASE answered shared, holding s->lease_mu); it goes by c's loop too, under the write lock
 * (expiry, a close, a RELEASE that a GET of c still reads under) or shared (a RELEASE, holding
 * s->lease_mu: kvt__h_release_shared). The leases gauge is not set here: STATS, the scrape and the
 * tick set it under the write lock (store.c kvt__tier_metrics) before anything reads it.
 */
#include "server.h"

#include <stdlib.h>
#include <string.h>

/*
 * Leases. A connection keeps its leases in a list (the tick walks it for expiry), and finds one
 * by id through a table of their positions, plus one (0 is empty), that follows the list in its
 * allocation: 2 * cap_leases entries (a power of two), linear probing, at most half full.
 *
 *   c->leases: [ lease 0 | lease 1 | ... | lease cap-1 ][ pos+1 | 0 | 0 | pos+1 | ... 2 cap ]
 *
 * Both are c's alone, so a GET on c's loop reads them with the lock shared while other loops add
 * leases of their own connections (a server-wide table by the tree's lease slot did this before:
 * a leased MATCH's growth of it moved it under every other loop's GET).
 */

static uint32_t *map_of(const kvt__conn_t *c)
{
    return (uint32_t *)(c->leases + c->cap_leases);
}

static uint32_t map_home(const kvt__conn_t *c, uint64_t id)
{
    return (uint32_t)((id * 0x9e3779b97f4a7c15ull) >> 32) & (uint32_t)(c->cap_leases * 2 - 1);
}

/* The table's entry for id, or NULL. */
static uint32_t *map_find(const kvt__conn_t *c, uint64_t id)
{
    if (!c->cap_leases)
        return NULL;
    uint32_t *map = map_of(c), mask = (uint32_t)(c->cap_leases * 2 - 1);
    for (uint32_t i = map_home(c, id);; i = (i + 1) & mask) {
        if (!map[i])
            return NULL;
        if (c->leases[map[i] - 1].id == id)
            return &map[i];
    }
}

static void map_put(kvt__conn_t *c, uint64_t id, uint32_t pos)
{
    uint32_t *map = map_of(c), mask = (uint32_t)(c->cap_leases * 2 - 1), i = map_home(c, id);
    while (map[i])
        i = (i + 1) & mask;
    map[i] = pos + 1;
}

/* Room for one lease more: the list and its table move to an allocation twice the size, the
 * table rebuilt. */
static int lease_reserve(kvt__conn_t *c)
{
    if (c->nleases < c->cap_leases)
        return 0;
    size_t cap = c->cap_leases ? c->cap_leases * 2 : 8;
    if (cap > UINT32_MAX / 4)
        return KVT_ENOMEM;
    kvt__lease_t *v = calloc(1, cap * sizeof *v + cap * 2 * sizeof(uint32_t));
    if (!v)
        return KVT_ENOMEM;
    if (c->nleases)
        memcpy(v, c->leases, c->nleases * sizeof *v);
    free(c->leases);
    c->leases = v;
    c->cap_leases = cap;
    for (size_t i = 0; i < c->nleases; i++)
        map_put(c, c->leases[i].id, (uint32_t)i);
    return 0;
}

/* Takes id's entry out of the table, moving each entry after it in its run back into the hole
 * when the hole lies between its home and where it is (no tombstones: lookups stop at a hole).
 * The leases the entries name must still be in the list. */
static void map_del(kvt__conn_t *c, uint64_t id)
{
    uint32_t *map = map_of(c), *e = map_find(c, id), mask = (uint32_t)(c->cap_leases * 2 - 1);
    kvt_assert(e);
    uint32_t hole = (uint32_t)(e - map);
    for (uint32_t j = (hole + 1) & mask; map[j]; j = (j + 1) & mask) {
        uint32_t home = map_home(c, c->leases[map[j] - 1].id);
        /* It stays unless its home is cyclically outside (hole, j]. */
        int stays = hole < j ? home > hole && home <= j : home > hole || home <= j;
        if (!stays) {
            map[hole] = map[j];
            hole = j;
        }
    }
    map[hole] = 0;
}

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
    if (lease_reserve(c) < 0)
        return KVT_ENOMEM;
    map_put(c, l->id, (uint32_t)c->nleases);
    c->leases[c->nleases++] = *l;
    lease_ns(s, l->ns, 1);
    if (c->nleases == 1 || l->expires_ns < c->lease_next_ns)
        c->lease_next_ns = l->expires_ns;
    return 0;
}

/* c's lease id, or NULL: a stale id, or another connection's lease, is not in c's table. */
kvt__lease_t *kvt__lease_find(kvt__conn_t *c, uint64_t id)
{
    uint32_t *e = map_find(c, id);
    return e ? &c->leases[*e - 1] : NULL;
}

/* l leaves c's list and table (c's own), the last lease moving into its place. */
static void lease_forget(kvt__conn_t *c, kvt__lease_t *l)
{
    map_del(c, l->id);
    *l = c->leases[--c->nleases];
    if (l != c->leases + c->nleases) { /* the last one moved into l's place */
        uint32_t *e = map_find(c, l->id);
        kvt_assert(e);
        *e = (uint32_t)(l - c->leases) + 1;
    }
}

static void lease_del(kvt__conn_t *c, kvt__lease_t *l)
{
    /* Before the path goes: its GETs' later batches. One of them may keep the lease's pin. */
    if (!c->srv->conn_ops->lease_ends(c, l->node, l->id))
        kvt__path_unpin(c->srv, l->id);
    kvt__nvme_unpin(c->srv, &l->pins);
    lease_ns(c->srv, l->ns, -1);
    lease_forget(c, l);
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
    if (c->cap_leases)
        memset(map_of(c), 0, c->cap_leases * 2 * sizeof(uint32_t));
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

/*
 * A RELEASE under the lock shared (conn.c's framing, several loops), beside other loops' MATCHes,
 * GETs and RELEASEs. It ends the lease as lease_del does, and writes, under s->lease_mu what is
 * not c's (the mutex a MATCH with LEASE answered shared takes its lease under, op_match.c
 * shared_lease; every other writer of it holds the write lock, which excludes this):
 *
 *   the tree's lease table, the pins on the   kvt__path_unpin (kvt_radix_release: the slot, the
 *   path's nodes, the evictable list and      nodes' counts, their place in the list); the shared
 *   the count of leases ended                 paths read none of it, and those who act on an end
 *                                             (the step's kept copies and parked promotions, the
 *                                             policy's walk for victims) look at that count under
 *                                             the write lock, at the next step (a write's, or the
 *                                             tick's): the end waits for them there, unlost
 *   the NVMe segments' pins                   kvt__nvme_unpin (a count: reclaim reads it under the
 *                                             write lock)
 *   the namespace's lease count               lease_ns: read only under the write lock
 *   c's lease list and its table by id        c's own (lease_forget)
 *
 * A lease that a GET of c still reads under (kvt__get_lease_reads: pages left, reads in flight,
 * a batch to check) goes by the write path, which hands that GET the lease's pin
 * (kvt__get_lease_ends). A REMOVE of a prefix a client leases is refused at once, never waits for
 * its lease (op_remove.c), so no REMOVE is to be woken. A lease c does not hold (released
 * already, expired, another connection's) is answered 0 here as there: nothing to write. Counted
 * in the loop's table (kvtier_loop_shared_releases_total). Returns 1 when answered, 0 when it did
 * nothing and the write path takes the frame: a bad body, such a GET, or no loop table.
 */
int kvt__h_release_shared(kvt__conn_t *c, const kvt_proto_hdr_t *h, const uint8_t *body,
                          uint64_t t0)
{
    kvt_srv_t *s = c->srv;
    uint64_t id;
    if (h->flags || !c->loop->metrics || kvt_proto_release_decode(body, h->body_len, &id) < 0)
        return 0;
    kvt__lease_t *l = kvt__lease_find(c, id);
    if (l && s->conn_ops->lease_reads(c, l->node))
        return 0;
    if (l) {
        pthread_mutex_lock(&s->lease_mu);
        kvt__path_unpin(s, l->id);
        kvt__nvme_unpin(s, &l->pins);
        lease_ns(s, l->ns, -1);
        pthread_mutex_unlock(&s->lease_mu);
        lease_forget(c, l);
    }
    kvt__metric_add(c->loop->metrics, KVT_M_LOOP_SHARED_RELEASES, c->loop->id, 1);
    uint8_t w[sizeof(kvt_wire_release_reply_t)];
    kvt_proto_release_reply_encode(w, l ? 1 : 0);
    /* Out of memory for the reply closes the connection, as a handler's error does under the
     * write lock: the replies after it would answer the wrong requests. */
    if (kvt__reply(c, h->opcode, h->request_id, t0, 0, w, sizeof w) < 0)
        c->closing = 1;
    return 1;
}
