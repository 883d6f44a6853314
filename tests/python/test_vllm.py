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
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import pytest
import torch

from conftest import Daemon, STALL_SLACK
from vllm_harness import forward, handed_back, skip_without_vllm, vllm_config
from vllm_harness import settle as settle_saves

try:
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ParallelConfig,
        VllmConfig,
    )
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
    skip_without_vllm(e)

import kvtier.vllm as kv  # noqa: E402

# The paged KV's shape and the end-to-end model are shared with the other connectors' tests.
from tiny_model import BS, DTYPE, HEAD, HEADS, NBLOCKS, TinyModel  # noqa: E402
from tiny_model import paged_kv as paged  # noqa: E402

_ids = itertools.count(1)
_tok = itertools.count(0)


def config(d: Daemon, tp: int = 1, **extra: Any) -> "VllmConfig":
    return vllm_config(d, "tiny-test", BS, tp, **extra)


def connector(cfg: "VllmConfig", role: "KVConnectorRole") -> Any:
    return KVConnectorFactory.create_connector(
        cfg, role, KVCacheConfig(num_blocks=NBLOCKS, kv_cache_tensors=[], kv_cache_groups=[]))


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


def load_between_steps(e: "Engine", r: "Request") -> set:
    """An asynchronous load (load_async): a step in which the request waits for its KV (not
    scheduled), then the worker's steps until get_finished reports it. Returns the blocks
    reported as failed, in the pass that reports the request or before."""
    meta = e.sched.build_connector_meta(sched_output())
    e.worker.bind_connector_metadata(meta)
    e.worker.start_load_kv(None)
    errors: set = set()
    deadline = time.monotonic() + 5
    while True:
        e.worker.wait_for_save()
        sending, recving = e.worker.get_finished(set())
        errors |= e.worker.get_block_ids_with_load_errors()
        assert sending is None
        if recving:
            assert recving == {r.request_id}
            break
        assert time.monotonic() < deadline, "the load was never reported"
        time.sleep(0.005)
    e.worker.clear_connector_metadata()
    return errors


def run_step(worker: Any, kvc: Dict[str, torch.Tensor], meta: Any, settle: bool = True) -> set:
    """The worker's calls in one forward, as vLLM's model runner and attention layers make
    them. Returns the blocks reported as failed to load. Saves are asynchronous: with
    ``settle``, waits (as a test, outside the step) until the step's saves are stored, so
    that another engine's lookup finds them."""
    errors = forward(worker, kvc, meta)
    if settle:
        settle_saves(worker, 3.0)
    return errors


def finish(e: "Engine", r: "Request", ids: List[int]) -> bool:
    """request_finished, then, when the scheduler holds the blocks (a save was planned), the
    worker's get_finished calls of the following steps until it hands them back. Returns
    whether they were held."""
    held, params = e.sched.request_finished(r, ids)
    assert params is None
    if held:
        handed_back(e.worker, r.request_id)
    return held


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


def pages_of(kvc: Dict[str, torch.Tensor], ids: List[int]) -> List[torch.Tensor]:
    return [t[:, ids] for t in kvc.values()]


def save_prompt(e: Engine, r: "Request", ids: List[int]) -> None:
    n, meta = schedule(e.sched, r, ids)
    assert n == 0 and not meta.loads
    assert run_step(e.worker, e.kv, meta) == set()
    assert finish(e, r, ids)


def test_factory_builds_both_roles(vd: Daemon) -> None:
    cfg = config(vd)
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        c = connector(cfg, role)
        assert type(c).__name__ == "KvtierConnector" and c.role == role
        c.shutdown()


APIS = ["keys", "tokens"] if kv.store._HAVE_KEYS else ["tokens"]


@pytest.mark.parametrize("api", APIS)
def test_save_then_load_into_another_paged_tensor(vd: Daemon, api: str) -> None:
    # A stores one page per PUT (put_bytes under a page), B loads them all in one GET.
    a, b = Engine(vd, seed=1, put_bytes=1, api=api), Engine(vd, seed=None, api=api)
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
    with vd.client() as c:  # the connector's defaults take the zero-copy path
        st = c.stats()
        assert st["zero_copy_pages_reserve"] > 0 and st["zero_copy_pages_get"] > 0, st
    for x, y in zip(pages_of(a.kv, [4, 9, 2]), pages_of(b.kv, [11, 3, 30])):
        assert torch.equal(x.view(torch.int16), y.view(torch.int16))
    # Blocks outside the load were not touched.
    assert all(int(t[:, [0, 1, 5, 6]].abs().sum()) == 0 for t in b.kv.values())
    b.sched.request_finished(r, [11, 3, 30, 5])
    assert wait_until(lambda: leases(vd) == 0)
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
    assert wait_until(lambda: leases(vd) == 0)
    a.close()
    b.close()


def test_async_load(vd: Daemon) -> None:
    """load_async: the hit is announced as asynchronous, the pages arrive between steps into
    the allocated blocks, get_finished reports the request; a load that fails (daemon killed)
    is reported the same way, its blocks as load errors in the same pass. On the Unix socket
    the pages are read where they lie in the mapping (GET by location), no staging copy."""
    a, b = Engine(vd, seed=8), Engine(vd, seed=None, load_async=True)
    toks = prompt(3)
    save_prompt(a, request(toks), [4, 9, 2, 7])
    r = request(toks)
    assert b.sched.get_num_new_matched_tokens(r, 0) == (3 * BS, True)
    b.sched.update_state_after_alloc(r, blocks([11, 3, 30, 5]), 3 * BS)
    before = zc_stats(vd)
    assert load_between_steps(b, r) == set()
    assert b.worker._async_store.mapped
    assert zc_stats(vd)["zero_copy_pages_get"] - before["zero_copy_pages_get"] == 3
    for x, y in zip(pages_of(a.kv, [4, 9, 2]), pages_of(b.kv, [11, 3, 30])):
        assert torch.equal(x.view(torch.int16), y.view(torch.int16))
    # Then scheduled with its 48 tokens computed: nothing loaded again, nothing saved again.
    r.num_computed_tokens = 3 * BS
    meta = b.sched.build_connector_meta(sched_output(new=[(r, [11, 3, 30, 5], 5)]))
    assert meta.loads == [] and meta.saves == []
    b.sched.request_finished(r, [11, 3, 30, 5])
    assert wait_until(lambda: leases(vd) == 0)
    # The daemon killed before the load: the request is still reported, its blocks failed.
    r = request(toks)
    assert b.sched.get_num_new_matched_tokens(r, 0) == (3 * BS, True)
    b.sched.update_state_after_alloc(r, blocks([12, 13, 14, 15]), 3 * BS)
    vd.stop(signal.SIGKILL)
    assert load_between_steps(b, r) == {12, 13, 14}
    b.sched.request_finished(r, [])
    a.close()
    b.close()


@pytest.mark.parametrize("zero_copy", [True, False])
def test_load_overlaps_the_forward_layer_by_layer(vd: Daemon, zero_copy: bool) -> None:
    """Loads overlap compute as far as vLLM's per-layer wait allows: once the step's first
    wait_for_layer_load has returned (its layer in the blocks), the later layers arrive in
    vLLM's blocks while the forward computes, before it waits for them; then the step ends
    with no load error and every layer byte for byte."""
    a, b = Engine(vd, seed=62), Engine(vd, seed=None, zero_copy=zero_copy)
    toks = prompt(3)
    save_prompt(a, request(toks), [4, 9, 2, 7])
    r = request(toks)
    n, meta = schedule(b.sched, r, [11, 3, 30, 5])
    assert n == 3 * BS
    names = list(b.kv)

    def layer_in(name: str) -> bool:
        return torch.equal(a.kv[name][:, [4, 9, 2]].view(torch.int16),
                           b.kv[name][:, [11, 3, 30]].view(torch.int16))

    w = b.worker
    w.bind_connector_metadata(meta)
    w.start_load_kv(None)
    w.wait_for_layer_load(names[0])
    assert layer_in(names[0])
    assert wait_until(lambda: all(layer_in(x) for x in names[1:])), \
        "the later layers came only when waited for"
    for name in names[1:]:
        w.wait_for_layer_load(name)
    w.wait_for_save()
    assert w.get_block_ids_with_load_errors() == set()
    w.clear_connector_metadata()
    assert w._store.mapped is zero_copy
    b.sched.request_finished(r, [])
    assert wait_until(lambda: leases(vd) == 0)
    a.close()
    b.close()


@pytest.mark.skipif(not kv.store._HAVE_KEYS, reason="the package has no keyed calls (api tokens)")
def test_pages_are_a_keyed_chain(vd: Daemon) -> None:
    """The connector's pages are the package's keyed chain of vLLM block hashes: a plain
    Client finds them with exists_keys and reads them with get_keys_into."""
    a = Engine(vd, seed=9)
    toks = prompt(2)
    r = request(toks)
    save_prompt(a, r, [1, 2, 3])
    keys = kv.key_chain(r, BS, kv.chain_root("tiny-test"), [], 2)
    page = a.worker._layout.page_bytes
    with vd.client(model="tiny-test", salt=kv.rank_salt(0, 1, 0, 1), block_bytes=page) as c:
        assert c.exists_keys(keys) == 2
        out = torch.empty((2, page), dtype=torch.uint8)
        assert c.get_keys_into(keys, out) == 2
    name = next(iter(a.kv))
    assert torch.equal(out[1, :a.worker._layout.sizes[0]].view(DTYPE).view(2, BS, HEADS, HEAD),
                       a.kv[name][:, 2])
    a.close()


def test_tensor_parallel_ranks_keep_their_shards(vd: Daemon) -> None:
    """Tensor parallelism 2: each rank stores its shard under the same chain, in its rank's
    namespace, and gets its own back; a rank whose shard is missing reports load errors."""
    toks = prompt(2)

    def ranks(seed: Optional[int]) -> Tuple[Any, List[Any], List[Dict[str, torch.Tensor]]]:
        sched = connector(config(vd, tp=2), KVConnectorRole.SCHEDULER)
        workers, kvs = [], []
        for rank in range(2):
            w = connector(config(vd, tp=2, tp_rank=rank), KVConnectorRole.WORKER)
            kvs.append(paged(None if seed is None else seed + rank))
            w.register_kv_caches(kvs[-1])
            workers.append(w)
        return sched, workers, kvs

    sched, workers, kvs = ranks(seed=20)
    r = request(toks)
    n, meta = schedule(sched, r, [1, 2, 3])
    for w, k in zip(workers, kvs):
        assert run_step(w, k, meta) == set()
    sched.request_finished(r, [1, 2, 3])
    sched2, workers2, kvs2 = ranks(seed=None)
    r = request(toks)
    n, meta = schedule(sched2, r, [7, 8, 9])
    assert n == 2 * BS
    for w, k in zip(workers2, kvs2):
        assert run_step(w, k, meta) == set()
    for rank in range(2):
        for x, y in zip(pages_of(kvs[rank], [1, 2]), pages_of(kvs2[rank], [7, 8])):
            assert torch.equal(x.view(torch.int16), y.view(torch.int16))
    sched2.request_finished(r, [])
    # Rank 0 alone saved a prompt: the scheduler (rank 0's namespace) sees it, rank 1 cannot
    # load its shard and says so.
    toks2 = prompt(2)
    r = request(toks2)
    n, meta = schedule(sched, r, [4, 5, 6])
    assert run_step(workers[0], kvs[0], meta) == set()
    sched.request_finished(r, [])
    r = request(toks2)
    n, meta = schedule(sched2, r, [10, 11, 12])
    assert n == 2 * BS
    assert run_step(workers2[0], kvs2[0], meta) == set()
    assert run_step(workers2[1], kvs2[1], meta) == {10, 11}
    sched2.request_finished(r, [])
    assert wait_until(lambda: leases(vd) == 0)
    for c in (sched, sched2, *workers, *workers2):
        c.shutdown()


def _pp_stage(stage: int, port: int, unix: str, toks: List[int], q: Any) -> None:
    """One stage of a 2-stage pipeline, in a process of its own (spawned): vLLM's own parallel
    state (init_distributed_environment and initialize_model_parallel over gloo, as vLLM's
    worker makes it before building the connector), and connectors whose extra config names no
    rank. Saves the prompt's 2 pages from this stage's layers (page j filled with
    10 * (stage + 1) + j), then a fresh worker of the same stage loads them into zeroed KV.
    Puts (stage, None) or (stage, the failure) on q."""
    import traceback

    try:
        from vllm.config import set_current_vllm_config
        from vllm.distributed import parallel_state as ps

        cfg = VllmConfig(
            kv_transfer_config=KVTransferConfig(
                kv_connector="KvtierConnector", kv_connector_module_path="kvtier.vllm",
                kv_role="kv_both", kv_connector_extra_config={
                    "unix_path": unix, "model": "tiny-pp", "worker_deadline_ms": 2000}),
            device_config=DeviceConfig(device="cpu"), cache_config=CacheConfig(block_size=BS),
            parallel_config=ParallelConfig(pipeline_parallel_size=2))
        with set_current_vllm_config(cfg):
            ps.init_distributed_environment(
                world_size=2, rank=stage, local_rank=stage, backend="gloo",
                distributed_init_method="tcp://127.0.0.1:%d" % port)
            ps.initialize_model_parallel(1, 2, backend="gloo")
        assert ps.get_pp_group().rank_in_group == stage

        def stage_kv(fill: bool) -> Dict[str, torch.Tensor]:
            kvc = {"model.layers.%d.self_attn.attn" % (2 * stage + i):
                   torch.zeros(2, NBLOCKS, BS, HEADS, HEAD, dtype=DTYPE) for i in range(2)}
            if fill:
                for t in kvc.values():
                    for j, b in enumerate([1, 2]):
                        t[:, b] = 10 * (stage + 1) + j
            return kvc

        sched = connector(cfg, KVConnectorRole.SCHEDULER)
        w = connector(cfg, KVConnectorRole.WORKER)
        kvc = stage_kv(True)
        w.register_kv_caches(kvc)
        r = request(toks)
        n, meta = schedule(sched, r, [1, 2, 3])
        assert n == 0
        torch.distributed.barrier()  # both stages looked up before either saved
        assert run_step(w, kvc, meta) == set()
        sched.request_finished(r, [1, 2, 3])
        torch.distributed.barrier()  # both stages saved
        w.shutdown()
        fresh = connector(cfg, KVConnectorRole.WORKER)
        kv2 = stage_kv(False)
        fresh.register_kv_caches(kv2)
        r = request(toks)
        n, meta = schedule(sched, r, [5, 6, 7])
        assert n == 2 * BS
        assert run_step(fresh, kv2, meta) == set()
        sched.request_finished(r, [])
        for name, t in kv2.items():
            for j, b in enumerate([5, 6]):
                got = sorted(set(t[:, b].float().flatten().tolist()))
                assert got == [10.0 * (stage + 1) + j], (stage, name, j, got)
        fresh.shutdown()
        sched.shutdown()
        torch.distributed.barrier()
        ps.destroy_model_parallel()
        ps.destroy_distributed_environment()
        q.put((stage, None))
    except BaseException:  # noqa: BLE001 - reported to the test
        q.put((stage, traceback.format_exc()))


