/*
 * loop.c: the daemon's skeleton and its loop 0 (the other loops, when loops > 1, are loops.c's).
 * It owns loop 0's epoll set, the listening
 * sockets (Unix and TCP), the signalfd for SIGTERM/SIGINT/SIGHUP/SIGUSR1 (blocked from the
 * start of main: kvt__srv_block_signals), the tier descriptors, the periodic tick (lease expiry,
 * gauges), the reload of the settings on SIGHUP, and the two ways out: the orderly shutdown
 * (SIGTERM, SIGINT: stop accepting, fail nothing that can still finish within the grace period,
 * flush replies, remove the socket file) and the drain for rolling restarts (SIGUSR1: stop
 * accepting, keep serving every connection that holds a lease, a reservation or a request, close
 * each one as soon as it holds none, exit when none is left or drain-ms has passed).
 */
#include "server.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/types.h>
#include <unistd.h>

#define KVT_GRACE_NS (5ull * 1000 * 1000 * 1000)
/* Evicted blocks remembered for the "evicted" miss reason: 2^16 slots, or the cost policy's
 * 2^22 when it shares the table (its reuse signal reads the same one). */
#define KVT_GHOST_BITS      16
#define KVT_GHOST_BITS_COST 22

static int listen_unix(kvt_srv_t *s)
{
    const char *path = s->conf->unix_path;
    struct sockaddr_un sun = {.sun_family = AF_UNIX};
    if (path[0] == '/') {
        snprintf(s->unix_path, sizeof s->unix_path, "%s", path);
    } else {
        char cwd[PATH_MAX];
        if (!getcwd(cwd, sizeof cwd))
            return -errno;
        if (strlen(cwd) + 1 + strlen(path) >= sizeof s->unix_path)
            return KVT_EINVAL;
        memcpy(s->unix_path, cwd, strlen(cwd));
        s->unix_path[strlen(cwd)] = '/';
        strcpy(s->unix_path + strlen(cwd) + 1, path);
    }
    /* bind() takes the path as given (relative to the working directory), so that a long
     * working directory does not push the name past sun_path's 108 bytes. */
    if (strlen(path) >= sizeof sun.sun_path)
        return KVT_EINVAL;
    strcpy(sun.sun_path, path);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -errno;
    /* A socket file left by a daemon that died: remove it only if nobody answers on it. */
    struct stat st;
    if (lstat(path, &st) == 0) {
        if (!S_ISSOCK(st.st_mode)) {
            close(fd);
            return KVT_EEXIST;
        }
        int probe = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        int live = probe >= 0 && connect(probe, (struct sockaddr *)&sun, sizeof sun) == 0;
        if (probe >= 0)
            close(probe);
        if (live) {
            close(fd);
            return -EADDRINUSE;
        }
        unlink(path);
    }
    mode_t old = umask(0777 & ~s->conf->unix_mode);
    int rc = bind(fd, (struct sockaddr *)&sun, sizeof sun);
    umask(old);
    /* As deep as the TCP listener's (net.c): past a full queue a connect here fails (EAGAIN). */
    if (rc < 0 || chmod(path, s->conf->unix_mode) < 0 || listen(fd, SOMAXCONN) < 0) {
        rc = -errno;
        close(fd);
        return rc;
    }
    return fd;
}

static void on_unix(kvt_srv_t *s, kvt__ev_t *ev, uint32_t events)
{
    (void)events;
    kvt__conn_accept(s, ev->fd, 0);
}

static void on_tcp(kvt_srv_t *s, kvt__ev_t *ev, uint32_t events)
{
    (void)events;
    kvt__conn_accept(s, ev->fd, 1);
}

