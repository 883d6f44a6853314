/*
 * nvme_recover.c: the second half of the NVMe warm restart. The scan in nvme.c found the blocks
 * on disk, each with its namespace seed, prefix hash, parent hash and tokens; this file gives
 * them back to a radix tree. A block's token path is rebuilt by following parent hashes up to
 * the namespace seed (each hop is one page of tokens), and only the deepest blocks (those no
 * other block names as parent) are inserted: their paths cover their ancestors. Blocks name
 * their namespace by seed only: a seed the tree does not know is opened with
 * kvt_radix_ns_open_seed, and DIR/namespaces keeps descriptions (kvt_tier_nvme_add_ns) so that
 * the namespaces come back with their names too.
 *
 * Kept apart from nvme.c so that a program that never recovers into a tree does not link the
 * radix tree.
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
    uint64_t seed = kvt_radix_ns_seed_of(model, adapter, salt, page);
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

/* A namespace seed found on disk: the page size of its first block (or of its line in the file),
 * its id in the tree once opened, and whether the file named it. */
typedef struct disk_ns {
    uint64_t seed;
    size_t first; /* its first block in n->recovered */
    uint32_t page, id;
    uint8_t open, named;
} disk_ns_t;

static int disk_ns_cmp(const void *a, const void *b)
{
    const disk_ns_t *x = a, *y = b;
    if (x->seed != y->seed)
        return x->seed < y->seed ? -1 : 1;
    return x->first < y->first ? -1 : x->first > y->first;
}

static disk_ns_t *disk_ns_find(disk_ns_t *v, size_t nv, uint64_t seed)
{
    size_t lo = 0, hi = nv;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (v[mid].seed < seed)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < nv && v[lo].seed == seed ? &v[lo] : NULL;
}

/* The namespaces of the blocks found, one per seed, sorted by seed; *out NULL when none. */
static int disk_ns_collect(const nvme_t *n, disk_ns_t **out, size_t *nout)
{
    size_t nr = n->nrecovered, k = 0;
    *out = NULL;
    *nout = 0;
    if (nr == 0)
        return 0;
    disk_ns_t *v = malloc(nr * sizeof(*v));
    if (!v)
        return KVT_ENOMEM;
    for (size_t i = 0; i < nr; i++)
        if (n->recovered[i].ntokens > 0)
            v[k++] = (disk_ns_t){
                .seed = n->recovered[i].ns_seed, .first = i, .page = n->recovered[i].ntokens};
    if (k > 0)
        qsort(v, k, sizeof(*v), disk_ns_cmp);
    size_t u = 0;
    for (size_t i = 0; i < k; i++)
        if (u == 0 || v[u - 1].seed != v[i].seed)
            v[u++] = v[i];
    *out = v;
    *nout = u;
    return 0;
}

typedef struct ns_name_ctx {
    kvt_radix_t *tree;
    disk_ns_t *ns;
    size_t nns;
} ns_name_ctx_t;

/* A line of the file: opens its namespace by name when blocks of it were found (once), and keeps
 * the line. Lines of namespaces that left nothing on disk are dropped: the list would otherwise
 * grow with every tenant ever seen, and opening them all could fill the tree's namespaces. */
static int ns_name_one(void *arg, const char *model, const char *adapter, const char *salt,
                       uint32_t page)
{
    ns_name_ctx_t *c = arg;
    disk_ns_t *d = disk_ns_find(c->ns, c->nns, kvt_radix_ns_seed_of(model, adapter, salt, page));
    if (!d || d->named)
        return 0;
    if (kvt_radix_ns_open(c->tree, model, adapter, salt, page, &d->id) < 0) {
        kvt_log(KVT_LOG_WARN, "nvme tier: could not reopen namespace %s/%s (page %u)", model,
                adapter, page);
        return 0;
    }
    d->named = d->open = 1;
    d->page = page; /* blocks of another page size are orphans */
    return 1;
}

static int ns_name_each(void *arg, const char *model, const char *adapter, const char *salt,
                        uint32_t page)
{
    ns_name_one(arg, model, adapter, salt, page);
    return 0;
}

