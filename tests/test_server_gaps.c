/*
 * test_server_gaps.c: chains with gaps (docs/protocol.md, "Chains with gaps") against a real
 * kvtierd: a PUT or a zero-copy RESERVE/COMMIT with GAPS stores pages after pages without bytes
 * (a sliding-window layer's window), which a PUT without it skips as before; a MATCH reports
 * every page of the chain with its tier; a window's pages read back byte-exact; REMOVE takes a
 * gapped chain whole; a full tier drops old windows to take new ones, and what is left of a
 * chain after its window went is index-only, trimmed under index-bytes; the remote probe finds a
 * window behind a gap its index knows; a malformed gap frame is refused and changes nothing. A warm
 * restart gives back a window behind a gap, written by a PUT or moved down to NVMe, from the path
 * log the daemon keeps beside the data log (DIR/kvtier.paths); without that log (a directory from
 * before it) the window is an orphan as it was, and a damaged record is skipped and counted.
 */
#include <time.h>

#include "proto.h"
#include "test_raw_frames.h"
#include "test_server_harness.h"

#define PAGE 16
#define BB   8192

/* PUT of pages [first, first + n) of tok's whole pages, page p's bytes filled from seed + p. */
static kvt_client_put_t put_window(kvt_client_t *c, const uint32_t *tok, uint32_t pages,
                                   uint32_t first, uint32_t n, uint32_t bb, uint32_t seed)
{
    uint8_t *payload = malloc((size_t)n * bb);
    for (uint32_t p = 0; p < n; p++)
        kvd_fill(payload + (size_t)p * bb, bb, seed + first + p);
    kvt_client_put_t r = {0};
    int rc = kvt_client_put(c, tok, pages * PAGE, first, n, payload, NULL, &r);
    cr_assert_eq(rc, 0, "put: %s %s", kvt_client_strerror(rc), kvt_client_errmsg(c));
    free(payload);
    return r;
}

/* MATCH of tok's pages with a lease: the tiers in tiers[], the lease returned. */
static uint64_t match_tiers(kvt_client_t *c, const uint32_t *tok, uint32_t pages, uint8_t *tiers,
                            uint32_t *matched)
{
    kvt_client_match_t m = {.tiers = tiers, .tiers_cap = pages};
    cr_assert_eq(kvt_client_match(c, tok, pages * PAGE, KVT_CLIENT_LEASE, 0, NULL, &m), 0);
    *matched = m.pages;
    return m.lease;
}

/* Every page of tiers[0, n) equal to t. */
static int all_in(const uint8_t *tiers, uint32_t from, uint32_t to, uint8_t t)
{
    for (uint32_t i = from; i < to; i++)
        if (tiers[i] != t)
            return 0;
    return 1;
}