void kvt__srv_notify(const char *state)
{
    const char *path = getenv("NOTIFY_SOCKET");
    struct sockaddr_un sun = {.sun_family = AF_UNIX};
    size_t len = path ? strlen(path) : 0;
    if (len < 2 || len >= sizeof sun.sun_path || (path[0] != '/' && path[0] != '@'))
        return;
    memcpy(sun.sun_path, path, len);
    if (path[0] == '@')
        sun.sun_path[0] = 0; /* an abstract socket */
    int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return;
    socklen_t sl = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + len);
    if (sendto(fd, state, strlen(state), MSG_NOSIGNAL, (struct sockaddr *)&sun, sl) < 0)
        kvt_log(KVT_LOG_DEBUG, "kvtierd: notify %s: %s", state, strerror(errno));
    close(fd);
}

/* SIGHUP: the settings read again (server/conf.c says which can change while running). */
static void reload(kvt_srv_t *s)
{
    char err[512] = "";
    kvt__srv_notify("RELOADING=1");
    int rc = kvt__conf_reload(s->conf, err, sizeof err);
    if (rc < 0) {
        kvt_log(KVT_LOG_ERROR, "kvtierd: reload refused, nothing changed: %s",
                err[0] ? err : kvt_strerror(rc));
        kvt__metric_add(s->metrics, KVT_M_CONFIG_RELOAD_FAILURES, 0, 1);
    } else {
        if (s->policy)
            kvt_policy_tune(s->policy, (float)s->conf->policy_high, (float)s->conf->policy_low,
                            s->conf->nvme_min_hits);
        kvt__store_quotas(s);
        kvt__turns_reload(s);
        kvt_log(KVT_LOG_INFO, "kvtierd: reload: %d setting%s changed", rc, rc == 1 ? "" : "s");
        kvt__metric_add(s->metrics, KVT_M_CONFIG_RELOADS, 0, 1);
    }
    kvt__srv_notify("READY=1");
}

static void close_listeners(kvt_srv_t *s)
{
    if (s->unix_ev.fd >= 0) {
        kvt__ev_del(s, &s->unix_ev);
        close(s->unix_ev.fd);
        s->unix_ev.fd = -1;
    }
    if (s->tcp_ev.fd >= 0) {
        kvt__ev_del(s, &s->tcp_ev);
        close(s->tcp_ev.fd);
        s->tcp_ev.fd = -1;
    }
}

/* A connection the drain may close: it holds nothing a client is still using. */
static int conn_quiet(const kvt__conn_t *c)
{
    return !c->nleases && !c->nresv && !c->inflight && !c->head && !c->in_len;
}

static int busy(const kvt_srv_t *s);

/* One drain step (each tick): returns 1 when the daemon may exit. */
static int drain_step(kvt_srv_t *s, uint64_t now)
{
    kvt__conn_t *next;
    for (kvt__conn_t *c = s->clients.list; c; c = next) {
        next = c->next; /* the kick frees a quiet connection */
        if (!c->closing && conn_quiet(c)) {
            c->closing = 1;
            kvt__conn_kick(c);
        }
    }
    if (!s->clients.n && !busy(s)) {
        kvt_log(KVT_LOG_INFO, "kvtierd: drained: no connection left");
        return 1;
    }
    if (now >= s->drain_until_ns) {
        kvt_log(KVT_LOG_WARN,
                "kvtierd: drain-ms passed with %u connection%s left: shutting down (their "
                "leases are released)",
                s->clients.n, s->clients.n == 1 ? "" : "s");
        s->stopping = 1;
    }
    return 0;
}

static void on_signal(kvt_srv_t *s, kvt__ev_t *ev, uint32_t events)
{
    (void)events;
    struct signalfd_siginfo si;
    while (read(ev->fd, &si, sizeof si) == sizeof si) {
        if (si.ssi_signo == SIGHUP) {
            s->reload = 1; /* on the loop's next turn, outside any handler */
            continue;
        }
        if (si.ssi_signo == SIGUSR1) {
            if (!s->draining && !s->stopping) {
                kvt_log(KVT_LOG_INFO,
                        "kvtierd: SIGUSR1 received, draining: no new connections; each one closes "
                        "once it holds no lease, reservation or request (at most %u ms)",
                        s->conf->drain_ms);
                s->draining = 1;
                kvt__metric_set(s->metrics, KVT_M_DRAINING, 0, 1);
                s->drain_until_ns = kvt_now_ns() + (uint64_t)s->conf->drain_ms * 1000000ull;
                close_listeners(s);
                kvt__srv_notify("STOPPING=1");
            }
            continue;
        }
        if (!s->stopping)
            kvt_log(KVT_LOG_INFO, "kvtierd: %s received, shutting down",
                    si.ssi_signo == SIGINT ? "SIGINT" : "SIGTERM");
        s->stopping = 1;
    }
}

