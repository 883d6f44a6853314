/*
 * proto.h: the kvtier wire protocol, the proto/ module's one header, shared by kvtierd and
 * libkvtier: every request and every reply is encoded and decoded here and nowhere else.
 * docs/protocol.md is the byte-by-byte description for other languages; this header is its C
 * form and the two must agree.
 *
 * Every frame is a 24-byte header followed by body_len bytes of body. All integers are
 * little-endian; no field is aligned beyond what its offset gives. Requests carry status 0; a
 * reply echoes the request's request_id, carries opcode | KVT_OP_REPLY, and a status that is 0 or
 * a negative KVT_E* code (common/common.h). An error reply's body is a human-readable message.
 *
 *     0       4   5   6       8               16      20      24
 *     +-------+---+---+-------+---------------+-------+-------+---- body ----
 *     | magic |ver|op | flags |  request_id   |  len  |status |
 *     +-------+---+---+-------+---------------+-------+-------+--------------
 *
 * The kvt_wire_* structs below are the exact layouts. Code never casts a buffer to them: the
 * kvt_proto_* functions memcpy and convert byte order, so alignment and host order never matter.
 * Encoders write the fixed part of a body into a buffer of the wire struct's size; what follows
 * it (names, tokens, payload, a MATCH reply's tier bytes) the caller appends or sends from where
 * it lies, so a payload is never copied just to be framed. Decoders take exactly one body and
 * answer KVT_EPROTO for anything else; pointers they return borrow from that body.
 *
 * Replies come back in request order on a connection, except that one GET answers with several
 * frames (KVT_RF_MORE on all but its last), all before the reply to the next request.
 */
#ifndef KVT_PROTO_H
#define KVT_PROTO_H

#include <stddef.h>
#include <stdint.h>

#include "common.h"

#define KVT_PROTO_MAGIC   0x5254564bu /* the bytes 'K' 'V' 'T' 'R' */
#define KVT_PROTO_VERSION 1
#define KVT_PROTO_HDR     24

/* Default limits and addresses (kvtierd's embedded defaults; kvtier uses the same). */
#define KVT_PROTO_MAX_FRAME_DEFAULT (64u << 20)
#define KVT_DEFAULT_UNIX_PATH       "kvtierd.sock"
#define KVT_DEFAULT_TCP_PORT        7390
#define KVT_DEFAULT_METRICS_PORT    7391
#define KVT_PROTO_NAME_MAX          255 /* model, adapter and salt, each */
#define KVT_PROTO_SECRET_MAX        1024
#define KVT_PROTO_ERRMSG_MAX        512

typedef enum {
    KVT_OP_HELLO = 1,
    KVT_OP_AUTH = 2,
    KVT_OP_MATCH = 3,
    KVT_OP_PUT = 4,
    KVT_OP_GET = 5,
    KVT_OP_PREFETCH = 6,
    KVT_OP_RELEASE = 7,
    KVT_OP_REMOVE = 8,
    KVT_OP_STATS = 9,
    KVT_OP_PING = 10,
    KVT_OP_MAP = 11,     /* zero-copy: map the namespace's shared memory (Unix socket only) */
    KVT_OP_RESERVE = 12, /* zero-copy PUT: reserve room the client writes through its mapping */
    KVT_OP_COMMIT = 13,  /* zero-copy PUT: make a reservation's pages visible (or give it back) */
    KVT_OP_COUNT = 14,
    KVT_OP_REPLY = 0x80 /* or-ed into a reply's opcode */
} kvt_op_t;

/* The op's name ("match"), or NULL for an unknown opcode. */
const char *kvt_proto_op_name(unsigned op);

