/*
 * op_put.c: PUT. The handler inserts the tokens into the index and queues the request; the state
 * machine writes each new page's payload to the fastest tier that takes it (kvt_order), making
 * room through the policy when none has any, and once every write has landed hands the blocks to
 * the policy in page order and answers. With the GAPS flag a run of pages with bytes may follow
 * pages without (a sliding-window layer's window: docs/protocol.md, "Chains with gaps").
 *
 * A page that goes to DRAM is only allocated by the handler, under the write lock; its loop copies
 * the bytes in with the lock let go after its batch of events (kvt__put_apart), and the request
 * is answered once its copies and its other writes are done (docs/architecture.md, "Event loops":
 * "PUT's copy outside the lock"). A page that goes to NVMe is decided there too but submitted
 * after that phase, which hashes its record and copies it to an aligned buffer (put_prepare).
 *
 * RESERVE and COMMIT are the same PUT written by a local client through its mapping (op_map.c):
 * RESERVE runs the state machine with no payload, its writes only allocating room in the
 * connection's DRAM arena, and instead of handing the blocks to the policy it parks the request
 * on the connection as a reservation, its pages still BUSY and invisible; COMMIT hands them over
 * exactly as a PUT's landing does, and an abort, the connection's close or reserve-ms gives the
 * room back.
 */
#include "server.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* Where a PUT's page goes: the first of these that takes it. */
static const kvt_tier_id_t kvt_order[] = {KVT_TIER_HBM, KVT_TIER_DRAM, KVT_TIER_NVME,
                                          KVT_TIER_REMOTE};

/* ---- PUT ---- */

/* Where a PUT's page landed, until the whole PUT is done and hands its blocks to the policy. */
typedef struct kvt__landed {
    uint64_t loc;
    uint32_t len;
    uint8_t tier;    /* KVT_TIER_NONE: not written */
    uint8_t started; /* a write was submitted: the block is BUSY */
    uint8_t held;    /* the tier whose policy accounting holds room for the write, or NONE */
    uint8_t orphan;  /* an expired reservation's room: kvt_tier_dram_orphan, no longer stored */
    /* A DRAM page allocated but not written yet: where kvt__put_apart copies its bytes. Written
     * by the handler, read by the loop's copy; put_done writes the other fields meanwhile. */
    uint8_t *dst;
    /* An NVMe write decided by the handler and not submitted yet: kvt__put_apart readies it with
     * the lock let go (put_prepare) and submits it after (put_submit). */
    kvt__io_t *later;
    /* later's payload lies unaligned and the clients' memory had room for an aligned copy of it
     * (put_copy_count): counted there from the handler until the write ends (put_end), whether
     * the copy is made or its allocation fails. */
    uint8_t copy_counted;
} kvt__landed_t;

/* A payload page of r not stored, and why. */
static void put_skip(kvt_srv_t *s, kvt__req_t *r, kvt_put_outcome_t why, uint32_t pages)
{
    r->put.skipped += pages;
    kvt__metric_add(s->metrics, KVT_M_PUT_PAGES, why, pages);
}

/*
 * PUT and COMMIT with GAPS: the run of pages with bytes that begins at depth follows a page
 * without bytes. A node's tiers never get faster with depth (policy.c), so the policy would
 * refuse the run in the same node; the node is split there instead, and the run begins a node
 * of its own below the pages without bytes (a gap node: index-only pages that only name the
 * path, evicted as any index-only pages once nothing below them is left, docs/protocol.md).
 * Without room (index-bytes, or the allocator), nothing is split and the run is refused as
 * without GAPS.
 */
static void put_gap(kvt_srv_t *s, kvt__req_t *r, uint32_t depth)
{
    if (!r->put.gaps || depth == 0)
        return;
    kvt_radix_node_t *x = kvt__path_holder(r->node, depth);
    if (!x || depth == kvt__node_depth(x) || kvt__path_block(x, depth - 1)->tier != KVT_TIER_NONE)
        return;
    if (kvt__path_split(s, x, depth) == 0)
        kvt__metric_add(s->metrics, KVT_M_PUT_GAPS, 0, 1);
}

/*
 * Every write of the PUT is done: its blocks join the policy in page order, runs of one tier
 * at a time (the order of tiers inside a node must hold, so the policy may refuse a page that
 * landed in a faster tier than the one before it; its bytes are then freed and it stays
 * index-only, counted as skipped). With GAPS a run after a page without bytes begins a node of
 * its own first (put_gap).
 */
static void put_adopt(kvt_srv_t *s, kvt__req_t *r)
{
    kvt__landed_t *l = r->extra;
    if (!l)
        return;
    uint32_t n = r->put.end - r->put.first;
    for (uint32_t i = 0; i < n; i++) {
        if (l[i].held != KVT_TIER_NONE) /* the room the policy held is the adoption's to take */
            kvt_policy_unhold(s->policy, (kvt_tier_id_t)l[i].held, r->block_bytes);
        l[i].held = KVT_TIER_NONE;
        if (!l[i].started)
            continue;
        kvt_block_t *b = kvt__path_block(r->node, r->put.first + i);
        kvt__block_busy(b, 0);
        if (l[i].tier == KVT_TIER_NONE)
            continue;
        kvt__block_place(b, l[i].loc, l[i].len);
    }
    for (uint32_t i = 0; i < n;) {
        uint32_t j = i + 1;
        if (l[i].tier == KVT_TIER_NONE) {
            i = j;
            continue;
        }
        while (j < n && l[j].tier == l[i].tier)
            j++;
        kvt_tier_id_t t = (kvt_tier_id_t)l[i].tier;
        put_gap(s, r, r->put.first + i);
        uint32_t got = kvt__policy_adopt(
            s, r->node, r->put.first + i, r->put.first + j, t, r->pages,
            r->put.hint.priority || r->put.hint.finished || r->put.hint.paused_ms ? &r->put.hint
                                                                                  : NULL);
        r->put.stored += got;
        kvt__metric_add(s->metrics, KVT_M_PUT_PAGES, KVT_PUT_STORED, got);
        if (got < j - i) /* refused: the node's tier order */
            put_skip(s, r, KVT_PUT_NO_ROOM, (j - i) - got);
        if (t == KVT_TIER_NVME)
            kvt__metric_add(s->metrics, KVT_M_NVME_WRITTEN, 0, (double)(j - i) * l[i].len);
        i = j;
    }
    free(r->extra);
    r->extra = NULL;
}

