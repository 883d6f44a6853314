/*
 * bench_accept.c: how kvtierd's loops take TCP connections (issue 42, docs/architecture.md
 * "Event loops"): loop 0 accepting every connection and handing it to the loop with the fewest
 * (kvtierd's way, conn.c's accept and kvt__loop_pick), against each loop accepting for itself on
 * its own SO_REUSEPORT listener, and against one listener in every loop's epoll set with
 * EPOLLEXCLUSIVE. The three share one skeleton, the loops' part of kvtierd's accept with nothing
 * above it: per loop a thread and an epoll set; a connection is accepted (accept4), registered
 * in its loop's set (epoll_ctl), read until its client closes, and closed.
 *
 *   storm   clients connect and close as fast as they can for --seconds: connections accepted a
 *           second, and the loops' CPU time (their threads' clocks) per connection accepted.
 *   spread  a handful (--handful) of long-lived connections, made one after another as an
 *           engine's workers do, --trials times: the share of trials in which the loops' counts
 *           differ by at most one, and the worst count one loop got.
 *
 * One JSON object per mode and load, the hand-off's figures beside it as the baseline.
 *
 * With --port P --pid PID it storms a server already listening on 127.0.0.1:P instead (kvtierd
 * with loops 1 and 2, say) and prints its CPU time per connection (PID's utime + stime, read from
 * /proc: clock ticks, so give it seconds). --from ADDR connects from that address of this host
 * instead of loopback (its non-loopback one, to a server listening on 0.0.0.0 or [::]): a peer
 * kvtierd finds neither loopback nor the address it reached, and looks up among the host's own.
 * --hold N keeps each client's last N connections open (a storm closes each at once otherwise):
 * a connection reset before the server accepts it costs the server less than a live one.
 *
 * usage: bench_accept [--loops N] [--seconds S] [--clients N] [--handful N] [--trials N]
 *                     [--hold N] [--port P --pid PID [--from ADDR]]
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#define MAX_LOOPS 16

typedef enum { HANDOFF, REUSEPORT, EXCLUSIVE, NMODES } accept_mode_t;
static const char *const mode_names[NMODES] = {"handoff", "reuseport", "epollexclusive"};

typedef struct loop {
    pthread_t th;
    int epfd, lfd; /* lfd: this loop's listener (-1: none) */
    atomic_int conns;
    atomic_ullong accepted;
} loop_t;

static struct {
    accept_mode_t mode;
    int nloops;
    loop_t loops[MAX_LOOPS];
    atomic_int stop;
    int port;
    struct in_addr from; /* --from: the storm's source address; INADDR_ANY: the kernel's pick */
} g;

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static int listener(int reuseport)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0), one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (reuseport)
        setsockopt(fd, SOL_SOCKET, SO_REUSEPORT, &one, sizeof one);
    struct sockaddr_in a = {.sin_family = AF_INET,
                            .sin_port = htons((uint16_t)g.port),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    if (bind(fd, (struct sockaddr *)&a, sizeof a) < 0 || listen(fd, 4096) < 0) {
        perror("bench_accept: bind/listen");
        exit(1);
    }
    if (!g.port) {
        socklen_t len = sizeof a;
        getsockname(fd, (struct sockaddr *)&a, &len);
        g.port = ntohs(a.sin_port);
    }
    return fd;
}

/* The fewest first, as kvt__loop_pick. */
static loop_t *pick(void)
{
    loop_t *best = &g.loops[0];
    for (int i = 1; i < g.nloops; i++)
        if (atomic_load(&g.loops[i].conns) < atomic_load(&best->conns))
            best = &g.loops[i];
    return best;
}

static void take(loop_t *to, int fd)
{
    atomic_fetch_add(&to->conns, 1);
    atomic_fetch_add(&to->accepted, 1);
    struct epoll_event ev = {.events = EPOLLIN, .data.fd = fd};
    if (epoll_ctl(to->epfd, EPOLL_CTL_ADD, fd, &ev) < 0) {
        close(fd);
        atomic_fetch_sub(&to->conns, 1);
    }
}

