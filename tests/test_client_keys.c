/*
 * test_client_keys.c: libkvtier's block keys (client/keys.c) against the real daemon. Chains share
 * their common prefix in the radix tree (STATS counts the pages once); independent keys are
 * found alone, a suffix without its prefix; a missing key is a per-key miss; a key over
 * KVT_KEY_MAX bytes is refused with a message before anything is sent; the keyed namespace and
 * the token namespace of one model never see each other; bytes round-trip exactly; a small DRAM
 * tier stays within its capacity under keyed PUTs, evicting leaves first.
 */
#include "test_server_harness.h"

#define BB 1024 /* block bytes */

static kvt_keys_t *keyed(const kvd_t *d, const char *model, uint32_t block_bytes)
{
    kvt_client_conf_t conf = {
        .unix_path = d->sock, .model = model, .block_bytes = block_bytes, .timeout_ms = 10000};
    kvt_keys_t *k = NULL;
    int rc = kvt_keys_connect(&k, &conf);
    cr_assert_eq(rc, 0, "keys connect: %s", kvt_client_strerror(rc));
    return k;
}

/* n keys "prefix/i" in names (each up to 31 bytes), described in keys. */
static void mkkeys(kvt_key_t *keys, char (*names)[32], uint32_t n, const char *prefix)
{
    for (uint32_t i = 0; i < n; i++) {
        snprintf(names[i], 32, "%s/%u", prefix, i);
        keys[i] = (kvt_key_t){names[i], strlen(names[i])};
    }
}

Test(client_keys, chains_share_their_common_prefix)
{
    kvd_t d = {0};
    kvd_start(&d, NULL);
    kvt_keys_t *k = keyed(&d, "m", BB);
    kvt_client_t *c = kvt_keys_client(k);
    char an[4][32], bn[5][32];
    kvt_key_t a[4], b[5];
    mkkeys(a, an, 4, "p");
    mkkeys(b, bn, 5, "p");
    snprintf(an[3], 32, "a-tail");
    a[3].len = strlen(an[3]);
    snprintf(bn[3], 32, "b-tail");
    b[3].len = strlen(bn[3]);
    static uint8_t pa[4 * BB], pb[5 * BB], back[5 * BB];
    kvd_fill(pa, sizeof pa, 1);
    kvd_fill(pb, sizeof pb, 2);
    kvt_client_put_t r;
    cr_assert_eq(kvt_keys_chain_put(k, a, 4, 0, 4, pa, &r), 0);
    cr_expect_eq(r.new_pages, 4);
    cr_assert_eq(kvt_keys_chain_put(k, b, 5, 0, 5, pb, &r), 0);
    cr_expect_eq(r.new_pages, 2, "the 3 shared pages are held once: %u new", r.new_pages);
    cr_expect_eq(r.stored, 2);
    cr_expect_eq(kvd_stat(c, "index_blocks"), 6);
    cr_expect_eq(kvd_stat(c, "dram_blocks"), 6);
    uint32_t hits;
    cr_assert_eq(kvt_keys_chain_exists(k, b, 5, &hits), 0);
    cr_expect_eq(hits, 5);
    cr_assert_eq(kvt_keys_chain_exists(k, b, 4, &hits), 0);
    cr_expect_eq(hits, 4);
    uint32_t got;
    cr_assert_eq(kvt_keys_chain_get(k, b, 5, 0, back, sizeof back, &got), 0);
    cr_expect_eq(got, 5);
    cr_expect(memcmp(back, pa, 3 * BB) == 0, "the shared pages hold the first chain's bytes");
    cr_expect(memcmp(back + 3 * BB, pb + 3 * BB, 2 * BB) == 0);
    /* From the middle: keys 3..4 into a two-block buffer. */
    memset(back, 0, sizeof back);
    cr_assert_eq(kvt_keys_chain_get(k, b, 5, 3, back, 2 * BB, &got), 0);
    cr_expect_eq(got, 2);
    cr_expect(memcmp(back, pb + 3 * BB, 2 * BB) == 0);
    /* Leaf removal leaves the prefix. */
    cr_assert_eq(kvt_keys_chain_remove(k, b, 5), 0);
    cr_assert_eq(kvt_keys_chain_exists(k, b, 5, &hits), 0);
    cr_expect_eq(hits, 4);
    cr_expect_eq(kvd_stat(c, "leases"), 0);
    kvt_keys_close(k);
    kvd_cleanup(&d);
}

