/*
 * seal.c: a page copied into the zero-copy mapping and hashed in the same pass, for the checksum
 * libkvtier sends with COMMIT (zero-copy-checksum, docs/server.md). The copy from the caller's
 * buffer runs at memory speed, its loads waiting on DRAM; XXH3's arithmetic on each 64-byte
 * stripe, done on the register the stripe was just loaded into, fits in those waits, so the
 * checksum costs next to nothing (docs/benchmarks.md: the same CPU time as memcpy, where a
 * memcpy followed by a hash of each 16 KiB chunk still costs 17 % more, and the daemon's own
 * pass after COMMIT's reply a third of the PUT).
 *
 * The loop is XXH3's long-input loop (xxhash.h's XXH3_hashLong_internal_loop with the default
 * secret) with a store of each stripe added, built from xxhash.h's own accumulate and scramble
 * steps for AVX-512 and AVX2, so the value is XXH3_64bits' to the bit (tests compare them). The
 * widest unit the CPU has is picked once at run time; without either, and for pages of 240 bytes
 * or less (XXH3's short-input paths), a plain memcpy and then XXH3_64bits. A page gathered from
 * spans (the vLLM save: 64 rows of 32 layer tensors) carries the loop's state from span to span,
 * several pages' spans interleaved so that the tensors are read in runs, with streaming stores
 * on AVX-512 (docs/benchmarks.md, "The vLLM save's checksums").
 */
#include "seal.h"

#include <string.h>

/* xxhash.h inline in this file: its steps and constants are not exported by the library. On
 * x86-64 its AVX-512 and AVX2 steps are compiled for those units, as libxxhash's own
 * xxh_x86dispatch.c does. */
#define XXH_INLINE_ALL
#if defined(__x86_64__)
#include <immintrin.h>
#define XXH_X86DISPATCH
#define XXH_DISPATCH_AVX512 1
#define XXH_DISPATCH_AVX2   1
#define XXH_TARGET_AVX512   __attribute__((__target__("avx512f")))
#define XXH_TARGET_AVX2     __attribute__((__target__("avx2")))
#endif
#include <xxhash.h>

/* One page's hash as its spans go by (the loop below), a page's steps in order. */
typedef struct {
    XXH_ALIGN(64) xxh_u64 acc[XXH_ACC_NB];
    size_t stripe, off; /* stripes hashed, bytes copied */
} kvt_seal_state;

typedef void (*step_fn)(kvt_seal_state *, const uint8_t *, size_t, uint8_t *, size_t);
typedef uint64_t (*end_fn)(kvt_seal_state *, uint8_t *, size_t);

static void state_init(kvt_seal_state *st)
{
    static const xxh_u64 init[XXH_ACC_NB] = XXH3_INIT_ACC;
    memcpy(st->acc, init, sizeof(init));
    st->stripe = st->off = 0;
}

#if defined(__x86_64__)
/* The long-input loop with a copy: acc512/scramble are one unit's steps, COPY64 moves one
 * 64-byte stripe with that unit's registers, each stripe hashed from where it was just stored
 * (what the daemon holds, even if the source changes meanwhile; the load hits L1). */
