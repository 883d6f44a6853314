/*
 * test_server_zc.c: the daemon's zero-copy path for local clients (docs/protocol.md, "Zero-copy
 * for local clients"), spoken frame by frame over a raw Unix socket: MAP's memfd really arrives
 * over SCM_RIGHTS and is really mapped here, RESERVE's room is really written through that
 * mapping, GET with LOCATE really answers by offset. Tenancy, the lifetimes (commit, abort,
 * expiry, a client killed mid-write, a lease holding bytes in place) and every refusal are checked
 * against a real kvtierd. So is what a client cannot keep (issue 36): memory it makes resident in
 * its memfd outside its blocks, DRAM held by expired reservations, arena slots after it left,
 * and the arenas gauge against the daemon's real memfds. And a page promoted into HBM under a
 * reader's lease: its old DRAM copy kept, unreused, until the lease ends (promote-keep-share).
 */
#define _GNU_SOURCE /* SEEK_DATA, SEEK_HOLE */
#include <criterion/criterion.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

#include "common.h" /* kvt_put_u64 */
#include "proto.h"
#include "test_raw_frames.h"
#include "test_server_harness.h"

#define PAGE 4
#define BB   (64u << 10) /* block bytes */

/* One reply: header, body (up to cap bytes kept), and a descriptor if one came with it. */
typedef struct zreply {
    kvt_proto_hdr_t h;
    uint8_t body[4096];
    int fd; /* -1 when none came */
} zreply_t;

/* Reads one whole reply with recvmsg, so that a descriptor on its first byte is taken. */
static void zrecv(int fd, zreply_t *r)
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
    size_t keep = KVT_MIN((size_t)r->h.body_len, sizeof r->body);
    cr_assert_eq(read_full(fd, r->body, keep), 0);
    for (size_t left = r->h.body_len - keep; left > 0;) { /* a data frame's payload: not kept */
        uint8_t junk[4096];
        size_t t = KVT_MIN(left, sizeof junk);
        cr_assert_eq(read_full(fd, junk, t), 0);
        left -= t;
    }
    r->body[KVT_MIN(keep, sizeof r->body - 1)] = 0;
}

static void zsend(int fd, unsigned op, uint16_t flags, uint64_t id, const void *b, uint32_t len)
{
    raw_frame(fd, op, flags, id, b, len, KVT_PROTO_MAGIC, KVT_PROTO_VERSION);
}

/* Sends a request and reads its (single-frame) reply. */
static void zcall(int fd, unsigned op, uint16_t flags, const void *b, uint32_t len, zreply_t *r)
{
    static uint64_t id = 1;
    uint64_t my = id++;
    zsend(fd, op, flags, my, b, len);
    zrecv(fd, r);
    cr_assert_eq(r->h.request_id, my);
    cr_assert_eq(r->h.opcode, op | KVT_OP_REPLY);
}

static int zhello(int fd, const char *model, const char *salt, uint32_t bb)
{
    uint8_t body[600];
    size_t ml = strlen(model), sl = salt ? strlen(salt) : 0;
    kvt_proto_hello_t m = {.min_version = 1,
                           .max_version = 1,
                           .page_size = PAGE,
                           .block_bytes = bb,
                           .model_len = (uint16_t)ml,
                           .salt_len = (uint16_t)sl};
    kvt_proto_hello_encode(body, &m);
    memcpy(body + sizeof(kvt_wire_hello_t), model, ml);
    if (sl)
        memcpy(body + sizeof(kvt_wire_hello_t) + ml, salt, sl);
    zreply_t r;
    zcall(fd, KVT_OP_HELLO, 0, body, (uint32_t)(sizeof(kvt_wire_hello_t) + ml + sl), &r);
    return r.h.status;
}

static int zconn(const kvd_t *d, const char *model, const char *salt)
{
    int fd = kvd_raw(d);
    cr_assert_eq(zhello(fd, model, salt, BB), 0);
    return fd;
}

typedef struct zmap {
    uint8_t *base;
    uint64_t bytes;
    int fd; /* the memfd, kept for fstat and SEEK_DATA */
} zmap_t;

/* MAP of tier; returns the status, with the mapping made on success (DRAM). */
static int zmap_tier(int fd, uint32_t tier, zmap_t *z, char *msg)
{
    uint8_t b[sizeof(kvt_wire_map_t)];
    kvt_proto_map_encode(b, tier);
    zreply_t r;
    zcall(fd, KVT_OP_MAP, 0, b, sizeof b, &r);
    if (msg)
        snprintf(msg, 256, "%.200s", (const char *)r.body);
    if (r.h.status < 0) {
        cr_expect_eq(r.fd, -1, "a refused MAP carries no descriptor");
        return r.h.status;
    }
    kvt_proto_map_reply_t m;
    cr_assert_eq(kvt_proto_map_reply_decode(r.body, r.h.body_len, &m), 0);
    cr_assert_eq(m.tier, tier);
    cr_assert_geq(r.fd, 0, "the MAP reply carried no descriptor");
    z->bytes = m.map_bytes;
    z->fd = r.fd;
    z->base = mmap(NULL, m.map_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, r.fd, 0);
    cr_assert(z->base != MAP_FAILED, "mmap: %s", strerror(errno));
    return 0;
}

/* Where a reserved page lies in the client's mapping. */
static uint8_t *z_late(zmap_t *z, uint64_t off)
{
    cr_assert_leq(off + BB, z->bytes);
    return z->base + off;
}

static void zunmap(zmap_t *z)
{
    munmap(z->base, z->bytes);
    close(z->fd);
}

/* RESERVE pages [first, first + n) of the tokens t; returns the status, the reply in *rr and
 * the locations in page/off (n entries at most). */
static int zreserve(int fd, const uint32_t *t, uint32_t nt, uint32_t first, uint32_t n,
                    kvt_proto_reserve_reply_t *rr, uint32_t *page, uint64_t *off, zreply_t *r)
{
    uint8_t b[4096];
    kvt_proto_reserve_t q = {.ntokens = nt, .first_page = first, .npages = n};
    kvt_proto_reserve_encode(b, &q);
    kvt_proto_tokens_encode(b + sizeof(kvt_wire_reserve_t), t, nt);
    zcall(fd, KVT_OP_RESERVE, 0, b, (uint32_t)(sizeof(kvt_wire_reserve_t) + 4 * nt), r);
    if (r->h.status < 0)
        return r->h.status;
    cr_assert_eq(kvt_proto_reserve_reply_decode(r->body, r->h.body_len, rr), 0);
    for (uint32_t i = 0; i < rr->nlocs; i++)
        kvt_proto_resv_loc(rr, i, &page[i], &off[i]);
    return 0;
}

static int zcommit(int fd, uint64_t resv, uint16_t flags, kvt_proto_put_reply_t *p)
{
    uint8_t b[8];
    kvt_proto_commit_encode(b, resv);
    zreply_t r;
    zcall(fd, KVT_OP_COMMIT, flags, b, sizeof b, &r);
    if (r.h.status == 0)
        cr_assert_eq(kvt_proto_put_reply_decode(r.body, r.h.body_len, p), 0);
    return r.h.status;
}

/* MATCH with a lease; returns the lease (0 when nothing matched), *pages and the tiers. */
static uint64_t zmatch(int fd, const uint32_t *t, uint32_t nt, uint32_t *pages, uint8_t *tiers)
{
    uint8_t b[4096];
    kvt_proto_match_t q = {.ntokens = nt};
    kvt_proto_match_encode(b, &q);
    kvt_proto_tokens_encode(b + sizeof(kvt_wire_match_t), t, nt);
    zreply_t r;
    zcall(fd, KVT_OP_MATCH, KVT_MATCH_F_LEASE, b, (uint32_t)(sizeof(kvt_wire_match_t) + 4 * nt),
          &r);
    cr_assert_eq(r.h.status, 0, "MATCH: %s", r.body);
    kvt_proto_match_reply_t m;
    const uint8_t *tb;
    cr_assert_eq(kvt_proto_match_reply_decode(r.body, r.h.body_len, &m, &tb), 0);
    *pages = m.pages;
    if (tiers)
        memcpy(tiers, tb, m.pages);
    return m.lease;
}

/* GET of a lease's pages with LOCATE: per page, its offset (or UINT64_MAX when it came with its
 * bytes); returns the end frame's status, *left the lease time it reported. */
static int zget_locate(int fd, uint64_t lease, uint32_t n, uint64_t *off, uint32_t *left)
{
    uint8_t b[sizeof(kvt_wire_get_t)];
    kvt_proto_get_t q = {.lease = lease, .npages = n};
    kvt_proto_get_encode(b, &q);
    zsend(fd, KVT_OP_GET, KVT_GET_F_LOCATE, 999, b, sizeof b);
    for (uint32_t i = 0;; i++) {
        zreply_t r;
        zrecv(fd, &r);
        cr_assert_eq(r.h.request_id, 999);
        if (!(r.h.flags & KVT_RF_MORE)) {
            uint32_t sent;
            if (r.h.status == 0)
                cr_assert_eq(kvt_proto_get_end_decode(r.body, r.h.body_len, &sent, left), 0);
            return r.h.status;
        }
        cr_assert_lt(i, n);
        uint32_t page, len;
        uint8_t tier;
        if (kvt_proto_get_data_kind(r.body, r.h.body_len) == KVT_GET_DATA_LOC) {
            cr_assert_eq(
                kvt_proto_get_loc_decode(r.body, r.h.body_len, &page, &tier, &off[i], &len), 0);
            cr_expect_eq(len, BB);
            cr_expect_eq(tier, KVT_TIER_DRAM);
        } else {
            cr_assert_eq(r.h.body_len, sizeof(kvt_wire_get_data_t) + BB);
            off[i] = UINT64_MAX;
            page = kvt_get_u32(r.body);
        }
        cr_expect_eq(page, i);
    }
}

static void zrelease(int fd, uint64_t lease)
{
    uint8_t b[8];
    kvt_proto_release_encode(b, lease);
    zreply_t r;
    zcall(fd, KVT_OP_RELEASE, 0, b, sizeof b, &r);
}

/* Waits (up to 10 s) for a STATS counter to reach want. */
static uint64_t wait_stat(kvt_client_t *c, const char *name, uint64_t want)
{
    uint64_t v = 0;
    for (int i = 0; i < 1000 && (v = kvd_stat(c, name)) < want; i++)
        usleep(10000);
    return v;
}

static kvt_client_t *zclient(const kvd_t *d, const char *salt)
{
    kvt_client_conf_t conf = {.unix_path = d->sock,
                              .model = "zc",
                              .salt = salt,
                              .page_size = PAGE,
                              .block_bytes = BB,
                              .timeout_ms = 10000};
    kvt_client_t *c = NULL;
    cr_assert_eq(kvt_client_connect(&c, &conf), 0);
    return c;
}

/* A page's pattern, and whether mem holds it. */
static void pattern(uint8_t *p, uint32_t seed)
{
    kvd_fill(p, BB, seed);
}

static kvd_t d;

static void teardown(void)
{
    kvd_cleanup(&d);
}

/* The whole path: MAP, RESERVE, write through the mapping, COMMIT; another client reads the
 * bytes through the socket; the writer's GET with LOCATE answers the same offsets, and the bytes
 * there are the bytes. */
Test(server_zc, reserve_write_commit_then_locate, .fini = teardown)
{
    kvd_start(&d, NULL);
    int fd = zconn(&d, "zc", NULL);
    zmap_t z;
    cr_assert_eq(zmap_tier(fd, KVT_TIER_DRAM, &z, NULL), 0);
    uint32_t t[3 * PAGE];
    kvd_tokens(t, 3 * PAGE, 100);
    kvt_proto_reserve_reply_t rr;
    uint32_t page[3];
    uint64_t off[3];
    zreply_t r;
    cr_assert_eq(zreserve(fd, t, 3 * PAGE, 0, 3, &rr, page, off, &r), 0, "RESERVE: %s", r.body);
    cr_assert(rr.resv != 0 && rr.pages == 3 && rr.new_pages == 3 && rr.nlocs == 3);
    for (uint32_t i = 0; i < 3; i++) {
        cr_assert_eq(page[i], i);
        cr_assert_leq(off[i] + BB, z.bytes);
        pattern(z.base + off[i], 7 + i);
    }
    kvt_proto_put_reply_t p;
    cr_assert_eq(zcommit(fd, rr.resv, 0, &p), 0);
    cr_expect(p.pages == 3 && p.stored == 3 && p.skipped == 0);

    kvt_client_t *c = zclient(&d, NULL);
    kvt_client_match_t m = {0};
    cr_assert_eq(kvt_client_match(c, t, 3 * PAGE, KVT_CLIENT_LEASE, 0, NULL, &m), 0);
    cr_assert_eq(m.pages, 3);
    uint8_t *got = malloc(3 * BB), *want = malloc(BB);
    cr_assert_eq(kvt_client_get(c, m.lease, 0, 3, got, 3 * BB, NULL, NULL), 0);
    for (uint32_t i = 0; i < 3; i++) {
        pattern(want, 7 + i);
        cr_expect(memcmp(got + (size_t)i * BB, want, BB) == 0, "page %u read back wrong", i);
    }

    uint32_t pages, left = 0;
    uint8_t tiers[3];
    uint64_t lease = zmatch(fd, t, 3 * PAGE, &pages, tiers);
    cr_assert_eq(pages, 3);
    uint64_t loc[3];
    cr_assert_eq(zget_locate(fd, lease, 3, loc, &left), 0);
    for (uint32_t i = 0; i < 3; i++) {
        cr_expect_eq(tiers[i], KVT_TIER_DRAM);
        cr_expect_eq(loc[i], off[i], "page %u answered at another place", i);
    }
    cr_expect(left > 0 && left <= 30000, "lease_ms_left %u", left);
    cr_expect_eq(kvd_stat(c, "zero_copy_pages_get"), 3);
    cr_expect_eq(kvd_stat(c, "zero_copy_pages_reserve"), 3);
    cr_expect_eq(kvd_stat(c, "reservations_committed"), 1);
    cr_expect_eq(kvd_stat(c, "zero_copy_maps_dram"), 1);
    cr_expect_eq(kvd_stat(c, "zero_copy_arenas"), 1);
    zrelease(fd, lease);
    free(got);
    free(want);
    kvt_client_close(c);
    zunmap(&z);
    close(fd);
}

