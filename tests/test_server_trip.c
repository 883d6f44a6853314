/*
 * test_server_trip.c: one round trip per engine step (docs/protocol.md: MATCH's LOCATE and KEEP,
 * PUT's and RESERVE's HANDLE), frame by frame over a raw Unix socket against a real kvtierd, and
 * then through libkvtier (kvt_client_match_step, kvt_client_put_kept, _reserve_kept). A MATCH with
 * LOCATE must answer the very offsets a GET with LOCATE answers, under its lease; a PUT that names
 * a MATCH's handle must store what a PUT of the whole tokens stores; a handle that is bad, expired,
 * replaced, of another namespace or of another connection must be refused with a clear error
 * and change nothing.
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "proto.h"
#include "test_raw_frames.h"
#include "test_server_harness.h"

#define PAGE 4
#define BB   (16u << 10) /* block bytes */

typedef struct treply {
    kvt_proto_hdr_t h;
    uint8_t body[8192];
    int fd;
} treply_t;

/* Reads one whole reply (recvmsg: a MAP reply's descriptor comes on its first byte). */
static void trecv(int fd, treply_t *r)
{
    uint8_t hdr[KVT_PROTO_HDR];
    union {
        struct cmsghdr h;
        char buf[CMSG_SPACE(sizeof(int))];
    } ctl;
    struct iovec iov = {hdr, sizeof hdr};
    struct msghdr m = {
        .msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.buf, .msg_controllen = sizeof ctl};
    r->fd = -1;
    ssize_t n = recvmsg(fd, &m, MSG_CMSG_CLOEXEC);
    cr_assert_gt(n, 0, "recvmsg: %s", n < 0 ? strerror(errno) : "closed");
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&m); c; c = CMSG_NXTHDR(&m, c))
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS)
            memcpy(&r->fd, CMSG_DATA(c), sizeof(int));
    if ((size_t)n < sizeof hdr)
        cr_assert_eq(read_full(fd, hdr + n, sizeof hdr - (size_t)n), 0);
    kvt_proto_hdr_decode(hdr, &r->h);
    cr_assert_lt(r->h.body_len, sizeof r->body, "a reply longer than this test reads");
    cr_assert_eq(read_full(fd, r->body, r->h.body_len), 0);
    r->body[r->h.body_len] = 0;
}

static void tcall(int fd, unsigned op, uint16_t flags, const void *b, uint32_t len, treply_t *r)
{
    static uint64_t id = 1;
    uint64_t my = id++;
    raw_frame(fd, op, flags, my, b, len, KVT_PROTO_MAGIC, KVT_PROTO_VERSION);
    trecv(fd, r);
    cr_assert_eq(r->h.request_id, my);
    cr_assert_eq(r->h.opcode, op | KVT_OP_REPLY);
}

static int thello(int fd, const char *model)
{
    uint8_t body[300];
    size_t ml = strlen(model);
    kvt_proto_hello_t m = {.min_version = 1,
                           .max_version = 1,
                           .page_size = PAGE,
                           .block_bytes = BB,
                           .model_len = (uint16_t)ml};
    kvt_proto_hello_encode(body, &m);
    memcpy(body + sizeof(kvt_wire_hello_t), model, ml);
    treply_t r;
    tcall(fd, KVT_OP_HELLO, 0, body, (uint32_t)(sizeof(kvt_wire_hello_t) + ml), &r);
    return r.h.status;
}

static int tconn(const kvd_t *d, const char *model)
{
    int fd = kvd_raw(d);
    cr_assert_eq(thello(fd, model), 0);
    return fd;
}

/* MAP of the DRAM arena; returns the mapping (its length in *bytes). */
static uint8_t *tmap(int fd, uint64_t *bytes)
{
    uint8_t b[sizeof(kvt_wire_map_t)];
    kvt_proto_map_encode(b, KVT_TIER_DRAM);
    treply_t r;
    tcall(fd, KVT_OP_MAP, 0, b, sizeof b, &r);
    cr_assert_eq(r.h.status, 0, "MAP: %s", r.body);
    kvt_proto_map_reply_t m;
    cr_assert_eq(kvt_proto_map_reply_decode(r.body, r.h.body_len, &m), 0);
    cr_assert_geq(r.fd, 0);
    uint8_t *p = mmap(NULL, m.map_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, r.fd, 0);
    cr_assert(p != MAP_FAILED, "mmap: %s", strerror(errno));
    close(r.fd);
    *bytes = m.map_bytes;
    return p;
}

/* A PUT of nt tokens (after the handle's, with flags HANDLE) and n pages from first, whose
 * bytes are kvd_fill(seed + page). Returns the status; the reply in *p, a message in msg. */
static int tput(int fd, uint16_t flags, uint32_t handle, const uint32_t *t, uint32_t nt,
                uint32_t first, uint32_t n, uint32_t seed, kvt_proto_put_reply_t *p, char *msg)
{
    size_t len = sizeof(kvt_wire_put_t) + 4 * (size_t)nt + (size_t)n * BB;
    uint8_t *b = malloc(len);
    kvt_proto_put_t q = {.ntokens = nt, .first_page = first, .npayload = n, .handle = handle};
    kvt_proto_put_encode(b, &q);
    kvt_proto_tokens_encode(b + sizeof(kvt_wire_put_t), t, nt);
    for (uint32_t i = 0; i < n; i++)
        kvd_fill(b + sizeof(kvt_wire_put_t) + 4 * (size_t)nt + (size_t)i * BB, BB,
                 seed + first + i);
    treply_t r;
    tcall(fd, KVT_OP_PUT, flags, b, (uint32_t)len, &r);
    free(b);
    if (msg)
        snprintf(msg, 256, "%.250s", (const char *)r.body);
    if (r.h.status == 0)
        cr_assert_eq(kvt_proto_put_reply_decode(r.body, r.h.body_len, p), 0);
    return r.h.status;
}

