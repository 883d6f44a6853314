/*
 * metrics.c: the storage behind KVT_METRIC_LIST and its two renderings, the Prometheus text of
 * /metrics and the name/value list of STATS. Everything either shows comes from the one table in
 * metrics.h: name, type, help and label dimension; this file only knows how to lay out each
 * dimension's series. Histograms share one bucket ladder in seconds, from 10 us to 10 s, which
 * covers a DRAM hit and a remote round trip alike.
 */
#include "metrics.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define KVT_MAX_SERIES (KVT_TIER_COUNT * KVT_TIER_COUNT)

static const double kvt_bounds[KVT_HIST_BUCKETS - 1] = {
    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005,
    0.01,    0.025,    0.05,    0.1,    0.25,    0.5,    1.0,   10.0,
};

static const struct kvt_metric_def {
    const char *name, *help;
    kvt_metric_type_t type;
    kvt_label_kind_t lbl;
} kvt_defs[KVT_M_COUNT] = {
#define KVT_X(id, type, name, help, lbl) [KVT_M_##id] = {name, help, KVT_MT_##type, KVT_LBL_##lbl},
    KVT_METRIC_LIST(KVT_X)
#undef KVT_X
};

static const char *const kvt_reason_names[KVT_MISS_COUNT] = {
    "never_seen", "evicted", "short_page", "remote_unreachable", "checksum",
};
static const char *const kvt_recovery_names[KVT_RECOVERY_COUNT] = {
    "inserted", "torn", "stale", "orphan", "removed",
};
static const char *const kvt_put_names[KVT_PUT_COUNT] = {"stored", "cached", "no_room", "failed"};
static const char *const kvt_hint_names[KVT_HINTK_COUNT] = {"paused", "finished", "priority"};
static const char *const kvt_resv_names[KVT_RESV_COUNT] = {"committed", "aborted", "expired",
                                                           "closed"};
static const char *const kvt_perr_names[KVT_PERR_COUNT] = {
    "bad_magic", "bad_version", "too_big", "unknown_op",
    "bad_body",  "no_hello",    "auth",    "truncated",
};

/* The labels that name one value of a fixed list: label, the list, its length. */
static const struct kvt_enum_label {
    const char *key;
    const char *const *names;
    unsigned count;
} kvt_enum_labels[] = {
    [KVT_LBL_REASON] = {"reason", kvt_reason_names, KVT_MISS_COUNT},
    [KVT_LBL_ERR] = {"kind", kvt_perr_names, KVT_PERR_COUNT},
    [KVT_LBL_RECOVERY] = {"outcome", kvt_recovery_names, KVT_RECOVERY_COUNT},
    [KVT_LBL_PUT] = {"outcome", kvt_put_names, KVT_PUT_COUNT},
    [KVT_LBL_HINT] = {"kind", kvt_hint_names, KVT_HINTK_COUNT},
    [KVT_LBL_RESV] = {"outcome", kvt_resv_names, KVT_RESV_COUNT},
};

struct kvt_metrics {
    double values[KVT_M_COUNT][KVT_MAX_SERIES];
    kvt_hist_t hists[KVT_M_COUNT][KVT_MAX_SERIES];
};

int kvt__metrics_create(kvt_metrics_t **out)
{
    kvt_metrics_t *m = calloc(1, sizeof *m);
    if (!m)
        return KVT_ENOMEM;
    *out = m;
    return 0;
}

void kvt__metrics_destroy(kvt_metrics_t *m)
{
    free(m);
}

void kvt__metric_add(kvt_metrics_t *m, kvt_metric_id_t id, unsigned series, double v)
{
    kvt_assert(id < KVT_M_COUNT && series < KVT_MAX_SERIES);
    m->values[id][series] += v;
}

void kvt__metric_set(kvt_metrics_t *m, kvt_metric_id_t id, unsigned series, double v)
{
    kvt_assert(id < KVT_M_COUNT && series < KVT_MAX_SERIES);
    m->values[id][series] = v;
}

double kvt__metric_get(const kvt_metrics_t *m, kvt_metric_id_t id, unsigned series)
{
    kvt_assert(id < KVT_M_COUNT && series < KVT_MAX_SERIES);
    return m->values[id][series];
}

void kvt__metric_observe(kvt_metrics_t *m, kvt_metric_id_t id, unsigned series, uint64_t ns)
{
    kvt_assert(id < KVT_M_COUNT && series < KVT_MAX_SERIES);
    kvt_hist_t *h = &m->hists[id][series];
    double s = (double)ns / 1e9;
    unsigned b = 0;
    while (b < KVT_HIST_BUCKETS - 1 && s > kvt_bounds[b])
        b++;
    h->buckets[b]++;
    h->count++;
    h->sum += s;
}

const kvt_hist_t *kvt__metric_hist(const kvt_metrics_t *m, kvt_metric_id_t id, unsigned series)
{
    kvt_assert(id < KVT_M_COUNT && series < KVT_MAX_SERIES);
    return &m->hists[id][series];
}

