/*
 * bench_client.c: the C side of the client benchmark (bench/bench_client.py drives it): PUT and
 * GET of whole pages through libkvtier over the daemon's Unix socket, one page per request, and
 * memcpy of the same bytes, each pass printed as one JSON object per line. The Python side runs
 * the same loops through the kvtier package against a daemon of its own, so that the driver can
 * print the ratios package/libkvtier and each/memcpy.
 *
 * A pass: PUT pages 0..n-1 of one token sequence (request i carries the tokens of pages 0..i and
 * the bytes of page i), MATCH it with a lease, GET each page into its place in one buffer,
 * RELEASE, check the bytes, REMOVE the sequence (so that the next pass stores again, into the
 * memory the daemon freed: the first pass on a fresh daemon faults its memory in, the reruns
 * are warm). Each pass uses new token ids. Then PING round trips: the per-call cost alone.
 *
 * zc: the same pass on the zero-copy path (impl "libkvtier_zc": the client maps its namespace's
 * DRAM arena): put is kvt_client_put (RESERVE with a MATCH PROBE behind it, a memcpy into the
 * mapping, COMMIT), get is kvt_client_get (GET by location, one memcpy from the mapping into the
 * caller's buffer), get_cb is kvt_client_get_cb with no copy at all: the callback reads one
 * 8-byte word per 4 KiB of the block (it sums them, so that the reads happen and the page
 * table entries are made) and nothing else, which is what the zero-copy GET costs a consumer
 * that reads the bytes where they lie. Then put_reserve: kvt_client_reserve of the page, a
 * memcpy into its room, kvt_client_commit (the two-step API without put's probe), on new
 * tokens. The first pass of a fresh daemon also pays this process's page faults on the mapping.
 * get_batch8: kvt_client_get of 8 pages a request, each into its place (one round trip per 8
 * memcpys out of the mapping, as an engine's load of a prompt's pages).
 * One round trip per step (issue 38), one page a request, request i asking for page i of the
 * tokens of pages 0..i: step_get is the step before it (MATCH with a lease, GET with LOCATE of
 * the page into its place, RELEASE: three round trips); step_locate the step with it
 * (kvt_client_match_step with LEASE | LOCATE, a memcpy from the location the MATCH answered,
 * kvt_client_release_later: one round trip). get_located is the GET's part of step_locate, timed
 * from the MATCH's reply to the page copied and its lease sent back: what loading a hit costs
 * once the lookup the step does anyway answers where it lies (the bar's figure; the MATCH's own
 * round trip is step_locate's). step_match is the lookup alone (MATCH without a lease, nothing
 * loaded): step_locate - step_match is all that loading adds to a step.
 * And memcpy: the same bytes copied page by page right after the GETs, in this process (the
 * baseline beside them, under the same load); get_reader: kvt_client_get of the same pages by a
 * second connection with a mapping of its own (another process's reader: its first touch of
 * each page faults, since every block written lies in pages the arena punched and refilled);
 * put_socket_arena: socket PUTs into the same namespace by a connection without a mapping (the
 * daemon writes them into the namespace's arena: the zero-copy PUT's fair baseline).
 *
 * seal: the scribble check's cost (issue 36, docs/benchmarks.md). Each round starts two fresh
 * daemons (kvtierd --zero-copy-checksum yes, and no), in alternating order, and times the
 * zero-copy PUT of N pages on each: put (kvt_client_put, which hashes each page as it copies it
 * in and sends the sums with COMMIT) and put_reserve (kvt_client_reserve, memcpy,
 * kvt_client_commit: no sums, the daemon hashes the pages itself after its reply). Each prints
 * one line per round and configuration (the median of the warm passes), then one summary line
 * per op: the medians over the rounds, the median of the rounds' on/off ratios (each round's
 * two daemons run back to back, so the pair shares the host's load of the moment) and whether it
 * meets the bar (the check costs at most 5 %: ratio >= 0.95), and the ratio of the
 * medians beside it.
 *
 *   bench_client client --unix PATH --block-bytes B --pages N --passes R
 *   bench_client zc --unix PATH --block-bytes B --pages N --passes R
 *   bench_client memcpy --block-bytes B --pages N --passes R
 *   bench_client seal --kvtierd PATH --block-bytes B --pages N --passes R --rounds K
 *   bench_client connect [--tcp HOST:PORT] [--unix PATH] --seconds S --rounds K
 *
 * connect: connections a second of one client connecting and closing in a loop through
 * libkvtier (kvt_client_connect: the HELLO's round trip; libkvtier_zc also maps the arena) and,
 * the baseline, a plain socket's connect and close to the same daemon (bench_connect says more).
 */
