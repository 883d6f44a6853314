/*
 * radix.c: the page-granular radix tree behind radix.h.
 *
 * It owns the nodes, their page storage, the namespaces, the leases, the list of evictable
 * leaves and the arena the nodes live in ("the node arena" below), and counts every byte it
 * allocates: a slot's size class for the arena's, malloc_usable_size for the rest, so the count is
 * what an allocator really handed out.
 *
 * A node's pages live in one allocation, blocks first (8-byte aligned) then tokens, the node's
 * pages at slots [off, off + npages) of both:
 *
 *     storage: [ block 0 | block 1 | ... | block cap-1 ][ tokens of page 0 | ... | page cap-1 ]
 *
 * Slots outside that range are dead: evictions free pages at the end, and a split leaves the
 * smaller of its two halves behind in the storage the larger half keeps, so that a split copies
 * only that smaller half (a split's cost was a copy of the whole node before). The storage is
 * compacted when fewer than half its slots are live. Children are kept in one allocation too, keys
 * then pointers, keyed by the hash of the child's first page:
 *
 *     kids:    [ key 0 | key 1 | ... | key cap-1 ][ node* 0 | node* 1 | ... | node* cap-1 ]
 *
 * Up to KID_ARRAY_MAX children the keys are sorted, for binary search; past that the allocation
 * is an open-addressing hash table (linear probing, at most half full, an empty slot has a NULL
 * pointer): a shared system prompt followed by a million different conversations would otherwise
 * move half a million entries on every insert and removal under it. A big table grows a step at
 * a time ("Growing a big table" below).
 *
 * The evictable list holds exactly the nodes that are leaves (no children), unleased and not a
 * root. Leases live in a slab whose ids carry a generation, so a stale id is recognised and a
 * second release is harmless.
 */
#define _GNU_SOURCE /* mremap */
#include "radix.h"

#include <malloc.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

typedef struct kvt_ns {
    uint64_t seed;
    uint32_t page_size;
    uint32_t next_free;     /* closed: the next closed id, or NO_SLOT */
    kvt_radix_node_t *root; /* NULL once closed */
    char *desc;             /* "model\0adapter\0salt\0", for logs; NULL when opened by seed */
    uint64_t blocks;        /* cached pages: what freeing the namespace would cost */
} kvt_ns_t;

struct kvt_radix_node {
    kvt_radix_node_t *parent;
    kvt_radix_node_t *lprev, *lnext; /* evictable list, when in it */
    kvt_block_t *blocks;             /* slot off of the storage: cap blocks, then cap pages */
    uint32_t *tokens;                /* of tokens; the storage starts at blocks - off */
    uint64_t *keys;                  /* kids allocation: kcap keys then kcap pointers */
    uint64_t mark;                   /* kvt_radix_node_mark's number (0: never marked) */
    uint32_t nkids, kcap;
    uint32_t npages, cap;
    uint32_t off;   /* slot of the first live page in store */
    uint32_t depth; /* page depth of the first page */
    uint32_t ns;
    uint32_t leases;
    uint32_t early; /* of those leases, the ones numbered below mark */
    uint32_t idx;   /* position in the tree's node registry; UINT32_MAX for roots */
    uint16_t page_size;
    uint8_t in_list;
    uint8_t kid_hash; /* kids is a hash table (past KID_ARRAY_MAX children), not a sorted array */
};

typedef struct kvt_lease {
    uint64_t owner; /* 0 when the slot is free */
    uint64_t seq;   /* the order it was taken in (kvt_radix_node_leased_before) */
    kvt_radix_node_t *node;
    uint32_t gen;
    uint32_t next_free;
} kvt_lease_t;

struct kvt_radix {
    kvt_radix_conf_t conf;
    float decay_per_tick; /* log2 decay per clock unit: freq *= 2^(-dt * decay_per_tick) */
    uint32_t clock;

    kvt_ns_t *ns;
    uint32_t nns, ns_cap; /* ids in use or closed, and room */
    uint32_t ns_open;     /* ids in use */
    uint32_t ns_free;     /* the last id closed, first to be reused; NO_SLOT when none */
    uint32_t *ns_slots;   /* by seed: namespace id + 1, 0 for empty; at most half full */
    uint32_t ns_slots_cap;

    kvt_radix_node_t **nodes; /* registry of non-root nodes */
    size_t nnodes, nodes_cap;
    uint32_t max_kcap; /* the largest child array made so far (kvt_radix_insert_bound) */
    /* The one node whose child table is growing a step at a time, and its old table; then
     * that table's pages given back a step at a time (done bytes of it so far). */
    kvt_radix_node_t *mig;
    uint64_t *mig_keys;
    uint32_t mig_cap, mig_pos;
    uint64_t *old_tab;
    size_t old_bytes, old_done;

    kvt_radix_node_t list; /* sentinel of the evictable list */
    size_t nlist;

    kvt_lease_t *leases;
    uint32_t lease_cap, lease_free, nleases;
    uint64_t releases;  /* leases ended, ever */
    uint64_t lease_seq; /* the next lease's seq */

    uint64_t epoch; /* bumped by every change of shape: insert, split, remove, evict */
    uint64_t rng;   /* xorshift64 state of kvt_radix_trim's sampling */
    uint64_t bytes;
    uint64_t blocks;
    uint64_t cached_tokens;

    /* The node arena ("the node arena" below): free slots by class, the bump region of the
     * newest chunk, the chunks (linked through their first word), bytes mapped, the next chunk's
     * size. */
    void *ar_free[111];
    uint8_t *ar_cur, *ar_end;
    void *ar_chunks;
    size_t ar_mapped, ar_next;
    size_t ar_live;  /* bytes of slots in use */
    size_t ar_waste; /* chunk headers and chunk tails too small for a slot */
};

#define NO_SLOT       UINT32_MAX
#define KID_ARRAY_MAX 64 /* children kept as a sorted array; more go to a hash table */
#define KID_MOVED     ((kvt_radix_node_t *)(uintptr_t)1)  /* an old table's moved entry */
#define KID_SLOT      (sizeof(uint64_t) + sizeof(void *)) /* bytes of a child slot: key, pointer */
#define REG_MAP_BYTES (1u << 20) /* a node registry this big is a mapping of its own */

/* ---- allocation with byte accounting -------------------------------------------------------- */

static void *rx_malloc(kvt_radix_t *t, size_t n)
{
    void *p = malloc(n);
    if (p)
        t->bytes += malloc_usable_size(p);
    return p;
}

static void *rx_realloc(kvt_radix_t *t, void *p, size_t n)
{
    size_t old = p ? malloc_usable_size(p) : 0;
    void *q = realloc(p, n);
    if (q)
        t->bytes += malloc_usable_size(q) - old;
    return q;
}

static void rx_free(kvt_radix_t *t, void *p)
{
    if (!p)
        return;
    t->bytes -= malloc_usable_size(p);
    free(p);
}

/*
 * ---- the node arena --------------------------------------------------------------------------
 *
 * Nodes, their page storage and their child arrays (everything that grows and shrinks with the
 * cached pages) come from the tree's own arena rather than from malloc: chunks mapped with
 * MAP_POPULATE (the kernel fills every page in one call, where a growing heap took a fault per
 * 4 KiB page, 12 a request on the conversation trace, each about 2 us with its zeroing), carved
 * by a bump pointer into slots of size classes, eight to a doubling (at most an eighth more than
 * asked), and freed slots kept on a list per class for the next
 * allocation of that class. Nothing goes back to the kernel until the tree is destroyed: a split,
 * an eviction or a namespace's removal leaves its slots for the next insert, which then touches
 * no new page.
 *
 *     chunk: [ next chunk, bytes | slot | slot | ... | bump region ......... ]
 *     slot:  [ 8-byte header: class | payload, 16-byte aligned ]
 *
 * Chunks are 1 MiB, then 2 MiB (ARENA_STEP_MAX): each is faulted in by one call (0.6 us of CPU a
 * 4 KiB page here against 0.85 us a page faulted by touching it), and 2 MiB at once is 0.3 ms,
 * short enough for the insert that pays it (bench_index_pauses counts inserts over 1 ms).
 * Pre-faulting still zeroes every page, and a request adds some 50 KB of tokens and blocks on the
 * conversation trace: conf.arena_reserve maps and fills a first chunk that big, on huge pages where
 * the kernel has them (reserve_map), when the tree is made, so that the first requests do not pay
 * for it. The mapped total stays within conf.arena_bytes (kvtierd passes index-bytes); past it, and
 * for a request above the largest class (a big child table), the slot comes from malloc behind the
 * same header. The tree's byte count counts slots, as it counted malloc's usable sizes;
 * kvt_radix_stats reports the mapped total beside it.
 */
#define ARENA_HDR       8                 /* the header before each payload */
#define ARENA_CLASSES   111               /* 32 B .. 1 MiB slots */
#define ARENA_MALLOC    UINT32_MAX        /* the header of a slot that malloc made */
#define ARENA_FIRST     ((size_t)1 << 20) /* the first chunk; then ARENA_STEP_MAX */
#define ARENA_STEP_MAX  ((size_t)2 << 20)
#define ARENA_CHUNK_HDR 64 /* next chunk and its size, a cache line so that slots stay aligned */
_Static_assert(KVT_ARRAY_LEN(((kvt_radix_t *)0)->ar_free) == ARENA_CLASSES, "a list per class");

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#define ARENA_POISON(p, n)   ASAN_POISON_MEMORY_REGION(p, n)
#define ARENA_UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION(p, n)
#else
#define ARENA_POISON(p, n)   ((void)(p), (void)(n))
#define ARENA_UNPOISON(p, n) ((void)(p), (void)(n))
#endif

/* Slot bytes (header included) of class c: 32, 48, ..., 256, then eight to a doubling. */
static size_t class_size(uint32_t c)
{
    if (c < 15)
        return ((size_t)c + 2) * 16;
    uint32_t lg = 8 + (c - 15) / 8, k = (c - 15) % 8;
    return ((size_t)1 << lg) + ((size_t)k + 1) * ((size_t)1 << (lg - 3));
}

/* The smallest class whose slots hold s bytes (header included); ARENA_CLASSES when none does. */
static uint32_t class_of(size_t s)
{
    if (s <= 256)
        return s <= 32 ? 0 : (uint32_t)((s + 15) / 16 - 2);
    uint32_t lg = 63 - (uint32_t)__builtin_clzll((unsigned long long)s - 1);
    uint32_t c = 15 + (lg - 8) * 8 + (uint32_t)((s - 1 - ((size_t)1 << lg)) >> (lg - 3));
    return c < ARENA_CLASSES ? c : ARENA_CLASSES;
}

static uint64_t *slot_hdr(const void *p)
{
    return (uint64_t *)((uint8_t *)(uintptr_t)p - ARENA_HDR);
}

/* Bytes a slot counts for: its class, or what malloc handed out for it. */
static size_t slot_bytes(const void *p)
{
    if (!p)
        return 0;
    uint64_t h = *slot_hdr(p);
    return h == ARENA_MALLOC ? malloc_usable_size(slot_hdr(p) - 1) : class_size((uint32_t)h);
}

static void free_push(kvt_radix_t *t, uint8_t *slot, uint32_t c)
{
    void **link = (void **)(slot + ARENA_HDR);
    ARENA_UNPOISON(slot, ARENA_HDR + sizeof(void *));
    *(uint64_t *)slot = c;
    *link = t->ar_free[c];
    t->ar_free[c] = link;
    ARENA_POISON(slot, class_size(c));
}

/*
 * The reserve's mapping: on transparent huge pages where the kernel has them (2 MiB aligned,
 * MADV_HUGEPAGE), filled before the tree is used. Huge pages cost more to fill (compaction:
 * 0.55-0.6 s of CPU a GiB here against 0.14-0.15 on 4 KiB pages) but that is paid at start, not in
 * a request, and the walk then misses the TLB far less: the conversation trace's fill took 3.8-3.9
 * us of CPU a request against 4.9-5.0 on small pages. A chunk grown later stays on small pages:
 * filling huge pages in a request stalled the event loop for tens of ms (bench_index_pauses).
 */
static uint8_t *reserve_map(size_t bytes)
{
    size_t huge = (size_t)2 << 20;
    uint8_t *raw =
        mmap(NULL, bytes + huge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED)
        return MAP_FAILED;
    uint8_t *m = (uint8_t *)(((uintptr_t)raw + huge - 1) & ~(uintptr_t)(huge - 1));
    if (m > raw)
        munmap(raw, (size_t)(m - raw));
    munmap(m + bytes, (size_t)(raw + huge - m));
    (void)madvise(m, bytes, MADV_HUGEPAGE); /* refused: small pages, still filled below */
#if defined(MADV_POPULATE_WRITE)
    if (madvise(m, bytes, MADV_POPULATE_WRITE) == 0)
        return m;
#endif
    for (size_t i = 0; i < bytes; i += 4096) /* kernels before 5.14 */
        ((volatile uint8_t *)m)[i] = 0;
    return m;
}

/* Maps a chunk with room for a slot of class c; 0, or -1 when over conf.arena_bytes or the
 * kernel refuses (the caller goes to malloc). The old bump region's rest goes to free lists. */
