/*
 * ns.c: what the daemon knows of a namespace beyond the tree (the block size clients declared,
 * who uses it), and the closing of empty namespaces nobody uses so that their ids can be reused.
 */
#include "server.h"

#include <stdlib.h>
#include <string.h>

int kvt__ns_get(kvt_srv_t *s, uint32_t ns, kvt__ns_t **out)
{
    size_t old = s->cap_ns;
    if (kvt_reserve(&s->ns, &s->cap_ns, (size_t)ns + 1, sizeof *s->ns, 8) < 0)
        return KVT_ENOMEM;
    memset(s->ns + old, 0, (s->cap_ns - old) * sizeof *s->ns);
    if (ns >= s->nns)
        s->nns = ns + 1;
    *out = &s->ns[ns];
    return 0;
}

void kvt__ns_use(kvt_srv_t *s, uint32_t ns)
{
    kvt_assert(ns < s->nns); /* every id in use was declared by a HELLO, which made its entry */
    s->ns[ns].users++;
}

void kvt__ns_unuse(kvt_srv_t *s, uint32_t ns)
{
    kvt_assert(ns < s->nns && s->ns[ns].users > 0);
    if (--s->ns[ns].users == 0)
        s->ns[ns].idle_ns = kvt_now_ns(); /* kvt__ns_evict takes the longest unused first */
}

uint32_t kvt__ns_reclaim(kvt_srv_t *s)
{
    uint32_t closed = 0;
    for (uint32_t id = 0; id < KVT_RADIX_NS_MAX; id++) {
        if ((id < s->nns && s->ns[id].users) || !kvt__ns_page_size(s, id) ||
            kvt__ns_close(s, id) < 0) /* KVT_EBUSY: it holds pages */
            continue;
        kvt_policy_forget_ns(s->policy, id);
        if (id < s->nns)
            s->ns[id] = (kvt__ns_t){0};
        closed++;
    }
    kvt__metric_add(s->metrics, KVT_M_NAMESPACES_CLOSED, 0, closed);
    static kvt_log_limit_t lim; /* a HELLO flood at a full daemon would repeat it */
    if (closed)
        kvt_log_limited(&lim, KVT_LOG_INFO,
                        "kvtierd: closed %u empty namespaces no client uses, for new ones", closed);
    else
        kvt_log_limited(&lim, KVT_LOG_WARN,
                        "kvtierd: no namespace can be closed (each holds pages or is in use): "
                        "new ones are refused");
    return closed;
}
