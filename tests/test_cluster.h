/*
 * test_cluster.h: a real Redis Cluster on loopback for the remote tier's cluster tests.
 *
 * cl_start runs NODES redis-server processes in cluster mode (cluster-node-timeout 1000 ms,
 * persistence off, files under a fresh directory in $TMPDIR) on free ports whose bus ports
 * (port + 10000) are free too, joins them with `redis-cli --cluster create --cluster-replicas 1
 * --cluster-yes` (3 primaries, 3 replicas), and waits until every node says cluster_state:ok and
 * every replica has synced. cl_stop kills them by PID. The binaries are KVT_REDIS_SERVER (else
 * redis-server on PATH) and the redis-cli beside it (else on PATH); without them the tests skip.
 * A cluster takes about 2 s to form, so one is shared by the tests that leave it whole (started
 * by the runner, see test_remote_cluster.c) and the failover test forms its own.
 *
 * cl_replicated says when a primary's replicas have applied every write it took so far. A test
 * that kills a primary must wait for that: replication is asynchronous, and a write the replica
 * never got is lost with the primary. `WAIT 1 ms` cannot tell, when sent on a connection of its
 * own: it waits for the replication offset of that connection's last write, which is 0 for a
 * connection that wrote nothing, so any replica the primary calls online counts, at once, with
 * nothing applied.
 */
#ifndef KVT_TEST_CLUSTER_H
#define KVT_TEST_CLUSTER_H

#include <criterion/criterion.h>

#include <errno.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <hiredis/hiredis.h>

#define CL_NODES 6

typedef struct cl {
    int n;
    pid_t pid[CL_NODES];
    uint16_t port[CL_NODES];
    char dir[256];
    char seeds[256]; /* "127.0.0.1:P1,...": every node */
} cl_t;

static int cl_find(const char *name, const char *beside, char *out, size_t cap)
{
    if (beside && *beside) {
        snprintf(out, cap, "%s", beside);
        char *slash = strrchr(out, '/');
        if (slash) {
            snprintf(slash + 1, cap - (size_t)(slash + 1 - out), "%s", name);
            if (access(out, X_OK) == 0)
                return 1;
        }
    }
    const char *path = getenv("PATH");
    char buf[4096];
    snprintf(buf, sizeof(buf), "%s", path ? path : "/usr/bin");
    for (char *save = NULL, *d = strtok_r(buf, ":", &save); d; d = strtok_r(NULL, ":", &save)) {
        snprintf(out, cap, "%s/%s", d, name);
        if (access(out, X_OK) == 0)
            return 1;
    }
    return 0;
}

static int cl_binaries(char *server, char *cli, size_t cap)
{
    const char *env = getenv("KVT_REDIS_SERVER");
    if (env && *env && access(env, X_OK) == 0)
        snprintf(server, cap, "%s", env);
    else if (!cl_find("redis-server", NULL, server, cap))
        return 0;
    return cl_find("redis-cli", server, cli, cap);
}

