/*
 * test_metrics_scrape.c: kvtierd's HTTP endpoint on a real scrape: /metrics after real traffic
 * passes `promtool check metrics` with no warnings (skipped when promtool is absent), the counters
 * move with the requests (lookups, looked-up tokens, hits per tier, miss reasons, request
 * histograms, protocol errors, engine hints by kind), STATS lists the same series as /metrics
 * (every counter and gauge of the one metric table), only series that can be other than zero
 * are exported, /healthz answers, and other paths get 404/405. The operator's series: prefill
 * seconds saved per tier and per namespace as the cost model prices them, the per-namespace label
 * set capped at metrics-namespaces, kvtier_build_info and the process_* gauges against what /proc
 * says of the daemon.
 */
#include <math.h>
#include <time.h>

#include "config.h"
#include "policy.h"
#include "proto.h"
#include "test_raw_frames.h"
#include "test_server_harness.h"

#define PAGE 16

static char body[1 << 20];

static double metric(const char *text, const char *series)
{
    const char *p = text;
    size_t n = strlen(series);
    while ((p = strstr(p, series))) {
        if ((p == text || p[-1] == '\n') && p[n] == ' ')
            return strtod(p + n + 1, NULL);
        p += n;
    }
    cr_assert_fail("no series %s", series);
    return 0;
}

static void traffic(const kvd_t *d)
{
    kvt_client_t *c = kvd_client(d, "m", PAGE, 4096);
    uint32_t tok[8 * PAGE + 3];
    kvd_tokens(tok, 8 * PAGE + 3, 1);
    uint8_t payload[4 * 4096] = {0};
    kvt_client_put_t r;
    cr_assert_eq(kvt_client_put(c, tok, 4 * PAGE, 0, 4, payload, NULL, &r), 0);
    kvt_client_match_t m = {0};
    /* 131 tokens: 4 pages hit in DRAM, 4 never seen, 3 tokens shorter than a page. */
    cr_assert_eq(kvt_client_match(c, tok, 8 * PAGE + 3, KVT_CLIENT_LEASE, 0, NULL, &m), 0);
    uint8_t buf[4 * 4096];
    cr_assert_eq(kvt_client_get(c, m.lease, 0, 4, buf, sizeof buf, NULL, NULL), 0);
    /* Evict by removing, then look again: the removed pages are "never seen" (a REMOVE is not
     * an eviction), and the first page still hits. */
    cr_assert_eq(kvt_client_release(c, m.lease, NULL), 0);
    cr_assert_eq(kvt_client_remove(c, tok, 2 * PAGE), 0);
    cr_assert_eq(kvt_client_match(c, tok, 4 * PAGE, 0, 0, NULL, &m), 0);
    cr_assert_eq(m.pages, 1);
    kvt_client_close(c);
    /* One protocol error. */
    int fd = kvd_raw(d);
    uint8_t hdr[KVT_PROTO_HDR];
    kvt_proto_frame(hdr, 99, 0, 1, 0, 0);
    cr_assert_eq(write(fd, hdr, sizeof hdr), (ssize_t)sizeof hdr);
    cr_assert_eq(read(fd, body, KVT_PROTO_HDR), KVT_PROTO_HDR);
    close(fd);
}

/* Reads one reply frame from fd into buf (its body); returns its header. */
static kvt_proto_hdr_t read_reply(int fd, uint8_t *buf, size_t cap)
{
    uint8_t hdr[KVT_PROTO_HDR];
    kvt_proto_hdr_t h;
    cr_assert_eq(read_full(fd, hdr, sizeof hdr), 0);
    kvt_proto_hdr_decode(hdr, &h);
    cr_assert_leq(h.body_len, cap);
    cr_assert_eq(read_full(fd, buf, h.body_len), 0);
    return h;
}

/* A raw connection to d, past HELLO in model "m" (pages of PAGE tokens, 4096-byte blocks). */
static int raw_hello(const kvd_t *d)
{
    int fd = kvd_raw(d);
    uint8_t frame[sizeof(kvt_wire_hello_t) + 1];
    kvt_proto_hello_t hq = {
        .min_version = 1, .max_version = 1, .page_size = PAGE, .block_bytes = 4096, .model_len = 1};
    kvt_proto_hello_encode(frame, &hq);
    frame[sizeof(kvt_wire_hello_t)] = 'm';
    raw_frame(fd, KVT_OP_HELLO, 0, 1, frame, sizeof frame, KVT_PROTO_MAGIC, KVT_PROTO_VERSION);
    static uint8_t reply[256];
    cr_assert_eq(read_reply(fd, reply, sizeof reply).status, 0);
    return fd;
}

/* A MATCH frame of tok[0..n) (no lease) at `at`; returns its length. */
static size_t match_frame(uint8_t *at, const uint32_t *tok, uint32_t n, uint32_t id)
{
    uint32_t mlen = (uint32_t)(sizeof(kvt_wire_match_t) + 4 * n);
    kvt_proto_match_t mq = {.ntokens = n};
    kvt_proto_frame(at, KVT_OP_MATCH, 0, id, 0, mlen);
    kvt_proto_match_encode(at + KVT_PROTO_HDR, &mq);
    kvt_proto_tokens_encode(at + KVT_PROTO_HDR + sizeof(kvt_wire_match_t), tok, n);
    return KVT_PROTO_HDR + mlen;
}

