/*
 * test_server_remote.c: kvtierd with the remote tier on the real redis-server the test command
 * started (KVT_TEST_REDIS=host:port; skipped without it): blocks that fit in no local tier land
 * in Redis and read back byte-exact; a second daemon sharing the server finds a prefix the first
 * stored through MATCH's remote probe and reads its bytes; a remote that is down is a counted
 * miss reason, not an error; values overwritten with far more than a block are refused unbuffered
 * and counted (kvtier_remote_oversized_values_total) while the connection stays up; a PUT's
 * pages that NVMe cannot place (its segments all pinned) go on to Redis; a daemon whose writes
 * time out and land late deletes no key another daemon stored; a GET on loop 1 whose server stops
 * answering holds up nothing else on its loop and ends at its read's deadline. One test stands up
 * a fake server of its own whose GET answers have the wrong type.
 */
#include <strings.h>
#include <time.h>

#include "proto.h"
#include "test_server_harness.h"
#include "test_raw_frames.h"

static unsigned long long now_ns_test(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (unsigned long long)ts.tv_sec * 1000000000ull + (unsigned long long)ts.tv_nsec;
}

#define PAGE 16
#define BB   16384

static void prefix(char *buf, size_t len)
{
    snprintf(buf, len, "kvtest%d-%llu", (int)getpid(), (unsigned long long)now_ns_test());
}

static void put_all(kvt_client_t *c, const uint32_t *tok, uint32_t pages, uint32_t seed,
                    kvt_client_put_t *r)
{
    uint8_t *payload = malloc((size_t)pages * BB);
    for (uint32_t p = 0; p < pages; p++)
        kvd_fill(payload + (size_t)p * BB, BB, seed + p);
    int rc = kvt_client_put(c, tok, pages * PAGE, 0, pages, payload, NULL, r);
    cr_assert_eq(rc, 0, "put: %s %s", kvt_client_strerror(rc), kvt_client_errmsg(c));
    free(payload);
}

static void get_all(kvt_client_t *c, uint64_t lease, uint32_t pages, uint32_t seed, uint8_t *from)
{
    uint8_t *buf = malloc((size_t)pages * BB), *want = malloc(BB);
    uint32_t got = 0;
    int rc = kvt_client_get(c, lease, 0, pages, buf, (size_t)pages * BB, &got, from);
    cr_assert_eq(rc, 0, "get: %s %s", kvt_client_strerror(rc), kvt_client_errmsg(c));
    cr_assert_eq(got, pages);
    for (uint32_t p = 0; p < pages; p++) {
        kvd_fill(want, BB, seed + p);
        cr_assert(memcmp(buf + (size_t)p * BB, want, BB) == 0, "page %u differs", p);
    }
    free(buf);
    free(want);
}

Test(server_remote, blocks_past_dram_and_nvme_land_in_redis_and_read_back)
{
    const char *addr = kvd_redis();
    char pfx[64];
    prefix(pfx, sizeof pfx);
    kvd_t d = {0};
    kvd_start(&d, "--dram-bytes", "256K", "--nvme-bytes", "2M", "--remote", addr, "--remote-prefix",
              pfx, "--remote-bytes", "64M", NULL);
    kvt_client_t *c = kvd_client(&d, "m", PAGE, BB);
    enum { N = 200 }; /* 3.2 MB: past 256K of DRAM and 2M of NVMe */
    uint32_t *tok = malloc(N * PAGE * 4);
    kvd_tokens(tok, N * PAGE, 11);
    kvt_client_put_t r;
    put_all(c, tok, N, 500, &r);
    cr_expect_eq(r.stored, N, "every page stored somewhere (stored %u, skipped %u)", r.stored,
                 r.skipped);
    cr_expect_gt(kvd_stat(c, "remote_blocks"), 0);
    cr_expect_leq(kvd_stat(c, "dram_used_bytes"), kvd_stat(c, "dram_capacity_bytes"));
    cr_expect_leq(kvd_stat(c, "nvme_used_bytes"), kvd_stat(c, "nvme_capacity_bytes"));
    uint8_t tiers[N], from[N];
    kvt_client_match_t m = {.tiers = tiers, .tiers_cap = N};
    cr_assert_eq(kvt_client_match(c, tok, N * PAGE, KVT_CLIENT_LEASE, 0, NULL, &m), 0);
    cr_assert_eq(m.pages, N);
    cr_expect_eq(tiers[N - 1], KVT_CLIENT_TIER_REMOTE);
    get_all(c, m.lease, N, 500, from);
    cr_expect_eq(from[N - 1], KVT_CLIENT_TIER_REMOTE, "read back from redis");
    cr_assert_eq(kvt_client_release(c, m.lease, NULL), 0);
    static char body[1 << 20];
    cr_assert_eq(kvd_http_get(&d, "/metrics", body, sizeof body), 200);
    cr_expect(strstr(body, "\nkvtier_remote_connects_total 1\n"), "one connection");
    cr_expect(strstr(body, "\nkvtier_remote_disconnects_total 0\n"), "never lost");
    cr_expect(strstr(body, "\nkvtier_remote_oversized_values_total 0\n"), "nothing oversized");

    /* Four remote keys of ours overwritten with 8 MiB (the server pads SETRANGE itself): the
     * daemon refuses them as corrupt without holding them, counts them, and keeps serving. (A
     * few: with every key so treated the server built 512 MiB of replies for the 64 GETs in
     * flight and, on a busy machine, took longer than the remote timeout to start sending.) */
    char cmd[1024];
    const char *colon = strrchr(addr, ':');
    cr_assert(colon);
    snprintf(cmd, sizeof cmd,
             "k=$(redis-cli -h %.*s -p %s --scan --pattern '%s:*' | head -4) && [ -n \"$k\" ] && "
             "for x in $k; do "
             "redis-cli -h %.*s -p %s SETRANGE \"$x\" 8388607 x >/dev/null; done",
             (int)(colon - addr), addr, colon + 1, pfx, (int)(colon - addr), addr, colon + 1);
    cr_assert_eq(system(cmd), 0, "%s", cmd);
    m.tiers = tiers;
    cr_assert_eq(kvt_client_match(c, tok, N * PAGE, KVT_CLIENT_LEASE, 0, NULL, &m), 0);
    uint8_t *buf = malloc((size_t)N * BB);
    uint32_t got = 0;
    int rc = kvt_client_get(c, m.lease, 0, N, buf, (size_t)N * BB, &got, from);
    cr_expect(rc < 0 || got < N, "the overwritten blocks are not served (rc %d, got %u)", rc, got);
    free(buf);
    cr_assert_eq(kvd_http_get(&d, "/metrics", body, sizeof body), 200);
    const char *o = strstr(body, "\nkvtier_remote_oversized_values_total ");
    cr_assert(o);
    cr_expect_geq(strtod(o + strlen("\nkvtier_remote_oversized_values_total "), NULL), 1);
    cr_expect(strstr(body, "\nkvtier_remote_disconnects_total 0\n"), "the connection stayed");
    cr_expect_eq(kvt_client_ping(c, NULL), 0);
    free(tok);
    kvt_client_close(c);
    kvd_cleanup(&d);
}

/*
 * A PUT's page that NVMe takes but cannot place (every full segment of its log pinned by a lease,
 * while there are bytes to spare) goes on to the next tier instead of being skipped: NVMe answers
 * such a write "try again" (KVT_EAGAIN), now or from its queue, and the page lands in Redis.
 */
