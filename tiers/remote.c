/*
 * remote.c: the remote tier, blocks stored as string values in a Valkey or Redis server.
 *
 * This file owns the hiredis async connections (a node_t each: the one server, or every primary
 * of a cluster) and everything around them: the adapter that plugs hiredis into an epoll fd of
 * our own (the fd the tier's caller polls), the handshake (AUTH, SELECT or PING) that must answer
 * before a connection counts as up, reconnection with exponential backoff, per-request deadlines
 * on a timerfd, the RESP encoding of SET, GET, DEL and EXISTS, reply decoding, the
 * longest-prefix probe, and in cluster mode the routing: the slot map (CLUSTER SLOTS), CRC16 key
 * slots, MOVED and ASK. tier.c owns the location index, the capacity accounting and the
 * completion queue; this backend only moves bytes.
 *
 * A block is stored under "<prefix>:<ns seed hex>:<prefix hash hex>" so that every kvtierd
 * pointed at the same server finds blocks another one stored; the value is the shared block
 * header, the page's tokens and the payload (blockhdr.c), checked before a byte is returned: here,
 * or for a read whose caller takes the payload's checksum (check_later) the header and tokens
 * here and the checksum by the caller (kvt__tier_read_verify), whose failure then ends the read
 * as a failure here would have (remote_read_corrupt).
 *
 * In cluster mode each request goes to the node owning its key's slot and takes the path below
 * on that node's queues; a MOVED or ASK reply puts it back on the queue of the node named (the
 * redirect is followed from the reply callback, never by blocking), and the map is asked for
 * again, from any node up, after a redirect, a lost node or a timeout.
 *
 * Requests flow through FIFO queues (per node):
 *
 *   submit -> waitq --(connection up, < max_inflight unanswered)--> sentq --reply--> callback
 *               |                                                     |  \
 *               +- deadline passed: ETIMEDOUT                         |   outq: bytes not yet
 *                                                                     |   all on the socket
 *                             deadline passed: ETIMEDOUT, the request -+
 *                             stays in sentq, detached, until its reply
 *
 * Reads a client waits for (io->urgent) and probes take the same path through a queue of their
 * own, urgentq, which pump() empties before waitq: they wait for the window, not for the writes
 * and moves queued before them. urgentq and waitq, the window and the deadlines of waiting
 * requests are the tiers' shared request queue (ioq.c), as for the NVMe tier's slots.
 *
 * Redis answers in order, so sentq mirrors hiredis's own callback list one for one: the head
 * of sentq is the request whose reply is being parsed. That lets the reply decoder check a GET
 * value and copy its payload into the caller's buffer while the bytes are still in hiredis's
 * read buffer, with no reply object allocated. A request that timed out stays in sentq, detached
 * from its caller (io = NULL), until its late reply arrives and is dropped; a SET that succeeds
 * after its caller was told it failed is undone with a DEL, so that a failed write stores
 * nothing, unless the keys are shared (keep_on_free: the tier never deletes one). When the oldest
 * request has waited twice its timeout the connection is declared stalled and closed: everything in
 * flight then fails with KVT_EUNAVAIL.
 *
 * Bytes on the wire: hiredis would copy each command into its output buffer, and after a partial
 * write move the unsent rest to the front, which for megabyte values costs more than the network.
 * So hiredis only registers each command's reply callback (it is handed the command with length
 * 0: it parses the name and appends nothing) and this file writes the bytes itself, with
 * sendmsg over an iovec per request: the RESP head and stored block header from the request,
 * the payload straight from the caller's buffer, no copy. A big GET value is read from the socket
 * into the caller's buffer itself and checked there (direct_begin); other reads go into hiredis's
 * reader buffer directly, sized to the GET value being received, so that hiredis's 16 KiB reads
 * do not set the pace, and the value is then checked and copied out in one pass. hiredis's own
 * output buffer stays empty: it only connects, parses replies and runs callbacks. Sends use
 * MSG_NOSIGNAL, so a server that goes away never raises SIGPIPE.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/timerfd.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include <hiredis/async.h>
#include <hiredis/hiredis.h>
#include <hiredis/sds.h>

/* Decodes the replies in the reader and runs their callbacks: what redisAsyncHandleRead does
 * after its own read, which the tier does instead (read_more). hiredis 0.14 (and 1.x) export it
 * without declaring it in their headers. */
void redisProcessCallbacks(redisAsyncContext *ac);

#include "tier_impl.h"

#define KVT__READ_MIN   (64u << 10)
#define KVT__READ_MAX   (8u << 20)
#define KVT__IOV        64
#define KVT__PREFIX_MAX 64u
#define KVT__KEY_MAX    KVT_TIER_REMOTE_KEY_MAX
#define KVT__UNDO_MAX   4096u
#define KVT__NODES_MAX  64u /* cluster nodes known at once (seeds, primaries, redirect targets) */
#define KVT__REDIRECTS  5u  /* MOVED/ASK a request may follow before it fails */
#define KVT__MAP_GAP_NS (100ull * 1000000ull) /* slot-map refreshes at most this often */
#define KVT__ADDR_MAX   64u /* a numeric address as text: IPv6, '%', an interface's name */

/* epoll data: the tag in the low 4 bits, a socket's node index above. */
enum { TAG_SOCK = 1, TAG_TIMER = 2, TAG_WAKE = 3 };
typedef enum { ST_DOWN, ST_CONNECTING, ST_READY } conn_state_t;
typedef enum { RQ_GET, RQ_SET, RQ_DEL, RQ_EXISTS, RQ_HELLO, RQ_ASKING, RQ_SLOTS } rq_kind_t;

typedef struct remote remote_t;
typedef struct node node_t;
typedef struct rq rq_t;
typedef struct lookup lookup_t;
struct rq {
    kvt__ioq_link_t link; /* the queues and the free list (ioq.c); link.deadline_ns */
    rq_kind_t kind;
    kvt_tier_io_t *io;       /* GET/SET: the caller's request; NULL once detached */
    kvt_tier_probe_t *probe; /* EXISTS: its probe; NULL once the probe completed */
    uint32_t idx;            /* EXISTS: the key's index in the probe */
    uint32_t slot;           /* SET: the location slot reserved at submit */
    uint64_t sent_ns;
    uint64_t seed, hash; /* the key's name */
    uint16_t cslot;      /* the key's cluster hash slot */
    uint8_t redirects;   /* MOVED/ASK followed so far */
    uint8_t ask;         /* send ASKING first (an ASK redirect) */
    node_t *on;          /* the node whose queues hold it */

    /* The command's bytes while they are being written (outq). */
    rq_t *onext;
    int in_outq;
    char *hb; /* RESP head, and for SET the stored block header and tokens */
    uint32_t hblen;
    uint32_t paylen;
    const uint8_t *pay; /* SET: the caller's buffer, or own once detached mid-write */
    uint8_t *own;
    char tail[48];
    uint32_t taillen;
    uint64_t off;    /* bytes written */
    uint64_t expect; /* GET: bytes of the reply if the value is the one asked for */
    uint64_t vlen;   /* GET: the value's length in that case */
    uint8_t direct;  /* GET: its value was read straight into io->buf (direct_begin) */
    int dstatus;     /* ... and what the check of it found: 0 or KVT_ECORRUPT */
    char inl[320];   /* hb when it fits */
};

/* One location handed out by a successful write: which key to DEL when it is freed. */
typedef struct loc_slot {
    uint64_t seed, hash;
    uint32_t gen;
    uint32_t used;
} loc_slot_t;

/* The reply being decoded. hiredis hands one reply at a time to its callback and frees it right
 * after, so one object per connection is enough; it starts with a real redisReply because
 * hiredis reads type and str of an unsolicited error reply itself. (A slot map, the one reply
 * worth a tree, is built with hiredis's own functions instead: see reply_tree.) */
typedef struct remote_reply {
    redisReply r;
    int status;    /* GET value: 0 (payload copied out), KVT_ECORRUPT or KVT_EPROTO */
    char msg[320]; /* an error: long enough for "MOVED 16383 <255-byte host>:65535" */
} remote_reply_t;

/* One server connection: the single server, or one cluster node. */
struct node {
    remote_t *rm;
    uint32_t idx; /* in rm->nodes, and in its socket's epoll data */
    char *host;   /* as configured or named by the cluster: logs, metrics, node_get */
    int port;
    int seed; /* named by the conf: tried when no node knows the map */

    /* What hiredis connects to: always a numeric address, so that its getaddrinfo never asks a
     * resolver (see "name lookups" below). */
    char addr[KVT__ADDR_MAX];
    int numeric;       /* host is an address literal: addr is host, for good */
    int resolved;      /* addr may be connected to; for a name, until a connection to it fails */
    lookup_t *lookup;  /* a lookup of host started and not yet taken, or NULL */
    int lookup_logged; /* its last lookup failed and said so: log the next success */

    conn_state_t state;
    redisAsyncContext *ac;
    int sock;             /* ac's fd while registered in epfd, else -1 */
    uint32_t sock_events; /* EPOLLIN/EPOLLOUT hiredis asked for */
    uint32_t sock_armed;  /* what epfd has for sock */
    int ac_gone;          /* hiredis is freeing or has freed ac */
    int drop;             /* close ac once hiredis has returned */
    int drop_status;      /* what requests still waiting are failed with */
    uint32_t hello_left;  /* handshake replies still expected */
    uint64_t retry_ns;    /* DOWN: when to connect again */
    uint64_t backoff_ns;
    int logged_down;
    uint32_t owned; /* cluster: hash slots the map gives this node */

    /* Waiting to be sent (urgent reads and probes ahead of the rest), the window (max_inflight
     * unanswered, sentq.n) and deadlines. */
    kvt__ioq_t q;
    kvt__ioq_fifo_t sentq, undoq;
    rq_t *out_head, *out_tail; /* sent to hiredis, bytes not all written yet (onext) */

    remote_reply_t reply;
    redisReply *tree; /* a CLUSTER SLOTS reply being read or handled (reply_tree) */
    uint64_t skip;    /* bytes of an oversized GET value still to read off the socket and drop */
    rq_t *dr;         /* the GET whose value is being read straight into its buffer, or NULL */
    uint64_t dr_off;  /* bytes of that value (block header, then payload) read so far */
    uint8_t *dhdr;    /* its block header and tokens land here (kvt__blockhdr_size(PAGE_MAX)) */
    kvt_tier_remote_node_stats_t st; /* its own counters (addr, slots and up filled when read) */
};

struct remote {
    kvt_tier_t *tier;
    char *password;
    int db;
    char prefix[KVT__PREFIX_MAX + 1];
    uint32_t ttl_s;
    uint64_t timeout_ns;
    uint64_t backoff_min_ns, backoff_max_ns;
    uint32_t max_inflight;
    int keep_on_free;
    uint64_t seq; /* stored in each block header written */
    uint64_t rng; /* xorshift state for the backoff's jitter */

    int epfd, tfd, wfd;
    uint64_t timer_armed_ns; /* absolute time the timerfd is set to; UINT64_MAX: disarmed */

    /* The single server is nodes[0]; a cluster starts with its seeds and adds the nodes its map
     * and redirects name. A node is never removed (its index names it in epoll and the map);
     * one that owns no slot is left disconnected. */
    int cluster;
    node_t *nodes[KVT__NODES_MAX];
    uint32_t nnodes;
    uint8_t map[16384];   /* cluster: hash slot -> node index; 0xff: not known */
    int map_known;        /* a CLUSTER SLOTS reply was applied */
    int map_stale;        /* a redirect, a lost node or a timeout asked for a refresh */
    int map_inflight;     /* a CLUSTER SLOTS is on its way */
    uint64_t map_next_ns; /* no refresh before this */
    uint32_t map_rr;      /* which ready node to ask next */

    kvt__ioq_t pool; /* only its free list of requests */
    kvt_tier_probe_t *probes_done_head, *probes_done_tail;

    loc_slot_t *slots;
    uint32_t nslots, capslots;
    uint32_t *free_slots;
    uint32_t nfree_slots;

    redisReplyObjectFunctions fns, tree_fns;
    char *scratch; /* oversized values are read here, KVT__READ_MIN bytes, allocated when needed */
    kvt_tier_remote_stats_t stats;
};

static remote_t *remote_of(const kvt_tier_t *t)
{
    return t->impl;
}

/* --- queues and allocation --- */

static rq_t *rq_of(kvt__ioq_link_t *l)
{
    return l ? KVT__IOQ_OF(l, rq_t, link) : NULL;
}

static rq_t *rq_next(const rq_t *r)
{
    return rq_of(r->link.next);
}

static void q_push(kvt__ioq_fifo_t *q, rq_t *r)
{
    kvt__ioq_fifo_push(q, &r->link);
}

static rq_t *q_pop(kvt__ioq_fifo_t *q)
{
    return rq_of(kvt__ioq_fifo_pop(q));
}

/* Waiting to be sent: urgent reads and probes, and the rest (ioq.c). */
static kvt__ioq_fifo_t *urgentq(node_t *n)
{
    return &n->q.wait[1];
}

static kvt__ioq_fifo_t *waitq(node_t *n)
{
    return &n->q.wait[0];
}

static void outq_clear(node_t *n)
{
    for (rq_t *r = n->out_head; r; r = r->onext)
        r->in_outq = 0;
    n->out_head = n->out_tail = NULL;
}

/* A caller's request whose caller was already answered (a probe's other keys after a timeout):
 * not worth sending. */
static int rq_dead(const rq_t *r)
{
    return (r->kind == RQ_GET || r->kind == RQ_SET || r->kind == RQ_EXISTS) && !r->io && !r->probe;
}

static rq_t *rq_new(remote_t *rm, rq_kind_t kind)
{
    rq_t *r = rq_of(kvt__ioq_slot_get(&rm->pool));
    if (!r && !(r = malloc(sizeof(*r))))
        return NULL;
    memset(r, 0, sizeof(*r));
    r->kind = kind;
    r->slot = UINT32_MAX;
    return r;
}

