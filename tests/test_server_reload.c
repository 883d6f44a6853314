/*
 * test_server_reload.c: the two signals an operator sends a running kvtierd besides SIGTERM.
 * SIGHUP reads the settings again (the --config file and the flags, as at start): the ones that
 * can change while running take effect, the others are named in the log as needing a restart,
 * and a file that no longer parses changes nothing. SIGUSR1 drains for a rolling restart: no new
 * connection, quiet connections closed at once, a connection holding a lease served until it
 * gives the lease back, then exit 0; or drain-ms passes and the daemon shuts down anyway.
 */
#include "test_server_harness.h"

#include <time.h>

#define PAGE 16
#define BB   4096

static void write_conf(const kvd_t *d, const char *text)
{
    char path[700];
    kvd_write_conf(d, text, path, sizeof path);
}

static void start_with_conf(kvd_t *d, const char *text, const char *flag, const char *value)
{
    kvd_mkdir(d);
    char path[700];
    kvd_write_conf(d, text, path, sizeof path);
    kvd_start(d, "--config", path, flag, value, NULL);
}

/* Waits up to 5 s for STATS name to reach want; returns its last value. */
static uint64_t stat_until(kvt_client_t *c, const char *name, uint64_t want)
{
    uint64_t v = 0;
    for (int i = 0; i < 500 && (v = kvd_stat(c, name)) < want; i++)
        usleep(10000);
    return v;
}

static void put_one(kvt_client_t *c, const uint32_t *tok, uint32_t seed)
{
    uint8_t page[BB];
    kvd_fill(page, BB, seed);
    kvt_client_put_t r;
    int rc = kvt_client_put(c, tok, PAGE, 0, 1, page, NULL, &r);
    cr_assert_eq(rc, 0, "put: %s", kvt_client_strerror(rc));
    cr_assert_eq(r.stored, 1);
}

/* MATCHes with a lease until one is refused; returns how many were granted (at most cap). */
static int leases_granted(kvt_client_t *c, const uint32_t *tok, int cap, uint64_t *leases)
{
    int n = 0;
    for (; n < cap; n++) {
        kvt_client_match_t m = {0};
        int rc = kvt_client_match(c, tok, PAGE, KVT_CLIENT_LEASE, 0, NULL, &m);
        if (rc == KVT_CLIENT_ENOSPC)
            break;
        cr_assert_eq(rc, 0, "match: %s", kvt_client_strerror(rc));
        cr_assert_eq(m.pages, 1);
        leases[n] = m.lease;
    }
    return n;
}

static void release_all(kvt_client_t *c, const uint64_t *leases, int n)
{
    for (int i = 0; i < n; i++)
        cr_assert_eq(kvt_client_release(c, leases[i], NULL), 0);
}

static int log_has(const kvd_t *d, const char *needle)
{
    static char buf[1 << 16];
    kvd_slurp(d, "kvtierd.log", buf, sizeof buf);
    return strstr(buf, needle) != NULL;
}

Test(server_reload, sighup_applies_what_can_change_and_names_what_cannot)
{
    kvd_t d = {0};
    start_with_conf(&d, "max-leases = 3\nindex-bytes = 64M\n", "--log-level", "info");
    kvt_client_t *c = kvd_client(&d, "reload", PAGE, BB);
    uint32_t tok[PAGE];
    kvd_tokens(tok, PAGE, 5000);
    put_one(c, tok, 1);
    uint64_t leases[16];
    cr_assert_eq(leases_granted(c, tok, 16, leases), 3, "max-leases 3 from the file");
    release_all(c, leases, 3);
    cr_assert_eq(kvd_stat(c, "index_capacity_bytes"), 64ull << 20);

    write_conf(&d, "max-leases = 5\nindex-bytes = 128M\n");
    cr_assert_eq(kill(d.pid, SIGHUP), 0);
    cr_assert_eq(stat_until(c, "config_reloads", 1), 1, "the reload was applied");
    cr_expect_eq(kvd_stat(c, "config_reload_failures"), 0);
    cr_expect_eq(leases_granted(c, tok, 16, leases), 5, "max-leases 5 after SIGHUP");
    release_all(c, leases, 5);
    cr_expect_eq(kvd_stat(c, "index_capacity_bytes"), 64ull << 20,
                 "index-bytes sizes the index at start: it stays until a restart");
    cr_expect(log_has(&d, "reload: max-leases 3 -> 5"), "the change is logged");
    cr_expect(log_has(&d, "index-bytes changed to 134217728 but needs a restart"),
              "the setting that needs a restart is named");
    kvt_client_close(c);
    kvd_cleanup(&d);
}

