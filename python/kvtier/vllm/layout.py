"""kvtier.vllm.layout: vLLM's per-layer paged tensors and kvtierd's pages of all layers, and the
copies between them (through a staging tensor, or straight into and out of kvtierd's mapping)."""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

from .. import gpucopy
from .._lib import ffi, lib

# A CPU tensor's bytes as numpy sees them: an integer type of the element's size (numpy has no
# bfloat16; the copies move bytes, never values).
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NP_INT_OF_SIZE = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}


def _copy_spans() -> Optional[Any]:
    """libkvtier's kvt_copy_spans (one call for a list of memcpys, the GIL released by cffi
    around it), or None: a libkvtier from before it (the copies then go through numpy), or a
    platform where its span is not three 64-bit words (the plans below build them as such)."""
    try:
        fn = lib.kvt_copy_spans
    except AttributeError:  # the header declares it, the library lacks the symbol
        return None
    if ffi.sizeof("kvt_copy_span_t") != 24 or ffi.sizeof("void *") != 8:
        return None
    return fn


_COPY_SPANS = _copy_spans()


def _copy_pages_xxh3() -> Optional[Any]:
    """libkvtier's kvt_copy_pages_xxh3 (a save's spans page by page, each page's XXH3-64 taken
    in the copy: the sums COMMIT carries), or None: a libkvtier from before it (the save then
    commits without sums and the daemon hashes the pages itself)."""
    if _COPY_SPANS is None:
        return None
    try:
        return lib.kvt_copy_pages_xxh3
    except AttributeError:
        return None


_COPY_PAGES_XXH3 = _copy_pages_xxh3()


def page_sums(addrs: List[int], page_bytes: int) -> Optional[np.ndarray]:
    """The XXH3-64 (seed 0) of each page of ``page_bytes`` bytes at ``addrs`` (in order): the
    sums COMMIT carries for pages a save copied without taking them (numpy's copies, a CUDA
    tensor's), so that the daemon does not hash the pages on its loop after COMMIT's reply.
    Taken by kvt_copy_pages_xxh3 copying each page into one scratch page (a page at a time:
    it hashes as it writes, and pages of one call would be written over each other), or None
    without it in libkvtier (the daemon then hashes them, as before)."""
    if _COPY_PAGES_XXH3 is None or not addrs or page_bytes <= 0:
        return None
    scratch = np.empty(page_bytes, dtype=np.uint8)
    span = np.array([[scratch.ctypes.data, 0, page_bytes]], dtype=np.uint64)
    sp = ffi.cast("kvt_copy_span_t *", span.ctypes.data)
    sums = np.empty(len(addrs), dtype=np.uint64)
    out = ffi.cast("uint64_t *", sums.ctypes.data)
    for i, a in enumerate(addrs):
        span[0, 1] = a
        rc = _COPY_PAGES_XXH3(sp, 1, 1, out + i)
        if rc != 0:
            raise OSError("kvt_copy_pages_xxh3: %d" % rc)
    return sums


def _np(t: torch.Tensor) -> Optional[np.ndarray]:
    """``t``'s memory as a numpy array of the same shape and strides, or None (a CUDA tensor,
    an element size numpy has no integer for). numpy copies a strided block in one call, on
    the calling thread, without torch's per-call overhead or its OpenMP parallel region (see
    _Layout._chunk), and releases the GIL while it copies."""
    it = _INT_OF_SIZE.get(t.element_size())
    if it is None or t.device.type != "cpu":
        return None
    return t.view(it).numpy()


