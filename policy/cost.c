/*
 * cost.c: the cost model. It owns the built-in model and hardware profiles, the key=value
 * parser for custom ones, and the three formulas the policy and the replay price everything
 * with: KV bytes of a run of tokens, FLOPs (and seconds) to recompute it at its depth, and
 * seconds to load it from a tier. docs/policy.md gives the sources of every number below and
 * derives the formulas.
 */
#include "policy.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Numbers from each model's published config.json (see docs/policy.md). */
static const kvt_model_profile_t builtin_models[] = {
    {"llama-3-8b", 32, 8, 128, 2, 32, 4096, 8.03e9},
    {"llama-3-70b", 80, 8, 128, 2, 64, 8192, 70.6e9},
    {"qwen2.5-7b", 28, 4, 128, 2, 28, 3584, 7.61e9},
    {"mixtral-8x22b", 56, 8, 128, 2, 48, 6144, 39.0e9},
};

/* H200 SXM: 989 TFLOP/s dense BF16, 4.8 TB/s HBM3e per GPU; 50% of peak reached in prefill.
 * DRAM->HBM over PCIe Gen5 x16 (~50 GB/s per GPU achieved of 64 raw), NVMe from the node's
 * eight U.2 drives (~6.5 GB/s each), remote Valkey/Redis over the storage network. Queue depths
 * (requests served at once): NVMe 32 per drive (kvtierd's io_uring ring per drive), remote 16
 * round trips in flight per node (the pipelined connections of the remote tier); DRAM and HBM
 * copies do not queue at this grain. */
static const kvt_hw_profile_t builtin_hw[] = {
    {"h200-node",
     8 * 989e12 * 0.5,
     {0, 8 * 4.8e12, 8 * 50e9, 8 * 6.5e9, 10e9},
     {0, 0, 10e-6, 100e-6, 500e-6},
     {0, 0, 0, 8 * 32, 16}},
    {"h200-1gpu",
     989e12 * 0.5,
     {0, 4.8e12, 50e9, 6.5e9, 1.25e9},
     {0, 0, 10e-6, 100e-6, 1e-3},
     {0, 0, 0, 32, 4}},
};

static const char *const model_names[] = {"llama-3-8b", "llama-3-70b", "qwen2.5-7b",
                                          "mixtral-8x22b", NULL};
static const char *const hw_names[] = {"h200-node", "h200-1gpu", NULL};

const char *const *kvt_model_profile_names(void)
{
    return model_names;
}

const char *const *kvt_hw_profile_names(void)
{
    return hw_names;
}

int kvt_model_profile_get(const char *name, kvt_model_profile_t *out)
{
    if (!name || !out)
        return KVT_EINVAL;
    for (size_t i = 0; i < KVT_ARRAY_LEN(builtin_models); i++) {
        if (strcmp(builtin_models[i].name, name) == 0) {
            *out = builtin_models[i];
            return 0;
        }
    }
    return KVT_ENOENT;
}

int kvt_hw_profile_get(const char *name, kvt_hw_profile_t *out)
{
    if (!name || !out)
        return KVT_EINVAL;
    for (size_t i = 0; i < KVT_ARRAY_LEN(builtin_hw); i++) {
        if (strcmp(builtin_hw[i].name, name) == 0) {
            *out = builtin_hw[i];
            return 0;
        }
    }
    return KVT_ENOENT;
}

int kvt_model_profile_check(const kvt_model_profile_t *m)
{
    if (!m || m->name[0] == '\0' || memchr(m->name, '\0', sizeof(m->name)) == NULL)
        return KVT_EINVAL;
    if (m->layers == 0 || m->layers > 4096 || m->kv_heads == 0 || m->kv_heads > 4096 ||
        m->head_dim == 0 || m->head_dim > 4096 || m->bytes_per_elem == 0 || m->bytes_per_elem > 8 ||
        m->q_heads == 0 || m->q_heads > 4096 || m->hidden == 0)
        return KVT_EINVAL;
    if (m->q_heads % m->kv_heads != 0)
        return KVT_EINVAL;
    if (!(m->params >= 1e6 && m->params <= 1e14))
        return KVT_EINVAL;
    return 0;
}

