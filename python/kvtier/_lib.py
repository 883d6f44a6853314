"""_lib.py: loads libkvtier with cffi in ABI mode (no compiler needed when installing) and
declares the part of client/kvtier.h that the package calls.

Where libkvtier comes from, first match wins:

1. ``$KVTIER_LIB``: a path to the library (a file name without a slash is looked up by the
   dynamic loader). If it is set and fails to load, that is an error, not a fallback.
2. Next to the package: ``kvtier/libkvtier.so`` (the wheel's own copy: ``pip install .`` from
   the repository root builds it there) or ``kvtier/libkvtier.so.0``.
3. ``$KVT_BUILD_ROOT/client/libkvtier.so`` (the meson build tree the tests run from).
4. ``<source>/build/client/libkvtier.so`` when the package is imported from a source checkout
   (``python/kvtier`` beside ``build/``).
5. The dynamic loader's search path, by name: ``libkvtier.so.0`` (``meson install`` puts it in
   the library directory; run ``ldconfig`` or set ``LD_LIBRARY_PATH``).

cffi rather than ctypes: ``ffi.from_buffer`` borrows any buffer, read-only ones included
(``bytes``, a read-only numpy array), without a copy, where ctypes' ``from_buffer`` insists on
writable buffers; and cffi releases the GIL around every C call, so that other Python threads
(and an asyncio loop using the executor form) run while a call waits on the daemon.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, List

import cffi  # type: ignore[import-untyped]

CDEF = """
enum {
    KVT_CLIENT_EINVAL = -30800,
    KVT_CLIENT_ENOMEM = -30801,
    KVT_CLIENT_ENOENT = -30802,
    KVT_CLIENT_EBUSY = -30803,
    KVT_CLIENT_ENOSPC = -30804,
    KVT_CLIENT_ECORRUPT = -30805,
    KVT_CLIENT_EIO = -30806,
    KVT_CLIENT_EPROTO = -30807,
    KVT_CLIENT_EUNAVAIL = -30808,
    KVT_CLIENT_ETIMEDOUT = -30809,
    KVT_CLIENT_EAUTH = -30813,
    KVT_CLIENT_ETOOBIG = -30814,
    KVT_CLIENT_ECLOSED = -30812,
};
const char *kvt_client_strerror(int err);

typedef struct kvt_client kvt_client_t;
typedef struct kvt_client_conf {
    const char *unix_path;
    const char *tcp;
    const char *secret;
    const char *model;
    const char *adapter;
    const char *salt;
    uint32_t page_size;
    uint32_t block_bytes;
    int timeout_ms;
    int zero_copy;
    int device;
} kvt_client_conf_t;

int kvt_client_connect(kvt_client_t **out, const kvt_client_conf_t *conf);
void kvt_client_close(kvt_client_t *c);
const char *kvt_client_errmsg(const kvt_client_t *c);
uint64_t kvt_client_ns_seed(const kvt_client_t *c);
unsigned kvt_client_tiers(const kvt_client_t *c);

typedef struct kvt_client_hints {
    uint64_t engine_request_id;
    uint32_t resume_ms;
    uint16_t priority;
    uint16_t flags;
} kvt_client_hints_t;

typedef struct kvt_client_match {
    uint32_t tokens;
    uint32_t pages;
    uint32_t remote_pages;
    uint64_t lease;
    uint8_t *tiers;
    uint32_t tiers_cap;
} kvt_client_match_t;

typedef struct kvt_client_put {
    uint32_t pages;
    uint32_t new_pages;
    uint32_t stored;
    uint32_t skipped;
} kvt_client_put_t;

typedef struct kvt_client_prefetch {
    uint32_t pages, moved, resident, failed;
} kvt_client_prefetch_t;

int kvt_client_ping(kvt_client_t *c, uint64_t *rtt_ns);
int kvt_client_match(kvt_client_t *c, const uint32_t *tokens, uint32_t ntokens, unsigned flags,
                     uint32_t lease_ms, const kvt_client_hints_t *hints, kvt_client_match_t *res);
int kvt_client_put(kvt_client_t *c, const uint32_t *tokens, uint32_t ntokens, uint32_t first_page,
                   uint32_t npages, const void *payload, const kvt_client_hints_t *hints,
                   kvt_client_put_t *res);
int kvt_client_get(kvt_client_t *c, uint64_t lease, uint32_t first_page, uint32_t npages, void *buf,
                   size_t cap, uint32_t *got, uint8_t *tiers);
typedef int (*kvt_client_block_cb)(void *arg, uint32_t page, unsigned tier, const void *data,
                                   uint32_t len);
int kvt_client_get_cb(kvt_client_t *c, uint64_t lease, uint32_t first_page, uint32_t npages,
                      kvt_client_block_cb cb, void *arg, uint32_t *got);
int kvt_client_prefetch(kvt_client_t *c, const uint32_t *tokens, uint32_t ntokens, unsigned tier,
                        uint32_t deadline_ms, kvt_client_prefetch_t *res);
int kvt_client_prefetch_start(kvt_client_t *c, const uint32_t *tokens, uint32_t ntokens,
                              unsigned tier, uint32_t deadline_ms, kvt_client_prefetch_t *res);
