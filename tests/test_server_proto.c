/*
 * test_server_proto.c: the protocol's codec on its own (proto/proto.c): header round trip and
 * checks, every body decoder against exact, short, long and inconsistent bodies, including
 * counts whose byte sizes overflow, and every encoder against its decoder. The daemon-level
 * behaviour is test_server_malformed.c.
 */
#include <criterion/criterion.h>
#include <string.h>

#include "proto.h"

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
    /* The once reserved u32 is the handle (PUT's HANDLE flag): read as it is, the handler
     * checks it against the flag (server_trip tests a handle without the flag). */
    w.npayload = 0;
    w.handle = 9;
    memcpy(b, &w, sizeof w);
    cr_assert_eq(kvt_proto_put_decode(b, sizeof w + 32, 16, &p), 0);
    cr_expect_eq(p.handle, 9);
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

/* What one side encodes the other decodes to the same values, and a body one byte off is
 * refused: requests (the client encodes, the server decodes) and replies (the other way). */
Test(server_proto, encoders_round_trip)
{
    kvt_proto_hints_t hints = {
        .engine_request_id = 77, .resume_ms = 5, .priority = 3, .flags = KVT_HINT_PAUSED};
    uint32_t tok[6] = {1, 2, 3, 0xdeadbeef, 5, 6};
    uint8_t body[256];

    kvt_proto_match_t mq = {.hints = hints, .lease_ms = 900, .ntokens = 6}, md;
    kvt_proto_match_encode(body, &mq);
    kvt_proto_tokens_encode(body + sizeof(kvt_wire_match_t), tok, 6);
    cr_assert_eq(kvt_proto_match_decode(body, sizeof(kvt_wire_match_t) + 24, &md), 0);
    cr_expect_eq(md.lease_ms, 900);
    cr_expect_eq(md.hints.engine_request_id, 77);
    cr_expect_eq(md.hints.flags, KVT_HINT_PAUSED);
    uint32_t back[6];
    kvt_proto_tokens(md.tokens, md.ntokens, back);
    cr_expect(memcmp(back, tok, sizeof tok) == 0);
    cr_expect_eq(kvt_get_u32(body + sizeof(kvt_wire_match_t) + 12), 0xdeadbeef, "little-endian");

    kvt_proto_put_t pq = {.hints = hints, .ntokens = 4, .first_page = 1, .npayload = 1}, pd;
    kvt_proto_put_encode(body, &pq);
    kvt_proto_tokens_encode(body + sizeof(kvt_wire_put_t), tok, 4);
    memset(body + sizeof(kvt_wire_put_t) + 16, 0xab, 8); /* one page of 8 bytes */
    cr_assert_eq(kvt_proto_put_decode(body, sizeof(kvt_wire_put_t) + 24, 8, &pd), 0);
    cr_expect(pd.ntokens == 4 && pd.first_page == 1 && pd.npayload == 1 && pd.payload[7] == 0xab);

    kvt_proto_get_t gq = {.lease = 1ull << 40, .first_page = 2, .npages = 3}, gd;
    kvt_proto_get_encode(body, &gq);
    cr_assert_eq(kvt_proto_get_decode(body, sizeof(kvt_wire_get_t), &gd), 0);
    cr_expect(gd.lease == gq.lease && gd.first_page == 2 && gd.npages == 3);

    kvt_proto_prefetch_t fq = {.tier = 2, .deadline_ms = 50, .ntokens = 0}, fd;
    kvt_proto_prefetch_encode(body, &fq);
    cr_assert_eq(kvt_proto_prefetch_decode(body, sizeof(kvt_wire_prefetch_t), &fd), 0);
    cr_expect(fd.tier == 2 && fd.deadline_ms == 50 && fd.ntokens == 0);

    uint64_t lease;
    kvt_proto_release_encode(body, 123456789012ull);
    cr_assert_eq(kvt_proto_release_decode(body, 8, &lease), 0);
    cr_expect_eq(lease, 123456789012ull);
    uint32_t n;
    const uint8_t *tp;
    kvt_proto_remove_encode(body, 0);
    cr_expect_eq(kvt_proto_remove_decode(body, 8, &n, &tp), 0);
    cr_expect_eq(n, 0);

    kvt_proto_hello_t hq = {.min_version = 1,
                            .max_version = 1,
                            .page_size = 16,
                            .block_bytes = 4096,
                            .model_len = 2,
                            .salt_len = 1},
                      hd;
    kvt_proto_hello_encode(body, &hq);
    memcpy(body + sizeof(kvt_wire_hello_t), "m1s", 3);
    cr_assert_eq(kvt_proto_hello_decode(body, sizeof(kvt_wire_hello_t) + 3, &hd), 0);
    cr_expect(hd.page_size == 16 && hd.block_bytes == 4096 && hd.model_len == 2 &&
              hd.adapter_len == 0 && hd.salt_len == 1 && hd.salt[0] == 's');
    cr_expect_eq(hd.device, 0, "no device: 0, what an old client sends");
    /* The device is the u16 at offset 18 (once reserved, 0 from old clients), little-endian. */
    hq.device = 0x0102;
    kvt_proto_hello_encode(body, &hq);
    cr_expect(body[18] == 0x02 && body[19] == 0x01);
    cr_assert_eq(kvt_proto_hello_decode(body, sizeof(kvt_wire_hello_t) + 3, &hd), 0);
    cr_expect_eq(hd.device, 0x0102);

    kvt_proto_hello_reply_t hr = {.version = 1,
                                  .tiers = 0x1e,
                                  .ns = 9,
                                  .ns_seed = 1ull << 63,
                                  .max_frame = 1 << 20,
                                  .lease_ms_max = 60000},
                            hrd;
    kvt_proto_hello_reply_encode(body, &hr);
    cr_assert_eq(kvt_proto_hello_reply_decode(body, sizeof(kvt_wire_hello_reply_t), &hrd), 0);
    cr_expect(memcmp(&hr, &hrd, sizeof hr) == 0);
    cr_expect_eq(kvt_proto_hello_reply_decode(body, sizeof(kvt_wire_hello_reply_t) - 1, &hrd),
                 KVT_EPROTO);

    kvt_proto_match_reply_t mr = {.tokens = 32, .pages = 2, .lease = 5, .remote_pages = 1}, mrd;
    const uint8_t *tiers;
    kvt_proto_match_reply_encode(body, &mr);
    body[sizeof(kvt_wire_match_reply_t)] = 2;
    body[sizeof(kvt_wire_match_reply_t) + 1] = 4;
    cr_assert_eq(
        kvt_proto_match_reply_decode(body, sizeof(kvt_wire_match_reply_t) + 2, &mrd, &tiers), 0);
    cr_expect(mrd.tokens == 32 && mrd.pages == 2 && mrd.lease == 5 && mrd.remote_pages == 1);
    cr_expect(tiers[0] == 2 && tiers[1] == 4);
    cr_expect_eq(
        kvt_proto_match_reply_decode(body, sizeof(kvt_wire_match_reply_t) + 1, &mrd, &tiers),
        KVT_EPROTO, "fewer tier bytes than pages");

    kvt_proto_put_reply_t pr = {.pages = 4, .new_pages = 3, .stored = 2, .skipped = 1}, prd;
    kvt_proto_put_reply_encode(body, &pr);
    cr_assert_eq(kvt_proto_put_reply_decode(body, sizeof(kvt_wire_put_reply_t), &prd), 0);
    cr_expect(memcmp(&pr, &prd, sizeof pr) == 0);

    kvt_proto_prefetch_reply_t fr = {.pages = 4, .moved = 3, .resident = 1, .failed = 0}, frd;
    kvt_proto_prefetch_reply_encode(body, &fr);
    cr_assert_eq(kvt_proto_prefetch_reply_decode(body, sizeof(kvt_wire_prefetch_reply_t), &frd), 0);
    cr_expect(memcmp(&fr, &frd, sizeof fr) == 0);

    uint32_t released;
    kvt_proto_release_reply_encode(body, 1);
    cr_assert_eq(kvt_proto_release_reply_decode(body, 4, &released), 0);
    cr_expect_eq(released, 1);
    cr_expect_eq(kvt_proto_release_reply_decode(body, 5, &released), KVT_EPROTO);

    uint32_t page, dlen;
    uint8_t tier;
    const uint8_t *data;
    kvt_proto_get_data_encode(body, 7, 3);
    memcpy(body + sizeof(kvt_wire_get_data_t), "abcd", 4);
    cr_assert_eq(kvt_proto_get_data_decode(body, sizeof(kvt_wire_get_data_t) + 4, &page, &tier,
                                           &data, &dlen),
                 0);
    cr_expect(page == 7 && tier == 3 && dlen == 4 && memcmp(data, "abcd", 4) == 0);
    cr_expect_eq(kvt_proto_get_data_decode(body, 3, &page, &tier, &data, &dlen), KVT_EPROTO);
    kvt_proto_get_end_encode(body, 11, 250);
    uint32_t left = 0;
    cr_assert_eq(kvt_proto_get_end_decode(body, sizeof(kvt_wire_get_end_t), &n, &left), 0);
    cr_expect(n == 11 && left == 250);
    cr_assert_eq(kvt_proto_get_end_decode(body, sizeof(kvt_wire_get_end_t), &n, NULL), 0);

    /* A location frame is not a payload frame, and the other way round. */
    uint64_t off;
    kvt_proto_get_loc_encode(body, 9, 2, 1ull << 40, 4096);
    cr_expect_eq(kvt_proto_get_data_kind(body, sizeof(kvt_wire_get_loc_t)), KVT_GET_DATA_LOC);
    cr_assert_eq(
        kvt_proto_get_loc_decode(body, sizeof(kvt_wire_get_loc_t), &page, &tier, &off, &dlen), 0);
    cr_expect(page == 9 && tier == 2 && off == 1ull << 40 && dlen == 4096);
    cr_expect_eq(
        kvt_proto_get_data_decode(body, sizeof(kvt_wire_get_loc_t), &page, &tier, &data, &dlen),
        KVT_EPROTO);
    cr_expect_eq(
        kvt_proto_get_loc_decode(body, sizeof(kvt_wire_get_loc_t) - 1, &page, &tier, &off, &dlen),
        KVT_EPROTO);
    kvt_proto_get_data_encode(body, 7, 3);
    cr_expect_eq(kvt_proto_get_data_kind(body, sizeof(kvt_wire_get_loc_t)), KVT_GET_DATA_BYTES);
    cr_expect_eq(
        kvt_proto_get_loc_decode(body, sizeof(kvt_wire_get_loc_t), &page, &tier, &off, &dlen),
        KVT_EPROTO);
}

