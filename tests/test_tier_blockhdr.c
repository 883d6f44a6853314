/*
 * test_tier_blockhdr.c: the stored block format shared by the NVMe and remote tiers. A block
 * checks against its own key; every single flipped bit anywhere in header, tokens or payload is
 * caught; a different key, a truncated block and garbage are refused; the split form (header and
 * payload in separate buffers) agrees with the contiguous one; the layout is little-endian at
 * the documented offsets; the checksum is plain XXH3-64 whatever vector unit computed it; a
 * payload checked in pieces (recovery of large records) agrees with it whole; a checksum made
 * apart (kvt__blockhdr_sum, a PUT's NVMe write prepared with no lock held) encodes the same bytes.
 */
#define XXH_STATIC_LINKING_ONLY
#include "test_tier_util.h"
#include "tier_impl.h"

#include <xxhash.h>

static uint8_t *encode(const kvt_block_key_t *k, const uint8_t *payload, uint32_t len,
                       size_t *total)
{
    size_t hdr = kvt__blockhdr_size(k->ntokens);
    uint8_t *b = malloc(hdr + len + 1);
    kvt__blockhdr_encode(b, k, payload, len, 77);
    memcpy(b + hdr, payload, len);
    *total = hdr + len;
    return b;
}

Test(tier_blockhdr, a_block_checks_against_its_key)
{
    uint32_t tok[16];
    kvt_block_key_t k = tu_key(3, tok, 16);
    uint8_t payload[3000];
    tu_fill(payload, sizeof(payload), 3);
    size_t n;
    uint8_t *b = encode(&k, payload, sizeof(payload), &n);
    cr_assert_eq(n, 64 + 64 + sizeof(payload));
    uint32_t len = 0;
    const void *p = NULL;
    cr_assert_eq(kvt__blockhdr_check(b, n, &k, &len, &p), 0);
    cr_assert_eq(len, sizeof(payload));
    cr_assert_eq(memcmp(p, payload, len), 0);
    cr_assert_eq(kvt__blockhdr_check(b, n, NULL, &len, &p), 0, "any key, as in recovery");
    cr_assert_eq(kvt__blockhdr_verify(b, 128, payload, sizeof(payload), &k, &len), 0);
    kvt__blockhdr_info_t in;
    cr_assert_eq(kvt__blockhdr_peek(b, n, &in), 0);
    cr_assert_eq(in.hash, k.hash);
    cr_assert_eq(in.parent, k.parent);
    cr_assert_eq(in.ns_seed, k.ns_seed);
    cr_assert_eq(in.seq, 77);
    cr_assert_eq(in.ntokens, 16);
    cr_assert_eq(in.hdr_bytes, 128);
    /* Little-endian at the documented offsets. */
    cr_assert_eq(memcmp(b, "KVTB", 4), 0);
    cr_assert_eq(b[24], (uint8_t)k.hash);
    cr_assert_eq(b[31], (uint8_t)(k.hash >> 56));
    cr_assert_eq(b[64], (uint8_t)tok[0]);
    /* tokens == NULL and parent == 0 in a key skip those comparisons. */
    kvt_block_key_t loose = {.ns_seed = k.ns_seed, .hash = k.hash, .ntokens = 16};
    cr_assert_eq(kvt__blockhdr_check(b, n, &loose, &len, &p), 0);
    free(b);
}

Test(tier_blockhdr, every_flipped_bit_is_caught)
{
    uint32_t tok[4];
    kvt_block_key_t k = tu_key(5, tok, 4);
    uint8_t payload[200];
    tu_fill(payload, sizeof(payload), 5);
    size_t n;
    uint8_t *b = encode(&k, payload, sizeof(payload), &n);
    for (size_t i = 0; i < n; i++) {
        for (int bit = 0; bit < 8; bit++) {
            b[i] ^= (uint8_t)(1u << bit);
            uint32_t len;
            const void *p;
            cr_assert_eq(kvt__blockhdr_check(b, n, NULL, &len, &p), KVT_ECORRUPT, "byte %zu bit %d",
                         i, bit);
            b[i] ^= (uint8_t)(1u << bit);
        }
    }
    free(b);
}

