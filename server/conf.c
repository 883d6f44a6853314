/*
 * conf.c: the settings table and the three ways of filling it (embedded defaults, the
 * configuration file, the command line). A setting is named once here; the parsers, --help and
 * docs/server.md all follow this table. Values are checked as they are set, so a bad line is
 * reported with its file and line number and the daemon does not start on a half-read setup.
 */
#include "conf.h"

#include "config.h" /* the build's: KVT_VERSION */

#include <ctype.h>
#include <errno.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "policy.h"
#include "proto.h"

typedef enum {
    KVT_OPT_STR,
    KVT_OPT_BYTES,
    KVT_OPT_U32,
    KVT_OPT_INT,
    KVT_OPT_BOOL,
    KVT_OPT_MODE,
    KVT_OPT_DBL,  /* > 0 */
    KVT_OPT_SHARE /* a double in [0, 1], 0 included */
} kvt_opt_type_t;

typedef struct kvt_opt {
    const char *name;
    kvt_opt_type_t type;
    size_t off;
    const char *def;
    const char *help;
} kvt_opt_t;

#define KVT_O(field) offsetof(kvt_srv_conf_t, field)

static const kvt_opt_t kvt_opts[] = {
    {"unix", KVT_OPT_STR, KVT_O(unix_path), KVT_DEFAULT_UNIX_PATH,
     "Unix socket path, relative to the working directory; \"\" disables it"},
    {"unix-mode", KVT_OPT_MODE, KVT_O(unix_mode), "0600", "permission bits of the Unix socket"},
    {"tcp", KVT_OPT_STR, KVT_O(tcp), "127.0.0.1:7390",
     "TCP listen address host:port, an IPv6 one in brackets ([::]:port: IPv4 and IPv6); \"\" "
     "disables"},
    {"metrics", KVT_OPT_STR, KVT_O(metrics), "127.0.0.1:7391",
     "HTTP address for /metrics and /healthz; \"\" disables"},
    {"data-dir", KVT_OPT_STR, KVT_O(data_dir), "kvtier-data", "directory of the NVMe tier"},
    {"dram-bytes", KVT_OPT_BYTES, KVT_O(dram_bytes), "1G", "DRAM tier capacity; 0 disables"},
    {"nvme-bytes", KVT_OPT_BYTES, KVT_O(nvme_bytes), "4G", "NVMe tier capacity; 0 disables"},
    {"hbm-bytes", KVT_OPT_BYTES, KVT_O(hbm_bytes), "1G",
     "HBM pool of each device (hbm-devices) when a GPU is usable; 0 disables"},
    {"hbm-backend", KVT_OPT_STR, KVT_O(hbm_backend), "auto",
     "auto (the GPU when one is usable, else no HBM tier), cuda (must work), or host (ordinary "
     "memory standing in for HBM, for testing)"},
    {"nvme-segment-bytes", KVT_OPT_BYTES, KVT_O(nvme_segment_bytes), "0",
     "NVMe log segment size; 0 picks the tier's default (64M)"},
    {"nvme-sparse", KVT_OPT_BOOL, KVT_O(nvme_sparse), "no",
     "do not preallocate the NVMe data file"},
    {"hbm-device", KVT_OPT_INT, KVT_O(hbm_device), "0", "CUDA device of the HBM tier"},
    {"hbm-devices", KVT_OPT_STR, KVT_O(hbm_devices), "",
     "CUDA devices with an HBM pool each, e.g. 0,1 (hbm-bytes each); a block goes to the pool of "
     "the device its client declared; \"\": the one hbm-device"},
    {"hbm-batch", KVT_OPT_U32, KVT_O(hbm_batch), "16",
     "most HBM copies submitted as one batch (1 .. 256; 1 submits each copy at once)"},
    {"remote", KVT_OPT_STR, KVT_O(remote), "",
     "Valkey/Redis server host:port of the remote tier; \"\" for none; with remote-cluster, "
     "seed nodes host:port[,host:port...]"},
    {"remote-cluster", KVT_OPT_BOOL, KVT_O(remote_cluster), "no",
     "the remote is a Redis/Valkey Cluster: remote lists seed nodes, keys go by hash slot"},
    {"remote-bytes", KVT_OPT_BYTES, KVT_O(remote_bytes), "4G", "remote tier capacity"},
    {"remote-prefix", KVT_OPT_STR, KVT_O(remote_prefix), "kvt",
     "key prefix of blocks on the remote server (keys are PREFIX:SEED:HASH)"},
    {"remote-password", KVT_OPT_STR, KVT_O(remote_password), "",
     "AUTH password of the remote server; \"\" for none"},
    {"remote-db", KVT_OPT_INT, KVT_O(remote_db), "0", "SELECT index on the remote server"},
    {"remote-ttl-s", KVT_OPT_U32, KVT_O(remote_ttl_s), "0",
     "expiry of blocks written to the remote server, seconds; 0 for none"},
    {"remote-timeout-ms", KVT_OPT_U32, KVT_O(remote_timeout_ms), "2000",
     "per-request timeout of the remote server"},
    {"nvme-recover", KVT_OPT_BOOL, KVT_O(nvme_recover), "yes",
     "warm restart: rebuild the index from the blocks found in data-dir"},
    {"max-frame", KVT_OPT_BYTES, KVT_O(max_frame), "64M",
     "largest frame body accepted; larger frames close the connection"},
    {"index-bytes", KVT_OPT_BYTES, KVT_O(index_bytes), "1G",
     "memory the prefix index may allocate; index-only pages go, least recently used first, "
     "to stay under it; 0 for no limit"},
    {"index-prefault", KVT_OPT_BYTES, KVT_O(index_prefault), "index-bytes",
     "index memory mapped and faulted in at start, so that the first requests take no page fault "
     "(at most index-bytes; the default: all of it); 0: it grows with the index, in pre-faulted "
     "steps of 2 MiB"},
    {"max-conns", KVT_OPT_U32, KVT_O(max_conns), "1024", "most client connections at once"},
    {"lease-ms", KVT_OPT_U32, KVT_O(lease_ms), "30000", "lease time limit when MATCH gives 0"},
    {"lease-ms-max", KVT_OPT_U32, KVT_O(lease_ms_max), "600000", "longest lease a client gets"},
    {"zero-copy", KVT_OPT_BOOL, KVT_O(zero_copy), "yes",
     "clients on the Unix socket may map their namespace's DRAM arena (MAP, GET LOCATE, "
     "RESERVE/COMMIT)"},
    {"zero-copy-arenas", KVT_OPT_U32, KVT_O(zero_copy_arenas), "64",
     "namespaces with a DRAM arena of their own at once (1..4096); a MAP past it gets ENOSPC"},
    {"hbm-ipc", KVT_OPT_BOOL, KVT_O(hbm_ipc), "no",
     "MAP of the HBM pool (one CUDA IPC handle opens all of it): only when every local client "
     "is one tenant"},
    {"reserve-ms", KVT_OPT_U32, KVT_O(reserve_ms), "10000",
     "a RESERVE not committed within this long is given back (1..600000)"},
    {"max-reservations", KVT_OPT_U32, KVT_O(max_reservations), "64",
     "reservations one connection may hold at once (1..65536)"},
    {"max-reserved-bytes", KVT_OPT_BYTES, KVT_O(max_resv_bytes), "1G",
     "bytes of pages one connection's reservations may hold, expired ones included, until "
     "COMMIT, ABORT or close (at least 4K); a RESERVE past it gets room for the pages that fit"},
    {"zero-copy-checksum", KVT_OPT_BOOL, KVT_O(zc_checksum), "yes",
     "a zero-copy COMMIT takes a checksum of its pages, checked when they leave DRAM (a "
     "demotion, a socket GET): a page a client wrote over after its COMMIT is dropped, never "
     "demoted or served"},
    {"tenant-hbm-bytes", KVT_OPT_BYTES, KVT_O(tenant_bytes[KVT_TIER_HBM]), "0",
     "bytes one namespace (tenant) may hold in the HBM tier; 0 for no quota"},
    {"tenant-dram-bytes", KVT_OPT_BYTES, KVT_O(tenant_bytes[KVT_TIER_DRAM]), "0",
     "bytes one namespace (tenant) may hold in the DRAM tier, its arena and reservations "
     "included: past it its PUT pages go to the next tier down, its RESERVE pages get no room, "
     "its promotions stop; 0 for no quota"},
    {"tenant-nvme-bytes", KVT_OPT_BYTES, KVT_O(tenant_bytes[KVT_TIER_NVME]), "0",
     "bytes one namespace (tenant) may hold in the NVMe tier: past it its pages are dropped "
     "instead of demoted there; 0 for no quota"},
    {"tenant-remote-bytes", KVT_OPT_BYTES, KVT_O(tenant_bytes[KVT_TIER_REMOTE]), "0",
     "bytes one namespace (tenant) may hold in the remote tier; 0 for no quota"},
    {"max-namespaces", KVT_OPT_U32, KVT_O(max_namespaces), "65536",
     "namespaces open at once (1..65536); when full, a HELLO of a new one closes the empty "
     "namespaces no client uses"},
    {"max-leases", KVT_OPT_U32, KVT_O(max_leases), "4096",
     "leases one connection may hold at once; a MATCH asking for one more gets ENOSPC"},
    {"max-inflight", KVT_OPT_U32, KVT_O(max_inflight), "64",
     "tier I/Os in flight per connection before it stops reading requests"},
    {"max-output", KVT_OPT_BYTES, KVT_O(max_output), "16M",
     "reply bytes queued per connection before it stops reading requests (64K..1G)"},
    {"socket-send-budget", KVT_OPT_BYTES, KVT_O(sock_send_budget), "8M",
     "reply bytes the kernel may hold in the send buffers of all Unix-socket and loopback TCP "
     "connections together: past budget / connections, each one's buffer (SO_SNDBUF) is cut to "
     "the largest power of two under that share, at least 64K, up to the kernel's default "
     "(TCP from another host keeps the kernel's tuning); 0: the kernel's default for each (0 or "
     "64K..1G); applies only when socket-turns is 0 (or reply-timeout-ms is 0)"},
    {"socket-turns", KVT_OPT_U32, KVT_O(socket_turns), "8",
     "per event loop, how many Unix-socket and loopback TCP connections may have a reply too big "
     "for the socket (over 64K) in the kernel at once; the others' replies wait in kvtierd, "
     "first come first served, until a connection's queue is all in the kernel; 0: every "
     "connection writes at once (socket-send-budget then applies); off while reply-timeout-ms "
     "is 0 (0..65536)"},
    {"socket-turn-stall-ms", KVT_OPT_U32, KVT_O(socket_turn_stall_ms), "5",
     "a connection holding a turn whose client has read none of what the turn put in its "
     "socket for this long, while others wait, gives its turn to the first of them and waits at "
     "the back (its client reads its connections one after another, or stopped reading); 50 ms "
     "once it has read some (1..10000)"},
    {"max-client-bytes", KVT_OPT_BYTES, KVT_O(max_client_bytes), "1G",
     "memory all connections together may hold beyond their 512 KiB input buffers: frames over "
     "that, queued replies, PUT payloads waiting for their writes (at least max-frame + 1M)"},
    {"reply-timeout-ms", KVT_OPT_U32, KVT_O(reply_timeout_ms), "60000",
     "a connection whose socket takes none of its queued replies for this long is closed; 0 for "
     "never"},
    {"hello-timeout-ms", KVT_OPT_U32, KVT_O(hello_timeout_ms), "10000",
     "a new connection whose first frame (HELLO, or AUTH) is not whole within this long is "
     "closed; 0 for never"},
    {"frame-timeout-ms", KVT_OPT_U32, KVT_O(frame_timeout_ms), "10000",
     "a frame begun must be whole within this long, or arrive at frame-min-rate, or its "
     "connection is closed and its buffer given back; 0 for never"},
    {"frame-min-rate", KVT_OPT_BYTES, KVT_O(frame_min_rate), "1M",
     "bytes per second a frame too big for one frame-timeout-ms must keep arriving at"},
    {"evict-idle-ms", KVT_OPT_U32, KVT_O(evict_idle_ms), "1000",
     "at max-conns a new connection closes the one idle longest, if idle this long with no "
     "lease and no request; 0 refuses the new one instead"},
    {"drain-ms", KVT_OPT_U32, KVT_O(drain_ms), "30000",
     "on SIGUSR1 (drain), the longest the daemon waits for its connections to give back their "
     "leases and reservations before it shuts down as on SIGTERM (1..3600000)"},
    {"loops", KVT_OPT_U32, KVT_O(loops), "1",
     "event loops serving client connections (1..16; 0: one per CPU the daemon may run on, at "
     "most 8); the store stays behind one lock (docs/architecture.md, \"Event loops\")"},
    {"tick-ms", KVT_OPT_U32, KVT_O(tick_ms), "50",
     "housekeeping interval, ms: lease and request deadlines, gauges, the index clock"},
    {"prefill-tokens-per-s", KVT_OPT_DBL, KVT_O(prefill_tokens_per_s), "20000",
     "prefill throughput the saved-seconds estimate assumes"},
    {"metrics-namespaces", KVT_OPT_U32, KVT_O(metrics_namespaces), "32",
     "(model, adapter) pairs with a kvtier_namespace_prefill_seconds_saved_total series of their "
     "own (0..1024); later ones count under model=\"_other\""},
    {"mrc", KVT_OPT_BOOL, KVT_O(mrc), "yes",
     "estimate each tier's miss-ratio curve from the lookups (kvtier_mrc_* metrics)"},
    {"mrc-sample-rate", KVT_OPT_DBL, KVT_O(mrc_sample_rate), "0.1",
     "share of the pages the miss-ratio curve samples at first (0 < rate <= 1)"},
    {"mrc-max-keys", KVT_OPT_U32, KVT_O(mrc_max_keys), "16384",
     "pages the miss-ratio curve tracks at most (64..16777216; about 72 bytes each); past it the "
     "sample rate is lowered"},
    {"policy", KVT_OPT_STR, KVT_O(policy), "cost",
     "tier policy: cost (cost-aware), lru or lfu (checked; see docs/server.md)"},
    {"policy-model", KVT_OPT_STR, KVT_O(policy_model), "llama-3-70b",
     "model profile of the cost model: llama-3-8b, llama-3-70b, qwen2.5-7b, mixtral-8x22b"},
    {"policy-hw", KVT_OPT_STR, KVT_O(policy_hw), "h200-node",
     "hardware profile of the cost model: h200-node, h200-1gpu"},
    {"policy-high", KVT_OPT_DBL, KVT_O(policy_high), "0.95",
     "high watermark: maintenance starts above this fraction of a tier's capacity"},
    {"policy-low", KVT_OPT_DBL, KVT_O(policy_low), "0.90",
     "low watermark: maintenance demotes until this fraction (0 < low <= high <= 1)"},
    {"promote-keep-share", KVT_OPT_SHARE, KVT_O(promote_keep_share), "0.25",
     "share of dram-bytes that old DRAM copies of pages promoted into HBM under a lease may "
     "hold until those leases end; 0 refuses such promotions until no lease holds the pages"},
    {"nvme-min-hits", KVT_OPT_U32, KVT_O(nvme_min_hits), "0",
     "hits a block needs before it is demoted into NVMe; 0 for none"},
    {"log-level", KVT_OPT_STR, KVT_O(log_level), "info", "debug, info, warn or error"},
    {"log-rate", KVT_OPT_U32, KVT_O(log_rate), "10",
     "lines a second each line a client can repeat (error replies, ...) may write (1..1000000); "
     "the rest are counted and the next line says how many"},
    {"secret", KVT_OPT_STR, KVT_O(secret), "",
     "shared secret clients must AUTH with before anything else; \"\" for none"},
    {"secret-file", KVT_OPT_STR, KVT_O(secret_file), "",
     "file holding the shared secret (first line), instead of secret"},
    {"auth-failures-per-s", KVT_OPT_U32, KVT_O(auth_failures_per_s), "10",
     "wrong AUTHs answered a second, all connections together (in bursts of as many); past it "
     "every AUTH answer waits its turn; 0 for no limit"},
    {"auth-wait-ms", KVT_OPT_U32, KVT_O(auth_wait_ms), "5000",
     "the longest an AUTH answer waits for auth-failures-per-s; an AUTH that would wait longer "
     "gets EAGAIN at once, its secret unchecked (1..600000)"},
};

