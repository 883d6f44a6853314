/*
 * test_server_proto.c: the frame parser on its own (server/proto.c): header round trip and
 * checks, and every body decoder against exact, short, long and inconsistent bodies, including
 * counts whose byte sizes overflow. The daemon-level behaviour is test_server_malformed.c.
 */
#include <criterion/criterion.h>
#include <string.h>

#include "../server/proto.h"

Test(server_proto, header_round_trip_and_checks)
{
    kvt_proto_hdr_t h = {.magic = KVT_PROTO_MAGIC,
                         .version = KVT_PROTO_VERSION,
                         .opcode = 3,
                         .flags = 0x1234,
                         .request_id = 0x0102030405060708ull,
                         .body_len = 99,
                         .status = KVT_EBUSY};
    uint8_t b[KVT_PROTO_HDR];
    kvt_proto_hdr_encode(b, &h);
    /* Byte order on the wire: little-endian, magic first. */
    cr_expect(b[0] == 'K' && b[1] == 'V' && b[2] == 'T' && b[3] == 'R');
    cr_expect_eq(b[4], 1);
    cr_expect_eq(b[5], 3);
    cr_expect(b[6] == 0x34 && b[7] == 0x12);
    cr_expect(b[8] == 0x08 && b[15] == 0x01);
    cr_expect(b[16] == 99 && b[17] == 0);
    kvt_proto_hdr_t g;
    kvt_proto_hdr_decode(b, &g);
    cr_expect(memcmp(&g, &h, sizeof g) == 0);
    cr_expect_eq(kvt_proto_hdr_check(&g, 99), 0);
    cr_expect_eq(kvt_proto_hdr_check(&g, 98), KVT_ETOOBIG);
    g.magic ^= 1;
    cr_expect_eq(kvt_proto_hdr_check(&g, 1000), KVT_EPROTO);
    g.magic = KVT_PROTO_MAGIC;
    g.version = 2;
    cr_expect_eq(kvt_proto_hdr_check(&g, 1000), KVT_EPROTO);
    cr_expect_str_eq(kvt_proto_op_name(KVT_OP_PREFETCH), "prefetch");
    cr_expect_str_eq(kvt_proto_op_name(KVT_OP_PING | KVT_OP_REPLY), "ping");
    cr_expect_null(kvt_proto_op_name(0));
    cr_expect_null(kvt_proto_op_name(42));
}

Test(server_proto, match_body)
{
    uint8_t b[256] = {0};
    kvt_wire_match_t w = {.lease_ms = 5, .ntokens = 3};
    memcpy(b, &w, sizeof w);
    for (int i = 0; i < 3; i++)
        kvt_put_u32(b + sizeof w + 4 * i, 10u + (uint32_t)i);
    kvt_proto_match_t m;
    cr_assert_eq(kvt_proto_match_decode(b, sizeof w + 12, &m), 0);
    cr_expect_eq(m.ntokens, 3);
    cr_expect_eq(m.lease_ms, 5);
    uint32_t t[3];
    kvt_proto_tokens(m.tokens, 3, t);
    cr_expect(t[0] == 10 && t[2] == 12);
    for (size_t len = 0; len < sizeof w + 20; len++)
        if (len != sizeof w + 12)
            cr_expect_eq(kvt_proto_match_decode(b, len, &m), KVT_EPROTO, "length %zu", len);
    w.ntokens = 0x40000003; /* x 4 wraps to 12 in 32 bits */
    memcpy(b, &w, sizeof w);
    cr_expect_eq(kvt_proto_match_decode(b, sizeof w + 12, &m), KVT_EPROTO);
    w.ntokens = 0;
    w.hints.flags = KVT_HINT_PAUSED | KVT_HINT_FINISHED;
    memcpy(b, &w, sizeof w);
    cr_expect_eq(kvt_proto_match_decode(b, sizeof w, &m), KVT_EPROTO, "paused and finished");
    w.hints.flags = KVT_HINT_PAUSED;
    w.hints.resume_ms = 700;
    w.hints.engine_request_id = 77;
    memcpy(b, &w, sizeof w);
    cr_assert_eq(kvt_proto_match_decode(b, sizeof w, &m), 0);
    cr_expect(m.hints.resume_ms == 700 && m.hints.engine_request_id == 77);
}

