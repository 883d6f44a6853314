/*
 * store.h: the door to the store. The operation files (op_*.c), the connections, leases,
 * namespaces and metrics reach the tree (radix/) and the tiers (tiers/) only through these calls;
 * only the door's files call radix.h or tier.h themselves:
 *
 *     index.c   the path cursor, namespaces, leases; the index budget (index-bytes)
 *     exec.c    the policy's executor: moves, frees, drops (cause and request as arguments)
 *     tierio.c  a request's tier I/O: block keys, pins, reads and writes, tier locations
 *     store.c   the tiers' creation, recovery and gauges
 *     loop.c    the tree's and the tiers' lifecycle on the loop (create, fds, destroy)
 *
 * scripts/server_calls.py fails when another file of server/ calls a function radix.h or tier.h
 * declares (docs/architecture.md, "The door to the store"). Types (kvt_block_t, kvt_match_t,
 * kvt_tier_id_t) are shared: a block record is read in place, never copied out.
 *
 * Included by server.h, after the types it names.
 */
#ifndef KVT_SERVER_STORE_H
#define KVT_SERVER_STORE_H

/*
 * A path cursor, allocated by the caller on its stack (as rax's raxIterator): a seek finds the
 * longest stored prefix of a token run, then the walk visits its pages node by node, from the
 * deepest node up, each step one node's blocks on the path as the array they are:
 *
 *     kvt__path_t p;
 *     if (kvt__path_seek(s, &p, ns, tokens, n, 0) == 0)
 *         for (kvt__path_walk(&p, &p.m); p.run.node; kvt__path_step(&p))
 *             ... p.run.blocks[0 .. p.run.n), at page depths p.run.depth ...
 *
 * The match (p.m) and the blocks are valid until the next insert, remove, evict or index trim
 * (kvt__index_fit): a pin (kvt__path_pin) keeps the path itself, not the block pointers.
 */
typedef struct kvt__path {
    kvt_match_t m;      /* the seek's result: deepest node, pages matched, namespace, epoch */
    kvt_path_run_t run; /* the walk's current node: run.node NULL once past the top */
} kvt__path_t;

/* Seeks tokens[0, n) of namespace ns: p->m gets the longest stored prefix (pages may be 0).
 * flags: KVT_MATCH_NOTOUCH (no hit counted). 0 or KVT_EINVAL. */
int kvt__path_seek(kvt_srv_t *s, kvt__path_t *p, uint32_t ns, const uint32_t *tokens, size_t n,
                   unsigned flags);
/* Counts the hits of a seek made with KVT_MATCH_NOTOUCH (kvt_radix_touch): one made under the
 * shared lock, counted under the write lock before the tree changes. */
void kvt__path_touch(kvt_srv_t *s, const kvt_match_t *m);
/* Starts a walk of the path m names (p->m may be m); p->run.node is NULL for an empty one. */
void kvt__path_walk(kvt__path_t *p, const kvt_match_t *m);
void kvt__path_step(kvt__path_t *p);
/* The key (block hash) of the last page of m, or the namespace's seed when m is empty: the
 * parent of the page after it. */
uint64_t kvt__path_tail(kvt_srv_t *s, const kvt_match_t *m);
/* The keys of the n whole pages of tokens after the page whose key is parent, into out. */
int kvt__path_keys(kvt_srv_t *s, uint32_t ns, uint64_t parent, const uint32_t *tokens, size_t n,
                   uint64_t *out);
/* The block at page depth of the path ending at node (NULL past its end). */
kvt_block_t *kvt__path_block(kvt_radix_node_t *node, uint32_t depth);
/* The node of the path ending at node that holds page depth (NULL past its end). */
kvt_radix_node_t *kvt__path_holder(kvt_radix_node_t *node, uint32_t depth);
/* The page depth of node's first page. */
uint32_t kvt__node_depth(const kvt_radix_node_t *node);
/* Makes page depth of the path ending at node begin a node (the tree's kvt_radix_split_at):
 * 0, KVT_EINVAL, KVT_ENOSPC (index-bytes has no room for it) or KVT_ENOMEM (nothing changed). */
int kvt__path_split(kvt_srv_t *s, kvt_radix_node_t *node, uint32_t depth);

/* Inserts tokens[0, n) of namespace ns (whole pages; the rest is ignored): res names the path's
 * deepest node and its pages. After kvt__index_room. The tree's returns (radix.h). m: the seek of
 * the same tokens, when the tree may not have changed since (it starts from its end), or NULL. */
