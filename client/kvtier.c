/*
 * kvtier.c: libkvtier. It owns one socket per client, a buffered reader over it, the calls (each
 * encoded and its reply decoded by proto/, the one codec of the wire format, shared with kvtierd),
 * and the batch's pipelining loop, which writes queued frames and reads replies in the same poll
 * loop so that a batch larger than the socket buffers never deadlocks against a daemon that has
 * stopped reading until its replies drain.
 *
 * Zero-copy (docs/protocol.md, "Zero-copy for local clients"): on the Unix socket the client maps
 * its namespace's DRAM arena after HELLO. The memfd comes on the MAP reply's first byte
 * (SCM_RIGHTS), so every read of the socket is a recvmsg with room for a descriptor: one that
 * comes with any other reply is closed at once, never leaked or silently swallowed. GETs then ask
 * for locations and read the pages from the mapping; PUTs reserve room, copy into it and commit.
 */
#include "kvtier.h"

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <unistd.h>

#include "common.h"
#include "each.h"
#include "proto.h"
#include "seal.h"

#define KVT_SAME(a, b) ((int)(a) == (int)(b))
_Static_assert(KVT_SAME(KVT_CLIENT_LEASE, KVT_MATCH_F_LEASE) &&
                   KVT_SAME(KVT_CLIENT_REMOTE, KVT_MATCH_F_REMOTE) &&
                   KVT_SAME(KVT_CLIENT_PROBE, KVT_MATCH_F_PROBE),
               "MATCH flags agree with the wire");
_Static_assert(KVT_SAME(KVT_CLIENT_HINT_PAUSED, KVT_HINT_PAUSED) &&
                   KVT_SAME(KVT_CLIENT_HINT_FINISHED, KVT_HINT_FINISHED),
               "hint flags agree with the wire");
_Static_assert(KVT_SAME(KVT_CLIENT_EINVAL, KVT_EINVAL) &&
                   KVT_SAME(KVT_CLIENT_ECLOSED, KVT_ECLOSED) &&
                   KVT_SAME(KVT_CLIENT_ETOOBIG, KVT_ETOOBIG) &&
                   KVT_SAME(KVT_CLIENT_EAUTH, KVT_EAUTH),
               "status codes agree with common.h");

struct kvt_client {
    int fd;
    int timeout_ms;
    int broken;
    uint64_t next_id;
    uint32_t page_size, block_bytes, max_frame;
    /* The longest reply body taken: 64 KiB until HELLO, then the daemon's max-frame (no reply of
     * its is longer). A longer one is a broken or hostile server: EPROTO, nothing allocated. */
    uint32_t max_reply;
    uint64_t seed;
    unsigned tiers;
    uint16_t put_flags; /* wire flags every PUT and RESERVE carries (kvt_client_set_put_flags) */
    char errmsg[KVT_PROTO_ERRMSG_MAX + 1];
    uint8_t *in; /* buffered input: [in_pos, in_len) not yet consumed */
    size_t in_pos, in_len, in_cap;
    uint8_t *out; /* the request being built */
    size_t out_cap;
    /* Zero-copy. map is the namespace's DRAM arena (map_bytes long) or NULL; fd_want is set
     * while a MAP reply is awaited, and fd_got holds the descriptor it brought (or -1). */
    int is_unix, fd_want, fd_got, hbm_mapped;
    uint8_t *map;
    uint64_t map_bytes, hbm_bytes;
    /* One bit per granule of the mapping (KVT_WARM_SHIFT) that this mapping has populated for
     * writing (warm_room), NULL when none can be (no memory for it, or a kernel without
     * MADV_POPULATE_WRITE). */
    uint64_t *warm;
    char zc_reason[KVT_PROTO_ERRMSG_MAX + 64];
    /* RELEASEs sent without waiting (kvt_client_release_later), ids from later_id: their
     * frames go out in front of the next request's (later_out, later_len bytes not sent yet),
     * and their replies, which come before that request's, are read and dropped first. */
    uint32_t later;
    uint64_t later_id;
    size_t later_len;
    uint8_t later_out[64 * (KVT_PROTO_HDR + sizeof(kvt_wire_release_t))];
};

const char *kvt_client_strerror(int err)
{
    return kvt_strerror(err);
}

const char *kvt_client_errmsg(const kvt_client_t *c)
{
    return c ? c->errmsg : "";
}

uint64_t kvt_client_ns_seed(const kvt_client_t *c)
{
    return c->seed;
}

unsigned kvt_client_tiers(const kvt_client_t *c)
{
    return c->tiers;
}

int kvt_client_zero_copy(const kvt_client_t *c)
{
    return c && c->map != NULL;
}

const char *kvt_client_zero_copy_reason(const kvt_client_t *c)
{
    return c ? c->zc_reason : "";
}

const void *kvt_client_mapping(const kvt_client_t *c, uint64_t *bytes)
{
    if (bytes)
        *bytes = c && c->map ? c->map_bytes : 0;
    return c ? c->map : NULL;
}

static int broken_with(kvt_client_t *c, int err)
{
    c->broken = 1;
    return err;
}

static int wait_ready(kvt_client_t *c, short ev, uint64_t deadline)
{
    for (;;) {
        uint64_t now = kvt_now_ns();
        if (now >= deadline)
            return KVT_ETIMEDOUT;
        struct pollfd p = {.fd = c->fd, .events = ev};
        int n = poll(&p, 1, (int)((deadline - now) / 1000000) + 1);
        if (n > 0)
            return 0;
        if (n < 0 && errno != EINTR)
            return -errno;
    }
}

static uint64_t deadline_from_now(const kvt_client_t *c)
{
    return kvt_now_ns() + (uint64_t)c->timeout_ms * 1000000;
}

static int send_all(kvt_client_t *c, const uint8_t *p, size_t len, uint64_t deadline)
{
    while (len > 0) {
        ssize_t n = send(c->fd, p, len, MSG_NOSIGNAL);
        if (n > 0) {
            p += n;
            len -= (size_t)n;
            continue;
        }
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && errno != EAGAIN)
            return broken_with(c, -errno);
        int rc = wait_ready(c, POLLOUT, deadline);
        if (rc < 0)
            return broken_with(c, rc);
    }
    return 0;
}

/* The descriptors a read brought: the first kept while a MAP reply is awaited, the rest closed.
 * A truncated control message (MSG_CTRUNC: the kernel closed what did not fit) is remembered as
 * no descriptor, so a MAP reply short of its fd maps nothing. */
static void take_fds(kvt_client_t *c, struct msghdr *msg)
{
    for (struct cmsghdr *cm = CMSG_FIRSTHDR(msg); cm; cm = CMSG_NXTHDR(msg, cm)) {
        if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS)
            continue;
        size_t nfd = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < nfd; i++) {
            int fd;
            memcpy(&fd, CMSG_DATA(cm) + i * sizeof(int), sizeof fd);
            if (c->fd_want && c->fd_got < 0 && !(msg->msg_flags & MSG_CTRUNC))
                c->fd_got = fd;
            else
                close(fd);
        }
    }
}

/* Reads whatever the socket has (at least one byte, waiting until deadline). */
static int fill(kvt_client_t *c, uint64_t deadline, int wait)
{
    if (c->in_pos > 0 && c->in_pos == c->in_len)
        c->in_pos = c->in_len = 0;
    if (c->in_cap - c->in_len < 65536) {
        if (c->in_pos > 0) {
            memmove(c->in, c->in + c->in_pos, c->in_len - c->in_pos);
            c->in_len -= c->in_pos;
            c->in_pos = 0;
        }
        if (kvt_reserve(&c->in, &c->in_cap, c->in_len + 65536, 1, 4096) < 0)
            return broken_with(c, KVT_ENOMEM);
    }
    for (;;) {
        /* recvmsg with room for descriptors on every read: a descriptor rides on a byte of the
         * stream, and a plain recv over that byte would drop it. Only a MAP reply carries one
         * (kept in fd_got); any other is closed here. */
        struct iovec iov = {.iov_base = c->in + c->in_len, .iov_len = c->in_cap - c->in_len};
        union {
            struct cmsghdr align;
            char buf[CMSG_SPACE(4 * sizeof(int))];
        } ctl;
        struct msghdr msg = {
            .msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.buf, .msg_controllen = sizeof ctl};
        ssize_t n = recvmsg(c->fd, &msg, MSG_CMSG_CLOEXEC);
        if (n >= 0 && msg.msg_controllen > 0)
            take_fds(c, &msg);
        if (n > 0) {
            c->in_len += (size_t)n;
            return 0;
        }
        if (n == 0)
            return broken_with(c, KVT_ECLOSED);
        if (errno == EINTR)
            continue;
        if (errno != EAGAIN)
            return broken_with(c, -errno);
        if (!wait)
            return KVT_EAGAIN;
        int rc = wait_ready(c, POLLIN, deadline);
        if (rc < 0)
            return broken_with(c, rc);
    }
}

/* Makes n bytes available at c->in + c->in_pos. */
static int need(kvt_client_t *c, size_t n, uint64_t deadline)
{
    if (c->in_len - c->in_pos >= n)
        return 0;
    if (c->in_pos > 0) {
        memmove(c->in, c->in + c->in_pos, c->in_len - c->in_pos);
        c->in_len -= c->in_pos;
        c->in_pos = 0;
    }
    if (kvt_reserve(&c->in, &c->in_cap, n, 1, 4096) < 0)
        return broken_with(c, KVT_ENOMEM);
    while (c->in_len - c->in_pos < n) {
        int rc = fill(c, deadline, 1);
        if (rc < 0)
            return rc;
    }
    return 0;
}

/* Checks a reply header against the request it must answer. */
static int check_reply(kvt_client_t *c, const kvt_proto_hdr_t *h, unsigned op, uint64_t id)
{
    if (kvt_proto_hdr_check(h, UINT32_MAX) < 0 || h->opcode != (op | KVT_OP_REPLY) ||
        h->request_id != id)
        return broken_with(c, KVT_EPROTO);
    return 0;
}

static int read_frame_raw(kvt_client_t *c, kvt_proto_hdr_t *h, const uint8_t **body,
                          uint64_t deadline);

/* The replies to the RELEASEs sent without waiting: read and dropped (a lease already gone
 * answers 0, which is no error either). */
static int flush_later(kvt_client_t *c, uint64_t deadline)
{
    size_t n = c->later_len;
    c->later_len = 0;
    return n ? send_all(c, c->later_out, n, deadline) : 0;
}

static int drain_later(kvt_client_t *c, uint64_t deadline)
{
    int frc = flush_later(c, deadline);
    if (frc < 0)
        return frc;
    while (c->later) {
        kvt_proto_hdr_t h;
        const uint8_t *body;
        int rc = read_frame_raw(c, &h, &body, deadline);
        if (rc < 0 || (rc = check_reply(c, &h, KVT_OP_RELEASE, c->later_id)) < 0)
            return rc;
        c->later--;
        c->later_id++;
    }
    return 0;
}

/* Reads one whole frame; *body points into the input buffer until the next read. */
static int read_frame(kvt_client_t *c, kvt_proto_hdr_t *h, const uint8_t **body, uint64_t deadline)
{
    int rc = drain_later(c, deadline);
    return rc < 0 ? rc : read_frame_raw(c, h, body, deadline);
}

static int read_frame_raw(kvt_client_t *c, kvt_proto_hdr_t *h, const uint8_t **body,
                          uint64_t deadline)
{
    int rc = need(c, KVT_PROTO_HDR, deadline);
    if (rc < 0)
        return rc;
    kvt_proto_hdr_decode(c->in + c->in_pos, h);
    if (kvt_proto_hdr_check(h, c->max_reply) < 0)
        return broken_with(c, KVT_EPROTO);
    if ((rc = need(c, KVT_PROTO_HDR + (size_t)h->body_len, deadline)) < 0)
        return rc;
    *body = c->in + c->in_pos + KVT_PROTO_HDR;
    c->in_pos += KVT_PROTO_HDR + (size_t)h->body_len;
    return 0;
}

