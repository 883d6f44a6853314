/*
 * keys.c: block keys in libkvtier, a client-side mapping onto the token protocol. A key hashes
 * (XXH3-128) to KVT_KEY_TOKENS synthetic token ids; a chain of keys is their tokens in order, one
 * page per key, in a namespace made keyed by a tag before its adapter name. Everything below is
 * plain MATCH/PUT/GET/RELEASE/REMOVE on that namespace, so keyed pages share the daemon's tiers,
 * policy, capacity and metrics with token pages, and a chain gets the radix tree's prefix
 * sharing and leaf-first eviction. The daemon knows nothing of keys (docs/protocol.md, "Keyed
 * blocks"); it uses only kvtier.h's public API.
 *
 *   chain  k0 k1 k2    tokens  [h(k0)0..3][h(k1)0..3][h(k2)0..3]   3 pages, k2 under k0 k1
 *   independent k2     tokens  [h(k2)0..3]                         1 page at the root
 *
 * A client with the zero-copy mapping reads its hits by location: the MATCH that leases them
 * (LOCATE) says where they lie, and only pages it did not locate need a GET (issue 38: one round
 * trip where a GET per key was). It writes independent keys' blocks in place, the RESERVEs of 32
 * keys at a time pipelined, then their COMMITs (each.h; issue 35: two round trips where a PUT per
 * key took two each).
 */
#include "kvtier.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <xxhash.h>

#include "each.h"

/* Independent keys go out in batches of at most this many requests: a get holds one lease per
 * key until its GET, and the daemon grants a connection max-leases (4,096 by default). */
#define KVT_KEYS_CHUNK 256u

struct kvt_keys {
    kvt_client_t *c;
    uint32_t block_bytes;
    int local_err; /* the last error was found here, not answered by the daemon */
    char errmsg[160];
};

int kvt_key_tokens(const void *key, size_t len, uint32_t out[KVT_KEY_TOKENS])
{
    if (!key || len == 0 || len > KVT_KEY_MAX || !out)
        return KVT_CLIENT_EINVAL;
    XXH128_hash_t h = XXH3_128bits(key, len);
    out[0] = (uint32_t)(h.high64 >> 32);
    out[1] = (uint32_t)h.high64;
    out[2] = (uint32_t)(h.low64 >> 32);
    out[3] = (uint32_t)h.low64;
    return 0;
}

__attribute__((format(printf, 3, 4))) static int keys_fail(kvt_keys_t *k, int rc, const char *fmt,
                                                           ...)
{
    va_list ap;
    va_start(ap, fmt);
    k->local_err = 1;
    vsnprintf(k->errmsg, sizeof k->errmsg, fmt, ap);
    va_end(ap);
    return rc;
}

/* kvt_client_step_t's clock (CLOCK_MONOTONIC), for its valid_until_ns. */
static uint64_t keys_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* The tokens of keys[0, n) in order, into a fresh array (the caller frees it). */
static int keys_chain_tokens(kvt_keys_t *k, const kvt_key_t *keys, uint32_t n, uint32_t **out)
{
    k->local_err = 0;
    if (!keys || n == 0 || n > UINT32_MAX / KVT_KEY_TOKENS)
        return keys_fail(k, KVT_CLIENT_EINVAL, "no keys (%u), or too many", n);
    uint32_t *t = malloc((size_t)n * KVT_KEY_TOKENS * sizeof *t);
    if (!t)
        return KVT_CLIENT_ENOMEM;
    for (uint32_t i = 0; i < n; i++) {
        if (kvt_key_tokens(keys[i].data, keys[i].len, t + (size_t)i * KVT_KEY_TOKENS) < 0) {
            free(t);
            return keys_fail(k, KVT_CLIENT_EINVAL,
                             "key %u is %zu bytes: a key is 1..%d (KVT_KEY_MAX) bytes", i,
                             keys[i].len, KVT_KEY_MAX);
        }
    }
    *out = t;
    return 0;
}