/* Header flags. Request flags are per opcode; reply flags are the same for every opcode. */
enum {
    KVT_MATCH_F_LEASE = 1u << 0,  /* pin the matched path and return a lease id */
    KVT_MATCH_F_REMOTE = 1u << 1, /* probe the remote tier for pages beyond the local match */
    KVT_MATCH_F_PROBE = 1u << 2,  /* a probe: do not count as a use of the blocks */
    KVT_MATCH_F_LOCATE = 1u << 3, /* with LEASE: the reply says where mapped pages lie */
    KVT_MATCH_F_KEEP = 1u << 4,   /* keep the tokens under a handle a later PUT names */
    KVT_MATCH_F_ALL = 0x1f,
    KVT_PUT_F_HANDLE = 1u << 0, /* PUT and RESERVE: the tokens extend a MATCH's kept ones */
    KVT_PUT_F_GAPS = 1u << 1,   /* PUT and RESERVE: pages may be stored after pages without bytes */
    KVT_PUT_F_ALL = 0x3,
    KVT_PREFETCH_F_START = 1u << 0, /* reply once the moves have started, not when they land */
    KVT_PREFETCH_F_ALL = 0x1,
    KVT_REMOVE_F_NOWAIT = 1u << 0, /* EBUSY at once for blocks busy with I/O, instead of waiting */
    KVT_REMOVE_F_ALL = 0x1,
    KVT_GET_F_LOCATE = 1u << 0, /* pages in the connection's mapping answered by location */
    KVT_GET_F_ALL = 0x1,
    KVT_COMMIT_F_ABORT = 1u << 0, /* give the reservation back: nothing becomes visible */
    KVT_COMMIT_F_SUMS = 1u << 1,  /* the body carries the XXH3-64 of each reserved page */
    KVT_COMMIT_F_ALL = 0x3,
    KVT_RESV_F_SEAL = 1u << 0, /* RESERVE reply: COMMIT seals these pages (may send SUMS) */
    KVT_RESV_F_ALL = 0x1,
    KVT_RF_MORE = 1u << 0, /* reply: more frames for this request follow (GET data) */
};

/* The request flag bits op defines: 0 for an op that has none, or an unknown opcode. */
unsigned kvt_proto_req_flags(unsigned op);

/* Engine hints on MATCH and PUT. */
enum {
    KVT_HINT_PAUSED = 1u << 0,   /* the session paused; expected back in resume_ms */
    KVT_HINT_FINISHED = 1u << 1, /* the session finished: its private suffix may go first */
    KVT_HINT_ALL = 0x3,
};

typedef struct kvt_proto_hdr {
    uint32_t magic;
    uint8_t version;
    uint8_t opcode;
    uint16_t flags;
    uint64_t request_id;
    uint32_t body_len;
    int32_t status;
} kvt_proto_hdr_t;

/* 16 bytes on the wire: u64 engine_request_id, u32 resume_ms, u16 priority, u16 flags. */
typedef struct kvt_proto_hints {
    uint64_t engine_request_id; /* the engine's own id, for logs and lease tracing; 0 = none */
    uint32_t resume_ms;         /* with KVT_HINT_PAUSED */
    uint16_t priority;          /* retention priority; 0 = none, higher keeps longer */
    uint16_t flags;             /* KVT_HINT_* */
} kvt_proto_hints_t;

/*
 * The fixed parts of the bodies, as they lie on the wire (packed, little-endian). Variable parts
 * (names, tokens as little-endian u32, payloads) follow the fixed part in the order given.
 */
#define KVT_WIRE __attribute__((packed))

typedef struct KVT_WIRE kvt_wire_hdr {
    uint32_t magic;
    uint8_t version;
    uint8_t opcode;
    uint16_t flags;
    uint64_t request_id;
    uint32_t body_len;
    int32_t status;
} kvt_wire_hdr_t;

typedef struct KVT_WIRE kvt_wire_hints {
    uint64_t engine_request_id;
    uint32_t resume_ms;
    uint16_t priority;
    uint16_t flags;
} kvt_wire_hints_t;

typedef struct KVT_WIRE kvt_wire_hello { /* then model, adapter, salt bytes */
    uint16_t min_version, max_version;
    uint32_t page_size;
    uint32_t block_bytes;
    uint16_t model_len, adapter_len, salt_len;
    uint16_t device; /* the CUDA device the client's engine runs on (0 before it was added) */
} kvt_wire_hello_t;

