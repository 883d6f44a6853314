/*
 * test_tier_dram.c: the DRAM tier through the public tier interface: round trips of many sizes,
 * capacity exhaustion, free and reuse, requests in flight together, exact byte accounting
 * against jemalloc's own statistics, bad input, and a randomized run against a reference model
 * (which also exercises tier.c's location index). Then the shared arenas of zero-copy clients,
 * with real memfds: a second mapping of the tier's fd stands for the client's.
 */
#define _GNU_SOURCE /* fallocate */
#include <fcntl.h>
#include <jemalloc/jemalloc.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <xxhash.h>

#include "test_tier_util.h"
#include "test_thp.h"

static kvt_tier_t *mk(uint64_t cap)
{
    kvt_tier_t *t = NULL;
    kvt_tier_dram_conf_t c = {.capacity_bytes = cap, .pin = 2};
    cr_assert_eq(kvt_tier_dram_create(&t, &c), 0);
    cr_assert_eq(kvt_tier_kind(t), KVT_TIER_DRAM);
    cr_assert_str_eq(kvt_tier_backend(t), "jemalloc");
    return t;
}

Test(tier_dram, round_trips_of_varied_sizes)
{
    kvt_tier_t *t = mk(64u << 20);
    static const uint32_t sizes[] = {
        1, 100, 4095, 4096, 4097, 65536, 256u << 10, (256u << 10) + 3, 2u << 20, (3u << 20) + 17};
    uint64_t locs[KVT_ARRAY_LEN(sizes)];
    uint32_t tok[16];
    for (size_t i = 0; i < KVT_ARRAY_LEN(sizes); i++) {
        kvt_block_key_t k = tu_key(i, tok, 16);
        uint8_t *buf = malloc(sizes[i]);
        tu_fill(buf, sizes[i], i);
        cr_assert_eq(tu_write(t, &k, buf, sizes[i], &locs[i]), 0);
        cr_assert_neq(locs[i], 0);
        cr_assert(tu_same(kvt_tier_ptr(t, locs[i]), sizes[i], i), "stored bytes of %u", sizes[i]);
        memset(buf, 0, sizes[i]);
        cr_assert_eq(tu_read(t, &k, locs[i], buf, sizes[i]), 0);
        cr_assert(tu_same(buf, sizes[i], i), "read back %u bytes", sizes[i]);
        cr_assert_eq(kvt_tier_valid(t, locs[i], &k), 1);
        free(buf);
    }
    kvt_tier_usage_t u;
    kvt_tier_usage(t, &u);
    cr_assert_eq(u.blocks, KVT_ARRAY_LEN(sizes));
    cr_assert_eq(u.writes, KVT_ARRAY_LEN(sizes));
    cr_assert_eq(u.reads, KVT_ARRAY_LEN(sizes));
    cr_assert_eq(u.inflight, 0);
    uint64_t fp = 0;
    for (size_t i = 0; i < KVT_ARRAY_LEN(sizes); i++)
        fp += kvt_tier_footprint(t, sizes[i]);
    cr_assert_eq(u.used_bytes, fp);
    for (size_t i = 0; i < KVT_ARRAY_LEN(sizes); i++)
        kvt_tier_free(t, locs[i], sizes[i]);
    kvt_tier_usage(t, &u);
    cr_assert_eq(u.blocks, 0);
    cr_assert_eq(u.used_bytes, 0);
    kvt_tier_destroy(t);
}

Test(tier_dram, capacity_exhaustion_fails_cleanly)
{
    const uint32_t len = 1u << 20;
    kvt_tier_t *t = mk(8u << 20);
    uint8_t *buf = malloc(len);
    tu_fill(buf, len, 7);
    uint32_t tok[16];
    uint64_t locs[16];
    int n = 0;
    for (;; n++) {
        cr_assert_lt(n, 16);
        kvt_block_key_t k = tu_key((uint64_t)n, tok, 16);
        kvt_tier_usage_t before;
        kvt_tier_usage(t, &before);
        int rc = tu_write(t, &k, buf, len, &locs[n]);
        if (rc == KVT_ENOSPC) {
            kvt_tier_usage_t after;
            kvt_tier_usage(t, &after);
            cr_assert_eq(after.used_bytes, before.used_bytes, "a failed write changes nothing");
            cr_assert_eq(after.blocks, before.blocks);
            break;
        }
        cr_assert_eq(rc, 0);
    }
    cr_assert_eq(n, 8, "eight 1 MiB blocks fit in 8 MiB (got %d)", n);
    kvt_tier_usage_t u;
    kvt_tier_usage(t, &u);
    cr_assert_leq(u.used_bytes, u.capacity_bytes);
    /* Freeing one makes room for exactly one more. */
    kvt_tier_free(t, locs[3], len);
    kvt_block_key_t k = tu_key(100, tok, 16);
    cr_assert_eq(tu_write(t, &k, buf, len, &locs[3]), 0);
    k = tu_key(101, tok, 16);
    cr_assert_eq(tu_write(t, &k, buf, len, NULL), KVT_ENOSPC);
    free(buf);
    kvt_tier_destroy(t);
}

static uint64_t arena_allocated(unsigned arena)
{
    uint64_t epoch = 1;
    size_t sz = sizeof(epoch);
    cr_assert_eq(mallctl("epoch", &epoch, &sz, &epoch, sz), 0);
    char name[96];
    size_t small = 0, large = 0;
    sz = sizeof(size_t);
    snprintf(name, sizeof(name), "stats.arenas.%u.small.allocated", arena);
    cr_assert_eq(mallctl(name, &small, &sz, NULL, 0), 0);
    snprintf(name, sizeof(name), "stats.arenas.%u.large.allocated", arena);
    cr_assert_eq(mallctl(name, &large, &sz, NULL, 0), 0);
    return small + large;
}

Test(tier_dram, bytes_counted_exactly_as_jemalloc_counts_them)
{
    kvt_tier_t *t = mk(128u << 20);
    unsigned arena = kvt_tier_dram_arena(t);
    cr_assert_eq(arena_allocated(arena), 0);
    uint64_t s = 42;
    uint32_t tok[16];
    uint64_t locs[300];
    uint32_t lens[300];
    uint8_t *buf = malloc(1u << 20);
    for (int i = 0; i < 300; i++) {
        lens[i] = 1 + (uint32_t)(tu_rand(&s) % (512u << 10));
        kvt_block_key_t k = tu_key((uint64_t)i, tok, 16);
        cr_assert_eq(tu_write(t, &k, buf, lens[i], &locs[i]), 0);
    }
    for (int i = 0; i < 300; i += 3)
        kvt_tier_free(t, locs[i], lens[i]);
    kvt_tier_usage_t u;
    kvt_tier_usage(t, &u);
    cr_assert_eq(u.used_bytes, arena_allocated(arena), "tier says %llu, jemalloc says %llu",
                 (unsigned long long)u.used_bytes, (unsigned long long)arena_allocated(arena));
    for (int i = 1; i < 300; i++)
        if (i % 3)
            kvt_tier_free(t, locs[i], lens[i]);
    cr_assert_eq(arena_allocated(arena), 0);
    free(buf);
    kvt_tier_destroy(t);
}

static uint64_t arena_mapped(unsigned arena)
{
    uint64_t epoch = 1;
    size_t sz = sizeof(epoch), mapped = 0;
    cr_assert_eq(mallctl("epoch", &epoch, &sz, &epoch, sz), 0);
    char name[96];
    snprintf(name, sizeof(name), "stats.arenas.%u.mapped", arena);
    sz = sizeof(mapped);
    cr_assert_eq(mallctl(name, &mapped, &sz, NULL, 0), 0);
    return mapped;
}

/* The main region's mapped bytes (kvtier_dram_arena_mapped_bytes): what its arena took, the
 * blocks at least and within the region, and kept once they are freed (reused, never given
 * back). */
Test(tier_dram, mapped_bytes_hold_the_blocks_and_stay_after_them)
{
    kvt_tier_t *t = mk(64u << 20);
    unsigned arena = kvt_tier_dram_arena(t);
    uint64_t m0 = kvt_tier_dram_mapped(t);
    cr_assert_leq(arena_mapped(arena), m0);
    uint32_t tok[16];
    uint64_t locs[8];
    uint8_t *buf = malloc(1u << 20);
    tu_fill(buf, 1u << 20, 3);
    for (int i = 0; i < 8; i++) {
        kvt_block_key_t k = tu_key((uint64_t)i, tok, 16);
        cr_assert_eq(tu_write(t, &k, buf, 1u << 20, &locs[i]), 0);
    }
    uint64_t m1 = kvt_tier_dram_mapped(t);
    cr_assert_geq(m1, m0 + (8u << 20), "8 MiB of blocks in %llu bytes", (unsigned long long)m1);
    cr_assert_leq(m1, (64u << 20) + (16u << 20) + (64u << 20), "beyond the region");
    /* jemalloc has mapped no more than the region's hooks handed it */
    cr_assert_leq(arena_mapped(arena), m1);
    for (int i = 0; i < 8; i++)
        kvt_tier_free(t, locs[i], 1u << 20);
    cr_assert_eq(kvt_tier_dram_mapped(t), m1, "the region gives nothing back");
    for (int i = 0; i < 8; i++) {
        kvt_block_key_t k = tu_key((uint64_t)i, tok, 16);
        cr_assert_eq(tu_write(t, &k, buf, 1u << 20, &locs[i]), 0);
    }
    cr_assert_eq(kvt_tier_dram_mapped(t), m1, "the same blocks again reuse what was taken");
    for (int i = 0; i < 8; i++)
        kvt_tier_free(t, locs[i], 1u << 20);
    cr_assert_eq(kvt_tier_dram_mapped(NULL), 0);
    free(buf);
    kvt_tier_destroy(t);
}

