/*
 * server.h: kvtierd's internals, shared by the files of server/ (kvt__ names; nothing here is
 * public). One kvt_srv_t is the daemon: it owns the event loops, the listening sockets, the index,
 * the tiers, the metrics and every connection. It is passed by pointer, never reached through a
 * global (the signal handler included: signals arrive through a signalfd).
 *
 * Requests and replies
 * --------------------
 * Every request that gets a reply has a kvt__req_t in its connection's reply queue, in arrival
 * order. A request answered at once appends its reply to the queue's tail; one that waits for
 * tier I/O (PUT, GET, PREFETCH) holds its place and is written when it reaches the head:
 *
 *     conn->head                                              conn->tail
 *       [MATCH,MATCH,PING done] -> [PUT: 3 writes pending] -> [MATCH done]
 *         written now               blocks the ones after      waits its turn
 *
 * A request whose connection goes away keeps running until its I/O completes (the buffers are
 * the request's), then frees itself: req->conn is NULL from then on.
 */
#ifndef KVT_SERVER_H
#define KVT_SERVER_H

#include <stddef.h>
#include <stdint.h>
#include <endian.h>
#include <pthread.h>
#include <sys/types.h>
#include <netinet/in.h>

#include "common.h"
#include "policy.h"
#include "radix.h"
#include "tier.h"
#include "conf.h"
#include "metrics.h"
#include "mrc.h"
#include "proto.h"

typedef struct kvt_srv kvt_srv_t;
typedef struct kvt__conn kvt__conn_t;
typedef struct kvt__loop kvt__loop_t;

/* A MATCH's tokens kept under a handle (KEEP, op_match.c) so that the PUT after it need not send
 * them again: per connection, at most KVT_MATCH_HANDLES (a new one replaces the oldest) and
 * KVT_MATCH_HANDLE_BYTES of tokens; each lives as long as the MATCH's lease would have. */
#define KVT_MATCH_HANDLES      16
#define KVT_MATCH_HANDLE_BYTES (4u << 20)
typedef struct kvt__handle {
    uint32_t id; /* 0: a free slot */
    uint32_t ns, page;
    uint32_t ntokens;
    uint64_t made_ns, expires_ns;
    uint32_t *tokens; /* host order */
} kvt__handle_t;
typedef struct kvt__req kvt__req_t;
typedef struct kvt__ev kvt__ev_t;
typedef struct kvt_http_conn kvt_http_conn_t;
typedef struct kvt__move kvt__move_t;

/* A file descriptor in the loop and what to call when it is ready. */
struct kvt__ev {
    int fd;
    /* With several loops, cb may run with s->lock held shared and takes the write lock itself
     * for what writes (a connection's event, a loop's eventfd); 0: the loop takes the write lock
     * before calling it (listeners, signals, tiers, the metrics port). Beside fd: no room more. */
    int shared;
    void (*cb)(kvt_srv_t *s, kvt__ev_t *ev, uint32_t events);
};

/* What the daemon knows of a namespace beyond the tree: the block size clients declared, and who
 * uses it. An empty namespace nobody uses may be closed (kvt__ns_reclaim) and its id reused; when
 * none is empty, the pages of one nobody uses and nobody leases may be evicted (kvt__ns_evict). */
typedef struct kvt__ns {
    uint32_t page_size;
    uint32_t block_bytes; /* 0 until a client declares a non-zero size */
    uint64_t seed;
    uint32_t users;   /* connections that declared it, requests that name it */
    uint32_t leases;  /* connections' leases on its pages */
    uint64_t idle_ns; /* when users last fell to 0 */
} kvt__ns_t;

/* NVMe locations pinned in the tier against the log's segment reclaim (tierio.c kvt__nvme_pin). */
typedef struct kvt__nvme_pins {
    uint64_t *locs;
    uint32_t n;
} kvt__nvme_pins_t;

/* A lease held by a connection: the pinned path's deepest node and its length in pages. */
typedef struct kvt__lease {
    uint64_t id;
    kvt_radix_node_t *node;
    uint32_t pages;
    uint32_t ns;
    uint64_t expires_ns;
    uint64_t engine_id;    /* the engine's request id from the hints, for logs */
    kvt__nvme_pins_t pins; /* its path's NVMe blocks, while leased */
} kvt__lease_t;

/* One tier I/O of a request: a read, a write or a copy, for the block at (node, depth). */
typedef struct kvt__io {
    kvt_tier_io_t io;
    kvt_tier_copy_t copy;
    kvt__req_t *req;
    kvt_radix_node_t *node;
    uint32_t depth;
    uint8_t tier;    /* where the I/O goes (write, copy destination) or comes from (read) */
    uint8_t from;    /* copy source tier */
    uint8_t is_copy; /* through kvt_tier_copy */
    uint64_t start_ns;
    uint64_t src_loc;
    uint8_t *buf;      /* GET: the read buffer of a block from a non-memory tier; PUT: the payload
                          copied aligned for an NVMe write (op_put.c, put_align) */
    uint32_t tokens[]; /* the page's tokens: key.tokens points here */
} kvt__io_t;

typedef enum {
    KVT_REQ_PLAIN,
    KVT_REQ_PUT,
    KVT_REQ_GET,
    KVT_REQ_PREFETCH,
    KVT_REQ_REMOVE
} kvt__req_kind_t;

/* A piece of a reply that is not in the request's out buffer (GET, store.c): ptr, or with ptr
 * NULL the bytes at out + off. */
typedef struct kvt__seg {
    const uint8_t *ptr;
    size_t off, len;
} kvt__seg_t;

struct iovec;

/*
 * A reply source: where a request's reply bytes come from while they are not (all) in its out
 * buffer, such as a GET's batch (frame heads in out, payloads in tier memory or read buffers).
 * The connection's writer knows frames and buffers, not operations: it writes a request's out
 * buffer, or, while the request has a source, what the source offers, and tells it what went.
 *
 *   iov      up to max pieces ready to be written now, in order; 0 when none is (yet)
 *   ends     1 when the `offered` pieces iov just gave are the whole rest of the reply, its
 *            final frame included: the writer may then put the next requests' replies in the
 *            same write (a pipeline of GETs leaves in one writev, as the raw ceiling's does)
 *   wrote    n bytes were written from the first piece iov offered on; returns the part of n
 *            past the source's offer (more than 0 only after ends said 1), which belongs to the
 *            requests after it; the writer then calls drained at once
 *   drained  called when the request is at the head and iov offers nothing: the source moves on
 *            (its next part, or its final frame into out with the source cleared) and returns 1,
 *            or returns 0 while it waits for I/O (whose completion kicks the connection)
 *   abort    the connection closes with the reply unfinished and no I/O in flight: give back
 *            what the source holds (its buffers, the pins on the blocks it sends from)
 *   apart    1 when what iov offers may be written with s->lock let go (docs/architecture.md,
 *            "Event loops"): no other thread writes or frees those bytes, nor the source's
 *            state, until wrote and drained have run under the lock again
 *   shares   1 when every hook may run with s->lock held shared by the connection's loop
 *            (conn.c, queue_plain); the field NULL: never
 */
typedef struct kvt__reply_src {
    int (*iov)(kvt__req_t *r, struct iovec *iov, int max);
    int (*ends)(const kvt__req_t *r, int offered);
    size_t (*wrote)(kvt__req_t *r, size_t n);
    int (*drained)(kvt__req_t *r);
    void (*abort)(kvt__req_t *r);
    int (*apart)(const kvt__req_t *r);
    int (*shares)(const kvt__req_t *r);
} kvt__reply_src_t;

/* A reply's bytes up to this many stay inside its kvt__req_t (out_inline): a GET's frame heads
 * and final frame for up to KVT_GET_INLINE pages (32 bytes each, the final frame 32), a short
 * answer (PING, an error, a MATCH of a few pages).
 * A bigger reply moves to the heap (kvt__req_out_reserve). */
#define KVT_REQ_OUT_INLINE 96
/* A GET batch of up to this many pages keeps its page records and reply pieces inside its
 * request (op_get.c): no allocation per batch for the common one- or two-page GET. */
#define KVT_GET_INLINE 2

/* One page of a GET batch (op_get.c): the record of its read when it is read from a tier that is
 * not memory (x), or, sent from the tier's memory, the block hash whose read count it holds
 * until written (hash, 0 for none: a location frame holds none). */
typedef struct kvt__get_slot {
    kvt__io_t *x;
    uint64_t hash;
} kvt__get_slot_t;

