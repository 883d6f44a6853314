"""test_gpucopy.py: kvtier.gpucopy, the pinned and batched copies between engine tensors on a GPU
and kvtier's host pages (docs/gpu.md, "Engine tensors and the arena"), against a real kvtierd.

Here (no GPU): the strategy's selection, the bounce pool's bound and reuse, the copier's checks
(another device, dtype, layout), the batching logic of the bounce path run end to end with CPU
tensors through a real reservation and lease (the device side is the same torch code on the
CPU; only the pool is ordinary memory: torch gives pinned memory only with an accelerator), the
arena lookup the registration uses, and that a CPU tensor still takes the connector's own path.
The vLLM worker aborts a reservation whose copy failed part-way.

On a GPU (run.sh suite): each strategy's round trip GPU tensor -> arena -> GPU tensor through the
vLLM layout's copy code, byte for byte, with the registrations counted before and after."""

import ctypes
import logging
import os
import random
from typing import Any, Dict, List

import pytest
from conftest import Daemon

torch = pytest.importorskip("torch", reason="torch is not installed")
np = pytest.importorskip("numpy", reason="numpy is not installed")

from kvtier import gpucopy  # noqa: E402
from kvtier.vllm.layout import _Layout  # noqa: E402

# vLLM's FlashAttention layout (2, blocks, block_size, heads, head): a block's slice of a layer is
# two pieces (K and V) apart in the tensor, so the device side has to gather it.
LAYERS, NB, BS, HEADS, HEAD = 4, 24, 16, 2, 8
DT = torch.bfloat16
SLICE = 2 * BS * HEADS * HEAD * 2  # bytes of one layer of one block
PAGE = LAYERS * SLICE

CUDA = torch.cuda.is_available()
NO_CUDA = "torch here has no usable CUDA device (%s): run on a GPU by `bash .gpu/run.sh suite`" % (
    torch.__version__)


def paged(device: Any, seed: Any) -> Dict[str, Any]:
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    out = {}
    for i in range(LAYERS):
        t = torch.randn((2, NB, BS, HEADS, HEAD), generator=g) if g is not None else \
            torch.zeros((2, NB, BS, HEADS, HEAD))
        out["model.layers.%d.self_attn.attn" % i] = t.to(DT).to(device)
    return out


@pytest.fixture(scope="module")
def gd():
    d = Daemon()
    yield d
    assert d.stop() == 0


_tok = [0]


def toks(pages: int) -> List[int]:
    _tok[0] += 1
    return list(range(_tok[0] * 10000, _tok[0] * 10000 + pages * BS))


def client(d: Daemon) -> Any:
    return d.client("gpucopy", page_size=BS, block_bytes=PAGE)


# == selection ===================================================================================


def test_strategy_choice() -> None:
    assert gpucopy.choose("auto", True) == "register"
    assert gpucopy.choose("auto", False) == "bounce"
    assert gpucopy.choose("register", False) == "bounce", "no runtime library: the pool"
    assert gpucopy.choose("register", True) == "register"
    assert gpucopy.choose("bounce", True) == "bounce"
    assert gpucopy.choose("pageable", True) == "pageable"
    with pytest.raises(ValueError, match="one of auto, register, bounce, pageable"):
        gpucopy.choose("pinned", True)


def test_settings_from_the_environment(monkeypatch: Any) -> None:
    monkeypatch.delenv("KVTIER_GPU_COPY", raising=False)
    monkeypatch.delenv("KVTIER_GPU_BOUNCE_MB", raising=False)
    assert gpucopy.strategy_from_env() == "auto"
    assert gpucopy.bounce_bytes_from_env() == 64 << 20
    monkeypatch.setenv("KVTIER_GPU_COPY", " Bounce ")
    assert gpucopy.strategy_from_env() == "bounce"
    monkeypatch.setenv("KVTIER_GPU_COPY", "fast")
    with pytest.raises(ValueError, match="KVTIER_GPU_COPY='fast'"):
        gpucopy.strategy_from_env()
    monkeypatch.setenv("KVTIER_GPU_BOUNCE_MB", "8")
    assert gpucopy.bounce_bytes_from_env() == 8 << 20
    for bad in ("0", "-1", "8M"):
        monkeypatch.setenv("KVTIER_GPU_BOUNCE_MB", bad)
        with pytest.raises(ValueError, match="a positive number of MiB"):
            gpucopy.bounce_bytes_from_env()


