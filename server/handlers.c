/*
 * handlers.c: what each request does. A frame arrives here whole (conn.c found its end); each
 * handler decodes its body with proto.c, checks it against the connection's state (AUTH first
 * when a secret is set, HELLO before anything that names a namespace), acts on the index, and
 * either replies at once or hands the tier work to store.c with a place in the reply queue.
 * A bad body gets an error reply and changes nothing; only framing errors close a connection.
 * Leases a connection takes are listed here, expire here, and all go when it closes.
 */
#include "server.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config.h" /* KVT_VERSION */

/* Points c->tok at the frame's tokens in host order: the frame itself when the host is
 * little-endian and they are aligned (no copy on the hot path), else a copy. Valid until the
 * next frame. */
static int kvt_tokens(kvt__conn_t *c, const uint8_t *src, uint32_t n)
{
#if __BYTE_ORDER == __LITTLE_ENDIAN
    if (((uintptr_t)src & (_Alignof(uint32_t) - 1)) == 0) {
        c->tok = (const uint32_t *)(const void *)src;
        return 0;
    }
#endif
    size_t had = c->tokens_cap;
    if (kvt_reserve(&c->tokens, &c->tokens_cap, n, sizeof *c->tokens, 4096) < 0)
        return KVT_ENOMEM;
    c->srv->client_bytes += (c->tokens_cap - had) * sizeof *c->tokens;
    kvt_proto_tokens(src, n, c->tokens);
    c->tok = c->tokens;
    return 0;
}

static uint16_t kvt_tier_mask(const kvt_srv_t *s)
{
    uint16_t m = 0;
    for (int i = 1; i < KVT_TIER_COUNT; i++)
        if (s->tiers[i])
            m |= (uint16_t)(1u << i);
    return m;
}

/*
 * Leases. A connection keeps its leases in a list (the tick walks it for expiry); the server's
 * lease_pos says where in its owner's list each one is, by the tree's lease slot, so a GET or
 * RELEASE finds its lease at once among the thousands an engine's connection may hold.
 */

/* Leases by namespace: one a lease holds keeps its pages (kvt__ns_evict passes it by). Every
 * leased namespace was declared by a HELLO, which made its entry. */
static void kvt_lease_ns(kvt_srv_t *s, uint32_t ns, int delta)
{
    kvt_assert(ns < s->nns && (delta > 0 || s->ns[ns].leases > 0));
    s->ns[ns].leases += (uint32_t)delta;
}

static int kvt_lease_add(kvt__conn_t *c, const kvt__lease_t *l)
{
    kvt_srv_t *s = c->srv;
    uint32_t slot = kvt_radix_lease_slot(l->id);
    if (kvt_reserve(&s->lease_pos, &s->lease_pos_cap, (size_t)slot + 1, sizeof *s->lease_pos, 64) <
            0 ||
        kvt_reserve(&c->leases, &c->cap_leases, c->nleases + 1, sizeof *c->leases, 8) < 0)
        return KVT_ENOMEM;
    s->lease_pos[slot] = (uint32_t)c->nleases;
    c->leases[c->nleases++] = *l;
    kvt_lease_ns(s, l->ns, 1);
    if (c->nleases == 1 || l->expires_ns < c->lease_next_ns)
        c->lease_next_ns = l->expires_ns;
    kvt__metric_set(c->srv->metrics, KVT_M_LEASES, 0, (double)kvt_radix_lease_count(c->srv->radix));
    return 0;
}

/*
 * A lease pins its path against the NVMe log's segment reclaim too, which drops blocks without
 * asking the index: every NVMe block on the path is pinned in the tier until the lease goes.
 * Out of memory for the list, the lease still holds in the index; its NVMe blocks are then only
 * as safe as any other (kvt__store_lost catches a reclaimed one).
 */
static void kvt_lease_pin(kvt_srv_t *s, kvt__lease_t *l, const kvt_match_t *m)
{
    kvt_tier_t *t = s->tiers[KVT_TIER_NVME];
    if (!t)
        return;
    uint32_t n = 0;
    kvt_path_run_t r;
    for (r = kvt_path_run_first(m->node, m->node_pages); r.node; kvt_path_run_next(&r))
        for (uint32_t i = 0; i < r.n; i++)
            n += r.blocks[i].tier == KVT_TIER_NVME;
    if (n == 0 || !(l->pins = malloc(n * sizeof *l->pins)))
        return;
    for (r = kvt_path_run_first(m->node, m->node_pages); r.node; kvt_path_run_next(&r))
        for (uint32_t i = 0; i < r.n; i++)
            if (r.blocks[i].tier == KVT_TIER_NVME && kvt_tier_pin(t, r.blocks[i].loc, 1) == 0)
                l->pins[l->npins++] = r.blocks[i].loc;
}

static void kvt_lease_unpin(kvt_srv_t *s, kvt__lease_t *l)
{
    for (uint32_t i = 0; i < l->npins; i++)
        kvt_tier_pin(s->tiers[KVT_TIER_NVME], l->pins[i], -1);
    free(l->pins);
    l->pins = NULL;
    l->npins = 0;
}

/* c's lease id, or NULL: a stale id, or another connection's lease, is not found (the entry at
 * its slot's position, if any, has another id). */
static kvt__lease_t *kvt_lease_find(kvt__conn_t *c, uint64_t id)
{
    const kvt_srv_t *s = c->srv;
    uint32_t slot = kvt_radix_lease_slot(id);
    if (slot >= s->lease_pos_cap)
        return NULL;
    uint32_t i = s->lease_pos[slot];
    return i < c->nleases && c->leases[i].id == id ? &c->leases[i] : NULL;
}

static void kvt_lease_del(kvt__conn_t *c, kvt__lease_t *l)
{
    kvt_radix_release(c->srv->radix, l->id);
    kvt_lease_unpin(c->srv, l);
    kvt_lease_ns(c->srv, l->ns, -1);
    *l = c->leases[--c->nleases];
    if (l != c->leases + c->nleases) /* the last one moved into l's place */
        c->srv->lease_pos[kvt_radix_lease_slot(l->id)] = (uint32_t)(l - c->leases);
    kvt__metric_set(c->srv->metrics, KVT_M_LEASES, 0, (double)kvt_radix_lease_count(c->srv->radix));
}

