/*
 * metrics.h: kvtierd's metrics, defined once in KVT_METRIC_LIST and rendered from that one
 * definition in the Prometheus text format (metrics.c). Internal to server/ (kvt__ names).
 *
 * Each metric has a label dimension: none, tier, miss reason, operation, tier pair (from, to),
 * tier x I/O direction, or protocol error kind. Storage is a flat array of series per metric;
 * the event loops write them and the HTTP handler (loop 0) reads them, all under the daemon's
 * lock (server.h, struct kvt__loop), so nothing is atomic.
 */
#ifndef KVT_SERVER_METRICS_H
#define KVT_SERVER_METRICS_H

#include <stddef.h>
#include <stdint.h>

#include "radix.h"
#include "proto.h"
#include "tier.h"

typedef enum {
    KVT_LBL_NONE,
    KVT_LBL_TIER,     /* tier="hbm|dram|nvme|remote|none" */
    KVT_LBL_STORE,    /* tier="hbm|dram|nvme|remote": the tiers that hold bytes */
    KVT_LBL_LOSS,     /* tier="nvme|remote": the tiers that drop blocks by themselves */
    KVT_LBL_MAP,      /* tier="hbm|dram": the tiers a MAP hands out */
    KVT_LBL_REASON,   /* reason="never_seen|evicted|short_page|remote_unreachable|checksum" */
    KVT_LBL_OP,       /* op="hello|auth|match|..." */
    KVT_LBL_ZC_OP,    /* op="get|reserve": the operations that move pages through a mapping */
    KVT_LBL_PAIR,     /* from="...",to="..." over real tiers */
    KVT_LBL_TIER_IO,  /* tier="...",dir="read|write" */
    KVT_LBL_ERR,      /* kind="..." protocol error kinds */
    KVT_LBL_RECOVERY, /* outcome="inserted|torn|stale|orphan|removed" */
    KVT_LBL_PUT,      /* outcome="stored|cached|no_room|failed" */
    KVT_LBL_HINT,     /* kind="paused|finished|priority" */
    KVT_LBL_RESV,     /* outcome="committed|aborted|expired|closed" */
    KVT_LBL_NS,       /* model="...",adapter="...": metrics-namespaces of them, then "_other" */
    KVT_LBL_BUILD,    /* version="...",commit="...",cuda="yes|no": one series */
    /* tier="...",scale="0.25|0.5|1|2|4" over the configured real tiers (kvt__metrics_tiers) */
    KVT_LBL_TIER_SCALE,
    KVT_LBL_DEVICE, /* device="0".."15": the HBM pools' devices (kvt__metrics_devices) */
    KVT_LBL_LOOP,   /* loop="0".."15": the event loops (kvt__metrics_loops) */
} kvt_label_kind_t;

typedef enum { KVT_MT_COUNTER, KVT_MT_GAUGE, KVT_MT_HISTOGRAM } kvt_metric_type_t;

typedef enum {
    KVT_MISS_NEVER_SEEN,
    KVT_MISS_EVICTED,
    KVT_MISS_SHORT_PAGE,
    KVT_MISS_REMOTE_UNREACHABLE,
    KVT_MISS_CHECKSUM,
    KVT_MISS_COUNT
} kvt_miss_reason_t;

typedef enum {
    KVT_PERR_BAD_MAGIC,
    KVT_PERR_BAD_VERSION,
    KVT_PERR_TOO_BIG,
    KVT_PERR_UNKNOWN_OP,
    KVT_PERR_BAD_BODY,
    KVT_PERR_NO_HELLO,
    KVT_PERR_AUTH,
    KVT_PERR_TRUNCATED, /* the peer closed in the middle of a frame */
    KVT_PERR_COUNT
} kvt_proto_err_t;

/* What became of a PUT's payload page. */
typedef enum {
    KVT_PUT_STORED,  /* in a tier, and in the policy's accounting */
    KVT_PUT_CACHED,  /* the page held bytes already, or another PUT was writing them */
    KVT_PUT_NO_ROOM, /* no tier took it, nor could room be made */
    KVT_PUT_FAILED,  /* its write failed */
    KVT_PUT_COUNT
} kvt_put_outcome_t;

/* An engine hint a MATCH or PUT carried (docs/protocol.md "Engine hints"). */
typedef enum {
    KVT_HINTK_PAUSED,   /* KVT_HINT_PAUSED, with its resume_ms */
    KVT_HINTK_FINISHED, /* KVT_HINT_FINISHED */
    KVT_HINTK_PRIORITY, /* a non-zero priority */
    KVT_HINTK_COUNT
} kvt_hint_kind_t;

/* How a zero-copy reservation ended (op_put.c). */
typedef enum {
    KVT_RESV_COMMITTED, /* COMMIT: its pages are stored */
    KVT_RESV_ABORTED,   /* COMMIT with ABORT */
    KVT_RESV_EXPIRED,   /* reserve-ms passed */
    KVT_RESV_CLOSED,    /* its connection closed */
    KVT_RESV_COUNT
} kvt_resv_outcome_t;

/* What the NVMe tier's recovery did with a block it found at start-up. */
typedef enum {
    KVT_RECOVERY_INSERTED,
    KVT_RECOVERY_TORN,
    KVT_RECOVERY_STALE,
    KVT_RECOVERY_ORPHAN,
    KVT_RECOVERY_DISCARDED,
    KVT_RECOVERY_COUNT
} kvt_recovery_outcome_t;

