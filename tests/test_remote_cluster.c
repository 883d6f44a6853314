/*
 * test_remote_cluster.c: the remote tier's cluster mode against a real Redis Cluster on
 * loopback (3 primaries, 3 replicas, test_cluster.h).
 *
 * The runner forms one cluster before the tests (a report hook: each test runs in a process of
 * its own, forked from the runner, and finds the cluster's ports in KVT_TEST_CLUSTER) and kills
 * it after them; the tests that use it leave it whole (a slot they migrate stays served). The
 * failover test forms a cluster of its own, since it kills a primary. Without redis-server and
 * redis-cli the tests skip; a cluster that fails to form fails them. The last tests run two real
 * kvtierd (test_server_harness.h) over the cluster: one finds the other's prefix, and one's late
 * writes delete no key the other stored.
 */
#include "test_cluster.h"

#include <criterion/hooks.h>
#include <strings.h>

#include "test_server_harness.h"
#include "tier.h"

#define PAGE 16

/* --- the shared cluster --- */

static cl_t g_shared;

ReportHook(PRE_ALL)(struct criterion_test_set *set)
{
    (void)set;
    char err[512] = "";
    int rc = cl_start(&g_shared, err, sizeof(err));
    if (rc == 0)
        setenv("KVT_TEST_CLUSTER", g_shared.seeds, 1);
    else if (rc == -2)
        setenv("KVT_TEST_CLUSTER_ERROR", err, 1);
}

ReportHook(POST_ALL)(struct criterion_global_stats *stats)
{
    (void)stats;
    cl_stop(&g_shared);
}

/* The shared cluster's ports (every node); skips or fails the test without one. */
static int shared(uint16_t *ports)
{
    const char *err = getenv("KVT_TEST_CLUSTER_ERROR");
    cr_assert(!err, "the test cluster did not form: %s", err);
    const char *s = getenv("KVT_TEST_CLUSTER");
    if (!s)
        cr_skip_test("no redis-server and redis-cli to form a cluster with");
    int n = 0;
    for (const char *p = s; p && *p && n < CL_NODES; n++) {
        const char *colon = strchr(p, ':');
        cr_assert(colon);
        ports[n] = (uint16_t)atoi(colon + 1);
        p = strchr(colon, ',');
        p = p ? p + 1 : NULL;
    }
    cr_assert_eq(n, CL_NODES);
    return n;
}

/* --- tiers and blocks --- */

static uint64_t g_seed;
static char g_prefix[64];

static void test_init(void)
{
    g_seed = ((uint64_t)getpid() << 32) ^ kvt_now_ns() ^ 0x9e3779b97f4a7c15ull;
    snprintf(g_prefix, sizeof(g_prefix), "kvt-cl-%d", (int)getpid());
}

static kvt_tier_remote_conf_t cluster_conf(const char *seeds)
{
    return (kvt_tier_remote_conf_t){.cluster = 1,
                                    .seeds = seeds,
                                    .key_prefix = g_prefix,
                                    .capacity_bytes = 1ull << 30,
                                    .timeout_ms = 1000,
                                    .backoff_min_ms = 20,
                                    .backoff_max_ms = 200};
}

static int wait_connected(kvt_tier_t *t, int ms)
{
    uint64_t end = kvt_now_ns() + (uint64_t)ms * 1000000u;
    while (!kvt_tier_remote_connected(t) && kvt_now_ns() < end)
        kvt_tier_wait(t, 10);
    return kvt_tier_remote_connected(t);
}

static kvt_tier_t *open_cluster(const char *seeds)
{
    kvt_tier_remote_conf_t c = cluster_conf(seeds);
    kvt_tier_t *t = NULL;
    cr_assert_eq(kvt_tier_remote_create(&t, &c), 0);
    cr_assert(wait_connected(t, 5000), "no slot map from %s", seeds);
    return t;
}

static kvt_tier_remote_stats_t stats(const kvt_tier_t *t)
{
    kvt_tier_remote_stats_t s;
    kvt_tier_remote_stats(t, &s);
    return s;
}

/* The counters of the node on 127.0.0.1:port; fails the test when the tier does not know it. */
static kvt_tier_remote_node_stats_t node_stats(const kvt_tier_t *t, uint16_t port)
{
    char addr[32];
    snprintf(addr, sizeof(addr), "127.0.0.1:%u", port);
    kvt_tier_remote_node_stats_t ns;
    int n = kvt_tier_remote_node_stats(t, 0, &ns);
    cr_assert_gt(n, 0);
    for (int i = 0; i < n; i++) {
        cr_assert_eq(kvt_tier_remote_node_stats(t, (uint32_t)i, &ns), n);
        if (!strcmp(ns.addr, addr))
            return ns;
    }
    cr_assert_fail("the tier knows no node %s", addr);
    return ns;
}

typedef struct blk {
    kvt_tier_io_t io;
    uint32_t tokens[PAGE];
    uint8_t *buf;
    int done;
} blk_t;

static void io_done(kvt_tier_io_t *io)
{
    ((blk_t *)io->data)->done++;
}

static void fill(uint8_t *p, uint32_t len, uint64_t salt)
{
    uint64_t x = salt * 0x9e3779b97f4a7c15ull + 1;
    for (uint32_t i = 0; i < len; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        p[i] = (uint8_t)x;
    }
}

static void blk_init(blk_t *b, uint32_t i, uint32_t len)
{
    memset(b, 0, sizeof(*b));
    for (uint32_t k = 0; k < PAGE; k++)
        b->tokens[k] = i * 1000 + k;
    b->io.key = (kvt_block_key_t){.ns_seed = g_seed,
                                  .hash = g_seed ^ (0x100000001b3ull * (i + 1)),
                                  .parent = g_seed ^ (0x100000001b3ull * i),
                                  .tokens = b->tokens,
                                  .ntokens = PAGE};
    b->io.len = len;
    b->buf = malloc(len);
    cr_assert(b->buf);
    b->io.buf = b->buf;
    b->io.cb = io_done;
    b->io.data = b;
}

static void blk_fini(blk_t *b)
{
    free(b->buf);
}

static void wait_all(kvt_tier_t *t, blk_t *b, int n, int ms)
{
    uint64_t end = kvt_now_ns() + (uint64_t)ms * 1000000u;
    for (;;) {
        int left = 0;
        for (int i = 0; i < n; i++)
            left += b[i].done == 0;
        if (!left)
            return;
        cr_assert(kvt_now_ns() < end, "%d requests never completed", left);
        kvt_tier_wait(t, 20);
    }
}

static int do_io(kvt_tier_t *t, blk_t *b, int write)
{
    b->done = 0;
    int rc = write ? kvt_tier_write(t, &b->io) : kvt_tier_read(t, &b->io);
    if (rc)
        return rc;
    wait_all(t, b, 1, 10000);
    return b->io.status;
}

static int write_blk(kvt_tier_t *t, blk_t *b, uint64_t salt)
{
    fill(b->buf, b->io.len, salt);
    return do_io(t, b, 1);
}

/* Reads b into a scrubbed buffer; a success must hold salt's bytes exactly. */
static int read_check(kvt_tier_t *t, blk_t *b, uint64_t salt)
{
    uint8_t *want = malloc(b->io.len);
    cr_assert(want);
    fill(want, b->io.len, salt);
    memset(b->buf, 0xa5, b->io.len);
    int rc = do_io(t, b, 0);
    int same = rc != 0 || !memcmp(b->buf, want, b->io.len);
    free(want);
    cr_assert(same, "a wrong byte was served");
    return rc;
}

static int key_slot_of(kvt_tier_t *t, const blk_t *b, char *key)
{
    int n = kvt_tier_remote_key(t, b->io.key.ns_seed, b->io.key.hash, key, KVT_TIER_REMOTE_KEY_MAX);
    cr_assert_gt(n, 0);
    return kvt_tier_remote_key_slot(key, (size_t)n);
}

/* Keys of ours held by the node on port. */
static long long keys_on(uint16_t port)
{
    char pat[80];
    snprintf(pat, sizeof(pat), "%s:*", g_prefix);
    long long n = 0;
    redisContext *c = cl_conn(port);
    cr_assert(c);
    char cursor[32] = "0";
    do {
        redisReply *r = redisCommand(c, "SCAN %s MATCH %s COUNT 1000", cursor, pat);
        cr_assert(r && r->type == REDIS_REPLY_ARRAY && r->elements == 2);
        snprintf(cursor, sizeof(cursor), "%s", r->element[0]->str);
        n += (long long)r->element[1]->elements;
        freeReplyObject(r);
    } while (strcmp(cursor, "0"));
    redisFree(c);
    return n;
}

/* The PID of the redis-server on port (INFO server). */
static pid_t node_pid(uint16_t port)
{
    redisReply *r = cl_cmd(port, "INFO server");
    cr_assert(r && r->type == REDIS_REPLY_STRING);
    const char *p = strstr(r->str, "process_id:");
    cr_assert(p);
    pid_t pid = (pid_t)atoi(p + strlen("process_id:"));
    freeReplyObject(r);
    return pid;
}

static void ok_reply(redisReply *r, const char *what)
{
    cr_assert(r, "%s: no reply", what);
    cr_assert(r->type != REDIS_REPLY_ERROR, "%s: %s", what, r->str);
    freeReplyObject(r);
}

/* The cluster's current epoch as the node on port sees it (CLUSTER INFO); -1 without an answer. */
static long long current_epoch(uint16_t port)
{
    redisReply *r = cl_cmd(port, "CLUSTER INFO");
    long long e =
        r && r->type == REDIS_REPLY_STRING ? cl_info_num(r->str, "cluster_current_epoch:") : -1;
    if (r)
        freeReplyObject(r);
    return e;
}