#include "kvtier.h"

#include <dirent.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define PAGE_TOKENS 16

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void emit(const char *impl, const char *op, size_t block, uint32_t pages, int pass,
                 double secs)
{
    double bytes = (double)block * pages;
    printf("{\"bench\":\"client\",\"impl\":\"%s\",\"op\":\"%s\",\"block_bytes\":%zu,"
           "\"pages\":%u,\"pass\":%d,\"gib_s\":%.3f,\"us_per_page\":%.2f}\n",
           impl, op, block, pages, pass, bytes / secs / (1u << 30), secs * 1e6 / pages);
    fflush(stdout);
}

/* Fresh, untouched memory each call, as a new buffer would be (the first pass's faults). */
static uint8_t *fresh(size_t n)
{
    void *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
        perror("bench_client: mmap");
        exit(1);
    }
    return p;
}

static int bench_memcpy(size_t block, uint32_t pages, int passes)
{
    size_t n = block * pages;
    uint8_t *src = fresh(n), *dst = fresh(n);
    memset(src, 0x5a, n);
    for (int pass = 1; pass <= passes; pass++) {
        double t0 = now_s();
        for (uint32_t i = 0; i < pages; i++)
            memcpy(dst + (size_t)i * block, src + (size_t)i * block, block);
        emit("memcpy", "copy", block, pages, pass, now_s() - t0);
        if (dst[n - 1] != 0x5a)
            return 1;
    }
    munmap(src, n);
    munmap(dst, n);
    return 0;
}

static int fail(const char *what, int rc, kvt_client_t *c)
{
    fprintf(stderr, "bench_client: %s: %s %s\n", what, kvt_client_strerror(rc),
            c ? kvt_client_errmsg(c) : "");
    return 1;
}

typedef struct touch {
    uint64_t sum;
    uint32_t n;
} touch_t;

/* get_cb's consumer: one word per 4 KiB, where the block lies (no copy). */
static int touch_block(void *arg, uint32_t page, unsigned tier, const void *data, uint32_t len)
{
    (void)page, (void)tier;
    touch_t *t = arg;
    const uint8_t *p = data;
    for (uint32_t off = 0; off + 8 <= len; off += 4096) {
        uint64_t w;
        memcpy(&w, p + off, 8);
        t->sum += w;
    }
    t->n++;
    return 0;
}

/* The steps of one page a request (the header's step_get, step_locate, get_located,
 * step_match), over pages already stored under tok; each checks the bytes it loaded. */
static int bench_steps(kvt_client_t *c, const char *impl, const uint32_t *tok, const uint8_t *src,
                       uint8_t *dst, size_t block, uint32_t pages, int pass)
{
    size_t n = block * pages;
    int rc;
    memset(dst, 0, n);
    double t0 = now_s();
    for (uint32_t i = 0; i < pages; i++) {
        kvt_client_match_t m = {0};
        uint32_t got;
        if ((rc = kvt_client_match(c, tok, (i + 1) * PAGE_TOKENS, KVT_CLIENT_LEASE, 60000, NULL,
                                   &m)) < 0 ||
            m.pages != i + 1)
            return fail("step_get match", rc, c);
        rc = kvt_client_get(c, m.lease, i, 1, dst + (size_t)i * block, block, &got, NULL);
        if (rc < 0 || got != 1)
            return fail("step_get get", rc, c);
        if ((rc = kvt_client_release(c, m.lease, NULL)) < 0)
            return fail("step_get release", rc, c);
    }
    emit(impl, "step_get", block, pages, pass, now_s() - t0);
    if (memcmp(src, dst, n) != 0) {
        fprintf(stderr, "bench_client: step_get loaded other bytes than PUT stored\n");
        return 1;
    }
    memset(dst, 0, n);
    kvt_client_loc_t *locs = malloc(pages * sizeof *locs);
    if (!locs)
        return 1;
    double load = 0;
    t0 = now_s();
    for (uint32_t i = 0; i < pages; i++) {
        kvt_client_match_t m = {0};
        kvt_client_step_t st = {.locs = locs, .locs_cap = pages};
        if ((rc = kvt_client_match_step(c, tok, (i + 1) * PAGE_TOKENS,
                                        KVT_CLIENT_LEASE | KVT_CLIENT_LOCATE, 60000, NULL, &m,
                                        &st)) < 0 ||
            m.pages != i + 1 || !locs[i].host_ptr)
            return fail("step_locate match", rc < 0 ? rc : -1, c);
        double t1 = now_s();
        memcpy(dst + (size_t)i * block, locs[i].host_ptr, block);
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts); /* valid_until_ns's clock */
        if ((uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec >= st.valid_until_ns) {
            fprintf(stderr, "bench_client: the lease ran out before the page was read\n");
            return 1;
        }
        if ((rc = kvt_client_release_later(c, m.lease)) < 0)
            return fail("step_locate release", rc, c);
        load += now_s() - t1;
    }
    emit(impl, "step_locate", block, pages, pass, now_s() - t0);
    emit(impl, "get_located", block, pages, pass, load);
    free(locs);
    if (memcmp(src, dst, n) != 0) {
        fprintf(stderr, "bench_client: step_locate loaded other bytes than PUT stored\n");
        return 1;
    }
    t0 = now_s();
    for (uint32_t i = 0; i < pages; i++) {
        kvt_client_match_t m = {0};
        if ((rc = kvt_client_match(c, tok, (i + 1) * PAGE_TOKENS, 0, 0, NULL, &m)) < 0 ||
            m.pages != i + 1)
            return fail("step_match", rc, c);
    }
    emit(impl, "step_match", block, pages, pass, now_s() - t0);
    return 0;
}

