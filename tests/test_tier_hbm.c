/*
 * test_tier_hbm.c: the HBM tier. The `host` backend (ordinary memory, chosen explicitly) runs
 * everywhere: round trips, slot rounding, capacity exhaustion, fragmentation of the slot pool,
 * free and reuse, requests in flight, and the grouping of requests into batches (the same code
 * for both backends: requests queued together go out as one batch). The `cuda` backend needs a
 * usable GPU: without one its creation must fail with KVT_EUNAVAIL (tested here), and the tests
 * that move bytes through the device are skipped, not passed, with the reason on stderr too
 * (Criterion prints it only with --verbose).
 */
#include "test_tier_util.h"

#include <poll.h>

#include "config.h" /* KVT_HAVE_CUDA */

static void skip_no_gpu(const char *why)
{
    fprintf(stderr, "SKIP %s::%s: %s\n", criterion_current_test->category,
            criterion_current_test->name, why);
    cr_skip_test("%s", why);
}

/* Block i's completion order, for tests of the order batches go out in. */
typedef struct order {
    int done;
    int seq[256];
    kvt_tier_io_t *base;
} order_t;

static void order_cb(kvt_tier_io_t *io)
{
    order_t *o = io->data;
    o->seq[io - o->base] = o->done++;
}

static kvt_tier_hbm_stats_t stats(kvt_tier_t *t)
{
    kvt_tier_hbm_stats_t st;
    cr_assert_eq(kvt_tier_hbm_stats(t, &st), 0);
    return st;
}

static int fd_readable(kvt_tier_t *t)
{
    struct pollfd pf = {.fd = kvt_tier_fd(t), .events = POLLIN};
    return poll(&pf, 1, 0) == 1;
}

static kvt_tier_t *mk_host(uint64_t cap, uint32_t slot)
{
    kvt_tier_t *t = NULL;
    kvt_tier_hbm_conf_t c = {.backend = "host", .capacity_bytes = cap, .slot_bytes = slot};
    cr_assert_eq(kvt_tier_hbm_create(&t, &c), 0);
    cr_assert_eq(kvt_tier_kind(t), KVT_TIER_HBM);
    cr_assert_str_eq(kvt_tier_backend(t), "host");
    return t;
}

Test(tier_hbm, host_round_trips_of_varied_sizes)
{
    kvt_tier_t *t = mk_host(64u << 20, 64u << 10);
    static const uint32_t sizes[] = {1, 4096, 65535, 65536, 65537, 256u << 10, 2u << 20, 3000001};
    uint32_t tok[16];
    uint64_t locs[KVT_ARRAY_LEN(sizes)];
    for (size_t i = 0; i < KVT_ARRAY_LEN(sizes); i++) {
        kvt_block_key_t k = tu_key(i, tok, 16);
        uint8_t *buf = malloc(sizes[i]);
        tu_fill(buf, sizes[i], i);
        cr_assert_eq(tu_write(t, &k, buf, sizes[i], &locs[i]), 0);
        cr_assert_eq(kvt_tier_hbm_devptr(t, locs[i]), kvt_tier_ptr(t, locs[i]));
        memset(buf, 0, sizes[i]);
        cr_assert_eq(tu_read(t, &k, locs[i], buf, sizes[i]), 0);
        cr_assert(tu_same(buf, sizes[i], i));
        cr_assert_eq(kvt_tier_footprint(t, sizes[i]),
                     ((uint64_t)sizes[i] + (64u << 10) - 1) / (64u << 10) * (64u << 10),
                     "a block takes whole slots");
        free(buf);
    }
    for (size_t i = 0; i < KVT_ARRAY_LEN(sizes); i++) {
        kvt_block_key_t k = tu_key(i, tok, 16);
        cr_assert(tu_same(kvt_tier_ptr(t, locs[i]), sizes[i], i), "block %zu untouched", i);
        cr_assert_eq(kvt_tier_valid(t, locs[i], &k), 1);
        kvt_tier_free(t, locs[i], sizes[i]);
        cr_assert_eq(kvt_tier_valid(t, locs[i], &k), 0);
        cr_assert_null(kvt_tier_hbm_devptr(t, locs[i]));
    }
    kvt_tier_usage_t u;
    kvt_tier_usage(t, &u);
    cr_assert_eq(u.used_bytes, 0);
    cr_assert_eq(u.blocks, 0);
    kvt_tier_destroy(t);
}

