"""kvtier.sglang (SGLang's HiCache storage backend) against SGLang's own classes (HiCacheStorage,
HiCacheStorageConfig, StorageBackendFactory; MHATokenToKVPoolHost where it imports) and a real
kvtierd. Skipped, saying why, when sglang is not importable (scripts/engines/sglang.sh installs
it; its log is engine-sglang.log in the venv, e.g. build/pyenv/engine-sglang.log).

The tests that need SGLang's host KV pool or its scheduler's cache (get_stats) are marked
`hostpool`. In build/pyenv they skip (both import torchvision, which does not load beside its
CPU torch); the meson test python_sglang_hostpool runs them in build/pyenv-sglang
(scripts/pyenv.sh --sglang), whose .ready says that both imported there: in that venv, an
import failure fails them instead."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Any

import pytest

from conftest import Daemon, STALL_SLACK

# scripts/pyenv.sh --sglang writes .ready only after scripts/engines/sglang.sh saw the host pool
# import: here SGLang or its pool missing is a failure, not a skip.
HOSTPOOL_VENV = os.path.exists(os.path.join(sys.prefix, ".ready"))

try:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
except Exception as e:  # ImportError, or a dependency failing at import
    if HOSTPOOL_VENV:
        raise
    pytest.skip("sglang is not importable (%s: %s); see %s" % (
        type(e).__name__, e, os.path.join(sys.prefix, "engine-sglang.log")),
        allow_module_level=True)

import torch  # noqa: E402  (sglang needs it; so do these tests)

PAGE_BYTES = 8192  # a flat data page of this test's "model"


def config(d: Daemon, *, model: str = "sgl-model", tp_rank: int = 0, tp_size: int = 2,
           mla: bool = False, metrics: bool = False, **extra: Any) -> Any:
    ec = {"backend_name": "kvtier", "module_path": "kvtier.sglang",
          "class_name": "KvtierStorage", "unix_path": d.unix, "deadline_ms": 2000}
    ec.update(extra)
    ec = {k: v for k, v in ec.items() if v is not None}  # None: the backend's default
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
        attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=metrics,
        is_page_first_layout=True, model_name=model, extra_config=ec)


def backend(d: Daemon, **kw: Any) -> Any:
    b = StorageBackendFactory.create_backend("dynamic", config(d, **kw), None)
    assert isinstance(b, HiCacheStorage)
    return b


def page(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2**15, 2**15, (PAGE_BYTES // 2,), dtype=torch.int16,
                         generator=g).view(torch.bfloat16)


def hkeys(tag: str, n: int) -> list:
    return ["%s-%064x" % (tag, i * 7919 + 1) for i in range(n)]  # SGLang-style page hashes


def test_the_factory_builds_it_from_the_dynamic_config(daemon: Daemon) -> None:
    import kvtier.sglang

    b = backend(daemon)
    assert type(b).__name__ == "KvtierStorage" and type(b) is kvtier.sglang.KvtierStorage
    assert b.shard == "tp0-2" and b.model == "sgl-model"
    b.close()


def test_set_then_get_byte_exact_into_another_buffer(daemon: Daemon) -> None:
    b = backend(daemon)
    ks = hkeys("rt", 4)
    vals = [page(i) for i in range(4)]
    assert b.batch_set(ks, vals) is True
    outs = [torch.zeros(PAGE_BYTES // 2, dtype=torch.bfloat16) for _ in ks]
    got = b.batch_get(ks, outs)
    for g, o, v in zip(got, outs, vals):
        assert g is o and torch.equal(o.view(torch.int16), v.view(torch.int16))
    assert b.set("single", page(9)) is True and b.exists("single")
    one = torch.zeros(PAGE_BYTES, dtype=torch.uint8)
    assert b.get("single", one) is one
    assert torch.equal(one, page(9).view(torch.uint8))
    # a miss is None in its place, the others served
    outs = [torch.zeros(PAGE_BYTES // 2, dtype=torch.bfloat16) for _ in range(3)]
    got = b.batch_get([ks[0], "absent", ks[2]], outs)
    assert got[1] is None and got[0] is outs[0] and got[2] is outs[2]
    assert b.get("absent", torch.zeros(PAGE_BYTES, dtype=torch.uint8)) is None
    b.close()


def test_batch_exists_counts_leading_hits(daemon: Daemon) -> None:
    b = backend(daemon)
    ks = hkeys("ex", 5)
    assert b.batch_set(ks[:3], [page(20 + i) for i in range(3)])
    assert b.batch_exists(ks) == 3
    assert b.batch_exists(ks[1:3]) == 2  # a suffix alone
    assert b.batch_exists([ks[0], "gap", ks[1]]) == 1
    assert b.batch_exists(["gap"]) == 0 and b.batch_exists([]) == 0
    assert b.exists(ks[2]) and not b.exists(ks[3])
    b.close()


def test_another_model_or_tp_rank_does_not_hit(daemon: Daemon) -> None:
    b = backend(daemon)
    ks = hkeys("id", 2)
    assert b.batch_set(ks, [page(30), page(31)])
    others = [backend(daemon, model="other-model"), backend(daemon, tp_rank=1),
              backend(daemon, tp_size=4), backend(daemon, salt="tenant-b")]
    for o in others:
        o.set("warm", page(0))  # learns the page size, as a registered host pool would give
        assert o.batch_exists(ks) == 0, o.shard
        assert o.batch_get(ks, [torch.zeros(PAGE_BYTES, dtype=torch.uint8)] * 2) == [None] * 2
        o.close()
    # MLA: every TP rank holds the whole KV, so ranks share it; only the writer writes
    m0 = backend(daemon, mla=True, tp_rank=0)
    m1 = backend(daemon, mla=True, tp_rank=1)
    assert m0.batch_set(ks, [page(40), page(41)])
    m1.set("warm", page(0))
    assert m1.batch_exists(ks) == 2
    b.close(), m0.close(), m1.close()


def test_daemon_killed_answers_misses_and_raises_nothing() -> None:
    d = Daemon()
    b = backend(d)
    ks = hkeys("kill", 64)
    vals = [page(50 + i) for i in range(64)]
    assert b.batch_set(ks[:8], vals[:8])
    # mid-batch: the daemon dies while a thread stores and loads as SGLang's backup and
    # prefetch threads do; every call returns, none raises
    errors: list = []

    def engine() -> None:
        try:
            for _ in range(20):
                r = b.batch_set(ks, vals)
                assert r in (True, False)
                got = b.batch_get(ks, [torch.zeros(PAGE_BYTES, dtype=torch.uint8) for _ in ks])
                assert len(got) == len(ks)
                assert 0 <= b.batch_exists(ks) <= len(ks)
        except BaseException as e:  # what would escape into the engine
            errors.append(e)

    t = threading.Thread(target=engine)
    t.start()
    time.sleep(0.05)
    os.kill(d.proc.pid, signal.SIGKILL)
    t.join(30)
    assert not t.is_alive() and errors == []
    d.stop()
    # after: misses at once, without waiting on a socket
    start = time.monotonic()
    assert b.batch_exists(ks) == 0
    assert b.batch_get(ks[:2], [torch.zeros(PAGE_BYTES, dtype=torch.uint8)] * 2) == [None] * 2
    assert b.batch_set(ks[:2], vals[:2]) is False
    assert b.exists(ks[0]) is False and b.get(ks[0], torch.zeros(PAGE_BYTES,
                                                                  dtype=torch.uint8)) is None
    assert time.monotonic() - start < 2.0
    assert b.stats["errors"] >= 1
    b.close()


def _host_pool(layout: str = "page_first") -> Any:
    """A real SGLang host KV pool (MHATokenToKVPoolHost over a real MHATokenToKVPool) in this
    layout; the test skips when the pool does not import here (it pulls in transformers and
    torchvision). A test that calls it is marked `hostpool`."""
    try:
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    except Exception as e:
        if HOSTPOOL_VENV:
            raise
        pytest.skip("SGLang's host KV pool does not import here (%s: %s): it needs torchvision; "
                    "the meson test python_sglang_hostpool runs this in build/pyenv-sglang "
                    "(docs/engines.md)" % (type(e).__name__, e))
    dev = MHATokenToKVPool(size=64, page_size=4, dtype=torch.bfloat16, head_num=2, head_dim=8,
                           layer_num=3, device="cpu", enable_memory_saver=False,
                           enable_alt_stream=False)
    # As SGLang's host-pool assembly builds it: from the device pool's buffer description.
    return MHATokenToKVPoolHost(dev._mha_buffer_info(), 2.0, 0, 4, layout,
                                pin_memory=False, device="cpu", device_capacity_tokens=64,
                                start_layer=0, end_layer=3)


@pytest.mark.hostpool
@pytest.mark.parametrize("layout", ["page_first", "page_first_direct", "page_head",
                                    "layer_first"])
def test_zero_copy_v1_into_host_indices(daemon: Daemon, layout: str) -> None:
    host = _host_pool(layout)
    b = backend(daemon, interface_v1=1, model="v1-" + layout)
    b.register_mem_pool_host(host)
    ps = host.page_size
    ks = hkeys("v1", 3)
    src = torch.arange(0, 3 * ps, dtype=torch.int64) + 2 * ps  # pages 2..4 of the pool
    g = torch.Generator().manual_seed(7)
    host.kv_buffer.view(torch.int16).copy_(
        torch.randint(-2**15, 2**15, host.kv_buffer.shape, dtype=torch.int16, generator=g))
    want = [host.get_data_page(int(src[i * ps]), flat=True).clone() for i in range(3)]
    assert b.batch_set_v1(ks, src) == [True] * 3
    assert b.batch_exists(ks + ["absent"]) == 3
    dst = torch.arange(0, 3 * ps, dtype=torch.int64) + 8 * ps  # other pages of the pool
    before = host.get_data_page(int(dst[ps]), flat=True).clone()
    assert b.batch_get_v1([ks[0], "absent", ks[2]], dst) == [True, False, True]
    for i in (0, 2):
        got = host.get_data_page(int(dst[i * ps]), flat=True)
        assert torch.equal(got.view(torch.int16), want[i].view(torch.int16))
    # the miss's page is left as it was
    after = host.get_data_page(int(dst[ps]), flat=True)
    assert torch.equal(after.view(torch.int16), before.view(torch.int16))
    b.close()


@pytest.mark.hostpool
def test_get_stats_feeds_sglangs_storage_metrics(daemon: Daemon) -> None:
    """--enable-metrics: SGLang's scheduler loop (UnifiedRadixCache.check_hicache_events, run
    here as SGLang's own code on a cache object holding only what that function reads) takes
    the backend's get_stats(), sets .prefetch_stats on it and logs it into its
    StorageMetricsCollector (its own class, through the hooks SGLang gives other metric
    systems, recording instead of exporting). The collector gets each batch's pages and rate,
    then, the batches drained, nothing; no exception. (The cache module imports torchvision:
    marked hostpool, run in build/pyenv-sglang.)"""
    try:
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
        from sglang.srt.observability.metrics_collector import (
            StorageMetrics,
            StorageMetricsCollector,
        )
    except Exception as e:
        if HOSTPOOL_VENV:
            raise
        pytest.skip("SGLang's scheduler cache does not import here (%s: %s); the meson test "
                    "python_sglang_hostpool runs this in build/pyenv-sglang" % (
                        type(e).__name__, e))
    from types import SimpleNamespace

    class Recorded:
        """Stands for prometheus_client's Counter, Gauge and Histogram."""

        def __init__(self, name: str, **kw: Any) -> None:
            self.name, self.values = name, []

        def labels(self, **kw: Any) -> "Recorded":
            return self

        def observe(self, v: float) -> None:
            self.values.append(v)

        inc = set = observe

    class Collector(StorageMetricsCollector):
        _counter_cls = _gauge_cls = _histogram_cls = _summary_cls = Recorded

    b = backend(daemon, model="metrics", tp_size=1, metrics=True)
    ks = hkeys("metrics", 4)
    assert b.batch_set(ks[:3], [page(40 + i) for i in range(3)])
    outs = [torch.zeros(PAGE_BYTES, dtype=torch.uint8) for _ in ks]
    assert [g is not None for g in b.batch_get(ks, outs)] == [True, True, True, False]
    assert b.get(ks[0], torch.zeros(PAGE_BYTES, dtype=torch.uint8)) is not None

    coll = Collector(labels={"tp_rank": "0"})
    cache = SimpleNamespace(
        linker=None, _drain_async_work=lambda: None, flush_pending_backups=lambda: None,
        _sync_hicache_ready_counts=lambda: (0, 0, [], []),
        writing_check=lambda finish_count: None, loading_check=lambda finish_count: None,
        enable_storage=True, buffer_pipeline=None, enable_storage_metrics=True,
        storage_metrics_collector=coll, cache_controller=SimpleNamespace(storage_backend=b),
        prefetch_outcome_stats_snapshot=lambda: {})
    UnifiedRadixCache.check_hicache_events(cache)  # type: ignore[arg-type]
    assert coll.histogram_backup_pgs.values == [3]
    assert coll.histogram_prefetch_pgs.values == [3, 1]
    bw = coll.histogram_prefetch_bandwidth.values + coll.histogram_backup_bandwidth.values
    assert len(bw) == 3 and all(v > 0 for v in bw)
    UnifiedRadixCache.check_hicache_events(cache)  # type: ignore[arg-type]
    assert coll.histogram_backup_pgs.values == [3]  # drained: nothing new
    assert coll.histogram_prefetch_pgs.values == [3, 1]
    m = b.get_stats()
    assert isinstance(m, StorageMetrics) and m.prefetch_pgs == [] and m.backup_pgs == []
    assert b.stats["get_hits"] == 4 and b.stats["get_misses"] == 1 and b.stats["set_pages"] == 3
    b.close()
    # Without SGLang's enable_storage_metrics no batch is kept.
    b = backend(daemon, model="metrics", tp_size=1)
    assert b.batch_set(ks[:1], [page(40)])
    m = b.get_stats()
    assert isinstance(m, StorageMetrics) and m.backup_pgs == [] and m.backup_bandwidth == []
    b.close()


