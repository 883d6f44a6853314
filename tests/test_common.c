/*
 * test_common.c: common/'s rate-limited log line: at most one a second per limiter, the held-back
 * ones counted on the next line, nothing below the log level counted at all.
 */
#include <criterion/criterion.h>

#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "common.h"

/* Runs fn with stderr going to a temporary file; returns what it wrote. */
static const char *capture(void (*fn)(void))
{
    static char out[4096];
    FILE *f = tmpfile();
    cr_assert(f);
    fflush(stderr);
    int saved = dup(2);
    cr_assert(saved >= 0 && dup2(fileno(f), 2) == 2);
    fn();
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    rewind(f);
    size_t n = fread(out, 1, sizeof out - 1, f);
    out[n] = 0;
    fclose(f);
    return out;
}

static size_t lines(const char *s)
{
    size_t n = 0;
    for (; *s; s++)
        n += *s == '\n';
    return n;
}

static kvt_log_limit_t lim;

static void burst(void)
{
    for (int i = 0; i < 100; i++)
        kvt_log_limited(&lim, KVT_LOG_WARN, "tier write failed: %d", i);
}

static void one(void)
{
    kvt_log_limited(&lim, KVT_LOG_WARN, "tier write failed: later");
}

static void debug_burst(void)
{
    for (int i = 0; i < 10; i++)
        kvt_log_limited(&lim, KVT_LOG_DEBUG, "not at this level");
}

Test(common_log, limited_says_one_line_a_second_and_counts_the_rest)
{
    kvt_log_set_level(KVT_LOG_INFO);
    memset(&lim, 0, sizeof lim);
    const char *s = capture(burst);
    cr_expect_eq(lines(s), 1, "one line for the burst: '%s'", s);
    cr_expect(strstr(s, "tier write failed: 0\n"), "the first goes out as it is: '%s'", s);
    s = capture(debug_burst);
    cr_expect_eq(lines(s), 0, "below the level: nothing, and not counted");
    usleep(1100 * 1000);
    s = capture(one);
    cr_expect_eq(lines(s), 1);
    cr_expect(strstr(s, "tier write failed: later (and 99 more like it since the last)\n"),
              "the next line counts the held ones: '%s'", s);
    s = capture(one);
    cr_expect_eq(lines(s), 0, "and starts a new second");
}