static const kvt_opt_t *opt_find(const char *name)
{
    for (size_t i = 0; i < KVT_ARRAY_LEN(kvt_opts); i++) {
        const char *a = kvt_opts[i].name, *b = name;
        while (*a && (*a == *b || (*a == '-' && *b == '_'))) {
            a++;
            b++;
        }
        if (!*a && !*b)
            return &kvt_opts[i];
    }
    return NULL;
}

int kvt__conf_set(kvt_srv_conf_t *conf, const char *name, const char *value, char *err,
                  size_t errlen)
{
    const kvt_opt_t *o = opt_find(name);
    if (!o) {
        snprintf(err, errlen, "unknown setting '%s'", name);
        return KVT_ENOENT;
    }
    void *f = (char *)conf + o->off;
    uint64_t v;
    /* index-prefault's default follows index-bytes, whichever order the two are given in: the
     * word stands for it until kvt__conf_finish knows index-bytes. */
    if (o->off == KVT_O(index_prefault) && !strcmp(value, "index-bytes")) {
        conf->index_prefault = KVT_PREFAULT_INDEX_BYTES;
        return 0;
    }
    switch (o->type) {
    case KVT_OPT_STR: {
        char *s = strdup(value);
        if (!s)
            return KVT_ENOMEM;
        free(*(char **)f);
        *(char **)f = s;
        return 0;
    }
    case KVT_OPT_BYTES:
        if (kvt_parse_u64(value, &v, 1) < 0)
            break;
        *(uint64_t *)f = v;
        return 0;
    case KVT_OPT_U32:
        if (kvt_parse_u64(value, &v, 0) < 0 || v > UINT32_MAX)
            break;
        *(uint32_t *)f = (uint32_t)v;
        return 0;
    case KVT_OPT_INT:
        if (kvt_parse_u64(value, &v, 0) < 0 || v > 65535)
            break;
        *(int *)f = (int)v;
        return 0;
    case KVT_OPT_MODE: {
        char *end;
        errno = 0;
        unsigned long m = strtoul(value, &end, 8);
        if (errno || !*value || *end || m > 0777)
            break;
        *(uint32_t *)f = (uint32_t)m;
        return 0;
    }
    case KVT_OPT_BOOL:
        if (!strcmp(value, "yes") || !strcmp(value, "true") || !strcmp(value, "1") ||
            !strcmp(value, "on")) {
            *(int *)f = 1;
            return 0;
        }
        if (!strcmp(value, "no") || !strcmp(value, "false") || !strcmp(value, "0") ||
            !strcmp(value, "off")) {
            *(int *)f = 0;
            return 0;
        }
        break;
    case KVT_OPT_DBL: {
        char *end;
        double d = strtod(value, &end);
        if (!*value || *end || !(d > 0) || d > 1e12)
            break;
        *(double *)f = d;
        return 0;
    }
    case KVT_OPT_SHARE: {
        char *end;
        double d = strtod(value, &end);
        if (!*value || *end || !(d >= 0 && d <= 1))
            break;
        *(double *)f = d;
        return 0;
    }
    }
    snprintf(err, errlen, "bad value '%s' for %s", value, o->name);
    return KVT_EINVAL;
}

