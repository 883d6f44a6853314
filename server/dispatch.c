/*
 * dispatch.c: where a whole frame (conn.c found its end) goes to its operation. It checks what
 * every operation needs first (AUTH when a secret is set), calls the operation's handler, and
 * owns what the handlers share: malformed-body answers, the HELLO check, the frame's tokens in
 * host order, the internal pin on a path, and the requests' deadlines. HELLO, STATS and PING,
 * which touch nothing but the namespace table and the metrics, are answered here. A bad body gets
 * an error reply and changes nothing; only framing errors close a connection.
 */
#include "server.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

void kvt__ops_deadlines(kvt__conn_t *c, uint64_t now)
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
        if (r->kind == KVT_REQ_PREFETCH && !r->done && kvt__prefetch_deadline(r, now))
            return; /* answered: the kick may have freed the connection */
    }
}

static uint16_t tier_mask(const kvt_srv_t *s)
{
    uint16_t m = 0;
    for (int i = 1; i < KVT_TIER_COUNT; i++)
        if (s->tiers[i])
            m |= (uint16_t)(1u << i);
    return m;
}

/*
 * Pages larger than an NVMe record can hold (nvme-segment-bytes) never go there: every write
 * fails with KVT_ETOOBIG however much of the tier is free, so DRAM's victims pass NVMe by for the
 * remote tier, or are dropped where there is none (exec.c, exec_holds; and a PUT into a full DRAM
 * makes room there so, op_put.c). It looks like a hierarchy with NVMe all but empty; the HELLO
 * that declares such pages says why in the log.
 */
static void nvme_too_small(kvt_srv_t *s, const char *shown, uint32_t page_size,
                           uint32_t block_bytes)
{
    uint32_t max = kvt__tier_nvme_max_block(s, page_size);
    if (!block_bytes || block_bytes <= max)
        return;
    static kvt_log_limit_t lim;
    kvt_log_limited(&lim, KVT_LOG_WARN,
                    "kvtierd: namespace \"%s\": its pages of %u bytes do not fit an NVMe record "
                    "(at most %u bytes with %u tokens a page: raise nvme-segment-bytes); they "
                    "are never stored in NVMe: DRAM demotes them to the remote tier, or drops "
                    "them where there is none",
                    shown, block_bytes, max, page_size);
}