void kvt__lease_drop_all(kvt__conn_t *c)
{
    /* Every lease the connection owns is in its list (a MATCH releases one it cannot list). */
    size_t n = c->nleases;
    for (size_t i = 0; i < c->nleases; i++) {
        kvt_radix_release(c->srv->radix, c->leases[i].id);
        kvt_lease_unpin(c->srv, &c->leases[i]);
        kvt_lease_ns(c->srv, c->leases[i].ns, -1);
    }
    if (n)
        kvt_log(KVT_LOG_DEBUG, "kvtierd: connection %llu: released %zu leases on close",
                (unsigned long long)c->id, n);
    c->nleases = 0;
    kvt__metric_set(c->srv->metrics, KVT_M_LEASES, 0, (double)kvt_radix_lease_count(c->srv->radix));
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
            kvt_lease_del(c, &c->leases[i]);
        } else {
            next = KVT_MIN(next, c->leases[i].expires_ns);
            i++;
        }
    }
    c->lease_next_ns = next;
}

/* Handlers. Each returns 0, or a negative code when the connection must close. */

static int kvt_bad_body(kvt__conn_t *c, const kvt_proto_hdr_t *h, uint64_t t0, const char *what)
{
    kvt__proto_error(c->srv, KVT_PERR_BAD_BODY);
    kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_EPROTO, "malformed %s body (%u bytes)",
                     what, h->body_len);
    return 0;
}

static int kvt_need_hello(kvt__conn_t *c, const kvt_proto_hdr_t *h, uint64_t t0)
{
    if (c->hello)
        return 0;
    kvt__proto_error(c->srv, KVT_PERR_NO_HELLO);
    kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_EPROTO,
                     "HELLO must declare a namespace first");
    return -1;
}

static int kvt_h_hello(kvt__conn_t *c, const kvt_proto_hdr_t *h, const uint8_t *body, uint64_t t0)
{
    kvt_srv_t *s = c->srv;
    kvt_proto_hello_t m;
    if (h->flags || kvt_proto_hello_decode(body, h->body_len, &m) < 0)
        return kvt_bad_body(c, h, t0, "HELLO");
    if (m.min_version > KVT_PROTO_VERSION || m.max_version < KVT_PROTO_VERSION)
        return kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_EPROTO,
                                "no common protocol version: client %u..%u, server %u",
                                m.min_version, m.max_version, KVT_PROTO_VERSION);
    if (m.page_size == 0 || m.page_size > KVT_PAGE_MAX)
        return kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_EINVAL,
                                "page size %u is not in 1..%u", m.page_size, KVT_PAGE_MAX);
    if (m.block_bytes > KVT_TIER_MAX_BLOCK || (uint64_t)m.block_bytes + 64 > s->conf->max_frame)
        return kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_EINVAL,
                                "block size %u is over the limit (%u and max-frame)", m.block_bytes,
                                KVT_TIER_MAX_BLOCK);
    char model[KVT_PROTO_NAME_MAX + 1], adapter[KVT_PROTO_NAME_MAX + 1],
        salt[KVT_PROTO_NAME_MAX + 1];
    memcpy(model, m.model, m.model_len);
    model[m.model_len] = 0;
    memcpy(adapter, m.adapter, m.adapter_len);
    adapter[m.adapter_len] = 0;
    memcpy(salt, m.salt, m.salt_len);
    salt[m.salt_len] = 0;
    /* The model as a log line or an error message may show it: the client chose its bytes. */
    char shown[KVT_LOG_STR_CAP(KVT_LOG_STR_MAX)];
    kvt_log_str(shown, sizeof shown, m.model, m.model_len, KVT_LOG_STR_MAX);
    /* A new namespace needs room in the index and one of max-namespaces ids: when either is
     * short, the empty namespaces nobody uses are closed first. */
    int reclaimed = 0;
    if (kvt__index_fit(s, kvt_radix_ns_need(s->radix, model, adapter, salt, m.page_size)) < 0) {
        reclaimed = 1;
        if (!kvt__ns_reclaim(s) ||
            kvt__index_fit(s, kvt_radix_ns_need(s->radix, model, adapter, salt, m.page_size)) < 0)
            return kvt__reply_error(
                c, h->opcode, h->request_id, t0, KVT_ENOSPC,
                "no room for a new namespace in the index: it is at index-bytes (%llu) and every "
                "page it could evict is leased or busy with I/O",
                (unsigned long long)s->conf->index_bytes);
    }
    uint32_t ns;
    int rc = kvt_radix_ns_open(s->radix, model, adapter, salt, m.page_size, &ns);
    if (rc == KVT_ENOSPC && !reclaimed && kvt__ns_reclaim(s) &&
        kvt__index_fits(s, kvt_radix_ns_need(s->radix, model, adapter, salt, m.page_size)))
        rc = kvt_radix_ns_open(s->radix, model, adapter, salt, m.page_size, &ns);
    /* None empty: the pages of one nobody uses go (kvt__ns_evict), as index-bytes evicts. */
    if (rc == KVT_ENOSPC && kvt__ns_evict(s) &&
        kvt__index_fits(s, kvt_radix_ns_need(s->radix, model, adapter, salt, m.page_size)))
        rc = kvt_radix_ns_open(s->radix, model, adapter, salt, m.page_size, &ns);
    if (rc < 0)
        return kvt__reply_error(c, h->opcode, h->request_id, t0, rc, "cannot open namespace%s",
                                rc == KVT_ENOSPC
                                    ? ": the daemon holds max-namespaces, each declared by a "
                                      "connection, named by a request, leased, or with pages "
                                      "being moved"
                                    : "");
    kvt__ns_t *n;
    if ((rc = kvt__ns_get(s, ns, &n)) < 0)
        return kvt__reply_error(c, h->opcode, h->request_id, t0, rc, "out of memory");
    if (m.block_bytes && n->block_bytes && n->block_bytes != m.block_bytes)
        return kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_EINVAL,
                                "namespace \"%s\" already has blocks of %u bytes, not %u", shown,
                                n->block_bytes, m.block_bytes);
    n->page_size = m.page_size;
    n->seed = kvt_radix_ns_seed(s->radix, ns);
    if (m.block_bytes)
        n->block_bytes = m.block_bytes;
    if (s->tiers[KVT_TIER_NVME]) {
        /* The record only names the namespace after a restart: its blocks come back by seed
         * without it. Names with a tab or a line break cannot be recorded (EINVAL). */
        rc = kvt_tier_nvme_add_ns(s->tiers[KVT_TIER_NVME], model, adapter, salt, m.page_size);
        if (rc < 0) {
            static kvt_log_limit_t lim;
            kvt_log_limited(
                &lim, rc == KVT_EINVAL ? KVT_LOG_INFO : KVT_LOG_WARN,
                "kvtierd: namespace \"%s\" not recorded in the NVMe tier's list (%s): "
                "after a restart its blocks come back unnamed, found by seed",
                shown, rc == KVT_EINVAL ? "a name holds a tab or a line break" : kvt_strerror(rc));
        }
    }
    kvt__ns_use(s, ns);
    if (c->hello)
        kvt__ns_unuse(s, c->ns);
    c->hello = 1;
    c->ns = ns;
    c->page_size = m.page_size;
    /* What this client declared, not the namespace's: a payload on a connection that said 0 is
     * malformed whichever HELLO came first (docs/protocol.md). */
    c->block_bytes = m.block_bytes;
    kvt_proto_hello_reply_t r = {
        .version = KVT_PROTO_VERSION,
        .tiers = kvt_tier_mask(s),
        .ns = ns,
        .ns_seed = n->seed,
        .max_frame = (uint32_t)s->conf->max_frame,
        .lease_ms_max = s->conf->lease_ms_max,
    };
    uint8_t w[sizeof(kvt_wire_hello_reply_t)];
    kvt_proto_hello_reply_encode(w, &r);
    return kvt__reply(c, h->opcode, h->request_id, t0, 0, w, sizeof w);
}

