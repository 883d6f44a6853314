/*
 * test_server_malformed.c: every malformed-frame case over a raw socket to the real daemon:
 * wrong magic, wrong version, a body over max-frame, an unknown opcode, truncated and
 * inconsistent bodies, requests before HELLO, unknown flag bits, a peer that disconnects in the
 * middle of a frame, a peer that never reads its replies. Each gets its error reply (or a closed
 * connection where the framing cannot be trusted), is counted, and leaves a second, well-behaved
 * client untouched.
 */
#include <sys/uio.h>

#include "proto.h"
#include "test_raw_frames.h"
#include "test_server_harness.h"

static void req(int fd, unsigned op, uint16_t flags, uint64_t id, const void *body, uint32_t len)
{
    raw_frame(fd, op, flags, id, body, len, KVT_PROTO_MAGIC, KVT_PROTO_VERSION);
}

/* Reads one reply; returns its status, checks its id and opcode. */
static int reply(int fd, unsigned op, uint64_t id, uint8_t *body, uint32_t *len)
{
    uint8_t hdr[KVT_PROTO_HDR];
    cr_assert_eq(read_full(fd, hdr, sizeof hdr), 0, "no reply to request %llu",
                 (unsigned long long)id);
    kvt_proto_hdr_t h;
    kvt_proto_hdr_decode(hdr, &h);
    cr_assert_eq(h.magic, KVT_PROTO_MAGIC);
    cr_assert_eq(h.request_id, id);
    cr_assert_eq(h.opcode, op | KVT_OP_REPLY, "opcode 0x%x", h.opcode);
    cr_assert_leq(h.body_len, 65536);
    uint8_t tmp[65536];
    cr_assert_eq(read_full(fd, body ? body : tmp, h.body_len), 0);
    if (len)
        *len = h.body_len;
    return h.status;
}

/* Reads one reply: its status must be st and its message must say text. */
static void says(int fd, unsigned op, uint64_t id, int st, const char *text)
{
    static uint8_t msg[65536 + 1];
    uint32_t len = 0;
    cr_expect_eq(reply(fd, op, id, msg, &len), st, "request %llu", (unsigned long long)id);
    msg[len] = 0;
    cr_expect(strstr((char *)msg, text), "request %llu: '%s' does not say '%s'",
              (unsigned long long)id, (char *)msg, text);
}

/* The daemon closed the connection: end of file, or a reset when it closed with bytes of ours
 * still unread. */
static int closed(int fd)
{
    uint8_t b;
    ssize_t n = read(fd, &b, 1);
    return n == 0 || (n < 0 && errno == ECONNRESET);
}

/* HELLO as request id for model "m" with the given page and block size; it must succeed. */
static void hello_as(int fd, uint64_t id, uint32_t page, uint32_t bb)
{
    uint8_t body[64];
    kvt_wire_hello_t w = {
        .min_version = 1, .max_version = 1, .page_size = page, .block_bytes = bb, .model_len = 1};
    memcpy(body, &w, sizeof w);
    body[sizeof w] = 'm';
    req(fd, KVT_OP_HELLO, 0, id, body, sizeof w + 1);
    cr_assert_eq(reply(fd, KVT_OP_HELLO, id, NULL, NULL), 0);
}

static void hello(int fd, uint64_t id)
{
    hello_as(fd, id, 4, 16);
}

/* STATS has one protocol_errors_<kind> per kind, as /metrics has one series per kind. */
static int perrors_cb(void *arg, const char *name, uint64_t v)
{
    if (!strncmp(name, "protocol_errors_", 16))
        *(uint64_t *)arg += v;
    return 0;
}

static uint64_t perrors(kvt_client_t *c)
{
    uint64_t n = 0;
    cr_assert_eq(kvt_client_stats(c, perrors_cb, &n), 0);
    return n;
}

Test(server_malformed, framing_errors_close_only_that_connection)
{
    kvd_t d = {0};
    kvd_start(&d, "--max-frame", "64K", NULL);
    kvt_client_t *good = kvd_client(&d, "m", 4, 16);
    uint64_t e0 = perrors(good);

    int fd = kvd_raw(&d);
    raw_frame(fd, KVT_OP_PING, 0, 5, "hi", 2, 0xdeadbeef, KVT_PROTO_VERSION);
    cr_expect_eq(reply(fd, 0, 5, NULL, NULL), KVT_EPROTO, "bad magic");
    cr_expect(closed(fd));
    close(fd);

    fd = kvd_raw(&d);
    raw_frame(fd, KVT_OP_PING, 0, 6, "hi", 2, KVT_PROTO_MAGIC, 9);
    cr_expect_eq(reply(fd, KVT_OP_PING, 6, NULL, NULL), KVT_EPROTO, "bad version");
    cr_expect(closed(fd));
    close(fd);

    fd = kvd_raw(&d);
    req(fd, KVT_OP_PING, 0, 7, NULL, 65 * 1024); /* header only: the body never comes */
    cr_expect_eq(reply(fd, KVT_OP_PING, 7, NULL, NULL), KVT_ETOOBIG, "over max-frame");
    cr_expect(closed(fd));
    close(fd);

    cr_expect_eq(kvt_client_ping(good, NULL), 0, "the other client is fine");
    cr_expect_eq(perrors(good), e0 + 3);
    kvt_client_close(good);
    kvd_cleanup(&d);
}