static int h_hello(kvt__conn_t *c, const kvt_proto_hdr_t *h, const uint8_t *body, uint64_t t0)
{
    kvt_srv_t *s = c->srv;
    kvt_proto_hello_t m;
    if (h->flags || kvt_proto_hello_decode(body, h->body_len, &m) < 0)
        return kvt__bad_body(c, h, t0, "HELLO");
    if (m.min_version > KVT_PROTO_VERSION || m.max_version < KVT_PROTO_VERSION)
        return kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_EPROTO,
                                "no common protocol version: client %u..%u, server %u",
                                m.min_version, m.max_version, KVT_PROTO_VERSION);
    if (m.page_size == 0 || m.page_size > KVT_PAGE_MAX)
        return kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_EINVAL,
                                "page size %u is not in 1..%u", m.page_size, KVT_PAGE_MAX);
    /* docs/protocol.md: a PUT of one page's payload (page 0: one page of tokens) fits a frame */
    uint64_t put1 = sizeof(kvt_wire_put_t) + 4ull * m.page_size + m.block_bytes;
    if (m.block_bytes > KVT_TIER_MAX_BLOCK)
        return kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_EINVAL,
                                "block size %u is over the limit of %u bytes", m.block_bytes,
                                KVT_TIER_MAX_BLOCK);
    if (m.block_bytes && put1 > s->conf->max_frame)
        return kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_EINVAL,
                                "block size %u does not fit in a frame: a PUT of one page is "
                                "%llu bytes, over max-frame (%llu)",
                                m.block_bytes, (unsigned long long)put1,
                                (unsigned long long)s->conf->max_frame);
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
    if (kvt__index_fit(s, kvt__ns_need(s, model, adapter, salt, m.page_size)) < 0) {
        reclaimed = 1;
        if (!kvt__ns_reclaim(s) ||
            kvt__index_fit(s, kvt__ns_need(s, model, adapter, salt, m.page_size)) < 0)
            return kvt__reply_error(
                c, h->opcode, h->request_id, t0, KVT_ENOSPC,
                "no room for a new namespace in the index: it is at index-bytes (%llu) and every "
                "page it could evict is leased or busy with I/O",
                (unsigned long long)s->conf->index_bytes);
    }
    uint32_t ns;
    int rc = kvt__ns_open(s, model, adapter, salt, m.page_size, &ns);
    if (rc == KVT_ENOSPC && !reclaimed && kvt__ns_reclaim(s) &&
        kvt__index_fits(s, kvt__ns_need(s, model, adapter, salt, m.page_size)))
        rc = kvt__ns_open(s, model, adapter, salt, m.page_size, &ns);
    /* None empty: the pages of one nobody uses go (kvt__ns_evict), as index-bytes evicts. */
    if (rc == KVT_ENOSPC && kvt__ns_evict(s) &&
        kvt__index_fits(s, kvt__ns_need(s, model, adapter, salt, m.page_size)))
        rc = kvt__ns_open(s, model, adapter, salt, m.page_size, &ns);
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
    n->seed = kvt__ns_seed(s, ns);
    if (m.block_bytes)
        n->block_bytes = m.block_bytes;
    if (s->tiers[KVT_TIER_NVME]) {
        /* The record only names the namespace after a restart: its blocks come back by seed
         * without it. Names with a tab or a line break cannot be recorded (EINVAL). */
        rc = kvt__tier_add_ns(s, model, adapter, salt, m.page_size);
        if (rc < 0) {
            static kvt_log_limit_t lim;
            kvt_log_limited(
                &lim, rc == KVT_EINVAL ? KVT_LOG_INFO : KVT_LOG_WARN,
                "kvtierd: namespace \"%s\" not recorded in the NVMe tier's list (%s): "
                "after a restart its blocks come back unnamed, found by seed",
                shown, rc == KVT_EINVAL ? "a name holds a tab or a line break" : kvt_strerror(rc));
        }
        nvme_too_small(s, shown, m.page_size, m.block_bytes);
    }
    kvt__ns_use(s, ns);
    if (c->hello)
        kvt__ns_unuse(s, c->ns);
    c->hello = 1;
    c->ns = ns;
    c->metric_ns = kvt__metrics_ns_slot(s->metrics, model, adapter);
    c->page_size = m.page_size;
    /* What this client declared, not the namespace's: a payload on a connection that said 0 is
     * malformed whichever HELLO came first (docs/protocol.md). */
    c->block_bytes = m.block_bytes;
    c->device = m.device;
    kvt_proto_hello_reply_t r = {
        .version = KVT_PROTO_VERSION,
        .tiers = tier_mask(s),
        .ns = ns,
        .ns_seed = n->seed,
        .max_frame = (uint32_t)s->conf->max_frame,
        .lease_ms_max = s->conf->lease_ms_max,
    };
    uint8_t w[sizeof(kvt_wire_hello_reply_t)];
    kvt_proto_hello_reply_encode(w, &r);
    return kvt__reply(c, h->opcode, h->request_id, t0, 0, w, sizeof w);
}

/* STATS: the same series as /metrics (metrics.h's table, kvt__metrics_each), as name/value
 * entries in a buffer that grows as they come. */
typedef struct kvt_statbuf {
    uint8_t *buf;
    size_t len, cap;
} kvt_statbuf_t;

static int add_stat(void *arg, const char *name, uint64_t v)
{
    kvt_statbuf_t *b = arg;
    while (kvt_proto_stat_encode(b->buf, b->cap, &b->len, name, v) < 0)
        if (kvt_reserve(&b->buf, &b->cap, b->cap * 2, 1, 4096) < 0)
            return KVT_ENOMEM;
    return 0;
}

