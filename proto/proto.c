/*
 * proto.c: the codec of the wire format, both ways. It owns nothing but the format's rules:
 * header checks, the request and reply encoders, and the decoders, each of which accepts exactly
 * one well-formed body and rejects everything else (short, long, counts that disagree with the
 * length, unknown flag bits) with KVT_EPROTO, without touching any state. kvtierd and libkvtier
 * both link it; the tests fuzz it through the daemon's socket.
 */
#include "proto.h"

#include <endian.h>
#include <string.h>

static const char *const kvt_op_names[KVT_OP_COUNT] = {
    [KVT_OP_HELLO] = "hello",     [KVT_OP_AUTH] = "auth",     [KVT_OP_MATCH] = "match",
    [KVT_OP_PUT] = "put",         [KVT_OP_GET] = "get",       [KVT_OP_PREFETCH] = "prefetch",
    [KVT_OP_RELEASE] = "release", [KVT_OP_REMOVE] = "remove", [KVT_OP_STATS] = "stats",
    [KVT_OP_PING] = "ping",       [KVT_OP_MAP] = "map",       [KVT_OP_RESERVE] = "reserve",
    [KVT_OP_COMMIT] = "commit",
};

const char *kvt_proto_op_name(unsigned op)
{
    op &= ~(unsigned)KVT_OP_REPLY;
    return op < KVT_OP_COUNT ? kvt_op_names[op] : NULL;
}

static const uint16_t kvt_op_flags[KVT_OP_COUNT] = {
    [KVT_OP_MATCH] = KVT_MATCH_F_ALL,   [KVT_OP_PREFETCH] = KVT_PREFETCH_F_ALL,
    [KVT_OP_REMOVE] = KVT_REMOVE_F_ALL, [KVT_OP_GET] = KVT_GET_F_ALL,
    [KVT_OP_COMMIT] = KVT_COMMIT_F_ALL, [KVT_OP_PUT] = KVT_PUT_F_ALL,
    [KVT_OP_RESERVE] = KVT_PUT_F_ALL,
};

unsigned kvt_proto_req_flags(unsigned op)
{
    return op < KVT_OP_COUNT ? kvt_op_flags[op] : 0;
}

void kvt_proto_hdr_encode(uint8_t out[KVT_PROTO_HDR], const kvt_proto_hdr_t *h)
{
    kvt_wire_hdr_t w = {
        .magic = htole32(h->magic),
        .version = h->version,
        .opcode = h->opcode,
        .flags = htole16(h->flags),
        .request_id = htole64(h->request_id),
        .body_len = htole32(h->body_len),
        .status = (int32_t)htole32((uint32_t)h->status),
    };
    memcpy(out, &w, sizeof w);
}

void kvt_proto_hdr_decode(const uint8_t in[KVT_PROTO_HDR], kvt_proto_hdr_t *h)
{
    kvt_wire_hdr_t w;
    memcpy(&w, in, sizeof w);
    h->magic = le32toh(w.magic);
    h->version = w.version;
    h->opcode = w.opcode;
    h->flags = le16toh(w.flags);
    h->request_id = le64toh(w.request_id);
    h->body_len = le32toh(w.body_len);
    h->status = (int32_t)le32toh((uint32_t)w.status);
}

int kvt_proto_hdr_check(const kvt_proto_hdr_t *h, uint32_t max_body)
{
    if (h->magic != KVT_PROTO_MAGIC || h->version != KVT_PROTO_VERSION)
        return KVT_EPROTO;
    if (h->body_len > max_body)
        return KVT_ETOOBIG;
    return 0;
}

void kvt_proto_frame(uint8_t *out, unsigned op, uint16_t flags, uint64_t id, int32_t status,
                     uint32_t body_len)
{
    kvt_proto_hdr_t h = {
        .magic = KVT_PROTO_MAGIC,
        .version = KVT_PROTO_VERSION,
        .opcode = (uint8_t)op,
        .flags = flags,
        .request_id = id,
        .body_len = body_len,
        .status = status,
    };
    kvt_proto_hdr_encode(out, &h);
}

