/*
 * mrc.c: the SHARDS estimator of mrc.h and the gauges it feeds. It owns a linear-probing table of
 * the sampled pages (key, last-lookup time, bytes), a Fenwick tree of their bytes over those
 * times, and the histogram of reuse distances. Times grow by one per sampled lookup of a page;
 * when they reach the end of the Fenwick tree (twice max_keys), the tracked pages are renumbered
 * 1..n in order and the tree rebuilt, which costs O(n log n) once per max_keys lookups at least.
 * Between renumberings no slot moves (nothing is deleted from the table but by them), so a time
 * names its slot (at[]) and the renumbering reads the pages in time order without sorting.
 * Everything is allocated at create: a lookup never allocates (but the caller's scratch).
 */
#include "mrc.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "server.h"

#define KVT_MRC_P_BITS   24 /* the sampling hash is 24 bits: T / 2^24 is the rate */
#define KVT_MRC_SUB_BITS 5  /* 32 linear histogram buckets per doubling of the distance */
#define KVT_MRC_BUCKETS  ((64 << KVT_MRC_SUB_BITS) + 1)

typedef struct kvt_mrc_slot {
    uint64_t key;
    uint32_t t; /* last lookup time, 1-based; 0: an empty slot */
    uint32_t bytes;
} kvt_mrc_slot_t;

struct kvt__mrc {
    uint32_t thresh; /* T: a page is sampled when its sampling hash is below it */
    uint32_t max_keys;
    kvt_mrc_slot_t *tab; /* 2^tab_bits slots, at most half full */
    uint32_t tab_bits, n;
    kvt_mrc_slot_t *buf; /* max_keys + 1 slots: the renumbering's copy */
    uint32_t *at;        /* by time: the slot that had it (stale once the page moved on) */
    uint64_t *fen;       /* Fenwick tree of bytes by time, [1, fen_n] */
    uint32_t fen_n, now; /* now: the next time to give */
    uint64_t fen_total;
    double hist[KVT_MRC_BUCKETS]; /* tokens / R by distance bucket */
    double cold;                  /* tokens / R of first lookups (infinite distance) */
    double weight;                /* all tokens / R, hist and cold together */
    uint64_t lookup_tokens, page_tokens;
    uint32_t last_bytes;
    uint64_t *scratch;
    size_t scratch_cap;
    size_t bytes; /* allocated at create */
};

static uint32_t sample_hash(uint64_t key)
{
    return (uint32_t)((key * 0x9E3779B97F4A7C15ull) >> (64 - KVT_MRC_P_BITS));
}

static uint32_t slot_of(const kvt__mrc_t *m, uint64_t key)
{
    return (uint32_t)((key * 0xC2B2AE3D27D4EB4Full) >> (64 - m->tab_bits));
}

static void fen_add(kvt__mrc_t *m, uint32_t i, uint64_t delta)
{
    m->fen_total += delta;
    for (; i <= m->fen_n; i += i & -i)
        m->fen[i] += delta; /* unsigned: a removal wraps back exactly */
}

static uint64_t fen_prefix(const kvt__mrc_t *m, uint32_t i)
{
    uint64_t s = 0;
    for (; i > 0; i -= i & -i)
        s += m->fen[i];
    return s;
}

