/*
 * nvme_recover.c: the second half of the NVMe warm restart, and the namespace list it needs. The
 * scan in nvme.c found the blocks on disk, each with its namespace seed, prefix hash, parent hash
 * and tokens; this file hands them to the owner of the index as token paths (tier.h, "Recovery
 * into an index"), knowing no index itself. A block's token path is rebuilt by following parent
 * hashes up to the namespace seed (each hop is one page of tokens), and only the deepest blocks
 * (those no other block names as parent) start a path: their paths cover their ancestors. Blocks
 * name their namespace by seed only: DIR/namespaces keeps descriptions (kvt_tier_nvme_add_ns) so
 * that the namespaces come back with their names too. A window stored behind a gap has a first
 * block whose parent no record names: DIR/kvtier.paths (nvme_paths.c) holds the tokens in front
 * of it, which start its path as pages without blocks.
 */
#include "nvme_impl.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <xxhash.h>

#define NS_FILE        "namespaces"
#define NS_COMPACT_MIN 4096 /* lines the list may reach before its first compaction */

static int ns_str_ok(const char *s, int may_be_empty)
{
    if (!s)
        return may_be_empty;
    size_t n = strlen(s);
    if (n > 255 || (n == 0 && !may_be_empty))
        return 0;
    return strpbrk(s, "\t\n\r") == NULL;
}

static nvme_t *nvme_of(kvt_tier_t *t)
{
    return t && t->ops == &kvt__nvme_ops ? t->impl : NULL;
}

/* Calls fn for each recorded namespace; returns 0 or a negated errno (a missing file is 0). */
static int ns_each(const nvme_t *n,
                   int (*fn)(void *arg, const char *model, const char *adapter, const char *salt,
                             uint32_t page),
                   void *arg)
{
    char path[4096];
    snprintf(path, sizeof(path), "%s/" NS_FILE, n->dir);
    FILE *f = fopen(path, "r");
    if (!f)
        return errno == ENOENT ? 0 : -errno;
    char line[1100];
    int rc = 0;
    while (rc == 0 && fgets(line, sizeof(line), f)) {
        char *save = NULL;
        line[strcspn(line, "\n")] = 0;
        char *v = strtok_r(line, "\t", &save);
        if (!v || strcmp(v, "v1") != 0)
            continue;
        char *fields[4];
        int k = 0;
        for (char *p = save; k < 4; k++) {
            char *tab = p ? strchr(p, '\t') : NULL;
            fields[k] = p;
            if (tab) {
                *tab = 0;
                p = tab + 1;
            } else {
                p = NULL;
            }
        }
        if (!fields[0] || !fields[3])
            continue;
        char *end;
        unsigned long page = strtoul(fields[3], &end, 10);
        if (*end || page == 0 || page > KVT_PAGE_MAX)
            continue;
        rc = fn(arg, fields[0], fields[1] ? fields[1] : "", fields[2] ? fields[2] : "",
                (uint32_t)page);
    }
    fclose(f);
    return rc < 0 ? rc : 0;
}

/* A namespace's line in the file, with its line break. */
static int ns_line(char *buf, size_t size, const char *model, const char *adapter, const char *salt,
                   uint32_t page)
{
    return snprintf(buf, size, "v1\t%s\t%s\t%s\t%u\n", model, adapter, salt, page);
}

/* A description's key in n->ns_set. Two descriptions with one key (a 64-bit hash collision)
 * would leave the second unrecorded: its blocks still come back, found by seed. */
static uint64_t ns_key(const char *model, const char *adapter, const char *salt, uint32_t page)
{
    char buf[3 * 256 + 16]; /* ns_str_ok: each at most 255 bytes */
    int len = snprintf(buf, sizeof buf, "%s%c%s%c%s%c%u", model, 0, adapter, 0, salt, 0, page);
    uint64_t k = XXH3_64bits(buf, (size_t)len);
    return k ? k : 1;
}

/* The slot holding key, or the free slot where it would go. */
static size_t ns_slot(const nvme_t *n, uint64_t key)
{
    size_t j = key & (n->ns_cap - 1);
    while (n->ns_set[j] && n->ns_set[j] != key)
        j = (j + 1) & (n->ns_cap - 1);
    return j;
}