int kvt_keys_connect(kvt_keys_t **out, const kvt_client_conf_t *conf)
{
    if (!out || !conf)
        return KVT_CLIENT_EINVAL;
    char adapter[256];
    int len = conf->adapter && *conf->adapter
                  ? snprintf(adapter, sizeof adapter, "%s:%s", KVT_KEYS_TAG, conf->adapter)
                  : snprintf(adapter, sizeof adapter, "%s", KVT_KEYS_TAG);
    if (len < 0 || (size_t)len >= sizeof adapter)
        return KVT_CLIENT_EINVAL; /* the tag leaves 255 - 12 bytes for the adapter's name */
    kvt_keys_t *k = calloc(1, sizeof *k);
    if (!k)
        return KVT_CLIENT_ENOMEM;
    kvt_client_conf_t kc = *conf;
    kc.adapter = adapter;
    kc.page_size = KVT_KEY_TOKENS;
    int rc = kvt_client_connect(&k->c, &kc);
    if (rc < 0) {
        free(k);
        return rc;
    }
    k->block_bytes = conf->block_bytes;
    *out = k;
    return 0;
}

void kvt_keys_close(kvt_keys_t *k)
{
    if (!k)
        return;
    kvt_client_close(k->c);
    free(k);
}

kvt_client_t *kvt_keys_client(kvt_keys_t *k)
{
    return k ? k->c : NULL;
}

const char *kvt_keys_errmsg(const kvt_keys_t *k)
{
    if (!k)
        return "";
    return k->local_err ? k->errmsg : kvt_client_errmsg(k->c);
}

/* The leading pages of a MATCH that hold bytes: a page the index knows without bytes (stored
 * index only, or its bytes lost) is no block to an engine, and a prefix is no use past it. */
static uint32_t keys_with_bytes(const uint8_t *tiers, uint32_t pages)
{
    uint32_t i = 0;
    while (i < pages && tiers[i] != KVT_CLIENT_TIER_NONE)
        i++;
    return i;
}

/* An error that broke the connection (libkvtier: every later call is ECLOSED), as opposed to
 * one request's error reply. */
static int keys_transport(int rc)
{
    return (rc < 0 && rc > -30000) || rc == KVT_CLIENT_ECLOSED || rc == KVT_CLIENT_ETIMEDOUT ||
           rc == KVT_CLIENT_EPROTO;
}

/* -- chains ------------------------------------------------------------------------------- */

/* A chain's lookup; with kept, a MATCH with KEEP whose handle goes there. */
static int keys_chain_exists(kvt_keys_t *k, const kvt_key_t *keys, uint32_t n, uint32_t *hits,
                             kvt_keys_kept_t *kept)
{
    if (!k || !hits)
        return KVT_CLIENT_EINVAL;
    *hits = 0;
    if (kept)
        *kept = (kvt_keys_kept_t){0};
    if (n == 0)
        return 0;
    uint32_t *t = NULL;
    int rc = keys_chain_tokens(k, keys, n, &t);
    if (rc < 0)
        return rc;
    uint8_t *tiers = malloc(n);
    if (!tiers) {
        free(t);
        return KVT_CLIENT_ENOMEM;
    }
    kvt_client_match_t m = {.tiers = tiers, .tiers_cap = n};
    kvt_client_step_t st = {0};
    rc = kvt_client_match_step(k->c, t, n * KVT_KEY_TOKENS, kept ? KVT_CLIENT_KEEP : 0, 0, NULL, &m,
                               kept ? &st : NULL);
    free(t);
    if (rc == 0)
        *hits = keys_with_bytes(tiers, m.pages);
    if (rc == 0 && kept && st.handle)
        *kept = (kvt_keys_kept_t){.handle = st.handle, .keys = n};
    free(tiers);
    return rc;
}

int kvt_keys_chain_exists(kvt_keys_t *k, const kvt_key_t *keys, uint32_t n, uint32_t *hits)
{
    return keys_chain_exists(k, keys, n, hits, NULL);
}

int kvt_keys_chain_exists_kept(kvt_keys_t *k, const kvt_key_t *keys, uint32_t n, uint32_t *hits,
                               kvt_keys_kept_t *kept)
{
    if (!kept)
        return KVT_CLIENT_EINVAL;
    return keys_chain_exists(k, keys, n, hits, kept);
}

/* A chain's PUT of payload (one buffer) or blocks (one per page), after a kept chain (after:
 * NULL or its handle 0 for none). */
