/*
 * bench_index_pauses.c: the longest single insert and removal in an index whose root gains,
 * then loses, millions of children, as a daemon's does under a flood of distinct prompts. The
 * root's child table doubles past each power of two and, as children go, shrinks; the event loop
 * serves nobody while one operation runs, so the longest one is what a client can wait behind.
 *
 * The tree as kvtierd builds it (tables of 65,536 slots or more grow and shrink a step at a time,
 * radix.c) runs beside the simple version in the same run: the same tree with step_table_slots
 * past any table, so that every table is rehashed in one go. --prompts prompts of two pages, each
 * with a first page of its own, are inserted, then removed in a shuffled order, each operation
 * timed alone. Reported per tree and phase: the longest, the 99.99th percentile, how many took
 * over a millisecond, and the mean; the ratio is the simple version's longest over this one's
 * (over both phases). It runs on jemalloc with kvtierd's settings (server/main.c), as the
 * index does in the daemon: on glibc's malloc the first large free after millions of small ones
 * consolidates them all (a 645 ms removal here), which says nothing of the index. The heap's
 * transparent huge page setting ("thp") is in the output: MALLOC_CONF=thp:always runs it as
 * kvtierd ran before that was measured here (README). One JSON object on stdout, then one per
 * tree shape for the longest index trim (below; --trim-only: those alone).
 *
 * usage: bench_index_pauses [--prompts N] [--trim-only]
 */
#include <jemalloc/jemalloc.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "radix.h"
#include "bench_stats.h"

#define PAGE 16

typedef struct phase {
    double longest, p9999, mean;
    uint32_t over_1ms;
} phase_t;

static phase_t summarize(double *us, uint32_t n)
{
    phase_t p = {0};
    double sum = 0;
    for (uint32_t i = 0; i < n; i++) {
        sum += us[i];
        p.longest = us[i] > p.longest ? us[i] : p.longest;
        p.over_1ms += us[i] > 1000.0;
    }
    p.mean = sum / n;
    qsort(us, n, sizeof(*us), bench_cmp_double);
    p.p9999 = us[(size_t)((double)(n - 1) * 0.9999)];
    return p;
}

static void prompt(uint32_t *tok, uint32_t k)
{
    for (uint32_t j = 0; j < 2 * PAGE; j++)
        tok[j] = k * 2 * PAGE + j + 1;
}

/* Inserts then removes n prompts; fills ins[] and del[] with microseconds per operation. */
static void run(uint32_t step_slots, uint32_t n, const uint32_t *order, double *ins, double *del)
{
    kvt_radix_conf_t conf = {.step_table_slots = step_slots};
    kvt_radix_t *t;
    uint32_t ns;
    if (kvt_radix_create(&t, &conf) < 0 || kvt_radix_ns_open(t, "m", NULL, NULL, PAGE, &ns) < 0) {
        fprintf(stderr, "bench_index_pauses: no tree\n");
        exit(1);
    }
    uint32_t tok[2 * PAGE];
    kvt_insert_t r;
    for (uint32_t i = 0; i < n; i++) {
        prompt(tok, i);
        uint64_t t0 = kvt_now_ns();
        int rc = kvt_radix_insert(t, ns, tok, 2 * PAGE, &r);
        ins[i] = (double)(kvt_now_ns() - t0) / 1e3;
        if (rc < 0) {
            fprintf(stderr, "bench_index_pauses: insert: %s\n", kvt_strerror(rc));
            exit(1);
        }
    }
    for (uint32_t i = 0; i < n; i++) {
        prompt(tok, order[i]);
        uint64_t t0 = kvt_now_ns();
        int rc = kvt_radix_remove(t, ns, tok, PAGE);
        del[i] = (double)(kvt_now_ns() - t0) / 1e3;
        if (rc < 0) {
            fprintf(stderr, "bench_index_pauses: remove: %s\n", kvt_strerror(rc));
            exit(1);
        }
    }
    kvt_radix_destroy(t);
}

/*
 * The index trim an operation runs inline (kvtierd's kvt__index_fit, server/index.c: a PUT, or a
 * GET or PREFETCH whose pin must grow the lease table, at index-bytes) evicts up to
 * KVT_TRIM_INLINE index-only pages in one go, the maintenance step KVT_TRIM_PAGES at a time. Both
 * timed on a tree of twice that many pages, least recently used first: prompts of `pages` pages
 * of their own, under the root. Milliseconds, the median of 3.
 */
#define KVT_TRIM_INLINE 65536 /* server/index.c */
#define KVT_TRIM_PAGES  4096

static int trim_drop(void *arg, kvt_radix_node_t *n, uint32_t npages)
{
    int rc = kvt_radix_evict(arg, n, npages);
    return rc < 0 ? rc : (int)npages;
}

