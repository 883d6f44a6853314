/*
 * common.c: error names, the assertion handler, the stderr logger, the monotonic clock and the
 * parsing of sizes (64G) that the daemon's settings and the replay's flags share.
 * Nothing here allocates; the logger writes one line per call with a single fprintf so that
 * lines from different threads do not interleave mid-line.
 */
#include "common.h"

#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

#include <xxhash.h>

static const char *const kvt_errnames[] = {
    [KVT_EINVAL - KVT_EINVAL] = "invalid argument",
    [KVT_EINVAL - KVT_ENOMEM] = "out of memory",
    [KVT_EINVAL - KVT_ENOENT] = "not found",
    [KVT_EINVAL - KVT_EBUSY] = "busy (leased or in use)",
    [KVT_EINVAL - KVT_ENOSPC] = "capacity exhausted",
    [KVT_EINVAL - KVT_ECORRUPT] = "corrupt data (checksum or header mismatch)",
    [KVT_EINVAL - KVT_EIO] = "I/O error",
    [KVT_EINVAL - KVT_EPROTO] = "protocol error",
    [KVT_EINVAL - KVT_EUNAVAIL] = "backend unavailable",
    [KVT_EINVAL - KVT_ETIMEDOUT] = "timed out",
    [KVT_EINVAL - KVT_EEXIST] = "already exists",
    [KVT_EINVAL - KVT_EAGAIN] = "temporarily unavailable, try again",
    [KVT_EINVAL - KVT_ECLOSED] = "closed",
    [KVT_EINVAL - KVT_EAUTH] = "authentication failed",
    [KVT_EINVAL - KVT_ETOOBIG] = "too big",
};

const char *kvt_strerror(int err)
{
    if (err == 0)
        return "success";
    if (err <= KVT_EINVAL && err > KVT_ELAST) {
        const char *s = kvt_errnames[KVT_EINVAL - err];
        return s ? s : "unknown kvtier error";
    }
    if (err < 0 && err > -4096)
        return strerror(-err);
    return "unknown error";
}

void kvt__assert_fail(const char *cond, const char *file, int line, const char *func)
{
    fprintf(stderr, "kvtier: assertion failed: %s (%s:%d, %s)\n", cond, file, line, func);
    fflush(stderr);
    abort();
}

static kvt_log_level_t kvt_log_level = KVT_LOG_INFO;
static const char *const kvt_log_names[] = {"debug", "info", "warn", "error"};

void kvt_log_set_level(kvt_log_level_t level)
{
    kvt_log_level = level;
}

kvt_log_level_t kvt_log_get_level(void)
{
    return kvt_log_level;
}

int kvt_log_parse_level(const char *s, kvt_log_level_t *out)
{
    if (!s || !out)
        return KVT_EINVAL;
    for (size_t i = 0; i < KVT_ARRAY_LEN(kvt_log_names); i++) {
        if (strcasecmp(s, kvt_log_names[i]) == 0) {
            *out = (kvt_log_level_t)i;
            return 0;
        }
    }
    return KVT_EINVAL;
}

/* The length of the UTF-8 sequence at p (n bytes there) when a log line may show it as it is:
 * well-formed, and not a C1 control (U+0080..U+009F, which terminals obey) nor a line or
 * paragraph separator (U+2028, U+2029, which some viewers break lines at). 0 otherwise. */
static size_t utf8_ok(const uint8_t *p, size_t n)
{
    uint8_t b = p[0];
    size_t len = b >= 0xc2 && b <= 0xdf   ? 2
                 : b >= 0xe0 && b <= 0xef ? 3
                 : b >= 0xf0 && b <= 0xf4 ? 4
                                          : 0;
    if (len == 0 || len > n)
        return 0;
    for (size_t i = 1; i < len; i++)
        if ((p[i] & 0xc0) != 0x80)
            return 0;
    if ((b == 0xe0 && p[1] < 0xa0) || (b == 0xed && p[1] > 0x9f) || /* overlong, surrogate */
        (b == 0xf0 && p[1] < 0x90) || (b == 0xf4 && p[1] > 0x8f) || /* overlong, past U+10FFFF */
        (b == 0xc2 && p[1] < 0xa0) ||                               /* C1 controls */
        (b == 0xe2 && p[1] == 0x80 && (p[2] == 0xa8 || p[2] == 0xa9)))
        return 0;
    return len;
}