typedef struct kvt_buf {
    char *p;
    size_t len, cap;
    int oom;
} kvt_buf_t;

__attribute__((format(printf, 2, 3))) static void kvt_bprintf(kvt_buf_t *b, const char *fmt, ...)
{
    for (;;) {
        if (b->oom)
            return;
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(b->p + b->len, b->cap - b->len, fmt, ap);
        va_end(ap);
        if (n >= 0 && (size_t)n < b->cap - b->len) {
            b->len += (size_t)n;
            return;
        }
        size_t cap = b->cap * 2 + (size_t)(n > 0 ? n : 64);
        char *np = realloc(b->p, cap);
        if (!np) {
            b->oom = 1;
            return;
        }
        b->p = np;
        b->cap = cap;
    }
}

/* The tiers each tier-labelled metric has a series for, one bit per tier id: only those whose
 * series can be other than zero (a tier="none" row of used bytes, a MAP of NVMe, a reclaim in
 * DRAM would be always 0, and a scraper would store and graph them all). */
#define TIER_BIT(t) (1u << (t))
static const unsigned kvt_tier_sets[] = {
    [KVT_LBL_TIER] = (1u << KVT_TIER_COUNT) - 1,
    [KVT_LBL_STORE] = TIER_BIT(KVT_TIER_HBM) | TIER_BIT(KVT_TIER_DRAM) | TIER_BIT(KVT_TIER_NVME) |
                      TIER_BIT(KVT_TIER_REMOTE),
    [KVT_LBL_LOSS] = TIER_BIT(KVT_TIER_NVME) | TIER_BIT(KVT_TIER_REMOTE),
    [KVT_LBL_MAP] = TIER_BIT(KVT_TIER_HBM) | TIER_BIT(KVT_TIER_DRAM),
};

static int lbl_is_tier(kvt_label_kind_t lbl)
{
    return lbl == KVT_LBL_TIER || lbl == KVT_LBL_STORE || lbl == KVT_LBL_LOSS || lbl == KVT_LBL_MAP;
}

/* The labels of one series as key/value pairs (at most two), their count, or -1 when the series
 * index is not rendered (a tier pair of one tier with itself, a tier or an operation that the
 * metric cannot count). */
static int series_kv(kvt_label_kind_t lbl, unsigned s, const char *kv[4])
{
    switch (lbl) {
    case KVT_LBL_NONE:
        return s == 0 ? 0 : -1;
    case KVT_LBL_TIER:
    case KVT_LBL_STORE:
    case KVT_LBL_LOSS:
    case KVT_LBL_MAP:
        if (s >= KVT_TIER_COUNT || !(kvt_tier_sets[lbl] & TIER_BIT(s)))
            return -1;
        kv[0] = "tier";
        kv[1] = kvt_tier_name((kvt_tier_id_t)s);
        return 1;
    case KVT_LBL_OP:
    case KVT_LBL_ZC_OP:
        if (s == 0 || s >= KVT_OP_COUNT ||
            (lbl == KVT_LBL_ZC_OP && s != KVT_OP_GET && s != KVT_OP_RESERVE))
            return -1;
        kv[0] = "op";
        kv[1] = kvt_proto_op_name(s);
        return 1;
    case KVT_LBL_PAIR: {
        unsigned from = s / KVT_TIER_COUNT, to = s % KVT_TIER_COUNT;
        if (s >= KVT_MAX_SERIES || from == to || from == KVT_TIER_NONE || to == KVT_TIER_NONE)
            return -1;
        kv[0] = "from";
        kv[1] = kvt_tier_name((kvt_tier_id_t)from);
        kv[2] = "to";
        kv[3] = kvt_tier_name((kvt_tier_id_t)to);
        return 2;
    }
    case KVT_LBL_TIER_IO:
        if (s / 2 == KVT_TIER_NONE || s / 2 >= KVT_TIER_COUNT)
            return -1;
        kv[0] = "tier";
        kv[1] = kvt_tier_name((kvt_tier_id_t)(s / 2));
        kv[2] = "dir";
        kv[3] = s % 2 ? "write" : "read";
        return 2;
    case KVT_LBL_REASON:
    case KVT_LBL_ERR:
    case KVT_LBL_RECOVERY:
    case KVT_LBL_PUT:
    case KVT_LBL_HINT:
    case KVT_LBL_RESV: {
        const struct kvt_enum_label *e = &kvt_enum_labels[lbl];
        if (s >= e->count)
            return -1;
        kv[0] = e->key;
        kv[1] = e->names[s];
        return 1;
    }
    }
    return -1;
}

/* The label set of one series, e.g. tier="dram", or "" for an unlabelled metric; NULL when the
 * series index is not rendered. */
