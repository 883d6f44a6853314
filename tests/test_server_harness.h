/*
 * test_server_harness.h: starts the real kvtierd binary for the server, client and metrics
 * tests. Each daemon runs in a fresh directory under $TMPDIR (its socket, data directory and log
 * live there and are removed at the end), on ephemeral TCP ports whose numbers it prints at
 * start-up. The binary is $KVT_BUILD_ROOT/server/kvtierd, which meson sets for every test (run by
 * hand, this build's).
 */
#ifndef KVT_TEST_SERVER_HARNESS_H
#define KVT_TEST_SERVER_HARNESS_H

#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kvtier.h"

typedef struct kvd {
    pid_t pid;
    char dir[512];
    char sock[600];
    char tcp[64];
    char metrics[64];
    FILE *out;
    /* When nofile_soft is set, the daemon starts with this open-file limit (soft, hard). */
    unsigned long nofile_soft, nofile_hard;
    /* Set: the daemon keeps its default index-prefault (all of index-bytes, filled at start);
     * otherwise the test defaults turn it off, as hundreds of daemons filling 1 GiB each would
     * cost the suite minutes and gigabytes where a test is not about it. */
    int index_prefault_default;
    /* "NAME=VALUE" entries the daemon's environment gets beside the test's own (LD_PRELOAD for a
     * shim, say), NULL-terminated; an entry replaces a variable of the same name. */
    const char *env[8];
} kvd_t;

/* The build directory: $KVT_BUILD_ROOT, which meson test sets; run by hand, the build the test
 * belongs to (tests/meson.build defines KVT_TEST_BUILD_ROOT). */
static inline const char *kvd_build_root(void)
{
    const char *root = getenv("KVT_BUILD_ROOT");
    return root && *root ? root : KVT_TEST_BUILD_ROOT;
}

static inline const char *kvd_binary(void)
{
    static char path[1024];
    /* KVT_TEST_KVTIERD: another build's daemon (scripts/test.sh runs these tests, built without
     * a sanitizer, against build-tsan's ThreadSanitizer kvtierd: Criterion's runner does not
     * start under ThreadSanitizer). */
    const char *bin = getenv("KVT_TEST_KVTIERD");
    if (bin && *bin)
        return bin;
    snprintf(path, sizeof path, "%s/server/kvtierd", kvd_build_root());
    return path;
}

static inline void kvd_mkdir(kvd_t *d)
{
    const char *tmp = getenv("TMPDIR");
    snprintf(d->dir, sizeof d->dir, "%s/kvtd.XXXXXX", tmp && *tmp ? tmp : "/tmp");
    cr_assert(mkdtemp(d->dir), "mkdtemp: %s", strerror(errno));
}

/* Writes text as d->dir/kvtierd.conf, whole at once (a reload never reads half a file), and its
 * path into path, for --config. */
static inline void kvd_write_conf(const kvd_t *d, const char *text, char *path, size_t cap)
{
    char tmp[720];
    snprintf(path, cap, "%s/kvtierd.conf", d->dir);
    snprintf(tmp, sizeof tmp, "%s.new", path);
    FILE *f = fopen(tmp, "w");
    cr_assert(f, "%s: %s", tmp, strerror(errno));
    fputs(text, f);
    fclose(f);
    cr_assert_eq(rename(tmp, path), 0);
}

/* Starts kvtierd in d->dir (made by kvd_mkdir, or fresh when d->dir is empty) with the given
 * flags (NULL-terminated) after the test defaults: small tiers, ephemeral ports. The defaults
 * name every tier the daemon gets, so that a test runs the same on every machine: no HBM tier
 * (hbm-backend auto would add one wherever a GPU is usable); a test that wants one asks for it,
 * with its backend. */
