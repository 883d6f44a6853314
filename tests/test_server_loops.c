/*
 * test_server_loops.c: kvtierd with several event loops (the loops setting, issue 42): clients
 * on two loops served at once, each checking its bytes; a connection owned by loop 1 whose GET
 * reads from NVMe (the completion arrives on loop 0 and is handed to loop 1) and whose lease
 * expires (loop 0's tick); clients that leave with moves in flight; evictions at max-conns across
 * loops; the setting's bounds; the per-loop series; MATCHes on both loops under the store's lock
 * shared while other clients write, their replies and counters checked; GETs of DRAM blocks on
 * both loops, written with the lock let go, while other clients PUT, REMOVE and push blocks out;
 * runs of pipelined MATCHes that take no write lock on 2 and 4 loops, and on loop 0; the MATCHes
 * pipelined after a PUT answered under the lock shared again; GETs with LOCATE (zero-copy) that
 * take no write lock, and whose located pages keep their bytes while another loop writes; each
 * loop's queue depth (requests and reply bytes waiting on a client that does not read); GETs
 * that outlive their lease, every page their MATCH reported stored delivered (NVMe pages a
 * reclaim would take included); GETs of NVMe pages that take no write lock on their loop, and
 * whose bytes come whole from several loops at once while a writer makes the log reclaim, and
 * none when pipelined on one connection (a finished GET in front of others still reading); GETs
 * of remote-tier pages (the redis-server of KVT_TEST_REDIS) that take no write lock on their loop,
 * and one whose remote read fails; a close while such a GET's reads (NVMe or remote) are in
 * flight; a lease that ends, or a close, while such GETs read a corrupt record, their path
 * REMOVEd meanwhile, or wait for their payloads' check; the check itself, on the GET's loop with
 * the lock let go (held there by a gate while loop 0 writes), and a corrupt record it finds, with
 * 1 and 2 loops; every path of the shared lock at once on
 * four loops (MATCHes, GETs of DRAM and NVMe pages, GETs with LOCATE), for ThreadSanitizer to
 * watch.
 */
#define _GNU_SOURCE /* sched_getaffinity, CPU_COUNT */
#include <pthread.h>
#include <sched.h>

#include "common.h"
#include "proto.h"
#include "test_server_harness.h"
#include "test_raw_frames.h"

#define PAGE 16
#define BB   4096
#define BIG  65536

typedef struct worker {
    const kvd_t *d;
    pthread_barrier_t *connected; /* every worker connected before any works */
    int id;
    int errors;
} worker_t;

/* PUT, MATCH with a lease, GET and RELEASE on its own prefixes, every byte checked; the odd
 * workers over TCP. */
static void *worker_main(void *arg)
{
    worker_t *w = arg;
    kvt_client_conf_t conf = {
        .unix_path = w->d->sock, .model = "m", .page_size = PAGE, .block_bytes = BB};
    if (w->id % 2)
        conf.unix_path = NULL, conf.tcp = w->d->tcp;
    kvt_client_t *c;
    int rc = kvt_client_connect(&c, &conf);
    /* A worker that connected after another had finished and left would go to the loop that
     * one left, and the loops' shares of the work would depend on the scheduler. */
    pthread_barrier_wait(w->connected);
    if (rc < 0) {
        w->errors++;
        return NULL;
    }
    enum { P = 4 };
    uint32_t tok[P * PAGE];
    static __thread uint8_t payload[P * BB], back[P * BB];
    for (int k = 0; k < 60; k++) {
        kvd_tokens(tok, P * PAGE, (uint32_t)(w->id * 1000000 + k * 1000));
        for (int p = 0; p < P; p++)
            kvd_fill(payload + p * BB, BB, (uint32_t)(w->id * 10000 + k * 10 + p));
        kvt_client_put_t r;
        kvt_client_match_t m = {0};
        uint32_t got = 0;
        if (kvt_client_put(c, tok, P * PAGE, 0, P, payload, NULL, &r) < 0 ||
            kvt_client_match(c, tok, P * PAGE, KVT_CLIENT_LEASE, 0, NULL, &m) < 0 || m.pages != P ||
            kvt_client_get(c, m.lease, 0, P, back, sizeof back, &got, NULL) < 0 || got != P ||
            memcmp(back, payload, sizeof back) != 0 || kvt_client_release(c, m.lease, NULL) < 0)
            w->errors++;
        /* MATCHes of another worker's prefix: the index read while other loops write it. */
        kvd_tokens(tok, P * PAGE, (uint32_t)(((w->id + 1) % 8) * 1000000 + k * 1000));
        if (kvt_client_match(c, tok, P * PAGE, 0, 0, NULL, &m) < 0)
            w->errors++;
    }
    kvt_client_close(c);
    return NULL;
}

Test(server_loops, two_loops_serve_clients_at_once)
{
    kvd_t d = {0};
    kvd_start(&d, "--loops", "2", NULL);
    enum { N = 8 };
    pthread_t th[N];
    worker_t w[N];
    pthread_barrier_t connected;
    pthread_barrier_init(&connected, NULL, N);
    /* Connected before the workers start: each loop has one, whatever the workers' timing. */
    kvt_client_t *c0 = kvd_client(&d, "m", PAGE, BB), *c1 = kvd_client(&d, "m", PAGE, BB);
    cr_assert_eq(kvd_stat(c0, "loop_connections_0"), 1);
    cr_assert_eq(kvd_stat(c0, "loop_connections_1"), 1);
    for (int i = 0; i < N; i++) {
        w[i] = (worker_t){.d = &d, .connected = &connected, .id = i};
        pthread_create(&th[i], NULL, worker_main, &w[i]);
    }
    int errors = 0;
    for (int i = 0; i < N; i++) {
        pthread_join(th[i], NULL);
        errors += w[i].errors;
    }
    pthread_barrier_destroy(&connected);
    cr_expect_eq(errors, 0, "%d failed round trips", errors);
    cr_expect_eq(kvd_stat(c0, "index_blocks"), N * 60 * 4);
    cr_expect_eq(kvd_stat(c0, "leases"), 0);
    /* The workers went half to each loop (the fewest first), and both served requests. */
    uint64_t r0 = kvd_stat(c0, "loop_requests_0"), r1 = kvd_stat(c0, "loop_requests_1");
    cr_expect_gt(r0, 4 * 60 * 5, "loop 0 answered %llu requests", (unsigned long long)r0);
    cr_expect_gt(r1, 4 * 60 * 5, "loop 1 answered %llu requests", (unsigned long long)r1);
    /* The workers' closes reach their loops after the joins: wait for them, not a race. */
    uint64_t conns = 0;
    for (int i = 0; i < 1000; i++) {
        conns = kvd_stat(c0, "loop_connections_0") + kvd_stat(c0, "loop_connections_1");
        if (conns == 2)
            break;
        usleep(10000);
    }
    cr_expect_eq(conns, 2, "%llu connections left", (unsigned long long)conns);
    char buf[1 << 16];
    cr_assert_eq(kvd_http_get(&d, "/metrics", buf, sizeof buf), 200);
    cr_expect(strstr(buf, "kvtier_loop_connections{loop=\"1\"} 1"), "per-loop series: %s",
              strstr(buf, "kvtier_loop") ? strstr(buf, "kvtier_loop") : "(none)");
    cr_expect(strstr(buf, "kvtier_loop_requests_total{loop=\"0\"}"));
    usleep(120000); /* a tick reads the loops' CPU time */
    cr_assert_eq(kvd_http_get(&d, "/metrics", buf, sizeof buf), 200);
    const char *cpu = strstr(buf, "kvtier_loop_cpu_seconds_total{loop=\"1\"} ");
    cr_expect(cpu && strtod(cpu + strlen("kvtier_loop_cpu_seconds_total{loop=\"1\"} "), NULL) > 0,
              "loop 1's thread used CPU");
    cr_expect(!strstr(buf, "{loop=\"2\"}"), "no series of a loop that does not exist");
    kvt_client_close(c0);
    kvt_client_close(c1);
    cr_expect_eq(kvd_stop(&d), 0, "clean shutdown with two loops");
    kvd_cleanup(&d);
}

/* A client of loop 1 (the second to connect) reads pages from NVMe: their reads complete on loop
 * 0, which hands them to loop 1; its lease expires in loop 0's tick. Its MATCH queues a promotion
 * of the NVMe pages into DRAM, which used to win the race with the GET now and then on a loaded
 * machine (the GET then read DRAM, and no completion crossed loops): c0 leases the DRAM pages
 * first, so that the promotion finds no room it may make (a leased page does not leave DRAM). */
Test(server_loops, completions_on_loop_0_reach_a_loop_1_connection)
{
    kvd_t d = {0};
    kvd_start(&d, "--loops", "2", "--dram-bytes", "1M", "--policy-high", "1", "--policy-low", "1",
              NULL);
    kvt_client_t *c0 = kvd_client(&d, "m", PAGE, BIG), *c1 = kvd_client(&d, "m", PAGE, BIG);
    cr_assert_eq(kvd_stat(c0, "loop_connections_1"), 1, "c1 is loop 1's");
    uint32_t a[16 * PAGE], b[4 * PAGE];
    kvd_tokens(a, 16 * PAGE, 1);
    kvd_tokens(b, 4 * PAGE, 700000);
    static uint8_t payload[16 * BIG], back[16 * BIG];
    for (int p = 0; p < 16; p++)
        kvd_fill(payload + (size_t)p * BIG, BIG, 100 + p);
    kvt_client_put_t r;
    cr_assert_eq(kvt_client_put(c1, a, 16 * PAGE, 0, 16, payload, NULL, &r), 0);
    for (int p = 0; p < 4; p++)
        kvd_fill(payload + (size_t)p * BIG, BIG, 500 + p);
    cr_assert_eq(kvt_client_put(c1, b, 4 * PAGE, 0, 4, payload, NULL, &r), 0);
    kvt_client_match_t held = {0};
    cr_assert_eq(kvt_client_match(c0, a, 16 * PAGE, KVT_CLIENT_LEASE, 0, NULL, &held), 0);
    uint64_t posted = kvd_stat(c0, "loop_kicks_posted_1");
    uint8_t tiers[4];
    kvt_client_match_t m = {.tiers = tiers, .tiers_cap = 4};
    cr_assert_eq(kvt_client_match(c1, b, 4 * PAGE, KVT_CLIENT_LEASE, 0, NULL, &m), 0);
    cr_assert_eq(m.pages, 4);
    cr_expect_eq(tiers[0], KVT_CLIENT_TIER_NVME, "b's pages are in NVMe");
    uint32_t got = 0;
    uint8_t from[4];
    cr_assert_eq(kvt_client_get(c1, m.lease, 0, 4, back, 4 * (size_t)BIG, &got, from), 0);
    cr_assert_eq(got, 4);
    cr_expect_eq(from[0], KVT_CLIENT_TIER_NVME);
    cr_expect(memcmp(back, payload, 4 * (size_t)BIG) == 0, "the NVMe pages' bytes");
    cr_expect_gt(kvd_stat(c0, "loop_kicks_posted_1"), posted,
                 "the reads' completions came to loop 1 from loop 0");
    cr_assert_eq(kvt_client_release(c1, m.lease, NULL), 0);
    cr_assert_eq(kvt_client_release(c0, held.lease, NULL), 0);

    /* A lease of c1's that expires: loop 0's tick ends it, c1's GET then finds it gone. */
    cr_assert_eq(kvt_client_match(c1, b, 4 * PAGE, KVT_CLIENT_LEASE, 100, NULL, &m), 0);
    uint64_t t0 = kvt_now_ns();
    while (kvd_stat(c0, "leases") && kvt_now_ns() - t0 < 3000000000ull)
        usleep(20 * 1000);
    cr_expect_eq(kvd_stat(c0, "leases"), 0, "the lease expired");
    cr_expect_eq(kvt_client_get(c1, m.lease, 0, 1, back, BIG, NULL, NULL), KVT_CLIENT_ENOENT);
    cr_expect_eq(kvt_client_ping(c1, NULL), 0);
    kvt_client_close(c0);
    kvt_client_close(c1);
    cr_expect_eq(kvd_stop(&d), 0);
    kvd_cleanup(&d);
}

typedef struct leaver {
    const kvd_t *d;
    const uint32_t *tok;
    int errors;
} leaver_t;

/* Connects, takes a lease on NVMe pages, asks for their promotion and goes while it runs: the
 * connection closes with its lease held and moves in flight, whose completions (on loop 0) then
 * find it gone. */
static void *leaver_main(void *arg)
{
    leaver_t *l = arg;
    for (int k = 0; k < 20; k++) {
        kvt_client_conf_t conf = {
            .unix_path = l->d->sock, .model = "m", .page_size = PAGE, .block_bytes = BIG};
        kvt_client_t *c;
        if (kvt_client_connect(&c, &conf) < 0) {
            l->errors++;
            continue;
        }
        kvt_client_match_t m = {0};
        if (kvt_client_match(c, l->tok, 4 * PAGE, KVT_CLIENT_LEASE, 0, NULL, &m) < 0 ||
            m.pages != 4)
            l->errors++;
        kvt_client_prefetch_t pf;
        if (kvt_client_prefetch_start(c, l->tok, 4 * PAGE, KVT_CLIENT_TIER_DRAM, 1000, &pf) < 0)
            l->errors++;
        kvt_client_close(c);
    }
    return NULL;
}

Test(server_loops, clients_that_leave_with_io_in_flight)
{
    kvd_t d = {0};
    kvd_start(&d, "--loops", "2", "--dram-bytes", "1M", "--policy-high", "1", "--policy-low", "1",
              NULL);
    kvt_client_t *c0 = kvd_client(&d, "m", PAGE, BIG);
    uint32_t a[16 * PAGE], b[4 * PAGE];
    kvd_tokens(a, 16 * PAGE, 1);
    kvd_tokens(b, 4 * PAGE, 700000);
    static uint8_t payload[16 * BIG];
    for (int p = 0; p < 16; p++)
        kvd_fill(payload + (size_t)p * BIG, BIG, 100 + p);
    kvt_client_put_t r;
    cr_assert_eq(kvt_client_put(c0, a, 16 * PAGE, 0, 16, payload, NULL, &r), 0);
    cr_assert_eq(kvt_client_put(c0, b, 4 * PAGE, 0, 4, payload, NULL, &r), 0);
    enum { N = 4 };
    pthread_t th[N];
    leaver_t l[N];
    for (int i = 0; i < N; i++) {
        l[i] = (leaver_t){.d = &d, .tok = b};
        pthread_create(&th[i], NULL, leaver_main, &l[i]);
    }
    int errors = 0;
    for (int i = 0; i < N; i++) {
        pthread_join(th[i], NULL);
        errors += l[i].errors;
    }
    cr_expect_eq(errors, 0);
    /* The daemon is whole: its leases given back, b's bytes still right. */
    uint64_t t0 = kvt_now_ns();
    while (kvd_stat(c0, "leases") && kvt_now_ns() - t0 < 3000000000ull)
        usleep(20 * 1000);
    cr_expect_eq(kvd_stat(c0, "leases"), 0);
    kvt_client_match_t m = {0};
    cr_assert_eq(kvt_client_match(c0, b, 4 * PAGE, KVT_CLIENT_LEASE, 0, NULL, &m), 0);
    static uint8_t back[4 * BIG];
    uint32_t got = 0;
    cr_assert_eq(kvt_client_get(c0, m.lease, 0, 4, back, sizeof back, &got, NULL), 0);
    cr_expect_eq(got, 4);
    cr_expect(memcmp(back, payload, sizeof back) == 0);
    kvt_client_close(c0);
    cr_expect_eq(kvd_stop(&d), 0);
    kvd_cleanup(&d);
}

/* At max-conns, new connections that come together each close a different idle one, though
 * the idle ones of loop 1 are closed there, after loop 0 picked them (a victim picked twice let
 * the daemon hold more than max-conns). */
Test(server_loops, connections_past_max_conns_each_evict_another)
{
    kvd_t d = {0};
    kvd_start(&d, "--loops", "2", "--max-conns", "6", "--evict-idle-ms", "1", NULL);
    enum { OLD = 6, NEW = 4 };
    int old[OLD], fresh[NEW];
    for (int i = 0; i < OLD; i++) /* to loops 0, 1, 0, 1, ...: the fewest first */
        old[i] = kvd_raw(&d);
    usleep(100000);
    cr_assert_eq(kvd_metric(&d, "kvtier_connections"), OLD);
    for (int i = 0; i < NEW; i++)
        fresh[i] = kvd_raw(&d);
    double open = OLD + NEW;
    for (int i = 0; i < 200 && open > OLD; i++) {
        usleep(10000);
        open = kvd_metric(&d, "kvtier_connections");
    }
    cr_expect_leq(open, OLD, "at most max-conns open once the evictions are done: %.0f", open);
    cr_expect_eq(kvd_metric(&d, "kvtier_connections_evicted_total"), NEW);
    int closed = 0;
    for (int i = 0; i < OLD; i++) {
        struct pollfd pf = {.fd = old[i], .events = POLLIN};
        char b;
        closed += poll(&pf, 1, 1000) == 1 && read(old[i], &b, 1) == 0;
        close(old[i]);
    }
    cr_expect_eq(closed, NEW, "each new connection closed an idle one of its own");
    for (int i = 0; i < NEW; i++)
        close(fresh[i]);
    kvd_cleanup(&d);
}

/* loops past 16 is refused at start with a clear error (exit 64); loops = 0 runs one loop per CPU
 * the daemon may run on, at most 8, each with its series. */
Test(server_loops, the_loops_setting)
{
    kvd_t d = {0};
    kvd_mkdir(&d);
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "cd '%s' && '%s' --loops 17 2>err.txt >/dev/null", d.dir,
             kvd_binary());
    int st = system(cmd);
    cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 64, "loops 17: exit %d", WEXITSTATUS(st));
    char err[512];
    kvd_slurp(&d, "err.txt", err, sizeof err);
    cr_expect(strstr(err, "loops must be between 0"), "%s", err);
    kvd_start(&d, "--loops", "0", NULL);
    cpu_set_t set;
    cr_assert_eq(sched_getaffinity(0, sizeof set, &set), 0);
    int want = CPU_COUNT(&set) < 8 ? CPU_COUNT(&set) : 8;
    kvt_client_t *c = kvd_client(&d, "m", PAGE, BB);
    char key[32];
    snprintf(key, sizeof key, "loop_connections_%d", want - 1);
    cr_expect_eq(kvd_stat(c, key), 0);
    char buf[1 << 16];
    cr_assert_eq(kvd_http_get(&d, "/metrics", buf, sizeof buf), 200);
    snprintf(key, sizeof key, "{loop=\"%d\"}", want);
    cr_expect(!strstr(buf, key), "no loop %d", want);
    cr_expect_eq(kvd_metric(&d, "kvtier_loops"), want, "loops 0 resolved to %d", want);
    cr_expect_eq(kvd_stat(c, "loops"), (uint64_t)want);
    kvt_client_close(c);
    cr_expect_eq(kvd_stop(&d), 0);
    kvd_cleanup(&d);
}

/* With no loops setting the daemon runs the documented default (docs/server.md: 1), shown as
 * kvtier_loops and STATS' loops; KVT_TEST_LOOPS (the loops2 runs) is not this test's. */
Test(server_loops, the_loops_default_is_one)
{
    unsetenv("KVT_TEST_LOOPS");
    kvd_t d = {0};
    kvd_start(&d, NULL);
    kvt_client_t *c = kvd_client(&d, "m", PAGE, BB);
    cr_expect_eq(kvd_metric(&d, "kvtier_loops"), 1);
    cr_expect_eq(kvd_stat(c, "loops"), 1);
    char buf[1 << 16];
    cr_assert_eq(kvd_http_get(&d, "/metrics", buf, sizeof buf), 200);
    cr_expect(strstr(buf, "kvtier_loop_connections{loop=\"0\"} 1"), "loop 0 serves c");
    cr_expect(!strstr(buf, "{loop=\"1\"}"), "no loop 1");
    kvt_client_close(c);
    cr_expect_eq(kvd_stop(&d), 0);
    kvd_cleanup(&d);
}

/*
 * MATCHes without a lease take the store's lock shared (op_match.c, kvt__h_match_shared) while
 * other clients PUT, REMOVE and push blocks out of a small DRAM tier (evicted: out of the index).
 * Each reader MATCHes its prefixes and the next reader's, which they hold leases on (so that
 * nothing evicts them): every page stored is matched, in DRAM; a longer lookup matches the same
 * pages; a prefix it removed (from its first page) matches nothing. The lookups counted are the
 * MATCHes sent (none lost to a race), and both loops answered some with the lock shared.
 */
typedef struct churner {
    const kvd_t *d;
    pthread_barrier_t *start; /* the readers' leases are taken before the writers start */
    int id, reader;
    int errors, line;         /* and the first one's line */
    uint64_t matches, probes; /* MATCHes sent that count as lookups; PROBEs */
    uint64_t hit, miss;       /* the lookups' whole pages matched, and not */
} churner_t;

/* A counted lookup of n tokens that matched pages pages. */
static void churn_count(churner_t *w, uint32_t n, uint32_t pages)
{
    w->matches++;
    w->hit += pages;
    w->miss += n / PAGE > pages ? n / PAGE - pages : 0;
}

/* One more wrong reply; the first one's line is kept for the message. */
#define CHURN_WRONG(w) ((w)->line = (w)->line ? (w)->line : __LINE__, (w)->errors++)

static void *churner_main(void *arg)
{
    churner_t *w = arg;
    kvt_client_conf_t conf = {
        .unix_path = w->d->sock, .model = "m", .page_size = PAGE, .block_bytes = BB};
    kvt_client_t *c;
    if (kvt_client_connect(&c, &conf) < 0) {
        CHURN_WRONG(w);
        pthread_barrier_wait(w->start);
        return NULL;
    }
    enum { P = 4, K = 6 };
    uint32_t tok[(P + 1) * PAGE];
    uint8_t tiers[P + 1];
    static __thread uint8_t payload[P * BB];
    kvt_client_put_t r;
    kvt_client_match_t m;
    uint32_t base = (uint32_t)(w->id + 1) * 10000000u;
    /* A reader's K prefixes (P pages each, tokens apart) and a spare one, K, that it removes. */
    for (int k = 0; w->reader && k < K; k++) {
        kvd_tokens(tok, P * PAGE, base + (uint32_t)k * 1000);
        kvd_fill(payload, sizeof payload, base + (uint32_t)k);
        m = (kvt_client_match_t){0};
        if (kvt_client_put(c, tok, P * PAGE, 0, P, payload, NULL, &r) < 0 || r.stored != P ||
            kvt_client_match(c, tok, P * PAGE, KVT_CLIENT_LEASE, 600000, NULL, &m) < 0 ||
            m.pages != P)
            CHURN_WRONG(w);
        churn_count(w, P * PAGE, m.pages);
    }
    pthread_barrier_wait(w->start);
    kvt_batch_t *batch = NULL;
    if (kvt_batch_create(&batch, c) < 0)
        CHURN_WRONG(w);
    for (int round = 0; round < 400 && batch; round++) {
        int k = round % K;
        if (!w->reader) { /* a new prefix each time: DRAM fills, the step evicts; half removed */
            kvd_tokens(tok, P * PAGE, base + (uint32_t)round * 1000);
            kvd_fill(payload, sizeof payload, base + (uint32_t)round);
            if (kvt_client_put(c, tok, P * PAGE, 0, P, payload, NULL, &r) < 0)
                CHURN_WRONG(w);
            int rc = round % 2 ? kvt_client_remove(c, tok, P * PAGE) : 0;
            if (rc < 0 && rc != KVT_CLIENT_ENOENT) /* ENOENT: evicted first */
                CHURN_WRONG(w);
            continue;
        }
        /* Its prefix and the next reader's (leased too: the same blocks read on both loops at
         * once), each also with a lookup one page longer (never stored): P pages each time. */
        for (int j = 0; j < 4; j++) {
            uint32_t owner = j < 2 ? (uint32_t)w->id : (uint32_t)(w->id + 1) % 4;
            kvd_tokens(tok, (P + 1) * PAGE, (owner + 1) * 10000000u + (uint32_t)k * 1000);
            uint32_t n = (j % 2 ? P + 1 : P) * PAGE;
            memset(tiers, 0xff, sizeof tiers);
            m = (kvt_client_match_t){.tiers = tiers, .tiers_cap = P + 1};
            if (kvt_client_match(c, tok, n, 0, 0, NULL, &m) < 0 || m.pages != P ||
                m.tokens != P * PAGE || m.lease != 0)
                CHURN_WRONG(w);
            for (int p = 0; p < P; p++)
                if (tiers[p] != KVT_TIER_DRAM)
                    CHURN_WRONG(w);
            churn_count(w, n, m.pages);
        }
        /* The same pipelined (a batch: the daemon walks a run of them in one shared section),
         * a PROBE and a MATCH with a lease (the write path) among them. */
        enum { B = 12 };
        static __thread uint32_t btok[B][(P + 1) * PAGE];
        kvt_client_match_t bm[B];
        uint8_t bt[B][P + 1];
        int st[B];
        for (int i = 0; i < B; i++) {
            uint32_t owner = i % 2 ? (uint32_t)w->id : (uint32_t)(w->id + 1) % 4;
            kvd_tokens(btok[i], (P + 1) * PAGE,
                       (owner + 1) * 10000000u + (uint32_t)((k + i) % K) * 1000);
            memset(bt[i], 0xff, sizeof bt[i]);
            bm[i] = (kvt_client_match_t){.tiers = bt[i], .tiers_cap = P + 1};
            unsigned flags = i == 5 ? KVT_CLIENT_LEASE : i == 8 ? KVT_CLIENT_PROBE : 0;
            if (kvt_batch_match(batch, btok[i], (i % 3 == 2 ? P + 1 : P) * PAGE, flags, 0, NULL,
                                &bm[i], &st[i]) < 0)
                CHURN_WRONG(w);
        }
        if (kvt_batch_run(batch) < 0)
            CHURN_WRONG(w);
        for (int i = 0; i < B; i++) {
            if (st[i] != 0 || bm[i].pages != P || (bm[i].lease != 0) != (i == 5))
                CHURN_WRONG(w);
            for (int p = 0; p < P; p++)
                if (bt[i][p] != KVT_TIER_DRAM)
                    CHURN_WRONG(w);
            if (i == 8)
                w->probes++;
            else
                churn_count(w, (i % 3 == 2 ? P + 1 : P) * PAGE, bm[i].pages);
        }
        if (bm[5].lease && kvt_client_release(c, bm[5].lease, NULL) < 0)
            CHURN_WRONG(w);
        if (round % 10 == 9) { /* the spare: stored, then removed, it matches nothing */
            kvd_tokens(tok, P * PAGE, base + (uint32_t)K * 1000);
            kvd_fill(payload, sizeof payload, base + (uint32_t)K);
            m = (kvt_client_match_t){0};
            if (kvt_client_put(c, tok, P * PAGE, 0, P, payload, NULL, &r) < 0)
                CHURN_WRONG(w);
            /* Its first page, and everything below it (ENOENT: evicted first). */
            int rc = kvt_client_remove(c, tok, PAGE);
            if ((rc < 0 && rc != KVT_CLIENT_ENOENT) ||
                kvt_client_match(c, tok, P * PAGE, 0, 0, NULL, &m) < 0 || m.pages != 0)
                CHURN_WRONG(w);
            churn_count(w, P * PAGE, m.pages);
        }
    }
    kvt_batch_destroy(batch);
    kvt_client_close(c);
    return NULL;
}

/*
 * The churn with loops loops. A MATCH answered under the shared lock counts in its loop's own
 * table (merged on scrape): the lookups, hit and miss tokens and the MATCH requests (their count
 * and their latency histogram's) are those sent, in /metrics and in STATS, with none lost to
 * another loop counting at the same time.
 */
static void churn_with(const char *loops)
{
    kvd_t d = {0};
    kvd_start(&d, "--loops", loops, "--dram-bytes", "1M", "--nvme-bytes", "0", NULL);
    enum { N = 6 };
    pthread_t th[N];
    churner_t w[N];
    pthread_barrier_t start;
    pthread_barrier_init(&start, NULL, N);
    for (int i = 0; i < N; i++) {
        w[i] = (churner_t){.d = &d, .start = &start, .id = i, .reader = i < 4};
        pthread_create(&th[i], NULL, churner_main, &w[i]);
    }
    int errors = 0, line = 0;
    uint64_t matches = 0, probes = 0, hit = 0, miss = 0;
    for (int i = 0; i < N; i++) {
        pthread_join(th[i], NULL);
        errors += w[i].errors;
        line = line ? line : w[i].line;
        matches += w[i].matches;
        probes += w[i].probes;
        hit += w[i].hit;
        miss += w[i].miss;
    }
    pthread_barrier_destroy(&start);
    cr_expect_eq(errors, 0, "%d wrong replies, the first at line %d", errors, line);
    cr_expect_eq(kvd_metric(&d, "kvtier_lookups_total"), (double)matches);
    cr_expect_eq(kvd_metric(&d, "kvtier_hit_tokens_total{tier=\"dram\"}"), (double)hit * PAGE);
    double missed = kvd_metric(&d, "kvtier_miss_tokens_total{reason=\"never_seen\"}") +
                    kvd_metric(&d, "kvtier_miss_tokens_total{reason=\"evicted\"}");
    cr_expect_eq(missed, (double)miss * PAGE, "miss tokens %g, sent %llu", missed,
                 (unsigned long long)miss * PAGE);
    cr_expect_eq(kvd_metric(&d, "kvtier_requests_total{op=\"match\"}"), (double)(matches + probes));
    cr_expect_eq(kvd_metric(&d, "kvtier_request_duration_seconds_count{op=\"match\"}"),
                 (double)(matches + probes));
    cr_expect_gt(kvd_metric(&d, "kvtier_blocks_dropped_total{tier=\"dram\"}"), 0,
                 "the writers pushed blocks out of DRAM");
    int n = atoi(loops);
    double shared = 0;
    char key[64];
    for (int i = 0; i < n; i++) {
        snprintf(key, sizeof key, "kvtier_loop_shared_matches_total{loop=\"%d\"}", i);
        double si = kvd_metric(&d, key);
        /* With two loops each has readers (the fewest first); with four, some may have none. */
        if (n == 2)
            cr_expect_gt(si, 0, "loop %d answered MATCHes under the shared lock (%g)", i, si);
        shared += si;
    }
    cr_expect_gt(shared, 0);
    cr_expect_leq(shared, (double)(matches + probes));
    kvt_client_t *c = kvd_client(&d, "m", PAGE, BB);
    cr_expect_eq(kvd_stat(c, "lookups"), matches, "STATS: the same sums");
    cr_expect_eq(kvd_stat(c, "hit_tokens_dram"), hit * PAGE);
    kvt_client_close(c);
    cr_expect_eq(kvd_stop(&d), 0);
    kvd_cleanup(&d);
}

Test(server_loops, matches_share_the_lock_while_others_write)
{
    churn_with("2");
}

Test(server_loops, matches_on_four_loops_count_what_was_sent)
{
    churn_with("4");
}

/* The use a MATCH made under the shared lock tells the policy counts (applied at the next write
 * lock): its hit in NVMe promotes the path to DRAM (lru: a hit from a lower tier goes to the top),
 * as with one loop. */
Test(server_loops, a_shared_match_tells_the_policy_of_its_hit)
{
    kvd_t d = {0};
    kvd_start(&d, "--loops", "2", "--dram-bytes", "1M", "--policy", "lru", "--policy-high", "1",
              "--policy-low", "1", NULL); /* no demotion of a's blocks: b goes to NVMe */
    kvt_client_t *c0 = kvd_client(&d, "m", PAGE, BIG), *c1 = kvd_client(&d, "m", PAGE, BIG);
    cr_assert_eq(kvd_stat(c0, "loop_connections_1"), 1, "c1 is loop 1's");
    uint32_t a[16 * PAGE], b[4 * PAGE];
    kvd_tokens(a, 16 * PAGE, 1);
    kvd_tokens(b, 4 * PAGE, 700000);
    static uint8_t payload[16 * BIG];
    kvd_fill(payload, sizeof payload, 7);
    kvt_client_put_t r;
    cr_assert_eq(kvt_client_put(c0, a, 16 * PAGE, 0, 16, payload, NULL, &r), 0);
    cr_assert_eq(kvt_client_put(c0, b, 4 * PAGE, 0, 4, payload, NULL, &r), 0);
    uint8_t tiers[4] = {0};
    kvt_client_match_t m = {.tiers = tiers, .tiers_cap = 4};
    cr_assert_eq(kvt_client_match(c0, b, 4 * PAGE, KVT_CLIENT_PROBE, 0, NULL, &m), 0);
    cr_assert_eq(m.pages, 4);
    cr_assert_eq(tiers[0], KVT_CLIENT_TIER_NVME, "b's pages went to NVMe (DRAM is full)");
    cr_assert_eq(kvt_client_remove(c0, a, PAGE), 0); /* room in DRAM for the promotion */
    double shared = kvd_metric(&d, "kvtier_loop_shared_matches_total{loop=\"1\"}");
    cr_assert_eq(kvt_client_match(c1, b, 4 * PAGE, 0, 0, NULL, &m), 0);
    cr_assert_eq(m.pages, 4);
    cr_assert_eq(kvd_metric(&d, "kvtier_loop_shared_matches_total{loop=\"1\"}"), shared + 1,
                 "c1's MATCH (loop 1) walked under the shared lock");
    /* The promotion the hit asked for runs in a step; PROBEs look without counting a use. */
    uint64_t t0 = kvt_now_ns();
    do {
        usleep(10 * 1000);
        m = (kvt_client_match_t){.tiers = tiers, .tiers_cap = 4};
        cr_assert_eq(kvt_client_match(c0, b, 4 * PAGE, KVT_CLIENT_PROBE, 0, NULL, &m), 0);
    } while (tiers[0] != KVT_CLIENT_TIER_DRAM && kvt_now_ns() - t0 < 3000000000ull);
    cr_expect_eq(tiers[0], KVT_CLIENT_TIER_DRAM, "the hit promoted b's path to DRAM");
    kvt_client_close(c0);
    kvt_client_close(c1);
    cr_expect_eq(kvd_stop(&d), 0);
    kvd_cleanup(&d);
}

/*
 * A namespace nobody declared a block size for (index-only prompts, lookup-only clients): its
 * lookups are no pages of the miss-ratio curve, so MATCH gathers no page keys for it, on the
 * shared walk (loop 1, with LEASE or without, with KEEP too) and under the write lock (LEASE with
 * KEEP and REMOTE: no remote tier here, so no probe) alike, and still counts its hits and its
 * misses' reason.
 */
Test(server_loops, a_match_without_a_block_size_counts_no_curve_but_its_misses)
{
    kvd_t d = {0};
    kvd_start(&d, "--loops", "2", NULL); /* mrc on, as by default */
    kvt_client_t *c0 = kvd_client(&d, "m", PAGE, 0), *c1 = kvd_client(&d, "m", PAGE, 0);
    cr_assert_eq(kvd_stat(c0, "loop_connections_1"), 1, "c1 is loop 1's");
    uint32_t x[12 * PAGE];
    kvd_tokens(x, 12 * PAGE, 1);
    kvt_client_put_t r;
    cr_assert_eq(kvt_client_put(c0, x, 8 * PAGE, 0, 0, NULL, NULL, &r), 0);
    for (int lease = 0; lease < 4; lease++) {
        unsigned flags = lease ? KVT_CLIENT_LEASE : 0;
        flags |= lease >= 2 ? KVT_CLIENT_KEEP : 0;
        flags |= lease == 3 ? KVT_CLIENT_REMOTE : 0;
        kvt_client_step_t step = {0};
        double shared = kvd_metric(&d, "kvtier_loop_shared_matches_total{loop=\"1\"}");
        double hit = kvd_metric(&d, "kvtier_hit_tokens_total{tier=\"none\"}");
        double never = kvd_metric(&d, "kvtier_miss_tokens_total{reason=\"never_seen\"}");
        double short_page = kvd_metric(&d, "kvtier_miss_tokens_total{reason=\"short_page\"}");
        kvt_client_match_t m = {0};
        /* 8 pages stored, 3 never seen, and 3 tokens of a page short */
        cr_assert_eq(kvt_client_match_step(c1, x, 12 * PAGE + 3 - PAGE, flags, 0, NULL, &m, &step),
                     0);
        cr_assert_eq(m.pages, 8);
        cr_expect_eq(kvd_metric(&d, "kvtier_loop_shared_matches_total{loop=\"1\"}"),
                     shared + (lease < 3), "lease %d: shared walk %d", lease, lease < 3);
        cr_expect_eq(kvd_metric(&d, "kvtier_hit_tokens_total{tier=\"none\"}"), hit + 8 * PAGE,
                     "lease %d", lease);
        cr_expect_eq(kvd_metric(&d, "kvtier_miss_tokens_total{reason=\"never_seen\"}"),
                     never + 3 * PAGE, "lease %d", lease);
        cr_expect_eq(kvd_metric(&d, "kvtier_miss_tokens_total{reason=\"short_page\"}"),
                     short_page + 3, "lease %d", lease);
        if (lease)
            cr_assert_eq(kvt_client_release(c1, m.lease, NULL), 0);
    }
    cr_expect_eq(kvd_metric(&d, "kvtier_mrc_tracked_pages"), 0, "no page of the curve");
    kvt_client_close(c0);
    kvt_client_close(c1);
    cr_expect_eq(kvd_stop(&d), 0);
    kvd_cleanup(&d);
}

/*
 * GETs of 256 KiB DRAM blocks on both loops, their batches written with the store's lock let go
 * (op_get.c, get_apart), while other clients PUT over the readers' prefixes (other bytes: skipped,
 * the pages hold theirs), PUT new prefixes that push blocks out of DRAM (demotions to NVMe,
 * drops), and REMOVE the prefixes the readers lease and let go in turn. Each reader GETs its
 * leased prefixes (always in DRAM: a lease keeps them there) and, every round, a prefix it leases
 * only for that GET, which the writers' REMOVEs and the step's moves reach between its rounds, and
 * the previous round's again under a lease of 2 ms, some of them read slowly so that a REMOVE
 * meets the GET's writes: whatever part of it is found, from whichever tier, must have its own
 * bytes. Every page's checksum is compared with its pattern's. (With the GET's pin and the
 * deferred free of busy blocks both taken out, this fails every run.)
 */
#define GBB (256u << 10)