void kvt_proto_hints_to_wire(const kvt_proto_hints_t *h, kvt_wire_hints_t *w)
{
    w->engine_request_id = htole64(h->engine_request_id);
    w->resume_ms = htole32(h->resume_ms);
    w->priority = htole16(h->priority);
    w->flags = htole16(h->flags);
}

int kvt_proto_hints_from_wire(const kvt_wire_hints_t *w, kvt_proto_hints_t *h)
{
    h->engine_request_id = le64toh(w->engine_request_id);
    h->resume_ms = le32toh(w->resume_ms);
    h->priority = le16toh(w->priority);
    h->flags = le16toh(w->flags);
    if (h->flags & ~(unsigned)KVT_HINT_ALL)
        return KVT_EPROTO;
    if ((h->flags & KVT_HINT_PAUSED) && (h->flags & KVT_HINT_FINISHED))
        return KVT_EPROTO;
    return 0;
}

void kvt_proto_tokens(const uint8_t *src, uint32_t n, uint32_t *dst)
{
    if (n == 0)
        return; /* dst may be NULL then: no buffer was needed yet */
    memcpy(dst, src, (size_t)n * 4);
#if __BYTE_ORDER != __LITTLE_ENDIAN
    for (uint32_t i = 0; i < n; i++)
        dst[i] = le32toh(dst[i]);
#endif
}

/* A token count is consistent when the tokens exactly fill what the fixed part leaves. */
static int tokens_fit(size_t len, size_t fixed, uint32_t ntokens, size_t tail)
{
    return len >= fixed && (len - fixed) / 4 >= ntokens &&
           len == fixed + (size_t)ntokens * 4 + tail;
}

int kvt_proto_hello_decode(const uint8_t *body, size_t len, kvt_proto_hello_t *out)
{
    kvt_wire_hello_t w;
    if (len < sizeof w)
        return KVT_EPROTO;
    memcpy(&w, body, sizeof w);
    out->min_version = le16toh(w.min_version);
    out->max_version = le16toh(w.max_version);
    out->page_size = le32toh(w.page_size);
    out->block_bytes = le32toh(w.block_bytes);
    out->model_len = le16toh(w.model_len);
    out->adapter_len = le16toh(w.adapter_len);
    out->salt_len = le16toh(w.salt_len);
    out->device = le16toh(w.device);
    if (out->min_version > out->max_version)
        return KVT_EPROTO;
    if (out->model_len == 0 || out->model_len > KVT_PROTO_NAME_MAX ||
        out->adapter_len > KVT_PROTO_NAME_MAX || out->salt_len > KVT_PROTO_NAME_MAX)
        return KVT_EPROTO;
    if (len != sizeof w + (size_t)out->model_len + out->adapter_len + out->salt_len)
        return KVT_EPROTO;
    out->model = (const char *)body + sizeof w;
    out->adapter = out->model + out->model_len;
    out->salt = out->adapter + out->adapter_len;
    /* Names become C strings on the server: an embedded NUL would make two namespaces one. */
    if (memchr(out->model, 0, (size_t)out->model_len + out->adapter_len + out->salt_len))
        return KVT_EPROTO;
    return 0;
}

int kvt_proto_match_decode(const uint8_t *body, size_t len, kvt_proto_match_t *out)
{
    kvt_wire_match_t w;
    if (len < sizeof w)
        return KVT_EPROTO;
    memcpy(&w, body, sizeof w);
    if (kvt_proto_hints_from_wire(&w.hints, &out->hints) < 0)
        return KVT_EPROTO;
    out->lease_ms = le32toh(w.lease_ms);
    out->ntokens = le32toh(w.ntokens);
    if (!tokens_fit(len, sizeof w, out->ntokens, 0))
        return KVT_EPROTO;
    out->tokens = body + sizeof w;
    return 0;
}