static void rq_release(remote_t *rm, rq_t *r)
{
    kvt_assert(!r->in_outq);
    if (r->hb && r->hb != r->inl)
        free(r->hb);
    free(r->own);
    r->hb = NULL;
    r->own = NULL;
    kvt__ioq_slot_put(&rm->pool, &r->link);
}

static int slot_reserve(remote_t *rm, uint32_t *out)
{
    if (rm->nfree_slots > 0) {
        *out = rm->free_slots[--rm->nfree_slots];
        return 0;
    }
    if (rm->nslots == rm->capslots) {
        uint32_t cap = rm->capslots ? rm->capslots * 2 : 256;
        loc_slot_t *s = realloc(rm->slots, (size_t)cap * sizeof(*s));
        if (!s)
            return KVT_ENOMEM;
        rm->slots = s;
        uint32_t *f = realloc(rm->free_slots, (size_t)cap * sizeof(*f));
        if (!f)
            return KVT_ENOMEM;
        rm->free_slots = f;
        rm->capslots = cap;
    }
    rm->slots[rm->nslots] = (loc_slot_t){0};
    *out = rm->nslots++;
    return 0;
}

static void slot_unreserve(remote_t *rm, uint32_t slot)
{
    rm->slots[slot].used = 0;
    rm->slots[slot].gen++;
    rm->free_slots[rm->nfree_slots++] = slot;
}

static uint64_t slot_loc(const remote_t *rm, uint32_t slot)
{
    return ((uint64_t)rm->slots[slot].gen << 32) | (uint64_t)(slot + 1);
}

/* The slot a location names, or UINT32_MAX when it is not one of ours (any more). */
static uint32_t loc_slot(const remote_t *rm, uint64_t loc)
{
    uint64_t low = loc & 0xffffffffu;
    if (low == 0 || low > rm->nslots)
        return UINT32_MAX;
    uint32_t slot = (uint32_t)(low - 1);
    if (!rm->slots[slot].used || rm->slots[slot].gen != (uint32_t)(loc >> 32))
        return UINT32_MAX;
    return slot;
}

/* --- formatting --- */

static int format_key(const remote_t *rm, uint64_t seed, uint64_t hash, char *buf, size_t cap)
{
    int n = snprintf(buf, cap, "%s:%016llx:%016llx", rm->prefix, (unsigned long long)seed,
                     (unsigned long long)hash);
    return (n < 0 || (size_t)n >= cap) ? KVT_EINVAL : n;
}

/* Lays out r's command: hb (RESP head, block header, tokens), the payload, tail. */
static int format_cmd(remote_t *rm, rq_t *r)
{
    char key[KVT__KEY_MAX];
    int klen = format_key(rm, r->seed, r->hash, key, sizeof(key));
    if (klen < 0)
        return klen;
    char head[256];
    int hn;
    size_t hdr = 0;
    const char *verb = r->kind == RQ_GET ? "GET" : r->kind == RQ_DEL ? "DEL" : "EXISTS";
    r->paylen = 0;
    r->pay = NULL;
    r->taillen = 0;
    r->off = 0;
    if (r->kind == RQ_SET) {
        const kvt_tier_io_t *io = r->io;
        hdr = kvt__blockhdr_size(io->key.ntokens);
        int tn = snprintf(r->tail, sizeof(r->tail), "\r\n");
        if (rm->ttl_s) {
            char ttl[16];
            int ln = snprintf(ttl, sizeof(ttl), "%u", rm->ttl_s);
            tn = snprintf(r->tail, sizeof(r->tail), "\r\n$2\r\nEX\r\n$%d\r\n%s\r\n", ln, ttl);
        }
        r->taillen = (uint32_t)tn;
        hn = snprintf(head, sizeof(head), "*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%zu\r\n",
                      rm->ttl_s ? 5 : 3, klen, key, hdr + io->len);
        r->pay = io->buf;
        r->paylen = io->len;
    } else {
        hn = snprintf(head, sizeof(head), "*2\r\n$%zu\r\n%s\r\n$%d\r\n%s\r\n", strlen(verb), verb,
                      klen, key);
    }
    if (r->kind == RQ_GET) {
        size_t vlen = kvt__blockhdr_size(r->io->key.ntokens) + r->io->len;
        char digits[24];
        r->vlen = vlen;
        r->expect = (uint64_t)snprintf(digits, sizeof(digits), "%zu", vlen) + 3 + vlen + 2;
    }
    size_t need = (size_t)hn + hdr + 1;
    if (r->hb && r->hb != r->inl)
        free(r->hb);
    r->hb = need <= sizeof(r->inl) ? r->inl : malloc(need);
    if (!r->hb)
        return KVT_ENOMEM;
    memcpy(r->hb, head, (size_t)hn + 1);
    if (r->kind == RQ_SET)
        kvt__blockhdr_encode(r->hb + hn, &r->io->key, r->io->buf, r->io->len, ++rm->seq);
    r->hblen = (uint32_t)(hn + hdr);
    return 0;
}

/* A command of our own (the handshake, ASKING, CLUSTER SLOTS) as r's bytes. */
static int format_words(rq_t *r, int argc, const char *const *argv)
{
    size_t need = 16;
    for (int i = 0; i < argc; i++)
        need += strlen(argv[i]) + 32;
    r->hb = need <= sizeof(r->inl) ? r->inl : malloc(need);
    if (!r->hb)
        return KVT_ENOMEM;
    size_t n = (size_t)snprintf(r->hb, need, "*%d\r\n", argc);
    for (int i = 0; i < argc; i++)
        n += (size_t)snprintf(r->hb + n, need - n, "$%zu\r\n%s\r\n", strlen(argv[i]), argv[i]);
    r->hblen = (uint32_t)n;
    r->paylen = r->taillen = 0;
    r->pay = NULL;
    r->off = 0;
    return 0;
}

/* The handshake step s: 1 AUTH, 2 SELECT, 4 PING. */
static int format_hello(remote_t *rm, rq_t *r, int s)
{
    char dbs[16];
    const char *argv[2] = {"PING", NULL};
    int argc = 1;
    if (s == 1)
        argv[0] = "AUTH", argv[1] = rm->password, argc = 2;
    else if (s == 2) {
        snprintf(dbs, sizeof(dbs), "%d", rm->db);
        argv[0] = "SELECT", argv[1] = dbs, argc = 2;
    }
    return format_words(r, argc, argv);
}

/* --- cluster routing --- */

static void map_stale(remote_t *rm)
{
    if (rm->cluster)
        rm->map_stale = 1;
}

/* CRC16-CCITT (XMODEM), the cluster's key hash. Bitwise: a key is under 100 bytes, and a
 * request's network round trip dwarfs it. */
static uint16_t crc16(const char *buf, size_t len)
{
    uint16_t crc = 0;
    for (size_t i = 0; i < len; i++) {
        crc ^= (uint16_t)((uint8_t)buf[i] << 8);
        for (int k = 0; k < 8; k++)
            crc = (crc & 0x8000) ? (uint16_t)((crc << 1) ^ 0x1021) : (uint16_t)(crc << 1);
    }
    return crc;
}

uint16_t kvt_tier_remote_key_slot(const char *key, size_t len)
{
    if (!key)
        return 0;
    /* A hash tag: the bytes between the first '{' and the next '}', when not empty. */
    const char *open = memchr(key, '{', len);
    if (open) {
        size_t o = (size_t)(open - key);
        const char *close = memchr(open + 1, '}', len - o - 1);
        if (close && close > open + 1)
            return crc16(open + 1, (size_t)(close - open - 1)) & 16383;
    }
    return crc16(key, len) & 16383;
}

/* Names r's key, and its hash slot in cluster mode. */
static void rq_name(remote_t *rm, rq_t *r, uint64_t seed, uint64_t hash)
{
    r->seed = seed;
    r->hash = hash;
    r->cslot = 0;
    if (rm->cluster) {
        char key[KVT__KEY_MAX];
        int klen = format_key(rm, seed, hash, key, sizeof(key));
        if (klen > 0)
            r->cslot = kvt_tier_remote_key_slot(key, (size_t)klen);
    }
}

/* The node at host:port, added (disconnected) when new; NULL when KVT__NODES_MAX are known or
 * memory is short. */
static node_t *node_get(remote_t *rm, const char *host, int port)
{
    for (uint32_t i = 0; i < rm->nnodes; i++)
        if (rm->nodes[i]->port == port && !strcmp(rm->nodes[i]->host, host))
            return rm->nodes[i];
    if (rm->nnodes == KVT__NODES_MAX)
        return NULL;
    node_t *n = calloc(1, sizeof(*n));
    if (!n || !(n->host = strdup(host))) {
        free(n);
        return NULL;
    }
    n->rm = rm;
    n->idx = rm->nnodes;
    n->port = port;
    unsigned char in[sizeof(struct in6_addr)];
    if (inet_pton(AF_INET, host, in) == 1 || inet_pton(AF_INET6, host, in) == 1) {
        snprintf(n->addr, sizeof(n->addr), "%s", host); /* fits: a literal is at most 45 bytes */
        n->numeric = n->resolved = 1;
    }
    n->sock = -1;
    n->state = ST_DOWN;
    n->backoff_ns = rm->backoff_min_ns;
    kvt__ioq_init(&n->q, rm->max_inflight);
    rm->nodes[rm->nnodes++] = n;
    return n;
}

/* Where r goes: the single server, or the owner of its slot; NULL while the map names no owner
 * (not learnt yet, or a slot the cluster does not serve): such a request is not sent anywhere,
 * since a node that is no cluster node would take it. */
static node_t *route(remote_t *rm, const rq_t *r)
{
    if (!rm->cluster)
        return rm->nodes[0];
    uint8_t i = rm->map[r->cslot];
    return i != 0xff ? rm->nodes[i] : NULL;
}

/* The node r goes to, NULL when none is known or it is down (connecting to it, or starting the
 * lookup of its name, if its backoff allows: neither waits). */
static void node_retry(node_t *n, uint64_t now);
static node_t *route_up(remote_t *rm, const rq_t *r, uint64_t now)
{
    node_t *n = route(rm, r);
    if (n && n->state == ST_DOWN && !n->ac && now >= n->retry_ns)
        node_retry(n, now);
    if (!n || n->state == ST_DOWN) {
        map_stale(rm);
        return NULL;
    }
    return n;
}

/* --- completion --- */

/* A block of ours that the server evicted, or holds corrupt (someone overwrote it), is gone: its
 * location loc, if it still names the key (seed, hash), is dropped and its charge given back. */
static void loc_gone(remote_t *rm, uint64_t loc, uint64_t seed, uint64_t hash)
{
    uint32_t slot = loc_slot(rm, loc);
    if (slot == UINT32_MAX || rm->slots[slot].hash != hash || rm->slots[slot].seed != seed)
        return;
    kvt__tier_drop(rm->tier, loc);
    slot_unreserve(rm, slot);
    rm->stats.evicted++;
}

static void probe_finish(remote_t *rm, kvt_tier_probe_t *p, int status)
{
    /* Detach every request still naming p: the caller may reuse p after its callback. (After
     * a success every key was answered, and each answer detached its own request.) */
    for (uint32_t k = 0; status != 0 && k < rm->nnodes; k++) {
        node_t *n = rm->nodes[k];
        kvt__ioq_fifo_t *qs[] = {urgentq(n), waitq(n), &n->sentq};
        for (size_t i = 0; i < KVT_ARRAY_LEN(qs); i++)
            for (rq_t *r = rq_of(qs[i]->head); r; r = rq_next(r))
                if (r->probe == p)
                    r->probe = NULL;
    }
    p->status = status;
    p->found = status == 0 ? p->first_missing : 0;
    p->next = NULL;
    if (rm->probes_done_tail)
        rm->probes_done_tail->next = p;
    else
        rm->probes_done_head = p;
    rm->probes_done_tail = p;
    uint64_t one = 1;
    if (write(rm->wfd, &one, sizeof(one)) < 0 && errno != EAGAIN)
        kvt_log(KVT_LOG_WARN, "remote: eventfd write: %s", strerror(errno));
}

/* Completes whatever r carries (an io or a probe key) with status; r itself is not freed. */
static void rq_fail(remote_t *rm, rq_t *r, int status)
{
    if ((r->io || r->probe) && r->on && status != KVT_ENOENT)
        r->on->st.errors++;
    if (r->io && r->in_outq && r->pay && !r->own) {
        /* Its bytes are still being written from the caller's buffer, which goes back to the
         * caller now: keep a copy, or give up on the connection. */
        if ((r->own = malloc(r->paylen))) {
            memcpy(r->own, r->pay, r->paylen);
            r->pay = r->own;
        } else {
            r->on->drop = 1;
            r->on->drop_status = KVT_EUNAVAIL;
        }
    }
    if (r->io) {
        if (r->kind == RQ_SET && r->slot != UINT32_MAX) {
            slot_unreserve(rm, r->slot);
            r->slot = UINT32_MAX;
        }
        if (status == KVT_EUNAVAIL)
            rm->stats.unavailable++;
        if (r->kind == RQ_GET) /* a miss never hands out bytes: part of a value read in place */
            memset(r->io->buf, 0, r->io->len);
        kvt__tier_complete(rm->tier, r->io, status);
        r->io = NULL;
    }
    if (r->probe) {
        if (status == KVT_EUNAVAIL)
            rm->stats.unavailable++;
        probe_finish(rm, r->probe, status);
    }
}

/* A SET whose outcome the caller was told was a failure may still have stored its value: queue
 * a DEL for it unless a newer SET of the same key is queued (its outcome governs then). A tier
 * whose keys are shared (keep_on_free) deletes nothing: another daemon may have stored the same
 * key (the value is the same block, keyed by its prefix) and be relying on it, and no value tag
 * tells the two writes apart once the late SET overwrote it; the ttl or the server's eviction
 * clears such a key instead. */
