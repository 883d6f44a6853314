/*
 * test_server_limits.c: what a client can hold by being slow, silent or many, against the real
 * daemon (issue 31): connection slots held by connections that say nothing, say only HELLO or
 * send a few bytes of a header; max-client-bytes held by frames one byte short; the metrics port
 * under connection churn and fed bytes that are not HTTP. Each attack runs beside an innocent
 * client whose requests must complete within 2 s; the attacks are shrunk through the settings
 * (a few connections, small memory, short deadlines) so that each test takes about a second.
 */
#include <pthread.h>
#include <time.h>

#include "proto.h"
#include "test_server_harness.h"

#define PAGE     16
#define LIMIT_MS 2000 /* an innocent request's deadline */

static char text[1 << 20];

static uint64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

/* A series' value from a scrape of /metrics, which must have it (kvd_metric's -1 for none: the
 * series read here are counts and byte totals, never negative). */
static double metric(const kvd_t *d, const char *series)
{
    double v = kvd_metric(d, series);
    cr_assert_geq(v, 0, "no series %s", series);
    return v;
}

/* Scrapes until series reaches at least v (2 s at most); returns the last value. */
static double metric_reaches(const kvd_t *d, const char *series, double v)
{
    double x = 0;
    for (uint64_t end = now_ms() + LIMIT_MS; (x = metric(d, series)) < v && now_ms() < end;)
        usleep(10000);
    return x;
}

/* Writes len bytes to fd (non-blocking) as far as the peer takes them before the deadline;
 * returns how many went. */
static size_t send_until(int fd, const uint8_t *p, size_t len, uint64_t deadline)
{
    int fl = fcntl(fd, F_GETFL);
    fcntl(fd, F_SETFL, fl | O_NONBLOCK);
    size_t sent = 0;
    while (sent < len) {
        ssize_t w = write(fd, p + sent, len - sent);
        if (w > 0) {
            sent += (size_t)w;
            continue;
        }
        uint64_t now = now_ms();
        if ((w < 0 && errno != EAGAIN && errno != EINTR) || now >= deadline)
            break;
        struct pollfd pf = {.fd = fd, .events = POLLOUT};
        poll(&pf, 1, (int)(deadline - now));
    }
    fcntl(fd, F_SETFL, fl);
    return sent;
}

/* Reads exactly len bytes before the deadline: 0, or -1 (closed, or too late). */
static int recv_until(int fd, uint8_t *p, size_t len, uint64_t deadline)
{
    size_t got = 0;
    while (got < len) {
        uint64_t now = now_ms();
        struct pollfd pf = {.fd = fd, .events = POLLIN};
        if (now >= deadline || poll(&pf, 1, (int)(deadline - now)) != 1)
            return -1;
        ssize_t r = read(fd, p + got, len - got);
        if (r <= 0)
            return -1;
        got += (size_t)r;
    }
    return 0;
}

/* The daemon closed fd within ms: end of file, or a reset (it closed with bytes of ours still
 * unread). */
static int closed_within(int fd, int ms)
{
    struct pollfd pf = {.fd = fd, .events = POLLIN};
    if (poll(&pf, 1, ms) != 1)
        return 0;
    uint8_t b;
    ssize_t n = read(fd, &b, 1);
    return n == 0 || (n < 0 && errno == ECONNRESET);
}

static void frame(int fd, unsigned op, uint64_t id, const void *body, uint32_t len)
{
    uint8_t hdr[KVT_PROTO_HDR];
    kvt_proto_frame(hdr, op, 0, id, 0, len);
    cr_assert_eq(write(fd, hdr, sizeof hdr), (ssize_t)sizeof hdr);
    if (len)
        cr_assert_eq(send_until(fd, body, len, now_ms() + LIMIT_MS), len,
                     "the daemon did not take a %u-byte frame within %d ms", len, LIMIT_MS);
}