#define KVT_COPY_XXH3(name, target, acc512, scramble, COPY64)                                      \
    target static uint64_t name(uint8_t *dst, const uint8_t *src, size_t len)                      \
    {                                                                                              \
        XXH_ALIGN(64) xxh_u64 acc[XXH_ACC_NB] = XXH3_INIT_ACC;                                     \
        const xxh_u8 *secret = XXH3_kSecret;                                                       \
        size_t const ssize = sizeof(XXH3_kSecret);                                                 \
        size_t const per_block = (ssize - XXH_STRIPE_LEN) / XXH_SECRET_CONSUME_RATE;               \
        size_t const block_len = XXH_STRIPE_LEN * per_block;                                       \
        size_t const nb_blocks = (len - 1) / block_len;                                            \
        size_t off = 0;                                                                            \
        for (size_t n = 0; n < nb_blocks; n++) {                                                   \
            for (size_t s = 0; s < per_block; s++, off += XXH_STRIPE_LEN) {                        \
                COPY64(dst + off, src + off);                                                      \
                acc512(acc, dst + off, secret + s * XXH_SECRET_CONSUME_RATE);                      \
            }                                                                                      \
            scramble(acc, secret + ssize - XXH_STRIPE_LEN);                                        \
        }                                                                                          \
        size_t const nb_stripes = ((len - 1) - block_len * nb_blocks) / XXH_STRIPE_LEN;            \
        for (size_t s = 0; s < nb_stripes; s++, off += XXH_STRIPE_LEN) {                           \
            COPY64(dst + off, src + off);                                                          \
            acc512(acc, dst + off, secret + s * XXH_SECRET_CONSUME_RATE);                          \
        }                                                                                          \
        memcpy(dst + off, src + off, len - off);                                                   \
        acc512(acc, dst + len - XXH_STRIPE_LEN,                                                    \
               secret + ssize - XXH_STRIPE_LEN - XXH_SECRET_LASTACC_START);                        \
        return XXH3_mergeAccs(acc, secret + XXH_SECRET_MERGEACCS_START,                            \
                              (xxh_u64)len * XXH_PRIME64_1);                                       \
    }

#define COPY64_AVX512(d, s) _mm512_storeu_si512((d), _mm512_loadu_si512((s)))
#define COPY64_AVX2(d, s)                                                                          \
    do {                                                                                           \
        __m256i lo_ = _mm256_loadu_si256((const __m256i *)(s));                                    \
        __m256i hi_ = _mm256_loadu_si256((const __m256i *)((s) + 32));                             \
        _mm256_storeu_si256((__m256i *)(d), lo_);                                                  \
        _mm256_storeu_si256((__m256i *)((d) + 32), hi_);                                           \
    } while (0)

KVT_COPY_XXH3(copy_xxh3_avx512, XXH_TARGET_AVX512, XXH3_accumulate_512_avx512,
              XXH3_scrambleAcc_avx512, COPY64_AVX512)
KVT_COPY_XXH3(copy_xxh3_avx2, XXH_TARGET_AVX2, XXH3_accumulate_512_avx2, XXH3_scrambleAcc_avx2,
              COPY64_AVX2)

/* The same loop over a page gathered from several spans (its dsts back to back), the
 * accumulators carried from one span to the next in a kvt_seal_state: the stripe counter, not the
 * span, says where in its 1 KiB block a stripe falls (which secret bytes, when to scramble). A
 * span that begins on a stripe boundary of the page is copied and hashed stripe by stripe; the
 * stripes a span leaves whole only after a plain copy (one that began or ended mid-stripe) are
 * hashed from dst once written, so any layout gives XXH3_64bits' value and the usual one (whole
 * stripes) is fused. A page's spans must go through step in order, but the steps of several
 * pages may be interleaved (kvt__copy_pages_xxh3). */