static int keys_chain_put(kvt_keys_t *k, const kvt_keys_kept_t *after, const kvt_key_t *keys,
                          uint32_t n, uint32_t first, uint32_t npages, const void *payload,
                          const void *const *blocks, kvt_client_put_t *res)
{
    if (!k)
        return KVT_CLIENT_EINVAL;
    uint32_t *t = NULL;
    int rc = keys_chain_tokens(k, keys, n, &t);
    if (rc < 0)
        return rc;
    if ((uint64_t)first + npages > n || (npages && !payload && !blocks)) {
        free(t);
        return keys_fail(k, KVT_CLIENT_EINVAL, "blocks [%u, +%u) beyond the chain's %u keys", first,
                         npages, n);
    }
    uint32_t handle = after ? after->handle : 0, kept = handle ? after->keys : 0;
    if (kept > n) {
        free(t);
        return keys_fail(k, KVT_CLIENT_EINVAL, "the lookup kept %u keys, more than the %u given",
                         kept, n);
    }
    kvt_client_put_t r = {0};
    /* One PUT for the chain rather than one per block: a PUT carries the whole prefix's tokens,
     * so a PUT per block would send the chain's tokens npages times. With a kept chain, only the
     * tokens past it (kvt_client_put_kept sends them all if the daemon no longer holds it). */
    rc = blocks ? kvt_client_putv_kept(k->c, handle, t, n * KVT_KEY_TOKENS, kept * KVT_KEY_TOKENS,
                                       first, npages, blocks, NULL, res ? res : &r)
                : kvt_client_put_kept(k->c, handle, t, n * KVT_KEY_TOKENS, kept * KVT_KEY_TOKENS,
                                      first, npages, payload, NULL, res ? res : &r);
    free(t);
    return rc;
}

int kvt_keys_chain_put(kvt_keys_t *k, const kvt_key_t *keys, uint32_t n, uint32_t first,
                       uint32_t npages, const void *payload, kvt_client_put_t *res)
{
    return keys_chain_put(k, NULL, keys, n, first, npages, payload, NULL, res);
}

int kvt_keys_chain_put_kept(kvt_keys_t *k, const kvt_keys_kept_t *after, const kvt_key_t *keys,
                            uint32_t n, uint32_t first, uint32_t npages, const void *payload,
                            kvt_client_put_t *res)
{
    return keys_chain_put(k, after, keys, n, first, npages, payload, NULL, res);
}

static int keys_chain_putv(kvt_keys_t *k, const kvt_keys_kept_t *after, const kvt_key_t *keys,
                           uint32_t n, uint32_t first, uint32_t npages, const void *const *blocks,
                           kvt_client_put_t *res)
{
    if (!k || (npages && !blocks))
        return KVT_CLIENT_EINVAL;
    if (npages && k->block_bytes == 0)
        return keys_fail(k, KVT_CLIENT_EINVAL,
                         "blocks (%u) on an index-only client (block_bytes 0)", npages);
    return keys_chain_put(k, after, keys, n, first, npages, NULL, npages ? blocks : NULL, res);
}

int kvt_keys_chain_putv(kvt_keys_t *k, const kvt_key_t *keys, uint32_t n, uint32_t first,
                        uint32_t npages, const void *const *blocks, kvt_client_put_t *res)
{
    return keys_chain_putv(k, NULL, keys, n, first, npages, blocks, res);
}

int kvt_keys_chain_putv_kept(kvt_keys_t *k, const kvt_keys_kept_t *after, const kvt_key_t *keys,
                             uint32_t n, uint32_t first, uint32_t npages, const void *const *blocks,
                             kvt_client_put_t *res)
{
    return keys_chain_putv(k, after, keys, n, first, npages, blocks, res);
}

