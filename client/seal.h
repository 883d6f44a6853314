/*
 * seal.h: libkvtier's copy of a page into the zero-copy mapping that also takes its checksum
 * (internal to client/).
 */
#ifndef KVT_CLIENT_SEAL_H
#define KVT_CLIENT_SEAL_H

#include <stddef.h>
#include <stdint.h>

#include "kvtier.h"

/* Copies len bytes from src to dst (not overlapping) and returns XXH3-64 (seed 0) of them, the
 * value XXH3_64bits(dst, len) gives: what the daemon checks a zero-copy page against. */
uint64_t kvt__copy_xxh3(void *dst, const void *src, size_t len);

/* The same through one way for tests: KVT_COPY_XXH3_PLAIN (memcpy, then XXH3_64bits), _AVX2 or
 * _AVX512 (pages over 240 bytes only). Returns 0 with *sum, or -1 where the CPU lacks that unit
 * (or len is 240 or less for the vector ways). */
enum { KVT_COPY_XXH3_PLAIN, KVT_COPY_XXH3_AVX2, KVT_COPY_XXH3_AVX512 };
int kvt__copy_xxh3_by(int way, void *dst, const void *src, size_t len, uint64_t *sum);

/* One page gathered from spans[0, n) (their src, their len; nothing else of them is read) into
 * dst, back to back, len bytes in all (the sum of the spans' lens), and its XXH3-64 (seed 0), the
 * value XXH3_64bits(dst, len) gives: hashed as it is copied wherever a span begins on one of the
 * page's 64-byte stripes (kvt_copy_pages_xxh3). _by as kvt__copy_xxh3_by. */
uint64_t kvt__copy_spans_xxh3(const kvt_copy_span_t *spans, size_t n, void *dst, size_t len);
int kvt__copy_spans_xxh3_by(int way, const kvt_copy_span_t *spans, size_t n, void *dst, size_t len,
                            uint64_t *sum);

/* npages pages (spans[p * per_page, (p + 1) * per_page) into dsts[p], lens[p] bytes each), copied
 * and hashed as kvt__copy_spans_xxh3 does each into sums[p], but KVT_SEAL_GROUP pages at a time,
 * span j of each of them before span j + 1 (the source read in its own order). */
#ifndef KVT_SEAL_GROUP
#define KVT_SEAL_GROUP 16
#endif
void kvt__copy_pages_xxh3(const kvt_copy_span_t *spans, size_t per_page, size_t npages,
                          uint8_t *const *dsts, const size_t *lens, uint64_t *sums);

#endif
