/*
 * cli.c: the kvtier command line, a thin layer on libkvtier. It owns argument parsing (getopt_long,
 * options before or after the command, as people type them), turning token lists ("1-64 100 7")
 * into arrays, and printing replies for people, or as JSON (--json) for scripts. With no address
 * flags it talks to ./kvtierd.sock, which is where a kvtierd started with no configuration in the
 * same working directory listens. "kvtier replay ..." runs the trace replay of replay/; "kvtier
 * bench NAME ..." runs one of bench/'s benchmarks, which are programs of their own (bench_radix
 * must run on glibc's malloc, which the DRAM tier's jemalloc would replace in any program that
 * links the tiers).
 */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "config.h"

#include "kvtier.h"

#include "replay.h"

static void print_usage(FILE *f)
{
    fprintf(f, "usage: kvtier [options] COMMAND [args] [options]\n"
               "\n"
               "commands:\n"
               "  ping [COUNT]                 round trips to the daemon\n"
               "  match TOKENS... [--json]     longest cached prefix, tier per page\n"
               "  put TOKENS... [--fill BYTE]  cache the tokens; with --block-bytes also store\n"
               "                               each page's bytes (BYTE repeated, default 0xab)\n"
               "  get TOKENS... [--out FILE]   match with a lease and fetch the matched pages'\n"
               "                               bytes (to FILE, or just counted)\n"
               "  prefetch TOKENS... [--tier T] [--deadline-ms N] [--start]\n"
               "                               move the cached prefix up to tier T (hbm, dram,\n"
               "                               nvme; default dram) within N ms; --start: answered\n"
               "                               once the moves have started\n"
               "  remove TOKENS... [--nowait]  drop the last page of TOKENS and what follows;\n"
               "                               --nowait: busy (EBUSY) at once for blocks with\n"
               "                               I/O in flight, instead of waiting up to a second\n"
               "  stats [--json] [--interval S [--count N]]\n"
               "                               the daemon's counters, and its hit rate per tier;\n"
               "                               with --interval, again every S seconds (N times,\n"
               "                               default until interrupted)\n"
               "  watch [--interval S] [--count N]\n"
               "                               stats every S seconds (default 2)\n"
               "  replay ARGS...               the trace replay (kvtier replay --help)\n"
               "  bench NAME ARGS...           a benchmark, NAME radix, tiers, server, policy or\n"
               "                               recover, each beside its baseline\n"
               "                               (docs/benchmarks.md)\n"
               "\n"
               "TOKENS are numbers and ranges: 1-64 100 7 (the range 1-64 is 64 tokens).\n"
               "Options may come before or after the command, except for replay and bench,\n"
               "which take everything after their name as their own; \"--\" ends the options.\n"
               "\n"
               "options:\n"
               "  -s, --socket PATH  Unix socket (default ./kvtierd.sock; also --unix)\n"
               "  -H, --host HOST    TCP to HOST (default 127.0.0.1 with --port)\n"
               "  -p, --port PORT    TCP to PORT (default 7390 with --host)\n"
               "  --tcp HOST:PORT    TCP instead of the Unix socket\n"
               "  --secret S         shared secret (default: $KVTIER_SECRET)\n"
               "  -m, --model M      namespace model (default \"default\")\n"
               "  --adapter A, --salt S\n"
               "  --page N           tokens per page (default 16)\n"
               "  -b, --block-bytes N\n"
               "                     KV bytes per page (default 0: index only)\n"
               "  --lease-ms N       lease time limit for get (default: the daemon's)\n"
               "  --timeout-ms N     per call (default 10000)\n"
               "  -j, --json         JSON output (stats, watch and match): one object per line\n"
               "  -i, --interval S   stats: repeat every S seconds (fractions allowed)\n"
               "  -n, --count N      stats: stop after N rounds\n"
               "  -h, --help         this text\n"
               "  -V, --version      kvtier's version\n");
}

