/*
 * auth.c: AUTH. The secret is compared in constant time, and wrong guesses, over all
 * connections together, are throttled by a token bucket (auth-failures-per-s) with a bounded wait
 * line answered by the tick.
 */
#include "server.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

/*
 * Guessing the secret. Wrong AUTHs, over all connections together, take tokens from a bucket of
 * auth-failures-per-s refilled at that rate. An AUTH is answered at once while no other waits
 * and a token is left (a wrong one takes it); otherwise it waits in line, its connection read no
 * further, and the tick answers the line's head whenever a token is there, right or wrong alike,
 * taking one either way: were a right one answered sooner, the wait itself would tell a guesser
 * it guessed wrong, and guessing would go on at full speed with a short timeout. A guesser thus
 * learns the answer to at most that many guesses a second, whatever number of connections it
 * uses, and the loop never waits for anyone. Waiting AUTHs hold connection slots, so the line is
 * at most auth-wait-ms of tokens long; an AUTH past it gets EAGAIN at once, its secret unchecked.
 */
static void auth_refill(kvt_srv_t *s, uint64_t now)
{
    double rate = s->conf->auth_failures_per_s;
    if (s->auth.refill_ns == 0)
        s->auth.tokens = rate; /* the bucket starts full */
    else if (now > s->auth.refill_ns)
        s->auth.tokens =
            KVT_MIN(rate, s->auth.tokens + (double)(now - s->auth.refill_ns) * rate / 1e9);
    s->auth.refill_ns = now;
}

static int auth_failed(kvt__conn_t *c, uint64_t id)
{
    static kvt_log_limit_t lim; /* a guesser's every try */
    kvt__proto_error(c->srv, KVT_PERR_AUTH);
    kvt_log_limited(&lim, KVT_LOG_INFO, "kvtierd: connection %llu: AUTH request %llu: wrong secret",
                    (unsigned long long)c->id, (unsigned long long)id);
    return KVT_EAUTH;
}

/* Answers the AUTH c waits with, in its place in c's queue. */
static void auth_answer(kvt__conn_t *c, int status)
{
    static const char wrong[] = "wrong secret", stop[] = "the daemon is shutting down";
    kvt__req_t *r = c->auth_req;
    c->auth_wait = 0;
    c->auth_req = NULL;
    r->status = status;
    if (status == 0) {
        c->authed = 1;
        kvt__req_reply(r, NULL, 0);
    } else {
        if (status == KVT_EAUTH)
            auth_failed(c, r->id);
        c->closing = 1;
        kvt__req_reply(r, status == KVT_EAUTH ? wrong : stop,
                       status == KVT_EAUTH ? sizeof wrong - 1 : sizeof stop - 1);
    }
    kvt__req_finish(r); /* kicks c: its queue moves on, and it reads again or closes */
}

static int auth_order(const void *a, const void *b)
{
    uint64_t x = (*(kvt__conn_t *const *)a)->auth_seq, y = (*(kvt__conn_t *const *)b)->auth_seq;
    return x < y ? -1 : x > y;
}

void kvt__auth_tick(kvt_srv_t *s, uint64_t now)
{
    if (!s->auth.waiting)
        return;
    auth_refill(s, now);
    /* Connections closed since they began waiting left the list with their AUTH. */
    uint32_t n = 0;
    for (kvt__conn_t *c = s->clients.list; c; c = c->next)
        n += !c->gone && c->auth_wait;
    s->auth.waiting = n;
    if (n == 0 || (s->auth.tokens < 1 && !s->stopping))
        return;
    kvt__conn_t **line = malloc(n * sizeof *line);
    if (!line)
        return; /* the next tick tries again */
    n = 0;
    for (kvt__conn_t *c = s->clients.list; c; c = c->next)
        if (!c->gone && c->auth_wait)
            line[n++] = c;
    qsort(line, n, sizeof *line, auth_order);
    uint32_t i = 0;
    for (; i < n && (s->auth.tokens >= 1 || s->stopping); i++) {
        if (line[i]->gone || !line[i]->auth_wait)
            continue;      /* closed by an answer before it (not by one of its own: never) */
        if (s->stopping) { /* no more turns to wait for: answered unchecked */
            auth_answer(line[i], KVT_EAGAIN);
            continue;
        }
        s->auth.tokens -= 1;
        auth_answer(line[i], line[i]->auth_req->status);
    }
    s->auth.waiting = n - i;
    free(line);
}

int kvt__h_auth(kvt__conn_t *c, const kvt_proto_hdr_t *h, const uint8_t *body, uint64_t t0)
{
    kvt_srv_t *s = c->srv;
    const char *secret = s->conf->secret;
    size_t sl = strlen(secret);
    if (h->body_len == 0 || h->body_len > KVT_PROTO_SECRET_MAX) {
        /* A secret is 1..1024 bytes: this is no guess, and with a secret set the connection
         * cannot go on unauthenticated. */
        kvt__bad_body(c, h, t0, "AUTH");
        return sl && !c->authed ? KVT_EPROTO : 0;
    }
    if (!sl) {
        c->authed = 1;
        return kvt__reply(c, h->opcode, h->request_id, t0, 0, NULL, 0);
    }
    /* Constant time in the secret's length: the comparison leaks nothing but that. */
    unsigned diff = (unsigned)(h->body_len != sl);
    for (size_t i = 0; i < sl; i++)
        diff |= (unsigned)(secret[i] ^ (i < h->body_len ? body[i] : 0));
    if (diff)
        kvt__metric_add(s->metrics, KVT_M_AUTH_FAILURES, 0, 1);
    uint32_t rate = s->conf->auth_failures_per_s;
    if (rate) {
        auth_refill(s, t0);
        if (s->auth.waiting || s->auth.tokens < 1) {
            uint64_t most = KVT_MAX((uint64_t)rate * s->conf->auth_wait_ms / 1000, 1);
            if (s->auth.waiting >= most) {
                kvt__metric_add(s->metrics, KVT_M_AUTH_REFUSED, 0, 1);
                kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_EAGAIN,
                                 "AUTH refused unchecked: too many wait their turn "
                                 "(auth-failures-per-s %u); try again later",
                                 rate);
                return KVT_EAGAIN;
            }
            kvt__req_t *r = kvt__req_new(c, KVT_REQ_PLAIN, h->opcode, h->request_id, t0);
            if (!r) {
                kvt__reply_error(c, h->opcode, h->request_id, t0, KVT_ENOMEM, "out of memory");
                return KVT_ENOMEM;
            }
            r->status = diff ? KVT_EAUTH : 0; /* told when its turn comes */
            c->auth_req = r;
            c->auth_wait = 1;
            c->auth_seq = ++s->auth.seq;
            s->auth.waiting++;
            kvt__metric_add(s->metrics, KVT_M_AUTH_DELAYED, 0, 1);
            return 0;
        }
        if (diff)
            s->auth.tokens -= 1;
    }
    if (diff) {
        auth_failed(c, h->request_id);
        kvt__reply(c, h->opcode, h->request_id, t0, KVT_EAUTH, "wrong secret", 12);
        return KVT_EAUTH;
    }
    c->authed = 1;
    return kvt__reply(c, h->opcode, h->request_id, t0, 0, NULL, 0);
}