Test(tier_hbm, host_capacity_exhaustion_and_reuse)
{
    kvt_tier_t *t = mk_host(4u << 20, 64u << 10);
    const uint32_t len = (256u << 10) + 1; /* five slots */
    uint8_t *buf = malloc(len);
    tu_fill(buf, len, 1);
    uint32_t tok[16];
    uint64_t locs[32];
    int n = 0;
    for (;; n++) {
        kvt_block_key_t k = tu_key((uint64_t)n, tok, 16);
        kvt_tier_usage_t before, after;
        kvt_tier_usage(t, &before);
        int rc = tu_write(t, &k, buf, len, &locs[n]);
        kvt_tier_usage(t, &after);
        if (rc != 0) {
            cr_assert_eq(rc, KVT_ENOSPC);
            cr_assert_eq(after.used_bytes, before.used_bytes);
            cr_assert_eq(after.blocks, before.blocks);
            break;
        }
    }
    cr_assert_eq(n, 64 / 5, "64 slots hold 12 blocks of 5 slots (got %d)", n);
    for (int round = 0; round < 50; round++) {
        int i = round % n;
        kvt_tier_free(t, locs[i], len);
        kvt_block_key_t k = tu_key((uint64_t)(100 + round), tok, 16);
        cr_assert_eq(tu_write(t, &k, buf, len, &locs[i]), 0, "round %d", round);
    }
    free(buf);
    kvt_tier_destroy(t);
}

Test(tier_hbm, host_fragmented_pool_refuses_what_does_not_fit_contiguously)
{
    kvt_tier_t *t = mk_host(1u << 20, 64u << 10); /* 16 slots */
    uint8_t buf[64u << 10];
    uint32_t tok[16];
    uint64_t locs[16];
    for (int i = 0; i < 16; i++) {
        kvt_block_key_t k = tu_key((uint64_t)i, tok, 16);
        cr_assert_eq(tu_write(t, &k, buf, sizeof(buf), &locs[i]), 0);
    }
    for (int i = 0; i < 16; i += 2)
        kvt_tier_free(t, locs[i], sizeof(buf));
    /* Half the pool is free, but no two free slots touch. */
    uint8_t *big = malloc(128u << 10);
    kvt_block_key_t k = tu_key(99, tok, 16);
    kvt_tier_usage_t before, after;
    kvt_tier_usage(t, &before);
    cr_assert_eq(tu_write(t, &k, big, 128u << 10, NULL), KVT_ENOSPC);
    kvt_tier_usage(t, &after);
    cr_assert_eq(after.used_bytes, before.used_bytes);
    kvt_tier_free(t, locs[1], sizeof(buf)); /* slots 0..2 free now */
    uint64_t loc = 0;
    cr_assert_eq(tu_write(t, &k, big, 128u << 10, &loc), 0);
    free(big);
    kvt_tier_destroy(t);
}

Test(tier_hbm, host_many_requests_in_flight)
{
    enum { N = 128, LEN = 100000 };
    kvt_tier_t *t = mk_host(64u << 20, 0);
    static kvt_tier_io_t ios[N];
    static uint32_t toks[N][16];
    uint8_t *bufs = malloc((size_t)N * LEN);
    int done = 0;
    tu_write_burst(t, ios, toks, bufs, N, LEN, 0, &done);
    cr_assert_eq(done, 0);
    cr_assert(tu_drive(t, &done, N));
    memset(bufs, 0, (size_t)N * LEN);
    done = 0;
    for (int i = 0; i < N; i++)
        cr_assert_eq(kvt_tier_read(t, &ios[i]), 0);
    cr_assert(tu_drive(t, &done, N));
    for (int i = 0; i < N; i++)
        cr_assert(tu_same(bufs + (size_t)i * LEN, LEN, (uint64_t)i));
    free(bufs);
    kvt_tier_destroy(t);
}