/* PUT's and RESERVE's fixed parts are the same 32 bytes: hints, tokens, first page, pages. */
_Static_assert(sizeof(kvt_wire_reserve_t) == sizeof(kvt_wire_put_t), "RESERVE is PUT's layout");

/* The handle is read as it is: whether the header's flag and it agree is the handler's check
 * (the flags are the header's, not the body's). */
static int pages_fixed_decode(const uint8_t *body, size_t len, kvt_proto_hints_t *hints,
                              uint32_t *ntokens, uint32_t *first_page, uint32_t *npages,
                              uint32_t *handle)
{
    kvt_wire_put_t w;
    if (len < sizeof w)
        return KVT_EPROTO;
    memcpy(&w, body, sizeof w);
    if (kvt_proto_hints_from_wire(&w.hints, hints) < 0)
        return KVT_EPROTO;
    *ntokens = le32toh(w.ntokens);
    *first_page = le32toh(w.first_page);
    *npages = le32toh(w.npayload);
    *handle = le32toh(w.handle);
    return 0;
}

int kvt_proto_put_decode(const uint8_t *body, size_t len, uint32_t block_bytes,
                         kvt_proto_put_t *out)
{
    if (pages_fixed_decode(body, len, &out->hints, &out->ntokens, &out->first_page, &out->npayload,
                           &out->handle) < 0)
        return KVT_EPROTO;
    if (out->npayload > 0 && block_bytes == 0)
        return KVT_EPROTO;
    uint64_t payload = (uint64_t)out->npayload * block_bytes;
    if (payload > len)
        return KVT_EPROTO;
    if (!tokens_fit(len, sizeof(kvt_wire_put_t), out->ntokens, (size_t)payload))
        return KVT_EPROTO;
    out->tokens = body + sizeof(kvt_wire_put_t);
    out->payload = out->tokens + (size_t)out->ntokens * 4;
    return 0;
}

int kvt_proto_map_decode(const uint8_t *body, size_t len, uint32_t *tier)
{
    kvt_wire_map_t w;
    if (len != sizeof w)
        return KVT_EPROTO;
    memcpy(&w, body, sizeof w);
    if (w.reserved != 0)
        return KVT_EPROTO;
    *tier = le32toh(w.tier);
    return 0;
}

int kvt_proto_reserve_decode(const uint8_t *body, size_t len, kvt_proto_reserve_t *out)
{
    if (pages_fixed_decode(body, len, &out->hints, &out->ntokens, &out->first_page, &out->npages,
                           &out->handle) < 0 ||
        !tokens_fit(len, sizeof(kvt_wire_reserve_t), out->ntokens, 0))
        return KVT_EPROTO;
    out->tokens = body + sizeof(kvt_wire_reserve_t);
    return 0;
}

int kvt_proto_commit_decode(const uint8_t *body, size_t len, uint64_t *resv)
{
    if (len != sizeof(kvt_wire_commit_t))
        return KVT_EPROTO;
    *resv = kvt_get_u64(body);
    return 0;
}

int kvt_proto_commit_sums_decode(const uint8_t *body, size_t len, uint64_t *resv, uint32_t *nsums,
                                 const uint8_t **sums)
{
    size_t n = len < sizeof(kvt_wire_commit_t) ? 0 : (len - sizeof(kvt_wire_commit_t)) / 8;
    if (n == 0 || n > UINT32_MAX || len != sizeof(kvt_wire_commit_t) + n * 8)
        return KVT_EPROTO;
    *resv = kvt_get_u64(body);
    *nsums = (uint32_t)n;
    *sums = body + sizeof(kvt_wire_commit_t);
    return 0;
}

int kvt_proto_get_decode(const uint8_t *body, size_t len, kvt_proto_get_t *out)
{
    kvt_wire_get_t w;
    if (len != sizeof w)
        return KVT_EPROTO;
    memcpy(&w, body, sizeof w);
    out->lease = le64toh(w.lease);
    out->first_page = le32toh(w.first_page);
    out->npages = le32toh(w.npages);
    return 0;
}