static int parse_tokens(char **args, int n, uint32_t **out, uint32_t *count)
{
    size_t cap = 1024, len = 0;
    uint32_t *t = malloc(cap * sizeof *t);
    if (!t)
        return -1;
    for (int i = 0; i < n; i++) {
        char *end;
        errno = 0;
        unsigned long a = strtoul(args[i], &end, 10), b = a;
        if (end == args[i] || errno || a > UINT32_MAX)
            goto bad;
        if (*end == '-') {
            char *e2;
            b = strtoul(end + 1, &e2, 10);
            if (e2 == end + 1 || *e2 || b < a || b > UINT32_MAX || b - a > (1u << 24))
                goto bad;
        } else if (*end) {
            goto bad;
        }
        for (unsigned long v = a; v <= b; v++) {
            if (len == cap) {
                cap *= 2;
                uint32_t *nt = realloc(t, cap * sizeof *nt);
                if (!nt) {
                    free(t);
                    return -1;
                }
                t = nt;
            }
            t[len++] = (uint32_t)v;
        }
        continue;
    bad:
        fprintf(stderr, "kvtier: bad token or range '%s'\n", args[i]);
        free(t);
        return -1;
    }
    *out = t;
    *count = (uint32_t)len;
    return 0;
}

static const char *const kvt_tier_names[] = {"none", "hbm", "dram", "nvme", "remote"};

static const char *tname(unsigned t)
{
    return t < 5 ? kvt_tier_names[t] : "?";
}

static int fail(kvt_client_t *c, const char *what, int rc)
{
    const char *msg = kvt_client_errmsg(c);
    fprintf(stderr, "kvtier: %s: %s%s%s\n", what, kvt_client_strerror(rc), *msg ? ": " : "", msg);
    return 1;
}

/* A string as a JSON string: the daemon's names are plain, but nothing here relies on it. */
static void json_str(const char *str)
{
    putchar('"');
    for (const unsigned char *p = (const unsigned char *)str; *p; p++) {
        if (*p == '"' || *p == '\\')
            printf("\\%c", *p);
        else if (*p < 0x20)
            printf("\\u%04x", *p);
        else
            putchar(*p);
    }
    putchar('"');
}

/* What the hit-rate line under the counters is made of: tier[] by KVT_CLIENT_TIER_*; and how the
 * counters are printed (json: one object, n counters so far). */
typedef struct kvt_hits {
    int json;
    unsigned n;
    uint64_t looked_up;
    uint64_t tier[KVT_CLIENT_TIER_REMOTE + 1];
    /* The miss-ratio curve (mrc_hit_ratio_TIER_SCALE_ppm): has[t] when the daemon sent tier t's */
    uint64_t mrc[KVT_CLIENT_TIER_REMOTE + 1][5], mrc_all;
    int mrc_has[KVT_CLIENT_TIER_REMOTE + 1], mrc_any;
} kvt_hits_t;

static const char *const kvt_mrc_scales[5] = {"0.25", "0.5", "1", "2", "4"};

/* mrc_hit_ratio_TIER_SCALE_ppm into h->mrc. */
static void take_mrc(kvt_hits_t *h, const char *name, uint64_t v)
{
    if (!strcmp(name, "mrc_hierarchy_hit_ratio_ppm")) {
        h->mrc_all = v;
        return;
    }
    if (strncmp(name, "mrc_hit_ratio_", 14))
        return;
    for (unsigned t = KVT_CLIENT_TIER_HBM; t <= KVT_CLIENT_TIER_REMOTE; t++) {
        size_t tl = strlen(tname(t));
        const char *rest = name + 14;
        if (strncmp(rest, tname(t), tl) || rest[tl] != '_')
            continue;
        for (unsigned k = 0; k < 5; k++) {
            size_t kl = strlen(kvt_mrc_scales[k]);
            if (!strncmp(rest + tl + 1, kvt_mrc_scales[k], kl) &&
                !strcmp(rest + tl + 1 + kl, "_ppm")) {
                h->mrc[t][k] = v;
                h->mrc_has[t] = h->mrc_any = 1;
            }
        }
    }
}

