/*
 * fuzz_trace.c: libFuzzer harness for the Mooncake trace reader (trace/trace.c): the input is a
 * trace file (JSON lines), loaded through a memfd's /proc path. A trace it accepts must hold
 * together: every request's hash ids inside the trace's id store, the store exactly as long as
 * the requests' ids together, one id per 512-token block of each prompt, and the totals the sums
 * of the requests'. The token ids of each request are expanded, as a replay does.
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "trace.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerInitialize(int *argc, char ***argv);

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    kvt_log_set_level((kvt_log_level_t)(KVT_LOG_ERROR + 1)); /* each refusal logs its line */
    return 0;
}

static void check(const kvt_trace_t *tr)
{
    uint64_t ids = 0, total = 0;
    uint32_t max = 0;
    uint32_t *tok = NULL;
    for (size_t i = 0; i < tr->nreqs; i++) {
        const kvt_trace_req_t *r = &tr->reqs[i];
        if (r->nhash != (r->input_length + KVT_TRACE_BLOCK_TOKENS - 1) / KVT_TRACE_BLOCK_TOKENS)
            abort();
        if (r->nhash && (r->hash_ids < tr->ids || r->hash_ids + r->nhash > tr->ids + tr->nids))
            abort();
        ids += r->nhash;
        total += r->input_length;
        max = r->input_length > max ? r->input_length : max;
        /* Expanded as a replay does, for prompts of a size a run can afford. */
        if (r->input_length <= 1u << 16) {
            uint32_t *t = realloc(tok, (size_t)(r->input_length ? r->input_length : 1) * 4);
            if (!t)
                break;
            tok = t;
            kvt_trace_tokens(r, tok);
            for (uint32_t k = 0; k < r->input_length; k++)
                if (tok[k] >= KVT_TRACE_VOCAB)
                    abort();
        }
    }
    free(tok);
    /* The id store holds the accepted requests' ids and nothing else: a request's ids are the
     * ones its own line listed. */
    if (ids != tr->nids || total != tr->total_tokens || max != tr->max_input_length)
        abort();
    char name[256];
    (void)kvt_trace_name(tr, name, sizeof name);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size > 1 << 20)
        return 0;
    int fd = memfd_create("trace.jsonl", MFD_CLOEXEC);
    if (fd < 0)
        return 0;
    if (write(fd, data, size) == (ssize_t)size) {
        char path[64];
        snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
        kvt_trace_t *tr = NULL;
        int rc = kvt_trace_load(&tr, path);
        if (rc == 0) {
            check(tr);
            kvt_trace_free(tr);
        } else if (tr) {
            abort(); /* a refused trace returns nothing */
        }
    }
    close(fd);
    return 0;
}