class _Layout:
    """Where each layer's slice of a block lies inside a page of all layers.

    A layer's tensor has a block dimension (the one of size num_blocks: dim 1 in the
    (2, num_blocks, block_size, heads, head_size) layout of FlashAttention and the CPU backend,
    dim 0 in (num_blocks, ...) layouts such as MLA's or FlashInfer's); one block of it is the
    rest of the tensor. A page is those block slices of every layer, in registration order."""

    def __init__(self, kv_caches: Dict[str, torch.Tensor], num_blocks: Optional[int]) -> None:
        self.names: List[str] = list(kv_caches)
        self.index = {n: i for i, n in enumerate(self.names)}
        self.dims: List[int] = []
        self.shapes: List[Tuple[int, ...]] = []
        self.offsets: List[int] = []
        self.sizes: List[int] = []
        self.dtypes: List[torch.dtype] = []
        off = 0
        for n in self.names:
            t = kv_caches[n]
            dim = 0
            if num_blocks is not None and t.dim() > 1 and t.shape[0] != num_blocks and \
                    t.shape[1] == num_blocks:
                dim = 1
            elif num_blocks is None and t.dim() == 5 and t.shape[0] == 2:
                dim = 1
            shape = tuple(t.select(dim, 0).shape)
            size = t.select(dim, 0).numel() * t.element_size()
            self.dims.append(dim)
            self.dtypes.append(t.dtype)
            self.shapes.append(shape)
            self.offsets.append(off)
            self.sizes.append(size)
            off += size
        self.page_bytes = off
        # Every layer's slot alike, back to back (runs() then sees a run as one array).
        self._uniform = len(set(self.dtypes)) == 1 and len(set(self.shapes)) == 1 and \
            all(o == i * self.sizes[0] for i, o in enumerate(self.offsets))
        ints = [_NP_INT_OF_SIZE.get(d.itemsize) for d in self.dtypes]
        self._ints: Optional[List[Any]] = None if any(i is None for i in ints) else ints
        self._inner: List[int] = []  # a uniform slot's strides in bytes
        if self.shapes:
            shape, es = self.shapes[0], self.dtypes[0].itemsize
            self._inner = [es] * len(shape)
            for i in range(len(shape) - 2, -1, -1):
                self._inner[i] = self._inner[i + 1] * shape[i + 1]
        self._np_kv: Dict[int, Tuple[Any, Optional[np.ndarray]]] = {}  # _blocks_np's
        self._tensor_spans: Optional[Tuple[Any, Any]] = None  # plan's (_tensor_rows)
        self._save_offsets: Optional[Tuple[Any, Any]] = None  # save_plan's (_save_rows)
        self._offsets_np = np.array(self.offsets, dtype=np.uint64)
        self.signature = ";".join("%s%s@%d" % (str(kv_caches[n].dtype).replace("torch.", ""),
                                               "x".join(map(str, s)), d)
                                  for n, s, d in zip(self.names, self.shapes, self.dims))

    def _slot(self, staging: torch.Tensor, layer: int, dtype: torch.dtype) -> torch.Tensor:
        o, s = self.offsets[layer], self.sizes[layer]
        v = staging[:, o:o + s].view(dtype)
        return v.view(staging.shape[0], *self.shapes[layer])

    # A CUDA tensor's copies go through kvtier.gpucopy (pinned memory, one transfer per run of
    # pages per layer, on its own stream, done when the call returns); a CPU tensor's, or a
    # CUDA one's with gpucopy's strategy "pageable", are the ones below.
    def _gpu(self, layer: int, kv: torch.Tensor, blocks: List[int],
             segments: List[gpucopy.Segment], out: bool,
             pinned: Optional[List[bool]] = None) -> bool:
        """Whether gpucopy made this layer's copy (False: not a CUDA tensor, or pageable)."""
        c = gpucopy.copier_for(kv)
        if c is None:
            return False
        kvb = kv.movedim(self.dims[layer], 0)
        if out:
            return c.to_host(kvb, blocks, segments, self.sizes[layer], self.dtypes[layer],
                             pinned)
        return c.to_device(kvb, blocks, segments, self.sizes[layer], self.dtypes[layer],
                           pinned)

    def _gpu_runs(self, runs: List[_Run], layer: int, kv: torch.Tensor, out: bool) -> bool:
        """_gpu for runs of pages in the mapping: each stretch of them registered with CUDA
        (register strategy) at the job's first copy, for every layer after it; the Pin goes
        with the runs, which the worker drops before its COMMIT or RELEASE."""
        c = gpucopy.copier_for(kv)
        if c is None:
            return False
        blocks, segs, groups = self._run_rows(runs, layer)
        pinned = None
        if c.strategy == "register":
            pinned = [self._pinned(c, runs[a:b]) for a, b in groups]
        return self._gpu(layer, kv, blocks, segs, out, pinned)

    def _pinned(self, c: gpucopy.Copier, group: List[_Run]) -> bool:
        """Whether a stretch of runs (one segment's) lies in a registration, made on first
        use: from its first page to the end of its last."""
        if group[0].pin is None:
            last = group[-1]
            end = last.addr + (last.n - 1) * last.stride + self.page_bytes
            p = c.pin(group[0].addr, end - group[0].addr)
            for r in group:
                r.pin = p if p is not None else False
        return bool(group[0].pin)

    def _staged(self, staging: torch.Tensor, layer: int, rows: int) -> List[gpucopy.Segment]:
        """This layer's slot in the first ``rows`` staging pages, as one host segment."""
        if staging.is_cuda:
            raise gpucopy.GpuCopyError(gpucopy.EINVAL, "a staging buffer on the device")
        return [(staging.data_ptr() + self.offsets[layer],
                 staging.stride(0) * staging.element_size(), rows)]

    def _run_rows(self, runs: List[_Run], layer: int
                  ) -> Tuple[List[int], List[gpucopy.Segment], List[Tuple[int, int]]]:
        """The runs' blocks, this layer's slots in their pages as host segments, and which
        runs each segment takes ([a, b) of ``runs``). Runs that follow each other in memory
        at one spacing are one segment whatever their block ids (a run needs consecutive
        blocks; the device gathers any): vLLM's block ids are seldom consecutive, a
        reservation's pages often are. Which runs merge does not depend on the layer."""
        blocks = [b for r in runs for b in range(r.block, r.block + r.n)]
        off = self.offsets[layer]
        segs: List[gpucopy.Segment] = []
        groups: List[Tuple[int, int]] = []
        for i, r in enumerate(runs):
            a = r.addr + off
            if segs:
                pa, pd, pn = segs[-1]
                d = pd if pn > 1 else a - pa
                if d >= self.page_bytes and a == pa + pn * d and (r.n == 1 or r.stride == d):
                    segs[-1] = (pa, d, pn + r.n)
                    groups[-1] = (groups[-1][0], i + 1)
                    continue
            segs.append((a, r.stride, r.n))
            groups.append((i, i + 1))
        return blocks, segs, groups

    # One copy per block: index_select / index_copy_ over the block dimension measured 10-25x
    # slower on CPU (bf16, 64 KiB slices: 0.1-0.4 against 1-2.8 GiB/s).
    def gather(self, staging: torch.Tensor, layer: int, kv: torch.Tensor,
               blocks: List[int]) -> None:
        """Copies this layer's slice of each block in ``blocks`` into the staging pages."""
        if kv.is_cuda and self._gpu(layer, kv, blocks,
                                    self._staged(staging, layer, len(blocks)), True):
            return
        dst, dim = self._slot(staging, layer, kv.dtype), self.dims[layer]
        a, d = _np(kv), _np(dst)
        if a is not None and d is not None:
            a = np.moveaxis(a, dim, 0)
            for j, b in enumerate(blocks):
                np.copyto(d[j], a[b])
            return
        for j, b in enumerate(blocks):
            dst[j].copy_(kv.select(dim, b))

    def scatter(self, staging: torch.Tensor, layer: int, kv: torch.Tensor,
                blocks: List[int]) -> None:
        """Copies this layer's slice of the staging pages into the blocks of ``kv``."""
        if kv.is_cuda and self._gpu(layer, kv, blocks,
                                    self._staged(staging, layer, len(blocks)), False):
            return
        src, dim = self._slot(staging, layer, kv.dtype), self.dims[layer]
        a, d = _np(kv), _np(src)
        if a is not None and d is not None:
            a = np.moveaxis(a, dim, 0)
            for j, b in enumerate(blocks):
                np.copyto(a[b], d[j])
            return
        for j, b in enumerate(blocks):
            kv.select(dim, b).copy_(src[j])

    # The zero-copy path: a page is a view into kvtierd's mapping (or bytes that came through
    # the socket), not a row of a staging tensor. Pages whose blocks are consecutive and whose
    # places in the mapping are equally spaced (a reservation's room and a GET's pages often
    # are) form a run, one strided tensor over the mapping: a layer of a run is then one copy
    # instead of one per block (a copy_ of one block's 64 KiB layer costs about as much in call
    # overhead as in bytes moved). The tensors are made once, on the I/O thread.
    def runs(self, items: List[Any], blocks: List[int]) -> List[_Run]:
        """``items[j]`` (a memoryview into the mapping, or bytes) holds the page of block
        ``blocks[j]``: returns them as runs, each with every layer's slot of its pages. Made
        on every load and save before the first copy (0.15 ms for bench_vllm's 32 pages in
        12 runs when each run made a numpy array per layer; now one per run, and the
        addresses without a Python call each): the layers' views are taken at the copy.
        The arrays are made over the addresses through ctypes: they borrow no buffer export
        (the cdata of ffi.from_buffer is dropped at once), so that commit() can release a
        reservation's views, and a load's read-only views are read without torch's warning
        about writes (the connector only reads those)."""
        out: List[_Run] = []
        es = self.dtypes[0].itemsize if self.dtypes else 1
        uniform, pb = self._uniform, self.page_bytes
        cast, frombuf = ffi.cast, ffi.from_buffer
        addrs = [int(cast("uintptr_t", frombuf(x))) for x in items]
        mapped = [isinstance(x, memoryview) for x in items]
        j, n_items = 0, len(items)
        while j < n_items:
            k, d = j + 1, pb
            if uniform and mapped[j]:
                while k < n_items and mapped[k] and blocks[k] == blocks[k - 1] + 1:
                    step = addrs[k] - addrs[k - 1]
                    if (k > j + 1 and step != d) or step < pb or step % es:
                        break
                    d = step
                    k += 1
            out.append(_Run(blocks[j], k - j, self._run_arrays(addrs[j], k - j, d, uniform),
                            functools.partial(self._run_slots, addrs[j], k - j, d, uniform),
                            addr=addrs[j], stride=d))
            j = k
        return out

    def _run_arrays(self, addr: int, n: int, stride: int, uniform: bool) -> Optional[Any]:
        """A run's slots as numpy over the same memory (for the CPU copies), indexed by layer
        (each (n, *that layer's block shape)), or None where a layer's element size has no
        numpy integer. Made straight from the address: a torch tensor per slot costs several
        microseconds each, 32 per run."""
        if self._ints is None:
            return None
        mem = (ctypes.c_ubyte * ((n - 1) * stride + self.page_bytes)).from_address(addr)
        if not uniform:  # one page (n 1): each layer's slice by its own offset, dtype, shape
            page = np.frombuffer(mem, dtype=np.uint8)
            return [page[o:o + sz].view(i).reshape(1, *shape) for o, sz, i, shape in
                    zip(self.offsets, self.sizes, self._ints, self.shapes)]
        # (layers, n, *shape) over the memory; its rows are the layers' slots (one array per
        # run: a view per layer is taken by the copy that uses it).
        return np.ndarray((len(self.names), n, *self.shapes[0]), dtype=self._ints[0],
                          buffer=mem, strides=(self.sizes[0], stride, *self._inner))

    def _run_slots(self, addr: int, n: int, stride: int, uniform: bool) -> List[torch.Tensor]:
        span = (n - 1) * stride + self.page_bytes
        mem = (ctypes.c_ubyte * span).from_address(addr)
        if not uniform:  # one page (n 1): each layer's slice by its own offset, dtype, shape
            page = torch.frombuffer(mem, dtype=torch.uint8)
            return [page[o:o + sz].view(d).view(1, *shape) for o, sz, d, shape in
                    zip(self.offsets, self.sizes, self.dtypes, self.shapes)]
        d, shape = self.dtypes[0], self.shapes[0]
        es = d.itemsize
        inner = [1] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            inner[i] = inner[i + 1] * shape[i + 1]
        t = torch.frombuffer(mem, dtype=d).as_strided(
            (n, len(self.names), *shape), (stride // es, self.sizes[0] // es, *inner))
        return list(t.unbind(1))

    def plan(self, runs: List[_Run], kvs: List[torch.Tensor], load: bool) -> Optional[_Plan]:
        """A load's (``load``) or a save's copies of every layer of ``runs`` as memcpy spans,
        one kvt_copy_spans call a layer (_Plan), or None where they cannot be (the copies then
        go through scatter_runs / gather_runs): no kvt_copy_spans in libkvtier, a CUDA tensor,
        layers not alike, a tensor whose block slice is not contiguous rows, a block outside
        a tensor. ``kvs[i]`` is layer i's tensor. bench_vllm's 32 pages lie in 12 runs: 384
        numpy copies a load, each with its call's overhead and the GIL handed over, against
        32 C calls here, made with the GIL released (docs/benchmarks.md: 0.13-0.23 ms less
        a load, plan included). Each span is one page's
        contiguous piece of a layer's slot (the slot's rows before the block dimension: K and
        V for (2, num_blocks, ...)), built with numpy for all layers at once (0.05-0.1 ms for
        bench_vllm's 2048 spans)."""
        fn = _COPY_SPANS
        if fn is None or not runs or not self._uniform or len(kvs) != len(self.names):
            return None
        got = self.prepare(kvs)
        if got is None:
            return None
        bases, sd, outer, inner, nb = got
        bl = [b for r in runs for b in range(r.block, r.block + r.n)]
        if min(bl) < 0 or max(bl) >= nb:  # numpy's copies raise IndexError for these
            return None
        blocks = np.array(bl, dtype=np.uint64)
        pages = np.array([r.addr + i * r.stride for r in runs for i in range(r.n)],
                         dtype=np.uint64)
        nl, no, npg = len(kvs), len(outer), len(pages)
        tens = (bases[:, None, None] + outer[None, :, None]
                + (blocks * np.uint64(sd))[None, None, :])
        mine = (pages[None, None, :] + self._offsets_np[:, None, None]
                + (np.arange(no, dtype=np.uint64) * np.uint64(inner))[None, :, None])
        spans = np.empty((nl, no, npg, 3), dtype=np.uint64)
        # a layer's spans in the tensor's row order (K's blocks, then V's): numpy's walk of
        # vLLM's side in memory order was the faster one (docs/benchmarks.md)
        spans[..., 0], spans[..., 1] = (tens, mine) if load else (mine, tens)
        spans[..., 2] = inner
        return _Plan(fn, spans.reshape(nl, no * npg, 3), npg)

    def save_plan(self, addrs: Any, blocks: List[int], kvs: List[torch.Tensor]
                  ) -> Optional[_Plan]:
        """A sealed save's copies straight from vLLM's blocks ``blocks`` into the pages at
        ``addrs`` (a reservation's room, a page each, in page order), built in
        kvt_copy_pages_xxh3's order (each page's layers and their rows back to back) for
        copy_sums, or None where plan() would give none (the save then takes runs() and
        plan()). No runs and no numpy arrays over the mapping are made, nor spans reordered
        at the copy: per save two broadcasts over the tensors' (layer, row) offsets, kept from
        save to save with the tensors' view (_save_rows). bench_vllm's warm save spent about
        0.25 ms building its 12 runs and their plan (docs/benchmarks.md)."""
        if _COPY_SPANS is None or _COPY_PAGES_XXH3 is None or not blocks or \
                not self._uniform or len(kvs) != len(self.names) or len(addrs) != len(blocks):
            return None
        got = self._save_rows(kvs)
        if got is None:
            return None
        theirs, mine, sd, inner, nb = got
        b = np.array(blocks, dtype=np.int64)
        if int(b.min()) < 0 or int(b.max()) >= nb:  # numpy's copies raise IndexError
            return None
        npg = len(blocks)
        spans = np.empty((npg, len(mine), 3), dtype=np.uint64)
        np.add(np.array(addrs, dtype=np.uint64)[:, None], mine[None, :], out=spans[..., 0])
        np.add((b.astype(np.uint64) * np.uint64(sd))[:, None], theirs[None, :],
               out=spans[..., 1])
        spans[..., 2] = inner
        return _Plan(_COPY_SPANS, spans, npg, paged=True)

    def _save_rows(self, kvs: List[torch.Tensor]) -> Optional[Tuple[Any, Any, int, int, int]]:
        """save_plan's offsets, made once per view of the tensors (prepare's): each (layer,
        row) of a page in page order, its address in the tensors less the block's offset
        (theirs) and its offset in the page (mine), with the block stride, a row's bytes and
        the blocks a tensor has."""
        got = self.prepare(kvs)
        if got is None:
            return None
        cached = self._save_offsets
        if cached is not None and cached[0] is got:
            return cached[1]
        bases, sd, outer, inner, nb = got
        no = len(outer)
        theirs = (bases[:, None] + outer[None, :]).reshape(-1)
        mine = (self._offsets_np[:, None]
                + np.arange(no, dtype=np.uint64)[None, :] * np.uint64(inner)).reshape(-1)
        rows = (theirs, mine, sd, inner, nb)
        self._save_offsets = (got, rows)
        return rows

    def prepare(self, kvs: List[torch.Tensor]) -> Optional[Tuple[Any, int, Any, int, int]]:
        """plan's view of vLLM's tensors ``kvs`` (_tensor_rows), made now and kept while they
        stay: the worker makes it when vLLM registers them, not in the first step."""
        key = tuple(kv.data_ptr() for kv in kvs)
        got = self._tensor_spans
        if got is None or got[0] != key:
            got = self._tensor_spans = (key, self._tensor_rows(kvs))
        return got[1]

    def _tensor_rows(self, kvs: List[torch.Tensor]) -> Optional[Tuple[Any, int, Any, int, int]]:
        """plan's view of vLLM's tensors, kept while they stay (vLLM passes the same ones step
        after step): each layer's address, the block dimension's stride, the offsets of a
        block's rows (the dims before the block one) and a row's bytes, all in bytes, and the
        blocks a tensor has; None where the spans cannot describe them (see plan)."""
        d = self.dims[0]
        if any(x != d for x in self.dims):
            return None
        es, shape = self.dtypes[0].itemsize, self.shapes[0]
        bases, common = [], None
        for kv in kvs:
            if kv.device.type != "cpu" or kv.dtype != self.dtypes[0] or \
                    kv.dim() != len(shape) + 1 or \
                    tuple(kv.shape[:d]) + tuple(kv.shape[d + 1:]) != shape:
                return None
            st = kv.stride()
            want, acc = [], 1  # the dims after the block dim contiguous
            for i in range(kv.dim() - 1, d, -1):
                want.append(acc)
                acc *= kv.shape[i]
            if list(st[d + 1:]) != want[::-1]:
                return None
            o = [0]  # the rows before it, each row's offset in row order
            for i in range(d - 1, -1, -1):
                o = [k * st[i] * es + b for k in range(kv.shape[i]) for b in o]
            this = (st[d] * es, tuple(o), acc * es, kv.shape[d])
            if common is None:
                common = this
            elif this != common:
                return None
            bases.append(kv.data_ptr())
        if common is None:
            return None
        sd, outer, inner, nb = common
        return (np.array(bases, dtype=np.uint64), sd, np.array(outer, dtype=np.uint64), inner,
                nb)

    def _chunk(self, layer: int, kv: torch.Tensor) -> int:
        """Blocks per copy_. A CUDA copy: the whole run (one transfer instead of one per
        block). A CPU copy: as many as stay under torch's parallel grain (32768 elements),
        because a larger one runs in an OpenMP parallel region, which on a machine with every
        core busy stalled for scheduler slices (bench_vllm passes of 1-3 s instead of 10 ms,
        gone with OMP_NUM_THREADS=1); a 64 KiB bf16 layer slice is one block per copy."""
        if kv.is_cuda:
            return 1 << 30
        return max(1, 32768 // max(1, self.sizes[layer] // self.dtypes[layer].itemsize))

    def _blocks_np(self, layer: int, kv: torch.Tensor) -> Optional[np.ndarray]:
        """``kv`` as numpy, in its own axis order (None: not on the CPU), kept per layer while
        vLLM passes the same tensor (it does, step after step)."""
        key = (kv.data_ptr(), kv.shape, kv.stride(), kv.dtype)
        got = self._np_kv.get(layer)
        if got is not None and got[0] == key:
            return got[1]
        a = _np(kv)
        self._np_kv[layer] = (key, a)
        return a

    def _copy_np(self, runs: List[_Run], layer: int, kv: torch.Tensor, load: bool) -> bool:
        """The CPU copies of gather_runs (load False) and scatter_runs (load True) in numpy,
        one per run. The run's pages are seen with their block axis where vLLM's tensor has
        it, and vLLM's blocks in its tensor's own axis order, so that numpy walks vLLM's side
        in memory order: with the block dimension second ((2, num_blocks, ...)), a copy of
        the block-major view crossed K and V block by block (3.49-3.54 ms against 3.28-3.34
        for bench_vllm's 64 MiB from a memfd mapping into torch tensors, min of 60; memcpy
        2.95-2.97). False (nothing copied) where numpy cannot: a CUDA tensor, an element size
        without a numpy integer."""
        a = self._blocks_np(layer, kv)
        if a is None or self._ints is None:  # then no run has arrays
            return False
        d = self.dims[layer]
        copyto = np.copyto
        for r in runs:  # 12 runs a layer in bench_vllm: no call here but the copy's
            m = r._moved
            if m is None or m[0] != d:
                if not isinstance(r.arrays, np.ndarray):  # one page, layers of other shapes
                    theirs = np.moveaxis(r.arrays[layer], 0, d)
                    mine = a[(slice(None),) * d + (slice(r.block, r.block + r.n),)]
                    copyto(mine, theirs) if load else copyto(theirs, mine)
                    continue
                m = r.moved(d)
            if load:
                copyto(a[m[2]], m[1][layer])
            else:
                copyto(m[1][layer], a[m[2]])
        return True

    def gather_runs(self, runs: List[_Run], layer: int, kv: torch.Tensor,
                    plan: Optional[_Plan] = None) -> None:
        """Copies this layer of each run's blocks straight into its pages' slots: with a
        save's ``plan`` (plan(runs, ..., load=False)) one kvt_copy_spans call; else on the CPU
        one numpy copy per run (bench_vllm: about twice torch's copy_ of one block at a time,
        docs/benchmarks.md); on a GPU through kvtier.gpucopy, one transfer per run)."""
        if plan is not None:
            plan.copy(layer)
            return
        if kv.is_cuda and self._gpu_runs(runs, layer, kv, True):
            return
        if self._copy_np(runs, layer, kv, load=False):
            return
        dim, step = self.dims[layer], self._chunk(layer, kv)
        for r in runs:
            src, dst = kv.narrow(dim, r.block, r.n).movedim(dim, 0), r.slots[layer]
            if r.n <= step:
                dst.copy_(src)
                continue
            for a in range(0, r.n, step):
                dst[a:a + step].copy_(src[a:a + step])

    def scatter_runs(self, runs: List[_Run], layer: int, kv: torch.Tensor,
                     plan: Optional[_Plan] = None) -> None:
        """Copies this layer of each run's pages straight into its blocks of ``kv`` (with a
        load's ``plan`` one kvt_copy_spans call; else on the CPU one numpy copy per run, as
        gather_runs)."""
        if plan is not None:
            plan.copy(layer)
            return
        if kv.is_cuda and self._gpu_runs(runs, layer, kv, False):
            return
        if self._copy_np(runs, layer, kv, load=True):
            return
        dim, step = self.dims[layer], self._chunk(layer, kv)
        for r in runs:
            dst, src = kv.narrow(dim, r.block, r.n).movedim(dim, 0), r.slots[layer]
            if r.n <= step:
                dst.copy_(src)
                continue
            for a in range(0, r.n, step):
                dst[a:a + step].copy_(src[a:a + step])


@dataclass
class _Run:
    """Pages of consecutive blocks from ``block`` on, equally spaced in memory.

    ``arrays``: each layer's slice of the pages, (n, *that layer's block shape), as numpy
    arrays (the CPU copies; empty where numpy has no integer of an element's size); ``slots``
    the same as torch tensors, made on first use (the CUDA copies)."""

    block: int
    n: int
    arrays: Optional[Any]  # indexed by layer; None: no numpy integer of an element's size
    make_slots: Callable[[], List[torch.Tensor]]
    _slots: Optional[List[torch.Tensor]] = None
    addr: int = 0  # where the first page lies, and the pages' spacing (the GPU copies)
    stride: int = 0
    pin: Any = None  # gpucopy.Pin of the pages (False: none to be had), dropped with the run
    # (block dim, the arrays with their block axis there, the index of the run's blocks in a
    # tensor with that dim), made at the first copy
    _moved: Any = None

    def moved(self, d: int) -> Tuple[int, Any, Tuple[slice, ...]]:
        """(``d``, each layer's slots of the run's pages with their block axis at ``d``, where
        vLLM's tensor has it, the index of the run's blocks in a tensor with that block dim):
        numpy then walks vLLM's side in memory order (with the block dimension second,
        (2, num_blocks, ...), the block-major view crossed K and V block by block: 3.49-3.54 ms
        against 3.28-3.34 for bench_vllm's 64 MiB, min of 60). Made once a run, not once a
        layer (12 runs of 32 layers a step in bench_vllm), and kept as one tuple set at once:
        the forward and the I/O thread both copy a load's layers."""
        arr = self.arrays  # (layers, n, ...) (a run of pages whose layers are alike)
        mine = (slice(None),) * d + (slice(self.block, self.block + self.n),)
        # The block axis to d + 1, then a list of the layers' views made in one call (half
        # the cost of indexing one at each copy).
        m = self._moved = (d, list(arr if d == 0 else np.moveaxis(arr, 1, d + 1)), mine)
        return m

class _Plan:
    """A load's or a save's copies as kvt_copy_spans spans, (layers, spans, 3) words of (dst,
    src, len): copy(layer) is one C call, cffi releasing the GIL around it. Valid while the
    runs' memory and the tensors are (the views' lease or reservation, vLLM's caches)."""

    def __init__(self, fn: Any, spans: np.ndarray, pages: int = 0, paged: bool = False) -> None:
        self.fn = fn
        self.spans = spans  # kept alive: ptr points into it
        self.n = spans.shape[1]
        self.pages = pages  # the runs' pages, in the runs' order
        # (pages, spans of a page, 3) in copy_sums' order (save_plan's): copy_sums only
        self.paged = paged
        self.ptr = ffi.cast("kvt_copy_span_t *", spans.ctypes.data)

    def copy(self, layer: int) -> None:
        if self.paged:
            raise ValueError("a page-ordered plan copies through copy_sums")
        rc = self.fn(self.ptr + layer * self.n, self.n)
        if rc != 0:
            raise OSError("kvt_copy_spans: %d" % rc)

    @property
    def sums(self) -> bool:
        """Whether copy_sums() can be had: a save's plan (the pages its spans' dsts) and a
        libkvtier with kvt_copy_pages_xxh3."""
        return _COPY_PAGES_XXH3 is not None and self.pages > 0

    def copy_sums(self) -> np.ndarray:
        """A save's copies of every layer at once, page by page (each page's layers and their
        rows in order, back to back in the mapping), each page's XXH3-64 (seed 0) taken in the
        same pass (kvt_copy_pages_xxh3): returns them, one uint64 per page in the runs' order,
        the sums COMMIT carries for a sealed reservation. The same bytes land as with copy()
        of each layer; the daemon then does not hash the pages after COMMIT's reply."""
        nl, npg = self.spans.shape[0], self.pages
        if self.paged:  # save_plan's: in that order already
            per = self.spans.reshape(-1, 3)
        else:  # (layers, rows x pages) in (layer, row, page) order to (page, layer, row)
            per = np.ascontiguousarray(
                self.spans.reshape(nl, -1, npg, 3).transpose(2, 0, 1, 3)).reshape(-1, 3)
        sums = np.empty(npg, dtype=np.uint64)
        rc = _COPY_PAGES_XXH3(ffi.cast("kvt_copy_span_t *", per.ctypes.data), per.shape[0],
                              per.shape[0] // npg, ffi.cast("uint64_t *", sums.ctypes.data))
        if rc != 0:
            raise OSError("kvt_copy_pages_xxh3: %d" % rc)
        return sums


@dataclass
class _Views:
    """What a load through the mapping got: the pages' slots (each layer's slice of each page,
    in the mapping or in bytes that came through the socket), valid while ``lease`` holds."""

    lease: int
    pages: int
    runs: List[_Run]
    items: List[Any]  # the views and bytes the runs lie in, kept alive with them
    plan: Optional[_Plan] = None  # the runs' copies into vLLM's blocks in C (None: numpy's)
