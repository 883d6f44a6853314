/*
 * replay.c: the trace replay. It owns the simulated executor (per-tier byte counts charged by
 * the policy's moves, admissions and the tree's frees), the simulated prefill clock (each hit
 * charged its tier's load time, each miss its recompute time at its depth), the future
 * knowledge the oracle and the simulated engine hints draw on, and the JSON report.
 *
 * One run = one trace x one tier configuration x one policy, over a fresh radix tree and a fresh
 * policy engine: the same code path kvtierd runs (match, on_match, insert, on_insert, step),
 * with the tree clock set to the request's timestamp in ms. No KV bytes move.
 */
#include "replay.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <sys/wait.h>
#include <unistd.h>

#include "config.h" /* KVT_SOURCE_ROOT, KVT_BENCHDIR: where the plotter is */
#include "policy.h"
#include "radix.h"
#include "trace.h"

#define MAX_RUNS             64
#define MAX_HINTS            8
#define NEVER                UINT32_MAX
#define OWNER                1
#define REMOTE_PCT           30.0
#define NWIN                 48 /* windows of the timeline (--plot, --timeline) */
#define REPLAY_CACHED_BLOCKS 4096
/* A run's hint_acc: < 0 no hints, 0..1 simulated hints of that accuracy, HINTS_TRACE the hint
 * events the trace's records carry (--trace-hints). */
#define HINTS_NONE  (-1.0)
#define HINTS_TRACE (-2.0)

/*
 * Reference policies of the replay alone (docs/policy.md, section 4, "What each part of the gap
 * is"): each reads part of the trace's future, so no engine can run one; they say how much of
 * the LRU-to-oracle gap a given piece of knowledge is worth. One runs in the engine as the
 * ORACLE kind with next uses the replay makes up, on both of the oracle's schedules, the better
 * one reported.
 *
 * REF_LRU_DEAD_FIRST ("lru-dead-first"): LRU's order, except that a page no later request uses
 * goes first. Its key is NEVER for a dead page and NEVER - 1 - i for a page request i used
 * (the later the use, the smaller the key: used "sooner", evicted later), so the oracle's rule
 * "furthest next use first, deeper first on ties" is LRU's "least recent first, deeper first on
 * ties" with the dead pages ahead. It is what knowing which sessions have ended (and which
 * pages nothing comes back to) is worth, and no more: among live pages it knows nothing.
 */
#define REF_NONE           0
#define REF_LRU_DEAD_FIRST 1
#define MAX_POLICIES       (KVT_POLICY_KIND_COUNT + 1)
static const char *const ref_names[] = {NULL, "lru-dead-first"};

typedef struct opts {
    kvt_policy_kind_t kinds[MAX_POLICIES];
    int refs[MAX_POLICIES]; /* REF_*: the run of kinds[k] is that reference (kind ORACLE) */
    int nkinds;
    kvt_model_profile_t model;
    kvt_hw_profile_t hw;
    uint32_t page_size;
    double pct[KVT_TIER_COUNT];
    uint64_t bytes[KVT_TIER_COUNT]; /* a capacity given in bytes (--dram 64G) instead of pct */
    uint8_t in_bytes[KVT_TIER_COUNT];
    int configs; /* 1 = as given, 2 = also with a remote tier added */
    double hint_acc[MAX_HINTS];
    int nhints;
    int trace_hints; /* also run the cost policy with the trace's own hint events */
    uint32_t max_prompt;
    size_t max_requests;
    uint32_t nvme_min_hits;
    int no_cost_drop;
    int expert;        /* kvt_policy_conf_t.expert */
    int oracle_demand; /* kvt_policy_conf_t.oracle_demand, set per oracle run */
    int progress;
    int verify;
    uint64_t seed;
    int timeline;   /* each result carries its hit ratio per tier per time window */
    int sweep_tier; /* --sweep TIER=A..B: that tier's capacity doubles from A to B */
    double sweep_from, sweep_to;
    int sweep_bytes; /* A and B are bytes (else percentages) */
    /* The expanded blocks every run reads its prompts through (NULL: expanded each time, where
     * the cache could not be made): every request expands its whole prompt, and in a session
     * each turn repeats the blocks of the turns before it, so most expansions are repeats. */
    kvt_trace_cache_t *blocks;
} opts_t;

/* Future knowledge of one trace, computed once. */
typedef struct future {
    uint32_t *off;    /* off[i]: first entry of request i in next[] */
    uint32_t *next;   /* request index of the next use of each whole page, NEVER for none */
    uint32_t *npages; /* whole pages of request i (after --max-prompt) */
    uint64_t unique_tokens;
    uint32_t *gaps; /* ms from a request to the next use of its last page, where there is one */
    size_t ngaps;
} future_t;

/* The simulated executor: what the tiers would hold. */
typedef struct sim {
    uint64_t used[KVT_TIER_COUNT];
    uint64_t block_bytes;
    kvt_policy_t *pol;
    int mismatch;
} sim_t;

typedef struct result {
    char trace[128];
    const char *config;
    kvt_policy_kind_t kind;
    int ref;           /* REF_*: a reference policy run as kind ORACLE */
    double hint_acc;   /* HINTS_NONE, HINTS_TRACE or a simulated accuracy */
    int oracle_demand; /* ORACLE: the schedule kept (the better of the two) */
    uint64_t requests;
    uint64_t working_set; /* tokens of the distinct whole pages: what percentages are shares of */
    uint64_t cap_tokens[KVT_TIER_COUNT];
    uint64_t cap_bytes[KVT_TIER_COUNT];
    uint64_t hit_tokens[KVT_TIER_COUNT];
    uint64_t miss_tokens, input_tokens;
    kvt_policy_stats_t st;
    double total_s, p50_s, p99_s, no_cache_s, wall_s;
    /* The timeline: the replayed span cut into NWIN windows of trace time. */
    double win_s;
    uint64_t win_in[NWIN];
    uint64_t win_hit[NWIN][KVT_TIER_COUNT];
} result_t;

/* ---- executor ------------------------------------------------------------------------------- */

static uint64_t run_size(kvt_radix_node_t *n, uint32_t depth, uint32_t npages)
{
    const kvt_block_t *bl = kvt_radix_node_blocks(n);
    uint32_t i0 = depth - kvt_radix_node_depth(n);
    uint64_t s = 0;
    for (uint32_t i = i0; i < i0 + npages; i++)
        s += bl[i].size;
    return s;
}

static int sim_move(void *arg, const kvt_policy_cause_t *why, kvt_radix_node_t *n, uint32_t depth,
                    uint32_t npages, kvt_tier_id_t from, kvt_tier_id_t to)
{
    (void)why;
    sim_t *s = arg;
    uint64_t b = run_size(n, depth, npages);
    if (s->used[from] < b) {
        s->mismatch = 1;
        return KVT_EINVAL;
    }
    s->used[from] -= b;
    s->used[to] += b;
    return 0;
}

static int sim_admit(void *arg, kvt_radix_node_t *n, uint32_t depth, uint32_t npages,
                     kvt_tier_id_t tier)
{
    (void)n;
    (void)depth;
    sim_t *s = arg;
    s->used[tier] += npages * s->block_bytes;
    return 0;
}