int kvt__conf_defaults(kvt_srv_conf_t *conf)
{
    char err[128];
    memset(conf, 0, sizeof *conf);
    for (size_t i = 0; i < KVT_ARRAY_LEN(kvt_opts); i++) {
        int rc = kvt__conf_set(conf, kvt_opts[i].name, kvt_opts[i].def, err, sizeof err);
        if (rc < 0) {
            kvt__conf_free(conf);
            return rc == KVT_ENOMEM ? rc : KVT_EINVAL;
        }
    }
    return 0;
}

void kvt__conf_free(kvt_srv_conf_t *conf)
{
    for (size_t i = 0; i < KVT_ARRAY_LEN(kvt_opts); i++) {
        if (kvt_opts[i].type == KVT_OPT_STR) {
            char **f = (char **)((char *)conf + kvt_opts[i].off);
            free(*f);
            *f = NULL;
        }
    }
    free(conf->config);
    conf->config = NULL;
}

static char *trim(char *s)
{
    while (isspace((unsigned char)*s))
        s++;
    char *e = s + strlen(s);
    while (e > s && isspace((unsigned char)e[-1]))
        *--e = 0;
    return s;
}

int kvt__conf_load(kvt_srv_conf_t *conf, const char *path, char *err, size_t errlen)
{
    FILE *f = fopen(path, "r");
    if (!f) {
        int e = -errno;
        snprintf(err, errlen, "%s: %s", path, strerror(-e));
        return e;
    }
    char line[4096];
    int lineno = 0, rc = 0;
    while (fgets(line, sizeof line, f)) {
        lineno++;
        if (!strchr(line, '\n') && !feof(f)) {
            snprintf(err, errlen, "%s:%d: line too long", path, lineno);
            rc = KVT_EINVAL;
            break;
        }
        char *s = trim(line);
        if (!*s || *s == '#')
            continue;
        char *eq = strchr(s, '=');
        if (!eq) {
            snprintf(err, errlen, "%s:%d: expected 'name = value'", path, lineno);
            rc = KVT_EINVAL;
            break;
        }
        *eq = 0;
        char *name = trim(s), *value = trim(eq + 1);
        if (value[0] == '"') {
            /* A quoted value runs to its closing quote; only a comment may follow it. */
            char *end = strchr(value + 1, '"');
            char *rest = end ? trim(end + 1) : NULL;
            if (!end || (*rest && *rest != '#')) {
                snprintf(err, errlen, "%s:%d: unterminated quote or text after it", path, lineno);
                rc = KVT_EINVAL;
                break;
            }
            *end = 0;
            value++;
        } else {
            /* An unquoted value ends at a '#' that follows white space (or starts it). */
            for (char *h = value; *h; h++) {
                if (*h == '#' && (h == value || h[-1] == ' ' || h[-1] == '\t')) {
                    *h = 0;
                    break;
                }
            }
            value = trim(value);
        }
        char msg[256];
        rc = kvt__conf_set(conf, name, value, msg, sizeof msg);
        if (rc < 0) {
            snprintf(err, errlen, "%s:%d: %s", path, lineno, msg);
            if (rc == KVT_ENOENT)
                rc = KVT_EINVAL;
            break;
        }
    }
    fclose(f);
    return rc;
}