/* Appends src[0, len) to dst at *at, escaped (kvt_log_str; a backslash doubled only when
 * backslash is set), as far as dst's cap bytes hold it with its NUL. Returns the source bytes
 * taken. */
static size_t escape(char *dst, size_t cap, size_t *at, const uint8_t *src, size_t len,
                     int backslash)
{
    size_t i = 0, o = *at;
    while (i < len) {
        uint8_t b = src[i];
        char esc[8];
        const char *out = esc;
        size_t el = 1, take = 1;
        if (b >= 0x20 && b < 0x7f) {
            esc[0] = (char)b;
            if (b == '\\' && backslash) {
                out = "\\\\";
                el = 2;
            }
        } else if (b == '\n' || b == '\r' || b == '\t') {
            esc[0] = '\\';
            esc[1] = b == '\n' ? 'n' : b == '\r' ? 'r' : 't';
            el = 2;
        } else if (b >= 0x80 && (take = utf8_ok(src + i, len - i)) > 0) {
            out = (const char *)src + i;
            el = take;
        } else {
            snprintf(esc, sizeof esc, "\\x%02x", b);
            el = 4;
            take = 1;
        }
        if (o + el >= cap)
            break;
        memcpy(dst + o, out, el);
        o += el;
        i += take;
    }
    if (cap)
        dst[o] = 0;
    *at = o;
    return i;
}

const char *kvt_log_str(char *dst, size_t cap, const void *src, size_t len, size_t max)
{
    if (!dst || cap == 0)
        return dst;
    dst[0] = 0;
    if (!src || cap < 4)
        return dst;
    size_t at = 0, n = KVT_MIN(len, max);
    /* Room for the "..." kept back, so that a cut string always says so. */
    if (escape(dst, cap - 3, &at, src, n, 1) < len)
        memcpy(dst + at, "...", 4);
    return dst;
}

static void log_line(kvt_log_level_t level, const char *msg)
{
    /* Whatever reached the message unescaped (a name read back from a file a client once
     * named) still cannot start a line of its own. */
    char clean[4 * 1024 + 4];
    size_t at = 0;
    escape(clean, sizeof clean, &at, (const uint8_t *)msg, strlen(msg), 0);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    struct tm tm;
    gmtime_r(&ts.tv_sec, &tm);
    fprintf(stderr, "%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ %-5s %s\n", tm.tm_year + 1900,
            tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, ts.tv_nsec / 1000000,
            kvt_log_names[level], clean);
}

void kvt_log(kvt_log_level_t level, const char *fmt, ...)
{
    if (level < kvt_log_level)
        return;
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    log_line(level, msg);
}

static uint32_t kvt_log_rate = 1;
static uint64_t kvt_log_held_total; /* atomic: a tier thread may log too */

void kvt_log_set_rate(uint32_t lines_per_s)
{
    kvt_log_rate = lines_per_s ? KVT_MIN(lines_per_s, 1000000u) : 1;
}

uint32_t kvt_log_get_rate(void)
{
    return kvt_log_rate;
}

uint64_t kvt_log_suppressed(void)
{
    return __atomic_load_n(&kvt_log_held_total, __ATOMIC_RELAXED);
}

void kvt_log_limited(kvt_log_limit_t *lim, kvt_log_level_t level, const char *fmt, ...)
{
    if (level < kvt_log_level)
        return;
    /* A token bucket of `rate` lines refilled at `rate` a second, kept as one time (GCRA): a
     * line goes out when the bucket would not be over-full with it. */
    uint64_t now = kvt_now_ns(), step = 1000000000ull / kvt_log_rate;
    uint64_t tat = lim->tat_ns > now ? lim->tat_ns : now;
    if (tat + step - now > step * kvt_log_rate) {
        lim->held++;
        __atomic_add_fetch(&kvt_log_held_total, 1, __ATOMIC_RELAXED);
        return;
    }
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    if (lim->held && n >= 0 && (size_t)n < sizeof msg)
        snprintf(msg + n, sizeof msg - (size_t)n, " (and %llu more like it since the last)",
                 (unsigned long long)lim->held);
    lim->tat_ns = tat + step;
    lim->held = 0;
    log_line(level, msg);
}

