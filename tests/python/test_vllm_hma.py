"""test_vllm_hma.py: kvtier.vllm.KvtierConnector with vLLM's hybrid KV cache manager (SupportsHMA).

A hybrid configuration built offline: vLLM's own KVCacheConfig with two KV cache groups (full
attention and a sliding window of 32 tokens, two layers each, block size 16), vLLM's own
KVCacheManager (its HybridKVCacheCoordinator) allocating each request's blocks per group, with
vLLM's null block where a sliding window no longer reaches; the connector built by vLLM's
KVConnectorFactory with that config, its scheduler side and worker side driven as vLLM's
scheduler and model runner drive them, a real kvtierd behind it. Serving a hybrid model is not
possible on this CPU (no vllm._C); the groups, blocks and calls are vLLM's own.
"""

from __future__ import annotations

import itertools
import logging
import signal
import time
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch

from conftest import Daemon
from vllm_harness import forward, handed_back, load_with_daemon_killed, settle, skip_without_vllm
from vllm_harness import real_scheduler, run_step, transfer_config
from vllm_harness import vllm_config as harness_vllm_config

try:
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                                   KVConnectorRole, supports_hma)
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
                                            MambaSpec, SlidingWindowSpec)
    from vllm.v1.request import Request
except Exception as e:  # noqa: BLE001 - any import failure means: no usable vLLM here
    skip_without_vllm(e)

import kvtier.vllm as kv  # noqa: E402
from kvtier.keys import KEY_TOKENS, KEYS_TAG, key_tokens  # noqa: E402
import test_vllm  # noqa: E402

# vLLM's ModelConfig of a tiny Llama, which its Scheduler needs (test_vllm.py's fixture, this
# module's own instance).
tiny_model_config = test_vllm.tiny_model_config

BS, HEADS, HEAD, NBLOCKS, WINDOW = 16, 2, 8, 40, 32
DTYPE = torch.bfloat16
NAMES = ["model.layers.%d.self_attn.attn" % i for i in range(4)]
FULL, SWA = NAMES[0::2], NAMES[1::2]  # group 0: layers 0 and 2; group 1: layers 1 and 3
SETTLE_S = 5.0  # seconds a step's saves may take to be stored
_ids = itertools.count(1)
_tok = itertools.count(0)


def hybrid_config(*extra_groups: Any, full_layers: List[str] = FULL,
                  swa_layers: List[str] = SWA) -> "KVCacheConfig":
    full = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD, dtype=DTYPE)
    swa = SlidingWindowSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD, dtype=DTYPE,
                            sliding_window=WINDOW)
    return KVCacheConfig(num_blocks=NBLOCKS, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(full_layers, full),
                                          KVCacheGroupSpec(swa_layers, swa), *extra_groups])


MODEL = "tiny-hybrid"


def vllm_config(d: Daemon, **extra: Any) -> "VllmConfig":
    return harness_vllm_config(d, MODEL, BS, **extra)


def paged(seed: Any) -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    shape = (2, NBLOCKS, BS, HEADS, HEAD)
    return {n: (torch.randn(*shape, generator=g) if g is not None else torch.zeros(*shape)
                ).to(DTYPE) for n in NAMES}


class Engine:
    """vLLM's KV cache manager for the hybrid config, the connector's two roles, and the
    worker's paged tensors."""

    def __init__(self, d: Daemon, seed: Any, kvc: Any = None,
                 kv: Optional[Dict[str, torch.Tensor]] = None, **extra: Any) -> None:
        self.kvc = kvc or hybrid_config()
        self.manager = KVCacheManager(self.kvc, max_model_len=1024, scheduler_block_size=BS,
                                      hash_block_size=BS, enable_caching=False)
        cfg = vllm_config(d, **extra)
        self.sched = KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER,
                                                         self.kvc)
        self.worker = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, self.kvc)
        self.kv = kv if kv is not None else paged(seed)
        self.worker.register_kv_caches(self.kv)
        self.loaded: Any = None  # the metadata of admit's load between steps, if any

    def admit(self, r: "Request") -> Tuple[int, Any]:
        """vLLM's scheduler admitting a new request: the connector's hit, the manager's
        blocks for all of it (the hit as external computed tokens), update_state_after_alloc;
        with several groups a hit is loaded between steps (load_between), as vLLM 0.34 has
        it with load_async; then the step's metadata with the rest of the prompt scheduled
        (with one group, the hit's loads in it)."""
        n, load_async = self.sched.get_num_new_matched_tokens(r, 0)
        assert load_async is (bool(n) and len(self.kvc.kv_cache_groups) > 1)
        got = self.manager.allocate_slots(r, r.num_tokens - n, num_external_computed_tokens=n,
                                          delay_cache_blocks=load_async)
        assert got is not None
        self.sched.update_state_after_alloc(r, self.manager.get_blocks(r.request_id), n)
        self.loaded = self.load_between(r) if load_async else None
        r.num_computed_tokens = n
        ids = self.manager.get_block_ids(r.request_id)
        nr = NewRequestData.from_request(r, ids, list(r.all_token_ids))
        so = SchedulerOutput(scheduled_new_reqs=[nr],
                             scheduled_cached_reqs=CachedRequestData.make_empty(),
                             num_scheduled_tokens={r.request_id: r.num_tokens - n},
                             total_num_scheduled_tokens=r.num_tokens - n,
                             scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
                             finished_req_ids=set(), free_encoder_mm_hashes=[])
        return n, self.sched.build_connector_meta(so)

    def load_between(self, r: "Request") -> Any:
        """The steps in which ``r`` waits for its load (vLLM schedules none of its tokens):
        the worker's calls until get_transfer_results reports the load done, with no block
        among the load errors and the request not failed. Returns the metadata that carried
        the loads."""
        meta = self.sched.build_connector_meta(waiting_output())
        w = self.worker
        w.bind_connector_metadata(meta)
        w.start_load_kv(None)
        deadline = time.monotonic() + SETTLE_S
        while True:
            w.wait_for_save()
            res = w.get_transfer_results(set())
            assert w.get_block_ids_with_load_errors() == set() and not res.failed_recving
            if res.finished_recving:
                assert res.finished_recving == {r.request_id}
                break
            assert time.monotonic() < deadline, "the load was never reported"
            time.sleep(0.005)
        w.clear_connector_metadata()
        return meta

    def step(self, meta: Any) -> set:
        """The worker's calls of one forward (model runner and attention layers). Saves are
        asynchronous: then waits (as a test, outside the step) until the step's save jobs are
        stored, so that another engine's lookup finds them."""
        errors = forward(self.worker, self.kv, meta)
        settle(self.worker, SETTLE_S)
        return errors

    def finish(self, r: "Request") -> bool:
        """request_finished_all_groups, then, when the scheduler holds the blocks (a save was
        planned, in any group), get_finished until the worker hands them back, then vLLM frees
        them. Returns whether they were held."""
        ids = self.manager.get_block_ids(r.request_id)
        held, params = self.sched.request_finished_all_groups(r, ids)
        assert params is None
        if held:
            handed_back(self.worker, r.request_id)
        self.manager.free(r)
        return held

    def close(self) -> None:
        self.worker.shutdown()
        self.sched.shutdown()


class NotHybrid(KVConnectorBase_V1):
    """A connector class without SupportsHMA (only its class is looked at)."""


def request(tokens: List[int]) -> "Request":
    return Request("hreq-%d" % next(_ids), tokens, SamplingParams(max_tokens=4), None)


def prompt(pages: int, extra: int) -> List[int]:
    base = next(_tok) * 100_000 + 7
    return list(range(base, base + pages * BS + extra))


def waiting_output() -> "SchedulerOutput":
    """A step of vLLM's scheduler that schedules no token (the requests wait for their
    loads)."""
    return SchedulerOutput(scheduled_new_reqs=[],
                           scheduled_cached_reqs=CachedRequestData.make_empty(),
                           num_scheduled_tokens={}, total_num_scheduled_tokens=0,
                           scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
                           finished_req_ids=set(), free_encoder_mm_hashes=[])


def stored_tiers(d: Daemon, e: Engine, r: "Request", gid: int, pages: int) -> List[int]:
    """Where kvtierd holds each page of group ``gid``'s chain of ``r`` (0: index only)."""
    from kvtier.vllm.common import group_chain

    model = MODEL + "|groups=2"  # a hybrid config's own namespace
    base = kv.key_chain(r, BS, kv.chain_root(model), [], pages)
    keys = group_chain(base, gid, [], pages)
    with d.client(model=model, salt=kv.rank_salt(0, 1, 0, 1),
                  page_size=KEY_TOKENS, adapter=KEYS_TAG,
                  block_bytes=e.worker._layout.page_bytes) as c:
        m = c.match([t for k in keys for t in key_tokens(k)], probe=True)
        return list(m.tiers) + [0] * (pages - len(m.tiers))


def window_start(pages: int) -> int:
    return max(0, pages * BS - (WINDOW - 1)) // BS