/*
 * Guessing the secret. Wrong AUTHs, over all connections together, take tokens from a bucket of
 * auth-failures-per-s refilled at that rate. An AUTH is answered at once while no other waits
 * and a token is left (a wrong one takes it); otherwise it waits in line, its connection read no
 * further, and the tick answers the line's head whenever a token is there, right or wrong alike,
 * taking one either way: were a right one answered sooner, the wait itself would tell a guesser
 * it guessed wrong, and guessing would go on at full speed with a short timeout. A guesser thus
 * learns the answer to at most that many guesses a second, whatever number of connections it
 * uses, and the loop never waits for anyone. Waiting AUTHs hold connection slots, so the line is
 * at most auth-wait-ms of tokens long; an AUTH past it gets EAGAIN at once, its secret unchecked.
 */
static void kvt_auth_refill(kvt_srv_t *s, uint64_t now)
{
    double rate = s->conf->auth_failures_per_s;
    if (s->auth_refill_ns == 0)
        s->auth_tokens = rate; /* the bucket starts full */
    else if (now > s->auth_refill_ns)
        s->auth_tokens =
            KVT_MIN(rate, s->auth_tokens + (double)(now - s->auth_refill_ns) * rate / 1e9);
    s->auth_refill_ns = now;
}

static int kvt_auth_failed(kvt__conn_t *c, uint64_t id)
{
    static kvt_log_limit_t lim; /* a guesser's every try */
    kvt__proto_error(c->srv, KVT_PERR_AUTH);
    kvt_log_limited(&lim, KVT_LOG_INFO, "kvtierd: connection %llu: AUTH request %llu: wrong secret",
                    (unsigned long long)c->id, (unsigned long long)id);
    return KVT_EAUTH;
}

/* Answers the AUTH c waits with, in its place in c's queue. */
static void kvt_auth_answer(kvt__conn_t *c, int status)
{
    static const char wrong[] = "wrong secret", stop[] = "the daemon is shutting down";
    kvt__req_t *r = c->auth_req;
    c->auth_wait = 0;
    c->auth_req = NULL;
    r->status = status;
    if (status == 0) {
        c->authed = 1;
        kvt__req_reply(r, NULL, 0);
    } else {
        if (status == KVT_EAUTH)
            kvt_auth_failed(c, r->id);
        c->closing = 1;
        kvt__req_reply(r, status == KVT_EAUTH ? wrong : stop,
                       status == KVT_EAUTH ? sizeof wrong - 1 : sizeof stop - 1);
    }
    kvt__req_finish(r); /* kicks c: its queue moves on, and it reads again or closes */
}

static int kvt_auth_order(const void *a, const void *b)
{
    uint64_t x = (*(kvt__conn_t *const *)a)->auth_seq, y = (*(kvt__conn_t *const *)b)->auth_seq;
    return x < y ? -1 : x > y;
}

void kvt__auth_tick(kvt_srv_t *s, uint64_t now)
{
    if (!s->auth_waiting)
        return;
    kvt_auth_refill(s, now);
    /* Connections closed since they began waiting left the list with their AUTH. */
    uint32_t n = 0;
    for (kvt__conn_t *c = s->conns; c; c = c->next)
        n += !c->gone && c->auth_wait;
    s->auth_waiting = n;
    if (n == 0 || (s->auth_tokens < 1 && !s->stopping))
        return;
    kvt__conn_t **line = malloc(n * sizeof *line);
    if (!line)
        return; /* the next tick tries again */
    n = 0;
    for (kvt__conn_t *c = s->conns; c; c = c->next)
        if (!c->gone && c->auth_wait)
            line[n++] = c;
    qsort(line, n, sizeof *line, kvt_auth_order);
    uint32_t i = 0;
    for (; i < n && (s->auth_tokens >= 1 || s->stopping); i++) {
        if (line[i]->gone || !line[i]->auth_wait)
            continue;      /* closed by an answer before it (not by one of its own: never) */
        if (s->stopping) { /* no more turns to wait for: answered unchecked */
            kvt_auth_answer(line[i], KVT_EAGAIN);
            continue;
        }
        s->auth_tokens -= 1;
        kvt_auth_answer(line[i], line[i]->auth_req->status);
    }
    s->auth_waiting = n - i;
    free(line);
}

