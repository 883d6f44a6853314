/*
 * op_get.c: GET. The handler finds the connection's lease and queues the request; the state
 * machine reads the leased path's blocks in bounded batches and is the request's reply source
 * (server.h): the connection's writer sends each batch's frames from where their bytes are.
 */
#include "server.h"

#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

#define KVT_GET_BATCH_BYTES (8u << 20) /* GET reads at most this much ahead of the socket */

/* ---- GET ---- */

/* A read count of the batch's is dropped from the table that holds it: its loop's for a batch
 * planned shared (r->get.loop_reads, which names the loop: the request may have lost its
 * connection while a read was in flight), else the main one. */
static void get_unread(kvt_srv_t *s, const kvt__req_t *r, uint64_t hash)
{
    if (r->get.loop_reads)
        kvt__busy_dec_loop(&s->loops[r->get.loop_reads - 1], hash);
    else
        kvt__busy_dec(s, hash);
}

/* Whether r's path (its node) is still there: its pin holds it, or, for a GET planned shared,
 * its client's lease (whose end pins it for r: kvt__get_lease_ends). A close lets the leases go
 * before a request with reads in flight becomes an orphan: the path may be gone when they
 * complete, and a bad record is left for the next reader to find. */
static int get_holds_path(const kvt__req_t *r)
{
    return r->lease || (r->get.shared && r->conn);
}

static void get_read_done(kvt_tier_io_t *io)
{
    kvt__io_t *x = io->data;
    kvt__req_t *r = x->req;
    kvt_srv_t *s = x->req->srv;
    get_unread(s, r, io->key.hash);
    if (io->unchecked)
        r->get.check_due = 1; /* the GET takes the payload's checksum: get_check */
    if (io->status == KVT_ECORRUPT)
        kvt__metric_add(s->metrics, KVT_M_MISS_TOKENS, KVT_MISS_CHECKSUM, io->key.ntokens);
    if ((io->status == KVT_ECORRUPT || io->status == KVT_ENOENT) && get_holds_path(r))
        kvt__store_lost(s, x->node, x->depth); /* later MATCHes say so; this GET ends here */
    /* Promotion is the policy's: the MATCH that leased this path queued it. */
    if (kvt__io_finished(s, x, io->status, 0))
        kvt__store_get_batch(s, r);
}

/*
 * The checksums of a batch's NVMe payloads that its reads left to it (get_read: a GET planned
 * shared), taken by the connection's loop before any byte of the batch is offered (get_drained),
 * not on loop 0 under the write lock with the rest of the completion: an XXH3 over each payload,
 * about 20 us a 256 KiB page, in which no other loop could hold the lock at all. The buffers and
 * I/O records are the request's own, written by the completion before its kick and touched by no
 * one else once the reads are done, so the check runs with the lock let go where conn.c allows it
 * (kvt__conn_unlock). A page that fails is zeroed and never sent; what its completion would have
 * done then (the counts, the block made lost) needs the write lock, taken for that case only
 * (docs/architecture.md, "The checksum on the GET's loop").
 */

/* KVT_DEBUG_GET_CHECK_GATE names a file; while it exists, a GET's check waits
 * (tests/test_server_loops.c holds one in it), and says so by creating the file's name with
 * ".held" after it. Unset: nothing. */
static void get_check_gate(const kvt_srv_t *s)
{
    if (!s->get_check_gate || access(s->get_check_gate, F_OK) != 0)
        return;
    char held[PATH_MAX];
    snprintf(held, sizeof held, "%s.held", s->get_check_gate);
    int fd = open(held, O_CREAT | O_WRONLY | O_CLOEXEC, 0600);
    if (fd >= 0)
        close(fd);
    while (access(s->get_check_gate, F_OK) == 0)
        usleep(1000);
}

/* Takes the checksums left to the batch: 1 when a page failed (kvt__tier_read_check zeroed it and
 * set its status). The request's own records and buffers only. */
static int get_check_pages(kvt__req_t *r)
{
    int bad = 0;
    for (uint32_t i = 0; i < r->get.batch; i++) {
        kvt__io_t *x = r->get.slots[i].x;
        if (x && x->io.unchecked)
            bad |= kvt__tier_read_check(&x->io) < 0;
    }
    return bad;
}

/* Under the write lock, for each page that failed its check, what a corrupt read's completion does
 * (get_read_done, kvt__io_finished): the tier's count and the daemon's, and with `lost` the block
 * made lost if it still lies where it was read (a move or a loss since has settled it). */
static void get_check_failed(kvt_srv_t *s, const kvt__req_t *r, int lost)
{
    for (uint32_t i = 0; i < r->get.batch; i++) {
        kvt__io_t *x = r->get.slots[i].x;
        if (!x || !x->io.unchecked || x->io.status != KVT_ECORRUPT)
            continue;
        kvt__tier_read_corrupt(s, (kvt_tier_id_t)x->tier, &x->io);
        kvt__metric_add(s->metrics, KVT_M_TIER_IO_ERRORS, kvt__tier_io(x->tier, 0), 1);
        kvt__metric_add(s->metrics, KVT_M_MISS_TOKENS, KVT_MISS_CHECKSUM, x->io.key.ntokens);
        const kvt_block_t *b = lost ? kvt__path_block(x->node, x->depth) : NULL;
        if (b && b->tier == x->tier && b->loc == x->io.loc)
            kvt__store_lost(s, x->node, x->depth);
    }
}

/* The check before the batch is sent, on its connection's loop (get_drained), which holds the lock
 * shared or for writing and holds it so again after; for writing once a page has failed. */
static void get_check(kvt_srv_t *s, kvt__req_t *r)
{
    kvt__conn_t *c = r->conn;
    int held = kvt__conn_unlock(c);
    get_check_gate(s);
    int bad = get_check_pages(r);
    kvt__conn_relock(c, held);
    r->get.check_due = 0;
    if (!bad)
        return;
    kvt__loop_hold(c->loop, KVT_HELD_WRITE);
    get_check_failed(s, r, get_holds_path(r));
}

