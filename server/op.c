/*
 * op.c: what every operation's handler shares: the answer to a malformed body, the HELLO check,
 * and the frame's tokens in host order. The handlers are above it, dispatch.c above them.
 */
#include "server.h"

/* Points c->tok at the frame's tokens in host order: the frame itself when the host is
 * little-endian and they are aligned (no copy on the hot path), else a copy. Valid until the
 * next frame. */
int kvt__tokens(kvt__conn_t *c, const uint8_t *src, uint32_t n)
{
#if __BYTE_ORDER == __LITTLE_ENDIAN
    if (((uintptr_t)src & (_Alignof(uint32_t) - 1)) == 0) {
        c->tok = (const uint32_t *)(const void *)src;
        return 0;
    }
#endif
    size_t had = c->tokens_cap;
    if (kvt_reserve(&c->tokens, &c->tokens_cap, n, sizeof *c->tokens, 4096) < 0)
        return KVT_ENOMEM;
    kvt__clients_add(c, (int64_t)((c->tokens_cap - had) * sizeof *c->tokens));
    kvt_proto_tokens(src, n, c->tokens);
    c->tok = c->tokens;
    return 0;
}

/* Handlers. Each returns 0, or a negative code when the connection must close. */

int kvt__bad_body(kvt__conn_t *c, const kvt_proto_hdr_t *h, uint64_t t0, const char *what)
{
    kvt__proto_error(c->srv, KVT_PERR_BAD_BODY);
    unsigned unknown = h->flags & ~(unsigned)kvt_proto_req_flags(h->opcode);
    if (unknown)
        kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_EPROTO, "unknown %s flag bits 0x%x",
                         what, unknown);
    else
        kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_EPROTO,
                         "malformed %s body (%u bytes)", what, h->body_len);
    return 0;
}

int kvt__need_hello(kvt__conn_t *c, const kvt_proto_hdr_t *h, uint64_t t0)
{
    if (c->hello)
        return 0;
    kvt__proto_error(c->srv, KVT_PERR_NO_HELLO);
    kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_EPROTO,
                     "HELLO must declare a namespace first");
    return -1;
}
