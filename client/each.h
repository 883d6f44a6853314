/*
 * each.h: libkvtier's pipelined PUT of many independent one-page sequences through the zero-copy
 * mapping, for the keyed calls (keys.c's kvt_keys_put; internal to client/).
 */
#ifndef KVT_CLIENT_EACH_H
#define KVT_CLIENT_EACH_H

#include <stdint.h>

#include "kvtier.h"

/* Reservations one group holds at once: under the daemon's max-reservations (64 by default), so
 * that a group's RESERVEs all get room when nothing else of the connection's is held. */
#define KVT_EACH_GROUP 32u

/*
 * n independent PUTs, one page each: sequence i is tokens[i * ntokens, (i + 1) * ntokens) (one
 * whole page), its block blocks[i] (block_bytes). c must be mapped (kvt_client_zero_copy). Each
 * sequence gets what kvt_client_put of it would give, in res[i] and status[i] (0 or the daemon's
 * error for it), but in groups of KVT_EACH_GROUP with two round trips a group: their RESERVEs
 * pipelined, a memcpy each into the reserved room, their COMMITs pipelined. Sequences RESERVE
 * gave no room are probed (MATCH PROBE, pipelined: one round trip more): those that hold no
 * bytes go by a socket PUT each, as kvt_client_put sends them. Returns 0, or a transport error
 * (the connection is then broken, and the statuses of the group it broke in and of those after
 * it are KVT_CLIENT_ECLOSED).
 */
int kvt__put_each_mapped(kvt_client_t *c, const uint32_t *tokens, uint32_t ntokens, uint32_t n,
                         const void *const *blocks, kvt_client_put_t *res, int *status);

#endif
