/*
 * kvtier.h: libkvtier, the C client of kvtierd. This header is the whole public API; it needs
 * nothing but the C library. The wire protocol under it is docs/protocol.md.
 *
 * A client is one connection, declared to one namespace (model, adapter, tenant salt, page size,
 * block byte size) by the HELLO that kvt_client_connect() sends, after AUTH when a secret is
 * given. Calls are synchronous: each sends one request and waits for its reply (up to the
 * configured timeout). A batch (kvt_batch_*) queues many requests and sends them pipelined in one
 * go, reading the replies as they come, which is what an engine's scheduler does per step.
 *
 * Errors: every function that can fail returns 0 or a negative code: the daemon's status
 * (KVT_E* values, listed below and named by kvt_client_strerror) or a negated errno from the
 * socket. After a reply with an error status, kvt_client_errmsg() gives the daemon's message.
 * A transport error (timeout, closed connection, a malformed reply) leaves the client unusable:
 * every later call returns KVT_CLIENT_ECLOSED; close it and connect again.
 *
 * Ownership: the client copies everything from its configuration. Token arrays and payloads are
 * borrowed only for the duration of the call (a batch copies them when queued, except
 * kvt_batch_put_ref's payload). Result structs and tier arrays passed to a batch are borrowed
 * until kvt_batch_run() returns.
 *
 * Threads: a client is used by one thread at a time; use one client per thread.
 */
#ifndef KVTIER_H
#define KVTIER_H

#include <stddef.h>
#include <stdint.h>

/* KVT_API marks what libkvtier exports: it is built with -fvisibility=hidden (and its static
 * parts, proto/ and common/, kept local), so that a function declared here without it is not
 * in the library, and nothing else (the wire codec, logging) is: scripts/check_exports.py holds
 * the two to each other. Defining KVT_API before including this header overrides it. */
#ifndef KVT_API
#if defined(__GNUC__) || defined(__clang__)
#define KVT_API __attribute__((visibility("default")))
#else
#define KVT_API
#endif
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Status codes, equal to kvtier's KVT_E* codes. */
enum {
    KVT_CLIENT_EINVAL = -30800,
    KVT_CLIENT_ENOMEM = -30801,
    KVT_CLIENT_ENOENT = -30802, /* no such lease, nothing cached there */
    KVT_CLIENT_EBUSY = -30803,  /* leased or in use (REMOVE) */
    KVT_CLIENT_ENOSPC = -30804,
    KVT_CLIENT_ECORRUPT = -30805,
    KVT_CLIENT_EIO = -30806,
    KVT_CLIENT_EPROTO = -30807, /* malformed frame or reply (also: a reply longer than the
                                   daemon's max-frame, refused before its body is read) */
    KVT_CLIENT_EUNAVAIL = -30808,
    KVT_CLIENT_ETIMEDOUT = -30809,
    KVT_CLIENT_EAGAIN = -30811, /* AUTH: too many wait their turn (a guessing attack): later */
    KVT_CLIENT_EAUTH = -30813,
    KVT_CLIENT_ETOOBIG = -30814,
    KVT_CLIENT_ECLOSED = -30812, /* the connection is gone */
};

/* The name of a status code or a negated errno; the string is static. */
KVT_API const char *kvt_client_strerror(int err);

/* Tiers, as MATCH reports them per block and PREFETCH takes them. */
enum {
    KVT_CLIENT_TIER_NONE = 0, /* index only: no bytes stored */
    KVT_CLIENT_TIER_HBM = 1,
    KVT_CLIENT_TIER_DRAM = 2,
    KVT_CLIENT_TIER_NVME = 3,
    KVT_CLIENT_TIER_REMOTE = 4,
};

typedef struct kvt_client kvt_client_t;

typedef struct kvt_client_conf {
    const char *unix_path; /* Unix socket; with tcp NULL too: "kvtierd.sock" in the working dir */
    const char *tcp;       /* "host:port", used when unix_path is NULL */
    const char *secret;    /* shared secret for AUTH; NULL or "": none */
    const char *model;     /* namespace: model name (required, 1..255 bytes) */
    const char *adapter;   /* namespace: adapter (LoRA) name; NULL: none */
    const char *salt;      /* namespace: tenant salt, isolates tenants; NULL: none */
    uint32_t page_size;    /* tokens per page, 1..1024 */
    uint32_t block_bytes;  /* KV bytes of one page; 0 for index-only use */
    int timeout_ms;        /* per call; 0: 10000 */
    int zero_copy;         /* 1: map the namespace's DRAM arena when possible (below); 0: never */
    /* The CUDA device (ordinal, 0..65535) the engine's KV cache is on. A daemon with an HBM
     * pool per device (hbm-devices) puts this connection's blocks, and the promotions its
     * PREFETCHes ask for, in that device's pool, and kvt_client_map_hbm gets that pool. 0 (a
     * zeroed conf): the first GPU. */
    int device;
} kvt_client_conf_t;

/* Connects, authenticates and declares the namespace. Returns 0, a negated errno (no daemon
 * there: -ENOENT or -ECONNREFUSED), KVT_CLIENT_EAUTH, KVT_CLIENT_EAGAIN (the daemon's line of
 * AUTHs is full: connect again later), KVT_CLIENT_EINVAL, KVT_CLIENT_EPROTO, or
 * KVT_CLIENT_ENOSPC (a new namespace the daemon has no room for). An AUTH may take a while to be
 * answered while someone guesses the secret (docs/protocol.md, AUTH). */
