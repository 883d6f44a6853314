/*
 * nvme_paths.c: DIR/kvtier.paths, the token paths that recovery cannot rebuild from the data log
 * alone. Recovery finds a block by its chain of parents' records (nvme_recover.c); a sliding
 * window stored behind a gap (docs/protocol.md, "Chains with gaps") has a first page whose parent
 * holds no bytes anywhere, so no record names the gap's tokens and the window would be freed as
 * an orphan. When such a block is written here, its owner records the path in front of it
 * (kvt_tier_nvme_add_path): the tokens of every page from the namespace's root to its parent.
 * Recovery gives those pages back as index-only pages, with the window's blocks after them.
 *
 * The file is a log of its own beside the data file, so that the data log's format (and a
 * directory written before this file existed, which simply has none) is unchanged:
 *
 *   file:    | "KVTPATH1" | record | record | ...
 *   record:  | magic "KVTP" 4 | npages 4 | page_size 4 | 0 4 | ns_seed 8 | hash 8 | parent 8 |
 *            | header sum 8 | sum 8 | tokens: npages x page_size, u32 each |       (little-endian)
 *
 * hash is the block's (the path leads to it), parent its parent's (the path's last page); the
 * header sum is XXH3-64 of the 40 bytes before it, the sum XXH3-64 of the header and tokens. One
 * write() per record, not synced (a cache's durability, as the data log's): a record a crash cut
 * short, or any damaged one, is skipped and counted as torn; one whose header is intact is
 * stepped over whole, one whose header is damaged ends in a search, 4 bytes at a time, for the
 * next intact header. The file grows by a record per window start written to NVMe and is
 * compacted, when it has doubled since the last compaction (from 1 MiB), to the records of
 * blocks the tier still holds; after a recovery, to those whose blocks came back.
 */
#define XXH_STATIC_LINKING_ONLY
#include "nvme_impl.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <xxhash.h>

#define PATHS_FILE        "kvtier.paths"
#define PATHS_MAGIC       "KVTPATH1"
#define PATH_MAGIC        0x5054564bu /* "KVTP" */
#define PATH_HDR          56u
#define PATHS_COMPACT_MIN (1u << 20)

static void paths_name(const nvme_t *n, char *buf, size_t size, const char *suffix)
{
    snprintf(buf, size, "%s/" PATHS_FILE "%s", n->dir, suffix);
}

/* A record's header for key and npages pages of tokens (the sum over them too). */
static void path_hdr(uint8_t *h, uint64_t ns_seed, uint64_t hash, uint64_t parent,
                     uint32_t page_size, uint32_t npages, const uint32_t *tokens)
{
    kvt_put_u32(h, PATH_MAGIC);
    kvt_put_u32(h + 4, npages);
    kvt_put_u32(h + 8, page_size);
    kvt_put_u32(h + 12, 0);
    kvt_put_u64(h + 16, ns_seed);
    kvt_put_u64(h + 24, hash);
    kvt_put_u64(h + 32, parent);
    kvt_put_u64(h + 40, XXH3_64bits(h, 40));
    XXH3_state_t st;
    XXH3_64bits_reset(&st);
    XXH3_64bits_update(&st, h, 48);
    size_t nt = (size_t)npages * page_size;
    for (size_t i = 0; i < nt; i++) {
        uint8_t le[4];
        kvt_put_u32(le, tokens[i]);
        XXH3_64bits_update(&st, le, 4);
    }
    kvt_put_u64(h + 48, XXH3_64bits_digest(&st));
}

/* One record, header and tokens, in one write (a short one leaves a torn tail, skipped). */
static int path_write(int fd, uint64_t ns_seed, uint64_t hash, uint64_t parent, uint32_t page_size,
                      uint32_t npages, const uint32_t *tokens)
{
    size_t nt = (size_t)npages * page_size, len = PATH_HDR + 4 * nt;
    uint8_t *b = malloc(len);
    if (!b)
        return KVT_ENOMEM;
    path_hdr(b, ns_seed, hash, parent, page_size, npages, tokens);
    for (size_t i = 0; i < nt; i++)
        kvt_put_u32(b + PATH_HDR + 4 * i, tokens[i]);
    ssize_t w = write(fd, b, len);
    free(b);
    return w == (ssize_t)len ? 0 : w < 0 ? -errno : KVT_EIO;
}

/* Opens the file for appending, writing its magic when it is new or empty. */
static int paths_open_append(const nvme_t *n, off_t *size)
{
    char path[4200];
    paths_name(n, path, sizeof path, "");
    int fd = open(path, O_RDWR | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd < 0)
        return -errno;
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        int rc = -errno;
        close(fd);
        return rc;
    }
    if (sb.st_size == 0) {
        if (write(fd, PATHS_MAGIC, 8) != 8) {
            close(fd);
            return KVT_EIO;
        }
        sb.st_size = 8;
    }
    *size = sb.st_size;
    return fd;
}