Test(server_reload, a_reload_that_does_not_parse_changes_nothing)
{
    kvd_t d = {0};
    start_with_conf(&d, "max-leases = 2\n", "--log-level", "warn");
    kvt_client_t *c = kvd_client(&d, "reload", PAGE, BB);
    uint32_t tok[PAGE];
    kvd_tokens(tok, PAGE, 6000);
    put_one(c, tok, 2);

    write_conf(&d, "max-leases = 9\nlease-ms = banana\n");
    cr_assert_eq(kill(d.pid, SIGHUP), 0);
    cr_assert_eq(stat_until(c, "config_reload_failures", 1), 1, "the reload was refused");
    cr_expect_eq(kvd_stat(c, "config_reloads"), 0);
    uint64_t leases[16];
    cr_expect_eq(leases_granted(c, tok, 16, leases), 2, "max-leases is still 2");
    release_all(c, leases, 2);
    cr_expect(log_has(&d, "reload refused, nothing changed"), "the refusal is logged");
    cr_expect(log_has(&d, "banana"), "with the bad value");

    /* The flags still win over the file on a reload, as they do at start. */
    write_conf(&d, "max-leases = 4\nlog-level = debug\n");
    cr_assert_eq(kill(d.pid, SIGHUP), 0);
    cr_assert_eq(stat_until(c, "config_reloads", 1), 1);
    cr_expect_eq(leases_granted(c, tok, 16, leases), 4);
    release_all(c, leases, 4);
    cr_expect(!log_has(&d, "reload: log-level"), "--log-level warn on the line still wins");
    kvt_client_close(c);
    kvd_cleanup(&d);
}

static uint64_t ms_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

/* Waits up to ms for the daemon to exit; returns its exit status, or -1 if it still runs. */
static int exit_within(kvd_t *d, int ms)
{
    int st;
    for (int i = 0; i < ms / 10; i++) {
        pid_t p = waitpid(d->pid, &st, WNOHANG);
        if (p == d->pid) {
            d->pid = 0;
            return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        }
        usleep(10000);
    }
    return -1;
}

Test(server_reload, sigusr1_drains_serving_leases_to_their_end_then_exits_0)
{
    kvd_t d = {0};
    kvd_start(&d, NULL);
    kvt_client_t *holder = kvd_client(&d, "drain", PAGE, BB);
    kvt_client_t *idle = kvd_client(&d, "drain", PAGE, BB);
    uint32_t tok[PAGE];
    kvd_tokens(tok, PAGE, 7000);
    put_one(holder, tok, 3);
    kvt_client_match_t m = {0};
    cr_assert_eq(kvt_client_match(holder, tok, PAGE, KVT_CLIENT_LEASE, 0, NULL, &m), 0);
    cr_assert_eq(m.pages, 1);

    cr_assert_eq(kill(d.pid, SIGUSR1), 0);
    /* The quiet connection goes at the next tick; no new connection is taken. */
    int closed = 0;
    for (int i = 0; i < 200 && !closed; i++) {
        closed = kvt_client_ping(idle, NULL) < 0;
        if (!closed)
            usleep(10000);
    }
    cr_expect(closed, "the connection with nothing held was closed by the drain");
    char body[256];
    cr_expect_eq(kvd_http_get(&d, "/healthz", body, sizeof body), 503, "healthz: %s", body);
    cr_expect(strstr(body, "draining"), "healthz says why: %s", body);
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un sun = {.sun_family = AF_UNIX};
    memcpy(sun.sun_path, d.sock, strlen(d.sock) + 1);
    cr_expect(connect(fd, (struct sockaddr *)&sun, sizeof sun) < 0, "no new connection");
    close(fd);

    /* The lease's holder is served to the end: its bytes, then its RELEASE. */
    uint8_t got[BB], want[BB];
    uint32_t n = 0;
    cr_assert_eq(kvt_client_get(holder, m.lease, 0, 1, got, BB, &n, NULL), 0,
                 "GET under the lease while draining");
    kvd_fill(want, BB, 3);
    cr_expect(n == 1 && !memcmp(got, want, BB), "byte-exact while draining");
    cr_expect_eq(exit_within(&d, 300), -1, "still serving the lease's holder");
    cr_assert_eq(kvt_client_release(holder, m.lease, NULL), 0);
    uint64_t t0 = ms_now();
    int rc = exit_within(&d, 5000);
    cr_expect_eq(rc, 0, "the drain ends with exit 0 once nothing is held (got %d)", rc);
    cr_expect_lt(ms_now() - t0, 2000, "and promptly");
    kvt_client_close(idle);
    kvt_client_close(holder);
    kvd_cleanup(&d);
}

Test(server_reload, a_drain_ends_at_drain_ms_whatever_is_still_held)
{
    kvd_t d = {0};
    kvd_start(&d, "--drain-ms", "300", NULL);
    kvt_client_t *c = kvd_client(&d, "drain", PAGE, BB);
    uint32_t tok[PAGE];
    kvd_tokens(tok, PAGE, 8000);
    put_one(c, tok, 4);
    kvt_client_match_t m = {0};
    cr_assert_eq(kvt_client_match(c, tok, PAGE, KVT_CLIENT_LEASE, 0, NULL, &m), 0);
    uint64_t t0 = ms_now();
    cr_assert_eq(kill(d.pid, SIGUSR1), 0);
    int rc = exit_within(&d, 10000);
    uint64_t took = ms_now() - t0;
    cr_expect_eq(rc, 0, "exit 0 after drain-ms (got %d)", rc);
    cr_expect_geq(took, 250, "not before drain-ms (%llu ms)", (unsigned long long)took);
    cr_expect_lt(took, 6000, "nor long after (%llu ms)", (unsigned long long)took);
    kvt_client_close(c);
    kvd_cleanup(&d);
}