typedef struct tmatch {
    int status;
    kvt_proto_match_reply_t m;
    uint8_t tiers[64];
    kvt_proto_match_locs_t l;
    uint64_t off[64];
    char msg[256];
} tmatch_t;

static void tmatch(int fd, uint16_t flags, uint32_t lease_ms, const uint32_t *t, uint32_t nt,
                   tmatch_t *o)
{
    uint8_t b[sizeof(kvt_wire_match_t) + 4096];
    kvt_proto_match_t q = {.lease_ms = lease_ms, .ntokens = nt};
    kvt_proto_match_encode(b, &q);
    kvt_proto_tokens_encode(b + sizeof(kvt_wire_match_t), t, nt);
    treply_t r;
    tcall(fd, KVT_OP_MATCH, flags, b, (uint32_t)(sizeof(kvt_wire_match_t) + 4 * nt), &r);
    memset(o, 0, sizeof *o);
    o->status = r.h.status;
    snprintf(o->msg, sizeof o->msg, "%.250s", (const char *)r.body);
    if (r.h.status < 0)
        return;
    const uint8_t *tiers;
    if (flags & KVT_MATCH_F_LOCATE) {
        cr_assert_eq(kvt_proto_match_reply_locs_decode(r.body, r.h.body_len, &o->m, &tiers, &o->l),
                     0, "a LOCATE reply of %u bytes", r.h.body_len);
        for (uint32_t i = 0; i < o->m.pages && i < 64; i++)
            o->off[i] = kvt_proto_match_loc(&o->l, i);
    } else {
        cr_assert_eq(kvt_proto_match_reply_decode(r.body, r.h.body_len, &o->m, &tiers), 0);
    }
    memcpy(o->tiers, tiers, KVT_MIN(o->m.pages, 64u));
}

/* GET with LOCATE of a lease's n pages: each page's offset (UINT64_MAX: it came as bytes). */
static void tget_locate(int fd, uint64_t lease, uint32_t n, uint64_t *off)
{
    uint8_t b[sizeof(kvt_wire_get_t)];
    kvt_proto_get_t q = {.lease = lease, .npages = n};
    kvt_proto_get_encode(b, &q);
    raw_frame(fd, KVT_OP_GET, KVT_GET_F_LOCATE, 4242, b, sizeof b, KVT_PROTO_MAGIC,
              KVT_PROTO_VERSION);
    for (uint32_t i = 0;; i++) {
        static treply_t r;
        trecv(fd, &r);
        cr_assert_eq(r.h.request_id, 4242);
        if (!(r.h.flags & KVT_RF_MORE)) {
            cr_assert_eq(r.h.status, 0);
            cr_assert_eq(i, n);
            return;
        }
        uint32_t page, len;
        uint8_t tier;
        if (kvt_proto_get_data_kind(r.body, r.h.body_len) == KVT_GET_DATA_LOC) {
            cr_assert_eq(
                kvt_proto_get_loc_decode(r.body, r.h.body_len, &page, &tier, &off[i], &len), 0);
        } else {
            off[i] = UINT64_MAX;
            page = kvt_get_u32(r.body);
        }
        cr_assert_eq(page, i);
    }
}

static int trelease(int fd, uint64_t lease)
{
    uint8_t b[8];
    kvt_proto_release_encode(b, lease);
    treply_t r;
    tcall(fd, KVT_OP_RELEASE, 0, b, sizeof b, &r);
    uint32_t released = 0;
    cr_assert_eq(kvt_proto_release_reply_decode(r.body, r.h.body_len, &released), 0);
    return (int)released;
}

static int holds_fill(const uint8_t *p, uint32_t seed)
{
    static uint8_t want[BB];
    kvd_fill(want, BB, seed);
    return memcmp(p, want, BB) == 0;
}

static kvd_t d;

static void teardown(void)
{
    kvd_cleanup(&d);
}

/* MATCH with LEASE and LOCATE answers, in the MATCH's own reply, the offsets GET with LOCATE
 * answers, and the bytes lie there; a connection without the mapping gets no location. */