static int kvt_h_auth(kvt__conn_t *c, const kvt_proto_hdr_t *h, const uint8_t *body, uint64_t t0)
{
    kvt_srv_t *s = c->srv;
    const char *secret = s->conf->secret;
    size_t sl = strlen(secret);
    if (h->body_len == 0 || h->body_len > KVT_PROTO_SECRET_MAX) {
        /* A secret is 1..1024 bytes: this is no guess, and with a secret set the connection
         * cannot go on unauthenticated. */
        kvt_bad_body(c, h, t0, "AUTH");
        return sl && !c->authed ? KVT_EPROTO : 0;
    }
    if (!sl) {
        c->authed = 1;
        return kvt__reply(c, h->opcode, h->request_id, t0, 0, NULL, 0);
    }
    /* Constant time in the secret's length: the comparison leaks nothing but that. */
    unsigned diff = (unsigned)(h->body_len != sl);
    for (size_t i = 0; i < sl; i++)
        diff |= (unsigned)(secret[i] ^ (i < h->body_len ? body[i] : 0));
    if (diff)
        kvt__metric_add(s->metrics, KVT_M_AUTH_FAILURES, 0, 1);
    uint32_t rate = s->conf->auth_failures_per_s;
    if (rate) {
        kvt_auth_refill(s, t0);
        if (s->auth_waiting || s->auth_tokens < 1) {
            uint64_t most = KVT_MAX((uint64_t)rate * s->conf->auth_wait_ms / 1000, 1);
            if (s->auth_waiting >= most) {
                kvt__metric_add(s->metrics, KVT_M_AUTH_REFUSED, 0, 1);
                kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_EAGAIN,
                                 "AUTH refused unchecked: too many wait their turn "
                                 "(auth-failures-per-s %u); try again later",
                                 rate);
                return KVT_EAGAIN;
            }
            kvt__req_t *r = kvt__req_new(c, KVT_REQ_PLAIN, h->opcode, h->request_id, t0);
            if (!r) {
                kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_ENOMEM, "out of memory");
                return KVT_ENOMEM;
            }
            r->status = diff ? KVT_EAUTH : 0; /* told when its turn comes */
            c->auth_req = r;
            c->auth_wait = 1;
            c->auth_seq = ++s->auth_seq;
            s->auth_waiting++;
            kvt__metric_add(s->metrics, KVT_M_AUTH_DELAYED, 0, 1);
            return 0;
        }
        if (diff)
            s->auth_tokens -= 1;
    }
    if (diff) {
        kvt_auth_failed(c, h->request_id);
        kvt__reply(c, h->opcode, h->request_id, t0, KVT_EAUTH, "wrong secret", 12);
        return KVT_EAUTH;
    }
    c->authed = 1;
    return kvt__reply(c, h->opcode, h->request_id, t0, 0, NULL, 0);
}

/* A lease over node and everything above it, for I/O that must not see the path go. KVT_ENOSPC
 * when the lease table would grow past index-bytes: the caller made room first when it could. */
static int kvt_pin(kvt_srv_t *s, kvt_radix_node_t *node, uint32_t ns, uint64_t *lease)
{
    if (!kvt__index_fits(s, kvt_radix_lease_need(s->radix)))
        return KVT_ENOSPC;
    kvt_match_t m = {
        .node = node,
        .node_pages = kvt_radix_node_pages(node),
        .pages = kvt_radix_node_depth(node) + kvt_radix_node_pages(node),
        .ns = ns,
    };
    return kvt_radix_lease(s->radix, &m, s->internal_owner, lease);
}

static void kvt_count_match(kvt_srv_t *s, kvt_match_t *m, const uint32_t *tokens, uint32_t ntokens,
                            uint32_t page, const uint8_t *tiers, int remote_down)
{
    kvt_metrics_t *mt = s->metrics;
    kvt__metric_add(mt, KVT_M_LOOKUPS, 0, 1);
    kvt__metric_add(mt, KVT_M_LOOKUP_TOKENS, 0, ntokens);
    /* Runs of one tier (a path is mostly one or two runs): no per-page counter updates. A run
     * is followed eight pages at a time. */
    for (uint32_t i = 0, run; i < m->pages; i += run) {
        uint64_t all = 0x0101010101010101ull * tiers[i], w;
        for (run = 1; i + run + 8 <= m->pages; run += 8) {
            memcpy(&w, tiers + i + run, 8);
            if (w != all)
                break;
        }
        for (; i + run < m->pages && tiers[i + run] == tiers[i]; run++)
            ;
        kvt__metric_add(mt, KVT_M_HIT_TOKENS, tiers[i] < KVT_TIER_COUNT ? tiers[i] : 0,
                        (double)run * page);
    }
    kvt__metric_add(mt, KVT_M_PREFILL_SAVED, 0,
                    (double)m->pages * page / s->conf->prefill_tokens_per_s);
    uint32_t whole = ntokens / page;
    if (ntokens % page)
        kvt__metric_add(mt, KVT_M_MISS_TOKENS, KVT_MISS_SHORT_PAGE, ntokens % page);
    if (whole > m->pages) {
        /* The first page not matched names the reason for the whole rest: was it ever here? */
        kvt_miss_reason_t why = KVT_MISS_REMOTE_UNREACHABLE;
        if (!remote_down) {
            uint64_t parent = m->pages ? kvt_radix_block_hash(s->radix, m->node, m->pages - 1)
                                       : kvt_radix_ns_seed(s->radix, m->ns);
            uint64_t next = 0;
            kvt_radix_hash_chain(s->radix, m->ns, parent, tokens + (size_t)m->pages * page, 1,
                                 &next);
            why = kvt__ghost_seen(s, next) ? KVT_MISS_EVICTED : KVT_MISS_NEVER_SEEN;
        }
        kvt__metric_add(mt, KVT_M_MISS_TOKENS, why, (double)(whole - m->pages) * page);
    }
}

/* What a MATCH asked for, kept while a remote probe runs. */
typedef struct kvt_match_q {
    uint16_t flags;
    uint32_t lease_ms;
    uint64_t engine_id;
    uint32_t ntokens;
    uint32_t page; /* the namespace's page size when asked (a HELLO may change c's) */
    const uint32_t *tokens;
    uint32_t gone; /* kvt__store_check_path: pages from here on are reported index-only */
} kvt_match_q_t;

/*
 * Answers a MATCH for m: tiers per page, counters, the lease if asked for. r is NULL for an
 * answer given at once (appended to the connection's queue) or the request that waited for the
 * remote probe (its reply goes in its own slot).
 */