typedef struct getter {
    kvt_client_t *c; /* connected by the test, so that each loop has two readers */
    const kvd_t *d;
    pthread_barrier_t *start;
    struct getter *all; /* every reader's and writer's, for the writers to aim at */
    int id, reader;
    int round, finished;        /* a reader's, read by the writers (atomic) */
    int errors, line, rc;       /* and the first one's line and, for a request, its return */
    uint64_t pages, dram_pages; /* the churn prefixes' pages received, and how many from DRAM */
    uint64_t removed;           /* a writer's REMOVEs that took a reader's churn prefix */
} getter_t;

#define GET_WRONG(w)       ((w)->line = (w)->line ? (w)->line : __LINE__, (w)->errors++)
#define GET_WRONG_RC(w, r) ((w)->rc = (w)->errors ? (w)->rc : (r), GET_WRONG(w))

static uint64_t page_sum(const uint8_t *p, size_t len)
{
    uint64_t h = 0xcbf29ce484222325ull, x;
    for (size_t i = 0; i + 8 <= len; i += 8) {
        memcpy(&x, p + i, 8);
        h = (h ^ x) * 0x100000001b3ull;
        h ^= h >> 29;
    }
    return h;
}

/* The pattern seed of page p of prefix k of reader id (its churn prefix: k = 100 + round). */
static uint32_t get_seed(int id, int k, int p)
{
    return (uint32_t)(id * 100000 + k * 10 + p);
}

typedef struct get_check {
    getter_t *w;
    const uint64_t *sums; /* expected, per page */
    uint32_t first, n, seen;
    int want_dram;
    int slow_ms; /* a slow reader: waits this long after its first page */
} get_check_t;

static int get_check_page(void *arg, uint32_t page, unsigned tier, const void *data, uint32_t len)
{
    get_check_t *k = arg;
    if (page < k->first || page >= k->first + k->n || len != GBB ||
        page_sum(data, len) != k->sums[page]) {
        GET_WRONG(k->w);
        return 0;
    }
    if (k->want_dram && tier != KVT_CLIENT_TIER_DRAM)
        GET_WRONG(k->w);
    k->w->dram_pages += tier == KVT_CLIENT_TIER_DRAM;
    if (k->seen++ == 0 && k->slow_ms)
        usleep((useconds_t)k->slow_ms * 1000);
    return 0;
}

static void *getter_main(void *arg)
{
    getter_t *w = arg;
    enum { P = 4, K = 2, ROUNDS = 40 };
    uint32_t tok[P * PAGE];
    uint8_t *payload = malloc((size_t)P * GBB);
    uint64_t sums[K + 1][P];
    uint64_t lease[K] = {0};
    kvt_client_put_t r;
    kvt_client_match_t m;
    kvt_client_t *c = w->c;
    if (!c) {
        kvt_client_conf_t conf = {
            .unix_path = w->d->sock, .model = "g", .page_size = PAGE, .block_bytes = GBB};
        if (kvt_client_connect(&c, &conf) < 0)
            GET_WRONG(w);
    }
    for (int k = 0; c && payload && w->reader && k < K; k++) { /* its leased prefixes */
        kvd_tokens(tok, P * PAGE, (uint32_t)(w->id + 1) * 10000000u + (uint32_t)k * 1000);
        for (int p = 0; p < P; p++) {
            kvd_fill(payload + (size_t)p * GBB, GBB, get_seed(w->id, k, p));
            sums[k][p] = page_sum(payload + (size_t)p * GBB, GBB);
        }
        m = (kvt_client_match_t){0};
        if (kvt_client_put(c, tok, P * PAGE, 0, P, payload, NULL, &r) < 0 || r.stored != P ||
            kvt_client_match(c, tok, P * PAGE, KVT_CLIENT_LEASE, 600000, NULL, &m) < 0 ||
            m.pages != P)
            GET_WRONG(w);
        lease[k] = m.lease;
    }
    pthread_barrier_wait(w->start);
    for (int round = 0; c && payload && (round < ROUNDS || !w->reader); round++) {
        if (!w->reader) {
            /* On until the readers are done, so that their slow GETs meet REMOVEs. */
            int left = 0;
            for (int i = 0; i < 4; i++)
                left += !__atomic_load_n(&w->all[i].finished, __ATOMIC_RELAXED);
            if (round >= ROUNDS && (!left || round >= 50 * ROUNDS))
                break;
            if (round >= ROUNDS)
                usleep(2000);
            /* A new prefix (DRAM fills: the step demotes and drops), one of a reader's churn
             * prefixes removed (EBUSY while it is leased, ENOENT once gone), and a reader's
             * leased prefix PUT over with other bytes (skipped: its pages have theirs). */
            kvd_tokens(tok, P * PAGE, (uint32_t)(w->id + 1) * 10000000u + (uint32_t)round * 1000);
            kvd_fill(payload, (size_t)P * GBB, (uint32_t)(w->id * 7777 + round));
            if (kvt_client_put(c, tok, P * PAGE, 0, P, payload, NULL, &r) < 0)
                GET_WRONG(w);
            /* The churn prefix the victim is reading again now, or about to. */
            int victim = round % 4;
            int vr = __atomic_load_n(&w->all[victim].round, __ATOMIC_RELAXED);
            kvd_tokens(tok, P * PAGE,
                       (uint32_t)(victim + 1) * 10000000u + (uint32_t)(100 + vr - 1) * 1000);
            int rc = kvt_client_remove(c, tok, PAGE);
            if (rc < 0 && rc != KVT_CLIENT_ENOENT && rc != KVT_CLIENT_EBUSY)
                GET_WRONG(w);
            w->removed += rc == 0;
            kvd_tokens(tok, P * PAGE,
                       (uint32_t)(victim + 1) * 10000000u + (uint32_t)(round % K) * 1000);
            if (kvt_client_put(c, tok, P * PAGE, 0, P, payload, NULL, &r) < 0 || r.stored != 0)
                GET_WRONG(w);
            continue;
        }
        __atomic_store_n(&w->round, round, __ATOMIC_RELAXED);
        /* Its leased prefixes, whole and from page 1 on: every page from DRAM. */
        for (int k = 0; k < K; k++) {
            for (uint32_t first = 0; first < 2; first++) {
                get_check_t ck = {
                    .w = w, .sums = sums[k], .first = first, .n = P - first, .want_dram = 1};
                uint32_t got = 0;
                int rc = kvt_client_get_cb(c, lease[k], first, 0, get_check_page, &ck, &got);
                if (rc < 0 || got != P - first || ck.seen != P - first)
                    GET_WRONG_RC(w, rc);
            }
        }
        /* A churn prefix: stored, leased for one GET, let go; the writers remove it meanwhile.
         * Those of earlier rounds are read again: whatever of them is left, from any tier. */
        for (int back = 0; back < 2 && back <= round; back++) {
            int k = 100 + round - back;
            kvd_tokens(tok, P * PAGE, (uint32_t)(w->id + 1) * 10000000u + (uint32_t)k * 1000);
            for (int p = 0; p < P; p++) {
                kvd_fill(payload + (size_t)p * GBB, GBB, get_seed(w->id, k, p));
                sums[K][p] = page_sum(payload + (size_t)p * GBB, GBB);
            }
            if (back == 0 && kvt_client_put(c, tok, P * PAGE, 0, P, payload, NULL, &r) < 0)
                GET_WRONG(w);
            /* The earlier round's under a lease of 2 ms, which may run out before or during the
             * GET: a writer's REMOVE then waits for the GET's own pin (retried on loop 0's tick
             * while this loop writes the batch), or the GET finds no lease (ENOENT). */
            m = (kvt_client_match_t){0};
            if (kvt_client_match(c, tok, P * PAGE, KVT_CLIENT_LEASE, back ? 2 : 10000, NULL, &m) <
                0)
                GET_WRONG(w);
            if (m.pages == 0)
                continue; /* removed or evicted whole */
            /* Every fourth such GET is read slowly: the daemon's writes of it wait for the socket
             * (EAGAIN, then EPOLLOUT) past the lease's end and loop 0's tick drops the lease, so a
             * writer's REMOVE finds the GET's pin alone and waits for it: the batch's pages must
             * stay put through the writes that follow. */
            get_check_t ck = {.w = w,
                              .sums = sums[K],
                              .first = 0,
                              .n = m.pages,
                              .slow_ms = back && round % 4 == 1 ? 80 : 0};
            uint32_t got = 0;
            int rc = kvt_client_get_cb(c, m.lease, 0, m.pages, get_check_page, &ck, &got);
            /* A page lost on the way ends the GET early (an error with the pages before it). */
            if ((rc < 0 && rc != KVT_CLIENT_ENOENT) || got != ck.seen ||
                (rc == 0 && got != m.pages))
                GET_WRONG_RC(w, rc);
            w->pages += got;
            rc = kvt_client_release(c, m.lease, NULL);
            if (rc < 0 && !(back && rc == KVT_CLIENT_ENOENT))
                GET_WRONG(w);
        }
    }
    /* The leases last until the writers are done: they PUT over the leased prefixes, which must
     * still hold their bytes (once let go, the step may push them out). */
    __atomic_store_n(&w->finished, 1, __ATOMIC_RELAXED);
    pthread_barrier_wait(w->start);
    for (int k = 0; k < K; k++)
        if (lease[k] && kvt_client_release(c, lease[k], NULL) < 0)
            GET_WRONG(w);
    if (c)
        kvt_client_close(c);
    free(payload);
    return NULL;
}

Test(server_loops, gets_from_dram_leave_the_lock_while_others_write)
{
    kvd_t d = {0};
    kvd_start(&d, "--loops", "2", "--dram-bytes", "16M", "--nvme-bytes", "16M", NULL);
    enum { R = 4, N = 6 };
    pthread_t th[N];
    getter_t w[N];
    pthread_barrier_t start;
    pthread_barrier_init(&start, NULL, N);
    /* The readers connect first, one at a time: two on each loop (the fewest first). */
    for (int i = 0; i < N; i++) {
        w[i] = (getter_t){.d = &d, .start = &start, .all = w, .id = i, .reader = i < R};
        if (i < R)
            w[i].c = kvd_client(&d, "g", PAGE, GBB);
    }
    cr_assert_eq(kvd_stat(w[0].c, "loop_connections_0"), 2);
    cr_assert_eq(kvd_stat(w[0].c, "loop_connections_1"), 2);
    for (int i = 0; i < N; i++)
        pthread_create(&th[i], NULL, getter_main, &w[i]);
    int errors = 0, line = 0, rc = 0;
    uint64_t pages = 0, dram = 0, removed = 0;
    for (int i = 0; i < N; i++) {
        pthread_join(th[i], NULL);
        errors += w[i].errors;
        rc = line ? rc : w[i].rc;
        line = line ? line : w[i].line;
        pages += w[i].pages;
        dram += w[i].dram_pages;
        removed += w[i].removed;
    }
    pthread_barrier_destroy(&start);
    if (errors)
        kvd_log_tail(&d, 4000); /* a connection closed under the readers says why there */
    cr_expect_eq(errors, 0, "%d wrong replies or pages, the first at line %d (rc %d)", errors, line,
                 rc);
    cr_expect_gt(pages, 0, "the churn prefixes were read back");
    cr_expect_gt(removed, 0, "the writers removed churn prefixes the readers had read");
    cr_expect_geq(dram, (uint64_t)R * 40 * 2 * 7, "the GETs were of DRAM blocks (%llu pages)",
                  (unsigned long long)dram);
    double dropped = kvd_metric(&d, "kvtier_blocks_dropped_total{tier=\"dram\"}"),
           demoted = kvd_metric(&d, "kvtier_blocks_moved_total{from=\"dram\",to=\"nvme\"}");
    cr_expect(dropped > 0 || demoted > 0, "the writers pushed blocks out of DRAM (%g, %g)", dropped,
              demoted);
    /* Most of them planned, written and released under the shared lock (op_get.c), on both loops:
     * their read counts in their loops' tables are what the REMOVEs and evictions meet. */
    for (int i = 0; i < 2; i++) {
        char key[64];
        snprintf(key, sizeof key, "kvtier_loop_shared_gets_total{loop=\"%d\"}", i);
        cr_expect_gt(kvd_metric(&d, key), 0, "loop %d: GETs planned shared", i);
    }
    cr_expect_eq(kvd_stop(&d), 0);
    kvd_cleanup(&d);
}

/* A GET's reply leaves with the lock let go, so the client may have its last byte, and ask
 * STATS on a connection of the other loop, before the loop that wrote it takes the lock back:
 * the GET must be counted before its final frame is written, as a plain reply is before it is
 * queued. */
Test(server_loops, a_get_is_counted_before_its_last_byte_is_out)
{
    kvd_t d = {0};
    kvd_start(&d, "--loops", "2", NULL);
    /* The fewest first: a on loop 0, b on loop 1. */
    kvt_client_t *a = kvd_client(&d, "m", PAGE, 256 << 10),
                 *b = kvd_client(&d, "m", PAGE, 256 << 10);
    cr_assert(a && b);
    cr_assert_eq(kvd_stat(b, "loop_connections_1"), 1);
    enum { P = 4 };
    static uint32_t tok[P * PAGE];
    static uint8_t payload[P << 18], back[P << 18];
    kvd_tokens(tok, P * PAGE, 4242);
    kvd_fill(payload, sizeof payload, 7);
    kvt_client_put_t pr;
    cr_assert_eq(kvt_client_put(a, tok, P * PAGE, 0, P, payload, NULL, &pr), 0);
    kvt_client_match_t m = {0};
    cr_assert_eq(kvt_client_match(a, tok, P * PAGE, KVT_CLIENT_LEASE, 0, NULL, &m), 0);
    cr_assert_eq(m.pages, P);
    int stale = 0;
    for (int i = 0; i < 300; i++) {
        uint64_t before = kvd_stat(b, "requests_get");
        uint32_t got = 0;
        cr_assert_eq(kvt_client_get(a, m.lease, 0, P, back, sizeof back, &got, NULL), 0);
        cr_assert_eq(got, P);
        stale += kvd_stat(b, "requests_get") != before + 1;
    }
    cr_expect_eq(stale, 0, "%d of 300 GETs not yet counted when their reply was in", stale);
    cr_expect(memcmp(back, payload, sizeof back) == 0);
    kvt_client_close(a);
    kvt_client_close(b);
    kvd_cleanup(&d);
}

/* Loop i's write-lock takes so far (kvtier_loop_write_locks_total), read through the metrics port
 * (loop 0's), so that the reading itself takes none on loop i. */
static double write_locks(const kvd_t *d, int i)
{
    char key[64];
    snprintf(key, sizeof key, "kvtier_loop_write_locks_total{loop=\"%d\"}", i);
    double v = kvd_metric(d, key);
    cr_assert_geq(v, 0, "no series %s", key);
    return v;
}

/* Starts d with `loops` loops (at most 4) and connects one client of model "m" to each, c[i] on
 * loop i, zero-copy ones (kvd_client_map) if zero_copy; returns the loops. */
static int client_a_loop(kvd_t *d, const char *loops, int zero_copy, kvt_client_t **c)
{
    kvd_start(d, "--loops", loops, NULL);
    int n = atoi(loops);
    cr_assert_leq(n, 4);
    for (int i = 0; i < n; i++)
        c[i] = kvd_client_map(d, "m", PAGE, BB, zero_copy);
    char key[64];
    for (int i = 0; i < n; i++) {
        snprintf(key, sizeof key, "loop_connections_%d", i);
        cr_assert_eq(kvd_stat(c[0], key), 1, "c[%d] is loop %d's", i, i);
    }
    return n;
}

/* client_a_loop's clients close and its daemon stops. */
static void client_a_loop_stop(kvd_t *d, kvt_client_t **c, int n)
{
    for (int i = 0; i < n; i++)
        kvt_client_close(c[i]);
    cr_expect_eq(kvd_stop(d), 0);
    kvd_cleanup(d);
}

/* Loop i's series of a lock histogram (kvtier_loop_*_lock_*_seconds): its count or its sum. */
static double lock_series(const kvd_t *d, const char *hist, const char *part, int i)
{
    char key[128];
    snprintf(key, sizeof key, "kvtier_loop_%s_seconds_%s{loop=\"%d\"}", hist, part, i);
    double v = kvd_metric(d, key);
    cr_assert_geq(v, 0, "no series %s", key);
    return v;
}

/* The store's lock, timed per loop: every write-lock take of a loop is one wait and one hold in
 * its histograms (kvtier_loop_write_lock_wait_seconds, _hold_seconds; a scrape, on loop 0,
 * runs while no other loop holds the lock, so each of their holds has ended and been observed),
 * a run of MATCHes adds shared waits, and a loop's holds, one after another on
 * its own thread, add up to no more than the wall time they fell in (a unit wrong by 1,000 would
 * fail that or the > 0). STATS has each sum in us (loop_write_lock_hold_us_1, ...). The MATCHes'
 * deferred hits, applied by the next write lock, count in kvtier_loop_deferred_hits_total. */
Test(server_loops, the_lock_is_timed_per_loop, .timeout = 60)
{
    kvd_t d = {0};
    kvt_client_t *c[2];
    int n = client_a_loop(&d, "2", 0, c);
    enum { P = 4, R = 40 };
    static uint32_t tok[P * PAGE];
    static uint8_t payload[P * BB];
    double hold0[2], wait0[2], shared0[2], hold_sum0[2], wait_sum0[2], locks0[2];
    for (int i = 0; i < n; i++) {
        locks0[i] = write_locks(&d, i);
        hold0[i] = lock_series(&d, "write_lock_hold", "count", i);
        wait0[i] = lock_series(&d, "write_lock_wait", "count", i);
        shared0[i] = lock_series(&d, "shared_lock_wait", "count", i);
        hold_sum0[i] = lock_series(&d, "write_lock_hold", "sum", i);
        wait_sum0[i] = lock_series(&d, "write_lock_wait", "sum", i);
    }
    cr_assert_eq(hold0[1], locks0[1], "loop 1: a hold per write lock (%.0f, %.0f)", hold0[1],
                 locks0[1]);
    uint64_t t0 = kvt_now_ns();
    for (int k = 0; k < R; k++) { /* loop 1: PUTs (write locks), then a run of MATCHes */
        kvt_client_put_t r;
        kvd_tokens(tok, P * PAGE, (uint32_t)(3000000 + k * 1000));
        cr_assert_eq(kvt_client_put(c[1], tok, P * PAGE, 0, P, payload, NULL, &r), 0);
    }
    double locks_put = write_locks(&d, 1);
    double shared_put = lock_series(&d, "shared_lock_wait", "count", 1);
    double deferred0 = kvd_metric(&d, "kvtier_loop_deferred_hits_total{loop=\"1\"}");
    for (int k = 0; k < R; k++) {
        kvt_client_match_t m = {0};
        kvd_tokens(tok, P * PAGE, (uint32_t)(3000000 + k * 1000));
        cr_assert_eq(kvt_client_match(c[1], tok, P * PAGE, 0, 0, NULL, &m), 0);
        cr_assert_eq(m.pages, P);
    }
    uint64_t wall = kvt_now_ns() - t0;
    /* Each MATCH's use of its path was deferred, and the scrape's write lock applied it. */
    cr_assert_eq(kvd_metric(&d, "kvtier_loop_deferred_hits_total{loop=\"1\"}") - deferred0, R,
                 "loop 1's MATCHes deferred one hit each");
    /* (The step after the last PUT's batch may take one more after its reply: the MATCHes' own
     * write locks are other tests', runs_take_no_write_lock's.) */
    cr_assert_geq(locks_put - locks0[1], R, "each PUT took the write lock on loop 1");
    for (int i = 0; i < n; i++) {
        double locks = write_locks(&d, i);
        double hold = lock_series(&d, "write_lock_hold", "count", i);
        double wait = lock_series(&d, "write_lock_wait", "count", i);
        double hold_sum = lock_series(&d, "write_lock_hold", "sum", i) - hold_sum0[i];
        double wait_sum = lock_series(&d, "write_lock_wait", "sum", i) - wait_sum0[i];
        if (i == 1) {
            cr_assert_eq(hold - hold0[i], locks - locks0[i], "loop 1: one hold per write lock");
            cr_assert_gt(hold_sum, 0, "loop 1 held the write lock for some time");
            cr_assert_lt(hold_sum, wall / 1e9,
                         "loop 1's holds (%.6f s) fit in the %.6f s they "
                         "fell in",
                         hold_sum, wall / 1e9);
        } else { /* loop 0's own hold, the scrape's, is still going on: counted once it ends */
            cr_assert_geq(hold - hold0[i], locks - locks0[i] - 1);
        }
        cr_assert_eq(wait - wait0[i], locks - locks0[i], "loop %d: one wait per write lock", i);
        cr_assert_geq(wait_sum, 0);
        cr_assert_lt(wait_sum, wall / 1e9 + 1, "loop %d waited %.6f s", i, wait_sum);
    }
    cr_assert_gt(lock_series(&d, "shared_lock_wait", "count", 1), shared_put,
                 "the MATCHes took the lock shared on loop 1");
    /* STATS has loop 1's sums too, in us (loop 1 idle: the same as the scrape's). */
    const char *hists[] = {"write_lock_hold", "write_lock_wait", "shared_lock_wait"};
    for (int h = 0; h < 3; h++) {
        char key[64];
        snprintf(key, sizeof key, "loop_%s_us_1", hists[h]);
        double us = lock_series(&d, hists[h], "sum", 1) * 1e6;
        uint64_t st = kvd_stat(c[0], key);
        cr_assert(st + 1 >= (uint64_t)us && st <= (uint64_t)us + 1, "STATS %s %llu, scrape %.1f us",
                  key, (unsigned long long)st, us);
    }
    cr_assert_gt(shared0[0] + lock_series(&d, "shared_lock_wait", "count", 0), 0);
    client_a_loop_stop(&d, c, n);
}

/*
 * A run of pipelined MATCHes without a lease (hits, misses a page longer, PROBEs) is framed and
 * answered under the store's lock shared, in one hold: the loop that serves it takes no write
 * lock (issue 42), while a PUT on the same connection takes one. Each loop past 0 is checked (one
 * client each; loop 0 takes the lock for writing for its own work). The metrics scrape between
 * rounds, on loop 0, applies the hits the rounds deferred. The counters still come out as sent.
 */
static void runs_take_no_write_lock(const char *loops)
{
    kvd_t d = {0};
    kvt_client_t *c[4];
    int n = client_a_loop(&d, loops, 0, c);
    char key[64];
    enum { P = 4, B = 32, R = 8 };
    static uint32_t tok[(P + 1) * PAGE];
    static uint8_t payload[P * BB];
    uint64_t lookups = 0, missed = 0;
    for (int i = 1; i < n; i++) {
        kvd_tokens(tok, (P + 1) * PAGE, (uint32_t)i * 1000000u);
        kvd_fill(payload, sizeof payload, (uint32_t)i);
        double w0 = write_locks(&d, i);
        kvt_client_put_t r;
        cr_assert_eq(kvt_client_put(c[i], tok, P * PAGE, 0, P, payload, NULL, &r), 0);
        cr_assert_eq(r.stored, P);
        /* The PUT's loop takes the lock back after writing its reply, which the client may have
         * first: a MATCH's round trip after it waits for that. */
        kvt_client_match_t one = {0};
        cr_assert_eq(kvt_client_match(c[i], tok, P * PAGE, 0, 0, NULL, &one), 0);
        lookups++;
        double w1 = write_locks(&d, i);
        cr_expect_geq(w1 - w0, 1, "loop %d: a PUT takes the write lock (%g)", i, w1 - w0);
        kvt_batch_t *b;
        cr_assert_eq(kvt_batch_create(&b, c[i]), 0);
        for (int round = 0; round < R; round++) {
            kvt_client_match_t m[B];
            uint8_t tiers[B][P + 1];
            int st[B];
            for (int k = 0; k < B; k++) {
                m[k] = (kvt_client_match_t){.tiers = tiers[k], .tiers_cap = P + 1};
                unsigned flags = k % 8 == 3 ? KVT_CLIENT_PROBE : 0;
                lookups += !flags;
                missed += !flags && k % 2;
                cr_assert_eq(kvt_batch_match(b, tok, (k % 2 ? P + 1 : P) * PAGE, flags, 0, NULL,
                                             &m[k], &st[k]),
                             0);
            }
            double before = write_locks(&d, i);
            cr_assert_eq(kvt_batch_run(b), 0);
            double after = write_locks(&d, i);
            for (int k = 0; k < B; k++) {
                cr_expect_eq(st[k], 0, "loop %d, MATCH %d", i, k);
                cr_expect_eq(m[k].pages, P, "loop %d, MATCH %d", i, k);
                cr_expect_eq(tiers[k][0], KVT_TIER_DRAM);
            }
            cr_expect_eq(after - before, 0,
                         "loop %d, round %d: %g write locks for %d pipelined MATCHes", i, round,
                         after - before, B);
        }
        kvt_batch_destroy(b);
        snprintf(key, sizeof key, "kvtier_loop_shared_matches_total{loop=\"%d\"}", i);
        cr_expect_eq(kvd_metric(&d, key), R * B + 1, "loop %d: every MATCH answered shared", i);
    }
    cr_expect_eq(kvd_metric(&d, "kvtier_lookups_total"), (double)lookups);
    cr_expect_eq(kvd_metric(&d, "kvtier_hit_tokens_total{tier=\"dram\"}"),
                 (double)lookups * P * PAGE);
    cr_expect_eq(kvd_metric(&d, "kvtier_miss_tokens_total{reason=\"never_seen\"}"),
                 (double)missed * PAGE);
    client_a_loop_stop(&d, c, n);
}

Test(server_loops, a_run_of_matches_takes_no_write_lock)
{
    runs_take_no_write_lock("2");
}

Test(server_loops, a_run_of_matches_on_four_loops_takes_no_write_lock)
{
    runs_take_no_write_lock("4");
}

/* A zero-copy GET's page as kvt_client_get_cb hands it: where it lies (in the client's mapping, a
 * location, or a buffer of the reply) and whether its bytes are want's, from page first on. */
typedef struct loc_check {
    const uint8_t *map, *want;
    const uint8_t **ptrs; /* if not NULL: per page, where it lies in the mapping, or NULL */
    uint64_t map_bytes;
    uint32_t first, n, bb, seen, located; /* pages [first, first + n) asked for */
    int wrong;
} loc_check_t;

static int loc_check_page(void *arg, uint32_t page, unsigned tier, const void *data, uint32_t len)
{
    loc_check_t *k = arg;
    const uint8_t *p = data;
    int in_map = p >= k->map && p + len <= k->map + k->map_bytes;
    (void)tier; /* a located page lies in the mapping: DRAM's */
    if (k->seen >= k->n || page != k->first + k->seen || len != k->bb) {
        k->wrong++;
        return 1;
    }
    if (k->ptrs)
        k->ptrs[k->seen] = in_map ? p : NULL;
    k->located += (uint32_t)in_map;
    k->wrong += memcmp(p, k->want + (size_t)k->seen * k->bb, len) != 0;
    k->seen++;
    return 0;
}

/*
 * A GET whose pages all lie in DRAM is framed, planned, written and released under the store's
 * lock shared (op_get.c, kvt__h_get_shared): the loop that serves it takes no write lock (issue
 * 42), on each loop past 0 (one client each; loop 0 takes the lock for writing for its own work).
 * With zero_copy the clients map their namespace's arena, store through it, and GET with LOCATE
 * (step 8): the daemon answers where the pages lie in the mapping. Each round GETs the whole
 * leased prefix (with LOCATE copied from the mapping, kvt_client_get) and a page of it
 * (kvt_client_get_cb: with LOCATE a pointer into the mapping), checking the bytes; the MATCH
 * after the last GET (shared too) comes after the loop released the GET's batch, so that a write
 * lock the release took would be counted. The requests, and the located pages, still count as
 * sent.
 */
static void gets_take_no_write_lock(const char *loops, int zero_copy)
{
    kvd_t d = {0};
    kvt_client_t *c[4];
    int n = client_a_loop(&d, loops, zero_copy, c);
    char key[64];
    enum { P = 4, R = 16 };
    static uint32_t tok[P * PAGE];
    static uint8_t payload[P * BB], back[P * BB];
    uint64_t gets = 0, located = 0;
    for (int i = 1; i < n; i++) {
        kvd_tokens(tok, P * PAGE, 9400000u + (uint32_t)i * 100000u);
        kvd_fill(payload, sizeof payload, 94 + (uint32_t)i);
        kvt_client_put_t r;
        cr_assert_eq(kvt_client_put(c[i], tok, P * PAGE, 0, P, payload, NULL, &r), 0);
        cr_assert_eq(r.stored, P);
        kvt_client_match_t m = {0};
        cr_assert_eq(kvt_client_match(c[i], tok, P * PAGE, KVT_CLIENT_LEASE, 60000, NULL, &m), 0);
        cr_assert_eq(m.pages, P);
        kvt_client_match_t one = {0};
        cr_assert_eq(kvt_client_match(c[i], tok, P * PAGE, 0, 0, NULL, &one), 0);
        double w0 = write_locks(&d, i);
        for (int round = 0; round < R; round++) {
            uint32_t got = 0, first = (uint32_t)round % P;
            memset(back, 0, sizeof back);
            cr_assert_eq(kvt_client_get(c[i], m.lease, 0, P, back, sizeof back, &got, NULL), 0);
            cr_expect_eq(got, P, "loop %d, round %d", i, round);
            cr_expect(memcmp(back, payload, sizeof back) == 0, "loop %d, round %d: the bytes", i,
                      round);
            loc_check_t k = {
                .want = payload + (size_t)first * BB, .first = first, .n = 1, .bb = BB};
            k.map = kvt_client_mapping(c[i], &k.map_bytes);
            cr_assert_eq(kvt_client_get_cb(c[i], m.lease, first, 1, loc_check_page, &k, &got), 0);
            cr_expect_eq(got, 1);
            cr_expect_eq(k.located, (uint32_t)zero_copy, "loop %d, round %d: where it lies", i,
                         round);
            cr_expect_eq(k.wrong, 0, "loop %d, round %d: the page's bytes", i, round);
            gets += 2;
            located += zero_copy ? P + 1 : 0;
        }
        cr_assert_eq(kvt_client_match(c[i], tok, P * PAGE, 0, 0, NULL, &one), 0);
        double w1 = write_locks(&d, i);
        cr_expect_eq(w1 - w0, 0, "loop %d: %g write locks for %d GETs of DRAM pages%s", i, w1 - w0,
                     2 * R, zero_copy ? " with LOCATE" : "");
        snprintf(key, sizeof key, "kvtier_loop_shared_gets_total{loop=\"%d\"}", i);
        cr_expect_eq(kvd_metric(&d, key), 2 * R, "loop %d: every GET planned shared", i);
    }
    cr_expect_eq(kvd_metric(&d, "kvtier_zero_copy_pages_total{op=\"get\"}"), (double)located);
    cr_expect_eq(kvd_metric(&d, "kvtier_requests_total{op=\"get\"}"), (double)gets);
    cr_expect_eq(kvd_metric(&d, "kvtier_request_errors_total{op=\"get\"}"), 0);
    client_a_loop_stop(&d, c, n);
}

Test(server_loops, gets_from_dram_take_no_write_lock)
{
    gets_take_no_write_lock("2", 0);
}

Test(server_loops, gets_from_dram_on_four_loops_take_no_write_lock)
{
    gets_take_no_write_lock("4", 0);
}

Test(server_loops, locate_gets_take_no_write_lock)
{
    gets_take_no_write_lock("2", 1);
}

Test(server_loops, locate_gets_on_four_loops_take_no_write_lock)
{
    gets_take_no_write_lock("4", 1);
}

/*
 * A MATCH with LEASE (without KEEP, REMOTE or LOCATE) is answered under the store's lock shared,
 * its lease taken under s->lease_mu (op_match.c, shared_lease): the loop that serves a run of
 * them takes no write lock (issue 42), on each loop past 0, one client each. With nvme the path
 * lies in DRAM and NVMe (16 pages of 64 KiB, 1 MiB of DRAM: the step moves the rest down), so
 * that each lease pins NVMe blocks too. Every lease is its own and holds the whole path, a GET
 * under the first and the last reads it back, and STATS counts them; the RELEASEs after may take
 * the write lock, and leave no lease.
 */
#define LSB (64u << 10)
/* The deferred hits a loop keeps (server.h KVT_LOOP_HITS): a run past them takes the write lock
 * to apply them. */
#define KVT_TEST_LOOP_HITS 256

/* STATS' leases once it is want, or after 5 s: the step's moves pin their paths too while they
 * run (counted there), and the path in DRAM and NVMe may have one in flight; a close on another
 * loop lets its leases go after the client has gone on. */
static double leases_now(kvt_client_t *c, double want)
{
    uint64_t t0 = kvt_now_ns();
    double v;
    while ((v = kvd_stat(c, "leases")) != want && kvt_now_ns() - t0 < 5000000000ull)
        usleep(10 * 1000);
    return v;
}

static void leases_take_no_write_lock(const char *loops, int nvme)
{
    kvd_t d = {0};
    if (nvme)
        kvd_start(&d, "--loops", loops, "--dram-bytes", "1M", "--nvme-bytes", "64M", "--tick-ms",
                  "10000", NULL);
    else
        kvd_start(&d, "--loops", loops, NULL);
    int n = atoi(loops);
    cr_assert_leq(n, 4);
    kvt_client_t *c[4];
    char key[96];
    for (int i = 0; i < n; i++) {
        c[i] = kvd_client(&d, "m", PAGE, LSB);
        snprintf(key, sizeof key, "loop_connections_%d", i);
        cr_assert_eq(kvd_stat(c[0], key), 1, "c[%d] is loop %d's", i, i);
    }
    enum { P = 16, B = 32 };
    static uint32_t tok[(P + 1) * PAGE];
    static uint8_t payload[P * LSB], back[P * LSB];
    double held = 0;
    for (int i = 1; i < n; i++) {
        kvd_tokens(tok, (P + 1) * PAGE, 9800000u + (uint32_t)i * 100000u);
        kvd_fill(payload, sizeof payload, 980 + (uint32_t)i);
        kvt_client_put_t r;
        cr_assert_eq(kvt_client_put(c[i], tok, P * PAGE, 0, P, payload, NULL, &r), 0);
        cr_assert_eq(r.stored, P);
        uint8_t tiers0[P];
        kvt_client_match_t one = {.tiers = tiers0, .tiers_cap = P};
        uint64_t t0 = kvt_now_ns();
        for (;;) {
            cr_assert_eq(kvt_client_match(c[i], tok, P * PAGE, 0, 0, NULL, &one), 0);
            cr_assert_eq(one.pages, P);
            if (!nvme ||
                (memchr(tiers0, KVT_CLIENT_TIER_NVME, P) &&
                 memchr(tiers0, KVT_CLIENT_TIER_DRAM, P)) ||
                kvt_now_ns() - t0 > 10000000000ull)
                break;
            usleep(10 * 1000);
        }
        if (nvme)
            cr_assert(memchr(tiers0, KVT_CLIENT_TIER_NVME, P), "loop %d: the path is in NVMe", i);
        snprintf(key, sizeof key, "kvtier_loop_shared_matches_total{loop=\"%d\"}", i);
        double shared = kvd_metric(&d, key);
        kvt_batch_t *b;
        cr_assert_eq(kvt_batch_create(&b, c[i]), 0);
        kvt_client_match_t m[B];
        int st[B];
        for (int k = 0; k < B; k++) {
            m[k] = (kvt_client_match_t){0};
            unsigned flags = KVT_CLIENT_LEASE | (k % 8 == 3 ? KVT_CLIENT_PROBE : 0);
            cr_assert_eq(kvt_batch_match(b, tok, (k % 2 ? P + 1 : P) * PAGE, flags, 60000, NULL,
                                         &m[k], &st[k]),
                         0);
        }
        double before = write_locks(&d, i);
        cr_assert_eq(kvt_batch_run(b), 0);
        double after = write_locks(&d, i);
        cr_expect_eq(after - before, 0, "loop %d: %g write locks for %d pipelined leased MATCHes",
                     i, after - before, B);
        cr_expect_eq(kvd_metric(&d, key) - shared, B, "loop %d: every leased MATCH shared", i);
        for (int k = 0; k < B; k++) {
            cr_expect_eq(st[k], 0, "loop %d, MATCH %d", i, k);
            cr_expect_eq(m[k].pages, P, "loop %d, MATCH %d", i, k);
            cr_expect_neq(m[k].lease, 0, "loop %d, MATCH %d", i, k);
            for (int j = 0; j < k; j++)
                cr_expect_neq(m[k].lease, m[j].lease, "loop %d: MATCHes %d and %d", i, j, k);
        }
        held += B;
        double now = leases_now(c[0], held);
        cr_expect_eq(now, held, "loop %d: the leases held (%g)", i, now);
        cr_expect_eq(kvd_metric(&d, "kvtier_leases"), now, "loop %d: the gauge", i);
        for (int k = 0; k < B; k += B - 1) {
            uint32_t got = 0;
            memset(back, 0, sizeof back);
            cr_expect_eq(kvt_client_get(c[i], m[k].lease, 0, P, back, sizeof back, &got, NULL), 0);
            cr_expect_eq(got, P, "loop %d: the GET under lease %d", i, k);
            cr_expect(memcmp(back, payload, sizeof back) == 0, "loop %d, lease %d: the bytes", i,
                      k);
        }
        for (int k = 0; k < B; k++)
            cr_assert_eq(kvt_batch_release(b, m[B - 1 - k].lease, &st[k]), 0);
        cr_assert_eq(kvt_batch_run(b), 0);
        for (int k = 0; k < B; k++)
            cr_expect_eq(st[k], 0, "loop %d: RELEASE %d", i, k);
        kvt_batch_destroy(b);
        held -= B;
        double left = leases_now(c[0], held);
        cr_expect_eq(left, held, "loop %d: released (%g left)", i, left);
    }
    cr_expect_eq(leases_now(c[0], 0), 0);
    cr_expect_eq(kvd_metric(&d, "kvtier_leases"), 0);
    cr_expect_eq(kvd_metric(&d, "kvtier_request_errors_total{op=\"match\"}"), 0);
    for (int i = 0; i < n; i++)
        kvt_client_close(c[i]);
    cr_expect_eq(kvd_stop(&d), 0);
    kvd_cleanup(&d);
}

Test(server_loops, leased_matches_take_no_write_lock, .timeout = 60)
{
    leases_take_no_write_lock("2", 0);
}

Test(server_loops, leased_matches_on_four_loops_take_no_write_lock, .timeout = 60)
{
    leases_take_no_write_lock("4", 0);
}

