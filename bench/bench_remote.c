/*
 * bench_remote.c: the remote-tier half of bench_tiers. For each block size it measures the
 * remote tier's own pipelined write (SET) and read (GET) bandwidth, driven the way the service
 * drives it (depth requests in flight, completions from the tier's fd), then runs
 * redis-benchmark SET and GET with the same value size, pipeline depth and one connection
 * against the same server as the ceiling, and prints one JSON object per (size, op) with the
 * ratio. Like the tier, the baseline works over as many distinct keys as blocks (-r n over keys
 * stored beforehand): one hot key, redis-benchmark's default, would keep the server's value in
 * cache and its memory in place, which no cache of many blocks gets. Each figure is the median of
 * BENCH_REPS runs, the two sides taking turns at going first. When no server is given it starts
 * a throwaway redis-server on a free loopback port (files under $TMPDIR) and kills it by PID.
 *
 * bench_remote_cluster_run does the same against a Redis Cluster it forms itself (3 primaries and
 * 3 replicas on loopback, as the tests' tests/test_cluster.h does), the tier in cluster mode, the
 * baseline redis-benchmark --cluster: one connection per primary on both sides (-c 3: the
 * benchmark gives each client a node), at most BENCH_DEPTH requests in flight per primary on both
 * sides, each side's depth picked untimed as its better (the tier's BENCH_DEPTH, about 4 MiB or 4
 * per primary, all spread over the three). redis-benchmark --cluster's keys carry a hash tag per
 * node
 * (-r n/3 keys each, n in all), so they cannot be stored beforehand by name: an untimed SET run of
 * 4 x n requests stores about 98% of them first. --cluster alone runs a client thread per node
 * (4 threads in all): --threads 1 gives it one I/O thread for the three connections, as the tier
 * has one loop. In cluster mode redis-benchmark's clock only
 * stops on its 250 ms progress timer, which makes a short run look slow (192 MiB at any speed
 * reads as 0.25 s): each pass there makes BENCH_CL_ROUNDS rounds over the n keys, on both sides
 * (6 GiB, about 2 s), so that the rounding costs the baseline a few percent at most.
 */
#include "bench_remote.h"
#include "bench_stats.h"

#include <errno.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <hiredis/hiredis.h>

#include "tier.h"

#define BENCH_DEPTH 16
#ifndef BENCH_REPS
#define BENCH_REPS 9
#endif
#define BENCH_BYTES      (192ull << 20) /* moved per run and size */
#define BENCH_MIN_BLOCKS 64
#define BENCH_PAGE       16
#define BENCH_CL_ROUNDS  32  /* cluster: requests a pass, in rounds over the keys (see above) */
#define BENCH_CL_BAR     0.8 /* cluster: the ratio the tier must reach */

typedef struct bench_srv {
    pid_t pid;
    char dir[256];
} bench_srv_t;

static int redis_ping(const char *host, uint16_t port)
{
    struct timeval tv = {1, 0};
    redisContext *c = redisConnectWithTimeout(host, port, tv);
    int ok = 0;
    if (c && !c->err) {
        redisReply *r = redisCommand(c, "PING");
        ok = r && r->type == REDIS_REPLY_STATUS;
        if (r)
            freeReplyObject(r);
    }
    if (c)
        redisFree(c);
    return ok;
}

static int free_port(uint16_t *port)
{
    int s = socket(AF_INET, SOCK_STREAM, 0);
    if (s < 0)
        return -errno;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t l = sizeof(a);
    int rc = 0;
    if (bind(s, (struct sockaddr *)&a, sizeof(a)) < 0 ||
        getsockname(s, (struct sockaddr *)&a, &l) < 0)
        rc = -errno;
    close(s);
    *port = ntohs(a.sin_port);
    return rc;
}