static inline void kvd_startv(kvd_t *d, const char *const *extra)
{
    if (!d->dir[0])
        kvd_mkdir(d);
    const char *argv[64];
    int n = 0;
    argv[n++] = kvd_binary();
    const char *defaults[] = {"--tcp",        "127.0.0.1:0",  "--metrics",
                              "127.0.0.1:0",  "--dram-bytes", "16M",
                              "--nvme-bytes", "8M",           "--nvme-segment-bytes",
                              "1M",           "--hbm-bytes",  "0",
                              "--log-level",  "warn"};
    for (size_t i = 0; i < sizeof defaults / sizeof *defaults; i++)
        argv[n++] = defaults[i];
    if (!d->index_prefault_default) {
        argv[n++] = "--index-prefault";
        argv[n++] = "0";
    }
    /* KVT_TEST_LOOPS=N runs every daemon with N event loops (the loops2 tests of
     * tests/meson.build); a test's own --loops, later on the line, wins. */
    const char *loops = getenv("KVT_TEST_LOOPS");
    if (loops && *loops) {
        argv[n++] = "--loops";
        argv[n++] = loops;
    }
    for (int i = 0; extra && extra[i]; i++)
        argv[n++] = extra[i];
    argv[n] = NULL;
    /* The environment, made before the fork (the child may not allocate): the test's own with
     * d->env's entries in place of the variables they name. */
    extern char **environ;
    size_t ne = 0, nd = 0;
    while (environ[ne])
        ne++;
    while (nd < sizeof d->env / sizeof *d->env && d->env[nd])
        nd++;
    char **envp = calloc(ne + nd + 1, sizeof *envp);
    cr_assert(envp);
    size_t k = 0;
    for (size_t i = 0; i < ne; i++) {
        int replaced = 0;
        for (size_t j = 0; j < nd && !replaced; j++) {
            const char *eq = strchr(d->env[j], '=');
            size_t nl = eq ? (size_t)(eq - d->env[j]) + 1 : 0;
            replaced = nl && !strncmp(environ[i], d->env[j], nl);
        }
        if (!replaced)
            envp[k++] = environ[i];
    }
    for (size_t j = 0; j < nd; j++)
        envp[k++] = (char *)d->env[j];
    envp[k] = NULL;
    int pipefd[2];
    cr_assert(pipe(pipefd) == 0);
    char log[600];
    snprintf(log, sizeof log, "%s/kvtierd.log", d->dir);
    /* Between fork and exec the child only makes system calls: no Criterion assertion (its IPC
     * is not fork-safe) and no allocation (another thread may hold the allocator's lock). */
    d->pid = fork();
    if (d->pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL); /* a test that dies takes its daemon with it */
        if (chdir(d->dir) < 0)
            _exit(127);
        if (d->nofile_soft) {
            struct rlimit rl = {.rlim_cur = d->nofile_soft, .rlim_max = d->nofile_hard};
            if (setrlimit(RLIMIT_NOFILE, &rl) < 0)
                _exit(127);
        }
        dup2(pipefd[1], 1);
        close(pipefd[0]);
        close(pipefd[1]);
        int lfd = open(log, O_WRONLY | O_CREAT | O_APPEND, 0600);
        if (lfd >= 0)
            dup2(lfd, 2);
        execve(argv[0], (char *const *)argv, envp);
        _exit(127);
    }
    free(envp);
    cr_assert(d->pid > 0, "fork: %s", strerror(errno));
    close(pipefd[1]);
    d->out = fdopen(pipefd[0], "r");
    int ready = 0;
    snprintf(d->sock, sizeof d->sock, "%s/kvtierd.sock", d->dir);
    /* The daemon prints its addresses and then "ready" within seconds; give up after 30. The
     * pipe is read raw (not through stdio's buffer) so that poll sees what is left. */
    char text[2048];
    size_t len = 0;
    struct pollfd pf = {.fd = pipefd[0], .events = POLLIN};
    while (!ready && len + 1 < sizeof text && poll(&pf, 1, 30000) == 1) {
        ssize_t got = read(pipefd[0], text + len, sizeof text - 1 - len);
        if (got <= 0)
            break;
        len += (size_t)got;
        text[len] = 0;
        ready = strstr(text, "\nready\n") != NULL || !strncmp(text, "ready\n", 6);
    }
    for (char *line = text; ready && line && *line;
         line = strchr(line, '\n') ? strchr(line, '\n') + 1 : NULL) {
        if (!strncmp(line, "tcp ", 4))
            sscanf(line + 4, "%63s", d->tcp);
        else if (!strncmp(line, "metrics http://", 15))
            sscanf(line + 15, "%63[^/]", d->metrics);
    }
    cr_assert(ready, "kvtierd did not start (see %s/kvtierd.log)", d->dir);
}

static inline void kvd_start(kvd_t *d, ...)
{
    const char *extra[32];
    int n = 0;
    va_list ap;
    va_start(ap, d);
    const char *a;
    while ((a = va_arg(ap, const char *)) && n < 31)
        extra[n++] = a;
    va_end(ap);
    extra[n] = NULL;
    kvd_startv(d, extra);
}