static void window_after_a_gap(int zero_copy)
{
    kvd_t d = {0};
    kvd_start(&d, NULL);
    kvt_client_conf_t conf = {.unix_path = d.sock,
                              .model = "swa",
                              .page_size = PAGE,
                              .block_bytes = BB,
                              .timeout_ms = 10000,
                              .zero_copy = zero_copy};
    kvt_client_t *c = NULL;
    cr_assert_eq(kvt_client_connect(&c, &conf), 0);
    cr_assert_eq(kvt_client_zero_copy(c), zero_copy, "%s", kvt_client_zero_copy_reason(c));
    uint32_t old[8 * PAGE], tok[14 * PAGE];
    kvd_tokens(old, 8 * PAGE, 1);
    kvd_tokens(tok, 14 * PAGE, 5000);

    /* Without GAPS, as before: pages after pages without bytes are skipped. */
    kvt_client_put_t r = put_window(c, old, 8, 5, 3, BB, 0);
    cr_expect_eq(r.stored, 0);
    cr_expect_eq(r.skipped, 3);

    /* With it, the window [5, 8) is stored after 5 pages without bytes. */
    cr_expect_eq(kvt_client_set_put_flags(c, KVT_CLIENT_PUT_GAPS), 0);
    r = put_window(c, tok, 8, 5, 3, BB, 100);
    cr_expect_eq(r.pages, 8);
    cr_expect_eq(r.new_pages, 8);
    cr_expect_eq(r.stored, 3);
    cr_expect_eq(r.skipped, 0);
    /* The window moves on: [6, 10) (6 and 7 held already), then [12, 14) after a new gap. */
    r = put_window(c, tok, 10, 6, 4, BB, 100);
    cr_expect_eq(r.stored, 2);
    cr_expect_eq(r.skipped, 2);
    r = put_window(c, tok, 14, 12, 2, BB, 100);
    cr_expect_eq(r.stored, 2);
    cr_expect_eq(kvt_client_set_put_flags(c, 0), KVT_CLIENT_PUT_GAPS);

    uint8_t tiers[16];
    uint32_t pages = 0;
    uint64_t lease = match_tiers(c, tok, 14, tiers, &pages);
    cr_assert_eq(pages, 14, "the whole chain is known");
    cr_expect(all_in(tiers, 0, 5, KVT_CLIENT_TIER_NONE));
    cr_expect(all_in(tiers, 5, 10, KVT_CLIENT_TIER_DRAM));
    cr_expect(all_in(tiers, 10, 12, KVT_CLIENT_TIER_NONE));
    cr_expect(all_in(tiers, 12, 14, KVT_CLIENT_TIER_DRAM));
    kvd_check_get(c, lease, 5, 5, BB, 100, NULL);
    kvd_check_get(c, lease, 12, 2, BB, 100, NULL);
    uint8_t one[BB];
    cr_expect_eq(kvt_client_get(c, lease, 0, 1, one, sizeof one, NULL, NULL), KVT_CLIENT_ENOENT,
                 "a page without bytes");
    cr_expect_eq(kvt_client_release(c, lease, NULL), 0);

    /* The daemon counts what it holds: 7 pages in DRAM, stored by PUTs, 2 nodes split. */
    cr_expect_eq(kvd_metric(&d, "kvtier_tier_blocks{tier=\"dram\"}"), 7);
    cr_expect_eq(kvd_metric(&d, "kvtier_put_pages_total{outcome=\"stored\"}"), 7);
    cr_expect_eq(kvd_metric(&d, "kvtier_put_gap_splits_total"), 2);
    kvt_client_close(c);
    kvd_cleanup(&d);
}

Test(server_gaps, a_window_is_stored_after_pages_without_bytes)
{
    window_after_a_gap(0);
}

Test(server_gaps, a_window_is_reserved_and_committed_after_pages_without_bytes)
{
    window_after_a_gap(1);
}

/* REMOVE of a gapped chain takes its pages with bytes below the gap with it. */
Test(server_gaps, remove_takes_a_gapped_chain)
{
    kvd_t d = {0};
    kvd_start(&d, NULL);
    kvt_client_t *c = kvd_client(&d, "swa", PAGE, BB);
    uint32_t tok[8 * PAGE];
    kvd_tokens(tok, 8 * PAGE, 7);
    kvt_client_set_put_flags(c, KVT_CLIENT_PUT_GAPS);
    cr_assert_eq(put_window(c, tok, 8, 4, 4, BB, 1).stored, 4);
    cr_expect_eq(kvd_metric(&d, "kvtier_tier_blocks{tier=\"dram\"}"), 4);
    /* Leased, it stays. */
    uint8_t tiers[8];
    uint32_t pages;
    uint64_t lease = match_tiers(c, tok, 8, tiers, &pages);
    cr_expect_eq(kvt_client_remove(c, tok, 2 * PAGE), KVT_CLIENT_EBUSY);
    cr_expect_eq(kvt_client_release(c, lease, NULL), 0);
    /* From page 1 on: the gap's pages 1..3 and the window 4..7 go, page 0 stays. */
    cr_assert_eq(kvt_client_remove(c, tok, 2 * PAGE), 0);
    kvt_client_match_t m = {0};
    cr_assert_eq(kvt_client_match(c, tok, 8 * PAGE, 0, 0, NULL, &m), 0);
    cr_expect_eq(m.pages, 1);
    cr_expect_eq(kvd_metric(&d, "kvtier_tier_blocks{tier=\"dram\"}"), 0);
    cr_expect_eq(kvd_metric(&d, "kvtier_tier_used_bytes{tier=\"dram\"}"), 0);
    cr_expect_eq(kvd_metric(&d, "kvtier_index_blocks"), 1);
    kvt_client_close(c);
    kvd_cleanup(&d);
}