/* A client killed between RESERVE and COMMIT, half its page written: nobody sees the page, its
 * room goes back, and the next PUT of it stores it. */
Test(server_zc, client_killed_mid_write_leaves_nothing, .fini = teardown)
{
    kvd_start(&d, NULL);
    kvt_client_t *c = zclient(&d, NULL);
    uint64_t used0 = kvd_stat(c, "dram_used_bytes");
    uint32_t t[2 * PAGE];
    kvd_tokens(t, 2 * PAGE, 500);
    int ready[2];
    cr_assert_eq(pipe(ready), 0);
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        int fd = zconn(&d, "zc", NULL);
        zmap_t z;
        if (zmap_tier(fd, KVT_TIER_DRAM, &z, NULL) != 0)
            _exit(2);
        kvt_proto_reserve_reply_t rr;
        uint32_t page[2];
        uint64_t off[2];
        zreply_t r;
        if (zreserve(fd, t, 2 * PAGE, 0, 2, &rr, page, off, &r) != 0 || rr.nlocs != 2)
            _exit(3);
        memset(z.base + off[0], 0xab, BB / 2); /* half of the first page */
        if (write(ready[1], "x", 1) != 1)
            _exit(4);
        pause(); /* killed here */
        _exit(5);
    }
    close(ready[1]);
    char x;
    cr_assert_eq(read(ready[0], &x, 1), 1, "the child failed before writing");
    close(ready[0]);
    cr_assert_gt(kvd_stat(c, "dram_used_bytes"), used0, "the reservation holds room");
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    cr_assert_eq(wait_stat(c, "reservations_closed", 1), 1);
    cr_expect_eq(kvd_stat(c, "dram_used_bytes"), used0, "the reservation's room went back");
    kvt_client_match_t m = {0};
    uint8_t tiers[2];
    m.tiers = tiers;
    m.tiers_cap = 2;
    cr_assert_eq(kvt_client_match(c, t, 2 * PAGE, 0, 0, NULL, &m), 0);
    cr_expect_eq(m.pages, 2, "the index keeps the pages");
    cr_expect(tiers[0] == KVT_CLIENT_TIER_NONE && tiers[1] == KVT_CLIENT_TIER_NONE,
              "a page of a dead reservation is visible (tiers %u %u)", tiers[0], tiers[1]);
    uint8_t *pay = malloc(2 * BB);
    kvd_fill(pay, 2 * BB, 3);
    kvt_client_put_t pr;
    cr_assert_eq(kvt_client_put(c, t, 2 * PAGE, 0, 2, pay, NULL, &pr), 0);
    cr_expect_eq(pr.stored, 2, "the pages are no longer busy");
    free(pay);
    kvt_client_close(c);
}

/* Until COMMIT a reserved page is invisible; ABORT gives it back; a reservation is the
 * connection's own; one left past reserve-ms is given back by the daemon. */
Test(server_zc, abort_foreign_and_expired_reservations, .fini = teardown)
{
    kvd_start(&d, "--reserve-ms", "300", NULL);
    int a = zconn(&d, "zc", NULL), b = zconn(&d, "zc", NULL);
    zmap_t za, zb;
    cr_assert_eq(zmap_tier(a, KVT_TIER_DRAM, &za, NULL), 0);
    cr_assert_eq(zmap_tier(b, KVT_TIER_DRAM, &zb, NULL), 0);
    cr_expect(za.bytes == zb.bytes);
    uint32_t t[PAGE];
    kvd_tokens(t, PAGE, 900);
    kvt_proto_reserve_reply_t rr;
    uint32_t page[1];
    uint64_t off[1];
    zreply_t r;
    cr_assert_eq(zreserve(a, t, PAGE, 0, 1, &rr, page, off, &r), 0);
    cr_assert_eq(rr.nlocs, 1);
    /* Invisible: another connection sees an index-only page. */
    uint32_t pages;
    uint8_t tiers[1];
    uint64_t lease = zmatch(b, t, PAGE, &pages, tiers);
    cr_expect(pages == 1 && tiers[0] == KVT_TIER_NONE);
    zrelease(b, lease);
    /* Reserved twice: the second finds the page being written. */
    kvt_proto_reserve_reply_t r2;
    cr_assert_eq(zreserve(b, t, PAGE, 0, 1, &r2, page, off, &r), 0);
    cr_expect(r2.nlocs == 0 && r2.resv == 0);
    /* Another connection's reservation is not found. */
    kvt_proto_put_reply_t p;
    cr_expect_eq(zcommit(b, rr.resv, 0, &p), KVT_ENOENT);
    cr_expect_eq(zcommit(a, rr.resv + 1000, 0, &p), KVT_ENOENT);
    cr_assert_eq(zcommit(a, rr.resv, KVT_COMMIT_F_ABORT, &p), 0);
    cr_expect(p.stored == 0 && p.skipped == 1);
    cr_expect_eq(zcommit(a, rr.resv, 0, &p), KVT_ENOENT, "committed after its abort");
    /* Expiry. */
    cr_assert_eq(zreserve(a, t, PAGE, 0, 1, &rr, page, off, &r), 0);
    cr_assert_eq(rr.nlocs, 1);
    kvt_client_t *c = zclient(&d, NULL);
    cr_assert_eq(wait_stat(c, "reservations_expired", 1), 1);
    /* Expired: its page is let go (another client stores it), and its room no longer counts in
     * DRAM (others may use the capacity), but it stays allocated until the slow client's COMMIT
     * (or close), so late bytes land nowhere else. */
    cr_expect_eq(kvd_stat(c, "dram_used_bytes"), 0, "an expired reservation's room still counts");
    uint8_t *pay = malloc(BB);
    kvd_fill(pay, BB, 99);
    kvt_client_put_t cp;
    cr_assert_eq(kvt_client_put(c, t, PAGE, 0, 1, pay, NULL, &cp), 0);
    cr_expect_eq(cp.stored, 1, "the expired reservation's page is still busy");
    memset(z_late(&za, off[0]), 0xee, BB); /* the slow client's late write */
    cr_expect_eq(zcommit(a, rr.resv, 0, &p), KVT_ENOENT, "committed after it expired");
    cr_expect_eq(kvd_stat(c, "reservations_aborted"), 1);
    cr_expect_eq(kvd_stat(c, "reservations_expired"), 1, "counted once");
    cr_expect_eq(kvd_stat(c, "dram_used_bytes"), BB, "the stored page alone counts");
    kvt_client_match_t cm = {0};
    uint8_t *got = malloc(BB);
    cr_assert_eq(kvt_client_match(c, t, PAGE, KVT_CLIENT_LEASE, 0, NULL, &cm), 0);
    cr_assert_eq(kvt_client_get(c, cm.lease, 0, 1, got, BB, NULL, NULL), 0);
    cr_expect(memcmp(got, pay, BB) == 0, "the late write reached the stored page");
    free(got);
    free(pay);
    kvt_client_close(c);
    zunmap(&za);
    zunmap(&zb);
    close(a);
    close(b);
}

/* Whether the memfd holds the bytes of p (BB of them) anywhere it has data. */
static int memfd_holds(int fd, const uint8_t *p)
{
    off_t at = 0;
    uint8_t *buf = malloc(1u << 20);
    int found = 0;
    for (;;) {
        off_t data = lseek(fd, at, SEEK_DATA);
        if (data < 0)
            break;
        off_t hole = lseek(fd, data, SEEK_HOLE);
        for (off_t o = data; o < hole && !found; o += 4096) {
            uint8_t pg[64];
            if (pread(fd, pg, sizeof pg, o) == (ssize_t)sizeof pg && !memcmp(pg, p, sizeof pg))
                found = 1;
        }
        at = hole;
    }
    free(buf);
    return found;
}

/* Two tenants (salts) get two memfds; one's blocks are never in the other's. Blocks stored
 * before the namespace mapped its arena stay outside it and come with their bytes. */
Test(server_zc, tenants_map_only_their_own_blocks, .fini = teardown)
{
    kvd_start(&d, NULL);
    kvt_client_t *early = zclient(&d, "tenant-a");
    uint32_t t0[PAGE];
    kvd_tokens(t0, PAGE, 40);
    uint8_t *pay = malloc(BB);
    pattern(pay, 41);
    kvt_client_put_t pr;
    cr_assert_eq(kvt_client_put(early, t0, PAGE, 0, 1, pay, NULL, &pr), 0);
    cr_assert_eq(pr.stored, 1);

    int a = zconn(&d, "zc", "tenant-a"), b = zconn(&d, "zc", "tenant-b");
    zmap_t za, zb;
    cr_assert_eq(zmap_tier(a, KVT_TIER_DRAM, &za, NULL), 0);
    cr_assert_eq(zmap_tier(b, KVT_TIER_DRAM, &zb, NULL), 0);
    struct stat sa, sb;
    cr_assert(fstat(za.fd, &sa) == 0 && fstat(zb.fd, &sb) == 0);
    cr_expect_neq(sa.st_ino, sb.st_ino, "two tenants share one memfd");

    /* a's page through the socket PUT lands in a's arena (a mapped it). */
    uint32_t t1[PAGE];
    kvd_tokens(t1, PAGE, 80);
    pattern(pay, 81);
    cr_assert_eq(kvt_client_put(early, t1, PAGE, 0, 1, pay, NULL, &pr), 0);
    cr_assert_eq(pr.stored, 1);
    cr_expect(memfd_holds(za.fd, pay), "a's page is not in a's arena");
    cr_expect(!memfd_holds(zb.fd, pay), "a's page is in b's arena");

    /* GET with LOCATE on a: the early page comes with its bytes, the later one by location. */
    uint32_t t2[2 * PAGE];
    memcpy(t2, t0, sizeof t0);
    uint32_t pages, left;
    uint64_t lease = zmatch(a, t0, PAGE, &pages, NULL);
    uint64_t loc[1];
    cr_assert_eq(pages, 1);
    cr_assert_eq(zget_locate(a, lease, 1, loc, &left), 0);
    cr_expect_eq(loc[0], UINT64_MAX, "a page from before the arena was answered by location");
    zrelease(a, lease);
    lease = zmatch(a, t1, PAGE, &pages, NULL);
    cr_assert_eq(zget_locate(a, lease, 1, loc, &left), 0);
    cr_assert_neq(loc[0], UINT64_MAX);
    cr_expect(memcmp(za.base + loc[0], pay, BB) == 0);
    zrelease(a, lease);
    /* b cannot lease a's page at all: same tokens, its own namespace. */
    lease = zmatch(b, t1, PAGE, &pages, NULL);
    cr_expect_eq(pages, 0);
    free(pay);
    kvt_client_close(early);
    zunmap(&za);
    zunmap(&zb);
    close(a);
    close(b);
}

/* zero-copy-arenas bounds the namespaces with an arena; one nobody maps and that holds no block
 * goes, and its slot is another's. */
Test(server_zc, arena_limit_and_reuse, .fini = teardown)
{
    kvd_start(&d, "--zero-copy-arenas", "1", NULL);
    int a = zconn(&d, "zc", "one"), b = zconn(&d, "zc", "two");
    zmap_t za, zb;
    char msg[256];
    cr_assert_eq(zmap_tier(a, KVT_TIER_DRAM, &za, NULL), 0);
    cr_expect_eq(zmap_tier(b, KVT_TIER_DRAM, &zb, msg), KVT_ENOSPC);
    cr_expect(strstr(msg, "zero-copy-arenas"), "%s", msg);
    zunmap(&za);
    close(a);
    kvt_client_t *c = zclient(&d, NULL);
    for (int i = 0; i < 1000 && kvd_stat(c, "zero_copy_arenas") != 0; i++)
        usleep(10000);
    cr_assert_eq(kvd_stat(c, "zero_copy_arenas"), 0);
    cr_expect_eq(zmap_tier(b, KVT_TIER_DRAM, &zb, NULL), 0);
    zunmap(&zb);
    kvt_client_close(c);
    close(b);
}