KVT_API int kvt_client_connect(kvt_client_t **out, const kvt_client_conf_t *conf);
/* Closes the connection (the daemon releases every lease and reservation it held) and unmaps
 * the zero-copy mapping: every pointer into it (kvt_client_get_cb's, kvt_client_reserve's) dies
 * here. NULL is a no-op. */
KVT_API void kvt_client_close(kvt_client_t *c);
/* The daemon's message for the last error reply ("" if none); valid until the next call. A GET
 * whose stream stopped (its end frame carries a status, no message) says after how many pages. */
KVT_API const char *kvt_client_errmsg(const kvt_client_t *c);
/* What HELLO answered: the namespace's seed (its hash chain's start) and the server's tiers
 * (bit 1 << tier per tier it has). */
KVT_API uint64_t kvt_client_ns_seed(const kvt_client_t *c);
KVT_API unsigned kvt_client_tiers(const kvt_client_t *c);

/*
 * Zero-copy (docs/protocol.md, "Zero-copy for local clients"). With conf->zero_copy set, a client
 * on the daemon's Unix socket with a block size sends MAP after HELLO and maps (MAP_SHARED) the
 * memfd that holds its namespace's DRAM blocks, which the reply carries (SCM_RIGHTS). From then
 * on, with nothing else to do for the caller:
 *
 *   kvt_client_get     GET with LOCATE: a page in the mapping is copied from it into buf (the
 *                      one copy; no bytes cross the socket); other pages come as before.
 *   kvt_client_get_cb  the same, but cb gets a pointer INTO the mapping: no copy at all.
 *   kvt_client_put     RESERVE, one memcpy per page into the reserved room, COMMIT; pages that
 *                      got no room go by an ordinary PUT. Same results as a socket PUT. Where
 *                      the daemon seals committed pages (zero-copy-checksum), each page is
 *                      hashed (XXH3-64) as it is copied and the sums go with COMMIT.
 *
 * A refused MAP (no DRAM tier, zero-copy off in the daemon, no arena left, TCP) is not an error:
 * the client stays on the socket path, and kvt_client_zero_copy_reason() says why. Batches
 * (kvt_batch_*) are socket-only. Keyed clients (kvt_keys_*) map as their conf says.
 *
 * Safety: bytes read through the mapping are valid only while the lease they were read under
 * holds; after RELEASE or expiry the daemon may reuse the memory for another block of the
 * namespace. kvt_client_get and kvt_client_get_cb check, before returning, that the lease could
 * not have expired while the pages were read (the GET's end frame says how long it had left,
 * counted from before the request was sent): if it could, they return KVT_CLIENT_ETIMEDOUT and
 * the bytes delivered must be thrown away. Ask for leases long enough to read the pages.
 */

/* 1 when the client mapped its namespace's DRAM arena (zero-copy in use), else 0. */
KVT_API int kvt_client_zero_copy(const kvt_client_t *c);
/* Why zero-copy is not in use: "" when it is, else a message (conf->zero_copy 0, TCP, no block
 * size, or the daemon's refusal with its code and message). Static until kvt_client_close. */
KVT_API const char *kvt_client_zero_copy_reason(const kvt_client_t *c);
/* The mapping's address and length (*bytes, if not NULL); NULL (and 0) when not mapped. Valid
 * until kvt_client_close. Read-only for callers, except through kvt_client_reserve's pointers. */
KVT_API const void *kvt_client_mapping(const kvt_client_t *c, uint64_t *bytes);

/* Hints to the daemon's policy, on MATCH and PUT. All optional: pass NULL for none. */
enum {
    KVT_CLIENT_HINT_PAUSED = 1u << 0,   /* the session pauses; back in resume_ms */
    KVT_CLIENT_HINT_FINISHED = 1u << 1, /* the session ended */
};
typedef struct kvt_client_hints {
    uint64_t engine_request_id; /* the engine's own request id, for the daemon's logs */
    uint32_t resume_ms;
    uint16_t priority; /* retention priority, 0 = none */
    uint16_t flags;    /* KVT_CLIENT_HINT_* */
} kvt_client_hints_t;

/* MATCH flags. */
enum {
    KVT_CLIENT_LEASE = 1u << 0,  /* pin the matched path; res->lease names the lease */
    KVT_CLIENT_REMOTE = 1u << 1, /* also look in the remote tier beyond the local match */
    KVT_CLIENT_PROBE = 1u << 2,  /* only look: not counted as a use or in the hit metrics */
    KVT_CLIENT_LOCATE = 1u << 3, /* with LEASE: where each page lies (kvt_client_match_step) */
    KVT_CLIENT_KEEP = 1u << 4,   /* keep the tokens under a handle (kvt_client_match_step) */
};

typedef struct kvt_client_match {
    uint32_t tokens;       /* matched tokens (pages x page size) */
    uint32_t pages;        /* matched pages */
    uint32_t remote_pages; /* of those, found by the remote probe */
    uint64_t lease;        /* with KVT_CLIENT_LEASE and pages > 0; else 0 */
    uint8_t *tiers;        /* in: caller's array (may be NULL); out: tier of each matched page */
    uint32_t tiers_cap;    /* in: entries tiers holds; pages beyond it are not reported */
} kvt_client_match_t;

typedef struct kvt_client_put {
    uint32_t pages;     /* whole pages of the request, all in the index now */
    uint32_t new_pages; /* pages this PUT added */
    uint32_t stored;    /* payload pages stored by this PUT */
    uint32_t skipped;   /* payload pages not stored: held already, or no room anywhere */
} kvt_client_put_t;

typedef struct kvt_client_prefetch {
    uint32_t pages, moved, resident, failed;
} kvt_client_prefetch_t;