static void sim_free(void *arg, uint32_t ns, kvt_block_t *b, kvt_radix_why_t why)
{
    (void)why;
    sim_t *s = arg;
    if (b->tier != KVT_TIER_NONE) {
        if (s->used[b->tier] < b->size)
            s->mismatch = 1;
        else
            s->used[b->tier] -= b->size;
    }
    if (s->pol)
        kvt_policy_on_free(s->pol, ns, b);
}

static void sim_node_free(void *arg, kvt_radix_node_t *n, kvt_radix_why_t why)
{
    (void)why;
    sim_t *s = arg;
    if (s->pol)
        kvt_policy_on_node_free(s->pol, n);
}

static const kvt_policy_ops_t sim_ops = {sim_move, sim_admit};

/* ---- future knowledge ----------------------------------------------------------------------- */

static uint32_t req_tokens(const opts_t *o, const kvt_trace_req_t *r)
{
    uint32_t n = r->input_length;
    if (o->max_prompt && n > o->max_prompt)
        n = o->max_prompt;
    return n;
}

static void future_free(future_t *f)
{
    free(f->off);
    free(f->next);
    free(f->npages);
    free(f->gaps);
    memset(f, 0, sizeof(*f));
}

/*
 * A page of the radix tree is its tokens and every token before it, so the future table keys a
 * whole page by its prefix, never by a block id alone: the same id behind two different
 * prefixes (a document pasted into two conversations) is two different sets of pages in the
 * tree, and an oracle that merged them would see a next use that never comes.
 *
 * The prefix of a trace block is interned exactly (no hash to collide): a block prefix is the
 * pair (prefix of the blocks before it, this block's id), and a table maps that pair to a dense
 * index, assigned in the order prefixes first occur. A page is then (block prefix, where in the
 * block it ends). Every table is sized by the ids the trace holds, not by their values, so a
 * trace whose ids start at 10,000,000 costs what one starting at 0 does.
 */
typedef struct prefix_slot {
    uint64_t id;
    uint32_t parent; /* dense index of the prefix before this block; UINT32_MAX at the root */
    uint32_t idx;    /* dense index + 1; 0 = an empty slot */
} prefix_slot_t;

static uint32_t prefix_intern(prefix_slot_t *tab, size_t mask, uint32_t parent, uint64_t id,
                              uint32_t *count)
{
    uint64_t h = id + ((uint64_t)parent + 1) * 0x9E3779B97F4A7C15ull;
    h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9ull;
    h = (h ^ (h >> 27)) * 0x94D049BB133111EBull;
    h ^= h >> 31;
    for (size_t i = (size_t)h & mask;; i = (i + 1) & mask) {
        if (tab[i].idx == 0) {
            tab[i] = (prefix_slot_t){id, parent, ++*count};
            return *count - 1;
        }
        if (tab[i].id == id && tab[i].parent == parent)
            return tab[i].idx - 1;
    }
}

static int future_build(const opts_t *o, const kvt_trace_t *tr, size_t nreq, future_t *f)
{
    memset(f, 0, sizeof(*f));
    uint32_t ps = o->page_size;
    uint32_t per = (KVT_TRACE_BLOCK_TOKENS + ps - 1) / ps;
    size_t nblk = 0; /* block references of the replayed requests: a bound on distinct prefixes */
    for (size_t i = 0; i < nreq; i++)
        nblk += tr->reqs[i].nhash;
    if (nblk >= UINT32_MAX) {
        kvt_log(KVT_LOG_ERROR, "replay: %zu block references: too many for the future table", nblk);
        return KVT_EINVAL;
    }
    size_t cap = 1024;
    while (cap < 2 * nblk)
        cap *= 2;
    f->off = calloc(nreq + 1, sizeof(uint32_t));
    f->npages = calloc(nreq + 1, sizeof(uint32_t));
    prefix_slot_t *tab = calloc(cap, sizeof(*tab));
    uint32_t *bidx = malloc((nblk ? nblk : 1) * sizeof(uint32_t)); /* each reference's prefix */
    uint32_t *last = NULL;
    int err = KVT_ENOMEM;
    if (!f->off || !f->npages || !tab || !bidx)
        goto fail;
    uint64_t total = 0;
    uint32_t nprefix = 0;
    for (size_t i = 0, k = 0; i < nreq; i++) {
        const kvt_trace_req_t *r = &tr->reqs[i];
        uint32_t n = req_tokens(o, r);
        f->npages[i] = n / ps;
        f->off[i] = (uint32_t)total;
        total += f->npages[i];
        uint32_t parent = UINT32_MAX;
        for (uint32_t j = 0; j < r->nhash; j++, k++)
            bidx[k] = parent = prefix_intern(tab, cap - 1, parent, r->hash_ids[j], &nprefix);
    }
    free(tab);
    tab = NULL;
    err = KVT_EINVAL;
    if (total > UINT32_MAX)
        goto fail;
    f->off[nreq] = (uint32_t)total;
    err = KVT_ENOMEM;
    f->next = malloc((total ? total : 1) * sizeof(uint32_t));
    last = malloc(((size_t)nprefix * per + 1) * sizeof(uint32_t));
    if (!f->next || !last)
        goto fail;
    for (size_t s = 0; s < (size_t)nprefix * per; s++)
        last[s] = NEVER;
    /* Backwards, so that last[] holds each page's next use; a page met for the first time is
     * one more page of the working set the tree holds. */
    size_t k = nblk;
    uint64_t pages = 0;
    for (size_t i = nreq; i-- > 0;) {
        const kvt_trace_req_t *r = &tr->reqs[i];
        k -= r->nhash;
        for (uint32_t pg = 0; pg < f->npages[i]; pg++) {
            uint64_t end = (uint64_t)(pg + 1) * ps; /* one past the page's last token */
            uint64_t blk = (end - 1) / KVT_TRACE_BLOCK_TOKENS;
            uint32_t eoff = (uint32_t)(end - blk * KVT_TRACE_BLOCK_TOKENS); /* 1..512 */
            size_t slot = (size_t)bidx[k + blk] * per + (eoff - 1) / ps;
            pages += last[slot] == NEVER;
            f->next[f->off[i] + pg] = last[slot];
            last[slot] = (uint32_t)i;
        }
    }
    free(last);
    last = NULL;
    free(bidx);
    bidx = NULL;
    f->unique_tokens = pages * ps;
    f->gaps = malloc((nreq ? nreq : 1) * sizeof(uint32_t));
    if (!f->gaps)
        goto fail;
    for (size_t i = 0; i < nreq; i++) {
        if (f->npages[i] == 0)
            continue;
        uint32_t j = f->next[f->off[i] + f->npages[i] - 1];
        if (j != NEVER)
            f->gaps[f->ngaps++] = (uint32_t)KVT_MIN(
                tr->reqs[j].timestamp_ms - tr->reqs[i].timestamp_ms, (uint64_t)UINT32_MAX - 1);
    }
    return 0;
fail:
    free(tab);
    free(bidx);
    free(last);
    future_free(f);
    return err;
}