Test(tier_hbm, bad_configuration_is_refused)
{
    kvt_tier_t *t = NULL;
    kvt_tier_hbm_conf_t c = {.backend = "tpu", .capacity_bytes = 1u << 20};
    cr_assert_eq(kvt_tier_hbm_create(&t, &c), KVT_EINVAL);
    c = (kvt_tier_hbm_conf_t){.backend = "host", .capacity_bytes = 1u << 20, .slot_bytes = 3000};
    cr_assert_eq(kvt_tier_hbm_create(&t, &c), KVT_EINVAL);
    c = (kvt_tier_hbm_conf_t){.backend = "host", .capacity_bytes = 1000};
    cr_assert_eq(kvt_tier_hbm_create(&t, &c), KVT_EINVAL, "less than one slot");
    c = (kvt_tier_hbm_conf_t){.backend = "host", .capacity_bytes = 1u << 20, .streams = 99};
    cr_assert_eq(kvt_tier_hbm_create(&t, &c), KVT_EINVAL);
    cr_assert_eq(kvt_tier_hbm_create(NULL, &c), KVT_EINVAL);
}

Test(tier_hbm, requests_queued_together_go_out_as_one_batch)
{
    enum { N = 40, LEN = 100000 };
    kvt_tier_t *t = NULL;
    kvt_tier_hbm_conf_t c = {.backend = "host", .capacity_bytes = 64u << 20, .batch = 16};
    cr_assert_eq(kvt_tier_hbm_create(&t, &c), 0);
    static kvt_tier_io_t ios[N];
    static uint32_t toks[N][16];
    uint8_t *bufs = malloc((size_t)N * LEN);
    int done = 0;
    /* Ten writes in one turn: queued, nothing copied yet, and the fd says so to the loop. */
    tu_write_burst(t, ios, toks, bufs, 10, LEN, 0, &done);
    kvt_tier_hbm_stats_t st = stats(t);
    cr_assert_eq(st.batches, 0, "queued, not yet sent");
    cr_assert_eq(st.batch_max, 16);
    cr_assert_str_eq(st.api, "memcpy");
    cr_assert(fd_readable(t), "a queued request makes the tier's fd readable");
    cr_assert(tu_drive(t, &done, 10));
    st = stats(t);
    cr_assert_eq(st.batches, 1, "ten writes queued together: one batch (%llu)",
                 (unsigned long long)st.batches);
    cr_assert_eq(st.copies, 10);
    cr_assert_eq(st.largest, 10);
    for (int i = 0; i < 10; i++) {
        cr_assert_eq(ios[i].status, 0);
        cr_assert(tu_same(kvt_tier_ptr(t, ios[i].loc), LEN, (uint64_t)i), "block %d", i);
    }
    /* Their reads, queued together: one more batch, every callback run, byte-exact. */
    memset(bufs, 0, (size_t)N * LEN);
    done = 0;
    for (int i = 0; i < 10; i++)
        cr_assert_eq(kvt_tier_read(t, &ios[i]), 0);
    cr_assert(tu_drive(t, &done, 10));
    st = stats(t);
    cr_assert_eq(st.batches, 2);
    cr_assert_eq(st.copies, 20);
    for (int i = 0; i < 10; i++)
        cr_assert(tu_same(bufs + (size_t)i * LEN, LEN, (uint64_t)i), "read %d", i);
    for (int i = 0; i < 10; i++)
        kvt_tier_free(t, ios[i].loc, LEN);
    /* Forty at once: each full batch of 16 goes out as it fills, the last 8 on the next
     * process; no callback runs inside a submit. */
    done = 0;
    tu_write_burst(t, ios, toks, bufs, N, LEN, 100, &done);
    cr_assert_eq(done, 0);
    cr_assert_eq(stats(t).batches, 4, "two full batches went out at once");
    cr_assert(tu_drive(t, &done, N));
    st = stats(t);
    cr_assert_eq(st.batches, 5);
    cr_assert_eq(st.copies, 20 + N);
    cr_assert_eq(st.largest, 16);
    memset(bufs, 0, (size_t)N * LEN);
    done = 0;
    for (int i = 0; i < N; i++)
        cr_assert_eq(kvt_tier_read(t, &ios[i]), 0);
    cr_assert(tu_drive(t, &done, N));
    for (int i = 0; i < N; i++) {
        cr_assert_eq(ios[i].status, 0);
        cr_assert(tu_same(bufs + (size_t)i * LEN, LEN, 100 + (uint64_t)i), "read %d", i);
    }
    free(bufs);
    kvt_tier_destroy(t);
}