/* PING with an echoed payload; *rtt_ns (if not NULL) gets the round trip. */
KVT_API int kvt_client_ping(kvt_client_t *c, uint64_t *rtt_ns);

/* The longest cached prefix of tokens[0, ntokens). lease_ms: the lease's time limit (0: the
 * daemon's default; capped by its maximum). KVT_CLIENT_LOCATE and KVT_CLIENT_KEEP need
 * kvt_client_match_step (here: KVT_CLIENT_EINVAL); so do they in kvt_batch_match. */
KVT_API int kvt_client_match(kvt_client_t *c, const uint32_t *tokens, uint32_t ntokens,
                             unsigned flags, uint32_t lease_ms, const kvt_client_hints_t *hints,
                             kvt_client_match_t *res);

/*
 * One round trip per step (docs/protocol.md, MATCH's LOCATE and KEEP, PUT's HANDLE). An engine's
 * step MATCHes a prompt, loads the pages that hit, and PUTs the pages it computed. With
 * kvt_client_match_step the MATCH also answers where each leased page lies in the mapping
 * (KVT_CLIENT_LEASE | KVT_CLIENT_LOCATE: no GET to send) and keeps its tokens on the daemon
 * (KVT_CLIENT_KEEP: the PUT after it sends only the tokens past them, kvt_client_put_kept).
 *
 * A location: a page in the DRAM mapping has host_ptr (mapping + offset); a page in the HBM pool
 * (kvt_client_map_hbm) its offset and host_ptr NULL; any other page tier NONE here (not located:
 * read it with kvt_client_get under step->lease). Located bytes hold while the lease does:
 * finish reading them before valid_until_ns (CLOCK_MONOTONIC: the lease's limit counted from
 * before the MATCH was sent) and before kvt_client_release, and discard what was read after.
 */
typedef struct kvt_client_loc {
    unsigned tier;        /* KVT_CLIENT_TIER_DRAM or _HBM; _NONE: not located */
    const void *host_ptr; /* DRAM: the page's bytes in the mapping (read-only); else NULL */
    uint64_t offset;      /* located: its offset in the tier's mapping (HBM: in the pool) */
} kvt_client_loc_t;

typedef struct kvt_client_step {
    kvt_client_loc_t *locs;  /* in: caller's array for LOCATE (may be NULL); out: per page */
    uint32_t locs_cap;       /* in: entries locs holds; pages beyond it are not reported */
    uint32_t located;        /* out, LOCATE: pages with a location */
    uint64_t valid_until_ns; /* out, LOCATE: reads of located bytes must end before this */
    uint32_t handle;         /* out, KEEP: for kvt_client_put_kept; 0: the daemon kept none */
    uint32_t kept;           /* out, KEEP: the tokens kept (ntokens; 0 when handle is 0) */
} kvt_client_step_t;

/* kvt_client_match with the step's flags: KVT_CLIENT_LOCATE (needs KVT_CLIENT_LEASE, and a
 * zero-copy mapping to locate anything) and KVT_CLIENT_KEEP. res as kvt_client_match's; step
 * may be NULL without LOCATE and KEEP. KVT_CLIENT_EINVAL for LOCATE without LEASE. */
KVT_API int kvt_client_match_step(kvt_client_t *c, const uint32_t *tokens, uint32_t ntokens,
                                  unsigned flags, uint32_t lease_ms,
                                  const kvt_client_hints_t *hints, kvt_client_match_t *res,
                                  kvt_client_step_t *step);

/*
 * kvt_client_put of tokens[0, ntokens) after a MATCH that kept tokens[0, kept) under handle
 * (kvt_client_match_step with KVT_CLIENT_KEEP; the caller vouches that they are the same): only
 * tokens[kept, ntokens) are sent. With handle 0, or when the daemon no longer holds the handle
 * (expired with the MATCH's lease time, replaced by newer ones, the connection's namespace
 * switched), the whole sequence is sent instead: the same result, one more round trip at most.
 * A handle may be named by any number of PUTs until then. KVT_CLIENT_EINVAL for kept > ntokens.
 */
KVT_API int kvt_client_put_kept(kvt_client_t *c, uint32_t handle, const uint32_t *tokens,
                                uint32_t ntokens, uint32_t kept, uint32_t first_page,
                                uint32_t npages, const void *payload,
                                const kvt_client_hints_t *hints, kvt_client_put_t *res);
/* The same with one buffer of block_bytes per page, as kvt_client_putv is kvt_client_put's. */
KVT_API int kvt_client_putv_kept(kvt_client_t *c, uint32_t handle, const uint32_t *tokens,
                                 uint32_t ntokens, uint32_t kept, uint32_t first_page,
                                 uint32_t npages, const void *const *blocks,
                                 const kvt_client_hints_t *hints, kvt_client_put_t *res);

/*
 * Chains with gaps (docs/protocol.md): with KVT_CLIENT_PUT_GAPS, every later PUT and RESERVE of c
 * (kvt_client_put, _putv, _put_kept, _reserve, kvt_batch_put, and the keyed puts of a
 * kvt_keys_t through kvt_keys_client) may store pages after pages of the chain that hold no
 * bytes, as a sliding-window attention layer needs (only its window's pages), where without it
 * the daemon skips them (counted in the reply's skipped). flags: 0 or KVT_CLIENT_PUT_GAPS;
 * other bits are ignored. Returns the flags set before. A MATCH reports every page of a chain
 * the daemon knows with its tier (0 for a page without bytes) either way.
 */