static void signal_set(sigset_t *set)
{
    sigemptyset(set);
    sigaddset(set, SIGTERM);
    sigaddset(set, SIGINT);
    sigaddset(set, SIGHUP);
    sigaddset(set, SIGUSR1);
}

int kvt__srv_block_signals(void)
{
    sigset_t set;
    signal_set(&set);
    int rc = pthread_sigmask(SIG_BLOCK, &set, NULL);
    return rc ? -rc : 0;
}

static void on_tier(kvt_srv_t *s, kvt__ev_t *ev, uint32_t events)
{
    (void)events;
    kvt_tier_t *t = s->tiers[ev - s->tier_ev];
    /* The completions' kicks of loop 0's connections wait for the batch's end, so that the
     * replies it finishes on a connection leave in one writev (the others' go posted to their
     * loops, once each already). With several loops they stay posted: run0 kicks them after its
     * batch, shared, their socket writes and GETs' checksums with the lock let go (with the
     * write lock held here, those held every other loop back for as long). */
    kvt__kicks_defer(&s->loops[0]);
    int rc = kvt_tier_process(t);
    if (s->loops_running)
        kvt__kicks_keep(&s->loops[0]);
    else
        kvt__kicks_flush(&s->loops[0]);
    if (rc < 0)
        kvt_log(KVT_LOG_WARN, "kvtierd: %s tier: processing completions: %s",
                kvt_tier_name(kvt_tier_kind(t)), kvt_strerror(rc));
}

/* Descriptors besides client connections: listeners, epoll, signals, timers, the tiers' files
 * and rings and remote connection, metrics scrapes (64 at most), the spare, and slack. */
#define KVT_FD_RESERVE 160

/*
 * The open-file limit must hold max-conns clients and the daemon's own descriptors. Debian's
 * default soft limit is 1024, the same as max-conns': the soft limit is raised as far as the hard
 * limit lets it, and if that is not far enough the daemon says how many clients it can hold (the
 * rest are refused, kvt__accept).
 */
static void fd_limit(const kvt_srv_conf_t *c)
{
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0)
        return;
    /* Zero-copy: an arena's memfd each, and a connection's MAP reply holds one until sent. */
    rlim_t want = (rlim_t)c->max_conns + KVT_FD_RESERVE +
                  (c->zero_copy ? (rlim_t)c->zero_copy_arenas + c->max_conns : 0);
    if (rl.rlim_cur != RLIM_INFINITY && rl.rlim_cur < want) {
        rlim_t was = rl.rlim_cur;
        rl.rlim_cur = rl.rlim_max == RLIM_INFINITY ? want : KVT_MIN(want, rl.rlim_max);
        if (rl.rlim_cur > was && setrlimit(RLIMIT_NOFILE, &rl) == 0)
            kvt_log(KVT_LOG_INFO, "kvtierd: open-file limit raised from %llu to %llu",
                    (unsigned long long)was, (unsigned long long)rl.rlim_cur);
        else
            rl.rlim_cur = was;
    }
    if (rl.rlim_cur != RLIM_INFINITY && rl.rlim_cur < want)
        kvt_log(KVT_LOG_WARN,
                "kvtierd: the open-file limit (%llu, hard %llu) is below max-conns (%u) plus the "
                "%d descriptors kept for the daemon: connections past it are refused; raise it "
                "(ulimit -n) or lower max-conns",
                (unsigned long long)rl.rlim_cur, (unsigned long long)rl.rlim_max, c->max_conns,
                KVT_FD_RESERVE);
}

/* What a writer does first, before anything can change the tree (lock.c): the loops' deferred
 * MATCH hits, then the frees that waited for reads their GETs dropped with the lock shared. */