static int kvt_match_answer(kvt__conn_t *c, kvt__req_t *r, const kvt_proto_hdr_t *h, uint64_t t0,
                            const kvt_match_q_t *q, kvt_match_t *m, uint32_t remote_pages,
                            int remote_down)
{
    kvt_srv_t *s = c->srv;
    uint8_t stackbuf[sizeof(kvt_wire_match_reply_t) + 512];
    size_t len = sizeof(kvt_wire_match_reply_t) + m->pages;
    uint8_t *out = len <= sizeof stackbuf ? stackbuf : malloc(len);
    int rc = 0;
    if (!out)
        return kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_ENOMEM, "out of memory");
    uint8_t *tiers = out + sizeof(kvt_wire_match_reply_t);
    /* Tiers per page, node by node: each node's blocks are read in place. */
    for (kvt_path_run_t pr = kvt_path_run_first(m->pages ? m->node : NULL, m->node_pages); pr.node;
         kvt_path_run_next(&pr))
        for (uint32_t i = 0; i < pr.n; i++)
            tiers[pr.depth + i] = pr.blocks[i].tier;
    if (q->gone < m->pages)
        memset(tiers + q->gone, KVT_TIER_NONE, m->pages - q->gone);
    if (!(q->flags & KVT_MATCH_F_PROBE))
        kvt_count_match(s, m, q->tokens, q->ntokens, q->page, tiers, remote_down);
    uint64_t lease = 0;
    int leasing = (q->flags & KVT_MATCH_F_LEASE) && m->pages > 0, full = 0;
    if (leasing && c->nleases >= s->conf->max_leases) {
        rc = KVT_ENOSPC; /* refused below, saying why */
    } else if (leasing && !kvt__index_fits(s, kvt_radix_lease_need(s->radix))) {
        rc = KVT_ENOSPC; /* the lease table would grow past index-bytes */
        full = 1;
    } else if (leasing) {
        rc = kvt_radix_lease(s->radix, m, c->id, &lease);
        uint32_t ms = q->lease_ms ? KVT_MIN(q->lease_ms, s->conf->lease_ms_max) : s->conf->lease_ms;
        kvt__lease_t l = {
            .id = lease,
            .node = m->node,
            .pages = m->pages,
            .ns = m->ns,
            .expires_ns = kvt_now_ns() + (uint64_t)ms * 1000000,
            .engine_id = q->engine_id,
        };
        if (rc == 0)
            kvt_lease_pin(s, &l, m);
        if (rc == 0 && (rc = kvt_lease_add(c, &l)) < 0) {
            kvt_lease_unpin(s, &l);
            kvt_radix_release(s->radix, lease);
        }
        if (rc < 0)
            lease = 0;
    }
    kvt_proto_match_reply_t w = {
        .tokens = m->pages * q->page,
        .pages = m->pages,
        .lease = lease,
        .remote_pages = remote_pages,
    };
    kvt_proto_match_reply_encode(out, &w);
    if (rc < 0) {
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

/* A MATCH waiting for the remote tier's answer about the pages after the local match. */
typedef struct kvt_rprobe {
    kvt_tier_probe_t probe;
    kvt__req_t *req;
    kvt_proto_hdr_t hdr;
    kvt_match_q_t q;
    kvt_proto_hints_t hints; /* for the policy, told once the probe has answered */
    uint32_t local_pages;
    uint32_t *tokens;
    kvt_block_key_t keys[KVT_TIER_PROBE_MAX];
} kvt_rprobe_t;

static void kvt_probe_done(kvt_tier_probe_t *p)
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
            kvt_radix_insert(s->radix, r->ns, x->tokens, (size_t)(x->local_pages + found) * page,
                             &res) == 0) {
            /* Runs of index-only pages join the policy as remote blocks (location 0: read by
             * key); pages that hold bytes here already, or are being written, stay as they are.
             * With the path pinned, a remote tier full in the policy's accounting makes room for
             * them as for a PUT's pages (its lowest-value blocks dropped): a fleet's daemon whose
             * share of the server is full would otherwise never take a run of found blocks
             * larger than its watermarks' headroom. */
            uint64_t pin = 0;
            if (kvt_pin(s, res.node, r->ns, &pin) < 0)
                pin = 0;
            for (uint32_t i = x->local_pages; i < res.pages;) {
                kvt_block_t *b = kvt_radix_block_at(res.node, i);
                if (!b || b->tier != KVT_TIER_NONE || (b->flags & KVT_BLOCK_BUSY)) {
                    i++;
                    continue;
                }
                uint32_t j = i, held = 0;
                for (; j < res.pages; j++) {
                    kvt_block_t *e = kvt_radix_block_at(res.node, j);
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
                    kvt_block_t *e = kvt_radix_block_at(res.node, k);
                    e->loc = 0;
                    e->size = ns->block_bytes;
                }
                if (end > i)
                    kvt__policy_adopt(s, res.node, i, end, KVT_TIER_REMOTE, res.pages, NULL);
                i = j;
            }
            if (pin)
                kvt_radix_release(s->radix, pin);
        } else {
            found = 0;
        }
    }
    if (x->q.flags & KVT_MATCH_F_LEASE)
        kvt__index_fit(s, kvt_radix_lease_need(s->radix)); /* may trim: before the match */
    kvt_match_t m;
    if (kvt_radix_match(s->radix, r->ns, x->tokens, x->q.ntokens, KVT_MATCH_NOTOUCH, &m) < 0)
        memset(&m, 0, sizeof m);
    x->q.gone = kvt__store_check_path(s, &m); /* NVMe may have dropped blocks meanwhile */
    /* The policy hears of this use once, for the whole path: the local pages and the blocks
     * found remote (a hit too: promote them). */
    if (!(x->q.flags & KVT_MATCH_F_PROBE))
        kvt__policy_match(s, &m, &x->hints);
    uint32_t remote = m.pages > x->local_pages ? m.pages - x->local_pages : 0;
    kvt_match_answer(c, r, &x->hdr, r->t0, &x->q, &m, remote, down); /* kicks c */
}