/* Moves slot from the primary on port src to the one on port dst, keys and all, and tells
 * every primary (ports[0..n)) the new owner: dst first, then src, then the rest, the order
 * CLUSTER SETSLOT's documentation asks for. Returns once every primary names dst the slot's owner
 * and all see one current epoch. Without both, migrations back to back lost slots, which the
 * reshard test then found uncovered: after 30 of the late corrupt test's migrations, 3 runs of 4
 * ended with 1 to 4 slots no primary claimed (the fourth failed a read first); 0 of 4 with them. */
static void migrate_slot(int slot, uint16_t src, uint16_t dst, const uint16_t *ports, int n)
{
    char sid[41], did[41];
    cl_myid(src, sid);
    cl_myid(dst, did);
    ok_reply(cl_cmd(dst, "CLUSTER SETSLOT %d IMPORTING %s", slot, sid), "IMPORTING");
    ok_reply(cl_cmd(src, "CLUSTER SETSLOT %d MIGRATING %s", slot, did), "MIGRATING");
    for (;;) {
        redisReply *r = cl_cmd(src, "CLUSTER GETKEYSINSLOT %d 100", slot);
        cr_assert(r && r->type == REDIS_REPLY_ARRAY);
        size_t k = r->elements;
        for (size_t i = 0; i < k; i++)
            ok_reply(cl_cmd(src, "MIGRATE 127.0.0.1 %u %s 0 5000", dst, r->element[i]->str),
                     "MIGRATE");
        freeReplyObject(r);
        if (k == 0)
            break;
    }
    uint16_t order[CL_NODES];
    int m = 0;
    order[m++] = dst;
    order[m++] = src;
    for (int i = 0; i < n && m < CL_NODES; i++)
        if (ports[i] != dst && ports[i] != src)
            order[m++] = ports[i];
    for (int i = 0; i < m; i++) {
        redisReply *r = cl_cmd(order[i], "CLUSTER SETSLOT %d NODE %s", slot, did);
        if (r)
            freeReplyObject(r); /* a replica refuses: it learns from its primary */
    }
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (;;) {
        int agree = 1;
        long long e0 = current_epoch(order[0]);
        for (int i = 0; i < m && agree; i++)
            agree = cl_owner(order[i], slot) == dst && current_epoch(order[i]) == e0 && e0 >= 0;
        if (agree)
            return;
        cr_assert_lt(cl_ms_since(&t0), 5000, "slot %d: the primaries do not agree on its owner",
                     slot);
        cl_sleep_ms(10);
    }
}

TestSuite(remote_cluster, .init = test_init, .timeout = 60);

Test(remote_cluster, key_slots_match_the_server)
{
    uint16_t ports[CL_NODES];
    shared(ports);
    const char *samples[] = {"",
                             "a",
                             "kvt:0123456789abcdef:fedcba9876543210",
                             "{user1000}.following",
                             "foo{}{bar}",
                             "foo{{bar}}zap",
                             "foo{bar}{zap}",
                             "{}",
                             "}{"};
    for (size_t i = 0; i < sizeof(samples) / sizeof(samples[0]); i++) {
        redisReply *r = cl_cmd(ports[0], "CLUSTER KEYSLOT %s", samples[i]);
        cr_assert(r && r->type == REDIS_REPLY_INTEGER);
        cr_expect_eq(kvt_tier_remote_key_slot(samples[i], strlen(samples[i])), r->integer,
                     "slot of '%s'", samples[i]);
        freeReplyObject(r);
    }
    kvt_tier_t *t = open_cluster(getenv("KVT_TEST_CLUSTER"));
    for (uint32_t i = 0; i < 200; i++) {
        char key[KVT_TIER_REMOTE_KEY_MAX];
        int n = kvt_tier_remote_key(t, g_seed + i, i * 0x9e3779b97f4a7c15ull, key, sizeof(key));
        cr_assert_gt(n, 0);
        redisReply *r = cl_cmd(ports[0], "CLUSTER KEYSLOT %s", key);
        cr_assert(r && r->type == REDIS_REPLY_INTEGER);
        cr_assert_eq(kvt_tier_remote_key_slot(key, (size_t)n), r->integer, "slot of %s", key);
        freeReplyObject(r);
    }
    kvt_tier_destroy(t);
}

Test(remote_cluster, keys_spread_over_every_primary_and_read_back)
{
    uint16_t ports[CL_NODES];
    shared(ports);
    /* One seed is enough: the map names the rest. */
    char seed[32];
    snprintf(seed, sizeof(seed), "127.0.0.1:%u", ports[0]);
    kvt_tier_t *t = open_cluster(seed);
    enum { N = 96 };
    blk_t *b = calloc(N, sizeof(*b));
    cr_assert(b);
    for (int i = 0; i < N; i++) {
        blk_init(&b[i], (uint32_t)i, 4096 + (uint32_t)i * 100);
        fill(b[i].buf, b[i].io.len, (uint64_t)i);
        cr_assert_eq(kvt_tier_write(t, &b[i].io), 0); /* all in flight at once */
    }
    wait_all(t, b, N, 10000);
    for (int i = 0; i < N; i++)
        cr_assert_eq(b[i].io.status, 0, "write %d: %s", i, kvt_strerror(b[i].io.status));
    for (int i = 0; i < N; i++)
        cr_assert_eq(read_check(t, &b[i], (uint64_t)i), 0);
    uint16_t prim[CL_NODES];
    int np = cl_primaries(ports[0], prim, CL_NODES);
    cr_assert_eq(np, 3);
    long long total = 0;
    for (int i = 0; i < np; i++) {
        long long k = keys_on(prim[i]);
        cr_expect_gt(k, 0, "no key of ours on the primary on port %u", prim[i]);
        total += k;
    }
    cr_expect_eq(total, N);
    kvt_tier_remote_stats_t s = stats(t);
    cr_expect_geq(s.map_refreshes, 1);
    cr_expect_eq(s.moved, 0, "the map was known before the first write");
    cr_expect_eq(s.connects, 3, "one connection per primary (the seed is one of them)");
    for (int i = 0; i < N; i++)
        blk_fini(&b[i]);
    free(b);
    kvt_tier_destroy(t);
}

/* Per node: where each read went (hits and misses on the primary owning the key), the slots each
 * serves, and nothing counted on a node no request went to. */
Test(remote_cluster, per_node_counters_say_where_each_request_went)
{
    uint16_t ports[CL_NODES], prim[CL_NODES];
    shared(ports);
    cr_assert_eq(cl_primaries(ports[0], prim, CL_NODES), 3);
    kvt_tier_t *t = open_cluster(getenv("KVT_TEST_CLUSTER"));
    enum { N = 48 };
    blk_t b[N + 1];
    int on[CL_NODES] = {0}; /* blocks per primary (index in prim) */
    for (int i = 0; i <= N; i++) {
        blk_init(&b[i], (uint32_t)i, 1024);
        char key[KVT_TIER_REMOTE_KEY_MAX];
        uint16_t owner = cl_owner(ports[0], key_slot_of(t, &b[i], key));
        for (int k = 0; k < 3; k++)
            on[k] += i < N && owner == prim[k];
        if (i < N)
            cr_assert_eq(write_blk(t, &b[i], (uint64_t)i), 0);
    }
    for (int i = 0; i < N; i++)
        cr_assert_eq(read_check(t, &b[i], (uint64_t)i), 0);
    cr_assert_eq(read_check(t, &b[N], (uint64_t)N), KVT_ENOENT); /* never written */
    char key[KVT_TIER_REMOTE_KEY_MAX];
    uint16_t miss_on = cl_owner(ports[0], key_slot_of(t, &b[N], key));

    kvt_tier_remote_node_stats_t ns;
    int n = kvt_tier_remote_node_stats(t, 0, &ns);
    cr_assert_geq(n, 3, "the seeds and the primaries");
    uint64_t hits = 0, misses = 0, slots = 0, refreshes = 0;
    for (int i = 0; i < n; i++) {
        kvt_tier_remote_node_stats(t, (uint32_t)i, &ns);
        hits += ns.hits, misses += ns.misses, slots += ns.slots, refreshes += ns.map_refreshes;
        cr_expect_eq(ns.errors + ns.moved + ns.asks + ns.failovers, 0, "%s", ns.addr);
        if (!ns.slots)
            cr_expect_eq(ns.hits + ns.misses, 0, "%s: a node with no slot got no read", ns.addr);
    }
    cr_expect_eq(hits, N);
    cr_expect_eq(misses, 1);
    cr_expect_eq(slots, 16384);
    cr_expect_eq(refreshes, stats(t).map_refreshes);
    for (int k = 0; k < 3; k++) {
        ns = node_stats(t, prim[k]);
        cr_expect(ns.up && ns.slots > 0, "%s: up, serving slots", ns.addr);
        cr_expect_eq(ns.hits, (uint64_t)on[k], "%s: the reads of the blocks it owns", ns.addr);
        cr_expect_eq(ns.misses, prim[k] == miss_on, "%s: the miss on the key's owner", ns.addr);
    }
    /* Bad input changes nothing. */
    cr_expect_eq(kvt_tier_remote_node_stats(NULL, 0, &ns), KVT_EINVAL);
    cr_expect_eq(kvt_tier_remote_node_stats(t, 0, NULL), KVT_EINVAL);
    cr_expect_eq(kvt_tier_remote_node_stats(t, (uint32_t)n, &ns), n, "past the end: the count");
    for (int i = 0; i <= N; i++)
        blk_fini(&b[i]);
    kvt_tier_destroy(t);
}