struct kvt__req {
    kvt__req_t *next;
    kvt_srv_t *srv;
    kvt__conn_t *conn; /* NULL once the connection has gone */
    kvt__req_kind_t kind;
    uint8_t op;
    uint8_t done;    /* the whole reply is in out (or, GET, the final frame is) */
    uint8_t counted; /* in the request counters already (kvt__req_count) */
    uint8_t has_fd;  /* pass_fd is set */
    uint64_t id;     /* the client's request id */
    uint64_t t0;     /* arrival, for the latency histogram */
    uint8_t *out;    /* reply bytes not yet written: [out_off, out_len); out_inline or heap */
    size_t out_len, out_cap, out_off;
    const kvt__reply_src_t *src; /* while set, the reply's bytes come from it, not from out */
    int pass_fd; /* with has_fd: a descriptor sent with the reply's first byte (MAP), then closed */
    /* The requests whose replies are in it: 1, or more when kvt__reply added plain replies to a
     * finished one (a pipeline's answers leave in one write). Each counts in its loop's queued.
     * (Beside pass_fd and has_fd beside counted: the struct stays in its 640-byte class.) */
    uint32_t replies;
    /* A move this request asked for (a PREFETCH's promotion) landed: exec.c tells it so. */
    void (*on_move)(kvt_srv_t *s, kvt__req_t *r, int ok, uint32_t promoted_pages);
    uint32_t pending; /* tier I/Os in flight */
    int status;

    /* PUT, GET, PREFETCH and REMOVE */
    uint32_t ns; /* set by kvt__req_ns, which holds the namespace open */
    uint8_t ns_held;
    uint64_t lease;         /* an internal lease pinning the path while I/O runs */
    kvt_radix_node_t *node; /* the path's deepest node */
    uint32_t pages;         /* path length; a waiting REMOVE: its tokens */
    uint32_t block_bytes;
    uint8_t *payload; /* PUT: the payload pages; a waiting REMOVE: its tokens */
    void *held;       /* what payload lies in, counted in the clients' memory */
    size_t held_bytes;
    uint64_t deadline_ns; /* PREFETCH, REMOVE */
    /* Each operation's own state, touched by its file only (op_put.c, op_get.c, op_prefetch.c). */
    struct {
        kvt_policy_hint_t hint; /* the engine's hints, handed to the policy with the blocks */
        uint32_t first, end;    /* payload pages [first, end) */
        uint32_t stored, skipped, new_pages;
        uint8_t reserve;        /* RESERVE: room in the connection's DRAM arena, no payload */
        uint8_t gaps;           /* KVT_PUT_F_GAPS: a page may be stored after one without bytes */
        uint64_t resv;          /* its id, once replied to */
        uint64_t resv_expiry;   /* when its pages are let go if not committed */
        uint8_t expired;        /* past it: only its room is still held (kvt__resv_expire) */
        uint64_t resv_bytes;    /* counted in its connection's resv_bytes (max-reserved-bytes) */
        kvt__req_t *apart_next; /* on its loop's apart list (kvt__loop_t.apart) */
    } put;
    struct {
        uint32_t cur, end; /* pages [cur, end) left */
        uint32_t sent, batch;
        kvt__get_slot_t *slots; /* the batch's pages: slot_inline or heap */
        kvt__seg_t *segs;       /* the batch's output, while it is the reply source */
        uint32_t nsegs, seg_i;
        size_t seg_off;
        int segs_ready;         /* the batch's reads are done: segs may be written */
        uint8_t end_queued;     /* the final frame is the batch's last piece (op_get.c) */
        uint8_t locate;         /* LOCATE: mapped pages go as locations */
        uint8_t hbm_mem;        /* a page of the batch is sent from the HBM tier's memory */
        uint8_t pin_gone;       /* its pin counts in s->pins_ending (op_get.c get_unpin) */
        uint8_t shared;         /* planned under the shared lock: no pin, no namespace
                                 * reference, its path (node) held by the client's lease */
        uint8_t loop_reads;     /* the batch's read counts are in loop loop_reads - 1's table
                                 * (planned shared); 0: the main table */
        uint8_t check_due;      /* a read of the batch left its payload's checksum to the GET
                                 * (op_get.c get_check): nothing of the batch goes before it */
        uint32_t located;       /* pages that went as locations */
        uint64_t lease_expires; /* the client's lease's, for the end frame (LOCATE) */
    } get;
    struct {
        uint8_t replied; /* the reply went out (deadline, START), I/O still running */
        uint32_t moved, resident, target;
        uint32_t rounds; /* promotion rounds run */
        int progress;    /* a move of the last round landed */
        int waiting;     /* no move of its own; pages of its path are in another's move */
        int waited;      /* has waited at least once (counted in the metrics) */
        int start_only;  /* KVT_PREFETCH_F_START, replied once its moves began */
    } prefetch;
    /* op-specific state, freed with the request: a MATCH's remote probe, a PUT's landed pages, a
     * GET's pins of its path's NVMe blocks once the client's lease has ended (op_get.c) */
    void *extra;

    /* The request's own room for a small reply; from here on kvt__req_new does not zero it
     * (each byte is written before it is read): out_inline, and a small GET batch's slots and
     * pieces (get.slots, get.segs point here then). */
    kvt__get_slot_t get_slot_inline[KVT_GET_INLINE];
    kvt__seg_t get_seg_inline[2 * KVT_GET_INLINE + 1];
    uint8_t out_inline[KVT_REQ_OUT_INLINE];
};
_Static_assert(KVT_REQ_OUT_INLINE >=
                   KVT_GET_INLINE * (KVT_PROTO_HDR + sizeof(kvt_wire_get_data_t)) + KVT_PROTO_HDR +
                       sizeof(kvt_wire_get_end_t),
               "a KVT_GET_INLINE-page GET's frames fit in its request");
_Static_assert(sizeof(kvt__req_t) <= 640, "kvt__req_t stays in jemalloc's 640-byte class");

/*
 * What a connection hands up to the operations above it (dispatch.c's kvt__dispatch_ops, set by
 * loop.c), so that framing calls no operation by name:
 *   batch      the input buffer before its whole frames are handled one by one (len bytes at in)
 *   frame      one whole frame; 0, or a negative code when the connection must close
 *   shared     one whole frame, under s->lock shared (several loops, c's own event): 1 when it
 *              answered it there, 0 when it did nothing and the frame needs the write lock
 *   shares     whether a frame with header h may be answered so (shared may still refuse): the
 *              lock is taken back shared after a read only for such a frame
 *   closing    c closes: what it holds beyond its requests (its leases) goes
 *   tick       every tick, per connection (lease expiry)
 *   deadlines  its requests' deadlines and waits, every tick and as soon as moves land
 *   lease_ends a lease of c on node goes (RELEASE, expiry), under the write lock, before its path
 *              is let go: the GETs that read the path under it pin it and its NVMe blocks; 1
 *              when one of them took the lease's own pin on the path (pin) as its own, which
 *              the lease then leaves held (kvt__get_lease_ends; through here, lease.c calls no
 *              GET by name: op_get.c finds leases in lease.c)
 *   lease_reads whether lease_ends would find a GET of c on node to change; only reads c's queue
 *              (kvt__get_lease_reads): a RELEASE under the shared lock goes to the write path then
 */
typedef struct kvt__conn_ops {
    void (*batch)(kvt__conn_t *c, const uint8_t *in, size_t len);
    int (*frame)(kvt__conn_t *c, const kvt_proto_hdr_t *h, const uint8_t *body);
    int (*shared)(kvt__conn_t *c, const kvt_proto_hdr_t *h, const uint8_t *body);
    int (*shares)(const kvt_proto_hdr_t *h);
    void (*closing)(kvt__conn_t *c);
    void (*tick)(kvt__conn_t *c, uint64_t now);
    void (*deadlines)(kvt__conn_t *c, uint64_t now);
    int (*lease_ends)(kvt__conn_t *c, kvt_radix_node_t *node, uint64_t pin);
    int (*lease_reads)(const kvt__conn_t *c, const kvt_radix_node_t *node);
} kvt__conn_ops_t;

/*
 * A client connection. Its fields are laid out by how often they are touched: a request's read,
 * parse, handling and reply write (a GET's whole path) touch only the hot part, the first
 * KVT_CONN_HOT bytes (three cache lines, asserted below); what only some connections or only the
 * tick use comes after, and what only a KEEPing MATCH uses (its handles, 640 bytes) is allocated
 * on the first KEEP. docs/architecture.md, "Connections", has the layout.
 */