Test(tier_dram, free_and_reuse)
{
    kvt_tier_t *t = mk(16u << 20);
    uint32_t tok[16];
    kvt_block_key_t k = tu_key(1, tok, 16);
    uint8_t buf[5000];
    tu_fill(buf, sizeof(buf), 1);
    uint64_t loc = 0;
    cr_assert_eq(tu_write(t, &k, buf, sizeof(buf), &loc), 0);
    kvt_tier_free(t, loc, sizeof(buf));
    kvt_tier_free(t, loc, sizeof(buf)); /* already freed: no-op */
    kvt_tier_free(t, 12345, 10);        /* unknown: no-op */
    cr_assert_eq(kvt_tier_valid(t, loc, &k), 0);
    cr_assert_null(kvt_tier_ptr(t, loc));
    cr_assert_eq(tu_read(t, &k, loc, buf, sizeof(buf)), KVT_ENOENT);
    kvt_tier_usage_t u;
    kvt_tier_usage(t, &u);
    cr_assert_eq(u.misses, 1);
    cr_assert_eq(u.used_bytes, 0);
    /* The space is reused. */
    for (int i = 0; i < 1000; i++) {
        kvt_block_key_t ki = tu_key((uint64_t)i, tok, 16);
        cr_assert_eq(tu_write(t, &ki, buf, sizeof(buf), &loc), 0);
        kvt_tier_free(t, loc, sizeof(buf));
    }
    kvt_tier_usage(t, &u);
    cr_assert_eq(u.blocks, 0);
    cr_assert_eq(u.used_bytes, 0);
    /* A read with the wrong hash for a live location is a miss, not someone else's bytes. */
    cr_assert_eq(tu_write(t, &k, buf, sizeof(buf), &loc), 0);
    kvt_block_key_t other = tu_key(2, tok, 16);
    cr_assert_eq(tu_read(t, &other, loc, buf, sizeof(buf)), KVT_ENOENT);
    cr_assert_eq(kvt_tier_valid(t, loc, &other), 0);
    kvt_tier_destroy(t);
}

Test(tier_dram, many_requests_in_flight_complete_through_the_fd)
{
    enum { N = 256, LEN = 70000 };
    kvt_tier_t *t = mk(64u << 20);
    static kvt_tier_io_t ios[N];
    static uint32_t toks[N][16];
    uint8_t *bufs = malloc((size_t)N * LEN);
    int done = 0;
    tu_write_burst(t, ios, toks, bufs, N, LEN, 0, &done);
    cr_assert_eq(done, 0, "no callback runs inside a submit");
    kvt_tier_usage_t u;
    kvt_tier_usage(t, &u);
    cr_assert_eq(u.inflight, N);
    struct pollfd pfd = {.fd = kvt_tier_fd(t), .events = POLLIN};
    cr_assert_eq(poll(&pfd, 1, 1000), 1, "the tier's fd is readable with completions ready");
    cr_assert_eq(kvt_tier_process(t), N);
    cr_assert_eq(done, N);
    memset(bufs, 0, (size_t)N * LEN);
    done = 0;
    for (int i = 0; i < N; i++) {
        ios[i].cb = tu_count_cb;
        cr_assert_eq(ios[i].status, 0);
        cr_assert_eq(kvt_tier_read(t, &ios[i]), 0);
    }
    cr_assert(tu_drive(t, &done, N));
    for (int i = 0; i < N; i++) {
        cr_assert_eq(ios[i].status, 0);
        cr_assert(tu_same(bufs + (size_t)i * LEN, LEN, (uint64_t)i));
    }
    pfd.revents = 0;
    cr_assert_eq(poll(&pfd, 1, 0), 0, "nothing ready: the fd is quiet");
    free(bufs);
    kvt_tier_destroy(t);
}

Test(tier_dram, bad_input_is_refused_and_changes_nothing)
{
    kvt_tier_t *t = NULL;
    kvt_tier_dram_conf_t c = {.capacity_bytes = 0};
    cr_assert_eq(kvt_tier_dram_create(&t, &c), KVT_EINVAL);
    c = (kvt_tier_dram_conf_t){.capacity_bytes = 1 << 20, .pin = 7};
    cr_assert_eq(kvt_tier_dram_create(&t, &c), KVT_EINVAL);
    if (!kvt_tier_cuda_usable()) {
        c = (kvt_tier_dram_conf_t){.capacity_bytes = 1 << 20, .pin = 1};
        cr_assert_eq(kvt_tier_dram_create(&t, &c), KVT_EUNAVAIL);
    }
    cr_assert_eq(kvt_tier_dram_create(NULL, &c), KVT_EINVAL);
    t = mk(4u << 20);
    uint32_t tok[16];
    uint8_t buf[64];
    kvt_tier_io_t io = {.key = tu_key(1, tok, 16), .buf = buf, .len = 0};
    cr_assert_eq(kvt_tier_write(t, &io), KVT_EINVAL);
    io.len = KVT_TIER_MAX_BLOCK + 1;
    cr_assert_eq(kvt_tier_write(t, &io), KVT_EINVAL);
    io.len = 64;
    io.key.ntokens = KVT_PAGE_MAX + 1;
    cr_assert_eq(kvt_tier_write(t, &io), KVT_EINVAL);
    io.key.ntokens = 16;
    io.key.tokens = NULL;
    cr_assert_eq(kvt_tier_write(t, &io), KVT_EINVAL);
    cr_assert_eq(kvt_tier_write(NULL, &io), KVT_EINVAL);
    /* A read whose length is not the stored one. */
    kvt_block_key_t k = tu_key(1, tok, 16);
    uint64_t loc = 0;
    cr_assert_eq(tu_write(t, &k, buf, sizeof(buf), &loc), 0);
    kvt_tier_io_t rd = {.key = k, .loc = loc, .buf = buf, .len = 32};
    cr_assert_eq(kvt_tier_read(t, &rd), KVT_EINVAL);
    kvt_tier_usage_t u;
    kvt_tier_usage(t, &u);
    cr_assert_eq(u.blocks, 1);
    cr_assert_eq(u.writes, 1);
    cr_assert_eq(u.inflight, 0);
    cr_assert_eq(u.errors, 0);
    kvt_tier_destroy(t);
}

/* Random writes, reads and frees against a plain array of what should be stored. */
Test(tier_dram, random_operations_match_a_reference_model)
{
    enum { SLOTS = 200, OPS = 4000 };
    kvt_tier_t *t = mk(32u << 20);
    struct {
        int live;
        uint64_t loc;
        uint32_t len;
        uint64_t seed;
        uint32_t tok[4];
    } m[SLOTS] = {{0}};
    uint64_t s = 99;
    uint8_t *buf = malloc(1u << 20);
    uint64_t expect_used = 0, expect_blocks = 0;
    for (int op = 0; op < OPS; op++) {
        int i = (int)(tu_rand(&s) % SLOTS);
        int what = (int)(tu_rand(&s) % 3);
        kvt_block_key_t k = tu_key((uint64_t)i, m[i].tok, 4);
        if (!m[i].live) {
            uint32_t len = 1 + (uint32_t)(tu_rand(&s) % (400u << 10));
            uint64_t seed = tu_rand(&s);
            tu_fill(buf, len, seed);
            uint64_t fp = kvt_tier_footprint(t, len);
            uint64_t loc = 0;
            int rc = tu_write(t, &k, buf, len, &loc);
            if (expect_used + fp > (32u << 20)) {
                cr_assert_eq(rc, KVT_ENOSPC);
                continue;
            }
            cr_assert_eq(rc, 0);
            m[i].live = 1, m[i].loc = loc, m[i].len = len, m[i].seed = seed;
            expect_used += fp;
            expect_blocks++;
        } else if (what == 0) {
            kvt_tier_free(t, m[i].loc, m[i].len);
            m[i].live = 0;
            expect_used -= kvt_tier_footprint(t, m[i].len);
            expect_blocks--;
        } else {
            cr_assert_eq(kvt_tier_valid(t, m[i].loc, &k), 1);
            cr_assert_eq(tu_read(t, &k, m[i].loc, buf, m[i].len), 0);
            cr_assert(tu_same(buf, m[i].len, m[i].seed));
        }
        kvt_tier_usage_t u;
        kvt_tier_usage(t, &u);
        cr_assert_eq(u.used_bytes, expect_used);
        cr_assert_eq(u.blocks, expect_blocks);
    }
    cr_assert_eq(arena_allocated(kvt_tier_dram_arena(t)), expect_used);
    free(buf);
    kvt_tier_destroy(t);
}

/* Filling the tier to capacity, emptying it and filling it again must fit the same blocks
 * every time: the arena's region does not strand memory as jemalloc grows into it. */
Test(tier_dram, refilling_to_capacity_fits_the_same_blocks_every_round)
{
    const uint64_t cap = 64u << 20;
    kvt_tier_t *t = mk(cap);
    static const uint32_t sizes[] = {256u << 10, 2u << 20, 100000};
    uint8_t *buf = malloc(2u << 20);
    uint32_t tok[16];
    static uint64_t locs[1024];
    for (size_t s = 0; s < KVT_ARRAY_LEN(sizes); s++) {
        uint32_t len = sizes[s];
        uint64_t want = cap / kvt_tier_footprint(t, len);
        for (int round = 0; round < 3; round++) {
            uint64_t n = 0;
            for (;; n++) {
                kvt_block_key_t k = tu_key(n, tok, 16);
                int rc = tu_write(t, &k, buf, len, &locs[n]);
                if (rc == KVT_ENOSPC)
                    break;
                cr_assert_eq(rc, 0);
            }
            cr_assert_eq(n, want, "size %u round %d: %llu blocks, want %llu", len, round,
                         (unsigned long long)n, (unsigned long long)want);
            for (uint64_t i = 0; i < n; i++)
                kvt_tier_free(t, locs[i], len);
        }
    }
    free(buf);
    kvt_tier_destroy(t);
}

/* The region lies on a 2 MiB boundary and is advised for transparent huge pages (tiers/dram.c),
 * which keeps an O_DIRECT I/O of a block to one bio: the kernel says so in the region's
 * THPeligible line. Skipped where transparent huge pages are off. */