int kvt_proto_prefetch_decode(const uint8_t *body, size_t len, kvt_proto_prefetch_t *out)
{
    kvt_wire_prefetch_t w;
    if (len < sizeof w)
        return KVT_EPROTO;
    memcpy(&w, body, sizeof w);
    out->tier = le32toh(w.tier);
    out->deadline_ms = le32toh(w.deadline_ms);
    out->ntokens = le32toh(w.ntokens);
    if (w.reserved != 0 || !tokens_fit(len, sizeof w, out->ntokens, 0))
        return KVT_EPROTO;
    out->tokens = body + sizeof w;
    return 0;
}

int kvt_proto_release_decode(const uint8_t *body, size_t len, uint64_t *lease)
{
    kvt_wire_release_t w;
    if (len != sizeof w)
        return KVT_EPROTO;
    memcpy(&w, body, sizeof w);
    *lease = le64toh(w.lease);
    return 0;
}

int kvt_proto_remove_decode(const uint8_t *body, size_t len, uint32_t *ntokens,
                            const uint8_t **tokens)
{
    kvt_wire_remove_t w;
    if (len < sizeof w)
        return KVT_EPROTO;
    memcpy(&w, body, sizeof w);
    *ntokens = le32toh(w.ntokens);
    if (w.reserved != 0 || !tokens_fit(len, sizeof w, *ntokens, 0))
        return KVT_EPROTO;
    *tokens = body + sizeof w;
    return 0;
}

void kvt_proto_tokens_encode(uint8_t *dst, const uint32_t *src, uint32_t n)
{
#if __BYTE_ORDER == __LITTLE_ENDIAN
    if (n)
        memcpy(dst, src, (size_t)n * 4);
#else
    for (uint32_t i = 0; i < n; i++)
        kvt_put_u32(dst + 4 * (size_t)i, src[i]);
#endif
}

/* ---- request encoders ---- */

void kvt_proto_hello_encode(uint8_t out[sizeof(kvt_wire_hello_t)], const kvt_proto_hello_t *m)
{
    kvt_wire_hello_t w = {
        .min_version = htole16(m->min_version),
        .max_version = htole16(m->max_version),
        .page_size = htole32(m->page_size),
        .block_bytes = htole32(m->block_bytes),
        .model_len = htole16(m->model_len),
        .adapter_len = htole16(m->adapter_len),
        .salt_len = htole16(m->salt_len),
        .device = htole16(m->device),
    };
    memcpy(out, &w, sizeof w);
}

void kvt_proto_match_encode(uint8_t out[sizeof(kvt_wire_match_t)], const kvt_proto_match_t *m)
{
    kvt_wire_match_t w = {.lease_ms = htole32(m->lease_ms), .ntokens = htole32(m->ntokens)};
    kvt_proto_hints_to_wire(&m->hints, &w.hints);
    memcpy(out, &w, sizeof w);
}

void kvt_proto_put_encode(uint8_t out[sizeof(kvt_wire_put_t)], const kvt_proto_put_t *m)
{
    kvt_wire_put_t w = {
        .ntokens = htole32(m->ntokens),
        .first_page = htole32(m->first_page),
        .npayload = htole32(m->npayload),
        .handle = htole32(m->handle),
    };
    kvt_proto_hints_to_wire(&m->hints, &w.hints);
    memcpy(out, &w, sizeof w);
}

void kvt_proto_get_encode(uint8_t out[sizeof(kvt_wire_get_t)], const kvt_proto_get_t *m)
{
    kvt_wire_get_t w = {
        .lease = htole64(m->lease),
        .first_page = htole32(m->first_page),
        .npages = htole32(m->npages),
    };
    memcpy(out, &w, sizeof w);
}