static void *loop_main(void *arg)
{
    loop_t *l = arg;
    struct epoll_event evs[64];
    char buf[256];
    while (!atomic_load(&g.stop)) {
        int n = epoll_wait(l->epfd, evs, 64, 50);
        for (int i = 0; i < n; i++) {
            int fd = evs[i].data.fd;
            if (fd == l->lfd) {
                for (;;) {
                    int c = accept4(fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
                    if (c < 0)
                        break;
                    take(g.mode == HANDOFF ? pick() : l, c);
                }
                continue;
            }
            ssize_t r = read(fd, buf, sizeof buf);
            if (r == 0 || (r < 0 && errno != EAGAIN)) {
                close(fd); /* leaves the epoll set with its last reference */
                atomic_fetch_sub(&l->conns, 1);
            }
        }
    }
    return NULL;
}

static double loops_cpu_s(void)
{
    double s = 0;
    for (int i = 0; i < g.nloops; i++) {
        clockid_t id;
        struct timespec ts;
        if (pthread_getcpuclockid(g.loops[i].th, &id) == 0 && clock_gettime(id, &ts) == 0)
            s += (double)ts.tv_sec + ts.tv_nsec / 1e9;
    }
    return s;
}

static void start(accept_mode_t mode, int nloops)
{
    g.mode = mode;
    g.nloops = nloops;
    g.port = 0;
    atomic_store(&g.stop, 0);
    int shared = mode == REUSEPORT ? -1 : listener(0);
    for (int i = 0; i < nloops; i++) {
        loop_t *l = &g.loops[i];
        atomic_store(&l->conns, 0);
        atomic_store(&l->accepted, 0);
        l->epfd = epoll_create1(EPOLL_CLOEXEC);
        l->lfd = mode == REUSEPORT ? listener(1) : mode == EXCLUSIVE || i == 0 ? shared : -1;
        if (l->lfd >= 0) {
            struct epoll_event ev = {.events = EPOLLIN | (mode == EXCLUSIVE ? EPOLLEXCLUSIVE : 0),
                                     .data.fd = l->lfd};
            epoll_ctl(l->epfd, EPOLL_CTL_ADD, l->lfd, &ev);
        }
    }
    for (int i = 0; i < nloops; i++)
        pthread_create(&g.loops[i].th, NULL, loop_main, &g.loops[i]);
}

static void stop(void)
{
    atomic_store(&g.stop, 1);
    for (int i = 0; i < g.nloops; i++)
        pthread_join(g.loops[i].th, NULL);
    for (int i = 0; i < g.nloops; i++) {
        if (g.loops[i].lfd >= 0 && (g.mode == REUSEPORT || i == 0))
            close(g.loops[i].lfd);
        close(g.loops[i].epfd);
    }
}

static int dial(void)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0), one = 1;
    struct sockaddr_in a = {.sin_family = AF_INET,
                            .sin_port = htons((uint16_t)g.port),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    struct sockaddr_in src = {.sin_family = AF_INET, .sin_addr = g.from};
    /* The port is picked at connect, as without the bind: the storm's ports last as long. */
    if (g.from.s_addr != htonl(INADDR_ANY) &&
        (setsockopt(fd, IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, &one, sizeof one) < 0 ||
         bind(fd, (struct sockaddr *)&src, sizeof src) < 0)) {
        close(fd);
        return -1;
    }
    if (connect(fd, (struct sockaddr *)&a, sizeof a) < 0) {
        close(fd);
        return -1;
    }
    return fd;
}

static double storm_secs;
static int storm_hold; /* --hold: connections each client keeps open, closing the oldest */
static atomic_ullong storm_fail, storm_ok;

#define MAX_HOLD 256