Test(server_malformed, body_errors_answer_and_continue)
{
    kvd_t d = {0};
    kvd_start(&d, NULL);
    kvt_client_t *good = kvd_client(&d, "m", 4, 16);
    uint64_t e0 = perrors(good);
    int fd = kvd_raw(&d);
    uint8_t body[4096] = {0};

    /* Before HELLO: a MATCH has no namespace. */
    kvt_wire_match_t mw = {.ntokens = 4};
    memcpy(body, &mw, sizeof mw);
    req(fd, KVT_OP_MATCH, 0, 1, body, sizeof mw + 16);
    cr_expect_eq(reply(fd, KVT_OP_MATCH, 1, NULL, NULL), KVT_EPROTO, "MATCH before HELLO");

    /* HELLO bodies: truncated, names longer than the body, empty model, NUL in a name. */
    kvt_wire_hello_t hw = {.min_version = 1, .max_version = 1, .page_size = 4, .model_len = 5};
    memcpy(body, &hw, sizeof hw);
    memcpy(body + sizeof hw, "model", 5);
    req(fd, KVT_OP_HELLO, 0, 2, body, 10);
    cr_expect_eq(reply(fd, KVT_OP_HELLO, 2, NULL, NULL), KVT_EPROTO, "truncated HELLO");
    req(fd, KVT_OP_HELLO, 0, 3, body, sizeof hw + 4);
    cr_expect_eq(reply(fd, KVT_OP_HELLO, 3, NULL, NULL), KVT_EPROTO, "name past the body");
    hw.model_len = 0;
    memcpy(body, &hw, sizeof hw);
    req(fd, KVT_OP_HELLO, 0, 4, body, sizeof hw);
    cr_expect_eq(reply(fd, KVT_OP_HELLO, 4, NULL, NULL), KVT_EPROTO, "empty model");
    hw.model_len = 5;
    memcpy(body, &hw, sizeof hw);
    memcpy(body + sizeof hw, "mo\0el", 5);
    req(fd, KVT_OP_HELLO, 0, 5, body, sizeof hw + 5);
    cr_expect_eq(reply(fd, KVT_OP_HELLO, 5, NULL, NULL), KVT_EPROTO, "NUL in the model");
    hw.page_size = 5000;
    memcpy(body, &hw, sizeof hw);
    memcpy(body + sizeof hw, "model", 5);
    req(fd, KVT_OP_HELLO, 0, 6, body, sizeof hw + 5);
    cr_expect_eq(reply(fd, KVT_OP_HELLO, 6, NULL, NULL), KVT_EINVAL, "page size out of range");
    hw.page_size = 4;
    /* Block sizes: over the tiers' 64 MiB; at it, but a PUT of one page is over max-frame. */
    hw.block_bytes = (64u << 20) + 1;
    memcpy(body, &hw, sizeof hw);
    req(fd, KVT_OP_HELLO, 0, 61, body, sizeof hw + 5);
    says(fd, KVT_OP_HELLO, 61, KVT_EINVAL, "block size 67108865 is over the limit of 67108864");
    hw.block_bytes = 64u << 20;
    memcpy(body, &hw, sizeof hw);
    req(fd, KVT_OP_HELLO, 0, 62, body, sizeof hw + 5);
    says(fd, KVT_OP_HELLO, 62, KVT_EINVAL,
         "a PUT of one page is 67108912 bytes, over max-frame (67108864)");
    hw.block_bytes = 0;
    hw.min_version = 2;
    hw.max_version = 3;
    memcpy(body, &hw, sizeof hw);
    req(fd, KVT_OP_HELLO, 0, 7, body, sizeof hw + 5);
    cr_expect_eq(reply(fd, KVT_OP_HELLO, 7, NULL, NULL), KVT_EPROTO, "no common version");

    hello(fd, 8);
    /* MATCH: token count disagrees with the length, both ways; unknown flags; bad hints. */
    mw.ntokens = 10;
    memcpy(body, &mw, sizeof mw);
    req(fd, KVT_OP_MATCH, 0, 9, body, sizeof mw + 5 * 4);
    cr_expect_eq(reply(fd, KVT_OP_MATCH, 9, NULL, NULL), KVT_EPROTO, "short token list");
    req(fd, KVT_OP_MATCH, 0, 10, body, sizeof mw + 11 * 4);
    cr_expect_eq(reply(fd, KVT_OP_MATCH, 10, NULL, NULL), KVT_EPROTO, "long token list");
    req(fd, KVT_OP_MATCH, 0, 11, body, sizeof mw + 3);
    cr_expect_eq(reply(fd, KVT_OP_MATCH, 11, NULL, NULL), KVT_EPROTO, "ragged tokens");
    req(fd, KVT_OP_MATCH, 0x80 | KVT_MATCH_F_LEASE, 12, body, sizeof mw + 10 * 4);
    says(fd, KVT_OP_MATCH, 12, KVT_EPROTO, "unknown MATCH flag bits 0x80");
    mw.hints.flags = 0x40;
    memcpy(body, &mw, sizeof mw);
    req(fd, KVT_OP_MATCH, 0, 13, body, sizeof mw + 10 * 4);
    cr_expect_eq(reply(fd, KVT_OP_MATCH, 13, NULL, NULL), KVT_EPROTO, "unknown hint flag");
    mw.hints.flags = 0;
    mw.ntokens = 0xffffffffu; /* a count whose byte size overflows 32 bits */
    memcpy(body, &mw, sizeof mw);
    req(fd, KVT_OP_MATCH, 0, 14, body, sizeof mw + 12);
    cr_expect_eq(reply(fd, KVT_OP_MATCH, 14, NULL, NULL), KVT_EPROTO, "huge token count");

    /* PUT: payload shorter than npayload x block bytes; payload pages past the tokens. */
    kvt_wire_put_t pw = {.ntokens = 8, .npayload = 2};
    memcpy(body, &pw, sizeof pw);
    req(fd, KVT_OP_PUT, 0, 15, body, sizeof pw + 8 * 4 + 16);
    cr_expect_eq(reply(fd, KVT_OP_PUT, 15, NULL, NULL), KVT_EPROTO, "short payload");
    pw.first_page = 1;
    memcpy(body, &pw, sizeof pw);
    req(fd, KVT_OP_PUT, 0, 16, body, sizeof pw + 8 * 4 + 32);
    says(fd, KVT_OP_PUT, 16, KVT_EINVAL, "payload pages 1..2 go past the request's 2 whole pages");
    pw.first_page = 0xffffffffu;
    pw.npayload = 1;
    memcpy(body, &pw, sizeof pw);
    req(fd, KVT_OP_PUT, 0, 161, body, sizeof pw + 8 * 4 + 16);
    says(fd, KVT_OP_PUT, 161, KVT_EINVAL, "payload pages 4294967295..4294967295 go past");

    /* GET outside a lease's pages: the last page named as sent, not wrapped past 2^32. */
    kvt_wire_put_t iw = {.ntokens = 8}; /* index-only: 2 pages to lease */
    memcpy(body, &iw, sizeof iw);
    for (int i = 0; i < 8; i++)
        kvt_put_u32(body + sizeof iw + 4 * i, 5000 + (uint32_t)i);
    req(fd, KVT_OP_PUT, 0, 162, body, sizeof iw + 32);
    cr_assert_eq(reply(fd, KVT_OP_PUT, 162, NULL, NULL), 0);
    kvt_wire_match_t lw = {.ntokens = 8};
    memcpy(body, &lw, sizeof lw);
    for (int i = 0; i < 8; i++)
        kvt_put_u32(body + sizeof lw + 4 * i, 5000 + (uint32_t)i);
    req(fd, KVT_OP_MATCH, KVT_MATCH_F_LEASE, 163, body, sizeof lw + 32);
    uint8_t mrb[64];
    cr_assert_eq(reply(fd, KVT_OP_MATCH, 163, mrb, NULL), 0);
    kvt_wire_match_reply_t mr;
    memcpy(&mr, mrb, sizeof mr);
    cr_assert_eq(mr.pages, 2);
    kvt_wire_get_t gw = {.lease = mr.lease, .first_page = 0xffffffffu, .npages = 1};
    req(fd, KVT_OP_GET, 0, 164, &gw, sizeof gw);
    says(fd, KVT_OP_GET, 164, KVT_EINVAL,
         "pages 4294967295..4294967295 go past the leased 2 pages");
    gw.first_page = 1;
    gw.npages = 2;
    req(fd, KVT_OP_GET, 0, 165, &gw, sizeof gw);
    says(fd, KVT_OP_GET, 165, KVT_EINVAL, "pages 1..2 go past the leased 2 pages");
    gw.first_page = 2;
    gw.npages = 0; /* to the end: from past it */
    req(fd, KVT_OP_GET, 0, 166, &gw, sizeof gw);
    says(fd, KVT_OP_GET, 166, KVT_EINVAL, "page 2 is past the leased 2 pages");

    /* Fixed-size bodies of the wrong size. */
    req(fd, KVT_OP_GET, 0, 17, body, 15);
    cr_expect_eq(reply(fd, KVT_OP_GET, 17, NULL, NULL), KVT_EPROTO, "GET of 15 bytes");
    req(fd, KVT_OP_RELEASE, 0, 18, body, 9);
    cr_expect_eq(reply(fd, KVT_OP_RELEASE, 18, NULL, NULL), KVT_EPROTO, "RELEASE of 9 bytes");
    req(fd, KVT_OP_STATS, 0, 19, body, 1);
    says(fd, KVT_OP_STATS, 19, KVT_EPROTO, "STATS takes an empty body");
    req(fd, KVT_OP_STATS, 0x2, 191, NULL, 0);
    says(fd, KVT_OP_STATS, 191, KVT_EPROTO, "unknown STATS flag bits 0x2");
    req(fd, KVT_OP_REMOVE, 0, 20, body, 3);
    cr_expect_eq(reply(fd, KVT_OP_REMOVE, 20, NULL, NULL), KVT_EPROTO, "REMOVE of 3 bytes");
    req(fd, KVT_OP_PREFETCH, 0, 21, body, 8);
    cr_expect_eq(reply(fd, KVT_OP_PREFETCH, 21, NULL, NULL), KVT_EPROTO, "PREFETCH of 8 bytes");

    /* Flag bits an opcode does not define are named as such, not as a malformed body. */
    req(fd, KVT_OP_PING, 0x4, 211, "hi", 2);
    says(fd, KVT_OP_PING, 211, KVT_EPROTO, "unknown PING flag bits 0x4");
    req(fd, KVT_OP_RELEASE, 0x1, 212, body, 8);
    says(fd, KVT_OP_RELEASE, 212, KVT_EPROTO, "unknown RELEASE flag bits 0x1");
    req(fd, KVT_OP_REMOVE, 0x6, 213, body, 3);
    says(fd, KVT_OP_REMOVE, 213, KVT_EPROTO, "unknown REMOVE flag bits 0x6");
    req(fd, KVT_OP_REMOVE, KVT_REMOVE_F_NOWAIT, 214, body, 3);
    says(fd, KVT_OP_REMOVE, 214, KVT_EPROTO, "malformed REMOVE body (3 bytes)");

    /* Unknown opcodes, a reply opcode sent as a request. */
    req(fd, 77, 0, 22, "xyz", 3);
    cr_expect_eq(reply(fd, 77, 22, NULL, NULL), KVT_EPROTO, "unknown opcode");
    req(fd, KVT_OP_PING | KVT_OP_REPLY, 0, 23, NULL, 0);
    cr_expect_eq(reply(fd, KVT_OP_PING | KVT_OP_REPLY, 23, NULL, NULL), KVT_EPROTO);

    /* After all that, this connection still works, and the other one too. */
    uint8_t echo[8];
    uint32_t len;
    req(fd, KVT_OP_PING, 0, 24, "still ok", 8);
    cr_expect_eq(reply(fd, KVT_OP_PING, 24, echo, &len), 0);
    cr_expect(len == 8 && !memcmp(echo, "still ok", 8));
    cr_expect_eq(kvt_client_ping(good, NULL), 0);
    cr_expect_geq(perrors(good), e0 + 18, "each bad body is counted");
    close(fd);
    kvt_client_close(good);
    kvd_cleanup(&d);
}