typedef struct KVT_WIRE kvt_wire_hello_reply {
    uint16_t version;
    uint16_t tiers;
    uint32_t ns;
    uint64_t ns_seed;
    uint32_t max_frame;
    uint32_t lease_ms_max;
} kvt_wire_hello_reply_t;

typedef struct KVT_WIRE kvt_wire_match { /* then ntokens x u32 */
    kvt_wire_hints_t hints;
    uint32_t lease_ms;
    uint32_t ntokens;
} kvt_wire_match_t;

typedef struct KVT_WIRE kvt_wire_match_reply { /* then pages x u8 tier */
    uint32_t tokens;
    uint32_t pages;
    uint64_t lease;
    uint32_t remote_pages;
    uint32_t handle; /* KEEP: the handle a PUT may name; 0 otherwise */
} kvt_wire_match_reply_t;

/* A MATCH reply with LOCATE: after the tier bytes, this head, then pages x u64 offsets. */
typedef struct KVT_WIRE kvt_wire_match_locs {
    uint32_t lease_ms; /* the lease's time limit as granted (0: no lease, nothing matched) */
    uint32_t located;  /* pages whose offset is not KVT_MATCH_NO_LOC */
} kvt_wire_match_locs_t;

#define KVT_MATCH_NO_LOC UINT64_MAX /* an offset: the page is not in the connection's mapping */

typedef struct KVT_WIRE kvt_wire_put { /* then ntokens x u32, then npayload x block_bytes */
    kvt_wire_hints_t hints;
    uint32_t ntokens;
    uint32_t first_page;
    uint32_t npayload;
    uint32_t handle; /* with KVT_PUT_F_HANDLE: a MATCH's handle; 0 otherwise */
} kvt_wire_put_t;

typedef struct KVT_WIRE kvt_wire_put_reply {
    uint32_t pages, new_pages, stored, skipped;
} kvt_wire_put_reply_t;

typedef struct KVT_WIRE kvt_wire_get {
    uint64_t lease;
    uint32_t first_page;
    uint32_t npages;
} kvt_wire_get_t;

typedef struct KVT_WIRE kvt_wire_get_data { /* then block_bytes of payload */
    uint32_t page;
    uint8_t tier;
    uint8_t reserved[3];
} kvt_wire_get_data_t;

typedef struct KVT_WIRE kvt_wire_get_end {
    uint32_t npages;
    uint32_t lease_ms_left; /* GET with LOCATE: what the lease had left; 0 otherwise */
} kvt_wire_get_end_t;

/* A GET data frame's byte 5: what follows the head. */
enum { KVT_GET_DATA_BYTES = 0, KVT_GET_DATA_LOC = 1 };

typedef struct KVT_WIRE kvt_wire_get_loc { /* a data frame answered by location (LOCATE) */
    uint32_t page;
    uint8_t tier;
    uint8_t kind; /* KVT_GET_DATA_LOC */
    uint16_t reserved;
    uint64_t offset; /* into the mapping MAP gave for that tier */
    uint32_t len;
    uint32_t reserved2;
} kvt_wire_get_loc_t;

typedef struct KVT_WIRE kvt_wire_map {
    uint32_t tier; /* KVT_TIER_DRAM or KVT_TIER_HBM */
    uint32_t reserved;
} kvt_wire_map_t;

typedef struct KVT_WIRE kvt_wire_map_reply { /* then handle_len bytes (HBM: the IPC handle) */
    uint64_t map_bytes;
    uint32_t tier;
    uint32_t handle_len;
} kvt_wire_map_reply_t;

typedef struct KVT_WIRE kvt_wire_reserve { /* then ntokens x u32 */
    kvt_wire_hints_t hints;
    uint32_t ntokens;
    uint32_t first_page;
    uint32_t npages;
    uint32_t handle; /* as PUT's */
} kvt_wire_reserve_t;

typedef struct KVT_WIRE kvt_wire_reserve_reply { /* then nlocs x kvt_wire_resv_loc */
    uint64_t resv;
    uint32_t pages;
    uint32_t new_pages;
    uint32_t nlocs;
    uint32_t flags; /* KVT_RESV_F_* */
} kvt_wire_reserve_reply_t;