enum {
    KVT_CLIENT_PUT_GAPS = 1u << 0,
};
KVT_API unsigned kvt_client_set_put_flags(kvt_client_t *c, unsigned flags);

/*
 * Caches every whole page of tokens and stores the KV bytes of pages [first_page, first_page +
 * npages): payload holds npages x block_bytes bytes (NULL with npages 0: index only). Pages
 * already stored keep their bytes. Replies when the bytes are in their tier. Zero-copy: RESERVE
 * (with a MATCH PROBE pipelined behind it), a memcpy per reserved page into the mapping, COMMIT;
 * pages that got no room and hold no bytes go by a socket PUT. The results are a socket PUT's;
 * a PUT of pages already held costs one round trip and sends no payload.
 */
KVT_API int kvt_client_put(kvt_client_t *c, const uint32_t *tokens, uint32_t ntokens,
                           uint32_t first_page, uint32_t npages, const void *payload,
                           const kvt_client_hints_t *hints, kvt_client_put_t *res);
/* The same with one buffer of block_bytes per page (blocks[0 .. npages)). A mapped client copies
 * each straight into its reserved room; on the socket one PUT sends each from where it lies. */
KVT_API int kvt_client_putv(kvt_client_t *c, const uint32_t *tokens, uint32_t ntokens,
                            uint32_t first_page, uint32_t npages, const void *const *blocks,
                            const kvt_client_hints_t *hints, kvt_client_put_t *res);

/*
 * The KV bytes of pages [first_page, first_page + npages) of a leased path (npages 0: to its
 * end), into buf (cap bytes: npages x block_bytes). *got (if not NULL) gets the pages received;
 * tiers (if not NULL, npages entries) the tier each came from. The daemon streams the blocks
 * from wherever they are, promoting them on the way. Zero-copy: pages in the mapping are copied
 * from it into buf; KVT_CLIENT_ETIMEDOUT when the lease may have expired before they were (buf's
 * bytes are then not to be trusted; the call can be repeated under a new lease).
 */
KVT_API int kvt_client_get(kvt_client_t *c, uint64_t lease, uint32_t first_page, uint32_t npages,
                           void *buf, size_t cap, uint32_t *got, uint8_t *tiers);

/* The same, handing each block to cb as it arrives (data valid during the call). A non-zero
 * return from cb stops delivery (the rest of the reply is read and dropped) and is returned.
 * Zero-copy (above): data points into the mapping, the daemon's own copy of the block. Read it,
 * never write it; KVT_CLIENT_ETIMEDOUT after the callbacks means what they read may have been
 * reused and must be discarded. */
typedef int (*kvt_client_block_cb)(void *arg, uint32_t page, unsigned tier, const void *data,
                                   uint32_t len);
KVT_API int kvt_client_get_cb(kvt_client_t *c, uint64_t lease, uint32_t first_page, uint32_t npages,
                              kvt_client_block_cb cb, void *arg, uint32_t *got);

/*
 * Zero-copy PUT in two steps, for a caller that produces a page's bytes straight into the
 * daemon's memory. kvt_client_reserve caches every whole page of tokens (as a PUT) and reserves
 * room in the mapping for the pages [first_page, first_page + npages) that have no bytes yet:
 * res->ptrs (the caller's array of npages pointers) gets, for page first_page + i, where to write
 * its block_bytes bytes, or NULL when it got none (held already, being written by another
 * request, or no room in DRAM: send those with kvt_client_put if they matter). res->id names the
 * reservation (0 when nothing was reserved: nothing to commit). Nothing is visible to anyone
 * until kvt_client_commit(id), which stores every reserved page as a PUT would and fills res
 * (stored: pages made visible) if not NULL; kvt_client_abort(id) gives the room back. A
 * reservation not committed within the daemon's reserve-ms, or whose connection closes, makes
 * none of its pages visible: they stay index-only (KVT_CLIENT_TIER_NONE); an expired one's
 * commit answers KVT_CLIENT_ENOENT (its room, kept until then, goes back).
 *
 * The pointers are valid until the commit or abort (the memory is the daemon's after that).
 * Before the call returns, the room is made present in this client's mapping (one
 * madvise(MADV_POPULATE_WRITE) per run of 64 KiB granules wholly inside it, once per mapping,
 * where the kernel has it), so that writing it takes no page fault per 4 KiB.
 * kvt_client_commit sends no checksums: a daemon with zero-copy-checksum on hashes the pages
 * itself after its reply (one more pass over them, docs/benchmarks.md); res->sealed says so, and
 * kvt_client_commit_sums sends them.
 * Errors: KVT_CLIENT_EINVAL (not mapped; npages 0; pages past the tokens' whole pages),
 * KVT_CLIENT_ENOSPC (the index is full, or this connection holds the daemon's
 * max-reservations), KVT_CLIENT_ENOENT from commit/abort (an id this connection does not hold:
 * never made, committed already, expired, or another connection's).
 */
typedef struct kvt_client_resv {
    uint64_t id;        /* for kvt_client_commit/abort; 0 when no page got room */
    uint32_t pages;     /* whole pages of the request, all in the index now */
    uint32_t new_pages; /* pages this request added to the index */
    uint32_t nreserved; /* pages that got room (non-NULL entries of ptrs) */
    uint32_t sealed;    /* 1 when the daemon seals these pages (RESERVE's SEAL, zero-copy-checksum):
                         * their sums are worth sending (kvt_client_commit_sums) */
    void **ptrs;        /* in: caller's array of npages; out: page first_page + i's room or NULL */
} kvt_client_resv_t;
KVT_API int kvt_client_reserve(kvt_client_t *c, const uint32_t *tokens, uint32_t ntokens,
                               uint32_t first_page, uint32_t npages,
                               const kvt_client_hints_t *hints, kvt_client_resv_t *res);