/*
 * A full DRAM tier (no NVMe) takes new windows by dropping the oldest ones, as it drops any
 * pages; a chain whose window went is left with its index-only pages, which index-bytes bounds:
 * with many chains the index stays under it, trimming them least recently used first.
 */
Test(server_gaps, full_tiers_drop_old_windows_and_the_index_trims_their_gaps)
{
    enum { BIG = 64 << 10, CHAINS = 200, LEN = 12, WIN = 4 };
    kvd_t d = {0};
    kvd_start(&d, "--dram-bytes", "1M", "--nvme-bytes", "0", "--index-bytes", "256K", NULL);
    kvt_client_t *c = kvd_client(&d, "swa", PAGE, BIG);
    kvt_client_set_put_flags(c, KVT_CLIENT_PUT_GAPS);
    static uint32_t tok[CHAINS][LEN * PAGE];
    for (uint32_t k = 0; k < CHAINS; k++) {
        kvd_tokens(tok[k], LEN * PAGE, 100000 * (k + 1));
        kvt_client_put_t r = put_window(c, tok[k], LEN, LEN - WIN, WIN, BIG, k);
        cr_assert_eq(r.stored, WIN, "chain %u: stored %u (room is made for new windows)", k,
                     r.stored);
    }
    cr_expect_leq(kvd_metric(&d, "kvtier_tier_used_bytes{tier=\"dram\"}"), 1 << 20);
    /* The newest window is whole and byte-exact. */
    uint8_t tiers[LEN];
    uint32_t pages;
    uint64_t lease = match_tiers(c, tok[CHAINS - 1], LEN, tiers, &pages);
    cr_assert_eq(pages, LEN);
    cr_expect(all_in(tiers, 0, LEN - WIN, KVT_CLIENT_TIER_NONE));
    cr_expect(all_in(tiers, LEN - WIN, LEN, KVT_CLIENT_TIER_DRAM));
    kvd_check_get(c, lease, LEN - WIN, WIN, BIG, CHAINS - 1, NULL);
    kvt_client_release(c, lease, NULL);
    /* The oldest lost its window: what the index still holds of it has no bytes. */
    kvt_client_match_t m = {.tiers = tiers, .tiers_cap = LEN};
    cr_assert_eq(kvt_client_match(c, tok[0], LEN * PAGE, 0, 0, NULL, &m), 0);
    cr_expect_lt(m.pages, LEN, "the window's pages left the index with their bytes");
    cr_expect(all_in(tiers, 0, m.pages, KVT_CLIENT_TIER_NONE));
    /* 200 chains of 12 pages do not fit 256K of index: gap pages were trimmed. */
    cr_expect_lt(kvd_metric(&d, "kvtier_index_blocks"), CHAINS * (LEN - WIN));
    cr_expect_leq(kvd_metric(&d, "kvtier_index_bytes"), 256 << 10);
    kvt_client_close(c);
    kvd_cleanup(&d);
}

/*
 * A warm restart rebuilds the index from the NVMe tier's records, each block found by its chain
 * of parents. A window after a gap has no record for the gap's pages: the daemon wrote the
 * gap's path (its tokens from the root) to DIR/kvtier.paths with the window's first page, and
 * the restart gives the gap back as index-only pages with the window's blocks after them,
 * byte-exact. Three chains: a window after a gap from the root, one after a gap in the middle
 * (pages before it stored), and a whole chain.
 */
static void gapped_chains(kvd_t *d, uint32_t *win, uint32_t *mid, uint32_t *whole, const char *dram)
{
    kvd_start(d, "--dram-bytes", dram, NULL);
    kvt_client_t *c = kvd_client(d, "swa", PAGE, BB);
    kvd_tokens(win, 6 * PAGE, 11);
    kvd_tokens(mid, 6 * PAGE, 33000);
    kvd_tokens(whole, 3 * PAGE, 77000);
    kvt_client_set_put_flags(c, KVT_CLIENT_PUT_GAPS);
    cr_assert_eq(put_window(c, win, 6, 4, 2, BB, 5).stored, 2);
    cr_assert_eq(put_window(c, mid, 2, 0, 2, BB, 6).stored, 2);
    cr_assert_eq(put_window(c, mid, 6, 4, 2, BB, 6).stored, 2);
    cr_assert_eq(put_window(c, whole, 3, 0, 3, BB, 9).stored, 3);
    kvt_client_close(c);
    cr_assert_eq(kvd_stop(d), 0);
}