Test(client_keys, independent_keys_suffix_alone_and_misses_per_key)
{
    kvd_t d = {0};
    kvd_start(&d, NULL);
    kvt_keys_t *k = keyed(&d, "m", BB);
    char names[4][32];
    kvt_key_t keys[4];
    mkkeys(keys, names, 4, "hash");
    static uint8_t data[4][BB], back[4][BB];
    const void *blocks[4];
    for (int i = 0; i < 4; i++) {
        kvd_fill(data[i], BB, 10 + (uint32_t)i);
        blocks[i] = data[i];
    }
    int st[4];
    cr_assert_eq(kvt_keys_put(k, keys, 4, blocks, st), 4);
    /* The suffix alone. */
    uint8_t found[4];
    cr_assert_eq(kvt_keys_exists(k, keys + 2, 2, found), 2);
    cr_expect(found[0] && found[1]);
    /* A miss in the middle. */
    kvt_key_t ask[3] = {keys[3], {"absent", 6}, keys[1]};
    void *bufs[3] = {back[0], back[1], back[2]};
    memset(back, 0x5a, sizeof back);
    cr_assert_eq(kvt_keys_get(k, ask, 3, bufs, st), 2);
    cr_expect_eq(st[0], 0);
    cr_expect_eq(st[1], KVT_CLIENT_ENOENT);
    cr_expect_eq(st[2], 0);
    cr_expect(memcmp(back[0], data[3], BB) == 0);
    cr_expect(memcmp(back[2], data[1], BB) == 0);
    cr_expect_eq(back[1][0], 0x5a, "a missing key's buffer is untouched");
    cr_expect_eq(kvd_stat(kvt_keys_client(k), "leases"), 0, "the gets' leases were released");
    /* An independent key is not the same page as that key inside a chain. */
    uint32_t hits;
    kvt_key_t chain[2] = {{"x", 1}, keys[0]};
    cr_assert_eq(kvt_keys_chain_exists(k, chain, 2, &hits), 0);
    cr_expect_eq(hits, 0);
    cr_assert_eq(kvt_keys_remove(k, ask, 3, st), 2);
    cr_expect_eq(st[1], KVT_CLIENT_ENOENT);
    cr_assert_eq(kvt_keys_exists(k, keys, 4, found), 2);
    cr_expect(found[0] && !found[1] && found[2] && !found[3]);
    kvt_keys_close(k);
    kvd_cleanup(&d);
}

Test(client_keys, a_key_over_key_max_is_refused_with_a_message)
{
    kvd_t d = {0};
    kvd_start(&d, NULL);
    kvt_keys_t *k = keyed(&d, "m", BB);
    static char big[KVT_KEY_MAX + 1];
    memset(big, 'k', sizeof big);
    static uint8_t blk[BB];
    kvt_key_t ok = {big, KVT_KEY_MAX};
    cr_assert_eq(kvt_keys_chain_put(k, &ok, 1, 0, 1, blk, NULL), 0);
    uint64_t before = kvd_stat(kvt_keys_client(k), "lookups");
    kvt_key_t keys[2] = {ok, {big, KVT_KEY_MAX + 1}};
    uint32_t hits = 7;
    cr_expect_eq(kvt_keys_chain_exists(k, keys, 2, &hits), KVT_CLIENT_EINVAL);
    cr_expect(strstr(kvt_keys_errmsg(k), "key 1 is 1025 bytes"), "message: %s", kvt_keys_errmsg(k));
    uint8_t found[2];
    cr_expect_eq(kvt_keys_exists(k, keys, 2, found), KVT_CLIENT_EINVAL);
    kvt_key_t empty = {"", 0};
    cr_expect_eq(kvt_keys_exists(k, &empty, 1, found), KVT_CLIENT_EINVAL);
    uint32_t t[KVT_KEY_TOKENS];
    cr_expect_eq(kvt_key_tokens(big, KVT_KEY_MAX + 1, t), KVT_CLIENT_EINVAL);
    cr_expect_eq(kvd_stat(kvt_keys_client(k), "lookups"), before, "nothing was sent");
    /* The connection still serves. */
    cr_assert_eq(kvt_keys_chain_exists(k, &ok, 1, &hits), 0);
    cr_expect_eq(hits, 1);
    cr_expect_str_eq(kvt_keys_errmsg(k), "");
    kvt_keys_close(k);
    kvd_cleanup(&d);
}