/* Room for one more key (the set stays at most half full): 0 or KVT_ENOMEM. */
static int ns_set_reserve(nvme_t *n)
{
    if (2 * (n->ns_count + 1) <= n->ns_cap)
        return 0;
    size_t ocap = n->ns_cap, cap = ocap ? 2 * ocap : 64;
    uint64_t *m = calloc(cap, sizeof *m), *old = n->ns_set;
    if (!m)
        return KVT_ENOMEM;
    n->ns_set = m;
    n->ns_cap = cap;
    for (size_t i = 0; i < ocap; i++)
        if (old[i])
            m[ns_slot(n, old[i])] = old[i];
    free(old);
    return 0;
}

static int ns_load_one(void *arg, const char *model, const char *adapter, const char *salt,
                       uint32_t page)
{
    nvme_t *n = arg;
    if (ns_set_reserve(n) < 0)
        return KVT_ENOMEM;
    uint64_t key = ns_key(model, adapter, salt, page);
    size_t j = ns_slot(n, key);
    n->ns_count += !n->ns_set[j];
    n->ns_set[j] = key;
    n->ns_lines++;
    return 0;
}

typedef int (*ns_keep_fn)(void *arg, const char *model, const char *adapter, const char *salt,
                          uint32_t page);

typedef struct ns_rewrite_ctx {
    nvme_t *n;
    FILE *out;
    ns_keep_fn keep;
    void *arg;
    int err;
} ns_rewrite_ctx_t;

static int ns_rewrite_one(void *arg, const char *model, const char *adapter, const char *salt,
                          uint32_t page)
{
    ns_rewrite_ctx_t *c = arg;
    nvme_t *n = c->n;
    if (!c->keep(c->arg, model, adapter, salt, page))
        return 0;
    if (ns_set_reserve(n) < 0)
        return KVT_ENOMEM;
    uint64_t key = ns_key(model, adapter, salt, page);
    size_t j = ns_slot(n, key);
    if (n->ns_set[j])
        return 0; /* listed twice (two daemons, a lost set): kept once */
    char line[1100];
    int len = ns_line(line, sizeof line, model, adapter, salt, page);
    if (fwrite(line, 1, (size_t)len, c->out) != (size_t)len)
        c->err = 1;
    n->ns_set[j] = key;
    n->ns_count++;
    n->ns_lines++;
    return 0;
}

/*
 * Rewrites DIR/namespaces to the lines keep() accepts, each description once: a new file renamed
 * over the old, so that a crash leaves one or the other; synced first when sync is set (at start
 * up; in the event loop a crash may at worst leave the new file empty, which loses names only:
 * the blocks come back by seed). The set of recorded names becomes those lines. Returns 0, or an
 * error with the file and the set as they were.
 */
static int ns_rewrite(nvme_t *n, ns_keep_fn keep, void *arg, int sync)
{
    char path[4096], tmp[4100];
    snprintf(path, sizeof(path), "%s/" NS_FILE, n->dir);
    snprintf(tmp, sizeof(tmp), "%s.new", path);
    ns_rewrite_ctx_t c = {.n = n, .keep = keep, .arg = arg};
    if (!(c.out = fopen(tmp, "we")))
        return -errno;
    uint64_t *set = n->ns_set;
    size_t count = n->ns_count, cap = n->ns_cap, lines = n->ns_lines;
    n->ns_set = NULL;
    n->ns_count = n->ns_cap = n->ns_lines = 0;
    int rc = ns_each(n, ns_rewrite_one, &c);
    if (rc == 0 && (c.err || fflush(c.out) != 0 || (sync && fsync(fileno(c.out)) != 0)))
        rc = errno ? -errno : KVT_EIO;
    if (fclose(c.out) != 0 && rc == 0)
        rc = KVT_EIO;
    if (rc == 0 && rename(tmp, path) != 0)
        rc = -errno;
    if (rc == 0) {
        free(set);
        n->ns_loaded = 1;
        return 0;
    }
    unlink(tmp);
    free(n->ns_set);
    n->ns_set = set;
    n->ns_count = count;
    n->ns_cap = cap;
    n->ns_lines = lines;
    return rc;
}

/* The namespace seeds of the blocks the tier holds, sorted. */
typedef struct seed_vec {
    uint64_t *v;
    size_t n, cap;
    int err;
} seed_vec_t;