int kvt_client_release(kvt_client_t *c, uint64_t lease, int *released);
int kvt_client_release_later(kvt_client_t *c, uint64_t lease);
typedef struct kvt_client_loc {
    unsigned tier;
    const void *host_ptr;
    uint64_t offset;
} kvt_client_loc_t;
typedef struct kvt_client_step {
    kvt_client_loc_t *locs;
    uint32_t locs_cap;
    uint32_t located;
    uint64_t valid_until_ns;
    uint32_t handle;
    uint32_t kept;
} kvt_client_step_t;
int kvt_client_match_step(kvt_client_t *c, const uint32_t *tokens, uint32_t ntokens,
                          unsigned flags, uint32_t lease_ms, const kvt_client_hints_t *hints,
                          kvt_client_match_t *res, kvt_client_step_t *step);
int kvt_client_put_kept(kvt_client_t *c, uint32_t handle, const uint32_t *tokens, uint32_t ntokens,
                        uint32_t kept, uint32_t first_page, uint32_t npages, const void *payload,
                        const kvt_client_hints_t *hints, kvt_client_put_t *res);
int kvt_client_remove(kvt_client_t *c, const uint32_t *tokens, uint32_t ntokens);
int kvt_client_remove_nowait(kvt_client_t *c, const uint32_t *tokens, uint32_t ntokens);
typedef int (*kvt_client_stat_cb)(void *arg, const char *name, uint64_t value);
int kvt_client_stats(kvt_client_t *c, kvt_client_stat_cb cb, void *arg);

int kvt_client_zero_copy(const kvt_client_t *c);
const char *kvt_client_zero_copy_reason(const kvt_client_t *c);
const void *kvt_client_mapping(const kvt_client_t *c, uint64_t *bytes);
typedef struct kvt_client_resv {
    uint64_t id;
    uint32_t pages, new_pages;
    uint32_t nreserved;
    void **ptrs;
} kvt_client_resv_t;
int kvt_client_reserve(kvt_client_t *c, const uint32_t *tokens, uint32_t ntokens,
                       uint32_t first_page, uint32_t npages, const kvt_client_hints_t *hints,
                       kvt_client_resv_t *res);
int kvt_client_commit(kvt_client_t *c, uint64_t id, kvt_client_put_t *res);
int kvt_client_abort(kvt_client_t *c, uint64_t id);
int kvt_client_map_hbm(kvt_client_t *c, uint8_t handle[64], uint64_t *pool_bytes);
typedef int (*kvt_client_loc_cb)(void *arg, uint32_t page, unsigned tier, const void *host_ptr,
                                 uint64_t offset, uint32_t len, const void *data);
int kvt_client_get_loc(kvt_client_t *c, uint64_t lease, uint32_t first_page, uint32_t npages,
                       kvt_client_loc_cb cb, void *arg);

typedef struct kvt_batch kvt_batch_t;
int kvt_batch_create(kvt_batch_t **out, kvt_client_t *c);
void kvt_batch_destroy(kvt_batch_t *b);
void kvt_batch_reset(kvt_batch_t *b);
size_t kvt_batch_size(const kvt_batch_t *b);
int kvt_batch_ping(kvt_batch_t *b, int *status);
int kvt_batch_match(kvt_batch_t *b, const uint32_t *tokens, uint32_t ntokens, unsigned flags,
                    uint32_t lease_ms, const kvt_client_hints_t *hints, kvt_client_match_t *res,
                    int *status);
int kvt_batch_put(kvt_batch_t *b, const uint32_t *tokens, uint32_t ntokens, uint32_t first_page,
                  uint32_t npages, const void *payload, const kvt_client_hints_t *hints,
                  kvt_client_put_t *res, int *status);
int kvt_batch_prefetch(kvt_batch_t *b, const uint32_t *tokens, uint32_t ntokens, unsigned tier,
                       uint32_t deadline_ms, kvt_client_prefetch_t *res, int *status);
int kvt_batch_prefetch_start(kvt_batch_t *b, const uint32_t *tokens, uint32_t ntokens,
                             unsigned tier, uint32_t deadline_ms, kvt_client_prefetch_t *res,
                             int *status);
int kvt_batch_remove(kvt_batch_t *b, const uint32_t *tokens, uint32_t ntokens, int *status);
int kvt_batch_remove_nowait(kvt_batch_t *b, const uint32_t *tokens, uint32_t ntokens, int *status);
int kvt_batch_release(kvt_batch_t *b, uint64_t lease, int *status);
int kvt_batch_run(kvt_batch_t *b);
"""

ffi = cffi.FFI()
ffi.cdef(CDEF)


def candidates() -> List[str]:
    """The places tried for libkvtier, in order (see the module's docstring)."""
    env = os.environ.get("KVTIER_LIB")
    if env:
        return [env]
    here = Path(__file__).resolve().parent
    paths = [here / "libkvtier.so", here / "libkvtier.so.0"]
    build = os.environ.get("KVT_BUILD_ROOT")
    if build:
        paths.append(Path(build) / "client" / "libkvtier.so")
    paths.append(here.parent.parent / "build" / "client" / "libkvtier.so")
    out = [str(p) for p in paths if p.exists()]
    out.append("libkvtier.so.0")
    return out


def load() -> Any:
    tried = []
    for c in candidates():
        try:
            lib = ffi.dlopen(c)
        except OSError as e:
            tried.append("%s (%s)" % (c, e))
            if os.environ.get("KVTIER_LIB"):
                break
            continue
        global path
        path = c
        return lib
    raise ImportError(
        "kvtier: libkvtier not found; install the package with `pip install .` from the "
        "kvtier repository's root (that builds libkvtier into it), or set KVTIER_LIB to the "
        "library's path (meson: build/client/libkvtier.so), or install it (meson install). "
        "Tried: " + "; ".join(tried))


path = ""
lib = load()
