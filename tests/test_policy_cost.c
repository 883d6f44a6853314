/*
 * test_policy_cost.c: the cost model against values computed by hand (the arithmetic is in the
 * comments), the built-in profiles, and the key=value profile parser, including what it refuses.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <string.h>

#include "policy.h"

static void near(double got, double want, double rel)
{
    cr_assert(fabs(got - want) <= rel * fabs(want), "got %.17g, want %.17g", got, want);
}

Test(policy_cost, kv_bytes_by_hand)
{
    kvt_model_profile_t m;
    cr_assert_eq(kvt_model_profile_get("llama-3-70b", &m), 0);
    /* 2 x 80 layers x 16 tokens x 8 kv heads x 128 dims x 2 bytes */
    cr_assert_eq(kvt_cost_kv_bytes(&m, 16), 5242880ull);
    cr_assert_eq(kvt_model_profile_get("llama-3-8b", &m), 0);
    /* 2 x 32 x 1 x 8 x 128 x 2 = 131072 per token */
    cr_assert_eq(kvt_cost_kv_bytes(&m, 1), 131072ull);
    cr_assert_eq(kvt_model_profile_get("qwen2.5-7b", &m), 0);
    /* 2 x 28 x 16 x 4 x 128 x 2 */
    cr_assert_eq(kvt_cost_kv_bytes(&m, 16), 917504ull);
    cr_assert_eq(kvt_model_profile_get("mixtral-8x22b", &m), 0);
    /* 2 x 56 x 1 x 8 x 128 x 2 */
    cr_assert_eq(kvt_cost_kv_bytes(&m, 1), 229376ull);
    cr_assert_eq(kvt_cost_kv_bytes(&m, 0), 0ull);
}

Test(policy_cost, recompute_flops_by_hand)
{
    kvt_model_profile_t m;
    cr_assert_eq(kvt_model_profile_get("llama-3-8b", &m), 0);
    /* first page: linear 2 x 8.03e9 x 16 = 2.5696e11; attention 4 x 32 layers x 32 heads x
     * 128 dims = 524288 per attended token, times sum_{p=0}^{15} (p + 1) = 136 -> 71303168 */
    near(kvt_cost_recompute_flops(&m, 0, 16), 2.5696e11 + 71303168.0, 1e-12);
    /* the page at tokens [1000, 1016): sum of (p + 1) = 16 x 1000 + 136 = 16136 */
    near(kvt_cost_recompute_flops(&m, 1000, 16), 2.5696e11 + 524288.0 * 16136, 1e-12);
    /* deeper costs more, linearly in the depth */
    double d1 = kvt_cost_recompute_flops(&m, 1000, 16) - kvt_cost_recompute_flops(&m, 0, 16);
    double d2 = kvt_cost_recompute_flops(&m, 2000, 16) - kvt_cost_recompute_flops(&m, 0, 16);
    near(d2, 2 * d1, 1e-12);
    /* splitting a run does not change its total */
    near(kvt_cost_recompute_flops(&m, 0, 32),
         kvt_cost_recompute_flops(&m, 0, 16) + kvt_cost_recompute_flops(&m, 16, 16), 1e-12);
}

Test(policy_cost, seconds_by_hand)
{
    kvt_model_profile_t m;
    kvt_hw_profile_t hw;
    cr_assert_eq(kvt_model_profile_get("llama-3-70b", &m), 0);
    cr_assert_eq(kvt_hw_profile_get("h200-node", &hw), 0);
    /* 8 GPUs x 989e12 x 0.5 = 3.956e15 FLOP/s */
    near(hw.prefill_flops, 3.956e15, 1e-12);
    /* 2 x 70.6e9 x 16 + 4 x 80 x 64 x 128 x 136 = 2.2592e12 + 356515840 */
    near(kvt_cost_recompute_s(&m, &hw, 0, 16), (2.2592e12 + 356515840.0) / 3.956e15, 1e-12);
    /* DRAM -> HBM: 10 us + 5242880 B / 400e9 B/s */
    near(kvt_cost_load_s(&hw, KVT_TIER_DRAM, 5242880), 10e-6 + 5242880 / 400e9, 1e-12);
    /* NVMe: 100 us + bytes / 52e9 */
    near(kvt_cost_load_s(&hw, KVT_TIER_NVME, 5242880), 100e-6 + 5242880 / 52e9, 1e-12);
    cr_assert_eq(kvt_cost_load_s(&hw, KVT_TIER_NVME, 0), 0.0);
    cr_assert(isinf(kvt_cost_load_s(&hw, KVT_TIER_NONE, 1)));
    /* for a 70B model the local tiers load even a lone page faster than recomputing it
     * (0.571 ms); the remote tier only once its 500 us latency is shared by a few pages:
     * 0.5 ms + 0.524 ms for one page, but 0.524 ms per page on bandwidth alone */
    double redo = kvt_cost_recompute_s(&m, &hw, 0, 16);
    for (int t = KVT_TIER_HBM; t <= KVT_TIER_NVME; t++)
        cr_assert_lt(kvt_cost_load_s(&hw, (kvt_tier_id_t)t, 5242880), redo, "tier %d", t);
    cr_assert_gt(kvt_cost_load_s(&hw, KVT_TIER_REMOTE, 5242880), redo);
    cr_assert_lt(5242880 / hw.bw[KVT_TIER_REMOTE], redo);
}