Test(server_loops, leased_matches_of_nvme_pages_take_no_write_lock, .timeout = 60)
{
    leases_take_no_write_lock("2", 1);
}

/*
 * The vLLM connector's loads MATCH with LEASE and KEEP, and with LEASE, LOCATE and KEEP
 * (python/kvtier/vllm/store.py): such a MATCH is answered under the store's lock shared as well
 * (op_match.c, kvt__h_match_shared), its handle kept in the connection's own table, its
 * locations read as a shared GET with LOCATE reads them and counted in the loop's metric table.
 * Each loop past 0 has a zero-copy client that stores a path of P pages through its mapping and
 * pipelines B such MATCHes (a page longer, PROBEs among them): no write lock, each counted in
 * kvtier_loop_shared_matches_total. A one-loop daemon (the write path's answers) gets the same
 * requests on a client of its own: the same pages, tiers, handles, located pages and offsets.
 * Every located page reads its own bytes where it lies, the last handle names the path for a
 * PUT of one page more, and the counters (lookups, located pages) and the clients' memory come
 * out the same on both; the RELEASEs after may take the write lock.
 */
static void kept_take_no_write_lock(const char *loops, unsigned flags)
{
    kvd_t d = {0}, one = {0};
    kvt_client_t *c[4];
    int n = client_a_loop(&d, loops, 1, c);
    kvd_start(&one, "--loops", "1", NULL);
    kvt_client_t *refs[4] = {0};
    enum { P = 4, B = 32 };
    static uint32_t tok[(P + 1) * PAGE];
    static uint8_t payload[(P + 1) * BB];
    char key[96];
    uint64_t located = 0, lookups = 0;
    int locate = (flags & KVT_CLIENT_LOCATE) != 0;
    for (int i = 1; i < n; i++) {
        kvt_client_t *ref = refs[i] = kvd_client_map(&one, "m", PAGE, BB, 1);
        kvd_tokens(tok, (P + 1) * PAGE, 9900000u + (uint32_t)i * 100000u);
        kvd_fill(payload, sizeof payload, 990 + (uint32_t)i);
        kvt_client_put_t r;
        cr_assert_eq(kvt_client_put(c[i], tok, P * PAGE, 0, P, payload, NULL, &r), 0);
        cr_assert_eq(r.stored, P);
        cr_assert_eq(kvt_client_put(ref, tok, P * PAGE, 0, P, payload, NULL, &r), 0);
        cr_assert_eq(r.stored, P);
        kvt_client_match_t first = {0};
        cr_assert_eq(kvt_client_match(c[i], tok, P * PAGE, 0, 0, NULL, &first), 0);
        lookups++;
        snprintf(key, sizeof key, "kvtier_loop_shared_matches_total{loop=\"%d\"}", i);
        double shared = kvd_metric(&d, key);
        static kvt_client_match_t m[2][B];
        static kvt_client_step_t st[2][B];
        static kvt_client_loc_t locs[2][B][P + 1];
        static uint8_t tiers[2][B][P + 1];
        int status[2][B];
        double locks = 0;
        for (int side = 0; side < 2; side++) {
            kvt_batch_t *b;
            cr_assert_eq(kvt_batch_create(&b, side ? ref : c[i]), 0);
            for (int k = 0; k < B; k++) {
                m[side][k] = (kvt_client_match_t){.tiers = tiers[side][k], .tiers_cap = P + 1};
                st[side][k] = (kvt_client_step_t){.locs = locs[side][k], .locs_cap = P + 1};
                unsigned f = flags | (k % 8 == 3 ? KVT_CLIENT_PROBE : 0);
                lookups += !side && k % 8 != 3;
                cr_assert_eq(kvt_batch_match_step(b, tok, (k % 2 ? P + 1 : P) * PAGE, f, 60000,
                                                  NULL, &m[side][k], &st[side][k],
                                                  &status[side][k]),
                             0);
            }
            double before = side ? 0 : write_locks(&d, i);
            cr_assert_eq(kvt_batch_run(b), 0);
            if (!side)
                locks = write_locks(&d, i) - before;
            kvt_batch_destroy(b);
        }
        cr_expect_eq(locks, 0, "loop %d: %g write locks for %d pipelined MATCHes (flags %#x)", i,
                     locks, B, flags);
        cr_expect_eq(kvd_metric(&d, key) - shared, B, "loop %d: every MATCH answered shared", i);
        const uint8_t *map = kvt_client_mapping(c[i], NULL);
        for (int k = 0; k < B; k++) {
            const kvt_client_match_t *a = &m[0][k], *w = &m[1][k];
            const kvt_client_step_t *sa = &st[0][k], *sw = &st[1][k];
            cr_expect_eq(status[0][k], 0, "loop %d, MATCH %d", i, k);
            cr_expect_eq(status[1][k], 0, "the write path's MATCH %d", k);
            cr_expect_eq(a->pages, P, "loop %d, MATCH %d", i, k);
            cr_expect_eq(a->pages, w->pages, "loop %d, MATCH %d: pages", i, k);
            cr_expect_eq(a->tokens, w->tokens, "loop %d, MATCH %d: tokens", i, k);
            cr_expect(memcmp(tiers[0][k], tiers[1][k], P) == 0, "loop %d, MATCH %d: tiers", i, k);
            cr_expect_neq(a->lease, 0, "loop %d, MATCH %d: a lease", i, k);
            cr_expect_neq(w->lease, 0, "the write path's MATCH %d: a lease", k);
            cr_expect_neq(sa->handle, 0, "loop %d, MATCH %d: a handle", i, k);
            cr_expect_eq(sa->handle, sw->handle, "loop %d, MATCH %d: handle", i, k);
            cr_expect_eq(sa->kept, sw->kept, "loop %d, MATCH %d: kept", i, k);
            cr_expect_eq(sa->located, sw->located, "loop %d, MATCH %d: located", i, k);
            cr_expect_eq(sa->located, locate ? P : 0, "loop %d, MATCH %d: located", i, k);
            located += sa->located;
            for (uint32_t p = 0; locate && p < P; p++) {
                cr_expect_eq(sa->locs[p].tier, sw->locs[p].tier, "loop %d, MATCH %d, page %u", i, k,
                             p);
                cr_expect_eq(sa->locs[p].offset, sw->locs[p].offset,
                             "loop %d, MATCH %d, page %u: its offset", i, k, p);
                cr_expect(sa->locs[p].host_ptr == map + sa->locs[p].offset,
                          "loop %d, MATCH %d, page %u: in the mapping", i, k, p);
                cr_expect(sa->locs[p].host_ptr &&
                              memcmp(sa->locs[p].host_ptr, payload + (size_t)p * BB, BB) == 0,
                          "loop %d, MATCH %d, page %u: its bytes", i, k, p);
            }
        }
        /* The last handle names the path's tokens: a PUT of one page more sends only that page's
         * (both daemons store it). */
        for (int side = 0; side < 2; side++) {
            const kvt_client_step_t *s = &st[side][B - 1];
            cr_assert_eq(kvt_client_put_kept(side ? ref : c[i], s->handle, tok, (P + 1) * PAGE,
                                             s->kept, P, 1, payload + (size_t)P * BB, NULL, &r),
                         0);
            cr_expect_eq(r.pages, P + 1, "side %d: the kept PUT's pages", side);
            cr_expect_eq(r.stored, 1, "side %d: the kept PUT stored its page", side);
        }
        for (int side = 0; side < 2; side++) {
            kvt_batch_t *b;
            cr_assert_eq(kvt_batch_create(&b, side ? ref : c[i]), 0);
            for (int k = 0; k < B; k++)
                cr_assert_eq(kvt_batch_release(b, m[side][k].lease, &status[side][k]), 0);
            cr_assert_eq(kvt_batch_run(b), 0);
            for (int k = 0; k < B; k++)
                cr_expect_eq(status[side][k], 0, "side %d: RELEASE %d", side, k);
            kvt_batch_destroy(b);
        }
        cr_expect_eq(leases_now(c[0], 0), 0, "loop %d: no lease left", i);
    }
    cr_expect_eq(kvd_metric(&d, "kvtier_zero_copy_pages_total{op=\"get\"}"), (double)located);
    cr_expect_eq(kvd_metric(&one, "kvtier_zero_copy_pages_total{op=\"get\"}"), (double)located);
    cr_expect_eq(kvd_metric(&d, "kvtier_lookups_total"), (double)lookups);
    cr_expect_eq(kvd_metric(&one, "kvtier_lookups_total"), (double)lookups - (n - 1));
    cr_expect_eq(kvd_metric(&d, "kvtier_request_errors_total{op=\"match\"}"), 0);
    /* Each loop's client keeps what its one-loop counterpart keeps (its last 16 handles, counted
     * shared in its loop's share of the clients' memory); all of it goes with them. */
    double kept = kvd_metric(&one, "kvtier_client_buffer_bytes");
    cr_expect_gt(kept, 0);
    cr_expect_eq(kvd_metric(&d, "kvtier_client_buffer_bytes"), kept,
                 "the clients' memory: %g, the write path's %g",
                 kvd_metric(&d, "kvtier_client_buffer_bytes"), kept);
    for (int i = 1; i < n; i++) {
        kvt_client_close(refs[i]);
        kvt_client_close(c[i]);
    }
    uint64_t t0 = kvt_now_ns();
    while (kvd_metric(&d, "kvtier_client_buffer_bytes") != 0 && kvt_now_ns() - t0 < 5000000000ull)
        usleep(10 * 1000);
    cr_expect_eq(kvd_metric(&d, "kvtier_client_buffer_bytes"), 0, "the handles' bytes given back");
    cr_expect_eq(kvd_stop(&one), 0);
    kvd_cleanup(&one);
    kvt_client_close(c[0]);
    cr_expect_eq(kvd_stop(&d), 0);
    kvd_cleanup(&d);
}

Test(server_loops, leased_kept_matches_take_no_write_lock, .timeout = 60)
{
    kept_take_no_write_lock("2", KVT_CLIENT_LEASE | KVT_CLIENT_KEEP);
}

Test(server_loops, leased_located_matches_take_no_write_lock, .timeout = 60)
{
    kept_take_no_write_lock("2", KVT_CLIENT_LEASE | KVT_CLIENT_LOCATE | KVT_CLIENT_KEEP);
}

Test(server_loops, leased_located_matches_on_four_loops_take_no_write_lock, .timeout = 60)
{
    kept_take_no_write_lock("4", KVT_CLIENT_LEASE | KVT_CLIENT_LOCATE | KVT_CLIENT_KEEP);
}

/*
 * A RELEASE is answered under the store's lock shared too (lease.c, kvt__h_release_shared): a
 * loop that serves an engine's leased lookups, each MATCH with LEASE and each RELEASE after it,
 * takes no write lock (issue 42), on each loop past 0, one client each. Its leases are let go
 * whether RELEASEd in a pipelined run, again (a double RELEASE finds nothing), or after a GET
 * under it, in front of the next MATCH (kvt_client_release_later, as the engines' connectors do),
 * and STATS and the gauge count none left.
 */
static void releases_take_no_write_lock(const char *loops)
{
    kvd_t d = {0};
    kvt_client_t *c[4];
    int n = client_a_loop(&d, loops, 0, c);
    enum { P = 4, B = 32, STEPS = 64 };
    static uint32_t tok[P * PAGE];
    static uint8_t payload[P * BB];
    for (int i = 1; i < n; i++) {
        kvd_tokens(tok, P * PAGE, 9450000u + (uint32_t)i * 10000u);
        kvd_fill(payload, sizeof payload, 945 + (uint32_t)i);
        kvt_client_put_t r;
        cr_assert_eq(kvt_client_put(c[i], tok, P * PAGE, 0, P, payload, NULL, &r), 0);
        cr_assert_eq(r.stored, P);
        kvt_client_match_t one = {0}; /* after the PUT's loop has the lock back (above) */
        cr_assert_eq(kvt_client_match(c[i], tok, P * PAGE, 0, 0, NULL, &one), 0);
        kvt_batch_t *b;
        cr_assert_eq(kvt_batch_create(&b, c[i]), 0);
        kvt_client_match_t m[B];
        int st[B];
        for (int k = 0; k < B; k++) {
            m[k] = (kvt_client_match_t){0};
            cr_assert_eq(
                kvt_batch_match(b, tok, P * PAGE, KVT_CLIENT_LEASE, 60000, NULL, &m[k], &st[k]), 0);
        }
        cr_assert_eq(kvt_batch_run(b), 0);
        for (int k = 0; k < B; k++)
            cr_assert(st[k] == 0 && m[k].pages == P && m[k].lease, "loop %d, MATCH %d", i, k);
        cr_expect_eq(leases_now(c[0], B), B, "loop %d: the leases held", i);
        /* Pipelined, then each again: the second finds none. */
        char key[96];
        snprintf(key, sizeof key, "kvtier_loop_shared_releases_total{loop=\"%d\"}", i);
        double shared = kvd_metric(&d, key);
        double before = write_locks(&d, i);
        for (int round = 0; round < 2; round++) {
            for (int k = 0; k < B; k++)
                cr_assert_eq(kvt_batch_release(b, m[B - 1 - k].lease, &st[k]), 0);
            cr_assert_eq(kvt_batch_run(b), 0);
            for (int k = 0; k < B; k++)
                cr_expect_eq(st[k], 0, "loop %d, round %d: RELEASE %d", i, round, k);
        }
        int released = 1;
        cr_assert_eq(kvt_client_release(c[i], m[0].lease, &released), 0);
        cr_expect_eq(released, 0, "loop %d: a lease released twice is not held", i);
        double after = write_locks(&d, i);
        cr_expect_eq(after - before, 0, "loop %d: %g write locks for %d pipelined RELEASEs", i,
                     after - before, 2 * B + 1);
        cr_expect_eq(leases_now(c[0], 0), 0, "loop %d: released", i);
        cr_expect_eq(kvd_metric(&d, "kvtier_leases"), 0, "loop %d: the gauge", i);
        kvt_batch_destroy(b);
        /* An engine's steps: a MATCH with LEASE, a GET under it (every other step), then its
         * RELEASE, which goes in front of the next step's MATCH: the GET is over by then. */
        before = write_locks(&d, i);
        uint64_t last = 0;
        int wrong = 0;
        for (int k = 0; k < STEPS; k++) {
            kvt_client_match_t s = {0};
            static uint8_t back[P * BB];
            uint32_t got = 0;
            cr_assert_eq(kvt_client_match(c[i], tok, P * PAGE, KVT_CLIENT_LEASE, 60000, NULL, &s),
                         0);
            cr_assert(s.pages == P && s.lease, "loop %d, step %d", i, k);
            if (k % 2 == 0)
                wrong += kvt_client_get(c[i], s.lease, 0, P, back, sizeof back, &got, NULL) < 0 ||
                         got != P || memcmp(back, payload, sizeof back) != 0;
            if (k < STEPS - 1)
                cr_assert_eq(kvt_client_release_later(c[i], s.lease), 0);
            last = s.lease;
        }
        cr_expect_eq(wrong, 0, "loop %d: %d wrong GETs", i, wrong);
        cr_assert_eq(kvt_client_release(c[i], last, &released), 0);
        cr_expect_eq(released, 1, "loop %d: the last step's lease", i);
        after = write_locks(&d, i);
        cr_expect_eq(after - before, 0, "loop %d: %g write locks for %d leased steps", i,
                     after - before, STEPS);
        cr_expect_eq(leases_now(c[0], 0), 0, "loop %d: every step's lease released", i);
        cr_expect_eq(kvd_metric(&d, "kvtier_leases"), 0);
        cr_expect_eq(kvd_metric(&d, key) - shared, 2 * B + 1 + STEPS,
                     "loop %d: every RELEASE answered shared", i);
    }
    cr_expect_eq(kvd_metric(&d, "kvtier_request_errors_total{op=\"release\"}"), 0);
    client_a_loop_stop(&d, c, n);
}

Test(server_loops, releases_take_no_write_lock, .timeout = 60)
{
    releases_take_no_write_lock("2");
}

Test(server_loops, releases_on_four_loops_take_no_write_lock, .timeout = 60)
{
    releases_take_no_write_lock("4");
}

/*
 * Leases taken under the shared lock keep their paths while another loop writes. 1 MiB of DRAM,
 * no NVMe, 64 KiB pages: loop 1's client leases its path A (4 pages) and holds it, while loop 0's
 * client PUTs 64 fresh prefixes from another thread (16 MiB through 1 MiB: the PUTs evict the
 * oldest pages). Until they are done, and at least 100 times, loop 1 leases A again (shared), GETs
 * it under that lease and RELEASEs it. A leased page is
 * never evicted: every lease holds the whole of A and every GET reads A's own bytes; afterwards A
 * is still whole, the writer evicted pages, and one lease is left.
 */
typedef struct lkeep {
    kvt_client_t *c;
    int done; /* atomic */
    int rc;   /* the PUT that failed, if one did */
    uint32_t rounds;
} lkeep_t;

/* Whether all n tiers are t. */
static int all_in(const uint8_t *tiers, uint32_t n, uint8_t t)
{
    for (uint32_t i = 0; i < n; i++)
        if (tiers[i] != t)
            return 0;
    return 1;
}

static void *lkeep_writer_main(void *arg)
{
    lkeep_t *w = arg;
    static uint32_t tok[4 * PAGE];
    static uint8_t payload[4 * LSB];
    kvd_fill(payload, sizeof payload, 991);
    for (; w->rounds < 64; w->rounds++) {
        kvd_tokens(tok, 4 * PAGE, 9910000u + w->rounds * 100u);
        kvt_client_put_t r;
        if ((w->rc = kvt_client_put(w->c, tok, 4 * PAGE, 0, 4, payload, NULL, &r)) < 0)
            break;
    }
    __atomic_store_n(&w->done, 1, __ATOMIC_RELEASE);
    return NULL;
}

Test(server_loops, leases_taken_shared_keep_their_paths, .timeout = 60)
{
    kvd_t d = {0};
    kvd_start(&d, "--loops", "2", "--dram-bytes", "1M", "--nvme-bytes", "0", NULL);
    enum { P = 4, R = 100 };
    kvt_client_t *c0 = kvd_client(&d, "m", PAGE, LSB), *c1 = kvd_client(&d, "m", PAGE, LSB);
    cr_assert_eq(kvd_stat(c0, "loop_connections_1"), 1, "c1 is loop 1's");
    static uint32_t tok[P * PAGE];
    static uint8_t payload[P * LSB], back[P * LSB];
    kvd_tokens(tok, P * PAGE, 9900000u);
    kvd_fill(payload, sizeof payload, 990);
    kvt_client_put_t r;
    cr_assert_eq(kvt_client_put(c1, tok, P * PAGE, 0, P, payload, NULL, &r), 0);
    cr_assert_eq(r.stored, P);
    kvt_client_match_t a = {0};
    cr_assert_eq(kvt_client_match(c1, tok, P * PAGE, KVT_CLIENT_LEASE, 600000, NULL, &a), 0);
    cr_assert_eq(a.pages, P);
    double shared = kvd_metric(&d, "kvtier_loop_shared_matches_total{loop=\"1\"}");
    lkeep_t w = {.c = c0};
    pthread_t th;
    cr_assert_eq(pthread_create(&th, NULL, lkeep_writer_main, &w), 0);
    int wrong = 0, line = 0;
    int round = 0;
    for (; round < R || !__atomic_load_n(&w.done, __ATOMIC_ACQUIRE); round++) {
        uint8_t tiers[P];
        kvt_client_match_t m = {.tiers = tiers, .tiers_cap = P};
        uint32_t got = 0;
        memset(back, 0, sizeof back);
        if (kvt_client_match(c1, tok, P * PAGE, KVT_CLIENT_LEASE, 60000, NULL, &m) < 0 ||
            m.pages != P || !m.lease || !all_in(tiers, P, KVT_CLIENT_TIER_DRAM))
            wrong++, line = line ? line : __LINE__;
        else if (kvt_client_get(c1, m.lease, 0, P, back, sizeof back, &got, NULL) < 0 || got != P ||
                 memcmp(back, payload, sizeof back) != 0)
            wrong++, line = line ? line : __LINE__;
        if (m.lease && kvt_client_release(c1, m.lease, NULL) < 0)
            wrong++, line = line ? line : __LINE__;
    }
    pthread_join(th, NULL);
    cr_expect_eq(wrong, 0, "%d wrong rounds, the first at line %d", wrong, line);
    cr_expect_eq(w.rounds, 64, "the writer's PUTs: %s", kvt_client_strerror(w.rc));
    cr_expect_geq(kvd_metric(&d, "kvtier_loop_shared_matches_total{loop=\"1\"}") - shared, round,
                  "loop 1's %d leased MATCHes were answered shared", round);
    cr_expect_gt(kvd_metric(&d, "kvtier_blocks_dropped_total{tier=\"dram\"}"), 0,
                 "the writer evicted");
    uint32_t got = 0;
    cr_expect_eq(kvt_client_get(c1, a.lease, 0, P, back, sizeof back, &got, NULL), 0);
    cr_expect(got == P && memcmp(back, payload, sizeof back) == 0, "A is whole under its lease");
    cr_expect_eq(kvd_stat(c0, "leases"), 1);
    cr_assert_eq(kvt_client_release(c1, a.lease, NULL), 0);
    cr_expect_eq(kvd_stat(c0, "leases"), 0);
    kvt_client_close(c0);
    kvt_client_close(c1);
    cr_expect_eq(kvd_stop(&d), 0);
    kvd_cleanup(&d);
}

/*
 * A leased MATCH the shared path cannot lease goes to the write path, whose reply says why, as
 * before: max-leases reached (3 here), then, on another daemon, the lease table at index-bytes.
 * Leases taken shared expire with the tick as others do, and their slots are taken again.
 */
Test(server_loops, leases_taken_shared_are_refused_and_expire_as_before, .timeout = 60)
{
    kvd_t d = {0};
    kvd_start(&d, "--loops", "2", "--max-leases", "3", "--tick-ms", "20", NULL);
    kvt_client_t *c0 = kvd_client(&d, "m", PAGE, BB), *c1 = kvd_client(&d, "m", PAGE, BB);
    cr_assert_eq(kvd_stat(c0, "loop_connections_1"), 1, "c1 is loop 1's");
    enum { P = 4 };
    static uint32_t tok[P * PAGE];
    static uint8_t payload[P * BB];
    kvd_tokens(tok, P * PAGE, 9920000u);
    kvd_fill(payload, sizeof payload, 992);
    kvt_client_put_t r;
    cr_assert_eq(kvt_client_put(c1, tok, P * PAGE, 0, P, payload, NULL, &r), 0);
    kvt_client_match_t m = {0};
    cr_assert_eq(kvt_client_match(c1, tok, P * PAGE, 0, 0, NULL, &m), 0);
    double w0 = write_locks(&d, 1);
    for (int k = 0; k < 3; k++)
        cr_assert_eq(kvt_client_match(c1, tok, P * PAGE, KVT_CLIENT_LEASE, 300, NULL, &m), 0);
    cr_expect_eq(write_locks(&d, 1) - w0, 0, "three leases taken shared");
    cr_assert_eq(kvt_client_match(c1, tok, P * PAGE, KVT_CLIENT_LEASE, 300, NULL, &m),
                 KVT_CLIENT_ENOSPC);
    cr_expect(strstr(kvt_client_errmsg(c1), "max-leases (3)"), "%s", kvt_client_errmsg(c1));
    cr_expect_eq(kvd_stat(c0, "leases"), 3);
    uint64_t t0 = kvt_now_ns();
    while (kvd_stat(c0, "leases") > 0 && kvt_now_ns() - t0 < 5000000000ull)
        usleep(20 * 1000);
    cr_expect_eq(kvd_stat(c0, "leases"), 0, "the leases expired");
    cr_expect_eq(kvd_metric(&d, "kvtier_leases_expired_total"), 3);
    w0 = write_locks(&d, 1);
    cr_assert_eq(kvt_client_match(c1, tok, P * PAGE, KVT_CLIENT_LEASE, 60000, NULL, &m), 0);
    cr_expect_eq(write_locks(&d, 1) - w0, 0, "a lease taken shared again");
    uint8_t back[P * BB];
    uint32_t got = 0;
    cr_expect_eq(kvt_client_get(c1, m.lease, 0, P, back, sizeof back, &got, NULL), 0);
    cr_expect(got == P && memcmp(back, payload, sizeof back) == 0);
    kvt_client_close(c0);
    kvt_client_close(c1);
    cr_expect_eq(kvd_stop(&d), 0);
    kvd_cleanup(&d);

    /* The lease table at index-bytes: its growth does not fit, and nothing is trimmed for it. */
    kvd_t e = {0};
    kvd_start(&e, "--loops", "2", "--index-bytes", "256K", "--max-leases", "100000", NULL);
    c0 = kvd_client(&e, "m", PAGE, BB);
    c1 = kvd_client(&e, "m", PAGE, BB);
    cr_assert_eq(kvd_stat(c0, "loop_connections_1"), 1, "c1 is loop 1's");
    cr_assert_eq(kvt_client_put(c1, tok, P * PAGE, 0, P, payload, NULL, &r), 0);
    int rc = 0;
    uint32_t held = 0;
    w0 = write_locks(&e, 1);
    for (; held < 100000; held++)
        if ((rc = kvt_client_match(c1, tok, P * PAGE, KVT_CLIENT_LEASE, 600000, NULL, &m)) < 0)
            break;
    cr_assert_eq(rc, KVT_CLIENT_ENOSPC, "the leases filled the index (%u held)", held);
    cr_expect(strstr(kvt_client_errmsg(c1), "no room for one more lease in the index"), "%s",
              kvt_client_errmsg(c1));
    /* Write locks only for the refusal and where the loop's deferred hits filled up. */
    double wl = write_locks(&e, 1) - w0;
    cr_expect_leq(wl, 2 + 2 * held / KVT_TEST_LOOP_HITS, "%u leases taken shared: %g write locks",
                  held, wl);
    cr_expect_eq(kvd_stat(c0, "leases"), held);
    kvt_client_close(c1);
    cr_expect_eq(leases_now(c0, 0), 0, "the close released them");
    kvt_client_close(c0);
    cr_expect_eq(kvd_stop(&e), 0);
    kvd_cleanup(&e);
}

/*
 * A connection's table of its leases by id (lease.c: open addressing, deletion by backward shift,
 * grown with the list) against a reference model: loop 1's client takes and releases leases in a
 * random order, up to 600 held (the table grows past 1024 entries), the leases taken shared and
 * released under the write lock. Every RELEASE of a held lease finds it, every RELEASE of one
 * already released (its id stale, its slot maybe reused) finds none, and a GET under a random
 * held lease reads the path's first page. At the end STATS counts the model's leases.
 */
Test(server_loops, a_connections_leases_against_a_model, .timeout = 60)
{
    kvd_t d = {0};
    kvd_start(&d, "--loops", "2", "--max-leases", "100000", NULL);
    kvt_client_t *c0 = kvd_client(&d, "m", PAGE, BB), *c1 = kvd_client(&d, "m", PAGE, BB);
    cr_assert_eq(kvd_stat(c0, "loop_connections_1"), 1, "c1 is loop 1's");
    enum { P = 2, N = 600, OPS = 4000 };
    static uint32_t tok[P * PAGE];
    static uint8_t payload[P * BB], back[BB];
    static uint64_t held[N], gone[OPS];
    kvd_tokens(tok, P * PAGE, 9930000u);
    kvd_fill(payload, sizeof payload, 993);
    kvt_client_put_t r;
    cr_assert_eq(kvt_client_put(c1, tok, P * PAGE, 0, P, payload, NULL, &r), 0);
    uint32_t nheld = 0, ngone = 0, peak = 0, rng = 993;
    int wrong = 0, line = 0;
    for (int op = 0; op < OPS; op++) {
        rng = rng * 1103515245u + 12345u;
        uint32_t x = rng >> 8;
        /* Mostly growing to N, then mostly shrinking: the table grows, and empties in runs. */
        int take = nheld < N && (op < OPS / 2 ? x % 4 != 0 : x % 4 == 0);
        if (take || nheld == 0) {
            kvt_client_match_t m = {0};
            if (kvt_client_match(c1, tok, P * PAGE, KVT_CLIENT_LEASE, 600000, NULL, &m) < 0 ||
                !m.lease)
                wrong++, line = line ? line : __LINE__;
            else
                held[nheld++] = m.lease;
            peak = nheld > peak ? nheld : peak;
        } else if (x % 5 == 0 && ngone) {
            int released = 1;
            if (kvt_client_release(c1, gone[x % ngone], &released) < 0 || released)
                wrong++, line = line ? line : __LINE__;
        } else {
            uint32_t i = x % nheld;
            uint32_t got = 0;
            if (x % 7 == 0 &&
                (kvt_client_get(c1, held[i], 0, 1, back, sizeof back, &got, NULL) < 0 || got != 1 ||
                 memcmp(back, payload, BB) != 0))
                wrong++, line = line ? line : __LINE__;
            int released = 0;
            if (kvt_client_release(c1, held[i], &released) < 0 || !released)
                wrong++, line = line ? line : __LINE__;
            gone[ngone++] = held[i];
            held[i] = held[--nheld];
        }
    }
    cr_expect_eq(wrong, 0, "%d wrong replies, the first at line %d", wrong, line);
    cr_expect_eq(peak, N, "the leases held at most (the table grew to hold them)");
    cr_expect_eq(kvd_stat(c0, "leases"), nheld);
    kvt_client_close(c1);
    cr_expect_eq(leases_now(c0, 0), 0, "the close released them");
    kvt_client_close(c0);
    cr_expect_eq(kvd_stop(&d), 0);
    kvd_cleanup(&d);
}

/*
 * LOCATE GETs under the shared lock while another loop writes. A writer on loop 0 stores a
 * 2-page prefix S before anyone maps the namespace (its pages stay in the main DRAM region and go
 * with their bytes), then PUTs fresh prefixes of the same namespace into its arena (64 KiB pages,
 * 4 MiB of DRAM: the step pushes blocks out to NVMe and drops them, and the arena reuses their
 * room) and REMOVEs the readers' churn prefixes from their second page on. A zero-copy reader on
 * each loop past 0 leases S extended by two pages of its own in the arena (the writer waits for
 * all of them: before their leases its PUTs could push those pages out), and every round GETs
 * it with LOCATE (two pages with their bytes, two located) and then stores a churn prefix, leases
 * it, GETs it with LOCATE, and reads its located pages where they lie three times over with the
 * writer at work before it RELEASEs the lease. Every byte read through a location must be the
 * page's own while the lease holds: the writer's REMOVE is refused meanwhile, and no eviction,
 * move or PUT may have the room (docs/protocol.md, "Lifetimes"). The previous round's churn prefix,
 * once let go, is leased and read again: whatever of it is left, from whichever tier, must be its
 * own. (With REMOVE let through a client's lease this fails every run: the located pages read
 * other bytes.)
 */
#define RBB (64u << 10)

typedef struct zrace {
    const kvd_t *d;
    kvt_client_t *c;     /* connected by the test: the writer on loop 0, reader i on loop i */
    struct zrace *all;   /* the readers, for the writer to aim at */
    int id, nreaders;    /* id 0: the writer */
    int round, finished; /* a reader's, read by the writer (atomic) */
    int ready;           /* a reader's: its own pages are leased (atomic) */
    int errors, line, rc;
    uint64_t located, sent, removed; /* a reader's pages read where they lie, or with bytes */
} zrace_t;

#define ZRACE_WRONG(w)       ((w)->line = (w)->line ? (w)->line : __LINE__, (w)->errors++)
#define ZRACE_WRONG_RC(w, r) ((w)->rc = (w)->errors ? (w)->rc : (r), ZRACE_WRONG(w))
enum { ZP = 4, ZROUNDS = 40 };

/* The tokens of reader id's churn prefix of round k (ZP pages). */
static void zrace_churn(uint32_t *tok, int id, int k)
{
    kvd_tokens(tok, ZP * PAGE, 9810000u + (uint32_t)id * 100000u + (uint32_t)k * 1000u);
}

/* Its bytes: page p of churn round k of reader id, as kvd_fill makes them. */
static void zrace_fill(uint8_t *payload, int id, int k)
{
    for (int p = 0; p < ZP; p++)
        kvd_fill(payload + (size_t)p * RBB, RBB, (uint32_t)(id * 100000 + k * 10 + p));
}

static void *zrace_writer_main(void *arg)
{
    zrace_t *w = arg;
    static uint32_t tok[ZP * PAGE];
    uint8_t *payload = malloc((size_t)ZP * RBB);
    /* Not before every reader leased its own pages: until then a PUT of the writer's may push
     * them out to NVMe, and a reader's GET would find them sent with bytes, not located. */
    for (int r = 1; r <= w->nreaders; r++)
        while (!__atomic_load_n(&w->all[r].ready, __ATOMIC_ACQUIRE))
            usleep(1000);
    for (int i = 0; payload; i++) {
        int left = 0;
        for (int r = 1; r <= w->nreaders; r++)
            left += !__atomic_load_n(&w->all[r].finished, __ATOMIC_ACQUIRE);
        if (!left)
            break;
        /* A fresh prefix into the arena: DRAM fills, the step demotes and drops. */
        kvd_tokens(tok, ZP * PAGE, 7700000u + (uint32_t)(i % 64) * 1000u);
        kvd_fill(payload, (size_t)ZP * RBB, 990000u + (uint32_t)i);
        kvt_client_put_t r;
        if (kvt_client_put(w->c, tok, ZP * PAGE, 0, ZP, payload, NULL, &r) < 0)
            ZRACE_WRONG(w);
        /* A reader's churn prefix of now, from its second page: refused while it is leased. */
        zrace_t *v = &w->all[1 + i % w->nreaders];
        zrace_churn(tok, v->id, __atomic_load_n(&v->round, __ATOMIC_ACQUIRE));
        int rc = kvt_client_remove(w->c, tok, 2 * PAGE);
        if (rc < 0 && rc != KVT_CLIENT_ENOENT && rc != KVT_CLIENT_EBUSY)
            ZRACE_WRONG_RC(w, rc);
        w->removed += rc == 0;
    }
    free(payload);
    return NULL;
}

/* Reader w's GET with LOCATE of pages [0, n) under lease, each checked against want (page p at
 * p x RBB): a wrong page is an error, and so is a GET that fails, but where `lost` allows it, one
 * that ends with ENOENT after the pages before a page whose bytes went (a MATCH leases the
 * index-only pages that eviction leaves). Returns the pages read where they lie; ptrs (if not
 * NULL, n entries) gets their pointers into the mapping (NULL: with bytes, or not sent). */
static uint32_t zrace_get(zrace_t *w, uint64_t lease, uint32_t n, const uint8_t *want,
                          const uint8_t **ptrs, int lost)
{
    loc_check_t k = {.want = want, .n = n, .bb = RBB, .ptrs = ptrs};
    k.map = kvt_client_mapping(w->c, &k.map_bytes);
    for (uint32_t p = 0; ptrs && p < n; p++)
        ptrs[p] = NULL;
    uint32_t got = 0;
    int rc = kvt_client_get_cb(w->c, lease, 0, n, loc_check_page, &k, &got);
    if ((rc < 0 && !(lost && rc == KVT_CLIENT_ENOENT)) || got != k.seen || k.wrong ||
        (rc == 0 && got != n))
        ZRACE_WRONG_RC(w, rc);
    w->located += k.located;
    w->sent += k.seen - k.located;
    return k.located;
}

/* Leases the churn prefix of round k (its tokens in tok, its bytes in churn) for one GET with
 * LOCATE; with hold, reads the located pages again where they lie, three times, with the writer
 * at work, before the RELEASE: they must still be the page's own. */
static void zrace_churn_get(zrace_t *w, uint32_t *tok, uint8_t *churn, int k, int hold)
{
    const uint8_t *ptrs[ZP];
    kvt_client_match_t m = {0};
    zrace_churn(tok, w->id, k);
    zrace_fill(churn, w->id, k);
    if (kvt_client_match(w->c, tok, ZP * PAGE, KVT_CLIENT_LEASE, 10000, NULL, &m) < 0)
        ZRACE_WRONG(w);
    if (m.pages == 0)
        return; /* removed or pushed out whole */
    zrace_get(w, m.lease, m.pages, churn, ptrs, 1);
    for (int again = 0; hold && again < 3; again++) {
        usleep(1000);
        for (uint32_t p = 0; p < m.pages; p++)
            if (ptrs[p] && memcmp(ptrs[p], churn + (size_t)p * RBB, RBB) != 0)
                ZRACE_WRONG(w);
    }
    if (kvt_client_release(w->c, m.lease, NULL) < 0)
        ZRACE_WRONG(w);
}

static void *zrace_reader_main(void *arg)
{
    zrace_t *w = arg;
    uint32_t tok[ZP * PAGE];
    uint8_t *mine = malloc((size_t)2 * ZP * RBB), *churn = mine ? mine + (size_t)ZP * RBB : NULL;
    kvt_client_put_t r;
    kvt_client_match_t lm = {0};
    /* Its leased path: S (the writer's, with its bytes) and two pages of its own, in the arena. */
    kvd_tokens(tok, 2 * PAGE, 9800000u);
    kvd_tokens(tok + 2 * PAGE, 2 * PAGE, 9800500u + (uint32_t)w->id * 1000u);
    if (mine) {
        kvd_fill(mine, 2 * RBB, 98);
        kvd_fill(mine + 2 * RBB, 2 * RBB, 98 + (uint32_t)w->id);
    }
    if (!mine || kvt_client_put(w->c, tok, ZP * PAGE, 0, ZP, mine, NULL, &r) < 0 ||
        kvt_client_match(w->c, tok, ZP * PAGE, KVT_CLIENT_LEASE, 600000, NULL, &lm) < 0 ||
        lm.pages != ZP)
        ZRACE_WRONG(w);
    __atomic_store_n(&w->ready, 1, __ATOMIC_RELEASE);
    for (int round = 0; lm.pages == ZP && round < ZROUNDS; round++) {
        if (zrace_get(w, lm.lease, ZP, mine, NULL, 0) != 2)
            ZRACE_WRONG(w); /* S's pages with their bytes, its own where they lie */
        /* The writer REMOVEs this round's churn prefix as soon as it may. */
        __atomic_store_n(&w->round, round, __ATOMIC_RELEASE);
        zrace_churn(tok, w->id, round);
        zrace_fill(churn, w->id, round);
        if (kvt_client_put(w->c, tok, ZP * PAGE, 0, ZP, churn, NULL, &r) < 0)
            ZRACE_WRONG(w);
        zrace_churn_get(w, tok, churn, round, 1);
        if (round > 0)
            zrace_churn_get(w, tok, churn, round - 1, 0);
    }
    __atomic_store_n(&w->finished, 1, __ATOMIC_RELEASE);
    if (lm.lease && kvt_client_release(w->c, lm.lease, NULL) < 0)
        ZRACE_WRONG(w);
    free(mine);
    return NULL;
}

