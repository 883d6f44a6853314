/*
 * test_raw_frames.h: frames written and read by hand over a raw socket, for the tests that send
 * what libkvtier never would (bad magic, unknown flags, payloads it would refuse).
 */
#ifndef KVT_TEST_RAW_FRAMES_H
#define KVT_TEST_RAW_FRAMES_H

#include <criterion/criterion.h>
#include <sys/uio.h>
#include <unistd.h>

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

#endif
