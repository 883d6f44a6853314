"""gpucopy.py: copies between an engine's paged CUDA tensors and kvtier's host pages (the zero-copy
mapping of the daemon's arena, or a staging buffer) through pinned memory, one host transfer per
run of equally spaced pages per layer, on a CUDA stream of the copier's own.

A copy takes one layer: its tensor with the block dimension first (``kv``), the blocks, and the
host rows they go to or come from, as segments ``(addr, pitch, rows)``: ``rows`` rows of
``width`` bytes, ``pitch`` bytes apart (a run of pages in the mapping is one segment, its pitch
the pages' spacing, its address the layer's offset in the first page). On the device the
layer's blocks are gathered (``index_select``) into, or scattered (``index_copy_``) from, one
contiguous staging tensor (none when the blocks are consecutive and already contiguous), so each
segment is one host transfer whatever the engine's block layout. Two strategies:

- ``register``: the pages' span is registered with CUDA (``cudaHostRegister``, portable) while
  a reservation or a lease holds them (Pin: made at a job's first copy, undone when the job
  drops its runs, before its COMMIT or RELEASE), and each segment is one ``cudaMemcpy2DAsync``
  straight between the device and the pages. Not the whole mapping, once: see "Why a span" below.
- ``bounce``: a pinned buffer of at most ``bounce_bytes`` (``KVTIER_GPU_BOUNCE_MB``, 64 MiB),
  made once and reused: the rows go through it in chunks (one device-to-host copy, then numpy
  copies into the pages' places; or the reverse).

Why a span, not the whole mapping once: the daemon's arenas are sparse memfds whose freed pages
it punches out (tiers/dram.c; within about a second). A registration pins the physical pages it
found: a page punched after it leaves the file, and a later block at that place lives in a new
page while the registration, and every copy through it, still points at the old one: the bytes
would go nowhere. Registering the whole mapping would also make all of it resident (an arena is
as large as the DRAM region). A span held by a reservation or a lease is live blocks, which the
daemon never punches.

The copies run on the copier's stream; an event recorded after them is synchronised before the
call returns, so the caller commits a reservation or releases a lease only once the bytes are
in. A failure part-way synchronises the stream first (no transfer goes on into memory the
caller then gives back) and raises GpuCopyError: the caller aborts the reservation.

Selection (``copier_for``): a CPU tensor, or a torch without CUDA: None, the caller's own path,
unchanged. ``KVTIER_GPU_COPY`` (``auto``, the default, ``register``, ``bounce`` or
``pageable``): ``auto`` is ``register`` where the CUDA runtime library can be loaded (the one
torch loaded) and ``bounce`` where it cannot (logged once); a registration CUDA refuses moves
that copier to ``bounce`` (logged once; a span sharing a page with another registration goes
through the pool alone); a bounce pool that cannot be allocated (out of pinned
memory) moves it to ``pageable``, the caller's own path (torch's pageable copies; logged once).
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import logging
import os
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .errors import EINVAL, InvalidArgument

log = logging.getLogger(__name__)

STRATEGIES = ("auto", "register", "bounce", "pageable")
BOUNCE_BYTES = 64 << 20
# cudaHostRegisterPortable: the registration serves every device's context, not only the one
# current when it was made. cudaErrorHostMemoryAlreadyRegistered: someone else (the engine)
# registered the range: it is pinned, and not ours to undo.
_PORTABLE = 1
_ALREADY = 712
_H2D, _D2H = 1, 2
_ARENA_TAG = "memfd:kvtier-ns-"

Segment = Tuple[int, int, int]  # (address, pitch in bytes, rows)


class GpuCopyError(InvalidArgument):
    """A copy between an engine tensor and host pages that cannot be made (a tensor on another
    device, an unexpected dtype or layout) or that failed part-way (its CUDA error). Nothing
    the copy wrote may be committed."""


def strategy_from_env() -> str:
    """The strategy KVTIER_GPU_COPY asks for (auto when unset). Raises ValueError naming the
    accepted values for any other."""
    s = os.environ.get("KVTIER_GPU_COPY", "auto").strip().lower() or "auto"
    if s not in STRATEGIES:
        raise ValueError("KVTIER_GPU_COPY=%r: one of %s" % (s, ", ".join(STRATEGIES)))
    return s


def bounce_bytes_from_env() -> int:
    """The bounce pool's bound in bytes (KVTIER_GPU_BOUNCE_MB, MiB; 64 when unset). Raises
    ValueError for a value that is not a positive integer."""
    v = os.environ.get("KVTIER_GPU_BOUNCE_MB")
    if v is None or not v.strip():
        return BOUNCE_BYTES
    try:
        n = int(v)
    except ValueError:
        n = 0
    if n <= 0:
        raise ValueError("KVTIER_GPU_BOUNCE_MB=%r: a positive number of MiB" % v)
    return n << 20


def choose(requested: str, have_cudart: bool) -> str:
    """The strategy a copier starts with: ``requested`` unless it is ``auto`` (``register``
    with the CUDA runtime library, else ``bounce``) or ``register`` without the library
    (``bounce``)."""
    if requested not in STRATEGIES:
        raise ValueError("strategy %r: one of %s" % (requested, ", ".join(STRATEGIES)))
    if requested in ("auto", "register"):
        return "register" if have_cudart else "bounce"
    return requested


def chunks(rows: int, width: int, cap: int) -> List[Tuple[int, int]]:
    """Rows [0, rows) as (first, count) chunks of at most ``cap`` bytes of ``width``-byte rows
    (at least one row each: a row wider than the cap is the pool's whole size)."""
    per = max(1, cap // max(1, width))
    return [(a, min(per, rows - a)) for a in range(0, rows, per)]


def host_rows(addr: int, pitch: int, rows: int, width: int) -> np.ndarray:
    """A segment's rows as a (rows, width) uint8 numpy array over its memory (no copy)."""
    span = (rows - 1) * pitch + width if rows else 0
    mem = (ctypes.c_ubyte * max(span, 1)).from_address(addr)
    return np.ndarray((rows, width), dtype=np.uint8, buffer=mem, strides=(pitch, 1))


# == the CUDA runtime, through ctypes =============================================================

_cudart_lock = threading.Lock()
_cudart: Any = False  # False: not looked for yet; None: not found


def _cudart_candidates() -> List[str]:
    """libcudart's paths: the one this process loaded (torch's) first, then the usual names."""
    seen: List[str] = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                p = line.rstrip("\n").split(None, 5)
                if len(p) == 6 and "libcudart" in os.path.basename(p[5]) and p[5] not in seen:
                    seen.append(p[5])
    except OSError:
        pass
    found = ctypes.util.find_library("cudart")
    return seen + [x for x in (found, "libcudart.so.13", "libcudart.so.12", "libcudart.so")
                   if x and x not in seen]


def cudart() -> Any:
    """The CUDA runtime library (ctypes, the functions this module calls typed), or None when
    no libcudart with cudaMemcpy2DAsync can be loaded (a torch without CUDA, or one linking
    the runtime statically)."""
    global _cudart
    with _cudart_lock:
        if _cudart is not False:
            return _cudart
        _cudart = None
        for path in _cudart_candidates():
            try:
                lib = ctypes.CDLL(path)
                f = lib.cudaMemcpy2DAsync
            except (OSError, AttributeError):
                continue
            f.restype = ctypes.c_int
            f.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                          ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
            lib.cudaHostRegister.restype = ctypes.c_int
            lib.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
            lib.cudaHostUnregister.restype = ctypes.c_int
            lib.cudaHostUnregister.argtypes = [ctypes.c_void_p]
            lib.cudaGetLastError.restype = ctypes.c_int
            lib.cudaGetLastError.argtypes = []
            lib.cudaGetErrorString.restype = ctypes.c_char_p
            lib.cudaGetErrorString.argtypes = [ctypes.c_int]
            _cudart = lib
            break
        return _cudart


def _cuda_error(rt: Any, rc: int, what: str) -> GpuCopyError:
    # The runtime keeps the last error for cudaGetLastError, which torch reads after its own
    # kernel launches: cleared here, or torch would raise it against an unrelated launch.
    if rt is not None:
        rt.cudaGetLastError()
    name = rt.cudaGetErrorString(rc).decode("utf-8", "replace") if rt is not None else "?"
    return GpuCopyError(EINVAL, "%s: CUDA error %d (%s)" % (what, rc, name))


# == registrations: a span of pages, pinned while a reservation or a lease holds it ==============

_reg_lock = threading.Lock()
_live: Dict[int, "Pin"] = {}  # id -> registered span, undone by close()


class Pin:
    """A span [addr, addr + nbytes) of host memory registered with CUDA until close(), which
    its holder's death also calls (the layout's runs hold it: the worker drops them before its
    COMMIT or RELEASE). Made by pin()."""

    def __init__(self, rt: Any, addr: int, nbytes: int) -> None:
        self._rt, self.addr, self.nbytes = rt, addr, nbytes
        self.open = True

    def close(self) -> None:
        with _reg_lock:
            if not self.open:
                return
            self.open = False
            _live.pop(id(self), None)
        rc = self._rt.cudaHostUnregister(ctypes.c_void_p(self.addr))
        if rc != 0:
            err = _cuda_error(self._rt, rc, "cudaHostUnregister of %d bytes" % self.nbytes)
            log.warning("kvtier: %s", err)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - at interpreter exit
            pass


def pin(rt: Any, addr: int, nbytes: int) -> Optional[Pin]:
    """Registers [addr, addr + nbytes) with CUDA (portable: every device's context). None when
    part of it is registered already (a span sharing a page with another: it goes through the
    bounce pool rather than register twice). Raises GpuCopyError when CUDA refuses."""
    rc = rt.cudaHostRegister(ctypes.c_void_p(addr), nbytes, _PORTABLE)
    if rc == _ALREADY:
        rt.cudaGetLastError()  # as _cuda_error: not left for torch to find
        return None
    if rc != 0:
        raise _cuda_error(rt, rc, "cudaHostRegister of %d bytes" % nbytes)
    p = Pin(rt, addr, nbytes)
    with _reg_lock:
        _live[id(p)] = p
    return p


def registrations() -> int:
    """How many spans are registered with CUDA by this module and not yet undone."""
    with _reg_lock:
        return len(_live)


def unregister(addr: int, nbytes: int) -> int:
    """Undoes the registrations inside [addr, addr + nbytes) (a mapping about to be unmapped:
    Client.close calls it; none should be left by then). Returns how many; never raises."""
    with _reg_lock:
        inside = [p for p in _live.values() if addr <= p.addr < addr + nbytes]
    for p in inside:
        p.close()
    return len(inside)


@atexit.register
def _unregister_all() -> None:
    with _reg_lock:
        left = list(_live.values())
    for p in left:
        p.close()


def arena_of(addr: int) -> Optional[Tuple[int, int]]:
    """The kvtier arena mapping holding ``addr`` as (start, bytes), from /proc/self/maps, or
    None (the heap, a staging buffer, bytes that came through the socket): for diagnostics and
    tests."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                p = line.split(None, 5)
                lo, hi = (int(x, 16) for x in p[0].split("-"))
                if lo <= addr < hi:
                    return (lo, hi - lo) if len(p) == 6 and _ARENA_TAG in p[5] else None
    except (OSError, ValueError):
        pass
    return None


# == the copier ==================================================================================


class BouncePool:
    """One host buffer of at most ``cap`` bytes, made on first use by ``alloc`` (pinned memory:
    torch.empty(pin_memory=True)) and reused by every copy after; a copy larger than ``cap``
    goes through it in chunks (chunks())."""

    def __init__(self, cap: int, alloc: Callable[[int], torch.Tensor]) -> None:
        if cap <= 0:
            raise ValueError("bounce pool of %d bytes: it needs at least one" % cap)
        self.cap = cap
        self._alloc = alloc
        self._buf: Optional[torch.Tensor] = None
        self.allocations = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """The pool's buffer, at least min(nbytes, cap) bytes (a larger one than before replaces
        it, up to cap). Raises what ``alloc`` raises (out of memory)."""
        want = min(max(nbytes, 1), self.cap)
        if self._buf is None or self._buf.numel() < want:
            self._buf = None  # the old one freed before the larger one is asked for
            self._buf = self._alloc(want)
            self.allocations += 1
        return self._buf

    @property
    def nbytes(self) -> int:
        return 0 if self._buf is None else int(self._buf.numel())


def _pinned(n: int) -> torch.Tensor:
    return torch.empty(n, dtype=torch.uint8, pin_memory=True)


class Copier:
    """Copies one layer's blocks between a device tensor and host rows (see the module's
    docstring). One per device (copier_for); thread-safe (copies are serialised: the bounce
    pool and the stream are shared by the connector's threads)."""

    def __init__(self, device: torch.device, strategy: str = "auto",
                 bounce_bytes: int = BOUNCE_BYTES,
                 alloc: Optional[Callable[[int], torch.Tensor]] = None) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._rt = cudart() if self.cuda else None
        self.strategy = choose(strategy, self._rt is not None)
        if self.cuda and strategy in ("auto", "register") and self.strategy == "bounce":
            log.info("kvtier: no CUDA runtime library with cudaMemcpy2DAsync: engine tensors "
                     "go through a pinned bounce pool")
        self.pool = BouncePool(bounce_bytes, alloc or _pinned)
        self._lock = threading.Lock()
        self._stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.transfers = 0  # host transfers issued (copies through the pool or 2D copies)

    # -- checks --

    def _check(self, kv: torch.Tensor, width: int, dtype: Optional[torch.dtype]) -> None:
        if kv.device != self.device:
            raise GpuCopyError(EINVAL, "a tensor on %s: this copier serves %s" % (kv.device,
                                                                                 self.device))
        if kv.layout != torch.strided:
            raise GpuCopyError(EINVAL, "a %s tensor: only strided tensors" % kv.layout)
        if dtype is not None and kv.dtype != dtype:
            raise GpuCopyError(EINVAL, "a %s tensor where the layout has %s" % (kv.dtype, dtype))
        if kv.dim() < 1 or kv[0].numel() * kv.element_size() != width:
            raise GpuCopyError(EINVAL, "a block of %d bytes where the layout has %d" % (
                kv[0].numel() * kv.element_size() if kv.dim() else 0, width))

    @staticmethod
    def _check_rows(blocks: Sequence[int], segments: Sequence[Segment], width: int) -> None:
        if sum(s[2] for s in segments) != len(blocks):
            raise GpuCopyError(EINVAL, "%d blocks for %d host rows" % (
                len(blocks), sum(s[2] for s in segments)))
        for _, pitch, rows in segments:
            if rows > 1 and pitch < width:
                raise GpuCopyError(EINVAL, "host rows %d bytes apart, narrower than a block's "
                                   "%d" % (pitch, width))

    # -- the device side --

    def _consecutive(self, kv: torch.Tensor, blocks: Sequence[int]) -> Optional[torch.Tensor]:
        """The blocks as one contiguous slice of ``kv`` (no device copy), or None."""
        b = blocks[0]
        if list(blocks) != list(range(b, b + len(blocks))):
            return None
        s = kv.narrow(0, b, len(blocks))
        return s if s.is_contiguous() else None

    def _index(self, blocks: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(blocks), dtype=torch.long).to(self.device)

    @staticmethod
    def _bytes(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(-1).view(torch.uint8)

    def _sync(self) -> None:
        if self._stream is not None:
            ev = torch.cuda.Event()
            ev.record(self._stream)
            ev.synchronize()

    def _drain(self) -> None:
        """After a failure: nothing of this call goes on in the background. Errors here are
        the one already raised."""
        try:
            if self._stream is not None:
                self._stream.synchronize()
        except Exception:  # noqa: BLE001
            pass

    def _ctx(self) -> Any:
        if self._stream is None:
            return _Nothing()
        return _Both(torch.cuda.device(self.device), torch.cuda.stream(self._stream))

    # -- copies --

    def pin(self, addr: int, nbytes: int) -> Optional[Pin]:
        """A registration of [addr, addr + nbytes) for the register strategy (None with
        another strategy, or where part of it is registered already). A registration CUDA
        refuses moves this copier to the bounce pool (logged)."""
        if self.strategy != "register" or nbytes <= 0:
            return None
        with self._lock, self._ctx():
            try:
                return pin(self._rt, addr, nbytes)
            except GpuCopyError as e:
                log.warning("kvtier: %s: engine tensors go through a pinned bounce pool", e)
                self.strategy = "bounce"
                return None

    def to_host(self, kv: torch.Tensor, blocks: Sequence[int], segments: Sequence[Segment],
                width: int, dtype: Optional[torch.dtype] = None,
                pinned: Optional[Sequence[bool]] = None) -> bool:
        """Copies blocks ``blocks`` of ``kv`` (a layer, block dimension first, on this
        copier's device) into the host rows of ``segments`` (``width`` bytes each, in block
        order); ``pinned[i]``: segment i lies in a live Pin (copied straight, with the register
        strategy; the others go through the bounce pool). Returns False, having copied nothing,
        when the strategy is (or falls back to) ``pageable``: the caller copies. Raises
        GpuCopyError (nothing it wrote to be committed)."""
        return self._copy(kv, blocks, segments, width, dtype, pinned, True)

    def to_device(self, kv: torch.Tensor, blocks: Sequence[int], segments: Sequence[Segment],
                  width: int, dtype: Optional[torch.dtype] = None,
                  pinned: Optional[Sequence[bool]] = None) -> bool:
        """The reverse of to_host: the host rows into the blocks of ``kv``; once it returns
        the blocks hold them."""
        return self._copy(kv, blocks, segments, width, dtype, pinned, False)

    def _copy(self, kv: torch.Tensor, blocks: Sequence[int], segments: Sequence[Segment],
              width: int, dtype: Optional[torch.dtype], pinned: Optional[Sequence[bool]],
              out: bool) -> bool:
        self._check(kv, width, dtype)
        self._check_rows(blocks, segments, width)
        if not blocks:
            return True
        with self._lock:
            if self.strategy == "pageable":
                return False
            direct = [bool(pinned and pinned[i]) and self.strategy == "register"
                      for i in range(len(segments))]
            pooled = sum(r for (_, _, r), d in zip(segments, direct) if not d)
            if pooled:
                try:  # made (or found) before anything moves: its failure copies nothing
                    self.pool.take(pooled * width)
                except RuntimeError as e:  # out of pinned memory
                    log.warning("kvtier: no pinned bounce pool of %d bytes (%s): engine tensors "
                                "are copied pageable", min(pooled * width, self.pool.cap), e)
                    self.strategy = "pageable"
                    return False
            try:
                with self._ctx():
                    (self._out if out else self._in)(kv, blocks, segments, width, direct)
                    self._sync()
            except GpuCopyError:
                self._drain()
                raise
            except Exception as e:  # noqa: BLE001 - a CUDA error, out of device memory
                self._drain()
                raise GpuCopyError(EINVAL, "copy %s the device failed: %s" % (
                    "from" if out else "to", e)) from e
            return True

    def _memcpy2d(self, dst: int, dpitch: int, src: int, spitch: int, width: int, rows: int,
                  kind: int) -> None:
        stream = self._stream.cuda_stream if self._stream is not None else None
        rc = self._rt.cudaMemcpy2DAsync(ctypes.c_void_p(dst), dpitch, ctypes.c_void_p(src),
                                        spitch, width, rows, kind, ctypes.c_void_p(stream))
        if rc != 0:
            raise _cuda_error(self._rt, rc, "cudaMemcpy2DAsync of %d rows of %d bytes" % (
                rows, width))
        self.transfers += 1

    @staticmethod
    def _routes(segments: Sequence[Segment], width: int, direct: List[bool]
                ) -> Tuple[List[Tuple[int, Segment]], List[int], List[np.ndarray]]:
        """The direct segments with their first row, and the pooled rows: their row numbers
        and their host rows (numpy views), in block order."""
        straight: List[Tuple[int, Segment]] = []
        rows: List[int] = []
        host: List[np.ndarray] = []
        at = 0
        for seg, d in zip(segments, direct):
            if d:
                straight.append((at, seg))
            else:
                rows.extend(range(at, at + seg[2]))
                host.append(host_rows(seg[0], seg[1], seg[2], width))
            at += seg[2]
        return straight, rows, host

    def _out(self, kv: torch.Tensor, blocks: Sequence[int], segments: Sequence[Segment],
             width: int, direct: List[bool]) -> None:
        src = self._consecutive(kv, blocks)
        if src is None:  # the blocks gathered on the device, contiguous
            src = torch.index_select(kv, 0, self._index(blocks))
        flat = self._bytes(src).view(len(blocks), width)
        straight, rows, host = self._routes(segments, width, direct)
        for at, (addr, pitch, n) in straight:
            self._memcpy2d(addr, pitch, src.data_ptr() + at * width, width, width, n, _D2H)
        if not rows:
            return
        if rows != list(range(rows[0], rows[0] + len(rows))):
            flat = flat.index_select(0, self._index(rows))
        else:
            flat = flat[rows[0]:rows[0] + len(rows)]
        buf = self.pool.take(len(rows) * width)
        for first, n in chunks(len(rows), width, buf.numel()):
            part = buf[:n * width]
            part.copy_(flat[first:first + n].reshape(-1), non_blocking=self.cuda)
            self._sync()  # the pool's bytes in before the host reads them
            _spread(part.numpy().reshape(n, width), host, first, n, True)
            self.transfers += 1

    def _in(self, kv: torch.Tensor, blocks: Sequence[int], segments: Sequence[Segment],
            width: int, direct: List[bool]) -> None:
        dst = self._consecutive(kv, blocks)
        staging = None
        if dst is None:
            staging = dst = torch.empty((len(blocks), *kv.shape[1:]), dtype=kv.dtype,
                                        device=self.device)
        flat = self._bytes(dst).view(len(blocks), width)
        straight, rows, host = self._routes(segments, width, direct)
        for at, (addr, pitch, n) in straight:
            self._memcpy2d(dst.data_ptr() + at * width, width, addr, pitch, width, n, _H2D)
        if rows:
            run = rows == list(range(rows[0], rows[0] + len(rows)))
            buf = self.pool.take(len(rows) * width)
            for first, n in chunks(len(rows), width, buf.numel()):
                part = buf[:n * width]
                _spread(part.numpy().reshape(n, width), host, first, n, False)
                if run:
                    a = rows[0] + first
                    flat[a:a + n].copy_(part.view(n, width), non_blocking=self.cuda)
                else:
                    tmp = part.view(n, width).to(self.device, non_blocking=self.cuda)
                    flat.index_copy_(0, self._index(rows[first:first + n]), tmp)
                self._sync()  # the pool is free again before the next chunk fills it
                self.transfers += 1
        if staging is not None:
            kv.index_copy_(0, self._index(blocks), staging)


def _spread(pool: np.ndarray, host: List[np.ndarray], first: int, n: int, out: bool) -> None:
    """Between the pool's ``n`` rows and pooled rows [first, first + n) of the segments'
    ``host`` rows (concatenated in order): one numpy copy per stretch of one segment."""
    i, k = 0, first
    while k >= host[i].shape[0]:
        k -= host[i].shape[0]
        i += 1
    j = 0
    while j < n:
        m = min(n - j, host[i].shape[0] - k)
        if out:
            np.copyto(host[i][k:k + m], pool[j:j + m])
        else:
            np.copyto(pool[j:j + m], host[i][k:k + m])
        j += m
        i, k = i + 1, 0


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


class _Both:
    def __init__(self, a: Any, b: Any) -> None:
        self.a, self.b = a, b

    def __enter__(self) -> None:
        self.a.__enter__()
        self.b.__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            self.b.__exit__(*exc)
        finally:
            self.a.__exit__(*exc)


_copiers_lock = threading.Lock()
_copiers: Dict[torch.device, Copier] = {}


def copier_for(t: torch.Tensor) -> Optional[Copier]:
    """The copier of ``t``'s device (made on first use, with KVTIER_GPU_COPY's strategy), or
    None: ``t`` is not a CUDA tensor, torch has no usable CUDA, or the strategy is (or fell
    back to) ``pageable``: the caller's own copies, as without this module."""
    if t.device.type != "cuda":
        return None
    with _copiers_lock:
        c = _copiers.get(t.device)
        if c is None:
            c = _copiers[t.device] = Copier(t.device, strategy_from_env(),
                                            bounce_bytes_from_env())
    return None if c.strategy == "pageable" else c


def copiers() -> Dict[torch.device, Copier]:
    """The copiers made so far, by device (for tests and metrics)."""
    with _copiers_lock:
        return dict(_copiers)