void kvt_proto_prefetch_encode(uint8_t out[sizeof(kvt_wire_prefetch_t)],
                               const kvt_proto_prefetch_t *m)
{
    kvt_wire_prefetch_t w = {
        .tier = htole32(m->tier),
        .deadline_ms = htole32(m->deadline_ms),
        .ntokens = htole32(m->ntokens),
    };
    memcpy(out, &w, sizeof w);
}

void kvt_proto_release_encode(uint8_t out[sizeof(kvt_wire_release_t)], uint64_t lease)
{
    kvt_put_u64(out, lease);
}

void kvt_proto_remove_encode(uint8_t out[sizeof(kvt_wire_remove_t)], uint32_t ntokens)
{
    kvt_wire_remove_t w = {.ntokens = htole32(ntokens)};
    memcpy(out, &w, sizeof w);
}

void kvt_proto_map_encode(uint8_t out[sizeof(kvt_wire_map_t)], uint32_t tier)
{
    kvt_wire_map_t w = {.tier = htole32(tier)};
    memcpy(out, &w, sizeof w);
}

void kvt_proto_reserve_encode(uint8_t out[sizeof(kvt_wire_reserve_t)], const kvt_proto_reserve_t *m)
{
    kvt_proto_put_t p = {.hints = m->hints,
                         .ntokens = m->ntokens,
                         .first_page = m->first_page,
                         .npayload = m->npages,
                         .handle = m->handle};
    kvt_proto_put_encode(out, &p);
}

void kvt_proto_commit_encode(uint8_t out[sizeof(kvt_wire_commit_t)], uint64_t resv)
{
    kvt_put_u64(out, resv);
}

/* ---- replies ---- */

void kvt_proto_hello_reply_encode(uint8_t out[sizeof(kvt_wire_hello_reply_t)],
                                  const kvt_proto_hello_reply_t *r)
{
    kvt_wire_hello_reply_t w = {
        .version = htole16(r->version),
        .tiers = htole16(r->tiers),
        .ns = htole32(r->ns),
        .ns_seed = htole64(r->ns_seed),
        .max_frame = htole32(r->max_frame),
        .lease_ms_max = htole32(r->lease_ms_max),
    };
    memcpy(out, &w, sizeof w);
}

int kvt_proto_hello_reply_decode(const uint8_t *body, size_t len, kvt_proto_hello_reply_t *r)
{
    kvt_wire_hello_reply_t w;
    if (len != sizeof w)
        return KVT_EPROTO;
    memcpy(&w, body, sizeof w);
    r->version = le16toh(w.version);
    r->tiers = le16toh(w.tiers);
    r->ns = le32toh(w.ns);
    r->ns_seed = le64toh(w.ns_seed);
    r->max_frame = le32toh(w.max_frame);
    r->lease_ms_max = le32toh(w.lease_ms_max);
    return 0;
}

void kvt_proto_match_reply_encode(uint8_t out[sizeof(kvt_wire_match_reply_t)],
                                  const kvt_proto_match_reply_t *r)
{
    kvt_wire_match_reply_t w = {
        .tokens = htole32(r->tokens),
        .pages = htole32(r->pages),
        .lease = htole64(r->lease),
        .remote_pages = htole32(r->remote_pages),
        .handle = htole32(r->handle),
    };
    memcpy(out, &w, sizeof w);
}

/* The fixed part and the tier bytes, whose count the fixed part gives; extra is what must
 * follow them per page (0, or LOCATE's offsets) after a head of extra_head bytes. */
static int match_reply_fixed(const uint8_t *body, size_t len, kvt_proto_match_reply_t *r,
                             const uint8_t **tiers, size_t extra_head, size_t extra)
{
    kvt_wire_match_reply_t w;
    if (len < sizeof w)
        return KVT_EPROTO;
    memcpy(&w, body, sizeof w);
    r->pages = le32toh(w.pages);
    if (len != sizeof w + extra_head + (size_t)r->pages * (1 + extra))
        return KVT_EPROTO;
    r->tokens = le32toh(w.tokens);
    r->lease = le64toh(w.lease);
    r->remote_pages = le32toh(w.remote_pages);
    r->handle = le32toh(w.handle);
    *tiers = body + sizeof w;
    return 0;
}