/* Every refusal is an error reply that changes nothing, and the connection goes on. */
Test(server_zc, refusals_are_clear_errors, .fini = teardown)
{
    kvd_start(&d, "--hbm-backend", "host", "--hbm-bytes", "4M", NULL);
    char msg[256];
    zmap_t z;
    /* Before HELLO. */
    int fd = kvd_raw(&d);
    uint8_t mb[8];
    kvt_proto_map_encode(mb, KVT_TIER_DRAM);
    zreply_t r;
    zcall(fd, KVT_OP_MAP, 0, mb, sizeof mb, &r);
    cr_expect_eq(r.h.status, KVT_EPROTO);
    close(fd);
    /* Index-only. */
    fd = kvd_raw(&d);
    cr_assert_eq(zhello(fd, "zc", NULL, 0), 0);
    cr_expect_eq(zmap_tier(fd, KVT_TIER_DRAM, &z, msg), KVT_EINVAL);
    cr_expect(strstr(msg, "index-only"), "%s", msg);
    close(fd);

    fd = zconn(&d, "zc", NULL);
    cr_expect_eq(zmap_tier(fd, 3, &z, msg), KVT_EINVAL);
    cr_expect_eq(zmap_tier(fd, KVT_TIER_HBM, &z, msg), KVT_EUNAVAIL);
    cr_expect(strstr(msg, "hbm-ipc"), "%s", msg);
    /* RESERVE before MAP, and malformed. */
    uint32_t t[2 * PAGE];
    kvd_tokens(t, 2 * PAGE, 3000);
    kvt_proto_reserve_reply_t rr;
    uint32_t page[4];
    uint64_t off[4];
    cr_expect_eq(zreserve(fd, t, 2 * PAGE, 0, 1, &rr, page, off, &r), KVT_EINVAL);
    cr_expect(strstr((char *)r.body, "MAP"), "%s", r.body);
    cr_assert_eq(zmap_tier(fd, KVT_TIER_DRAM, &z, NULL), 0);
    cr_expect_eq(zreserve(fd, t, 2 * PAGE, 0, 0, &rr, page, off, &r), KVT_EINVAL);
    cr_expect_eq(zreserve(fd, t, 2 * PAGE, 1, 2, &rr, page, off, &r), KVT_EINVAL);
    cr_expect(strstr((char *)r.body, "past"), "%s", r.body);
    zcall(fd, KVT_OP_MAP, 0, mb, 7, &r);
    cr_expect_eq(r.h.status, KVT_EPROTO);
    uint8_t cb[20] = {0};
    zcall(fd, KVT_OP_COMMIT, 0x4, cb, 8, &r);
    cr_expect_eq(r.h.status, KVT_EPROTO);
    cr_expect(strstr((char *)r.body, "flag"), "%s", r.body);
    zcall(fd, KVT_OP_COMMIT, 0, cb, 9, &r);
    cr_expect_eq(r.h.status, KVT_EPROTO);
    zcall(fd, KVT_OP_COMMIT, KVT_COMMIT_F_SUMS, cb, 8, &r); /* the flag without a sum */
    cr_expect_eq(r.h.status, KVT_EPROTO);
    zcall(fd, KVT_OP_COMMIT, KVT_COMMIT_F_SUMS, cb, 20, &r); /* half a sum */
    cr_expect_eq(r.h.status, KVT_EPROTO);
    uint8_t gb[sizeof(kvt_wire_get_t)] = {0};
    zcall(fd, KVT_OP_GET, 0x2, gb, sizeof gb, &r);
    cr_expect_eq(r.h.status, KVT_EPROTO);
    /* Two MAPs in one write: the first reply holds a descriptor until it is read, and a
     * connection holds one at a time (a client that never reads cannot pile them up). */
    uint8_t two[2 * (KVT_PROTO_HDR + sizeof mb)];
    for (int i = 0; i < 2; i++) {
        kvt_proto_hdr_t hh = {.magic = KVT_PROTO_MAGIC,
                              .version = KVT_PROTO_VERSION,
                              .opcode = KVT_OP_MAP,
                              .request_id = 500 + (uint64_t)i,
                              .body_len = sizeof mb};
        kvt_proto_hdr_encode(two + i * (KVT_PROTO_HDR + sizeof mb), &hh);
        memcpy(two + i * (KVT_PROTO_HDR + sizeof mb) + KVT_PROTO_HDR, mb, sizeof mb);
    }
    cr_assert_eq(write(fd, two, sizeof two), (ssize_t)sizeof two);
    zrecv(fd, &r);
    cr_expect(r.h.request_id == 500 && r.h.status == 0 && r.fd >= 0);
    if (r.fd >= 0)
        close(r.fd);
    zrecv(fd, &r);
    cr_expect(r.h.request_id == 501 && r.h.status == KVT_EAGAIN && r.fd < 0, "status %d",
              r.h.status);
    zmap_t z2;
    cr_expect_eq(zmap_tier(fd, KVT_TIER_DRAM, &z2, NULL), 0, "a MAP after the reply was read");
    zunmap(&z2);
    /* Nothing changed, and the connection still works. */
    zcall(fd, KVT_OP_PING, 0, "hi", 2, &r);
    cr_expect(r.h.status == 0 && r.h.body_len == 2);
    zunmap(&z);
    close(fd);

    /* The host stand-in for HBM has no device memory to export. */
    kvd_stop(&d);
    kvd_start(&d, "--hbm-backend", "host", "--hbm-bytes", "4M", "--hbm-ipc", "yes", NULL);
    fd = zconn(&d, "zc", NULL);
    cr_expect_eq(zmap_tier(fd, KVT_TIER_HBM, &z, msg), KVT_EUNAVAIL);
    cr_expect(strstr(msg, "host"), "%s", msg);
    close(fd);

    /* Zero-copy off. */
    kvd_stop(&d);
    kvd_start(&d, "--zero-copy", "no", NULL);
    fd = zconn(&d, "zc", NULL);
    cr_expect_eq(zmap_tier(fd, KVT_TIER_DRAM, &z, msg), KVT_EUNAVAIL);
    close(fd);
}

/* Over TCP a mapping means nothing: refused. */
Test(server_zc, tcp_is_refused, .fini = teardown)
{
    kvd_start(&d, NULL);
    char host[64];
    unsigned port;
    cr_assert_eq(sscanf(d.tcp, "%63[^:]:%u", host, &port), 2);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sin = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    inet_pton(AF_INET, host, &sin.sin_addr);
    cr_assert_eq(connect(fd, (struct sockaddr *)&sin, sizeof sin), 0);
    cr_assert_eq(zhello(fd, "zc", NULL, BB), 0);
    char msg[256];
    zmap_t z;
    cr_expect_eq(zmap_tier(fd, KVT_TIER_DRAM, &z, msg), KVT_EINVAL);
    cr_expect(strstr(msg, "Unix socket"), "%s", msg);
    close(fd);
}

/* A lease holds a located page in place: pages pushed through DRAM by another client while it
 * holds the lease do not move it, and its bytes stay. */
Test(server_zc, lease_holds_located_bytes_in_place, .fini = teardown)
{
    kvd_start(&d, "--dram-bytes", "2M", "--nvme-bytes", "64M", "--nvme-segment-bytes", "4M", NULL);
    int fd = zconn(&d, "zc", NULL);
    zmap_t z;
    cr_assert_eq(zmap_tier(fd, KVT_TIER_DRAM, &z, NULL), 0);
    uint32_t t[PAGE];
    kvd_tokens(t, PAGE, 7000);
    kvt_proto_reserve_reply_t rr;
    uint32_t page[1];
    uint64_t off[1];
    zreply_t r;
    cr_assert_eq(zreserve(fd, t, PAGE, 0, 1, &rr, page, off, &r), 0);
    cr_assert_eq(rr.nlocs, 1);
    pattern(z.base + off[0], 77);
    kvt_proto_put_reply_t p;
    cr_assert_eq(zcommit(fd, rr.resv, 0, &p), 0);
    uint32_t pages, left;
    uint64_t lease = zmatch(fd, t, PAGE, &pages, NULL), loc[1];
    cr_assert_eq(zget_locate(fd, lease, 1, loc, &left), 0);
    cr_assert_eq(loc[0], off[0]);

    /* 64 pages of 64 KiB through a 2 MiB DRAM tier: everything unleased is demoted. */
    kvt_client_t *c = zclient(&d, NULL);
    uint8_t *pay = malloc(BB);
    for (uint32_t i = 0; i < 64; i++) {
        uint32_t u[PAGE];
        kvd_tokens(u, PAGE, 10000 + 100 * i);
        kvd_fill(pay, BB, 1000 + i);
        kvt_client_put_t pr;
        cr_assert_eq(kvt_client_put(c, u, PAGE, 0, 1, pay, NULL, &pr), 0);
    }
    cr_assert_gt(kvd_stat(c, "blocks_moved_dram_nvme"), 0, "nothing was demoted");
    uint8_t *want = malloc(BB);
    pattern(want, 77);
    cr_expect(memcmp(z.base + off[0], want, BB) == 0, "a leased page's bytes changed");
    cr_expect_eq(zget_locate(fd, lease, 1, loc, &left), 0);
    cr_expect_eq(loc[0], off[0], "a leased page moved");
    zrelease(fd, lease);
    free(pay);
    free(want);
    kvt_client_close(c);
    zunmap(&z);
    close(fd);
}

/* ---- Memory a client can touch, and slots and gauges that must not go stale (issue 36) ---- */

static uint64_t mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

/* The bytes the memfd holds in memory, whoever maps it. */
static uint64_t memfd_resident(int fd)
{
    struct stat st;
    cr_assert_eq(fstat(fd, &st), 0);
    return (uint64_t)st.st_blocks * 512;
}

/* Waits (up to ms) for the memfd to hold at most max bytes; returns how long it took, or
 * UINT64_MAX when it did not come down. */
static uint64_t wait_resident(int fd, uint64_t max, uint64_t ms)
{
    uint64_t t0 = mono_ms();
    while (memfd_resident(fd) > max) {
        if (mono_ms() - t0 > ms)
            return UINT64_MAX;
        usleep(20000);
    }
    return mono_ms() - t0;
}

/* Reserves, writes (pattern seed) and commits page 0 of t through the mapping; its offset. */
static uint64_t zstore_one(int fd, zmap_t *z, const uint32_t *t, uint32_t seed)
{
    kvt_proto_reserve_reply_t rr;
    uint32_t page[1];
    uint64_t off[1];
    zreply_t r;
    cr_assert_eq(zreserve(fd, t, PAGE, 0, 1, &rr, page, off, &r), 0, "RESERVE: %s", r.body);
    cr_assert_eq(rr.nlocs, 1);
    pattern(z_late(z, off[0]), seed);
    kvt_proto_put_reply_t p;
    cr_assert_eq(zcommit(fd, rr.resv, 0, &p), 0);
    cr_assert_eq(p.stored, 1);
    return off[0];
}

/* Whether c (of the page's namespace) reads page 0 of t from tier with pattern seed. */
static void expect_page_in(kvt_client_t *c, const uint32_t *t, uint32_t seed, uint8_t tier,
                           const char *what)
{
    kvt_client_match_t m = {0};
    uint8_t tiers[1];
    m.tiers = tiers;
    m.tiers_cap = 1;
    cr_assert_eq(kvt_client_match(c, t, PAGE, KVT_CLIENT_LEASE, 0, NULL, &m), 0);
    cr_assert_eq(m.pages, 1, "%s: not in the index", what);
    cr_expect_eq(tiers[0], tier, "%s: in tier %u", what, tiers[0]);
    uint8_t *got = malloc(BB), *want = malloc(BB);
    cr_assert_eq(kvt_client_get(c, m.lease, 0, 1, got, BB, NULL, NULL), 0);
    pattern(want, seed);
    cr_expect(memcmp(got, want, BB) == 0, "%s: bytes changed", what);
    kvt_client_release(c, m.lease, NULL);
    free(got);
    free(want);
}

static void expect_page(kvt_client_t *c, const uint32_t *t, uint32_t seed, const char *what)
{
    expect_page_in(c, t, seed, KVT_CLIENT_TIER_DRAM, what);
}

/* Whether page 0 of the lease's path is still located at off in the DRAM mapping. */
static int located_at(int fd, uint64_t lease, uint64_t off)
{
    uint64_t loc[1];
    uint32_t left;
    return zget_locate(fd, lease, 1, loc, &left) == 0 && loc[0] == off;
}

/* Starts kvtierd with 1 MiB of HBM (host memory) over 2 MiB of DRAM and no NVMe, leases of
 * lease_ms, promote-keep-share keep (0: a promotion out of DRAM under a lease is refused and
 * parked), and maps the DRAM of a zero-copy connection into z; the connection. */