/* A block size equal to the tiers' limit (64 MiB) is taken where max-frame holds a PUT of it. */
Test(server_malformed, a_block_size_at_the_limit_is_taken)
{
    kvd_t d = {0};
    kvd_start(&d, "--max-frame", "65M", NULL);
    int fd = kvd_raw(&d);
    hello_as(fd, 1, 4, 64u << 20);
    close(fd);
    kvd_cleanup(&d);
}

Test(server_malformed, disconnect_mid_frame)
{
    kvd_t d = {0};
    kvd_start(&d, NULL);
    kvt_client_t *good = kvd_client(&d, "m", 4, 16);
    uint64_t e0 = perrors(good);
    for (int k = 0; k < 20; k++) {
        int fd = kvd_raw(&d);
        hello(fd, 1);
        uint8_t body[64] = {0};
        kvt_wire_put_t pw = {.ntokens = 8, .npayload = 2};
        memcpy(body, &pw, sizeof pw);
        /* A header promising 96 bytes, then half of them, then gone. Half the time mid-header. */
        if (k % 2) {
            req(fd, KVT_OP_PUT, 0, 2, NULL, sizeof pw + 32 + 32);
            cr_assert_eq(write(fd, body, 40), 40);
        } else {
            uint8_t hdr[KVT_PROTO_HDR];
            kvt_proto_frame(hdr, KVT_OP_PING, 0, 3, 0, 0);
            cr_assert_eq(write(fd, hdr, 10), 10);
        }
        close(fd);
    }
    /* A lease holder that vanishes mid-frame loses its lease too. */
    int fd = kvd_raw(&d);
    hello(fd, 1);
    uint8_t body[256] = {0};
    kvt_wire_put_t pw = {.ntokens = 8};
    memcpy(body, &pw, sizeof pw);
    for (int i = 0; i < 8; i++)
        kvt_put_u32(body + sizeof pw + 4 * i, 1000 + (uint32_t)i);
    req(fd, KVT_OP_PUT, 0, 2, body, sizeof pw + 32);
    cr_assert_eq(reply(fd, KVT_OP_PUT, 2, NULL, NULL), 0);
    kvt_wire_match_t mw = {.ntokens = 8};
    memcpy(body, &mw, sizeof mw);
    for (int i = 0; i < 8; i++)
        kvt_put_u32(body + sizeof mw + 4 * i, 1000 + (uint32_t)i);
    req(fd, KVT_OP_MATCH, KVT_MATCH_F_LEASE, 3, body, sizeof mw + 32);
    cr_assert_eq(reply(fd, KVT_OP_MATCH, 3, NULL, NULL), 0);
    cr_expect_eq(kvd_stat(good, "leases"), 1);
    req(fd, KVT_OP_MATCH, 0, 4, NULL, 100);
    close(fd);
    uint64_t leases = 1;
    for (int i = 0; i < 1000 && leases; i++) { /* up to 5 s */
        usleep(5000);
        leases = kvd_stat(good, "leases");
    }
    cr_expect_eq(leases, 0);
    cr_expect_eq(perrors(good), e0 + 21, "each truncated frame is counted");
    cr_expect_eq(kvt_client_ping(good, NULL), 0);
    kvt_client_close(good);
    kvd_cleanup(&d);
}