Test(tier_dram, region_is_eligible_for_huge_pages)
{
    thp_skip_unless_on();
    kvt_tier_t *t = mk(64u << 20);
    uint32_t tok[16];
    kvt_block_key_t k = tu_key(1, tok, 16);
    uint8_t *buf = malloc(2u << 20);
    tu_fill(buf, 2u << 20, 1);
    uint64_t loc = 0;
    cr_assert_eq(tu_write(t, &k, buf, 2u << 20, &loc), 0);
    uintptr_t p = (uintptr_t)kvt_tier_ptr(t, loc);
    FILE *f = fopen("/proc/self/smaps", "r");
    cr_assert(f);
    char line[512];
    int in = 0, eligible = -1;
    unsigned long lo = 0;
    while (fgets(line, sizeof line, f)) {
        unsigned long a, b;
        if (sscanf(line, "%lx-%lx ", &a, &b) == 2) {
            in = p >= a && p < b;
            if (in)
                lo = a;
        } else if (in && sscanf(line, "THPeligible: %d", &eligible) == 1) {
            break;
        }
    }
    fclose(f);
    cr_expect_eq(lo % (2u << 20), 0, "the region starts on a 2 MiB boundary (%#lx)", lo);
    cr_expect_eq(eligible, 1, "THPeligible of the block's mapping: %d", eligible);
    free(buf);
    kvt_tier_free(t, loc, 2u << 20);
    kvt_tier_destroy(t);
}

/* ---- shared arenas (zero-copy local clients) ---- */

#define NS_A 0xa11ce0000000000aull
#define NS_B 0xb0b0000000000000ull
#define NS_C 0xc0c0000000000000ull

static kvt_tier_t *mk_shared(uint64_t cap, uint32_t max_shared)
{
    kvt_tier_t *t = NULL;
    kvt_tier_dram_conf_t c = {.capacity_bytes = cap, .pin = 2, .max_shared = max_shared};
    cr_assert_eq(kvt_tier_dram_create(&t, &c), 0);
    return t;
}

static kvt_block_key_t ns_key(uint64_t ns, uint64_t i, uint32_t *tok)
{
    kvt_block_key_t k = tu_key(i, tok, 16);
    k.ns_seed = ns;
    return k;
}

/* What a client does with the fd: its own MAP_SHARED mapping of the whole memfd. */
static uint8_t *client_map(int fd, uint64_t bytes)
{
    void *m = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    cr_assert_neq(m, MAP_FAILED, "mmap of the shared fd: %s", strerror(errno));
    return m;
}

static uint64_t fd_bytes(int fd)
{
    struct stat st;
    cr_assert_eq(fstat(fd, &st), 0);
    return (uint64_t)st.st_blocks * 512;
}

Test(tier_dram, a_shared_namespace_s_blocks_lie_in_its_own_arena)
{
    kvt_tier_t *t = mk_shared(16u << 20, 4);
    const uint32_t len = 100000;
    uint8_t *buf = malloc(len);
    uint32_t tok[16];
    /* Written before sharing: stays in the main region. */
    kvt_block_key_t k0 = ns_key(NS_A, 0, tok);
    tu_fill(buf, len, 0);
    uint64_t before = 0, off = 0;
    cr_assert_eq(tu_write(t, &k0, buf, len, &before), 0);

    int fa = -1, fb = -1;
    uint64_t ma = 0, mb = 0;
    cr_assert_eq(kvt_tier_dram_share(t, NS_A, &fa, &ma), 0);
    cr_assert_geq(fa, 0);
    cr_assert_geq(ma, 16u << 20);
    cr_assert_eq(kvt_tier_dram_share(t, NS_B, &fb, &mb), 0);
    cr_assert_neq(fa, fb);
    cr_assert_eq(kvt_tier_dram_shared(t), 2);
    cr_assert_eq(kvt_tier_dram_offset(t, NS_A, before, &off), KVT_ENOENT);

    kvt_block_key_t ka = ns_key(NS_A, 1, tok), kb = ns_key(NS_B, 2, tok), kc = ns_key(NS_C, 3, tok);
    uint64_t la = 0, lb = 0, lc = 0;
    tu_fill(buf, len, 1);
    cr_assert_eq(tu_write(t, &ka, buf, len, &la), 0);
    tu_fill(buf, len, 2);
    cr_assert_eq(tu_write(t, &kb, buf, len, &lb), 0);
    tu_fill(buf, len, 3);
    cr_assert_eq(tu_write(t, &kc, buf, len, &lc), 0);

    uint8_t *ca = client_map(fa, ma);
    cr_assert_eq(kvt_tier_dram_offset(t, NS_A, la, &off), 0);
    cr_assert_eq(off % 4096, 0, "blocks of 4 KiB or more stay 4 KiB aligned in the memfd");
    cr_assert(tu_same(ca + off, len, 1), "the tier's bytes appear in the client's mapping");
    /* And the other way: what the client writes, the tier reads. */
    tu_fill(ca + off, len, 11);
    cr_assert(tu_same(kvt_tier_ptr(t, la), len, 11));
    cr_assert_eq(tu_read(t, &ka, la, buf, len), 0);
    cr_assert(tu_same(buf, len, 11));
    /* Nobody else's block is in A's arena, even a namespace shared too, nor an unshared one. */
    cr_assert_eq(kvt_tier_dram_offset(t, NS_A, lb, &off), KVT_ENOENT);
    cr_assert_eq(kvt_tier_dram_offset(t, NS_A, lc, &off), KVT_ENOENT);
    cr_assert_eq(kvt_tier_dram_offset(t, NS_B, la, &off), KVT_ENOENT);
    cr_assert_eq(kvt_tier_dram_offset(t, NS_C, lc, &off), KVT_ENOENT);
    cr_assert_eq(kvt_tier_dram_offset(t, NS_B, lb, &off), 0);
    uint8_t *cb = client_map(fb, mb);
    cr_assert(tu_same(cb + off, len, 2));
    /* The block written before sharing is still readable where it was. */
    cr_assert_eq(tu_read(t, &k0, before, buf, len), 0);
    cr_assert(tu_same(buf, len, 0));

    kvt_tier_usage_t u;
    kvt_tier_usage(t, &u);
    cr_assert_eq(u.used_bytes, 4 * kvt_tier_footprint(t, len));
    munmap(ca, ma);
    munmap(cb, mb);
    free(buf);
    kvt_tier_destroy(t);
}

Test(tier_dram, a_write_without_buf_reserves_a_block_the_client_fills)
{
    kvt_tier_t *t = mk_shared(8u << 20, 1);
    int fd = -1;
    uint64_t mb = 0, off = 0, loc = 0;
    cr_assert_eq(kvt_tier_dram_share(t, NS_A, &fd, &mb), 0);
    uint8_t *c = client_map(fd, mb);
    const uint32_t len = 300000;
    uint32_t tok[16];
    kvt_block_key_t k = ns_key(NS_A, 1, tok);
    kvt_tier_usage_t u0, u1;
    kvt_tier_usage(t, &u0);
    cr_assert_eq(tu_write(t, &k, NULL, len, &loc), 0);
    kvt_tier_usage(t, &u1);
    cr_assert_eq(u1.used_bytes - u0.used_bytes, kvt_tier_footprint(t, len), "charged");
    cr_assert_eq(u1.blocks, u0.blocks + 1);
    cr_assert_eq(kvt_tier_dram_offset(t, NS_A, loc, &off), 0);
    tu_fill(c + off, len, 5); /* the client's PUT, through its mapping */
    uint8_t *buf = malloc(len);
    cr_assert_eq(tu_read(t, &k, loc, buf, len), 0);
    cr_assert(tu_same(buf, len, 5));
    /* Reads still need a buffer. */
    kvt_tier_io_t rd = {.key = k, .loc = loc, .buf = NULL, .len = len};
    cr_assert_eq(kvt_tier_read(t, &rd), KVT_EINVAL);
    /* Another tier kind refuses a write without buf, and charges nothing. */
    kvt_tier_t *h = NULL;
    kvt_tier_hbm_conf_t hc = {.backend = "host", .capacity_bytes = 4u << 20};
    cr_assert_eq(kvt_tier_hbm_create(&h, &hc), 0);
    kvt_tier_io_t wr = {.key = k, .buf = NULL, .len = len};
    cr_assert_eq(kvt_tier_write(h, &wr), KVT_EINVAL);
    kvt_tier_usage(h, &u0);
    cr_assert_eq(u0.used_bytes, 0);
    kvt_tier_destroy(h);
    munmap(c, mb);
    free(buf);
    kvt_tier_destroy(t);
}

/* Copies into DRAM (promotions, demotions) land in the namespace's arena too, and a block in a
 * shared arena (pageable, never pinned) copies out correctly. */
Test(tier_dram, copies_land_in_the_namespace_s_arena_and_copy_out)
{
    kvt_tier_t *t = mk_shared(8u << 20, 1);
    kvt_tier_t *h = NULL;
    kvt_tier_hbm_conf_t hc = {.backend = "host", .capacity_bytes = 4u << 20};
    cr_assert_eq(kvt_tier_hbm_create(&h, &hc), 0);
    int fd = -1;
    uint64_t mb = 0, off = 0, hloc = 0;
    cr_assert_eq(kvt_tier_dram_share(t, NS_A, &fd, &mb), 0);
    const uint32_t len = 200000;
    uint32_t tok[16];
    kvt_block_key_t k = ns_key(NS_A, 1, tok);
    uint8_t *buf = malloc(len);
    tu_fill(buf, len, 9);
    cr_assert_eq(tu_write(h, &k, buf, len, &hloc), 0);
    kvt_tier_copy_t cp = {.src = h, .dst = t, .src_loc = hloc, .key = k, .len = len, .cb = NULL};
    cr_assert_eq(kvt_tier_copy(&cp), 0);
    while (kvt_tier_wait(t, 1000) > 0 && !cp.dst_loc)
        ;
    cr_assert_eq(cp.status, 0);
    cr_assert_eq(kvt_tier_dram_offset(t, NS_A, cp.dst_loc, &off), 0);
    uint8_t *c = client_map(fd, mb);
    cr_assert(tu_same(c + off, len, 9));
    /* And back out to the other tier from the shared arena. */
    kvt_tier_free(h, hloc, len);
    tu_fill(c + off, len, 10);
    kvt_tier_copy_t back = {.src = t, .dst = h, .src_loc = cp.dst_loc, .key = k, .len = len};
    cr_assert_eq(kvt_tier_copy(&back), 0);
    while (kvt_tier_wait(h, 1000) > 0 && !back.dst_loc)
        ;
    cr_assert_eq(back.status, 0);
    cr_assert_eq(tu_read(h, &k, back.dst_loc, buf, len), 0);
    cr_assert(tu_same(buf, len, 10));
    munmap(c, mb);
    free(buf);
    kvt_tier_destroy(h);
    kvt_tier_destroy(t);
}