static int srv_start(bench_srv_t *srv, uint16_t *port)
{
    const char *bin = getenv("KVT_REDIS_SERVER");
    if (!bin || !*bin)
        bin = "redis-server";
    const char *tmp = getenv("TMPDIR");
    snprintf(srv->dir, sizeof(srv->dir), "%s/kvt-bench-redis-XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(srv->dir))
        return -errno;
    int rc = free_port(port);
    if (rc)
        return rc;
    char ports[16], log[300];
    snprintf(ports, sizeof(ports), "%u", *port);
    snprintf(log, sizeof(log), "%s/redis.log", srv->dir);
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid < 0)
        return -errno;
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != parent)
            _exit(1);
        execlp(bin, bin, "--port", ports, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
               "--dir", srv->dir, "--logfile", log, "--daemonize", "no", (char *)NULL);
        _exit(127);
    }
    srv->pid = pid;
    for (int i = 0; i < 300; i++) {
        if (redis_ping("127.0.0.1", *port))
            return 0;
        if (waitpid(pid, NULL, WNOHANG) == pid) {
            srv->pid = -1;
            break;
        }
        usleep(10000);
    }
    fprintf(stderr, "bench_remote: %s did not start (see %s)\n", bin, log);
    return KVT_EUNAVAIL;
}

static void srv_stop(bench_srv_t *srv)
{
    if (srv->pid > 0) {
        kill(srv->pid, SIGKILL);
        waitpid(srv->pid, NULL, 0);
        srv->pid = -1;
    }
    if (srv->dir[0]) {
        char log[300];
        snprintf(log, sizeof(log), "%s/redis.log", srv->dir);
        unlink(log);
        rmdir(srv->dir);
        srv->dir[0] = 0;
    }
}

/* --- the tier side --- */

typedef struct bslot {
    kvt_tier_io_t io;
    uint32_t tokens[BENCH_PAGE];
    uint32_t idx;
    struct brun *run;
} bslot_t;

typedef struct brun {
    kvt_tier_t *t;
    uint64_t seed;
    uint32_t len, n;
    uint32_t reqs; /* requests a pass (over the n keys in turn) */
    int depth;     /* requests in flight */
    uint32_t next, done, inflight;
    uint64_t *locs;
    int errors;
    int first_error;
} brun_t;

static void slot_done(kvt_tier_io_t *io)
{
    bslot_t *s = io->data;
    brun_t *r = s->run;
    r->done++;
    r->inflight--;
    if (io->status != 0) {
        if (!r->errors)
            r->first_error = io->status;
        r->errors++;
    } else if (io->op == KVT_IO_WRITE) {
        if (r->locs[s->idx]) /* an earlier round's write of the key */
            kvt_tier_free(r->t, r->locs[s->idx], r->len);
        r->locs[s->idx] = io->loc;
    }
    s->idx = UINT32_MAX;
}

static void slot_key(brun_t *r, bslot_t *s, uint32_t i)
{
    for (uint32_t k = 0; k < BENCH_PAGE; k++)
        s->tokens[k] = i * BENCH_PAGE + k;
    s->io.key = (kvt_block_key_t){.ns_seed = r->seed,
                                  .hash = r->seed ^ (0x9e3779b97f4a7c15ull * (i + 1)),
                                  .parent = r->seed,
                                  .tokens = s->tokens,
                                  .ntokens = BENCH_PAGE};
}

/* Runs r->reqs writes or reads over the n keys in turn, r->depth in flight; returns GB/s, or a
 * negative error. */
static double tier_pass(brun_t *r, bslot_t *slots, int write)
{
    r->next = r->done = r->inflight = 0;
    r->errors = 0;
    uint64_t t0 = kvt_now_ns();
    while (r->done < r->reqs) {
        for (int k = 0; k < r->depth && r->next < r->reqs; k++) {
            bslot_t *s = &slots[k];
            if (s->idx != UINT32_MAX)
                continue;
            uint32_t i = r->next % r->n;
            slot_key(r, s, i);
            s->idx = i;
            s->io.len = r->len;
            s->io.loc = write ? 0 : r->locs[i];
            int rc = write ? kvt_tier_write(r->t, &s->io) : kvt_tier_read(r->t, &s->io);
            if (rc) {
                s->idx = UINT32_MAX;
                return rc;
            }
            r->next++;
            r->inflight++;
        }
        int rc = kvt_tier_wait(r->t, 1000);
        if (rc < 0)
            return rc;
    }
    uint64_t dt = kvt_now_ns() - t0;
    if (r->errors) {
        fprintf(stderr, "bench_remote: %d of %u %s failed (%s)\n", r->errors, r->reqs,
                write ? "writes" : "reads", kvt_strerror(r->first_error));
        return KVT_EIO;
    }
    return (double)r->reqs * r->len / (double)dt;
}

