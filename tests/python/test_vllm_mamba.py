"""test_vllm_mamba.py: kvtier.vllm.KvtierConnector with a hybrid SSM model's KV cache groups.

A configuration built offline as vLLM builds one for a hybrid Mamba model: vLLM's own
KVCacheConfig with a full-attention group and a Mamba group (MambaSpec, mamba_cache_mode
"align": the state after p pages in the request's Mamba block p - 1), two layers each, block
size 16; the Mamba layers' caches are vLLM's own views of a raw buffer (create_kv_cache_views:
int8 pages, the states padded to the attention page); vLLM's own KVCacheManager (its
MambaManager, prefix caching on as align mode is in vLLM) allocating each request's blocks;
prefill chunks ending where vLLM's align mode ends them (get_mamba_prefill_checkpoint_position);
each step's state saves checked against the boundary states vLLM's manager offers. The
connector is built by vLLM's KVConnectorFactory; its scheduler and worker sides are driven as
vLLM drives them (Mamba layers call neither wait_for_layer_load nor save_kv_layer), a real
kvtierd behind it. Serving a real hybrid model is not possible on this CPU (no vllm._C).
"""

from __future__ import annotations

import itertools
import time
import traceback
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch

from conftest import Daemon
from vllm_harness import handed_back, load_with_daemon_killed, real_scheduler, run_step, settle
from vllm_harness import skip_without_vllm
from vllm_harness import vllm_config as harness_vllm_config

try:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
                                            KVCacheTensor, MambaSpec,
                                            create_kv_cache_views,
                                            get_mamba_prefill_checkpoint_position)
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.request import Request
except Exception as e:  # noqa: BLE001 - any import failure means: no usable vLLM here
    skip_without_vllm(e)

import kvtier.vllm as kv  # noqa: E402
from kvtier.keys import KEY_TOKENS, KEYS_TAG, key_tokens  # noqa: E402
import test_vllm  # noqa: E402

# vLLM's ModelConfig of a tiny Llama, which its Scheduler needs (test_vllm.py's fixture, this
# module's own instance).
tiny_model_config = test_vllm.tiny_model_config

BS, HEADS, HEAD, NBLOCKS = 16, 2, 8, 40
DTYPE = torch.bfloat16
FULL = ["model.layers.0.self_attn.attn", "model.layers.2.self_attn.attn"]
MAMBA = ["model.layers.1.mixer", "model.layers.3.mixer"]
PAGE = 2 * BS * HEADS * HEAD * 2  # an attention layer's page: the Mamba pages padded to it
MODEL = "tiny-ssm-hybrid"
SETTLE_S = 5.0
_ids = itertools.count(1)
_tok = itertools.count(0)


def mamba_spec(**kw: Any) -> "MambaSpec":
    args: Dict[str, Any] = dict(block_size=BS, shapes=((4, 8), (2, 4)),
                                dtypes=(DTYPE, torch.float32), mamba_cache_mode="align",
                                page_size_padded=PAGE)
    args.update(kw)
    return MambaSpec(**args)


def ssm_config(mamba: Optional["MambaSpec"] = None, full: bool = True) -> "KVCacheConfig":
    """The hybrid config (``full`` False: a model of Mamba layers only, one group)."""
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD, dtype=DTYPE)
    groups = [KVCacheGroupSpec(FULL, spec)] if full else []
    groups.append(KVCacheGroupSpec(MAMBA, mamba or mamba_spec()))
    return KVCacheConfig(num_blocks=NBLOCKS, kv_cache_tensors=[], kv_cache_groups=groups)