static void set_errmsg(kvt_client_t *c, const kvt_proto_hdr_t *h, const uint8_t *body)
{
    size_t n = KVT_MIN((size_t)h->body_len, sizeof c->errmsg - 1);
    memcpy(c->errmsg, body, n);
    c->errmsg[n] = 0;
}

/* Sends one request whose body is b1, b2, then nparts parts of part_len bytes each, sent from
 * the caller's memory (the pages of a PUT, one buffer each: no gather copy); *id gets its request
 * id. */
static int send_req_parts(kvt_client_t *c, unsigned op, uint16_t flags, const void *b1, size_t l1,
                          const void *b2, size_t l2, const void *const *parts, uint32_t nparts,
                          size_t part_len, uint64_t *id, uint64_t deadline)
{
    if (c->broken)
        return KVT_ECLOSED;
    size_t l3 = (size_t)nparts * part_len, blen = l1 + l2 + l3;
    if ((part_len && l3 / part_len != nparts) || blen > UINT32_MAX || blen > c->max_frame)
        return KVT_ETOOBIG;
    *id = c->next_id++;
    uint8_t hdr[KVT_PROTO_HDR];
    kvt_proto_frame(hdr, op, flags, *id, 0, (uint32_t)blen);
    /* Small requests go out in one send, behind the RELEASEs waiting to go; a big payload is
     * sent from the caller's memory. */
    size_t pre = c->later_len;
    if (kvt_reserve(&c->out, &c->out_cap, pre + KVT_PROTO_HDR + l1 + l2, 1, 4096) < 0)
        return KVT_ENOMEM;
    memcpy(c->out, c->later_out, pre);
    memcpy(c->out + pre, hdr, KVT_PROTO_HDR);
    if (l1)
        memcpy(c->out + pre + KVT_PROTO_HDR, b1, l1);
    if (l2)
        memcpy(c->out + pre + KVT_PROTO_HDR + l1, b2, l2);
    c->later_len = 0;
    int rc = send_all(c, c->out, pre + KVT_PROTO_HDR + l1 + l2, deadline);
    for (uint32_t i = 0; rc == 0 && part_len && i < nparts; i++)
        rc = send_all(c, parts[i], part_len, deadline);
    return rc;
}

/* Sends one request (its body is b1, b2, b3 in that order); *id gets its request id. */
static int send_req(kvt_client_t *c, unsigned op, uint16_t flags, const void *b1, size_t l1,
                    const void *b2, size_t l2, const void *b3, size_t l3, uint64_t *id,
                    uint64_t deadline)
{
    return send_req_parts(c, op, flags, b1, l1, b2, l2, &b3, l3 ? 1 : 0, l3, id, deadline);
}

/* Reads the reply to request id: returns its status, its body in *body (len *len), valid until
 * the next read; an error reply's message goes to errmsg. */
static int read_reply(kvt_client_t *c, unsigned op, uint64_t id, const uint8_t **body,
                      uint32_t *len, uint64_t deadline)
{
    kvt_proto_hdr_t h;
    int rc;
    if ((rc = read_frame(c, &h, body, deadline)) < 0)
        return rc;
    if ((rc = check_reply(c, &h, op, id)) < 0)
        return rc;
    *len = h.body_len;
    if (h.status < 0) {
        set_errmsg(c, &h, *body);
        return h.status;
    }
    return 0;
}

/* One request, one reply: returns the reply's status, its body in *body (len *len). */
static int call(kvt_client_t *c, unsigned op, uint16_t flags, const void *b1, size_t l1,
                const void *b2, size_t l2, const void *b3, size_t l3, const uint8_t **body,
                uint32_t *len)
{
    c->errmsg[0] = 0;
    uint64_t id, deadline = deadline_from_now(c);
    int rc = send_req(c, op, flags, b1, l1, b2, l2, b3, l3, &id, deadline);
    if (rc < 0)
        return rc;
    return read_reply(c, op, id, body, len, deadline);
}

static int connect_fd(const kvt_client_conf_t *conf)
{
    if (conf->unix_path || !conf->tcp) {
        const char *path = conf->unix_path ? conf->unix_path : KVT_DEFAULT_UNIX_PATH;
        struct sockaddr_un sun = {.sun_family = AF_UNIX};
        if (strlen(path) >= sizeof sun.sun_path)
            return KVT_EINVAL;
        strcpy(sun.sun_path, path);
        int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0)
            return -errno;
        if (connect(fd, (struct sockaddr *)&sun, sizeof sun) < 0) {
            int e = -errno;
            close(fd);
            return e;
        }
        return fd;
    }
    const char *colon = strrchr(conf->tcp, ':');
    char host[256];
    if (!colon || colon == conf->tcp || (size_t)(colon - conf->tcp) >= sizeof host)
        return KVT_EINVAL;
    memcpy(host, conf->tcp, (size_t)(colon - conf->tcp));
    host[colon - conf->tcp] = 0;
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *ai, *p;
    if (getaddrinfo(host, colon + 1, &hints, &ai) != 0)
        return KVT_EINVAL;
    int fd = -ECONNREFUSED;
    for (p = ai; p; p = p->ai_next) {
        fd = socket(p->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0) {
            fd = -errno;
            continue;
        }
        if (connect(fd, p->ai_addr, p->ai_addrlen) == 0)
            break;
        int e = -errno;
        close(fd);
        fd = e;
    }
    freeaddrinfo(ai);
    if (fd >= 0) {
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    }
    return fd;
}

/* MAP of one tier: the reply decoded into *r (its handle borrowed from the input buffer until
 * the next read); a DRAM reply's descriptor in c->fd_got (-1 when none came). */
static int map_call(kvt_client_t *c, uint32_t tier, kvt_proto_map_reply_t *r)
{
    uint8_t w[sizeof(kvt_wire_map_t)];
    kvt_proto_map_encode(w, tier);
    const uint8_t *body;
    uint32_t len;
    /* Nothing else is in flight (calls are synchronous), so the next byte read is the reply's
     * first, the one that carries the descriptor. */
    if (c->in_pos != c->in_len)
        return broken_with(c, KVT_EPROTO);
    c->fd_want = 1;
    int rc = call(c, KVT_OP_MAP, 0, w, sizeof w, NULL, 0, NULL, 0, &body, &len);
    c->fd_want = 0;
    if (rc < 0)
        return rc;
    if (kvt_proto_map_reply_decode(body, len, r) < 0 || r->tier != tier)
        return broken_with(c, KVT_EPROTO);
    return 0;
}

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14; older headers lack it */
#endif
#define KVT_WARM_SHIFT 16 /* 64 KiB granules: the kernel's fault-around size */

/*
 * The room a RESERVE gave, made present in this mapping's page tables before the caller writes
 * it. The arena's memfd has 4 KiB pages (shmem takes no huge pages unless the machine says so),
 * and a write fault on a shared mapping maps one of them: a 2 MiB page written through a mapping
 * that never touched that memory takes 512 faults, each allocating (fresh memory) or only
 * mapping (memory the daemon or another client wrote). One madvise(MADV_POPULATE_WRITE) over
 * the room does the same work without a fault per page: bench_vllm's first pass, 64 MiB of
 * fresh memory, 16384 faults (docs/benchmarks.md, "First pass"). Only granules wholly inside
 * the room are populated (the edges of one not 64 KiB aligned fault as before), so no memory
 * outside a block is made resident, and each once per mapping (a bit in warm): a populate over
 * pages already present still walks them, 0.5-1 ms for 64 MiB, an eighth of a warm save. A
 * granule the daemon has punched since (its purge of freed memory) then faults as before: only
 * speed is at stake, never the bytes. Best effort: a kernel without it answers EINVAL once and
 * the client stops asking.
 */
static void warm_room(kvt_client_t *c, const uint8_t *p, size_t len)
{
    if (!c->warm)
        return;
    const size_t g = (size_t)1 << KVT_WARM_SHIFT;
    size_t off = (size_t)(p - c->map);
    size_t a = (off + g - 1) >> KVT_WARM_SHIFT, b = (off + len) >> KVT_WARM_SHIFT;
    while (a < b) {
        if (c->warm[a / 64] & (1ull << (a % 64))) {
            a++;
            continue;
        }
        size_t e = a + 1; /* a run of granules not populated yet: one call */
        while (e < b && !(c->warm[e / 64] & (1ull << (e % 64))))
            e++;
        if (madvise(c->map + (a << KVT_WARM_SHIFT), (e - a) << KVT_WARM_SHIFT,
                    MADV_POPULATE_WRITE) != 0) {
            if (errno == EINVAL) { /* not this kernel's: the faults, as before */
                free(c->warm);
                c->warm = NULL;
                return;
            }
            a = e; /* ENOMEM, EINTR...: the writes fault as they would have; not marked */
            continue;
        }
        for (; a < e; a++)
            c->warm[a / 64] |= 1ull << (a % 64);
    }
}

/* Maps the namespace's DRAM arena (connect, with conf->zero_copy). Only a transport error is
 * returned: a refusal, or a reply that cannot be mapped, leaves the client on the socket path
 * with the reason in zc_reason. */
