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


# -- hybrid models: the per-pool v2 calls ---------------------------------------------------


def _fill(host: Any, slot: int, seed: int) -> torch.Tensor:
    """Random bytes into the page at slot of a host pool (through its own flat-page copy);
    the page's bytes."""
    page = host.get_dummy_flat_data_page()
    g = torch.Generator().manual_seed(seed)
    page.view(torch.uint8).copy_(torch.randint(0, 256, (page.numel() * page.element_size(),),
                                               dtype=torch.uint8, generator=g))
    host.set_from_flat_data_page(slot, page)
    return _bytes(host, slot)


def _bytes(host: Any, slot: int) -> torch.Tensor:
    return host.get_data_page(slot, flat=True).contiguous().view(torch.uint8).clone()


def _hybrid_pools() -> Any:
    """A hybrid model's host pools as SGLang holds them: the full-attention KV
    (MHATokenToKVPoolHost, the anchor), a sliding-window KV pool of its own layers (another
    MHATokenToKVPoolHost) and the Mamba state pool (MambaPoolHost: a state slot per page,
    temporal and conv states of two layers)."""
    kv = _host_pool("page_first")
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    dev = MHATokenToKVPool(size=64, page_size=4, dtype=torch.bfloat16, head_num=1, head_dim=8,
                           layer_num=2, device="cpu", enable_memory_saver=False,
                           enable_alt_stream=False)
    swa = MHATokenToKVPoolHost(dev._mha_buffer_info(), 2.0, 0, 4, "page_first",
                               pin_memory=False, device="cpu", device_capacity_tokens=64,
                               start_layer=0, end_layer=2)
    states = MambaStateBufferInfo(temporal=torch.zeros(2, 9, 4, 8, dtype=torch.float32),
                                  conv=(torch.zeros(2, 9, 3, 16, dtype=torch.bfloat16),))
    mamba = MambaPoolHost(states, 2.0, 0, device_capacity=8, pin_memory=False, device="cpu",
                          layout="page_first")
    return kv, swa, mamba


def _pages(ps: int, at: list) -> torch.Tensor:
    """Host indices of whole pages starting at page numbers at (ps slots a page)."""
    return torch.cat([torch.arange(a * ps, (a + 1) * ps, dtype=torch.int64) for a in at])