typedef struct KVT_WIRE kvt_wire_resv_loc {
    uint32_t page;
    uint32_t reserved;
    uint64_t offset;
} kvt_wire_resv_loc_t;

typedef struct KVT_WIRE kvt_wire_commit { /* then, with KVT_COMMIT_F_SUMS, nlocs x u64 */
    uint64_t resv;
} kvt_wire_commit_t;

typedef struct KVT_WIRE kvt_wire_prefetch { /* then ntokens x u32 */
    uint32_t tier;
    uint32_t deadline_ms;
    uint32_t ntokens;
    uint32_t reserved;
} kvt_wire_prefetch_t;

typedef struct KVT_WIRE kvt_wire_prefetch_reply {
    uint32_t pages, moved, resident, failed;
} kvt_wire_prefetch_reply_t;

typedef struct KVT_WIRE kvt_wire_release {
    uint64_t lease;
} kvt_wire_release_t;

typedef struct KVT_WIRE kvt_wire_release_reply {
    uint32_t released;
} kvt_wire_release_reply_t;

typedef struct KVT_WIRE kvt_wire_remove { /* then ntokens x u32 */
    uint32_t ntokens;
    uint32_t reserved;
} kvt_wire_remove_t;

_Static_assert(sizeof(kvt_wire_hdr_t) == KVT_PROTO_HDR, "header is 24 bytes");
_Static_assert(sizeof(kvt_wire_hints_t) == 16, "hints are 16 bytes");
_Static_assert(sizeof(kvt_wire_hello_t) == 20, "HELLO fixed part is 20 bytes");
_Static_assert(sizeof(kvt_wire_hello_reply_t) == 24, "HELLO reply is 24 bytes");
_Static_assert(sizeof(kvt_wire_match_t) == 24, "MATCH fixed part is 24 bytes");
_Static_assert(sizeof(kvt_wire_match_reply_t) == 24, "MATCH reply fixed part is 24 bytes");
_Static_assert(sizeof(kvt_wire_match_locs_t) == 8, "MATCH reply's LOCATE head is 8 bytes");
_Static_assert(sizeof(kvt_wire_put_t) == 32, "PUT fixed part is 32 bytes");
_Static_assert(sizeof(kvt_wire_put_reply_t) == 16, "PUT reply is 16 bytes");
_Static_assert(sizeof(kvt_wire_get_t) == 16, "GET is 16 bytes");
_Static_assert(sizeof(kvt_wire_get_data_t) == 8, "GET data frame head is 8 bytes");
_Static_assert(sizeof(kvt_wire_get_end_t) == 8, "GET end frame is 8 bytes");
_Static_assert(sizeof(kvt_wire_get_loc_t) == 24, "GET location frame is 24 bytes");
_Static_assert(sizeof(kvt_wire_map_t) == 8, "MAP is 8 bytes");
_Static_assert(sizeof(kvt_wire_map_reply_t) == 16, "MAP reply fixed part is 16 bytes");
_Static_assert(sizeof(kvt_wire_reserve_t) == 32, "RESERVE fixed part is 32 bytes");
_Static_assert(sizeof(kvt_wire_reserve_reply_t) == 24, "RESERVE reply fixed part is 24 bytes");
_Static_assert(sizeof(kvt_wire_resv_loc_t) == 16, "a reserved page's location is 16 bytes");
_Static_assert(sizeof(kvt_wire_commit_t) == 8, "COMMIT is 8 bytes");
_Static_assert(sizeof(kvt_wire_prefetch_t) == 16, "PREFETCH fixed part is 16 bytes");
_Static_assert(sizeof(kvt_wire_prefetch_reply_t) == 16, "PREFETCH reply is 16 bytes");
_Static_assert(sizeof(kvt_wire_release_t) == 8, "RELEASE is 8 bytes");
_Static_assert(sizeof(kvt_wire_release_reply_t) == 4, "RELEASE reply is 4 bytes");
_Static_assert(sizeof(kvt_wire_remove_t) == 8, "REMOVE fixed part is 8 bytes");