def caches(seed: Any, full: bool = True) -> Dict[str, torch.Tensor]:
    """The worker's caches: the attention layers paged (2, blocks, 16, heads, head), the Mamba
    layers as vLLM views them (create_kv_cache_views of a raw int8 buffer: (blocks, 1, 1,
    96-byte state) at a page's stride). Random bytes from ``seed``, or zeros (None)."""
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    out: Dict[str, torch.Tensor] = {}
    for n in FULL if full else ():
        t = torch.randn(2, NBLOCKS, BS, HEADS, HEAD, generator=g) if g is not None else \
            torch.zeros(2, NBLOCKS, BS, HEADS, HEAD)
        out[n] = t.to(DTYPE)
    raw = torch.zeros(len(MAMBA) * NBLOCKS * PAGE, dtype=torch.int8)
    if g is not None:
        raw.copy_(torch.randint(-128, 128, raw.shape, generator=g, dtype=torch.int8))
    t = KVCacheTensor(size=raw.numel(), layers=MAMBA, layer_stride=NBLOCKS * PAGE,
                      block_stride=PAGE)
    out.update(zip(MAMBA, create_kv_cache_views(raw, mamba_spec(), NBLOCKS,
                                                KVCacheLayout.LBHNC, t)))
    return out


def empty_output(new: List[Any], cached: Any, scheduled: Dict[str, int]) -> "SchedulerOutput":
    return SchedulerOutput(scheduled_new_reqs=new, scheduled_cached_reqs=cached,
                           num_scheduled_tokens=scheduled,
                           total_num_scheduled_tokens=sum(scheduled.values()),
                           scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
                           finished_req_ids=set(), free_encoder_mm_hashes=[])