static int print_stat(void *arg, const char *name, uint64_t v)
{
    kvt_hits_t *h = arg;
    if (h->json) {
        fputs(h->n++ ? "," : "{", stdout);
        json_str(name);
        printf(":%" PRIu64, v);
    } else {
        printf("%-28s %" PRIu64 "\n", name, v);
    }
    take_mrc(h, name, v);
    if (!strcmp(name, "lookup_tokens"))
        h->looked_up = v;
    else if (!strncmp(name, "hit_tokens_", 11))
        for (unsigned t = KVT_CLIENT_TIER_HBM; t <= KVT_CLIENT_TIER_REMOTE; t++)
            if (!strcmp(name + 11, tname(t)))
                h->tier[t] = v;
    return 0;
}

/* The operator's question, answered from the counters above: what share of the looked-up tokens
 * the cache served, and from which tier. In JSON, fractions (0 to 1) under "hit_rate", null
 * before the first lookup, closing the object the counters opened. */
static void print_hit_rate(const kvt_hits_t *h)
{
    uint64_t all = 0;
    for (unsigned t = KVT_CLIENT_TIER_HBM; t <= KVT_CLIENT_TIER_REMOTE; t++)
        all += h->tier[t];
    if (h->json) {
        printf("%s\"hit_rate\":", h->n ? "," : "{");
        if (h->looked_up == 0) {
            printf("null}\n");
            return;
        }
        printf("{\"all\":%.6f", (double)all / (double)h->looked_up);
        for (unsigned t = KVT_CLIENT_TIER_HBM; t <= KVT_CLIENT_TIER_REMOTE; t++)
            printf(",\"%s\":%.6f", tname(t), (double)h->tier[t] / (double)h->looked_up);
        printf("}");
        if (h->mrc_any) {
            printf(",\"mrc\":{\"all\":%.6f", (double)h->mrc_all / 1e6);
            for (unsigned t = KVT_CLIENT_TIER_HBM; t <= KVT_CLIENT_TIER_REMOTE; t++) {
                if (!h->mrc_has[t])
                    continue;
                printf(",\"%s\":{", tname(t));
                for (unsigned k = 0; k < 5; k++)
                    printf("%s\"%s\":%.6f", k ? "," : "", kvt_mrc_scales[k],
                           (double)h->mrc[t][k] / 1e6);
                printf("}");
            }
            printf("}");
        }
        printf("}\n");
        return;
    }
    if (h->looked_up == 0) {
        printf("hit rate: no lookups yet\n");
        return;
    }
    printf("hit rate: %.1f%% of %" PRIu64 " looked-up tokens (",
           100.0 * (double)all / (double)h->looked_up, h->looked_up);
    for (unsigned t = KVT_CLIENT_TIER_HBM; t <= KVT_CLIENT_TIER_REMOTE; t++)
        printf("%s%s %.1f%%", t > KVT_CLIENT_TIER_HBM ? ", " : "", tname(t),
               100.0 * (double)h->tier[t] / (double)h->looked_up);
    printf(")\n");
    if (!h->mrc_any)
        return;
    /* The miss-ratio curve: "what would twice the DRAM buy me", a row per tier. */
    printf("if a tier were s x its size (LRU estimate, token hit ratio of that tier; all tiers "
           "now %.1f%%):\n",
           (double)h->mrc_all / 1e4);
    printf("  %-8s", "s");
    for (unsigned k = 0; k < 5; k++)
        printf(" %7sx", kvt_mrc_scales[k]);
    printf("\n");
    for (unsigned t = KVT_CLIENT_TIER_HBM; t <= KVT_CLIENT_TIER_REMOTE; t++) {
        if (!h->mrc_has[t])
            continue;
        printf("  %-8s", tname(t));
        for (unsigned k = 0; k < 5; k++)
            printf(" %7.1f%%", (double)h->mrc[t][k] / 1e4);
        printf("\n");
    }
}