#define KVT_COPY_XXH3_STEP(name, target, acc512, scramble, COPYH, FENCE)                           \
    target static void name(kvt_seal_state *st, const uint8_t *src, size_t l, uint8_t *dst,        \
                            size_t len)                                                            \
    {                                                                                              \
        /* in a local: dst's stores cannot alias it, it stays in registers */                      \
        XXH_ALIGN(64) xxh_u64 acc[XXH_ACC_NB];                                                     \
        XXH_ALIGN(64) uint8_t h_[XXH_STRIPE_LEN];                                                  \
        memcpy(acc, st->acc, sizeof(acc));                                                         \
        const xxh_u8 *secret = XXH3_kSecret;                                                       \
        size_t const ssize = sizeof(XXH3_kSecret);                                                 \
        size_t const per_block = (ssize - XXH_STRIPE_LEN) / XXH_SECRET_CONSUME_RATE;               \
        size_t const nstripes = (len - 1) / XXH_STRIPE_LEN; /* the loop's; then the last */        \
        size_t stripe = st->stripe, off = st->off, k = 0;                                          \
        if (off % XXH_STRIPE_LEN == 0)                                                             \
            for (; k + XXH_STRIPE_LEN <= l && stripe < nstripes; k += XXH_STRIPE_LEN) {            \
                acc512(acc, COPYH(dst + off + k, src + k, h_),                                     \
                       secret + (stripe % per_block) * XXH_SECRET_CONSUME_RATE);                   \
                if (++stripe % per_block == 0)                                                     \
                    scramble(acc, secret + ssize - XXH_STRIPE_LEN);                                \
            }                                                                                      \
        if (l > k)                                                                                 \
            memcpy(dst + off + k, src + k, l - k);                                                 \
        off += l;                                                                                  \
        for (; stripe < nstripes && (stripe + 1) * XXH_STRIPE_LEN <= off;) {                       \
            acc512(acc, dst + stripe * XXH_STRIPE_LEN,                                             \
                   secret + (stripe % per_block) * XXH_SECRET_CONSUME_RATE);                       \
            if (++stripe % per_block == 0)                                                         \
                scramble(acc, secret + ssize - XXH_STRIPE_LEN);                                    \
        }                                                                                          \
        FENCE();                                                                                   \
        memcpy(st->acc, acc, sizeof(acc));                                                         \
        st->stripe = stripe;                                                                       \
        st->off = off;                                                                             \
    }

/* The page's last stripe and the merge, once all its spans went through step. */
#define KVT_COPY_XXH3_END(name, target, acc512)                                                    \
    target static uint64_t name(kvt_seal_state *st, uint8_t *dst, size_t len)                      \
    {                                                                                              \
        const xxh_u8 *secret = XXH3_kSecret;                                                       \
        size_t const ssize = sizeof(XXH3_kSecret);                                                 \
        acc512(st->acc, dst + len - XXH_STRIPE_LEN,                                                \
               secret + ssize - XXH_STRIPE_LEN - XXH_SECRET_LASTACC_START);                        \
        return XXH3_mergeAccs(st->acc, secret + XXH_SECRET_MERGEACCS_START,                        \
                              (xxh_u64)len * XXH_PRIME64_1);                                       \
    }

/* COPYH copies a stripe and says where to hash it from: dst, just stored (an L1 hit), or for
 * the streaming stores (which leave dst out of the cache) a copy of the register stored, so
 * the sum is of the bytes stored either way. Streaming stores skip the read of each dst line
 * before it is written: with the source jumping between layer tensors, the fused loop ran at
 * 0.8 of the contiguous one with them left out, 0.9-1.0 with them (bench_copy_spans --seal). */
#define COPYH_AVX512(d, s, h) ((void)(h), COPY64_AVX512((d), (s)), (const uint8_t *)(d))
#define COPYH_AVX512_NT(d, s, h)                                                                   \
    __extension__({                                                                                \
        __m512i v_ = _mm512_loadu_si512((s));                                                      \
        _mm512_stream_si512((void *)(d), v_);                                                      \
        _mm512_store_si512((void *)(h), v_);                                                       \
        (const uint8_t *)(h);                                                                      \
    })
#define COPYH_AVX2(d, s, h)                                                                        \
    __extension__({                                                                                \
        (void)(h);                                                                                 \
        COPY64_AVX2((d), (s));                                                                     \
        (const uint8_t *)(d);                                                                      \
    })
#define NO_FENCE() ((void)0)
#define SFENCE()   _mm_sfence() /* streaming stores ordered before what follows */

KVT_COPY_XXH3_STEP(step_avx512, XXH_TARGET_AVX512, XXH3_accumulate_512_avx512,
                   XXH3_scrambleAcc_avx512, COPYH_AVX512, NO_FENCE)
KVT_COPY_XXH3_STEP(step_avx512_nt, XXH_TARGET_AVX512, XXH3_accumulate_512_avx512,
                   XXH3_scrambleAcc_avx512, COPYH_AVX512_NT, SFENCE)