static void resv_reply(kvt_srv_t *s, kvt__req_t *r);
static void put_apart_queue(kvt_srv_t *s, kvt__req_t *r);

static void put_reply(kvt_srv_t *s, kvt__req_t *r)
{
    if (r->put.reserve) {
        resv_reply(s, r);
        return;
    }
    put_adopt(s, r);
    kvt__unpin(s, r);
    kvt_proto_put_reply_t p = {
        .pages = r->pages,
        .new_pages = r->put.new_pages,
        .stored = r->put.stored,
        .skipped = r->put.skipped,
    };
    uint8_t w[sizeof(kvt_wire_put_reply_t)];
    kvt_proto_put_reply_encode(w, &p);
    kvt__req_reply(r, w, r->status < 0 ? 0 : sizeof w);
    kvt__req_finish(r);
}

/* A tier that answers a write so gives it up to the next one down: full, unable to place it for
 * now (an NVMe log whose full segments are all pinned), unable to hold a page that large (an NVMe
 * segment smaller than the page's record), or down (the remote). */
static int put_passes_on(int rc)
{
    return rc == KVT_ENOSPC || rc == KVT_EAGAIN || rc == KVT_ETOOBIG || rc == KVT_EUNAVAIL;
}

/* The landing record of x's page. */
static kvt__landed_t *put_landed(const kvt__io_t *x)
{
    return (kvt__landed_t *)x->req->extra + (x->depth - x->req->put.first);
}

/*
 * x's NVMe write left for kvt__put_apart, its payload unaligned in the frame: room for its aligned
 * copy (put_align) counted in the clients' memory now, under the write lock, since the copy is
 * made with the lock let go, where the count cannot change. At max-client-bytes, no copy: the
 * tier bounces the page when its write starts, under the lock, as it did before step 11 (its
 * bounce buffers are the tier's own, bounded by its queue depth), so the clients' memory never
 * goes past its bound and the PUT is neither refused nor held.
 */
static void put_copy_count(kvt_srv_t *s, const kvt__io_t *x)
{
    if ((uintptr_t)x->io.buf % KVT_TIER_DIRECT_ALIGN == 0 ||
        s->clients.bytes + x->io.len > s->conf->max_client_bytes)
        return;
    s->clients.bytes += x->io.len;
    put_landed(x)->copy_counted = 1;
}

/*
 * Starts x's write into tier id, or with apart leaves its CPU work to the loop's phase with the
 * lock let go: a DRAM write only allocates (its copy: put_copy), an NVMe write is not submitted
 * yet (its checksum and aligned copy: put_prepare). Returns 0 or the tier's refusal.
 */
static int put_start(kvt_srv_t *s, kvt__io_t *x, kvt_tier_id_t id, int apart)
{
    kvt__landed_t *l = put_landed(x);
    if (apart && id == KVT_TIER_NVME) {
        l->later = x;
        put_copy_count(s, x);
        return 0;
    }
    void *buf = x->io.buf;
    int later = apart && id == KVT_TIER_DRAM;
    if (later)
        x->io.buf = NULL;
    int rc = kvt__tier_write(s, id, &x->io);
    x->io.buf = buf;
    /* DRAM answers at once (its completion is queued): the location is there. */
    if (rc == 0 && later) {
        l->dst = kvt__tier_loc_ptr(s, id, x->io.loc);
        kvt_assert(l->dst); /* else the page would be published unwritten */
    }
    return rc;
}

/*
 * Writes a PUT's page into the first tier of kvt_order[from ..] that takes it, holding room for
 * it in that tier's policy accounting until the PUT is adopted, so that the tier's watermarks see
 * the writes in flight (x->tier and the page's held say which). A first pass takes only room
 * there is; when no tier has any, a second makes room as the policy's own inserts do (the lowest
 * tier's least valuable pages go), so that a full cache takes new pages instead of refusing every
 * run larger than its watermarks' headroom. With apart, the write's copy and checksum are left to
 * kvt__put_apart (put_start). Returns 0, or the refusal of the last one asked (x->tier then as it
 * was). An NVMe write left for later that its tier refuses when it is submitted (put_submit) goes
 * to the tiers below as one refused after its tier queued it does (put_done), without a second
 * pass making room in NVMe.
 */