@pytest.mark.hostpool
@pytest.mark.parametrize("v1", [0, 1])
def test_v2_hybrid_pools_round_trip_and_trailing_hits(daemon: Daemon, v1: int) -> None:
    """A Mamba + sliding-window hybrid (SGLang's own host pools and PoolTransfer): the KV pages
    go through batch_set_v1 (interface_v1) or batch_set, the SWA window (the last 2 pages) and
    the Mamba state (the last page) through batch_set_v2, as HybridCacheController's backup
    does, for a 4-page and then a 6-page chain. batch_exists_v2 then finds the prefixes that can
    be restored (4 and 6, not 5: no state ends there), each pool's own boundary; batch_get_v2
    brings each pool's pages back byte-exact into other slots, a miss leaves its slot alone,
    and the SWA pool holds only window pages."""
    from sglang.srt.mem_cache.hicache_storage import (
        PoolHitPolicy,
        PoolName,
        PoolTransfer,
        PoolTransferResult,
        count_pool_hits,
    )

    kv, swa, mamba = _hybrid_pools()
    b = backend(daemon, interface_v1=v1, model="hybrid-%d" % v1, tp_size=1)
    b.register_mem_pool_host(kv)
    b.register_mem_host_pool_v2(swa, PoolName.SWA)
    b.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
    b.on_host_pools_registered()
    ks = hkeys("hybrid", 6)
    ps = kv.page_size
    kv_at = [2, 3, 4, 5, 6, 7]
    kv_want = [_fill(kv, a * ps, 100 + i) for i, a in enumerate(kv_at)]
    swa_at = {2: 1, 3: 2, 4: 3, 5: 4}  # page number in the chain -> SWA pool page
    swa_want = {i: _fill(swa, a * ps, 200 + i) for i, a in swa_at.items()}
    mamba_at = {3: 1, 5: 2}  # the states at the ends of the two chains
    mamba_want = {i: _fill(mamba, a, 300 + i) for i, a in mamba_at.items()}

    def trailing(name: Any, pool: Any, pages: list, at: dict) -> Any:
        return PoolTransfer(name=name, keys=[ks[i] for i in pages],
                            host_indices=_pages(pool.page_size, [at[i] for i in pages]),
                            hit_policy=PoolHitPolicy.TRAILING_PAGES)

    for n in (4, 6):  # two backups: a 4-page chain, then its 6-page continuation
        idx = _pages(ps, kv_at[:n])
        if v1:
            assert b.batch_set_v1(ks[:n], idx) == [True] * n
        else:
            assert b.batch_set(ks[:n], [kv.get_data_page(a * ps) for a in kv_at[:n]])
        got = b.batch_set_v2([trailing(PoolName.SWA, swa, [n - 2, n - 1], swa_at),
                              trailing(PoolName.MAMBA, mamba, [n - 1], mamba_at)])
        assert count_pool_hits(got) == {PoolName.SWA: 2, PoolName.MAMBA: 1}

    # A prefix is restorable where the SWA window (2 pages) and the Mamba state (1) end.
    query = [trailing(PoolName.SWA, swa, [4, 5], swa_at),
             trailing(PoolName.MAMBA, mamba, [5], mamba_at)]
    r = b.batch_exists_v2(ks, query)
    assert isinstance(r, PoolTransferResult)
    assert (r.kv_hit_pages, r.restorable_prefix_pages) == (6, [4, 6])
    assert r.extra_pool_hit_pages == {PoolName.KV: 6, PoolName.SWA: 6, PoolName.MAMBA: 6}
    r = b.batch_exists_v2(ks[:5], query)
    assert (r.kv_hit_pages, r.restorable_prefix_pages) == (4, [4])
    r = b.batch_exists_v2(ks + ["absent"], query)
    assert r.kv_hit_pages == 6
    # The window only: pages 0 and 1 were never in the SWA pool's window.
    r = b.batch_exists_v2(ks, [PoolTransfer(name=PoolName.SWA, keys=ks,
                                            hit_policy=PoolHitPolicy.ALL_PAGES)])
    assert (r.kv_hit_pages, r.restorable_prefix_pages) == (0, [])

    # Load the 6-page prefix into other slots of each pool.
    kv_to, swa_to, mamba_to = [10, 11, 12, 13, 14, 15], {4: 8, 5: 9}, {5: 6, 4: 7}
    if v1:
        assert b.batch_get_v1(ks, _pages(ps, kv_to)) == [True] * 6
    else:
        pages = b.batch_get(ks, [kv.get_dummy_flat_data_page() for _ in ks])
        for a, page in zip(kv_to, pages):
            kv.set_from_flat_data_page(a * ps, page)
    untouched = _bytes(mamba, mamba_to[4])
    got = b.batch_get_v2([trailing(PoolName.SWA, swa, [4, 5], swa_to),
                          trailing(PoolName.MAMBA, mamba, [5, 4], mamba_to)])
    assert got == {PoolName.SWA: [True, True], PoolName.MAMBA: [True, False]}
    for i, a in enumerate(kv_to):
        assert torch.equal(_bytes(kv, a * ps), kv_want[i])
    for i in (4, 5):
        assert torch.equal(_bytes(swa, swa_to[i] * ps), swa_want[i])
    assert torch.equal(_bytes(mamba, mamba_to[5]), mamba_want[5])
    assert torch.equal(_bytes(mamba, mamba_to[4]), untouched)  # the miss: left as it was
    assert b.stats["errors"] == 0
    # With interface_v1 each pool's pages move in place (its buffer segments), else as
    # SGLang's flat data pages; each pool in namespaces of its own.
    assert b._forms["mamba"][0][0] == ("v2-mamba-v1-page_first-0" if v1 else
                                       "v2-mamba-flat-page_first")
    b.close()


