/*
 * policy_test.h: what the tests look at inside the policy engine beyond policy.h. Not
 * installed; the daemon and the replay do not use it.
 */
#ifndef KVT_POLICY_TEST_H
#define KVT_POLICY_TEST_H

#include "policy.h"

/* Entries in tier t's victim heap now, stale ones included (0 for a tier out of range). */
size_t kvt__policy_heap_len(const kvt_policy_t *p, kvt_tier_id_t t);

#endif