int kvt_hw_profile_check(const kvt_hw_profile_t *hw)
{
    if (!hw || hw->name[0] == '\0' || memchr(hw->name, '\0', sizeof(hw->name)) == NULL)
        return KVT_EINVAL;
    if (!(hw->prefill_flops >= 1e9 && hw->prefill_flops <= 1e20))
        return KVT_EINVAL;
    for (int t = KVT_TIER_HBM; t < KVT_TIER_COUNT; t++) {
        if (!(hw->bw[t] >= 0 && hw->bw[t] <= 1e15) ||
            !(hw->latency_s[t] >= 0 && hw->latency_s[t] <= 60) || hw->qd[t] > 1000000)
            return KVT_EINVAL;
    }
    if (hw->bw[KVT_TIER_HBM] <= 0)
        return KVT_EINVAL;
    return 0;
}

uint64_t kvt_cost_kv_bytes(const kvt_model_profile_t *m, uint64_t ntokens)
{
    return 2ull * m->layers * ntokens * m->kv_heads * m->head_dim * m->bytes_per_elem;
}

double kvt_cost_recompute_flops(const kvt_model_profile_t *m, uint64_t first, uint64_t ntokens)
{
    double t = (double)ntokens;
    /* sum over p in [first, first + t) of (p + 1) = t * first + t * (t + 1) / 2 */
    double ctx = t * (double)first + t * (t + 1) / 2;
    double attn = 4.0 * m->layers * (double)m->q_heads * m->head_dim * ctx;
    return 2.0 * m->params * t + attn;
}

double kvt_cost_recompute_s(const kvt_model_profile_t *m, const kvt_hw_profile_t *hw,
                            uint64_t first, uint64_t ntokens)
{
    return kvt_cost_recompute_flops(m, first, ntokens) / hw->prefill_flops;
}

double kvt_cost_load_s(const kvt_hw_profile_t *hw, kvt_tier_id_t tier, uint64_t bytes)
{
    if (bytes == 0)
        return 0;
    if (tier <= KVT_TIER_NONE || tier >= KVT_TIER_COUNT || hw->bw[tier] <= 0)
        return INFINITY;
    return hw->latency_s[tier] + (double)bytes / hw->bw[tier];
}

double kvt_cost_load_queued_s(const kvt_hw_profile_t *hw, kvt_tier_id_t tier, uint64_t bytes,
                              uint32_t queued)
{
    double s = kvt_cost_load_s(hw, tier, bytes);
    if (bytes == 0 || !isfinite(s) || hw->qd[tier] == 0)
        return s;
    return s + hw->latency_s[tier] * (double)(queued / hw->qd[tier]);
}

/* ---- key=value parsing --------------------------------------------------------------------- */

typedef int (*kv_fn)(void *dst, const char *key, const char *val);

static int parse_double(const char *s, double *out)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end != '\0' || !isfinite(v))
        return KVT_EINVAL;
    *out = v;
    return 0;
}

static int parse_u32(const char *s, uint32_t *out)
{
    double v;
    if (parse_double(s, &v) < 0 || v < 0 || v > UINT32_MAX || v != floor(v))
        return KVT_EINVAL;
    *out = (uint32_t)v;
    return 0;
}

static int set_name(char *dst, const char *val)
{
    size_t n = strlen(val);
    if (n == 0 || n >= KVT_PROFILE_NAME_MAX)
        return KVT_EINVAL;
    memcpy(dst, val, n + 1);
    return 0;
}

static int model_kv(void *dst, const char *key, const char *val)
{
    kvt_model_profile_t *m = dst;
    if (strcmp(key, "name") == 0)
        return set_name(m->name, val);
    if (strcmp(key, "base") == 0) {
        kvt_model_profile_t b;
        if (kvt_model_profile_get(val, &b) < 0)
            return KVT_EINVAL;
        char name[KVT_PROFILE_NAME_MAX];
        memcpy(name, m->name, sizeof(name));
        *m = b;
        if (name[0])
            memcpy(m->name, name, sizeof(name));
        return 0;
    }
    if (strcmp(key, "params") == 0)
        return parse_double(val, &m->params);
    static const struct {
        const char *key;
        size_t off;
    } u32s[] = {
        {"layers", offsetof(kvt_model_profile_t, layers)},
        {"kv_heads", offsetof(kvt_model_profile_t, kv_heads)},
        {"head_dim", offsetof(kvt_model_profile_t, head_dim)},
        {"bytes_per_elem", offsetof(kvt_model_profile_t, bytes_per_elem)},
        {"q_heads", offsetof(kvt_model_profile_t, q_heads)},
        {"hidden", offsetof(kvt_model_profile_t, hidden)},
    };
    for (size_t i = 0; i < KVT_ARRAY_LEN(u32s); i++) {
        if (strcmp(key, u32s[i].key) == 0)
            return parse_u32(val, (uint32_t *)(void *)((char *)m + u32s[i].off));
    }
    return KVT_EINVAL;
}