static double trim_ms(uint32_t pages, uint32_t budget)
{
    double ms[3];
    for (int rep = 0; rep < 3; rep++) {
        kvt_radix_t *t;
        uint32_t ns, *tok = malloc((size_t)pages * PAGE * sizeof(*tok));
        if (!tok || kvt_radix_create(&t, NULL) < 0 ||
            kvt_radix_ns_open(t, "m", NULL, NULL, PAGE, &ns) < 0) {
            fprintf(stderr, "bench_index_pauses: no tree\n");
            exit(1);
        }
        kvt_insert_t r;
        for (uint32_t k = 0; k < 2 * KVT_TRIM_INLINE / pages; k++) {
            for (uint32_t j = 0; j < pages * PAGE; j++)
                tok[j] = k * pages * PAGE + j + 1;
            kvt_radix_set_clock(t, k + 1);
            if (kvt_radix_insert(t, ns, tok, (size_t)pages * PAGE, &r) < 0) {
                fprintf(stderr, "bench_index_pauses: insert failed\n");
                exit(1);
            }
        }
        uint64_t t0 = kvt_now_ns();
        uint32_t got = kvt_radix_trim(t, 0, budget, kvt_radix_index_only, trim_drop, t);
        ms[rep] = (double)(kvt_now_ns() - t0) / 1e6;
        if (got != budget) {
            fprintf(stderr, "bench_index_pauses: trimmed %u of %u pages\n", got, budget);
            exit(1);
        }
        kvt_radix_destroy(t);
        free(tok);
    }
    double lo = ms[0] < ms[1] ? ms[0] : ms[1], hi = ms[0] < ms[1] ? ms[1] : ms[0];
    return ms[2] < lo ? lo : ms[2] > hi ? hi : ms[2];
}

static void print_trims(void)
{
    static const uint32_t shapes[] = {64, 1};
    for (size_t i = 0; i < sizeof shapes / sizeof *shapes; i++)
        printf("{\"bench\":\"index_trim\",\"prompt_pages\":%u,\"inline_pages\":%u,"
               "\"inline_ms\":%.2f,\"baseline\":\"the step's trim\",\"step_pages\":%u,"
               "\"step_ms\":%.2f}\n",
               shapes[i], KVT_TRIM_INLINE, trim_ms(shapes[i], KVT_TRIM_INLINE), KVT_TRIM_PAGES,
               trim_ms(shapes[i], KVT_TRIM_PAGES));
}

static void print_phase(const char *name, phase_t p, int comma)
{
    printf("\"%s\":{\"longest_us\":%.1f,\"p9999_us\":%.1f,\"over_1ms\":%u,\"mean_us\":%.3f}%s",
           name, p.longest, p.p9999, p.over_1ms, p.mean, comma ? "," : "");
}

int main(int argc, char **argv)
{
    uint32_t n = 2200000;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--prompts") && i + 1 < argc) {
            n = (uint32_t)strtoul(argv[++i], NULL, 10);
        } else if (!strcmp(argv[i], "--trim-only")) {
            print_trims();
            return 0;
        } else {
            fprintf(stderr, "usage: bench_index_pauses [--prompts N] [--trim-only]\n");
            return 2;
        }
    }
    if (n < 1000) {
        fprintf(stderr, "bench_index_pauses: --prompts of at least 1000\n");
        return 2;
    }
    uint32_t *order = malloc((size_t)n * sizeof(*order));
    double *ins = malloc((size_t)n * sizeof(*ins)), *del = malloc((size_t)n * sizeof(*del));
    if (!order || !ins || !del) {
        fprintf(stderr, "bench_index_pauses: out of memory\n");
        return 1;
    }
    uint64_t x = 0x9e3779b97f4a7c15ull;
    for (uint32_t i = 0; i < n; i++)
        order[i] = i;
    for (uint32_t i = n - 1; i > 0; i--) { /* Fisher-Yates, xorshift64 */
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        uint32_t j = (uint32_t)(x % (i + 1)), v = order[i];
        order[i] = order[j];
        order[j] = v;
    }
    run(0, n, order, ins, del); /* 0: the default, 65,536 slots */
    phase_t si = summarize(ins, n), sd = summarize(del, n);
    run(UINT32_MAX, n, order, ins, del);
    phase_t bi = summarize(ins, n), bd = summarize(del, n);
    double worst = si.longest > sd.longest ? si.longest : sd.longest;
    double bworst = bi.longest > bd.longest ? bi.longest : bd.longest;
    const char *thp = "unknown";
    size_t sz = sizeof thp;
    if (mallctl("opt.thp", &thp, &sz, NULL, 0) != 0 || !thp)
        thp = "unknown";
    printf("{\"bench\":\"index_pauses\",\"prompts\":%u,\"thp\":\"%s\",", n, thp);
    print_phase("insert", si, 1);
    print_phase("remove", sd, 1);
    printf("\"baseline\":\"every table rehashed in one go\",");
    print_phase("baseline_insert", bi, 1);
    print_phase("baseline_remove", bd, 1);
    printf("\"ratio\":%.2f}\n", worst > 0 ? bworst / worst : 0);
    print_trims();
    free(order);
    free(ins);
    free(del);
    return 0;
}