/* Forgets the locations of the last write pass (the tier runs with keep_on_free: the values stay
 * on the server for the next pass to replace). */
static void forget_all(brun_t *r)
{
    for (uint32_t i = 0; i < r->n; i++)
        if (r->locs[i]) {
            kvt_tier_free(r->t, r->locs[i], r->len);
            r->locs[i] = 0;
        }
}

/* DELs the tier's n keys through c. */
static int del_tier_keys(brun_t *r, redisContext *c)
{
    bslot_t s;
    for (uint32_t i = 0; i < r->n; i += BENCH_DEPTH) {
        uint32_t m = KVT_MIN((uint32_t)BENCH_DEPTH, r->n - i);
        for (uint32_t k = 0; k < m; k++) {
            char key[KVT_TIER_REMOTE_KEY_MAX];
            slot_key(r, &s, i + k);
            if (kvt_tier_remote_key(r->t, s.io.key.ns_seed, s.io.key.hash, key, sizeof(key)) < 0 ||
                redisAppendCommand(c, "DEL %s", key) != REDIS_OK)
                return KVT_EIO;
        }
        for (uint32_t k = 0; k < m; k++) {
            redisReply *rep = NULL;
            if (redisGetReply(c, (void **)&rep) != REDIS_OK || !rep)
                return KVT_EIO;
            freeReplyObject(rep);
        }
    }
    return 0;
}

/* --- the baseline --- */

/* SETs (fill = 1) or DELs redis-benchmark's keys key:000000000000 .. key:<n-1>, 16 at a time. */
static int bench_keys(redisContext *c, uint32_t n, const void *val, size_t size, int fill)
{
    for (uint32_t i = 0; i < n; i += BENCH_DEPTH) {
        uint32_t m = KVT_MIN((uint32_t)BENCH_DEPTH, n - i);
        for (uint32_t k = 0; k < m; k++) {
            char key[32];
            snprintf(key, sizeof(key), "key:%012u", i + k);
            int rc = fill ? redisAppendCommand(c, "SET %s %b", key, val, size)
                          : redisAppendCommand(c, "DEL %s", key);
            if (rc != REDIS_OK)
                return KVT_EIO;
        }
        for (uint32_t k = 0; k < m; k++) {
            redisReply *r = NULL;
            if (redisGetReply(c, (void **)&r) != REDIS_OK || !r || r->type == REDIS_REPLY_ERROR) {
                if (r)
                    freeReplyObject(r);
                return KVT_EIO;
            }
            freeReplyObject(r);
        }
    }
    return 0;
}

/* What a run measures against: one server (c: a connection to it, which stores the baseline's
 * keys beforehand and deletes both sides' keys after) or a cluster (c NULL; the cluster is the
 * benchmark's own: each primary is flushed after). conns: connections on each side. */
typedef struct btarget {
    const char *host;
    uint16_t port;
    redisContext *c;
    int cluster;
    int conns;
    const uint16_t *primaries;
    int nprimaries;
} btarget_t;

/* Runs redis-benchmark SET or GET, reqs requests over the n keys key:<0 .. n-1> (random order,
 * -r n, which the caller has stored first: so that, like the tier's, every GET returns a value
 * of size bytes and every SET replaces one, rather than one hot key over and over), depth
 * pipelined per connection; returns requests/s. */
static double redis_benchmark(const btarget_t *tg, const char *test, size_t size, uint32_t reqs,
                              uint32_t n, int depth)
{
    /* --cluster: each node has a key space of its own (a hash tag per node), -r keys each. */
    if (tg->cluster)
        n = KVT_MAX(1u, n / (uint32_t)tg->conns);
    char cmd[512];
    snprintf(cmd, sizeof(cmd),
             "redis-benchmark -h %s -p %u -t %s -d %zu -n %u -r %u -P %d -c %d%s --csv 2>/dev/null",
             tg->host, tg->port, test, size, reqs, n, depth, tg->conns,
             tg->cluster ? " --cluster --threads 1" : "");
    FILE *f = popen(cmd, "r");
    if (!f)
        return -errno;
    char line[512];
    int set = !strcmp(test, "set");
    double rps = 0;
    while (fgets(line, sizeof(line), f)) {
        double v;
        int got = set ? sscanf(line, "\"SET\",\"%lf\"", &v) : sscanf(line, "\"GET\",\"%lf\"", &v);
        if (got == 1)
            rps = v;
    }
    int st = pclose(f);
    if (st != 0 || rps <= 0) {
        fprintf(stderr, "bench_remote: redis-benchmark failed (status %d): %s\n", st, cmd);
        return KVT_EIO;
    }
    return rps;
}