KVT_COPY_XXH3_STEP(step_avx2, XXH_TARGET_AVX2, XXH3_accumulate_512_avx2, XXH3_scrambleAcc_avx2,
                   COPYH_AVX2, NO_FENCE)
KVT_COPY_XXH3_END(end_avx512, XXH_TARGET_AVX512, XXH3_accumulate_512_avx512)
KVT_COPY_XXH3_END(end_avx2, XXH_TARGET_AVX2, XXH3_accumulate_512_avx2)

static uint64_t spans_by(step_fn step, end_fn end, const kvt_copy_span_t *sp, size_t n,
                         uint8_t *dst, size_t len)
{
    kvt_seal_state st;
    state_init(&st);
    for (size_t i = 0; i < n; i++)
        step(&st, sp[i].src, sp[i].len, dst, len);
    return end(&st, dst, len);
}

/* The streaming stores need dst's stripes 64-byte aligned: the page's start. */
static step_fn step_avx512_for(const uint8_t *dst)
{
    return (uintptr_t)dst % XXH_STRIPE_LEN == 0 ? step_avx512_nt : step_avx512;
}

static uint64_t spans_xxh3_avx512(const kvt_copy_span_t *sp, size_t n, uint8_t *dst, size_t len)
{
    return spans_by(step_avx512_for(dst), end_avx512, sp, n, dst, len);
}

static uint64_t spans_xxh3_avx2(const kvt_copy_span_t *sp, size_t n, uint8_t *dst, size_t len)
{
    return spans_by(step_avx2, end_avx2, sp, n, dst, len);
}
#endif

static uint64_t spans_then_xxh3(const kvt_copy_span_t *sp, size_t n, uint8_t *dst, size_t len)
{
    for (size_t i = 0, off = 0; i < n; off += sp[i].len, i++)
        if (sp[i].len)
            memcpy(dst + off, sp[i].src, sp[i].len);
    return XXH3_64bits(dst, len);
}

typedef uint64_t (*spans_xxh3_fn)(const kvt_copy_span_t *, size_t, uint8_t *, size_t);

static spans_xxh3_fn spans_way_fn(int way)
{
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (way == KVT_COPY_XXH3_AVX512)
        return __builtin_cpu_supports("avx512f") ? spans_xxh3_avx512 : NULL;
    if (way == KVT_COPY_XXH3_AVX2)
        return __builtin_cpu_supports("avx2") ? spans_xxh3_avx2 : NULL;
#endif
    return way == KVT_COPY_XXH3_PLAIN ? spans_then_xxh3 : NULL;
}

static uint64_t copy_then_xxh3(uint8_t *dst, const uint8_t *src, size_t len)
{
    memcpy(dst, src, len);
    return XXH3_64bits(dst, len);
}

typedef uint64_t (*copy_xxh3_fn)(uint8_t *, const uint8_t *, size_t);

/* The way for this CPU, or NULL when it lacks the unit. */
static copy_xxh3_fn way_fn(int way)
{
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (way == KVT_COPY_XXH3_AVX512)
        return __builtin_cpu_supports("avx512f") ? copy_xxh3_avx512 : NULL;
    if (way == KVT_COPY_XXH3_AVX2)
        return __builtin_cpu_supports("avx2") ? copy_xxh3_avx2 : NULL;
#endif
    return way == KVT_COPY_XXH3_PLAIN ? copy_then_xxh3 : NULL;
}

/* Picked once; two threads' first calls may both pick, and store the same value. */
static copy_xxh3_fn pick(void)
{
    copy_xxh3_fn fn = way_fn(KVT_COPY_XXH3_AVX512);
    if (!fn)
        fn = way_fn(KVT_COPY_XXH3_AVX2);
    return fn ? fn : copy_then_xxh3;
}

int kvt__copy_xxh3_by(int way, void *dst, const void *src, size_t len, uint64_t *sum)
{
    copy_xxh3_fn fn = way_fn(way);
    if (!fn || (way != KVT_COPY_XXH3_PLAIN && len <= XXH3_MIDSIZE_MAX))
        return -1;
    *sum = fn(dst, src, len);
    return 0;
}

