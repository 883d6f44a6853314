/*
 * test_server_fuzz.c: kvtierd under frames from a seeded fuzzer, beside a client that must get
 * exactly its own bytes back.
 *
 * Several raw connections send mostly well-formed requests of every opcode (prompts that share
 * prefixes, PUT payloads, GETs and RELEASEs of leases seen in replies and of made-up ones, HELLOs
 * that switch among more namespaces than the daemon may hold open, so that empty ones are closed
 * under requests in flight), and one frame in two is mutated: a flipped bit, a byte or a count of
 * the body, the opcode, the flags, the body length, a body length past max-frame. Half of them
 * use the Unix socket, half TCP; the odd PUT is bigger than the daemon's input buffer. Now and then
 * a connection sends random bytes, stops in the middle of a frame, or just hangs up. The daemon has
 * small DRAM, HBM (host memory) and NVMe tiers, and Redis when the test command started one, so
 * blocks move between tiers all the time. Between batches, a libkvtier client in a namespace of its
 * own stores prompts whose page bytes are a function of the page's prefix, and reads back every
 * prompt it finds: a wrong byte, a lost connection, or an unclean exit (the ASan+UBSan build stops
 * the daemon at its first report) fails the test. Its first runs found a use-after-free, a read
 * past a buffer, and a memcpy to NULL (see the git log).
 *
 * Each seed runs 5 s; KVT_FUZZ_MS=N runs each for N ms instead (longer runs by hand).
 */
#include <poll.h>
#include <time.h>

#include "proto.h"
#include "test_server_harness.h"

#define PAGE  16
#define BB    4096
#define NFUZZ 6
/* Pages of a prompt, and of the odd big PUT (800 KiB of payload, over the 512 KiB input buffer). */
#define MAXPG  40
#define BIGPG  200
#define OUTCAP (8u << 20)

static uint64_t rnd(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

static uint64_t mix(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return x;
}

static uint64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

/* A prompt of one of six families, of at most maxpg pages: the family's pages up to a random
 * page, then one of five variants, and sometimes a few tokens short of a page. Returns its token
 * count. */
static uint32_t gen_prompt_of(uint64_t *s, uint32_t *tok, uint32_t maxpg)
{
    uint32_t f = (uint32_t)(rnd(s) % 6), np = 1 + (uint32_t)(rnd(s) % maxpg);
    uint32_t split = (uint32_t)(rnd(s) % (np + 1)), v = 1 + (uint32_t)(rnd(s) % 5);
    for (uint32_t p = 0; p < np; p++)
        for (uint32_t j = 0; j < PAGE; j++)
            tok[p * PAGE + j] = (uint32_t)mix((uint64_t)f << 40 | (uint64_t)p << 20 | j |
                                              (p >= split ? (uint64_t)v << 56 : 0));
    uint32_t extra = rnd(s) % 4 == 0 ? (uint32_t)(rnd(s) % PAGE) : 0;
    for (uint32_t j = 0; j < extra; j++)
        tok[np * PAGE + j] = (uint32_t)rnd(s);
    return np * PAGE + extra;
}

static uint32_t gen_prompt(uint64_t *s, uint32_t *tok)
{
    return gen_prompt_of(s, tok, MAXPG);
}

/* The bytes of page p of a prompt: a function of the tokens up to the page's end, so that any
 * copy of the page, from any PUT of any prompt sharing that prefix, must read back the same. */
static void page_bytes(const uint32_t *tok, uint32_t p, uint8_t *out)
{
    uint64_t h = 1469598103934665603ull;
    for (uint32_t i = 0; i < (p + 1) * PAGE; i++)
        h = mix(h ^ tok[i]);
    for (uint32_t i = 0; i < BB; i += 8) {
        h = mix(h + i);
        memcpy(out + i, &h, 8);
    }
}

typedef struct fuzz {
    uint64_t rng;
    uint64_t leases[64]; /* ids seen in MATCH replies, for GET and RELEASE */
    uint32_t tok[(BIGPG + 1) * PAGE];
    uint8_t body[(BIGPG + 1) * PAGE * 4 + BIGPG * BB + 64];
    long frames;
} fuzz_t;

typedef struct fconn {
    int fd;
    uint8_t *out;
    size_t len, off;
    int hello, hang_up;
} fconn_t;

static size_t body_hello(fuzz_t *z)
{
    /* Six models against max-namespaces 4 (the clean client's among them): HELLOs find the
     * daemon full, close the empty namespaces nobody uses, or are refused. */
    static const char *const models[] = {"fuzz-a", "fuzz-b", "fuzz-c",
                                         "fuzz-d", "fuzz-e", "fuzz-f"};
    const char *model = models[rnd(&z->rng) % 6];
    kvt_wire_hello_t w = {.min_version = 1,
                          .max_version = 1,
                          .page_size = PAGE,
                          .block_bytes = rnd(&z->rng) % 4 ? BB : 0,
                          .model_len = (uint16_t)strlen(model),
                          .salt_len = rnd(&z->rng) % 3 == 0 ? 4 : 0};
    memcpy(z->body, &w, sizeof w);
    memcpy(z->body + sizeof w, model, w.model_len);
    memcpy(z->body + sizeof w + w.model_len, "salt", w.salt_len);
    return sizeof w + w.model_len + w.salt_len;
}

static size_t put_tokens(fuzz_t *z, size_t at, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++)
        kvt_put_u32(z->body + at + 4 * i, z->tok[i]);
    return at + 4 * (size_t)n;
}