int kvt__path_insert(kvt_srv_t *s, uint32_t ns, const kvt_match_t *m, const uint32_t *tokens,
                     size_t n, kvt_insert_t *res);

/* Pins m's path for client owner (a MATCH's lease): nothing on it is evicted or removed until
 * kvt__path_unpin. 0, KVT_ENOSPC (the lease table would grow past index-bytes: refused here,
 * nothing trimmed) or KVT_ENOMEM. */
int kvt__path_pin(kvt_srv_t *s, const kvt_match_t *m, uint64_t owner, uint64_t *lease);
void kvt__path_unpin(kvt_srv_t *s, uint64_t lease);
/* Index bytes a pin may allocate (the lease table growing), for kvt__index_fit before a seek. */
uint64_t kvt__pin_need(const kvt_srv_t *s);
/* The leases held in all. */
uint32_t kvt__lease_count(const kvt_srv_t *s);

/* Namespaces: page size (0: not open), seed, close (KVT_EBUSY while it holds pages). */
uint32_t kvt__ns_page_size(const kvt_srv_t *s, uint32_t ns);
uint64_t kvt__ns_seed(const kvt_srv_t *s, uint32_t ns);
int kvt__ns_close(kvt_srv_t *s, uint32_t ns);
/* Opens (or finds) the namespace of (model, adapter, salt) with page_size tokens a page, and the
 * index bytes that may take (kvt_radix_ns_open, kvt_radix_ns_need). */
int kvt__ns_open(kvt_srv_t *s, const char *model, const char *adapter, const char *salt,
                 uint32_t page_size, uint32_t *ns);
uint64_t kvt__ns_need(const kvt_srv_t *s, const char *model, const char *adapter, const char *salt,
                      uint32_t page_size);
/* Warms the CPU cache for the n seeks of runs about to be made, in two steps: the paths followed
 * and their pages noted, then asked for run by run (kvt_radix_warm_plan, kvt_radix_warm_run). */
void kvt__path_warm_plan(const kvt_srv_t *s, uint32_t ns, const kvt_token_run_t *runs, size_t n,
                         kvt_warm_plan_t *plan);
void kvt__path_warm_run(const kvt_warm_plan_t *plan, size_t i);

/* Removes tokens[0, n) of namespace ns and everything below it (a REMOVE: its tier bytes are
 * discarded for good, no ghost, no drop counted; the tree hands the cause, KVT_RADIX_REMOVE, to
 * kvt__store_free_cb). 0, KVT_ENOENT, KVT_EBUSY (a lease or work in flight holds it). */
int kvt__store_remove(kvt_srv_t *s, uint32_t ns, const uint32_t *tokens, size_t n);
/* Promotes the first pages of node (its own pages, the path above it is the policy's to
 * include) to tier target for request r (a PREFETCH: the moves started report to it and it
 * waits for them; NULL: none), into device's HBM pool (-1: any). The policy's return. */
int kvt__store_promote(kvt_srv_t *s, kvt_radix_node_t *node, uint32_t pages, kvt_tier_id_t target,
                       kvt__req_t *r, int device);

/* At zero-copy-arenas, for a MAP: moves the blocks of the DRAM arena no connection maps (the one
 * with the fewest) into the main region, same tier and charge, and the arena goes. 0 when it
 * went; KVT_ENOSPC when there was none or a block in use (busy, read, leased) stayed. */
int kvt__store_free_arena(kvt_srv_t *s);

/* Tiers: the tier's usage and the bytes it holds for a block of block_bytes (0 when absent). NVMe
 * pins against reclaim: kvt__nvme_pin (server.h). */
void kvt__tier_usage(const kvt_srv_t *s, kvt_tier_id_t tier, kvt_tier_usage_t *u);
uint64_t kvt__tier_dropped(const kvt_srv_t *s, kvt_tier_id_t tier); /* shared lock: tier.h */
/* Starts a probe of the remote tier (tier.h's kvt_tier_remote_probe): KVT_EUNAVAIL when there
 * is no remote tier. */
int kvt__tier_probe(kvt_srv_t *s, kvt_tier_probe_t *p);
/* A DRAM block's seal against its bytes (KVT_ECORRUPT: written over since its COMMIT); 0 for
 * other tiers. */
int kvt__tier_check(kvt_srv_t *s, const kvt_block_t *b);
/* kvt__tier_check without a write, for a GET under the shared lock: 1 when b is not DRAM or
 * checks out as it is, 0 when kvt__tier_check must run (under the write lock). */
