"""test_vllm.py: kvtier.vllm.KvtierConnector against vLLM's own classes and a real kvtierd.

The connector is built by vLLM's KVConnectorFactory from the module path, as `--kv-transfer-config`
builds it; requests are vLLM's Request objects, blocks its KVCacheBlocks, each step's plan its
SchedulerOutput. The worker side is driven as vLLM's model runner drives it (bind the step's
metadata, start_load_kv, per layer wait_for_layer_load / save_kv_layer, wait_for_save), over
real torch tensors in vLLM's paged layout (2, num_blocks, block_size, kv_heads, head_size).
Skipped, with the reason, where vLLM is not installed (scripts/engines/vllm.sh).
"""

from __future__ import annotations

import itertools
import os
import signal
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch

from conftest import BUILD_ROOT, Daemon

try:
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request
except Exception as e:  # noqa: BLE001 - any import failure means: no usable vLLM here
    pytest.skip("vllm is not importable (%s: %s); scripts/engines/vllm.sh installs it, its log "
                "is %s" % (type(e).__name__, e, os.path.join(BUILD_ROOT, "pyenv", "engine-vllm.log")),
                allow_module_level=True)

import kvtier.vllm as kv  # noqa: E402

BS = 16  # tokens per block
LAYERS = 3
HEADS = 2
HEAD = 8
NBLOCKS = 32
DTYPE = torch.bfloat16

_ids = itertools.count(1)
_tok = itertools.count(0)


def config(d: Daemon, **extra: Any) -> "VllmConfig":
    ec = {"unix_path": d.unix, "model": "tiny-test", "timeout_ms": 2000, "retry_ms": 0}
    ec.update(extra)
    return VllmConfig(
        kv_transfer_config=KVTransferConfig(kv_connector="KvtierConnector",
                                            kv_connector_module_path="kvtier.vllm",
                                            kv_role="kv_both", kv_connector_extra_config=ec),
        device_config=DeviceConfig(device="cpu"), cache_config=CacheConfig(block_size=BS))


def connector(cfg: "VllmConfig", role: "KVConnectorRole") -> Any:
    return KVConnectorFactory.create_connector(
        cfg, role, KVCacheConfig(num_blocks=NBLOCKS, kv_cache_tensors=[], kv_cache_groups=[]))


def paged(seed: Optional[int]) -> Dict[str, torch.Tensor]:
    """vLLM's paged KV of each layer: (2, num_blocks, block_size, kv_heads, head_size)."""
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    out = {}
    for i in range(LAYERS):
        shape = (2, NBLOCKS, BS, HEADS, HEAD)
        t = torch.randn(shape, generator=g) if g else torch.zeros(shape)
        out["model.layers.%d.self_attn.attn" % i] = t.to(DTYPE)
    return out


def request(tokens: List[int], **kw: Any) -> "Request":
    return Request("req-%d" % next(_ids), tokens, SamplingParams(max_tokens=4), None, **kw)


def prompt(pages: int, extra: int = 5) -> List[int]:
    base = next(_tok) * 100_000
    return list(range(base, base + pages * BS + extra))


def blocks(ids: List[int]) -> "KVCacheBlocks":
    return KVCacheBlocks(blocks=([KVCacheBlock(block_id=i) for i in ids],))


def sched_output(new: List[Tuple["Request", List[int], int]] = (),  # type: ignore[assignment]
                 cached: List[Tuple["Request", List[int], int]] = ()  # type: ignore[assignment]
                 ) -> "SchedulerOutput":
    """One step: `new` requests (with their blocks and tokens scheduled) and cached ones."""
    nrs = []
    num: Dict[str, int] = {}
    for r, ids, n in new:
        nrs.append(NewRequestData.from_request(r, (ids,), list(r.all_token_ids)))
        num[r.request_id] = n
    crd = CachedRequestData.make_empty()
    for r, ids, n in cached:
        crd.req_ids.append(r.request_id)
        crd.new_token_ids.append([])
        crd.new_block_ids.append((ids,) if ids else None)
        crd.num_computed_tokens.append(r.num_computed_tokens)
        crd.num_output_tokens.append(0)
        num[r.request_id] = n
    return SchedulerOutput(scheduled_new_reqs=nrs, scheduled_cached_reqs=crd,
                           num_scheduled_tokens=num, total_num_scheduled_tokens=sum(num.values()),
                           scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
                           finished_req_ids=set(),
                           free_encoder_mm_hashes=[])


def schedule(sched: Any, r: "Request", ids: List[int]) -> Tuple[int, Any]:
    """The scheduler's calls for a new request given blocks `ids`: the hit, then the step's
    metadata with the whole remaining prompt scheduled."""
    n, async_load = sched.get_num_new_matched_tokens(r, 0)
    assert async_load is False
    sched.update_state_after_alloc(r, blocks(ids), n)
    r.num_computed_tokens = n
    return n, sched.build_connector_meta(sched_output(new=[(r, ids, r.num_tokens - n)]))