/*
 * kvt_client_reserve of tokens[0, ntokens) after a MATCH that kept tokens[0, kept) under handle,
 * as kvt_client_put_kept is kvt_client_put's: only tokens[kept, ntokens) are sent, and with
 * handle 0, or when the daemon no longer holds the handle (its ENOENT), the RESERVE goes again
 * with all of them (the same result, one more round trip at most). first_page and npages count
 * over the whole sequence. Errors as kvt_client_reserve's, and KVT_CLIENT_EINVAL for kept >
 * ntokens, or a handle kept in another namespace than the connection's now (a HELLO since).
 */
KVT_API int kvt_client_reserve_kept(kvt_client_t *c, uint32_t handle, const uint32_t *tokens,
                                    uint32_t ntokens, uint32_t kept, uint32_t first_page,
                                    uint32_t npages, const kvt_client_hints_t *hints,
                                    kvt_client_resv_t *res);
KVT_API int kvt_client_commit(kvt_client_t *c, uint64_t id, kvt_client_put_t *res);
/* kvt_client_commit with the pages' checksums (COMMIT's SUMS): sums[i] the XXH3-64 (seed 0) of
 * the i-th reserved page (non-NULL ptrs in page order) as written, nsums the reservation's
 * nreserved (kvt_copy_pages_xxh3 computes them in the copy). Where the reservation is sealed the
 * daemon records them instead of reading the pages after its reply; a wrong sum only gets that
 * page dropped at its first check (docs/protocol.md, COMMIT). Errors as kvt_client_commit's, and
 * KVT_CLIENT_EINVAL for sums NULL or nsums 0 (nothing sent), or nsums other than the pages
 * reserved (the daemon's; the reservation is still held). */
KVT_API int kvt_client_commit_sums(kvt_client_t *c, uint64_t id, const uint64_t *sums,
                                   uint32_t nsums, kvt_client_put_t *res);
KVT_API int kvt_client_abort(kvt_client_t *c, uint64_t id);

/*
 * HBM blocks for a CUDA client in the same host: sends MAP for the HBM tier and returns the
 * cudaIpcMemHandle_t of the daemon's HBM pool (handle, 64 bytes) and its size. The caller opens
 * it with cudaIpcOpenMemHandle in its own process (libkvtier does not link CUDA) and reads HBM
 * pages at the offsets kvt_client_get_loc gives. Errors: KVT_CLIENT_EUNAVAIL (no HBM tier, a
 * host backend, or the daemon's hbm-ipc off), KVT_CLIENT_EINVAL (TCP, no block size). After it,
 * the daemon answers this connection's HBM pages by location: kvt_client_get and
 * kvt_client_get_cb (which deliver host bytes) stop asking for locations at all; read through
 * kvt_client_get_loc.
 */
KVT_API int kvt_client_map_hbm(kvt_client_t *c, uint8_t handle[64], uint64_t *pool_bytes);

/*
 * The raw form of a zero-copy GET, for callers that copy with their own engine (cudaMemcpy from
 * the mapping or from the HBM pool): GET with LOCATE of pages [first_page, first_page + npages)
 * of a leased path (npages 0: to its end), one cb call per page in page order:
 *
 *   a page in the DRAM mapping: tier DRAM, host_ptr = mapping + offset, data NULL
 *   a page in the HBM pool:     tier HBM, host_ptr NULL, offset into the pool, data NULL
 *   any other page:             its bytes in data (valid during the call), host_ptr NULL, offset 0
 *
 * len is block_bytes. A location outside the mapping (or pool), or a len other than
 * block_bytes, is KVT_CLIENT_EPROTO. A non-zero return from cb stops delivery (the rest is read
 * and dropped) and is returned. Located bytes stay valid while the lease holds: finish reading
 * them (a copy started in cb included) before it is released or expires. The call returns
 * KVT_CLIENT_ETIMEDOUT when the lease may have expired before it returned (as kvt_client_get).
 */
typedef int (*kvt_client_loc_cb)(void *arg, uint32_t page, unsigned tier, const void *host_ptr,
                                 uint64_t offset, uint32_t len, const void *data);
KVT_API int kvt_client_get_loc(kvt_client_t *c, uint64_t lease, uint32_t first_page,
                               uint32_t npages, kvt_client_loc_cb cb, void *arg);

/* Moves the cached prefix of tokens up to tier (HBM, DRAM or NVMe) within deadline_ms (0: the
 * daemon's lease time); replies at completion or at the deadline. */
KVT_API int kvt_client_prefetch(kvt_client_t *c, const uint32_t *tokens, uint32_t ntokens,
                                unsigned tier, uint32_t deadline_ms, kvt_client_prefetch_t *res);
/* The same, answered as soon as the moves have started, so that it holds up no reply behind it
 * on the connection: res->moved counts the pages on their way up (or arrived since the request
 * came), res->failed those not started when it answered. More start as the first land, until
 * the deadline, with no further reply; a MATCH shows where the pages are. */
KVT_API int kvt_client_prefetch_start(kvt_client_t *c, const uint32_t *tokens, uint32_t ntokens,
                                      unsigned tier, uint32_t deadline_ms,
                                      kvt_client_prefetch_t *res);

/* Releases a lease; *released (if not NULL) is 1 if it was held, 0 if not (already released,
 * expired): releasing twice is not an error. */