/* SIGTERM, then the exit status (0 for a clean shutdown). */
static inline int kvd_stop(kvd_t *d)
{
    int st = -1;
    if (d->pid > 0) {
        kill(d->pid, SIGTERM);
        waitpid(d->pid, &st, 0);
        d->pid = 0;
    }
    if (d->out) {
        fclose(d->out);
        d->out = NULL;
    }
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + (WIFSIGNALED(st) ? WTERMSIG(st) : 0);
}

static inline void kvd_rmrf(const char *dir)
{
    char cmd[700];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0)
        fprintf(stderr, "could not remove %s\n", dir);
}

/* Reads the file `name` in d->dir into buf (cap bytes, NUL-terminated); the file must exist. */
static inline void kvd_slurp(const kvd_t *d, const char *name, char *buf, size_t cap)
{
    char path[700];
    snprintf(path, sizeof path, "%s/%s", d->dir, name);
    FILE *f = fopen(path, "r");
    cr_assert(f, "%s: %s", path, strerror(errno));
    size_t n = fread(buf, 1, cap - 1, f);
    buf[n] = 0;
    fclose(f);
}

/* Whether the daemon's log (its first 16 KiB) holds what. */
static inline int kvd_log_has(const kvd_t *d, const char *what)
{
    char log[16384];
    kvd_slurp(d, "kvtierd.log", log, sizeof log);
    return strstr(log, what) != NULL;
}

/* Copies the end of the daemon's log to stderr: for a test about to fail, whose directory (and
 * log) a CI machine does not keep. */
static inline void kvd_log_tail(const kvd_t *d, long bytes)
{
    char path[700];
    snprintf(path, sizeof path, "%s/kvtierd.log", d->dir);
    FILE *f = fopen(path, "r");
    if (!f)
        return;
    if (fseek(f, 0, SEEK_END) == 0 && ftell(f) > bytes)
        fseek(f, -bytes, SEEK_END);
    else
        rewind(f);
    char buf[4096];
    size_t n;
    fprintf(stderr, "---- the end of %s ----\n", path);
    while ((n = fread(buf, 1, sizeof buf, f)) > 0)
        fwrite(buf, 1, n, stderr);
    fprintf(stderr, "---- end ----\n");
    fclose(f);
}

/* Stops the daemon if running and removes its directory. */
static inline void kvd_cleanup(kvd_t *d)
{
    if (d->pid > 0) {
        int rc = kvd_stop(d);
        cr_expect_eq(rc, 0, "kvtierd exit status %d", rc);
    }
    if (d->dir[0])
        kvd_rmrf(d->dir);
    d->dir[0] = 0;
}

/* A client of d's Unix socket; with zero_copy, one that has mapped its namespace's DRAM arena
 * (its GETs ask for LOCATE, its PUTs go through RESERVE and COMMIT). */
static inline kvt_client_t *kvd_client_map(const kvd_t *d, const char *model, uint32_t page,
                                           uint32_t block_bytes, int zero_copy)
{
    kvt_client_conf_t conf = {.unix_path = d->sock,
                              .model = model,
                              .page_size = page,
                              .block_bytes = block_bytes,
                              .timeout_ms = 10000,
                              .zero_copy = zero_copy};
    kvt_client_t *c = NULL;
    int rc = kvt_client_connect(&c, &conf);
    cr_assert_eq(rc, 0, "connect: %s", kvt_client_strerror(rc));
    if (zero_copy)
        cr_assert_eq(kvt_client_zero_copy(c), 1, "not mapped: %s", kvt_client_zero_copy_reason(c));
    return c;
}

static inline kvt_client_t *kvd_client(const kvd_t *d, const char *model, uint32_t page,
                                       uint32_t block_bytes)
{
    return kvd_client_map(d, model, page, block_bytes, 0);
}

/* A raw socket to the daemon's Unix socket, for bytes no client library would send. */
static inline int kvd_raw(const kvd_t *d)
{
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    cr_assert(fd >= 0);
    struct sockaddr_un sun = {.sun_family = AF_UNIX};
    cr_assert_lt(strlen(d->sock), sizeof sun.sun_path);
    memcpy(sun.sun_path, d->sock, strlen(d->sock) + 1);
    cr_assert(connect(fd, (struct sockaddr *)&sun, sizeof sun) == 0, "connect: %s",
              strerror(errno));
    struct timeval tv = {.tv_sec = 10};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    return fd;
}