static void seed_collect(void *arg, const kvt__tier_ent_t *e)
{
    seed_vec_t *s = arg;
    if (s->n > 0 && s->v[s->n - 1] == e->ns_seed)
        return; /* the common run of one namespace's blocks */
    if (s->n == s->cap) {
        size_t cap = s->cap ? 2 * s->cap : 64;
        uint64_t *v = realloc(s->v, cap * sizeof(*v));
        if (!v) {
            s->err = 1;
            return;
        }
        s->v = v;
        s->cap = cap;
    }
    s->v[s->n++] = e->ns_seed;
}

static int u64_cmp(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static int seed_held(void *arg, const char *model, const char *adapter, const char *salt,
                     uint32_t page)
{
    const seed_vec_t *s = arg;
    uint64_t seed = kvt_ns_seed_of(model, adapter, salt, page);
    return s->n && bsearch(&seed, s->v, s->n, sizeof(*s->v), u64_cmp) != NULL;
}

/* Drops the lines of namespaces with no block in the tier: the list would otherwise grow with
 * every tenant that ever came and went. Next when it has doubled again. */
static void ns_compact(nvme_t *n)
{
    seed_vec_t s = {0};
    kvt__tier_foreach(n->tier, seed_collect, &s);
    int rc = KVT_ENOMEM;
    if (!s.err) {
        if (s.n)
            qsort(s.v, s.n, sizeof(*s.v), u64_cmp);
        size_t before = n->ns_lines;
        if ((rc = ns_rewrite(n, seed_held, &s, 0)) == 0)
            kvt_log(KVT_LOG_INFO, "nvme tier: namespace list compacted from %zu lines to %zu",
                    before, n->ns_lines);
    }
    if (rc < 0)
        kvt_log(KVT_LOG_WARN, "nvme tier: could not compact %s/" NS_FILE ": %s", n->dir,
                kvt_strerror(rc));
    n->ns_compact_at = KVT_MAX((size_t)NS_COMPACT_MIN, 2 * n->ns_lines);
    free(s.v);
}

int kvt_tier_nvme_add_ns(kvt_tier_t *t, const char *model, const char *adapter, const char *salt,
                         uint32_t page_size)
{
    nvme_t *n = nvme_of(t);
    if (!n || !ns_str_ok(model, 0) || !ns_str_ok(adapter, 1) || !ns_str_ok(salt, 1) ||
        page_size == 0 || page_size > KVT_PAGE_MAX)
        return KVT_EINVAL;
    adapter = adapter ? adapter : "";
    salt = salt ? salt : "";
    int rc;
    if (!n->ns_loaded) { /* the file is read once; a failed read is tried again next call */
        if ((rc = ns_each(n, ns_load_one, n)) < 0)
            return rc;
        n->ns_loaded = 1;
    }
    uint64_t key = ns_key(model, adapter, salt, page_size);
    if (n->ns_cap && n->ns_set[ns_slot(n, key)])
        return 0;
    if (n->ns_lines >= KVT_MAX((size_t)NS_COMPACT_MIN, n->ns_compact_at))
        ns_compact(n);
    if ((rc = ns_set_reserve(n)) < 0)
        return rc;
    size_t j = ns_slot(n, key);
    char path[4096], line[1100];
    snprintf(path, sizeof(path), "%s/" NS_FILE, n->dir);
    /* One append, not synced: the line only names the namespace after a restart (its blocks come
     * back by seed without it), not worth an fsync in the daemon's event loop. A file that a
     * crash left without its last line break gets one first, or this line would join that one. */
    int fd = open(path, O_RDWR | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd < 0)
        return -errno;
    struct stat sb;
    char last = '\n';
    if (fstat(fd, &sb) == 0 && sb.st_size > 0 && pread(fd, &last, 1, sb.st_size - 1) != 1)
        last = '\n';
    int len = last == '\n' ? 0 : 1;
    line[0] = '\n';
    len += ns_line(line + len, sizeof(line) - 1, model, adapter, salt, page_size);
    ssize_t w = write(fd, line, (size_t)len);
    rc = w == len ? 0 : w < 0 ? -errno : KVT_EIO;
    close(fd);
    if (rc == 0) {
        n->ns_set[j] = key;
        n->ns_count++;
        n->ns_lines++;
    }
    return rc;
}

/* Recovery's state between kvt_tier_nvme_recover_begin and _end. */
struct nvme_replay {
    kvt_tier_nvme_ns_t *ns; /* one per seed found on disk, sorted by seed */
    size_t nns;
    char **strs;                /* per namespace: its description's strings, one allocation */
    kvt_tier_nvme_block_t *pub; /* per recovered block: what the caller sees and marks */
    int32_t *depth;             /* per block: pages from the root, or D_ORPHAN */
    long *parent;               /* per block: its parent block, or -1 under the seed */
    uint32_t *nsidx;            /* per block: its namespace */
    uint8_t *has_child;
    uint32_t *pre; /* per block: 1 + its path's index in pres (kvtier.paths), 0 for none */
    struct nvme_pre {
        uint32_t npages;
        uint32_t *tokens;
    } * pres;
    size_t npres, pres_cap;
    size_t next;    /* the next block kvt_tier_nvme_recover_next looks at */
    uint32_t *path; /* the path handed out last */
    kvt_tier_nvme_block_t **path_blocks;
    size_t path_cap, blocks_cap;
};

static nvme_replay_t *replay_of(kvt_tier_t *t)
{
    nvme_t *n = nvme_of(t);
    return n ? n->replay : NULL;
}

void kvt__nvme_replay_free(nvme_t *n)
{
    nvme_replay_t *r = n->replay;
    if (!r)
        return;
    if (r->strs)
        for (size_t i = 0; i < r->nns; i++)
            free(r->strs[i]);
    free(r->strs);
    free(r->ns);
    free(r->pub);
    free(r->depth);
    free(r->parent);
    free(r->nsidx);
    free(r->has_child);
    free(r->pre);
    for (size_t i = 0; i < r->npres; i++)
        free(r->pres[i].tokens);
    free(r->pres);
    free(r->path);
    free(r->path_blocks);
    free(r);
    n->replay = NULL;
}

static kvt_tier_nvme_ns_t *ns_find(const nvme_replay_t *r, uint64_t seed)
{
    size_t lo = 0, hi = r->nns;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (r->ns[mid].seed < seed)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < r->nns && r->ns[lo].seed == seed ? &r->ns[lo] : NULL;
}

typedef struct seed_first {
    uint64_t seed;
    size_t first;
} seed_first_t;

static int seed_first_cmp(const void *a, const void *b)
{
    const seed_first_t *x = a, *y = b;
    if (x->seed != y->seed)
        return x->seed < y->seed ? -1 : 1;
    return x->first < y->first ? -1 : x->first > y->first;
}

/* The namespaces of the blocks found, one per seed, sorted by seed, with the page size of the
 * first block of each (DIR/namespaces may name a better one). */
static int ns_collect(const nvme_t *n, nvme_replay_t *r)
{
    size_t nr = n->nrecovered, k = 0;
    if (nr == 0)
        return 0;
    seed_first_t *v = malloc(nr * sizeof(*v));
    if (!v)
        return KVT_ENOMEM;
    for (size_t i = 0; i < nr; i++)
        if (n->recovered[i].ntokens > 0)
            v[k++] = (seed_first_t){.seed = n->recovered[i].ns_seed, .first = i};
    if (k > 0)
        qsort(v, k, sizeof(*v), seed_first_cmp);
    size_t u = 0;
    for (size_t i = 0; i < k; i++)
        if (u == 0 || v[u - 1].seed != v[i].seed)
            v[u++] = v[i];
    r->ns = calloc(u ? u : 1, sizeof(*r->ns));
    r->strs = calloc(u ? u : 1, sizeof(*r->strs));
    if (!r->ns || !r->strs) {
        free(v);
        return KVT_ENOMEM;
    }
    for (size_t i = 0; i < u; i++) {
        r->ns[i] =
            (kvt_tier_nvme_ns_t){.seed = v[i].seed, .page_size = n->recovered[v[i].first].ntokens};
    }
    r->nns = u;
    free(v);
    return 0;
}

/* A line of DIR/namespaces: names the namespace of its seed when blocks of it were found and no
 * earlier line named it. */
static int ns_name_one(void *arg, const char *model, const char *adapter, const char *salt,
                       uint32_t page)
{
    nvme_replay_t *r = arg;
    kvt_tier_nvme_ns_t *d = ns_find(r, kvt_ns_seed_of(model, adapter, salt, page));
    if (!d || d->model)
        return 0;
    size_t lm = strlen(model) + 1, la = strlen(adapter) + 1, ls = strlen(salt) + 1;
    char *p = malloc(lm + la + ls);
    if (!p)
        return KVT_ENOMEM;
    memcpy(p, model, lm);
    memcpy(p + lm, adapter, la);
    memcpy(p + lm + la, salt, ls);
    r->strs[d - r->ns] = p;
    d->model = p;
    d->adapter = p + lm;
    d->salt = p + lm + la;
    d->page_size = page; /* blocks of another page size are orphans */
    return 0;
}

/* The recovered block with (hash, ns_seed), or -1; n->recovered is sorted by hash, ns_seed. */
static long rec_find(const nvme_t *n, uint64_t hash, uint64_t ns_seed)
{
    size_t lo = 0, hi = n->nrecovered;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        const nvme_recovered_t *r = &n->recovered[mid];
        if (r->hash < hash || (r->hash == hash && r->ns_seed < ns_seed))
            lo = mid + 1;
        else
            hi = mid;
    }
    if (lo < n->nrecovered && n->recovered[lo].hash == hash && n->recovered[lo].ns_seed == ns_seed)
        return (long)lo;
    return -1;
}

