/*
 * test_client_copy.c: kvt_copy_spans (client/copy.c), libkvtier's list of memcpys for the
 * Python connectors' per-layer copies, through the exported function: spans scattered over a
 * buffer land byte for byte where they say and nowhere else, zero-length spans are skipped
 * whatever their pointers, spans that touch without overlapping are copied, and bad lists
 * (NULL spans, a NULL pointer, a span overlapping itself, one wrapping the address space) are
 * refused with KVT_CLIENT_EINVAL before any byte moves.
 */
#include <criterion/criterion.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvtier.h"

#define SZ 65536

static uint8_t *filled(uint8_t seed)
{
    uint8_t *p = malloc(SZ);
    cr_assert(p);
    for (size_t i = 0; i < SZ; i++)
        p[i] = (uint8_t)(seed + i * 131u + (i >> 9));
    return p;
}

Test(client_copy, spans_land_where_they_say_and_nowhere_else)
{
    uint8_t *src = filled(7), *dst = filled(99), *want = malloc(SZ);
    cr_assert(want);
    memcpy(want, dst, SZ);
    /* Uneven offsets and lengths, out of order, one of them odd-sized and misaligned. */
    const size_t so[] = {40000, 0, 1234, 20000, 65535};
    const size_t doff[] = {0, 30000, 60000, 4097, 12345};
    const size_t len[] = {4096, 8192, 5536, 3, 1};
    kvt_copy_span_t s[5];
    for (int i = 0; i < 5; i++) {
        s[i] = (kvt_copy_span_t){dst + doff[i], src + so[i], len[i]};
        memcpy(want + doff[i], src + so[i], len[i]);
    }
    cr_assert_eq(kvt_copy_spans(s, 5), 0);
    cr_assert_eq(memcmp(dst, want, SZ), 0, "every byte as the spans say, the rest untouched");
    free(src);
    free(dst);
    free(want);
}

Test(client_copy, zero_length_spans_and_lists_are_skipped)
{
    uint8_t *src = filled(1), *dst = filled(2), *want = malloc(SZ);
    cr_assert(want);
    memcpy(want, dst, SZ);
    cr_assert_eq(kvt_copy_spans(NULL, 0), 0, "an empty list is nothing to do");
    kvt_copy_span_t s[3] = {
        {NULL, NULL, 0},      /* skipped whatever its pointers */
        {dst, dst, 0},        /* the same place: no bytes, no overlap */
        {dst + 100, src, 50}, /* the one real copy */
    };
    memcpy(want + 100, src, 50);
    cr_assert_eq(kvt_copy_spans(s, 3), 0);
    cr_assert_eq(memcmp(dst, want, SZ), 0);
    free(src);
    free(dst);
    free(want);
}

Test(client_copy, spans_that_touch_without_overlapping_are_copied)
{
    /* Within one buffer: src right before dst, and right after it. */
    uint8_t *b = filled(3), *want = malloc(SZ);
    cr_assert(want);
    memcpy(want, b, SZ);
    kvt_copy_span_t s[2] = {{b + 1000, b + 0, 1000}, {b + 5000, b + 6000, 1000}};
    memcpy(want + 1000, want + 0, 1000);
    memcpy(want + 5000, want + 6000, 1000);
    cr_assert_eq(kvt_copy_spans(s, 2), 0);
    cr_assert_eq(memcmp(b, want, SZ), 0);
    free(b);
    free(want);
}

Test(client_copy, bad_lists_are_refused_and_copy_nothing)
{
    uint8_t *src = filled(5), *dst = filled(6), *want = malloc(SZ);
    cr_assert(want);
    memcpy(want, dst, SZ);
    cr_assert_eq(kvt_copy_spans(NULL, 1), KVT_CLIENT_EINVAL, "NULL spans with n > 0");
    /* Each bad span comes after a good one: the good one must not have been copied either. */
    kvt_copy_span_t bad[][2] = {
        {{dst, src, 64}, {NULL, src, 8}},
        {{dst, src, 64}, {dst + 64, NULL, 8}},
        {{dst, src, 64}, {dst + 10, dst, 64}},                 /* dst inside src's bytes */
        {{dst, src, 64}, {src + 62, src + 63, 2}},             /* src inside dst's bytes */
        {{dst, src, 64}, {dst + 200, dst + 200, 1}},           /* the same byte */
        {{dst, src, 64}, {(void *)(UINTPTR_MAX - 3), src, 8}}, /* wraps */
        {{dst, src, 64}, {dst, (const void *)(UINTPTR_MAX - 3), 8}},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        cr_assert_eq(kvt_copy_spans(bad[i], 2), KVT_CLIENT_EINVAL, "bad list %zu", i);
        cr_assert_eq(memcmp(dst, want, SZ), 0, "bad list %zu copied something", i);
    }
    free(src);
    free(dst);
    free(want);
}