/* The zero-copy requests and replies round-trip; a count that disagrees with the length, or a
 * reserved field set, is refused. */
Test(server_proto, zero_copy_codec_round_trips)
{
    uint8_t b[256];
    uint32_t tier;
    kvt_proto_map_encode(b, 2);
    cr_assert_eq(kvt_proto_map_decode(b, sizeof(kvt_wire_map_t), &tier), 0);
    cr_expect_eq(tier, 2);
    cr_expect_eq(kvt_proto_map_decode(b, sizeof(kvt_wire_map_t) + 1, &tier), KVT_EPROTO);
    b[4] = 1;
    cr_expect_eq(kvt_proto_map_decode(b, sizeof(kvt_wire_map_t), &tier), KVT_EPROTO);

    kvt_proto_map_reply_t mr = {.map_bytes = 1ull << 33, .tier = 1, .handle_len = 4};
    kvt_proto_map_reply_encode(b, &mr);
    memcpy(b + sizeof(kvt_wire_map_reply_t), "hndl", 4);
    kvt_proto_map_reply_t mo;
    cr_assert_eq(kvt_proto_map_reply_decode(b, sizeof(kvt_wire_map_reply_t) + 4, &mo), 0);
    cr_expect(mo.map_bytes == 1ull << 33 && mo.tier == 1 && mo.handle_len == 4 &&
              memcmp(mo.handle, "hndl", 4) == 0);
    cr_expect_eq(kvt_proto_map_reply_decode(b, sizeof(kvt_wire_map_reply_t) + 3, &mo), KVT_EPROTO);

    uint32_t toks[3] = {1, 2, 3};
    kvt_proto_reserve_t rq = {.ntokens = 3, .first_page = 1, .npages = 2};
    rq.hints.priority = 5;
    kvt_proto_reserve_encode(b, &rq);
    kvt_proto_tokens_encode(b + sizeof(kvt_wire_reserve_t), toks, 3);
    kvt_proto_reserve_t ro;
    cr_assert_eq(kvt_proto_reserve_decode(b, sizeof(kvt_wire_reserve_t) + 12, &ro), 0);
    cr_expect(ro.ntokens == 3 && ro.first_page == 1 && ro.npages == 2 && ro.hints.priority == 5);
    cr_expect_eq(kvt_proto_reserve_decode(b, sizeof(kvt_wire_reserve_t) + 8, &ro), KVT_EPROTO);

    kvt_proto_reserve_reply_t rr = {
        .resv = 77, .pages = 4, .new_pages = 2, .nlocs = 2, .flags = KVT_RESV_F_SEAL};
    kvt_proto_reserve_reply_encode(b, &rr);
    kvt_proto_resv_loc_encode(b + sizeof(kvt_wire_reserve_reply_t), 1, 4096);
    kvt_proto_resv_loc_encode(b + sizeof(kvt_wire_reserve_reply_t) + 16, 3, 1ull << 36);
    kvt_proto_reserve_reply_t rd;
    cr_assert_eq(kvt_proto_reserve_reply_decode(b, sizeof(kvt_wire_reserve_reply_t) + 32, &rd), 0);
    cr_expect(rd.resv == 77 && rd.pages == 4 && rd.new_pages == 2 && rd.nlocs == 2 &&
              rd.flags == KVT_RESV_F_SEAL);
    uint32_t page;
    uint64_t off;
    kvt_proto_resv_loc(&rd, 1, &page, &off);
    cr_expect(page == 3 && off == 1ull << 36);
    cr_expect_eq(kvt_proto_reserve_reply_decode(b, sizeof(kvt_wire_reserve_reply_t) + 16, &rd),
                 KVT_EPROTO);

    uint64_t resv;
    kvt_proto_commit_encode(b, 99);
    cr_assert_eq(kvt_proto_commit_decode(b, 8, &resv), 0);
    cr_expect_eq(resv, 99);
    cr_expect_eq(kvt_proto_commit_decode(b, 9, &resv), KVT_EPROTO);
    /* With sums: one little-endian u64 per reserved page after the reservation. */
    kvt_put_u64(b + 8, 0x1122334455667788ull);
    kvt_put_u64(b + 16, 42);
    uint32_t nsums = 0;
    const uint8_t *sums = NULL;
    cr_assert_eq(kvt_proto_commit_sums_decode(b, 24, &resv, &nsums, &sums), 0);
    cr_expect(resv == 99 && nsums == 2 && sums == b + 8);
    cr_expect(kvt_get_u64(sums) == 0x1122334455667788ull && kvt_get_u64(sums + 8) == 42);
    cr_expect_eq(kvt_proto_commit_sums_decode(b, 8, &resv, &nsums, &sums), KVT_EPROTO);
    cr_expect_eq(kvt_proto_commit_sums_decode(b, 20, &resv, &nsums, &sums), KVT_EPROTO);
    cr_expect_eq(kvt_proto_commit_sums_decode(b, 4, &resv, &nsums, &sums), KVT_EPROTO);
    /* A reply flag this side does not know is a protocol error, as a wrong length is. */
    rr.flags = 0x2;
    kvt_proto_reserve_reply_encode(b, &rr);
    cr_expect_eq(kvt_proto_reserve_reply_decode(b, sizeof(kvt_wire_reserve_reply_t) + 32, &rd),
                 KVT_EPROTO);
    cr_expect_eq(kvt_proto_req_flags(KVT_OP_GET), KVT_GET_F_LOCATE);
    cr_expect_eq(kvt_proto_req_flags(KVT_OP_COMMIT), KVT_COMMIT_F_ABORT | KVT_COMMIT_F_SUMS);
    cr_expect_str_eq(kvt_proto_op_name(KVT_OP_RESERVE | KVT_OP_REPLY), "reserve");
}

