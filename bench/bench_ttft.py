#!/usr/bin/env python3
"""bench_ttft.py: time to first token (TTFT) of a prompt whose prefix is cached, with the
prefix's KV recomputed (a full prefill) against loaded through kvtier (bench/ttft.py), on a
Llama-shaped model with random weights made on the device.

    bench_ttft.py [--build-root B] [--device cuda|cpu] [--shapes llama-3-8b,...] \
                  [--tokens 1024,4096,16384] [--tiers dram,nvme] [--reps N]

For each shape, prompt length and tier: a fresh kvtierd holding only that tier (DRAM, or NVMe
with no DRAM so that every page is read from the disk), the prompt prefilled once and its whole
pages PUT; then TTFT recomputed and TTFT through kvtier (MATCH, GET into a pinned buffer, copy to
the device, compute the tokens after the cached pages), the first pass (the daemon's first read
of those pages) and the median of --reps warm ones; the load time against the plainest copy of
the same bytes to the device (a pinned host-to-device copy: the ceiling); and whether the
logits through kvtier match the full prefill's (same top token, small difference). One JSON
object per line. On a machine without a GPU it runs the tiny shape on the CPU unless told
otherwise, and says so: CPU figures say nothing about a GPU's TTFT.

Defaults on a GPU: llama-3-8b and llama-3-70b-20of80 (20 of 70B's 80 layers: x4 for the
model; ttft.py says why), bf16, prompts of 1k, 4k and 16k tokens, DRAM and NVMe tiers.
"""

import argparse
import json
import os
import statistics
import sys

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, here)
ap = argparse.ArgumentParser()
ap.add_argument("--build-root", default=os.path.join(here, "..", "build"))
ap.add_argument("--device", default=None)
ap.add_argument("--shapes", default=None)
ap.add_argument("--tokens", default=None)
ap.add_argument("--tiers", default="dram,nvme")
ap.add_argument("--reps", type=int, default=3)
ap.add_argument("--no-venv", action="store_true",
                help="run with this python (the GPU pack's runner does), not build/pyenv's")
args = ap.parse_args()
import pybench  # noqa: E402

pybench.run_here_or_in_venv(args.build_root, "bench_ttft", args.no_venv)
torch = pybench.torch_or_skip("bench_ttft")

import kvtier  # noqa: E402
import ttft  # noqa: E402
from pybench import Daemon  # noqa: E402

gpu = torch.cuda.is_available()
device = torch.device(args.device or ("cuda" if gpu else "cpu"))
if device.type == "cuda" and not gpu:
    print("bench_ttft: --device cuda but torch sees no usable GPU", file=sys.stderr)
    sys.exit(77)
dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
shapes = [ttft.SHAPES[n] for n in (args.shapes or ("llama-3-8b,llama-3-70b-20of80"
                                                   if device.type == "cuda" else "tiny"))
          .split(",")]
lengths = [int(x) for x in (args.tokens or ("1024,4096,16384" if device.type == "cuda"
                                             else "256,1024")).split(",")]
tiers = args.tiers.split(",")
card = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
if device.type == "cpu":
    print("bench_ttft: no GPU here: the tiny shape on the CPU checks the harness; the TTFT "
          "figures come from a GPU machine (docs/gpu.md)", file=sys.stderr)


def daemon(tier: str, pages: int, page_bytes: int) -> Daemon:
    """A fresh kvtierd holding only the tier under test: DRAM, or NVMe with no DRAM (every page
    read from the file, O_DIRECT; the file holds at least 2 segments of 64M, sparse)."""
    need = pages * page_bytes * 2 + (64 << 20)
    dram, nvme = (need, 0) if tier == "dram" else (0, max(need, 256 << 20))
    return Daemon(args.build_root, "kvt-ttft-", str(dram), str(nvme))


failed = 0
for shape in shapes:
    model = ttft.Model(shape, str(device), dtype)
    pb = shape.page_bytes(dtype)
    for n in lengths:
        toks = ttft.prompt(n + 1, shape.vocab, seed=n)  # the cached pages, then the rest
        pages = toks.shape[0] // ttft.PAGE
        host = torch.empty((pages, shape.layers, 2, ttft.PAGE, shape.kv_heads, shape.head_dim),
                           dtype=dtype, pin_memory=device.type == "cuda")
        ceiling = ttft.copy_ceiling(host, device)
        ref, rec_first = ttft.recompute(model, toks)
        rec = statistics.median(ttft.recompute(model, toks)[1] for _ in range(args.reps))
        for tier in tiers:
            d = daemon(tier, pages, pb)
            try:
                with kvtier.Client("ttft-" + shape.name, unix_path=d.unix, page_size=ttft.PAGE,
                                   block_bytes=pb) as c:
                    _, stored = ttft.save(c, model, toks)
                    runs = [ttft.load_and_finish(c, model, toks, host)
                            for _ in range(args.reps + 1)]
            finally:
                d.stop()
            first, warm = runs[0], runs[1:]
            logits = first[0]
            diff = float((logits - ref).abs().max())
            scale = float(ref.abs().max())
            match = int(logits.argmax()) == int(ref.argmax()) and diff <= 0.05 * scale + 1e-3
            failed |= not match or first[1] != pages
            load_w = statistics.median(r[2] for r in warm)
            ttft_w = statistics.median(r[3] for r in warm)
            print(json.dumps({
                "bench": "ttft", "card": card, "shape": shape.name, "note": shape.note,
                "dtype": str(dtype).replace("torch.", ""), "prompt_tokens": n + 1,
                "cached_tokens": first[1] * ttft.PAGE, "tier": tier, "stored_pages": stored,
                "kv_bytes": pages * pb,
                "ttft_recompute_s": round(rec, 5), "ttft_recompute_first_s": round(rec_first, 5),
                "ttft_kvtier_s": round(ttft_w, 5), "ttft_kvtier_first_s": round(first[3], 5),
                "speedup": round(rec / ttft_w, 2), "speedup_first": round(rec / first[3], 2),
                "load_s": round(load_w, 5), "load_first_s": round(first[2], 5),
                "copy_ceiling_s": round(ceiling, 5),
                "load_vs_ceiling": round(ceiling / load_w, 3) if load_w > 0 else None,
                "logits_match": match, "logits_max_diff": round(diff, 5)}), flush=True)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
sys.exit(1 if failed else 0)
