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
 * Input: u8 flags (1: a password, so the handshake has an AUTH; 2: a database, so a SELECT; 4:
 * big values, below), then chunks of u16 length (little-endian) and that many bytes.
 *
 * Big values (flag 4): the GET values the tier reads in place (16 KiB and more, read from the
 * socket into the caller's buffer, remote.c's direct_begin) are too long to come from the input,
 * so a byte after the flags sizes the blocks (three, written then read back pipelined: one of
 * 15 KiB + that many KiB, one of 600 bytes between, one of 16 KiB + half the first) and a chunk
 * may stand for a reply the harness builds: a length of 0xff00 | m is followed by a u16 p, and
 * answers the command with what Redis would (a GET: the value its SET stored), altered by m & 3
 * (0: not; 1: one byte of it flipped, at p; 2: the length line off by the signed low byte of p;
 * 3: cut after p bytes, the connection then closed) and written in two parts split at (m >> 2)
 * 64ths of it, the tier running between them. Plain chunks (MOVED, ASK, errors, nils, garbage)
 * go among them as they come.
 *
 * KVT_FUZZ_MAKE_SEEDS=DIR writes seed inputs into DIR, recorded from a server that answers as
 * Redis would (and one that answers with misses and errors), and exits.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
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

#define PAGE    16
#define LEN     600
#define NBIG    3             /* blocks in the big mode */
#define BIG_MAX (400u << 10)  /* the largest of them, with room */
#define IN_MAX  (4u << 20)    /* the commands the tier sends, not yet answered */
#define OUT_MAX (2 * BIG_MAX) /* the replies not yet written */
#define SPECIAL 0xff00u       /* a chunk length at or above: a reply the harness builds */

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

/* --- the server's side in the big mode: the values it stored, the replies it still writes --- */

typedef struct stored {
    char key[96];
    size_t klen;
    uint8_t *val;
    size_t len;
} stored_t;

static stored_t stored[NBIG + 2];

/* Keeps a SET's value: the big mode answers a GET with it. */
static void store_set(const cmd_t *c)
{
    if (c->argc < 3 || c->len[1] > sizeof stored[0].key)
        return;
    stored_t *e = NULL;
    for (size_t i = 0; i < sizeof stored / sizeof *stored && !e; i++)
        if (!stored[i].klen ||
            (stored[i].klen == c->len[1] && !memcmp(stored[i].key, c->argv[1], c->len[1])))
            e = &stored[i];
    if (!e)
        return;
    uint8_t *v = realloc(e->val, c->len[2] ? c->len[2] : 1);
    if (!v)
        abort();
    memcpy(v, c->argv[2], c->len[2]);
    memcpy(e->key, c->argv[1], c->len[1]);
    e->klen = c->len[1];
    e->val = v;
    e->len = c->len[2];
}

static const stored_t *store_get(const cmd_t *c)
{
    for (size_t i = 0; i < sizeof stored / sizeof *stored; i++)
        if (c->argc >= 2 && stored[i].klen && stored[i].klen == c->len[1] &&
            !memcmp(stored[i].key, c->argv[1], c->len[1]))
            return &stored[i];
    return NULL;
}

static void store_clear(void)
{
    for (size_t i = 0; i < sizeof stored / sizeof *stored; i++)
        free(stored[i].val);
    memset(stored, 0, sizeof stored);
}

/* Replies not yet written, and where the writing pauses for a step of the tier (a split). */
static uint8_t outq[OUT_MAX];
static size_t out_off, out_len, close_at = SIZE_MAX;
static size_t cuts[64];
static int ncuts;

static void out_reset(void)
{
    out_off = out_len = 0;
    ncuts = 0;
    close_at = SIZE_MAX;
}

/* Queues n bytes, split at `split` (0: not). Returns -1 when they do not fit. */
static int emit(const void *p, size_t n, size_t split)
{
    if (out_off == out_len)
        out_reset();
    if (out_len + n > OUT_MAX)
        return -1;
    memcpy(outq + out_len, p, n);
    if (split && split < n && ncuts < (int)(sizeof cuts / sizeof *cuts))
        cuts[ncuts++] = out_len + split;
    out_len += n;
    return 0;
}

/* Writes what is queued, up to the next split. Returns 1 when it wrote something, 0 when not,
 * -1 when the connection is to be closed (an error, or a reply cut short was written). */