/* ---- one run -------------------------------------------------------------------------------- */

static uint64_t rng_next(uint64_t *s)
{
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static double rng_unit(uint64_t *s)
{
    return (double)(rng_next(s) >> 11) * 0x1.0p-53;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static void progress(const opts_t *o, const char *label, size_t i, size_t n, size_t *shown)
{
    if (!o->progress || n == 0)
        return;
    size_t pct = i * 100 / n;
    if (pct == *shown && i != n)
        return;
    *shown = pct;
    char bar[41];
    size_t fill = pct * 40 / 100;
    for (size_t k = 0; k < 40; k++)
        bar[k] = k < fill ? '#' : '.';
    bar[40] = '\0';
    fprintf(stderr, "\r%-40.40s [%s] %3zu%%%s", label, bar, pct, i == n ? "\n" : "");
    fflush(stderr);
}

/* The hint a simulated engine gives for request i, with the given accuracy. */
static void make_hint(const kvt_trace_t *tr, const future_t *f, size_t i, uint32_t matched,
                      double acc, uint64_t *rng, kvt_policy_hint_t *h)
{
    memset(h, 0, sizeof(*h));
    uint32_t np = f->npages[i];
    if (np == 0)
        return;
    const uint32_t *nx = f->next + f->off[i];
    uint32_t j = nx[np - 1];
    int truth_paused = j != NEVER;
    int say_paused = rng_unit(rng) < acc ? truth_paused : !truth_paused;
    if (say_paused) {
        uint64_t back = truth_paused ? tr->reqs[j].timestamp_ms - tr->reqs[i].timestamp_ms
                        : f->ngaps
                            ? f->gaps[rng_next(rng) % f->ngaps] /* a plausible, wrong pause */
                            : 60000;
        h->paused_ms = back > UINT32_MAX - 1 ? UINT32_MAX - 1 : (uint32_t)(back ? back : 1);
        h->from_page = 0;
    } else {
        h->finished = 1;
        if (!truth_paused) {
            /* the tail no later request uses: the session's own part */
            uint32_t s = np;
            while (s > 0 && nx[s - 1] == NEVER)
                s--;
            h->from_page = s;
        } else {
            h->from_page = matched;
        }
    }
}

/*
 * The hint event of request r (traces/README.md, "Engine hints"): what the engine knows when the
 * request's generation ends, sent as the connectors send it (kvtier.hints): a MATCH of the
 * prompt that counts as a use and carries the hint, applied to the deepest matched node's pages
 * (the request's own part, as kvtierd's kvt__policy_match does), under a lease released at once.
 * The replay simulates no decode time, so the event comes at the request's own timestamp,
 * before any later request: it says nothing the engine could not know then.
 */
static int trace_hint(kvt_radix_t *t, uint32_t ns, kvt_policy_t *pol, const uint32_t *tokens,
                      uint32_t n, const kvt_trace_req_t *r)
{
    kvt_match_t m;
    int err = kvt_radix_match(t, ns, tokens, n, 0, &m);
    if (err < 0 || m.pages == 0)
        return err;
    kvt_policy_hint_t h = {
        .finished = r->hint_finished,
        .paused_ms = r->hint_pause_ms,
        .from_page = kvt_radix_node_depth(m.node),
    };
    uint64_t lease = 0;
    if ((err = kvt_radix_lease(t, &m, OWNER, &lease)) < 0)
        return err;
    kvt_policy_on_match(pol, &m, &h);
    err = kvt_policy_step(pol, 0);
    kvt_radix_release(t, lease);
    return err;
}

static int run_one(const opts_t *o, const kvt_trace_t *tr, size_t nreq, const future_t *f,
                   const double pct[KVT_TIER_COUNT], kvt_policy_kind_t kind, int ref,
                   double hint_acc, result_t *res)
{
    memset(res->hit_tokens, 0, sizeof(res->hit_tokens));
    memset(res->win_in, 0, sizeof(res->win_in));
    memset(res->win_hit, 0, sizeof(res->win_hit));
    uint64_t ts0 = nreq ? tr->reqs[0].timestamp_ms : 0;
    uint64_t span = nreq ? tr->reqs[nreq - 1].timestamp_ms - ts0 + 1 : 1;
    res->win_s = (double)span / 1000.0 / NWIN;
    res->kind = kind;
    res->ref = ref;
    res->hint_acc = hint_acc;
    res->requests = nreq;
    res->working_set = f->unique_tokens;
    res->miss_tokens = res->input_tokens = 0;
    uint64_t t0 = kvt_now_ns();

    sim_t sim = {0};
    sim.block_bytes = kvt_cost_kv_bytes(&o->model, o->page_size);
    kvt_radix_conf_t rc = {.free_cb = sim_free, .node_free_cb = sim_node_free, .free_arg = &sim};
    kvt_radix_t *t = NULL;
    kvt_policy_t *pol = NULL;
    uint32_t *tokens = NULL;
    double *times = NULL;
    int err = kvt_radix_create(&t, &rc);
    if (err < 0)
        goto out;
    uint32_t ns;
    err = kvt_radix_ns_open(t, o->model.name, NULL, NULL, o->page_size, &ns);
    if (err < 0)
        goto out;

    kvt_policy_conf_t pc;
    memset(&pc, 0, sizeof(pc));
    pc.kind = kind;
    pc.model = o->model;
    pc.hw = o->hw;
    double per_token = (double)kvt_cost_kv_bytes(&o->model, 1);
    for (int ti = KVT_TIER_HBM; ti < KVT_TIER_COUNT; ti++) {
        uint64_t toks = o->in_bytes[ti] ? (uint64_t)((double)o->bytes[ti] / per_token)
                                        : (uint64_t)(pct[ti] / 100.0 * (double)f->unique_tokens);
        toks -= toks % o->page_size;
        res->cap_tokens[ti] = toks;
        res->cap_bytes[ti] = pc.tiers[ti].capacity = (uint64_t)(toks * per_token);
    }
    pc.nvme_min_hits = o->nvme_min_hits;
    pc.no_cost_drop = o->no_cost_drop;
    pc.expert = o->expert;
    pc.oracle_demand = o->oracle_demand;
    res->oracle_demand = o->oracle_demand;
    pc.reports_node_frees = 1;
    pc.ops = &sim_ops;
    pc.ops_arg = &sim;
    err = kvt_policy_create(&pol, t, &pc);
    if (err < 0)
        goto out;
    sim.pol = pol;

    uint32_t maxlen = 0;
    for (size_t i = 0; i < nreq; i++)
        maxlen = KVT_MAX(maxlen, req_tokens(o, &tr->reqs[i]));
    tokens = malloc(((size_t)maxlen + 1) * sizeof(uint32_t));
    times = malloc((nreq ? nreq : 1) * sizeof(double));
    err = KVT_ENOMEM;
    if (!tokens || !times)
        goto out;
    err = 0;

    uint64_t rng = o->seed ^ (uint64_t)kind * 0x51ED27u;
    char label[192];
    snprintf(label, sizeof(label), "%s %s %s", res->trace, res->config,
             ref ? ref_names[ref] : kvt_policy_kind_name(kind));
    size_t shown = (size_t)-1;
    double no_cache = 0, total = 0;
    uint32_t ps = o->page_size;
    uint32_t *next_clock = NULL;
    if (kind == KVT_POLICY_ORACLE) {
        next_clock = malloc(((size_t)maxlen / ps + 1) * sizeof(uint32_t));
        if (!next_clock) {
            err = KVT_ENOMEM;
            goto out;
        }
    }
    for (size_t i = 0; i < nreq; i++) {
        progress(o, label, i, nreq, &shown);
        const kvt_trace_req_t *r = &tr->reqs[i];
        uint32_t n = req_tokens(o, r);
        /* the tree clock: ms of trace time (the oracle's keys are request indices instead) */
        kvt_radix_set_clock(t, (uint32_t)r->timestamp_ms);
        kvt_trace_req_t cut = *r;
        cut.input_length = n;
        if (o->blocks)
            kvt_trace_tokens_cached(o->blocks, &cut, tokens);
        else
            kvt_trace_tokens(&cut, tokens);
        kvt_match_t m;
        err = kvt_radix_match(t, ns, tokens, n, 0, &m);
        if (err < 0)
            goto out;
        /* Charge the hit: per tier, bytes over bandwidth plus the tier's fixed latency. The
         * usable prefix stops at the first index-only block. */
        uint64_t tier_bytes[KVT_TIER_COUNT] = {0};
        uint32_t hit_pages = 0;
        kvt_path_iter_t it;
        kvt_path_iter_init(&it, m.node, m.node_pages);
        kvt_block_t *b;
        size_t w = (size_t)((r->timestamp_ms - ts0) * NWIN / span);
        while ((b = kvt_path_iter_next(&it, NULL))) {
            if (b->tier == KVT_TIER_NONE)
                break;
            tier_bytes[b->tier] += b->size;
            res->hit_tokens[b->tier] += ps;
            res->win_hit[w][b->tier] += ps;
            hit_pages++;
        }
        res->win_in[w] += n;
        double req_s = 0;
        for (int ti = KVT_TIER_HBM; ti < KVT_TIER_COUNT; ti++)
            req_s += kvt_cost_load_s(&o->hw, (kvt_tier_id_t)ti, tier_bytes[ti]);
        uint64_t hit_tok = (uint64_t)hit_pages * ps;
        req_s += kvt_cost_recompute_s(&o->model, &o->hw, hit_tok, n - hit_tok);
        no_cache += kvt_cost_recompute_s(&o->model, &o->hw, 0, n);
        res->miss_tokens += n - hit_tok;
        res->input_tokens += n;
        times[i] = req_s;
        total += req_s;

        kvt_policy_hint_t hint, *hp = NULL;
        if (kind == KVT_POLICY_ORACLE) {
            const uint32_t *nx = f->next + f->off[i];
            for (uint32_t k = 0; k < f->npages[i]; k++)
                next_clock[k] = ref != REF_LRU_DEAD_FIRST || nx[k] == NEVER
                                    ? nx[k]
                                    : NEVER - 1 - (uint32_t)i; /* LRU's order, dead first */
            memset(&hint, 0, sizeof(hint));
            hint.next_use = next_clock;
            hint.nnext = f->npages[i];
            hp = &hint;
        } else if (hint_acc >= 0) { /* simulated from the future; HINTS_TRACE: below */
            make_hint(tr, f, i, m.pages, hint_acc, &rng, &hint);
            hp = &hint;
        }
        kvt_policy_on_match(pol, &m, hp);
        uint64_t lease = 0;
        if (m.pages && (err = kvt_radix_lease(t, &m, OWNER, &lease)) < 0)
            goto out;
        kvt_insert_t ins;
        err = kvt_radix_insert_matched(t, &m, tokens, n, &ins);
        if (err == KVT_EEXIST)
            err = 0; /* a 64-bit page-key collision: the rest of this prompt is not cached */
        if (err < 0)
            goto out;
        if (ins.new_pages) {
            err = kvt_policy_on_insert(pol, &ins, hp);
            if (err < 0)
                goto out;
        }
        err = kvt_policy_step(pol, 0);
        if (err < 0)
            goto out;
        if (lease)
            kvt_radix_release(t, lease);
        if (hint_acc == HINTS_TRACE && (r->hint_pause_ms || r->hint_finished) &&
            (err = trace_hint(t, ns, pol, tokens, n, r)) < 0)
            goto out;
        if (o->verify && (i % 64 == 0 || i + 1 == nreq)) {
            err = kvt_policy_verify(pol);
            if (err == 0 && kvt_radix_verify(t) != 0)
                err = KVT_ECORRUPT;
            if (err < 0)
                goto out;
        }
    }
    progress(o, label, nreq, nreq, &shown);
    kvt_policy_stats(pol, &res->st);
    for (int ti = 0; ti < KVT_TIER_COUNT; ti++) {
        if (sim.used[ti] != res->st.used[ti])
            sim.mismatch = 1;
    }
    if (sim.mismatch) {
        kvt_log(KVT_LOG_ERROR, "replay: executor and policy disagree on tier usage");
        err = KVT_ECORRUPT;
        goto out;
    }
    if (nreq > 0)
        qsort(times, nreq, sizeof(double), cmp_double);
    res->total_s = total;
    res->no_cache_s = no_cache;
    res->p50_s = nreq ? times[(size_t)(0.50 * (double)(nreq - 1))] : 0;
    res->p99_s = nreq ? times[(size_t)(0.99 * (double)(nreq - 1))] : 0;
    free(next_clock);
out:
    res->wall_s = (double)(kvt_now_ns() - t0) / 1e9;
    sim.pol = NULL;
    kvt_policy_destroy(pol);
    kvt_radix_destroy(t);
    free(tokens);
    free(times);
    return err;
}

/* ---- report --------------------------------------------------------------------------------- */

static void print_result(FILE *f, const result_t *r, const result_t *lru, const result_t *oracle,
                         const opts_t *o)
{
    static const char *const tn[KVT_TIER_COUNT] = {"none", "hbm", "dram", "nvme", "remote"};
    fprintf(f, "{\"trace\":\"%s\",\"config\":\"%s\",\"policy\":\"%s\"", r->trace, r->config,
            r->ref ? ref_names[r->ref] : kvt_policy_kind_name(r->kind));
    if (r->ref)
        fprintf(f, ",\"reference\":true");
    if (r->hint_acc >= 0)
        fprintf(f, ",\"hint_accuracy\":%.2f", r->hint_acc);
    if (r->hint_acc == HINTS_TRACE)
        fprintf(f, ",\"hint_source\":\"trace\"");
    fprintf(f, ",\"model\":\"%s\",\"hw\":\"%s\",\"page_size\":%u,\"requests\":%llu", o->model.name,
            o->hw.name, o->page_size, (unsigned long long)r->requests);
    fprintf(f, ",\"working_set_tokens\":%llu,\"capacity_tokens\":{",
            (unsigned long long)r->working_set);
    for (int t = 1, first = 1; t < KVT_TIER_COUNT; t++) {
        fprintf(f, "%s\"%s\":%llu", first ? "" : ",", tn[t], (unsigned long long)r->cap_tokens[t]);
        first = 0;
    }
    fprintf(f, "},\"capacity_bytes\":{");
    for (int t = 1; t < KVT_TIER_COUNT; t++)
        fprintf(f, "%s\"%s\":%llu", t > 1 ? "," : "", tn[t], (unsigned long long)r->cap_bytes[t]);
    fprintf(f, "},\"input_tokens\":%llu,\"hit_tokens\":{", (unsigned long long)r->input_tokens);
    for (int t = 1; t < KVT_TIER_COUNT; t++)
        fprintf(f, "%s\"%s\":%llu", t > 1 ? "," : "", tn[t], (unsigned long long)r->hit_tokens[t]);
    fprintf(f, "},\"miss_tokens\":%llu,\"moved_bytes\":{", (unsigned long long)r->miss_tokens);
    int first = 1;
    for (int a = 1; a < KVT_TIER_COUNT; a++) {
        for (int b = 1; b < KVT_TIER_COUNT; b++) {
            if (a == b || (!r->cap_tokens[a] || !r->cap_tokens[b]))
                continue;
            fprintf(f, "%s\"%s->%s\":%llu", first ? "" : ",", tn[a], tn[b],
                    (unsigned long long)r->st.moved_bytes[a][b]);
            first = 0;
        }
    }
    uint64_t nvme_w = r->st.admitted_bytes[KVT_TIER_NVME];
    for (int a = 1; a < KVT_TIER_COUNT; a++)
        nvme_w += r->st.moved_bytes[a][KVT_TIER_NVME];
    uint64_t dropped = 0;
    for (int t = 1; t < KVT_TIER_COUNT; t++)
        dropped += r->st.dropped_bytes[t];
    fprintf(f, "},\"nvme_written_bytes\":%llu,\"dropped_bytes\":%llu,\"cost_drop_pages\":%llu",
            (unsigned long long)nvme_w, (unsigned long long)dropped,
            (unsigned long long)r->st.cost_drops);
    fprintf(f, ",\"rejected_pages\":%llu,\"final_fill\":{", (unsigned long long)r->st.rejected);
    for (int t = 1, first_t = 1; t < KVT_TIER_COUNT; t++) {
        if (!r->st.capacity[t])
            continue;
        fprintf(f, "%s\"%s\":%.3f", first_t ? "" : ",", tn[t],
                (double)r->st.used[t] / (double)r->st.capacity[t]);
        first_t = 0;
    }
    fprintf(f, "}");
    if (r->kind == KVT_POLICY_ORACLE)
        fprintf(f, ",\"oracle_schedule\":\"%s\"", r->oracle_demand ? "demand" : "bypass");
    if (r->kind == KVT_POLICY_COST) {
        static const char *const en[KVT_POLICY_EXPERTS] = {"cost", "recent", "frequent",
                                                           "cost-recent", "density"};
        fprintf(f, ",\"expert\":\"%s\",\"expert_miss_s\":{", en[r->st.expert % KVT_POLICY_EXPERTS]);
        for (int e = 0; e < KVT_POLICY_EXPERTS; e++)
            fprintf(f, "%s\"%s\":%.5f", e ? "," : "", en[e], r->st.expert_miss_s[e]);
        fprintf(f, "},\"expert_choices\":{");
        for (int e = 0; e < KVT_POLICY_EXPERTS; e++)
            fprintf(f, "%s\"%s\":%llu", e ? "," : "", en[e],
                    (unsigned long long)r->st.expert_choices[e]);
        fprintf(f, "},\"expert_uses\":{");
        for (int e = 0; e < KVT_POLICY_EXPERTS; e++)
            fprintf(f, "%s\"%s\":%llu", e ? "," : "", en[e],
                    (unsigned long long)r->st.expert_uses[e]);
        fprintf(f, "},\"expert_switches\":%llu,\"expert_real_s\":%.5f",
                (unsigned long long)r->st.expert_switches, r->st.expert_real_s);
    }
    double saving = r->no_cache_s - r->total_s;
    fprintf(f,
            ",\"prefill_seconds_total\":%.3f,\"prefill_seconds_p50\":%.6f,"
            "\"prefill_seconds_p99\":%.6f,\"prefill_seconds_no_cache\":%.3f,"
            "\"saving_vs_no_cache\":%.4f",
            r->total_s, r->p50_s, r->p99_s, r->no_cache_s,
            r->no_cache_s > 0 ? saving / r->no_cache_s : 0);
    if (lru) {
        double ls = lru->no_cache_s - lru->total_s;
        fprintf(f, ",\"saving_ratio_vs_lru\":%.4f", ls > 0 ? saving / ls : 0);
    }
    if (lru && oracle) {
        double gap = lru->total_s - oracle->total_s;
        if (fabs(gap) > 1e-12)
            fprintf(f, ",\"lru_oracle_gap_closed\":%.4f", (lru->total_s - r->total_s) / gap);
    }
    if (o->timeline) {
        fprintf(f, ",\"timeline\":{\"window_seconds\":%.3f,\"input_tokens\":[", r->win_s);
        for (int w = 0; w < NWIN; w++)
            fprintf(f, "%s%llu", w ? "," : "", (unsigned long long)r->win_in[w]);
        fprintf(f, "],\"hit_tokens\":{");
        for (int t = 1; t < KVT_TIER_COUNT; t++) {
            fprintf(f, "%s\"%s\":[", t > 1 ? "," : "", tn[t]);
            for (int w = 0; w < NWIN; w++)
                fprintf(f, "%s%llu", w ? "," : "", (unsigned long long)r->win_hit[w][t]);
            fprintf(f, "]");
        }
        fprintf(f, "}}");
    }
    /* the replay's speed (issue 40's bar: 10,000 requests/s for the cost policy); wall-clock,
     * so a loaded machine reads lower */
    fprintf(f, ",\"wall_seconds\":%.2f,\"requests_per_second\":%.0f}\n", r->wall_s,
            r->wall_s > 0 ? (double)r->requests / r->wall_s : 0.0);
    fflush(f);
}

/* ---- options -------------------------------------------------------------------------------- */

static void usage(FILE *f, const char *prog)
{
    fprintf(f,
            "usage: %s [options] TRACE.jsonl...\n"
            "Replays Mooncake traces through the radix index and the tier policy in simulated\n"
            "time; prints one JSON object per policy per trace and tier configuration.\n"
            "  --policy LIST        cost,lru,lfu,oracle (default: all four); also the\n"
            "                       reference lru-dead-first (LRU, but pages no later request\n"
            "                       uses go first: it reads the trace's future, as the\n"
            "                       oracle does)\n"
            "  --model NAME|FILE    built-in model or a key=value file (default llama-3-70b)\n"
            "  --hw NAME|FILE       built-in hardware or a key=value file (default h200-node)\n"
            "  --page-size N        tokens per page (default 16)\n"
            "  --hbm CAP --dram CAP --nvme CAP --remote CAP\n"
            "                       tier capacities: a percentage of the working set of\n"
            "                       the requests replayed (their distinct whole pages by\n"
            "                       prefix; working_set_tokens on each line), e.g. 4, or\n"
            "                       bytes of KV cache with a unit (64G, 2T, 512M)\n"
            "                       (default 1, 4, 15; remote 0 plus a second configuration\n"
            "                       with remote %.0f unless any tier flag is given)\n"
            "  --hints LIST         also run the cost policy with simulated engine hints of\n"
            "                       these accuracies, e.g. 0.5,0.8,1\n"
            "  --trace-hints        also run the cost policy with the hint events the\n"
            "                       trace's records carry (hint_pause_ms, hint_finished)\n"
            "  --max-prompt N       cut every prompt to at most N tokens\n"
            "  --requests N         replay only the first N requests (percentages are\n"
            "                       then shares of what those N requests touch)\n"
            "  --nvme-min-hits N    admission to NVMe needs N hits\n"
            "  --no-cost-drop       the cost policy demotes even when recomputing is cheaper\n"
            "  --expert NAME        the cost policy's victims in one expert's order: cost,\n"
            "                       recent, frequent, cost-recent or density (default: learned\n"
            "                       online)\n"
            "  --seed N             seed of the simulated hints (default 1)\n"
            "  --verify             check the policy's and the tree's invariants as it runs\n"
            "  --no-progress        no progress bar on stderr\n"
            "  --timeline           each result also gives its hit tokens per tier over time\n"
            "                       (%d windows of the replayed span)\n"
            "  --sweep TIER=A..B    replay at that tier's capacity A, 2A, 4A ... up to B (bytes\n"
            "                       with a unit, e.g. dram=1G..64G, or percentages), the\n"
            "                       other tiers as given: what more of that tier buys\n"
            "  --plot FILE.png      draw the results with matplotlib (python3, or\n"
            "                       $KVTIER_PYTHON): hit ratio per tier over time and prefill\n"
            "                       time per policy; with --sweep, a curve per policy\n",
            prog, REMOTE_PCT, NWIN);
}

static char *read_file(const char *path)
{
    FILE *fp = fopen(path, "r");
    if (!fp)
        return NULL;
    size_t cap = 4096, len = 0;
    char *buf = malloc(cap);
    while (buf) {
        size_t n = fread(buf + len, 1, cap - len - 1, fp);
        len += n;
        if (n == 0)
            break;
        if (len + 1 == cap) {
            char *nb = realloc(buf, cap * 2);
            if (!nb) {
                free(buf);
                buf = NULL;
                break;
            }
            buf = nb;
            cap *= 2;
        }
    }
    fclose(fp);
    if (buf)
        buf[len] = '\0';
    return buf;
}

static int load_model(const char *arg, kvt_model_profile_t *m)
{
    if (kvt_model_profile_get(arg, m) == 0)
        return 0;
    char *text = read_file(arg);
    if (!text) {
        fprintf(stderr, "replay: no built-in model or readable file '%s'\n", arg);
        return KVT_EINVAL;
    }
    int rc = kvt_model_profile_parse(text, m);
    free(text);
    return rc;
}

static int load_hw(const char *arg, kvt_hw_profile_t *hw)
{
    if (kvt_hw_profile_get(arg, hw) == 0)
        return 0;
    char *text = read_file(arg);
    if (!text) {
        fprintf(stderr, "replay: no built-in hardware or readable file '%s'\n", arg);
        return KVT_EINVAL;
    }
    int rc = kvt_hw_profile_parse(text, hw);
    free(text);
    return rc;
}

static int parse_num(const char *s, double lo, double hi, double *out)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !(v >= lo && v <= hi))
        return KVT_EINVAL;
    *out = v;
    return 0;
}