int kvt__tier_intact(const kvt_srv_t *s, const kvt_block_t *b);
/* Where a memory tier holds b's bytes (valid while b stays there, busy), or NULL: read it. */
const uint8_t *kvt__tier_ptr(kvt_srv_t *s, const kvt_block_t *b);
/* Where a memory tier's location loc lies, for a PUT that copies its bytes in after it allocated
 * it (op_put.c, with the lock let go), or NULL. */
void *kvt__tier_loc_ptr(kvt_srv_t *s, kvt_tier_id_t tier, uint64_t loc);
/* Starts a read from tier (tier.h's kvt_tier_read: io's callback on completion). */
int kvt__tier_read(kvt_srv_t *s, kvt_tier_id_t tier, kvt_tier_io_t *io);
/* Starts a write to tier (kvt_tier_write; io is a kvt__io_t's, a GAPS PUT's window on NVMe has
 * its gap's path recorded: kvt__nvme_gap_path); whether tenant ns_seed may take len more bytes
 * there (tenant-<tier>-bytes, kvt_tier_ns_fits). */
int kvt__tier_write(kvt_srv_t *s, kvt_tier_id_t tier, kvt_tier_io_t *io);
int kvt__tier_fits(kvt_srv_t *s, kvt_tier_id_t tier, uint64_t ns_seed, uint32_t len);
/* Frees a location no block names yet (a PUT's write that did not join the tree); orphan: a
 * DRAM reservation handed to kvt__tier_orphan, freed once the client's writes stop. */
void kvt__tier_release(kvt_srv_t *s, kvt_tier_id_t tier, uint64_t loc, uint32_t len, int orphan);
/* A zero-copy reservation in DRAM: its offset in namespace ns_seed's arena (kvt_tier_dram_offset),
 * its seal (the client's sum when has_sum, else computed later, or now without memory), and the
 * orphaning of one the client may still write (kvt_tier_dram_orphan). */
int kvt__tier_offset(const kvt_srv_t *s, uint64_t ns_seed, uint64_t loc, uint64_t *off);
void kvt__tier_seal(kvt_srv_t *s, uint64_t loc, int has_sum, uint64_t sum);
int kvt__tier_orphan(kvt_srv_t *s, uint64_t loc, uint32_t len);
/* The DRAM arena of namespace ns_seed, shared with a client (kvt_tier_dram_share: a memfd of
 * its own, map_bytes), unshared, and the arenas shared now; the HBM pool's IPC handle for
 * device (kvt_tier_hbm_ipc). */
int kvt__tier_share(kvt_srv_t *s, uint64_t ns_seed, int *fd, uint64_t *map_bytes);
void kvt__tier_unshare(kvt_srv_t *s, uint64_t ns_seed);
uint32_t kvt__tier_shared(const kvt_srv_t *s);
int kvt__tier_hbm_ipc(kvt_srv_t *s, int device, uint8_t *handle, uint64_t *bytes);
/* Records a namespace's name in the NVMe tier, for a warm restart (kvt_tier_nvme_add_ns). */
int kvt__tier_add_ns(kvt_srv_t *s, const char *model, const char *adapter, const char *salt,
                     uint32_t page_size);
/* The largest page the NVMe tier can hold for pages of page_size tokens
 * (kvt_tier_nvme_max_block). */
uint32_t kvt__tier_nvme_max_block(const kvt_srv_t *s, uint32_t page_size);
/* Whether tier can ever hold a page of len bytes of namespace ns, however much room it has:
 * NVMe's records hold a page whole and never span segments (KVT_ETOOBIG). Such a page passes the
 * tier by, neither refused nor counted by its tenant quota (kvt__tier_fits). */
int kvt__tier_holds(const kvt_srv_t *s, kvt_tier_id_t tier, uint32_t ns, uint32_t len);
/* io's write readied with no lock held (kvt_tier_write_prepare: NVMe's record checksum). */
int kvt__tier_write_prepare(const kvt_srv_t *s, kvt_tier_id_t tier, kvt_tier_io_t *io);
/* A read's payload checksum left to its caller, taken with no lock held (kvt_tier_read_check),
 * and one that failed counted as the tier's corrupt read, under the write lock
 * (kvt_tier_read_corrupt). */
int kvt__tier_read_check(kvt_tier_io_t *io);
void kvt__tier_read_corrupt(const kvt_srv_t *s, kvt_tier_id_t tier, const kvt_tier_io_t *io);
uint64_t kvt__tier_footprint(const kvt_srv_t *s, kvt_tier_id_t tier, uint64_t block_bytes);

#endif