Test(remote_cluster, moved_after_a_slot_migration_is_followed)
{
    uint16_t ports[CL_NODES];
    shared(ports);
    kvt_tier_t *t = open_cluster(getenv("KVT_TEST_CLUSTER"));
    blk_t b;
    blk_init(&b, 7, 8192);
    cr_assert_eq(write_blk(t, &b, 7), 0);
    char key[KVT_TIER_REMOTE_KEY_MAX];
    int slot = key_slot_of(t, &b, key);
    uint16_t src = cl_owner(ports[0], slot), prim[CL_NODES];
    int np = cl_primaries(ports[0], prim, CL_NODES);
    uint16_t dst = prim[0] == src ? prim[1] : prim[0];
    migrate_slot(slot, src, dst, prim, np);
    cr_assert_eq(cl_owner(dst, slot), dst);

    /* The tier still sends the key to src, which answers MOVED: followed, and the map learns. */
    kvt_tier_remote_stats_t before = stats(t);
    cr_assert_eq(read_check(t, &b, 7), 0);
    kvt_tier_remote_stats_t after = stats(t);
    cr_expect_eq(after.moved, before.moved + 1);
    cr_expect_eq(node_stats(t, src).moved, 1, "counted on the node that answered MOVED");
    cr_expect_eq(node_stats(t, dst).hits, 1, "and the read on the node that served it");
    /* The next read goes straight to dst. */
    cr_assert_eq(read_check(t, &b, 7), 0);
    cr_expect_eq(stats(t).moved, after.moved, "the map learnt the slot from the MOVED");
    /* And a refresh of the whole map followed. */
    uint64_t end = kvt_now_ns() + 2000000000ull;
    while (stats(t).map_refreshes == before.map_refreshes && kvt_now_ns() < end)
        kvt_tier_wait(t, 10);
    cr_expect_gt(stats(t).map_refreshes, before.map_refreshes);
    cr_expect_eq(stats(t).redirect_errors, 0);
    blk_fini(&b);
    kvt_tier_destroy(t);
}

Test(remote_cluster, ask_during_a_migration_is_followed)
{
    uint16_t ports[CL_NODES];
    shared(ports);
    kvt_tier_t *t = open_cluster(getenv("KVT_TEST_CLUSTER"));
    /* Two blocks in one slot: the first stored before the migration starts (it stays on src until
     * moved), the second written while the slot is MIGRATING (src has no such key: ASK). */
    blk_t a, b;
    blk_init(&a, 1, 4096);
    char key[KVT_TIER_REMOTE_KEY_MAX];
    int slot = key_slot_of(t, &a, key);
    uint32_t i = 2;
    for (;; i++) {
        blk_init(&b, i, 4096);
        if (key_slot_of(t, &b, key) == slot)
            break;
        blk_fini(&b);
        cr_assert_lt(i, 200000u, "no second key in slot %d", slot);
    }
    cr_assert_eq(write_blk(t, &a, 1), 0);
    uint16_t src = cl_owner(ports[0], slot), prim[CL_NODES];
    int np = cl_primaries(ports[0], prim, CL_NODES);
    uint16_t dst = prim[0] == src ? prim[1] : prim[0];
    char sid[41], did[41];
    cl_myid(src, sid);
    cl_myid(dst, did);
    ok_reply(cl_cmd(dst, "CLUSTER SETSLOT %d IMPORTING %s", slot, sid), "IMPORTING");
    ok_reply(cl_cmd(src, "CLUSTER SETSLOT %d MIGRATING %s", slot, did), "MIGRATING");

    kvt_tier_remote_stats_t s0 = stats(t);
    cr_assert_eq(write_blk(t, &b, i), 0); /* src: ASK; dst takes it after ASKING */
    cr_expect_eq(stats(t).asks, s0.asks + 1);
    cr_assert_eq(read_check(t, &b, i), 0); /* ASK again */
    cr_expect_eq(stats(t).asks, s0.asks + 2);
    cr_assert_eq(read_check(t, &a, 1), 0); /* still on src: no redirect */
    cr_expect_eq(stats(t).asks, s0.asks + 2);
    cr_expect_eq(stats(t).moved, s0.moved, "ASK does not change the map");
    /* Where the bytes are: b on dst, a on src. */
    long long on_dst = keys_on(dst), on_src_before = keys_on(src);
    cr_expect_eq(on_dst, 1);
    cr_expect_geq(on_src_before, 1);

    /* Finish the migration; both read back from dst (a MOVED for the first). */
    migrate_slot(slot, src, dst, prim, np);
    cr_assert_eq(read_check(t, &a, 1), 0);
    cr_assert_eq(read_check(t, &b, i), 0);
    cr_expect_eq(stats(t).redirect_errors, 0);
    blk_fini(&a);
    blk_fini(&b);
    kvt_tier_destroy(t);
}

/* --- a late corrupt read across a redirect --- */

/* DELs the node on port took, rejected ones (a redirect) included: INFO commandstats. */
static long long dels_on(uint16_t port)
{
    redisReply *r = cl_cmd(port, "INFO commandstats");
    cr_assert(r && r->type == REDIS_REPLY_STRING);
    long long n = 0;
    const char *p = strstr(r->str, "cmdstat_del:");
    if (p) {
        const char *calls = strstr(p, "calls="), *rej = strstr(p, "rejected_calls=");
        const char *eol = strchr(p, '\n');
        n += calls && (!eol || calls < eol) ? atoll(calls + strlen("calls=")) : 0;
        n += rej && (!eol || rej < eol) ? atoll(rej + strlen("rejected_calls=")) : 0;
    }
    freeReplyObject(r);
    return n;
}

/* Flips the byte at `at` of b's value on the primary on port, which serves b's slot or imports
 * it (ASKING first: harmless on the owner). */
static void flip_on(kvt_tier_t *t, const blk_t *b, uint16_t port, size_t at)
{
    char key[KVT_TIER_REMOTE_KEY_MAX];
    key_slot_of(t, b, key);
    redisContext *c = cl_conn(port);
    cr_assert(c);
    ok_reply(redisCommand(c, "ASKING"), "ASKING");
    redisReply *r = redisCommand(c, "GET %s", key);
    cr_assert(r && r->type == REDIS_REPLY_STRING && (size_t)r->len > at, "%s is not on port %u",
              key, port);
    r->str[at] ^= 0x01;
    ok_reply(redisCommand(c, "ASKING"), "ASKING"); /* it holds for one command */
    ok_reply(redisCommand(c, "SET %s %b", key, r->str, (size_t)r->len), "SET");
    freeReplyObject(r);
    redisFree(c);
}

/* What a read leaves behind in t: its usage, kvt_tier_dropped, the remote stats, the counters
 * of the nodes the read went to first (src) and last (dst), and every node's hits and errors. */
typedef struct cl_state {
    kvt_tier_usage_t u;
    uint64_t dropped;
    kvt_tier_remote_stats_t rs;
    kvt_tier_remote_node_stats_t src, dst;
    uint64_t hits, errors, misses;
} cl_state_t;

static void cl_state(kvt_tier_t *t, uint16_t src, uint16_t dst, cl_state_t *st)
{
    memset(st, 0, sizeof(*st));
    kvt_tier_usage(t, &st->u);
    st->dropped = kvt_tier_dropped(t);
    st->rs = stats(t);
    st->src = node_stats(t, src);
    st->dst = node_stats(t, dst);
    kvt_tier_remote_node_stats_t ns;
    int n = kvt_tier_remote_node_stats(t, 0, &ns);
    for (int i = 0; i < n; i++) {
        kvt_tier_remote_node_stats(t, (uint32_t)i, &ns);
        st->hits += ns.hits, st->errors += ns.errors, st->misses += ns.misses;
    }
}

/* Asserts that b - a (a field of cl_state_t) moved by want, naming the redirect. */
#define CL_MOVED_BY(a, b, field, want, how)                                                        \
    cr_assert_eq((int64_t)((b).field - (a).field), (int64_t)(want),                                \
                 "after %s: %s moved by %lld, not %lld", how, #field,                              \
                 (long long)((b).field - (a).field), (long long)(want))

/* A value of len bytes, its payload corrupt on the node its slot went to, read with check_later
 * after a MOVED (ask 0: the slot migrated whole) or an ASK (ask 1: the slot still migrating, the
 * value written there through an ASK): see the test below. */