Test(server_malformed, pipelined_requests_keep_order)
{
    kvd_t d = {0};
    kvd_start(&d, NULL);
    int fd = kvd_raw(&d);
    hello(fd, 1);
    /* 300 requests in one write, good and bad mixed; the replies come back in order. */
    static uint8_t buf[300 * 64];
    size_t off = 0;
    for (uint64_t i = 0; i < 300; i++) {
        uint8_t b[8];
        kvt_put_u64(b, i);
        unsigned op = i % 3 == 2 ? 99 : KVT_OP_PING;
        kvt_proto_frame(buf + off, op, 0, 100 + i, 0, 8);
        memcpy(buf + off + KVT_PROTO_HDR, b, 8);
        off += KVT_PROTO_HDR + 8;
    }
    cr_assert_eq(write(fd, buf, off), (ssize_t)off);
    for (uint64_t i = 0; i < 300; i++) {
        uint8_t b[64];
        uint32_t len;
        unsigned op = i % 3 == 2 ? 99 : KVT_OP_PING;
        int st = reply(fd, op, 100 + i, b, &len);
        if (op == KVT_OP_PING) {
            cr_expect_eq(st, 0);
            cr_expect(len == 8 && kvt_get_u64(b) == i);
        } else {
            cr_expect_eq(st, KVT_EPROTO);
        }
    }
    close(fd);
    kvd_cleanup(&d);
}

/* kvtierd's resident memory, in KiB (0 when it cannot be read). */
static long kvd_rss_kib(const kvd_t *d)
{
    char path[64], line[256];
    snprintf(path, sizeof path, "/proc/%d/status", (int)d->pid);
    FILE *f = fopen(path, "r");
    long kib = 0;
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "VmRSS: %ld kB", &kib) == 1)
            break;
    if (f)
        fclose(f);
    return kib;
}

/*
 * A client that pipelines GETs and never reads a reply: 400 GETs of 16 NVMe pages of 64 KiB
 * (400 MiB of replies, every page read from disk into a buffer first). The daemon stops reading
 * that connection's requests once its queued output (max-output, 4M here) or its I/O in flight
 * (max-inflight) passes its bound, so its memory stays bounded, and another client is served
 * meanwhile.
 */
Test(server_malformed, a_client_that_never_reads_holds_bounded_memory)
{
    enum { PAGES = 16, BIGB = 65536, GETS = 400 };
    kvd_t d = {0};
    kvd_start(&d, "--dram-bytes", "0", "--nvme-bytes", "8M", "--max-output", "4M", NULL);
    kvt_client_t *good = kvd_client(&d, "m", 16, BIGB);
    uint32_t tok[PAGES * 16];
    kvd_tokens(tok, PAGES * 16, 3);
    uint8_t *payload = malloc((size_t)PAGES * BIGB);
    for (int p = 0; p < PAGES; p++)
        kvd_fill(payload + (size_t)p * BIGB, BIGB, 40 + p);
    kvt_client_put_t pr;
    cr_assert_eq(kvt_client_put(good, tok, PAGES * 16, 0, PAGES, payload, NULL, &pr), 0);
    cr_assert_eq(pr.stored, PAGES);
    cr_assert_eq(kvd_stat(good, "nvme_blocks"), PAGES);

    int fd = kvd_raw(&d);
    uint8_t body[512];
    kvt_wire_hello_t hw = {
        .min_version = 1, .max_version = 1, .page_size = 16, .block_bytes = BIGB, .model_len = 1};
    memcpy(body, &hw, sizeof hw);
    body[sizeof hw] = 'm';
    req(fd, KVT_OP_HELLO, 0, 1, body, sizeof hw + 1);
    cr_assert_eq(reply(fd, KVT_OP_HELLO, 1, NULL, NULL), 0);
    static uint8_t mbody[sizeof(kvt_wire_match_t) + PAGES * 16 * 4];
    kvt_wire_match_t mw = {.ntokens = PAGES * 16};
    memcpy(mbody, &mw, sizeof mw);
    for (int i = 0; i < PAGES * 16; i++)
        kvt_put_u32(mbody + sizeof mw + 4 * i, tok[i]);
    req(fd, KVT_OP_MATCH, KVT_MATCH_F_LEASE, 2, mbody, sizeof mbody);
    uint8_t rb[1024];
    uint32_t rlen = 0;
    cr_assert_eq(reply(fd, KVT_OP_MATCH, 2, rb, &rlen), 0);
    kvt_wire_match_reply_t mr;
    memcpy(&mr, rb, sizeof mr);
    cr_assert_eq(mr.pages, PAGES);
    cr_assert_neq(mr.lease, 0);

    long before = kvd_rss_kib(&d);
    cr_assert_gt(before, 0);
    /* All the GETs in one write: as separate small writes they would fill this end's socket
     * buffer with per-write overhead once the daemon stops reading them, and block here. */
    kvt_wire_get_t gw = {.lease = mr.lease, .first_page = 0, .npages = PAGES};
    enum { FRAME = KVT_PROTO_HDR + sizeof(kvt_wire_get_t) };
    static uint8_t gets[GETS * FRAME];
    for (int i = 0; i < GETS; i++) {
        uint8_t *f = gets + (size_t)i * FRAME;
        kvt_proto_frame(f, KVT_OP_GET, 0, 100 + (uint64_t)i, 0, sizeof gw);
        memcpy(f + KVT_PROTO_HDR, &gw, sizeof gw);
    }
    cr_assert_eq(write(fd, gets, sizeof gets), (ssize_t)sizeof gets);
    /* While those replies wait for a reader that never comes, the other client is served. */
    long peak = before;
    for (int i = 0; i < 40; i++) {
        cr_assert_eq(kvt_client_ping(good, NULL), 0, "the other client is served");
        kvt_client_match_t m = {0};
        cr_assert_eq(kvt_client_match(good, tok, PAGES * 16, 0, 0, NULL, &m), 0);
        cr_assert_eq(m.pages, PAGES);
        peak = KVT_MAX(peak, kvd_rss_kib(&d));
        usleep(20000);
    }
    cr_expect_lt(peak - before, 64 << 10, "400 MiB of GET replies queued: RSS grew %ld KiB",
                 peak - before);
    close(fd);
    cr_assert_eq(kvt_client_ping(good, NULL), 0);
    free(payload);
    kvt_client_close(good);
    kvd_cleanup(&d);
}