/* A record of DIR/kvtier.paths: kept for the recovered block it leads to when that block's parent
 * has no record of its own (the case it was written for), with the block's page size. */
typedef struct pre_ctx {
    const nvme_t *n;
    nvme_replay_t *r;
} pre_ctx_t;

static int pre_one(void *arg, const nvme_path_rec_t *p)
{
    pre_ctx_t *c = arg;
    nvme_replay_t *r = c->r;
    long i = rec_find(c->n, p->hash, p->ns_seed);
    if (i < 0 || r->pre[i])
        return 0;
    const nvme_recovered_t *b = &c->n->recovered[i];
    if (b->parent != p->parent || b->ntokens != p->page_size || b->parent == b->ns_seed ||
        rec_find(c->n, b->parent, b->ns_seed) >= 0)
        return 0;
    if (r->npres == r->pres_cap) {
        size_t cap = r->pres_cap ? 2 * r->pres_cap : 16;
        struct nvme_pre *v = realloc(r->pres, cap * sizeof *v);
        if (!v)
            return KVT_ENOMEM;
        r->pres = v;
        r->pres_cap = cap;
    }
    size_t nt = (size_t)p->npages * p->page_size;
    uint32_t *t = malloc(nt * sizeof *t);
    if (!t)
        return KVT_ENOMEM;
    memcpy(t, p->tokens, nt * sizeof *t);
    r->pres[r->npres++] = (struct nvme_pre){.npages = p->npages, .tokens = t};
    r->pre[i] = (uint32_t)r->npres;
    return 0;
}