void kvt__conf_usage(FILE *f)
{
    fprintf(f, "usage: kvtierd [--config FILE] [--name=value ...]\n\nsettings (also "
               "'name = value' lines in the configuration file):\n");
    for (size_t i = 0; i < KVT_ARRAY_LEN(kvt_opts); i++)
        fprintf(f, "  --%-22s %s (default \"%s\")\n", kvt_opts[i].name, kvt_opts[i].help,
                kvt_opts[i].def);
    fprintf(f, "  --%-22s %s\n  --%-22s %s\n", "config FILE", "read settings from FILE first",
            "help, --version", "print this or the version and exit");
}

int kvt__conf_args(kvt_srv_conf_t *conf, int argc, char **argv, char *err, size_t errlen)
{
    conf->argc = argc; /* for a reload (SIGHUP), which reads the same file and flags again */
    conf->argv = argv;
    /* The file first, so that every flag overrides it whatever the order on the line. */
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *path = NULL;
        if (!strcmp(a, "--config") && i + 1 < argc)
            path = argv[i + 1];
        else if (!strncmp(a, "--config=", 9))
            path = a + 9;
        if (path) {
            int rc = kvt__conf_load(conf, path, err, errlen);
            if (rc < 0)
                return rc;
            free(conf->config);
            conf->config = strdup(path);
            break;
        }
    }
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            kvt__conf_usage(stdout);
            return 1;
        }
        if (!strcmp(a, "--version")) {
            printf("kvtierd %s\n", KVT_VERSION);
            return 1;
        }
        if (strncmp(a, "--", 2) != 0) {
            snprintf(err, errlen, "unexpected argument '%s' (settings are --name=value)", a);
            return KVT_EINVAL;
        }
        char name[64];
        const char *eq = strchr(a + 2, '='), *value;
        size_t nl = eq ? (size_t)(eq - a - 2) : strlen(a + 2);
        if (nl >= sizeof name) {
            snprintf(err, errlen, "unknown flag '%s'", a);
            return KVT_EINVAL;
        }
        memcpy(name, a + 2, nl);
        name[nl] = 0;
        if (eq) {
            value = eq + 1;
        } else if (i + 1 < argc) {
            value = argv[++i];
        } else {
            snprintf(err, errlen, "flag '%s' needs a value", a);
            return KVT_EINVAL;
        }
        if (!strcmp(name, "config"))
            continue;
        int rc = kvt__conf_set(conf, name, value, err, errlen);
        if (rc < 0)
            return rc == KVT_ENOENT ? KVT_EINVAL : rc;
    }
    return 0;
}