Test(server_trip, match_locate_answers_where_get_would, .fini = teardown)
{
    kvd_start(&d, NULL);
    int fd = tconn(&d, "trip");
    uint64_t mbytes;
    uint8_t *map = tmap(fd, &mbytes);
    uint32_t t[3 * PAGE];
    kvd_tokens(t, 3 * PAGE, 100);
    kvt_proto_put_reply_t p;
    cr_assert_eq(tput(fd, 0, 0, t, 3 * PAGE, 0, 3, 50, &p, NULL), 0);
    cr_assert_eq(p.stored, 3);

    tmatch_t m;
    tmatch(fd, KVT_MATCH_F_LEASE | KVT_MATCH_F_LOCATE, 5000, t, 3 * PAGE, &m);
    cr_assert_eq(m.status, 0, "%s", m.msg);
    cr_assert_eq(m.m.pages, 3);
    cr_assert_neq(m.m.lease, 0);
    cr_expect_eq(m.l.lease_ms, 5000, "the lease's time as granted");
    cr_expect_eq(m.l.located, 3);
    uint64_t got[3];
    tget_locate(fd, m.m.lease, 3, got);
    for (uint32_t i = 0; i < 3; i++) {
        cr_expect_eq(m.tiers[i], KVT_TIER_DRAM);
        cr_assert_neq(m.off[i], KVT_MATCH_NO_LOC);
        cr_expect_eq(m.off[i], got[i], "page %u: MATCH and GET answer other places", i);
        cr_assert_leq(m.off[i] + BB, mbytes);
        cr_expect(holds_fill(map + m.off[i], 50 + i), "page %u's bytes are not at its location", i);
    }
    cr_expect_eq(trelease(fd, m.m.lease), 1, "LOCATE's lease is an ordinary lease");

    /* Without a mapping: the same reply's shape, nothing located, and still a lease. */
    int fd2 = tconn(&d, "trip");
    tmatch(fd2, KVT_MATCH_F_LEASE | KVT_MATCH_F_LOCATE, 0, t, 3 * PAGE, &m);
    cr_assert_eq(m.status, 0, "%s", m.msg);
    cr_expect_eq(m.m.pages, 3);
    cr_expect_eq(m.l.located, 0);
    for (uint32_t i = 0; i < 3; i++)
        cr_expect_eq(m.off[i], KVT_MATCH_NO_LOC);
    cr_expect_gt(m.l.lease_ms, 0, "the daemon's default lease time");
    cr_expect_eq(trelease(fd2, m.m.lease), 1);

    /* Nothing matched: no lease, no locations, a well-formed reply. */
    uint32_t miss[PAGE];
    kvd_tokens(miss, PAGE, 9000);
    tmatch(fd, KVT_MATCH_F_LEASE | KVT_MATCH_F_LOCATE, 0, miss, PAGE, &m);
    cr_assert_eq(m.status, 0);
    cr_expect(m.m.pages == 0 && m.m.lease == 0 && m.l.located == 0 && m.l.lease_ms == 0);
    munmap(map, mbytes);
    close(fd);
    close(fd2);
}

/* LOCATE without LEASE: a location would have no lifetime. Refused, and no lease taken. */
Test(server_trip, locate_needs_a_lease, .fini = teardown)
{
    kvd_start(&d, NULL);
    int fd = tconn(&d, "trip");
    uint32_t t[PAGE];
    kvd_tokens(t, PAGE, 100);
    kvt_proto_put_reply_t p;
    cr_assert_eq(tput(fd, 0, 0, t, PAGE, 0, 1, 1, &p, NULL), 0);
    tmatch_t m;
    tmatch(fd, KVT_MATCH_F_LOCATE, 0, t, PAGE, &m);
    cr_expect_eq(m.status, KVT_EINVAL);
    cr_expect(strstr(m.msg, "LEASE") != NULL, "message: %s", m.msg);
    kvt_client_t *c = kvd_client(&d, "trip", PAGE, BB);
    cr_expect_eq(kvd_stat(c, "leases"), 0);
    kvt_client_close(c);
    close(fd);
}

/* KEEP then PUT naming the handle: no tokens again (or only the new ones), the same pages
 * stored as a PUT of all the tokens; and the handle may be named again. */
Test(server_trip, put_names_the_match_it_follows, .fini = teardown)
{
    kvd_start(&d, NULL);
    int fd = tconn(&d, "trip");
    uint32_t t[5 * PAGE + 2]; /* 5 pages and a part of one */
    kvd_tokens(t, 5 * PAGE + 2, 300);
    tmatch_t m;
    tmatch(fd, KVT_MATCH_F_KEEP, 0, t, 3 * PAGE + 1, &m); /* the prompt: 3 pages and a token */
    cr_assert_eq(m.status, 0, "%s", m.msg);
    cr_expect_eq(m.m.pages, 0);
    cr_assert_neq(m.m.handle, 0, "a KEEP with room left no handle");
    uint32_t h = m.m.handle;

    kvt_proto_put_reply_t p;
    char msg[256];
    /* No tokens at all: exactly the MATCH's 3 pages (its partial page is not a page). */
    cr_assert_eq(tput(fd, KVT_PUT_F_HANDLE, h, NULL, 0, 0, 3, 70, &p, msg), 0, "%s", msg);
    cr_expect(p.pages == 3 && p.new_pages == 3 && p.stored == 3, "pages %u new %u stored %u",
              p.pages, p.new_pages, p.stored);
    /* The tail: the kept tokens and the next 2 pages' worth + 1 make 5 whole pages. */
    cr_assert_eq(tput(fd, KVT_PUT_F_HANDLE, h, t + 3 * PAGE + 1, 2 * PAGE + 1, 3, 2, 70, &p, msg),
                 0, "%s", msg);
    cr_expect(p.pages == 5 && p.new_pages == 2 && p.stored == 2, "pages %u new %u stored %u",
              p.pages, p.new_pages, p.stored);

    /* What was stored is what a PUT of the whole tokens names: a MATCH of them finds 5 pages,
     * and their bytes are the payloads'. */
    kvt_client_t *c = kvd_client(&d, "trip", PAGE, BB);
    kvt_client_match_t cm = {0};
    cr_assert_eq(kvt_client_match(c, t, 5 * PAGE + 2, KVT_CLIENT_LEASE, 0, NULL, &cm), 0);
    cr_assert_eq(cm.pages, 5);
    uint8_t *buf = malloc(5 * (size_t)BB);
    cr_assert_eq(kvt_client_get(c, cm.lease, 0, 5, buf, 5 * (size_t)BB, NULL, NULL), 0);
    for (uint32_t i = 0; i < 5; i++)
        cr_expect(holds_fill(buf + (size_t)i * BB, 70 + i), "page %u", i);
    free(buf);
    kvt_client_close(c);
    close(fd);
}