static void locate_gets_race(const char *loops)
{
    kvd_t d = {0};
    kvd_start(&d, "--loops", loops, "--dram-bytes", "4M", "--nvme-bytes", "16M", NULL);
    int n = atoi(loops);
    cr_assert(n >= 2 && n <= 4);
    zrace_t w[4];
    pthread_t th[4];
    /* The writer first, on loop 0; it stores S before anyone maps the namespace. */
    w[0] = (zrace_t){.d = &d, .all = w, .nreaders = n - 1, .c = kvd_client(&d, "zr", PAGE, RBB)};
    static uint32_t tok[2 * PAGE];
    static uint8_t s_bytes[2 * RBB];
    kvd_tokens(tok, 2 * PAGE, 9800000u);
    kvd_fill(s_bytes, sizeof s_bytes, 98);
    kvt_client_put_t r;
    cr_assert_eq(kvt_client_put(w[0].c, tok, 2 * PAGE, 0, 2, s_bytes, NULL, &r), 0);
    cr_assert_eq(r.stored, 2);
    for (int i = 1; i < n; i++)
        w[i] = (zrace_t){.d = &d, .all = w, .id = i, .c = kvd_client_map(&d, "zr", PAGE, RBB, 1)};
    char key[64];
    for (int i = 0; i < n; i++) {
        snprintf(key, sizeof key, "loop_connections_%d", i);
        cr_assert_eq(kvd_stat(w[0].c, key), 1, "w[%d] is loop %d's", i, i);
    }
    for (int i = 0; i < n; i++)
        pthread_create(&th[i], NULL, i ? zrace_reader_main : zrace_writer_main, &w[i]);
    int errors = 0, line = 0, rc = 0;
    for (int i = 0; i < n; i++) {
        pthread_join(th[i], NULL);
        errors += w[i].errors;
        rc = line ? rc : w[i].rc;
        line = line ? line : w[i].line;
    }
    if (errors)
        kvd_log_tail(&d, 4000);
    cr_expect_eq(errors, 0, "%d wrong replies or pages, the first at line %d (rc %d)", errors, line,
                 rc);
    cr_expect_gt(w[0].removed, 0, "the writer removed churn prefixes the readers had read");
    double dropped = kvd_metric(&d, "kvtier_blocks_dropped_total{tier=\"dram\"}"),
           demoted = kvd_metric(&d, "kvtier_blocks_moved_total{from=\"dram\",to=\"nvme\"}");
    cr_expect(dropped > 0 || demoted > 0, "the writer pushed blocks out of DRAM (%g, %g)", dropped,
              demoted);
    for (int i = 1; i < n; i++) {
        cr_expect_geq(w[i].located, ZROUNDS * 2, "reader %d: pages read where they lie", i);
        cr_expect_geq(w[i].sent, ZROUNDS * 2, "reader %d: S's pages with their bytes", i);
        snprintf(key, sizeof key, "kvtier_loop_shared_gets_total{loop=\"%d\"}", i);
        cr_expect_geq(kvd_metric(&d, key), ZROUNDS, "loop %d: GETs with LOCATE planned shared", i);
    }
    for (int i = 0; i < n; i++)
        kvt_client_close(w[i].c);
    cr_expect_eq(kvd_stop(&d), 0);
    kvd_cleanup(&d);
}

Test(server_loops, locate_gets_keep_their_pages_while_others_write, .timeout = 120)
{
    locate_gets_race("2");
}

Test(server_loops, locate_gets_on_four_loops_keep_their_pages_while_others_write, .timeout = 120)
{
    locate_gets_race("4");
}

/*
 * A GET of more than one batch (12 pages of 2 MiB: 4 batches of KVT_GET_BATCH_BYTES) of DRAM
 * pages on loop 1 goes batch after batch under the shared lock too: each next batch is built
 * while the client's lease holds the path (op_get.c, get_next_shared). Before, such a GET went to
 * the write path (a write lock for the frame and one per batch). With zero_copy the client maps
 * its arena and GETs with LOCATE (step 8): every page goes as a location, batch after batch.
 */
static void several_batches_take_no_write_lock(int zero_copy)
{
    kvd_t d = {0};
    kvd_start(&d, "--loops", "2", "--dram-bytes", "64M", NULL);
    enum { P = 12, R = 6 };
    const size_t bb = 2u << 20;
    kvt_client_t *c0 = kvd_client(&d, "m", PAGE, BB),
                 *c1 = kvd_client_map(&d, "big", PAGE, bb, zero_copy);
    cr_assert_eq(kvd_stat(c0, "loop_connections_1"), 1, "c1 is loop 1's");
    static uint32_t tok[P * PAGE];
    uint8_t *payload = malloc(P * bb), *back = malloc(P * bb);
    cr_assert(payload && back);
    kvd_tokens(tok, P * PAGE, 9500000u);
    kvd_fill(payload, P * bb, 95);
    kvt_client_put_t r;
    for (uint32_t p = 0; p < P; p++) {
        cr_assert_eq(kvt_client_put(c1, tok, (p + 1) * PAGE, p, 1, payload + p * bb, NULL, &r), 0);
        cr_assert_eq(r.stored, 1);
    }
    kvt_client_match_t m = {0}, one = {0};
    cr_assert_eq(kvt_client_match(c1, tok, P * PAGE, KVT_CLIENT_LEASE, 60000, NULL, &m), 0);
    cr_assert_eq(m.pages, P);
    cr_assert_eq(kvt_client_match(c1, tok, P * PAGE, 0, 0, NULL, &one), 0);
    double w0 = write_locks(&d, 1);
    uint64_t located = 0;
    for (int round = 0; round < R; round++) {
        uint32_t got = 0, first = (uint32_t)round % 3;
        located += zero_copy ? P - first : 0;
        memset(back, 0, P * bb);
        cr_assert_eq(kvt_client_get(c1, m.lease, first, P - first, back, P * bb, &got, NULL), 0);
        cr_expect_eq(got, P - first, "round %d", round);
        cr_expect(memcmp(back, payload + first * bb, (P - first) * bb) == 0, "round %d: the bytes",
                  round);
    }
    cr_assert_eq(kvt_client_match(c1, tok, P * PAGE, 0, 0, NULL, &one), 0);
    double w1 = write_locks(&d, 1);
    cr_expect_eq(w1 - w0, 0, "%g write locks for %d GETs of 4 batches of DRAM pages", w1 - w0, R);
    cr_expect_eq(kvd_metric(&d, "kvtier_loop_shared_gets_total{loop=\"1\"}"), R);
    cr_expect_eq(kvd_metric(&d, "kvtier_zero_copy_pages_total{op=\"get\"}"), (double)located);
    cr_expect_eq(kvd_metric(&d, "kvtier_request_errors_total{op=\"get\"}"), 0);
    free(payload);
    free(back);
    kvt_client_close(c0);
    kvt_client_close(c1);
    cr_expect_eq(kvd_stop(&d), 0);
    kvd_cleanup(&d);
}

Test(server_loops, gets_of_several_batches_take_no_write_lock, .timeout = 60)
{
    several_batches_take_no_write_lock(0);
}

Test(server_loops, locate_gets_of_several_batches_take_no_write_lock, .timeout = 60)
{
    several_batches_take_no_write_lock(1);
}

/*
 * Multi-batch GETs whose lease ends between their batches. A reader on loop 1 stores 8 pages of
 * 2 MiB (3 batches), leases them and GETs them slowly (its batches wait for the socket), and
 * either RELEASEs the lease in the same write as the GET (a raw socket: the RELEASE is framed
 * while the GET's first batch goes out) or leases for 5 ms (the tick expires it mid-GET); a
 * writer meanwhile REMOVEs the reader's prefix and PUTs fresh ones that push DRAM out to NVMe.
 * A GET that began holds the path as the lease goes (op_get.c, kvt__get_lease_ends: the lease's
 * own pin, and the path's NVMe blocks), as the write path's GET holds it from its start: every
 * page that comes has its own bytes, in order, and the GET ends whole with status 0, or with
 * ENOENT at the first page its MATCH reported without bytes (one the hierarchy let go before the
 * MATCH), never at a page it promised. The NVMe segments (8 MiB) hold a 2 MiB page: with the
 * harness's 1 MiB ones no page could go to NVMe (KVT_ETOOBIG), DRAM dropped its victims instead
 * of demoting them, and the reader's PUTs after a dropped page were skipped with the tier all but
 * empty (server_policy::pages_larger_than_an_nvme_record_are_named_at_hello).
 */
#define LB (2u << 20)

typedef struct lapse {
    const kvd_t *d;
    int *round, *done;        /* the reader's leased round (-1: none yet), read by the writer */
    int *push;                /* the writer PUTs too (the second half of the rounds) */
    int errors, line, status; /* status: the first wrong end's */
    uint64_t pages, released, removed;
} lapse_t;

#define LAPSE_WRONG(w) ((w)->line = (w)->line ? (w)->line : __LINE__, (w)->errors++)
enum { LP = 8, LROUNDS = 40 };

static void lapse_tokens(uint32_t *tok, int round)
{
    kvd_tokens(tok, LP * PAGE, 9600000u + (uint32_t)round * 1000);
}

/* The leading pages of a MATCH's reply of LP pages that it gave a tier: those it promised. */
static uint32_t lapse_stored(const uint8_t *tiers)
{
    uint32_t n = 0;
    while (n < LP && tiers[n] != KVT_CLIENT_TIER_NONE)
        n++;
    return n;
}

/* n GETs of a whole lease (request ids 10, 12, ...) and a RELEASE of it (11) in one write on raw
 * socket fd; their frames read slowly and checked against sums; how many pages each GET sent and
 * its status in got[i], status[i]. */
static void lapse_get_release(lapse_t *w, int fd, uint64_t lease, int n, const uint64_t *sums,
                              uint8_t *body, uint32_t *got, int *status)
{
    enum { GETF = KVT_PROTO_HDR + sizeof(kvt_wire_get_t), MAXN = 2 };
    uint8_t f[MAXN * GETF + KVT_PROTO_HDR + sizeof(kvt_wire_release_t)], *g = f;
    kvt_wire_get_t gw = {.lease = lease};
    kvt_wire_release_t rw = {.lease = lease};
    cr_assert_leq(n, MAXN);
    for (int i = 0; i < n; i++, g += GETF) {
        kvt_proto_frame(g, KVT_OP_GET, 0, 10 + 2 * (uint64_t)i, 0, sizeof gw);
        memcpy(g + KVT_PROTO_HDR, &gw, sizeof gw);
    }
    kvt_proto_frame(g, KVT_OP_RELEASE, 0, 11, 0, sizeof rw);
    memcpy(g + KVT_PROTO_HDR, &rw, sizeof rw);
    g += KVT_PROTO_HDR + sizeof rw;
    cr_assert_eq(write(fd, f, (size_t)(g - f)), g - f);
    kvt_proto_hdr_t h;
    for (int i = 0; i < n; i++) {
        for (got[i] = 0;;) {
            read_reply_frame(fd, &h, body, sizeof(kvt_wire_get_data_t) + LB);
            if (h.request_id != 10 + 2 * (uint64_t)i)
                LAPSE_WRONG(w);
            if (!(h.flags & KVT_RF_MORE))
                break;
            uint32_t page = kvt_get_u32(body);
            if (h.body_len != sizeof(kvt_wire_get_data_t) + LB || page != got[i] ||
                page_sum(body + sizeof(kvt_wire_get_data_t), LB) != sums[page])
                LAPSE_WRONG(w);
            if (got[i]++ < 4 && i == 0)
                usleep(15000); /* slow: the batch after waits for the socket */
        }
        status[i] = h.status;
        /* The end frame says how many pages went (an error before any data is a message). */
        if (h.body_len == sizeof(kvt_wire_get_end_t) && kvt_get_u32(body) != got[i])
            LAPSE_WRONG(w);
    }
    read_reply_frame(fd, &h, body, 64); /* the RELEASE's */
    if (h.request_id != 11 || h.status != 0)
        LAPSE_WRONG(w);
    w->released += kvt_get_u32(body);
}

typedef struct lapse_check {
    lapse_t *w;
    const uint64_t *sums;
    uint32_t seen;
} lapse_check_t;

static int lapse_page(void *arg, uint32_t page, unsigned tier, const void *data, uint32_t len)
{
    lapse_check_t *k = arg;
    (void)tier;
    if (page != k->seen || len != LB || page_sum(data, len) != k->sums[page])
        LAPSE_WRONG(k->w);
    if (k->seen++ < 4)
        usleep(15000); /* past the 5 ms lease: the tick expires it mid-GET */
    return 0;
}

static void *lapse_writer_main(void *arg)
{
    lapse_t *w = arg;
    kvt_client_t *c = kvd_client(w->d, "big", PAGE, LB);
    static uint32_t tok[LP * PAGE];
    uint8_t *payload = malloc(LB);
    for (int i = 0; payload && !__atomic_load_n(w->done, __ATOMIC_ACQUIRE); i++) {
        kvt_client_put_t r;
        /* 16 prefixes over and over: DRAM's 12 pages spill to NVMe, which never fills. */
        kvd_tokens(tok, PAGE, 9900000u + (uint32_t)(i % 16) * 100);
        kvd_fill(payload, LB, 990000u + (uint32_t)(i % 16));
        if (__atomic_load_n(w->push, __ATOMIC_ACQUIRE) &&
            kvt_client_put(c, tok, PAGE, 0, 1, payload, NULL, &r) < 0)
            LAPSE_WRONG(w);
        int round = __atomic_load_n(w->round, __ATOMIC_ACQUIRE);
        if (round < 0)
            continue;
        lapse_tokens(tok, round);
        int rc = kvt_client_remove(c, tok, PAGE);
        if (rc < 0 && rc != KVT_CLIENT_ENOENT && rc != KVT_CLIENT_EBUSY)
            LAPSE_WRONG(w);
        w->removed += rc == 0;
        usleep(2000);
    }
    kvt_client_close(c);
    free(payload);
    return NULL;
}

Test(server_loops, gets_of_several_batches_outlive_their_lease, .timeout = 120)
{
    kvd_t d = {0};
    kvd_start(&d, "--loops", "2", "--dram-bytes", "24M", "--nvme-bytes", "256M",
              "--nvme-segment-bytes", "8M", "--tick-ms", "2", NULL);
    int leased = -1, done = 0, push = 0;
    lapse_t w = {.d = &d, .round = &leased, .done = &done, .push = &push},
            wr = w; /* the reader's, the writer's */
    /* The writer's connection goes to loop 0, the reader's client to loop 1, its storer to 0,
     * and so each round's raw socket to loop 1. */
    pthread_t th;
    pthread_create(&th, NULL, lapse_writer_main, &wr);
    while (kvd_metric(&d, "kvtier_loop_connections{loop=\"0\"}") < 1)
        usleep(1000);
    kvt_client_t *e = kvd_client(&d, "big", PAGE, LB), *st = kvd_client(&d, "big", PAGE, LB);
    cr_assert_eq(kvd_stat(e, "loop_connections_1"), 1);
    static uint32_t tok[LP * PAGE];
    uint8_t *payload = malloc(LB), *body = malloc(sizeof(kvt_wire_get_data_t) + LB);
    uint64_t sums[LP];
    cr_assert(payload && body);
    int ran = 0, ended = 0; /* GETs raced, and those whole */
    for (int round = 0; round < LROUNDS; round++) {
        lapse_tokens(tok, round);
        for (uint32_t p = 0; p < LP; p++) {
            kvt_client_put_t r;
            kvd_fill(payload, LB, (uint32_t)round * 10 + p);
            sums[p] = page_sum(payload, LB);
            cr_assert_eq(kvt_client_put(st, tok, (p + 1) * PAGE, p, 1, payload, NULL, &r), 0);
        }
        uint32_t got = 0, stored = 0; /* stored: the leading pages the MATCH gave a tier */
        int status = 0;
        if (round % 2 == 0) {
            int fd = kvd_raw(&d);
            raw_hello_model(fd, "big", PAGE, LB, body, 4096);
            uint64_t lease = raw_match_lease(fd, tok, LP * PAGE, body, 4096);
            if (lease && kvt_get_u32(body + 4) == LP) { /* else pushed out first: nothing to race */
                stored = lapse_stored(body + 24);
                __atomic_store_n(&leased, round, __ATOMIC_RELEASE); /* REMOVE it from now on */
                lapse_get_release(&w, fd, lease, 1, sums, body, &got, &status);
            }
            close(fd);
            if (got == 0 && status == 0)
                continue;
        } else {
            uint8_t tiers[LP];
            kvt_client_match_t m = {.tiers = tiers, .tiers_cap = LP};
            cr_assert_eq(kvt_client_match(e, tok, LP * PAGE, KVT_CLIENT_LEASE, 5, NULL, &m), 0);
            if (m.pages < LP) { /* the writer's PUTs pushed some out first: nothing to race */
                kvt_client_release(e, m.lease, NULL);
                continue;
            }
            stored = lapse_stored(tiers);
            __atomic_store_n(&leased, round, __ATOMIC_RELEASE);
            lapse_check_t ck = {.w = &w, .sums = sums};
            status = kvt_client_get_cb(e, m.lease, 0, LP, lapse_page, &ck, &got);
            if (got != ck.seen)
                LAPSE_WRONG(&w);
            kvt_client_release(e, m.lease, NULL); /* expired by now, most often */
        }
        /* The write path's ends: all of it (the pin keeps the path from the REMOVEs), nothing
         * when the lease ran out before the GET, or every page the MATCH gave a tier and ENOENT
         * at the first it did not. Nothing the MATCH promised goes under the GET. */
        int enoent = status == KVT_CLIENT_ENOENT || status == KVT_ENOENT;
        if (!(status == 0 && got == LP) && !(enoent && (got == stored || got == 0))) {
            w.status = w.errors ? w.status : status;
            LAPSE_WRONG(&w);
        }
        w.pages += got;
        ran++;
        ended += got == LP;
        if (round == LROUNDS / 2)
            __atomic_store_n(&push, 1, __ATOMIC_RELEASE);
    }
    __atomic_store_n(&done, 1, __ATOMIC_RELEASE);
    pthread_join(th, NULL);
    if (w.errors || wr.errors)
        kvd_log_tail(&d, 4000);
    cr_expect_eq(w.errors, 0, "%d wrong pages or ends, the first at line %d (status %d)", w.errors,
                 w.line, w.status);
    cr_expect_eq(wr.errors, 0, "the writer: %d wrong replies, the first at line %d", wr.errors,
                 wr.line);
    cr_expect_gt(w.released, 0, "the RELEASEs found their leases");
    cr_expect_gt(wr.removed, 0, "the writer removed the reader's prefixes");
    cr_expect(ran > 0 && ended > 0, "%d of %d GETs whole", ended, ran);
    double dropped = kvd_metric(&d, "kvtier_blocks_dropped_total{tier=\"dram\"}"),
           demoted = kvd_metric(&d, "kvtier_blocks_moved_total{from=\"dram\",to=\"nvme\"}");
    cr_expect_gt(demoted, 0, "the writer pushed blocks out of DRAM to NVMe (%g, %g dropped)",
                 demoted, dropped);
    cr_expect_gt(kvd_metric(&d, "kvtier_loop_shared_gets_total{loop=\"1\"}"), 0);
    cr_expect_gt(kvd_metric(&d, "kvtier_leases_expired_total"), 0);
    free(payload);
    free(body);
    kvt_client_close(e);
    kvt_client_close(st);
    cr_expect_eq(kvd_stop(&d), 0);
    kvd_cleanup(&d);
}

/*
 * RELEASEs answered under the shared lock end their leases as the write path did. Two loops, 1 MiB
 * of DRAM and no NVMe, 64 KiB pages; c1 is loop 1's, c0 loop 0's:
 * - c1 RELEASEs a lease of c0's: refused (0), c0's lease still held; its own twice: 1, then 0;
 * - a REMOVE of a path c1 leases is refused at once, as before; once c1 RELEASEs it, the next
 *   REMOVE removes it at once (no REMOVE waits for a client's lease: nothing to wake);
 * - a path whose leases c1 RELEASEd is evictable again: c0's PUTs (16 MiB through 1 MiB) push it
 *   out;
 * - loop 1 takes no write lock for any of this, and STATS and the gauge count the leases right.
 * Then a RELEASE that comes while a GET of the same connection still reads under its lease (one
 * write: the GET of 8 pages of 2 MiB goes in 3 batches, the first planned shared) goes by the
 * write path, which hands the GET the lease's pin (op_get.c, kvt__get_lease_ends): loop 1 takes
 * the write lock for it, the GET reads every byte, and no lease or pin is left.
 */
Test(server_loops, releases_taken_shared_end_leases_as_before, .timeout = 60)
{
    kvd_t d = {0};
    kvd_start(&d, "--loops", "2", "--dram-bytes", "1M", "--nvme-bytes", "0", NULL);
    enum { P = 4 };
    kvt_client_t *c0 = kvd_client(&d, "m", PAGE, LSB), *c1 = kvd_client(&d, "m", PAGE, LSB);
    cr_assert_eq(kvd_stat(c0, "loop_connections_1"), 1, "c1 is loop 1's");
    static uint32_t a[P * PAGE], z[P * PAGE], tok[P * PAGE];
    static uint8_t payload[P * LSB];
    kvd_tokens(a, P * PAGE, 9460000u);
    kvd_tokens(z, P * PAGE, 9461000u);
    kvd_fill(payload, sizeof payload, 946);
    kvt_client_put_t r;
    cr_assert_eq(kvt_client_put(c1, a, P * PAGE, 0, P, payload, NULL, &r), 0);
    cr_assert_eq(kvt_client_put(c1, z, P * PAGE, 0, P, payload, NULL, &r), 0);
    kvt_client_match_t ma = {0}, ma2 = {0}, mz = {0}, mo = {0};
    /* A's leases as PROBEs: no hit, so that A is the oldest and least used of the pages. */
    cr_assert_eq(
        kvt_client_match(c1, a, P * PAGE, KVT_CLIENT_LEASE | KVT_CLIENT_PROBE, 60000, NULL, &ma),
        0);
    cr_assert_eq(
        kvt_client_match(c1, a, P * PAGE, KVT_CLIENT_LEASE | KVT_CLIENT_PROBE, 60000, NULL, &ma2),
        0);
    cr_assert_eq(kvt_client_match(c1, z, P * PAGE, KVT_CLIENT_LEASE, 60000, NULL, &mz), 0);
    cr_assert_eq(kvt_client_match(c0, z, P * PAGE, KVT_CLIENT_LEASE, 60000, NULL, &mo), 0);
    cr_assert(ma.lease && ma2.lease && mz.lease && mo.lease);
    cr_expect_eq(leases_now(c0, 4), 4);
    double w0 = write_locks(&d, 1),
           r0 = kvd_metric(&d, "kvtier_loop_shared_releases_total{loop=\"1\"}");
    int released = -1;
    cr_assert_eq(kvt_client_release(c1, mo.lease, &released), 0);
    cr_expect_eq(released, 0, "another connection's lease is not c1's to release");
    cr_expect_eq(leases_now(c0, 4), 4, "c0's lease still held");
    cr_assert_eq(kvt_client_release(c0, mo.lease, &released), 0);
    cr_expect_eq(released, 1, "c0 releases its own");
    cr_assert_eq(kvt_client_release(c1, ma.lease, &released), 0);
    cr_expect_eq(released, 1);
    cr_assert_eq(kvt_client_release(c1, ma.lease, &released), 0);
    cr_expect_eq(released, 0, "a double RELEASE finds nothing");
    cr_expect_eq(leases_now(c0, 2), 2);
    cr_expect_eq(kvd_metric(&d, "kvtier_leases"), 2);
    /* Z: leased by c1 only, so a REMOVE is refused at once; then released, removed at once. */
    cr_expect_eq(kvt_client_remove(c0, z, P * PAGE), KVT_CLIENT_EBUSY);
    cr_assert_eq(kvt_client_release(c1, mz.lease, &released), 0);
    cr_expect_eq(released, 1);
    uint64_t t0 = kvt_now_ns();
    cr_expect_eq(kvt_client_remove(c0, z, P * PAGE), 0, "Z removed once released");
    uint64_t remove_ns = kvt_now_ns() - t0;
    cr_expect_lt(remove_ns, 100000000ull, "the REMOVE after the RELEASE took %llu us",
                 (unsigned long long)remove_ns / 1000);
    cr_log_info("the REMOVE after a RELEASE on another loop: %llu us",
                (unsigned long long)remove_ns / 1000);
    /* A: one lease left keeps it through c0's PUTs; once it goes, the next PUTs push A out. */
    for (int pass = 0; pass < 2; pass++) {
        for (uint32_t k = 0; k < 64; k++) {
            kvd_tokens(tok, P * PAGE, 9462000u + (uint32_t)pass * 100000u + k * 100u);
            cr_assert_eq(kvt_client_put(c0, tok, P * PAGE, 0, P, payload, NULL, &r), 0);
        }
        kvt_client_match_t m = {0};
        cr_assert_eq(kvt_client_match(c0, a, P * PAGE, KVT_CLIENT_PROBE, 0, NULL, &m), 0);
        if (pass == 0) {
            cr_expect_eq(m.pages, P, "A leased: kept");
            cr_assert_eq(kvt_client_release(c1, ma2.lease, &released), 0);
            cr_expect_eq(released, 1);
        } else {
            cr_expect_lt(m.pages, P, "A released: evicted by the PUTs after (%u pages)", m.pages);
        }
    }
    double w1 = write_locks(&d, 1);
    cr_expect_eq(w1 - w0, 0, "loop 1: %g write locks for its RELEASEs", w1 - w0);
    cr_expect_eq(kvd_metric(&d, "kvtier_loop_shared_releases_total{loop=\"1\"}") - r0, 5,
                 "loop 1: its 5 RELEASEs answered shared");
    cr_expect_eq(leases_now(c0, 0), 0);
    cr_expect_eq(kvd_metric(&d, "kvtier_leases"), 0);
    kvt_client_close(c0);
    kvt_client_close(c1);
    cr_expect_eq(kvd_stop(&d), 0);
    kvd_cleanup(&d);

    /* A RELEASE behind a GET still reading under its lease: by the write path. */
    kvd_t e = {0};
    kvd_start(&e, "--loops", "2", "--dram-bytes", "64M", "--nvme-bytes", "0", NULL);
    c0 = kvd_client(&e, "big", PAGE, LB);
    static uint32_t t[LP * PAGE];
    uint8_t *big = malloc((size_t)LP * LB), *body = malloc(sizeof(kvt_wire_get_data_t) + LB);
    cr_assert(big && body);
    kvd_tokens(t, LP * PAGE, 9463000u);
    kvd_fill(big, (size_t)LP * LB, 947);
    cr_assert_eq(kvt_client_put(c0, t, LP * PAGE, 0, LP, big, NULL, &r), 0);
    cr_assert_eq(r.stored, LP);
    int fd = kvd_raw(&e);
    cr_assert_eq(kvd_stat(c0, "loop_connections_1"), 1, "the raw socket is loop 1's");
    raw_hello_model(fd, "big", PAGE, LB, body, 4096);
    uint64_t lease = raw_match_lease(fd, t, LP * PAGE, body, 4096);
    cr_assert(lease && kvt_get_u32(body + 4) == LP);
    w0 = write_locks(&e, 1);
    double gets = kvd_metric(&e, "kvtier_loop_shared_gets_total{loop=\"1\"}"),
           rels = kvd_metric(&e, "kvtier_loop_shared_releases_total{loop=\"1\"}");
    enum { GETF = KVT_PROTO_HDR + sizeof(kvt_wire_get_t) };
    uint8_t f[GETF + KVT_PROTO_HDR + sizeof(kvt_wire_release_t)];
    kvt_wire_get_t gw = {.lease = lease};
    kvt_wire_release_t rw = {.lease = lease};
    kvt_proto_frame(f, KVT_OP_GET, 0, 10, 0, sizeof gw);
    memcpy(f + KVT_PROTO_HDR, &gw, sizeof gw);
    kvt_proto_frame(f + GETF, KVT_OP_RELEASE, 0, 11, 0, sizeof rw);
    memcpy(f + GETF + KVT_PROTO_HDR, &rw, sizeof rw);
    cr_assert_eq(write(fd, f, sizeof f), (ssize_t)sizeof f);
    kvt_proto_hdr_t h;
    uint32_t got = 0, wrong = 0;
    for (;;) {
        read_reply_frame(fd, &h, body, sizeof(kvt_wire_get_data_t) + LB);
        cr_assert_eq(h.request_id, 10);
        if (!(h.flags & KVT_RF_MORE))
            break;
        uint32_t page = kvt_get_u32(body);
        wrong += page != got || h.body_len != sizeof(kvt_wire_get_data_t) + LB ||
                 memcmp(body + sizeof(kvt_wire_get_data_t), big + (size_t)page * LB, LB) != 0;
        got++;
    }
    cr_expect_eq(h.status, 0);
    cr_expect_eq(got, LP, "the GET read every page");
    cr_expect_eq(wrong, 0, "%u pages with the wrong bytes", wrong);
    read_reply_frame(fd, &h, body, 64);
    cr_expect(h.request_id == 11 && h.status == 0 && kvt_get_u32(body) == 1, "the RELEASE's reply");
    cr_expect_eq(kvd_metric(&e, "kvtier_loop_shared_gets_total{loop=\"1\"}") - gets, 1,
                 "the GET was planned shared");
    cr_expect_geq(write_locks(&e, 1) - w0, 1, "loop 1: the RELEASE went by the write path");
    cr_expect_eq(kvd_metric(&e, "kvtier_loop_shared_releases_total{loop=\"1\"}"), rels,
                 "loop 1: the RELEASE behind the GET not answered shared");
    cr_expect_eq(leases_now(c0, 0), 0, "neither the lease nor the GET's pin is left");
    close(fd);
    free(big);
    free(body);
    kvt_client_close(c0);
    cr_expect_eq(kvd_stop(&e), 0);
    kvd_cleanup(&e);
}

/*
 * A GET's NVMe pages once its client's lease has ended. The lease pinned the path's NVMe blocks
 * against the log's segment reclaim (lease.c); the GET's own pin keeps the path in the index, and
 * must keep those blocks too: a GET that outlives its lease (a slow reader, an engine that lets
 * the lease run out) otherwise reads ENOENT from the first page of a later batch whose segment a
 * writer's PUTs made the log reclaim, though the MATCH had reported it stored.
 *
 * No DRAM, so every PUT lands in the NVMe log in order: segments of 4 MiB hold 3 pages of 1 MiB,
 * and 8 of them fill the log. The reader's 10 pages go to segments 0 and 1 (pages 0-5, 3 each)
 * and 2-5 (pages 6-9, one each, behind two fillers that are then REMOVEd), so that segments 2-5
 * hold the fewest live bytes: those a reclaim picks first. The GET goes in two batches (7 pages,
 * then 3). While the reader holds its first page, its 50 ms lease expires and a writer PUTs 12
 * fresh pages: 6 fill segments 6 and 7, and the next 6 need two segments reclaimed. Unpinned,
 * those were segments 2 and 3, with pages 6 (already read) and 7 (the second batch's first).
 */
#define NBB (1u << 20)

/* Stores page p of tok (block bb, filled from seed) by a PUT of its own through payload; the
 * page's sum. */
static uint64_t put_page(kvt_client_t *c, const uint32_t *tok, uint32_t p, uint32_t bb,
                         uint32_t seed, uint8_t *payload)
{
    kvt_client_put_t r;
    kvd_fill(payload, bb, seed);
    cr_assert_eq(kvt_client_put(c, tok, (p + 1) * PAGE, p, 1, payload, NULL, &r), 0);
    cr_assert_eq(r.stored, 1, "page %u", p);
    return page_sum(payload, bb);
}

typedef struct nvme_reader {
    kvd_t *d;
    kvt_client_t *w; /* the writer's connection */
    const uint64_t *sums;
    uint32_t seen;
    int errors, line;
    double lost; /* the log's dropped blocks before the writer's PUTs */
} nvme_reader_t;

#define NVME_WRONG(k) ((k)->line = (k)->line ? (k)->line : __LINE__, (k)->errors++)

/* The writer's pushes, once the reader's lease has expired: fresh one-page prompts. */
static void nvme_push(nvme_reader_t *k)
{
    while (kvd_metric(k->d, "kvtier_leases_expired_total") < 1)
        usleep(2000);
    k->lost = kvd_metric(k->d, "kvtier_tier_lost_blocks_total{tier=\"nvme\"}");
    static uint32_t tok[PAGE];
    uint8_t *payload = malloc(NBB);
    cr_assert(payload);
    for (uint32_t i = 0; i < 12; i++) {
        kvt_client_put_t r;
        kvd_tokens(tok, PAGE, 9710000u + i * 100);
        kvd_fill(payload, NBB, 9710 + i);
        if (kvt_client_put(k->w, tok, PAGE, 0, 1, payload, NULL, &r) < 0)
            NVME_WRONG(k);
    }
    free(payload);
}

static int nvme_page(void *arg, uint32_t page, unsigned tier, const void *data, uint32_t len)
{
    nvme_reader_t *k = arg;
    if (page != k->seen || tier != KVT_CLIENT_TIER_NVME || len != NBB ||
        page_sum(data, len) != k->sums[page])
        NVME_WRONG(k);
    if (k->seen++ == 0)
        nvme_push(k); /* the first batch waits for the socket meanwhile */
    return 0;
}

/* A one-page prompt of the writer's at seed, stored and then (remove) REMOVEd. */
static void nvme_filler(kvt_client_t *w, uint32_t seed, int remove)
{
    static uint32_t tok[PAGE];
    static uint8_t payload[NBB];
    kvt_client_put_t r;
    kvd_tokens(tok, PAGE, seed);
    kvd_fill(payload, NBB, seed);
    if (!remove) {
        cr_assert_eq(kvt_client_put(w, tok, PAGE, 0, 1, payload, NULL, &r), 0);
        cr_assert_eq(r.stored, 1);
    } else {
        cr_assert_eq(kvt_client_remove(w, tok, PAGE), 0);
    }
}

Test(server_loops, a_get_keeps_its_nvme_pages_once_its_lease_ends, .timeout = 60)
{
    if (unix_sndbuf_default() >= 6 * (int)NBB)
        cr_skip_test("the kernel's default send buffer holds the GET's first batch");
    kvd_t d = {0};
    kvd_start(&d, "--loops", "2", "--dram-bytes", "0", "--nvme-bytes", "32M",
              "--nvme-segment-bytes", "4M", "--tick-ms", "2", NULL);
    kvt_client_t *w = kvd_client(&d, "n", PAGE, NBB), *rd = kvd_client(&d, "n", PAGE, NBB);
    enum { P = 10, SPREAD = 6 }; /* pages SPREAD.. go one to a segment */
    static uint32_t tok[P * PAGE];
    uint8_t *payload = malloc(NBB);
    uint64_t sums[P];
    cr_assert(payload);
    kvd_tokens(tok, P * PAGE, 9700000u);
    for (uint32_t p = 0; p < P; p++) {
        sums[p] = put_page(w, tok, p, NBB, 970 + p, payload);
        for (uint32_t f = 0; p >= SPREAD && f < 2; f++)
            nvme_filler(w, 9800000u + p * 100 + f, 0);
    }
    for (uint32_t p = SPREAD; p < P; p++)
        for (uint32_t f = 0; f < 2; f++)
            nvme_filler(w, 9800000u + p * 100 + f, 1);
    uint8_t tiers[P];
    kvt_client_match_t m = {.tiers = tiers, .tiers_cap = P};
    cr_assert_eq(kvt_client_match(rd, tok, P * PAGE, KVT_CLIENT_LEASE, 50, NULL, &m), 0);
    cr_assert_eq(m.pages, P);
    for (uint32_t p = 0; p < P; p++)
        cr_assert_eq(tiers[p], KVT_CLIENT_TIER_NVME, "page %u", p);
    nvme_reader_t k = {.d = &d, .w = w, .sums = sums};
    uint32_t got = 0;
    int rc = kvt_client_get_cb(rd, m.lease, 0, P, nvme_page, &k, &got);
    if (rc != 0 || k.errors)
        kvd_log_tail(&d, 4000);
    cr_expect_eq(rc, 0, "the GET ended %d after %u pages", rc, got);
    cr_expect_eq(got, P);
    cr_expect_eq(k.errors, 0, "%d wrong pages or PUTs, the first at line %d", k.errors, k.line);
    cr_expect_gt(kvd_metric(&d, "kvtier_tier_lost_blocks_total{tier=\"nvme\"}"), k.lost,
                 "the writer's PUTs made the log reclaim segments");
    free(payload);
    kvt_client_close(w);
    kvt_client_close(rd);
    cr_expect_eq(kvd_stop(&d), 0);
    kvd_cleanup(&d);
}

/*
 * A GET planned shared of a path in HBM (10 pages of 1 MiB: its host backend's 10 MiB) and DRAM
 * (the last 2), whose 50 ms lease expires while the reader holds its first page: the first batch
 * (pages 0-6, all HBM) waits for the socket, and the lease's end pins the path for the GET
 * (kvt__get_lease_ends), which goes on by the write path: its second batch (pages 7-11, HBM then
 * DRAM) is read, and every byte comes back. With one loop too (the write path throughout).
 */
typedef struct hbm_lapse {
    kvd_t *d;
    const uint64_t *sums;
    uint32_t seen;
    int errors, line;
} hbm_lapse_t;

static int hbm_lapse_page(void *arg, uint32_t page, unsigned tier, const void *data, uint32_t len)
{
    hbm_lapse_t *k = arg;
    unsigned want = page < 10 ? KVT_CLIENT_TIER_HBM : KVT_CLIENT_TIER_DRAM;
    if (page != k->seen || tier != want || len != NBB || page_sum(data, len) != k->sums[page])
        k->line = k->line ? k->line : __LINE__, k->errors++;
    uint64_t t0 = kvt_now_ns();
    while (k->seen == 0 && kvd_metric(k->d, "kvtier_leases_expired_total") < 1 &&
           kvt_now_ns() - t0 < 5000000000ull)
        usleep(2000); /* the first batch waits for the socket meanwhile */
    k->seen++;
    return 0;
}