int kvt_proto_match_reply_decode(const uint8_t *body, size_t len, kvt_proto_match_reply_t *r,
                                 const uint8_t **tiers)
{
    return match_reply_fixed(body, len, r, tiers, 0, 0);
}

void kvt_proto_match_locs_encode(uint8_t out[sizeof(kvt_wire_match_locs_t)], uint32_t lease_ms,
                                 uint32_t located)
{
    kvt_put_u32(out, lease_ms);
    kvt_put_u32(out + 4, located);
}

void kvt_proto_match_loc_encode(uint8_t out[8], uint64_t offset)
{
    kvt_put_u64(out, offset);
}

int kvt_proto_match_reply_locs_decode(const uint8_t *body, size_t len, kvt_proto_match_reply_t *r,
                                      const uint8_t **tiers, kvt_proto_match_locs_t *locs)
{
    if (match_reply_fixed(body, len, r, tiers, sizeof(kvt_wire_match_locs_t), 8) < 0)
        return KVT_EPROTO;
    const uint8_t *p = *tiers + r->pages;
    locs->lease_ms = kvt_get_u32(p);
    locs->located = kvt_get_u32(p + 4);
    locs->offs = p + sizeof(kvt_wire_match_locs_t);
    /* A count the offsets contradict would mislead a client that trusts it: counted here. */
    uint32_t n = 0;
    for (uint32_t i = 0; i < r->pages; i++)
        n += kvt_proto_match_loc(locs, i) != KVT_MATCH_NO_LOC;
    if (n != locs->located || (r->pages && !r->lease))
        return KVT_EPROTO;
    return 0;
}

uint64_t kvt_proto_match_loc(const kvt_proto_match_locs_t *locs, uint32_t i)
{
    return kvt_get_u64(locs->offs + (size_t)i * 8);
}

void kvt_proto_put_reply_encode(uint8_t out[sizeof(kvt_wire_put_reply_t)],
                                const kvt_proto_put_reply_t *r)
{
    kvt_wire_put_reply_t w = {
        .pages = htole32(r->pages),
        .new_pages = htole32(r->new_pages),
        .stored = htole32(r->stored),
        .skipped = htole32(r->skipped),
    };
    memcpy(out, &w, sizeof w);
}

int kvt_proto_put_reply_decode(const uint8_t *body, size_t len, kvt_proto_put_reply_t *r)
{
    kvt_wire_put_reply_t w;
    if (len != sizeof w)
        return KVT_EPROTO;
    memcpy(&w, body, sizeof w);
    r->pages = le32toh(w.pages);
    r->new_pages = le32toh(w.new_pages);
    r->stored = le32toh(w.stored);
    r->skipped = le32toh(w.skipped);
    return 0;
}

void kvt_proto_prefetch_reply_encode(uint8_t out[sizeof(kvt_wire_prefetch_reply_t)],
                                     const kvt_proto_prefetch_reply_t *r)
{
    kvt_wire_prefetch_reply_t w = {
        .pages = htole32(r->pages),
        .moved = htole32(r->moved),
        .resident = htole32(r->resident),
        .failed = htole32(r->failed),
    };
    memcpy(out, &w, sizeof w);
}

int kvt_proto_prefetch_reply_decode(const uint8_t *body, size_t len, kvt_proto_prefetch_reply_t *r)
{
    kvt_wire_prefetch_reply_t w;
    if (len != sizeof w)
        return KVT_EPROTO;
    memcpy(&w, body, sizeof w);
    r->pages = le32toh(w.pages);
    r->moved = le32toh(w.moved);
    r->resident = le32toh(w.resident);
    r->failed = le32toh(w.failed);
    return 0;
}