/* hbm-devices: distinct ordinals 0 .. 65535 separated by commas, at most KVT_HBM_MAX_DEVICES;
 * empty: the one hbm-device. */
static int parse_devices(kvt_srv_conf_t *conf, char *err, size_t errlen)
{
    conf->hbm_ndevs = 0;
    const char *p = conf->hbm_devices;
    if (!*p) {
        if (conf->hbm_device < 0 || conf->hbm_device > 65535) {
            snprintf(err, errlen, "hbm-device must be between 0 and 65535");
            return KVT_EINVAL;
        }
        conf->hbm_devs[conf->hbm_ndevs++] = conf->hbm_device;
        return 0;
    }
    for (;;) {
        char *end;
        errno = 0;
        long v = strtol(p, &end, 10);
        if (end == p || *p < '0' || *p > '9' || errno || v > 65535 || (*end && *end != ',')) {
            snprintf(err, errlen,
                     "hbm-devices \"%s\": a list of CUDA device numbers (0..65535) separated by "
                     "commas, such as 0,1",
                     conf->hbm_devices);
            return KVT_EINVAL;
        }
        for (uint32_t i = 0; i < conf->hbm_ndevs; i++)
            if (conf->hbm_devs[i] == (int)v) {
                snprintf(err, errlen, "hbm-devices \"%s\" names device %ld twice",
                         conf->hbm_devices, v);
                return KVT_EINVAL;
            }
        if (conf->hbm_ndevs == KVT_HBM_MAX_DEVICES) {
            snprintf(err, errlen, "hbm-devices names more than %d devices", KVT_HBM_MAX_DEVICES);
            return KVT_EINVAL;
        }
        conf->hbm_devs[conf->hbm_ndevs++] = (int)v;
        if (!*end)
            return 0;
        p = end + 1;
    }
}