# -- end to end: a small attention model whose KV goes through the backend ---------------------


def test_end_to_end_tiny_model(daemon: Daemon) -> None:
    """The tiny model's prompt KV, copied page by page from its paged KV into a host buffer in
    SGLang's page_first host-pool layout, is stored by SGLang's page hashes with batch_set and
    set (as HiCacheController's backup does); a second run in other buffers loads it with
    batch_get and get into SGLang's flat data pages, writes them into its own host buffer at
    other indices (set_from_flat_data_page), copies them into fresh paged KV and computes only
    the rest: the same greedy output as everything recomputed."""
    from sglang.srt.mem_cache.utils import get_hash_str

    import tiny_model as tm

    L, P = tm.LAYERS, tm.BS  # SGLang's page size is the model's block size

    def host_pool() -> torch.Tensor:
        # MHATokenToKVPoolHost's "page_first" kv_buffer: (2, size, layer_num, head_num, head_dim)
        return torch.zeros(2, 8 * P, L, tm.HEADS, tm.HEAD, dtype=tm.DTYPE)

    def data_page(host: torch.Tensor, index: int) -> torch.Tensor:  # get_data_page(flat=True)
        return host[:, index:index + P].flatten()

    model = tm.TinyModel(seed=11)
    toks = list(range(9000, 9000 + 3 * P + 7))  # 3 whole pages and a partial one
    steps = 6
    pages = len(toks) // P
    keys, prior = [], None
    for i in range(pages):  # SGLang's page keys: a hash chain over each page's token ids
        prior = get_hash_str(toks[i * P:(i + 1) * P], prior)
        keys.append(prior)
    table_a, table_b = [4, 11, 2, 20, 7], [15, 1, 9, 30, 22]
    ref = tm.generate(model, toks, steps, table_a)

    # Run A: prefill, back the prompt's whole pages up to the host pool, store them.
    b = backend(daemon, tp_size=1, model="tiny-model")
    kvc = tm.paged_kv(None)
    logits = model.forward(toks, 0, kvc, table_a)
    host_a, at_a = host_pool(), [3 * P, 1 * P, 6 * P]  # host indices of the pages
    for i in range(pages):
        for layer, cache in enumerate(kvc.values()):
            host_a[:, at_a[i]:at_a[i] + P, layer] = cache[:, table_a[i]]
    assert b.batch_set(keys[:-1], [data_page(host_a, at_a[i]) for i in range(pages - 1)])
    assert b.set(keys[-1], data_page(host_a, at_a[-1]))
    assert tm.same_output(tm.decode(model, logits, len(toks), kvc, table_a, steps), ref)
    b.close()

    # Run B: another backend, host pool and paged KV; loads what kvtierd holds.
    b = backend(daemon, tp_size=1, model="tiny-model")
    host_b, at_b = host_pool(), [5 * P, 0, 2 * P]
    dummy = [torch.zeros(2 * L * P * tm.HEADS * tm.HEAD, dtype=tm.DTYPE) for _ in keys]
    got = b.batch_get(keys[:-1], dummy[:-1]) + [b.get(keys[-1], dummy[-1])]
    assert all(g is d for g, d in zip(got, dummy))
    # (SGLang asks batch_exists first; here, with no host pool registered (it needs
    # torchvision), the backend learns the flat page's size from the first page it sees.)
    assert b.batch_exists(keys) == pages
    for i in range(pages):  # set_from_flat_data_page
        host_b[:, at_b[i]:at_b[i] + P] = got[i].reshape(2, P, L, tm.HEADS, tm.HEAD)
    kvc = tm.paged_kv(None)
    for i in range(pages):  # load_to_device
        for layer, cache in enumerate(kvc.values()):
            cache[:, table_b[i]] = host_b[:, at_b[i]:at_b[i] + P, layer]
    hit = pages * P
    logits = model.forward(toks[hit:], hit, kvc, table_b)
    assert tm.same_output(tm.decode(model, logits, len(toks), kvc, table_b, steps), ref)
    b.close()


