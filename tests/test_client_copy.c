/*
 * test_client_copy.c: kvt_copy_spans (client/copy.c), libkvtier's list of memcpys for the
 * Python connectors' per-layer copies, through the exported function: spans scattered over a
 * buffer land byte for byte where they say and nowhere else, zero-length spans are skipped
 * whatever their pointers, spans that touch without overlapping are copied, and bad lists
 * (NULL spans, a NULL pointer, a span overlapping itself, one wrapping the address space) are
 * refused with KVT_CLIENT_EINVAL before any byte moves. kvt_copy_pages_xxh3, the same copies
 * page by page with each page's XXH3-64 taken in the copy (the sums a vLLM save sends with
 * COMMIT), against kvt_copy_spans and libxxhash's XXH3_64bits over random layouts.
 */
#include <criterion/criterion.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

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

/*
 * kvt_copy_pages_xxh3: pages gathered from spans, each hashed in the copy. A reference model:
 * the same spans through kvt_copy_spans, then libxxhash's XXH3_64bits over each page.
 */

/* A small deterministic generator (xorshift64*), so that a failure names its seed. */
static uint64_t next(uint64_t *s)
{
    *s ^= *s >> 12;
    *s ^= *s << 25;
    *s ^= *s >> 27;
    return *s * 2685821657736338717ull;
}

/* One random layout: npages pages of per_page spans each, span lengths multiples of 64 (the
 * fused path) or, when odd, any (the copy-then-hash path for the stripes they cut), the sources
 * scattered over src, the pages at random offsets in dst. Checks the bytes and the sums. */
static void check_layout(uint64_t seed, int odd)
{
    uint64_t s = seed;
    size_t npages = 1 + next(&s) % 6, per_page = 1 + next(&s) % 9;
    size_t n = npages * per_page, srcsz = 1u << 20, total = 0;
    kvt_copy_span_t *sp = calloc(n, sizeof *sp), *ref = calloc(n, sizeof *ref);
    size_t *lens = calloc(n, sizeof *lens), *pagelen = calloc(npages, sizeof *pagelen);
    cr_assert(sp && ref && lens && pagelen);
    for (size_t i = 0; i < n; i++) {
        uint64_t r = next(&s);
        lens[i] = odd ? r % 3000 : 64 * (r % 48); /* 0 included: skipped spans */
        if (r % 17 == 0)
            lens[i] = 0;
        pagelen[i / per_page] += lens[i];
        total += lens[i];
    }
    uint8_t *src = malloc(srcsz), *dst = malloc(total + 64 * npages + 4096),
            *want = malloc(total + 64 * npages + 4096);
    cr_assert(src && dst && want);
    for (size_t i = 0; i < srcsz; i++)
        src[i] = (uint8_t)next(&s);
    memset(dst, 0xee, total + 64 * npages + 4096);
    memset(want, 0xee, total + 64 * npages + 4096);
    /* Pages one after another with a random gap (alignment) between them. */
    size_t at = next(&s) % 64;
    size_t *pageat = calloc(npages, sizeof *pageat);
    cr_assert(pageat);
    for (size_t p = 0; p < npages; p++) {
        pageat[p] = at;
        size_t off = at;
        for (size_t k = 0; k < per_page; k++) {
            size_t i = p * per_page + k;
            const uint8_t *from = src + next(&s) % (srcsz - lens[i]);
            sp[i] = (kvt_copy_span_t){dst + off, from, lens[i]};
            ref[i] = (kvt_copy_span_t){want + off, from, lens[i]};
            off += lens[i];
        }
        at = off + next(&s) % 64;
    }
    uint64_t *sums = calloc(npages, sizeof *sums);
    cr_assert(sums);
    cr_assert_eq(kvt_copy_pages_xxh3(sp, n, per_page, sums), 0, "seed %llu",
                 (unsigned long long)seed);
    cr_assert_eq(kvt_copy_spans(ref, n), 0);
    cr_assert_eq(memcmp(dst, want, total + 64 * npages + 4096), 0,
                 "seed %llu: bytes other than kvt_copy_spans'", (unsigned long long)seed);
    for (size_t p = 0; p < npages; p++)
        cr_assert_eq(sums[p], XXH3_64bits(want + pageat[p], pagelen[p]),
                     "seed %llu: page %zu of %zu (%zu bytes, %zu spans) hashed wrong",
                     (unsigned long long)seed, p, npages, pagelen[p], per_page);
    free(sp);
    free(ref);
    free(lens);
    free(pagelen);
    free(pageat);
    free(sums);
    free(src);
    free(dst);
    free(want);
}

Test(client_copy, pages_of_whole_stripes_hash_as_xxh3_over_random_layouts)
{
    for (uint64_t seed = 1; seed <= 300; seed++)
        check_layout(seed * 0x9e3779b97f4a7c15ull, 0);
}

Test(client_copy, pages_of_odd_spans_hash_as_xxh3_over_random_layouts)
{
    for (uint64_t seed = 1; seed <= 300; seed++)
        check_layout(seed * 0x9e3779b97f4a7c15ull + 1, 1);
}