int kvt__conf_finish(kvt_srv_conf_t *conf, char *err, size_t errlen)
{
    kvt_log_level_t lvl;
    if (kvt_log_parse_level(conf->log_level, &lvl) < 0) {
        snprintf(err, errlen, "bad log-level '%s'", conf->log_level);
        return KVT_EINVAL;
    }
    if (conf->index_prefault == KVT_PREFAULT_INDEX_BYTES)
        conf->index_prefault = conf->index_bytes; /* 0, no limit: nothing to fill at start */
    if (conf->index_bytes && conf->index_prefault > conf->index_bytes) {
        snprintf(err, errlen, "index-prefault must be at most index-bytes");
        return KVT_EINVAL;
    }
    if (conf->log_rate == 0 || conf->log_rate > 1000000) {
        snprintf(err, errlen, "log-rate must be between 1 and 1000000");
        return KVT_EINVAL;
    }
    if (conf->auth_wait_ms == 0 || conf->auth_wait_ms > 600000) {
        snprintf(err, errlen, "auth-wait-ms must be between 1 and 600000");
        return KVT_EINVAL;
    }
    if (*conf->secret_file) {
        FILE *f = fopen(conf->secret_file, "r");
        if (!f) {
            snprintf(err, errlen, "secret-file %s: %s", conf->secret_file, strerror(errno));
            return KVT_EINVAL;
        }
        char line[KVT_PROTO_SECRET_MAX + 2] = "";
        if (!fgets(line, sizeof line, f))
            line[0] = 0;
        fclose(f);
        line[strcspn(line, "\r\n")] = 0;
        if (!*line) {
            snprintf(err, errlen, "secret-file %s is empty", conf->secret_file);
            return KVT_EINVAL;
        }
        free(conf->secret);
        conf->secret = strdup(line);
        if (!conf->secret)
            return KVT_ENOMEM;
    }
    if (strlen(conf->secret) > KVT_PROTO_SECRET_MAX) {
        snprintf(err, errlen, "secret longer than %d bytes", KVT_PROTO_SECRET_MAX);
        return KVT_EINVAL;
    }
    if (conf->max_frame < 4096 || conf->max_frame > (1ull << 31)) {
        snprintf(err, errlen, "max-frame must be between 4K and 2G");
        return KVT_EINVAL;
    }
    if (conf->max_conns == 0 || conf->lease_ms == 0 || conf->lease_ms > conf->lease_ms_max ||
        conf->max_inflight == 0) {
        snprintf(err, errlen,
                 "max-conns, lease-ms and max-inflight must be > 0, and lease-ms <= "
                 "lease-ms-max");
        return KVT_EINVAL;
    }
    if (parse_devices(conf, err, errlen) < 0)
        return KVT_EINVAL;
    if (conf->zero_copy_arenas == 0 || conf->zero_copy_arenas > 4096 || conf->reserve_ms == 0 ||
        conf->reserve_ms > 600000 || conf->max_reservations == 0 ||
        conf->max_reservations > 65536 || conf->max_resv_bytes < 4096) {
        snprintf(err, errlen,
                 "zero-copy-arenas must be 1..4096, reserve-ms 1..600000, max-reservations "
                 "1..65536, max-reserved-bytes at least 4K");
        return KVT_EINVAL;
    }
    if (conf->max_namespaces == 0 || conf->max_namespaces > KVT_RADIX_NS_MAX) {
        snprintf(err, errlen, "max-namespaces must be between 1 and %u", KVT_RADIX_NS_MAX);
        return KVT_EINVAL;
    }
    if (conf->metrics_namespaces > 1024) {
        snprintf(err, errlen, "metrics-namespaces must be between 0 and 1024");
        return KVT_EINVAL;
    }
    if (conf->max_leases == 0 || conf->max_leases > (1u << 20)) {
        snprintf(err, errlen, "max-leases must be between 1 and 1048576");
        return KVT_EINVAL;
    }
    if (conf->sock_send_budget != 0 &&
        (conf->sock_send_budget < (64u << 10) || conf->sock_send_budget > (1ull << 30))) {
        snprintf(err, errlen, "socket-send-budget must be 0 or between 64K and 1G");
        return KVT_EINVAL;
    }
    if (conf->socket_turns > 65536) {
        snprintf(err, errlen, "socket-turns must be between 0 and 65536");
        return KVT_EINVAL;
    }
    if (conf->socket_turn_stall_ms < 1 || conf->socket_turn_stall_ms > 10000) {
        snprintf(err, errlen, "socket-turn-stall-ms must be between 1 and 10000");
        return KVT_EINVAL;
    }
    if (conf->max_output < (64u << 10) || conf->max_output > (1ull << 30)) {
        snprintf(err, errlen, "max-output must be between 64K and 1G");
        return KVT_EINVAL;
    }
    if (conf->max_client_bytes < conf->max_frame + (1u << 20)) {
        snprintf(err, errlen, "max-client-bytes must be at least max-frame + 1M (%llu)",
                 (unsigned long long)(conf->max_frame + (1u << 20)));
        return KVT_EINVAL;
    }
    if (conf->frame_min_rate > (1ull << 30)) {
        snprintf(err, errlen, "frame-min-rate must be at most 1G (bytes per second)");
        return KVT_EINVAL;
    }
    if (conf->drain_ms == 0 || conf->drain_ms > 3600000) {
        snprintf(err, errlen, "drain-ms must be between 1 and 3600000");
        return KVT_EINVAL;
    }
    if (conf->loops > 16) {
        snprintf(err, errlen, "loops must be between 0 (one per CPU) and 16");
        return KVT_EINVAL;
    }
    if (conf->tick_ms == 0 || conf->tick_ms > 10000) {
        snprintf(err, errlen, "tick-ms must be between 1 and 10000");
        return KVT_EINVAL;
    }
    kvt_policy_kind_t kind;
    if (kvt_policy_kind_parse(conf->policy, &kind) < 0 || kind == KVT_POLICY_ORACLE) {
        /* The oracle needs the future (hint->next_use): only the replay has it. */
        snprintf(err, errlen, "bad policy '%s' (cost, lru or lfu)", conf->policy);
        return KVT_EINVAL;
    }
    kvt_model_profile_t mp;
    if (kvt_model_profile_get(conf->policy_model, &mp) < 0) {
        snprintf(err, errlen, "unknown policy-model '%s'", conf->policy_model);
        return KVT_EINVAL;
    }
    kvt_hw_profile_t hp;
    if (kvt_hw_profile_get(conf->policy_hw, &hp) < 0) {
        snprintf(err, errlen, "unknown policy-hw '%s'", conf->policy_hw);
        return KVT_EINVAL;
    }
    if (!(conf->policy_low > 0) || conf->policy_low > conf->policy_high || conf->policy_high > 1) {
        snprintf(err, errlen, "policy watermarks need 0 < policy-low <= policy-high <= 1");
        return KVT_EINVAL;
    }
    if (!(conf->mrc_sample_rate > 0 && conf->mrc_sample_rate <= 1)) {
        snprintf(err, errlen, "mrc-sample-rate needs 0 < rate <= 1");
        return KVT_EINVAL;
    }
    if (conf->mrc_max_keys < 64 || conf->mrc_max_keys > (1u << 24)) {
        snprintf(err, errlen, "mrc-max-keys needs 64 .. 16777216");
        return KVT_EINVAL;
    }
    if (!*conf->unix_path && !*conf->tcp) {
        snprintf(err, errlen, "nothing to listen on: both unix and tcp are \"\"");
        return KVT_EINVAL;
    }
    return 0;
}