uint64_t kvt__copy_xxh3(void *dst, const void *src, size_t len)
{
    static copy_xxh3_fn picked;
    if (len <= XXH3_MIDSIZE_MAX)
        return copy_then_xxh3(dst, src, len);
    copy_xxh3_fn fn = __atomic_load_n(&picked, __ATOMIC_RELAXED);
    if (!fn) {
        fn = pick();
        __atomic_store_n(&picked, fn, __ATOMIC_RELAXED);
    }
    return fn(dst, src, len);
}

int kvt__copy_spans_xxh3_by(int way, const kvt_copy_span_t *spans, size_t n, void *dst, size_t len,
                            uint64_t *sum)
{
    spans_xxh3_fn fn = spans_way_fn(way);
    if (!fn || (way != KVT_COPY_XXH3_PLAIN && len <= XXH3_MIDSIZE_MAX))
        return -1;
    *sum = fn(spans, n, dst, len);
    return 0;
}

uint64_t kvt__copy_spans_xxh3(const kvt_copy_span_t *spans, size_t n, void *dst, size_t len)
{
    static spans_xxh3_fn picked;
    if (len <= XXH3_MIDSIZE_MAX)
        return spans_then_xxh3(spans, n, dst, len);
    spans_xxh3_fn fn = __atomic_load_n(&picked, __ATOMIC_RELAXED);
    if (!fn) {
        fn = spans_way_fn(KVT_COPY_XXH3_AVX512);
        if (!fn)
            fn = spans_way_fn(KVT_COPY_XXH3_AVX2);
        if (!fn)
            fn = spans_then_xxh3;
        __atomic_store_n(&picked, fn, __ATOMIC_RELAXED);
    }
    return fn(spans, n, dst, len);
}

/* Interleaving several pages' spans (span j of each page, then span j + 1) reads the engine's
 * tensors as they lie: span j of consecutive pages is one layer's consecutive blocks, so the
 * source runs on for a group's pages instead of jumping to another layer's tensor every span
 * (bench/bench_copy_spans.py --seal). */
void kvt__copy_pages_xxh3(const kvt_copy_span_t *spans, size_t per_page, size_t npages,
                          uint8_t *const *dsts, const size_t *lens, uint64_t *sums)
{
    step_fn step = NULL;
    end_fn end = NULL;
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f"))
        step = step_avx512, end = end_avx512;
    else if (__builtin_cpu_supports("avx2"))
        step = step_avx2, end = end_avx2;
#endif
    for (size_t p = 0; p < npages; p++)
        if (lens[p] <= XXH3_MIDSIZE_MAX) /* XXH3's short-input paths */
            step = NULL;
    if (!step || !end) {
        for (size_t p = 0; p < npages; p++)
            sums[p] = kvt__copy_spans_xxh3(spans + p * per_page, per_page, dsts[p], lens[p]);
        return;
    }
    kvt_seal_state st[KVT_SEAL_GROUP];
    step_fn steps[KVT_SEAL_GROUP];
    for (size_t g = 0; g < npages; g += KVT_SEAL_GROUP) {
        size_t const m = npages - g < KVT_SEAL_GROUP ? npages - g : KVT_SEAL_GROUP;
        for (size_t p = 0; p < m; p++) {
            state_init(&st[p]);
            steps[p] = step;
#if defined(__x86_64__)
            if (step == step_avx512)
                steps[p] = step_avx512_for(dsts[g + p]);
#endif
        }
        for (size_t j = 0; j < per_page; j++)
            for (size_t p = 0; p < m; p++) {
                const kvt_copy_span_t *s = &spans[(g + p) * per_page + j];
                steps[p](&st[p], s->src, s->len, dsts[g + p], lens[g + p]);
            }
        for (size_t p = 0; p < m; p++)
            sums[g + p] = end(&st[p], dsts[g + p], lens[g + p]);
    }
}