static void *storm_client(void *arg)
{
    (void)arg;
    int held[MAX_HOLD];
    uint32_t next = 0, n = 0;
    uint64_t end = now_ns() + (uint64_t)(storm_secs * 1e9);
    while (now_ns() < end) {
        int fd = dial();
        if (fd < 0) {
            atomic_fetch_add(&storm_fail, 1);
            usleep(1000);
            continue;
        }
        /* RST on close: no TIME_WAIT, so that the ephemeral ports last the storm. */
        struct linger lg = {.l_onoff = 1, .l_linger = 0};
        setsockopt(fd, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
        atomic_fetch_add(&storm_ok, 1);
        if (storm_hold == 0) {
            close(fd);
            continue;
        }
        /* Held: the server accepts it with its peer still there (one reset before its accept
         * ends the server's work at a failed getpeername). */
        if (n == (uint32_t)storm_hold)
            close(held[next]);
        else
            n++;
        held[next] = fd;
        next = (next + 1) % (uint32_t)storm_hold;
    }
    for (uint32_t i = 0; i < n; i++)
        close(held[i]);
    return NULL;
}

typedef struct storm {
    double per_s, cpu_us;
} storm_t;

/* PID's CPU seconds (utime + stime), -1 if unread. */
static double pid_cpu_s(pid_t pid)
{
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "re");
    size_t n = f ? fread(buf, 1, sizeof buf - 1, f) : 0;
    if (f)
        fclose(f);
    buf[n] = 0;
    char *p = strrchr(buf, ')');
    unsigned long long ut, st;
    if (!p || sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &ut, &st) != 2)
        return -1;
    return (double)(ut + st) / (double)sysconf(_SC_CLK_TCK);
}

/* The storm against another process's listener on g.port: per connection, its CPU. */
static storm_t storm_external(pid_t pid, int clients)
{
    double c0 = pid_cpu_s(pid);
    uint64_t t0 = now_ns();
    pthread_t th[64];
    for (int i = 0; i < clients; i++)
        pthread_create(&th[i], NULL, storm_client, NULL);
    for (int i = 0; i < clients; i++)
        pthread_join(th[i], NULL);
    usleep(100000);
    double secs = (double)(now_ns() - t0) / 1e9, cpu = pid_cpu_s(pid) - c0;
    unsigned long long n = atomic_load(&storm_ok);
    return (storm_t){.per_s = (double)n / secs, .cpu_us = n && c0 >= 0 ? cpu * 1e6 / (double)n : 0};
}

static storm_t storm(accept_mode_t mode, int nloops, int clients)
{
    start(mode, nloops);
    double c0 = loops_cpu_s();
    uint64_t t0 = now_ns();
    pthread_t th[64];
    for (int i = 0; i < clients; i++)
        pthread_create(&th[i], NULL, storm_client, NULL);
    for (int i = 0; i < clients; i++)
        pthread_join(th[i], NULL);
    usleep(100000); /* the last ones accepted */
    double secs = (double)(now_ns() - t0) / 1e9, cpu = loops_cpu_s() - c0;
    unsigned long long n = 0;
    for (int i = 0; i < nloops; i++)
        n += atomic_load(&g.loops[i].accepted);
    stop();
    return (storm_t){.per_s = (double)n / secs, .cpu_us = n ? cpu * 1e6 / (double)n : 0};
}

typedef struct spread {
    double even; /* share of the trials with every loop within one of the others */
    int worst;   /* the most connections one loop got in a trial */
} spread_t;

static spread_t spread(accept_mode_t mode, int nloops, int handful, int trials)
{
    int even = 0, worst = 0;
    for (int t = 0; t < trials; t++) {
        start(mode, nloops);
        int fds[64];
        for (int i = 0; i < handful; i++) {
            fds[i] = dial();
            /* Each is taken before the next connects, as an engine's workers start. */
            for (int k = 0; k < 1000; k++) {
                unsigned long long n = 0;
                for (int j = 0; j < nloops; j++)
                    n += atomic_load(&g.loops[j].accepted);
                if (n > (unsigned long long)i)
                    break;
                usleep(100);
            }
        }
        int lo = handful, hi = 0;
        for (int j = 0; j < nloops; j++) {
            int c = atomic_load(&g.loops[j].conns);
            lo = c < lo ? c : lo;
            hi = c > hi ? c : hi;
        }
        even += hi - lo <= 1;
        worst = hi > worst ? hi : worst;
        for (int i = 0; i < handful; i++)
            if (fds[i] >= 0)
                close(fds[i]);
        stop();
    }
    return (spread_t){.even = (double)even / trials, .worst = worst};
}