static int hbm_over_dram(zmap_t *z, const char *lease_ms, const char *keep)
{
    char conf[700];
    const char *flag = "--promote-keep-share", *value = keep;
    if (!keep) { /* 0, from a config file that a reload reads again (a flag would win) */
        kvd_mkdir(&d);
        kvd_write_conf(&d, "promote-keep-share = 0\n", conf, sizeof conf);
        flag = "--config";
        value = conf;
    }
    kvd_start(&d, "--hbm-backend", "host", "--hbm-bytes", "1M", "--dram-bytes", "2M",
              "--nvme-bytes", "0", "--lease-ms", lease_ms, flag, value, NULL);
    int fd = zconn(&d, "zc", NULL);
    cr_assert_eq(zmap_tier(fd, KVT_TIER_DRAM, z, NULL), 0);
    return fd;
}

/* With no room to keep old copies (promote-keep-share 0), a promotion into HBM leaves a page a
 * lease holds in the DRAM mapping: neither the promotion its MATCH queued nor a PREFETCH up to
 * HBM moves it, since the switch would free its DRAM copy under the reader, and pages reserved
 * next land in DRAM that is free. Once the lease is released, a PREFETCH moves it. */
Test(server_zc, promotion_waits_for_a_zero_copy_reader, .fini = teardown)
{
    zmap_t z;
    int fd = hbm_over_dram(&z, "30000", "0");
    uint32_t t[PAGE], pages;
    kvd_tokens(t, PAGE, 7100);
    uint64_t off = zstore_one(fd, &z, t, 78);
    uint64_t lease = zmatch(fd, t, PAGE, &pages, NULL);
    cr_assert_eq(pages, 1);
    cr_assert(located_at(fd, lease, off), "not located where it was written");

    kvt_client_t *c = zclient(&d, NULL);
    kvt_client_prefetch_t pf;
    cr_assert_eq(kvt_client_prefetch(c, t, PAGE, KVT_CLIENT_TIER_HBM, 5000, &pf), 0);
    cr_expect_eq(pf.moved + pf.resident, 0, "promoted under its reader: moved %u resident %u",
                 pf.moved, pf.resident);
    cr_expect_eq(pf.failed, 1, "a refused page not answered failed"); /* docs/protocol.md */
    for (uint32_t i = 0; i < 16; i++) {
        uint32_t u[PAGE];
        kvd_tokens(u, PAGE, 20000 + 100 * i);
        zstore_one(fd, &z, u, 300 + i);
    }
    uint8_t *want = malloc(BB);
    pattern(want, 78);
    cr_expect(memcmp(z.base + off, want, BB) == 0, "a leased page's bytes changed");
    cr_expect(located_at(fd, lease, off), "a leased page moved");
    zrelease(fd, lease);

    cr_assert_eq(kvt_client_prefetch(c, t, PAGE, KVT_CLIENT_TIER_HBM, 5000, &pf), 0);
    cr_expect_eq(pf.moved + pf.resident, 1, "not promoted once released: failed %u", pf.failed);
    free(want);
    kvt_client_close(c);
    zunmap(&z);
    close(fd);
}

/* An engine's MATCH, with a lease, of a page fd wrote through its mapping into DRAM: the
 * promotion into HBM it queues is refused while the lease holds the page (a STATS after the
 * lease's GET sees it, after the step that followed the MATCH), and the page stays where the
 * lease's LOCATE put it. Returns the lease. */
static uint64_t leased_in_dram(int fd, zmap_t *z, kvt_client_t *c, const uint32_t *t, uint32_t seed)
{
    uint64_t off = zstore_one(fd, z, t, seed);
    uint32_t pages;
    uint64_t lease = zmatch(fd, t, PAGE, &pages, NULL);
    cr_assert_eq(pages, 1);
    cr_assert(located_at(fd, lease, off), "not located where it was written");
    cr_expect_eq(kvd_stat(c, "hbm_blocks"), 0, "promoted under its lease");
    cr_expect(located_at(fd, lease, off), "a leased page moved");
    return lease;
}

/* Once the lease has gone, the page reaches HBM with no MATCH or PREFETCH after it: the
 * promotion refused under the lease was parked and runs again. */
static void promoted_once_free(kvt_client_t *c, const uint32_t *t, uint32_t seed, const char *how)
{
    cr_expect_eq(wait_stat(c, "hbm_blocks", 1), 1, "not promoted after the lease's %s", how);
    cr_expect_eq(kvd_stat(c, "dram_blocks"), 0);
    expect_page_in(c, t, seed, KVT_CLIENT_TIER_HBM, how);
}

/* How the lease of leased_in_dram ends. */
typedef enum { BY_RELEASE, BY_EXPIRY, BY_CLOSE } lease_end_t;

/* Ends fd's lease how (an expiry is waited for) and unmaps z; BY_CLOSE closes fd. */
static void end_lease(int fd, zmap_t *z, kvt_client_t *c, uint64_t lease, lease_end_t how)
{
    if (how == BY_RELEASE)
        zrelease(fd, lease);
    if (how == BY_EXPIRY)
        cr_assert_eq(wait_stat(c, "leases_expired", 1), 1, "the lease did not expire");
    zunmap(z);
    if (how == BY_CLOSE)
        close(fd);
}

/* An engine MATCHes every hit with a lease: with no room to keep old copies, the promotion its
 * MATCH queues, refused while that lease holds the page, is made once the lease has gone, however
 * it went. */
static void promoted_after_the_lease(lease_end_t how, uint32_t seed)
{
    static const char *const name[] = {"RELEASE", "expiry", "close"};
    zmap_t z;
    int fd = hbm_over_dram(&z, how == BY_EXPIRY ? "1000" : "30000", "0");
    kvt_client_t *c = zclient(&d, NULL);
    uint32_t t[PAGE];
    kvd_tokens(t, PAGE, 100 * seed);
    uint64_t lease = leased_in_dram(fd, &z, c, t, seed);
    end_lease(fd, &z, c, lease, how);
    promoted_once_free(c, t, seed, name[how]);
    if (how != BY_CLOSE)
        close(fd);
    kvt_client_close(c);
}

Test(server_zc, a_promotion_refused_for_a_lease_runs_after_its_release, .fini = teardown)
{
    promoted_after_the_lease(BY_RELEASE, 81);
}

Test(server_zc, a_promotion_refused_for_a_lease_runs_after_its_expiry, .fini = teardown)
{
    promoted_after_the_lease(BY_EXPIRY, 82);
}

Test(server_zc, a_promotion_refused_for_a_lease_runs_after_its_connection_closed, .fini = teardown)
{
    promoted_after_the_lease(BY_CLOSE, 83);
}

/* An engine MATCHes a hot leased page at every step: while its parked promotion (no room to
 * keep old copies) waits for the first lease, those MATCHes queue promotions that start no move
 * for the executor to refuse (its refusals are what the policy parks: still one), and the page
 * reaches HBM once the lease is released. */
Test(server_zc, a_parked_promotion_is_not_started_again_while_its_lease_holds, .fini = teardown)
{
    zmap_t z;
    int fd = hbm_over_dram(&z, "30000", "0");
    kvt_client_t *c = zclient(&d, NULL);
    uint32_t t[PAGE], pages;
    kvd_tokens(t, PAGE, 8400);
    uint64_t lease = leased_in_dram(fd, &z, c, t, 84);
    cr_assert_eq(kvd_stat(c, "policy_parked"), 1);
    for (int i = 0; i < 3; i++)
        zrelease(fd, zmatch(fd, t, PAGE, &pages, NULL));
    uint64_t parked = kvd_stat(c, "policy_parked");
    cr_expect_eq(parked, 1, "started again under the lease: %llu refusals parked",
                 (unsigned long long)parked);
    cr_expect_eq(kvd_stat(c, "policy_park_waits"), 3);
    cr_expect_eq(kvd_stat(c, "hbm_blocks"), 0);
    zrelease(fd, lease);
    zunmap(&z);
    promoted_once_free(c, t, 84, "RELEASE");
    close(fd);
    kvt_client_close(c);
}

/* Starts kvtierd as hbm_over_dram does (leases of 30 s, no room to keep old copies) but with LRU
 * and no watermarks below the tiers' capacity, so that nothing moves out of HBM before it is
 * full. The connection. */
static int hbm_kept_full(zmap_t *z)
{
    kvd_start(&d, "--hbm-backend", "host", "--hbm-bytes", "1M", "--dram-bytes", "2M",
              "--nvme-bytes", "0", "--lease-ms", "30000", "--promote-keep-share", "0", "--policy",
              "lru", "--policy-high", "1", "--policy-low", "1", NULL);
    int fd = zconn(&d, "zc", NULL);
    cr_assert_eq(zmap_tier(fd, KVT_TIER_DRAM, z, NULL), 0);
    return fd;
}

/* Fills the 16 pages of HBM with pages fd writes into DRAM and c PREFETCHes up. */
static void fill_hbm(int fd, zmap_t *z, kvt_client_t *c)
{
    for (uint32_t i = 0; i < 16; i++) {
        uint32_t u[PAGE];
        kvt_client_prefetch_t pf;
        kvd_tokens(u, PAGE, 40000 + 100 * i);
        zstore_one(fd, z, u, 400 + i);
        cr_assert_eq(kvt_client_prefetch(c, u, PAGE, KVT_CLIENT_TIER_HBM, 5000, &pf), 0);
        cr_assert_eq(pf.moved, 1, "page %u not PREFETCHed into HBM", i);
    }
    cr_assert_eq(kvd_stat(c, "hbm_blocks"), 16);
}

/* fd's lease on page 0 of t (seed) ends with HBM full: the page reaches HBM with no MATCH after,
 * one page moved out for it and no other. */
static void promoted_into_full_hbm(int fd, zmap_t *z, kvt_client_t *c, uint64_t lease,
                                   const uint32_t *t, uint32_t seed)
{
    uint64_t up = kvd_stat(c, "blocks_moved_dram_hbm");
    zrelease(fd, lease);
    zunmap(z);
    cr_expect_eq(wait_stat(c, "blocks_moved_dram_hbm", up + 1), up + 1,
                 "not promoted once its room landed");
    cr_expect_eq(kvd_stat(c, "blocks_moved_hbm_dram"), 1, "more room made than it needed");
    cr_expect_eq(kvd_stat(c, "hbm_blocks"), 16);
    expect_page_in(c, t, seed, KVT_CLIENT_TIER_HBM, "RELEASE");
    close(fd);
    kvt_client_close(c);
}

/* A parked promotion queued again once its lease went, into an HBM that filled up meanwhile,
 * makes room by moving one page out, and is made once that move landed; the room on its way
 * meanwhile moves no other page out. Before, it made the room and was dropped. */
Test(server_zc, a_parked_promotion_into_a_full_hbm_runs_once_its_room_lands, .fini = teardown)
{
    zmap_t z;
    int fd = hbm_kept_full(&z);
    kvt_client_t *c = zclient(&d, NULL);
    uint32_t t[PAGE];
    kvd_tokens(t, PAGE, 9100);
    uint64_t lease = leased_in_dram(fd, &z, c, t, 91);
    cr_assert_eq(kvd_stat(c, "policy_parked"), 1);
    fill_hbm(fd, &z, c);
    promoted_into_full_hbm(fd, &z, c, lease, t, 91);
}

/* The promotion a leased MATCH queues into a full HBM makes room, waits for it, is refused under
 * the lease then (parked), and is made after the RELEASE. Before, it made the room and was
 * dropped: never refused, so never parked. */
Test(server_zc, a_leased_match_into_a_full_hbm_is_promoted_after_its_release, .fini = teardown)
{
    zmap_t z;
    int fd = hbm_kept_full(&z);
    kvt_client_t *c = zclient(&d, NULL);
    fill_hbm(fd, &z, c);
    uint32_t t[PAGE], pages;
    kvd_tokens(t, PAGE, 9200);
    zstore_one(fd, &z, t, 92);
    uint64_t lease = zmatch(fd, t, PAGE, &pages, NULL);
    cr_assert_eq(pages, 1);
    cr_expect_eq(wait_stat(c, "policy_parked", 1), 1, "not refused once its room landed");
    cr_expect_eq(kvd_stat(c, "hbm_blocks"), 15);
    promoted_into_full_hbm(fd, &z, c, lease, t, 92);
}

/* ---- Promotions under a lease, their old DRAM copy kept (exec.c, "Kept copies") ---- */

/* Waits (up to 10 s) for a STATS gauge to come down to want. */
static uint64_t wait_stat_down(kvt_client_t *c, const char *name, uint64_t want)
{
    uint64_t v = 0;
    for (int i = 0; i < 1000 && (v = kvd_stat(c, name)) > want; i++)
        usleep(10000);
    return v;
}

/* An engine's requests overlap on a shared prefix: each MATCHes it with a lease before the one
 * before releases, so a lease holds it at every moment. It reaches HBM all the same, its old
 * DRAM copy kept for the leases taken before the switch, and freed once the last of them went. */
