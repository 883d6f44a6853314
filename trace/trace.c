/*
 * trace.c: the Mooncake JSONL reader and the canonical hash-id-to-token mapping.
 *
 * The reader accepts the record shape the traces use: one JSON object per line with the integer
 * fields timestamp, input_length, output_length and the integer array hash_ids, in any order.
 * Other keys are skipped whatever their value (traces from other tools carry extra fields, and a
 * reader that refuses them makes people edit gigabytes of JSON), and the timestamp may have a
 * fraction (tools that write float milliseconds), which is dropped. It is not a general JSON
 * parser: a malformed record, or a known field of the wrong shape, is KVT_EPROTO.
 *
 * Two optional fields carry engine hints (traces/README.md): hint_pause_ms, an integer in
 * 1..4294967294 (the session paused for a tool call, expected back in that many ms), and
 * hint_finished, true or false (or 1 or 0). A record that says both, paused and finished, is
 * malformed.
 */
#include "trace.h"

#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static uint64_t splitmix_mix(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

void kvt_trace_block_tokens(uint64_t hash_id, uint32_t out[KVT_TRACE_BLOCK_TOKENS])
{
    uint64_t state = splitmix_mix(hash_id + 1);
    for (int i = 0; i < KVT_TRACE_BLOCK_TOKENS; i++) {
        state += 0x9E3779B97F4A7C15ull;
        out[i] = (uint32_t)(splitmix_mix(state) % KVT_TRACE_VOCAB);
    }
}

void kvt_trace_tokens(const kvt_trace_req_t *r, uint32_t *out)
{
    uint32_t left = r->input_length;
    for (uint32_t b = 0; b < r->nhash && left > 0; b++) {
        uint32_t tmp[KVT_TRACE_BLOCK_TOKENS];
        uint32_t n = left < KVT_TRACE_BLOCK_TOKENS ? left : KVT_TRACE_BLOCK_TOKENS;
        if (n == KVT_TRACE_BLOCK_TOKENS) {
            kvt_trace_block_tokens(r->hash_ids[b], out);
        } else {
            kvt_trace_block_tokens(r->hash_ids[b], tmp);
            memcpy(out, tmp, n * sizeof(uint32_t));
        }
        out += n;
        left -= n;
    }
}

/*
 * The block cache: sets of two ways, a set chosen by the mixed id (the traces' ids are small
 * consecutive integers; mixed, they spread over the sets). The ids and each set's state are
 * small arrays apart from the tokens, so that a lookup touches a token block only on a hit.
 * The token store is malloc'd, not zeroed: a way is read only once its valid bit says it was
 * filled, and pages of the store that no set reaches are never touched.
 */
#define CACHE_MAX_BLOCKS ((size_t)1 << 24)

struct kvt_trace_cache {
    size_t mask;    /* sets - 1 */
    uint64_t *ids;  /* 2 per set */
    uint8_t *state; /* per set: bit 0 and 1, way 0 and 1 filled; bit 2, way 1 used last */
    uint32_t *toks; /* 2 * 512 per set */
    uint64_t lookups, hits;
};

int kvt_trace_cache_create(kvt_trace_cache_t **out, size_t blocks)
{
    if (!out || blocks > CACHE_MAX_BLOCKS)
        return KVT_EINVAL;
    *out = NULL;
    size_t sets = 1;
    while (2 * sets < blocks)
        sets *= 2;
    kvt_trace_cache_t *c = calloc(1, sizeof(*c));
    if (!c)
        return KVT_ENOMEM;
    c->mask = sets - 1;
    c->ids = malloc(2 * sets * sizeof(*c->ids));
    c->state = calloc(sets, 1);
    c->toks = malloc(2 * sets * KVT_TRACE_BLOCK_TOKENS * sizeof(*c->toks));
    if (!c->ids || !c->state || !c->toks) {
        kvt_trace_cache_free(c);
        return KVT_ENOMEM;
    }
    *out = c;
    return 0;
}

void kvt_trace_cache_free(kvt_trace_cache_t *c)
{
    if (!c)
        return;
    free(c->ids);
    free(c->state);
    free(c->toks);
    free(c);
}