Test(server_remote, pages_nvme_cannot_place_go_on_to_redis)
{
    const char *addr = kvd_redis();
    char pfx[64];
    prefix(pfx, sizeof pfx);
    kvd_t d = {0};
    /* No maintenance (watermarks at 100%): NVMe keeps what it took. */
    kvd_start(&d, "--policy", "lru", "--policy-high", "1", "--policy-low", "1", "--dram-bytes", "0",
              "--nvme-bytes", "2M", "--nvme-segment-bytes", "1M", "--remote", addr,
              "--remote-prefix", pfx, "--remote-bytes", "64M", NULL);
    kvt_client_t *c = kvd_client(&d, "m", PAGE, BB);
    /* One-page prompts into NVMe until it takes no more (the next one lands in Redis). Looked
     * at through STATS: a MATCH that hit Redis would promote, moving NVMe's pages around. */
    enum { MAXN = 400 };
    static uint32_t tok[MAXN][PAGE];
    kvt_client_match_t m = {0};
    kvt_client_put_t r;
    int n = 0;
    for (; n < MAXN && kvd_stat(c, "remote_blocks") == 0; n++) {
        kvd_tokens(tok[n], PAGE, 100000u * (n + 1));
        put_all(c, tok[n], 1, 1000 + n, &r);
        cr_assert_eq(r.stored, 1);
    }
    cr_assert_lt(n, MAXN, "NVMe never filled");
    n--; /* the last one is in Redis */
    /* Every eighth one leased (both segments pinned), the others removed: bytes to spare, but
     * no segment the log may reclaim. */
    uint64_t leases[MAXN / 8 + 1];
    int nl = 0;
    for (int i = 0; i < n; i++) {
        if (i % 8 == 0) {
            cr_assert_eq(kvt_client_match(c, tok[i], PAGE, KVT_CLIENT_LEASE, 0, NULL, &m), 0);
            leases[nl++] = m.lease;
        } else {
            int rc = kvt_client_remove(c, tok[i], PAGE);
            cr_assert_eq(rc, 0, "remove %d of %d: %d %s", i, n, rc, kvt_client_errmsg(c));
        }
    }
    cr_assert_lt(kvd_stat(c, "nvme_used_bytes"), kvd_stat(c, "nvme_capacity_bytes") / 2);
    enum { CP = 56 }; /* more than a segment holds: some need a segment the log cannot reclaim */
    uint32_t ctok[CP * PAGE];
    kvd_tokens(ctok, CP * PAGE, 77000000);
    put_all(c, ctok, CP, 9000, &r);
    cr_expect_eq(r.stored, CP, "every page stored (stored %u, skipped %u)", r.stored, r.skipped);
    uint8_t tiers[CP], from[CP];
    m = (kvt_client_match_t){.tiers = tiers, .tiers_cap = CP};
    cr_assert_eq(kvt_client_match(c, ctok, CP * PAGE, KVT_CLIENT_LEASE, 0, NULL, &m), 0);
    cr_assert_eq(m.pages, CP);
    int in_redis = 0;
    for (int i = 0; i < CP; i++)
        in_redis += tiers[i] == KVT_CLIENT_TIER_REMOTE;
    cr_expect_gt(in_redis, 0, "NVMe could not place them: they went on to Redis");
    get_all(c, m.lease, CP, 9000, from);
    for (int i = 0; i < nl; i++)
        cr_assert_eq(kvt_client_release(c, leases[i], NULL), 0);
    kvt_client_close(c);
    kvd_cleanup(&d);
}

/*
 * With the remote tier down, NVMe past its high watermark demotes into it, and those moves fail
 * (then pause: server/exec.c, after which the policy drops what it cannot demote). A REMOVE waits
 * for moves on its prefix only so long (it used to wait up to lease-ms, 30 s, past the client's
 * own 10 s timeout): it is answered, removed, EBUSY or ENOENT (dropped meanwhile), and the
 * connection goes on.
 */
Test(server_remote, remove_is_answered_while_demotions_to_a_dead_remote_fail)
{
    kvd_t d = {0};
    kvd_start(&d, "--policy", "lru", "--dram-bytes", "0", "--nvme-bytes", "2M",
              "--nvme-segment-bytes", "1M", "--policy-high", "0.5", "--policy-low", "0.25",
              "--remote", "127.0.0.1:1", NULL);
    kvt_client_t *c = kvd_client(&d, "m", PAGE, BB);
    enum { N = 8, P = 12 };
    static uint32_t tok[N][P * PAGE];
    kvt_client_put_t r;
    for (int k = 0; k < N; k++) {
        kvd_tokens(tok[k], P * PAGE, 1000000u * (k + 1));
        put_all(c, tok[k], P, 100 * k, &r);
    }
    usleep(200000); /* the failing demotions are under way */
    for (int k = 0; k < N; k++) {
        int rc = kvt_client_remove(c, tok[k], PAGE);
        cr_assert(rc == 0 || rc == KVT_CLIENT_EBUSY || rc == KVT_CLIENT_ENOENT, "remove %d: %d %s",
                  k, rc, kvt_client_errmsg(c));
    }
    cr_expect_eq(kvt_client_ping(c, NULL), 0, "the connection goes on");
    kvt_client_close(c);
    kvd_cleanup(&d);
}

/* Two daemons on the test's redis-server under a key prefix of their own: a keeps nothing
 * locally (every block it stores goes to the shared server), b has the default tiers. */
static void two_daemons_one_remote(kvd_t *a, kvd_t *b)
{
    const char *addr = kvd_redis();
    char pfx[64];
    prefix(pfx, sizeof pfx);
    kvd_start(a, "--dram-bytes", "0", "--nvme-bytes", "0", "--remote", addr, "--remote-prefix", pfx,
              NULL);
    kvd_start(b, "--remote", addr, "--remote-prefix", pfx, NULL);
}

Test(server_remote, second_daemon_finds_the_first_ones_prefix)
{
    kvd_t a = {0}, b = {0};
    two_daemons_one_remote(&a, &b);
    kvt_client_t *ca = kvd_client(&a, "shared-model", PAGE, BB);
    kvt_client_t *cb = kvd_client(&b, "shared-model", PAGE, BB);
    uint32_t tok[12 * PAGE];
    kvd_tokens(tok, 12 * PAGE, 3);
    kvt_client_put_t r;
    put_all(ca, tok, 8, 40, &r); /* pages 0..7 by a */
    cr_assert_eq(r.stored, 8);

    uint8_t tiers[12], from[12];
    kvt_client_match_t m = {.tiers = tiers, .tiers_cap = 12};
    cr_assert_eq(kvt_client_match(cb, tok, 12 * PAGE, 0, 0, NULL, &m), 0);
    cr_expect_eq(m.pages, 0, "without the probe b knows nothing");
    /* PROBE (only look, not a use): a use would queue the path's promotion, which a lease does
     * not hold back, and the GET below could then race it and read DRAM instead of redis. The
     * lookups of the loop after it are the uses that promote. */
    cr_assert_eq(kvt_client_match(cb, tok, 12 * PAGE,
                                  KVT_CLIENT_LEASE | KVT_CLIENT_REMOTE | KVT_CLIENT_PROBE, 0, NULL,
                                  &m),
                 0);
    cr_expect_eq(m.pages, 8, "the probe finds a's 8 pages, not the 4 nobody stored");
    cr_expect_eq(m.remote_pages, 8);
    cr_expect_eq(tiers[0], KVT_CLIENT_TIER_REMOTE);
    get_all(cb, m.lease, 8, 40, from);
    cr_expect_eq(from[0], KVT_CLIENT_TIER_REMOTE);
    /* Hit remote, the blocks move up into b's DRAM (asynchronously: poll up to 5 s). */
    for (int i = 0; i < 1000; i++) {
        cr_assert_eq(kvt_client_match(cb, tok, 12 * PAGE, 0, 0, NULL, &m), 0);
        if (m.pages == 8 && tiers[0] == KVT_CLIENT_TIER_DRAM && tiers[7] == KVT_CLIENT_TIER_DRAM)
            break;
        usleep(5000);
    }
    cr_assert_eq(kvt_client_match(cb, tok, 12 * PAGE, KVT_CLIENT_LEASE, 0, NULL, &m), 0);
    cr_expect_eq(m.pages, 8);
    cr_expect_eq(tiers[7], KVT_CLIENT_TIER_DRAM);
    get_all(cb, m.lease, 8, 40, from);
    kvt_client_close(ca);
    kvt_client_close(cb);
    kvd_cleanup(&a);
    kvd_cleanup(&b);
}

/* A daemon whose share of the server is full takes a run of found blocks larger than its
 * watermarks' headroom, dropping its own least valuable remote blocks for them, and reads them
 * back byte-exact. Before, adopting them was refused as a whole: MATCH reported them found but
 * index-only, every time. */