Test(client_keys, keyed_and_token_namespaces_do_not_see_each_other)
{
    kvd_t d = {0};
    kvd_start(&d, NULL);
    kvt_keys_t *k = keyed(&d, "m", BB);
    kvt_client_t *t = kvd_client(&d, "m", KVT_KEY_TOKENS, BB); /* same model, same page size */
    kvt_key_t key = {"the-key", 7};
    uint32_t tok[2 * KVT_KEY_TOKENS];
    cr_assert_eq(kvt_key_tokens(key.data, key.len, tok), 0);
    memcpy(tok + KVT_KEY_TOKENS, tok, sizeof tok / 2);
    static uint8_t kb[BB], tb[2 * BB], back[BB];
    kvd_fill(kb, sizeof kb, 1);
    kvd_fill(tb, sizeof tb, 2);
    const void *blocks[1] = {kb};
    cr_assert_eq(kvt_keys_put(k, &key, 1, blocks, NULL), 1);
    kvt_client_match_t m = {0};
    cr_assert_eq(kvt_client_match(t, tok, KVT_KEY_TOKENS, 0, 0, NULL, &m), 0);
    cr_expect_eq(m.pages, 0, "the token namespace does not see the key's page");
    kvt_client_put_t r;
    cr_assert_eq(kvt_client_put(t, tok, 2 * KVT_KEY_TOKENS, 0, 2, tb, NULL, &r), 0);
    cr_expect_eq(r.new_pages, 2);
    void *bufs[1] = {back};
    cr_assert_eq(kvt_keys_get(k, &key, 1, bufs, NULL), 1);
    cr_expect(memcmp(back, kb, BB) == 0, "the key keeps its own bytes");
    kvt_key_t two[2] = {key, key};
    uint32_t hits;
    cr_assert_eq(kvt_keys_chain_exists(k, two, 2, &hits), 0);
    cr_expect_eq(hits, 1, "the token pages are not the keyed chain's");
    kvt_client_close(t);
    kvt_keys_close(k);
    kvd_cleanup(&d);
}

Test(client_keys, mapping_is_xxh3_128_high_half_first)
{
    /* docs/protocol.md, "Keyed blocks": a worked example other clients can check against. */
    uint32_t t[KVT_KEY_TOKENS];
    cr_assert_eq(kvt_key_tokens("abc", 3, t), 0);
    cr_expect_eq(t[0], 0x06b05ab6u);
    cr_expect_eq(t[1], 0x733a6185u);
    cr_expect_eq(t[2], 0x78af5f94u);
    cr_expect_eq(t[3], 0x892f3950u);
}