def test_pipeline_stages_default_to_vllms_rank(vd: Daemon) -> None:
    """Pipeline parallelism 2, no pp_rank in the extra config: each stage takes its rank from
    vLLM's own parallel state (initialised for real, two processes over gloo), so a fresh
    stage-1 worker loads stage 1's layers (20, 21), not stage 0's (10, 11); stage 0 its own."""
    import multiprocessing
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    toks = prompt(2)
    procs = [ctx.Process(target=_pp_stage, args=(stage, port, vd.unix, toks, q))
             for stage in range(2)]
    for p in procs:
        p.start()
    try:
        results = dict(q.get(timeout=180) for _ in procs)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert results == {0: None, 1: None}, "\n".join(v for v in results.values() if v)


def test_pipeline_stage_without_a_rank_refuses(vd: Daemon) -> None:
    """Pipeline parallelism 2 outside vLLM's worker (no parallel state) and no pp_rank: the
    worker refuses to guess stage 0 (it would mix the stages' pages); pp_rank set, it runs."""
    cfg = config(vd)
    cfg.parallel_config.pipeline_parallel_size = 2
    w = connector(cfg, KVConnectorRole.WORKER)
    with pytest.raises(ValueError, match="pp_rank"):
        w.register_kv_caches(paged(None))
    w.shutdown()
    cfg.kv_transfer_config.kv_connector_extra_config["pp_rank"] = 1
    w = connector(cfg, KVConnectorRole.WORKER)
    w.register_kv_caches(paged(None))
    assert w._store._salt == kv.rank_salt(0, 1, 1, 2)
    w.shutdown()


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
    assert wait_until(lambda: leases(vd) == 0)
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


def test_forward_copies_the_layers_the_io_thread_has_not_taken(vd: Daemon) -> None:
    """A layer not yet copied when the forward asks for it: the forward copies the layers no
    one has taken rather than sleeping until the I/O thread reaches each (a wake-up per layer
    and the GIL handed back and forth, docs/benchmarks.md). With the I/O thread's copies
    slowed to 0.3 s a layer, the step takes about one of them, not one per layer; the bytes
    are the saved ones and the lease goes back once every layer is in."""
    a, b = Engine(vd, seed=41), Engine(vd, seed=None)
    toks = prompt(2)
    save_prompt(a, request(toks), [1, 2, 3])
    r = request(toks)
    n, meta = schedule(b.sched, r, [4, 5, 6])
    assert n == 2 * BS
    lay = b.worker._layout
    slow = 0.3
    by: Dict[str, List[int]] = {"io": [], "forward": []}
    real = lay.scatter_runs

    def scatter_runs(runs: Any, layer: int, kvl: torch.Tensor, *plan: Any) -> None:
        io = threading.current_thread().name.startswith("kvtier-vllm")
        by["io" if io else "forward"].append(layer)
        if io:
            time.sleep(slow)
        real(runs, layer, kvl, *plan)

    lay.scatter_runs = scatter_runs
    b.worker.bind_connector_metadata(meta)
    t0 = time.monotonic()
    b.worker.start_load_kv(None)
    for name in b.kv:
        b.worker.wait_for_layer_load(name)
    took = time.monotonic() - t0
    b.worker.wait_for_save()
    assert b.worker.get_block_ids_with_load_errors() == set()
    b.worker.clear_connector_metadata()
    assert by["forward"], by
    assert sorted(by["io"] + by["forward"]) == list(range(len(b.kv))), by
    assert took < 2 * slow, (took, by)
    for name in b.kv:
        assert torch.equal(b.kv[name][:, [4, 5]], a.kv[name][:, [1, 2]]), name
    b.sched.request_finished(r, [4, 5, 6])
    assert wait_until(lambda: leases(vd) == 0)
    a.close()
    b.close()


def test_daemon_hung_mid_load(vd: Daemon) -> None:
    """The daemon stops answering (SIGSTOP) between the lookup and the load: the load times
    out into load errors; once it answers again, no lease is left."""
    a, b = Engine(vd, seed=6), Engine(vd, seed=None, worker_deadline_ms=300)
    toks = prompt(2)
    save_prompt(a, request(toks), [1, 2, 3])
    r = request(toks)
    n, meta = schedule(b.sched, r, [4, 5, 6])
    assert n == 2 * BS
    vd.freeze()
    try:
        assert run_step(b.worker, b.kv, meta) == {4, 5}
    finally:
        os.kill(vd.proc.pid, signal.SIGCONT)
    b.sched.request_finished(r, [4, 5, 6])
    deadline = time.monotonic() + 2
    while leases(vd) and time.monotonic() < deadline:  # the worker's closed connection
        time.sleep(0.01)
    assert wait_until(lambda: leases(vd) == 0)
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
    assert wait_until(lambda: leases(vd) == 0)
    # Aborted with its load planned but not yet run: released, and the load is not sent.
    r = request(toks)
    assert b.sched.get_num_new_matched_tokens(r, 0)[0] == 2 * BS
    b.sched.update_state_after_alloc(r, blocks([7, 8, 9]), 2 * BS)
    assert leases(vd) == 1
    b.sched.request_finished(r, [7, 8, 9])
    assert wait_until(lambda: leases(vd) == 0)
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


# -- the worker's zero-copy path: one copy each way through the mapping ----------------------


def zc_stats(d: Daemon) -> Dict[str, int]:
    with d.client() as c:
        return c.stats()


def no_staging(w: Any) -> bool:
    """No staging buffer was ever made: neither the loads' nor a save job's."""
    return w._staged == 0 and not w._staging_free and all(a.numel() == 0 for a in w._arenas)


def same_pages(x: Engine, xi: List[int], y: Engine, yi: List[int]) -> bool:
    return all(torch.equal(p.view(torch.int16), q.view(torch.int16))
               for p, q in zip(pages_of(x.kv, xi), pages_of(y.kv, yi)))


def test_zero_copy_path_is_used(vd: Daemon) -> None:
    """On the Unix socket the worker maps its namespace's arena: a save reserves the step's
    pages and writes each layer straight into them (RESERVE, COMMIT), a load reads them where
    they lie (GET by location) and scatters each layer from there into another paged tensor,
    byte for byte; the staging buffers are never made."""
    a, b = Engine(vd, seed=11), Engine(vd, seed=None)
    toks = prompt(3)
    before = zc_stats(vd)
    save_prompt(a, request(toks), [4, 9, 2, 7])
    mid = zc_stats(vd)
    assert a.worker._store.mapped
    assert mid["zero_copy_pages_reserve"] - before["zero_copy_pages_reserve"] == 3
    assert mid["reservations_committed"] - before["reservations_committed"] == 1
    assert mid["requests_put"] == before["requests_put"], "nothing went through the socket"
    r = request(toks)
    n, meta = schedule(b.sched, r, [11, 3, 30, 5])
    assert n == 3 * BS
    assert run_step(b.worker, b.kv, meta) == set()
    after = zc_stats(vd)
    assert b.worker._store.mapped
    assert after["zero_copy_pages_get"] - mid["zero_copy_pages_get"] == 3
    assert same_pages(a, [4, 9, 2], b, [11, 3, 30])
    assert all(int(t[:, [0, 1, 5, 6]].abs().sum()) == 0 for t in b.kv.values())
    for w in (a.worker, b.worker):  # no staging: the one copy is the layer's, into/from the arena
        assert no_staging(w)
    b.sched.request_finished(r, [11, 3, 30, 5])
    assert wait_until(lambda: leases(vd) == 0)
    a.close()
    b.close()


def _jobs_of(w: Any) -> List[Any]:
    return [j for jobs in w._jobs.values() for j in jobs]


def test_save_reserves_at_the_groups_first_layer(vd: Daemon) -> None:
    """A step's save job goes to the I/O thread at its group's first layer and makes its
    RESERVE while the forward computes the other layers (issue 35: RESERVE and the hand-off to
    the I/O thread were after the last layer); it reads the blocks only once the last layer is
    in, so the pages hold what the blocks hold then, byte for byte."""
    a, b = Engine(vd, seed=23), Engine(vd, seed=None)
    toks = prompt(3)
    r = request(toks)
    ids = [6, 1, 8, 3]
    n, meta = schedule(a.sched, r, ids)
    assert n == 0
    before = zc_stats(vd)
    names = list(a.kv)
    a.worker.bind_connector_metadata(meta)
    a.worker.start_load_kv(None)
    a.worker.wait_for_layer_load(names[0])
    a.worker.save_kv_layer(names[0], a.kv[names[0]], None)
    assert wait_until(lambda: zc_stats(vd)["zero_copy_pages_reserve"]
                      - before["zero_copy_pages_reserve"] == 3), "no RESERVE at the first layer"
    time.sleep(0.05)  # the job would have read the blocks by now if it did not wait
    assert [j.copied for j in _jobs_of(a.worker)] == [False]
    for t in a.kv.values():  # the other layers' KV, computed after the first layer's save
        t[:, ids].view(torch.int16).random_(-30000, 30000)
    for name in names[1:]:
        a.worker.wait_for_layer_load(name)
        a.worker.save_kv_layer(name, a.kv[name], None)
    a.worker.wait_for_save()
    a.worker.clear_connector_metadata()
    assert finish(a, r, ids)
    mid = zc_stats(vd)
    assert mid["reservations_committed"] - before["reservations_committed"] == 1
    rb = request(toks)
    into = [10, 2, 30, 5]
    n, meta = schedule(b.sched, rb, into)
    assert n == 3 * BS
    assert run_step(b.worker, b.kv, meta) == set()
    assert same_pages(a, ids[:3], b, into[:3])
    b.sched.request_finished(rb, into)
    assert wait_until(lambda: leases(vd) == 0)
    a.close()
    b.close()


def test_save_reserves_every_request_at_the_groups_first_layer(vd: Daemon) -> None:
    """A step that saves several requests makes every request's RESERVE at the group's first
    layer, not only the first request's (issue 35: each job waited for the last layer before
    the next one reserved, so every request after the first reserved after it); each job
    reads its blocks only once the last layer is in, and every request's pages are stored
    byte for byte."""
    a, b = Engine(vd, seed=31), Engine(vd, seed=None)
    reqs = [(request(prompt(2)), [6, 1, 9]), (request(prompt(3)), [2, 8, 3, 12]),
            (request(prompt(1)), [14, 15])]
    for r, ids in reqs:
        n, _ = a.sched.get_num_new_matched_tokens(r, 0)
        assert n == 0
        a.sched.update_state_after_alloc(r, blocks(ids), 0)
    meta = a.sched.build_connector_meta(sched_output(new=[(r, ids, r.num_tokens)
                                                           for r, ids in reqs]))
    assert len(meta.saves) == 3
    before = zc_stats(vd)
    names = list(a.kv)
    a.worker.bind_connector_metadata(meta)
    a.worker.start_load_kv(None)
    a.worker.save_kv_layer(names[0], a.kv[names[0]], None)
    # Well within worker_deadline_ms (2 s): past it, the first job gives its room back and
    # the next ones reserve in turn, each after the last.
    assert wait_until(lambda: zc_stats(vd)["zero_copy_pages_reserve"]
                      - before["zero_copy_pages_reserve"] == 6, timeout=1.0), \
        "not every request reserved at the first layer"
    time.sleep(0.05)  # a job would have read the blocks by now if it did not wait
    assert [(j.copied, j.cancelled) for j in _jobs_of(a.worker)] == [(False, False)] * 3
    for t in a.kv.values():  # the other layers' KV, computed after the first layer's save
        t[:, list(range(1, 16))].view(torch.int16).random_(-30000, 30000)
    for name in names[1:]:
        a.worker.save_kv_layer(name, a.kv[name], None)
    a.worker.wait_for_save()
    a.worker.clear_connector_metadata()
    assert a.worker.wait_saves(None, 5)
    for r, ids in reqs:
        assert a.sched.request_finished(r, ids) == (True, None)
    sending, _ = a.worker.get_finished({r.request_id for r, _ in reqs})
    assert sending == {r.request_id for r, _ in reqs}
    assert zc_stats(vd)["reservations_committed"] - before["reservations_committed"] == 3
    for (r, ids), into in zip(reqs, ([20, 21, 22], [23, 24, 25, 26], [27, 28])):
        rb = request(list(r.all_token_ids))
        n, m = schedule(b.sched, rb, into)
        assert n == (len(ids) - 1) * BS
        assert run_step(b.worker, b.kv, m) == set()
        assert same_pages(a, ids[:-1], b, into[:-1])
        b.sched.request_finished(rb, into)
    assert wait_until(lambda: leases(vd) == 0)
    a.close()
    b.close()


def test_save_reserves_ahead_within_its_cap(vd: Daemon, monkeypatch: Any) -> None:
    """The requests that reserve at the group's first layer are capped (_AHEAD_JOBS: the
    daemon bounds one connection's reservations): past the cap a request reserves in its turn,
    after the last layer, and is stored all the same."""
    import kvtier.vllm.worker as vw

    monkeypatch.setattr(vw, "_AHEAD_JOBS", 2)
    a = Engine(vd, seed=37)
    reqs = [(request(prompt(1)), [6, 1]), (request(prompt(2)), [2, 8, 3]),
            (request(prompt(3)), [12, 13, 14, 15])]
    for r, ids in reqs:
        a.sched.get_num_new_matched_tokens(r, 0)
        a.sched.update_state_after_alloc(r, blocks(ids), 0)
    meta = a.sched.build_connector_meta(sched_output(new=[(r, ids, r.num_tokens)
                                                           for r, ids in reqs]))
    before = zc_stats(vd)
    names = list(a.kv)
    a.worker.bind_connector_metadata(meta)
    a.worker.start_load_kv(None)
    a.worker.save_kv_layer(names[0], a.kv[names[0]], None)

    def reserved() -> int:
        return zc_stats(vd)["zero_copy_pages_reserve"] - before["zero_copy_pages_reserve"]

    assert wait_until(lambda: reserved() == 3, timeout=1.0)  # the first two requests' pages
    time.sleep(0.1)
    assert reserved() == 3, "the third request reserved ahead, past the cap"
    for name in names[1:]:
        a.worker.save_kv_layer(name, a.kv[name], None)
    a.worker.wait_for_save()
    a.worker.clear_connector_metadata()
    assert a.worker.wait_saves(None, 5)
    assert reserved() == 6
    assert zc_stats(vd)["reservations_committed"] - before["reservations_committed"] == 3
    assert a.worker.kvtier_stats()["saves_dropped"] == 0
    for r, ids in reqs:
        assert finish(a, r, ids)
    a.close()