static int parse_list(const char *s, opts_t *o, int policies)
{
    char buf[256];
    if (strlen(s) >= sizeof(buf))
        return KVT_EINVAL;
    strcpy(buf, s);
    char *save = NULL;
    int n = 0;
    for (char *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        if (policies) {
            if (n >= MAX_POLICIES)
                return KVT_EINVAL;
            o->refs[n] = REF_NONE;
            if (strcmp(tok, ref_names[REF_LRU_DEAD_FIRST]) == 0) {
                o->kinds[n] = KVT_POLICY_ORACLE;
                o->refs[n] = REF_LRU_DEAD_FIRST;
            } else if (kvt_policy_kind_parse(tok, &o->kinds[n]) < 0) {
                return KVT_EINVAL;
            }
        } else {
            if (n >= MAX_HINTS || parse_num(tok, 0, 1, &o->hint_acc[n]) < 0)
                return KVT_EINVAL;
        }
        n++;
    }
    if (n == 0)
        return KVT_EINVAL;
    if (policies)
        o->nkinds = n;
    else
        o->nhints = n;
    return 0;
}

/* --sweep TIER=A..B: A and B both bytes with a unit, or both percentages; A <= B. */
static int parse_sweep(const char *v, opts_t *o)
{
    static const char *const names[] = {"hbm", "dram", "nvme", "remote"};
    const char *eq = strchr(v, '='), *dots = eq ? strstr(eq, "..") : NULL;
    if (!eq || !dots)
        return KVT_EINVAL;
    o->sweep_tier = 0;
    for (int t = 0; t < 4; t++)
        if ((size_t)(eq - v) == strlen(names[t]) && !strncmp(v, names[t], (size_t)(eq - v)))
            o->sweep_tier = KVT_TIER_HBM + t;
    char a[64], b[64];
    size_t al = (size_t)(dots - eq - 1), bl = strlen(dots + 2);
    if (!o->sweep_tier || al == 0 || al >= sizeof a || bl == 0 || bl >= sizeof b)
        return KVT_EINVAL;
    memcpy(a, eq + 1, al);
    a[al] = 0;
    memcpy(b, dots + 2, bl + 1);
    int abytes = !!isalpha((unsigned char)a[al - 1]), bbytes = !!isalpha((unsigned char)b[bl - 1]);
    if (abytes != bbytes)
        return KVT_EINVAL;
    o->sweep_bytes = abytes;
    if (abytes) {
        uint64_t x, y;
        if (kvt_parse_u64(a, &x, 1) < 0 || kvt_parse_u64(b, &y, 1) < 0)
            return KVT_EINVAL;
        o->sweep_from = (double)x;
        o->sweep_to = (double)y;
    } else if (parse_num(a, 0, 1000, &o->sweep_from) < 0 ||
               parse_num(b, 0, 1000, &o->sweep_to) < 0) {
        return KVT_EINVAL;
    }
    return o->sweep_from > 0 && o->sweep_from <= o->sweep_to ? 0 : KVT_EINVAL;
}