Test(server_remote, a_full_remote_tier_takes_the_blocks_a_probe_finds)
{
    const char *addr = kvd_redis();
    char pfx[64];
    prefix(pfx, sizeof pfx);
    kvd_t a = {0}, b = {0};
    kvd_start(&a, "--dram-bytes", "0", "--nvme-bytes", "0", "--remote", addr, "--remote-prefix",
              pfx, NULL);
    kvd_start(&b, "--dram-bytes", "0", "--nvme-bytes", "0", "--remote", addr, "--remote-prefix",
              pfx, "--remote-bytes", "1M", "--policy", "lru", NULL);
    kvt_client_t *ca = kvd_client(&a, "shared-model", PAGE, BB);
    kvt_client_t *cb = kvd_client(&b, "shared-model", PAGE, BB);
    enum { P = 32, OWN = 5 };
    static uint32_t tok[P * PAGE], own[OWN][16 * PAGE];
    kvd_tokens(tok, P * PAGE, 77);
    kvt_client_put_t r;
    put_all(ca, tok, P, 900, &r);
    cr_assert_eq(r.stored, P);
    for (int k = 0; k < OWN; k++) { /* b's own 80 pages into its 1 MiB: full */
        kvd_tokens(own[k], 16 * PAGE, 1000 + (uint32_t)k);
        put_all(cb, own[k], 16, 100 * (uint32_t)k, &r);
    }
    cr_assert_geq(kvd_stat(cb, "remote_used_bytes"), kvd_stat(cb, "remote_capacity_bytes") * 8 / 10,
                  "b's remote share is full");
    uint8_t tiers[P], from[P];
    kvt_client_match_t m = {.tiers = tiers, .tiers_cap = P};
    cr_assert_eq(kvt_client_match(cb, tok, P * PAGE,
                                  KVT_CLIENT_LEASE | KVT_CLIENT_REMOTE | KVT_CLIENT_PROBE, 0, NULL,
                                  &m),
                 0);
    cr_expect_eq(m.remote_pages, P);
    for (int p = 0; p < P; p++)
        cr_expect_eq(tiers[p], KVT_CLIENT_TIER_REMOTE, "page %d held by the remote tier", p);
    get_all(cb, m.lease, P, 900, from);
    cr_expect_eq(from[P - 1], KVT_CLIENT_TIER_REMOTE);
    cr_assert_leq(kvd_stat(cb, "remote_used_bytes"), kvd_stat(cb, "remote_capacity_bytes"));
    kvt_client_close(ca);
    kvt_client_close(cb);
    kvd_cleanup(&a);
    kvd_cleanup(&b);
}

/* A HELLO frame for model with the given page and block size, at out; returns its length. */
static size_t hello_frame(uint8_t *out, uint64_t id, const char *model, uint32_t page, uint32_t bb)
{
    kvt_wire_hello_t w = {.min_version = 1,
                          .max_version = 1,
                          .page_size = page,
                          .block_bytes = bb,
                          .model_len = (uint16_t)strlen(model)};
    kvt_proto_frame(out, KVT_OP_HELLO, 0, id, 0, (uint32_t)(sizeof w + w.model_len));
    memcpy(out + KVT_PROTO_HDR, &w, sizeof w);
    memcpy(out + KVT_PROTO_HDR + sizeof w, model, w.model_len);
    return KVT_PROTO_HDR + sizeof w + w.model_len;
}

/*
 * A MATCH whose remote probe is still out when the next frame, a HELLO, switches the connection
 * to a namespace with a far bigger page: the probe's answer is the first namespace's, in its
 * pages. The daemon took the page size from the connection when the answer came, so it inserted
 * 8 x 1,024 tokens from the request's 192 (reading past its buffer: found by a fuzzer under
 * ASan) and answered 8,192 matched tokens.
 */
Test(server_remote, a_probe_answers_in_the_namespace_it_was_asked_in)
{
    kvd_t a = {0}, b = {0};
    two_daemons_one_remote(&a, &b);
    kvt_client_t *ca = kvd_client(&a, "shared-model", PAGE, BB);
    uint32_t tok[12 * PAGE];
    kvd_tokens(tok, 12 * PAGE, 5);
    kvt_client_put_t r;
    put_all(ca, tok, 8, 60, &r);
    cr_assert_eq(r.stored, 8);

    /* HELLO, MATCH with the remote probe, HELLO to another namespace: one write. PROBE (only
     * look): a use would queue the path's promotion to DRAM, and the tiers are checked below. */
    static uint8_t out[4096];
    size_t n = hello_frame(out, 1, "shared-model", PAGE, BB);
    kvt_wire_match_t mw = {.ntokens = 12 * PAGE};
    kvt_proto_frame(out + n, KVT_OP_MATCH, KVT_MATCH_F_REMOTE | KVT_MATCH_F_PROBE, 2, 0,
                    (uint32_t)(sizeof mw + sizeof tok));
    memcpy(out + n + KVT_PROTO_HDR, &mw, sizeof mw);
    for (uint32_t i = 0; i < 12 * PAGE; i++)
        kvt_put_u32(out + n + KVT_PROTO_HDR + sizeof mw + 4 * i, tok[i]);
    n += KVT_PROTO_HDR + sizeof mw + sizeof tok;
    n += hello_frame(out + n, 3, "other-model", 1024, 0);
    int fd = kvd_raw(&b);
    cr_assert_eq(write(fd, out, n), (ssize_t)n);
    uint8_t in[4096];
    for (uint64_t id = 1; id <= 3; id++) {
        uint8_t hdr[KVT_PROTO_HDR];
        cr_assert_eq(recv(fd, hdr, sizeof hdr, MSG_WAITALL), (ssize_t)sizeof hdr);
        kvt_proto_hdr_t h;
        kvt_proto_hdr_decode(hdr, &h);
        cr_assert_eq(h.request_id, id);
        cr_assert_eq(h.status, 0, "request %llu: status %d", (unsigned long long)id, h.status);
        cr_assert_leq(h.body_len, sizeof in);
        cr_assert_eq(recv(fd, in, h.body_len, MSG_WAITALL), (ssize_t)h.body_len);
        if (id == 2) {
            kvt_wire_match_reply_t mr;
            memcpy(&mr, in, sizeof mr);
            cr_expect_eq(mr.pages, 8);
            cr_expect_eq(mr.remote_pages, 8);
            cr_expect_eq(mr.tokens, 8 * PAGE, "matched tokens %u", mr.tokens);
        }
    }
    close(fd);
    /* b's index holds the 8 pages in the first namespace, as remote blocks, and reads them. */
    kvt_client_t *cb = kvd_client(&b, "shared-model", PAGE, BB);
    uint8_t tiers[12];
    kvt_client_match_t m = {.tiers = tiers, .tiers_cap = 12};
    cr_assert_eq(
        kvt_client_match(cb, tok, 12 * PAGE, KVT_CLIENT_LEASE | KVT_CLIENT_PROBE, 0, NULL, &m), 0);
    cr_assert_eq(m.pages, 8);
    cr_expect_eq(tiers[7], KVT_CLIENT_TIER_REMOTE);
    get_all(cb, m.lease, 8, 60, NULL);
    kvt_client_close(ca);
    kvt_client_close(cb);
    kvd_cleanup(&a);
    kvd_cleanup(&b);
}

/* Serves one RESP connection of a Redis that stores nothing: every GET is answered with an
 * integer, everything else with +OK (+PONG for PING); or, with exists_ms, every EXISTS with 1
 * after exists_ms (a slow server that has every key). In a child process. */
static void lying_redis_conn(int fd, int exists_ms)
{
    static char buf[1 << 20];
    size_t len = 0;
    for (;;) {
        ssize_t n = read(fd, buf + len, sizeof buf - len);
        if (n <= 0)
            return;
        len += (size_t)n;
        size_t off = 0;
        for (;;) { /* whole commands: *N then N bulk strings */
            char *p = buf + off, *end = buf + len, *nl;
            if (p >= end || *p != '*' || !(nl = memchr(p, '\n', (size_t)(end - p))))
                break;
            long argc = strtol(p + 1, NULL, 10), i;
            char verb[16] = "";
            p = nl + 1;
            for (i = 0; i < argc; i++) {
                if (p >= end || !(nl = memchr(p, '\n', (size_t)(end - p))))
                    break;
                long l = strtol(p + 1, NULL, 10);
                if (nl + 1 + l + 2 > end)
                    break;
                if (i == 0)
                    snprintf(verb, sizeof verb, "%.*s", (int)KVT_MIN(l, 15), nl + 1);
                p = nl + 1 + l + 2;
            }
            if (i < argc)
                break;
            off = (size_t)(p - buf);
            int exists = exists_ms && !strcasecmp(verb, "EXISTS");
            const char *reply = !strcasecmp(verb, "GET") || exists ? ":1\r\n"
                                : !strcasecmp(verb, "PING")        ? "+PONG\r\n"
                                                                   : "+OK\r\n";
            if (exists)
                usleep((useconds_t)exists_ms * 1000);
            if (write(fd, reply, strlen(reply)) < 0)
                return;
        }
        memmove(buf, buf + off, len - off);
        len -= off;
    }
}