static int put_write(kvt_srv_t *s, kvt__io_t *x, size_t from, int apart)
{
    kvt__req_t *r = x->req;
    kvt__landed_t *l = put_landed(x);
    uint8_t was = x->tier;
    int rc = KVT_ENOSPC;
    for (int room = 0; room < 2 && put_passes_on(rc); room++) {
        rc = KVT_ENOSPC;
        for (size_t i = from; i < KVT_ARRAY_LEN(kvt_order) && put_passes_on(rc); i++) {
            kvt_tier_id_t id = kvt_order[i];
            if (r->put.reserve && id != KVT_TIER_DRAM)
                continue; /* room a client can write is in its DRAM arena only */
            if (!s->tiers[id])
                continue;
            /* A page NVMe can never hold passes it by before its quota is asked or room is
             * made there for a write that would fail. */
            if (!kvt__tier_holds(s, id, r->ns, x->io.len)) {
                rc = KVT_ETOOBIG;
                continue;
            }
            /* At its quota there (tenant-<tier>-bytes): the next tier down, and no room made
             * for a write the tier would refuse anyway, at other tenants' expense. */
            if (!kvt__tier_fits(s, id, x->io.key.ns_seed, x->io.len)) {
                rc = KVT_ENOSPC;
                continue;
            }
            if ((rc = kvt_policy_hold(s->policy, id, x->io.len, room)) < 0)
                continue;
            x->tier = (uint8_t)id;
            if ((rc = put_start(s, x, id, apart)) < 0) {
                kvt_policy_unhold(s->policy, id, x->io.len);
                continue;
            }
            l->held = (uint8_t)id;
            if (room)
                kvt__metric_add(s->metrics, KVT_M_PUT_ROOM, 0, 1);
        }
    }
    if (rc < 0)
        x->tier = was;
    return rc;
}

/* x's write refused by its tier in a way the tiers below may take (put_passes_on): its hold on
 * the refused tier's room goes, and the next tier down that takes it gets it. Returns 0 when one
 * did (x->tier names it), else its refusal (x->tier as it was). */
static int put_pass_on(kvt_srv_t *s, kvt__io_t *x)
{
    uint8_t failed = x->tier;
    size_t i = 0;
    kvt_policy_unhold(s->policy, (kvt_tier_id_t)failed, x->io.len);
    put_landed(x)->held = KVT_TIER_NONE;
    while (i < KVT_ARRAY_LEN(kvt_order) && kvt_order[i] != failed)
        i++;
    return put_write(s, x, i + 1, 0);
}

/* x's write is over (x->io.status): where it landed goes in its landing record, or the page is
 * counted as skipped; x goes, and the request is answered if it was its last piece. */
static void put_end(kvt_srv_t *s, kvt__io_t *x)
{
    kvt__req_t *r = x->req;
    kvt_tier_io_t *io = &x->io;
    kvt__landed_t *l = put_landed(x);
    if (io->status == 0) {
        l->tier = x->tier;
        l->loc = io->loc;
        l->len = io->len;
    } else {
        static kvt_log_limit_t lim; /* a full tier fails every write */
        kvt_log_limited(&lim, KVT_LOG_WARN, "kvtierd: %s tier write failed: %s",
                        kvt_tier_name(x->tier), kvt_strerror(io->status));
        put_skip(s, r, put_passes_on(io->status) ? KVT_PUT_NO_ROOM : KVT_PUT_FAILED, 1);
    }
    if (l->copy_counted) /* given back whether the copy was made or not (put_copy_count) */
        s->clients.bytes -= io->len;
    int last = kvt__io_finished(s, x, io->status, 1);
    free(x->buf);
    free(x);
    if (last)
        put_reply(s, r);
}

static void put_done(kvt_tier_io_t *io)
{
    kvt__io_t *x = io->data;
    kvt_srv_t *s = x->req->srv;
    if (io->status < 0 && put_passes_on(io->status)) {
        /* Refused after it was taken (the tier queued it): the tiers below may take it. The
         * refused write counts as that tier's failed I/O; the request keeps waiting. */
        uint8_t failed = x->tier;
        uint64_t now = kvt_now_ns();
        if (put_pass_on(s, x) == 0) {
            unsigned series = kvt__tier_io(failed, 1);
            kvt__metric_observe(s->metrics, KVT_M_TIER_IO_SECONDS, series, now - x->start_ns);
            kvt__metric_add(s->metrics, KVT_M_TIER_IO_ERRORS, series, 1);
            x->start_ns = now;
            return;
        }
    }
    put_end(s, x);
}

int kvt__store_put(kvt_srv_t *s, kvt__req_t *r)
{
    uint32_t end = r->status < 0 ? r->put.first : KVT_MIN(r->put.end, r->pages);
    if (end > r->put.first) {
        r->put.end = end;
        r->extra = calloc(end - r->put.first, sizeof(kvt__landed_t));
        if (!r->extra) {
            r->status = KVT_ENOMEM;
            end = r->put.first;
        }
    }
    for (uint32_t p = r->put.first; p < end; p++) {
        kvt_block_t *b = kvt__path_block(r->node, p);
        if (!b || b->tier != KVT_TIER_NONE || (b->flags & KVT_BLOCK_BUSY)) {
            put_skip(s, r, KVT_PUT_CACHED, 1); /* held already, or another PUT writes it */
            continue;
        }
        kvt__io_t *x = kvt__io_new(s, r, p);
        if (!x) {
            r->status = KVT_ENOMEM;
            break;
        }
        /* A reservation's write only allocates (tiers/dram.c): the client writes the bytes. */
        x->io.buf =
            r->put.reserve ? NULL : r->payload + (size_t)(p - r->put.first) * r->block_bytes;
        x->io.len = r->block_bytes;
        x->io.cb = put_done;
        x->io.device = r->conn ? r->conn->device : -1; /* its engine's HBM pool */
        int rc = put_write(s, x, 0, !r->put.reserve && r->conn);
        if (rc < 0) {
            free(x);
            put_skip(s, r, put_passes_on(rc) ? KVT_PUT_NO_ROOM : KVT_PUT_FAILED, 1);
            continue;
        }
        kvt__block_busy(b, 1);
        ((kvt__landed_t *)r->extra)[p - r->put.first].started = 1;
        kvt__io_started(s, r);
    }
    put_apart_queue(s, r);
    if (r->pending == 0)
        put_reply(s, r); /* nothing to write (all held already), or it failed to start */
    return 0;
}