def test_a_cpu_tensor_takes_the_connectors_own_path() -> None:
    assert gpucopy.copier_for(torch.zeros(4)) is None
    assert gpucopy.copier_for(torch.zeros(4, dtype=DT)) is None


def test_cpu_tensors_never_make_a_copier(gd: Daemon) -> None:
    """The layout's copies of CPU tensors (the zero-copy runs and the staging rows) are
    today's: no copier is made, and the bytes round trip."""
    before = gpucopy.copiers()
    kv, back = paged("cpu", 1), paged("cpu", None)
    lay = _Layout(kv, NB)
    blocks = [3, 4, 5, 9]
    with client(gd) as c:
        t = toks(len(blocks))
        r = c.reserve(t, len(blocks))
        runs = lay.runs(list(r.views), blocks)
        for li, n in enumerate(lay.names):
            lay.gather_runs(runs, li, kv[n])
        runs.clear()
        c.commit(r)
        m = c.match(t, lease=True)
        views = c.get_views(m.lease)
        runs = lay.runs(views, blocks)
        for li, n in enumerate(lay.names):
            lay.scatter_runs(runs, li, back[n])
        runs.clear()
        c.release(m.lease)
    for n in kv:
        assert torch.equal(kv[n][:, blocks].view(torch.int16), back[n][:, blocks].view(torch.int16))
    assert gpucopy.copiers() == before


def test_runs_in_memory_order_are_one_segment() -> None:
    """The GPU copies take a layer's slots by their place in memory: runs of pages that follow
    each other at one spacing are one host transfer whatever their block ids; a gap, another
    spacing or a page before the last start a new one."""
    from kvtier.vllm.layout import _Run

    lay = _Layout(paged("cpu", None), NB)

    def run(block: int, n: int, addr: int, stride: int = PAGE) -> Any:
        return _Run(block, n, [], list, addr=addr, stride=stride)

    base = 1 << 30
    runs = [run(9, 1, base), run(3, 2, base + PAGE), run(20, 1, base + 3 * PAGE),
            run(1, 1, base + 5 * PAGE),  # a gap: the spacing changes
            run(2, 1, base + 7 * PAGE),  # the new spacing (2 pages), kept
            run(5, 1, base)]  # back before: a new segment
    blocks, segs, groups = lay._run_rows(runs, 2)
    assert blocks == [9, 3, 4, 20, 1, 2, 5]
    off = 2 * SLICE
    assert segs == [(base + off, PAGE, 4), (base + 5 * PAGE + off, 2 * PAGE, 2),
                    (base + off, PAGE, 1)]
    assert groups == [(0, 3), (3, 5), (5, 6)]
    assert lay._run_rows(runs, 0)[2] == groups, "the same stretches for every layer"


# == the bounce pool ============================================================================


def test_chunks_cover_the_rows_within_the_bound() -> None:
    assert gpucopy.chunks(10, 100, 400) == [(0, 4), (4, 4), (8, 2)]
    assert gpucopy.chunks(3, 100, 50) == [(0, 1), (1, 1), (2, 1)], "a row wider than the pool"
    assert gpucopy.chunks(0, 100, 400) == []


def _host_alloc() -> Any:
    """Pinned memory where torch gives it (it does not without an accelerator: then ordinary
    memory, which exercises the same bound and reuse)."""
    try:
        torch.empty(1, dtype=torch.uint8, pin_memory=True)
        return gpucopy._pinned
    except RuntimeError:
        return lambda n: torch.empty(n, dtype=torch.uint8)


