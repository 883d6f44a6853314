/*
 * test_thp.h: for the tests that check memory is on transparent huge pages. Skips the calling
 * test where the kernel has them off (neither "always" nor "madvise" selected in sysfs).
 */
#ifndef KVT_TEST_THP_H
#define KVT_TEST_THP_H

#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>

static inline void thp_skip_unless_on(void)
{
    char mode[128] = "";
    FILE *f = fopen("/sys/kernel/mm/transparent_hugepage/enabled", "r");
    if (f) {
        if (!fgets(mode, sizeof mode, f))
            mode[0] = 0;
        fclose(f);
    }
    if (!strstr(mode, "[always]") && !strstr(mode, "[madvise]"))
        cr_skip_test("transparent huge pages are off here (%s)", mode[0] ? mode : "no sysfs file");
}

#endif