class Engine:
    """vLLM's KV cache manager for the hybrid SSM config, the connector's two roles, and the
    worker's caches."""

    def __init__(self, d: Daemon, seed: Any, full: bool = True, **extra: Any) -> None:
        self.kvc = ssm_config(full=full)
        self.manager = KVCacheManager(self.kvc, max_model_len=1024, scheduler_block_size=BS,
                                      hash_block_size=BS, enable_caching=True)
        cfg = harness_vllm_config(d, MODEL, BS, **extra)
        self.sched = KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER,
                                                         self.kvc)
        self.worker = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, self.kvc)
        self.kv = caches(seed, full)
        self.worker.register_kv_caches(self.kv)
        self.states: Dict[int, int] = {}

    def forward(self, meta: Any) -> set:
        """One forward's worker calls as vLLM makes them: the attention layers wait for their
        load and save; the Mamba layers call neither; wait_for_save after the last layer. Then
        (a test, outside the step) waits until the saves are stored."""
        w = self.worker
        w.bind_connector_metadata(meta)
        w.start_load_kv(None)
        for name in FULL if FULL[0] in self.kv else ():
            w.wait_for_layer_load(name)
            w.save_kv_layer(name, self.kv[name], None)
        w.wait_for_save()
        assert w.get_finished(set()) == (None, None)
        errors = w.get_block_ids_with_load_errors()
        w.clear_connector_metadata()
        settle(w, SETTLE_S)
        return errors

    def prefill(self, r: "Request", chunk: int = 1 << 30) -> List[List[Tuple[int, int, int]]]:
        """Computes the whole prompt, no hit, in chunks of at most ``chunk`` tokens ending
        where vLLM's align mode ends them (on page boundaries, the last cacheable one
        included). Returns each step's saves as (group, first page, pages)."""
        n, _ = self.sched.get_num_new_matched_tokens(r, 0)
        assert n == 0
        last = get_mamba_prefill_checkpoint_position(r.num_tokens, BS, False)
        saves = []
        first = True
        while r.num_computed_tokens < r.num_tokens:
            start = r.num_computed_tokens
            end = min(start + chunk, r.num_tokens)
            if start < last < end:
                end = last
            elif end < r.num_tokens:
                end = end // BS * BS
            new = self.manager.allocate_slots(r, end - start)
            assert new is not None
            if first:
                self.sched.update_state_after_alloc(r, self.manager.get_blocks(r.request_id), 0)
                nr = NewRequestData.from_request(r, self.manager.get_block_ids(r.request_id),
                                                 list(r.all_token_ids))
                so = empty_output([nr], CachedRequestData.make_empty(),
                                  {r.request_id: end - start})
                first = False
            else:
                so = empty_output([], self.cached(r, new), {r.request_id: end - start})
            meta = self.sched.build_connector_meta(so)
            saves.append(self.note(meta))
            assert self.forward(meta) == set()
            r.num_computed_tokens = end
        return saves

    def note(self, meta: Any) -> List[Tuple[int, int, int]]:
        """The step's saves as (group, first page, pages); the block each Mamba state was
        saved from kept in ``states`` by page (vLLM frees it a step or two later). The
        states saved are the ones vLLM's own manager offers a connector this step
        (take_boundary_state_offloads: group, block, boundary in tokens)."""
        mine = []
        for t in meta.saves:
            if t.group == len(self.kvc.kv_cache_groups) - 1:
                self.states[t.first] = t.block_ids[0]
                mine.append((t.group, t.block_ids[0], (t.first + 1) * BS))
        offers = [o for os_ in self.manager.take_boundary_state_offloads().values()
                  for o in os_]
        assert sorted(mine) == sorted(offers)
        return sorted((t.group, t.first, len(t.keys)) for t in meta.saves)

    @staticmethod
    def cached(r: "Request", new: Any) -> "CachedRequestData":
        crd = CachedRequestData.make_empty()
        ids = new.get_block_ids()
        crd.req_ids.append(r.request_id)
        crd.new_token_ids.append([])
        crd.new_block_ids.append(ids if any(ids) else None)
        crd.num_computed_tokens.append(r.num_computed_tokens)
        crd.num_output_tokens.append(len(r.output_token_ids))
        return crd

    def load(self, r: "Request") -> int:
        """A new request's lookup; on a hit, vLLM's allocation with the hit as external tokens
        and the load between steps (the request waits), until get_finished reports it.
        Returns the hit (tokens)."""
        n, load_async = self.sched.get_num_new_matched_tokens(r, 0)
        assert load_async is bool(n)
        if not n:
            return 0
        assert self.manager.allocate_slots(r, r.num_tokens - n, num_external_computed_tokens=n,
                                           delay_cache_blocks=True) is not None
        self.sched.update_state_after_alloc(r, self.manager.get_blocks(r.request_id), n)
        meta = self.sched.build_connector_meta(empty_output([], CachedRequestData.make_empty(),
                                                            {}))
        assert all(t.async_load for t in meta.loads)
        self.loads = {t.group: (t.first, len(t.keys), t.block_ids) for t in meta.loads}
        w = self.worker
        w.bind_connector_metadata(meta)
        w.start_load_kv(None)
        errors: set = set()
        deadline = time.monotonic() + SETTLE_S
        while True:
            w.wait_for_save()
            _, recving = w.get_finished(set())
            errors |= w.get_block_ids_with_load_errors()
            if recving:
                assert recving == {r.request_id}
                break
            assert time.monotonic() < deadline, "the load was never reported"
            time.sleep(0.005)
        w.clear_connector_metadata()
        assert errors == set()
        return n

    def finish(self, r: "Request") -> bool:
        ids = self.manager.get_block_ids(r.request_id)
        held, _ = self.sched.request_finished_all_groups(r, ids)
        if held:
            handed_back(self.worker, r.request_id)
        self.manager.free(r)
        return held

    def close(self) -> None:
        self.worker.shutdown()
        self.sched.shutdown()


def request(tokens: List[int]) -> "Request":
    """A request with vLLM's own block hashes (its prefix cache, on: Mamba's align mode is
    vLLM's prefix caching of such a model)."""
    init_none_hash(sha256_cbor)
    return Request("sreq-%d" % next(_ids), tokens, SamplingParams(max_tokens=4), None,
                   block_hasher=get_request_block_hasher(BS, sha256_cbor))