/* A handle never made, one without its flag, a flag without one: refused, nothing added. */
Test(server_trip, bad_handles_change_nothing, .fini = teardown)
{
    kvd_start(&d, NULL);
    int fd = tconn(&d, "trip");
    uint32_t t[2 * PAGE];
    kvd_tokens(t, 2 * PAGE, 500);
    kvt_client_t *c = kvd_client(&d, "trip", PAGE, BB);
    uint64_t blocks = kvd_stat(c, "index_blocks");
    kvt_proto_put_reply_t p;
    char msg[256];
    cr_expect_eq(tput(fd, KVT_PUT_F_HANDLE, 77, t, 2 * PAGE, 0, 1, 1, &p, msg), KVT_ENOENT);
    cr_expect(strstr(msg, "handle 77") != NULL, "message: %s", msg);
    cr_expect_eq(tput(fd, 0, 77, t, 2 * PAGE, 0, 1, 1, &p, msg), KVT_EPROTO, "handle, no flag");
    cr_expect_eq(tput(fd, KVT_PUT_F_HANDLE, 0, t, 2 * PAGE, 0, 1, 1, &p, msg), KVT_EPROTO,
                 "flag, no handle");
    /* RESERVE takes the same field and flag. */
    uint8_t b[sizeof(kvt_wire_reserve_t)];
    kvt_proto_reserve_t rq = {.ntokens = 0, .first_page = 0, .npages = 1, .handle = 77};
    kvt_proto_reserve_encode(b, &rq);
    treply_t r;
    tcall(fd, KVT_OP_RESERVE, 0, b, sizeof b, &r);
    cr_expect_eq(r.h.status, KVT_EPROTO, "RESERVE: handle, no flag");
    cr_expect_eq(kvd_stat(c, "index_blocks"), blocks, "a refused PUT added pages");
    /* The connection goes on. */
    cr_expect_eq(tput(fd, 0, 0, t, 2 * PAGE, 0, 2, 1, &p, msg), 0, "%s", msg);
    cr_expect_eq(p.stored, 2);
    kvt_client_close(c);
    close(fd);
}

/* A handle lives as long as its MATCH's lease would: after that, ENOENT and nothing added. */
Test(server_trip, expired_handle_changes_nothing, .fini = teardown)
{
    kvd_start(&d, NULL);
    int fd = tconn(&d, "trip");
    uint32_t t[2 * PAGE];
    kvd_tokens(t, 2 * PAGE, 600);
    tmatch_t m;
    tmatch(fd, KVT_MATCH_F_KEEP, 50, t, 2 * PAGE, &m);
    cr_assert_eq(m.status, 0);
    cr_assert_neq(m.m.handle, 0);
    usleep(150 * 1000);
    kvt_client_t *c = kvd_client(&d, "trip", PAGE, BB);
    uint64_t blocks = kvd_stat(c, "index_blocks");
    kvt_proto_put_reply_t p;
    char msg[256];
    cr_expect_eq(tput(fd, KVT_PUT_F_HANDLE, m.m.handle, NULL, 0, 0, 2, 1, &p, msg), KVT_ENOENT);
    cr_expect(strstr(msg, "expired") != NULL, "message: %s", msg);
    cr_expect_eq(kvd_stat(c, "index_blocks"), blocks);
    tmatch(fd, 0, 0, t, 2 * PAGE, &m);
    cr_expect_eq(m.m.pages, 0, "the expired handle's PUT stored pages");
    kvt_client_close(c);
    close(fd);
}

/* Handles are per connection: another connection's id names nothing there, or that
 * connection's own handle (the ids of both start at 1), never the first one's tokens. */