/* Deterministic test data: page p of a block has bytes that name (seed, p, offset). */
static inline void kvd_fill(uint8_t *buf, size_t len, uint32_t seed)
{
    uint64_t x = 0x9E3779B97F4A7C15ull * (seed + 1);
    for (size_t i = 0; i < len; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        buf[i] = (uint8_t)x;
    }
}

/* GETs pages [first, first + n) of a lease (their tiers in tiers[] when not NULL): all must come
 * back, page p as kvd_fill(seed + p) made it. */
static inline void kvd_check_get(kvt_client_t *c, uint64_t lease, uint32_t first, uint32_t n,
                                 uint32_t bb, uint32_t seed, uint8_t *tiers)
{
    uint8_t *buf = malloc((size_t)n * bb), *want = malloc(bb);
    uint32_t got = 0;
    int rc = kvt_client_get(c, lease, first, n, buf, (size_t)n * bb, &got, tiers);
    cr_assert_eq(rc, 0, "get: %s %s", kvt_client_strerror(rc), kvt_client_errmsg(c));
    cr_assert_eq(got, n);
    for (uint32_t p = 0; p < n; p++) {
        kvd_fill(want, bb, seed + first + p);
        cr_assert(memcmp(buf + (size_t)p * bb, want, bb) == 0, "page %u differs", first + p);
    }
    free(buf);
    free(want);
}

static inline void kvd_tokens(uint32_t *t, uint32_t n, uint32_t base)
{
    for (uint32_t i = 0; i < n; i++)
        t[i] = base + i * 7 + 1;
}

typedef struct kvd_stat_find {
    const char *name;
    uint64_t value;
    int found;
} kvd_stat_find_t;

static inline int kvd_stat_cb(void *arg, const char *name, uint64_t v)
{
    kvd_stat_find_t *f = arg;
    if (!strcmp(name, f->name)) {
        f->value = v;
        f->found = 1;
        return 1;
    }
    return 0;
}

/* The redis-server the test command started (KVT_TEST_REDIS=host:port); the test is skipped
 * without one. */
static inline const char *kvd_redis(void)
{
    const char *a = getenv("KVT_TEST_REDIS");
    if (!a || !*a)
        cr_skip_test("KVT_TEST_REDIS is not set: no redis-server to test against");
    return a;
}

static inline uint64_t kvd_stat(kvt_client_t *c, const char *name)
{
    kvd_stat_find_t f = {.name = name};
    cr_assert_eq(kvt_client_stats(c, kvd_stat_cb, &f), 0);
    cr_assert(f.found, "no stat %s", name);
    return f.value;
}

/* GET path from the daemon's metrics endpoint; returns the HTTP status, body in buf (NUL-ended). */
static inline int kvd_http_get(const kvd_t *d, const char *path, char *buf, size_t cap)
{
    char host[64];
    unsigned port = 0;
    cr_assert_eq(sscanf(d->metrics, "%63[^:]:%u", host, &port), 2, "metrics address %s",
                 d->metrics);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    cr_assert(fd >= 0);
    struct sockaddr_in sin = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    inet_pton(AF_INET, host, &sin.sin_addr);
    cr_assert_eq(connect(fd, (struct sockaddr *)&sin, sizeof sin), 0);
    char req[256];
    int n = snprintf(req, sizeof req, "GET %s HTTP/1.1\r\nHost: %s\r\n\r\n", path, d->metrics);
    cr_assert_eq(write(fd, req, (size_t)n), n);
    size_t len = 0;
    ssize_t r;
    while (len + 1 < cap && (r = read(fd, buf + len, cap - 1 - len)) > 0)
        len += (size_t)r;
    buf[len] = 0;
    close(fd);
    int status = 0;
    sscanf(buf, "HTTP/1.1 %d", &status);
    char *body = strstr(buf, "\r\n\r\n");
    if (body)
        memmove(buf, body + 4, strlen(body + 4) + 1);
    return status;
}

/* The value of one series on d's /metrics page (its name with labels, exactly as exposed), or -1
 * when the page has no such line. */
static inline double kvd_metric(const kvd_t *d, const char *series)
{
    static char body[1 << 20];
    cr_assert_eq(kvd_http_get(d, "/metrics", body, sizeof body), 200);
    size_t n = strlen(series);
    for (const char *p = body; (p = strstr(p, series)); p += n)
        if ((p == body || p[-1] == '\n') && p[n] == ' ')
            return strtod(p + n + 1, NULL);
    return -1;
}

#endif