/* One request of opcode op, well-formed: its body in z->body, its length returned. */
static size_t gen_body(fuzz_t *z, unsigned op, uint16_t *flags)
{
    uint64_t *s = &z->rng;
    switch (op) {
    case KVT_OP_HELLO:
        return body_hello(z);
    case KVT_OP_MATCH: {
        uint32_t n = gen_prompt(s, z->tok);
        kvt_wire_match_t w = {.lease_ms = rnd(s) % 3 ? 0 : (uint32_t)(rnd(s) % 2000), .ntokens = n};
        memcpy(z->body, &w, sizeof w);
        *flags = (uint16_t)(rnd(s) & KVT_MATCH_F_ALL);
        return put_tokens(z, sizeof w, n);
    }
    case KVT_OP_PUT: {
        uint32_t n = gen_prompt_of(s, z->tok, rnd(s) % 30 ? MAXPG : BIGPG), np = n / PAGE;
        uint32_t first = (uint32_t)(rnd(s) % (np + 1));
        uint32_t pay = rnd(s) % 3 == 0 ? 0 : (uint32_t)(rnd(s) % (np - first + 1));
        kvt_wire_put_t w = {.ntokens = n, .first_page = first, .npayload = pay};
        memcpy(z->body, &w, sizeof w);
        size_t len = put_tokens(z, sizeof w, n);
        for (uint32_t i = 0; i < pay; i++, len += BB)
            memset(z->body + len, (int)(rnd(s) & 255), BB);
        return len;
    }
    case KVT_OP_GET: {
        kvt_wire_get_t w = {.lease = rnd(s) % 2 ? z->leases[rnd(s) % 64] : rnd(s) % 100,
                            .first_page = rnd(s) % 4 ? 0 : (uint32_t)(rnd(s) % 50),
                            .npages = rnd(s) % 3 ? 0 : (uint32_t)(rnd(s) % 50)};
        memcpy(z->body, &w, sizeof w);
        return sizeof w;
    }
    case KVT_OP_PREFETCH: {
        uint32_t n = gen_prompt(s, z->tok);
        *flags = (uint16_t)(rnd(s) & KVT_PREFETCH_F_ALL);
        kvt_wire_prefetch_t w = {
            .tier = (uint32_t)(rnd(s) % 6), .deadline_ms = (uint32_t)(rnd(s) % 200), .ntokens = n};
        memcpy(z->body, &w, sizeof w);
        return put_tokens(z, sizeof w, n);
    }
    case KVT_OP_RELEASE: {
        uint64_t l = rnd(s) % 2 ? z->leases[rnd(s) % 64] : rnd(s);
        memcpy(z->body, &l, 8);
        return 8;
    }
    case KVT_OP_REMOVE: {
        uint32_t n = gen_prompt(s, z->tok);
        *flags = (uint16_t)(rnd(s) & KVT_REMOVE_F_ALL);
        kvt_wire_remove_t w = {.ntokens = n};
        memcpy(z->body, &w, sizeof w);
        return put_tokens(z, sizeof w, n);
    }
    default: /* AUTH, STATS, PING */
        return op == KVT_OP_STATS ? 0 : (size_t)(rnd(s) % 64);
    }
}