static int h_stats(kvt__conn_t *c, const kvt_proto_hdr_t *h, uint64_t t0)
{
    kvt_srv_t *s = c->srv;
    if (h->flags)
        return kvt__bad_body(c, h, t0, "STATS");
    if (h->body_len != 0) {
        kvt__proto_error(s, KVT_PERR_BAD_BODY);
        return kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_EPROTO,
                                "STATS takes an empty body");
    }
    kvt__tier_metrics(s); /* the gauges a scrape refreshes first */
    kvt__loops_gauges(s);
    kvt__metrics_process(s->metrics);
    kvt_statbuf_t b = {0};
    int rc = kvt_reserve(&b.buf, &b.cap, 8192, 1, 8192);
    if (rc == 0) {
        memset(b.buf, 0, 4); /* the count */
        b.len = 4;
        rc = kvt__metrics_each(s->metrics, add_stat, &b);
    }
    if (rc < 0) {
        free(b.buf);
        return kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_ENOMEM, "out of memory");
    }
    rc = kvt__reply(c, h->opcode, h->request_id, t0, 0, b.buf, (uint32_t)b.len);
    free(b.buf);
    return rc;
}

/*
 * The warming of a batch of MATCH frames (dispatch_batch, below): their paths are followed all
 * together when the batch is read, and each one's tokens and blocks asked for KVT_WARM_AHEAD
 * MATCHes before its own, so that they arrive while the MATCHes before it are handled. Asking
 * for all of them at once made the first MATCH wait for every line of the batch. One per loop
 * thread: only the connection being parsed (c) uses it, frame by frame (body: each MATCH's).
 */
#define KVT_WARM_AHEAD 6

static _Thread_local struct {
    const kvt__conn_t *c;
    const uint8_t *body[KVT_WARM_MAX];
    size_t next;
    kvt_warm_plan_t plan;
} warm;

static void warm_next(const kvt__conn_t *c, const uint8_t *body)
{
    if (warm.c != c || warm.next >= warm.plan.n || warm.body[warm.next] != body)
        return;
    kvt__path_warm_run(&warm.plan, warm.next + KVT_WARM_AHEAD);
    warm.next++;
}

int kvt__handle(kvt__conn_t *c, const kvt_proto_hdr_t *h, const uint8_t *body)
{
    /* A request arrives when its bytes are read: the read's stamp (conn.c), one clock read for
     * the whole pipeline it brought instead of one per request (clock reads were 3.4 % of
     * kvtierd's samples under pipelined MATCHes, two a request; 2.2 % with this one gone). */
    uint64_t t0 = c->rx_ns;
    if (!c->authed && h->opcode != KVT_OP_AUTH) {
        kvt__proto_error(c->srv, KVT_PERR_AUTH);
        kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_EAUTH,
                         "AUTH with the shared secret must come first");
        return KVT_EAUTH;
    }
    switch (h->opcode) {
    case KVT_OP_HELLO:
        return h_hello(c, h, body, t0);
    case KVT_OP_AUTH:
        return kvt__h_auth(c, h, body, t0);
    case KVT_OP_MATCH:
        warm_next(c, body);
        return kvt__h_match(c, h, body, t0);
    case KVT_OP_PUT:
        return kvt__h_put(c, h, body, t0);
    case KVT_OP_GET:
        return kvt__h_get(c, h, body, t0);
    case KVT_OP_PREFETCH:
        return kvt__h_prefetch(c, h, body, t0);
    case KVT_OP_RELEASE:
        return kvt__h_release(c, h, body, t0);
    case KVT_OP_REMOVE:
        return kvt__h_remove(c, h, body, t0);
    case KVT_OP_MAP:
        return kvt__h_map(c, h, body, t0);
    case KVT_OP_RESERVE:
        return kvt__h_reserve(c, h, body, t0);
    case KVT_OP_COMMIT:
        return kvt__h_commit(c, h, body, t0);
    case KVT_OP_STATS:
        return h_stats(c, h, t0);
    case KVT_OP_PING:
        if (h->flags)
            return kvt__bad_body(c, h, t0, "PING");
        return kvt__reply(c, h->opcode, h->request_id, t0, 0, body, h->body_len);
    default:
        kvt__proto_error(c->srv, KVT_PERR_UNKNOWN_OP);
        kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_EPROTO, "unknown opcode %u",
                         h->opcode);
        return 0;
    }
}

/*
 * Before the whole MATCH frames in the input buffer go to their handler one by one, their paths
 * through the index are followed all together (kvt_radix_warm_plan): a match alone waits for the
 * index's cache misses one after the other, a pipelined batch can have them in flight at once
 * while the frames before are handled. bench_server, twelve alternating runs with and without:
 * kvtierd CPU per MATCH lower in ten, by about 10% (README, "Benchmarks"). Each path's pages are
 * then asked for KVT_WARM_AHEAD MATCHes ahead (warm_next, above): ten alternating runs against
 * asking for all at once, lower in eight, by about 3 % (docs/benchmarks.md, "MATCH's CPU, session
 * 23"). The wire's tokens are little-endian, the tree's host-order: only done where those are the
 * same bytes.
 */
