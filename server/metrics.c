/*
 * metrics.c: the storage behind KVT_METRIC_LIST and its two renderings, the Prometheus text of
 * /metrics and the name/value list of STATS. Everything either shows comes from the one table in
 * metrics.h: name, type, help and label dimension; this file only knows how to lay out each
 * dimension's series. Histograms share one bucket ladder in seconds, from 10 us to 10 s, which
 * covers a DRAM hit and a remote round trip alike. Two dimensions are not fixed lists: the
 * per-namespace series, a table of label strings that grows to metrics-namespaces entries and no
 * further, and the one build_info series. The process_* gauges are read from /proc/self when a
 * scrape asks, as every Prometheus client library does. The remote tier's per-node families
 * (label node) are rows copied from the tier with the other gauges, like the per-tenant bytes.
 *
 * Each event loop also has a table of its own (kvt__metrics_loop, issue 42): a MATCH answered
 * under the store's lock shared counts there, and so do the replies' request metrics, each loop
 * writing only its own while other loops write theirs. A scrape holds the lock for writing, so no
 * loop writes then: kvt__metrics_process adds every loop's counts into the main table and clears
 * them, and what is rendered is the sums (the same names and values as one table's).
 */
#include "metrics.h"

#include <dirent.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include "config.h"
#include "kvt_commit.h"

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

/* One per-namespace series: its rendered label set and a value per KVT_LBL_NS metric. */
typedef struct kvt_ns_series {
    char *labels; /* model="...",adapter="...", escaped */
    double v;
} kvt_ns_series_t;

struct kvt_metrics {
    double values[KVT_M_COUNT][KVT_MAX_SERIES];
    kvt_hist_t hists[KVT_M_COUNT][KVT_MAX_SERIES];
    kvt_ns_series_t *ns; /* [0] is model="_other" */
    unsigned nns, ns_limit;
    unsigned tier_mask;                           /* kvt__metrics_tiers */
    kvt_metric_tenant_t tenants[KVT_TENANT_ROWS]; /* KVT_TENANT_NAME's rows */
    size_t ntenants;
    unsigned device_mask;                                     /* kvt__metrics_devices */
    unsigned nloops;                                          /* kvt__metrics_loops */
    kvt_tier_remote_node_stats_t nodes[KVT_REMOTE_NODE_ROWS]; /* kvt__metrics_remote_nodes */
    size_t nnodes;
    /* The main table: the loops' own tables (kvt__metrics_loops), merged at each scrape. */
    struct kvt_metrics **loop_tables;
    unsigned nloop_tables;
    /* A loop's table: the metrics added since the last merge (only those are merged), and its
     * per-namespace adds by slot (the main table's labels; room for every slot it can give). */
    uint8_t dirty[KVT_M_COUNT];
    double *ns_adds;
    unsigned ns_cap;
};

void kvt__metrics_remote_nodes(kvt_metrics_t *m, const kvt_tier_remote_node_stats_t *rows, size_t n)
{
    kvt_assert(n <= KVT_REMOTE_NODE_ROWS);
    if (n)
        memcpy(m->nodes, rows, n * sizeof(*rows));
    m->nnodes = n;
}

/* The per-node families, each rendered from one field of kvt_tier_remote_node_stats_t. */
static const struct kvt_node_family {
    const char *name, *help;
    int gauge;
    size_t off; /* a uint64_t, or for the gauges the uint32_t slots / int up */
} kvt_node_families[] = {
    {"kvtier_remote_node_hits_total",
     "GETs this remote node answered with a block that checked out.", 0,
     offsetof(kvt_tier_remote_node_stats_t, hits)},
    {"kvtier_remote_node_misses_total",
     "GETs this remote node answered with nil (never stored, evicted, expired, lost).", 0,
     offsetof(kvt_tier_remote_node_stats_t, misses)},
    {"kvtier_remote_node_errors_total",
     "Remote requests that failed on this node: an error reply, a timeout, a lost connection, a "
     "corrupt value, or refused at once while it was down.",
     0, offsetof(kvt_tier_remote_node_stats_t, errors)},
    {"kvtier_remote_node_moved_total", "MOVED replies this cluster node sent (followed).", 0,
     offsetof(kvt_tier_remote_node_stats_t, moved)},
    {"kvtier_remote_node_asks_total", "ASK replies this cluster node sent (followed).", 0,
     offsetof(kvt_tier_remote_node_stats_t, asks)},
    {"kvtier_remote_node_slot_map_refreshes_total",
     "Slot maps this cluster node sent that were applied.", 0,
     offsetof(kvt_tier_remote_node_stats_t, map_refreshes)},
    {"kvtier_remote_node_failovers_total",
     "Times this cluster node was lost and a refreshed map gave its slots to another.", 0,
     offsetof(kvt_tier_remote_node_stats_t, failovers)},
    {"kvtier_remote_node_slots", "Hash slots the map gives this node (16384 for a single server).",
     1, offsetof(kvt_tier_remote_node_stats_t, slots)},
    {"kvtier_remote_node_up", "1 while the connection to this node is up (handshake answered).", 2,
     offsetof(kvt_tier_remote_node_stats_t, up)},
};

