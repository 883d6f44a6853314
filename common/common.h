/*
 * common.h: what every kvtier module shares: error codes, assertions, logging and clocks.
 *
 * Errors follow LMDB: functions that can fail return int, 0 on success and a negative KVT_E*
 * code otherwise. The codes live in a private range (-30800 and below) so that they never
 * collide with a negated errno, which functions may also return (-ENOSPC from the disk, say);
 * kvt_strerror() names both.
 */
#ifndef KVT_COMMON_H
#define KVT_COMMON_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

enum {
    KVT_OK = 0,
    KVT_EINVAL = -30800,   /* an argument is out of its documented range */
    KVT_ENOMEM = -30801,   /* an allocation failed */
    KVT_ENOENT = -30802,   /* the thing asked for is not there */
    KVT_EBUSY = -30803,    /* it is leased or in use and cannot change now */
    KVT_ENOSPC = -30804,   /* the tier or table is at its configured capacity */
    KVT_ECORRUPT = -30805, /* stored data failed its checksum or header check */
    KVT_EIO = -30806,      /* an I/O operation failed */
    KVT_EPROTO = -30807,   /* a malformed frame or an unexpected reply */
    KVT_EUNAVAIL = -30808, /* the backend is not usable here (no GPU, server down) */
    KVT_ETIMEDOUT = -30809,
    KVT_EEXIST = -30810,  /* already present */
    KVT_EAGAIN = -30811,  /* try again later: resource temporarily exhausted */
    KVT_ECLOSED = -30812, /* the connection or handle was closed */
    KVT_EAUTH = -30813,   /* authentication required or refused */
    KVT_ETOOBIG = -30814, /* a frame or value exceeds the configured limit */
    KVT_ELAST = -30815
};

/* The name of a KVT_E* code or of a negated errno. The string is static. */
const char *kvt_strerror(int err);

/* kvt_assert() is for internal invariants only: arguments are checked and answered with
 * KVT_EINVAL. It stays on in release builds: a broken invariant in a cache that serves KV
 * bytes would serve wrong data, which is worse than a crash. */
#define kvt_assert(cond) ((cond) ? (void)0 : kvt__assert_fail(#cond, __FILE__, __LINE__, __func__))
_Noreturn void kvt__assert_fail(const char *cond, const char *file, int line, const char *func);

typedef enum { KVT_LOG_DEBUG, KVT_LOG_INFO, KVT_LOG_WARN, KVT_LOG_ERROR } kvt_log_level_t;