/* One capacity over all arenas: blocks of three shared namespaces and the main region together
 * never exceed it, and the write that does not fit changes nothing. */
Test(tier_dram, capacity_counts_every_arena)
{
    const uint32_t len = 1u << 20;
    kvt_tier_t *t = mk_shared(8u << 20, 3);
    static const uint64_t ns[] = {NS_A, NS_B, NS_C, TU_NS_SEED};
    int fd;
    uint64_t mb;
    for (int i = 0; i < 3; i++)
        cr_assert_eq(kvt_tier_dram_share(t, ns[i], &fd, &mb), 0);
    uint8_t *buf = malloc(len);
    tu_fill(buf, len, 1);
    uint32_t tok[16];
    uint64_t locs[16];
    int n = 0;
    for (;; n++) {
        cr_assert_lt(n, 16);
        kvt_block_key_t k = ns_key(ns[n % 4], (uint64_t)n, tok);
        kvt_tier_usage_t before, after;
        kvt_tier_usage(t, &before);
        int rc = tu_write(t, &k, buf, len, &locs[n]);
        kvt_tier_usage(t, &after);
        cr_assert_leq(after.used_bytes, after.capacity_bytes);
        if (rc == KVT_ENOSPC) {
            cr_assert_eq(after.used_bytes, before.used_bytes, "a failed write changes nothing");
            cr_assert_eq(after.blocks, before.blocks);
            break;
        }
        cr_assert_eq(rc, 0);
        uint64_t off;
        cr_assert_eq(kvt_tier_dram_offset(t, ns[n % 4], locs[n], &off),
                     n % 4 == 3 ? KVT_ENOENT : 0);
    }
    cr_assert_eq(n, 8, "eight 1 MiB blocks fit in 8 MiB over four arenas (got %d)", n);
    /* Room freed in one arena is room for another's block. */
    kvt_tier_free(t, locs[0], len);
    kvt_block_key_t k = ns_key(NS_B, 100, tok);
    cr_assert_eq(tu_write(t, &k, buf, len, &locs[0]), 0);
    k = ns_key(NS_C, 101, tok);
    cr_assert_eq(tu_write(t, &k, buf, len, NULL), KVT_ENOSPC);
    free(buf);
    kvt_tier_destroy(t);
}

Test(tier_dram, max_shared_bounds_the_arenas)
{
    kvt_tier_t *t = mk_shared(4u << 20, 2);
    int fd, fd2;
    uint64_t mb;
    cr_assert_eq(kvt_tier_dram_share(t, NS_A, &fd, &mb), 0);
    cr_assert_eq(kvt_tier_dram_share(t, NS_B, &fd, &mb), 0);
    cr_assert_eq(kvt_tier_dram_share(t, NS_C, &fd, &mb), KVT_ENOSPC);
    /* Sharing a namespace again finds its arena: same fd, no new slot. */
    cr_assert_eq(kvt_tier_dram_share(t, NS_A, &fd, &mb), 0);
    cr_assert_eq(kvt_tier_dram_share(t, NS_A, &fd2, &mb), 0);
    cr_assert_eq(fd, fd2);
    cr_assert_eq(kvt_tier_dram_shared(t), 2);
    /* B is empty: its one unshare frees its slot. */
    kvt_tier_dram_unshare(t, NS_B);
    cr_assert_eq(kvt_tier_dram_shared(t), 1);
    cr_assert_eq(kvt_tier_dram_share(t, NS_C, &fd, &mb), 0);
    cr_assert_eq(kvt_tier_dram_shared(t), 2);
    /* A has three references: two unshares leave it. */
    kvt_tier_dram_unshare(t, NS_A);
    kvt_tier_dram_unshare(t, NS_A);
    cr_assert_eq(kvt_tier_dram_shared(t), 2);
    kvt_tier_dram_unshare(t, NS_A);
    cr_assert_eq(kvt_tier_dram_shared(t), 1);
    kvt_tier_dram_unshare(t, NS_A); /* not shared any more: no-op */
    cr_assert_eq(kvt_tier_dram_shared(t), 1);
    /* Bad input, and no arena at all with max_shared 0. */
    cr_assert_eq(kvt_tier_dram_share(t, NS_A, NULL, &mb), KVT_EINVAL);
    cr_assert_eq(kvt_tier_dram_share(NULL, NS_A, &fd, &mb), KVT_EINVAL);
    kvt_tier_t *z = mk(4u << 20);
    cr_assert_eq(kvt_tier_dram_share(z, NS_A, &fd, &mb), KVT_ENOSPC);
    cr_assert_eq(kvt_tier_dram_shared(z), 0);
    kvt_tier_t *h = NULL;
    kvt_tier_hbm_conf_t hc = {.backend = "host", .capacity_bytes = 4u << 20};
    cr_assert_eq(kvt_tier_hbm_create(&h, &hc), 0);
    cr_assert_eq(kvt_tier_dram_share(h, NS_A, &fd, &mb), KVT_EINVAL);
    uint64_t off;
    cr_assert_eq(kvt_tier_dram_offset(h, NS_A, 4096, &off), KVT_ENOENT);
    kvt_tier_destroy(h);
    kvt_tier_destroy(z);
    kvt_tier_destroy(t);
}

Test(tier_dram, an_unshared_arena_lives_until_its_last_block_goes)
{
    kvt_tier_t *t = mk_shared(8u << 20, 1);
    int fd;
    uint64_t mb, off, la = 0, lb = 0;
    cr_assert_eq(kvt_tier_dram_share(t, NS_A, &fd, &mb), 0);
    const uint32_t len = 50000;
    uint8_t *buf = malloc(len);
    uint32_t tok[16];
    kvt_block_key_t ka = ns_key(NS_A, 1, tok);
    tu_fill(buf, len, 1);
    cr_assert_eq(tu_write(t, &ka, buf, len, &la), 0);
    kvt_tier_dram_unshare(t, NS_A);
    cr_assert_eq(kvt_tier_dram_shared(t), 1, "a block still lives in it");
    cr_assert_eq(kvt_tier_dram_offset(t, NS_A, la, &off), 0);
    memset(buf, 0, len);
    cr_assert_eq(tu_read(t, &ka, la, buf, len), 0);
    cr_assert(tu_same(buf, len, 1));
    /* Unreferenced, it only drains: a new block of A goes to the main region. */
    kvt_tier_dram_unshare(t, NS_A); /* a stray extra unshare changes nothing */
    kvt_block_key_t kb = ns_key(NS_A, 2, tok);
    cr_assert_eq(tu_write(t, &kb, buf, len, &lb), 0);
    cr_assert_eq(kvt_tier_dram_offset(t, NS_A, lb, &off), KVT_ENOENT);
    kvt_tier_free(t, la, len);
    cr_assert_eq(kvt_tier_dram_shared(t), 0, "its last block gone, the arena is destroyed");
    cr_assert_eq(kvt_tier_dram_offset(t, NS_A, la, &off), KVT_ENOENT);
    /* Its slot is free for another namespace. */
    cr_assert_eq(kvt_tier_dram_share(t, NS_B, &fd, &mb), 0);
    cr_assert_eq(tu_read(t, &kb, lb, buf, len), 0);
    kvt_tier_free(t, lb, len);
    free(buf);
    kvt_tier_destroy(t);
}

/* Writes n blocks of len bytes of namespace ns (keys first .. first+n-1) into locs. */
static void ns_fill(kvt_tier_t *t, uint64_t ns, uint64_t first, int n, uint32_t len, uint64_t *locs)
{
    uint8_t *buf = malloc(len);
    uint32_t tok[16];
    for (int i = 0; i < n; i++) {
        kvt_block_key_t k = ns_key(ns, first + (uint64_t)i, tok);
        tu_fill(buf, len, first + (uint64_t)i);
        cr_assert_eq(tu_write(t, &k, buf, len, &locs[i]), 0, "block %d of %016llx", i,
                     (unsigned long long)ns);
    }
    free(buf);
}

/* Shares ns's arena and returns a second descriptor of its memfd: what a client that kept the
 * fd sees after the namespace is unshared (fd_bytes on it). */
static int share_kept(kvt_tier_t *t, uint64_t ns)
{
    int fd;
    uint64_t mb;
    cr_assert_eq(kvt_tier_dram_share(t, ns, &fd, &mb), 0);
    int keep = dup(fd);
    cr_assert_geq(keep, 0);
    return keep;
}

static void ns_drop(kvt_tier_t *t, int n, uint32_t len, const uint64_t *locs)
{
    for (int i = 0; i < n; i++)
        kvt_tier_free(t, locs[i], len);
}

/* The daemon's ticks for ms milliseconds, one every 25. */
static void ticks(kvt_tier_t *t, int ms)
{
    for (int i = 0; i < ms / 25; i++) {
        usleep(25000);
        kvt_tier_dram_decay(t);
    }
}

static long minor_faults(void)
{
    struct rusage ru;
    cr_assert_eq(getrusage(RUSAGE_SELF, &ru), 0);
    return ru.ru_minflt;
}

/* Freed blocks of a shared arena keep their pages for the namespace's next blocks however long
 * the pause, while the tier's footprint is within its capacity: the next blocks take no page
 * fault and no new memory (issue 35: a decay of a second cost an engine whose stores came
 * 1.2 s after its removals a fault per 4 KiB). */
