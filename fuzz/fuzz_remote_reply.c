/*
 * fuzz_remote_reply.c: libFuzzer harness for the remote tier's reply handling (tiers/remote.c:
 * hiredis's reader with the tier's reply functions, on_reply for the handshake, SET, GET, EXISTS
 * and DEL, and the cut of oversized GET values). The harness plays the Valkey/Redis server on a
 * loopback socket of its own: the tier connects to it, and each command the tier sends is
 * answered with the input's next chunk of bytes, whatever they are; when the chunks run out the
 * harness closes the connection. The tier meanwhile writes a block, probes two keys, reads the
 * block back once it is written and frees it. Whatever the replies, every request completes
 * (with a status), nothing leaks, and a block read back is the block written.
 *
 * Input: u8 flags (1: a password, so the handshake has an AUTH; 2: a database, so a SELECT),
 * then chunks of u16 length (little-endian) and that many bytes.
 * KVT_FUZZ_MAKE_SEEDS=DIR writes seed inputs into DIR, recorded from a server that answers as
 * Redis would (and one that answers with misses and errors), and exits.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "tier.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerInitialize(int *argc, char ***argv);

#define PAGE 16
#define LEN  600

static int lfd = -1;
static uint16_t port;

/* --- the server's side --- */

typedef struct cmd {
    int argc;
    const char *argv[8];
    size_t len[8];
} cmd_t;

/* Parses one command (an array of bulk strings) at p; returns its bytes, 0 when it is not whole
 * yet, -1 when it is not a command. */
static long parse_cmd(const char *p, size_t n, cmd_t *c)
{
    const char *end = p + n, *q = p;
    if (q >= end)
        return 0;
    if (*q != '*')
        return -1;
    char *e;
    const char *nl = memchr(q, '\n', (size_t)(end - q));
    if (!nl)
        return 0;
    long argc = strtol(q + 1, &e, 10);
    if (argc < 1 || argc > 8)
        return -1;
    q = nl + 1;
    c->argc = (int)argc;
    for (long i = 0; i < argc; i++) {
        if (q >= end)
            return 0;
        if (*q != '$')
            return -1;
        nl = memchr(q, '\n', (size_t)(end - q));
        if (!nl)
            return 0;
        long len = strtol(q + 1, &e, 10);
        if (len < 0)
            return -1;
        q = nl + 1;
        if ((size_t)(end - q) < (size_t)len + 2)
            return 0;
        c->argv[i] = q;
        c->len[i] = (size_t)len;
        q += len + 2;
    }
    return q - p;
}

static int is(const cmd_t *c, const char *name)
{
    return c->len[0] == strlen(name) && !strncasecmp(c->argv[0], name, c->len[0]);
}

/* A server that answers as Redis would (mode 0), or with misses and errors (mode 1): what the
 * seeds are recorded from. Writes the reply into out; returns its length. */
static size_t auto_reply(const cmd_t *c, int mode, char *out, size_t cap, char *value,
                         size_t *value_len)
{
    if (is(c, "PING"))
        return (size_t)snprintf(out, cap, "+PONG\r\n");
    if (is(c, "AUTH") || is(c, "SELECT"))
        return (size_t)snprintf(out, cap, mode ? "-WRONGPASS invalid password\r\n" : "+OK\r\n");
    if (is(c, "SET") && c->argc >= 3) {
        *value_len = c->len[2] < 4096 ? c->len[2] : 4096;
        memcpy(value, c->argv[2], *value_len);
        return (size_t)snprintf(out, cap, mode ? "-OOM command not allowed\r\n" : "+OK\r\n");
    }
    if (is(c, "GET")) {
        if (mode || !*value_len)
            return (size_t)snprintf(out, cap, "$-1\r\n");
        size_t n = (size_t)snprintf(out, cap, "$%zu\r\n", *value_len);
        memcpy(out + n, value, *value_len);
        memcpy(out + n + *value_len, "\r\n", 2);
        return n + *value_len + 2;
    }
    if (is(c, "EXISTS"))
        return (size_t)snprintf(out, cap, ":%d\r\n", mode ? 0 : 1);
    if (is(c, "DEL"))
        return (size_t)snprintf(out, cap, ":1\r\n");
    return (size_t)snprintf(out, cap, "-ERR unknown command\r\n");
}