/* The plotter: $KVTIER_PLOT, else installed beside the benchmarks, else in the source tree. */
static const char *plotter(void)
{
    static char path[1024];
    const char *env = getenv("KVTIER_PLOT");
    if (env && *env)
        return env;
    snprintf(path, sizeof path, "%s/kvtier-plot.py", KVT_BENCHDIR);
    if (access(path, R_OK) == 0)
        return path;
    snprintf(path, sizeof path, "%s/replay/plot.py", KVT_SOURCE_ROOT);
    return path;
}

/* Runs the plotter over the results in data; returns 0 or 1 (it said why on stderr). */
static int plot(const char *prog, const char *data, const char *png)
{
    const char *py = getenv("KVTIER_PYTHON");
    if (!py || !*py)
        py = "python3";
    const char *script = plotter();
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        execlp(py, py, script, "--out", png, data, (char *)NULL);
        fprintf(stderr, "%s: --plot: cannot run %s: %s\n", prog, py, strerror(errno));
        _exit(127);
    }
    int st = 0;
    if (pid < 0 || waitpid(pid, &st, 0) < 0) {
        fprintf(stderr, "%s: --plot: cannot start the plotter: %s\n", prog, strerror(errno));
        return 1;
    }
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
        fprintf(stderr, "%s: --plot: %s %s failed (exit %d); the results above stand\n", prog, py,
                script, WIFEXITED(st) ? WEXITSTATUS(st) : -1);
        return 1;
    }
    return 0;
}