static int bench_client(const char *unix_path, size_t block, uint32_t pages, int passes, int zc)
{
    kvt_client_conf_t conf = {.unix_path = unix_path,
                              .model = "bench-client",
                              .page_size = PAGE_TOKENS,
                              .block_bytes = (uint32_t)block,
                              .timeout_ms = 60000,
                              .zero_copy = zc};
    const char *impl = zc ? "libkvtier_zc" : "libkvtier";
    kvt_client_t *c;
    int rc = kvt_client_connect(&c, &conf);
    if (rc < 0)
        return fail("connect", rc, NULL);
    kvt_client_t *c2 = NULL, *c3 = NULL;
    if (zc && (rc = kvt_client_connect(&c2, &conf)) < 0)
        return fail("connect", rc, NULL);
    conf.zero_copy = 0;
    if (zc && (rc = kvt_client_connect(&c3, &conf)) < 0)
        return fail("connect", rc, NULL);
    if (zc && (!kvt_client_zero_copy(c) || !kvt_client_zero_copy(c2))) {
        fprintf(stderr, "bench_client: no zero-copy mapping: %s\n", kvt_client_zero_copy_reason(c));
        return 1;
    }
    size_t n = block * pages;
    uint8_t *src = fresh(n), *dst = fresh(n);
    /* The client's buffers are faulted in first, as an engine's pinned buffers are: the first
     * pass measures a fresh daemon, not this process's page faults. */
    memset(src, 1, n);
    memset(dst, 1, n);
    uint32_t ntok = pages * PAGE_TOKENS;
    uint32_t *tok = malloc(ntok * sizeof *tok);
    if (!tok)
        return 1;
    for (int pass = 1; pass <= passes; pass++) {
        for (uint32_t i = 0; i < ntok; i++)
            tok[i] = 7000000u + (uint32_t)pass * 1000000u + i;
        for (size_t i = 0; i < n; i += 4096)
            src[i] = (uint8_t)(pass + i / 4096);
        double t0 = now_s();
        for (uint32_t i = 0; i < pages; i++) {
            kvt_client_put_t pr;
            rc = kvt_client_put(c, tok, (i + 1) * PAGE_TOKENS, i, 1, src + (size_t)i * block, NULL,
                                &pr);
            if (rc < 0 || pr.stored != 1)
                return fail("put", rc, c);
        }
        emit(impl, "put", block, pages, pass, now_s() - t0);
        kvt_client_match_t m = {0};
        if ((rc = kvt_client_match(c, tok, ntok, KVT_CLIENT_LEASE, 60000, NULL, &m)) < 0 ||
            m.pages != pages)
            return fail("match", rc, c);
        t0 = now_s();
        for (uint32_t i = 0; i < pages; i++) {
            uint32_t got;
            rc = kvt_client_get(c, m.lease, i, 1, dst + (size_t)i * block, block, &got, NULL);
            if (rc < 0 || got != 1)
                return fail("get", rc, c);
        }
        emit(impl, "get", block, pages, pass, now_s() - t0);
        if (memcmp(src, dst, n) != 0) {
            fprintf(stderr, "bench_client: GET returned other bytes than PUT stored\n");
            return 1;
        }
        if (zc) {
            /* memcpy of the same bytes, page by page, in this process right after the GETs:
             * the baseline under the same load (the machine's load moves between runs). */
            t0 = now_s();
            for (uint32_t i = 0; i < pages; i++)
                memcpy(dst + (size_t)i * block, src + (size_t)i * block, block);
            emit(impl, "memcpy", block, pages, pass, now_s() - t0);
            /* Another reader: a second connection with a mapping of its own, as another process
             * (an engine's other worker) would have; its first touch of each page faults. */
            kvt_client_match_t m2 = {0};
            if ((rc = kvt_client_match(c2, tok, ntok, KVT_CLIENT_LEASE, 60000, NULL, &m2)) < 0 ||
                m2.pages != pages)
                return fail("match", rc, c2);
            memset(dst, 0, n);
            t0 = now_s();
            for (uint32_t i = 0; i < pages; i++) {
                uint32_t got;
                rc = kvt_client_get(c2, m2.lease, i, 1, dst + (size_t)i * block, block, &got, NULL);
                if (rc < 0 || got != 1)
                    return fail("get", rc, c2);
            }
            emit(impl, "get_reader", block, pages, pass, now_s() - t0);
            if (memcmp(src, dst, n) != 0 || (rc = kvt_client_release(c2, m2.lease, NULL)) < 0)
                return fail("get_reader", rc, c2);
            touch_t t = {0}, want = {0};
            t0 = now_s();
            for (uint32_t i = 0; i < pages; i++) {
                uint32_t got;
                rc = kvt_client_get_cb(c, m.lease, i, 1, touch_block, &t, &got);
                if (rc < 0 || got != 1)
                    return fail("get_cb", rc, c);
            }
            emit(impl, "get_cb", block, pages, pass, now_s() - t0);
            /* GETs of 8 pages a request (a prompt's pages come together: an engine's load asks
             * for them in one GET): the round trip spread over 8 memcpys out of the mapping. */
            memset(dst, 0, n);
            t0 = now_s();
            for (uint32_t i = 0; i < pages; i += 8) {
                uint32_t k = pages - i < 8 ? pages - i : 8, got;
                rc = kvt_client_get(c, m.lease, i, k, dst + (size_t)i * block, (size_t)k * block,
                                    &got, NULL);
                if (rc < 0 || got != k)
                    return fail("get_batch8", rc, c);
            }
            emit(impl, "get_batch8", block, pages, pass, now_s() - t0);
            if (memcmp(src, dst, n) != 0) {
                fprintf(stderr, "bench_client: an 8-page GET returned other bytes\n");
                return 1;
            }
            for (uint32_t i = 0; i < pages; i++)
                touch_block(&want, i, 0, src + (size_t)i * block, (uint32_t)block);
            if (t.sum != want.sum || t.n != pages) {
                fprintf(stderr, "bench_client: get_cb saw other bytes than PUT stored\n");
                return 1;
            }
            if ((rc = bench_steps(c, impl, tok, src, dst, block, pages, pass)) != 0)
                return rc;
        }
        if ((rc = kvt_client_release(c, m.lease, NULL)) < 0)
            return fail("release", rc, c);
        if ((rc = kvt_client_remove(c, tok, PAGE_TOKENS)) < 0)
            return fail("remove", rc, c);
        if (!zc)
            continue;
        /* The two-step PUT, on tokens of its own (then removed as well). */
        for (uint32_t i = 0; i < ntok; i++)
            tok[i] = 500000000u + (uint32_t)pass * 1000000u + i;
        t0 = now_s();
        for (uint32_t i = 0; i < pages; i++) {
            void *room;
            kvt_client_resv_t rv = {.ptrs = &room};
            kvt_client_put_t pr;
            rc = kvt_client_reserve(c, tok, (i + 1) * PAGE_TOKENS, i, 1, NULL, &rv);
            if (rc < 0 || !room)
                return fail("reserve", rc, c);
            memcpy(room, src + (size_t)i * block, block);
            if ((rc = kvt_client_commit(c, rv.id, &pr)) < 0 || pr.stored != 1)
                return fail("commit", rc, c);
        }
        emit(impl, "put_reserve", block, pages, pass, now_s() - t0);
        if ((rc = kvt_client_remove(c, tok, PAGE_TOKENS)) < 0)
            return fail("remove", rc, c);
        /* Socket PUTs into the same namespace (whose DRAM blocks live in its arena now), by a
         * connection without a mapping: what the zero-copy PUT is to be weighed against. */
        for (uint32_t i = 0; i < ntok; i++)
            tok[i] = 900000000u + (uint32_t)pass * 1000000u + i;
        t0 = now_s();
        for (uint32_t i = 0; i < pages; i++) {
            kvt_client_put_t pr;
            rc = kvt_client_put(c3, tok, (i + 1) * PAGE_TOKENS, i, 1, src + (size_t)i * block, NULL,
                                &pr);
            if (rc < 0 || pr.stored != 1)
                return fail("put", rc, c3);
        }
        emit(impl, "put_socket_arena", block, pages, pass, now_s() - t0);
        if ((rc = kvt_client_remove(c3, tok, PAGE_TOKENS)) < 0)
            return fail("remove", rc, c3);
    }
    /* The per-call cost without payload: PING round trips. */
    enum { PINGS = 5000 };
    double t0 = now_s();
    for (int i = 0; i < PINGS; i++)
        if ((rc = kvt_client_ping(c, NULL)) < 0)
            return fail("ping", rc, c);
    printf("{\"bench\":\"client\",\"impl\":\"%s\",\"op\":\"ping\",\"calls\":%d,"
           "\"us_per_call\":%.2f}\n",
           impl, PINGS, (now_s() - t0) * 1e6 / PINGS);
    free(tok);
    munmap(src, n);
    munmap(dst, n);
    kvt_client_close(c);
    kvt_client_close(c2);
    kvt_client_close(c3);
    return 0;
}