/* Reads one reply of request id: its status; its body (up to cap bytes) to body. */
static int reply(int fd, uint64_t id, uint8_t *body, size_t cap, uint32_t *len, uint64_t deadline)
{
    uint8_t hdr[KVT_PROTO_HDR];
    cr_assert_eq(recv_until(fd, hdr, sizeof hdr, deadline), 0, "no reply to request %llu in time",
                 (unsigned long long)id);
    kvt_proto_hdr_t h;
    kvt_proto_hdr_decode(hdr, &h);
    cr_assert_eq(h.request_id, id);
    cr_assert_leq(h.body_len, cap);
    cr_assert_eq(recv_until(fd, body, h.body_len, deadline), 0, "reply %llu cut short",
                 (unsigned long long)id);
    if (len)
        *len = h.body_len;
    return h.status;
}

static void raw_hello(int fd)
{
    uint8_t body[64];
    kvt_wire_hello_t w = {
        .min_version = 1, .max_version = 1, .page_size = PAGE, .block_bytes = 0, .model_len = 1};
    memcpy(body, &w, sizeof w);
    body[sizeof w] = 'm';
    frame(fd, KVT_OP_HELLO, 1, body, sizeof w + 1);
    uint8_t r[256];
    cr_assert_eq(reply(fd, 1, r, sizeof r, NULL, now_ms() + LIMIT_MS), 0);
}

/* Ten bytes of a frame's header, and nothing more. */
static void ten_bytes(int fd)
{
    uint8_t hdr[KVT_PROTO_HDR];
    kvt_proto_frame(hdr, KVT_OP_PING, 0, 7, 0, 0);
    cr_assert_eq(write(fd, hdr, 10), 10);
}

/* A new client: connected (HELLO answered) and a PING answered, within LIMIT_MS however often it
 * has to try (a connection refused at max-conns is closed at once). NULL if it never was. */
static kvt_client_t *innocent(const kvd_t *d, uint64_t *took_ms)
{
    kvt_client_conf_t conf = {
        .unix_path = d->sock, .model = "m", .page_size = PAGE, .timeout_ms = LIMIT_MS};
    uint64_t t0 = now_ms();
    kvt_client_t *c = NULL;
    while (now_ms() - t0 < LIMIT_MS) {
        if (kvt_client_connect(&c, &conf) == 0) {
            if (kvt_client_ping(c, NULL) == 0)
                break;
            kvt_client_close(c);
        }
        c = NULL;
        usleep(20000);
    }
    *took_ms = now_ms() - t0;
    return c;
}

/*
 * max-conns 4, all taken: a connection holding a lease, one that only connected, one that only
 * said HELLO, one that sent ten bytes of a header. New clients are served at once, each closing
 * the connection idle the longest that holds no lease and no request; the one with the lease
 * is never chosen, even when it is the longest idle.
 */
Test(server_limits, idle_connections_make_room_at_max_conns)
{
    kvd_t d = {0};
    kvd_start(&d, "--max-conns", "4", "--evict-idle-ms", "400", NULL);
    kvt_client_t *lessee = kvd_client(&d, "m", PAGE, 0);
    uint32_t tok[4 * PAGE];
    kvd_tokens(tok, 4 * PAGE, 1);
    kvt_client_put_t p;
    cr_assert_eq(kvt_client_put(lessee, tok, 4 * PAGE, 0, 0, NULL, NULL, &p), 0);
    kvt_client_match_t m = {0};
    cr_assert_eq(kvt_client_match(lessee, tok, 4 * PAGE, KVT_CLIENT_LEASE, 60000, NULL, &m), 0);
    cr_assert_neq(m.lease, 0);
    int silent = kvd_raw(&d);
    kvt_client_t *quiet = kvd_client(&d, "m", PAGE, 0);
    int slow = kvd_raw(&d);
    ten_bytes(slow);
    usleep(600000); /* every one of them idle past evict-idle-ms */

    kvt_client_t *fresh[4];
    for (int i = 0; i < 3; i++) {
        uint64_t took;
        fresh[i] = innocent(&d, &took);
        cr_assert(fresh[i], "new client %d not served within %d ms", i, LIMIT_MS);
        cr_expect_lt(took, LIMIT_MS, "new client %d took %llu ms", i, (unsigned long long)took);
    }
    cr_expect(closed_within(silent, LIMIT_MS), "the silent connection was closed");
    cr_expect(closed_within(slow, LIMIT_MS), "the ten-byte one was closed");
    cr_expect_neq(kvt_client_ping(quiet, NULL), 0, "the HELLO-only one was closed");
    /* Now the lessee is the longest idle: a fourth newcomer closes the first one instead. */
    usleep(600000);
    uint64_t took;
    fresh[3] = innocent(&d, &took);
    cr_assert(fresh[3], "a fourth new client is served");
    cr_expect_neq(kvt_client_ping(fresh[0], NULL), 0, "the first newcomer, idle, was closed");
    int released = 0;
    cr_expect_eq(kvt_client_release(lessee, m.lease, &released), 0);
    cr_expect(released, "the connection holding a lease kept it");
    cr_expect_eq(metric(&d, "kvtier_connections_evicted_total"), 4);
    for (int i = 0; i < 4; i++)
        kvt_client_close(fresh[i]);
    kvt_client_close(quiet);
    kvt_client_close(lessee);
    close(silent);
    close(slow);
    kvd_cleanup(&d);
}