/* After the restart: which pages of each chain hold bytes, and the bytes. */
static void check_gapped(kvt_client_t *c, const uint32_t *win, const uint32_t *mid,
                         const uint32_t *whole, int windows_back)
{
    uint8_t tiers[6];
    uint32_t pages = 0;
    uint64_t lease = match_tiers(c, win, 6, tiers, &pages);
    if (windows_back) {
        cr_assert_eq(pages, 6, "the gap's pages are known again");
        cr_expect(all_in(tiers, 0, 4, KVT_CLIENT_TIER_NONE));
        cr_expect(all_in(tiers, 4, 6, KVT_CLIENT_TIER_NVME));
        kvd_check_get(c, lease, 4, 2, BB, 5, NULL);
    } else {
        cr_expect_eq(pages, 0, "the window is gone with its gap");
    }
    if (lease)
        cr_expect_eq(kvt_client_release(c, lease, NULL), 0);
    lease = match_tiers(c, mid, 6, tiers, &pages);
    cr_assert_eq(pages, windows_back ? 6 : 2);
    cr_expect(all_in(tiers, 0, 2, KVT_CLIENT_TIER_NVME));
    kvd_check_get(c, lease, 0, 2, BB, 6, NULL);
    if (windows_back) {
        cr_expect(all_in(tiers, 2, 4, KVT_CLIENT_TIER_NONE));
        cr_expect(all_in(tiers, 4, 6, KVT_CLIENT_TIER_NVME));
        kvd_check_get(c, lease, 4, 2, BB, 6, NULL);
    }
    cr_expect_eq(kvt_client_release(c, lease, NULL), 0);
    lease = match_tiers(c, whole, 3, tiers, &pages);
    cr_expect_eq(pages, 3);
    kvd_check_get(c, lease, 0, 3, BB, 9, NULL);
    cr_expect_eq(kvt_client_release(c, lease, NULL), 0);
}

Test(server_gaps, a_warm_restart_gives_back_a_window_behind_a_gap)
{
    kvd_t d = {0};
    uint32_t win[6 * PAGE], mid[6 * PAGE], whole[3 * PAGE];
    gapped_chains(&d, win, mid, whole, "0");
    for (int round = 0; round < 2; round++) {
        /* The second restart reads the path log as the first one's recovery rewrote it. */
        kvd_startv(&d, (const char *const[]){"--dram-bytes", "0", NULL});
        kvt_client_t *c = kvd_client(&d, "swa", PAGE, BB);
        cr_expect_eq(kvd_stat(c, "nvme_recovery_blocks_inserted"), 9, "round %d", round);
        cr_expect_eq(kvd_stat(c, "nvme_recovery_blocks_orphan"), 0, "round %d", round);
        cr_expect_eq(kvd_stat(c, "nvme_recovery_blocks_torn"), 0);
        cr_expect_eq(kvd_stat(c, "nvme_blocks"), 9);
        check_gapped(c, win, mid, whole, 1);
        kvt_client_close(c);
        cr_assert_eq(kvd_stop(&d), 0);
    }
    kvd_cleanup(&d);
}

/* A window moved down from DRAM to NVMe (the policy's demotion, not a PUT) records its path
 * too: a one-page window, which a demotion moves alone. */
