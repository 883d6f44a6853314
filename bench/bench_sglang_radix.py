"""bench_sglang_radix.py: SGLang's own RadixCache over a Mooncake trace, page 16: for each request
match_prefix then insert of the whole prompt (its KV indices made outside the timed calls), as
bench_radix does with kvtier's index. It prints SGLang's fresh pass (a new cache in a new
process) and a second pass into a new cache, as CPU time per request (time.thread_time_ns), with
the hit tokens to cross-check against bench_radix's. The figure bench_radix's cold bars are read
beside (issue 38); it runs under build/pyenv-sglang (SGLang with torchvision), else exits 77.

  bench_sglang_radix.py --build-root BUILD TRACE.jsonl [--page-size 16] [--requests N]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from typing import Any, List


def tokens(hash_ids: List[int], n: int) -> List[int]:
    """The prompt's n tokens: 512 per hash id, equal blocks for equal ids (the trace's rule)."""
    out: List[int] = []
    for h in hash_ids:
        out.extend(((h * 512 + i) & 0x7FFFFFFF) for i in range(512))
        if len(out) >= n:
            break
    return out[:n]


def one_pass(reqs: List[Any], page: int) -> dict:
    import torch
    from sglang.srt.mem_cache.radix_cache import (CacheInitParams, InsertParams,
                                                  MatchPrefixParams, RadixCache, RadixKey)
    cache = RadixCache(CacheInitParams(disable=False, req_to_token_pool=None,
                                       token_to_kv_pool_allocator=None, page_size=page))
    cpu = 0
    hit = total = 0
    for r in reqs:
        tok = tokens(r["hash_ids"], r["input_length"])
        value = torch.arange(len(tok), dtype=torch.int64)
        key = RadixKey(tok)
        t0 = time.thread_time_ns()
        m = cache.match_prefix(MatchPrefixParams(key=key))
        cache.insert(InsertParams(key=key, value=value))
        cpu += time.thread_time_ns() - t0
        hit += m.device_prefix_len
        total += len(tok)
    return {"cpu_us_per_request_mean": cpu / 1e3 / len(reqs), "hit_tokens": hit,
            "total_tokens": total}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--build-root", default=os.environ.get("KVT_BUILD_ROOT", "build"))
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--requests", type=int, default=0)
    a = ap.parse_args()
    venv = os.path.join(a.build_root, "pyenv-sglang", "bin", "python")
    if os.path.exists(venv) and os.path.realpath(sys.prefix) != os.path.realpath(
            os.path.join(a.build_root, "pyenv-sglang")):
        os.execv(venv, [venv] + sys.argv)
    warnings.filterwarnings("ignore")
    try:
        import sglang.srt.mem_cache.radix_cache  # noqa: F401
    except Exception as e:  # noqa: BLE001: any import failure means "not installed here"
        print("bench_sglang_radix: SGLang's RadixCache does not import here (%s: %s)"
              % (type(e).__name__, e), file=sys.stderr)
        return 77
    with open(a.trace) as f:
        reqs = [json.loads(line) for line in f if line.strip()]
    if a.requests:
        reqs = reqs[:a.requests]
    fresh = one_pass(reqs, a.page_size)
    second = one_pass(reqs, a.page_size)
    print(json.dumps({
        "bench": "sglang_radix", "trace": os.path.basename(a.trace), "page_size": a.page_size,
        "requests": len(reqs), "hit_tokens": fresh["hit_tokens"],
        "total_tokens": fresh["total_tokens"],
        "fresh_cpu_us_per_request_mean": round(fresh["cpu_us_per_request_mean"], 1),
        "second_cpu_us_per_request_mean": round(second["cpu_us_per_request_mean"], 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