static int flush_out(int sfd)
{
    if (out_off == out_len)
        return 0;
    size_t upto = ncuts ? cuts[0] : out_len;
    if (close_at < upto)
        upto = close_at;
    ssize_t n = write(sfd, outq + out_off, upto - out_off);
    if (n < 0)
        return errno == EAGAIN || errno == EWOULDBLOCK ? 0 : -1;
    out_off += (size_t)n;
    if (out_off == close_at)
        return -1;
    if (ncuts && out_off == cuts[0])
        memmove(cuts, cuts + 1, (size_t)--ncuts * sizeof *cuts);
    return 1;
}

/* The reply a special chunk (m, p) stands for, queued: see the top of the file. */
static int answer_special(const cmd_t *c, unsigned m, unsigned p)
{
    static uint8_t rep[BIG_MAX + 64];
    size_t n;
    unsigned kind = m & 3;
    const stored_t *st = is(c, "GET") ? store_get(c) : NULL;
    if (st) {
        long long dl = (long long)st->len;
        if (kind == 2)
            dl += (int8_t)(p & 0xff) ? (int8_t)(p & 0xff) : 1;
        n = (size_t)snprintf((char *)rep, 32, "$%lld\r\n", dl < 0 ? 0 : dl);
        memcpy(rep + n, st->val, st->len);
        if (kind == 1 && st->len)
            rep[n + p % st->len] ^= (uint8_t)((p >> 8) | 1);
        n += st->len;
        memcpy(rep + n, "\r\n", 2);
        n += 2;
    } else {
        static char value[4096];
        size_t vl = 0; /* a GET of a key never stored: a nil */
        n = auto_reply(c, 0, (char *)rep, sizeof rep, value, &vl);
        if (kind == 1)
            rep[p % n] ^= (uint8_t)((p >> 8) | 1);
    }
    if (kind == 3)
        n = p % n;
    if (emit(rep, n, (m >> 2) * n / 64) < 0)
        return -1;
    if (kind == 3)
        close_at = out_len;
    return 0;
}

/* --- the tier's side --- */

/* The big mode's block bytes, made once: a loop over every byte in each session, with its
 * compares traced for the fuzzer, took 70% of the harness's time. */
static uint8_t pattern[BIG_MAX + 64];

typedef struct blk {
    kvt_tier_io_t w, r;
    uint32_t tok[PAGE];
    uint8_t *wbuf, *rbuf;
    uint32_t len;
    int wrc, written, wstatus;
    int rrc; /* -1: not submitted; 0: submitted; 1: refused at submit */
    int read, rstatus;
} blk_t;

typedef struct run {
    int probed, pstatus;
} run_t;

static void on_write(kvt_tier_io_t *io)
{
    blk_t *b = io->data;
    b->written = 1;
    b->wstatus = io->status;
}