/* The 512 tokens of id, from the cache or expanded into it. */
static const uint32_t *cache_block(kvt_trace_cache_t *c, uint64_t id)
{
    size_t set = (size_t)splitmix_mix(id) & c->mask;
    uint8_t st = c->state[set];
    uint64_t *ids = c->ids + 2 * set;
    c->lookups++;
    int way;
    if ((st & 1) && ids[0] == id) {
        way = 0;
        c->hits++;
    } else if ((st & 2) && ids[1] == id) {
        way = 1;
        c->hits++;
    } else {
        /* an empty way first, else the one not used last */
        way = !(st & 1) ? 0 : !(st & 2) ? 1 : !(st & 4);
        ids[way] = id;
        st |= (uint8_t)(1u << way);
        kvt_trace_block_tokens(id, c->toks + (2 * set + (size_t)way) * KVT_TRACE_BLOCK_TOKENS);
    }
    c->state[set] = (uint8_t)(way ? st | 4 : st & ~4);
    return c->toks + (2 * set + (size_t)way) * KVT_TRACE_BLOCK_TOKENS;
}

void kvt_trace_tokens_cached(kvt_trace_cache_t *c, const kvt_trace_req_t *r, uint32_t *out)
{
    uint32_t left = r->input_length;
    for (uint32_t b = 0; b < r->nhash && left > 0; b++) {
        uint32_t n = left < KVT_TRACE_BLOCK_TOKENS ? left : KVT_TRACE_BLOCK_TOKENS;
        memcpy(out, cache_block(c, r->hash_ids[b]), n * sizeof(uint32_t));
        out += n;
        left -= n;
    }
}

void kvt_trace_cache_stats(const kvt_trace_cache_t *c, uint64_t *lookups, uint64_t *hits)
{
    *lookups = c->lookups;
    *hits = c->hits;
}

/* A cursor over one line. */
typedef struct {
    const char *p, *end;
} cursor_t;

static void skip_ws(cursor_t *c)
{
    while (c->p < c->end && isspace((unsigned char)*c->p))
        c->p++;
}

static int expect(cursor_t *c, char ch)
{
    skip_ws(c);
    if (c->p >= c->end || *c->p != ch)
        return KVT_EPROTO;
    c->p++;
    return 0;
}

static int parse_u64(cursor_t *c, uint64_t *v)
{
    skip_ws(c);
    if (c->p >= c->end || !isdigit((unsigned char)*c->p))
        return KVT_EPROTO;
    uint64_t x = 0;
    while (c->p < c->end && isdigit((unsigned char)*c->p)) {
        uint64_t d = (uint64_t)(*c->p - '0');
        if (x > (UINT64_MAX - d) / 10)
            return KVT_EPROTO;
        x = x * 10 + d;
        c->p++;
    }
    *v = x;
    return 0;
}

/* A timestamp in milliseconds: an integer, or one with a fraction that is dropped (12.75 is
 * 12). No exponent: the traces' timestamps are plain numbers. */
static int parse_ms(cursor_t *c, uint64_t *v)
{
    int rc = parse_u64(c, v);
    if (rc != 0 || c->p >= c->end || *c->p != '.')
        return rc;
    c->p++;
    if (c->p >= c->end || !isdigit((unsigned char)*c->p))
        return KVT_EPROTO;
    while (c->p < c->end && isdigit((unsigned char)*c->p))
        c->p++;
    return 0;
}

/* A flag: true, false, 1 or 0. */
static int parse_flag(cursor_t *c, uint8_t *v)
{
    skip_ws(c);
    size_t left = (size_t)(c->end - c->p);
    if (left >= 4 && memcmp(c->p, "true", 4) == 0) {
        *v = 1;
        c->p += 4;
    } else if (left >= 5 && memcmp(c->p, "false", 5) == 0) {
        *v = 0;
        c->p += 5;
    } else if (left >= 1 && (*c->p == '0' || *c->p == '1')) {
        *v = (uint8_t)(*c->p - '0');
        c->p++;
    } else {
        return KVT_EPROTO;
    }
    /* "truex", "10": not a flag */
    if (c->p < c->end && (isalnum((unsigned char)*c->p) || *c->p == '.'))
        return KVT_EPROTO;
    return 0;
}

/* Past a JSON string whose opening quote is at c->p, escapes included. */
static int skip_string(cursor_t *c)
{
    if (c->p >= c->end || *c->p != '"')
        return KVT_EPROTO;
    for (c->p++; c->p < c->end; c->p++) {
        if (*c->p == '\\') {
            c->p++;
            continue;
        }
        if (*c->p == '"') {
            c->p++;
            return 0;
        }
    }
    return KVT_EPROTO;
}

/* Past one JSON value of a key the reader does not know. Nesting is bounded so that a hostile
 * line cannot exhaust the stack. */