/* stats, once or every interval_s seconds (count rounds; 0: until interrupted or the daemon goes
 * away). Rounds after the first are told apart by a time line in text; in JSON each round is one
 * line of its own. Returns the exit status. */
static int cmd_stats(kvt_client_t *c, int json, double interval_s, unsigned long count)
{
    for (unsigned long round = 0;; round++) {
        if (interval_s > 0 && !json) {
            time_t now = time(NULL);
            struct tm tm;
            char when[32];
            strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%SZ", gmtime_r(&now, &tm));
            printf("%s--- %s\n", round ? "\n" : "", when);
        }
        kvt_hits_t hits = {.json = json};
        int rc = kvt_client_stats(c, print_stat, &hits);
        if (rc < 0) {
            if (json && hits.n)
                printf("}\n"); /* what was printed stays one line */
            return fail(c, "stats", rc);
        }
        print_hit_rate(&hits);
        fflush(stdout);
        if (interval_s <= 0 || (count && round + 1 >= count))
            return 0;
        struct timespec ts = {.tv_sec = (time_t)interval_s};
        ts.tv_nsec = (long)((interval_s - (double)ts.tv_sec) * 1e9);
        while (nanosleep(&ts, &ts) < 0 && errno == EINTR)
            ;
    }
}

static const char *const kvt_benches[] = {"radix", "tiers", "server", "policy", "recover"};
#define KVT_NBENCHES (sizeof kvt_benches / sizeof kvt_benches[0])

/*
 * Runs bench_NAME with args: from $KVTIER_BENCH_DIR when set, else from the build tree this
 * kvtier sits in (BUILD/client/kvtier, BUILD/bench/bench_NAME), else from where `meson install`
 * put it. Returns only when it cannot.
 */
static int cmd_bench(int argc, char **argv)
{
    const char *name = argc > 0 ? argv[0] : "";
    size_t k = 0;
    while (k < KVT_NBENCHES && strcmp(name, kvt_benches[k]) != 0)
        k++;
    if (k == KVT_NBENCHES) {
        if (argc > 0)
            fprintf(stderr,
                    "kvtier: bench %s: no such benchmark (radix, tiers, server, policy, recover)\n",
                    name);
        else
            fprintf(stderr,
                    "kvtier: bench needs a NAME: radix, tiers, server, policy or recover\n");
        return 2;
    }
    char self[PATH_MAX], tree[PATH_MAX], path[PATH_MAX];
    const char *dirs[3];
    int ndirs = 0;
    if (getenv("KVTIER_BENCH_DIR"))
        dirs[ndirs++] = getenv("KVTIER_BENCH_DIR");
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    char *slash = n > 0 ? (self[n] = 0, strrchr(self, '/')) : NULL;
    if (slash) {
        *slash = 0;
        int w = snprintf(tree, sizeof tree, "%s/../bench", self);
        if (w > 0 && (size_t)w < sizeof tree)
            dirs[ndirs++] = tree;
    }
    dirs[ndirs++] = KVT_BENCHDIR;
    for (int d = 0; d < ndirs; d++) {
        int w = snprintf(path, sizeof path, "%s/bench_%s", dirs[d], name);
        if (w < 0 || (size_t)w >= sizeof path || access(path, X_OK) != 0)
            continue;
        argv[0] = path;
        execv(path, argv);
        fprintf(stderr, "kvtier: bench %s: cannot run %s: %s\n", name, path, strerror(errno));
        return 1;
    }
    fprintf(stderr, "kvtier: bench %s: bench_%s is in none of", name, name);
    for (int d = 0; d < ndirs; d++)
        fprintf(stderr, " %s", dirs[d]);
    fprintf(stderr, " (KVTIER_BENCH_DIR names another)\n");
    return 1;
}

