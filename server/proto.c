/*
 * proto.c: the frame parser. It owns nothing but the rules of the wire format: header checks and
 * the body decoders, each of which accepts exactly one well-formed body and rejects everything
 * else (short, long, counts that disagree with the length, unknown flag bits) with KVT_EPROTO,
 * without touching any state. It is shared by kvtierd and libkvtier, and fuzzed by the tests
 * through the daemon's socket.
 */
#include "proto.h"

#include <endian.h>
#include <string.h>

static const char *const kvt_op_names[KVT_OP_COUNT] = {
    [KVT_OP_HELLO] = "hello",     [KVT_OP_AUTH] = "auth",     [KVT_OP_MATCH] = "match",
    [KVT_OP_PUT] = "put",         [KVT_OP_GET] = "get",       [KVT_OP_PREFETCH] = "prefetch",
    [KVT_OP_RELEASE] = "release", [KVT_OP_REMOVE] = "remove", [KVT_OP_STATS] = "stats",
    [KVT_OP_PING] = "ping",
};

const char *kvt_proto_op_name(unsigned op)
{
    op &= ~(unsigned)KVT_OP_REPLY;
    return op < KVT_OP_COUNT ? kvt_op_names[op] : NULL;
}

static const uint16_t kvt_op_flags[KVT_OP_COUNT] = {
    [KVT_OP_MATCH] = KVT_MATCH_F_ALL,
    [KVT_OP_PREFETCH] = KVT_PREFETCH_F_ALL,
    [KVT_OP_REMOVE] = KVT_REMOVE_F_ALL,
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
static int kvt_tokens_fit(size_t len, size_t fixed, uint32_t ntokens, size_t tail)
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
    if (w.reserved != 0 || out->min_version > out->max_version)
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
    if (!kvt_tokens_fit(len, sizeof w, out->ntokens, 0))
        return KVT_EPROTO;
    out->tokens = body + sizeof w;
    return 0;
}

int kvt_proto_put_decode(const uint8_t *body, size_t len, uint32_t block_bytes,
                         kvt_proto_put_t *out)
{
    kvt_wire_put_t w;
    if (len < sizeof w)
        return KVT_EPROTO;
    memcpy(&w, body, sizeof w);
    if (kvt_proto_hints_from_wire(&w.hints, &out->hints) < 0 || w.reserved != 0)
        return KVT_EPROTO;
    out->ntokens = le32toh(w.ntokens);
    out->first_page = le32toh(w.first_page);
    out->npayload = le32toh(w.npayload);
    if (out->npayload > 0 && block_bytes == 0)
        return KVT_EPROTO;
    uint64_t payload = (uint64_t)out->npayload * block_bytes;
    if (payload > len)
        return KVT_EPROTO;
    if (!kvt_tokens_fit(len, sizeof w, out->ntokens, (size_t)payload))
        return KVT_EPROTO;
    out->tokens = body + sizeof w;
    out->payload = out->tokens + (size_t)out->ntokens * 4;
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
    if (w.reserved != 0 || !kvt_tokens_fit(len, sizeof w, out->ntokens, 0))
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
    if (w.reserved != 0 || !kvt_tokens_fit(len, sizeof w, *ntokens, 0))
        return KVT_EPROTO;
    *tokens = body + sizeof w;
    return 0;
}