def test_vllm_keeps_its_hybrid_manager_on(vd: Daemon, monkeypatch: Any, caplog: Any) -> None:
    """The connector class is a SupportsHMA: vLLM's own check on the configured connector
    (KVConnectorFactory.supports_hma_config) passes, and VllmConfig leaves the hybrid KV cache
    manager on without the "Turning off hybrid kv cache manager" warning. This CPU's platform
    (no vllm._C: vLLM's UnspecifiedPlatform) turns the manager off for every config, so the
    platform's answer is set to a GPU platform's; a connector class that is not a SupportsHMA
    (NotHybrid, loaded by module path the same way) still turns it off: the rule decides."""
    from vllm.platforms import current_platform

    assert supports_hma(kv.KvtierConnector)
    assert KVConnectorFactory.supports_hma_config(transfer_config(vd, MODEL))
    monkeypatch.setattr(type(current_platform), "support_hybrid_kv_cache",
                        classmethod(lambda cls: True))
    with caplog.at_level(logging.WARNING):
        assert vllm_config(vd).scheduler_config.disable_hybrid_kv_cache_manager is False
    assert "Turning off hybrid kv cache manager" not in caplog.text
    other = KVTransferConfig(kv_connector="NotHybrid", kv_connector_module_path=__name__,
                             kv_role="kv_both")
    cfg = VllmConfig(kv_transfer_config=other, device_config=DeviceConfig(device="cpu"),
                     cache_config=CacheConfig(block_size=BS))
    assert cfg.scheduler_config.disable_hybrid_kv_cache_manager is True


@pytest.mark.parametrize("extra,zero_copy", [(5, True), (0, True), (5, False)])
def test_two_groups_round_trip_each_its_window(vd: Daemon, extra: int, zero_copy: bool) -> None:
    """Engine A saves a prompt of 8 full pages (+ extra tokens): each group stores under its
    own chain (the group id in the keys) the pages it needs, the full group all 8, the window
    group only its window's (pages 5..7: those a hit of 8 or of 7 pages loads), after a gap
    of 5 pages without bytes; kvtierd holds 8 + 3 pages, no more. Engine B, fresh zeroed
    tensors, the same prompt: a hit of every page vLLM can take (8, or 7 when the prompt ends
    on a page boundary); the full group loads them all, the window group only the pages of
    its window (vLLM gave the pages before it its null block), each byte-exact in its own
    layers; the null block stays zero and no lease is left. Through the zero-copy mapping
    (reserve and commit with gaps, loads by location) and through the socket (keyed put and
    get with gaps)."""
    a, b = Engine(vd, seed=11, zero_copy=zero_copy), Engine(vd, seed=None, zero_copy=zero_copy)
    toks = prompt(8, extra)
    r = request(toks)
    n, meta = a.admit(r)
    assert n == 0 and not meta.loads
    saves = {t.group: (t.first, len(t.keys), t.block_ids) for t in meta.saves}
    ids_a = a.manager.get_block_ids(r.request_id)
    kept = window_start(7)
    assert kept == 5
    assert saves[0] == (0, 8, ids_a[0][:8])
    assert saves[1] == (kept, 8, ids_a[1][kept:8])
    assert a.step(meta) == set()
    a.finish(r)
    assert all(stored_tiers(vd, a, r, 0, 8))
    assert [bool(t) for t in stored_tiers(vd, a, r, 1, 8)] == [False] * kept + [True] * 3
    with vd.client() as c:
        st = c.stats()
        assert st["dram_blocks"] + st["nvme_blocks"] == 8 + 3, "only the window's pages"

    r2 = request(toks)
    hit = (len(toks) - 1) // BS
    n, meta = b.admit(r2)
    assert n == hit * BS
    ids_b = b.manager.get_block_ids(r2.request_id)
    ws = window_start(hit)
    assert ids_b[1][:ws] == [0] * ws  # vLLM's null block outside the window
    assert not meta.loads  # loaded between steps (several groups)
    loads = {t.group: (t.first, t.block_ids) for t in b.loaded.loads}
    assert loads == {0: (0, ids_b[0][:hit]), 1: (ws, ids_b[1][ws:hit])}
    assert b.step(meta) == set()
    for name in FULL:
        assert torch.equal(a.kv[name][:, ids_a[0][:hit]].view(torch.int16),
                           b.kv[name][:, ids_b[0][:hit]].view(torch.int16)), name
    for name in SWA:
        assert torch.equal(a.kv[name][:, ids_a[1][ws:hit]].view(torch.int16),
                           b.kv[name][:, ids_b[1][ws:hit]].view(torch.int16)), name
        assert not b.kv[name][:, 0].any()  # the null block untouched
    assert b.worker._store.mapped is zero_copy
    st = b.worker.get_kv_connector_stats().data
    assert st["load_pages"] == hit + (hit - ws) and st.get("load_errors", 0) == 0
    b.finish(r2)
    with vd.client() as c:
        assert c.stats()["leases"] == 0
    a.close()
    b.close()


def test_window_hit_is_the_longest_prefix_whose_window_holds_bytes() -> None:
    """The window group's hit (scheduler._window_hit): the largest h whose window pages
    [window_start(h), h) all hold bytes, whatever the pages before them hold."""
    from kvtier.vllm.common import KvGroup
    from kvtier.vllm.scheduler import _window_hit

    g = KvGroup(1, None, WINDOW - 1)
    assert [window_start(h) for h in range(1, 9)] == [0, 0, 1, 2, 3, 4, 5, 6]
    assert _window_hit(bytes([0] * 5 + [2] * 3), g, BS) == 8
    assert _window_hit(bytes([0] * 5 + [2] * 2), g, BS) == 7
    assert _window_hit(bytes([0] * 5 + [2]), g, BS) == 0, "page 4 of the window of 6 missing"
    assert _window_hit(bytes([2, 2, 0, 2]), g, BS) == 2
    assert _window_hit(bytes([2] * 6), g, BS) == 6
    assert _window_hit(b"", g, BS) == 0


def test_a_hit_needs_every_group(vd: Daemon) -> None:
    """A step whose window-group layers never came (as on another pipeline stage): the full
    group's save jobs go once its layers are in and store its pages, the window group's never
    go (nothing reserved), and a lookup of the prompt is 0 tokens, not a hit whose window-group
    KV would be missing. Computed and saved whole afterwards, it hits."""
    a, b = Engine(vd, seed=12), Engine(vd, seed=None)
    toks = prompt(6, 3)
    r = request(toks)
    n, meta = a.admit(r)
    w = a.worker
    w.bind_connector_metadata(meta)
    w.start_load_kv(None)
    for name in FULL:
        w.save_kv_layer(name, a.kv[name], None)
    w.wait_for_save()
    w.clear_connector_metadata()
    settle(w, SETTLE_S)
    assert a.finish(r)  # held until its saves were done
    assert all(stored_tiers(vd, a, r, 0, 6)) and not any(stored_tiers(vd, a, r, 1, 6))
    r2 = request(toks)
    n, meta = b.admit(r2)
    assert n == 0 and not meta.loads
    assert b.step(meta) == set()  # b computes it, and saves both groups
    b.finish(r2)
    assert all(stored_tiers(vd, a, r, 1, 6)[window_start(5):])
    r3 = request(toks)
    n, meta = a.admit(r3)
    assert n == 6 * BS and {t.group for t in a.loaded.loads} == {0, 1}
    assert a.step(meta) == set()
    a.finish(r3)
    with vd.client() as c:
        assert c.stats()["leases"] == 0
    a.close()
    b.close()


def test_unsupported_group_refused_at_start(vd: Daemon) -> None:
    """A group the connector cannot store (a Mamba layer's recurrent state in vLLM's default
    mamba_cache_mode, which keeps no state at page boundaries: test_vllm_mamba.py has those
    it stores) is refused when vLLM builds the connector, with a message naming the group and
    its spec, in both roles: not silently turned into wrong loads or misses."""
    mamba = MambaSpec(block_size=BS, shapes=((4, 8),), dtypes=(DTYPE,))
    kvc = hybrid_config(KVCacheGroupSpec(["model.layers.4.mixer"], mamba))
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ValueError, match="KV cache group 2 \\(MambaSpec"):
            KVConnectorFactory.create_connector(vllm_config(vd), role, kvc)


def unlike_config() -> "KVCacheConfig":
    """One group of three layers (unlike_layers'), as vLLM builds it for them."""
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD, dtype=DTYPE)
    return KVCacheConfig(num_blocks=NBLOCKS, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(NAMES[:3], spec)])


def unlike_layers(seed: Any) -> Dict[str, torch.Tensor]:
    """Three layers not alike (bf16 K/V, float32 K/V with other heads, an MLA-style latent with
    its block dimension first): no span plan covers them, so their pages are copied by numpy
    (seed None: zeros)."""
    g = torch.Generator().manual_seed(seed or 0)
    made = {NAMES[0]: torch.randn(2, NBLOCKS, BS, HEADS, HEAD, generator=g).to(DTYPE),
            NAMES[1]: torch.randn(2, NBLOCKS, BS, 1, 4, generator=g),
            NAMES[2]: torch.randn(NBLOCKS, BS, 24, generator=g).to(DTYPE)}
    return made if seed is not None else {n: torch.zeros_like(t) for n, t in made.items()}


def same_unlike_blocks(a: "Engine", ia: List[int], b: "Engine", ib: List[int]) -> None:
    """unlike_layers' blocks ia of engine a hold bytes, and the same bytes as blocks ib of b (the
    latent's block dimension is its first, the others' their second)."""
    for name in NAMES[:3]:
        dim = 1 if name != NAMES[2] else 0
        x, y = a.kv[name].index_select(dim, torch.tensor(ia)), \
            b.kv[name].index_select(dim, torch.tensor(ib))
        assert x.any() and torch.equal(x.view(torch.uint8), y.view(torch.uint8)), name


