/*
 * store.c: the tiers and the tier policy, created from the configuration (HBM when a GPU is
 * usable, DRAM, NVMe in the data directory with its warm-restart recovery, the remote Valkey/Redis
 * server) and destroyed at exit, and the tier gauges of the metrics. All of it runs on the loop:
 * submits never block, completions come back through the tiers' fds.
 */
#include "server.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

/* The NVMe blocks recovery put back into the tree join the policy's accounting. */
static void adopt_recovered(kvt_srv_t *s)
{
    size_t n = kvt_radix_node_count(s->radix), refused = 0;
    for (size_t i = 0; i < n; i++) {
        kvt_radix_node_t *node = kvt_radix_node_at(s->radix, i);
        kvt_block_t *b = kvt_radix_node_blocks(node);
        uint32_t np = kvt_radix_node_pages(node), d0 = kvt_radix_node_depth(node);
        for (uint32_t j = 0; j < np;) {
            uint8_t t = b[j].tier;
            uint32_t k = j;
            while (k < np && b[k].tier == t)
                k++;
            if (t != KVT_TIER_NONE) {
                for (uint32_t q = j; q < k; q++)
                    kvt__block_place(&b[q], b[q].loc, b[q].size); /* adopted below */
                uint32_t got =
                    kvt__policy_adopt(s, node, d0 + j, d0 + k, (kvt_tier_id_t)t, 0, NULL);
                refused += (k - j) - got;
                b = kvt_radix_node_blocks(node);
            }
            j = k;
        }
    }
    if (refused)
        kvt_log(KVT_LOG_WARN,
                "kvtierd: %zu recovered blocks did not fit the policy's accounting "
                "and were freed",
                refused);
}

static int policy_open(kvt_srv_t *s)
{
    kvt_srv_conf_t *c = s->conf;
    kvt_policy_conf_t pc = {.ops = &kvt__exec_ops,
                            .ops_arg = s,
                            .nvme_min_hits = c->nvme_min_hits,
                            .reports_node_frees = 1,
                            .ghosts = s->exec.ghosts};
    if (kvt_policy_kind_parse(c->policy, &pc.kind) < 0 ||
        kvt_model_profile_get(c->policy_model, &pc.model) < 0 ||
        kvt_hw_profile_get(c->policy_hw, &pc.hw) < 0)
        return KVT_EINVAL; /* kvt__conf_finish checked them: not reached */
    for (int i = 1; i < KVT_TIER_COUNT; i++) {
        if (!s->tiers[i])
            continue;
        kvt_tier_usage_t u;
        kvt_tier_usage(s->tiers[i], &u);
        pc.tiers[i] = (kvt_policy_tier_conf_t){.capacity = u.capacity_bytes,
                                               .high = (float)c->policy_high,
                                               .low = (float)c->policy_low};
    }
    int rc = kvt_policy_create(&s->policy, s->radix, &pc);
    if (rc < 0) {
        kvt_log(KVT_LOG_ERROR, "kvtierd: policy %s: %s", c->policy, kvt_strerror(rc));
        return rc;
    }
    adopt_recovered(s);
    kvt_log(KVT_LOG_INFO,
            "kvtierd: policy %s (%s on %s): tiers above %.0f%% of capacity are brought down to "
            "%.0f%% by demoting or dropping their lowest-value blocks",
            c->policy, c->policy_model, c->policy_hw, c->policy_high * 100, c->policy_low * 100);
    return 0;
}

/* ---- tiers ---- */

/*
 * The NVMe tier's warm restart, fed into the index: the tier yields token paths (tier.h,
 * "Recovery into an index"); each namespace found on disk is opened by the description the tier
 * recorded, else by its seed, each path inserted, and every block on it whose page the tree now
 * holds with the same hash and no bytes elsewhere gets tier, loc and size; a path's pages without
 * a block (a gap in front of a window, tier.h) stay index-only. The tier frees what nothing
 * indexed (orphans). On KVT_ENOMEM the tree keeps what was inserted so far.
 */