static void late_corrupt_after_redirect(int ask, uint32_t len, uint32_t i)
{
    const char *how = ask ? "ASK" : "MOVED";
    uint16_t ports[CL_NODES], prim[CL_NODES];
    shared(ports);
    int np = cl_primaries(ports[0], prim, CL_NODES);
    cr_assert_eq(np, 3);
    kvt_tier_t *t = open_cluster(getenv("KVT_TEST_CLUSTER"));
    blk_t b;
    blk_init(&b, i, len);
    char key[KVT_TIER_REMOTE_KEY_MAX];
    int slot = key_slot_of(t, &b, key);
    uint16_t src = cl_owner(ports[0], slot);
    uint16_t dst = prim[0] == src ? prim[1] : prim[0];
    if (ask) {
        char sid[41], did[41];
        cl_myid(src, sid);
        cl_myid(dst, did);
        ok_reply(cl_cmd(dst, "CLUSTER SETSLOT %d IMPORTING %s", slot, sid), "IMPORTING");
        ok_reply(cl_cmd(src, "CLUSTER SETSLOT %d MIGRATING %s", slot, did), "MIGRATING");
        cr_assert_eq(write_blk(t, &b, i), 0); /* src answers ASK: stored on dst */
    } else {
        cr_assert_eq(write_blk(t, &b, i), 0); /* stored on src */
        migrate_slot(slot, src, dst, prim, np);
        cr_assert_eq(cl_owner(dst, slot), dst);
    }
    const uint64_t loc = b.io.loc;
    flip_on(t, &b, dst, 64 + 4 * PAGE + 100); /* a payload byte, past the header and tokens */
    long long dels = 0;
    for (int k = 0; k < np; k++)
        dels += dels_on(prim[k]);

    cl_state_t s[3];
    cl_state(t, src, dst, &s[0]);
    b.io.check_later = 1;
    memset(b.buf, 0xa5, len);
    cr_assert_eq(do_io(t, &b, 0), 0, "after %s: the payload left to the caller", how);
    cr_assert(b.io.unchecked);
    cl_state(t, src, dst, &s[1]);
    CL_MOVED_BY(s[0], s[1], src.moved, !ask, how);
    CL_MOVED_BY(s[0], s[1], src.asks, ask, how);
    CL_MOVED_BY(s[0], s[1], dst.hits, 1, how); /* the node that served it */
    CL_MOVED_BY(s[0], s[1], src.hits, 0, how);
    cr_assert_eq(kvt_tier_read_check(&b.io), KVT_ECORRUPT);
    kvt_tier_read_corrupt(t, &b.io);
    cl_state(t, src, dst, &s[2]);
    /* As for one server (a_late_corrupt_read_ends_as_one_found_at_completion), the error on the
     * node that answered the GET, not the one that redirected it. */
    CL_MOVED_BY(s[0], s[2], u.reads, 0, how);
    CL_MOVED_BY(s[0], s[2], u.read_bytes, 0, how);
    CL_MOVED_BY(s[0], s[2], u.corrupt, 1, how);
    CL_MOVED_BY(s[0], s[2], u.misses, 0, how);
    CL_MOVED_BY(s[0], s[2], u.errors, 0, how);
    CL_MOVED_BY(s[0], s[2], u.reclaimed, 1, how);
    CL_MOVED_BY(s[0], s[2], dropped, 1, how);
    CL_MOVED_BY(s[0], s[2], u.blocks, -1, how);
    CL_MOVED_BY(s[0], s[2], u.used_bytes, -(int64_t)kvt_tier_footprint(t, len), how);
    CL_MOVED_BY(s[0], s[2], u.inflight, 0, how);
    CL_MOVED_BY(s[0], s[2], rs.evicted, 1, how);
    CL_MOVED_BY(s[0], s[2], rs.redirect_errors, 0, how);
    CL_MOVED_BY(s[0], s[2], dst.hits, 0, how);
    CL_MOVED_BY(s[0], s[2], dst.misses, 0, how);
    CL_MOVED_BY(s[0], s[2], dst.errors, 1, how);
    CL_MOVED_BY(s[0], s[2], src.hits, 0, how);
    CL_MOVED_BY(s[0], s[2], src.misses, 0, how);
    CL_MOVED_BY(s[0], s[2], src.errors, 0, how);
    CL_MOVED_BY(s[0], s[2], hits, 0, how);
    CL_MOVED_BY(s[0], s[2], misses, 0, how);
    CL_MOVED_BY(s[0], s[2], errors, 1, how);
    cr_assert(!kvt_tier_valid(t, loc, &b.io.key), "after %s: the location dropped", how);

    /* Freeing the dropped location, as the daemon does when it makes the block lost, sends no
     * DEL, to either node: a read queued behind the free (on src's connection, then dst's, in
     * order) finds the value still on dst, corrupt, with nothing more dropped. */
    kvt_tier_free(t, loc, len);
    b.io.check_later = 0;
    cr_assert_eq(do_io(t, &b, 0), KVT_ECORRUPT, "after %s: the value is still there", how);
    cr_assert(!kvt_tier_valid(t, loc, &b.io.key));
    cr_assert_eq(kvt_tier_dropped(t), s[2].dropped, "after %s: the re-read dropped nothing", how);
    long long dels_after = 0;
    for (int k = 0; k < np; k++)
        dels_after += dels_on(prim[k]);
    cr_assert_eq(dels_after, dels, "after %s: %lld DELs sent", how, dels_after - dels);

    if (ask)
        migrate_slot(slot, src, dst, prim, np); /* leave the cluster whole */
    ok_reply(cl_cmd(dst, "DEL %s", key), "DEL");
    cr_expect_eq(stats(t).redirect_errors, 0);
    blk_fini(&b);
    kvt_tier_destroy(t);
}

/* A value read after a redirect whose payload then fails the check its reader took (check_later,
 * kvt_tier_read_check, kvt_tier_read_corrupt: the daemon's shared GET) ends as it does with one
 * server: a corrupt read, not a read; the block reclaimed once (kvt_tier_dropped by one), its
 * charge back, an eviction; the hit taken back from, and the error counted on, the node that
 * served the GET (the slot's new owner), none on the node that answered MOVED or ASK nor on any
 * other; the location dropped, and no DEL sent, to any node, when the daemon then frees it. For a
 * value copied out of hiredis's buffer (8 KiB) and one read in place (256 KiB). */
Test(remote_cluster, a_late_corrupt_read_after_a_redirect_ends_on_the_node_that_served_it)
{
    late_corrupt_after_redirect(0, 8192, 40);
    late_corrupt_after_redirect(0, 256u << 10, 41);
    late_corrupt_after_redirect(1, 8192, 42);
    late_corrupt_after_redirect(1, 256u << 10, 43);
}

Test(remote_cluster, a_dead_seed_is_passed_over)
{
    uint16_t ports[CL_NODES];
    shared(ports);
    char seeds[96];
    snprintf(seeds, sizeof(seeds), "127.0.0.1:%u,127.0.0.1:%u", cl_free_port(), ports[1]);
    kvt_tier_t *t = open_cluster(seeds);
    blk_t b;
    blk_init(&b, 3, 2048);
    cr_assert_eq(write_blk(t, &b, 3), 0);
    cr_assert_eq(read_check(t, &b, 3), 0);
    cr_expect_geq(stats(t).connect_failures, 1, "the dead seed was tried");
    blk_fini(&b);
    kvt_tier_destroy(t);

    /* Only dead seeds: no map, every request a fast KVT_EUNAVAIL, and no crash. */
    snprintf(seeds, sizeof(seeds), "127.0.0.1:%u", cl_free_port());
    kvt_tier_remote_conf_t c = cluster_conf(seeds);
    cr_assert_eq(kvt_tier_remote_create(&t, &c), 0);
    cr_assert_not(wait_connected(t, 300));
    blk_init(&b, 4, 2048);
    fill(b.buf, b.io.len, 4);
    cr_expect_eq(kvt_tier_write(t, &b.io), KVT_EUNAVAIL);
    cr_expect_eq(kvt_tier_read(t, &b.io), KVT_EUNAVAIL);
    blk_fini(&b);
    kvt_tier_destroy(t);
}

Test(remote_cluster, bad_settings_are_refused)
{
    kvt_tier_t *t = NULL;
    const char *bad_seeds[] = {"",
                               ",",
                               "127.0.0.1",
                               "127.0.0.1:0",
                               "127.0.0.1:6379,",
                               "127.0.0.1:6379,,127.0.0.1:6380",
                               "host:port"};
    for (size_t i = 0; i < sizeof(bad_seeds) / sizeof(bad_seeds[0]); i++) {
        kvt_tier_remote_conf_t c = cluster_conf(bad_seeds[i]);
        cr_expect_eq(kvt_tier_remote_create(&t, &c), KVT_EINVAL, "seeds '%s'", bad_seeds[i]);
    }
    kvt_tier_remote_conf_t c = cluster_conf("127.0.0.1:6379");
    c.db = 1; /* a cluster has one database */
    cr_expect_eq(kvt_tier_remote_create(&t, &c), KVT_EINVAL);
    c = cluster_conf("127.0.0.1:6379");
    c.key_prefix = "kv{t}"; /* a hash tag: every key in one slot */
    cr_expect_eq(kvt_tier_remote_create(&t, &c), KVT_EINVAL);
    c = cluster_conf(NULL);
    cr_expect_eq(kvt_tier_remote_create(&t, &c), KVT_EINVAL);
    cr_expect_null(t);
}

/* A single-server tier pointed at one primary of a cluster: keys the primary does not own come
 * back MOVED, which the tier cannot follow there: a counted KVT_EIO, at once, never a retry
 * loop. */
Test(remote_cluster, moved_to_a_single_server_tier_is_a_counted_error)
{
    uint16_t ports[CL_NODES];
    shared(ports);
    uint16_t prim[CL_NODES];
    cr_assert_eq(cl_primaries(ports[0], prim, CL_NODES), 3);
    kvt_tier_remote_conf_t c = cluster_conf(NULL);
    c.cluster = 0;
    c.host = "127.0.0.1";
    c.port = prim[0];
    kvt_tier_t *t = NULL;
    cr_assert_eq(kvt_tier_remote_create(&t, &c), 0);
    cr_assert(wait_connected(t, 3000));
    int moved = 0, stored = 0;
    for (uint32_t i = 0; i < 32; i++) {
        blk_t b;
        blk_init(&b, i, 1024);
        int rc = write_blk(t, &b, i);
        cr_assert(rc == 0 || rc == KVT_EIO, "write: %s", kvt_strerror(rc));
        moved += rc == KVT_EIO;
        stored += rc == 0;
        if (rc == 0)
            cr_assert_eq(read_check(t, &b, i), 0);
        blk_fini(&b);
    }
    cr_expect_gt(moved, 0);
    cr_expect_gt(stored, 0);
    kvt_tier_remote_stats_t s = stats(t);
    cr_expect_eq(s.moved, (uint64_t)moved);
    cr_expect_eq(s.redirect_errors, (uint64_t)moved);
    cr_expect(kvt_tier_remote_connected(t), "the connection stays up");
    kvt_tier_destroy(t);
}

/* A cluster-mode tier whose seed is no cluster node: CLUSTER SLOTS is refused; the tier counts
 * it, asks again at most every 100 ms, and sends no block anywhere. */