/* A chain's read; with kept, its MATCH keeps the tokens it sends and the handle goes there. */
static int keys_chain_get(kvt_keys_t *k, const kvt_key_t *keys, uint32_t n, uint32_t first,
                          void *buf, size_t cap, uint32_t *got, kvt_keys_kept_t *kept)
{
    if (!k || !got || (cap && !buf))
        return KVT_CLIENT_EINVAL;
    *got = 0;
    if (kept)
        *kept = (kvt_keys_kept_t){0};
    if (k->block_bytes == 0)
        return keys_fail(k, KVT_CLIENT_EINVAL, "get on an index-only client (block_bytes 0)");
    if (n == 0)
        return 0;
    uint32_t *t = NULL;
    int rc = keys_chain_tokens(k, keys, n, &t);
    if (rc < 0)
        return rc;
    /* Only the pages up to the last one wanted: the lease pins no more than the GET reads. */
    uint64_t want = cap / k->block_bytes;
    uint64_t end = (uint64_t)first + want < n ? (uint64_t)first + want : n;
    if (first >= end) {
        free(t);
        return 0;
    }
    uint8_t *tiers = malloc(end);
    if (!tiers) {
        free(t);
        return KVT_CLIENT_ENOMEM;
    }
    /* Mapped: the MATCH also says where each page lies, and those are copied from there. */
    int mapped = kvt_client_zero_copy(k->c);
    kvt_client_loc_t *locs = mapped ? malloc(end * sizeof *locs) : NULL;
    if (mapped && !locs) {
        free(t);
        free(tiers);
        return KVT_CLIENT_ENOMEM;
    }
    kvt_client_match_t m = {.tiers = tiers, .tiers_cap = (uint32_t)end};
    kvt_client_step_t st = {.locs = locs, .locs_cap = (uint32_t)end};
    rc = kvt_client_match_step(k->c, t, (uint32_t)end * KVT_KEY_TOKENS,
                               KVT_CLIENT_LEASE | (mapped ? KVT_CLIENT_LOCATE : 0) |
                                   (kept ? KVT_CLIENT_KEEP : 0),
                               0, NULL, &m, mapped || kept ? &st : NULL);
    free(t);
    if (rc == 0 && kept && st.handle)
        *kept = (kvt_keys_kept_t){.handle = st.handle, .keys = (uint32_t)end};
    /* From first on: pages before it without bytes (a sliding window's gap: docs/protocol.md,
     * "Chains with gaps") do not stop a read that does not include them. */
    uint32_t have = rc == 0 && m.pages > first
                        ? first + keys_with_bytes(tiers + first, m.pages - first)
                        : 0,
             i = first;
    free(tiers);
    for (; rc == 0 && mapped && i < have && locs[i].host_ptr; i++)
        memcpy((uint8_t *)buf + (size_t)(i - first) * k->block_bytes, locs[i].host_ptr,
               k->block_bytes);
    free(locs);
    *got = i > first ? i - first : 0;
    if (*got && keys_now_ns() >= st.valid_until_ns)
        rc = KVT_CLIENT_ETIMEDOUT; /* the lease may have ended before the copies did */
    if (rc == 0 && have > i) {
        uint32_t more = 0;
        rc = kvt_client_get(k->c, m.lease, i, have - i,
                            (uint8_t *)buf + (size_t)(i - first) * k->block_bytes,
                            cap - (size_t)(i - first) * k->block_bytes, &more, NULL);
        *got += more;
    }
    if (rc < 0 && !keys_transport(rc))
        rc = 0; /* the stream stopped at a page whose bytes went (ECORRUPT, EIO): *got says where */
    if (rc == 0 && m.lease)
        rc = kvt_client_release(k->c, m.lease, NULL);
    return rc;
}

int kvt_keys_chain_get(kvt_keys_t *k, const kvt_key_t *keys, uint32_t n, uint32_t first, void *buf,
                       size_t cap, uint32_t *got)
{
    return keys_chain_get(k, keys, n, first, buf, cap, got, NULL);
}

int kvt_keys_chain_get_kept(kvt_keys_t *k, const kvt_key_t *keys, uint32_t n, uint32_t first,
                            void *buf, size_t cap, uint32_t *got, kvt_keys_kept_t *kept)
{
    if (!kept)
        return KVT_CLIENT_EINVAL;
    return keys_chain_get(k, keys, n, first, buf, cap, got, kept);
}

int kvt_keys_chain_remove(kvt_keys_t *k, const kvt_key_t *keys, uint32_t n)
{
    if (!k)
        return KVT_CLIENT_EINVAL;
    uint32_t *t = NULL;
    int rc = keys_chain_tokens(k, keys, n, &t);
    if (rc < 0)
        return rc;
    rc = kvt_client_remove(k->c, t, n * KVT_KEY_TOKENS);
    free(t);
    return rc;
}

/* -- independent keys --------------------------------------------------------------------- */

/* What each independent call queues per key, and what it does with the reply. */
enum { KEYS_EXISTS, KEYS_PUT, KEYS_GET, KEYS_REMOVE };

/* A PUT's skipped page is held already, being written by another PUT, or dropped for want of
 * room: the reply does not say which. Look (PROBE: not a use) at the skipped keys, and give those
 * without bytes ENOSPC, so that a key reported stored is one a get can find. */