struct kvt__conn {
    /* ---- hot: every request ---- */
    kvt__ev_t ev;
    kvt_srv_t *srv;
    kvt__loop_t *loop; /* the loop that owns it: the only one that reads, writes or frees it */
    uint8_t *in;
    size_t in_len, in_cap;
    kvt__req_t *head, *tail;
    size_t out_bytes; /* bytes queued in out buffers */
    /* Its leases, cap_leases of room, and after them in the same allocation their table by id
     * (lease.c); written by its loop or under the write lock. */
    kvt__lease_t *leases;
    size_t nleases;
    /* Slow and idle clients (conn.c): when its last bytes came, how many bytes and whole frames
     * it has sent (and, in the cold part, where the progress of the frame being received was
     * last measured: frame-timeout-ms). */
    uint64_t rx_ns, rx_bytes, frames;
    uint64_t stuck_ns; /* since when its socket has taken none of its queued replies; 0: not */
    uint32_t inflight;
    uint32_t events;
    uint32_t ns, page_size, block_bytes;
    /* Its namespace's slot in the per-namespace series (kvt__metrics_ns_slot, at HELLO). */
    unsigned metric_ns;
    /* Kicked by another loop: on its loop's posted list until that loop kicks it (loops.c). */
    uint8_t posted;
    /* Its loop writes finished replies with the lock let go: kvt__reply starts a new request
     * rather than append to a tail whose bytes the socket may be reading. */
    uint8_t writing;
    uint8_t tcp;
    uint8_t authed;
    uint8_t hello;
    uint8_t closing;    /* no more requests: close once the queue drains */
    uint8_t dead;       /* the peer is gone or broke the framing: close now */
    uint8_t in_handler; /* inside kvt__conn_kick: nested kicks only mark work */
    /* Closed, and off the list, but its memory is kept until its loop's reap: an event for it
     * may still be in the batch epoll_wait returned, and a walk over the list may stand on it. */
    uint8_t gone;
    uint8_t mem_wait;  /* waits for max-client-bytes to have mem_need more bytes */
    uint8_t auth_wait; /* an AUTH waits for its turn (auth.c): nothing more is read until then */
    uint8_t fd_queued; /* a MAP reply holding a descriptor is not yet written */
    /* log2 of the send buffer socket-send-budget gave its socket; 0: the kernel's default. */
    uint8_t sndbuf_log;
    uint8_t turn;      /* socket-turns (conn.c): KVT_TURN_NONE, _HELD or _WAIT */
    uint8_t turn_read; /* its client read some of what its socket held since its turn began */
    uint32_t *tokens;  /* scratch for decoded tokens */
    size_t tokens_cap;
    uint64_t id; /* also the owner of its leases in the tree */

    /* ---- cold: the tick, closing, and what only some connections use ---- */
    const uint32_t *tok;    /* the current frame's tokens (op.c kvt__tokens): MATCH, PUT */
    uint64_t lease_next_ns; /* no lease expires before this: the tick skips the list until then */
    kvt__conn_t *posted_next;
    kvt__conn_t *prev, *next;
    /* The next on its loop's list of closed connections, or, while it holds or waits for a turn
     * (never both: a close ends its turn first), its neighbours in its loop's list of holders or
     * queue of waiters (conn.c, socket-turns): doubly linked, so that a waiter that closes leaves
     * the queue without a walk. */
    union {
        kvt__conn_t *gone_next;
        struct {
            kvt__conn_t *turn_next, *turn_prev;
        };
    };
    size_t cap_leases;
    size_t mem_need;
    uint64_t born_ns;
    uint64_t mark_ns, mark_rx;
    uint32_t mark_frames; /* frames' low 32 bits: compared only for a change since the last tick */
    /* While it holds a turn: when it got it, in ms (kvt__turns_step: a socket stalled before
     * then is given a whole socket-turn-stall-ms from it); 32 bits of ms compare right across a
     * wrap. */
    uint32_t turn_ms;
    /* An AUTH waiting for its turn (auth.c, auth-failures-per-s), answered in the order of
     * auth_seq (reading on would tell a guesser how its guess went). */
    uint64_t auth_seq;
    kvt__req_t *auth_req;
    /* Zero-copy (op_map.c, op_put.c): the namespace whose DRAM arena it mapped (a reference on
     * the arena until it closes), whether it mapped the HBM pool, and its reservations (PUT
     * requests whose writes landed in room the client fills, waiting for COMMIT). */
    uint64_t zc_seed;
    uint8_t zc_dram, zc_hbm;
    int zc_hbm_device; /* with zc_hbm: the device of the HBM pool it mapped */
    /* The CUDA device its engine runs on (HELLO): its PUTs go to that device's HBM pool, and so
     * do the promotions its PREFETCHes ask for (hbm-devices). */
    int device;
    uint32_t handle_next; /* the next of handles to fill (below; beside device: no padding) */
    kvt__req_t **resv;
    size_t nresv, cap_resv;
    /* Bytes of pages its reservations hold (expired ones too) and its RESERVEs in flight ask
     * for: at most max-reserved-bytes. */
    uint64_t resv_bytes;
    /* MATCHes' kept tokens (op_match.c, KEEP), named by later PUTs and RESERVEs: NULL until the
     * first KEEP, then KVT_MATCH_HANDLES of them (kvt__conn_handles). */
    kvt__handle_t *handles;
    uint64_t handle_bytes; /* the kept tokens' bytes: at most KVT_MATCH_HANDLE_BYTES */
};
/* The hot part's end (the first cold field), and the whole struct's size: a field added to the
 * hot part, or 640 bytes of handles back inline, fails the build (tests/test_server_conns.c
 * prints the sizes). */
#define KVT_CONN_HOT 192
_Static_assert(offsetof(kvt__conn_t, tok) <= KVT_CONN_HOT,
               "kvt__conn_t's hot part is at most three cache lines");
_Static_assert(sizeof(kvt__conn_t) <= 384, "kvt__conn_t stays small: cold state goes aside");

/* The connections' part (conn.c): the open ones, the closed ones not yet freed, and the memory
 * held for clients. */
typedef struct kvt__clients {
    kvt__conn_t *list;
    uint32_t n;
    uint64_t next_id;
    /* Memory held for clients beyond their base input buffers: input buffers grown for big
     * frames, token scratch, queued replies, request payloads. max-client-bytes bounds it. */
    uint64_t bytes;
    uint32_t mem_waiting; /* connections with mem_wait set */
    int spare_fd;         /* /dev/null, given up to refuse a connection at the open-file limit */
    int sndbuf_default;   /* a Unix socket's SO_SNDBUF as the kernel makes it; 0: not yet seen */
    /* The host's own addresses, IPv4 ones v4-mapped (conn.c peer_on_host), looked up again at
     * most once a second, from the accept path: getifaddrs at every TCP accept from a peer that
     * is neither loopback nor the address it reached cost that accept 8.5 us. */
    struct in6_addr *host_addrs;
    size_t host_naddrs, host_addrs_cap;
    uint64_t host_addrs_ns; /* when they were looked up; 0: never */
    /* The buffer of the last big frame a request freed, kept for the next big frame: a fresh one
     * per frame came from jemalloc purged (madvise) at every free, its pages faulted and zeroed
     * again (conn.c spare_take). Not in bytes (held for no client), but kept only while bytes
     * plus it are under max-client-bytes, and dropped before anyone would wait or be held back
     * for memory, and when the last connection closes. */
    void *kept;
    size_t kept_bytes;
} kvt__clients_t;

/* Reads in flight per block hash (exec.c): open addressing, backward-shift deletion. */
typedef struct kvt__busy {
    uint64_t hash; /* 0 = empty */
    uint32_t count;
} kvt__busy_t;
typedef struct kvt__busytab {
    kvt__busy_t *tab;
    size_t cap, n;
} kvt__busytab_t;

/* The policy's executor's part (exec.c): moves in flight, the request a PREFETCH's promotions
 * report to, tier locations whose free waits for reads, reads in flight per block, the ghosts. */
typedef struct kvt__exec {
    kvt__move_t *moves;
    int moves_landed; /* a move finished since the loop last looked */
    struct kvt__dfree *dfree;
    size_t ndfree, cap_dfree;
    kvt__busytab_t busy;  /* reads in flight per block hash, the write path's */
    kvt_ghosts_t *ghosts; /* evicted blocks: the "evicted" miss reason, the cost policy's too */
    struct kvt__settle *settle; /* lost blocks MATCHes found, made index-only by the step */
    size_t nsettle, cap_settle;
    /* Old DRAM copies of runs promoted under a lease, kept for the leases taken before their
     * switch (exec.c, "Kept copies"); their footprint in DRAM, and the tree's lease releases
     * when they were last looked at. */
    struct kvt__kept *kept;
    size_t nkept, cap_kept;
    uint64_t kept_bytes, kept_releases;
    /* Moves into a tier whose writes keep failing (a full file system, a dead device) pause,
     * 100 ms after the first failure, doubling to 2 s, until one lands (exec.c). */
    uint64_t write_paused_until[KVT_TIER_COUNT];
    uint32_t write_failures[KVT_TIER_COUNT];
} kvt__exec_t;

/* Wrong AUTHs' token bucket and the AUTHs waiting for it (auth.c). */
typedef struct kvt__auth {
    double tokens;
    uint64_t refill_ns;
    uint64_t seq;
    uint32_t waiting; /* at most; recounted by kvt__auth_tick */
} kvt__auth_t;