void kvt__metrics_tenants(kvt_metrics_t *m, const kvt_metric_tenant_t *rows, size_t n)
{
    kvt_assert(n <= KVT_TENANT_ROWS);
    if (n)
        memcpy(m->tenants, rows, n * sizeof(*rows));
    m->ntenants = n;
}

/* Appends a label value to dst (room for 2 x len + 1 bytes): a backslash or a quote escaped, as
 * the text format wants, and a byte outside printable ASCII shown as '?' (a label value must be
 * UTF-8; a client's name need not be). */
static char *label_value(char *dst, const char *v)
{
    for (; *v; v++) {
        unsigned char ch = (unsigned char)*v;
        if (ch == '\\' || ch == '"')
            *dst++ = '\\';
        *dst++ = ch >= 0x20 && ch < 0x7f ? (char)ch : '?';
    }
    *dst = 0;
    return dst;
}

void kvt__metrics_ns_limit(kvt_metrics_t *m, unsigned limit)
{
    m->ns_limit = limit;
}

unsigned kvt__metrics_ns_slot(kvt_metrics_t *m, const char *model, const char *adapter)
{
    char lb[2 * 2 * 256 + 32];
    char *p = lb + sprintf(lb, "model=\"");
    p = label_value(p, model);
    p += sprintf(p, "\",adapter=\"");
    p = label_value(p, adapter ? adapter : "");
    strcpy(p, "\"");
    for (unsigned i = 1; i < m->nns; i++)
        if (!strcmp(m->ns[i].labels, lb))
            return i;
    if (m->nns > m->ns_limit) /* [0] is not one of the limit */
        return 0;
    kvt_ns_series_t *n = realloc(m->ns, (m->nns + 1) * sizeof *n);
    if (!n)
        return 0;
    m->ns = n;
    if (!(n[m->nns].labels = strdup(lb)))
        return 0;
    n[m->nns].v = 0;
    return m->nns++;
}

void kvt__metric_ns_add(kvt_metrics_t *m, kvt_metric_id_t id, unsigned slot, double v)
{
    if (m->ns_adds) { /* a loop's table */
        kvt_assert(id < KVT_M_COUNT && kvt_defs[id].lbl == KVT_LBL_NS && slot < m->ns_cap);
        m->ns_adds[slot] += v;
        return;
    }
    kvt_assert(id < KVT_M_COUNT && kvt_defs[id].lbl == KVT_LBL_NS && slot < m->nns);
    m->ns[slot].v += v;
}

/* The seconds since boot the kernel booted at (/proc/stat's btime); 0 if unread. */
static double boot_time(void)
{
    FILE *f = fopen("/proc/stat", "re");
    char line[256];
    double bt = 0;
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "btime %lf", &bt) == 1)
            break;
    if (f)
        fclose(f);
    return bt;
}

/* Adds a loop's counts into the main table m and clears them. Only counters and histograms are
 * added in a loop's table (kvt__metric_set is the main table's). */