Test(server_gaps, a_window_moved_down_to_nvme_comes_back_after_a_restart)
{
    kvd_t d = {0};
    kvd_start(&d, "--dram-bytes", "64K", NULL);
    kvt_client_t *c = kvd_client(&d, "swa", PAGE, BB);
    uint32_t win[6 * PAGE], fill[8 * PAGE];
    kvd_tokens(win, 6 * PAGE, 11);
    kvt_client_set_put_flags(c, KVT_CLIENT_PUT_GAPS);
    cr_assert_eq(put_window(c, win, 6, 5, 1, BB, 5).stored, 1);
    /* Newer pages fill DRAM (8 blocks) over and over: the window goes down to NVMe. */
    uint8_t tiers[6];
    uint32_t pages = 0;
    for (uint32_t k = 0; k < 8; k++) {
        kvd_tokens(fill, 8 * PAGE, 50000 + 1000 * k);
        put_window(c, fill, 8, 0, 8, BB, 40);
        kvt_client_match_t m = {.tiers = tiers, .tiers_cap = 6};
        cr_assert_eq(kvt_client_match(c, win, 6 * PAGE, KVT_CLIENT_PROBE, 0, NULL, &m), 0);
        if (m.pages == 6 && tiers[5] == KVT_CLIENT_TIER_NVME)
            break;
    }
    /* Looked at without a use (PROBE): a use would bring it back up to DRAM. */
    kvt_client_match_t m = {.tiers = tiers, .tiers_cap = 6};
    cr_assert_eq(kvt_client_match(c, win, 6 * PAGE, KVT_CLIENT_PROBE, 0, NULL, &m), 0);
    cr_assert_eq(m.pages, 6);
    cr_assert_eq(tiers[5], KVT_CLIENT_TIER_NVME, "the window went down: %u", tiers[5]);
    kvt_client_close(c);
    cr_assert_eq(kvd_stop(&d), 0);

    kvd_startv(&d, (const char *const[]){"--dram-bytes", "64K", NULL});
    c = kvd_client(&d, "swa", PAGE, BB);
    uint64_t lease = match_tiers(c, win, 6, tiers, &pages);
    cr_assert_eq(pages, 6, "the window is back behind its gap");
    cr_expect(all_in(tiers, 0, 5, KVT_CLIENT_TIER_NONE));
    kvd_check_get(c, lease, 5, 1, BB, 5, NULL);
    kvt_client_release(c, lease, NULL);
    kvt_client_close(c);
    kvd_cleanup(&d);
}

/*
 * A directory written before the path log (or whose log was lost) recovers as it did: the data
 * log's format is unchanged, the window is an orphan (a miss, never wrong bytes), the rest comes
 * back.
 */
Test(server_gaps, a_warm_restart_without_the_path_log_frees_the_window_as_before)
{
    kvd_t d = {0};
    uint32_t win[6 * PAGE], mid[6 * PAGE], whole[3 * PAGE];
    gapped_chains(&d, win, mid, whole, "0");
    char path[700];
    snprintf(path, sizeof path, "%s/kvtier-data/kvtier.paths", d.dir);
    cr_assert_eq(unlink(path), 0, "the path log was written: %s", strerror(errno));
    kvd_startv(&d, (const char *const[]){"--dram-bytes", "0", NULL});
    kvt_client_t *c = kvd_client(&d, "swa", PAGE, BB);
    cr_expect_eq(kvd_stat(c, "nvme_recovery_blocks_inserted"), 5);
    cr_expect_eq(kvd_stat(c, "nvme_recovery_blocks_orphan"), 4);
    check_gapped(c, win, mid, whole, 0);
    kvt_client_close(c);
    kvd_cleanup(&d);
}

/* A damaged record of the path log is skipped and counted as torn: its window is an orphan, the
 * window whose record is intact comes back. */
Test(server_gaps, a_damaged_path_record_is_skipped_and_counted)
{
    kvd_t d = {0};
    uint32_t win[6 * PAGE], mid[6 * PAGE], whole[3 * PAGE];
    gapped_chains(&d, win, mid, whole, "0");
    char path[700];
    snprintf(path, sizeof path, "%s/kvtier-data/kvtier.paths", d.dir);
    FILE *f = fopen(path, "r+");
    cr_assert(f);
    /* The first record (win's): a token byte after the 8-byte magic and its 56-byte header. */
    cr_assert_eq(fseek(f, 8 + 56 + 5, SEEK_SET), 0);
    int ch = fgetc(f);
    cr_assert_eq(fseek(f, 8 + 56 + 5, SEEK_SET), 0);
    fputc(ch ^ 0x40, f);
    fclose(f);
    kvd_startv(&d, (const char *const[]){"--dram-bytes", "0", NULL});
    kvt_client_t *c = kvd_client(&d, "swa", PAGE, BB);
    cr_expect_eq(kvd_stat(c, "nvme_recovery_blocks_torn"), 1);
    cr_expect_eq(kvd_stat(c, "nvme_recovery_blocks_orphan"), 2);
    cr_expect_eq(kvd_stat(c, "nvme_recovery_blocks_inserted"), 7);
    kvt_client_match_t m = {0};
    cr_assert_eq(kvt_client_match(c, win, 6 * PAGE, 0, 0, NULL, &m), 0);
    cr_expect_eq(m.pages, 0, "win's record was damaged: its window is gone");
    uint8_t tiers[6];
    uint32_t pages = 0;
    uint64_t lease = match_tiers(c, mid, 6, tiers, &pages);
    cr_assert_eq(pages, 6);
    kvd_check_get(c, lease, 4, 2, BB, 6, NULL);
    kvt_client_release(c, lease, NULL);
    kvt_client_close(c);
    kvd_cleanup(&d);
}