/* ---- seal: the scribble check on and off, each round against two fresh daemons ---- */

typedef struct seal_daemon {
    pid_t pid;
    char dir[64], sock[96];
} seal_daemon_t;

/* Starts kvtierd in a new directory of its own, zero-copy-checksum on or off, and waits (10 s
 * at most) until its Unix socket takes a connection. */
static int seal_start(seal_daemon_t *d, const char *kvtierd, int on, const kvt_client_conf_t *c)
{
    snprintf(d->dir, sizeof d->dir, "/tmp/bench-seal-XXXXXX");
    if (!mkdtemp(d->dir)) {
        perror("bench_client: mkdtemp");
        return -1;
    }
    snprintf(d->sock, sizeof d->sock, "%s/kvtierd.sock", d->dir);
    d->pid = fork();
    if (d->pid < 0)
        return -1;
    if (d->pid == 0) {
        if (chdir(d->dir) != 0 || !freopen("/dev/null", "w", stdout)) /* its "ready" lines */
            _exit(127);
        execl(kvtierd, kvtierd, "--tcp", "", "--metrics", "", "--dram-bytes", "512M",
              "--nvme-bytes", "0", "--hbm-bytes", "0", "--zero-copy-checksum", on ? "yes" : "no",
              "--log-level", "warn", (char *)NULL);
        perror("bench_client: exec kvtierd");
        _exit(127);
    }
    kvt_client_conf_t conf = *c;
    conf.unix_path = d->sock;
    for (int i = 0; i < 1000; i++) {
        kvt_client_t *k;
        if (kvt_client_connect(&k, &conf) == 0) {
            kvt_client_close(k);
            return 0;
        }
        if (waitpid(d->pid, NULL, WNOHANG) == d->pid) {
            fprintf(stderr, "bench_client: kvtierd exited at start\n");
            return -1;
        }
        usleep(10000);
    }
    fprintf(stderr, "bench_client: kvtierd did not listen on %s\n", d->sock);
    return -1;
}