static int cl_bindable(uint16_t port)
{
    int s = socket(AF_INET, SOCK_STREAM, 0);
    if (s < 0)
        return 0;
    struct sockaddr_in a = {
        .sin_family = AF_INET, .sin_port = htons(port), .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    int ok = bind(s, (struct sockaddr *)&a, sizeof(a)) == 0;
    close(s);
    return ok;
}

/* A port that is free, and whose cluster bus port (+10000) is free too. Both stay below the
 * kernel's ephemeral range (32768 and up by default), where any outgoing connection of the tests
 * running beside this one could take a port between this probe and the node's bind. */
static uint16_t cl_free_port(void)
{
    static unsigned seed;
    if (!seed)
        seed = (unsigned)getpid() ^ (unsigned)time(NULL);
    for (int i = 0; i < 1000; i++) {
        uint16_t p = (uint16_t)(20000 + rand_r(&seed) % 2760);
        if (cl_bindable(p) && cl_bindable((uint16_t)(p + 10000)))
            return p;
    }
    return 0;
}

static redisContext *cl_conn(uint16_t port)
{
    struct timeval tv = {1, 0};
    redisContext *c = redisConnectWithTimeout("127.0.0.1", port, tv);
    if (c && c->err) {
        redisFree(c);
        return NULL;
    }
    if (c)
        redisSetTimeout(c, tv);
    return c;
}

/* A command's reply on a fresh connection to port; NULL when the node does not answer. */
static redisReply *cl_cmd(uint16_t port, const char *fmt, ...)
{
    redisContext *c = cl_conn(port);
    if (!c)
        return NULL;
    va_list ap;
    va_start(ap, fmt);
    redisReply *r = redisvCommand(c, fmt, ap);
    va_end(ap);
    redisFree(c);
    return r;
}

static int cl_info_has(uint16_t port, const char *section, const char *needle)
{
    redisReply *r = section ? cl_cmd(port, "INFO %s", section) : cl_cmd(port, "CLUSTER INFO");
    int ok = r && r->type == REDIS_REPLY_STRING && strstr(r->str, needle);
    if (r)
        freeReplyObject(r);
    return ok;
}

static pid_t cl_spawn(const cl_t *c, const char *server, uint16_t port)
{
    char ports[16], conf[64], log[64];
    snprintf(ports, sizeof(ports), "%u", port);
    snprintf(conf, sizeof(conf), "nodes-%u.conf", port);
    snprintf(log, sizeof(log), "redis-%u.log", port);
    pid_t pid = fork();
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        execl(server, server, "--port", ports, "--bind", "127.0.0.1", "--save", "", "--appendonly",
              "no", "--dir", c->dir, "--logfile", log, "--cluster-enabled", "yes",
              "--cluster-config-file", conf, "--cluster-node-timeout", "1000", "--daemonize", "no",
              /* A replica's first sync starts at once, not after the default 5 s wait for more
               * replicas to share one diskless transfer. */
              "--repl-diskless-sync-delay", "0", (char *)NULL);
        _exit(127);
    }
    return pid;
}

static void cl_sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* Kills every node (by PID) and removes the directory. */
static void cl_stop(cl_t *c)
{
    for (int i = 0; i < c->n; i++) {
        if (c->pid[i] > 0) {
            kill(c->pid[i], SIGKILL);
            waitpid(c->pid[i], NULL, 0);
            c->pid[i] = -1;
        }
    }
    if (c->dir[0]) {
        char cmd[300];
        snprintf(cmd, sizeof(cmd), "rm -rf '%s'", c->dir);
        if (system(cmd) != 0)
            fprintf(stderr, "cluster: could not remove %s\n", c->dir);
        c->dir[0] = 0;
    }
    c->n = 0;
}

/*
 * A node redis-cli meant as a replica that is still a primary owning no slot (seen once on a
 * loaded machine: its CLUSTER REPLICATE never took) is made the replica of a primary that has
 * none, from what the node on port[0] says (CLUSTER NODES: "id addr flags primary-id ... slots").
 */