/* --- the tier's side --- */

typedef struct run {
    int written, read, probed; /* completions */
    int wstatus, rstatus, pstatus;
} run_t;

static void on_write(kvt_tier_io_t *io)
{
    run_t *r = io->data;
    r->written = 1;
    r->wstatus = io->status;
}

static void on_read(kvt_tier_io_t *io)
{
    run_t *r = io->data;
    r->read = 1;
    r->rstatus = io->status;
}

static void on_probe(kvt_tier_probe_t *p)
{
    run_t *r = p->data;
    r->probed = 1;
    r->pstatus = p->status;
}

static kvt_block_key_t key_of(uint32_t i, uint32_t *tok)
{
    for (uint32_t k = 0; k < PAGE; k++)
        tok[k] = i * 100 + k;
    return (kvt_block_key_t){.ns_seed = 7,
                             .hash = 0x5000 + i,
                             .parent = i ? 0x5000 + i - 1 : 7,
                             .tokens = tok,
                             .ntokens = PAGE};
}

/*
 * One session. With data (the fuzz input's chunks), each command is answered with the next
 * chunk; with rec (making seeds), auto_reply(mode) answers and the chunks are appended to rec.
 */
static void session(uint8_t flags, const uint8_t *data, size_t size, int mode, FILE *rec)
{
    kvt_tier_remote_conf_t conf = {.host = "127.0.0.1",
                                   .port = port,
                                   .password = (flags & 1) ? "secret" : NULL,
                                   .db = (flags & 2) ? 3 : 0,
                                   .capacity_bytes = 1 << 20,
                                   .timeout_ms = 200,
                                   .backoff_min_ms = 1000,
                                   .max_inflight = 8};
    /* Connections left in the backlog by earlier sessions' tiers (all closed) go first. */
    for (int fd; (fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC)) >= 0;)
        close(fd);
    kvt_tier_t *t = NULL;
    if (kvt_tier_remote_create(&t, &conf) != 0)
        abort();
    int sfd = -1;
    for (int i = 0; i < 2000 && sfd < 0; i++) {
        kvt_tier_wait(t, 0);
        struct pollfd pl = {.fd = lfd, .events = POLLIN};
        if (poll(&pl, 1, 1) == 1)
            sfd = accept4(lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    }
    if (sfd < 0)
        abort(); /* the tier never connected */
    run_t run = {0};
    static uint8_t wbuf[LEN], rbuf[LEN];
    uint32_t wtok[PAGE], ptok[2][PAGE];
    memset(wbuf, 0x3c, sizeof wbuf);
    kvt_tier_io_t w = {
        .key = key_of(0, wtok), .buf = wbuf, .len = LEN, .cb = on_write, .data = &run};
    kvt_tier_io_t r = {.cb = on_read, .data = &run, .buf = rbuf, .len = LEN};
    kvt_block_key_t pkeys[2] = {key_of(0, ptok[0]), key_of(1, ptok[1])};
    kvt_tier_probe_t p = {.keys = pkeys, .n = 2, .cb = on_probe, .data = &run};
    int wrc = kvt_tier_write(t, &w), prc = kvt_tier_remote_probe(t, &p), rrc = -1, freed = 0;
    static char in[1 << 16];
    static char value[4096], out[8192];
    size_t in_len = 0, at = 0, value_len = 0;
    int closed = 0, idle = 0;
    for (int step = 0; step < 4000; step++) {
        /* Loopback delivers a write to the peer's socket before write() returns, so while the
         * connection is open a step that polls without waiting sees whatever the other side
         * sent: an idle step is one where the tier had nothing to say, and the harness need not
         * sleep to know it (a 1 ms sleep per idle step made the harness 15 times slower). Once
         * the harness has closed, the tier is given time to see it. */
        kvt_tier_wait(t, closed ? 1 : 0);
        if (!closed) {
            ssize_t n = read(sfd, in + in_len, sizeof in - in_len);
            if (n > 0)
                in_len += (size_t)n;
            else if (n == 0)
                closed = 1; /* the tier dropped the connection */
            idle = n > 0 ? 0 : idle + 1;
            if (!rec && idle == 3 && at < size) {
                /* The tier waits for the rest of a reply that a short chunk left unfinished:
                 * whatever the input has left goes out now, then the connection closes. */
                if (write(sfd, data + at, size - at) < 0)
                    closed = 1;
                at = size;
            }
            if (idle >= 6 && !rec)
                closed = 1;
            cmd_t c;
            long used;
            while (!closed && (used = parse_cmd(in, in_len, &c)) > 0) {
                if (rec) {
                    size_t len = auto_reply(&c, mode, out, sizeof out, value, &value_len);
                    uint8_t hdr[2] = {(uint8_t)len, (uint8_t)(len >> 8)};
                    fwrite(hdr, 1, 2, rec);
                    fwrite(out, 1, len, rec);
                    if (write(sfd, out, len) != (ssize_t)len)
                        closed = 1;
                } else if (at + 2 <= size) {
                    size_t len = (size_t)data[at] | (size_t)data[at + 1] << 8;
                    at += 2;
                    len = len < size - at ? len : size - at;
                    if (len && write(sfd, data + at, len) != (ssize_t)len)
                        closed = 1;
                    at += len;
                } else {
                    closed = 1; /* nothing left to answer with */
                }
                memmove(in, in + used, in_len - (size_t)used);
                in_len -= (size_t)used;
            }
            if (used < 0 || in_len == sizeof in)
                abort(); /* the tier sent something that is not a command */
            if (closed)
                shutdown(sfd, SHUT_RDWR);
        }
        if (run.written && run.wstatus == 0 && rrc < 0) {
            r.key = w.key;
            r.loc = w.loc;
            rrc = kvt_tier_read(t, &r);
            if (rrc < 0)
                rrc = 1;
        }
        if (run.read && run.rstatus == 0 && memcmp(rbuf, wbuf, LEN) != 0)
            abort(); /* a read that succeeds gives back the bytes written */
        if (run.read && !freed) {
            if (run.wstatus == 0)
                kvt_tier_free(t, w.loc, LEN);
            freed = 1;
        }
        int done = (wrc < 0 || run.written) && (prc < 0 || run.probed) &&
                   (!run.written || run.wstatus != 0 || rrc == 1 || run.read);
        if (done && (closed || freed))
            break;
    }
    if ((wrc == 0 && !run.written) || (prc == 0 && !run.probed) || (rrc == 0 && !run.read))
        abort(); /* a request that never completed, long after the connection went */
    close(sfd);
    kvt_tier_destroy(t);
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    kvt_log_set_level((kvt_log_level_t)(KVT_LOG_ERROR + 1)); /* refusals are logged */
    /* As kvtierd (server/loop.c): a write to a connection the other side closed is EPIPE, not
     * the end of the process. Without it a slow run died of SIGPIPE when the tier had closed a
     * connection the harness still wrote the rest of its input to. */
    signal(SIGPIPE, SIG_IGN);
    lfd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t al = sizeof a;
    if (lfd < 0 || bind(lfd, (struct sockaddr *)&a, sizeof a) != 0 || listen(lfd, 16) != 0 ||
        getsockname(lfd, (struct sockaddr *)&a, &al) != 0)
        abort();
    port = ntohs(a.sin_port);
    const char *dir = getenv("KVT_FUZZ_MAKE_SEEDS");
    if (dir) {
        for (int flags = 0; flags < 4; flags++) {
            for (int mode = 0; mode < 2; mode++) {
                char path[4096];
                snprintf(path, sizeof path, "%s/auth%d-db%d-%s", dir, flags & 1, flags >> 1,
                         mode ? "errors" : "ok");
                FILE *f = fopen(path, "wb");
                if (!f)
                    abort();
                fputc(flags, f);
                session((uint8_t)flags, NULL, 0, mode, f);
                fclose(f);
            }
        }
        exit(0);
    }
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1 || size > 1 << 16)
        return 0;
    session(data[0], data + 1, size - 1, 0, NULL);
    return 0;
}