Test(server_trip, foreign_handle_is_not_found, .fini = teardown)
{
    kvd_start(&d, NULL);
    int a = tconn(&d, "trip"), b = tconn(&d, "trip");
    uint32_t ta[2 * PAGE], tb[2 * PAGE];
    kvd_tokens(ta, 2 * PAGE, 700);
    kvd_tokens(tb, 2 * PAGE, 800);
    tmatch_t m;
    tmatch(a, KVT_MATCH_F_KEEP, 0, ta, 2 * PAGE, &m);
    uint32_t ha = m.m.handle;
    cr_assert_neq(ha, 0);
    kvt_proto_put_reply_t p;
    char msg[256];
    cr_expect_eq(tput(b, KVT_PUT_F_HANDLE, ha, NULL, 0, 0, 2, 1, &p, msg), KVT_ENOENT);
    tmatch(b, 0, 0, ta, 2 * PAGE, &m);
    cr_expect_eq(m.m.pages, 0, "b's PUT stored a's tokens");
    /* b's own handle of the same id is b's tokens. */
    tmatch(b, KVT_MATCH_F_KEEP, 0, tb, 2 * PAGE, &m);
    cr_assert_eq(m.m.handle, ha, "ids count per connection from the same start");
    cr_assert_eq(tput(b, KVT_PUT_F_HANDLE, ha, NULL, 0, 0, 2, 1, &p, msg), 0, "%s", msg);
    tmatch(a, 0, 0, tb, 2 * PAGE, &m);
    cr_expect_eq(m.m.pages, 2);
    tmatch(a, 0, 0, ta, 2 * PAGE, &m);
    cr_expect_eq(m.m.pages, 0);
    close(a);
    close(b);
}

/* A HELLO to another namespace since the MATCH: the handle's tokens are not this one's. */
Test(server_trip, handle_of_another_namespace, .fini = teardown)
{
    kvd_start(&d, NULL);
    int fd = tconn(&d, "trip");
    uint32_t t[PAGE];
    kvd_tokens(t, PAGE, 900);
    tmatch_t m;
    tmatch(fd, KVT_MATCH_F_KEEP, 0, t, PAGE, &m);
    cr_assert_neq(m.m.handle, 0);
    cr_assert_eq(thello(fd, "other"), 0);
    kvt_proto_put_reply_t p;
    char msg[256];
    cr_expect_eq(tput(fd, KVT_PUT_F_HANDLE, m.m.handle, NULL, 0, 0, 1, 1, &p, msg), KVT_EINVAL);
    cr_expect(strstr(msg, "namespace") != NULL, "message: %s", msg);
    cr_assert_eq(thello(fd, "trip"), 0);
    cr_expect_eq(tput(fd, KVT_PUT_F_HANDLE, m.m.handle, NULL, 0, 0, 1, 1, &p, msg), 0,
                 "back in its namespace: %s", msg);
    close(fd);
}

/* At most 16 handles a connection: the 17th replaces the oldest. Their tokens count in the
 * clients' memory and go at the close. */
Test(server_trip, handles_are_bounded_and_freed, .fini = teardown)
{
    kvd_start(&d, NULL);
    kvt_client_t *c = kvd_client(&d, "trip", PAGE, BB);
    uint64_t base = kvd_stat(c, "client_buffer_bytes");
    int fd = tconn(&d, "trip");
    enum { N = 1000 }; /* tokens per MATCH: 4,000 bytes kept each */
    static uint32_t t[N];
    uint32_t ids[17];
    for (int i = 0; i < 17; i++) {
        kvd_tokens(t, N, 10000u * (uint32_t)i);
        tmatch_t m;
        tmatch(fd, KVT_MATCH_F_KEEP, 0, t, N, &m);
        cr_assert_eq(m.status, 0);
        ids[i] = m.m.handle;
        cr_assert_neq(ids[i], 0);
    }
    uint64_t held = kvd_stat(c, "client_buffer_bytes");
    cr_expect_geq(held, base + 16u * N * 4, "kept tokens not counted: %llu over %llu",
                  (unsigned long long)held, (unsigned long long)base);
    kvt_proto_put_reply_t p;
    char msg[256];
    cr_expect_eq(tput(fd, KVT_PUT_F_HANDLE, ids[0], NULL, 0, 0, 0, 0, &p, msg), KVT_ENOENT,
                 "the oldest of 17 was kept");
    cr_expect_eq(tput(fd, KVT_PUT_F_HANDLE, ids[1], NULL, 0, 0, 0, 0, &p, msg), 0, "%s", msg);
    cr_expect_eq(p.pages, N / PAGE);
    close(fd);
    uint64_t after = base + 1;
    for (int i = 0; i < 500 && (after = kvd_stat(c, "client_buffer_bytes")) > base; i++)
        usleep(10000);
    cr_expect_leq(after, base, "the closed connection's handles still held: %llu over %llu",
                  (unsigned long long)after, (unsigned long long)base);
    kvt_client_close(c);
}

/* The steps the kept-handle tests share (client_step_calls' PUT, client_reserve_kept's RESERVE).
 * A fresh kvtierd and a libkvtier client of it that maps its arena, in namespace "trip": */
static kvt_client_t *mapped_client(void)
{
    kvd_start(&d, NULL);
    kvt_client_conf_t conf = {.unix_path = d.sock,
                              .model = "trip",
                              .page_size = PAGE,
                              .block_bytes = BB,
                              .timeout_ms = 10000,
                              .zero_copy = 1};
    kvt_client_t *c = NULL;
    cr_assert_eq(kvt_client_connect(&c, &conf), 0);
    cr_assert(kvt_client_zero_copy(c), "no mapping: %s", kvt_client_zero_copy_reason(c));
    return c;
}

/* And a MATCH of t's first `pages` pages that keeps their tokens for the save after it (for
 * lease_ms; 0: the daemon's default): the step, with its handle. */