/* Appends one frame, mutated one time in two, to out; returns its length. */
static size_t gen_frame(fuzz_t *z, uint8_t *out, int hello)
{
    uint64_t *s = &z->rng;
    unsigned op = hello ? KVT_OP_HELLO : 1 + (unsigned)(rnd(s) % (KVT_OP_COUNT - 1));
    uint16_t flags = 0;
    size_t bl = gen_body(z, op, &flags);
    kvt_proto_frame(out, op, flags, rnd(s), 0, (uint32_t)bl);
    memcpy(out + KVT_PROTO_HDR, z->body, bl);
    size_t n = KVT_PROTO_HDR + bl;
    uint32_t v = (uint32_t)rnd(s);
    switch (rnd(s) % 16) {
    case 0: /* a bit anywhere */
        out[rnd(s) % n] ^= (uint8_t)(1u << (v % 8));
        break;
    case 1: /* a byte of the body */
        if (bl)
            out[KVT_PROTO_HDR + rnd(s) % bl] = (uint8_t)v;
        break;
    case 2: /* a body length that disagrees with the body */
        kvt_put_u32(out + 16, v % (uint32_t)(bl + 64));
        break;
    case 3:
        out[5] = (uint8_t)v; /* the opcode */
        break;
    case 4:
        memcpy(out + 6, &v, 2); /* the flags */
        break;
    case 5: /* a count or field of the body, anything */
    case 6: /* ... or just past what fits */
        if (bl >= 4)
            kvt_put_u32(out + KVT_PROTO_HDR + 4 * (rnd(s) % (bl / 4)),
                        rnd(s) % 2 ? v : 0x7fffffffu + v % 4);
        break;
    case 7: /* a body length past max-frame */
        kvt_put_u32(out + 16, 0xffffffffu - v % 16);
        break;
    }
    z->frames++;
    return n;
}

/* Half the connections over the Unix socket, half over TCP (each has its own read and close
 * paths in the daemon). */
static int fz_connect(const kvd_t *d, int tcp)
{
    int fd;
    if (tcp) {
        char host[64];
        unsigned port = 0;
        cr_assert_eq(sscanf(d->tcp, "%63[^:]:%u", host, &port), 2, "tcp address %s", d->tcp);
        struct sockaddr_in sin = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
        inet_pton(AF_INET, host, &sin.sin_addr);
        fd = socket(AF_INET, SOCK_STREAM, 0);
        cr_assert(fd >= 0);
        cr_assert(connect(fd, (struct sockaddr *)&sin, sizeof sin) == 0, "connect: %s",
                  strerror(errno));
    } else {
        struct sockaddr_un sun = {.sun_family = AF_UNIX};
        memcpy(sun.sun_path, d->sock, strlen(d->sock) + 1);
        fd = socket(AF_UNIX, SOCK_STREAM, 0);
        cr_assert(fd >= 0);
        cr_assert(connect(fd, (struct sockaddr *)&sun, sizeof sun) == 0, "connect: %s",
                  strerror(errno));
    }
    cr_assert(fcntl(fd, F_SETFL, O_NONBLOCK) == 0);
    return fd;
}

/* The next batch of frames for c: a few, sometimes garbage or cut short. */
static void fz_refill(fuzz_t *z, fconn_t *c)
{
    uint64_t *s = &z->rng;
    c->len = c->off = 0;
    int n = 1 + (int)(rnd(s) % 8);
    for (int k = 0; k < n && c->len + sizeof z->body + KVT_PROTO_HDR <= OUTCAP; k++) {
        c->len += gen_frame(z, c->out + c->len, c->hello && rnd(s) % 8);
        c->hello = 0;
    }
    if (rnd(s) % 200 == 0)
        for (size_t k = 0; k < c->len; k++)
            c->out[k] = (uint8_t)rnd(s);
    if (rnd(s) % 50 == 0) {
        c->len = rnd(s) % (c->len + 1);
        c->hang_up = 1;
    }
}

