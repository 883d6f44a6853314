/*
 * index.c: the index budget (index-bytes). Before an insert or a lease the index must have room;
 * when it does not, index-only pages are evicted, least recently used first (through the policy
 * when there is one); the maintenance step keeps it between its low and high marks; and at
 * max-namespaces the namespace whose loss costs least is evicted for a new one. It is also the
 * door's way into the tree for the operation files (store.h): the path cursor (seek, walk, pin),
 * the namespaces' page size, seed and close, and the lease slots.
 */
#include "server.h"

/* The index is trimmed from above 98% of index-bytes down to 95%, at most KVT_TRIM_PAGES pages
 * per loop iteration; a request that finds it full trims up to KVT_TRIM_INLINE pages itself. */
#define KVT_INDEX_HIGH_PCT 98
#define KVT_INDEX_LOW_PCT  95
#define KVT_TRIM_PAGES     4096
#define KVT_TRIM_INLINE    65536

static uint64_t index_used_bytes(const kvt_srv_t *s)
{
    kvt_radix_stats_t rs;
    kvt_radix_stats(s->radix, &rs);
    return rs.bytes;
}

static int trim_evict(void *arg, kvt_radix_node_t *n, uint32_t npages)
{
    kvt_srv_t *s = arg;
    int rc = kvt_radix_evict(s->radix, n, npages);
    return rc < 0 ? rc : (int)npages;
}

uint32_t kvt__index_trim(kvt_srv_t *s, uint64_t target, uint32_t budget)
{
    if (s->policy) {
        uint32_t n = kvt_policy_trim_index(s->policy, target, budget);
        if (n >= budget || index_used_bytes(s) <= target)
            return n;
        /* Index-only pages were not enough: pages with bytes go too, oldest first, rather than
         * every new page being refused for good (index-bytes too small for what the tiers hold,
         * or lowered across a warm restart). */
        uint32_t d = kvt_policy_trim_index_bytes(s->policy, target, budget - n);
        if (d > 0) {
            static kvt_log_limit_t lim;
            kvt_log_limited(&lim, KVT_LOG_WARN,
                            "kvtierd: index-bytes (%llu) is full of pages that hold bytes: "
                            "dropped the %u least recently used; the tiers hold more than the "
                            "index may (raise index-bytes to keep them)",
                            (unsigned long long)s->conf->index_bytes, d);
        }
        return n + d;
    }
    /* No tier, so no policy: every page is index-only and nothing else tracks the nodes. */
    return kvt_radix_trim(s->radix, target, budget, kvt_radix_index_only, trim_evict, s);
}

int kvt__index_fits(const kvt_srv_t *s, uint64_t need)
{
    uint64_t cap = s->conf->index_bytes;
    return !cap || !need || (need <= cap && index_used_bytes(s) <= cap - need);
}

int kvt__index_fit(kvt_srv_t *s, uint64_t need)
{
    uint64_t cap = s->conf->index_bytes;
    if (kvt__index_fits(s, need))
        return 0;
    if (need > cap)
        return KVT_ENOSPC;
    kvt__index_trim(s, KVT_MIN(cap / 100 * KVT_INDEX_LOW_PCT, cap - need), KVT_TRIM_INLINE);
    return kvt__index_fits(s, need) ? 0 : KVT_ENOSPC;
}

int kvt__index_room(kvt_srv_t *s, uint32_t ns, const uint32_t *tokens, size_t ntokens, int pin,
                    kvt_match_t *at)
{
    if (at)
        at->ns = UINT32_MAX; /* no walk yet */
    if (!s->conf->index_bytes)
        return 0;
    /* Admitted only when the insert's worst case fits: the index never passes index-bytes. The
     * tree-wide bound first (no walk); near the cap, what this insert can add to the tree as it
     * is (a walk), which does not reserve room for the largest child table's growth when this
     * insert cannot grow it. A pin is a lease, which may grow the lease table. */
    uint64_t lease = pin ? kvt_radix_lease_need(s->radix) : 0;
    if (kvt__index_fits(s, kvt_radix_insert_bound(s->radix, ns, ntokens) + lease))
        return 0;
    uint64_t need = kvt_radix_insert_need(s->radix, ns, tokens, ntokens, at) + lease;
    if (kvt__index_fits(s, need))
        return 0;
    if (kvt__index_fit(s, need) < 0) /* trims */
        return KVT_ENOSPC;
    /* The trim changed the tree, and with it what the insert adds. */
    need = kvt_radix_insert_need(s->radix, ns, tokens, ntokens, at) + lease;
    return kvt__index_fits(s, need) ? 0 : KVT_ENOSPC;
}