static void dispatch_batch(kvt__conn_t *c, const uint8_t *in, size_t len)
{
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    kvt_token_run_t runs[KVT_WARM_MAX];
    size_t n = 0, off = 0;
    warm.c = NULL;
    if (!c->hello)
        return;
    /* At most 2 x KVT_WARM_MAX frames looked at: a buffer of many small other frames (which the
     * loop may take in several turns under back-pressure) is not scanned whole each time. */
    for (int seen = 0; seen < 2 * KVT_WARM_MAX && n < KVT_WARM_MAX && len - off >= KVT_PROTO_HDR;
         seen++) {
        kvt_proto_hdr_t h;
        kvt_proto_hdr_decode(in + off, &h);
        if (kvt_proto_hdr_check(&h, (uint32_t)c->srv->conf->max_frame) < 0 ||
            len - off - KVT_PROTO_HDR < h.body_len)
            break; /* a bad header or a frame not all here: framing's business */
        kvt_proto_match_t q;
        if (h.opcode == KVT_OP_MATCH &&
            kvt_proto_match_decode(in + off + KVT_PROTO_HDR, h.body_len, &q) == 0) {
            runs[n].tokens = q.tokens;
            runs[n].ntokens = q.ntokens;
            warm.body[n] = in + off + KVT_PROTO_HDR;
            n++;
        }
        off += KVT_PROTO_HDR + (size_t)h.body_len;
    }
    if (n > 1) {
        kvt__path_warm_plan(c->srv, c->ns, runs, n, &warm.plan);
        warm.c = c;
        warm.next = 0;
        for (size_t i = 0; i < KVT_WARM_AHEAD; i++)
            kvt__path_warm_run(&warm.plan, i);
    }
#else
    (void)c;
    (void)in;
    (void)len;
#endif
}

/* A frame under the lock shared (conn.c's framing, several loops): a MATCH without REMOTE
 * (kvt__match_shares), a GET (kvt__get_shares; its pages' tiers decide, kvt__h_get_shared), or a
 * RELEASE, and only once AUTH has passed; it arrived with its read and a MATCH's pages are asked
 * for ahead, as in kvt__handle. */
static int dispatch_shared(kvt__conn_t *c, const kvt_proto_hdr_t *h, const uint8_t *body)
{
    if (!c->authed)
        return 0;
    if (h->opcode == KVT_OP_GET)
        return kvt__h_get_shared(c, h, body, c->rx_ns);
    if (h->opcode == KVT_OP_RELEASE)
        return kvt__h_release_shared(c, h, body, c->rx_ns);
    if (h->opcode != KVT_OP_MATCH)
        return 0;
    warm_next(c, body);
    return kvt__h_match_shared(c, h, body, c->rx_ns);
}

static int dispatch_shares(const kvt_proto_hdr_t *h)
{
    return (h->opcode == KVT_OP_MATCH && kvt__match_shares(h)) ||
           (h->opcode == KVT_OP_GET && kvt__get_shares(h)) ||
           (h->opcode == KVT_OP_RELEASE && h->flags == 0);
}

/* A closing connection's leases, reservations and mappings go; reservations before the mapping,
 * so that an arena emptied by them can go with its last reference. */
static void dispatch_closing(kvt__conn_t *c)
{
    kvt__lease_drop_all(c);
    kvt__resv_drop_all(c);
    kvt__map_close(c);
}

static void dispatch_tick(kvt__conn_t *c, uint64_t now)
{
    kvt__lease_expire(c, now);
    if (c->nresv)
        kvt__resv_expire(c, now);
}

const kvt__conn_ops_t kvt__dispatch_ops = {
    .batch = dispatch_batch,
    .frame = kvt__handle,
    .shared = dispatch_shared,
    .shares = dispatch_shares,
    .closing = dispatch_closing,
    .tick = dispatch_tick,
    .deadlines = kvt__ops_deadlines,
    .lease_ends = kvt__get_lease_ends,
    .lease_reads = kvt__get_lease_reads,
};
