/*
 * bench_stats.h: the order statistics the benchmarks report (bench_tiers, bench_remote,
 * bench_radix), in one place so that every figure called a median is the same median.
 */
#ifndef KVT_BENCH_STATS_H
#define KVT_BENCH_STATS_H

#include <stdlib.h>

/* qsort order of doubles, ascending. */
static inline int bench_cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* The median of v[0 .. n-1] (sorts v); the mean of the middle two for even n. */
static inline double bench_median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof(*v), bench_cmp_double);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

#endif