/* The PUT frame of pages [0, pages) of tok, payload seeded from seed: header and body, encoded as
 * the protocol document says. *len gets its length; the caller frees it. */
static uint8_t *put_frame(const uint32_t *tok, uint32_t ntok, uint32_t pages, uint32_t bb,
                          uint32_t seed, uint64_t id, size_t *len)
{
    kvt_wire_put_t w = {.ntokens = ntok, .first_page = 0, .npayload = pages};
    size_t body = sizeof w + (size_t)ntok * 4 + (size_t)pages * bb;
    uint8_t *f = malloc(KVT_PROTO_HDR + body);
    cr_assert(f);
    kvt_proto_frame(f, KVT_OP_PUT, 0, id, 0, (uint32_t)body);
    memcpy(f + KVT_PROTO_HDR, &w, sizeof w);
    uint8_t *p = f + KVT_PROTO_HDR + sizeof w;
    for (uint32_t i = 0; i < ntok; i++)
        kvt_put_u32(p + 4 * i, tok[i]);
    for (uint32_t i = 0; i < pages; i++)
        kvd_fill(p + (size_t)ntok * 4 + (size_t)i * bb, bb, seed + i);
    *len = KVT_PROTO_HDR + body;
    return f;
}

/* Every page of the prompt reads back under a lease, byte-exact to put_frame's seed. */
static void reads_back(kvt_client_t *c, const uint32_t *tok, uint32_t pages, uint32_t page,
                       uint32_t bb, uint32_t seed)
{
    kvt_client_match_t m = {0};
    cr_assert_eq(kvt_client_match(c, tok, pages * page, KVT_CLIENT_LEASE, 0, NULL, &m), 0);
    cr_assert_eq(m.pages, pages);
    uint8_t *buf = malloc((size_t)pages * bb), *want = malloc(bb);
    uint32_t got = 0;
    cr_assert_eq(kvt_client_get(c, m.lease, 0, pages, buf, (size_t)pages * bb, &got, NULL), 0);
    cr_assert_eq(got, pages);
    for (uint32_t i = 0; i < pages; i++) {
        kvd_fill(want, bb, seed + i);
        cr_assert(memcmp(buf + (size_t)i * bb, want, bb) == 0, "page %u differs", i);
    }
    cr_assert_eq(kvt_client_release(c, m.lease, NULL), 0);
    free(buf);
    free(want);
}

static void raw_hello(int fd, uint32_t page, uint32_t bb)
{
    hello_as(fd, 1, page, bb);
}

/* Polls STATS until name reaches at least v (2 s at most); returns the last value. */
static uint64_t stat_reaches(kvt_client_t *c, const char *name, uint64_t v)
{
    uint64_t x = 0;
    for (int i = 0; i < 200 && (x = kvd_stat(c, name)) < v; i++)
        usleep(10000);
    return x;
}

/*
 * A PUT of 8 MiB (a frame sixteen times the base input buffer) gets a buffer of its own, which
 * the PUT keeps until its pages are written instead of copying them, and which goes back when
 * they are: the daemon holds nothing for clients once they are answered, and the bytes read
 * back exact. A MATCH of 200,000 tokens (800 KB) after it takes a big buffer too and gives it
 * back the same way.
 */
Test(server_malformed, big_frames_get_a_buffer_of_their_own_and_give_it_back)
{
    enum { PAGE = 16, BB = 1 << 20, PAGES = 8 };
    kvd_t d = {0};
    kvd_start(&d, "--dram-bytes", "64M", "--nvme-bytes", "0", "--max-frame", "16M", NULL);
    kvt_client_t *c = kvd_client(&d, "m", PAGE, BB);
    cr_assert_eq(kvd_stat(c, "client_buffer_bytes"), 0);
    int fd = kvd_raw(&d);
    raw_hello(fd, PAGE, BB);
    uint32_t tok[PAGES * PAGE];
    kvd_tokens(tok, PAGES * PAGE, 7);
    size_t len;
    uint8_t *f = put_frame(tok, PAGES * PAGE, PAGES, BB, 500, 2, &len);
    cr_assert_eq(write(fd, f, len), (ssize_t)len);
    uint8_t rb[64];
    cr_assert_eq(reply(fd, KVT_OP_PUT, 2, rb, NULL), 0);
    kvt_wire_put_reply_t pr;
    memcpy(&pr, rb, sizeof pr);
    cr_assert_eq(pr.pages, PAGES);
    cr_expect_eq(kvd_stat(c, "client_buffer_bytes"), 0, "the PUT's buffer went with its writes");
    reads_back(c, tok, PAGES, PAGE, BB, 500);

    enum { NT = 200000 };
    uint8_t *mb = malloc(sizeof(kvt_wire_match_t) + NT * 4);
    kvt_wire_match_t mw = {.ntokens = NT};
    memcpy(mb, &mw, sizeof mw);
    for (uint32_t i = 0; i < NT; i++)
        kvt_put_u32(mb + sizeof mw + 4 * i, i < PAGES * PAGE ? tok[i] : 7000000 + i);
    req(fd, KVT_OP_MATCH, 0, 3, mb, sizeof mw + NT * 4);
    uint8_t big[sizeof(kvt_wire_match_reply_t) + NT / PAGE];
    uint32_t blen = 0;
    cr_assert_eq(reply(fd, KVT_OP_MATCH, 3, big, &blen), 0);
    kvt_wire_match_reply_t mr;
    memcpy(&mr, big, sizeof mr);
    cr_assert_eq(mr.pages, PAGES, "the long MATCH finds the stored prefix");
    cr_expect_eq(kvd_stat(c, "client_buffer_bytes"), 0, "the MATCH's buffer went back to the base");
    cr_expect_eq(kvd_stat(c, "client_memory_waits"), 0);
    free(mb);
    free(f);
    close(fd);
    kvt_client_close(c);
    kvd_cleanup(&d);
}

/*
 * PUTs of 8 MiB one after another, as an engine stores its pages: from the second on, each frame
 * is read into the buffer the PUT before it gave back (kept, instead of one freed and purged by
 * the allocator and a fresh one faulted in per frame), and still stores exactly its own bytes,
 * small PUTs of another connection in between or not; a frame bigger than that buffer gets a
 * fresh one. The kept buffer counts as held for no client,
 * and a second connection's frame may take it.
 */