uint64_t kvt_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

int kvt_reserve(void *pp, size_t *cap, size_t need, size_t elem, size_t first)
{
    if (need <= *cap)
        return 0;
    size_t nc = *cap ? *cap : KVT_MAX(first, (size_t)1);
    while (nc < need) {
        if (nc > SIZE_MAX / 2 / elem)
            return KVT_ENOMEM;
        nc *= 2;
    }
    void *p;
    memcpy(&p, pp, sizeof p); /* pp is a T **: its pointer is read and written as bytes */
    void *np = realloc(p, nc * elem);
    if (!np)
        return KVT_ENOMEM;
    memcpy(pp, &np, sizeof np);
    *cap = nc;
    return 0;
}

void kvt_heap_hugepages(char **argv)
{
#if defined(__GLIBC__)
    const char *old = getenv("GLIBC_TUNABLES");
    if (!argv || !argv[0] || (old && strstr(old, "glibc.malloc.hugetlb")))
        return;
    char val[1024];
    int n = snprintf(val, sizeof val, "%s%sglibc.malloc.hugetlb=1", old ? old : "",
                     old && *old ? ":" : "");
    if (n < 0 || (size_t)n >= sizeof val || setenv("GLIBC_TUNABLES", val, 1) != 0)
        return;
    /* By its real path: exec'ing /proc/self/exe would name the process "exe" in ps and top. */
    char self[4096];
    ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);
    if (len > 0) {
        self[len] = 0;
        execv(self, argv);
    }
    /* Still here: put the environment back and run on small pages. */
    if (old)
        setenv("GLIBC_TUNABLES", old, 1);
    else
        unsetenv("GLIBC_TUNABLES");
#else
    (void)argv;
#endif
}

int kvt_parse_u64(const char *s, uint64_t *out, int with_suffix)
{
    char *end;
    if (!*s || *s == '-' || isspace((unsigned char)*s))
        return KVT_EINVAL;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s)
        return KVT_EINVAL;
    uint64_t mul = 1;
    if (with_suffix && *end) {
        static const char units[] = "KMGT"; /* 2^10, 2^20, 2^30, 2^40 */
        const char *u = strchr(units, toupper((unsigned char)*end));
        if (!u)
            return KVT_EINVAL;
        mul = 1ull << (10 * (u - units + 1));
        end++;
        if (toupper((unsigned char)*end) == 'I')
            end++;
        if (toupper((unsigned char)*end) == 'B')
            end++;
    }
    if (*end)
        return KVT_EINVAL;
    if (v > UINT64_MAX / mul)
        return KVT_EINVAL;
    *out = v * mul;
    return 0;
}

const char *kvt_tier_name(kvt_tier_id_t tier)
{
    static const char *const names[] = {"none", "hbm", "dram", "nvme", "remote"};
    return (unsigned)tier < KVT_TIER_COUNT ? names[tier] : "invalid";
}

size_t kvt_ns_describe(char *buf, const char *model, const char *adapter, const char *salt,
                       uint32_t page_size)
{
    if (!buf || !model || page_size < 1 || page_size > KVT_PAGE_MAX)
        return 0;
    const char *parts[3] = {model, adapter ? adapter : "", salt ? salt : ""};
    memcpy(buf, "kvtier-ns-v1", KVT_NS_TAG_LEN);
    size_t len = KVT_NS_TAG_LEN;
    for (int i = 0; i < 3; i++) {
        size_t l = strlen(parts[i]);
        if (l > 255)
            return 0;
        memcpy(buf + len, parts[i], l + 1);
        len += l + 1;
    }
    kvt_put_u32((uint8_t *)buf + len, page_size);
    return len + 4;
}

uint64_t kvt_ns_seed_of(const char *model, const char *adapter, const char *salt,
                        uint32_t page_size)
{
    char buf[KVT_NS_DESC_MAX];
    size_t len = kvt_ns_describe(buf, model, adapter, salt, page_size);
    return len ? XXH3_64bits(buf, len) : 0;
}