@pytest.mark.hostpool
def test_v2_through_sglangs_hybrid_cache_controller(daemon: Daemon) -> None:
    """SGLang's HybridCacheController itself (its methods, on a controller holding only what
    they read: the backend, a real HostPoolGroup of the KV, SWA and Mamba host pools) drives
    the backend: its backup (_page_backup: batch_set_v2 for the SWA window and the Mamba state
    of a 5-page request, then batch_set_v1 for the KV pages), the hit query of a longer request
    sharing those pages (_storage_hit_query: batch_exists_v2, SGLang's page hashes), and the
    load (_page_transfer_kv_batch, then _page_transfer_sidecar, which re-aligns the window to
    the hit and calls batch_get_v2) into other slots of each pool: byte-exact."""
    from queue import Queue
    from types import SimpleNamespace

    kv, swa, mamba = _hybrid_pools()
    from sglang.srt.mem_cache.hicache_storage import (
        HiCacheStorageExtraInfo,
        PoolHitPolicy,
        PoolName,
        PoolTransfer,
    )
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (
        HybridCacheController,
        PrefetchOperation,
        StorageOperation,
    )
    from sglang.srt.mem_cache.pool_host.group import HostPoolGroup, PoolEntry
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    cfg = config(daemon, model="hybrid-ctrl", tp_size=1, interface_v1=1)
    b = StorageBackendFactory.create_backend("dynamic", cfg, None)
    group = HostPoolGroup([
        PoolEntry(PoolName.KV, kv, None, lambda layer: layer, is_primary_index_anchor=True),
        PoolEntry(PoolName.SWA, swa, None, lambda layer: layer),
        PoolEntry(PoolName.MAMBA, mamba, None, lambda layer: layer)])
    ctrl = HybridCacheController.__new__(HybridCacheController)
    ctrl.storage_backend, ctrl.storage_config, ctrl.storage_backend_type = b, cfg, "dynamic"
    ctrl.mem_pool_host, ctrl.storage_host_pool, ctrl.page_size = group, kv, kv.page_size
    ctrl.page_get_func, ctrl.page_set_func = ctrl._page_get_zero_copy, ctrl._page_set_zero_copy
    ctrl.prefetch_sync_queue = Queue()
    b.register_mem_pool_host(kv)  # as attach_storage_backend does
    for entry in group.entries[1:]:
        b.register_mem_host_pool_v2(entry.host_pool, entry.name)
    b.on_host_pools_registered()

    ps = kv.page_size
    toks = list(range(7000, 7000 + 5 * ps))
    hashes = get_storage_hash_str(toks, None, page_size=ps)
    kv_want = [_fill(kv, a * ps, 700 + a) for a in range(1, 6)]
    swa_want = [_fill(swa, a * ps, 800 + a) for a in (1, 2)]  # the window: pages 3 and 4
    mamba_want = _fill(mamba, 1, 900)  # the state after page 4
    trailing = PoolHitPolicy.TRAILING_PAGES
    op = StorageOperation(_pages(ps, [1, 2, 3, 4, 5]), toks, hash_value=hashes, pool_transfers=[
        PoolTransfer(PoolName.SWA, host_indices=_pages(ps, [1, 2]), keys=hashes[3:],
                     hit_policy=trailing),
        PoolTransfer(PoolName.MAMBA, host_indices=torch.tensor([1]), keys=hashes[4:],
                     hit_policy=trailing)])
    ctrl._page_backup(op)
    assert op.completed_tokens == 5 * ps
    assert op.pool_storage_result.extra_pool_hit_pages == {PoolName.SWA: 2, PoolName.MAMBA: 1}

    # A longer request over the same 5 pages: what the storage can restore.
    longer = toks + list(range(100, 100 + 2 * ps))
    pf = PrefetchOperation(SimpleNamespace(rid="r2"), longer, pool_transfers=[
        PoolTransfer(PoolName.SWA, host_indices=_pages(ps, [5, 6]), keys=[None, None],
                     hit_policy=trailing),
        PoolTransfer(PoolName.MAMBA, host_indices=torch.tensor([5]), keys=[None],
                     hit_policy=trailing)])
    hit, tokens = ctrl._storage_hit_query(pf)
    assert hit == hashes and tokens == 5 * ps
    assert pf.pool_storage_result.restorable_prefix_pages == [5]
    assert pf.query_pool_hit_pages == {PoolName.KV: 5, PoolName.SWA: 5, PoolName.MAMBA: 5}

    pf.hash_value = hit
    assert ctrl._page_transfer_kv_batch(pf, hit, _pages(ps, [8, 9, 10, 11, 12]),
                                        HiCacheStorageExtraInfo(), []) == 5
    ctrl._page_transfer_sidecar(pf, 5)
    ack = ctrl.prefetch_sync_queue.get_nowait()
    assert ack.pool_hits == {PoolName.SWA: 2, PoolName.MAMBA: 1}
    for i, a in enumerate((8, 9, 10, 11, 12)):
        assert torch.equal(_bytes(kv, a * ps), kv_want[i])
    assert torch.equal(_bytes(swa, 5 * ps), swa_want[0])
    assert torch.equal(_bytes(swa, 6 * ps), swa_want[1])
    assert torch.equal(_bytes(mamba, 5), mamba_want)
    b.close()