/*     id, type, name, unit-bearing help, labels */
#define KVT_METRIC_LIST(X)                                                                         \
    X(LOOKUPS, COUNTER, "kvtier_lookups_total", "MATCH lookups answered.", NONE)                   \
    X(LOOKUP_TOKENS, COUNTER, "kvtier_lookup_tokens_total",                                        \
      "Tokens looked up by MATCH: the denominator of the hit rate.", NONE)                         \
    X(HIT_TOKENS, COUNTER, "kvtier_hit_tokens_total",                                              \
      "Matched tokens, by the tier holding their block at the time of the match.", TIER)           \
    X(MISS_TOKENS, COUNTER, "kvtier_miss_tokens_total",                                            \
      "Looked-up tokens not matched, by reason.", REASON)                                          \
    X(TIER_USED, GAUGE, "kvtier_tier_used_bytes", "Bytes stored in each tier.", STORE)             \
    X(TIER_CAPACITY, GAUGE, "kvtier_tier_capacity_bytes", "Configured capacity of each tier.",     \
      STORE)                                                                                       \
    X(TIER_BLOCKS, GAUGE, "kvtier_tier_blocks", "Blocks stored in each tier.", STORE)              \
    X(TIER_LOST, COUNTER, "kvtier_tier_lost_blocks_total",                                         \
      "Blocks a tier dropped by itself (NVMe segment reclaim, remote server eviction).", LOSS)     \
    X(NVME_BOUNCED, COUNTER, "kvtier_nvme_bounced_bytes_total",                                    \
      "Payload bytes the NVMe tier copied through a bounce buffer (an unaligned buffer).", NONE)   \
    X(HBM_BATCHES, COUNTER, "kvtier_hbm_copy_batches_total",                                       \
      "Batches the HBM tier's copies went out in (one cudaMemcpyBatchAsync each).", NONE)          \
    X(HBM_COPIES, COUNTER, "kvtier_hbm_copies_total",                                              \
      "HBM copies in those batches, both ways: copies per batch = this / the batches.", NONE)      \
    X(HBM_POOL_USED, GAUGE, "kvtier_hbm_pool_used_bytes",                                          \
      "Bytes the HBM pool of each device holds (hbm-devices); their sum is the tier's.", DEVICE)   \
    X(HBM_POOL_CAPACITY, GAUGE, "kvtier_hbm_pool_capacity_bytes",                                  \
      "Size of the HBM pool of each device.", DEVICE)                                              \
    X(HBM_POOL_BLOCKS, GAUGE, "kvtier_hbm_pool_blocks", "Blocks in the HBM pool of each device.",  \
      DEVICE)                                                                                      \
    X(BLOCKS_MOVED, COUNTER, "kvtier_blocks_moved_total",                                          \
      "Blocks copied from one tier to another.", PAIR)                                             \
    X(BLOCKS_DROPPED, COUNTER, "kvtier_blocks_dropped_total",                                      \
      "Blocks dropped from the index, by the tier that held them.", TIER)                          \
    X(MOVE_FAILURES, COUNTER, "kvtier_policy_move_failures_total",                                 \
      "Pages of policy moves whose copy the tiers refused as it began, by the tier they were "     \
      "to go to.",                                                                                 \
      STORE)                                                                                       \
    X(PREFILL_SAVED, COUNTER, "kvtier_prefill_saved_seconds_total",                                \
      "Estimated prefill compute saved by matched tokens (hit tokens / prefill_tokens_per_s).",    \
      NONE)                                                                                        \
    X(NVME_WRITTEN, COUNTER, "kvtier_nvme_written_bytes_total", "Payload bytes written to NVMe.",  \
      NONE)                                                                                        \
    X(REQUESTS, COUNTER, "kvtier_requests_total", "Requests answered, by operation.", OP)          \
    X(REQUEST_ERRORS, COUNTER, "kvtier_request_errors_total",                                      \
      "Requests answered with an error status, by operation.", OP)                                 \
    X(REQUEST_SECONDS, HISTOGRAM, "kvtier_request_duration_seconds",                               \
      "Time from a request's arrival to its reply being queued, by operation.", OP)                \
    X(TIER_IO_SECONDS, HISTOGRAM, "kvtier_tier_io_duration_seconds",                               \
      "Time from a tier read or write being submitted to its completion.", TIER_IO)                \
    X(TIER_IO_ERRORS, COUNTER, "kvtier_tier_io_errors_total",                                      \
      "Tier reads and writes that completed with an error (misses included).", TIER_IO)            \
    X(CONNECTIONS, GAUGE, "kvtier_connections", "Client connections open now.", NONE)              \
    X(LOOPS, GAUGE, "kvtier_loops",                                                                \
      "Event loops serving the clients: the loops setting, 0 resolved to the CPUs the daemon may " \
      "run on (at most 8).",                                                                       \
      NONE)                                                                                        \
    X(LOOP_CONNECTIONS, GAUGE, "kvtier_loop_connections",                                          \
      "Client connections open now, by the event loop that serves them (loops).", LOOP)            \
    X(LOOP_REQUESTS, COUNTER, "kvtier_loop_requests_total",                                        \
      "Requests answered, by the event loop of their connection.", LOOP)                           \
    X(LOOP_CPU, COUNTER, "kvtier_loop_cpu_seconds_total",                                          \
      "CPU time each event loop's thread has used (loop 0: the main thread), read every tick.",    \
      LOOP)                                                                                        \
    X(LOOP_SHARED_MATCHES, COUNTER, "kvtier_loop_shared_matches_total",                            \
      "MATCHes whose tree walk ran under the store's lock shared with other loops (several "       \
      "loops; no lease, KEEP or REMOTE), by loop.",                                                \
      LOOP)                                                                                        \
    X(LOOP_SHARED_GETS, COUNTER, "kvtier_loop_shared_gets_total",                                  \
      "GETs of DRAM pages (or LOCATE's locations in the mapped arena) planned, written and "       \
      "released under the store's lock shared with other loops (several loops), by loop.",         \
      LOOP)                                                                                        \
    X(LOOP_SHARED_RELEASES, COUNTER, "kvtier_loop_shared_releases_total",                          \
      "RELEASEs answered under the store's lock shared with other loops (several loops; not one "  \
      "behind a GET still reading under its lease), by loop.",                                     \
      LOOP)                                                                                        \
    X(LOOP_WRITE_LOCKS, COUNTER, "kvtier_loop_write_locks_total",                                  \
      "Times each event loop's thread took the store's lock for writing (a write op, a close, a "  \
      "posted kick, the step after a batch that wrote): a run of MATCHes without a lease takes "   \
      "none.",                                                                                     \
      LOOP)                                                                                        \
    X(LOOP_WRITE_LOCK_WAIT, HISTOGRAM, "kvtier_loop_write_lock_wait_seconds",                      \
      "Time each event loop's thread waited for the store's lock for writing, by loop: other "     \
      "loops held it (for writing, or shared by their MATCHes and GETs).",                         \
      LOOP)                                                                                        \
    X(LOOP_WRITE_LOCK_HOLD, HISTOGRAM, "kvtier_loop_write_lock_hold_seconds",                      \
      "Time each event loop's thread held the store's lock for writing, by loop (every other "     \
      "loop's MATCHes and GETs wait that long); the loops' deferred MATCH hits, which a writer "   \
      "applies first, count in it.",                                                               \
      LOOP)                                                                                        \
    X(LOOP_SHARED_LOCK_WAIT, HISTOGRAM, "kvtier_loop_shared_lock_wait_seconds",                    \
      "Time each event loop's thread waited for the store's lock shared (its MATCHes, GETs and "   \
      "framing), by loop: another loop held it for writing.",                                      \
      LOOP)                                                                                        \
    X(LOOP_DEFERRED_HITS, COUNTER, "kvtier_loop_deferred_hits_total",                              \
      "MATCHes a loop answered under the shared lock whose use of the store (the blocks' hits, "   \
      "the policy's, the miss-ratio curve's sample) it deferred, applied by the next thread to "   \
      "take the lock for writing, by the loop that deferred them.",                                \
      LOOP)                                                                                        \
    X(LOOP_KICKS_POSTED, COUNTER, "kvtier_loop_kicks_posted_total",                                \
      "Times another loop handed a loop one of its connections to serve (a tier completion, a "    \
      "deadline, a close), through its eventfd.",                                                  \
      LOOP)                                                                                        \
    X(LOOP_SOCKET_TURNS, GAUGE, "kvtier_loop_socket_turns",                                        \
      "Connections holding a turn to have a big reply in the kernel (socket-turns), by loop.",     \
      LOOP)                                                                                        \
    X(LOOP_SOCKET_TURN_WAITERS, GAUGE, "kvtier_loop_socket_turn_waiters",                          \
      "Connections whose big replies wait in kvtierd for a turn (socket-turns), by loop.", LOOP)   \
    X(LOOP_SOCKET_TURN_STALLS, COUNTER, "kvtier_loop_socket_turn_stalls_total",                    \
      "Turns passed on because the holder's socket took nothing for socket-turn-stall-ms while "   \
      "others waited (its client stopped reading, or reads another connection first), by loop.",   \
      LOOP)                                                                                        \
    X(LOOP_QUEUED_REQUESTS, GAUGE, "kvtier_loop_queued_requests",                                  \
      "Requests read from each event loop's connections whose reply is not yet all in the "        \
      "kernel: waiting for tier I/O or a turn, or answered and queued in kvtierd.",                \
      LOOP)                                                                                        \
    X(LOOP_QUEUED_BYTES, GAUGE, "kvtier_loop_queued_reply_bytes",                                  \
      "Reply bytes ready in kvtierd and not yet taken by the kernel, by the event loop of their "  \
      "connection.",                                                                               \
      LOOP)                                                                                        \
    X(CONNECTIONS_REFUSED, COUNTER, "kvtier_connections_refused_total",                            \
      "Connections closed as soon as accepted: max-conns, shutting down, no descriptor left.",     \
      NONE)                                                                                        \
    X(CONNECTIONS_ACCEPTED, COUNTER, "kvtier_connections_accepted_total",                          \
      "Client connections accepted.", NONE)                                                        \
    X(CONNECTIONS_TIMED_OUT, COUNTER, "kvtier_connections_timed_out_total",                        \
      "Connections closed because their socket took none of their replies for reply-timeout-ms.",  \
      NONE)                                                                                        \
    X(CONNECTIONS_HELLO_TIMED_OUT, COUNTER, "kvtier_connections_hello_timed_out_total",            \
      "Connections closed because their first frame was not whole within hello-timeout-ms.", NONE) \
    X(CONNECTIONS_FRAME_TIMED_OUT, COUNTER, "kvtier_connections_frame_timed_out_total",            \
      "Connections closed because a frame was neither whole within frame-timeout-ms nor "          \
      "arriving at frame-min-rate.",                                                               \
      NONE)                                                                                        \
    X(CONNECTIONS_EVICTED, COUNTER, "kvtier_connections_evicted_total",                            \
      "Idle connections with no lease and no request closed at max-conns to make room for a new "  \
      "one (evict-idle-ms).",                                                                      \
      NONE)                                                                                        \
    X(SCRAPES_EVICTED, COUNTER, "kvtier_metrics_connections_evicted_total",                        \
      "Metrics-port connections not yet answered, closed to make room for a new one (64 at "       \
      "most).",                                                                                    \
      NONE)                                                                                        \
    X(PROTOCOL_ERRORS, COUNTER, "kvtier_protocol_errors_total",                                    \
      "Malformed or refused frames, by kind.", ERR)                                                \
    X(INDEX_BLOCKS, GAUGE, "kvtier_index_blocks", "Pages cached in the prefix index.", NONE)       \
    X(INDEX_BYTES, GAUGE, "kvtier_index_bytes", "Memory allocated by the prefix index.", NONE)     \
    X(INDEX_CAPACITY, GAUGE, "kvtier_index_capacity_bytes",                                        \
      "The prefix index's memory limit (index-bytes); 0 for none.", NONE)                          \
    X(INDEX_PREFAULTED, GAUGE, "kvtier_index_prefaulted_bytes",                                    \
      "Memory the prefix index's arena has mapped and faulted in (index-prefault at start, then "  \
      "2 MiB steps); resident, kept until exit.",                                                  \
      NONE)                                                                                        \
    X(INDEX_NODES, GAUGE, "kvtier_index_nodes", "Nodes of the prefix index.", NONE)                \
    X(INDEX_CACHED_TOKENS, GAUGE, "kvtier_index_cached_tokens",                                    \
      "Tokens of the pages cached in the prefix index.", NONE)                                     \
    X(NAMESPACES, GAUGE, "kvtier_namespaces", "Namespaces open in the prefix index.", NONE)        \
    X(NAMESPACES_CLOSED, COUNTER, "kvtier_namespaces_closed_total",                                \
      "Empty namespaces no client used, closed to make room for new ones.", NONE)                  \
    X(PIN_REFUSALS, COUNTER, "kvtier_policy_pin_refusals_total",                                   \
      "Tier moves not started: index-bytes had no room for the lease that pins them.", NONE)       \
    X(POLICY_REBUILDS, COUNTER, "kvtier_policy_rebuilds_total",                                    \
      "Times the tier policy renewed its victim heaps in one walk (docs/policy.md).", NONE)        \
    X(POLICY_SWEEPS, COUNTER, "kvtier_policy_sweeps_total",                                        \
      "Times the tier policy renewed its victim heaps by a sweep (docs/policy.md).", NONE)         \
    X(POLICY_PARKED, COUNTER, "kvtier_policy_parked_total",                                        \
      "Promotions refused while a lease's holder may read the run in place, parked till it ends.", \
      NONE)                                                                                        \
    X(POLICY_PARK_WAITS, COUNTER, "kvtier_policy_park_waits_total",                                \
      "Promotions MATCH queued not started: a parked one waits on their path.", NONE)              \
    X(POLICY_ROOM_WAITS, COUNTER, "kvtier_policy_room_waits_total",                                \
      "Queued promotions parked till the room their moves out make in the top tier lands.", NONE)  \
    X(POLICY_ROOM_GAVEUPS, COUNTER, "kvtier_policy_room_gaveups_total",                            \
      "Queued promotions dropped after their room went elsewhere 3 times (till the next MATCH).",  \
      NONE)                                                                                        \
    X(LEASED_PROMOTIONS, COUNTER, "kvtier_leased_promotions_total",                                \
      "Promotions out of DRAM switched to their new copy while a lease held the run, the old "     \
      "copy kept until the leases taken before the switch end (promote-keep-share).",              \
      NONE)                                                                                        \
    X(LEASED_PROMO_COPIES, GAUGE, "kvtier_leased_promotion_copies",                                \
      "Old DRAM copies of pages promoted under a lease, kept now for leases taken before the "     \
      "switch.",                                                                                   \
      NONE)                                                                                        \
    X(LEASED_PROMO_BYTES, GAUGE, "kvtier_leased_promotion_copy_bytes",                             \
      "DRAM bytes those kept copies hold (counted as used in the DRAM tier).", NONE)               \
    X(POLICY_EXPERT, GAUGE, "kvtier_policy_expert",                                                \
      "The cost policy's expert that orders victims (docs/policy.md, Experts): 1 value, 2 "        \
      "recent, 3 frequent, 4 value above the lowest tier and recent in it, 5 hit density by "      \
      "age; 0 under lru and lfu.",                                                                 \
      NONE)                                                                                        \
    X(POLICY_INDEX_DROPS, COUNTER, "kvtier_policy_index_drops_total",                              \
      "Pages holding bytes dropped to keep the index under index-bytes.", NONE)                    \
    X(UPTIME, GAUGE, "kvtier_uptime_seconds", "Seconds since the daemon started.", NONE)           \
    X(CONFIG_RELOADS, COUNTER, "kvtier_config_reloads_total",                                      \
      "Reloads of the settings (SIGHUP) that were applied.", NONE)                                 \
    X(CONFIG_RELOAD_FAILURES, COUNTER, "kvtier_config_reload_failures_total",                      \
      "Reloads refused, the settings left as they were: a bad value, an unreadable file.", NONE)   \
    X(DRAINING, GAUGE, "kvtier_draining",                                                          \
      "1 while the daemon drains for a restart (SIGUSR1): it accepts no new connection.", NONE)    \
    X(REMOTE_CONNECTS, COUNTER, "kvtier_remote_connects_total",                                    \
      "Connections to the remote server that completed their handshake.", NONE)                    \
    X(REMOTE_DISCONNECTS, COUNTER, "kvtier_remote_disconnects_total",                              \
      "Established connections to the remote server that were lost.", NONE)                        \
    X(REMOTE_TIMEOUTS, COUNTER, "kvtier_remote_timeouts_total",                                    \
      "Remote requests and probes failed by their deadline.", NONE)                                \
    X(REMOTE_OVERSIZED, COUNTER, "kvtier_remote_oversized_values_total",                           \
      "Remote values longer than their block, refused without being buffered.", NONE)              \
    X(REMOTE_MOVED, COUNTER, "kvtier_remote_moved_total",                                          \
      "MOVED replies from the remote cluster (a slot served elsewhere): followed.", NONE)          \
    X(REMOTE_ASKS, COUNTER, "kvtier_remote_asks_total",                                            \
      "ASK replies from the remote cluster (a slot migrating): followed with ASKING.", NONE)       \
    X(REMOTE_REDIRECT_ERRORS, COUNTER, "kvtier_remote_redirect_errors_total",                      \
      "Remote redirects not followed (a bad address, too many, no cluster mode): misses.", NONE)   \
    X(REMOTE_MAP_REFRESHES, COUNTER, "kvtier_remote_slot_map_refreshes_total",                     \
      "Slot maps of the remote cluster applied (CLUSTER SLOTS).", NONE)                            \
    X(REMOTE_MAP_ERRORS, COUNTER, "kvtier_remote_slot_map_errors_total",                           \
      "Slot-map replies refused (malformed, or an error): the map was kept.", NONE)                \
    X(REMOTE_FAILOVERS, COUNTER, "kvtier_remote_failovers_total",                                  \
      "Lost remote primaries whose slots a refreshed map gave to another node.", NONE)             \
    X(REMOTE_NODES, GAUGE, "kvtier_remote_nodes",                                                  \
      "Remote cluster primaries the slot map names (1 for a single server).", NONE)                \
    X(REMOTE_LATE_KEPT, COUNTER, "kvtier_remote_late_writes_kept_total",                           \
      "Remote writes failed that may have landed (late, or lost with a connection): kept.", NONE)  \
    X(PREFETCH_WAITS, COUNTER, "kvtier_prefetch_waits_total",                                      \
      "PREFETCH requests that waited for room on its way or for others' moves.", NONE)             \
    X(PUT_PAGES, COUNTER, "kvtier_put_pages_total",                                                \
      "PUT payload pages, by outcome: stored, cached (held already or being written), no_room "    \
      "(no tier took it, nor could room be made), failed (the write failed).",                     \
      PUT)                                                                                         \
    X(PUT_ROOM, COUNTER, "kvtier_put_room_pages_total",                                            \
      "PUT pages written after the policy made room for them (no tier had any).", NONE)            \
    X(PUT_GAPS, COUNTER, "kvtier_put_gap_splits_total",                                            \
      "Nodes split so that a PUT or COMMIT with GAPS stores pages after pages without bytes.",     \
      NONE)                                                                                        \
    X(HINTS, COUNTER, "kvtier_hints_total",                                                        \
      "Engine hints carried by MATCH and PUT requests, by kind: paused, finished, priority "       \
      "(non-zero). A request with several counts once for each.",                                  \
      HINT)                                                                                        \
    X(CLIENT_BYTES, GAUGE, "kvtier_client_buffer_bytes",                                           \
      "Memory held for clients beyond their base input buffers (max-client-bytes).", NONE)         \
    X(CLIENT_MEMORY_WAITS, COUNTER, "kvtier_client_memory_waits_total",                            \
      "Times a connection stopped reading until max-client-bytes had room for its frame.", NONE)   \
    X(FRAME_BUFFERS_REUSED, COUNTER, "kvtier_frame_buffers_reused_total",                          \
      "Big frames read into the kept buffer of an earlier one instead of a fresh buffer.", NONE)   \
    X(SOCKET_WRITES, COUNTER, "kvtier_socket_writes_total",                                        \
      "Writes of replies to client sockets (writev, sendmsg; EAGAIN included): requests over "     \
      "writes is how many replies one write carries.",                                             \
      NONE)                                                                                        \
    X(LEASES, GAUGE, "kvtier_leases", "Leases held now.", NONE)                                    \
    X(LEASES_EXPIRED, COUNTER, "kvtier_leases_expired_total",                                      \
      "Leases released because their time limit passed.", NONE)                                    \
    X(NVME_RECOVERY, GAUGE, "kvtier_nvme_recovery_blocks",                                         \
      "Blocks the NVMe recovery found at start-up, by outcome: inserted in the index, torn "       \
      "(checksum failed: skipped), stale (an older copy: skipped), orphan (namespace or "          \
      "ancestors gone: freed), removed (dropped before the stop: stepped over).",                  \
      RECOVERY)                                                                                    \
    X(AUTH_FAILURES, COUNTER, "kvtier_auth_failures_total", "AUTH requests with a wrong secret.",  \
      NONE)                                                                                        \
    X(AUTH_DELAYED, COUNTER, "kvtier_auth_delayed_total",                                          \
      "AUTH answers that waited their turn: wrong AUTHs came faster than auth-failures-per-s.",    \
      NONE)                                                                                        \
    X(AUTH_REFUSED, COUNTER, "kvtier_auth_refused_total",                                          \
      "AUTH requests answered EAGAIN unchecked: they would have waited past auth-wait-ms.", NONE)  \
    X(LOG_SUPPRESSED, COUNTER, "kvtier_log_lines_suppressed_total",                                \
      "Log lines held back by their rate limit (log-rate).", NONE)                                 \
    X(NAMESPACES_EVICTED, COUNTER, "kvtier_namespaces_evicted_total",                              \
      "Namespaces no client used whose pages were evicted to free a namespace for a new one "      \
      "(max-namespaces).",                                                                         \
      NONE)                                                                                        \
    X(NVME_RECOVERY_GAPS, GAUGE, "kvtier_nvme_recovery_gaps",                                      \
      "Stretches with no record before intact ones that the NVMe recovery passed at start-up "     \
      "(writes a crash cancelled).",                                                               \
      NONE)                                                                                        \
    X(DRAM_MAPPED, GAUGE, "kvtier_dram_arena_mapped_bytes",                                        \
      "Bytes of the DRAM tier's main region its arena has taken so far, kept in memory for reuse " \
      "and never given back (the arenas' memfds: kvtier_zero_copy_resident_bytes).",               \
      NONE)                                                                                        \
    X(DRAM_TRIMS, COUNTER, "kvtier_dram_trims_total",                                              \
      "Times a DRAM arena gave its freed pages back because the tier's footprint passed "          \
      "dram-bytes or no client maps it any more.",                                                 \
      NONE)                                                                                        \
    X(DRAM_TRIMMED, COUNTER, "kvtier_dram_trimmed_bytes_total",                                    \
      "Bytes of freed pages the DRAM arenas gave back to the kernel (kvtier_dram_trims_total).",   \
      NONE)                                                                                        \
    X(DRAM_KEPT, GAUGE, "kvtier_dram_kept_bytes",                                                  \
      "Bytes of freed DRAM blocks kept in memory for reuse: the arenas' (given back past "         \
      "dram-bytes) and the main region's (never given back).",                                     \
      NONE)                                                                                        \
    X(ZC_MAPS, COUNTER, "kvtier_zero_copy_maps_total",                                             \
      "MAP requests granted to local clients, by tier (a memfd for DRAM, an IPC handle for HBM).", \
      MAP)                                                                                         \
    X(ZC_ARENAS, GAUGE, "kvtier_zero_copy_arenas",                                                 \
      "Namespaces with a DRAM arena of their own (zero-copy-arenas).", NONE)                       \
    X(ZC_RESIDENT, GAUGE, "kvtier_zero_copy_resident_bytes",                                       \
      "Bytes the DRAM arenas' memfds hold in memory (their blocks, freed pages not yet punched, "  \
      "and what clients touched outside their blocks until it is punched).",                       \
      NONE)                                                                                        \
    X(ZC_PUNCHED, COUNTER, "kvtier_zero_copy_punched_bytes_total",                                 \
      "Bytes of the DRAM arenas' memfds that clients made resident outside any live block, "       \
      "punched out by the daemon.",                                                                \
      NONE)                                                                                        \
    X(ZC_SCRIBBLES, COUNTER, "kvtier_zero_copy_scribbles_total",                                   \
      "Committed zero-copy pages found changed as they left DRAM (a client wrote over them "       \
      "through its mapping; zero-copy-checksum): dropped, never demoted or served.",               \
      NONE)                                                                                        \
    X(ZC_SEALS, COUNTER, "kvtier_zero_copy_seals_total",                                           \
      "Committed zero-copy pages whose checksum the daemon took by reading them (a COMMIT "        \
      "without sums: the two-step API, raw clients; zero-copy-checksum).",                         \
      NONE)                                                                                        \
    X(ZC_CLIENT_SUMS, COUNTER, "kvtier_zero_copy_client_sums_total",                               \
      "Committed zero-copy pages sealed with the checksum their client sent with COMMIT "          \
      "(libkvtier's PUT hashes as it copies): the daemon did not read them.",                      \
      NONE)                                                                                        \
    X(TENANT_QUOTA, GAUGE, "kvtier_tenant_quota_bytes",                                            \
      "Bytes one namespace (tenant) may hold in each tier (tenant-<tier>-bytes); 0 for none.",     \
      TIER)                                                                                        \
    X(TENANT_REFUSALS, COUNTER, "kvtier_tenant_quota_refusals_total",                              \
      "Writes, copies and adoptions a tier refused because their namespace was at its quota "      \
      "there (tenant-<tier>-bytes).",                                                              \
      TIER)                                                                                        \
    X(ZC_PAGES, COUNTER, "kvtier_zero_copy_pages_total",                                           \
      "Pages a local client read (GET with LOCATE) or wrote (RESERVE) through its mapping.",       \
      ZC_OP)                                                                                       \
    X(RESERVATIONS, COUNTER, "kvtier_reservations_total",                                          \
      "Zero-copy reservations ended, by outcome: committed, aborted, expired (reserve-ms), "       \
      "closed (the connection went).",                                                             \
      RESV)                                                                                        \
    X(SECONDS_SAVED, COUNTER, "kvtier_prefill_seconds_saved_total",                                \
      "Prefill seconds the matched pages held in each tier saved, by the cost model "              \
      "(policy-model on policy-hw): recompute time avoided minus the load from that tier, per "    \
      "MATCH, never below 0.",                                                                     \
      STORE)                                                                                       \
    X(NS_SECONDS_SAVED, COUNTER, "kvtier_namespace_prefill_seconds_saved_total",                   \
      "The same, by the model and adapter the clients' HELLO named; past metrics-namespaces "      \
      "distinct pairs the rest count under model=\"_other\".",                                     \
      NS)                                                                                          \
    X(BUILD_INFO, GAUGE, "kvtier_build_info",                                                      \
      "1, labelled with the daemon's version, the commit it was built from and whether it has "    \
      "the CUDA backend.",                                                                         \
      BUILD)                                                                                       \
    X(REMOTE_UP, GAUGE, "kvtier_remote_up",                                                        \
      "1 while the connection to the remote server is up (handshake answered), else 0; 0 also "    \
      "with no remote tier (its kvtier_tier_capacity_bytes is 0 then).",                           \
      NONE)                                                                                        \
    X(PROC_START, GAUGE, "process_start_time_seconds",                                             \
      "Start time of the process since the Unix epoch, in seconds.", NONE)                         \
    X(PROC_CPU, COUNTER, "process_cpu_seconds_total",                                              \
      "User and system CPU time spent, in seconds.", NONE)                                         \
    X(PROC_RSS, GAUGE, "process_resident_memory_bytes", "Resident memory size, in bytes.", NONE)   \
    X(PROC_VSIZE, GAUGE, "process_virtual_memory_bytes", "Virtual memory size, in bytes.", NONE)   \
    X(PROC_FDS, GAUGE, "process_open_fds", "Open file descriptors.", NONE)                         \
    X(PROC_MAX_FDS, GAUGE, "process_max_fds",                                                      \
      "The limit on open file descriptors (RLIMIT_NOFILE).", NONE)                                 \
    X(MRC_HIT_RATIO, GAUGE, "kvtier_mrc_hit_ratio",                                                \
      "Estimated share of the looked-up tokens the tier would have served at scale x its size, "   \
      "the other tiers as they are, under LRU (the miss-ratio curve, docs/server.md).",            \
      TIER_SCALE)                                                                                  \
    X(MRC_PREFILL_SAVED, GAUGE, "kvtier_mrc_prefill_saved_seconds",                                \
      "Estimated prefill seconds the tier's hits since start would have saved at scale x its "     \
      "size (its hit tokens at that size / prefill_tokens_per_s).",                                \
      TIER_SCALE)                                                                                  \
    X(MRC_HIERARCHY, GAUGE, "kvtier_mrc_hierarchy_hit_ratio",                                      \
      "Estimated share of the looked-up tokens all the tiers together serve at their sizes, "      \
      "under LRU.",                                                                                \
      NONE)                                                                                        \
    X(MRC_SAMPLING, GAUGE, "kvtier_mrc_sampling_ratio",                                            \
      "Share of the pages the miss-ratio curve tracks now (mrc-sample-rate, lowered when more "    \
      "than mrc-max-keys would be tracked).",                                                      \
      NONE)                                                                                        \
    X(MRC_PAGES, GAUGE, "kvtier_mrc_tracked_pages", "Pages the miss-ratio curve tracks now.",      \
      NONE)                                                                                        \
    X(MRC_BYTES, GAUGE, "kvtier_mrc_bytes", "Memory held by the miss-ratio curve's estimator.",    \
      NONE)