/* A batch released before its check (an orphan's, one its connection's close aborts), under the
 * write lock: nothing of it is sent, but a corrupt page counts as its completion counted it. Its
 * path may be gone (get_holds_path): no block is made lost, the next reader finds it. */
static void get_check_unsent(kvt_srv_t *s, kvt__req_t *r)
{
    r->get.check_due = 0;
    if (get_check_pages(r))
        get_check_failed(s, r, 0);
}

/*
 * A GET goes out in batches of frames that reference the bytes where they are:
 *
 *     r->out:   [hdr 0][hdr 1][hdr 2] ...          32 bytes each (frame header + page, tier)
 *     r->get.segs:  hdr 0, payload 0, hdr 1, payload 1, ...
 *                        |                 |
 *                 DRAM/HBM-host memory   a read buffer (NVMe, remote: read first)
 *
 * Memory tiers are sent from their own memory (kvt_tier_ptr): no copy, no I/O (but for a GET
 * planned shared, which reads an HBM page as it reads an NVMe one: get_read_tier). The block cannot
 * go meanwhile: its read count (kvt__busy_inc, or its loop's table for a GET planned under the
 * shared lock) defers any free of its location until the batch is written, and the request's
 * pin (a write-path GET's) keeps the path for the batches after. Other tiers are read into
 * buffers of the batch first. The batch is written when every read is done; when the socket has
 * taken all of it, the source's drained hook builds the next one. At most
 * KVT_GET_BATCH_BYTES are referenced at a time.
 *
 * Called with nothing in flight: after the request is set up, when the batch's last read (or
 * promotion) completes, and when conn.c has written the batch.
 */
static void get_release_batch(kvt_srv_t *s, kvt__req_t *r)
{
    if (r->get.check_due)
        get_check_unsent(s, r);
    for (uint32_t i = 0; i < r->get.batch; i++) {
        kvt__get_slot_t *g = &r->get.slots[i];
        if (g->hash)
            get_unread(s, r, g->hash);
        if (g->x) {
            free(g->x->buf);
            free(g->x);
        }
    }
    if (r->get.slots != r->get_slot_inline)
        free(r->get.slots); /* the segs share its allocation (get_build) */
    r->get.slots = NULL;
    r->get.batch = 0;
    r->get.segs = NULL;
    r->get.nsegs = r->get.seg_i = r->get.seg_off = 0;
    r->get.segs_ready = 0;
    r->get.hbm_mem = 0;
    r->src = NULL;
}

/* The GET as a reply source (server.h): its batch's frames from where their bytes are. */
static int get_iov(kvt__req_t *r, struct iovec *iov, int max)
{
    int n = 0;
    if (!r->get.segs_ready)
        return 0; /* reads still in flight */
    for (uint32_t k = r->get.seg_i; k < r->get.nsegs && n < max; k++) {
        const kvt__seg_t *g = &r->get.segs[k];
        size_t skip = k == r->get.seg_i ? r->get.seg_off : 0;
        iov[n].iov_base = (uint8_t *)(g->ptr ? g->ptr : r->out + g->off) + skip;
        iov[n].iov_len = g->len - skip;
        n++;
    }
    return n;
}

/* Everything left of the reply is in what iov offered: the last batch with its final frame. */
static int get_ends(const kvt__req_t *r, int offered)
{
    return r->get.end_queued && r->get.segs_ready &&
           r->get.seg_i + (uint32_t)offered == r->get.nsegs;
}

static size_t get_wrote(kvt__req_t *r, size_t left)
{
    /* Empty pieces (a location frame's payload) are passed over as soon as they are reached. */
    while (r->get.seg_i < r->get.nsegs &&
           (left > 0 || r->get.segs[r->get.seg_i].len == r->get.seg_off)) {
        size_t t = KVT_MIN(r->get.segs[r->get.seg_i].len - r->get.seg_off, left);
        r->get.seg_off += t;
        left -= t;
        if (r->get.seg_off == r->get.segs[r->get.seg_i].len) {
            r->get.seg_i++;
            r->get.seg_off = 0;
        }
    }
    return left;
}

static int get_next_shared(kvt_srv_t *s, const kvt__req_t *r);

static int get_drained(kvt__req_t *r)
{
    kvt__loop_t *l = r->conn->loop;
    if (r->get.check_due) {
        if (r->pending)
            return 0;
        get_check(r->srv, r);
        /* A GET whose lease ended meanwhile went on by the write path (kvt__get_lease_ends):
         * its send counts its pin (get_send), a write. */
        if (l->held != KVT_HELD_WRITE && !r->get.shared)
            kvt__loop_hold(l, KVT_HELD_WRITE);
        kvt__store_get_batch(r->srv, r); /* the batch goes, up to a page that failed */
        return 1;
    }
    if (!r->get.segs_ready || r->get.seg_i < r->get.nsegs)
        return 0;
    /* A GET planned shared goes on shared while its next batch can (get_next_shared); else, as
     * conn_write does for a queue that is not plain, the loop takes the write lock, and the GET
     * pins its path and goes on by the write path (kvt__store_get_batch). */
    if (l->held != KVT_HELD_WRITE && !get_next_shared(r->srv, r))
        kvt__loop_hold(l, KVT_HELD_WRITE);
    kvt__store_get_batch(r->srv, r); /* the batch is out: the next one, or the end frame */
    return 1;
}

/* The GET's pin goes, and its NVMe pins (r->extra) if its lease had ended (kvt__get_lease_ends);
 * if the pin was shown gone already (get_send), it leaves s->pins_ending too. */
static void get_unpin(kvt_srv_t *s, kvt__req_t *r)
{
    if (r->get.pin_gone) {
        r->get.pin_gone = 0;
        s->pins_ending--;
    }
    if (r->extra) {
        kvt__nvme_unpin(s, r->extra);
        free(r->extra);
        r->extra = NULL;
    }
    kvt__unpin(s, r);
}