static kvt_client_step_t keep_match(kvt_client_t *c, const uint32_t *t, uint32_t pages,
                                    uint32_t lease_ms)
{
    kvt_client_match_t m = {0};
    kvt_client_step_t st = {0};
    cr_assert_eq(
        kvt_client_match_step(c, t, pages * PAGE, KVT_CLIENT_KEEP, lease_ms, NULL, &m, &st), 0);
    cr_assert_neq(st.handle, 0);
    cr_assert_eq(st.kept, pages * PAGE);
    return st;
}

/* libkvtier: one MATCH that locates and keeps, a PUT that names it; the located bytes are the
 * stored ones; a handle the daemon no longer has falls back to the whole tokens. */
Test(server_trip, client_step_calls, .fini = teardown)
{
    kvt_client_t *c = mapped_client();
    uint32_t t[4 * PAGE];
    kvd_tokens(t, 4 * PAGE, 1000);
    uint8_t *pay = malloc(4 * (size_t)BB);
    for (uint32_t i = 0; i < 4; i++)
        kvd_fill(pay + (size_t)i * BB, BB, 40 + i);

    kvt_client_match_t m = {0};
    kvt_client_step_t st = {0};
    cr_expect_eq(kvt_client_match_step(c, t, 2 * PAGE, KVT_CLIENT_LOCATE, 0, NULL, &m, &st),
                 KVT_CLIENT_EINVAL, "LOCATE without LEASE");
    cr_expect_eq(
        kvt_client_match(c, t, 2 * PAGE, KVT_CLIENT_LEASE | KVT_CLIENT_LOCATE, 0, NULL, &m),
        KVT_CLIENT_EINVAL, "LOCATE has no place in kvt_client_match's result");
    cr_expect_eq(kvt_client_match(c, t, 2 * PAGE, KVT_CLIENT_KEEP, 0, NULL, &m), KVT_CLIENT_EINVAL);
    st = keep_match(c, t, 2, 0);
    kvt_client_put_t pr;
    cr_assert_eq(kvt_client_put_kept(c, st.handle, t, 2 * PAGE, st.kept, 0, 2, pay, NULL, &pr), 0,
                 "%s", kvt_client_errmsg(c));
    cr_expect(pr.pages == 2 && pr.stored == 2, "pages %u stored %u", pr.pages, pr.stored);
    /* A handle the daemon never made: the whole tokens go instead, the same result. */
    cr_assert_eq(
        kvt_client_put_kept(c, 999, t, 4 * PAGE, 2 * PAGE, 2, 2, pay + 2 * (size_t)BB, NULL, &pr),
        0, "%s", kvt_client_errmsg(c));
    cr_expect(pr.pages == 4 && pr.stored == 2, "pages %u stored %u", pr.pages, pr.stored);

    kvt_client_loc_t locs[4];
    uint8_t tiers[4];
    m = (kvt_client_match_t){.tiers = tiers, .tiers_cap = 4};
    st = (kvt_client_step_t){.locs = locs, .locs_cap = 4};
    uint64_t before = kvt_now_ns();
    cr_assert_eq(kvt_client_match_step(c, t, 4 * PAGE,
                                       KVT_CLIENT_LEASE | KVT_CLIENT_LOCATE | KVT_CLIENT_KEEP, 2000,
                                       NULL, &m, &st),
                 0, "%s", kvt_client_errmsg(c));
    cr_assert_eq(m.pages, 4);
    cr_assert_neq(m.lease, 0);
    cr_expect_eq(st.located, 4);
    cr_expect_neq(st.handle, 0);
    cr_expect(st.valid_until_ns >= before + 2000ull * 1000000 &&
                  st.valid_until_ns <= kvt_now_ns() + 2000ull * 1000000,
              "the locations' limit is the lease's from the send");
    for (uint32_t i = 0; i < 4; i++) {
        cr_assert_eq(locs[i].tier, KVT_CLIENT_TIER_DRAM);
        cr_assert_not_null(locs[i].host_ptr);
        cr_expect(memcmp(locs[i].host_ptr, pay + (size_t)i * BB, BB) == 0, "page %u", i);
    }
    cr_expect_eq(kvt_client_release(c, m.lease, NULL), 0);
    free(pay);
    kvt_client_close(c);
}

/* A reservation's pages written, committed and read back by location: the bytes of seed. */
static void reserve_fill_commit(kvt_client_t *c, kvt_client_resv_t *rv, uint32_t npages,
                                uint32_t seed)
{
    cr_assert_eq(rv->nreserved, npages);
    for (uint32_t i = 0; i < npages; i++)
        kvd_fill(rv->ptrs[i], BB, seed + i);
    kvt_client_put_t pr;
    cr_assert_eq(kvt_client_commit(c, rv->id, &pr), 0, "%s", kvt_client_errmsg(c));
    cr_expect_eq(pr.stored, npages);
}

static void expect_pages(kvt_client_t *c, const uint32_t *t, uint32_t pages, uint32_t from,
                         uint32_t seed)
{
    kvt_client_match_t m = {0};
    cr_assert_eq(kvt_client_match(c, t, pages * PAGE, KVT_CLIENT_LEASE, 0, NULL, &m), 0);
    cr_assert_eq(m.pages, pages);
    uint8_t *buf = malloc((size_t)(pages - from) * BB), *want = malloc(BB);
    uint32_t got = 0;
    cr_assert_eq(kvt_client_get(c, m.lease, from, pages - from, buf, (size_t)(pages - from) * BB,
                                &got, NULL),
                 0, "%s", kvt_client_errmsg(c));
    cr_assert_eq(got, pages - from);
    for (uint32_t i = 0; i < got; i++) {
        kvd_fill(want, BB, seed + i);
        cr_expect(memcmp(buf + (size_t)i * BB, want, BB) == 0, "page %u", from + i);
    }
    cr_expect_eq(kvt_client_release(c, m.lease, NULL), 0);
    free(buf);
    free(want);
}

