/*
 * nvme_impl.h: the NVMe tier's state, shared by nvme.c (I/O, segments, the recovery scan) and
 * nvme_recover.c (handing recovered blocks to the owner of the index). Internal to tiers/.
 */
#ifndef KVT_NVME_IMPL_H
#define KVT_NVME_IMPL_H

#include <liburing.h>
#include <sys/uio.h>

#include "tier_impl.h"

enum { SEG_FREE = 0, SEG_OPEN = 1, SEG_FULL = 2 };

typedef struct nvme_seg {
    uint32_t gen;   /* bumps each time the segment is freed; part of every location */
    uint32_t state; /* SEG_* */
    uint64_t stamp; /* random, drawn when opened for writing; in every record's prefix */
    uint32_t head;  /* bytes handed out from the start */
    uint32_t live_blocks;
    uint64_t live_bytes; /* record bytes of live blocks */
    uint32_t inflight;   /* reads and writes in flight here: never reclaimed meanwhile */
    uint32_t pins;       /* kvt_tier_pin counts on blocks here: never reclaimed meanwhile */
    uint32_t opening;    /* the first record of this use is in flight: no other starts here */
    uint32_t nlocs, locs_cap;
    uint64_t *locs; /* every location written in this use (some freed since) */
} nvme_seg_t;

/* One io_uring request slot: the tier has queue_depth of them. */
typedef struct nvme_req {
    kvt_tier_io_t *io;
    kvt__ioq_link_t link; /* the slot pool (ioq) */
    uint8_t *hdr;         /* HDR_MAX_BYTES, sector-aligned: prefix, block header, tokens */
    uint8_t *tail;        /* one sector for a payload's partial last sector */
    uint8_t *bounce;      /* the whole payload, for a caller buffer that is not aligned */
    struct iovec iov[3];
    uint32_t niov, iov_at;
    uint32_t done, total; /* bytes transferred so far, bytes to transfer */
    uint32_t seg;
    int first; /* a write of its segment's first record */
    int payload_direct;
    uint64_t off; /* file offset of the record */
} nvme_req_t;

/* A block the recovery scan found, kept until recovery ends (kvt_tier_nvme_recover_end). */
typedef struct nvme_replay nvme_replay_t; /* nvme_recover.c */
typedef struct nvme_recovered {
    uint64_t loc, ns_seed, hash, parent, seq;
    uint32_t len, ntokens;
    uint32_t *tokens;
} nvme_recovered_t;

typedef struct nvme {
    kvt_tier_t *tier;
    char *dir, *path;
    int fd, efd;
    int lockfd; /* kvtier.lock, flock()ed for as long as the tier is open */
    int direct;
    struct io_uring ring;
    int ring_ok;
    uint32_t qd;
    nvme_req_t *reqs;
    kvt__ioq_t q; /* requests waiting for a slot (window: qd), and the free slots */
    uint32_t seg_bytes, nsegs;
    nvme_seg_t *segs;
    uint32_t cur;       /* the open segment, or UINT32_MAX */
    uint32_t next_free; /* where the search for a free segment starts */
    uint64_t seq;       /* the last sequence number taken or recovered (atomic: nvme_next_seq) */
    int warned_nospc;
    nvme_recovered_t *recovered;
    size_t nrecovered, recovered_cap;
    int recover_done;
    nvme_replay_t *replay; /* between kvt_tier_nvme_recover_begin and _end */
    /* Hashes of the descriptions DIR/namespaces holds (kvt_tier_nvme_add_ns): an open-addressing
     * set, 0 marking a free slot, read from the file once, on the first call. */
    uint64_t *ns_set;
    size_t ns_count, ns_cap;
    size_t ns_lines, ns_compact_at; /* lines in the file; compacted when it reaches the second */
    int ns_loaded;
    void (*reclaim_cb)(void *arg, uint64_t loc, uint64_t ns_seed, uint64_t hash);
    void *reclaim_arg;
    kvt_tier_nvme_recovery_t rec;
    /* DIR/kvtier.live, mapped shared: per segment the stamp of its current use and a bit for
     * each sector that starts a live block's record (nvme.c, "Live blocks"). */
    int livefd;
    uint8_t *live;
    size_t live_size;
    uint32_t live_entry;       /* bytes per segment: 8 + one bit per sector */
    uint32_t meta_version;     /* of the directory opened: 1 was written before kvtier.live */
    uint64_t paths_compact_at; /* DIR/kvtier.paths' size that makes the next record compact it */
} nvme_t;

/* A record of DIR/kvtier.paths (nvme_paths.c): the npages pages of tokens from the namespace's
 * root in front of the block (ns_seed, hash) whose parent's hash is parent. */
typedef struct nvme_path_rec {
    uint64_t ns_seed, hash, parent;
    uint32_t page_size, npages;
    const uint32_t *tokens; /* npages x page_size */
} nvme_path_rec_t;
/* Called per intact record; for a read, 0 goes on and an error stops it; for a rewrite, non-zero
 * keeps the record. */
typedef int (*kvt__nvme_path_fn)(void *arg, const nvme_path_rec_t *p);
/* Reads DIR/kvtier.paths (none: nothing), counting damaged records in *torn (may be NULL). */
int kvt__nvme_paths_load(const nvme_t *n, kvt__nvme_path_fn fn, void *arg, uint64_t *torn);
/* Rewrites it to the records keep accepts, each block's once; synced when sync is set. */
int kvt__nvme_paths_rewrite(nvme_t *n, kvt__nvme_path_fn keep, void *arg, int sync);
/* Removes it (the blocks it leads to dropped for good). */
void kvt__nvme_paths_drop(nvme_t *n);

extern const kvt_tier_ops_t kvt__nvme_ops;

uint64_t kvt__nvme_loc(uint32_t seg, uint32_t gen, uint32_t hdr_sectors, uint32_t sector);
int kvt__nvme_scan(nvme_t *n);
void kvt__nvme_recovered_free(nvme_t *n); /* the scan's blocks and the replay state */
void kvt__nvme_replay_free(nvme_t *n);

#endif
