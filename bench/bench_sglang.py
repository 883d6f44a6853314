"""bench_sglang.py: kvtier.sglang's HiCache storage backend (KvtierStorage, built by SGLang's
own StorageBackendFactory from the "dynamic" config) storing and loading 32-layer pages, beside
the kvtier package's keyed and raw PUT and GET of the same bytes, in one run, over kvtierd's
Unix socket (bench/connbench.py: the page, the forms, first and warm passes).

The connector form is what HiCache's controller calls on the generic (non-v1) path: batch_set
of 32 flat data pages (2 MiB bf16 tensors, one per page, under SGLang-style 64-hex-digit page
hashes), then batch_get of the same keys into 32 other flat pages (its dummy pages).

The v1 form (connector_v1) is what the controller calls with interface_v1 (SGLang's zero-copy
path, as for its mooncake and hf3fs backends): batch_set_v1 of 32 pages read in place from a
real SGLang host KV pool (MHATokenToKVPoolHost over an MHATokenToKVPool, on the CPU) at their
host indices, then batch_get_v1 of the same keys straight into 32 other pages of that pool. The
pool has the same geometry (32 layers, 16 tokens a page, 8 KV heads of 128, bf16: 2 MiB a page)
in the page_first layout: the one SGLang pairs with its zero-copy backends (its server turns a
layer_first request for mooncake into it with the kernel io backend, page_first_direct with the
direct one; hf3fs is zero-copy, and simm and tensorcast work, only in those two), and whose
get_page_buffer_meta gives two segments a page (K and V, 1 MiB each), which the backend stores
as one key each.

The host pool imports sglang.srt.configs, which needs torchvision: it imports in
build/pyenv-sglang (scripts/pyenv.sh --sglang: torch 2.14.1 and torchvision 0.29.1), not in
build/pyenv, whose CPU torch 2.13.0 has no torchvision that loads here. The benchmark runs in
build/pyenv-sglang when that venv is complete (its .ready), else in build/pyenv, where it prints
a not_measured line for the v1 form, with the import's own error, and measures the rest.

  bench_sglang.py --build-root BUILD [--passes R] [--pyenv NAME]

Runs under BUILD/NAME's Python (re-executing itself there; NAME: pyenv-sglang when complete,
else pyenv). Exits 77 (skipped), saying why, when SGLang's HiCache interface does not import
there (scripts/engines/sglang.sh).
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
    ap.add_argument("--passes", type=int, default=12, help="warm passes after the first "
                    "(>= 1; 12: each of 3 or 4 forms in each place of the rotation alike)")
    ap.add_argument("--busy", type=int, default=0, help="CPU-bound processes to run beside "
                    "the passes (the keyed PUT's bar is also set with 2)")
    ap.add_argument("--pairs", type=int, default=None, help="paired keyed and raw saves after "
                    "the passes, on which the keyed PUT's warm bar is judged (default: "
                    "connbench.BUSY_PAIRS with --busy, else none)")
    ap.add_argument("--pyenv", default="", help="the venv in BUILD to run in (default: "
                    "pyenv-sglang when complete, else pyenv)")
    return ap.parse_args()


args = parse()
build = os.path.abspath(args.build_root)
# scripts/pyenv.sh --sglang writes .ready once SGLang's host pool imported there.
venv = args.pyenv or ("pyenv-sglang" if os.path.exists(
    os.path.join(build, "pyenv-sglang", ".ready")) else "pyenv")
run_in_venv(build, "bench_sglang", 77, venv)

import torch  # noqa: E402

import connbench as cb  # noqa: E402
import kvtier  # noqa: E402

try:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
except Exception as e:  # noqa: BLE001: any import failure means "not installed here"
    cb.emit({"bench": "sglang", "skipped": "sglang not importable: %s: %s (see %s)" % (
        type(e).__name__, e, os.path.join(sys.prefix, "engine-sglang.log"))})
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
              "class_name": "KvtierStorage", "unix_path": unix, "deadline_ms": 60000}
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
        assert cb.same(self.src, self.out), "batch_get: other bytes came back"

    def drop(self) -> None:
        assert all(self.rm.remove_keys_each(self.keys)), "the pages are not in the namespace"

    def close(self) -> None:
        self.b.close()
        self.rm.close()


def page_indices(pages: List[int]) -> torch.Tensor:
    """The host indices of these host-pool pages (16 token slots each), as HiCache hands
    them to batch_*_v1."""
    return torch.cat([torch.arange(q * cb.BS, (q + 1) * cb.BS, dtype=torch.int64)
                      for q in pages])


class ConnectorV1(cb.Form):
    """KvtierStorage with interface_v1 and a real host pool registered (page_first): pages go
    between kvtierd and the pool's own memory."""

    LAYOUT = "page_first"

    def __init__(self, unix: str) -> None:
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

        ec = {"backend_name": "kvtier", "module_path": "kvtier.sglang",
              "class_name": "KvtierStorage", "unix_path": unix, "deadline_ms": 60000,
              "interface_v1": 1}
        cfg = HiCacheStorageConfig(
            tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
            is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
            model_name=MODEL, extra_config=ec)
        self.b: Any = StorageBackendFactory.create_backend("dynamic", cfg, None)
        assert type(self.b).__module__ == "kvtier.sglang", type(self.b)
        # As SGLang's host-pool assembly builds it, from a (small: 2 pages) device pool's
        # buffer description; the host pool holds 2 x 32 pages: the pages stored, then the
        # pages loaded into.
        dev = MHATokenToKVPool(size=2 * cb.BS, page_size=cb.BS, dtype=torch.bfloat16,
                               head_num=cb.HEADS, head_dim=cb.HEAD, layer_num=cb.LAYERS,
                               device="cpu", enable_memory_saver=False,
                               enable_alt_stream=False)
        self.host = MHATokenToKVPoolHost(
            dev._mha_buffer_info(), 2.0, 0, cb.BS, self.LAYOUT, pin_memory=False,
            device="cpu", device_capacity_tokens=2 * cb.BS, start_layer=0,
            end_layer=cb.LAYERS, host_token_capacity=2 * cb.PAGES * cb.BS)
        del dev
        self.b.register_mem_pool_host(self.host)
        assert self.b.flat_bytes == cb.PAGE_BYTES, self.b.flat_bytes
        kv = self.host.kv_buffer  # page_first: (2, tokens, layers, heads, head_dim)
        assert kv.dim() == 5 and kv.shape[1] >= 2 * cb.PAGES * cb.BS, kv.shape
        g = torch.Generator().manual_seed(10)
        kv.view(torch.int16).copy_(torch.randint(-2**15, 2**15, kv.shape, dtype=torch.int16,
                                                 generator=g))
        # Stored from pool pages 0..31; loaded into pages 63..32 (key i into page 63 - i), so
        # that a page landing at another key's place fails the check.
        self.src_pages = list(range(cb.PAGES))
        self.dst_pages = [2 * cb.PAGES - 1 - i for i in range(cb.PAGES)]
        self.src = page_indices(self.src_pages)
        self.dst = page_indices(self.dst_pages)
        # The backend's namespaces are one per buffer segment of a page (K and V here); the
        # pages are removed through plain Clients in them.
        _, sizes = self.host.get_page_buffer_meta(page_indices([0]))
        assert sum(sizes) == cb.PAGE_BYTES, sizes
        self.rm = [kvtier.Client(MODEL, page_size=kvtier.KEY_TOKENS, block_bytes=int(size),
                                 adapter="sglang/v1-%s-%d/%dB/tp0-1" % (self.LAYOUT, s, size),
                                 unix_path=unix, timeout_ms=60000)
                   for s, size in enumerate(sizes)]
        self.keys: List[str] = []
        self.ok: List[bool] = []
        self.got: List[bool] = []

    def prepare(self, p: int) -> None:
        self.keys = page_keys(p)
        for kv in self.host.kv_buffer:  # K, then V: each [tokens, ...] contiguous
            cb.mark(kv[:cb.PAGES * cb.BS], p)

    def save(self) -> None:
        self.ok = self.b.batch_set_v1(self.keys, self.src)

    def load(self) -> None:
        self.got = self.b.batch_get_v1(self.keys, self.dst)

    def check(self) -> None:
        assert self.ok == [True] * cb.PAGES, "batch_set_v1 did not store every page"
        assert self.got == [True] * cb.PAGES, "batch_get_v1 missed pages"
        for s, d in zip(self.src_pages, self.dst_pages):
            for kv in self.host.kv_buffer:  # a page's K, then its V: its tokens' rows
                assert cb.same(kv[s * cb.BS:(s + 1) * cb.BS], kv[d * cb.BS:(d + 1) * cb.BS]), \
                    "batch_get_v1: other bytes in pool page %d" % d

    def drop(self) -> None:
        for c in self.rm:
            assert all(c.remove_keys_each(self.keys)), "the segments are not in the namespace"

    def close(self) -> None:
        self.b.close()
        for c in self.rm:
            c.close()


def host_pool_error() -> str:
    """Empty when SGLang's host KV pool imports here, else the import's error."""
    try:
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: F401
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return "%s: %s" % (type(e).__name__, str(e).splitlines()[0] if str(e) else "")
    return ""


def main() -> None:
    forms = {
        "connector": Connector,
        "keyed": lambda unix: cb.Keyed(unix, page_keys),
        "raw": cb.Raw,
    }
    err = host_pool_error()
    if err:
        cb.emit({"bench": "sglang", "not_measured": "connector_v1: batch_set_v1/batch_get_v1 "
                 "(zero copy into the host KV pool)",
                 "why": "SGLang's host KV pool does not import in %s (%s): it needs torchvision, "
                 "which does not load beside this venv's torch; run this benchmark under "
                 "build/pyenv-sglang (bash scripts/pyenv.sh --sglang BUILD makes it)" % (
                     sys.prefix, err)})
    else:
        forms["connector_v1"] = ConnectorV1
    cb.run("sglang", build, forms, max(1, args.passes), busy=args.busy, pairs=args.pairs)


main()