/*
 * max-conns 4, taken by a client that said HELLO and then idles, one that says nothing, one that
 * sent ten bytes of its first frame and one that sent ten bytes after its HELLO (no eviction:
 * evict-idle-ms 0). The second and third get no whole first frame in within hello-timeout-ms,
 * the fourth does not finish its frame within frame-timeout-ms: all three are closed, and a new
 * client is served within 2 s; the idle client that said HELLO is not touched.
 */
Test(server_limits, silent_and_slow_connections_are_closed)
{
    kvd_t d = {0};
    kvd_start(&d, "--max-conns", "4", "--evict-idle-ms", "0", "--hello-timeout-ms", "300",
              "--frame-timeout-ms", "300", NULL);
    kvt_client_t *early = kvd_client(&d, "m", PAGE, 0);
    int silent = kvd_raw(&d), slow_first = kvd_raw(&d), slow_next = kvd_raw(&d);
    ten_bytes(slow_first);
    raw_hello(slow_next);
    ten_bytes(slow_next);

    uint64_t took;
    kvt_client_t *c = innocent(&d, &took);
    cr_assert(c, "a new client is not served within %d ms", LIMIT_MS);
    cr_expect_lt(took, LIMIT_MS);
    cr_expect(closed_within(silent, LIMIT_MS), "the silent connection was closed");
    cr_expect(closed_within(slow_first, LIMIT_MS), "the slow first frame's was closed");
    cr_expect(closed_within(slow_next, LIMIT_MS), "the slow second frame's was closed");
    usleep(400000);
    cr_expect_eq(kvt_client_ping(early, NULL), 0, "an idle connection past its HELLO stays");
    cr_expect_eq(metric(&d, "kvtier_connections_hello_timed_out_total"), 2);
    cr_expect_eq(metric(&d, "kvtier_connections_frame_timed_out_total"), 1);
    kvt_client_close(c);
    kvt_client_close(early);
    close(silent);
    close(slow_first);
    close(slow_next);
    kvd_cleanup(&d);
}

/*
 * max-frame 1M, max-client-bytes 2M: four connections each send a 1 MiB frame one byte short;
 * the buffers of three take the clients' memory, the fourth waits for it. Another client's 1 MiB
 * PING must be answered within 2 s all the same: the stalled frames are closed after
 * frame-timeout-ms (300) and their memory goes back. A frame that takes longer than that but
 * keeps arriving at frame-min-rate is not cut off, and once all are gone nothing is held.
 */