def test_bounce_pool_is_bounded_and_reused() -> None:
    pool = gpucopy.BouncePool(1 << 20, _host_alloc())
    a = pool.take(1000)
    assert pool.allocations == 1 and a.numel() == 1000
    assert pool.take(10).data_ptr() == a.data_ptr(), "a smaller copy reuses the buffer"
    b = pool.take(5 << 20)
    assert b.numel() == 1 << 20, "never more than its bound"
    assert pool.allocations == 2 and pool.nbytes == 1 << 20
    assert pool.take(3 << 20).data_ptr() == b.data_ptr()
    assert pool.take(1).data_ptr() == b.data_ptr()
    assert pool.allocations == 2
    with pytest.raises(ValueError):
        gpucopy.BouncePool(0, _host_alloc())


def test_bounce_pool_out_of_memory_falls_back_to_pageable(caplog: Any) -> None:
    """A pool that cannot be allocated: nothing copied, the copier says "pageable" from then on
    (the caller copies as without gpucopy), and the log names the fall-back."""
    def oom(n: int) -> Any:
        raise RuntimeError("CUDA error: out of memory (%d bytes asked)" % n)

    c = gpucopy.Copier(torch.device("cpu"), "bounce", 1 << 20, alloc=oom)
    kv = torch.ones((4, SLICE), dtype=torch.uint8)
    host = torch.zeros((4, SLICE), dtype=torch.uint8)
    with caplog.at_level(logging.WARNING, logger="kvtier.gpucopy"):
        assert c.to_host(kv, [0, 1, 2, 3], [(host.data_ptr(), SLICE, 4)], SLICE) is False
    assert c.strategy == "pageable"
    assert "copied pageable" in caplog.text
    assert int(host.sum()) == 0
    assert c.to_host(kv, [0, 1], [(host.data_ptr(), SLICE, 2)], SLICE) is False


def _cpu_copier(cap: int) -> Any:
    return gpucopy.Copier(torch.device("cpu"), "bounce", cap,
                          alloc=lambda n: torch.empty(n, dtype=torch.uint8))


@pytest.mark.parametrize("cap", [SLICE * 3, 64 << 20])
def test_bounce_path_round_trip_through_a_reservation(gd: Daemon, cap: int) -> None:
    """The bounce path's batching (device gather of a layer's blocks, one transfer per chunk,
    the rows spread over runs of pages) writes the bytes the connector's own CPU path writes,
    and reads them back into other blocks: with a pool of 3 rows (chunks cutting across runs)
    and one that holds a whole layer."""
    kv, back = paged("cpu", 2), paged("cpu", None)
    lay = _Layout(kv, NB)
    cp = _cpu_copier(cap)
    blocks = [2, 3, 4, 11, 12, 20, 7]  # runs of 3, 2, 1 and 1 pages
    with client(gd) as c:
        ta, tb = toks(len(blocks)), toks(len(blocks))
        ra, rb = c.reserve(ta, len(blocks)), c.reserve(tb, len(blocks))
        runs = lay.runs(list(ra.views), blocks)
        ref = lay.runs(list(rb.views), blocks)
        assert len(runs) >= 2
        for li, n in enumerate(lay.names):
            b, segs, _ = lay._run_rows(runs, li)
            assert cp.to_host(kv[n].movedim(1, 0), b, segs, SLICE, DT)
            lay.gather_runs(ref, li, kv[n])  # the connector's CPU path, for comparison
        runs.clear()
        ref.clear()
        c.commit(ra)
        c.commit(rb)
        ma, mb = c.match(ta, lease=True), c.match(tb, lease=True)
        va, vb = c.get_views(ma.lease), c.get_views(mb.lease)
        assert [bytes(x) for x in va] == [bytes(x) for x in vb], "the same page bytes"
        dest = [NB - 1 - i for i in range(len(blocks))]  # descending: no run
        runs = lay.runs(va, dest)
        for li, n in enumerate(lay.names):
            b, segs, _ = lay._run_rows(runs, li)
            assert cp.to_device(back[n].movedim(1, 0), b, segs, SLICE, DT)
        runs.clear()
        c.release(ma.lease)
        c.release(mb.lease)
    for n in kv:
        assert torch.equal(kv[n][:, blocks].view(torch.int16), back[n][:, dest].view(torch.int16))
    assert cp.transfers >= LAYERS * 2


