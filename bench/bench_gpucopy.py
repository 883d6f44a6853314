#!/usr/bin/env python3
"""bench_gpucopy.py: engine tensors on the GPU to and from kvtier's mapped arena through the vLLM
connector's copy code (kvtier/vllm/layout.py, which hands CUDA tensors to kvtier/gpucopy.py),
against one pinned torch copy of the same bytes each way, in the same run.

    bench_gpucopy.py [--build-root B] [--pages N] [--passes R] [--no-venv]

The pages are vLLM's with Llama-3-8B's KV shape: 32 layers, each a (2, blocks, 16, 8, 128) bf16
tensor (FlashAttention's layout, a block's layer slice two 32 KiB pieces apart), so a page is 32
x 64 KiB = 2 MiB. Per pass, N pages (default 128: 256 MiB) at shuffled block ids (as vLLM hands
them out): save, every layer's gather_runs into a reservation's pages (then COMMIT, not timed);
load, every layer's scatter_runs from the leased pages into other blocks (then RELEASE). Each
strategy in turn (KVTIER_GPU_COPY): register (the arena registered with CUDA, one
cudaMemcpy2DAsync per layer), bounce (a 64 MiB pinned pool) and pageable (torch's copies
between the CUDA tensor and the unpinned mapping: the connector without gpucopy). The ceiling:
one torch copy of N x 2 MiB between a device tensor and a pinned host tensor, each way.

One JSON object per strategy and direction: the median of --passes passes after one warm-up
(the first reported apart as first_s; with register every pass includes registering its pages'
span, and register_unregister_s is that cost alone for the N pages), GB/s, the ceiling's GB/s, the
ratio and the bar (0.8, issue 37) with pass or fail; pageable is reported without a bar (it is
the baseline the pinned paths replace). Exits 77 (skipped) where torch has no usable GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, here)
ap = argparse.ArgumentParser()
ap.add_argument("--build-root", default=os.path.join(here, "..", "build"))
ap.add_argument("--pages", type=int, default=128)
ap.add_argument("--passes", type=int, default=5)
ap.add_argument("--strategies", default="register,bounce,pageable")
ap.add_argument("--no-venv", action="store_true",
                help="run with this python (the GPU pack's runner does), not build/pyenv's")
args = ap.parse_args()
import pybench  # noqa: E402

pybench.run_here_or_in_venv(args.build_root, "bench_gpucopy", args.no_venv)
torch = pybench.torch_or_skip("bench_gpucopy")
if not torch.cuda.is_available():
    print("SKIP: bench_gpucopy: torch %s sees no usable GPU: the figures come from a GPU machine "
          "(docs/gpu.md)" % torch.__version__)
    sys.exit(77)

import kvtier  # noqa: E402
from kvtier import gpucopy  # noqa: E402
from kvtier.vllm.layout import _Layout  # noqa: E402
from pybench import Daemon  # noqa: E402

BAR = 0.8
LAYERS, BS, HEADS, HEAD = 32, 16, 8, 128
DT = torch.bfloat16
dev = torch.device("cuda", torch.cuda.current_device())
N = args.pages
NB = 2 * N + 8
page = LAYERS * 2 * BS * HEADS * HEAD * DT.itemsize
total = N * page


def ceiling() -> dict:
    """One pinned copy of the same bytes each way (the median of the passes)."""
    d = torch.empty(total, dtype=torch.uint8, device=dev)
    h = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    out = {}
    for name, dst, src in (("d2h", h, d), ("h2d", d, h)):
        ts = []
        for _ in range(args.passes + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            ts.append(time.perf_counter() - t0)
        out[name] = statistics.median(ts[1:])
    del d, h
    return out


def lay_addr(view: memoryview) -> int:
    from kvtier._lib import ffi
    return int(ffi.cast("uintptr_t", ffi.from_buffer(view)))


def run(strategy: str, unix: str, ceil: dict) -> bool:
    os.environ["KVTIER_GPU_COPY"] = strategy
    gpucopy._copiers.clear()  # a copier per strategy (made on first use)
    g = torch.Generator(device=dev).manual_seed(1)
    kv = {"model.layers.%d.self_attn.attn" % i:
          torch.randn((2, NB, BS, HEADS, HEAD), generator=g, device=dev, dtype=DT)
          for i in range(LAYERS)}
    back = {n: torch.zeros_like(t) for n, t in kv.items()}
    lay = _Layout(kv, NB)
    assert lay.page_bytes == page
    rng = random.Random(7)
    ids = list(range(NB))
    times: dict = {"d2h": [], "h2d": []}
    ok = True
    with kvtier.Client("bench-gpucopy", page_size=BS, block_bytes=page, unix_path=unix) as c:
        if not c.zero_copy:
            print("bench_gpucopy: no zero-copy mapping (%s)" % c.zero_copy_reason,
                  file=sys.stderr)
            sys.exit(1)
        for p in range(args.passes + 1):
            rng.shuffle(ids)
            src, dst = ids[:N], ids[N:2 * N]
            toks = list(range(p * 10 ** 6, p * 10 ** 6 + N * BS))
            r = c.reserve(toks, N)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            runs = lay.runs(list(r.views), src)
            for li, n in enumerate(lay.names):
                lay.gather_runs(runs, li, kv[n])
            runs.clear()  # as the worker before its COMMIT: a registration undone, timed
            torch.cuda.synchronize()
            times["d2h"].append(time.perf_counter() - t0)
            c.commit(r)
            m = c.match(toks, lease=True, lease_ms=60000)
            views = c.get_views(m.lease)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            runs = lay.runs(views, dst)
            for li, n in enumerate(lay.names):
                lay.scatter_runs(runs, li, back[n])
            runs.clear()
            torch.cuda.synchronize()
            times["h2d"].append(time.perf_counter() - t0)
            del views
            c.release(m.lease)
            if p == 0:  # the bytes made the round trip (checked once: it costs a pass)
                ok = all(torch.equal(kv[n][:, src], back[n][:, dst]) for n in kv)
            c.remove(toks)
        cp = gpucopy.copiers().get(dev)
        used = "pageable" if cp is None else cp.strategy
        regs = gpucopy.registrations()
        pin_s = None
        if used == "register":  # what the save's first layer paid: registering its pages
            r = c.reserve(list(range(9 * 10 ** 7, 9 * 10 ** 7 + N * BS)), N)
            addrs = sorted(lay_addr(v) for v in r.views if v is not None)
            t0 = time.perf_counter()
            p = cp.pin(addrs[0], addrs[-1] + page - addrs[0])
            if p is not None:
                p.close()
                pin_s = round(time.perf_counter() - t0, 6)
            c.abort(r)
    for d in ("d2h", "h2d"):
        secs = statistics.median(times[d][1:])
        ratio = ceil[d] / secs
        rec = {"bench": "gpucopy", "strategy": strategy, "used": used, "dir": d, "pages": N,
               "page_bytes": page, "layers": LAYERS, "first_s": round(times[d][0], 6),
               "secs": round(secs, 6), "gb_s": round(total / secs / 1e9, 2),
               "ceiling_gb_s": round(total / ceil[d] / 1e9, 2), "ratio": round(ratio, 3),
               "bytes_match": ok, "registrations_open": regs, "register_unregister_s": pin_s}
        if strategy != "pageable":
            rec["bar"] = BAR
            rec["verdict"] = "pass" if ratio >= BAR and ok and used == strategy else "fail"
        print(json.dumps(rec), flush=True)
    assert gpucopy.registrations() == 0, "a registration outlived its client"
    return ok


def main() -> None:
    d = Daemon(os.path.abspath(args.build_root), "kvt-bench-gpucopy-",
               "%dM" % (3 * total // (1 << 20) + 64))
    try:
        ceil = ceiling()
        print(json.dumps({"bench": "gpucopy", "card": torch.cuda.get_device_name(dev),
                          "torch": torch.__version__, "cuda": torch.version.cuda,
                          "ceiling_d2h_gb_s": round(total / ceil["d2h"] / 1e9, 2),
                          "ceiling_h2d_gb_s": round(total / ceil["h2d"] / 1e9, 2)}), flush=True)
        bad = [s for s in args.strategies.split(",") if not run(s, d.unix, ceil)]
    finally:
        d.stop()
    if bad:  # wrong bytes is an error, not a figure
        print("bench_gpucopy: the bytes did not round trip with %s" % ", ".join(bad),
              file=sys.stderr)
        sys.exit(1)


main()