static int skip_value(cursor_t *c, int depth)
{
    skip_ws(c);
    if (c->p >= c->end || depth > 64)
        return KVT_EPROTO;
    char ch = *c->p;
    if (ch == '"')
        return skip_string(c);
    if (ch == '{' || ch == '[') {
        char close = ch == '{' ? '}' : ']';
        int rc;
        c->p++;
        skip_ws(c);
        if (c->p < c->end && *c->p == close) {
            c->p++;
            return 0;
        }
        for (;;) {
            if (ch == '{') {
                skip_ws(c);
                if ((rc = skip_string(c)) != 0 || (rc = expect(c, ':')) != 0)
                    return rc;
            }
            if ((rc = skip_value(c, depth + 1)) != 0)
                return rc;
            skip_ws(c);
            if (c->p < c->end && *c->p == ',') {
                c->p++;
                continue;
            }
            return expect(c, close);
        }
    }
    /* A number or a literal: the characters they are made of. */
    const char *start = c->p;
    while (c->p < c->end && (isalnum((unsigned char)*c->p) || strchr("+-.", *c->p)))
        c->p++;
    size_t n = (size_t)(c->p - start);
    if (n == 0)
        return KVT_EPROTO;
    if ((n == 4 && (!memcmp(start, "true", 4) || !memcmp(start, "null", 4))) ||
        (n == 5 && !memcmp(start, "false", 5)))
        return 0;
    if (!isdigit((unsigned char)*start) && *start != '-')
        return KVT_EPROTO;
    return 0;
}

typedef struct {
    uint64_t *ids;
    size_t n, cap;
} idvec_t;

static int idvec_push(idvec_t *v, uint64_t x)
{
    if (v->n == v->cap) {
        size_t cap = v->cap ? v->cap * 2 : 4096;
        uint64_t *ids = realloc(v->ids, cap * sizeof(*ids));
        if (!ids)
            return KVT_ENOMEM;
        v->ids = ids;
        v->cap = cap;
    }
    v->ids[v->n++] = x;
    return 0;
}

/* Parses one record; hash ids are appended to ids and their count stored in r->nhash. */
static int parse_line(const char *line, size_t len, kvt_trace_req_t *r, idvec_t *ids)
{
    cursor_t c = {line, line + len};
    int seen = 0, rc;
    if ((rc = expect(&c, '{')) != 0)
        return rc;
    for (;;) {
        skip_ws(&c);
        const char *key = c.p + 1;
        if ((rc = skip_string(&c)) != 0)
            return rc;
        size_t klen = (size_t)(c.p - 1 - key);
        if ((rc = expect(&c, ':')) != 0)
            return rc;
        uint64_t v;
        /* A field named twice is refused: the second "hash_ids" would have added its ids to the
         * trace's store after the first's, and the request pointed at the first's. */
        int field = klen == 9 && memcmp(key, "timestamp", 9) == 0         ? 1
                    : klen == 12 && memcmp(key, "input_length", 12) == 0  ? 2
                    : klen == 13 && memcmp(key, "output_length", 13) == 0 ? 4
                    : klen == 8 && memcmp(key, "hash_ids", 8) == 0        ? 8
                                                                          : 0;
        if (seen & field)
            return KVT_EPROTO;
        if (field == 1) {
            if ((rc = parse_ms(&c, &v)) != 0)
                return rc;
            r->timestamp_ms = v;
            seen |= 1;
        } else if (field == 2) {
            if ((rc = parse_u64(&c, &v)) != 0 || v > UINT32_MAX)
                return KVT_EPROTO;
            r->input_length = (uint32_t)v;
            seen |= 2;
        } else if (field == 4) {
            if ((rc = parse_u64(&c, &v)) != 0 || v > UINT32_MAX)
                return KVT_EPROTO;
            r->output_length = (uint32_t)v;
            seen |= 4;
        } else if (field == 8) {
            if ((rc = expect(&c, '[')) != 0)
                return rc;
            skip_ws(&c);
            r->nhash = 0;
            if (c.p < c.end && *c.p == ']') {
                c.p++;
            } else {
                for (;;) {
                    if ((rc = parse_u64(&c, &v)) != 0 || (rc = idvec_push(ids, v)) != 0)
                        return rc;
                    r->nhash++;
                    skip_ws(&c);
                    if (c.p < c.end && *c.p == ',') {
                        c.p++;
                        continue;
                    }
                    if ((rc = expect(&c, ']')) != 0)
                        return rc;
                    break;
                }
            }
            seen |= 8;
        } else if (klen == 13 && memcmp(key, "hint_pause_ms", 13) == 0) {
            if ((rc = parse_u64(&c, &v)) != 0 || v == 0 || v >= UINT32_MAX)
                return KVT_EPROTO;
            r->hint_pause_ms = (uint32_t)v;
        } else if (klen == 13 && memcmp(key, "hint_finished", 13) == 0) {
            if ((rc = parse_flag(&c, &r->hint_finished)) != 0)
                return rc;
        } else if ((rc = skip_value(&c, 0)) != 0) {
            return rc;
        }
        skip_ws(&c);
        if (c.p < c.end && *c.p == ',') {
            c.p++;
            continue;
        }
        if ((rc = expect(&c, '}')) != 0)
            return rc;
        break;
    }
    if ((seen & 0xb) != 0xb || (r->hint_pause_ms && r->hint_finished))
        return KVT_EPROTO;
    /* The trace's promise: one id per 512-token block of the prompt. */
    if (r->nhash != (r->input_length + KVT_TRACE_BLOCK_TOKENS - 1) / KVT_TRACE_BLOCK_TOKENS)
        return KVT_EPROTO;
    return 0;
}

