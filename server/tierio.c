/*
 * tierio.c: what every request with tier I/O shares: the block key of a page, the I/O record,
 * the in-flight counts (per request, connection and daemon) and their completion accounting, and
 * the pin the request holds on its path while its I/O runs.
 */
#include "server.h"

#include <errno.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

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

uint64_t kvt__block_hash(kvt_srv_t *s, kvt_radix_node_t *node, uint32_t depth)
{
    uint64_t h = kvt_radix_block_hash(s->radix, node, depth); /* computed here if not yet */
    kvt_assert(h);
    return h;
}

kvt__io_t *kvt__io_new(kvt_srv_t *s, kvt__req_t *r, uint32_t depth)
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

void kvt__io_started(kvt_srv_t *s, kvt__req_t *r)
{
    r->pending++;
    s->inflight++;
    if (r->conn)
        r->conn->inflight++;
}

/* Accounts one finished I/O; returns 1 when it was the request's last. */
int kvt__io_finished(kvt_srv_t *s, kvt__io_t *x, int status, int write)
{
    kvt__req_t *r = x->req;
    unsigned series = kvt__tier_io(x->tier, write);
    kvt__metric_observe(s->metrics, KVT_M_TIER_IO_SECONDS, series, kvt_now_ns() - x->start_ns);
    if (status < 0)
        kvt__metric_add(s->metrics, KVT_M_TIER_IO_ERRORS, series, 1);
    return kvt__io_ended(s, r);
}

int kvt__io_ended(kvt_srv_t *s, kvt__req_t *r)
{
    r->pending--;
    s->inflight--;
    if (r->conn)
        r->conn->inflight--;
    return r->pending == 0;
}

void kvt__unpin(kvt_srv_t *s, kvt__req_t *r)
{
    if (r->lease) {
        kvt_radix_release(s->radix, r->lease);
        r->lease = 0;
    }
}

/* A tier's error as a client reads it in a GET's end frame: the remote tier's EPROTO (its server
 * answered something malformed) would tell the client that its own frame was malformed; to it,
 * that is a failed I/O. */
int kvt__tier_failure(int rc)
{
    return rc == KVT_EPROTO ? KVT_EIO : rc;
}

/* A lease over node and everything above it, for I/O that must not see the path go. KVT_ENOSPC
 * when the lease table would grow past index-bytes: the caller made room first when it could. */
int kvt__pin(kvt_srv_t *s, kvt_radix_node_t *node, uint32_t ns, uint64_t *lease)
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

/*
 * The NVMe log's segment reclaim drops blocks without asking the index, so a path whose pages
 * must stay readable pins their NVMe blocks in the tier as well as the path in the index: a
 * client's lease from its MATCH (lease.c) and, once that lease has ended, a GET still reading
 * under it (op_get.c, kvt__get_lease_ends). Out of memory for the list, the path still holds in
 * the index; its NVMe blocks are then only as safe as any other (kvt__store_lost catches a
 * reclaimed one).
 */
void kvt__nvme_pin(kvt_srv_t *s, kvt__nvme_pins_t *p, kvt_radix_node_t *node, uint32_t pages)
{
    if (!s->tiers[KVT_TIER_NVME])
        return;
    const kvt_match_t m = {
        .node = node, .node_pages = pages - kvt_radix_node_depth(node), .pages = pages};
    uint32_t n = 0;
    kvt__path_t w;
    for (kvt__path_walk(&w, &m); w.run.node; kvt__path_step(&w))
        for (uint32_t i = 0; i < w.run.n; i++)
            n += w.run.blocks[i].tier == KVT_TIER_NVME;
    if (n == 0 || !(p->locs = malloc(n * sizeof *p->locs)))
        return;
    for (kvt__path_walk(&w, &m); w.run.node; kvt__path_step(&w))
        for (uint32_t i = 0; i < w.run.n; i++)
            if (w.run.blocks[i].tier == KVT_TIER_NVME &&
                kvt_tier_pin(s->tiers[KVT_TIER_NVME], w.run.blocks[i].loc, 1) == 0)
                p->locs[p->n++] = w.run.blocks[i].loc;
}

void kvt__nvme_unpin(kvt_srv_t *s, kvt__nvme_pins_t *p)
{
    for (uint32_t i = 0; i < p->n; i++)
        kvt_tier_pin(s->tiers[KVT_TIER_NVME], p->locs[i], -1);
    free(p->locs);
    *p = (kvt__nvme_pins_t){0};
}

/* ---- the door's tier calls (store.h) ---- */

void kvt__tier_usage(const kvt_srv_t *s, kvt_tier_id_t tier, kvt_tier_usage_t *u)
{
    kvt_tier_usage(s->tiers[tier], u);
}

