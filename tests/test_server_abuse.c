/*
 * test_server_abuse.c: a client attacking the daemon from outside, beside an innocent one: a
 * flood of made-up namespaces (max-namespaces), names that would forge log lines, a payload on an
 * index-only connection, guessing the secret, and floods of error replies. Each attack is shrunk
 * through the daemon's settings (a few namespaces, a low rate) so that it takes a second or two;
 * each checks that the innocent client is served within a generous deadline, and that what the
 * attack did is bounded and counted.
 */
#include <sys/uio.h>
#include <time.h>

#include "radix.h"
#include "proto.h"
#include "test_raw_frames.h"
#include "test_server_harness.h"

static void raw_send(int fd, unsigned op, uint16_t flags, uint64_t id, const void *body,
                     uint32_t len)
{
    raw_frame(fd, op, flags, id, body, len, KVT_PROTO_MAGIC, KVT_PROTO_VERSION);
}

/* Reads one reply to request id of opcode op; returns its status. body (if given, 4096 bytes)
 * gets its body, NUL-terminated. */
static int reply(int fd, unsigned op, uint64_t id, char *body)
{
    uint8_t hdr[KVT_PROTO_HDR];
    cr_assert_eq(read_full(fd, hdr, sizeof hdr), 0, "no reply to request %llu",
                 (unsigned long long)id);
    kvt_proto_hdr_t h;
    kvt_proto_hdr_decode(hdr, &h);
    cr_assert_eq(h.request_id, id);
    cr_assert_eq(h.opcode, op | KVT_OP_REPLY, "opcode 0x%x", h.opcode);
    cr_assert_lt(h.body_len, 4096);
    char tmp[4096];
    cr_assert_eq(read_full(fd, (uint8_t *)(body ? body : tmp), h.body_len), 0);
    (body ? body : tmp)[h.body_len] = 0;
    return h.status;
}

static int closed(int fd)
{
    uint8_t b;
    ssize_t n = read(fd, &b, 1);
    return n == 0 || (n < 0 && errno == ECONNRESET);
}

/* HELLO for (model, salt) with the given block size; returns the status. */
static int hello(int fd, uint64_t id, const char *model, size_t model_len, const char *salt,
                 uint32_t bb, char *msg)
{
    uint8_t body[1024];
    size_t sl = salt ? strlen(salt) : 0;
    kvt_wire_hello_t w = {.min_version = 1,
                          .max_version = 1,
                          .page_size = 4,
                          .block_bytes = bb,
                          .model_len = (uint16_t)model_len,
                          .salt_len = (uint16_t)sl};
    memcpy(body, &w, sizeof w);
    memcpy(body + sizeof w, model, model_len);
    if (sl) /* memcpy's source must not be NULL, even for 0 bytes */
        memcpy(body + sizeof w + model_len, salt, sl);
    raw_send(fd, KVT_OP_HELLO, 0, id, body, (uint32_t)(sizeof w + model_len + sl));
    return reply(fd, KVT_OP_HELLO, id, msg);
}

/* PUT of one page (4 tokens from base), with npayload pages of bb bytes; returns the status. */
static int put1(int fd, uint64_t id, uint32_t base, uint32_t npayload, uint32_t bb)
{
    uint8_t body[256] = {0};
    kvt_wire_put_t w = {.ntokens = 4, .npayload = npayload};
    memcpy(body, &w, sizeof w);
    for (uint32_t i = 0; i < 4; i++)
        kvt_put_u32(body + sizeof w + 4 * i, base + i);
    memset(body + sizeof w + 16, 0x5a, (size_t)npayload * bb);
    raw_send(fd, KVT_OP_PUT, 0, id, body, (uint32_t)(sizeof w + 16 + (size_t)npayload * bb));
    return reply(fd, KVT_OP_PUT, id, NULL);
}