typedef struct kvt_proto_hello {
    uint16_t min_version, max_version;
    uint32_t page_size;
    uint32_t block_bytes;               /* KV bytes of one page; 0 for an index-only client */
    const char *model, *adapter, *salt; /* not NUL-terminated: borrowed from the frame */
    uint16_t model_len, adapter_len, salt_len;
    /* The CUDA device (ordinal) of the engine rank behind the connection: its PUTs go to that
     * device's HBM pool where the daemon has one per device (hbm-devices). 0 for old clients. */
    uint16_t device;
} kvt_proto_hello_t;

typedef struct kvt_proto_hello_reply {
    uint16_t version;
    uint16_t tiers; /* bit (1 << kvt_tier_id_t) per tier the server has */
    uint32_t ns;
    uint64_t ns_seed;
    uint32_t max_frame;
    uint32_t lease_ms_max;
} kvt_proto_hello_reply_t;

typedef struct kvt_proto_match {
    kvt_proto_hints_t hints;
    uint32_t lease_ms; /* 0: the server's default */
    uint32_t ntokens;
    const uint8_t *tokens; /* ntokens little-endian u32, borrowed from the frame */
} kvt_proto_match_t;

typedef struct kvt_proto_match_reply {
    uint32_t tokens;       /* matched tokens (pages x page size) */
    uint32_t pages;        /* matched pages; as many tier bytes follow */
    uint64_t lease;        /* 0 when none was asked for or nothing matched */
    uint32_t remote_pages; /* of pages, how many were found only by the remote probe */
    uint32_t handle;       /* KEEP: the kept tokens' handle, 0 when none was kept */
} kvt_proto_match_reply_t;

/* A LOCATE reply's locations: offs holds pages little-endian u64 offsets (kvt_proto_match_loc
 * reads the i-th), borrowed from the body. */
typedef struct kvt_proto_match_locs {
    uint32_t lease_ms;
    uint32_t located;
    const uint8_t *offs;
} kvt_proto_match_locs_t;

typedef struct kvt_proto_put {
    kvt_proto_hints_t hints;
    uint32_t ntokens;
    uint32_t first_page; /* page index of the first payload page */
    uint32_t npayload;   /* pages whose KV bytes follow the tokens (block_bytes each) */
    uint32_t handle;     /* KVT_PUT_F_HANDLE: the MATCH handle whose tokens come first */
    const uint8_t *tokens;
    const uint8_t *payload;
} kvt_proto_put_t;

typedef struct kvt_proto_put_reply {
    uint32_t pages;     /* whole pages of the request, all in the index now */
    uint32_t new_pages; /* pages this PUT added to the index */
    uint32_t stored;    /* pages whose bytes this PUT stored */
    uint32_t skipped;   /* payload pages not stored: already held, or no room in any tier */
} kvt_proto_put_reply_t;

typedef struct kvt_proto_get {
    uint64_t lease;
    uint32_t first_page;
    uint32_t npages; /* 0: to the end of the leased path */
} kvt_proto_get_t;

/* RESERVE: PUT's fields without a payload; npages pages from first_page get room. */
typedef struct kvt_proto_reserve {
    kvt_proto_hints_t hints;
    uint32_t ntokens;
    uint32_t first_page;
    uint32_t npages;
    uint32_t handle; /* as PUT's */
    const uint8_t *tokens;
} kvt_proto_reserve_t;

typedef struct kvt_proto_reserve_reply {
    uint64_t resv;      /* the reservation's id, for COMMIT; 0 when nothing was reserved */
    uint32_t pages;     /* whole pages of the request, all in the index now */
    uint32_t new_pages; /* pages this RESERVE added to the index */
    uint32_t nlocs;     /* pages that got room: as many locations follow */
    uint32_t flags;     /* KVT_RESV_F_* */
    const uint8_t *locs;
} kvt_proto_reserve_reply_t;

typedef struct kvt_proto_map_reply {
    uint64_t map_bytes; /* the length to mmap (DRAM) or of the device allocation (HBM) */
    uint32_t tier;
    uint32_t handle_len;
    const uint8_t *handle; /* HBM: the cudaIpcMemHandle_t bytes */
} kvt_proto_map_reply_t;