/* FLUSHALL on every primary of the benchmark's own cluster. */
static int flush_cluster(const btarget_t *tg)
{
    int rc = 0;
    for (int i = 0; i < tg->nprimaries; i++) {
        struct timeval tv = {10, 0};
        redisContext *c = redisConnectWithTimeout(tg->host, tg->primaries[i], tv);
        redisReply *r = c && !c->err ? redisCommand(c, "FLUSHALL") : NULL;
        if (!r || r->type == REDIS_REPLY_ERROR)
            rc = KVT_EIO;
        if (r)
            freeReplyObject(r);
        if (c)
            redisFree(c);
    }
    return rc;
}

static int bench_size(kvt_tier_t *t, const btarget_t *tg, size_t size)
{
    if (size == 0 || size > KVT_TIER_MAX_BLOCK)
        return KVT_EINVAL;
    uint32_t n = (uint32_t)KVT_MAX((uint64_t)BENCH_MIN_BLOCKS, BENCH_BYTES / size);
    uint32_t reqs = tg->cluster ? BENCH_CL_ROUNDS * n : n;
    int nslots = BENCH_DEPTH * tg->conns;
    brun_t r = {.t = t, .len = (uint32_t)size, .n = n, .reqs = n, .depth = nslots};
    r.locs = calloc(n, sizeof(*r.locs));
    bslot_t *slots = calloc((size_t)nslots, sizeof(*slots));
    if (!r.locs || !slots) {
        free(r.locs);
        free(slots);
        return KVT_ENOMEM;
    }
    int rc = 0;
    for (int k = 0; k < nslots; k++) {
        slots[k].idx = UINT32_MAX;
        slots[k].run = &r;
        slots[k].io.cb = slot_done;
        slots[k].io.data = &slots[k];
        if (!(slots[k].io.buf = malloc(size))) {
            rc = KVT_ENOMEM;
            goto out;
        }
        uint8_t *p = slots[k].io.buf;
        for (size_t i = 0; i < size; i++)
            p[i] = (uint8_t)(i * 131 + (size_t)k * 7 + (i >> 12));
    }
    /* Untimed: store every key once on both sides, so that each timed pass replaces values in
     * place, as a cache in steady state does (and redis-benchmark -r over stored keys does). */
    r.seed = kvt_now_ns() ^ ((uint64_t)getpid() << 40);
    double w0 = tier_pass(&r, slots, 1);
    if (w0 < 0) {
        rc = (int)w0;
        goto out;
    }
    r.reqs = reqs;
    if (tg->cluster ? redis_benchmark(tg, "set", size, 4 * n, n, BENCH_DEPTH) < 0
                    : (rc = bench_keys(tg->c, n, slots[0].io.buf, size, 1)) != 0) {
        rc = rc ? rc : KVT_EIO;
        goto out;
    }
    /* redis-benchmark waits for a whole batch of -P replies before sending more, which with big
     * values starves the server: its better of our depth and ~4 MiB per batch is the ceiling.
     * Which one is picked once, untimed, by the median of three runs of each, taking turns (SET
     * and GET apart); the timed passes then run that depth only, one sample a pass like the tier:
     * taking the better of two noisy samples in every pass would lift the baseline by the noise
     * itself. */
    int depths[2] = {BENCH_DEPTH, (int)KVT_MAX(1, (4u << 20) / size)};
    int dset = depths[0], dget = depths[0];
    if (depths[1] != depths[0]) {
        double s[2][3], g2[2][3];
        for (int k = 0; k < 3; k++)
            for (int d = 0; d < 2; d++) {
                s[d][k] = redis_benchmark(tg, "set", size, reqs, n, depths[d]);
                g2[d][k] = redis_benchmark(tg, "get", size, reqs, n, depths[d]);
                if (s[d][k] < 0 || g2[d][k] < 0) {
                    rc = KVT_EIO;
                    goto out;
                }
            }
        dset = depths[bench_median(s[1], 3) > bench_median(s[0], 3)];
        dget = depths[bench_median(g2[1], 3) > bench_median(g2[0], 3)];
    }
    /* Against the cluster the tier's depth is picked the same way, among the same kinds of
     * depth: BENCH_DEPTH per connection, about 4 MiB per connection (what the baseline may pick),
     * and 4 per connection. At 2 MiB the baseline keeps 2 values per connection in flight where
     * the tier kept 16 (96 MiB in flight over three primaries, far past the caches its copies and
     * checksums run in). The single server's passes (192 MiB, tens of ms) are too short for three
     * runs to pick by: there the tier keeps BENCH_DEPTH, as its recorded runs did. */
    int tdepths[3] = {nslots, (int)KVT_MAX(1, (4u << 20) / size) * tg->conns, 4 * tg->conns};
    int tw = nslots, tr = nslots;
    {
        double sw[3][3], sr[3][3];
        int nd = 0, cand[3];
        for (int d = 0; d < 3; d++) {
            int dup = 0;
            for (int e = 0; e < nd; e++)
                dup |= cand[e] == tdepths[d];
            if (!dup && tdepths[d] <= nslots && (tg->cluster || d == 0))
                cand[nd++] = tdepths[d];
        }
        for (int k = 0; k < 3 && nd > 1; k++)
            for (int d = 0; d < nd; d++) {
                r.depth = cand[d];
                forget_all(&r);
                sw[d][k] = tier_pass(&r, slots, 1);
                sr[d][k] = sw[d][k] < 0 ? sw[d][k] : tier_pass(&r, slots, 0);
                if (sw[d][k] < 0 || sr[d][k] < 0) {
                    rc = (int)(sw[d][k] < 0 ? sw[d][k] : sr[d][k]);
                    goto out;
                }
            }
        double bwm = -1, brm = -1;
        for (int d = 0; d < nd && nd > 1; d++) {
            double mw = bench_median(sw[d], 3), mr = bench_median(sr[d], 3);
            if (mw > bwm)
                bwm = mw, tw = cand[d];
            if (mr > brm)
                brm = mr, tr = cand[d];
        }
    }
    double w[BENCH_REPS], rd[BENCH_REPS], bw[BENCH_REPS], brd[BENCH_REPS];
    /* The tier and redis-benchmark take turns at going first, so that a drift of this shared
     * machine does not land on one side only. */
    for (int rep = 0; rep < BENCH_REPS; rep++) {
        for (int side = 0; side < 2; side++) {
            if ((side == 0) == ((rep & 1) == 0)) {
                forget_all(&r);
                r.depth = tw;
                w[rep] = tier_pass(&r, slots, 1);
                if (w[rep] < 0) {
                    rc = (int)w[rep];
                    goto out;
                }
                r.depth = tr;
                rd[rep] = tier_pass(&r, slots, 0);
                if (rd[rep] < 0) {
                    rc = (int)rd[rep];
                    goto out;
                }
                continue;
            }
            double set = redis_benchmark(tg, "set", size, reqs, n, dset);
            double get = redis_benchmark(tg, "get", size, reqs, n, dget);
            if (set < 0 || get < 0) {
                rc = KVT_EIO;
                goto out;
            }
            bw[rep] = set * (double)size / 1e9;
            brd[rep] = get * (double)size / 1e9;
        }
    }
    /* The ratio of each pass (the tier's sample over the baseline's run next to it): a drift of
     * the machine's load moves both samples of a pass alike, so the median of these ratios, and
     * their spread, say more about the bar than the ratio of the two medians, whose samples may
     * come from different minutes. The bar is judged on that median. */
    double pr[2][BENCH_REPS], prm[2], prlo[2], prhi[2];
    for (int o = 0; o < 2; o++) {
        for (int rep = 0; rep < BENCH_REPS; rep++) {
            double den = o ? brd[rep] : bw[rep];
            pr[o][rep] = den > 0 ? (o ? rd[rep] : w[rep]) / den : 0.0;
        }
        prm[o] = bench_median(pr[o], BENCH_REPS); /* sorts */
        prlo[o] = pr[o][0];
        prhi[o] = pr[o][BENCH_REPS - 1];
    }
    double load[3] = {0, 0, 0};
    if (getloadavg(load, 3) < 0)
        load[0] = load[1] = load[2] = -1;
    const char *ops[2] = {"write", "read"};
    double g[2] = {bench_median(w, BENCH_REPS), bench_median(rd, BENCH_REPS)};
    double b[2] = {bench_median(bw, BENCH_REPS), bench_median(brd, BENCH_REPS)};
    /* The spread of each side's passes, (max - min) / median, to read a ratio against. */
    double *all[2][2] = {{w, bw}, {rd, brd}}, spread[2][2];
    for (int o = 0; o < 2; o++)
        for (int k = 0; k < 2; k++) {
            double lo = all[o][k][0], hi = lo, med = bench_median(all[o][k], BENCH_REPS);
            for (int rep = 1; rep < BENCH_REPS; rep++)
                lo = KVT_MIN(lo, all[o][k][rep]), hi = KVT_MAX(hi, all[o][k][rep]);
            spread[o][k] = med > 0 ? (hi - lo) / med : 0;
        }
    for (int o = 0; o < 2; o++) {
        double ratio = b[o] > 0 ? g[o] / b[o] : 0.0;
        printf("{\"tier\":\"remote\",\"server\":\"%s\",\"block_bytes\":%zu,\"op\":\"%s\","
               "\"gbps\":%.3f,\"baseline\":\"redis-benchmark%s\",\"baseline_gbps\":%.3f,"
               "\"ratio\":%.3f,\"blocks\":%u,\"requests\":%u,\"depth\":%d,\"baseline_depth\":%d,"
               "\"conns\":%d,\"reps\":%d,\"spread\":%.2f,\"baseline_spread\":%.2f",
               tg->cluster ? "cluster" : "single", size, ops[o], g[o],
               tg->cluster ? " --cluster --threads 1" : "", b[o], ratio, n, reqs, o ? tr : tw,
               o ? dget : dset, tg->conns, BENCH_REPS, spread[o][0], spread[o][1]);
        printf(",\"pass_ratio_median\":%.3f,\"pass_ratio_min\":%.3f,\"pass_ratio_max\":%.3f,"
               "\"loadavg\":%.2f",
               prm[o], prlo[o], prhi[o], load[0]);
        /* The cluster run's bar (issue 39): the tier at 0.8x redis-benchmark --cluster or more,
         * by the median of the paired passes' ratios. */
        if (tg->cluster)
            printf(",\"bar\":%.1f,\"pass\":%s", BENCH_CL_BAR,
                   prm[o] >= BENCH_CL_BAR ? "true" : "false");
        printf("}\n");
    }
    fflush(stdout);
out:
    forget_all(&r);
    if (tg->cluster ? flush_cluster(tg) != 0
                    : (del_tier_keys(&r, tg->c) || bench_keys(tg->c, n, NULL, 0, 0)))
        fprintf(stderr, "bench_remote: could not delete the benchmark's keys\n");
    for (int k = 0; k < nslots; k++)
        free(slots[k].io.buf);
    free(slots);
    free(r.locs);
    return rc;
}