/* The payload pages r left for its loop to copy into DRAM (kvt__landed_t.dst) or to ready for
 * NVMe (later), if any: r goes on its loop's apart list, that work counted as one piece in
 * flight, so that no completion answers it, nor lets its pages be seen, before it is done. */
static void put_apart_queue(kvt_srv_t *s, kvt__req_t *r)
{
    kvt__landed_t *l = r->extra;
    for (uint32_t i = 0; l && i < r->put.end - r->put.first; i++)
        if (l[i].dst || l[i].later) {
            kvt__io_started(s, r);
            r->put.apart_next = r->conn->loop->apart;
            r->conn->loop->apart = r;
            return;
        }
}

/* r's DRAM pages written from its payload. With the lock let go: what it reads and writes is
 * r's alone until its loop gives the piece back (the table in docs/architecture.md). */
static void put_copy(const kvt__req_t *r)
{
    const kvt__landed_t *l = r->extra;
    for (uint32_t i = 0; i < r->put.end - r->put.first; i++)
        if (l[i].dst)
            memcpy(l[i].dst, r->payload + (size_t)i * r->block_bytes, r->block_bytes);
}

/* x's payload in a KVT_TIER_DIRECT_ALIGN-aligned buffer of its own (x->buf) when the handler
 * counted one for it (put_copy_count: it does not lie aligned in the frame, and max-client-bytes
 * had room), so that the NVMe tier writes it in place rather than copy it into a bounce buffer
 * when the write starts, under the lock. Out of memory, the tier bounces it. */
static void put_align(kvt__io_t *x)
{
    void *buf;
    if (!put_landed(x)->copy_counted || posix_memalign(&buf, KVT_TIER_DIRECT_ALIGN, x->io.len) != 0)
        return;
    memcpy(buf, x->io.buf, x->io.len);
    x->buf = buf;
    x->io.buf = buf;
}

/* r's NVMe pages readied for their writes with the lock let go: aligned (put_align), and their
 * records' checksums made (kvt__tier_write_prepare), so that starting the write, under the lock,
 * only encodes the header. Each x is r's alone until put_submit (nothing has been submitted);
 * the tier's pointer does not change while the daemon runs. Unprepared (it cannot fail for a
 * PUT's io), the write is hashed when it starts, as any other. */
static void put_prepare(kvt_srv_t *s, const kvt__req_t *r)
{
    const kvt__landed_t *l = r->extra;
    for (uint32_t i = 0; i < r->put.end - r->put.first; i++) {
        kvt__io_t *x = l[i].later;
        if (!x)
            continue;
        put_align(x);
        (void)kvt__tier_write_prepare(s, KVT_TIER_NVME, &x->io);
    }
}

/* r's NVMe pages readied by put_prepare submitted, under the write lock. One the tier refuses
 * goes down as put_done sends one refused later, or is counted as failed. */
static void put_submit(kvt_srv_t *s, kvt__req_t *r)
{
    kvt__landed_t *l = r->extra;
    for (uint32_t i = 0; i < r->put.end - r->put.first; i++) {
        kvt__io_t *x = l[i].later;
        if (!x)
            continue;
        l[i].later = NULL;
        x->start_ns = kvt_now_ns();
        int rc = kvt__tier_write(s, KVT_TIER_NVME, &x->io);
        if (rc == 0 || (put_passes_on(rc) && put_pass_on(s, x) == 0))
            continue;
        x->io.status = rc;
        put_end(s, x);
    }
}

/* KVT_DEBUG_PUT_GATE names a file; while it exists, the copies and the NVMe pages' preparation
 * wait (tests/test_server_loops.c holds a PUT inside that phase with it). Unset: nothing. */
static void put_gate(const kvt_srv_t *s)
{
    while (s->put_gate && access(s->put_gate, F_OK) == 0)
        usleep(1000);
}

void kvt__put_apart(kvt__loop_t *l)
{
    kvt_srv_t *s = l->srv;
    kvt__req_t *list = l->apart;
    if (!list)
        return;
    l->apart = NULL;
    if (s->loops_running) /* with one loop, no one else would run meanwhile */
        kvt__loop_hold(l, KVT_HELD_NONE);
    put_gate(s);
    for (kvt__req_t *r = list; r; r = r->put.apart_next) {
        put_copy(r);
        put_prepare(s, r);
    }
    kvt__loop_hold(l, KVT_HELD_WRITE);
    while (list) {
        kvt__req_t *r = list;
        list = r->put.apart_next;
        r->put.apart_next = NULL;
        put_submit(s, r);
        if (kvt__io_ended(s, r))
            put_reply(s, r);
    }
}

/* The RESERVE reply when nothing gets room: no reservation, only the index's answer. */
static int resv_reply_empty(kvt__conn_t *c, const kvt_proto_hdr_t *h, uint64_t t0, uint32_t pages,
                            uint32_t new_pages)
{
    kvt_proto_reserve_reply_t rr = {.pages = pages, .new_pages = new_pages};
    uint8_t w[sizeof(kvt_wire_reserve_reply_t)];
    kvt_proto_reserve_reply_encode(w, &rr);
    return kvt__reply(c, h->opcode, h->request_id, t0, 0, w, sizeof w);
}