def test_save_of_a_group_whose_last_layer_never_came(vd: Daemon) -> None:
    """A step that ends (wait_for_save) before its group's last layer came to this worker
    saves nothing, as before the jobs went at the first layer: the early job's reservation is
    given back unread, nothing is committed or counted dropped, and the request is handed back
    once the job is done."""
    a = Engine(vd, seed=29)
    toks = prompt(3)
    r = request(toks)
    ids = [6, 1, 8, 3]
    n, meta = schedule(a.sched, r, ids)
    before = zc_stats(vd)
    names = list(a.kv)
    a.worker.bind_connector_metadata(meta)
    a.worker.start_load_kv(None)
    a.worker.save_kv_layer(names[0], a.kv[names[0]], None)
    assert wait_until(lambda: zc_stats(vd)["zero_copy_pages_reserve"]
                      - before["zero_copy_pages_reserve"] == 3)
    a.worker.wait_for_save()
    a.worker.clear_connector_metadata()
    assert finish(a, r, ids)
    after = zc_stats(vd)
    assert after["reservations_committed"] == before["reservations_committed"]
    assert after["reservations_aborted"] - before["reservations_aborted"] == 1, after
    assert a.worker.kvtier_stats()["saves_dropped"] == 0
    assert not a.worker._jobs and a.worker._store._holds == 0
    a.close()


def test_worker_connects_and_maps_at_registration(vd: Daemon) -> None:
    """register_kv_caches makes the worker's connection and maps its namespace's arena, starts
    its I/O threads and takes plan's view of vLLM's tensors: the first step's load and save
    make no connection, HELLO or MAP of their own (bench_vllm's first pass paid them inside the step,
    docs/benchmarks.md)."""
    def stats() -> Dict[str, int]:  # one HELLO, no MAP
        with vd.client(zero_copy=False) as c:
            return c.stats()

    before = stats()
    a = Engine(vd, seed=11)
    mid = stats()
    stores = [s for s in (a.worker._store, a.worker._async_store) if s is not None]
    assert all(s._client is not None and s.mapped for s in stores)
    assert mid["zero_copy_maps_dram"] - before["zero_copy_maps_dram"] == len(stores)
    lay = a.worker._layout
    assert lay._tensor_spans is not None and lay._tensor_spans[1] is not None
    pools = [p for p in (a.worker._pool, a.worker._async_pool) if p is not None]
    assert all(len(p._threads) == 1 for p in pools), "the I/O threads are started"
    b = Engine(vd, seed=None)
    toks = prompt(3)
    held = stats()
    save_prompt(a, request(toks), [4, 9, 2, 7])
    r = request(toks)
    n, meta = schedule(b.sched, r, [11, 3, 30, 5])
    assert n == 3 * BS
    assert run_step(b.worker, b.kv, meta) == set()
    after = stats()
    # The only HELLOs: the two schedulers' (each connects at its first lookup) and stats()'s.
    assert after["zero_copy_maps_dram"] == held["zero_copy_maps_dram"]
    assert after["requests_hello"] - held["requests_hello"] == 3, \
        after["requests_hello"] - held["requests_hello"]
    assert same_pages(a, [4, 9, 2], b, [11, 3, 30])
    b.sched.request_finished(r, [11, 3, 30, 5])
    a.close()
    b.close()


@pytest.mark.parametrize("given, mapped", [("false", False), ("0", False), ("True", True)])
def test_switches_given_as_strings_mean_what_they_say(vd: Daemon, given: str, mapped: bool) -> None:
    """A switch given as a string (an environment or a launch line that quotes it) is read as
    what it says: ``zero_copy`` "false" does not map (bool("false") is True, which mapped)."""
    e = Engine(vd, seed=31, zero_copy=given)
    save_prompt(e, request(prompt(1)), [5, 6])
    assert e.worker._store.mapped is mapped
    e.close()


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("load_async", [False, True])
@pytest.mark.parametrize("zero_copy", [False, True])
def test_zero_copy_false_never_maps(vd: Daemon, api: str, load_async: bool,
                                    zero_copy: bool) -> None:
    """``zero_copy`` False on the Unix socket: neither engine's connections MAP the arena (no
    MAP granted, no page read or reserved through a mapping), so every load is a socket GET,
    which checks the page's checksum (a page changed in DRAM is answered ECORRUPT, never
    served). The keyed worker's fallback client once took the package's default (map) and
    read its loads by location. The default maps and loads by location."""
    def stats() -> Dict[str, int]:  # this observer maps nothing itself
        with vd.client(zero_copy=False) as c:
            return c.stats()

    before = stats()
    a = Engine(vd, seed=13, api=api, zero_copy=zero_copy)
    b = Engine(vd, seed=None, api=api, zero_copy=zero_copy, load_async=load_async)
    toks = prompt(3)
    save_prompt(a, request(toks), [4, 9, 2, 7])
    r = request(toks)
    if load_async:
        assert b.sched.get_num_new_matched_tokens(r, 0) == (3 * BS, True)
        b.sched.update_state_after_alloc(r, blocks([11, 3, 30, 5]), 3 * BS)
        assert load_between_steps(b, r) == set()
    else:
        n, meta = schedule(b.sched, r, [11, 3, 30, 5])
        assert n == 3 * BS
        assert run_step(b.worker, b.kv, meta) == set()
    after = stats()
    assert same_pages(a, [4, 9, 2], b, [11, 3, 30])
    d = {k: after[k] - before.get(k, 0) for k in
         ("zero_copy_maps_dram", "zero_copy_pages_get", "zero_copy_pages_reserve",
          "requests_get")}
    stores = [s for e in (a, b) for s in (e.worker._store, e.worker._async_store) if s]
    if zero_copy:
        assert d["zero_copy_maps_dram"] > 0 and d["zero_copy_pages_get"] == 3, d
    else:
        assert d == {"zero_copy_maps_dram": 0, "zero_copy_pages_get": 0,
                     "zero_copy_pages_reserve": 0, "requests_get": d["requests_get"]}, d
        assert d["requests_get"] > 0, "the load went over the socket"
        assert not any(s.mapped or s._client.zero_copy for s in stores if s._client)
    b.sched.request_finished(r, [11, 3, 30, 5])
    assert wait_until(lambda: leases(vd) == 0)
    a.close()
    b.close()


def test_zero_copy_false_loads_are_checked(vd: Daemon, monkeypatch: Any) -> None:
    """What zero_copy False buys: its loads are socket GETs, and the daemon checks each page
    against its checksum there. Pages saved through the mapping with a bit of each sum flipped
    (as a client writing over them would leave them): an engine with zero_copy False on the
    same Unix socket gets load errors and the daemon counts the scribbles, where reading them
    by location from a mapping would have served them without a check."""
    from kvtier.vllm import layout

    real = layout._Plan.copy_sums
    monkeypatch.setattr(layout._Plan, "copy_sums", lambda self: real(self) ^ np.uint64(1))
    a = Engine(vd, seed=19)
    toks = prompt(3)
    save_prompt(a, request(toks), [4, 9, 2, 7])
    assert a.worker._store.mapped
    mid = zc_stats(vd)
    b = Engine(vd, seed=None, zero_copy=False)
    r = request(toks)
    n, meta = schedule(b.sched, r, [11, 3, 30, 5])
    assert n == 3 * BS
    assert run_step(b.worker, b.kv, meta), "pages with wrong sums were served"
    after = zc_stats(vd)
    assert after["zero_copy_scribbles"] > mid["zero_copy_scribbles"], after
    assert after["zero_copy_pages_get"] == mid["zero_copy_pages_get"], "read by location"
    b.sched.request_finished(r, [11, 3, 30, 5])
    assert wait_until(lambda: leases(vd) == 0)
    a.close()
    b.close()


def test_zero_copy_and_socket_connectors_share_pages(vd: Daemon) -> None:
    """A page saved through the mapping (reserve, commit in the keyed namespace as synthetic
    tokens) is the page put_keys names: a connector over TCP (staging, keyed calls) loads it,
    and one on the Unix socket loads what the TCP one saved; both byte for byte."""
    zc, tcp = Engine(vd, seed=12), Engine(vd, seed=13, unix_path=None, tcp=vd.tcp)
    rz, rt = request(prompt(2)), request(prompt(3))
    save_prompt(zc, rz, [1, 2, 3])
    save_prompt(tcp, rt, [5, 6, 7, 8])
    assert zc.worker._store.mapped and not tcp.worker._store.mapped
    assert tcp.worker._store._client.zero_copy is False
    z2, t2 = Engine(vd, seed=None), Engine(vd, seed=None, unix_path=None, tcp=vd.tcp)
    r = request(list(rz.all_token_ids))
    n, meta = schedule(t2.sched, r, [20, 21, 22])
    assert n == 2 * BS and run_step(t2.worker, t2.kv, meta) == set()
    t2.sched.request_finished(r, [])
    assert same_pages(zc, [1, 2], t2, [20, 21])
    r = request(list(rt.all_token_ids))
    n, meta = schedule(z2.sched, r, [10, 11, 12, 13])
    assert n == 3 * BS and run_step(z2.worker, z2.kv, meta) == set()
    z2.sched.request_finished(r, [])
    assert same_pages(tcp, [5, 6, 7], z2, [10, 11, 12])
    assert z2.worker._store.mapped and no_staging(z2.worker)
    assert wait_until(lambda: leases(vd) == 0)
    for e in (zc, tcp, z2, t2):
        e.close()


def test_zero_copy_step_with_missing_layers_leaves_nothing(vd: Daemon) -> None:
    """A step whose layers do not all come to this worker, or that saves none at all:
    nothing becomes visible (the save job that went at the group's first layer reserved, then
    gave its room back unread at the step's end: reads blocks only after the last layer), and
    the next save of the same pages goes through whole."""
    a = Engine(vd, seed=14)
    names = list(a.kv)
    toks = prompt(2)
    r = request(toks)
    _, meta = schedule(a.sched, r, [1, 2, 3])
    before = zc_stats(vd)
    a.worker.bind_connector_metadata(meta)
    a.worker.start_load_kv(None)
    a.worker.save_kv_layer(names[0], a.kv[names[0]], None)  # the first layer only
    a.worker.wait_for_save()
    a.worker.clear_connector_metadata()
    a.worker.bind_connector_metadata(meta)  # the same step again, no layer saved at all
    a.worker.start_load_kv(None)
    a.worker.wait_for_save()
    a.worker.clear_connector_metadata()
    assert wait_until(lambda: a.worker.saves_in_flight() == 0)  # the abort, on the I/O thread
    finish(a, r, [1, 2, 3])
    after = zc_stats(vd)
    # The first step's early RESERVE, given back unread (none where the step ended before
    # the I/O thread took the job).
    resv = (after["zero_copy_pages_reserve"] - before["zero_copy_pages_reserve"]) // 2
    assert resv in (0, 1)
    assert after["reservations_aborted"] - before["reservations_aborted"] == resv
    assert after["reservations_committed"] == before["reservations_committed"]
    assert a.worker._store._holds == 0
    b = Engine(vd, seed=None)
    assert b.sched.get_num_new_matched_tokens(request(toks), 0) == (0, False)
    save_prompt(a, request(toks), [4, 5, 6])  # now whole: committed, and found
    r = request(toks)
    n, meta = schedule(b.sched, r, [7, 8, 9])
    assert n == 2 * BS and run_step(b.worker, b.kv, meta) == set()
    assert same_pages(a, [4, 5], b, [7, 8])
    b.sched.request_finished(r, [])
    assert wait_until(lambda: leases(vd) == 0)
    a.close()
    b.close()


def test_zero_copy_no_reservation_falls_back_to_the_socket() -> None:
    """A request whose pages get no reservation (here: the daemon's max-reservations is 1 and
    the worker's connection holds one already) is staged and PUT through the socket: nothing
    lost."""
    d = Daemon("--max-reservations", "1")
    try:
        a, b = Engine(d, seed=15), Engine(d, seed=None)
        save_prompt(a, request(prompt(1)), [7, 8])  # connected, mapped
        other = kv.key_chain(request(prompt(1)), BS, kv.chain_root("tiny-test"), [], 1)
        held, _ = a.worker._store.reserve(other, 0)
        assert held.id
        r1, r2 = request(prompt(2)), request(prompt(2))
        r1.num_computed_tokens = r2.num_computed_tokens = 0
        for r in (r1, r2):
            assert a.sched.get_num_new_matched_tokens(r, 0) == (0, False)
            a.sched.update_state_after_alloc(r, blocks([]), 0)
        meta = a.sched.build_connector_meta(sched_output(
            new=[(r1, [1, 2, 3], r1.num_tokens), (r2, [4, 5, 6], r2.num_tokens)]))
        assert len(meta.saves) == 2
        before = zc_stats(d)
        assert run_step(a.worker, a.kv, meta) == set()
        after = zc_stats(d)
        assert a.worker._staged >= 2, "the requests' pages were staged"
        assert after["put_pages_stored"] - before["put_pages_stored"] == 4
        assert after["reservations_committed"] == before["reservations_committed"]
        a.worker._store.abort(held)
        for r in (r1, r2):
            finish(a, r, [])
        for r, src, dst in ((r1, [1, 2], [10, 11]), (r2, [4, 5], [12, 13])):
            q = request(list(r.all_token_ids))
            n, meta = schedule(b.sched, q, dst + [14])
            assert n == 2 * BS and run_step(b.worker, b.kv, meta) == set()
            b.sched.request_finished(q, [])
            assert same_pages(a, src, b, dst)
        a.close()
        b.close()
    finally:
        d.stop(signal.SIGKILL)


