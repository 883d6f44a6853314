/*
 * fuzz_http.c: libFuzzer harness for the metrics endpoint's request parsing (server/http.c,
 * kvt__http_parse): the input arrives as a socket would deliver it, in reads of the size its
 * first byte names, into the endpoint's 8 KiB head buffer, and is parsed after each read the way
 * the endpoint does, until it is answered or the buffer is full. An answer to /metrics or
 * /healthz must come from a GET or HEAD request line for that path.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "server.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define HEAD_MAX 8192 /* http.c's KVT_HTTP_HEAD_MAX */

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    size_t chunk = data[0] ? data[0] : 1;
    data++;
    size--;
    char *head = malloc(HEAD_MAX);
    if (!head)
        return 0;
    size_t len = 0;
    kvt__http_req_t req = KVT__HTTP_MORE;
    int head_only = 0;
    while (req == KVT__HTTP_MORE && len < size) {
        size_t n = size - len;
        n = n < chunk ? n : chunk;
        n = n < HEAD_MAX - 1 - len ? n : HEAD_MAX - 1 - len;
        memcpy(head + len, data + len, n);
        len += n;
        head[len] = 0;
        req = kvt__http_parse(head, len, len == HEAD_MAX - 1, &head_only);
        if (req == KVT__HTTP_MORE && len == HEAD_MAX - 1)
            abort(); /* a full buffer is always answered */
    }
    if (req == KVT__HTTP_METRICS || req == KVT__HTTP_HEALTHZ) {
        const char *path = req == KVT__HTTP_METRICS ? "/metrics" : "/healthz";
        const char *sp = strchr(head, ' ');
        int get = !strncmp(head, "GET ", 4), hd = !strncmp(head, "HEAD ", 5);
        if (!(get || hd) || hd != head_only || !sp || strncmp(sp + 1, path, 8) != 0 ||
            (sp[9] != ' ' && sp[9] != '?'))
            abort();
    }
    free(head);
    return 0;
}