Test(tier_dram, freed_pages_of_a_shared_arena_stay_while_within_capacity)
{
    const uint32_t len = 1u << 20;
    enum { N = 16 };
    kvt_tier_t *t = mk_shared(64u << 20, 1);
    int fd;
    uint64_t mb, locs[N];
    cr_assert_eq(kvt_tier_dram_share(t, NS_A, &fd, &mb), 0);
    ns_fill(t, NS_A, 0, N, len, locs);
    uint64_t full = fd_bytes(fd);
    cr_assert_geq(full, (uint64_t)N * len);
    ns_drop(t, N, len, locs);
    ticks(t, 1600);
    cr_assert_geq(fd_bytes(fd), full, "freed pages given back within capacity: %llu of %llu",
                  (unsigned long long)fd_bytes(fd), (unsigned long long)full);
    long f0 = minor_faults();
    ns_fill(t, NS_A, 100, N, len, locs);
    long faults = minor_faults() - f0;
    cr_expect_lt(faults, (long)((uint64_t)N * len / 4096 / 10),
                 "%ld page faults writing %d MiB into kept pages", faults, N);
    cr_expect_eq(fd_bytes(fd), full, "the new blocks took new memory");
    ns_drop(t, N, len, locs);
    kvt_tier_destroy(t);
}

/* Past the capacity (blocks of another namespace written into the main region), the kept pages
 * go back at the next tick, as much as needed: the tier's live blocks and kept pages together
 * stay within its capacity. Once those main-region blocks are freed the main region keeps their
 * pages (never given back), which counts too: from the second round on the arena's freed pages
 * go back at once, since 8 MiB kept there and 12 MiB kept in the arena exceed the 16 MiB. */
Test(tier_dram, freed_pages_go_back_once_the_footprint_passes_capacity)
{
    const uint32_t len = 1u << 20;
    enum { N = 12, M = 8 };
    const uint64_t cap = 16u << 20;
    kvt_tier_t *t = mk_shared(cap, 1);
    int fd;
    uint64_t mb, locs[N], mains[M];
    cr_assert_eq(kvt_tier_dram_share(t, NS_A, &fd, &mb), 0);
    for (int round = 0; round < 3; round++) {
        ns_fill(t, NS_A, 0, N, len, locs);
        uint64_t full = fd_bytes(fd);
        ns_drop(t, N, len, locs);
        kvt_tier_dram_decay(t);
        if (round == 0)
            cr_assert_geq(fd_bytes(fd), full, "round 0: kept within capacity");
        else
            cr_assert_leq(fd_bytes(fd) + (uint64_t)M * len, cap,
                          "round %d: %llu bytes kept in the arena beside %d MiB kept in the main "
                          "region",
                          round, (unsigned long long)fd_bytes(fd), M);
        ns_fill(t, NS_C, 1000, M, len, mains); /* not shared: the main region */
        kvt_tier_dram_decay(t);
        cr_assert_leq(fd_bytes(fd) + (uint64_t)M * len, cap,
                      "round %d: %llu bytes in the arena beside %d MiB of live blocks", round,
                      (unsigned long long)fd_bytes(fd), M);
        ns_drop(t, M, len, mains);
    }
    kvt_tier_destroy(t);
}

/* Bytes of [p, p + len) resident in this process (mincore), p page-aligned. */
static uint64_t resident_bytes(const void *p, uint64_t len)
{
    uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE), n = (len + page - 1) / page, r = 0;
    unsigned char *v = malloc(n);
    cr_assert_not_null(v);
    cr_assert_eq(mincore((void *)(uintptr_t)p, len, v), 0, "mincore: %s", strerror(errno));
    for (uint64_t i = 0; i < n; i++)
        r += (v[i] & 1) ? page : 0;
    free(v);
    return r;
}

static kvt_tier_dram_shared_stats_t dram_stats(const kvt_tier_t *t)
{
    kvt_tier_dram_shared_stats_t st;
    cr_assert_eq(kvt_tier_dram_shared_stats(t, &st), 0);
    return st;
}

/* The main region keeps the pages of its freed blocks resident (its purges are refused), so
 * they are part of the tier's footprint: a shared arena's freed pages that fit beside the live
 * blocks alone but not beside those too go back at the next tick, counted as a trim, and the
 * main region's kept pages plus the arena's stay within the capacity. */
Test(tier_dram, the_main_region_s_kept_pages_count_in_the_footprint)
{
    const uint32_t len = 1u << 20;
    enum { N = 10 };
    const uint64_t cap = 16u << 20;
    kvt_tier_t *t = mk_shared(cap, 1);
    int fd;
    uint64_t mb, mains[N], locs[N];
    cr_assert_eq(kvt_tier_dram_share(t, NS_A, &fd, &mb), 0);
    ns_fill(t, NS_C, 0, N, len, mains); /* not shared: the main region */
    ns_drop(t, N, len, mains);
    uint64_t lo = mains[0], hi = mains[0];
    for (int i = 1; i < N; i++) {
        lo = KVT_MIN(lo, mains[i]);
        hi = KVT_MAX(hi, mains[i]);
    }
    uint64_t kept_main = resident_bytes((const void *)(uintptr_t)lo, hi + len - lo);
    cr_assert_geq(kept_main, (uint64_t)N * len, "the freed blocks' pages left the main region");
    kvt_tier_dram_shared_stats_t st = dram_stats(t);
    cr_expect_geq(st.kept_bytes, (uint64_t)N * len, "kept %llu bytes",
                  (unsigned long long)st.kept_bytes);
    cr_expect_eq(st.trims, 0);
    cr_log_info("main region: %llu bytes resident after its blocks went, %llu counted as kept",
                (unsigned long long)kept_main, (unsigned long long)st.kept_bytes);
    ns_fill(t, NS_A, 100, N, len, locs);
    ns_drop(t, N, len, locs); /* 10 MiB kept in the arena: 20 with the main region's */
    kvt_tier_dram_decay(t);
    cr_expect_lt(fd_bytes(fd), (uint64_t)len,
                 "%llu bytes kept in the arena beside %llu kept in "
                 "the main region (capacity 16 MiB)",
                 (unsigned long long)fd_bytes(fd), (unsigned long long)kept_main);
    cr_expect_leq(fd_bytes(fd) + resident_bytes((const void *)(uintptr_t)lo, hi + len - lo), cap);
    st = dram_stats(t);
    cr_expect_eq(st.trims, 1);
    cr_expect_geq(st.trimmed_bytes, (uint64_t)(N - 1) * len, "trimmed %llu bytes",
                  (unsigned long long)st.trimmed_bytes);
    cr_expect_leq(st.kept_bytes, cap, "kept %llu bytes after the trim",
                  (unsigned long long)st.kept_bytes);
    kvt_tier_destroy(t);
}

/* The counters behind kvtier_dram_kept_bytes, _trims_total and _trimmed_bytes_total: an arena's
 * freed pages are kept bytes while within capacity (no trim); once its namespace is unshared
 * they go at the next tick, one trim of what its memfd held beyond its last block. */
Test(tier_dram, trims_and_kept_bytes_are_counted)
{
    const uint32_t len = 1u << 20;
    enum { N = 8 };
    kvt_tier_t *t = mk_shared(64u << 20, 1);
    uint64_t locs[N];
    int keep = share_kept(t, NS_A);
    ns_fill(t, NS_A, 0, N, len, locs);
    ns_drop(t, N - 1, len, locs);
    kvt_tier_dram_decay(t);
    kvt_tier_dram_shared_stats_t st = dram_stats(t);
    cr_expect_eq(st.trims, 0, "trimmed within capacity");
    cr_expect_geq(st.kept_bytes, (uint64_t)(N - 1) * len, "kept %llu bytes",
                  (unsigned long long)st.kept_bytes);
    cr_expect_leq(st.kept_bytes, (uint64_t)N * len);
    uint64_t before = fd_bytes(keep);
    kvt_tier_dram_unshare(t, NS_A);
    kvt_tier_dram_decay(t);
    st = dram_stats(t);
    cr_expect_eq(st.trims, 1);
    cr_expect_eq(st.trimmed_bytes, before - fd_bytes(keep));
    cr_expect_geq(st.trimmed_bytes, (uint64_t)(N - 1) * len);
    cr_expect_lt(st.kept_bytes, (uint64_t)len, "still kept: %llu bytes",
                 (unsigned long long)st.kept_bytes);
    kvt_tier_dram_decay(t);
    cr_expect_eq(dram_stats(t).trims, 1, "an arena with nothing freed since is not trimmed again");
    kvt_tier_free(t, locs[N - 1], len);
    close(keep);
    kvt_tier_destroy(t);
}

/* A write that finds no room in its shared arena purges it and tries again. Small blocks (4 KiB,
 * on slabs under 16 KiB, whose freed extents jemalloc coalesces only once purged) filled the
 * capacity and were freed; then 1 MiB blocks take the rest of the arena's memfd (a quarter of
 * the capacity and 64 MiB), and the next ones fit only in the small blocks' room, coalesced by
 * the purge (jemalloc 5.3 merges no further than each 8 MiB it took from the hooks, which is why
 * the blocks are not larger). Reservations (no buf): nothing touches the memfd. */
Test(tier_dram, a_write_into_a_fragmented_shared_arena_purges_it_and_retries)
{
    const uint64_t cap = 128u << 20;
    const uint32_t small = 4096, mid = 1u << 20;
    enum { MID = 120 };
    const int n = (int)(cap / small);
    kvt_tier_t *t = mk_shared(cap, 1);
    int fd;
    uint64_t mb, mids[MID];
    cr_assert_eq(kvt_tier_dram_share(t, NS_A, &fd, &mb), 0);
    cr_assert_lt(mb - cap, (uint64_t)MID * mid, "the 1 MiB blocks fit in the untouched rest");
    uint64_t *locs = malloc((size_t)n * sizeof(*locs));
    cr_assert_not_null(locs);
    uint32_t tok[16];
    for (int i = 0; i < n; i++) {
        kvt_block_key_t k = ns_key(NS_A, (uint64_t)i, tok);
        cr_assert_eq(tu_write(t, &k, NULL, small, &locs[i]), 0, "small block %d", i);
    }
    for (int i = 0; i < n; i++)
        kvt_tier_free(t, locs[i], small);
    for (int i = 0; i < MID; i++) {
        kvt_block_key_t k = ns_key(NS_A, (uint64_t)(n + i), tok);
        mids[i] = 0;
        int rc = tu_write(t, &k, NULL, mid, &mids[i]);
        cr_assert_eq(rc, 0, "1 MiB block %d: %d", i, rc);
        cr_expect_eq(kvt_tier_dram_offset(t, NS_A, mids[i], NULL), 0, "it lies in the arena");
    }
    for (int i = 0; i < MID; i++)
        kvt_tier_free(t, mids[i], mid);
    free(locs);
    kvt_tier_destroy(t);
}