KVT_API int kvt_client_release(kvt_client_t *c, uint64_t lease, int *released);
/* Releases lease without a round trip: the RELEASE goes out in front of the next request on the
 * connection (in the same write; at once when 64 wait), and its reply, which comes before that
 * request's, is read and dropped then. So the lease holds until the client's next call (or its
 * expiry, or kvt_client_close): a step releases the last step's lease with its own MATCH.
 * Returns 0 or a transport error (ECLOSED). */
KVT_API int kvt_client_release_later(kvt_client_t *c, uint64_t lease);

/* Drops the last whole page of tokens and everything cached beneath it. KVT_CLIENT_ENOENT when
 * not cached, KVT_CLIENT_EBUSY when a connection's lease holds it. Blocks the daemon itself is
 * moving or reading are waited for (up to a second, then KVT_CLIENT_EBUSY), not refused. */
KVT_API int kvt_client_remove(kvt_client_t *c, const uint32_t *tokens, uint32_t ntokens);
/* The same, but blocks busy with the daemon's own I/O are KVT_CLIENT_EBUSY at once (nothing
 * removed), so that the REMOVE holds up no reply behind it on the connection. */
KVT_API int kvt_client_remove_nowait(kvt_client_t *c, const uint32_t *tokens, uint32_t ntokens);

/* The daemon's counters, one cb call per (name, value); cb's non-zero return stops. */
typedef int (*kvt_client_stat_cb)(void *arg, const char *name, uint64_t value);
KVT_API int kvt_client_stats(kvt_client_t *c, kvt_client_stat_cb cb, void *arg);

/*
 * Batches: requests queued with kvt_batch_* go out together in kvt_batch_run(), pipelined, and
 * their replies fill the result structs given when queued. Each queued request has its own
 * status (an int the caller gives, set by run). A batch may be run again after more requests are
 * queued; kvt_batch_reset() empties it. Batches are socket-only: a batched PUT sends its payload
 * through the socket even on a zero-copy client.
 */
typedef struct kvt_batch kvt_batch_t;

KVT_API int kvt_batch_create(kvt_batch_t **out, kvt_client_t *c);
KVT_API void kvt_batch_destroy(kvt_batch_t *b);
KVT_API void kvt_batch_reset(kvt_batch_t *b);
KVT_API size_t kvt_batch_size(const kvt_batch_t *b);
KVT_API int kvt_batch_ping(kvt_batch_t *b, int *status);
KVT_API int kvt_batch_match(kvt_batch_t *b, const uint32_t *tokens, uint32_t ntokens,
                            unsigned flags, uint32_t lease_ms, const kvt_client_hints_t *hints,
                            kvt_client_match_t *res, int *status);
/* kvt_client_match_step's request, queued: step (borrowed as res is) is filled when its reply
 * comes; LOCATE's time limit counts from when kvt_batch_run began to send. */
KVT_API int kvt_batch_match_step(kvt_batch_t *b, const uint32_t *tokens, uint32_t ntokens,
                                 unsigned flags, uint32_t lease_ms, const kvt_client_hints_t *hints,
                                 kvt_client_match_t *res, kvt_client_step_t *step, int *status);
KVT_API int kvt_batch_put(kvt_batch_t *b, const uint32_t *tokens, uint32_t ntokens,
                          uint32_t first_page, uint32_t npages, const void *payload,
                          const kvt_client_hints_t *hints, kvt_client_put_t *res, int *status);
/* kvt_batch_put with the payload lent, not copied: it is sent from where it lies and must stay
 * valid and unchanged until kvt_batch_run() returns (or the batch is reset). For big pages the
 * copy into the batch costs as much as sending them. */
KVT_API int kvt_batch_put_ref(kvt_batch_t *b, const uint32_t *tokens, uint32_t ntokens,
                              uint32_t first_page, uint32_t npages, const void *payload,
                              const kvt_client_hints_t *hints, kvt_client_put_t *res, int *status);
/* kvt_client_prefetch's request, queued: res is filled when its reply comes, which is when the
 * moves are done or the deadline passes (the batch's run waits for that). */
KVT_API int kvt_batch_prefetch(kvt_batch_t *b, const uint32_t *tokens, uint32_t ntokens,
                               unsigned tier, uint32_t deadline_ms, kvt_client_prefetch_t *res,
                               int *status);
/* kvt_client_prefetch_start's request, queued. */
KVT_API int kvt_batch_prefetch_start(kvt_batch_t *b, const uint32_t *tokens, uint32_t ntokens,
                                     unsigned tier, uint32_t deadline_ms,
                                     kvt_client_prefetch_t *res, int *status);
/* kvt_client_remove's request, queued; and kvt_client_remove_nowait's. */
KVT_API int kvt_batch_remove(kvt_batch_t *b, const uint32_t *tokens, uint32_t ntokens, int *status);
KVT_API int kvt_batch_remove_nowait(kvt_batch_t *b, const uint32_t *tokens, uint32_t ntokens,
                                    int *status);
KVT_API int kvt_batch_release(kvt_batch_t *b, uint64_t lease, int *status);
/* Sends everything queued and waits for every reply. Returns 0 when all replies came (each
 * request's own outcome is in its status), or a transport error. The batch is empty after. */
KVT_API int kvt_batch_run(kvt_batch_t *b);

