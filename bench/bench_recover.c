/*
 * bench_recover.c: what a long namespace list costs an NVMe warm restart. The NVMe tier keeps
 * DIR/namespaces, one line per namespace a client declared, to name namespaces again after a
 * restart; in a fleet with per-tenant salts most of those tenants have left nothing on disk.
 * Recovery (kvt_store_nvme_recover) must cost what the blocks on disk cost, whatever the list
 * holds.
 *
 * One namespace's --blocks blocks (one-page prompts, 512 bytes each) are written through the
 * tier, then recovered into a fresh tree, timed, --rounds times each way in turn: with a list
 * naming that namespace only (the baseline, the simple case), and with --idle other tenants
 * listed before it. The ratio is the baseline's median time over the idle case's: 1 when the
 * list's length costs nothing, below 1 as it does. (Before recovery opened only the namespaces it
 * found blocks of, 100,000 blocks behind 20,000 idle lines recovered in 1.2-1.3 s, behind none in
 * 0.07-0.12 s: a ratio near 0.07.) The recovered block count is checked each time. One JSON
 * object on stdout.
 *
 * usage: bench_recover [--dir DIR] [--blocks N] [--idle N] [--rounds N]
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common.h"
#include "radix.h"
#include "tier.h"
#include "server.h" /* kvt_store_nvme_recover */
#include "bench_stats.h"

#define PAGE    16
#define PAYLOAD 512
#define BATCH   256

static char dir[4096]; /* the tier's directory, made under --dir */

/* Removes what the tier left in dir, and dir. */
static void cleanup(void)
{
    char path[4300];
    const char *files[] = {"kvtier.data", "kvtier.meta", "kvtier.lock", "namespaces"};
    for (size_t i = 0; i < KVT_ARRAY_LEN(files); i++) {
        snprintf(path, sizeof path, "%s/%s", dir, files[i]);
        unlink(path);
    }
    if (rmdir(dir) < 0)
        fprintf(stderr, "bench_recover: could not remove %s: %s\n", dir, strerror(errno));
}

static void die(const char *what, int rc)
{
    fprintf(stderr, "bench_recover: %s: %s\n", what, kvt_strerror(rc));
    cleanup();
    exit(1);
}

static kvt_tier_t *open_tier(uint64_t blocks)
{
    /* A record is a sector-aligned header with the tokens, then the payload: 8 KiB covers it;
     * sparse, so that the file takes only what is written. */
    kvt_tier_nvme_conf_t c = {.dir = dir,
                              .capacity_bytes = KVT_MAX((uint64_t)blocks * 16384, 64ull << 20),
                              .segment_bytes = 8u << 20,
                              .queue_depth = 64,
                              .sparse = 1};
    kvt_tier_t *t = NULL;
    int rc = kvt_tier_nvme_create(&t, &c);
    if (rc < 0)
        die("NVMe tier", rc);
    return t;
}

static void count_cb(kvt_tier_io_t *io)
{
    (*(uint32_t *)io->data)++;
}

/* Writes n one-page prompts of namespace seed, BATCH at a time. */
static void write_blocks(kvt_tier_t *t, kvt_radix_t *tree, uint32_t ns, uint32_t n)
{
    static uint32_t tok[BATCH][PAGE];
    static kvt_tier_io_t io[BATCH];
    static uint8_t buf[PAYLOAD];
    memset(buf, 0xab, sizeof buf);
    uint64_t seed = kvt_radix_ns_seed(tree, ns);
    for (uint32_t at = 0; at < n; at += BATCH) {
        uint32_t k = KVT_MIN((uint32_t)BATCH, n - at), done = 0;
        for (uint32_t i = 0; i < k; i++) {
            for (uint32_t j = 0; j < PAGE; j++)
                tok[i][j] = (at + i) * PAGE + j + 1;
            uint64_t h;
            kvt_radix_hash_pages(tree, ns, tok[i], 1, &h);
            io[i] = (kvt_tier_io_t){.key = {.ns_seed = seed,
                                            .hash = h,
                                            .parent = seed,
                                            .tokens = tok[i],
                                            .ntokens = PAGE},
                                    .buf = buf,
                                    .len = PAYLOAD,
                                    .cb = count_cb,
                                    .data = &done};
            int rc = kvt_tier_write(t, &io[i]);
            if (rc < 0)
                die("write", rc);
        }
        while (done < k) {
            int rc = kvt_tier_wait(t, 1000);
            if (rc < 0)
                die("wait", rc);
        }
        for (uint32_t i = 0; i < k; i++)
            if (io[i].status < 0)
                die("write", io[i].status);
    }
}