/* Keeps the records whose block the index took back. */
static int pre_indexed(void *arg, const nvme_path_rec_t *p)
{
    const pre_ctx_t *c = arg;
    long i = rec_find(c->n, p->hash, p->ns_seed);
    return i >= 0 && c->r->pre[i] && c->r->pub[i].indexed;
}

enum { D_UNKNOWN = 0, D_ORPHAN = -1, D_VISITING = -2 };

/* Each block's namespace, parent and depth in pages; marks the blocks others name as parent. */
static int chains_build(const nvme_t *n, nvme_replay_t *rp)
{
    size_t nr = n->nrecovered;
    long *stack = calloc(nr ? nr : 1, sizeof(*stack));
    if (!stack)
        return KVT_ENOMEM;
    /* Namespace and parent of each block; a block whose page size differs from its namespace's
     * is an orphan. */
    for (size_t i = 0; i < nr; i++) {
        const nvme_recovered_t *r = &n->recovered[i];
        rp->pub[i] = (kvt_tier_nvme_block_t){.loc = r->loc, .hash = r->hash, .len = r->len};
        const kvt_tier_nvme_ns_t *d = ns_find(rp, r->ns_seed);
        if (!d || d->page_size != r->ntokens) {
            rp->depth[i] = D_ORPHAN;
            continue;
        }
        rp->nsidx[i] = (uint32_t)(d - rp->ns);
        rp->parent[i] = r->parent == r->ns_seed ? -1 : rec_find(n, r->parent, r->ns_seed);
        if (r->parent != r->ns_seed && rp->parent[i] < 0 && !rp->pre[i])
            rp->depth[i] = D_ORPHAN;
    }
    /* Depths in pages, by walking up to a block of known depth or to the namespace seed. */
    for (size_t i = 0; i < nr; i++) {
        size_t sp = 0;
        long j = (long)i;
        int32_t base;
        for (;;) {
            if (rp->depth[j] != D_UNKNOWN) {
                base = rp->depth[j] == D_VISITING ? D_ORPHAN : rp->depth[j];
                break;
            }
            rp->depth[j] = D_VISITING;
            stack[sp++] = j;
            if (rp->parent[j] < 0) {
                base = rp->pre[j] ? (int32_t)rp->pres[rp->pre[j] - 1].npages : 0;
                break;
            }
            j = rp->parent[j];
        }
        while (sp > 0) {
            long k = stack[--sp];
            base = base == D_ORPHAN ? D_ORPHAN : base + 1;
            rp->depth[k] = base;
        }
    }
    for (size_t i = 0; i < nr; i++)
        if (rp->depth[i] > 0 && rp->parent[i] >= 0)
            rp->has_child[rp->parent[i]] = 1;
    free(stack);
    return 0;
}