/* libkvtier's RESERVE naming a kept MATCH (kvt_client_reserve_kept): only the tokens past the
 * kept ones go out, and the reservation is the one of the whole sequence. The kept tokens the
 * caller passes are scrambled here: a RESERVE that sent them would cache another chain. A handle
 * the daemon does not hold (never made, expired) falls back to all the tokens; kept past the
 * tokens is refused and changes nothing. */
Test(server_trip, client_reserve_kept, .fini = teardown)
{
    kvt_client_t *c = mapped_client();
    uint32_t t[8 * PAGE], scrambled[8 * PAGE];
    kvd_tokens(t, 8 * PAGE, 1300);
    uint8_t *pay = malloc(2 * (size_t)BB);
    for (uint32_t i = 0; i < 2; i++)
        kvd_fill(pay + (size_t)i * BB, BB, 70 + i);
    cr_assert_eq(kvt_client_put(c, t, 2 * PAGE, 0, 2, pay, NULL, NULL), 0);

    kvt_client_step_t st = keep_match(c, t, 2, 0);
    void *ptrs[4];
    kvt_client_resv_t rv = {.ptrs = ptrs};
    uint64_t blocks = kvd_stat(c, "index_blocks");
    cr_expect_eq(kvt_client_reserve_kept(c, st.handle, t, 2 * PAGE - 1, st.kept, 2, 2, NULL, &rv),
                 KVT_CLIENT_EINVAL, "kept past the tokens");
    kvt_client_resv_t noptrs = {0};
    cr_expect_eq(kvt_client_reserve_kept(c, st.handle, t, 4 * PAGE, st.kept, 2, 2, NULL, &noptrs),
                 KVT_CLIENT_EINVAL, "no pointer array");
    cr_expect_eq(kvd_stat(c, "index_blocks"), blocks, "a refused RESERVE changed the index");

    memcpy(scrambled, t, sizeof t);
    for (uint32_t i = 0; i < st.kept; i++)
        scrambled[i] = 7;
    cr_assert_eq(
        kvt_client_reserve_kept(c, st.handle, scrambled, 4 * PAGE, st.kept, 2, 2, NULL, &rv), 0,
        "%s", kvt_client_errmsg(c));
    cr_expect(rv.pages == 4 && rv.new_pages == 2, "pages %u new %u: the kept tokens were sent",
              rv.pages, rv.new_pages);
    reserve_fill_commit(c, &rv, 2, 80);
    expect_pages(c, t, 4, 2, 80);
    /* The handle may be named again (by the next save of the same request). */
    cr_assert_eq(
        kvt_client_reserve_kept(c, st.handle, scrambled, 5 * PAGE, st.kept, 4, 1, NULL, &rv), 0,
        "%s", kvt_client_errmsg(c));
    cr_expect(rv.pages == 5 && rv.new_pages == 1, "pages %u new %u", rv.pages, rv.new_pages);
    reserve_fill_commit(c, &rv, 1, 90);
    expect_pages(c, t, 5, 4, 90);

    /* A handle never made: the whole tokens go instead, the same reservation. */
    cr_assert_eq(kvt_client_reserve_kept(c, 999, t, 6 * PAGE, 5 * PAGE, 5, 1, NULL, &rv), 0, "%s",
                 kvt_client_errmsg(c));
    cr_expect(rv.pages == 6 && rv.new_pages == 1, "pages %u new %u", rv.pages, rv.new_pages);
    reserve_fill_commit(c, &rv, 1, 100);
    expect_pages(c, t, 6, 5, 100);

    /* A handle expired with its MATCH's lease time: the same. */
    st = keep_match(c, t, 6, 50);
    usleep(150 * 1000);
    cr_assert_eq(kvt_client_reserve_kept(c, st.handle, t, 8 * PAGE, st.kept, 6, 2, NULL, &rv), 0,
                 "%s", kvt_client_errmsg(c));
    cr_expect(rv.pages == 8 && rv.new_pages == 2, "pages %u new %u", rv.pages, rv.new_pages);
    reserve_fill_commit(c, &rv, 2, 110);
    expect_pages(c, t, 8, 6, 110);
    cr_expect_eq(kvd_stat(c, "leases"), 0, "leases left held");
    free(pay);
    kvt_client_close(c);
}

/* kvt_client_release_later: the RELEASE rides in front of the next request, whatever it is (a
 * call, a GET's stream, a batch), and its reply is read before that request's. */