/*
 * The remote probe asks the shared server for the pages after the local match and stops at the
 * first it does not find. A window stored there after a gap (its daemon keeps nothing locally)
 * is not found by a daemon that knows nothing of the chain (page 0 was never written anywhere:
 * a miss), and is found, after the gap, by one whose index holds the gap's pages.
 */
Test(server_gaps, the_remote_probe_finds_a_window_after_a_gap_it_knows)
{
    const char *addr = getenv("KVT_TEST_REDIS");
    if (!addr || !*addr)
        cr_skip_test("KVT_TEST_REDIS is not set: no redis-server to test against");
    char pfx[64];
    snprintf(pfx, sizeof pfx, "kvgaps%d-%ld", (int)getpid(), (long)time(NULL));
    kvd_t a = {0}, b = {0};
    kvd_start(&a, "--dram-bytes", "0", "--nvme-bytes", "0", "--remote", addr, "--remote-prefix",
              pfx, NULL);
    kvd_start(&b, "--remote", addr, "--remote-prefix", pfx, NULL);
    kvt_client_t *ca = kvd_client(&a, "swa", PAGE, BB), *cb = kvd_client(&b, "swa", PAGE, BB);
    uint32_t tok[6 * PAGE];
    kvd_tokens(tok, 6 * PAGE, 31);
    kvt_client_set_put_flags(ca, KVT_CLIENT_PUT_GAPS);
    cr_assert_eq(put_window(ca, tok, 6, 4, 2, BB, 3).stored, 2);
    uint8_t tiers[6];
    kvt_client_match_t m = {.tiers = tiers, .tiers_cap = 6};
    unsigned probe = KVT_CLIENT_LEASE | KVT_CLIENT_REMOTE | KVT_CLIENT_PROBE;
    cr_assert_eq(kvt_client_match(cb, tok, 6 * PAGE, probe, 0, NULL, &m), 0);
    cr_expect_eq(m.pages, 0, "page 0 is in no tier anywhere");
    kvt_client_put_t r;
    cr_assert_eq(kvt_client_put(cb, tok, 4 * PAGE, 0, 0, NULL, NULL, &r), 0); /* the gap */
    cr_assert_eq(kvt_client_match(cb, tok, 6 * PAGE, probe, 0, NULL, &m), 0);
    cr_assert_eq(m.pages, 6);
    cr_expect_eq(m.remote_pages, 2);
    cr_expect(all_in(tiers, 0, 4, KVT_CLIENT_TIER_NONE));
    cr_expect(all_in(tiers, 4, 6, KVT_CLIENT_TIER_REMOTE));
    kvd_check_get(cb, m.lease, 4, 2, BB, 3, NULL);
    kvt_client_close(ca);
    kvt_client_close(cb);
    kvd_cleanup(&a);
    kvd_cleanup(&b);
}

static void hello(int fd)
{
    uint8_t body[64];
    kvt_proto_hello_t w = {
        .min_version = 1, .max_version = 1, .page_size = PAGE, .block_bytes = BB, .model_len = 3};
    kvt_proto_hello_encode(body, &w);
    memcpy(body + sizeof(kvt_wire_hello_t), "swa", 3);
    raw_frame(fd, KVT_OP_HELLO, 0, 1, body, sizeof(kvt_wire_hello_t) + 3, KVT_PROTO_MAGIC,
              KVT_PROTO_VERSION);
}