enum { BIG = 2048 * PAGE };

/* The reply to a MATCH of the BIG tokens of tok, which d holds in its index: all 2,048 pages. */
static void read_big_match(int fd)
{
    static uint8_t reply[1 << 16];
    kvt_proto_hdr_t h = read_reply(fd, reply, sizeof reply);
    cr_assert(h.opcode == (KVT_OP_MATCH | KVT_OP_REPLY) && h.status == 0, "MATCH: op %u status %d",
              h.opcode, h.status);
    kvt_proto_match_reply_t mr;
    const uint8_t *tiers;
    cr_assert_eq(kvt_proto_match_reply_decode(reply, h.body_len, &mr, &tiers), 0);
    cr_assert_eq(mr.pages, 2048, "the MATCH walked the whole cached path");
}

/* d's index holds the BIG tokens of tok (seed 7), through a client of its own. */
static void index_big(const kvd_t *d, uint32_t *tok)
{
    kvd_tokens(tok, BIG, 7);
    kvt_client_t *c = kvd_client(d, "m", PAGE, 4096);
    kvt_client_put_t pr;
    cr_assert_eq(kvt_client_put(c, tok, BIG, 0, 0, NULL, NULL, &pr), 0); /* index only */
    kvt_client_close(c);
}

/*
 * A request's duration runs from the read that brought it ("arrival"), not from when its handler
 * began: a PING pipelined in one write behind a MATCH of 2,048 cached pages is read with it, so
 * its duration includes the MATCH's handling and is at least the MATCH's (the same read, the
 * PING's reply queued after). When each request took its own clock reading as it was handled,
 * the PING's was a microsecond or two, far below the MATCH's.
 */
Test(metrics_scrape, a_requests_duration_runs_from_the_read_that_brought_it)
{
    kvd_t d = {0};
    kvd_start(&d, NULL);
    static uint32_t tok[BIG];
    index_big(&d, tok);
    int fd = raw_hello(&d);
    static uint8_t frames[2 * KVT_PROTO_HDR + sizeof(kvt_wire_match_t) + 4 * BIG];
    size_t len = match_frame(frames, tok, BIG, 2); /* MATCH then PING, in one write */
    kvt_proto_frame(frames + len, KVT_OP_PING, 0, 3, 0, 0);
    len += KVT_PROTO_HDR;
    cr_assert_eq(write(fd, frames, len), (ssize_t)len);
    read_big_match(fd);
    static uint8_t reply[256];
    cr_assert_eq(read_reply(fd, reply, sizeof reply).opcode, KVT_OP_PING | KVT_OP_REPLY);
    close(fd);

    double match_s = kvd_metric(&d, "kvtier_request_duration_seconds_sum{op=\"match\"}");
    double ping_s = kvd_metric(&d, "kvtier_request_duration_seconds_sum{op=\"ping\"}");
    cr_assert_gt(match_s, 0);
    cr_expect_geq(ping_s, match_s, "PING %.9f s, MATCH %.9f s: the PING arrived with the MATCH",
                  ping_s, match_s);
    kvd_stop(&d);
    kvd_cleanup(&d);
}

/*
 * The same with two loops, where MATCHes are answered under the lock shared (a path of their
 * own): a one-page MATCH pipelined behind the 2,048-page one arrived with it, so neither lasts
 * under 10 us (the big one's handling takes hundreds); stamped as its handler began, the small
 * one took a microsecond or two.
 */
Test(metrics_scrape, shared_matches_run_from_the_read_that_brought_them)
{
    kvd_t d = {0};
    kvd_start(&d, "--loops", "2", NULL);
    static uint32_t tok[BIG];
    index_big(&d, tok);
    uint32_t miss[PAGE];
    kvd_tokens(miss, PAGE, 8);
    int fd = raw_hello(&d);
    static uint8_t frames[2 * KVT_PROTO_HDR + 2 * sizeof(kvt_wire_match_t) + 4 * (BIG + PAGE)];
    size_t len = match_frame(frames, tok, BIG, 2);
    len += match_frame(frames + len, miss, PAGE, 3);
    cr_assert_eq(write(fd, frames, len), (ssize_t)len);
    read_big_match(fd);
    static uint8_t reply[1 << 12];
    cr_assert_eq(read_reply(fd, reply, sizeof reply).opcode, KVT_OP_MATCH | KVT_OP_REPLY);
    close(fd);

    cr_assert_geq(kvd_metric(&d, "kvtier_loop_shared_matches_total{loop=\"1\"}") +
                      kvd_metric(&d, "kvtier_loop_shared_matches_total{loop=\"0\"}"),
                  2, "both MATCHes answered under the lock shared");
    cr_assert_eq(kvd_metric(&d, "kvtier_request_duration_seconds_count{op=\"match\"}"), 2);
    double quick =
        kvd_metric(&d, "kvtier_request_duration_seconds_bucket{op=\"match\",le=\"1e-05\"}");
    cr_expect_eq(quick, 0, "%.0f MATCHes under 10 us: the small one did not count from its read",
                 quick);
    kvd_stop(&d);
    kvd_cleanup(&d);
}