static void get_abort(kvt__req_t *r)
{
    if (r->get.slots)
        get_release_batch(r->srv, r);
    get_unpin(r->srv, r);
}

/*
 * Whether the batch may be written with the store's lock let go (conn.c, and docs/architecture.md,
 * "Event loops"). Its pieces are the request's own (frame heads in r->out, read buffers whose reads
 * are done) or DRAM tier memory, and only this connection's loop frees or changes them: the
 * batch goes (get_release_batch) only from drained or abort, which the writer calls under the
 * lock after the write. A DRAM page's bytes stay where they are and as they are meanwhile: its
 * read count (kvt__busy_inc in get_plan, kvt__busy_inc_loop in get_plan_shared) keeps the
 * arena's move-out off it and defers its free
 * (kvt__free_loc) past the write, whoever frees it (REMOVE, eviction, a loss, the switch of a
 * move, which only reads it); the shared arena's scans punch only pages no live block holds, and
 * a block not yet freed is live; PUT skips pages that have bytes and writes only fresh locations.
 * The HBM tier's memory (its host backend), which only the write path sends from, is kept under
 * the lock: nothing has checked it with several loops (a GET planned shared reads HBM pages into
 * buffers of its own: get_read_tier).
 */
static int get_apart(const kvt__req_t *r)
{
    return r->get.segs_ready && !r->get.hbm_mem;
}

/* A GET planned under the shared lock: its hooks touch the request and its loop's read counts
 * (get_release_batch) only; it holds no pin and no namespace reference (kvt__h_get_shared), and
 * its drained hook takes the write lock before anything else (get_drained). */
static int get_shares(const kvt__req_t *r)
{
    return r->get.shared;
}

static const kvt__reply_src_t kvt_get_src = {
    .iov = get_iov,
    .ends = get_ends,
    .wrote = get_wrote,
    .drained = get_drained,
    .abort = get_abort,
    .apart = get_apart,
    .shares = get_shares,
};

/*
 * A batch is built page by page in three steps, each with one job:
 *
 *     get_plan   the lookup: the page's block, and how it goes out (a location, from the tier's
 *                memory, or read first), its checks (present, sealed) and its read count taken
 *     get_read   the I/O: a page that is not in memory is read into a buffer of the batch
 *     get_frame  the framing: the page's frame head in r->out and its two pieces in r->get.segs
 *
 * and goes out by get_send once nothing is in flight; get_end encodes the final frame.
 */

/* One page of the batch, as get_plan decided. */
typedef struct get_page {
    kvt_block_t *b;
    kvt__io_t *x;       /* read first: the read's record */
    uint64_t hash;      /* sent from the tier's memory: the block whose read count it holds */
    int located;        /* the client reads it where it lies: a location frame, no bytes */
    uint64_t off;       /* located: its offset in the client's mapping */
    const uint8_t *ptr; /* otherwise where its bytes are: the tier's memory or the read buffer */
} get_page_t;

/* The lookup of page r->get.cur into pg: 0, or the error that ends the GET here (nothing of
 * this page is held then). A page sent from memory or as a location needs no I/O record (nor its
 * block key's copy of the page's tokens): its hash is all it keeps. */
static int get_plan(kvt_srv_t *s, kvt__req_t *r, get_page_t *pg)
{
    uint64_t t0 = kvt_now_ns();
    *pg = (get_page_t){.b = kvt__path_block(r->node, r->get.cur)};
    kvt_block_t *b = pg->b;
    if (!b || b->tier == KVT_TIER_NONE || !s->tiers[b->tier] || b->size != r->block_bytes)
        return KVT_ENOENT;
    if (r->get.locate && kvt__store_locate(s, r->conn, r->ns, b, &pg->off)) {
        pg->located = 1; /* under the client's lease: no I/O, no read count */
        return 0;
    }
    if (b->tier == KVT_TIER_DRAM && s->conf->zc_checksum && kvt__tier_check(s, b) == KVT_ECORRUPT) {
        /* Written over since its zero-copy COMMIT: lost, as a corrupt read is. */
        kvt__metric_add(s->metrics, KVT_M_MISS_TOKENS, KVT_MISS_CHECKSUM,
                        kvt__ns_page_size(s, r->ns));
        kvt__store_lost(s, r->node, r->get.cur);
        return KVT_ECORRUPT;
    }
    uint64_t hash = kvt__block_hash(s, r->node, r->get.cur);
    if (kvt__busy_inc(s, hash) < 0)
        return KVT_ENOMEM;
    if ((pg->ptr = kvt__tier_ptr(s, b))) {
        pg->hash = hash; /* sent from where it lies: the read count keeps moves off it */
        r->get.hbm_mem |= b->tier != KVT_TIER_DRAM;
        kvt__metric_observe(s->metrics, KVT_M_TIER_IO_SECONDS, kvt__tier_io(b->tier, 0),
                            kvt_now_ns() - t0);
        return 0;
    }
    kvt__io_t *x = pg->x = kvt__io_new(s, r, r->get.cur);
    if (!x) {
        kvt__busy_dec(s, hash);
        return KVT_ENOMEM;
    }
    x->tier = b->tier;
    return 0;
}

/*
 * The pages a GET reads, as the shared path checks them before anything is written: pages
 * [first, end) of node's path in namespace ns, in blocks of block_bytes; zc is the connection
 * whose zero-copy mapping locates them (a GET with LOCATE), NULL when every page goes with its
 * bytes.
 */
typedef struct get_span {
    kvt_radix_node_t *node;
    const kvt__conn_t *zc;
    uint32_t ns, block_bytes, first, end;
} get_span_t;

/* Whether block b lies in a tier whose reads a GET planned shared submits itself (get_submit,
 * under s->submit): NVMe (the ring), the remote tier (its wait queue; loop 0 sends and reads its
 * socket) and HBM (its read queue only: the read is queue_only, get_read, so that its batch, its
 * CUDA calls and its copy stay in the tier's poll on loop 0). All complete on loop 0 under the
 * write lock. An HBM page goes by a read even where the write path sends it from the host
 * backend's memory (get_plan, get_apart): one copy more, on loop 0, for the backend that stands
 * in for a GPU, and the path the cuda backend takes. */