Test(client_copy, a_vllm_page_of_layers_hashes_as_xxh3)
{
    /* bench_vllm's shape: 32 layers of K and V rows of 32 KiB, 4 pages; spans page by page. */
    size_t layers = 32, rows = 2, row = 32768, per_page = layers * rows, npages = 4;
    size_t page = per_page * row;
    uint8_t *src = malloc(page * npages), *dst = malloc(page * npages);
    kvt_copy_span_t *sp = calloc(per_page * npages, sizeof *sp);
    cr_assert(src && dst && sp);
    for (size_t i = 0; i < page * npages; i++)
        src[i] = (uint8_t)(i * 2654435761u >> 11);
    /* vLLM's side: layer l's row r of block b lies far from the page's order. */
    for (size_t p = 0; p < npages; p++)
        for (size_t k = 0; k < per_page; k++)
            sp[p * per_page + k] = (kvt_copy_span_t){
                dst + p * page + k * row, src + ((k * 7 + p * 3) % (per_page * npages)) * row, row};
    uint64_t sums[4];
    cr_assert_eq(kvt_copy_pages_xxh3(sp, per_page * npages, per_page, sums), 0);
    for (size_t p = 0; p < npages; p++) {
        cr_assert_eq(sums[p], XXH3_64bits(dst + p * page, page), "page %zu", p);
        for (size_t k = 0; k < per_page; k++)
            cr_assert_eq(memcmp(dst + p * page + k * row, sp[p * per_page + k].src, row), 0);
    }
    free(src);
    free(dst);
    free(sp);
}

Test(client_copy, bad_page_lists_are_refused_and_copy_nothing)
{
    uint8_t *src = filled(8), *dst = filled(9), *want = malloc(SZ);
    cr_assert(want);
    memcpy(want, dst, SZ);
    uint64_t sums[4] = {0};
    kvt_copy_span_t ok[4] = {{dst, src, 512},
                             {dst + 512, src + 4096, 512},
                             {dst + 2048, src, 64},
                             {dst + 2112, src, 64}};
    cr_assert_eq(kvt_copy_pages_xxh3(NULL, 0, 0, NULL), 0, "an empty list is nothing to do");
    cr_assert_eq(kvt_copy_pages_xxh3(NULL, 2, 2, sums), KVT_CLIENT_EINVAL, "NULL spans");
    cr_assert_eq(kvt_copy_pages_xxh3(ok, 4, 2, NULL), KVT_CLIENT_EINVAL, "NULL sums");
    cr_assert_eq(kvt_copy_pages_xxh3(ok, 4, 0, sums), KVT_CLIENT_EINVAL, "per_page 0");
    cr_assert_eq(kvt_copy_pages_xxh3(ok, 4, 3, sums), KVT_CLIENT_EINVAL, "4 spans, pages of 3");
    kvt_copy_span_t gap[4] = {
        {dst, src, 512}, {dst + 512, src, 512}, {dst + 2048, src, 64}, {dst + 2113, src, 64}};
    cr_assert_eq(kvt_copy_pages_xxh3(gap, 4, 2, sums), KVT_CLIENT_EINVAL,
                 "a page whose spans are not back to back");
    kvt_copy_span_t bad[4] = {{dst, src, 512},
                              {dst + 512, src, 512},
                              {dst + 2048, dst + 2050, 64},
                              {dst + 2112, src, 64}};
    cr_assert_eq(kvt_copy_pages_xxh3(bad, 4, 2, sums), KVT_CLIENT_EINVAL, "a span overlapping");
    cr_assert_eq(memcmp(dst, want, SZ), 0, "a refused list copied something");
    for (int i = 0; i < 4; i++)
        cr_assert_eq(sums[i], 0, "a refused list wrote a sum");
    cr_assert_eq(kvt_copy_pages_xxh3(ok, 4, 2, sums), 0);
    cr_assert_eq(sums[0], XXH3_64bits(dst, 1024));
    cr_assert_eq(sums[1], XXH3_64bits(dst + 2048, 128));
    free(src);
    free(dst);
    free(want);
}

Test(client_copy, more_pages_than_a_group_hash_each_as_xxh3)
{
    /* 37 pages: groups of pages whose spans are interleaved (KVT_SEAL_GROUP at a time, the last
     * group short), layer-major sources as vLLM's tensors lie (span k of page p at block p of
     * layer k), one page of odd spans in the middle so its stripes are hashed after the copy. */
    size_t per_page = 6, row = 1024, npages = 37, page = per_page * row;
    /* dst 64-byte aligned: pages 0-20 take the streaming stores, the others (9 bytes on) not */
    uint8_t *src = malloc(page * npages), *dst = aligned_alloc(64, page * npages + 64);
    kvt_copy_span_t *sp = calloc(per_page * npages, sizeof *sp);
    uint64_t *sums = calloc(npages, sizeof *sums);
    cr_assert(src && dst && sp && sums);
    for (size_t i = 0; i < page * npages; i++)
        src[i] = (uint8_t)(i * 2654435761u >> 13);
    for (size_t p = 0; p < npages; p++)
        for (size_t k = 0; k < per_page; k++) {
            size_t len = p == 20 ? row - 3 + k : row; /* 1021 to 1026 bytes: stripes cut */
            size_t off = p * page + (p > 20 ? 9 : 0) +
                         (p == 20 ? k * row - 3 * k + k * (k - 1) / 2 : k * row);
            sp[p * per_page + k] =
                (kvt_copy_span_t){dst + off, src + (k * npages + p) * row + (p == 20), len};
        }
    cr_assert_eq(kvt_copy_pages_xxh3(sp, per_page * npages, per_page, sums), 0);
    for (size_t p = 0; p < npages; p++) {
        size_t len = 0;
        for (size_t k = 0; k < per_page; k++) {
            const kvt_copy_span_t *s = &sp[p * per_page + k];
            cr_assert_eq(memcmp(s->dst, s->src, s->len), 0, "page %zu span %zu", p, k);
            len += s->len;
        }
        cr_assert_eq(sums[p], XXH3_64bits(sp[p * per_page].dst, len), "page %zu", p);
    }
    free(src);
    free(dst);
    free(sp);
    free(sums);
}
