/*
 * fuzz_frame.c: libFuzzer harness for the wire protocol's codec (proto/): the frame header and
 * every body decoder, requests and replies, the zero-copy ones (MAP, RESERVE, COMMIT, GET by
 * location) and the one-round-trip ones (MATCH with LOCATE's reply, PUT naming a handle)
 * included, and the STATS iterator. The input's first two bytes are the connection's block size
 * for PUT (as HELLO would have set it), the rest is the body handed to every decoder; its first
 * 24 bytes are also decoded as a header. What a decoder accepts is then checked against the body
 * it came from: every pointer it hands out lies inside the body with all the bytes its counts
 * promise (read here, so that AddressSanitizer sees a pointer that does not).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "proto.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* Aborts (a crash libFuzzer keeps) when [p, p + n) is not inside [body, body + len). */
static void inside(const uint8_t *body, size_t len, const void *p, uint64_t n)
{
    const uint8_t *q = p;
    if (n == 0)
        return;
    if (!q || q < body || (uint64_t)(q - body) > len || n > len - (size_t)(q - body))
        abort();
    volatile uint8_t sink = 0;
    for (uint64_t i = 0; i < n; i++)
        sink ^= q[i];
    (void)sink;
}

static void tokens(const uint8_t *body, size_t len, const uint8_t *t, uint32_t n)
{
    inside(body, len, t, (uint64_t)n * 4);
    if (n == 0)
        return;
    uint32_t *dst = malloc((size_t)n * sizeof(*dst));
    if (!dst)
        return;
    kvt_proto_tokens(t, n, dst);
    free(dst);
}

static void requests(const uint8_t *b, size_t len, uint32_t block_bytes)
{
    kvt_proto_hello_t hello;
    if (kvt_proto_hello_decode(b, len, &hello) == 0) {
        if (hello.model_len > KVT_PROTO_NAME_MAX || hello.adapter_len > KVT_PROTO_NAME_MAX ||
            hello.salt_len > KVT_PROTO_NAME_MAX)
            abort();
        inside(b, len, hello.model, hello.model_len);
        inside(b, len, hello.adapter, hello.adapter_len);
        inside(b, len, hello.salt, hello.salt_len);
    }
    kvt_proto_match_t match;
    if (kvt_proto_match_decode(b, len, &match) == 0)
        tokens(b, len, match.tokens, match.ntokens);
    kvt_proto_put_t put;
    if (kvt_proto_put_decode(b, len, block_bytes, &put) == 0) {
        tokens(b, len, put.tokens, put.ntokens);
        inside(b, len, put.payload, (uint64_t)put.npayload * block_bytes);
    }
    kvt_proto_get_t get;
    (void)kvt_proto_get_decode(b, len, &get);
    kvt_proto_prefetch_t pf;
    if (kvt_proto_prefetch_decode(b, len, &pf) == 0)
        tokens(b, len, pf.tokens, pf.ntokens);
    uint64_t u64;
    (void)kvt_proto_release_decode(b, len, &u64);
    uint32_t n;
    const uint8_t *t;
    if (kvt_proto_remove_decode(b, len, &n, &t) == 0)
        tokens(b, len, t, n);
    uint32_t tier;
    (void)kvt_proto_map_decode(b, len, &tier);
    kvt_proto_reserve_t resv;
    if (kvt_proto_reserve_decode(b, len, &resv) == 0)
        tokens(b, len, resv.tokens, resv.ntokens);
    (void)kvt_proto_commit_decode(b, len, &u64);
    if (kvt_proto_commit_sums_decode(b, len, &u64, &n, &t) == 0)
        inside(b, len, t, (uint64_t)n * 8);
    if (len >= sizeof(kvt_wire_hints_t)) {
        kvt_wire_hints_t w;
        kvt_proto_hints_t h;
        memcpy(&w, b, sizeof(w));
        (void)kvt_proto_hints_from_wire(&w, &h);
    }
}

static void replies(const uint8_t *b, size_t len)
{
    kvt_proto_hello_reply_t hr;
    (void)kvt_proto_hello_reply_decode(b, len, &hr);
    kvt_proto_match_reply_t mr;
    const uint8_t *tiers;
    if (kvt_proto_match_reply_decode(b, len, &mr, &tiers) == 0)
        inside(b, len, tiers, mr.pages);
    kvt_proto_match_locs_t ml; /* a MATCH with LOCATE's reply: tiers, then the offsets */
    if (kvt_proto_match_reply_locs_decode(b, len, &mr, &tiers, &ml) == 0) {
        inside(b, len, tiers, mr.pages);
        inside(b, len, ml.offs, (uint64_t)mr.pages * 8);
        for (uint32_t i = 0; i < mr.pages; i++)
            (void)kvt_proto_match_loc(&ml, i);
    }
    kvt_proto_put_reply_t pr;
    (void)kvt_proto_put_reply_decode(b, len, &pr);
    kvt_proto_prefetch_reply_t fr;
    (void)kvt_proto_prefetch_reply_decode(b, len, &fr);
    uint32_t u32, page, data_len;
    uint8_t tier;
    (void)kvt_proto_release_reply_decode(b, len, &u32);
    const uint8_t *data;
    if (kvt_proto_get_data_decode(b, len, &page, &tier, &data, &data_len) == 0)
        inside(b, len, data, data_len);
    (void)kvt_proto_get_data_kind(b, len);
    uint64_t off;
    (void)kvt_proto_get_loc_decode(b, len, &page, &tier, &off, &data_len);
    (void)kvt_proto_get_end_decode(b, len, &page, &u32);
    (void)kvt_proto_get_end_decode(b, len, &page, NULL);
    kvt_proto_map_reply_t map;
    if (kvt_proto_map_reply_decode(b, len, &map) == 0)
        inside(b, len, map.handle, map.handle_len);
    kvt_proto_reserve_reply_t rr;
    if (kvt_proto_reserve_reply_decode(b, len, &rr) == 0) {
        inside(b, len, rr.locs, (uint64_t)rr.nlocs * sizeof(kvt_wire_resv_loc_t));
        for (uint32_t i = 0; i < rr.nlocs; i++)
            kvt_proto_resv_loc(&rr, i, &page, &off);
    }
    kvt_proto_stats_iter_t it;
    if (kvt_proto_stats_begin(&it, b, len) == 0) {
        char name[256];
        uint64_t v;
        int rc;
        while ((rc = kvt_proto_stats_next(&it, name, &v)) == 1)
            if (strlen(name) > 255)
                abort();
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 2)
        return 0;
    uint32_t block_bytes = (uint32_t)data[0] | (uint32_t)data[1] << 8;
    /* The body in a buffer of its own, exactly as long: a read past it is a heap overflow. */
    size_t len = size - 2;
    uint8_t *body = malloc(len ? len : 1);
    if (!body)
        return 0;
    memcpy(body, data + 2, len);
    if (len >= KVT_PROTO_HDR) {
        kvt_proto_hdr_t h;
        kvt_proto_hdr_decode(body, &h);
        uint8_t again[KVT_PROTO_HDR];
        kvt_proto_hdr_encode(again, &h);
        if (memcmp(again, body, KVT_PROTO_HDR) != 0)
            abort(); /* the header is fixed fields only: decoding loses nothing */
        (void)kvt_proto_hdr_check(&h, KVT_PROTO_MAX_FRAME_DEFAULT);
        (void)kvt_proto_req_flags(h.opcode);
        (void)kvt_proto_op_name(h.opcode);
    }
    requests(body, len, block_bytes);
    replies(body, len);
    free(body);
    return 0;
}