static int arena_grow(kvt_radix_t *t, uint32_t c, size_t want)
{
    size_t need = class_size(c) + ARENA_CHUNK_HDR + 16;
    size_t bytes = KVT_MAX(want, t->ar_next ? t->ar_next : ARENA_FIRST);
    while (bytes < need)
        bytes *= 2;
    if (t->conf.arena_bytes && t->ar_mapped + bytes > t->conf.arena_bytes) {
        bytes = (t->conf.arena_bytes - KVT_MIN(t->ar_mapped, t->conf.arena_bytes)) & ~(size_t)4095;
        if (bytes < need)
            return -1;
    }
    uint8_t *m = want ? reserve_map(bytes)
                      : mmap(NULL, bytes, PROT_READ | PROT_WRITE,
                             MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (m == MAP_FAILED)
        return -1;
    ARENA_UNPOISON(m, bytes); /* as arena_destroy: an earlier mapping's poison may linger */
    /* The rest of the old region: the largest slots that fit, most of it in one or two. */
    while (t->ar_cur && (size_t)(t->ar_end - t->ar_cur) >= class_size(0)) {
        uint32_t k = class_of((size_t)(t->ar_end - t->ar_cur));
        if (k == ARENA_CLASSES || class_size(k) > (size_t)(t->ar_end - t->ar_cur))
            k--;
        free_push(t, t->ar_cur, k);
        t->ar_cur += class_size(k);
    }
    t->ar_waste += (size_t)(t->ar_end - t->ar_cur) + ARENA_CHUNK_HDR + ARENA_HDR;
    ((void **)m)[0] = t->ar_chunks;
    ((size_t *)m)[1] = bytes;
    t->ar_chunks = m;
    t->ar_mapped += bytes;
    t->ar_next = KVT_MIN(bytes * 2, ARENA_STEP_MAX);
    /* Slots start 8 bytes past a 16-byte boundary: payloads are 16-byte aligned (the streaming
     * stores of fill_blocks and copy_stream want that). */
    t->ar_cur = m + ARENA_CHUNK_HDR + ARENA_HDR;
    t->ar_end = m + bytes;
    ARENA_POISON(t->ar_cur, (size_t)(t->ar_end - t->ar_cur));
    return 0;
}

/* n bytes from the arena (or malloc, behind the same header); NULL when out of memory. */
static void *nd_alloc(kvt_radix_t *t, size_t n, int zero)
{
    uint32_t c = class_of(n + ARENA_HDR);
    uint8_t *slot = NULL;
    if (c < ARENA_CLASSES) {
        void **link = t->ar_free[c];
        if (link) {
            ARENA_UNPOISON((uint8_t *)link - ARENA_HDR, class_size(c));
            t->ar_free[c] = *link;
            slot = (uint8_t *)link - ARENA_HDR;
        } else if ((size_t)(t->ar_end - t->ar_cur) >= class_size(c) || arena_grow(t, c, 0) == 0) {
            slot = t->ar_cur;
            t->ar_cur += class_size(c);
            ARENA_UNPOISON(slot, class_size(c));
        }
    }
    if (slot) {
        *(uint64_t *)slot = c;
        if (zero)
            memset(slot + ARENA_HDR, 0, n);
        t->bytes += class_size(c);
        t->ar_live += class_size(c);
        return slot + ARENA_HDR;
    }
    /* Two header words from malloc keep the payload 16-byte aligned. */
    uint64_t *m = zero ? calloc(1, n + 2 * ARENA_HDR) : malloc(n + 2 * ARENA_HDR);
    if (!m)
        return NULL;
    m[1] = ARENA_MALLOC;
    t->bytes += malloc_usable_size(m);
    return m + 2;
}

static void nd_free(kvt_radix_t *t, void *p)
{
    if (!p)
        return;
    uint64_t h = *slot_hdr(p);
    t->bytes -= slot_bytes(p);
    if (h == ARENA_MALLOC) {
        free(slot_hdr(p) - 1);
    } else {
        t->ar_live -= class_size((uint32_t)h);
        free_push(t, (uint8_t *)slot_hdr(p), (uint32_t)h);
    }
}

/* Moves p's first n bytes (those it has, when it is smaller) to a slot of n bytes; p stays when
 * its class is already right. NULL when out of memory (p as it was). */
static void *nd_realloc(kvt_radix_t *t, void *p, size_t n)
{
    if (!p)
        return nd_alloc(t, n, 0);
    uint64_t h = *slot_hdr(p);
    uint32_t c = class_of(n + ARENA_HDR);
    if (h != ARENA_MALLOC && c == h)
        return p;
    void *q = nd_alloc(t, n, 0);
    if (!q)
        return NULL;
    memcpy(q, p, KVT_MIN(n, slot_bytes(p) - (h == ARENA_MALLOC ? 2 * ARENA_HDR : ARENA_HDR)));
    nd_free(t, p);
    return q;
}

static void arena_destroy(kvt_radix_t *t)
{
    for (void *m = t->ar_chunks, *next; m; m = next) {
        next = ((void **)m)[0];
        size_t bytes = ((size_t *)m)[1];
        /* ASan keeps a region's poison past munmap: the next mapping at this address (another
         * tree's chunk) would start poisoned. */
        ARENA_UNPOISON(m, bytes);
        munmap(m, bytes);
    }
    t->ar_chunks = NULL;
}

/* malloc_usable_size rounds each allocation up to a size class: at most a quarter more. */
static uint64_t rounded(uint64_t b)
{
    return b + b / 4 + 8 * 64;
}

static size_t storage_bytes(uint32_t cap, uint32_t page_size)
{
    return (size_t)cap * (sizeof(kvt_block_t) + (size_t)page_size * sizeof(uint32_t));
}

static kvt_radix_node_t **kids_ptrs(const kvt_radix_node_t *n)
{
    return (kvt_radix_node_t **)(n->keys + n->kcap);
}

/* The chain hash of a page (never 0: 0 means "not computed"). */
static inline uint64_t page_hash(const uint32_t *tokens, uint32_t page_size, uint64_t seed)
{
    uint64_t h = XXH3_64bits_withSeed(tokens, (size_t)page_size * sizeof(uint32_t), seed);
    return h ? h : 1;
}

/* The key a child is found by under its parent: a hash of its first page alone. */
static inline uint64_t page_key(const uint32_t *tokens, uint32_t page_size)
{
    return XXH3_64bits(tokens, (size_t)page_size * sizeof(uint32_t));
}

/*
 * Copies a new node's tokens with non-temporal stores when the run is large: the pages are next
 * read when a later request shares them, long after they have left the cache, so pulling every
 * destination line into the cache first (what an ordinary store does) only doubles the memory
 * traffic of an insert.
 */
static void copy_stream(void *dst, const void *src, size_t n)
{
#if defined(__x86_64__)
    if (n >= 8192) {
        uint8_t *d = dst;
        const uint8_t *s = src;
        size_t head = (16 - ((uintptr_t)d & 15)) & 15;
        memcpy(d, s, head);
        d += head, s += head, n -= head;
        for (; n >= 64; n -= 64, d += 64, s += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)s);
            __m128i b = _mm_loadu_si128((const __m128i *)(s + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(s + 32));
            __m128i e = _mm_loadu_si128((const __m128i *)(s + 48));
            _mm_stream_si128((__m128i *)d, a);
            _mm_stream_si128((__m128i *)(d + 16), b);
            _mm_stream_si128((__m128i *)(d + 32), c);
            _mm_stream_si128((__m128i *)(d + 48), e);
        }
        _mm_sfence();
        memcpy(d, s, n);
        return;
    }
#endif
    memcpy(dst, src, n);
}

/* Fills n blocks with copies of proto, streaming large runs for the same reason as above. */
static void fill_blocks(kvt_block_t *b, uint32_t n, const kvt_block_t *proto)
{
    uint32_t i = 0;
#if defined(__x86_64__)
    _Static_assert(sizeof(kvt_block_t) * 2 == 5 * 16, "two blocks are five 16-byte stores");
    if (n >= 64 && ((uintptr_t)b & 15) == 0) {
        kvt_block_t pair[2] = {*proto, *proto};
        __m128i v[5];
        memcpy(v, pair, sizeof(v));
        for (; i + 2 <= n; i += 2) {
            __m128i *d = (__m128i *)(b + i);
            for (int k = 0; k < 5; k++)
                _mm_stream_si128(d + k, v[k]);
        }
        _mm_sfence();
    }
#endif
    for (; i < n; i++)
        b[i] = *proto;
}

/* ---- evictable list ------------------------------------------------------------------------- */

static void list_update(kvt_radix_t *t, kvt_radix_node_t *n)
{
    int want = n->idx != NO_SLOT && n->nkids == 0 && n->leases == 0 && n->npages > 0;
    if (want == n->in_list)
        return;
    if (want) {
        n->lnext = t->list.lnext;
        n->lprev = &t->list;
        t->list.lnext->lprev = n;
        t->list.lnext = n;
        t->nlist++;
    } else {
        n->lprev->lnext = n->lnext;
        n->lnext->lprev = n->lprev;
        n->lprev = n->lnext = NULL;
        t->nlist--;
    }
    n->in_list = (uint8_t)want;
}

/* ---- nodes ---------------------------------------------------------------------------------- */

/* The start of a node's storage allocation (NULL for a root). */
static void *node_store(const kvt_radix_node_t *n)
{
    return n->blocks ? n->blocks - n->off : NULL;
}

/* Points blocks and tokens at slot off of a storage with cap slots. */
static void node_set_store(kvt_radix_node_t *n, void *store, uint32_t cap, uint32_t off)
{
    n->cap = cap;
    n->off = off;
    n->blocks = (kvt_block_t *)store + off;
    n->tokens = (uint32_t *)((kvt_block_t *)store + cap) + (size_t)off * n->page_size;
}

/* Sets a node's storage capacity, keeping its npages pages and moving them to slot 0. */
static int node_set_cap(kvt_radix_t *t, kvt_radix_node_t *n, uint32_t cap)
{
    kvt_assert(cap >= n->npages);
    size_t tok_bytes = (size_t)n->npages * n->page_size * sizeof(uint32_t);
    if (cap == n->cap && n->off == 0)
        return 0;
    void *s = node_store(n);
    if (cap > n->cap) {
        s = nd_realloc(t, node_store(n), storage_bytes(cap, n->page_size));
        if (!s)
            return KVT_ENOMEM;
    }
    /* Blocks to the front first: their new place ends before the old tokens start. Then the
     * tokens to where the block area of cap slots ends. */
    const uint32_t *old_tok =
        (const uint32_t *)((const kvt_block_t *)s + n->cap) + (size_t)n->off * n->page_size;
    memmove(s, (kvt_block_t *)s + n->off, n->npages * sizeof(kvt_block_t));
    memmove((kvt_block_t *)s + cap, old_tok, tok_bytes);
    if (cap < n->cap) {
        void *q = nd_realloc(t, s, storage_bytes(cap, n->page_size));
        if (q) /* a failed shrink keeps the old, larger allocation: still valid */
            s = q;
    }
    node_set_store(n, s, cap, 0);
    return 0;
}

/* Whether the registry is a mapping of its own (REG_MAP_BYTES and more) rather than a malloc. */
static int registry_mapped(const kvt_radix_t *t)
{
    return t->nodes_cap * sizeof(void *) >= REG_MAP_BYTES;
}

/*
 * Doubles the registry. A big one is a mapping of its own, grown with mremap: the kernel moves
 * its pages instead of copying them (a realloc copied 8 MB in 6.2 ms at a million nodes, 16 MB
 * in 12.7 ms at two million, jemalloc, with the event loop waiting).
 */