/* A numeric option's value: digits only (0x for hex), at most max; else a message and -1. */
static int parse_num(const char *opt, const char *v, unsigned long max, unsigned long *out)
{
    char *end;
    errno = 0;
    unsigned long x = strtoul(v, &end, 0);
    if (!*v || *v == '-' || *end || errno || x > max) {
        fprintf(stderr, "kvtier: %s takes a number from 0 to %lu, not '%s'\n", opt, max, v);
        return -1;
    }
    *out = x;
    return 0;
}

/* Long options; a short letter where people expect one. The values past 255 name options that
 * have no letter. */
enum {
    OPT_TCP = 256,
    OPT_SECRET,
    OPT_ADAPTER,
    OPT_SALT,
    OPT_PAGE,
    OPT_LEASE_MS,
    OPT_TIMEOUT_MS,
    OPT_FILL,
    OPT_TIER,
    OPT_DEADLINE_MS,
    OPT_START,
    OPT_NOWAIT,
};

static const struct option kvt_longopts[] = {
    {"socket", required_argument, NULL, 's'},
    {"unix", required_argument, NULL, 's'}, /* the first spelling, kept */
    {"host", required_argument, NULL, 'H'},
    {"port", required_argument, NULL, 'p'},
    {"tcp", required_argument, NULL, OPT_TCP},
    {"secret", required_argument, NULL, OPT_SECRET},
    {"model", required_argument, NULL, 'm'},
    {"adapter", required_argument, NULL, OPT_ADAPTER},
    {"salt", required_argument, NULL, OPT_SALT},
    {"page", required_argument, NULL, OPT_PAGE},
    {"block-bytes", required_argument, NULL, 'b'},
    {"lease-ms", required_argument, NULL, OPT_LEASE_MS},
    {"timeout-ms", required_argument, NULL, OPT_TIMEOUT_MS},
    {"fill", required_argument, NULL, OPT_FILL},
    {"out", required_argument, NULL, 'o'},
    {"tier", required_argument, NULL, OPT_TIER},
    {"deadline-ms", required_argument, NULL, OPT_DEADLINE_MS},
    {"start", no_argument, NULL, OPT_START},
    {"nowait", no_argument, NULL, OPT_NOWAIT},
    {"json", no_argument, NULL, 'j'},
    {"interval", required_argument, NULL, 'i'},
    {"count", required_argument, NULL, 'n'},
    {"help", no_argument, NULL, 'h'},
    {"version", no_argument, NULL, 'V'},
    {NULL, 0, NULL, 0},
};