def test_staged_pages_of_a_mapped_worker_go_with_their_sums(vd: Daemon,
                                                            monkeypatch: Any) -> None:
    """Pages a mapped worker stages (here its reservation is unusable: the copy plan raises)
    go through Client.put, whose libkvtier put_mapped reserves room for them again, copies
    them in hashing each page and commits with the sums: the daemon records them
    (zero_copy_client_sums up by the pages) and hashes none itself (zero_copy_seals
    unchanged); another engine loads them byte for byte."""
    from kvtier.vllm import layout

    def unusable(*args: Any, **kwargs: Any) -> Any:
        raise ValueError("no plan (test)")

    a, b = Engine(vd, seed=18), Engine(vd, seed=None)
    assert a.worker._store.mapped
    monkeypatch.setattr(layout._Layout, "save_plan", unusable)
    monkeypatch.setattr(layout._Layout, "runs", unusable)
    toks = prompt(3)
    before = zc_stats(vd)
    save_prompt(a, request(toks), [1, 2, 3, 4])
    monkeypatch.undo()  # B's load plans its copies
    after = zc_stats(vd)
    assert a.worker._staged >= 3, "the pages were staged"
    assert after["reservations_aborted"] - before["reservations_aborted"] == 1
    assert after["zero_copy_client_sums"] - before["zero_copy_client_sums"] == 3, after
    assert after["zero_copy_seals"] == before["zero_copy_seals"], "the daemon hashed the pages"
    r = request(toks)
    n, meta = schedule(b.sched, r, [20, 21, 22, 23])
    assert n == 3 * BS and run_step(b.worker, b.kv, meta) == set()
    assert same_pages(a, [1, 2, 3], b, [20, 21, 22])
    b.sched.request_finished(r, [])
    a.close()
    b.close()


def test_zero_copy_daemon_killed_between_reserve_and_commit(vd: Daemon, caplog: Any) -> None:
    """The daemon dies after a save job reserved its pages and before it copied the blocks
    into them: the copy still goes into the mapping (kept until the job is over: closing would
    unmap it under the copy), the commit fails and is logged, nothing raises; the finished
    request's blocks are handed back; the next step sees no hit and recomputes, its save
    dropped quietly."""
    a = Engine(vd, seed=16)
    toks = prompt(2)
    r = request(toks)
    _, meta = schedule(a.sched, r, [1, 2, 3])
    w = a.worker
    gate = threading.Event()
    w._pool.submit(gate.wait, 5)  # the I/O thread waits: the step's job queues behind it
    w.bind_connector_metadata(meta)
    w.start_load_kv(None)
    for name, t in a.kv.items():
        w.save_kv_layer(name, t, None)
    w.wait_for_save()
    w.clear_connector_metadata()
    (job,) = w._jobs[r.request_id]
    failures = w.kvtier_stats()["failures"]
    with caplog.at_level("WARNING", logger="kvtier.vllm"):
        with job.lock:  # the job stops before its copy, its reservation out
            gate.set()
            assert wait_until(lambda: w._store._holds == 1), "the job's reservation is out"
            vd.stop(signal.SIGKILL)
        assert wait_until(lambda: job.future.done())
        assert job.copied and w.saves_in_flight() == 0
    # Logged: the daemon unreachable (one line; the save's own warning is counted, held back
    # by the rate limit).
    assert any("kvtierd unreachable" in m for m in caplog.messages), caplog.messages
    assert w.kvtier_stats()["failures"] == failures + 1
    assert w._store._holds == 0 and w._store._client is None and w._store._doomed is None, \
        "closed once the views came back"
    assert finish(a, r, [1, 2, 3])
    r2 = request(toks)
    assert a.sched.get_num_new_matched_tokens(r2, 0) == (0, False)
    a.sched.update_state_after_alloc(r2, blocks([4, 5, 6]), 0)
    meta2 = a.sched.build_connector_meta(sched_output(new=[(r2, [4, 5, 6], len(toks))]))
    assert run_step(w, a.kv, meta2) == set()
    a.sched.request_finished(r2, [])
    a.close()


def test_zero_copy_connection_kept_while_views_are_out(vd: Daemon) -> None:
    """A transport failure while another reservation's views are still being written does not
    close the connection (closing unmaps them under the worker): the views stay writable, the
    connection is closed when the last one is given back."""
    a = Engine(vd, seed=17)
    st = a.worker._store
    root = kv.chain_root("tiny-test")
    k1 = kv.key_chain(request(prompt(2)), BS, root, [], 2)
    k2 = kv.key_chain(request(prompt(2)), BS, root, [], 2)
    r1, _ = st.reserve(k1, 0)
    r2, _ = st.reserve(k2, 0)
    assert st.mapped and st._holds == 2 and r1.nreserved == r2.nreserved == 2
    vd.stop(signal.SIGKILL)
    with pytest.raises(Exception):
        st.commit(r1)
    assert st._doomed is not None and st._holds == 1, "kept: r2's views are out"
    torch.frombuffer(r2.views[1], dtype=torch.uint8).fill_(7)  # still mapped
    with pytest.raises(Exception):
        st.abort(r2)
    assert st._doomed is None and st._holds == 0
    a.close()

# -- end to end: a small attention model whose KV goes through the connector ------------------


def generate(model: TinyModel, e: Optional["Engine"], toks: List[int], steps: int,
             pool: List[int]) -> Tuple[List[int], int, List[torch.Tensor]]:
    """Greedy decoding of `steps` tokens, as vLLM's scheduler and model runner would run it
    with the connector (e) or without (None: everything recomputed, fresh paged tensors).
    Returns the tokens, how many prompt tokens came from kvtierd, and each step's logits."""
    r = request(list(toks))
    kvc = e.kv if e is not None else paged(None)
    worker = e.worker if e is not None else None
    free = iter(pool)
    table: List[int] = []

    def need(ntok: int) -> List[int]:
        old = len(table)
        while len(table) * BS < ntok:
            table.append(next(free))
        return table[old:]

    need(len(toks))
    hit = 0
    meta = None
    if e is not None:
        hit, async_load = e.sched.get_num_new_matched_tokens(r, 0)
        e.sched.update_state_after_alloc(r, blocks(table), hit)
        if async_load:
            assert load_between_steps(e, r) == set()
        r.num_computed_tokens = hit
        meta = e.sched.build_connector_meta(sched_output(new=[(r, list(table), len(toks) - hit)]))
    logits = model.forward(list(toks[hit:]), hit, kvc, table, worker, meta)
    r.num_computed_tokens = len(toks)
    out: List[int] = []
    seen = []
    for i in range(steps):
        seen.append(logits)
        t = int(logits.argmax())
        out.append(t)
        r.append_output_token_ids(t)
        if i == steps - 1:
            break
        p = r.num_tokens - 1
        new_ids = need(p + 1)
        if e is not None:
            meta = e.sched.build_connector_meta(sched_output(cached=[(r, new_ids, 1)]))
        logits = model.forward([t], p, kvc, table, worker, meta)
        r.num_computed_tokens += 1
    if e is not None:
        finish(e, r, table)  # its saves stored (get_finished hands its blocks back)
    return out, hit, seen


@pytest.mark.parametrize("load_async", [False, True])
def test_end_to_end_tiny_model(vd: Daemon, load_async: bool) -> None:
    model = TinyModel(seed=7)
    toks = prompt(3, extra=10)  # 58 tokens
    pool_a = [20, 3, 17, 9, 25, 1]
    pool_b = [5, 30, 12, 2, 8, 19]
    # Recomputed everywhere: the reference.
    ref, _, ref_logits = generate(model, None, toks, 7, pool_a)
    # Engine A computes it all and saves the prompt's pages (and the page decoding completes).
    a = Engine(vd, seed=None)
    out_a, hit_a, _ = generate(model, a, toks, 7, pool_a)
    assert hit_a == 0 and out_a == ref
    # Engine B (other paged tensors, other blocks) loads 3 pages and computes the rest: the
    # same tokens, from the same logits (up to float summation order: B computes fewer rows).
    b = Engine(vd, seed=None, load_async=load_async)
    out_b, hit_b, logits_b = generate(model, b, toks, 7, pool_b)
    assert hit_b == 3 * BS and out_b == ref
    assert all(torch.allclose(x, y, rtol=0, atol=1e-4) for x, y in zip(logits_b, ref_logits))
    # The page that A's decoding completed (generated tokens included) is there too.
    longer = toks + ref  # 65 tokens: 4 whole pages
    ref2, _, ref2_logits = generate(model, None, longer, 4, pool_a)
    c = Engine(vd, seed=None, load_async=load_async)
    out_c, hit_c, logits_c = generate(model, c, longer, 4, pool_b)
    assert hit_c == 4 * BS and out_c == ref2
    assert all(torch.allclose(x, y, rtol=0, atol=1e-4) for x, y in zip(logits_c, ref2_logits))
    assert wait_until(lambda: leases(vd) == 0)
    for e in (a, b, c):
        e.close()


# -- never stall the engine: deadlines, the circuit breaker, settings refused ----------------


def stall_config(unix: str, **extra: Any) -> "VllmConfig":
    """The connector's own defaults for deadlines, probe and warnings (none set here), vLLM's
    kv_load_failure_policy as the README sets it."""
    return VllmConfig(
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvtierConnector", kv_connector_module_path="kvtier.vllm",
            kv_role="kv_both", kv_load_failure_policy="recompute",
            kv_connector_extra_config={"unix_path": unix, "model": "tiny-test", **extra}),
        device_config=DeviceConfig(device="cpu"), cache_config=CacheConfig(block_size=BS))


def wait_until(cond: Any, timeout: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def scheduler_step(sched: Any, toks: List[int], n: int = 4) -> Tuple[float, List[int]]:
    """One scheduler step with n new requests of the same prompt, the connector's calls in the
    order vLLM's Scheduler.schedule() makes them (get_num_new_matched_tokens, then
    update_state_after_alloc for each request admitted, then build_connector_meta once), and
    each request then finished (request_finished, as vLLM's _free_request calls it). Returns
    the step's wall time and each request's matched tokens."""
    rs = [request(toks) for _ in range(n)]
    t0 = time.perf_counter()
    hits, new = [], []
    for i, r in enumerate(rs):
        m, _ = sched.get_num_new_matched_tokens(r, 0)
        ids = list(range(1 + 4 * i, 5 + 4 * i))
        sched.update_state_after_alloc(r, blocks(ids), m)
        r.num_computed_tokens = m
        hits.append(m)
        new.append((r, ids, r.num_tokens - m))
    sched.build_connector_meta(sched_output(new=new))
    for r in rs:
        sched.request_finished(r, [])
    return time.perf_counter() - t0, hits


def test_scheduler_step_bounded_when_daemon_hangs(vd: Daemon, tmp_path: Any) -> None:
    """The stall test at the connector's level: vLLM's scheduler-side connector, built by
    KVConnectorFactory with its default deadline (scheduler_deadline_ms 20), its
    scheduler-role methods called in the order vLLM's Scheduler calls them (the same through
    vLLM's own Scheduler: test_real_scheduler_step_bounded_when_daemon_hangs, below).
    With the daemon SIGSTOPped, no step takes longer than the same step with no daemon at all,
    plus the deadline, plus 20 ms; the lookups are misses; once the daemon runs again, the
    background probe reconnects, hits come back and no lease is left."""
    a = Engine(vd, seed=21)
    toks = prompt(3)
    save_prompt(a, request(toks), [1, 2, 3, 4])
    # The same step with no daemon: the baseline.
    none = connector(stall_config(str(tmp_path / "none")), KVConnectorRole.SCHEDULER)
    base = max(scheduler_step(none, toks)[0] for _ in range(3))
    assert none.kvtier_stats()["trips"] == 1
    none.shutdown()
    s = connector(stall_config(vd.unix), KVConnectorRole.SCHEDULER)
    assert s._index.deadline_ms == kv.SCHEDULER_DEADLINE_MS == 20
    assert wait_until(lambda: scheduler_step(s, toks)[1][0] == 3 * BS)
    vd.freeze()
    try:
        for _ in range(5):
            took, hits = scheduler_step(s, toks)
            assert hits == [0, 0, 0, 0]
            assert took <= base + 0.020 + STALL_SLACK, (took, base)
        st = s.kvtier_stats()
        assert st["trips"] == 1 and st["short_circuited"] > 0
    finally:
        os.kill(vd.proc.pid, signal.SIGCONT)
    assert wait_until(lambda: scheduler_step(s, toks)[1] == [3 * BS] * 4)
    assert s.kvtier_stats()["recoveries"] == 1
    assert wait_until(lambda: leases(vd) == 0)
    s.shutdown()
    a.close()


# A tiny Llama's configuration: vLLM's ModelConfig reads it (and inspects the architecture,
# which imports vLLM's Llama code) without weights, a tokenizer or a network; enough for its
# Scheduler, which never runs the model.
TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": HEADS,
              "head_dim": HEAD, "num_hidden_layers": 3, "vocab_size": 1000,
              "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16"}


@pytest.fixture(scope="module")
def tiny_model_config(tmp_path_factory: Any) -> Any:
    """vLLM's own ModelConfig of TINY_LLAMA, or a skip naming what failed."""
    import json

    d = tmp_path_factory.mktemp("tiny-llama")
    (d / "config.json").write_text(json.dumps(TINY_LLAMA))
    try:
        from vllm.config import ModelConfig

        return ModelConfig(model=str(d), skip_tokenizer_init=True, dtype="bfloat16",
                           max_model_len=1024)
    except Exception as e:  # noqa: BLE001
        pytest.skip("vLLM's ModelConfig for a tiny local Llama config cannot be built here, so "
                    "neither can its Scheduler (%s: %s); vLLM inspects the architecture by "
                    "importing its model code, which needs einops (scripts/engines/vllm.sh "
                    "installs it)" % (type(e).__name__, str(e).splitlines()[0][:300]))