static void hbm_get_outlives_its_lease(const char *loops)
{
    if (unix_sndbuf_default() >= 6 * (int)NBB)
        cr_skip_test("the kernel's default send buffer holds the GET's first batch");
    kvd_t d = {0};
    kvd_start(&d, "--loops", loops, "--dram-bytes", "64M", "--nvme-bytes", "0", "--hbm-backend",
              "host", "--hbm-bytes", "10M", "--policy-high", "1", "--policy-low", "1", "--tick-ms",
              "2", NULL);
    kvt_client_t *w = kvd_client(&d, "h", PAGE, NBB), *rd = kvd_client(&d, "h", PAGE, NBB);
    enum { P = 12 };
    static uint32_t tok[P * PAGE];
    uint8_t *payload = malloc(NBB), tiers[P];
    uint64_t sums[P];
    cr_assert(payload);
    kvd_tokens(tok, P * PAGE, 9760000u);
    for (uint32_t p = 0; p < P; p++)
        sums[p] = put_page(w, tok, p, NBB, 976 + p, payload);
    kvt_client_match_t m = {.tiers = tiers, .tiers_cap = P};
    cr_assert_eq(kvt_client_match(rd, tok, P * PAGE, KVT_CLIENT_LEASE, 50, NULL, &m), 0);
    cr_assert_eq(m.pages, P);
    for (uint32_t p = 0; p < P; p++)
        cr_assert_eq(tiers[p], p < 10 ? KVT_CLIENT_TIER_HBM : KVT_CLIENT_TIER_DRAM, "page %u", p);
    hbm_lapse_t k = {.d = &d, .sums = sums};
    uint32_t got = 0;
    int rc = kvt_client_get_cb(rd, m.lease, 0, P, hbm_lapse_page, &k, &got);
    cr_expect_eq(rc, 0, "the GET ended %d after %u pages", rc, got);
    cr_expect_eq(got, P);
    cr_expect_eq(k.errors, 0, "%d wrong pages, the first at line %d", k.errors, k.line);
    cr_expect_geq(kvd_metric(&d, "kvtier_leases_expired_total"), 1, "the lease ended meanwhile");
    if (atoi(loops) > 1)
        cr_expect_eq(kvd_metric(&d, "kvtier_loop_shared_gets_total{loop=\"1\"}"), 1,
                     "loop 1 planned the GET shared");
    cr_expect_eq(kvd_stat(w, "leases"), 0);
    free(payload);
    kvt_client_close(w);
    kvt_client_close(rd);
    cr_expect_eq(kvd_stop(&d), 0);
    kvd_cleanup(&d);
}

Test(server_loops, a_get_of_hbm_pages_outlives_its_lease, .timeout = 60)
{
    hbm_get_outlives_its_lease("2");
}

Test(server_loops, a_get_of_hbm_pages_outlives_its_lease_with_one_loop, .timeout = 60)
{
    hbm_get_outlives_its_lease("1");
}

/*
 * GETs planned shared whose lease ends between their batches, with the index at index-bytes. Such
 * a GET holds the path from then on (kvt__get_lease_ends): the first takes the ending lease's own
 * pin, which needs no slot in the tree's lease table; another GET of the same lease takes a pin
 * of its own, which a full table can grow for only within index-bytes. The reader's raw socket
 * (loop 1) leases 8 pages of 2 MiB in DRAM (3 batches); another client fills the lease table with
 * leases of the same path until the index has no room to grow it (a MATCH's lease is refused,
 * ENOSPC); the reader sends two GETs of the whole lease and its RELEASE in one write, reading
 * slowly so that the RELEASE is framed while the first batch goes out. The first GET comes whole
 * (before, it ended ENOSPC after its first batch, as its own pin was refused); the second, whose
 * pin is refused, ends after its first batch with ENOSPC in its end frame, which counts the pages
 * sent (docs/protocol.md, GET); the daemon serves on, the same path read whole again.
 */
Test(server_loops, gets_whose_lease_ends_at_index_bytes, .timeout = 60)
{
    kvd_t d = {0};
    kvd_start(&d, "--loops", "2", "--dram-bytes", "24M", "--nvme-bytes", "0", "--index-bytes",
              "256K", "--max-leases", "100000", NULL);
    kvt_client_t *st = kvd_client(&d, "big", PAGE, LB); /* loop 0 */
    int fd = kvd_raw(&d);                               /* loop 1 */
    static uint32_t tok[LP * PAGE];
    uint8_t *payload = malloc(LB), *body = malloc(sizeof(kvt_wire_get_data_t) + LB);
    uint64_t sums[LP];
    cr_assert(payload && body);
    lapse_tokens(tok, 0);
    for (uint32_t p = 0; p < LP; p++)
        sums[p] = put_page(st, tok, p, LB, 980 + p, payload);
    raw_hello_model(fd, "big", PAGE, LB, body, 4096);
    cr_assert_eq(kvd_stat(st, "loop_connections_1"), 1, "the raw connection is loop 1's");
    uint64_t lease = raw_match_lease(fd, tok, LP * PAGE, body, 4096);
    cr_assert_eq(kvt_get_u32(body + 4), LP);
    uint32_t held = 0;
    uint64_t first = 0;
    int rc = 0;
    for (; held < 100000; held++) {
        kvt_client_match_t m = {0};
        rc = kvt_client_match(st, tok, LP * PAGE, KVT_CLIENT_LEASE | KVT_CLIENT_PROBE, 600000, NULL,
                              &m);
        if (rc < 0)
            break;
        first = first ? first : m.lease;
    }
    cr_assert_eq(rc, KVT_CLIENT_ENOSPC, "the leases filled the index (%u held): %s", held,
                 kvt_client_strerror(rc));
    double shared = kvd_metric(&d, "kvtier_loop_shared_gets_total{loop=\"1\"}");
    lapse_t w = {.d = &d};
    uint32_t got[2];
    int status[2];
    lapse_get_release(&w, fd, lease, 2, sums, body, got, status);
    cr_expect_eq(kvd_metric(&d, "kvtier_loop_shared_gets_total{loop=\"1\"}"), shared + 2,
                 "the GETs were planned shared");
    cr_expect_eq(w.errors, 0, "%d wrong pages or replies, the first at line %d", w.errors, w.line);
    cr_expect_eq(w.released, 1, "the RELEASE found its lease");
    cr_expect(status[0] == 0 && got[0] == LP, "the first GET ended %d after %u of %d pages",
              status[0], got[0], LP);
    cr_expect(status[1] == KVT_ENOSPC && got[1] == 3, "the second GET ended %d after %u pages",
              status[1], got[1]);
    cr_expect_gt(kvd_metric(&d, "kvtier_request_errors_total{op=\"get\"}"), 0);
    /* Served on: a slot given back, the path leased and read whole again. */
    cr_assert_eq(kvt_client_release(st, first, NULL), 0);
    lease = raw_match_lease(fd, tok, LP * PAGE, body, 4096);
    cr_assert_neq(lease, 0);
    w = (lapse_t){.d = &d};
    lapse_get_release(&w, fd, lease, 1, sums, body, got, status);
    cr_expect(status[0] == 0 && got[0] == LP && w.errors == 0, "again: %d after %u pages",
              status[0], got[0]);
    close(fd);
    free(payload);
    free(body);
    kvt_client_close(st);
    cr_expect_eq(kvd_stop(&d), 0);
    kvd_cleanup(&d);
}

/*
 * Loop 0's own connections frame and answer a run of MATCHes under the lock shared as the other
 * loops' do: loop 0 takes the write lock only for its own work (tier completions, the tick,
 * listeners, signals, the metrics port), not on every wake. The tick is set to 10 s so that none
 * falls in the rounds, and the counter is read through STATS on loop 1's connection (the
 * metrics port is loop 0's and takes its write lock); that STATS also applies the hits the round
 * deferred.
 */
Test(server_loops, loop_zeros_run_of_matches_takes_no_write_lock)
{
    kvd_t d = {0};
    kvd_start(&d, "--loops", "2", "--tick-ms", "10000", NULL);
    kvt_client_t *c0 = kvd_client(&d, "m", PAGE, BB), *c1 = kvd_client(&d, "m", PAGE, BB);
    cr_assert_eq(kvd_stat(c0, "loop_connections_0"), 1);
    cr_assert_eq(kvd_stat(c0, "loop_connections_1"), 1, "c1 is loop 1's");
    enum { P = 4, B = 32, R = 8 };
    static uint32_t tok[(P + 1) * PAGE];
    static uint8_t payload[P * BB];
    kvd_tokens(tok, (P + 1) * PAGE, 7000000u);
    kvd_fill(payload, sizeof payload, 70);
    kvt_client_put_t r;
    cr_assert_eq(kvt_client_put(c0, tok, P * PAGE, 0, P, payload, NULL, &r), 0);
    cr_assert_eq(r.stored, P);
    kvt_client_match_t one = {0};
    cr_assert_eq(kvt_client_match(c0, tok, P * PAGE, 0, 0, NULL, &one), 0);
    uint64_t shared0 = kvd_stat(c1, "loop_shared_matches_0");
    kvt_batch_t *b;
    cr_assert_eq(kvt_batch_create(&b, c0), 0);
    for (int round = 0; round < R; round++) {
        kvt_client_match_t m[B];
        int st[B];
        for (int k = 0; k < B; k++) {
            m[k] = (kvt_client_match_t){0};
            cr_assert_eq(
                kvt_batch_match(b, tok, (k % 2 ? P + 1 : P) * PAGE, 0, 0, NULL, &m[k], &st[k]), 0);
        }
        uint64_t before = kvd_stat(c1, "loop_write_locks_0");
        cr_assert_eq(kvt_batch_run(b), 0);
        uint64_t after = kvd_stat(c1, "loop_write_locks_0");
        for (int k = 0; k < B; k++) {
            cr_expect_eq(st[k], 0, "round %d, MATCH %d", round, k);
            cr_expect_eq(m[k].pages, P, "round %d, MATCH %d", round, k);
        }
        cr_expect_eq(after - before, 0,
                     "round %d: loop 0 took %llu write locks for %d pipelined MATCHes", round,
                     (unsigned long long)(after - before), B);
    }
    kvt_batch_destroy(b);
    cr_expect_eq(kvd_stat(c1, "loop_shared_matches_0") - shared0, (uint64_t)R * B,
                 "every MATCH of loop 0's connection answered shared");
    cr_expect_eq(kvd_stat(c1, "lookups"), (uint64_t)R * B + 1);
    kvt_client_close(c0);
    kvt_client_close(c1);
    cr_expect_eq(kvd_stop(&d), 0);
    kvd_cleanup(&d);
}

/*
 * A PUT at the front of a pipelined batch takes the write lock for itself; the 31 MATCHes behind
 * it in the same read go back to the shared lock (answered shared, counted in
 * kvtier_loop_shared_matches_total) instead of holding the write lock to the batch's end, which
 * kept every other loop out for the whole batch. The write locks the batch takes are counted
 * too: a handful for the PUT (below), none for the MATCHes.
 */
Test(server_loops, a_put_then_matches_go_back_to_the_shared_lock)
{
    kvd_t d = {0};
    kvd_start(&d, "--loops", "2", NULL);
    kvt_client_t *c0 = kvd_client(&d, "m", PAGE, BB), *c1 = kvd_client(&d, "m", PAGE, BB);
    cr_assert_eq(kvd_stat(c0, "loop_connections_1"), 1, "c1 is loop 1's");
    enum { P = 4, B = 32, R = 8 };
    static uint32_t tok[P * PAGE], fresh[PAGE];
    static uint8_t payload[P * BB];
    kvd_tokens(tok, P * PAGE, 8000000u);
    kvd_fill(payload, sizeof payload, 80);
    kvt_client_put_t r;
    cr_assert_eq(kvt_client_put(c1, tok, P * PAGE, 0, P, payload, NULL, &r), 0);
    kvt_client_match_t one = {0};
    cr_assert_eq(kvt_client_match(c1, tok, P * PAGE, 0, 0, NULL, &one), 0);
    cr_assert_eq(one.pages, P);
    kvt_batch_t *b;
    cr_assert_eq(kvt_batch_create(&b, c1), 0);
    for (int round = 0; round < R; round++) {
        kvd_tokens(fresh, PAGE, 8100000u + (uint32_t)round * 1000u);
        kvt_client_put_t pr;
        kvt_client_match_t m[B - 1];
        int st[B];
        cr_assert_eq(kvt_batch_put(b, fresh, PAGE, 0, 1, payload, NULL, &pr, &st[0]), 0);
        for (int k = 1; k < B; k++) {
            m[k - 1] = (kvt_client_match_t){0};
            cr_assert_eq(kvt_batch_match(b, tok, P * PAGE, 0, 0, NULL, &m[k - 1], &st[k]), 0);
        }
        uint64_t w0 = kvd_stat(c0, "loop_write_locks_1");
        uint64_t s0 = kvd_stat(c0, "loop_shared_matches_1");
        cr_assert_eq(kvt_batch_run(b), 0);
        /* The step after the batch may still be on its way when the last reply is in: a PING's
         * round trip on the same connection waits for it. */
        cr_assert_eq(kvt_client_ping(c1, NULL), 0);
        uint64_t w1 = kvd_stat(c0, "loop_write_locks_1");
        uint64_t s1 = kvd_stat(c0, "loop_shared_matches_1");
        cr_expect_eq(st[0], 0, "round %d: the PUT", round);
        cr_expect_eq(pr.stored, 1, "round %d: the PUT", round);
        for (int k = 1; k < B; k++) {
            cr_expect_eq(st[k], 0, "round %d, MATCH %d", round, k);
            cr_expect_eq(m[k - 1].pages, P, "round %d, MATCH %d", round, k);
        }
        cr_expect_eq(s1 - s0, (uint64_t)B - 1,
                     "round %d: %llu of the %d MATCHes after the PUT answered shared", round,
                     (unsigned long long)(s1 - s0), B - 1);
        /* The PUT's frame, the step after the batch, the kick its completion posts and the
         * write of the replies, the PING's frame and its reply's write: 5 on a quiet machine,
         * never one per MATCH. Under load it varies (7 in 2 of 15 runs at load 9-11, not traced:
         * a batch read in several pieces or replies written in several would each add a hold),
         * so the bound is a third of the MATCHes, which one lock per MATCH would exceed. */
        cr_expect_leq(w1 - w0, (B - 1) / 3, "round %d: %llu write locks for a PUT and %d MATCHes",
                      round, (unsigned long long)(w1 - w0), B - 1);
    }
    kvt_batch_destroy(b);
    kvt_client_close(c0);
    kvt_client_close(c1);
    cr_expect_eq(kvd_stop(&d), 0);
    kvd_cleanup(&d);
}

/* What one STATS says of the leases and of loop 1's queue. */
typedef struct after_get {
    uint64_t leases, queued, queued_bytes;
} after_get_t;

static int after_get_take(void *arg, const char *name, uint64_t v)
{
    after_get_t *a = arg;
    if (!strcmp(name, "leases"))
        a->leases = v;
    else if (!strcmp(name, "loop_queued_requests_1"))
        a->queued = v;
    else if (!strcmp(name, "loop_queued_reply_bytes_1"))
        a->queued_bytes = v;
    return 0;
}

/*
 * A GET's pin (the lease it holds while its pages go out) counts as gone once its reply is whole
 * on its way, as its request counts as answered: with several loops the reply is written with the
 * lock let go, and the pin went only when the loop took the lock back, so a STATS on another
 * loop's connection sent as soon as the reply was in could still count it (one lease more). So
 * do the GET and its bytes in its loop's queue (kvtier_loop_queued_requests, _reply_bytes). 200
 * GETs of DRAM pages on loop 1, each followed at once by STATS on loop 0 (no round trip on a's
 * connection between): the client's own lease only, and an empty queue, every time.
 */
Test(server_loops, stats_after_a_gets_reply_never_counts_its_pin)
{
    kvd_t d = {0};
    kvd_start(&d, "--loops", "2", NULL);
    kvt_client_t *b = kvd_client(&d, "m", PAGE, BB), *a = kvd_client(&d, "m", PAGE, BB);
    cr_assert_eq(kvd_stat(b, "loop_connections_1"), 1, "a is loop 1's");
    enum { P = 4, N = 200 };
    static uint32_t tok[P * PAGE];
    static uint8_t payload[P * BB], back[P * BB];
    kvd_tokens(tok, P * PAGE, 9100000u);
    kvd_fill(payload, sizeof payload, 91);
    kvt_client_put_t r;
    cr_assert_eq(kvt_client_put(a, tok, P * PAGE, 0, P, payload, NULL, &r), 0);
    kvt_client_match_t m = {0};
    cr_assert_eq(kvt_client_match(a, tok, P * PAGE, KVT_CLIENT_LEASE, 60000, NULL, &m), 0);
    cr_assert_eq(m.pages, P);
    int more = 0, queued = 0;
    for (int i = 0; i < N; i++) {
        uint32_t got = 0;
        cr_assert_eq(kvt_client_get(a, m.lease, 0, P, back, sizeof back, &got, NULL), 0);
        cr_assert_eq(got, P);
        after_get_t st = {.queued = UINT64_MAX};
        cr_assert_eq(kvt_client_stats(b, after_get_take, &st), 0);
        more += st.leases != 1;
        queued += st.queued != 0 || st.queued_bytes != 0;
    }
    cr_expect_eq(more, 0, "%d of %d STATS after a GET's reply counted its pin", more, N);
    cr_expect_eq(queued, 0, "%d of %d STATS after a GET's reply found it in its loop's queue",
                 queued, N);
    cr_expect(memcmp(back, payload, sizeof back) == 0);
    kvt_client_close(a);
    kvt_client_close(b);
    cr_expect_eq(kvd_stop(&d), 0);
    kvd_cleanup(&d);
}

/*
 * A PUT's DRAM pages are allocated under the write lock and their bytes copied in by the PUT's
 * loop with the lock let go (op_put.c, kvt__put_apart). KVT_DEBUG_PUT_GATE holds every copy while
 * its file exists: with several loops, a PUT on loop 0 then waits inside its copy while loop 1's
 * connection takes STATS (the write lock) and MATCHes; with one loop the gate is not used (the
 * loop would wait on itself) and the same requests run one after the other. Each helper is run
 * with 1 and with 2 loops.
 */
#define PBB (256u << 10)

typedef struct putter {
    kvt_client_t *c;
    const uint32_t *tok;
    uint32_t pages;
    const uint8_t *payload;
    kvt_client_put_t r;
    int rc, done; /* done: atomic, read by the test while the PUT waits */
} putter_t;

static void *putter_main(void *arg)
{
    putter_t *p = arg;
    p->rc = kvt_client_put(p->c, p->tok, p->pages * PAGE, 0, p->pages, p->payload, NULL, &p->r);
    __atomic_store_n(&p->done, 1, __ATOMIC_RELEASE);
    return NULL;
}

/* A key prefix of this daemon's own on the shared server: tests run side by side. */
static void loops_redis_prefix(char *buf, size_t cap)
{
    snprintf(buf, cap, "kvloops%d-%llu", (int)getpid(), (unsigned long long)kvt_now_ns());
}

/* A daemon with loops loops and its gate's path ("" with one loop: no gate), and two clients of
 * PBB pages: a first (loop 0's), b (loop 1's with two loops). With nvme, no DRAM tier: every
 * page goes to NVMe; with max_client set too, max-frame 3M and that max-client-bytes; with
 * nvme_quota, that tenant-nvme-bytes; with remote, the remote tier below NVMe (the redis-server of
 * KVT_TEST_REDIS, under a prefix of its own: remote_pfx). */
typedef struct put_fix {
    kvd_t d;
    char gate[700];
    kvt_client_t *a, *b;
    const char *max_client, *nvme_quota;
    int remote;
    char remote_pfx[64];
} put_fix_t;

static void put_fix_start(put_fix_t *f, const char *loops, int nvme)
{
    kvd_mkdir(&f->d);
    snprintf(f->gate, sizeof f->gate, "%s/put-gate", f->d.dir);
    if (strcmp(loops, "1"))
        setenv("KVT_DEBUG_PUT_GATE", f->gate, 1);
    else
        f->gate[0] = 0;
    const char *argv[24] = {"--loops", loops};
    int n = 2;
    if (nvme) {
        const char *const tiers[] = {"--dram-bytes",         "0", "--nvme-bytes", "64M",
                                     "--nvme-segment-bytes", "8M"};
        for (size_t i = 0; i < KVT_ARRAY_LEN(tiers); i++)
            argv[n++] = tiers[i];
    }
    if (nvme && f->max_client) {
        argv[n++] = "--max-frame";
        argv[n++] = "3M";
        argv[n++] = "--max-client-bytes";
        argv[n++] = f->max_client;
    }
    if (f->nvme_quota) {
        argv[n++] = "--tenant-nvme-bytes";
        argv[n++] = f->nvme_quota;
    }
    if (f->remote) {
        loops_redis_prefix(f->remote_pfx, sizeof f->remote_pfx);
        argv[n++] = "--remote";
        argv[n++] = kvd_redis();
        argv[n++] = "--remote-prefix";
        argv[n++] = f->remote_pfx;
        argv[n++] = "--remote-bytes";
        argv[n++] = "64M";
    }
    argv[n] = NULL;
    kvd_startv(&f->d, argv);
    unsetenv("KVT_DEBUG_PUT_GATE");
    f->a = kvd_client(&f->d, "p", PAGE, PBB);
    f->b = kvd_client(&f->d, "p", PAGE, PBB);
}

static void put_fix_end(put_fix_t *f)
{
    kvt_client_close(f->a);
    kvt_client_close(f->b);
    cr_expect_eq(kvd_stop(&f->d), 0);
    kvd_cleanup(&f->d);
}

static void put_gate_close(const char *gate)
{
    if (!gate[0])
        return;
    FILE *f = fopen(gate, "w");
    cr_assert(f, "%s: %s", gate, strerror(errno));
    fclose(f);
}

/* STATS on c until the index holds n blocks: a PUT's handler has run. Each STATS takes the
 * write lock: with the PUT's copy under it, the first one waits out the client's timeout. */
static void put_wait_index(kvt_client_t *c, uint64_t n)
{
    for (int i = 0; i < 5000 && kvd_stat(c, "index_blocks") < n; i++)
        usleep(1000);
    cr_assert_geq(kvd_stat(c, "index_blocks"), n, "the PUT's pages are in the index");
}

/* With nvme, the pages go to NVMe: what the gate holds is their checksums and aligned copies
 * (put_prepare), and none of them goes through the tier's bounce buffer. */
static void put_copy_outside(const char *loops, int nvme)
{
    put_fix_t f = {0};
    put_fix_start(&f, loops, nvme);
    kvt_client_t *a = f.a, *b = f.b;
    const char *gate = f.gate;
    enum { P = 4 };
    static uint32_t tok[P * PAGE], other[PAGE];
    static uint8_t payload[P * PBB];
    kvd_tokens(tok, P * PAGE, 9100000u);
    kvd_tokens(other, PAGE, 9200000u);
    for (int p = 0; p < P; p++)
        kvd_fill(payload + (size_t)p * PBB, PBB, 91 + p);
    kvt_client_put_t r;
    cr_assert_eq(kvt_client_put(b, other, PAGE, 0, 1, payload, NULL, &r), 0);
    put_gate_close(gate);
    putter_t pt = {.c = a, .tok = tok, .pages = P, .payload = payload};
    pthread_t th;
    pthread_create(&th, NULL, putter_main, &pt);
    if (gate[0]) {
        put_wait_index(b, 1 + P);
        uint64_t shared = kvd_stat(b, "loop_shared_matches_1");
        kvt_client_match_t m = {0};
        cr_expect_eq(kvt_client_match(b, other, PAGE, 0, 0, NULL, &m), 0);
        cr_expect_eq(m.pages, 1);
        cr_expect_eq(kvd_stat(b, "loop_shared_matches_1") - shared, 1, "answered shared");
        cr_expect(!__atomic_load_n(&pt.done, __ATOMIC_ACQUIRE),
                  "the PUT waits in its copy while loop 1 answers");
        cr_assert_eq(unlink(gate), 0);
    }
    pthread_join(th, NULL);
    cr_assert_eq(pt.rc, 0, "put: %s", kvt_client_strerror(pt.rc));
    cr_expect_eq(pt.r.stored, P);
    kvt_client_match_t m = {0};
    uint8_t tiers[P];
    cr_assert_eq(kvt_client_match(b, tok, P * PAGE, KVT_CLIENT_LEASE, 0, NULL, &m), 0);
    cr_assert_eq(m.pages, P);
    kvd_check_get(b, m.lease, 0, P, PBB, 91, tiers);
    for (int p = 0; p < P; p++)
        cr_expect_eq(tiers[p], nvme ? KVT_CLIENT_TIER_NVME : KVT_CLIENT_TIER_DRAM, "page %d", p);
    if (nvme)
        cr_expect_eq(kvd_metric(&f.d, "kvtier_nvme_bounced_bytes_total"), 0,
                     "the PUTs' pages were copied aligned apart, not bounced under the lock");
    cr_assert_eq(kvt_client_release(b, m.lease, NULL), 0);
    put_fix_end(&f);
}

Test(server_loops, a_put_copies_its_pages_with_the_lock_let_go)
{
    put_copy_outside("2", 0);
}

Test(server_loops, a_put_copies_its_pages_with_one_loop)
{
    put_copy_outside("1", 0);
}

/* A PUT of NVMe pages (no DRAM tier) on loop 0 held in its checksums and aligned copies while loop
 * 1 takes STATS and a MATCH: before, both were made when the write started, under the write lock
 * (tiers/nvme.c, nvme_start_write), and loop 1's STATS waited out the client's timeout. */
Test(server_loops, a_put_hashes_its_nvme_pages_with_the_lock_let_go)
{
    put_copy_outside("2", 1);
}

Test(server_loops, a_put_hashes_its_nvme_pages_with_one_loop)
{
    put_copy_outside("1", 1);
}

/* STATS on c until the clients' memory count is back at want (a request's buffers go once its
 * reply is queued, as the loop gets to them); true when it is. */
static int put_client_bytes_back(kvt_client_t *c, uint64_t want)
{
    for (int i = 0; i < 5000 && kvd_stat(c, "client_buffer_bytes") != want; i++)
        usleep(1000);
    return kvd_stat(c, "client_buffer_bytes") == want;
}

static void raw_put(int fd, const uint32_t *tok, uint32_t pages, const uint8_t *payload);

/* Two prefixes of pages pages, tok (from seed) and left (from seed + 100000), and their payload:
 * page p of PBB bytes filled from fill + p. */
static void put_data(uint32_t *tok, uint32_t *left, uint8_t *payload, uint32_t pages, uint32_t seed,
                     uint32_t fill)
{
    kvd_tokens(tok, pages * PAGE, seed);
    kvd_tokens(left, pages * PAGE, seed + 100000u);
    for (uint32_t p = 0; p < pages; p++)
        kvd_fill(payload + (size_t)p * PBB, PBB, fill + p);
}

/* A PUT frame's bytes, counted whole in the clients' memory while its request lives: pages pages
 * of PAGE tokens and PBB bytes. */
static uint64_t put_frame_bytes(uint32_t pages)
{
    return KVT_PROTO_HDR + sizeof(kvt_wire_put_t) + (uint64_t)pages * PAGE * 4 +
           (uint64_t)pages * PBB;
}

/* f->a PUTs pages pages of tok and payload, held by f's gate (two loops) in its copies while
 * f->b reads the clients' memory count into *mid (left as it was with one loop: no gate). The
 * PUT's result; it must succeed. */
static kvt_client_put_t put_held(put_fix_t *f, const uint32_t *tok, uint32_t pages,
                                 const uint8_t *payload, uint64_t *mid)
{
    put_gate_close(f->gate);
    putter_t pt = {.c = f->a, .tok = tok, .pages = pages, .payload = payload};
    pthread_t th;
    pthread_create(&th, NULL, putter_main, &pt);
    if (f->gate[0]) {
        put_wait_index(f->b, pages);
        *mid = kvd_stat(f->b, "client_buffer_bytes");
        cr_assert_eq(unlink(f->gate), 0);
    }
    pthread_join(th, NULL);
    cr_assert_eq(pt.rc, 0, "put: %s", kvt_client_strerror(pt.rc));
    return pt.r;
}

/*
 * A PUT's NVMe pages (no DRAM tier) copied aligned apart (op_put.c, put_copy_count): each copy
 * counts in the clients' memory beside the frame that holds the payload, from the handler until
 * its write ends, and those max-client-bytes has no room for go through the tier's bounce buffer
 * instead. Eleven 256 KiB pages in a frame of their own (2.75 MiB, counted whole) under a 4 MiB
 * max-client-bytes: four copies fit, the other seven pages bounce. With two loops the gate holds
 * the PUT in its copies while loop 1's STATS reads the count, then a connection closed while its
 * PUT waits there leaves nothing counted once the orphan's writes end.
 */
static void put_copies_counted(const char *loops)
{
    put_fix_t f = {.max_client = "4M"};
    put_fix_start(&f, loops, 1);
    kvt_client_t *b = f.b;
    enum { P = 11 };
    static uint32_t tok[P * PAGE], left[P * PAGE];
    static uint8_t payload[P * PBB];
    put_data(tok, left, payload, P, 9150000u, 60);
    const uint64_t frame = put_frame_bytes(P);
    uint64_t base = kvd_stat(b, "client_buffer_bytes"), mid = 0;
    kvt_client_put_t r = put_held(&f, tok, P, payload, &mid);
    cr_expect_eq(r.stored, P);
    double bounced = kvd_metric(&f.d, "kvtier_nvme_bounced_bytes_total");
    uint64_t copies = P - (uint64_t)bounced / PBB;
    cr_expect_eq(copies, 4, "%.0f bytes bounced: only the copies max-client-bytes holds are made",
                 bounced);
    if (f.gate[0]) {
        cr_expect_eq(mid, base + frame + copies * PBB, "the PUT held its frame and %llu copies",
                     (unsigned long long)copies);
        cr_expect_leq(mid, 4u << 20, "the count stays within max-client-bytes");
    }
    cr_expect(put_client_bytes_back(b, base), "the copies given back with their writes");
    kvt_client_match_t m = {0};
    cr_assert_eq(kvt_client_match(b, tok, P * PAGE, KVT_CLIENT_LEASE, 0, NULL, &m), 0);
    cr_assert_eq(m.pages, P);
    kvd_check_get(b, m.lease, 0, P, PBB, 60, NULL);
    cr_assert_eq(kvt_client_release(b, m.lease, NULL), 0);
    if (f.gate[0]) { /* an orphan's copies: its connection closed while they wait */
        put_gate_close(f.gate);
        int fd = kvd_raw(&f.d);
        raw_put(fd, left, P, payload);
        put_wait_index(b, 2 * P);
        close(fd);
        cr_assert_eq(unlink(f.gate), 0);
        cr_expect(put_client_bytes_back(b, base), "the orphan's copies given back");
    }
    put_fix_end(&f);
}

Test(server_loops, a_puts_aligned_nvme_copies_count_in_the_clients_memory)
{
    put_copies_counted("2");
}

Test(server_loops, a_puts_aligned_nvme_copies_count_with_one_loop)
{
    put_copies_counted("1");
}

static long long redis_del_prefix(const char *addr, const char *pfx);

/*
 * A PUT's NVMe pages that the tier refuses when they are submitted give back their aligned copies'
 * count in the clients' memory, whether the tier below takes them or not (op_put.c, put_submit;
 * put_end gives the count back). The tenant's NVMe share (tenant-nvme-bytes) is charged at
 * submission, so the handler takes every page and the tier refuses those past the share then.
 * Eleven 256 KiB pages under a 1 MiB share and a 4 MiB max-client-bytes: four copies are counted
 * (as in put_copies_counted) and the share holds fewer than four pages, so pages with a copy
 * counted are among the refused ones. With remote, the refused pages go to the remote tier and
 * all eleven are stored; without, they are skipped (no room anywhere).
 */
static void put_refused_counted(const char *loops, int remote)
{
    put_fix_t f = {.max_client = "4M", .nvme_quota = "1M", .remote = remote};
    put_fix_start(&f, loops, 1);
    kvt_client_t *b = f.b;
    enum { P = 11 };
    static uint32_t tok[P * PAGE], left[P * PAGE];
    static uint8_t payload[P * PBB];
    put_data(tok, left, payload, P, 9170000u + 1000u * (uint32_t)remote, 70);
    uint64_t base = kvd_stat(b, "client_buffer_bytes"), mid = 0;
    kvt_client_put_t r = put_held(&f, tok, P, payload, &mid);
    if (f.gate[0]) /* held in its copies: the count held the frame and four copies */
        cr_expect_eq(mid, base + put_frame_bytes(P) + 4 * PBB);
    cr_expect_eq(kvd_metric(&f.d, "kvtier_nvme_bounced_bytes_total"), 0,
                 "the pages without a copy were refused before their write started");
    uint64_t in_nvme = kvd_stat(b, "nvme_blocks");
    cr_expect(in_nvme >= 1 && in_nvme < 4, "%llu pages within the share",
              (unsigned long long)in_nvme);
    cr_expect_geq(kvd_metric(&f.d, "kvtier_tenant_quota_refusals_total{tier=\"nvme\"}"),
                  P - in_nvme, "the pages past the share refused at submission");
    cr_expect_eq(r.stored, remote ? P : in_nvme);
    cr_expect_eq(r.skipped, P - r.stored);
    cr_expect(put_client_bytes_back(b, base),
              "the refused pages' copies given back: %llu bytes counted against %llu before",
              (unsigned long long)kvd_stat(b, "client_buffer_bytes"), (unsigned long long)base);
    kvt_client_match_t m = {0};
    uint8_t tiers[P];
    cr_assert_eq(kvt_client_match(b, tok, P * PAGE, KVT_CLIENT_LEASE, 0, NULL, &m), 0);
    cr_assert_eq(m.pages, P, "every page in the index, skipped ones without data");
    kvd_check_get(b, m.lease, 0, r.stored, PBB, 70, tiers);
    for (uint32_t p = 0; p < r.stored; p++)
        cr_expect_eq(tiers[p], p < in_nvme ? KVT_CLIENT_TIER_NVME : KVT_CLIENT_TIER_REMOTE,
                     "page %u", p);
    cr_assert_eq(kvt_client_release(b, m.lease, NULL), 0);
    put_fix_end(&f);
    if (remote)
        cr_expect_eq(redis_del_prefix(kvd_redis(), f.remote_pfx), P - in_nvme);
}

Test(server_loops, a_puts_pages_refused_at_submission_give_back_their_copies)
{
    put_refused_counted("2", 0);
}

Test(server_loops, a_puts_pages_refused_at_submission_give_back_their_copies_with_one_loop)
{
    put_refused_counted("1", 0);
}

Test(server_loops, a_puts_pages_refused_at_submission_go_to_remote_with_their_copies_given_back)
{
    put_refused_counted("2", 1);
}

/* HELLO (model "p", PBB) and a PUT of pages pages on a raw socket; no reply read. */
static void raw_put(int fd, const uint32_t *tok, uint32_t pages, const uint8_t *payload)
{
    uint8_t f[KVT_PROTO_HDR + sizeof(kvt_wire_hello_t) + 1];
    kvt_wire_hello_t hw = {
        .min_version = 1, .max_version = 1, .page_size = PAGE, .block_bytes = PBB, .model_len = 1};
    kvt_proto_frame(f, KVT_OP_HELLO, 0, 1, 0, sizeof hw + 1);
    memcpy(f + KVT_PROTO_HDR, &hw, sizeof hw);
    f[sizeof f - 1] = 'p';
    cr_assert_eq(write(fd, f, sizeof f), (ssize_t)sizeof f);
    size_t ntok = (size_t)pages * PAGE, pay = (size_t)pages * PBB;
    size_t body = sizeof(kvt_wire_put_t) + ntok * 4 + pay, len = KVT_PROTO_HDR + body;
    uint8_t *w = malloc(len);
    kvt_proto_put_t q = {.ntokens = (uint32_t)ntok, .npayload = pages};
    kvt_proto_frame(w, KVT_OP_PUT, 0, 2, 0, (uint32_t)body);
    kvt_proto_put_encode(w + KVT_PROTO_HDR, &q);
    kvt_proto_tokens_encode(w + KVT_PROTO_HDR + sizeof(kvt_wire_put_t), tok, (uint32_t)ntok);
    memcpy(w + len - pay, payload, pay);
    for (size_t put = 0; put < len;) {
        ssize_t n = write(fd, w + put, len - put);
        cr_assert_gt(n, 0, "write: %s", strerror(errno));
        put += (size_t)n;
    }
    free(w);
}

/*
 * A REMOVE of the prefix a PUT is copying (its pages BUSY, its path pinned): refused (NOWAIT),
 * the pages being written stay; once the PUT is done, a REMOVE takes them. And a connection that
 * closes while its PUT waits in its copy: the daemon reads the close before the copy (the PUT
 * goes on as an orphan) or after it, as the reads fall; either way the pages land whole.
 */