Test(server_limits, a_stalled_big_frame_gives_its_memory_back)
{
    enum { BODY = 1 << 20 };
    kvd_t d = {0};
    kvd_start(&d, "--max-frame", "1M", "--max-client-bytes", "2M", "--frame-timeout-ms", "300",
              "--frame-min-rate", "64K", NULL);
    int good = kvd_raw(&d);
    raw_hello(good);
    uint8_t *body = malloc(BODY), *back = malloc(BODY);
    cr_assert(body && back);
    kvd_fill(body, BODY, 3);
    int att[4];
    for (int i = 0; i < 4; i++) {
        att[i] = kvd_raw(&d);
        uint8_t hdr[KVT_PROTO_HDR];
        kvt_proto_frame(hdr, KVT_OP_PING, 0, 9, 0, BODY);
        cr_assert_eq(write(att[i], hdr, sizeof hdr), (ssize_t)sizeof hdr);
        send_until(att[i], body, BODY - 1, now_ms() + (i < 3 ? LIMIT_MS : 100));
    }
    cr_assert_geq(metric_reaches(&d, "kvtier_client_buffer_bytes", 3.0 * (BODY / 2)),
                  3.0 * (BODY / 2), "three stalled frames hold the clients' memory");

    uint64_t t0 = now_ms();
    frame(good, KVT_OP_PING, 2, body, BODY);
    uint32_t len = 0;
    cr_assert_eq(reply(good, 2, back, BODY, &len, t0 + LIMIT_MS), 0);
    uint64_t took = now_ms() - t0;
    cr_expect_lt(took, LIMIT_MS, "the PING took %llu ms", (unsigned long long)took);
    cr_assert_eq(len, BODY);
    cr_expect(memcmp(back, body, BODY) == 0);
    for (int i = 0; i < 4; i++) {
        cr_expect(closed_within(att[i], LIMIT_MS), "stalled connection %d was closed", i);
        close(att[i]);
    }
    cr_expect_geq(metric(&d, "kvtier_connections_frame_timed_out_total"), 3);

    /* 1 MiB in 32 KiB pieces 25 ms apart: about 800 ms, well over frame-timeout-ms, at about
     * 1.3 MB/s, well over frame-min-rate. */
    uint8_t hdr[KVT_PROTO_HDR];
    kvt_proto_frame(hdr, KVT_OP_PING, 0, 3, 0, BODY);
    cr_assert_eq(write(good, hdr, sizeof hdr), (ssize_t)sizeof hdr);
    for (size_t off = 0; off < BODY; off += 32 << 10) {
        usleep(25000);
        cr_assert_eq(send_until(good, body + off, 32 << 10, now_ms() + LIMIT_MS), 32u << 10);
    }
    cr_assert_eq(reply(good, 3, back, BODY, &len, now_ms() + LIMIT_MS), 0,
                 "a slow but steady frame is answered");
    cr_expect(memcmp(back, body, BODY) == 0);
    cr_expect_eq(metric_reaches(&d, "kvtier_connections_frame_timed_out_total", 4), 4);
    double held = 1;
    for (uint64_t end = now_ms() + LIMIT_MS; held > 0 && now_ms() < end; usleep(10000))
        held = metric(&d, "kvtier_client_buffer_bytes");
    cr_expect_eq(held, 0, "what the stalled frames held went back");
    close(good);
    free(body);
    free(back);
    kvd_cleanup(&d);
}

/* Connections to the metrics port, opened and closed by a thread: 80 open at a time (the port
 * keeps 64), one replaced every 10 ms. */
typedef struct churn {
    struct sockaddr_in sin;
    volatile int stop;
    unsigned opened;
} churn_t;

static int churn_open(churn_t *ch)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    if (fd >= 0) {
        connect(fd, (struct sockaddr *)&ch->sin, sizeof ch->sin);
        ch->opened++;
    }
    return fd;
}

static void *churn_run(void *arg)
{
    churn_t *ch = arg;
    int fds[80];
    for (int i = 0; i < 80; i++)
        fds[i] = churn_open(ch);
    for (unsigned k = 0; !ch->stop; k = (k + 1) % 80) {
        usleep(10000);
        if (fds[k] >= 0)
            close(fds[k]);
        fds[k] = churn_open(ch);
    }
    for (int i = 0; i < 80; i++)
        if (fds[i] >= 0)
            close(fds[i]);
    return NULL;
}