/* Starts the fake server on a free loopback port; addr gets its host:port. */
static pid_t lying_redis(char *addr, size_t cap, int exists_ms)
{
    int lfd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sin = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t sl = sizeof sin;
    cr_assert(lfd >= 0 && bind(lfd, (struct sockaddr *)&sin, sizeof sin) == 0 &&
              listen(lfd, 8) == 0 && getsockname(lfd, (struct sockaddr *)&sin, &sl) == 0);
    snprintf(addr, cap, "127.0.0.1:%u", ntohs(sin.sin_port));
    pid_t pid = fork();
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        for (;;) {
            int fd = accept(lfd, NULL, NULL);
            if (fd >= 0) {
                lying_redis_conn(fd, exists_ms);
                close(fd);
            }
        }
    }
    close(lfd);
    cr_assert(pid > 0);
    return pid;
}

/*
 * A remote server whose GET answers are of the wrong type (a proxy or a broken server): the GET
 * of those pages fails with EIO, a failed tier I/O, and not with the remote tier's own EPROTO,
 * which a client reads as "your frame was malformed". No redis-server needed.
 */
Test(server_remote, a_malformed_remote_answer_is_a_failed_read)
{
    char addr[64];
    pid_t liar = lying_redis(addr, sizeof addr, 0);
    kvd_t d = {0};
    kvd_start(&d, "--dram-bytes", "0", "--nvme-bytes", "0", "--remote", addr, NULL);
    kvt_client_t *c = kvd_client(&d, "m", PAGE, BB);
    uint32_t tok[2 * PAGE];
    kvd_tokens(tok, 2 * PAGE, 11);
    kvt_client_put_t r;
    put_all(c, tok, 2, 1, &r);
    cr_assert_eq(r.stored, 2, "the liar answers SET with +OK");
    uint8_t tiers[2];
    kvt_client_match_t m = {.tiers = tiers, .tiers_cap = 2};
    cr_assert_eq(kvt_client_match(c, tok, 2 * PAGE, KVT_CLIENT_LEASE, 0, NULL, &m), 0);
    cr_assert_eq(m.pages, 2);
    cr_expect_eq(tiers[0], KVT_CLIENT_TIER_REMOTE);
    uint8_t *buf = malloc(2 * BB);
    uint32_t got = 9;
    int rc = kvt_client_get(c, m.lease, 0, 2, buf, 2 * BB, &got, NULL);
    cr_expect_eq(rc, KVT_CLIENT_EIO, "GET: %s (%s)", kvt_client_strerror(rc), kvt_client_errmsg(c));
    cr_expect_eq(got, 0);
    cr_assert_eq(kvt_client_ping(c, NULL), 0, "the connection goes on");
    free(buf);
    kvt_client_close(c);
    kvd_cleanup(&d);
    kill(liar, SIGKILL);
    waitpid(liar, NULL, 0);
}

/* Reads one reply frame of fd into body (at most cap bytes); returns its status. */
static int raw_reply(int fd, uint8_t *body, uint32_t cap, uint32_t *len)
{
    uint8_t hdr[KVT_PROTO_HDR];
    kvt_proto_hdr_t h;
    for (size_t got = 0; got < sizeof hdr;) {
        ssize_t n = read(fd, hdr + got, sizeof hdr - got);
        cr_assert(n > 0, "reply header: %s", n < 0 ? strerror(errno) : "closed");
        got += (size_t)n;
    }
    kvt_proto_hdr_decode(hdr, &h);
    cr_assert_leq(h.body_len, cap);
    for (size_t got = 0; got < h.body_len;) {
        ssize_t n = read(fd, body + got, h.body_len - got);
        cr_assert(n > 0);
        got += (size_t)n;
    }
    *len = h.body_len;
    return h.status;
}

/* A HELLO frame for model m (one letter) at out; returns its length. */
static size_t raw_hello_frame(uint8_t *out, char m, uint64_t id)
{
    kvt_wire_hello_t hw = {
        .min_version = 1, .max_version = 1, .page_size = PAGE, .block_bytes = BB, .model_len = 1};
    kvt_proto_frame(out, KVT_OP_HELLO, 0, id, 0, sizeof hw + 1);
    memcpy(out + KVT_PROTO_HDR, &hw, sizeof hw);
    out[KVT_PROTO_HDR + sizeof hw] = (uint8_t)m;
    return KVT_PROTO_HDR + sizeof hw + 1;
}

/*
 * A remote probe in flight keeps its namespace open: a connection declares x, asks a slow remote
 * server for a prompt (every key exists there, each answer 200 ms late) and switches to y at once.
 * With max-namespaces 2, another client's HELLO of z is refused while the probe runs (x is empty
 * but the probe names it), so the 4 pages found remote join x, not whatever took x's id; once the
 * connection is gone, y (empty, unused) is closed for z, which starts empty. (A probe held nothing
 * open at first: x was closed under it, z took its id, and z found x's pages.)
 */
Test(server_remote, a_probe_in_flight_keeps_its_namespace_open)
{
    char addr[64];
    pid_t slow = lying_redis(addr, sizeof addr, 200);
    kvd_t d = {0};
    kvd_start(&d, "--max-namespaces", "2", "--nvme-bytes", "0", "--remote", addr, NULL);
    uint32_t tok[4 * PAGE];
    kvd_tokens(tok, 4 * PAGE, 21);
    static uint8_t f[3 * (KVT_PROTO_HDR + 64) + sizeof(kvt_wire_match_t) + sizeof tok];
    size_t len = raw_hello_frame(f, 'x', 1);
    kvt_wire_match_t mw = {.ntokens = 4 * PAGE};
    kvt_proto_frame(f + len, KVT_OP_MATCH, KVT_MATCH_F_REMOTE, 2, 0, sizeof mw + sizeof tok);
    memcpy(f + len + KVT_PROTO_HDR, &mw, sizeof mw);
    memcpy(f + len + KVT_PROTO_HDR + sizeof mw, tok, sizeof tok);
    len += KVT_PROTO_HDR + sizeof mw + sizeof tok;
    len += raw_hello_frame(f + len, 'y', 3);
    int fd = kvd_raw(&d);
    uint8_t body[256];
    uint32_t blen;
    static char text[1 << 18];
    for (int i = 0; i < 200; i++) { /* until the handshake with the slow server is done */
        cr_assert_eq(kvd_http_get(&d, "/metrics", text, sizeof text), 200);
        if (strstr(text, "\nkvtier_remote_connects_total 1"))
            break;
        usleep(10000);
    }
    cr_assert(strstr(text, "\nkvtier_remote_connects_total 1"), "the daemon reached the server");
    cr_assert(write(fd, f, len) == (ssize_t)len);
    cr_assert_eq(raw_reply(fd, body, sizeof body, &blen), 0, "HELLO x");
    for (int i = 0; i < 200; i++) { /* until the daemon has read the second HELLO: x and y */
        cr_assert_eq(kvd_http_get(&d, "/metrics", text, sizeof text), 200);
        if (strstr(text, "\nkvtier_namespaces 2"))
            break;
        usleep(10000);
    }
    kvt_client_t *z = NULL;
    kvt_client_conf_t zc = {
        .unix_path = d.sock, .model = "z", .page_size = PAGE, .block_bytes = BB};
    cr_assert_eq(kvt_client_connect(&z, &zc), KVT_CLIENT_ENOSPC, "x is held by the probe");
    cr_assert_eq(raw_reply(fd, body, sizeof body, &blen), 0, "MATCH");
    kvt_wire_match_reply_t mr;
    memcpy(&mr, body, sizeof mr);
    cr_expect_eq(le32toh(mr.pages), 4);
    cr_expect_eq(le32toh(mr.remote_pages), 4, "the slow server has them all");
    cr_assert_eq(raw_reply(fd, body, sizeof body, &blen), 0, "HELLO y");
    close(fd);
    int rc = -1;
    for (int i = 0; i < 200 && rc < 0; i++)
        if ((rc = kvt_client_connect(&z, &zc)) < 0)
            usleep(10000);
    cr_assert_eq(rc, 0, "y is closed for z: %s", kvt_client_strerror(rc));
    kvt_client_match_t q = {0};
    cr_assert_eq(kvt_client_match(z, tok, 4 * PAGE, 0, 0, NULL, &q), 0);
    cr_expect_eq(q.pages, 0, "z starts empty: x's pages stayed in x");
    kvt_client_close(z);
    kvd_cleanup(&d);
    kill(slow, SIGKILL);
    waitpid(slow, NULL, 0);
}