static void merge_loop(kvt_metrics_t *m, kvt_metrics_t *l)
{
    for (unsigned id = 0; id < KVT_M_COUNT; id++) {
        if (!l->dirty[id])
            continue;
        l->dirty[id] = 0;
        for (unsigned s = 0; s < KVT_MAX_SERIES; s++) {
            m->values[id][s] += l->values[id][s];
            l->values[id][s] = 0;
            kvt_hist_t *to = &m->hists[id][s], *from = &l->hists[id][s];
            if (!from->count)
                continue;
            for (unsigned b = 0; b < KVT_HIST_BUCKETS; b++)
                to->buckets[b] += from->buckets[b];
            to->count += from->count;
            to->sum += from->sum;
            memset(from, 0, sizeof *from);
        }
    }
    for (unsigned i = 0; i < l->ns_cap && i < m->nns; i++) {
        m->ns[i].v += l->ns_adds[i];
        l->ns_adds[i] = 0;
    }
}

void kvt__metrics_process(kvt_metrics_t *m)
{
    for (unsigned i = 0; i < m->nloop_tables; i++)
        merge_loop(m, m->loop_tables[i]);
    /* /proc/self/stat: the name in parentheses may hold spaces; the fields counted from the
     * last ')' are 3 (state) onwards: utime 14, stime 15, starttime 22, vsize 23, rss 24. */
    char buf[1024];
    FILE *f = fopen("/proc/self/stat", "re");
    size_t n = f ? fread(buf, 1, sizeof buf - 1, f) : 0;
    if (f)
        fclose(f);
    buf[n] = 0;
    char *p = strrchr(buf, ')');
    unsigned long long utime, stime, start, vsize;
    long long rss;
    if (p && sscanf(p + 2,
                    "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu %*d %*d %*d %*d %*d "
                    "%*d %llu %llu %lld",
                    &utime, &stime, &start, &vsize, &rss) == 5) {
        double hz = (double)sysconf(_SC_CLK_TCK);
        m->values[KVT_M_PROC_CPU][0] = (double)(utime + stime) / hz;
        m->values[KVT_M_PROC_VSIZE][0] = (double)vsize;
        m->values[KVT_M_PROC_RSS][0] = (double)rss * (double)sysconf(_SC_PAGESIZE);
        if (m->values[KVT_M_PROC_START][0] == 0) {
            double bt = boot_time();
            if (bt > 0)
                m->values[KVT_M_PROC_START][0] = bt + (double)start / hz;
        }
    }
    DIR *d = opendir("/proc/self/fd");
    if (d) {
        unsigned fds = 0;
        for (struct dirent *e; (e = readdir(d));)
            fds += e->d_name[0] != '.';
        closedir(d);
        m->values[KVT_M_PROC_FDS][0] = fds ? fds - 1 : 0; /* less the directory's own */
    }
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0)
        m->values[KVT_M_PROC_MAX_FDS][0] = rl.rlim_cur == RLIM_INFINITY ? 0 : (double)rl.rlim_cur;
}

void kvt__metrics_tiers(kvt_metrics_t *m, unsigned mask)
{
    m->tier_mask = mask;
}

void kvt__metrics_devices(kvt_metrics_t *m, unsigned mask)
{
    m->device_mask = mask;
}

int kvt__metrics_loops(kvt_metrics_t *m, unsigned n)
{
    m->nloops = n;
    if (m->loop_tables)
        return 0; /* made once, at start */
    kvt_metrics_t **t = calloc(n ? n : 1, sizeof *t);
    if (!t)
        return KVT_ENOMEM;
    for (unsigned i = 0; i < n; i++) {
        /* Slots 0 .. ns_limit: every one kvt__metrics_ns_slot can hand out. */
        if (!(t[i] = calloc(1, sizeof *t[i])) ||
            !(t[i]->ns_adds = calloc(m->ns_limit + 1, sizeof *t[i]->ns_adds))) {
            for (unsigned j = 0; j <= i; j++)
                kvt__metrics_destroy(t[j]);
            free(t);
            return KVT_ENOMEM;
        }
        t[i]->ns_cap = m->ns_limit + 1;
    }
    m->loop_tables = t;
    m->nloop_tables = n;
    return 0;
}

kvt_metrics_t *kvt__metrics_loop(kvt_metrics_t *m, unsigned i)
{
    return i < m->nloop_tables ? m->loop_tables[i] : NULL;
}

/* A TIER_SCALE series of a tier not configured, a DEVICE series of a device with no HBM pool,
 * is not shown. */
