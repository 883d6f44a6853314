"""client.py: Client (one connection to kvtierd) and Batch (pipelined requests), over libkvtier.

Units: tokens are token ids (uint32); a page is ``page_size`` tokens; a block is the KV bytes of
one page, ``block_bytes`` bytes. Payload sizes are always whole blocks.

Buffers: payloads are borrowed through the buffer protocol (``bytes``, ``bytearray``,
``memoryview``, numpy arrays, ``array.array``, mmap) or, for torch tensors (which have no buffer
protocol), through ``data_ptr()`` of a contiguous CPU tensor, pinned or not. Nothing is copied in
Python: PUT sends from the caller's memory, GET writes into the caller's memory. A buffer must be
C-contiguous; its dtype does not matter, only its size in bytes.

Zero-copy: on the daemon's Unix socket a Client maps its namespace's DRAM arena at connect
(``zero_copy=True``, the default; docs/python.md, "Zero-copy"): get_into/get/put and the keyed
calls then move block bytes through that shared memory instead of the socket, with no change to
their results; get_views() and reserve()/commit() expose the mapping itself.

Threads: a Client serialises its calls with a lock (libkvtier's client is one thread at a time);
the GIL is released while libkvtier waits on the daemon. Use one Client per thread for
parallelism.
"""

from __future__ import annotations

import array
import enum
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

from ._base import Buffer, Hints, PutResult, _check_tensor, _rbuf, _wbuf
from ._lib import ffi, lib
from ._lib import put_flags as _put_flags
from .errors import ECLOSED, EINVAL, EPROTO, Error, InvalidArgument, error_for
from .hints import HintsMixin
from .keys import KeysMixin

__all__ = [
    "Batch",
    "Client",
    "Hints",
    "Match",
    "Pending",
    "PrefetchResult",
    "PutResult",
    "Reservation",
    "Tier",
]

Tokens = Union[Iterable[int], "array.array[int]", memoryview, Any]

_LEASE: int = lib.KVT_CLIENT_LEASE
_REMOTE: int = lib.KVT_CLIENT_REMOTE
_PROBE: int = lib.KVT_CLIENT_PROBE
_LOCATE: int = lib.KVT_CLIENT_LOCATE
_KEEP: int = lib.KVT_CLIENT_KEEP


class Tier(enum.IntEnum):
    """Where a page's bytes are, as MATCH reports them and PREFETCH takes them."""

    NONE = lib.KVT_CLIENT_TIER_NONE  # index only: no bytes stored
    HBM = lib.KVT_CLIENT_TIER_HBM
    DRAM = lib.KVT_CLIENT_TIER_DRAM
    NVME = lib.KVT_CLIENT_TIER_NVME
    REMOTE = lib.KVT_CLIENT_TIER_REMOTE


# Tier by its wire number, for Match.tiers: indexing a tuple is cheaper than Tier(n) per page.
_TIERS = tuple(Tier(i) for i in range(max(Tier) + 1))


def _tiers(raw: Any) -> Tuple[Union[Tier, int], ...]:
    """The Tier of each page of a MATCH answer's tier bytes. A number this package does not know
    (a newer daemon's tier) stays a plain int rather than failing the whole match."""
    return tuple(_TIERS[t] if t < len(_TIERS) else t for t in bytes(raw))


@dataclass(frozen=True)
class Match:
    """What MATCH found: ``tokens`` and ``pages`` matched (tokens = pages x page_size),
    ``remote_pages`` of them found by the remote probe, ``lease`` (non-zero when a lease was
    asked for and pages > 0), ``tiers`` the Tier of each matched page (a tuple, one per page:
    ``Tier.NONE`` for a page indexed with no bytes stored). Tier is an IntEnum, so each also
    compares equal to its wire number (``t == 2``, ``if t:`` for "stored")."""

    tokens: int
    pages: int
    remote_pages: int
    lease: int
    tiers: Tuple[Union[Tier, int], ...]
    # match(keep=True): the daemon's handle for the matched tokens (0: none kept) and how many
    # tokens it holds; put(after=this Match) then sends only the tokens past them.
    handle: int = 0
    kept: int = 0
    # match(locate=True): per page, a read-only memoryview of its bytes where they lie in the
    # zero-copy mapping, or None (not located: read it with get_into under ``lease``). Valid
    # while the lease holds, and only until ``valid_until_ns`` (time.monotonic_ns()).
    views: Optional[Tuple[Optional[memoryview], ...]] = None
    valid_until_ns: int = 0

    @property
    def tiers_raw(self) -> bytes:
        """``tiers`` as the wire has them: one byte per page, the tier's number."""
        return bytes(self.tiers)


@dataclass(frozen=True)
class PrefetchResult:
    """What PREFETCH did, in pages: ``pages`` of the cached prefix, ``moved`` up (or on their
    way, for ``wait=False``), ``resident`` already at or above the tier, ``failed``."""

    pages: int
    moved: int
    resident: int
    failed: int