int kvt__mrc_create(kvt__mrc_t **out, const kvt__mrc_conf_t *conf)
{
    if (!out || !conf || !(conf->rate > 0 && conf->rate <= 1) || conf->max_keys < 64 ||
        conf->max_keys > (1u << 26))
        return KVT_EINVAL;
    kvt__mrc_t *m = calloc(1, sizeof *m);
    if (!m)
        return KVT_ENOMEM;
    m->max_keys = conf->max_keys;
    m->thresh = (uint32_t)ceil(conf->rate * (double)(1u << KVT_MRC_P_BITS));
    m->tab_bits = 1;
    while ((1u << m->tab_bits) < 2 * conf->max_keys) /* max_keys + 1 at most: half full */
        m->tab_bits++;
    m->fen_n = 2 * conf->max_keys;
    m->now = 1;
    m->tab = calloc((size_t)1 << m->tab_bits, sizeof *m->tab);
    m->buf = malloc(((size_t)conf->max_keys + 1) * sizeof *m->buf);
    m->fen = calloc((size_t)m->fen_n + 1, sizeof *m->fen);
    m->at = calloc((size_t)m->fen_n + 1, sizeof *m->at);
    if (!m->tab || !m->buf || !m->fen || !m->at) {
        kvt__mrc_destroy(m);
        return KVT_ENOMEM;
    }
    m->bytes = sizeof *m + ((size_t)1 << m->tab_bits) * sizeof *m->tab +
               ((size_t)conf->max_keys + 1) * sizeof *m->buf +
               ((size_t)m->fen_n + 1) * (sizeof *m->fen + sizeof *m->at);
    *out = m;
    return 0;
}

void kvt__mrc_destroy(kvt__mrc_t *m)
{
    if (!m)
        return;
    free(m->tab);
    free(m->buf);
    free(m->fen);
    free(m->at);
    free(m->scratch);
    free(m);
}

uint64_t *kvt__mrc_scratch(kvt__mrc_t *m, size_t n)
{
    if (n > m->scratch_cap) {
        uint64_t *p = realloc(m->scratch, n * sizeof *p);
        if (!p)
            return NULL;
        m->scratch = p;
        m->scratch_cap = n;
    }
    return m->scratch;
}

/* The slot holding key, or the empty slot where it would go. */
static kvt_mrc_slot_t *find(kvt__mrc_t *m, uint64_t key)
{
    uint32_t mask = (1u << m->tab_bits) - 1;
    for (uint32_t i = slot_of(m, key);; i = (i + 1) & mask)
        if (!m->tab[i].t || m->tab[i].key == key)
            return &m->tab[i];
}

/* Keeps the tracked pages whose sampling hash is under the threshold, renumbered 1..n in the
 * order of their last lookups, and rebuilds the table and the Fenwick tree around them. */
static void rebuild(kvt__mrc_t *m)
{
    uint32_t k = 0, cap = 1u << m->tab_bits;
    for (uint32_t t = 1; t < m->now; t++) {
        const kvt_mrc_slot_t *s = &m->tab[m->at[t]];
        if (s->t == t && sample_hash(s->key) < m->thresh)
            m->buf[k++] = *s;
    }
    memset(m->tab, 0, (size_t)cap * sizeof *m->tab);
    memset(m->fen, 0, ((size_t)m->fen_n + 1) * sizeof *m->fen);
    m->fen_total = 0;
    for (uint32_t i = 0; i < k; i++) {
        kvt_mrc_slot_t *s = find(m, m->buf[i].key);
        *s = m->buf[i];
        s->t = i + 1;
        m->at[i + 1] = (uint32_t)(s - m->tab);
        m->fen[i + 1] = s->bytes;
        m->fen_total += s->bytes;
    }
    /* O(n) build: each node passes its sum to its parent once */
    for (uint32_t i = 1; i <= m->fen_n; i++) {
        uint32_t up = i + (i & -i);
        if (up <= m->fen_n)
            m->fen[up] += m->fen[i];
    }
    m->n = k;
    m->now = k + 1;
}

/* The histogram bucket of a distance of d bytes: 0 below 1, then 32 linear buckets per doubling
 * (HDR-histogram style), read off the double's exponent and top mantissa bits. */
static unsigned bucket(double d)
{
    if (d < 1)
        return 0;
    uint64_t bits;
    memcpy(&bits, &d, sizeof bits);
    unsigned e = (unsigned)(bits >> 52) - 1023;
    unsigned b = 1 + (e << KVT_MRC_SUB_BITS) + (unsigned)(bits >> (52 - KVT_MRC_SUB_BITS) & 31);
    return b >= KVT_MRC_BUCKETS ? KVT_MRC_BUCKETS - 1 : b;
}

