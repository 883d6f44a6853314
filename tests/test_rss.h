/*
 * test_rss.h: the process's peak resident set, for the tests that bound what an operation makes
 * resident (a replay's tables, the NVMe recovery scan's buffer). Skips the calling test where the
 * kernel cannot reset the peak (/proc/self/clear_refs).
 */
#ifndef KVT_TEST_RSS_H
#define KVT_TEST_RSS_H

#include <criterion/criterion.h>
#include <stdio.h>

/* VmHWM in KiB; reset first clears it to the current resident set. */
static inline long peak_kib(int reset)
{
    if (reset) {
        FILE *f = fopen("/proc/self/clear_refs", "w");
        if (!f)
            cr_skip_test("no /proc/self/clear_refs to reset the peak RSS");
        fputs("5", f);
        fclose(f);
    }
    FILE *f = fopen("/proc/self/status", "r");
    cr_assert_not_null(f);
    char line[256];
    long kib = -1;
    while (fgets(line, sizeof(line), f))
        if (sscanf(line, "VmHWM: %ld kB", &kib) == 1)
            break;
    fclose(f);
    cr_assert_geq(kib, 0);
    return kib;
}

#endif