static int get_read_tier(const kvt_srv_t *s, const kvt_block_t *b)
{
    return (b->tier == KVT_TIER_NVME || b->tier == KVT_TIER_REMOTE || b->tier == KVT_TIER_HBM) &&
           s->tiers[b->tier];
}

/* Under the shared lock: whether NVMe, remote or HBM page `page` (block b) of g can be read with
 * nothing written: its I/O record's key (kvt__block_key: the remote tier's key name too) needs its
 * hash and its parent's, which the tree computes and caches when they are missing (a write). Its
 * record is checked by the read's completion, on loop 0 under the write lock, which makes a bad
 * or missing one lost (get_read_done). */
static int get_read_shares(const get_span_t *g, uint32_t page, const kvt_block_t *b)
{
    const kvt_block_t *parent = page ? kvt__path_block(g->node, page - 1) : NULL;
    return b->hash && (!page || (parent && parent->hash));
}

/* Under the shared lock: whether page `page` of g can go as get_plan would send it with nothing
 * written: a location in the DRAM arena g->zc maps (kvt__store_locate only reads: the arena
 * table changes under the write lock alone), or its bytes from DRAM (its hash cached: computing
 * it is a write; with zero-copy-checksum, its seal checked out without a write: a block written
 * over since is the write path's, which makes it lost). A located page is not checked, as on
 * the write path: the client reads the mapping itself. An HBM page that g->zc would locate (a
 * connection that mapped the pool) is the write path's, which sends its location: the shared
 * path only reads HBM pages (get_read_tier). */
static int get_page_shares(kvt_srv_t *s, const get_span_t *g, uint32_t page)
{
    const kvt_block_t *b = kvt__path_block(g->node, page);
    if (b && b->tier == KVT_TIER_HBM && g->zc && kvt__store_locate(s, g->zc, g->ns, b, NULL))
        return 0;
    if (b && get_read_tier(s, b) && b->size == g->block_bytes)
        return get_read_shares(g, page, b);
    if (!b || b->tier != KVT_TIER_DRAM || !s->tiers[KVT_TIER_DRAM] || b->size != g->block_bytes)
        return 0;
    if (g->zc && kvt__store_locate(s, g->zc, g->ns, b, NULL))
        return 1;
    return b->hash && kvt__tier_ptr(s, b) && (!s->conf->zc_checksum || kvt__tier_intact(s, b));
}

/* get_plan_shared's NVMe, remote or HBM page: its read count in the loop's table (held until the
 * read completes, get_read_done), and an I/O record for get_read, whose key reads only cached
 * hashes (get_read_shares). */
static int get_plan_read_shared(kvt_srv_t *s, kvt__req_t *r, kvt_block_t *b, get_page_t *pg)
{
    kvt__io_t *x = kvt__io_new(s, r, r->get.cur);
    if (!x)
        return KVT_ENOMEM;
    if (kvt__busy_inc_loop(r->conn->loop, b->hash) < 0) {
        free(x);
        return KVT_ENOMEM;
    }
    x->tier = b->tier;
    *pg = (get_page_t){.b = b, .x = x};
    return 0;
}

/* get_plan for a GET planned shared, for a page get_batch_shares found it may take: a location
 * (no read count: the client's lease keeps it, as on the write path), or its bytes from DRAM,
 * whose read count goes in the loop's own table and its time in the loop's metrics. */
static int get_plan_shared(kvt_srv_t *s, kvt__req_t *r, get_page_t *pg)
{
    uint64_t t0 = kvt_now_ns();
    kvt__loop_t *l = r->conn->loop;
    kvt_block_t *b = kvt__path_block(r->node, r->get.cur);
    /* As get_batch_shares found it in this hold (kvt__h_get_shared, kvt__store_get_batch). */
    kvt_assert(b && (b->tier == KVT_TIER_DRAM || get_read_tier(s, b)));
    if (b->tier != KVT_TIER_DRAM)
        return get_plan_read_shared(s, r, b, pg);
    uint64_t off;
    if (r->get.locate && kvt__store_locate(s, r->conn, r->ns, b, &off)) {
        *pg = (get_page_t){.b = b, .located = 1, .off = off};
        return 0;
    }
    kvt_assert(b->hash);
    if (kvt__busy_inc_loop(l, b->hash) < 0)
        return KVT_ENOMEM;
    *pg = (get_page_t){.b = b, .hash = b->hash, .ptr = kvt__tier_ptr(s, b)};
    kvt__metric_observe(l->metrics, KVT_M_TIER_IO_SECONDS, kvt__tier_io(KVT_TIER_DRAM, 0),
                        kvt_now_ns() - t0);
    return 0;
}

/*
 * The read's submission, counted in flight. A batch planned shared submits with the store's lock
 * held shared, beside other loops doing the same: s->submit keeps them one at a time in the
 * tier's queue, its ring (NVMe) or its hiredis context, wait queue, request pool and timer
 * (remote: the submitter only queues and arms the socket's EPOLLOUT; loop 0 writes and reads the
 * socket), its read queues and kick flag (HBM: the submitter only queues, queue_only, and writes
 * the tier's eventfd; loop 0's poll sends the batch and completes it), and the daemon's in-flight
 * count. Everyone else in those (loop 0's completions and
 * remote socket events, the writes, the frees, the scrapes) holds the lock for writing, which no
 * shared holder shares. (docs/architecture.md, "GET of NVMe pages" and "GET of remote pages".)
 */