/*
 * The request's tokens in c->tok: the frame's, or (KVT_PUT_F_HANDLE) the tokens a MATCH kept
 * under the handle followed by the frame's, in c's scratch (the handle stays as it was: it may
 * be named again until it expires). *ntokens gets their count. 0, or an error already answered
 * (1): a handle c does not hold, or one kept in another namespace, changes nothing.
 */
static int put_tokens(kvt__conn_t *c, const kvt_proto_hdr_t *h, uint64_t t0,
                      const kvt_proto_put_t *q, uint32_t *ntokens)
{
    *ntokens = q->ntokens;
    if (!q->handle) {
        if (kvt__tokens(c, q->tokens, q->ntokens) < 0)
            goto nomem;
        return 0;
    }
    const kvt__handle_t *k = kvt__handle_find(c, q->handle);
    if (!k) {
        kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_ENOENT,
                         "no MATCH handle %u on this connection: never kept, expired (a handle "
                         "lives as long as its MATCH's lease would), replaced by newer ones (%u "
                         "at most), or another connection's",
                         q->handle, KVT_MATCH_HANDLES);
        return 1;
    }
    if (k->ns != c->ns || k->page != c->page_size) {
        kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_EINVAL,
                         "MATCH handle %u was kept in another namespace: a HELLO switched this "
                         "connection since",
                         q->handle);
        return 1;
    }
    size_t n = (size_t)k->ntokens + q->ntokens, had = c->tokens_cap;
    if (n > UINT32_MAX) {
        kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_EINVAL,
                         "MATCH handle %u's %u tokens and %u more are too many", q->handle,
                         k->ntokens, q->ntokens);
        return 1;
    }
    if (kvt_reserve(&c->tokens, &c->tokens_cap, n, sizeof *c->tokens, 4096) < 0)
        goto nomem;
    c->srv->clients.bytes += (c->tokens_cap - had) * sizeof *c->tokens;
    memcpy(c->tokens, k->tokens, (size_t)k->ntokens * 4);
    kvt_proto_tokens(q->tokens, q->ntokens, c->tokens + k->ntokens);
    c->tok = c->tokens;
    *ntokens = (uint32_t)n;
    return 0;
nomem:
    kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_ENOMEM, "out of memory");
    return 1;
}

/* PUT and RESERVE from their decoded bodies: q->payload is NULL for RESERVE, whose room
 * max-reserved-bytes bounds (the pages past it get none, as if DRAM were full). */
static int put_begin(kvt__conn_t *c, const kvt_proto_hdr_t *h, const uint8_t *body, uint64_t t0,
                     const kvt_proto_put_t *q_in)
{
    kvt_proto_put_t cq = *q_in;
    const kvt_proto_put_t *q = &cq;
    kvt_srv_t *s = c->srv;
    int reserve = h->opcode == KVT_OP_RESERVE;
    if (put_tokens(c, h, t0, q_in, &cq.ntokens))
        return 0;
    kvt__count_hints(s->metrics, &q->hints);
    uint32_t whole = q->ntokens / c->page_size;
    if (q->npayload && ((uint64_t)q->first_page + q->npayload > whole))
        return kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_EINVAL,
                                "%s pages %u..%llu go past the request's %u whole pages",
                                reserve ? "reserved" : "payload", q->first_page,
                                (unsigned long long)q->first_page + q->npayload - 1, whole);
    uint64_t resv_room = c->srv->conf->max_resv_bytes;
    resv_room = resv_room > c->resv_bytes ? resv_room - c->resv_bytes : 0;
    if (reserve && (uint64_t)cq.npayload * c->block_bytes > resv_room) {
        uint32_t fit = (uint32_t)(resv_room / c->block_bytes);
        kvt__metric_add(s->metrics, KVT_M_PUT_PAGES, KVT_PUT_NO_ROOM, cq.npayload - fit);
        cq.npayload = fit;
    }
    kvt_match_t at;
    if (kvt__index_room(s, c->ns, c->tok, q->ntokens, q->npayload > 0, &at) < 0)
        return kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_ENOSPC,
                                "no room for %u tokens in the index: it is at index-bytes (%llu) "
                                "and every page it could evict is leased or busy with I/O",
                                q->ntokens, (unsigned long long)s->conf->index_bytes);
    kvt_insert_t res; /* near the cap the room check walked the path: the insert goes on from it */
    int rc = kvt__path_insert(s, c->ns, at.ns == c->ns ? &at : NULL, c->tok, q->ntokens, &res);
    if (rc < 0)
        return kvt__reply_error(c, h->opcode, h->request_id, t0, rc, "insert failed");
    if (q->npayload == 0 || res.pages == 0) {
        if (reserve)
            return resv_reply_empty(c, h, t0, res.pages, res.new_pages);
        kvt_proto_put_reply_t r = {.pages = res.pages, .new_pages = res.new_pages};
        uint8_t w[sizeof(kvt_wire_put_reply_t)];
        kvt_proto_put_reply_encode(w, &r);
        return kvt__reply(c, h->opcode, h->request_id, t0, 0, w, sizeof w);
    }
    kvt__req_t *r = kvt__req_new(c, KVT_REQ_PUT, h->opcode, h->request_id, t0);
    if (!r)
        return kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_ENOMEM, "out of memory");
    kvt__req_ns(r, c->ns);
    r->node = res.node;
    r->pages = res.pages;
    r->put.new_pages = res.new_pages;
    r->put.reserve = (uint8_t)reserve;
    r->put.gaps = (h->flags & KVT_PUT_F_GAPS) != 0;
    kvt__policy_hint(&q->hints, kvt__node_depth(res.node), &r->put.hint);
    r->block_bytes = c->block_bytes;
    r->put.first = q->first_page;
    r->put.end = q->first_page + q->npayload;
    if (reserve) { /* until the reply says how much of it became a reservation */
        r->put.resv_bytes = (uint64_t)q->npayload * c->block_bytes;
        c->resv_bytes += r->put.resv_bytes;
    }
    rc = 0;
    if (!reserve) {
        size_t bytes = (size_t)q->npayload * c->block_bytes, held;
        /* A frame with a buffer of its own is kept whole until the pages are written, not
         * copied. */
        if ((r->held = kvt__conn_take_frame(c, body, h->body_len, &held))) {
            r->held_bytes = held;
            r->payload = (uint8_t *)(uintptr_t)q->payload;
        } else {
            rc = kvt__req_hold(r, q->payload, bytes);
        }
    }
    if (rc < 0 || (rc = kvt__pin(s, res.node, c->ns, &r->lease)) < 0) {
        r->status = rc;
        r->lease = 0;
    }
    kvt__store_put(s, r); /* replies at once when there is nothing to write */
    return 0;
}