/* Reads one reply: its status. */
static int status_of(int fd, uint64_t id)
{
    uint8_t hdr[KVT_PROTO_HDR];
    cr_assert_eq(read_full(fd, hdr, sizeof hdr), 0, "no reply to %llu", (unsigned long long)id);
    kvt_proto_hdr_t h;
    kvt_proto_hdr_decode(hdr, &h);
    cr_assert_eq(h.request_id, id);
    static uint8_t body[1 << 16];
    cr_assert_leq(h.body_len, sizeof body);
    cr_assert_eq(read_full(fd, body, h.body_len), 0);
    return h.status;
}

/* A PUT with GAPS that is malformed (an unknown flag beside it, pages past the tokens) is refused
 * and adds nothing to the index; the same frame well-formed stores its window. */
Test(server_gaps, a_malformed_gap_frame_changes_nothing)
{
    kvd_t d = {0};
    kvd_start(&d, NULL);
    int fd = kvd_raw(&d);
    hello(fd);
    cr_assert_eq(status_of(fd, 1), 0);
    uint32_t tok[4 * PAGE];
    kvd_tokens(tok, 4 * PAGE, 9);
    size_t len = sizeof(kvt_wire_put_t) + sizeof tok + 2 * BB;
    uint8_t *body = calloc(1, len);
    kvt_proto_put_t q = {.ntokens = 4 * PAGE, .first_page = 2, .npayload = 2};
    kvt_proto_put_encode(body, &q);
    for (uint32_t i = 0; i < 4 * PAGE; i++)
        kvt_put_u32(body + sizeof(kvt_wire_put_t) + 4 * i, tok[i]);
    raw_frame(fd, KVT_OP_PUT, KVT_PUT_F_GAPS | 0x4, 2, body, (uint32_t)len, KVT_PROTO_MAGIC,
              KVT_PROTO_VERSION);
    cr_expect_eq(status_of(fd, 2), KVT_EPROTO, "an unknown flag beside GAPS");
    q.first_page = 3; /* pages 3 and 4 of 4 */
    kvt_proto_put_encode(body, &q);
    raw_frame(fd, KVT_OP_PUT, KVT_PUT_F_GAPS, 3, body, (uint32_t)len, KVT_PROTO_MAGIC,
              KVT_PROTO_VERSION);
    cr_expect_eq(status_of(fd, 3), KVT_EINVAL, "pages past the request's");
    uint8_t rbody[sizeof(kvt_wire_reserve_t) + sizeof tok];
    kvt_proto_reserve_t rq = {.ntokens = 4 * PAGE, .first_page = 2, .npages = 2};
    kvt_proto_reserve_encode(rbody, &rq);
    memcpy(rbody + sizeof(kvt_wire_reserve_t), body + sizeof(kvt_wire_put_t), sizeof tok);
    raw_frame(fd, KVT_OP_RESERVE, KVT_PUT_F_GAPS | 0x8, 5, rbody, sizeof rbody, KVT_PROTO_MAGIC,
              KVT_PROTO_VERSION);
    cr_expect_eq(status_of(fd, 5), KVT_EPROTO, "RESERVE: an unknown flag beside GAPS");
    kvt_client_t *c = kvd_client(&d, "swa", PAGE, BB);
    kvt_client_match_t m = {0};
    cr_assert_eq(kvt_client_match(c, tok, 4 * PAGE, 0, 0, NULL, &m), 0);
    cr_expect_eq(m.pages, 0, "nothing was added");
    cr_expect_eq(kvd_metric(&d, "kvtier_index_blocks"), 0);
    q.first_page = 2;
    kvt_proto_put_encode(body, &q);
    raw_frame(fd, KVT_OP_PUT, KVT_PUT_F_GAPS, 4, body, (uint32_t)len, KVT_PROTO_MAGIC,
              KVT_PROTO_VERSION);
    cr_expect_eq(status_of(fd, 4), 0);
    uint8_t tiers[4];
    m = (kvt_client_match_t){.tiers = tiers, .tiers_cap = 4};
    cr_assert_eq(kvt_client_match(c, tok, 4 * PAGE, 0, 0, NULL, &m), 0);
    cr_expect_eq(m.pages, 4);
    cr_expect(all_in(tiers, 0, 2, KVT_CLIENT_TIER_NONE));
    cr_expect(all_in(tiers, 2, 4, KVT_CLIENT_TIER_DRAM));
    free(body);
    close(fd);
    kvt_client_close(c);
    kvd_cleanup(&d);
}