int bench_remote_run(const char *redis, const size_t *block_bytes, int nsizes)
{
    if (!block_bytes || nsizes <= 0)
        return KVT_EINVAL;
    char host[256] = "127.0.0.1";
    uint16_t port = 0;
    bench_srv_t srv = {.pid = -1};
    int rc;
    if (redis) {
        if ((rc = kvt_tier_remote_parse_addr(redis, host, sizeof(host), &port)))
            return rc;
    } else if ((rc = srv_start(&srv, &port))) {
        srv_stop(&srv);
        return rc;
    }
    char prefix[64];
    snprintf(prefix, sizeof(prefix), "kvt-bench-%d", (int)getpid());
    kvt_tier_remote_conf_t conf = {.host = host,
                                   .port = port,
                                   .key_prefix = prefix,
                                   .capacity_bytes = 64ull << 30,
                                   .timeout_ms = 10000,
                                   .max_inflight = BENCH_DEPTH,
                                   .keep_on_free = 1};
    kvt_tier_t *t = NULL;
    redisContext *c = NULL;
    if ((rc = kvt_tier_remote_create(&t, &conf)))
        goto out;
    uint64_t end = kvt_now_ns() + 5000000000ull;
    while (!kvt_tier_remote_connected(t) && kvt_now_ns() < end)
        kvt_tier_wait(t, 20);
    if (!kvt_tier_remote_connected(t)) {
        fprintf(stderr, "bench_remote: no connection to %s:%u\n", host, port);
        rc = KVT_EUNAVAIL;
        goto out;
    }
    struct timeval tv = {10, 0};
    c = redisConnectWithTimeout(host, port, tv);
    if (!c || c->err) {
        fprintf(stderr, "bench_remote: %s:%u: %s\n", host, port, c ? c->errstr : "no memory");
        rc = KVT_EUNAVAIL;
        goto out;
    }
    btarget_t tg = {.host = host, .port = port, .c = c, .conns = 1};
    for (int i = 0; i < nsizes && rc == 0; i++)
        rc = bench_size(t, &tg, block_bytes[i]);
out:
    if (c)
        redisFree(c);
    kvt_tier_destroy(t);
    srv_stop(&srv);
    return rc;
}