Test(remote_cluster, a_seed_that_is_no_cluster_node_gives_no_map)
{
    const char *plain = getenv("KVT_TEST_REDIS");
    if (!plain || !*plain)
        cr_skip_test("KVT_TEST_REDIS is not set (scripts/test.sh starts a redis-server)");
    kvt_tier_remote_conf_t c = cluster_conf(plain);
    kvt_tier_t *t = NULL;
    cr_assert_eq(kvt_tier_remote_create(&t, &c), 0);
    uint64_t end = kvt_now_ns() + 600000000ull;
    while (kvt_now_ns() < end)
        kvt_tier_wait(t, 10);
    kvt_tier_remote_stats_t s = stats(t);
    cr_expect_not(kvt_tier_remote_connected(t));
    cr_expect_geq(s.map_errors, 2, "refused, and asked again");
    cr_expect_leq(s.map_errors, 8, "at most every 100 ms, not in a loop");
    cr_expect_eq(s.map_refreshes, 0);
    blk_t b;
    blk_init(&b, 1, 1024);
    fill(b.buf, b.io.len, 1);
    cr_expect_eq(kvt_tier_write(t, &b.io), KVT_EUNAVAIL);
    blk_fini(&b);
    kvt_tier_destroy(t);
}

/* What the failover test holds, released by its fini whether it passes or fails (a failed
 * assertion leaves the test body at once): the tier, the blocks, the cluster's processes. */
#define FO_N   48
#define FO_LEN 8192
static struct {
    cl_t cl;
    kvt_tier_t *t;
    blk_t b[FO_N + 1]; /* FO_N read in a loop, then one written after the failover */
    int nb;
} g_fo;

static void failover_fini(void)
{
    if (g_fo.t)
        kvt_tier_destroy(g_fo.t);
    g_fo.t = NULL;
    for (int i = 0; i < g_fo.nb; i++)
        blk_fini(&g_fo.b[i]);
    g_fo.nb = 0;
    cl_stop(&g_fo.cl);
}

/* One round's outcomes. */
typedef struct round {
    int ok, missing, unavail; /* unavail: found their node down or failing over, or timed out */
} round_t;

/* Reads every block at once; each must complete (within the timeout, never hang) and a success
 * must hold exactly its bytes. */
static round_t read_all(kvt_tier_t *t, blk_t *b, int n)
{
    uint8_t want[FO_LEN];
    round_t r = {0};
    for (int i = 0; i < n; i++) {
        memset(b[i].buf, 0xa5, b[i].io.len);
        b[i].done = 0;
        int rc = kvt_tier_read(t, &b[i].io);
        if (rc) {
            cr_assert_eq(rc, KVT_EUNAVAIL, "read %d: %s", i, kvt_strerror(rc));
            b[i].done = 1;
            b[i].io.status = rc;
        }
    }
    wait_all(t, b, n, 3000); /* timeout_ms is 500 */
    for (int i = 0; i < n; i++) {
        int st = b[i].io.status;
        if (st == 0) {
            cr_assert_eq(b[i].io.len, FO_LEN);
            fill(want, FO_LEN, (uint64_t)i);
            cr_assert(!memcmp(b[i].buf, want, FO_LEN), "read %d served a wrong byte", i);
            r.ok++;
        } else {
            cr_assert(st == KVT_EUNAVAIL || st == KVT_ETIMEDOUT || st == KVT_ENOENT, "read %d: %s",
                      i, kvt_strerror(st));
            r.missing += st == KVT_ENOENT;
            r.unavail += st != KVT_ENOENT;
        }
    }
    return r;
}

/* A primary SIGKILLed while blocks are being read: its replica is promoted by the cluster, the
 * tier finds it by itself, no wrong byte is served, and every request completes or is a counted
 * miss in the meantime. The replicas must have applied every write before the kill (see
 * cl_replicated): a write the primary took and had not yet sent is lost with it, a miss the tier
 * cannot avoid, which made this test fail now and then on a loaded machine while its check was a
 * WAIT on a connection of its own. */
Test(remote_cluster, primary_killed_under_load_fails_over_to_its_replica, .timeout = 90,
     .fini = failover_fini)
{
    cl_t *cl = &g_fo.cl;
    char err[512] = "";
    int rc = cl_start(cl, err, sizeof(err));
    if (rc == -1)
        cr_skip_test("no redis-server and redis-cli to form a cluster with");
    cr_assert_eq(rc, 0, "the cluster did not form: %s", err);
    kvt_tier_remote_conf_t c = cluster_conf(cl->seeds);
    c.timeout_ms = 500;
    cr_assert_eq(kvt_tier_remote_create(&g_fo.t, &c), 0);
    kvt_tier_t *t = g_fo.t;
    cr_assert(wait_connected(t, 5000));
    blk_t *b = g_fo.b;
    for (int i = 0; i < FO_N; i++) {
        blk_init(&b[i], (uint32_t)i, FO_LEN);
        g_fo.nb = i + 1;
        cr_assert_eq(write_blk(t, &b[i], (uint64_t)i), 0);
    }
    /* Every replica holds every block before its primary goes. */
    uint16_t prim[CL_NODES];
    int np = cl_primaries(cl->port[0], prim, CL_NODES);
    cr_assert_eq(np, 3);
    for (int i = 0; i < np; i++)
        cr_assert(cl_replicated(prim[i], 10000), "the replica of %u never applied the writes",
                  prim[i]);
    char key[KVT_TIER_REMOTE_KEY_MAX];
    uint16_t victim = cl_owner(cl->port[0], key_slot_of(t, &b[0], key));
    int vi = -1;
    for (int i = 0; i < CL_NODES; i++)
        if (cl->port[i] == victim)
            vi = i;
    cr_assert_geq(vi, 0);
    uint16_t other = cl->port[(vi + 1) % CL_NODES];

    round_t r = read_all(t, b, FO_N);
    cr_assert_eq(r.ok, FO_N);
    kill(cl->pid[vi], SIGKILL);
    waitpid(cl->pid[vi], NULL, 0);
    cl->pid[vi] = -1;
    uint64_t killed = kvt_now_ns(), back = 0;
    int rounds = 0, unavail = 0;
    while (kvt_now_ns() - killed < 15000000000ull) {
        rounds++;
        r = read_all(t, b, FO_N);
        unavail += r.unavail;
        if (r.ok == FO_N && cl_owner(other, key_slot_of(t, &b[0], key)) != victim) {
            back = kvt_now_ns();
            break;
        }
        cl_sleep_ms(10); /* a steady load, not a spin */
        kvt_tier_process(t);
    }
    cr_assert(back,
              "the tier never served every block again (%d rounds; the last served %d of %d, %d "
              "not found, %d unavailable or timed out)",
              rounds, r.ok, FO_N, r.missing, r.unavail);
    cr_expect_gt(unavail, 0, "the reads in the failover were counted misses");
    kvt_tier_remote_stats_t s = stats(t);
    cr_expect_geq(s.failovers, 1);
    cr_expect_geq(s.disconnects, 1);
    cr_expect_geq(s.map_refreshes, 2);
    cr_expect(kvt_tier_remote_connected(t), "whole again: every primary up");
    kvt_tier_remote_node_stats_t gone = node_stats(t, victim);
    cr_expect_eq(gone.failovers, 1, "the failover counted on the lost primary");
    cr_expect_gt(gone.errors, 0, "the reads it failed counted on it");
    cr_expect(!gone.up && gone.slots == 0);
    fprintf(stderr,
            "failover: every block served again %.2f s after the SIGKILL (%d rounds, %d "
            "misses while failing over)\n",
            (double)(back - killed) / 1e9, rounds, unavail);
    /* Writes land on the promoted replica. */
    blk_t *w = &b[FO_N];
    blk_init(w, 1000, 4096);
    g_fo.nb = FO_N + 1;
    cr_assert_eq(write_blk(t, w, 1000), 0);
    cr_assert_eq(read_check(t, w, 1000), 0);
}

/* The check the failover test relies on: a write the primary took is not "replicated" while its
 * replica has not applied it (here: the replica paused with SIGSTOP, for well under the node
 * timeout), and is once the replica goes on and holds it. */
Test(remote_cluster, a_write_is_replicated_only_once_the_replica_applied_it)
{
    uint16_t ports[CL_NODES], prim[CL_NODES];
    shared(ports);
    cr_assert_eq(cl_primaries(ports[0], prim, CL_NODES), 3);
    redisReply *info = cl_cmd(prim[0], "INFO replication");
    cr_assert(info && info->type == REDIS_REPLY_STRING);
    const char *line = strstr(info->str, "\nslave0:");
    cr_assert(line, "the primary on %u has no replica", prim[0]);
    uint16_t rep = (uint16_t)cl_info_num(line, ",port=");
    freeReplyObject(info);
    pid_t rpid = node_pid(rep);
    /* A key the primary owns: names tried until one's slot is prim[0]'s. */
    char k[96];
    int owned = 0;
    for (int i = 0; i < 1000 && !owned; i++) {
        snprintf(k, sizeof(k), "%s:repl:%d", g_prefix, i);
        owned = cl_owner(ports[0], kvt_tier_remote_key_slot(k, strlen(k))) == prim[0];
    }
    cr_assert(owned);
    kill(rpid, SIGSTOP);
    redisReply *set = cl_cmd(prim[0], "SET %s v", k);
    int refused = cl_replicated(prim[0], 200);
    kill(rpid, SIGCONT);
    cr_assert(set && set->type == REDIS_REPLY_STATUS, "SET on the primary");
    freeReplyObject(set);
    cr_expect_not(refused, "a paused replica cannot have applied the write");
    cr_assert(cl_replicated(prim[0], 5000), "the replica applied it once it went on");
    redisContext *rc = cl_conn(rep);
    cr_assert(rc);
    redisReply *ro = redisCommand(rc, "READONLY");
    cr_assert(ro && ro->type == REDIS_REPLY_STATUS);
    freeReplyObject(ro);
    redisReply *got = redisCommand(rc, "GET %s", k);
    cr_expect(got && got->type == REDIS_REPLY_STRING, "the replica holds the key");
    if (got)
        freeReplyObject(got);
    redisFree(rc);
    ok_reply(cl_cmd(prim[0], "DEL %s", k), "DEL");
}

/* Every primary at a tiny maxmemory with noeviction: SETs the cluster refuses with OOM are
 * KVT_ENOSPC, at once, while the blocks stored before still read back; no error loop, and the
 * connections stay up. */