Test(server_zc, a_prefix_leased_without_a_break_reaches_hbm, .fini = teardown)
{
    zmap_t z;
    int fd = hbm_over_dram(&z, "30000", "0.25");
    kvt_client_t *c = zclient(&d, NULL);
    uint32_t t[PAGE], pages;
    kvd_tokens(t, PAGE, 8500);
    zstore_one(fd, &z, t, 85);
    uint64_t held = zmatch(fd, t, PAGE, &pages, NULL);
    cr_assert_eq(pages, 1);
    for (int i = 0; i < 1000 && kvd_stat(c, "hbm_blocks") == 0; i++) {
        uint64_t next = zmatch(fd, t, PAGE, &pages, NULL);
        zrelease(fd, held);
        held = next;
        usleep(10000);
    }
    cr_assert_eq(kvd_stat(c, "hbm_blocks"), 1, "not promoted while leased without a break");
    cr_expect_eq(kvd_stat(c, "leased_promotions"), 1);
    cr_expect_eq(kvd_stat(c, "policy_parked"), 0);
    zrelease(fd, held);
    cr_expect_eq(wait_stat_down(c, "leased_promotion_copies", 0), 0, "the old copy stayed");
    cr_expect_eq(kvd_stat(c, "leased_promotion_copy_bytes"), 0);
    expect_page_in(c, t, 85, KVT_CLIENT_TIER_HBM, "promoted");
    zunmap(&z);
    close(fd);
    kvt_client_close(c);
}

/* A zero-copy reader's lease, located in DRAM, sees its page promoted into HBM: the old copy
 * keeps its bytes while other pages are written into DRAM (none lands on it), counts in DRAM's
 * used bytes, and goes once the lease has, however it went. */
static void old_copy_kept_for_the_lease(lease_end_t how, uint32_t seed)
{
    static const char *const name[] = {"RELEASE", "expiry", "close"};
    zmap_t z;
    int fd = hbm_over_dram(&z, how == BY_EXPIRY ? "3000" : "30000", "0.25");
    kvt_client_t *c = zclient(&d, NULL);
    uint32_t t[PAGE], pages;
    kvd_tokens(t, PAGE, 100 * seed);
    uint64_t off = zstore_one(fd, &z, t, seed);
    /* The lease's holder knows where it wrote the page; a GET with LOCATE after the switch would
     * give it the new location. */
    uint64_t lease = zmatch(fd, t, PAGE, &pages, NULL);
    cr_assert_eq(pages, 1);
    cr_assert_eq(wait_stat(c, "hbm_blocks", 1), 1, "not promoted under its lease");
    cr_expect_eq(kvd_stat(c, "dram_blocks"), 1, "the old copy is not in DRAM");
    cr_expect_eq(kvd_stat(c, "leased_promotion_copies"), 1);
    uint64_t kept = kvd_stat(c, "leased_promotion_copy_bytes");
    cr_expect_geq(kept, BB);
    uint8_t *want = malloc(BB);
    pattern(want, seed);
    if (how != BY_EXPIRY) { /* an expiring lease may end while they are written */
        for (uint32_t i = 0; i < 16; i++) {
            uint32_t u[PAGE];
            kvd_tokens(u, PAGE, 100 * seed + 1000 * (i + 1));
            cr_expect_neq(zstore_one(fd, &z, u, seed + 1 + i), off, "reused under its reader");
        }
    }
    cr_expect(memcmp(z.base + off, want, BB) == 0, "the old copy's bytes changed");
    uint64_t used = kvd_stat(c, "dram_used_bytes"), blocks = kvd_stat(c, "dram_blocks");
    end_lease(fd, &z, c, lease, how);
    cr_expect_eq(wait_stat_down(c, "leased_promotion_copies", 0), 0, "kept after the lease's %s",
                 name[how]);
    cr_expect_eq(kvd_stat(c, "leased_promotion_copy_bytes"), 0);
    cr_expect_eq(kvd_stat(c, "dram_used_bytes"), used - kept, "DRAM not given back after %s",
                 name[how]);
    cr_expect_eq(kvd_stat(c, "dram_blocks"), blocks - 1);
    expect_page_in(c, t, seed, KVT_CLIENT_TIER_HBM, name[how]);
    free(want);
    if (how != BY_CLOSE)
        close(fd);
    kvt_client_close(c);
}

Test(server_zc, a_promotion_under_a_lease_keeps_the_old_copy_till_its_release, .fini = teardown)
{
    old_copy_kept_for_the_lease(BY_RELEASE, 86);
}

Test(server_zc, a_promotion_under_a_lease_keeps_the_old_copy_till_its_expiry, .fini = teardown)
{
    old_copy_kept_for_the_lease(BY_EXPIRY, 87);
}

Test(server_zc, a_promotion_under_a_lease_keeps_the_old_copy_till_its_connection_closed,
     .fini = teardown)
{
    old_copy_kept_for_the_lease(BY_CLOSE, 88);
}

/* promote-keep-share bounds the kept copies: with room for one page's (0.04 of 2 MiB), a second
 * leased page's promotion is refused and parked as without any, and made once its lease went. */
Test(server_zc, a_leased_promotion_past_the_keep_share_is_parked, .fini = teardown)
{
    zmap_t z;
    int fd = hbm_over_dram(&z, "30000", "0.04");
    kvt_client_t *c = zclient(&d, NULL);
    uint32_t t[PAGE], u[PAGE], pages;
    kvd_tokens(t, PAGE, 8900);
    kvd_tokens(u, PAGE, 9900);
    zstore_one(fd, &z, t, 89);
    uint64_t first = zmatch(fd, t, PAGE, &pages, NULL);
    cr_assert_eq(wait_stat(c, "hbm_blocks", 1), 1, "the first not promoted under its lease");
    uint64_t off = zstore_one(fd, &z, u, 90);
    uint64_t second = zmatch(fd, u, PAGE, &pages, NULL);
    cr_assert(located_at(fd, second, off), "not located where it was written");
    /* With several loops the leased MATCH is answered shared: the policy hears of its hit at the
     * next write lock (kvt__match_settle), and parks the promotion after that. */
    cr_expect_eq(wait_stat(c, "policy_parked", 1), 1, "past the share, not parked");
    cr_expect_eq(kvd_stat(c, "hbm_blocks"), 1, "promoted under its lease past the share");
    cr_expect_eq(kvd_stat(c, "leased_promotion_copies"), 1);
    zrelease(fd, first);
    cr_expect_eq(wait_stat_down(c, "leased_promotion_copies", 0), 0);
    cr_expect_eq(kvd_stat(c, "hbm_blocks"), 1, "promoted while its lease holds it, past the share");
    zrelease(fd, second);
    cr_expect_eq(wait_stat(c, "hbm_blocks", 2), 2, "not promoted after its lease");
    cr_expect_eq(kvd_stat(c, "leased_promotions"), 1);
    zunmap(&z);
    close(fd);
    kvt_client_close(c);
}

/* The config file says promote-keep-share = share; the reload is the n-th. */
static void reload_share(kvt_client_t *c, const char *share, uint64_t n)
{
    char text[64], conf[700];
    snprintf(text, sizeof text, "promote-keep-share = %s\n", share);
    kvd_write_conf(&d, text, conf, sizeof conf);
    cr_assert_eq(kill(d.pid, SIGHUP), 0);
    cr_assert_eq(wait_stat(c, "config_reloads", n), n, "reload %llu not applied",
                 (unsigned long long)n);
}

/* promote-keep-share changes on a reload (SIGHUP). Raised from 0, a page promoted under its lease
 * keeps its old copy; lowered back to 0, that copy stays until its lease ends (a lowered share
 * frees nothing early), while the next leased page's promotion is refused and parked. */
Test(server_zc, promote_keep_share_changes_on_a_reload, .fini = teardown)
{
    zmap_t z;
    int fd = hbm_over_dram(&z, "30000", NULL);
    kvt_client_t *c = zclient(&d, NULL);
    uint32_t t[PAGE], u[PAGE], pages;
    kvd_tokens(t, PAGE, 9100);
    kvd_tokens(u, PAGE, 9200);
    reload_share(c, "0.25", 1);
    zstore_one(fd, &z, t, 91);
    uint64_t first = zmatch(fd, t, PAGE, &pages, NULL);
    cr_assert_eq(pages, 1);
    cr_assert_eq(wait_stat(c, "hbm_blocks", 1), 1, "not promoted under its lease: share still 0");
    cr_expect_eq(kvd_stat(c, "leased_promotion_copies"), 1);
    reload_share(c, "0", 2);
    zstore_one(fd, &z, u, 92);
    uint64_t second = zmatch(fd, u, PAGE, &pages, NULL);
    cr_assert_eq(pages, 1);
    cr_expect_eq(wait_stat(c, "policy_parked", 1), 1, "share 0 again: not parked");
    cr_expect_eq(kvd_stat(c, "hbm_blocks"), 1, "promoted under its lease at share 0");
    cr_expect_eq(kvd_stat(c, "leased_promotion_copies"), 1, "the kept copy went before its lease");
    zrelease(fd, first);
    cr_expect_eq(wait_stat_down(c, "leased_promotion_copies", 0), 0);
    zrelease(fd, second);
    cr_expect_eq(wait_stat(c, "hbm_blocks", 2), 2, "not promoted after its lease");
    cr_expect_eq(kvd_stat(c, "leased_promotions"), 1);
    cr_expect_eq(kvd_stat(c, "config_reload_failures"), 0);
    zunmap(&z);
    close(fd);
    kvt_client_close(c);
}

/* A client makes its whole memfd resident (fallocate) and writes pages of its mapping where no
 * block is, then leaves: the daemon punches all of it within 2 s, the live block's bytes stay,
 * and the resident gauge shows what the memfd holds. */
Test(server_zc, client_touched_arena_memory_goes_back, .fini = teardown)
{
    kvd_start(&d, "--dram-bytes", "16M", NULL);
    int fd = zconn(&d, "zc", NULL);
    zmap_t z;
    cr_assert_eq(zmap_tier(fd, KVT_TIER_DRAM, &z, NULL), 0);
    uint32_t t[PAGE];
    kvd_tokens(t, PAGE, 12000);
    uint64_t off = zstore_one(fd, &z, t, 55);
    for (uint64_t o = 0; o < (8u << 20); o += 4096)
        if (o + 4096 <= off || o >= off + BB)
            z.base[o] = 1;
    /* The daemon's scan may see the touched pages and punch them while the fallocate runs
     * (88 MB of zeroing, 120 ms at load 10): until the whole memfd is seen resident once, the
     * fallocate goes again. */
    int resident = 0;
    for (int i = 0; i < 50 && !resident; i++) {
        cr_assert_eq(fallocate(z.fd, 0, 0, (off_t)z.bytes), 0, "fallocate: %s", strerror(errno));
        resident = memfd_resident(z.fd) >= z.bytes - BB;
        if (!resident)
            usleep(20000);
    }
    cr_assert(resident, "fallocate made nothing resident");
    int keep = dup(z.fd); /* to watch the memfd after the client left */
    zunmap(&z);
    close(fd);
    uint64_t took = wait_resident(keep, 2 * BB, 2500);
    cr_expect_leq(took, 2000, "the touched memory was not punched within 2 s (%llu bytes left)",
                  (unsigned long long)memfd_resident(keep));
    kvt_client_t *c = zclient(&d, NULL);
    cr_expect_leq(kvd_stat(c, "zero_copy_resident_bytes"), 2 * BB);
    cr_expect_geq(kvd_stat(c, "zero_copy_punched_bytes"), (16u << 20));
    cr_expect_eq(kvd_stat(c, "dram_used_bytes"), BB);
    expect_page(c, t, 55, "the live block");
    kvt_client_close(c);
    close(keep);
}

/* Reservations that expire while their connection stays give DRAM back to other tenants at
 * once, their memory is punched (again after a late write), and their offsets stay unused until
 * the connection commits. */