/* Bucket b's bounds [lo, hi), for b >= 1. */
static void bucket_bounds(unsigned b, double *lo, double *hi)
{
    unsigned e = (b - 1) >> KVT_MRC_SUB_BITS, k = (b - 1) & 31;
    *lo = ldexp(1 + k / 32.0, (int)e);
    *hi = ldexp(1 + (k + 1) / 32.0, (int)e);
}

static void access_page(kvt__mrc_t *m, uint64_t key, uint32_t bytes, uint32_t tokens)
{
    if (sample_hash(key) >= m->thresh)
        return; /* the threshold fell since the key was picked (an earlier page's lookup) */
    if (m->now > m->fen_n)
        rebuild(m);
    kvt_mrc_slot_t *s = find(m, key);
    double scale = (double)(1u << KVT_MRC_P_BITS) / m->thresh, w = tokens * scale;
    if (!s->t && m->n >= m->max_keys && m->thresh == 1) {
        m->cold += w; /* no lower rate left (a billion pages seen): the table stays as it is */
        m->weight += w;
        return;
    }
    if (s->t) {
        /* the bytes looked up since, itself included (its own time's bytes are in the sum) */
        uint64_t since = m->fen_total - fen_prefix(m, s->t - 1);
        m->hist[bucket((double)since * scale)] += w;
        fen_add(m, s->t, -(uint64_t)s->bytes);
    } else {
        m->cold += w;
        s->key = key;
        m->n++;
    }
    m->weight += w;
    s->t = m->now++;
    m->at[s->t] = (uint32_t)(s - m->tab);
    s->bytes = bytes;
    fen_add(m, s->t, bytes);
    if (m->n > m->max_keys) {
        /* SHARDS fixed-size: a lower rate, the pages now over it forgotten. The weights already
         * counted keep their old rate's scale: every estimate is a ratio to m->weight. */
        while (m->n > m->max_keys && m->thresh > 1) {
            m->thresh -= m->thresh / 8 ? m->thresh / 8 : 1;
            rebuild(m);
        }
    }
}

void kvt__mrc_lookup(kvt__mrc_t *m, const uint64_t *keys, uint32_t npages, uint32_t page_tokens,
                     uint32_t block_bytes, uint32_t ntokens)
{
    if (!block_bytes)
        return; /* no block size known: not a page of any tier's stack */
    m->lookup_tokens += ntokens;
    m->page_tokens += (uint64_t)npages * page_tokens;
    /* Deepest first: the first page ends up the most recent, never less recent than a child.
     * The sampled pages' slots are asked of the memory a batch at a time before any is read:
     * the table is megabytes, each lookup of it a cache miss, and they then overlap. */
    uint64_t batch[32];
    for (uint32_t i = npages; i > 0;) {
        unsigned n = 0;
        for (; i > 0 && n < 32; i--)
            if (sample_hash(keys[i - 1]) < m->thresh) {
                batch[n++] = keys[i - 1];
                __builtin_prefetch(&m->tab[slot_of(m, keys[i - 1])]);
            }
        for (unsigned k = 0; k < n; k++)
            access_page(m, batch[k], block_bytes, page_tokens);
        if (n)
            m->last_bytes = block_bytes;
    }
}

/* The weight of the distances at most x bytes, interpolated inside x's bucket. */
static double weight_upto(const kvt__mrc_t *m, double x)
{
    if (x < 1)
        return 0;
    unsigned b = bucket(x);
    double w = 0;
    for (unsigned i = 0; i < b; i++)
        w += m->hist[i];
    if (b >= KVT_MRC_BUCKETS - 1)
        return w + m->hist[b];
    double lo, hi;
    bucket_bounds(b, &lo, &hi);
    double f = (x - lo) / (hi - lo);
    return w + m->hist[b] * (f < 0 ? 0 : f > 1 ? 1 : f);
}