Test(remote_cluster, a_full_cluster_refuses_writes_with_enospc)
{
    uint16_t ports[CL_NODES], prim[CL_NODES];
    shared(ports);
    int np = cl_primaries(ports[0], prim, CL_NODES);
    cr_assert_eq(np, 3);
    kvt_tier_t *t = open_cluster(getenv("KVT_TEST_CLUSTER"));
    enum { N = 4 };
    blk_t b[N];
    for (int i = 0; i < N; i++) {
        blk_init(&b[i], (uint32_t)i, 4096);
        cr_assert_eq(write_blk(t, &b[i], (uint64_t)i), 0);
    }
    for (int i = 0; i < np; i++) {
        redisReply *r = cl_cmd(prim[i], "INFO memory");
        cr_assert(r && r->type == REDIS_REPLY_STRING);
        const char *u = strstr(r->str, "used_memory:");
        cr_assert(u);
        long long used = atoll(u + strlen("used_memory:"));
        freeReplyObject(r);
        ok_reply(cl_cmd(prim[i], "CONFIG SET maxmemory-policy noeviction"), "policy");
        ok_reply(cl_cmd(prim[i], "CONFIG SET maxmemory %lld", used + 65536), "maxmemory");
    }
    int enospc = 0, stored = 0;
    for (uint32_t i = 100; i < 300 && enospc < 20; i++) {
        blk_t w;
        blk_init(&w, i, 65536);
        int rc = write_blk(t, &w, i);
        cr_assert(rc == 0 || rc == KVT_ENOSPC, "write %u: %s", i, kvt_strerror(rc));
        enospc += rc == KVT_ENOSPC;
        stored += rc == 0;
        blk_fini(&w);
    }
    for (int i = 0; i < np; i++)
        ok_reply(cl_cmd(prim[i], "CONFIG SET maxmemory 0"), "maxmemory 0");
    cr_expect_geq(enospc, 20, "the full cluster refused writes (%d stored)", stored);
    for (int i = 0; i < N; i++)
        cr_expect_eq(read_check(t, &b[i], (uint64_t)i), 0, "block %d stored before", i);
    cr_expect(kvt_tier_remote_connected(t));
    cr_expect_eq(stats(t).disconnects, 0);
    blk_t w;
    blk_init(&w, 400, 4096);
    cr_expect_eq(write_blk(t, &w, 400), 0, "room again");
    blk_fini(&w);
    for (int i = 0; i < N; i++)
        blk_fini(&b[i]);
    kvt_tier_destroy(t);
}

/* The policy a node evicts by, copied into out (CONFIG GET). */
static void policy_of(uint16_t port, char *out, size_t cap)
{
    redisReply *r = cl_cmd(port, "CONFIG GET maxmemory-policy");
    cr_assert(r && r->type == REDIS_REPLY_ARRAY && r->elements == 2);
    snprintf(out, cap, "%s", r->element[1]->str);
    freeReplyObject(r);
}

/* Every primary at a small maxmemory under allkeys-lru while the tier writes 3 times that: the
 * cluster evicts the oldest blocks, the tier goes on writing (no OOM, no error), and reads of the
 * evicted blocks are KVT_ENOENT misses, counted (misses, reclaimed, evicted: their charge given
 * back), never errors, while the newest blocks read back byte-exact. */
Test(remote_cluster, an_evicting_cluster_turns_evicted_blocks_into_counted_misses)
{
    uint16_t ports[CL_NODES], prim[CL_NODES];
    shared(ports);
    int np = cl_primaries(ports[0], prim, CL_NODES);
    cr_assert_eq(np, 3);
    char policy[3][64];
    for (int i = 0; i < np; i++) {
        policy_of(prim[i], policy[i], sizeof(policy[i]));
        redisReply *r = cl_cmd(prim[i], "INFO memory");
        cr_assert(r && r->type == REDIS_REPLY_STRING);
        const char *u = strstr(r->str, "used_memory:");
        cr_assert(u);
        long long used = atoll(u + strlen("used_memory:"));
        freeReplyObject(r);
        ok_reply(cl_cmd(prim[i], "CONFIG SET maxmemory-policy allkeys-lru"), "policy");
        ok_reply(cl_cmd(prim[i], "CONFIG SET maxmemory %lld", used + (2ll << 20)), "maxmemory");
    }
    kvt_tier_t *t = open_cluster(getenv("KVT_TEST_CLUSTER"));
    enum { N = 144, LEN = 128 << 10 }; /* 18 MiB against 6 MiB */
    blk_t *b = calloc(N, sizeof(*b));
    cr_assert(b);
    for (int i = 0; i < N; i++) {
        blk_init(&b[i], (uint32_t)i, LEN);
        int rc = write_blk(t, &b[i], (uint64_t)i);
        cr_assert_eq(rc, 0, "write %d: %s", i, kvt_strerror(rc));
    }
    int hits = 0, misses = 0;
    for (int i = N - 1; i >= 0; i--) { /* newest first, as LRU would keep them */
        int rc = read_check(t, &b[i], (uint64_t)i);
        cr_assert(rc == 0 || rc == KVT_ENOENT, "read %d: %s", i, kvt_strerror(rc));
        if (i >= N - 3)
            cr_expect_eq(rc, 0, "block %d, among the newest, was evicted", i);
        hits += rc == 0;
        misses += rc == KVT_ENOENT;
    }
    for (int i = 0; i < np; i++) {
        ok_reply(cl_cmd(prim[i], "CONFIG SET maxmemory 0"), "maxmemory 0");
        ok_reply(cl_cmd(prim[i], "CONFIG SET maxmemory-policy %s", policy[i]), "policy back");
    }
    cr_expect_gt(misses, N / 3, "only %d of %d evicted", misses, N);
    cr_expect_gt(hits, 0);
    kvt_tier_usage_t u;
    kvt_tier_usage(t, &u);
    cr_expect_eq(u.errors, 0, "eviction is not an error");
    cr_expect_eq(u.misses, (uint64_t)misses);
    cr_expect_eq(u.reclaimed, (uint64_t)misses);
    cr_expect_eq(u.blocks, (uint64_t)hits);
    kvt_tier_remote_stats_t s = stats(t);
    cr_expect_eq(s.evicted, (uint64_t)misses);
    cr_expect_eq(s.disconnects, 0);
    cr_expect_eq(s.timeouts, 0);
    for (int i = 0; i < N; i++)
        blk_fini(&b[i]);
    free(b);
    kvt_tier_destroy(t);
}

/* ttl_s holds in cluster mode: every key, on whichever primary, carries the expiry (each SET
 * renews it), and a block read after its key expired is a counted miss. */
Test(remote_cluster, ttl_holds_on_every_primary)
{
    uint16_t ports[CL_NODES], prim[CL_NODES];
    shared(ports);
    int np = cl_primaries(ports[0], prim, CL_NODES);
    cr_assert_eq(np, 3);
    kvt_tier_remote_conf_t c = cluster_conf(getenv("KVT_TEST_CLUSTER"));
    c.ttl_s = 1;
    kvt_tier_t *t = NULL;
    cr_assert_eq(kvt_tier_remote_create(&t, &c), 0);
    cr_assert(wait_connected(t, 5000));
    /* At least 24 keys, and more until each primary holds one: the slots a primary owns by now
     * depend on the reshards and failovers of the tests before (a primary can own far fewer than
     * a third of them). */
    enum { MAXN = 256 };
    blk_t b[MAXN];
    int on[3] = {0}, N = 0;
    for (int i = 0; i < MAXN && (i < 24 || !on[0] || !on[1] || !on[2]); i++, N++) {
        blk_init(&b[i], (uint32_t)i, 2048);
        cr_assert_eq(write_blk(t, &b[i], (uint64_t)i), 0);
        char key[KVT_TIER_REMOTE_KEY_MAX];
        int slot = key_slot_of(t, &b[i], key);
        uint16_t owner = cl_owner(ports[0], slot);
        redisReply *r = cl_cmd(owner, "PTTL %s", key);
        cr_assert(r && r->type == REDIS_REPLY_INTEGER);
        cr_expect(r->integer > 0 && r->integer <= 1000, "key %d: pttl %lld", i, r->integer);
        freeReplyObject(r);
        for (int k = 0; k < np; k++)
            on[k] += prim[k] == owner;
    }
    for (int k = 0; k < np; k++)
        cr_expect_gt(on[k], 0, "no key on the primary on port %u", prim[k]);
    cl_sleep_ms(1300);
    for (int i = 0; i < N; i++)
        cr_expect_eq(read_check(t, &b[i], (uint64_t)i), KVT_ENOENT, "block %d outlived its ttl", i);
    kvt_tier_usage_t u;
    kvt_tier_usage(t, &u);
    cr_expect_eq(u.misses, N);
    cr_expect_eq(u.errors, 0);
    cr_expect_eq(u.blocks, 0, "the expired blocks' charge was given back");
    for (int i = 0; i < N; i++)
        blk_fini(&b[i]);
    kvt_tier_destroy(t);
}

/* redis-cli --cluster reshard moves 1000 slots from one primary to another while the tier reads
 * and writes: every request completes, no wrong byte is served, and afterwards every block
 * reads back (the tier followed MOVED and ASK). */