Test(server_malformed, big_frames_reuse_the_buffer_of_the_last_one)
{
    enum { PAGE = 16, BB = 1 << 20, PAGES = 8, N = 3 };
    kvd_t d = {0};
    kvd_start(&d, "--dram-bytes", "64M", "--nvme-bytes", "0", "--max-frame", "16M", NULL);
    kvt_client_t *c = kvd_client(&d, "m", PAGE, BB), *small = kvd_client(&d, "s", PAGE, 4096);
    int fd = kvd_raw(&d), fd2 = kvd_raw(&d);
    raw_hello(fd, PAGE, BB);
    raw_hello(fd2, PAGE, BB);
    uint32_t tok[N + 2][(PAGES + 4) * PAGE];
    for (int i = 0; i < N + 2; i++) {
        int pages = i == N ? PAGES + 4 : PAGES; /* the one bigger than the kept buffer */
        kvd_tokens(tok[i], pages * PAGE, 10000 * (i + 1));
        size_t len;
        uint8_t *f = put_frame(tok[i], pages * PAGE, pages, BB, 100 * (i + 1), 2, &len);
        int to = i == N + 1 ? fd2 : fd;
        cr_assert_eq(write(to, f, len), (ssize_t)len);
        cr_assert_eq(reply(to, KVT_OP_PUT, 2, NULL, NULL), 0);
        free(f);
        cr_expect_eq(kvd_stat(c, "client_buffer_bytes"), 0, "the kept buffer is no client's");
        if (i == 0) { /* a small PUT meanwhile (its payload copied, then freed) keeps it too */
            uint32_t st[PAGE];
            uint8_t page[4096];
            kvd_tokens(st, PAGE, 777);
            kvd_fill(page, sizeof page, 7);
            kvt_client_put_t sp;
            cr_assert_eq(kvt_client_put(small, st, PAGE, 0, 1, page, NULL, &sp), 0);
            cr_assert_eq(sp.stored, 1);
        }
    }
    cr_expect_eq(kvd_stat(c, "frame_buffers_reused"), 3,
                 "the 2nd and 3rd frames, and the other connection's, took a kept buffer");
    for (int i = 0; i < N + 2; i++)
        reads_back(c, tok[i], i == N ? PAGES + 4 : PAGES, PAGE, BB, 100 * (i + 1));
    close(fd);
    close(fd2);
    kvt_client_close(small);
    kvt_client_close(c);
    kvd_cleanup(&d);
}

/*
 * max-client-bytes 9M, frames of about 6 MiB: the first connection's frame gets its buffer, the
 * second's does not fit beside it, so that connection is not read (counted, and the memory held
 * stays under the bound) until the first frame is handled; then it is, and both PUTs store their
 * bytes exactly. A third frame waits as well and its client hangs up meanwhile; a fourth client
 * is served all along.
 */
Test(server_malformed, max_client_bytes_makes_big_frames_wait_their_turn)
{
    enum { PAGE = 16, BB = 1 << 20, PAGES = 6 };
    kvd_t d = {0};
    kvd_start(&d, "--dram-bytes", "64M", "--nvme-bytes", "0", "--max-frame", "8M",
              "--max-client-bytes", "9M", NULL);
    kvt_client_t *c = kvd_client(&d, "m", PAGE, BB);
    int a = kvd_raw(&d), b = kvd_raw(&d);
    raw_hello(a, PAGE, BB);
    raw_hello(b, PAGE, BB);
    uint32_t ta[PAGES * PAGE], tb[PAGES * PAGE];
    kvd_tokens(ta, PAGES * PAGE, 100);
    kvd_tokens(tb, PAGES * PAGE, 900000);
    size_t la, lb;
    uint8_t *fa = put_frame(ta, PAGES * PAGE, PAGES, BB, 10, 2, &la);
    uint8_t *fb = put_frame(tb, PAGES * PAGE, PAGES, BB, 20, 2, &lb);
    enum { HEAD = 64 << 10 }; /* what each sends first: fits the socket's buffer */
    cr_assert_eq(write(a, fa, HEAD), HEAD);
    cr_assert(stat_reaches(c, "client_buffer_bytes", la - (512 << 10)) >= la - (512 << 10),
              "the first frame got a buffer of its own");
    cr_assert_eq(write(b, fb, HEAD), HEAD);
    cr_assert_eq(stat_reaches(c, "client_memory_waits", 1), 1, "the second frame waits");
    /* A third waits too, and hangs up while it does: it leaves nothing behind. */
    int x = kvd_raw(&d);
    raw_hello(x, PAGE, BB);
    cr_assert_eq(write(x, fb, HEAD), HEAD);
    cr_assert_eq(stat_reaches(c, "client_memory_waits", 2), 2, "the third frame waits");
    close(x);
    for (int i = 0; i < 200 && kvd_stat(c, "connections") > 3; i++)
        usleep(10000);
    cr_assert_eq(kvd_stat(c, "connections"), 3, "the third connection is gone");
    uint64_t held = kvd_stat(c, "client_buffer_bytes");
    cr_expect_leq(held, 9u << 20, "held %llu", (unsigned long long)held);
    /* The waiting connection holds back no one else. */
    uint32_t small[4 * PAGE];
    kvd_tokens(small, 4 * PAGE, 5000);
    kvt_client_put_t cp;
    cr_assert_eq(kvt_client_put(c, small, 4 * PAGE, 0, 0, NULL, NULL, &cp), 0);
    cr_assert_eq(kvt_client_ping(c, NULL), 0);

    cr_assert_eq(write(a, fa + HEAD, la - HEAD), (ssize_t)(la - HEAD));
    cr_assert_eq(reply(a, KVT_OP_PUT, 2, NULL, NULL), 0);
    cr_assert_eq(write(b, fb + HEAD, lb - HEAD), (ssize_t)(lb - HEAD));
    cr_assert_eq(reply(b, KVT_OP_PUT, 2, NULL, NULL), 0);
    reads_back(c, ta, PAGES, PAGE, BB, 10);
    reads_back(c, tb, PAGES, PAGE, BB, 20);
    cr_expect_eq(kvd_stat(c, "client_memory_waits"), 2);
    cr_expect_eq(kvd_stat(c, "client_buffer_bytes"), 0);
    free(fa);
    free(fb);
    close(a);
    close(b);
    kvt_client_close(c);
    kvd_cleanup(&d);
}

/* CPU time kvtierd has used so far, in clock ticks (utime + stime of /proc/PID/stat). */
static long kvd_cpu_ticks(const kvd_t *d)
{
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)d->pid);
    FILE *f = fopen(path, "r");
    size_t n = f ? fread(buf, 1, sizeof buf - 1, f) : 0;
    if (f)
        fclose(f);
    buf[n] = 0;
    char *p = strrchr(buf, ')'); /* the command name may hold spaces */
    long ut = 0, st = 0;
    cr_assert(p &&
              sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %ld %ld", &ut, &st) == 2);
    return ut + st;
}

/* A series' value from a scrape of /metrics, which must have it (kvd_metric's -1 for none: the
 * series read here are counts, never negative). */
static double metric(const kvd_t *d, const char *series)
{
    double v = kvd_metric(d, series);
    cr_assert_geq(v, 0, "%s missing", series);
    return v;
}

