/*
 * bench_remote.h: the remote-tier half of bench_tiers (bench/bench_remote.c, owned by the remote
 * tier work). Measures the remote tier's write and read bandwidth for each block size next to
 * redis-benchmark SET/GET with the same value size against the same server (or cluster),
 * printing one JSON object per (block size, op) line to stdout. redis is "HOST:PORT", or NULL to
 * start a throwaway redis-server. Returns 0, or a negative KVT_E* code.
 */
#ifndef KVT_BENCH_REMOTE_H
#define KVT_BENCH_REMOTE_H

#include <stddef.h>

int bench_remote_run(const char *redis, const size_t *block_bytes, int nsizes);

/* The same against a Redis Cluster it forms itself (3 primaries, 3 replicas on loopback), the
 * tier in cluster mode beside redis-benchmark --cluster, one connection per primary each.
 * Returns 0, or a negative KVT_E* code (KVT_EUNAVAIL: the cluster did not form). */
int bench_remote_cluster_run(const size_t *block_bytes, int nsizes);

#endif