static void write_list(uint32_t idle)
{
    char path[4300];
    snprintf(path, sizeof path, "%s/namespaces", dir);
    FILE *f = fopen(path, "w");
    if (!f)
        die(path, -errno);
    for (uint32_t i = 0; i < idle; i++)
        fprintf(f, "v1\tllama-70b\t\tidle-tenant-%u\t%u\n", i, PAGE);
    fprintf(f, "v1\tllama-70b\t\tbusy-tenant\t%u\n", PAGE);
    if (fclose(f) != 0)
        die(path, -errno);
}

/* Seconds kvt_store_nvme_recover takes with idle tenants listed before the busy one. */
static double recover_once(uint32_t blocks, uint32_t idle)
{
    write_list(idle);
    kvt_tier_t *t = open_tier(blocks);
    kvt_radix_t *tree;
    if (kvt_radix_create(&tree, NULL) < 0)
        die("tree", KVT_ENOMEM);
    kvt_tier_nvme_recovery_t r;
    uint64_t t0 = kvt_now_ns();
    int rc = kvt_store_nvme_recover(tree, t, &r);
    double s = (double)(kvt_now_ns() - t0) / 1e9;
    if (rc < 0)
        die("recover", rc);
    if (r.inserted != blocks) {
        fprintf(stderr, "bench_recover: %llu of %u blocks recovered\n",
                (unsigned long long)r.inserted, blocks);
        cleanup();
        exit(1);
    }
    kvt_radix_destroy(tree); /* no free callback: the blocks stay on disk for the next round */
    kvt_tier_destroy(t);
    return s;
}

int main(int argc, char **argv)
{
    const char *base = ".";
    uint32_t blocks = 100000, idle = 60000, rounds = 3;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--dir") && i + 1 < argc)
            base = argv[++i];
        else if (!strcmp(argv[i], "--blocks") && i + 1 < argc)
            blocks = (uint32_t)strtoul(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--idle") && i + 1 < argc)
            idle = (uint32_t)strtoul(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--rounds") && i + 1 < argc)
            rounds = (uint32_t)strtoul(argv[++i], NULL, 10);
        else {
            fprintf(stderr, "usage: bench_recover [--dir DIR] [--blocks N] [--idle N] "
                            "[--rounds N]\n");
            return 2;
        }
    }
    if (blocks == 0 || rounds == 0 || rounds > 64) {
        fprintf(stderr, "bench_recover: --blocks > 0, --rounds 1..64\n");
        return 2;
    }
    kvt_log_set_level(KVT_LOG_WARN);
    snprintf(dir, sizeof dir, "%s/kvt-bench-recover-XXXXXX", base);
    if (!mkdtemp(dir)) {
        fprintf(stderr, "bench_recover: mkdtemp %s: %s\n", dir, strerror(errno));
        return 1;
    }
    kvt_radix_t *tree;
    uint32_t ns;
    if (kvt_radix_create(&tree, NULL) < 0 ||
        kvt_radix_ns_open(tree, "llama-70b", NULL, "busy-tenant", PAGE, &ns) < 0)
        die("tree", KVT_ENOMEM);
    kvt_tier_t *t = open_tier(blocks);
    write_blocks(t, tree, ns, blocks);
    kvt_tier_destroy(t);
    kvt_radix_destroy(tree);

    double with[64], without[64];
    for (uint32_t r = 0; r < rounds; r++) { /* in turn, so that the machine's moods fall on both */
        without[r] = recover_once(blocks, 0);
        with[r] = recover_once(blocks, idle);
    }
    double m = bench_median(with, (int)rounds), b = bench_median(without, (int)rounds);
    printf("{\"bench\":\"nvme_recover\",\"blocks\":%u,\"idle_namespaces\":%u,\"rounds\":%u,"
           "\"recover_s\":%.4f,\"baseline\":\"the busy namespace listed alone\","
           "\"baseline_recover_s\":%.4f,\"ratio\":%.3f}\n",
           blocks, idle, rounds, m, b, m > 0 ? b / m : 0);
    cleanup();
    return 0;
}