static void on_read(kvt_tier_io_t *io)
{
    blk_t *b = io->data;
    b->read = 1;
    b->rstatus = io->status;
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

/* The chunk a recorded big-mode seed answers command k with: mode 0 as Redis would, split at
 * varied points; mode 1 the GETs (a big block, a small one, a big one) answered by pattern
 * (sz & 1): a flipped byte, ASK, as Redis would; or MOVED, an error, a flipped byte. Returns the
 * chunk's bytes in chunk (cap bytes). */
static size_t big_seed_chunk(const cmd_t *c, int mode, int k, uint8_t sz, uint8_t *chunk,
                             size_t cap)
{
    static int gets;
    static const char *const odd[2][3] = {{NULL, "-ASK 866 127.0.0.1:7002\r\n", NULL},
                                          {"-MOVED 866 127.0.0.1:7001\r\n", "-ERR busy\r\n", NULL}};
    static const int flip[2][3] = {{1, 0, 0}, {0, 0, 1}};
    if (k == 0)
        gets = 0;
    unsigned m = (unsigned)((k * 5 + 3) % 64) << 2, p = (unsigned)(k * 977 + 11);
    if (mode && is(c, "GET") && gets < 3) {
        int g = gets++;
        const char *o = odd[sz & 1][g];
        if (o) {
            size_t n = strlen(o);
            if (n + 2 > cap)
                abort();
            chunk[0] = (uint8_t)n;
            chunk[1] = (uint8_t)(n >> 8);
            memcpy(chunk + 2, o, n);
            return n + 2;
        }
        m |= (unsigned)flip[sz & 1][g];
    }
    uint16_t len = (uint16_t)(SPECIAL | m);
    chunk[0] = (uint8_t)len;
    chunk[1] = (uint8_t)(len >> 8);
    chunk[2] = (uint8_t)p;
    chunk[3] = (uint8_t)(p >> 8);
    return 4;
}

/*
 * One session. With data (the fuzz input's chunks), each command is answered with the next
 * chunk; with rec (making seeds), auto_reply(mode) answers (or in the big mode, a built reply)
 * and the chunks are appended to rec.
 */
static void session(uint8_t flags, const uint8_t *data, size_t size, int mode, FILE *rec)
{
    int big = flags & 4;
    uint8_t sz = 0;
    if (big) {
        if (rec)
            sz = (uint8_t)(mode >> 1), mode &= 1; /* the caller packs the size above the mode */
        else if (size)
            sz = data[0], data++, size--;
        if (rec)
            fputc(sz, rec);
    }
    kvt_tier_remote_conf_t conf = {.host = "127.0.0.1",
                                   .port = port,
                                   .password = (flags & 1) ? "secret" : NULL,
                                   .db = (flags & 2) ? 3 : 0,
                                   .capacity_bytes = 4 << 20,
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
    /* A reply written in parts must reach the tier at once: with Nagle the second part waited
     * for the tier's delayed ACK (40 ms), longer than the harness's steps last. */
    int one = 1;
    setsockopt(sfd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    out_reset();
    run_t run = {0};
    static blk_t b[NBIG];
    int nb = big ? NBIG : 1;
    const uint32_t lens[NBIG] = {(15u << 10) + sz * 1024u, 600, (16u << 10) + sz * 512u};
    for (int i = 0; i < nb; i++) {
        free(b[i].wbuf);
        free(b[i].rbuf);
        memset(&b[i], 0, sizeof b[i]);
        b[i].len = big ? lens[i] : LEN;
        b[i].wbuf = malloc(b[i].len);
        b[i].rbuf = malloc(b[i].len);
        if (!b[i].wbuf || !b[i].rbuf)
            abort();
        /* 0x3c bytes as the recorded seeds' values hold (a checked value of other bytes would
         * fail the comparison below); the big mode's values come from its SETs, any bytes. */
        if (big)
            memcpy(b[i].wbuf, pattern + 7 * i, b[i].len);
        else
            memset(b[i].wbuf, 0x3c, b[i].len);
        b[i].w = (kvt_tier_io_t){.key = key_of((uint32_t)i, b[i].tok),
                                 .buf = b[i].wbuf,
                                 .len = b[i].len,
                                 .cb = on_write,
                                 .data = &b[i]};
        b[i].r = (kvt_tier_io_t){.cb = on_read, .data = &b[i], .buf = b[i].rbuf, .len = b[i].len};
        b[i].rrc = -1;
    }
    uint32_t ptok[2][PAGE];
    kvt_block_key_t pkeys[2] = {key_of(0, ptok[0]), key_of(1, ptok[1])};
    kvt_tier_probe_t p = {.keys = pkeys, .n = 2, .cb = on_probe, .data = &run};
    for (int i = 0; i < nb; i++)
        b[i].wrc = kvt_tier_write(t, &b[i].w);
    int prc = kvt_tier_remote_probe(t, &p), reading = 0, freed = 0, ncmd = 0;
    static char in[IN_MAX];
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
            idle = n > 0 || out_off < out_len ? 0 : idle + 1;
            if (!rec && idle == 3 && at < size) {
                /* The tier waits for the rest of a reply that a short chunk left unfinished:
                 * whatever the input has left goes out now, then the connection closes. */
                if (emit(data + at, size - at, 0) < 0)
                    closed = 1;
                at = size;
            }
            if (idle >= 6 && !rec)
                closed = 1;
            cmd_t c;
            long used;
            while (!closed && (used = parse_cmd(in, in_len, &c)) > 0) {
                store_set(&c);
                if (rec && big) {
                    uint8_t chunk[64];
                    size_t cl = big_seed_chunk(&c, mode, ncmd, sz, chunk, sizeof chunk);
                    fwrite(chunk, 1, cl, rec);
                    if (cl == 4)
                        closed |= answer_special(&c, (unsigned)(chunk[0]),
                                                 (unsigned)chunk[2] | (unsigned)chunk[3] << 8) < 0;
                    else
                        closed |= emit(chunk + 2, cl - 2, 0) < 0;
                } else if (rec) {
                    size_t len = auto_reply(&c, mode, out, sizeof out, value, &value_len);
                    uint8_t hdr[2] = {(uint8_t)len, (uint8_t)(len >> 8)};
                    fwrite(hdr, 1, 2, rec);
                    fwrite(out, 1, len, rec);
                    closed |= emit(out, len, 0) < 0;
                } else if (at + 2 <= size) {
                    size_t len = (size_t)data[at] | (size_t)data[at + 1] << 8;
                    at += 2;
                    if (big && len >= SPECIAL) {
                        unsigned pp = 0;
                        if (at + 2 <= size)
                            pp = (unsigned)data[at] | (unsigned)data[at + 1] << 8;
                        at = at + 2 <= size ? at + 2 : size;
                        closed |= answer_special(&c, (unsigned)(len & 0xff), pp) < 0;
                    } else {
                        len = len < size - at ? len : size - at;
                        closed |= emit(data + at, len, 0) < 0;
                        at += len;
                    }
                } else {
                    closed = 1; /* nothing left to answer with */
                }
                ncmd++;
                memmove(in, in + used, in_len - (size_t)used);
                in_len -= (size_t)used;
            }
            if (used < 0 || in_len == sizeof in)
                abort(); /* the tier sent something that is not a command */
            if (!closed && flush_out(sfd) < 0)
                closed = 1;
            if (closed)
                shutdown(sfd, SHUT_RDWR);
        }
        int writes_done = 1;
        for (int i = 0; i < nb; i++)
            writes_done &= b[i].wrc < 0 || b[i].written;
        if (writes_done && !reading) {
            /* Every block written is read back, pipelined: big values behind one another. */
            for (int i = 0; i < nb; i++) {
                if (b[i].wrc < 0 || b[i].wstatus != 0)
                    continue;
                b[i].r.key = b[i].w.key;
                b[i].r.loc = b[i].w.loc;
                b[i].rrc = kvt_tier_read(t, &b[i].r) < 0 ? 1 : 0;
            }
            reading = 1;
        }
        int reads_done = reading;
        for (int i = 0; i < nb; i++) {
            if (b[i].read && b[i].rstatus == 0 && memcmp(b[i].rbuf, b[i].wbuf, b[i].len) != 0)
                abort(); /* a read that succeeds gives back the bytes written */
            reads_done &= b[i].rrc != 0 || b[i].read;
        }
        if (reads_done && !freed) {
            for (int i = 0; i < nb; i++)
                if (b[i].wrc == 0 && b[i].wstatus == 0)
                    kvt_tier_free(t, b[i].w.loc, b[i].len);
            freed = 1;
        }
        int done = reads_done && (prc < 0 || run.probed);
        if (done && (closed || freed))
            break;
    }
    for (int i = 0; i < nb; i++)
        if ((b[i].wrc == 0 && !b[i].written) || (b[i].rrc == 0 && !b[i].read))
            abort(); /* a request that never completed, long after the connection went */
    if (prc == 0 && !run.probed)
        abort();
    if (rec && big && !mode && sz > 0) {
        /* The seeds must take the path the big mode is for: both big blocks read in place. */
        kvt_tier_remote_stats_t st;
        kvt_tier_remote_stats(t, &st);
        if (st.direct_reads != 2)
            abort();
    }
    close(sfd);
    kvt_tier_destroy(t);
    for (int i = 0; i < nb; i++) {
        free(b[i].wbuf);
        free(b[i].rbuf);
        b[i].wbuf = b[i].rbuf = NULL;
    }
    store_clear();
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
    for (size_t k = 0; k < sizeof pattern; k++)
        pattern[k] = (uint8_t)(0x3c + k * 13 + (k >> 10));
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
        /* The big mode: blocks of 15 KiB (copied out of hiredis's buffer), 16 KiB and 270 KiB
         * (read in place), as Redis would answer and with MOVED, ASK, errors among them. */
        static const int bigs[][2] = {{0, 0}, {1, 0}, {255, 0}, {1, 1}, {60, 1}};
        for (size_t i = 0; i < sizeof bigs / sizeof *bigs; i++) {
            char path[4096];
            snprintf(path, sizeof path, "%s/big%d-%s", dir, bigs[i][0],
                     bigs[i][1] ? "errors" : "ok");
            FILE *f = fopen(path, "wb");
            if (!f)
                abort();
            fputc(4, f);
            session(4, NULL, 0, bigs[i][0] << 1 | bigs[i][1], f);
            fclose(f);
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