def real_scheduler(model_config: Any, unix: str, blocks_n: int = 4096) -> Any:
    """vLLM's own v1 Scheduler (vllm.v1.core.sched.scheduler.Scheduler) with a
    KVTransferConfig naming kvtier, as `vllm serve --kv-transfer-config` builds it: it makes
    the scheduler-side connector through KVConnectorFactory and calls it from schedule() and
    finish_requests(). The connector's own defaults (deadlines, probe, warnings); vLLM's
    prefix cache off, so that every request asks the connector."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    cfg = VllmConfig(
        model_config=model_config, device_config=DeviceConfig(device="cpu"),
        cache_config=CacheConfig(block_size=BS, enable_prefix_caching=False),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvtierConnector", kv_connector_module_path="kvtier.vllm",
            kv_role="kv_both",
            kv_connector_extra_config={"unix_path": unix, "model": "tiny-test"}))
    # Without a worker to report them, requests whose saves vLLM holds keep their blocks: the
    # stall test needs thousands.
    cfg.cache_config.num_gpu_blocks = blocks_n
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD, dtype=DTYPE)
    kcc = KVCacheConfig(num_blocks=blocks_n, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(["l0", "l1", "l2"], spec)])
    s = Scheduler(vllm_config=cfg, kv_cache_config=kcc,
                  structured_output_manager=StructuredOutputManager(cfg), block_size=BS)
    assert isinstance(s.connector, kv.KvtierConnector)
    return s


def real_step(s: Any, toks: List[int], n: int = 4) -> Tuple[float, List[int]]:
    """One step of vLLM's Scheduler: n new requests of the same prompt added, schedule()
    (the connector's lookups, allocations, the step's metadata), then the requests finished
    (finish_requests: the connector's request_finished). Returns the step's wall time and
    each request's tokens loaded from kvtierd (its prompt less what it scheduled)."""
    from vllm.v1.request import RequestStatus

    rs = [request(toks) for _ in range(n)]
    for r in rs:
        s.add_request(r)
    t0 = time.perf_counter()
    out = s.schedule()
    s.finish_requests([r.request_id for r in rs], RequestStatus.FINISHED_ABORTED)
    took = time.perf_counter() - t0
    return took, [len(toks) - out.num_scheduled_tokens[r.request_id] for r in rs]


def test_real_scheduler_step_bounded_when_daemon_hangs(vd: Daemon, tmp_path: Any,
                                                       tiny_model_config: Any) -> None:
    """The stall test of issue 35 through vLLM's real Scheduler: with the daemon SIGSTOPped,
    no schedule() step (4 new requests looked up, allocated, planned, then finished) takes
    longer than the same step of a Scheduler whose connector has no daemon at all, plus the
    scheduler deadline (20 ms), plus 20 ms. The lookups are misses meanwhile; after SIGCONT
    the background probe reconnects, the hits come back and no lease is left."""
    a = Engine(vd, seed=26)
    toks = prompt(3)
    save_prompt(a, request(toks), [1, 2, 3, 4])
    none = real_scheduler(tiny_model_config, str(tmp_path / "none.sock"))
    for _ in range(2):  # warm: vLLM's first steps pay for imports and caches
        real_step(none, toks)
    base = max(real_step(none, toks)[0] for _ in range(3))
    assert none.connector.kvtier_stats()["trips"] == 1
    none.shutdown()
    s = real_scheduler(tiny_model_config, vd.unix)
    assert s.connector._index.deadline_ms == kv.SCHEDULER_DEADLINE_MS == 20
    assert wait_until(lambda: real_step(s, toks)[1] == [3 * BS] * 4)
    vd.freeze()
    try:
        for i in range(5):
            took, hits = real_step(s, toks)
            assert hits == [0, 0, 0, 0], i
            assert took <= base + 0.020 + STALL_SLACK, (i, took, base)
        st = s.connector.kvtier_stats()
        assert st["trips"] == 1 and st["short_circuited"] > 0
    finally:
        os.kill(vd.proc.pid, signal.SIGCONT)
    assert wait_until(lambda: real_step(s, toks)[1] == [3 * BS] * 4)
    assert s.connector.kvtier_stats()["recoveries"] == 1
    assert wait_until(lambda: leases(vd) == 0)
    s.shutdown()
    a.close()


def test_real_scheduler_holds_blocks_until_saved(vd: Daemon, tiny_model_config: Any) -> None:
    """Asynchronous saves as vLLM's own Scheduler sees them, stepped as its engine steps it
    (schedule(), the worker's forward with the step's metadata, get_finished with the step's
    finished_req_ids, update_from_output with the worker's KVConnectorOutput): a request whose
    save is still out when it is aborted keeps its blocks (vLLM's delayed free, its request
    kept), step after step, until the worker reports it in finished_sending once its pages
    are stored; then vLLM frees them, and another engine loads the pages byte for byte."""
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.request import RequestStatus

    s = real_scheduler(tiny_model_config, vd.unix, blocks_n=NBLOCKS)
    worker = connector(config(vd), KVConnectorRole.WORKER)
    kvc = paged(61)
    worker.register_kv_caches(kvc)
    pool = s.kv_cache_manager.block_pool
    free0 = pool.get_num_free_blocks()
    gate = threading.Event()
    worker._pool.submit(gate.wait, 5)  # the I/O thread busy: the save stays out

    def step(abort: Optional[str] = None) -> Any:
        out = s.schedule()
        worker.bind_connector_metadata(out.kv_connector_metadata)
        worker.start_load_kv(None)
        for name, t in kvc.items():
            worker.wait_for_layer_load(name)
            worker.save_kv_layer(name, t, None)
        worker.wait_for_save()
        if abort is not None:  # aborted while the model runs its step (vLLM skips its output)
            s.finish_requests([abort], RequestStatus.FINISHED_ABORTED)
        sending, recving = worker.get_finished(out.finished_req_ids)
        worker.clear_connector_metadata()
        s.update_from_output(out, ModelRunnerOutput(
            req_ids=[], kv_connector_output=KVConnectorOutput(finished_sending=sending,
                                                              finished_recving=recving)))
        return out

    toks = prompt(3)
    r = request(toks)
    s.add_request(r)
    out = step(abort=r.request_id)
    assert out.num_scheduled_tokens[r.request_id] == len(toks)
    (ids,) = s.kv_cache_manager.get_block_ids(r.request_id)
    ids = list(ids)
    assert [t.block_ids for t in out.kv_connector_metadata.saves] == [ids[:3]]
    assert r.request_id in s.requests and pool.get_num_free_blocks() == free0 - len(ids)
    for _ in range(3):  # held: the save is out
        step()
        assert r.request_id in s.requests
        assert pool.get_num_free_blocks() == free0 - len(ids)
    gate.set()
    deadline = time.monotonic() + 5
    while r.request_id in s.requests:
        assert time.monotonic() < deadline, "vLLM never freed the blocks"
        step()
        time.sleep(0.002)
    assert pool.get_num_free_blocks() == free0
    b = Engine(vd, seed=None)
    r2 = request(toks)
    n, meta = schedule(b.sched, r2, [20, 21, 22, 23])
    assert n == 3 * BS and run_step(b.worker, b.kv, meta) == set()
    for x, y in zip(pages_of(kvc, ids[:3]), pages_of(b.kv, [20, 21, 22])):
        assert torch.equal(x.view(torch.int16), y.view(torch.int16))
    b.sched.request_finished(r2, [])
    assert wait_until(lambda: leases(vd) == 0)
    b.close()
    worker.shutdown()
    s.shutdown()


def resv_open(d: Daemon) -> int:
    st = zc_stats(d)
    return (st["requests_reserve"] - st["request_errors_reserve"] - st["reservations_committed"]
            - st["reservations_aborted"] - st["reservations_expired"]
            - st["reservations_closed"])


@pytest.mark.parametrize("zero_copy", [True, False])
def test_worker_step_bounded_when_daemon_hangs(vd: Daemon, tmp_path: Any,
                                               zero_copy: bool) -> None:
    """A forward step that loads one request and saves another, the daemon SIGSTOPped before
    it: the step takes no longer than the same step with no daemon plus worker_deadline_ms
    (100) plus 20 ms; the load is reported as load errors (recomputed, never served partly),
    the save dropped (counted); the next steps answer at once (circuit breaker); once the
    daemon runs again, no lease or reservation is left and loads hit again."""
    a = Engine(vd, seed=22)
    toks = prompt(3)
    save_prompt(a, request(toks), [1, 2, 3, 4])
    cfg = stall_config(vd.unix, zero_copy=zero_copy)
    b_sched = connector(config(vd), KVConnectorRole.SCHEDULER)  # plans with a long deadline
    worker = connector(cfg, KVConnectorRole.WORKER)
    kvc = paged(None)
    worker.register_kv_caches(kvc)
    assert worker._worker_deadline_ms == kv.WORKER_DEADLINE_MS == 100

    def plan() -> Any:
        r, r2 = request(toks), request(prompt(2))
        n, _ = b_sched.get_num_new_matched_tokens(r, 0)
        assert n == 3 * BS
        b_sched.update_state_after_alloc(r, blocks([5, 6, 7, 8]), n)
        r.num_computed_tokens = n
        assert b_sched.get_num_new_matched_tokens(r2, 0) == (0, False)
        b_sched.update_state_after_alloc(r2, blocks([9, 10, 11]), 0)
        meta = b_sched.build_connector_meta(sched_output(new=[(r, [5, 6, 7, 8], 5),
                                                              (r2, [9, 10, 11], r2.num_tokens)]))
        assert len(meta.loads) == 1 and len(meta.saves) == 1
        return r, r2, meta

    def step(w: Any, meta: Any) -> Tuple[float, set]:
        t0 = time.perf_counter()
        err = run_step(w, kvc, meta)
        return time.perf_counter() - t0, err

    # The baseline: the same step on a worker with no daemon.
    none = connector(stall_config(str(tmp_path / "none"), zero_copy=zero_copy),
                     KVConnectorRole.WORKER)
    none.register_kv_caches(paged(None))
    r, r2, meta = plan()
    base = 0.0
    for _ in range(3):
        took, err = step(none, meta)
        assert err == {5, 6, 7}
        base = max(base, took)
    none.shutdown()

    def hits() -> bool:  # a whole step, the load served (the first one connects)
        r, r2, meta = plan()
        ok = step(worker, meta)[1] == set()
        for x in (r, r2):
            b_sched.request_finished(x, [])
        return ok

    for x in (r, r2):
        b_sched.request_finished(x, [])
    assert wait_until(hits)
    r, r2, meta = plan()
    vd.freeze()
    try:
        for i in range(3):
            took, err = step(worker, meta)
            assert err == {5, 6, 7}, i
            assert took <= base + 0.100 + STALL_SLACK, (i, took, base)
        st = worker.kvtier_stats()
        assert st["trips"] == 1 and st["saves_dropped"] >= 1 and st["short_circuited"] >= 1
    finally:
        os.kill(vd.proc.pid, signal.SIGCONT)
    for x in (r, r2):
        b_sched.request_finished(x, [])
    assert wait_until(lambda: leases(vd) == 0 and resv_open(vd) == 0)
    # Back: the probe reconnected in the background, the next load hits.
    assert wait_until(lambda: worker.kvtier_stats()["recoveries"] == 1)
    assert wait_until(hits)
    worker.shutdown()
    b_sched.shutdown()
    a.close()


def test_daemon_not_up_at_start(tmp_path: Any, caplog: Any) -> None:
    """Both roles started before kvtierd: misses, one warning line per connector however many
    calls (the rest counted), and hits once the daemon is up (the background probe connects;
    the engine's thread never waits on it)."""
    sock = str(tmp_path / "later.sock")
    cfg = stall_config(sock, probe_ms=20)
    sched = connector(cfg, KVConnectorRole.SCHEDULER)
    worker = connector(cfg, KVConnectorRole.WORKER)
    kvc = paged(23)
    worker.register_kv_caches(kvc)
    toks = prompt(2)
    with caplog.at_level("WARNING", logger="kvtier.vllm"):
        for _ in range(20):
            r = request(toks)
            assert sched.get_num_new_matched_tokens(r, 0) == (0, False)
            sched.request_finished(r, [])
        r = request(toks)
        n, meta = schedule(sched, r, [1, 2, 3])
        assert n == 0 and len(meta.saves) == 1
        assert run_step(worker, kvc, meta) == set()  # the save dropped, nothing raised
        sched.request_finished(r, [])
    lines = [m for m in caplog.records if m.name == "kvtier.vllm"]
    assert len(lines) == 2, [m.getMessage() for m in lines]  # one per connector
    st = sched.kvtier_stats()
    assert st["warnings_logged"] == 1 and st["warnings"] >= 20 and st["trips"] == 1
    assert worker.kvtier_stats()["saves_dropped"] == 1
    d = Daemon("--unix", sock)
    try:
        assert wait_until(lambda: sched.kvtier_stats()["recoveries"] == 1 and
                          worker.kvtier_stats()["recoveries"] == 1)
        r = request(toks)
        n, meta = schedule(sched, r, [1, 2, 3])
        assert n == 0 and run_step(worker, kvc, meta) == set()
        sched.request_finished(r, [])
        assert sched.get_num_new_matched_tokens(request(toks), 0) == (2 * BS, False)
        worker.shutdown()
        sched.shutdown()
    finally:
        d.stop(signal.SIGKILL)


@pytest.mark.parametrize("bad, names", [
    ({"unix_pth": "/x"}, "'unix_pth'"),
    ({"timeout_ms": 5000}, "scheduler_deadline_ms"),
    ({"retry_ms": 0}, "probe_ms"),
    ({"scheduler_deadline_ms": "fast"}, "'scheduler_deadline_ms'"),
    ({"worker_deadline_ms": 0}, "'worker_deadline_ms'"),
    ({"block_size": 2 * BS}, "'block_size'"),
    ({"preempt_pause_ms": "soon"}, "'preempt_pause_ms'"),
    ({"preempt_pause_ms": -1}, "'preempt_pause_ms'"),
    ({"zero_copy": "maybe"}, "'zero_copy'"),
    ({"load_async": 2}, "'load_async'"),
])
def test_wrong_settings_refused_at_start(tmp_path: Any, bad: Dict[str, Any], names: str) -> None:
    """A key the connector does not know (a typo, or one it replaced), a malformed deadline,
    or a block size other than the engine's: KVConnectorFactory fails with the key named,
    for either role, instead of a connector that answers misses."""
    cfg = stall_config(str(tmp_path / "none"), **bad)
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ValueError, match=names):
            connector(cfg, role)


