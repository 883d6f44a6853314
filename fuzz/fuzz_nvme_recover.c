/*
 * fuzz_nvme_recover.c: libFuzzer harness for the NVMe tier's warm restart (tiers/nvme.c's
 * recovery scan over segment and record headers, tiers/nvme_recover.c's namespace list and path
 * building). The input overlays the start of one segment of the template's data file (or of a
 * zeroed one) and supplies DIR/namespaces; kvtier.meta says v2 (the template's kvtier.live
 * applies) or v1 (every intact record is scanned). Whatever the disk holds, opening the tier
 * either fails cleanly or recovers, and the tier then works (fuzz_nvme.h).
 *
 * Input: u8 flags (1: v1, 2: zeroed data file, 4: no namespaces file), u8 segment, u16 length
 * of the namespaces file (little-endian), its bytes, then the bytes laid over the segment.
 * KVT_FUZZ_MAKE_SEEDS=DIR writes seed inputs into DIR from the template and exits.
 */
#include "fuzz_nvme.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerInitialize(int *argc, char ***argv);

static fz_template_t tp;
static const char meta_v1[] = "kvtier-nvme v1 segment_bytes=65536 segments=2\n";
_Static_assert(FZ_SEG == 65536 && FZ_NSEGS == 2, "meta_v1 says the geometry");

static void seed(const char *dir, const char *name, uint8_t flags, size_t ns_len, size_t over)
{
    size_t n = 4 + ns_len + over;
    uint8_t *p = malloc(n);
    if (!p)
        fz_die("seed");
    p[0] = flags;
    p[1] = 0;
    p[2] = (uint8_t)ns_len;
    p[3] = (uint8_t)(ns_len >> 8);
    memcpy(p + 4, tp.ns.p, ns_len);
    memcpy(p + 4 + ns_len, tp.data.p, over);
    fz_put(dir, name, p, n);
    free(p);
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    kvt_log_set_level((kvt_log_level_t)(KVT_LOG_ERROR + 1)); /* damage is logged: keep runs quiet */
    fz_template(&tp);
    char dir[4200];
    snprintf(dir, sizeof dir, "%s/run", fz_dir);
    fz_run_init(dir, &tp.data);
    const char *out = getenv("KVT_FUZZ_MAKE_SEEDS");
    if (out) {
        size_t records = 4 * 8192; /* the template's records: 8 KiB each */
        seed(out, "v2-records", 0, tp.ns.n, records);
        seed(out, "v1-records", 1, tp.ns.n, records);
        seed(out, "v2-first-record", 0, tp.ns.n, 8192);
        seed(out, "v2-no-namespaces", 4, 0, records);
        seed(out, "v1-zeroed-two-records", 3, tp.ns.n, 2 * 8192);
        exit(0);
    }
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 4 || size > FZ_SEG)
        return 0;
    uint8_t flags = data[0];
    uint32_t seg = data[1] % FZ_NSEGS;
    size_t ns_len = (size_t)data[2] | (size_t)data[3] << 8;
    data += 4;
    size -= 4;
    ns_len = ns_len < size ? ns_len : size;
    fz_run_reset();
    if (flags & 2)
        fz_run_zero();
    fz_run_lay((size_t)seg * FZ_SEG, data + ns_len, size - ns_len);
    const char *dir = fz_run.dir;
    if (flags & 1)
        fz_put(dir, "kvtier.meta", meta_v1, sizeof meta_v1 - 1);
    else
        fz_put(dir, "kvtier.meta", tp.meta.p, tp.meta.n);
    fz_put(dir, "kvtier.live", tp.live.p, tp.live.n);
    char ns[4300];
    snprintf(ns, sizeof ns, "%s/namespaces", dir);
    if (flags & 4)
        unlink(ns);
    else
        fz_put(dir, "namespaces", data, ns_len);
    kvt_tier_t *t = NULL;
    if (fz_open(dir, &t) == 0) {
        fz_recover_and_use(t);
        kvt_tier_destroy(t);
    } else if (t) {
        abort();
    }
    return 0;
}