/*
 * Block keys: engines that name their own pages (SGLang HiCache, LMCache, vLLM's block hashes)
 * store and find them by key. This is a client-side convention over the same frames, not a
 * daemon feature (docs/protocol.md, "Keyed blocks"): each key (1..KVT_KEY_MAX bytes) hashes
 * (xxh3-128) to KVT_KEY_TOKENS synthetic token ids, one page of a keyed namespace whose page
 * size is KVT_KEY_TOKENS. A chain of keys (each naming a page and, implicitly, its prefix) is
 * the token sequence of its keys in order, so chains share prefixes in the radix tree, are
 * deduplicated there and evicted leaf first, exactly as token pages. An independent key (a page
 * named by an already-chained hash, looked up alone) is a chain of one.
 *
 * A keyed namespace is the namespace of the conf with KVT_KEYS_TAG put before its adapter name
 * ("kvt:keys:v1", or "kvt:keys:v1:" + adapter) and page size KVT_KEY_TOKENS, so that it never
 * sees the token namespaces of the same model. Adapter names beginning "kvt:" are reserved.
 *
 * A key is found only in the form it was stored in: keys[i] of a chain is the page under the
 * chain's keys[0..i), not the independent key keys[i].
 *
 * kvt_keys_t is one connection (a kvt_client_t declared to the keyed namespace) plus the
 * mapping; same thread rule as kvt_client_t. Keys are borrowed for the call.
 */
#define KVT_KEY_MAX    1024 /* bytes in one key */
#define KVT_KEY_TOKENS 4    /* synthetic token ids per key (a keyed page's page_size) */
#define KVT_KEYS_TAG   "kvt:keys:v1"

typedef struct kvt_keys kvt_keys_t;
typedef struct kvt_key {
    const void *data;
    size_t len; /* 1..KVT_KEY_MAX */
} kvt_key_t;

/* The synthetic tokens of one key: XXH3-128 of its bytes, high 64 bits first, each half high 32
 * bits first (docs/protocol.md, "Keyed blocks"). KVT_CLIENT_EINVAL for len 0 or > KVT_KEY_MAX. */
KVT_API int kvt_key_tokens(const void *key, size_t len, uint32_t out[KVT_KEY_TOKENS]);

/* Connects as kvt_client_connect() does, declaring conf's namespace made keyed (above):
 * conf->page_size is ignored (KVT_KEY_TOKENS), conf->adapter must leave room for the tag (at most
 * 255 - 12 bytes). Returns what kvt_client_connect() returns. */
KVT_API int kvt_keys_connect(kvt_keys_t **out, const kvt_client_conf_t *conf);
/* Closes the connection (releasing its leases). NULL is a no-op. */
KVT_API void kvt_keys_close(kvt_keys_t *k);
/* The connection underneath, for kvt_client_ping/stats; owned by k, valid until its close. */
KVT_API kvt_client_t *kvt_keys_client(kvt_keys_t *k);
/* The message for the last error: a key-side one (a key too long) or the daemon's; "" if none.
 * Valid until the next call on k. */
KVT_API const char *kvt_keys_errmsg(const kvt_keys_t *k);

/* Chains. keys[0, n) is one chain. Too long a key anywhere: KVT_CLIENT_EINVAL, nothing sent. */

/* *hits = how many leading keys of the chain are cached (a MATCH, counted as a lookup). */
KVT_API int kvt_keys_chain_exists(kvt_keys_t *k, const kvt_key_t *keys, uint32_t n, uint32_t *hits);
/* Caches the chain and stores the blocks of keys [first, first + npages) from payload (npages x
 * block_bytes bytes; NULL with npages 0: index only). res may be NULL. As kvt_client_put. */
KVT_API int kvt_keys_chain_put(kvt_keys_t *k, const kvt_key_t *keys, uint32_t n, uint32_t first,
                               uint32_t npages, const void *payload, kvt_client_put_t *res);
/* The same with one pointer per block (blocks[i] holds key first + i's block_bytes bytes), as
 * kvt_client_putv: copied each straight into the daemon's memory by a mapped client, gathered
 * into one PUT (one copy) on the socket. */
KVT_API int kvt_keys_chain_putv(kvt_keys_t *k, const kvt_key_t *keys, uint32_t n, uint32_t first,
                                uint32_t npages, const void *const *blocks, kvt_client_put_t *res);
/* Reads the blocks of keys [first, first + cap / block_bytes) of the chain into buf, as far as
 * the chain is cached: MATCH with a lease, GET, RELEASE. *got = blocks written (0 when key first
 * is missing, or one before it is not in the index: not an error; keys before first that the
 * index holds without their block, a gap of docs/protocol.md, do not stop it). */
KVT_API int kvt_keys_chain_get(kvt_keys_t *k, const kvt_key_t *keys, uint32_t n, uint32_t first,
                               void *buf, size_t cap, uint32_t *got);

/*
 * Tokens sent once (docs/protocol.md, "Handles"; "Keyed blocks"): a chain's lookup or read that
 * keeps its keys' tokens on the daemon (MATCH with KEEP), and a chain PUT that names them, so
 * that it sends only the tokens of the keys past them. An engine's step reads the keys that hit
 * (kvt_keys_chain_get_kept) and then stores the keys it computed after them
 * (kvt_keys_chain_put_kept): the chain's tokens go over the wire once, not twice.
 *
 * A kept chain is valid on its kvt_keys_t only, for as long as the daemon holds the handle (the
 * daemon's lease-ms; a connection keeps at most 16). keys[0, after->keys) of the PUT must be the
 * keys the lookup named (the caller vouches for it: the daemon sees only tokens). With
 * after->handle 0 (the daemon kept none), or a handle the daemon no longer holds (its ENOENT),
 * the PUT sends every key's tokens: the same result, one more round trip at most, as
 * kvt_client_put_kept. KVT_CLIENT_EINVAL (nothing sent) when after->keys > n.
 */
