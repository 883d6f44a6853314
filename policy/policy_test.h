/*
 * policy_test.h: what the tests look at inside the policy engine beyond policy.h. Not
 * installed; the daemon and the replay do not use it.
 */
#ifndef KVT_POLICY_TEST_H
#define KVT_POLICY_TEST_H

#include "policy.h"

/* Entries in tier t's victim heap now, stale ones included (0 for a tier out of range). */
size_t kvt__policy_heap_len(const kvt_policy_t *p, kvt_tier_id_t t);

/* What the cost policy knows of its experts when it chooses one (policy.c, choose_expert): each
 * copy's decayed seconds, and per expert, over the sampled uses while it ordered the victims,
 * the real hierarchy's decayed seconds, its copy's, and their decayed count. Arrays of nexp. */
typedef struct kvt__policy_experts {
    int nexp;
    const double *copy_s, *held_real, *held_copy, *held_n;
} kvt__policy_experts_t;

/* The expert to order the victims, cur ordering them now: another takes over when its copy
 * costs 1 % less than cur's, and still does once each copy's seconds are corrected by its real
 * over its copy's seconds while in charge (docs/policy.md, "Experts"). */
int kvt__policy_pick_expert(const kvt__policy_experts_t *x, int cur);

#endif