Test(tier_blockhdr, other_keys_short_blocks_and_garbage_are_refused)
{
    uint32_t tok[16], tok2[16];
    kvt_block_key_t k = tu_key(1, tok, 16);
    uint8_t payload[1000];
    tu_fill(payload, sizeof(payload), 1);
    size_t n;
    uint8_t *b = encode(&k, payload, sizeof(payload), &n);
    uint32_t len;
    const void *p;
    kvt_block_key_t o = k;
    o.hash ^= 1;
    cr_assert_eq(kvt__blockhdr_check(b, n, &o, &len, &p), KVT_ECORRUPT);
    o = k;
    o.ns_seed ^= 1;
    cr_assert_eq(kvt__blockhdr_check(b, n, &o, &len, &p), KVT_ECORRUPT);
    o = k;
    o.parent ^= 1;
    cr_assert_eq(kvt__blockhdr_check(b, n, &o, &len, &p), KVT_ECORRUPT);
    memcpy(tok2, tok, sizeof(tok));
    tok2[15] ^= 1;
    o = k;
    o.tokens = tok2;
    cr_assert_eq(kvt__blockhdr_check(b, n, &o, &len, &p), KVT_ECORRUPT);
    o = k;
    o.ntokens = 15;
    cr_assert_eq(kvt__blockhdr_check(b, n, &o, &len, &p), KVT_ECORRUPT);
    for (size_t cut = 0; cut < n; cut += 97)
        cr_assert_eq(kvt__blockhdr_check(b, cut, &k, &len, &p), KVT_ECORRUPT, "cut at %zu", cut);
    uint8_t junk[512];
    tu_fill(junk, sizeof(junk), 9);
    cr_assert_eq(kvt__blockhdr_check(junk, sizeof(junk), NULL, &len, &p), KVT_ECORRUPT);
    cr_assert_eq(kvt__blockhdr_check(NULL, 10, NULL, &len, &p), KVT_EINVAL);
    /* An empty page and an empty payload are valid blocks too. */
    kvt_block_key_t e = {.ns_seed = 1, .hash = 2, .parent = 1, .tokens = NULL, .ntokens = 0};
    uint8_t hdr[64];
    kvt__blockhdr_encode(hdr, &e, NULL, 0, 1);
    cr_assert_eq(kvt__blockhdr_check(hdr, sizeof(hdr), &e, &len, &p), 0);
    cr_assert_eq(len, 0);
    free(b);
}

/* The checksum is plain XXH3-64 over bytes 0..55, the tokens and the payload, whichever vector
 * unit computed it (tiers/blockhdr.c uses libxxhash's run-time dispatch): blocks stored by an
 * earlier build, or on another machine of the fleet, still verify. Computed here with the
 * baseline entry points over a payload long enough for the vector path. */
Test(tier_blockhdr, the_checksum_is_plain_xxh3)
{
    enum { LEN = (1u << 20) + 13 };
    uint32_t tok[16];
    kvt_block_key_t k = tu_key(5, tok, 16);
    uint8_t *payload = malloc(LEN);
    tu_fill(payload, LEN, 9);
    size_t total;
    uint8_t *b = encode(&k, payload, LEN, &total);
    XXH3_state_t st;
    XXH3_64bits_reset(&st);
    XXH3_64bits_update(&st, b, 56);
    XXH3_64bits_update(&st, b + KVT_BLOCKHDR_BYTES, sizeof tok);
    XXH3_64bits_update(&st, payload, LEN);
    uint64_t want = XXH3_64bits_digest(&st), got = 0;
    for (int i = 7; i >= 0; i--)
        got = got << 8 | b[56 + i];
    cr_expect_eq(got, want, "stored %016llx, XXH3 %016llx", (unsigned long long)got,
                 (unsigned long long)want);
    free(b);
    free(payload);
}

/* A payload handed out in pieces of `step` bytes (the last may run past its end, as recovery's
 * sector-rounded reads do); fail: the code to fail with at the second piece. */