void kvt__conf_apply_log(const kvt_srv_conf_t *conf)
{
    kvt_log_level_t lvl;
    if (kvt_log_parse_level(conf->log_level, &lvl) == 0) /* kvt__conf_finish checked it */
        kvt_log_set_level(lvl);
    kvt_log_set_rate(conf->log_rate);
}

/* ---- reload (SIGHUP) ---- */

/*
 * The settings a running daemon takes on a reload: each is read where it is used (a limit
 * checked per request, per move or per tick, a log setting, the secret an AUTH is checked
 * against) or is handed to the policy by the caller (policy-high, policy-low, nvme-min-hits).
 * promote-keep-share is read at each promotion's start and switch: lowered below the bytes
 * already kept, it frees none of them (a reader may still be reading them) and refuses new ones
 * until enough of those went with their leases. Everything else sizes or opens something at
 * start (tiers, sockets, the index, the arenas) and needs a restart.
 */
/* Two columns; clang-format puts an odd count one a line. */
/* clang-format off */
static const char *const kvt_reloadable[] = {
    "log-level",         "log-rate",
    "lease-ms",          "lease-ms-max",
    "reserve-ms",        "max-reservations",
    "max-leases",        "max-inflight",
    "max-output",        "max-conns",
    "max-client-bytes",  "reply-timeout-ms",
    "hello-timeout-ms",  "frame-timeout-ms",
    "frame-min-rate",    "evict-idle-ms",
    "tick-ms",           "prefill-tokens-per-s",
    "policy-high",       "policy-low",
    "nvme-min-hits",     "promote-keep-share",
    "secret",
    "secret-file",       "auth-failures-per-s",
    "auth-wait-ms",      "drain-ms",
    "tenant-hbm-bytes",  "tenant-dram-bytes",
    "tenant-nvme-bytes", "tenant-remote-bytes",
    "socket-turns",      "socket-turn-stall-ms",
};
/* clang-format on */