/* Namespaces taking turns, each filling most of the capacity then freeing it: the arenas'
 * memory comes within the capacity after each step (at the next tick here; within a second of
 * decay before). */
Test(tier_dram, many_namespaces_filling_and_freeing_stay_within_capacity)
{
    const uint32_t len = 1u << 20;
    enum { N = 12, NS = 6 };
    const uint64_t cap = 16u << 20;
    kvt_tier_t *t = mk_shared(cap, NS);
    int fds[NS];
    uint64_t mb, locs[N];
    for (int k = 0; k < NS; k++)
        cr_assert_eq(kvt_tier_dram_share(t, NS_A + (uint64_t)k, &fds[k], &mb), 0);
    int slow = 0;
    for (int step = 0; step < 2 * NS * 2; step++) {
        int k = (step / 2) % NS;
        if (step % 2 == 0)
            ns_fill(t, NS_A + (uint64_t)k, (uint64_t)step * N, N, len, locs);
        else
            ns_drop(t, N, len, locs);
        uint64_t sum = 0;
        for (int w = 0; w <= 2500; w += 25) {
            kvt_tier_dram_decay(t);
            sum = 0;
            for (int j = 0; j < NS; j++)
                sum += fd_bytes(fds[j]);
            if (sum <= cap)
                break;
            slow = 1;
            usleep(25000);
        }
        cr_assert_leq(sum, cap, "step %d: the arenas hold %llu bytes", step,
                      (unsigned long long)sum);
    }
    cr_log_info("within capacity at the first tick of every step: %s", slow ? "no" : "yes");
    for (int k = 0; k < NS; k++)
        kvt_tier_dram_unshare(t, NS_A + (uint64_t)k);
    cr_assert_eq(kvt_tier_dram_shared(t), 0, "a namespace that goes gives its arena back");
    kvt_tier_destroy(t);
}

/* Over capacity by less than two arenas keep, only the one written or freed in least recently
 * gives its pages back; the other namespace's next blocks still find theirs. */
Test(tier_dram, the_least_recently_used_arena_gives_back_first)
{
    const uint32_t len = 1u << 20;
    enum { N = 10, M = 14 };
    kvt_tier_t *t = mk_shared(32u << 20, 2);
    int fa, fb;
    uint64_t mb, la[N], lb[N], mains[M];
    cr_assert_eq(kvt_tier_dram_share(t, NS_A, &fa, &mb), 0);
    cr_assert_eq(kvt_tier_dram_share(t, NS_B, &fb, &mb), 0);
    ns_fill(t, NS_A, 0, N, len, la);
    ns_fill(t, NS_B, 100, N, len, lb);
    ns_drop(t, N, len, la); /* A: freed first */
    ns_drop(t, N, len, lb);
    kvt_tier_dram_decay(t);
    uint64_t a = fd_bytes(fa), b = fd_bytes(fb);
    cr_assert_geq(a, (uint64_t)N * len);
    cr_assert_geq(b, (uint64_t)N * len);
    ns_fill(t, NS_C, 200, M, len, mains); /* 14 + 20 MiB: 2 over */
    kvt_tier_dram_decay(t);
    cr_expect_lt(fd_bytes(fa), (uint64_t)len, "A, idle longest, gave its pages back");
    cr_expect_eq(fd_bytes(fb), b, "B kept its pages: only A's were needed");
    ns_fill(t, NS_B, 300, N, len, lb);
    cr_expect_eq(fd_bytes(fb), b, "B's next blocks took new memory");
    ns_drop(t, N, len, lb);
    ns_drop(t, M, len, mains);
    kvt_tier_destroy(t);
}

/* An arena nobody references takes no new blocks, so its freed pages are of no use: they go at
 * the next tick, far within capacity, and the whole memfd when its last block goes. */
Test(tier_dram, an_unreferenced_arena_gives_freed_pages_back_at_once)
{
    const uint32_t len = 1u << 20;
    enum { N = 8 };
    kvt_tier_t *t = mk_shared(64u << 20, 1);
    uint64_t locs[N];
    int keep = share_kept(t, NS_A);
    ns_fill(t, NS_A, 0, N, len, locs);
    kvt_tier_dram_unshare(t, NS_A);
    cr_assert_eq(kvt_tier_dram_shared(t), 1, "blocks still live in it");
    ns_drop(t, N - 1, len, locs);
    kvt_tier_dram_decay(t);
    cr_expect_leq(fd_bytes(keep), 2 * (uint64_t)len, "%llu bytes kept for one 1 MiB block",
                  (unsigned long long)fd_bytes(keep));
    kvt_tier_free(t, locs[N - 1], len);
    cr_assert_eq(kvt_tier_dram_shared(t), 0);
    cr_expect_eq(fd_bytes(keep), 0, "the arena's memfd emptied as it went");
    close(keep);
    kvt_tier_destroy(t);
}

/* Destroying the tier with blocks in several shared arenas frees them all (ASan and the fd count
 * say whether anything leaked). */
Test(tier_dram, destroy_frees_blocks_in_every_arena)
{
    long fds_before = 0;
    DIR *dir = opendir("/proc/self/fd");
    cr_assert(dir);
    while (readdir(dir))
        fds_before++;
    closedir(dir);
    kvt_tier_t *t = mk_shared(8u << 20, 3);
    int fd;
    uint64_t mb;
    cr_assert_eq(kvt_tier_dram_share(t, NS_A, &fd, &mb), 0);
    cr_assert_eq(kvt_tier_dram_share(t, NS_B, &fd, &mb), 0);
    cr_assert_eq(kvt_tier_dram_share(t, NS_B, &fd, &mb), 0);
    uint8_t buf[20000];
    tu_fill(buf, sizeof(buf), 1);
    uint32_t tok[16];
    for (int i = 0; i < 12; i++) {
        kvt_block_key_t k = ns_key(i % 3 == 0 ? NS_A : i % 3 == 1 ? NS_B : NS_C, (uint64_t)i, tok);
        cr_assert_eq(tu_write(t, &k, buf, sizeof(buf), NULL), 0);
    }
    kvt_tier_destroy(t);
    long fds_after = 0;
    dir = opendir("/proc/self/fd");
    cr_assert(dir);
    while (readdir(dir))
        fds_after++;
    closedir(dir);
    cr_assert_eq(fds_after, fds_before, "every memfd closed");
}

/* The client maps the whole memfd read-write: whatever it writes there, even where no block of
 * its own lies, must not reach the allocator's metadata (kept out of the memfd) and so cannot
 * break the tier; blocks written after the scribbling read back as written. */
Test(tier_dram, a_client_scribbling_over_its_mapping_cannot_break_the_tier)
{
    kvt_tier_t *t = mk_shared(16u << 20, 1);
    int fd;
    uint64_t mb;
    cr_assert_eq(kvt_tier_dram_share(t, NS_A, &fd, &mb), 0);
    cr_assert_eq(fd_bytes(fd), 0, "no allocator metadata in the memfd");
    uint8_t *c = client_map(fd, mb);
    memset(c, 0xa5, 8u << 20);
    static const uint32_t sizes[] = {100, 5000, 300000, 64, 4096, 1u << 20};
    enum { N = 24 };
    uint64_t locs[N];
    uint32_t tok[16];
    uint8_t *buf = malloc(1u << 20);
    for (int i = 0; i < N; i++) {
        uint32_t len = sizes[i % KVT_ARRAY_LEN(sizes)];
        kvt_block_key_t k = ns_key(NS_A, (uint64_t)i, tok);
        tu_fill(buf, len, (uint64_t)i);
        cr_assert_eq(tu_write(t, &k, buf, len, &locs[i]), 0);
        memset(c, 0x5a, 4096); /* and again, while the arena is busy */
    }
    for (int i = 0; i < N; i++) {
        uint32_t len = sizes[i % KVT_ARRAY_LEN(sizes)];
        kvt_block_key_t k = ns_key(NS_A, (uint64_t)i, tok);
        uint64_t off;
        cr_assert_eq(kvt_tier_dram_offset(t, NS_A, locs[i], &off), 0);
        if (off >= 4096) /* the first page was scribbled over after the write */
            cr_assert(tu_same(c + off, len, (uint64_t)i), "block %d in the client's mapping", i);
        cr_assert_eq(tu_read(t, &k, locs[i], buf, len), 0);
        if (off >= 4096)
            cr_assert(tu_same(buf, len, (uint64_t)i), "block %d read back", i);
    }
    for (int i = 0; i < N; i++)
        kvt_tier_free(t, locs[i], sizes[i % KVT_ARRAY_LEN(sizes)]);
    munmap(c, mb);
    kvt_tier_dram_unshare(t, NS_A);
    cr_assert_eq(kvt_tier_dram_shared(t), 0);
    free(buf);
    kvt_tier_destroy(t);
}

/* ---- what a client can touch (issue 36) ---- */

/* A client makes its whole memfd resident (fallocate): the check punches everything no live
 * block holds, blocks under a page that share pages with others included, and every live block
 * keeps its bytes. The scan's time is logged: its cost, for docs/tiers.md. */