int kvt_tier_nvme_recover_begin(kvt_tier_t *t, kvt_tier_nvme_ns_t **ns, size_t *nns)
{
    nvme_t *n = nvme_of(t);
    if (!n || !ns || !nns)
        return KVT_EINVAL;
    if (n->recover_done)
        return KVT_EBUSY;
    n->recover_done = 1;
    size_t nr = n->nrecovered;
    nvme_replay_t *r = calloc(1, sizeof(*r));
    if (!r)
        return KVT_ENOMEM;
    n->replay = r;
    r->pub = calloc(nr ? nr : 1, sizeof(*r->pub));
    r->depth = calloc(nr ? nr : 1, sizeof(*r->depth));
    r->parent = calloc(nr ? nr : 1, sizeof(*r->parent));
    r->nsidx = calloc(nr ? nr : 1, sizeof(*r->nsidx));
    r->has_child = calloc(nr ? nr : 1, 1);
    r->pre = calloc(nr ? nr : 1, sizeof(*r->pre));
    int rc = KVT_ENOMEM;
    if (!r->pub || !r->depth || !r->parent || !r->nsidx || !r->has_child || !r->pre ||
        (rc = ns_collect(n, r)) < 0)
        goto fail;
    /* The paths in front of windows behind gaps (a file that cannot be read: none, and those
     * windows are orphans, as before it existed). */
    pre_ctx_t pc = {.n = n, .r = r};
    if (nr && (rc = kvt__nvme_paths_load(n, pre_one, &pc, &n->rec.torn)) == KVT_ENOMEM)
        goto fail;
    /* The namespaces by name where DIR/namespaces has them (a file that cannot be read: by
     * seed, as with no file). */
    if ((rc = ns_each(n, ns_name_one, r)) == KVT_ENOMEM)
        goto fail;
    if ((rc = chains_build(n, r)) < 0)
        goto fail;
    *ns = r->nns ? r->ns : NULL;
    *nns = r->nns;
    return 0;
fail:
    kvt__nvme_replay_free(n);
    return rc;
}