/* GET /metrics in one go: the HTTP status, 0 when it failed or was not whole by the deadline. */
static int scrape(const struct sockaddr_in *sin, uint64_t deadline)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    cr_assert(fd >= 0);
    int status = 0;
    const char req[] = "GET /metrics HTTP/1.1\r\nHost: kvtierd\r\n\r\n";
    if (connect(fd, (const struct sockaddr *)sin, sizeof *sin) == 0 &&
        write(fd, req, sizeof req - 1) == (ssize_t)(sizeof req - 1)) {
        size_t len = 0;
        for (;;) {
            uint64_t now = now_ms();
            struct pollfd pf = {.fd = fd, .events = POLLIN};
            if (now >= deadline || poll(&pf, 1, (int)(deadline - now)) != 1)
                break;
            ssize_t r = read(fd, text + len, sizeof text - 1 - len);
            if (r <= 0) {
                text[len] = 0;
                if (r == 0 && strstr(text, "kvtier_connections "))
                    sscanf(text, "HTTP/1.1 %d", &status);
                break;
            }
            len += (size_t)r;
        }
    }
    close(fd);
    return status;
}

/* Under that churn, ten scrapes each complete within 2 s. */
Test(server_limits, scrapes_get_through_connection_churn)
{
    kvd_t d = {0};
    kvd_start(&d, NULL);
    char host[64];
    unsigned port = 0;
    cr_assert_eq(sscanf(d.metrics, "%63[^:]:%u", host, &port), 2);
    churn_t ch = {.sin = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)}};
    inet_pton(AF_INET, host, &ch.sin.sin_addr);
    pthread_t th;
    cr_assert_eq(pthread_create(&th, NULL, churn_run, &ch), 0);
    usleep(200000);
    int ok = 0;
    for (int i = 0; i < 10; i++) {
        uint64_t t0 = now_ms();
        int status = scrape(&ch.sin, t0 + LIMIT_MS);
        ok += status == 200;
        cr_expect_eq(status, 200, "scrape %d: status %d after %llu ms", i, status,
                     (unsigned long long)(now_ms() - t0));
        usleep(50000);
    }
    ch.stop = 1;
    pthread_join(th, NULL);
    cr_expect_eq(ok, 10, "%d of 10 scrapes got through (%u connections churned)", ok, ch.opened);
    cr_expect_gt(metric(&d, "kvtier_metrics_connections_evicted_total"), 0);
    kvd_cleanup(&d);
}

/* Bytes that are not an HTTP request line get a 400 at once, without a wait for a blank line. */
Test(server_limits, garbage_on_the_metrics_port_gets_400)
{
    kvd_t d = {0};
    kvd_start(&d, NULL);
    char host[64];
    unsigned port = 0;
    cr_assert_eq(sscanf(d.metrics, "%63[^:]:%u", host, &port), 2);
    struct sockaddr_in sin = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    inet_pton(AF_INET, host, &sin.sin_addr);
    uint8_t ping[KVT_PROTO_HDR];
    kvt_proto_frame(ping, KVT_OP_PING, 0, 1, 0, 0);
    const struct {
        const char *what;
        const void *bytes;
        size_t len;
    } cases[] = {
        {"a TLS hello", "\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03", 11},
        {"a kvtier frame", ping, sizeof ping},
        {"words", "hello there\r\n\r\n", 15},
        {"a line with no version", "GET /metrics\r\n", 14},
        {"a control byte", "GET /met\x01rics HTTP/1.1\r\n", 24},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        cr_assert_eq(connect(fd, (struct sockaddr *)&sin, sizeof sin), 0);
        cr_assert_eq(write(fd, cases[i].bytes, cases[i].len), (ssize_t)cases[i].len);
        char buf[512];
        size_t len = 0;
        uint64_t deadline = now_ms() + LIMIT_MS;
        for (;;) {
            uint64_t now = now_ms();
            struct pollfd pf = {.fd = fd, .events = POLLIN};
            if (now >= deadline || poll(&pf, 1, (int)(deadline - now)) != 1)
                break;
            ssize_t r = read(fd, buf + len, sizeof buf - 1 - len);
            if (r <= 0)
                break;
            len += (size_t)r;
        }
        buf[len] = 0;
        cr_expect(!strncmp(buf, "HTTP/1.1 400 ", 13), "%s: got \"%.40s\"", cases[i].what, buf);
        close(fd);
    }
    cr_expect_eq(kvd_http_get(&d, "/healthz", text, sizeof text), 200, "a real request is served");
    kvd_cleanup(&d);
}