def prompt(pages: int, extra: int) -> List[int]:
    base = next(_tok) * 100_000 + 11
    return list(range(base, base + pages * BS + extra))


def stored(d: Daemon, e: Engine, r: "Request", gid: int, pages: int) -> List[bool]:
    """Whether kvtierd holds bytes for each page of group ``gid``'s chain of ``r`` (in the
    namespace of engine ``e``)."""
    from kvtier.vllm.common import group_chain

    model = e.sched._model
    base = kv.key_chain(r, BS, kv.chain_root(model), [], pages)
    keys = group_chain(base, gid, [], pages)
    with d.client(model=model, salt=kv.rank_salt(0, 1, 0, 1), page_size=KEY_TOKENS,
                  adapter=KEYS_TAG, block_bytes=e.worker._layout.page_bytes) as c:
        m = c.match([t for k in keys for t in key_tokens(k)], probe=True)
        return [bool(t) for t in list(m.tiers) + [0] * (pages - len(m.tiers))]


def same(a: Any, full: List[int], state: int, b: Engine, ib: List[List[int]],
         pages: int) -> None:
    """B's blocks of the hit hold A's bytes: every full-attention page of it (A's blocks
    ``full``), and the Mamba state at its boundary (A's block ``state``, B's block
    pages - 1); B's other Mamba blocks untouched (zeros)."""
    for name in FULL if FULL[0] in b.kv else ():
        x, y = a.kv[name][:, full[:pages]], b.kv[name][:, ib[0][:pages]]
        assert x.any() and torch.equal(x.view(torch.int16), y.view(torch.int16)), name
    for name in MAMBA:
        x, y = a.kv[name][state], b.kv[name][ib[-1][pages - 1]]
        assert x.any() and torch.equal(x, y), name
        others = [blk for blk in ib[-1] if blk not in (0, ib[-1][pages - 1])]
        assert others and not b.kv[name][others].any(), name


def test_mamba_group_starts_in_both_roles(vd: Daemon) -> None:
    """A full-attention group and a Mamba group in vLLM's align mode: vLLM builds the connector
    in both roles (kvtier before refused any Mamba group: ValueError at start); the Mamba group
    is a state group with its own chain, and loads go between steps. A Mamba group kvtier
    cannot store is refused, naming why: vLLM's default mode (no state at page boundaries),
    speculative state blocks, and load_async set false."""
    cfg = harness_vllm_config(vd, MODEL, BS)
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        c = KVConnectorFactory.create_connector(cfg, role, ssm_config())
        assert [(g.gid, g.state, g.gaps) for g in c._groups] == [(0, False, False),
                                                                  (1, True, True)]
        assert c._async is True
        c.shutdown()
    for spec, why in ((mamba_spec(mamba_cache_mode="none"), "mamba_cache_mode 'none'"),
                      (mamba_spec(num_speculative_blocks=1), "num_speculative_blocks 1")):
        with pytest.raises(ValueError, match="KV cache group 1 \\(MambaSpec.*" + why):
            KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER,
                                                ssm_config(spec))
    off = harness_vllm_config(vd, MODEL, BS, load_async=False)
    with pytest.raises(ValueError, match="load_async"):
        KVConnectorFactory.create_connector(off, KVConnectorRole.WORKER, ssm_config())