static int map_dram(kvt_client_t *c)
{
    if (!c->is_unix) {
        snprintf(c->zc_reason, sizeof c->zc_reason,
                 "the connection is over TCP: zero-copy needs the daemon's Unix socket");
        return 0;
    }
    if (!c->block_bytes) {
        snprintf(c->zc_reason, sizeof c->zc_reason,
                 "an index-only client (block_bytes 0) has no blocks to map");
        return 0;
    }
    kvt_proto_map_reply_t r;
    int rc = map_call(c, KVT_TIER_DRAM, &r);
    int fd = c->fd_got;
    c->fd_got = -1;
    if (rc < 0) {
        if (fd >= 0)
            close(fd);
        if (c->broken)
            return rc;
        snprintf(c->zc_reason, sizeof c->zc_reason, "MAP refused: %s: %s", kvt_strerror(rc),
                 c->errmsg);
        c->errmsg[0] = 0;
        return 0;
    }
    if (fd < 0 || r.map_bytes == 0 || r.map_bytes > SIZE_MAX) {
        if (fd >= 0)
            close(fd);
        snprintf(c->zc_reason, sizeof c->zc_reason,
                 "the MAP reply came without a descriptor or a length");
        return 0;
    }
    void *p = mmap(NULL, (size_t)r.map_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    int e = errno;
    close(fd);
    if (p == MAP_FAILED) {
        snprintf(c->zc_reason, sizeof c->zc_reason, "mmap of %llu bytes: %s",
                 (unsigned long long)r.map_bytes, strerror(e));
        return 0;
    }
    c->map = p;
    c->map_bytes = r.map_bytes;
    c->warm = calloc(((size_t)(r.map_bytes >> KVT_WARM_SHIFT) + 63) / 64 + 1, sizeof *c->warm);
    c->zc_reason[0] = 0;
    return 0;
}

int kvt_client_map_hbm(kvt_client_t *c, uint8_t handle[64], uint64_t *pool_bytes)
{
    if (!c || !handle)
        return KVT_EINVAL;
    if (!c->is_unix || !c->block_bytes) {
        snprintf(c->errmsg, sizeof c->errmsg, "MAP needs the Unix socket and a block size");
        return KVT_EINVAL;
    }
    kvt_proto_map_reply_t r;
    int rc = map_call(c, KVT_TIER_HBM, &r);
    if (c->fd_got >= 0) { /* an HBM reply carries none: never keep one */
        close(c->fd_got);
        c->fd_got = -1;
    }
    if (rc < 0)
        return rc;
    if (r.handle_len != 64)
        return broken_with(c, KVT_EPROTO);
    memcpy(handle, r.handle, 64);
    c->hbm_mapped = 1;
    c->hbm_bytes = r.map_bytes;
    if (pool_bytes)
        *pool_bytes = r.map_bytes;
    return 0;
}

int kvt_client_connect(kvt_client_t **out, const kvt_client_conf_t *conf)
{
    if (!out || !conf || !conf->model || !*conf->model ||
        strlen(conf->model) > KVT_PROTO_NAME_MAX || conf->page_size == 0 ||
        conf->page_size > 1024 || (conf->adapter && strlen(conf->adapter) > KVT_PROTO_NAME_MAX) ||
        (conf->salt && strlen(conf->salt) > KVT_PROTO_NAME_MAX) ||
        (conf->secret && strlen(conf->secret) > KVT_PROTO_SECRET_MAX) || conf->timeout_ms < 0 ||
        conf->device < 0 || conf->device > 65535)
        return KVT_EINVAL;
    kvt_client_t *c = calloc(1, sizeof *c);
    if (!c)
        return KVT_ENOMEM;
    c->timeout_ms = conf->timeout_ms ? conf->timeout_ms : 10000;
    c->next_id = 1;
    c->max_frame = KVT_PROTO_MAX_FRAME_DEFAULT;
    c->max_reply = 64u << 10;
    c->fd_got = -1;
    c->is_unix = conf->unix_path || !conf->tcp;
    c->fd = connect_fd(conf);
    if (c->fd < 0) {
        int rc = c->fd;
        free(c);
        return rc;
    }
    fcntl(c->fd, F_SETFL, fcntl(c->fd, F_GETFL) | O_NONBLOCK);
    const uint8_t *body;
    uint32_t len;
    int rc;
    /* An empty secret is none: the daemon refuses an empty AUTH body (1..1024 bytes). */
    if (conf->secret && *conf->secret &&
        (rc = call(c, KVT_OP_AUTH, 0, conf->secret, strlen(conf->secret), NULL, 0, NULL, 0, &body,
                   &len)) < 0)
        goto fail;
    size_t ml = strlen(conf->model), al = conf->adapter ? strlen(conf->adapter) : 0,
           sl = conf->salt ? strlen(conf->salt) : 0;
    kvt_proto_hello_t hm = {
        .min_version = KVT_PROTO_VERSION,
        .max_version = KVT_PROTO_VERSION,
        .page_size = conf->page_size,
        .block_bytes = conf->block_bytes,
        .model_len = (uint16_t)ml,
        .adapter_len = (uint16_t)al,
        .salt_len = (uint16_t)sl,
        .device = (uint16_t)conf->device,
    };
    uint8_t w[sizeof(kvt_wire_hello_t)];
    kvt_proto_hello_encode(w, &hm);
    char names[3 * KVT_PROTO_NAME_MAX];
    memcpy(names, conf->model, ml);
    if (al)
        memcpy(names + ml, conf->adapter, al);
    if (sl)
        memcpy(names + ml + al, conf->salt, sl);
    rc = call(c, KVT_OP_HELLO, 0, w, sizeof w, names, ml + al + sl, NULL, 0, &body, &len);
    if (rc < 0)
        goto fail;
    kvt_proto_hello_reply_t r;
    if ((rc = kvt_proto_hello_reply_decode(body, len, &r)) < 0)
        goto fail;
    c->seed = r.ns_seed;
    c->tiers = r.tiers;
    c->max_frame = r.max_frame;
    c->max_reply = KVT_MAX(c->max_frame, c->max_reply);
    c->page_size = conf->page_size;
    c->block_bytes = conf->block_bytes;
    if (conf->zero_copy && (rc = map_dram(c)) < 0)
        goto fail;
    if (!conf->zero_copy)
        snprintf(c->zc_reason, sizeof c->zc_reason, "zero_copy is off in the client's conf");
    *out = c;
    return 0;
fail:
    kvt_client_close(c);
    return rc;
}

void kvt_client_close(kvt_client_t *c)
{
    if (!c)
        return;
    if (c->map)
        munmap(c->map, c->map_bytes);
    free(c->warm);
    if (c->fd_got >= 0)
        close(c->fd_got);
    close(c->fd);
    free(c->in);
    free(c->out);
    free(c);
}

int kvt_client_ping(kvt_client_t *c, uint64_t *rtt_ns)
{
    if (!c)
        return KVT_EINVAL;
    static const char payload[] = "kvtier-ping";
    uint64_t t0 = kvt_now_ns();
    const uint8_t *body;
    uint32_t len;
    int rc = call(c, KVT_OP_PING, 0, payload, sizeof payload, NULL, 0, NULL, 0, &body, &len);
    if (rc < 0)
        return rc;
    if (len != sizeof payload || memcmp(body, payload, len) != 0)
        return broken_with(c, KVT_EPROTO);
    if (rtt_ns)
        *rtt_ns = kvt_now_ns() - t0;
    return 0;
}

static kvt_proto_hints_t proto_hints(const kvt_client_hints_t *h)
{
    kvt_proto_hints_t p = {0};
    if (h) {
        p.engine_request_id = h->engine_request_id;
        p.resume_ms = h->resume_ms;
        p.priority = h->priority;
        p.flags = h->flags;
    }
    return p;
}

static int tokens_wire(kvt_client_t *c, const uint32_t *tokens, uint32_t n, uint8_t **out)
{
    /* The wire is little-endian: on such hosts the caller's array goes out as it is. */
#if __BYTE_ORDER == __LITTLE_ENDIAN
    (void)c;
    *out = (uint8_t *)(uintptr_t)tokens;
    (void)n;
    return 0;
#else
    uint8_t *p = malloc((size_t)n * 4 + 1);
    if (!p)
        return KVT_ENOMEM;
    kvt_proto_tokens_encode(p, tokens, n);
    *out = p;
    return 1;
#endif
}

int kvt_client_match(kvt_client_t *c, const uint32_t *tokens, uint32_t ntokens, unsigned flags,
                     uint32_t lease_ms, const kvt_client_hints_t *hints, kvt_client_match_t *res)
{
    return kvt_client_match_step(c, tokens, ntokens, flags, lease_ms, hints, res, NULL);
}

static int check_loc(const kvt_client_t *c, uint8_t tier, uint64_t off, uint32_t len,
                     const void **host);

/* LOCATE's part of a MATCH reply into step: each offset checked against the mapping. */
static int step_locs(kvt_client_t *c, const kvt_proto_match_reply_t *r, const uint8_t *tiers,
                     const kvt_proto_match_locs_t *l, uint64_t sent_ns, kvt_client_step_t *step)
{
    for (uint32_t i = 0; i < r->pages; i++) {
        uint64_t off = kvt_proto_match_loc(l, i);
        kvt_client_loc_t loc = {.tier = KVT_TIER_NONE};
        if (off != KVT_MATCH_NO_LOC) {
            if (check_loc(c, tiers[i], off, c->block_bytes, &loc.host_ptr) < 0)
                return KVT_EPROTO;
            loc.tier = tiers[i];
            loc.offset = off;
        }
        if (step->locs && i < step->locs_cap)
            step->locs[i] = loc;
    }
    step->located = l->located;
    step->valid_until_ns = sent_ns + (uint64_t)l->lease_ms * 1000000;
    return 0;
}

/* A MATCH reply for the flags it was asked with into res and step (KVT_EPROTO when malformed):
 * the step's calls and batches. sent_ns: when the request went out (LOCATE's time limit). */
static int match_step_parse(kvt_client_t *c, const uint8_t *body, uint32_t len, unsigned flags,
                            uint32_t ntokens, uint64_t sent_ns, kvt_client_match_t *res,
                            kvt_client_step_t *step)
{
    unsigned locate = flags & KVT_MATCH_F_LOCATE, keep = flags & KVT_MATCH_F_KEEP;
    kvt_proto_match_reply_t r;
    kvt_proto_match_locs_t l;
    const uint8_t *tiers;
    if ((locate ? kvt_proto_match_reply_locs_decode(body, len, &r, &tiers, &l)
                : kvt_proto_match_reply_decode(body, len, &r, &tiers)) < 0 ||
        (r.handle && !keep))
        return KVT_EPROTO;
    res->tokens = r.tokens;
    res->pages = r.pages;
    res->remote_pages = r.remote_pages;
    res->lease = r.lease;
    if (res->tiers)
        memcpy(res->tiers, tiers, KVT_MIN(r.pages, res->tiers_cap));
    if (locate && step_locs(c, &r, tiers, &l, sent_ns, step) < 0)
        return KVT_EPROTO;
    if (keep) {
        step->handle = r.handle;
        step->kept = r.handle ? ntokens : 0;
    }
    return 0;
}

int kvt_client_match_step(kvt_client_t *c, const uint32_t *tokens, uint32_t ntokens, unsigned flags,
                          uint32_t lease_ms, const kvt_client_hints_t *hints,
                          kvt_client_match_t *res, kvt_client_step_t *step)
{
    unsigned locate = flags & KVT_MATCH_F_LOCATE, keep = flags & KVT_MATCH_F_KEEP;
    if (!c || !res || (ntokens && !tokens) || (flags & ~(unsigned)KVT_MATCH_F_ALL) ||
        ((locate || keep) && !step) || (locate && !(flags & KVT_MATCH_F_LEASE)))
        return KVT_EINVAL;
    kvt_proto_match_t m = {.hints = proto_hints(hints), .lease_ms = lease_ms, .ntokens = ntokens};
    uint8_t w[sizeof(kvt_wire_match_t)];
    kvt_proto_match_encode(w, &m);
    uint8_t *tw;
    int own = tokens_wire(c, tokens, ntokens, &tw);
    if (own < 0)
        return own;
    const uint8_t *body;
    uint32_t len;
    uint64_t sent_ns = kvt_now_ns();
    int rc = call(c, KVT_OP_MATCH, (uint16_t)flags, w, sizeof w, NULL, 0, tw, (size_t)ntokens * 4,
                  &body, &len);
    if (own)
        free(tw);
    if (rc < 0)
        return rc;
    if (match_step_parse(c, body, len, flags, ntokens, sent_ns, res, step) < 0)
        return broken_with(c, KVT_EPROTO);
    return 0;
}

static int put_parse(const uint8_t *body, uint32_t len, kvt_client_put_t *res)
{
    kvt_proto_put_reply_t r;
    if (kvt_proto_put_reply_decode(body, len, &r) < 0)
        return KVT_EPROTO;
    if (res) {
        res->pages = r.pages;
        res->new_pages = r.new_pages;
        res->stored = r.stored;
        res->skipped = r.skipped;
    }
    return 0;
}

/* PUT through the socket: the payload goes out from the caller's memory, as nparts parts of
 * part_len bytes (one buffer of the pages, or one buffer per page). */
static int put_socket_parts(kvt_client_t *c, uint32_t handle, const uint32_t *tokens,
                            uint32_t ntokens, uint32_t first_page, uint32_t npages,
                            const void *const *parts, uint32_t nparts, size_t part_len,
                            const kvt_client_hints_t *hints, kvt_client_put_t *res)
{
    kvt_proto_put_t m = {.hints = proto_hints(hints),
                         .ntokens = ntokens,
                         .first_page = first_page,
                         .npayload = npages,
                         .handle = handle};
    uint8_t w[sizeof(kvt_wire_put_t)];
    kvt_proto_put_encode(w, &m);
    uint8_t *tw;
    int own = tokens_wire(c, tokens, ntokens, &tw);
    if (own < 0)
        return own;
    const uint8_t *body;
    uint32_t len;
    c->errmsg[0] = 0;
    uint64_t id, deadline = deadline_from_now(c);
    int rc =
        send_req_parts(c, KVT_OP_PUT, (uint16_t)((handle ? KVT_PUT_F_HANDLE : 0) | c->put_flags), w,
                       sizeof w, tw, (size_t)ntokens * 4, parts, nparts, part_len, &id, deadline);
    if (own)
        free(tw);
    if (rc == 0)
        rc = read_reply(c, KVT_OP_PUT, id, &body, &len, deadline);
    if (rc < 0)
        return rc;
    if (put_parse(body, len, res) < 0)
        return broken_with(c, KVT_EPROTO);
    return 0;
}

static int put_socket(kvt_client_t *c, uint32_t handle, const uint32_t *tokens, uint32_t ntokens,
                      uint32_t first_page, uint32_t npages, const void *payload,
                      const kvt_client_hints_t *hints, kvt_client_put_t *res)
{
    return put_socket_parts(c, handle, tokens, ntokens, first_page, npages, &payload,
                            npages ? 1 : 0, (size_t)npages * c->block_bytes, hints, res);
}

/* Sends RESERVE (and, with probe, a MATCH PROBE of the same tokens right behind it, pipelined:
 * one round trip) without reading the replies; *id and *probe_id get their request ids. */
static int reserve_send(kvt_client_t *c, uint32_t handle, const uint32_t *tokens, uint32_t ntokens,
                        uint32_t first_page, uint32_t npages, const kvt_client_hints_t *hints,
                        int probe, uint64_t *id, uint64_t *probe_id, uint64_t deadline)
{
    kvt_proto_reserve_t m = {.hints = proto_hints(hints),
                             .ntokens = ntokens,
                             .first_page = first_page,
                             .npages = npages,
                             .handle = handle};
    uint8_t w[sizeof(kvt_wire_reserve_t)];
    kvt_proto_reserve_encode(w, &m);
    uint8_t *tw;
    int own = tokens_wire(c, tokens, ntokens, &tw);
    if (own < 0)
        return own;
    int rc = send_req(c, KVT_OP_RESERVE, (uint16_t)((handle ? KVT_PUT_F_HANDLE : 0) | c->put_flags),
                      w, sizeof w, NULL, 0, tw, (size_t)ntokens * 4, id, deadline);
    if (rc == 0 && probe) {
        kvt_proto_match_t mm = {.ntokens = ntokens};
        uint8_t mw[sizeof(kvt_wire_match_t)];
        kvt_proto_match_encode(mw, &mm);
        rc = send_req(c, KVT_OP_MATCH, KVT_MATCH_F_PROBE, mw, sizeof mw, NULL, 0, tw,
                      (size_t)ntokens * 4, probe_id, deadline);
        if (rc < 0) /* RESERVE went out and its reply would be left unread */
            rc = broken_with(c, rc);
    }
    if (own)
        free(tw);
    return rc;
}

static int reserve_parse(kvt_client_t *c, const uint8_t *body, uint32_t len, uint32_t first_page,
                         uint32_t npages, kvt_client_resv_t *res, uint32_t *flags);

/* Reads RESERVE's reply into res, each location checked against the mapping and the pages
 * asked for. */
static int reserve_read(kvt_client_t *c, uint64_t id, uint32_t first_page, uint32_t npages,
                        kvt_client_resv_t *res, uint32_t *flags, uint64_t deadline)
{
    const uint8_t *body;
    uint32_t len;
    int rc = read_reply(c, KVT_OP_RESERVE, id, &body, &len, deadline);
    if (rc < 0)
        return rc;
    return reserve_parse(c, body, len, first_page, npages, res, flags);
}

/* RESERVE's reply body into res (reserve_read's, and kvt__put_each_mapped's). */
static int reserve_parse(kvt_client_t *c, const uint8_t *body, uint32_t len, uint32_t first_page,
                         uint32_t npages, kvt_client_resv_t *res, uint32_t *flags)
{
    kvt_proto_reserve_reply_t r;
    if (kvt_proto_reserve_reply_decode(body, len, &r) < 0 || r.nlocs > npages ||
        (r.nlocs && !r.resv))
        return broken_with(c, KVT_EPROTO);
    for (uint32_t i = 0; i < npages; i++)
        res->ptrs[i] = NULL;
    for (uint32_t i = 0; i < r.nlocs; i++) {
        uint32_t page;
        uint64_t off;
        kvt_proto_resv_loc(&r, i, &page, &off);
        if (page < first_page || page - first_page >= npages || res->ptrs[page - first_page] ||
            off > c->map_bytes || c->block_bytes > c->map_bytes - off)
            return broken_with(c, KVT_EPROTO);
        res->ptrs[page - first_page] = c->map + off;
        warm_room(c, c->map + off, c->block_bytes);
    }
    res->id = r.resv;
    res->pages = r.pages;
    res->new_pages = r.new_pages;
    res->nreserved = r.nlocs;
    res->sealed = (r.flags & KVT_RESV_F_SEAL) != 0;
    if (flags)
        *flags = r.flags;
    return 0;
}

/* One RESERVE (its tokens after handle's, when handle is not 0) and its reply. */
static int reserve_call(kvt_client_t *c, uint32_t handle, const uint32_t *tokens, uint32_t ntokens,
                        uint32_t first_page, uint32_t npages, const kvt_client_hints_t *hints,
                        kvt_client_resv_t *res)
{
    if (!c->map) {
        snprintf(c->errmsg, sizeof c->errmsg, "RESERVE needs the zero-copy mapping (%.400s)",
                 c->zc_reason);
        return KVT_EINVAL;
    }
    c->errmsg[0] = 0;
    uint64_t id, unused, deadline = deadline_from_now(c);
    int rc = reserve_send(c, handle, tokens, ntokens, first_page, npages, hints, 0, &id, &unused,
                          deadline);
    if (rc < 0)
        return rc;
    return reserve_read(c, id, first_page, npages, res, NULL, deadline);
}

int kvt_client_reserve(kvt_client_t *c, const uint32_t *tokens, uint32_t ntokens,
                       uint32_t first_page, uint32_t npages, const kvt_client_hints_t *hints,
                       kvt_client_resv_t *res)
{
    if (!c || !res || (ntokens && !tokens) || (npages && !res->ptrs))
        return KVT_EINVAL;
    return reserve_call(c, 0, tokens, ntokens, first_page, npages, hints, res);
}

int kvt_client_reserve_kept(kvt_client_t *c, uint32_t handle, const uint32_t *tokens,
                            uint32_t ntokens, uint32_t kept, uint32_t first_page, uint32_t npages,
                            const kvt_client_hints_t *hints, kvt_client_resv_t *res)
{
    if (!c || !res || (ntokens && !tokens) || kept > ntokens || (npages && !res->ptrs))
        return KVT_EINVAL;
    if (!handle)
        return reserve_call(c, 0, tokens, ntokens, first_page, npages, hints, res);
    int rc = reserve_call(c, handle, tokens + kept, ntokens - kept, first_page, npages, hints, res);
    /* As kvt_client_put_kept's: a RESERVE's ENOENT only names the handle (gone), and changed
     * nothing, so the tokens go in full. */
    if (rc == KVT_ENOENT)
        rc = reserve_call(c, 0, tokens, ntokens, first_page, npages, hints, res);
    return rc;
}

/* COMMIT (or ABORT) of reservation id; with sums (nsums of them, little-endian u64 each, one
 * per reserved page in location order) the SUMS flag goes with them. */
static int commit_call(kvt_client_t *c, uint64_t id, uint16_t flags, const uint8_t *sums,
                       uint32_t nsums, kvt_client_put_t *res)
{
    if (!c)
        return KVT_EINVAL;
    if (!c->map) {
        snprintf(c->errmsg, sizeof c->errmsg, "COMMIT needs the zero-copy mapping (%.400s)",
                 c->zc_reason);
        return KVT_EINVAL;
    }
    uint8_t w[sizeof(kvt_wire_commit_t)];
    kvt_proto_commit_encode(w, id);
    const uint8_t *body;
    uint32_t len;
    if (sums && nsums)
        flags |= KVT_COMMIT_F_SUMS;
    int rc = call(c, KVT_OP_COMMIT, flags, w, sizeof w, sums, sums ? (size_t)nsums * 8 : 0, NULL, 0,
                  &body, &len);
    if (rc < 0)
        return rc;
    if (put_parse(body, len, res) < 0)
        return broken_with(c, KVT_EPROTO);
    return 0;
}

int kvt_client_commit(kvt_client_t *c, uint64_t id, kvt_client_put_t *res)
{
    return commit_call(c, id, 0, NULL, 0, res);
}

int kvt_client_commit_sums(kvt_client_t *c, uint64_t id, const uint64_t *sums, uint32_t nsums,
                           kvt_client_put_t *res)
{
    if (!c || !sums || !nsums)
        return KVT_EINVAL;
    /* The wire's little-endian words (the caller's are native). */
    uint8_t small[64 * 8], *w = nsums <= 64 ? small : malloc((size_t)nsums * 8);
    if (!w)
        return KVT_ENOMEM;
    for (uint32_t i = 0; i < nsums; i++)
        kvt_put_u64(w + (size_t)8 * i, sums[i]);
    int rc = commit_call(c, id, 0, w, nsums, res);
    if (w != small)
        free(w);
    return rc;
}

int kvt_client_abort(kvt_client_t *c, uint64_t id)
{
    return commit_call(c, id, KVT_COMMIT_F_ABORT, NULL, 0, NULL);
}

/*
 * PUT through the mapping: RESERVE with a MATCH PROBE behind it (one round trip), a memcpy per
 * reserved page, COMMIT. A page RESERVE gave no room either holds bytes already (the probe
 * shows its tier: nothing to send, as a socket PUT would skip it) or got no room in DRAM or is
 * being written by another request (tier NONE): those go by a socket PUT, one per run of such
 * pages, so that the daemon places them as it places any PUT's. So a PUT of held pages costs one
 * round trip and no payload, and the results add up as one socket PUT's would.
 */
/* Page i of a PUT's bytes: in one buffer (payload) or one buffer per page (blocks). */
static const uint8_t *page_at(const kvt_client_t *c, const uint8_t *payload,
                              const void *const *blocks, uint32_t i)
{
    return payload ? payload + (size_t)i * c->block_bytes : (const uint8_t *)blocks[i];
}

/* put_socket of pages [i, j) of payload or blocks; blocks are sent each from where it lies. */
static int put_socket_run(kvt_client_t *c, uint32_t handle, const uint32_t *tokens,
                          uint32_t ntokens, uint32_t first_page, uint32_t i, uint32_t j,
                          const uint8_t *payload, const void *const *blocks,
                          const kvt_client_hints_t *hints, kvt_client_put_t *res)
{
    if (payload)
        return put_socket(c, handle, tokens, ntokens, first_page + i, j - i,
                          payload + (size_t)i * c->block_bytes, hints, res);
    return put_socket_parts(c, handle, tokens, ntokens, first_page + i, j - i, blocks + i, j - i,
                            c->block_bytes, hints, res);
}

static int put_mapped(kvt_client_t *c, uint32_t handle, const uint32_t *tokens, uint32_t ntokens,
                      uint32_t first_page, uint32_t npages, const uint8_t *payload,
                      const void *const *blocks, const kvt_client_hints_t *hints,
                      kvt_client_put_t *res)
{
    void *small[16];
    void **ptrs = npages <= 16 ? small : malloc(npages * sizeof *ptrs);
    if (!ptrs)
        return KVT_ENOMEM;
    kvt_client_resv_t rv = {.ptrs = ptrs};
    c->errmsg[0] = 0;
    uint64_t id, pid, deadline = deadline_from_now(c);
    /* With a handle the probe is left out (it would send the tokens the handle saves): pages
     * RESERVE gave no room go by a socket PUT, which skips those held already. */
    int probe = !handle;
    int rc = reserve_send(c, handle, tokens, ntokens, first_page, npages, hints, probe, &id, &pid,
                          deadline);
    uint32_t rflags = 0;
    int rrc = rc < 0 ? rc : reserve_read(c, id, first_page, npages, &rv, &rflags, deadline);
    char msg[sizeof c->errmsg];
    memcpy(msg, c->errmsg, sizeof msg);
    /* The probe's reply is read whatever RESERVE answered: replies come in order. */
    const uint8_t *body = NULL;
    uint32_t len = 0;
    int prc = rc < 0 || c->broken ? KVT_ECLOSED
              : probe             ? read_reply(c, KVT_OP_MATCH, pid, &body, &len, deadline)
                                  : 0;
    kvt_proto_match_reply_t mr = {0};
    const uint8_t *tiers = NULL;
    if (prc == 0 && probe && kvt_proto_match_reply_decode(body, len, &mr, &tiers) < 0)
        prc = broken_with(c, KVT_EPROTO);
    if (c->broken) {
        rc = rrc < 0 ? rrc : prc < 0 ? prc : KVT_ECLOSED;
        goto out;
    }
    memcpy(c->errmsg, msg, sizeof msg);
    if (rrc < 0) {
        /* No reservation (ENOSPC: this connection holds max-reservations, or the index is full;
         * or RESERVE's own EINVAL): a socket PUT answers as it would have. */
        rc = put_socket_run(c, handle, tokens, ntokens, first_page, 0, npages, payload, blocks,
                            hints, res);
        goto out;
    }
    /* Which unreserved pages must still be sent: those without bytes now. tiers[] is read
     * before the next request overwrites the input buffer. */
    uint8_t need_small[16], *need = npages <= 16 ? need_small : malloc(npages);
    if (!need) {
        rc = KVT_ENOMEM;
        if (rv.id)
            kvt_client_abort(c, rv.id);
        goto out;
    }
    for (uint32_t i = 0; i < npages; i++) {
        uint32_t p = first_page + i;
        need[i] = !ptrs[i] && (!probe || p >= mr.pages || tiers[p] == KVT_TIER_NONE);
    }
    kvt_client_put_t sum = {.pages = rv.pages, .new_pages = rv.new_pages};
    rc = 0;
    if (rv.id) {
        /* The daemon seals these pages: each is hashed in the pass that copies it in (seal.c),
         * and the sums go with COMMIT, in location (page) order. */
        uint8_t sums_small[16 * 8], *sums = NULL;
        if (rflags & KVT_RESV_F_SEAL)
            sums = rv.nreserved <= 16 ? sums_small : malloc((size_t)rv.nreserved * 8);
        uint32_t k = 0;
        for (uint32_t i = 0; i < npages; i++) {
            if (!ptrs[i])
                continue;
            if (sums)
                kvt_put_u64(
                    sums + (size_t)8 * k++,
                    kvt__copy_xxh3(ptrs[i], page_at(c, payload, blocks, i), c->block_bytes));
            else
                memcpy(ptrs[i], page_at(c, payload, blocks, i), c->block_bytes);
        }
        kvt_client_put_t cr;
        /* Without room for the sums (malloc failed) the daemon seals the pages itself. */
        rc = commit_call(c, rv.id, 0, sums, k, &cr);
        if (sums != sums_small)
            free(sums);
        if (rc == KVT_ENOENT) {
            /* The reservation expired (reserve-ms) before the commit: send those pages too. */
            for (uint32_t i = 0; i < npages; i++)
                need[i] |= ptrs[i] != NULL;
            rc = 0;
        } else if (rc == 0) {
            sum.stored += cr.stored;
        }
    }
    for (uint32_t i = 0; rc == 0 && i < npages;) {
        if (!need[i]) {
            i++;
            continue;
        }
        uint32_t j = i;
        while (j < npages && need[j])
            j++;
        kvt_client_put_t pr;
        rc = put_socket_run(c, handle, tokens, ntokens, first_page, i, j, payload, blocks, hints,
                            &pr);
        if (rc == 0) {
            sum.new_pages += pr.new_pages;
            sum.stored += pr.stored;
        }
        i = j;
    }
    if (need != need_small)
        free(need);
    if (rc == 0) {
        sum.skipped = npages - sum.stored;
        if (res)
            *res = sum;
    }
out:
    if (ptrs != small)
        free(ptrs);
    return rc;
}

/* One key of kvt__put_each_mapped's group: its requests' ids and what their replies said. */
typedef struct each_ent {
    uint64_t resv_req, probe_req, commit_req;
    uint64_t resv;      /* the reservation's id, 0 for none */
    void *room;         /* where its block goes in the mapping, or NULL */
    kvt_client_put_t r; /* its result so far */
    int st;             /* RESERVE's status, then the key's */
    int need;           /* to go by a socket PUT: no room and no bytes held */
} each_ent_t;

/* Appends one request frame (fixed part, then tokens) to out at *at; *id gets its request id. */
static void each_frame(kvt_client_t *c, uint8_t *out, size_t *at, unsigned op, uint16_t flags,
                       const void *fixed, size_t flen, const void *tail, size_t tlen, uint64_t *id)
{
    *id = c->next_id++;
    kvt_proto_frame(out + *at, op, flags, *id, 0, (uint32_t)(flen + tlen));
    memcpy(out + *at + KVT_PROTO_HDR, fixed, flen);
    if (tlen)
        memcpy(out + *at + KVT_PROTO_HDR + flen, tail, tlen);
    *at += KVT_PROTO_HDR + flen + tlen;
}

/* A transport failure in the middle of a group: the statuses not yet set say so too. */
static int each_broken(int rc, int *status, uint32_t from, uint32_t n)
{
    for (uint32_t i = from; i < n; i++)
        status[i] = KVT_ECLOSED;
    return rc < 0 ? rc : KVT_ECLOSED;
}

/* One group (n <= KVT_EACH_GROUP) of kvt__put_each_mapped, its frames built in out. */
static int each_group(kvt_client_t *c, const uint32_t *tokens, uint32_t ntokens, uint32_t n,
                      const void *const *blocks, kvt_client_put_t *res, int *status, uint8_t *out)
{
    each_ent_t e[KVT_EACH_GROUP];
    size_t tlen = (size_t)ntokens * 4, at = 0;
    uint64_t deadline = deadline_from_now(c);
    c->errmsg[0] = 0;
    /* RELEASEs waiting to go are sent and answered first: their ids come before the group's. */
    int rc = drain_later(c, deadline);
    if (rc < 0)
        return each_broken(rc, status, 0, n);
    kvt_proto_reserve_t rm = {.ntokens = ntokens, .npages = 1};
    uint8_t rw[sizeof(kvt_wire_reserve_t)];
    kvt_proto_reserve_encode(rw, &rm);
    for (uint32_t i = 0; i < n; i++) {
        uint8_t *tw;
        int own = tokens_wire(c, tokens + (size_t)i * ntokens, ntokens, &tw);
        if (own < 0)
            return own; /* nothing sent yet */
        each_frame(c, out, &at, KVT_OP_RESERVE, c->put_flags, rw, sizeof rw, tw, tlen,
                   &e[i].resv_req);
        if (own)
            free(tw);
    }
    if ((rc = send_all(c, out, at, deadline)) < 0)
        return each_broken(rc, status, 0, n);
    int seal = 0;
    uint32_t probes = 0;
    for (uint32_t i = 0; i < n; i++) {
        const uint8_t *body;
        uint32_t len, fl = 0;
        e[i].room = NULL;
        kvt_client_resv_t rv = {.ptrs = &e[i].room};
        rc = read_reply(c, KVT_OP_RESERVE, e[i].resv_req, &body, &len, deadline);
        if (rc == 0)
            rc = reserve_parse(c, body, len, 0, 1, &rv, &fl);
        if (c->broken)
            return each_broken(rc, status, 0, n);
        e[i].st = rc;
        e[i].resv = rc == 0 ? rv.id : 0;
        e[i].r = (kvt_client_put_t){.pages = rv.pages, .new_pages = rv.new_pages};
        seal |= rc == 0 && rv.id && (fl & KVT_RESV_F_SEAL);
        /* No reservation at all (its error): a socket PUT answers as it would have. No room:
         * held already, or to be sent (the probe below says which). */
        e[i].need = e[i].st < 0;
        e[i].probe_req = 0;
        probes += e[i].st == 0 && !e[i].room;
    }
    /* Only keys RESERVE gave no room are probed, in one more round trip (put_mapped pipelines a
     * probe behind every RESERVE: here that would be a request more per key on the common path,
     * where every key gets room). */
    if (probes) {
        kvt_proto_match_t mm = {.ntokens = ntokens};
        uint8_t mw[sizeof(kvt_wire_match_t)];
        kvt_proto_match_encode(mw, &mm);
        at = 0;
        for (uint32_t i = 0; i < n; i++) {
            if (e[i].st < 0 || e[i].room)
                continue;
            uint8_t *tw;
            int own = tokens_wire(c, tokens + (size_t)i * ntokens, ntokens, &tw);
            if (own < 0) {
                e[i].need = 1; /* no way to look: sent, as a socket PUT skips it if held */
                continue;
            }
            each_frame(c, out, &at, KVT_OP_MATCH, KVT_MATCH_F_PROBE, mw, sizeof mw, tw, tlen,
                       &e[i].probe_req);
            if (own)
                free(tw);
        }
        if (at && (rc = send_all(c, out, at, deadline)) < 0)
            return each_broken(rc, status, 0, n);
        for (uint32_t i = 0; i < n; i++) {
            if (!e[i].probe_req)
                continue;
            const uint8_t *body, *tiers;
            uint32_t len;
            kvt_proto_match_reply_t mr;
            rc = read_reply(c, KVT_OP_MATCH, e[i].probe_req, &body, &len, deadline);
            if (rc == 0 && kvt_proto_match_reply_decode(body, len, &mr, &tiers) < 0)
                rc = broken_with(c, KVT_EPROTO);
            if (c->broken)
                return each_broken(rc, status, 0, n);
            e[i].need = rc < 0 || mr.pages < 1 || tiers[0] == KVT_TIER_NONE;
        }
    }
    /* The copies, then the COMMITs in one go; with the daemon sealing, each page is hashed in
     * the pass that copies it and its sum goes with its COMMIT. */
    at = 0;
    uint8_t cw[sizeof(kvt_wire_commit_t)], sum[8];
    for (uint32_t i = 0; i < n; i++) {
        if (!e[i].resv)
            continue;
        if (e[i].room && seal)
            kvt_put_u64(sum, kvt__copy_xxh3(e[i].room, blocks[i], c->block_bytes));
        else if (e[i].room)
            memcpy(e[i].room, blocks[i], c->block_bytes);
        kvt_proto_commit_encode(cw, e[i].resv);
        int sums = seal && e[i].room;
        each_frame(c, out, &at, KVT_OP_COMMIT, sums ? KVT_COMMIT_F_SUMS : 0, cw, sizeof cw, sum,
                   sums ? sizeof sum : 0, &e[i].commit_req);
    }
    if (at && (rc = send_all(c, out, at, deadline)) < 0)
        return each_broken(rc, status, 0, n);
    for (uint32_t i = 0; i < n; i++) {
        if (!e[i].resv)
            continue;
        const uint8_t *body;
        uint32_t len;
        kvt_client_put_t cr = {0};
        rc = read_reply(c, KVT_OP_COMMIT, e[i].commit_req, &body, &len, deadline);
        if (rc == 0 && put_parse(body, len, &cr) < 0)
            rc = broken_with(c, KVT_EPROTO);
        if (c->broken)
            return each_broken(rc, status, 0, n);
        if (rc == KVT_ENOENT)
            e[i].need = 1; /* the reservation expired (reserve-ms) before the commit: send it */
        else if (rc < 0)
            e[i].st = rc;
        else
            e[i].r.stored += cr.stored;
    }
    for (uint32_t i = 0; i < n; i++) {
        if (e[i].need) {
            kvt_client_put_t pr = {0};
            int was = e[i].st;
            rc =
                put_socket(c, 0, tokens + (size_t)i * ntokens, ntokens, 0, 1, blocks[i], NULL, &pr);
            if (c->broken)
                return each_broken(rc, status, 0, n);
            e[i].st = rc;
            if (rc == 0 && was < 0) {
                e[i].r = pr; /* no reservation: the socket PUT's answer is the whole answer */
            } else if (rc == 0) {
                e[i].r.new_pages += pr.new_pages;
                e[i].r.stored += pr.stored;
            }
        }
        if (e[i].st == 0) {
            e[i].r.skipped = 1 - e[i].r.stored;
            res[i] = e[i].r;
        }
        status[i] = e[i].st;
    }
    return 0;
}

int kvt__put_each_mapped(kvt_client_t *c, const uint32_t *tokens, uint32_t ntokens, uint32_t n,
                         const void *const *blocks, kvt_client_put_t *res, int *status)
{
    if (!c || !c->map || !c->block_bytes || (n && (!tokens || !blocks || !res || !status)) ||
        ntokens != c->page_size)
        return KVT_EINVAL;
    if (c->broken)
        return each_broken(KVT_ECLOSED, status, 0, n);
    /* Room for a group's biggest write: a RESERVE, a PROBE or a COMMIT with its sum per key. */
    size_t per = 2 * KVT_PROTO_HDR + sizeof(kvt_wire_reserve_t) + sizeof(kvt_wire_match_t) +
                 (size_t)ntokens * 8;
    uint8_t *out = malloc(per * KVT_EACH_GROUP);
    if (!out)
        return KVT_ENOMEM;
    int rc = 0;
    for (uint32_t at = 0; at < n && rc == 0; at += KVT_EACH_GROUP) {
        uint32_t g = n - at < KVT_EACH_GROUP ? n - at : KVT_EACH_GROUP;
        rc = each_group(c, tokens + (size_t)at * ntokens, ntokens, g, blocks + at, res + at,
                        status + at, out);
        if (rc < 0)
            (void)each_broken(rc, status, at + g, n);
    }
    free(out);
    return rc;
}

unsigned kvt_client_set_put_flags(kvt_client_t *c, unsigned flags)
{
    if (!c)
        return 0;
    unsigned was = c->put_flags & KVT_PUT_F_GAPS ? KVT_CLIENT_PUT_GAPS : 0;
    c->put_flags = flags & KVT_CLIENT_PUT_GAPS ? KVT_PUT_F_GAPS : 0;
    return was;
}

int kvt_client_put(kvt_client_t *c, const uint32_t *tokens, uint32_t ntokens, uint32_t first_page,
                   uint32_t npages, const void *payload, const kvt_client_hints_t *hints,
                   kvt_client_put_t *res)
{
    if (!c || (ntokens && !tokens) || (npages && (!payload || !c->block_bytes)))
        return KVT_EINVAL;
    if (c->map && npages)
        return put_mapped(c, 0, tokens, ntokens, first_page, npages, payload, NULL, hints, res);
    return put_socket(c, 0, tokens, ntokens, first_page, npages, payload, hints, res);
}

int kvt_client_putv(kvt_client_t *c, const uint32_t *tokens, uint32_t ntokens, uint32_t first_page,
                    uint32_t npages, const void *const *blocks, const kvt_client_hints_t *hints,
                    kvt_client_put_t *res)
{
    if (!c || (ntokens && !tokens) || (npages && (!blocks || !c->block_bytes)))
        return KVT_EINVAL;
    for (uint32_t i = 0; i < npages; i++)
        if (!blocks[i])
            return KVT_EINVAL;
    if (c->map && npages)
        return put_mapped(c, 0, tokens, ntokens, first_page, npages, NULL, blocks, hints, res);
    return put_socket_run(c, 0, tokens, ntokens, first_page, 0, npages, NULL, blocks, hints, res);
}

/* kvt_client_put_kept and _putv_kept: payload (one buffer) or blocks (one per page). */
static int put_kept(kvt_client_t *c, uint32_t handle, const uint32_t *tokens, uint32_t ntokens,
                    uint32_t kept, uint32_t first_page, uint32_t npages, const uint8_t *payload,
                    const void *const *blocks, const kvt_client_hints_t *hints,
                    kvt_client_put_t *res)
{
    if (!handle)
        return blocks ? kvt_client_putv(c, tokens, ntokens, first_page, npages, blocks, hints, res)
                      : kvt_client_put(c, tokens, ntokens, first_page, npages, payload, hints, res);
    int rc = c->map && npages ? put_mapped(c, handle, tokens + kept, ntokens - kept, first_page,
                                           npages, payload, blocks, hints, res)
             : blocks ? put_socket_run(c, handle, tokens + kept, ntokens - kept, first_page, 0,
                                       npages, NULL, blocks, hints, res)
                      : put_socket(c, handle, tokens + kept, ntokens - kept, first_page, npages,
                                   payload, hints, res);
    /* ENOENT only names the handle (a PUT has no other): gone, so the tokens go in full. A
     * mapped PUT's reservation failing so fell back to a socket PUT, answered the same. */
    if (rc == KVT_ENOENT)
        rc = blocks ? kvt_client_putv(c, tokens, ntokens, first_page, npages, blocks, hints, res)
                    : kvt_client_put(c, tokens, ntokens, first_page, npages, payload, hints, res);
    return rc;
}

int kvt_client_put_kept(kvt_client_t *c, uint32_t handle, const uint32_t *tokens, uint32_t ntokens,
                        uint32_t kept, uint32_t first_page, uint32_t npages, const void *payload,
                        const kvt_client_hints_t *hints, kvt_client_put_t *res)
{
    if (!c || (ntokens && !tokens) || kept > ntokens || (npages && (!payload || !c->block_bytes)))
        return KVT_EINVAL;
    return put_kept(c, handle, tokens, ntokens, kept, first_page, npages, payload, NULL, hints,
                    res);
}

int kvt_client_putv_kept(kvt_client_t *c, uint32_t handle, const uint32_t *tokens, uint32_t ntokens,
                         uint32_t kept, uint32_t first_page, uint32_t npages,
                         const void *const *blocks, const kvt_client_hints_t *hints,
                         kvt_client_put_t *res)
{
    if (!c || (ntokens && !tokens) || kept > ntokens || (npages && (!blocks || !c->block_bytes)))
        return KVT_EINVAL;
    for (uint32_t i = 0; i < npages; i++)
        if (!blocks[i])
            return KVT_EINVAL;
    return put_kept(c, handle, tokens, ntokens, kept, first_page, npages, NULL,
                    npages ? blocks : NULL, hints, res);
}

/* Where a located page lies: a pointer into the DRAM mapping, or an offset into the HBM pool.
 * KVT_EPROTO for a location outside them or of another length than a block. */
static int check_loc(const kvt_client_t *c, uint8_t tier, uint64_t off, uint32_t len,
                     const void **host)
{
    if (len != c->block_bytes)
        return KVT_EPROTO;
    if (tier == KVT_TIER_DRAM && c->map && off <= c->map_bytes && len <= c->map_bytes - off) {
        *host = c->map + off;
        return 0;
    }
    if (tier == KVT_TIER_HBM && c->hbm_mapped && off <= c->hbm_bytes && len <= c->hbm_bytes - off) {
        *host = NULL;
        return 0;
    }
    return KVT_EPROTO;
}

/*
 * One GET, each page handed to cb in kvt_client_loc_cb's shape. With locate, the request asks
 * for locations, and the end frame's lease_ms_left is checked against the time since the request
 * went out: the lease's expiry lies at least lease_ms_left after the send (the daemon built the
 * reply after it received the request), so reads that ended before then read the leased bytes.
 */
static int get_run(kvt_client_t *c, uint64_t lease, uint32_t first_page, uint32_t npages,
                   int locate, kvt_client_loc_cb cb, void *arg, uint32_t *got)
{
    if (c->broken)
        return KVT_ECLOSED;
    c->errmsg[0] = 0;
    kvt_proto_get_t m = {.lease = lease, .first_page = first_page, .npages = npages};
    uint64_t id = c->next_id++, deadline = deadline_from_now(c);
    uint8_t frame[KVT_PROTO_HDR + sizeof(kvt_wire_get_t)];
    kvt_proto_frame(frame, KVT_OP_GET, locate ? KVT_GET_F_LOCATE : 0, id, 0,
                    sizeof(kvt_wire_get_t));
    kvt_proto_get_encode(frame + KVT_PROTO_HDR, &m);
    uint64_t sent_ns = kvt_now_ns();
    int rc = flush_later(c, deadline);
    if (rc == 0)
        rc = send_all(c, frame, sizeof frame, deadline);
    if (rc < 0)
        return rc;
    int stop = 0, located = 0;
    uint32_t n = 0;
    for (;;) {
        kvt_proto_hdr_t h;
        const uint8_t *body;
        /* Each block frame restarts the clock: a long GET is fine while data flows. */
        if ((rc = read_frame(c, &h, &body, deadline_from_now(c))) < 0)
            return rc;
        if ((rc = check_reply(c, &h, KVT_OP_GET, id)) < 0)
            return rc;
        if (!(h.flags & KVT_RF_MORE)) {
            if (got)
                *got = n;
            if (h.status < 0) {
                /* An end frame's body is the count of pages sent, not a message. */
                snprintf(c->errmsg, sizeof c->errmsg,
                         "the stream stopped after %u page%s (the daemon's log says why)", n,
                         n == 1 ? "" : "s");
                return h.status;
            }
            uint32_t sent, left_ms;
            if (kvt_proto_get_end_decode(body, h.body_len, &sent, &left_ms) < 0 || sent != n)
                return broken_with(c, KVT_EPROTO);
            if (stop)
                return stop;
            uint64_t took_ns = kvt_now_ns() - sent_ns;
            if (located && took_ns >= (uint64_t)left_ms * 1000000) {
                snprintf(c->errmsg, sizeof c->errmsg,
                         "the lease had %u ms left and the GET took %llu ms: the mapped pages "
                         "may have been reused before they were read",
                         left_ms, (unsigned long long)(took_ns / 1000000));
                return KVT_ETIMEDOUT;
            }
            return 0;
        }
        uint32_t page, dlen;
        uint8_t tier;
        int kind = kvt_proto_get_data_kind(body, h.body_len);
        if (kind == KVT_GET_DATA_LOC && locate) {
            uint64_t off;
            const void *host;
            if (kvt_proto_get_loc_decode(body, h.body_len, &page, &tier, &off, &dlen) < 0 ||
                check_loc(c, tier, off, dlen, &host) < 0)
                return broken_with(c, KVT_EPROTO);
            located = 1;
            if (!stop)
                stop = cb(arg, page, tier, host, off, dlen, NULL);
        } else {
            const uint8_t *data;
            if (kind != KVT_GET_DATA_BYTES ||
                kvt_proto_get_data_decode(body, h.body_len, &page, &tier, &data, &dlen) < 0)
                return broken_with(c, KVT_EPROTO);
            if (!stop)
                stop = cb(arg, page, tier, NULL, 0, dlen, data);
        }
        n++;
    }
}

int kvt_client_get_loc(kvt_client_t *c, uint64_t lease, uint32_t first_page, uint32_t npages,
                       kvt_client_loc_cb cb, void *arg)
{
    if (!c || !cb)
        return KVT_EINVAL;
    return get_run(c, lease, first_page, npages, 1, cb, arg, NULL);
}

typedef struct kvt_block_fwd {
    kvt_client_block_cb cb;
    void *arg;
} kvt_block_fwd_t;

/* kvt_client_get_cb's callback behind get_run's: host bytes, wherever they lie. */
static int block_fwd(void *arg, uint32_t page, unsigned tier, const void *host, uint64_t off,
                     uint32_t len, const void *data)
{
    (void)off;
    kvt_block_fwd_t *f = arg;
    if (!host && !data)
        return KVT_EPROTO; /* HBM: not asked for by get/get_cb (see get_locates) */
    return f->cb(f->arg, page, tier, host ? host : data, len);
}

/* get and get_cb ask for locations when they can deliver every one as host bytes: with the DRAM
 * arena mapped, and not HBM (whose pages only kvt_client_get_loc can hand over). */
static int get_locates(const kvt_client_t *c)
{
    return c->map && !c->hbm_mapped;
}

int kvt_client_get_cb(kvt_client_t *c, uint64_t lease, uint32_t first_page, uint32_t npages,
                      kvt_client_block_cb cb, void *arg, uint32_t *got)
{
    if (!c || !cb)
        return KVT_EINVAL;
    kvt_block_fwd_t f = {cb, arg};
    return get_run(c, lease, first_page, npages, get_locates(c), block_fwd, &f, got);
}

typedef struct kvt_get_buf {
    uint8_t *buf;
    size_t cap, off;
    uint8_t *tiers;
    uint32_t i, first;
} kvt_get_buf_t;

static int get_into(void *arg, uint32_t page, unsigned tier, const void *data, uint32_t len)
{
    kvt_get_buf_t *g = arg;
    if (g->off + len > g->cap || page != g->first + g->i)
        return KVT_ETOOBIG;
    memcpy(g->buf + g->off, data, len);
    g->off += len;
    if (g->tiers)
        g->tiers[g->i] = (uint8_t)tier;
    g->i++;
    return 0;
}

int kvt_client_get(kvt_client_t *c, uint64_t lease, uint32_t first_page, uint32_t npages, void *buf,
                   size_t cap, uint32_t *got, uint8_t *tiers)
{
    if (!c || (!buf && cap))
        return KVT_EINVAL;
    kvt_get_buf_t g = {.buf = buf, .cap = cap, .tiers = tiers, .first = first_page};
    return kvt_client_get_cb(c, lease, first_page, npages, get_into, &g, got);
}

static int prefetch_parse(const uint8_t *body, uint32_t len, kvt_client_prefetch_t *res)
{
    kvt_proto_prefetch_reply_t r;
    if (kvt_proto_prefetch_reply_decode(body, len, &r) < 0)
        return KVT_EPROTO;
    if (res) {
        res->pages = r.pages;
        res->moved = r.moved;
        res->resident = r.resident;
        res->failed = r.failed;
    }
    return 0;
}

static int prefetch_call(kvt_client_t *c, unsigned flags, const uint32_t *tokens, uint32_t ntokens,
                         unsigned tier, uint32_t deadline_ms, kvt_client_prefetch_t *res)
{
    if (!c || (ntokens && !tokens))
        return KVT_EINVAL;
    kvt_proto_prefetch_t m = {.tier = tier, .deadline_ms = deadline_ms, .ntokens = ntokens};
    uint8_t w[sizeof(kvt_wire_prefetch_t)];
    kvt_proto_prefetch_encode(w, &m);
    uint8_t *tw;
    int own = tokens_wire(c, tokens, ntokens, &tw);
    if (own < 0)
        return own;
    const uint8_t *body;
    uint32_t len;
    int rc =
        call(c, KVT_OP_PREFETCH, flags, w, sizeof w, NULL, 0, tw, (size_t)ntokens * 4, &body, &len);
    if (own)
        free(tw);
    if (rc < 0)
        return rc;
    if (prefetch_parse(body, len, res) < 0)
        return broken_with(c, KVT_EPROTO);
    return 0;
}

int kvt_client_prefetch(kvt_client_t *c, const uint32_t *tokens, uint32_t ntokens, unsigned tier,
                        uint32_t deadline_ms, kvt_client_prefetch_t *res)
{
    return prefetch_call(c, 0, tokens, ntokens, tier, deadline_ms, res);
}

int kvt_client_prefetch_start(kvt_client_t *c, const uint32_t *tokens, uint32_t ntokens,
                              unsigned tier, uint32_t deadline_ms, kvt_client_prefetch_t *res)
{
    return prefetch_call(c, KVT_PREFETCH_F_START, tokens, ntokens, tier, deadline_ms, res);
}

int kvt_client_release(kvt_client_t *c, uint64_t lease, int *released)
{
    if (!c)
        return KVT_EINVAL;
    uint8_t w[sizeof(kvt_wire_release_t)];
    kvt_proto_release_encode(w, lease);
    const uint8_t *body;
    uint32_t len;
    int rc = call(c, KVT_OP_RELEASE, 0, w, sizeof w, NULL, 0, NULL, 0, &body, &len);
    if (rc < 0)
        return rc;
    uint32_t n;
    if (kvt_proto_release_reply_decode(body, len, &n) < 0)
        return broken_with(c, KVT_EPROTO);
    if (released)
        *released = n != 0;
    return 0;
}

int kvt_client_release_later(kvt_client_t *c, uint64_t lease)
{
    if (!c)
        return KVT_EINVAL;
    uint64_t id, deadline = deadline_from_now(c);
    int rc;
    /* The replies waiting must have ids that run on to this one (a batch queued meanwhile took
     * ids): otherwise they are read first. */
    if (c->later && c->next_id != c->later_id + c->later && (rc = drain_later(c, deadline)) < 0)
        return rc;
    if (c->broken)
        return KVT_ECLOSED;
    size_t f = KVT_PROTO_HDR + sizeof(kvt_wire_release_t);
    if (c->later_len + f > sizeof c->later_out && (rc = flush_later(c, deadline)) < 0)
        return rc;
    id = c->next_id++;
    kvt_proto_frame(c->later_out + c->later_len, KVT_OP_RELEASE, 0, id, 0,
                    sizeof(kvt_wire_release_t));
    kvt_proto_release_encode(c->later_out + c->later_len + KVT_PROTO_HDR, lease);
    c->later_len += f;
    if (!c->later)
        c->later_id = id;
    c->later++;
    return 0;
}

static int remove_call(kvt_client_t *c, unsigned flags, const uint32_t *tokens, uint32_t ntokens)
{
    if (!c || (ntokens && !tokens))
        return KVT_EINVAL;
    uint8_t w[sizeof(kvt_wire_remove_t)];
    kvt_proto_remove_encode(w, ntokens);
    uint8_t *tw;
    int own = tokens_wire(c, tokens, ntokens, &tw);
    if (own < 0)
        return own;
    const uint8_t *body;
    uint32_t len;
    int rc =
        call(c, KVT_OP_REMOVE, flags, w, sizeof w, NULL, 0, tw, (size_t)ntokens * 4, &body, &len);
    if (own)
        free(tw);
    return rc;
}

int kvt_client_remove(kvt_client_t *c, const uint32_t *tokens, uint32_t ntokens)
{
    return remove_call(c, 0, tokens, ntokens);
}

int kvt_client_remove_nowait(kvt_client_t *c, const uint32_t *tokens, uint32_t ntokens)
{
    return remove_call(c, KVT_REMOVE_F_NOWAIT, tokens, ntokens);
}

int kvt_client_stats(kvt_client_t *c, kvt_client_stat_cb cb, void *arg)
{
    if (!c || !cb)
        return KVT_EINVAL;
    const uint8_t *body;
    uint32_t len;
    int rc = call(c, KVT_OP_STATS, 0, NULL, 0, NULL, 0, NULL, 0, &body, &len);
    if (rc < 0)
        return rc;
    kvt_proto_stats_iter_t it;
    char name[256];
    uint64_t v;
    if (kvt_proto_stats_begin(&it, body, len) < 0)
        return broken_with(c, KVT_EPROTO);
    while ((rc = kvt_proto_stats_next(&it, name, &v)) > 0)
        if (cb(arg, name, v))
            break;
    return rc < 0 ? broken_with(c, KVT_EPROTO) : 0;
}

/* ---- batches ---- */

typedef struct kvt_batch_ent {
    unsigned op;
    uint64_t id;
    int *status;
    void *res;
    kvt_client_step_t *step; /* kvt_batch_match_step's */
    uint16_t flags;
    uint32_t ntokens;
} kvt_batch_ent_t;

/* A piece of a batch's output: bytes of out ([off, off + len)), or, with ptr set, a payload the
 * caller lent (kvt_batch_put_ref) sent from where it lies. */
typedef struct kvt_batch_seg {
    const uint8_t *ptr;
    size_t off, len;
} kvt_batch_seg_t;

struct kvt_batch {
    kvt_client_t *c;
    uint8_t *out;
    size_t out_len, out_cap;
    kvt_batch_ent_t *ents;
    size_t n, cap;
    /* The output in order: out's bytes up to out_cut, then lent payloads between them. With
     * nothing lent, one piece (out) at run time. */
    kvt_batch_seg_t *segs;
    size_t nsegs, cap_segs, out_cut;
    uint64_t sent_ns; /* when the run began to send: LOCATE's time limits count from there */
};

int kvt_batch_create(kvt_batch_t **out, kvt_client_t *c)
{
    if (!out || !c)
        return KVT_EINVAL;
    kvt_batch_t *b = calloc(1, sizeof *b);
    if (!b)
        return KVT_ENOMEM;
    b->c = c;
    *out = b;
    return 0;
}

void kvt_batch_destroy(kvt_batch_t *b)
{
    if (!b)
        return;
    free(b->out);
    free(b->ents);
    free(b->segs);
    free(b);
}

void kvt_batch_reset(kvt_batch_t *b)
{
    b->out_len = 0;
    b->n = 0;
    b->nsegs = 0;
    b->out_cut = 0;
}

/* Ends the piece of out that runs up to out_len (if any) before the next lent payload, or
 * before the run. */
static int batch_cut(kvt_batch_t *b)
{
    if (b->out_len == b->out_cut)
        return 0;
    if (kvt_reserve(&b->segs, &b->cap_segs, b->nsegs + 1, sizeof *b->segs, 16) < 0)
        return KVT_ENOMEM;
    b->segs[b->nsegs++] = (kvt_batch_seg_t){.off = b->out_cut, .len = b->out_len - b->out_cut};
    b->out_cut = b->out_len;
    return 0;
}

size_t kvt_batch_size(const kvt_batch_t *b)
{
    return b->n;
}

static int batch_add(kvt_batch_t *b, unsigned op, uint16_t flags, const void *p1, size_t l1,
                     const void *p2, size_t l2, const void *p3, size_t l3, int lend, void *res,
                     int *status)
{
    size_t blen = l1 + l2 + l3, copied = lend ? l1 + l2 : blen;
    if (blen > b->c->max_frame)
        return KVT_ETOOBIG;
    if (kvt_reserve(&b->ents, &b->cap, b->n + 1, sizeof *b->ents, 64) < 0)
        return KVT_ENOMEM;
    if (kvt_reserve(&b->out, &b->out_cap, b->out_len + KVT_PROTO_HDR + copied, 1, 4096) < 0)
        return KVT_ENOMEM;
    if (lend && l3 && kvt_reserve(&b->segs, &b->cap_segs, b->nsegs + 2, sizeof *b->segs, 16) < 0)
        return KVT_ENOMEM; /* room for batch_cut's piece and the payload's: neither fails now */
    uint64_t id = b->c->next_id++;
    uint8_t *f = b->out + b->out_len;
    kvt_proto_frame(f, op, flags, id, 0, (uint32_t)blen);
    f += KVT_PROTO_HDR;
    if (l1)
        memcpy(f, p1, l1);
    if (l2)
        memcpy(f + l1, p2, l2);
    if (l3 && !lend)
        memcpy(f + l1 + l2, p3, l3);
    b->out_len += KVT_PROTO_HDR + copied;
    if (lend && l3) {
        (void)batch_cut(b);
        b->segs[b->nsegs++] = (kvt_batch_seg_t){.ptr = p3, .len = l3};
    }
    b->ents[b->n++] = (kvt_batch_ent_t){.op = op, .id = id, .status = status, .res = res};
    if (status)
        *status = KVT_EAGAIN; /* until run */
    return 0;
}

int kvt_batch_ping(kvt_batch_t *b, int *status)
{
    if (!b)
        return KVT_EINVAL;
    return batch_add(b, KVT_OP_PING, 0, NULL, 0, NULL, 0, NULL, 0, 0, NULL, status);
}

/* Queues a frame of a fixed part, the tokens (as the wire has them), then payload. */
static int batch_tokens(kvt_batch_t *b, uint8_t op, uint16_t flags, const void *fixed, size_t flen,
                        const uint32_t *tokens, uint32_t ntokens, const void *payload, size_t plen,
                        int lend, void *res, int *status)
{
    uint8_t *tw;
    int own = tokens_wire(b->c, tokens, ntokens, &tw);
    if (own < 0)
        return own;
    int rc = batch_add(b, op, flags, fixed, flen, tw, (size_t)ntokens * 4, payload, plen, lend, res,
                       status);
    if (own)
        free(tw);
    return rc;
}

int kvt_batch_match(kvt_batch_t *b, const uint32_t *tokens, uint32_t ntokens, unsigned flags,
                    uint32_t lease_ms, const kvt_client_hints_t *hints, kvt_client_match_t *res,
                    int *status)
{
    return kvt_batch_match_step(b, tokens, ntokens, flags, lease_ms, hints, res, NULL, status);
}

int kvt_batch_match_step(kvt_batch_t *b, const uint32_t *tokens, uint32_t ntokens, unsigned flags,
                         uint32_t lease_ms, const kvt_client_hints_t *hints,
                         kvt_client_match_t *res, kvt_client_step_t *step, int *status)
{
    unsigned locate = flags & KVT_MATCH_F_LOCATE, keep = flags & KVT_MATCH_F_KEEP;
    if (!b || !res || (ntokens && !tokens) || (flags & ~(unsigned)KVT_MATCH_F_ALL) ||
        ((locate || keep) && !step) || (locate && !(flags & KVT_MATCH_F_LEASE)))
        return KVT_EINVAL;
    kvt_proto_match_t m = {.hints = proto_hints(hints), .lease_ms = lease_ms, .ntokens = ntokens};
    uint8_t w[sizeof(kvt_wire_match_t)];
    kvt_proto_match_encode(w, &m);
    int rc = batch_tokens(b, KVT_OP_MATCH, (uint16_t)flags, w, sizeof w, tokens, ntokens, NULL, 0,
                          0, res, status);
    if (rc == 0) {
        b->ents[b->n - 1].step = step;
        b->ents[b->n - 1].flags = (uint16_t)flags;
        b->ents[b->n - 1].ntokens = ntokens;
    }
    return rc;
}

static int batch_put(kvt_batch_t *b, const uint32_t *tokens, uint32_t ntokens, uint32_t first_page,
                     uint32_t npages, const void *payload, int lend,
                     const kvt_client_hints_t *hints, kvt_client_put_t *res, int *status)
{
    if (!b || (ntokens && !tokens) || (npages && (!payload || !b->c->block_bytes)))
        return KVT_EINVAL;
    kvt_proto_put_t m = {.hints = proto_hints(hints),
                         .ntokens = ntokens,
                         .first_page = first_page,
                         .npayload = npages};
    uint8_t w[sizeof(kvt_wire_put_t)];
    kvt_proto_put_encode(w, &m);
    return batch_tokens(b, KVT_OP_PUT, b->c->put_flags, w, sizeof w, tokens, ntokens, payload,
                        (size_t)npages * b->c->block_bytes, lend, res, status);
}

int kvt_batch_put(kvt_batch_t *b, const uint32_t *tokens, uint32_t ntokens, uint32_t first_page,
                  uint32_t npages, const void *payload, const kvt_client_hints_t *hints,
                  kvt_client_put_t *res, int *status)
{
    return batch_put(b, tokens, ntokens, first_page, npages, payload, 0, hints, res, status);
}

int kvt_batch_put_ref(kvt_batch_t *b, const uint32_t *tokens, uint32_t ntokens, uint32_t first_page,
                      uint32_t npages, const void *payload, const kvt_client_hints_t *hints,
                      kvt_client_put_t *res, int *status)
{
    return batch_put(b, tokens, ntokens, first_page, npages, payload, 1, hints, res, status);
}

static int batch_prefetch_flags(kvt_batch_t *b, unsigned flags, const uint32_t *tokens,
                                uint32_t ntokens, unsigned tier, uint32_t deadline_ms,
                                kvt_client_prefetch_t *res, int *status)
{
    if (!b || (ntokens && !tokens))
        return KVT_EINVAL;
    kvt_proto_prefetch_t m = {.tier = tier, .deadline_ms = deadline_ms, .ntokens = ntokens};
    uint8_t w[sizeof(kvt_wire_prefetch_t)];
    kvt_proto_prefetch_encode(w, &m);
    return batch_tokens(b, KVT_OP_PREFETCH, flags, w, sizeof w, tokens, ntokens, NULL, 0, 0, res,
                        status);
}

int kvt_batch_prefetch(kvt_batch_t *b, const uint32_t *tokens, uint32_t ntokens, unsigned tier,
                       uint32_t deadline_ms, kvt_client_prefetch_t *res, int *status)
{
    return batch_prefetch_flags(b, 0, tokens, ntokens, tier, deadline_ms, res, status);
}

int kvt_batch_prefetch_start(kvt_batch_t *b, const uint32_t *tokens, uint32_t ntokens,
                             unsigned tier, uint32_t deadline_ms, kvt_client_prefetch_t *res,
                             int *status)
{
    return batch_prefetch_flags(b, KVT_PREFETCH_F_START, tokens, ntokens, tier, deadline_ms, res,
                                status);
}

static int batch_remove_flags(kvt_batch_t *b, unsigned flags, const uint32_t *tokens,
                              uint32_t ntokens, int *status)
{
    if (!b || (ntokens && !tokens))
        return KVT_EINVAL;
    uint8_t w[sizeof(kvt_wire_remove_t)];
    kvt_proto_remove_encode(w, ntokens);
    return batch_tokens(b, KVT_OP_REMOVE, flags, w, sizeof w, tokens, ntokens, NULL, 0, 0, NULL,
                        status);
}

int kvt_batch_remove(kvt_batch_t *b, const uint32_t *tokens, uint32_t ntokens, int *status)
{
    return batch_remove_flags(b, 0, tokens, ntokens, status);
}

int kvt_batch_remove_nowait(kvt_batch_t *b, const uint32_t *tokens, uint32_t ntokens, int *status)
{
    return batch_remove_flags(b, KVT_REMOVE_F_NOWAIT, tokens, ntokens, status);
}

int kvt_batch_release(kvt_batch_t *b, uint64_t lease, int *status)
{
    if (!b)
        return KVT_EINVAL;
    uint8_t w[sizeof(kvt_wire_release_t)];
    kvt_proto_release_encode(w, lease);
    return batch_add(b, KVT_OP_RELEASE, 0, w, sizeof w, NULL, 0, NULL, 0, 0, NULL, status);
}

static int batch_reply(kvt_batch_t *b, const kvt_batch_ent_t *e, const kvt_proto_hdr_t *h,
                       const uint8_t *body)
{
    kvt_client_t *c = b->c;
    if (check_reply(c, h, e->op, e->id) < 0)
        return KVT_EPROTO;
    int st = h->status;
    if (st < 0) {
        set_errmsg(c, h, body);
    } else if (e->op == KVT_OP_MATCH) {
        if (match_step_parse(c, body, h->body_len, e->flags, e->ntokens, b->sent_ns, e->res,
                             e->step) < 0)
            return broken_with(c, KVT_EPROTO);
    } else if (e->op == KVT_OP_PUT) {
        if (put_parse(body, h->body_len, e->res) < 0)
            return broken_with(c, KVT_EPROTO);
    } else if (e->op == KVT_OP_PREFETCH) {
        if (prefetch_parse(body, h->body_len, e->res) < 0)
            return broken_with(c, KVT_EPROTO);
    }
    if (e->status)
        *e->status = st;
    return 0;
}

/* Sends what it can of the batch's pieces from piece seg, seg_off bytes into it. */
static ssize_t batch_send(int fd, const kvt_batch_t *b, size_t seg, size_t seg_off)
{
    struct iovec iov[64];
    int n = 0;
    for (size_t i = seg; i < b->nsegs && n < 64; i++, n++) {
        const kvt_batch_seg_t *g = &b->segs[i];
        size_t skip = i == seg ? seg_off : 0;
        iov[n].iov_base = (void *)((g->ptr ? g->ptr : b->out + g->off) + skip);
        iov[n].iov_len = g->len - skip;
    }
    struct msghdr m = {.msg_iov = iov, .msg_iovlen = (size_t)n};
    return sendmsg(fd, &m, MSG_NOSIGNAL);
}

int kvt_batch_run(kvt_batch_t *b)
{
    if (!b)
        return KVT_EINVAL;
    kvt_client_t *c = b->c;
    if (c->broken)
        return KVT_ECLOSED;
    size_t seg = 0, seg_off = 0, done = 0;
    uint64_t deadline = deadline_from_now(c);
    int rc = drain_later(c, deadline); /* their replies come before the batch's */
    b->sent_ns = kvt_now_ns();
    if (rc == 0)
        rc = batch_cut(b); /* out's last piece */
    if (rc < 0) {
        kvt_batch_reset(b);
        return rc;
    }
    while (done < b->n) {
        if (seg < b->nsegs) {
            ssize_t n = batch_send(c->fd, b, seg, seg_off);
            if (n > 0) {
                for (size_t left = (size_t)n; left > 0;) {
                    size_t t = KVT_MIN(b->segs[seg].len - seg_off, left);
                    seg_off += t;
                    left -= t;
                    if (seg_off == b->segs[seg].len) {
                        seg++;
                        seg_off = 0;
                    }
                }
                deadline = deadline_from_now(c);
            } else if (n < 0 && errno != EAGAIN && errno != EINTR) {
                rc = broken_with(c, -errno);
                break;
            }
        }
        /* Take every whole reply already buffered. */
        int progressed = 0;
        while (done < b->n && c->in_len - c->in_pos >= KVT_PROTO_HDR) {
            kvt_proto_hdr_t h;
            kvt_proto_hdr_decode(c->in + c->in_pos, &h);
            if (kvt_proto_hdr_check(&h, c->max_reply) < 0) {
                rc = broken_with(c, KVT_EPROTO);
                break;
            }
            size_t frame = KVT_PROTO_HDR + (size_t)h.body_len;
            if (c->in_len - c->in_pos < frame) {
                if (kvt_reserve(&c->in, &c->in_cap, c->in_pos + frame, 1, 4096) < 0)
                    rc = broken_with(c, KVT_ENOMEM);
                break;
            }
            const uint8_t *body = c->in + c->in_pos + KVT_PROTO_HDR;
            c->in_pos += frame;
            if ((rc = batch_reply(b, &b->ents[done], &h, body)) < 0)
                break;
            done++;
            progressed = 1;
        }
        if (rc < 0 || done == b->n)
            break;
        rc = fill(c, deadline, 0);
        if (rc == 0) {
            deadline = deadline_from_now(c);
            continue;
        }
        if (rc != KVT_EAGAIN)
            break;
        rc = 0;
        if (progressed)
            continue;
        struct pollfd p = {.fd = c->fd, .events = POLLIN | (seg < b->nsegs ? POLLOUT : 0)};
        uint64_t now = kvt_now_ns();
        if (now >= deadline) {
            rc = broken_with(c, KVT_ETIMEDOUT);
            break;
        }
        if (poll(&p, 1, (int)((deadline - now) / 1000000) + 1) < 0 && errno != EINTR) {
            rc = broken_with(c, -errno);
            break;
        }
    }
    kvt_batch_reset(b);
    return rc;
}