class Reservation:
    """Room reserved in the daemon's DRAM arena for pages of a token sequence (Client.reserve):
    ``views[i]`` is a writable memoryview of block_bytes bytes where page ``first_page + i``
    goes, or None when that page got no room (held already, being written by another request,
    or no room in DRAM: put() those if they matter). ``id`` names it for commit()/abort() (0:
    nothing was reserved); ``pages`` and ``new_pages`` as PutResult's; ``nreserved`` the views
    that are not None. ``sealed``: the daemon seals these pages (zero-copy-checksum), so their
    XXH3-64 sums are worth sending with commit() (the daemon then does not read them again).
    ``addrs``: each view's address in the mapping as an int (0: no view), for copies made
    by address (one call's unpacking, not one buffer export per view).

    Write each view completely, then commit(): the pages become visible to every client. The
    views point into the daemon's memory: after commit() or abort() (which release them, unless
    something still holds a buffer taken from them) they must not be touched."""

    __slots__ = ("id", "pages", "new_pages", "nreserved", "first_page", "views", "sealed",
                 "addrs")

    def __init__(self, id: int, pages: int, new_pages: int, nreserved: int, first_page: int,
                 views: List[Optional[memoryview]], sealed: bool = False,
                 addrs: Optional[List[int]] = None) -> None:
        self.id = id
        self.pages = pages
        self.new_pages = new_pages
        self.nreserved = nreserved
        self.first_page = first_page
        self.views = views
        self.sealed = sealed
        self.addrs = addrs if addrs is not None else [0] * len(views)

    def _release(self) -> None:
        for v in self.views:
            if v is not None:
                try:
                    v.release()
                except BufferError:  # a numpy array or torch tensor still uses it
                    pass
        self.views = [None] * len(self.views)
        self.addrs = [0] * len(self.addrs)

    def __repr__(self) -> str:
        return "Reservation(id=%d, pages=%d, new_pages=%d, nreserved=%d)" % (
            self.id, self.pages, self.new_pages, self.nreserved)


def _tokens(tokens: Any) -> Tuple[Any, int]:
    """A uint32_t* over the token ids and their count. A buffer of 4-byte integers (numpy
    uint32/int32, array('I'), a torch int32 tensor) is borrowed as it is; anything else is
    converted once into an array('I') (raises OverflowError for ids outside 0..2**32-1)."""
    if isinstance(tokens, array.array) and tokens.itemsize == 4 and tokens.typecode in "IiLl":
        return ffi.from_buffer("uint32_t[]", tokens), len(tokens)
    if isinstance(tokens, (list, tuple, range)):
        a = array.array("I", tokens)
        return ffi.from_buffer("uint32_t[]", a), len(a)
    if hasattr(tokens, "data_ptr") and hasattr(tokens, "element_size"):
        if str(tokens.dtype) in ("torch.int32", "torch.uint32"):
            _check_tensor(tokens)
            return ffi.cast("uint32_t *", tokens.data_ptr()), tokens.numel()
    else:
        try:
            m = memoryview(tokens)
        except TypeError:
            m = None
        if m is not None and m.itemsize == 4 and m.format in ("I", "i", "<I", "<i", "=I", "=i"):
            if not m.c_contiguous:
                raise InvalidArgument(EINVAL, "tokens: not a contiguous buffer")
            return ffi.from_buffer("uint32_t[]", m), m.nbytes // 4
    if hasattr(tokens, "tolist"):  # numpy or torch of another dtype: checked conversion
        tokens = tokens.tolist()
    a = array.array("I", tokens)
    return ffi.from_buffer("uint32_t[]", a), len(a)


def _payload(payload: Optional[Buffer], bb: int) -> Tuple[Any, int]:
    """A PUT's payload as (pointer, pages): NULL and 0 for None or an empty buffer. Raises
    InvalidArgument for bytes that are not whole blocks of bb."""
    if payload is None:
        return ffi.NULL, 0
    pp, size = _rbuf(payload)
    if not bb or size % bb:
        raise InvalidArgument(
            EINVAL, "payload of %d bytes is not whole blocks of %d bytes" % (size, bb))
    return (pp if size else ffi.NULL), size // bb


def _unpin(c: Any) -> None:
    """Undoes kvtier.gpucopy's CUDA registration of the client's mapping, if it made one,
    before the mapping goes (a registration must not outlive the memory it pins). Looked up
    in sys.modules: a process that never copied engine tensors never imports it (nor torch)."""
    g = sys.modules.get("kvtier.gpucopy")
    if g is None or not g.registrations():
        return
    n = ffi.new("uint64_t *")
    p = lib.kvt_client_mapping(c, n)
    if n[0]:
        g.unregister(int(ffi.cast("uintptr_t", p)), int(n[0]))


def _collect_block_py(arg: Any, page: int, tier: int, data: Any, length: int) -> int:
    ffi.from_handle(arg).append(ffi.buffer(data, length)[:])
    return 0