/* The metrics port's connections (http.c). */
typedef struct kvt__http {
    kvt_http_conn_t *conns;
    unsigned n;
    kvt_http_conn_t *gone; /* closed to make room, freed at the next tick */
} kvt__http_t;

/*
 * One event loop (loops.c, docs/architecture.md "Event loops"). Loop 0 is the daemon's main
 * thread: it alone has the listeners, the signals, the tiers' completion descriptors, the
 * metrics port and the tick. Loops 1..loops-1 are threads that serve the connections handed to
 * them at accept. A loop holds s->lock for writing for everything above the sockets, but for
 * the framing of its connections' input and a run of MATCHes without a lease, which hold it
 * shared, and for waiting in epoll and a connection's socket I/O, which hold nothing (conn.c):
 *
 *     loop 1:  [wait] -shared- framing, MATCHes, replies -none- [read|writev] -shared- ...
 *                     -write- a PUT, a GET's pins, a close, posted kicks, the step -shared- ...
 *     loop 0:  [wait] -write- tier completions, tick, policy step -none- [wait]
 *
 * A connection belongs to one loop. Another loop that must kick it (a completion, a deadline,
 * a drain) puts it on the owner's posted list and wakes the owner through its eventfd; one that
 * must close it marks it dead and does the same: only the owner frees it, after its own batch.
 *
 * Under the shared lock a loop writes only what is its own (its connection's input, queue and
 * fields, its metric table) and defers what a MATCH would write to the store (the blocks' hit
 * counters, the policy's use, a path's cached hash, the curve's sample, the clients' memory) in
 * its hits, which the next kvt__srv_lock applies, every loop's, before anything changes the tree.
 */
/* One MATCH's use of its path, applied under the write lock (kvt__match_settle). */
typedef struct kvt__hit {
    int pending;    /* m's blocks were hit: touch them, tell the policy */
    int cache_tail; /* its path's last hash was not cached: cache it (kvt__path_tail) */
    int device;
    kvt_match_t m;
    kvt_proto_hints_t hints;
    /* The miss-ratio curve's sample (kvt__mrc_lookup's arguments), its keys at keys_at in the
     * loop's keys. */
    int sample;
    uint32_t whole, page, block, ntokens;
    size_t keys_at;
} kvt__hit_t;

/* The hits a loop may defer before it must take the write lock (kvt__match_settle) to defer
 * more, and the page keys of their samples. */
#define KVT_LOOP_HITS 256
#define KVT_LOOP_KEYS (1u << 20)

/* How a loop's thread holds s->lock (kvt__loop_hold). */
enum { KVT_HELD_NONE, KVT_HELD_SHARED, KVT_HELD_WRITE };

/* A loop's list of connections holding a turn, or its queue of those waiting for one (conn.c,
 * socket-turns), linked through kvt__conn_t's turn_next and turn_prev. */
typedef struct kvt__turnq {
    kvt__conn_t *head, *tail;
    uint32_t n;
} kvt__turnq_t;

struct kvt__loop {
    kvt_srv_t *srv;
    unsigned id;
    int epfd;
    kvt__ev_t wake;      /* an eventfd: a posted kick, or the daemon stopping */
    pthread_t thread;    /* loop 0: the main thread's, set when it runs */
    int started;         /* thread is set (loop 0: running) */
    kvt__conn_t *posted; /* kicked by other loops; under s->lock */
    kvt__conn_t *gone;   /* closed, freed by kvt__conns_reap */
    /* The connection whose own event (or posted kick) is being handled at the top of the loop:
     * the one place where its socket I/O may let the lock go (nothing else is half done). */
    kvt__conn_t *top;
    int sealing;
    /* Between kvt__kicks_defer and kvt__kicks_flush: its own connections' kicks only put them
     * on its posted list. Its own thread's only. */
    int deferring;
    uint32_t conns;
    /* Requests in its connections' reply queues (conn.c): read, and their reply not yet all in
     * the kernel; kvtier_loop_queued_requests. Changed with s->lock held, by its own thread
     * (shared or write) or another holding it for writing. */
    uint32_t queued;
    /* socket-turns (conn.c): its connections holding a turn, and those waiting for one, first
     * come first served. Each loop grants its own: changed by its own thread only, with the lock
     * held (shared at least); the tick and a scrape read them under the write lock. */
    kvt__turnq_t turn_held, turn_wait;
    /* How this loop's thread holds s->lock: set by it only, with the lock held (the other
     * threads read a loop's under the write lock: kvt__out_add of its connection). */
    int held;
    /* When it last took the write lock (kvt_now_ns, its settle included in the hold): its
     * kvtier_loop_write_lock_hold_seconds. Its own thread's only. */
    uint64_t write_at;
    /* It took the write lock since its last wake: the work after the batch (the policy's step)
     * runs, whichever way the batch ended holding the lock. Its own thread's only. */
    int wrote;
    /* MATCHes answered under the shared lock, deferred (written by this loop's thread under
     * the shared lock only; applied and emptied under the write lock): hits[0 .. nhits), their
     * samples' page keys keys[0 .. nkeys), and the clients' memory their replies queued
     * (kvt__out_add while shared: s->clients.bytes's). */
    kvt__hit_t *hits;
    uint32_t nhits;
    uint64_t *keys;
    size_t nkeys, keys_cap;
    int64_t clients_bytes;
    /* Its own counters (kvt__metrics_loop), merged on scrape; NULL: s->metrics (loops.c). */
    kvt_metrics_t *metrics;
    /* The read counts of its GETs planned under the shared lock (op_get.c), changed by its own
     * thread (shared or write) or another holding the write lock, read under the write lock; and
     * frees_due: a count it dropped to 0 with the lock shared had a free waiting for it
     * (kvt__busy_dec_loop), which the next write lock does (kvt__busy_settle). */
    kvt__busytab_t busy;
    int frees_due;
    /* Its connections' PUTs whose DRAM pages are allocated but not yet written, linked by
     * put.apart_next: kvt__put_apart copies their bytes in with the lock let go. Its own
     * thread's only. */
    kvt__req_t *apart;
};

struct kvt_srv {
    kvt_srv_conf_t *conf;
    const kvt__conn_ops_t *conn_ops; /* the operations above the connections */
    int epfd;                        /* loop 0's */
    /* Issue 42: the store (index, tiers, policy, executor, leases), the connections' list and
     * the metrics are behind this one lock, taken for writing except by a MATCH's walk (shared);
     * see struct kvt__loop. */
    pthread_rwlock_t lock;
    /* When the write lock was last granted (kvt_now_ns; kvt__srv_lock sets it, holding it). */
    uint64_t lock_at;
    /* Tier reads submitted with the lock shared (op_get.c get_submit: a GET's NVMe pages, planned
     * on several loops at once) go one at a time through it. */
    pthread_mutex_t submit;
    /* A MATCH with LEASE answered with the lock shared (op_match.c, shared_lease) takes its lease
     * through it: the tree's lease table and the pins on the path's nodes, the index's bytes the
     * table adds, the NVMe segments' pins, and the namespaces' lease counts (server.h kvt__ns_t).
     * Every other writer of those holds the write lock. */
    pthread_mutex_t lease_mu;
    kvt__loop_t *loops;
    unsigned nloops;
    int loops_running; /* loops 1.. run: a connection of another loop is not closed directly */
    int loops_exit;    /* loop 0 returned: the others stop */
    void (*loop_after)(kvt__loop_t *l); /* loop.c's work after a batch, on every loop */
    void (*lock_settle)(kvt_srv_t *s);  /* kvt__srv_lock's, first: kvt__match_settle (loop.c) */
    const char *put_gate; /* $KVT_DEBUG_PUT_GATE, a test's (op_put.c put_gate); NULL: none */
    /* $KVT_DEBUG_GET_CHECK_GATE, a test's (op_get.c get_check_gate); NULL: none */
    const char *get_check_gate;
    kvt__ev_t sig_ev, unix_ev, tcp_ev, http_ev;
    kvt__ev_t tier_ev[KVT_TIER_COUNT];
    char unix_path[4096]; /* absolute, for unlink at exit */
    char tcp_addr[128], http_addr[128];
    kvt_radix_t *radix;
    kvt_tier_t *tiers[KVT_TIER_COUNT];
    kvt_policy_t *policy;
    kvt_metrics_t *metrics;
    /* policy-model and policy-hw: what the prefill seconds a hit saved are priced with */
    kvt_model_profile_t cost_model;
    kvt_hw_profile_t cost_hw;
    /* The lookups' miss-ratio curve (mrc.c); NULL with mrc = no. */
    kvt__mrc_t *mrc;
    kvt__ns_t *ns; /* ns.c */
    size_t nns, cap_ns;
    uint64_t internal_owner; /* owner of the leases requests take while their I/O runs */
    uint64_t resv_next;      /* the next zero-copy reservation's id */
    uint64_t inflight;       /* tier I/Os in flight, all connections */
    /* GETs' pins still held whose final frame is on its way: not counted in the leases shown
     * (kvt__lease_count), as their requests count as answered (op_get.c, get_send). */
    uint32_t pins_ending;
    int stopping;
    int reload;              /* SIGHUP came: the loop reads the settings again */
    int draining;            /* SIGUSR1 came: no new connections, quiet ones closed (loop.c) */
    uint64_t drain_until_ns; /* then the ordinary shutdown, whatever is left */
    int reqs_waiting;        /* a PREFETCH or REMOVE may be waiting for others' moves */
    uint64_t started_ns;
    kvt__clients_t clients;
    kvt__exec_t exec;
    kvt__auth_t auth;
    kvt__http_t http;
};