Test(client_keys, a_small_tier_stays_within_capacity)
{
    kvd_t d = {0};
    kvd_start(&d, "--dram-bytes", "256K", "--nvme-bytes", "0", NULL);
    kvt_keys_t *k = keyed(&d, "m", 4096);
    kvt_client_t *c = kvt_keys_client(k);
    uint64_t cap = kvd_stat(c, "dram_capacity_bytes");
    static uint8_t p[4 * 4096], back[4 * 4096];
    char names[4][32];
    kvt_key_t keys[4];
    for (uint32_t i = 0; i < 40; i++) { /* 640 KiB of new leaves through a 256 KiB tier */
        mkkeys(keys, names, 4, "shared");
        snprintf(names[2], 32, "ev%u/0", i);
        snprintf(names[3], 32, "ev%u/1", i);
        keys[2].len = strlen(names[2]);
        keys[3].len = strlen(names[3]);
        kvd_fill(p, sizeof p, 100 + i);
        cr_assert_eq(kvt_keys_chain_put(k, keys, 4, 0, 4, p, NULL), 0);
        cr_assert_leq(kvd_stat(c, "dram_used_bytes"), cap);
    }
    uint32_t hits, got;
    cr_assert_eq(kvt_keys_chain_exists(k, keys, 2, &hits), 0);
    cr_expect_eq(hits, 2, "the shared prefix (inner pages) outlives the leaves");
    cr_assert_eq(kvt_keys_chain_get(k, keys, 4, 2, back, 2 * 4096, &got), 0);
    cr_expect_eq(got, 2);
    cr_expect(memcmp(back, p + 2 * 4096, 2 * 4096) == 0);
    snprintf(names[2], 32, "ev0/0");
    keys[2].len = strlen(names[2]);
    cr_assert_eq(kvt_keys_chain_exists(k, keys, 3, &hits), 0);
    cr_expect_eq(hits, 2, "the first chain's leaf was evicted");
    kvt_keys_close(k);
    kvd_cleanup(&d);
}

/* A chain's lookup keeps its keys' tokens and the PUT after it names them: the PUT stores what a
 * PUT of every key stores, also when the daemon no longer holds the handle (replaced by 16
 * newer ones: the PUT goes again in full), and refuses a kept chain longer than its keys. The
 * bytes on the wire are counted in tests/python/test_keys_keep.py. */
Test(client_keys, a_put_after_a_kept_lookup_stores_the_whole_chain)
{
    kvd_t d = {0};
    kvd_start(&d, NULL);
    kvt_keys_t *k = keyed(&d, "m", BB);
    char an[5][32], xn[16][32];
    kvt_key_t a[5], x[16];
    mkkeys(a, an, 5, "kept");
    mkkeys(x, xn, 16, "other");
    static uint8_t pa[5 * BB], back[5 * BB];
    kvd_fill(pa, sizeof pa, 7);
    kvt_client_put_t r;
    cr_assert_eq(kvt_keys_chain_put(k, a, 1, 0, 1, pa, &r), 0);
    uint32_t hits = 9;
    kvt_keys_kept_t kept;
    cr_assert_eq(kvt_keys_chain_exists_kept(k, a, 3, &hits, &kept), 0);
    cr_expect_eq(hits, 1);
    cr_assert_neq(kept.handle, 0);
    cr_expect_eq(kept.keys, 3);
    cr_expect_eq(kvt_keys_chain_put_kept(k, &kept, a, 2, 1, 1, pa + BB, &r), KVT_CLIENT_EINVAL);
    cr_expect(strstr(kvt_keys_errmsg(k), "kept 3 keys"), "%s", kvt_keys_errmsg(k));
    cr_assert_eq(kvt_keys_chain_put_kept(k, &kept, a, 4, 1, 3, pa + BB, &r), 0);
    cr_expect(r.pages == 4 && r.new_pages == 3 && r.stored == 3, "%u %u %u", r.pages, r.new_pages,
              r.stored);
    /* Replaced: 16 newer handles on the connection. */
    for (int i = 0; i < 16; i++) {
        kvt_keys_kept_t o;
        cr_assert_eq(kvt_keys_chain_exists_kept(k, &x[i], 1, &hits, &o), 0);
        cr_assert_neq(o.handle, 0);
    }
    const void *blk[1] = {pa + 4 * BB};
    cr_assert_eq(kvt_keys_chain_putv_kept(k, &kept, a, 5, 4, 1, blk, &r), 0);
    cr_expect(r.pages == 5 && r.new_pages == 1 && r.stored == 1, "%u %u %u", r.pages, r.new_pages,
              r.stored);
    uint32_t got = 0;
    cr_assert_eq(kvt_keys_chain_get_kept(k, a, 5, 0, back, sizeof back, &got, &kept), 0);
    cr_expect_eq(got, 5);
    cr_expect_eq(kept.keys, 5);
    cr_expect(memcmp(back, pa, sizeof pa) == 0, "the chain's bytes");
    kvt_keys_close(k);
    kvd_stop(&d);
}

