/*
 * test_tier_hbm.c: the HBM tier. The `host` backend (ordinary memory, chosen explicitly) runs
 * everywhere: round trips, slot rounding, capacity exhaustion, fragmentation of the slot pool,
 * free and reuse, requests in flight, and the grouping of requests into batches (the same code
 * for both backends: requests queued together go out as one batch). The `cuda` backend needs a
 * usable GPU: without one its creation must fail with KVT_EUNAVAIL (tested here), and the tests
 * that move bytes through the device are skipped, not passed, with the reason on stderr too
 * (Criterion prints it only with --verbose).
 *
 * The IPC export: block offsets in the pool (both backends), no handle from the host backend,
 * and, with a GPU, a block read through the handle in another process. That process is this
 * test program exec'd afresh (ipc_child_entry), not a plain fork: CUDA does not work in a child
 * forked from a process that has used it, and by the time a handle exists this one has.
 */
#include "test_tier_util.h"

#include <poll.h>
#include <pthread.h>
#include <sys/wait.h>

#include "config.h" /* KVT_HAVE_CUDA */
#if KVT_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

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

/* Reads back n blocks of len bytes written as ios into back, each counted in *done. */
static void reads_of(kvt_tier_io_t *rd, const kvt_tier_io_t *ios, uint8_t *back, int n,
                     uint32_t len, int *done, int queue_only)
{
    for (int i = 0; i < n; i++)
        rd[i] = (kvt_tier_io_t){.key = ios[i].key,
                                .loc = ios[i].loc,
                                .buf = back + (size_t)i * len,
                                .len = len,
                                .cb = tu_count_cb,
                                .data = done,
                                .queue_only = (uint8_t)queue_only};
}

/* A read marked queue_only (a GET's, submitted from a loop that does not process the tier) is
 * never sent from its submission, even past a full batch: the tier's fd turns readable and the
 * owner's kvt_tier_process sends them all, in batches of batch_max, byte-exact. Without the mark
 * the batch_max-th read went out inline, on the submitter's thread. */
Test(tier_hbm, queue_only_reads_wait_for_the_owners_process)
{
    enum { N = 6, LEN = 4096 };
    kvt_tier_t *t = NULL;
    kvt_tier_hbm_conf_t c = {.backend = "host", .capacity_bytes = 1u << 20, .batch = 2};
    cr_assert_eq(kvt_tier_hbm_create(&t, &c), 0);
    static kvt_tier_io_t ios[N], rd[N];
    static uint32_t toks[N][16];
    static uint8_t bufs[N * LEN], back[N * LEN];
    int done = 0;
    tu_write_burst(t, ios, toks, bufs, N, LEN, 31, &done);
    cr_assert(tu_drive(t, &done, N));
    uint64_t batches = stats(t).batches;
    done = 0;
    reads_of(rd, ios, back, N, LEN, &done, 1);
    for (int i = 0; i < N; i++)
        cr_assert_eq(kvt_tier_read(t, &rd[i]), 0, "read %d", i);
    cr_assert_eq(stats(t).batches, batches, "no read went out from its submission");
    cr_assert(fd_readable(t), "the tier's fd wakes its owner");
    cr_assert_eq(kvt_tier_process(t), N);
    cr_assert_eq(done, N);
    cr_assert_eq(stats(t).batches, batches + N / 2, "in batches of 2");
    for (int i = 0; i < N; i++)
        cr_assert(tu_same(back + (size_t)i * LEN, LEN, 31 + (uint64_t)i), "block %d", i);
    kvt_tier_destroy(t);
}

/* Submissions from a thread other than the one that created the tier (the daemon: a PUT or a
 * write-path GET on a loop past 0, under its write lock). */
typedef struct foreign {
    kvt_tier_t *t;
    kvt_tier_io_t *ios;
    int n, rc, write;
} foreign_t;

static void *foreign_submit(void *arg)
{
    foreign_t *f = arg;
    for (int i = 0; i < f->n && f->rc == 0; i++)
        f->rc = f->write ? kvt_tier_write(f->t, &f->ios[i]) : kvt_tier_read(f->t, &f->ios[i]);
    return NULL;
}