def _collect_loc_py(arg: Any, page: int, tier: int, host: Any, offset: int, length: int,
                    data: Any) -> int:
    out = ffi.from_handle(arg)
    if host != ffi.NULL:
        # A read-only view of the page where it lies in the mapping: no copy.
        out.append(memoryview(ffi.buffer(host, length)).toreadonly())
    elif data != ffi.NULL:
        out.append(ffi.buffer(data, length)[:])  # came through the socket: its own bytes
    else:
        out.append(None)  # HBM: not mapped by this package
    return 0


def _collect_stat_py(arg: Any, name: Any, value: int) -> int:
    ffi.from_handle(arg)[ffi.string(name).decode()] = value
    return 0


# One C callback each for the whole process (cffi keeps them alive while this module is).
_collect_block = ffi.callback("int(void *, uint32_t, unsigned, const void *, uint32_t)",
                              _collect_block_py)
_collect_stat = ffi.callback("int(void *, const char *, uint64_t)", _collect_stat_py)
_collect_loc = ffi.callback(
    "int(void *, uint32_t, unsigned, const void *, uint64_t, uint32_t, const void *)",
    _collect_loc_py)


def _s(v: Optional[str]) -> Any:
    return ffi.NULL if v is None else ffi.new("char[]", v.encode())