int kvt_trace_load(kvt_trace_t **out, const char *path)
{
    if (!out || !path)
        return KVT_EINVAL;
    *out = NULL;
    FILE *f = fopen(path, "r");
    if (!f)
        return -errno;
    kvt_trace_t *tr = calloc(1, sizeof(*tr));
    idvec_t ids = {0};
    size_t *first = NULL, cap = 0;
    char *line = NULL;
    size_t linecap = 0;
    ssize_t len;
    int rc = 0;
    size_t lineno = 0;
    if (!tr || !(tr->path = strdup(path))) {
        rc = KVT_ENOMEM;
        goto fail;
    }
    while ((len = getline(&line, &linecap, f)) >= 0) {
        lineno++;
        size_t l = (size_t)len;
        while (l > 0 && isspace((unsigned char)line[l - 1]))
            l--;
        if (l == 0)
            continue;
        if (tr->nreqs == cap) {
            size_t ncap = cap ? cap * 2 : 1024;
            kvt_trace_req_t *reqs = realloc(tr->reqs, ncap * sizeof(*reqs));
            size_t *nfirst = realloc(first, ncap * sizeof(*nfirst));
            if (reqs)
                tr->reqs = reqs;
            if (nfirst)
                first = nfirst;
            if (!reqs || !nfirst) {
                rc = KVT_ENOMEM;
                goto fail;
            }
            cap = ncap;
        }
        kvt_trace_req_t *r = &tr->reqs[tr->nreqs];
        memset(r, 0, sizeof(*r));
        first[tr->nreqs] = ids.n;
        if ((rc = parse_line(line, l, r, &ids)) != 0) {
            if (rc == KVT_EPROTO)
                kvt_log(KVT_LOG_ERROR, "%s:%zu: not a Mooncake trace record", path, lineno);
            goto fail;
        }
        tr->total_tokens += r->input_length;
        if (r->input_length > tr->max_input_length)
            tr->max_input_length = r->input_length;
        tr->nreqs++;
    }
    if (ferror(f)) {
        rc = KVT_EIO;
        goto fail;
    }
    /* Pointers into ids only now that it has stopped moving; none where no request had an id
     * (an empty prompt): no store was ever allocated, and NULL + 0 is undefined in C. */
    tr->ids = ids.ids;
    tr->nids = ids.n;
    for (size_t i = 0; i < tr->nreqs; i++)
        tr->reqs[i].hash_ids = tr->ids ? tr->ids + first[i] : NULL;
    free(first);
    free(line);
    fclose(f);
    *out = tr;
    return 0;
fail:
    free(first);
    free(line);
    free(ids.ids);
    fclose(f);
    if (tr) {
        free(tr->reqs);
        free(tr->path);
        free(tr);
    }
    return rc;
}

void kvt_trace_free(kvt_trace_t *tr)
{
    if (!tr)
        return;
    free(tr->reqs);
    free(tr->ids);
    free(tr->path);
    free(tr);
}

const char *kvt_trace_name(const kvt_trace_t *tr, char *buf, size_t len)
{
    const char *base = strrchr(tr->path, '/');
    base = base ? base + 1 : tr->path;
    snprintf(buf, len, "%s", base);
    char *dot = strrchr(buf, '.');
    if (dot && dot != buf)
        *dot = '\0';
    return buf;
}
