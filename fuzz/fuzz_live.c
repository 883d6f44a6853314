/*
 * fuzz_live.c: libFuzzer harness for the NVMe tier's live-block map, DIR/kvtier.live (tiers/
 * nvme.c, "Live blocks"): its header, its length and every segment's entry (the stamp of the
 * segment's use and a bit per sector that starts a live block's record) come from the input,
 * over the template's data file and kvtier.meta v2. A damaged map stops the tier cleanly; one
 * that opens names only records the scan can check, and the tier then works (fuzz_nvme.h).
 *
 * Input: u8 flags (1: the map cut or padded to the length the geometry needs, 2: the template's
 * valid header put over the first 32 bytes), then the map's bytes.
 * KVT_FUZZ_MAKE_SEEDS=DIR writes seed inputs into DIR from the template and exits.
 */
#include "fuzz_nvme.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerInitialize(int *argc, char ***argv);

static fz_template_t tp;

static void seed(const char *dir, const char *name, uint8_t flags, size_t n)
{
    uint8_t *p = malloc(1 + n);
    if (!p)
        fz_die("seed");
    p[0] = flags;
    memcpy(p + 1, tp.live.p, n);
    fz_put(dir, name, p, 1 + n);
    free(p);
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    kvt_log_set_level((kvt_log_level_t)(KVT_LOG_ERROR + 1));
    fz_template(&tp);
    char dir[4200];
    snprintf(dir, sizeof dir, "%s/run", fz_dir);
    fz_run_init(dir, &tp.data);
    const char *out = getenv("KVT_FUZZ_MAKE_SEEDS");
    if (out) {
        /* The whole map, and its header and entries only (the padding is the harness's). */
        size_t entries = 4096 + FZ_NSEGS * (8 + FZ_SEG / 4096 / 8);
        seed(out, "whole", 0, tp.live.n);
        seed(out, "entries-padded", 1, entries);
        seed(out, "entries-fixed-header", 3, entries);
        exit(0);
    }
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1 || size > 1 << 16)
        return 0;
    uint8_t flags = data[0];
    data++;
    size--;
    static uint8_t map[1 << 16];
    size_t n = size;
    memcpy(map, data, size);
    if (flags & 1) {
        n = tp.live.n;
        if (size < n)
            memset(map + size, 0, n - size);
    }
    if ((flags & 2) && n >= 32)
        memcpy(map, tp.live.p, 32);
    fz_run_reset();
    fz_put(fz_run.dir, "kvtier.meta", tp.meta.p, tp.meta.n);
    fz_put(fz_run.dir, "namespaces", tp.ns.p, tp.ns.n);
    fz_put(fz_run.dir, "kvtier.live", map, n);
    kvt_tier_t *t = NULL;
    if (fz_open(fz_run.dir, &t) == 0) {
        fz_recover_and_use(t);
        kvt_tier_destroy(t);
    } else if (t) {
        abort();
    }
    return 0;
}