int kvt_store_nvme_recover(kvt_radix_t *tree, kvt_tier_t *nvme, kvt_tier_nvme_recovery_t *out)
{
    if (!tree || !nvme)
        return KVT_EINVAL;
    kvt_tier_nvme_ns_t *ns;
    size_t nns;
    int rc = kvt_tier_nvme_recover_begin(nvme, &ns, &nns);
    if (rc < 0)
        return rc;
    uint32_t *ids = calloc(nns ? nns : 1, sizeof(*ids));
    uint8_t *open = calloc(nns ? nns : 1, 1);
    if (!ids || !open) {
        rc = KVT_ENOMEM;
        goto out;
    }
    for (size_t k = 0; k < nns; k++) {
        if (ns[k].model) {
            if (kvt_radix_ns_open(tree, ns[k].model, ns[k].adapter, ns[k].salt, ns[k].page_size,
                                  &ids[k]) == 0)
                ns[k].named = open[k] = 1;
            else
                kvt_log(KVT_LOG_WARN, "nvme tier: could not reopen namespace %s/%s (page %u)",
                        ns[k].model, ns[k].adapter, ns[k].page_size);
        }
        if (!open[k] && kvt_radix_ns_open_seed(tree, ns[k].seed, ns[k].page_size, &ids[k]) == 0)
            open[k] = 1;
    }
    kvt_tier_nvme_path_t p;
    while ((rc = kvt_tier_nvme_recover_next(nvme, &p)) > 0) {
        if (!open[p.ns])
            continue; /* its blocks are orphans */
        kvt_insert_t res;
        if ((rc = kvt_radix_insert(tree, ids[p.ns], p.tokens, (size_t)p.npages * ns[p.ns].page_size,
                                   &res)) < 0)
            break;
        for (uint32_t d = 0; d < p.npages; d++) {
            kvt_tier_nvme_block_t *r = p.blocks[d];
            kvt_block_t *b = kvt_radix_block_at(res.node, d);
            if (!r) /* a gap's page in front of a window: index-only */
                continue;
            if (r->indexed || !b || kvt_radix_block_hash(tree, res.node, d) != r->hash ||
                b->tier != KVT_TIER_NONE)
                continue;
            kvt__block_recovered(b, KVT_TIER_NVME, r->loc, r->len);
            r->indexed = 1;
        }
        /* A window after a gap's index-only pages begins a node of its own, as a GAPS PUT made
         * it (op_put.c, put_gap): a node's tiers never get faster with depth. A split refused
         * (no memory) leaves the window to the policy's adoption, which frees what it cannot
         * account (adopt_recovered logs how many). */
        for (uint32_t d = 1; d < p.npages; d++) {
            kvt_radix_node_t *x = !p.blocks[d - 1] && p.blocks[d] && p.blocks[d]->indexed
                                      ? kvt_radix_node_holding(res.node, d)
                                      : NULL;
            if (x && d != kvt_radix_node_depth(x))
                (void)kvt_radix_split_at(tree, x, d);
        }
    }
out:
    kvt_tier_nvme_recover_end(nvme, rc < 0, out);
    free(open);
    free(ids);
    return rc < 0 ? rc : 0;
}

static void recovered_sizes(kvt_srv_t *s)
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

/*
 * Quotas per tenant: the namespace (model, adapter, salt, page size), the unit the daemon already
 * isolates (its own radix root, its own DRAM arena, its own memfd). Each tier counts what every
 * namespace holds there and refuses a write, copy or adoption past the namespace's quota as if
 * the tier were full (tiers/tier.c), which every path into a tier goes through: PUT and RESERVE
 * (op_put.c), promotions and demotions (the policy's moves, exec.c). Those paths also ask before
 * making room for a write the quota would refuse (kvt_tier_ns_fits), so that a tenant at its
 * quota never has another's blocks demoted or dropped on its behalf. Recovered NVMe blocks are
 * adopted before the quotas are set: what is on disk comes back whatever it holds.
 */
void kvt__store_quotas(kvt_srv_t *s)
{
    for (int i = 1; i < KVT_TIER_COUNT; i++)
        if (s->tiers[i])
            (void)kvt_tier_set_ns_quota(s->tiers[i], s->conf->tenant_bytes[i]);
}