/* Starts a remote probe for the pages after m; returns 1 when the reply will come later. */
static int kvt_probe_start(kvt__conn_t *c, const kvt_proto_hdr_t *h, uint64_t t0,
                           const kvt_match_q_t *q, const kvt_match_t *m,
                           const kvt_proto_hints_t *hints, int *down)
{
    kvt_srv_t *s = c->srv;
    kvt_tier_t *remote = s->tiers[KVT_TIER_REMOTE];
    uint32_t page = q->page, whole = q->ntokens / page;
    kvt__ns_t *nsr; /* blocks found there are read by the namespace's size (kvt_probe_done) */
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
    x->hdr = *h;
    x->q = *q;
    x->hints = *hints;
    x->local_pages = m->pages;
    x->tokens = (uint32_t *)(x + 1);
    memcpy(x->tokens, q->tokens, (size_t)q->ntokens * 4);
    x->q.tokens = x->tokens;
    uint64_t seed = kvt_radix_ns_seed(s->radix, c->ns);
    uint64_t prev = m->pages ? kvt_radix_block_hash(s->radix, m->node, m->pages - 1) : seed;
    uint64_t hashes[KVT_TIER_PROBE_MAX];
    kvt_radix_hash_chain(s->radix, c->ns, prev, x->tokens + (size_t)m->pages * page, n, hashes);
    for (uint32_t i = 0; i < n; i++) {
        x->keys[i] = (kvt_block_key_t){.ns_seed = seed,
                                       .hash = hashes[i],
                                       .parent = i ? hashes[i - 1] : prev,
                                       .tokens = x->tokens + (size_t)(m->pages + i) * page,
                                       .ntokens = page};
    }
    x->probe.keys = x->keys;
    x->probe.n = n;
    x->probe.cb = kvt_probe_done;
    x->probe.data = x;
    int rc = kvt_tier_remote_probe(remote, &x->probe);
    if (rc < 0) {
        /* Not started: answer from the local match in this request's slot. */
        *down = rc == KVT_EUNAVAIL || rc == KVT_ETIMEDOUT;
        if (!(q->flags & KVT_MATCH_F_PROBE))
            kvt__policy_match(s, m, hints);
        kvt_match_t lm = *m;
        kvt_match_answer(c, r, h, t0, &x->q, &lm, 0, *down);
        return 1;
    }
    r->pending++;
    s->inflight++;
    c->inflight++;
    return 1;
}

static int kvt_h_match(kvt__conn_t *c, const kvt_proto_hdr_t *h, const uint8_t *body, uint64_t t0)
{
    kvt_srv_t *s = c->srv;
    kvt_proto_match_t q;
    if ((h->flags & ~(unsigned)KVT_MATCH_F_ALL) ||
        kvt_proto_match_decode(body, h->body_len, &q) < 0)
        return kvt_bad_body(c, h, t0, "MATCH");
    if (kvt_need_hello(c, h, t0) < 0)
        return 0;
    if (kvt_tokens(c, q.tokens, q.ntokens) < 0)
        return kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_ENOMEM, "out of memory");
    /* Room for the lease, trimming if need be: before the match, whose path a trim may cut. */
    if (h->flags & KVT_MATCH_F_LEASE)
        kvt__index_fit(s, kvt_radix_lease_need(s->radix));
    kvt_match_t m;
    int rc = kvt_radix_match(s->radix, c->ns, c->tok, q.ntokens,
                             (h->flags & KVT_MATCH_F_PROBE) ? KVT_MATCH_NOTOUCH : 0, &m);
    if (rc < 0)
        return kvt__reply_error(c, h->opcode, h->request_id, t0, rc, "match failed");
    kvt_match_q_t mq = {.flags = h->flags,
                        .lease_ms = q.lease_ms,
                        .engine_id = q.hints.engine_request_id,
                        .ntokens = q.ntokens,
                        .page = c->page_size,
                        .tokens = c->tok,
                        /* blocks NVMe dropped by itself are not reported stored */
                        .gone = kvt__store_check_path(s, &m)};
    int down = 0;
    if ((h->flags & KVT_MATCH_F_REMOTE) && kvt_probe_start(c, h, t0, &mq, &m, &q.hints, &down))
        return 0; /* the probe's answer tells the policy */
    if (!(h->flags & KVT_MATCH_F_PROBE))
        kvt__policy_match(s, &m, &q.hints);
    return kvt_match_answer(c, NULL, h, t0, &mq, &m, 0, down);
}

static int kvt_h_put(kvt__conn_t *c, const kvt_proto_hdr_t *h, const uint8_t *body, uint64_t t0)
{
    kvt_srv_t *s = c->srv;
    kvt_proto_put_t q;
    if (h->flags || !c->hello || kvt_proto_put_decode(body, h->body_len, c->block_bytes, &q) < 0) {
        if (!h->flags && kvt_need_hello(c, h, t0) < 0)
            return 0;
        return kvt_bad_body(c, h, t0, "PUT");
    }
    uint32_t whole = q.ntokens / c->page_size;
    if (q.npayload && ((uint64_t)q.first_page + q.npayload > whole))
        return kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_EINVAL,
                                "payload pages %u..%u are past the request's %u whole pages",
                                q.first_page, q.first_page + q.npayload, whole);
    if (kvt_tokens(c, q.tokens, q.ntokens) < 0)
        return kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_ENOMEM, "out of memory");
    kvt_match_t at;
    if (kvt__index_room(s, c->ns, c->tok, q.ntokens, q.npayload > 0, &at) < 0)
        return kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_ENOSPC,
                                "no room for %u tokens in the index: it is at index-bytes (%llu) "
                                "and every page it could evict is leased or busy with I/O",
                                q.ntokens, (unsigned long long)s->conf->index_bytes);
    kvt_insert_t res; /* near the cap the room check walked the path: the insert goes on from it */
    int rc = at.ns == c->ns ? kvt_radix_insert_matched(s->radix, &at, c->tok, q.ntokens, &res)
                            : kvt_radix_insert(s->radix, c->ns, c->tok, q.ntokens, &res);
    if (rc < 0)
        return kvt__reply_error(c, h->opcode, h->request_id, t0, rc, "insert failed");
    if (q.npayload == 0 || res.pages == 0) {
        kvt_proto_put_reply_t r = {.pages = res.pages, .new_pages = res.new_pages};
        uint8_t w[sizeof(kvt_wire_put_reply_t)];
        kvt_proto_put_reply_encode(w, &r);
        return kvt__reply(c, h->opcode, h->request_id, t0, 0, w, sizeof w);
    }
    kvt__req_t *r = kvt__req_new(c, KVT_REQ_PUT, h->opcode, h->request_id, t0);
    if (!r)
        return kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_ENOMEM, "out of memory");
    kvt__req_ns(r, c->ns);
    r->node = res.node;
    r->pages = res.pages;
    r->new_pages = res.new_pages;
    kvt__policy_hint(&q.hints, kvt_radix_node_depth(res.node), &r->hint);
    r->block_bytes = c->block_bytes;
    r->first = q.first_page;
    r->end = q.first_page + q.npayload;
    size_t bytes = (size_t)q.npayload * c->block_bytes, held;
    /* A frame with a buffer of its own is kept whole until the pages are written, not copied. */
    if ((r->held = kvt__conn_take_frame(c, body, h->body_len, &held))) {
        r->held_bytes = held;
        r->payload = (uint8_t *)(uintptr_t)q.payload;
        rc = 0;
    } else {
        rc = kvt__req_hold(r, q.payload, bytes);
    }
    if (rc < 0 || (rc = kvt_pin(s, res.node, c->ns, &r->lease)) < 0) {
        r->status = rc;
        r->lease = 0;
    }
    kvt__store_put(s, r); /* replies at once when there is nothing to write */
    return 0;
}