Test(policy_cost, small_model_recomputes_cheaper_than_remote)
{
    /* The case where dropping beats demoting: Qwen2.5-7B on one H200, a shallow page.
     * recompute: 2 x 7.61e9 x 16 / 4.945e14 = 0.493 ms; remote: 1 ms + 917504 / 1.25e9 = 1.73 ms;
     * NVMe: 0.1 ms + 917504 / 6.5e9 = 0.24 ms. */
    kvt_model_profile_t m;
    kvt_hw_profile_t hw;
    cr_assert_eq(kvt_model_profile_get("qwen2.5-7b", &m), 0);
    cr_assert_eq(kvt_hw_profile_get("h200-1gpu", &hw), 0);
    uint64_t page = kvt_cost_kv_bytes(&m, 16);
    double redo = kvt_cost_recompute_s(&m, &hw, 0, 16);
    near(redo, (2 * 7.61e9 * 16 + 4.0 * 28 * 28 * 128 * 136) / 4.945e14, 1e-12);
    cr_assert_gt(kvt_cost_load_s(&hw, KVT_TIER_REMOTE, page), redo);
    cr_assert_lt(kvt_cost_load_s(&hw, KVT_TIER_NVME, page), redo);
}

Test(policy_cost, builtin_names)
{
    const char *const *n = kvt_model_profile_names();
    int count = 0;
    for (; *n; n++, count++) {
        kvt_model_profile_t m;
        cr_assert_eq(kvt_model_profile_get(*n, &m), 0, "%s", *n);
        cr_assert_eq(kvt_model_profile_check(&m), 0, "%s", *n);
        cr_assert_str_eq(m.name, *n);
    }
    cr_assert_eq(count, 4);
    for (n = kvt_hw_profile_names(); *n; n++) {
        kvt_hw_profile_t hw;
        cr_assert_eq(kvt_hw_profile_get(*n, &hw), 0, "%s", *n);
        cr_assert_eq(kvt_hw_profile_check(&hw), 0, "%s", *n);
    }
    kvt_model_profile_t m;
    cr_assert_eq(kvt_model_profile_get("gpt-5", &m), KVT_ENOENT);
    cr_assert_eq(kvt_model_profile_get(NULL, &m), KVT_EINVAL);
}

Test(policy_cost, parse_custom_model)
{
    kvt_model_profile_t m;
    const char *text = "# a small custom model\n"
                       "name = tiny\n"
                       "layers=4\n kv_heads = 2\nhead_dim=64\nbytes_per_elem=2\n"
                       "q_heads=8\nhidden=512\nparams=1.5e8   # active\n\n";
    cr_assert_eq(kvt_model_profile_parse(text, &m), 0);
    cr_assert_str_eq(m.name, "tiny");
    cr_assert_eq(m.layers, 4);
    cr_assert_eq(m.kv_heads, 2);
    cr_assert_eq(m.q_heads, 8);
    near(m.params, 1.5e8, 0);
    /* 2 x 4 x 10 x 2 x 64 x 2 */
    cr_assert_eq(kvt_cost_kv_bytes(&m, 10), 20480ull);

    /* base= starts from a built-in, later keys override */
    cr_assert_eq(kvt_model_profile_parse("base=llama-3-8b\nname=llama-fp8\nbytes_per_elem=1\n", &m),
                 0);
    cr_assert_str_eq(m.name, "llama-fp8");
    cr_assert_eq(m.layers, 32);
    cr_assert_eq(m.bytes_per_elem, 1);
}