/* loop.c: the daemon's skeleton, the event loop and the tick (the top of server/: it may call
 * every file; no file calls it). */
/* Blocks SIGTERM, SIGINT and SIGHUP in the calling thread, the signals the loop's signalfd
 * takes. main calls it first thing, before any library can start a thread: a thread inherits the
 * mask of the one that starts it, so every later thread (the CUDA runtime's, any of ours) keeps
 * them blocked and none can take one and die by its default action. A signal that arrives
 * before the loop runs stays pending, and the signalfd reads it then. Returns 0 or -errno. */
int kvt__srv_block_signals(void);
int kvt__srv_open(kvt_srv_t **out, kvt_srv_conf_t *conf);
int kvt__srv_run(kvt_srv_t *s);
/* Tells systemd (Type=notify) the daemon's state when $NOTIFY_SOCKET names its socket:
 * "READY=1", "RELOADING=1", "STOPPING=1". Does nothing otherwise; failures are ignored. */
void kvt__srv_notify(const char *state);
void kvt__srv_close(kvt_srv_t *s);
/* loops.c: loops 1..loops-1 (their threads, epoll sets and eventfds). kvt__loops_start runs
 * them, each calling after(l) after each batch of its events; kvt__loops_stop (s->lock held,
 * held again on return) ends them. */
int kvt__loops_open(kvt_srv_t *s);
int kvt__loops_start(kvt_srv_t *s, void (*after)(kvt__loop_t *l));
void kvt__loops_stop(kvt_srv_t *s);
void kvt__loops_close(kvt_srv_t *s);
/* kvtier_loop_cpu_seconds_total: each running loop's thread's CPU time (every tick). */
void kvt__loops_cpu(kvt_srv_t *s);
/* lock.c: s->lock for writing (every loop's pending hits applied first, s->lock_settle), shared,
 * and let go (either). */
void kvt__srv_lock(kvt_srv_t *s);
void kvt__srv_lock_shared(kvt_srv_t *s);
void kvt__srv_unlock(kvt_srv_t *s);
/* Loop l's thread holds s->lock as held says (KVT_HELD_*) from now on, letting go of how it held
 * it first: from shared to write is not atomic, nor from write to shared (a pthread rwlock has no
 * downgrade): a writer may come between, so nothing may be half done. Each write lock taken
 * counts in kvtier_loop_write_locks_total and sets l->wrote. */
void kvt__loop_hold(kvt__loop_t *l, int held);
/* Whether loop l, at the end of a batch that did not take the write lock, still has work after it
 * that needs it: kicks posted, connections to free, moves landed, memory waits, seals. */
int kvt__loop_busy(const kvt__loop_t *l);
/* The number of loops for loops = 0: the CPUs this process may run on, at most 8. */
unsigned kvt__loops_auto(void);
/* ev.c: the epoll sets' registrations. */
int kvt__ev_ctl(int epfd, int op, kvt__ev_t *ev, uint32_t events);
int kvt__ev_add(kvt_srv_t *s, kvt__ev_t *ev, uint32_t events);
int kvt__ev_mod(kvt_srv_t *s, kvt__ev_t *ev, uint32_t events);
void kvt__ev_del(kvt_srv_t *s, kvt__ev_t *ev);
/* ns.c: the namespace table. */
int kvt__ns_get(kvt_srv_t *s, uint32_t ns, kvt__ns_t **out);
/* Holds namespace ns open (it stays open while it has users) or lets it go. */
void kvt__ns_use(kvt_srv_t *s, uint32_t ns);
void kvt__ns_unuse(kvt_srv_t *s, uint32_t ns);
/* Closes every namespace that holds no page and that no connection or request uses, so that its
 * id and memory can go to a new one; returns how many. Walks every namespace. */
uint32_t kvt__ns_reclaim(kvt_srv_t *s);

/* conn.c */
void kvt__conn_accept(kvt_srv_t *s, int lfd, int tcp);
/* accept4 on listening socket lfd: the new descriptor, or -1 when there is none to take now. At
 * the open-file limit the waiting connection is refused (closed at once, through the spare
 * descriptor) instead of being left to wake the loop again and again. */
int kvt__accept(kvt_srv_t *s, int lfd, const char *what);
/* Closes c: its leases, requests and socket go now; the struct itself at its loop's reap
 * (kvt__conns_reap), so that whatever still points at it (an epoll event of the same batch, a
 * walk over the list that stands on it) finds it marked gone. Called by a loop that does not own
 * c, while the loops run, it marks c dead and posts it to its owner, which closes it. */
void kvt__conn_close(kvt__conn_t *c);
/* Kicks what other loops posted to l, then frees l's connections closed since the last call;
 * only where no pointer to one is held (after its batch). */
void kvt__conns_reap(kvt__loop_t *l);
/* With the lock shared, by l's own thread at the top of its loop: kicks the connections other
 * loops posted to l whose queues may be written shared (a GET planned shared whose reads are
 * done), leaving the rest (a close, a write-path reply) to kvt__conns_reap. */
void kvt__posted_shared(kvt__loop_t *l);
/* The loop the calling thread runs (NULL outside the loops). */
kvt__loop_t *kvt__loop_self(void);
void kvt__loop_set_self(kvt__loop_t *l);
/* The loop that gets the next accepted connection: the one with the fewest, lowest id first. */
kvt__loop_t *kvt__loop_pick(kvt_srv_t *s);
/* c belongs to another loop: it is kicked there (a posted kick, under s->lock). */
void kvt__loop_post(kvt__conn_t *c);
/* Between the two, a kick of one of l's own connections (l the calling thread's loop, holding
 * s->lock for writing) only puts it on l's posted list, and kvt__kicks_flush kicks what is there
 * once each. For a batch of completions (a tier's, loop.c on_tier), each of which finishes a
 * request and kicks its connection: the replies the batch finishes on one connection then leave
 * in one write, not one each. */
void kvt__kicks_defer(kvt__loop_t *l);
void kvt__kicks_flush(kvt__loop_t *l);
/* Ends kvt__kicks_defer leaving them on l's posted list, for kvt__posted_shared (or the reap). */
void kvt__kicks_keep(kvt__loop_t *l);
/* Appends a complete reply frame (header + body) for request (op, id) to the queue. */
int kvt__reply(kvt__conn_t *c, uint8_t op, uint64_t id, uint64_t t0, int status, const void *body,
               uint32_t len);
int kvt__reply_error(kvt__conn_t *c, uint8_t op, uint64_t id, uint64_t t0, int status,
                     const char *fmt, ...) __attribute__((format(printf, 6, 7)));
/* A request that will finish later: its place in the queue. */
kvt__req_t *kvt__req_new(kvt__conn_t *c, kvt__req_kind_t kind, uint8_t op, uint64_t id,
                         uint64_t t0);
/* c's table of KVT_MATCH_HANDLES kept-token handles (op_match.c), made on its first KEEP: NULL
 * when there is no memory for it (nothing is kept then). Freed when c closes. */
kvt__handle_t *kvt__conn_handles(kvt__conn_t *c);
/* The namespace r works in, held open until r is freed. */
void kvt__req_ns(kvt__req_t *r, uint32_t ns);
/* Adds bytes to a request's output (GET frames, final replies). Returns 0 or KVT_ENOMEM. */
int kvt__req_append(kvt__req_t *r, const void *p, size_t len);
/* Room for need bytes in r->out (its content kept): 0, or KVT_ENOMEM with r unchanged. */
int kvt__req_out_reserve(kvt__req_t *r, size_t need);
/* Appends r's reply frame: status r->status, then len bytes of body. Out of memory closes the
 * connection (the replies after it would otherwise answer the wrong requests). */
int kvt__req_reply(kvt__req_t *r, const void *body, uint32_t len);
/* The request has all its reply: write what can be written, free what an orphan held. */
void kvt__req_finish(kvt__req_t *r);
/* Counts r's reply now, before its last bytes are written (kvt__req_finish then does not). */
void kvt__req_count(kvt__req_t *r);
void kvt__req_free(kvt__req_t *r);
/* r->payload: a copy of bytes at src, r's own, counted in the clients' memory. 0 or KVT_ENOMEM. */
int kvt__req_hold(kvt__req_t *r, const void *src, size_t bytes);
/* The input buffer, when it holds only the frame whose body is `body` and is a buffer of that
 * frame's own (one too big for the base buffer): the caller owns it from now on, *bytes long
 * and counted in the clients' memory. NULL otherwise. */