/*
 * Reads the file: calls fn for each intact record (its tokens valid during the call; fn returns
 * 0 to go on, or an error that stops the read), and counts the damaged ones in *torn. A file
 * without the magic (not ours, or another version) is read as empty. Memory: one record's tokens
 * at a time, at most KVT_NVME_PATH_MAX_TOKENS.
 */
static int paths_each(const nvme_t *n, kvt__nvme_path_fn fn, void *arg, uint64_t *torn)
{
    char path[4200];
    paths_name(n, path, sizeof path, "");
    FILE *f = fopen(path, "re");
    if (!f)
        return errno == ENOENT ? 0 : -errno;
    char magic[8];
    if (fread(magic, 1, 8, f) != 8 || memcmp(magic, PATHS_MAGIC, 8) != 0) {
        fclose(f);
        return 0;
    }
    uint8_t h[PATH_HDR];
    uint32_t *tok = NULL;
    size_t tok_cap = 0;
    int rc = 0;
    long at = 8;
    while (rc == 0) {
        if (fseek(f, at, SEEK_SET) != 0)
            break;
        size_t got = fread(h, 1, PATH_HDR, f);
        if (got == 0)
            break;
        if (got < PATH_HDR) { /* a torn tail */
            if (torn)
                (*torn)++;
            break;
        }
        uint32_t np = kvt_get_u32(h + 4), ps = kvt_get_u32(h + 8);
        uint64_t nt = (uint64_t)np * ps;
        if (kvt_get_u32(h) != PATH_MAGIC || kvt_get_u64(h + 40) != XXH3_64bits(h, 40) || np == 0 ||
            ps == 0 || ps > KVT_PAGE_MAX || nt > KVT_NVME_PATH_MAX_TOKENS) {
            /* A damaged header: search on for the next intact one. */
            long next = -1;
            for (long s = at + 4;; s += 4) {
                uint8_t w[PATH_HDR];
                if (fseek(f, s, SEEK_SET) != 0 || fread(w, 1, PATH_HDR, f) != PATH_HDR)
                    break;
                if (kvt_get_u32(w) == PATH_MAGIC && kvt_get_u64(w + 40) == XXH3_64bits(w, 40)) {
                    next = s;
                    break;
                }
            }
            if (torn)
                (*torn)++;
            if (next < 0)
                break;
            at = next;
            continue;
        }
        if (nt > tok_cap) {
            uint32_t *v = realloc(tok, nt * sizeof *v);
            if (!v) {
                rc = KVT_ENOMEM;
                break;
            }
            tok = v;
            tok_cap = nt;
        }
        uint8_t *raw = (uint8_t *)tok; /* read in place, then decoded from the end */
        size_t want = (size_t)nt * 4;
        int whole = fread(raw, 1, want, f) == want;
        XXH3_state_t st;
        XXH3_64bits_reset(&st);
        XXH3_64bits_update(&st, h, 48);
        if (whole)
            XXH3_64bits_update(&st, raw, want);
        if (!whole || XXH3_64bits_digest(&st) != kvt_get_u64(h + 48)) {
            if (torn)
                (*torn)++;
            if (!whole)
                break;                     /* a torn tail */
            at += (long)(PATH_HDR + want); /* its header is intact: so is its length */
            continue;
        }
        for (size_t i = 0; i < nt; i++)
            tok[i] = kvt_get_u32(raw + 4 * i);
        nvme_path_rec_t p = {.ns_seed = kvt_get_u64(h + 16),
                             .hash = kvt_get_u64(h + 24),
                             .parent = kvt_get_u64(h + 32),
                             .page_size = ps,
                             .npages = np,
                             .tokens = tok};
        rc = fn(arg, &p);
        at += (long)(PATH_HDR + want);
    }
    free(tok);
    fclose(f);
    return rc;
}

int kvt__nvme_paths_load(const nvme_t *n, kvt__nvme_path_fn fn, void *arg, uint64_t *torn)
{
    return paths_each(n, fn, arg, torn);
}

/* Rewrites the file to the records keep() accepts, each (ns_seed, hash) once: a new file renamed
 * over the old, synced when sync is set (at start up). 0, or an error with the old file left. */
typedef struct paths_rewrite {
    int fd;
    kvt__nvme_path_fn keep;
    void *arg;
    uint64_t *done; /* (seed ^ hash) of the records written, to keep each once */
    size_t ndone, done_cap;
    uint64_t kept;
} paths_rewrite_t;

static int rewrite_one(void *arg, const nvme_path_rec_t *p)
{
    paths_rewrite_t *w = arg;
    if (!w->keep(w->arg, p))
        return 0;
    uint64_t k = p->ns_seed ^ (p->hash * 0x9e3779b97f4a7c15ull);
    for (size_t i = 0; i < w->ndone; i++)
        if (w->done[i] == k)
            return 0; /* written twice (a block demoted again): kept once */
    if (w->ndone == w->done_cap) {
        size_t cap = w->done_cap ? 2 * w->done_cap : 64;
        uint64_t *v = realloc(w->done, cap * sizeof *v);
        if (!v)
            return KVT_ENOMEM;
        w->done = v;
        w->done_cap = cap;
    }
    w->done[w->ndone++] = k;
    w->kept++;
    return path_write(w->fd, p->ns_seed, p->hash, p->parent, p->page_size, p->npages, p->tokens);
}