typedef struct pieces {
    const uint8_t *p;
    size_t at, step;
    int calls, fail;
} pieces_t;

static int next_piece(void *arg, const uint8_t **piece, size_t *n)
{
    pieces_t *s = arg;
    if (++s->calls == 2 && s->fail)
        return s->fail;
    *piece = s->p + s->at;
    *n = s->step;
    s->at += s->step;
    return 0;
}

Test(tier_blockhdr, a_payload_in_pieces_checks_as_a_whole)
{
    uint32_t tok[16];
    kvt_block_key_t k = tu_key(5, tok, 16);
    enum { LEN = 10000, ROOM = 3 * 4096 };
    uint8_t *payload = calloc(1, ROOM);
    tu_fill(payload, LEN, 5);
    size_t n;
    uint8_t *b = encode(&k, payload, LEN, &n);
    const size_t steps[] = {1, 7, 4096, LEN, ROOM};
    for (size_t i = 0; i < sizeof(steps) / sizeof(steps[0]); i++) {
        pieces_t s = {.p = payload, .step = steps[i]};
        uint32_t len = 0;
        cr_assert_eq(kvt__blockhdr_verify_pieces(b, 128, next_piece, &s, &len), 0, "step %zu",
                     steps[i]);
        cr_assert_eq(len, LEN);
        cr_assert_leq(s.at - s.step, (size_t)LEN - 1, "no piece asked for after the payload");
    }
    /* A flipped byte in a later piece is caught; a failing read is the caller's code. */
    payload[LEN - 1] ^= 1;
    pieces_t s = {.p = payload, .step = 4096};
    cr_assert_eq(kvt__blockhdr_verify_pieces(b, 128, next_piece, &s, NULL), KVT_ECORRUPT);
    payload[LEN - 1] ^= 1;
    s = (pieces_t){.p = payload, .step = 4096, .fail = KVT_EIO};
    cr_assert_eq(kvt__blockhdr_verify_pieces(b, 128, next_piece, &s, NULL), KVT_EIO);
    s = (pieces_t){.p = payload, .step = 4096};
    cr_assert_eq(kvt__blockhdr_verify_pieces(b, 100, next_piece, &s, NULL), KVT_ECORRUPT,
                 "a header cut short");
    free(b);
    free(payload);
}

/* kvt_tier_write_prepare's pieces: the checksum made with no header to read it from, then the
 * header encoded with it, give the bytes kvt__blockhdr_encode writes, whatever the page size
 * (token runs longer than the sum's encoding buffer included, and none). */
Test(tier_blockhdr, a_checksum_made_apart_encodes_the_same_header)
{
    static uint32_t tok[1000];
    static uint8_t payload[70000];
    static const uint32_t ntokens[] = {0, 1, 16, 63, 64, 65, 1000};
    for (size_t i = 0; i < KVT_ARRAY_LEN(ntokens); i++) {
        kvt_block_key_t k = tu_key(40 + i, tok, ntokens[i]);
        uint32_t len = (uint32_t)(sizeof(payload) - 977 * i);
        tu_fill(payload, len, 40 + i);
        size_t hdr = kvt__blockhdr_size(k.ntokens);
        uint8_t *whole = malloc(hdr), *apart = malloc(hdr);
        kvt__blockhdr_encode(whole, &k, payload, len, 1000 + i);
        uint64_t sum = kvt__blockhdr_sum(&k, payload, len, 1000 + i);
        kvt__blockhdr_encode_summed(apart, &k, len, 1000 + i, sum);
        cr_assert_eq(memcmp(whole, apart, hdr), 0, "%u tokens", ntokens[i]);
        cr_assert_eq(kvt__blockhdr_verify(apart, hdr, payload, len, &k, NULL), 0);
        cr_assert_neq(kvt__blockhdr_sum(&k, payload, len, 2000 + i), sum, "the seq counts");
        payload[len / 2] ^= 1;
        cr_assert_neq(kvt__blockhdr_sum(&k, payload, len, 1000 + i), sum, "the payload counts");
        free(whole);
        free(apart);
    }
}