typedef enum {
#define KVT_X(id, type, name, help, lbl) KVT_M_##id,
    KVT_METRIC_LIST(KVT_X)
#undef KVT_X
        KVT_M_COUNT
} kvt_metric_id_t;

#define KVT_HIST_BUCKETS 18

typedef struct kvt_hist {
    uint64_t buckets[KVT_HIST_BUCKETS]; /* non-cumulative; the last is +Inf */
    uint64_t count;
    double sum; /* seconds */
} kvt_hist_t;

typedef struct kvt_metrics kvt_metrics_t;

/*
 * Bytes per tenant and tier, the one family whose label values are not a fixed list: tenant is
 * the namespace's seed in hex (as in the daemon's log lines and its memfds' names,
 * kvtier-ns-<seed>). Its cardinality is bounded: the KVT_TENANT_TOP namespaces holding the most in
 * each tier, refreshed with the other gauges (store.c); the rest are left out.
 */
#define KVT_TENANT_TOP  16
#define KVT_TENANT_ROWS (KVT_TENANT_TOP * KVT_TIER_COUNT)
#define KVT_TENANT_NAME "kvtier_tenant_used_bytes"
#define KVT_TENANT_HELP                                                                            \
    "Bytes a namespace (tenant, by its seed) holds in a tier: the 16 holding the most in each "    \
    "tier (tenant-<tier>-bytes caps it)."