def test_layers_of_other_shapes_and_dtypes_round_trip(vd: Daemon) -> None:
    """One group whose layers differ (unlike_layers): pages laid out layer by layer at their
    own offsets, saved through the zero-copy mapping and loaded into another engine's tensors
    byte-exact (the numpy copies of a page whose layers are not alike)."""
    kvc = unlike_config()
    tensors = unlike_layers
    a = Engine(vd, None, kvc, tensors(31))
    b = Engine(vd, None, kvc, tensors(None))
    assert a.worker._layout.dims == [1, 1, 0]
    toks = prompt(5, 2)
    r = request(toks)
    n, meta = a.admit(r)
    assert n == 0 and a.step(meta) == set()
    ia = a.manager.get_block_ids(r.request_id)[0][:5]
    a.finish(r)
    r2 = request(toks)
    n, meta = b.admit(r2)
    assert n == 5 * BS and b.step(meta) == set()
    assert b.worker._store.mapped
    ib = b.manager.get_block_ids(r2.request_id)[0][:5]
    same_unlike_blocks(a, ia, b, ib)
    b.finish(r2)
    a.close()
    b.close()


def test_numpy_copied_save_sends_its_pages_sums(vd: Daemon) -> None:
    """A save into the mapping copied by numpy (layers not alike: no span plan, so no sums
    taken in the copy), where RESERVE's reply asks for sums (zero-copy-checksum, the default):
    the worker hashes the pages it copied and COMMIT carries the sums, so the daemon records
    them (zero_copy_client_sums) and hashes none itself on its loop (zero_copy_seals stays).
    Before, it committed without sums and the daemon hashed every page. The sums are right: a
    connector over TCP, where the daemon checks each page against its sum, loads them byte
    for byte."""
    def stats() -> Dict[str, int]:
        with vd.client() as c:
            return c.stats()

    kvc = unlike_config()
    a = Engine(vd, None, kvc, unlike_layers(33))
    assert a.worker._store.mapped
    toks = prompt(5, 2)
    r = request(toks)
    n, meta = a.admit(r)
    assert n == 0
    before = stats()
    assert a.step(meta) == set()
    mid = stats()
    assert mid["zero_copy_pages_reserve"] - before["zero_copy_pages_reserve"] == 5
    assert mid["zero_copy_client_sums"] - before["zero_copy_client_sums"] == 5, mid
    assert mid["zero_copy_seals"] == before["zero_copy_seals"], "the daemon hashed the pages"
    ia = a.manager.get_block_ids(r.request_id)[0][:5]
    a.finish(r)
    b = Engine(vd, None, kvc, unlike_layers(None), unix_path=None, tcp=vd.tcp)
    assert not b.worker._store.mapped
    r2 = request(toks)
    n, meta = b.admit(r2)
    assert n == 5 * BS and b.step(meta) == set()
    assert stats()["zero_copy_scribbles"] == mid["zero_copy_scribbles"]
    ib = b.manager.get_block_ids(r2.request_id)[0][:5]
    same_unlike_blocks(a, ia, b, ib)
    b.finish(r2)
    a.close()
    b.close()


def test_groups_of_other_page_sizes(vd: Daemon) -> None:
    """Three full-attention layers and one sliding-window layer: the window group's pages are
    a third of the full group's, padded to them (one page size per namespace); both round-trip
    byte-exact, the window group into its window's blocks only."""
    kvc = hybrid_config(full_layers=NAMES[:3], swa_layers=NAMES[3:])
    a, b = Engine(vd, 41, kvc), Engine(vd, None, kvc)
    assert [len(b.worker._layouts[g].names) for g in (0, 1)] == [3, 1]
    assert b.worker._layouts[1].page_bytes == b.worker._layouts[0].page_bytes
    toks = prompt(6, 1)
    r = request(toks)
    n, meta = a.admit(r)
    assert a.step(meta) == set()
    ia = a.manager.get_block_ids(r.request_id)
    a.finish(r)
    r2 = request(toks)
    n, meta = b.admit(r2)
    assert n == 6 * BS and b.step(meta) == set()
    ib = b.manager.get_block_ids(r2.request_id)
    ws = window_start(6)
    for name in NAMES:
        g, first = (0, 0) if name in NAMES[:3] else (1, ws)
        x, y = a.kv[name][:, ia[g][first:6]], b.kv[name][:, ib[g][first:6]]
        assert x.any() and torch.equal(x.view(torch.int16), y.view(torch.int16)), name
    b.finish(r2)
    a.close()
    b.close()


def test_asynchronous_load_of_both_groups(vd: Daemon) -> None:
    """load_async: the hit is answered as a load between steps; vLLM allocates the blocks
    (the window group's outside its window null), the step in which the request waits carries
    both groups' loads, and get_finished reports the request once both are in, byte-exact,
    with no load error."""
    a, b = Engine(vd, seed=51), Engine(vd, None, load_async=True)
    toks = prompt(7, 4)
    r = request(toks)
    assert a.step(a.admit(r)[1]) == set()
    ia = a.manager.get_block_ids(r.request_id)
    a.finish(r)
    r2 = waiting_for_its_load(b, toks, 7)
    ib = b.manager.get_block_ids(r2.request_id)
    meta = b.sched.build_connector_meta(waiting_output())
    ws = window_start(7)
    assert {t.group: (t.first, t.async_load) for t in meta.loads} == {0: (0, True),
                                                                       1: (ws, True)}
    w = b.worker
    w.bind_connector_metadata(meta)
    w.start_load_kv(None)
    errors: set = set()
    for _ in range(500):
        w.wait_for_save()
        _, recving = w.get_finished(set())
        errors |= w.get_block_ids_with_load_errors()
        if recving:
            assert recving == {r2.request_id}
            break
        time.sleep(0.01)
    else:
        raise AssertionError("the load was never reported")
    w.clear_connector_metadata()
    assert errors == set()
    for name in NAMES:
        g, first = (0, 0) if name in FULL else (1, ws)
        x, y = a.kv[name][:, ia[g][first:7]], b.kv[name][:, ib[g][first:7]]
        assert x.any() and torch.equal(x.view(torch.int16), y.view(torch.int16)), name
    b.finish(r2)
    a.close()
    b.close()


def test_decode_saves_each_group_as_pages_complete(vd: Daemon) -> None:
    """Decode steps (vLLM's CachedRequestData, new blocks per group from the manager's
    allocate_slots): the page a step completes is saved in both groups; by then vLLM has
    freed the window group's blocks that left its window, which are never read. Another
    engine then hits the prompt and the decoded tokens, byte-exact in each group's blocks."""
    a, b = Engine(vd, seed=61), Engine(vd, None)
    toks = prompt(4, 14)
    r = request(toks)
    n, meta = a.admit(r)
    assert a.step(meta) == set()
    r.num_computed_tokens = r.num_tokens
    saved = []
    for t in (901, 902, 903):  # 78 -> 81 tokens: the step computing token 80 fills page 5
        r.append_output_token_ids(t)
        new = a.manager.allocate_slots(r, 1)
        assert new is not None
        ids = new.get_block_ids()
        crd = CachedRequestData.make_empty()
        crd.req_ids.append(r.request_id)
        crd.new_token_ids.append([])
        crd.new_block_ids.append(ids if any(ids) else None)
        crd.num_computed_tokens.append(r.num_computed_tokens)
        crd.num_output_tokens.append(len(r.output_token_ids))
        so = SchedulerOutput(scheduled_new_reqs=[], scheduled_cached_reqs=crd,
                             num_scheduled_tokens={r.request_id: 1},
                             total_num_scheduled_tokens=1, scheduled_spec_decode_tokens={},
                             scheduled_encoder_inputs={}, finished_req_ids=set(),
                             free_encoder_mm_hashes=[])
        meta = a.sched.build_connector_meta(so)
        saved.append(sorted((x.group, x.first, len(x.keys)) for x in meta.saves))
        assert a.step(meta) == set()
        r.num_computed_tokens += 1
    assert saved == [[], [(0, 4, 5), (1, 4, 5)], []]
    ia = a.manager.get_block_ids(r.request_id)
    assert ia[1][0] == 0  # the window group's first block freed by now (vLLM's null block)
    a.finish(r)
    r2 = request(list(r.all_token_ids))  # 81 tokens: a hit of 5 pages
    n, meta = b.admit(r2)
    assert n == 5 * BS and b.step(meta) == set()
    ib = b.manager.get_block_ids(r2.request_id)
    ws = window_start(5)
    for name in NAMES:
        g, first = (0, 0) if name in FULL else (1, ws)
        x, y = a.kv[name][:, ia[g][first:5]], b.kv[name][:, ib[g][first:5]]
        assert x.any() and torch.equal(x.view(torch.int16), y.view(torch.int16)), name
    b.finish(r2)
    a.close()
    b.close()