/*
 * A client that makes up a namespace per request (a salt each time) and leaves one page in each
 * fills max-namespaces with namespaces that are neither empty nor used, which kvt__ns_reclaim
 * cannot close and index-bytes never evicts (their pages are few): every new tenant would then be
 * refused for good, long after that client left. So a new namespace frees one as index-bytes
 * pressure frees pages: the namespace whose pages are worth least goes, here the one holding the
 * fewest (freeing a namespace costs all of its pages), then the one unused longest. A namespace a
 * connection has declared, a request names or a connection's lease holds is never chosen. The
 * KVT_NS_EVICT_TRIES cheapest are tried: one fails only while the policy is moving a block of it.
 */
#define KVT_NS_EVICT_TRIES 16

typedef struct kvt_ns_victim {
    uint64_t blocks, idle_ns;
    uint32_t id;
} kvt_ns_victim_t;

static int ns_victim_before(const kvt_ns_victim_t *a, const kvt_ns_victim_t *b)
{
    return a->blocks != b->blocks ? a->blocks < b->blocks : a->idle_ns < b->idle_ns;
}

int kvt__ns_evict(kvt_srv_t *s)
{
    kvt_ns_victim_t best[KVT_NS_EVICT_TRIES];
    uint32_t n = 0;
    /* One pass over the ids keeps the cheapest few, in order (an insertion into a short list). */
    for (uint32_t id = 0; id < KVT_RADIX_NS_MAX; id++) {
        if (!kvt_radix_ns_page_size(s->radix, id))
            continue;
        kvt_ns_victim_t v = {.blocks = kvt_radix_ns_blocks(s->radix, id), .id = id};
        if (id < s->nns) {
            if (s->ns[id].users || s->ns[id].leases)
                continue;
            v.idle_ns = s->ns[id].idle_ns;
        }
        if (n == KVT_NS_EVICT_TRIES && !ns_victim_before(&v, &best[n - 1]))
            continue;
        uint32_t i = n < KVT_NS_EVICT_TRIES ? n++ : n - 1;
        for (; i > 0 && ns_victim_before(&v, &best[i - 1]); i--)
            best[i] = best[i - 1];
        best[i] = v;
    }
    for (uint32_t i = 0; i < n; i++) {
        uint32_t id = best[i].id;
        if (kvt_radix_ns_clear(s->radix, id) < 0) /* KVT_EBUSY: a move holds a block of it */
            continue;
        kvt_policy_forget_ns(s->policy, id);
        if (kvt_radix_ns_close(s->radix, id) < 0)
            continue; /* cannot be: it is empty now */
        if (id < s->nns)
            s->ns[id] = (kvt__ns_t){0};
        kvt__metric_add(s->metrics, KVT_M_NAMESPACES_EVICTED, 0, 1);
        static kvt_log_limit_t lim; /* a HELLO flood of new namespaces would repeat it */
        kvt_log_limited(&lim, KVT_LOG_INFO,
                        "kvtierd: max-namespaces (%u) are open and none is empty: evicted the %llu "
                        "pages of an unused one for a new one",
                        s->conf->max_namespaces, (unsigned long long)best[i].blocks);
        return 1;
    }
    return 0;
}

void kvt__index_step(kvt_srv_t *s)
{
    uint64_t cap = s->conf->index_bytes;
    if (cap && !s->stopping && index_used_bytes(s) > cap / 100 * KVT_INDEX_HIGH_PCT)
        kvt__index_trim(s, cap / 100 * KVT_INDEX_LOW_PCT, KVT_TRIM_PAGES);
}

/* ---- the door: the path cursor, namespaces and leases (store.h) ---- */

int kvt__path_seek(kvt_srv_t *s, kvt__path_t *p, uint32_t ns, const uint32_t *tokens, size_t n,
                   unsigned flags)
{
    p->run.node = NULL;
    return kvt_radix_match(s->radix, ns, tokens, n, flags, &p->m);
}

void kvt__path_touch(kvt_srv_t *s, const kvt_match_t *m)
{
    kvt_radix_touch(s->radix, m);
}

void kvt__path_walk(kvt__path_t *p, const kvt_match_t *m)
{
    if (m != &p->m)
        p->m = *m;
    p->run = kvt_path_run_first(p->m.pages ? p->m.node : NULL, p->m.node_pages);
}

void kvt__path_step(kvt__path_t *p)
{
    kvt_path_run_next(&p->run);
}