Test(server_zc, expired_reservations_give_dram_back, .fini = teardown)
{
    kvd_start(&d, "--dram-bytes", "2M", "--reserve-ms", "300", NULL);
    int fd = zconn(&d, "zc", NULL);
    zmap_t z;
    cr_assert_eq(zmap_tier(fd, KVT_TIER_DRAM, &z, NULL), 0);
    uint32_t t[32 * PAGE];
    kvd_tokens(t, 32 * PAGE, 20000);
    kvt_proto_reserve_reply_t rr;
    uint32_t page[32];
    uint64_t off[32];
    zreply_t r;
    cr_assert_eq(zreserve(fd, t, 32 * PAGE, 0, 32, &rr, page, off, &r), 0, "RESERVE: %s", r.body);
    cr_assert_geq(rr.nlocs, 16, "the reservation got %u pages of DRAM", rr.nlocs);
    for (uint32_t i = 0; i < rr.nlocs; i++)
        memset(z_late(&z, off[i]), 0x5a, BB);
    kvt_client_t *c = zclient(&d, NULL);
    cr_assert_eq(kvd_stat(c, "dram_used_bytes"), (uint64_t)rr.nlocs * BB);
    cr_assert_eq(wait_stat(c, "reservations_expired", 1), 1);
    cr_expect_eq(kvd_stat(c, "dram_used_bytes"), 0, "expired reservations still hold DRAM");
    cr_expect_leq(wait_resident(z.fd, BB, 2500), 2000, "the expired room was not punched");

    /* Another tenant's pages all go to DRAM. */
    kvt_client_t *o = zclient(&d, "other-tenant");
    uint32_t u[16 * PAGE];
    kvd_tokens(u, 16 * PAGE, 30000);
    uint8_t *pay = malloc(16 * BB);
    kvd_fill(pay, 16 * BB, 8);
    kvt_client_put_t pr;
    cr_assert_eq(kvt_client_put(o, u, 16 * PAGE, 0, 16, pay, NULL, &pr), 0);
    cr_expect_eq(pr.stored, 16);
    kvt_client_match_t m = {0};
    uint8_t tiers[16];
    m.tiers = tiers;
    m.tiers_cap = 16;
    cr_assert_eq(kvt_client_match(o, u, 16 * PAGE, 0, 0, NULL, &m), 0);
    cr_assert_eq(m.pages, 16);
    for (uint32_t i = 0; i < 16; i++)
        cr_expect_eq(tiers[i], KVT_CLIENT_TIER_DRAM, "page %u went to tier %u", i, tiers[i]);

    /* The slow client writes late: nothing of it lands in the other pages, and it is punched
     * again. */
    for (uint32_t i = 0; i < rr.nlocs; i++)
        memset(z_late(&z, off[i]), 0xee, BB);
    cr_expect_leq(wait_resident(z.fd, BB, 2500), 2000, "the late write was not punched");
    uint8_t *got = malloc(16 * BB);
    cr_assert_eq(kvt_client_match(o, u, 16 * PAGE, KVT_CLIENT_LEASE, 0, NULL, &m), 0);
    cr_assert_eq(kvt_client_get(o, m.lease, 0, 16, got, 16 * BB, NULL, NULL), 0);
    cr_expect(memcmp(got, pay, 16 * BB) == 0, "the late write reached another block");
    kvt_client_release(o, m.lease, NULL);
    kvt_proto_put_reply_t p;
    cr_expect_eq(zcommit(fd, rr.resv, 0, &p), KVT_ENOENT);
    cr_expect_eq(kvd_stat(c, "dram_used_bytes"), 16 * BB);
    free(got);
    free(pay);
    kvt_client_close(o);
    kvt_client_close(c);
    zunmap(&z);
    close(fd);
}

/* max-reserved-bytes bounds one connection's room, expired reservations included: pages past it
 * get no location, and ABORT gives the room back. */
Test(server_zc, max_reserved_bytes_caps_a_connection, .fini = teardown)
{
    kvd_start(&d, "--max-reserved-bytes", "256K", "--reserve-ms", "200", NULL);
    int fd = zconn(&d, "zc", NULL);
    zmap_t z;
    cr_assert_eq(zmap_tier(fd, KVT_TIER_DRAM, &z, NULL), 0);
    uint32_t t[8 * PAGE];
    kvd_tokens(t, 8 * PAGE, 40000);
    kvt_proto_reserve_reply_t rr, r2;
    uint32_t page[8];
    uint64_t off[8];
    zreply_t r;
    cr_assert_eq(zreserve(fd, t, 8 * PAGE, 0, 6, &rr, page, off, &r), 0, "RESERVE: %s", r.body);
    cr_expect_eq(rr.nlocs, 4, "256K of 64K pages: 4 of 6 pages");
    cr_assert_eq(zreserve(fd, t, 8 * PAGE, 6, 2, &r2, page, off, &r), 0);
    cr_expect(r2.nlocs == 0 && r2.resv == 0, "%u pages past the cap", r2.nlocs);
    kvt_proto_put_reply_t p;
    cr_assert_eq(zcommit(fd, rr.resv, KVT_COMMIT_F_ABORT, &p), 0);
    cr_assert_eq(zreserve(fd, t, 8 * PAGE, 6, 2, &r2, page, off, &r), 0);
    cr_expect_eq(r2.nlocs, 2, "the aborted room was not given back");
    /* Expired, its room still counts until the client's COMMIT answers ENOENT. */
    kvt_client_t *c = zclient(&d, NULL);
    cr_assert_eq(wait_stat(c, "reservations_expired", 1), 1);
    cr_assert_eq(zreserve(fd, t, 8 * PAGE, 0, 4, &rr, page, off, &r), 0);
    cr_expect_eq(rr.nlocs, 2, "an expired reservation's room stopped counting");
    cr_expect_eq(zcommit(fd, r2.resv, 0, &p), KVT_ENOENT);
    kvt_proto_reserve_reply_t r3;
    cr_assert_eq(zreserve(fd, t, 8 * PAGE, 6, 2, &r3, page, off, &r), 0);
    cr_expect_eq(r3.nlocs, 2, "the expired room was not given back at its COMMIT");
    kvt_client_close(c);
    zunmap(&z);
    close(fd);
}

/* Arenas whose clients left, one block in each, give way to a newcomer's MAP: their blocks move
 * to the main region (still in DRAM, same bytes), and the arenas go. */
Test(server_zc, departed_clients_arenas_give_way, .fini = teardown)
{
    kvd_start(&d, "--zero-copy-arenas", "2", NULL);
    char salt[2][16] = {"dep-0", "dep-1"};
    uint32_t t[2][PAGE];
    for (int i = 0; i < 2; i++) {
        int fd = zconn(&d, "zc", salt[i]);
        zmap_t z;
        cr_assert_eq(zmap_tier(fd, KVT_TIER_DRAM, &z, NULL), 0);
        kvd_tokens(t[i], PAGE, 50000 + 100 * (uint32_t)i);
        zstore_one(fd, &z, t[i], 60 + (uint32_t)i);
        zunmap(&z);
        close(fd);
    }
    kvt_client_t *c = zclient(&d, NULL);
    cr_assert_eq(kvd_stat(c, "zero_copy_arenas"), 2, "the departed clients' blocks keep them");
    for (int i = 0; i < 2; i++) {
        char nm[16];
        snprintf(nm, sizeof nm, "new-%d", i);
        int fd = zconn(&d, "zc", nm);
        zmap_t z;
        char msg[256];
        cr_assert_eq(zmap_tier(fd, KVT_TIER_DRAM, &z, msg), 0, "newcomer %d: %s", i, msg);
        cr_expect_eq(kvd_stat(c, "zero_copy_arenas"), 2);
        if (i == 1) {
            char again[256];
            int fd2 = zconn(&d, "zc", "new-2");
            zmap_t z2;
            cr_expect_eq(zmap_tier(fd2, KVT_TIER_DRAM, &z2, again), KVT_ENOSPC,
                         "both arenas are mapped now: %s", again);
            close(fd2);
        }
        zunmap(&z);
        /* kept open: the newcomers' arenas are mapped */
        (void)fd;
    }
    for (int i = 0; i < 2; i++) {
        kvt_client_t *o = zclient(&d, salt[i]);
        expect_page(o, t[i], 60 + (uint32_t)i, "a moved block");
        kvt_client_close(o);
    }
    cr_expect_eq(kvd_stat(c, "dram_used_bytes"), 2 * BB);
    kvt_client_close(c);
}

/* The daemon's memfds of arenas, by its /proc links. */
static int memfds_of(pid_t pid)
{
    char dir[64];
    snprintf(dir, sizeof dir, "/proc/%d/fd", (int)pid);
    DIR *dp = opendir(dir);
    cr_assert(dp, "opendir %s: %s", dir, strerror(errno));
    int n = 0;
    struct dirent *e;
    while ((e = readdir(dp))) {
        char path[320], link[256];
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        ssize_t l = readlink(path, link, sizeof link - 1);
        if (l <= 0)
            continue;
        link[l] = 0;
        n += strstr(link, "memfd:kvtier-ns-") != NULL;
    }
    closedir(dp);
    return n;
}

/* kvtier_zero_copy_arenas is the number of memfds the daemon holds, also once arenas go with
 * their last block (not with a connection's close). */
Test(server_zc, arenas_gauge_counts_the_memfds, .fini = teardown)
{
    kvd_start(&d, NULL);
    char salt[3][16] = {"g-0", "g-1", "g-2"};
    uint32_t t[3][PAGE];
    for (int i = 0; i < 3; i++) {
        int fd = zconn(&d, "zc", salt[i]);
        zmap_t z;
        cr_assert_eq(zmap_tier(fd, KVT_TIER_DRAM, &z, NULL), 0);
        kvd_tokens(t[i], PAGE, 60000 + 100 * (uint32_t)i);
        zstore_one(fd, &z, t[i], 70 + (uint32_t)i);
        zunmap(&z);
        close(fd);
    }
    kvt_client_t *c = zclient(&d, NULL);
    cr_expect_eq(kvd_stat(c, "zero_copy_arenas"), 3);
    cr_expect_eq(memfds_of(d.pid), 3);
    for (int i = 0; i < 3; i++) {
        kvt_client_t *o = zclient(&d, salt[i]);
        cr_assert_eq(kvt_client_remove(o, t[i], PAGE), 0);
        kvt_client_close(o);
    }
    for (int i = 0; i < 200 && memfds_of(d.pid) > 0; i++)
        usleep(10000);
    cr_assert_eq(memfds_of(d.pid), 0, "the arenas outlived their blocks");
    cr_expect_eq(kvd_stat(c, "zero_copy_arenas"), 0, "the gauge counts arenas that went");
    int fd = zconn(&d, "zc", "g-new");
    zmap_t z;
    cr_assert_eq(zmap_tier(fd, KVT_TIER_DRAM, &z, NULL), 0);
    cr_expect_eq(kvd_stat(c, "zero_copy_arenas"), 1);
    cr_expect_eq(memfds_of(d.pid), 1);
    zunmap(&z);
    close(fd);
    kvt_client_close(c);
}

/* Reserves, writes and commits pages [0, n) of t (pattern seed + i); their offsets in off. */
static void zstore(int fd, zmap_t *z, const uint32_t *t, uint32_t n, uint32_t seed, uint64_t *off)
{
    kvt_proto_reserve_reply_t rr;
    uint32_t page[8];
    zreply_t r;
    cr_assert_leq(n, 8);
    cr_assert_eq(zreserve(fd, t, n * PAGE, 0, n, &rr, page, off, &r), 0, "RESERVE: %s", r.body);
    cr_assert_eq(rr.nlocs, n);
    for (uint32_t i = 0; i < n; i++)
        pattern(z_late(z, off[i]), seed + i);
    kvt_proto_put_reply_t p;
    cr_assert_eq(zcommit(fd, rr.resv, 0, &p), 0);
    cr_assert_eq(p.stored, n);
}

/* A socket GET of pages [0, n) of t by c: its status, the pages that came (*got) and, for each
 * that came, whether it holds pattern seed + i. */
static int sget(kvt_client_t *c, const uint32_t *t, uint32_t n, uint32_t *got, uint32_t seed,
                int *exact)
{
    uint8_t tiers[8];
    kvt_client_match_t m = {.tiers = tiers, .tiers_cap = 8};
    cr_assert_leq(n, 8);
    cr_assert_eq(kvt_client_match(c, t, n * PAGE, KVT_CLIENT_LEASE, 0, NULL, &m), 0);
    uint32_t held = 0; /* the pages that hold bytes, up to the first index-only one */
    while (held < m.pages && tiers[held] != KVT_CLIENT_TIER_NONE)
        held++;
    uint8_t *buf = calloc(n, BB), *want = malloc(BB);
    *got = 0;
    int rc = held ? kvt_client_get(c, m.lease, 0, held, buf, (size_t)held * BB, got, NULL)
                  : KVT_CLIENT_ENOENT;
    for (uint32_t i = 0; i < *got; i++) {
        pattern(want, seed + i);
        exact[i] = memcmp(buf + (size_t)i * BB, want, BB) == 0;
    }
    if (m.lease)
        kvt_client_release(c, m.lease, NULL);
    free(buf);
    free(want);
    return rc;
}

/* Scribbles (issue 36): a client writes over a page it committed. A socket GET never carries
 * the scribbled bytes (the page is lost, as a corrupt read is: the GET stops before it), a
 * demotion never writes them to NVMe (the page is dropped instead), and the counter says so.
 * Each scribble comes after a later request's reply: the daemon seals a COMMIT's pages in the
 * loop iteration after its reply, a slice of 256 KiB, more than the test's pages. */