int kvt__store_open(kvt_srv_t *s)
{
    kvt_srv_conf_t *c = s->conf;
    int rc;
    if (c->hbm_bytes) {
        kvt_tier_hbm_conf_t hc = {.backend = c->hbm_backend,
                                  .capacity_bytes = c->hbm_bytes,
                                  .device = c->hbm_device,
                                  .batch = c->hbm_batch,
                                  .devices = c->hbm_devs,
                                  .ndevices = c->hbm_ndevs};
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
        kvt_tier_dram_conf_t dc = {
            .capacity_bytes = c->dram_bytes,
            .max_shared = c->zero_copy ? c->zero_copy_arenas : 0,
        };
        if ((rc = kvt_tier_dram_create(&s->tiers[KVT_TIER_DRAM], &dc)) < 0) {
            kvt_log(KVT_LOG_ERROR, "kvtierd: DRAM tier of %llu bytes: %s",
                    (unsigned long long)c->dram_bytes, kvt_strerror(rc));
            return rc;
        }
    }
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
            /* The tier names what it found wrong on disk; the settings can only be short. */
            uint64_t segb = c->nvme_segment_bytes ? c->nvme_segment_bytes : 64u << 20;
            kvt_log(KVT_LOG_ERROR, "kvtierd: NVMe tier in %s: %s%s", c->data_dir, kvt_strerror(rc),
                    rc == KVT_EINVAL && c->nvme_bytes / segb < 2
                        ? " (nvme-bytes must hold at least 2 segments of "
                          "nvme-segment-bytes, 64M by default)"
                        : "");
            return rc;
        }
        if (c->nvme_recover) {
            kvt_tier_nvme_recovery_t rec;
            rc = kvt_store_nvme_recover(s->radix, s->tiers[KVT_TIER_NVME], &rec);
            if (rc < 0) {
                kvt_log(KVT_LOG_ERROR, "kvtierd: NVMe recovery: %s", kvt_strerror(rc));
                return rc;
            }
            recovered_sizes(s);
            kvt_metrics_t *m = s->metrics;
            kvt__metric_set(m, KVT_M_NVME_RECOVERY, KVT_RECOVERY_INSERTED, (double)rec.inserted);
            kvt__metric_set(m, KVT_M_NVME_RECOVERY, KVT_RECOVERY_TORN, (double)rec.torn);
            kvt__metric_set(m, KVT_M_NVME_RECOVERY, KVT_RECOVERY_STALE, (double)rec.stale);
            kvt__metric_set(m, KVT_M_NVME_RECOVERY, KVT_RECOVERY_ORPHAN, (double)rec.orphans);
            kvt__metric_set(m, KVT_M_NVME_RECOVERY, KVT_RECOVERY_DISCARDED, (double)rec.discarded);
            kvt__metric_set(m, KVT_M_NVME_RECOVERY_GAPS, 0, (double)rec.gaps);
            kvt_log(KVT_LOG_INFO,
                    "kvtierd: NVMe recovery: %llu blocks back in the index (%llu scanned, %llu "
                    "torn, %llu stale, %llu gaps, %llu orphans, %llu removed)",
                    (unsigned long long)rec.inserted, (unsigned long long)rec.scanned,
                    (unsigned long long)rec.torn, (unsigned long long)rec.stale,
                    (unsigned long long)rec.gaps, (unsigned long long)rec.orphans,
                    (unsigned long long)rec.discarded);
        } else {
            /* Left in the tier, they would hold its capacity with nothing naming them. */
            long dropped = kvt_tier_nvme_drop_recovered(s->tiers[KVT_TIER_NVME]);
            if (dropped > 0)
                kvt_log(KVT_LOG_INFO,
                        "kvtierd: nvme-recover is off: the %ld blocks found in %s were dropped",
                        dropped, c->data_dir);
        }
    }
    if (*c->remote) {
        char host[256];
        uint16_t port = 0;
        if (!c->remote_cluster &&
            kvt_tier_remote_parse_addr(c->remote, host, sizeof host, &port) < 0) {
            kvt_log(KVT_LOG_ERROR, "kvtierd: bad remote address '%s'", c->remote);
            return KVT_EINVAL;
        }
        kvt_tier_remote_conf_t rcf = {.host = c->remote_cluster ? NULL : host,
                                      .cluster = c->remote_cluster,
                                      .seeds = c->remote_cluster ? c->remote : NULL,
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
    kvt__store_quotas(s);
    int any = 0;
    for (int i = 1; i < KVT_TIER_COUNT; i++) {
        if (!s->tiers[i])
            continue;
        kvt_tier_usage_t u;
        kvt_tier_usage(s->tiers[i], &u);
        kvt_log(KVT_LOG_INFO, "kvtierd: %s tier: %llu bytes (%s)", kvt_tier_name((kvt_tier_id_t)i),
                (unsigned long long)u.capacity_bytes, kvt_tier_backend(s->tiers[i]));
        any = 1;
    }
    if (!any) {
        /* Every tier disabled: an index-only sidecar. PUT payloads are kept as index-only pages
         * (counted as skipped); there is nothing for a policy to place. */
        kvt_log(KVT_LOG_INFO, "kvtierd: no tier configured: the index only, no KV bytes kept");
        return 0;
    }
    return policy_open(s);
}

void kvt__store_close(kvt_srv_t *s)
{
    for (int i = 0; i < KVT_TIER_COUNT; i++) {
        kvt_tier_destroy(s->tiers[i]);
        s->tiers[i] = NULL;
    }
    kvt__exec_close(s);
    kvt_policy_destroy(s->policy);
    s->policy = NULL;
}

/* The remote tier's rows per node (the single server, or each cluster node it knows), for
 * /metrics: at most KVT_REMOTE_NODE_ROWS (metrics.h). */
static void remote_nodes(kvt_srv_t *s)
{
    kvt_tier_remote_node_stats_t rows[KVT_REMOTE_NODE_ROWS]; /* a few KiB */
    const kvt_tier_t *remote = s->tiers[KVT_TIER_REMOTE];
    size_t n = 0;
    int total = remote ? kvt_tier_remote_node_stats(remote, 0, &rows[0]) : 0;
    for (int i = 0; i < total && n < KVT_REMOTE_NODE_ROWS; i++)
        if (kvt_tier_remote_node_stats(remote, (uint32_t)i, &rows[n]) > i)
            n++;
    kvt__metrics_remote_nodes(s->metrics, rows, n);
}

void kvt__tier_metrics(kvt_srv_t *s)
{
    kvt_metric_tenant_t rows[KVT_TENANT_ROWS];
    size_t nrows = 0;
    for (int i = 1; i < KVT_TIER_COUNT; i++) {
        if (!s->tiers[i])
            continue;
        kvt_tier_usage_t u;
        kvt_tier_usage(s->tiers[i], &u);
        kvt__metric_set(s->metrics, KVT_M_TIER_USED, (unsigned)i, (double)u.used_bytes);
        kvt__metric_set(s->metrics, KVT_M_TIER_CAPACITY, (unsigned)i, (double)u.capacity_bytes);
        kvt__metric_set(s->metrics, KVT_M_TIER_BLOCKS, (unsigned)i, (double)u.blocks);
        kvt__metric_set(s->metrics, KVT_M_TIER_LOST, (unsigned)i, (double)u.reclaimed);
        kvt__metric_set(s->metrics, KVT_M_TENANT_QUOTA, (unsigned)i,
                        (double)s->conf->tenant_bytes[i]);
        kvt__metric_set(s->metrics, KVT_M_TENANT_REFUSALS, (unsigned)i, (double)u.quota_refused);
        kvt_tier_ns_usage_t top[KVT_TENANT_TOP];
        size_t n = kvt_tier_ns_top(s->tiers[i], top, KVT_TENANT_TOP);
        for (size_t k = 0; k < n; k++)
            rows[nrows++] = (kvt_metric_tenant_t){
                .ns_seed = top[k].ns_seed, .bytes = top[k].bytes, .tier = (uint8_t)i};
    }
    kvt__metrics_tenants(s->metrics, rows, nrows);
    kvt_tier_usage_t nu = {0};
    kvt_tier_usage(s->tiers[KVT_TIER_NVME], &nu);
    kvt__metric_set(s->metrics, KVT_M_NVME_BOUNCED, 0, (double)nu.bounced_bytes);
    kvt__metric_set(s->metrics, KVT_M_DRAM_MAPPED, 0,
                    (double)kvt_tier_dram_mapped(s->tiers[KVT_TIER_DRAM]));
    kvt_tier_dram_shared_stats_t ds;
    if (s->tiers[KVT_TIER_DRAM] && kvt_tier_dram_shared_stats(s->tiers[KVT_TIER_DRAM], &ds) == 0) {
        /* Read here, not kept up to date by MAP and close: an arena also goes with its last
         * block, and a scrape must see the memfds that exist. */
        kvt__metric_set(s->metrics, KVT_M_ZC_ARENAS, 0, (double)ds.arenas);
        kvt__metric_set(s->metrics, KVT_M_ZC_RESIDENT, 0, (double)ds.resident_bytes);
        kvt__metric_set(s->metrics, KVT_M_ZC_PUNCHED, 0, (double)ds.punched_bytes);
        kvt__metric_set(s->metrics, KVT_M_DRAM_TRIMS, 0, (double)ds.trims);
        kvt__metric_set(s->metrics, KVT_M_DRAM_TRIMMED, 0, (double)ds.trimmed_bytes);
        kvt__metric_set(s->metrics, KVT_M_DRAM_KEPT, 0, (double)ds.kept_bytes);
        kvt__metric_set(s->metrics, KVT_M_ZC_SCRIBBLES, 0, (double)ds.scribbles);
        kvt__metric_set(s->metrics, KVT_M_ZC_SEALS, 0, (double)ds.sealed);
        kvt__metric_set(s->metrics, KVT_M_ZC_CLIENT_SUMS, 0, (double)ds.sealed_as);
    }
    kvt_tier_hbm_stats_t hs;
    if (s->tiers[KVT_TIER_HBM] && kvt_tier_hbm_stats(s->tiers[KVT_TIER_HBM], &hs) == 0) {
        kvt__metric_set(s->metrics, KVT_M_HBM_BATCHES, 0, (double)hs.batches);
        kvt__metric_set(s->metrics, KVT_M_HBM_COPIES, 0, (double)hs.copies);
        kvt_tier_hbm_pool_t pools[KVT_HBM_MAX_DEVICES];
        int np = kvt_tier_hbm_pools(s->tiers[KVT_TIER_HBM], pools, KVT_HBM_MAX_DEVICES);
        unsigned mask = 0;
        for (int i = 0; i < np; i++) {
            unsigned d = (unsigned)pools[i].device;
            if (d >= 16)
                continue; /* no series: device numbers past 15 are shown by STATS only as sums */
            mask |= 1u << d;
            kvt__metric_set(s->metrics, KVT_M_HBM_POOL_USED, d, (double)pools[i].used_bytes);
            kvt__metric_set(s->metrics, KVT_M_HBM_POOL_CAPACITY, d,
                            (double)pools[i].capacity_bytes);
            kvt__metric_set(s->metrics, KVT_M_HBM_POOL_BLOCKS, d, (double)pools[i].blocks);
        }
        kvt__metrics_devices(s->metrics, mask);
    }
    kvt_radix_stats_t rs;
    kvt_radix_stats(s->radix, &rs);
    kvt__metric_set(s->metrics, KVT_M_INDEX_BLOCKS, 0, (double)rs.blocks);
    kvt__metric_set(s->metrics, KVT_M_INDEX_BYTES, 0, (double)rs.bytes);
    kvt__metric_set(s->metrics, KVT_M_INDEX_CAPACITY, 0, (double)s->conf->index_bytes);
    kvt__metric_set(s->metrics, KVT_M_INDEX_PREFAULTED, 0, (double)rs.arena_bytes);
    kvt__metric_set(s->metrics, KVT_M_INDEX_NODES, 0, (double)rs.nodes);
    kvt__metric_set(s->metrics, KVT_M_INDEX_CACHED_TOKENS, 0, (double)rs.cached_tokens);
    kvt__metric_set(s->metrics, KVT_M_UPTIME, 0, (double)(kvt_now_ns() - s->started_ns) / 1e9);
    kvt__metric_set(s->metrics, KVT_M_LOG_SUPPRESSED, 0, (double)kvt_log_suppressed());
    kvt__mrc_metrics(s);
    if (s->tiers[KVT_TIER_REMOTE]) {
        kvt_tier_remote_stats_t st;
        kvt_tier_remote_stats(s->tiers[KVT_TIER_REMOTE], &st);
        kvt__metric_set(s->metrics, KVT_M_REMOTE_CONNECTS, 0, (double)st.connects);
        kvt__metric_set(s->metrics, KVT_M_REMOTE_DISCONNECTS, 0, (double)st.disconnects);
        kvt__metric_set(s->metrics, KVT_M_REMOTE_TIMEOUTS, 0, (double)st.timeouts);
        kvt__metric_set(s->metrics, KVT_M_REMOTE_OVERSIZED, 0, (double)st.oversized);
        kvt__metric_set(s->metrics, KVT_M_REMOTE_UP, 0,
                        kvt_tier_remote_connected(s->tiers[KVT_TIER_REMOTE]));
        kvt__metric_set(s->metrics, KVT_M_REMOTE_MOVED, 0, (double)st.moved);
        kvt__metric_set(s->metrics, KVT_M_REMOTE_ASKS, 0, (double)st.asks);
        kvt__metric_set(s->metrics, KVT_M_REMOTE_REDIRECT_ERRORS, 0, (double)st.redirect_errors);
        kvt__metric_set(s->metrics, KVT_M_REMOTE_MAP_REFRESHES, 0, (double)st.map_refreshes);
        kvt__metric_set(s->metrics, KVT_M_REMOTE_MAP_ERRORS, 0, (double)st.map_errors);
        kvt__metric_set(s->metrics, KVT_M_REMOTE_FAILOVERS, 0, (double)st.failovers);
        kvt__metric_set(s->metrics, KVT_M_REMOTE_NODES, 0, (double)st.nodes);
        kvt__metric_set(s->metrics, KVT_M_REMOTE_LATE_KEPT, 0, (double)st.undo_kept);
    }
    remote_nodes(s);
    if (s->policy) {
        kvt_policy_stats_t ps;
        kvt_policy_stats(s->policy, &ps);
        kvt__metric_set(s->metrics, KVT_M_PIN_REFUSALS, 0, (double)ps.pin_refusals);
        kvt__metric_set(s->metrics, KVT_M_POLICY_REBUILDS, 0, (double)ps.rebuilds);
        kvt__metric_set(s->metrics, KVT_M_POLICY_SWEEPS, 0, (double)ps.sweeps);
        kvt__metric_set(s->metrics, KVT_M_POLICY_PARKED, 0, (double)ps.parked);
        kvt__metric_set(s->metrics, KVT_M_POLICY_PARK_WAITS, 0, (double)ps.park_waits);
        kvt__metric_set(s->metrics, KVT_M_POLICY_ROOM_WAITS, 0, (double)ps.room_waits);
        kvt__metric_set(s->metrics, KVT_M_POLICY_ROOM_GAVEUPS, 0, (double)ps.room_gaveups);
        /* 1 + KVT_POLICY_EXPERT_*, so that 0 can say "no experts" (ps.expert is 0 then too). */
        kvt_policy_kind_t kind;
        int cost = kvt_policy_kind_parse(s->conf->policy, &kind) == 0 && kind == KVT_POLICY_COST;
        kvt__metric_set(s->metrics, KVT_M_POLICY_EXPERT, 0, cost ? 1.0 + ps.expert : 0);
        kvt__metric_set(s->metrics, KVT_M_POLICY_INDEX_DROPS, 0,
                        (double)ps.pages_dropped_for_index);
    }
    kvt__metric_set(s->metrics, KVT_M_LEASES, 0, (double)kvt__lease_count(s));
    kvt__metric_set(s->metrics, KVT_M_NAMESPACES, 0, (double)rs.namespaces);
    kvt__metric_set(s->metrics, KVT_M_CLIENT_BYTES, 0, (double)s->clients.bytes);
}