/* Log to stderr with a timestamp and level; lines below the current level are dropped. */
void kvt_log(kvt_log_level_t level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void kvt_log_set_level(kvt_log_level_t level);
kvt_log_level_t kvt_log_get_level(void);
/* Parses "debug", "info", "warn", "error". Returns 0 or KVT_EINVAL. */
int kvt_log_parse_level(const char *s, kvt_log_level_t *out);

/*
 * A line that can repeat at any rate (a tier failing every write while it is full, a block lost
 * per request, anything a client can make the daemon say): a static limiter at the call site
 * lets through kvt_log_get_rate() lines a second, in bursts of as many; the lines held back
 * meanwhile are counted, here and in kvt_log_suppressed(), and the next line that goes out says
 * how many. Zero-initialised.
 */
typedef struct kvt_log_limit {
    uint64_t tat_ns; /* when the bucket is next empty (GCRA's theoretical arrival time); 0: never */
    uint64_t held;   /* lines held back since the last one out */
} kvt_log_limit_t;

void kvt_log_limited(kvt_log_limit_t *lim, kvt_log_level_t level, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Lines a second each limiter lets through (at least 1; 1 until set). Set once at start-up. */
void kvt_log_set_rate(uint32_t lines_per_s);
uint32_t kvt_log_get_rate(void);
/* Lines every limiter together has held back since the process started. */
uint64_t kvt_log_suppressed(void);

/*
 * A string someone else chose (a client's model name), made fit for a log line: printable ASCII
 * and valid UTF-8 as they are, a backslash as two, \n \r \t as such, and every other control
 * byte and every byte that is not valid UTF-8 as \xNN; at most max bytes of src, followed by
 * "..." when it had more. Without this a name holding a line break writes a line of its own,
 * which a client could make look like anything. dst (cap bytes) is always NUL-terminated;
 * KVT_LOG_STR_CAP(max) bytes hold the longest result. Returns dst.
 *
 * Every line is also scrubbed on its way out (control bytes and bad UTF-8 escaped the same way,
 * backslashes left alone), so a string that reaches a line unescaped cannot break it either.
 */
#define KVT_LOG_STR_MAX    64 /* bytes of a client's string a log line shows */
#define KVT_LOG_STR_CAP(m) ((m)*4 + 4)
const char *kvt_log_str(char *dst, size_t cap, const void *src, size_t len, size_t max);

/* A decimal unsigned number; with_suffix, optionally followed by K, M, G or T (powers of 1024,
 * case-insensitive, an "i" and a "B" allowed after: 64G, 64GiB, 512kb). Returns 0, or KVT_EINVAL
 * for anything else (a sign, spaces, an unknown suffix, trailing text, overflow). */
int kvt_parse_u64(const char *s, uint64_t *out, int with_suffix);

/* Monotonic clock. */
uint64_t kvt_now_ns(void);
static inline uint64_t kvt_now_us(void)
{
    return kvt_now_ns() / 1000;
}

/* How long ago then was at now, 0 when then is later: a time another thread stamped after now was
 * read (a loop that waited for the store's lock with now in hand) is no time ago, not 584 years. */
static inline uint64_t kvt_ns_since(uint64_t now, uint64_t then)
{
    return now > then ? now - then : 0;
}

/*
 * Huge pages for a glibc heap (bench_radix; kvtierd's heap is jemalloc's, set up in
 * server/main.c). The index is hundreds of MiB of node storage walked in no particular
 * order, so with 4 KiB pages nearly every node costs a TLB miss; glibc (2.35 and later) backs its
 * heap with transparent huge pages when started with GLIBC_TUNABLES=glibc.malloc.hugetlb=1, and it
 * reads that only at start-up. So this re-executes the program (same argv, same pid and file
 * descriptors) with the tunable added, once, at the top of main(), before anything is allocated
 * that matters. It does nothing when GLIBC_TUNABLES already names glibc.malloc.hugetlb (set it to
 * 0 to opt out), when the C library is not glibc, or when re-executing fails (then it returns and
 * the program runs on small pages).
 */
void kvt_heap_hugepages(char **argv);

/*
 * Names the index (radix/), the tiers (tiers/) and the policy share, kept here so that none of
 * them depends on another for them: where a block's bytes live, the largest page, and the seed a
 * namespace's blocks are hashed from (the tree's prefix hashes and the tiers' stored headers both
 * carry it).
 */
#define KVT_PAGE_MAX 1024 /* the most tokens in one page */

/* Where a block's KV bytes live (kvt_block_t.tier; the tiers' own kind). */
typedef enum {
    KVT_TIER_NONE = 0, /* index only: no bytes stored anywhere */
    KVT_TIER_HBM = 1,
    KVT_TIER_DRAM = 2,
    KVT_TIER_NVME = 3,
    KVT_TIER_REMOTE = 4,
    KVT_TIER_COUNT = 5
} kvt_tier_id_t;

const char *kvt_tier_name(kvt_tier_id_t t); /* "none", "hbm", "dram", "nvme", "remote" */

/* A namespace's description as hashed into its seed (radix/radix.h, "The prefix hash"): the tag
 * "kvtier-ns-v1" with its NUL, model, adapter and salt each with its NUL (NULL adapter or salt:
 * empty), the page size as a little-endian uint32. kvt_ns_describe writes it into buf
 * (KVT_NS_DESC_MAX bytes) and returns its length, or 0 for a description refused (no model, a
 * string over 255 bytes, a page size outside 1..KVT_PAGE_MAX); the part after the tag
 * (KVT_NS_TAG_LEN bytes) is what the tree keeps as the namespace's name. */
#define KVT_NS_TAG_LEN  13
#define KVT_NS_DESC_MAX (KVT_NS_TAG_LEN + 3 * 256 + 4)
size_t kvt_ns_describe(char *buf, const char *model, const char *adapter, const char *salt,
                       uint32_t page_size);
/* The seed of a description (XXH3_64bits of it), the same in every process; 0 for one refused. */
uint64_t kvt_ns_seed_of(const char *model, const char *adapter, const char *salt,
                        uint32_t page_size);

/*
 * Little-endian fields, byte by byte: the one set for every format kvtier writes (the wire
 * protocol, the stored block header, the NVMe log's records), so that none depends on the host's
 * byte order or on alignment.
 */
static inline void kvt_put_u16(uint8_t *p, uint16_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}
static inline void kvt_put_u32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}
static inline void kvt_put_u64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}
static inline uint16_t kvt_get_u16(const uint8_t *p)
{
    return (uint16_t)(p[0] | (p[1] << 8));
}
static inline uint32_t kvt_get_u32(const uint8_t *p)
{
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}
static inline uint64_t kvt_get_u64(const uint8_t *p)
{
    return (uint64_t)kvt_get_u32(p) | ((uint64_t)kvt_get_u32(p + 4) << 32);
}

/*
 * A growing array: *pp (any object pointer, passed by address) holds *cap elements of elem
 * bytes; makes it hold at least need, doubling from first (or from *cap), contents kept. On
 * failure nothing changes. Returns 0 or KVT_ENOMEM. Every buffer that grows by doubling (reply
 * output, client input, token scratch) grows through this one.
 */
int kvt_reserve(void *pp, size_t *cap, size_t need, size_t elem, size_t first);

#define KVT_ARRAY_LEN(a) (sizeof(a) / sizeof((a)[0]))
#define KVT_MIN(a, b)    ((a) < (b) ? (a) : (b))
#define KVT_MAX(a, b)    ((a) > (b) ? (a) : (b))

#endif