Test(tier_dram, client_touched_pages_are_punched_and_live_blocks_kept)
{
    enum { N = 6000 };
    kvt_tier_t *t = mk_shared(64u << 20, 1);
    int fd;
    uint64_t mb;
    cr_assert_eq(kvt_tier_dram_share(t, NS_A, &fd, &mb), 0);
    static uint64_t locs[N];
    static uint32_t lens[N];
    uint8_t buf[9000], got[9000];
    uint32_t tok[16];
    uint64_t live = 0;
    for (int i = 0; i < N; i++) {
        lens[i] = i % 3 == 0 ? 1000 : i % 3 == 1 ? 4096 : 9000; /* slab-sized and page-sized */
        kvt_block_key_t k = ns_key(NS_A, (uint64_t)i, tok);
        tu_fill(buf, lens[i], (uint32_t)i);
        cr_assert_eq(tu_write(t, &k, buf, lens[i], &locs[i]), 0);
    }
    for (int i = 0; i < N; i += 4)
        kvt_tier_free(t, locs[i], lens[i]);
    for (int i = 0; i < N; i++)
        if (i % 4)
            live += (lens[i] + 4095) & ~4095u;
    uint8_t *m = client_map(fd, mb);
    cr_assert_eq(fallocate(fd, 0, 0, (off_t)mb), 0, "fallocate: %s", strerror(errno));
    cr_assert_geq(fd_bytes(fd), mb - (1u << 20));
    cr_assert_eq(kvt_tier_dram_scan(t), 0);
    kvt_tier_dram_shared_stats_t st;
    cr_assert_eq(kvt_tier_dram_shared_stats(t, &st), 0);
    cr_assert_eq(st.arenas, 1);
    cr_assert_eq(st.scans, 1);
    cr_expect_leq(fd_bytes(fd), live, "%llu bytes resident for %llu of live blocks' pages",
                  (unsigned long long)fd_bytes(fd), (unsigned long long)live);
    cr_expect_eq(st.resident_bytes, fd_bytes(fd));
    cr_expect_geq(st.punched_bytes, mb - live - (1u << 20));
    cr_log_info("scan of a %llu-byte memfd holding %d blocks: %.3f ms", (unsigned long long)mb,
                N - N / 4, (double)st.scan_ns / 1e6);
    for (int i = 0; i < N; i++) {
        if (i % 4 == 0)
            continue;
        kvt_block_key_t k = ns_key(NS_A, (uint64_t)i, tok);
        tu_fill(buf, lens[i], (uint32_t)i);
        cr_assert_eq(tu_read(t, &k, locs[i], got, lens[i]), 0);
        cr_assert(memcmp(got, buf, lens[i]) == 0, "block %d (%u bytes) lost its bytes", i, lens[i]);
    }
    /* Nothing touched since: the next check does not scan. */
    uint64_t scan_ns = st.scan_ns;
    cr_assert_eq(kvt_tier_dram_scan(t), 0);
    cr_assert_eq(kvt_tier_dram_shared_stats(t, &st), 0);
    cr_expect_eq(st.scans, 1, "an arena holding only its blocks was scanned");
    cr_log_info("a check that finds nothing to scan: %.3f ms",
                (double)(st.scan_ns - scan_ns) / 1e6);
    munmap(m, mb);
    kvt_tier_destroy(t);
}

/* An orphan (an expired reservation's room) no longer counts in the capacity and holds no
 * memory, whatever the client writes there, but no other block is placed in it until it is
 * freed. */
Test(tier_dram, an_orphan_keeps_its_room_but_not_its_charge_or_memory)
{
    const uint32_t len = 65536;
    kvt_tier_t *t = mk_shared(8u << 20, 1);
    int fd;
    uint64_t mb, off, loc = 0, other = 0;
    cr_assert_eq(kvt_tier_dram_share(t, NS_A, &fd, &mb), 0);
    uint8_t *m = client_map(fd, mb);
    uint32_t tok[16];
    kvt_block_key_t k = ns_key(NS_A, 1, tok);
    cr_assert_eq(tu_write(t, &k, NULL, len, &loc), 0);
    cr_assert_eq(kvt_tier_dram_offset(t, NS_A, loc, &off), 0);
    memset(m + off, 0x11, len); /* the client fills it */
    kvt_tier_usage_t u;
    kvt_tier_usage(t, &u);
    cr_assert_eq(u.used_bytes, len);
    cr_assert_eq(kvt_tier_dram_orphan(t, loc, len + 1), KVT_ENOENT);
    cr_assert_eq(kvt_tier_dram_orphan(t, loc, len), 0);
    kvt_tier_usage(t, &u);
    cr_expect(u.used_bytes == 0 && u.blocks == 0, "an orphan still counts");
    cr_expect_lt(fd_bytes(fd), len, "an orphan's pages were not punched");
    cr_assert_eq(kvt_tier_dram_orphan(t, loc, len), KVT_ENOENT, "orphaned twice");
    /* Its room is kept: a new block lies elsewhere. */
    kvt_block_key_t k2 = ns_key(NS_A, 2, tok);
    uint8_t buf[65536];
    tu_fill(buf, len, 5);
    cr_assert_eq(tu_write(t, &k2, buf, len, &other), 0);
    cr_expect(other + len <= loc || other >= loc + len, "a block was placed in an orphan");
    /* The slow client writes late: punched again by the next check. */
    memset(m + off, 0x22, len);
    cr_assert_geq(fd_bytes(fd), 2 * (uint64_t)len);
    cr_assert_eq(kvt_tier_dram_scan(t), 0);
    cr_expect_leq(fd_bytes(fd), len, "a late write into an orphan stayed resident");
    uint8_t got[65536];
    cr_assert_eq(tu_read(t, &k2, other, got, len), 0);
    cr_expect(memcmp(got, buf, len) == 0);
    /* Freed: the arena goes with it once unshared and empty. */
    kvt_tier_dram_orphan_free(t, loc, len);
    kvt_tier_free(t, other, len);
    kvt_tier_dram_unshare(t, NS_A);
    cr_expect_eq(kvt_tier_dram_shared(t), 0, "an orphan freed is still counted in its arena");
    munmap(m, mb);
    kvt_tier_destroy(t);
}

/* An arena nobody shares gives way: its blocks move to the main region with their bytes and
 * charge, and the arena (its slot) goes with the last of them. */
Test(tier_dram, an_unshared_arena_s_blocks_move_out)
{
    const uint32_t len = 50000;
    kvt_tier_t *t = mk_shared(8u << 20, 1);
    int fd;
    uint64_t mb, off, loc[3], seed;
    cr_assert_eq(kvt_tier_dram_idle(t, &seed), KVT_ENOENT);
    cr_assert_eq(kvt_tier_dram_share(t, NS_A, &fd, &mb), 0);
    uint8_t buf[50000], got[50000];
    uint32_t tok[16];
    for (int i = 0; i < 3; i++) {
        kvt_block_key_t k = ns_key(NS_A, (uint64_t)i, tok);
        tu_fill(buf, len, 40 + (uint32_t)i);
        cr_assert_eq(tu_write(t, &k, buf, len, &loc[i]), 0);
    }
    cr_assert_eq(kvt_tier_dram_idle(t, &seed), KVT_ENOENT, "a shared arena is not idle");
    uint64_t l0 = loc[0];
    cr_assert_eq(kvt_tier_dram_move_out(t, &l0), KVT_EBUSY);
    kvt_tier_dram_unshare(t, NS_A);
    cr_assert_eq(kvt_tier_dram_idle(t, &seed), 0);
    cr_assert_eq(seed, NS_A);
    kvt_tier_usage_t before, after;
    kvt_tier_usage(t, &before);
    for (int i = 0; i < 3; i++) {
        uint64_t was = loc[i];
        cr_assert_eq(kvt_tier_dram_move_out(t, &loc[i]), 0);
        cr_assert_neq(loc[i], was);
        cr_assert_eq(kvt_tier_dram_offset(t, NS_A, loc[i], &off), KVT_ENOENT);
        cr_assert_eq(kvt_tier_dram_shared(t), i < 2 ? 1u : 0u);
    }
    kvt_tier_usage(t, &after);
    cr_expect(after.used_bytes == before.used_bytes && after.blocks == before.blocks);
    for (int i = 0; i < 3; i++) {
        kvt_block_key_t k = ns_key(NS_A, (uint64_t)i, tok);
        tu_fill(buf, len, 40 + (uint32_t)i);
        cr_assert_eq(tu_read(t, &k, loc[i], got, len), 0);
        cr_expect(memcmp(got, buf, len) == 0, "block %d moved wrong", i);
        kvt_tier_free(t, loc[i], len);
    }
    kvt_tier_usage(t, &after);
    cr_expect_eq(after.used_bytes, 0);
    cr_assert_eq(kvt_tier_dram_move_out(t, &l0), KVT_ENOENT);
    kvt_tier_destroy(t);
}

/* Seals (issue 36): a sealed block checks out until its bytes change, then fails the check and
 * the read, counted; a seal taken a step at a time covers the bytes as they were at its last
 * step, is finished by a departure that comes first, skips a block freed meanwhile, and
 * follows a block that moves out of its arena. */