void *kvt__conn_take_frame(kvt__conn_t *c, const uint8_t *body, uint32_t body_len, size_t *bytes);
/* Connections waiting for max-client-bytes to have room try again where it now has. */
void kvt__conns_mem_retry(kvt_srv_t *s);
/* The clients' memory changes by delta for c: with the lock shared (other loops may count too),
 * in c's loop's own sum, added at the next write lock (kvt__match_settle). */
static inline void kvt__clients_add(kvt__conn_t *c, int64_t delta)
{
    if (c->loop->held == KVT_HELD_SHARED)
        c->loop->clients_bytes += delta;
    else
        c->srv->clients.bytes += (uint64_t)delta;
}
/* Queued reply bytes of c change by delta. */
static inline void kvt__out_add(kvt__conn_t *c, int64_t delta)
{
    c->out_bytes += (size_t)delta;
    kvt__clients_add(c, delta);
}
/* Something changed on the connection (output added, I/O finished): try to write and read. */
void kvt__conn_kick(kvt__conn_t *c);
/* Lets s->lock go while c's loop works on bytes that are c's own alone, where conn.c may (c's
 * own event or posted kick at the top of its loop, several loops running): returns how the loop
 * held it, KVT_HELD_NONE when it was not let go; kvt__conn_relock(c, that) takes it back so.
 * Between the two, only c's own buffers may be touched: anything else may change. */
int kvt__conn_unlock(kvt__conn_t *c);
void kvt__conn_relock(kvt__conn_t *c, int held);
/* socket-turns (conn.c): passes on the turns of loop l's holders whose sockets stalled while
 * others wait, and grants the turns free; returns how long l may sleep before the next one
 * stalls, in ms (-1: no limit). Run by l's thread after every wake, with the lock held. */
int kvt__turns_step(kvt__loop_t *l);
/* After a reload (write lock): wakes each loop with waiters, so that its step grants the turns
 * a raised socket-turns added. */
void kvt__turns_reload(kvt_srv_t *s);
/* The loops' gauges read off their connections (kvtier_loop_socket_turns, _waiters,
 * kvtier_loop_queued_requests, kvtier_loop_queued_reply_bytes), under the write lock: one walk
 * over the connections. */
void kvt__loops_gauges(kvt_srv_t *s);
/* Every tick: leases past their time limit go, then kvt__conns_deadlines. */
void kvt__conns_tick(kvt_srv_t *s, uint64_t now);
/* Requests' deadlines, and PREFETCHes waiting for others' moves or for room try again; also
 * run as soon as moves land. */
void kvt__conns_deadlines(kvt_srv_t *s, uint64_t now);
void kvt__proto_error(kvt_srv_t *s, kvt_proto_err_t kind);

/* dispatch.c: a whole frame to its operation (the connections' kvt__conn_ops_t). */
extern const kvt__conn_ops_t kvt__dispatch_ops;
/* Handles one frame (header and body). Returns 0, or a negative code when the connection must
 * close after the queued replies are written. */
int kvt__handle(kvt__conn_t *c, const kvt_proto_hdr_t *h, const uint8_t *body);
/* Requests' deadlines on c: a REMOVE or PREFETCH waiting for others' moves tries again, a
 * PREFETCH past its deadline answers with what moved. */
void kvt__ops_deadlines(kvt__conn_t *c, uint64_t now);
/* A malformed body: counted, answered EPROTO; returns 0 (the connection goes on). */
int kvt__bad_body(kvt__conn_t *c, const kvt_proto_hdr_t *h, uint64_t t0, const char *what);
/* 0 when c declared its namespace; otherwise answers EPROTO and returns -1. */
int kvt__need_hello(kvt__conn_t *c, const kvt_proto_hdr_t *h, uint64_t t0);
/* Points c->tok at the frame's n tokens in host order (valid until the next frame). 0 or
 * KVT_ENOMEM. */
int kvt__tokens(kvt__conn_t *c, const uint8_t *src, uint32_t n);

/* The operations' handlers (auth.c, lease.c, op_*.c): each decodes its body, answers at once
 * or queues a request; 0, or a negative code when the connection must close. */
int kvt__h_auth(kvt__conn_t *c, const kvt_proto_hdr_t *h, const uint8_t *body, uint64_t t0);
int kvt__h_match(kvt__conn_t *c, const kvt_proto_hdr_t *h, const uint8_t *body, uint64_t t0);
int kvt__h_put(kvt__conn_t *c, const kvt_proto_hdr_t *h, const uint8_t *body, uint64_t t0);
int kvt__h_get(kvt__conn_t *c, const kvt_proto_hdr_t *h, const uint8_t *body, uint64_t t0);
int kvt__h_prefetch(kvt__conn_t *c, const kvt_proto_hdr_t *h, const uint8_t *body, uint64_t t0);
int kvt__h_release(kvt__conn_t *c, const kvt_proto_hdr_t *h, const uint8_t *body, uint64_t t0);
/* A RELEASE under the shared lock (lease.c, through kvt__conn_ops_t.shared): 1 when answered, 0
 * when it did nothing (the write path answers it: a bad body, or a GET of c still reading under
 * the lease's path). */
int kvt__h_release_shared(kvt__conn_t *c, const kvt_proto_hdr_t *h, const uint8_t *body,
                          uint64_t t0);
int kvt__h_remove(kvt__conn_t *c, const kvt_proto_hdr_t *h, const uint8_t *body, uint64_t t0);
int kvt__h_map(kvt__conn_t *c, const kvt_proto_hdr_t *h, const uint8_t *body, uint64_t t0);
int kvt__h_reserve(kvt__conn_t *c, const kvt_proto_hdr_t *h, const uint8_t *body, uint64_t t0);
int kvt__h_commit(kvt__conn_t *c, const kvt_proto_hdr_t *h, const uint8_t *body, uint64_t t0);

/* op_map.c: the connection's mappings go with it (its reference on its namespace's arena). */
void kvt__map_close(kvt__conn_t *c);
/* op_put.c: reservations. The closing connection's are given back; the tick gives back those
 * past reserve-ms. */
void kvt__resv_drop_all(kvt__conn_t *c);
void kvt__resv_expire(kvt__conn_t *c, uint64_t now);

/* auth.c: AUTH, and the wait line wrong secrets are throttled through. */
/* Every tick: AUTHs waiting for auth-failures-per-s are answered as its tokens allow. */
void kvt__auth_tick(kvt_srv_t *s, uint64_t now);

/* lease.c: the leases connections hold on matched paths. */
int kvt__lease_add(kvt__conn_t *c, const kvt__lease_t *l);
/* c's lease id, or NULL (a stale id, or another connection's lease). */
kvt__lease_t *kvt__lease_find(kvt__conn_t *c, uint64_t id);
void kvt__lease_drop_all(kvt__conn_t *c);
void kvt__lease_expire(kvt__conn_t *c, uint64_t now);

/* The pages of a matched path whose NVMe blocks the tier dropped by itself, which a MATCH reports
 * index-only (kvt__store_check_path): runs [from, to), and from gone on everything (a block a
 * move holds, or more lost runs than fit). */
#define KVT_LOST_RUNS 8
typedef struct kvt__lost {
    uint32_t n;
    uint32_t from[KVT_LOST_RUNS], to[KVT_LOST_RUNS];
    uint32_t gone;
} kvt__lost_t;

/* op_match.c and op_probe.c: MATCH, and its remote probe for the pages after a local match. */
/* What a MATCH asked for, kept while a remote probe runs. */
typedef struct kvt__match_q {
    uint16_t flags;
    uint32_t lease_ms;
    uint64_t engine_id;
    uint32_t ntokens;
    uint32_t page; /* the namespace's page size when asked (a HELLO may change c's) */
    /* and its block size (0: not declared), for the miss-ratio curve */
    uint32_t block_bytes;
    const uint32_t *tokens;
    uint32_t handle;  /* KEEP: the handle its tokens were kept under (0: none) */
    kvt__lost_t lost; /* kvt__store_check_path: pages reported index-only */
} kvt__match_q_t;
/* Answers a MATCH for m: tiers per page, counters, the lease if asked for; r is NULL for an answer
 * given at once, else the request that waited for the probe. */
int kvt__match_answer(kvt__conn_t *c, kvt__req_t *r, const kvt_proto_hdr_t *h, uint64_t t0,
                      const kvt__match_q_t *q, kvt_match_t *m, uint32_t remote_pages,
                      int remote_down);