def test_bounce_path_staging_rows() -> None:
    """The staging path's segment (a layer's slot in each staging page) through the copier:
    the same bytes as the layout's own gather."""
    kv = paged("cpu", 3)
    lay = _Layout(kv, NB)
    cp = _cpu_copier(SLICE * 2)
    blocks = [5, 1, 17]
    mine = torch.zeros((len(blocks), PAGE), dtype=torch.uint8)
    ref = torch.zeros((len(blocks), PAGE), dtype=torch.uint8)
    for li, n in enumerate(lay.names):
        assert cp.to_host(kv[n].movedim(1, 0), blocks, lay._staged(mine, li, len(blocks)),
                          SLICE, DT)
        lay.gather(ref, li, kv[n], blocks)
    assert torch.equal(mine, ref)


class _RowCopies:
    """cudaMemcpy2DAsync's contract on host memory, row by row (memmove): the stand-in for the
    CUDA runtime in the next test, which checks how a copy splits between the straight 2D
    copies and the bounce pool; the real runtime is test_cuda_round_trip_through_the_arena's."""

    def cudaMemcpy2DAsync(self, dst: Any, dpitch: int, src: Any, spitch: int, width: int,
                          rows: int, kind: int, stream: Any) -> int:
        for i in range(rows):
            ctypes.memmove(dst.value + i * dpitch, src.value + i * spitch, width)
        return 0