typedef struct kvt_proto_prefetch {
    uint32_t tier; /* kvt_tier_id_t to move the blocks up to (HBM or DRAM) */
    uint32_t deadline_ms;
    uint32_t ntokens;
    const uint8_t *tokens;
} kvt_proto_prefetch_t;

typedef struct kvt_proto_prefetch_reply {
    uint32_t pages;    /* matched pages */
    uint32_t moved;    /* copied up to the tier by the deadline */
    uint32_t resident; /* already at the tier or above */
    uint32_t failed;   /* not moved: no room, read error, or the deadline passed */
} kvt_proto_prefetch_reply_t;

/*
 * Header. kvt_proto_hdr_decode checks only that 24 bytes are there; kvt_proto_hdr_check then
 * validates magic, version and the size limit, returning 0, KVT_EPROTO (magic or version) or
 * KVT_ETOOBIG.
 */
void kvt_proto_hdr_encode(uint8_t out[KVT_PROTO_HDR], const kvt_proto_hdr_t *h);
void kvt_proto_hdr_decode(const uint8_t in[KVT_PROTO_HDR], kvt_proto_hdr_t *h);
int kvt_proto_hdr_check(const kvt_proto_hdr_t *h, uint32_t max_body);

/*
 * Body decoders: each takes exactly the body (len bytes) and returns 0 or KVT_EPROTO when the
 * body is truncated, too long, or inconsistent with its own counts (a token count that does not
 * match the length, an unknown flag bit, a name longer than KVT_PROTO_NAME_MAX). Pointers in the
 * result borrow from body.
 */
int kvt_proto_hello_decode(const uint8_t *body, size_t len, kvt_proto_hello_t *out);
int kvt_proto_match_decode(const uint8_t *body, size_t len, kvt_proto_match_t *out);
/* block_bytes is the connection's, from its HELLO: the payload must be npayload x block_bytes. */
int kvt_proto_put_decode(const uint8_t *body, size_t len, uint32_t block_bytes,
                         kvt_proto_put_t *out);
int kvt_proto_get_decode(const uint8_t *body, size_t len, kvt_proto_get_t *out);
int kvt_proto_prefetch_decode(const uint8_t *body, size_t len, kvt_proto_prefetch_t *out);
int kvt_proto_release_decode(const uint8_t *body, size_t len, uint64_t *lease);
int kvt_proto_remove_decode(const uint8_t *body, size_t len, uint32_t *ntokens,
                            const uint8_t **tokens);
int kvt_proto_map_decode(const uint8_t *body, size_t len, uint32_t *tier);
int kvt_proto_reserve_decode(const uint8_t *body, size_t len, kvt_proto_reserve_t *out);
int kvt_proto_commit_decode(const uint8_t *body, size_t len, uint64_t *resv);
/* COMMIT with KVT_COMMIT_F_SUMS: the reservation, then *nsums (at least 1) checksums, each a
 * little-endian u64 (kvt_get_u64 of sums + 8 * i), borrowed from the frame. */
int kvt_proto_commit_sums_decode(const uint8_t *body, size_t len, uint64_t *resv, uint32_t *nsums,
                                 const uint8_t **sums);

/* Copies n little-endian u32 tokens out of a frame into host order. */
void kvt_proto_tokens(const uint8_t *src, uint32_t n, uint32_t *dst);
/* Writes n host-order tokens to dst (4n bytes) as the wire has them. */
void kvt_proto_tokens_encode(uint8_t *dst, const uint32_t *src, uint32_t n);

/*
 * Request encoders (the client's side): the fixed part of each body. HELLO's names, the tokens
 * (kvt_proto_tokens_encode, or the caller's array as it is on a little-endian host) and PUT's
 * payload follow it; the pointers and lengths of the names and tokens in m are not read, except
 * HELLO's three lengths.
 */