static int keys_check_skipped(kvt_batch_t *b, uint32_t (*t)[KVT_KEY_TOKENS],
                              const kvt_client_put_t *pr, kvt_client_match_t *m, uint8_t *tier,
                              int *st, uint32_t n)
{
    int ms[KVT_KEYS_CHUNK];
    int rc = 0;
    kvt_batch_reset(b);
    for (uint32_t i = 0; i < n && rc == 0; i++) {
        if (st[i] != 0 || pr[i].skipped == 0)
            continue;
        memset(&m[i], 0, sizeof m[i]);
        m[i].tiers = &tier[i];
        m[i].tiers_cap = 1;
        rc = kvt_batch_match(b, t[i], KVT_KEY_TOKENS, KVT_CLIENT_PROBE, 0, NULL, &m[i], &ms[i]);
    }
    if (rc == 0 && kvt_batch_size(b))
        rc = kvt_batch_run(b);
    if (rc < 0)
        return rc;
    for (uint32_t i = 0; i < n; i++)
        if (st[i] == 0 && pr[i].skipped &&
            (ms[i] < 0 || keys_with_bytes(&tier[i], m[i].pages) == 0))
            st[i] = ms[i] < 0 ? ms[i] : KVT_CLIENT_ENOSPC;
    return 0;
}

/* One chunk of independent keys: queue one request per key, run, then (get) GET each hit and
 * release the leases in a second batch. Returns the successes or a transport error. */
static int keys_chunk(kvt_keys_t *k, kvt_batch_t *b, int op, const kvt_key_t *keys, uint32_t n,
                      const void *const *blocks, void *const *bufs, uint8_t *found, int *status)
{
    uint32_t t[KVT_KEYS_CHUNK][KVT_KEY_TOKENS];
    kvt_client_match_t m[KVT_KEYS_CHUNK];
    kvt_client_step_t sp[KVT_KEYS_CHUNK]; /* get, mapped: where each hit lies */
    kvt_client_loc_t loc[KVT_KEYS_CHUNK];
    int mapped = op == KEYS_GET && kvt_client_zero_copy(k->c);
    /* Through the mapping: written in place, no socket bytes (bench_client: twice a socket PUT's
     * speed for 2 MiB pages), the chunk's RESERVEs and COMMITs pipelined (each.h): two round
     * trips per KVT_EACH_GROUP keys, where a kvt_client_put per key took two each. */
    int put_mapped = op == KEYS_PUT && kvt_client_zero_copy(k->c);
    uint8_t tier[KVT_KEYS_CHUNK];
    kvt_client_put_t pr[KVT_KEYS_CHUNK];
    int st[KVT_KEYS_CHUNK];
    int rc = 0;
    kvt_batch_reset(b);
    for (uint32_t i = 0; i < n && rc == 0; i++) {
        (void)kvt_key_tokens(keys[i].data, keys[i].len, t[i]); /* checked by the caller */
        memset(&m[i], 0, sizeof m[i]);
        m[i].tiers = &tier[i];
        m[i].tiers_cap = 1;
        switch (op) {
        case KEYS_EXISTS:
            rc = kvt_batch_match(b, t[i], KVT_KEY_TOKENS, 0, 0, NULL, &m[i], &st[i]);
            break;
        case KEYS_GET:
            loc[i] = (kvt_client_loc_t){.tier = KVT_CLIENT_TIER_NONE};
            sp[i] = (kvt_client_step_t){.locs = &loc[i], .locs_cap = 1};
            rc = kvt_batch_match_step(b, t[i], KVT_KEY_TOKENS,
                                      KVT_CLIENT_LEASE | (mapped ? KVT_CLIENT_LOCATE : 0), 0, NULL,
                                      &m[i], mapped ? &sp[i] : NULL, &st[i]);
            break;
        case KEYS_PUT:
            if (put_mapped)
                break; /* all at once below */
            /* Lent, not copied into the batch: the batch runs before this returns. */
            rc = kvt_batch_put_ref(b, t[i], KVT_KEY_TOKENS, 0, 1, blocks[i], NULL, &pr[i], &st[i]);
            break;
        default:
            rc = kvt_batch_remove(b, t[i], KVT_KEY_TOKENS, &st[i]);
        }
    }
    if (rc == 0 && put_mapped)
        rc = kvt__put_each_mapped(k->c, &t[0][0], KVT_KEY_TOKENS, n, blocks, pr, st);
    if (rc == 0)
        rc = kvt_batch_run(b);
    if (rc < 0) {
        kvt_batch_reset(b);
        return rc;
    }
    if (op == KEYS_PUT && (rc = keys_check_skipped(b, t, pr, m, tier, st, n)) < 0)
        return rc;
    int ok = 0;
    for (uint32_t i = 0; i < n; i++) {
        int s = st[i];
        if (s == 0 && (op == KEYS_EXISTS || op == KEYS_GET) &&
            keys_with_bytes(&tier[i], m[i].pages) == 0)
            s = KVT_CLIENT_ENOENT;
        if (s == 0 && op == KEYS_GET && mapped && loc[i].host_ptr) {
            /* Located: copied from the mapping, no GET. */
            memcpy(bufs[i], loc[i].host_ptr, k->block_bytes);
            if (keys_now_ns() >= sp[i].valid_until_ns)
                s = KVT_CLIENT_ETIMEDOUT; /* the lease may have ended before the copy did */
        } else if (s == 0 && op == KEYS_GET) {
            uint32_t got = 0;
            s = kvt_client_get(k->c, m[i].lease, 0, 1, bufs[i], k->block_bytes, &got, NULL);
            if (s == 0 && got != 1)
                s = KVT_CLIENT_ENOENT; /* the page lost its bytes (index only) */
            if (keys_transport(s))
                return s; /* the connection is gone: the leases went with it */
        }
        if (found)
            found[i] = s == 0;
        if (status)
            status[i] = s;
        ok += s == 0;
    }
    if (op == KEYS_GET) {
        int rs[KVT_KEYS_CHUNK];
        kvt_batch_reset(b);
        for (uint32_t i = 0; i < n && rc == 0; i++)
            if (st[i] == 0 && m[i].lease)
                rc = kvt_batch_release(b, m[i].lease, &rs[i]);
        if (rc == 0 && kvt_batch_size(b))
            rc = kvt_batch_run(b);
        if (rc < 0)
            return rc;
    }
    return ok;
}

