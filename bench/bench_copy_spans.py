"""bench_copy_spans.py: the vLLM connector's warm-load copies alone (issue 35): a request's 32
pages of 32 layers (bench_vllm's shape: blocks of 16 tokens, 8 KV heads of 128, bf16, 64 KiB
a layer's block, 2 MiB a page) lying in an anonymous mapping in 12 unevenly spaced runs, copied
into vLLM's (2, num_blocks, ...) tensors layer by layer: numpy (one copy per run and layer,
_Layout.scatter_runs) against kvt_copy_spans (one C call per layer, _Plan.copy, its spans
built once per load: _Layout.plan), taking turns, and one contiguous 64 MiB copy for scale.
Prints min and median in ms of --reps loads each, one JSON line.

--seal measures the save into a sealed reservation (issue 35) like with like, GiB/s medians:
kvt_copy_pages_xxh3 over the plan's spans (the connector's copy+hash: 64 spans of 32 KiB a page
from 32 layer tensors, _Plan.copy_sums), the same call over contiguous 2 MiB pages from one
buffer into the same pages (one span a page: the fused loop of the raw PUT's copy+hash), and
plain memcpy of both (the plan's spans layer by layer, kvt_copy_spans; one np.copyto of 64 MiB).

    bench_copy_spans.py --build-root BUILD [--reps 60] [--save | --seal]

Runs under BUILD/pyenv (torch), else is skipped (77).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import time

from pybench import run_in_venv

ap = argparse.ArgumentParser()
ap.add_argument("--build-root", default=os.environ.get("KVT_BUILD_ROOT", "build"))
ap.add_argument("--reps", type=int, default=60)
ap.add_argument("--save", action="store_true", help="the save's direction (tensor to pages)")
ap.add_argument("--seal", action="store_true",
                help="the save's copy+hash, spans against contiguous pages (GiB/s)")
args = ap.parse_args()
run_in_venv(os.path.abspath(args.build_root), "bench_copy_spans", 77)

import numpy as np  # noqa: E402
import torch  # noqa: E402

from kvtier._lib import ffi  # noqa: E402
from kvtier.vllm import layout as _layout_mod  # noqa: E402
from kvtier.vllm.layout import _Layout  # noqa: E402

LAYERS, PAGES, NBLOCKS, BS, HEADS, HEAD = 32, 32, 64, 16, 8, 128
RUNS = [3, 3, 2, 3, 2, 3, 3, 2, 3, 3, 2, 3]  # 12 runs, 32 pages


def main() -> None:
    a = args
    kv = {"l%d" % i: torch.randn((2, NBLOCKS, BS, HEADS, HEAD)).to(torch.bfloat16)
          for i in range(LAYERS)}
    kvs = list(kv.values())
    lay = _Layout(kv, NBLOCKS)
    pb = lay.page_bytes
    gaps = [1, 3, 0, 2, 5, 1, 0, 4, 2, 1, 3, 0]  # pages left free after each run
    arena = mmap.mmap(-1, (PAGES + sum(gaps) + 1) * pb)
    mv = memoryview(arena)
    mv[:] = os.urandom(16) * (len(mv) // 16)
    items, blocks, at, b = [], [], 0, 5
    for n, g in zip(RUNS, gaps):
        for _ in range(n):
            items.append(mv[at * pb:(at + 1) * pb])
            blocks.append(b)
            at, b = at + 1, b + 1
        at, b = at + g, b + 2  # the next run elsewhere, on other blocks
    runs = lay.runs(items, blocks)
    assert len(runs) == len(RUNS), len(runs)
    if a.seal:
        seal(lay, runs, kvs, pb)
        return
    load = not a.save

    def numpy_way() -> None:
        for li in range(LAYERS):
            if load:
                lay.scatter_runs(runs, li, kvs[li])
            else:
                lay.gather_runs(runs, li, kvs[li])

    def spans_way() -> None:
        plan = lay.plan(runs, kvs, load)
        assert plan is not None
        for li in range(LAYERS):
            plan.copy(li)

    src = np.empty(PAGES * pb, dtype=np.uint8)
    dst = np.empty_like(src)

    def memcpy_way() -> None:
        np.copyto(dst, src)

    ways = {"numpy": numpy_way, "spans": spans_way, "memcpy": memcpy_way}
    for f in ways.values():  # warm up: pages touched, arrays made
        f()
    t = {k: [] for k in ways}
    plan_ms = []
    for _ in range(a.reps):
        for k, f in ways.items():
            s = time.perf_counter()
            f()
            t[k].append((time.perf_counter() - s) * 1e3)
        s = time.perf_counter()
        lay.plan(runs, kvs, load)
        plan_ms.append((time.perf_counter() - s) * 1e3)
    out = {"bench": "copy_spans", "direction": "load" if load else "save", "runs": len(runs),
           "layers": LAYERS, "pages": PAGES, "mib": PAGES * pb / 2**20, "reps": a.reps,
           "loadavg": os.getloadavg()[0], "plan_min_ms": round(min(plan_ms), 4)}
    for k, v in t.items():
        out[k + "_min_ms"] = round(min(v), 3)
        out[k + "_median_ms"] = round(statistics.median(v), 3)
    print(json.dumps(out))


def seal(lay: _Layout, runs, kvs, pb: int) -> None:
    """--seal: the four ways into the same 32 pages, taking turns, GiB/s of their medians."""
    fn = _layout_mod._COPY_PAGES_XXH3
    if fn is None:
        raise SystemExit("bench_copy_spans: no kvt_copy_pages_xxh3 in this libkvtier")
    plan = lay.plan(runs, kvs, False)
    assert plan is not None and plan.sums
    src = np.frombuffer(os.urandom(PAGES * pb), dtype=np.uint8).copy()
    flat = np.empty_like(src)
    addrs = np.array([r.addr + i * r.stride for r in runs for i in range(r.n)], dtype=np.uint64)
    whole = np.empty((PAGES, 3), dtype=np.uint64)  # one span a page: contiguous 2 MiB
    whole[:, 0] = addrs
    whole[:, 1] = src.ctypes.data + np.arange(PAGES, dtype=np.uint64) * np.uint64(pb)
    whole[:, 2] = pb
    wptr = ffi.cast("kvt_copy_span_t *", whole.ctypes.data)
    sums = np.empty(PAGES, dtype=np.uint64)
    sptr = ffi.cast("uint64_t *", sums.ctypes.data)

    def pages_hash() -> None:
        assert fn(wptr, PAGES, 1, sptr) == 0

    def spans_hash() -> None:
        plan.copy_sums()

    def pages_memcpy() -> None:
        np.copyto(flat, src)

    def spans_memcpy() -> None:
        for li in range(LAYERS):
            plan.copy(li)

    ways = {"seal_pages": pages_hash, "seal_spans": spans_hash, "memcpy_flat": pages_memcpy,
            "memcpy_spans": spans_memcpy}
    for f in ways.values():
        f()
    t = {k: [] for k in ways}
    for _ in range(args.reps):
        for k, f in ways.items():
            s = time.perf_counter()
            f()
            t[k].append(time.perf_counter() - s)
    gib = PAGES * pb / 2**30
    out = {"bench": "copy_spans", "direction": "seal", "runs": len(runs), "layers": LAYERS,
           "pages": PAGES, "mib": PAGES * pb / 2**20, "reps": args.reps,
           "loadavg": os.getloadavg()[0]}
    for k, v in t.items():
        out[k + "_gib_s"] = round(gib / statistics.median(v), 2)
    out["spans_over_pages"] = round(out["seal_spans_gib_s"] / out["seal_pages_gib_s"], 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
