/*
 * op_map.c: MAP, the start of a local client's zero-copy path (docs/protocol.md, "Zero-copy for
 * local clients"). A DRAM MAP gives the client the memfd of its namespace's arena, sent with the
 * reply (SCM_RIGHTS); from then on GET with LOCATE answers its pages there by location and
 * RESERVE hands out room in it. An HBM MAP gives the pool's CUDA IPC handle, where the operator
 * said every local client is one tenant (hbm-ipc).
 *
 * Why an arena per namespace: a mapping shows everything in the memory it maps, so the memory a
 * client maps must hold its own tenant's blocks and no one else's. The namespace is the tenant
 * (model, adapter, salt: what a GET through the socket could read anyway).
 *
 * zero-copy-arenas bounds the arenas (each a memfd, a mapping and a jemalloc arena). An arena
 * that no connection maps any more only drains (tiers/dram.c), and a departed client's last
 * blocks could keep it, and its slot, for as long as the policy keeps them in DRAM; so when the
 * slots are all taken, a MAP moves the blocks of such an arena into the main region (same tier,
 * same charge: the policy sees nothing change but the location) and the arena goes
 * (kvt__store_free_arena, exec.c).
 */
#include "server.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <unistd.h>

static int map_dram(kvt__conn_t *c, const kvt_proto_hdr_t *h, uint64_t t0)
{
    kvt_srv_t *s = c->srv;
    kvt_tier_t *t = s->tiers[KVT_TIER_DRAM];
    if (!t)
        return kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_EUNAVAIL,
                                "the daemon has no DRAM tier");
    if (c->fd_queued) /* one descriptor held per connection, whatever it pipelines */
        return kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_EAGAIN,
                                "the reply to an earlier MAP is not yet read");
    uint64_t seed = kvt__ns_seed(s, c->ns);
    int fd;
    uint64_t bytes;
    int rc = kvt__tier_share(s, seed, &fd, &bytes);
    if (rc == KVT_ENOSPC && kvt__store_free_arena(s) == 0)
        rc = kvt__tier_share(s, seed, &fd, &bytes);
    if (rc == KVT_ENOSPC)
        return kvt__reply_error(c, h->opcode, h->request_id, t0, rc,
                                "zero-copy-arenas (%u) namespaces have arenas already, each "
                                "mapped by a connection or holding blocks in use",
                                s->conf->zero_copy_arenas);
    if (rc < 0)
        return kvt__reply_error(c, h->opcode, h->request_id, t0, rc,
                                "the namespace's arena could not be made: %s", kvt_strerror(rc));
    /* One reference per connection: a second MAP (or one after a HELLO to another namespace)
     * gives back the one it held. */
    if (c->zc_dram)
        kvt__tier_unshare(s, c->zc_seed);
    c->zc_dram = 1;
    c->zc_seed = seed;
    kvt__metric_set(s->metrics, KVT_M_ZC_ARENAS, 0, kvt__tier_shared(s));
    /* The reply owns a descriptor of its own: the arena's may be closed before the reply is
     * written (its last reference could go first). */
    int dup_fd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (dup_fd < 0)
        return kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_EIO, "dup: %s",
                                strerror(errno));
    kvt__req_t *r = kvt__req_new(c, KVT_REQ_PLAIN, h->opcode, h->request_id, t0);
    if (!r) {
        close(dup_fd);
        return kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_ENOMEM, "out of memory");
    }
    r->pass_fd = dup_fd;
    r->has_fd = 1;
    c->fd_queued = 1;
    kvt_proto_map_reply_t m = {.map_bytes = bytes, .tier = KVT_TIER_DRAM};
    uint8_t w[sizeof(kvt_wire_map_reply_t)];
    kvt_proto_map_reply_encode(w, &m);
    kvt__req_reply(r, w, sizeof w);
    kvt__req_finish(r);
    kvt__metric_add(s->metrics, KVT_M_ZC_MAPS, KVT_TIER_DRAM, 1);
    return 0;
}

static int map_hbm(kvt__conn_t *c, const kvt_proto_hdr_t *h, uint64_t t0)
{
    kvt_srv_t *s = c->srv;
    kvt_tier_t *t = s->tiers[KVT_TIER_HBM];
    if (!t)
        return kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_EUNAVAIL,
                                "the daemon has no HBM tier");
    if (!s->conf->hbm_ipc)
        return kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_EUNAVAIL,
                                "hbm-ipc is off: the HBM pool is one allocation shared by every "
                                "tenant, exported only when all local clients are one");
    uint8_t b[sizeof(kvt_wire_map_reply_t) + KVT_HBM_IPC_HANDLE];
    uint64_t bytes;
    int rc = kvt__tier_hbm_ipc(s, c->device, b + sizeof(kvt_wire_map_reply_t), &bytes);
    if (rc < 0)
        return kvt__reply_error(c, h->opcode, h->request_id, t0, rc,
                                rc == KVT_EUNAVAIL ? "the HBM tier has no CUDA device memory to "
                                                     "export (host backend)"
                                                   : "the HBM pool could not be exported: %s",
                                kvt_strerror(rc));
    c->zc_hbm = 1;
    c->zc_hbm_device = rc; /* the pool of its device (or the first): only its blocks LOCATE */
    kvt_proto_map_reply_t m = {
        .map_bytes = bytes, .tier = KVT_TIER_HBM, .handle_len = KVT_HBM_IPC_HANDLE};
    kvt_proto_map_reply_encode(b, &m);
    kvt__metric_add(s->metrics, KVT_M_ZC_MAPS, KVT_TIER_HBM, 1);
    return kvt__reply(c, h->opcode, h->request_id, t0, 0, b, sizeof b);
}

int kvt__h_map(kvt__conn_t *c, const kvt_proto_hdr_t *h, const uint8_t *body, uint64_t t0)
{
    uint32_t tier;
    if (h->flags || kvt_proto_map_decode(body, h->body_len, &tier) < 0)
        return kvt__bad_body(c, h, t0, "MAP");
    if (kvt__need_hello(c, h, t0) < 0)
        return 0;
    if (c->tcp)
        return kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_EINVAL,
                                "zero-copy needs the Unix socket: a mapping is for clients on "
                                "the daemon's host");
    if (c->block_bytes == 0)
        return kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_EINVAL,
                                "the connection is index-only (HELLO block size 0)");
    if (!c->srv->conf->zero_copy)
        return kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_EUNAVAIL,
                                "zero-copy is off in this daemon's configuration");
    if (tier == KVT_TIER_DRAM)
        return map_dram(c, h, t0);
    if (tier == KVT_TIER_HBM)
        return map_hbm(c, h, t0);
    return kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_EINVAL,
                            "tier %u cannot be mapped (DRAM 2 or HBM 1)", tier);
}

void kvt__map_close(kvt__conn_t *c)
{
    kvt_srv_t *s = c->srv;
    if (c->zc_dram && s->tiers[KVT_TIER_DRAM]) {
        kvt__tier_unshare(s, c->zc_seed);
        kvt__metric_set(s->metrics, KVT_M_ZC_ARENAS, 0, kvt__tier_shared(s));
    }
    c->zc_dram = 0;
    c->zc_hbm = 0;
}