static void fz_drop(fconn_t *c)
{
    close(c->fd);
    c->fd = -1;
}

/* One pass over the fuzzing connections: connect, write, read (taking lease ids from MATCH
 * replies that start a read), hang up. */
static void fz_pass(fuzz_t *z, fconn_t *cs, const kvd_t *d, uint8_t *in, size_t incap)
{
    struct pollfd pf[NFUZZ];
    for (int i = 0; i < NFUZZ; i++) {
        if (cs[i].fd < 0) {
            cs[i].fd = fz_connect(d, i % 2);
            cs[i].hello = 1;
            cs[i].hang_up = 0;
            cs[i].len = cs[i].off = 0;
        }
        if (cs[i].off == cs[i].len && !cs[i].hang_up)
            fz_refill(z, &cs[i]);
        pf[i] = (struct pollfd){.fd = cs[i].fd,
                                .events = POLLIN | (cs[i].off < cs[i].len ? POLLOUT : 0)};
    }
    poll(pf, NFUZZ, 5);
    for (int i = 0; i < NFUZZ; i++) {
        fconn_t *c = &cs[i];
        if (pf[i].revents & (POLLIN | POLLHUP | POLLERR)) {
            ssize_t r = read(c->fd, in, incap);
            if (r == 0 || (r < 0 && errno != EAGAIN)) {
                fz_drop(c);
                continue;
            }
            if (r >= KVT_PROTO_HDR + 16 && in[5] == (KVT_OP_MATCH | KVT_OP_REPLY)) {
                int32_t st;
                uint64_t l;
                memcpy(&st, in + 20, 4);
                memcpy(&l, in + KVT_PROTO_HDR + 8, 8);
                if (st == 0 && l)
                    z->leases[rnd(&z->rng) % 64] = l;
            }
        }
        if (pf[i].revents & POLLOUT) {
            ssize_t w = send(c->fd, c->out + c->off, c->len - c->off, MSG_NOSIGNAL);
            if (w < 0 && errno != EAGAIN) {
                fz_drop(c);
                continue;
            }
            c->off += w > 0 ? (size_t)w : 0;
        }
        if ((c->hang_up && c->off == c->len) || rnd(&z->rng) % 2000 == 0)
            fz_drop(c);
    }
}

typedef struct clean {
    kvt_client_t *c;
    uint64_t rng;
    uint32_t tok[(MAXPG + 1) * PAGE];
    uint8_t pay[MAXPG * BB];
    long rounds, pages_checked;
} clean_t;

static int clean_check(void *arg, uint32_t page, unsigned tier, const void *data, uint32_t len)
{
    clean_t *k = arg;
    uint8_t want[BB];
    page_bytes(k->tok, page, want);
    cr_assert_eq(len, BB);
    cr_assert(memcmp(want, data, BB) == 0, "page %u (from tier %u) is not what was stored", page,
              tier);
    k->pages_checked++;
    return 0;
}

/* MATCH a prompt, PUT the pages not found with their bytes, MATCH it again with a lease and read
 * every page found back; sometimes REMOVE it. */