Test(server_trip, release_later_rides_with_the_next_request, .fini = teardown)
{
    kvd_start(&d, NULL);
    kvt_client_t *c = kvd_client(&d, "trip", PAGE, BB);
    uint32_t t[2 * PAGE];
    kvd_tokens(t, 2 * PAGE, 1100);
    uint8_t *pay = malloc(2 * (size_t)BB), *buf = malloc(2 * (size_t)BB);
    kvd_fill(pay, 2 * (size_t)BB, 3);
    cr_assert_eq(kvt_client_put(c, t, 2 * PAGE, 0, 2, pay, NULL, NULL), 0);
    kvt_client_match_t m = {0};
    cr_assert_eq(kvt_client_match(c, t, 2 * PAGE, KVT_CLIENT_LEASE, 0, NULL, &m), 0);
    cr_assert_eq(kvt_client_release_later(c, m.lease), 0);
    cr_expect_eq(kvd_stat(c, "leases"), 0, "the RELEASE did not go out with the STATS");
    /* More than fit in the queue (64): the first ones go out alone. */
    for (int i = 0; i < 70; i++) {
        cr_assert_eq(kvt_client_match(c, t, 2 * PAGE, KVT_CLIENT_LEASE, 0, NULL, &m), 0);
        cr_assert_eq(kvt_client_release_later(c, m.lease), 0);
    }
    /* A GET's stream after one, under a lease taken before it. */
    kvt_client_match_t keep = {0};
    cr_assert_eq(kvt_client_match(c, t, 2 * PAGE, KVT_CLIENT_LEASE, 0, NULL, &keep), 0);
    cr_assert_eq(kvt_client_match(c, t, 2 * PAGE, KVT_CLIENT_LEASE, 0, NULL, &m), 0);
    cr_assert_eq(kvt_client_release_later(c, m.lease), 0);
    uint32_t got = 0;
    cr_assert_eq(kvt_client_get(c, keep.lease, 0, 2, buf, 2 * (size_t)BB, &got, NULL), 0, "%s",
                 kvt_client_errmsg(c));
    cr_expect(got == 2 && memcmp(buf, pay, 2 * (size_t)BB) == 0);
    /* A batch queued before one, run after it. */
    kvt_batch_t *b;
    cr_assert_eq(kvt_batch_create(&b, c), 0);
    int st1 = 1, st2 = 1;
    cr_assert_eq(kvt_batch_ping(b, &st1), 0);
    cr_assert_eq(kvt_client_release_later(c, keep.lease), 0);
    cr_assert_eq(kvt_batch_ping(b, &st2), 0);
    cr_assert_eq(kvt_batch_run(b), 0);
    cr_expect(st1 == 0 && st2 == 0);
    kvt_batch_destroy(b);
    cr_expect_eq(kvd_stat(c, "leases"), 0, "leases left held");
    free(pay);
    free(buf);
    kvt_client_close(c);
}

/* Keyed gets on a mapped client (SGLang's and LMCache's independent keys, vLLM's chains) read
 * their hits by location: the MATCH that leases them says where, and no GET goes out. */
Test(server_trip, keyed_gets_read_by_location, .fini = teardown)
{
    kvd_start(&d, NULL);
    kvt_client_conf_t conf = {.unix_path = d.sock,
                              .model = "trip",
                              .block_bytes = BB,
                              .timeout_ms = 10000,
                              .zero_copy = 1};
    kvt_keys_t *k = NULL;
    cr_assert_eq(kvt_keys_connect(&k, &conf), 0);
    cr_assert(kvt_client_zero_copy(kvt_keys_client(k)));
    kvt_client_t *c = kvd_client(&d, "trip", PAGE, BB);
    enum { N = 5 };
    kvt_key_t keys[N];
    char names[N][8];
    uint8_t *blocks = malloc(N * (size_t)BB), *out = malloc(N * (size_t)BB);
    const void *bp[N];
    void *op[N];
    for (int i = 0; i < N; i++) {
        snprintf(names[i], sizeof names[i], "key%d", i);
        keys[i] = (kvt_key_t){names[i], strlen(names[i])};
        kvd_fill(blocks + (size_t)i * BB, BB, 200 + (uint32_t)i);
        bp[i] = blocks + (size_t)i * BB;
        op[i] = out + (size_t)i * BB;
    }
    int st[N + 1];
    cr_assert_eq(kvt_keys_put(k, keys, N - 1, bp, st), N - 1); /* the last key stays missing */
    cr_assert_eq(kvt_keys_chain_put(k, keys, N, 0, N, blocks, NULL), 0);
    uint64_t gets = kvd_stat(c, "requests_get");

    memset(out, 0, N * (size_t)BB);
    cr_assert_eq(kvt_keys_get(k, keys, N, op, st), N - 1);
    for (int i = 0; i < N - 1; i++) {
        cr_expect_eq(st[i], 0, "key %d: %d", i, st[i]);
        cr_expect(memcmp(op[i], bp[i], BB) == 0, "key %d's bytes", i);
    }
    cr_expect_eq(st[N - 1], KVT_CLIENT_ENOENT);
    uint32_t got = 0;
    memset(out, 0, N * (size_t)BB);
    cr_assert_eq(kvt_keys_chain_get(k, keys, N, 1, out, (N - 1) * (size_t)BB, &got), 0);
    cr_expect_eq(got, N - 1);
    cr_expect(memcmp(out, blocks + BB, (N - 1) * (size_t)BB) == 0, "the chain's bytes");
    cr_expect_eq(kvd_stat(c, "requests_get"), gets, "a keyed get sent a GET for a mapped page");
    cr_expect_eq(kvd_stat(c, "leases"), 0, "a keyed get left a lease");
    free(blocks);
    free(out);
    kvt_client_close(c);
    kvt_keys_close(k);
}