def run_step(worker: Any, kvc: Dict[str, torch.Tensor], meta: Any) -> set:
    """The worker's calls in one forward, as vLLM's model runner and attention layers make
    them. Returns the blocks reported as failed to load."""
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    for name, t in kvc.items():
        worker.wait_for_layer_load(name)
        worker.save_kv_layer(name, t, None)
    worker.wait_for_save()
    errors = worker.get_block_ids_with_load_errors()
    assert worker.get_finished(set()) == (None, None)
    worker.clear_connector_metadata()
    return errors


def leases(d: Daemon) -> int:
    with d.client() as c:
        return c.stats()["leases"]


class Engine:
    """One scheduler-side and one worker-side connector with their own paged tensors."""

    def __init__(self, d: Daemon, seed: Optional[int], **extra: Any) -> None:
        cfg = config(d, **extra)
        self.sched = connector(cfg, KVConnectorRole.SCHEDULER)
        self.worker = connector(cfg, KVConnectorRole.WORKER)
        self.kv = paged(seed)
        self.worker.register_kv_caches(self.kv)

    def close(self) -> None:
        self.worker.shutdown()
        self.sched.shutdown()


@pytest.fixture
def vd() -> Any:
    d = Daemon()
    yield d
    d.stop(signal.SIGKILL)


def pages_of(kvc: Dict[str, torch.Tensor], ids: List[int]) -> List[torch.Tensor]:
    return [t[:, ids] for t in kvc.values()]


def save_prompt(e: Engine, r: "Request", ids: List[int]) -> None:
    n, meta = schedule(e.sched, r, ids)
    assert n == 0 and not meta.loads
    assert run_step(e.worker, e.kv, meta) == set()
    e.sched.request_finished(r, ids)


def test_factory_builds_both_roles(vd: Daemon) -> None:
    cfg = config(vd)
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        c = connector(cfg, role)
        assert type(c).__name__ == "KvtierConnector" and c.role == role
        c.shutdown()


def test_save_then_load_into_another_paged_tensor(vd: Daemon) -> None:
    a, b = Engine(vd, seed=1), Engine(vd, seed=None)
    toks = prompt(3)  # 3 full pages and 5 tokens
    save_prompt(a, request(toks), [4, 9, 2, 7])
    # A second request sharing the 3 pages (its own tail): 48 tokens matched, loaded into other
    # blocks of another engine's paged tensors, byte for byte.
    r = request(toks[:3 * BS] + [7, 7, 7, 7, 7, 7, 7, 7, 7])
    n, meta = schedule(b.sched, r, [11, 3, 30, 5])
    assert n == 3 * BS
    assert [ld.block_ids for ld in meta.loads] == [[11, 3, 30]]
    assert leases(vd) == 1  # the scheduler's, held for the load
    assert run_step(b.worker, b.kv, meta) == set()
    for x, y in zip(pages_of(a.kv, [4, 9, 2]), pages_of(b.kv, [11, 3, 30])):
        assert torch.equal(x.view(torch.int16), y.view(torch.int16))
    # Blocks outside the load were not touched.
    assert all(int(t[:, [0, 1, 5, 6]].abs().sum()) == 0 for t in b.kv.values())
    b.sched.request_finished(r, [11, 3, 30, 5])
    assert leases(vd) == 0
    # A prompt that is exactly whole pages leaves its last page for the engine to compute.
    r2 = request(toks[:3 * BS])
    assert b.sched.get_num_new_matched_tokens(r2, 0) == (2 * BS, False)
    b.sched.request_finished(r2, [])
    # Tokens vLLM computed itself are not loaded again.
    r3 = request(toks[:3 * BS] + [1])
    assert b.sched.get_num_new_matched_tokens(r3, BS) == (2 * BS, False)
    b.sched.update_state_after_alloc(r3, blocks([8, 9, 10, 12]), 2 * BS)
    m3 = b.sched.build_connector_meta(sched_output())
    assert [(t.first, t.block_ids) for t in m3.loads] == [(1, [9, 10])]
    b.sched.request_finished(r3, [])
    assert leases(vd) == 0
    a.close()
    b.close()