Test(metrics_scrape, counters_follow_traffic)
{
    kvd_t d = {0};
    kvd_start(&d, NULL);
    traffic(&d);
    cr_assert_eq(kvd_http_get(&d, "/metrics", body, sizeof body), 200);
    cr_expect_eq(metric(body, "kvtier_lookups_total"), 2);
    cr_expect_eq(metric(body, "kvtier_lookup_tokens_total"), 8 * PAGE + 3 + 4 * PAGE);
    cr_expect_eq(metric(body, "kvtier_hit_tokens_total{tier=\"dram\"}"), 5 * PAGE);
    cr_expect_eq(metric(body, "kvtier_miss_tokens_total{reason=\"never_seen\"}"), 7 * PAGE);
    cr_expect_eq(metric(body, "kvtier_miss_tokens_total{reason=\"short_page\"}"), 3);
    cr_expect_eq(metric(body, "kvtier_requests_total{op=\"match\"}"), 2);
    cr_expect_eq(metric(body, "kvtier_request_duration_seconds_count{op=\"put\"}"), 1);
    cr_expect_eq(metric(body, "kvtier_request_duration_seconds_count{op=\"get\"}"), 1);
    cr_expect_eq(metric(body, "kvtier_protocol_errors_total{kind=\"unknown_op\"}"), 1);
    cr_expect_eq(metric(body, "kvtier_tier_io_duration_seconds_count{tier=\"dram\",dir=\"write\"}"),
                 4);
    cr_expect_eq(metric(body, "kvtier_tier_io_duration_seconds_count{tier=\"dram\",dir=\"read\"}"),
                 4);
    cr_expect_eq(metric(body, "kvtier_tier_capacity_bytes{tier=\"dram\"}"), 16 << 20);
    cr_expect_eq(metric(body, "kvtier_tier_blocks{tier=\"dram\"}"), 1);
    cr_expect_gt(metric(body, "kvtier_prefill_saved_seconds_total"), 0);
    cr_expect_eq(metric(body, "kvtier_connections_accepted_total"), 2);
    char h[256];
    cr_expect_eq(kvd_http_get(&d, "/healthz", h, sizeof h), 200);
    cr_expect_str_eq(h, "ok\n");
    cr_expect_eq(kvd_http_get(&d, "/nope", h, sizeof h), 404);
    kvd_cleanup(&d);
}

/* A path of two runs (13 pages in DRAM, 32 index-only), of lengths that are not multiples of
 * eight: the hits are counted per tier, as the reply's tiers say. */
Test(metrics_scrape, hits_are_counted_per_tier_along_a_mixed_path)
{
    kvd_t d = {0};
    kvd_start(&d, NULL);
    kvt_client_t *c = kvd_client(&d, "m", PAGE, 512);
    uint32_t tok[45 * PAGE];
    kvd_tokens(tok, 45 * PAGE, 7);
    static uint8_t payload[13 * 512];
    kvt_client_put_t r;
    cr_assert_eq(kvt_client_put(c, tok, 45 * PAGE, 0, 13, payload, NULL, &r), 0);
    cr_assert_eq(r.stored, 13);
    uint8_t tiers[45];
    kvt_client_match_t m = {.tiers = tiers, .tiers_cap = 45};
    cr_assert_eq(kvt_client_match(c, tok, 45 * PAGE, 0, 0, NULL, &m), 0);
    cr_assert_eq(m.pages, 45);
    for (int i = 0; i < 45; i++)
        cr_assert_eq(tiers[i], i < 13 ? KVT_CLIENT_TIER_DRAM : KVT_CLIENT_TIER_NONE,
                     "page %d: tier %u", i, tiers[i]);
    /* A prefix that ends inside the DRAM run. */
    cr_assert_eq(kvt_client_match(c, tok, 7 * PAGE, 0, 0, NULL, &m), 0);
    cr_assert_eq(m.pages, 7);
    kvt_client_close(c);
    cr_assert_eq(kvd_http_get(&d, "/metrics", body, sizeof body), 200);
    cr_expect_eq(metric(body, "kvtier_hit_tokens_total{tier=\"dram\"}"), (13 + 7) * PAGE);
    cr_expect_eq(metric(body, "kvtier_hit_tokens_total{tier=\"none\"}"), 32 * PAGE);
    kvd_cleanup(&d);
}