Test(server_remote, remote_down_is_a_counted_miss)
{
    kvd_t d = {0};
    /* Port 1 on loopback: nothing listens there. */
    kvd_start(&d, "--remote", "127.0.0.1:1", NULL);
    kvt_client_t *c = kvd_client(&d, "m", PAGE, BB);
    uint32_t tok[4 * PAGE];
    kvd_tokens(tok, 4 * PAGE, 9);
    kvt_client_match_t m = {0};
    cr_assert_eq(kvt_client_match(c, tok, 4 * PAGE, KVT_CLIENT_REMOTE, 0, NULL, &m), 0);
    cr_expect_eq(m.pages, 0);
    static char body[1 << 20];
    cr_assert_eq(kvd_http_get(&d, "/metrics", body, sizeof body), 200);
    cr_expect(strstr(body, "kvtier_miss_tokens_total{reason=\"remote_unreachable\"} 64"), "%s",
              strstr(body, "kvtier_miss_tokens_total") ? strstr(body, "kvtier_miss_tokens_total")
                                                       : body);
    kvt_client_close(c);
    kvd_cleanup(&d);
}

/* A redis-server of this test's own (the shared one must not be paused under other tests), on a
 * free loopback port; *port gets it. Skips without a redis-server binary. */
static pid_t own_redis(char *dir, size_t dlen, uint16_t *port)
{
    int s = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t l = sizeof a;
    cr_assert(s >= 0 && bind(s, (struct sockaddr *)&a, sizeof a) == 0 &&
              getsockname(s, (struct sockaddr *)&a, &l) == 0);
    close(s);
    *port = ntohs(a.sin_port);
    const char *tmp = getenv("TMPDIR");
    snprintf(dir, dlen, "%s/kvt-redis-XXXXXX", tmp && *tmp ? tmp : "/tmp");
    cr_assert(mkdtemp(dir));
    const char *bin = getenv("KVT_REDIS_SERVER") ? getenv("KVT_REDIS_SERVER") : "redis-server";
    char ps[16];
    snprintf(ps, sizeof ps, "%u", *port);
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        int fd = open("/dev/null", O_WRONLY);
        if (fd >= 0) {
            dup2(fd, 1);
            dup2(fd, 2);
        }
        execlp(bin, bin, "--port", ps, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
               "--dir", dir, (char *)NULL);
        _exit(127);
    }
    for (int i = 0; i < 500; i++) { /* up to 5 s for it to listen */
        int c = socket(AF_INET, SOCK_STREAM, 0);
        int ok = connect(c, (struct sockaddr *)&a, sizeof a) == 0;
        close(c);
        if (ok)
            return pid;
        int st;
        if (waitpid(pid, &st, WNOHANG) == pid)
            cr_skip_test("no redis-server to start (%s)", bin);
        usleep(10000);
    }
    cr_assert_fail("redis-server did not start");
    return -1;
}

/* Kills an own_redis server and removes its directory. */
static void own_redis_stop(pid_t pid, const char *dir)
{
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    kvd_rmrf(dir);
}

/* Two daemons on a redis-server of the test's own (which a test may pause): a keeps its blocks
 * there only, b (a DRAM tier, remote-timeout-ms timeout_ms) learns of them by its remote probe. */
typedef struct remote_pair {
    char dir[512];
    pid_t redis;
    kvd_t a, b;
    kvt_client_t *ca, *cb;
} remote_pair_t;

static void pair_start(remote_pair_t *p, const char *timeout_ms)
{
    char addr[64], pfx[64];
    uint16_t port;
    memset(p, 0, sizeof *p);
    p->redis = own_redis(p->dir, sizeof p->dir, &port);
    snprintf(addr, sizeof addr, "127.0.0.1:%u", port);
    prefix(pfx, sizeof pfx);
    kvd_start(&p->a, "--dram-bytes", "0", "--nvme-bytes", "0", "--remote", addr, "--remote-prefix",
              pfx, NULL);
    kvd_start(&p->b, "--nvme-bytes", "0", "--remote", addr, "--remote-prefix", pfx,
              "--remote-timeout-ms", timeout_ms, NULL);
    p->ca = kvd_client(&p->a, "m", PAGE, BB);
    p->cb = kvd_client(&p->b, "m", PAGE, BB);
}

static void pair_stop(remote_pair_t *p)
{
    kvt_client_close(p->ca);
    kvt_client_close(p->cb);
    kvd_cleanup(&p->a);
    kvd_cleanup(&p->b);
    own_redis_stop(p->redis, p->dir);
}

/*
 * PREFETCHes answered at their deadline while their moves still run (the remote tier paused, so
 * reads from it hang until its timeout): each goes on as an orphan, and its moves used to stay
 * counted against the connection, which stopped reading for good once 64 had piled up. 80 of
 * them, then the connection is still served.
 */
Test(server_remote, prefetches_answered_at_their_deadline_leave_the_connection_free)
{
    enum { N = 80 };
    remote_pair_t p;
    pair_start(&p, "3000");
    kvt_client_t *ca = p.ca, *cb = p.cb;
    static uint32_t tok[N][PAGE];
    kvt_client_put_t r;
    for (int k = 0; k < N; k++) {
        kvd_tokens(tok[k], PAGE, 7000000u + 1000u * (uint32_t)k);
        put_all(ca, tok[k], 1, (uint32_t)k, &r);
        cr_assert_eq(r.stored, 1);
        kvt_client_match_t m = {0};
        cr_assert_eq(
            kvt_client_match(cb, tok[k], PAGE, KVT_CLIENT_REMOTE | KVT_CLIENT_PROBE, 0, NULL, &m),
            0);
        cr_assert_eq(m.remote_pages, 1, "b learns of prompt %d from the server", k);
    }
    kill(p.redis, SIGSTOP);
    for (int k = 0; k < N; k++) {
        kvt_client_prefetch_t pr;
        int rc = kvt_client_prefetch(cb, tok[k], PAGE, KVT_CLIENT_TIER_DRAM, 5, &pr);
        cr_assert(rc == 0 || rc == KVT_CLIENT_ETIMEDOUT || rc == KVT_CLIENT_EUNAVAIL,
                  "prefetch %d: %s %s", k, kvt_client_strerror(rc), kvt_client_errmsg(cb));
    }
    cr_expect_eq(kvt_client_ping(cb, NULL), 0, "the connection is still read");
    kill(p.redis, SIGCONT);
    pair_stop(&p);
}

/*
 * A PREFETCH with START is answered as soon as its moves have started, so that it holds up no
 * reply behind it on the connection: with the remote server paused, a PREFETCH of pages only it
 * holds is answered at once (all of them on their way), and a PING behind it too, where one
 * without START waits until its pages land or its deadline. A REMOVE of those busy pages with
 * NOWAIT is EBUSY at once, where one without it waits a second first. Once the server goes on,
 * the pages land in DRAM and read back byte-exact.
 */