void kvt_proto_hello_encode(uint8_t out[sizeof(kvt_wire_hello_t)], const kvt_proto_hello_t *m);
void kvt_proto_match_encode(uint8_t out[sizeof(kvt_wire_match_t)], const kvt_proto_match_t *m);
void kvt_proto_put_encode(uint8_t out[sizeof(kvt_wire_put_t)], const kvt_proto_put_t *m);
void kvt_proto_get_encode(uint8_t out[sizeof(kvt_wire_get_t)], const kvt_proto_get_t *m);
void kvt_proto_prefetch_encode(uint8_t out[sizeof(kvt_wire_prefetch_t)],
                               const kvt_proto_prefetch_t *m);
void kvt_proto_release_encode(uint8_t out[sizeof(kvt_wire_release_t)], uint64_t lease);
void kvt_proto_remove_encode(uint8_t out[sizeof(kvt_wire_remove_t)], uint32_t ntokens);
void kvt_proto_map_encode(uint8_t out[sizeof(kvt_wire_map_t)], uint32_t tier);
void kvt_proto_reserve_encode(uint8_t out[sizeof(kvt_wire_reserve_t)],
                              const kvt_proto_reserve_t *m);
void kvt_proto_commit_encode(uint8_t out[sizeof(kvt_wire_commit_t)], uint64_t resv);

/*
 * Replies. The server encodes, the client decodes; a decoder answers KVT_EPROTO for a body of
 * the wrong length. A MATCH reply's fixed part is followed by r->pages tier bytes (one
 * kvt_tier_id_t per matched page); its decoder checks that they are there and points *tiers at
 * them. A GET answers with data frames (KVT_RF_MORE: a head, then block_bytes of payload) and an
 * end frame (the pages sent).
 */
void kvt_proto_hello_reply_encode(uint8_t out[sizeof(kvt_wire_hello_reply_t)],
                                  const kvt_proto_hello_reply_t *r);
int kvt_proto_hello_reply_decode(const uint8_t *body, size_t len, kvt_proto_hello_reply_t *r);
void kvt_proto_match_reply_encode(uint8_t out[sizeof(kvt_wire_match_reply_t)],
                                  const kvt_proto_match_reply_t *r);
int kvt_proto_match_reply_decode(const uint8_t *body, size_t len, kvt_proto_match_reply_t *r,
                                 const uint8_t **tiers);
/* A reply to a MATCH with LOCATE: the fixed part, r->pages tier bytes, the locations' head and
 * r->pages offsets (kvt_proto_match_locs_encode writes the head, kvt_proto_match_loc_encode each
 * offset). The decoder checks that exactly these are there. */
void kvt_proto_match_locs_encode(uint8_t out[sizeof(kvt_wire_match_locs_t)], uint32_t lease_ms,
                                 uint32_t located);
void kvt_proto_match_loc_encode(uint8_t out[8], uint64_t offset);
int kvt_proto_match_reply_locs_decode(const uint8_t *body, size_t len, kvt_proto_match_reply_t *r,
                                      const uint8_t **tiers, kvt_proto_match_locs_t *locs);
uint64_t kvt_proto_match_loc(const kvt_proto_match_locs_t *locs, uint32_t i);
void kvt_proto_put_reply_encode(uint8_t out[sizeof(kvt_wire_put_reply_t)],
                                const kvt_proto_put_reply_t *r);
int kvt_proto_put_reply_decode(const uint8_t *body, size_t len, kvt_proto_put_reply_t *r);
void kvt_proto_prefetch_reply_encode(uint8_t out[sizeof(kvt_wire_prefetch_reply_t)],
                                     const kvt_proto_prefetch_reply_t *r);
int kvt_proto_prefetch_reply_decode(const uint8_t *body, size_t len, kvt_proto_prefetch_reply_t *r);
void kvt_proto_release_reply_encode(uint8_t out[sizeof(kvt_wire_release_reply_t)],
                                    uint32_t released);
int kvt_proto_release_reply_decode(const uint8_t *body, size_t len, uint32_t *released);
void kvt_proto_get_data_encode(uint8_t out[sizeof(kvt_wire_get_data_t)], uint32_t page,
                               uint8_t tier);