static void put_copy_races(const char *loops)
{
    put_fix_t f = {0};
    put_fix_start(&f, loops, 0);
    kvt_client_t *a = f.a, *b = f.b;
    const char *gate = f.gate;
    enum { P = 4 };
    static uint32_t tok[P * PAGE], left[P * PAGE];
    static uint8_t payload[P * PBB];
    put_data(tok, left, payload, P, 9300000u, 93);
    /* REMOVE against the copy. */
    put_gate_close(gate);
    putter_t pt = {.c = a, .tok = tok, .pages = P, .payload = payload};
    pthread_t th;
    pthread_create(&th, NULL, putter_main, &pt);
    if (gate[0])
        put_wait_index(b, P);
    else
        pthread_join(th, NULL);
    /* Loop 1's (two loops) while the PUT waits in its copy: refused, the PUT's pin holds the
     * path, nothing of the pages being written is freed. With one loop, after the PUT: gone. */
    int rm = kvt_client_remove_nowait(b, tok, PAGE);
    cr_expect_eq(rm, gate[0] ? KVT_CLIENT_EBUSY : 0, "remove: %s", kvt_client_strerror(rm));
    if (gate[0]) {
        cr_assert_eq(unlink(gate), 0);
        pthread_join(th, NULL);
    }
    cr_assert_eq(pt.rc, 0, "put: %s", kvt_client_strerror(pt.rc));
    cr_expect_eq(pt.r.stored, P);
    kvt_client_match_t m = {0};
    cr_assert_eq(kvt_client_match(b, tok, P * PAGE, KVT_CLIENT_LEASE, 0, NULL, &m), 0);
    cr_expect_eq(m.pages, rm == 0 ? 0 : P, "removed: %d", rm);
    if (m.pages == P)
        kvd_check_get(b, m.lease, 0, P, PBB, 93, NULL);
    if (m.lease)
        cr_assert_eq(kvt_client_release(b, m.lease, NULL), 0);
    cr_expect_eq(kvt_client_remove(b, tok, PAGE), rm == 0 ? KVT_CLIENT_ENOENT : 0,
                 "the PUT's pages removed once it is done");
    /* A connection closed while its PUT copies (its reply never read): the daemon sees the
     * close before the copy (an orphan PUT) or after it, as the two reads fall. */
    uint64_t blocks = kvd_stat(b, "index_blocks");
    put_gate_close(gate);
    int fd = kvd_raw(&f.d);
    raw_put(fd, left, P, payload);
    put_wait_index(b, blocks + P);
    close(fd);
    if (gate[0])
        cr_assert_eq(unlink(gate), 0);
    /* Its pages land whole, in DRAM, once the copy is done. */
    uint8_t tiers[P] = {0};
    for (int i = 0; i < 5000; i++) {
        m = (kvt_client_match_t){.tiers = tiers, .tiers_cap = P};
        cr_assert_eq(kvt_client_match(b, left, P * PAGE, 0, 0, NULL, &m), 0);
        if (m.pages == P && tiers[P - 1] == KVT_CLIENT_TIER_DRAM)
            break;
        usleep(1000);
    }
    m = (kvt_client_match_t){0};
    cr_assert_eq(kvt_client_match(b, left, P * PAGE, KVT_CLIENT_LEASE, 0, NULL, &m), 0);
    cr_assert_eq(m.pages, P);
    kvd_check_get(b, m.lease, 0, P, PBB, 93, NULL);
    cr_assert_eq(kvt_client_release(b, m.lease, NULL), 0);
    cr_expect_eq(kvd_stat(b, "leases"), 0);
    put_fix_end(&f);
}

Test(server_loops, a_remove_or_a_close_meets_a_put_in_its_copy)
{
    put_copy_races("2");
}

Test(server_loops, a_remove_or_a_close_after_a_put_with_one_loop)
{
    put_copy_races("1");
}

/*
 * Two writers, one on each loop, PUT the same fresh prefix at once with their own bytes, round
 * after round, while a third PUTs new prefixes that push blocks out of DRAM: one of them stores
 * each page (the other finds it BUSY or held: skipped), and a GET of the prefix serves every page
 * whole as one writer wrote it, all pages from the same writer.
 */
typedef struct same_writer {
    kvt_client_t *c;
    pthread_barrier_t *go;
    int id, rounds;
    uint32_t stored[64];
    int errors;
} same_writer_t;

static void same_tokens(uint32_t *tok, int round)
{
    kvd_tokens(tok, 4 * PAGE, 9500000u + (uint32_t)round * 1000u);
}

static void *same_writer_main(void *arg)
{
    same_writer_t *w = arg;
    enum { P = 4 };
    static __thread uint32_t tok[P * PAGE];
    uint8_t *payload = malloc((size_t)P * PBB);
    for (int round = 0; payload && round < w->rounds; round++) {
        kvt_client_put_t r;
        if (w->id < 2) {
            same_tokens(tok, round);
            for (int p = 0; p < P; p++)
                kvd_fill(payload + (size_t)p * PBB, PBB, (uint32_t)(w->id * 1000 + p));
        } else { /* the pusher: fresh prefixes, DRAM (16 MiB) fills and the step pushes out */
            kvd_tokens(tok, P * PAGE, 9800000u + (uint32_t)round * 1000u);
        }
        pthread_barrier_wait(w->go);
        if (kvt_client_put(w->c, tok, P * PAGE, 0, P, payload, NULL, &r) < 0)
            w->errors++;
        if (w->id < 2)
            w->stored[round] = r.stored;
    }
    free(payload);
    return NULL;
}

static void same_prefix(const char *loops)
{
    kvd_t d = {0};
    kvd_start(&d, "--loops", loops, "--dram-bytes", "16M", "--nvme-bytes", "16M", NULL);
    enum { P = 4, ROUNDS = 48, N = 3 };
    pthread_barrier_t go;
    pthread_barrier_init(&go, NULL, N);
    same_writer_t w[N];
    pthread_t th[N];
    for (int i = 0; i < N; i++) {
        w[i] = (same_writer_t){
            .c = kvd_client(&d, "p", PAGE, PBB), .go = &go, .id = i, .rounds = ROUNDS};
        if (!strcmp(loops, "2"))
            cr_assert_eq(kvd_stat(w[i].c, i % 2 ? "loop_connections_1" : "loop_connections_0"),
                         i / 2 + 1, "writer %d's loop", i);
    }
    for (int i = 0; i < N; i++)
        pthread_create(&th[i], NULL, same_writer_main, &w[i]);
    for (int i = 0; i < N; i++)
        pthread_join(th[i], NULL);
    pthread_barrier_destroy(&go);
    cr_expect_eq(w[0].errors + w[1].errors + w[2].errors, 0);
    kvt_client_t *c = w[0].c;
    static uint32_t tok[P * PAGE];
    uint8_t *buf = malloc((size_t)P * PBB), *want = malloc(PBB);
    int checked = 0;
    for (int round = 0; round < ROUNDS; round++) {
        cr_expect_eq(w[0].stored[round] + w[1].stored[round], P,
                     "round %d: each page stored by one writer (%u, %u)", round, w[0].stored[round],
                     w[1].stored[round]);
        same_tokens(tok, round);
        kvt_client_match_t m = {0};
        cr_assert_eq(kvt_client_match(c, tok, P * PAGE, KVT_CLIENT_LEASE, 0, NULL, &m), 0);
        uint32_t got = 0;
        if (m.pages > 0 &&
            kvt_client_get(c, m.lease, 0, m.pages, buf, (size_t)P * PBB, &got, NULL) == 0) {
            int from = -1;
            for (uint32_t p = 0; p < got; p++) {
                int whose = -1;
                for (int k = 0; k < 2 && whose < 0; k++) {
                    kvd_fill(want, PBB, (uint32_t)(k * 1000) + p);
                    if (!memcmp(buf + (size_t)p * PBB, want, PBB))
                        whose = k;
                }
                cr_expect_geq(whose, 0, "round %d page %u: neither writer's bytes", round, p);
                cr_expect(from < 0 || whose == from, "round %d page %u: a mix of writers", round,
                          p);
                from = whose;
            }
            checked += got > 0;
        }
        if (m.lease)
            cr_assert_eq(kvt_client_release(c, m.lease, NULL), 0);
    }
    cr_expect_gt(checked, 0, "some rounds' prefixes were still there to read");
    double dropped = kvd_metric(&d, "kvtier_blocks_dropped_total{tier=\"dram\"}"),
           demoted = kvd_metric(&d, "kvtier_blocks_moved_total{from=\"dram\",to=\"nvme\"}");
    cr_expect(dropped > 0 || demoted > 0, "the pusher pushed blocks out of DRAM (%g, %g)", dropped,
              demoted);
    free(buf);
    free(want);
    for (int i = 0; i < N; i++)
        kvt_client_close(w[i].c);
    cr_expect_eq(kvd_stop(&d), 0);
    kvd_cleanup(&d);
}

Test(server_loops, two_loops_put_the_same_prefix_with_other_bytes)
{
    same_prefix("2");
}

Test(server_loops, one_loop_puts_the_same_prefix_with_other_bytes)
{
    same_prefix("1");
}

/*
 * Each loop's queue depth (kvtier_loop_queued_requests, kvtier_loop_queued_reply_bytes): a raw
 * connection on loop 1 pipelines N GETs of a 1 MiB page, more than its socket's send buffer
 * holds, and reads nothing. Its loop shows the N requests and their bytes, less what the kernel
 * took; loop 0 (the STATS client's, whose own STATS is not queued yet when the gauges are read)
 * shows none. Once the client has read every reply the gauges are 0 at once: the last replies
 * are written with the lock let go, and count as gone from before that write, as the requests'
 * counters do, so the STATS sent as soon as they are in never finds them. R rounds.
 */
#define QBB (1u << 20)

/* Loop i's queued requests and bytes through STATS on c (loop 0's connection). */
static void queue_depth(kvt_client_t *c, int i, uint64_t *reqs, uint64_t *bytes)
{
    char key[64];
    snprintf(key, sizeof key, "loop_queued_requests_%d", i);
    *reqs = kvd_stat(c, key);
    snprintf(key, sizeof key, "loop_queued_reply_bytes_%d", i);
    *bytes = kvd_stat(c, key);
}

Test(server_loops, a_loops_queue_depth_shows_the_replies_its_client_has_not_read, .timeout = 60)
{
    if (unix_sndbuf_default() >= (int)QBB / 2)
        cr_skip_test("the kernel's default send buffer holds a whole reply");
    kvd_t d = {0};
    kvd_start(&d, "--loops", "2", "--dram-bytes", "64M", NULL);
    kvt_client_t *c = kvd_client(&d, "q", PAGE, QBB); /* loop 0 */
    int fd = kvd_raw(&d);                             /* loop 1 */
    static uint32_t tok[PAGE];
    kvd_tokens(tok, PAGE, 9300000u);
    uint8_t *page = malloc(QBB), *body = malloc(QBB + 4096);
    cr_assert(page && body);
    kvd_fill(page, QBB, 93);
    kvt_client_put_t r;
    cr_assert_eq(kvt_client_put(c, tok, PAGE, 0, 1, page, NULL, &r), 0);
    cr_assert_eq(r.stored, 1);
    uint64_t lease = raw_lease(fd, "q", PAGE, QBB, tok, PAGE, body, QBB + 4096);
    cr_assert_eq(kvd_stat(c, "loop_connections_1"), 1, "the raw connection is loop 1's");
    enum { N = 8, R = 10 };
    size_t frame =
        2 * KVT_PROTO_HDR + sizeof(kvt_wire_get_data_t) + QBB + sizeof(kvt_wire_get_end_t);
    for (int round = 0; round < R; round++) {
        raw_gets(fd, lease, N, 100);
        /* Polled until loop 1 has read them all (5 s at most). */
        uint64_t reqs = 0, bytes = 0, reqs0, bytes0;
        for (int i = 0; i < 500 && reqs < N; i++) {
            queue_depth(c, 1, &reqs, &bytes);
            if (reqs < N)
                usleep(10000);
        }
        queue_depth(c, 0, &reqs0, &bytes0);
        cr_expect_eq(reqs, N, "round %d: loop 1 queues %llu of the %d GETs", round,
                     (unsigned long long)reqs, N);
        cr_expect_gt(bytes, (N - 1) * (uint64_t)QBB, "round %d: %llu bytes queued on loop 1", round,
                     (unsigned long long)bytes);
        cr_expect_leq(bytes, N * frame, "round %d", round);
        cr_expect_eq(reqs0, 0, "round %d: loop 0 queues nothing", round);
        cr_expect_eq(bytes0, 0, "round %d: loop 0 queues nothing", round);
        for (int g = 0; g < N; g++) {
            kvt_proto_hdr_t h;
            read_reply_frame(fd, &h, body, QBB + 4096);
            cr_assert_eq(h.status, 0, "round %d, GET %d", round, g);
            cr_assert_eq(h.body_len, sizeof(kvt_wire_get_data_t) + QBB);
            cr_assert(memcmp(body + sizeof(kvt_wire_get_data_t), page, QBB) == 0);
            read_reply_frame(fd, &h, body, QBB + 4096); /* the end frame */
            cr_assert_eq(h.request_id, 100u + (unsigned)g);
        }
        queue_depth(c, 1, &reqs, &bytes);
        cr_expect_eq(reqs, 0, "round %d: %llu requests still queued once read", round,
                     (unsigned long long)reqs);
        cr_expect_eq(bytes, 0, "round %d: %llu bytes still queued once read", round,
                     (unsigned long long)bytes);
    }
    double promreq = kvd_metric(&d, "kvtier_loop_queued_requests{loop=\"1\"}");
    cr_expect_eq(promreq, 0, "/metrics has the series, at 0");
    close(fd);
    free(page);
    free(body);
    kvt_client_close(c);
    cr_expect_eq(kvd_stop(&d), 0);
    kvd_cleanup(&d);
}

/*
 * A GET whose pages lie in NVMe is planned and its reads submitted under the store's lock shared
 * (op_get.c get_plan_read_shared, get_submit), its completion handed from loop 0 to the
 * connection's loop as a posted kick, which that loop takes shared (kvt__posted_shared), and its
 * batch written and released shared: the loop that serves it takes no write lock (issue 42), on
 * each loop past 0. No DRAM tier: every page is in the tier the flags `tier` give the daemon
 * (`want`, as MATCH names it; here NVMe, below the remote tier). Each round GETs the leased prefix
 * whole and one page of it, the bytes checked; with pages of bb bytes, p of them, a GET of several
 * batches (each next one planned in its drained hook). Before, 3 write locks a GET on its loop
 * (the frame, the posted kick's reap, the batch's release), 110 for each of 2 MiB pages.
 */
static void tier_gets_take_no_write_lock(const char *loops, uint32_t bb, uint32_t p, int rounds,
                                         const char *const *tier, uint8_t want)
{
    kvd_t d = {0};
    const char *argv[16] = {"--loops", loops, "--dram-bytes", "0", "--tick-ms", "10000"};
    for (int i = 0; tier[i]; i++)
        argv[6 + i] = tier[i];
    kvd_startv(&d, argv);
    int n = atoi(loops);
    kvt_client_t *c[4];
    for (int i = 0; i < n; i++)
        c[i] = kvd_client(&d, "m", PAGE, bb);
    uint32_t *tok = calloc((size_t)p * PAGE, sizeof *tok);
    uint8_t *payload = malloc((size_t)p * bb), *back = malloc((size_t)p * bb), tiers[16];
    cr_assert(tok && payload && back && p <= 16);
    char key[96];
    uint64_t gets = 0;
    for (int i = 1; i < n; i++) {
        snprintf(key, sizeof key, "loop_connections_%d", i);
        cr_assert_eq(kvd_stat(c[0], key), 1, "c[%d] is loop %d's", i, i);
        kvd_tokens(tok, p * PAGE, 9900000u + (uint32_t)i * 100000u);
        kvd_fill(payload, (size_t)p * bb, 990 + (uint32_t)i);
        kvt_client_put_t r;
        for (uint32_t k = 0; k < p; k++) {
            cr_assert_eq(
                kvt_client_put(c[i], tok, (k + 1) * PAGE, k, 1, payload + (size_t)k * bb, NULL, &r),
                0);
            cr_assert_eq(r.stored, 1);
        }
        kvt_client_match_t m = {.tiers = tiers, .tiers_cap = 16}, one = {0};
        cr_assert_eq(kvt_client_match(c[i], tok, p * PAGE, KVT_CLIENT_LEASE, 60000, NULL, &m), 0);
        cr_assert_eq(m.pages, p);
        for (uint32_t k = 0; k < p; k++)
            cr_assert_eq(tiers[k], want, "page %u", k);
        cr_assert_eq(kvt_client_match(c[i], tok, p * PAGE, 0, 0, NULL, &one), 0);
        snprintf(key, sizeof key, "kvtier_loop_kicks_posted_total{loop=\"%d\"}", i);
        double w0 = write_locks(&d, i), k0 = kvd_metric(&d, key);
        for (int round = 0; round < rounds; round++) {
            uint32_t got = 0;
            memset(back, 0, (size_t)p * bb);
            cr_assert_eq(kvt_client_get(c[i], m.lease, 0, p, back, (size_t)p * bb, &got, NULL), 0);
            cr_expect_eq(got, p, "loop %d, round %d", i, round);
            cr_expect(memcmp(back, payload, (size_t)p * bb) == 0, "loop %d, round %d: the bytes", i,
                      round);
            cr_assert_eq(kvt_client_get(c[i], m.lease, 1, 1, back, bb, &got, NULL), 0);
            cr_expect_eq(got, 1);
            cr_expect(memcmp(back, payload + bb, bb) == 0, "loop %d, round %d: page 1", i, round);
            gets += 2;
        }
        cr_assert_eq(kvt_client_match(c[i], tok, p * PAGE, 0, 0, NULL, &one), 0);
        double w1 = write_locks(&d, i);
        cr_expect_eq(w1 - w0, 0, "loop %d: %g write locks for %d GETs of %s pages", i, w1 - w0,
                     2 * rounds, kvt_tier_name((kvt_tier_id_t)want));
        cr_expect_geq(kvd_metric(&d, key) - k0, 2 * rounds, "loop %d: loop 0 completed them", i);
        snprintf(key, sizeof key, "kvtier_loop_shared_gets_total{loop=\"%d\"}", i);
        cr_expect_eq(kvd_metric(&d, key), 2 * rounds, "loop %d: every GET planned shared", i);
    }
    cr_expect_eq(kvd_metric(&d, "kvtier_requests_total{op=\"get\"}"), (double)gets);
    cr_expect_eq(kvd_metric(&d, "kvtier_request_errors_total{op=\"get\"}"), 0);
    free(tok);
    free(payload);
    free(back);
    client_a_loop_stop(&d, c, n);
}

static void nvme_gets_take_no_write_lock(const char *loops, uint32_t bb, uint32_t p, int rounds)
{
    static const char *const nvme[] = {"--nvme-bytes", "256M", "--nvme-segment-bytes", "8M", NULL};
    tier_gets_take_no_write_lock(loops, bb, p, rounds, nvme, KVT_CLIENT_TIER_NVME);
}

Test(server_loops, gets_from_nvme_take_no_write_lock)
{
    nvme_gets_take_no_write_lock("2", BB, 4, 16);
}

Test(server_loops, gets_from_nvme_on_four_loops_take_no_write_lock)
{
    nvme_gets_take_no_write_lock("4", BB, 4, 16);
}

Test(server_loops, gets_of_several_nvme_batches_take_no_write_lock, .timeout = 60)
{
    nvme_gets_take_no_write_lock("2", 2u << 20, 12, 6);
}

/*
 * The same for pages in the remote tier (no DRAM, no NVMe: every page goes to the redis-server):
 * a GET's remote reads are planned and submitted under the shared lock too (s->submit: the tier's
 * queue and hiredis context; loop 0 sends, reads the replies and completes them under the write
 * lock), and the GET's loop takes no write lock. Before, 3 a GET (the frame, the posted kick's
 * reap, the release).
 */
static void remote_gets_take_no_write_lock(const char *loops, uint32_t bb, uint32_t p, int rounds)
{
    char pfx[64];
    loops_redis_prefix(pfx, sizeof pfx);
    const char *const remote[] = {
        "--nvme-bytes",   "0",    "--remote", kvd_redis(), "--remote-prefix", pfx,
        "--remote-bytes", "256M", NULL};
    tier_gets_take_no_write_lock(loops, bb, p, rounds, remote, KVT_CLIENT_TIER_REMOTE);
}

Test(server_loops, gets_from_remote_take_no_write_lock)
{
    remote_gets_take_no_write_lock("2", BB, 4, 16);
}

Test(server_loops, gets_from_remote_on_four_loops_take_no_write_lock)
{
    remote_gets_take_no_write_lock("4", BB, 4, 16);
}

Test(server_loops, gets_of_several_remote_batches_take_no_write_lock, .timeout = 60)
{
    remote_gets_take_no_write_lock("2", 2u << 20, 12, 4);
}

/* Runs lua (an EVAL with no keys) on the redis-server at addr (host:port, a loopback address),
 * ARGV[1] the pattern of pfx's keys and ARGV[2] the n bytes at arg, over a plain socket (this file
 * links no hiredis): its integer reply. */
static long long redis_eval(const char *addr, const char *lua, const char *pfx, const void *arg,
                            size_t n)
{
    char host[64], pat[96], req[1024], rep[64] = "";
    int port = 0;
    cr_assert_eq(sscanf(addr, "%63[^:]:%d", host, &port), 2, "%s", addr);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    cr_assert_eq(inet_pton(AF_INET, host, &a.sin_addr), 1, "%s: not an IPv4 address", host);
    int k = snprintf(pat, sizeof pat, "%s:*", pfx);
    int h = snprintf(req, sizeof req,
                     "*5\r\n$4\r\nEVAL\r\n$%zu\r\n%s\r\n$1\r\n0\r\n$%d\r\n%s\r\n$%zu\r\n",
                     strlen(lua), lua, k, pat, n);
    cr_assert(h > 0 && (size_t)h + n + 2 <= sizeof req);
    memcpy(req + h, arg, n);
    memcpy(req + h + n, "\r\n", 2);
    size_t len = (size_t)h + n + 2;
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    cr_assert(fd >= 0 && connect(fd, (struct sockaddr *)&a, sizeof a) == 0);
    cr_assert_eq(write(fd, req, len), (ssize_t)len);
    ssize_t got = 0;
    while (got < (ssize_t)sizeof rep - 1 && !strstr(rep, "\r\n")) {
        ssize_t r = read(fd, rep + got, sizeof rep - 1 - (size_t)got);
        cr_assert_gt(r, 0, "EVAL: no reply");
        got += r;
        rep[got] = 0;
    }
    close(fd);
    cr_assert_eq(rep[0], ':', "EVAL: %s", rep);
    return atoll(rep + 1);
}

/* Deletes every key under prefix pfx on the redis-server at addr, behind the daemon's back:
 * how many went. */
static long long redis_del_prefix(const char *addr, const char *pfx)
{
    static const char lua[] = "local n = 0 for _, k in ipairs(redis.call('KEYS', ARGV[1])) do "
                              "n = n + redis.call('DEL', k) end return n";
    return redis_eval(addr, lua, pfx, "", 0);
}

/* Flips a payload byte (its 101st) of the value under prefix pfx whose payload begins as page
 * does (its first 64 bytes), behind the daemon's back, so that its read fails the checksum. */
static void redis_corrupt(const char *addr, const char *pfx, const uint8_t *page)
{
    static const char lua[] =
        "local n = 0 for _, k in ipairs(redis.call('KEYS', ARGV[1])) do "
        "local v = redis.call('GET', k) local at = string.find(v, ARGV[2], 1, true) if at then "
        "redis.call('SETRANGE', k, at + 99, string.char(255 - string.byte(v, at + 100))) "
        "n = n + 1 end end return n";
    cr_assert_eq(redis_eval(addr, lua, pfx, page, 64), 1, "the page's value is on the server");
}

/*
 * A GET whose remote read fails (its keys deleted on the server behind the daemon's back: a miss)
 * ends as the write path's did: no page, KVT_CLIENT_ENOENT, one request error, the pages marked
 * lost (the next MATCH finds them index-only); its connection and the other loop keep serving. Loop
 * 1's client stores and leases path A, its keys go, then loop 0's client stores path B; loop 1's
 * GET of A fails (planned shared: counted on loop 1), while loop 0 reads B whole, 8 times.
 */
Test(server_loops, a_failed_remote_read_ends_its_get_alone)
{
    enum { P = 4 };
    char pfx[64];
    const char *addr = kvd_redis();
    loops_redis_prefix(pfx, sizeof pfx);
    kvd_t d = {0};
    kvd_start(&d, "--loops", "2", "--dram-bytes", "0", "--nvme-bytes", "0", "--remote", addr,
              "--remote-prefix", pfx, "--tick-ms", "10000", NULL);
    kvt_client_t *c[2] = {kvd_client(&d, "m", PAGE, BB), kvd_client(&d, "m", PAGE, BB)};
    cr_assert_eq(kvd_stat(c[0], "loop_connections_1"), 1, "c[1] is loop 1's");
    static uint32_t ta[P * PAGE], tb[P * PAGE];
    static uint8_t pa[P * BB], pb[P * BB], back[P * BB];
    uint8_t tiers[P];
    kvd_tokens(ta, P * PAGE, 9600000u);
    kvd_tokens(tb, P * PAGE, 9700000u);
    kvd_fill(pa, sizeof pa, 960);
    kvd_fill(pb, sizeof pb, 970);
    kvt_client_put_t r;
    cr_assert_eq(kvt_client_put(c[1], ta, P * PAGE, 0, P, pa, NULL, &r), 0);
    cr_assert_eq(r.stored, P);
    kvt_client_match_t ma = {.tiers = tiers, .tiers_cap = P};
    cr_assert_eq(kvt_client_match(c[1], ta, P * PAGE, KVT_CLIENT_LEASE, 60000, NULL, &ma), 0);
    cr_assert_eq(ma.pages, P);
    cr_assert_eq(tiers[0], KVT_CLIENT_TIER_REMOTE);
    cr_assert_eq(redis_del_prefix(addr, pfx), P, "A's keys deleted");
    cr_assert_eq(kvt_client_put(c[0], tb, P * PAGE, 0, P, pb, NULL, &r), 0);
    cr_assert_eq(r.stored, P);
    kvt_client_match_t mb = {0};
    cr_assert_eq(kvt_client_match(c[0], tb, P * PAGE, KVT_CLIENT_LEASE, 60000, NULL, &mb), 0);
    double errs = kvd_metric(&d, "kvtier_request_errors_total{op=\"get\"}");
    double gets = kvd_metric(&d, "kvtier_requests_total{op=\"get\"}");
    uint32_t got = 99;
    int rc = kvt_client_get(c[1], ma.lease, 0, P, back, sizeof back, &got, NULL);
    cr_expect_eq(rc, KVT_CLIENT_ENOENT, "the failed read ends the GET: %s",
                 kvt_client_strerror(rc));
    cr_expect_eq(got, 0, "no page before the miss");
    for (int i = 0; i < 8; i++) {
        memset(back, 0, sizeof back);
        cr_assert_eq(kvt_client_get(c[0], mb.lease, 0, P, back, sizeof back, &got, NULL), 0);
        cr_expect_eq(got, P);
        cr_expect(memcmp(back, pb, sizeof back) == 0, "B's bytes, round %d", i);
    }
    cr_expect_eq(kvd_metric(&d, "kvtier_requests_total{op=\"get\"}") - gets, 9);
    cr_expect_eq(kvd_metric(&d, "kvtier_request_errors_total{op=\"get\"}") - errs, 1,
                 "the failed GET counts one error");
    kvt_client_match_t again = {.tiers = tiers, .tiers_cap = P};
    cr_assert_eq(kvt_client_match(c[1], ta, P * PAGE, 0, 0, NULL, &again), 0);
    for (uint32_t k = 0; k < again.pages; k++)
        cr_expect_eq(tiers[k], KVT_CLIENT_TIER_NONE, "A's page %u is lost: index-only", k);
    cr_expect_eq(kvt_client_ping(c[1], NULL), 0, "loop 1's connection serves on");
    cr_expect_geq(kvd_metric(&d, "kvtier_loop_shared_gets_total{loop=\"1\"}"), 1,
                  "the GET of A was planned shared");
    client_a_loop_stop(&d, c, 2);
}

/*
 * A pipeline of GETs of NVMe pages on one connection (loop 1), each followed by a MATCH without a
 * lease: the first GET's reads complete on loop 0 while the later ones' are still in flight, and
 * the posted kick finds a queue whose front is finished (a GET's batch, a MATCH's reply) and whose
 * later GETs still read. queue_plain refused any queue with a read pending in it: such a kick was
 * left to the write reap (kvt__loop_busy sees the posted list) and the write took the write lock,
 * 0.87 a GET in bench_server --ops loops --nvme with 8 in flight (docs/benchmarks.md, Step 9).
 * The write stops at the first GET still reading and touches nothing past it, so loop 1 takes no
 * write lock for them now. R rounds of N GETs of 256 KiB pages, every byte and every reply's id
 * checked. With race, a client on loop 0 GETs the same path whole meanwhile (its reads completed
 * on loop 0 among loop 1's), for ThreadSanitizer to watch; the write locks are not counted then.
 */
#define PQB (256u << 10)
enum { PQP = 8, PQN = 8, PQR = 12 }; /* pages of the path, GETs a round, rounds */

typedef struct pq_racer {
    const kvd_t *d;
    const uint32_t *tok;
    const uint8_t *payload;
    volatile int stop;
    int gets, errors;
} pq_racer_t;

/* Loop 0's client: the path leased and GOT whole until told to stop, its bytes checked. */
static void *pq_racer_main(void *arg)
{
    pq_racer_t *w = arg;
    kvt_client_t *c = kvd_client(w->d, "m", PAGE, PQB);
    uint8_t *back = malloc((size_t)PQP * PQB);
    kvt_client_match_t m = {0};
    if (!back || kvt_client_match(c, w->tok, PQP * PAGE, KVT_CLIENT_LEASE, 60000, NULL, &m) ||
        m.pages != PQP)
        w->errors++;
    while (!w->stop && !w->errors) {
        uint32_t got = 0;
        if (kvt_client_get(c, m.lease, 0, PQP, back, (size_t)PQP * PQB, &got, NULL) || got != PQP ||
            memcmp(back, w->payload, (size_t)PQP * PQB) != 0)
            w->errors++;
        w->gets++;
    }
    free(back);
    kvt_client_close(c);
    return NULL;
}

/* N GETs of one page each (page g % PQP, request id 100 + 2g), each followed by a MATCH without a
 * lease of the path's first page (id 101 + 2g), in one write. */
static void pq_send(int fd, uint64_t lease, const uint32_t *tok)
{
    size_t get = KVT_PROTO_HDR + sizeof(kvt_wire_get_t);
    size_t match = KVT_PROTO_HDR + sizeof(kvt_wire_match_t) + PAGE * 4, len = 0;
    uint8_t f[PQN * (KVT_PROTO_HDR + sizeof(kvt_wire_get_t) + KVT_PROTO_HDR +
                     sizeof(kvt_wire_match_t) + PAGE * 4)];
    for (uint32_t g = 0; g < PQN; g++) {
        kvt_wire_get_t gw = {.lease = lease, .first_page = g % PQP, .npages = 1};
        kvt_proto_frame(f + len, KVT_OP_GET, 0, 100 + 2 * g, 0, sizeof gw);
        memcpy(f + len + KVT_PROTO_HDR, &gw, sizeof gw);
        len += get;
        kvt_wire_match_t mw = {.ntokens = PAGE};
        kvt_proto_frame(f + len, KVT_OP_MATCH, 0, 101 + 2 * g, 0, (uint32_t)(sizeof mw + PAGE * 4));
        memcpy(f + len + KVT_PROTO_HDR, &mw, sizeof mw);
        memcpy(f + len + KVT_PROTO_HDR + sizeof mw, tok, PAGE * 4);
        len += match;
    }
    cr_assert_eq(write(fd, f, len), (ssize_t)len);
}

/* The replies to pq_send's frames, in order: each GET's page (its bytes checked) and end frame,
 * then the MATCH's reply. */
static void pq_read(int fd, const uint8_t *payload, uint8_t *body, int round)
{
    for (uint32_t g = 0; g < PQN; g++) {
        kvt_proto_hdr_t h;
        read_reply_frame(fd, &h, body, sizeof(kvt_wire_get_data_t) + PQB);
        cr_assert_eq(h.request_id, 100 + 2 * g, "round %d, GET %u", round, g);
        cr_assert_eq(h.status, 0, "round %d, GET %u", round, g);
        cr_assert_eq(h.body_len, sizeof(kvt_wire_get_data_t) + PQB);
        cr_assert(
            memcmp(body + sizeof(kvt_wire_get_data_t), payload + (size_t)(g % PQP) * PQB, PQB) == 0,
            "round %d, GET %u: the bytes", round, g);
        read_reply_frame(fd, &h, body, sizeof(kvt_wire_get_data_t) + PQB); /* the end frame */
        cr_assert_eq(h.request_id, 100 + 2 * g);
        cr_assert_eq(h.status, 0);
        read_reply_frame(fd, &h, body, sizeof(kvt_wire_get_data_t) + PQB); /* the MATCH's */
        cr_assert_eq(h.request_id, 101 + 2 * g, "round %d, MATCH %u", round, g);
        cr_assert_eq(h.status, 0);
        cr_assert_eq(kvt_get_u32(body + 4), 1, "round %d, MATCH %u: its page stored", round, g);
    }
}

static void pipelined_nvme_gets(int race)
{
    kvd_t d = {0};
    kvd_start(&d, "--loops", "2", "--dram-bytes", "0", "--nvme-bytes", "256M",
              "--nvme-segment-bytes", "8M", "--tick-ms", "10000", NULL);
    kvt_client_t *c = kvd_client(&d, "m", PAGE, PQB); /* loop 0 */
    int fd = kvd_raw(&d);                             /* loop 1 */
    static uint32_t tok[PQP * PAGE];
    kvd_tokens(tok, PQP * PAGE, 9810000u);
    uint8_t *payload = malloc((size_t)PQP * PQB), *body = malloc(sizeof(kvt_wire_get_data_t) + PQB);
    cr_assert(payload && body);
    for (uint32_t p = 0; p < PQP; p++)
        put_page(c, tok, p, PQB, 981u + p, payload + (size_t)p * PQB);
    uint64_t lease =
        raw_lease(fd, "m", PAGE, PQB, tok, PQP * PAGE, body, sizeof(kvt_wire_get_data_t) + PQB);
    cr_assert_eq(kvt_get_u32(body + 4), PQP, "the path leased whole");
    cr_assert_eq(kvd_stat(c, "loop_connections_1"), 1, "the raw connection is loop 1's");
    pq_racer_t w = {.d = &d, .tok = tok, .payload = payload};
    pthread_t th;
    if (race)
        cr_assert_eq(pthread_create(&th, NULL, pq_racer_main, &w), 0);
    double w0 = write_locks(&d, 1);
    double s0 = kvd_metric(&d, "kvtier_loop_shared_gets_total{loop=\"1\"}");
    for (int round = 0; round < PQR; round++) {
        pq_send(fd, lease, tok);
        pq_read(fd, payload, body, round);
    }
    double w1 = write_locks(&d, 1);
    if (race) {
        w.stop = 1;
        pthread_join(th, NULL);
        cr_expect_eq(w.errors, 0, "loop 0's GETs: %d wrong of %d", w.errors, w.gets);
        cr_expect_gt(w.gets, 0);
    } else {
        cr_expect_eq(w1 - w0, 0, "%g write locks on loop 1 for %d pipelined GETs of NVMe pages",
                     w1 - w0, PQN * PQR);
    }
    cr_expect_eq(kvd_metric(&d, "kvtier_loop_shared_gets_total{loop=\"1\"}") - s0, PQN * PQR,
                 "every GET planned shared");
    cr_expect_eq(kvd_metric(&d, "kvtier_request_errors_total{op=\"get\"}"), 0);
    close(fd);
    free(payload);
    free(body);
    kvt_client_close(c);
    cr_expect_eq(kvd_stop(&d), 0);
    kvd_cleanup(&d);
}

Test(server_loops, pipelined_nvme_gets_take_no_write_lock, .timeout = 60)
{
    pipelined_nvme_gets(0);
}

Test(server_loops, pipelined_nvme_gets_while_loop_0_completes_others, .timeout = 60)
{
    pipelined_nvme_gets(1);
}

/* A reader of nvme_gets_share_the_lock: its connection, on loop `loop`, and what it saw. */
typedef struct nvme_sharer {
    kvt_client_t *c;
    int loop, rounds, done; /* rounds to run; those whose pages were all in NVMe when leased */
    int errors, line, finished;
} nvme_sharer_t;

#define SBB             (64u << 10)
#define SHARER_WRONG(k) ((k)->line = (k)->line ? (k)->line : __LINE__, (k)->errors++)

static void sharer_tokens(uint32_t *tok, int loop, int round, uint32_t pages)
{
    kvd_tokens(tok, pages * PAGE, 9600000u + (uint32_t)loop * 100000u + (uint32_t)round * 100u);
}

/* Each round: a fresh 4-page prefix PUT (into NVMe: there is no DRAM tier), leased, GET whole
 * twice and one page once, every byte checked, then RELEASEd. A round whose pages the log
 * reclaimed before the lease pinned them is passed over. */
static void *nvme_sharer_main(void *arg)
{
    nvme_sharer_t *k = arg;
    enum { P = 4 };
    static __thread uint32_t tok[P * PAGE];
    static __thread uint8_t payload[P * SBB], back[P * SBB];
    uint8_t tiers[P];
    for (int round = 0; round < k->rounds; round++) {
        sharer_tokens(tok, k->loop, round, P);
        kvd_fill(payload, sizeof payload, (uint32_t)(k->loop * 1000 + round));
        kvt_client_put_t r;
        kvt_client_match_t m = {.tiers = tiers, .tiers_cap = P};
        if (kvt_client_put(k->c, tok, P * PAGE, 0, P, payload, NULL, &r) < 0 ||
            kvt_client_match(k->c, tok, P * PAGE, KVT_CLIENT_LEASE, 60000, NULL, &m) < 0) {
            SHARER_WRONG(k);
            continue;
        }
        int whole = m.pages == P && memchr(tiers, KVT_CLIENT_TIER_NONE, P) == NULL;
        for (int g = 0; whole && g < 3; g++) {
            uint32_t first = g == 2 ? 2 : 0, n = g == 2 ? 1 : P, got = 0;
            memset(back, 0, sizeof back);
            if (kvt_client_get(k->c, m.lease, first, n, back, sizeof back, &got, NULL) < 0 ||
                got != n || memcmp(back, payload + (size_t)first * SBB, (size_t)n * SBB) != 0)
                SHARER_WRONG(k);
        }
        k->done += whole;
        if (m.lease && kvt_client_release(k->c, m.lease, NULL) < 0)
            SHARER_WRONG(k);
    }
    __atomic_store_n(&k->finished, 1, __ATOMIC_RELAXED);
    return NULL;
}

/* The writer's prompts start far from every reader's tokens (a page with the same tokens would be
 * one page, stored with whoever's bytes came first). */
#define KVT_WRITER_TOK 20000000u

/* The writer's round w: a fresh one-page prompt PUT (the log fills and reclaims segments), every
 * other one of them REMOVEd 8 rounds later (the rest stay, so the log fills), and each reader's
 * prefix of a few rounds back REMOVEd (the one it has leased is refused: NOWAIT). */
static void nvme_writer_round(kvt_client_t *w, int round, const nvme_sharer_t *k, int n)
{
    static uint32_t tok[4 * PAGE];
    static uint8_t payload[SBB];
    kvt_client_put_t r;
    kvd_tokens(tok, PAGE, KVT_WRITER_TOK + (uint32_t)round * 100u);
    kvd_fill(payload, SBB, 9690u + (uint32_t)round);
    cr_assert_eq(kvt_client_put(w, tok, PAGE, 0, 1, payload, NULL, &r), 0);
    if (round >= 8 && round % 2) {
        kvd_tokens(tok, PAGE, KVT_WRITER_TOK + (uint32_t)(round - 8) * 100u);
        (void)kvt_client_remove(w, tok, PAGE);
    }
    for (int i = 0; i < n; i++) {
        sharer_tokens(tok, k[i].loop, round % k[i].rounds, 4);
        (void)kvt_client_remove_nowait(w, tok, 4 * PAGE);
    }
}

