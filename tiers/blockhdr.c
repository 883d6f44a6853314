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

/* The header's first BLOCKHDR_SUMOFF bytes at p: key's, len, and k's parent, seq, reserved. */
static void head_encode(uint8_t *p, const kvt_block_key_t *key, uint32_t len,
                        const kvt__blockhdr_kept_t *k)
{
    kvt_put_u32(p, BLOCKHDR_MAGIC);
    kvt_put_u16(p + 4, BLOCKHDR_VERSION);
    kvt_put_u16(p + 6, KVT_BLOCKHDR_BYTES);
    kvt_put_u32(p + 8, key->ntokens);
    kvt_put_u32(p + 12, len);
    kvt_put_u64(p + 16, key->ns_seed);
    kvt_put_u64(p + 24, key->hash);
    kvt_put_u64(p + 32, k->parent);
    kvt_put_u64(p + 40, k->seq);
    kvt_put_u64(p + 48, k->reserved);
}

void kvt__blockhdr_encode_summed(void *dst, const kvt_block_key_t *key, uint32_t len, uint64_t seq,
                                 uint64_t sum)
{
    uint8_t *p = dst;
    head_encode(p, key, len, &(kvt__blockhdr_kept_t){.parent = key->parent, .seq = seq});
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

/* blockhdr_sum's stream with no header to read it from: the head (key, len and k's fields) and
 * the tokens are encoded here a slice at a time (little-endian whatever the host), as
 * kvt__blockhdr_encode lays them out. */
static uint64_t key_sum(const kvt_block_key_t *key, const kvt__blockhdr_kept_t *k,
                        const void *payload, uint32_t len)
{
    uint8_t head[BLOCKHDR_SUMOFF], toks[1024];
    head_encode(head, key, len, k);
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

uint64_t kvt__blockhdr_sum(const kvt_block_key_t *key, const void *payload, uint32_t len,
                           uint64_t seq)
{
    return key_sum(key, &(kvt__blockhdr_kept_t){.parent = key->parent, .seq = seq}, payload, len);
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

/* Whether the header at p (parsed into in) names key (kvt__blockhdr_check says which fields). */
static int key_matches(const uint8_t *p, const kvt__blockhdr_info_t *in, const kvt_block_key_t *key)
{
    if (in->ns_seed != key->ns_seed || in->hash != key->hash)
        return 0;
    if (key->parent && in->parent != key->parent)
        return 0;
    if (key->tokens) {
        if (in->ntokens != key->ntokens)
            return 0;
        for (uint32_t i = 0; i < in->ntokens; i++)
            if (kvt_get_u32(p + KVT_BLOCKHDR_BYTES + 4 * i) != key->tokens[i])
                return 0;
    }
    return 1;
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
    if (key && !key_matches(p, &in, key))
        return KVT_ECORRUPT;
    if (len_out)
        *len_out = in.len;
    return 0;
}

int kvt__blockhdr_verify_head(const void *hdr, size_t hdr_avail, const kvt_block_key_t *key,
                              uint32_t len, kvt__blockhdr_kept_t *kept)
{
    if (!hdr || !key || !key->tokens || !kept)
        return KVT_EINVAL;
    kvt__blockhdr_info_t in;
    const uint8_t *p = hdr;
    if (kvt__blockhdr_peek(hdr, hdr_avail, &in) < 0 || hdr_avail < in.hdr_bytes || in.len != len ||
        !key_matches(p, &in, key))
        return KVT_ECORRUPT;
    /* With the key's tokens compared, the header is the key, len and these. */
    *kept = (kvt__blockhdr_kept_t){.parent = in.parent,
                                   .seq = in.seq,
                                   .reserved = kvt_get_u64(p + 48),
                                   .sum = kvt_get_u64(p + BLOCKHDR_SUMOFF)};
    return 0;
}

int kvt__blockhdr_verify_kept(const kvt__blockhdr_kept_t *kept, const kvt_block_key_t *key,
                              const void *payload, uint32_t len)
{
    if (!kept || !key || !key->tokens || (!payload && len))
        return KVT_EINVAL;
    return key_sum(key, kept, payload, len) == kept->sum ? 0 : KVT_ECORRUPT;
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