static void seal_stop(seal_daemon_t *d)
{
    if (d->pid > 0) {
        kill(d->pid, SIGTERM);
        waitpid(d->pid, NULL, 0);
    }
    DIR *dir = opendir(d->dir);
    struct dirent *e;
    char path[400];
    while (dir && (e = readdir(dir)))
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) {
            snprintf(path, sizeof path, "%s/%s", d->dir, e->d_name);
            unlink(path);
        }
    if (dir)
        closedir(dir);
    rmdir(d->dir);
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

enum { SEAL_PUT, SEAL_RESERVE, SEAL_OPS };
static const char *const seal_op[SEAL_OPS] = {"put", "put_reserve"};

/* The warm passes' median GiB/s of each op against one daemon (the first pass faults the
 * arena in and is left out). */
static int seal_run(const kvt_client_conf_t *conf, size_t block, uint32_t pages, int passes,
                    const uint8_t *src, uint32_t *tok, double out[SEAL_OPS])
{
    kvt_client_t *c;
    int rc = kvt_client_connect(&c, conf);
    if (rc < 0)
        return fail("connect", rc, NULL);
    if (!kvt_client_zero_copy(c)) {
        fprintf(stderr, "bench_client: no zero-copy mapping: %s\n", kvt_client_zero_copy_reason(c));
        return 1;
    }
    uint32_t ntok = pages * PAGE_TOKENS;
    double rate[SEAL_OPS][64];
    int warm = 0;
    for (int pass = 1; pass <= passes; pass++) {
        for (int op = 0; op < SEAL_OPS; op++) {
            for (uint32_t i = 0; i < ntok; i++)
                tok[i] = 7000000u + (uint32_t)(pass * SEAL_OPS + op) * 1000000u + i;
            double t0 = now_s();
            for (uint32_t i = 0; i < pages; i++) {
                const uint8_t *p = src + (size_t)i * block;
                kvt_client_put_t pr;
                if (op == SEAL_PUT) {
                    rc = kvt_client_put(c, tok, (i + 1) * PAGE_TOKENS, i, 1, p, NULL, &pr);
                } else {
                    void *room = NULL;
                    kvt_client_resv_t rv = {.ptrs = &room};
                    rc = kvt_client_reserve(c, tok, (i + 1) * PAGE_TOKENS, i, 1, NULL, &rv);
                    if (rc == 0 && !room)
                        rc = KVT_CLIENT_ENOSPC;
                    if (rc == 0) {
                        memcpy(room, p, block);
                        rc = kvt_client_commit(c, rv.id, &pr);
                    }
                }
                if (rc < 0 || pr.stored != 1)
                    return fail(seal_op[op], rc, c);
            }
            double secs = now_s() - t0;
            if (pass > 1 && warm < 64)
                rate[op][warm] = (double)block * pages / secs / (1u << 30);
            if ((rc = kvt_client_remove(c, tok, PAGE_TOKENS)) < 0)
                return fail("remove", rc, c);
        }
        warm += pass > 1;
    }
    for (int op = 0; op < SEAL_OPS; op++)
        out[op] = median(rate[op], warm < 64 ? warm : 64);
    kvt_client_close(c);
    return 0;
}