/* Applies every loop's pending hits (struct kvt__loop): kvt__srv_lock's, under the write lock. */
void kvt__match_settle(kvt_srv_t *s);
/* A MATCH without REMOTE (LEASE, KEEP and LOCATE allowed), under the shared lock (conn.c's
 * framing, through kvt__conn_ops_t.shared): 1 when answered, 0 when it did nothing (the write
 * path answers it). */
int kvt__h_match_shared(kvt__conn_t *c, const kvt_proto_hdr_t *h, const uint8_t *body, uint64_t t0);
/* Whether a MATCH with header h is one kvt__h_match_shared may answer (its flags allow it). */
int kvt__match_shares(const kvt_proto_hdr_t *h);
/* A GET whose first batch's pages all lie in DRAM (with LOCATE, those in the mapped arena go as
 * locations), under the shared lock (op_get.c): 1 when it queued the GET, 0 when it did nothing
 * (the write path answers it). */
int kvt__h_get_shared(kvt__conn_t *c, const kvt_proto_hdr_t *h, const uint8_t *body, uint64_t t0);
/* Whether a GET with header h is one kvt__h_get_shared may take (no flag but LOCATE). */
int kvt__get_shares(const kvt_proto_hdr_t *h);
/* Under the write lock, as a lease of c on node goes (RELEASE, expiry): each GET of c on node's
 * path with pages left pins the path's NVMe blocks, as the lease did; one planned under the
 * shared lock also holds the path, as the write path's GET does, and goes on by the write path:
 * the first such GET takes the lease's own pin on the path (pin) and returns 1 (the lease must
 * not let it go then), the others pin the path anew. */
int kvt__get_lease_ends(kvt__conn_t *c, kvt_radix_node_t *node, uint64_t pin);
/* Whether kvt__get_lease_ends would find a GET of c to change for a lease on node (one with pages
 * left, reads in flight or a batch to check): it only reads c's queue, so that a RELEASE under the
 * shared lock (lease.c) leaves such a lease's end to the write path. */
int kvt__get_lease_reads(const kvt__conn_t *c, const kvt_radix_node_t *node);
/* How a probe answers its MATCH: kvt__match_answer, handed down by op_match.c so that the probe
 * does not call back up into it. */
typedef int (*kvt__match_answer_fn)(kvt__conn_t *c, kvt__req_t *r, const kvt_proto_hdr_t *h,
                                    uint64_t t0, const kvt__match_q_t *q, kvt_match_t *m,
                                    uint32_t remote_pages, int remote_down);
/* Starts a remote probe for the pages after m; returns 1 when the reply will come later (through
 * answer, in the request's place in the queue). */
int kvt__probe_start(kvt__conn_t *c, const kvt_proto_hdr_t *h, uint64_t t0, const kvt__match_q_t *q,
                     const kvt_match_t *m, const kvt_proto_hints_t *hints,
                     kvt__match_answer_fn answer, int *down);

/* The handle id of c (KEEP), or NULL when c has none such: never made, replaced, expired (it is
 * dropped then). conn.c frees c's handles at its close. */
const kvt__handle_t *kvt__handle_find(kvt__conn_t *c, uint32_t id);

/* tierio.c (the door, store.h): whether block b (of namespace ns, under a lease) can be answered
 * to c by location: 1 and its offset in c's mapping of b's tier, or 0. */
int kvt__store_locate(kvt_srv_t *s, const kvt__conn_t *c, uint32_t ns, const kvt_block_t *b,
                      uint64_t *off);

/* op_remove.c */
/* A REMOVE waiting for moves and requests on its prefix: tries again. Returns 1 when it was
 * answered (removed, gone, held by a lease, or past its deadline). */
int kvt__remove_retry(kvt__req_t *r, uint64_t now);

/* op_put.c, op_get.c, op_prefetch.c: the state machines of the operations with tier I/O. */
int kvt__store_put(kvt_srv_t *s, kvt__req_t *r);
/* l's PUTs' DRAM pages copied in, with s->lock let go where several loops run, then each PUT
 * that has nothing else in flight answered, under the write lock (l's own thread, between its
 * batches of events: nothing is half done). */
void kvt__put_apart(kvt__loop_t *l);
int kvt__store_get_batch(kvt_srv_t *s, kvt__req_t *r);
int kvt__store_prefetch(kvt_srv_t *s, kvt__req_t *r);
/* r's deadline and waits (kvt__ops_deadlines); 1 when it was answered (the kick may have freed
 * the connection), 0 otherwise. */
int kvt__prefetch_deadline(kvt__req_t *r, uint64_t now);

/* tierio.c: a request's tier I/Os. */
/* A lease over node and everything above it, for I/O that must not see the path go. KVT_ENOSPC
 * when the lease table would grow past index-bytes. */
int kvt__pin(kvt_srv_t *s, kvt_radix_node_t *node, uint32_t ns, uint64_t *lease);
/* Pins the NVMe blocks of the path's first pages pages that ends in node in the tier against the
 * log's segment reclaim, into p (best effort: out of memory, none), and lets them go (p emptied).
 * A lease holds them (lease.c), and so does a GET once the lease it reads under has ended
 * (op_get.c). Under the write lock. */
void kvt__nvme_pin(kvt_srv_t *s, kvt__nvme_pins_t *p, kvt_radix_node_t *node, uint32_t pages);
void kvt__nvme_unpin(kvt_srv_t *s, kvt__nvme_pins_t *p);
/* Fills a block key for the block at (node, depth) of namespace ns, tokens copied to tok. */
void kvt__block_key(kvt_srv_t *s, kvt_radix_node_t *node, uint32_t depth, uint32_t *tok,
                    kvt_block_key_t *key);
/* The key (hash) alone of the block at (node, depth): what a GET sent from memory needs, without
 * the block key's copy of the page's tokens. */
uint64_t kvt__block_hash(kvt_srv_t *s, kvt_radix_node_t *node, uint32_t depth);
kvt__io_t *kvt__io_new(kvt_srv_t *s, kvt__req_t *r, uint32_t depth);
/* The block at (node, depth) goes to NVMe: when the page before it holds no bytes (a window
 * behind a gap), the tokens in front of it are recorded for a restart (kvt_tier_nvme_add_path). */
void kvt__nvme_gap_path(kvt_srv_t *s, kvt_radix_node_t *node, uint32_t depth,
                        const kvt_block_key_t *key);
void kvt__io_started(kvt_srv_t *s, kvt__req_t *r);
/* One I/O of r done: counted; returns 1 when it was r's last in flight. */
int kvt__io_finished(kvt_srv_t *s, kvt__io_t *x, int status, int write);
/* The in-flight counts of one piece of r's work that is no tier I/O (a PUT's copies, op_put.c)
 * given back; returns 1 when it was r's last in flight. */
int kvt__io_ended(kvt_srv_t *s, kvt__req_t *r);
/* Releases the lease r took on its path. */
void kvt__unpin(kvt_srv_t *s, kvt__req_t *r);
/* A tier's error as a client reads it (a remote EPROTO is a failed I/O to it). */
int kvt__tier_failure(int rc);

/* store.c: the tiers and the policy, opened from the configuration and closed. */
int kvt__store_open(kvt_srv_t *s);
/* Gives what the NVMe tier's scan found back to tree (once, after creation, before any write):
 * namespaces reopened by name where the tier recorded one, else by seed; blocks whose ancestors
 * are not all on disk, whose page size is not their namespace's, or whose page the tree holds in
 * another tier are freed as orphans. Returns 0, KVT_EINVAL, KVT_ENOMEM (the tree keeps what was
 * inserted so far) or KVT_EBUSY (called twice). out (may be NULL) gets the tier's counts. */
int kvt_store_nvme_recover(kvt_radix_t *tree, kvt_tier_t *nvme, kvt_tier_nvme_recovery_t *out);
void kvt__store_close(kvt_srv_t *s);
/* Hands tenant-<tier>-bytes to the tiers (at start and on reload). */
void kvt__store_quotas(kvt_srv_t *s);
void kvt__tier_metrics(kvt_srv_t *s);

/* exec.c: the policy's executor: moves, adopt, frees, the busy table, lost blocks. */
/*
 * The block record (radix.h's kvt_block_t: tier, loc, size, flags) is written in kvtierd only
 * through these; the policy sets a tier through kvt__exec_ops' set_tier (its own flag bits, the
 * position class and ghost mark, stay its own):
 *   busy      a write or a move of the block is in flight (KVT_BLOCK_BUSY): nothing else moves,
 *             frees or drops it meanwhile
 *   place     its bytes are at loc (size bytes) in a tier, not yet in the policy's accounting:
 *             tier NONE until kvt__policy_adopt gives it one
 *   relocate  a move landed: the bytes are at loc now
 *   tier      the policy placed the block's bytes in tier (it adopted it, or a move landed):
 *             the policy's kvt_policy_ops_t.set_tier
 *   drop      index-only: no tier, location or size
 *   recovered a block the NVMe tier found at start-up, before the policy adopts it
 */