@pytest.mark.hostpool
def test_v2_bad_transfers_answer_misses_and_change_nothing(daemon: Daemon) -> None:
    """A pool never registered, host indices that do not match the keys, a hit policy the
    backend does not serve (BLOCK_GROUPS), and kvtierd gone: each answers misses for that pool
    alone (a warning, counted), never raises into SGLang, and stores nothing."""
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

    kv, swa, mamba = _hybrid_pools()
    d = Daemon()
    b = backend(d, interface_v1=1, model="hybrid-bad", tp_size=1)
    b.register_mem_pool_host(kv)
    b.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
    ks = hkeys("bad", 2)
    _fill(mamba, 1, 1)
    assert b.batch_set_v1(ks, _pages(kv.page_size, [1, 2])) == [True, True]
    got = b.batch_set_v2([
        PoolTransfer(name=PoolName.SWA, keys=ks[:1], host_indices=_pages(4, [1])),
        PoolTransfer(name=PoolName.MAMBA, keys=ks, host_indices=torch.tensor([1]))])
    assert got == {PoolName.SWA: [False], PoolName.MAMBA: [False, False]}
    assert b.stats["errors"] == 2
    mam = [PoolTransfer(name=PoolName.MAMBA, keys=ks[1:],
                        hit_policy=PoolHitPolicy.TRAILING_PAGES)]
    assert b.batch_exists_v2(ks, mam).kv_hit_pages == 0  # nothing was stored
    assert b.batch_set_v2([PoolTransfer(name=PoolName.MAMBA, keys=ks[1:],
                                        host_indices=torch.tensor([1]))]) == {
        PoolName.MAMBA: [True]}
    assert b.batch_exists_v2(ks[:1], mam).kv_hit_pages == 0  # page 0 ends no stored state
    r = b.batch_exists_v2(ks, [PoolTransfer(name=PoolName.MAMBA, keys=ks,
                                            hit_policy=PoolHitPolicy.BLOCK_GROUPS)])
    assert r.kv_hit_pages == 0 and b.stats["errors"] == 3
    assert b.batch_exists_v2(ks, mam).restorable_prefix_pages == [2]
    d.stop(signal.SIGKILL)
    start = time.monotonic()
    got = b.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, keys=ks[1:],
                                       host_indices=torch.tensor([3]))])
    assert got == {PoolName.MAMBA: [False]}
    assert b.batch_exists_v2(ks, mam).kv_hit_pages == 0
    assert b.batch_set_v2([PoolTransfer(name=PoolName.MAMBA, keys=ks[1:],
                                        host_indices=torch.tensor([1]))]) == {
        PoolName.MAMBA: [False]}
    assert time.monotonic() - start < 2.0
    assert b.kvtier_stats()["trips"] == 1
    b.close()


@pytest.mark.hostpool
def test_mla_tp2_latent_kv_stored_once_mamba_state_per_rank(daemon: Daemon) -> None:
    """MLA with two TP ranks (SGLang's MLATokenToKVPoolHost on each): the latent KV, the same
    on every rank, is stored once: rank 1 (not SGLang's storage writer) answers its saves as
    done and writes nothing, rank 0 writes, and rank 1 reads rank 0's pages into its own pool.
    The Mamba state of a hybrid MLA model is split across ranks: each rank stores and reads
    back its own."""
    _host_pool()  # skips, saying why, where SGLang's host pools do not import
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    def mla_pool() -> Any:
        dev = MLATokenToKVPool(size=64, page_size=4, dtype=torch.bfloat16, kv_lora_rank=16,
                               qk_rope_head_dim=8, layer_num=2, device="cpu",
                               enable_memory_saver=False)
        return MLATokenToKVPoolHost(dev._mla_buffer_info(), 2.0, 0, 4, "page_first",
                                    pin_memory=False, device="cpu", device_capacity_tokens=64,
                                    start_layer=0, end_layer=2, target_layer_num=2)

    ranks = []
    for r in (0, 1):
        kv, mamba = mla_pool(), _hybrid_pools()[2]
        b = backend(daemon, mla=True, tp_rank=r, tp_size=2, interface_v1=1, model="mla-tp2")
        b.register_mem_pool_host(kv)
        b.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
        ranks.append((b, kv, mamba))
    (b0, kv0, m0), (b1, kv1, m1) = ranks
    assert b0.writer and not b1.writer and b0.shard == b1.shard == "mla"
    ps = kv0.page_size
    ks = hkeys("mla", 3)
    want = [_fill(kv0, a * ps, 400 + a) for a in (1, 2, 3)]
    for a in (1, 2, 3):
        _fill(kv1, a * ps, 500 + a)  # not what rank 0 holds: shows whose bytes arrive
    assert b1.batch_set_v1(ks, _pages(ps, [1, 2, 3])) == [True] * 3  # SGLang: "done"
    assert b0.batch_exists(ks) == 0 and b1.batch_exists(ks) == 0  # but nothing stored
    assert b0.batch_set_v1(ks, _pages(ps, [1, 2, 3])) == [True] * 3
    assert b1.batch_exists(ks) == 3
    assert b1.batch_get_v1(ks, _pages(ps, [5, 6, 7])) == [True] * 3
    for i, a in enumerate((5, 6, 7)):
        assert torch.equal(_bytes(kv1, a * ps), want[i])

    state = {0: _fill(m0, 1, 600), 1: _fill(m1, 1, 601)}
    assert not torch.equal(state[0], state[1])
    for r, (b, kv, m) in enumerate(ranks):
        got = b.batch_set_v2([PoolTransfer(name=PoolName.MAMBA, keys=ks[2:],
                                           host_indices=torch.tensor([1]))])
        assert got == {PoolName.MAMBA: [True]}
    for r, (b, kv, m) in enumerate(ranks):
        q = [PoolTransfer(name=PoolName.MAMBA, keys=ks[2:],
                          hit_policy=PoolHitPolicy.TRAILING_PAGES)]
        assert b.batch_exists_v2(ks, q).kv_hit_pages == 3
        got = b.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, keys=ks[2:],
                                           host_indices=torch.tensor([4]))])
        assert got == {PoolName.MAMBA: [True]} and torch.equal(_bytes(m, 4), state[r])
    for b, _, _ in ranks:
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