Test(tier_hbm, batch_of_one_sends_each_copy_at_once)
{
    enum { N = 5, LEN = 4096 };
    kvt_tier_t *t = NULL;
    kvt_tier_hbm_conf_t c = {.backend = "host", .capacity_bytes = 1u << 20, .batch = 1};
    cr_assert_eq(kvt_tier_hbm_create(&t, &c), 0);
    static kvt_tier_io_t ios[N];
    static uint32_t toks[N][16];
    uint8_t bufs[N * LEN];
    int done = 0;
    tu_write_burst(t, ios, toks, bufs, N, LEN, 7, &done);
    cr_assert_eq(stats(t).batches, N, "each write went out as it was submitted");
    cr_assert_eq(done, 0, "but its callback waits for kvt_tier_process");
    cr_assert(tu_drive(t, &done, N));
    cr_assert_eq(stats(t).largest, 1);
    kvt_tier_destroy(t);
    c.batch = 257;
    cr_assert_eq(kvt_tier_hbm_create(&t, &c), KVT_EINVAL, "at most 256 copies a batch");
}

Test(tier_hbm, queued_reads_go_out_before_the_writes_after_them)
{
    /* A read queued, its block freed and its slots written again in the same turn: the read
     * still gets the bytes it was submitted for, and its callback comes first. The pool has
     * four slots, all taken, so the new write can only land in the freed one. */
    enum { LEN = 64u << 10 };
    kvt_tier_t *t = NULL;
    kvt_tier_hbm_conf_t c = {
        .backend = "host", .capacity_bytes = 4 * LEN, .slot_bytes = LEN, .batch = 4};
    cr_assert_eq(kvt_tier_hbm_create(&t, &c), 0);
    static uint8_t buf[LEN], got[LEN], fresh[4][LEN];
    uint32_t tok[16];
    uint64_t locs[4];
    tu_write_n(t, 4, buf, LEN, tok, locs);
    static kvt_tier_io_t ios[5];
    static uint32_t toks[5][16];
    order_t o = {.base = ios};
    ios[0] = (kvt_tier_io_t){.key = tu_key(0, toks[0], 16),
                             .loc = locs[0],
                             .buf = got,
                             .len = LEN,
                             .cb = order_cb,
                             .data = &o};
    cr_assert_eq(kvt_tier_read(t, &ios[0]), 0);
    kvt_tier_free(t, locs[0], LEN);
    /* A write in the same turn takes block 0's slot; both go out on the next process. */
    tu_fill(fresh[0], LEN, 99);
    ios[1] = (kvt_tier_io_t){
        .key = tu_key(50, toks[1], 16), .buf = fresh[0], .len = LEN, .cb = order_cb, .data = &o};
    cr_assert_eq(kvt_tier_write(t, &ios[1]), 0);
    cr_assert_eq(ios[1].loc, locs[0], "the only free slot is the one just freed");
    cr_assert(tu_drive(t, &o.done, 2));
    cr_assert(tu_same(got, LEN, 0), "the read got the bytes it was submitted for");
    cr_assert_lt(o.seq[0], o.seq[1], "the queued read completed first");
    cr_assert(tu_same(kvt_tier_ptr(t, ios[1].loc), LEN, 99));
    kvt_tier_destroy(t);
}

/* The first NVIDIA GPU the driver lists (its /proc entry), or "" when the machine shows none. */
static void gpu_listed(char *out, size_t cap)
{
    out[0] = 0;
    DIR *d = opendir("/proc/driver/nvidia/gpus");
    if (!d) {
        if (access("/dev/nvidia0", F_OK) == 0)
            snprintf(out, cap, "/dev/nvidia0");
        return;
    }
    struct dirent *e;
    while ((e = readdir(d)))
        if (e->d_name[0] != '.') {
            snprintf(out, cap, "/proc/driver/nvidia/gpus/%s", e->d_name);
            break;
        }
    closedir(d);
}