int kvt__nvme_paths_rewrite(nvme_t *n, kvt__nvme_path_fn keep, void *arg, int sync)
{
    char path[4200], tmp[4200];
    paths_name(n, path, sizeof path, "");
    paths_name(n, tmp, sizeof tmp, ".new");
    if (access(path, F_OK) != 0)
        return 0; /* none: nothing to keep */
    paths_rewrite_t w = {.keep = keep, .arg = arg};
    w.fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (w.fd < 0)
        return -errno;
    int rc = write(w.fd, PATHS_MAGIC, 8) == 8 ? 0 : KVT_EIO;
    if (rc == 0)
        rc = paths_each(n, rewrite_one, &w, NULL);
    if (rc == 0 && sync && fsync(w.fd) != 0)
        rc = -errno;
    struct stat sb;
    if (rc == 0 && fstat(w.fd, &sb) == 0)
        n->paths_compact_at = KVT_MAX((uint64_t)PATHS_COMPACT_MIN, 2 * (uint64_t)sb.st_size);
    if (close(w.fd) != 0 && rc == 0)
        rc = KVT_EIO;
    if (rc == 0 && rename(tmp, path) != 0)
        rc = -errno;
    if (rc < 0)
        unlink(tmp);
    free(w.done);
    return rc;
}

void kvt__nvme_paths_drop(nvme_t *n)
{
    char path[4200];
    paths_name(n, path, sizeof path, "");
    unlink(path);
}

/* The (ns_seed, hash) of every block the tier holds, sorted: what compaction keeps. */
typedef struct pair_vec {
    uint64_t (*v)[2];
    size_t n, cap;
    int err;
} pair_vec_t;

static void pair_collect(void *arg, const kvt__tier_ent_t *e)
{
    pair_vec_t *s = arg;
    if (s->n == s->cap) {
        size_t cap = s->cap ? 2 * s->cap : 256;
        uint64_t(*v)[2] = realloc(s->v, cap * sizeof *v);
        if (!v) {
            s->err = 1;
            return;
        }
        s->v = v;
        s->cap = cap;
    }
    s->v[s->n][0] = e->ns_seed;
    s->v[s->n][1] = e->hash;
    s->n++;
}

static int pair_cmp(const void *a, const void *b)
{
    const uint64_t *x = a, *y = b;
    if (x[0] != y[0])
        return x[0] < y[0] ? -1 : 1;
    return x[1] < y[1] ? -1 : x[1] > y[1];
}

static int pair_held(void *arg, const nvme_path_rec_t *p)
{
    const pair_vec_t *s = arg;
    uint64_t k[2] = {p->ns_seed, p->hash};
    return s->n && bsearch(k, s->v, s->n, sizeof *s->v, pair_cmp) != NULL;
}

static void paths_compact(nvme_t *n)
{
    pair_vec_t s = {0};
    kvt__tier_foreach(n->tier, pair_collect, &s);
    int rc = KVT_ENOMEM;
    if (!s.err) {
        if (s.n)
            qsort(s.v, s.n, sizeof *s.v, pair_cmp);
        rc = kvt__nvme_paths_rewrite(n, pair_held, &s, 0);
    }
    if (rc < 0) {
        kvt_log(KVT_LOG_WARN, "nvme tier: could not compact %s/" PATHS_FILE ": %s", n->dir,
                kvt_strerror(rc));
        n->paths_compact_at *= 2; /* not again at the next record */
    }
    free(s.v);
}

int kvt_tier_nvme_add_path(kvt_tier_t *t, const kvt_block_key_t *key, const uint32_t *tokens,
                           uint32_t npages)
{
    nvme_t *n = t && t->ops == &kvt__nvme_ops ? t->impl : NULL;
    if (!n || !key || !tokens || npages == 0 || key->ntokens == 0 || key->ntokens > KVT_PAGE_MAX ||
        (uint64_t)npages * key->ntokens > KVT_NVME_PATH_MAX_TOKENS)
        return KVT_EINVAL;
    if (!n->paths_compact_at)
        n->paths_compact_at = PATHS_COMPACT_MIN;
    off_t size = 0;
    int fd = paths_open_append(n, &size);
    if (fd >= 0 && (uint64_t)size >= n->paths_compact_at) {
        close(fd);
        paths_compact(n);
        fd = paths_open_append(n, &size);
    }
    if (fd < 0)
        return fd;
    int rc = path_write(fd, key->ns_seed, key->hash, key->parent, key->ntokens, npages, tokens);
    close(fd);
    return rc;
}