# -- never stall the engine: deadlines, the circuit breaker, settings refused ----------------


def _wait_until(cond: Any, timeout: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _calls(b: Any, ks: list, vals: list) -> Any:
    """SGLang's prefetch and backup calls in one go: (seconds, batch_exists, batch_get hits,
    batch_set)."""
    t0 = time.perf_counter()
    n = b.batch_exists(ks)
    got = b.batch_get(ks, [torch.zeros(PAGE_BYTES, dtype=torch.uint8) for _ in ks])
    ok = b.batch_set(hkeys("stall-new", 2), vals[:2])
    return time.perf_counter() - t0, n, sum(g is not None for g in got), ok


def test_calls_bounded_when_daemon_hangs(tmp_path: Any) -> None:
    """The daemon SIGSTOPped: with the default deadline (deadline_ms 100) SGLang's calls take
    no longer than with no daemon at all, plus the deadline, plus 20 ms, and answer misses;
    later calls answer at once (the circuit breaker); once the daemon runs again, the
    background probe reconnects and the pages are hits again."""
    d = Daemon()
    try:
        none = backend(d, deadline_ms=None, unix_path=str(tmp_path / "none"))
        ks = hkeys("stall", 4)
        vals = [page(60 + i) for i in range(4)]
        none.set("warm", page(0))  # learns the page size
        base = max(_calls(none, ks, vals)[0] for _ in range(3))
        none.close()
        b = backend(d, deadline_ms=None, probe_ms=20)
        assert b.deadline_ms == 100
        assert b.batch_set(ks, vals) is True and b.batch_exists(ks) == 4
        os.kill(d.proc.pid, signal.SIGSTOP)
        try:
            for _ in range(3):
                took, n, hits, ok = _calls(b, ks, vals)
                assert (n, hits, ok) == (0, 0, False)
                assert took <= base + 0.100 + STALL_SLACK, (took, base)
            st = b.kvtier_stats()
            assert st["trips"] == 1 and st["short_circuited"] >= 3
        finally:
            os.kill(d.proc.pid, signal.SIGCONT)
        assert _wait_until(lambda: b.batch_exists(ks) == 4)
        assert b.kvtier_stats()["recoveries"] == 1
        b.close()
    finally:
        d.stop(signal.SIGKILL)


def test_daemon_not_up_at_start(tmp_path: Any, caplog: Any) -> None:
    """The backend built before kvtierd: misses with one warning line however many calls
    (all counted), and hits once the daemon is up, reached by the background probe."""
    sock = str(tmp_path / "later.sock")
    ks = hkeys("later", 2)
    vals = [page(70), page(71)]
    with caplog.at_level("WARNING", logger="kvtier.sglang"):
        b = StorageBackendFactory.create_backend("dynamic", HiCacheStorageConfig(
            tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
            is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
            model_name="later", extra_config={
                "backend_name": "kvtier", "module_path": "kvtier.sglang",
                "class_name": "KvtierStorage", "unix_path": sock, "probe_ms": 20}), None)
        for _ in range(10):
            assert b.batch_set(ks, vals) is False
            assert b.batch_exists(ks) == 0
    lines = [r for r in caplog.records if r.name == "kvtier.sglang"]
    assert len(lines) == 1, [r.getMessage() for r in lines]
    st = b.kvtier_stats()
    assert st["trips"] == 1 and st["short_circuited"] >= 19
    d = Daemon("--unix", sock)
    try:
        assert _wait_until(lambda: b.batch_set(ks, vals) is True)
        assert b.batch_exists(ks) == 2 and b.kvtier_stats()["recoveries"] == 1
        b.close()
    finally:
        d.stop(signal.SIGKILL)


@pytest.mark.parametrize("bad, names", [
    ({"unix_pth": "/x"}, "'unix_pth'"),
    ({"timeout_ms": 5000}, "deadline_ms"),
    ({"reconnect_s": 1.0}, "probe_ms"),
    ({"deadline_ms": "soon"}, "'deadline_ms'"),
    ({"probe_ms": 0}, "'probe_ms'"),
])
def test_wrong_settings_refused_at_start(tmp_path: Any, bad: dict, names: str) -> None:
    """A key neither the backend nor SGLang reads (a typo, or one this version replaced), or
    a malformed number: SGLang's factory fails with the key named."""
    ec = {"backend_name": "kvtier", "module_path": "kvtier.sglang",
          "class_name": "KvtierStorage", "unix_path": str(tmp_path / "none"), **bad}
    cfg = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
        model_name="m", extra_config=ec)
    with pytest.raises(ValueError, match=names):
        StorageBackendFactory.create_backend("dynamic", cfg, None)