Test(tier_hbm, a_gpu_the_machine_has_is_usable)
{
    /* On a GPU host the cuda tests must run, not skip: a build without CUDA, or a runtime that
     * cannot see the device, fails here (this was scripts/gpu-check.sh's job). */
    char gpu[300];
    gpu_listed(gpu, sizeof gpu);
    if (!gpu[0])
        skip_no_gpu("this machine shows no NVIDIA GPU (/proc/driver/nvidia/gpus, /dev/nvidia0)");
    cr_assert(KVT_HAVE_CUDA, "this machine has a GPU (%s) but the build has no CUDA", gpu);
    if (!kvt_tier_cuda_usable()) {
        kvt_tier_t *t = NULL;
        kvt_tier_hbm_conf_t c = {.backend = "cuda", .capacity_bytes = 1u << 20};
        (void)kvt_tier_hbm_create(&t, &c); /* logs cudaGetDeviceCount's error */
        cr_assert_fail("this machine has a GPU (%s) but CUDA cannot use it (the log line above "
                       "says why)",
                       gpu);
    }
}

Test(tier_hbm, cuda_without_a_usable_gpu_is_unavailable)
{
    if (kvt_tier_cuda_usable())
        skip_no_gpu("a GPU is usable here: the no-GPU path is not reachable");
    const char *names[] = {"cuda", "auto", NULL};
    for (int i = 0; i < 3; i++) {
        kvt_tier_t *t = NULL;
        kvt_tier_hbm_conf_t c = {.backend = names[i], .capacity_bytes = 64u << 20};
        cr_assert_eq(kvt_tier_hbm_create(&t, &c), KVT_EUNAVAIL, "backend %s",
                     names[i] ? names[i] : "(default)");
        cr_assert_null(t);
    }
}

static kvt_tier_t *mk_cuda(uint64_t cap)
{
    if (!kvt_tier_cuda_usable())
        skip_no_gpu("no usable CUDA device: the cuda backend cannot move bytes here");
    kvt_tier_t *t = NULL;
    kvt_tier_hbm_conf_t c = {.backend = "cuda", .capacity_bytes = cap};
    cr_assert_eq(kvt_tier_hbm_create(&t, &c), 0);
    cr_assert_str_eq(kvt_tier_backend(t), "cuda");
    cr_assert_null(kvt_tier_ptr(t, 1), "device memory has no host pointer");
    return t;
}

Test(tier_hbm, cuda_round_trips_from_pinned_dram)
{
    kvt_tier_t *h = mk_cuda(256u << 20);
    kvt_tier_t *d = NULL;
    kvt_tier_dram_conf_t dc = {.capacity_bytes = 64u << 20, .pin = 1};
    cr_assert_eq(kvt_tier_dram_create(&d, &dc), 0);
    cr_assert_eq(kvt_tier_dram_pinned(d), 1);
    static const uint32_t sizes[] = {1, 4097, 256u << 10, 2u << 20, (2u << 20) + 3};
    uint32_t tok[16];
    for (size_t i = 0; i < KVT_ARRAY_LEN(sizes); i++) {
        kvt_block_key_t k = tu_key(i, tok, 16);
        uint8_t *src = malloc(sizes[i]);
        tu_fill(src, sizes[i], i);
        uint64_t dloc = 0, hloc = 0;
        cr_assert_eq(tu_write(d, &k, src, sizes[i], &dloc), 0);
        /* HBM writes straight from the pinned DRAM block, and reads back into another one. */
        cr_assert_eq(tu_write(h, &k, kvt_tier_ptr(d, dloc), sizes[i], &hloc), 0);
        cr_assert_not_null(kvt_tier_hbm_devptr(h, hloc));
        memset(kvt_tier_ptr(d, dloc), 0, sizes[i]);
        cr_assert_eq(tu_read(h, &k, hloc, kvt_tier_ptr(d, dloc), sizes[i]), 0);
        cr_assert(tu_same(kvt_tier_ptr(d, dloc), sizes[i], i));
        kvt_tier_free(h, hloc, sizes[i]);
        kvt_tier_free(d, dloc, sizes[i]);
        free(src);
    }
    kvt_tier_destroy(d);
    kvt_tier_destroy(h);
}