static int get_submit(kvt_srv_t *s, kvt__req_t *r, kvt_tier_id_t tier, kvt_tier_io_t *io)
{
    if (r->get.loop_reads)
        pthread_mutex_lock(&s->submit);
    int rc = kvt__tier_read(s, tier, io);
    if (rc == 0)
        kvt__io_started(s, r);
    if (r->get.loop_reads)
        pthread_mutex_unlock(&s->submit);
    return rc;
}

/* Starts the read of a page get_plan found outside memory into a buffer of its own: 0, or the
 * error that ends the GET here (the page is let go). */
static int get_read(kvt_srv_t *s, kvt__req_t *r, get_page_t *pg)
{
    kvt__io_t *x = pg->x;
    const kvt_block_t *b = pg->b;
    int rc = KVT_ENOMEM;
    /* Aligned, the NVMe tier reads the payload straight into it: with malloc's alignment it
     * went through a bounce buffer of the tier's, one more allocation and copy per page. */
    void *buf;
    x->buf = posix_memalign(&buf, KVT_TIER_DIRECT_ALIGN, b->size) == 0 ? buf : NULL;
    if (x->buf) {
        x->io.buf = x->buf;
        x->io.len = b->size;
        x->io.loc = b->loc;
        x->io.cb = get_read_done;
        x->io.urgent = 1; /* the client waits: ahead of queued moves */
        /* A GET planned shared takes its NVMe payloads' checksums on its own loop, off loop 0's
         * write lock (get_check); the write path's are taken there, as every other read's. */
        x->io.check_later = r->get.shared;
        /* Submitted from the GET's own loop: the HBM tier only queues it (its batches and CUDA
         * calls are loop 0's, in the tier's poll). */
        x->io.queue_only = r->get.shared;
        rc = get_submit(s, r, (kvt_tier_id_t)b->tier, &x->io);
    }
    if (rc < 0) {
        get_unread(s, r, x->io.key.hash);
        free(x->buf);
        free(x);
        return rc;
    }
    pg->ptr = x->buf;
    return 0;
}

#define KVT_GET_END_FRAME (KVT_PROTO_HDR + sizeof(kvt_wire_get_end_t))

/* The pages of block_bytes a batch holds (get_build's): KVT_GET_BATCH_BYTES of data frames. */
static uint32_t get_batch_pages(uint32_t block_bytes)
{
    size_t page = KVT_PROTO_HDR + sizeof(kvt_wire_get_data_t) + block_bytes;
    return (uint32_t)KVT_MAX(1, KVT_GET_BATCH_BYTES / page);
}

/* Each page's frame head lies at i * stride in r->out: a location frame is longer. */
static size_t get_stride(const kvt__req_t *r)
{
    return r->get.locate ? KVT_PROTO_HDR + sizeof(kvt_wire_get_loc_t)
                         : KVT_PROTO_HDR + sizeof(kvt_wire_get_data_t);
}

/* The final frame at f: the status, made final here, and how many pages went out before it. */
static void get_end_frame(kvt__req_t *r, uint8_t f[KVT_GET_END_FRAME])
{
    uint64_t now = kvt_now_ns();
    uint32_t left = 0;
    if (r->get.locate && r->get.lease_expires > now)
        left = (uint32_t)KVT_MIN((r->get.lease_expires - now) / 1000000u, UINT32_MAX);
    r->status = kvt__tier_failure(r->status);
    kvt_proto_frame(f, r->op | KVT_OP_REPLY, 0, r->id, r->status, sizeof(kvt_wire_get_end_t));
    kvt_proto_get_end_encode(f + KVT_PROTO_HDR, r->get.sent, left);
}

/* Page i of the batch's frame: its head at i * stride in r->out (a location frame, or a data
 * frame's head whose payload is pg->ptr), and its pieces segs[2i], segs[2i + 1]. */
static void get_frame(kvt__req_t *r, uint32_t i, size_t stride, const get_page_t *pg)
{
    size_t hdr = KVT_PROTO_HDR + sizeof(kvt_wire_get_data_t);
    uint8_t *f = r->out + (size_t)i * stride;
    const kvt_block_t *b = pg->b;
    if (pg->located) {
        kvt_proto_frame(f, r->op | KVT_OP_REPLY, KVT_RF_MORE, r->id, 0, sizeof(kvt_wire_get_loc_t));
        kvt_proto_get_loc_encode(f + KVT_PROTO_HDR, r->get.cur, b->tier, pg->off, b->size);
        r->get.segs[2 * i] = (kvt__seg_t){.off = (size_t)i * stride, .len = stride};
        r->get.segs[2 * i + 1] = (kvt__seg_t){.off = 0, .len = 0};
        return;
    }
    kvt_proto_frame(f, r->op | KVT_OP_REPLY, KVT_RF_MORE, r->id, 0,
                    (uint32_t)(hdr - KVT_PROTO_HDR + r->block_bytes));
    kvt_proto_get_data_encode(f + KVT_PROTO_HDR, r->get.cur, b->tier);
    r->get.segs[2 * i] = (kvt__seg_t){.off = (size_t)i * stride, .len = hdr};
    r->get.segs[2 * i + 1] = (kvt__seg_t){.ptr = pg->ptr, .len = b->size};
}

/* Builds the next batch from page r->get.cur on, up to KVT_GET_BATCH_BYTES, stopping at the first
 * page that cannot go (r->status says why): the pages before it go. Returns the batch's pages
 * (0: none, the batch released). */