@pytest.mark.parametrize("zero_copy", [True, False])
def test_state_round_trips_into_other_blocks(vd: Daemon, zero_copy: bool) -> None:
    """Engine A computes a prompt of 8 pages + 5 tokens as vLLM's align mode does (a chunk
    ending at 128 tokens, then the rest): the full group stores its 8 pages, the Mamba group
    only the state at the chunk's end, page 7 of its chain (block 7), after a gap; the last
    chunk, ending inside a page, stores nothing. Engine B, zeroed caches, the same prompt: a
    hit of 8 pages, loaded between steps into the blocks vLLM allocated, the state into B's
    block 7, byte-exact; B's other Mamba blocks untouched. Through the zero-copy mapping and
    the socket."""
    a, b = Engine(vd, 21, zero_copy=zero_copy), Engine(vd, None, zero_copy=zero_copy)
    r = request(prompt(8, 5))
    assert a.prefill(r) == [[(0, 0, 8), (1, 7, 8)], []]
    ia = a.manager.get_block_ids(r.request_id)
    assert a.finish(r)
    assert stored(vd, a, r, 0, 8) == [True] * 8
    assert stored(vd, a, r, 1, 8) == [False] * 7 + [True]
    r2 = request(list(r.all_token_ids))
    assert b.load(r2) == 8 * BS
    ib = b.manager.get_block_ids(r2.request_id)
    assert b.loads == {0: (0, 8, ib[0][:8]), 1: (7, 8, [ib[1][7]])}
    assert ib[1][:7] == [0] * 7
    assert a.states == {7: ia[1][7]}
    same(a, ia[0], ia[1][7], b, ib, 8)
    assert b.worker._store.mapped is zero_copy
    b.finish(r2)
    with vd.client() as c:
        assert c.stats()["leases"] == 0
    a.close()
    b.close()


def test_model_of_mamba_layers_only(vd: Daemon) -> None:
    """A model of Mamba layers only (one KV cache group, a MambaSpec; kvtier before stored its
    blocks as pages of tokens, loading whatever block p - 1 held as a state): its one group is
    a state group in a namespace of its own; the state at the prompt's last boundary is
    stored alone and loaded byte-exact into another engine's block for it."""
    a, b = Engine(vd, 51, full=False), Engine(vd, None, full=False)
    r = request(prompt(6, 2))
    assert a.prefill(r) == [[(0, 5, 6)], []]
    assert [(g.gid, g.state) for g in a.sched._groups] == [(0, True)]
    assert a.sched._model.endswith("|groups=1")
    assert a.finish(r)
    assert stored(vd, a, r, 0, 6) == [False] * 5 + [True]
    r2 = request(list(r.all_token_ids))
    assert b.load(r2) == 6 * BS
    ib = b.manager.get_block_ids(r2.request_id)
    assert b.loads == {0: (5, 6, [ib[0][5]])}
    same(a, [], a.states[5], b, ib, 6)
    b.finish(r2)
    a.close()
    b.close()


def test_hit_needs_the_state_at_its_boundary(vd: Daemon) -> None:
    """Chunked prefill (chunks of 64 tokens) leaves states at pages 4 and 8 only. A prompt
    sharing 6 pages: the full group holds 6, but no state at 6: the hit is the longest prefix
    with a state, 4 pages, and loads the state at 4. A prompt sharing 3 pages: no state at
    3 or below, a miss (0 tokens) though the full group holds 3. A decode step that fills
    page 9 stores its state and page; a prompt sharing 9 pages then hits 9."""
    a, b = Engine(vd, 31), Engine(vd, None)
    toks = prompt(8, 5)
    r = request(toks)
    assert a.prefill(r, chunk=64) == [[(0, 0, 4), (1, 3, 4)], [(0, 4, 8), (1, 7, 8)], []]
    assert stored(vd, a, r, 1, 8) == [False] * 3 + [True] + [False] * 3 + [True]
    ia = a.manager.get_block_ids(r.request_id)

    other = prompt(0, 40)
    r6 = request(toks[:6 * BS] + other)
    assert b.load(r6) == 4 * BS
    ib = b.manager.get_block_ids(r6.request_id)
    assert b.loads == {0: (0, 4, ib[0][:4]), 1: (3, 4, [ib[1][3]])}
    same(a, ia[0], a.states[3], b, ib, 4)
    b.finish(r6)
    assert b.load(request(toks[:3 * BS] + other)) == 0

    # Decode: 133 -> 145 tokens; the step computing token 144 ends page 9.
    r.num_computed_tokens = r.num_tokens
    saved = []
    for t in range(11):
        r.append_output_token_ids(900 + t)
        new = a.manager.allocate_slots(r, 1)
        assert new is not None
        meta = a.sched.build_connector_meta(empty_output([], Engine.cached(r, new),
                                                         {r.request_id: 1}))
        saved.append(a.note(meta))
        assert a.forward(meta) == set()
        r.num_computed_tokens += 1
    assert saved == [[]] * 10 + [[(0, 8, 9), (1, 8, 9)]]
    ia = a.manager.get_block_ids(r.request_id)
    assert a.finish(r)
    r9 = request(list(r.all_token_ids)[:9 * BS] + other)
    assert b.load(r9) == 9 * BS
    same(a, ia[0], a.states[8], b, b.manager.get_block_ids(r9.request_id), 9)
    b.finish(r9)
    a.close()
    b.close()