Test(metrics_scrape, promtool_check_metrics_has_no_warnings)
{
    if (system("command -v promtool >/dev/null 2>&1") != 0)
        cr_skip_test("promtool is not installed (Debian package prometheus)");
    kvd_t d = {0};
    kvd_start(&d, NULL);
    traffic(&d);
    cr_assert_eq(kvd_http_get(&d, "/metrics", body, sizeof body), 200);
    char path[700], cmd[1600];
    snprintf(path, sizeof path, "%s/scrape.txt", d.dir);
    FILE *f = fopen(path, "w");
    cr_assert(f);
    fputs(body, f);
    fclose(f);
    snprintf(cmd, sizeof cmd, "promtool check metrics < '%s' > '%s.out' 2>&1", path, path);
    int st = system(cmd);
    snprintf(cmd, sizeof cmd, "%s.out", path);
    f = fopen(cmd, "r");
    char out[4096] = "";
    size_t n = f ? fread(out, 1, sizeof out - 1, f) : 0;
    out[n] = 0;
    if (f)
        fclose(f);
    cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 0, "promtool failed: %s", out);
    cr_expect_eq(n, 0, "promtool printed: %s", out);
    kvd_cleanup(&d);
}

/* 64 connections to the metrics port that never send a request take every scrape slot; a scrape
 * still gets through at once (it closes the oldest of them), and each of the others is closed
 * once its 5 s are up. */