/* A mapped keyed client on d (the zero-copy path of kvt_keys_put). */
static kvt_keys_t *keyed_mapped(const kvd_t *d, uint32_t block_bytes)
{
    kvt_client_conf_t conf = {.unix_path = d->sock,
                              .model = "m",
                              .block_bytes = block_bytes,
                              .timeout_ms = 10000,
                              .zero_copy = 1};
    kvt_keys_t *k = NULL;
    cr_assert_eq(kvt_keys_connect(&k, &conf), 0);
    cr_assert(kvt_client_zero_copy(kvt_keys_client(k)), "%s",
              kvt_client_zero_copy_reason(kvt_keys_client(k)));
    return k;
}

/* 300 independent keys through the mapping: more than a chunk (256) and than a group of
 * pipelined reservations (each.h, 32), so every group boundary is crossed; each key gets its own
 * bytes back, the pages are sealed with the client's sums, every reservation is committed; a
 * second PUT of the same keys (held already, one new among them) stores only the new one and
 * says true for all. */
Test(client_keys, independent_puts_through_the_mapping_in_groups)
{
    kvd_t d = {0};
    kvd_start(&d, NULL);
    kvt_keys_t *k = keyed_mapped(&d, BB);
    enum { N = 300 };
    static char names[N][32];
    static kvt_key_t keys[N];
    static uint8_t p[N * BB], back[N * BB];
    static const void *blk[N];
    static void *out[N];
    static int st[N];
    mkkeys(keys, names, N, "grp");
    kvd_fill(p, sizeof p, 41);
    for (uint32_t i = 0; i < N; i++) {
        blk[i] = p + (size_t)i * BB;
        out[i] = back + (size_t)i * BB;
    }
    cr_assert_eq(kvt_keys_put(k, keys, N - 1, blk, st), N - 1);
    for (uint32_t i = 0; i < N - 1; i++)
        cr_assert_eq(st[i], 0, "key %u: %d", i, st[i]);
    cr_expect_eq(kvd_metric(&d, "kvtier_reservations_total{outcome=\"committed\"}"), N - 1);
    cr_expect_eq(kvd_metric(&d, "kvtier_zero_copy_client_sums_total"), N - 1);
    cr_expect_eq(kvd_metric(&d, "kvtier_put_pages_total{outcome=\"stored\"}"), N - 1);
    cr_assert_eq(kvt_keys_put(k, keys, N, blk, st), N, "held keys count as cached");
    for (uint32_t i = 0; i < N; i++)
        cr_assert_eq(st[i], 0, "key %u: %d", i, st[i]);
    cr_expect_eq(kvd_metric(&d, "kvtier_put_pages_total{outcome=\"stored\"}"), N,
                 "only the new key was stored again");
    cr_assert_eq(kvt_keys_get(k, keys, N, out, st), N);
    cr_expect(memcmp(back, p, sizeof p) == 0, "each key's own bytes");
    kvt_keys_close(k);
    kvd_stop(&d);
}

/* Where the daemon holds one reservation per connection, the pipelined RESERVEs past the first
 * of a group are refused (ENOSPC): those keys go by a socket PUT each, and every key is stored
 * with its own bytes all the same. With no checksums (zero-copy-checksum no) the copies go
 * without hashing. */