int kvt__conf_reloadable(const char *name)
{
    for (size_t i = 0; i < KVT_ARRAY_LEN(kvt_reloadable); i++)
        if (!strcmp(kvt_reloadable[i], name))
            return 1;
    return 0;
}

static size_t opt_size(const kvt_opt_t *o)
{
    switch (o->type) {
    case KVT_OPT_STR:
        return sizeof(char *);
    case KVT_OPT_BYTES:
        return sizeof(uint64_t);
    case KVT_OPT_U32:
    case KVT_OPT_MODE:
        return sizeof(uint32_t);
    case KVT_OPT_INT:
    case KVT_OPT_BOOL:
        return sizeof(int);
    case KVT_OPT_DBL:
    case KVT_OPT_SHARE:
        return sizeof(double);
    }
    return 0;
}

/* A string by its text; every other type by its bytes (a double here is never -0 nor NaN: the
 * parser takes only values > 0). */
static int opt_equal(const kvt_opt_t *o, const kvt_srv_conf_t *a, const kvt_srv_conf_t *b)
{
    const void *x = (const char *)a + o->off, *y = (const char *)b + o->off;
    if (o->type == KVT_OPT_STR)
        return !strcmp(*(char *const *)x, *(char *const *)y);
    return !memcmp(x, y, opt_size(o));
}

/* The value as a person wrote it, for the log: strings as they are (the secret hidden). */
static void opt_show(const kvt_opt_t *o, const kvt_srv_conf_t *c, char *buf, size_t len)
{
    const void *x = (const char *)c + o->off;
    switch (o->type) {
    case KVT_OPT_STR:
        snprintf(buf, len, "\"%s\"", strcmp(o->name, "secret") ? *(char *const *)x : "...");
        return;
    case KVT_OPT_BYTES:
        snprintf(buf, len, "%llu", (unsigned long long)*(const uint64_t *)x);
        return;
    case KVT_OPT_U32:
        snprintf(buf, len, "%u", *(const uint32_t *)x);
        return;
    case KVT_OPT_MODE:
        snprintf(buf, len, "%03o", *(const uint32_t *)x);
        return;
    case KVT_OPT_INT:
    case KVT_OPT_BOOL:
        snprintf(buf, len, "%d", *(const int *)x);
        return;
    case KVT_OPT_DBL:
    case KVT_OPT_SHARE:
        snprintf(buf, len, "%g", *(const double *)x);
        return;
    }
}

int kvt__conf_reload(kvt_srv_conf_t *cur, char *err, size_t errlen)
{
    kvt_srv_conf_t next;
    int rc = kvt__conf_defaults(&next);
    if (rc < 0)
        return rc;
    rc = kvt__conf_args(&next, cur->argc, cur->argv, err, errlen);
    if (rc == 0)
        rc = kvt__conf_finish(&next, err, errlen);
    if (rc != 0) {
        kvt__conf_free(&next);
        return rc < 0 ? rc : KVT_EINVAL;
    }
    /* Strings first, into fresh copies, so that running out of memory changes nothing. */
    char *fresh[KVT_ARRAY_LEN(kvt_opts)] = {0};
    for (size_t i = 0; i < KVT_ARRAY_LEN(kvt_opts); i++) {
        const kvt_opt_t *o = &kvt_opts[i];
        if (o->type != KVT_OPT_STR || !kvt__conf_reloadable(o->name) || opt_equal(o, cur, &next))
            continue;
        fresh[i] = strdup(*(char **)((char *)&next + o->off));
        if (!fresh[i]) {
            for (size_t j = 0; j < i; j++)
                free(fresh[j]);
            kvt__conf_free(&next);
            return KVT_ENOMEM;
        }
    }
    int changed = 0;
    for (size_t i = 0; i < KVT_ARRAY_LEN(kvt_opts); i++) {
        const kvt_opt_t *o = &kvt_opts[i];
        if (opt_equal(o, cur, &next))
            continue;
        char was[96], now[96];
        opt_show(o, cur, was, sizeof was);
        opt_show(o, &next, now, sizeof now);
        if (!kvt__conf_reloadable(o->name)) {
            kvt_log(KVT_LOG_WARN, "kvtierd: reload: %s changed to %s but needs a restart: still %s",
                    o->name, now, was);
            continue;
        }
        void *dst = (char *)cur + o->off;
        const void *src = (const char *)&next + o->off;
        if (o->type == KVT_OPT_STR) {
            free(*(char **)dst);
            *(char **)dst = fresh[i];
        } else {
            memcpy(dst, src, opt_size(o));
        }
        kvt_log(KVT_LOG_INFO, "kvtierd: reload: %s %s -> %s", o->name, was, now);
        changed++;
    }
    kvt__conf_free(&next);
    kvt__conf_apply_log(cur);
    return changed;
}