@pytest.mark.parametrize("slow_s,deadline_ms,cancelled", [(0.05, 2000, False), (0.4, 100, True)])
def test_window_saves_read_before_the_next_step(vd: Daemon, slow_s: float, deadline_ms: int,
                                                cancelled: bool) -> None:
    """Saves are asynchronous, but vLLM frees a running request's window-group blocks that
    left the window when it schedules the next step, and may hand them on in that step: the
    next step's start_load_kv returns only once the window group's save jobs have read their
    blocks, or, past the step's deadline, has cancelled them (a later miss, never another
    request's KV stored under this chain). The full-attention group's jobs are not waited for
    (vLLM holds those blocks until the saves are done)."""
    from kvtier.vllm.common import KvtierConnectorMetadata

    a = Engine(vd, seed=71, worker_deadline_ms=deadline_ms)
    w = a.worker
    save = w._save

    def slow(job: Any, stored: List[int]) -> int:
        if job.t.group == 1:
            time.sleep(slow_s)
        return save(job, stored)

    w._save = slow
    r = request(prompt(4, 3))
    n, meta = a.admit(r)
    w.bind_connector_metadata(meta)
    w.start_load_kv(None)
    for name, t in a.kv.items():
        w.wait_for_layer_load(name)
        w.save_kv_layer(name, t, None)
    w.wait_for_save()
    w.clear_connector_metadata()
    window = [j for js in w._jobs.values() for j in js if j.t.group == 1]
    assert len(window) == 1 and not window[0].read.is_set()
    w.bind_connector_metadata(KvtierConnectorMetadata())  # the next step
    t0 = time.monotonic()
    w.start_load_kv(None)
    waited = time.monotonic() - t0
    assert window[0].read.is_set() or window[0].cancelled
    assert window[0].cancelled is cancelled and window[0].copied is not cancelled
    assert waited < slow_s + 0.3
    w.wait_for_save()
    w.clear_connector_metadata()
    settle(w, SETTLE_S)
    assert a.finish(r)
    assert all(stored_tiers(vd, a, r, 0, 4))
    assert all(stored_tiers(vd, a, r, 1, 4)[window_start(3):]) is not cancelled
    a.close()


def test_window_saves_of_a_step_not_waited_for_after_its_forward(vd: Daemon) -> None:
    """vLLM 0.34's model runner calls handle_preemptions before the step's forward and
    start_load_kv after it when the step loads nothing in it. The window group's save jobs
    sent during that forward are the step's own: start_load_kv then does not wait for them to
    read their blocks (the next step's handle_preemptions does, before its forward writes), nor
    does it cancel them past the step's deadline. On the old code start_load_kv waited after
    the forward until the step's own window save had read its blocks (0.3 s here, up to
    worker_deadline_ms), stalling every such step."""
    a = Engine(vd, seed=72, worker_deadline_ms=2000)
    w = a.worker
    save = w._save

    def slow(job: Any, stored: List[int]) -> int:
        if job.t.group == 1:
            time.sleep(0.3)
        return save(job, stored)

    w._save = slow
    r = request(prompt(4, 3))
    n, meta = a.admit(r)
    assert n == 0 and meta.loads == [] and meta.saves
    w.handle_preemptions(meta)  # pre_forward, as vLLM 0.34 calls it
    w.bind_connector_metadata(meta)
    for name, t in a.kv.items():  # the forward
        w.wait_for_layer_load(name)
        w.save_kv_layer(name, t, None)
    (window,) = [j for js in w._jobs.values() for j in js if j.t.group == 1]
    t0 = time.monotonic()
    w.start_load_kv(None)  # post_forward: no load in the step
    waited = time.monotonic() - t0
    w.wait_for_save()
    w.clear_connector_metadata()
    assert waited < 0.15, "start_load_kv waited for the step's own window save"
    assert not window.cancelled
    settle(w, SETTLE_S)
    assert a.finish(r)
    assert all(stored_tiers(vd, a, r, 1, 4)[window_start(3):])
    a.close()

def test_failed_asynchronous_load_is_reported_as_its_request(vd: Daemon) -> None:
    """load_async, the daemon killed between the lookup and the load: the request is reported
    as a whole (get_transfer_results: failed_recving, and finished_recving), no block among the
    load errors: vLLM 0.34 raises RuntimeError at failed blocks with several KV cache groups (a
    block id names a block of one group only) and recomputes a failed request from its start."""
    toks = prompt(5, 4)
    store(vd, 81, toks)
    b = Engine(vd, None, load_async=True)
    r2 = waiting_for_its_load(b, toks, 5)
    meta = b.sched.build_connector_meta(waiting_output())
    assert {t.group for t in meta.loads} == {0, 1}
    res = load_with_daemon_killed(vd, b.worker, meta, SETTLE_S)
    assert res.finished_recving == {r2.request_id} and res.failed_recving == {r2.request_id}
    b.finish(r2)
    b.close()


def test_several_groups_load_between_steps(vd: Daemon) -> None:
    """With several KV cache groups a hit is always a load between steps (load_async on: a load
    that fails there is reported as its request, which vLLM 0.34 takes; one that fails inside
    a step only as its blocks, at which it raises RuntimeError); load_async set false is
    refused when vLLM builds the connector, in both roles, naming why. One group keeps the
    load in the step by default, and load_async false is its own choice."""
    kvc = hybrid_config()
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ValueError, match="'load_async': false, but with 2 KV cache groups"):
            KVConnectorFactory.create_connector(vllm_config(vd, load_async=False), role, kvc)
    e = Engine(vd, None)
    assert e.sched._async and e.worker._async
    e.close()
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD, dtype=DTYPE)
    one = KVCacheConfig(num_blocks=NBLOCKS, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(NAMES, spec)])
    for extra in ({}, {"load_async": False}):
        c = KVConnectorFactory.create_connector(vllm_config(vd, **extra),
                                                KVConnectorRole.SCHEDULER, one)
        assert c._async is False
        c.shutdown()


def hybrid_scheduler(model_config: Any, d: Daemon, kvc: Any, policy: str) -> Any:
    """vLLM's own v1 Scheduler for the hybrid config ``kvc`` in MODEL's namespace (the one
    Engine stores in), vLLM's prefix cache off (vllm_harness.real_scheduler)."""
    s, cfg = real_scheduler(model_config, d, MODEL, kvc, policy)
    assert len(s.kv_cache_config.kv_cache_groups) == 2
    return s, cfg


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_daemon_killed_mid_load_through_vllms_scheduler(vd: Daemon, tiny_model_config: Any,
                                                        policy: str) -> None:
    """Issue 35 with several KV cache groups, through vLLM's real Scheduler stepped as its
    engine steps it (schedule(), the worker's forward with the step's metadata, the worker's
    KVConnectorOutput as vLLM's model runner builds it: get_transfer_results, then
    get_block_ids_with_load_errors, then update_from_output): the daemon killed between the
    lookup and the load. The request waits for its load (vLLM schedules none of its tokens),
    the failed load is reported as the request (failed_recving), no block among the load
    errors, and no step raises. With vLLM's kv_load_failure_policy "recompute", vLLM then
    schedules the whole prompt: recomputed; with its default, "fail", vLLM ends that request
    with an error (its choice; the engine goes on). Before, the load went in the step and its
    blocks were reported: vLLM 0.34's update_from_output raised RuntimeError (block-level load
    failures with several groups), whatever the policy."""
    from vllm.v1.request import RequestStatus

    toks = prompt(5, 4)
    store(vd, 91, toks)
    kvc = hybrid_config()
    s, cfg = hybrid_scheduler(tiny_model_config, vd, kvc, policy)
    worker = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, kvc)
    kvs = paged(None)
    worker.register_kv_caches(kvs)
    reported: Dict[str, set] = {}

    def run(out: Any) -> None:
        run_step(s, worker, kvs, list(kvs), out, reported)

    r2 = request(toks)
    s.add_request(r2)
    out = s.schedule()  # the lookup: a hit of 5 pages
    assert out.kv_connector_metadata.loads
    vd.stop(signal.SIGKILL)  # between the lookup and the load
    run(out)
    assert r2.request_id not in out.num_scheduled_tokens, "it waited for its load"
    deadline = time.monotonic() + SETTLE_S
    while True:
        out = s.schedule()
        if r2.request_id in out.num_scheduled_tokens:
            break
        run(out)
        if r2.is_finished():
            break
        assert time.monotonic() < deadline, "the request never ran again"
        time.sleep(0.005)
    assert reported == {"failed": {r2.request_id}, "recving": {r2.request_id},
                        "invalid": set()}
    if policy == "fail":
        assert r2.status == RequestStatus.FINISHED_ERROR
    else:
        assert out.num_scheduled_tokens[r2.request_id] == len(toks), "recomputed from its start"
        assert r2.status == RequestStatus.RUNNING
        s.finish_requests([r2.request_id], RequestStatus.FINISHED_ABORTED)
    worker.shutdown()
    s.shutdown()


@pytest.mark.parametrize("groups,partial", [(2, False), (2, True), (1, False)],
                         ids=["two", "two_second_only", "one"])