int main(int argc, char **argv)
{
    int nloops = 2, clients = 2, handful = 4, trials = 100, port = 0, pid = 0;
    const char *from = "127.0.0.1";
    storm_secs = 2;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--loops"))
            nloops = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--seconds"))
            storm_secs = atof(argv[i + 1]);
        else if (!strcmp(argv[i], "--clients"))
            clients = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--handful"))
            handful = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--trials"))
            trials = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--port"))
            port = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--pid"))
            pid = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--from") && inet_pton(AF_INET, argv[i + 1], &g.from) == 1)
            from = argv[i + 1];
        else if (!strcmp(argv[i], "--hold"))
            storm_hold = atoi(argv[i + 1]);
        else {
            fprintf(stderr, "bench_accept: unknown option %s\n", argv[i]);
            return 64;
        }
    }
    if (nloops < 1 || nloops > MAX_LOOPS || clients < 1 || clients > 64 || handful < 1 ||
        handful > 64 || trials < 1 || !(storm_secs > 0) || storm_hold < 0 ||
        storm_hold > MAX_HOLD) {
        fprintf(stderr, "bench_accept: loops 1..16, clients 1..64, handful 1..64, trials >= 1, "
                        "seconds > 0, hold 0..256\n");
        return 64;
    }
    if (port || pid) {
        if (port <= 0 || port > 65535 || pid <= 0) {
            fprintf(stderr, "bench_accept: --port and --pid go together\n");
            return 64;
        }
        g.port = port;
        storm_t x = storm_external((pid_t)pid, clients);
        printf("{\"op\":\"accept\",\"mode\":\"external\",\"port\":%d,\"from\":\"%s\","
               "\"clients\":%d,\"hold\":%d,\"seconds\":%.1f,\"connects_per_s\":%.0f,"
               "\"cpu_us_per_connect\":%.2f,\"failed_connects\":%llu}\n",
               port, from, clients, storm_hold, storm_secs, x.per_s, x.cpu_us,
               (unsigned long long)atomic_load(&storm_fail));
        return 0;
    }
    /* The storm's modes alternate, hand-off first, so that a change in the machine's load hits
     * each alike. */
    storm_t st[NMODES];
    for (int m = 0; m < NMODES; m++)
        st[m] = storm((accept_mode_t)m, nloops, clients);
    spread_t sp[NMODES];
    for (int m = 0; m < NMODES; m++)
        sp[m] = spread((accept_mode_t)m, nloops, handful, trials);
    for (int m = 1; m < NMODES; m++) {
        printf("{\"op\":\"accept\",\"mode\":\"%s\",\"loops\":%d,\"clients\":%d,\"seconds\":%.1f,"
               "\"accepts_per_s\":%.0f,\"cpu_us_per_accept\":%.2f,\"handful\":%d,\"trials\":%d,"
               "\"even_spread\":%.2f,\"worst_loop_conns\":%d,\"baseline\":\"handoff\","
               "\"baseline_accepts_per_s\":%.0f,\"baseline_cpu_us_per_accept\":%.2f,"
               "\"baseline_even_spread\":%.2f,\"baseline_worst_loop_conns\":%d,"
               "\"failed_connects\":%llu}\n",
               mode_names[m], nloops, clients, storm_secs, st[m].per_s, st[m].cpu_us, handful,
               trials, sp[m].even, sp[m].worst, st[HANDOFF].per_s, st[HANDOFF].cpu_us,
               sp[HANDOFF].even, sp[HANDOFF].worst, (unsigned long long)atomic_load(&storm_fail));
    }
    return 0;
}