Test(server_remote, a_started_prefetch_or_nowait_remove_holds_up_no_reply)
{
    enum { P = 4 };
    remote_pair_t p;
    pair_start(&p, "30000");
    kvt_client_t *ca = p.ca, *cb = p.cb;
    uint32_t tok[P * PAGE];
    kvd_tokens(tok, P * PAGE, 8100000);
    kvt_client_put_t r;
    put_all(ca, tok, P, 500, &r);
    cr_assert_eq(r.stored, P);
    uint8_t tiers[P];
    kvt_client_match_t m = {.tiers = tiers, .tiers_cap = P};
    cr_assert_eq(
        kvt_client_match(cb, tok, P * PAGE, KVT_CLIENT_REMOTE | KVT_CLIENT_PROBE, 0, NULL, &m), 0);
    cr_assert_eq(m.remote_pages, P, "b learns of the prompt from the server");

    kill(p.redis, SIGSTOP);
    unsigned long long t0 = now_ns_test();
    kvt_client_prefetch_t pr = {0};
    int rc = kvt_client_prefetch_start(cb, tok, P * PAGE, KVT_CLIENT_TIER_DRAM, 20000, &pr);
    cr_assert_eq(rc, 0, "%s %s", kvt_client_strerror(rc), kvt_client_errmsg(cb));
    cr_expect_eq(kvt_client_ping(cb, NULL), 0);
    double waited = (double)(now_ns_test() - t0) / 1e9;
    cr_expect_lt(waited, 5.0, "answered with the reads still hanging (%.2f s)", waited);
    cr_expect_eq(pr.pages, P);
    cr_expect_eq(pr.moved, P, "all on their way");
    cr_expect_eq(pr.resident, 0);
    cr_expect_eq(pr.failed, 0);
    m = (kvt_client_match_t){.tiers = tiers, .tiers_cap = P};
    cr_assert_eq(kvt_client_match(cb, tok, P * PAGE, KVT_CLIENT_PROBE, 0, NULL, &m), 0);
    cr_expect_eq(tiers[0], KVT_CLIENT_TIER_REMOTE, "still on their way");
    /* A REMOVE of pages busy with those moves: NOWAIT answers EBUSY at once; without it the
     * REMOVE (and the PING behind it) waits its second for the moves, then EBUSY. */
    t0 = now_ns_test();
    cr_expect_eq(kvt_client_remove_nowait(cb, tok, P * PAGE), KVT_CLIENT_EBUSY);
    cr_expect(strstr(kvt_client_errmsg(cb), "NOWAIT"), "%s", kvt_client_errmsg(cb));
    cr_expect_eq(kvt_client_ping(cb, NULL), 0);
    double nowait = (double)(now_ns_test() - t0) / 1e9;
    t0 = now_ns_test();
    cr_expect_eq(kvt_client_remove(cb, tok, P * PAGE), KVT_CLIENT_EBUSY);
    cr_expect_eq(kvt_client_ping(cb, NULL), 0);
    double waited_remove = (double)(now_ns_test() - t0) / 1e9;
    cr_expect_lt(nowait, 0.5, "NOWAIT answered in %.2f s", nowait);
    cr_expect_geq(waited_remove, 0.9, "the REMOVE waited %.2f s", waited_remove);

    kill(p.redis, SIGCONT);
    int up = 0;
    for (int i = 0; i < 1000 && !up; i++) {
        m = (kvt_client_match_t){.tiers = tiers, .tiers_cap = P};
        cr_assert_eq(kvt_client_match(cb, tok, P * PAGE, KVT_CLIENT_PROBE, 0, NULL, &m), 0);
        up = m.pages == P;
        for (int k = 0; k < P; k++)
            up &= tiers[k] == KVT_CLIENT_TIER_DRAM;
        if (!up)
            usleep(10000);
    }
    cr_expect(up, "the pages landed in DRAM");
    m = (kvt_client_match_t){.tiers = tiers, .tiers_cap = P};
    cr_assert_eq(kvt_client_match(cb, tok, P * PAGE, KVT_CLIENT_LEASE, 0, NULL, &m), 0);
    uint8_t from[P];
    get_all(cb, m.lease, P, 500, from);
    for (int k = 0; k < P; k++)
        cr_expect_eq(from[k], KVT_CLIENT_TIER_DRAM, "page %d read from tier %u", k, from[k]);
    pair_stop(&p);
}

/* The value of one unlabelled series of a /metrics scrape; -1 when absent. */
static double scraped(const kvd_t *d, const char *series)
{
    static char text[1 << 20];
    cr_assert_eq(kvd_http_get(d, "/metrics", text, sizeof text), 200);
    char key[128];
    snprintf(key, sizeof key, "\n%s ", series);
    const char *p = strstr(text, key);
    return p ? strtod(p + strlen(key), NULL) : -1;
}

/* kvtier_remote_up, what the remote-tier-down alert (ops/prometheus) watches: 1 while the daemon's
 * connection to its remote server is up, 0 within a second or two of the server dying, and 0 for
 * a daemon with no remote tier. */
Test(server_remote, remote_up_follows_the_server)
{
    char dir[512], addr[64];
    uint16_t port;
    pid_t redis = own_redis(dir, sizeof dir, &port);
    snprintf(addr, sizeof addr, "127.0.0.1:%u", port);
    kvd_t d = {0}, none = {0};
    kvd_start(&d, "--nvme-bytes", "0", "--remote", addr, "--tick-ms", "20", NULL);
    kvd_start(&none, "--nvme-bytes", "0", NULL);
    double up = -1;
    for (int i = 0; i < 100 && (up = scraped(&d, "kvtier_remote_up")) != 1; i++)
        usleep(20000);
    cr_expect_eq(up, 1, "connected to the remote server");
    cr_expect_eq(scraped(&none, "kvtier_remote_up"), 0, "no remote tier");
    kill(redis, SIGKILL);
    waitpid(redis, NULL, 0);
    for (int i = 0; i < 150 && (up = scraped(&d, "kvtier_remote_up")) != 0; i++)
        usleep(20000);
    cr_expect_eq(up, 0, "the remote server is gone");
    kvd_cleanup(&d);
    kvd_cleanup(&none);
    kvd_rmrf(dir);
}

/* The integer reply of a one-word command (DBSIZE) from the redis-server on port, over a plain
 * socket: this file links no hiredis. */