static int shown(const kvt_metrics_t *m, const struct kvt_metric_def *d, unsigned s)
{
    if (d->lbl == KVT_LBL_DEVICE)
        return s < 16 && (m->device_mask >> s & 1);
    if (d->lbl == KVT_LBL_LOOP)
        return s < m->nloops;
    return d->lbl != KVT_LBL_TIER_SCALE || (m->tier_mask >> (s / KVT_MRC_SCALES) & 1);
}

int kvt__metrics_create(kvt_metrics_t **out)
{
    kvt_metrics_t *m = calloc(1, sizeof *m);
    if (!m || !(m->ns = calloc(1, sizeof *m->ns)) ||
        !(m->ns[0].labels = strdup("model=\"_other\",adapter=\"\""))) {
        kvt__metrics_destroy(m);
        return KVT_ENOMEM;
    }
    m->nns = 1;
    m->ns_limit = 32;
    m->values[KVT_M_BUILD_INFO][0] = 1;
    *out = m;
    return 0;
}

void kvt__metrics_destroy(kvt_metrics_t *m)
{
    if (!m)
        return;
    for (unsigned i = 0; m->ns && i < m->nns; i++)
        free(m->ns[i].labels);
    free(m->ns);
    for (unsigned i = 0; i < m->nloop_tables; i++)
        kvt__metrics_destroy(m->loop_tables[i]);
    free(m->loop_tables);
    free(m->ns_adds);
    free(m);
}