def test_identity_salt_lora_multimodal(vd: Daemon) -> None:
    a, b = Engine(vd, seed=2), Engine(vd, seed=None)
    toks = prompt(2)

    def image(ident: str) -> "MultiModalFeatureSpec":
        return MultiModalFeatureSpec(data=None, modality="image", identifier=ident,
                                     mm_position=PlaceholderRange(offset=3, length=8))

    lora = LoRARequest("adapter-a", 1, "/adapters/a")
    saved = [request(toks, cache_salt="tenant-a"), request(toks, lora_request=lora),
             request(toks, mm_features=[image("img-a")])]
    for i, r in enumerate(saved):
        save_prompt(a, r, [3 * i, 3 * i + 1, 3 * i + 2])
    # The same kind of request hits; another salt, adapter or image (same token ids) does not.
    hit = [request(toks, cache_salt="tenant-a"), request(toks, lora_request=lora),
           request(toks, mm_features=[image("img-a")])]
    miss = [request(toks), request(toks, cache_salt="tenant-b"),
            request(toks, lora_request=LoRARequest("adapter-b", 2, "/adapters/b")),
            request(toks, lora_request=LoRARequest("adapter-a", 1, "/adapters/a-v2")),
            request(toks, mm_features=[image("img-b")])]
    for r in hit:
        assert b.sched.get_num_new_matched_tokens(r, 0) == (2 * BS, False), r
        b.sched.request_finished(r, [])
    for r in miss:
        assert b.sched.get_num_new_matched_tokens(r, 0) == (0, False), r
        b.sched.request_finished(r, [])
    # Another model's namespace does not see them either.
    other = Engine(vd, seed=None, model="another-model")
    assert other.sched.get_num_new_matched_tokens(request(toks, cache_salt="tenant-a"), 0) == \
        (0, False)
    assert leases(vd) == 0
    for e in (a, b, other):
        e.close()


def test_daemon_killed_mid_load(vd: Daemon) -> None:
    a, b = Engine(vd, seed=3), Engine(vd, seed=None)
    toks = prompt(3)
    save_prompt(a, request(toks), [1, 2, 3, 4])
    r = request(toks)
    n, meta = schedule(b.sched, r, [5, 6, 7, 8])
    assert n == 3 * BS and leases(vd) == 1
    vd.stop(signal.SIGKILL)  # between the scheduler's answer and the worker's load
    # The worker's load fails: its blocks are reported for recompute, nothing raises.
    assert run_step(b.worker, b.kv, meta) == {5, 6, 7}
    b.sched.request_finished(r, [5, 6, 7, 8])
    # The daemon still down: the scheduler sees no hit, and a save is dropped quietly.
    r2 = request(toks)
    assert b.sched.get_num_new_matched_tokens(r2, 0) == (0, False)
    b.sched.update_state_after_alloc(r2, blocks([9, 10, 11, 12]), 0)
    meta2 = b.sched.build_connector_meta(sched_output(new=[(r2, [9, 10, 11, 12], len(toks))]))
    assert run_step(b.worker, b.kv, meta2) == set()
    b.sched.request_finished(r2, [])
    a.close()
    b.close()


def test_daemon_restarted_no_lease_left(vd: Daemon) -> None:
    """A lookup, then the daemon gone and another in its place: the old lease is not left on
    the new daemon, and the connector reconnects to it."""
    d2 = Daemon()
    try:
        e = Engine(d2, seed=4)
        toks = prompt(2)
        save_prompt(e, request(toks), [1, 2, 3])
        r = request(toks)
        assert e.sched.get_num_new_matched_tokens(r, 0) == (2 * BS, False)
        assert leases(d2) == 1
        e.sched.request_finished(r, [])  # aborted before it was scheduled
        assert leases(d2) == 0
        # Asked twice (not scheduled the first time): one lease, not two.
        r = request(toks)
        e.sched.get_num_new_matched_tokens(r, 0)
        e.sched.get_num_new_matched_tokens(r, 0)
        assert leases(d2) == 1
        e.sched.request_finished(r, [])
        assert leases(d2) == 0
        e.close()
    finally:
        d2.stop(signal.SIGKILL)


def test_leases_released_on_finish_and_abort(vd: Daemon) -> None:
    a, b = Engine(vd, seed=5), Engine(vd, seed=None)
    toks = prompt(2)
    save_prompt(a, request(toks), [1, 2, 3])
    # Scheduled, loaded, then finished: released.
    r = request(toks)
    n, meta = schedule(b.sched, r, [4, 5, 6])
    assert n == 2 * BS and leases(vd) == 1
    assert run_step(b.worker, b.kv, meta) == set()
    assert leases(vd) == 1  # the worker's own lease went with its GET
    b.sched.request_finished(r, [4, 5, 6])
    assert leases(vd) == 0
    # Aborted with its load planned but not yet run: released, and the load is not sent.
    r = request(toks)
    assert b.sched.get_num_new_matched_tokens(r, 0)[0] == 2 * BS
    b.sched.update_state_after_alloc(r, blocks([7, 8, 9]), 2 * BS)
    assert leases(vd) == 1
    b.sched.request_finished(r, [7, 8, 9])
    assert leases(vd) == 0
    assert b.sched.build_connector_meta(sched_output()).loads == []
    a.close()
    b.close()


def test_scheduler_survives_no_daemon(tmp_path: Any) -> None:
    cfg = VllmConfig(
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvtierConnector", kv_connector_module_path="kvtier.vllm",
            kv_role="kv_both", kv_connector_extra_config={"unix_path": str(tmp_path / "none")}),
        device_config=DeviceConfig(device="cpu"), cache_config=CacheConfig(block_size=BS))
    s = connector(cfg, KVConnectorRole.SCHEDULER)
    r = request(prompt(4))
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)
    assert s.request_finished(r, []) == (False, None)
    s.shutdown()