static void cl_fix_replicas(const cl_t *c)
{
    redisReply *r = cl_cmd(c->port[0], "CLUSTER NODES");
    if (!r || r->type != REDIS_REPLY_STRING) {
        if (r)
            freeReplyObject(r);
        return;
    }
    char lone[CL_NODES][41];
    uint16_t bare_port[CL_NODES];
    int nbare = 0, nlone = 0;
    char *save = NULL;
    for (char *line = strtok_r(r->str, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        char id[41], addr[64], flags[64], of[41];
        int fields = 0; /* the spaces before a field: one less than the fields */
        for (const char *q = line; *q; q++)
            fields += *q == ' ' && q[1] && q[1] != ' ';
        if (sscanf(line, "%40s %63s %63s %40s", id, addr, flags, of) != 4 || strstr(flags, "fail"))
            continue;
        int has_slots = fields >= 8; /* a slot range after the 8 fixed fields */
        if (strstr(flags, "master") && !has_slots && nbare < CL_NODES) {
            const char *colon = strchr(addr, ':');
            bare_port[nbare++] = colon ? (uint16_t)atoi(colon + 1) : 0;
        } else if (strstr(flags, "master") && has_slots && nlone < CL_NODES) {
            memcpy(lone[nlone++], id, 41); /* those with a replica are dropped below */
        }
    }
    /* Drop the primaries that have a replica already. */
    for (int i = 0; i < CL_NODES; i++) {
        char *info = NULL;
        redisReply *x = cl_cmd(c->port[i], "INFO replication");
        if (x && x->type == REDIS_REPLY_STRING && strstr(x->str, "role:slave"))
            info = strstr(x->str, "master_port:");
        uint16_t mp = info ? (uint16_t)atoi(info + strlen("master_port:")) : 0;
        if (x)
            freeReplyObject(x);
        if (!mp)
            continue;
        char mid[41] = "";
        redisReply *y = cl_cmd(mp, "CLUSTER MYID");
        if (y && y->type == REDIS_REPLY_STRING && y->len == 40)
            memcpy(mid, y->str, 41);
        if (y)
            freeReplyObject(y);
        for (int k = 0; k < nlone; k++)
            if (!strcmp(lone[k], mid))
                memmove(lone[k--], lone[--nlone], 41);
    }
    for (int i = 0; i < nbare && i < nlone; i++) {
        redisReply *x = cl_cmd(bare_port[i], "CLUSTER REPLICATE %s", lone[i]);
        if (x)
            freeReplyObject(x);
    }
    freeReplyObject(r);
}

/* One try at starting and joining the cluster (cl_start). */
static int cl_start_once(cl_t *c, char *err, size_t errcap)
{
    char server[512], cli[512];
    memset(c, 0, sizeof(*c));
    if (!cl_binaries(server, cli, sizeof(server)))
        return -1;
    const char *tmp = getenv("TMPDIR");
    snprintf(c->dir, sizeof(c->dir), "%s/kvt-cluster.XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(c->dir)) {
        snprintf(err, errcap, "mkdtemp: %s", strerror(errno));
        c->dir[0] = 0;
        return -2;
    }
    size_t off = 0;
    for (int i = 0; i < CL_NODES; i++) {
        c->port[i] = cl_free_port();
        c->pid[i] = c->port[i] ? cl_spawn(c, server, c->port[i]) : -1;
        c->n = i + 1;
        if (c->pid[i] <= 0) {
            snprintf(err, errcap, "could not start node %d", i);
            cl_stop(c);
            return -2;
        }
        off += (size_t)snprintf(c->seeds + off, sizeof(c->seeds) - off, "%s127.0.0.1:%u",
                                i ? "," : "", c->port[i]);
    }
    for (int i = 0; i < CL_NODES; i++) {
        int up = 0;
        /* A node that exits (its port taken after all) starts again on another, 5 times. */
        for (int again = 0; !up && again < 5; again++) {
            for (int t = 0; t < 400 && !up; t++) {
                up = cl_info_has(c->port[i], "server", "redis_version");
                if (!up && waitpid(c->pid[i], NULL, WNOHANG) == c->pid[i]) {
                    c->pid[i] = -1;
                    break;
                }
                if (!up)
                    cl_sleep_ms(25);
            }
            if (up)
                break;
            if (c->pid[i] > 0) {
                kill(c->pid[i], SIGKILL);
                waitpid(c->pid[i], NULL, 0);
            }
            c->port[i] = cl_free_port();
            c->pid[i] = c->port[i] ? cl_spawn(c, server, c->port[i]) : -1;
            if (c->pid[i] <= 0)
                break;
        }
        if (!up) {
            snprintf(err, errcap, "node %d never answered (last on port %u)", i, c->port[i]);
            cl_stop(c);
            return -2;
        }
    }
    off = 0; /* the seeds, with the ports the nodes did start on */
    for (int i = 0; i < CL_NODES; i++)
        off += (size_t)snprintf(c->seeds + off, sizeof(c->seeds) - off, "%s127.0.0.1:%u",
                                i ? "," : "", c->port[i]);
    char addr[CL_NODES][32], logp[300];
    const char *argv[CL_NODES + 8];
    int a = 0;
    argv[a++] = cli;
    argv[a++] = "--cluster";
    argv[a++] = "create";
    for (int i = 0; i < CL_NODES; i++) {
        snprintf(addr[i], sizeof(addr[i]), "127.0.0.1:%u", c->port[i]);
        argv[a++] = addr[i];
    }
    argv[a++] = "--cluster-replicas";
    argv[a++] = "1";
    argv[a++] = "--cluster-yes";
    argv[a] = NULL;
    snprintf(logp, sizeof(logp), "%s/create.log", c->dir);
    pid_t pid = fork();
    if (pid == 0) {
        FILE *f = freopen(logp, "w", stdout);
        (void)f;
        dup2(1, 2);
        execv(cli, (char *const *)argv);
        _exit(127);
    }
    int st = 0;
    if (pid < 0 || waitpid(pid, &st, 0) < 0 || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
        snprintf(err, errcap, "redis-cli --cluster create failed (status %d; see %s)", st, logp);
        cl_stop(c);
        return -2;
    }
    /* Every node agrees the cluster is whole, and every replica has its primary's data. Half the
     * nodes must say so as replicas: a node that redis-cli made a replica can still answer
     * role:master for a moment, before it has turned into one. */
    int ok = 0, synced = 0, bad = -1;
    for (int t = 0; t < 800; t++) {
        if (t % 40 == 39)
            cl_fix_replicas(c);
        ok = 1, synced = 0, bad = -1;
        for (int i = 0; i < CL_NODES && ok; i++) {
            int replica = cl_info_has(c->port[i], "replication", "role:slave");
            ok = cl_info_has(c->port[i], NULL, "cluster_state:ok") &&
                 (!replica || cl_info_has(c->port[i], "replication", "master_link_status:up"));
            synced += replica;
            bad = ok ? bad : i;
        }
        if (ok && synced == CL_NODES / 2)
            return 0;
        cl_sleep_ms(25);
    }
    snprintf(err, errcap,
             "the cluster never reached cluster_state:ok with %d synced replicas (node on %u not "
             "ready; %d replicas)",
             CL_NODES / 2, bad >= 0 ? c->port[bad] : 0, synced);
    cl_stop(c);
    return -2;
}

/* Starts and joins the cluster. Returns 0, or -1 when the binaries are missing (the caller
 * skips); any other failure is written to err and returns -2 (the caller fails). A cluster that
 * did not form is started again once, from new processes on new ports: redis-cli's create on a
 * loaded machine has left a node meant as a replica a primary without slots for the whole wait
 * (CI, once in the ASan pass: 2 synced replicas of 3 after 20 s), which is redis's start-up, not
 * what the tests are about; the first try's reason goes to stderr. */
static int cl_start(cl_t *c, char *err, size_t errcap)
{
    int rc = cl_start_once(c, err, errcap);
    if (rc != -2)
        return rc;
    fprintf(stderr, "test_cluster: starting the cluster again: %s\n", err);
    return cl_start_once(c, err, errcap);
}

/* The node id of the node on port (41 bytes with the NUL). */
static void cl_myid(uint16_t port, char *id)
{
    redisReply *r = cl_cmd(port, "CLUSTER MYID");
    cr_assert(r && r->type == REDIS_REPLY_STRING && r->len == 40, "CLUSTER MYID on %u", port);
    memcpy(id, r->str, 41);
    freeReplyObject(r);
}

/* The port of the primary serving slot, as the node on port asked sees it; 0 when none. */
static uint16_t cl_owner(uint16_t port, int slot)
{
    redisReply *r = cl_cmd(port, "CLUSTER SLOTS");
    uint16_t owner = 0;
    for (size_t i = 0; r && r->type == REDIS_REPLY_ARRAY && i < r->elements; i++) {
        redisReply *e = r->element[i];
        if (slot >= e->element[0]->integer && slot <= e->element[1]->integer)
            owner = (uint16_t)e->element[2]->element[1]->integer;
    }
    if (r)
        freeReplyObject(r);
    return owner;
}

/* The ports of the current primaries (that own slots), as the node on port sees them. */
static int cl_primaries(uint16_t port, uint16_t *out, int cap)
{
    redisReply *r = cl_cmd(port, "CLUSTER SLOTS");
    int n = 0;
    for (size_t i = 0; r && r->type == REDIS_REPLY_ARRAY && i < r->elements; i++) {
        uint16_t p = (uint16_t)r->element[i]->element[2]->element[1]->integer;
        int seen = 0;
        for (int k = 0; k < n; k++)
            seen |= out[k] == p;
        if (!seen && n < cap)
            out[n++] = p;
    }
    if (r)
        freeReplyObject(r);
    return n;
}

/* A number after "name" in an INFO text (name includes its ':' or '='); -1 when absent. */
static long long cl_info_num(const char *text, const char *name)
{
    const char *p = strstr(text, name);
    return p ? atoll(p + strlen(name)) : -1;
}

/* Milliseconds since t0 (CLOCK_MONOTONIC). */
static long long cl_ms_since(const struct timespec *t0)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (now.tv_sec - t0->tv_sec) * 1000ll + (now.tv_nsec - t0->tv_nsec) / 1000000;
}