Test(server_zc, scribbled_pages_are_never_served_nor_demoted, .fini = teardown)
{
    kvd_start(&d, "--dram-bytes", "1M", "--policy", "lru", NULL);
    int fd = zconn(&d, "zc", NULL);
    zmap_t z;
    cr_assert_eq(zmap_tier(fd, KVT_TIER_DRAM, &z, NULL), 0);
    kvt_client_t *c = zclient(&d, NULL);
    uint32_t a[2 * PAGE], b[PAGE];
    kvd_tokens(a, 2 * PAGE, 40000);
    kvd_tokens(b, PAGE, 41000);
    uint64_t offa[2], offb[1];
    zstore(fd, &z, a, 2, 70, offa);
    zstore(fd, &z, b, 1, 80, offb);

    /* One byte of page 1 of a changes after its COMMIT: the GET sends page 0 and stops. */
    z.base[offa[1] + 1000] ^= 0x5a;
    uint32_t got;
    int exact[2] = {0, 0};
    int rc = sget(c, a, 2, &got, 70, exact);
    cr_expect_neq(rc, 0, "the GET of a scribbled page succeeded");
    cr_expect_leq(got, 1, "the scribbled page was served");
    for (uint32_t i = 0; i < got; i++)
        cr_expect(exact[i], "page %u came back wrong", i);
    cr_expect_eq(kvd_stat(c, "zero_copy_scribbles"), 1);
    cr_expect_eq(sget(c, a, 2, &got, 70, exact), 0);
    cr_expect_eq(got, 1, "the scribbled page is still stored");
    cr_expect(exact[0]);

    /* b is scribbled, then pushed out of DRAM by 32 pages of another tenant's: its demotion
     * finds the change, and b is dropped, not written to NVMe. */
    z.base[offb[0]] ^= 1;
    kvt_client_t *o = zclient(&d, "pressure");
    uint32_t u[32 * PAGE];
    kvd_tokens(u, 32 * PAGE, 42000);
    uint8_t *pay = malloc(32 * BB);
    kvd_fill(pay, 32 * BB, 9);
    kvt_client_put_t pr;
    cr_assert_eq(kvt_client_put(o, u, 32 * PAGE, 0, 32, pay, NULL, &pr), 0);
    cr_expect_eq(wait_stat(c, "zero_copy_scribbles", 2), 2, "the demotion did not check b");
    uint8_t tier = KVT_CLIENT_TIER_DRAM;
    kvt_client_match_t m = {.tiers = &tier, .tiers_cap = 1};
    for (int i = 0; i < 500; i++) {
        cr_assert_eq(kvt_client_match(c, b, PAGE, 0, 0, NULL, &m), 0);
        if (m.pages == 0 || tier == KVT_CLIENT_TIER_NONE)
            break;
        usleep(10000);
    }
    cr_expect(m.pages == 0 || tier == KVT_CLIENT_TIER_NONE,
              "the scribbled page is still stored, in tier %u", tier);
    cr_expect_gt(wait_stat(c, "blocks_moved_dram_nvme", 1), 0, "nothing was demoted at all");
    free(pay);
    kvt_client_close(o);
    kvt_client_close(c);
    zunmap(&z);
    close(fd);
}

/* zero-copy-checksum no: no checksum is taken, and a scribbled page is served as it is now (the
 * behaviour before issue 36, for a deployment that trusts its clients' own mappings). */
Test(server_zc, scribble_check_can_be_turned_off, .fini = teardown)
{
    kvd_start(&d, "--zero-copy-checksum", "no", NULL);
    int fd = zconn(&d, "zc", NULL);
    zmap_t z;
    cr_assert_eq(zmap_tier(fd, KVT_TIER_DRAM, &z, NULL), 0);
    kvt_client_t *c = zclient(&d, NULL);
    uint32_t a[2 * PAGE];
    kvd_tokens(a, 2 * PAGE, 43000);
    uint64_t off[2];
    zstore(fd, &z, a, 2, 90, off);
    z.base[off[1] + 7] ^= 0x5a;
    uint32_t got;
    int exact[2] = {0, 0};
    cr_expect_eq(sget(c, a, 2, &got, 90, exact), 0);
    cr_expect_eq(got, 2);
    cr_expect(exact[0] && !exact[1], "page 1 should carry the scribbled byte");
    cr_expect_eq(kvd_stat(c, "zero_copy_scribbles"), 0);
    kvt_client_close(c);
    zunmap(&z);
    close(fd);
}

/* COMMIT with the SUMS flag: the reservation, then n checksums (little-endian u64 each). */
static int zcommit_sums(int fd, uint64_t resv, const uint64_t *sums, uint32_t n,
                        kvt_proto_put_reply_t *p, zreply_t *r)
{
    uint8_t b[8 + 8 * 8];
    cr_assert_leq(n, 8);
    kvt_proto_commit_encode(b, resv);
    for (uint32_t i = 0; i < n; i++)
        kvt_put_u64(b + 8 + 8 * i, sums[i]);
    zcall(fd, KVT_OP_COMMIT, KVT_COMMIT_F_SUMS, b, 8 + 8 * n, r);
    if (r->h.status == 0)
        cr_assert_eq(kvt_proto_put_reply_decode(r->body, r->h.body_len, p), 0);
    return r->h.status;
}

/* Reserves pages [0, n) of t and writes pattern seed + i in each; the reply in *rr, offsets in
 * off, and each page's XXH3-64 in sum. */
static void zwrite(int fd, zmap_t *z, const uint32_t *t, uint32_t n, uint32_t seed,
                   kvt_proto_reserve_reply_t *rr, uint64_t *off, uint64_t *sum)
{
    uint32_t page[8];
    zreply_t r;
    cr_assert_leq(n, 8);
    cr_assert_eq(zreserve(fd, t, n * PAGE, 0, n, rr, page, off, &r), 0, "RESERVE: %s", r.body);
    cr_assert_eq(rr->nlocs, n);
    for (uint32_t i = 0; i < n; i++) {
        pattern(z_late(z, off[i]), seed + i);
        sum[i] = XXH3_64bits(z_late(z, off[i]), BB);
    }
}

/* Sums a client sent with COMMIT (libkvtier hashes each page as it copies it in) are the seal:
 * the daemon reads nothing, and a scribble after COMMIT is still found as the page leaves. */
Test(server_zc, client_sums_seal_the_pages, .fini = teardown)
{
    kvd_start(&d, NULL);
    int fd = zconn(&d, "zc", NULL);
    zmap_t z;
    cr_assert_eq(zmap_tier(fd, KVT_TIER_DRAM, &z, NULL), 0);
    kvt_client_t *c = zclient(&d, NULL);
    uint32_t a[2 * PAGE];
    kvd_tokens(a, 2 * PAGE, 44000);
    kvt_proto_reserve_reply_t rr;
    uint64_t off[2], sum[2];
    zwrite(fd, &z, a, 2, 100, &rr, off, sum);
    cr_expect(rr.flags & KVT_RESV_F_SEAL, "RESERVE's reply should say COMMIT seals (flags %u)",
              rr.flags);
    kvt_proto_put_reply_t p;
    zreply_t r;
    cr_assert_eq(zcommit_sums(fd, rr.resv, sum, 2, &p, &r), 0, "COMMIT: %s", r.body);
    cr_expect_eq(p.stored, 2);
    cr_expect_eq(kvd_stat(c, "zero_copy_client_sums"), 2);
    cr_expect_eq(kvd_stat(c, "zero_copy_seals"), 0, "the daemon hashed pages it had sums of");
    /* Right after the reply: nothing is left for the daemon to seal, so nothing is sealed in. */
    z.base[off[1] + 4095] ^= 0x11;
    uint32_t got;
    int exact[2] = {0, 0};
    cr_expect_neq(sget(c, a, 2, &got, 100, exact), 0, "the GET of a scribbled page succeeded");
    cr_expect_eq(got, 1, "page 0 should come, page 1 not");
    cr_expect(exact[0], "page 0 came back wrong");
    cr_expect_eq(kvd_stat(c, "zero_copy_scribbles"), 1);
    kvt_client_close(c);
    zunmap(&z);
    close(fd);
}

/* A wrong sum is the client's word against its own page: the page fails its first check, as a
 * scribbled one does, and is dropped (counted), never served through the socket or demoted. */
Test(server_zc, wrong_client_sums_drop_the_page, .fini = teardown)
{
    kvd_start(&d, "--dram-bytes", "1M", "--policy", "lru", NULL);
    int fd = zconn(&d, "zc", NULL);
    zmap_t z;
    cr_assert_eq(zmap_tier(fd, KVT_TIER_DRAM, &z, NULL), 0);
    kvt_client_t *c = zclient(&d, NULL);
    uint32_t a[2 * PAGE], b[PAGE];
    kvd_tokens(a, 2 * PAGE, 45000);
    kvd_tokens(b, PAGE, 46000);
    kvt_proto_reserve_reply_t rr;
    uint64_t off[2], sum[2];
    kvt_proto_put_reply_t p;
    zreply_t r;
    zwrite(fd, &z, a, 2, 110, &rr, off, sum);
    sum[1] ^= 1;
    cr_assert_eq(zcommit_sums(fd, rr.resv, sum, 2, &p, &r), 0, "COMMIT: %s", r.body);
    cr_expect_eq(p.stored, 2);
    uint32_t got;
    int exact[2] = {0, 0};
    cr_expect_neq(sget(c, a, 2, &got, 110, exact), 0, "a page with a wrong sum was served");
    cr_expect_eq(got, 1);
    cr_expect(exact[0]);
    cr_expect_eq(kvd_stat(c, "zero_copy_scribbles"), 1);

    /* b's sum is wrong too; 32 pages of another tenant push it out of DRAM: not demoted. */
    zwrite(fd, &z, b, 1, 120, &rr, off, sum);
    sum[0] = ~sum[0];
    cr_assert_eq(zcommit_sums(fd, rr.resv, sum, 1, &p, &r), 0, "COMMIT: %s", r.body);
    kvt_client_t *o = zclient(&d, "pressure");
    uint32_t u[32 * PAGE];
    kvd_tokens(u, 32 * PAGE, 47000);
    uint8_t *pay = malloc(32 * BB);
    kvd_fill(pay, 32 * BB, 9);
    kvt_client_put_t pr;
    cr_assert_eq(kvt_client_put(o, u, 32 * PAGE, 0, 32, pay, NULL, &pr), 0);
    cr_expect_eq(wait_stat(c, "zero_copy_scribbles", 2), 2, "the demotion did not check b");
    uint8_t tier = KVT_CLIENT_TIER_DRAM;
    kvt_client_match_t m = {.tiers = &tier, .tiers_cap = 1};
    for (int i = 0; i < 500; i++) {
        cr_assert_eq(kvt_client_match(c, b, PAGE, 0, 0, NULL, &m), 0);
        if (m.pages == 0 || tier == KVT_CLIENT_TIER_NONE)
            break;
        usleep(10000);
    }
    cr_expect(m.pages == 0 || tier == KVT_CLIENT_TIER_NONE,
              "the page with a wrong sum is still stored, in tier %u", tier);
    cr_expect_gt(wait_stat(c, "blocks_moved_dram_nvme", 1), 0, "nothing was demoted at all");
    free(pay);
    kvt_client_close(o);
    kvt_client_close(c);
    zunmap(&z);
    close(fd);
}

/* A COMMIT whose sums do not match its reservation's pages is refused and changes nothing: the
 * reservation is still held, its pages still invisible, and a right COMMIT then stores them. */
Test(server_zc, commit_sums_must_match_the_reservation, .fini = teardown)
{
    kvd_start(&d, NULL);
    int fd = zconn(&d, "zc", NULL);
    zmap_t z;
    cr_assert_eq(zmap_tier(fd, KVT_TIER_DRAM, &z, NULL), 0);
    uint32_t a[2 * PAGE];
    kvd_tokens(a, 2 * PAGE, 48000);
    kvt_proto_reserve_reply_t rr;
    uint64_t off[2], sum[3];
    kvt_proto_put_reply_t p;
    zreply_t r;
    zwrite(fd, &z, a, 2, 130, &rr, off, sum);
    sum[2] = 0;
    cr_expect_eq(zcommit_sums(fd, rr.resv, sum, 1, &p, &r), KVT_EINVAL);
    cr_expect(strstr((const char *)r.body, "checksums"), "unclear error: %s", r.body);
    cr_expect_eq(zcommit_sums(fd, rr.resv, sum, 3, &p, &r), KVT_EINVAL);
    uint32_t pages;
    uint8_t tiers[2];
    uint64_t lease = zmatch(fd, a, 2 * PAGE, &pages, tiers);
    cr_expect_eq(pages, 2);
    cr_expect(tiers[0] == KVT_TIER_NONE && tiers[1] == KVT_TIER_NONE,
              "a refused COMMIT made pages visible (tiers %u %u)", tiers[0], tiers[1]);
    (void)lease;
    cr_expect_eq(zcommit_sums(fd, rr.resv, sum, 2, &p, &r), 0, "COMMIT: %s", r.body);
    cr_expect_eq(p.stored, 2);
    zunmap(&z);
    close(fd);
}

/* zero-copy-checksum no: RESERVE's reply does not ask for sums, and sums sent anyway (wrong
 * ones here) are ignored: the pages are served as they are, nothing is counted. */