static void undo_set(remote_t *rm, rq_t *r, int sent_now)
{
    if (rm->keep_on_free) {
        rm->stats.undo_kept++;
        return;
    }
    node_t *n = sent_now ? route(rm, r) : r->on; /* else held until r's node is back */
    if (!n)
        n = r->on;
    kvt__ioq_fifo_t *qs[] = {waitq(n), &n->sentq};
    for (size_t i = 0; i < KVT_ARRAY_LEN(qs); i++)
        for (rq_t *o = rq_of(qs[i]->head); o; o = rq_next(o))
            if (o != r && o->kind == RQ_SET && o->io && o->seed == r->seed && o->hash == r->hash)
                return;
    rq_t *d = rq_new(rm, RQ_DEL);
    if (!d)
        return;
    rq_name(rm, d, r->seed, r->hash);
    d->on = n;
    rm->stats.undone++;
    if (sent_now) {
        q_push(waitq(n), d); /* the window sends it, ahead of nothing newer of this key */
        return;
    }
    if (n->undoq.n >= KVT__UNDO_MAX) {
        rq_release(rm, d);
        return;
    }
    q_push(&n->undoq, d);
}

/* An error reply as a KVT_E* code. AUTH's refusals differ across versions ("WRONGPASS ...",
 * "ERR invalid password", "ERR Client sent AUTH, but no password is set", "ERR AUTH <password>
 * called without any password configured ..."). */
static int map_error(const char *msg, rq_kind_t kind)
{
    if (!strncmp(msg, "OOM", 3))
        return kind == RQ_SET ? KVT_ENOSPC : KVT_EIO;
    if (!strncmp(msg, "NOAUTH", 6) || !strncmp(msg, "WRONGPASS", 9) ||
        (kind == RQ_HELLO && (strstr(msg, "password") || strstr(msg, "AUTH"))))
        return KVT_EAUTH;
    if (!strncmp(msg, "LOADING", 7) || !strncmp(msg, "BUSY", 4) ||
        !strncmp(msg, "MASTERDOWN", 10) || !strncmp(msg, "CLUSTERDOWN", 11) ||
        !strncmp(msg, "TRYAGAIN", 8))
        return KVT_EUNAVAIL;
    if (!strncmp(msg, "WRONGTYPE", 9))
        return KVT_ECORRUPT;
    return KVT_EIO;
}

static void on_reply(redisAsyncContext *ac, void *reply, void *privdata);

/* --- the hiredis adapter: hooks onto our epoll fd --- */

static void sock_update(node_t *n)
{
    uint32_t want = n->sock_events | (n->out_head ? (uint32_t)EPOLLOUT : 0);
    if (n->sock < 0 || want == n->sock_armed)
        return;
    n->sock_armed = want;
    struct epoll_event ev = {.events = want, .data.u32 = TAG_SOCK | (n->idx << 4)};
    if (epoll_ctl(n->rm->epfd, EPOLL_CTL_MOD, n->sock, &ev) < 0)
        kvt_log(KVT_LOG_WARN, "remote: epoll_ctl: %s", strerror(errno));
}

static void ev_add_read(void *p)
{
    node_t *n = p;
    n->sock_events |= EPOLLIN;
    sock_update(n);
}

static void ev_del_read(void *p)
{
    node_t *n = p;
    n->sock_events &= ~(uint32_t)EPOLLIN;
    sock_update(n);
}

static void ev_add_write(void *p)
{
    node_t *n = p;
    n->sock_events |= EPOLLOUT;
    sock_update(n);
}

static void ev_del_write(void *p)
{
    node_t *n = p;
    n->sock_events &= ~(uint32_t)EPOLLOUT;
    sock_update(n);
}

/* hiredis is tearing ac down: called once or more, before the pending callbacks run (an error)
 * or after (redisAsyncFree). */
static void ev_cleanup(void *p)
{
    node_t *n = p;
    if (n->sock >= 0) {
        epoll_ctl(n->rm->epfd, EPOLL_CTL_DEL, n->sock, NULL);
        n->sock = -1;
    }
    n->sock_events = n->sock_armed = 0;
    outq_clear(n);
    n->ac_gone = 1;
}

static void on_connect(const redisAsyncContext *ac, int status)
{
    node_t *n = ac->data;
    if (status != REDIS_OK) {
        n->ac_gone = 1;
        n->rm->stats.connect_failures++;
    }
}

static void on_disconnect(const redisAsyncContext *ac, int status)
{
    node_t *n = ac->data;
    (void)status;
    n->ac_gone = 1;
}

/* --- reply objects: decoded in place, a GET payload copied straight to the caller --- */

static remote_reply_t *reply_reset(node_t *n, int type)
{
    remote_reply_t *o = &n->reply;
    memset(&o->r, 0, sizeof(o->r));
    o->r.type = type;
    o->status = 0;
    o->msg[0] = 0;
    return o;
}

/* 1 when the object being made belongs to a reply built as a tree by hiredis's own functions:
 * a CLUSTER SLOTS reply (its root), or any element below such a root. The root is remembered in
 * n->tree, which this file frees (reply_free cannot tell a tree from the one flat object). */
static int reply_tree(node_t *n, const redisReadTask *task)
{
    if (task->parent)
        return task->parent->obj != &n->reply;
    rq_t *h = rq_of(n->sentq.head);
    return h && h->kind == RQ_SLOTS;
}

static void *tree_root(node_t *n, const redisReadTask *task, void *obj)
{
    if (!task->parent && obj) {
        if (n->tree)
            freeReplyObject(n->tree);
        n->tree = obj;
    }
    return obj;
}

/*
 * A reply when no request waits for one (a server out of step, or not a Redis server): hiredis
 * takes a reply it has no callback for as a server's spontaneous error, and drops the connection,
 * but asserts (aborting the daemon) on any other kind. Every such reply is made an error here, so
 * that the connection goes and its requests are retried on the next one.
 */
static remote_reply_t *unasked(node_t *n)
{
    remote_reply_t *o = reply_reset(n, REDIS_REPLY_ERROR);
    snprintf(o->msg, sizeof(o->msg), "kvtier: a reply to no request");
    o->r.str = o->msg;
    o->r.len = strlen(o->msg);
    o->status = KVT_EPROTO;
    static kvt_log_limit_t lim;
    kvt_log_limited(&lim, KVT_LOG_WARN,
                    "remote: %s:%d sent a reply to no request: reconnecting (is it a Redis or "
                    "Valkey server?)",
                    n->host, n->port);
    return o;
}

static void *reply_string(const redisReadTask *task, char *str, size_t len)
{
    node_t *n = task->privdata;
    if (reply_tree(n, task))
        return tree_root(n, task, n->rm->tree_fns.createString(task, str, len));
    if (task->parent)
        return &n->reply; /* an element of an array we never asked for */
    if (!n->sentq.head && task->type != REDIS_REPLY_ERROR)
        return unasked(n);
    remote_reply_t *o = reply_reset(n, task->type);
    o->r.len = len;
    if (task->type != REDIS_REPLY_STRING) {
        size_t k = KVT_MIN(len, sizeof(o->msg) - 1);
        memcpy(o->msg, str, k);
        o->msg[k] = 0;
        o->r.str = o->msg;
        return o;
    }
    rq_t *r = rq_of(n->sentq.head);
    if (!r || r->kind != RQ_GET) {
        o->status = KVT_EPROTO;
        return o;
    }
    if (!r->io)
        return o;    /* a late reply: nobody waits for it */
    if (r->direct) { /* read and checked in place: hiredis saw an empty stand-in */
        o->status = r->dstatus;
        return o;
    }
    kvt_tier_io_t *io = r->io;
    uint32_t hb = kvt__blockhdr_size(io->key.ntokens);
    if (len != hb + io->len) {
        o->status = KVT_ECORRUPT;
        return o;
    }
    /* A shared GET's payload checksum is its own to take (kvt__tier_read_verify): the copy is
     * then all that reading the value costs here. */
    int rc = kvt__tier_read_verify(io, str, hb, str + hb);
    if (rc == 0)
        memcpy(io->buf, str + hb, io->len);
    o->status = rc;
    return o;
}

static void *reply_array(const redisReadTask *task, int elements)
{
    node_t *n = task->privdata;
    if (reply_tree(n, task))
        return tree_root(n, task, n->rm->tree_fns.createArray(task, elements));
    if (task->parent)
        return &n->reply;
    if (!n->sentq.head)
        return unasked(n);
    remote_reply_t *o = reply_reset(n, REDIS_REPLY_ARRAY);
    o->r.elements = elements > 0 ? (size_t)elements : 0;
    return o;
}

static void *reply_integer(const redisReadTask *task, long long value)
{
    node_t *n = task->privdata;
    if (reply_tree(n, task))
        return tree_root(n, task, n->rm->tree_fns.createInteger(task, value));
    if (task->parent)
        return &n->reply;
    if (!n->sentq.head)
        return unasked(n);
    remote_reply_t *o = reply_reset(n, REDIS_REPLY_INTEGER);
    o->r.integer = value;
    return o;
}

static void *reply_nil(const redisReadTask *task)
{
    node_t *n = task->privdata;
    if (reply_tree(n, task))
        return tree_root(n, task, n->rm->tree_fns.createNil(task));
    if (task->parent)
        return &n->reply;
    if (!n->sentq.head)
        return unasked(n);
    return reply_reset(n, REDIS_REPLY_NIL);
}

static void reply_free(void *obj)
{
    (void)obj; /* the flat object lives in its node; a tree is freed through n->tree */
}

static void tree_free(node_t *n)
{
    if (n->tree)
        freeReplyObject(n->tree);
    n->tree = NULL;
}

/* --- name lookups: off every request path and every lock --- */

/*
 * getaddrinfo blocks for as long as the resolver takes (seconds when a DNS server does not
 * answer), and hiredis calls it inside redisAsyncConnect. A connect is started from a request's
 * submission (route_up: any loop, under the daemon's shared lock with its submit mutex held),
 * from a redirect and from the tick (loop 0, under the write lock), so a host name is never
 * handed to hiredis: each node connects to a numeric address (n->addr), for which glibc's
 * getaddrinfo only parses the literal. An address literal is its own address for good; a name
 * is looked up on a thread of its own, started when the node is due to connect:
 *
 *   DOWN, retry due --lookup_start--> DOWN, n->lookup set --thread: getaddrinfo, state DONE,
 *          ^                                  |               write the tier's eventfd-->
 *          |                                  v
 *          |              tick: lookup_take --+-- found: n->addr, connect_start (CONNECTING)
 *          +-- backoff ---------------------- +-- failed: logged; the last address if any,
 *                                                 else schedule_retry
 *
 * While the lookup runs the node is down: requests routed to it fail at once with KVT_EUNAVAIL,
 * as during a backoff, and the tick does not arm the timer for it; the thread's write to the
 * tier's eventfd (TAG_WAKE) wakes the caller's loop, whose poll takes the answer. A connection
 * to the address that fails or is lost marks it stale (schedule_retry): the next attempt, after
 * the backoff, looks the name up again, since the service may have moved.
 *
 * One thread per lookup, detached, rather than glibc's getaddrinfo_a: a lookup is rare (start-up
 * and reconnects, paced by the backoff), its completion wakes the loop through the eventfd
 * instead of the tick polling gai_error on a timer, and a lookup still running when the tier is
 * destroyed is simply handed to its thread, which frees it (getaddrinfo_a's request cannot be
 * cancelled once started, and its gaicb could then be neither freed nor waited for without
 * blocking the close). The thread and the tier share only lk->state: whichever of them moves it
 * second (DONE after ORPHAN, or ORPHAN after DONE) frees lk. The thread wakes the loop through a
 * descriptor of its own (a dup of the eventfd), so the tier may close its own at any time.
 */
enum { LK_RUNNING, LK_DONE, LK_ORPHAN };

struct lookup {
    atomic_int state;
    int wake;      /* the thread's dup of the tier's eventfd; it closes it */
    int rc;        /* getaddrinfo's, or EAI_NONAME when it gave no TCP address */
    int sys_errno; /* with EAI_SYSTEM */
    char port[8];
    char addr[KVT__ADDR_MAX];
    char host[]; /* the name looked up */
};

/* The first IPv4 address of a lookup's answer, else the first IPv6 one, as text (an IPv6 one
 * with its scope, "fe80::1%eth0"): the order hiredis itself tries (an IPv4 lookup, then an IPv6
 * one). Returns 0 or EAI_NONAME. */
static int pick_addr(const struct addrinfo *res, char *out, size_t cap)
{
    for (int fam = 0; fam < 2; fam++)
        for (const struct addrinfo *a = res; a; a = a->ai_next)
            if (a->ai_family == (fam == 0 ? AF_INET : AF_INET6) &&
                getnameinfo(a->ai_addr, a->ai_addrlen, out, (socklen_t)cap, NULL, 0,
                            NI_NUMERICHOST) == 0)
                return 0;
    return EAI_NONAME;
}

static void *lookup_run(void *arg)
{
    lookup_t *lk = arg;
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM};
    struct addrinfo *res = NULL;
    int rc = getaddrinfo(lk->host, lk->port, &hints, &res);
    lk->sys_errno = errno;
    if (rc == 0) {
        rc = pick_addr(res, lk->addr, sizeof(lk->addr));
        freeaddrinfo(res);
    }
    lk->rc = rc;
    int wake = lk->wake; /* lk may be freed by the tier once DONE is seen */
    if (atomic_exchange_explicit(&lk->state, LK_DONE, memory_order_acq_rel) == LK_ORPHAN) {
        free(lk);
    } else {
        uint64_t one = 1;
        ssize_t w = write(wake, &one, sizeof(one)); /* fails only when a wake-up is pending */
        (void)w;
    }
    close(wake);
    return NULL;
}

/* Starts the lookup of n's host on a thread of its own; the node stays down meanwhile. Returns 0,
 * or an error when no thread could start (then retried after the backoff). */