@pytest.mark.parametrize("zero_copy", [True, False])
def test_daemon_stopped_mid_save(vd: Daemon, zero_copy: bool) -> None:
    """Asynchronous saves (issue 35): with the daemon SIGSTOPped, a step that saves a request
    (all its layers, then wait_for_save) waits for nothing: no longer than the same step with
    no daemon plus 20 ms. The request finishes: vLLM holds its blocks (request_finished
    returns True), and get_finished hands them back once the save misses its deadline
    (worker_deadline_ms after its step), dropped and counted. After SIGCONT no reservation or
    lease is left, the breaker recovers, and pages saved by a later step are hits."""
    e = Engine(vd, seed=24, worker_deadline_ms=kv.WORKER_DEADLINE_MS, zero_copy=zero_copy)
    save_prompt(e, request(prompt(1)), [7, 8])  # both roles connected
    assert e.worker._store.mapped is zero_copy
    toks = prompt(2)

    def step(w: Any, kvc: Dict[str, torch.Tensor]) -> Tuple[Any, float]:
        r = request(toks)
        _, meta = schedule(e.sched, r, [1, 2, 3])
        assert len(meta.saves) == 1
        t0 = time.perf_counter()
        assert run_step(w, kvc, meta, settle=False) == set()
        return r, time.perf_counter() - t0

    none = connector(stall_config("/nonexistent/kvtier.sock", zero_copy=zero_copy),
                     KVConnectorRole.WORKER)
    none.register_kv_caches(paged(None))
    base = max(step(none, none._kv)[1] for _ in range(3))
    none.shutdown()
    w = e.worker
    vd.freeze()
    try:
        r, took = step(w, e.kv)
        assert took <= base + STALL_SLACK, (took, base)
        assert w.saves_in_flight() == 1
        held, _ = e.sched.request_finished(r, [1, 2, 3])
        assert held
        t0 = time.perf_counter()
        finished = {r.request_id}
        while True:
            sending, _ = w.get_finished(finished)
            finished = set()
            if sending:
                break
            assert time.perf_counter() - t0 < 0.100 + STALL_SLACK, "blocks held too long"
            time.sleep(0.002)
        assert sending == {r.request_id}
        assert w.kvtier_stats()["saves_dropped"] == 1
    finally:
        os.kill(vd.proc.pid, signal.SIGCONT)
    assert wait_until(lambda: resv_open(vd) == 0 and leases(vd) == 0)
    # The worker's job, its deadline passed, either failed (the breaker tripped, and recovers)
    # or ended well after SIGCONT; the scheduler's finished hint timed out (20 ms).
    for c in (w, e.sched):
        assert wait_until(lambda: c.kvtier_stats()["trips"] == c.kvtier_stats()["recoveries"])
    toks = prompt(2)
    save_prompt(e, request(toks), [4, 5, 6])
    assert e.sched.get_num_new_matched_tokens(request(toks), 0) == (2 * BS, False)
    e.close()


# What a step that waited on a dead daemon would take: the package client's own timeout (10 s,
# kvtier.Client's timeout_ms), or 5 s as vLLM's scheduler did before issue 35. A bound well
# below that, and 10 times the worker's 100 ms deadline, tells such a wait from a slow machine:
# the step measured 5-113 ms in 10 runs beside two busy processes at load average 4-14.
HANG_BOUND_S = 1.0


def test_daemon_restarted_mid_load(tmp_path: Any) -> None:
    """The daemon killed between the lookup and the load, a new one started on the same
    socket: the step does not wait on the dead daemon (its load ends once, by its error or at
    the step's deadline, and is reported as load errors, not retried on the new daemon); the
    connectors reach the new daemon in the background, and pages saved there are hits."""
    sock = str(tmp_path / "k.sock")
    d = Daemon("--unix", sock)
    try:
        b = Engine(d, seed=25, worker_deadline_ms=100, probe_ms=20)
        toks = prompt(2)
        save_prompt(b, request(toks), [1, 2, 3])  # both roles connected to the first daemon
        r = request(toks)
        n, meta = schedule(b.sched, r, [4, 5, 6])
        assert n == 2 * BS
        d.stop(signal.SIGKILL)
        d = Daemon("--unix", sock)
        t0 = time.perf_counter()
        errors = forward(b.worker, b.kv, meta)  # the step; settle_saves is the test's own wait
        took = time.perf_counter() - t0
        assert errors == {4, 5}
        assert took < HANG_BOUND_S, took
        settle_saves(b.worker, 3.0)
        b.sched.request_finished(r, [])
        st = b.worker.kvtier_stats()
        # The breaker opened on the dead connection; the load ended once: by its error, or by
        # the step's deadline when the I/O thread came too late on a loaded machine.
        assert st["trips"] == 1
        assert st["failures"] + st["deadline_misses"] == 1, st
        assert wait_until(lambda: b.worker.kvtier_stats()["recoveries"] == 1, 10.0)
        save_prompt(b, request(toks), [7, 8, 9])
        assert wait_until(lambda: b.sched.get_num_new_matched_tokens(request(toks), 0) ==
                          (2 * BS, False), 10.0)
        assert leases(d) <= 1  # the last lookup's lease (released below)
        b.close()
        assert wait_until(lambda: leases(d) == 0)
    finally:
        d.stop(signal.SIGKILL)


def test_metrics_through_vllms_own_aggregation(vd: Daemon, caplog: Any) -> None:
    """The connector's figures reach vLLM's own metrics: each worker's get_kv_connector_stats
    summed by vLLM's KVOutputAggregator (two workers), the scheduler's added as vLLM's
    Scheduler.update_from_output adds it, to_dict() through vLLM's msgpack serialisation of
    SchedulerStats, then vLLM's KVConnectorLogging (its log line) and KVConnectorProm (the
    Prometheus counters) through the connector class's build_kv_connector_stats and
    build_prom_metrics. Hits, misses, bytes, load and save time, failures."""
    from prometheus_client import REGISTRY
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorLogging,
        KVConnectorProm,
    )
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    a, b = Engine(vd, seed=31), Engine(vd, seed=None)
    page = a.worker._layout.page_bytes
    toks = prompt(3)
    r = request(toks)
    save_prompt(a, r, [4, 9, 2, 7])  # a lookup with 3 pages missed, then 3 pages saved
    r2 = request(toks)
    n, meta = schedule(b.sched, r2, [11, 3, 30, 5])  # 3 pages hit
    assert n == 3 * BS
    assert run_step(b.worker, b.kv, meta) == set()  # 3 pages loaded
    b.sched.request_finished(r2, [])
    # A lookup with the daemon gone: its pages missed, the failure counted.
    vd.stop(signal.SIGKILL)
    r3 = request(prompt(2))
    assert b.sched.get_num_new_matched_tokens(r3, 0) == (0, False)
    b.sched.request_finished(r3, [])

    def step_output(w: Any) -> "ModelRunnerOutput":
        return ModelRunnerOutput(req_ids=[], kv_connector_output=(
            KVConnectorOutput(kv_connector_stats=w.get_kv_connector_stats())))

    out = KVOutputAggregator(2).aggregate([step_output(a.worker), step_output(b.worker)])
    stats = out.kv_connector_output.kv_connector_stats
    for s in (a.sched, b.sched):  # vLLM's scheduler adds its own connector's figures
        s_stats = s.get_kv_connector_stats()
        assert s_stats is not None and not s_stats.is_empty()
        stats = stats.aggregate(s_stats)
    sent = SchedulerStats(kv_connector_stats=stats.to_dict())
    got = MsgpackDecoder(SchedulerStats).decode(MsgpackEncoder().encode(sent)).kv_connector_stats
    assert got["lookups"] == 3
    assert got["hit_pages"] == 3 and got["miss_pages"] == 3 + 2  # r's 3 pages, then r3's 2
    assert got["save_pages"] == 3 and got["save_bytes"] == 3 * page
    assert got["load_pages"] == 3 and got["load_bytes"] == 3 * page
    assert got["load_seconds"] > 0 and got["save_seconds"] > 0
    assert got.get("load_errors", 0) == 0
    assert got["failures"] >= 1 and got["trips"] >= 1
    # An interval's figures are reported once: the next call has nothing new.
    assert a.worker.get_kv_connector_stats() is None
    assert a.sched.get_kv_connector_stats() is None

    cfg = config(vd)
    logging_ = KVConnectorLogging(cfg.kv_transfer_config)
    logging_.observe(got)
    lines: List[str] = []
    logging_.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    assert len(lines) == 1 and "hit_pages=3" in lines[0] and "hit_rate=0.375" in lines[0], lines
    assert "load_bytes=%d" % (3 * page) in lines[0] and "load_GBps=" in lines[0]
    prom = KVConnectorProm(cfg, ["model_name", "engine"], {0: ["tiny-test", "0"]})
    prom.observe(got, 0)
    labels = {"model_name": "tiny-test", "engine": "0"}
    for name, want in (("hit_pages", 3), ("miss_pages", 5), ("save_bytes", 3 * page),
                       ("load_pages", 3), ("lookups", 3)):
        assert REGISTRY.get_sample_value("vllm:kvtier_%s_total" % name, labels) == want, name
    assert REGISTRY.get_sample_value("vllm:kvtier_load_seconds_total", labels) > 0
    assert REGISTRY.get_sample_value("vllm:kvtier_failures_total", labels) >= 1
    a.close()
    b.close()


def test_preemption_keeps_in_flight_output() -> None:
    """vLLM's scheduler reads connector.requires_kv_delivery once, and with True drops (and
    samples again) the in-flight output of every request it preempts. vLLM's base answers True
    for a KV producer, which kv_role kv_both (the README's) is; this connector, a best-effort
    cache that holds no blocks past a step, answers False in both roles."""
    d = Daemon()
    try:
        cfg = config(d)
        assert cfg.kv_transfer_config.is_kv_producer  # what vLLM's base would answer True for
        for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
            c = connector(cfg, role)
            assert c.requires_kv_delivery is False
            c.shutdown()
    finally:
        d.stop(signal.SIGKILL)


@pytest.mark.parametrize("same_step", [True, False])
def test_preempted_request_saved_and_loaded_after_resume(vd: Daemon, same_step: bool) -> None:
    """Preemption as vLLM 0.34's scheduler signals it: the request's blocks freed and its
    computed tokens reset, its id in the next SchedulerOutput's preempted_req_ids, then, when
    resumed, asked get_num_new_matched_tokens afresh and sent in full among the new requests
    with its new blocks: in a later step, or in the same output (reset_prefix_cache preempts
    every running request between steps, and the next step resumes them). The pages saved
    before the preemption are loaded into the new blocks, the rest is saved from them, and
    the request goes on being saved while it decodes; another engine then loads every page."""
    a, b = Engine(vd, seed=41), Engine(vd, seed=None)
    toks = prompt(3, extra=10)  # 3 whole pages and 10 tokens
    r = request(toks)
    assert a.sched.get_num_new_matched_tokens(r, 0) == (0, False)
    a.sched.update_state_after_alloc(r, blocks([1, 2, 3, 4]), 0)
    # A chunked prefill: the first 2 pages this step.
    meta = a.sched.build_connector_meta(sched_output(new=[(r, [1, 2, 3, 4], 2 * BS)]))
    assert [(t.first, t.block_ids) for t in meta.saves] == [(0, [1, 2])]
    assert run_step(a.worker, a.kv, meta) == set()
    r.num_computed_tokens = 2 * BS
    # Preempted: its blocks freed, its computed tokens reset (vLLM's _preempt_request).
    r.num_computed_tokens = 0
    if not same_step:
        so = sched_output()
        so.preempted_req_ids = {r.request_id}
        meta = a.sched.build_connector_meta(so)
        assert meta.saves == [] and meta.loads == []
        assert run_step(a.worker, a.kv, meta) == set()
    # Resumed into other blocks: the 2 pages saved come back from kvtierd.
    n, async_load = a.sched.get_num_new_matched_tokens(r, 0)
    assert (n, async_load) == (2 * BS, False)
    a.sched.update_state_after_alloc(r, blocks([5, 6, 7, 8]), n)
    r.num_computed_tokens = n
    so = sched_output(new=[(r, [5, 6, 7, 8], r.num_tokens - n)])
    if same_step:
        so.preempted_req_ids = {r.request_id}
    meta = a.sched.build_connector_meta(so)
    assert [(t.first, t.block_ids) for t in meta.loads] == [(0, [5, 6])]
    assert [(t.first, t.block_ids) for t in meta.saves] == [(2, [7])]
    assert run_step(a.worker, a.kv, meta) == set()
    for x, y in zip(pages_of(a.kv, [1, 2]), pages_of(a.kv, [5, 6])):
        assert torch.equal(x.view(torch.int16), y.view(torch.int16))
    # Decoding on: the tokens that fill its 4th page, and that page is saved too.
    r.num_computed_tokens = r.num_tokens
    for _ in range(BS - 10):
        r.append_output_token_ids(7)
    meta = a.sched.build_connector_meta(sched_output(cached=[(r, [], BS - 10)]))
    assert [(t.first, t.block_ids) for t in meta.saves] == [(3, [8])]
    assert run_step(a.worker, a.kv, meta) == set()
    a.sched.request_finished(r, [5, 6, 7, 8])
    # Another engine finds all 4 pages (and their bytes: pages 0-1 from before the preemption).
    r2 = request(list(r.all_token_ids) + [1])
    n, meta = schedule(b.sched, r2, [20, 21, 22, 23, 24])
    assert n == 4 * BS
    assert run_step(b.worker, b.kv, meta) == set()
    for x, y in zip(pages_of(a.kv, [1, 2, 7, 8]), pages_of(b.kv, [20, 21, 22, 23])):
        assert torch.equal(x.view(torch.int16), y.view(torch.int16))
    b.sched.request_finished(r2, [])
    assert wait_until(lambda: leases(vd) == 0)
    a.close()
    b.close()