/* *data and *data_len: the block's bytes after the head. KVT_EPROTO for a location frame. */
int kvt_proto_get_data_decode(const uint8_t *body, size_t len, uint32_t *page, uint8_t *tier,
                              const uint8_t **data, uint32_t *data_len);
/* A data frame's kind (KVT_GET_DATA_BYTES or _LOC), or KVT_EPROTO when it is too short. */
int kvt_proto_get_data_kind(const uint8_t *body, size_t len);
void kvt_proto_get_loc_encode(uint8_t out[sizeof(kvt_wire_get_loc_t)], uint32_t page, uint8_t tier,
                              uint64_t offset, uint32_t len);
int kvt_proto_get_loc_decode(const uint8_t *body, size_t len, uint32_t *page, uint8_t *tier,
                             uint64_t *offset, uint32_t *data_len);
void kvt_proto_get_end_encode(uint8_t out[sizeof(kvt_wire_get_end_t)], uint32_t npages,
                              uint32_t lease_ms_left);
/* lease_ms_left may be NULL. */
int kvt_proto_get_end_decode(const uint8_t *body, size_t len, uint32_t *npages,
                             uint32_t *lease_ms_left);
/* MAP's reply: the fixed part, then handle_len bytes of handle. */
void kvt_proto_map_reply_encode(uint8_t out[sizeof(kvt_wire_map_reply_t)],
                                const kvt_proto_map_reply_t *r);
int kvt_proto_map_reply_decode(const uint8_t *body, size_t len, kvt_proto_map_reply_t *r);
/* RESERVE's reply: the fixed part, then r->nlocs locations (kvt_proto_resv_loc_encode each);
 * the decoder checks they are all there, and kvt_proto_resv_loc reads the i-th. */
void kvt_proto_reserve_reply_encode(uint8_t out[sizeof(kvt_wire_reserve_reply_t)],
                                    const kvt_proto_reserve_reply_t *r);
void kvt_proto_resv_loc_encode(uint8_t out[sizeof(kvt_wire_resv_loc_t)], uint32_t page,
                               uint64_t offset);
int kvt_proto_reserve_reply_decode(const uint8_t *body, size_t len, kvt_proto_reserve_reply_t *r);
void kvt_proto_resv_loc(const kvt_proto_reserve_reply_t *r, uint32_t i, uint32_t *page,
                        uint64_t *offset);

/*
 * STATS reply: u32 count, then count entries of u8 name_len, name, u64 value. The encoder
 * appends one entry at *len in out (cap bytes) and counts it in the u32 at out[0] (the caller
 * zeroes it and sets *len = 4 before the first); it returns KVT_ETOOBIG, writing nothing, when
 * the entry does not fit or its name is longer than 255 bytes. The decoder is an iterator on the
 * caller's stack over a body it borrows: begin checks the count is there (0 or KVT_EPROTO); next
 * gives the next entry (name NUL-terminated) and returns 1, 0 after the last, KVT_EPROTO for an
 * entry that runs past the body.
 */
typedef struct kvt_proto_stats_iter {
    const uint8_t *body;
    size_t len, off;
    uint32_t left;
} kvt_proto_stats_iter_t;

int kvt_proto_stat_encode(uint8_t *out, size_t cap, size_t *len, const char *name, uint64_t value);
int kvt_proto_stats_begin(kvt_proto_stats_iter_t *it, const uint8_t *body, size_t len);
int kvt_proto_stats_next(kvt_proto_stats_iter_t *it, char name[256], uint64_t *value);

/* Hints between host and wire form. decode returns KVT_EPROTO for unknown flag bits. */
void kvt_proto_hints_to_wire(const kvt_proto_hints_t *h, kvt_wire_hints_t *w);
int kvt_proto_hints_from_wire(const kvt_wire_hints_t *w, kvt_proto_hints_t *h);

/*
 * Frame building for both sides: writes a header for (op, flags, id, status) and a body of
 * body_len bytes at out, which must hold KVT_PROTO_HDR + body_len bytes.
 */
void kvt_proto_frame(uint8_t *out, unsigned op, uint16_t flags, uint64_t id, int32_t status,
                     uint32_t body_len);

#endif