int kvt__h_put(kvt__conn_t *c, const kvt_proto_hdr_t *h, const uint8_t *body, uint64_t t0)
{
    kvt_proto_put_t q;
    /* The handle field is the handle with KVT_PUT_F_HANDLE, else (reserved) 0. */
    if ((h->flags & ~(unsigned)KVT_PUT_F_ALL) || !c->hello ||
        kvt_proto_put_decode(body, h->body_len, c->block_bytes, &q) < 0 ||
        !(h->flags & KVT_PUT_F_HANDLE) != !q.handle) {
        if (!(h->flags & ~(unsigned)KVT_PUT_F_ALL) && kvt__need_hello(c, h, t0) < 0)
            return 0;
        return kvt__bad_body(c, h, t0, "PUT");
    }
    return put_begin(c, h, body, t0, &q);
}

/* ---- RESERVE and COMMIT ---- */

/* Lets page i of a reservation (or of a RESERVE that cannot become one) go in the index: the
 * policy's hold, its BUSY mark; with free_room, its room in the arena too. */
static void resv_page_release(kvt_srv_t *s, kvt__req_t *v, uint32_t i, int free_room)
{
    kvt__landed_t *l = (kvt__landed_t *)v->extra + i;
    if (l->held != KVT_TIER_NONE)
        kvt_policy_unhold(s->policy, (kvt_tier_id_t)l->held, v->block_bytes);
    l->held = KVT_TIER_NONE;
    if (l->started)
        kvt__block_busy(kvt__path_block(v->node, v->put.first + i), 0);
    l->started = 0;
    if (free_room && l->tier != KVT_TIER_NONE) {
        kvt__tier_release(s, (kvt_tier_id_t)l->tier, l->loc, l->len, l->orphan);
        l->tier = KVT_TIER_NONE;
        l->orphan = 0;
    }
}

/* Every page of v released, and the pin on its path. Without free_room (an expired
 * reservation) its room stays allocated; with it, all v holds is given back and nothing of it
 * was visible: the pages stay index-only. */
static void resv_release(kvt_srv_t *s, kvt__req_t *v, int free_room)
{
    for (uint32_t i = 0; v->extra && i < v->put.end - v->put.first; i++)
        resv_page_release(s, v, i, free_room);
    kvt__unpin(s, v);
}

/* The connection's reservation id, or NULL; *at its index. */
static kvt__req_t *resv_find(kvt__conn_t *c, uint64_t id, size_t *at)
{
    for (size_t i = 0; i < c->nresv; i++)
        if (c->resv[i]->put.resv == id) {
            *at = i;
            return c->resv[i];
        }
    return NULL;
}

static void resv_end(kvt__conn_t *c, size_t i, kvt_resv_outcome_t how)
{
    kvt__req_t *v = c->resv[i];
    c->resv[i] = c->resv[--c->nresv];
    kvt_assert(c->resv_bytes >= v->put.resv_bytes);
    c->resv_bytes -= v->put.resv_bytes;
    if (how != KVT_RESV_COMMITTED)
        resv_release(c->srv, v, 1);
    if (!v->put.expired) /* an expired one was counted when it expired */
        kvt__metric_add(c->srv->metrics, KVT_M_RESERVATIONS, how, 1);
    kvt__req_free(v);
}

/*
 * A RESERVE's writes have all landed (or failed): the pages that got room in the connection's
 * arena become a reservation, parked on the connection with the request's state (its landed
 * table, pin and namespace use) moved into a record of its own, and the reply says where each
 * page goes. Pages that landed outside the arena (the connection's HELLO named another namespace
 * meanwhile) are given back: the client could not write them.
 */