/* --- the cluster run --- */

#define BENCH_CL_NODES 6

typedef struct bench_cl {
    int n;
    pid_t pid[BENCH_CL_NODES];
    uint16_t port[BENCH_CL_NODES];
    char dir[256];
} bench_cl_t;

static int bindable(uint16_t port)
{
    int s = socket(AF_INET, SOCK_STREAM, 0);
    if (s < 0)
        return 0;
    struct sockaddr_in a = {
        .sin_family = AF_INET, .sin_port = htons(port), .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    int ok = bind(s, (struct sockaddr *)&a, sizeof(a)) == 0;
    close(s);
    return ok;
}

/* A free port whose cluster bus port (+10000) is free too; 0 when none was found. */
static uint16_t cl_port(void)
{
    static unsigned seed;
    if (!seed)
        seed = (unsigned)getpid() ^ (unsigned)kvt_now_ns();
    for (int i = 0; i < 1000; i++) {
        uint16_t p = (uint16_t)(20000 + rand_r(&seed) % 25000);
        if (bindable(p) && bindable((uint16_t)(p + 10000)))
            return p;
    }
    return 0;
}

static const char *info_of(redisReply *r)
{
    return r && r->type == REDIS_REPLY_STRING ? r->str : "";
}

/* 1 when the node on port says needle in its answer to cmd. */
static int node_says(uint16_t port, const char *cmd, const char *needle)
{
    struct timeval tv = {1, 0};
    redisContext *c = redisConnectWithTimeout("127.0.0.1", port, tv);
    int yes = 0;
    if (c && !c->err) {
        redisReply *r = redisCommand(c, cmd);
        yes = strstr(info_of(r), needle) != NULL;
        if (r)
            freeReplyObject(r);
    }
    if (c)
        redisFree(c);
    return yes;
}

static void cl_stop(bench_cl_t *cl)
{
    for (int i = 0; i < cl->n; i++)
        if (cl->pid[i] > 0) {
            kill(cl->pid[i], SIGKILL);
            waitpid(cl->pid[i], NULL, 0);
            cl->pid[i] = -1;
        }
    cl->n = 0;
    if (cl->dir[0]) {
        char cmd[300];
        snprintf(cmd, sizeof(cmd), "rm -rf '%s'", cl->dir);
        if (system(cmd) != 0)
            fprintf(stderr, "bench_remote: could not remove %s\n", cl->dir);
        cl->dir[0] = 0;
    }
}

/* Starts 6 nodes, joins them as 3 primaries with a replica each (redis-cli --cluster create),
 * and waits until every node says cluster_state:ok and every replica has synced. */
static int cl_start(bench_cl_t *cl)
{
    const char *bin = getenv("KVT_REDIS_SERVER");
    if (!bin || !*bin)
        bin = "redis-server";
    const char *tmp = getenv("TMPDIR");
    snprintf(cl->dir, sizeof(cl->dir), "%s/kvt-bench-cluster-XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(cl->dir)) {
        cl->dir[0] = 0;
        return -errno;
    }
    pid_t parent = getpid();
    char create[1024];
    size_t off = (size_t)snprintf(create, sizeof(create), "redis-cli --cluster create");
    for (int i = 0; i < BENCH_CL_NODES; i++) {
        uint16_t port = cl_port();
        if (!port)
            return KVT_EUNAVAIL;
        char ports[16], conf[64];
        snprintf(ports, sizeof(ports), "%u", port);
        snprintf(conf, sizeof(conf), "nodes-%u.conf", port);
        pid_t pid = fork();
        if (pid < 0)
            return -errno;
        if (pid == 0) {
            prctl(PR_SET_PDEATHSIG, SIGKILL);
            if (getppid() != parent)
                _exit(1);
            execlp(bin, bin, "--port", ports, "--bind", "127.0.0.1", "--save", "", "--appendonly",
                   "no", "--dir", cl->dir, "--logfile", "redis.log", "--cluster-enabled", "yes",
                   "--cluster-config-file", conf, "--cluster-node-timeout", "1000", "--daemonize",
                   "no", "--repl-diskless-sync-delay", "0", (char *)NULL);
            _exit(127);
        }
        cl->pid[i] = pid;
        cl->port[i] = port;
        cl->n = i + 1;
        off += (size_t)snprintf(create + off, sizeof(create) - off, " 127.0.0.1:%u", port);
    }
    for (int i = 0; i < cl->n; i++) {
        int up = 0;
        for (int k = 0; k < 300 && !(up = redis_ping("127.0.0.1", cl->port[i])); k++)
            usleep(10000);
        if (!up) {
            fprintf(stderr, "bench_remote: cluster node on %u did not start\n", cl->port[i]);
            return KVT_EUNAVAIL;
        }
    }
    snprintf(create + off, sizeof(create) - off,
             " --cluster-replicas 1 --cluster-yes >/dev/null 2>&1");
    if (system(create) != 0) {
        fprintf(stderr, "bench_remote: %s failed\n", create);
        return KVT_EUNAVAIL;
    }
    /* Half the nodes must say so as replicas: one that redis-cli made a replica can still say
     * role:master for a moment, and would then be taken for a primary (one more connection). */
    for (int k = 0; k < 800; k++) {
        int ok = 1, replicas = 0;
        for (int i = 0; i < cl->n && ok; i++) {
            int replica = node_says(cl->port[i], "INFO replication", "role:slave");
            ok = node_says(cl->port[i], "CLUSTER INFO", "cluster_state:ok") &&
                 (!replica || node_says(cl->port[i], "INFO replication", "master_link_status:up"));
            replicas += replica;
        }
        if (ok && replicas == cl->n / 2)
            return 0;
        usleep(25000);
    }
    fprintf(stderr, "bench_remote: the cluster never reached cluster_state:ok\n");
    return KVT_EUNAVAIL;
}

int bench_remote_cluster_run(const size_t *block_bytes, int nsizes)
{
    if (!block_bytes || nsizes <= 0)
        return KVT_EINVAL;
    bench_cl_t cl = {0};
    kvt_tier_t *t = NULL;
    int rc = cl_start(&cl);
    if (rc)
        goto out;
    uint16_t prim[BENCH_CL_NODES];
    int np = 0;
    for (int i = 0; i < cl.n; i++)
        if (node_says(cl.port[i], "INFO replication", "role:master"))
            prim[np++] = cl.port[i];
    char seeds[256], prefix[64];
    snprintf(seeds, sizeof(seeds), "127.0.0.1:%u", cl.port[0]);
    snprintf(prefix, sizeof(prefix), "kvt-bench-%d", (int)getpid());
    kvt_tier_remote_conf_t conf = {.cluster = 1,
                                   .seeds = seeds,
                                   .key_prefix = prefix,
                                   .capacity_bytes = 64ull << 30,
                                   .timeout_ms = 10000,
                                   .max_inflight = BENCH_DEPTH,
                                   .keep_on_free = 1};
    if ((rc = kvt_tier_remote_create(&t, &conf)))
        goto out;
    uint64_t end = kvt_now_ns() + 5000000000ull;
    while (!kvt_tier_remote_connected(t) && kvt_now_ns() < end)
        kvt_tier_wait(t, 20);
    if (!kvt_tier_remote_connected(t)) {
        fprintf(stderr, "bench_remote: no slot map from the cluster at %s\n", seeds);
        rc = KVT_EUNAVAIL;
        goto out;
    }
    btarget_t tg = {.host = "127.0.0.1",
                    .port = cl.port[0],
                    .cluster = 1,
                    .conns = np,
                    .primaries = prim,
                    .nprimaries = np};
    for (int i = 0; i < nsizes && rc == 0; i++)
        rc = bench_size(t, &tg, block_bytes[i]);
out:
    kvt_tier_destroy(t);
    cl_stop(&cl);
    return rc;
}
