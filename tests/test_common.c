/*
 * test_common.c: common/'s rate-limited log line (at most one a second per limiter, the held-back
 * ones counted on the next line, nothing below the log level counted at all) and its parsing of
 * sizes, and its clock's ages.
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

Test(common_parse, sizes_with_and_without_units)
{
    static const struct {
        const char *s;
        int units, ok;
        uint64_t want;
    } cases[] = {
        {"0", 0, 1, 0},
        {"4096", 0, 1, 4096},
        {"18446744073709551615", 0, 1, UINT64_MAX},
        {"64G", 1, 1, 64ull << 30},
        {"64GiB", 1, 1, 64ull << 30},
        {"512kb", 1, 1, 512ull << 10},
        {"3m", 1, 1, 3ull << 20},
        {"2T", 1, 1, 2ull << 40},
        {"7", 1, 1, 7},
        {"64G", 0, 0, 0}, /* no units here */
        {"", 1, 0, 0},
        {"-1", 1, 0, 0},
        {" 1", 1, 0, 0},
        {"1 ", 1, 0, 0},
        {"12X", 1, 0, 0},
        {"1GBs", 1, 0, 0},
        {"1.5G", 1, 0, 0},
        {"18446744073709551616", 0, 0, 0},
        {"17179869184G", 1, 0, 0}, /* 2^64 bytes */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        uint64_t v = 12345;
        int rc = kvt_parse_u64(cases[i].s, &v, cases[i].units);
        if (cases[i].ok) {
            cr_expect_eq(rc, 0, "'%s' parsed", cases[i].s);
            cr_expect_eq(v, cases[i].want, "'%s' = %llu", cases[i].s, (unsigned long long)v);
        } else {
            cr_expect_eq(rc, KVT_EINVAL, "'%s' refused", cases[i].s);
            cr_expect_eq(v, 12345, "'%s' leaves the output alone", cases[i].s);
        }
    }
}

/* A loop that read the clock, then waited for the store's lock while another loop stamped a
 * connection, finds that stamp a little after its now: no time ago, not 2^64 ns (the tick closed
 * such connections as past reply-timeout-ms, issue 42's gets_from_dram test under load). */
Test(common_clock, a_time_after_now_is_no_time_ago)
{
    uint64_t now = kvt_now_ns();
    cr_expect_eq(kvt_ns_since(now, now - 5000), 5000);
    cr_expect_eq(kvt_ns_since(now, now), 0);
    cr_expect_eq(kvt_ns_since(now, now + 5000), 0);
    cr_expect_eq(kvt_ns_since(now, 0), now);
}
