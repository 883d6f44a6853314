/*
 * test_server_policy.c: kvtierd's tier-policy settings (policy, policy-model, policy-hw,
 * policy-high, policy-low, nvme-min-hits). Each bad value stops the daemon before it starts
 * (exit 64, a message naming the setting); good ones start it and it serves. The engine itself
 * is not yet in the daemon's code path (see docs/server.md): these tests cover the settings only.
 */
#include "test_server_harness.h"

/* Runs kvtierd in dir with one extra flag pair; returns its exit status and leaves its stderr in
 * err. The daemon is not expected to start. */
static int run_bad(const char *dir, const char *flag, const char *value, char *err, size_t cap)
{
    char cmd[2048];
    snprintf(cmd, sizeof cmd,
             "cd '%s' && '%s' --unix x.sock --tcp 127.0.0.1:0 --metrics '' --nvme-bytes 0 "
             "'%s' '%s' >/dev/null 2>err.txt",
             dir, kvd_binary(), flag, value);
    int st = system(cmd);
    char path[700];
    snprintf(path, sizeof path, "%s/err.txt", dir);
    err[0] = 0;
    FILE *f = fopen(path, "r");
    if (f) {
        size_t n = fread(err, 1, cap - 1, f);
        err[n] = 0;
        fclose(f);
    }
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

Test(server_policy, bad_settings_refused)
{
    kvd_t d = {0};
    kvd_mkdir(&d);
    static const struct {
        const char *flag, *value, *says;
    } cases[] = {
        {"--policy", "random", "bad policy 'random'"},
        {"--policy", "oracle", "bad policy 'oracle'"}, /* needs the future: replay only */
        {"--policy-model", "gpt-9", "unknown policy-model 'gpt-9'"},
        {"--policy-hw", "toaster", "unknown policy-hw 'toaster'"},
        {"--policy-high", "1.5", "policy watermarks"},
        {"--policy-low", "0.99", "policy watermarks"}, /* above the default high of 0.95 */
        {"--policy-low", "0", "bad value '0' for policy-low"},
        {"--nvme-min-hits", "-1", "bad value '-1' for nvme-min-hits"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        char err[1024];
        int rc = run_bad(d.dir, cases[i].flag, cases[i].value, err, sizeof err);
        cr_expect_eq(rc, 64, "%s %s: exit %d", cases[i].flag, cases[i].value, rc);
        cr_expect(strstr(err, cases[i].says), "%s %s: stderr '%s'", cases[i].flag, cases[i].value,
                  err);
    }
    struct stat st;
    char sock[700];
    snprintf(sock, sizeof sock, "%s/x.sock", d.dir);
    cr_expect(stat(sock, &st) < 0, "no socket left by a daemon that did not start");
    kvd_cleanup(&d);
}

Test(server_policy, good_settings_start)
{
    static const char *const kinds[] = {"cost", "lru", "lfu"};
    for (size_t i = 0; i < sizeof kinds / sizeof *kinds; i++) {
        kvd_t d = {0};
        kvd_start(&d, "--policy", kinds[i], "--policy-model", "qwen2.5-7b", "--policy-hw",
                  "h200-1gpu", "--policy-high", "0.8", "--policy-low", "0.7", "--nvme-min-hits",
                  "2", NULL);
        kvt_client_t *c = kvd_client(&d, "m", 16, 64);
        cr_assert(c, "policy %s: the daemon serves", kinds[i]);
        cr_expect_eq(kvt_client_ping(c, NULL), 0, "policy %s: ping", kinds[i]);
        kvt_client_close(c);
        kvd_cleanup(&d);
    }
}