static void submit_from_another_thread(kvt_tier_t *t, kvt_tier_io_t *ios, int n, int write)
{
    foreign_t f = {.t = t, .ios = ios, .n = n, .write = write};
    pthread_t th;
    cr_assert_eq(pthread_create(&th, NULL, foreign_submit, &f), 0);
    cr_assert_eq(pthread_join(th, NULL), 0);
    cr_assert_eq(f.rc, 0, "%s from another thread: %d", write ? "write" : "read", f.rc);
}

/* A full queue goes out from a submission only on the thread that created the tier, which is the
 * one that processes it: writes and reads submitted from another thread past batch_max (not
 * marked queue_only) are queued and kicked, and the creator's kvt_tier_process sends them all in
 * batches of batch_max, byte-exact. Before, the batch_max-th went out on the submitter's thread,
 * with its CUDA calls on the cuda backend and its memcpy and completion on the host one. */
Test(tier_hbm, full_queues_from_another_thread_wait_for_the_owners_process)
{
    enum { N = 6, LEN = 4096 };
    kvt_tier_t *t = NULL;
    kvt_tier_hbm_conf_t c = {.backend = "host", .capacity_bytes = 1u << 20, .batch = 2};
    cr_assert_eq(kvt_tier_hbm_create(&t, &c), 0);
    static kvt_tier_io_t ios[N], rd[N];
    static uint32_t toks[N][16];
    static uint8_t bufs[N * LEN], back[N * LEN];
    int done = 0;
    for (int i = 0; i < N; i++) {
        tu_fill(bufs + (size_t)i * LEN, LEN, 51 + (uint64_t)i);
        ios[i] = (kvt_tier_io_t){.key = tu_key((uint64_t)i, toks[i], 16),
                                 .buf = bufs + (size_t)i * LEN,
                                 .len = LEN,
                                 .cb = tu_count_cb,
                                 .data = &done};
    }
    submit_from_another_thread(t, ios, N, 1);
    cr_assert_eq(stats(t).batches, 0, "no write went out on the submitter's thread");
    cr_assert_eq(done, 0);
    cr_assert(fd_readable(t), "the tier's fd wakes its owner");
    cr_assert_eq(kvt_tier_process(t), N);
    cr_assert_eq(done, N);
    cr_assert_eq(stats(t).batches, N / 2, "in batches of 2");
    for (int i = 0; i < N; i++) {
        cr_assert_eq(ios[i].status, 0);
        cr_assert(tu_same(kvt_tier_ptr(t, ios[i].loc), LEN, 51 + (uint64_t)i), "block %d", i);
    }
    done = 0;
    reads_of(rd, ios, back, N, LEN, &done, 0);
    submit_from_another_thread(t, rd, N, 0);
    cr_assert_eq(stats(t).batches, N / 2, "no read went out on the submitter's thread");
    cr_assert_eq(done, 0);
    cr_assert(fd_readable(t));
    cr_assert_eq(kvt_tier_process(t), N);
    cr_assert_eq(done, N);
    cr_assert_eq(stats(t).batches, N, "in batches of 2");
    for (int i = 0; i < N; i++)
        cr_assert(tu_same(back + (size_t)i * LEN, LEN, 51 + (uint64_t)i), "read %d", i);
    /* On the creating thread a full queue still goes out from its submission. */
    for (int i = 0; i < N; i++)
        kvt_tier_free(t, ios[i].loc, LEN);
    done = 0;
    tu_write_burst(t, ios, toks, bufs, N, LEN, 51, &done);
    cr_assert_eq(stats(t).batches, N + N / 2, "the owner's full queues went out at once");
    cr_assert(tu_drive(t, &done, N));
    kvt_tier_destroy(t);
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

/* ---- the IPC export ---- */

Test(tier_hbm, host_offsets_name_where_blocks_are)
{
    enum { SLOT = 64u << 10, POOL = 2u << 20 };
    kvt_tier_t *t = mk_host(POOL, SLOT);
    static const uint32_t sizes[] = {1, SLOT, SLOT + 1, 3 * SLOT, 4096, 2 * SLOT - 7, 5 * SLOT};
    enum { N = KVT_ARRAY_LEN(sizes) };
    uint32_t tok[16];
    uint64_t locs[N + 2], offs[N + 2];
    uint32_t lens[N + 2];
    uint8_t *buf = malloc(5 * SLOT);
    for (int i = 0; i < N; i++) {
        kvt_block_key_t k = tu_key((uint64_t)i, tok, 16);
        lens[i] = sizes[i];
        tu_fill(buf, lens[i], (uint64_t)i);
        cr_assert_eq(tu_write(t, &k, buf, lens[i], &locs[i]), 0, "block %d", i);
    }
    /* Holes, then two blocks more, so that offsets are not merely in the order written. */
    kvt_tier_free(t, locs[1], lens[1]);
    kvt_tier_free(t, locs[3], lens[3]);
    uint64_t freed[2] = {locs[1], locs[3]};
    for (int j = 0; j < 2; j++) {
        int i = j ? 3 : 1;
        kvt_block_key_t k = tu_key(100 + (uint64_t)i, tok, 16);
        lens[i] = j ? 2 * SLOT : SLOT - 1;
        tu_fill(buf, lens[i], 100 + (uint64_t)i);
        cr_assert_eq(tu_write(t, &k, buf, lens[i], &locs[i]), 0);
    }
    cr_assert_eq(kvt_tier_hbm_offset(t, locs[0], &offs[0]), 0);
    cr_assert_eq(offs[0], 0, "the first block written to an empty pool is at its start");
    uint8_t *base = kvt_tier_ptr(t, locs[0]);
    for (int i = 0; i < N; i++) {
        uint64_t seed = i == 1 || i == 3 ? 100 + (uint64_t)i : (uint64_t)i;
        cr_assert_eq(kvt_tier_hbm_offset(t, locs[i], &offs[i]), 0, "block %d", i);
        cr_assert_eq(offs[i] % SLOT, 0, "block %d: offset %llu is not slot-aligned", i,
                     (unsigned long long)offs[i]);
        cr_assert_leq(offs[i] + kvt_tier_footprint(t, lens[i]), POOL, "block %d", i);
        cr_assert_eq((uint8_t *)kvt_tier_ptr(t, locs[i]) - base, (ptrdiff_t)offs[i],
                     "block %d: its offset is where its bytes are", i);
        cr_assert(tu_same(base + offs[i], lens[i], seed), "block %d's bytes at its offset", i);
        for (int j = 0; j < i; j++)
            cr_assert(offs[j] + kvt_tier_footprint(t, lens[j]) <= offs[i] ||
                          offs[i] + kvt_tier_footprint(t, lens[i]) <= offs[j],
                      "blocks %d and %d overlap", j, i);
    }
    /* What is not a live location of this tier. */
    uint64_t off = 7;
    kvt_tier_free(t, locs[4], lens[4]);
    cr_assert_eq(kvt_tier_hbm_offset(t, locs[4], &off), KVT_ENOENT, "a freed location");
    for (int j = 0; j < 2; j++) /* unless the writes after the frees were given it again */
        if (freed[j] != locs[1] && freed[j] != locs[3])
            cr_assert_eq(kvt_tier_hbm_offset(t, freed[j], &off), KVT_ENOENT);
    cr_assert_eq(kvt_tier_hbm_offset(t, 0, &off), KVT_ENOENT);
    cr_assert_eq(kvt_tier_hbm_offset(t, POOL / SLOT + 1, &off), KVT_ENOENT, "past the pool");
    cr_assert_eq(off, 7, "*off untouched by a miss");
    cr_assert_eq(kvt_tier_hbm_offset(t, locs[0], NULL), KVT_EINVAL);
    cr_assert_eq(kvt_tier_hbm_offset(NULL, locs[0], &off), KVT_EINVAL);
    kvt_tier_t *d = NULL;
    kvt_tier_dram_conf_t dc = {.capacity_bytes = 1u << 20, .pin = 2};
    cr_assert_eq(kvt_tier_dram_create(&d, &dc), 0);
    uint64_t dloc = 0;
    kvt_block_key_t k = tu_key(7, tok, 16);
    cr_assert_eq(tu_write(d, &k, buf, 4096, &dloc), 0);
    cr_assert_eq(kvt_tier_hbm_offset(d, dloc, &off), KVT_EINVAL, "a DRAM tier");
    kvt_tier_destroy(d);
    free(buf);
    kvt_tier_destroy(t);
}

Test(tier_hbm, host_pool_has_no_ipc_handle)
{
    kvt_tier_t *t = mk_host(1u << 20, 0);
    uint8_t hd[KVT_HBM_IPC_HANDLE];
    uint64_t pool = 0;
    cr_assert_eq(kvt_tier_hbm_ipc(t, 0, hd, &pool), KVT_EUNAVAIL, "host memory has no CUDA handle");
    cr_assert_eq(kvt_tier_hbm_ipc(t, 0, hd, NULL), KVT_EINVAL);
    cr_assert_eq(kvt_tier_hbm_ipc(t, 0, NULL, &pool), KVT_EINVAL);
    cr_assert_eq(kvt_tier_hbm_ipc(NULL, 0, hd, &pool), KVT_EINVAL);
    kvt_tier_t *d = NULL;
    kvt_tier_dram_conf_t dc = {.capacity_bytes = 1u << 20, .pin = 2};
    cr_assert_eq(kvt_tier_dram_create(&d, &dc), 0);
    cr_assert_eq(kvt_tier_hbm_ipc(d, 0, hd, &pool), KVT_EINVAL, "a DRAM tier");
    kvt_tier_destroy(d);
    void *base = &pool;
    memset(hd, 0, sizeof hd);
    cr_assert_eq(kvt_tier_hbm_ipc_open(hd, 0, NULL), KVT_EINVAL);
    cr_assert_eq(kvt_tier_hbm_ipc_open(NULL, 0, &base), KVT_EINVAL);
    cr_assert_eq(kvt_tier_hbm_ipc_open(hd, -1, &base), KVT_EINVAL);
    cr_assert_eq(kvt_tier_hbm_ipc_close(NULL), KVT_EINVAL);
    kvt_tier_destroy(t);
}

/* The process that opens the handle: this program again (see the top), told by the environment
 * variable what to read: "<handle as hex>:<offset>:<len>:<seed>:<device>". Exits 0 when the
 * block read through the handle is byte-exact, 1 when it differs, 2 for bad arguments or a build
 * without CUDA, 3 when the handle does not open, 4 when the copy fails, 5 when the mapping does
 * not close. */
#define IPC_CHILD_ENV "KVT_TEST_HBM_IPC_CHILD"

static int ipc_child(const char *arg)
{
#if KVT_HAVE_CUDA
    uint8_t hd[KVT_HBM_IPC_HANDLE];
    for (size_t i = 0; i < sizeof hd; i++) {
        unsigned v;
        if (sscanf(arg + 2 * i, "%2x", &v) != 1)
            return 2;
        hd[i] = (uint8_t)v;
    }
    unsigned long long off, seed;
    unsigned len;
    int device;
    if (sscanf(arg + 2 * sizeof hd, ":%llu:%u:%llu:%d", &off, &len, &seed, &device) != 4)
        return 2;
    void *base = NULL;
    if (kvt_tier_hbm_ipc_open(hd, device, &base) != 0)
        return 3; /* logged */
    uint8_t *buf = malloc(len);
    cudaError_t ce = cudaMemcpy(buf, (uint8_t *)base + off, len, cudaMemcpyDeviceToHost);
    if (ce != cudaSuccess)
        fprintf(stderr, "ipc child: cudaMemcpy from the mapped pool: %s\n", cudaGetErrorString(ce));
    int same = ce == cudaSuccess && tu_same(buf, len, seed);
    free(buf);
    if (kvt_tier_hbm_ipc_close(base) != 0)
        return 5;
    return ce != cudaSuccess ? 4 : same ? 0 : 1;
#else
    (void)arg;
    return 2;
#endif
}

static const char *ipc_child_says(int code)
{
    static const char *why[] = {
        "ok",          "the block's bytes differ", "bad arguments", "the handle did not open",
        "copy failed", "the mapping did not close"};
    if (code >= 0 && code < (int)KVT_ARRAY_LEN(why))
        return why[code];
    return code == 127 ? "exec failed" : "?";
}

/* Before Criterion's main: in the exec'd child, do its work and leave. */
__attribute__((constructor)) static void ipc_child_entry(void)
{
    const char *arg = getenv(IPC_CHILD_ENV);
    if (arg)
        _exit(ipc_child(arg));
}

/* Runs ipc_child(arg) in a fresh process (this program exec'd, the environment kept plus arg)
 * and returns its wait status. Everything the child needs is made before the fork: after it,
 * in a process with CUDA's threads, the child only execs. */
static int ipc_spawn(const char *arg)
{
    extern char **environ;
    size_t n = 0;
    while (environ[n])
        n++;
    char **envp = calloc(n + 2, sizeof(*envp));
    size_t vlen = strlen(IPC_CHILD_ENV) + strlen(arg) + 2;
    char *var = malloc(vlen);
    cr_assert(envp && var);
    snprintf(var, vlen, "%s=%s", IPC_CHILD_ENV, arg);
    envp[0] = var;
    memcpy(envp + 1, environ, n * sizeof(*envp));
    char *argv[] = {"test_tier_hbm (ipc child)", NULL};
    pid_t pid = fork();
    cr_assert_geq(pid, 0, "fork: %s", strerror(errno));
    if (pid == 0) {
        execve("/proc/self/exe", argv, envp);
        _exit(127);
    }
    free(envp);
    free(var);
    int st = 0;
    while (waitpid(pid, &st, 0) < 0)
        cr_assert_eq(errno, EINTR, "waitpid: %s", strerror(errno));
    return st;
}

Test(tier_hbm, cuda_pool_read_through_its_ipc_handle_in_another_process)
{
    if (!kvt_tier_cuda_usable())
        skip_no_gpu("no usable CUDA device (or no CUDA in this build): the IPC export of the "
                    "pool is tested on GPU hosts");
    enum { POOL = 64u << 20, LEN = (256u << 10) + 3 };
    kvt_tier_t *h = mk_cuda(POOL);
    uint8_t *buf = malloc(LEN);
    uint32_t tok[16];
    uint64_t locs[2], offs[2];
    /* Two blocks, so that the one read through the handle is not at the pool's start. */
    for (int i = 0; i < 2; i++) {
        kvt_block_key_t k = tu_key((uint64_t)i, tok, 16);
        tu_fill(buf, LEN, 70 + (uint64_t)i);
        cr_assert_eq(tu_write(h, &k, buf, LEN, &locs[i]), 0, "block %d", i);
        cr_assert_eq(kvt_tier_hbm_offset(h, locs[i], &offs[i]), 0);
    }
    free(buf);
    cr_assert_gt(offs[1], 0);
    cr_assert_eq((uint8_t *)kvt_tier_hbm_devptr(h, locs[0]) - offs[0],
                 (uint8_t *)kvt_tier_hbm_devptr(h, locs[1]) - offs[1],
                 "device address - offset is the pool's base for every block");
    uint8_t hd[KVT_HBM_IPC_HANDLE], again[KVT_HBM_IPC_HANDLE];
    uint64_t pool = 0, pool2 = 0;
    cr_assert_eq(kvt_tier_hbm_ipc(h, 0, hd, &pool), 0);
    cr_assert_eq(pool, POOL);
    cr_assert_leq(offs[1] + LEN, pool);
    cr_assert_eq(kvt_tier_hbm_ipc(h, 0, again, &pool2), 0);
    cr_assert(!memcmp(hd, again, sizeof hd) && pool2 == pool, "the same handle each time");
    char arg[2 * KVT_HBM_IPC_HANDLE + 96];
    for (size_t i = 0; i < sizeof hd; i++)
        snprintf(arg + 2 * i, 3, "%02x", hd[i]);
    snprintf(arg + 2 * sizeof hd, sizeof arg - 2 * sizeof hd, ":%llu:%u:%llu:%d",
             (unsigned long long)offs[1], (unsigned)LEN, 71ull, 0 /* mk_cuda's device */);
    int st = ipc_spawn(arg);
    cr_assert(WIFEXITED(st), "the ipc child died (wait status %#x)", st);
    int code = WEXITSTATUS(st);
    cr_assert_eq(code, 0, "the ipc child exited %d: %s (its log is above)", code,
                 ipc_child_says(code));
    /* The child has closed its mapping (and exited): the pool may go. */
    kvt_tier_destroy(h);
}

/* ---- one pool per device (host backend standing in for two GPUs) ---- */

#define MP_SLOT (64u << 10)
#define MP_POOL (1u << 20) /* 16 slots per device */

static kvt_tier_t *mk_pools(const int *devs, uint32_t n)
{
    kvt_tier_t *t = NULL;
    kvt_tier_hbm_conf_t c = {.backend = "host",
                             .capacity_bytes = MP_POOL,
                             .slot_bytes = MP_SLOT,
                             .devices = devs,
                             .ndevices = n};
    cr_assert_eq(kvt_tier_hbm_create(&t, &c), 0);
    return t;
}

/* A synchronous write that names a device. */
static int mp_write(kvt_tier_t *t, int device, uint64_t i, uint32_t *tok, const void *buf,
                    uint32_t len, uint64_t *loc)
{
    int done = 0;
    kvt_tier_io_t io = {.key = tu_key(i, tok, 16),
                        .buf = (void *)buf,
                        .len = len,
                        .cb = tu_count_cb,
                        .data = &done,
                        .device = device};
    int rc = kvt_tier_write(t, &io);
    if (rc < 0)
        return rc;
    cr_assert(tu_drive(t, &done, 1));
    *loc = io.loc;
    return io.status;
}

static void mp_pools_hold(kvt_tier_t *t, kvt_tier_hbm_pool_t p[2])
{
    cr_assert_eq(kvt_tier_hbm_pools(t, p, 2), 2);
    kvt_tier_usage_t u;
    kvt_tier_usage(t, &u);
    for (int i = 0; i < 2; i++)
        cr_assert_leq(p[i].used_bytes, p[i].capacity_bytes, "pool %d over its capacity", i);
    cr_assert_eq(p[0].used_bytes + p[1].used_bytes, u.used_bytes, "the pools sum to the tier");
    cr_assert_eq(p[0].blocks + p[1].blocks, u.blocks);
}

Test(tier_hbm, host_pool_per_device_places_blocks_on_their_device)
{
    static const int devs[] = {3, 5};
    kvt_tier_t *t = mk_pools(devs, 2);
    kvt_tier_usage_t u;
    kvt_tier_usage(t, &u);
    cr_assert_eq(u.capacity_bytes, 2 * MP_POOL, "the tier's capacity is the pools' sum");
    kvt_tier_hbm_pool_t p[2];
    cr_assert_eq(kvt_tier_hbm_pools(t, NULL, 0), 2);
    mp_pools_hold(t, p);
    cr_assert_eq(p[0].device, 3);
    cr_assert_eq(p[1].device, 5);
    cr_assert_eq(p[1].capacity_bytes, MP_POOL);

    uint32_t tok[64][16];
    uint8_t *buf = malloc(MP_SLOT);
    uint64_t locs[64], off;
    /* Device 5's blocks in pool 5, device 3's in pool 3, each readable at its own address. */
    for (int i = 0; i < 4; i++) {
        tu_fill(buf, MP_SLOT, (uint64_t)i);
        int dev = i % 2 ? 5 : 3;
        cr_assert_eq(mp_write(t, dev, (uint64_t)i, tok[i], buf, MP_SLOT, &locs[i]), 0);
        cr_assert_eq(kvt_tier_hbm_device(t, locs[i]), dev, "block %d on its device", i);
        cr_assert_eq(kvt_tier_hbm_offset(t, locs[i], &off), 0);
        cr_assert_lt(off, MP_POOL, "an offset inside its own pool");
    }
    mp_pools_hold(t, p);
    cr_assert_eq(p[0].blocks, 2);
    cr_assert_eq(p[1].blocks, 2);
    cr_assert_eq(p[1].used_bytes, 2 * MP_SLOT);
    for (int i = 0; i < 4; i++) {
        kvt_block_key_t k = tu_key((uint64_t)i, tok[i], 16);
        memset(buf, 0, MP_SLOT);
        cr_assert_eq(tu_read(t, &k, locs[i], buf, MP_SLOT), 0);
        cr_assert(tu_same(buf, MP_SLOT, (uint64_t)i), "block %d read back", i);
    }
    /* The pools are apart: the same offset in each is another address. */
    uint64_t o1, o3;
    cr_assert_eq(kvt_tier_hbm_offset(t, locs[1], &o1), 0);
    cr_assert_eq(kvt_tier_hbm_offset(t, locs[0], &o3), 0);
    cr_assert_eq(o1, o3, "first block of each pool at offset 0");
    cr_assert_neq(kvt_tier_hbm_devptr(t, locs[1]), kvt_tier_hbm_devptr(t, locs[0]));

    /* No device wanted (-1): the pool with the most room (5 here, after one more block on 3).
     * A device without a pool (7: an old client names device 0 whatever it runs on): the first
     * pool, though it has less room. */
    tu_fill(buf, MP_SLOT, 4);
    cr_assert_eq(mp_write(t, 3, 4, tok[4], buf, MP_SLOT, &locs[4]), 0);
    cr_assert_eq(mp_write(t, -1, 5, tok[5], buf, MP_SLOT, &locs[5]), 0);
    cr_assert_eq(kvt_tier_hbm_device(t, locs[5]), 5);
    cr_assert_eq(mp_write(t, 7, 6, tok[6], buf, MP_SLOT, &locs[6]), 0);
    cr_assert_eq(kvt_tier_hbm_device(t, locs[6]), 3);

    /* Fill pool 5: its device's next blocks spill to pool 3, and each pool stops at its own
     * capacity; with both full a write fails and changes nothing. */
    int n = 7;
    mp_pools_hold(t, p);
    while (p[1].used_bytes < p[1].capacity_bytes) {
        cr_assert_eq(mp_write(t, 5, (uint64_t)n, tok[n], buf, MP_SLOT, &locs[n]), 0);
        cr_assert_eq(kvt_tier_hbm_device(t, locs[n]), 5);
        n++;
        mp_pools_hold(t, p);
    }
    cr_assert_eq(mp_write(t, 5, (uint64_t)n, tok[n], buf, MP_SLOT, &locs[n]), 0);
    cr_assert_eq(kvt_tier_hbm_device(t, locs[n]), 3, "a full pool's device spills over");
    n++;
    for (mp_pools_hold(t, p); p[0].used_bytes < p[0].capacity_bytes; mp_pools_hold(t, p), n++)
        cr_assert_eq(mp_write(t, 5, (uint64_t)n, tok[n], buf, MP_SLOT, &locs[n]), 0);
    cr_assert_eq(n, 32, "both pools full: 32 slots");
    kvt_tier_usage_t before, after;
    kvt_tier_usage(t, &before);
    cr_assert_eq(mp_write(t, 3, 40, tok[40], buf, MP_SLOT, &locs[40]), KVT_ENOSPC);
    kvt_tier_usage(t, &after);
    cr_assert_eq(after.used_bytes, before.used_bytes);
    cr_assert_eq(after.blocks, before.blocks);

    /* A freed slot of pool 5 goes to device 5's next block. */
    kvt_tier_free(t, locs[1], MP_SLOT);
    cr_assert_eq(kvt_tier_hbm_device(t, locs[1]), KVT_ENOENT, "a freed location");
    cr_assert_eq(mp_write(t, 5, 41, tok[41], buf, MP_SLOT, &locs[41]), 0);
    cr_assert_eq(kvt_tier_hbm_device(t, locs[41]), 5);
    mp_pools_hold(t, p);
    cr_assert_eq(p[1].used_bytes, MP_POOL);
    cr_assert_eq(kvt_tier_hbm_device(NULL, locs[0]), KVT_EINVAL);
    cr_assert_eq(kvt_tier_hbm_pools(t, NULL, 2), KVT_EINVAL);
    free(buf);
    kvt_tier_destroy(t);
}

/* Requests to two pools queued in one turn go out as one batch per pool (a stream and an event
 * belong to one device), all in the one flush. */
Test(tier_hbm, host_pools_batch_apart)
{
    static const int devs[] = {0, 1};
    kvt_tier_t *t = mk_pools(devs, 2);
    kvt_tier_io_t ios[8];
    uint32_t toks[8][16];
    uint8_t *bufs = malloc(8 * 4096);
    kvt_tier_hbm_stats_t st0 = stats(t);
    int done = 0;
    for (int i = 0; i < 8; i++) {
        tu_fill(bufs + (size_t)i * 4096, 4096, 200 + (uint64_t)i);
        ios[i] = (kvt_tier_io_t){.key = tu_key((uint64_t)i, toks[i], 16),
                                 .buf = bufs + (size_t)i * 4096,
                                 .len = 4096,
                                 .cb = tu_count_cb,
                                 .data = &done,
                                 .device = i % 2};
        cr_assert_eq(kvt_tier_write(t, &ios[i]), 0);
    }
    cr_assert(tu_drive(t, &done, 8));
    kvt_tier_hbm_stats_t st = stats(t);
    cr_assert_eq(st.batches - st0.batches, 2, "one batch per pool");
    cr_assert_eq(st.copies - st0.copies, 8);
    for (int i = 0; i < 8; i++) {
        cr_assert_eq(kvt_tier_hbm_device(t, ios[i].loc), i % 2);
        cr_assert(tu_same(kvt_tier_ptr(t, ios[i].loc), 4096, 200 + (uint64_t)i));
    }
    free(bufs);
    kvt_tier_destroy(t);
}

/* A copy into a tier of several pools lands on the device it names (a promotion asked for by
 * a client on that device). */
Test(tier_hbm, copy_lands_on_the_device_it_names)
{
    static const int devs[] = {0, 1};
    kvt_tier_t *h = mk_pools(devs, 2);
    kvt_tier_t *d = NULL;
    kvt_tier_dram_conf_t dc = {.capacity_bytes = 4u << 20, .pin = 2};
    cr_assert_eq(kvt_tier_dram_create(&d, &dc), 0);
    uint32_t tok[16];
    kvt_block_key_t k = tu_key(1, tok, 16);
    uint8_t *buf = malloc(100000);
    tu_fill(buf, 100000, 77);
    uint64_t dloc = 0;
    cr_assert_eq(tu_write(d, &k, buf, 100000, &dloc), 0);
    for (int dev = 1; dev >= 0; dev--) {
        kvt_tier_copy_t cp = {
            .src = d, .dst = h, .src_loc = dloc, .key = k, .len = 100000, .dst_device = dev};
        cr_assert_eq(kvt_tier_copy(&cp), 0);
        while (!cp.dst_loc && cp.status == 0 && kvt_tier_wait(h, 1000) > 0)
            ;
        cr_assert_eq(cp.status, 0);
        cr_assert_eq(kvt_tier_hbm_device(h, cp.dst_loc), dev);
        cr_assert(tu_same(kvt_tier_ptr(h, cp.dst_loc), 100000, 77));
    }
    free(buf);
    kvt_tier_destroy(h);
    kvt_tier_destroy(d);
}

Test(tier_hbm, bad_device_lists_are_refused)
{
    kvt_tier_t *t = NULL;
    static const int twice[] = {1, 1}, neg[] = {0, -1};
    int many[KVT_HBM_MAX_DEVICES + 1];
    for (int i = 0; i <= KVT_HBM_MAX_DEVICES; i++)
        many[i] = i;
    kvt_tier_hbm_conf_t c = {.backend = "host", .capacity_bytes = MP_POOL};
    c.devices = twice, c.ndevices = 2;
    cr_assert_eq(kvt_tier_hbm_create(&t, &c), KVT_EINVAL, "a device twice");
    c.devices = neg;
    cr_assert_eq(kvt_tier_hbm_create(&t, &c), KVT_EINVAL, "a negative device");
    c.devices = many, c.ndevices = KVT_HBM_MAX_DEVICES + 1;
    cr_assert_eq(kvt_tier_hbm_create(&t, &c), KVT_EINVAL, "too many devices");
    c.devices = NULL, c.ndevices = 2;
    cr_assert_eq(kvt_tier_hbm_create(&t, &c), KVT_EINVAL, "no list");
    cr_assert_null(t);
    c.devices = many, c.ndevices = KVT_HBM_MAX_DEVICES;
    cr_assert_eq(kvt_tier_hbm_create(&t, &c), 0, "the most devices");
    kvt_tier_usage_t u;
    kvt_tier_usage(t, &u);
    cr_assert_eq(u.capacity_bytes, (uint64_t)KVT_HBM_MAX_DEVICES * MP_POOL);
    kvt_tier_destroy(t);
    /* The cuda backend with a list: without a GPU, unavailable as for one device. */
    if (!kvt_tier_cuda_usable()) {
        static const int two[] = {0, 1};
        c = (kvt_tier_hbm_conf_t){
            .backend = "cuda", .capacity_bytes = MP_POOL, .devices = two, .ndevices = 2};
        cr_assert_eq(kvt_tier_hbm_create(&t, &c), KVT_EUNAVAIL);
    }
}