void kvt__metric_add(kvt_metrics_t *m, kvt_metric_id_t id, unsigned series, double v)
{
    kvt_assert(id < KVT_M_COUNT && series < KVT_MAX_SERIES);
    m->values[id][series] += v;
    m->dirty[id] = 1;
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
    m->dirty[id] = 1;
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
    case KVT_LBL_TIER_SCALE: {
        static const char *const scales[KVT_MRC_SCALES] = {"0.25", "0.5", "1", "2", "4"};
        unsigned t = s / KVT_MRC_SCALES;
        if (t == KVT_TIER_NONE || t >= KVT_TIER_COUNT)
            return -1;
        kv[0] = "tier";
        kv[1] = kvt_tier_name((kvt_tier_id_t)t);
        kv[2] = "scale";
        kv[3] = scales[s % KVT_MRC_SCALES];
        return 2;
    }
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
    case KVT_LBL_DEVICE:
    case KVT_LBL_LOOP: {
        static const char *const devs[16] = {"0", "1", "2",  "3",  "4",  "5",  "6",  "7",
                                             "8", "9", "10", "11", "12", "13", "14", "15"};
        if (s >= 16)
            return -1;
        kv[0] = lbl == KVT_LBL_LOOP ? "loop" : "device";
        kv[1] = devs[s];
        return 1;
    }
    case KVT_LBL_BUILD:
        /* Three labels fixed at build time, given as one key whose value is the last one's. */
        if (s != 0)
            return -1;
        kv[0] = "version=\"" KVT_VERSION "\",commit=\"" KVT_COMMIT "\",cuda";
        kv[1] = KVT_HAVE_CUDA ? "yes" : "no";
        return 1;
    case KVT_LBL_NS:
        return -1; /* not a fixed list: kvt__metrics_render walks the table */
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

/* A gauge whose value is a fraction: STATS sends it in parts per million. */
static int is_ratio(const struct kvt_metric_def *d)
{
    size_t n = strlen(d->name);
    return d->type == KVT_MT_GAUGE && n > 6 && !strcmp(d->name + n - 6, "_ratio");
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
    if (d->type == KVT_MT_HISTOGRAM) { /* a loop's: its sum in us (kvt__metrics_each) */
        if (n != 1 || sl < 8 || strncmp(stem + sl - 8, "_seconds", 8))
            return NULL;
        snprintf(buf, len, "%.*s_us_%s", (int)(sl - 8), stem, kv[1]);
    } else if (d->lbl == KVT_LBL_BUILD)
        snprintf(buf, len, "%.*s", (int)sl, stem);
    else if (lbl_is_tier(d->lbl) && !strncmp(stem, "tier_", 5))
        snprintf(buf, len, "%s_%.*s", kv[1], (int)(sl - 5), stem + 5);
    else if (n == 0)
        snprintf(buf, len, "%.*s", (int)sl, stem);
    else if (n == 1)
        snprintf(buf, len, "%.*s_%s", (int)sl, stem, kv[1]);
    else
        snprintf(buf, len, "%.*s_%s_%s", (int)sl, stem, kv[1], kv[3]);
    if (is_ratio(d)) {
        size_t bl = strlen(buf);
        snprintf(buf + bl, len - bl, "_ppm");
    }
    return buf;
}

int kvt__metrics_each(const kvt_metrics_t *m, int (*cb)(void *arg, const char *name, uint64_t v),
                      void *arg)
{
    for (unsigned id = 0; id < KVT_M_COUNT; id++) {
        const struct kvt_metric_def *d = &kvt_defs[id];
        if (d->type == KVT_MT_HISTOGRAM && d->lbl != KVT_LBL_LOOP)
            continue;
        for (unsigned s = 0; s < KVT_MAX_SERIES; s++) {
            char name[128];
            if (!shown(m, d, s) || !series_stat_name(d, s, name, sizeof name))
                continue;
            double v = m->values[id][s] * (is_ratio(d) ? 1e6 : 1);
            if (d->type == KVT_MT_HISTOGRAM) /* a loop's lock times: their sum, in us */
                v = m->hists[id][s].sum * 1e6;
            int rc = cb(arg, name, v > 0 ? (uint64_t)v : 0);
            if (rc)
                return rc;
        }
    }
    for (size_t i = 0; i < m->ntenants; i++) {
        const kvt_metric_tenant_t *t = &m->tenants[i];
        char name[128];
        snprintf(name, sizeof name, "tenant_%016llx_%s_used_bytes", (unsigned long long)t->ns_seed,
                 kvt_tier_name((kvt_tier_id_t)t->tier));
        int rc = cb(arg, name, t->bytes);
        if (rc)
            return rc;
    }
    return 0;
}

static void render_value(kvt_buf_t *b, double v)
{
    if (v == (double)(uint64_t)v && v < 1e18)
        kvt_bprintf(b, "%llu\n", (unsigned long long)v);
    else
        kvt_bprintf(b, "%.15g\n", v); /* a start time in seconds keeps its fraction */
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
        for (unsigned i = 0; d->lbl == KVT_LBL_NS && i < m->nns; i++) {
            kvt_bprintf(&b, "%s{%s} ", d->name, m->ns[i].labels);
            render_value(&b, m->ns[i].v);
        }
        for (unsigned s = 0; s < KVT_MAX_SERIES; s++) {
            char lb[96];
            const char *l = shown(m, d, s) ? series_labels(d->lbl, s, lb, sizeof lb) : NULL;
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
    for (size_t f = 0; f < KVT_ARRAY_LEN(kvt_node_families); f++) {
        const struct kvt_node_family *nf = &kvt_node_families[f];
        kvt_bprintf(&b, "# HELP %s %s\n# TYPE %s %s\n", nf->name, nf->help, nf->name,
                    nf->gauge ? "gauge" : "counter");
        for (size_t i = 0; i < m->nnodes; i++) {
            const char *p = (const char *)&m->nodes[i] + nf->off;
            uint64_t v;
            if (nf->gauge == 1)
                v = *(const uint32_t *)(const void *)p;
            else if (nf->gauge == 2)
                v = (uint64_t)(*(const int *)(const void *)p != 0);
            else
                v = *(const uint64_t *)(const void *)p;
            char addr[2 * KVT_TIER_REMOTE_ADDR_MAX + 1];
            label_value(addr, m->nodes[i].addr);
            kvt_bprintf(&b, "%s{node=\"%s\"} %llu\n", nf->name, addr, (unsigned long long)v);
        }
    }
    kvt_bprintf(&b, "# HELP %s %s\n# TYPE %s gauge\n", KVT_TENANT_NAME, KVT_TENANT_HELP,
                KVT_TENANT_NAME);
    for (size_t i = 0; i < m->ntenants; i++)
        kvt_bprintf(&b, "%s{tenant=\"%016llx\",tier=\"%s\"} %llu\n", KVT_TENANT_NAME,
                    (unsigned long long)m->tenants[i].ns_seed,
                    kvt_tier_name((kvt_tier_id_t)m->tenants[i].tier),
                    (unsigned long long)m->tenants[i].bytes);
    if (b.oom) {
        free(b.p);
        return KVT_ENOMEM;
    }
    *out = b.p;
    *len = b.len;
    return 0;
}