static int bench_seal(const char *kvtierd, size_t block, uint32_t pages, int passes, int rounds)
{
    kvt_client_conf_t conf = {.model = "bench-seal",
                              .page_size = PAGE_TOKENS,
                              .block_bytes = (uint32_t)block,
                              .timeout_ms = 60000,
                              .zero_copy = 1};
    size_t n = block * pages;
    uint8_t *src = fresh(n);
    for (size_t i = 0; i < n; i++)
        src[i] = (uint8_t)(i * 131 + i / 4096);
    uint32_t *tok = malloc((size_t)pages * PAGE_TOKENS * sizeof *tok);
    double *rate[2][SEAL_OPS], *ratio[SEAL_OPS];
    for (int op = 0; op < SEAL_OPS; op++) {
        rate[0][op] = calloc((size_t)rounds, sizeof(double));
        rate[1][op] = calloc((size_t)rounds, sizeof(double));
        ratio[op] = calloc((size_t)rounds, sizeof(double));
        if (!rate[0][op] || !rate[1][op] || !ratio[op])
            return 1;
    }
    if (!tok)
        return 1;
    for (int r = 0; r < rounds; r++) {
        for (int k = 0; k < 2; k++) {
            int on = (r + k) % 2 == 0; /* on first in even rounds, off first in odd ones */
            seal_daemon_t d = {0};
            double got[SEAL_OPS];
            if (seal_start(&d, kvtierd, on, &conf) < 0) {
                seal_stop(&d);
                return 1;
            }
            kvt_client_conf_t c = conf;
            c.unix_path = d.sock;
            int rc = seal_run(&c, block, pages, passes, src, tok, got);
            seal_stop(&d);
            if (rc)
                return rc;
            for (int op = 0; op < SEAL_OPS; op++) {
                rate[on][op][r] = got[op];
                printf("{\"bench\":\"seal\",\"round\":%d,\"checksum\":\"%s\",\"op\":\"%s\","
                       "\"block_bytes\":%zu,\"pages\":%u,\"gib_s\":%.3f}\n",
                       r + 1, on ? "on" : "off", seal_op[op], block, pages, got[op]);
            }
            fflush(stdout);
        }
        for (int op = 0; op < SEAL_OPS; op++)
            ratio[op][r] = rate[1][op][r] / rate[0][op][r];
    }
    for (int op = 0; op < SEAL_OPS; op++) {
        double on = median(rate[1][op], rounds), off = median(rate[0][op], rounds);
        double rt = median(ratio[op], rounds);
        printf("{\"bench\":\"seal\",\"op\":\"%s\",\"block_bytes\":%zu,\"pages\":%u,\"rounds\":%d,"
               "\"on_gib_s\":%.3f,\"on_min\":%.3f,\"on_max\":%.3f,\"off_gib_s\":%.3f,"
               "\"off_min\":%.3f,\"off_max\":%.3f,\"ratio\":%.3f,\"ratio_min\":%.3f,"
               "\"ratio_max\":%.3f,\"ratio_of_medians\":%.3f,\"bar\":0.95,\"pass\":%s}\n",
               seal_op[op], block, pages, rounds, on, rate[1][op][0], rate[1][op][rounds - 1], off,
               rate[0][op][0], rate[0][op][rounds - 1], rt, ratio[op][0], ratio[op][rounds - 1],
               on / off, rt >= 0.95 ? "true" : "false");
    }
    for (int op = 0; op < SEAL_OPS; op++) {
        free(rate[0][op]);
        free(rate[1][op]);
        free(ratio[op]);
    }
    free(tok);
    munmap(src, n);
    return 0;
}

