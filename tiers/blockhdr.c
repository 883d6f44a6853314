/*
 * blockhdr.c: the stored block format that NVMe records and remote values share (layout in
 * tier_impl.h). Encoding writes every field little-endian byte by byte so the format does not
 * depend on the host; the checksum is XXH3-64 streamed over the header's first 56 bytes, the
 * tokens and the payload, so header and payload may live in separate buffers (the NVMe tier
 * reads a payload straight into the caller's buffer).
 */
#define XXH_STATIC_LINKING_ONLY
#include "tier_impl.h"

#include <string.h>
#include <xxhash.h>
#if defined(__x86_64__)
/* libxxhash's run-time dispatch picks the widest vector unit the CPU has (AVX2, AVX-512): the
 * plain XXH3 entry points are built for baseline SSE2. Same hash values, and the payload
 * checksum is the NVMe tier's largest cost per block: bench_tiers' 2 MiB NVMe writes spent 52% of
 * their CPU in it. Measured here over 64 MiB of 2 MiB buffers: 25-32 GB/s against 17-19. */
#include <xxh_x86dispatch.h>
#endif

#define BLOCKHDR_MAGIC   0x4254564bu /* "KVTB" little-endian */
#define BLOCKHDR_VERSION 1u
#define BLOCKHDR_SUMOFF  56u

size_t kvt__blockhdr_size(uint32_t ntokens)
{
    return KVT_BLOCKHDR_BYTES + (size_t)4 * ntokens;
}

static uint64_t blockhdr_sum(const uint8_t *hdr, uint32_t ntokens, const void *payload,
                             uint32_t len)
{
    XXH3_state_t st;
    XXH3_64bits_reset(&st);
    XXH3_64bits_update(&st, hdr, BLOCKHDR_SUMOFF);
    XXH3_64bits_update(&st, hdr + KVT_BLOCKHDR_BYTES, (size_t)4 * ntokens);
    if (len)
        XXH3_64bits_update(&st, payload, len);
    return XXH3_64bits_digest(&st);
}

/* The header's fields before its checksum (BLOCKHDR_SUMOFF bytes): the checksum's first piece. */
static void blockhdr_head(uint8_t *p, const kvt_block_key_t *key, uint32_t len, uint64_t seq)
{
    kvt_put_u32(p, BLOCKHDR_MAGIC);
    kvt_put_u16(p + 4, BLOCKHDR_VERSION);
    kvt_put_u16(p + 6, KVT_BLOCKHDR_BYTES);
    kvt_put_u32(p + 8, key->ntokens);
    kvt_put_u32(p + 12, len);
    kvt_put_u64(p + 16, key->ns_seed);
    kvt_put_u64(p + 24, key->hash);
    kvt_put_u64(p + 32, key->parent);
    kvt_put_u64(p + 40, seq);
    kvt_put_u64(p + 48, 0);
}

void kvt__blockhdr_encode_summed(void *dst, const kvt_block_key_t *key, uint32_t len, uint64_t seq,
                                 uint64_t sum)
{
    uint8_t *p = dst;
    blockhdr_head(p, key, len, seq);
    for (uint32_t i = 0; i < key->ntokens; i++)
        kvt_put_u32(p + KVT_BLOCKHDR_BYTES + 4 * i, key->tokens[i]);
    kvt_put_u64(p + BLOCKHDR_SUMOFF, sum);
}

void kvt__blockhdr_encode(void *dst, const kvt_block_key_t *key, const void *payload, uint32_t len,
                          uint64_t seq)
{
    uint8_t *p = dst;
    kvt__blockhdr_encode_summed(p, key, len, seq, 0);
    kvt_put_u64(p + BLOCKHDR_SUMOFF, blockhdr_sum(p, key->ntokens, payload, len));
}

/* blockhdr_sum's stream with no header to read it from: the head and the tokens are encoded here
 * a few at a time, as kvt__blockhdr_encode would lay them out. */
uint64_t kvt__blockhdr_sum(const kvt_block_key_t *key, const void *payload, uint32_t len,
                           uint64_t seq)
{
    uint8_t head[BLOCKHDR_SUMOFF], toks[256];
    blockhdr_head(head, key, len, seq);
    XXH3_state_t st;
    XXH3_64bits_reset(&st);
    XXH3_64bits_update(&st, head, sizeof head);
    for (uint32_t i = 0; i < key->ntokens;) {
        uint32_t n = KVT_MIN(key->ntokens - i, (uint32_t)(sizeof toks / 4));
        for (uint32_t j = 0; j < n; j++)
            kvt_put_u32(toks + 4 * j, key->tokens[i + j]);
        XXH3_64bits_update(&st, toks, (size_t)4 * n);
        i += n;
    }
    if (len)
        XXH3_64bits_update(&st, payload, len);
    return XXH3_64bits_digest(&st);
}