static int keys_each(kvt_keys_t *k, int op, const kvt_key_t *keys, uint32_t n,
                     const void *const *blocks, void *const *bufs, uint8_t *found, int *status)
{
    if (!k || (n && !keys))
        return KVT_CLIENT_EINVAL;
    k->local_err = 0;
    if ((op == KEYS_PUT && n && !blocks) || (op == KEYS_GET && n && !bufs))
        return KVT_CLIENT_EINVAL;
    if ((op == KEYS_PUT || op == KEYS_GET) && n && k->block_bytes == 0)
        return keys_fail(k, KVT_CLIENT_EINVAL,
                         "blocks (%u keys) on an index-only client (block_bytes 0)", n);
    for (uint32_t i = 0; i < n; i++)
        if (!keys[i].data || keys[i].len == 0 || keys[i].len > KVT_KEY_MAX)
            return keys_fail(k, KVT_CLIENT_EINVAL,
                             "key %u is %zu bytes: a key is 1..%d (KVT_KEY_MAX) bytes", i,
                             keys[i].len, KVT_KEY_MAX);
    kvt_batch_t *b;
    int rc = kvt_batch_create(&b, k->c);
    if (rc < 0)
        return rc;
    int ok = 0;
    for (uint32_t at = 0; at < n; at += KVT_KEYS_CHUNK) {
        uint32_t cn = n - at < KVT_KEYS_CHUNK ? n - at : KVT_KEYS_CHUNK;
        rc = keys_chunk(k, b, op, keys + at, cn, blocks ? blocks + at : NULL,
                        bufs ? bufs + at : NULL, found ? found + at : NULL,
                        status ? status + at : NULL);
        if (rc < 0)
            break;
        ok += rc;
    }
    kvt_batch_destroy(b);
    return rc < 0 ? rc : ok;
}

int kvt_keys_exists(kvt_keys_t *k, const kvt_key_t *keys, uint32_t n, uint8_t *found)
{
    return keys_each(k, KEYS_EXISTS, keys, n, NULL, NULL, found, NULL);
}

int kvt_keys_put(kvt_keys_t *k, const kvt_key_t *keys, uint32_t n, const void *const *blocks,
                 int *status)
{
    return keys_each(k, KEYS_PUT, keys, n, blocks, NULL, NULL, status);
}

int kvt_keys_get(kvt_keys_t *k, const kvt_key_t *keys, uint32_t n, void *const *bufs, int *status)
{
    return keys_each(k, KEYS_GET, keys, n, NULL, bufs, NULL, status);
}

int kvt_keys_remove(kvt_keys_t *k, const kvt_key_t *keys, uint32_t n, int *status)
{
    return keys_each(k, KEYS_REMOVE, keys, n, NULL, NULL, NULL, status);
}