static void clean_round(clean_t *k)
{
    uint32_t n = gen_prompt(&k->rng, k->tok), np = n / PAGE;
    kvt_client_match_t m = {0};
    int rc = kvt_client_match(k->c, k->tok, n, 0, 0, NULL, &m);
    cr_assert_eq(rc, 0, "match: %s", kvt_client_strerror(rc));
    if (m.pages < np) {
        for (uint32_t p = m.pages; p < np; p++)
            page_bytes(k->tok, p, k->pay + (size_t)(p - m.pages) * BB);
        kvt_client_put_t pr;
        rc = kvt_client_put(k->c, k->tok, n, m.pages, np - m.pages, k->pay, NULL, &pr);
        cr_assert_eq(rc, 0, "put: %s %s", kvt_client_strerror(rc), kvt_client_errmsg(k->c));
    }
    rc = kvt_client_match(k->c, k->tok, n, KVT_CLIENT_LEASE, 0, NULL, &m);
    cr_assert_eq(rc, 0, "match: %s", kvt_client_strerror(rc));
    if (m.lease) {
        /* A page whose bytes a full tier dropped, or an NVMe segment reclaimed, ends the read
         * early with ENOENT: a miss, never other bytes. */
        rc = kvt_client_get_cb(k->c, m.lease, 0, 0, clean_check, k, NULL);
        cr_assert(rc == 0 || rc == KVT_CLIENT_ENOENT, "get: %s %s", kvt_client_strerror(rc),
                  kvt_client_errmsg(k->c));
        cr_assert_eq(kvt_client_release(k->c, m.lease, NULL), 0);
    }
    if (rnd(&k->rng) % 10 == 0) {
        rc = kvt_client_remove(k->c, k->tok, n);
        cr_assert(rc == 0 || rc == KVT_CLIENT_ENOENT || rc == KVT_CLIENT_EBUSY ||
                      rc == KVT_CLIENT_EINVAL,
                  "remove: %s", kvt_client_strerror(rc));
    }
    k->rounds++;
}

static void fuzz_for(uint64_t seed, uint64_t ms)
{
    kvd_t d = {0};
    const char *redis = getenv("KVT_TEST_REDIS");
    char pfx[64];
    snprintf(pfx, sizeof pfx, "kvfuzz%d-%llu", (int)getpid(), (unsigned long long)seed);
    kvd_start(&d, "--dram-bytes", "4M", "--hbm-backend", "host", "--hbm-bytes", "2M",
              "--nvme-bytes", "16M", "--nvme-segment-bytes", "1M", "--remote",
              redis && *redis ? redis : "", "--remote-prefix", pfx, "--remote-bytes", "64M",
              "--max-namespaces", "4", NULL);
    static fuzz_t z;
    static clean_t k;
    memset(&z, 0, sizeof z);
    memset(&k, 0, sizeof k);
    z.rng = mix(seed) | 1;
    k.rng = mix(seed + 1) | 1;
    k.c = kvd_client(&d, "clean", PAGE, BB);
    fconn_t cs[NFUZZ];
    for (int i = 0; i < NFUZZ; i++) {
        cs[i] = (fconn_t){.fd = -1, .out = malloc(OUTCAP)};
        cr_assert(cs[i].out);
    }
    size_t incap = 1 << 20;
    uint8_t *in = malloc(incap);
    cr_assert(in);
    uint64_t end = now_ms() + ms;
    for (long pass = 0; now_ms() < end; pass++) {
        fz_pass(&z, cs, &d, in, incap);
        if (pass % 8 == 0)
            clean_round(&k);
    }
    for (int i = 0; i < NFUZZ; i++) {
        if (cs[i].fd >= 0)
            close(cs[i].fd);
        free(cs[i].out);
    }
    free(in);
    static char body[1 << 18];
    cr_assert_eq(kvd_http_get(&d, "/metrics", body, sizeof body), 200);
    const char *closed = strstr(body, "\nkvtier_namespaces_closed_total ");
    cr_assert(closed);
    cr_log_info(
        "seed %llu: %ld frames, %ld clean rounds, %ld pages read back, %ld namespaces closed",
        (unsigned long long)seed, z.frames, k.rounds, k.pages_checked,
        strtol(closed + 32, NULL, 10));
    cr_expect_gt(z.frames, 1000);
    cr_expect_gt(k.pages_checked, 100, "the clean client read back only %ld pages",
                 k.pages_checked);
    cr_assert_eq(kvt_client_ping(k.c, NULL), 0);
    kvt_client_close(k.c);
    kvd_cleanup(&d); /* the daemon must stop cleanly: exit status 0 */
}

static uint64_t fuzz_ms(void)
{
    const char *v = getenv("KVT_FUZZ_MS");
    return v && *v ? strtoull(v, NULL, 10) : 5000;
}

Test(server_fuzz, seed_1)
{
    fuzz_for(1, fuzz_ms());
}

Test(server_fuzz, seed_2)
{
    fuzz_for(2, fuzz_ms());
}
