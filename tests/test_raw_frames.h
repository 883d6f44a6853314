/*
 * test_raw_frames.h: frames written and read by hand over a raw socket, for the tests that send
 * what libkvtier never would (bad magic, unknown flags, payloads it would refuse).
 */
#ifndef KVT_TEST_RAW_FRAMES_H
#define KVT_TEST_RAW_FRAMES_H

#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include "common.h"
#include "proto.h"

/* One frame with the given header fields. Header and body go in one call: the daemon may close
 * the connection as soon as it has read a bad header, and a body written after that would raise
 * SIGPIPE in this process. */
static inline void raw_frame(int fd, unsigned op, uint16_t flags, uint64_t id, const void *body,
                             uint32_t len, uint32_t magic, uint8_t version)
{
    uint8_t hdr[KVT_PROTO_HDR];
    kvt_proto_hdr_t h = {.magic = magic,
                         .version = version,
                         .opcode = (uint8_t)op,
                         .flags = flags,
                         .request_id = id,
                         .body_len = len};
    kvt_proto_hdr_encode(hdr, &h);
    struct iovec iov[2] = {{hdr, sizeof hdr}, {(void *)body, body ? len : 0}};
    ssize_t want = (ssize_t)(sizeof hdr + (body ? len : 0));
    cr_assert_eq(writev(fd, iov, 2), want);
}

/* Reads exactly n bytes; -1 when the connection ends or fails first. */
static inline int read_full(int fd, uint8_t *p, size_t n)
{
    size_t got = 0;
    while (got < n) {
        ssize_t r = read(fd, p + got, n - got);
        if (r <= 0)
            return -1;
        got += (size_t)r;
    }
    return 0;
}

/* A Unix socket's send buffer as the kernel makes it (SO_SNDBUF of a fresh socket pair): whether
 * a test's replies overflow the daemon's socket. */
static inline int unix_sndbuf_default(void)
{
    int sp[2], def = 0;
    socklen_t dl = sizeof def;
    cr_assert_eq(socketpair(AF_UNIX, SOCK_STREAM, 0, sp), 0);
    cr_assert_eq(getsockopt(sp[0], SOL_SOCKET, SO_SNDBUF, &def, &dl), 0);
    close(sp[0]);
    close(sp[1]);
    return def;
}

/* One reply frame: its header in h, its body (at most cap bytes) in body. */
static inline void read_reply_frame(int fd, kvt_proto_hdr_t *h, uint8_t *body, size_t cap)
{
    uint8_t hdr[KVT_PROTO_HDR];
    cr_assert_eq(read_full(fd, hdr, sizeof hdr), 0, "the reply ended early");
    kvt_proto_hdr_decode(hdr, h);
    cr_assert_leq(h->body_len, cap);
    cr_assert_eq(read_full(fd, body, h->body_len), 0, "the reply ended early");
}

/* A MATCH with a lease of ntok tokens (at most 256) on a raw socket after its HELLO: the lease, 0
 * when nothing matched; the reply's body in body. */
static inline uint64_t raw_match_lease(int fd, const uint32_t *t, uint32_t ntok, uint8_t *body,
                                       size_t cap)
{
    uint8_t f[KVT_PROTO_HDR + sizeof(kvt_wire_match_t) + 256 * 4];
    cr_assert_leq(ntok, 256);
    kvt_wire_match_t mw = {.ntokens = ntok};
    size_t len = KVT_PROTO_HDR + sizeof mw + ntok * 4;
    kvt_proto_frame(f, KVT_OP_MATCH, KVT_MATCH_F_LEASE, 2, 0, (uint32_t)(sizeof mw + ntok * 4));
    memcpy(f + KVT_PROTO_HDR, &mw, sizeof mw);
    memcpy(f + KVT_PROTO_HDR + sizeof mw, t, ntok * 4);
    cr_assert_eq(write(fd, f, len), (ssize_t)len);
    kvt_proto_hdr_t h;
    read_reply_frame(fd, &h, body, cap);
    cr_assert_eq(h.status, 0);
    return kvt_get_u64(body + 8);
}

/* HELLO (model, page size, block size) on a raw socket, its reply read into body. */
static inline void raw_hello_model(int fd, const char *model, uint32_t page, uint32_t block_bytes,
                                   uint8_t *body, size_t cap)
{
    uint8_t f[KVT_PROTO_HDR + sizeof(kvt_wire_hello_t) + 256];
    size_t mlen = strlen(model);
    cr_assert_leq(sizeof(kvt_wire_hello_t) + mlen, sizeof f - KVT_PROTO_HDR);
    kvt_wire_hello_t hw = {.min_version = 1,
                           .max_version = 1,
                           .page_size = page,
                           .block_bytes = block_bytes,
                           .model_len = (uint16_t)mlen};
    size_t len = KVT_PROTO_HDR + sizeof hw + mlen;
    kvt_proto_frame(f, KVT_OP_HELLO, 0, 1, 0, (uint32_t)(sizeof hw + mlen));
    memcpy(f + KVT_PROTO_HDR, &hw, sizeof hw);
    memcpy(f + KVT_PROTO_HDR + sizeof hw, model, mlen);
    cr_assert_eq(write(fd, f, len), (ssize_t)len);
    kvt_proto_hdr_t h;
    read_reply_frame(fd, &h, body, cap);
    cr_assert_eq(h.status, 0);
}

/* HELLO (model, page size, block size) and a MATCH with a lease of ntok tokens (at most 256) on a
 * raw socket: the lease. */
static inline uint64_t raw_lease(int fd, const char *model, uint32_t page, uint32_t block_bytes,
                                 const uint32_t *t, uint32_t ntok, uint8_t *body, size_t cap)
{
    raw_hello_model(fd, model, page, block_bytes, body, cap);
    uint64_t lease = raw_match_lease(fd, t, ntok, body, cap);
    cr_assert_neq(lease, 0);
    return lease;
}

/* n GETs of page 0 under lease, pipelined in one write, request ids id0, id0 + 1, ... */
static inline void raw_gets(int fd, uint64_t lease, uint32_t n, uint64_t id0)
{
    size_t one = KVT_PROTO_HDR + sizeof(kvt_wire_get_t), len = 0;
    uint8_t *frames = malloc(n * one);
    cr_assert(frames);
    for (uint32_t i = 0; i < n; i++) {
        kvt_wire_get_t gw = {.lease = lease, .first_page = 0, .npages = 1};
        kvt_proto_frame(frames + len, KVT_OP_GET, 0, id0 + i, 0, sizeof gw);
        memcpy(frames + len + KVT_PROTO_HDR, &gw, sizeof gw);
        len += one;
    }
    cr_assert_eq(write(fd, frames, len), (ssize_t)len);
    free(frames);
}

#endif