int kvt_tier_nvme_recover_next(kvt_tier_t *t, kvt_tier_nvme_path_t *p)
{
    nvme_t *n = nvme_of(t);
    nvme_replay_t *r = replay_of(t);
    if (!r || !p)
        return KVT_EINVAL;
    for (; r->next < n->nrecovered; r->next++) {
        size_t i = r->next;
        if (r->depth[i] <= 0 || r->has_child[i])
            continue;
        const kvt_tier_nvme_ns_t *ns = &r->ns[r->nsidx[i]];
        uint32_t npages = (uint32_t)r->depth[i];
        size_t ntok = (size_t)npages * ns->page_size;
        if (ntok > r->path_cap) {
            uint32_t *v = realloc(r->path, ntok * sizeof(*v));
            if (!v)
                return KVT_ENOMEM;
            r->path = v;
            r->path_cap = ntok;
        }
        if (npages > r->blocks_cap) {
            kvt_tier_nvme_block_t **v = realloc(r->path_blocks, npages * sizeof(*v));
            if (!v)
                return KVT_ENOMEM;
            r->path_blocks = v;
            r->blocks_cap = npages;
        }
        for (long j = (long)i; j >= 0; j = r->parent[j]) {
            size_t page = (size_t)r->depth[j] - 1;
            memcpy(r->path + page * ns->page_size, n->recovered[j].tokens,
                   (size_t)ns->page_size * sizeof(*r->path));
            r->path_blocks[page] = &r->pub[j];
            if (r->parent[j] < 0 && r->pre[j]) { /* a gap's pages in front: no blocks */
                const struct nvme_pre *g = &r->pres[r->pre[j] - 1];
                memcpy(r->path, g->tokens, (size_t)g->npages * ns->page_size * sizeof(*r->path));
                for (uint32_t k = 0; k < g->npages; k++)
                    r->path_blocks[k] = NULL;
            }
        }
        r->next++;
        *p = (kvt_tier_nvme_path_t){
            .ns = r->nsidx[i], .npages = npages, .tokens = r->path, .blocks = r->path_blocks};
        return 1;
    }
    return 0;
}

/* Keeps the lines of the namespaces the caller opened by name. */
static int ns_keep_named(void *arg, const char *model, const char *adapter, const char *salt,
                         uint32_t page)
{
    const kvt_tier_nvme_ns_t *d = ns_find(arg, kvt_ns_seed_of(model, adapter, salt, page));
    return d && d->named;
}

int kvt_tier_nvme_recover_end(kvt_tier_t *t, int failed, kvt_tier_nvme_recovery_t *out)
{
    nvme_t *n = nvme_of(t);
    nvme_replay_t *r = replay_of(t);
    if (!r)
        return KVT_EINVAL;
    /* DIR/namespaces keeps the namespaces that left blocks on disk and came back by name: the
     * list would otherwise grow with every tenant ever seen, and opening them all at the next
     * start could fill the tree's namespaces. */
    char path[4096];
    snprintf(path, sizeof(path), "%s/" NS_FILE, n->dir);
    if (access(path, F_OK) == 0) {
        int rc = ns_rewrite(n, ns_keep_named, r, 1);
        if (rc < 0)
            kvt_log(KVT_LOG_WARN, "nvme tier: could not rewrite %s (%s): left as it was", path,
                    kvt_strerror(rc));
        n->ns_compact_at = KVT_MAX((size_t)NS_COMPACT_MIN, 2 * n->ns_lines);
    }
    for (size_t i = 0; i < n->nrecovered; i++)
        n->rec.inserted += r->pub[i].indexed != 0;
    /* DIR/kvtier.paths keeps the paths of the windows that came back (synced, as the list). */
    pre_ctx_t pc = {.n = n, .r = r};
    int prc = failed ? 0 : kvt__nvme_paths_rewrite(n, pre_indexed, &pc, 1);
    if (prc < 0)
        kvt_log(KVT_LOG_WARN, "nvme tier: could not rewrite %s/kvtier.paths (%s): left as it was",
                n->dir, kvt_strerror(prc));
    if (!failed) {
        for (size_t i = 0; i < n->nrecovered; i++) {
            if (!r->pub[i].indexed) {
                kvt_tier_free(t, n->recovered[i].loc, n->recovered[i].len);
                n->rec.orphans++;
            }
        }
        kvt__nvme_recovered_free(n); /* and the replay state */
    } else {
        kvt__nvme_replay_free(n);
    }
    if (out)
        *out = n->rec;
    kvt_log(KVT_LOG_INFO, "nvme tier: recovery gave %llu blocks back to the index (%llu orphans)",
            (unsigned long long)n->rec.inserted, (unsigned long long)n->rec.orphans);
    return 0;
}

long kvt_tier_nvme_drop_recovered(kvt_tier_t *t)
{
    nvme_t *n = nvme_of(t);
    if (!n)
        return KVT_EINVAL;
    if (n->recover_done)
        return KVT_EBUSY;
    n->recover_done = 1;
    long dropped = (long)n->nrecovered;
    for (size_t i = 0; i < n->nrecovered; i++)
        kvt_tier_free(t, n->recovered[i].loc, n->recovered[i].len);
    kvt__nvme_paths_drop(n); /* the blocks its paths lead to are gone */
    kvt__nvme_recovered_free(n);
    return dropped;
}