def test_load_that_cannot_be_planned_is_reported(vd: Daemon, tiny_model_config: Any,
                                                 monkeypatch: Any, groups: int,
                                                 partial: bool) -> None:
    """Through vLLM's real Scheduler (policy "recompute"), stepped as its engine steps it: a
    hit loaded between steps (several groups; one group with load_async) whose planning
    raises in update_state_after_alloc (no transfer can be built; ``partial``: the first
    group's is, the second group's not: a partial plan, of which no load goes out), after vLLM
    made the request wait for its load (WAITING_FOR_REMOTE_KVS). The request is reported once, as a failed
    load (failed_recving, within finished_recving; with one group too, where a load's
    missing pages go as blocks: none of this one was planned), no block among the load
    errors, in the step it began waiting: the step after, vLLM schedules its whole prompt
    (its next lookup answers 0). On the old code the scheduler only logged the failure: no
    load went to the workers, no one reported the request, and it waited for ever."""
    import kvtier.vllm.scheduler as vsched
    from vllm.v1.request import RequestStatus

    spec = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD, dtype=DTYPE)
    kvc = hybrid_config() if groups == 2 else KVCacheConfig(
        num_blocks=NBLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(NAMES, spec)])
    extra = {"load_async": True}
    toks = prompt(5, 4)
    store(vd, 95, toks, kvc=kvc, **extra)
    s, cfg = real_scheduler(tiny_model_config, vd, MODEL, kvc, "recompute", extra)
    worker = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, kvc)
    kvs = paged(None)
    worker.register_kv_caches(kvs)
    reported: Dict[str, set] = {}

    built: List[int] = []

    def unbuildable(*args: Any, **kw: Any) -> Any:
        if partial and (args[5] if len(args) > 5 else kw.get("group")) == 0:  # group 0's
            built.append(0)
            return kv.common._Transfer(*args, **kw)
        raise ValueError("no transfer")

    r2 = request(toks)
    s.add_request(r2)
    with monkeypatch.context() as m:
        m.setattr(vsched, "_Transfer", unbuildable)
        out = s.schedule()  # the lookup: a hit of 5 pages, to load between steps
    assert built == ([0] if partial else [])
    assert r2.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert not out.kv_connector_metadata.loads
    run_step(s, worker, kvs, list(kvs), out, reported)
    scheduled = waited = None
    for step in range(100):  # 100 steps, a second: on the old code it waited for ever
        out = s.schedule()
        if r2.request_id in out.num_scheduled_tokens:
            scheduled, waited = out.num_scheduled_tokens[r2.request_id], step
            break
        run_step(s, worker, kvs, list(kvs), out, reported)
        time.sleep(0.01)
    assert r2.status == RequestStatus.RUNNING, "it waited for ever"
    assert scheduled == len(toks), "recomputed from its start"
    assert waited == 0, "scheduled the step after the one it began waiting in"
    assert reported == {"failed": {r2.request_id}, "recving": {r2.request_id},
                        "invalid": set()}
    s.finish_requests([r2.request_id], RequestStatus.FINISHED_ABORTED)
    worker.shutdown()
    s.shutdown()


@pytest.mark.parametrize("policy", ["recompute", "fail"])
@pytest.mark.parametrize("local", [0, 2])
def test_load_in_the_step_that_cannot_be_planned_is_load_errors(
        vd: Daemon, tiny_model_config: Any, monkeypatch: Any, local: int, policy: str) -> None:
    """Through vLLM's real Scheduler, stepped as its engine steps it: one KV cache group, the
    load in the step (load_async off), ``local`` pages of the prompt in vLLM's own prefix
    cache (a request of those pages run and finished before), the rest of the hit answered
    by kvtierd, synchronously: vLLM counts the hit's tokens as computed and schedules only
    the prompt's last 4 tokens in that very step. Planning the load then raises in
    update_state_after_alloc (no transfer can be built). The hit's blocks go in the step's
    metadata and the worker reports them as load errors (get_block_ids_with_load_errors),
    nothing else: with "recompute" vLLM rewinds the request to before the hit (its local
    pages, none of the hit's counted computed) and the next step computes the rest of its
    prompt, never using KV nothing loaded (the connector asked nothing again: its next lookup
    answers 0); with "fail" vLLM ends it with an error. On the old code the scheduler only
    logged the failure: no block was reported and vLLM went on from the hit's tokens as
    computed on blocks never written (garbage KV)."""
    import kvtier.vllm.scheduler as vsched
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import RequestStatus

    spec = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD, dtype=DTYPE)
    kvc = KVCacheConfig(num_blocks=NBLOCKS, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(NAMES, spec)])
    toks = prompt(5, 4)
    store(vd, 96, toks, kvc=kvc)
    s, cfg = real_scheduler(tiny_model_config, vd, MODEL, kvc, policy,
                            enable_prefix_caching=bool(local))
    assert s.connector._async is False, "the load goes in the step"
    worker = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, kvc)
    kvs = paged(None)
    worker.register_kv_caches(kvs)
    reported: Dict[str, set] = {}
    init_none_hash(sha256_cbor)

    def hashed(tokens: List[int]) -> "Request":  # vLLM's block hashes: its prefix cache
        return Request("hreq-%d" % next(_ids), tokens, SamplingParams(max_tokens=4), None,
                       block_hasher=get_request_block_hasher(BS, sha256_cbor))

    if local:  # its pages in vLLM's prefix cache (loaded from kvtierd, in the step)
        r0 = hashed(toks[:local * BS + 1])
        s.add_request(r0)
        out = s.schedule()
        assert out.kv_connector_metadata.loads
        run_step(s, worker, kvs, list(kvs), out, reported)
        assert r0.num_computed_tokens == r0.num_tokens and not reported["invalid"]
        s.finish_requests([r0.request_id], RequestStatus.FINISHED_ABORTED)

    def unbuildable(*args: Any, **kw: Any) -> Any:
        raise ValueError("no transfer")

    r2 = hashed(toks)
    s.add_request(r2)
    with monkeypatch.context() as m:
        m.setattr(vsched, "_Transfer", unbuildable)
        out = s.schedule()  # local pages, then kvtierd's hit of the rest: 5 pages in all
    meta = out.kv_connector_metadata
    assert r2.status == RequestStatus.RUNNING and not meta.loads and not meta.unplanned
    assert out.num_scheduled_tokens[r2.request_id] == 4, "the hit counted computed"
    hit_blocks = set(s.kv_cache_manager.get_block_ids(r2.request_id)[0][local:5])
    assert len(hit_blocks) == 5 - local
    run_step(s, worker, kvs, list(kvs), out, reported)
    assert reported["invalid"] == hit_blocks, "the hit's blocks reported as load errors"
    assert not reported["failed"] and not reported["recving"]
    assert set(meta.load_errors) == hit_blocks  # through the step's metadata
    if policy == "fail":
        assert r2.status == RequestStatus.FINISHED_ERROR
    else:
        assert r2.num_computed_tokens == local * BS, "rewound to before the hit"
        out = s.schedule()
        assert out.num_scheduled_tokens[r2.request_id] == len(toks) - local * BS, \
            "the hit's tokens recomputed"
        run_step(s, worker, kvs, list(kvs), out, reported)
        assert r2.num_computed_tokens == len(toks) and r2.status == RequestStatus.RUNNING
        assert reported["invalid"] == hit_blocks, "reported once"
        assert s.connector.get_num_new_matched_tokens(r2, local * BS) == (0, False)
        s.finish_requests([r2.request_id], RequestStatus.FINISHED_ABORTED)
    worker.shutdown()
    s.shutdown()


def store(vd: Daemon, seed: int, toks: List[int], **engine: Any) -> None:
    """The pages of ``toks`` stored in kvtierd by an engine of their own (``seed``; ``engine``:
    its other settings, e.g. ``kvc``), which kvtierd held none of and which closes: what the
    tests' second engine or vLLM's Scheduler then hits."""
    a = Engine(vd, seed, **engine)
    r = request(toks)
    n, meta = a.admit(r)
    assert n == 0 and a.step(meta) == set()
    a.finish(r)
    a.close()


def waiting_for_its_load(b: "Engine", toks: List[int], pages: int) -> "Request":
    """A request of ``toks`` on ``b`` (loads between steps) that hits kvtierd for ``pages``
    pages and waits for its load: matched (asynchronously), its blocks allocated as vLLM does
    for a load between steps (not cached until it lands) and its load planned."""
    r2 = request(toks)
    n, load_async = b.sched.get_num_new_matched_tokens(r2, 0)
    assert (n, load_async) == (pages * BS, True)
    assert b.manager.allocate_slots(r2, r2.num_tokens - n, num_external_computed_tokens=n,
                                    delay_cache_blocks=True) is not None
    b.sched.update_state_after_alloc(r2, b.manager.get_blocks(r2.request_id), n)
    return r2


def _prefix_cached_scheduler(vd: Daemon, model_config: Any, seed: int,
                             extra: Optional[Dict[str, Any]],
                             names: List[str] = NAMES) -> Tuple[Any, ...]:
    """The set-up of the tests of blocks shared through vLLM's prefix cache: 5 pages and 4
    tokens stored in kvtierd by another engine (``seed``), then vLLM's real Scheduler with its
    prefix cache on (policy "recompute", one KV cache group of the layers ``names``, ``extra``
    connector settings) and a worker over paged caches. Returns (scheduler, worker, caches,
    the stored prompt's tokens, a maker of requests that carry vLLM's block hashes)."""
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    spec = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD, dtype=DTYPE)
    kvc = KVCacheConfig(num_blocks=NBLOCKS, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(names, spec)])
    toks = prompt(5, 4)
    store(vd, seed, toks, kvc=kvc, kv={n: t for n, t in paged(seed).items() if n in names})
    s, cfg = real_scheduler(model_config, vd, MODEL, kvc, "recompute", extra,
                            enable_prefix_caching=True)
    worker = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, kvc)
    kvs = {n: t for n, t in paged(None).items() if n in names}
    worker.register_kv_caches(kvs)
    init_none_hash(sha256_cbor)

    def hashed(tokens: List[int]) -> "Request":  # vLLM's block hashes: its prefix cache
        return Request("hreq-%d" % next(_ids), tokens, SamplingParams(max_tokens=4), None,
                       block_hasher=get_request_block_hasher(BS, sha256_cbor))

    return s, worker, kvs, toks, hashed