void kvt__block_busy(kvt_block_t *b, int busy);
void kvt__block_place(kvt_block_t *b, uint64_t loc, uint32_t size);
void kvt__block_relocate(kvt_block_t *b, uint64_t loc);
void kvt__block_tier(kvt_block_t *b, kvt_tier_id_t tier);
void kvt__block_drop(kvt_block_t *b);
/* A block found on disk at start-up, in tier at loc: set before the policy adopts it. */
void kvt__block_recovered(kvt_block_t *b, kvt_tier_id_t tier, uint64_t loc, uint32_t size);
/* What the policy calls to act (policy.h's kvt_policy_ops_t), with the kvt_srv_t as its arg. */
extern const kvt_policy_ops_t kvt__exec_ops;
/* After the tiers are destroyed: the moves in flight, deferred frees and read counts go. */
void kvt__exec_close(kvt_srv_t *s);
void kvt__store_free_cb(void *arg, uint32_t ns, kvt_block_t *b, kvt_radix_why_t why);
void kvt__store_node_free_cb(void *arg, kvt_radix_node_t *n, kvt_radix_why_t why);
/* A block its tier lost by itself (an NVMe segment reclaim dropped it, the remote server evicted
 * it, or its read failed the checksum) at page `depth` of the path ending in node n: that page
 * and the rest of the node
 * holding it become index-only (the rest's bytes are freed: pages after a gap are no use to a
 * prefix), so no MATCH reports bytes that are not there. Returns the pages changed; 0 when a
 * block there is BUSY (the copy in flight settles first) or nothing was stored. */
uint32_t kvt__store_lost(kvt_srv_t *s, kvt_radix_node_t *n, uint32_t depth);
/* Checks the NVMe blocks of a matched path against the tier (only once the tier has dropped
 * anything by itself), reading only: *lost says which pages a MATCH reports index-only (a lost
 * block and the rest of its node, as kvt__store_lost will make them; from a block a move holds,
 * the rest of the path). The lost blocks are made index-only by the next maintenance step
 * (kvt__store_step), their nodes pinned until then; a lookup frees no tier bytes. */
void kvt__store_check_path(kvt_srv_t *s, const kvt_match_t *m, kvt__lost_t *lost);
/* Reads in flight per block hash: a block being read is never moved, and a free of its location
 * waits for them (kvt__free_loc). The write path counts in s->exec.busy; a GET planned under the
 * shared lock (op_get.c) in its loop's own table (kvt__loop_t.busy), which only that loop's thread
 * changes with the lock shared. Every table is read, summed, only under the write lock.
 * inc: 0 or KVT_ENOMEM. */
int kvt__busy_inc(kvt_srv_t *s, uint64_t h);
void kvt__busy_dec(kvt_srv_t *s, uint64_t h);
int kvt__busy_inc_loop(kvt__loop_t *l, uint64_t h);
/* Under the shared lock (l's own thread), a location whose free waited for the last read is not
 * freed here: l->frees_due asks the next write lock to (kvt__busy_settle). */
void kvt__busy_dec_loop(kvt__loop_t *l, uint64_t h);
/* Under the write lock, first (s->lock_settle): frees the waiting locations no read holds now. */
void kvt__busy_settle(kvt_srv_t *s);
/* Reads of block hash h in flight, every table's (0 when none); under the write lock. */
uint32_t kvt__busy_reads(const kvt_srv_t *s, uint64_t h);
/* A loop's table's memory goes (loops.c, at its end). */
void kvt__busy_free(kvt__busytab_t *t);
/* Frees a tier location, or defers it while reads of block hash are in flight; discard: for
 * good (a REMOVE's: the block must not come back at a restart). */
void kvt__free_loc(kvt_srv_t *s, uint8_t tier, uint64_t loc, uint32_t len, uint64_t hash,
                   int discard);
int kvt__ghost_seen(const kvt_srv_t *s, uint64_t hash);
/* The policy's maintenance step (promotions, demotions, drops) and the index trim, bounded; the
 * loop calls it after every batch of events. */
void kvt__store_step(kvt_srv_t *s);
/* Counts a MATCH's or PUT's engine hints by kind (kvtier_hints_total), as they arrive, so that
 * an operator sees whether the engines' connectors send them at all; in mt (s->metrics, or under
 * the shared lock the loop's own table). */
void kvt__count_hints(kvt_metrics_t *mt, const kvt_proto_hints_t *w);
/* Engine hints from the wire, for the pages of the path below its shared part (from_page). */
void kvt__policy_hint(const kvt_proto_hints_t *w, uint32_t from_page, kvt_policy_hint_t *out);
/* A MATCH's use of its path, for the policy's reuse counters and promotions. */
/* device: the CUDA device of the client that matched (-1: none), whose HBM pool the promotions
 * this MATCH queues go to. */
void kvt__policy_match(kvt_srv_t *s, const kvt_match_t *m, const kvt_proto_hints_t *w, int device);
/* Hands blocks the daemon holds in a tier to the policy: pages [from, to) of the path ending at
 * node, index-only until now, with loc and size set; tier as given. Pages the policy refuses
 * (no room in its accounting, order) are freed in the tier and left index-only. Returns the
 * pages adopted. */
uint32_t kvt__policy_adopt(kvt_srv_t *s, kvt_radix_node_t *node, uint32_t from, uint32_t to,
                           kvt_tier_id_t tier, uint32_t prompt_pages, const kvt_policy_hint_t *h);

/* index.c: the index budget (index-bytes). */
/* Evicts index-only pages (no bytes in any tier), least recently used first, until the index has
 * allocated at most target bytes or budget pages went; through the policy when there is one.
 * Returns the pages evicted. */
uint32_t kvt__index_trim(kvt_srv_t *s, uint64_t target, uint32_t budget);
/* The trim of the maintenance step: from above the high mark down to the low one, bounded. */
void kvt__index_step(kvt_srv_t *s);
/* Whether need more bytes of index fit under index-bytes as the index is (nothing always fits). */
int kvt__index_fits(const kvt_srv_t *s, uint64_t need);
/* 0 when need more bytes fit under index-bytes, trimming the index if need be (which evicts
 * unleased pages: no match result may be held across it), KVT_ENOSPC when they cannot. */
int kvt__index_fit(kvt_srv_t *s, uint64_t need);
/* Before an insert of tokens[0, ntokens) in namespace ns, followed by a pin of its path when pin
 * is set: 0 when the most they can allocate fits under index-bytes (trimming the index if need
 * be), KVT_ENOSPC when it cannot be made to fit. When it had to walk the tree (near the cap),
 * *at (if given) says where the walk stopped, for kvt_radix_insert_matched; at->ns is
 * UINT32_MAX when it did not. */
int kvt__index_room(kvt_srv_t *s, uint32_t ns, const uint32_t *tokens, size_t ntokens, int pin,
                    kvt_match_t *at);
/* max-namespaces are open and none is empty and unused (kvt__ns_reclaim closed none): evicts every
 * page of the namespace whose loss costs least among those no connection or request uses and no
 * lease holds (the fewest pages, then the longest unused), and closes it. Returns 1 when one was
 * closed, 0 when none could be (each in use, leased, or with pages being moved). */
int kvt__ns_evict(kvt_srv_t *s);

/* http.c */
int kvt__http_listen(kvt_srv_t *s, const char *addr);
void kvt__http_close(kvt_srv_t *s);
/* Every tick: scrape connections past their time (5 s) are closed. */
void kvt__http_tick(kvt_srv_t *s, uint64_t now);
/* What a request head read so far asks for: the whole of the endpoint's parsing, apart from its
 * socket (fuzz/fuzz_http.c drives it directly). */
typedef enum {
    KVT__HTTP_MORE,        /* no blank line yet, and room for more: read on */
    KVT__HTTP_BAD,         /* 400: not an HTTP request line */
    KVT__HTTP_TOO_LARGE,   /* 431: the buffer is full and the head is not whole */
    KVT__HTTP_METRICS,     /* GET or HEAD /metrics */
    KVT__HTTP_HEALTHZ,     /* GET or HEAD /healthz */
    KVT__HTTP_NOT_ALLOWED, /* 405: another method on those two */
    KVT__HTTP_NOT_FOUND,   /* 404 */
} kvt__http_req_t;
/* head: len bytes and a NUL after them; full: no more room in the buffer. *head_only is set for
 * HEAD (the reply carries no body). */
kvt__http_req_t kvt__http_parse(const char *head, size_t len, int full, int *head_only);

/* net.c: host:port parsing and listening TCP sockets. */
int kvt__parse_hostport(const char *s, char *host, size_t hostlen, uint16_t *port);
int kvt__listen_tcp(const char *addr, char *bound, size_t boundlen);
int kvt__listen_loopback(int fd);

#include "store.h" /* the door to the tree and the tiers */

#endif