uint64_t kvt__tier_dropped(const kvt_srv_t *s, kvt_tier_id_t tier)
{
    return kvt_tier_dropped(s->tiers[tier]);
}

int kvt__tier_write_prepare(const kvt_srv_t *s, kvt_tier_id_t tier, kvt_tier_io_t *io)
{
    return kvt_tier_write_prepare(s->tiers[tier], io);
}

int kvt__tier_read_check(kvt_tier_io_t *io)
{
    return kvt_tier_read_check(io);
}

void kvt__tier_read_corrupt(const kvt_srv_t *s, kvt_tier_id_t tier, const kvt_tier_io_t *io)
{
    kvt_tier_read_corrupt(s->tiers[tier], io);
}

uint64_t kvt__tier_footprint(const kvt_srv_t *s, kvt_tier_id_t tier, uint64_t block_bytes)
{
    return kvt_tier_footprint(s->tiers[tier], (uint32_t)block_bytes);
}

int kvt__tier_probe(kvt_srv_t *s, kvt_tier_probe_t *p)
{
    kvt_tier_t *t = s->tiers[KVT_TIER_REMOTE];
    return t ? kvt_tier_remote_probe(t, p) : KVT_EUNAVAIL;
}

/* Whether page b can go as a location to connection c: it lies in the DRAM arena c mapped (that
 * of ns, the namespace of the lease it is read under), or in the HBM pool c mapped. GET with
 * LOCATE and MATCH with LOCATE (op_match.c) both ask here. */
int kvt__store_locate(kvt_srv_t *s, const kvt__conn_t *c, uint32_t ns, const kvt_block_t *b,
                      uint64_t *off)
{
    if (!c)
        return 0;
    if (b->tier == KVT_TIER_DRAM && c->zc_dram && c->zc_seed == kvt_radix_ns_seed(s->radix, ns))
        return kvt_tier_dram_offset(s->tiers[KVT_TIER_DRAM], c->zc_seed, b->loc, off) == 0;
    if (b->tier == KVT_TIER_HBM && c->zc_hbm)
        return kvt_tier_hbm_device(s->tiers[KVT_TIER_HBM], b->loc) == c->zc_hbm_device &&
               kvt_tier_hbm_offset(s->tiers[KVT_TIER_HBM], b->loc, off) == 0;
    return 0;
}

int kvt__tier_check(kvt_srv_t *s, const kvt_block_t *b)
{
    return b->tier == KVT_TIER_DRAM && s->tiers[KVT_TIER_DRAM]
               ? kvt_tier_dram_check(s->tiers[KVT_TIER_DRAM], b->loc)
               : 0;
}

int kvt__tier_intact(const kvt_srv_t *s, const kvt_block_t *b)
{
    return b->tier != KVT_TIER_DRAM || kvt_tier_dram_intact(s->tiers[KVT_TIER_DRAM], b->loc);
}

const uint8_t *kvt__tier_ptr(kvt_srv_t *s, const kvt_block_t *b)
{
    return kvt_tier_ptr(s->tiers[b->tier], b->loc);
}

void *kvt__tier_loc_ptr(kvt_srv_t *s, kvt_tier_id_t tier, uint64_t loc)
{
    return kvt_tier_ptr(s->tiers[tier], loc);
}

int kvt__tier_read(kvt_srv_t *s, kvt_tier_id_t tier, kvt_tier_io_t *io)
{
    return kvt_tier_read(s->tiers[tier], io);
}

/*
 * A window behind a gap on NVMe (docs/protocol.md, "Chains with gaps"): the block at depth, about
 * to be written there, follows a page that holds no bytes (index-only, no write of it under
 * way), so no NVMe record names the pages in front of it and a restart could not rebuild its
 * path. Their tokens, from the root, go to the tier's path log (kvt_tier_nvme_add_path) so that
 * a restart gives them back as index-only pages before the window. Once per window start: the
 * window's later pages follow pages with bytes (or being written).
 */