Test(tier_dram, seals_find_bytes_changed_after_them)
{
    const uint32_t len = 600000; /* three slices of 256 KiB */
    kvt_tier_t *t = mk_shared(8u << 20, 1);
    int fd;
    uint64_t mb, off, loc[4];
    cr_assert_eq(kvt_tier_dram_share(t, NS_A, &fd, &mb), 0);
    uint8_t *c = client_map(fd, mb);
    uint8_t *buf = malloc(len);
    uint32_t tok[16];
    for (int i = 0; i < 4; i++) {
        kvt_block_key_t k = ns_key(NS_A, (uint64_t)i, tok);
        tu_fill(buf, len, 60 + (uint32_t)i);
        cr_assert_eq(tu_write(t, &k, buf, len, &loc[i]), 0);
    }
    kvt_tier_dram_shared_stats_t st;
    /* Unsealed: anything goes. */
    cr_assert_eq(kvt_tier_dram_offset(t, NS_A, loc[0], &off), 0);
    c[off] ^= 1;
    cr_expect_eq(kvt_tier_dram_check(t, loc[0]), 0);
    c[off] ^= 1;
    /* Sealed now. */
    cr_assert_eq(kvt_tier_dram_seal(t, loc[0]), 0);
    cr_expect_eq(kvt_tier_dram_check(t, loc[0]), 0);
    c[off + len - 1] ^= 0x80;
    cr_expect_eq(kvt_tier_dram_check(t, loc[0]), KVT_ECORRUPT);
    kvt_block_key_t k0 = ns_key(NS_A, 0, tok);
    cr_expect_eq(tu_read(t, &k0, loc[0], buf, len), KVT_ECORRUPT);
    cr_assert_eq(kvt_tier_dram_shared_stats(t, &st), 0);
    cr_expect_eq(st.scribbles, 2);
    /* Sealed a slice at a time: a change made after the last slice is found. */
    cr_assert_eq(kvt_tier_dram_seal_later(t, loc[1]), 0);
    cr_assert_eq(kvt_tier_dram_seal_later(t, loc[2]), 0);
    cr_assert_eq(kvt_tier_dram_seal_later(t, loc[3]), 0);
    cr_expect_eq(kvt_tier_dram_seal_step(t, 256u << 10), 3, "one slice seals no block");
    cr_expect_eq(kvt_tier_dram_seal_step(t, len), 2, "the first block is sealed");
    cr_assert_eq(kvt_tier_dram_offset(t, NS_A, loc[1], &off), 0);
    c[off + 12345] ^= 1;
    cr_expect_eq(kvt_tier_dram_check(t, loc[1]), KVT_ECORRUPT);
    /* A departure before its seal's turn finishes it: the bytes leave as they are. */
    cr_assert_eq(kvt_tier_dram_offset(t, NS_A, loc[2], &off), 0);
    c[off] ^= 1;
    cr_expect_eq(kvt_tier_dram_check(t, loc[2]), 0);
    c[off + 1] ^= 1;
    cr_expect_eq(kvt_tier_dram_check(t, loc[2]), KVT_ECORRUPT);
    /* A block freed while queued is passed over. */
    kvt_tier_free(t, loc[3], len);
    cr_expect_eq(kvt_tier_dram_seal_step(t, len), 0);
    cr_assert_eq(kvt_tier_dram_shared_stats(t, &st), 0);
    cr_expect_eq(st.scribbles, 4);
    /* The seal moves with its block. */
    kvt_block_key_t k = ns_key(NS_A, 9, tok);
    uint64_t l = 0;
    tu_fill(buf, len, 70);
    cr_assert_eq(tu_write(t, &k, buf, len, &l), 0);
    cr_assert_eq(kvt_tier_dram_seal_later(t, l), 0);
    for (int i = 0; i < 3; i++)
        kvt_tier_free(t, loc[i], len);
    kvt_tier_dram_unshare(t, NS_A);
    cr_assert_eq(kvt_tier_dram_move_out(t, &l), 0);
    cr_expect_eq(kvt_tier_dram_seal_step(t, len), 0, "the queued seal named the old address");
    cr_expect_eq(kvt_tier_dram_check(t, l), 0);
    ((uint8_t *)kvt_tier_ptr(t, l))[100] ^= 1;
    cr_expect_eq(kvt_tier_dram_check(t, l), KVT_ECORRUPT, "the seal did not follow the block");
    /* Bad input. */
    cr_expect_eq(kvt_tier_dram_seal(t, 12345), KVT_ENOENT);
    cr_expect_eq(kvt_tier_dram_check(t, 12345), KVT_ENOENT);
    cr_expect_eq(kvt_tier_dram_seal_later(NULL, l), KVT_EINVAL);
    kvt_tier_free(t, l, len);
    munmap(c, mb);
    free(buf);
    kvt_tier_destroy(t);
}

/* Seals given by the caller (a client's sums with COMMIT): recorded without reading the block,
 * checked as the tier's own; a wrong one fails the first check and the read, counted as a
 * scribble; one given while the tier's own seal of the block is queued replaces it. */
Test(tier_dram, seals_given_by_the_caller)
{
    const uint32_t len = 300000;
    kvt_tier_t *t = mk_shared(8u << 20, 1);
    int fd;
    uint64_t mb, off, loc[3];
    cr_assert_eq(kvt_tier_dram_share(t, NS_A, &fd, &mb), 0);
    uint8_t *c = client_map(fd, mb);
    uint8_t *buf = malloc(len);
    uint32_t tok[16];
    uint64_t sum[3];
    for (int i = 0; i < 3; i++) {
        kvt_block_key_t k = ns_key(NS_A, 20 + (uint64_t)i, tok);
        tu_fill(buf, len, 80 + (uint32_t)i);
        sum[i] = XXH3_64bits(buf, len);
        cr_assert_eq(tu_write(t, &k, buf, len, &loc[i]), 0);
    }
    /* A right sum: checks out until the bytes change. */
    cr_assert_eq(kvt_tier_dram_seal_as(t, loc[0], sum[0]), 0);
    cr_expect_eq(kvt_tier_dram_check(t, loc[0]), 0);
    cr_assert_eq(kvt_tier_dram_offset(t, NS_A, loc[0], &off), 0);
    c[off + 777] ^= 4;
    cr_expect_eq(kvt_tier_dram_check(t, loc[0]), KVT_ECORRUPT);
    /* A wrong sum: the unchanged block fails, its read too. */
    cr_assert_eq(kvt_tier_dram_seal_as(t, loc[1], sum[1] ^ 1), 0);
    cr_expect_eq(kvt_tier_dram_check(t, loc[1]), KVT_ECORRUPT);
    kvt_block_key_t k1 = ns_key(NS_A, 21, tok);
    cr_expect_eq(tu_read(t, &k1, loc[1], buf, len), KVT_ECORRUPT);
    /* Given while the tier's own seal is queued: the queued one is passed over. */
    cr_assert_eq(kvt_tier_dram_seal_later(t, loc[2]), 0);
    cr_assert_eq(kvt_tier_dram_seal_as(t, loc[2], sum[2]), 0);
    cr_expect_eq(kvt_tier_dram_seal_step(t, len), 0);
    cr_expect_eq(kvt_tier_dram_check(t, loc[2]), 0);
    kvt_tier_dram_shared_stats_t st;
    cr_assert_eq(kvt_tier_dram_shared_stats(t, &st), 0);
    cr_expect_eq(st.scribbles, 3);
    cr_expect_eq(st.sealed_as, 3);
    cr_expect_eq(st.sealed, 0, "the tier hashed a block it was given the sum of");
    /* Bad input. */
    cr_expect_eq(kvt_tier_dram_seal_as(t, 12345, 1), KVT_ENOENT);
    cr_expect_eq(kvt_tier_dram_seal_as(NULL, loc[2], 1), KVT_EINVAL);
    for (int i = 0; i < 3; i++)
        kvt_tier_free(t, loc[i], len);
    munmap(c, mb);
    free(buf);
    kvt_tier_destroy(t);
}

/* Quotas per namespace (issue 36): a namespace stops at its quota whatever room the tier has,
 * writes and copies alike, while another still writes; frees give its room back; the counts
 * per namespace are exact and ns_top lists the largest first. */
Test(tier_dram, a_namespace_stops_at_its_quota)
{
    const uint32_t len = 65536;
    kvt_tier_t *t = mk(8u << 20), *t2 = mk(8u << 20);
    cr_assert_eq(kvt_tier_set_ns_quota(t, 4 * (uint64_t)len), 0);
    cr_assert_eq(kvt_tier_set_ns_quota(NULL, 1), KVT_EINVAL);
    uint8_t *buf = malloc(len);
    tu_fill(buf, len, 3);
    uint32_t tok[16];
    uint64_t loc[8] = {0};
    for (int i = 0; i < 4; i++) {
        kvt_block_key_t k = ns_key(NS_A, (uint64_t)i, tok);
        cr_assert_eq(tu_write(t, &k, buf, len, &loc[i]), 0);
    }
    cr_expect_eq(kvt_tier_ns_used(t, NS_A), 4 * (uint64_t)len);
    cr_expect_eq(kvt_tier_ns_fits(t, NS_A, len, 1), 0);
    cr_expect_eq(kvt_tier_ns_fits(t, NS_B, len, 4), 1);
    cr_expect_eq(kvt_tier_ns_fits(t, NS_B, len, 5), 0);
    kvt_block_key_t k4 = ns_key(NS_A, 4, tok);
    cr_expect_eq(tu_write(t, &k4, buf, len, &loc[4]), KVT_ENOSPC, "past the quota");
    /* A copy into t is held to it too. */
    kvt_block_key_t k5 = ns_key(NS_A, 5, tok);
    uint64_t src = 0;
    cr_assert_eq(tu_write(t2, &k5, buf, len, &src), 0);
    kvt_tier_copy_t c = {.src = t2, .dst = t, .src_loc = src, .key = k5, .len = len};
    cr_expect_eq(kvt_tier_copy(&c), KVT_ENOSPC);
    kvt_tier_usage_t u;
    kvt_tier_usage(t, &u);
    cr_expect_eq(u.quota_refused, 4, "a write, a copy and two ns_fits refused");
    cr_expect_eq(u.used_bytes, 4 * (uint64_t)len, "nothing charged for the refusals");
    /* Another namespace still writes. */
    kvt_block_key_t kb = ns_key(NS_B, 6, tok);
    cr_assert_eq(tu_write(t, &kb, buf, len, &loc[5]), 0);
    kvt_tier_ns_usage_t top[4];
    cr_assert_eq(kvt_tier_ns_top(t, top, 4), 2);
    cr_expect(top[0].ns_seed == NS_A && top[0].bytes == 4 * (uint64_t)len);
    cr_expect(top[1].ns_seed == NS_B && top[1].bytes == len);
    cr_assert_eq(kvt_tier_ns_top(t, top, 1), 1);
    cr_expect_eq(top[0].ns_seed, NS_A);
    /* A free gives room back. */
    kvt_tier_free(t, loc[0], len);
    cr_expect_eq(kvt_tier_ns_used(t, NS_A), 3 * (uint64_t)len);
    cr_expect_eq(tu_write(t, &k4, buf, len, &loc[4]), 0);
    /* No quota: anything the capacity takes. */
    cr_assert_eq(kvt_tier_set_ns_quota(t, 0), 0);
    kvt_block_key_t k7 = ns_key(NS_A, 7, tok);
    cr_expect_eq(tu_write(t, &k7, buf, len, &loc[6]), 0);
    cr_expect_eq(kvt_tier_ns_used(t, NS_A), 5 * (uint64_t)len);
    for (int i = 1; i < 7; i++)
        kvt_tier_free(t, loc[i], len);
    cr_expect_eq(kvt_tier_ns_used(t, NS_A), 0);
    cr_expect_eq(kvt_tier_ns_top(t, top, 4), 0, "a namespace holding nothing is not listed");
    free(buf);
    kvt_tier_destroy(t2);
    kvt_tier_destroy(t);
}