/* STATS: entries that fit go in and are counted; one that does not is left out whole; the
 * iterator gives them back in order and refuses a body that ends inside an entry. */
Test(server_proto, stats_round_trip)
{
    uint8_t buf[40] = {0};
    size_t len = 4;
    cr_assert_eq(kvt_proto_stat_encode(buf, sizeof buf, &len, "leases", 3), 0);
    cr_assert_eq(kvt_proto_stat_encode(buf, sizeof buf, &len, "uptime_ms", 1ull << 40), 0);
    cr_expect_eq(kvt_proto_stat_encode(buf, sizeof buf, &len, "no_room", 1), KVT_ETOOBIG);
    cr_expect_eq(kvt_get_u32(buf), 2);
    kvt_proto_stats_iter_t it;
    char name[256];
    uint64_t v;
    cr_assert_eq(kvt_proto_stats_begin(&it, buf, len), 0);
    cr_assert_eq(kvt_proto_stats_next(&it, name, &v), 1);
    cr_expect(strcmp(name, "leases") == 0 && v == 3);
    cr_assert_eq(kvt_proto_stats_next(&it, name, &v), 1);
    cr_expect(strcmp(name, "uptime_ms") == 0 && v == 1ull << 40);
    cr_expect_eq(kvt_proto_stats_next(&it, name, &v), 0);
    cr_assert_eq(kvt_proto_stats_begin(&it, buf, len - 1), 0);
    kvt_proto_stats_next(&it, name, &v);
    cr_expect_eq(kvt_proto_stats_next(&it, name, &v), KVT_EPROTO);
    cr_expect_eq(kvt_proto_stats_begin(&it, buf, 3), KVT_EPROTO);
}