int main(int argc, char **argv)
{
    kvt_client_conf_t conf = {.model = "default", .page_size = 16};
    const char *out_path = NULL, *cmd = NULL, *host = NULL, *port = NULL;
    unsigned long fill = 0xab, lease_ms = 0, deadline_ms = 0, count = 0, num;
    unsigned tier = 2; /* DRAM */
    int start = 0, nowait = 0, json = 0, help = 0, version = 0, bad = 0;
    double interval_s = 0;
    char tcp[300];
    conf.secret = getenv("KVTIER_SECRET");
    /* The command's own arguments are gathered at the front of argv (never past where they were
     * read from): args[0 .. nargs). "-" at the front of the option string returns them in order
     * (as 1), whatever POSIXLY_CORRECT says, so that bench and replay can take the rest; ':'
     * tells a missing value from an unknown option. A bad value is remembered rather than fatal
     * at once, so that --help and --version work anywhere on the line. */
    char **args = argv + 1;
    int nargs = 0, opt, li = -1;
    opterr = 0;
    while ((opt = getopt_long(argc, argv, "-:s:H:p:m:b:o:ji:n:hV", kvt_longopts, &li)) != -1) {
        const char *v = optarg;
        /* The option as typed, for messages about its value. */
        char name[40];
        if (li >= 0)
            snprintf(name, sizeof name, "--%s", kvt_longopts[li].name);
        else
            snprintf(name, sizeof name, "-%c", opt);
        li = -1;
        switch (opt) {
        case 1:
            if (cmd) {
                args[nargs++] = (char *)v;
                break;
            }
            cmd = v;
            /* These two parse their own arguments. */
            if (!strcmp(cmd, "bench") && !help && !version && !bad)
                return cmd_bench(argc - optind, argv + optind);
            if (!strcmp(cmd, "replay") && !help && !version && !bad) {
                return kvt_replay_main(argc - optind + 1, argv + optind - 1);
            }
            break;
        case 'h':
            help = 1;
            break;
        case 'V':
            version = 1;
            break;
        case 's':
            conf.unix_path = v;
            break;
        case 'H':
            host = v;
            break;
        case 'p':
            port = v;
            bad |= parse_num(name, v, 65535, &num) < 0;
            break;
        case OPT_TCP:
            conf.tcp = v;
            break;
        case OPT_SECRET:
            conf.secret = v;
            break;
        case 'm':
            conf.model = v;
            break;
        case OPT_ADAPTER:
            conf.adapter = v;
            break;
        case OPT_SALT:
            conf.salt = v;
            break;
        case 'o':
            out_path = v;
            break;
        case OPT_PAGE:
            bad |= parse_num(name, v, UINT32_MAX, &num) < 0 || (conf.page_size = (uint32_t)num, 0);
            break;
        case 'b':
            bad |=
                parse_num(name, v, UINT32_MAX, &num) < 0 || (conf.block_bytes = (uint32_t)num, 0);
            break;
        case OPT_LEASE_MS:
            bad |= parse_num(name, v, UINT32_MAX, &lease_ms) < 0;
            break;
        case OPT_TIMEOUT_MS:
            bad |= parse_num(name, v, INT_MAX, &num) < 0 || (conf.timeout_ms = (int)num, 0);
            break;
        case OPT_FILL:
            bad |= parse_num(name, v, 255, &fill) < 0;
            break;
        case OPT_DEADLINE_MS:
            bad |= parse_num(name, v, UINT32_MAX, &deadline_ms) < 0;
            break;
        case OPT_START:
            start = 1;
            break;
        case OPT_NOWAIT:
            nowait = 1;
            break;
        case 'j':
            json = 1;
            break;
        case 'n':
            bad |= parse_num(name, v, ULONG_MAX, &count) < 0;
            break;
        case 'i': {
            char *end;
            errno = 0;
            interval_s = strtod(v, &end);
            /* A day at most: a typo should not look like a hang. */
            if (!*v || *end || errno || !(interval_s >= 0.01 && interval_s <= 86400)) {
                fprintf(stderr, "kvtier: %s takes seconds from 0.01 to 86400, not '%s'\n", name, v);
                bad = 1;
            }
            break;
        }
        case OPT_TIER: {
            static const char *const names[] = {"hbm", "dram", "nvme"};
            tier = 0;
            for (unsigned k = 0; k < 3; k++)
                if (!strcmp(v, names[k]))
                    tier = k + 1;
            if (!tier) {
                fprintf(stderr, "kvtier: --tier is hbm, dram or nvme, not '%s'\n", v);
                bad = 1;
            }
            break;
        }
        case ':': /* the option is the last word read */
            fprintf(stderr, "kvtier: %s needs a value\n", argv[optind - 1]);
            bad = 1;
            break;
        default: /* '?': optopt is the letter of an unknown short option, 0 for a long one */
            if (optopt)
                fprintf(stderr, "kvtier: unknown option '-%c'\n", optopt);
            else
                fprintf(stderr, "kvtier: unknown option '%s'\n", argv[optind - 1]);
            bad = 1;
            break;
        }
    }
    /* After "--", everything is the command and its arguments. */
    for (; optind < argc; optind++) {
        if (!cmd)
            cmd = argv[optind];
        else
            args[nargs++] = argv[optind];
    }
    if (help) {
        print_usage(stdout);
        return 0;
    }
    if (version) {
        printf("kvtier %s\n", KVT_VERSION);
        return 0;
    }
    if (bad)
        return 2;
    if (host || port) {
        if (conf.tcp) {
            fprintf(stderr, "kvtier: --tcp HOST:PORT, or --host and --port, not both\n");
            return 2;
        }
        /* libkvtier splits HOST:PORT at the last colon, so an IPv6 address goes in bare. */
        snprintf(tcp, sizeof tcp, "%s:%s", host ? host : "127.0.0.1", port ? port : "7390");
        conf.tcp = tcp;
    }
    if (!cmd) {
        print_usage(stderr);
        return 2;
    }
    /* The command and its tokens are checked before anything is asked of the daemon. */
    int with_tokens = !strcmp(cmd, "match") || !strcmp(cmd, "put") || !strcmp(cmd, "get") ||
                      !strcmp(cmd, "prefetch") || !strcmp(cmd, "remove");
    int watch = !strcmp(cmd, "watch"), stats = watch || !strcmp(cmd, "stats");
    if (!with_tokens && !stats && strcmp(cmd, "ping")) {
        fprintf(stderr, "kvtier: unknown command '%s'\n", cmd);
        print_usage(stderr);
        return 2;
    }
    if (json && !stats && strcmp(cmd, "match")) {
        fprintf(stderr, "kvtier: --json is for stats, watch and match\n");
        return 2;
    }
    if ((interval_s > 0 || count) && !stats) {
        fprintf(stderr, "kvtier: --interval and --count are for stats and watch\n");
        return 2;
    }
    if (stats && nargs > 0) {
        fprintf(stderr, "kvtier: %s takes no arguments ('%s')\n", cmd, args[0]);
        return 2;
    }
    if (watch && interval_s == 0)
        interval_s = 2;
    if (count && interval_s == 0) {
        fprintf(stderr, "kvtier: --count goes with --interval (or use watch)\n");
        return 2;
    }
    uint32_t *tok = NULL, ntok = 0;
    if (with_tokens && parse_tokens(args, nargs, &tok, &ntok) < 0)
        return 2;
    if (with_tokens && ntok == 0) {
        fprintf(stderr, "kvtier: %s needs token ids (numbers, or ranges such as 1-512)\n", cmd);
        free(tok);
        return 2;
    }
    unsigned long pings = 1;
    if (!strcmp(cmd, "ping") && nargs > 0 && parse_num("ping", args[0], 1000000000, &pings) < 0)
        return 2;
    kvt_client_t *c;
    int rc = kvt_client_connect(&c, &conf);
    if (rc < 0) {
        fprintf(stderr, "kvtier: cannot reach kvtierd at %s%s: %s\n",
                conf.unix_path || !conf.tcp ? "unix:" : "tcp:",
                conf.unix_path ? conf.unix_path
                : conf.tcp     ? conf.tcp
                               : "kvtierd.sock",
                kvt_client_strerror(rc));
        free(tok);
        return 1;
    }
    int status = 0;
    if (!strcmp(cmd, "ping")) {
        for (unsigned long k = 0; k < pings && !status; k++) {
            uint64_t rtt;
            if ((rc = kvt_client_ping(c, &rtt)) < 0)
                status = fail(c, "ping", rc);
            else
                printf("pong %.1f us\n", (double)rtt / 1000.0);
        }
    } else if (stats) {
        status = cmd_stats(c, json, interval_s, count);
    } else {
        uint32_t pages = ntok / conf.page_size;
        if (!strcmp(cmd, "match")) {
            uint8_t *tiers = malloc(pages + 1);
            kvt_client_match_t m = {.tiers = tiers, .tiers_cap = pages};
            if ((rc = kvt_client_match(c, tok, ntok, 0, 0, NULL, &m)) < 0) {
                status = fail(c, "match", rc);
            } else if (json) {
                printf("{\"tokens\":%u,\"matched_tokens\":%u,\"pages\":%u,\"tiers\":[", ntok,
                       m.tokens, m.pages);
                for (uint32_t p = 0; p < m.pages; p++)
                    printf("%s\"%s\"", p ? "," : "", tname(tiers[p]));
                printf("]}\n");
            } else {
                printf("matched %u of %u tokens (%u pages)\n", m.tokens, ntok, m.pages);
                for (uint32_t p = 0; p < m.pages; p++)
                    printf("  page %u: %s\n", p, tname(tiers[p]));
            }
            free(tiers);
        } else if (!strcmp(cmd, "put")) {
            uint8_t *payload = NULL;
            uint32_t np = conf.block_bytes ? pages : 0;
            if (np) {
                payload = malloc((size_t)np * conf.block_bytes);
                if (!payload) {
                    fprintf(stderr, "kvtier: out of memory\n");
                    status = 1;
                    goto out;
                }
                memset(payload, (int)fill, (size_t)np * conf.block_bytes);
            }
            kvt_client_put_t r;
            if ((rc = kvt_client_put(c, tok, ntok, 0, np, payload, NULL, &r)) < 0)
                status = fail(c, "put", rc);
            else
                printf("put %u pages: %u new, %u stored, %u skipped\n", r.pages, r.new_pages,
                       r.stored, r.skipped);
            free(payload);
        } else if (!strcmp(cmd, "get")) {
            kvt_client_match_t m = {0};
            if (!conf.block_bytes) {
                fprintf(stderr, "kvtier: get needs --block-bytes (the namespace's block size)\n");
                status = 2;
            } else if ((rc = kvt_client_match(c, tok, ntok, KVT_CLIENT_LEASE, (uint32_t)lease_ms,
                                              NULL, &m)) < 0) {
                status = fail(c, "match", rc);
            } else if (m.pages == 0) {
                printf("nothing cached for these tokens\n");
            } else {
                size_t cap = (size_t)m.pages * conf.block_bytes;
                uint8_t *buf = malloc(cap), *tiers = malloc(m.pages);
                uint32_t got = 0;
                if (!buf || !tiers) {
                    fprintf(stderr, "kvtier: out of memory\n");
                    status = 1;
                } else if ((rc = kvt_client_get(c, m.lease, 0, 0, buf, cap, &got, tiers)) < 0) {
                    status = fail(c, "get", rc);
                } else {
                    printf("got %u pages, %zu bytes\n", got, (size_t)got * conf.block_bytes);
                    for (uint32_t p = 0; p < got; p++)
                        printf("  page %u: from %s\n", p, tname(tiers[p]));
                    if (out_path) {
                        FILE *f = fopen(out_path, "wb");
                        if (!f || fwrite(buf, conf.block_bytes, got, f) != got) {
                            fprintf(stderr, "kvtier: writing %s: %s\n", out_path, strerror(errno));
                            status = 1;
                        }
                        if (f)
                            fclose(f);
                    }
                }
                kvt_client_release(c, m.lease, NULL);
                free(buf);
                free(tiers);
            }
        } else if (!strcmp(cmd, "prefetch")) {
            kvt_client_prefetch_t r;
            rc = start ? kvt_client_prefetch_start(c, tok, ntok, tier, (uint32_t)deadline_ms, &r)
                       : kvt_client_prefetch(c, tok, ntok, tier, (uint32_t)deadline_ms, &r);
            if (rc < 0)
                status = fail(c, "prefetch", rc);
            else
                printf("prefetch %u pages to %s: %u %s, %u resident, %u failed\n", r.pages,
                       tname(tier), r.moved, start ? "on their way" : "moved", r.resident,
                       r.failed);
        } else {
            rc = nowait ? kvt_client_remove_nowait(c, tok, ntok) : kvt_client_remove(c, tok, ntok);
            if (rc < 0)
                status = fail(c, "remove", rc);
            else
                printf("removed\n");
        }
    }
out:
    free(tok);
    kvt_client_close(c);
    return status;
}
