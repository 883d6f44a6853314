/*
 * test_tier_util.h: helpers the tier tests share: deterministic payloads and keys, synchronous
 * wrappers over the asynchronous tier calls (they drive kvt_tier_wait, bounded in time), and
 * temporary directories under $TMPDIR that each test removes again.
 */
#ifndef KVT_TEST_TIER_UTIL_H
#define KVT_TEST_TIER_UTIL_H

#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tier.h"

#define TU_NS_SEED 0x6b7674696572ull

static inline uint64_t tu_rand(uint64_t *s)
{
    uint64_t x = *s += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static inline void tu_fill(void *buf, size_t len, uint64_t seed)
{
    uint8_t *p = buf;
    uint64_t s = seed;
    size_t i = 0;
    for (; i + 8 <= len; i += 8) {
        uint64_t v = tu_rand(&s);
        memcpy(p + i, &v, 8);
    }
    uint64_t v = tu_rand(&s);
    memcpy(p + i, &v, len - i);
}

static inline int tu_same(const void *buf, size_t len, uint64_t seed)
{
    void *want = malloc(len ? len : 1);
    tu_fill(want, len, seed);
    int same = memcmp(want, buf, len) == 0;
    free(want);
    return same;
}

/* A key for block i: tokens derived from i, a made-up prefix hash and parent. */
static inline kvt_block_key_t tu_key(uint64_t i, uint32_t *tokens, uint32_t ntokens)
{
    uint64_t s = i * 7919 + 1;
    for (uint32_t k = 0; k < ntokens; k++)
        tokens[k] = (uint32_t)tu_rand(&s);
    kvt_block_key_t key = {
        .ns_seed = TU_NS_SEED,
        .hash = tu_rand(&s) | 1,
        .parent = i == 0 ? TU_NS_SEED : tu_rand(&s),
        .tokens = tokens,
        .ntokens = ntokens,
    };
    return key;
}

static inline void tu_count_cb(kvt_tier_io_t *io)
{
    (*(int *)io->data)++;
}

/* Waits until *done reaches want, for at most 20 s. Returns 1 when it did. */
static inline int tu_drive(kvt_tier_t *t, const int *done, int want)
{
    uint64_t deadline = kvt_now_ns() + 20ull * 1000000000ull;
    while (*done < want) {
        if (kvt_now_ns() > deadline)
            return 0;
        int rc = kvt_tier_wait(t, 100);
        if (rc < 0)
            return 0;
    }
    return 1;
}

/* Fills block i of n (len bytes each, at bufs + i * len) with seed + i and submits its write
 * through ios[i], keyed tu_key(i, toks[i], 16), counting completions in *done. */
static inline void tu_write_burst(kvt_tier_t *t, kvt_tier_io_t *ios, uint32_t (*toks)[16],
                                  uint8_t *bufs, int n, uint32_t len, uint64_t seed, int *done)
{
    for (int i = 0; i < n; i++) {
        tu_fill(bufs + (size_t)i * len, len, seed + (uint64_t)i);
        ios[i] = (kvt_tier_io_t){.key = tu_key((uint64_t)i, toks[i], 16),
                                 .buf = bufs + (size_t)i * len,
                                 .len = len,
                                 .cb = tu_count_cb,
                                 .data = done};
        cr_assert_eq(kvt_tier_write(t, &ios[i]), 0, "write %d", i);
    }
}

/* Synchronous write, with prepare its checksum made first (kvt_tier_write_prepare): returns the
 * submit error or the completion status. */
static inline int tu_write_as(kvt_tier_t *t, const kvt_block_key_t *key, const void *buf,
                              uint32_t len, uint64_t *loc, int prepare)
{
    int done = 0;
    kvt_tier_io_t io = {
        .key = *key, .buf = (void *)buf, .len = len, .cb = tu_count_cb, .data = &done};
    if (prepare)
        cr_assert_eq(kvt_tier_write_prepare(t, &io), 0);
    int rc = kvt_tier_write(t, &io);
    if (rc < 0)
        return rc;
    if (!tu_drive(t, &done, 1))
        return KVT_ETIMEDOUT;
    if (loc)
        *loc = io.loc;
    return io.status;
}

static inline int tu_write(kvt_tier_t *t, const kvt_block_key_t *key, const void *buf, uint32_t len,
                           uint64_t *loc)
{
    return tu_write_as(t, key, buf, len, loc, 0);
}

/* Writes blocks 0 .. n-1 of len bytes one at a time, block i keyed tu_key(i) over tok and filled
 * with tu_fill(i) through buf; every write must succeed. Their locations go to locs. */
static inline void tu_write_n(kvt_tier_t *t, int n, uint8_t *buf, uint32_t len, uint32_t *tok,
                              uint64_t *locs)
{
    for (int i = 0; i < n; i++) {
        kvt_block_key_t k = tu_key((uint64_t)i, tok, 16);
        tu_fill(buf, len, (uint64_t)i);
        cr_assert_eq(tu_write(t, &k, buf, len, &locs[i]), 0, "block %d", i);
    }
}

static inline int tu_read(kvt_tier_t *t, const kvt_block_key_t *key, uint64_t loc, void *buf,
                          uint32_t len)
{
    int done = 0;
    kvt_tier_io_t io = {
        .key = *key, .loc = loc, .buf = buf, .len = len, .cb = tu_count_cb, .data = &done};
    int rc = kvt_tier_read(t, &io);
    if (rc < 0)
        return rc;
    if (!tu_drive(t, &done, 1))
        return KVT_ETIMEDOUT;
    return io.status;
}

static inline void *tu_aligned(size_t len)
{
    void *p = NULL;
    cr_assert(posix_memalign(&p, 4096, len ? len : 1) == 0);
    return p;
}

/* A fresh directory under $TMPDIR (or /tmp). */
static inline void tu_tmpdir(char *out, size_t cap, const char *tag)
{
    const char *base = getenv("TMPDIR");
    if (!base || !*base)
        base = "/tmp";
    snprintf(out, cap, "%s/kvt-%s-XXXXXX", base, tag);
    cr_assert(mkdtemp(out) != NULL, "mkdtemp %s: %s", out, strerror(errno));
}

static inline void tu_rmrf(const char *path)
{
    DIR *d = opendir(path);
    if (d) {
        struct dirent *e;
        while ((e = readdir(d))) {
            if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
                continue;
            char sub[4400];
            if (snprintf(sub, sizeof(sub), "%s/%s", path, e->d_name) >= (int)sizeof(sub))
                continue;
            struct stat st;
            if (lstat(sub, &st) == 0 && S_ISDIR(st.st_mode))
                tu_rmrf(sub);
            else
                unlink(sub);
        }
        closedir(d);
    }
    rmdir(path);
}

#endif