void kvt_proto_release_reply_encode(uint8_t out[sizeof(kvt_wire_release_reply_t)],
                                    uint32_t released)
{
    kvt_put_u32(out, released);
}

int kvt_proto_release_reply_decode(const uint8_t *body, size_t len, uint32_t *released)
{
    if (len != sizeof(kvt_wire_release_reply_t))
        return KVT_EPROTO;
    *released = kvt_get_u32(body);
    return 0;
}

void kvt_proto_get_data_encode(uint8_t out[sizeof(kvt_wire_get_data_t)], uint32_t page,
                               uint8_t tier)
{
    kvt_wire_get_data_t w = {.page = htole32(page), .tier = tier};
    memcpy(out, &w, sizeof w);
}

int kvt_proto_get_data_decode(const uint8_t *body, size_t len, uint32_t *page, uint8_t *tier,
                              const uint8_t **data, uint32_t *data_len)
{
    kvt_wire_get_data_t w;
    if (len < sizeof w)
        return KVT_EPROTO;
    memcpy(&w, body, sizeof w);
    if (w.reserved[0] != KVT_GET_DATA_BYTES)
        return KVT_EPROTO;
    *page = le32toh(w.page);
    *tier = w.tier;
    *data = body + sizeof w;
    *data_len = (uint32_t)(len - sizeof w);
    return 0;
}

void kvt_proto_get_end_encode(uint8_t out[sizeof(kvt_wire_get_end_t)], uint32_t npages,
                              uint32_t lease_ms_left)
{
    kvt_wire_get_end_t w = {.npages = htole32(npages), .lease_ms_left = htole32(lease_ms_left)};
    memcpy(out, &w, sizeof w);
}

int kvt_proto_get_end_decode(const uint8_t *body, size_t len, uint32_t *npages,
                             uint32_t *lease_ms_left)
{
    if (len != sizeof(kvt_wire_get_end_t))
        return KVT_EPROTO;
    *npages = kvt_get_u32(body);
    if (lease_ms_left)
        *lease_ms_left = kvt_get_u32(body + 4);
    return 0;
}

int kvt_proto_get_data_kind(const uint8_t *body, size_t len)
{
    if (len < sizeof(kvt_wire_get_data_t))
        return KVT_EPROTO;
    return body[5];
}

void kvt_proto_get_loc_encode(uint8_t out[sizeof(kvt_wire_get_loc_t)], uint32_t page, uint8_t tier,
                              uint64_t offset, uint32_t len)
{
    kvt_wire_get_loc_t w = {
        .page = htole32(page),
        .tier = tier,
        .kind = KVT_GET_DATA_LOC,
        .offset = htole64(offset),
        .len = htole32(len),
    };
    memcpy(out, &w, sizeof w);
}

int kvt_proto_get_loc_decode(const uint8_t *body, size_t len, uint32_t *page, uint8_t *tier,
                             uint64_t *offset, uint32_t *data_len)
{
    kvt_wire_get_loc_t w;
    if (len != sizeof w)
        return KVT_EPROTO;
    memcpy(&w, body, sizeof w);
    if (w.kind != KVT_GET_DATA_LOC || w.reserved != 0 || w.reserved2 != 0)
        return KVT_EPROTO;
    *page = le32toh(w.page);
    *tier = w.tier;
    *offset = le64toh(w.offset);
    *data_len = le32toh(w.len);
    return 0;
}

void kvt_proto_map_reply_encode(uint8_t out[sizeof(kvt_wire_map_reply_t)],
                                const kvt_proto_map_reply_t *r)
{
    kvt_wire_map_reply_t w = {
        .map_bytes = htole64(r->map_bytes),
        .tier = htole32(r->tier),
        .handle_len = htole32(r->handle_len),
    };
    memcpy(out, &w, sizeof w);
}