Test(policy_cost, parse_refuses_bad_input_and_changes_nothing)
{
    kvt_model_profile_t m, before;
    cr_assert_eq(kvt_model_profile_get("llama-3-8b", &m), 0);
    before = m;
    const char *bad[] = {
        "name=x\nlayers=4\nkv_heads=2\nhead_dim=64\nbytes_per_elem=2\nq_heads=8\nhidden=512\n"
        "params=1e8\ncolour=blue\n", /* unknown key */
        "name=x\nlayers=four\n",     /* not a number */
        "name=x\nlayers=4\n",        /* incomplete */
        "name=x\nlayers=4\nkv_heads=3\nhead_dim=64\nbytes_per_elem=2\nq_heads=8\nhidden=512\n"
        "params=1e8\n",        /* 8 % 3 != 0 */
        "name=x\nlayers=-4\n", /* negative */
        "layers 4\n",          /* no '=' */
        "base=nonexistent\n",  /* unknown base */
        "name=x\nlayers=4.5\nkv_heads=2\nhead_dim=64\nbytes_per_elem=2\nq_heads=8\nhidden=512\n"
        "params=1e8\n", /* fraction */
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        cr_assert_eq(kvt_model_profile_parse(bad[i], &m), KVT_EINVAL, "case %zu", i);
        cr_assert_eq(memcmp(&m, &before, sizeof(m)), 0, "case %zu changed the output", i);
    }
    cr_assert_eq(kvt_model_profile_parse(NULL, &m), KVT_EINVAL);
}

Test(policy_cost, parse_custom_hardware)
{
    kvt_hw_profile_t hw, before;
    cr_assert_eq(kvt_hw_profile_parse("base=h200-node\nname=slow-remote\nremote_bw=1e9\n"
                                      "remote_latency_us=2000\n",
                                      &hw),
                 0);
    cr_assert_str_eq(hw.name, "slow-remote");
    near(hw.bw[KVT_TIER_REMOTE], 1e9, 0);
    near(hw.latency_s[KVT_TIER_REMOTE], 2e-3, 1e-12);
    near(hw.bw[KVT_TIER_DRAM], 400e9, 1e-12); /* from the base */
    before = hw;
    cr_assert_eq(kvt_hw_profile_parse("name=x\nprefill_flops=1e15\n", &hw),
                 KVT_EINVAL); /* no HBM */
    cr_assert_eq(kvt_hw_profile_parse("base=h200-node\nssd_bw=1e9\n", &hw), KVT_EINVAL);
    cr_assert_eq(kvt_hw_profile_parse("base=h200-node\nnvme_bw=-1\n", &hw), KVT_EINVAL);
    cr_assert_eq(kvt_hw_profile_parse("base=h200-node\nnvme_bw=inf\n", &hw), KVT_EINVAL);
    cr_assert_eq(kvt_hw_profile_parse("base=h200-node\nnvme_qd=-1\n", &hw), KVT_EINVAL);
    cr_assert_eq(kvt_hw_profile_parse("base=h200-node\nnvme_qd=1.5\n", &hw), KVT_EINVAL);
    cr_assert_eq(kvt_hw_profile_parse("base=h200-node\nremote_qd=2000000\n", &hw), KVT_EINVAL);
    cr_assert_eq(memcmp(&hw, &before, sizeof(hw)), 0);
}

/* Issue 40: a load behind a queue waits its round trips. A tier serving qd requests at once
 * makes the load behind q others wait floor(q / qd) more latencies; qd 0 does not queue. */
Test(policy_cost, queued_loads_wait_their_round_trips)
{
    kvt_hw_profile_t hw;
    cr_assert_eq(kvt_hw_profile_parse("base=h200-node\nname=q\nremote_qd=4\nnvme_qd=0\n", &hw), 0);
    cr_assert_eq(hw.qd[KVT_TIER_REMOTE], 4);
    double one = kvt_cost_load_s(&hw, KVT_TIER_REMOTE, 5242880);
    near(kvt_cost_load_queued_s(&hw, KVT_TIER_REMOTE, 5242880, 0), one, 1e-15);
    near(kvt_cost_load_queued_s(&hw, KVT_TIER_REMOTE, 5242880, 3), one, 1e-15);
    near(kvt_cost_load_queued_s(&hw, KVT_TIER_REMOTE, 5242880, 4), one + 500e-6, 1e-12);
    near(kvt_cost_load_queued_s(&hw, KVT_TIER_REMOTE, 5242880, 9), one + 1e-3, 1e-12);
    double nv = kvt_cost_load_s(&hw, KVT_TIER_NVME, 5242880);
    near(kvt_cost_load_queued_s(&hw, KVT_TIER_NVME, 5242880, 1000), nv, 1e-15);
    cr_assert_eq(kvt_cost_load_queued_s(&hw, KVT_TIER_REMOTE, 0, 100), 0);
    /* the shipped profile queues NVMe and remote, not DRAM */
    cr_assert_eq(kvt_hw_profile_get("h200-node", &hw), 0);
    cr_assert_gt(hw.qd[KVT_TIER_NVME], 0);
    cr_assert_gt(hw.qd[KVT_TIER_REMOTE], 0);
    cr_assert_eq(hw.qd[KVT_TIER_DRAM], 0);
}
