"""bench_sglang.py: kvtier.sglang's HiCache storage backend (KvtierStorage, built by SGLang's
own StorageBackendFactory from the "dynamic" config) storing and loading 32-layer pages, beside
the kvtier package's keyed and raw PUT and GET of the same bytes, in one run, over kvtierd's
Unix socket (bench/connbench.py: the page, the forms, first and warm passes).

The connector form is what HiCache's controller calls on the generic (non-v1) path: batch_set
of 32 flat data pages (2 MiB bf16 tensors, one per page, under SGLang-style 64-hex-digit page
hashes), then batch_get of the same keys into 32 other flat pages (its dummy pages).

Not measured: the zero-copy batch_set_v1 / batch_get_v1 into SGLang's host KV pool. The host
pool (sglang.srt.mem_cache.memory_pool_host) imports sglang.srt.configs, which needs
torchvision, and PyPI's torchvision for the CPU torch of this venv (2.13.0) is a CUDA build
that does not load here (../shared/ENGINES.md). The benchmark prints a line saying so, with the
import's own error.

  bench_sglang.py --build-root BUILD [--passes R]

Runs under BUILD/pyenv's Python (re-executing itself there). Exits 77 (skipped), saying why,
when SGLang's HiCache interface does not import there (scripts/engines/sglang.sh).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, List

from pybench import run_in_venv


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--build-root", default=os.environ.get("KVT_BUILD_ROOT", "build"))
    ap.add_argument("--passes", type=int, default=5, help="warm passes after the first (>= 1)")
    return ap.parse_args()


args = parse()
build = os.path.abspath(args.build_root)
run_in_venv(build, "bench_sglang", 77)

import torch  # noqa: E402

import connbench as cb  # noqa: E402
import kvtier  # noqa: E402

try:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
except Exception as e:  # noqa: BLE001: any import failure means "not installed here"
    cb.emit({"bench": "sglang", "skipped": "sglang not importable: %s: %s (see %s)" % (
        type(e).__name__, e, os.path.join(build, "pyenv", "engine-sglang.log"))})
    sys.exit(77)

MODEL = "bench-32l"
ELEMS = cb.PAGE_BYTES // 2  # bf16 elements in a flat data page


def page_keys(p: int) -> List[str]:
    """SGLang names a page by a 64-hex-digit hash chained over its prefix's tokens."""
    return ["%064x" % (p * 1_000_003 + i * 7919 + 1) for i in range(cb.PAGES)]


class Connector(cb.Form):
    """KvtierStorage as SGLang's factory builds it: TP 1, no host pool (so the flat layout)."""

    def __init__(self, unix: str) -> None:
        ec = {"backend_name": "kvtier", "module_path": "kvtier.sglang",
              "class_name": "KvtierStorage", "unix_path": unix, "timeout_ms": 60000}
        cfg = HiCacheStorageConfig(
            tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
            is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
            model_name=MODEL, extra_config=ec)
        self.b: Any = StorageBackendFactory.create_backend("dynamic", cfg, None)
        assert type(self.b).__module__ == "kvtier.sglang", type(self.b)
        g = torch.Generator().manual_seed(9)
        self.src = torch.randint(-2**15, 2**15, (cb.PAGES, ELEMS), dtype=torch.int16,
                                 generator=g).view(torch.bfloat16)
        self.out = torch.zeros((cb.PAGES, ELEMS), dtype=torch.bfloat16)
        self.pages = list(self.src)
        self.targets = list(self.out)
        # The pages are removed through a plain Client in the backend's namespace, as its
        # docstring names it (it has no remove of its own; HiCache never removes).
        self.rm = kvtier.Client(MODEL, page_size=kvtier.KEY_TOKENS, block_bytes=cb.PAGE_BYTES,
                                adapter="sglang/flat-flat/%dB/tp0-1" % cb.PAGE_BYTES,
                                unix_path=unix, timeout_ms=60000)
        self.keys: List[str] = []
        self.ok = False
        self.got: List[Any] = []

    def prepare(self, p: int) -> None:
        self.keys = page_keys(p)
        cb.mark(self.src, p)

    def save(self) -> None:
        self.ok = self.b.batch_set(self.keys, self.pages)

    def load(self) -> None:
        self.got = self.b.batch_get(self.keys, self.targets)

    def check(self) -> None:
        assert self.ok is True, "batch_set did not store every page"
        assert all(g is t for g, t in zip(self.got, self.targets)), "batch_get missed pages"
        assert torch.equal(self.src.view(torch.int16), self.out.view(torch.int16))

    def drop(self) -> None:
        assert all(self.rm.remove_keys_each(self.keys)), "the pages are not in the namespace"

    def close(self) -> None:
        self.b.close()
        self.rm.close()


def v1_note() -> None:
    try:
        import sglang.srt.mem_cache.memory_pool_host  # noqa: F401
        why = "the host pool imports here, but this benchmark has no v1 pass yet"
    except Exception as e:  # noqa: BLE001
        why = ("SGLang's host KV pool does not import in this venv (%s: %s): it needs "
               "torchvision, whose PyPI build for CPU torch 2.13 does not load" % (
                   type(e).__name__, str(e).splitlines()[0] if str(e) else ""))
    cb.emit({"bench": "sglang", "not_measured": "batch_set_v1/batch_get_v1 (zero copy into "
             "the host KV pool)", "why": why})


def main() -> None:
    v1_note()
    cb.run("sglang", build, {
        "connector": Connector,
        "keyed": lambda unix: cb.Keyed(unix, page_keys),
        "raw": cb.Raw,
    }, max(1, args.passes))


main()
