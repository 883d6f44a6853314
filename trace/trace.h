/*
 * trace.h: Mooncake JSONL request traces (traces/ at the repository root, with their notice) and
 * the one canonical mapping from their 512-token block hash ids to token ids, so that every
 * replay in the project and outside it sees the same tokens.
 */
#ifndef KVT_TRACE_H
#define KVT_TRACE_H

#include <stddef.h>
#include <stdint.h>

#include "common.h"

#define KVT_TRACE_BLOCK_TOKENS 512
#define KVT_TRACE_VOCAB        151936u /* Qwen2's vocabulary size */

typedef struct kvt_trace_req {
    uint64_t timestamp_ms; /* a fraction in the trace is dropped */
    uint32_t input_length;
    uint32_t output_length;
    uint32_t nhash;
    const uint64_t *hash_ids; /* nhash ids, owned by the trace */
    /* Engine hints the record carries (traces/README.md, "Engine hints"): what an engine knows
     * when this request's generation ends. hint_pause_ms: the reply was a tool call and the
     * session is expected back in this many ms (0: no pause); hint_finished: the session
     * ended. At most one of them is set. */
    uint32_t hint_pause_ms;
    uint8_t hint_finished;
} kvt_trace_req_t;

typedef struct kvt_trace {
    char *path;
    kvt_trace_req_t *reqs;
    size_t nreqs;
    uint64_t *ids; /* backing store for every request's hash_ids */
    size_t nids;
    uint64_t total_tokens;
    uint32_t max_input_length;
} kvt_trace_t;

/* Loads a trace file. Returns 0, a negated errno from opening or reading the file, KVT_ENOMEM,
 * or KVT_EPROTO for a malformed line (logged with its line number; nothing is returned). */
int kvt_trace_load(kvt_trace_t **out, const char *path);
void kvt_trace_free(kvt_trace_t *tr);

/* Writes the request's input_length token ids into out (which holds at least that many). */
void kvt_trace_tokens(const kvt_trace_req_t *r, uint32_t *out);
/* The 512 token ids of one block hash id. */
void kvt_trace_block_tokens(uint64_t hash_id, uint32_t out[KVT_TRACE_BLOCK_TOKENS]);

/*
 * A bounded cache of expanded blocks, for a reader that expands the same blocks again and again
 * (a replay: every request of a session expands its whole prompt, the earlier turns included).
 * It keeps the tokens of up to `blocks` block ids, 2 KiB each, two ways per set with the one
 * used last kept, and changes nothing about the tokens: kvt_trace_tokens_cached() writes exactly
 * what kvt_trace_tokens() writes. One thread at a time.
 *
 * kvt_trace_cache_create: `blocks` is rounded up to a power of two, at least 2, at most 2^24.
 * Returns 0, KVT_EINVAL (out NULL or blocks over the limit) or KVT_ENOMEM. The caller frees it
 * with kvt_trace_cache_free() (NULL is a no-op).
 */
typedef struct kvt_trace_cache kvt_trace_cache_t;
int kvt_trace_cache_create(kvt_trace_cache_t **out, size_t blocks);
void kvt_trace_cache_free(kvt_trace_cache_t *c);
/* kvt_trace_tokens() through the cache c (not NULL). */
void kvt_trace_tokens_cached(kvt_trace_cache_t *c, const kvt_trace_req_t *r, uint32_t *out);
/* Lookups since the cache was made, and how many of them found the block. */
void kvt_trace_cache_stats(const kvt_trace_cache_t *c, uint64_t *lookups, uint64_t *hits);

/* The base name of the trace file without extension, e.g. "mooncake-conversation". */
const char *kvt_trace_name(const kvt_trace_t *tr, char *buf, size_t len);

#endif