static double metric(const kvd_t *d, const char *name)
{
    static char body[1 << 17];
    char key[128];
    cr_assert_eq(kvd_http_get(d, "/metrics", body, sizeof body), 200);
    snprintf(key, sizeof key, "\n%s ", name);
    char *line = strstr(body, key);
    cr_assert(line, "%s missing", name);
    return atof(line + strlen(key));
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static kvt_client_t *connect_as(const kvd_t *d, const char *model, const char *salt,
                                const char *secret, int *rc)
{
    kvt_client_conf_t conf = {.unix_path = d->sock,
                              .model = model,
                              .salt = salt,
                              .secret = secret,
                              .page_size = 4,
                              .block_bytes = 16,
                              .timeout_ms = 10000};
    kvt_client_t *c = NULL;
    *rc = kvt_client_connect(&c, &conf);
    return c;
}

static size_t count(const char *s, const char *what)
{
    size_t n = 0;
    for (const char *p = s; (p = strstr(p, what)); p++)
        n++;
    return n;
}

/*
 * One client makes up a namespace per request (a salt each), leaving one index-only page in
 * each: with max-namespaces 8 it fills the table in eight requests, and the pages are far below
 * index-bytes. A new tenant's HELLO still gets a namespace at once, while the attacker is
 * connected and after it left: the pages of the cheapest namespace nobody uses go (one page),
 * never those of a tenant that stored more, nor of one a connection uses.
 */
Test(server_abuse, a_namespace_flood_does_not_lock_new_tenants_out)
{
    kvd_t d = {0};
    kvd_start(&d, "--max-namespaces", "8", NULL);
    int rc;
    /* A tenant that stored four pages and went. */
    kvt_client_t *keep = connect_as(&d, "keeper", NULL, NULL, &rc);
    cr_assert_eq(rc, 0);
    uint32_t tok[16];
    kvd_tokens(tok, 16, 3);
    uint8_t pay[4 * 16];
    kvd_fill(pay, sizeof pay, 1);
    kvt_client_put_t pr;
    cr_assert_eq(kvt_client_put(keep, tok, 16, 0, 4, pay, NULL, &pr), 0);
    cr_assert_eq(pr.stored, 4);
    kvt_client_close(keep);
    /* A tenant connected all along. */
    kvt_client_t *live = connect_as(&d, "live", NULL, NULL, &rc);
    cr_assert_eq(rc, 0);

    int fd = kvd_raw(&d);
    for (uint32_t i = 0; i < 40; i++) {
        char salt[32];
        snprintf(salt, sizeof salt, "salt-%u", i);
        if (hello(fd, 2 * i + 1, "m", 1, salt, 0, NULL) == 0)
            cr_assert_eq(put1(fd, 2 * i + 2, 100 + i, 0, 0), 0);
    }
    double t0 = now_s();
    kvt_client_t *fresh = connect_as(&d, "newcomer", NULL, NULL, &rc);
    double took = now_s() - t0;
    cr_expect_eq(rc, 0, "a new tenant beside the attacker: %s", kvt_client_strerror(rc));
    cr_expect_lt(took, 2.0, "its HELLO took %.2f s", took);
    if (fresh)
        kvt_client_close(fresh);
    close(fd);

    /* The attacker left; its namespaces stay full of pages. */
    t0 = now_s();
    fresh = connect_as(&d, "later", NULL, NULL, &rc);
    took = now_s() - t0;
    cr_expect_eq(rc, 0, "a new tenant after the attacker left: %s", kvt_client_strerror(rc));
    cr_expect_lt(took, 2.0, "its HELLO took %.2f s", took);
    if (fresh)
        kvt_client_close(fresh);

    /* The tenant with four pages kept them; so did the one connected. */
    keep = connect_as(&d, "keeper", NULL, NULL, &rc);
    cr_assert_eq(rc, 0, "the keeper's namespace is back: %s", kvt_client_strerror(rc));
    kvt_client_match_t m = {0};
    cr_assert_eq(kvt_client_match(keep, tok, 16, 0, 0, NULL, &m), 0);
    cr_expect_eq(m.pages, 4, "the namespace with the most pages was not the one to go");
    kvt_client_close(keep);
    cr_expect_eq(kvt_client_ping(live, NULL), 0);
    cr_expect_geq(metric(&d, "kvtier_namespaces_evicted_total"), 2);
    cr_expect_leq(kvd_stat(live, "namespaces"), 8);
    kvt_client_close(live);
    kvd_cleanup(&d);
}

/*
 * What cannot be evicted: a namespace a connection declared, and one a lease holds. With both
 * of max-namespaces 2 so held, a new namespace gets ENOSPC; once the lease goes, the leased
 * namespace's pages are evicted for it.
 */
Test(server_abuse, namespaces_in_use_or_leased_are_never_evicted)
{
    kvd_t d = {0};
    kvd_start(&d, "--max-namespaces", "2", NULL);
    int rc;
    kvt_client_t *a = connect_as(&d, "a", NULL, NULL, &rc);
    cr_assert_eq(rc, 0);
    int fd = kvd_raw(&d);
    cr_assert_eq(hello(fd, 1, "b", 1, NULL, 0, NULL), 0);
    cr_assert_eq(put1(fd, 2, 7, 0, 0), 0);
    uint8_t body[64] = {0};
    kvt_wire_match_t w = {.ntokens = 4};
    memcpy(body, &w, sizeof w);
    for (uint32_t i = 0; i < 4; i++)
        kvt_put_u32(body + sizeof w + 4 * i, 7 + i);
    raw_send(fd, KVT_OP_MATCH, KVT_MATCH_F_LEASE, 3, body, sizeof w + 16);
    char out[4096];
    cr_assert_eq(reply(fd, KVT_OP_MATCH, 3, out), 0);
    kvt_wire_match_reply_t mr;
    memcpy(&mr, out, sizeof mr);
    cr_assert_eq(mr.pages, 1);
    cr_assert_neq(mr.lease, 0);
    /* b is leased but declared by no one any more (the connection moves on to a); a is declared. */
    cr_assert_eq(hello(fd, 7, "a", 1, NULL, 0, NULL), 0);
    char msg[4096];
    cr_expect_eq(hello(fd, 4, "c", 1, NULL, 0, msg), KVT_ENOSPC);
    cr_expect(strstr(msg, "leased"), "the refusal says why: %s", msg);
    kvt_wire_release_t rel = {.lease = mr.lease};
    raw_send(fd, KVT_OP_RELEASE, 0, 5, &rel, sizeof rel);
    cr_assert_eq(reply(fd, KVT_OP_RELEASE, 5, NULL), 0);
    cr_expect_eq(hello(fd, 6, "c", 1, NULL, 0, NULL), 0, "b's page went for c");
    cr_expect_eq(kvt_client_ping(a, NULL), 0);
    close(fd);
    kvt_client_close(a);
    kvd_cleanup(&d);
}

/* kvt_radix_ns_clear against the tree's own verification: every page of one namespace goes,
 * the other namespace's stay, and a leased one is refused whole. */
Test(server_abuse, radix_ns_clear_drops_one_namespace_whole)
{
    kvt_radix_t *t;
    cr_assert_eq(kvt_radix_create(&t, NULL), 0);
    uint32_t a, b, tok[64];
    cr_assert_eq(kvt_radix_ns_open(t, "a", NULL, NULL, 4, &a), 0);
    cr_assert_eq(kvt_radix_ns_open(t, "b", NULL, NULL, 4, &b), 0);
    for (uint32_t i = 0; i < 20; i++) {
        kvd_tokens(tok, 64, i % 3);
        tok[8 + i % 50] = 1000 + i; /* branches */
        kvt_insert_t r;
        cr_assert_eq(kvt_radix_insert(t, a, tok, 64, &r), 0);
        cr_assert_eq(kvt_radix_insert(t, b, tok, 32, &r), 0);
    }
    uint64_t ba = kvt_radix_ns_blocks(t, a), bb = kvt_radix_ns_blocks(t, b);
    kvt_radix_stats_t st;
    kvt_radix_stats(t, &st);
    cr_assert_eq(ba + bb, st.blocks);
    cr_assert_eq(kvt_radix_verify(t), 0);
    kvt_match_t m;
    cr_assert_eq(kvt_radix_match(t, b, tok, 32, 0, &m), 0);
    uint64_t lease;
    cr_assert_eq(kvt_radix_lease(t, &m, 5, &lease), 0);
    cr_expect_eq(kvt_radix_ns_clear(t, b), KVT_EBUSY);
    cr_expect_eq(kvt_radix_ns_blocks(t, b), bb, "nothing changed");
    cr_assert_eq(kvt_radix_release(t, lease), 0);
    cr_expect_eq(kvt_radix_ns_clear(t, b), 0);
    cr_expect_eq(kvt_radix_ns_blocks(t, b), 0);
    cr_expect_eq(kvt_radix_ns_blocks(t, a), ba);
    cr_expect_eq(kvt_radix_verify(t), 0);
    cr_expect_eq(kvt_radix_ns_close(t, b), 0);
    cr_expect_eq(kvt_radix_verify(t), 0);
    kvt_radix_destroy(t);
}

/* The log line a client's string reaches, at any level, is one line. */
Test(server_abuse, log_strings_are_escaped_and_capped)
{
    char out[KVT_LOG_STR_CAP(KVT_LOG_STR_MAX)];
    static const char in[] = "a\nb\\c\x1b\xff\xc2\x85 \xc3\xa9";
    kvt_log_str(out, sizeof out, in, sizeof in - 1, KVT_LOG_STR_MAX);
    cr_expect_str_eq(out, "a\\nb\\\\c\\x1b\\xff\\xc2\\x85 \xc3\xa9");
    char longer[300];
    memset(longer, '\n', sizeof longer);
    kvt_log_str(out, sizeof out, longer, sizeof longer, KVT_LOG_STR_MAX);
    cr_expect_eq(strlen(out), 2 * KVT_LOG_STR_MAX + 3);
    cr_expect(strstr(out, "...") == out + strlen(out) - 3, "a cut string says so: %s", out);
    char tiny[8];
    kvt_log_str(tiny, sizeof tiny, "\x01\x02\x03", 3, 64);
    cr_expect_str_eq(tiny, "\\x01...", "no half escape");
}

/*
 * A model name holding a line break, reaching the log by the two paths the issue names: the NVMe
 * tier's "not recorded" line, and the line of an error reply (a HELLO whose block size conflicts
 * with the namespace's). Neither forges a line; the name is escaped, and a long one cut.
 */
Test(server_abuse, client_strings_cannot_forge_log_lines)
{
    kvd_t d = {0};
    kvd_start(&d, "--log-level", "info", NULL);
    int fd = kvd_raw(&d);
    static const char evil[] = "m\n2026-01-01T00:00:00.000Z error kvtierd: FORGED: \x1b[31mred\xff";
    char msg[4096];
    cr_assert_eq(hello(fd, 1, evil, sizeof evil - 1, NULL, 16, NULL), 0);
    cr_assert_eq(hello(fd, 2, evil, sizeof evil - 1, NULL, 32, msg), KVT_EINVAL);
    cr_expect(!strchr(msg, '\n'), "nor in the error message: %s", msg);
    char big[255];
    memset(big, 'A', sizeof big);
    big[100] = '\n';
    cr_assert_eq(hello(fd, 3, big, sizeof big, NULL, 16, NULL), 0);
    cr_assert_eq(hello(fd, 4, big, sizeof big, NULL, 32, NULL), KVT_EINVAL);
    close(fd);
    int c = kvd_raw(&d); /* a round trip: every line is written */
    cr_assert_eq(hello(c, 9, "ok", 2, NULL, 0, NULL), 0);
    close(c);
    static char log[1 << 16];
    kvd_slurp(&d, "kvtierd.log", log, sizeof log);
    for (char *line = log; *line; line = strchr(line, '\n') + 1) {
        cr_expect(!strncmp(line, "20", 2) && line[10] == 'T',
                  "a line that is not the daemon's:\n%s", log);
        if (!strchr(line, '\n'))
            break;
    }
    cr_expect(!strstr(log, "\n2026-01-01T"), "a forged line:\n%s", log);
    cr_expect_geq(count(log, "not recorded"), 1, "%s", log);
    cr_expect_geq(count(log, "already has blocks"), 2, "%s", log);
    cr_expect_geq(count(log, "m\\n2026-01-01T"), 2, "escaped on both paths:\n%s", log);
    cr_expect(strstr(log, "\\x1b[31mred\\xff"), "%s", log);
    char run[80];
    memset(run, 'A', sizeof run);
    run[sizeof run - 1] = 0;
    cr_expect(!strstr(log, run), "a 255-byte name is cut:\n%s", log);
    kvd_cleanup(&d);
}

/*
 * Connection A declares namespace z with blocks of 8 bytes, then B declares z index-only (0) and
 * PUTs a page with a payload: malformed, as it is when B comes first. Without a payload, B's PUT
 * is fine.
 */
Test(server_abuse, a_payload_on_an_index_only_connection_is_malformed_in_either_order)
{
    kvd_t d = {0};
    kvd_start(&d, NULL);
    int a = kvd_raw(&d), b = kvd_raw(&d);
    cr_assert_eq(hello(a, 1, "z", 1, NULL, 8, NULL), 0);
    cr_assert_eq(hello(b, 1, "z", 1, NULL, 0, NULL), 0);
    cr_expect_eq(put1(b, 2, 10, 1, 8), KVT_EPROTO, "A first, then B");
    cr_expect_eq(put1(b, 3, 10, 0, 0), 0, "index-only is what B may do");
    cr_expect_eq(put1(a, 2, 10, 1, 8), 0, "A stores its page");

    int c = kvd_raw(&d), e = kvd_raw(&d);
    cr_assert_eq(hello(c, 1, "y", 1, NULL, 0, NULL), 0);
    cr_assert_eq(hello(e, 1, "y", 1, NULL, 8, NULL), 0);
    cr_expect_eq(put1(c, 2, 10, 1, 8), KVT_EPROTO, "B first, then A");
    cr_expect_eq(put1(e, 2, 10, 1, 8), 0);
    close(a);
    close(b);
    close(c);
    close(e);
    kvd_cleanup(&d);
}

/* docs/protocol.md: an AUTH body is the secret, 1..1024 bytes; with no secret set, the others are
 * malformed and the connection goes on; with one, they close it. */
Test(server_abuse, auth_bodies_outside_1_to_1024_bytes_are_malformed)
{
    kvd_t d = {0};
    kvd_start(&d, NULL);
    static uint8_t body[1025];
    memset(body, 'x', sizeof body);
    int fd = kvd_raw(&d);
    raw_send(fd, KVT_OP_AUTH, 0, 1, NULL, 0);
    cr_expect_eq(reply(fd, KVT_OP_AUTH, 1, NULL), KVT_EPROTO, "0 bytes");
    raw_send(fd, KVT_OP_AUTH, 0, 2, body, 1025);
    cr_expect_eq(reply(fd, KVT_OP_AUTH, 2, NULL), KVT_EPROTO, "1025 bytes");
    raw_send(fd, KVT_OP_AUTH, 0, 3, body, 1);
    cr_expect_eq(reply(fd, KVT_OP_AUTH, 3, NULL), 0, "1 byte");
    raw_send(fd, KVT_OP_AUTH, 0, 4, body, 1024);
    cr_expect_eq(reply(fd, KVT_OP_AUTH, 4, NULL), 0, "1024 bytes");
    close(fd);
    kvd_cleanup(&d);

    kvd_t e = {0};
    kvd_start(&e, "--secret", "s3cret", NULL);
    fd = kvd_raw(&e);
    raw_send(fd, KVT_OP_AUTH, 0, 1, NULL, 0);
    cr_expect_eq(reply(fd, KVT_OP_AUTH, 1, NULL), KVT_EPROTO);
    cr_expect(closed(fd));
    close(fd);
    int rc;
    kvt_client_t *c = connect_as(&e, "m", NULL, "s3cret", &rc);
    cr_assert_eq(rc, 0);
    kvt_client_close(c);
    kvd_cleanup(&e);
}

/*
 * Guessing the secret from many connections at once: with auth-failures-per-s 20, 50 wrong
 * guesses take over a second to be answered (on main they were answered at once), each answered
 * EAUTH; a client that knows the secret, arriving in the middle, waits its turn too (so that the
 * wait tells a guesser nothing) and is let in; a client connected before is served at once all
 * along; the log has a few lines of it, the rest counted.
 */
Test(server_abuse, wrong_auths_are_rate_limited_across_connections)
{
    kvd_t d = {0};
    kvd_start(&d, "--secret", "s3cret", "--auth-failures-per-s", "20", "--log-level", "info",
              "--log-rate", "2", NULL);
    int rc;
    kvt_client_t *inn = connect_as(&d, "m", NULL, "s3cret", &rc);
    cr_assert_eq(rc, 0);
    enum { N = 50 };
    int fds[N];
    double t0 = now_s();
    for (int i = 0; i < N; i++) {
        fds[i] = kvd_raw(&d);
        char guess[32];
        int n = snprintf(guess, sizeof guess, "guess-%d", i);
        raw_send(fds[i], KVT_OP_AUTH, 0, 1, guess, (uint32_t)n);
    }
    uint64_t rtt = 0;
    double p0 = now_s();
    cr_expect_eq(kvt_client_ping(inn, &rtt), 0);
    cr_expect_lt(now_s() - p0, 2.0, "the loop does not wait for the guessers");
    kvt_client_t *late = connect_as(&d, "m", NULL, "s3cret", &rc);
    cr_expect_eq(rc, 0, "the right secret gets in, in its turn: %s", kvt_client_strerror(rc));
    for (int i = 0; i < N; i++) {
        cr_expect_eq(reply(fds[i], KVT_OP_AUTH, 1, NULL), KVT_EAUTH);
        cr_expect(closed(fds[i]));
        close(fds[i]);
    }
    double took = now_s() - t0;
    cr_expect_geq(took, 1.0, "50 wrong guesses answered in %.2f s at 20 a second", took);
    cr_expect_lt(took, 30.0);
    if (late) {
        cr_expect_eq(kvt_client_ping(late, NULL), 0);
        kvt_client_close(late);
    }
    cr_expect_eq(metric(&d, "kvtier_auth_failures_total"), N);
    cr_expect_geq(metric(&d, "kvtier_auth_delayed_total"), N - 25);
    static char log[1 << 16];
    kvd_slurp(&d, "kvtierd.log", log, sizeof log);
    size_t lines = count(log, "wrong secret");
    cr_expect_lt(lines, 20, "%zu lines for %d wrong guesses:\n%s", lines, N, log);
    for (int i = 0; i < 100 && metric(&d, "kvtier_log_lines_suppressed_total") < N - 20; i++)
        usleep(20000);
    cr_expect_geq(metric(&d, "kvtier_log_lines_suppressed_total"), N - 20);
    kvt_client_close(inn);
    kvd_cleanup(&d);
}

/*
 * The line of the waiting queue's limit: with auth-wait-ms short, a guess that would wait longer
 * is answered EAGAIN at once, its secret unchecked, and counted.
 */
Test(server_abuse, auth_past_the_longest_wait_is_refused_unchecked)
{
    kvd_t d = {0};
    kvd_start(&d, "--secret", "s3cret", "--auth-failures-per-s", "2", "--auth-wait-ms", "1000",
              NULL);
    enum { N = 8 };
    int fds[N];
    for (int i = 0; i < N; i++) {
        fds[i] = kvd_raw(&d);
        raw_send(fds[i], KVT_OP_AUTH, 0, 1, "nope", 4);
    }
    int eauth = 0, eagain = 0;
    for (int i = 0; i < N; i++) {
        int st = reply(fds[i], KVT_OP_AUTH, 1, NULL);
        eauth += st == KVT_EAUTH;
        eagain += st == KVT_EAGAIN;
        cr_expect(closed(fds[i]));
        close(fds[i]);
    }
    /* 2 at once (the bucket), 2 waiting (a second of turns), the rest refused. */
    cr_expect_eq(eauth + eagain, N);
    cr_expect_geq(eagain, 2, "%d refused", eagain);
    cr_expect_geq(eauth, 2, "%d answered", eauth);
    cr_expect_eq(metric(&d, "kvtier_auth_refused_total"), eagain);
    kvd_cleanup(&d);
}

/*
 * A client that makes every request an error (here an unknown opcode, 300 times): the log gets
 * log-rate lines a second of it, then one that says how many were held back; the metric counts
 * them. (At the default rate, so that this runs unchanged against a daemon without the limit.)
 */
Test(server_abuse, error_reply_floods_are_rate_limited_in_the_log)
{
    kvd_t d = {0};
    kvd_start(&d, "--log-level", "info", NULL); /* log-rate at its default, 10 */
    int fd = kvd_raw(&d);
    enum { N = 300 };
    for (int i = 0; i < N; i++)
        raw_send(fd, 50, 0, (uint64_t)i + 1, NULL, 0);
    for (int i = 0; i < N; i++)
        cr_assert_eq(reply(fd, 50, (uint64_t)i + 1, NULL), KVT_EPROTO);
    usleep(300 * 1000); /* tokens are back */
    raw_send(fd, 50, 0, 1000, NULL, 0);
    cr_assert_eq(reply(fd, 50, 1000, NULL), KVT_EPROTO);
    kvt_client_t *c = kvd_client(&d, "m", 4, 0); /* the innocent is served */
    cr_expect_eq(kvt_client_ping(c, NULL), 0);
    static char log[1 << 17];
    kvd_slurp(&d, "kvtierd.log", log, sizeof log);
    size_t lines = count(log, "unknown opcode");
    cr_expect_lt(lines, 30, "%zu lines for %d errors:\n%s", lines, N + 1, log);
    cr_expect(strstr(log, "more like it since the last"), "the held lines are counted:\n%s", log);
    for (int i = 0; i < 100 && metric(&d, "kvtier_log_lines_suppressed_total") < N - 20; i++)
        usleep(20000);
    cr_expect_geq(metric(&d, "kvtier_log_lines_suppressed_total"), N - 20);
    kvt_client_close(c);
    close(fd);
    kvd_cleanup(&d);
}
