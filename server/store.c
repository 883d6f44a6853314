/*
 * store.c: KV bytes in the tiers, as the daemon moves them. It owns the tiers' creation from the
 * configuration (HBM when a GPU is usable, DRAM, NVMe in the data directory with its warm-restart
 * recovery, the remote Valkey/Redis server), the radix free callback that gives a leaving block's
 * bytes back to its tier, and the three asynchronous paths of a request: PUT (write each new
 * page's payload to the fastest tier that takes it), GET (read a leased path's blocks in bounded
 * batches straight into the reply, promoting blocks read from below DRAM), and PREFETCH (copy a
 * path's blocks up to a tier with kvt_tier_copy). All of it runs on the loop: submits never
 * block, completions come back through the tiers' fds.
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
#include <xxhash.h>

#define KVT_GET_BATCH_BYTES (8u << 20) /* GET reads at most this much ahead of the socket */

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
        kvt_busy_tab[i].hash = h;
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
    for (size_t j = (i + 1) & mask;; j = (j + 1) & mask) {
        kvt_busy_tab[i].hash = 0;
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
        kvt_tier_hbm_conf_t hc = {
            .backend = c->hbm_backend, .capacity_bytes = c->hbm_bytes, .device = c->hbm_device};
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
            kvt_log(KVT_LOG_ERROR, "kvtierd: NVMe tier in %s: %s%s", c->data_dir, kvt_strerror(rc),
                    rc == KVT_EINVAL ? " (nvme-bytes must hold at least 2 segments of "
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
            kvt_log(KVT_LOG_INFO,
                    "kvtierd: NVMe recovery: %llu blocks back in the index (%llu scanned, %llu "
                    "torn, %llu stale, %llu orphans)",
                    (unsigned long long)rec.inserted, (unsigned long long)rec.scanned,
                    (unsigned long long)rec.torn, (unsigned long long)rec.stale,
                    (unsigned long long)rec.orphans);
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
    for (int i = 1; i < KVT_TIER_COUNT; i++) {
        if (!s->tiers[i])
            continue;
        kvt_tier_usage_t u;
        kvt_tier_usage(s->tiers[i], &u);
        kvt_log(KVT_LOG_INFO, "kvtierd: %s tier: %llu bytes (%s)", kvt_tier_name((kvt_tier_id_t)i),
                (unsigned long long)u.capacity_bytes, kvt_tier_backend(s->tiers[i]));
    }
    /* The policy settings are checked at start-up (conf.c) but the engine is not in this code
     * path yet: say so rather than let an operator believe otherwise. */
    kvt_log(KVT_LOG_INFO,
            "kvtierd: policy %s (%s on %s, watermarks %.2f/%.2f) checked but not yet applied: "
            "blocks go to the fastest tier with room and are not demoted",
            c->policy, c->policy_model, c->policy_hw, c->policy_high, c->policy_low);
    return 0;
}

void kvt__store_close(kvt_srv_t *s)
{
    for (int i = 0; i < KVT_TIER_COUNT; i++) {
        kvt_tier_destroy(s->tiers[i]);
        s->tiers[i] = NULL;
    }
    free(s->busy);
    s->busy = NULL;
    s->busy_cap = s->busy_n = 0;
}

int kvt__ghost_seen(const kvt_srv_t *s, uint64_t hash)
{
    return hash && s->ghosts[hash & (s->nghosts - 1)] == hash;
}

void kvt__store_free_cb(void *arg, uint32_t ns, kvt_block_t *b)
{
    (void)ns;
    kvt_srv_t *s = arg;
    if (s->tearing_down)
        return; /* the tiers are destroyed next and free everything themselves */
    if (b->tier != KVT_TIER_NONE && s->tiers[b->tier])
        kvt_tier_free(s->tiers[b->tier], b->loc, b->size);
    if (!s->removing) {
        s->ghosts[b->hash & (s->nghosts - 1)] = b->hash;
        kvt__metric_add(s->metrics, KVT_M_BLOCKS_DROPPED, b->tier, 1);
    }
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
    }
    kvt_radix_stats_t rs;
    kvt_radix_stats(s->radix, &rs);
    kvt__metric_set(s->metrics, KVT_M_INDEX_BLOCKS, 0, (double)rs.blocks);
    kvt__metric_set(s->metrics, KVT_M_INDEX_BYTES, 0, (double)rs.bytes);
    kvt__metric_set(s->metrics, KVT_M_LEASES, 0, (double)rs.leases);
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

static void kvt_put_reply(kvt_srv_t *s, kvt__req_t *r)
{
    kvt_unpin(s, r);
    uint8_t buf[KVT_PROTO_HDR + sizeof(kvt_wire_put_reply_t)];
    kvt_wire_put_reply_t w = {
        .pages = htole32(r->pages),
        .new_pages = htole32(r->new_pages),
        .stored = htole32(r->stored),
        .skipped = htole32(r->skipped),
    };
    uint32_t len = r->status < 0 ? 0 : sizeof w;
    kvt_proto_frame(buf, r->op | KVT_OP_REPLY, 0, r->id, r->status, len);
    memcpy(buf + KVT_PROTO_HDR, &w, sizeof w);
    if (kvt__req_append(r, buf, KVT_PROTO_HDR + len) < 0)
        r->status = KVT_ENOMEM;
    kvt__req_finish(r);
}

static void kvt_put_done(kvt_tier_io_t *io)
{
    kvt__io_t *x = io->data;
    kvt__req_t *r = x->req;
    kvt_srv_t *s = x->req->srv;
    kvt_block_t *b = kvt_radix_block_at(x->node, x->depth);
    kvt_assert(b);
    b->flags &= (uint8_t)~KVT_BLOCK_BUSY;
    if (io->status == 0 && b->tier == KVT_TIER_NONE) {
        b->tier = x->tier;
        b->loc = io->loc;
        b->size = io->len;
        r->stored++;
        if (x->tier == KVT_TIER_NVME)
            kvt__metric_add(s->metrics, KVT_M_NVME_WRITTEN, 0, io->len);
    } else {
        if (io->status == 0)
            kvt_tier_free(s->tiers[x->tier], io->loc, io->len);
        else
            kvt_log(KVT_LOG_WARN, "kvtierd: %s tier write failed: %s", kvt_tier_name(x->tier),
                    kvt_strerror(io->status));
        r->skipped++;
    }
    int last = kvt_io_finished(s, x, io->status, 1);
    free(x);
    if (last)
        kvt_put_reply(s, r);
}

int kvt__store_put(kvt_srv_t *s, kvt__req_t *r)
{
    uint32_t end = r->status < 0 ? r->first : KVT_MIN(r->end, r->pages);
    for (uint32_t p = r->first; p < end; p++) {
        kvt_block_t *b = kvt_radix_block_at(r->node, p);
        if (!b || b->tier != KVT_TIER_NONE || (b->flags & KVT_BLOCK_BUSY)) {
            r->skipped++; /* held already, or being written by another PUT */
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
        int rc = KVT_ENOSPC;
        for (size_t i = 0; i < KVT_ARRAY_LEN(kvt_order) && rc == KVT_ENOSPC; i++) {
            kvt_tier_t *t = s->tiers[kvt_order[i]];
            if (!t)
                continue;
            x->tier = (uint8_t)kvt_order[i];
            rc = kvt_tier_write(t, &x->io);
            if (rc == KVT_EUNAVAIL)
                rc = KVT_ENOSPC; /* the remote is down: as good as full */
        }
        if (rc < 0) {
            free(x);
            r->skipped++;
            continue;
        }
        b->flags |= KVT_BLOCK_BUSY;
        kvt_io_started(s, r);
    }
    if (r->pending == 0)
        kvt_put_reply(s, r); /* nothing to write (all held already), or it failed to start */
    return 0;
}

/* ---- moves (GET promotions and PREFETCH) ---- */

static void kvt_move_commit(kvt_srv_t *s, kvt__io_t *x, uint64_t new_loc, int status)
{
    kvt_block_t *b = kvt_radix_block_at(x->node, x->depth);
    kvt_assert(b);
    b->flags &= (uint8_t)~KVT_BLOCK_BUSY;
    if (status == 0 && b->tier == x->from && b->loc == x->src_loc &&
        kvt_busy_get(s, b->hash) == 0) {
        /* The remote copy stays for the fleet (keep_on_free); freeing only forgets it. */
        kvt_tier_free(s->tiers[x->from], x->src_loc, b->size);
        b->tier = x->tier;
        b->loc = new_loc;
        kvt__metric_add(s->metrics, KVT_M_BLOCKS_MOVED, kvt__pair(x->from, x->tier), 1);
        if (x->tier == KVT_TIER_NVME)
            kvt__metric_add(s->metrics, KVT_M_NVME_WRITTEN, 0, b->size);
        x->req->moved++;
    } else {
        if (status == 0)
            kvt_tier_free(s->tiers[x->tier], new_loc, b->size);
        x->req->failed++;
    }
}

/* ---- GET ---- */

static void kvt_get_promote_done(kvt_tier_io_t *io);

static void kvt_get_read_done(kvt_tier_io_t *io)
{
    kvt__io_t *x = io->data;
    kvt__req_t *r = x->req;
    kvt_srv_t *s = x->req->srv;
    kvt_busy_dec(s, io->key.hash);
    if (io->status == KVT_ECORRUPT)
        kvt__metric_add(s->metrics, KVT_M_MISS_TOKENS, KVT_MISS_CHECKSUM, io->key.ntokens);
    kvt__req_t *rr = r;
    int last = kvt_io_finished(s, x, io->status, 0);
    /* A block read from below DRAM moves up while its bytes are at hand, when DRAM has room and
     * nothing else is reading or moving it. */
    kvt_block_t *b = kvt_radix_block_at(x->node, x->depth);
    kvt_tier_t *dram = s->tiers[KVT_TIER_DRAM];
    if (io->status == 0 && rr->conn && dram && x->tier > KVT_TIER_DRAM && b && b->tier == x->tier &&
        !(b->flags & KVT_BLOCK_BUSY) && kvt_busy_get(s, b->hash) == 0) {
        kvt__io_t *w = kvt_io_new(s, rr, x->depth);
        if (w) {
            w->io.buf = io->buf;
            w->io.len = io->len;
            w->io.cb = kvt_get_promote_done;
            w->from = x->tier;
            w->tier = KVT_TIER_DRAM;
            w->src_loc = b->loc;
            if (kvt_tier_write(dram, &w->io) == 0) {
                b->flags |= KVT_BLOCK_BUSY;
                kvt_io_started(s, rr);
                last = 0;
            } else {
                free(w);
            }
        }
    }
    if (last)
        kvt__store_get_batch(s, rr);
}

static void kvt_get_promote_done(kvt_tier_io_t *io)
{
    kvt__io_t *w = io->data;
    kvt__req_t *r = w->req;
    kvt_srv_t *s = w->req->srv;
    kvt_move_commit(s, w, io->loc, io->status);
    int last = kvt_io_finished(s, w, io->status, 1);
    free(w);
    if (last)
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
 * taken all of it, conn.c calls kvt__store_get_batch() again for the next one. At most
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
}

void kvt__store_get_abort(kvt_srv_t *s, kvt__req_t *r)
{
    if (r->ios)
        kvt_get_release_batch(s, r);
    kvt_unpin(s, r);
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
                kvt_log(KVT_LOG_INFO, "kvtierd: GET page %u from %s: %s", x->depth,
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
            r->conn->out_bytes += bytes;
            kvt__conn_kick(r->conn);
            return 0; /* conn.c calls back when the socket has taken it */
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
        if (n * hdr > r->out_cap) {
            uint8_t *np = realloc(r->out, n * hdr);
            if (!np) {
                r->status = KVT_ENOMEM;
                goto end;
            }
            r->out = np;
            r->out_cap = n * hdr;
        }
        r->ios = calloc(n, sizeof *r->ios);
        r->segs = calloc(2 * (size_t)n, sizeof *r->segs);
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
            kvt_wire_get_data_t d = {.page = htole32(r->cur), .tier = b->tier};
            memcpy(f + KVT_PROTO_HDR, &d, sizeof d);
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
    uint8_t buf[KVT_PROTO_HDR + sizeof(kvt_wire_get_end_t)];
    kvt_wire_get_end_t e = {.npages = htole32(r->sent)};
    kvt_proto_frame(buf, r->op | KVT_OP_REPLY, 0, r->id, r->status, sizeof e);
    memcpy(buf + KVT_PROTO_HDR, &e, sizeof e);
    kvt_unpin(s, r);
    r->out_off = r->out_len = 0;
    if (kvt__req_append(r, buf, sizeof buf) < 0)
        r->conn->dead = 1;
    kvt__req_finish(r);
    return 0;
}

/* ---- PREFETCH ---- */

static void kvt_prefetch_reply(kvt_srv_t *s, kvt__req_t *r, uint32_t unfinished)
{
    (void)s;
    uint8_t buf[KVT_PROTO_HDR + sizeof(kvt_wire_prefetch_reply_t)];
    kvt_wire_prefetch_reply_t w = {
        .pages = htole32(r->pages),
        .moved = htole32(r->moved),
        .resident = htole32(r->resident),
        .failed = htole32(r->failed + unfinished),
    };
    uint32_t len = r->status < 0 ? 0 : sizeof w;
    kvt_proto_frame(buf, r->op | KVT_OP_REPLY, 0, r->id, r->status, len);
    memcpy(buf + KVT_PROTO_HDR, &w, sizeof w);
    r->replied = 1;
    if (r->conn && kvt__req_append(r, buf, KVT_PROTO_HDR + len) < 0)
        r->conn->dead = 1;
}

static void kvt_prefetch_done(kvt_tier_copy_t *c)
{
    kvt__io_t *x = c->data;
    kvt__req_t *r = x->req;
    kvt_srv_t *s = x->req->srv;
    kvt_move_commit(s, x, c->dst_loc, c->status);
    int last = kvt_io_finished(s, x, c->status, 1);
    free(x);
    if (!last)
        return;
    kvt_unpin(s, r);
    if (!r->replied)
        kvt_prefetch_reply(s, r, 0);
    kvt__req_finish(r);
}

int kvt__store_prefetch(kvt_srv_t *s, kvt__req_t *r)
{
    if (r->status < 0 || r->replied || r->cur == r->pages) {
        /* Nothing (more) to start: answer now. */
        kvt_unpin(s, r);
        kvt_prefetch_reply(s, r, 0);
        kvt__req_finish(r);
        return 0;
    }
    for (; r->cur < r->pages; r->cur++) {
        kvt_block_t *b = kvt_radix_block_at(r->node, r->cur);
        if (!b || b->tier == KVT_TIER_NONE || !s->tiers[b->tier]) {
            r->failed++;
            continue;
        }
        if (b->tier <= r->target) {
            r->resident++;
            continue;
        }
        if ((b->flags & KVT_BLOCK_BUSY) || kvt_busy_get(s, b->hash)) {
            r->failed++;
            continue;
        }
        kvt__io_t *x = kvt_io_new(s, r, r->cur);
        if (!x)
            return KVT_ENOMEM;
        x->from = b->tier;
        x->tier = (uint8_t)r->target;
        x->src_loc = b->loc;
        x->is_copy = 1;
        x->copy.src = s->tiers[b->tier];
        x->copy.dst = s->tiers[r->target];
        x->copy.src_loc = b->loc;
        x->copy.key = x->io.key;
        x->copy.len = b->size;
        x->copy.cb = kvt_prefetch_done;
        if (kvt_tier_copy(&x->copy) < 0) {
            free(x);
            r->failed++;
            continue;
        }
        b->flags |= KVT_BLOCK_BUSY;
        kvt_io_started(s, r);
    }
    return 0;
}

void kvt__store_deadlines(kvt__conn_t *c, uint64_t now)
{
    for (kvt__req_t *r = c->head; r; r = r->next) {
        if (r->kind == KVT_REQ_PREFETCH && !r->done && !r->replied && r->pending > 0 &&
            now >= r->deadline_ns) {
            kvt_prefetch_reply(c->srv, r, r->pending);
            kvt__req_finish(r);
            return; /* the kick may have freed the connection */
        }
    }
}
