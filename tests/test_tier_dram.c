/*
 * test_tier_dram.c: the DRAM tier through the public tier interface: round trips of many sizes,
 * capacity exhaustion, free and reuse, requests in flight together, exact byte accounting
 * against jemalloc's own statistics, bad input, and a randomized run against a reference model
 * (which also exercises tier.c's location index).
 */
#include <jemalloc/jemalloc.h>
#include <poll.h>

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
    io.buf = NULL;
    cr_assert_eq(kvt_tier_write(t, &io), KVT_EINVAL);
    io.buf = buf;
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