static int hw_kv(void *dst, const char *key, const char *val)
{
    kvt_hw_profile_t *hw = dst;
    if (strcmp(key, "name") == 0)
        return set_name(hw->name, val);
    if (strcmp(key, "base") == 0) {
        kvt_hw_profile_t b;
        if (kvt_hw_profile_get(val, &b) < 0)
            return KVT_EINVAL;
        char name[KVT_PROFILE_NAME_MAX];
        memcpy(name, hw->name, sizeof(name));
        *hw = b;
        if (name[0])
            memcpy(hw->name, name, sizeof(name));
        return 0;
    }
    if (strcmp(key, "prefill_flops") == 0)
        return parse_double(val, &hw->prefill_flops);
    for (int t = KVT_TIER_HBM; t < KVT_TIER_COUNT; t++) {
        const char *tn = kvt_tier_name((kvt_tier_id_t)t);
        size_t n = strlen(tn);
        if (strncmp(key, tn, n) != 0 || key[n] != '_')
            continue;
        if (strcmp(key + n, "_bw") == 0)
            return parse_double(val, &hw->bw[t]);
        if (strcmp(key + n, "_qd") == 0)
            return parse_u32(val, &hw->qd[t]);
        if (strcmp(key + n, "_latency_us") == 0) {
            double us;
            if (parse_double(val, &us) < 0)
                return KVT_EINVAL;
            hw->latency_s[t] = us * 1e-6;
            return 0;
        }
    }
    return KVT_EINVAL;
}

static void trim(char **s, char **e)
{
    while (*s < *e && isspace((unsigned char)**s))
        (*s)++;
    while (*e > *s && isspace((unsigned char)(*e)[-1]))
        (*e)--;
}

/* Applies every key=value line of text to dst through fn. */
static int parse_kv(const char *text, void *dst, kv_fn fn)
{
    int lineno = 0;
    const char *p = text;
    while (*p) {
        const char *nl = strchr(p, '\n');
        const char *end = nl ? nl : p + strlen(p);
        lineno++;
        char line[512];
        size_t len = (size_t)(end - p);
        if (len >= sizeof(line)) {
            kvt_log(KVT_LOG_ERROR, "profile line %d: too long", lineno);
            return KVT_EINVAL;
        }
        memcpy(line, p, len);
        line[len] = '\0';
        char *hash = strchr(line, '#');
        if (hash)
            *hash = '\0';
        char *s = line, *e = line + strlen(line);
        trim(&s, &e);
        if (s < e) {
            char *eq = memchr(s, '=', (size_t)(e - s));
            if (!eq) {
                kvt_log(KVT_LOG_ERROR, "profile line %d: expected key=value", lineno);
                return KVT_EINVAL;
            }
            char *ks = s, *ke = eq, *vs = eq + 1, *ve = e;
            trim(&ks, &ke);
            trim(&vs, &ve);
            *ke = '\0';
            *ve = '\0';
            if (fn(dst, ks, vs) < 0) {
                kvt_log(KVT_LOG_ERROR, "profile line %d: bad key or value '%s'", lineno, ks);
                return KVT_EINVAL;
            }
        }
        p = nl ? nl + 1 : end;
    }
    return 0;
}

int kvt_model_profile_parse(const char *text, kvt_model_profile_t *out)
{
    if (!text || !out)
        return KVT_EINVAL;
    kvt_model_profile_t m;
    memset(&m, 0, sizeof(m));
    if (parse_kv(text, &m, model_kv) < 0)
        return KVT_EINVAL;
    if (kvt_model_profile_check(&m) < 0) {
        kvt_log(KVT_LOG_ERROR, "model profile '%s': incomplete or out of range", m.name);
        return KVT_EINVAL;
    }
    *out = m;
    return 0;
}

int kvt_hw_profile_parse(const char *text, kvt_hw_profile_t *out)
{
    if (!text || !out)
        return KVT_EINVAL;
    kvt_hw_profile_t hw;
    memset(&hw, 0, sizeof(hw));
    if (parse_kv(text, &hw, hw_kv) < 0)
        return KVT_EINVAL;
    if (kvt_hw_profile_check(&hw) < 0) {
        kvt_log(KVT_LOG_ERROR, "hardware profile '%s': incomplete or out of range", hw.name);
        return KVT_EINVAL;
    }
    *out = hw;
    return 0;
}