int kvt_replay_main(int argc, char **argv)
{
    const char *prog = argc > 0 ? argv[0] : "kvtier-replay";
    opts_t o;
    memset(&o, 0, sizeof(o));
    for (int k = 0; k < KVT_POLICY_KIND_COUNT; k++)
        o.kinds[k] = (kvt_policy_kind_t)k;
    o.nkinds = KVT_POLICY_KIND_COUNT;
    kvt_model_profile_get("llama-3-70b", &o.model);
    kvt_hw_profile_get("h200-node", &o.hw);
    o.page_size = 16;
    o.pct[KVT_TIER_HBM] = 1;
    o.pct[KVT_TIER_DRAM] = 4;
    o.pct[KVT_TIER_NVME] = 15;
    o.configs = 2;
    o.progress = isatty(2);
    o.seed = 1;
    int tier_flags = 0;
    const char *plot_path = NULL;
    FILE *plot_data = NULL;
    char plot_tmp[4096] = "";
    const char *traces[64];
    int ntraces = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        double d = 0;
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            usage(stdout, prog);
            return 0;
        } else if (strcmp(a, "--no-progress") == 0) {
            o.progress = 0;
        } else if (strcmp(a, "--verify") == 0) {
            o.verify = 1;
        } else if (strcmp(a, "--no-cost-drop") == 0) {
            o.no_cost_drop = 1;
        } else if (strcmp(a, "--timeline") == 0) {
            o.timeline = 1;
        } else if (strcmp(a, "--trace-hints") == 0) {
            o.trace_hints = 1;
        } else if (a[0] == '-' && a[1] == '-' && !v) {
            fprintf(stderr, "%s: %s needs a value\n", prog, a);
            return 2;
        } else if (strcmp(a, "--expert") == 0) {
            static const char *const names[KVT_POLICY_EXPERTS] = {"cost", "recent", "frequent",
                                                                  "cost-recent", "density"};
            o.expert = 0;
            for (int e = 0; e < KVT_POLICY_EXPERTS; e++)
                if (strcmp(v, names[e]) == 0)
                    o.expert = e + 1;
            if (!o.expert) {
                fprintf(
                    stderr,
                    "%s: --expert: '%s' is not cost, recent, frequent, cost-recent or density\n",
                    prog, v);
                return 2;
            }
            i++;
        } else if (strcmp(a, "--plot") == 0) {
            plot_path = v;
            o.timeline = 1;
            i++;
        } else if (strcmp(a, "--sweep") == 0) {
            if (parse_sweep(v, &o) < 0) {
                fprintf(stderr,
                        "%s: bad --sweep '%s' (TIER=A..B: dram=1G..64G, or percentages "
                        "nvme=5..40; A <= B)\n",
                        prog, v);
                return 2;
            }
            i++;
        } else if (strcmp(a, "--policy") == 0) {
            if (parse_list(v, &o, 1) < 0) {
                fprintf(stderr, "%s: bad --policy '%s' (cost,lru,lfu,oracle,lru-dead-first)\n",
                        prog, v);
                return 2;
            }
            i++;
        } else if (strcmp(a, "--hints") == 0) {
            if (parse_list(v, &o, 0) < 0) {
                fprintf(stderr, "%s: bad --hints '%s' (accuracies in [0,1])\n", prog, v);
                return 2;
            }
            i++;
        } else if (strcmp(a, "--model") == 0) {
            if (load_model(v, &o.model) < 0)
                return 2;
            i++;
        } else if (strcmp(a, "--hw") == 0) {
            if (load_hw(v, &o.hw) < 0)
                return 2;
            i++;
        } else if (strcmp(a, "--page-size") == 0) {
            if (parse_num(v, 1, KVT_PAGE_MAX, &d) < 0 || d != floor(d)) {
                fprintf(stderr, "%s: bad --page-size '%s'\n", prog, v);
                return 2;
            }
            o.page_size = (uint32_t)d;
            i++;
        } else if (strcmp(a, "--hbm") == 0 || strcmp(a, "--dram") == 0 ||
                   strcmp(a, "--nvme") == 0 || strcmp(a, "--remote") == 0) {
            int t = a[2] == 'h'   ? KVT_TIER_HBM
                    : a[2] == 'd' ? KVT_TIER_DRAM
                    : a[2] == 'n' ? KVT_TIER_NVME
                                  : KVT_TIER_REMOTE;
            /* A unit makes it bytes (64G); a bare number is a percentage. */
            size_t vl = strlen(v);
            o.in_bytes[t] = vl > 0 && isalpha((unsigned char)v[vl - 1]);
            if (o.in_bytes[t] ? kvt_parse_u64(v, &o.bytes[t], 1) < 0
                              : parse_num(v, 0, 1000, &d) < 0) {
                fprintf(stderr, "%s: bad %s '%s' (a percentage, or bytes with K, M, G or T)\n",
                        prog, a, v);
                return 2;
            }
            o.pct[t] = o.in_bytes[t] ? 0 : d;
            tier_flags = 1;
            i++;
        } else if (strcmp(a, "--max-prompt") == 0 || strcmp(a, "--requests") == 0 ||
                   strcmp(a, "--nvme-min-hits") == 0 || strcmp(a, "--seed") == 0) {
            if (parse_num(v, 0, 4e9, &d) < 0 || d != floor(d)) {
                fprintf(stderr, "%s: bad %s '%s'\n", prog, a, v);
                return 2;
            }
            if (a[2] == 'm')
                o.max_prompt = (uint32_t)d;
            else if (a[2] == 'r')
                o.max_requests = (size_t)d;
            else if (a[2] == 'n')
                o.nvme_min_hits = (uint32_t)d;
            else
                o.seed = (uint64_t)d;
            i++;
        } else if (a[0] == '-') {
            fprintf(stderr, "%s: unknown option %s\n", prog, a);
            usage(stderr, prog);
            return 2;
        } else {
            if (ntraces == (int)KVT_ARRAY_LEN(traces)) {
                fprintf(stderr, "%s: too many traces\n", prog);
                return 2;
            }
            traces[ntraces++] = a;
        }
    }
    if (ntraces == 0) {
        usage(stderr, prog);
        return 2;
    }
    if (tier_flags || o.sweep_tier)
        o.configs = 1;
    if (plot_path) {
        const char *dir = getenv("TMPDIR");
        snprintf(plot_tmp, sizeof plot_tmp, "%s/kvtier-replay-XXXXXX", dir && *dir ? dir : "/tmp");
        int fd = mkstemp(plot_tmp);
        if (fd < 0 || !(plot_data = fdopen(fd, "w"))) {
            fprintf(stderr, "%s: --plot: %s: %s\n", prog, plot_tmp, strerror(errno));
            return 1;
        }
    }
    double sum = 0;
    for (int t = KVT_TIER_HBM; t < KVT_TIER_COUNT; t++)
        sum += o.pct[t] + (double)o.bytes[t];
    if (sum <= 0) {
        fprintf(stderr, "%s: every tier has capacity 0\n", prog);
        return 2;
    }
    if (o.model.name[0] == 0 || kvt_model_profile_check(&o.model) < 0 ||
        kvt_hw_profile_check(&o.hw) < 0) {
        fprintf(stderr, "%s: bad model or hardware profile\n", prog);
        return 2;
    }
    for (int t = KVT_TIER_HBM; t < KVT_TIER_COUNT; t++) {
        if ((o.pct[t] > 0 || o.bytes[t] > 0 || (t == KVT_TIER_REMOTE && o.configs == 2)) &&
            o.hw.bw[t] <= 0) {
            fprintf(stderr, "%s: hardware '%s' has no load path from %s\n", prog, o.hw.name,
                    kvt_tier_name((kvt_tier_id_t)t));
            return 2;
        }
    }

    /* 4,096 blocks (8 MiB of tokens): the families' traces find about 87 % of their blocks
     * there, within two points of an unbounded cache (docs/policy.md, section 6). */
    if (kvt_trace_cache_create(&o.blocks, REPLAY_CACHED_BLOCKS) < 0)
        o.blocks = NULL; /* slower, the same tokens */
    int failed = 0;
    for (int ti = 0; ti < ntraces; ti++) {
        kvt_trace_t *tr = NULL;
        int rc = kvt_trace_load(&tr, traces[ti]);
        if (rc < 0) {
            fprintf(stderr, "%s: %s: %s\n", prog, traces[ti], kvt_strerror(rc));
            failed = 1;
            continue;
        }
        size_t nreq = tr->nreqs;
        if (o.max_requests && o.max_requests < nreq)
            nreq = o.max_requests;
        future_t fut;
        rc = future_build(&o, tr, nreq, &fut);
        if (rc < 0) {
            fprintf(stderr, "%s: %s: %s\n", prog, traces[ti], kvt_strerror(rc));
            kvt_trace_free(tr);
            failed = 1;
            continue;
        }
        int nsteps = o.configs;
        if (o.sweep_tier)
            for (nsteps = 1; nsteps < 32 && o.sweep_from * pow(2, nsteps) <= o.sweep_to * 1.0001;)
                nsteps++;
        for (int cfg = 0; cfg < nsteps; cfg++) {
            double pct[KVT_TIER_COUNT];
            memcpy(pct, o.pct, sizeof(pct));
            opts_t oc = o; /* this configuration's capacities */
            if (!o.sweep_tier && cfg == 1)
                pct[KVT_TIER_REMOTE] = REMOTE_PCT;
            const char *cname = o.sweep_tier     ? "sweep"
                                : o.configs == 1 ? (pct[KVT_TIER_REMOTE] > 0 ? "remote" : "local")
                                : cfg == 0       ? "local"
                                                 : "remote";
            if (o.sweep_tier) {
                double cap = o.sweep_from * pow(2, cfg);
                oc.in_bytes[o.sweep_tier] = (uint8_t)o.sweep_bytes;
                oc.bytes[o.sweep_tier] = o.sweep_bytes ? (uint64_t)cap : 0;
                pct[o.sweep_tier] = o.sweep_bytes ? 0 : cap;
            }
            result_t runs[MAX_RUNS];
            int nruns = 0, lru = -1, oracle = -1;
            for (int k = 0; k < o.nkinds + o.nhints + o.trace_hints; k++) {
                result_t *r = &runs[nruns];
                memset(r, 0, sizeof(*r));
                kvt_trace_name(tr, r->trace, sizeof(r->trace));
                r->config = cname;
                kvt_policy_kind_t kind = k < o.nkinds ? o.kinds[k] : KVT_POLICY_COST;
                int ref = k < o.nkinds ? o.refs[k] : REF_NONE;
                double acc = k < o.nkinds              ? HINTS_NONE
                             : k < o.nkinds + o.nhints ? o.hint_acc[k - o.nkinds]
                                                       : HINTS_TRACE;
                oc.oracle_demand = 0;
                rc = run_one(&oc, tr, nreq, &fut, pct, kind, ref, acc, r);
                if (rc >= 0 && kind == KVT_POLICY_ORACLE) {
                    /* The oracle is the better of two schedules with the same future knowledge,
                     * Belady with bypass and Belady on demand (docs/policy.md, "The oracle"):
                     * neither is optimal for prefill time, and each wins somewhere. A reference
                     * run as the oracle (REF_*) takes the better of its two likewise. */
                    result_t *alt = malloc(sizeof(*alt));
                    rc = alt ? 0 : KVT_ENOMEM;
                    if (alt) {
                        *alt = *r;
                        oc.oracle_demand = 1;
                        rc = run_one(&oc, tr, nreq, &fut, pct, kind, ref, acc, alt);
                        if (rc >= 0 && alt->total_s < r->total_s) {
                            double wall = r->wall_s;
                            *r = *alt;
                            r->wall_s += wall;
                        } else if (rc >= 0) {
                            r->wall_s += alt->wall_s;
                        }
                        free(alt);
                    }
                }
                if (rc < 0) {
                    fprintf(stderr, "%s: %s %s: %s\n", prog, r->trace,
                            ref ? ref_names[ref] : kvt_policy_kind_name(kind), kvt_strerror(rc));
                    failed = 1;
                    continue;
                }
                if (kind == KVT_POLICY_LRU && acc < 0)
                    lru = nruns;
                if (kind == KVT_POLICY_ORACLE && !ref)
                    oracle = nruns;
                nruns++;
            }
            for (int k = 0; k < nruns; k++) {
                print_result(stdout, &runs[k], lru >= 0 ? &runs[lru] : NULL,
                             oracle >= 0 ? &runs[oracle] : NULL, &oc);
                if (plot_data)
                    print_result(plot_data, &runs[k], lru >= 0 ? &runs[lru] : NULL,
                                 oracle >= 0 ? &runs[oracle] : NULL, &oc);
            }
        }
        future_free(&fut);
        kvt_trace_free(tr);
    }
    if (plot_data) {
        int bad = fclose(plot_data) != 0;
        if (bad)
            fprintf(stderr, "%s: --plot: %s: %s\n", prog, plot_tmp, strerror(errno));
        else if (!failed)
            bad = plot(prog, plot_tmp, plot_path);
        unlink(plot_tmp);
        failed |= bad;
    }
    kvt_trace_cache_free(o.blocks);
    return failed ? 1 : 0;
}