@pytest.mark.hostpool
def test_kvtier_counters_reach_sglangs_metrics(daemon: Daemon, tmp_path: Any) -> None:
    """What StorageMetrics has no fields for (hits, misses, bytes, seconds, failures, the
    circuit breaker's trips) reaches SGLang's metrics too: each step of SGLang's own
    check_hicache_events (as above) adds what the backend's counters gained to
    kvtier_sglang_<name>_total in prometheus_client's registry, which SGLang's /metrics
    serves, labelled like SGLang's storage metrics; a second step adds nothing more."""
    try:
        import prometheus_client
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    except Exception as e:
        if HOSTPOOL_VENV:
            raise
        pytest.skip("SGLang's scheduler cache does not import here (%s: %s)" % (
            type(e).__name__, e))
    from types import SimpleNamespace

    def step(b: Any) -> None:
        """SGLang's scheduler step, with its metrics on, over this backend."""
        coll = SimpleNamespace(log_storage_metrics=lambda m: None)
        cache = SimpleNamespace(
            linker=None, _drain_async_work=lambda: None, flush_pending_backups=lambda: None,
            _sync_hicache_ready_counts=lambda: (0, 0, [], []),
            writing_check=lambda finish_count: None, loading_check=lambda finish_count: None,
            enable_storage=True, buffer_pipeline=None, enable_storage_metrics=True,
            storage_metrics_collector=coll, cache_controller=SimpleNamespace(storage_backend=b),
            prefetch_outcome_stats_snapshot=lambda: {})
        UnifiedRadixCache.check_hicache_events(cache)  # type: ignore[arg-type]

    def value(model: str, name: str) -> float:
        v = prometheus_client.REGISTRY.get_sample_value(
            "kvtier_sglang_%s_total" % name, {"storage_backend": "kvtier", "model": model,
                                              "tp_rank": "0", "dp_rank": "0", "pp_rank": "0"})
        return 0.0 if v is None else v

    b = backend(daemon, model="counted", tp_size=1, metrics=True)
    ks = hkeys("counted", 4)
    assert b.batch_set(ks[:3], [page(40 + i) for i in range(3)])
    outs = [torch.zeros(PAGE_BYTES, dtype=torch.uint8) for _ in ks]
    assert sum(g is not None for g in b.batch_get(ks, outs)) == 3
    # no host pool registered for the zero-copy call: a failure, answered as a miss
    assert b.batch_get_v1(ks[:1], torch.arange(4)) == [False]
    step(b)
    want = {"get_hits": 3, "get_misses": 1, "get_bytes": 3 * PAGE_BYTES, "set_pages": 3,
            "set_failed": 0, "set_bytes": 3 * PAGE_BYTES, "failures": 1, "warnings": 1,
            "trips": 0}
    assert {k: value("counted", k) for k in want} == want
    assert value("counted", "get_seconds") > 0 and value("counted", "set_seconds") > 0
    step(b)  # nothing new: nothing added
    assert {k: value("counted", k) for k in want} == want
    b.close()

    # kvtierd not there: the breaker's trip and the calls it answered at once
    b = backend(daemon, model="counted-down", tp_size=1, metrics=True,
                unix_path=str(tmp_path / "none"))
    for _ in range(3):
        assert b.batch_set(ks[:1], [page(1)]) is False
    step(b)
    assert value("counted-down", "trips") == 1 and value("counted-down", "failures") == 1
    assert value("counted-down", "short_circuited") == 2
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
        d.freeze()
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