static int kvt_h_get(kvt__conn_t *c, const kvt_proto_hdr_t *h, const uint8_t *body, uint64_t t0)
{
    kvt_srv_t *s = c->srv;
    kvt_proto_get_t q;
    if (h->flags || kvt_proto_get_decode(body, h->body_len, &q) < 0)
        return kvt_bad_body(c, h, t0, "GET");
    kvt__lease_t *l = kvt_lease_find(c, q.lease);
    if (!l || l->expires_ns <= kvt_now_ns())
        return kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_ENOENT,
                                "lease %llu is not held by this connection",
                                (unsigned long long)q.lease);
    uint32_t n = q.npages ? q.npages : (q.first_page < l->pages ? l->pages - q.first_page : 0);
    if (q.first_page >= l->pages || n == 0 || (uint64_t)q.first_page + n > l->pages)
        return kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_EINVAL,
                                "pages %u..%u are outside the leased %u pages", q.first_page,
                                q.first_page + n, l->pages);
    kvt__ns_t *ns;
    if (kvt__ns_get(s, l->ns, &ns) < 0 || ns->block_bytes == 0)
        return kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_EINVAL,
                                "the namespace is index-only (HELLO block size 0)");
    kvt__req_t *r = kvt__req_new(c, KVT_REQ_GET, h->opcode, h->request_id, t0);
    if (!r)
        return kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_ENOMEM, "out of memory");
    kvt__req_ns(r, l->ns);
    r->node = l->node;
    r->pages = l->pages;
    r->block_bytes = ns->block_bytes;
    r->cur = q.first_page;
    r->end = q.first_page + n;
    kvt__index_fit(s, kvt_radix_lease_need(s->radix)); /* the client's lease holds the path */
    int rc = kvt_pin(s, l->node, l->ns, &r->lease);
    if (rc < 0) {
        r->status = rc;
        r->end = r->cur; /* nothing to send: the final frame carries the error */
    }
    kvt__store_get_batch(s, r);
    return 0;
}

static int kvt_h_prefetch(kvt__conn_t *c, const kvt_proto_hdr_t *h, const uint8_t *body,
                          uint64_t t0)
{
    kvt_srv_t *s = c->srv;
    kvt_proto_prefetch_t q;
    if ((h->flags & ~KVT_PREFETCH_F_ALL) || kvt_proto_prefetch_decode(body, h->body_len, &q) < 0)
        return kvt_bad_body(c, h, t0, "PREFETCH");
    if (kvt_need_hello(c, h, t0) < 0)
        return 0;
    if (q.tier != KVT_TIER_HBM && q.tier != KVT_TIER_DRAM && q.tier != KVT_TIER_NVME)
        return kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_EINVAL,
                                "PREFETCH moves up to hbm (1), dram (2) or nvme (3), not %u",
                                q.tier);
    if (!s->tiers[q.tier])
        return kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_EUNAVAIL,
                                "the %s tier is not configured", kvt_tier_name(q.tier));
    if (kvt_tokens(c, q.tokens, q.ntokens) < 0)
        return kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_ENOMEM, "out of memory");
    kvt__index_fit(s, kvt_radix_lease_need(s->radix)); /* room for the pin, before the match */
    kvt_match_t m;
    int rc = kvt_radix_match(s->radix, c->ns, c->tok, q.ntokens, KVT_MATCH_NOTOUCH, &m);
    if (rc < 0)
        return kvt__reply_error(c, h->opcode, h->request_id, t0, rc, "match failed");
    if (m.pages == 0) {
        uint8_t w[sizeof(kvt_wire_prefetch_reply_t)];
        kvt_proto_prefetch_reply_encode(w, &(kvt_proto_prefetch_reply_t){0});
        return kvt__reply(c, h->opcode, h->request_id, t0, 0, w, sizeof w);
    }
    kvt__req_t *r = kvt__req_new(c, KVT_REQ_PREFETCH, h->opcode, h->request_id, t0);
    if (!r)
        return kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_ENOMEM, "out of memory");
    kvt__req_ns(r, c->ns);
    r->node = m.node;
    r->pages = m.pages;
    r->target = q.tier;
    r->start_only = (h->flags & KVT_PREFETCH_F_START) != 0;
    r->deadline_ns = t0 + (uint64_t)(q.deadline_ms ? q.deadline_ms : s->conf->lease_ms) * 1000000;
    kvt__ns_t *ns;
    kvt__ns_get(s, c->ns, &ns);
    r->block_bytes = ns->block_bytes;
    if ((rc = kvt_pin(s, m.node, c->ns, &r->lease)) < 0)
        r->status = rc;
    kvt__store_prefetch(s, r); /* replies at once when nothing moves */
    return 0;
}

static int kvt_h_release(kvt__conn_t *c, const kvt_proto_hdr_t *h, const uint8_t *body, uint64_t t0)
{
    uint64_t id;
    if (h->flags || kvt_proto_release_decode(body, h->body_len, &id) < 0)
        return kvt_bad_body(c, h, t0, "RELEASE");
    kvt__lease_t *l = kvt_lease_find(c, id);
    if (l)
        kvt_lease_del(c, l);
    uint8_t w[sizeof(kvt_wire_release_reply_t)];
    kvt_proto_release_reply_encode(w, l ? 1 : 0);
    return kvt__reply(c, h->opcode, h->request_id, t0, 0, w, sizeof w);
}

#define KVT_REMOVE_WAIT_MS 1000

/*
 * Whether a connection's lease holds what removing tokens[0, n) would remove: the node holding
 * its last whole page, or one below it. Such a REMOVE is refused (EBUSY) at once; one held only by
 * the daemon's own work (a move, a request's I/O) waits for it instead.
 */
