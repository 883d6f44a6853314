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

static void kvt_log_line(kvt_log_level_t level, const char *msg)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    struct tm tm;
    gmtime_r(&ts.tv_sec, &tm);
    fprintf(stderr, "%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ %-5s %s\n", tm.tm_year + 1900,
            tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, ts.tv_nsec / 1000000,
            kvt_log_names[level], msg);
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
    kvt_log_line(level, msg);
}

void kvt_log_limited(kvt_log_limit_t *lim, kvt_log_level_t level, const char *fmt, ...)
{
    if (level < kvt_log_level)
        return;
    uint64_t now = kvt_now_ns();
    if (lim->last_ns && now - lim->last_ns < 1000000000ull) {
        lim->held++;
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
    lim->last_ns = now;
    lim->held = 0;
    kvt_log_line(level, msg);
}

uint64_t kvt_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
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
