/*
 * copy.c: kvt_copy_spans, a list of memcpys done in one call. The Python connectors copy a
 * layer of a request's pages between the daemon's mapping and the engine's tensors; where the
 * arena placed the pages in several unevenly spaced runs, each run was a numpy call of its own
 * (bench_vllm: 12 runs of 32 layers, 384 calls a load, each with Python's and numpy's overhead
 * and the GIL handed over). Here the caller describes a layer's copies once, as (dst, src, len)
 * spans, and makes one call per layer; cffi releases the GIL for it, so the engine's other
 * threads run while it copies. It needs no connection and touches nothing but the spans.
 */
#include "kvtier.h"

#include <stdint.h>
#include <string.h>

/* Whether [a, a + alen) and [b, b + blen) share a byte (both lengths non-zero). */
static int overlaps(const void *a, size_t alen, const void *b, size_t blen)
{
    uintptr_t x = (uintptr_t)a, y = (uintptr_t)b;
    return x < y + blen && y < x + alen;
}

int kvt_copy_spans(const kvt_copy_span_t *spans, size_t n)
{
    if (n == 0)
        return 0;
    if (spans == NULL)
        return KVT_CLIENT_EINVAL;
    /* Every span checked before any byte moves: a bad list copies nothing. */
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
    for (size_t i = 0; i < n; i++)
        if (spans[i].len)
            memcpy(spans[i].dst, spans[i].src, spans[i].len);
    return 0;
}