static uint32_t get_build(kvt_srv_t *s, kvt__req_t *r)
{
    size_t stride = get_stride(r);
    uint32_t n = KVT_MIN(r->get.end - r->get.cur, get_batch_pages(r->block_bytes));
    r->out_off = r->out_len = 0;
    /* The heads, then room for the final frame should this batch be the last (get_send): inside
     * the request for a batch of up to KVT_GET_INLINE pages. */
    if (kvt__req_out_reserve(r, n * stride + KVT_GET_END_FRAME) < 0) {
        r->status = KVT_ENOMEM;
        return 0;
    }
    /* The pages' slots and the pieces: the request's own for a small batch, else one allocation
     * for both. Each is written before it is read (get_build's loop, get_frame, get_send). */
    if (n <= KVT_GET_INLINE) {
        r->get.slots = r->get_slot_inline;
        r->get.segs = r->get_seg_inline;
    } else {
        r->get.slots = malloc(n * sizeof *r->get.slots + (2 * (size_t)n + 1) * sizeof *r->get.segs);
        if (!r->get.slots) {
            r->status = KVT_ENOMEM;
            return 0;
        }
        r->get.segs = (kvt__seg_t *)(r->get.slots + n);
    }
    r->src = &kvt_get_src;
    r->get.loop_reads = r->get.shared ? (uint8_t)(r->conn->loop->id + 1) : 0;
    for (uint32_t i = 0; i < n; i++, r->get.cur++) {
        get_page_t pg;
        int rc = r->get.shared ? get_plan_shared(s, r, &pg) : get_plan(s, r, &pg);
        if (rc == 0 && !pg.located && !pg.ptr)
            rc = get_read(s, r, &pg);
        if (rc < 0) {
            r->status = rc;
            break;
        }
        get_frame(r, i, stride, &pg);
        r->get.slots[r->get.batch++] = (kvt__get_slot_t){.x = pg.x, .hash = pg.hash};
        r->get.located += (uint32_t)pg.located;
    }
    uint32_t got = r->get.batch;
    if (got == 0)
        get_release_batch(s, r);
    return got;
}

/* The pages that went as locations, counted with the final frame, in the connection's loop's
 * table as count_reply counts the request: a GET planned shared counts there while other loops
 * count theirs (any thread may write it under the write lock; a scrape merges it). */
static void get_count_located(kvt__req_t *r)
{
    kvt_metrics_t *mt = r->conn->loop->metrics ? r->conn->loop->metrics : r->srv->metrics;
    if (r->get.located)
        kvt__metric_add(mt, KVT_M_ZC_PAGES, KVT_OP_GET, r->get.located);
}

/* The batch's reads are done: it goes out up to its first failed read. Returns 1 when the
 * connection took it (its drained hook calls back once the socket has), 0 when nothing goes. */
static int get_send(kvt__req_t *r)
{
    uint32_t good = 0;
    for (; good < r->get.batch; good++) {
        kvt__io_t *x = r->get.slots[good].x;
        if (x && x->io.status < 0) {
            r->status = x->io.status;
            static kvt_log_limit_t lim; /* a remote tier down fails every GET */
            kvt_log_limited(&lim, KVT_LOG_INFO, "kvtierd: GET page %u from %s: %s", x->depth,
                            kvt_tier_name(x->tier), kvt_strerror(x->io.status));
            break;
        }
    }
    r->get.nsegs = 2 * good;
    r->get.segs_ready = 1;
    r->get.sent += good;
    if (!r->conn || !good)
        return 0;
    if (good < r->get.batch || r->status < 0 || r->get.cur >= r->get.end) {
        /* The last batch: its final frame goes with it, so that the connection can write the
         * next requests' replies in the same writev (server.h, ends) instead of one write per
         * GET. Nothing after this can change the frame: no read is in flight, and the pins
         * (kvt__unpin, in get_end) only go once the bytes are out. */
        size_t off = (size_t)r->get.batch * get_stride(r);
        get_end_frame(r, r->out + off);
        r->get.segs[r->get.nsegs++] = (kvt__seg_t){.off = off, .len = KVT_GET_END_FRAME};
        r->get.end_queued = 1;
        /* Counted now, not in get_end: written with the lock let go (several loops), the end
         * frame may reach the client, and its STATS on another connection another loop, before
         * the drained hook runs. */
        get_count_located(r);
        kvt__req_count(r);
        /* Its pin too: it goes in get_end, after the write, which a client that has the reply
         * may beat with a STATS on another loop; it counts as gone from here (kvt__lease_count). */
        if (r->lease && !r->get.pin_gone) {
            r->get.pin_gone = 1;
            r->conn->srv->pins_ending++;
        }
    }
    size_t bytes = 0;
    for (uint32_t i = 0; i < r->get.nsegs; i++)
        bytes += r->get.segs[i].len;
    kvt__out_add(r->conn, (int64_t)bytes);
    kvt__conn_kick(r->conn);
    return 1;
}

/* The GET ends: its final frame went with its last batch (end_queued), or goes now. */
static void get_end(kvt_srv_t *s, kvt__req_t *r)
{
    if (!r->get.end_queued)
        get_count_located(r);
    get_unpin(s, r);
    r->out_off = r->out_len = 0;
    if (!r->get.end_queued) {
        uint8_t f[KVT_GET_END_FRAME];
        get_end_frame(r, f);
        if (r->conn && kvt__req_append(r, f, sizeof f) < 0)
            r->conn->dead = 1; /* a reply lost would break the order of the rest */
    }
    kvt__req_finish(r);
}

/*
 * A GET planned shared whose next batch cannot go shared (a page of it left DRAM, or its seal is
 * to check with a write), or whose client's lease ends while another GET takes that lease's own
 * pin (kvt__get_lease_ends), under the write lock: it takes the pin the write path's GET took at
 * its start (kvt__h_get) while the client's lease still holds the path, and goes on as that GET:
 * its later batches planned by get_plan (the pages read from whichever tier holds them), its
 * hooks under the write lock (get_shares). A pin refused (the index at index-bytes, the lease
 * table full) ends it after the batch in flight with that error (ENOSPC), as the write path's
 * GET ends with nothing sent.
 */
static void get_pin(kvt_srv_t *s, kvt__req_t *r)
{
    r->get.shared = 0;
    kvt__index_fit(s, kvt__pin_need(s));
    int rc = kvt__pin(s, r->node, r->ns, &r->lease);
    if (rc < 0)
        r->status = rc;
}

