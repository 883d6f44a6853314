"""bench_lmcache.py: kvtier.lmcache's remote storage plugin (KvtierConnector, loaded by LMCache's
own CreateConnector from its config and wrapped in its InstrumentedRemoteConnector) storing and
loading 32-layer chunks, beside the kvtier package's keyed and raw PUT and GET of the same bytes,
in one run, over kvtierd's Unix socket (bench/connbench.py: the page, the forms, first and warm
passes).

A chunk here is 16 tokens (chunk_size 16, not LMCache's default 256) of the same 32-layer model
as the other connector benchmarks: 2 MiB in LMCache's KV_2LTD format, so that the three engines
move the same pages. The connector form is what LMCache's remote backend does: batched_put of
32 chunks (MemoryObjs of a real LocalCPUBackend, a reference taken for the put as LMCache takes
it) and batched_get of the same keys, which allocates 32 new MemoryObjs from the backend and
reads into them; the calls run on an event loop in a thread of their own, as in LMCache. The
backend's memory is written once before pass 1 (no page faults of this process are timed).

  bench_lmcache.py --build-root BUILD [--passes R]
  bench_lmcache.py --build-root BUILD --phases R [--pause-ms MS]

--phases R times the steps of R connector saves and loads instead (issue 35: where a call's
time goes), on one kvtierd, each pass's chunks removed just before the next pass stores (so the
DRAM tier's freed pages are reused: a save after a longer pause pays page faults for the pages
the daemon gave back meanwhile, docs/engines.md "Where the warm save and load go"); beside each
connector call, the package's keyed call of the same chunks (the same MemoryObjs' memory, the
same key strings, the LMCache wrapper and event loop left out). Per step, min and median ms.
--pause-ms MS pauses that long between a pass's removal and the next pass's save.

Runs under BUILD/pyenv's Python (re-executing itself there). Exits 77 (skipped), saying why,
when LMCache does not import there (scripts/engines/lmcache.sh).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import threading
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
    ap.add_argument("--phases", type=int, default=0, help="time the steps of this many "
                    "connector saves and loads instead (min and median per step)")
    ap.add_argument("--pause-ms", type=float, default=0, help="with --phases: the pause between "
                    "a pass's removal and the next pass's save (the faults it costs)")
    return ap.parse_args()


args = parse()
build = os.path.abspath(args.build_root)
run_in_venv(build, "bench_lmcache", 77)

import torch  # noqa: E402

import connbench as cb  # noqa: E402

try:
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.memory_management import MemoryFormat
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.connector import CreateConnector
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

    import kvtier.lmcache as klm
except Exception as e:  # noqa: BLE001: any import failure means "not installed here"
    cb.emit({"bench": "lmcache", "skipped": "lmcache not importable: %s: %s (see %s)" % (
        type(e).__name__, e, os.path.join(build, "pyenv", "engine-lmcache.log"))})
    sys.exit(77)

MODEL = "bench-32l"
SHAPE = (cb.LAYERS, 2, cb.BS, cb.HEADS, cb.HEAD)  # LMCache's kv_shape: 2 MiB a chunk in bf16
CHUNK = [torch.Size([2, cb.LAYERS, cb.BS, cb.HEADS * cb.HEAD])]  # KV_2LTD


def chunk_keys(p: int) -> List[Any]:
    return [CacheEngineKey(MODEL, 1, 0, p * 1_000_003 + i * 7919 + 1, torch.bfloat16)
            for i in range(cb.PAGES)]


def key_names(p: int) -> List[str]:
    """The kvtier keys the connector sends for those chunks, for the keyed form."""
    return [klm.key_string(k) for k in chunk_keys(p)]


class Connector(cb.Form):
    def __init__(self, unix: str) -> None:
        ec = {"remote_storage_plugin.kvtier.module_path": "kvtier.lmcache",
              "remote_storage_plugin.kvtier.class_name": "KvtierConnector",
              "remote_storage_plugin.kvtier.unix_path": unix,
              "remote_storage_plugin.kvtier.deadline_ms": 60000}
        # Room for the 32 chunks put and the 32 a load allocates (128 MiB), with some to spare.
        cfg = LMCacheEngineConfig.from_defaults(
            chunk_size=cb.BS, local_cpu=True, max_local_cpu_size=0.25,
            remote_storage_plugins=["kvtier"], extra_config=ec)
        md = LMCacheMetadata(model_name=MODEL, world_size=1, local_world_size=1, worker_id=0,
                             local_worker_id=0, kv_dtype=torch.bfloat16, kv_shape=SHAPE,
                             chunk_size=cb.BS)
        self.be = LocalCPUBackend(cfg, md)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.conn = CreateConnector("plugin://kvtier", self.loop, self.be, cfg, md,
                                    plugin_name="kvtier")
        inner = self.conn.getWrappedConnector()
        assert type(inner).__module__ == "kvtier.lmcache", type(inner)
        assert inner.block_bytes == cb.PAGE_BYTES, inner.block_bytes
        # Write the backend's memory once: allocate what a pass holds, fill it, give back the
        # half that loads will allocate again.
        spare = [self.alloc() for _ in range(cb.PAGES)]
        g = torch.Generator().manual_seed(10)
        self.objs = [self.alloc() for _ in range(cb.PAGES)]
        for o in self.objs:
            o.tensor.view(torch.int16).copy_(torch.randint(
                -2**15, 2**15, o.tensor.shape, dtype=torch.int16, generator=g))
        for o in spare:
            o.ref_count_down()
        self.keys: List[Any] = []
        self.got: List[Any] = []

    def alloc(self) -> Any:
        o = self.be.allocate(CHUNK, [torch.bfloat16], MemoryFormat.KV_2LTD)
        assert o is not None, "LocalCPUBackend is full"
        o.tensor.zero_()
        return o

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(120)

    def prepare(self, p: int) -> None:
        self.keys = chunk_keys(p)
        for o in self.objs:
            cb.mark(o.tensor, p)
            o.ref_count_up()  # as LMCache's RemoteBackend does; its wrapper drops it after put

    def save(self) -> None:
        self.call(self.conn.batched_put(self.keys, self.objs))

    def load(self) -> None:
        self.got = self.call(self.conn.batched_get(self.keys))

    def check(self) -> None:
        assert all(g is not None for g in self.got), "batched_get missed chunks"
        for g, o in zip(self.got, self.objs):
            assert cb.same(g.tensor, o.tensor), "batched_get: other bytes came back"
            g.ref_count_down()
        self.got = []

    def drop(self) -> None:
        assert all(self.conn.remove_sync(k) for k in self.keys), "chunks not removed"

    def close(self) -> None:
        self.call(self.conn.close())
        for o in self.objs:
            o.ref_count_down()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def phases(rounds: int) -> None:
    """The --phases mode (see the module's docstring)."""
    import resource
    import statistics
    import time

    from pybench import Daemon

    def faults() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    d = Daemon(build, "kvt-bench-lmcache-phases-", "256M")
    f = Connector(d.unix)
    inner = f.conn.getWrappedConnector()
    marks: dict = {}
    steps: dict = {}

    def timed(name: str, fn: Any) -> Any:
        def w(*a: Any) -> Any:
            marks[name + "0"] = (time.perf_counter(), faults())
            try:
                return fn(*a)
            finally:
                marks[name + "1"] = (time.perf_counter(), faults())
        return w

    # Instance attributes over the connector's own steps: its work on LMCache's loop (_put_sync,
    # _get_sync) and, inside it, the kvtier call (_call).
    inner._put_sync = timed("work", inner._put_sync)
    inner._get_sync = timed("work", inner._get_sync)
    inner._call = timed("kvtier", inner._call)

    def record(op: str, step: str, ms: float) -> None:
        steps.setdefault((op, step), []).append(ms)

    try:
        for p in range(1, rounds + 2):
            f.prepare(p)
            for op, call in (("save", f.save), ("load", f.load)):
                marks.clear()
                t0 = time.perf_counter()
                call()
                t1 = time.perf_counter()
                if p == 1:
                    continue  # the daemon's first pass faults its memory in
                w0, w1 = marks["work0"][0], marks["work1"][0]
                (k0, f0), (k1, f1) = marks["kvtier0"], marks["kvtier1"]
                for step, ms in (("to_loop", w0 - t0), ("connector_before", k0 - w0),
                                 ("kvtier_call", k1 - k0), ("connector_after", w1 - k1),
                                 ("from_loop", t1 - w1), ("whole", t1 - t0)):
                    record(op, step, ms * 1e3)
                record(op, "kvtier_call_faults", f1 - f0)
            f.check()
            names = key_names(p)
            f.drop()
            if p == 1:
                continue
            # The keyed calls of the same bytes (the MemoryObjs' memory) and key strings.
            bufs = [o.byte_array for o in f.objs]
            t0 = time.perf_counter()
            ok = inner._store.client.put_keys_each(names, bufs)
            t1 = time.perf_counter()
            outs = [f.alloc() for _ in f.objs]
            t2 = time.perf_counter()
            got = inner._store.client.get_keys_each_into(names, [o.byte_array for o in outs])
            t3 = time.perf_counter()
            assert all(ok) and all(got), "keyed: chunks not stored or not found"
            for o in outs:
                o.ref_count_down()
            assert all(inner._store.client.remove_keys_each(names))
            record("save", "keyed_same_memory", (t1 - t0) * 1e3)
            record("load", "keyed_same_memory", (t3 - t2) * 1e3)
            time.sleep(args.pause_ms / 1e3)
    finally:
        f.close()
        d.stop()
    for (op, step), v in steps.items():
        cb.emit({"bench": "lmcache_phases", "op": op, "step": step, "rounds": len(v),
                 "min": round(min(v), 3), "median": round(statistics.median(v), 3)})


def main() -> None:
    if args.phases > 0:
        phases(args.phases)
        return
    cb.run("lmcache", build, {
        "connector": Connector,
        "keyed": lambda unix: cb.Keyed(unix, key_names),
        "raw": cb.Raw,
    }, max(1, args.passes), busy=args.busy, pairs=args.pairs)


main()