/* ---- connect: connections a second, libkvtier's against a plain socket's ---- */

static int plain_connect(const char *unix_path, const char *tcp)
{
    int fd;
    if (tcp) {
        char host[64];
        const char *colon = strrchr(tcp, ':');
        if (!colon || (size_t)(colon - tcp) >= sizeof host)
            return -1;
        memcpy(host, tcp, (size_t)(colon - tcp));
        host[colon - tcp] = 0;
        struct sockaddr_in sin = {.sin_family = AF_INET,
                                  .sin_port = htons((uint16_t)atoi(colon + 1))};
        if (inet_pton(AF_INET, host, &sin.sin_addr) != 1)
            return -1;
        fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0 || connect(fd, (struct sockaddr *)&sin, sizeof sin) < 0)
            goto fail;
    } else {
        struct sockaddr_un sun = {.sun_family = AF_UNIX};
        if (strlen(unix_path) >= sizeof sun.sun_path)
            return -1;
        memcpy(sun.sun_path, unix_path, strlen(unix_path) + 1);
        fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0 || connect(fd, (struct sockaddr *)&sun, sizeof sun) < 0)
            goto fail;
    }
    /* RST on close, as bench_accept's storm: no TIME_WAIT left behind for the next connects
     * (this one's and the other implementations') to search their ports around. */
    struct linger lg = {.l_onoff = 1, .l_linger = 0};
    setsockopt(fd, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
    close(fd);
    return 0;
fail:
    if (fd >= 0)
        close(fd);
    return -1;
}

#define CONNECT_IMPLS 3
static const char *const connect_impl[CONNECT_IMPLS] = {"plain", "libkvtier", "libkvtier_zc"};

/* Connections a second for secs (at least one connection) through impl i: 0 a plain socket's
 * connect and close, 1 kvt_client_connect (the HELLO's round trip) and kvt_client_close, 2 the same
 * with zero_copy on the Unix socket (the MAP of the namespace's DRAM arena, its fd passed, the
 * mmap). < 0: an error. */
static double connect_rate(const char *unix_path, const char *tcp, int impl, double secs)
{
    kvt_client_conf_t conf = {.unix_path = tcp ? NULL : unix_path,
                              .tcp = tcp,
                              .model = "bench-connect",
                              .page_size = PAGE_TOKENS,
                              .block_bytes = impl == 2 ? 256u << 10 : 0,
                              .zero_copy = impl == 2};
    long n = 0;
    double t0 = now_s(), t;
    while ((t = now_s()) - t0 < secs || n == 0) {
        if (impl == 0) {
            if (plain_connect(unix_path, tcp) < 0) {
                perror("bench_client: connect");
                return -1;
            }
        } else {
            kvt_client_t *c;
            int rc = kvt_client_connect(&c, &conf);
            if (rc < 0) {
                fprintf(stderr, "bench_client: kvt_client_connect: %s\n", kvt_client_strerror(rc));
                return -1;
            }
            if (impl == 2 && !kvt_client_zero_copy(c)) {
                fprintf(stderr, "bench_client: no mapping: %s\n", kvt_client_zero_copy_reason(c));
                kvt_client_close(c);
                return -1;
            }
            kvt_client_close(c);
        }
        n++;
    }
    return (double)n / (t - t0);
}

/*
 * connect: one client connecting and closing in a loop, each connection waiting for the last:
 * libkvtier's connect (libkvtier; libkvtier_zc on the Unix socket, with its arena's MAP)
 * against a plain socket's connect and close to the same daemon (plain, the baseline: what the
 * kernel's part costs). The implementations alternate within each round so that a change in
 * the host's load hits them alike; one line per round and implementation, then one per
 * implementation with the median over the rounds, its range and its ratio to plain's median.
 * Plain connects do not wait for the daemon to accept them: at a rate the daemon's loop does not
 * keep up with, they wait in its listener's queue, and past the queue's depth their SYN is
 * dropped (a second's retry): that rate is as much the daemon's accept as the client's connect.
 */