/* A DRAM shared arena (zero-copy clients) is never pinned: HBM copies from and to its blocks
 * are from pageable memory, one at a time and in batches, and must still be right. */
Test(tier_hbm, cuda_round_trips_from_a_dram_shared_arena)
{
    enum { N = 8 };
    const uint64_t ns = 0x5ea4ed0000000001ull;
    kvt_tier_t *h = mk_cuda(256u << 20);
    kvt_tier_t *d = NULL;
    kvt_tier_dram_conf_t dc = {.capacity_bytes = 64u << 20, .max_shared = 1};
    cr_assert_eq(kvt_tier_dram_create(&d, &dc), 0);
    int fd;
    uint64_t mb, off;
    cr_assert_eq(kvt_tier_dram_share(d, ns, &fd, &mb), 0);
    static const uint32_t sizes[N] = {1,      4097,           256u << 10, 2u << 20,
                                      100000, (2u << 20) + 3, 4096,       1u << 20};
    static uint32_t toks[N][16];
    static kvt_tier_io_t ios[N];
    uint64_t dloc[N];
    for (int i = 0; i < N; i++) {
        kvt_block_key_t k = tu_key((uint64_t)i, toks[i], 16);
        k.ns_seed = ns;
        uint8_t *src = malloc(sizes[i]);
        tu_fill(src, sizes[i], (uint64_t)i);
        cr_assert_eq(tu_write(d, &k, src, sizes[i], &dloc[i]), 0);
        cr_assert_eq(kvt_tier_dram_offset(d, ns, dloc[i], &off), 0, "block %d in the arena", i);
        free(src);
    }
    /* All to HBM at once (one batch), then all back into the zeroed arena blocks. */
    int done = 0;
    for (int i = 0; i < N; i++) {
        ios[i] = (kvt_tier_io_t){.key = tu_key((uint64_t)i, toks[i], 16),
                                 .buf = kvt_tier_ptr(d, dloc[i]),
                                 .len = sizes[i],
                                 .cb = tu_count_cb,
                                 .data = &done};
        ios[i].key.ns_seed = ns;
        cr_assert_eq(kvt_tier_write(h, &ios[i]), 0);
    }
    cr_assert(tu_drive(h, &done, N));
    for (int i = 0; i < N; i++) {
        cr_assert_eq(ios[i].status, 0);
        memset(kvt_tier_ptr(d, dloc[i]), 0, sizes[i]);
        ios[i].cb = tu_count_cb;
    }
    done = 0;
    for (int i = 0; i < N; i++)
        cr_assert_eq(kvt_tier_read(h, &ios[i]), 0);
    cr_assert(tu_drive(h, &done, N));
    for (int i = 0; i < N; i++) {
        cr_assert_eq(ios[i].status, 0);
        cr_assert(tu_same(kvt_tier_ptr(d, dloc[i]), sizes[i], (uint64_t)i), "block %d", i);
        kvt_tier_free(h, ios[i].loc, sizes[i]);
        kvt_tier_free(d, dloc[i], sizes[i]);
    }
    kvt_tier_destroy(d);
    kvt_tier_destroy(h);
}

Test(tier_hbm, cuda_many_copies_in_flight_and_capacity)
{
    enum { N = 64, LEN = 1u << 20 };
    kvt_tier_t *h = mk_cuda(32u << 20);
    static kvt_tier_io_t ios[N];
    static uint32_t toks[N][16];
    uint8_t *bufs = malloc((size_t)N * LEN);
    int done = 0, accepted = 0;
    for (int i = 0; i < N; i++) {
        tu_fill(bufs + (size_t)i * LEN, LEN, (uint64_t)i);
        ios[i] = (kvt_tier_io_t){.key = tu_key((uint64_t)i, toks[i], 16),
                                 .buf = bufs + (size_t)i * LEN,
                                 .len = LEN,
                                 .cb = tu_count_cb,
                                 .data = &done};
        int rc = kvt_tier_write(h, &ios[i]);
        if (rc == KVT_ENOSPC)
            break;
        cr_assert_eq(rc, 0);
        accepted++;
    }
    cr_assert_eq(accepted, 32, "32 MiB of 1 MiB blocks");
    cr_assert(tu_drive(h, &done, accepted));
    memset(bufs, 0, (size_t)N * LEN);
    done = 0;
    for (int i = 0; i < accepted; i++) {
        cr_assert_eq(ios[i].status, 0);
        cr_assert_eq(kvt_tier_read(h, &ios[i]), 0);
    }
    cr_assert(tu_drive(h, &done, accepted));
    for (int i = 0; i < accepted; i++)
        cr_assert(tu_same(bufs + (size_t)i * LEN, LEN, (uint64_t)i), "block %d", i);
    free(bufs);
    kvt_tier_destroy(h);
}