Test(client_keys, independent_puts_past_max_reservations_go_by_the_socket)
{
    kvd_t d = {0};
    kvd_start(&d, "--max-reservations", "1", "--zero-copy-checksum", "no", NULL);
    kvt_keys_t *k = keyed_mapped(&d, BB);
    enum { N = 40 };
    char names[N][32];
    kvt_key_t keys[N];
    static uint8_t p[N * BB], back[N * BB];
    const void *blk[N];
    void *out[N];
    int st[N];
    mkkeys(keys, names, N, "one-resv");
    kvd_fill(p, sizeof p, 43);
    for (uint32_t i = 0; i < N; i++) {
        blk[i] = p + (size_t)i * BB;
        out[i] = back + (size_t)i * BB;
    }
    cr_assert_eq(kvt_keys_put(k, keys, N, blk, st), N);
    for (uint32_t i = 0; i < N; i++)
        cr_assert_eq(st[i], 0, "key %u: %d", i, st[i]);
    /* One reservation in each group of 32 (two groups), the rest by the socket. */
    cr_expect_eq(kvd_metric(&d, "kvtier_reservations_total{outcome=\"committed\"}"), 2);
    cr_expect_eq(kvd_metric(&d, "kvtier_zero_copy_client_sums_total"), 0);
    cr_assert_eq(kvt_keys_get(k, keys, N, out, st), N);
    cr_expect(memcmp(back, p, sizeof p) == 0, "each key's own bytes");
    kvt_keys_close(k);
    kvd_stop(&d);
}

/* The daemon gone before a mapped client's keyed PUTs: a transport error (the call's statuses
 * are not set, as on the socket), and the connection broken for the next call. */
Test(client_keys, independent_puts_through_the_mapping_when_the_daemon_is_gone)
{
    kvd_t d = {0};
    kvd_start(&d, NULL);
    kvt_keys_t *k = keyed_mapped(&d, BB);
    enum { N = 40 };
    char names[N][32];
    kvt_key_t keys[N];
    static uint8_t p[N * BB];
    const void *blk[N];
    int st[N];
    mkkeys(keys, names, N, "gone");
    for (uint32_t i = 0; i < N; i++)
        blk[i] = p + (size_t)i * BB;
    cr_assert_eq(kvt_keys_put(k, keys, 2, blk, st), 2);
    cr_assert_eq(kvd_stop(&d), 0);
    int rc = kvt_keys_put(k, keys + 2, N - 2, blk + 2, st + 2);
    cr_expect(rc < 0 && (rc > -30000 || rc == KVT_CLIENT_ECLOSED), "a transport error, not %d", rc);
    cr_expect_eq(kvt_keys_put(k, keys, 2, blk, st), KVT_CLIENT_ECLOSED, "the connection is broken");
    kvt_keys_close(k);
    kvd_cleanup(&d);
}

/* A chain's blocks in buffers of their own, on the socket: each sent from where it lies (no
 * gather copy), in one PUT, and read back in order. */
Test(client_keys, a_chain_of_separate_blocks_on_the_socket_round_trips)
{
    kvd_t d = {0};
    kvd_start(&d, NULL);
    kvt_keys_t *k = keyed(&d, "m", BB);
    cr_assert_not(kvt_client_zero_copy(kvt_keys_client(k)), "the socket path");
    char names[3][32];
    kvt_key_t keys[3];
    mkkeys(keys, names, 3, "sep");
    static uint8_t a[BB], b[BB], c[BB], back[3 * BB];
    kvd_fill(a, BB, 51);
    kvd_fill(b, BB, 52);
    kvd_fill(c, BB, 53);
    const void *blk[3] = {c, a, b};
    kvt_client_put_t r;
    cr_assert_eq(kvt_keys_chain_putv(k, keys, 3, 0, 3, blk, &r), 0);
    cr_expect(r.pages == 3 && r.new_pages == 3 && r.stored == 3, "%u %u %u", r.pages, r.new_pages,
              r.stored);
    uint32_t got = 0;
    cr_assert_eq(kvt_keys_chain_get(k, keys, 3, 0, back, sizeof back, &got), 0);
    cr_expect_eq(got, 3);
    cr_expect(memcmp(back, c, BB) == 0 && memcmp(back + BB, a, BB) == 0 &&
                  memcmp(back + 2 * BB, b, BB) == 0,
              "each block where its key is");
    kvt_keys_close(k);
    kvd_stop(&d);
}