def _held(d: Daemon, s: Any, worker: Any, r: "Request", pages: int) -> List[int]:
    """Where kvtierd holds each of the first ``pages`` pages of ``r``'s chain in the
    namespace of vLLM's Scheduler ``s`` (one group; 0: not held)."""
    c0 = s.connector
    keys = kv.key_chain(r, BS, c0._root, [], pages)
    with d.client(model=c0._model, salt=kv.rank_salt(0, 1, 0, 1), page_size=KEY_TOKENS,
                  adapter=KEYS_TAG, block_bytes=worker._layout.page_bytes) as c:
        m = c.match([t for k in keys for t in key_tokens(k)], probe=True)
        return list(m.tiers) + [0] * (pages - len(m.tiers))


def _no_transfer(*args: Any, **kw: Any) -> Any:
    raise ValueError("no transfer")


def _schedule_a_and_b(s: Any, hashed: Any, toks: List[int], b_toks: List[int], monkeypatch: Any,
                      unplanned: bool) -> Tuple["Request", "Request", Any]:
    """Requests A (``toks``: the 5 pages and 4 tokens kvtierd holds) and B (``b_toks``: those
    5 pages, then its own) added to vLLM's Scheduler ``s`` and scheduled in one step: A's load
    of its hit planned, or with ``unplanned`` its planning raising (the step's metadata then
    lists A's blocks as load errors). Returns (A, B, the step's SchedulerOutput)."""
    ra, rb = hashed(toks), hashed(b_toks)
    s.add_request(ra)
    s.add_request(rb)
    with monkeypatch.context() as m:
        if unplanned:
            m.setattr(s.connector, "_plan_loads", _no_transfer)
        out = s.schedule()
    return ra, rb, out


@pytest.mark.parametrize("how, layers", [
    ("unplanned", 4), ("killed", 4), ("removed", 4), ("copy_failed", 4),
    # A group of one layer: its first layer is its last, so its saves go to the I/O thread
    # there (save_kv_layer's other path, not _go's), and the same check must drop them.
    ("unplanned", 1), ("copy_failed", 1)])
def test_failed_load_of_blocks_shared_in_the_step(vd: Daemon, tiny_model_config: Any,
                                                  monkeypatch: Any, how: str,
                                                  layers: int) -> None:
    """Through vLLM's real Scheduler with its prefix cache on (policy "recompute"), one KV
    cache group, the load in the step: request A hits kvtierd for 5 pages; request B, of the
    same 5 pages then 2 pages and 4 tokens of its own, is scheduled in the same step and takes
    A's 5 blocks from vLLM's prefix cache (vLLM caches a hit's blocks when it allocates them,
    before anything is loaded into them). A's load then fails: ``unplanned``, its planning
    raising (h7's load errors through the metadata); ``killed``, kvtierd SIGKILLed between the
    lookup and the load; ``removed``, the pages removed meanwhile (the lookup's lease, 50 ms,
    lapsed); ``copy_failed``, the pages read but their copy into vLLM's blocks raising (the
    worker's own failure: the whole load recomputed). The worker reports A's 5 blocks as load errors, and vLLM's
    _handle_invalid_blocks, which walks every running request, rewinds both: A to its first
    token, B to before the step (its 2 pages computed on those blocks are computed again; it
    keeps the 5 shared blocks as computed because A recomputes them, marked_invalid_block_ids).
    The next step schedules A's whole prompt and B's 2 pages again, and a request C arriving
    then with the same 5 pages takes none of A's blocks: the connector took the failed blocks
    out of vLLM's prefix cache (update_connector_output; before s25 C took them there, in the
    step A wrote them again); C loads the 5 pages from kvtierd where it holds them
    (``unplanned``, ``copy_failed``), else computes them. The rewinding held on s24-int's
    code already: the connector reports the failed blocks, vLLM finds every request holding
    them. What did not: B's 2 pages, computed in the failed step
    on A's unloaded blocks, were saved to kvtierd (B's own load was none, so nothing marked
    its save): a later request with B's prompt would have loaded them from kvtierd as good KV.
    ``unplanned`` and ``copy_failed`` fail so on s24-int's code (kvtierd keeps A's 5 pages,
    B's 2 follow them); ``removed`` and ``killed`` pass there, kvtierd refusing pages after a
    page without bytes (protocol.md, "Chains with gaps") or being dead. Now a save carries the
    blocks of the step's loads it was computed on (``reads``) and a worker whose load of one
    of them failed stores none of its pages, and the scheduler, seeing vLLM rewind a request
    (its computed tokens before the pages it had saved), saves them again from there once
    computed anew: after the next step kvtierd holds B's 7 pages. The worker submits a step's
    saves on one of two paths, each with that check: at the group's first layer, let go at its
    last (_go; ``layers`` 4), or, where the first layer is the last (``layers`` 1), at that
    layer; either case fails with its path's check taken out. A and B aborted before the
    next step: test_failed_blocks_leave_vllms_prefix_cache."""
    from kvtier.errors import Busy
    from vllm.v1.request import RequestStatus

    s, worker, kvs, toks, hashed = _prefix_cached_scheduler(
        vd, tiny_model_config, 97, {"lease_ms": 50} if how == "removed" else None,
        NAMES[:layers])
    assert s.connector._async is False, "the load goes in the step"
    reported: Dict[str, set] = {}
    ra, rb, out = _schedule_a_and_b(s, hashed, toks, toks[:5 * BS] + prompt(2, 4), monkeypatch,
                                    how == "unplanned")
    assert out.num_scheduled_tokens == {ra.request_id: 4, rb.request_id: 2 * BS + 4}
    (a_ids,), (b_ids,) = (s.kv_cache_manager.get_block_ids(x.request_id) for x in (ra, rb))
    assert b_ids[:5] == a_ids[:5], "B took A's blocks from vLLM's prefix cache"
    hit = set(a_ids[:5])
    assert bool(out.kv_connector_metadata.loads) == (how != "unplanned")
    if how == "killed":
        vd.stop(signal.SIGKILL)
    elif how == "removed":
        first = kv.key_chain(ra, BS, s.connector._root, [], 1)[0]
        with vd.client(model=s.connector._model, salt=kv.rank_salt(0, 1, 0, 1),
                       page_size=KEY_TOKENS, adapter=KEYS_TAG,
                       block_bytes=worker._layout.page_bytes) as c:
            deadline = time.monotonic() + SETTLE_S
            while True:  # the whole chain, once no lease holds it
                try:
                    c.remove(key_tokens(first))
                    break
                except Busy:
                    assert time.monotonic() < deadline, "the lease never lapsed"
                    time.sleep(0.02)
    with monkeypatch.context() as m:
        if how == "copy_failed":
            m.setattr(worker, "_copy_layer", _no_transfer)
        run_step(s, worker, kvs, list(kvs), out, reported)
    assert reported == {"invalid": hit, "failed": set(), "recving": set()}
    assert ra.num_computed_tokens == 0, "A rewound to before its hit"
    assert rb.num_computed_tokens == 5 * BS, "B's step computed on the failed blocks: again"
    assert ra.status == rb.status == RequestStatus.RUNNING
    settle(worker, SETTLE_S)
    if how != "killed":  # nothing computed on the failed blocks is stored
        assert _held(vd, s, worker, rb, 7)[5:] == [0, 0], "B's pages of the failed step stored"
    rc = hashed(toks[:5 * BS] + prompt(1, 4))
    s.add_request(rc)
    out = s.schedule()
    c_hit = 5 * BS if how in ("unplanned", "copy_failed") else 0  # kvtierd's, not vLLM's
    assert out.num_scheduled_tokens == {ra.request_id: len(toks), rb.request_id: 2 * BS + 4,
                                        rc.request_id: 6 * BS + 4 - c_hit}
    (c_ids,) = s.kv_cache_manager.get_block_ids(rc.request_id)
    assert not set(c_ids) & hit, "C took failed blocks from vLLM's prefix cache"
    run_step(s, worker, kvs, list(kvs), out, reported)
    assert reported["invalid"] == hit, "reported once"
    assert not s.connector._failed, "blocks written again are no longer followed"
    for x, n in ((ra, len(toks)), (rb, 7 * BS + 4), (rc, 6 * BS + 4)):
        assert x.num_computed_tokens == n and x.status == RequestStatus.RUNNING
    settle(worker, SETTLE_S)
    if how != "killed":  # the pages computed again are saved again (A's 5 where they went)
        assert all(_held(vd, s, worker, rb, 7)), "the recomputed pages not stored"
    s.finish_requests([x.request_id for x in (ra, rb, rc)], RequestStatus.FINISHED_ABORTED)
    worker.shutdown()
    s.shutdown()