static int lookup_start(node_t *n)
{
    remote_t *rm = n->rm;
    size_t hl = strlen(n->host);
    lookup_t *lk = malloc(sizeof(*lk) + hl + 1);
    if (!lk)
        return KVT_ENOMEM;
    memset(lk, 0, sizeof(*lk));
    atomic_init(&lk->state, LK_RUNNING);
    memcpy(lk->host, n->host, hl + 1);
    snprintf(lk->port, sizeof(lk->port), "%d", n->port);
    if ((lk->wake = fcntl(rm->wfd, F_DUPFD_CLOEXEC, 0)) < 0) {
        int rc = -errno;
        free(lk);
        return rc;
    }
    /* The thread takes no signal: the daemon's loops read theirs from a signalfd, and a library
     * user's handlers expect their own threads. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_attr_t attr;
    pthread_t tid;
    int rc = pthread_attr_init(&attr);
    if (rc == 0) {
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_sigmask(SIG_SETMASK, &all, &old);
        rc = pthread_create(&tid, &attr, lookup_run, lk);
        pthread_sigmask(SIG_SETMASK, &old, NULL);
        pthread_attr_destroy(&attr);
    }
    if (rc) {
        close(lk->wake);
        free(lk);
        return -rc;
    }
    n->lookup = lk;
    rm->stats.lookups++;
    return 0;
}

/* Gives up a lookup the tier no longer waits for (the tier is going): its thread frees it when it
 * ends, unless it has ended already. */
static void lookup_abandon(lookup_t *lk)
{
    if (atomic_exchange_explicit(&lk->state, LK_ORPHAN, memory_order_acq_rel) == LK_DONE)
        free(lk);
}

static void schedule_retry(node_t *n, uint64_t now);
static void connect_start(node_t *n, uint64_t now);

/* Takes n's lookup when its thread has finished: connects to the address found, or after a
 * failure to the last address the name had (the resolver may be what is down), or waits out
 * the backoff. */
static void lookup_take(node_t *n, uint64_t now)
{
    static kvt_log_limit_t lim;
    remote_t *rm = n->rm;
    lookup_t *lk = n->lookup;
    if (atomic_load_explicit(&lk->state, memory_order_acquire) != LK_DONE)
        return;
    n->lookup = NULL;
    if (lk->rc == 0) {
        if (strcmp(n->addr, lk->addr) || n->lookup_logged)
            kvt_log(KVT_LOG_INFO, "remote: %s resolved to %s", n->host, lk->addr);
        snprintf(n->addr, sizeof(n->addr), "%s", lk->addr);
        n->lookup_logged = 0;
        n->resolved = 1;
        free(lk);
        connect_start(n, now);
        return;
    }
    rm->stats.lookup_failures++;
    const char *why = lk->rc == EAI_SYSTEM ? strerror(lk->sys_errno) : gai_strerror(lk->rc);
    n->lookup_logged = 1;
    if (n->addr[0]) {
        kvt_log_limited(&lim, KVT_LOG_WARN,
                        "remote: cannot resolve %s: %s; trying its last address, %s", n->host, why,
                        n->addr);
        n->resolved = 1;
        free(lk);
        connect_start(n, now);
        return;
    }
    kvt_log_limited(&lim, KVT_LOG_WARN, "remote: cannot resolve %s: %s; retrying with backoff",
                    n->host, why);
    n->logged_down = 1;
    free(lk);
    schedule_retry(n, now);
}

/* A node down past its backoff: connects to its address, or looks its name up first (the node
 * stays down until the lookup is taken). Nothing here waits for a resolver. */
static void node_retry(node_t *n, uint64_t now)
{
    static kvt_log_limit_t lim;
    if (n->lookup)
        return;
    if (n->resolved) {
        connect_start(n, now);
        return;
    }
    int rc = lookup_start(n);
    if (rc) {
        kvt_log_limited(&lim, KVT_LOG_WARN, "remote: cannot start a lookup of %s: %s", n->host,
                        kvt_strerror(rc));
        schedule_retry(n, now);
    }
}

/* --- connection --- */

/* The next attempt in backoff x [0.75, 1.25): a fleet that lost one server does not come back
 * to it in lockstep. A name's address is looked up again for that attempt: the connection to
 * it failed or was lost, and the service may have moved. */
static void schedule_retry(node_t *n, uint64_t now)
{
    remote_t *rm = n->rm;
    n->resolved = n->numeric;
    rm->rng ^= rm->rng << 13, rm->rng ^= rm->rng >> 7, rm->rng ^= rm->rng << 17;
    uint64_t quarter = n->backoff_ns / 4;
    uint64_t jitter = quarter ? rm->rng % (2 * quarter) : 0;
    n->retry_ns = now + n->backoff_ns - quarter + jitter;
    n->backoff_ns = KVT_MIN(n->backoff_ns * 2, rm->backoff_max_ns);
}

static int wire_queue(node_t *n, rq_t *r);

/* Connects to n->addr, a numeric address (see "name lookups"): hiredis's getaddrinfo parses it
 * and asks no resolver. */
static void connect_start(node_t *n, uint64_t now)
{
    remote_t *rm = n->rm;
    kvt_assert(n->resolved && !n->lookup);
    n->ac_gone = 0;
    n->drop = 0;
    rm->stats.connect_attempts++;
    redisAsyncContext *ac = redisAsyncConnect(n->addr, n->port);
    if (!ac || ac->err) {
        if (!n->logged_down)
            kvt_log(KVT_LOG_WARN, "remote: connect %s:%d: %s", n->host, n->port,
                    ac ? ac->errstr : "out of memory");
        n->logged_down = 1;
        if (ac)
            redisAsyncFree(ac);
        rm->stats.connect_failures++;
        n->state = ST_DOWN;
        schedule_retry(n, now);
        return;
    }
    ac->data = n;
    ac->c.reader->fn = &rm->fns;
    ac->c.reader->privdata = n;
    ac->c.reader->maxbuf = 0; /* keep the read buffer: values are megabytes */
    n->sock = ac->c.fd;
    n->sock_events = n->sock_armed = 0;
    struct epoll_event ev = {.events = 0, .data.u32 = TAG_SOCK | (n->idx << 4)};
    if (epoll_ctl(rm->epfd, EPOLL_CTL_ADD, n->sock, &ev) < 0) {
        kvt_log(KVT_LOG_WARN, "remote: epoll_ctl add: %s", strerror(errno));
        n->sock = -1;
        redisAsyncFree(ac);
        rm->stats.connect_failures++;
        n->state = ST_DOWN;
        schedule_retry(n, now);
        return;
    }
    ac->ev.data = n;
    ac->ev.addRead = ev_add_read;
    ac->ev.delRead = ev_del_read;
    ac->ev.addWrite = ev_add_write;
    ac->ev.delWrite = ev_del_write;
    ac->ev.cleanup = ev_cleanup;
    redisAsyncSetConnectCallback(ac, on_connect);
    redisAsyncSetDisconnectCallback(ac, on_disconnect);
    n->ac = ac;
    n->state = ST_CONNECTING;
    n->hello_left = 0;

    /* The handshake: the server must answer before the connection counts as up (a stopped
     * server still accepts TCP connections). */
    int steps = rm->password ? 1 : 0;
    if (rm->db)
        steps |= 2;
    if (!steps)
        steps = 4;
    for (int s = 1; s <= 4; s <<= 1) {
        if (!(steps & s))
            continue;
        rq_t *r = rq_new(rm, RQ_HELLO);
        if (!r || format_hello(rm, r, s) || wire_queue(n, r)) {
            if (r)
                rq_release(rm, r);
            n->drop = 1;
            n->drop_status = KVT_EUNAVAIL;
            return;
        }
        r->link.deadline_ns = now + rm->timeout_ns;
        n->hello_left++;
    }
    sock_update(n);
}

/* After any call into hiredis: if it freed the context, the connection is down. */
static void after_hiredis(node_t *n, uint64_t now)
{
    remote_t *rm = n->rm;
    if (n->drop && n->ac && !n->ac_gone) {
        outq_clear(n);
        redisAsyncFree(n->ac); /* runs every pending callback with a NULL reply */
    }
    if (!n->ac || !n->ac_gone)
        return;
    int status = n->drop ? n->drop_status : KVT_EUNAVAIL;
    n->ac = NULL;
    n->sock = -1;
    n->drop = 0;
    n->skip = 0;
    n->dr = NULL;
    n->hello_left = 0;
    tree_free(n);
    kvt_assert(n->sentq.n == 0);
    map_stale(rm);
    if (n->state == ST_READY) {
        rm->stats.disconnects++;
        kvt_log(KVT_LOG_WARN, "remote: lost %s:%d; reconnecting with backoff", n->host, n->port);
    } else if (!n->logged_down) {
        kvt_log(KVT_LOG_WARN, "remote: cannot reach %s:%d; retrying with backoff", n->host,
                n->port);
    }
    n->logged_down = 1;
    n->state = ST_DOWN;
    rq_t *r;
    while ((r = q_pop(urgentq(n)))) {
        rq_fail(rm, r, status);
        rq_release(rm, r);
    }
    while ((r = q_pop(waitq(n)))) {
        if (r->kind == RQ_DEL && !r->io)
            q_push(&n->undoq, r); /* still worth sending once the server is back */
        else {
            rq_fail(rm, r, status);
            rq_release(rm, r);
        }
    }
    schedule_retry(n, now);
}

static void became_ready(node_t *n)
{
    remote_t *rm = n->rm;
    n->state = ST_READY;
    n->backoff_ns = rm->backoff_min_ns;
    rm->stats.connects++;
    if (n->logged_down)
        kvt_log(KVT_LOG_INFO, "remote: connected to %s:%d", n->host, n->port);
    n->logged_down = 0;
    /* Undo writes whose outcome was unknown before anything newer goes out. */
    kvt__ioq_fifo_prepend(waitq(n), &n->undoq);
}

/* Registers r's reply callback with hiredis and queues its formatted bytes for writing. Returns
 * 0 or an error (r not queued). */
static int wire_queue(node_t *n, rq_t *r)
{
    kvt_assert(sdslen(n->ac->c.obuf) == 0);
    /* Length 0: hiredis parses the command name from hb and appends nothing. */
    if (redisAsyncFormattedCommand(n->ac, on_reply, r, r->hb, 0) != REDIS_OK)
        return KVT_EUNAVAIL;
    r->sent_ns = kvt_now_ns();
    r->on = n;
    q_push(&n->sentq, r);
    kvt__ioq_started(&n->q); /* the window counts sentq */
    r->onext = NULL;
    r->in_outq = 1;
    if (n->out_tail)
        n->out_tail->onext = r;
    else
        n->out_head = r;
    n->out_tail = r;
    return 0;
}

static int send_rq(node_t *n, rq_t *r)
{
    remote_t *rm = n->rm;
    int rc = format_cmd(rm, r);
    if (rc)
        return rc;
    if (r->ask) {
        /* An ASK redirect: this node takes the key only on the command right after ASKING. */
        static const char *const asking[] = {"ASKING"};
        rq_t *a = rq_new(rm, RQ_ASKING);
        if (!a)
            return KVT_ENOMEM;
        if ((rc = format_words(a, 1, asking)) || (rc = wire_queue(n, a))) {
            rq_release(rm, a);
            return rc;
        }
        r->ask = 0;
    }
    return wire_queue(n, r);
}

/* Moves waiting requests (urgent ones first) to the connection while the window is open: fewer
 * than max_inflight unanswered. */
static void pump(node_t *n)
{
    remote_t *rm = n->rm;
    int queued = 0;
    while (n->state == ST_READY && n->ac && !n->ac_gone && !n->drop && kvt__ioq_next(&n->q)) {
        rq_t *r = rq_of(kvt__ioq_take(&n->q));
        if (rq_dead(r)) {
            rq_release(rm, r);
            continue;
        }
        int rc = send_rq(n, r);
        if (rc) {
            rq_fail(rm, r, rc);
            rq_release(rm, r);
            continue;
        }
        queued = 1;
    }
    if (queued)
        sock_update(n);
}

static uint64_t rq_bytes(const rq_t *r)
{
    return (uint64_t)r->hblen + r->paylen + r->taillen;
}

/* Writes queued command bytes until the socket is full. */
static void flush(node_t *n)
{
    while (n->out_head && !n->drop) {
        struct iovec iov[KVT__IOV];
        int k = 0;
        for (rq_t *r = n->out_head; r && k + 3 <= KVT__IOV; r = r->onext) {
            const char *part[3] = {r->hb, (const char *)r->pay, r->tail};
            uint64_t plen[3] = {r->hblen, r->paylen, r->taillen};
            uint64_t off = r->off;
            for (int j = 0; j < 3; j++) {
                if (off >= plen[j]) {
                    off -= plen[j];
                    continue;
                }
                iov[k].iov_base = (void *)(part[j] + off);
                iov[k].iov_len = plen[j] - off;
                k++;
                off = 0;
            }
        }
        struct msghdr msg = {.msg_iov = iov, .msg_iovlen = (size_t)k};
        ssize_t w = sendmsg(n->sock, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            if (errno != EAGAIN && errno != EWOULDBLOCK) {
                n->drop = 1; /* the read side sees the same error; close now */
                n->drop_status = KVT_EUNAVAIL;
            }
            break;
        }
        uint64_t left = (uint64_t)w;
        while (left && n->out_head) {
            rq_t *r = n->out_head;
            uint64_t rem = rq_bytes(r) - r->off;
            if (left < rem) {
                r->off += left;
                break;
            }
            left -= rem;
            r->off += rem;
            r->in_outq = 0;
            n->out_head = r->onext;
            if (!n->out_head)
                n->out_tail = NULL;
            r->onext = NULL;
        }
    }
    sock_update(n);
}

/* --- the slot map --- */

static void map_set(remote_t *rm, uint32_t slot, node_t *n)
{
    uint8_t old = rm->map[slot];
    if (old != 0xff)
        rm->nodes[old]->owned--;
    rm->map[slot] = (uint8_t)n->idx;
    n->owned++;
}

static int rq_urgent(const rq_t *r)
{
    return r->kind == RQ_EXISTS || (r->kind == RQ_GET && r->io && r->io->urgent);
}

/* Queues r on node n (not sent yet: pump does that). */
static void node_queue(node_t *n, rq_t *r)
{
    r->on = n;
    kvt__ioq_push(&n->q, &r->link, rq_urgent(r));
}

static kvt_log_limit_t map_lim;

/* Applies a CLUSTER SLOTS reply from node from: each entry is [start, end, [host, port, id,
 * ...] (the primary), replicas...]. Anything malformed leaves the map as it was. Returns 0 or
 * KVT_EPROTO. */
static int map_apply(node_t *from, const redisReply *rep)
{
    remote_t *rm = from->rm;
    uint8_t m[16384];
    memset(m, 0xff, sizeof(m));
    const char *why = NULL;
    if (!rep || rep->type != REDIS_REPLY_ARRAY)
        why = rep && rep->type == REDIS_REPLY_ERROR ? rep->str : "not an array";
    for (size_t i = 0; !why && i < rep->elements; i++) {
        const redisReply *e = rep->element[i];
        if (!e || e->type != REDIS_REPLY_ARRAY || e->elements < 3 ||
            e->element[0]->type != REDIS_REPLY_INTEGER ||
            e->element[1]->type != REDIS_REPLY_INTEGER) {
            why = "an entry is not [start, end, primary]";
            break;
        }
        long long lo = e->element[0]->integer, hi = e->element[1]->integer;
        const redisReply *pr = e->element[2];
        if (lo < 0 || hi > 16383 || lo > hi) {
            why = "a slot range out of 0..16383";
            break;
        }
        if (pr->type != REDIS_REPLY_ARRAY || pr->elements < 2 ||
            pr->element[0]->type != REDIS_REPLY_STRING ||
            pr->element[1]->type != REDIS_REPLY_INTEGER || pr->element[1]->integer <= 0 ||
            pr->element[1]->integer > 65535 || pr->element[0]->len > 255) {
            why = "a primary is not [host, port, ...]";
            break;
        }
        /* An empty host (or "?") means "the address you reached me at" */
        const char *host = pr->element[0]->str;
        if (!host[0] || !strcmp(host, "?"))
            host = from->host;
        node_t *to = node_get(rm, host, (int)pr->element[1]->integer);
        if (!to) {
            why = "more nodes than this tier follows (64)";
            break;
        }
        for (long long k = lo; k <= hi; k++)
            m[k] = (uint8_t)to->idx;
    }
    if (why) {
        rm->stats.map_errors++;
        kvt_log_limited(&map_lim, KVT_LOG_WARN, "remote: %s:%d sent a slot map we cannot use: %s",
                        from->host, from->port, why);
        return KVT_EPROTO;
    }
    uint32_t owned[KVT__NODES_MAX] = {0};
    for (uint32_t k = 0; k < 16384; k++)
        if (m[k] != 0xff)
            owned[m[k]]++;
    for (uint32_t i = 0; i < rm->nnodes; i++) {
        node_t *n = rm->nodes[i];
        /* A primary that was lost and whose slots another node now serves: its replica was
         * promoted (or its slots were moved while it was away). */
        if (n->owned && !owned[i] && n->state != ST_READY) {
            rm->stats.failovers++;
            n->st.failovers++;
            kvt_log(KVT_LOG_WARN, "remote: %s:%d is gone from the slot map: failed over", n->host,
                    n->port);
        }
        n->owned = owned[i];
    }
    memcpy(rm->map, m, sizeof(m));
    rm->map_known = 1;
    rm->map_stale = 0;
    rm->stats.map_refreshes++;
    from->st.map_refreshes++;
    /* DELs held for a node that no longer owns anything go where their keys live now. */
    for (uint32_t i = 0; i < rm->nnodes; i++) {
        node_t *n = rm->nodes[i];
        if (n->owned || n->state == ST_READY)
            continue;
        rq_t *r;
        while ((r = q_pop(&n->undoq))) {
            node_t *to = route(rm, r);
            if (!to) {
                rq_release(rm, r);
                continue;
            }
            if (to == n || (to->state == ST_DOWN && !to->ac)) {
                q_push(&to->undoq, r);
                if (to == n)
                    break;
            } else {
                node_queue(to, r);
            }
        }
    }
    return 0;
}

/* Asks a node that is up for the slot map, at most every KVT__MAP_GAP_NS. */
static void map_refresh(remote_t *rm, uint64_t now)
{
    if (!rm->cluster || !rm->map_stale || rm->map_inflight || now < rm->map_next_ns)
        return;
    for (uint32_t k = 0; k < rm->nnodes; k++) {
        node_t *n = rm->nodes[(rm->map_rr + k) % rm->nnodes];
        if (n->state != ST_READY || !n->ac || n->ac_gone || n->drop)
            continue;
        static const char *const slots[] = {"CLUSTER", "SLOTS"};
        rq_t *r = rq_new(rm, RQ_SLOTS);
        if (!r)
            return;
        if (format_words(r, 2, slots) || wire_queue(n, r)) {
            rq_release(rm, r);
            return;
        }
        sock_update(n);
        rm->map_rr = n->idx + 1;
        rm->map_inflight = 1;
        rm->map_next_ns = now + KVT__MAP_GAP_NS;
        return;
    }
}

/* "HOST:PORT" as a redirect names it: split at the last colon, since the server writes an IPv6
 * address without brackets. host holds 256 bytes. Returns 0 or KVT_EINVAL. */
static int split_addr(const char *s, char *host, uint16_t *port)
{
    const char *colon = strrchr(s, ':');
    if (!colon || colon == s || (size_t)(colon - s) > 255)
        return KVT_EINVAL;
    char *end;
    errno = 0;
    unsigned long p = strtoul(colon + 1, &end, 10);
    if (errno || end == colon + 1 || *end || p == 0 || p > 65535)
        return KVT_EINVAL;
    for (const char *c = s; c < colon; c++)
        if (*c <= ' ' || *c == 0x7f)
            return KVT_EINVAL;
    memcpy(host, s, (size_t)(colon - s));
    host[colon - s] = 0;
    *port = (uint16_t)p;
    return 0;
}

/*
 * A MOVED or ASK error in reply to r, from node from: r goes to the node it names (a MOVED also
 * teaches the map that slot and asks for a whole refresh). Returns 0 when r was queued there,
 * or the status to fail r with: KVT_EIO for a redirect that cannot be followed (not in cluster
 * mode, a garbled address, more than KVT__REDIRECTS for one request, no room for another
 * node), KVT_EUNAVAIL when the node named is down.
 */
static int redirect(node_t *from, rq_t *r, const char *msg)
{
    static kvt_log_limit_t lim;
    remote_t *rm = from->rm;
    int ask = msg[0] == 'A';
    const char *p = msg + (ask ? 4 : 6);
    char *end;
    char host[256];
    uint16_t port = 0;
    unsigned long slot = strtoul(p, &end, 10);
    int ok = end != p && *end == ' ' && slot < 16384 && split_addr(end + 1, host, &port) == 0;
    if (ask)
        rm->stats.asks++, from->st.asks++;
    else
        rm->stats.moved++, from->st.moved++;
    map_stale(rm);
    node_t *to = NULL;
    const char *why = !rm->cluster                       ? "a cluster node: set remote-cluster"
                      : !ok                              ? "not a slot and an address"
                      : r->redirects >= KVT__REDIRECTS   ? "too many redirects"
                      : !(to = node_get(rm, host, port)) ? "too many nodes"
                                                         : NULL;
    if (why) {
        rm->stats.redirect_errors++;
        kvt_log_limited(&lim, KVT_LOG_WARN, "remote: %s:%d answered \"%s\": %s; a miss", from->host,
                        from->port, msg, why);
        return KVT_EIO;
    }
    r->redirects++;
    if (!ask)
        map_set(rm, (uint32_t)slot, to);
    if (to->state == ST_DOWN && !to->ac && kvt_now_ns() >= to->retry_ns)
        node_retry(to, kvt_now_ns());
    if (to->state == ST_DOWN)
        return KVT_EUNAVAIL;
    r->ask = (uint8_t)ask;
    node_queue(to, r);
    return 0;
}

static void on_reply(redisAsyncContext *ac, void *reply, void *privdata)
{
    node_t *n = ac->data;
    remote_t *rm = n->rm;
    rq_t *r = privdata;
    kvt_assert(rq_of(n->sentq.head) == r);
    q_pop(&n->sentq);
    kvt__ioq_finished(&n->q);
    remote_reply_t *o = reply;
    if (r->in_outq) {
        /* Not all written: the connection is going away (no reply), or the server answered a
         * command it had not fully received, and the stream is out of step. */
        if (n->out_head == r) {
            n->out_head = r->onext;
            if (!n->out_head)
                n->out_tail = NULL;
            r->in_outq = 0;
        } else {
            outq_clear(n);
        }
        if (o) {
            n->drop = 1;
            n->drop_status = KVT_EPROTO;
        }
    }
    if (r->kind == RQ_SLOTS) { /* reply is hiredis's own tree (reply_tree), or NULL */
        rm->map_inflight = 0;
        if (!reply || n->drop || map_apply(n, reply) < 0)
            rm->map_stale = 1;
        tree_free(n);
        rq_release(rm, r);
        return;
    }
    if (!o) { /* the connection is going away */
        if (r->kind == RQ_SET)
            undo_set(rm, r, 0);
        rq_fail(rm, r, n->drop ? n->drop_status : KVT_EUNAVAIL);
        rq_release(rm, r);
        return;
    }
    int type = o->r.type;
    if (type == REDIS_REPLY_ERROR && r->kind <= RQ_EXISTS &&
        (!strncmp(o->msg, "MOVED ", 6) || !strncmp(o->msg, "ASK ", 4))) {
        if (rq_dead(r)) {
            rq_release(rm, r);
            return;
        }
        int st = redirect(n, r, o->msg);
        if (st == 0)
            return; /* r is queued on another node */
        rq_fail(rm, r, st);
        rq_release(rm, r);
        return;
    }
    int err = type == REDIS_REPLY_ERROR ? map_error(o->msg, r->kind) : 0;
    switch (r->kind) {
    case RQ_HELLO:
        if (err) {
            if (!n->logged_down)
                kvt_log(KVT_LOG_ERROR, "remote: %s:%d refused the handshake: %s; retrying", n->host,
                        n->port, o->msg);
            n->logged_down = 1;
            n->drop = 1;
            n->drop_status = err == KVT_EAUTH ? KVT_EAUTH : KVT_EUNAVAIL;
            rm->stats.auth_failures += err == KVT_EAUTH;
        } else if (--n->hello_left == 0 && !n->drop) {
            became_ready(n);
        }
        break;
    case RQ_ASKING:
    case RQ_SLOTS:
        break;
    case RQ_SET:
        if (!r->io) { /* timed out before the server answered */
            if (!err && type == REDIS_REPLY_STATUS) {
                rm->stats.late_replies++;
                undo_set(rm, r, 1);
            }
            break;
        }
        if (!err && type != REDIS_REPLY_STATUS)
            err = KVT_EPROTO;
        if (err) {
            rq_fail(rm, r, err);
            break;
        }
        rm->slots[r->slot].used = 1;
        rm->slots[r->slot].seed = r->seed;
        rm->slots[r->slot].hash = r->hash;
        r->io->loc = slot_loc(rm, r->slot);
        r->slot = UINT32_MAX;
        kvt__tier_complete(rm->tier, r->io, 0);
        r->io = NULL;
        break;
    case RQ_GET: {
        if (!r->io) {
            rm->stats.late_replies++;
            break;
        }
        int st;
        if (err)
            st = err;
        else if (type == REDIS_REPLY_NIL)
            st = KVT_ENOENT;
        else if (type == REDIS_REPLY_STRING)
            st = o->status;
        else
            st = KVT_EPROTO;
        if (st == KVT_ENOENT || st == KVT_ECORRUPT)
            loc_gone(rm, r->io->loc, r->seed, r->hash);
        /* As every tier: a miss never hands out bytes (a refused value read in place). */
        if (st < 0)
            memset(r->io->buf, 0, r->io->len);
        if (st == 0)
            n->st.hits++;
        else if (st == KVT_ENOENT)
            n->st.misses++;
        else
            n->st.errors++;
        r->io->src = n->idx; /* whose hit a failed check of its payload takes back */
        kvt__tier_complete(rm->tier, r->io, st);
        r->io = NULL;
        break;
    }
    case RQ_EXISTS: {
        kvt_tier_probe_t *p = r->probe;
        if (!p)
            break;
        if (err || type != REDIS_REPLY_INTEGER) {
            n->st.errors++;
            probe_finish(rm, p, err ? err : KVT_EPROTO);
            break;
        }
        if (o->r.integer == 0 && r->idx < p->first_missing)
            p->first_missing = r->idx;
        r->probe = NULL;
        if (--p->pending == 0)
            probe_finish(rm, p, 0);
        break;
    }
    case RQ_DEL:
        break;
    }
    rq_release(rm, r);
}

static int rq_gone(const kvt__ioq_link_t *l)
{
    return rq_dead(KVT__IOQ_OF(l, const rq_t, link));
}

/* A waiting request past its deadline (expired), or one nobody waits for any more. DELs nobody
 * waits for have no deadline: they never expire. */
static void rq_expired(void *arg, kvt__ioq_link_t *l, int expired)
{
    remote_t *rm = arg;
    rq_t *r = rq_of(l);
    if (expired) {
        rm->stats.timeouts++;
        rq_fail(rm, r, KVT_ETIMEDOUT);
    }
    rq_release(rm, r);
}

/* Fails requests past their deadline; closes a stalled connection; returns the next deadline. */
static uint64_t expire(node_t *n, uint64_t now)
{
    remote_t *rm = n->rm;
    uint64_t timeouts = rm->stats.timeouts;
    uint64_t next = kvt__ioq_expire(&n->q, now, rq_gone, rq_expired, rm);
    /* sentq is not in deadline order (urgent requests passed others): all of it is looked at,
     * at most max_inflight requests. */
    for (rq_t *r = rq_of(n->sentq.head); r; r = rq_next(r)) {
        if (!r->io && !r->probe && r->kind != RQ_HELLO)
            continue;
        if (r->link.deadline_ns > now) {
            next = KVT_MIN(next, r->link.deadline_ns);
            continue;
        }
        if (r->kind == RQ_HELLO) {
            n->drop = 1;
            n->drop_status = KVT_EUNAVAIL;
            continue;
        }
        rm->stats.timeouts++;
        rq_fail(rm, r, KVT_ETIMEDOUT); /* r stays queued, detached, until its reply */
    }
    rq_t *h = rq_of(n->sentq.head);
    if (h) {
        uint64_t stall = h->sent_ns + 2 * rm->timeout_ns;
        if (stall <= now && !n->drop) {
            kvt_log(KVT_LOG_WARN, "remote: %s:%d has not answered for %llu ms; closing", n->host,
                    n->port, (unsigned long long)((now - h->sent_ns) / 1000000));
            n->drop = 1;
            n->drop_status = KVT_EUNAVAIL;
        }
        next = KVT_MIN(next, stall);
    }
    if (rm->stats.timeouts != timeouts)
        map_stale(rm); /* a node that stopped answering may have been failed over */
    return next;
}

/* Sets the timerfd to fire at the absolute monotonic time at (UINT64_MAX: disarm). */
static void arm_timer(remote_t *rm, uint64_t at)
{
    if (at == rm->timer_armed_ns)
        return;
    struct itimerspec its = {0};
    if (at != UINT64_MAX) {
        at = KVT_MAX(at, 1); /* 0 would disarm */
        its.it_value.tv_sec = (time_t)(at / 1000000000u);
        its.it_value.tv_nsec = (long)(at % 1000000000u);
    }
    if (timerfd_settime(rm->tfd, TFD_TIMER_ABSTIME, &its, NULL) < 0) {
        kvt_log(KVT_LOG_WARN, "remote: timerfd_settime: %s", strerror(errno));
        return;
    }
    rm->timer_armed_ns = at;
}

/* Runs every time-driven step and rearms the timer; the tail of each entry point. */
/*
 * Whether a disconnected node is worth connecting to: the single server always; a cluster node
 * when the map gives it slots or requests wait for it, and every node (seeds first among them)
 * while no node at all is up or on its way up, to learn the map from.
 */
static int node_wanted(const node_t *n, int any_up)
{
    return !n->rm->cluster || n->owned || kvt__ioq_waiting(&n->q) || n->undoq.n || !any_up;
}

static void tick(remote_t *rm)
{
    uint64_t now = kvt_now_ns();
    uint64_t next = UINT64_MAX;
    int any_up = 0;
    for (uint32_t i = 0; i < rm->nnodes; i++)
        any_up |= rm->nodes[i]->state != ST_DOWN;
    for (uint32_t i = 0; i < rm->nnodes; i++) {
        node_t *n = rm->nodes[i];
        int wanted = node_wanted(n, any_up);
        if (n->lookup)
            lookup_take(n, now);
        if (n->state == ST_DOWN && !n->ac && now >= n->retry_ns && wanted)
            node_retry(n, now);
        after_hiredis(n, now);
        pump(n);
        uint64_t nx = expire(n, now);
        if (n->drop) {
            after_hiredis(n, now);
            nx = expire(n, now);
        }
        /* A lookup in flight needs no timer: its thread's eventfd write wakes the poll. */
        if (n->state == ST_DOWN && !n->ac && !n->lookup && wanted)
            nx = KVT_MIN(nx, n->retry_ns);
        next = KVT_MIN(next, nx);
    }
    if (rm->cluster) {
        for (uint32_t i = 0; i < rm->nnodes; i++)
            if (rm->nodes[i]->owned && rm->nodes[i]->state != ST_READY)
                map_stale(rm); /* until the map names who serves its slots now */
        map_refresh(rm, now);
        if (rm->map_stale && !rm->map_inflight)
            next = KVT_MIN(next, KVT_MAX(rm->map_next_ns, now + 1000000));
    }
    arm_timer(rm, next);
}

/* --- the backend ops --- */

static uint64_t remote_footprint(const kvt_tier_t *t, uint32_t len)
{
    (void)t;
    return (uint64_t)len + kvt__blockhdr_size(KVT_PAGE_MAX);
}

/* Queues a caller's request. Returns 0, or KVT_EUNAVAIL while the server is known to be down
 * (waiting out the backoff): failing fast beats queueing work behind a dead server. */
static int submit(remote_t *rm, rq_t *r)
{
    uint64_t now = kvt_now_ns();
    node_t *n = route_up(rm, r, now);
    if (!n) {
        rm->stats.unavailable++;
        if ((n = route(rm, r)))
            n->st.errors++; /* refused at once: its node is down */
        return KVT_EUNAVAIL;
    }
    uint64_t deadline = now + rm->timeout_ns;
    r->link.deadline_ns = deadline;
    node_queue(n, r);
    pump(n); /* may send r, and even free it */
    if (deadline < rm->timer_armed_ns)
        arm_timer(rm, deadline);
    return 0;
}

static int check_key(const kvt_block_key_t *key)
{
    if (key->ntokens > KVT_PAGE_MAX || (key->ntokens && !key->tokens))
        return KVT_EINVAL;
    return 0;
}

static int remote_write(kvt_tier_t *t, kvt_tier_io_t *io)
{
    remote_t *rm = remote_of(t);
    if (!io->buf || io->len == 0 || check_key(&io->key))
        return KVT_EINVAL;
    rq_t *r = rq_new(rm, RQ_SET);
    if (!r)
        return KVT_ENOMEM;
    int rc = slot_reserve(rm, &r->slot);
    if (rc) {
        rq_release(rm, r);
        return rc;
    }
    r->io = io;
    rq_name(rm, r, io->key.ns_seed, io->key.hash);
    rc = submit(rm, r);
    if (rc) {
        slot_unreserve(rm, r->slot);
        rq_release(rm, r);
    }
    return rc;
}

static int remote_read(kvt_tier_t *t, kvt_tier_io_t *io)
{
    remote_t *rm = remote_of(t);
    if (!io->buf || io->len == 0 || check_key(&io->key))
        return KVT_EINVAL;
    rq_t *r = rq_new(rm, RQ_GET);
    if (!r)
        return KVT_ENOMEM;
    r->io = io;
    rq_name(rm, r, io->key.ns_seed, io->key.hash);
    int rc = submit(rm, r);
    if (rc)
        rq_release(rm, r);
    return rc;
}

static void remote_free(kvt_tier_t *t, uint64_t loc, uint32_t len)
{
    remote_t *rm = remote_of(t);
    (void)len;
    uint32_t slot = loc_slot(rm, loc);
    if (slot == UINT32_MAX)
        return;
    uint64_t seed = rm->slots[slot].seed, hash = rm->slots[slot].hash;
    slot_unreserve(rm, slot);
    if (rm->keep_on_free)
        return;
    rq_t *r = rq_new(rm, RQ_DEL);
    if (!r)
        return;
    rq_name(rm, r, seed, hash);
    node_t *n = route(rm, r);
    if (!n) { /* no owner known: the key stays (the daemon keeps keys anyway: keep_on_free) */
        rq_release(rm, r);
        return;
    }
    r->on = n;
    if (n->state == ST_DOWN) {
        if (n->undoq.n < KVT__UNDO_MAX)
            q_push(&n->undoq, r);
        else
            rq_release(rm, r);
        return;
    }
    q_push(waitq(n), r); /* no deadline: a DEL nobody waits for */
    pump(n);
}

/*
 * A read that completed 0 with its payload's checksum left to its caller (check_later) and failed
 * it there (kvt_tier_read_corrupt, under whatever serialises the tier's calls: the daemon's write
 * lock). It ends as one whose value failed at completion (on_reply's RQ_GET): the node that
 * answered counts an error instead of its hit, and the location is dropped unless it no longer
 * names the block (freed since: then there is nothing of ours left to drop).
 */
static void remote_read_corrupt(kvt_tier_t *t, const kvt_tier_io_t *io)
{
    remote_t *rm = remote_of(t);
    kvt_assert(io->src < rm->nnodes);
    node_t *n = rm->nodes[io->src];
    kvt_assert(n->st.hits > 0);
    n->st.hits--;
    n->st.errors++;
    loc_gone(rm, io->loc, io->key.ns_seed, io->key.hash);
}

static int remote_valid(kvt_tier_t *t, uint64_t loc, const kvt_block_key_t *key)
{
    remote_t *rm = remote_of(t);
    uint32_t slot = loc_slot(rm, loc);
    return slot != UINT32_MAX && rm->slots[slot].hash == key->hash &&
           rm->slots[slot].seed == key->ns_seed;
}

static int remote_fd(kvt_tier_t *t)
{
    return remote_of(t)->epfd;
}

/*
 * A GET value longer than the block asked for (a key of ours that something else overwrote, a
 * daemon configured with bigger blocks) would otherwise be buffered whole before being refused:
 * up to the server's 512 MiB string limit per request. Once hiredis has started on the reply at
 * the head of sentq, a GET's, and stopped for want of bytes, the reader holds "<length>\r\n" and
 * the value's first bytes at its cursor (the '$' consumed, ridx 0). When that length is over the
 * one expected, the reply is cut to an empty string, which the decoder refuses as corrupt as it
 * refuses any value of the wrong size, and the rest of the value is read off the socket into a
 * scratch buffer and dropped (n->skip) before hiredis sees another byte.
 */
static void cut_oversized(node_t *n)
{
    remote_t *rm = n->rm;
    redisReader *rd = n->ac->c.reader;
    rq_t *h = rq_of(n->sentq.head);
    if (n->skip || !h || h->kind != RQ_GET || rd->ridx != 0 || rd->pos >= rd->len)
        return;
    const char *p = rd->buf + rd->pos, *end = rd->buf + rd->len;
    uint64_t len = 0;
    int digits = 0;
    for (; p < end && *p >= '0' && *p <= '9' && digits < 19; p++, digits++)
        len = len * 10 + (uint64_t)(*p - '0');
    if (digits == 0 || end - p < 2 || p[0] != '\r' || p[1] != '\n' || len <= h->vlen)
        return;
    uint64_t have = (uint64_t)(end - (p + 2)); /* value bytes already read, fewer than len + 2 */
    sds buf = sdsMakeRoomFor(rd->buf, 5);
    if (!rm->scratch)
        rm->scratch = malloc(KVT__READ_MIN);
    if (!buf || !rm->scratch) {
        if (buf)
            rd->buf = buf;
        n->drop = 1; /* cannot even cut it: the connection goes, its requests fail */
        n->drop_status = KVT_EUNAVAIL;
        return;
    }
    n->skip = len + 2 - have;
    rm->stats.oversized++;
    rm->stats.skipped_bytes += len;
    static kvt_log_limit_t lim; /* a keyspace overwritten by someone else: every read */
    kvt_log_limited(&lim, KVT_LOG_WARN,
                    "remote: a value of %llu bytes under a key of ours, where a block "
                    "is %llu: refused, and dropped as it arrives",
                    (unsigned long long)len, (unsigned long long)h->vlen);
    rd->buf = buf;
    memcpy(buf + rd->pos, "0\r\n\r\n", 5);
    sdssetlen(buf, rd->pos + 5);
    rd->len = rd->pos + 5;
}

/* Drops up to n->skip bytes from the socket. Returns the bytes dropped; 0 when it had none. At
 * EOF or on an error the connection is dropped: the value can never end, and hiredis, which would
 * find the EOF, is not called while bytes are skipped (the socket stayed readable, the loop spun
 * on it until the request timed out). */
static ssize_t skip_more(node_t *n)
{
    remote_t *rm = n->rm;
    ssize_t got = read(n->sock, rm->scratch, (size_t)KVT_MIN(n->skip, (uint64_t)KVT__READ_MIN));
    if (got == 0 || (got < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
        n->drop = 1;
        n->drop_status = KVT_EUNAVAIL;
        return 0;
    }
    if (got < 0)
        return 0;
    n->skip -= (uint64_t)got;
    return got;
}

/*
 * A big GET value is read from the socket straight into the caller's buffer (io->buf), not into
 * hiredis's reader buffer first: the kernel's copy lands in place, the check (XXH3 over the block
 * header, the tokens and the payload) runs over io->buf, and no copy out follows. Three passes
 * over each value become two (bench_tiers' cluster reads, docs/remote.md).
 *
 * It starts where the reply at the head of sentq, the GET's, begins in the reader's unparsed
 * bytes with "$<the length asked for>\r\n" and the value has not all arrived: the block header
 * and tokens go to n->dhdr, the payload to io->buf, the reader's buffer is cut back to where the
 * reply began and given the stand-in head "$0\r\n" (or "0\r\n" when hiredis has consumed the
 * '$'). hiredis is not called while the value comes in (its own reads would take the value's
 * bytes); once the header and payload are whole, the check's outcome is left in r->dstatus, the
 * value's "\r\n" is read in behind the stand-in head, and hiredis
 * decodes an empty string for the GET, which reply_string answers with r->dstatus. A caller that
 * gives up meanwhile (a timeout) gets its buffer back at once: the rest of the value is dropped
 * as n->skip drops an oversized one.
 *
 * io->buf holds the value's bytes before the check has passed, and refused ones after it failed.
 * No caller reads them before the completion says 0 (docs/remote.md, "no refused byte is ever
 * served or published": a client's GET frames a batch only once its reads are done and only up
 * to the first failure, a move reads into a staging buffer written to its destination tier only
 * on success).
 */
#define KVT__DIRECT_MIN (16u << 10) /* smaller values: one read takes many, copied out */

/* What hiredis has consumed of the head reply when it may be taken over: 0 (nothing: its cursor
 * is at the '$') or 1 (the '$'); -1 when it may not (not a big GET, already taken, further
 * along). */
static int direct_ok(node_t *n, const rq_t *h)
{
    redisReader *rd = n->ac->c.reader;
    if (n->skip || n->dr || !h || h->kind != RQ_GET || !h->io || h->direct ||
        h->io->len < KVT__DIRECT_MIN || h->in_outq)
        return -1;
    if (rd->ridx == -1 || (rd->ridx == 0 && rd->rstack[0].type == -1))
        return 0;
    if (rd->ridx == 0 && rd->rstack[0].type == REDIS_REPLY_STRING)
        return 1;
    return -1;
}

/* The value is whole: checked where it lies, the outcome kept for reply_string. */
static void direct_done(node_t *n)
{
    rq_t *r = n->dr;
    kvt_tier_io_t *io = r->io;
    uint32_t hb = (uint32_t)(r->vlen - io->len);
    kvt__blockhdr_info_t in;
    int rc = kvt__blockhdr_peek(n->dhdr, hb, &in);
    if (rc == 0 && in.hdr_bytes != hb)
        rc = KVT_ECORRUPT; /* a header naming another page size: not this block's layout */
    if (rc == 0)
        rc = kvt__tier_read_verify(io, n->dhdr, hb, io->buf); /* or left to a shared GET */
    r->dstatus = rc == 0 ? 0 : KVT_ECORRUPT;
    n->dr = NULL;
}

/*
 * Takes the head reply over when it may be (see above). inbuf: bytes a read_more put in io->buf
 * after the reader's (the value's first payload bytes if the head is what it should be); handed
 * back to the reader when it is not. Returns 1 when taken over.
 */
static int direct_begin(node_t *n, size_t inbuf)
{
    redisReader *rd = n->ac->c.reader;
    rq_t *h = rq_of(n->sentq.head);
    int c = direct_ok(n, h);
    char pre[32];
    int plen = c < 0 ? 0 : snprintf(pre, sizeof(pre), "$%llu\r\n", (unsigned long long)h->vlen);
    size_t have = rd->len - rd->pos;
    const char *p = rd->buf + rd->pos;
    if (c < 0 || have + (size_t)c < (size_t)plen || memcmp(p, pre + c, (size_t)plen - c) != 0)
        goto back;
    size_t inrd = have - ((size_t)plen - c); /* value bytes in the reader */
    uint64_t hb = h->vlen - h->io->len;
    if (!inbuf && inrd >= h->vlen)
        goto back; /* all here already: hiredis decodes it, checked and copied in one pass */
    if (!n->dhdr && !(n->dhdr = malloc(kvt__blockhdr_size(KVT_PAGE_MAX))))
        goto back;
    const char *v = p + (plen - c);
    memcpy(n->dhdr, v, (size_t)KVT_MIN((uint64_t)inrd, hb));
    if (inrd > hb) {
        memcpy(h->io->buf, v + hb, inrd - hb); /* only with inbuf 0: read_more stops at hb */
        n->rm->stats.direct_copied += inrd - hb;
    }
    /* The stand-in head where the reply began; the value's bytes there need at least its room. */
    memcpy(rd->buf + rd->pos, &"$0\r\n"[c], 4 - (size_t)c);
    sdssetlen(rd->buf, rd->pos + 4 - c);
    rd->len = sdslen(rd->buf);
    h->direct = 1;
    n->dr = h;
    n->dr_off = inrd + inbuf;
    n->rm->stats.direct_reads++;
    if (n->dr_off == h->vlen)
        direct_done(n);
    return 1;
back:
    if (inbuf) {
        sds b = sdscatlen(rd->buf, h->io->buf, inbuf);
        if (!b) {
            n->drop = 1; /* the stream lost bytes: the connection goes, its requests fail */
            n->drop_status = KVT_EUNAVAIL;
            return 0;
        }
        rd->buf = b;
        rd->len = sdslen(b);
    }
    return 0;
}

/* Reads more of the value being taken (n->dr): the header, the payload, then its "\r\n" into
 * the reader behind the stand-in head. Returns the bytes read; 0 when the socket had none. */
static ssize_t direct_more(node_t *n)
{
    remote_t *rm = n->rm;
    redisReader *rd = n->ac->c.reader;
    rq_t *r = n->dr;
    if (!r->io) { /* timed out: io->buf is its caller's again; the rest is dropped */
        if (!rm->scratch && !(rm->scratch = malloc(KVT__READ_MIN))) {
            n->drop = 1;
            n->drop_status = KVT_EUNAVAIL;
            return 0;
        }
        n->skip = r->vlen - n->dr_off;
        n->dr = NULL;
        return 1;
    }
    kvt_tier_io_t *io = r->io;
    uint64_t hb = r->vlen - io->len;
    struct iovec iov[3];
    int k = 0;
    if (n->dr_off < hb)
        iov[k++] = (struct iovec){n->dhdr + n->dr_off, (size_t)(hb - n->dr_off)};
    uint64_t po = n->dr_off > hb ? n->dr_off - hb : 0;
    iov[k++] = (struct iovec){(uint8_t *)io->buf + po, (size_t)(io->len - po)};
    sds buf = sdsMakeRoomFor(rd->buf, KVT__READ_MIN);
    if (!buf) {
        n->drop = 1;
        n->drop_status = KVT_EUNAVAIL;
        return 0;
    }
    rd->buf = buf;
    iov[k++] = (struct iovec){buf + sdslen(buf), 2}; /* the value's "\r\n" (see read_more) */
    ssize_t got = readv(n->sock, iov, k);
    if (got == 0 || (got < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
        n->drop = 1; /* closed or failed mid-value */
        n->drop_status = KVT_EUNAVAIL;
        return 0;
    }
    if (got < 0)
        return 0;
    uint64_t need = r->vlen - n->dr_off;
    if ((uint64_t)got < need) {
        n->dr_off += (uint64_t)got;
        return got;
    }
    sdsIncrLen(buf, (ssize_t)((uint64_t)got - need));
    rd->len = sdslen(buf);
    n->dr_off = r->vlen;
    direct_done(n);
    return got;
}

/* Whether r is a GET whose value direct_begin may read in place (big enough, still wanted). */
static int direct_candidate(const rq_t *r)
{
    return r && r->kind == RQ_GET && r->io && !r->direct && r->io->len >= KVT__DIRECT_MIN;
}

/* The reply bytes, as expected, of the GETs queued behind h before the next one direct_begin may
 * read in place; UINT64_MAX when no such GET follows with only GETs between (another reply's
 * length is not known ahead). */
static uint64_t bytes_before_direct(const rq_t *h)
{
    uint64_t sum = 0;
    int i = 0;
    for (const rq_t *r = rq_next(h); r && i < 64; r = rq_next(r), i++) {
        if (direct_candidate(r))
            return sum;
        if (r->kind != RQ_GET)
            break;
        sum += r->expect;
    }
    return UINT64_MAX;
}

/*
 * Reads into hiredis's reader buffer directly; hiredis itself reads nothing while the connection
 * is up (handle_sock hands it the bytes through redisProcessCallbacks), so every byte read is
 * sized here, and a read never runs into a value that is to be read in place:
 *
 *   - the head of sentq a big GET not yet begun: its reply head, block header and tokens into
 *     the reader, the payload into io->buf in the same readv (direct_begin decides whether it
 *     stays there);
 *   - the head a big GET whose value is in: only the bytes of its "\r\n" still missing, none
 *     when it is whole (the next reply is read once this one is decoded, by the case above);
 *   - the head another GET: what its reply still needs, at least KVT__READ_MIN (one read takes
 *     many small values), but not past the start of a big GET's reply queued behind it
 *     (bytes_before_direct);
 *   - anything else: KVT__READ_MIN.
 *
 * hiredis 0.14's own read (16 KiB after every reply, from redisAsyncHandleRead) used to pull the
 * next value's first 16 KiB into its buffer, from where direct_begin copied them out: two more
 * copies of 6% of each 256 KiB value (`direct_copied`, docs/remote.md).
 *
 * Returns the bytes read, 1 when the reply at the head is whole with nothing read (decode it),
 * 0 when the socket had nothing, -1 at EOF or on an error (handle_sock lets hiredis read then,
 * which finds the same and drops the connection as it always does).
 */
static ssize_t read_more(node_t *n)
{
    redisReader *rd = n->ac->c.reader;
    size_t want = KVT__READ_MIN;
    rq_t *h = rq_of(n->sentq.head);
    struct iovec iov[2];
    int k = 1;
    if (h && h->kind == RQ_GET && h->io && !h->direct) {
        size_t have = rd->len - rd->pos;
        if (h->expect > have) {
            want = KVT_MAX(want, (size_t)KVT_MIN(h->expect - have, (uint64_t)KVT__READ_MAX));
            uint64_t ahead = bytes_before_direct(h);
            if (ahead != UINT64_MAX)
                want = (size_t)KVT_MIN((uint64_t)want, h->expect - have + ahead);
        }
        int c = direct_ok(n, h);
        uint64_t upto = h->expect - 2 - h->io->len; /* "$<len>\r\n", header and tokens */
        if (c >= 0 && have + (size_t)c < upto) {
            want = (size_t)(upto - have - (size_t)c);
            iov[1] = (struct iovec){h->io->buf, h->io->len};
            k = 2;
        }
    } else if (h && h->direct) {
        /* Its value is in: the reader holds the stand-in head ("$0\r\n", or "0\r\n" once
         * hiredis took the '$') and what arrived of the two bytes ending the value behind it. */
        size_t have = rd->len - rd->pos;
        size_t whole = (have && rd->buf[rd->pos] == '$' ? 4 : 3) + 2;
        if (have >= whole)
            return 1;
        want = whole - have;
    }
    sds buf = sdsMakeRoomFor(rd->buf, want);
    if (!buf)
        return -1;
    rd->buf = buf;
    iov[0] = (struct iovec){buf + sdslen(buf), want};
    ssize_t got = readv(n->sock, iov, k);
    if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))
        return 0;
    if (got <= 0)
        return -1;
    size_t into = KVT_MIN((size_t)got, want);
    sdsIncrLen(buf, (ssize_t)into);
    rd->len = sdslen(buf);
    if (k == 2) /* the value's head may be whole now even with nothing in io->buf */
        direct_begin(n, (size_t)got - into);
    return got;
}

static void handle_sock(node_t *n, uint32_t events)
{
    uint64_t now = kvt_now_ns();
    int connected = n->ac->c.flags & REDIS_CONNECTED;
    if ((events & EPOLLOUT) || (!connected && (events & (EPOLLERR | EPOLLHUP)))) {
        if (!connected || (n->sock_events & EPOLLOUT))
            redisAsyncHandleWrite(n->ac); /* connect completion; its buffer is always empty */
        after_hiredis(n, now);
        if (n->ac && (n->ac->c.flags & REDIS_CONNECTED))
            flush(n);
        after_hiredis(n, now);
    }
    if (!n->ac || !(events & (EPOLLIN | EPOLLERR | EPOLLHUP)))
        return;
    /* Keep reading while the socket has more, within a budget so that one busy connection
     * cannot hold the caller's loop. */
    for (int budget = 64; budget > 0; budget--) {
        int up = n->ac->c.flags & REDIS_CONNECTED;
        if (up && n->skip) {
            if (skip_more(n) <= 0) {
                if (n->drop) {
                    after_hiredis(n, now);
                    return;
                }
                break; /* the rest has not arrived: epoll says when it has */
            }
            if (n->skip)
                continue;
            /* All of it dropped: the reply it was cut to is decoded now, below. Nothing more may
             * come from the server to wake this up again (it was the last reply), so this must
             * not wait for another turn, which the budget could end first. */
        }
        if (up && !n->skip && !n->dr)
            direct_begin(n, 0); /* a big value's start already in hiredis's buffer */
        if (up && n->dr) {
            ssize_t got = direct_more(n);
            if (n->drop) {
                after_hiredis(n, now);
                return;
            }
            if (n->dr || n->skip) {
                if (got <= 0)
                    break;
                continue;
            }
            /* Whole: the stand-in is decoded now, below, as after a skip. */
        }
        ssize_t got = up ? read_more(n) : -1;
        if (n->dr)
            continue; /* taken over: hiredis must not read the value's bytes */
        if (got >= 0)
            redisProcessCallbacks(n->ac); /* what read_more read: hiredis reads nothing */
        else
            redisAsyncHandleRead(n->ac); /* the connect's completion, EOF, errors: its own */
        if (n->ac && !n->ac_gone && (n->ac->c.flags & REDIS_CONNECTED))
            cut_oversized(n);
        after_hiredis(n, now);
        if (!n->ac)
            return;
        pump(n);
        if (got <= 0)
            break;
    }
    if (n->out_head)
        flush(n);
    after_hiredis(n, now);
}

/* Runs the callbacks of finished probes (not while the tier is being destroyed); returns how
 * many finished. */
static int deliver_probes(remote_t *rm)
{
    kvt_tier_probe_t *p = rm->probes_done_head;
    rm->probes_done_head = rm->probes_done_tail = NULL;
    int n = 0;
    while (p) {
        kvt_tier_probe_t *next = p->next;
        p->next = NULL;
        if (rm->tier->delivered)
            p->cb(p);
        n++;
        p = next;
    }
    return n;
}

static int remote_poll(kvt_tier_t *t)
{
    remote_t *rm = remote_of(t);
    struct epoll_event evs[16];
    int n = epoll_wait(rm->epfd, evs, KVT_ARRAY_LEN(evs), 0);
    if (n < 0 && errno != EINTR)
        return -errno;
    for (int i = 0; i < n; i++) {
        uint64_t v;
        uint32_t idx = evs[i].data.u32 >> 4;
        switch (evs[i].data.u32 & 15) {
        case TAG_SOCK:
            if (idx < rm->nnodes && rm->nodes[idx]->ac && !rm->nodes[idx]->ac_gone)
                handle_sock(rm->nodes[idx], evs[i].events);
            break;
        case TAG_TIMER:
            if (read(rm->tfd, &v, sizeof(v)) < 0 && errno != EAGAIN)
                return -errno;
            rm->timer_armed_ns = UINT64_MAX;
            break;
        case TAG_WAKE:
            if (read(rm->wfd, &v, sizeof(v)) < 0 && errno != EAGAIN)
                return -errno;
            break;
        }
    }
    tick(rm);
    int ran = 0;
    while (rm->probes_done_head) /* callbacks may finish more at once */
        ran += deliver_probes(rm);
    return ran;
}

/* DELs (frees, undone writes) may still be queued when the tier goes: give them a moment. */
#define KVT__DESTROY_FLUSH_MS 200

static int flushing(const remote_t *rm)
{
    for (uint32_t i = 0; i < rm->nnodes; i++) {
        const node_t *n = rm->nodes[i];
        if (n->state == ST_READY && (kvt__ioq_waiting(&n->q) || n->sentq.n))
            return 1;
    }
    return 0;
}

static void remote_destroy(kvt_tier_t *t)
{
    remote_t *rm = remote_of(t);
    uint64_t end = kvt_now_ns() + KVT__DESTROY_FLUSH_MS * 1000000ull;
    while (flushing(rm) && kvt_now_ns() < end) {
        struct epoll_event ev;
        (void)epoll_wait(rm->epfd, &ev, 1, 10);
        if (remote_poll(t) < 0)
            break;
    }
    for (uint32_t i = 0; i < rm->nnodes; i++) {
        node_t *n = rm->nodes[i];
        if (n->lookup) /* never waited for: a resolver that hangs must not hold the close */
            lookup_abandon(n->lookup);
        n->lookup = NULL;
        if (n->ac && !n->ac_gone) {
            n->drop_status = KVT_ECLOSED;
            n->drop = 1;
            outq_clear(n);
            redisAsyncFree(n->ac);
        }
        n->ac = NULL;
        tree_free(n);
    }
    for (uint32_t i = 0; i < rm->nnodes; i++) {
        node_t *n = rm->nodes[i];
        kvt__ioq_fifo_t *qs[] = {urgentq(n), waitq(n), &n->sentq, &n->undoq};
        for (size_t k = 0; k < KVT_ARRAY_LEN(qs); k++) {
            rq_t *r;
            while ((r = q_pop(qs[k])))
                free(r);
        }
    }
    rq_t *r;
    while ((r = rq_of(kvt__ioq_slot_get(&rm->pool))))
        free(r);
    for (uint32_t i = 0; i < rm->nnodes; i++) {
        free(rm->nodes[i]->host);
        free(rm->nodes[i]->dhdr);
        free(rm->nodes[i]);
    }
    close(rm->epfd);
    close(rm->tfd);
    close(rm->wfd);
    free(rm->slots);
    free(rm->free_slots);
    free(rm->scratch);
    free(rm->password);
    free(rm);
}

static const kvt_tier_ops_t remote_ops = {
    .backend = "redis",
    .unindexed_reads = 1,
    .drops_corrupt = 1, /* loc_gone */
    .footprint = remote_footprint,
    .write = remote_write,
    .read = remote_read,
    .free = remote_free,
    .read_corrupt = remote_read_corrupt,
    .valid = remote_valid,
    .ptr = NULL,
    .fd = remote_fd,
    .poll = remote_poll,
    .destroy = remote_destroy,
};

/* --- public API --- */

static int prefix_ok(const char *p)
{
    size_t n = strlen(p);
    if (n == 0 || n > KVT__PREFIX_MAX)
        return 0;
    for (size_t i = 0; i < n; i++)
        if (p[i] <= ' ' || p[i] == 0x7f)
            return 0;
    return 1;
}

static void free_nodes(remote_t *rm)
{
    for (uint32_t i = 0; i < rm->nnodes; i++) {
        free(rm->nodes[i]->host);
        free(rm->nodes[i]->dhdr);
        free(rm->nodes[i]);
    }
    rm->nnodes = 0;
}

/* Adds the seeds of "HOST:PORT[,HOST:PORT...]". Returns 0, KVT_EINVAL or KVT_ENOMEM. */
static int add_seeds(remote_t *rm, const char *list)
{
    const char *p = list;
    while (*p) {
        const char *comma = strchr(p, ',');
        size_t len = comma ? (size_t)(comma - p) : strlen(p);
        char one[300], host[256];
        uint16_t port;
        if (len == 0 || len >= sizeof(one))
            return KVT_EINVAL;
        memcpy(one, p, len);
        one[len] = 0;
        if (kvt_tier_remote_parse_addr(one, host, sizeof(host), &port) < 0)
            return KVT_EINVAL;
        if (rm->nnodes == KVT__NODES_MAX)
            return KVT_EINVAL;
        node_t *n = node_get(rm, host, port);
        if (!n)
            return KVT_ENOMEM;
        n->seed = 1;
        if (!comma)
            break;
        p = comma + 1;
        if (!*p)
            return KVT_EINVAL; /* a trailing comma */
    }
    return rm->nnodes ? 0 : KVT_EINVAL;
}

int kvt_tier_remote_create(kvt_tier_t **out, const kvt_tier_remote_conf_t *conf)
{
    if (!out || !conf || conf->capacity_bytes == 0 || conf->db < 0 || conf->db > 65535 ||
        (conf->key_prefix && !prefix_ok(conf->key_prefix)) ||
        (conf->password && !conf->password[0]) ||
        (conf->backoff_max_ms && conf->backoff_min_ms > conf->backoff_max_ms))
        return KVT_EINVAL;
    if (!conf->cluster && (!conf->host || !conf->host[0]))
        return KVT_EINVAL;
    /* A cluster has one database, and a brace in the prefix would be a hash tag that puts every
     * key in one slot, on one node. */
    if (conf->cluster && (!conf->seeds || !conf->seeds[0] || conf->db != 0 ||
                          (conf->key_prefix && strpbrk(conf->key_prefix, "{}"))))
        return KVT_EINVAL;
    *out = NULL;
    remote_t *rm = calloc(1, sizeof(*rm));
    if (!rm)
        return KVT_ENOMEM;
    rm->epfd = rm->tfd = rm->wfd = -1;
    rm->password = conf->password ? strdup(conf->password) : NULL;
    int rc = KVT_ENOMEM;
    if (conf->password && !rm->password)
        goto fail;
    rm->db = conf->db;
    snprintf(rm->prefix, sizeof(rm->prefix), "%s", conf->key_prefix ? conf->key_prefix : "kvt");
    rm->ttl_s = conf->ttl_s;
    rm->timeout_ns = (uint64_t)(conf->timeout_ms ? conf->timeout_ms : 2000) * 1000000u;
    rm->backoff_min_ns = (uint64_t)(conf->backoff_min_ms ? conf->backoff_min_ms : 50) * 1000000u;
    rm->backoff_max_ns = (uint64_t)(conf->backoff_max_ms ? conf->backoff_max_ms : 5000) * 1000000u;
    if (rm->backoff_max_ns < rm->backoff_min_ns)
        rm->backoff_max_ns = rm->backoff_min_ns;
    rm->rng = (kvt_now_ns() ^ ((uint64_t)getpid() << 32)) | 1;
    rm->max_inflight = conf->max_inflight ? conf->max_inflight : 64;
    rm->keep_on_free = conf->keep_on_free;
    rm->cluster = conf->cluster != 0;
    memset(rm->map, 0xff, sizeof(rm->map));
    rm->map_stale = rm->cluster;
    if (rm->cluster) {
        if ((rc = add_seeds(rm, conf->seeds)) < 0)
            goto fail;
    } else if (!node_get(rm, conf->host, conf->port ? conf->port : 6379)) {
        goto fail;
    }
    rm->fns = (redisReplyObjectFunctions){
        .createString = reply_string,
        .createArray = reply_array,
        .createInteger = reply_integer,
        .createNil = reply_nil,
        .freeObject = reply_free,
    };
    /* hiredis's own reply functions (static in hiredis), for the slot map's tree. */
    redisReader *rd = redisReaderCreate();
    if (!rd)
        goto fail;
    rm->tree_fns = *rd->fn;
    redisReaderFree(rd);
    rm->timer_armed_ns = UINT64_MAX;

    rm->epfd = epoll_create1(EPOLL_CLOEXEC);
    rm->tfd = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
    rm->wfd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (rm->epfd < 0 || rm->tfd < 0 || rm->wfd < 0) {
        rc = -errno;
        goto fail;
    }
    struct epoll_event ev = {.events = EPOLLIN, .data.u32 = TAG_TIMER};
    if (epoll_ctl(rm->epfd, EPOLL_CTL_ADD, rm->tfd, &ev) < 0) {
        rc = -errno;
        goto fail;
    }
    ev.data.u32 = TAG_WAKE;
    if (epoll_ctl(rm->epfd, EPOLL_CTL_ADD, rm->wfd, &ev) < 0) {
        rc = -errno;
        goto fail;
    }
    kvt_tier_t *t;
    rc = kvt__tier_init(&t, KVT_TIER_REMOTE, &remote_ops, rm, conf->capacity_bytes);
    if (rc)
        goto fail;
    rm->tier = t;
    tick(rm); /* connects: the server, or every seed */
    *out = t;
    return 0;
fail:
    if (rm->epfd >= 0)
        close(rm->epfd);
    if (rm->tfd >= 0)
        close(rm->tfd);
    if (rm->wfd >= 0)
        close(rm->wfd);
    free_nodes(rm);
    free(rm->password);
    free(rm);
    return rc;
}

static int is_remote(const kvt_tier_t *t)
{
    return t && t->ops == &remote_ops;
}

int kvt_tier_remote_probe(kvt_tier_t *t, kvt_tier_probe_t *p)
{
    if (!is_remote(t) || !p || !p->keys || p->n == 0 || p->n > KVT_TIER_PROBE_MAX || !p->cb)
        return KVT_EINVAL;
    remote_t *rm = remote_of(t);
    uint64_t now = kvt_now_ns();
    rq_t *rs[KVT_TIER_PROBE_MAX];
    node_t *to[KVT_TIER_PROBE_MAX];
    uint32_t n = p->n;
    for (uint32_t i = 0; i < n; i++) {
        if (!(rs[i] = rq_new(rm, RQ_EXISTS))) {
            while (i > 0)
                rq_release(rm, rs[--i]);
            return KVT_ENOMEM;
        }
        rq_name(rm, rs[i], p->keys[i].ns_seed, p->keys[i].hash);
        /* The keys go to their nodes in parallel. The prefix found cannot pass a key whose node
         * is down: the keys from there on are not asked. */
        if (!(to[i] = route_up(rm, rs[i], now))) {
            rq_release(rm, rs[i]);
            n = i;
        }
    }
    if (n == 0) {
        rm->stats.unavailable++;
        return KVT_EUNAVAIL;
    }
    p->status = 0;
    p->found = 0;
    p->pending = n;
    p->first_missing = n;
    p->next = NULL;
    rm->stats.probes++;
    uint64_t deadline = now + rm->timeout_ns;
    for (uint32_t i = 0; i < n; i++) {
        rs[i]->probe = p;
        rs[i]->idx = i;
        rs[i]->link.deadline_ns = deadline;
        rs[i]->on = to[i];
        q_push(urgentq(to[i]), rs[i]); /* a MATCH waits for its probe */
    }
    for (uint32_t i = 0; i < n; i++)
        if (i == 0 || to[i] != to[i - 1])
            pump(to[i]);
    if (deadline < rm->timer_armed_ns)
        arm_timer(rm, deadline);
    return 0;
}

int kvt_tier_remote_key(const kvt_tier_t *t, uint64_t ns_seed, uint64_t hash, char *buf, size_t cap)
{
    if (!is_remote(t) || !buf)
        return KVT_EINVAL;
    return format_key(remote_of(t), ns_seed, hash, buf, cap);
}

int kvt_tier_remote_connected(const kvt_tier_t *t)
{
    if (!is_remote(t))
        return 0;
    const remote_t *rm = remote_of(t);
    if (!rm->cluster)
        return rm->nodes[0]->state == ST_READY;
    if (!rm->map_known)
        return 0;
    for (uint32_t i = 0; i < rm->nnodes; i++)
        if (rm->nodes[i]->owned && rm->nodes[i]->state != ST_READY)
            return 0;
    return 1;
}

void kvt_tier_remote_stats(const kvt_tier_t *t, kvt_tier_remote_stats_t *out)
{
    if (!out)
        return;
    if (!is_remote(t)) {
        memset(out, 0, sizeof(*out));
        return;
    }
    const remote_t *rm = remote_of(t);
    *out = rm->stats;
    out->nodes = rm->cluster ? 0 : 1;
    for (uint32_t i = 0; rm->cluster && i < rm->nnodes; i++)
        out->nodes += rm->nodes[i]->owned > 0;
}

int kvt_tier_remote_node_stats(const kvt_tier_t *t, uint32_t i, kvt_tier_remote_node_stats_t *out)
{
    if (!is_remote(t) || !out)
        return KVT_EINVAL;
    const remote_t *rm = remote_of(t);
    if (i < rm->nnodes) {
        const node_t *n = rm->nodes[i];
        *out = n->st;
        snprintf(out->addr, sizeof(out->addr), "%s:%d", n->host, n->port);
        out->slots = rm->cluster ? n->owned : 16384;
        out->up = n->state == ST_READY;
    }
    return (int)rm->nnodes;
}

int kvt_tier_remote_parse_addr(const char *s, char *host, size_t cap, uint16_t *port)
{
    if (!s || !host || !port || cap == 0)
        return KVT_EINVAL;
    const char *colon = strrchr(s, ':');
    const char *h = s;
    size_t hl;
    if (s[0] == '[') { /* [v6]:port */
        const char *close = strchr(s, ']');
        if (!close || close[1] != ':')
            return KVT_EINVAL;
        h = s + 1;
        hl = (size_t)(close - h);
        colon = close + 1;
    } else {
        if (!colon || strchr(s, ':') != colon)
            return KVT_EINVAL;
        hl = (size_t)(colon - s);
    }
    if (hl == 0 || hl >= cap)
        return KVT_EINVAL;
    char *end;
    errno = 0;
    unsigned long p = strtoul(colon + 1, &end, 10);
    if (errno || end == colon + 1 || *end || p == 0 || p > 65535)
        return KVT_EINVAL;
    memcpy(host, h, hl);
    host[hl] = 0;
    *port = (uint16_t)p;
    return 0;
}