static void resv_reply(kvt_srv_t *s, kvt__req_t *r)
{
    kvt__conn_t *c = r->conn;
    kvt__landed_t *l = r->extra;
    uint32_t n = r->put.end - r->put.first, nlocs = 0;
    uint64_t seed = kvt__ns_seed(s, r->ns);
    uint8_t *b = NULL;
    kvt__req_t *v = NULL;
    if (c) { /* the room it asked for; a reservation below counts its own */
        kvt_assert(c->resv_bytes >= r->put.resv_bytes);
        c->resv_bytes -= r->put.resv_bytes;
    }
    r->put.resv_bytes = 0;
    if (r->status == 0 && c && c->nresv >= s->conf->max_reservations)
        r->status = KVT_ENOSPC; /* pipelined RESERVEs passed the handler's check together */
    if (r->status == 0 && c && l) {
        b = malloc(sizeof(kvt_wire_reserve_reply_t) + (size_t)n * sizeof(kvt_wire_resv_loc_t));
        v = calloc(1, sizeof *v);
        if (!b || !v || kvt_reserve(&c->resv, &c->cap_resv, c->nresv + 1, sizeof *c->resv, 8) < 0)
            r->status = KVT_ENOMEM;
    }
    if (r->status < 0 || !c || !l) {
        resv_release(s, r, 1);
        free(b);
        free(v);
        if (r->status < 0) {
            const char *m = kvt_strerror(r->status);
            kvt__req_reply(r, m, (uint32_t)strlen(m));
        } else {
            kvt_proto_reserve_reply_t e = {.pages = r->pages, .new_pages = r->put.new_pages};
            uint8_t w[sizeof(kvt_wire_reserve_reply_t)];
            kvt_proto_reserve_reply_encode(w, &e);
            kvt__req_reply(r, w, sizeof w);
        }
        kvt__req_finish(r);
        return;
    }
    uint8_t *p = b + sizeof(kvt_wire_reserve_reply_t);
    for (uint32_t i = 0; i < n; i++) {
        uint64_t off;
        if (l[i].tier == KVT_TIER_NONE)
            continue;
        if (l[i].tier != KVT_TIER_DRAM || kvt__tier_offset(s, seed, l[i].loc, &off) < 0) {
            resv_page_release(s, r, i, 1);
            continue;
        }
        kvt_proto_resv_loc_encode(p, r->put.first + i, off);
        p += sizeof(kvt_wire_resv_loc_t);
        nlocs++;
    }
    kvt_proto_reserve_reply_t rr = {.pages = r->pages,
                                    .new_pages = r->put.new_pages,
                                    .nlocs = nlocs,
                                    .flags = s->conf->zc_checksum ? KVT_RESV_F_SEAL : 0};
    if (nlocs == 0) {
        resv_release(s, r, 1); /* nothing to write: no reservation */
        free(v);
    } else {
        v->srv = s;
        v->kind = KVT_REQ_PUT;
        v->op = KVT_OP_COMMIT;
        v->node = r->node;
        v->pages = r->pages;
        v->block_bytes = r->block_bytes;
        v->put = r->put;
        v->put.stored = v->put.skipped = 0; /* the RESERVE counted its own skips */
        v->put.resv_bytes = (uint64_t)nlocs * r->block_bytes;
        c->resv_bytes += v->put.resv_bytes;
        v->put.resv = rr.resv = ++s->resv_next;
        v->put.resv_expiry = kvt_now_ns() + (uint64_t)s->conf->reserve_ms * 1000000ull;
        v->extra = r->extra;
        v->lease = r->lease;
        r->extra = NULL;
        r->lease = 0;
        kvt__req_ns(v, r->ns);
        c->resv[c->nresv++] = v;
        kvt__metric_add(s->metrics, KVT_M_ZC_PAGES, KVT_OP_RESERVE, nlocs);
    }
    kvt_proto_reserve_reply_encode(b, &rr);
    kvt__req_reply(r, b, (uint32_t)(p - b));
    free(b);
    kvt__req_finish(r);
}

int kvt__h_reserve(kvt__conn_t *c, const kvt_proto_hdr_t *h, const uint8_t *body, uint64_t t0)
{
    kvt_srv_t *s = c->srv;
    kvt_proto_reserve_t q;
    if ((h->flags & ~(unsigned)KVT_PUT_F_ALL) ||
        kvt_proto_reserve_decode(body, h->body_len, &q) < 0 ||
        !(h->flags & KVT_PUT_F_HANDLE) != !q.handle)
        return kvt__bad_body(c, h, t0, "RESERVE");
    if (kvt__need_hello(c, h, t0) < 0)
        return 0;
    if (!c->zc_dram || c->zc_seed != kvt__ns_seed(s, c->ns))
        return kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_EINVAL,
                                "MAP the namespace's DRAM arena on this connection first");
    if (q.npages == 0)
        return kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_EINVAL,
                                "a RESERVE of 0 pages");
    if (c->nresv >= s->conf->max_reservations)
        return kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_ENOSPC,
                                "this connection holds max-reservations (%u) already",
                                s->conf->max_reservations);
    kvt_proto_put_t p = {
        .hints = q.hints,
        .ntokens = q.ntokens,
        .first_page = q.first_page,
        .npayload = q.npages,
        .handle = q.handle,
        .tokens = q.tokens,
    };
    return put_begin(c, h, body, t0, &p);
}

/*
 * The checksum of each page of v as the client committed it (zero-copy-checksum): from then on,
 * bytes the client writes over them through its mapping are found when the page leaves DRAM
 * (exec.c's moves, op_get.c's socket GET) and the page is dropped instead of demoted or served.
 *
 * With sums (COMMIT's SUMS flag, one per reserved page in location order: libkvtier hashes each
 * page in the pass that copies it in, client/seal.c) the daemon records them and reads nothing.
 * A wrong sum only makes the client's own page fail its first check: dropped, counted, never
 * served (docs/server.md, the trust model). Without sums the seal is queued and hashed by the
 * loop a slice at a time right after the reply (loop.c); a page that leaves before its seal is
 * done has it finished then, so every copy that leaves carries the sealed bytes; what the client
 * writes over a page between this reply and the seal's last slice is sealed in, not detected.
 * That deferred pass does not hide behind the client's next copy on a small host
 * (docs/benchmarks.md): the daemon's reply wakes the client on the daemon's own CPU, where it
 * waits for the slices, which is why libkvtier sends sums.
 */