static void lock_settle(kvt_srv_t *s)
{
    kvt__match_settle(s);
    kvt__busy_settle(s);
}

int kvt__srv_open(kvt_srv_t **out, kvt_srv_conf_t *conf)
{
    kvt_srv_t *s = calloc(1, sizeof *s);
    if (!s)
        return KVT_ENOMEM;
    s->conf = conf;
    s->conn_ops = &kvt__dispatch_ops;
    s->put_gate = getenv("KVT_DEBUG_PUT_GATE");
    s->get_check_gate = getenv("KVT_DEBUG_GET_CHECK_GATE");
    s->sig_ev.fd = s->unix_ev.fd = s->tcp_ev.fd = s->http_ev.fd = -1;
    fd_limit(conf);
    s->clients.spare_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    for (int i = 0; i < KVT_TIER_COUNT; i++)
        s->tier_ev[i].fd = -1;
    s->clients.next_id = 1;
    s->internal_owner = 1ull << 63;
    s->started_ns = kvt_now_ns();
    int rc = KVT_ENOMEM;
    kvt_policy_kind_t kind;
    unsigned ghost_bits = kvt_policy_kind_parse(conf->policy, &kind) == 0 && kind == KVT_POLICY_COST
                              ? KVT_GHOST_BITS_COST
                              : KVT_GHOST_BITS;
    if (kvt_ghosts_create(&s->exec.ghosts, ghost_bits) < 0 || kvt__metrics_create(&s->metrics) < 0)
        goto fail;
    kvt__metrics_ns_limit(s->metrics, conf->metrics_namespaces);
    if (kvt_model_profile_get(conf->policy_model, &s->cost_model) < 0 ||
        kvt_hw_profile_get(conf->policy_hw, &s->cost_hw) < 0) {
        rc = KVT_EINVAL; /* kvt__conf_finish checked them: not reached */
        goto fail;
    }
    kvt__mrc_conf_t mc = {.rate = conf->mrc_sample_rate, .max_keys = conf->mrc_max_keys};
    if (conf->mrc && (rc = kvt__mrc_create(&s->mrc, &mc)) < 0)
        goto fail;
    s->epfd = epoll_create1(EPOLL_CLOEXEC);
    if (s->epfd < 0) {
        rc = -errno;
        goto fail;
    }
    if ((rc = kvt__loops_open(s)) < 0)
        goto fail;
    s->lock_settle = lock_settle;
    /* Without its own table a loop would count into the main one beside the others: no start. */
    if ((rc = kvt__metrics_loops(s->metrics, s->nloops)) < 0)
        goto fail;
    kvt_radix_conf_t rconf = {.free_cb = kvt__store_free_cb,
                              .node_free_cb = kvt__store_node_free_cb,
                              .free_arg = s,
                              .arena_bytes = s->conf->index_bytes,
                              .arena_reserve = s->conf->index_prefault};
    /* The prefault is filled here, before the listeners open: a client's first requests then
     * find the index's memory faulted in (docs/server.md, index-prefault). */
    uint64_t t0 = kvt_now_ns();
    rc = kvt_radix_create(&s->radix, &rconf);
    if (rc < 0)
        goto fail;
    if (s->conf->index_prefault)
        kvt_log(KVT_LOG_INFO, "kvtierd: index: %llu MiB pre-faulted in %llu ms",
                (unsigned long long)(s->conf->index_prefault >> 20),
                (unsigned long long)((kvt_now_ns() - t0) / 1000000));
    rc = kvt__store_open(s);
    if (rc < 0)
        goto fail;
    /* After the NVMe recovery: a lowered max-namespaces frees no recovered block; it refuses new
     * namespaces until enough of those have emptied. */
    kvt_radix_set_max_namespaces(s->radix, s->conf->max_namespaces);
    for (int i = 0; i < KVT_TIER_COUNT; i++) {
        if (!s->tiers[i])
            continue;
        s->tier_ev[i].fd = kvt_tier_fd(s->tiers[i]);
        s->tier_ev[i].cb = on_tier;
        if (s->tier_ev[i].fd >= 0 && (rc = kvt__ev_add(s, &s->tier_ev[i], EPOLLIN)) < 0)
            goto fail;
    }

    /* The signals were blocked before anything else ran (main); blocking them again is a no-op
     * there and keeps a caller other than main correct. A SIGTERM that came during start-up
     * (the NVMe recovery, pinning the DRAM tier) is pending: the signalfd reads it on the loop's
     * first turn, and the daemon shuts down cleanly. */
    sigset_t set;
    signal_set(&set);
    if ((rc = kvt__srv_block_signals()) < 0)
        goto fail;
    signal(SIGPIPE, SIG_IGN);
    s->sig_ev.fd = signalfd(-1, &set, SFD_NONBLOCK | SFD_CLOEXEC);
    s->sig_ev.cb = on_signal;
    if (s->sig_ev.fd < 0 || (rc = kvt__ev_add(s, &s->sig_ev, EPOLLIN)) < 0) {
        rc = s->sig_ev.fd < 0 ? -errno : rc;
        goto fail;
    }

    if (*conf->unix_path) {
        rc = listen_unix(s);
        if (rc < 0) {
            kvt_log(KVT_LOG_ERROR, "kvtierd: cannot listen on unix:%s: %s", conf->unix_path,
                    kvt_strerror(rc));
            s->unix_path[0] = 0;
            goto fail;
        }
        s->unix_ev.fd = rc;
        s->unix_ev.cb = on_unix;
        if ((rc = kvt__ev_add(s, &s->unix_ev, EPOLLIN)) < 0)
            goto fail;
    }
    if (*conf->tcp) {
        rc = kvt__listen_tcp(conf->tcp, s->tcp_addr, sizeof s->tcp_addr);
        if (rc < 0) {
            kvt_log(KVT_LOG_ERROR, "kvtierd: cannot listen on tcp:%s: %s", conf->tcp,
                    kvt_strerror(rc));
            goto fail;
        }
        s->tcp_ev.fd = rc;
        s->tcp_ev.cb = on_tcp;
        if (!*conf->secret && !kvt__listen_loopback(rc))
            kvt_log(KVT_LOG_WARN,
                    "kvtierd: tcp %s is reachable from other machines and no secret is set: "
                    "anyone who reaches it can read, write and remove cached KV bytes",
                    s->tcp_addr);
        if ((rc = kvt__ev_add(s, &s->tcp_ev, EPOLLIN)) < 0)
            goto fail;
    }
    if (*conf->metrics) {
        rc = kvt__http_listen(s, conf->metrics);
        if (rc < 0) {
            kvt_log(KVT_LOG_ERROR, "kvtierd: cannot serve metrics on %s: %s", conf->metrics,
                    kvt_strerror(rc));
            goto fail;
        }
    }
    *out = s;
    return 0;
fail:
    kvt__srv_close(s);
    return rc;
}