class Client(KeysMixin, HintsMixin):
    """One connection to kvtierd, declared to one namespace.

    ``Client(model, page_size=16, block_bytes=..., unix_path=...)`` connects at once: AUTH (when
    ``secret`` is given), then HELLO with the namespace (model, adapter, salt, page size in
    tokens, block size in bytes). Use it as a context manager, or call close().

    Keyword arguments: ``unix_path`` (the daemon's Unix socket; with ``tcp`` None as well:
    "kvtierd.sock" in the working directory), ``tcp`` ("host:port", used when unix_path is None),
    ``secret`` (shared secret), ``adapter`` (LoRA name), ``salt`` (tenant salt: isolates
    tenants), ``page_size`` (tokens per page, 1..1024), ``block_bytes`` (KV bytes of one page; 0
    for index-only use), ``timeout_ms`` (per call, milliseconds), ``zero_copy`` (default True:
    on the Unix socket, map the namespace's DRAM arena and move block bytes through it; a
    refusal is not an error, see ``zero_copy`` and ``zero_copy_reason``), ``device`` (the CUDA
    device ordinal, 0..65535, the engine's KV cache is on: a daemon with an HBM pool per device,
    ``hbm-devices``, stores this connection's pages in that device's pool; default 0).

    Raises ConnectError (no daemon there: errno ENOENT or ECONNREFUSED), AuthError,
    InvalidArgument, ProtocolError, NoSpace (no room for a new namespace).

    Keyed calls (exists_keys, put_keys, get_keys_into, ... : kvtier/keys.py) name pages by
    key instead of tokens, on a second connection opened on first use.
    """

    def __init__(
        self,
        model: str,
        *,
        page_size: int = 16,
        block_bytes: int = 0,
        unix_path: Optional[str] = None,
        tcp: Optional[str] = None,
        secret: Optional[str] = None,
        adapter: Optional[str] = None,
        salt: Optional[str] = None,
        timeout_ms: int = 10000,
        zero_copy: bool = True,
        device: int = 0,
    ) -> None:
        self._c = ffi.NULL
        self._lock = threading.Lock()
        self.model = model
        self.page_size = page_size
        self.block_bytes = block_bytes
        keep = [_s(unix_path), _s(tcp), _s(secret), _s(model), _s(adapter), _s(salt)]
        conf = ffi.new("kvt_client_conf_t *")
        conf.unix_path, conf.tcp, conf.secret, conf.model, conf.adapter, conf.salt = keep
        conf.page_size = page_size
        conf.block_bytes = block_bytes
        conf.timeout_ms = timeout_ms
        conf.zero_copy = 1 if zero_copy else 0
        if isinstance(device, bool) or not isinstance(device, int) or not 0 <= device <= 65535:
            raise InvalidArgument(EINVAL, "device must be a CUDA device ordinal in 0..65535, "
                                  "not %r" % (device,))
        conf.device = device
        self.device = device
        out = ffi.new("kvt_client_t **")
        rc = lib.kvt_client_connect(out, conf)
        if rc < 0:
            raise error_for(rc)
        self._c = out[0]
        self._conf, self._conf_keep = conf, keep  # for the keyed connection (keys.py)

    # -- lifetime ---------------------------------------------------------------------------

    def close(self) -> None:
        """Closes the connection; the daemon releases every lease it held. Idempotent."""
        with self._lock:
            self._close_keys()
            if self._c != ffi.NULL:
                _unpin(self._c)
                lib.kvt_client_close(self._c)
                self._c = ffi.NULL

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        self._close_keys()
        c = getattr(self, "_c", ffi.NULL)
        if c != ffi.NULL:
            _unpin(c)
            lib.kvt_client_close(c)
            self._c = ffi.NULL

    @property
    def closed(self) -> bool:
        """True after close()."""
        return bool(self._c == ffi.NULL)

    @property
    def ns_seed(self) -> int:
        """The namespace's seed (the start of its hash chain), as HELLO answered."""
        return int(lib.kvt_client_ns_seed(self._live()))

    @property
    def tiers(self) -> List[Tier]:
        """The tiers the daemon has, as HELLO answered."""
        mask = lib.kvt_client_tiers(self._live())
        return [t for t in Tier if t != Tier.NONE and mask & (1 << t)]

    @property
    def zero_copy(self) -> bool:
        """True when this connection mapped its namespace's DRAM arena (zero-copy in use)."""
        return bool(lib.kvt_client_zero_copy(self._live()))

    @property
    def zero_copy_reason(self) -> str:
        """Why zero-copy is not in use ("" when it is): zero_copy=False, TCP, block_bytes 0, or
        the daemon's refusal (its code and message)."""
        return ffi.string(lib.kvt_client_zero_copy_reason(self._live())).decode("utf-8",
                                                                                "replace")

    def _mapping(self) -> Tuple[int, int]:
        """The mapping's address and length in bytes ((0, 0) when not mapped): for tests."""
        n = ffi.new("uint64_t *")
        p = lib.kvt_client_mapping(self._live(), n)
        return int(ffi.cast("uintptr_t", p)), int(n[0])

    def _live(self) -> Any:
        if self._c == ffi.NULL:
            raise error_for(ECLOSED, "the client is closed")
        return self._c

    def _raise(self, rc: int) -> None:
        msg = ffi.string(lib.kvt_client_errmsg(self._c)).decode("utf-8", "replace")
        raise error_for(rc, msg)

    # -- calls ------------------------------------------------------------------------------

    def ping(self) -> int:
        """A PING round trip; returns it in nanoseconds. Raises a transport Error."""
        rtt = ffi.new("uint64_t *")
        with self._lock:
            rc = lib.kvt_client_ping(self._live(), rtt)
            if rc < 0:
                self._raise(rc)
        return int(rtt[0])

    def match(
        self,
        tokens: Tokens,
        *,
        lease: bool = False,
        lease_ms: int = 0,
        remote: bool = False,
        probe: bool = False,
        hints: Optional[Hints] = None,
        keep: bool = False,
        locate: bool = False,
    ) -> Match:
        """The longest cached prefix of ``tokens`` (token ids), in whole pages.

        ``lease``: pin the matched pages until release() (or ``lease_ms`` milliseconds, 0: the
        daemon's default, capped by its maximum), so that get_into() can read them.
        ``remote``: also probe the remote tier. ``probe``: only look (not counted as a use).
        One round trip per step (docs/protocol.md): ``locate`` (with ``lease``) answers in
        ``Match.views`` where each page lies in the zero-copy mapping, so that a hit is read with
        no GET (LIFETIME as get_views(): while the lease holds, and before
        ``Match.valid_until_ns``); ``keep`` keeps the tokens on the daemon for the PUT after it
        (``put(..., after=match)`` sends only the tokens past them).
        Raises InvalidArgument (``locate`` without ``lease``), ProtocolError (contradictory
        hints), Error for transport failures.
        """
        if locate and not lease:
            raise InvalidArgument(EINVAL, "locate needs lease: a location holds only under one")
        tp, n = _tokens(tokens)
        cap = n // self.page_size if self.page_size else 0
        tiers = ffi.new("uint8_t[]", max(cap, 1))
        res = ffi.new("kvt_client_match_t *")
        res.tiers = tiers
        res.tiers_cap = cap
        flags = (_LEASE if lease else 0) | (_REMOTE if remote else 0) | (_PROBE if probe else 0)
        flags |= (_LOCATE if locate else 0) | (_KEEP if keep else 0)
        h = hints._c() if hints is not None else ffi.NULL
        step = ffi.NULL
        if locate or keep:
            step = ffi.new("kvt_client_step_t *")
            if locate:
                locs = ffi.new("kvt_client_loc_t[]", max(cap, 1))
                step.locs = locs
                step.locs_cap = cap
        with self._lock:
            rc = lib.kvt_client_match_step(self._live(), tp, n, flags, lease_ms, h, res, step)
            if rc < 0:
                self._raise(rc)
        pages = res.pages
        views = None
        if locate:
            bb = self.block_bytes
            views = tuple(
                memoryview(ffi.buffer(locs[i].host_ptr, bb)).toreadonly()
                if locs[i].host_ptr != ffi.NULL else None for i in range(min(pages, cap)))
        return Match(res.tokens, pages, res.remote_pages, res.lease,
                     _tiers(ffi.buffer(tiers, min(pages, cap))),
                     handle=int(step.handle) if keep else 0, kept=int(step.kept) if keep else 0,
                     views=views, valid_until_ns=int(step.valid_until_ns) if locate else 0)

    def put(
        self,
        tokens: Tokens,
        payload: Optional[Buffer] = None,
        *,
        first_page: int = 0,
        hints: Optional[Hints] = None,
        after: Optional[Match] = None,
        gaps: bool = False,
    ) -> PutResult:
        """Caches every whole page of ``tokens`` and stores the KV bytes of pages
        ``[first_page, first_page + npages)`` from ``payload``, a buffer of npages x block_bytes
        bytes (None: index only). The daemon reads the bytes straight from the payload's memory
        (no copy in Python or libkvtier); with zero-copy, libkvtier copies each page once into
        room reserved in the mapping instead of sending it. Pages already stored keep their
        bytes. Returns when the bytes are in their tier.

        ``after``: the Match of a ``match(..., keep=True)`` on this client whose tokens are the
        first ``after.kept`` of ``tokens`` (the caller vouches for that): only the rest are sent.
        When the daemon kept none or no longer holds them, all are sent (the same result).

        ``gaps``: the pages may follow pages of the chain that hold no bytes (a sliding-window
        layer's window; docs/protocol.md, "Chains with gaps"); without it the daemon skips them.

        Raises InvalidArgument (payload not a whole number of blocks, or beyond the tokens'
        pages, or ``after`` kept more tokens than given), TypeError (not a buffer), NoSpace,
        Error for transport failures.
        """
        tp, n = _tokens(tokens)
        pp, npages = _payload(payload, self.block_bytes)
        res = ffi.new("kvt_client_put_t *")
        h = hints._c() if hints is not None else ffi.NULL
        handle, kept = (after.handle, after.kept) if after is not None else (0, 0)
        if kept > n:
            raise InvalidArgument(EINVAL, "the match kept %d tokens, more than the %d given" % (
                kept, n))
        with self._lock:
            c = self._live()
            with _put_flags(c, gaps):
                if handle:
                    rc = lib.kvt_client_put_kept(c, handle, tp, n, kept, first_page, npages, pp, h,
                                                 res)
                else:
                    rc = lib.kvt_client_put(c, tp, n, first_page, npages, pp, h, res)
            if rc < 0:
                self._raise(rc)
        return PutResult(res.pages, res.new_pages, res.stored, res.skipped)

    def get_into(
        self,
        lease: int,
        buf: Buffer,
        *,
        first_page: int = 0,
        npages: int = 0,
        tiers: Optional[Buffer] = None,
    ) -> int:
        """Reads the KV bytes of pages ``[first_page, first_page + npages)`` of a leased path
        into ``buf``, a writable buffer (bytearray, memoryview, numpy array, CPU torch tensor),
        in place: the bytes land in the caller's memory with no copy in Python (with zero-copy,
        one memcpy from the mapping, no socket). ``npages`` 0:
        to the lease's end, which must fit in ``buf``. ``tiers``: a writable buffer that gets
        the Tier each page came from (one byte per page; at least npages, or buf's pages).

        Returns the pages received (int). Raises NotFound (a lease this connection does not
        hold), TooBig (more pages came than buf holds), InvalidArgument, TypeError (not a writable
        buffer), Error for transport failures.
        """
        bp, cap = _wbuf(buf)
        if npages and npages * self.block_bytes > cap:
            raise InvalidArgument(EINVAL, "buffer of %d bytes is under %d pages x %d bytes" % (
                cap, npages, self.block_bytes))
        tp = ffi.NULL
        if tiers is not None:
            tp, tcap = _wbuf(tiers)
            want = npages or (cap // self.block_bytes if self.block_bytes else 0)
            if tcap < want:
                raise InvalidArgument(EINVAL, "tiers holds %d entries, under %d" % (tcap, want))
        got = ffi.new("uint32_t *")
        with self._lock:
            rc = lib.kvt_client_get(self._live(), lease, first_page, npages, bp, cap, got, tp)
            if rc < 0:
                self._raise(rc)
        return int(got[0])

    def get(self, lease: int, *, first_page: int = 0, npages: int = 0) -> bytes:
        """The KV bytes of pages ``[first_page, first_page + npages)`` of a leased path (npages
        0: to its end), as bytes: a convenience that copies once more than get_into().
        Raises as get_into()."""
        if npages:
            out = bytearray(npages * self.block_bytes)
            got = self.get_into(lease, out, first_page=first_page, npages=npages)
            del out[got * self.block_bytes:]
            return bytes(out)
        blocks: List[bytes] = []
        h = ffi.new_handle(blocks)
        got = ffi.new("uint32_t *")
        with self._lock:
            rc = lib.kvt_client_get_cb(self._live(), lease, first_page, 0, _collect_block, h, got)
            if rc < 0:
                self._raise(rc)
        return b"".join(blocks)

    def get_views(self, lease: int, *, first_page: int = 0, npages: int = 0
                  ) -> List[Union[memoryview, bytes]]:
        """The pages ``[first_page, first_page + npages)`` of a leased path (npages 0: to its
        end), one item per page, WITHOUT COPYING the mapped ones: a page in the zero-copy
        mapping is a read-only memoryview of block_bytes bytes INTO the daemon's memory (wrap it
        with numpy.frombuffer or torch.frombuffer at no cost); a page that came through the
        socket (another tier, a block stored before the mapping, or no mapping at all) is
        bytes.

        LIFETIME: a view is valid only while ``lease`` is held. After release(), the lease's
        expiry or close() the memory may hold another block (or be unmapped: touching a view
        then may crash the process). Copy what must outlive the lease. Raises Timeout when the
        lease may have expired before this call returned (ask for a longer lease_ms), and as
        get_into() otherwise.
        """
        out: List[Any] = []
        h = ffi.new_handle(out)
        with self._lock:
            rc = lib.kvt_client_get_loc(self._live(), lease, first_page, npages, _collect_loc, h)
            if rc < 0:
                self._raise(rc)
        if any(v is None for v in out):
            raise error_for(EPROTO, "an HBM location: this package maps only DRAM")
        return out

    def reserve(
        self,
        tokens: Tokens,
        npages: int,
        *,
        first_page: int = 0,
        hints: Optional[Hints] = None,
        after: Optional[Match] = None,
        gaps: bool = False,
    ) -> Reservation:
        """Caches every whole page of ``tokens`` (as put() does) and reserves room in the
        zero-copy mapping for the pages ``[first_page, first_page + npages)`` that hold no bytes
        yet: the Reservation's writable views are where to write them (numpy.frombuffer /
        torch.frombuffer over a view writes in place). Nothing is visible to anyone until
        commit(); a reservation not committed within the daemon's reserve-ms, or whose client
        closes, is given back. ``after`` as put()'s: only the tokens past those a
        ``match(..., keep=True)`` kept are sent (all of them when the daemon kept none or no
        longer holds them). ``gaps`` as put()'s: the commit stores the pages even after pages
        of the chain that hold no bytes.

        Raises InvalidArgument (no zero-copy mapping: see zero_copy_reason; npages 0; pages past
        the tokens' whole pages; ``after`` kept more tokens than given), NoSpace (index full, or
        too many reservations held), Error for transport failures.
        """
        tp, n = _tokens(tokens)
        if npages <= 0:
            raise InvalidArgument(EINVAL, "reserve: npages must be at least 1")
        handle, kept = (after.handle, after.kept) if after is not None else (0, 0)
        if kept > n:
            raise InvalidArgument(EINVAL, "the match kept %d tokens, more than the %d given" % (
                kept, n))
        ptrs = ffi.new("void *[]", npages)
        res = ffi.new("kvt_client_resv_t *")
        res.ptrs = ptrs
        h = hints._c() if hints is not None else ffi.NULL
        with self._lock:
            c = self._live()
            with _put_flags(c, gaps):
                if handle:
                    rc = lib.kvt_client_reserve_kept(c, handle, tp, n, kept, first_page, npages,
                                                     h, res)
                else:
                    rc = lib.kvt_client_reserve(c, tp, n, first_page, npages, h, res)
            if rc < 0:
                self._raise(rc)
        bb = self.block_bytes
        # The addresses in one call; a view only where there is room (0: none).
        addrs: List[int] = ffi.unpack(ffi.cast("uintptr_t *", ptrs), npages)
        buf = ffi.buffer
        views: List[Optional[memoryview]] = [
            memoryview(buf(p, bb)) if a else None for p, a in zip(ptrs, addrs)]
        return Reservation(int(res.id), res.pages, res.new_pages, res.nreserved, first_page,
                           views, bool(res.sealed), addrs)

    def commit(self, reservation: Union[Reservation, int],
               sums: Optional[Any] = None) -> PutResult:
        """Makes a reservation's pages visible, as a PUT of the bytes written would: ``stored``
        counts them. A Reservation with id 0 (nothing reserved) commits nothing and sends
        nothing. ``sums``: the pages' checksums (COMMIT's SUMS, kvt_client_commit_sums), one
        XXH3-64 (seed 0) per reserved page in page order as written, a buffer of native uint64
        (numpy uint64, array('Q')) or a sequence of ints; where the reservation is ``sealed``
        the daemon keeps them instead of hashing the pages itself (a wrong one gets its page
        dropped at its first check). Raises InvalidArgument (sums empty, or not one per reserved
        page: the reservation is still held), NotFound (not this connection's: never made,
        committed or aborted already, expired), Error for transport failures."""
        rid = reservation.id if isinstance(reservation, Reservation) else int(reservation)
        sp, ns = ffi.NULL, 0
        if sums is not None:
            try:
                sp = ffi.from_buffer("uint64_t[]", sums)
            except TypeError:
                sp = ffi.new("uint64_t[]", [int(x) for x in sums])
            ns = len(sp)
            if ns == 0:
                raise InvalidArgument(EINVAL, "commit: sums given but empty")
        if isinstance(reservation, Reservation):
            if rid == 0:
                reservation._release()
                return PutResult(reservation.pages, reservation.new_pages, 0, 0)
            if sums is not None and ns != reservation.nreserved:
                raise InvalidArgument(EINVAL, "commit: %d sums for %d reserved pages" % (
                    ns, reservation.nreserved))
            reservation._release()
        res = ffi.new("kvt_client_put_t *")
        with self._lock:
            if sums is not None:
                rc = lib.kvt_client_commit_sums(self._live(), rid, sp, ns, res)
            else:
                rc = lib.kvt_client_commit(self._live(), rid, res)
            if rc < 0:
                self._raise(rc)
        return PutResult(res.pages, res.new_pages, res.stored, res.skipped)

    def abort(self, reservation: Union[Reservation, int]) -> None:
        """Gives a reservation's room back: none of its pages becomes visible. Raises as
        commit()."""
        rid = reservation.id if isinstance(reservation, Reservation) else int(reservation)
        if isinstance(reservation, Reservation):
            reservation._release()
            if rid == 0:
                return
        with self._lock:
            rc = lib.kvt_client_abort(self._live(), rid)
            if rc < 0:
                self._raise(rc)

    def prefetch(
        self, tokens: Tokens, tier: int = Tier.DRAM, *, deadline_ms: int = 0, wait: bool = True
    ) -> PrefetchResult:
        """Moves the cached prefix of ``tokens`` up to ``tier`` (HBM, DRAM or NVMe) within
        ``deadline_ms`` milliseconds (0: the daemon's lease time). ``wait`` True: answers when
        the moves are done or the deadline passed; False: as soon as they have started.
        Raises Unavailable (no such tier), InvalidArgument, Error for transport failures."""
        tp, n = _tokens(tokens)
        res = ffi.new("kvt_client_prefetch_t *")
        fn = lib.kvt_client_prefetch if wait else lib.kvt_client_prefetch_start
        with self._lock:
            rc = fn(self._live(), tp, n, int(tier), deadline_ms, res)
            if rc < 0:
                self._raise(rc)
        return PrefetchResult(res.pages, res.moved, res.resident, res.failed)

    def release(self, lease: int) -> bool:
        """Releases a lease. Returns True if it was held, False if not (already released or
        expired: not an error). Raises Error for transport failures."""
        released = ffi.new("int *")
        with self._lock:
            rc = lib.kvt_client_release(self._live(), lease, released)
            if rc < 0:
                self._raise(rc)
        return bool(released[0])

    def release_later(self, lease: int) -> None:
        """Releases a lease without a round trip: the RELEASE goes out in front of this
        client's next request (its reply is read then), so the lease holds until that call, its
        expiry or close(). Raises Error for transport failures."""
        with self._lock:
            rc = lib.kvt_client_release_later(self._live(), lease)
            if rc < 0:
                self._raise(rc)

    def remove(self, tokens: Tokens, *, wait: bool = True) -> None:
        """Drops the last whole page of ``tokens`` and everything cached beneath it. ``wait``
        False: blocks busy with the daemon's own I/O are Busy at once instead of waited for.
        Raises NotFound (not cached), Busy (leased, or in I/O), Error for transport failures."""
        tp, n = _tokens(tokens)
        fn = lib.kvt_client_remove if wait else lib.kvt_client_remove_nowait
        with self._lock:
            rc = fn(self._live(), tp, n)
            if rc < 0:
                self._raise(rc)

    def stats(self) -> Dict[str, int]:
        """The daemon's counters and gauges by name (the same as /metrics, without labels)."""
        out: Dict[str, int] = {}
        h = ffi.new_handle(out)
        with self._lock:
            rc = lib.kvt_client_stats(self._live(), _collect_stat, h)
            if rc < 0:
                self._raise(rc)
        return out

    def batch(self) -> "Batch":
        """A new Batch on this connection (see Batch)."""
        return Batch(self)


class Pending:
    """One request queued in a Batch; ``result()`` after the batch ran."""

    __slots__ = ("_status", "_res", "_conv", "_keep", "_done")

    def __init__(self, res: Any, conv: Callable[[Any], Any], keep: Any = None) -> None:
        self._status = ffi.new("int *")
        self._res = res
        self._conv = conv
        self._keep = keep
        self._done = False

    @property
    def done(self) -> bool:
        return self._done

    @property
    def status(self) -> int:
        """The request's status code (0 or a negative KVT_E* code), after the batch ran."""
        return int(self._status[0])

    def result(self) -> Any:
        """The request's result (Match, PutResult, ...), or raises its Error. Raises
        RuntimeError before the batch ran."""
        if not self._done:
            raise RuntimeError("kvtier: the batch has not run yet")
        st = self._status[0]
        if st < 0:
            raise error_for(st)
        return self._conv(self._res)


class Batch:
    """Requests queued and sent together, pipelined, in run(): one round trip for many MATCH,
    PUT, PREFETCH, REMOVE, RELEASE and PING requests, as an engine's scheduler does per step.

    Each queueing call returns a Pending; run() sends them all, waits for every reply, and
    returns their results in order. libkvtier copies tokens and payloads when a request is
    queued (the batch owns its frames), so buffers may be reused at once after queueing.
    """

    def __init__(self, client: Client) -> None:
        self._client = client
        self._b = ffi.NULL
        out = ffi.new("kvt_batch_t **")
        rc = lib.kvt_batch_create(out, client._live())
        if rc < 0:
            raise error_for(rc)
        self._b = ffi.gc(out[0], lib.kvt_batch_destroy)
        self._pending: List[Pending] = []

    def __len__(self) -> int:
        return len(self._pending)

    def __enter__(self) -> "Batch":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Frees the batch (the requests not run are dropped). Idempotent."""
        if self._b != ffi.NULL:
            ffi.release(self._b)
            self._b = ffi.NULL
        self._pending = []

    def reset(self) -> None:
        """Drops every request queued and not run (their Pending never complete)."""
        with self._client._lock:
            if self._b != ffi.NULL:
                lib.kvt_batch_reset(self._b)
        self._pending = []

    def _queue(self, p: Pending, fn: Any, *args: Any) -> Pending:
        # Under the client's lock: queueing takes a request id from the connection, which a call
        # running in another thread would be taking too.
        with self._client._lock:
            if self._b == ffi.NULL:
                raise RuntimeError("kvtier: the batch is closed")
            self._client._live()  # the batch's requests live on the client's connection
            rc = fn(self._b, *args)
        if rc < 0:
            raise error_for(rc, "queueing a batch request")
        self._pending.append(p)
        return p

    def ping(self) -> Pending:
        """Queues a PING; its result is None."""
        p = Pending(None, lambda r: None)
        return self._queue(p, lib.kvt_batch_ping, p._status)

    def match(self, tokens: Tokens, *, lease: bool = False, lease_ms: int = 0,
              remote: bool = False, probe: bool = False,
              hints: Optional[Hints] = None) -> Pending:
        """Queues a MATCH (arguments as Client.match); its result is a Match."""
        tp, n = _tokens(tokens)
        cap = n // self._client.page_size if self._client.page_size else 0
        tiers = ffi.new("uint8_t[]", max(cap, 1))
        res = ffi.new("kvt_client_match_t *")
        res.tiers = tiers
        res.tiers_cap = cap
        flags = (_LEASE if lease else 0) | (_REMOTE if remote else 0) | (_PROBE if probe else 0)
        h = hints._c() if hints is not None else ffi.NULL

        def conv(r: Any) -> Match:
            return Match(r.tokens, r.pages, r.remote_pages, r.lease,
                         _tiers(ffi.buffer(tiers, min(r.pages, cap))))

        p = Pending(res, conv, tiers)
        return self._queue(p, lib.kvt_batch_match, tp, n, flags, lease_ms, h, res, p._status)

    def put(self, tokens: Tokens, payload: Optional[Buffer] = None, *, first_page: int = 0,
            hints: Optional[Hints] = None) -> Pending:
        """Queues a PUT (arguments as Client.put; the payload is copied now); its result is a
        PutResult. Raises InvalidArgument for a payload that is not whole blocks."""
        tp, n = _tokens(tokens)
        pp, npages = _payload(payload, self._client.block_bytes)
        res = ffi.new("kvt_client_put_t *")
        h = hints._c() if hints is not None else ffi.NULL
        p = Pending(res, lambda r: PutResult(r.pages, r.new_pages, r.stored, r.skipped))
        return self._queue(p, lib.kvt_batch_put, tp, n, first_page, npages, pp, h, res,
                           p._status)

    def prefetch(self, tokens: Tokens, tier: int = Tier.DRAM, *, deadline_ms: int = 0,
                 wait: bool = True) -> Pending:
        """Queues a PREFETCH (arguments as Client.prefetch); its result is a PrefetchResult."""
        tp, n = _tokens(tokens)
        res = ffi.new("kvt_client_prefetch_t *")
        p = Pending(res, lambda r: PrefetchResult(r.pages, r.moved, r.resident, r.failed))
        fn = lib.kvt_batch_prefetch if wait else lib.kvt_batch_prefetch_start
        return self._queue(p, fn, tp, n, int(tier), deadline_ms, res, p._status)

    def remove(self, tokens: Tokens, *, wait: bool = True) -> Pending:
        """Queues a REMOVE (arguments as Client.remove); its result is None."""
        tp, n = _tokens(tokens)
        p = Pending(None, lambda r: None)
        fn = lib.kvt_batch_remove if wait else lib.kvt_batch_remove_nowait
        return self._queue(p, fn, tp, n, p._status)

    def release(self, lease: int) -> Pending:
        """Queues a RELEASE; its result is None (releasing a lease not held is not an error)."""
        p = Pending(None, lambda r: None)
        return self._queue(p, lib.kvt_batch_release, lease, p._status)

    def run(self, *, raise_on_error: bool = True) -> List[Any]:
        """Sends every queued request, waits for every reply, and returns their results in
        order. ``raise_on_error`` True: raises the first request's Error (after all replies
        came; the others' results stay in their Pending); False: errors are returned in the
        list as Error instances. The batch is empty afterwards and may be reused.
        Raises Error for transport failures (then the client is closed for use)."""
        c = self._client
        if self._b == ffi.NULL:
            raise RuntimeError("kvtier: the batch is closed")
        pending, self._pending = self._pending, []
        with c._lock:
            c._live()
            rc = lib.kvt_batch_run(self._b)
            if rc < 0:
                c._raise(rc)
        out: List[Any] = []
        first: Optional[Error] = None
        for p in pending:
            p._done = True
            try:
                out.append(p.result())
            except Error as e:
                first = first or e
                out.append(e)
        if first is not None and raise_on_error:
            raise first
        return out