typedef struct kvt_metric_tenant {
    uint64_t ns_seed;
    uint64_t bytes;
    uint8_t tier;
} kvt_metric_tenant_t;
/* Replaces the per-tenant rows with rows[0 .. n) (n at most KVT_TENANT_ROWS). */
void kvt__metrics_tenants(kvt_metrics_t *m, const kvt_metric_tenant_t *rows, size_t n);

/*
 * The remote tier's counters per server node, label node="host:port" (the single server, or each
 * cluster node the tier knows: at most KVT_REMOTE_NODE_ROWS, never forgotten, so the series are
 * bounded): /metrics only. The door (store.c) reads the n rows from the tier with the other
 * gauges and hands them over here, as it does the tenants' rows.
 */
#define KVT_REMOTE_NODE_ROWS 64
void kvt__metrics_remote_nodes(kvt_metrics_t *m, const kvt_tier_remote_node_stats_t *rows,
                               size_t n);

int kvt__metrics_create(kvt_metrics_t **out);
void kvt__metrics_destroy(kvt_metrics_t *m);

/* The series index of a label value: tier id, reason, op, kvt__pair(from, to), ... */
static inline unsigned kvt__pair(unsigned from, unsigned to)
{
    return from * KVT_TIER_COUNT + to;
}
static inline unsigned kvt__tier_io(unsigned tier, int write)
{
    return tier * 2 + (write ? 1 : 0);
}
/* The sizes a miss-ratio curve is read at: 0.25, 0.5, 1, 2 and 4 times a tier's (mrc.c). */
#define KVT_MRC_SCALES 5
static inline unsigned kvt__tier_scale(unsigned tier, unsigned scale)
{
    return tier * KVT_MRC_SCALES + scale;
}
/* The tiers (bit i: tier i) whose TIER_SCALE series are shown; none until set. */
void kvt__metrics_tiers(kvt_metrics_t *m, unsigned mask);

