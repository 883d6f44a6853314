/*
 * test_client_seal.c: libkvtier's copy-and-hash of a zero-copy page (client/seal.c) against
 * libxxhash's own XXH3_64bits, which is what the daemon checks the page with: every way the CPU
 * has (plain, AVX2, AVX-512), lengths on and around XXH3's stripe (64), block (1 KiB) and
 * short-input (240) boundaries, misaligned source and destination, and bytes past the copy left
 * alone. A way the CPU lacks is reported skipped.
 */
#include <criterion/criterion.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "seal.h"

static const size_t lens[] = {0,    1,    17,   64,    128,   240,      241,     255,
                              256,  300,  1023, 1024,  1025,  1087,     1088,    2047,
                              2048, 4099, 8192, 65536, 65600, 1u << 20, 2u << 20};

/* Copies through way (or kvt__copy_xxh3 when way is -1) at every length and a few alignments;
 * returns 0 when the CPU lacks the way. */
static int check_way(int way)
{
    size_t max = 2u << 20;
    uint8_t *src = malloc(max + 64), *dst = malloc(max + 128);
    cr_assert(src && dst);
    for (size_t i = 0; i < max + 64; i++)
        src[i] = (uint8_t)((i * 2654435761u) >> 13);
    for (size_t k = 0; k < sizeof lens / sizeof *lens; k++)
        for (size_t a = 0; a < 4; a++) {
            size_t len = lens[k], so = 7 * a, doff = 3 * a;
            memset(dst, 0xee, max + 128);
            uint64_t sum = 0;
            if (way < 0) {
                sum = kvt__copy_xxh3(dst + doff, src + so, len);
            } else if (kvt__copy_xxh3_by(way, dst + doff, src + so, len, &sum) < 0) {
                if (way != KVT_COPY_XXH3_PLAIN && len > 240) {
                    free(src);
                    free(dst);
                    return 0; /* this CPU lacks the unit */
                }
                continue; /* the vector ways take only XXH3's long inputs */
            }
            cr_assert_eq(sum, XXH3_64bits(src + so, len), "way %d, %zu bytes, offsets %zu/%zu", way,
                         len, so, doff);
            cr_assert_eq(memcmp(dst + doff, src + so, len), 0, "way %d copied %zu bytes wrong", way,
                         len);
            for (size_t i = 0; i < doff; i++)
                cr_assert_eq(dst[i], 0xee, "way %d wrote before the copy", way);
            for (size_t i = doff + len; i < doff + len + 64; i++)
                cr_assert_eq(dst[i], 0xee, "way %d wrote past the copy (%zu bytes)", way, len);
        }
    free(src);
    free(dst);
    return 1;
}

Test(client_seal, plain_way_is_xxh3)
{
    cr_assert(check_way(KVT_COPY_XXH3_PLAIN));
}

Test(client_seal, avx2_way_is_xxh3)
{
    if (!check_way(KVT_COPY_XXH3_AVX2))
        cr_skip_test("this CPU has no AVX2");
}

Test(client_seal, avx512_way_is_xxh3)
{
    if (!check_way(KVT_COPY_XXH3_AVX512))
        cr_skip_test("this CPU has no AVX-512");
}

Test(client_seal, the_picked_way_is_xxh3)
{
    cr_assert(check_way(-1));
}

/* A page gathered from spans through way: span lengths cut at, around and between XXH3's
 * stripes and blocks, and page lengths around its short-input limit; returns 0 when the CPU
 * lacks the way. */
static int check_spans_way(int way)
{
    static const size_t cuts[][5] = {
        {64, 64, 64, 64, 64}, {1024, 1024, 1024, 0, 64}, {100, 28, 1000, 3, 2048},
        {1, 2, 3, 4, 300},    {4096, 63, 65, 1024, 1},   {241, 0, 0, 0, 0},
        {240, 1, 0, 0, 0},    {960, 64, 1, 0, 0},        {32768, 32768, 32768, 32768, 64},
        {0, 0, 0, 0, 0},      {17, 0, 0, 0, 0},          {1088, 1088, 1087, 1, 64},
    };
    uint8_t *src = malloc(1 << 18), *dst = malloc(1 << 18);
    cr_assert(src && dst);
    for (size_t i = 0; i < 1u << 18; i++)
        src[i] = (uint8_t)((i * 2654435761u) >> 13);
    for (size_t c = 0; c < sizeof cuts / sizeof *cuts; c++) {
        kvt_copy_span_t sp[5];
        size_t len = 0;
        for (size_t k = 0; k < 5; k++) {
            sp[k] = (kvt_copy_span_t){NULL, src + 1000 * (4 - k) + 7 * k, cuts[c][k]};
            len += cuts[c][k];
        }
        memset(dst, 0xee, 1 << 18);
        uint64_t sum = 0;
        if (way < 0) {
            sum = kvt__copy_spans_xxh3(sp, 5, dst, len);
        } else if (kvt__copy_spans_xxh3_by(way, sp, 5, dst, len, &sum) < 0) {
            if (way != KVT_COPY_XXH3_PLAIN && len > 240) {
                free(src);
                free(dst);
                return 0;
            }
            continue;
        }
        cr_assert_eq(sum, XXH3_64bits(dst, len), "way %d, cut %zu", way, c);
        for (size_t k = 0, off = 0; k < 5; off += cuts[c][k], k++)
            cr_assert_eq(memcmp(dst + off, sp[k].src, cuts[c][k]), 0, "way %d, cut %zu, span %zu",
                         way, c, k);
        for (size_t i = len; i < len + 64; i++)
            cr_assert_eq(dst[i], 0xee, "way %d wrote past the page (cut %zu)", way, c);
    }
    free(src);
    free(dst);
    return 1;
}

Test(client_seal, spans_plain_way_is_xxh3)
{
    cr_assert(check_spans_way(KVT_COPY_XXH3_PLAIN));
}

Test(client_seal, spans_avx2_way_is_xxh3)
{
    if (!check_spans_way(KVT_COPY_XXH3_AVX2))
        cr_skip_test("this CPU has no AVX2");
}

Test(client_seal, spans_avx512_way_is_xxh3)
{
    if (!check_spans_way(KVT_COPY_XXH3_AVX512))
        cr_skip_test("this CPU has no AVX-512");
}

Test(client_seal, spans_picked_way_is_xxh3)
{
    cr_assert(check_spans_way(-1));
}