Test(remote_cluster, reshard_under_load)
{
    uint16_t ports[CL_NODES], prim[CL_NODES];
    shared(ports);
    cr_assert_eq(cl_primaries(ports[0], prim, CL_NODES), 3);
    char cli[512], server[512];
    cr_assert(cl_binaries(server, cli, sizeof(cli)));
    kvt_tier_t *t = open_cluster(getenv("KVT_TEST_CLUSTER"));
    enum { N = 64 };
    blk_t *b = calloc(N, sizeof(*b));
    cr_assert(b);
    for (int i = 0; i < N; i++) {
        blk_init(&b[i], (uint32_t)i, 16384);
        cr_assert_eq(write_blk(t, &b[i], (uint64_t)i), 0);
    }
    char from[41], to[41], addr[32], logp[300];
    cl_myid(prim[0], from);
    cl_myid(prim[1], to);
    snprintf(addr, sizeof(addr), "127.0.0.1:%u", prim[0]);
    snprintf(logp, sizeof(logp), "%s/reshard-%d.log", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp",
             (int)getpid());
    kvt_tier_remote_stats_t s0 = stats(t);
    pid_t pid = fork();
    cr_assert(pid >= 0);
    if (pid == 0) {
        FILE *f = freopen(logp, "w", stdout);
        (void)f;
        dup2(1, 2);
        execl(cli, cli, "--cluster", "reshard", addr, "--cluster-from", from, "--cluster-to", to,
              "--cluster-slots", "1000", "--cluster-yes", "--cluster-pipeline", "10", (char *)NULL);
        _exit(127);
    }
    int st = 0, rounds = 0, misses = 0;
    uint8_t *want = malloc(16384);
    cr_assert(want);
    for (;;) {
        int done = waitpid(pid, &st, WNOHANG) == pid;
        rounds++;
        for (int i = 0; i < N; i++) {
            memset(b[i].buf, 0xa5, b[i].io.len);
            b[i].done = 0;
            cr_assert_eq(kvt_tier_read(t, &b[i].io), 0);
        }
        wait_all(t, b, N, 5000);
        for (int i = 0; i < N; i++) {
            if (b[i].io.status) {
                misses++;
                continue;
            }
            fill(want, b[i].io.len, (uint64_t)i);
            cr_assert(!memcmp(b[i].buf, want, b[i].io.len), "block %d: a wrong byte", i);
        }
        if (done)
            break;
    }
    free(want);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "reshard failed: see %s", logp);
    for (int i = 0; i < N; i++)
        cr_assert_eq(read_check(t, &b[i], (uint64_t)i), 0, "block %d after the reshard", i);
    kvt_tier_remote_stats_t s = stats(t);
    cr_expect_gt(s.moved + s.asks, s0.moved + s0.asks, "the tier met the migration");
    cr_expect_eq(s.redirect_errors, 0);
    fprintf(stderr, "reshard: %d rounds of %d reads, %d misses, %llu MOVED, %llu ASK\n", rounds, N,
            misses, (unsigned long long)(s.moved - s0.moved),
            (unsigned long long)(s.asks - s0.asks));
    for (int i = 0; i < N; i++)
        blk_fini(&b[i]);
    free(b);
    kvt_tier_destroy(t);
}

/* --- a node that answers what no real one would --- */

/* The fake node: replies to PING; to CLUSTER SLOTS with three malformed maps, then a good one
 * (every slot on itself, its host left empty); to every GET with a redirect: first MOVED to a
 * garbage address, then MOVED to slot 99999, then MOVED back to itself, forever. */
static void fake_reply(int fd, const char *cmd, uint16_t self, int *maps, int *gets)
{
    char out[512];
    int n;
    if (!strcasecmp(cmd, "PING")) {
        n = snprintf(out, sizeof(out), "+PONG\r\n");
    } else if (!strcasecmp(cmd, "CLUSTER")) {
        static const char *const bad[] = {
            "*1\r\n*3\r\n:0\r\n:20000\r\n*2\r\n$9\r\n127.0.0.1\r\n:1\r\n", /* slot out of range */
            "*1\r\n:5\r\n",                                                /* not an entry */
            "*1\r\n*3\r\n:0\r\n:16383\r\n:7\r\n",                          /* no primary */
        };
        if (*maps < 3)
            n = snprintf(out, sizeof(out), "%s", bad[*maps]);
        else
            n = snprintf(out, sizeof(out),
                         "*1\r\n*3\r\n:0\r\n:16383\r\n*3\r\n$0\r\n\r\n:%u\r\n$2\r\nid\r\n", self);
        ++*maps;
    } else if (!strcasecmp(cmd, "GET")) {
        if (*gets == 0)
            n = snprintf(out, sizeof(out), "-MOVED 5 not-an-address\r\n");
        else if (*gets == 1)
            n = snprintf(out, sizeof(out), "-MOVED 99999 127.0.0.1:%u\r\n", self);
        else
            n = snprintf(out, sizeof(out), "-MOVED 5 127.0.0.1:%u\r\n", self);
        ++*gets;
    } else {
        n = snprintf(out, sizeof(out), "-ERR unknown\r\n");
    }
    if (write(fd, out, (size_t)n) != n)
        _exit(1);
}

/* Parses the whole commands in buf (RESP arrays of bulk strings) and answers each; returns the
 * bytes consumed. */
static size_t fake_serve(int fd, char *buf, size_t len, uint16_t self, int *maps, int *gets)
{
    size_t off = 0;
    for (;;) {
        char *p = buf + off, *end = buf + len;
        if (p >= end || *p != '*')
            return off;
        char *nl = memchr(p, '\n', (size_t)(end - p));
        if (!nl)
            return off;
        int argc = atoi(p + 1);
        p = nl + 1;
        char name[32] = "";
        for (int i = 0; i < argc; i++) {
            if (p >= end || *p != '$' || !(nl = memchr(p, '\n', (size_t)(end - p))))
                return off;
            long l = atol(p + 1);
            p = nl + 1;
            if (end - p < l + 2)
                return off;
            if (i == 0)
                snprintf(name, sizeof(name), "%.*s", (int)KVT_MIN(l, 31), p);
            p += l + 2;
        }
        fake_reply(fd, name, self, maps, gets);
        off = (size_t)(p - buf);
    }
}