void kvt__nvme_gap_path(kvt_srv_t *s, kvt_radix_node_t *node, uint32_t depth,
                        const kvt_block_key_t *key)
{
    static kvt_log_limit_t lim;
    kvt_tier_t *t = s->tiers[KVT_TIER_NVME];
    if (!t || depth == 0)
        return;
    const kvt_block_t *pb = kvt_radix_block_at(node, depth - 1);
    if (!pb || pb->tier != KVT_TIER_NONE || (pb->flags & KVT_BLOCK_BUSY))
        return;
    uint32_t page = key->ntokens;
    int rc = KVT_EINVAL;
    uint32_t *tok = (uint64_t)depth * page <= KVT_NVME_PATH_MAX_TOKENS
                        ? malloc((size_t)depth * page * sizeof *tok)
                        : NULL;
    if (tok) {
        kvt_radix_node_t *n = node;
        for (uint32_t p = depth; p-- > 0;) {
            while (p < kvt_radix_node_depth(n))
                n = kvt_radix_node_parent(n);
            memcpy(tok + (size_t)p * page, kvt_radix_node_tokens(n, p - kvt_radix_node_depth(n)),
                   page * sizeof *tok);
        }
        rc = kvt_tier_nvme_add_path(t, key, tok, depth);
        free(tok);
    } else if ((uint64_t)depth * page <= KVT_NVME_PATH_MAX_TOKENS) {
        rc = KVT_ENOMEM;
    }
    if (rc < 0)
        kvt_log_limited(&lim, KVT_LOG_WARN,
                        "kvtierd: the path in front of a window at page %u (%u tokens) was not "
                        "recorded (%s): a restart will not find the window",
                        depth, depth * page, kvt_strerror(rc));
}

int kvt__tier_write(kvt_srv_t *s, kvt_tier_id_t tier, kvt_tier_io_t *io)
{
    int rc = kvt_tier_write(s->tiers[tier], io);
    if (rc == 0 && tier == KVT_TIER_NVME) {
        /* Every write here is a PUT's, its io inside a kvt__io_t (kvt__io_new). */
        kvt__io_t *x = (kvt__io_t *)(void *)((char *)io - offsetof(kvt__io_t, io));
        if (x->req && x->req->put.gaps)
            kvt__nvme_gap_path(s, x->node, x->depth, &io->key);
    }
    return rc;
}

int kvt__tier_fits(kvt_srv_t *s, kvt_tier_id_t tier, uint64_t ns_seed, uint32_t len)
{
    return kvt_tier_ns_fits(s->tiers[tier], ns_seed, len, 1);
}

void kvt__tier_release(kvt_srv_t *s, kvt_tier_id_t tier, uint64_t loc, uint32_t len, int orphan)
{
    if (orphan)
        kvt_tier_dram_orphan_free(s->tiers[tier], loc, len);
    else
        kvt_tier_free(s->tiers[tier], loc, len);
}

int kvt__tier_offset(const kvt_srv_t *s, uint64_t ns_seed, uint64_t loc, uint64_t *off)
{
    return kvt_tier_dram_offset(s->tiers[KVT_TIER_DRAM], ns_seed, loc, off);
}

void kvt__tier_seal(kvt_srv_t *s, uint64_t loc, int has_sum, uint64_t sum)
{
    kvt_tier_t *t = s->tiers[KVT_TIER_DRAM];
    if (has_sum)
        (void)kvt_tier_dram_seal_as(t, loc, sum);
    else if (kvt_tier_dram_seal_later(t, loc) == KVT_ENOMEM)
        (void)kvt_tier_dram_seal(t, loc);
}

int kvt__tier_orphan(kvt_srv_t *s, uint64_t loc, uint32_t len)
{
    return kvt_tier_dram_orphan(s->tiers[KVT_TIER_DRAM], loc, len);
}

int kvt__tier_share(kvt_srv_t *s, uint64_t ns_seed, int *fd, uint64_t *map_bytes)
{
    return kvt_tier_dram_share(s->tiers[KVT_TIER_DRAM], ns_seed, fd, map_bytes);
}

void kvt__tier_unshare(kvt_srv_t *s, uint64_t ns_seed)
{
    kvt_tier_dram_unshare(s->tiers[KVT_TIER_DRAM], ns_seed);
}

uint32_t kvt__tier_shared(const kvt_srv_t *s)
{
    return kvt_tier_dram_shared(s->tiers[KVT_TIER_DRAM]);
}

int kvt__tier_hbm_ipc(kvt_srv_t *s, int device, uint8_t *handle, uint64_t *bytes)
{
    return kvt_tier_hbm_ipc(s->tiers[KVT_TIER_HBM], device, handle, bytes);
}

int kvt__tier_add_ns(kvt_srv_t *s, const char *model, const char *adapter, const char *salt,
                     uint32_t page_size)
{
    return kvt_tier_nvme_add_ns(s->tiers[KVT_TIER_NVME], model, adapter, salt, page_size);
}

uint32_t kvt__tier_nvme_max_block(const kvt_srv_t *s, uint32_t page_size)
{
    return kvt_tier_nvme_max_block(s->tiers[KVT_TIER_NVME], page_size);
}

int kvt__tier_holds(const kvt_srv_t *s, kvt_tier_id_t tier, uint32_t ns, uint32_t len)
{
    if (tier != KVT_TIER_NVME || !s->tiers[tier])
        return 1;
    return len <= kvt__tier_nvme_max_block(s, kvt_radix_ns_page_size(s->radix, ns));
}