typedef struct kvt_keys_kept {
    uint32_t handle; /* the daemon's handle; 0 when it kept none */
    uint32_t keys;   /* the leading keys kept (0 when handle is 0) */
} kvt_keys_kept_t;
/* kvt_keys_chain_exists, keeping the chain's tokens: *kept gets the handle (all n keys). */
KVT_API int kvt_keys_chain_exists_kept(kvt_keys_t *k, const kvt_key_t *keys, uint32_t n,
                                       uint32_t *hits, kvt_keys_kept_t *kept);
/* kvt_keys_chain_get, keeping the tokens its MATCH sent: keys [0, min(n, first + cap /
 * block_bytes)), the keys up to the last one read (kept->keys says how many). */
KVT_API int kvt_keys_chain_get_kept(kvt_keys_t *k, const kvt_key_t *keys, uint32_t n,
                                    uint32_t first, void *buf, size_t cap, uint32_t *got,
                                    kvt_keys_kept_t *kept);
/* kvt_keys_chain_put and _putv after a kept chain (after may be NULL: as without it). */
KVT_API int kvt_keys_chain_put_kept(kvt_keys_t *k, const kvt_keys_kept_t *after,
                                    const kvt_key_t *keys, uint32_t n, uint32_t first,
                                    uint32_t npages, const void *payload, kvt_client_put_t *res);
KVT_API int kvt_keys_chain_putv_kept(kvt_keys_t *k, const kvt_keys_kept_t *after,
                                     const kvt_key_t *keys, uint32_t n, uint32_t first,
                                     uint32_t npages, const void *const *blocks,
                                     kvt_client_put_t *res);

/* Drops the chain's last key and everything cached beneath it (as kvt_client_remove). */
KVT_API int kvt_keys_chain_remove(kvt_keys_t *k, const kvt_key_t *keys, uint32_t n);

/*
 * Independent keys: each key is a chain of one, and each gets its own answer. Pipelined (one
 * batch per call). Returns how many keys succeeded (>= 0; a missing key is a miss, not an
 * error) or a transport error / KVT_CLIENT_EINVAL (a key too long: nothing sent). status (may be
 * NULL: n entries) gets each key's outcome: 0, KVT_CLIENT_ENOENT (missing), or its error.
 */
/* found[i] = 1 when key i is cached, else 0. */
KVT_API int kvt_keys_exists(kvt_keys_t *k, const kvt_key_t *keys, uint32_t n, uint8_t *found);
/* Stores blocks[i] (block_bytes bytes) under key i, each sent from where it lies: on the socket
 * one pipelined PUT per key; on a mapped client copied once into the daemon's memory, the RESERVEs
 * of 32 keys at a time pipelined, then their COMMITs (two round trips per 32 keys; a probe round
 * trip more where a key got no room). A block the daemon skipped for want of room (checked with a
 * PROBE) is KVT_CLIENT_ENOSPC. */
KVT_API int kvt_keys_put(kvt_keys_t *k, const kvt_key_t *keys, uint32_t n,
                         const void *const *blocks, int *status);
/* Reads key i's block into bufs[i] (block_bytes bytes each): one pipelined MATCH with a lease per
 * key, a GET per hit, one pipelined RELEASE of the leases. */
KVT_API int kvt_keys_get(kvt_keys_t *k, const kvt_key_t *keys, uint32_t n, void *const *bufs,
                         int *status);
/* Drops each key (and what a chain stored beneath it). Busy/missing keys: their status. */
KVT_API int kvt_keys_remove(kvt_keys_t *k, const kvt_key_t *keys, uint32_t n, int *status);

/*
 * Copies: a list of memcpys in one call, for bindings that move a layer of pages between the
 * mapping and an engine's tensors wherever the pages lie (one call instead of one per run of
 * pages; a binding such as cffi releases its interpreter lock around it). No connection needed.
 */
typedef struct kvt_copy_span {
    void *dst;
    const void *src;
    size_t len; /* 0: skipped (dst and src may then be anything) */
} kvt_copy_span_t;

/* Copies spans[i].len bytes from spans[i].src to spans[i].dst for i in [0, n), in order. 0, or
 * KVT_CLIENT_EINVAL with nothing copied: spans NULL with n > 0, a span with len > 0 and a NULL
 * dst or src, a span whose end wraps the address space, or a span whose dst and src overlap.
 * Spans may not write where a later span reads or writes (not checked: the caller's layout). */
KVT_API int kvt_copy_spans(const kvt_copy_span_t *spans, size_t n);

/* kvt_copy_spans for spans that fill whole pages, each page hashed as it is copied: page i is
 * spans [i * per_page, (i + 1) * per_page), whose dsts lie back to back (the page's bytes in
 * order; spans of len 0 are skipped), and sums[i] (the caller's n / per_page words) gets the
 * XXH3-64 (seed 0) of the page's bytes as written, what XXH3_64bits(its first dst, the sum of
 * its lens) gives: the checksum COMMIT's SUMS carries (kvt_client_commit_sums). The copy and the
 * hash are one pass where each span begins on one of the page's 64-byte stripes (engines'
 * layers are multiples of 64 bytes); other spans are copied and then hashed from dst. 0, or
 * KVT_CLIENT_EINVAL with nothing copied: as kvt_copy_spans, and sums NULL, per_page 0, n not a
 * multiple of per_page (n 0 is nothing to do), a page whose spans are not back to back. */
KVT_API int kvt_copy_pages_xxh3(const kvt_copy_span_t *spans, size_t n, size_t per_page,
                                uint64_t *sums);

#ifdef __cplusplus
}
#endif

#endif