def test_mla_tensor_parallel_stores_the_latent_once(vd: Daemon) -> None:
    """MLA with tensor parallelism 2: the latent KV (one (num_blocks, block_size, latent)
    tensor per layer, identical on every rank) is stored once, by TP rank 0, in one namespace
    shared by the ranks (vLLM's own kv_tp_replicas, computed by vLLM from its MLAAttentionSpec
    with max_tp_shards 1), and every rank loads it; an MLA deployment at TP 1 reads the same
    pages."""
    from vllm.v1.core.kv_cache_planning import kv_cache_groups_tp_replicas
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec, MLAAttentionSpec

    latent = 64
    names = ["model.layers.%d.self_attn.attn" % i for i in range(3)]

    def mla_connector(tp: int, role: "KVConnectorRole", **extra: Any) -> Any:
        spec = MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=latent, dtype=DTYPE,
                                max_tp_shards=1)
        kvc = KVCacheConfig(num_blocks=NBLOCKS, kv_cache_tensors=[],
                            kv_cache_groups=[KVCacheGroupSpec(names, spec)])
        kvc.kv_tp_replicas = kv_cache_groups_tp_replicas(kvc.kv_cache_groups, tp)
        assert kvc.kv_tp_replicas == tp  # vLLM's own figure: every rank holds the latent
        return KVConnectorFactory.create_connector(config(vd, tp=tp, **extra), role, kvc)

    def latents(seed: Optional[int]) -> Dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed or 0)
        return {n: (torch.randn((NBLOCKS, BS, latent), generator=g) if seed is not None
                    else torch.zeros((NBLOCKS, BS, latent))).to(DTYPE) for n in names}

    def ranks(seed: Optional[int]) -> Tuple[Any, List[Any], List[Dict[str, torch.Tensor]]]:
        sched = mla_connector(2, KVConnectorRole.SCHEDULER)
        workers, kvs = [], []
        for rank in range(2):
            w = mla_connector(2, KVConnectorRole.WORKER, tp_rank=rank)
            kvs.append(latents(seed))  # the same latent on every rank
            w.register_kv_caches(kvs[-1])
            workers.append(w)
        return sched, workers, kvs

    sched, workers, kvs = ranks(seed=50)
    toks = prompt(2)
    r = request(toks)
    n, meta = schedule(sched, r, [1, 2, 3])
    assert n == 0 and [t.block_ids for t in meta.saves] == [[1, 2]]
    for w, k in zip(workers, kvs):
        assert run_step(w, k, meta) == set()
    sched.request_finished(r, [1, 2, 3])
    saved = [w.get_kv_connector_stats() for w in workers]
    assert saved[0].data["save_pages"] == 2
    assert saved[1] is None or not saved[1].data.get("save_pages")  # rank 1 skipped its save
    # Stored once: the chain is in the shared namespace (tp0/1), none in a rank's own.
    keys = kv.key_chain(r, BS, kv.chain_root("tiny-test"), [], 2)
    page = workers[0]._layout.page_bytes
    assert page == len(names) * BS * latent * 2
    for salt, want in ((kv.rank_salt(0, 1, 0, 1), 2), (kv.rank_salt(0, 2, 0, 1), 0),
                       (kv.rank_salt(1, 2, 0, 1), 0)):
        with vd.client(model="tiny-test", salt=salt, block_bytes=page) as c:
            assert c.exists_keys(keys) == want, salt
    # Fresh ranks with zeroed latents: both load the pages rank 0 stored.
    sched2, workers2, kvs2 = ranks(seed=None)
    r = request(toks)
    n, meta = schedule(sched2, r, [7, 8, 9])
    assert n == 2 * BS and meta.saves == []
    for w, k in zip(workers2, kvs2):
        assert run_step(w, k, meta) == set()
    for rank in range(2):
        for name in names:
            assert torch.equal(kvs[0][name][[1, 2]].view(torch.int16),
                               kvs2[rank][name][[7, 8]].view(torch.int16))
    sched2.request_finished(r, [])
    # An MLA deployment at TP 1 finds the same pages.
    s1 = mla_connector(1, KVConnectorRole.SCHEDULER)
    r = request(toks)
    assert s1.get_num_new_matched_tokens(r, 0) == (2 * BS, False)
    s1.request_finished(r, [])
    assert wait_until(lambda: leases(vd) == 0)
    for c in (sched, sched2, s1, *workers, *workers2):
        c.shutdown()


# -- asynchronous saves: the forward never waits; blocks held until stored --------------------


def test_finished_request_held_until_stored(vd: Daemon) -> None:
    """Asynchronous saves (issue 35): the step's saves go to the I/O thread after its last
    layer and wait_for_save returns without them. A finished request whose save was planned
    is held by vLLM (request_finished returns True: vLLM delays freeing its blocks, which the
    save still reads) and get_finished hands it back only once its pages are stored: another
    engine finds them then, byte for byte. A request with nothing to save is freed at once."""
    a, b = Engine(vd, seed=51), Engine(vd, seed=None)
    toks = prompt(3)
    r = request(toks)
    gate = threading.Event()
    a.worker._pool.submit(gate.wait, 5)  # the I/O thread busy: the step's save stays out
    n, meta = schedule(a.sched, r, [1, 2, 3, 4])
    assert n == 0 and len(meta.saves) == 1
    assert run_step(a.worker, a.kv, meta, settle=False) == set()
    assert a.worker.saves_in_flight() == 1
    assert a.sched.request_finished(r, [1, 2, 3, 4]) == (True, None)
    for _ in range(3):  # later steps: still held, not stored
        assert a.worker.get_finished({r.request_id}) == (None, None)
    probe = request(toks)
    assert b.sched.get_num_new_matched_tokens(probe, 0) == (0, False)
    b.sched.request_finished(probe, [])
    gate.set()
    t0 = time.monotonic()
    while True:
        sending, _ = a.worker.get_finished(set())
        if sending:
            break
        assert time.monotonic() - t0 < 5, "never handed back"
        time.sleep(0.002)
    assert sending == {r.request_id}
    r2 = request(toks)  # stored by then: found and loaded whole
    n, meta = schedule(b.sched, r2, [20, 21, 22, 23])
    assert n == 3 * BS and meta.saves == []
    assert run_step(b.worker, b.kv, meta) == set()
    assert same_pages(a, [1, 2, 3], b, [20, 21, 22])
    assert b.sched.request_finished(r2, [20, 21, 22, 23]) == (False, None)  # nothing saved
    assert b.worker.get_finished({r2.request_id}) == (None, None)
    assert wait_until(lambda: leases(vd) == 0)
    a.close()
    b.close()


def test_wait_saves_blocks_until_stored(vd: Daemon) -> None:
    """wait_saves (bench_vllm's wait for a save, issue 35) returns once the request's save job
    is done, woken by the job's end rather than a poll: with the I/O thread held it times out
    (False), another request's wait returns at once, and once the thread is let go it returns
    True no earlier than that; get_finished then hands the request back on its first call and
    another engine finds the pages."""
    a, b = Engine(vd, seed=53), Engine(vd, seed=None)
    toks = prompt(3)
    r = request(toks)
    gate = threading.Event()
    a.worker._pool.submit(gate.wait, 5)  # the I/O thread busy: the step's save stays out
    n, meta = schedule(a.sched, r, [1, 2, 3, 4])
    assert n == 0 and len(meta.saves) == 1
    assert run_step(a.worker, a.kv, meta, settle=False) == set()
    assert a.sched.request_finished(r, [1, 2, 3, 4]) == (True, None)
    t0 = time.monotonic()
    assert a.worker.wait_saves({r.request_id}, 0.05) is False
    assert time.monotonic() - t0 >= 0.05
    assert a.worker.wait_saves({"another-request"}, 5) is True
    assert a.worker.saves_in_flight() == 1
    let_go = threading.Timer(0.2, gate.set)
    t0 = time.monotonic()
    let_go.start()
    assert a.worker.wait_saves({r.request_id}, 5) is True
    assert 0.2 <= time.monotonic() - t0 < 4
    assert a.worker.saves_in_flight() == 0
    assert a.worker.get_finished({r.request_id}) == ({r.request_id}, None)
    assert a.worker.wait_saves(None, 0) is True  # nothing out: at once
    r2 = request(toks)
    n, meta = schedule(b.sched, r2, [20, 21, 22, 23])
    assert n == 3 * BS
    assert run_step(b.worker, b.kv, meta) == set()
    assert same_pages(a, [1, 2, 3], b, [20, 21, 22])
    b.sched.request_finished(r2, [20, 21, 22, 23])
    assert wait_until(lambda: leases(vd) == 0)
    a.close()
    b.close()


def test_preempted_request_saves_cancelled(vd: Daemon) -> None:
    """vLLM frees a preempted request's blocks at once (no connector call) and lists it in the
    next step, whose forward may write them for another request: that step's start_load_kv,
    before any layer, cancels the request's saves that have not read the blocks yet (counted
    as dropped). Their pages are not stored with another request's bytes: not at all."""
    a = Engine(vd, seed=52)
    toks = prompt(2)
    r = request(toks)
    gate = threading.Event()
    a.worker._pool.submit(gate.wait, 5)
    _, meta = schedule(a.sched, r, [1, 2, 3])
    assert run_step(a.worker, a.kv, meta, settle=False) == set()
    (job,) = a.worker._jobs[r.request_id]
    dropped = a.worker.kvtier_stats()["saves_dropped"]
    so = sched_output()
    so.preempted_req_ids = {r.request_id}
    meta = a.sched.build_connector_meta(so)
    assert meta.preempted == [r.request_id] and meta.saves == []
    a.worker.bind_connector_metadata(meta)
    a.worker.start_load_kv(None)
    assert job.cancelled and not job.copied and a.worker.saves_in_flight() == 0
    for t in a.kv.values():  # the blocks now hold another request's KV
        t[:, [1, 2]] = 0
    a.worker.wait_for_save()
    a.worker.clear_connector_metadata()
    gate.set()
    assert wait_until(lambda: job.future.done())
    assert job.future.result() == 0
    assert a.worker.kvtier_stats()["saves_dropped"] == dropped + 1
    keys = kv.key_chain(r, BS, kv.chain_root("tiny-test"), [], 2)
    page = a.worker._layout.page_bytes
    with vd.client(model="tiny-test", salt=kv.rank_salt(0, 1, 0, 1), block_bytes=page) as c:
        assert c.exists_keys(keys) == 0
    assert wait_until(lambda: resv_open(vd) == 0)
    a.close()



def test_preempted_request_saves_cancelled_before_a_forward_without_loads(vd: Daemon) -> None:
    """vLLM 0.34's model runner (v1/worker/gpu/kv_connector.py, the CPU one alike) calls
    handle_preemptions and bind_connector_metadata before the step's forward, but start_load_kv
    before it only when the step loads in it (has_sync_kv_loads); otherwise after it. A step
    with no load in it that lists a preempted request: its save jobs that have not read the
    freed blocks are cancelled in handle_preemptions, before the forward writes another
    request's KV into those blocks, so that a job reading meanwhile on the I/O thread cannot
    store that KV under the preempted request's keys. On the old code the cancel waited for
    start_load_kv, after the forward: the job copied the overwritten blocks and stored them."""
    a = Engine(vd, seed=54)
    r = request(prompt(2))
    gate = threading.Event()
    a.worker._pool.submit(gate.wait, 5)
    _, meta = schedule(a.sched, r, [1, 2, 3])
    assert run_step(a.worker, a.kv, meta, settle=False) == set()
    (job,) = a.worker._jobs[r.request_id]
    so = sched_output()
    so.preempted_req_ids = {r.request_id}
    meta = a.sched.build_connector_meta(so)
    assert meta.preempted == [r.request_id] and meta.loads == []
    a.worker.handle_preemptions(meta)  # pre_forward, as vLLM 0.34 calls it
    a.worker.bind_connector_metadata(meta)
    for t in a.kv.values():  # the forward: the freed blocks now hold another request's KV
        t[:, [1, 2]] = 0
    gate.set()  # the I/O thread goes on meanwhile
    assert wait_until(lambda: job.future.done())
    a.worker.start_load_kv(None)  # post_forward: no load in the step, so after it
    a.worker.wait_for_save()
    a.worker.clear_connector_metadata()
    keys = kv.key_chain(r, BS, kv.chain_root("tiny-test"), [], 2)
    page = a.worker._layout.page_bytes
    with vd.client(model="tiny-test", salt=kv.rank_salt(0, 1, 0, 1), block_bytes=page) as c:
        assert c.exists_keys(keys) == 0, "the overwritten blocks were stored"
    assert job.cancelled and not job.copied
    assert wait_until(lambda: resv_open(vd) == 0)
    a.close()

# -- the policy's hints: the request's own chain, paused when preempted, finished -------------


def hint_counts(d: Daemon) -> Tuple[int, int]:
    with d.client() as c:
        st = c.stats()
    return st["hints_paused"], st["hints_finished"]


def test_scheduler_hints_reach_the_daemon(vd: Daemon) -> None:
    """A preempted request's chain gets the "paused" hint (expected back in preempt_pause_ms),
    a finished one's the "finished" hint, a waiting one's (asked again) "paused" on its
    lookup: each one MATCH the daemon counts under its kind (STATS hints_paused /
    hints_finished, the metric kvtier_hints_total), naming the request's own chain (the
    pages it matched or saved)."""
    a = Engine(vd, seed=53, preempt_pause_ms=3000)
    r = request(prompt(2))
    _, meta = schedule(a.sched, r, [1, 2, 3])
    assert run_step(a.worker, a.kv, meta) == set()
    was = hint_counts(vd)
    so = sched_output()
    so.preempted_req_ids = {r.request_id}
    a.sched.build_connector_meta(so)
    assert hint_counts(vd) == (was[0] + 1, was[1])
    assert finish(a, r, [])
    assert hint_counts(vd) == (was[0] + 1, was[1] + 1)
    # A request that waits (looked up, then not scheduled: no blocks for it) is asked again
    # by vLLM's scheduler: that lookup carries "paused", and still finds and leases the pages.
    w = request(list(r.all_token_ids))
    assert a.sched.get_num_new_matched_tokens(w, 0) == (2 * BS, False)
    a.sched.build_connector_meta(sched_output())  # a step without it
    assert hint_counts(vd) == (was[0] + 1, was[1] + 1)
    assert a.sched.get_num_new_matched_tokens(w, 0) == (2 * BS, False)
    assert hint_counts(vd) == (was[0] + 2, was[1] + 1)
    assert leases(vd) == 1
    a.sched.request_finished(w, [])
    assert wait_until(lambda: leases(vd) == 0)
    a.close()


def _keyed_client(d: Daemon, page: int) -> Any:
    """A plain client of the connector's keyed namespace (rank 0's), its chains as tokens."""
    from kvtier.keys import KEY_TOKENS, KEYS_TAG

    return d.client(model="tiny-test", salt=kv.rank_salt(0, 1, 0, 1), block_bytes=page,
                    page_size=KEY_TOKENS, adapter=KEYS_TAG, zero_copy=False)


def _toks(keys: List[bytes]) -> List[int]:
    from kvtier.keys import key_tokens

    return [t for k in keys for t in key_tokens(k)]


def _pressure(c: Any, a: List[bytes], b: List[bytes], page: int) -> Tuple[int, int]:
    """Stores fresh chains (as another engine would) until the daemon evicts a page of chain
    a or b; returns how many pages of each it still holds then (probes: not a use)."""
    def held(keys: List[bytes]) -> int:
        return sum(1 for x in c.match(_toks(keys), probe=True).tiers if x != 0)

    assert held(a) == len(a) and held(b) == len(b)
    buf = torch.zeros((8, page), dtype=torch.uint8)
    for i in range(600):
        c.put(_toks([os.urandom(32) for _ in range(8)]), buf)
        ha, hb = held(a), held(b)
        if ha < len(a) or hb < len(b):
            return ha, hb
    pytest.fail("600 chains of pressure evicted neither session")