/* Requests still waiting on tier I/O, over all connections and orphans. */
static int busy(const kvt_srv_t *s)
{
    return s->inflight > 0;
}

/* Bytes of zero-copy seals hashed per loop iteration: 3-8 us (tiers/dram.c, docs/tiers.md). */
#define KVT_SEAL_SLICE (256u << 10)

/* The work after each batch of events, on any loop (loops.c calls it on loops 1..): requests
 * waiting for moves, connections waiting for memory, the policy's step, a slice of the seals. */
static void loop_after(kvt__loop_t *l)
{
    kvt_srv_t *s = l->srv;
    /* Requests waiting for moves go first, before the policy's step can start new moves on
     * what they wait for: a REMOVE behind a demotion that fails every time (a remote tier
     * that is down) would otherwise never find its prefix free. */
    if (s->exec.moves_landed) {
        s->exec.moves_landed = 0;
        if (s->reqs_waiting)
            kvt__conns_deadlines(s, kvt_now_ns());
    }
    if (s->clients.mem_waiting)
        kvt__conns_mem_retry(s);
    kvt__store_step(s); /* the policy's bounded maintenance, after what came in */
    /* A slice of the zero-copy seals (op_put.c resv_seal): a few microseconds between
     * events, so that no request waits for a whole block's hash. With more to hash, the CPU
     * goes first to whoever waits for it (the loop yields once the lock is let go): the client
     * that COMMIT's reply just woke runs on this CPU (a Unix socket's sync wakeup), and would
     * otherwise wait, runnable, until the whole block is hashed (COMMIT's round trip 41 us
     * instead of 6 for 2 MiB, docs/benchmarks.md). */
    l->sealing = kvt_tier_dram_seal_step(s->tiers[KVT_TIER_DRAM], KVT_SEAL_SLICE) > 0;
}