/*
 * GETs of NVMe pages planned, submitted and sent under the store's lock shared on several loops
 * at once (each loop's reads go through s->submit into the one io_uring ring), while a writer on
 * loop 0 PUTs fresh pages into a small log (16 segments of 1 MiB: it reclaims segments, dropping
 * blocks) and REMOVEs the readers' prefixes and its own older ones. A reader's leased pages stay
 * readable (the lease pins their segments: the reclaim passes them by) and every GET comes whole
 * with its own bytes; every reader loop plans its GETs shared and takes no write lock for them.
 */
static void nvme_gets_share_the_lock(const char *loops)
{
    kvd_t d = {0};
    kvd_start(&d, "--loops", loops, "--dram-bytes", "0", "--nvme-bytes", "16M",
              "--nvme-segment-bytes", "1M", "--tick-ms", "2", NULL);
    int n = atoi(loops) - 1;
    kvt_client_t *w = kvd_client(&d, "m", PAGE, SBB);
    nvme_sharer_t k[3] = {{0}};
    pthread_t th[3];
    cr_assert_leq(n, 3);
    for (int i = 0; i < n; i++)
        k[i] = (nvme_sharer_t){.c = kvd_client(&d, "m", PAGE, SBB), .loop = i + 1, .rounds = 40};
    double lost = kvd_metric(&d, "kvtier_tier_lost_blocks_total{tier=\"nvme\"}");
    enum { FILL = 160 }; /* about 11 MiB of the writer's pages live: the log is near full */
    int round = 0;
    for (; round < FILL; round++)
        nvme_writer_round(w, round, k, n);
    for (int i = 0; i < n; i++)
        cr_assert_eq(pthread_create(&th[i], NULL, nvme_sharer_main, &k[i]), 0);
    /* Until the readers are done, and (looked at every 32 rounds after) the log has reclaimed. */
    for (int left = n, reclaimed = 0; left > 0 || !reclaimed; round++) {
        nvme_writer_round(w, round, k, n);
        left = 0;
        for (int i = 0; i < n; i++)
            left += !__atomic_load_n(&k[i].finished, __ATOMIC_RELAXED);
        if (!left && round % 32 == 0)
            reclaimed = kvd_metric(&d, "kvtier_tier_lost_blocks_total{tier=\"nvme\"}") > lost;
    }
    char key[96];
    for (int i = 0; i < n; i++) {
        pthread_join(th[i], NULL);
        cr_expect_eq(k[i].errors, 0, "loop %d: %d wrong GETs or failed calls, the first at line %d",
                     k[i].loop, k[i].errors, k[i].line);
        cr_expect_geq(k[i].done, k[i].rounds / 2, "loop %d: %d rounds of %d leased whole",
                      k[i].loop, k[i].done, k[i].rounds);
        snprintf(key, sizeof key, "kvtier_loop_shared_gets_total{loop=\"%d\"}", k[i].loop);
        cr_expect_geq(kvd_metric(&d, key), 2 * k[i].done, "loop %d: its GETs planned shared",
                      k[i].loop);
        kvt_client_close(k[i].c);
    }
    kvt_client_close(w);
    cr_expect_eq(kvd_stop(&d), 0);
    kvd_cleanup(&d);
}

Test(server_loops, gets_from_nvme_share_the_lock_while_others_write, .timeout = 120)
{
    nvme_gets_share_the_lock("2");
}

Test(server_loops, gets_from_nvme_on_four_loops_share_the_lock_while_others_write, .timeout = 120)
{
    nvme_gets_share_the_lock("4");
}

/*
 * The same for pages in the HBM tier (its host backend, no DRAM or NVMe: every page lands in HBM
 * first): a GET's HBM reads are planned and queued under the shared lock too (s->submit: the
 * tier's read queue, marked queue_only so that the GET's loop never sends a batch; loop 0's poll
 * of the tier, under the write lock, copies and completes them), and the GET's loop takes no write
 * lock. Before, one a GET on a loop past 0 (the frame: its batch went from the host backend's
 * memory, written under the lock): 32 for 32 GETs of 4 pages of 4 KiB, 88 for 12 GETs of 12
 * pages of 2 MiB.
 */
static const char *const hbm_tier_args[] = {
    "--nvme-bytes", "0", "--hbm-backend", "host", "--hbm-bytes", "64M", NULL};

static void hbm_gets_take_no_write_lock(const char *loops, uint32_t bb, uint32_t p, int rounds)
{
    tier_gets_take_no_write_lock(loops, bb, p, rounds, hbm_tier_args, KVT_CLIENT_TIER_HBM);
}

Test(server_loops, gets_from_hbm_take_no_write_lock)
{
    hbm_gets_take_no_write_lock("2", BB, 4, 16);
}

Test(server_loops, gets_from_hbm_on_four_loops_take_no_write_lock)
{
    hbm_gets_take_no_write_lock("4", BB, 4, 16);
}

Test(server_loops, gets_of_several_hbm_batches_take_no_write_lock, .timeout = 60)
{
    hbm_gets_take_no_write_lock("2", 2u << 20, 12, 6);
}

/*
 * A connection that closes while its GET's batch, planned shared, is being read: the request
 * becomes an orphan (no connection) whose reads complete on loop 0, and its batch's DRAM pages'
 * read counts are let go from the loop's table the request names (r->get.loop_reads), not through
 * its connection. The path lies in the tiers tiers_args give the daemon, t1 and t2 among them
 * (DRAM and NVMe: 512 KiB of DRAM for 16 pages of 64 KiB, so a batch holds both); each of 20 raw
 * connections leases it, sends a GET of it and closes at once. The daemon serves on: the leases
 * given back, the path read whole, and it stops cleanly.
 */
static void close_while_a_shared_get_reads(const char *loops, const char *const *tiers_args,
                                           uint8_t t1, uint8_t t2)
{
    kvd_t d = {0};
    const char *argv[16] = {"--loops", loops, "--tick-ms", "10000"};
    for (int i = 0; tiers_args[i]; i++)
        argv[4 + i] = tiers_args[i];
    kvd_startv(&d, argv);
    enum { P = 16 };
    kvt_client_t *c0 = kvd_client(&d, "m", PAGE, SBB);
    static uint32_t tok[P * PAGE];
    static uint8_t payload[P * SBB], back[P * SBB], body[4096];
    uint8_t tiers[P];
    kvd_tokens(tok, P * PAGE, 9550000u);
    kvd_fill(payload, sizeof payload, 955);
    kvt_client_put_t r;
    cr_assert_eq(kvt_client_put(c0, tok, P * PAGE, 0, P, payload, NULL, &r), 0);
    kvt_client_match_t m = {.tiers = tiers, .tiers_cap = P};
    cr_assert_eq(kvt_client_match(c0, tok, P * PAGE, 0, 0, NULL, &m), 0);
    cr_assert_eq(m.pages, P);
    cr_assert(memchr(tiers, t1, P) && memchr(tiers, t2, P), "the path lies in %s and %s",
              kvt_tier_name((kvt_tier_id_t)t1), kvt_tier_name((kvt_tier_id_t)t2));
    for (int round = 0; round < 20; round++) {
        int fd = kvd_raw(&d);
        uint64_t lease = raw_lease(fd, "m", PAGE, SBB, tok, P * PAGE, body, sizeof body);
        uint8_t f[KVT_PROTO_HDR + sizeof(kvt_wire_get_t)];
        kvt_wire_get_t gw = {.lease = lease};
        kvt_proto_frame(f, KVT_OP_GET, 0, 3, 0, sizeof gw);
        memcpy(f + KVT_PROTO_HDR, &gw, sizeof gw);
        cr_assert_eq(write(fd, f, sizeof f), (ssize_t)sizeof f);
        close(fd);
    }
    uint64_t t0 = kvt_now_ns();
    while (kvd_stat(c0, "leases") && kvt_now_ns() - t0 < 3000000000ull)
        usleep(20 * 1000);
    cr_expect_eq(kvd_stat(c0, "leases"), 0);
    /* One loop runs no shared framing (loops_running): its GETs take the write path. */
    if (atoi(loops) > 1)
        cr_expect_gt(kvd_metric(&d, "kvtier_loop_shared_gets_total{loop=\"1\"}"), 0,
                     "loop 1 planned the GETs shared");
    m = (kvt_client_match_t){0};
    cr_assert_eq(kvt_client_match(c0, tok, P * PAGE, KVT_CLIENT_LEASE, 60000, NULL, &m), 0);
    uint32_t got = 0;
    cr_assert_eq(kvt_client_get(c0, m.lease, 0, P, back, sizeof back, &got, NULL), 0);
    cr_expect_eq(got, P);
    cr_expect(memcmp(back, payload, sizeof back) == 0);
    kvt_client_close(c0);
    cr_expect_eq(kvd_stop(&d), 0);
    kvd_cleanup(&d);
}

Test(server_loops, a_close_while_a_shared_get_reads_from_nvme)
{
    static const char *const t[] = {"--dram-bytes", "512K", "--nvme-bytes", "64M", NULL};
    close_while_a_shared_get_reads("2", t, KVT_CLIENT_TIER_DRAM, KVT_CLIENT_TIER_NVME);
}

/* The same with every page in the remote tier: the orphan's reads complete on loop 0 when the
 * redis-server answers, their read counts let go from loop 1's table. */
Test(server_loops, a_close_while_a_shared_get_reads_from_remote)
{
    char pfx[64];
    loops_redis_prefix(pfx, sizeof pfx);
    const char *const t[] = {
        "--dram-bytes",    "0", "--nvme-bytes",   "0",   "--remote", kvd_redis(),
        "--remote-prefix", pfx, "--remote-bytes", "64M", NULL};
    close_while_a_shared_get_reads("2", t, KVT_CLIENT_TIER_REMOTE, KVT_CLIENT_TIER_REMOTE);
}

/* The same with the path's first half in HBM (its host backend: 512 KiB, 8 of the 16 pages) and
 * the rest in DRAM: the orphan's HBM reads, queued from loop 1, are copied and completed by loop
 * 0's poll of the tier, their read counts let go from loop 1's table. With one loop too, which
 * frames nothing shared: the same closes on the write path, which sends HBM pages from the host
 * backend's memory. */
static const char *const hbm_dram_args[] = {
    "--dram-bytes", "2M",          "--nvme-bytes", "0", "--hbm-backend",
    "host",         "--hbm-bytes", "512K",         NULL};

Test(server_loops, a_close_while_a_shared_get_reads_from_hbm)
{
    close_while_a_shared_get_reads("2", hbm_dram_args, KVT_CLIENT_TIER_HBM, KVT_CLIENT_TIER_DRAM);
}

Test(server_loops, a_close_while_a_shared_get_reads_from_hbm_with_one_loop)
{
    close_while_a_shared_get_reads("1", hbm_dram_args, KVT_CLIENT_TIER_HBM, KVT_CLIENT_TIER_DRAM);
}

/* A path across HBM, DRAM and NVMe (256 KiB each of HBM and DRAM: 4 pages each, the other 8 in
 * NVMe), its batch holding reads of two tiers and pages sent from DRAM: the orphans' reads
 * complete on loop 0 from two tiers, and the last GET, read whole, has every page's bytes. */
static const char *const hbm_mix_args[] = {"--dram-bytes", "256K",          "--nvme-bytes",
                                           "64M",          "--hbm-backend", "host",
                                           "--hbm-bytes",  "256K",          NULL};

Test(server_loops, a_close_while_a_shared_get_reads_from_hbm_and_nvme)
{
    close_while_a_shared_get_reads("2", hbm_mix_args, KVT_CLIENT_TIER_HBM, KVT_CLIENT_TIER_NVME);
}

Test(server_loops, a_close_while_a_shared_get_reads_from_hbm_and_nvme_with_one_loop)
{
    close_while_a_shared_get_reads("1", hbm_mix_args, KVT_CLIENT_TIER_HBM, KVT_CLIENT_TIER_NVME);
}

typedef struct nvme_matcher {
    kvt_client_t *c;
    const uint32_t *tok;
    int rounds, errors, line;
} nvme_matcher_t;

/* MATCHes without a lease of a 4-page NVMe path, each answered shared (op_match.c nvme_dropped
 * reads the NVMe tier's drop counts, kvt_tier_dropped). */
static void *nvme_matcher_main(void *arg)
{
    nvme_matcher_t *k = arg;
    uint8_t tiers[4];
    for (int round = 0; round < k->rounds; round++) {
        kvt_client_match_t m = {.tiers = tiers, .tiers_cap = 4};
        if (kvt_client_match(k->c, k->tok, 4 * PAGE, 0, 0, NULL, &m) < 0 || m.pages != 4 ||
            tiers[3] != KVT_CLIENT_TIER_NVME)
            SHARER_WRONG(k);
    }
    return NULL;
}

/*
 * MATCHes answered shared on loop 2 while loop 1's GETs of NVMe pages submit their reads, shared
 * too (s->submit). A MATCH once copied the NVMe tier's whole usage to see whether the tier ever
 * dropped a block, racing with the reads' in-flight count (ThreadSanitizer, the multi-loop tests
 * of `make test`); it reads the drop counts alone now, which move only under the write lock.
 */
Test(server_loops, matches_share_the_lock_with_gets_reading_nvme, .timeout = 60)
{
    kvd_t d = {0};
    kvd_start(&d, "--loops", "3", "--dram-bytes", "0", "--nvme-bytes", "64M",
              "--nvme-segment-bytes", "8M", "--tick-ms", "10000", NULL);
    kvt_client_t *c[3];
    char key[96];
    for (int i = 0; i < 3; i++)
        c[i] = kvd_client(&d, "m", PAGE, SBB);
    for (int i = 0; i < 3; i++) {
        snprintf(key, sizeof key, "loop_connections_%d", i);
        cr_assert_eq(kvd_stat(c[0], key), 1, "c[%d] is loop %d's", i, i);
    }
    enum { P = 4, R = 200 };
    static uint32_t tok[P * PAGE];
    static uint8_t payload[P * SBB], back[P * SBB];
    uint8_t tiers[P];
    kvd_tokens(tok, P * PAGE, 9560000u);
    kvd_fill(payload, sizeof payload, 956);
    kvt_client_put_t r;
    cr_assert_eq(kvt_client_put(c[1], tok, P * PAGE, 0, P, payload, NULL, &r), 0);
    kvt_client_match_t m = {.tiers = tiers, .tiers_cap = P};
    cr_assert_eq(kvt_client_match(c[1], tok, P * PAGE, KVT_CLIENT_LEASE, 60000, NULL, &m), 0);
    cr_assert_eq(m.pages, P);
    cr_assert(memchr(tiers, KVT_CLIENT_TIER_NONE, P) == NULL);
    nvme_matcher_t k = {.c = c[2], .tok = tok, .rounds = R};
    pthread_t th;
    cr_assert_eq(pthread_create(&th, NULL, nvme_matcher_main, &k), 0);
    int wrong = 0;
    for (int round = 0; round < R; round++) {
        uint32_t got = 0;
        memset(back, 0, sizeof back);
        if (kvt_client_get(c[1], m.lease, 0, P, back, sizeof back, &got, NULL) < 0 || got != P ||
            memcmp(back, payload, sizeof back) != 0)
            wrong++;
    }
    pthread_join(th, NULL);
    cr_expect_eq(wrong, 0, "%d wrong GETs", wrong);
    cr_expect_eq(k.errors, 0, "%d wrong MATCHes, the first at line %d", k.errors, k.line);
    cr_expect_eq(kvd_metric(&d, "kvtier_loop_shared_gets_total{loop=\"1\"}"), R);
    cr_expect_eq(kvd_metric(&d, "kvtier_loop_shared_matches_total{loop=\"2\"}"), R);
    for (int i = 0; i < 3; i++)
        kvt_client_close(c[i]);
    cr_expect_eq(kvd_stop(&d), 0);
    kvd_cleanup(&d);
}

/*
 * Every path that runs under the store's lock shared, at once on four loops, with nothing else
 * going on. A path P lies in DRAM and NVMe (16 pages of 64 KiB, 1 MiB of DRAM shared with Z
 * below: the step moves what has no room down to NVMe), so that a batch of its holds both and the
 * reads' completions come back to each loop as posted kicks, taken shared. Loop 1 MATCHes P
 * (whole; a page longer, a miss whose reason and curve keys are hashed from the tokens; as a
 * PROBE), loop 2 GETs it whole and loop 3 a page at a time, each under a lease of its own; loop
 * 0's zero-copy client MATCHes P and GETs with LOCATE its own leased path Z, stored through its
 * mapping (located where they lie). A third of loops 0 and 1's MATCHes take a lease (held to the
 * end: the tree's lease table grows meanwhile), its NVMe blocks pinned while loops 2 and 3 read
 * them; every other one of those leases is RELEASEd at once (or in front of the client's next
 * request), under the shared lock too; loop 1's keep P's tokens (KEEP), and loop 0 then MATCHes Z
 * with LEASE, LOCATE and KEEP too, as the vLLM connector's loads do, its located pages read where
 * they lie. Two holders of the shared lock on different loops have no order between them:
 * whatever one writes that another reads or writes, without s->submit or a table of its own, is a
 * data race that ThreadSanitizer reports (scripts/test.sh runs this suite against its kvtierd).
 * Against the daemon before 13c51f2 (a MATCH copied the NVMe tier's usage while GETs counted their
 * reads in flight) it reports on every run.
 */
typedef struct mixer {
    kvt_client_t *c;
    const uint32_t *tok;    /* P's tokens, for the MATCHes */
    const uint8_t *payload; /* the bytes of the path its GETs read */
    uint64_t lease;         /* on that path */
    int loop, errors, line;
    uint32_t located;
    const uint32_t *ztok;      /* loop 0: Z's tokens, for its located MATCHes */
    uint32_t mlocated;         /* the pages those located */
    uint64_t held[128];        /* the leases its leased MATCHes took, released at the end */
    uint32_t nheld, nreleased; /* nreleased: those RELEASEd at once instead (mixer_match) */
} mixer_t;

enum { MIXP = 16, MIXZ = 4, MIXR = 150 };

/* Loop 0's MATCH of Z with LEASE (held), LOCATE and KEEP: every page located, its bytes Z's. */
static void mixer_locate(mixer_t *k)
{
    kvt_client_loc_t locs[MIXZ];
    kvt_client_match_t m = {0};
    kvt_client_step_t st = {.locs = locs, .locs_cap = MIXZ};
    unsigned flags = KVT_CLIENT_LEASE | KVT_CLIENT_LOCATE | KVT_CLIENT_KEEP;
    if (kvt_client_match_step(k->c, k->ztok, MIXZ * PAGE, flags, 600000, NULL, &m, &st) < 0 ||
        m.pages != MIXZ || !m.lease || !st.handle || st.located != MIXZ) {
        SHARER_WRONG(k);
        return;
    }
    for (uint32_t p = 0; p < MIXZ; p++)
        if (!locs[p].host_ptr || memcmp(locs[p].host_ptr, k->payload + (size_t)p * SBB, SBB) != 0)
            SHARER_WRONG(k);
    k->mlocated += st.located;
    if (k->nheld < sizeof k->held / sizeof *k->held)
        k->held[k->nheld++] = m.lease;
}

/* A MATCH of P with LEASE (held; loop 1's with KEEP), or of P and a page more (a miss), or a
 * PROBE of it: P's pages each time. */
static void mixer_match(mixer_t *k, int round)
{
    static __thread uint32_t longer[(MIXP + 1) * PAGE];
    memcpy(longer, k->tok, sizeof(uint32_t) * MIXP * PAGE);
    kvd_tokens(longer + MIXP * PAGE, PAGE, 9579000u);
    uint8_t tiers[MIXP + 1];
    kvt_client_match_t m = {.tiers = tiers, .tiers_cap = MIXP + 1};
    int more = round % 3 == 1;
    unsigned flags = round % 3 == 2 ? KVT_CLIENT_PROBE : round % 3 == 0 ? KVT_CLIENT_LEASE : 0;
    kvt_client_step_t st = {0};
    if (flags == KVT_CLIENT_LEASE && k->loop == 1)
        flags |= KVT_CLIENT_KEEP;
    if (kvt_client_match_step(k->c, more ? longer : k->tok, (MIXP + (uint32_t)more) * PAGE, flags,
                              600000, NULL, &m, &st) < 0 ||
        m.pages != MIXP || !(flags & KVT_CLIENT_LEASE) != !m.lease ||
        !(flags & KVT_CLIENT_KEEP) != !st.handle)
        SHARER_WRONG(k);
    /* Every other lease goes at once: RELEASEd, or in front of the next request (release_later,
     * as an engine's connector does), under the shared lock while the other loops read. */
    int released = 0;
    if (m.lease && round % 12 == 3) {
        if (kvt_client_release(k->c, m.lease, &released) < 0 || !released)
            SHARER_WRONG(k);
        k->nreleased++;
    } else if (m.lease && round % 12 == 9) {
        if (kvt_client_release_later(k->c, m.lease) < 0)
            SHARER_WRONG(k);
        k->nreleased++;
    } else if (m.lease && k->nheld < sizeof k->held / sizeof *k->held) {
        k->held[k->nheld++] = m.lease;
    }
    if (k->loop == 0 && round % 3 == 0)
        mixer_locate(k);
}

/* A GET of n pages from first under the loop's lease, every byte checked; loop 0's with LOCATE,
 * its pages read where they lie in its mapping. */
static void mixer_get(mixer_t *k, uint32_t first, uint32_t n)
{
    static __thread uint8_t back[MIXP * SBB];
    uint32_t got = 0;
    if (k->loop == 0) {
        loc_check_t w = {
            .want = k->payload + (size_t)first * SBB, .first = first, .n = n, .bb = SBB};
        w.map = kvt_client_mapping(k->c, &w.map_bytes);
        if (kvt_client_get_cb(k->c, k->lease, first, n, loc_check_page, &w, &got) < 0 || got != n ||
            w.seen != n || w.wrong)
            SHARER_WRONG(k);
        k->located += w.located;
        return;
    }
    memset(back, 0, (size_t)n * SBB);
    if (kvt_client_get(k->c, k->lease, first, n, back, sizeof back, &got, NULL) < 0 || got != n ||
        memcmp(back, k->payload + (size_t)first * SBB, (size_t)n * SBB) != 0)
        SHARER_WRONG(k);
}

static void *mixer_main(void *arg)
{
    mixer_t *k = arg;
    for (int round = 0; round < MIXR; round++) {
        if (k->loop <= 1)
            mixer_match(k, round);
        if (k->loop == 0)
            mixer_get(k, 0, MIXZ);
        if (k->loop == 2)
            mixer_get(k, 0, MIXP);
        if (k->loop == 3)
            mixer_get(k, (uint32_t)round % MIXP, 1);
    }
    return NULL;
}

/* Whether m, a MATCH of P, found all of it in DRAM and NVMe, some in each. */
static int mixed_path(const kvt_client_match_t *m)
{
    int dram = 0, nvme = 0;
    for (uint32_t p = 0; p < m->pages && p < MIXP; p++) {
        dram += m->tiers[p] == KVT_CLIENT_TIER_DRAM;
        nvme += m->tiers[p] == KVT_CLIENT_TIER_NVME;
    }
    return m->pages == MIXP && dram && nvme && dram + nvme == MIXP;
}

/* Leases n pages of tok on k's connection for its GETs; m gets the MATCH. */
static void mixer_lease(mixer_t *k, const uint32_t *tok, uint32_t n, kvt_client_match_t *m)
{
    cr_assert_eq(kvt_client_match(k->c, tok, n * PAGE, KVT_CLIENT_LEASE, 600000, NULL, m), 0);
    cr_assert_eq(m->pages, n);
    k->lease = m->lease;
}

Test(server_loops, every_shared_path_at_once, .timeout = 120)
{
    kvd_t d = {0};
    kvd_start(&d, "--loops", "4", "--dram-bytes", "1M", "--nvme-bytes", "64M", "--tick-ms", "10000",
              NULL);
    static uint32_t tok[MIXP * PAGE], ztok[MIXZ * PAGE];
    static uint8_t payload[MIXP * SBB], zbytes[MIXZ * SBB];
    kvd_tokens(tok, MIXP * PAGE, 9570000u);
    kvd_fill(payload, sizeof payload, 957);
    kvd_tokens(ztok, MIXZ * PAGE, 9575000u);
    kvd_fill(zbytes, sizeof zbytes, 958);
    mixer_t k[4];
    pthread_t th[4];
    char key[96];
    for (int i = 0; i < 4; i++) {
        k[i] = (mixer_t){.c = kvd_client_map(&d, "m", PAGE, SBB, i == 0),
                         .tok = tok,
                         .payload = i ? payload : zbytes,
                         .ztok = ztok,
                         .loop = i};
        snprintf(key, sizeof key, "loop_connections_%d", i);
        cr_assert_eq(kvd_stat(k[0].c, key), 1, "client %d is loop %d's", i, i);
    }
    /* Z through loop 0's mapping, leased at once (the step moves no leased page); then P. */
    kvt_client_put_t r;
    uint8_t tiers[MIXP];
    kvt_client_match_t m = {.tiers = tiers, .tiers_cap = MIXP};
    cr_assert_eq(kvt_client_put(k[0].c, ztok, MIXZ * PAGE, 0, MIXZ, zbytes, NULL, &r), 0);
    mixer_lease(&k[0], ztok, MIXZ, &m);
    cr_assert_eq(memchr(tiers, KVT_CLIENT_TIER_DRAM, MIXZ) != NULL, 1, "Z lies in DRAM");
    cr_assert_eq(kvt_client_put(k[1].c, tok, MIXP * PAGE, 0, MIXP, payload, NULL, &r), 0);
    uint64_t t0 = kvt_now_ns();
    do {
        usleep(10 * 1000);
        cr_assert_eq(kvt_client_match(k[1].c, tok, MIXP * PAGE, KVT_CLIENT_PROBE, 0, NULL, &m), 0);
    } while (!mixed_path(&m) && kvt_now_ns() - t0 < 10000000000ull);
    cr_assert(mixed_path(&m), "P lies in DRAM and NVMe");
    double matches[4], gets[4], releases[4];
    for (int i = 0; i < 4; i++) {
        if (i)
            mixer_lease(&k[i], tok, MIXP, &m);
        snprintf(key, sizeof key, "kvtier_loop_shared_releases_total{loop=\"%d\"}", i);
        releases[i] = kvd_metric(&d, key);
        snprintf(key, sizeof key, "kvtier_loop_shared_matches_total{loop=\"%d\"}", i);
        matches[i] = kvd_metric(&d, key);
        snprintf(key, sizeof key, "kvtier_loop_shared_gets_total{loop=\"%d\"}", i);
        gets[i] = kvd_metric(&d, key);
    }
    for (int i = 0; i < 4; i++)
        cr_assert_eq(pthread_create(&th[i], NULL, mixer_main, &k[i]), 0);
    for (int i = 0; i < 4; i++) {
        pthread_join(th[i], NULL);
        cr_expect_eq(k[i].errors, 0, "loop %d: %d wrong replies, the first at line %d", i,
                     k[i].errors, k[i].line);
    }
    cr_expect_eq(k[0].located, MIXR * MIXZ, "loop 0's GETs located Z's pages");
    cr_expect_eq(k[0].mlocated, (MIXR + 2) / 3 * MIXZ, "loop 0's MATCHes located Z's pages");
    /* The leased MATCHes' leases, and the four the GETs read under, held; then let go. */
    double want = 4 + k[0].nheld + k[1].nheld, now = leases_now(k[2].c, want);
    cr_expect_eq(k[0].nheld + k[1].nheld + k[0].nreleased + k[1].nreleased, 3 * ((MIXR + 2) / 3),
                 "every leased MATCH leased");
    cr_expect_eq(k[0].nreleased + k[1].nreleased, 2 * ((MIXR + 8) / 12 + (MIXR + 2) / 12),
                 "every other leased MATCH's lease released at once");
    cr_expect_eq(now, want, "STATS' leases: %g", now);
    for (int i = 0; i < 2; i++)
        for (uint32_t j = 0; j < k[i].nheld; j++) {
            int released = 0;
            cr_expect_eq(kvt_client_release(k[i].c, k[i].held[j], &released), 0);
            cr_expect_eq(released, 1, "loop %d's lease %u", i, j);
        }
    cr_expect_eq(leases_now(k[2].c, 4), 4);
    /* Every MATCH and GET answered shared: none went by the write path. */
    for (int i = 0; i < 4; i++) {
        snprintf(key, sizeof key, "kvtier_loop_shared_matches_total{loop=\"%d\"}", i);
        cr_expect_eq(kvd_metric(&d, key) - matches[i],
                     i == 0   ? MIXR + (MIXR + 2) / 3
                     : i == 1 ? MIXR
                              : 0,
                     "loop %d's MATCHes", i);
        snprintf(key, sizeof key, "kvtier_loop_shared_gets_total{loop=\"%d\"}", i);
        cr_expect_eq(kvd_metric(&d, key) - gets[i], i == 1 ? 0 : MIXR, "loop %d's GETs", i);
        snprintf(key, sizeof key, "kvtier_loop_shared_releases_total{loop=\"%d\"}", i);
        cr_expect_eq(kvd_metric(&d, key) - releases[i], k[i].nheld + k[i].nreleased,
                     "loop %d's RELEASEs", i);
    }
    for (int i = 0; i < 4; i++)
        kvt_client_close(k[i].c);
    cr_expect_eq(kvd_stop(&d), 0);
    kvd_cleanup(&d);
}

/*
 * A sibling of every_shared_path_at_once with the HBM tier (its host backend, 512 KiB: 8 slots of
 * 64 KiB): P's first 4 pages lie in HBM, the next in DRAM, the rest in NVMe, and 4 HBM slots are
 * free. Loop 1 MATCHes P (with LEASE and KEEP, a miss, a PROBE) and GETs it whole, loop 2 GETs it
 * whole, loop 3 a page at a time: their HBM reads queued from three loops at once (s->submit),
 * beside NVMe reads and DRAM pages, every byte checked. Meanwhile loop 0 PUTs and REMOVEs one-page
 * prompts that land in the free HBM slots, under the write lock: the tier's write queue, its flush
 * of the queued reads before those writes, its frees and its bitmap, against the shared readers.
 * Every MATCH and GET of loops 1-3 is answered shared.
 */
static void *hbm_mixer_main(void *arg)
{
    mixer_t *k = arg;
    static __thread uint32_t wtok[PAGE];
    static __thread uint8_t wbytes[SBB];
    for (int round = 0; round < MIXR; round++) {
        if (k->loop == 0) {
            kvt_client_put_t r;
            kvd_tokens(wtok, PAGE, 9590000u + (uint32_t)round * 100);
            kvd_fill(wbytes, SBB, 959 + (uint32_t)round);
            if (kvt_client_put(k->c, wtok, PAGE, 0, 1, wbytes, NULL, &r) < 0 || r.stored != 1 ||
                kvt_client_remove(k->c, wtok, PAGE) < 0)
                SHARER_WRONG(k);
        }
        if (k->loop == 1)
            mixer_match(k, round);
        if (k->loop == 1 || k->loop == 2)
            mixer_get(k, 0, MIXP);
        if (k->loop == 3)
            mixer_get(k, (uint32_t)round % MIXP, 1);
    }
    return NULL;
}

/* Whether m, a MATCH of P, found it in HBM, DRAM and NVMe, some in each. */
static int hbm_mixed_path(const kvt_client_match_t *m)
{
    int n[8] = {0};
    for (uint32_t p = 0; p < m->pages && p < MIXP; p++)
        n[m->tiers[p] & 7]++;
    return m->pages == MIXP && n[KVT_CLIENT_TIER_HBM] && n[KVT_CLIENT_TIER_DRAM] &&
           n[KVT_CLIENT_TIER_NVME] &&
           n[KVT_CLIENT_TIER_HBM] + n[KVT_CLIENT_TIER_DRAM] + n[KVT_CLIENT_TIER_NVME] == MIXP;
}

Test(server_loops, every_shared_path_at_once_with_hbm, .timeout = 120)
{
    kvd_t d = {0};
    kvd_start(&d, "--loops", "4", "--dram-bytes", "512K", "--nvme-bytes", "64M", "--hbm-backend",
              "host", "--hbm-bytes", "512K", "--tick-ms", "10000", NULL);
    static uint32_t tok[MIXP * PAGE], ftok[4 * PAGE];
    static uint8_t payload[MIXP * SBB];
    kvd_tokens(tok, MIXP * PAGE, 9580000u);
    kvd_fill(payload, sizeof payload, 958);
    kvd_tokens(ftok, 4 * PAGE, 9585000u);
    mixer_t k[4];
    pthread_t th[4];
    char key[96];
    for (int i = 0; i < 4; i++) {
        k[i] = (mixer_t){
            .c = kvd_client(&d, "m", PAGE, SBB), .tok = tok, .payload = payload, .loop = i};
        snprintf(key, sizeof key, "loop_connections_%d", i);
        cr_assert_eq(kvd_stat(k[0].c, key), 1, "client %d is loop %d's", i, i);
    }
    /* A filler takes 4 HBM slots, P the other 4 and then DRAM and NVMe; the filler goes. */
    kvt_client_put_t r;
    cr_assert_eq(kvt_client_put(k[0].c, ftok, 4 * PAGE, 0, 4, payload, NULL, &r), 0);
    cr_assert_eq(kvt_client_put(k[1].c, tok, MIXP * PAGE, 0, MIXP, payload, NULL, &r), 0);
    uint8_t tiers[MIXP];
    kvt_client_match_t m = {.tiers = tiers, .tiers_cap = MIXP};
    uint64_t t0 = kvt_now_ns();
    do {
        usleep(10 * 1000);
        cr_assert_eq(kvt_client_match(k[1].c, tok, MIXP * PAGE, KVT_CLIENT_PROBE, 0, NULL, &m), 0);
    } while (!hbm_mixed_path(&m) && kvt_now_ns() - t0 < 10000000000ull);
    cr_assert(hbm_mixed_path(&m), "P lies in HBM, DRAM and NVMe");
    double matches[4], gets[4];
    for (int i = 1; i < 4; i++)
        mixer_lease(&k[i], tok, MIXP, &m);
    cr_assert_eq(kvt_client_remove(k[0].c, ftok, PAGE), 0);
    cr_assert_eq(kvd_stat(k[0].c, "hbm_blocks"), 4, "4 HBM slots free");
    for (int i = 0; i < 4; i++) {
        snprintf(key, sizeof key, "kvtier_loop_shared_matches_total{loop=\"%d\"}", i);
        matches[i] = kvd_metric(&d, key);
        snprintf(key, sizeof key, "kvtier_loop_shared_gets_total{loop=\"%d\"}", i);
        gets[i] = kvd_metric(&d, key);
    }
    double hbm_writes =
        kvd_metric(&d, "kvtier_tier_io_duration_seconds_count{tier=\"hbm\",dir=\"write\"}");
    for (int i = 0; i < 4; i++)
        cr_assert_eq(pthread_create(&th[i], NULL, hbm_mixer_main, &k[i]), 0);
    for (int i = 0; i < 4; i++) {
        pthread_join(th[i], NULL);
        cr_expect_eq(k[i].errors, 0, "loop %d: %d wrong replies, the first at line %d", i,
                     k[i].errors, k[i].line);
    }
    cr_expect_geq(
        kvd_metric(&d, "kvtier_tier_io_duration_seconds_count{tier=\"hbm\",dir=\"write\"}") -
            hbm_writes,
        MIXR, "loop 0's PUTs went to HBM");
    for (uint32_t j = 0; j < k[1].nheld; j++)
        cr_expect_eq(kvt_client_release(k[1].c, k[1].held[j], NULL), 0);
    for (int i = 1; i < 4; i++) {
        snprintf(key, sizeof key, "kvtier_loop_shared_matches_total{loop=\"%d\"}", i);
        cr_expect_eq(kvd_metric(&d, key) - matches[i], i == 1 ? MIXR : 0, "loop %d's MATCHes", i);
        snprintf(key, sizeof key, "kvtier_loop_shared_gets_total{loop=\"%d\"}", i);
        cr_expect_eq(kvd_metric(&d, key) - gets[i], MIXR, "loop %d's GETs", i);
    }
    for (int i = 0; i < 4; i++)
        kvt_client_close(k[i].c);
    cr_expect_eq(kvd_stop(&d), 0);
    kvd_cleanup(&d);
}

/*
 * Located MATCHes on two loops at once: loops 1 and 2 each have a zero-copy client that stores a
 * path of its own through its mapping, then MATCHes it with LEASE, LOCATE and KEEP, 8 pipelined
 * a round, and RELEASEs them. Both loops' MATCHes are answered shared at the same time, each
 * counting its located pages (kvtier_zero_copy_pages_total{op="get"}) in its loop's metric table:
 * in the main one, two loops would write it together (a data race that ThreadSanitizer reports).
 * Every located page reads its own bytes where it lies.
 */
typedef struct locmatcher {
    kvt_client_t *c;
    const uint32_t *tok;
    const uint8_t *payload;
    int errors, line;
    uint32_t located;
} locmatcher_t;

enum { LMP = 4, LMB = 8, LMR = 60 };

static void *locmatcher_main(void *arg)
{
    locmatcher_t *k = arg;
    unsigned flags = KVT_CLIENT_LEASE | KVT_CLIENT_LOCATE | KVT_CLIENT_KEEP;
    for (int round = 0; round < LMR; round++) {
        kvt_client_match_t m[LMB];
        kvt_client_step_t st[LMB];
        kvt_client_loc_t locs[LMB][LMP];
        int status[LMB];
        kvt_batch_t *b;
        if (kvt_batch_create(&b, k->c) < 0) {
            SHARER_WRONG(k);
            return NULL;
        }
        for (int j = 0; j < LMB; j++) {
            m[j] = (kvt_client_match_t){0};
            st[j] = (kvt_client_step_t){.locs = locs[j], .locs_cap = LMP};
            if (kvt_batch_match_step(b, k->tok, LMP * PAGE, flags, 60000, NULL, &m[j], &st[j],
                                     &status[j]) < 0)
                SHARER_WRONG(k);
        }
        if (kvt_batch_run(b) < 0)
            SHARER_WRONG(k);
        kvt_batch_reset(b);
        for (int j = 0; j < LMB; j++) {
            if (status[j] || m[j].pages != LMP || !m[j].lease || !st[j].handle ||
                st[j].located != LMP)
                SHARER_WRONG(k);
            for (uint32_t p = 0; p < LMP && p < st[j].located; p++)
                if (!locs[j][p].host_ptr ||
                    memcmp(locs[j][p].host_ptr, k->payload + (size_t)p * BB, BB) != 0)
                    SHARER_WRONG(k);
            k->located += st[j].located;
            if (m[j].lease && kvt_batch_release(b, m[j].lease, &status[j]) < 0)
                SHARER_WRONG(k);
        }
        if (kvt_batch_run(b) < 0)
            SHARER_WRONG(k);
        kvt_batch_destroy(b);
    }
    return NULL;
}