int kvt__store_get_batch(kvt_srv_t *s, kvt__req_t *r)
{
    kvt_assert(r->pending == 0);
    if (r->get.check_due && r->conn) {
        kvt__conn_kick(r->conn); /* its loop checks the batch first (get_drained) */
        return 0;
    }
    if (r->get.slots && !r->get.segs_ready && get_send(r))
        return 0; /* drained calls back when the socket has taken it */
    if (r->get.slots)
        get_release_batch(s, r);
    if (!r->conn) {
        get_unpin(s, r);
        kvt__req_finish(r);
        return 0;
    }
    if (r->get.shared && !get_next_shared(s, r))
        get_pin(s, r); /* under the write lock (get_drained) */
    if (r->status == 0 && r->get.cur < r->get.end && get_build(s, r) > 0)
        return r->pending ? 0 : kvt__store_get_batch(s, r); /* all from memory: out it goes */
    get_end(s, r);
    return 0;
}

/* The pages a GET q asks for under lease l: 0 when they go past it. */
static uint32_t get_pages(const kvt_proto_get_t *q, const kvt__lease_t *l)
{
    uint32_t n = q->npages ? q->npages : (q->first_page < l->pages ? l->pages - q->first_page : 0);
    if (q->first_page >= l->pages || n == 0 || (uint64_t)q->first_page + n > l->pages)
        return 0;
    return n;
}

/* A GET request for pages [q->first_page, + n) of l's path, queued on c (its lease and namespace
 * reference are the caller's); NULL when out of memory. */
static kvt__req_t *get_req(kvt__conn_t *c, const kvt_proto_hdr_t *h, uint64_t t0,
                           const kvt_proto_get_t *q, const kvt__lease_t *l, uint32_t n,
                           uint32_t block_bytes)
{
    kvt__req_t *r = kvt__req_new(c, KVT_REQ_GET, h->opcode, h->request_id, t0);
    if (!r)
        return NULL;
    r->ns = l->ns;
    r->node = l->node;
    r->pages = l->pages;
    r->block_bytes = block_bytes;
    r->get.cur = q->first_page;
    r->get.end = q->first_page + n;
    r->get.locate = (h->flags & KVT_GET_F_LOCATE) != 0;
    r->get.lease_expires = l->expires_ns;
    return r;
}

int kvt__h_get(kvt__conn_t *c, const kvt_proto_hdr_t *h, const uint8_t *body, uint64_t t0)
{
    kvt_srv_t *s = c->srv;
    kvt_proto_get_t q;
    if ((h->flags & ~(unsigned)KVT_GET_F_ALL) || kvt_proto_get_decode(body, h->body_len, &q) < 0)
        return kvt__bad_body(c, h, t0, "GET");
    kvt__lease_t *l = kvt__lease_find(c, q.lease);
    if (!l || l->expires_ns <= kvt_now_ns())
        return kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_ENOENT,
                                "lease %llu is not held by this connection",
                                (unsigned long long)q.lease);
    uint32_t n = get_pages(&q, l);
    if (n == 0) {
        if (!q.npages)
            return kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_EINVAL,
                                    "page %u is past the leased %u pages", q.first_page, l->pages);
        return kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_EINVAL,
                                "pages %u..%llu go past the leased %u pages", q.first_page,
                                (unsigned long long)q.first_page + q.npages - 1, l->pages);
    }
    kvt__ns_t *ns;
    if (kvt__ns_get(s, l->ns, &ns) < 0 || ns->block_bytes == 0)
        return kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_EINVAL,
                                "the namespace is index-only (HELLO block size 0)");
    kvt__req_t *r = get_req(c, h, t0, &q, l, n, ns->block_bytes);
    if (!r)
        return kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_ENOMEM, "out of memory");
    kvt__req_ns(r, l->ns);
    /* GET's inline trim: room for the pin's lease slot, trimming unleased index-only pages if the
     * index is at index-bytes (docs/architecture.md, "The door to the store"); the client's lease
     * holds the path, so the trim cannot take it. */
    kvt__index_fit(s, kvt__pin_need(s));
    int rc = kvt__pin(s, l->node, l->ns, &r->lease);
    if (rc < 0) {
        r->status = rc;
        r->get.end = r->get.cur; /* nothing to send: the final frame carries the error */
    }
    kvt__store_get_batch(s, r);
    return 0;
}

/* ---- GET under the shared lock (several loops) ---- */

int kvt__get_shares(const kvt_proto_hdr_t *h)
{
    /* LOCATE too (its pages in DRAM); an unknown flag is the write path's, which refuses it. */
    return (h->flags & ~(unsigned)KVT_GET_F_LOCATE) == 0;
}

/* Whether the batch of g's pages from g->first on (get_build's) may all be planned shared
 * (get_page_shares). */
static int get_batch_shares(kvt_srv_t *s, const get_span_t *g)
{
    uint32_t n = KVT_MIN(g->end - g->first, get_batch_pages(g->block_bytes));
    for (uint32_t i = g->first; i < g->first + n; i++)
        if (!get_page_shares(s, g, i))
            return 0;
    return 1;
}

/* Whether a GET planned shared goes on shared: its end (nothing of the tree read, no pin to
 * let go), or a next batch that shares, while the client's lease holds the path (its end would
 * have pinned it: kvt__get_lease_ends). */
static int get_next_shared(kvt_srv_t *s, const kvt__req_t *r)
{
    if (!r->get.shared)
        return 0;
    get_span_t g = {.node = r->node,
                    .zc = r->get.locate ? r->conn : NULL,
                    .ns = r->ns,
                    .block_bytes = r->block_bytes,
                    .first = r->get.cur,
                    .end = r->get.end};
    return r->status < 0 || r->get.cur >= r->get.end || get_batch_shares(s, &g);
}

/* The NVMe blocks of the path r reads under its lease (get_req: the lease's node and length), as
 * the lease pinned them at its MATCH, into r->extra (none: out of memory, as for the lease). */
static void get_pin_nvme(kvt_srv_t *s, kvt__req_t *r)
{
    if ((r->extra = calloc(1, sizeof(kvt__nvme_pins_t))))
        kvt__nvme_pin(s, r->extra, r->node, r->pages);
}