/*
 * 1 once every replica of the primary on port has applied each write the primary took before
 * this call (its slave_repl_offset reached the primary's master_repl_offset), 0 when one has not
 * within ms, or the primary lists no replica within ms. The replicas are asked themselves: the
 * offset a primary lists for a replica is what the replica last acknowledged, once a second.
 */
static int cl_replicated(uint16_t port, int ms)
{
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    long long want = -1;
    uint16_t rep[CL_NODES];
    int nrep = 0;
    /* A cluster just formed may not list its replicas yet (they list themselves once their link
     * to the primary is up): ask again until one is listed, within ms. Reading the offset later
     * only asks for more than the writes before the call. */
    for (;;) {
        redisReply *r = cl_cmd(port, "INFO replication");
        if (r && r->type == REDIS_REPLY_STRING) {
            want = cl_info_num(r->str, "master_repl_offset:");
            nrep = 0;
            for (const char *p = r->str; nrep < CL_NODES && (p = strstr(p, "\nslave")); p++) {
                if (p[6] < '0' || p[6] > '9')
                    continue; /* "slave0:ip=...,port=...,state=...,offset=...": one a replica */
                long long rp = cl_info_num(p, ",port=");
                if (rp > 0 && rp < 65536)
                    rep[nrep++] = (uint16_t)rp;
            }
        }
        if (r)
            freeReplyObject(r);
        if ((want >= 0 && nrep > 0) || cl_ms_since(&t0) >= ms)
            break;
        cl_sleep_ms(10);
    }
    if (want < 0 || nrep == 0)
        return 0;
    for (int i = 0; i < nrep; i++) {
        long long have = -1;
        for (;;) {
            /* Short timeouts: a replica that does not answer is not waited for past ms. */
            struct timeval tv = {0, 100000};
            redisContext *x = redisConnectWithTimeout("127.0.0.1", rep[i], tv);
            if (x && !x->err) {
                redisSetTimeout(x, tv);
                redisReply *y = redisCommand(x, "INFO replication");
                if (y && y->type == REDIS_REPLY_STRING)
                    have = cl_info_num(y->str, "slave_repl_offset:");
                if (y)
                    freeReplyObject(y);
            }
            if (x)
                redisFree(x);
            if (have >= want || cl_ms_since(&t0) >= ms)
                break;
            cl_sleep_ms(10);
        }
        if (have < want)
            return 0;
    }
    return 1;
}

#endif