/* The devices (bit i: device i, i < 16) with an HBM pool, whose DEVICE series are shown. */
void kvt__metrics_devices(kvt_metrics_t *m, unsigned mask);
/* The event loops (at most 16), whose LOOP series are shown; and a table of counters for each
 * (made once: a later call only sets n). Returns 0 or KVT_ENOMEM (no loop tables then). */
int kvt__metrics_loops(kvt_metrics_t *m, unsigned n);
/* Loop i's own table (NULL: none): counters and histograms only (add, observe, ns_add), written by
 * loop i's thread under s->lock shared or by any thread under it for writing, and merged into m by
 * kvt__metrics_process under it for writing (a scrape: /metrics and STATS). Freed with m. */
kvt_metrics_t *kvt__metrics_loop(kvt_metrics_t *m, unsigned i);
void kvt__metric_add(kvt_metrics_t *m, kvt_metric_id_t id, unsigned series, double v);
void kvt__metric_set(kvt_metrics_t *m, kvt_metric_id_t id, unsigned series, double v);
void kvt__metric_observe(kvt_metrics_t *m, kvt_metric_id_t id, unsigned series, uint64_t ns);
double kvt__metric_get(const kvt_metrics_t *m, kvt_metric_id_t id, unsigned series);
const kvt_hist_t *kvt__metric_hist(const kvt_metrics_t *m, kvt_metric_id_t id, unsigned series);