def _save_in_child(unix: str, toks: List[int], q: Any) -> None:
    """Another process: engine A with caches from seed 41 computes ``toks`` and stores them;
    reports its request's block ids."""
    try:
        class D:  # the daemon's address, all harness_vllm_config reads
            pass
        d = D()
        d.unix = unix  # type: ignore[attr-defined]
        a = Engine(d, 41)  # type: ignore[arg-type]
        r = request(toks)
        a.prefill(r)
        ids = a.manager.get_block_ids(r.request_id)
        assert a.finish(r)
        a.close()
        q.put(((list(ids[0]), a.states[4]), None))
    except BaseException:  # noqa: BLE001 - reported to the test
        q.put((None, traceback.format_exc()))


def test_second_process_reads_what_the_first_saved(vd: Daemon) -> None:
    """A process (spawned: its own vLLM, connector and key chain root) computes and stores a
    prompt; this process's engine, another instance on the same daemon, hits it and loads
    every full page and the Mamba state byte-exact (the bytes the other process had, made
    here again from the same seed)."""
    import multiprocessing

    toks = prompt(5, 9)
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_save_in_child, args=(vd.unix, toks, q))
    p.start()
    try:
        theirs, err = q.get(timeout=180)
    finally:
        p.join(30)
        if p.is_alive():
            p.kill()
    assert err is None, err
    b = Engine(vd, None)

    class Theirs:  # the other process's caches, remade from its seed
        kv = caches(41)

    r = request(toks)
    assert b.load(r) == 5 * BS
    same(Theirs, theirs[0], theirs[1], b, b.manager.get_block_ids(r.request_id), 5)
    b.finish(r)
    b.close()


def test_failed_load_is_reported_as_its_request(vd: Daemon) -> None:
    """The daemon killed between the lookup and the load: the load between steps fails, and the
    request is reported as a whole (get_transfer_results: failed_recving, and finished_recving
    so that vLLM stops waiting), no block among the load errors: vLLM raises at failed blocks
    with several KV cache groups, and would recompute from a block whose state before it no
    block holds. Nothing raises, no thread is left waiting."""
    a, b = Engine(vd, 61), Engine(vd, None)
    r = request(prompt(4, 3))
    a.prefill(r)
    assert a.finish(r)
    a.close()
    r2 = request(list(r.all_token_ids))
    n, load_async = b.sched.get_num_new_matched_tokens(r2, 0)
    assert (n, load_async) == (4 * BS, True)
    assert b.manager.allocate_slots(r2, r2.num_tokens - n, num_external_computed_tokens=n,
                                    delay_cache_blocks=True) is not None
    b.sched.update_state_after_alloc(r2, b.manager.get_blocks(r2.request_id), n)
    meta = b.sched.build_connector_meta(empty_output([], CachedRequestData.make_empty(), {}))
    assert {t.group for t in meta.loads} == {0, 1}
    res = load_with_daemon_killed(vd, b.worker, meta, SETTLE_S)
    assert res.finished_recving == {r2.request_id} and res.failed_recving == {r2.request_id}
    assert b.worker.get_transfer_results(set()).failed_recving == set()  # reported once
    b.finish(r2)
    b.close()