@pytest.mark.parametrize("how", ["unplanned", "killed"])
def test_failed_blocks_leave_vllms_prefix_cache(vd: Daemon, tiny_model_config: Any,
                                                monkeypatch: Any, how: str) -> None:
    """Through vLLM's real Scheduler with its prefix cache on (policy "recompute"), one KV
    cache group, the load in the step: request A hits kvtierd for 5 pages and B, of the same
    5 pages then 2 of its own, takes A's 5 blocks from vLLM's prefix cache in the same step
    (vLLM caches a hit's blocks, and the blocks of the tokens a step will compute, when it
    allocates them). A's load fails (``unplanned``: its planning raising; ``killed``: kvtierd
    SIGKILLed between the lookup and the load), vLLM rewinds both to recompute the next step,
    but both are aborted before it. A later request of A's 5 pages, or of B's 7, must not
    take any of those blocks from vLLM's prefix cache as computed: nothing wrote A's 5, and
    B's 2 were computed on them. On s24-int's code vLLM served them (5 pages, and B's 7):
    with "recompute" vLLM keeps failed blocks cached (_handle_invalid_blocks evicts only with
    "fail"). Now the scheduler's connector, told of the failed blocks
    (update_connector_output, after vLLM rewound the requests), evicts them and every block
    after them of the requests holding them (KVCacheManager.evict_blocks, bound by vLLM's
    bind_kv_cache_manager), B's own 2 pages with them."""
    from vllm.v1.request import RequestStatus

    s, worker, kvs, toks, hashed = _prefix_cached_scheduler(vd, tiny_model_config, 99, None)
    reported: Dict[str, set] = {}
    b_toks = toks[:5 * BS] + prompt(2, 4)
    ra, rb, out = _schedule_a_and_b(s, hashed, toks, b_toks, monkeypatch, how == "unplanned")
    (a_ids,), (b_ids,) = (s.kv_cache_manager.get_block_ids(x.request_id) for x in (ra, rb))
    assert b_ids[:5] == a_ids[:5], "B took A's blocks from vLLM's prefix cache"
    assert s.kv_cache_manager.get_computed_blocks(hashed(b_toks))[1] == 7 * BS, \
        "a hit's blocks and B's are cached when allocated"
    if how == "killed":
        vd.stop(signal.SIGKILL)
    run_step(s, worker, kvs, list(kvs), out, reported)
    assert reported["invalid"] == set(a_ids[:5])
    assert ra.num_computed_tokens == 0 and rb.num_computed_tokens == 5 * BS, "rewound"
    # B's own 2 pages too (a lookup through A's evicted blocks would not reach them, but a
    # sliding window's would): no block of B's first 7 pages keeps its hash.
    pool = s.kv_cache_manager.block_pool
    assert [b for b in b_ids[:7] if pool.blocks[b].block_hash is not None] == []
    s.finish_requests([ra.request_id, rb.request_id], RequestStatus.FINISHED_ABORTED)
    for tokens in (toks[:5 * BS] + prompt(1, 4), b_toks):
        assert s.kv_cache_manager.get_computed_blocks(hashed(tokens))[1] == 0, \
            "blocks of the failed step served from vLLM's prefix cache"
    worker.shutdown()
    s.shutdown()


@pytest.mark.parametrize("how", ["unplanned", "killed"])
def test_failed_blocks_handed_over_when_their_writer_aborts(vd: Daemon, tiny_model_config: Any,
                                                            monkeypatch: Any, how: str) -> None:
    """Through vLLM's real Scheduler with its prefix cache on (policy "recompute"), one KV
    cache group, the load in the step: A hits kvtierd for 5 pages, B (the same 5 pages, then 2
    of its own) takes A's 5 blocks from vLLM's prefix cache in that step, and A's load fails
    (``unplanned``: planning raising; ``killed``: kvtierd SIGKILLed). vLLM rewinds A to write
    the 5 blocks again and B to before the step, B counting them computed because A writes
    them. A alone is aborted before the next step: no one would write them, and on s24-int's
    code B went on computing its 2 pages on them, and stored them in kvtierd as good KV
    (``unplanned``: kvtierd held all 7 of B's pages). Now A's finish hands its unwritten failed
    blocks over: the next step's metadata lists those B holds as load errors, the workers
    report them, vLLM rewinds B to its first token, the pages B computed in that step are not
    stored (their ``reads``), and the step after computes and stores all 7."""
    from vllm.v1.request import RequestStatus

    s, worker, kvs, toks, hashed = _prefix_cached_scheduler(vd, tiny_model_config, 96, None)
    ra, rb, out = _schedule_a_and_b(s, hashed, toks, toks[:5 * BS] + prompt(2, 4), monkeypatch,
                                    how == "unplanned")
    (a_ids,) = s.kv_cache_manager.get_block_ids(ra.request_id)
    hit = set(a_ids[:5])
    if how == "killed":
        vd.stop(signal.SIGKILL)
    reported: Dict[str, set] = {}
    run_step(s, worker, kvs, list(kvs), out, reported)
    assert reported["invalid"] == hit
    assert ra.num_computed_tokens == 0 and rb.num_computed_tokens == 5 * BS, "rewound"
    s.finish_requests([ra.request_id], RequestStatus.FINISHED_ABORTED)
    out = s.schedule()
    assert out.num_scheduled_tokens == {rb.request_id: 2 * BS + 4}
    assert set(out.kv_connector_metadata.load_errors) == hit, "A's blocks handed over"
    reported = {}
    run_step(s, worker, kvs, list(kvs), out, reported)
    assert reported["invalid"] == hit
    assert rb.num_computed_tokens == 0, "B rewound: it now writes the blocks"
    settle(worker, SETTLE_S)
    if how == "unplanned":
        assert _held(vd, s, worker, rb, 7)[5:] == [0, 0], "B's pages on unwritten blocks stored"
    out = s.schedule()
    assert out.num_scheduled_tokens == {rb.request_id: 7 * BS + 4}
    reported = {}
    run_step(s, worker, kvs, list(kvs), out, reported)
    assert not reported["invalid"] and rb.num_computed_tokens == 7 * BS + 4
    assert not s.connector._failed, "blocks written again are no longer followed"
    settle(worker, SETTLE_S)
    if how == "unplanned":
        assert all(_held(vd, s, worker, rb, 7)), "B's pages computed anew not stored"
    s.finish_requests([rb.request_id], RequestStatus.FINISHED_ABORTED)
    worker.shutdown()
    s.shutdown()


@pytest.mark.parametrize("killed", [False, True], ids=["loaded", "killed"])
def test_blocks_of_a_load_between_steps_not_shared_before_it_lands(
        vd: Daemon, tiny_model_config: Any, killed: bool) -> None:
    """Through vLLM's real Scheduler with its prefix cache on, one KV cache group, the load
    between steps (``load_async``): request A hits kvtierd for 5 pages and waits for its load
    (WAITING_FOR_REMOTE_KVS). vLLM allocates its blocks with ``delay_cache_blocks`` and puts
    them in its prefix cache only once the load is reported (_update_waiting_for_remote_kv;
    with a failed load only the pages before the first failed block): request B, of the same 5
    pages then 2 of its own, scheduled in the same step, takes none of A's blocks (it hits
    kvtierd itself, into blocks of its own, and waits too), and neither does a request D
    arriving while they wait, nor one asking between the step that reports the load and the
    next; a request C arriving once A runs takes 5 blocks from vLLM's prefix cache. ``killed``:
    kvtierd SIGKILLed between the lookup and the load, the failed load reported as blocks (one
    group), vLLM caches none of them and recomputes A from its first token. So no request
    reads blocks of a load between steps before it lands, nor a failed one's (unlike a load in
    the step with vLLM's "recompute": test_failed_load_of_blocks_shared_in_the_step). This held
    on s24-int's code already (vLLM's own rule); the test pins it down."""
    from vllm.v1.request import RequestStatus

    s, worker, kvs, toks, hashed = _prefix_cached_scheduler(vd, tiny_model_config, 98,
                                                             {"load_async": True})
    assert s.connector._async is True, "the load goes between steps"
    reported: Dict[str, set] = {}

    ra, rb = hashed(toks), hashed(toks[:5 * BS] + prompt(2, 4))
    s.add_request(ra)
    s.add_request(rb)
    out = s.schedule()
    assert ra.status == rb.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert not out.num_scheduled_tokens
    (a_ids,), (b_ids,) = (s.kv_cache_manager.get_block_ids(x.request_id) for x in (ra, rb))
    assert not set(a_ids[:5]) & set(b_ids[:5]), "B took blocks of A's load not landed"
    rd = hashed(toks[:5 * BS] + prompt(1, 4))
    if killed:
        vd.stop(signal.SIGKILL)
    deadline = time.monotonic() + SETTLE_S
    while ra.request_id not in out.num_scheduled_tokens:
        assert s.kv_cache_manager.get_computed_blocks(rd)[1] == 0, "A's blocks cached too soon"
        run_step(s, worker, kvs, list(kvs), out, reported)
        assert s.kv_cache_manager.get_computed_blocks(rd)[1] == 0, "A's blocks cached too soon"
        assert time.monotonic() < deadline, "the load never landed"
        time.sleep(0.005)
        out = s.schedule()
    assert out.num_scheduled_tokens[ra.request_id] == (len(toks) if killed else 4), \
        "A recomputed from its first token" if killed else "A's 5 pages loaded"
    run_step(s, worker, kvs, list(kvs), out, reported)
    assert not reported["failed"]
    assert bool(reported["invalid"] & set(a_ids[:5])) == killed
    rc = hashed(toks[:5 * BS] + prompt(1, 4))
    assert s.kv_cache_manager.get_computed_blocks(rc)[1] == 5 * BS, "cached once loaded"
    live = [x.request_id for x in (ra, rb) if not x.is_finished()]
    s.finish_requests(live, RequestStatus.FINISHED_ABORTED)
    worker.shutdown()
    s.shutdown()