static const char *series_labels(kvt_label_kind_t lbl, unsigned s, char *buf, size_t len)
{
    const char *kv[4];
    int n = series_kv(lbl, s, kv);
    if (n < 0)
        return NULL;
    buf[0] = 0;
    if (n == 1)
        snprintf(buf, len, "%s=\"%s\"", kv[0], kv[1]);
    else if (n == 2)
        snprintf(buf, len, "%s=\"%s\",%s=\"%s\"", kv[0], kv[1], kv[2], kv[3]);
    return buf;
}

/* A series' STATS name (metrics.h, kvt__metrics_each); NULL when the series is not rendered. */
static const char *series_stat_name(const struct kvt_metric_def *d, unsigned s, char *buf,
                                    size_t len)
{
    const char *kv[4];
    int n = series_kv(d->lbl, s, kv);
    if (n < 0)
        return NULL;
    const char *stem = d->name;
    size_t sl = strlen(stem);
    if (!strncmp(stem, "kvtier_", 7)) {
        stem += 7;
        sl -= 7;
    }
    if (sl > 6 && !strcmp(stem + sl - 6, "_total"))
        sl -= 6;
    if (lbl_is_tier(d->lbl) && !strncmp(stem, "tier_", 5))
        snprintf(buf, len, "%s_%.*s", kv[1], (int)(sl - 5), stem + 5);
    else if (n == 0)
        snprintf(buf, len, "%.*s", (int)sl, stem);
    else if (n == 1)
        snprintf(buf, len, "%.*s_%s", (int)sl, stem, kv[1]);
    else
        snprintf(buf, len, "%.*s_%s_%s", (int)sl, stem, kv[1], kv[3]);
    return buf;
}

int kvt__metrics_each(const kvt_metrics_t *m, int (*cb)(void *arg, const char *name, uint64_t v),
                      void *arg)
{
    for (unsigned id = 0; id < KVT_M_COUNT; id++) {
        const struct kvt_metric_def *d = &kvt_defs[id];
        if (d->type == KVT_MT_HISTOGRAM)
            continue;
        for (unsigned s = 0; s < KVT_MAX_SERIES; s++) {
            char name[128];
            if (!series_stat_name(d, s, name, sizeof name))
                continue;
            double v = m->values[id][s];
            int rc = cb(arg, name, v > 0 ? (uint64_t)v : 0);
            if (rc)
                return rc;
        }
    }
    return 0;
}

static void render_value(kvt_buf_t *b, double v)
{
    if (v == (double)(uint64_t)v && v < 1e18)
        kvt_bprintf(b, "%llu\n", (unsigned long long)v);
    else
        kvt_bprintf(b, "%.9g\n", v);
}

int kvt__metrics_render(const kvt_metrics_t *m, char **out, size_t *len)
{
    static const char *const types[] = {"counter", "gauge", "histogram"};
    kvt_buf_t b = {.cap = 16384};
    b.p = malloc(b.cap);
    if (!b.p)
        return KVT_ENOMEM;
    for (unsigned id = 0; id < KVT_M_COUNT; id++) {
        const struct kvt_metric_def *d = &kvt_defs[id];
        kvt_bprintf(&b, "# HELP %s %s\n# TYPE %s %s\n", d->name, d->help, d->name, types[d->type]);
        for (unsigned s = 0; s < KVT_MAX_SERIES; s++) {
            char lb[96];
            const char *l = series_labels(d->lbl, s, lb, sizeof lb);
            if (!l)
                continue;
            if (d->type != KVT_MT_HISTOGRAM) {
                kvt_bprintf(&b, "%s%s%s%s ", d->name, *l ? "{" : "", l, *l ? "}" : "");
                render_value(&b, m->values[id][s]);
                continue;
            }
            const kvt_hist_t *h = &m->hists[id][s];
            const char *sep = *l ? "," : "";
            uint64_t cum = 0;
            for (unsigned k = 0; k < KVT_HIST_BUCKETS; k++) {
                cum += h->buckets[k];
                if (k < KVT_HIST_BUCKETS - 1)
                    kvt_bprintf(&b, "%s_bucket{%s%sle=\"%g\"} %llu\n", d->name, l, sep,
                                kvt_bounds[k], (unsigned long long)cum);
                else
                    kvt_bprintf(&b, "%s_bucket{%s%sle=\"+Inf\"} %llu\n", d->name, l, sep,
                                (unsigned long long)cum);
            }
            kvt_bprintf(&b, "%s_sum%s%s%s %.9g\n", d->name, *l ? "{" : "", l, *l ? "}" : "",
                        h->sum);
            kvt_bprintf(&b, "%s_count%s%s%s %llu\n", d->name, *l ? "{" : "", l, *l ? "}" : "",
                        (unsigned long long)h->count);
        }
    }
    if (b.oom) {
        free(b.p);
        return KVT_ENOMEM;
    }
    *out = b.p;
    *len = b.len;
    return 0;
}