/*
 * The daemon at its open-file limit (64, which it cannot raise): 100 more clients connect. Those
 * past the limit are refused (closed at once and counted) instead of staying in the backlog and
 * waking the loop over and over (it used to spin at 100% CPU, logging a line each time); the
 * client connected before is served all along, and once the others go a new one is served too.
 * With a hard limit above what it needs, the daemon raises its soft limit and takes all 100.
 */
Test(server_malformed, at_the_open_file_limit_connections_are_refused_not_spun_on)
{
    kvd_t d = {.nofile_soft = 64, .nofile_hard = 64};
    kvd_start(&d, NULL);
    cr_expect(kvd_log_has(&d, "open-file limit (64, hard 64) is below max-conns"));
    kvt_client_t *c = kvd_client(&d, "m", 16, 0);
    int fds[100];
    for (int i = 0; i < 100; i++)
        fds[i] = kvd_raw(&d);
    usleep(200000);
    long t0 = kvd_cpu_ticks(&d);
    usleep(1000000);
    long used = kvd_cpu_ticks(&d) - t0;
    cr_expect_lt(used, 30, "kvtierd used %ld ticks in a second with clients it cannot take", used);
    cr_assert_eq(kvt_client_ping(c, NULL), 0, "the client connected before is served");
    cr_expect_lt(kvd_stat(c, "connections"), 64);
    for (int i = 0; i < 100; i++)
        close(fds[i]);
    for (int i = 0; i < 200 && kvd_stat(c, "connections") > 1; i++)
        usleep(10000);
    kvt_client_t *c2 = kvd_client(&d, "m", 16, 0);
    cr_assert_eq(kvt_client_ping(c2, NULL), 0, "a new client is served once the others went");
    cr_expect_geq(metric(&d, "kvtier_connections_refused_total"), 30);
    cr_expect(kvd_log_has(&d, "no file descriptor left"));
    kvt_client_close(c2);
    kvt_client_close(c);
    kvd_cleanup(&d);

    kvd_t e = {.nofile_soft = 64, .nofile_hard = 4096};
    kvd_start(&e, "--log-level", "info", NULL);
    cr_expect(kvd_log_has(&e, "open-file limit raised from 64 to"));
    c = kvd_client(&e, "m", 16, 0);
    for (int i = 0; i < 100; i++)
        fds[i] = kvd_raw(&e);
    for (int i = 0; i < 200 && kvd_stat(c, "connections") < 101; i++)
        usleep(10000);
    cr_expect_eq(kvd_stat(c, "connections"), 101, "all taken under the raised limit");
    for (int i = 0; i < 100; i++)
        close(fds[i]);
    kvt_client_close(c);
    kvd_cleanup(&e);
}

/* Writes PING frames to fd until the daemon stops reading them (the socket has taken nothing for
 * 300 ms); returns how many. */