int kvt_proto_map_reply_decode(const uint8_t *body, size_t len, kvt_proto_map_reply_t *r)
{
    kvt_wire_map_reply_t w;
    if (len < sizeof w)
        return KVT_EPROTO;
    memcpy(&w, body, sizeof w);
    r->map_bytes = le64toh(w.map_bytes);
    r->tier = le32toh(w.tier);
    r->handle_len = le32toh(w.handle_len);
    if (len - sizeof w != r->handle_len)
        return KVT_EPROTO;
    r->handle = body + sizeof w;
    return 0;
}

void kvt_proto_reserve_reply_encode(uint8_t out[sizeof(kvt_wire_reserve_reply_t)],
                                    const kvt_proto_reserve_reply_t *r)
{
    kvt_wire_reserve_reply_t w = {
        .resv = htole64(r->resv),
        .pages = htole32(r->pages),
        .new_pages = htole32(r->new_pages),
        .nlocs = htole32(r->nlocs),
        .flags = htole32(r->flags),
    };
    memcpy(out, &w, sizeof w);
}

void kvt_proto_resv_loc_encode(uint8_t out[sizeof(kvt_wire_resv_loc_t)], uint32_t page,
                               uint64_t offset)
{
    kvt_wire_resv_loc_t w = {.page = htole32(page), .offset = htole64(offset)};
    memcpy(out, &w, sizeof w);
}

int kvt_proto_reserve_reply_decode(const uint8_t *body, size_t len, kvt_proto_reserve_reply_t *r)
{
    kvt_wire_reserve_reply_t w;
    if (len < sizeof w)
        return KVT_EPROTO;
    memcpy(&w, body, sizeof w);
    r->resv = le64toh(w.resv);
    r->pages = le32toh(w.pages);
    r->new_pages = le32toh(w.new_pages);
    r->nlocs = le32toh(w.nlocs);
    r->flags = le32toh(w.flags);
    if ((r->flags & ~(uint32_t)KVT_RESV_F_ALL) ||
        (uint64_t)(len - sizeof w) != (uint64_t)r->nlocs * sizeof(kvt_wire_resv_loc_t))
        return KVT_EPROTO;
    r->locs = body + sizeof w;
    return 0;
}

void kvt_proto_resv_loc(const kvt_proto_reserve_reply_t *r, uint32_t i, uint32_t *page,
                        uint64_t *offset)
{
    const uint8_t *p = r->locs + (size_t)i * sizeof(kvt_wire_resv_loc_t);
    *page = kvt_get_u32(p);
    *offset = kvt_get_u64(p + 8);
}

int kvt_proto_stat_encode(uint8_t *out, size_t cap, size_t *len, const char *name, uint64_t value)
{
    size_t nl = strlen(name);
    if (nl > 255 || *len + 1 + nl + 8 > cap)
        return KVT_ETOOBIG;
    uint8_t *p = out + *len;
    p[0] = (uint8_t)nl;
    memcpy(p + 1, name, nl);
    kvt_put_u64(p + 1 + nl, value);
    *len += 1 + nl + 8;
    kvt_put_u32(out, kvt_get_u32(out) + 1);
    return 0;
}

int kvt_proto_stats_begin(kvt_proto_stats_iter_t *it, const uint8_t *body, size_t len)
{
    if (len < 4)
        return KVT_EPROTO;
    *it = (kvt_proto_stats_iter_t){.body = body, .len = len, .off = 4, .left = kvt_get_u32(body)};
    return 0;
}

int kvt_proto_stats_next(kvt_proto_stats_iter_t *it, char name[256], uint64_t *value)
{
    if (it->left == 0)
        return 0;
    if (it->off + 1 > it->len || it->off + 1 + it->body[it->off] + 8 > it->len)
        return KVT_EPROTO;
    uint8_t nl = it->body[it->off];
    memcpy(name, it->body + it->off + 1, nl);
    name[nl] = 0;
    *value = kvt_get_u64(it->body + it->off + 1 + nl);
    it->off += 1 + (size_t)nl + 8;
    it->left--;
    return 1;
}
