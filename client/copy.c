/*
 * copy.c: kvt_copy_spans, a list of memcpys done in one call. The Python connectors copy a
 * layer of a request's pages between the daemon's mapping and the engine's tensors; where the
 * arena placed the pages in several unevenly spaced runs, each run was a numpy call of its own
 * (bench_vllm: 12 runs of 32 layers, 384 calls a load, each with Python's and numpy's overhead
 * and the GIL handed over). Here the caller describes a layer's copies once, as (dst, src, len)
 * spans, and makes one call per layer; cffi releases the GIL for it, so the engine's other
 * threads run while it copies. It needs no connection and touches nothing but the spans.
 *
 * kvt_copy_pages_xxh3 is the same list ordered page by page, for a save into the daemon's room
 * when the daemon seals committed pages (zero-copy-checksum): each page's spans, its layers in
 * order, are copied and hashed in one pass (seal.c), so that the sums go with COMMIT and the
 * daemon does not read the pages again on its loop thread right after the reply. Pages go a group
 * at a time, span j of each before span j + 1: the engine's tensors are then read in long runs
 * (one layer's consecutive blocks) rather than a jump to another layer's tensor every span.
 */
#include "kvtier.h"
#include "seal.h"

#include <stdint.h>
#include <string.h>

/* Whether [a, a + alen) and [b, b + blen) share a byte (both lengths non-zero). */
static int overlaps(const void *a, size_t alen, const void *b, size_t blen)
{
    uintptr_t x = (uintptr_t)a, y = (uintptr_t)b;
    return x < y + blen && y < x + alen;
}

/* Every span checked before any byte moves: a bad list copies nothing. */
static int check_spans(const kvt_copy_span_t *spans, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        const kvt_copy_span_t *s = &spans[i];
        if (s->len == 0)
            continue;
        if (s->dst == NULL || s->src == NULL)
            return KVT_CLIENT_EINVAL;
        if ((uintptr_t)s->dst > UINTPTR_MAX - s->len || (uintptr_t)s->src > UINTPTR_MAX - s->len)
            return KVT_CLIENT_EINVAL;
        if (overlaps(s->dst, s->len, s->src, s->len)) /* memcpy's undefined case */
            return KVT_CLIENT_EINVAL;
    }
    return 0;
}

int kvt_copy_spans(const kvt_copy_span_t *spans, size_t n)
{
    if (n == 0)
        return 0;
    if (spans == NULL)
        return KVT_CLIENT_EINVAL;
    int rc = check_spans(spans, n);
    if (rc < 0)
        return rc;
    for (size_t i = 0; i < n; i++)
        if (spans[i].len)
            memcpy(spans[i].dst, spans[i].src, spans[i].len);
    return 0;
}

/* Where page [spans, spans + n) begins (its first span with bytes) and its length, or
 * KVT_CLIENT_EINVAL when its spans with bytes do not lie back to back. */
static int page_of(const kvt_copy_span_t *spans, size_t n, uint8_t **dst, size_t *len)
{
    uint8_t *start = NULL, *end = NULL;
    for (size_t i = 0; i < n; i++) {
        if (spans[i].len == 0)
            continue;
        if (start == NULL)
            start = end = spans[i].dst;
        else if ((uint8_t *)spans[i].dst != end)
            return KVT_CLIENT_EINVAL;
        end += spans[i].len;
    }
    *dst = start;
    *len = (size_t)(end - start);
    return 0;
}

int kvt_copy_pages_xxh3(const kvt_copy_span_t *spans, size_t n, size_t per_page, uint64_t *sums)
{
    if (n == 0)
        return 0;
    if (spans == NULL || sums == NULL || per_page == 0 || n % per_page)
        return KVT_CLIENT_EINVAL;
    int rc = check_spans(spans, n);
    for (size_t p = 0; rc == 0 && p < n; p += per_page) {
        uint8_t *dst;
        size_t len;
        rc = page_of(spans + p, per_page, &dst, &len);
    }
    if (rc < 0)
        return rc;
    /* KVT_SEAL_GROUP pages at a time, their spans interleaved (seal.c) */
    uint8_t *dsts[KVT_SEAL_GROUP];
    size_t lens[KVT_SEAL_GROUP];
    size_t const npages = n / per_page;
    for (size_t g = 0; g < npages; g += KVT_SEAL_GROUP) {
        size_t const m = npages - g < KVT_SEAL_GROUP ? npages - g : KVT_SEAL_GROUP;
        for (size_t p = 0; p < m; p++) {
            dsts[p] = NULL;
            lens[p] = 0;
            (void)page_of(spans + (g + p) * per_page, per_page, &dsts[p], &lens[p]); /* checked */
        }
        kvt__copy_pages_xxh3(spans + g * per_page, per_page, m, dsts, lens, sums + g);
    }
    return 0;
}