/*
 * Every counter and gauge series, in table order, by its STATS name (histograms and the
 * per-namespace series, whose labels are client-chosen strings, are /metrics' only): the metric's
 * name without "kvtier_" and "_total", then its label values joined by "_" (hit_tokens_dram,
 * blocks_moved_dram_nvme, put_pages_stored); a per-tier metric named kvtier_tier_* puts the tier
 * first instead (dram_used_bytes); kvtier_build_info is build_info, its labels left out. Values are
 * truncated to integers, but a gauge named *_ratio is sent in parts per million, "_ppm" added to
 * its name (mrc_hit_ratio_dram_2_ppm). cb returns non-zero to stop; that value is returned, else 0.
 */
int kvt__metrics_each(const kvt_metrics_t *m, int (*cb)(void *arg, const char *name, uint64_t v),
                      void *arg);

/*
 * The per-namespace series (KVT_LBL_NS). Their label is the model and adapter a HELLO named (the
 * tenant salt is a secret and the page size an engine detail: neither is shown); the first limit
 * distinct pairs get a series each for the daemon's life, every later one shares
 * model="_other",adapter="" (slot 0), so that clients inventing names cannot grow a scrape.
 * Returns the slot to pass to kvt__metric_ns_add; 0 also when memory is short.
 */
void kvt__metrics_ns_limit(kvt_metrics_t *m, unsigned limit);
unsigned kvt__metrics_ns_slot(kvt_metrics_t *m, const char *model, const char *adapter);
void kvt__metric_ns_add(kvt_metrics_t *m, kvt_metric_id_t id, unsigned slot, double v);

/* At scrape time: merges the loops' tables into m (kvt__metrics_loop), then reads the process_*
 * gauges from /proc/self (a scrape shows them fresh). A value it cannot read keeps its last one. */
void kvt__metrics_process(kvt_metrics_t *m);

/* Renders every metric in the Prometheus text exposition format (0.0.4). The string is
 * malloc'ed; the caller frees it. Returns 0 or KVT_ENOMEM. */
int kvt__metrics_render(const kvt_metrics_t *m, char **out, size_t *len);

#endif