int kvt__blockhdr_peek(const void *src, size_t avail, kvt__blockhdr_info_t *info)
{
    const uint8_t *p = src;
    if (!src || !info || avail < KVT_BLOCKHDR_BYTES)
        return KVT_ECORRUPT;
    if (kvt_get_u32(p) != BLOCKHDR_MAGIC || kvt_get_u16(p + 4) != BLOCKHDR_VERSION ||
        kvt_get_u16(p + 6) != KVT_BLOCKHDR_BYTES)
        return KVT_ECORRUPT;
    info->ntokens = kvt_get_u32(p + 8);
    info->len = kvt_get_u32(p + 12);
    if (info->ntokens > KVT_PAGE_MAX || info->len > KVT_TIER_MAX_BLOCK)
        return KVT_ECORRUPT;
    info->ns_seed = kvt_get_u64(p + 16);
    info->hash = kvt_get_u64(p + 24);
    info->parent = kvt_get_u64(p + 32);
    info->seq = kvt_get_u64(p + 40);
    info->hdr_bytes = kvt__blockhdr_size(info->ntokens);
    return 0;
}

int kvt__blockhdr_verify(const void *hdr, size_t hdr_avail, const void *payload,
                         size_t payload_avail, const kvt_block_key_t *key, uint32_t *len_out)
{
    if (!hdr || (!payload && payload_avail))
        return KVT_EINVAL;
    kvt__blockhdr_info_t in;
    if (kvt__blockhdr_peek(hdr, hdr_avail, &in) < 0 || hdr_avail < in.hdr_bytes ||
        payload_avail < in.len)
        return KVT_ECORRUPT;
    const uint8_t *p = hdr;
    if (kvt_get_u64(p + BLOCKHDR_SUMOFF) != blockhdr_sum(p, in.ntokens, payload, in.len))
        return KVT_ECORRUPT;
    if (key) {
        if (in.ns_seed != key->ns_seed || in.hash != key->hash)
            return KVT_ECORRUPT;
        if (key->parent && in.parent != key->parent)
            return KVT_ECORRUPT;
        if (key->tokens) {
            if (in.ntokens != key->ntokens)
                return KVT_ECORRUPT;
            for (uint32_t i = 0; i < in.ntokens; i++)
                if (kvt_get_u32(p + KVT_BLOCKHDR_BYTES + 4 * i) != key->tokens[i])
                    return KVT_ECORRUPT;
        }
    }
    if (len_out)
        *len_out = in.len;
    return 0;
}

int kvt__blockhdr_verify_pieces(const void *hdr, size_t hdr_avail,
                                int (*next)(void *arg, const uint8_t **piece, size_t *n), void *arg,
                                uint32_t *len_out)
{
    if (!hdr || !next)
        return KVT_EINVAL;
    kvt__blockhdr_info_t in;
    if (kvt__blockhdr_peek(hdr, hdr_avail, &in) < 0 || hdr_avail < in.hdr_bytes)
        return KVT_ECORRUPT;
    /* blockhdr_sum's stream, its payload fed as it comes */
    const uint8_t *p = hdr;
    XXH3_state_t st;
    XXH3_64bits_reset(&st);
    XXH3_64bits_update(&st, p, BLOCKHDR_SUMOFF);
    XXH3_64bits_update(&st, p + KVT_BLOCKHDR_BYTES, (size_t)4 * in.ntokens);
    for (uint32_t got = 0; got < in.len;) {
        const uint8_t *piece = NULL;
        size_t n = 0;
        int rc = next(arg, &piece, &n);
        if (rc < 0)
            return rc;
        if (n == 0 || !piece)
            return KVT_EINVAL;
        n = KVT_MIN(n, (size_t)(in.len - got));
        XXH3_64bits_update(&st, piece, n);
        got += (uint32_t)n;
    }
    if (kvt_get_u64(p + BLOCKHDR_SUMOFF) != XXH3_64bits_digest(&st))
        return KVT_ECORRUPT;
    if (len_out)
        *len_out = in.len;
    return 0;
}

int kvt__blockhdr_check(const void *src, size_t avail, const kvt_block_key_t *key,
                        uint32_t *len_out, const void **payload_out)
{
    if (!src)
        return KVT_EINVAL;
    kvt__blockhdr_info_t in;
    if (kvt__blockhdr_peek(src, avail, &in) < 0 || avail < in.hdr_bytes)
        return KVT_ECORRUPT;
    const uint8_t *payload = (const uint8_t *)src + in.hdr_bytes;
    int rc = kvt__blockhdr_verify(src, in.hdr_bytes, payload, avail - in.hdr_bytes, key, len_out);
    if (rc == 0 && payload_out)
        *payload_out = payload;
    return rc;
}