/* Loop 0's tick: deadlines, slow clients, gauges, the drain. Under the write lock. Returns 1 when
 * the drain is over and the daemon may exit. */
static int tick(kvt_srv_t *s, uint64_t now)
{
    if (s->draining && !s->stopping && drain_step(s, now))
        return 1;
    kvt__conns_tick(s, now);
    kvt__http_tick(s, now);
    kvt__auth_tick(s, now);
    kvt__tier_metrics(s);
    kvt__loops_gauges(s);
    kvt__loops_cpu(s);
    kvt_tier_dram_decay(s->tiers[KVT_TIER_DRAM]); /* shared arenas' freed pages go back */
    kvt_radix_set_clock(s->radix, (uint32_t)((now - s->started_ns) / 1000000));
    return 0;
}

/* While stopping, loop 0 looks this often at whether what was in flight has finished (the other
 * loops close their connections with no event on loop 0 to say so). */
#define KVT_STOP_POLL_MS 10

/*
 * Loop 0. With several loops it holds s->lock as the others do (loops.c, loop_main): shared from
 * each wake, for writing only for what writes: its own events (listeners, signals, tier
 * completions, the metrics port: kvt__ev_t.shared 0), the frames of its connections that write
 * (conn.c), the tick, the shutdown, a reload, and the step after a batch that wrote; not at all in
 * epoll_wait and its connections' socket I/O. With one loop it holds it for writing throughout.
 */