static void resv_seal(kvt_srv_t *s, kvt__req_t *v, const uint8_t *sums)
{
    kvt__landed_t *l = v->extra;
    if (!s->conf->zc_checksum || !l)
        return;
    for (uint32_t i = 0, k = 0; i < v->put.end - v->put.first; i++) {
        if (l[i].tier != KVT_TIER_DRAM)
            continue;
        kvt__tier_seal(s, l[i].loc, sums != NULL, sums ? kvt_get_u64(sums + (size_t)8 * k++) : 0);
    }
}

/* The reservation's pages that got room: as many locations as RESERVE's reply gave. */
static uint32_t resv_pages(const kvt__req_t *v)
{
    const kvt__landed_t *l = v->extra;
    uint32_t n = 0;
    for (uint32_t i = 0; l && i < v->put.end - v->put.first; i++)
        n += l[i].tier == KVT_TIER_DRAM;
    return n;
}

int kvt__h_commit(kvt__conn_t *c, const kvt_proto_hdr_t *h, const uint8_t *body, uint64_t t0)
{
    kvt_srv_t *s = c->srv;
    uint64_t id;
    uint32_t nsums = 0;
    const uint8_t *sums = NULL;
    if ((h->flags & ~(unsigned)KVT_COMMIT_F_ALL) ||
        ((h->flags & KVT_COMMIT_F_SUMS)
             ? kvt_proto_commit_sums_decode(body, h->body_len, &id, &nsums, &sums)
             : kvt_proto_commit_decode(body, h->body_len, &id)) < 0)
        return kvt__bad_body(c, h, t0, "COMMIT");
    size_t at;
    kvt__req_t *v = resv_find(c, id, &at);
    if (v && v->put.expired) {
        resv_end(c, at, KVT_RESV_EXPIRED); /* its room, kept since it expired, goes now */
        return kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_ENOENT,
                                "reservation %llu expired after reserve-ms (%u): nothing of it "
                                "was stored",
                                (unsigned long long)id, s->conf->reserve_ms);
    }
    if (!v)
        return kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_ENOENT,
                                "reservation %llu is not held by this connection (never made, "
                                "committed or given back)",
                                (unsigned long long)id);
    if (sums && !(h->flags & KVT_COMMIT_F_ABORT) && nsums != resv_pages(v))
        return kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_EINVAL,
                                "COMMIT of reservation %llu carries %u checksums for its %u "
                                "reserved pages: nothing was committed",
                                (unsigned long long)id, nsums, resv_pages(v));
    uint32_t reserved = 0;
    for (uint32_t i = 0; i < v->put.end - v->put.first; i++)
        reserved += ((kvt__landed_t *)v->extra)[i].tier != KVT_TIER_NONE;
    kvt_proto_put_reply_t p = {.pages = v->pages, .new_pages = v->put.new_pages};
    if (h->flags & KVT_COMMIT_F_ABORT) {
        p.skipped = reserved;
        resv_end(c, at, KVT_RESV_ABORTED);
    } else {
        resv_seal(s, v, sums);
        put_adopt(s, v); /* the blocks join the policy as a PUT's landing does */
        kvt__unpin(s, v);
        p.stored = v->put.stored;
        p.skipped = v->put.skipped;
        resv_end(c, at, KVT_RESV_COMMITTED);
    }
    uint8_t w[sizeof(kvt_wire_put_reply_t)];
    kvt_proto_put_reply_encode(w, &p);
    return kvt__reply(c, h->opcode, h->request_id, t0, 0, w, sizeof w);
}

void kvt__resv_drop_all(kvt__conn_t *c)
{
    while (c->nresv)
        resv_end(c, c->nresv - 1, KVT_RESV_CLOSED);
    free(c->resv);
    c->resv = NULL;
    c->cap_resv = 0;
}

/*
 * A reservation past reserve-ms lets its pages go (not BUSY, not pinned: another PUT may store
 * them, the policy may evict them), but keeps its room in the arena allocated until the client's
 * COMMIT or ABORT of it, or its connection's close: a client that is only slow may still be
 * writing there, and memory reused for another block at once would take its late bytes. The
 * room becomes an orphan (kvt_tier_dram_orphan): no longer charged to the DRAM tier, so other
 * tenants' writes have the capacity, and punched, so it holds no memory whatever the client
 * writes there after; it costs only address space in the namespace's own arena, bounded by
 * max-reserved-bytes per connection.
 */
void kvt__resv_expire(kvt__conn_t *c, uint64_t now)
{
    for (size_t i = 0; i < c->nresv; i++) {
        kvt__req_t *v = c->resv[i];
        if (v->put.expired || v->put.resv_expiry > now)
            continue;
        static kvt_log_limit_t lim;
        kvt_log_limited(&lim, KVT_LOG_INFO,
                        "kvtierd: connection %llu: reservation %llu not committed within "
                        "reserve-ms (%u): its pages are let go, its room kept until COMMIT, "
                        "ABORT or close",
                        (unsigned long long)c->id, (unsigned long long)v->put.resv,
                        c->srv->conf->reserve_ms);
        resv_release(c->srv, v, 0);
        kvt__landed_t *l = v->extra;
        for (uint32_t j = 0; l && j < v->put.end - v->put.first; j++)
            if (l[j].tier == KVT_TIER_DRAM && !l[j].orphan &&
                kvt__tier_orphan(c->srv, l[j].loc, l[j].len) == 0)
                l[j].orphan = 1;
        v->put.expired = 1;
        kvt__metric_add(c->srv->metrics, KVT_M_RESERVATIONS, KVT_RESV_EXPIRED, 1);
    }
}