Test(server_proto, put_body)
{
    uint8_t b[512] = {0};
    kvt_wire_put_t w = {.ntokens = 8, .first_page = 1, .npayload = 2};
    memcpy(b, &w, sizeof w);
    kvt_proto_put_t p;
    size_t good = sizeof w + 32 + 2 * 16;
    cr_assert_eq(kvt_proto_put_decode(b, good, 16, &p), 0);
    cr_expect_eq(p.payload, b + sizeof w + 32);
    cr_expect_eq(kvt_proto_put_decode(b, good - 1, 16, &p), KVT_EPROTO);
    cr_expect_eq(kvt_proto_put_decode(b, good + 1, 16, &p), KVT_EPROTO);
    cr_expect_eq(kvt_proto_put_decode(b, good, 15, &p), KVT_EPROTO);
    cr_expect_eq(kvt_proto_put_decode(b, good, 0, &p), KVT_EPROTO, "payload, index-only ns");
    w.npayload = 0x80000000u; /* x block bytes overflows */
    memcpy(b, &w, sizeof w);
    cr_expect_eq(kvt_proto_put_decode(b, good, 16, &p), KVT_EPROTO);
    w.npayload = 0;
    w.reserved = 1;
    memcpy(b, &w, sizeof w);
    cr_expect_eq(kvt_proto_put_decode(b, sizeof w + 32, 16, &p), KVT_EPROTO, "reserved != 0");
}

Test(server_proto, hello_and_fixed_bodies)
{
    uint8_t b[600] = {0};
    kvt_wire_hello_t w = {.min_version = 1,
                          .max_version = 1,
                          .page_size = 16,
                          .block_bytes = 4096,
                          .model_len = 3,
                          .adapter_len = 2,
                          .salt_len = 1};
    memcpy(b, &w, sizeof w);
    memcpy(b + sizeof w, "abcdef", 6);
    kvt_proto_hello_t h;
    cr_assert_eq(kvt_proto_hello_decode(b, sizeof w + 6, &h), 0);
    cr_expect(h.model_len == 3 && !memcmp(h.model, "abc", 3));
    cr_expect(h.adapter_len == 2 && !memcmp(h.adapter, "de", 2));
    cr_expect(h.salt_len == 1 && h.salt[0] == 'f');
    cr_expect_eq(kvt_proto_hello_decode(b, sizeof w + 5, &h), KVT_EPROTO);
    cr_expect_eq(kvt_proto_hello_decode(b, sizeof w + 7, &h), KVT_EPROTO);
    w.model_len = 300;
    memcpy(b, &w, sizeof w);
    cr_expect_eq(kvt_proto_hello_decode(b, sizeof w + 303, &h), KVT_EPROTO, "name over 255");
    w.model_len = 3;
    w.min_version = 2;
    memcpy(b, &w, sizeof w);
    cr_expect_eq(kvt_proto_hello_decode(b, sizeof w + 6, &h), KVT_EPROTO, "min > max");

    kvt_proto_get_t g;
    uint64_t lease;
    uint32_t n;
    const uint8_t *t;
    kvt_proto_prefetch_t pf;
    cr_expect_eq(kvt_proto_get_decode(b, 16, &g), 0);
    cr_expect_eq(kvt_proto_get_decode(b, 17, &g), KVT_EPROTO);
    cr_expect_eq(kvt_proto_release_decode(b, 8, &lease), 0);
    cr_expect_eq(kvt_proto_release_decode(b, 7, &lease), KVT_EPROTO);
    memset(b, 0, sizeof b);
    cr_expect_eq(kvt_proto_remove_decode(b, 8, &n, &t), 0);
    cr_expect_eq(kvt_proto_remove_decode(b, 12, &n, &t), KVT_EPROTO);
    cr_expect_eq(kvt_proto_prefetch_decode(b, 16, &pf), 0);
    cr_expect_eq(kvt_proto_prefetch_decode(b, 15, &pf), KVT_EPROTO);
}