Test(server_zc, scribble_check_off_ignores_client_sums, .fini = teardown)
{
    kvd_start(&d, "--zero-copy-checksum", "no", NULL);
    int fd = zconn(&d, "zc", NULL);
    zmap_t z;
    cr_assert_eq(zmap_tier(fd, KVT_TIER_DRAM, &z, NULL), 0);
    kvt_client_t *c = zclient(&d, NULL);
    uint32_t a[2 * PAGE];
    kvd_tokens(a, 2 * PAGE, 49000);
    kvt_proto_reserve_reply_t rr;
    uint64_t off[2], sum[2];
    kvt_proto_put_reply_t p;
    zreply_t r;
    zwrite(fd, &z, a, 2, 140, &rr, off, sum);
    cr_expect_eq(rr.flags & KVT_RESV_F_SEAL, 0);
    sum[0] ^= 1;
    cr_assert_eq(zcommit_sums(fd, rr.resv, sum, 2, &p, &r), 0, "COMMIT: %s", r.body);
    uint32_t got;
    int exact[2] = {0, 0};
    cr_expect_eq(sget(c, a, 2, &got, 140, exact), 0);
    cr_expect_eq(got, 2);
    cr_expect(exact[0] && exact[1]);
    cr_expect_eq(kvd_stat(c, "zero_copy_scribbles"), 0);
    cr_expect_eq(kvd_stat(c, "zero_copy_client_sums"), 0);
    kvt_client_close(c);
    zunmap(&z);
    close(fd);
}

/* Scribble the page that lies at data (a zero-copy GET's pointer into this client's mapping). */
static int scribble_block(void *arg, uint32_t page, unsigned tier, const void *data, uint32_t len)
{
    (void)tier, (void)len;
    if (page == *(uint32_t *)arg)
        ((uint8_t *)(uintptr_t)data)[17] ^= 0x80;
    return 0;
}

/* libkvtier's zero-copy PUT hashes each page as it copies it in and sends the sums: the daemon
 * takes them (it hashes nothing), they are right (the unscribbled page is served), and a page
 * the client writes over after the PUT is caught as it leaves through the socket. */
Test(server_zc, libkvtier_put_sends_sums_that_catch_scribbles, .fini = teardown)
{
    kvd_start(&d, NULL);
    kvt_client_conf_t conf = {.unix_path = d.sock,
                              .model = "zc",
                              .page_size = PAGE,
                              .block_bytes = BB,
                              .timeout_ms = 10000,
                              .zero_copy = 1};
    kvt_client_t *w = NULL, *c = zclient(&d, NULL);
    cr_assert_eq(kvt_client_connect(&w, &conf), 0);
    cr_assert(kvt_client_zero_copy(w), "no mapping: %s", kvt_client_zero_copy_reason(w));
    uint32_t a[2 * PAGE];
    kvd_tokens(a, 2 * PAGE, 50000);
    uint8_t *pay = malloc(2 * BB);
    pattern(pay, 150);
    pattern(pay + BB, 151);
    kvt_client_put_t pr;
    cr_assert_eq(kvt_client_put(w, a, 2 * PAGE, 0, 2, pay, NULL, &pr), 0, "%s",
                 kvt_client_errmsg(w));
    cr_expect_eq(pr.stored, 2);
    cr_expect_eq(kvd_stat(c, "zero_copy_client_sums"), 2);
    cr_expect_eq(kvd_stat(c, "zero_copy_seals"), 0);
    uint32_t got;
    int exact[2] = {0, 0};
    cr_expect_eq(sget(c, a, 2, &got, 150, exact), 0, "libkvtier's sums are wrong");
    cr_expect(got == 2 && exact[0] && exact[1]);
    kvt_client_match_t m = {0};
    cr_assert_eq(kvt_client_match(w, a, 2 * PAGE, KVT_CLIENT_LEASE, 0, NULL, &m), 0);
    uint32_t which = 1;
    cr_assert_eq(kvt_client_get_cb(w, m.lease, 0, 2, scribble_block, &which, &got), 0);
    cr_assert_eq(kvt_client_release(w, m.lease, NULL), 0);
    cr_expect_neq(sget(c, a, 2, &got, 150, exact), 0, "a scribbled page was served");
    cr_expect_eq(got, 1);
    cr_expect_eq(kvd_stat(c, "zero_copy_scribbles"), 1);
    free(pay);
    kvt_client_close(w);
    kvt_client_close(c);
}

/* Sends n frames of op with flags, one body each (bodies[i], lens[i]), request ids id0.. in one
 * write. */
static void zsend_pipelined(int fd, unsigned op, uint16_t flags, uint64_t id0, uint32_t n,
                            uint8_t (*bodies)[256], const uint32_t *lens)
{
    static uint8_t buf[64 * (KVT_PROTO_HDR + 256)];
    size_t len = 0;
    cr_assert_leq(n, 64);
    for (uint32_t i = 0; i < n; i++) {
        kvt_proto_frame(buf + len, op, flags, id0 + i, 0, lens[i]);
        memcpy(buf + len + KVT_PROTO_HDR, bodies[i], lens[i]);
        len += KVT_PROTO_HDR + lens[i];
    }
    cr_assert_eq(write(fd, buf, len), (ssize_t)len);
}

/* A keyed save's two pipelines (libkvtier's kvt__put_each_mapped in client/kvtier.c, the Python
 * package's keyed PUT) on fd, mapped at z: 32 RESERVEs of one page each (tokens from base) in one
 * write, then their 32 COMMITs in one; then a MATCH with a lease of each page in one write, and
 * their RELEASEs in one. Checks every reply, whole and in order, and the pages stored as written;
 * returns the daemon's socket writes for the RESERVEs (*reserves), the COMMITs (*commits) and the
 * MATCHes and RELEASEs together (*leases). */
static void pipelined_save(int fd, zmap_t *z, uint32_t base, double *reserves, double *commits,
                           double *leases)
{
    enum { N = 32 };
    uint32_t t[N][PAGE];
    static uint8_t bodies[N][256];
    uint32_t lens[N];
    for (uint32_t i = 0; i < N; i++) {
        kvd_tokens(t[i], PAGE, base + 100 * i);
        kvt_proto_reserve_t q = {.ntokens = PAGE, .first_page = 0, .npages = 1};
        kvt_proto_reserve_encode(bodies[i], &q);
        kvt_proto_tokens_encode(bodies[i] + sizeof(kvt_wire_reserve_t), t[i], PAGE);
        lens[i] = (uint32_t)(sizeof(kvt_wire_reserve_t) + 4 * PAGE);
    }
    double before = kvd_metric(&d, "kvtier_socket_writes_total");
    cr_assert_geq(before, 1, "kvtier_socket_writes_total is served");
    zsend_pipelined(fd, KVT_OP_RESERVE, 0, 1000, N, bodies, lens);
    uint64_t resv[N], off[N];
    for (uint32_t i = 0; i < N; i++) {
        zreply_t r;
        zrecv(fd, &r);
        cr_assert_eq(r.h.request_id, 1000 + i, "replies in request order");
        cr_assert_eq(r.h.opcode, KVT_OP_RESERVE | KVT_OP_REPLY);
        cr_assert_eq(r.h.status, 0, "RESERVE %u: %s", i, r.body);
        kvt_proto_reserve_reply_t rr;
        cr_assert_eq(kvt_proto_reserve_reply_decode(r.body, r.h.body_len, &rr), 0);
        cr_assert(rr.resv != 0 && rr.nlocs == 1, "RESERVE %u: room for its page", i);
        uint32_t page;
        kvt_proto_resv_loc(&rr, 0, &page, &off[i]);
        cr_assert_eq(page, 0);
        resv[i] = rr.resv;
        pattern(z_late(z, off[i]), base + i);
    }
    *reserves = kvd_metric(&d, "kvtier_socket_writes_total") - before;

    for (uint32_t i = 0; i < N; i++) {
        kvt_proto_commit_encode(bodies[i], resv[i]);
        lens[i] = 8;
    }
    before = kvd_metric(&d, "kvtier_socket_writes_total");
    zsend_pipelined(fd, KVT_OP_COMMIT, 0, 2000, N, bodies, lens);
    for (uint32_t i = 0; i < N; i++) {
        zreply_t r;
        zrecv(fd, &r);
        cr_assert_eq(r.h.request_id, 2000 + i, "replies in request order");
        cr_assert_eq(r.h.status, 0, "COMMIT %u: %s", i, r.body);
        kvt_proto_put_reply_t p;
        cr_assert_eq(kvt_proto_put_reply_decode(r.body, r.h.body_len, &p), 0);
        cr_assert_eq(p.stored, 1, "COMMIT %u stores its page", i);
    }
    *commits = kvd_metric(&d, "kvtier_socket_writes_total") - before;

    /* A load's MATCHes with a lease, then their RELEASEs: answered in their handlers, one write
     * each pipeline already before. */
    for (uint32_t i = 0; i < N; i++) {
        kvt_proto_match_t q = {.ntokens = PAGE};
        kvt_proto_match_encode(bodies[i], &q);
        kvt_proto_tokens_encode(bodies[i] + sizeof(kvt_wire_match_t), t[i], PAGE);
        lens[i] = (uint32_t)(sizeof(kvt_wire_match_t) + 4 * PAGE);
    }
    before = kvd_metric(&d, "kvtier_socket_writes_total");
    zsend_pipelined(fd, KVT_OP_MATCH, KVT_MATCH_F_LEASE, 3000, N, bodies, lens);
    uint64_t lease[N];
    for (uint32_t i = 0; i < N; i++) {
        zreply_t r;
        zrecv(fd, &r);
        cr_assert_eq(r.h.request_id, 3000 + i, "replies in request order");
        cr_assert_eq(r.h.status, 0, "MATCH %u: %s", i, r.body);
        kvt_proto_match_reply_t m;
        const uint8_t *tb;
        cr_assert_eq(kvt_proto_match_reply_decode(r.body, r.h.body_len, &m, &tb), 0);
        cr_assert(m.pages == 1 && m.lease != 0, "MATCH %u: its page, leased", i);
        lease[i] = m.lease;
    }
    for (uint32_t i = 0; i < N; i++) {
        kvt_proto_release_encode(bodies[i], lease[i]);
        lens[i] = 8;
    }
    zsend_pipelined(fd, KVT_OP_RELEASE, 0, 4000, N, bodies, lens);
    for (uint32_t i = 0; i < N; i++) {
        zreply_t r;
        zrecv(fd, &r);
        cr_assert_eq(r.h.request_id, 4000 + i, "replies in request order");
        cr_assert_eq(r.h.status, 0, "RELEASE %u: %s", i, r.body);
    }
    *leases = kvd_metric(&d, "kvtier_socket_writes_total") - before;

    kvt_client_t *c = zclient(&d, NULL);
    for (uint32_t i = 0; i < N; i++) {
        uint32_t got = 0;
        int exact = 0;
        cr_assert_eq(sget(c, t[i], 1, &got, base + i, &exact), 0);
        cr_expect(got == 1 && exact, "page of RESERVE %u read back wrong", i);
    }
    kvt_client_close(c);
}

/* 32 pipelined RESERVEs' replies leave in one write, as their COMMITs' do. Every RESERVE's room
 * comes by a DRAM write whose completion loop 0 delivers in one batch; the replies that batch
 * finishes leave together once it is done (loop.c on_tier, kvt__kicks_defer), not in a writev
 * each as they did (32 a pipeline: 33 writes a keyed save, docs/benchmarks.md). Two connections:
 * with KVT_TEST_LOOPS=2 the first is loop 0's, the second loop 1's (completions' kicks posted). */
Test(server_zc, pipelined_reserves_and_commits_leave_in_one_write, .fini = teardown)
{
    kvd_start(&d, NULL);
    int fd[2];
    zmap_t z[2];
    for (int k = 0; k < 2; k++) {
        fd[k] = zconn(&d, "zc", NULL);
        cr_assert_eq(zmap_tier(fd[k], KVT_TIER_DRAM, &z[k], NULL), 0);
    }
    for (int k = 0; k < 2; k++) {
        double reserves, commits, leases;
        pipelined_save(fd[k], &z[k], 5000 + 10000 * (uint32_t)k, &reserves, &commits, &leases);
        /* One each when the daemon reads a pipeline whole (the usual case); two when the
         * frames straddle two reads. */
        cr_expect_leq(reserves, 2, "connection %d: %g writes for 32 pipelined RESERVEs", k,
                      reserves);
        cr_expect_geq(reserves, 1);
        cr_expect_leq(commits, 2, "connection %d: %g writes for 32 pipelined COMMITs", k, commits);
        cr_expect_geq(commits, 1);
        cr_expect_leq(leases, 4, "connection %d: %g writes for 32 MATCHes, then 32 RELEASEs", k,
                      leases);
        cr_expect_geq(leases, 2);
    }
    for (int k = 0; k < 2; k++) {
        zunmap(&z[k]);
        close(fd[k]);
    }
}