/* Names the namespaces found on disk from DIR/namespaces, which is rewritten to their lines. */
static void ns_name_found(nvme_t *n, kvt_radix_t *tree, disk_ns_t *ns, size_t nns)
{
    char path[4096];
    snprintf(path, sizeof(path), "%s/" NS_FILE, n->dir);
    if (access(path, F_OK) != 0)
        return; /* no list: every namespace is opened by seed */
    ns_name_ctx_t c = {.tree = tree, .ns = ns, .nns = nns};
    int rc = ns_rewrite(n, ns_name_one, &c, 1);
    if (rc < 0) {
        kvt_log(KVT_LOG_WARN, "nvme tier: could not rewrite %s (%s): names read as it is", path,
                kvt_strerror(rc));
        ns_each(n, ns_name_each, &c); /* the names, at least */
    }
    n->ns_compact_at = KVT_MAX((size_t)NS_COMPACT_MIN, 2 * n->ns_lines);
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

enum { D_UNKNOWN = 0, D_ORPHAN = -1, D_VISITING = -2 };

int kvt_tier_nvme_recover(kvt_tier_t *t, kvt_radix_t *tree, kvt_tier_nvme_recovery_t *out)
{
    nvme_t *n = nvme_of(t);
    if (!n || !tree)
        return KVT_EINVAL;
    if (n->recover_done)
        return KVT_EBUSY;
    n->recover_done = 1;

    size_t nr = n->nrecovered, nns = 0;
    disk_ns_t *nss = NULL;
    int32_t *depth = calloc(nr ? nr : 1, sizeof(*depth));
    long *parent = calloc(nr ? nr : 1, sizeof(*parent));
    uint32_t *nsidx = calloc(nr ? nr : 1, sizeof(*nsidx));
    uint8_t *has_child = calloc(nr ? nr : 1, 1);
    uint8_t *placed = calloc(nr ? nr : 1, 1);
    long *stack = calloc(nr ? nr : 1, sizeof(*stack));
    uint32_t *path = NULL;
    int rc = KVT_ENOMEM;
    if (!depth || !parent || !nsidx || !has_child || !placed || !stack ||
        disk_ns_collect(n, &nss, &nns) < 0)
        goto out;
    /* The namespaces of the blocks found: by name where the file has it, else by seed. */
    ns_name_found(n, tree, nss, nns);
    for (size_t k = 0; k < nns; k++)
        if (!nss[k].open && kvt_radix_ns_open_seed(tree, nss[k].seed, nss[k].page, &nss[k].id) == 0)
            nss[k].open = 1;

    /* Namespace and parent of each block; a block whose page size differs from its namespace's,
     * or whose namespace could not be opened, is an orphan. */
    for (size_t i = 0; i < nr; i++) {
        const nvme_recovered_t *r = &n->recovered[i];
        disk_ns_t *d = disk_ns_find(nss, nns, r->ns_seed);
        if (!d || !d->open || d->page != r->ntokens) {
            depth[i] = D_ORPHAN;
            continue;
        }
        nsidx[i] = (uint32_t)(d - nss);
        parent[i] = r->parent == r->ns_seed ? -1 : rec_find(n, r->parent, r->ns_seed);
        if (r->parent != r->ns_seed && parent[i] < 0)
            depth[i] = D_ORPHAN;
    }
    /* Depths in pages, by walking up to a block of known depth or to the namespace seed. */
    for (size_t i = 0; i < nr; i++) {
        size_t sp = 0;
        long j = (long)i;
        int32_t base;
        for (;;) {
            if (depth[j] != D_UNKNOWN) {
                base = depth[j] == D_VISITING ? D_ORPHAN : depth[j];
                break;
            }
            depth[j] = D_VISITING;
            stack[sp++] = j;
            if (parent[j] < 0) {
                base = 0;
                break;
            }
            j = parent[j];
        }
        while (sp > 0) {
            long k = stack[--sp];
            base = base == D_ORPHAN ? D_ORPHAN : base + 1;
            depth[k] = base;
        }
    }
    for (size_t i = 0; i < nr; i++)
        if (depth[i] > 0 && parent[i] >= 0)
            has_child[parent[i]] = 1;

    /* Insert each deepest path and hand its blocks their NVMe location. */
    rc = 0;
    for (size_t i = 0; i < nr && rc == 0; i++) {
        if (depth[i] <= 0 || has_child[i])
            continue;
        const disk_ns_t *ns = &nss[nsidx[i]];
        size_t ntok = (size_t)depth[i] * ns->page;
        uint32_t *p = realloc(path, ntok * sizeof(*p));
        if (!p) {
            rc = KVT_ENOMEM;
            break;
        }
        path = p;
        for (long j = (long)i; j >= 0; j = parent[j])
            memcpy(path + (size_t)(depth[j] - 1) * ns->page, n->recovered[j].tokens,
                   (size_t)ns->page * sizeof(*path));
        kvt_insert_t res;
        if ((rc = kvt_radix_insert(tree, ns->id, path, ntok, &res)) < 0)
            break;
        for (long j = (long)i; j >= 0; j = parent[j]) {
            if (placed[j])
                continue;
            const nvme_recovered_t *r = &n->recovered[j];
            kvt_block_t *b = kvt_radix_block_at(res.node, (uint32_t)depth[j] - 1);
            if (!b || kvt_radix_block_hash(tree, res.node, (uint32_t)depth[j] - 1) != r->hash ||
                b->tier != KVT_TIER_NONE)
                continue; /* freed below as an orphan */
            b->tier = KVT_TIER_NVME;
            b->loc = r->loc;
            b->size = r->len;
            placed[j] = 1;
            n->rec.inserted++;
        }
    }
    if (rc == 0) {
        for (size_t i = 0; i < nr; i++) {
            if (!placed[i]) {
                kvt_tier_free(t, n->recovered[i].loc, n->recovered[i].len);
                n->rec.orphans++;
            }
        }
        kvt__nvme_recovered_free(n);
    }
out:
    free(path);
    free(stack);
    free(placed);
    free(has_child);
    free(nsidx);
    free(parent);
    free(depth);
    free(nss);
    if (out)
        *out = n->rec;
    kvt_log(KVT_LOG_INFO, "nvme tier: recovery gave %llu blocks back to the index (%llu orphans)",
            (unsigned long long)n->rec.inserted, (unsigned long long)n->rec.orphans);
    return rc;
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
    kvt__nvme_recovered_free(n);
    return dropped;
}