static long long redis_int(uint16_t port, const char *cmd)
{
    int s = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {
        .sin_family = AF_INET, .sin_port = htons(port), .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    cr_assert(s >= 0 && connect(s, (struct sockaddr *)&a, sizeof a) == 0);
    char req[64], rep[64] = "";
    int n = snprintf(req, sizeof req, "%s\r\n", cmd);
    cr_assert_eq(write(s, req, (size_t)n), n);
    ssize_t got = 0;
    while (got < (ssize_t)sizeof rep - 1 && !strstr(rep, "\r\n")) {
        ssize_t k = read(s, rep + got, sizeof rep - 1 - (size_t)got);
        cr_assert_gt(k, 0, "%s: no reply", cmd);
        got += k;
        rep[got] = 0;
    }
    close(s);
    cr_assert_eq(rep[0], ':', "%s: %s", cmd, rep);
    return atoll(rep + 1);
}

/*
 * Shared keys stay shared. Daemon a stores 4 pages on the server (its only tier); then, with the
 * server paused, daemon b stores the same 4 pages (the same keys: a key names the block by its
 * prefix) and its writes time out; the server goes on and b's SETs land late. Before, b then
 * DELed the keys "to undo its failed writes", deleting the blocks a had stored and relies on: a's
 * next read missed. Now a daemon (keep_on_free, the keys shared) deletes no key: every key stays,
 * b counts the writes it left in place, and a reads its 4 pages back byte-exact.
 */
Test(server_remote, a_late_write_by_one_daemon_deletes_no_key_another_stored)
{
    enum { N = 4 };
    char dir[512], addr[64], pfx[64];
    uint16_t port;
    pid_t redis = own_redis(dir, sizeof dir, &port);
    snprintf(addr, sizeof addr, "127.0.0.1:%u", port);
    prefix(pfx, sizeof pfx);
    kvd_t a = {0}, b = {0};
    kvd_start(&a, "--dram-bytes", "0", "--nvme-bytes", "0", "--remote", addr, "--remote-prefix",
              pfx, NULL);
    kvd_start(&b, "--dram-bytes", "0", "--nvme-bytes", "0", "--remote", addr, "--remote-prefix",
              pfx, "--remote-timeout-ms", "300", NULL);
    kvt_client_t *ca = kvd_client(&a, "m", PAGE, BB), *cb = kvd_client(&b, "m", PAGE, BB);
    uint32_t tok[N * PAGE];
    kvd_tokens(tok, N * PAGE, 77);
    kvt_client_put_t r;
    put_all(ca, tok, N, 90, &r);
    cr_assert_eq(r.stored, N);
    cr_assert_eq(redis_int(port, "DBSIZE"), N);
    for (int i = 0; i < 100 && scraped(&b, "kvtier_remote_up") != 1; i++)
        usleep(20000);

    kill(redis, SIGSTOP);
    uint8_t *payload = malloc((size_t)N * BB);
    for (uint32_t p = 0; p < N; p++)
        kvd_fill(payload + (size_t)p * BB, BB, 90 + p);
    int rc = kvt_client_put(cb, tok, N * PAGE, 0, N, payload, NULL, &r); /* times out */
    free(payload);
    kill(redis, SIGCONT);
    cr_assert(rc == 0 || rc == KVT_CLIENT_ETIMEDOUT, "put: %s", kvt_client_strerror(rc));
    cr_assert_geq(scraped(&b, "kvtier_remote_timeouts_total"), 1, "b's writes timed out");
    /* b's SETs land now, then (before) its DELs: wait for the late replies, or for a key to go. */
    double kept = 0;
    for (int i = 0; i < 150 && redis_int(port, "DBSIZE") == N; i++) {
        if ((kept = scraped(&b, "kvtier_remote_late_writes_kept_total")) >= N)
            break;
        usleep(20000);
    }
    usleep(100000);
    cr_expect_eq(redis_int(port, "DBSIZE"), N, "b's late writes deleted a's keys");
    cr_expect_geq(kept, 1, "b counts the late writes it left in place");

    kvt_client_match_t m = {0};
    cr_assert_eq(kvt_client_match(ca, tok, N * PAGE, KVT_CLIENT_LEASE, 0, NULL, &m), 0);
    cr_assert_eq(m.pages, N);
    uint8_t from[N];
    get_all(ca, m.lease, N, 90, from);
    cr_expect_eq(from[0], KVT_CLIENT_TIER_REMOTE);
    kvt_client_close(ca);
    kvt_client_close(cb);
    kvd_cleanup(&a);
    kvd_cleanup(&b);
    own_redis_stop(redis, dir);
}

/*
 * A remote read that hangs (the server stopped: SIGSTOP) holds up no other connection of the
 * GET's loop (issue 42: the GET's read is submitted under the shared lock and loop 0 sends it;
 * the loop goes back to its other connections meanwhile): with two loops, a raw connection on
 * loop 1 GETs a leased remote path while the server is stopped, and another client of loop 1 is
 * answered a PING and a MATCH before that GET's reply comes. The GET then ends at its read's
 * deadline (remote-timeout-ms) with ETIMEDOUT and no page, as the write path's did; once the
 * server goes on, the path reads back whole.
 */
Test(server_remote, a_stopped_server_holds_up_no_other_connection_of_the_gets_loop)
{
    enum { P = 4 };
    char dir[512], addr[64];
    uint16_t port;
    pid_t redis = own_redis(dir, sizeof dir, &port);
    snprintf(addr, sizeof addr, "127.0.0.1:%u", port);
    kvd_t d = {0};
    kvd_start(&d, "--loops", "2", "--dram-bytes", "0", "--nvme-bytes", "0", "--remote", addr,
              "--remote-timeout-ms", "2000", "--tick-ms", "10000", NULL);
    kvt_client_t *c0 = kvd_client(&d, "m", PAGE, BB);
    int fd = kvd_raw(&d);
    kvt_client_t *z0 = kvd_client(&d, "m", PAGE, BB), *c1 = kvd_client(&d, "m", PAGE, BB);
    cr_assert_eq(kvd_stat(c0, "loop_connections_1"), 2, "the raw connection and c1 are loop 1's");
    uint32_t tok[P * PAGE];
    kvd_tokens(tok, P * PAGE, 4400000u);
    kvt_client_put_t r;
    put_all(c1, tok, P, 440, &r);
    cr_assert_eq(r.stored, P);
    static uint8_t body[P * BB + 4096];
    uint64_t lease = raw_lease(fd, "m", PAGE, BB, tok, P * PAGE, body, sizeof body);

    kill(redis, SIGSTOP);
    kvt_wire_get_t gw = {.lease = lease};
    uint8_t f[KVT_PROTO_HDR + sizeof gw];
    kvt_proto_frame(f, KVT_OP_GET, 0, 7, 0, sizeof gw);
    memcpy(f + KVT_PROTO_HDR, &gw, sizeof gw);
    cr_assert_eq(write(fd, f, sizeof f), (ssize_t)sizeof f);
    cr_expect_eq(kvt_client_ping(c1, NULL), 0, "loop 1 answers c1's PING");
    kvt_client_match_t m = {0};
    cr_expect_eq(kvt_client_match(c1, tok, P * PAGE, 0, 0, NULL, &m), 0);
    cr_expect_eq(m.pages, P, "and its MATCH");
    struct pollfd pf = {.fd = fd, .events = POLLIN};
    cr_expect_eq(poll(&pf, 1, 0), 0, "before the GET on the stopped server is answered");
    kvt_proto_hdr_t h;
    read_reply_frame(fd, &h, body, sizeof body);
    cr_expect_eq(h.request_id, 7);
    cr_expect_eq(h.status, KVT_ETIMEDOUT, "the GET ends at its read's deadline: %d", h.status);
    cr_expect_eq(h.body_len, sizeof(kvt_wire_get_end_t), "with its end frame only");
    cr_expect_eq(scraped(&d, "kvtier_loop_shared_gets_total{loop=\"1\"}"), 1,
                 "the GET was planned under the shared lock");
    kill(redis, SIGCONT);

    m = (kvt_client_match_t){0};
    cr_assert_eq(kvt_client_match(c1, tok, P * PAGE, KVT_CLIENT_LEASE, 60000, NULL, &m), 0);
    int rc = -1;
    uint8_t *buf = malloc((size_t)P * BB);
    for (int i = 0; i < 100 && rc != 0; i++) { /* the connection comes back after its stall */
        uint32_t got = 0;
        if ((rc = kvt_client_get(c1, m.lease, 0, P, buf, (size_t)P * BB, &got, NULL)) != 0)
            usleep(50000);
    }
    free(buf);
    cr_expect_eq(rc, 0, "the server back, the GET reads: %s", kvt_client_strerror(rc));
    get_all(c1, m.lease, P, 440, NULL);
    close(fd);
    kvt_client_close(c0);
    kvt_client_close(z0);
    kvt_client_close(c1);
    cr_expect_eq(kvd_stop(&d), 0);
    kvd_cleanup(&d);
    own_redis_stop(redis, dir);
}

/* --- host names: looked up off the request path --- */

/* Sets d's environment for the slow resolver (tests/slow_dns.c): every lookup of "localhost"
 * takes ms milliseconds and is logged to d->dir/dns.log. The strings live in s (4 of 1 KiB). */
static void slow_dns(kvd_t *d, char s[4][1024], int ms)
{
    if (!d->dir[0])
        kvd_mkdir(d);
    snprintf(s[0], 1024, "LD_PRELOAD=%s/tests/libkvt_slow_dns.so", kvd_build_root());
    snprintf(s[1], 1024, "KVT_SLOW_DNS_LOG=%s/dns.log", d->dir);
    snprintf(s[2], 1024, "KVT_SLOW_DNS_MS=%d", ms);
    /* A sanitizer build's daemon refuses to start with a library loaded ahead of its runtime. */
    const char *asan = getenv("ASAN_OPTIONS");
    snprintf(s[3], 1024, "ASAN_OPTIONS=%s%sverify_asan_link_order=0", asan ? asan : "",
             asan && *asan ? ":" : "");
    for (int i = 0; i < 4; i++)
        d->env[i] = s[i];
    char so[1024];
    snprintf(so, sizeof so, "%s/tests/libkvt_slow_dns.so", kvd_build_root());
    cr_assert_eq(access(so, R_OK), 0, "%s is not built", so);
}

/* Lines in d's dns.log: lookups of "localhost" the slow resolver was asked for. */
static int slow_lookups(const kvd_t *d)
{
    char path[700], buf[4096];
    snprintf(path, sizeof path, "%s/dns.log", d->dir);
    FILE *f = fopen(path, "r");
    if (!f)
        return 0;
    int n = 0;
    while (fgets(buf, sizeof buf, f))
        n++;
    fclose(f);
    return n;
}

/*
 * A name lookup never holds up a request. The remote is named "localhost" and every lookup of
 * that name takes 2 s (tests/slow_dns.c, preloaded into the daemon). The daemon's connection to
 * the server is killed (CLIENT KILL): it must reconnect, and it looks the name up again first.
 * Meanwhile a client on loop 1 GETs a remote path and MATCHes with the remote probe, and one on
 * loop 0 PUTs, for 3 s: every request is answered within a second (a miss while the remote is
 * down). Before, hiredis's getaddrinfo ran inside the connect, on whichever thread reconnected:
 * loop 0's tick under the write lock, or a GET's submission under the shared lock and the submit
 * mutex; either way one of those requests waited out the 2 s lookup. Once the lookup is done the
 * daemon reconnects by itself and the path reads back whole.
 */
Test(server_remote, a_slow_name_lookup_holds_up_no_request)
{
    enum { P = 4 };
    char dir[512], addr[64], pfx[64], env[4][1024];
    uint16_t port;
    pid_t redis = own_redis(dir, sizeof dir, &port);
    snprintf(addr, sizeof addr, "localhost:%u", port);
    prefix(pfx, sizeof pfx);
    kvd_t d = {0};
    slow_dns(&d, env, 2000);
    /* A handshake deadline past the lookup: before, the connect's clock started ahead of it. */
    kvd_start(&d, "--loops", "2", "--dram-bytes", "0", "--nvme-bytes", "0", "--remote", addr,
              "--remote-prefix", pfx, "--remote-timeout-ms", "10000", NULL);
    kvt_client_t *c0 = kvd_client(&d, "m", PAGE, BB), *c1 = kvd_client(&d, "m", PAGE, BB);
    cr_assert_eq(kvd_stat(c0, "loop_connections_1"), 1, "c1 is loop 1's");
    double up = -1;
    for (int i = 0; i < 500 && (up = scraped(&d, "kvtier_remote_up")) != 1; i++)
        usleep(20000);
    cr_assert_eq(up, 1, "connected to localhost:%u", port);
    cr_assert_geq(slow_lookups(&d), 1, "the shim saw the lookup");
    uint32_t tok[P * PAGE];
    kvd_tokens(tok, P * PAGE, 5100000u);
    kvt_client_put_t r;
    put_all(c1, tok, P, 510, &r);
    cr_assert_eq(r.stored, P);
    kvt_client_match_t m = {0};
    cr_assert_eq(kvt_client_match(c1, tok, P * PAGE, KVT_CLIENT_LEASE, 60000, NULL, &m), 0);
    cr_assert_eq(m.pages, P);
    get_all(c1, m.lease, P, 510, NULL);

    int before = slow_lookups(&d);
    cr_assert_geq(redis_int(port, "CLIENT KILL TYPE normal"), 1, "the daemon's connection");
    uint8_t *buf = malloc((size_t)P * BB), *payload = malloc(BB);
    kvd_fill(payload, BB, 9);
    double worst = 0;
    const char *worst_op = "";
    int n = 0, missed = 0;
    unsigned long long t0 = now_ns_test();
    while (now_ns_test() - t0 < 3000000000ull) {
        uint32_t other[PAGE], got = 0;
        kvd_tokens(other, PAGE, 6000000u + 1000u * (uint32_t)n);
        kvt_client_match_t q = {0};
        unsigned long long a = now_ns_test();
        int rc = kvt_client_get(c1, m.lease, 0, P, buf, (size_t)P * BB, &got, NULL);
        unsigned long long b = now_ns_test();
        cr_assert_eq(
            kvt_client_match(c1, other, PAGE, KVT_CLIENT_REMOTE | KVT_CLIENT_PROBE, 0, NULL, &q),
            0);
        unsigned long long c = now_ns_test();
        cr_assert_eq(kvt_client_put(c0, other, PAGE, 0, 1, payload, NULL, &r), 0);
        unsigned long long e = now_ns_test();
        double s[3] = {(b - a) / 1e9, (c - b) / 1e9, (e - c) / 1e9};
        const char *name[3] = {"a GET on loop 1", "a probing MATCH on loop 1", "a PUT on loop 0"};
        for (int k = 0; k < 3; k++)
            if (s[k] > worst)
                worst = s[k], worst_op = name[k];
        missed += rc != 0; /* a miss (EUNAVAIL) while the remote is down, else the pages */
        n++;
        usleep(20000);
    }
    int during = slow_lookups(&d) - before;
    cr_expect_geq(during, 1, "the name was looked up again while requests ran");
    cr_expect_gt(missed, 0, "the remote was down meanwhile (%d GETs)", n);
    cr_expect_lt(worst, 1.0, "%s waited %.2f s (a 2 s lookup on its path?)", worst_op, worst);
    for (int i = 0; i < 500 && (up = scraped(&d, "kvtier_remote_up")) != 1; i++)
        usleep(20000);
    cr_assert_eq(up, 1, "reconnected");
    m = (kvt_client_match_t){0};
    cr_assert_eq(kvt_client_match(c1, tok, P * PAGE, KVT_CLIENT_LEASE, 60000, NULL, &m), 0);
    cr_assert_eq(m.pages, P);
    get_all(c1, m.lease, P, 510, NULL);
    free(buf);
    free(payload);
    kvt_client_close(c0);
    kvt_client_close(c1);
    cr_expect_eq(kvd_stop(&d), 0);
    kvd_cleanup(&d);
    own_redis_stop(redis, dir);
}

/*
 * A remote whose name does not resolve (.invalid never does, RFC 6761) is a remote that is down:
 * the daemon starts, says why in its log, keeps the pages it can in DRAM and answers a remote
 * probe as a miss for want of the remote.
 */
Test(server_remote, a_name_that_does_not_resolve_leaves_the_daemon_serving)
{
    kvd_t d = {0};
    kvd_start(&d, "--remote", "nosuchhost.invalid:6379", NULL);
    kvt_client_t *c = kvd_client(&d, "m", PAGE, BB);
    int said = 0;
    for (int i = 0; i < 300 && !(said = kvd_log_has(&d, "cannot resolve nosuchhost.invalid")); i++)
        usleep(100000); /* up to 30 s: a resolver that does not answer takes its time to fail */
    if (!said)
        kvd_log_tail(&d, 2000);
    cr_expect(said, "the log says the name does not resolve");
    uint32_t tok[4 * PAGE], other[4 * PAGE];
    kvd_tokens(tok, 4 * PAGE, 5200000u);
    kvd_tokens(other, 4 * PAGE, 5300000u);
    kvt_client_put_t r;
    put_all(c, tok, 4, 520, &r);
    cr_expect_eq(r.stored, 4, "the pages stay in DRAM");
    kvt_client_match_t m = {0};
    cr_assert_eq(kvt_client_match(c, tok, 4 * PAGE, KVT_CLIENT_LEASE, 0, NULL, &m), 0);
    cr_expect_eq(m.pages, 4);
    get_all(c, m.lease, 4, 520, NULL);
    m = (kvt_client_match_t){0};
    cr_assert_eq(kvt_client_match(c, other, 4 * PAGE, KVT_CLIENT_REMOTE, 0, NULL, &m), 0);
    cr_expect_eq(m.pages, 0);
    cr_expect_eq(kvd_metric(&d, "kvtier_miss_tokens_total{reason=\"remote_unreachable\"}"), 64);
    cr_expect_eq(scraped(&d, "kvtier_remote_up"), 0);
    kvt_client_close(c);
    kvd_cleanup(&d);
}

/* A remote named by host name ("localhost") works end to end: the name is looked up (the log
 * says what to), the blocks a PUT could place nowhere else land on the server and read back
 * byte-exact from it. */
Test(server_remote, a_remote_named_localhost_stores_and_reads_back)
{
    enum { P = 8 };
    char dir[512], addr[64], pfx[64];
    uint16_t port;
    pid_t redis = own_redis(dir, sizeof dir, &port);
    snprintf(addr, sizeof addr, "localhost:%u", port);
    prefix(pfx, sizeof pfx);
    kvd_t d = {0};
    kvd_start(&d, "--dram-bytes", "0", "--nvme-bytes", "0", "--remote", addr, "--remote-prefix",
              pfx, "--log-level", "info", NULL);
    kvt_client_t *c = kvd_client(&d, "m", PAGE, BB);
    double up = -1;
    for (int i = 0; i < 500 && (up = scraped(&d, "kvtier_remote_up")) != 1; i++)
        usleep(20000);
    cr_assert_eq(up, 1, "connected to %s", addr);
    cr_expect(kvd_log_has(&d, "remote: localhost resolved to 127.0.0.1"), "the lookup is logged");
    uint32_t tok[P * PAGE];
    kvd_tokens(tok, P * PAGE, 5400000u);
    kvt_client_put_t r;
    put_all(c, tok, P, 540, &r);
    cr_assert_eq(r.stored, P);
    cr_expect_eq(redis_int(port, "DBSIZE"), P, "on the server");
    uint8_t tiers[P], from[P];
    kvt_client_match_t m = {.tiers = tiers, .tiers_cap = P};
    cr_assert_eq(kvt_client_match(c, tok, P * PAGE, KVT_CLIENT_LEASE, 0, NULL, &m), 0);
    cr_assert_eq(m.pages, P);
    get_all(c, m.lease, P, 540, from);
    for (int k = 0; k < P; k++)
        cr_expect_eq(from[k], KVT_CLIENT_TIER_REMOTE, "page %d read from tier %u", k, from[k]);
    kvt_client_close(c);
    kvd_cleanup(&d);
    own_redis_stop(redis, dir);
}