@pytest.mark.parametrize("hint", ["none", "paused", "finished"])
def test_hinted_session_kept_under_pressure(hint: str) -> None:
    """Issue 40's end-to-end hint test: the connector's scheduler side drives two sessions,
    saved through the connector, on a daemon whose DRAM holds a few hundred pages (cost
    policy, no NVMe); each is used once (a lookup), a before b, then other chains fill the
    DRAM (as test_hints.py does with the package's calls). Unhinted (the control), a, used
    earlier, goes first. a preempted (vLLM lists it in preempted_req_ids: the "paused" hint,
    itself a use) before b's use: a is kept over b, the colder one. b finished
    (request_finished: the "finished" hint, itself a use) after a's use: b goes first."""
    d = Daemon("--dram-bytes", "1M", "--nvme-bytes", "0", "--policy", "cost")
    try:
        e = Engine(d, seed=54)
        page = e.worker._layout.page_bytes
        # Sessions larger than one maintenance pass (the DRAM from 95% down to 90%: about 17
        # pages here), so that the pass that reaches them takes one first, not both.
        n = 20
        ra, rb = request(prompt(n)), request(prompt(n))
        for r in (ra, rb):  # the same blocks: each save is stored before the next step
            _, meta = schedule(e.sched, r, list(range(1, n + 2)))
            assert run_step(e.worker, e.kv, meta) == set()
        ka = kv.key_chain(ra, BS, kv.chain_root("tiny-test"), [], n)
        kb = kv.key_chain(rb, BS, kv.chain_root("tiny-test"), [], n)
        with _keyed_client(d, page) as c:
            if hint == "paused":
                so = sched_output()
                so.preempted_req_ids = {ra.request_id}
                e.sched.build_connector_meta(so)
            else:
                assert c.match(_toks(ka)).pages == n
            time.sleep(0.2)  # a's use clearly the older one
            if hint == "finished":
                assert finish(e, rb, [])
            else:
                assert c.match(_toks(kb)).pages == n
            ha, hb = _pressure(c, ka, kb, page)
        if hint == "none":
            assert ha < hb, (ha, hb)  # the one used earlier goes first
        elif hint == "paused":
            assert ha == n and hb < n, (ha, hb)  # a paused session is kept over a colder one
        else:
            # b finished goes first, though used last: none of a's pages goes while one of b's
            # is left (what goes after b, a or the pressure's own pages, is the policy's choice).
            assert hb < n and (ha == n or hb == 0), (ha, hb)
        e.close()
    finally:
        d.stop(signal.SIGKILL)


def _runs_spy(lay: Any, made: List[Tuple[bool, int, Any]]) -> None:
    """Records each plan the layout makes: (load, runs, the plan or None); a sealed save's
    page-ordered plan (save_plan, made without runs) as (False, 0, the plan)."""
    real, real_save = lay.plan, lay.save_plan

    def plan(runs: Any, kvs: Any, load: bool) -> Any:
        p = real(runs, kvs, load)
        made.append((load, len(runs), p))
        return p

    def save_plan(addrs: Any, blocks: Any, kvs: Any) -> Any:
        p = real_save(addrs, blocks, kvs)
        if p is not None:
            made.append((False, 0, p))
        return p

    lay.plan, lay.save_plan = plan, save_plan


@pytest.mark.parametrize("spans", [True, False], ids=["kvt_copy_spans", "numpy"])
def test_zero_copy_pages_in_several_runs(vd: Daemon, spans: bool, monkeypatch: Any) -> None:
    """A save and a load whose blocks make several runs (consecutive blocks equally spaced in
    the mapping; here split by the block ids on both sides) copy every layer with one
    kvt_copy_spans call (the plan made once per job; the sealed save's one page-ordered
    plan, save_plan), byte for byte, leaving the other blocks alone; with a libkvtier
    without it (_COPY_SPANS None) the numpy copies do the same."""
    from kvtier.vllm import layout

    if spans:
        assert layout._COPY_SPANS is not None, "this build's libkvtier has kvt_copy_spans"
    else:
        monkeypatch.setattr(layout, "_COPY_SPANS", None)
    a, b = Engine(vd, seed=15), Engine(vd, seed=None)
    made: List[Tuple[bool, int, Any]] = []
    _runs_spy(a.worker._layout, made)
    _runs_spy(b.worker._layout, made)
    toks = prompt(7)
    saved = [1, 2, 3, 9, 10, 5, 7, 8]
    save_prompt(a, request(toks), saved)
    r = request(toks)
    into = [20, 21, 4, 30, 31, 12, 13, 0]
    n, meta = schedule(b.sched, r, into)
    assert n == 7 * BS
    assert run_step(b.worker, b.kv, meta) == set()
    assert same_pages(a, saved[:7], b, into[:7])
    rest = [i for i in range(NBLOCKS) if i not in into[:7]]
    assert all(int(t[:, rest].abs().sum()) == 0 for t in b.kv.values())
    saves = [m for m in made if not m[0]]
    loads = [m for m in made if m[0]]
    # Sealed (the daemon's default): one page-ordered plan, no runs; without kvt_copy_spans
    # the runs' numpy copies: 1-3, 9-10, 5, 7 at least.
    assert len(saves) == 1, made
    assert (saves[0][2].paged and saves[0][2].pages == 7) if spans else saves[0][1] >= 4, made
    assert len(loads) == 1 and loads[0][1] >= 4, made  # 20-21, 4, 30-31, 12-13
    assert all((p is not None) == spans for _, _, p in made), made
    assert no_staging(a.worker) and no_staging(b.worker)
    b.sched.request_finished(r, into)
    assert wait_until(lambda: leases(vd) == 0)
    a.close()
    b.close()


@pytest.mark.parametrize("dim", [0, 1])
def test_copy_plan_matches_the_numpy_copies(dim: int) -> None:
    """_Layout.plan's spans against the numpy copies, for both block dimensions vLLM uses
    ((num_blocks, ...) and (2, num_blocks, ...)), over pages in runs of uneven spacing in
    one buffer: a load gives vLLM's tensors the same bytes, a save the pages the same bytes;
    a block outside the tensors, a tensor of another dtype, or one whose rows are not
    contiguous gets no plan (the numpy copies, which check, do it)."""
    from kvtier.vllm import layout

    if layout._COPY_SPANS is None:
        pytest.skip("libkvtier without kvt_copy_spans")
    nb = 16
    shape = (nb, 2, BS, HEADS, HEAD) if dim == 0 else (2, nb, BS, HEADS, HEAD)
    g = torch.Generator().manual_seed(3)
    kvs = {"l%d" % i: torch.randn(*shape, generator=g).to(DTYPE) for i in range(3)}
    lay = layout._Layout(kvs, nb)
    assert lay.dims == [dim] * 3
    pb = lay.page_bytes
    mem = bytearray(os.urandom(20 * pb))
    mv = memoryview(mem)
    at = [0, 1, 2, 4, 5, 9, 13, 14, 15]  # places: runs of 3, 2, 1, 3 pages
    blocks = [3, 4, 5, 6, 7, 0, 10, 11, 12]  # 3-5 and 6-7 split by their places
    items = [mv[p * pb:(p + 1) * pb] for p in at]
    runs = lay.runs(items, blocks)
    assert len(runs) == 4
    names = list(kvs)

    def copies(load: bool, use_plan: bool, tensors: List[torch.Tensor]) -> None:
        p = lay.plan(runs, tensors, load) if use_plan else None
        assert (p is not None) == use_plan
        for li, t in enumerate(tensors):
            (lay.scatter_runs if load else lay.gather_runs)(runs, li, t, p)

    want = [t.clone() for t in kvs.values()]
    got = [t.clone() for t in kvs.values()]
    copies(True, False, want)
    copies(True, True, got)
    assert all(torch.equal(x.view(torch.int16), y.view(torch.int16)) for x, y in zip(want, got))
    assert not torch.equal(want[0].view(torch.int16), kvs[names[0]].view(torch.int16))
    for t in got:  # new contents to save
        t.view(torch.int16).random_(-30000, 30000, generator=g)
    before = bytes(mem)
    copies(False, True, got)
    by_plan = bytes(mem)
    mem[:] = before
    copies(False, False, got)
    assert by_plan == bytes(mem) and by_plan != before
    # Refused: a block past the tensors, another dtype, rows not contiguous.
    far = lay.runs(items[:1], [nb])
    assert lay.plan(far, got, True) is None
    assert lay.plan(runs, [t.to(torch.float16) for t in got], True) is None
    odd = [torch.empty(shape[::-1], dtype=DTYPE).permute(4, 3, 2, 1, 0) for _ in got]
    assert lay.plan(runs, odd, True) is None


@pytest.mark.parametrize("dim", [0, 1])
def test_save_plan_matches_the_runs_plan(dim: int) -> None:
    """_Layout.save_plan (a sealed save's copies planned straight from the room's addresses,
    page by page) writes the same bytes into the pages as plan() over runs() does, with the
    same XXH3-64 sums, for both block dimensions, over pages spaced unevenly in one buffer;
    it refuses what plan() refuses (a block past the tensors, another dtype) and a plan of it
    copies only through copy_sums."""
    from kvtier.vllm import layout

    if layout._COPY_PAGES_XXH3 is None:
        pytest.skip("libkvtier without kvt_copy_pages_xxh3")
    nb = 16
    shape = (nb, 2, BS, HEADS, HEAD) if dim == 0 else (2, nb, BS, HEADS, HEAD)
    g = torch.Generator().manual_seed(5)
    kvs = [torch.randn(*shape, generator=g).to(DTYPE) for _ in range(3)]
    lay = layout._Layout({"l%d" % i: t for i, t in enumerate(kvs)}, nb)
    pb = lay.page_bytes
    mem = bytearray(os.urandom(20 * pb))
    mv = memoryview(mem)
    at = [0, 1, 2, 4, 5, 9, 13, 14, 15]
    blocks = [3, 4, 5, 6, 7, 0, 10, 11, 12]
    items = [mv[p * pb:(p + 1) * pb] for p in at]
    base = int(layout.ffi.cast("uintptr_t", layout.ffi.from_buffer(mem)))
    addrs = [base + p * pb for p in at]
    before = bytes(mem)
    old = lay.plan(lay.runs(items, blocks), kvs, False)
    assert old is not None and not old.paged
    want_sums = old.copy_sums()
    want = bytes(mem)
    mem[:] = before
    new = lay.save_plan(addrs, blocks, kvs)
    assert new is not None and new.paged and new.pages == len(blocks)
    got_sums = new.copy_sums()
    assert bytes(mem) == want and want != before
    assert list(got_sums) == list(want_sums)
    with pytest.raises(ValueError):
        new.copy(0)
    assert lay.save_plan(addrs[:1], [nb], kvs) is None
    assert lay.save_plan(addrs, blocks, [t.to(torch.float16) for t in kvs]) is None


@pytest.mark.parametrize("wrong", [False, True], ids=["sums", "wrong_sums"])
def test_zero_copy_save_sends_its_pages_sums(vd: Daemon, wrong: bool, monkeypatch: Any) -> None:
    """A save into the mapping, where RESERVE's reply asks for sums (zero-copy-checksum, the
    default), copies each page's layers and takes its XXH3-64 in the same pass, and COMMIT
    carries them: the daemon records them (zero_copy_client_sums) and hashes none itself
    (zero_copy_seals stays), so the next lookup does not wait behind that pass (issue 35). The
    sums are right: a connector over TCP loads the pages through the socket, where the daemon
    checks each page against its sum, byte for byte. With one bit of each sum
    flipped (``wrong``) that socket load fails, every page a scribble: the check is real."""
    from kvtier.vllm import layout

    assert layout._COPY_PAGES_XXH3 is not None, "this build's libkvtier has kvt_copy_pages_xxh3"
    if wrong:
        real = layout._Plan.copy_sums
        monkeypatch.setattr(layout._Plan, "copy_sums", lambda self: real(self) ^ np.uint64(1))
    a = Engine(vd, seed=17)
    toks = prompt(7)
    saved = [1, 2, 3, 9, 10, 5, 7, 8]  # several runs in the mapping
    before = zc_stats(vd)
    save_prompt(a, request(toks), saved)
    mid = zc_stats(vd)
    assert a.worker._store.mapped
    assert mid["zero_copy_pages_reserve"] - before["zero_copy_pages_reserve"] == 7
    assert mid["zero_copy_client_sums"] - before["zero_copy_client_sums"] == 7, mid
    assert mid["zero_copy_seals"] == before["zero_copy_seals"], "the daemon hashed the pages"
    b = Engine(vd, seed=None, unix_path=None, tcp=vd.tcp)  # no mapping can be had over TCP
    assert not b.worker._store.mapped
    r = request(toks)
    into = [20, 21, 4, 30, 31, 12, 13, 0]
    n, meta = schedule(b.sched, r, into)
    assert n == 7 * BS
    failed = run_step(b.worker, b.kv, meta)
    after = zc_stats(vd)
    if wrong:
        assert failed, "pages with wrong sums were served through the socket"
        assert after["zero_copy_scribbles"] > mid["zero_copy_scribbles"], after
    else:
        assert failed == set()
        assert same_pages(a, saved[:7], b, into[:7])
        assert after["zero_copy_scribbles"] == mid["zero_copy_scribbles"]
    b.sched.request_finished(r, into)
    assert wait_until(lambda: leases(vd) == 0)
    a.close()
    b.close()


def test_readme_launch_line_recomputes_a_failed_load() -> None:
    """The README's `vllm serve --kv-transfer-config` builds vLLM's own KVTransferConfig naming
    this connector, with kv_load_failure_policy "recompute": vLLM's default ("fail") ends a
    request whose load failed with an error instead of recomputing it (docs/engines.md)."""
    import json
    import re

    from conftest import SOURCE_ROOT

    with open(os.path.join(SOURCE_ROOT, "README.md")) as f:
        m = re.search(r"vllm serve MODEL --kv-transfer-config '(\{.*?\})'", f.read(), re.S)
    assert m, "the README has a vLLM launch line"
    ktc = KVTransferConfig(**json.loads(m.group(1)))
    assert (ktc.kv_connector, ktc.kv_connector_module_path) == ("KvtierConnector", "kvtier.vllm")
    assert ktc.kv_load_failure_policy == "recompute"


@pytest.mark.parametrize("policy, warned", [("fail", True), ("recompute", False)])
def test_a_failing_load_policy_is_said_at_start(vd: Daemon, caplog: Any, policy: str,
                                                warned: bool) -> None:
    """vLLM's kv_load_failure_policy "fail" (its default) ends a request whose load failed
    instead of recomputing it: the scheduler's connector says so once at start, naming the
    setting; the worker's says nothing (vLLM's scheduler applies the policy)."""
    cfg = vllm_config(vd, "warn-test", BS)
    cfg.kv_transfer_config.kv_load_failure_policy = policy
    with caplog.at_level("WARNING", logger="kvtier.vllm"):
        sched = connector(cfg, KVConnectorRole.SCHEDULER)
        worker = connector(cfg, KVConnectorRole.WORKER)
    said = [m for m in caplog.messages if "kv_load_failure_policy" in m]
    assert len(said) == (1 if warned else 0), said
    worker.shutdown()
    sched.shutdown()