@pytest.mark.parametrize("full", [True, False], ids=["hybrid", "mamba_only"])
@pytest.mark.parametrize("how", ["no_state", "raises"])
def test_unplanned_load_reported_through_vllms_scheduler(vd: Daemon, tiny_model_config: Any,
                                                         monkeypatch: Any, full: bool,
                                                         how: str) -> None:
    """A hit whose load the scheduler side cannot plan, through vLLM's real Scheduler (the
    Mamba config, prefix caching on as align mode has it; policy "recompute") stepped as its
    engine steps it: the lookup answers 4 pages, asynchronously, and vLLM makes the request
    wait for its load (WAITING_FOR_REMOTE_KVS); then planning finds no Mamba state to load
    (state_load None, as if vLLM gave no block for it) or raises. The request is reported
    once, as a failed load (failed_recving, within finished_recving), no block among the load
    errors, in the very step it began waiting: it leaves WAITING_FOR_REMOTE_KVS the step
    after and is computed from its first token (its next lookup answers 0), the steps going
    on. On the old code no load was sent and no one reported the request: it waited for
    ever (the Mamba-only model, or any model where planning raised), or, with a full group
    beside, that group's load went alone and vLLM resumed the request on a Mamba state never
    loaded (its block untouched)."""
    import kvtier.vllm.scheduler as vsched
    from vllm.v1.request import RequestStatus

    a = Engine(vd, 71, full=full)
    r = request(prompt(4, 3))
    a.prefill(r)
    assert a.finish(r)
    a.close()
    kvc = ssm_config(full=full)
    s, cfg = real_scheduler(tiny_model_config, vd, MODEL, kvc, "recompute",
                            enable_prefix_caching=True, mamba_cache_mode="align")
    worker = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, kvc)
    kvs = caches(None, full)
    worker.register_kv_caches(kvs)
    layers = FULL if full else []

    def unplannable(*args: Any) -> Any:
        if how == "raises":
            raise ValueError("no block for the Mamba state")
        return None

    monkeypatch.setattr(vsched, "state_load", unplannable)
    reported: Dict[str, set] = {}
    r2 = request(list(r.all_token_ids))
    s.add_request(r2)
    out = s.schedule()  # the lookup: a hit of 4 pages, loaded between steps
    assert r2.request_id not in out.num_scheduled_tokens
    assert r2.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert not [t for t in out.kv_connector_metadata.loads if t.group == len(kvc.kv_cache_groups)
                - 1], "no Mamba state load planned"
    run_step(s, worker, kvs, layers, out, reported)
    started = waited = None
    for step in range(100):  # 100 steps, a second: on the old code it waited for ever
        out = s.schedule()
        new = [nr for nr in out.scheduled_new_reqs if nr.req_id == r2.request_id]
        if new:  # scheduled to compute: where it starts is what counts
            started, waited = new[0].num_computed_tokens, step
            break
        run_step(s, worker, kvs, layers, out, reported)
        time.sleep(0.01)  # time for a load between steps, had one gone (the old code's)
    assert r2.status != RequestStatus.WAITING_FOR_REMOTE_KVS, "it waited for ever"
    assert started == 0, "computed from its first token, not resumed on a state never loaded"
    assert reported == {"failed": {r2.request_id}, "recving": {r2.request_id},
                        "invalid": set()}
    assert waited == 0, "scheduled the step after the one it began waiting in"
    assert r2.num_computed_tokens > 0 and r2.status == RequestStatus.RUNNING
    s.finish_requests([r2.request_id], RequestStatus.FINISHED_ABORTED)
    worker.shutdown()
    s.shutdown()