uint64_t kvt__path_tail(kvt_srv_t *s, const kvt_match_t *m)
{
    return m->pages ? kvt_radix_block_hash(s->radix, m->node, m->pages - 1)
                    : kvt_radix_ns_seed(s->radix, m->ns);
}

int kvt__path_keys(kvt_srv_t *s, uint32_t ns, uint64_t parent, const uint32_t *tokens, size_t n,
                   uint64_t *out)
{
    return kvt_radix_hash_chain(s->radix, ns, parent, tokens, n, out);
}

kvt_block_t *kvt__path_block(kvt_radix_node_t *node, uint32_t depth)
{
    return kvt_radix_block_at(node, depth);
}

kvt_radix_node_t *kvt__path_holder(kvt_radix_node_t *node, uint32_t depth)
{
    return kvt_radix_node_holding(node, depth);
}

int kvt__path_split(kvt_srv_t *s, kvt_radix_node_t *node, uint32_t depth)
{
    /* The index never passes index-bytes: without room the split is refused, nothing trimmed
     * here (it runs when a PUT's writes land; the maintenance step keeps room below the cap). */
    if (!kvt__index_fits(s, kvt_radix_split_need(s->radix, node, depth)))
        return KVT_ENOSPC;
    int rc = kvt_radix_split_at(s->radix, node, depth);
    if (rc == 0) /* the new head node's cached pages are victims as they were before the split */
        kvt_policy_on_split(s->policy, kvt_radix_node_parent(kvt_radix_node_holding(node, depth)));
    return rc;
}

uint32_t kvt__node_depth(const kvt_radix_node_t *node)
{
    return kvt_radix_node_depth(node);
}

int kvt__path_pin(kvt_srv_t *s, const kvt_match_t *m, uint64_t owner, uint64_t *lease)
{
    if (!kvt__index_fits(s, kvt_radix_lease_need(s->radix)))
        return KVT_ENOSPC;
    return kvt_radix_lease(s->radix, m, owner, lease);
}

void kvt__path_unpin(kvt_srv_t *s, uint64_t lease)
{
    kvt_radix_release(s->radix, lease);
}

uint64_t kvt__pin_need(const kvt_srv_t *s)
{
    return kvt_radix_lease_need(s->radix);
}

uint32_t kvt__lease_count(const kvt_srv_t *s)
{
    /* A GET's pin goes once its reply is out, which another loop's STATS may follow before
     * the GET's loop has the lock back to let it go: shown gone from the reply's last batch. */
    return (uint32_t)kvt_radix_lease_count(s->radix) - s->pins_ending;
}

uint32_t kvt__ns_page_size(const kvt_srv_t *s, uint32_t ns)
{
    return kvt_radix_ns_page_size(s->radix, ns);
}

uint64_t kvt__ns_seed(const kvt_srv_t *s, uint32_t ns)
{
    return kvt_radix_ns_seed(s->radix, ns);
}

int kvt__ns_close(kvt_srv_t *s, uint32_t ns)
{
    return kvt_radix_ns_close(s->radix, ns);
}

int kvt__path_insert(kvt_srv_t *s, uint32_t ns, const kvt_match_t *m, const uint32_t *tokens,
                     size_t n, kvt_insert_t *res)
{
    res->split = NULL; /* a refused insert leaves res as it was */
    int rc = m ? kvt_radix_insert_matched(s->radix, m, tokens, n, res)
               : kvt_radix_insert(s->radix, ns, tokens, n, res);
    /* The pages a split moved to a new node stay victims (the new pages join the policy when
     * their writes land, kvt_policy_adopt; a split's node has none but the old node's). */
    kvt_policy_on_split(s->policy, res->split);
    return rc;
}

int kvt__ns_open(kvt_srv_t *s, const char *model, const char *adapter, const char *salt,
                 uint32_t page_size, uint32_t *ns)
{
    return kvt_radix_ns_open(s->radix, model, adapter, salt, page_size, ns);
}

uint64_t kvt__ns_need(const kvt_srv_t *s, const char *model, const char *adapter, const char *salt,
                      uint32_t page_size)
{
    return kvt_radix_ns_need(s->radix, model, adapter, salt, page_size);
}

void kvt__path_warm_plan(const kvt_srv_t *s, uint32_t ns, const kvt_token_run_t *runs, size_t n,
                         kvt_warm_plan_t *plan)
{
    kvt_radix_warm_plan(s->radix, ns, runs, n, plan);
}

void kvt__path_warm_run(const kvt_warm_plan_t *plan, size_t i)
{
    kvt_radix_warm_run(plan, i);
}