static int run0(kvt_srv_t *s)
{
    struct epoll_event evs[256];
    uint64_t next_tick = kvt_now_ns(), stop_at = 0;
    kvt__loop_t *l = &s->loops[0];
    for (;;) {
        uint64_t now = kvt_now_ns();
        if (s->stopping || s->reload)
            kvt__loop_hold(l, KVT_HELD_WRITE);
        if (s->stopping) {
            if (!stop_at) {
                stop_at = now + KVT_GRACE_NS;
                kvt__srv_notify("STOPPING=1");
                /* No new connections, no new requests; what is in flight may finish. */
                close_listeners(s);
                kvt__conn_t *next;
                for (kvt__conn_t *c = s->clients.list; c; c = next) {
                    next = c->next; /* the kick frees an idle connection */
                    c->closing = 1;
                    kvt__conn_kick(c);
                }
            }
            int pending_out = 0;
            for (kvt__conn_t *c = s->clients.list; c; c = c->next)
                pending_out |= c->head != NULL;
            if ((!busy(s) && !pending_out) || now >= stop_at) {
                if (busy(s))
                    kvt_log(KVT_LOG_WARN, "kvtierd: %llu tier I/Os still in flight at exit",
                            (unsigned long long)s->inflight);
                return 0;
            }
        }
        if (s->reload) {
            s->reload = 0;
            reload(s);
        }
        /* Seals of committed zero-copy pages still queued, or PUTs' copies (queued by the step's
         * kicks): no sleep until they are done; nor past the next stall of a turn's holder
         * (kvt__turns_step). */
        int timeout =
            l->sealing || l->apart || now >= next_tick ? 0 : (int)((next_tick - now) / 1000000) + 1;
        int turns = kvt__turns_step(l);
        if (turns >= 0 && turns < timeout)
            timeout = turns;
        if (s->stopping && timeout > KVT_STOP_POLL_MS)
            timeout = KVT_STOP_POLL_MS;
        if (s->nloops > 1)
            kvt__loop_hold(l, KVT_HELD_NONE);
        if (l->sealing)
            sched_yield(); /* loop_after: the CPU to whoever waits for the seals */
        int n = epoll_wait(s->epfd, evs, (int)KVT_ARRAY_LEN(evs), timeout);
        int err = errno;
        l->wrote = 0;
        if (s->nloops > 1)
            kvt__loop_hold(l, KVT_HELD_SHARED);
        if (n < 0) {
            if (err == EINTR)
                continue;
            kvt_log(KVT_LOG_ERROR, "kvtierd: epoll_wait: %s", strerror(err));
            return -err;
        }
        for (int i = 0; i < n; i++) {
            kvt__ev_t *ev = evs[i].data.ptr;
            if (!ev->shared)
                kvt__loop_hold(l, KVT_HELD_WRITE);
            ev->cb(s, ev, evs[i].events);
        }
        kvt__put_apart(l);
        if (s->nloops > 1 && l->posted) { /* as loop i's (loops.c): the completions' kicks */
            kvt__loop_hold(l, KVT_HELD_SHARED);
            kvt__posted_shared(l);
        }
        now = kvt_now_ns();
        if (now >= next_tick) {
            kvt__loop_hold(l, KVT_HELD_WRITE);
            /* Read again: the wait for the lock lets other loops stamp their connections
             * (stuck_ns, rx_ns) after the read above, and the tick's ages count from them. */
            now = kvt_now_ns();
            if (tick(s, now))
                return 0;
            next_tick = now + (uint64_t)s->conf->tick_ms * 1000000ull;
        }
        /* The step after a batch that wrote, the tick's included (at least every tick-ms); with
         * one loop, which holds the lock for writing throughout, after every batch. */
        if (l->held == KVT_HELD_WRITE || l->wrote || kvt__loop_busy(l)) {
            kvt__loop_hold(l, KVT_HELD_WRITE);
            loop_after(l);
            kvt__conns_reap(l); /* no event or walk holds one of its connections here */
        }
    }
}

int kvt__srv_run(kvt_srv_t *s)
{
    kvt__loop_hold(&s->loops[0], KVT_HELD_WRITE);
    kvt__loops_start(s, loop_after);
    int rc = run0(s);
    kvt__put_apart(&s->loops[0]); /* what a stop past its grace left: their requests go */
    kvt__loop_hold(&s->loops[0], KVT_HELD_WRITE); /* kvt__loops_stop's */
    kvt__loops_stop(s);
    kvt__loop_hold(&s->loops[0], KVT_HELD_NONE);
    return rc;
}

void kvt__srv_close(kvt_srv_t *s)
{
    if (!s)
        return;
    while (s->clients.list)
        kvt__conn_close(s->clients.list);
    kvt__loops_close(s);
    kvt__http_close(s);
    if (s->unix_ev.fd >= 0)
        close(s->unix_ev.fd);
    if (s->unix_path[0])
        unlink(s->unix_path);
    if (s->tcp_ev.fd >= 0)
        close(s->tcp_ev.fd);
    if (s->sig_ev.fd >= 0)
        close(s->sig_ev.fd);
    if (s->clients.spare_fd >= 0)
        close(s->clients.spare_fd);
    free(s->clients.host_addrs);
    /* The tree first (policy.h: the policy goes after the tree it borrows). Its free callbacks
     * give nothing back on KVT_RADIX_DESTROY (kvt__store_free_cb returns early): each tier,
     * destroyed next in kvt__store_close, frees all of its blocks at once, and NVMe keeps its
     * data on disk for a warm restart. */
    kvt_radix_destroy(s->radix);
    s->radix = NULL;
    kvt__store_close(s);
    if (s->epfd > 0)
        close(s->epfd);
    kvt__metrics_destroy(s->metrics);
    kvt__mrc_destroy(s->mrc);
    kvt_ghosts_destroy(s->exec.ghosts);
    free(s->ns);
    free(s);
}