static int kvt_remove_leased(kvt_srv_t *s, uint32_t ns, const uint32_t *tokens, uint32_t n)
{
    kvt_match_t m;
    uint32_t pages = n / kvt_radix_ns_page_size(s->radix, ns);
    if (kvt_radix_match(s->radix, ns, tokens, n, KVT_MATCH_NOTOUCH, &m) < 0 || pages == 0 ||
        m.pages < pages)
        return 0;
    kvt_radix_node_t *top = kvt_radix_node_holding(m.node, pages - 1);
    uint32_t d = kvt_radix_node_depth(top);
    for (kvt__conn_t *c = s->conns; c; c = c->next)
        for (size_t i = 0; i < c->nleases; i++)
            if (kvt_radix_node_holding(c->leases[i].node, d) == top) /* top on the lease's path */
                return 1;
    return 0;
}

static int kvt_remove(kvt_srv_t *s, uint32_t ns, const uint32_t *tokens, uint32_t n)
{
    s->removing = 1;
    int rc = kvt_radix_remove(s->radix, ns, tokens, n);
    s->removing = 0;
    return rc;
}

static void kvt_remove_reply(kvt__req_t *r, int rc)
{
    r->status = rc;
    kvt__req_reply(r, NULL, 0);
    kvt__req_finish(r);
}

int kvt__remove_retry(kvt__req_t *r, uint64_t now)
{
    kvt_srv_t *s = r->srv;
    const uint32_t *tokens = (const uint32_t *)(void *)r->payload;
    int rc = kvt_remove(s, r->ns, tokens, r->pages);
    if (rc == KVT_EBUSY && now < r->deadline_ns && !kvt_remove_leased(s, r->ns, tokens, r->pages))
        return 0;
    kvt_remove_reply(r, rc);
    return 1;
}

static int kvt_h_remove(kvt__conn_t *c, const kvt_proto_hdr_t *h, const uint8_t *body, uint64_t t0)
{
    kvt_srv_t *s = c->srv;
    uint32_t n;
    const uint8_t *tok;
    if ((h->flags & ~KVT_REMOVE_F_ALL) || kvt_proto_remove_decode(body, h->body_len, &n, &tok) < 0)
        return kvt_bad_body(c, h, t0, "REMOVE");
    if (kvt_need_hello(c, h, t0) < 0)
        return 0;
    if (kvt_tokens(c, tok, n) < 0)
        return kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_ENOMEM, "out of memory");
    int rc = kvt_remove(s, c->ns, c->tok, n);
    if (rc == KVT_EBUSY && (h->flags & KVT_REMOVE_F_NOWAIT))
        return kvt__reply_error(c, h->opcode, h->request_id, t0, rc, "remove of %u tokens: %s", n,
                                kvt_remove_leased(s, c->ns, c->tok, n)
                                    ? "a lease holds them"
                                    : "busy with moves or requests in flight (NOWAIT)");
    if (rc == KVT_EBUSY && !kvt_remove_leased(s, c->ns, c->tok, n)) {
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
            kvt_remove_reply(r, KVT_ENOMEM);
            return 0;
        }
        rc = KVT_ENOMEM;
    }
    if (rc < 0)
        return kvt__reply_error(c, h->opcode, h->request_id, t0, rc, "remove of %u tokens", n);
    return kvt__reply(c, h->opcode, h->request_id, t0, 0, NULL, 0);
}

/* STATS: the same series as /metrics (metrics.h's table, kvt__metrics_each), as name/value
 * entries in a buffer that grows as they come. */
typedef struct kvt_statbuf {
    uint8_t *buf;
    size_t len, cap;
} kvt_statbuf_t;

static int kvt_stat(void *arg, const char *name, uint64_t v)
{
    kvt_statbuf_t *b = arg;
    while (kvt_proto_stat_encode(b->buf, b->cap, &b->len, name, v) < 0)
        if (kvt_reserve(&b->buf, &b->cap, b->cap * 2, 1, 4096) < 0)
            return KVT_ENOMEM;
    return 0;
}

static int kvt_h_stats(kvt__conn_t *c, const kvt_proto_hdr_t *h, uint64_t t0)
{
    kvt_srv_t *s = c->srv;
    if (h->flags || h->body_len != 0) {
        kvt__proto_error(s, KVT_PERR_BAD_BODY);
        return kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_EPROTO,
                                "STATS takes an empty body");
    }
    kvt__tier_metrics(s); /* the gauges a scrape refreshes first */
    kvt_statbuf_t b = {0};
    int rc = kvt_reserve(&b.buf, &b.cap, 8192, 1, 8192);
    if (rc == 0) {
        memset(b.buf, 0, 4); /* the count */
        b.len = 4;
        rc = kvt__metrics_each(s->metrics, kvt_stat, &b);
    }
    if (rc < 0) {
        free(b.buf);
        return kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_ENOMEM, "out of memory");
    }
    rc = kvt__reply(c, h->opcode, h->request_id, t0, 0, b.buf, (uint32_t)b.len);
    free(b.buf);
    return rc;
}

int kvt__handle(kvt__conn_t *c, const kvt_proto_hdr_t *h, const uint8_t *body)
{
    uint64_t t0 = kvt_now_ns();
    if (!c->authed && h->opcode != KVT_OP_AUTH) {
        kvt__proto_error(c->srv, KVT_PERR_AUTH);
        kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_EAUTH,
                         "AUTH with the shared secret must come first");
        return KVT_EAUTH;
    }
    switch (h->opcode) {
    case KVT_OP_HELLO:
        return kvt_h_hello(c, h, body, t0);
    case KVT_OP_AUTH:
        return kvt_h_auth(c, h, body, t0);
    case KVT_OP_MATCH:
        return kvt_h_match(c, h, body, t0);
    case KVT_OP_PUT:
        return kvt_h_put(c, h, body, t0);
    case KVT_OP_GET:
        return kvt_h_get(c, h, body, t0);
    case KVT_OP_PREFETCH:
        return kvt_h_prefetch(c, h, body, t0);
    case KVT_OP_RELEASE:
        return kvt_h_release(c, h, body, t0);
    case KVT_OP_REMOVE:
        return kvt_h_remove(c, h, body, t0);
    case KVT_OP_STATS:
        return kvt_h_stats(c, h, t0);
    case KVT_OP_PING:
        if (h->flags)
            return kvt_bad_body(c, h, t0, "PING");
        return kvt__reply(c, h->opcode, h->request_id, t0, 0, body, h->body_len);
    default:
        kvt__proto_error(c->srv, KVT_PERR_UNKNOWN_OP);
        kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_EPROTO, "unknown opcode %u",
                         h->opcode);
        return 0;
    }
}