/* Connects n sockets to the daemon's TCP (is_unix 0) or Unix (1) listener without waiting for
 * an accept, closes them (RST) and returns how many the kernel queued for the daemon: a Unix
 * connect past a full accept queue fails with EAGAIN at once, a TCP one has its SYN dropped and
 * would retry a second later, so a TCP socket counts when its handshake is done 300 ms on. */
static int queued_connects(const kvd_t *d, int is_unix, int n)
{
    int *fds = calloc((size_t)n, sizeof *fds), queued = 0;
    cr_assert(fds);
    struct sockaddr_un sun = {.sun_family = AF_UNIX};
    memcpy(sun.sun_path, d->sock, strlen(d->sock) + 1);
    struct sockaddr_in sin = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    const char *colon = strrchr(d->tcp, ':');
    cr_assert(colon, "tcp address %s", d->tcp);
    sin.sin_port = htons((uint16_t)atoi(colon + 1));
    for (int i = 0; i < n; i++) {
        fds[i] = socket(is_unix ? AF_UNIX : AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
        cr_assert(fds[i] >= 0, "socket %d: %s", i, strerror(errno));
        int rc = is_unix ? connect(fds[i], (struct sockaddr *)&sun, sizeof sun)
                         : connect(fds[i], (struct sockaddr *)&sin, sizeof sin);
        cr_assert(rc == 0 || errno == EINPROGRESS || (is_unix && errno == EAGAIN), "connect %d: %s",
                  i, strerror(errno));
        queued += is_unix && rc == 0;
    }
    if (!is_unix) {
        usleep(300000);
        for (int i = 0; i < n; i++) {
            struct pollfd p = {.fd = fds[i], .events = POLLOUT};
            int err = -1;
            socklen_t el = sizeof err;
            if (poll(&p, 1, 0) == 1 && (p.revents & POLLOUT) &&
                getsockopt(fds[i], SOL_SOCKET, SO_ERROR, &err, &el) == 0 && err == 0)
                queued++;
        }
    }
    struct linger lg = {.l_onoff = 1, .l_linger = 0};
    for (int i = 0; i < n; i++) {
        setsockopt(fds[i], SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
        close(fds[i]);
    }
    free(fds);
    return queued;
}

/*
 * A daemon that does not accept for a moment (stopped here; a long step or a busy host's
 * scheduler in practice) still finds a burst of 1,000 connections queued for it, on TCP and on
 * the Unix socket: its listeners ask for the kernel's most (SOMAXCONN, capped by
 * net.core.somaxconn). With 512, a TCP client past 512 queued had its SYN dropped and waited a
 * second for the retry (bench_accept's storm got 0.5-3 k connections/s out of kvtierd against
 * 17-58 k once it queues 4,096), and a Unix client was refused with EAGAIN. Served afterwards.
 */
Test(server_limits, connections_queue_while_the_daemon_does_not_accept, .timeout = 60)
{
    enum { BURST = 1000 };
    FILE *f = fopen("/proc/sys/net/core/somaxconn", "r");
    int somaxconn = 0;
    if (f) {
        if (fscanf(f, "%d", &somaxconn) != 1)
            somaxconn = 0;
        fclose(f);
    }
    if (somaxconn < BURST + 1)
        cr_skip_test("net.core.somaxconn is %d: no listener queues %d connections", somaxconn,
                     BURST);
    kvd_t d = {0};
    kvd_start(&d, "--max-conns", "4096", NULL);
    cr_assert_eq(kill(d.pid, SIGSTOP), 0);
    int tcp = queued_connects(&d, 0, BURST);
    int unx = queued_connects(&d, 1, BURST);
    cr_assert_eq(kill(d.pid, SIGCONT), 0);
    cr_expect_eq(tcp, BURST, "TCP: %d of %d connections queued", tcp, BURST);
    cr_expect_eq(unx, BURST, "Unix: %d of %d connections queued", unx, BURST);
    uint64_t took;
    kvt_client_t *c = innocent(&d, &took);
    cr_assert(c, "a client is served once the daemon accepts again");
    kvt_client_close(c);
    kvd_cleanup(&d);
}