Test(server_loops, located_matches_on_two_loops_at_once, .timeout = 120)
{
    kvd_t d = {0};
    kvt_client_t *c[4];
    int n = client_a_loop(&d, "3", 1, c);
    static uint32_t tok[3][LMP * PAGE];
    static uint8_t payload[3][LMP * BB];
    locmatcher_t k[3];
    pthread_t th[3];
    double shared[3];
    char key[96];
    for (int i = 1; i < n; i++) {
        kvd_tokens(tok[i], LMP * PAGE, 9590000u + (uint32_t)i * 10000u);
        kvd_fill(payload[i], sizeof payload[i], 959 + (uint32_t)i);
        kvt_client_put_t r;
        cr_assert_eq(kvt_client_put(c[i], tok[i], LMP * PAGE, 0, LMP, payload[i], NULL, &r), 0);
        cr_assert_eq(r.stored, LMP);
        k[i] = (locmatcher_t){.c = c[i], .tok = tok[i], .payload = payload[i]};
        snprintf(key, sizeof key, "kvtier_loop_shared_matches_total{loop=\"%d\"}", i);
        shared[i] = kvd_metric(&d, key);
    }
    for (int i = 1; i < n; i++)
        cr_assert_eq(pthread_create(&th[i], NULL, locmatcher_main, &k[i]), 0);
    for (int i = 1; i < n; i++) {
        pthread_join(th[i], NULL);
        cr_expect_eq(k[i].errors, 0, "loop %d: %d wrong replies, the first at line %d", i,
                     k[i].errors, k[i].line);
        cr_expect_eq(k[i].located, LMR * LMB * LMP, "loop %d: located pages", i);
        snprintf(key, sizeof key, "kvtier_loop_shared_matches_total{loop=\"%d\"}", i);
        /* Since RELEASE went shared nothing here takes the write lock, which applies the loops'
         * deferred hits: the MATCH that finds its loop's KVT_LOOP_HITS (256) full goes to the
         * write path, which applies them (every loop's). At most one of a loop's 480 does. */
        double got = kvd_metric(&d, key) - shared[i];
        cr_expect(got >= LMR * LMB - 1 && got <= LMR * LMB, "loop %d: %g of %d MATCHes shared", i,
                  got, LMR * LMB);
    }
    cr_expect_eq(kvd_metric(&d, "kvtier_zero_copy_pages_total{op=\"get\"}"),
                 (double)(n - 1) * LMR * LMB * LMP);
    cr_expect_eq(leases_now(c[0], 0), 0);
    client_a_loop_stop(&d, c, n);
}

/*
 * A GET planned shared whose reads are in flight when its path is let go (its client's lease
 * ends, or its connection closes) and the path is then REMOVEd, while the read of a record that
 * fails its checksum has yet to complete on loop 0. That completion marks the record lost
 * (op_get.c get_read_done, kvt__store_lost), which writes to the path's node: only while
 * something still holds the path (get_holds_path).
 *
 * The window is wide by construction, not by timing: on its raw connection (loop 1) the client
 * leases two paths of 7 pages of 1 MiB in NVMe (no DRAM tier; one GET batch each), a good one and
 * a bad one whose last record has a payload byte flipped on disk, and pipelines 6 GETs of the good
 * path, then 2 of the bad one. The bad path's reads complete behind 42 MiB of reads that loop 0
 * checks 512 KiB a poll (tiers/nvme.c, POLL_VERIFY_BUDGET), well after the frames written with the
 * GETs, or a close and another connection's REMOVEs, have been handled. Both paths are REMOVEd,
 * so that the NVMe tier holds nothing: the node's block freed a second time fails the policy's
 * check of its books (kvt_policy_on_free) and stops the daemon, in the release build as under
 * AddressSanitizer (which also reports the freed node read).
 */
enum { BP = 7, BGOOD = 6, BBAD = 2 }; /* pages of a path; GETs of the good path, of the bad one */

typedef struct bad_fix {
    kvd_t d;
    kvt_client_t *c0;           /* loop 0 */
    int fd;                     /* the raw connection, loop 1; -1 once closed */
    uint32_t tok[2][BP * PAGE]; /* the good path's tokens, the bad one's */
    uint64_t sums[2][BP];
    uint64_t lease[2];
    uint8_t *body; /* a reply frame's body: at most a page with its data header */
} bad_fix_t;

/* Flips a payload byte of the NVMe record whose payload begins as page does, so that its read
 * fails the checksum (KVT_ECORRUPT). A record starts on a 4 KiB sector and its payload after a
 * 4 KiB header here, so the payload is found on a 4 KiB boundary of the log's file. */
static void nvme_corrupt(const kvd_t *d, const uint8_t *page)
{
    char path[700];
    snprintf(path, sizeof path, "%s/kvtier-data/kvtier.data", d->dir);
    int fd = open(path, O_RDWR);
    cr_assert(fd >= 0, "%s: %s", path, strerror(errno));
    uint8_t head[64];
    off_t at = -1;
    for (off_t off = 0; at < 0 && pread(fd, head, sizeof head, off) == sizeof head; off += 4096)
        if (memcmp(head, page, sizeof head) == 0)
            at = off;
    cr_assert(at >= 0, "the page's record is in %s", path);
    uint8_t x = (uint8_t)~page[100];
    cr_assert_eq(pwrite(fd, &x, 1, at + 100), 1);
    close(fd);
}

/* The daemon, the two paths stored (the bad one's last record corrupted) and leased on the raw
 * connection. */
static void bad_start(bad_fix_t *f)
{
    kvd_start(&f->d, "--loops", "2", "--dram-bytes", "0", "--nvme-bytes", "64M",
              "--nvme-segment-bytes", "16M", "--max-output", "1G", "--tick-ms", "5", NULL);
    f->c0 = kvd_client(&f->d, "m", PAGE, NBB);
    f->fd = kvd_raw(&f->d);
    f->body = malloc(sizeof(kvt_wire_get_data_t) + NBB);
    uint8_t *payload = malloc(NBB);
    cr_assert(f->body && payload);
    raw_hello_model(f->fd, "m", PAGE, NBB, f->body, 4096);
    cr_assert_eq(kvd_stat(f->c0, "loop_connections_1"), 1, "the raw connection is loop 1's");
    for (uint32_t k = 0; k < 2; k++) {
        kvd_tokens(f->tok[k], BP * PAGE, 9570000u + k * 10000u);
        for (uint32_t p = 0; p < BP; p++)
            f->sums[k][p] = put_page(f->c0, f->tok[k], p, NBB, 957u + k * 10u + p, payload);
    }
    nvme_corrupt(&f->d, payload); /* the bad path's last page, stored last */
    for (int k = 0; k < 2; k++) {
        f->lease[k] = raw_match_lease(f->fd, f->tok[k], BP * PAGE, f->body, 4096);
        cr_assert_eq(kvt_get_u32(f->body + 4), BP, "path %d leased whole", k);
    }
    free(payload);
}

/* A RELEASE of lease (request id) at f; its length. */
static size_t bad_release_frame(uint8_t *f, uint64_t id, uint64_t lease)
{
    kvt_wire_release_t rw = {.lease = lease};
    kvt_proto_frame(f, KVT_OP_RELEASE, 0, id, 0, sizeof rw);
    memcpy(f + KVT_PROTO_HDR, &rw, sizeof rw);
    return KVT_PROTO_HDR + sizeof rw;
}

/* A REMOVE of path tok whole (request id) at f, one that waits for the daemon's own holds: its
 * first page and every page beneath it; its length. */
static size_t bad_remove_frame(uint8_t *f, uint64_t id, const uint32_t *tok)
{
    uint32_t body = (uint32_t)(sizeof(kvt_wire_remove_t) + PAGE * 4);
    kvt_proto_frame(f, KVT_OP_REMOVE, 0, id, 0, body);
    kvt_proto_remove_encode(f + KVT_PROTO_HDR, PAGE);
    kvt_proto_tokens_encode(f + KVT_PROTO_HDR + sizeof(kvt_wire_remove_t), tok, PAGE);
    return KVT_PROTO_HDR + body;
}

/* The GETs (request ids 10, 11, ...: the good path's, then the bad one's), then the tail's
 * frames, in one write. */
static void bad_send(const bad_fix_t *f, const uint8_t *tail, size_t tail_len)
{
    enum { GETF = KVT_PROTO_HDR + sizeof(kvt_wire_get_t) };
    uint8_t buf[(BGOOD + BBAD) * GETF + 2048], *g = buf;
    for (int i = 0; i < BGOOD + BBAD; i++, g += GETF) {
        kvt_wire_get_t gw = {.lease = f->lease[i >= BGOOD]};
        kvt_proto_frame(g, KVT_OP_GET, 0, 10 + (uint64_t)i, 0, sizeof gw);
        memcpy(g + KVT_PROTO_HDR, &gw, sizeof gw);
    }
    cr_assert_leq(tail_len, sizeof buf - (size_t)(g - buf));
    if (tail_len)
        memcpy(g, tail, tail_len);
    g += tail_len;
    cr_assert_eq(write(f->fd, buf, (size_t)(g - buf)), g - buf);
}

/* The reply of GET id on raw socket fd, its frames read into body (room for one of a page of bb
 * bytes): its status; the pages it sent in *got, each checked to come in order, one of the path's
 * n pages, with the checksum in sums (a wrong frame counted in *wrong). */
static int raw_get_pages(int fd, uint64_t id, uint8_t *body, uint32_t bb, const uint64_t *sums,
                         uint32_t n, uint32_t *got, int *wrong)
{
    kvt_proto_hdr_t h;
    for (*got = 0;; (*got)++) {
        read_reply_frame(fd, &h, body, sizeof(kvt_wire_get_data_t) + bb);
        *wrong += h.request_id != id;
        if (!(h.flags & KVT_RF_MORE))
            return h.status;
        uint32_t page = kvt_get_u32(body);
        *wrong += h.body_len != sizeof(kvt_wire_get_data_t) + bb || page != *got || page >= n ||
                  page_sum(body + sizeof(kvt_wire_get_data_t), bb) != sums[page];
    }
}

/* GET i's reply: its status; the pages it sent in *got, each checked against its path's sums (a
 * wrong one counted in *wrong). */
static int bad_read_get(bad_fix_t *f, int i, uint32_t *got, int *wrong)
{
    return raw_get_pages(f->fd, 10 + (uint64_t)i, f->body, NBB, f->sums[i >= BGOOD], BP, got,
                         wrong);
}

/* The value of series once it lies in [at_least, at_most], or after 5 s. */
static double bad_wait_metric(const kvd_t *d, const char *series, double at_least, double at_most)
{
    uint64_t t0 = kvt_now_ns();
    double v = kvd_metric(d, series);
    while ((v < at_least || v > at_most) && kvt_now_ns() - t0 < 5000000000ull) {
        usleep(2000);
        v = kvd_metric(d, series);
    }
    return v;
}

/* Both paths gone, every NVMe byte freed once its reads were done, and the daemon serving on. */
static void bad_end(bad_fix_t *f)
{
    for (int k = 0; k < 2; k++) {
        kvt_client_match_t m = {0};
        cr_expect_eq(kvt_client_match(f->c0, f->tok[k], BP * PAGE, 0, 0, NULL, &m), 0);
        cr_expect_eq(m.pages, 0, "path %d was removed", k);
    }
    cr_expect_eq(bad_wait_metric(&f->d, "kvtier_tier_used_bytes{tier=\"nvme\"}", 0, 0), 0,
                 "the NVMe tier holds nothing");
    if (f->fd >= 0)
        close(f->fd);
    free(f->body);
    kvt_client_close(f->c0);
    cr_expect_eq(kvd_stop(&f->d), 0);
    kvd_cleanup(&f->d);
}

/*
 * The lease ends (RELEASE, framed right behind the GETs in the same write) while every GET's only
 * batch is being read: each GET then holds the path itself (kvt__get_lease_ends: a GET whose last
 * batch is in flight counts as one with pages left). So the REMOVEs framed after the RELEASEs wait
 * for the GETs, and the bad record is marked lost while its node is there. Each good GET comes
 * whole, each bad one ends with a miss at its last page after the 6 before it, byte-exact; then
 * the RELEASEs and REMOVEs succeed. Without the hold the REMOVEs free the nodes at once, and the
 * bad read's completion marks the freed node's block lost.
 */
/* The RELEASEs of both leases (request ids 30, 31), then REMOVEs of both paths (32, 33), at tail;
 * their length. */
static size_t bad_let_go_frames(const bad_fix_t *f, uint8_t *tail)
{
    size_t n = 0;
    for (int k = 0; k < 2; k++)
        n += bad_release_frame(tail + n, 30 + (uint64_t)k, f->lease[k]);
    for (int k = 0; k < 2; k++)
        n += bad_remove_frame(tail + n, 32 + (uint64_t)k, f->tok[k]);
    return n;
}

/* The GETs' replies, then bad_let_go_frames' (a REMOVE that waited past its second for the GETs
 * is sent again), and the bad record marked lost once, while its path was held. */
static void bad_read_let_go(bad_fix_t *f)
{
    int wrong = 0;
    for (int i = 0; i < BGOOD + BBAD; i++) {
        uint32_t got;
        int st = bad_read_get(f, i, &got, &wrong);
        if (i < BGOOD)
            cr_expect(st == 0 && got == BP, "good GET %d: %d after %u pages", i, st, got);
        else
            cr_expect(st != 0 && got == BP - 1, "bad GET %d: %d after %u pages", i, st, got);
    }
    cr_expect_eq(wrong, 0, "%d wrong frames", wrong);
    for (uint64_t id = 30; id < 34; id++) {
        kvt_proto_hdr_t h;
        read_reply_frame(f->fd, &h, f->body, 4096);
        /* A REMOVE waits for the GETs at most 1 s (op_remove.c), which a slow daemon (under
         * ThreadSanitizer) can take to check 56 MiB: EBUSY then, and it is sent again. */
        int busy = id >= 32 && h.status == KVT_EBUSY;
        cr_expect(h.request_id == id && (h.status == 0 || busy),
                  "request %llu: reply %llu, status %d", (unsigned long long)id,
                  (unsigned long long)h.request_id, h.status);
        if (busy)
            cr_expect_eq(kvt_client_remove(f->c0, f->tok[id - 32], PAGE), 0);
    }
    cr_expect_eq(kvd_metric(&f->d, "kvtier_blocks_dropped_total{tier=\"nvme\"}"), 1,
                 "the bad record was marked lost once, its path held");
}

Test(server_loops, a_lease_that_ends_under_a_shared_gets_reads_leaves_it_the_path, .timeout = 60)
{
    bad_fix_t f = {0};
    bad_start(&f);
    uint8_t tail[2048];
    bad_send(&f, tail, bad_let_go_frames(&f, tail));
    bad_read_let_go(&f);
    bad_end(&f);
}

/*
 * The same once every read is done: the GETs' payloads are checked on loop 1 as each reaches the
 * head of the queue (op_get.c get_check), and the client reads nothing until its RELEASEs and
 * REMOVEs are sent, in a second write, so that the bad GETs wait for their check, no read in
 * flight, when their lease ends. A GET with a batch to check counts as one with pages left
 * (kvt__get_lease_ends): it holds the path, the REMOVEs wait for it, and the bad record is marked
 * lost while the node is there. Without that, the REMOVEs free the nodes at once and the check
 * marks nothing lost (or reads the freed node).
 */
Test(server_loops, a_lease_that_ends_while_gets_wait_for_their_check_leaves_them_the_path,
     .timeout = 60)
{
    bad_fix_t f = {0};
    bad_start(&f);
    const char *reads = "kvtier_tier_io_duration_seconds_count{tier=\"nvme\",dir=\"read\"}";
    double before = kvd_metric(&f.d, reads);
    bad_send(&f, NULL, 0);
    double want = before + (BGOOD + BBAD) * BP;
    cr_assert_eq(bad_wait_metric(&f.d, reads, want, want), want, "every read completed");
    uint8_t tail[2048];
    size_t n = bad_let_go_frames(&f, tail);
    cr_assert_eq(write(f.fd, tail, n), (ssize_t)n);
    bad_read_let_go(&f);
    bad_end(&f);
}

/*
 * The connection closes while every GET's only batch is being read: its leases go (the close
 * pins nothing for its GETs) and its GETs become orphans whose reads complete on loop 0. Another
 * connection REMOVEs both paths as soon as the close has let them go (refused while leased),
 * before the bad path's reads complete behind the good path's 42 MiB. An orphan's completion
 * marks no record lost (get_holds_path: nothing holds its path), so the bad read is only counted
 * as a miss; marking it wrote to the freed node.
 */
Test(server_loops, a_close_under_a_shared_gets_reads_marks_no_record_lost, .timeout = 60)
{
    bad_fix_t f = {0};
    bad_start(&f);
    const char *miss = "kvtier_miss_tokens_total{reason=\"checksum\"}";
    double misses = kvd_metric(&f.d, miss);
    bad_send(&f, NULL, 0);
    close(f.fd);
    f.fd = -1;
    for (int k = 0; k < 2; k++) {
        int rc;
        uint64_t t0 = kvt_now_ns();
        while ((rc = kvt_client_remove(f.c0, f.tok[k], PAGE)) == KVT_CLIENT_EBUSY &&
               kvt_now_ns() - t0 < 5000000000ull)
            ;
        cr_assert_eq(rc, 0, "path %d removed once the close let its lease go: %s", k,
                     kvt_client_strerror(rc));
    }
    cr_expect_geq(bad_wait_metric(&f.d, miss, misses + BBAD * PAGE, 1e18), misses + BBAD * PAGE,
                  "each bad GET read the bad record");
    bad_end(&f);
}

/*
 * A GET planned shared takes its NVMe payloads' checksums on its own loop with the lock let go
 * (op_get.c get_check), no longer on loop 0 under the write lock with the rest of its reads'
 * completion. KVT_DEBUG_GET_CHECK_GATE holds every such check while its file exists: a GET of 4
 * NVMe pages of 256 KiB on loop 1 then waits in its check, its reads done (loop 0 has posted its
 * kick), while loop 0's connection takes STATS (the write lock) and has a MATCH answered; once the
 * gate goes, the GET comes whole. With the check under loop 0's write lock, as the completion took
 * it before, the first STATS waits out the client's timeout.
 */
#define CKB (256u << 10)

typedef struct check_getter {
    kvt_client_t *c;
    uint64_t lease;
    uint32_t pages, got;
    uint8_t *back;
    int rc, done; /* done: atomic, read by the test while the GET waits */
} check_getter_t;

static void *check_getter_main(void *arg)
{
    check_getter_t *g = arg;
    g->rc =
        kvt_client_get(g->c, g->lease, 0, g->pages, g->back, (size_t)g->pages * CKB, &g->got, NULL);
    __atomic_store_n(&g->done, 1, __ATOMIC_RELEASE);
    return NULL;
}

/* A daemon with loops loops and no DRAM tier, with one client per loop: every page in NVMe, or
 * with pfx in the remote tier (KVT_TEST_REDIS's server, pfx its keys' prefix). */
static void check_start(kvd_t *d, const char *loops, const char *pfx, kvt_client_t **c)
{
    if (pfx)
        kvd_start(d, "--loops", loops, "--dram-bytes", "0", "--nvme-bytes", "0", "--remote",
                  kvd_redis(), "--remote-prefix", pfx, "--remote-bytes", "64M", NULL);
    else
        kvd_start(d, "--loops", loops, "--dram-bytes", "0", "--nvme-bytes", "64M",
                  "--nvme-segment-bytes", "8M", NULL);
    for (int i = 0; i < atoi(loops); i++)
        c[i] = kvd_client(d, "m", PAGE, CKB);
}

/* Stores pages pages of tok in one PUT, page p filled from seed + p (kvd_check_get's). */
static void check_put(kvt_client_t *c, const uint32_t *tok, uint32_t pages, uint32_t seed,
                      uint8_t *payload)
{
    for (uint32_t p = 0; p < pages; p++)
        kvd_fill(payload + (size_t)p * CKB, CKB, seed + p);
    kvt_client_put_t r;
    cr_assert_eq(kvt_client_put(c, tok, pages * PAGE, 0, pages, payload, NULL, &r), 0);
    cr_assert_eq(r.stored, pages);
}

/* check_start's two loops, their GETs' checks held while the file gate (in d's directory) is
 * there (KVT_DEBUG_GET_CHECK_GATE). */
static void check_gated(kvd_t *d, const char *pfx, char *gate, size_t len, kvt_client_t **c)
{
    kvd_mkdir(d);
    snprintf(gate, len, "%s/check-gate", d->dir);
    setenv("KVT_DEBUG_GET_CHECK_GATE", gate, 1);
    check_start(d, "2", pfx, c);
    unsetenv("KVT_DEBUG_GET_CHECK_GATE");
}

/* pages pages of tok (from tseed) stored by c (filled from seed: check_put) and leased. */
static kvt_client_match_t check_leased(kvt_client_t *c, uint32_t *tok, uint32_t pages,
                                       uint32_t tseed, uint32_t seed, uint8_t *payload)
{
    kvd_tokens(tok, pages * PAGE, tseed);
    check_put(c, tok, pages, seed, payload);
    kvt_client_match_t m = {0};
    cr_assert_eq(kvt_client_match(c, tok, pages * PAGE, KVT_CLIENT_LEASE, 60000, NULL, &m), 0);
    cr_assert_eq(m.pages, pages);
    return m;
}

/* The GET's pages in NVMe, or with pfx in the remote tier. */
static void checksums_let_go(const char *pfx)
{
    kvd_t d = {0};
    char gate[700];
    kvt_client_t *c[2];
    check_gated(&d, pfx, gate, sizeof gate, c);
    cr_assert_eq(kvd_stat(c[0], "loop_connections_1"), 1, "c[1] is loop 1's");
    enum { P = 4 };
    static uint32_t tok[P * PAGE];
    uint8_t *payload = malloc((size_t)P * CKB), *back = calloc(P, CKB);
    cr_assert(payload && back);
    kvt_client_match_t m = check_leased(c[1], tok, P, 9610000u, 961, payload);
    uint64_t posted = kvd_stat(c[0], "loop_kicks_posted_1");
    put_gate_close(gate);
    check_getter_t g = {.c = c[1], .lease = m.lease, .pages = P, .back = back};
    pthread_t th;
    pthread_create(&th, NULL, check_getter_main, &g);
    /* Loop 0 completed the reads and posted the kick: the GET is in its check, or on its way. */
    for (int i = 0; i < 5000 && kvd_stat(c[0], "loop_kicks_posted_1") == posted; i++)
        usleep(1000);
    cr_assert_gt(kvd_stat(c[0], "loop_kicks_posted_1"), posted, "the reads completed");
    kvt_client_match_t one = {0};
    cr_expect_eq(kvt_client_match(c[0], tok, P * PAGE, 0, 0, NULL, &one), 0);
    cr_expect_eq(one.pages, P);
    /* Held in its check, the GET has no reply while the gate is there. One whose check is not its
     * own (the remote tier's before it left the checksum to the GET) is answered once loop 1 takes
     * the kick: up to a second for it to come, so that the test fails there and not by chance. */
    for (int i = 0; i < 1000 && !__atomic_load_n(&g.done, __ATOMIC_ACQUIRE); i++)
        usleep(1000);
    cr_expect(!__atomic_load_n(&g.done, __ATOMIC_ACQUIRE),
              "the GET waits in its check while loop 0 answers");
    cr_assert_eq(unlink(gate), 0);
    pthread_join(th, NULL);
    cr_assert_eq(g.rc, 0, "get: %s", kvt_client_strerror(g.rc));
    cr_expect_eq(g.got, P);
    cr_expect(memcmp(back, payload, (size_t)P * CKB) == 0, "the bytes");
    cr_expect_eq(kvd_metric(&d, "kvtier_loop_shared_gets_total{loop=\"1\"}"), 1, "planned shared");
    cr_assert_eq(kvt_client_release(c[1], m.lease, NULL), 0);
    free(payload);
    free(back);
    client_a_loop_stop(&d, c, 2);
}

Test(server_loops, a_gets_checksums_are_taken_with_the_lock_let_go, .timeout = 60)
{
    checksums_let_go(NULL);
}

/* A STATS on c (a write lock on c's loop) in a thread of its own: done says it was answered. */
typedef struct stats_asker {
    kvt_client_t *c;
    int rc, done; /* done: atomic */
} stats_asker_t;

static int stats_nothing(void *arg, const char *name, uint64_t v)
{
    (void)arg, (void)name, (void)v;
    return 0;
}

static void *stats_asker_main(void *arg)
{
    stats_asker_t *a = arg;
    a->rc = kvt_client_stats(a->c, stats_nothing, NULL);
    __atomic_store_n(&a->done, 1, __ATOMIC_RELEASE);
    return NULL;
}

/* A GET on loop 0 itself, its pages in NVMe: loop 0 completes its reads and kicks its connection.
 * That kick ran in the completions' event, under loop 0's write lock, with the lock kept through
 * the GET's checksums and its socket write (l->top not set): every other loop waited for them (in
 * bench_server --ops loops --nvme, 15-21 us of loop 0's write hold per 256 KiB GET). Now loop 0
 * kicks it after its batch with the lock shared, and lets it go for them as loop 1 does. While
 * the GET waits in its check (the gate, "<gate>.held" saying it is there), loop 1 takes the write
 * lock for a STATS and is answered; before, the STATS waited for the gate. */
Test(server_loops, loop_zeros_own_gets_check_with_the_lock_let_go, .timeout = 60)
{
    kvd_t d = {0};
    char gate[700], held[720];
    kvt_client_t *c[2];
    check_gated(&d, NULL, gate, sizeof gate, c);
    snprintf(held, sizeof held, "%s.held", gate);
    cr_assert_eq(kvd_stat(c[0], "loop_connections_0"), 1, "c[0] is loop 0's");
    enum { P = 4 };
    static uint32_t tok[P * PAGE];
    uint8_t *payload = malloc((size_t)P * CKB), *back = calloc(P, CKB);
    cr_assert(payload && back);
    kvt_client_match_t m = check_leased(c[0], tok, P, 9630000u, 963, payload);
    put_gate_close(gate);
    check_getter_t g = {.c = c[0], .lease = m.lease, .pages = P, .back = back};
    pthread_t th, ts;
    pthread_create(&th, NULL, check_getter_main, &g);
    for (int i = 0; i < 10000 && access(held, F_OK) != 0; i++)
        usleep(1000);
    cr_assert_eq(access(held, F_OK), 0, "the GET came to its check");
    stats_asker_t a = {.c = c[1]};
    pthread_create(&ts, NULL, stats_asker_main, &a);
    for (int i = 0; i < 3000 && !__atomic_load_n(&a.done, __ATOMIC_ACQUIRE); i++)
        usleep(1000);
    int answered = __atomic_load_n(&a.done, __ATOMIC_ACQUIRE);
    cr_expect(answered, "loop 1's STATS is answered while loop 0's GET waits in its check");
    cr_expect(!__atomic_load_n(&g.done, __ATOMIC_ACQUIRE), "the GET still waits");
    cr_assert_eq(unlink(gate), 0);
    pthread_join(th, NULL);
    pthread_join(ts, NULL);
    cr_expect_eq(a.rc, 0);
    cr_assert_eq(g.rc, 0, "get: %s", kvt_client_strerror(g.rc));
    cr_expect_eq(g.got, P);
    cr_expect(memcmp(back, payload, (size_t)P * CKB) == 0, "the bytes");
    cr_assert_eq(kvt_client_release(c[0], m.lease, NULL), 0);
    free(payload);
    free(back);
    client_a_loop_stop(&d, c, 2);
}

/* The remote tier leaves a shared GET's payload checksums to it as the NVMe tier does
 * (kvt__tier_read_verify). Before, it took them on loop 0 under the write lock, and no GET of
 * remote pages came to the gate: it ended while it should have waited there. */
Test(server_loops, a_gets_remote_checksums_are_taken_with_the_lock_let_go, .timeout = 60)
{
    char pfx[64];
    loops_redis_prefix(pfx, sizeof pfx);
    checksums_let_go(pfx);
}

/*
 * A record that fails its checksum, read by a GET on the last loop (loop 1 of 2, or the one
 * loop): the GET ends as when loop 0's completion found it, its check now on the GET's loop. The
 * pages before it come byte-exact, then the end frame's ECORRUPT; the bad block and the rest of
 * its node are made lost (dropped, and the next MATCH reports them index-only, the pages before
 * still served); kvtier_miss_tokens_total{reason="checksum"} counts the page's tokens and the
 * tier's read errors one read, once each. The pages in NVMe, or with remote in the remote tier (a
 * value overwritten on the server).
 */
static void gets_meet_a_corrupt_record(const char *loops, int remote)
{
    kvd_t d = {0};
    kvt_client_t *c[2];
    char pfx[64];
    loops_redis_prefix(pfx, sizeof pfx);
    check_start(&d, loops, remote ? pfx : NULL, c);
    int n = atoi(loops);
    kvt_client_t *g = c[n - 1];
    enum { P = 5, BAD = 2 };
    static uint32_t tok[P * PAGE];
    uint8_t *payload = malloc((size_t)P * CKB), *back = calloc(P, CKB);
    cr_assert(payload && back);
    kvd_tokens(tok, P * PAGE, 9620000u);
    check_put(g, tok, P, 962, payload);
    if (remote)
        redis_corrupt(kvd_redis(), pfx, payload + (size_t)BAD * CKB);
    else
        nvme_corrupt(&d, payload + (size_t)BAD * CKB);
    const char *tier = remote ? "remote" : "nvme";
    uint8_t in_tier = remote ? KVT_CLIENT_TIER_REMOTE : KVT_CLIENT_TIER_NVME;
    kvt_client_match_t m = {0};
    cr_assert_eq(kvt_client_match(g, tok, P * PAGE, KVT_CLIENT_LEASE, 60000, NULL, &m), 0);
    cr_assert_eq(m.pages, P);
    uint32_t got = 0;
    int rc = kvt_client_get(g, m.lease, 0, P, back, (size_t)P * CKB, &got, NULL);
    cr_expect_eq(rc, KVT_CLIENT_ECORRUPT, "get: %s", kvt_client_strerror(rc));
    cr_expect_eq(got, BAD, "the pages before the bad one");
    cr_expect(memcmp(back, payload, (size_t)BAD * CKB) == 0, "byte-exact");
    char key[160]; /* Room for a node label holding a host name. */
    snprintf(key, sizeof key, "kvtier_loop_shared_gets_total{loop=\"%d\"}", n - 1);
    if (n > 1)
        cr_expect_eq(kvd_metric(&d, key), 1, "planned shared");
    cr_expect_eq(kvd_metric(&d, "kvtier_miss_tokens_total{reason=\"checksum\"}"), PAGE);
    snprintf(key, sizeof key, "kvtier_tier_io_errors_total{tier=\"%s\",dir=\"read\"}", tier);
    cr_expect_eq(kvd_metric(&d, key), 1);
    snprintf(key, sizeof key, "kvtier_blocks_dropped_total{tier=\"%s\"}", tier);
    cr_expect_eq(kvd_metric(&d, key), P - BAD, "the bad block and the rest of its node made lost");
    if (remote) {
        /* The server's counts as an operator reads them, the same whichever took the checksum:
         * the batch read every page, the bad one an error of the node and not a hit, its block
         * dropped by the tier (a value held corrupt, as one the server evicted). */
        snprintf(key, sizeof key, "kvtier_remote_node_hits_total{node=\"%s\"}", kvd_redis());
        cr_expect_eq(kvd_metric(&d, key), P - 1, "every page but the bad one a hit");
        snprintf(key, sizeof key, "kvtier_remote_node_errors_total{node=\"%s\"}", kvd_redis());
        cr_expect_eq(kvd_metric(&d, key), 1, "the bad page an error of its node");
        cr_expect_eq(kvd_metric(&d, "kvtier_tier_lost_blocks_total{tier=\"remote\"}"), 1,
                     "the bad page's location dropped by the tier");
    }
    cr_assert_eq(kvt_client_release(g, m.lease, NULL), 0);
    uint8_t tiers[P];
    kvt_client_match_t again = {.tiers = tiers, .tiers_cap = P};
    cr_assert_eq(kvt_client_match(g, tok, P * PAGE, KVT_CLIENT_LEASE, 60000, NULL, &again), 0);
    cr_assert_eq(again.pages, P, "the index still knows the tokens");
    for (int i = 0; i < P; i++)
        cr_expect_eq(tiers[i], i < BAD ? in_tier : KVT_CLIENT_TIER_NONE, "page %d: tier %d", i,
                     tiers[i]);
    kvd_check_get(g, again.lease, 0, BAD, CKB, 962, NULL);
    cr_assert_eq(kvt_client_release(g, again.lease, NULL), 0);
    free(payload);
    free(back);
    client_a_loop_stop(&d, c, n);
}

Test(server_loops, a_shared_get_meets_a_corrupt_record, .timeout = 60)
{
    gets_meet_a_corrupt_record("2", 0);
}

Test(server_loops, a_get_meets_a_corrupt_record_with_one_loop, .timeout = 60)
{
    gets_meet_a_corrupt_record("1", 0);
}

/* The same for a remote value corrupted on the server (the checksum taken by the GET on loop 1,
 * by the tier with one loop), and the remote node's hits and errors and the tier's lost blocks
 * the same both ways: before, the GET's own check left the node's hit counted and no block lost. */
Test(server_loops, a_shared_get_meets_a_corrupt_remote_value, .timeout = 60)
{
    gets_meet_a_corrupt_record("2", 1);
}

Test(server_loops, a_get_meets_a_corrupt_remote_value_with_one_loop, .timeout = 60)
{
    gets_meet_a_corrupt_record("1", 1);
}

/*
 * A lease that ends (RELEASE, framed right behind two GETs of its path in one write) while the
 * GETs' HBM reads are queued or in flight: each GET, planned shared on loop 1, then holds the
 * path itself (kvt__get_lease_ends), so the REMOVE framed after the RELEASE waits for them (or,
 * past its second, answers EBUSY and is sent again) and frees nothing under them. Both GETs come
 * whole and byte-exact, the path goes, and the HBM tier holds nothing after. With one loop too
 * (the write path, which pins the path from the GET's start).
 */
static void hbm_lease_ends_under_reads(const char *loops)
{
    kvd_t d = {0};
    kvd_start(&d, "--loops", loops, "--dram-bytes", "0", "--nvme-bytes", "0", "--hbm-backend",
              "host", "--hbm-bytes", "16M", "--tick-ms", "10", NULL);
    kvt_client_t *c0 = kvd_client(&d, "h", PAGE, NBB);
    enum { P = 8, GETF = KVT_PROTO_HDR + sizeof(kvt_wire_get_t) };
    static uint32_t tok[P * PAGE];
    uint8_t *payload = malloc(NBB), *body = malloc(sizeof(kvt_wire_get_data_t) + NBB);
    uint64_t sums[P];
    cr_assert(payload && body);
    kvd_tokens(tok, P * PAGE, 9780000u);
    for (uint32_t p = 0; p < P; p++)
        sums[p] = put_page(c0, tok, p, NBB, 978 + p, payload);
    cr_assert_eq(kvd_stat(c0, "hbm_blocks"), P);
    int fd = kvd_raw(&d);
    uint64_t lease = raw_lease(fd, "h", PAGE, NBB, tok, P * PAGE, body, 4096);
    uint8_t buf[2 * GETF + 1024], *g = buf;
    for (int i = 0; i < 2; i++, g += GETF) {
        kvt_wire_get_t gw = {.lease = lease};
        kvt_proto_frame(g, KVT_OP_GET, 0, 10 + (uint64_t)i, 0, sizeof gw);
        memcpy(g + KVT_PROTO_HDR, &gw, sizeof gw);
    }
    g += bad_release_frame(g, 30, lease);
    g += bad_remove_frame(g, 31, tok);
    cr_assert_eq(write(fd, buf, (size_t)(g - buf)), g - buf);
    int wrong = 0;
    for (int i = 0; i < 2; i++) {
        uint32_t got = 0;
        int status = raw_get_pages(fd, 10 + (uint64_t)i, body, NBB, sums, P, &got, &wrong);
        cr_expect(status == 0 && got == P, "GET %d: %d after %u pages", i, status, got);
    }
    cr_expect_eq(wrong, 0, "%d wrong frames", wrong);
    for (uint64_t id = 30; id < 32; id++) {
        kvt_proto_hdr_t h;
        read_reply_frame(fd, &h, body, 4096);
        int busy = id == 31 && h.status == KVT_EBUSY;
        cr_expect(h.request_id == id && (h.status == 0 || busy), "request %llu: %llu, status %d",
                  (unsigned long long)id, (unsigned long long)h.request_id, h.status);
        if (busy)
            cr_expect_eq(kvt_client_remove(c0, tok, PAGE), 0);
    }
    if (atoi(loops) > 1)
        cr_expect_eq(kvd_metric(&d, "kvtier_loop_shared_gets_total{loop=\"1\"}"), 2,
                     "loop 1 planned both GETs shared");
    kvt_client_match_t m = {0};
    cr_expect_eq(kvt_client_match(c0, tok, P * PAGE, 0, 0, NULL, &m), 0);
    cr_expect_eq(m.pages, 0, "the path was removed");
    cr_expect_eq(bad_wait_metric(&d, "kvtier_tier_used_bytes{tier=\"hbm\"}", 0, 0), 0,
                 "the HBM tier holds nothing");
    close(fd);
    free(payload);
    free(body);
    kvt_client_close(c0);
    cr_expect_eq(kvd_stop(&d), 0);
    kvd_cleanup(&d);
}

Test(server_loops, a_lease_that_ends_under_a_shared_gets_hbm_reads_leaves_it_the_path,
     .timeout = 60)
{
    hbm_lease_ends_under_reads("2");
}

Test(server_loops, a_lease_that_ends_under_a_gets_hbm_reads_with_one_loop, .timeout = 60)
{
    hbm_lease_ends_under_reads("1");
}