static int flood_pings(int fd)
{
    static uint8_t frames[256 * KVT_PROTO_HDR];
    for (int i = 0; i < 256; i++)
        kvt_proto_frame(frames + (size_t)i * KVT_PROTO_HDR, KVT_OP_PING, 0, 1000 + (uint64_t)i, 0,
                        0);
    int sent = 0;
    for (;;) {
        ssize_t w = send(fd, frames, sizeof frames, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (w < 0) {
            cr_assert(errno == EAGAIN, "send: %s", strerror(errno));
            struct pollfd p = {.fd = fd, .events = POLLOUT};
            if (poll(&p, 1, 300) == 0)
                return sent;
            continue;
        }
        sent += (int)(w / KVT_PROTO_HDR);
        if ((size_t)w < sizeof frames)
            return sent; /* part of a frame went: the daemon never sees it whole */
    }
}

/*
 * A client that stops reading its replies is closed once its socket has taken none of them for
 * reply-timeout-ms, and its lease goes with it; a client that reads slowly, but reads, is not;
 * other clients are served throughout.
 */
Test(server_malformed, a_client_that_stops_reading_is_closed_after_reply_timeout)
{
    kvd_t d = {0};
    kvd_start(&d, "--reply-timeout-ms", "1000", "--tick-ms", "20", "--max-output", "64K", NULL);
    kvt_client_t *good = kvd_client(&d, "m", 4, 16);
    uint32_t tok[64];
    kvd_tokens(tok, 64, 9);
    kvt_client_put_t pr;
    cr_assert_eq(kvt_client_put(good, tok, 64, 0, 0, NULL, NULL, &pr), 0);

    int stuck = kvd_raw(&d), slow = kvd_raw(&d);
    hello(stuck, 1);
    hello(slow, 1);
    uint8_t mbody[sizeof(kvt_wire_match_t) + 64 * 4];
    kvt_wire_match_t mw = {.ntokens = 64};
    memcpy(mbody, &mw, sizeof mw);
    for (int i = 0; i < 64; i++)
        kvt_put_u32(mbody + sizeof mw + 4 * i, tok[i]);
    req(stuck, KVT_OP_MATCH, KVT_MATCH_F_LEASE, 2, mbody, sizeof mbody);
    cr_assert_eq(reply(stuck, KVT_OP_MATCH, 2, NULL, NULL), 0);
    cr_assert_eq(kvd_stat(good, "leases"), 1);

    int n_stuck = flood_pings(stuck), n_slow = flood_pings(slow);
    cr_assert_gt(n_stuck, 1000, "the daemon stopped reading after %d pings", n_stuck);
    cr_assert_gt(n_slow, 1000);
    /* The slow client reads 32 KiB every 50 ms until it has every reply (2 s at least), the
     * stuck one nothing. */
    uint64_t slow_bytes = 0, want = (uint64_t)n_slow * KVT_PROTO_HDR;
    uint8_t buf[32 << 10];
    for (int i = 0; i < 40 || (slow_bytes < want && i < 1000); i++) {
        ssize_t r = recv(slow, buf, sizeof buf, MSG_DONTWAIT);
        cr_assert(r > 0 || (r < 0 && errno == EAGAIN), "the slow reader was closed at %d ms",
                  i * 50);
        slow_bytes += r > 0 ? (uint64_t)r : 0;
        if (i % 10 == 0)
            cr_assert_eq(kvt_client_ping(good, NULL), 0, "the other client is served");
        usleep(50000);
    }
    cr_expect_eq(slow_bytes, want, "%llu bytes of %d replies", (unsigned long long)slow_bytes,
                 n_slow);
    cr_expect_eq(metric(&d, "kvtier_connections_timed_out_total"), 1);
    cr_expect_eq(kvd_stat(good, "leases"), 0, "the stuck client's lease went with it");
    cr_expect_eq(kvd_stat(good, "connections"), 2);
    cr_expect(kvd_log_has(&d, "took none of its replies for 1000 ms"));
    /* The stuck client finds the replies that were already in its socket, then the end. */
    int end = 0;
    for (int i = 0; i < 100000 && !end; i++) {
        ssize_t r = recv(stuck, buf, sizeof buf, 0);
        end = r == 0 || (r < 0 && errno == ECONNRESET);
        cr_assert(r >= 0 || end, "recv: %s", strerror(errno));
    }
    cr_expect(end);
    close(stuck);
    close(slow);
    cr_assert_eq(kvt_client_ping(good, NULL), 0);
    kvt_client_close(good);
    kvd_cleanup(&d);
}

/*
 * Clients that hang up while their PUTs are being written: each sends HELLO and a PUT whose pages
 * go to NVMe (written asynchronously), and closes soon after, while another connection keeps the
 * loop busy echoing big PINGs. The write's completion and the hang-up then often come back from
 * one epoll_wait, the completion first: finishing the PUT closed the connection (its reply could
 * not be written), and the hang-up's event after it in the batch used the freed connection (found
 * by a fuzzer against the ASan build, which stops the daemon on it: the exit status at cleanup).
 * Some clients close in the middle of the PUT frame. A well-behaved client is served throughout
 * and reads back what it stores at the end. (Its PUT may find NVMe full for a moment: the
 * hung-up clients' writes still in flight hold their room until they land and the policy's
 * watermark step drops what is over; its pages are then skipped, as the protocol allows, and it
 * sends them again, as an engine would. Expecting them stored at the first try failed 2 runs in
 * 16 here.)
 */
Test(server_malformed, clients_that_hang_up_while_their_puts_are_written)
{
    enum { PAGE = 16, BB = 64 << 10, PAGES = 4, ROUNDS = 60, CONNS = 8, PINGS = 32 };
    kvd_t d = {0};
    kvd_start(&d, "--dram-bytes", "0", "--nvme-bytes", "32M", NULL);
    kvt_client_t *good = kvd_client(&d, "m", PAGE, BB);
    int busy = kvd_raw(&d);
    size_t ping_len = KVT_PROTO_HDR + (64 << 10);
    uint8_t *pings = calloc(PINGS, ping_len), *sink = malloc(1 << 20);
    cr_assert(pings && sink);
    for (int i = 0; i < PINGS; i++)
        kvt_proto_frame(pings + (size_t)i * ping_len, KVT_OP_PING, 0, (uint64_t)i, 0, 64 << 10);
    uint32_t tok[PAGES * PAGE];
    size_t len;
    uint64_t x = 1;
    for (int round = 0; round < ROUNDS; round++) {
        int fds[CONNS];
        for (int i = 0; i < CONNS; i++) {
            fds[i] = kvd_raw(&d);
            raw_hello(fds[i], PAGE, BB);
            kvd_tokens(tok, PAGES * PAGE, (uint32_t)(round * CONNS + i) * 1000);
            uint8_t *f = put_frame(tok, PAGES * PAGE, PAGES, BB, (uint32_t)i, 2, &len);
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            size_t part = (x >> 33) % 8 == 0 ? len / 2 : len; /* some stop mid-frame */
            cr_assert_eq(write(fds[i], f, part), (ssize_t)part);
            free(f);
        }
        /* Whole PINGs only, as many as the socket takes now. */
        for (int i = 0; i < PINGS; i++)
            if (send(busy, pings + (size_t)i * ping_len, ping_len, MSG_DONTWAIT | MSG_NOSIGNAL) !=
                (ssize_t)ping_len)
                break;
        for (int i = 0; i < CONNS; i++) {
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            usleep((useconds_t)((x >> 33) % 200));
            close(fds[i]);
        }
        while (recv(busy, sink, 1 << 20, MSG_DONTWAIT) > 0)
            ;
        if (round % 10 == 0)
            cr_assert_eq(kvt_client_ping(good, NULL), 0, "round %d", round);
    }
    /* What the others sent filled the tier many times over: the good client's pages go in now. */
    kvd_tokens(tok, PAGES * PAGE, 1u << 30);
    uint8_t *mine = put_frame(tok, PAGES * PAGE, PAGES, BB, 7, 1, &len);
    kvt_client_put_t pr;
    uint32_t stored = 0;
    for (int i = 0; i < 100 && stored < PAGES; i++) {
        if (i > 0)
            usleep(50000);
        cr_assert_eq(kvt_client_put(good, tok, PAGES * PAGE, 0, PAGES,
                                    mine + len - (size_t)PAGES * BB, NULL, &pr),
                     0);
        stored += pr.stored;
    }
    cr_assert_eq(stored, PAGES, "the good client's pages went in");
    free(mine);
    reads_back(good, tok, PAGES, PAGE, BB, 7);
    close(busy);
    uint64_t conns = 0;
    for (int i = 0; i < 200 && (conns = kvd_stat(good, "connections")) > 1; i++)
        usleep(10000);
    cr_assert_eq(conns, 1, "every hung-up connection is closed");
    free(pings);
    free(sink);
    kvt_client_close(good);
    kvd_cleanup(&d);
}

/* Requests with no tokens at all, each after a MATCH of 100,000 tokens whose scratch buffer the
 * daemon gives back once it is answered: the daemon then copied no tokens into no buffer, a
 * memcpy to NULL that UBSan reported under a fuzzer (this sequence did not make it report here,
 * so the test only pins the answers down). Each gets its answer. */
Test(server_malformed, requests_with_no_tokens_are_answered)
{
    kvd_t d = {0};
    kvd_start(&d, NULL);
    struct {
        unsigned op;
        uint8_t body[32];
        uint32_t len;
        int status;
    } cases[] = {
        {KVT_OP_MATCH, {0}, sizeof(kvt_wire_match_t), 0},
        {KVT_OP_PUT, {0}, sizeof(kvt_wire_put_t), 0},
        {KVT_OP_PREFETCH, {KVT_CLIENT_TIER_DRAM}, sizeof(kvt_wire_prefetch_t), 0},
        {KVT_OP_REMOVE, {0}, sizeof(kvt_wire_remove_t), KVT_EINVAL},
    };
    enum { BIG = 100000 };
    uint8_t *big = calloc(1, sizeof(kvt_wire_match_t) + BIG * 4);
    cr_assert(big);
    kvt_wire_match_t mw = {.ntokens = BIG};
    memcpy(big, &mw, sizeof mw);
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        int fd = kvd_raw(&d);
        hello(fd, 1);
        req(fd, KVT_OP_MATCH, 0, 9, big, sizeof mw + BIG * 4);
        cr_assert_eq(reply(fd, KVT_OP_MATCH, 9, NULL, NULL), 0);
        req(fd, cases[i].op, 0, 2, cases[i].body, cases[i].len);
        int st = reply(fd, cases[i].op, 2, NULL, NULL);
        cr_expect_eq(st, cases[i].status, "opcode %u: status %d", cases[i].op, st);
        req(fd, KVT_OP_PING, 0, 3, NULL, 0);
        cr_assert_eq(reply(fd, KVT_OP_PING, 3, NULL, NULL), 0);
        close(fd);
    }
    free(big);
    kvd_cleanup(&d);
}