static pid_t fake_node(uint16_t *port)
{
    int ls = socket(AF_INET, SOCK_STREAM, 0);
    cr_assert(ls >= 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    cr_assert_eq(bind(ls, (struct sockaddr *)&a, sizeof(a)), 0);
    socklen_t al = sizeof(a);
    cr_assert_eq(getsockname(ls, (struct sockaddr *)&a, &al), 0);
    cr_assert_eq(listen(ls, 8), 0);
    *port = ntohs(a.sin_port);
    pid_t pid = fork();
    cr_assert(pid >= 0);
    if (pid > 0) {
        close(ls);
        return pid;
    }
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    int maps = 0, gets = 0;
    for (;;) { /* one client at a time: the tier opens one connection */
        int fd = accept(ls, NULL, NULL);
        if (fd < 0)
            continue;
        static char buf[1 << 16];
        size_t len = 0;
        ssize_t r;
        while ((r = read(fd, buf + len, sizeof(buf) - len)) > 0) {
            len += (size_t)r;
            size_t used = fake_serve(fd, buf, len, *port, &maps, &gets);
            memmove(buf, buf + used, len - used);
            len -= used;
        }
        close(fd);
    }
}

/* Malformed slot maps are refused whole and counted; MOVED to a garbage address, to a slot out
 * of range, or in a loop is a counted KVT_EIO miss at once: no crash, no request left hanging, no
 * retry loop, and the connection stays up. */
Test(remote_cluster, malformed_maps_and_redirects_are_counted_misses)
{
    uint16_t port;
    pid_t pid = fake_node(&port);
    char seed[32];
    snprintf(seed, sizeof(seed), "127.0.0.1:%u", port);
    kvt_tier_t *t = open_cluster(seed);
    kvt_tier_remote_stats_t s = stats(t);
    cr_expect_eq(s.map_errors, 3, "three malformed maps refused");
    cr_expect_eq(s.map_refreshes, 1, "then the good one applied");
    cr_expect_eq(s.nodes, 1);
    for (uint32_t i = 0; i < 3; i++) {
        blk_t b;
        blk_init(&b, i, 1024);
        uint64_t t0 = kvt_now_ns();
        cr_expect_eq(read_check(t, &b, i), KVT_EIO, "read %u", i);
        cr_expect_lt(kvt_now_ns() - t0, 900000000ull, "a miss at once, not by the timeout");
        blk_fini(&b);
    }
    s = stats(t);
    cr_expect_eq(s.redirect_errors, 3);
    cr_expect_eq(s.moved, 1 + 1 + 6, "the loop was followed 5 times, then refused");
    cr_expect_eq(s.map_errors, 3);
    cr_expect(kvt_tier_remote_connected(t));
    /* Quiet afterwards: the refreshes the redirects asked for, no more. */
    uint64_t refreshes = s.map_refreshes, end = kvt_now_ns() + 400000000ull;
    while (kvt_now_ns() < end)
        kvt_tier_wait(t, 20);
    cr_expect_leq(stats(t).map_refreshes, refreshes + 1);
    kvt_tier_destroy(t);
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
}

/* --- two daemons over the cluster --- */

#define BB 16384

static void put_pages(kvt_client_t *c, const uint32_t *tok, uint32_t pages, uint32_t seed)
{
    uint8_t *payload = malloc((size_t)pages * BB);
    cr_assert(payload);
    for (uint32_t p = 0; p < pages; p++)
        kvd_fill(payload + (size_t)p * BB, BB, seed + p);
    kvt_client_put_t r;
    int rc = kvt_client_put(c, tok, pages * PAGE, 0, pages, payload, NULL, &r);
    cr_assert_eq(rc, 0, "put: %s %s", kvt_client_strerror(rc), kvt_client_errmsg(c));
    cr_assert_eq(r.stored, pages);
    free(payload);
}

static void get_pages(kvt_client_t *c, uint64_t lease, uint32_t pages, uint32_t seed, uint8_t *from)
{
    uint8_t *buf = malloc((size_t)pages * BB), *want = malloc(BB);
    cr_assert(buf && want);
    uint32_t got = 0;
    int rc = kvt_client_get(c, lease, 0, pages, buf, (size_t)pages * BB, &got, from);
    cr_assert_eq(rc, 0, "get: %s %s", kvt_client_strerror(rc), kvt_client_errmsg(c));
    cr_assert_eq(got, pages);
    for (uint32_t p = 0; p < pages; p++) {
        kvd_fill(want, BB, seed + p);
        cr_assert(!memcmp(buf + (size_t)p * BB, want, BB), "page %u differs", p);
    }
    free(buf);
    free(want);
}

/* Daemon a stores a prefix with no local tier (every page goes to the cluster, spread over its
 * primaries); daemon b, seeded with another node, finds it with MATCH's remote probe (its keys
 * asked of their nodes in parallel) and reads every byte back from the cluster. */
Test(remote_cluster, second_daemon_finds_the_first_ones_prefix_through_the_cluster)
{
    uint16_t ports[CL_NODES];
    shared(ports);
    char seed_a[32], seed_b[32], pfx[64];
    snprintf(seed_a, sizeof(seed_a), "127.0.0.1:%u", ports[0]);
    snprintf(seed_b, sizeof(seed_b), "127.0.0.1:%u,127.0.0.1:%u", ports[4], ports[5]);
    snprintf(pfx, sizeof(pfx), "kvt-fleet-%d", (int)getpid());
    kvd_t a = {0}, b = {0};
    kvd_start(&a, "--dram-bytes", "0", "--nvme-bytes", "0", "--remote", seed_a, "--remote-cluster",
              "yes", "--remote-prefix", pfx, NULL);
    kvd_start(&b, "--remote", seed_b, "--remote-cluster", "yes", "--remote-prefix", pfx, NULL);
    kvt_client_t *ca = kvd_client(&a, "shared-model", PAGE, BB);
    kvt_client_t *cb = kvd_client(&b, "shared-model", PAGE, BB);
    enum { P = 24 };
    uint32_t tok[(P + 4) * PAGE];
    kvd_tokens(tok, (P + 4) * PAGE, 3);
    /* a's remote tier must be up before its PUT: poll its connection metric. */
    int up = 0;
    for (int i = 0; i < 500 && !up; i++) {
        static char body[1 << 18];
        cr_assert_eq(kvd_http_get(&a, "/metrics", body, sizeof(body)), 200);
        up = strstr(body, "\nkvtier_remote_nodes 3\n") != NULL;
        if (!up)
            usleep(10000);
    }
    cr_assert(up, "a never saw 3 primaries");
    put_pages(ca, tok, P, 40);
    cr_assert_eq(kvd_stat(ca, "remote_blocks"), P);

    uint8_t tiers[P + 4], from[P + 4];
    kvt_client_match_t m = {.tiers = tiers, .tiers_cap = P + 4};
    cr_assert_eq(kvt_client_match(cb, tok, (P + 4) * PAGE, 0, 0, NULL, &m), 0);
    cr_expect_eq(m.pages, 0, "without the probe b knows nothing");
    uint64_t end = kvt_now_ns() / 1000000 + 5000;
    do { /* b's tier may still be learning the map */
        cr_assert_eq(kvt_client_match(cb, tok, (P + 4) * PAGE,
                                      KVT_CLIENT_LEASE | KVT_CLIENT_REMOTE | KVT_CLIENT_PROBE, 0,
                                      NULL, &m),
                     0);
        if (m.pages == P)
            break;
        if (m.lease)
            kvt_client_release(cb, m.lease, NULL);
        usleep(20000);
    } while (kvt_now_ns() / 1000000 < end);
    cr_assert_eq(m.pages, P, "the probe finds a's pages, not the 4 nobody stored");
    cr_expect_eq(m.remote_pages, P);
    get_pages(cb, m.lease, P, 40, from);
    cr_expect_eq(from[0], KVT_CLIENT_TIER_REMOTE);
    cr_expect_eq(from[P - 1], KVT_CLIENT_TIER_REMOTE);

    static char body[1 << 18];
    cr_assert_eq(kvd_http_get(&b, "/metrics", body, sizeof(body)), 200);
    cr_expect(strstr(body, "\nkvtier_remote_nodes 3\n"), "b follows 3 primaries");
    cr_expect(strstr(body, "\nkvtier_remote_redirect_errors_total 0\n"));
    /* Per node: each primary up, serving slots, and b's reads on them. */
    uint16_t prim[CL_NODES];
    cr_assert_eq(cl_primaries(ports[0], prim, CL_NODES), 3);
    double hits = 0;
    for (int k = 0; k < 3; k++) {
        char line[128];
        snprintf(line, sizeof(line), "\nkvtier_remote_node_up{node=\"127.0.0.1:%u\"} 1\n", prim[k]);
        cr_expect(strstr(body, line), "%s", line + 1);
        snprintf(line, sizeof(line), "\nkvtier_remote_node_slots{node=\"127.0.0.1:%u\"} ", prim[k]);
        const char *v = strstr(body, line);
        cr_expect(v && atoi(v + strlen(line)) > 0, "%s", line + 1);
        snprintf(line, sizeof(line), "\nkvtier_remote_node_hits_total{node=\"127.0.0.1:%u\"} ",
                 prim[k]);
        v = strstr(body, line);
        cr_expect(v, "%s", line + 1);
        hits += v ? strtod(v + strlen(line), NULL) : 0;
    }
    cr_expect_geq(hits, P, "b's GETs of a's pages, counted on the primaries");
    kvt_client_close(ca);
    kvt_client_close(cb);
    kvd_cleanup(&a);
    kvd_cleanup(&b);
}

static double scraped(const kvd_t *d, const char *series)
{
    static char text[1 << 18];
    cr_assert_eq(kvd_http_get(d, "/metrics", text, sizeof(text)), 200);
    char key[128];
    snprintf(key, sizeof(key), "\n%s ", series);
    const char *p = strstr(text, key);
    return p ? strtod(p + strlen(key), NULL) : -1;
}

static long long keys_on_primaries(const uint16_t *prim, int np)
{
    long long n = 0;
    for (int i = 0; i < np; i++)
        n += keys_on(prim[i]);
    return n;
}

/*
 * Shared keys stay shared, over the cluster: daemon a stores 6 pages (spread over the primaries);
 * with every primary paused for a moment (well under the cluster's node timeout), daemon b's
 * writes of the same pages time out, then land once the primaries go on. Before, b's undo DELs
 * removed a's keys; now every key stays, b counts the writes it left, and a reads its pages back.
 */
Test(remote_cluster, a_late_write_by_one_daemon_deletes_no_key_another_stored)
{
    uint16_t ports[CL_NODES], prim[CL_NODES];
    shared(ports);
    int np = cl_primaries(ports[0], prim, CL_NODES);
    cr_assert_eq(np, 3);
    kvd_t a = {0}, b = {0};
    const char *seeds = getenv("KVT_TEST_CLUSTER");
    kvd_start(&a, "--dram-bytes", "0", "--nvme-bytes", "0", "--remote", seeds, "--remote-cluster",
              "yes", "--remote-prefix", g_prefix, NULL);
    kvd_start(&b, "--dram-bytes", "0", "--nvme-bytes", "0", "--remote", seeds, "--remote-cluster",
              "yes", "--remote-prefix", g_prefix, "--remote-timeout-ms", "300", NULL);
    for (int i = 0; i < 500; i++) {
        if (scraped(&a, "kvtier_remote_nodes") == 3 && scraped(&b, "kvtier_remote_nodes") == 3 &&
            scraped(&a, "kvtier_remote_up") == 1 && scraped(&b, "kvtier_remote_up") == 1)
            break;
        usleep(10000);
    }
    cr_assert_eq(scraped(&b, "kvtier_remote_up"), 1, "b never saw the cluster");
    kvt_client_t *ca = kvd_client(&a, "shared-model", PAGE, BB);
    kvt_client_t *cb = kvd_client(&b, "shared-model", PAGE, BB);
    enum { P = 6 };
    uint32_t tok[P * PAGE];
    kvd_tokens(tok, P * PAGE, 11);
    put_pages(ca, tok, P, 70);
    cr_assert_eq(keys_on_primaries(prim, np), P);

    pid_t pids[CL_NODES];
    for (int i = 0; i < np; i++)
        pids[i] = node_pid(prim[i]);
    for (int i = 0; i < np; i++)
        kill(pids[i], SIGSTOP);
    uint8_t *payload = malloc((size_t)P * BB);
    cr_assert(payload);
    for (uint32_t p = 0; p < P; p++)
        kvd_fill(payload + (size_t)p * BB, BB, 70 + p);
    kvt_client_put_t r;
    int rc = kvt_client_put(cb, tok, P * PAGE, 0, P, payload, NULL, &r); /* times out */
    free(payload);
    for (int i = 0; i < np; i++)
        kill(pids[i], SIGCONT);
    cr_assert(rc == 0 || rc == KVT_CLIENT_ETIMEDOUT, "put: %s", kvt_client_strerror(rc));
    cr_assert_geq(scraped(&b, "kvtier_remote_timeouts_total"), 1, "b's writes timed out");
    double kept = 0;
    for (int i = 0; i < 150 && keys_on_primaries(prim, np) == P; i++) {
        if ((kept = scraped(&b, "kvtier_remote_late_writes_kept_total")) >= P)
            break;
        usleep(20000);
    }
    usleep(100000);
    cr_expect_eq(keys_on_primaries(prim, np), P, "b's late writes deleted a's keys");
    cr_expect_geq(kept, 1, "b counts the late writes it left in place");

    uint8_t from[P];
    kvt_client_match_t m = {0};
    cr_assert_eq(kvt_client_match(ca, tok, P * PAGE, KVT_CLIENT_LEASE, 0, NULL, &m), 0);
    cr_assert_eq(m.pages, P);
    get_pages(ca, m.lease, P, 70, from);
    cr_expect_eq(from[0], KVT_CLIENT_TIER_REMOTE);
    kvt_client_close(ca);
    kvt_client_close(cb);
    kvd_cleanup(&a);
    kvd_cleanup(&b);
}