static int bench_connect(const char *unix_path, const char *tcp, double secs, int rounds)
{
    const char *transport = tcp ? "tcp" : "unix";
    int nimpl = tcp ? 2 : CONNECT_IMPLS;
    double *rate = calloc((size_t)rounds * CONNECT_IMPLS, sizeof *rate);
    if (!rate)
        return 1;
    for (int r = 0; r < rounds; r++) {
        for (int i = 0; i < nimpl; i++) {
            double x = connect_rate(unix_path, tcp, i, secs);
            if (x < 0) {
                free(rate);
                return 1;
            }
            rate[i * rounds + r] = x;
            /* Plain connects do not wait for the daemon's accept: those still queued would be
             * taken in the next implementation's time, ahead of its connects. A HELLO answered
             * says the daemon took every one queued before it (untimed). */
            if (i == 0 && connect_rate(unix_path, tcp, 1, 0) < 0) {
                free(rate);
                return 1;
            }
            if (i == 0)
                usleep(300000);
            printf("{\"op\":\"connect\",\"transport\":\"%s\",\"impl\":\"%s\",\"round\":%d,"
                   "\"seconds\":%.2f,\"connects_per_s\":%.0f}\n",
                   transport, connect_impl[i], r + 1, secs, x);
            fflush(stdout);
        }
    }
    double base = median(rate, rounds);
    for (int i = 0; i < nimpl; i++) {
        double *v = rate + i * rounds, lo = v[0], hi = v[0];
        for (int r = 1; r < rounds; r++) {
            lo = v[r] < lo ? v[r] : lo;
            hi = v[r] > hi ? v[r] : hi;
        }
        double med = median(v, rounds);
        printf("{\"op\":\"connect\",\"transport\":\"%s\",\"impl\":\"%s\",\"rounds\":%d,"
               "\"connects_per_s\":%.0f,\"min\":%.0f,\"max\":%.0f,\"baseline\":\"plain\","
               "\"baseline_connects_per_s\":%.0f,\"ratio\":%.3f,\"us_per_connect\":%.1f,"
               "\"baseline_us_per_connect\":%.1f}\n",
               transport, connect_impl[i], rounds, med, lo, hi, base, base > 0 ? med / base : 0,
               med > 0 ? 1e6 / med : 0, base > 0 ? 1e6 / base : 0);
    }
    free(rate);
    return 0;
}

int main(int argc, char **argv)
{
    const char *mode = argc > 1 ? argv[1] : "", *unix_path = NULL, *tcp = NULL;
    double secs = 1;
    size_t block = 2u << 20;
    uint32_t pages = 64;
    int passes = 4, rounds = 6;
    const char *kvtierd = NULL;
    for (int i = 2; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--unix"))
            unix_path = argv[i + 1];
        else if (!strcmp(argv[i], "--block-bytes"))
            block = strtoull(argv[i + 1], NULL, 0);
        else if (!strcmp(argv[i], "--pages"))
            pages = (uint32_t)strtoul(argv[i + 1], NULL, 0);
        else if (!strcmp(argv[i], "--passes"))
            passes = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--rounds"))
            rounds = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--kvtierd"))
            kvtierd = argv[i + 1];
        else if (!strcmp(argv[i], "--tcp"))
            tcp = argv[i + 1];
        else if (!strcmp(argv[i], "--seconds"))
            secs = atof(argv[i + 1]);
        else
            goto usage;
    }
    if (!block || !pages || passes < 1)
        goto usage;
    if (!strcmp(mode, "memcpy"))
        return bench_memcpy(block, pages, passes);
    if (!strcmp(mode, "connect") && (unix_path || tcp) && secs > 0 && rounds >= 1) {
        int rc = 0;
        if (tcp)
            rc |= bench_connect(NULL, tcp, secs, rounds);
        if (unix_path)
            rc |= bench_connect(unix_path, NULL, secs, rounds);
        return rc;
    }
    if (!strcmp(mode, "client") && unix_path)
        return bench_client(unix_path, block, pages, passes, 0);
    if (!strcmp(mode, "zc") && unix_path)
        return bench_client(unix_path, block, pages, passes, 1);
    if (!strcmp(mode, "seal") && kvtierd && passes >= 2 && rounds >= 1) {
        char *abs = realpath(kvtierd, NULL); /* the daemons run in directories of their own */
        if (!abs) {
            perror("bench_client: kvtierd");
            return 1;
        }
        int rc = bench_seal(abs, block, pages, passes, rounds);
        free(abs);
        return rc;
    }
usage:
    fprintf(stderr, "usage: bench_client client|zc --unix PATH [--block-bytes B] [--pages N] "
                    "[--passes R]\n       bench_client memcpy [--block-bytes B] [--pages N] "
                    "[--passes R]\n       bench_client seal --kvtierd PATH [--block-bytes B] "
                    "[--pages N] [--passes R >= 2] [--rounds K]\n       bench_client connect "
                    "[--tcp HOST:PORT] [--unix PATH] [--seconds S] [--rounds K]\n");
    return 2;
}