Test(tier_hbm, cuda_batches_both_ways_at_once_are_byte_exact)
{
    /* 96 blocks of 256 KiB written, then the first half read back while the second half is
     * written again, all queued in one turn: batches of up to 16 each way on their own streams,
     * every callback run, every byte where it belongs. */
    enum { N = 96, LEN = 256u << 10 };
    kvt_tier_t *h = mk_cuda(64u << 20);
    kvt_tier_t *d = NULL;
    kvt_tier_dram_conf_t dc = {.capacity_bytes = 2ull * N * LEN, .pin = 1};
    cr_assert_eq(kvt_tier_dram_create(&d, &dc), 0);
    static kvt_tier_io_t ios[N], again[N];
    static uint32_t toks[N][16];
    uint8_t *host = malloc((size_t)N * LEN);
    uint8_t *pinned[N];
    uint32_t tok[16];
    for (int i = 0; i < N; i++) {
        kvt_block_key_t k = tu_key(1000 + (uint64_t)i, tok, 16);
        uint64_t loc = 0;
        tu_fill(host + (size_t)i * LEN, LEN, (uint64_t)i);
        cr_assert_eq(tu_write(d, &k, host + (size_t)i * LEN, LEN, &loc), 0);
        pinned[i] = kvt_tier_ptr(d, loc);
    }
    int done = 0;
    for (int i = 0; i < N; i++) {
        ios[i] = (kvt_tier_io_t){.key = tu_key((uint64_t)i, toks[i], 16),
                                 .buf = pinned[i],
                                 .len = LEN,
                                 .cb = tu_count_cb,
                                 .data = &done};
        cr_assert_eq(kvt_tier_write(h, &ios[i]), 0, "write %d", i);
    }
    cr_assert(tu_drive(h, &done, N));
    kvt_tier_hbm_stats_t st = stats(h);
    cr_assert_str_eq(st.api, "cudaMemcpyBatchAsync", "batches refused by this driver?");
    cr_assert_eq(st.copies, N);
    cr_assert_lt(st.batches, (uint64_t)N, "copies went out in batches");
    done = 0;
    for (int i = 0; i < N / 2; i++) {
        memset(pinned[i], 0, LEN);
        cr_assert_eq(kvt_tier_read(h, &ios[i]), 0);
        int j = N / 2 + i;
        kvt_tier_free(h, ios[j].loc, LEN);
        tu_fill(pinned[j], LEN, 5000 + (uint64_t)j);
        again[j] = (kvt_tier_io_t){.key = tu_key((uint64_t)j, toks[j], 16),
                                   .buf = pinned[j],
                                   .len = LEN,
                                   .cb = tu_count_cb,
                                   .data = &done};
        cr_assert_eq(kvt_tier_write(h, &again[j]), 0);
    }
    cr_assert(tu_drive(h, &done, N));
    for (int i = 0; i < N / 2; i++) {
        cr_assert_eq(ios[i].status, 0);
        cr_assert(tu_same(pinned[i], LEN, (uint64_t)i), "read %d", i);
        int j = N / 2 + i;
        cr_assert_eq(again[j].status, 0);
        memset(pinned[j], 0, LEN);
        cr_assert_eq(tu_read(h, &again[j].key, again[j].loc, pinned[j], LEN), 0);
        cr_assert(tu_same(pinned[j], LEN, 5000 + (uint64_t)j), "rewritten %d", j);
    }
    free(host);
    kvt_tier_destroy(d);
    kvt_tier_destroy(h);
}