Test(metrics_scrape, silent_connections_do_not_block_scrapes_for_long)
{
    kvd_t d = {0};
    kvd_start(&d, NULL);
    char host[64];
    unsigned port = 0;
    cr_assert_eq(sscanf(d.metrics, "%63[^:]:%u", host, &port), 2);
    int fds[64];
    for (int i = 0; i < 64; i++) {
        fds[i] = socket(AF_INET, SOCK_STREAM, 0);
        struct sockaddr_in sin = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
        inet_pton(AF_INET, host, &sin.sin_addr);
        cr_assert_eq(connect(fds[i], (struct sockaddr *)&sin, sizeof sin), 0);
        struct timeval tv = {.tv_sec = 10};
        setsockopt(fds[i], SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    }
    usleep(200000);
    cr_expect_eq(kvd_http_get(&d, "/healthz", body, sizeof body), 200,
                 "a scrape gets through with every slot taken");
    char b;
    cr_expect_eq(read(fds[0], &b, 1), 0, "the oldest silent connection made room");
    for (int i = 1; i < 64; i++)
        cr_expect_eq(read(fds[i], &b, 1), 0, "silent connection %d was closed", i);
    for (int i = 0; i < 64; i++)
        close(fds[i]);
    cr_assert_eq(kvd_http_get(&d, "/metrics", body, sizeof body), 200);
    cr_expect_eq(metric(body, "kvtier_metrics_connections_evicted_total"), 1);
    kvd_cleanup(&d);
}

typedef struct stats_list {
    char names[512][128];
    uint64_t values[512];
    unsigned n;
} stats_list_t;

static int stats_take(void *arg, const char *name, uint64_t v)
{
    stats_list_t *l = arg;
    cr_assert_lt(l->n, 512);
    snprintf(l->names[l->n], sizeof l->names[l->n], "%s", name);
    l->values[l->n++] = v;
    return 0;
}

static uint64_t stats_value(const stats_list_t *l, const char *name)
{
    for (unsigned i = 0; i < l->n; i++)
        if (!strcmp(l->names[i], name))
            return l->values[i];
    cr_assert_fail("no STATS entry %s", name);
    return 0;
}

/* STATS and /metrics render one table: every counter and gauge series a scrape shows is a STATS
 * entry, named after it, newer counters (AUTH, connection limits, moves) included, and so is the
 * sum of each loop's lock-time histogram (loop_write_lock_hold_us_0, ...), the only histograms
 * STATS has. */
Test(metrics_scrape, stats_has_every_series_of_the_metrics)
{
    kvd_t d = {0};
    kvd_start(&d, NULL);
    traffic(&d);
    kvt_client_t *c = kvd_client(&d, "m", PAGE, 4096);
    static stats_list_t l;
    cr_assert_eq(kvt_client_stats(c, stats_take, &l), 0);
    cr_assert_eq(kvd_http_get(&d, "/metrics", body, sizeof body), 200);
    /* Sample lines of counters and gauges, as many as STATS has entries. */
    unsigned samples = 0;
    int histogram = 0;
    for (const char *p = body; *p; p = strchr(p, '\n') ? strchr(p, '\n') + 1 : p + strlen(p)) {
        if (!strncmp(p, "# TYPE ", 7))
            histogram = !strncmp(strchr(p + 7, ' ') + 1, "histogram", 9);
        else if (*p != '#' && *p != '\n' && !histogram &&
                 strncmp(p, "kvtier_namespace_", 17)) /* client-chosen labels: /metrics only */
            samples++;
        else if (histogram && strstr(p, "_sum{loop=\"") &&
                 strstr(p, "_sum{loop=\"") < strchr(p, '\n'))
            samples++;
    }
    cr_expect_eq(l.n, samples, "STATS %u entries, /metrics %u counter and gauge series", l.n,
                 samples);
    cr_expect_eq(stats_value(&l, "lookups"), metric(body, "kvtier_lookups_total"));
    cr_expect_eq(stats_value(&l, "hit_tokens_dram"),
                 metric(body, "kvtier_hit_tokens_total{tier=\"dram\"}"));
    cr_expect_eq(stats_value(&l, "miss_tokens_never_seen"),
                 metric(body, "kvtier_miss_tokens_total{reason=\"never_seen\"}"));
    cr_expect_eq(stats_value(&l, "dram_capacity_bytes"), 16 << 20);
    cr_expect_eq(stats_value(&l, "protocol_errors_unknown_op"), 1);
    cr_expect_eq(stats_value(&l, "auth_failures"), 0);
    cr_expect_eq(stats_value(&l, "connections_accepted"),
                 metric(body, "kvtier_connections_accepted_total"));
    cr_expect_eq(stats_value(&l, "blocks_moved_dram_nvme"),
                 metric(body, "kvtier_blocks_moved_total{from=\"dram\",to=\"nvme\"}"));
    cr_expect_eq(stats_value(&l, "tier_io_errors_dram_read"), 0);
    cr_expect_eq(stats_value(&l, "put_pages_stored"), 4);
    /* One loop holds the lock for writing throughout: no hold has ended. Several let it go. */
    if (stats_value(&l, "loops") > 1)
        cr_expect_gt(stats_value(&l, "loop_write_lock_hold_us_0"), 0);
    else
        cr_expect_eq(stats_value(&l, "loop_write_lock_hold_us_0"), 0);
    cr_expect_eq(stats_value(&l, "build_info"), 1);
    cr_expect_eq(stats_value(&l, "prefill_seconds_saved_dram"),
                 (uint64_t)metric(body, "kvtier_prefill_seconds_saved_total{tier=\"dram\"}"));
    cr_expect_gt(stats_value(&l, "process_open_fds"), 0);
    kvt_client_close(c);
    kvd_stop(&d);
}

static int stats_has(const stats_list_t *l, const char *name)
{
    for (unsigned i = 0; i < l->n; i++)
        if (!strcmp(l->names[i], name))
            return 1;
    return 0;
}

/* Whether the scrape has a sample line of exactly this series. */
static int has_series(const char *text, const char *series)
{
    size_t n = strlen(series);
    for (const char *p = text; (p = strstr(p, series)); p += n)
        if ((p == text || p[-1] == '\n') && p[n] == ' ')
            return 1;
    return 0;
}

/* Only series that can be other than zero are exported: no used bytes or reclaims of tier
 * "none", no reclaims in the tiers that never drop a block by themselves (HBM, DRAM), MAP only
 * of the tiers it hands out (DRAM, HBM), zero-copy pages only of GET and RESERVE. They used to
 * be there, always 0, in STATS and on /metrics alike. The series that can count stay. */
Test(metrics_scrape, only_series_that_can_count_are_exported)
{
    kvd_t d = {0};
    kvd_start(&d, NULL);
    traffic(&d);
    kvt_client_t *c = kvd_client(&d, "m", PAGE, 4096);
    static stats_list_t l;
    cr_assert_eq(kvt_client_stats(c, stats_take, &l), 0);
    cr_assert_eq(kvd_http_get(&d, "/metrics", body, sizeof body), 200);
    static const struct {
        const char *stat, *series;
        int present;
    } rows[] = {
        {"none_used_bytes", "kvtier_tier_used_bytes{tier=\"none\"}", 0},
        {"none_capacity_bytes", "kvtier_tier_capacity_bytes{tier=\"none\"}", 0},
        {"none_blocks", "kvtier_tier_blocks{tier=\"none\"}", 0},
        {"none_lost_blocks", "kvtier_tier_lost_blocks_total{tier=\"none\"}", 0},
        {"hbm_lost_blocks", "kvtier_tier_lost_blocks_total{tier=\"hbm\"}", 0},
        {"dram_lost_blocks", "kvtier_tier_lost_blocks_total{tier=\"dram\"}", 0},
        {"zero_copy_maps_none", "kvtier_zero_copy_maps_total{tier=\"none\"}", 0},
        {"zero_copy_maps_nvme", "kvtier_zero_copy_maps_total{tier=\"nvme\"}", 0},
        {"zero_copy_maps_remote", "kvtier_zero_copy_maps_total{tier=\"remote\"}", 0},
        /* What can count. */
        {"hit_tokens_none", "kvtier_hit_tokens_total{tier=\"none\"}", 1},
        {"blocks_dropped_none", "kvtier_blocks_dropped_total{tier=\"none\"}", 1},
        {"hbm_used_bytes", "kvtier_tier_used_bytes{tier=\"hbm\"}", 1},
        {"dram_used_bytes", "kvtier_tier_used_bytes{tier=\"dram\"}", 1},
        {"nvme_blocks", "kvtier_tier_blocks{tier=\"nvme\"}", 1},
        {"remote_capacity_bytes", "kvtier_tier_capacity_bytes{tier=\"remote\"}", 1},
        {"nvme_lost_blocks", "kvtier_tier_lost_blocks_total{tier=\"nvme\"}", 1},
        {"remote_lost_blocks", "kvtier_tier_lost_blocks_total{tier=\"remote\"}", 1},
        {"zero_copy_maps_dram", "kvtier_zero_copy_maps_total{tier=\"dram\"}", 1},
        {"zero_copy_maps_hbm", "kvtier_zero_copy_maps_total{tier=\"hbm\"}", 1},
    };
    for (size_t i = 0; i < sizeof rows / sizeof *rows; i++) {
        cr_expect_eq(stats_has(&l, rows[i].stat), rows[i].present, "STATS %s: %s", rows[i].stat,
                     rows[i].present ? "missing" : "exported");
        cr_expect_eq(has_series(body, rows[i].series), rows[i].present, "/metrics %s: %s",
                     rows[i].series, rows[i].present ? "missing" : "exported");
    }
    for (unsigned op = 1; op < KVT_OP_COUNT; op++) {
        const char *name = kvt_proto_op_name(op);
        int zc = op == KVT_OP_GET || op == KVT_OP_RESERVE;
        char stat[128], series[160];
        snprintf(stat, sizeof stat, "zero_copy_pages_%s", name);
        snprintf(series, sizeof series, "kvtier_zero_copy_pages_total{op=\"%s\"}", name);
        cr_expect_eq(stats_has(&l, stat), zc, "STATS %s", stat);
        cr_expect_eq(has_series(body, series), zc, "/metrics %s", series);
        /* Every operation keeps its request counter. */
        snprintf(stat, sizeof stat, "requests_%s", name);
        cr_expect(stats_has(&l, stat), "STATS %s", stat);
    }
    kvt_client_close(c);
    kvd_cleanup(&d);
}

/* The engine hints MATCH and PUT carry are counted by kind, as STATS and /metrics show: an
 * operator sees whether the engines' connectors send them. A request id alone is no hint. */
Test(metrics_scrape, hints_are_counted_by_kind)
{
    kvd_t d = {0};
    kvd_start(&d, NULL);
    kvt_client_t *c = kvd_client(&d, "m", PAGE, 512);
    uint32_t tok[2 * PAGE];
    kvd_tokens(tok, 2 * PAGE, 3);
    static const kvt_client_hints_t sent[] = {
        {.engine_request_id = 1},
        {.engine_request_id = 2, .resume_ms = 500, .flags = KVT_CLIENT_HINT_PAUSED},
        {.engine_request_id = 3, .flags = KVT_CLIENT_HINT_FINISHED},
        {.engine_request_id = 4, .priority = 5},
    };
    kvt_client_match_t m = {0};
    cr_assert_eq(kvt_client_match(c, tok, 2 * PAGE, 0, 0, NULL, &m), 0);
    for (size_t i = 0; i < sizeof sent / sizeof sent[0]; i++)
        cr_assert_eq(kvt_client_match(c, tok, 2 * PAGE, 0, 0, &sent[i], &m), 0);
    /* A PUT counts too, once per kind it carries (paused and finished together are refused). */
    static uint8_t payload[2 * 512];
    const kvt_client_hints_t two = {
        .resume_ms = 100, .priority = 1, .flags = KVT_CLIENT_HINT_PAUSED};
    kvt_client_put_t r;
    cr_assert_eq(kvt_client_put(c, tok, 2 * PAGE, 0, 2, payload, &two, &r), 0);
    static stats_list_t l;
    cr_assert_eq(kvt_client_stats(c, stats_take, &l), 0);
    cr_expect_eq(stats_value(&l, "hints_paused"), 2);
    cr_expect_eq(stats_value(&l, "hints_finished"), 1);
    cr_expect_eq(stats_value(&l, "hints_priority"), 2);
    kvt_client_close(c);
    cr_assert_eq(kvd_http_get(&d, "/metrics", body, sizeof body), 200);
    cr_expect_eq(metric(body, "kvtier_hints_total{kind=\"paused\"}"), 2);
    cr_expect_eq(metric(body, "kvtier_hints_total{kind=\"finished\"}"), 1);
    cr_expect_eq(metric(body, "kvtier_hints_total{kind=\"priority\"}"), 2);
    kvd_cleanup(&d);
}

static kvt_client_t *client_ns(const kvd_t *d, const char *model, const char *adapter)
{
    kvt_client_conf_t conf = {.unix_path = d->sock,
                              .model = model,
                              .adapter = adapter,
                              .page_size = PAGE,
                              .block_bytes = 512,
                              .timeout_ms = 10000};
    kvt_client_t *c = NULL;
    int rc = kvt_client_connect(&c, &conf);
    cr_assert_eq(rc, 0, "connect: %s", kvt_client_strerror(rc));
    return c;
}

/* What the cost model says a hit of the pages [0, pages) in DRAM saves. */
static double saved_dram(const kvt_model_profile_t *m, const kvt_hw_profile_t *hw, uint32_t pages)
{
    uint64_t t = (uint64_t)pages * PAGE;
    return kvt_cost_recompute_s(m, hw, 0, t) -
           kvt_cost_load_s(hw, KVT_TIER_DRAM, kvt_cost_kv_bytes(m, t));
}

static void expect_near(double got, double want, const char *what)
{
    cr_expect(fabs(got - want) <= 1e-9 * fabs(want) + 1e-12, "%s: %.12g, the cost model says %.12g",
              what, got, want);
}

/* A path of 13 pages in DRAM and 32 index-only: the DRAM run saves its recompute at its depth less
 * its load from DRAM, on the profiles the daemon was given (not the defaults); the index-only
 * pages save nothing kvtier could load, and no tier="none" series shows. The namespace's series
 * carries the same sum. */
Test(metrics_scrape, seconds_saved_follow_the_cost_model)
{
    kvd_t d = {0};
    kvd_start(&d, "--policy-model", "llama-3-8b", "--policy-hw", "h200-1gpu", NULL);
    kvt_client_t *c = client_ns(&d, "m", NULL);
    uint32_t tok[45 * PAGE];
    kvd_tokens(tok, 45 * PAGE, 11);
    static uint8_t payload[13 * 512];
    kvt_client_put_t r;
    cr_assert_eq(kvt_client_put(c, tok, 45 * PAGE, 0, 13, payload, NULL, &r), 0);
    cr_assert_eq(r.stored, 13);
    kvt_client_match_t m = {0};
    cr_assert_eq(kvt_client_match(c, tok, 45 * PAGE, 0, 0, NULL, &m), 0);
    cr_assert_eq(m.pages, 45);
    cr_assert_eq(kvt_client_match(c, tok, 7 * PAGE, 0, 0, NULL, &m), 0);
    kvt_client_close(c);
    kvt_model_profile_t mp;
    kvt_hw_profile_t hw;
    cr_assert_eq(kvt_model_profile_get("llama-3-8b", &mp), 0);
    cr_assert_eq(kvt_hw_profile_get("h200-1gpu", &hw), 0);
    double want = saved_dram(&mp, &hw, 13) + saved_dram(&mp, &hw, 7);
    cr_assert_gt(want, 0);
    cr_assert_eq(kvd_http_get(&d, "/metrics", body, sizeof body), 200);
    expect_near(metric(body, "kvtier_prefill_seconds_saved_total{tier=\"dram\"}"), want, "dram");
    cr_expect_eq(metric(body, "kvtier_prefill_seconds_saved_total{tier=\"hbm\"}"), 0);
    cr_expect_eq(metric(body, "kvtier_prefill_seconds_saved_total{tier=\"nvme\"}"), 0);
    cr_expect_eq(metric(body, "kvtier_prefill_seconds_saved_total{tier=\"remote\"}"), 0);
    cr_expect_null(strstr(body, "kvtier_prefill_seconds_saved_total{tier=\"none\"}"));
    expect_near(
        metric(body, "kvtier_namespace_prefill_seconds_saved_total{model=\"m\",adapter=\"\"}"),
        want, "namespace m");
    cr_expect_eq(
        metric(body, "kvtier_namespace_prefill_seconds_saved_total{model=\"_other\",adapter=\"\"}"),
        0);
    kvd_cleanup(&d);
}

/* With metrics-namespaces 2 the first two (model, adapter) pairs get a series each, a name's
 * quote and backslash escaped; the third and fourth share model="_other"; a pair seen again (a
 * second salt, another connection) keeps its series; no fifth series appears. */
Test(metrics_scrape, namespace_series_are_capped)
{
    kvd_t d = {0};
    kvd_start(&d, "--metrics-namespaces", "2", NULL);
    static const struct {
        const char *model, *adapter;
    } ns[] = {{"q\"\\", "lora"}, {"b", NULL}, {"c", NULL}, {"d", "x"}, {"q\"\\", "lora"}};
    uint32_t tok[4 * PAGE];
    kvd_tokens(tok, 4 * PAGE, 5);
    static uint8_t payload[4 * 512];
    for (size_t i = 0; i < sizeof ns / sizeof *ns; i++) {
        kvt_client_t *c = client_ns(&d, ns[i].model, ns[i].adapter);
        kvt_client_put_t r;
        kvt_client_match_t m = {0};
        if (i < 4)
            cr_assert_eq(kvt_client_put(c, tok, 4 * PAGE, 0, 4, payload, NULL, &r), 0);
        cr_assert_eq(kvt_client_match(c, tok, 4 * PAGE, 0, 0, NULL, &m), 0);
        cr_assert_eq(m.pages, 4);
        kvt_client_close(c);
    }
    cr_assert_eq(kvd_http_get(&d, "/metrics", body, sizeof body), 200);
    double one =
        metric(body, "kvtier_namespace_prefill_seconds_saved_total{model=\"b\",adapter=\"\"}");
    cr_assert_gt(one, 0);
    expect_near(metric(body, "kvtier_namespace_prefill_seconds_saved_total{model=\"q\\\"\\\\\","
                             "adapter=\"lora\"}"),
                2 * one, "the escaped name, matched twice");
    expect_near(
        metric(body, "kvtier_namespace_prefill_seconds_saved_total{model=\"_other\",adapter=\"\"}"),
        2 * one, "c and d");
    unsigned series = 0;
    for (const char *p = body; (p = strstr(p, "\nkvtier_namespace_prefill_seconds_saved_total{"));
         p++)
        series++;
    cr_expect_eq(series, 3, "_other and two namespaces, not %u", series);
    kvd_cleanup(&d);
}

/* The field of /proc/PID/<file> that follows key, as a number; -1 when absent. */
static double proc_field(pid_t pid, const char *file, const char *key)
{
    char path[64], line[512];
    snprintf(path, sizeof path, "/proc/%d/%s", (int)pid, file);
    FILE *f = fopen(path, "r");
    double v = -1;
    size_t n = strlen(key);
    while (f && fgets(line, sizeof line, f))
        if (!strncmp(line, key, n)) {
            v = strtod(line + n, NULL);
            break;
        }
    if (f)
        fclose(f);
    return v;
}

/* kvtier_build_info names this build's version and CUDA backend; the process_* gauges agree with
 * what /proc says of the daemon: its start within the test's minute, its open descriptors (ten
 * more with ten clients), its open-file limit, its resident memory. */
Test(metrics_scrape, build_info_and_process_metrics)
{
    time_t t0 = time(NULL);
    kvd_t d = {0};
    kvd_start(&d, NULL);
    cr_assert_eq(kvd_http_get(&d, "/metrics", body, sizeof body), 200);
    char want[128];
    snprintf(want, sizeof want, "\nkvtier_build_info{version=\"%s\",commit=\"", KVT_VERSION);
    const char *bi = strstr(body, want);
    cr_assert(bi, "no %s in the scrape", want + 1);
    snprintf(want, sizeof want, "\",cuda=\"%s\"} 1\n", KVT_HAVE_CUDA ? "yes" : "no");
    const char *end = strchr(bi + 1, '\n');
    cr_expect(end && strstr(bi, want) && strstr(bi, want) < end, "build_info: %.*s",
              end ? (int)(end - bi) : 80, bi + 1);
    double start = metric(body, "process_start_time_seconds");
    cr_expect(start >= (double)t0 - 2 && start <= (double)time(NULL) + 1, "start %.3f, test %lld",
              start, (long long)t0);
    double fds = metric(body, "process_open_fds");
    cr_expect_gt(fds, 3);
    cr_expect_eq(metric(body, "process_max_fds"), proc_field(d.pid, "limits", "Max open files"));
    double rss = metric(body, "process_resident_memory_bytes");
    double vmrss = proc_field(d.pid, "status", "VmRSS:") * 1024;
    cr_expect(rss > 0.5 * vmrss && rss < 2 * vmrss, "rss %.0f, VmRSS %.0f", rss, vmrss);
    cr_expect_geq(metric(body, "process_cpu_seconds_total"), 0);
    kvt_client_t *c[10];
    for (int i = 0; i < 10; i++)
        c[i] = kvd_client(&d, "m", PAGE, 512);
    cr_assert_eq(kvd_http_get(&d, "/metrics", body, sizeof body), 200);
    cr_expect_geq(metric(body, "process_open_fds"), fds + 10);
    for (int i = 0; i < 10; i++)
        kvt_client_close(c[i]);
    expect_near(metric(body, "process_start_time_seconds"), start, "a steady start time");
    kvd_cleanup(&d);
}

/* Which of the cost policy's experts orders the victims (docs/policy.md, "Experts"), as a gauge
 * of 1 + its index and the same STATS entry: on a fresh daemon the value's own order (1), as
 * kvt_policy_stats says until the miniature simulations choose another; under lru, which has no
 * experts, 0. */
Test(metrics_scrape, the_policy_expert_is_a_gauge)
{
    const char *kinds[] = {"cost", "lru"};
    for (int k = 0; k < 2; k++) {
        kvd_t d = {0};
        kvd_start(&d, "--policy", kinds[k], NULL);
        kvt_client_t *c = kvd_client(&d, "m", PAGE, 4096);
        usleep(200000); /* a tick or more: the gauges are set there */
        static stats_list_t l;
        l.n = 0;
        cr_assert_eq(kvt_client_stats(c, stats_take, &l), 0);
        cr_assert_eq(kvd_http_get(&d, "/metrics", body, sizeof body), 200);
        double want = k == 0 ? 1 + KVT_POLICY_EXPERT_COST : 0;
        cr_expect_eq(metric(body, "kvtier_policy_expert"), want, "%s", kinds[k]);
        cr_expect_eq(stats_value(&l, "policy_expert"), (uint64_t)want, "%s", kinds[k]);
        cr_expect(strstr(body, "# TYPE kvtier_policy_expert gauge"), "a gauge");
        kvt_client_close(c);
        kvd_cleanup(&d);
    }
}