static int registry_grow(kvt_radix_t *t)
{
    size_t cap = t->nodes_cap ? t->nodes_cap * 2 : 64;
    size_t ob = t->nodes_cap * sizeof(void *), nb = cap * sizeof(void *);
    void *v;
    if (nb < REG_MAP_BYTES) {
        v = rx_realloc(t, t->nodes, nb);
        if (!v)
            return KVT_ENOMEM;
    } else if (ob >= REG_MAP_BYTES) {
        v = mremap(t->nodes, ob, nb, MREMAP_MAYMOVE);
        if (v == MAP_FAILED)
            return KVT_ENOMEM;
        t->bytes += nb - ob;
    } else {
        v = mmap(NULL, nb, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (v == MAP_FAILED)
            return KVT_ENOMEM;
        memcpy(v, t->nodes, t->nnodes * sizeof(void *));
        rx_free(t, t->nodes);
        t->bytes += nb;
    }
    t->nodes = v;
    t->nodes_cap = cap;
    return 0;
}

static int registry_add(kvt_radix_t *t, kvt_radix_node_t *n)
{
    if (t->nnodes == t->nodes_cap && registry_grow(t) < 0)
        return KVT_ENOMEM;
    n->idx = (uint32_t)t->nnodes;
    t->nodes[t->nnodes++] = n;
    return 0;
}

/*
 * A mapped registry at most a quarter full gives its tail back, REG_MAP_BYTES a removal, down to
 * REG_MAP_BYTES (it stays a mapping): a tree that once held millions of nodes does not keep 8
 * bytes for each in index-bytes. A step at a time, as a big child table's old pages go back:
 * unmapping tens of MB at once would stop the loop for milliseconds. A mapped registry's size is
 * a multiple of REG_MAP_BYTES (doubled from it, shrunk by it), and so of the page size.
 */
static void registry_shrink(kvt_radix_t *t)
{
    size_t ob = t->nodes_cap * sizeof(void *);
    if (ob <= REG_MAP_BYTES || t->nnodes > t->nodes_cap / 4)
        return;
    size_t nb = ob - REG_MAP_BYTES;
    void *v = mremap(t->nodes, ob, nb, 0); /* in place */
    if (v == MAP_FAILED)
        return; /* it keeps its pages */
    t->nodes_cap = nb / sizeof(void *);
    t->bytes -= ob - nb;
}

static void registry_del(kvt_radix_t *t, kvt_radix_node_t *n)
{
    kvt_radix_node_t *last = t->nodes[--t->nnodes];
    t->nodes[n->idx] = last;
    last->idx = n->idx;
    registry_shrink(t);
}

/* Allocates a node with room for npages pages (storage uninitialised). */
static kvt_radix_node_t *node_new(kvt_radix_t *t, uint32_t ns, uint32_t page_size, uint32_t npages)
{
    kvt_radix_node_t *n = nd_alloc(t, sizeof(*n), 0);
    if (!n)
        return NULL;
    memset(n, 0, sizeof(*n));
    n->ns = ns;
    n->page_size = (uint16_t)page_size;
    n->idx = NO_SLOT;
    if (npages > 0) {
        void *store = nd_alloc(t, storage_bytes(npages, page_size), 0);
        if (!store) {
            nd_free(t, n);
            return NULL;
        }
        node_set_store(n, store, npages, 0);
    }
    return n;
}

static void node_free(kvt_radix_t *t, kvt_radix_node_t *n)
{
    kvt_assert(n != t->mig); /* emptied through kid_free_all or kid_densify, which end a move */
    nd_free(t, n->keys);
    nd_free(t, node_store(n));
    nd_free(t, n);
}

/* Index of the first key >= key in n's children (sorted array). */
static uint32_t kid_lower_bound(const kvt_radix_node_t *n, uint64_t key)
{
    uint32_t lo = 0, hi = n->nkids;
    while (lo < hi) {
        uint32_t mid = (lo + hi) / 2;
        if (n->keys[mid] < key)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* Slots to look at when visiting every child: the array's first nkids, or the whole table. */
static uint32_t kid_slots(const kvt_radix_node_t *n)
{
    return n->kid_hash ? n->kcap : n->nkids;
}

/* The slot holding key, or UINT32_MAX. */
static uint32_t kid_slot(const kvt_radix_node_t *n, uint64_t key)
{
    kvt_radix_node_t *const *p = kids_ptrs(n);
    if (!n->kid_hash) {
        uint32_t i = kid_lower_bound(n, key);
        return i < n->nkids && n->keys[i] == key ? i : UINT32_MAX;
    }
    uint32_t mask = n->kcap - 1;
    for (uint32_t i = (uint32_t)key & mask;; i = (i + 1) & mask) {
        if (!p[i])
            return UINT32_MAX;
        if (n->keys[i] == key)
            return i;
    }
}

/* Puts (key, c) in n's hash table, which has a free slot. */
static void kid_hash_put(kvt_radix_node_t *n, uint64_t key, kvt_radix_node_t *c)
{
    kvt_radix_node_t **p = kids_ptrs(n);
    uint32_t mask = n->kcap - 1, i = (uint32_t)key & mask;
    while (p[i])
        i = (i + 1) & mask;
    n->keys[i] = key;
    p[i] = c;
}

/*
 * Growing a big table. Rehashing a child table in one go stops the tree for as long as it takes
 * (a root with 1.1 million children: 44 ms on this project's VM). A table of at least
 * conf.step_table_slots slots grows as Redis grows its dicts: the new table is made at once and
 * the old one kept (t->mig, one node at a time), and each insert, removal and eviction moves
 * 1/64 of step_table_slots of the old slots over (1,024 by default: an old table of 65,536 slots
 * or more is moved over 64 or more of them). It shrinks the same way, into a smaller new table
 * (kid_shrink). Meanwhile a lookup that misses in the new table looks in the old one, where a
 * moved entry leaves KID_MOVED so that probes go on past it; an entry the tree is about to change
 * or delete is moved first (mig_take), so that changes only touch the new table; a walk over all
 * children finishes the move first or looks in both.
 */
static kvt_radix_node_t **mig_ptrs(const kvt_radix_t *t)
{
    return (kvt_radix_node_t **)(t->mig_keys + t->mig_cap);
}

/* The old table's slot holding key, or NO_SLOT. It ends in an empty slot: it was at most half
 * full, and moved entries become KID_MOVED, never NULL. */
static uint32_t mig_slot(const kvt_radix_t *t, uint64_t key)
{
    kvt_radix_node_t *const *p = mig_ptrs(t);
    uint32_t mask = t->mig_cap - 1;
    for (uint32_t i = (uint32_t)key & mask;; i = (i + 1) & mask) {
        if (!p[i])
            return NO_SLOT;
        if (p[i] != KID_MOVED && t->mig_keys[i] == key)
            return i;
    }
}

/* Frees the old table left by the last move. */
static void old_free(kvt_radix_t *t)
{
    nd_free(t, t->old_tab);
    t->old_tab = NULL;
    t->old_bytes = t->old_done = 0;
}

/*
 * Gives back `bytes` more of the old table's pages (MADV_DONTNEED: nothing reads it any more),
 * freeing it once all are: freeing 64 MB of touched pages at once took 6-7 ms, most of it the
 * kernel unmapping them.
 */
static void old_step(kvt_radix_t *t, size_t bytes)
{
    if (!t->old_tab)
        return;
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE), base = (uintptr_t)t->old_tab;
    uintptr_t from = (base + t->old_done + page - 1) & ~(page - 1);
    t->old_done = KVT_MIN(t->old_bytes, t->old_done + bytes);
    uintptr_t to = (base + t->old_done) & ~(page - 1);
    if (to > from)
        madvise((void *)from, to - from, MADV_DONTNEED);
    if (t->old_done == t->old_bytes)
        old_free(t);
}

static uint32_t step_above(const kvt_radix_t *t)
{
    return t->conf.step_table_slots ? t->conf.step_table_slots : 65536;
}

/* Moves `slots` slots of the old table over (one step: step_above / 64). */
static void mig_step(kvt_radix_t *t, uint32_t slots)
{
    if (!t->mig)
        return;
    kvt_radix_node_t **p = mig_ptrs(t);
    uint32_t end = t->mig_cap - t->mig_pos > slots ? t->mig_pos + slots : t->mig_cap;
    for (uint32_t i = t->mig_pos; i < end; i++)
        if (p[i] && p[i] != KID_MOVED) {
            kid_hash_put(t->mig, t->mig_keys[i], p[i]);
            p[i] = KID_MOVED;
        }
    t->mig_pos = end;
    if (end == t->mig_cap) {
        old_free(t); /* an earlier one not yet given back goes now */
        t->old_tab = t->mig_keys;
        t->old_bytes = (size_t)t->mig_cap * KID_SLOT;
        t->old_done = 0;
        t->mig = NULL;
        t->mig_keys = NULL;
        t->mig_cap = t->mig_pos = 0;
    }
}

/* One step of the move, if one is under way: each insert, removal and eviction takes one. */
static void mig_tick(kvt_radix_t *t)
{
    uint32_t slots = KVT_MAX(step_above(t) / 64, 1u);
    if (t->mig)
        mig_step(t, slots);
    else
        old_step(t, (size_t)slots * KID_SLOT * 4);
}

static void mig_finish(kvt_radix_t *t)
{
    mig_step(t, t->mig_cap);
}

/* Moves key's entry into n's new table if n's old table still has it. */
static void mig_take(kvt_radix_t *t, kvt_radix_node_t *n, uint64_t key)
{
    if (n != t->mig)
        return;
    uint32_t i = mig_slot(t, key);
    if (i != NO_SLOT) {
        kid_hash_put(n, key, mig_ptrs(t)[i]);
        mig_ptrs(t)[i] = KID_MOVED;
    }
}

static kvt_radix_node_t *kid_find(const kvt_radix_t *t, const kvt_radix_node_t *n, uint64_t key)
{
    if (n->nkids == 1 && !n->kid_hash) /* the common case: a chain, no search */
        return n->keys[0] == key ? kids_ptrs(n)[0] : NULL;
    uint32_t i = kid_slot(n, key);
    if (i != UINT32_MAX)
        return kids_ptrs(n)[i];
    if (n == t->mig && (i = mig_slot(t, key)) != NO_SLOT)
        return mig_ptrs(t)[i];
    return NULL;
}

/* Whether n has room for one more child as it is. */
static int kid_room(const kvt_radix_node_t *n)
{
    return n->kid_hash ? 2 * (n->nkids + 1) <= n->kcap : n->nkids < n->kcap;
}

/* n's child capacity after its next growth: the array doubles up to KID_ARRAY_MAX, then becomes a
 * table of four times that, which doubles whenever it would be more than half full. */
static uint32_t kid_next_cap(const kvt_radix_node_t *n)
{
    return n->kid_hash               ? n->kcap * 2
           : n->kcap == 0            ? 1
           : n->kcap < KID_ARRAY_MAX ? n->kcap * 2
                                     : 4 * KID_ARRAY_MAX;
}

/*
 * Gives n's children a new allocation of cap slots: a sorted array up to KID_ARRAY_MAX, a table
 * past it. With step set (n's table is big) the new table is made and the entries move over a
 * step at a time (t->mig, "Growing a big table"); otherwise at once, and the old allocation goes.
 * Growth and shrinking both come here. Returns 0 or KVT_ENOMEM (n as it was).
 */
static int kid_resize(kvt_radix_t *t, kvt_radix_node_t *n, uint32_t cap, int step)
{
    int hash = cap > KID_ARRAY_MAX;
    size_t bytes = (size_t)cap * KID_SLOT;
    uint64_t *k = nd_alloc(t, bytes, hash);
    if (!k)
        return KVT_ENOMEM;
    uint64_t *okeys = n->keys;
    uint32_t ocap = n->kcap, oslots = kid_slots(n);
    kvt_radix_node_t **old = kids_ptrs(n);
    n->keys = k;
    n->kcap = cap;
    if (step) {
        t->mig = n;
        t->mig_keys = okeys;
        t->mig_cap = ocap;
        t->mig_pos = 0;
        mig_tick(t);
        return 0;
    }
    n->kid_hash = (uint8_t)hash;
    kvt_radix_node_t **p = kids_ptrs(n);
    uint32_t d = 0;
    for (uint32_t i = 0; i < oslots; i++) {
        if (!old[i])
            continue;
        if (hash) {
            kid_hash_put(n, okeys[i], old[i]);
            continue;
        }
        uint32_t j = d++; /* the array is sorted by key: from an array this appends */
        for (; j > 0 && n->keys[j - 1] > okeys[i]; j--) {
            n->keys[j] = n->keys[j - 1];
            p[j] = p[j - 1];
        }
        n->keys[j] = okeys[i];
        p[j] = old[i];
    }
    kvt_assert(hash || d == n->nkids);
    nd_free(t, okeys);
    return 0;
}

/* Room for one more child. */
static int kid_reserve(kvt_radix_t *t, kvt_radix_node_t *n)
{
    if (kid_room(n))
        return 0;
    /* n's own move ends before it grows again, and another ends before n's starts (one old
     * table at a time); a table rehashed at once leaves another's move as it is. */
    int step = n->kid_hash && n->kcap >= step_above(t);
    if (n == t->mig || step)
        mig_finish(t);
    uint32_t cap = kid_next_cap(n);
    int rc = kid_resize(t, n, cap, step);
    if (rc == 0 && cap > t->max_kcap)
        t->max_kcap = cap;
    return rc;
}

static void kid_add(kvt_radix_node_t *n, kvt_radix_node_t *c)
{
    uint64_t key = page_key(c->tokens, c->page_size);
    c->parent = n;
    if (n->kid_hash) {
        kvt_assert(2 * (n->nkids + 1) <= n->kcap);
        kid_hash_put(n, key, c);
        n->nkids++;
        return;
    }
    uint32_t i = kid_lower_bound(n, key);
    kvt_assert(n->nkids < n->kcap);
    kvt_radix_node_t **p = kids_ptrs(n);
    memmove(n->keys + i + 1, n->keys + i, (n->nkids - i) * sizeof(uint64_t));
    memmove(p + i + 1, p + i, (n->nkids - i) * sizeof(void *));
    n->keys[i] = key;
    p[i] = c;
    n->nkids++;
}

static void kid_free_all(kvt_radix_t *t, kvt_radix_node_t *n)
{
    if (n == t->mig)
        mig_finish(t); /* nothing left to move: it frees the old table */
    nd_free(t, n->keys);
    n->keys = NULL;
    n->kcap = n->nkids = 0;
    n->kid_hash = 0;
}

/*
 * A table at most 1/8 full shrinks: to a table a quarter full, or back to the sorted array once
 * half an array's worth of children is left. A node that once had millions of children thus
 * gives their table back as they go. Below step_table_slots in one go (a rehash of at most that
 * many slots, the old table freed at once); a bigger one a step at a time, as it grew, once it is
 * at most 1/64 full, so that the new table that sits beside the old one during the move is at
 * most 1/8 of its size, and only while no other table is moving or being given back.
 */
static void kid_shrink(kvt_radix_t *t, kvt_radix_node_t *n)
{
    if (!n->kid_hash || n == t->mig || 8 * n->nkids > n->kcap)
        return;
    int step = n->kcap >= step_above(t);
    if (step && (t->mig || t->old_tab || 64 * n->nkids > n->kcap))
        return; /* nor while the last move's old table is being given back: its end frees it */
    int array = n->nkids <= KID_ARRAY_MAX / 2 && !step;
    uint32_t cap = array ? KID_ARRAY_MAX : 4 * KID_ARRAY_MAX;
    while (!array && cap < 4 * n->nkids)
        cap *= 2;
    if (cap < n->kcap)
        kid_resize(t, n, cap, step); /* KVT_ENOMEM leaves it as it is, which is no worse */
}

static void kid_del(kvt_radix_t *t, kvt_radix_node_t *n, uint64_t key)
{
    mig_take(t, n, key);
    uint32_t i = kid_slot(n, key);
    kvt_assert(i != UINT32_MAX);
    kvt_radix_node_t **p = kids_ptrs(n);
    if (n->kid_hash) {
        /* Backward-shift deletion: every entry after the hole that may move into it does, so
         * that no probe sequence is broken and no tombstone is left. */
        uint32_t mask = n->kcap - 1;
        for (uint32_t j = (i + 1) & mask; p[j]; j = (j + 1) & mask) {
            uint32_t home = (uint32_t)n->keys[j] & mask;
            if (((j - home) & mask) >= ((j - i) & mask)) {
                n->keys[i] = n->keys[j];
                p[i] = p[j];
                i = j;
            }
        }
        p[i] = NULL;
    } else {
        memmove(n->keys + i, n->keys + i + 1, (n->nkids - i - 1) * sizeof(uint64_t));
        memmove(p + i, p + i + 1, (n->nkids - i - 1) * sizeof(void *));
    }
    n->nkids--;
    if (n->nkids == 0)
        kid_free_all(t, n);
    else
        kid_shrink(t, n);
}

/* Moves n's children to the front of its allocation, in no order, for tear-down only: after
 * this, children can be taken from the end (nkids - 1 down) but no longer looked up. */
static void kid_densify(kvt_radix_t *t, kvt_radix_node_t *n)
{
    if (!n->kid_hash)
        return;
    if (n == t->mig)
        mig_finish(t);
    kvt_radix_node_t **p = kids_ptrs(n);
    uint32_t d = 0;
    for (uint32_t i = 0; i < n->kcap; i++)
        if (p[i]) {
            n->keys[d] = n->keys[i];
            p[d++] = p[i];
        }
    kvt_assert(d == n->nkids);
    n->kid_hash = 0;
}

static int is_root(const kvt_radix_node_t *n)
{
    return n->idx == NO_SLOT;
}

/* ---- tree ----------------------------------------------------------------------------------- */

int kvt_radix_create(kvt_radix_t **out, const kvt_radix_conf_t *conf)
{
    if (!out)
        return KVT_EINVAL;
    *out = NULL;
    if (conf && (conf->freq_half_life < 0 || isnan(conf->freq_half_life)))
        return KVT_EINVAL;
    kvt_radix_t *t = calloc(1, sizeof(*t));
    if (!t)
        return KVT_ENOMEM;
    t->bytes = malloc_usable_size(t);
    if (conf)
        t->conf = *conf;
    if (t->conf.freq_half_life == 0)
        t->conf.freq_half_life = 600000.0f;
    t->decay_per_tick = 1.0f / t->conf.freq_half_life;
    t->list.lnext = t->list.lprev = &t->list;
    t->lease_free = NO_SLOT;
    t->ns_free = NO_SLOT;
    kvt_radix_set_max_namespaces(t, t->conf.max_namespaces);
    t->rng = 0x9e3779b97f4a7c15ull;
    if (t->conf.arena_reserve) {
        size_t r = t->conf.arena_reserve;
        if (t->conf.arena_bytes)
            r = KVT_MIN(r, t->conf.arena_bytes);
        if (arena_grow(t, 0, (r + 4095) & ~(size_t)4095) != 0) {
            kvt_radix_destroy(t);
            return KVT_ENOMEM;
        }
    }
    *out = t;
    return 0;
}

static void subtree_free(kvt_radix_t *t, kvt_radix_node_t *n, kvt_radix_why_t why);

void kvt_radix_destroy(kvt_radix_t *t)
{
    if (!t)
        return;
    for (uint32_t i = 0; i < t->nns; i++) {
        if (t->ns[i].root)
            subtree_free(t, t->ns[i].root, KVT_RADIX_DESTROY);
        free(t->ns[i].desc);
    }
    free(t->ns);
    free(t->ns_slots);
    old_free(t);
    if (registry_mapped(t))
        munmap(t->nodes, t->nodes_cap * sizeof(void *));
    else
        free(t->nodes);
    free(t->leases);
    arena_destroy(t);
    free(t);
}

void kvt_radix_set_clock(kvt_radix_t *t, uint32_t now)
{
    if (t)
        t->clock = now;
}

uint32_t kvt_radix_clock(const kvt_radix_t *t)
{
    return t ? t->clock : 0;
}

/* ---- namespaces ----------------------------------------------------------------------------- */

static int ns_live(const kvt_radix_t *t, uint32_t ns)
{
    return ns < t->nns && t->ns[ns].root != NULL;
}

/* The slot of seed in the namespace index: where it is, or the empty one where it would go. */
static uint32_t ns_slot(const kvt_radix_t *t, uint64_t seed)
{
    uint32_t mask = t->ns_slots_cap - 1, i = (uint32_t)seed & mask;
    while (t->ns_slots[i] && t->ns[t->ns_slots[i] - 1].seed != seed)
        i = (i + 1) & mask;
    return i;
}

/* Room in the namespace index for one more. */
static int ns_index_reserve(kvt_radix_t *t)
{
    if (2 * (t->ns_open + 1) <= t->ns_slots_cap)
        return 0;
    uint32_t cap = t->ns_slots_cap ? 2 * t->ns_slots_cap : 16;
    uint32_t *v = rx_malloc(t, cap * sizeof(*v));
    if (!v)
        return KVT_ENOMEM;
    memset(v, 0, cap * sizeof(*v));
    rx_free(t, t->ns_slots);
    t->ns_slots = v;
    t->ns_slots_cap = cap;
    for (uint32_t id = 0; id < t->nns; id++)
        if (t->ns[id].root)
            t->ns_slots[ns_slot(t, t->ns[id].seed)] = id + 1;
    return 0;
}

/* Takes slot i out of the namespace index: backward-shift deletion, as kid_del does. */
static void ns_index_del(kvt_radix_t *t, uint32_t i)
{
    uint32_t mask = t->ns_slots_cap - 1;
    for (uint32_t j = (i + 1) & mask; t->ns_slots[j]; j = (j + 1) & mask) {
        uint32_t home = (uint32_t)t->ns[t->ns_slots[j] - 1].seed & mask;
        if (((j - home) & mask) >= ((j - i) & mask)) {
            t->ns_slots[i] = t->ns_slots[j];
            i = j;
        }
    }
    t->ns_slots[i] = 0;
}

/* The id + 1 of the namespace with this seed, 0 when none. */
static uint32_t ns_find(const kvt_radix_t *t, uint64_t seed)
{
    return t->ns_slots_cap ? t->ns_slots[ns_slot(t, seed)] : 0;
}

static int ns_add(kvt_radix_t *t, uint64_t seed, uint32_t page_size, char *desc, size_t desc_len,
                  uint32_t *ns_out)
{
    uint32_t found = ns_find(t, seed);
    if (found) {
        uint32_t i = found - 1;
        if (t->ns[i].page_size != page_size)
            return KVT_EINVAL;
        if (!t->ns[i].desc && desc) { /* first learnt by seed, now by name */
            t->ns[i].desc = rx_malloc(t, desc_len);
            if (t->ns[i].desc)
                memcpy(t->ns[i].desc, desc, desc_len);
        }
        *ns_out = i;
        return 0;
    }
    if (t->ns_open >= t->conf.max_namespaces)
        return KVT_ENOSPC;
    if (ns_index_reserve(t) < 0)
        return KVT_ENOMEM;
    if (t->ns_free == NO_SLOT && t->nns == t->ns_cap) {
        uint32_t cap = t->ns_cap ? t->ns_cap * 2 : 4;
        kvt_ns_t *v = rx_realloc(t, t->ns, cap * sizeof(*v));
        if (!v)
            return KVT_ENOMEM;
        t->ns = v;
        t->ns_cap = cap;
    }
    /* A closed id is reused first, so that ids stay below KVT_RADIX_NS_MAX. */
    uint32_t id = t->ns_free != NO_SLOT ? t->ns_free : t->nns;
    kvt_radix_node_t *root = node_new(t, id, page_size, 0);
    char *name = desc ? rx_malloc(t, desc_len) : NULL;
    if (!root || (desc && !name)) {
        if (root)
            node_free(t, root);
        return KVT_ENOMEM;
    }
    if (name)
        memcpy(name, desc, desc_len);
    if (id == t->nns)
        t->nns++;
    else
        t->ns_free = t->ns[id].next_free;
    t->ns[id] = (kvt_ns_t){
        .seed = seed, .page_size = page_size, .next_free = NO_SLOT, .root = root, .desc = name};
    t->ns_slots[ns_slot(t, seed)] = id + 1;
    t->ns_open++;
    *ns_out = id;
    return 0;
}

void kvt_radix_set_max_namespaces(kvt_radix_t *t, uint32_t max)
{
    if (t)
        t->conf.max_namespaces = max && max <= KVT_RADIX_NS_MAX ? max : KVT_RADIX_NS_MAX;
}

int kvt_radix_ns_close(kvt_radix_t *t, uint32_t ns)
{
    if (!t || !ns_live(t, ns))
        return KVT_EINVAL;
    kvt_ns_t *s = &t->ns[ns];
    if (s->root->nkids > 0)
        return KVT_EBUSY; /* no child, so no block, lease or I/O either */
    ns_index_del(t, ns_slot(t, s->seed));
    node_free(t, s->root);
    rx_free(t, s->desc);
    *s = (kvt_ns_t){.next_free = t->ns_free};
    t->ns_free = ns;
    t->ns_open--;
    return 0;
}

#define NS_TAG_LEN KVT_NS_TAG_LEN /* "kvtier-ns-v1" with its NUL: kvt_ns_describe */

int kvt_radix_ns_open(kvt_radix_t *t, const char *model, const char *adapter, const char *salt,
                      uint32_t page_size, uint32_t *ns_out)
{
    char buf[KVT_NS_DESC_MAX];
    size_t len = kvt_ns_describe(buf, model, adapter, salt, page_size);
    if (!t || !ns_out || !len)
        return KVT_EINVAL;
    /* The name kept is the strings, without the tag and the page size. */
    return ns_add(t, XXH3_64bits(buf, len), page_size, buf + NS_TAG_LEN, len - NS_TAG_LEN - 4,
                  ns_out);
}

uint64_t kvt_radix_ns_seed_of(const char *model, const char *adapter, const char *salt,
                              uint32_t page_size)
{
    return kvt_ns_seed_of(model, adapter, salt, page_size);
}

uint64_t kvt_radix_ns_need(const kvt_radix_t *t, const char *model, const char *adapter,
                           const char *salt, uint32_t page_size)
{
    char buf[KVT_NS_DESC_MAX];
    size_t len = kvt_ns_describe(buf, model, adapter, salt, page_size);
    if (!t || !len)
        return 0; /* refused by kvt_radix_ns_open, which then adds nothing */
    uint64_t b = len - NS_TAG_LEN - 4;
    uint32_t found = ns_find(t, XXH3_64bits(buf, len));
    if (found)
        return t->ns[found - 1].desc ? 0 : rounded(b);
    b += sizeof(kvt_radix_node_t);
    if (2 * (t->ns_open + 1) > t->ns_slots_cap)
        b += (uint64_t)(t->ns_slots_cap ? 2 * t->ns_slots_cap : 16) * sizeof(uint32_t);
    if (t->ns_free == NO_SLOT && t->nns == t->ns_cap)
        b += (uint64_t)(t->ns_cap ? 2 * t->ns_cap : 4) * sizeof(kvt_ns_t);
    return rounded(b);
}

int kvt_radix_ns_open_seed(kvt_radix_t *t, uint64_t seed, uint32_t page_size, uint32_t *ns_out)
{
    if (!t || !ns_out || page_size < 1 || page_size > KVT_PAGE_MAX)
        return KVT_EINVAL;
    return ns_add(t, seed, page_size, NULL, 0, ns_out);
}

uint32_t kvt_radix_ns_page_size(const kvt_radix_t *t, uint32_t ns)
{
    return t && ns_live(t, ns) ? t->ns[ns].page_size : 0;
}

uint64_t kvt_radix_ns_seed(const kvt_radix_t *t, uint32_t ns)
{
    return t && ns_live(t, ns) ? t->ns[ns].seed : 0;
}

int kvt_radix_hash_chain(const kvt_radix_t *t, uint32_t ns, uint64_t parent, const uint32_t *tokens,
                         size_t npages, uint64_t *hashes)
{
    if (!t || !ns_live(t, ns) || (npages && (!tokens || !hashes)))
        return KVT_EINVAL;
    uint32_t ps = t->ns[ns].page_size;
    uint64_t h = parent;
    for (size_t i = 0; i < npages; i++)
        hashes[i] = h = page_hash(tokens + i * ps, ps, h);
    return 0;
}

int kvt_radix_hash_pages(const kvt_radix_t *t, uint32_t ns, const uint32_t *tokens, size_t npages,
                         uint64_t *hashes)
{
    if (!t || !ns_live(t, ns))
        return KVT_EINVAL;
    return kvt_radix_hash_chain(t, ns, t->ns[ns].seed, tokens, npages, hashes);
}

/* ---- match ---------------------------------------------------------------------------------- */

/* How many of the first `avail` pages of a and b are equal (in whole pages). */
static uint32_t common_pages(const uint32_t *a, const uint32_t *b, uint32_t avail, uint32_t ps)
{
    size_t page_bytes = (size_t)ps * sizeof(uint32_t);
    uint32_t i = 0;
    /* Whole runs of 32 pages with one memcmp each; the first unequal run page by page. */
    while (i < avail) {
        uint32_t run = KVT_MIN(32u, avail - i);
        if (memcmp(a + (size_t)i * ps, b + (size_t)i * ps, run * page_bytes) == 0) {
            i += run;
            continue;
        }
        while (memcmp(a + (size_t)i * ps, b + (size_t)i * ps, page_bytes) == 0)
            i++;
        return i;
    }
    return avail;
}

/* Bumps the counters of blocks [0, n). Blocks on a path usually share last_access, so the decay
 * factor is computed once per run of equal last_access, and the run's loop does nothing else:
 * every MATCH runs it over each page of its path (a per-block check of the age against the last
 * one's, as it was, cost five instructions a page of the ~19). */
static void touch_blocks(kvt_radix_t *t, kvt_block_t *b, uint32_t n)
{
    uint32_t now = t->clock;
    for (kvt_block_t *e = b + n; b < e;) {
        uint32_t last = b->last_access;
        float factor = last == now ? 1.0f : exp2f(-(float)(now - last) * t->decay_per_tick);
        do {
            uint32_t hits;
            b->freq = b->freq * factor + 1.0f;
            b->last_access = now;
            /* Saturating: an add and a rarely taken branch (the compare and set it was cost
             * three instructions a page more). */
            if (!__builtin_add_overflow(b->hits, 1u, &hits))
                b->hits = hits;
        } while (++b < e && b->last_access == last);
    }
}

/* The walk shared by match, insert and remove. Stops at the first page not cached. On return:
 * parent is the last fully matched node (a root when nothing matched fully), node and k the
 * deepest node with matched pages and how many (NULL and 0 when none), pos the pages matched. */
typedef struct walk {
    kvt_radix_node_t *parent, *node;
    uint32_t k, pos;
    int collision; /* a child had page pos's key but other tokens */
} walk_t;

static void walk(kvt_radix_t *t, uint32_t ns, const uint32_t *tokens, uint32_t npages, int touch,
                 walk_t *w)
{
    uint32_t ps = t->ns[ns].page_size;
    kvt_radix_node_t *n = t->ns[ns].root;
    memset(w, 0, sizeof(*w));
    w->parent = n;
    while (w->pos < npages && n->nkids > 0) {
        const uint32_t *pg = tokens + (size_t)w->pos * ps;
        kvt_radix_node_t *c = kid_find(t, n, page_key(pg, ps));
        if (!c || memcmp(c->tokens, pg, (size_t)ps * sizeof(uint32_t)) != 0) {
            w->collision = c != NULL;
            return;
        }
        uint32_t avail = KVT_MIN(c->npages, npages - w->pos);
        uint32_t k = 1 + common_pages(c->tokens + ps, pg + ps, avail - 1, ps);
        if (touch)
            touch_blocks(t, c->blocks, k);
        w->node = c;
        w->k = k;
        w->pos += k;
        if (k < c->npages)
            return;
        w->parent = n = c;
    }
}

/* Whether w stopped inside a node, which an insert after it then splits. */
static int walk_inside(const walk_t *w)
{
    return w->node && w->k < w->node->npages;
}

int kvt_radix_match(kvt_radix_t *t, uint32_t ns, const uint32_t *tokens, size_t ntokens,
                    unsigned flags, kvt_match_t *m)
{
    if (!t || !m || !ns_live(t, ns) || (ntokens && !tokens) || ntokens > UINT32_MAX)
        return KVT_EINVAL;
    walk_t w;
    walk(t, ns, tokens, (uint32_t)(ntokens / t->ns[ns].page_size), !(flags & KVT_MATCH_NOTOUCH),
         &w);
    m->node = w.node;
    m->node_pages = w.k;
    m->pages = w.pos;
    m->ns = ns;
    m->epoch = t->epoch;
    return 0;
}

void kvt_radix_touch(kvt_radix_t *t, const kvt_match_t *m)
{
    if (!t || !m || !m->pages)
        return;
    kvt_assert(m->epoch == t->epoch);
    for (kvt_path_run_t r = kvt_path_run_first(m->node, m->node_pages); r.node;
         kvt_path_run_next(&r))
        touch_blocks(t, r.blocks, r.n);
}

/*
 * Asks for the cache lines of [p, p + len) without waiting for them. Into the L2 cache only
 * (locality 1, PREFETCHT2): on the AMD EPYC this was measured on, a T0 prefetch holds one of the
 * L1's few miss buffers until its line arrives, so a burst of them ran no faster than the
 * hardware prefetcher (6.8 GB/s over random 2 KiB runs), where T2 prefetches reached 15-16.
 */
static inline void prefetch_range(const void *p, size_t len)
{
    const char *b = (const char *)((uintptr_t)p & ~(uintptr_t)63), *e = (const char *)p + len;
    /* Four lines a step: a batch's warming asks for every line of its paths (some 190 a MATCH),
     * and the loop's own count and compare were three of the four instructions a line. */
    for (; e - b > 192; b += 256) {
        __builtin_prefetch(b, 0, 1);
        __builtin_prefetch(b + 64, 0, 1);
        __builtin_prefetch(b + 128, 0, 1);
        __builtin_prefetch(b + 192, 0, 1);
    }
    for (; b < e; b += 64)
        __builtin_prefetch(b, 0, 1);
}

/* kvt_radix_warm and kvt_radix_warm_plan: with a plan, each node's tokens and blocks are noted
 * in it (while it has room for the run) instead of asked for. */
static void warm(const kvt_radix_t *t, uint32_t ns, const kvt_token_run_t *runs, size_t n,
                 kvt_warm_plan_t *plan)
{
    uint32_t ps = t->ns[ns].page_size;
    size_t page_bytes = (size_t)ps * sizeof(uint32_t);
    struct {
        const kvt_radix_node_t *node; /* the parent on the first pass, then the child */
        const uint8_t *tokens;
        uint32_t pos, end; /* pages */
        uint32_t run;      /* its index in runs */
    } st[KVT_WARM_MAX];
    size_t live = 0;
    for (size_t i = 0; i < n && live < KVT_WARM_MAX; i++) {
        if (runs[i].ntokens / ps == 0 || !runs[i].tokens)
            continue;
        st[live].run = (uint32_t)i;
        st[live].node = t->ns[ns].root;
        st[live].tokens = runs[i].tokens;
        st[live].pos = 0;
        st[live].end = (uint32_t)KVT_MIN(runs[i].ntokens / ps, (size_t)UINT32_MAX);
        live++;
    }
    while (live > 0) {
        /* Every run one node down: the child its next page leads to, whose header is asked for
         * here and read on the second pass, by when it has had the other runs' time to arrive. */
        for (size_t i = 0; i < live;) {
            const kvt_radix_node_t *p = st[i].node, *c = NULL;
            if (p->nkids > 0)
                c = kid_find(t, p, XXH3_64bits(st[i].tokens + st[i].pos * page_bytes, page_bytes));
            if (!c) {
                st[i] = st[--live];
                continue;
            }
            prefetch_range(c, sizeof(*c));
            st[i].node = c;
            i++;
        }
        /* Its pages on the path and the keys the next step searches. */
        for (size_t i = 0; i < live;) {
            const kvt_radix_node_t *c = st[i].node;
            uint32_t avail = KVT_MIN(c->npages, st[i].end - st[i].pos);
            uint8_t *k = plan ? &plan->nspans[st[i].run] : NULL;
            if (k && *k < KVT_WARM_SPANS) {
                plan->span[st[i].run][(*k)++] = (kvt_warm_span_t){
                    .tokens = c->tokens,
                    .blocks = c->blocks,
                    .token_bytes = (uint32_t)(avail * page_bytes),
                    .block_bytes = (uint32_t)(avail * sizeof(kvt_block_t)),
                };
            } else {
                prefetch_range(c->tokens, avail * page_bytes);
                prefetch_range(c->blocks, avail * sizeof(kvt_block_t));
            }
            st[i].pos += avail;
            if (avail < c->npages || st[i].pos >= st[i].end || c->nkids == 0) {
                st[i] = st[--live];
                continue;
            }
            if (!c->kid_hash) { /* a table's slot depends on the key, found next step */
                prefetch_range(c->keys + c->nkids / 2, sizeof(uint64_t));
                prefetch_range(kids_ptrs(c) + c->nkids / 2, sizeof(void *));
            }
            i++;
        }
    }
}

void kvt_radix_warm(const kvt_radix_t *t, uint32_t ns, const kvt_token_run_t *runs, size_t n)
{
    if (t && runs && ns_live(t, ns))
        warm(t, ns, runs, n, NULL);
}

void kvt_radix_warm_plan(const kvt_radix_t *t, uint32_t ns, const kvt_token_run_t *runs, size_t n,
                         kvt_warm_plan_t *plan)
{
    if (!plan)
        return;
    plan->n = 0;
    if (!t || !runs || !ns_live(t, ns))
        return;
    plan->n = KVT_MIN(n, (size_t)KVT_WARM_MAX); /* run indexes stay below KVT_WARM_MAX */
    memset(plan->nspans, 0, plan->n);
    warm(t, ns, runs, plan->n, plan);
}

void kvt_radix_warm_run(const kvt_warm_plan_t *plan, size_t i)
{
    if (!plan || i >= plan->n)
        return;
    for (uint32_t k = 0; k < plan->nspans[i]; k++) {
        prefetch_range(plan->span[i][k].tokens, plan->span[i][k].token_bytes);
        prefetch_range(plan->span[i][k].blocks, plan->span[i][k].block_bytes);
    }
}

/* ---- insert --------------------------------------------------------------------------------- */

/*
 * Splits c after its first k pages by creating a new node p above it that takes those pages:
 *
 *     g -> c[0 .. n)        becomes        g -> p[0 .. k) -> c[k .. n)
 *
 * c keeps its address, children and leases (p inherits c's lease count: every lease through c
 * runs through p). Only the smaller half is copied: a small head goes to new storage for p and c
 * keeps its storage from slot off + k on; a large head keeps the storage, given to p, and c's
 * tail goes to new storage. Returns p, or NULL when out of memory (nothing changed).
 */
static kvt_radix_node_t *split(kvt_radix_t *t, kvt_radix_node_t *c, uint32_t k)
{
    kvt_assert(k > 0 && k < c->npages);
    kvt_radix_node_t *g = c->parent;
    uint32_t ps = c->page_size, rest = c->npages - k;
    int head_moves = k < rest;
    kvt_radix_node_t *p = node_new(t, c->ns, ps, head_moves ? k : 0);
    if (!p)
        return NULL;
    void *tail_store = NULL;
    p->kcap = 2; /* room for c and the leaf the insert adds next to it */
    p->keys = nd_alloc(t, 2 * KID_SLOT, 0);
    if (!head_moves)
        tail_store = nd_alloc(t, storage_bytes(rest, ps), 0);
    if (!p->keys || (!head_moves && !tail_store) || registry_add(t, p) != 0) {
        nd_free(t, tail_store);
        node_free(t, p);
        return NULL;
    }
    /* p takes c's place under g: same key, since p starts with c's old first page. */
    mig_take(t, g, page_key(c->tokens, ps));
    uint32_t i = kid_slot(g, page_key(c->tokens, ps));
    kvt_assert(i != UINT32_MAX && kids_ptrs(g)[i] == c);
    kids_ptrs(g)[i] = p;
    p->parent = g;
    p->depth = c->depth;
    p->leases = c->leases;

    if (head_moves) {
        memcpy(p->blocks, c->blocks, k * sizeof(kvt_block_t));
        memcpy(p->tokens, c->tokens, (size_t)k * ps * sizeof(uint32_t));
        node_set_store(c, node_store(c), c->cap, c->off + k);
    } else {
        void *old = node_store(c);
        uint32_t cap = c->cap, off = c->off;
        kvt_block_t *b = tail_store;
        memcpy(b, c->blocks + k, rest * sizeof(kvt_block_t));
        memcpy(b + rest, c->tokens + (size_t)k * ps, (size_t)rest * ps * sizeof(uint32_t));
        node_set_store(c, tail_store, rest, 0);
        node_set_store(p, old, cap, off);
    }
    p->npages = k;
    c->npages = rest;
    c->depth += k;
    /* Dead slots are at most half of a storage; compacting copies only the live ones. */
    if (p->cap > 2 * p->npages)
        node_set_cap(t, p, p->npages);
    if (c->cap > 2 * c->npages)
        node_set_cap(t, c, c->npages);
    p->keys[0] = page_key(c->tokens, ps);
    kids_ptrs(p)[0] = c;
    p->nkids = 1;
    c->parent = p;
    return p;
}

/* Adds pages [w->pos, npages) of tokens after the walk w. */
static int insert_after(kvt_radix_t *t, uint32_t ns, const uint32_t *tokens, uint32_t npages,
                        const walk_t *w, kvt_insert_t *res)
{
    uint32_t ps = t->ns[ns].page_size;
    mig_tick(t);
    memset(res, 0, sizeof(*res));
    res->pages = npages;
    if (w->pos == npages || w->collision) {
        res->node = w->node;
        res->first_page = w->pos;
        return w->collision ? KVT_EEXIST : 0;
    }

    /* The new pages hang under the last fully matched node, or under the head of a split. */
    uint32_t m = npages - w->pos;
    kvt_radix_node_t *leaf = node_new(t, ns, ps, m);
    if (!leaf || registry_add(t, leaf) != 0) {
        if (leaf)
            node_free(t, leaf);
        return KVT_ENOMEM;
    }
    kvt_radix_node_t *under = w->parent;
    if (walk_inside(w)) {
        under = split(t, w->node, w->k);
        if (!under) {
            registry_del(t, leaf);
            node_free(t, leaf);
            return KVT_ENOMEM;
        }
        res->split = under;
        t->epoch++;
    }
    if (kid_reserve(t, under) != 0) {
        /* The split (if any) stays: it is a valid tree, only with one more node. */
        registry_del(t, leaf);
        node_free(t, leaf);
        return KVT_ENOMEM;
    }

    copy_stream(leaf->tokens, tokens + (size_t)w->pos * ps, (size_t)m * ps * sizeof(uint32_t));
    /* Hashes stay 0 until asked for (kvt_radix_block_hash): an index-only insert hashes only the
     * first page, for its key. */
    kvt_block_t proto = {.last_access = t->clock, .freq = 1.0f};
    fill_blocks(leaf->blocks, m, &proto);
    leaf->npages = m;
    leaf->depth = w->pos;
    int was_leaf = under->nkids == 0;
    kid_add(under, leaf);
    if (was_leaf)
        list_update(t, under);
    list_update(t, leaf);
    t->blocks += m;
    t->ns[ns].blocks += m;
    t->cached_tokens += (uint64_t)m * ps;
    t->epoch++;

    res->node = leaf;
    res->first_page = w->pos;
    res->new_pages = m;
    return 0;
}

int kvt_radix_insert(kvt_radix_t *t, uint32_t ns, const uint32_t *tokens, size_t ntokens,
                     kvt_insert_t *res)
{
    if (!t || !res || !ns_live(t, ns) || (ntokens && !tokens) || ntokens > UINT32_MAX)
        return KVT_EINVAL;
    uint32_t npages = (uint32_t)(ntokens / t->ns[ns].page_size);
    walk_t w;
    walk(t, ns, tokens, npages, 0, &w);
    return insert_after(t, ns, tokens, npages, &w, res);
}

/* The bytes an insert of np pages can add besides a child array's growth: the new leaf and its
 * storage; a split's node, child array and the smaller half's copy (no more pages than the
 * request's); a compaction of the split's other half (as much again); the registry doubling
 * when it is full. */
static uint64_t insert_base(const kvt_radix_t *t, size_t np, uint32_t ps)
{
    uint64_t b =
        2 * sizeof(kvt_radix_node_t) + 2 * KID_SLOT + 3 * (uint64_t)storage_bytes((uint32_t)np, ps);
    if (t->nnodes + 2 > t->nodes_cap)
        b += (uint64_t)KVT_MAX(t->nodes_cap, (size_t)64) * sizeof(void *);
    return b;
}

uint64_t kvt_radix_insert_bound(const kvt_radix_t *t, uint32_t ns, size_t ntokens)
{
    if (!t || !ns_live(t, ns))
        return 0;
    uint32_t ps = t->ns[ns].page_size;
    uint64_t b = insert_base(t, KVT_MIN(ntokens / ps, (size_t)UINT32_MAX), ps);
    /* A child array's growth: at most its own size, or the array-to-table step's three times;
     * twice its size for a table that grows a step at a time (the old one stays for a while). */
    uint64_t kcap = KVT_MAX(t->max_kcap, 4u * KID_ARRAY_MAX);
    b += (kcap >= step_above(t) ? 2 : 1) * kcap * KID_SLOT;
    return rounded(b);
}

uint64_t kvt_radix_insert_need(kvt_radix_t *t, uint32_t ns, const uint32_t *tokens, size_t ntokens,
                               kvt_match_t *at)
{
    if (!t || !ns_live(t, ns) || (ntokens && !tokens) || ntokens > UINT32_MAX)
        return 0;
    uint32_t ps = t->ns[ns].page_size, npages = (uint32_t)(ntokens / ps);
    walk_t w;
    walk(t, ns, tokens, npages, 0, &w);
    if (at)
        *at = (kvt_match_t){
            .node = w.node, .node_pages = w.k, .pages = w.pos, .ns = ns, .epoch = t->epoch};
    if (w.pos == npages || w.collision)
        return 0; /* nothing to add */
    uint64_t b = insert_base(t, npages, ps);
    /* The one child array that may grow: the node the new leaf hangs under, unless a split
     * makes that node (with room for two). It grows by the new allocation less the old one,
     * or by all of it when the old one stays (a table that grows a step at a time). */
    const kvt_radix_node_t *n = w.parent;
    if (!walk_inside(&w) && !kid_room(n)) {
        int stays = n->kid_hash && n->kcap >= step_above(t);
        uint64_t slots = (uint64_t)kid_next_cap(n) - (stays ? 0 : n->kcap);
        b += slots * KID_SLOT;
    }
    return rounded(b);
}

int kvt_radix_insert_matched(kvt_radix_t *t, const kvt_match_t *m, const uint32_t *tokens,
                             size_t ntokens, kvt_insert_t *res)
{
    if (!t || !m || !res || !ns_live(t, m->ns) || (ntokens && !tokens) || ntokens > UINT32_MAX)
        return KVT_EINVAL;
    uint32_t ps = t->ns[m->ns].page_size;
    uint32_t npages = (uint32_t)(ntokens / ps);
    if (m->epoch != t->epoch || m->pages > npages)
        return kvt_radix_insert(t, m->ns, tokens, ntokens, res);
    walk_t w = {.parent = t->ns[m->ns].root, .node = m->node, .k = m->node_pages, .pos = m->pages};
    if (m->node) {
        /* A cheap guard against a caller passing other tokens: the last matched page. */
        const uint32_t *last = m->node->tokens + (size_t)(m->node_pages - 1) * ps;
        if (memcmp(last, tokens + (size_t)(m->pages - 1) * ps, ps * sizeof(uint32_t)) != 0)
            return kvt_radix_insert(t, m->ns, tokens, ntokens, res);
        w.parent = m->node_pages == m->node->npages ? m->node : m->node->parent;
    }
    /* The match stopped at a missing child or a collision; tell which for an exact result. */
    if (w.pos < npages && w.k == (m->node ? m->node->npages : 0)) {
        const uint32_t *pg = tokens + (size_t)w.pos * ps;
        kvt_radix_node_t *c = kid_find(t, w.parent, page_key(pg, ps));
        w.collision = c != NULL;
        if (c && memcmp(c->tokens, pg, (size_t)ps * sizeof(uint32_t)) == 0)
            return kvt_radix_insert(t, m->ns, tokens, ntokens, res); /* not what was matched */
    }
    return insert_after(t, m->ns, tokens, npages, &w, res);
}

uint64_t kvt_radix_split_need(const kvt_radix_t *t, kvt_radix_node_t *n, uint32_t depth)
{
    if (!t || !n)
        return 0;
    const kvt_radix_node_t *c = kvt_radix_node_holding(n, depth);
    if (!c || depth == c->depth)
        return 0;
    /* The new node and its child array; the smaller half's copy and the compaction of the
     * other (each at most the node's pages); the registry doubling when it is full. */
    uint64_t b = sizeof(kvt_radix_node_t) + 2 * KID_SLOT +
                 2 * (uint64_t)storage_bytes(c->npages, c->page_size);
    if (t->nnodes + 1 > t->nodes_cap)
        b += (uint64_t)KVT_MAX(t->nodes_cap, (size_t)64) * sizeof(void *);
    return rounded(b);
}

int kvt_radix_split_at(kvt_radix_t *t, kvt_radix_node_t *n, uint32_t depth)
{
    if (!t || !n)
        return KVT_EINVAL;
    kvt_radix_node_t *c = kvt_radix_node_holding(n, depth);
    if (!c)
        return KVT_EINVAL; /* not on n's path */
    if (depth == c->depth)
        return 0; /* a node begins there already */
    mig_tick(t);
    if (!split(t, c, depth - c->depth))
        return KVT_ENOMEM;
    t->epoch++;
    return 0;
}

/* ---- removal and eviction ------------------------------------------------------------------- */

static void free_blocks(kvt_radix_t *t, kvt_radix_node_t *n, uint32_t from, uint32_t to,
                        kvt_radix_why_t why)
{
    for (uint32_t i = to; i > from; i--) /* deepest first */
        if (t->conf.free_cb)
            t->conf.free_cb(t->conf.free_arg, n->ns, &n->blocks[i - 1], why);
    t->blocks -= to - from;
    t->ns[n->ns].blocks -= to - from;
    t->cached_tokens -= (uint64_t)(to - from) * n->page_size;
}

/* Frees n and everything below it, calling the free callbacks for each block and node with why.
 * Iterative: a long conversation makes deep chains. */
static void subtree_free(kvt_radix_t *t, kvt_radix_node_t *n, kvt_radix_why_t why)
{
    kvt_radix_node_t *cur = n;
    while (cur) {
        if (cur->nkids > 0) { /* descend into the last child first */
            kid_densify(t, cur);
            cur = kids_ptrs(cur)[cur->nkids - 1];
            continue;
        }
        kvt_radix_node_t *up = cur == n ? NULL : cur->parent;
        free_blocks(t, cur, 0, cur->npages, why);
        if (up)
            up->nkids--; /* it was the last child: its slot goes with it */
        if (cur->in_list) {
            cur->lprev->lnext = cur->lnext;
            cur->lnext->lprev = cur->lprev;
            t->nlist--;
        }
        if (!is_root(cur)) {
            registry_del(t, cur);
            if (t->conf.node_free_cb)
                t->conf.node_free_cb(t->conf.free_arg, cur, why);
        }
        node_free(t, cur);
        cur = up;
    }
}

/* Whether anything in n's subtree (n included when whole) is leased or busy. */
static int subtree_busy(const kvt_radix_t *t, kvt_radix_node_t *n, uint32_t from)
{
    if (n->leases > 0)
        return 1;
    for (uint32_t i = from; i < n->npages; i++)
        if (n->blocks[i].flags & KVT_BLOCK_BUSY)
            return 1;
    kvt_radix_node_t **kids = kids_ptrs(n);
    for (uint32_t i = 0; i < kid_slots(n); i++)
        if (kids[i] && subtree_busy(t, kids[i], 0))
            return 1;
    kids = n == t->mig ? mig_ptrs(t) : NULL; /* the children not yet moved */
    for (uint32_t i = 0; kids && i < t->mig_cap; i++)
        if (kids[i] && kids[i] != KID_MOVED && subtree_busy(t, kids[i], 0))
            return 1;
    return 0;
}

/* Drops the blocks of childless node n from index `keep` on; with keep 0 the node itself goes
 * (n is then dangling) and its parent may become evictable. */
static void drop_tail(kvt_radix_t *t, kvt_radix_node_t *n, uint32_t keep, kvt_radix_why_t why)
{
    kvt_assert(n->nkids == 0 && keep < n->npages);
    if (keep > 0) {
        free_blocks(t, n, keep, n->npages, why);
        n->npages = keep;
        if (n->cap > 2 * n->npages)
            node_set_cap(t, n, n->npages);
        list_update(t, n);
        return;
    }
    kvt_radix_node_t *parent = n->parent;
    kid_del(t, parent, page_key(n->tokens, n->page_size));
    subtree_free(t, n, why);
    list_update(t, parent);
}

int kvt_radix_remove(kvt_radix_t *t, uint32_t ns, const uint32_t *tokens, size_t ntokens)
{
    if (!t || !ns_live(t, ns) || (ntokens && !tokens) || ntokens > UINT32_MAX)
        return KVT_EINVAL;
    uint32_t npages = (uint32_t)(ntokens / t->ns[ns].page_size);
    if (npages == 0)
        return KVT_EINVAL;
    mig_tick(t);
    walk_t w;
    walk(t, ns, tokens, npages, 0, &w);
    if (w.pos < npages)
        return KVT_ENOENT;
    kvt_radix_node_t *n = w.node;
    uint32_t from = w.k - 1; /* index in n of the block to remove */
    if (subtree_busy(t, n, from))
        return KVT_EBUSY;
    t->epoch++;

    /* Children first, then the node's tail or the whole node. */
    kid_densify(t, n);
    while (n->nkids > 0) {
        kvt_radix_node_t *c = kids_ptrs(n)[n->nkids - 1];
        subtree_free(t, c, KVT_RADIX_REMOVE);
        if (--n->nkids == 0)
            kid_free_all(t, n);
    }
    drop_tail(t, n, from, KVT_RADIX_REMOVE);
    return 0;
}

int kvt_radix_ns_clear(kvt_radix_t *t, uint32_t ns)
{
    if (!t || !ns_live(t, ns))
        return KVT_EINVAL;
    kvt_radix_node_t *root = t->ns[ns].root;
    if (subtree_busy(t, root, 0))
        return KVT_EBUSY;
    mig_tick(t);
    t->epoch++;
    kid_densify(t, root);
    while (root->nkids > 0) {
        kvt_radix_node_t *c = kids_ptrs(root)[root->nkids - 1];
        subtree_free(t, c, KVT_RADIX_EVICT);
        if (--root->nkids == 0)
            kid_free_all(t, root);
    }
    return 0;
}

uint64_t kvt_radix_ns_blocks(const kvt_radix_t *t, uint32_t ns)
{
    return t && ns_live(t, ns) ? t->ns[ns].blocks : 0;
}

int kvt_radix_evict(kvt_radix_t *t, kvt_radix_node_t *n, uint32_t npages)
{
    if (!t || !n || is_root(n) || npages == 0 || npages > n->npages)
        return KVT_EINVAL;
    if (n->nkids > 0 || n->leases > 0)
        return KVT_EBUSY;
    for (uint32_t i = n->npages - npages; i < n->npages; i++)
        if (n->blocks[i].flags & KVT_BLOCK_BUSY)
            return KVT_EBUSY;
    t->epoch++;
    mig_tick(t);
    drop_tail(t, n, n->npages - npages, KVT_RADIX_EVICT);
    return 0;
}

kvt_radix_node_t *kvt_radix_evictable_first(kvt_radix_t *t)
{
    if (!t || t->list.lnext == &t->list)
        return NULL;
    return t->list.lnext;
}

kvt_radix_node_t *kvt_radix_evictable_next(kvt_radix_t *t, kvt_radix_node_t *n)
{
    if (!t || !n || !n->in_list || n->lnext == &t->list)
        return NULL;
    return n->lnext;
}

size_t kvt_radix_evictable_count(const kvt_radix_t *t)
{
    return t ? t->nlist : 0;
}

#define TRIM_SAMPLES 16
#define TRIM_DRAWS   8

/* The sampled victim of kvt_radix_trim, or NULL. */
static kvt_radix_node_t *trim_victim(kvt_radix_t *t, kvt_block_pred_t evictable, void *arg)
{
    kvt_radix_node_t *best = NULL;
    uint32_t best_age = 0;
    for (int i = 0; i < TRIM_SAMPLES && t->nnodes > 0; i++) {
        t->rng ^= t->rng << 13, t->rng ^= t->rng >> 7, t->rng ^= t->rng << 17;
        kvt_radix_node_t *n = t->nodes[t->rng % t->nnodes];
        if (!n->in_list || n->npages == 0) /* evictable: an unleased leaf */
            continue;
        const kvt_block_t *last = &n->blocks[n->npages - 1];
        uint32_t age = t->clock - last->last_access;
        if ((!best || age > best_age) && evictable(arg, last)) {
            best = n;
            best_age = age;
        }
    }
    return best;
}

int kvt_radix_index_only(void *arg, const kvt_block_t *b)
{
    (void)arg;
    return b->tier == KVT_TIER_NONE && !(b->flags & KVT_BLOCK_BUSY);
}

uint32_t kvt_radix_trim(kvt_radix_t *t, uint64_t target, uint32_t budget,
                        kvt_block_pred_t evictable, kvt_trim_drop_t drop, void *arg)
{
    uint32_t done = 0;
    if (!t || !evictable || !drop)
        return 0;
    for (int misses = 0; done < budget && t->bytes > target && misses < TRIM_DRAWS;) {
        kvt_radix_node_t *n = trim_victim(t, evictable, arg);
        if (!n) {
            misses++;
            continue;
        }
        misses = 0;
        uint32_t k = 0;
        while (k < n->npages && k < budget - done && evictable(arg, &n->blocks[n->npages - 1 - k]))
            k++;
        (void)kvt_radix_block_hash(t, n, n->depth + n->npages - 1); /* and all above it */
        int rc = drop(arg, n, k);
        if (rc <= 0)
            break;
        done += (uint32_t)rc;
    }
    return done;
}

/* ---- leases --------------------------------------------------------------------------------- */

/* Takes (delta 1) or ends (-1) lease number seq on n and every ancestor. A lease numbered below
 * a node's mark was counted in its early leases when the mark was made, and only ends; one taken
 * later is numbered at or past every mark. */
static void pin(kvt_radix_t *t, kvt_radix_node_t *n, int delta, uint64_t seq)
{
    for (; n && !is_root(n); n = n->parent) {
        kvt_assert(delta > 0 || n->leases > 0);
        n->leases += (uint32_t)delta;
        if (seq < n->mark) {
            kvt_assert(delta < 0 && n->early > 0);
            n->early--;
        }
        list_update(t, n);
    }
}

static uint32_t lease_next_cap(const kvt_radix_t *t)
{
    return t->lease_cap ? t->lease_cap * 2 : 64;
}

int kvt_radix_lease_reserve(kvt_radix_t *t)
{
    if (!t)
        return KVT_EINVAL;
    if (t->lease_free != NO_SLOT)
        return 0;
    uint32_t cap = lease_next_cap(t);
    kvt_lease_t *v = rx_realloc(t, t->leases, cap * sizeof(*v));
    if (!v)
        return KVT_ENOMEM;
    for (uint32_t i = t->lease_cap; i < cap; i++) {
        v[i].owner = 0;
        v[i].node = NULL;
        v[i].gen = 1;
        v[i].next_free = i + 1 < cap ? i + 1 : NO_SLOT;
    }
    t->leases = v;
    t->lease_free = t->lease_cap;
    t->lease_cap = cap;
    return 0;
}

int kvt_radix_lease(kvt_radix_t *t, const kvt_match_t *m, uint64_t owner, uint64_t *lease_out)
{
    if (!t || !m || !lease_out || owner == 0)
        return KVT_EINVAL;
    if (!m->node || m->pages == 0)
        return KVT_ENOENT;
    int rc = kvt_radix_lease_reserve(t);
    if (rc < 0)
        return rc;
    uint32_t slot = t->lease_free;
    kvt_lease_t *l = &t->leases[slot];
    t->lease_free = l->next_free;
    l->owner = owner;
    l->seq = t->lease_seq++;
    l->node = m->node;
    t->nleases++;
    pin(t, m->node, 1, l->seq);
    *lease_out = (uint64_t)l->gen << 32 | slot;
    return 0;
}

uint64_t kvt_radix_lease_need(const kvt_radix_t *t)
{
    if (!t || t->lease_free != NO_SLOT)
        return 0;
    return rounded((uint64_t)lease_next_cap(t) * sizeof(kvt_lease_t));
}

static void lease_drop(kvt_radix_t *t, uint32_t slot)
{
    kvt_lease_t *l = &t->leases[slot];
    pin(t, l->node, -1, l->seq);
    l->owner = 0;
    l->node = NULL;
    l->gen = l->gen == UINT32_MAX ? 1 : l->gen + 1;
    l->next_free = t->lease_free;
    t->lease_free = slot;
    t->nleases--;
    t->releases++;
}

int kvt_radix_release(kvt_radix_t *t, uint64_t lease)
{
    if (!t)
        return KVT_EINVAL;
    uint32_t slot = kvt_radix_lease_slot(lease), gen = (uint32_t)(lease >> 32);
    if (slot >= t->lease_cap || t->leases[slot].owner == 0 || t->leases[slot].gen != gen)
        return KVT_ENOENT;
    lease_drop(t, slot);
    return 0;
}

size_t kvt_radix_release_owner(kvt_radix_t *t, uint64_t owner)
{
    if (!t || owner == 0)
        return 0;
    size_t n = 0;
    for (uint32_t i = 0; i < t->lease_cap; i++) {
        if (t->leases[i].owner == owner) {
            lease_drop(t, i);
            n++;
        }
    }
    return n;
}

size_t kvt_radix_lease_count(const kvt_radix_t *t)
{
    return t ? t->nleases : 0;
}

uint64_t kvt_radix_lease_releases(const kvt_radix_t *t)
{
    return t ? t->releases : 0;
}

uint64_t kvt_radix_lease_seq(const kvt_radix_t *t)
{
    return t ? t->lease_seq : 0;
}

uint64_t kvt_radix_node_mark(kvt_radix_t *t, kvt_radix_node_t *n)
{
    if (!t)
        return 0;
    if (n && !is_root(n)) {
        n->mark = t->lease_seq;
        n->early = n->leases; /* every lease held now is numbered below lease_seq */
    }
    return t->lease_seq;
}

int kvt_radix_node_leased_before(const kvt_radix_t *t, const kvt_radix_node_t *n, uint64_t seq)
{
    if (!t || !n || n->leases == 0)
        return 0;
    if (seq == n->mark)
        return n->early > 0;
    for (uint32_t i = 0; i < t->lease_cap; i++) {
        const kvt_lease_t *l = &t->leases[i];
        if (l->owner == 0 || l->seq >= seq)
            continue;
        /* A lease runs through its deepest node and every ancestor (pin). */
        for (const kvt_radix_node_t *x = l->node; x && !is_root(x); x = x->parent)
            if (x == n)
                return 1;
    }
    return 0;
}

/* ---- node accessors and paths --------------------------------------------------------------- */

uint32_t kvt_radix_node_pages(const kvt_radix_node_t *n)
{
    return n ? n->npages : 0;
}

uint32_t kvt_radix_node_depth(const kvt_radix_node_t *n)
{
    return n ? n->depth : 0;
}

uint32_t kvt_radix_node_ns(const kvt_radix_node_t *n)
{
    return n ? n->ns : 0;
}

kvt_radix_node_t *kvt_radix_node_parent(const kvt_radix_node_t *n)
{
    if (!n || !n->parent || is_root(n->parent))
        return NULL;
    return n->parent;
}

uint32_t kvt_radix_node_children(const kvt_radix_node_t *n)
{
    return n ? n->nkids : 0;
}

int kvt_radix_node_leased(const kvt_radix_node_t *n)
{
    return n && n->leases > 0;
}

uint32_t kvt_radix_node_leases(const kvt_radix_node_t *n)
{
    return n ? n->leases : 0;
}

kvt_block_t *kvt_radix_node_blocks(kvt_radix_node_t *n)
{
    return n ? n->blocks : NULL;
}

const uint32_t *kvt_radix_node_tokens(const kvt_radix_node_t *n, uint32_t i)
{
    if (!n || i >= n->npages)
        return NULL;
    return n->tokens + (size_t)i * n->page_size;
}

kvt_radix_node_t *kvt_radix_node_holding(kvt_radix_node_t *n, uint32_t depth)
{
    if (!n || is_root(n) || depth >= n->depth + n->npages)
        return NULL;
    while (n->depth > depth)
        n = n->parent;
    return n;
}

kvt_block_t *kvt_radix_block_at(kvt_radix_node_t *n, uint32_t depth)
{
    n = kvt_radix_node_holding(n, depth);
    return n ? &n->blocks[depth - n->depth] : NULL;
}

static void path_run_set(kvt_path_run_t *r, kvt_radix_node_t *n, uint32_t pages)
{
    if (!n || is_root(n) || pages == 0) {
        memset(r, 0, sizeof(*r));
        return;
    }
    r->node = n;
    r->blocks = n->blocks;
    r->depth = n->depth;
    r->n = KVT_MIN(pages, n->npages);
}

kvt_path_run_t kvt_path_run_first(kvt_radix_node_t *node, uint32_t node_pages)
{
    kvt_path_run_t r;
    path_run_set(&r, node, node_pages);
    return r;
}

void kvt_path_run_next(kvt_path_run_t *r)
{
    kvt_radix_node_t *up = r->node ? r->node->parent : NULL;
    path_run_set(r, up, up ? up->npages : 0);
}

/* Hashes blocks [from, to) of x, after a block whose hash is h; returns the last one's. */
static uint64_t hash_blocks(kvt_radix_node_t *x, uint32_t from, uint32_t to, uint64_t h)
{
    for (uint32_t i = from; i < to; i++) {
        kvt_block_t *b = &x->blocks[i];
        if (b->hash == 0)
            b->hash = page_hash(x->tokens + (size_t)i * x->page_size, x->page_size, h);
        h = b->hash;
    }
    return h;
}

/* The first of x's first `end` blocks after its last hashed one (computed hashes form a prefix
 * of the path, so the ones before it are all hashed), stepping back over the unhashed ones. */
static uint32_t first_unhashed(const kvt_radix_node_t *x, uint32_t end)
{
    while (end > 0 && x->blocks[end - 1].hash == 0)
        end--;
    return end;
}

uint64_t kvt_radix_block_hash(kvt_radix_t *t, kvt_radix_node_t *n, uint32_t depth)
{
    kvt_block_t *target = kvt_radix_block_at(n, depth);
    if (!t || !target)
        return 0;
    if (target->hash)
        return target->hash;
    /*
     * Computed hashes form a prefix of the path: the work starts after the last one. Inside the
     * target's node that is a step back over its unhashed blocks (asking for a node's blocks one
     * by one, in order, then costs O(1) each, not a walk from the node's start). When the node
     * has none hashed, climb once to the topmost node with an unhashed last block; `above` is
     * the node over it (hashed to its end) or the root. Then hash downwards to the target, each
     * node from its first unhashed block. Going down needs the path's nodes in order: they are
     * gathered 64 at a time, the 64 just below `above`, so the whole costs
     * O(unhashed pages + levels^2 / 64) instead of a climb per page.
     */
    kvt_radix_node_t *holder = n;
    while (holder->depth > depth)
        holder = holder->parent;
    uint32_t end = depth - holder->depth + 1, start = first_unhashed(holder, end - 1);
    if (start > 0)
        return hash_blocks(holder, start, end, holder->blocks[start - 1].hash);
    kvt_radix_node_t *above = holder->parent;
    while (!is_root(above) && above->blocks[above->npages - 1].hash == 0)
        above = above->parent;
    uint64_t h = is_root(above) ? t->ns[holder->ns].seed : above->blocks[above->npages - 1].hash;
    for (;;) {
        kvt_radix_node_t *ring[64];
        uint32_t nr = 0;
        for (kvt_radix_node_t *x = holder; x != above; x = x->parent)
            ring[nr++ % 64] = x;
        uint32_t take = KVT_MIN(nr, 64u);
        for (uint32_t j = 0; j < take; j++) {
            kvt_radix_node_t *x = ring[(nr - 1 - j) % 64];
            uint32_t to = x == holder ? end : x->npages, from = first_unhashed(x, to);
            h = hash_blocks(x, from, to, from > 0 ? x->blocks[from - 1].hash : h);
            above = x;
        }
        if (above == holder)
            return h;
    }
}

void kvt_path_iter_init(kvt_path_iter_t *it, kvt_radix_node_t *node, uint32_t node_pages)
{
    memset(it, 0, sizeof(*it));
    if (!node || is_root(node) || node_pages == 0)
        return;
    it->deep = node;
    it->end = node->depth + KVT_MIN(node_pages, node->npages);
    uint32_t levels = 0;
    for (kvt_radix_node_t *n = node; !is_root(n); n = n->parent)
        levels++;
    if (levels <= KVT_ARRAY_LEN(it->path)) {
        uint32_t i = levels;
        for (kvt_radix_node_t *n = node; !is_root(n); n = n->parent)
            it->path[--i] = n;
        it->nlevels = levels;
    }
}

kvt_block_t *kvt_path_iter_next(kvt_path_iter_t *it, kvt_radix_node_t **node_out)
{
    if (it->depth >= it->end)
        return NULL;
    kvt_radix_node_t *n;
    if (it->nlevels) {
        n = it->path[it->level];
        if (it->depth >= n->depth + n->npages)
            n = it->path[++it->level];
    } else {
        for (n = it->deep; n->depth > it->depth;) /* a path deeper than path[]: walk up */
            n = n->parent;
    }
    if (node_out)
        *node_out = n;
    return &n->blocks[it->depth++ - n->depth];
}

size_t kvt_radix_node_count(const kvt_radix_t *t)
{
    return t ? t->nnodes : 0;
}

kvt_radix_node_t *kvt_radix_node_at(const kvt_radix_t *t, size_t i)
{
    return t && i < t->nnodes ? t->nodes[i] : NULL;
}

kvt_radix_node_t *const *kvt_radix_nodes(const kvt_radix_t *t)
{
    return t ? t->nodes : NULL;
}

void kvt_radix_stats(const kvt_radix_t *t, kvt_radix_stats_t *st)
{
    if (!st)
        return;
    memset(st, 0, sizeof(*st));
    if (!t)
        return;
    st->bytes = t->bytes;
    st->nodes = t->nnodes;
    st->blocks = t->blocks;
    st->cached_tokens = t->cached_tokens;
    st->leases = t->nleases;
    st->namespaces = t->ns_open;
    st->arena_bytes = t->ar_mapped;
    st->arena_free_bytes = t->ar_mapped - t->ar_live;
}

/* ---- verification --------------------------------------------------------------------------- */

#define VFAIL(...)                                                                                 \
    do {                                                                                           \
        kvt_log(KVT_LOG_ERROR, "radix verify: " __VA_ARGS__);                                      \
        rc = KVT_ECORRUPT;                                                                         \
        goto out;                                                                                  \
    } while (0)

static size_t usable(const void *p)
{
    return p ? malloc_usable_size((void *)p) : 0;
}

/* The bytes of p's slot when the arena made it, 0 when malloc did. */
static size_t arena_slot(const void *p)
{
    return p && *slot_hdr(p) != ARENA_MALLOC ? slot_bytes(p) : 0;
}

/* Every mapped byte of the arena is a live slot, a free one, bump room or waste; live is what
 * the tree walk found in its nodes. A free slot is listed under its own class. */
static int arena_verify(const kvt_radix_t *t, size_t live)
{
    size_t free_bytes = 0;
    for (uint32_t c = 0; c < ARENA_CLASSES; c++) /* each size's class is the tightest */
        if (class_of(class_size(c)) != c || class_size(c) % 16 ||
            class_of(class_size(c) + 1) != c + 1) {
            kvt_log(KVT_LOG_ERROR, "radix verify: size class %u (%zu bytes) is wrong", c,
                    class_size(c));
            return KVT_ECORRUPT;
        }
    for (uint32_t c = 0; c < ARENA_CLASSES; c++)
        for (void **link = t->ar_free[c], **next; link; link = next) {
            ARENA_UNPOISON((uint8_t *)link - ARENA_HDR, ARENA_HDR + sizeof(void *));
            uint64_t h = *slot_hdr(link);
            next = *link;
            ARENA_POISON((uint8_t *)link - ARENA_HDR, ARENA_HDR + sizeof(void *));
            if (h != c) {
                kvt_log(KVT_LOG_ERROR, "radix verify: a free slot of class %u on list %u",
                        (unsigned)h, c);
                return KVT_ECORRUPT;
            }
            free_bytes += class_size(c);
        }
    size_t bump = (size_t)(t->ar_end - t->ar_cur);
    if (live != t->ar_live || live + free_bytes + bump + t->ar_waste != t->ar_mapped) {
        kvt_log(KVT_LOG_ERROR,
                "radix verify: arena maps %zu bytes: %zu in nodes (counted %zu), %zu free, "
                "%zu bump, %zu waste",
                t->ar_mapped, live, t->ar_live, free_bytes, bump, t->ar_waste);
        return KVT_ECORRUPT;
    }
    return 0;
}

int kvt_radix_verify(const kvt_radix_t *t)
{
    if (!t)
        return KVT_EINVAL;
    int rc = 0;
    /* By node: its leases, then those numbered below its mark. */
    uint32_t *expect_leases = calloc(2 * (t->nnodes + 1), sizeof(uint32_t));
    uint32_t *expect_early = expect_leases ? expect_leases + t->nnodes + 1 : NULL;
    kvt_radix_node_t **stack = malloc((t->nnodes + t->nns + 1) * sizeof(*stack));
    if (!expect_leases || !stack) {
        free(expect_leases);
        free(stack);
        return KVT_ENOMEM;
    }
    uint64_t bytes = usable(t) + usable(t->ns) + usable(t->ns_slots) + usable(t->leases) +
                     slot_bytes(t->mig_keys) + slot_bytes(t->old_tab) +
                     (registry_mapped(t) ? t->nodes_cap * sizeof(void *) : usable(t->nodes));
    if (t->mig && (!t->mig->kid_hash || t->mig_pos >= t->mig_cap || t->mig->kcap == t->mig_cap ||
                   2 * t->mig->nkids > t->mig->kcap))
        VFAIL("a table move in a bad state: old %u slots, at %u, new %u", t->mig_cap, t->mig_pos,
              t->mig->kcap);
    uint64_t blocks = 0, tokens = 0, seen_nodes = 0, want_list = 0;
    size_t arena_live = arena_slot(t->mig_keys) + arena_slot(t->old_tab);

    for (uint32_t i = 0; i < t->lease_cap; i++) {
        const kvt_lease_t *l = &t->leases[i];
        if (l->owner == 0)
            continue;
        for (kvt_radix_node_t *n = l->node; !is_root(n); n = n->parent) {
            if (n->idx >= t->nnodes || t->nodes[n->idx] != n)
                VFAIL("lease %u pins a node that is not in the tree", i);
            expect_leases[n->idx]++;
            expect_early[n->idx] += l->seq < n->mark;
        }
    }

    uint32_t closed = 0, open = 0;
    for (uint32_t s = t->ns_free; s != NO_SLOT && closed <= t->nns; s = t->ns[s].next_free) {
        if (s >= t->nns || t->ns[s].root)
            VFAIL("namespace %u is on the closed list but not closed", s);
        closed++;
    }
    for (uint32_t s = 0; s < t->nns; s++) {
        const kvt_ns_t *ns = &t->ns[s];
        if (!ns->root)
            continue;
        open++;
        if (ns_find(t, ns->seed) != s + 1)
            VFAIL("namespace %u is not found by its seed", s);
        bytes += usable(ns->desc);
        uint64_t ns_blocks = blocks; /* the namespace's pages are what this walk adds */
        size_t sp = 0;
        stack[sp++] = ns->root;
        while (sp > 0) {
            kvt_radix_node_t *n = stack[--sp];
            bytes += slot_bytes(n) + slot_bytes(node_store(n)) + slot_bytes(n->keys);
            arena_live += arena_slot(n) + arena_slot(node_store(n)) + arena_slot(n->keys);
            if (n->ns != s || n->page_size != ns->page_size)
                VFAIL("node in namespace %u has ns %u page size %u", s, n->ns, n->page_size);
            if (is_root(n)) {
                if (n != ns->root || n->npages != 0 || n->leases != 0)
                    VFAIL("namespace %u: bad root", s);
            } else {
                seen_nodes++;
                if (n->idx >= t->nnodes || t->nodes[n->idx] != n)
                    VFAIL("node not in the registry");
                if (n->npages == 0 || n->off + n->npages > n->cap)
                    VFAIL("node with %u pages at slot %u, capacity %u", n->npages, n->off, n->cap);
                if (n->tokens != (uint32_t *)((kvt_block_t *)node_store(n) + n->cap) +
                                     (size_t)n->off * n->page_size)
                    VFAIL("node's tokens are not at its slot %u", n->off);
                const kvt_radix_node_t *p = n->parent;
                if (n->depth != p->depth + p->npages)
                    VFAIL("node depth %u after parent %u+%u", n->depth, p->depth, p->npages);
                if (n->leases != expect_leases[n->idx])
                    VFAIL("node has %u leases, %u expected", n->leases, expect_leases[n->idx]);
                if (n->early != expect_early[n->idx])
                    VFAIL("node counts %u leases before its mark, %u run through it", n->early,
                          expect_early[n->idx]);
                /* Computed hashes: a prefix of the path, each the chain of the one before. */
                uint64_t h = is_root(p) ? ns->seed : p->blocks[p->npages - 1].hash;
                for (uint32_t i = 0; i < n->npages; i++) {
                    uint64_t got = n->blocks[i].hash;
                    if (h == 0 && got != 0)
                        VFAIL("block at depth %u hashed after an unhashed one", n->depth + i);
                    if (h != 0 && got != 0 &&
                        got != page_hash(n->tokens + (size_t)i * n->page_size, n->page_size, h))
                        VFAIL("block at depth %u: hash chain broken", n->depth + i);
                    h = got;
                }
                blocks += n->npages;
                tokens += (uint64_t)n->npages * n->page_size;
                int want = n->nkids == 0 && n->leases == 0;
                if (want != n->in_list)
                    VFAIL("node evictable=%d but in_list=%d", want, n->in_list);
                want_list += (uint64_t)want;
            }
            if (n->kid_hash ? 2 * n->nkids > n->kcap || n->kcap <= KID_ARRAY_MAX
                            : n->nkids > n->kcap)
                VFAIL("%u children, capacity %u (%s)", n->nkids, n->kcap,
                      n->kid_hash ? "table" : "array");
            kvt_radix_node_t **kids = kids_ptrs(n);
            uint32_t found = 0;
            for (uint32_t i = 0; i < kid_slots(n); i++) {
                if (!kids[i]) {
                    if (!n->kid_hash)
                        VFAIL("an empty slot among the children");
                    continue;
                }
                found++;
                if (kids[i]->parent != n)
                    VFAIL("child's parent link is wrong");
                if (n->keys[i] != page_key(kids[i]->tokens, kids[i]->page_size))
                    VFAIL("child key is not its first page's key");
                if (n->kid_hash ? kid_slot(n, n->keys[i]) != i
                                : i > 0 && n->keys[i - 1] >= n->keys[i])
                    VFAIL("a child is not where a lookup of its key goes");
                stack[sp++] = kids[i];
            }
            /* A table growing a step at a time: the entries its old table still holds. */
            kids = n == t->mig ? mig_ptrs(t) : NULL;
            for (uint32_t i = 0; kids && i < t->mig_cap; i++) {
                if (!kids[i] || kids[i] == KID_MOVED)
                    continue;
                found++;
                if (i < t->mig_pos)
                    VFAIL("an old table's entry behind the move's position");
                if (kids[i]->parent != n ||
                    t->mig_keys[i] != page_key(kids[i]->tokens, kids[i]->page_size))
                    VFAIL("an old table's entry has the wrong parent or key");
                if (kid_slot(n, t->mig_keys[i]) != UINT32_MAX || mig_slot(t, t->mig_keys[i]) != i)
                    VFAIL("an old table's entry is not where a lookup of its key goes");
                stack[sp++] = kids[i];
            }
            if (found != n->nkids)
                VFAIL("%u children in the slots, %u counted", found, n->nkids);
        }
        if (blocks - ns_blocks != ns->blocks)
            VFAIL("namespace %u: %llu pages found, %llu counted", s,
                  (unsigned long long)(blocks - ns_blocks), (unsigned long long)ns->blocks);
    }
    if (open != t->ns_open || open + closed != t->nns)
        VFAIL("%u namespaces open and %u closed of %u ids; the tree says %u open", open, closed,
              t->nns, t->ns_open);
    if (seen_nodes != t->nnodes)
        VFAIL("%llu nodes reachable, %zu registered", (unsigned long long)seen_nodes, t->nnodes);
    if (blocks != t->blocks || tokens != t->cached_tokens)
        VFAIL("counted %llu blocks, %llu tokens; tree says %llu, %llu", (unsigned long long)blocks,
              (unsigned long long)tokens, (unsigned long long)t->blocks,
              (unsigned long long)t->cached_tokens);
    if (want_list != t->nlist)
        VFAIL("%llu evictable nodes, list has %zu", (unsigned long long)want_list, t->nlist);
    size_t listed = 0;
    for (const kvt_radix_node_t *n = t->list.lnext; n != &t->list; n = n->lnext)
        if (++listed > t->nlist)
            VFAIL("evictable list longer than its count");
    if (listed != t->nlist)
        VFAIL("evictable list has %zu nodes, count %zu", listed, t->nlist);
    if (bytes != t->bytes)
        VFAIL("allocated %llu bytes, tree counts %llu", (unsigned long long)bytes,
              (unsigned long long)t->bytes);
    rc = arena_verify(t, arena_live);
out:
    free(expect_leases);
    free(stack);
    return rc;
}

/* ---- ghosts ---------------------------------------------------------------------------------- */

struct kvt_ghosts {
    uint64_t mask;
    uint64_t slot[];
};

int kvt_ghosts_create(kvt_ghosts_t **out, unsigned bits)
{
    if (!out || bits < 1 || bits > 30)
        return KVT_EINVAL;
    kvt_ghosts_t *g = calloc(1, sizeof *g + ((size_t)1 << bits) * sizeof(uint64_t));
    if (!g)
        return KVT_ENOMEM;
    g->mask = ((uint64_t)1 << bits) - 1;
    *out = g;
    return 0;
}

void kvt_ghosts_destroy(kvt_ghosts_t *g)
{
    free(g);
}

void kvt_ghosts_add(kvt_ghosts_t *g, uint64_t hash)
{
    if (hash)
        g->slot[hash & g->mask] = hash;
}

int kvt_ghosts_seen(const kvt_ghosts_t *g, uint64_t hash)
{
    return hash && g->slot[hash & g->mask] == hash;
}

void kvt_ghosts_prefetch(const kvt_ghosts_t *g, uint64_t hash)
{
    __builtin_prefetch(&g->slot[hash & g->mask], 0, 1);
}