def test_straight_and_pooled_segments_mixed() -> None:
    """Segments of random sizes and pitches, some pinned (straight 2D copies) and some not (the
    bounce pool, in chunks that cut across segments), blocks shuffled or consecutive: every
    row lands where it belongs, both ways, and no other block is written."""
    rnd = random.Random(5)
    cp = _cpu_copier(SLICE * 3)
    cp._rt, cp.strategy = _RowCopies(), "register"
    for _ in range(60):
        kv = torch.randint(0, 255, (2, NB, SLICE // 2), dtype=torch.uint8)
        kvb = kv.movedim(1, 0)
        n = rnd.randint(1, 12)
        blocks = rnd.sample(range(NB), n) if rnd.random() < 0.5 else list(range(3, 3 + n))
        host = torch.zeros(64 * SLICE, dtype=torch.uint8)
        segs, at, left = [], 0, n
        while left:
            r = rnd.randint(1, left)
            pitch = SLICE * rnd.randint(1, 3)
            segs.append((host.data_ptr() + at, pitch, r))
            at += pitch * r + SLICE * rnd.randint(0, 2)
            left -= r
        pinned = [rnd.random() < 0.5 for _ in segs]
        assert cp.to_host(kvb, blocks, segs, SLICE, None, pinned)
        got = [gpucopy.host_rows(a, p, r, SLICE) for a, p, r in segs]
        assert np.array_equal(np.concatenate(got), kvb[blocks].reshape(n, SLICE).numpy())
        back = torch.zeros_like(kv)
        assert cp.to_device(back.movedim(1, 0), blocks, segs, SLICE, None, pinned)
        assert torch.equal(back[:, blocks], kv[:, blocks])
        others = [i for i in range(NB) if i not in blocks]
        assert int(back[:, others].sum()) == 0


def test_copier_refuses_what_it_cannot_copy() -> None:
    """Another device, another dtype, a block of another size, rows that do not match the
    blocks: a GpuCopyError naming it, nothing written."""
    cp = _cpu_copier(1 << 20)
    host = torch.zeros((2, SLICE), dtype=torch.uint8)
    seg = [(host.data_ptr(), SLICE, 2)]
    kv = paged("cpu", 4)["model.layers.0.self_attn.attn"].movedim(1, 0)
    with pytest.raises(gpucopy.GpuCopyError, match="a tensor on meta"):
        cp.to_host(torch.empty((NB, 2, BS, HEADS, HEAD), dtype=DT, device="meta"), [0, 1], seg,
                   SLICE, DT)
    with pytest.raises(gpucopy.GpuCopyError, match="torch.float16 tensor where the layout has"):
        cp.to_host(kv.to(torch.float16), [0, 1], seg, SLICE, DT)
    with pytest.raises(gpucopy.GpuCopyError, match="block of 256 bytes where the layout has 1024"):
        cp.to_host(kv[:, :, :4], [0, 1], seg, SLICE, DT)
    with pytest.raises(gpucopy.GpuCopyError, match="3 blocks for 2 host rows"):
        cp.to_host(kv, [0, 1, 2], seg, SLICE, DT)
    with pytest.raises(gpucopy.GpuCopyError, match="narrower than a block"):
        cp.to_host(kv, [0, 1], [(host.data_ptr(), SLICE // 2, 2)], SLICE, DT)
    with pytest.raises(gpucopy.GpuCopyError, match="only strided"):
        cp.to_host(kv.to_sparse(), [0, 1], seg, SLICE, DT)
    assert int(host.sum()) == 0 and cp.transfers == 0


# == the registration's arena lookup ============================================================


def test_arena_lookup_finds_the_clients_mapping_only(gd: Daemon) -> None:
    """Only the daemon's arena mappings are ever registered: the lookup finds a client's
    mapping from any address inside it, and nothing for the heap or a tensor."""
    with client(gd) as c:
        assert c.zero_copy, c.zero_copy_reason
        base, size = c._mapping()
        assert gpucopy.arena_of(base) == (base, size)
        assert gpucopy.arena_of(base + size - 1) == (base, size)
        blob = bytearray(PAGE)
        assert gpucopy.arena_of(int(torch.frombuffer(blob, dtype=torch.uint8).data_ptr())) is None
        assert gpucopy.arena_of(torch.zeros(1 << 20).data_ptr()) is None
    assert gpucopy.arena_of(base) is None, "unmapped at close"
    assert gpucopy.registrations() == 0


class _Registrar:
    """cudaHostRegister and cudaHostUnregister's bookkeeping (nothing is pinned): the stand-in
    for the CUDA runtime in the registration tests below; the real one is
    test_cuda_round_trip_through_the_arena's."""

    def __init__(self, rc: int = 0) -> None:
        self.rc = rc
        self.registered: List[int] = []
        self.unregistered: List[int] = []

    def cudaHostRegister(self, addr: Any, n: int, flags: int) -> int:
        if self.rc == 0:
            self.registered.append(addr.value)
        return self.rc

    def cudaHostUnregister(self, addr: Any) -> int:
        self.unregistered.append(addr.value)
        return 0

    def cudaGetLastError(self) -> int:
        return 0

    def cudaGetErrorString(self, rc: int) -> bytes:
        return b"cudaErrorMemoryAllocation" if rc == 2 else b"?"


def test_client_close_undoes_a_registration_in_its_mapping(gd: Daemon) -> None:
    """A registration still open inside a client's mapping when the client closes is undone
    before the mapping goes (a registration must not outlive the memory it pins); one
    elsewhere is left to its holder."""
    rt = _Registrar()
    other = bytearray(PAGE)
    before = gpucopy.registrations()
    with client(gd) as c:
        base, size = c._mapping()
        inside = gpucopy.pin(rt, base + PAGE, PAGE)
        outside = gpucopy.pin(rt, ctypes.addressof(ctypes.c_char.from_buffer(other)), PAGE)
        assert inside is not None and outside is not None
        assert gpucopy.registrations() == before + 2
    assert rt.unregistered == [base + PAGE] and not inside.open
    assert outside.open and gpucopy.registrations() == before + 1
    outside.close()
    outside.close()  # once only
    assert gpucopy.registrations() == before and len(rt.unregistered) == 2


def test_registration_refused_or_overlapping(caplog: Any) -> None:
    """A span that overlaps another registration (cudaErrorHostMemoryAlreadyRegistered) is not
    registered twice: None, and its segment goes through the pool; a registration CUDA refuses
    is a GpuCopyError, and a copier meeting one moves to the bounce pool, saying so."""
    before = gpucopy.registrations()
    assert gpucopy.pin(_Registrar(712), 4096, 4096) is None
    with pytest.raises(gpucopy.GpuCopyError, match="cudaErrorMemoryAllocation"):
        gpucopy.pin(_Registrar(2), 4096, 4096)
    assert gpucopy.registrations() == before
    cp = _cpu_copier(1 << 20)
    cp._rt, cp.strategy = _Registrar(2), "register"
    with caplog.at_level(logging.WARNING, logger="kvtier.gpucopy"):
        assert cp.pin(4096, 4096) is None
    assert cp.strategy == "bounce"
    assert "go through a pinned bounce pool" in caplog.text


# == the vLLM worker: a copy that fails part-way =================================================


def test_vllm_save_whose_copy_fails_part_way_is_aborted(caplog: Any) -> None:
    """A save job whose copy fails after some layers are in the reserved pages (here a layer's
    tensor no longer matches the registered layout) aborts its reservation: nothing becomes
    visible, no reservation is left open until reserve-ms, and the next save goes through."""
    tv = pytest.importorskip("test_vllm", reason="needs vLLM (test_vllm.py's helpers)")
    d = Daemon()
    try:
        a = tv.Engine(d, seed=21)
        names = list(a.kv)
        good = a.kv[names[1]]
        a.worker._kv[names[1]] = good[..., :3].clone()  # 3 of 8 dims: its copy fails
        toks_ = tv.prompt(2)
        r = tv.request(toks_)
        before = tv.zc_stats(d)
        _, meta = tv.schedule(a.sched, r, [1, 2, 3])
        tv.run_step(a.worker, a.kv, meta)
        after = tv.zc_stats(d)
        assert after["requests_reserve"] - before["requests_reserve"] == 1
        assert after["reservations_aborted"] - before["reservations_aborted"] == 1
        assert after["reservations_committed"] == before["reservations_committed"]
        assert tv.resv_open(d) == 0, "no reservation left open"
        assert a.worker._store._holds == 0
        tv.finish(a, r, [1, 2, 3])
        b = tv.Engine(d, seed=None)
        assert b.sched.get_num_new_matched_tokens(tv.request(toks_), 0) == (0, False)
        a.worker._kv[names[1]] = good
        tv.save_prompt(a, tv.request(toks_), [4, 5, 6])
        assert b.sched.get_num_new_matched_tokens(tv.request(toks_), 0) == (2 * tv.BS, False)
        a.close()
        b.close()
    finally:
        d.stop()


# == on a GPU ====================================================================================


def _need_cuda() -> None:
    if not CUDA:
        pytest.skip(NO_CUDA)


@pytest.mark.parametrize("strategy", ["register", "bounce"])
def test_cuda_round_trip_through_the_arena(gd: Daemon, strategy: str,
                                           monkeypatch: Any) -> None:
    """GPU tensor -> arena -> GPU tensor through the vLLM layout's copy code (its zero-copy runs
    and its staging rows), byte for byte, with the strategy forced; with register, the pages'
    span is registered at the first layer's copy and undone when the runs are dropped (before
    the COMMIT or the RELEASE), counted before and after."""
    _need_cuda()
    if strategy == "register" and gpucopy.cudart() is None:
        pytest.skip("no libcudart with cudaMemcpy2DAsync next to this torch")
    monkeypatch.setattr(gpucopy, "_copiers", {})
    monkeypatch.setenv("KVTIER_GPU_COPY", strategy)
    monkeypatch.setenv("KVTIER_GPU_BOUNCE_MB", "1")  # chunks, with the bounce pool
    dev = torch.device("cuda", torch.cuda.current_device())
    kv, back = paged(dev, 5), paged(dev, None)
    lay = _Layout(kv, NB)
    blocks = [2, 3, 4, 11, 12, 20, 7]
    dest = [NB - 1 - i for i in range(len(blocks))]
    regs = gpucopy.registrations()
    with client(gd) as c:
        t = toks(len(blocks))
        r = c.reserve(t, len(blocks))
        runs = lay.runs(list(r.views), blocks)
        for li, n in enumerate(lay.names):
            lay.gather_runs(runs, li, kv[n])
        cp = gpucopy.copier_for(kv[lay.names[0]])
        assert cp is not None and cp.strategy == strategy
        if strategy == "register":  # the pages' span, registered once for every layer
            assert gpucopy.registrations() - regs == len(lay._run_rows(runs, 0)[2])
        else:
            assert gpucopy.registrations() == regs
        runs.clear()  # as the worker does before its COMMIT: the registration undone
        assert gpucopy.registrations() == regs
        c.commit(r)
        m = c.match(t, lease=True)
        views = c.get_views(m.lease)
        for li, n in enumerate(lay.names):  # the pages as the CPU sees them
            host = torch.stack([torch.frombuffer(bytearray(v), dtype=torch.uint8)
                                [li * SLICE:(li + 1) * SLICE] for v in views])
            want = kv[n][:, blocks].movedim(1, 0).contiguous().cpu().view(torch.uint8)
            assert torch.equal(host, want.reshape(len(blocks), -1))
        runs = lay.runs(views, dest)
        for li, n in enumerate(lay.names):
            lay.scatter_runs(runs, li, back[n])
        runs.clear()
        c.release(m.lease)
        staging = torch.zeros((len(blocks), PAGE), dtype=torch.uint8)  # the staging path
        for li, n in enumerate(lay.names):
            lay.gather(staging, li, kv[n], blocks)
        again = paged(dev, None)
        for li, n in enumerate(lay.names):
            lay.scatter(staging, li, again[n], blocks)
    assert gpucopy.registrations() == regs, "none left"
    for n in kv:
        assert torch.equal(kv[n][:, blocks], back[n][:, dest])
        assert torch.equal(kv[n][:, blocks], again[n][:, blocks])
        assert int(back[n][:, [0, 1]].abs().sum()) == 0, "no other block written"


def test_cuda_wrong_dtype_is_refused_and_nothing_committed(gd: Daemon) -> None:
    """On the device: a layer whose dtype is not the registered layout's is refused with a
    GpuCopyError before any byte moves."""
    _need_cuda()
    dev = torch.device("cuda", torch.cuda.current_device())
    kv = paged(dev, 6)
    lay = _Layout(kv, NB)
    with client(gd) as c:
        r = c.reserve(toks(2), 2)
        runs = lay.runs(list(r.views), [0, 1])
        with pytest.raises(gpucopy.GpuCopyError, match="torch.float16 tensor"):
            lay.gather_runs(runs, 0, kv[lay.names[0]].to(torch.float16))
        assert all(not any(bytes(v)) for v in r.views)
        runs.clear()
        c.abort(r)


def test_cuda_tensor_on_another_device_is_refused() -> None:
    _need_cuda()
    if torch.cuda.device_count() < 2:
        pytest.skip("one CUDA device: a tensor on another device needs two")
    cp = gpucopy.Copier(torch.device("cuda", 0), "bounce", 1 << 20)
    kv = torch.zeros((4, SLICE), dtype=torch.uint8, device="cuda:1")
    host = torch.zeros((4, SLICE), dtype=torch.uint8)
    with pytest.raises(gpucopy.GpuCopyError, match="a tensor on cuda:1"):
        cp.to_host(kv, [0], [(host.data_ptr(), SLICE, 1)], SLICE)


def test_cuda_bounce_pool_out_of_pinned_memory_falls_back(caplog: Any) -> None:
    """A bounce pool the machine cannot pin (1 PiB asked of CUDA's pinned allocator): nothing
    copied, the copier falls back to pageable copies and the log says so."""
    _need_cuda()
    dev = torch.device("cuda", torch.cuda.current_device())
    cp = gpucopy.Copier(dev, "bounce", 1 << 20, alloc=lambda n: gpucopy._pinned(1 << 50))
    kv = torch.ones((4, SLICE), dtype=torch.uint8, device=dev)
    host = torch.zeros((4, SLICE), dtype=torch.uint8)
    with caplog.at_level(logging.WARNING, logger="kvtier.gpucopy"):
        assert cp.to_host(kv, [0, 1, 2, 3], [(host.data_ptr(), SLICE, 4)], SLICE) is False
    assert cp.strategy == "pageable" and "copied pageable" in caplog.text
    assert int(host.sum()) == 0
    torch.zeros(1, device=dev).add_(1)  # CUDA still usable: no error left behind


if __name__ == "__main__":
    raise SystemExit(pytest.main([os.path.abspath(__file__), "-v"]))