def test_request_finished_before_its_load_went_is_reported(vd: Daemon) -> None:
    """A request that finishes (aborted) between the plan of its load between steps
    (update_state_after_alloc) and the metadata that would carry it, as vLLM's deferred loads
    allow (update_state_after_alloc in update_from_output, the metadata at the next
    schedule()): vLLM holds the blocks of a request aborted while it waits for its load until
    a worker reports it. The load is not sent (nothing loaded into blocks about to be freed),
    but the request still goes out, unplanned: the worker reports it at once, failed, and
    vLLM frees its blocks. On the old code request_finished dropped the planned load, and no
    one ever reported the request: vLLM held its blocks for ever."""
    toks = prompt(4, 2)
    store(vd, 97, toks)
    b = Engine(vd, None)
    r2 = waiting_for_its_load(b, toks, 4)
    held, _ = b.sched.request_finished_all_groups(r2, b.manager.get_block_ids(r2.request_id))
    assert held is False  # no save planned (vLLM holds the blocks for the load it waits for)
    meta = b.sched.build_connector_meta(waiting_output())
    assert meta.loads == []
    w = b.worker
    w.bind_connector_metadata(meta)
    w.start_load_kv(None)
    w.wait_for_save()
    res = w.get_transfer_results({r2.request_id})
    assert w.get_block_ids_with_load_errors() == set()
    w.clear_connector_metadata()
    assert res.finished_recving == {r2.request_id} and res.failed_recving == {r2.request_id}
    res = w.get_transfer_results(set())
    assert not res.finished_recving and not res.failed_recving  # reported once
    b.manager.free(r2)
    with vd.client() as c:
        assert c.stats()["leases"] == 0
    b.close()


def test_hit_vllm_takes_none_of_is_not_reported(vd: Daemon, tiny_model_config: Any) -> None:
    """Through vLLM's real Scheduler: a request that skips cache reads (SamplingParams'
    skip_reading_prefix_cache). vLLM still asks the connector, which answers its hit of 5
    pages, asynchronously, then takes none of it (0 tokens, load_kv_async cleared) and calls
    update_state_after_alloc with 0 external tokens: the request never waits, nothing is
    loaded nor reported (vLLM asserts that a request reported loaded waits for its load or
    is finished: reporting a running one would stop the engine), vLLM schedules its whole
    prompt, and the lookup's leases are released at once (on the old code they were held
    until the request finished)."""
    from vllm.v1.request import RequestStatus

    toks = prompt(5, 4)
    store(vd, 99, toks)
    kvc = hybrid_config()
    s, cfg = hybrid_scheduler(tiny_model_config, vd, kvc, "recompute")
    worker = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, kvc)
    kvs = paged(None)
    worker.register_kv_caches(kvs)
    reported: Dict[str, set] = {}
    r2 = Request("hreq-%d" % next(_ids), toks,
                 SamplingParams(max_tokens=4, skip_reading_prefix_cache=True), None)
    assert r2.skip_reading_external_kv
    s.add_request(r2)
    out = s.schedule()
    assert s.connector._reqs[r2.request_id].hit_pages == 5  # answered, then not taken
    assert out.num_scheduled_tokens[r2.request_id] == len(toks)
    assert r2.status == RequestStatus.RUNNING
    with vd.client() as c:
        assert c.stats()["leases"] == 0
    meta = out.kv_connector_metadata
    assert not meta.loads and not meta.unplanned
    run_step(s, worker, kvs, list(kvs), out, reported)
    for _ in range(3):  # the steps go on: nothing of it reported
        run_step(s, worker, kvs, list(kvs), s.schedule(), reported)
    assert r2.status == RequestStatus.RUNNING
    assert not reported["recving"] and not reported["failed"] and not reported["invalid"]
    s.finish_requests([r2.request_id], RequestStatus.FINISHED_ABORTED)
    worker.shutdown()
    s.shutdown()


def test_lease_lapsed_before_the_load(vd: Daemon, tiny_model_config: Any) -> None:
    """Through vLLM's real Scheduler (policy "recompute"): the lookup's lease (lease_ms 50)
    lapses while the request waits for its load between steps, and the hit's pages go
    meanwhile (REMOVE, which the daemon refuses while a lease holds them). The workers' load
    asks for the pages afresh (its own MATCH with a lease), finds none, and reports the
    request failed (failed_recving, within finished_recving), no block among the load errors:
    vLLM recomputes its whole prompt; no step raises. The lapse costs a miss, never a load of
    pages that are not there."""
    from kvtier.errors import Busy
    from kvtier.vllm.common import group_chain
    from vllm.v1.request import RequestStatus

    toks = prompt(5, 4)
    store(vd, 93, toks)
    kvc = hybrid_config()
    s, cfg = real_scheduler(tiny_model_config, vd, MODEL, kvc, "recompute", {"lease_ms": 50})
    worker = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, kvc)
    kvs = paged(None)
    worker.register_kv_caches(kvs)
    reported: Dict[str, set] = {}
    r2 = request(toks)
    s.add_request(r2)
    out = s.schedule()  # the lookup, its leases for 50 ms
    assert r2.status == RequestStatus.WAITING_FOR_REMOTE_KVS and out.kv_connector_metadata.loads
    model = MODEL + "|groups=2"
    first = group_chain(kv.key_chain(r2, BS, kv.chain_root(model), [], 1), 0, [], 1)[0]
    with vd.client(model=model, salt=kv.rank_salt(0, 1, 0, 1), page_size=KEY_TOKENS,
                   adapter=KEYS_TAG, block_bytes=worker._layout.page_bytes) as c:
        deadline = time.monotonic() + SETTLE_S
        while True:  # the group's whole chain, once no lease holds it
            try:
                c.remove(key_tokens(first))
                break
            except Busy:
                assert time.monotonic() < deadline, "the lease never lapsed"
                time.sleep(0.02)
    run_step(s, worker, kvs, list(kvs), out, reported)
    scheduled = None
    for _ in range(100):
        out = s.schedule()
        if r2.request_id in out.num_scheduled_tokens:
            scheduled = out.num_scheduled_tokens[r2.request_id]
            break
        run_step(s, worker, kvs, list(kvs), out, reported)
        time.sleep(0.01)
    assert scheduled == len(toks), "recomputed from its start"
    assert reported == {"failed": {r2.request_id}, "recving": {r2.request_id},
                        "invalid": set()}
    s.finish_requests([r2.request_id], RequestStatus.FINISHED_ABORTED)
    worker.shutdown()
    s.shutdown()



def test_preempted_request_aborted_while_it_waits_for_its_load(vd: Daemon,
                                                              tiny_model_config: Any) -> None:
    """Through vLLM's real Scheduler (one group, load_async), stepped as its engine steps it: a
    request whose first step planned saves (request_finished holds its blocks from then on),
    preempted (reset_prefix_cache), resumed with a hit on its own saved pages loaded between
    steps (WAITING_FOR_REMOTE_KVS), and aborted before its load is in. vLLM holds its blocks for
    the load it waits for as well as for the saves, and frees them at the first report of
    either: the request goes out once, with its load (finished_recving), and never in
    finished_sending too. On the old code the worker reported it in finished_sending at the
    abort (vLLM freed it) and its load after: vLLM 0.34's update_from_output raised
    AssertionError (a report of a request it no longer knows), which ends the engine."""
    from vllm.v1.request import RequestStatus

    spec = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD, dtype=DTYPE)
    kvc = KVCacheConfig(num_blocks=NBLOCKS, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(NAMES, spec)])
    s, cfg = real_scheduler(tiny_model_config, vd, MODEL, kvc, "recompute", {"load_async": True})
    worker = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, kvc)
    kvs = paged(5)
    worker.register_kv_caches(kvs)
    reported: Dict[str, set] = {}
    r = request(prompt(5, 4))
    s.add_request(r)
    out = s.schedule()
    assert out.kv_connector_metadata.saves, "its pages saved in its first step"
    run_step(s, worker, kvs, list(kvs), out, reported)
    settle(worker, SETTLE_S)
    s.reset_prefix_cache(reset_running_requests=True)
    assert r.status == RequestStatus.PREEMPTED
    out = s.schedule()  # resumed: a hit on its own pages, loaded between steps
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert [t.req_id for t in out.kv_connector_metadata.loads] == [r.request_id]
    s.finish_requests([r.request_id], RequestStatus.FINISHED_ABORTED)  # before its load is in
    assert r.request_id in s.requests, "vLLM holds its blocks"
    run_step(s, worker, kvs, list(kvs), out, reported)
    for _ in range(100):
        if r.request_id not in s.requests:
            break
        run_step(s, worker, kvs, list(kvs), s.schedule(), reported)
        time.sleep(0.01)
    assert r.request_id not in s.requests, "its blocks were never freed"
    for _ in range(20):  # nothing more about it: vLLM asserts that it knows a request reported
        run_step(s, worker, kvs, list(kvs), s.schedule(), reported)
        time.sleep(0.01)
    assert reported == {"failed": set(), "recving": {r.request_id}, "invalid": set()}
    worker.shutdown()
    s.shutdown()