double kvt__mrc_hit_tokens(const kvt__mrc_t *m, double lo, double hi)
{
    if (m->weight <= 0 || hi <= lo)
        return 0;
    /* SHARDS-adj: the sampled weight should be the whole pages' tokens; a surplus or shortfall
     * is mostly a hot page sampled or not, whose lookups are at the shortest distances, so the
     * difference goes to the top of the stack. */
    double w = weight_upto(m, hi) - weight_upto(m, lo);
    if (lo <= 0)
        w += (double)m->page_tokens - m->weight;
    return w <= 0 ? 0 : w > (double)m->page_tokens ? (double)m->page_tokens : w;
}

uint32_t kvt__mrc_block_bytes(const kvt__mrc_t *m)
{
    return m->last_bytes;
}

void kvt__mrc_stats(const kvt__mrc_t *m, kvt__mrc_stats_t *out)
{
    out->keys = m->n;
    out->bytes = m->bytes + m->scratch_cap * sizeof *m->scratch;
    out->rate = (double)m->thresh / (double)(1u << KVT_MRC_P_BITS);
    out->lookup_tokens = m->lookup_tokens;
    out->page_tokens = m->page_tokens;
}

/* The scales each tier's curve is read at (the label values of kvtier_mrc_*{scale}). */
static const double kvt_mrc_scales[KVT_MRC_SCALES] = {0.25, 0.5, 1, 2, 4};

void kvt__mrc_metrics(kvt_srv_t *s)
{
    kvt_metrics_t *mt = s->metrics;
    if (!s->mrc) {
        kvt__metrics_tiers(mt, 0);
        return;
    }
    kvt__mrc_stats_t st;
    kvt__mrc_stats(s->mrc, &st);
    kvt__metric_set(mt, KVT_M_MRC_SAMPLING, 0, st.rate);
    kvt__metric_set(mt, KVT_M_MRC_PAGES, 0, (double)st.keys);
    kvt__metric_set(mt, KVT_M_MRC_BYTES, 0, (double)st.bytes);
    /* A tier's size in the stack: its capacity in blocks of the last size looked up (a tier may
     * charge a block more than its payload: NVMe's header and tokens), and the part of it the
     * policy keeps filled, between its low and high watermarks. */
    uint32_t bb = kvt__mrc_block_bytes(s->mrc);
    double fill = (s->conf->policy_high + s->conf->policy_low) / 2;
    double cap[KVT_TIER_COUNT] = {0}, all = 0;
    unsigned mask = 0;
    for (int i = KVT_TIER_HBM; i < KVT_TIER_COUNT; i++) {
        if (!s->tiers[i])
            continue;
        kvt_tier_usage_t u;
        kvt__tier_usage(s, (kvt_tier_id_t)i, &u);
        uint64_t fp = bb ? kvt__tier_footprint(s, (kvt_tier_id_t)i, bb) : 0;
        cap[i] = (double)u.capacity_bytes * fill * (fp ? (double)bb / (double)fp : 1);
        all += cap[i];
        mask |= 1u << i;
    }
    kvt__metrics_tiers(mt, mask);
    double looked = st.lookup_tokens ? (double)st.lookup_tokens : 1;
    double above = 0;
    for (int i = KVT_TIER_HBM; i < KVT_TIER_COUNT; i++) {
        if (!(mask & (1u << i)))
            continue;
        for (unsigned k = 0; k < KVT_MRC_SCALES; k++) {
            double tok = kvt__mrc_hit_tokens(s->mrc, above, above + kvt_mrc_scales[k] * cap[i]);
            kvt__metric_set(mt, KVT_M_MRC_HIT_RATIO, kvt__tier_scale((unsigned)i, k), tok / looked);
            kvt__metric_set(mt, KVT_M_MRC_PREFILL_SAVED, kvt__tier_scale((unsigned)i, k),
                            tok / s->conf->prefill_tokens_per_s);
        }
        above += cap[i];
    }
    kvt__metric_set(mt, KVT_M_MRC_HIERARCHY, 0, kvt__mrc_hit_tokens(s->mrc, 0, all) / looked);
}