/*
 * Each GET of c on node with pages left, or with reads in flight, keeps what the ending lease
 * kept for it (lease.c lease_del, under the write lock, before the lease's path and NVMe pins
 * go). One planned shared holds the path from now on as the write path's GET does: the first
 * takes the lease's own pin on it (pin; the lease leaves it held, and the GET lets it go as its
 * own), which needs no slot in the tree's lease table, so that a table full at index-bytes does
 * not end it partway; any other takes a pin of its own (get_pin, which that table may refuse).
 * Every one pins the path's NVMe blocks: the log's segment reclaim drops blocks without asking the
 * index, so the path's pin alone left a later batch reading ENOENT where the MATCH had said stored.
 * The lease's NVMe pins cover every NVMe block the GET can meet: a leased or pinned path takes no
 * block into NVMe (exec.c, move_finish). A GET's path is its lease's node (get_req): one of c's
 * other leases on the same node ending holds it too, which costs a pin and keeps it correct.
 */
/* Whether r is a GET that the end of a lease on node concerns: one on node with pages left, or
 * reads in flight or a batch to check (an NVMe or remote batch: its completion, or an NVMe
 * batch's check, may mark a page lost). */
static int get_reads_node(const kvt__req_t *r, const kvt_radix_node_t *node)
{
    return r->kind == KVT_REQ_GET && r->node == node && r->status >= 0 &&
           (r->get.cur < r->get.end || r->pending || r->get.check_due);
}

int kvt__get_lease_reads(const kvt__conn_t *c, const kvt_radix_node_t *node)
{
    for (const kvt__req_t *r = c->head; r; r = r->next)
        if (get_reads_node(r, node))
            return 1;
    return 0;
}

int kvt__get_lease_ends(kvt__conn_t *c, kvt_radix_node_t *node, uint64_t pin)
{
    kvt_srv_t *s = c->srv;
    int taken = 0;
    for (kvt__req_t *r = c->head; r; r = r->next) {
        if (!get_reads_node(r, node))
            continue;
        if (r->get.shared && !taken) {
            r->get.shared = 0; /* goes on by the write path, as get_pin's */
            r->lease = pin;
            taken = 1;
        } else if (r->get.shared) {
            get_pin(s, r);
        }
        if (r->lease && !r->extra)
            get_pin_nvme(s, r);
    }
    return taken;
}

/*
 * A GET whose first batch's pages all lie in DRAM, NVMe, the remote tier or HBM, with or without
 * LOCATE, under the lock shared (conn.c's framing, several loops), beside other loops' MATCHes
 * and GETs; its later batches go on shared while they can (get_next_shared). What the write
 * path's GET writes, and what this one does instead (docs/architecture.md, "GET under the shared
 * lock"):
 *
 *   the pin on the path (a lease)    none: each batch is built in one shared hold, while the
 *                                    client's lease holds the path (only a writer lets it go, and
 *                                    then pins it for this GET: kvt__get_lease_ends); after it
 *                                    nothing reads the tree, and the bytes are held by:
 *   the pages' read counts           the loop's own table (kvt__busy_inc_loop), which the frees
 *                                    consult under the write lock (kvt__free_loc)
 *   a located page (LOCATE)          nothing of the GET's: as on the write path, the client's
 *                                    lease keeps its location (no move, REMOVE or eviction of a
 *                                    leased path) until its RELEASE or expiry, when the client
 *                                    has read it; the arena table is only read (kvt__store_locate)
 *   the namespace reference          none: only the build reads the namespace, and the lease's
 *                                    pages keep it open
 *   counters, clients' memory        the loop's table (located pages: get_count_located);
 *                                    l->clients_bytes (as a shared MATCH)
 *   an NVMe, remote or HBM read      submitted through s->submit (get_submit; HBM's only queued:
 *                                    queue_only); its completion,
 *                                    on loop 0 under the write lock, drops its read count and
 *                                    marks a bad or missing record lost, and its kick reaches
 *                                    this loop as a posted one, taken shared (kvt__posted_shared)
 *
 * Its hooks (the write, drained, the release) run shared too (get_shares). Returns 1 when the GET
 * is queued, 0 when it did nothing and the write path takes the frame: a bad body or lease (the
 * write path says so), an HBM page a mapped pool would locate, its hash (or for a page read
 * first, NVMe, remote or HBM, its parent's) not cached or its seal to check with a write
 * (get_page_shares), no memory, no loop table.
 */
int kvt__h_get_shared(kvt__conn_t *c, const kvt_proto_hdr_t *h, const uint8_t *body, uint64_t t0)
{
    kvt_srv_t *s = c->srv;
    kvt_proto_get_t q;
    if (!kvt__get_shares(h) || !c->loop->metrics || kvt_proto_get_decode(body, h->body_len, &q) < 0)
        return 0;
    kvt__lease_t *l = kvt__lease_find(c, q.lease);
    uint32_t n = l && l->expires_ns > kvt_now_ns() ? get_pages(&q, l) : 0;
    /* The namespace's entry is read, not made (kvt__ns_get may grow the table: a write). */
    uint32_t block_bytes = n && l->ns < s->nns ? s->ns[l->ns].block_bytes : 0;
    if (!block_bytes)
        return 0;
    get_span_t g = {.node = l->node,
                    .zc = (h->flags & KVT_GET_F_LOCATE) ? c : NULL,
                    .ns = l->ns,
                    .block_bytes = block_bytes,
                    .first = q.first_page,
                    .end = q.first_page + n};
    if (!get_batch_shares(s, &g))
        return 0;
    kvt__req_t *r = get_req(c, h, t0, &q, l, n, block_bytes);
    if (!r)
        return 0;
    r->get.shared = 1;
    kvt__metric_add(c->loop->metrics, KVT_M_LOOP_SHARED_GETS, c->loop->id, 1);
    kvt__store_get_batch(s, r);
    return 1;
}
