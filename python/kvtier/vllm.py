"""kvtier.vllm: vLLM's KV connector (v1) over kvtierd.

Turned on by configuration alone::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvtierConnector",
        "kv_connector_module_path": "kvtier.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"unix_path": "/run/kvtier/kvtierd.sock"}}'

This module imports vLLM (it is only imported by vLLM's connector factory); ``import kvtier``
does not. docs/engines.md describes the mapping of each engine call to kvtierd's operations.

Identity. A page (one vLLM block of ``block_size`` tokens) is named by a chain of 32-byte keys
computed with vLLM's own block hash (``hash_block_tokens`` over the block's tokens and
``generate_block_hash_extra_keys``: LoRA adapter, multimodal inputs, ``cache_salt``, prompt
embeddings), with sha256-CBOR and a root derived from the model instead of vLLM's NONE_HASH, so
that the keys are the same in every process and every restart (vLLM's own NONE_HASH is random
per process for its non-cryptographic hashes). Each key covers its whole prefix, as vLLM's does.
The namespace is (model + KV dtype, tensor-parallel and pipeline rank): each rank stores its own
shard of a page under the same chain; the scheduler asks rank 0's namespace.

A page's bytes are every layer (K and V) of one block of this rank, layer after layer: the worker
writes each layer as vLLM saves it and stores the page when its last layer is in; a load reads
whole pages and scatters them layer by layer into vLLM's paged tensors. docs/engines.md says why
(measured) rather than one PUT per layer. On the daemon's Unix socket the worker maps its
namespace's DRAM arena (zero-copy): each layer is copied once, straight into room reserved in
the mapping (committed when the request's last layer is in) and, on load, straight from the
pages where they lie in the mapping into vLLM's blocks. Without the mapping (TCP, refused) each
layer goes through a staging buffer and the socket.

Failures never reach the engine: a daemon that is down makes the scheduler see 0 hits; a load
that fails or comes back short (daemon killed, page evicted) reports its blocks through
``get_block_ids_with_load_errors`` so vLLM recomputes them; a failed save is logged and dropped.
Nothing waits long on the daemon: the scheduler's calls have a deadline of
``scheduler_deadline_ms`` (20), a forward step waits ``worker_deadline_ms`` (100) in all for its
I/O, and after a failure a circuit breaker answers misses at once while a background thread
reconnects (kvtier/guard.py; docs/engines.md, "Deadlines and the circuit breaker").
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.utils.hashing import sha256_cbor
from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, hash_block_tokens

from ._lib import ffi
from .client import Client, Hints, Reservation
from .errors import ECLOSED, Error, error_for
from .guard import Guard, check_keys, number

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["KvtierConnector", "KvtierConnectorMetadata"]

log = logging.getLogger("kvtier.vllm")
_WHERE = "kvtier.vllm: kv_connector_extra_config"

KEY_BYTES = 32  # sha256


def _stored(tiers: bytes) -> int:
    """Pages from the start whose bytes are stored (an index-only page cannot be loaded)."""
    n = 0
    for t in tiers:
        if t == 0:
            break
        n += 1
    return n


# -- the page store: the one place that speaks to kvtierd ------------------------------------

try:  # the package's block keys (docs/protocol.md, "Keyed blocks"), where this package has them
    from .keys import KEY_TOKENS, KEYS_TAG, key_tokens

    _HAVE_KEYS = hasattr(Client, "put_keys")
except ImportError:  # an older package: the same chain through the token calls, below
    _HAVE_KEYS = False

_TRANSPORT = (-30812, -30809, -30807)  # ECLOSED, ETIMEDOUT, EPROTO: the connection is gone

# Deadlines (docs/engines.md, "Deadlines and the circuit breaker", says why these values). The
# scheduler's calls run on vLLM's scheduler thread, between steps: a MATCH answers in tens of
# microseconds, and 20 ms is a fraction of one decode step. The worker's calls run on its I/O
# thread while the forward waits for them: 100 ms bounds what a step waits in all (a few
# hundred MiB of pages at the mapping's or the socket's rate), and each call to kvtierd.
SCHEDULER_DEADLINE_MS = 20
WORKER_DEADLINE_MS = 100
PROBE_MS = 200  # while the breaker is open: a background connection attempt this often
WARN_INTERVAL_S = 10.0  # at most one warning line this often (all counted)

# kv_connector_extra_config keys this connector reads; any other is refused at start.
EXTRA_KEYS = ("unix_path", "tcp", "secret", "model", "lease_ms", "tp_rank", "pp_rank",
              "put_bytes", "load_async", "api", "zero_copy", "block_size",
              "scheduler_deadline_ms", "worker_deadline_ms", "probe_ms", "warn_interval_s")
REPLACED_KEYS = {"timeout_ms": "scheduler_deadline_ms and worker_deadline_ms",
                 "retry_ms": "probe_ms (a background probe instead of a retry on the engine's "
                             "thread)"}


class _PageStore:
    """Pages named by a key chain (one 32-byte key per page, each covering its prefix).

    With the package's block keys (``api`` "keys", the default where the package has them):
    the chain is a keyed chain (docs/protocol.md, "Keyed blocks"): PUT through put_keys, loads
    through get_keys_into, and the scheduler's lookup a MATCH with a lease (and the policy's
    hints) in the keyed namespace, the chain as the documented synthetic tokens, which the
    keyed calls have no form of. Without them (``api`` "tokens"): each key is sent as 8 token
    ids (its 32 bytes as uint32) in a namespace of 8 tokens per page of its own. Either way the
    radix tree holds the chain with its prefix structure (shared prefixes stored once,
    leaf-first eviction), and leases pin what a load will read.

    The worker's zero-copy path (``mapped``): on the Unix socket (``zero_copy`` not False in
    the extra config) the worker's client is a token client of the keyed namespace itself
    (page_size KEY_TOKENS, adapter KEYS_TAG: the namespace put_keys uses, the chain as the
    same synthetic tokens), and when it maps that namespace's DRAM arena the pages are
    reserved, written and committed in the mapping (reserve/commit/abort) and read where they
    lie (load_views), so that the connector copies each layer once each way. Its other calls
    (save, load) then take the token forms on that client, which name exactly the pages the
    keyed calls name. Not mapped (TCP, refused), the client is the keyed one, as before.

    Every method raises kvtier.Error on failure. Each call to kvtierd is bounded by
    ``deadline_ms`` (libkvtier's per-call timeout). A transport failure (a missed deadline
    included) closes the client and opens the store's circuit breaker (kvtier/guard.py): calls
    then raise at once, without a socket, while a background thread connects again and hands
    the new client over. Only the first connection is made on the caller's thread. While views
    into the mapping are out (a reservation or a leased load not given back: ``_holds``) the
    close waits for the last of them: closing unmaps, and the worker may still be writing a
    view.
    """

    def __init__(self, conf: Dict[str, Any], model: str, salt: str, block_bytes: int, *,
                 guard: Guard, deadline_ms: int, what: str) -> None:
        self._conf = conf
        self.deadline_ms = deadline_ms
        self.breaker = guard.breaker(what, self._connect, self._install,
                                     int(conf.get("probe_ms", PROBE_MS)))
        self._connected = False  # the first connection was tried (on the caller's thread)
        self._closed = False
        self._model = model
        self._salt = salt
        self.block_bytes = block_bytes
        api = conf.get("api", "keys" if _HAVE_KEYS else "tokens")
        if api not in ("keys", "tokens") or (api == "keys" and not _HAVE_KEYS):
            raise ValueError("kvtier.vllm: api %r: 'keys' (needs the package's keyed calls) or "
                             "'tokens'" % api)
        self.keyed = api == "keys"
        self.mapped = False  # the worker's client maps the keyed namespace's arena
        self._holds = 0  # reservations and leased views handed out and not given back
        # The client that failed while views were out: closed (unmapped) when the last comes
        # back, and referenced until then (dropping it would close it, under the worker).
        self._doomed: Optional[Client] = None
        self._client: Optional[Client] = None
        self._lock = threading.Lock()

    @property
    def up(self) -> bool:
        """False while the breaker is open (calls would raise at once)."""
        return not self.breaker.open

    def _connect(self) -> Tuple[Client, bool]:
        """A new client (and whether it maps the arena), or raises kvtier.Error."""
        kw: Dict[str, Any] = dict(
            block_bytes=self.block_bytes, unix_path=self._conf.get("unix_path"),
            tcp=self._conf.get("tcp"), secret=self._conf.get("secret"), salt=self._salt,
            timeout_ms=self.deadline_ms)
        mapped = False
        if self.keyed and not self.block_bytes:
            # The scheduler: token calls on the keyed namespace itself (index only).
            c = Client(self._model, page_size=KEY_TOKENS, adapter=KEYS_TAG, **kw)
        elif self.keyed and (kw["unix_path"] or not kw["tcp"]) and \
                self._conf.get("zero_copy", True):
            # The worker, local: the keyed namespace's token client, which maps its arena.
            c = Client(self._model, page_size=KEY_TOKENS, adapter=KEYS_TAG, **kw)
            mapped = c.zero_copy
            if not mapped:  # refused: the keyed calls, as over TCP
                log.info("kvtier: no zero-copy mapping (%s); staging", c.zero_copy_reason)
                c.close()
                c = Client(self._model, **kw)
        elif self.keyed:
            c = Client(self._model, **kw)  # keyed calls open the keyed namespace
        else:
            c = Client(self._model, page_size=KEY_BYTES // 4, **kw)
        return c, mapped

    def _install(self, got: Tuple[Client, bool]) -> bool:
        """The probe's new client (on the probe thread): taken unless the store is closed or
        the failed client still waits for its views."""
        with self._lock:
            if self._closed or self._doomed is not None or self._client is not None:
                got[0].close()
                return self._closed or self._client is not None
            self._client, self.mapped = got
            return True

    def _c(self) -> Client:
        c = self._client
        if self._doomed is not None:
            raise error_for(ECLOSED, "the connection failed; closed once its views come back")
        if c is not None and not c.closed:
            return c
        if not self.breaker.allow():
            raise error_for(ECLOSED, "kvtierd unreachable; answering misses until the "
                            "background probe reaches it")
        if self._connected or self._closed:  # lost: only the probe thread connects again
            e = error_for(ECLOSED, "the connection to kvtierd was lost")
            self.breaker.trip(e)
            raise e
        self._connected = True
        try:
            c, self.mapped = self._connect()
        except Error as e:
            self.breaker.trip(e)
            raise
        self._client = c
        return c

    def _failed(self, e: Error) -> None:
        c = self._client
        if c is None:
            return
        if not c.closed and (e.code in _TRANSPORT or e.code > -30800):  # > -30800: -errno
            if self._holds:
                self._doomed = c  # closing would unmap views still in use: at _unhold
            else:
                c.close()
        if c.closed or self._doomed is not None:  # a transport failure: the probe reconnects
            self._client = None
            self.breaker.trip(e)

    def tokens(self, keys: Sequence[bytes]) -> Any:
        """The chain as the token ids the daemon sees."""
        if self.keyed:
            return [t for k in keys for t in key_tokens(k)]
        return memoryview(b"".join(keys)).cast("I")

    def lookup(self, keys: Sequence[bytes], *, lease: bool) -> Tuple[int, int]:
        """How many pages of the chain, from its start, kvtierd holds with their bytes; with
        ``lease``, pinned until release(). Returns (pages, lease handle or 0)."""
        if not keys:
            return 0, 0
        with self._lock:
            try:
                m = self._c().match(self.tokens(keys), lease=lease,
                                    lease_ms=int(self._conf.get("lease_ms", 0)))
            except Error as e:
                self._failed(e)
                raise
        pages = _stored(m.tiers)
        if lease and m.lease and pages == 0:
            self.release(m.lease)
            return 0, 0
        return pages, m.lease

    def release(self, handle: int) -> None:
        if not handle:
            return
        with self._lock:
            try:
                self._c().release(handle)
            except Error as e:  # the daemon gone: its leases went with the connection
                self._failed(e)

    def load(self, keys: Sequence[bytes], first: int, buf: Any) -> int:
        """Reads pages [first, len(keys)) into buf (their bytes, page after page). Returns the
        pages read: fewer when kvtierd no longer holds them all."""
        with self._lock:
            try:
                c = self._c()
                if self.keyed and not self.mapped:
                    return int(c.get_keys_into(keys, buf, first))
                m = c.match(self.tokens(keys), lease=True)
                try:
                    n = _stored(m.tiers) - first
                    if n <= 0:
                        return 0
                    return c.get_into(m.lease, buf, first_page=first, npages=n)
                finally:
                    if m.lease:
                        c.release(m.lease)
            except Error as e:
                self._failed(e)
                raise

    def save(self, keys: Sequence[bytes], first: int, buf: Any) -> int:
        """Stores pages [first, len(keys)) from buf. Returns the pages stored."""
        # One PUT per few pages: a PUT is one frame, and the daemon's max-frame (64 MiB by
        # default) bounds it; put_bytes (default 16 MiB) keeps well under it.
        step = max(1, int(self._conf.get("put_bytes", 16 << 20)) // max(self.block_bytes, 1))
        stored = 0
        with self._lock:
            try:
                c = self._c()
                for a in range(first, len(keys), step):
                    b = min(a + step, len(keys))
                    if self.keyed and not self.mapped:
                        r = c.put_keys(keys[:b], buf[a - first:b - first], a)
                    else:
                        r = c.put(self.tokens(keys[:b]), buf[a - first:b - first], first_page=a)
                    stored += r.stored
            except Error as e:
                self._failed(e)
                raise
        return stored

    # -- the zero-copy path (mapped): views into the arena ----------------------------------

    def _unhold(self) -> None:
        self._holds -= 1
        if self._holds == 0 and self._doomed is not None:
            self._doomed.close()  # unmaps: no view of it is in use any more
            self._doomed = None

    def reserve(self, keys: Sequence[bytes], first: int
                ) -> Optional[Tuple[Reservation, Optional[bytes]]]:
        """Reserves room in the mapping for pages [first, len(keys)) of the chain. Returns None
        when this client does not map (the staging path), else (the Reservation, and when some
        pages got no view, the tier of every page of the chain: a page with bytes is held
        already). A Reservation with views is out until commit() or abort()."""
        with self._lock:
            try:
                c = self._c()
                if not self.mapped:
                    return None
                toks = self.tokens(keys)
                r = c.reserve(toks, len(keys) - first, first_page=first)
                if r.id:
                    self._holds += 1
            except Error as e:
                self._failed(e)
                raise
            held = None
            if r.nreserved < len(keys) - first:
                try:  # which of the pages without room are held already
                    held = c.match(toks, probe=True).tiers
                except Error as e:  # none known held: stage them all (the commit will say)
                    self._failed(e)
            return r, held

    def commit(self, r: Reservation) -> int:
        """Makes a reservation's pages visible. Returns the pages stored."""
        with self._lock:
            try:
                return int(self._c().commit(r).stored)
            except Error as e:
                self._failed(e)
                raise
            finally:
                if r.id:
                    self._unhold()

    def abort(self, r: Reservation) -> None:
        """Gives a reservation's room back (nothing of it becomes visible)."""
        with self._lock:
            try:
                self._c().abort(r)
            except Error as e:  # the daemon gone: it gave the room back with the connection
                self._failed(e)
                raise
            finally:
                if r.id:
                    self._unhold()

    def load_views(self, keys: Sequence[bytes], first: int
                   ) -> Optional[Tuple[int, List[Any]]]:
        """MATCH with a lease and GET by location of pages [first, len(keys)), as far as they
        are stored. Returns None when this client does not map (the staging path), else (the
        lease, 0 when nothing came, and one item per page: a read-only memoryview into the
        mapping, or bytes for a page that came through the socket). The items are valid until
        release_views(lease)."""
        with self._lock:
            try:
                c = self._c()
                if not self.mapped:
                    return None
                m = c.match(self.tokens(keys), lease=True)
                n = _stored(m.tiers) - first
                if n <= 0 or not m.lease:
                    if m.lease:
                        c.release(m.lease)
                    return 0, []
                try:
                    items = c.get_views(m.lease, first_page=first, npages=n)
                except Error:
                    if not c.closed:
                        try:
                            c.release(m.lease)
                        except Error:
                            pass
                    raise
                self._holds += 1
                return m.lease, items
            except Error as e:
                self._failed(e)
                raise

    def release_views(self, lease: int) -> None:
        """Releases the lease of load_views (its views must not be touched after)."""
        with self._lock:
            try:
                self._c().release(lease)
            except Error as e:  # the daemon gone: its leases went with the connection
                self._failed(e)
            finally:
                self._unhold()

    def finished(self, keys: Sequence[bytes]) -> None:
        """The policy's hint that the request using this chain finished."""
        if not keys:
            return
        with self._lock:
            try:
                self._c().match(self.tokens(keys), probe=True, hints=Hints(finished=True))
            except Error as e:
                self._failed(e)
                raise

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for c in (self._client, self._doomed):
                if c is not None:
                    c.close()
            self._client = self._doomed = None
        self.breaker.close()


# -- identity ---------------------------------------------------------------------------------


def model_name(vllm_config: "VllmConfig", extra: Dict[str, Any]) -> str:
    """The namespace's model: the served model and the KV cache's dtype (the bytes' meaning)."""
    name = extra.get("model")
    if name is None:
        mc = getattr(vllm_config, "model_config", None)
        name = getattr(mc, "model", None) or "unknown-model"
        dtype = getattr(mc, "dtype", None) if mc is not None else None
        kv = getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", "auto")
        name = "%s|%s|kv=%s" % (name, str(dtype).replace("torch.", ""), kv)
    return str(name)[-255:]


def rank_salt(tp_rank: int, tp_size: int, pp_rank: int, pp_size: int) -> str:
    """The namespace's salt: the rank whose shard a page holds."""
    return "vllm tp%d/%d pp%d/%d" % (tp_rank, tp_size, pp_rank, pp_size)


def worker_ranks(extra: Dict[str, Any], tp_size: int, pp_size: int) -> Tuple[int, int]:
    """This worker's (tensor-parallel rank, pipeline stage): ``tp_rank`` / ``pp_rank`` from the
    extra config where set, else vLLM's own, from its parallel state (the groups vLLM's worker
    initialises before it builds the connector: ``get_tp_group().rank_in_group`` and
    ``get_pp_group().rank_in_group``). Without that state (a connector built outside vLLM's
    worker) a size of 1 means rank 0; a larger size raises ValueError: guessing 0 would
    store and load another rank's shard under this one's name."""
    ps: Any = None
    try:
        from vllm.distributed import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            ps = None
    except Exception:  # noqa: BLE001 - no parallel state in this process
        ps = None
    out = []
    for key, size, group in (("tp_rank", tp_size, "get_tp_group"),
                             ("pp_rank", pp_size, "get_pp_group")):
        v = extra.get(key)
        if v is None and ps is not None:
            v = getattr(ps, group)().rank_in_group
        if v is None:
            if size > 1:
                raise ValueError(
                    "kvtier.vllm: %s size %d, and no %s in kv_connector_extra_config nor vLLM's "
                    "parallel state initialised to take it from" % (
                        "tensor-parallel" if key == "tp_rank" else "pipeline", size, key))
            v = 0
        v = int(v)
        if not 0 <= v < size:
            raise ValueError("kvtier.vllm: %s %d outside 0..%d" % (key, v, size - 1))
        out.append(v)
    return out[0], out[1]


def key_chain(request: "Request", block_size: int, root: bytes, have: List[bytes],
              pages: int) -> List[bytes]:
    """Extends ``have`` (the request's keys so far) to ``pages`` keys: vLLM's block hash of each
    full block (tokens, LoRA, multimodal inputs, cache_salt, prompt embeddings), chained from
    ``root`` (kvtier's, per model: fixed across processes)."""
    if len(have) >= pages:
        return have
    tokens = request.all_token_ids
    parent = have[-1] if have else root
    start = len(have) * block_size
    mm_idx = 0  # the extra-keys helper skips the inputs that end before each block
    while len(have) < pages:
        end = start + block_size
        extra, mm_idx = generate_block_hash_extra_keys(request, start, end, mm_idx)
        parent = bytes(hash_block_tokens(sha256_cbor, parent, tokens[start:end], extra))
        have.append(parent)
        start = end
    return have


def chain_root(model: str) -> bytes:
    return hashlib.sha256(b"kvtier vllm v1\0" + model.encode()).digest()


# -- metadata: what the scheduler tells the workers each step ---------------------------------


@dataclass
class _Transfer:
    req_id: str
    keys: List[bytes]  # the chain up to the last page moved
    first: int  # the first page moved (pages before it are not)
    block_ids: List[int]  # the engine's block of each page moved
    async_load: bool = False  # a load between steps, reported by get_finished



@dataclass
class KvtierConnectorMetadata(KVConnectorMetadata):
    loads: List[_Transfer] = field(default_factory=list)
    saves: List[_Transfer] = field(default_factory=list)


@dataclass
class _ReqState:
    request: "Request"
    keys: List[bytes] = field(default_factory=list)
    lease: int = 0
    hit_pages: int = 0  # pages kvtierd held at lookup (stored already)
    computed_pages: int = 0  # pages vLLM had itself at lookup
    block_ids: List[int] = field(default_factory=list)
    saved_pages: int = 0  # pages [0, saved_pages) stored or known to be there
    no_save: bool = False


# -- the paged layout: vLLM's per-layer tensors <-> pages of all layers -----------------------


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
        self.signature = ";".join("%s%s@%d" % (str(kv_caches[n].dtype).replace("torch.", ""),
                                               "x".join(map(str, s)), d)
                                  for n, s, d in zip(self.names, self.shapes, self.dims))

    def _slot(self, staging: torch.Tensor, layer: int, dtype: torch.dtype) -> torch.Tensor:
        o, s = self.offsets[layer], self.sizes[layer]
        v = staging[:, o:o + s].view(dtype)
        return v.view(staging.shape[0], *self.shapes[layer])

    # One copy per block: index_select / index_copy_ over the block dimension measured 10-25x
    # slower on CPU (bf16, 64 KiB slices: 0.1-0.4 against 1-2.8 GiB/s).
    def gather(self, staging: torch.Tensor, layer: int, kv: torch.Tensor,
               blocks: List[int]) -> None:
        """Copies this layer's slice of each block in ``blocks`` into the staging pages."""
        dst, dim = self._slot(staging, layer, kv.dtype), self.dims[layer]
        for j, b in enumerate(blocks):
            dst[j].copy_(kv.select(dim, b))

    def scatter(self, staging: torch.Tensor, layer: int, kv: torch.Tensor,
                blocks: List[int]) -> None:
        """Copies this layer's slice of the staging pages into the blocks of ``kv``."""
        src, dim = self._slot(staging, layer, kv.dtype), self.dims[layer]
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
        ``blocks[j]``: returns them as runs, each with every layer's slot of its pages."""
        out: List[_Run] = []
        es = self.dtypes[0].itemsize if self.dtypes else 1
        uniform = len(set(self.dtypes)) == 1 and len(set(self.shapes)) == 1 and \
            all(o == i * self.sizes[0] for i, o in enumerate(self.offsets))
        addrs = [_addr(x) for x in items]
        j = 0
        while j < len(items):
            k, d = j + 1, self.page_bytes
            if uniform and isinstance(items[j], memoryview):
                while k < len(items) and isinstance(items[k], memoryview) and \
                        blocks[k] == blocks[k - 1] + 1:
                    step = addrs[k] - addrs[k - 1]
                    if (k > j + 1 and step != d) or step < self.page_bytes or step % es:
                        break
                    d = step
                    k += 1
            out.append(_Run(blocks[j], k - j, self._run_slots(addrs[j], k - j, d, uniform)))
            j = k
        return out

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

    def _chunk(self, layer: int, kv: torch.Tensor) -> int:
        """Blocks per copy_. A CUDA copy: the whole run (one transfer instead of one per
        block). A CPU copy: as many as stay under torch's parallel grain (32768 elements),
        because a larger one runs in an OpenMP parallel region, which on a machine with every
        core busy stalled for scheduler slices (bench_vllm passes of 1-3 s instead of 10 ms,
        gone with OMP_NUM_THREADS=1); a 64 KiB bf16 layer slice is one block per copy."""
        if kv.is_cuda:
            return 1 << 30
        return max(1, 32768 // max(1, self.sizes[layer] // self.dtypes[layer].itemsize))

    def gather_runs(self, runs: List[_Run], layer: int, kv: torch.Tensor) -> None:
        """Copies this layer of each run's blocks straight into its pages' slots."""
        dim, step = self.dims[layer], self._chunk(layer, kv)
        for r in runs:
            src, dst = kv.narrow(dim, r.block, r.n).movedim(dim, 0), r.slots[layer]
            if r.n <= step:
                dst.copy_(src)
                continue
            for a in range(0, r.n, step):
                dst[a:a + step].copy_(src[a:a + step])

    def scatter_runs(self, runs: List[_Run], layer: int, kv: torch.Tensor) -> None:
        """Copies this layer of each run's pages straight into its blocks of ``kv``."""
        dim, step = self.dims[layer], self._chunk(layer, kv)
        for r in runs:
            dst, src = kv.narrow(dim, r.block, r.n).movedim(dim, 0), r.slots[layer]
            if r.n <= step:
                dst.copy_(src)
                continue
            for a in range(0, r.n, step):
                dst[a:a + step].copy_(src[a:a + step])


def _addr(buf: Any) -> int:
    """Where a buffer's bytes lie (the caller keeps it alive while they are used). A tensor
    made over them through ctypes (_run_slots) borrows no buffer export, so that commit() can
    release a reservation's views, and a read-only view of a load is taken without
    torch.frombuffer's warning about writes (the connector only reads those). copy_ between
    such a CPU tensor and a CUDA tensor is a pageable copy."""
    return int(ffi.cast("uintptr_t", ffi.from_buffer(buf)))


@dataclass
class _Run:
    """Pages of consecutive blocks from ``block`` on, equally spaced in memory."""

    block: int
    n: int
    slots: List[torch.Tensor]  # each layer's slice of the pages: (n, *that layer's block shape)


@dataclass
class _Views:
    """What a load through the mapping got: the pages' slots (each layer's slice of each page,
    in the mapping or in bytes that came through the socket), valid while ``lease`` holds."""

    lease: int
    pages: int
    runs: List[_Run]
    items: List[Any]  # the views and bytes the runs lie in, kept alive with them


@dataclass
class _Load:
    t: _Transfer
    future: "Future[Any]"  # pages read (staging), or _Views (mapped)
    staging: torch.Tensor
    blocks: List[int]
    got: int = -1  # pages read, once the future is done
    layers_done: Set[int] = field(default_factory=set)
    views: Optional[_Views] = None


@dataclass
class _Save:
    t: _Transfer
    staging: torch.Tensor  # the pages saved through the socket, one row each
    blocks: List[int]  # the block of each staging row
    layers_done: Set[int] = field(default_factory=set)
    rows: Optional[List[int]] = None  # each staging row's page (from t.first); None: all
    resv: Optional[Reservation] = None  # the mapped path: the pages reserved in the arena
    runs: List[_Run] = field(default_factory=list)  # the reserved pages, in the mapping


# -- the connector ----------------------------------------------------------------------------


class KvtierConnector(KVConnectorBase_V1):
    """vLLM KV connector (v1) storing pages in kvtierd and loading them back.

    ``kv_connector_extra_config`` keys: ``unix_path`` (the daemon's Unix socket) or ``tcp``
    ("host:port"), ``secret``, ``model`` (the namespace's model; default: vLLM's model and KV
    dtype), ``scheduler_deadline_ms`` (each call on the scheduler's thread, default 20),
    ``worker_deadline_ms`` (what a forward step waits for the worker's I/O in all, and each call
    of it, default 100), ``probe_ms`` (while the circuit breaker is open, how often a background
    thread tries to reach the daemon, default 200), ``warn_interval_s`` (at most one warning
    line this often, default 10), ``block_size`` (must equal vLLM's), ``lease_ms`` (the
    scheduler's lease, 0: the
    daemon's default), ``tp_rank`` / ``pp_rank`` (this worker's ranks; default: vLLM's
    parallel state, see worker_ranks),
    ``put_bytes`` (payload bytes per PUT, default 16 MiB), ``load_async`` (load between steps,
    reported by get_finished, instead of inside the step; default False; such a load goes
    through a staging buffer even when mapped), ``api`` ("keys" or "tokens": how chains reach
    the daemon, see _PageStore), ``zero_copy`` (default True: on the Unix socket, map the
    arena and copy each layer once each way; False: the staging path). Any other key (and the
    replaced ``timeout_ms`` / ``retry_ms``) is refused at start: ValueError naming it.
    """

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: Optional["KVCacheConfig"] = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._extra: Dict[str, Any] = dict(
            self._kv_transfer_config.kv_connector_extra_config or {})
        cc = vllm_config.cache_config
        self._block_size = int(self._extra.get("block_size") or cc.block_size)
        self._check_settings(cc, kv_cache_config)
        self._guard = Guard(log, number(self._extra, "warn_interval_s", WARN_INTERVAL_S, _WHERE,
                                        integer=False))
        self._worker_deadline_ms = number(self._extra, "worker_deadline_ms", WORKER_DEADLINE_MS,
                                          _WHERE, minimum=1)
        self._waited = 0.0  # seconds this step's forward has waited for the worker's I/O
        self._model = model_name(vllm_config, self._extra)
        self._root = chain_root(self._model)
        pc = vllm_config.parallel_config
        self._tp_size = int(getattr(pc, "tensor_parallel_size", 1) or 1)
        self._pp_size = int(getattr(pc, "pipeline_parallel_size", 1) or 1)
        self._num_blocks = getattr(kv_cache_config, "num_blocks", None)
        self._async = bool(self._extra.get("load_async", False))
        # Scheduler side.
        self._reqs: Dict[str, _ReqState] = {}
        self._pending_loads: Dict[str, _Transfer] = {}
        self._index: Optional[_PageStore] = None
        # Worker side.
        self._layout: Optional[_Layout] = None
        self._kv: Dict[str, torch.Tensor] = {}
        self._store: Optional[_PageStore] = None
        self._pool: Optional[ThreadPoolExecutor] = None
        self._loads: List[_Load] = []
        self._saves: Dict[str, _Save] = {}
        self._save_futures: List[Tuple[_Transfer, "Future[int]"]] = []
        self._load_errors: Set[int] = set()
        # The zero-copy path: the step's reservations (made on the I/O thread from
        # start_load_kv, taken by the first save_kv_layer), whether this step's saves are laid
        # out, and the I/O the step still waits for (lease releases, aborts).
        self._resv_future: Optional["Future[Dict[str, Any]]"] = None
        self._saves_ready = False
        self._io_futures: List[Tuple[str, "Future[Any]"]] = []
        # Loads between steps (load_async): their own connection and thread, so that a step's
        # saves never queue behind them; reported by get_finished once done.
        self._async_store: Optional[_PageStore] = None
        self._async_pool: Optional[ThreadPoolExecutor] = None
        self._async_loads: Dict[str, "Future[int]"] = {}
        self._async_errors: Dict[str, List[int]] = {}
        # Staging memory kept from step to step (a fresh 64 MiB tensor each step costs its page
        # faults on every load and save): [0] loads, [1] saves; each step slices its pages off.
        self._arenas: List[torch.Tensor] = [torch.empty(0, dtype=torch.uint8)] * 2
        if role == KVConnectorRole.SCHEDULER:
            # Index-only (block_bytes 0) in rank 0's namespace: all ranks store the same pages.
            self._index = _PageStore(
                self._extra, self._model, rank_salt(0, self._tp_size, 0, self._pp_size), 0,
                guard=self._guard, what="vllm scheduler",
                deadline_ms=number(self._extra, "scheduler_deadline_ms", SCHEDULER_DEADLINE_MS,
                                   _WHERE, minimum=1))

    def _check_settings(self, cc: Any, kv_cache_config: Any) -> None:
        """Refuses (ValueError naming the key) a setting this connector does not know, a
        malformed number, or a block size other than the engine's."""
        check_keys(self._extra, EXTRA_KEYS, _WHERE, REPLACED_KEYS)
        for k in ("scheduler_deadline_ms", "worker_deadline_ms", "probe_ms"):
            number(self._extra, k, 1, _WHERE, minimum=1)
        for k in ("lease_ms", "put_bytes", "tp_rank", "pp_rank"):
            number(self._extra, k, 0, _WHERE)
        sizes = {int(cc.block_size)}
        for g in getattr(kv_cache_config, "kv_cache_groups", None) or ():
            bs = getattr(getattr(g, "kv_cache_spec", None), "block_size", None)
            if bs:
                sizes.add(int(bs))
        if self._block_size not in sizes:
            raise ValueError("%s: setting 'block_size': %d tokens, but the engine's KV cache "
                             "blocks are %s tokens" % (_WHERE, self._block_size,
                                                       "/".join(map(str, sorted(sizes)))))

    def kvtier_stats(self) -> Dict[str, int]:
        """The connector's counters (kvtier/guard.py COUNTERS): failures, breaker trips and
        recoveries, calls answered "miss" at once, waits cut at the deadline, saves dropped,
        warnings raised and logged."""
        return self._guard.stats()

    # == scheduler side ==========================================================================

    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> Tuple[Optional[int], bool]:
        """Tokens kvtierd can give beyond ``num_computed_tokens``: its longest held prefix of the
        request's full blocks (leaving one token for the engine to compute), leased until the
        request finishes. 0 when the daemon is unreachable or anything fails."""
        try:
            n = self._match(request, num_computed_tokens)
            return n, bool(n and self._async)
        except Exception as e:  # noqa: BLE001 - nothing may escape into the scheduler
            self._guard.count("failures")
            self._guard.warn("kvtier: lookup of %s failed, computing it: %s",
                             request.request_id, e)
            st = self._reqs.get(request.request_id)
            if st is not None:
                st.hit_pages = 0
            return 0, False

    def _match(self, request: "Request", num_computed_tokens: int) -> int:
        assert self._index is not None
        st = self._reqs.get(request.request_id)
        if st is None:
            st = self._reqs[request.request_id] = _ReqState(request)
        elif st.lease:  # asked again (not scheduled last time): a fresh answer, a fresh lease
            self._index.release(st.lease)
            st.lease = 0
        st.hit_pages = 0
        bs = self._block_size
        max_pages = max(request.num_tokens - 1, 0) // bs
        computed = num_computed_tokens // bs
        st.computed_pages = computed
        if max_pages <= computed:
            return 0
        keys = key_chain(request, bs, self._root, st.keys, max_pages)
        hit, lease = self._index.lookup(keys[:max_pages], lease=True)
        st.hit_pages = hit
        if hit <= computed:
            self._index.release(lease)
            return 0
        st.lease = lease
        return hit * bs - num_computed_tokens

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        """Records the blocks the worker loads the matched pages into (the blocks of pages
        [computed, computed + hits) among the request's blocks)."""
        st = self._reqs.get(request.request_id)
        if st is None:
            return
        if num_external_tokens <= 0:
            return
        try:
            ids = list(blocks.get_block_ids()[0])
            first = st.computed_pages
            last = min(st.hit_pages, len(ids))
            if last > first:
                self._pending_loads[request.request_id] = _Transfer(
                    request.request_id, list(st.keys[:last]), first, ids[first:last],
                    self._async)
        except Exception as e:  # noqa: BLE001
            self._guard.warn("kvtier: no load planned for %s: %s", request.request_id, e)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        """This step's loads (planned by update_state_after_alloc) and saves (each request's
        full pages whose KV this step completes and kvtierd did not hold)."""
        meta = KvtierConnectorMetadata(loads=list(self._pending_loads.values()))
        self._pending_loads.clear()
        try:
            self._plan_saves(scheduler_output, meta)
        except Exception as e:  # noqa: BLE001
            self._guard.warn("kvtier: saves of this step not planned: %s", e)
        return meta

    def _plan_saves(self, so: "SchedulerOutput", meta: KvtierConnectorMetadata) -> None:
        bs = self._block_size
        steps: List[Tuple[str, Optional[List[int]], int]] = []
        for nr in so.scheduled_new_reqs:
            st = self._reqs.get(nr.req_id)
            if st is not None:
                st.block_ids = list(nr.block_ids[0]) if nr.block_ids else []
                st.saved_pages = max(st.hit_pages, 0)
                st.no_save = False  # its blocks listed afresh
            steps.append((nr.req_id, None, nr.num_computed_tokens))
        cr = so.scheduled_cached_reqs
        for i, rid in enumerate(cr.req_ids):
            nb = cr.new_block_ids[i]
            steps.append((rid, list(nb[0]) if nb else [], cr.num_computed_tokens[i]))
        for rid in so.preempted_req_ids or ():
            st = self._reqs.get(rid)
            if st is not None:  # its blocks are gone; stop saving it
                st.no_save = True
        for rid, new_ids, computed in steps:
            st = self._reqs.get(rid)
            if st is None or st.no_save:
                continue
            if new_ids:
                st.block_ids.extend(new_ids)
            done = computed + so.num_scheduled_tokens.get(rid, 0)
            pages = min(done, st.request.num_tokens) // bs
            pages = min(pages, len(st.block_ids))
            if pages <= st.saved_pages:
                continue
            keys = key_chain(st.request, bs, self._root, st.keys, pages)
            meta.saves.append(_Transfer(rid, list(keys[:pages]), st.saved_pages,
                                        st.block_ids[st.saved_pages:pages]))
            st.saved_pages = pages

    def request_finished(self, request: "Request",
                         block_ids: List[int]) -> Tuple[bool, Optional[Dict[str, Any]]]:
        """Finished or aborted: releases the request's lease and sends the policy's finished
        hint. Blocks are freed at once (saves copy them out within the step)."""
        st = self._reqs.pop(request.request_id, None)
        self._pending_loads.pop(request.request_id, None)
        if st is None or self._index is None:
            return False, None
        try:
            if st.lease:
                self._index.release(st.lease)
            if st.keys:
                self._index.finished(st.keys)
        except Exception as e:  # noqa: BLE001
            log.debug("kvtier: finish of %s: %s", request.request_id, e)
        return False, None

    # == worker side =============================================================================

    def register_kv_caches(self, kv_caches: Dict[str, torch.Tensor]) -> None:
        """Learns the paged layout; the worker's namespace is its rank's."""
        self.shutdown()  # registered again (a restored cache): start afresh
        self._kv = dict(kv_caches)
        self._layout = _Layout(self._kv, self._num_blocks)
        tp_rank, pp_rank = worker_ranks(self._extra, self._tp_size, self._pp_size)
        self._store = _PageStore(self._extra, self._model,
                                 rank_salt(tp_rank, self._tp_size, pp_rank, self._pp_size),
                                 self._layout.page_bytes, **self._worker_store())
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvtier-vllm")
        if self._async:
            self._async_store = _PageStore(self._extra, self._model, self._store._salt,
                                           self._layout.page_bytes,
                                           **self._worker_store(" (async loads)"))
            self._async_pool = ThreadPoolExecutor(1, thread_name_prefix="kvtier-vllm-load")

    def _worker_store(self, what: str = "") -> Dict[str, Any]:
        return dict(guard=self._guard, deadline_ms=self._worker_deadline_ms,
                    what="vllm worker" + what)

    def _wait(self, fut: "Future[Any]") -> bool:
        """Waits for an I/O job within what is left of this step's worker_deadline_ms. False
        (counted) when it is not done by then: the forward goes on without it."""
        if fut.done():
            return True
        left = self._worker_deadline_ms / 1000.0 - self._waited
        t0 = time.monotonic()
        if left > 0:
            wait_futures([fut], timeout=left)
        self._waited += time.monotonic() - t0
        if fut.done():
            return True
        self._guard.count("deadline_misses")
        return False

    def _later(self, fut: "Future[Any]", fn: Callable[[Any], None]) -> None:
        """Runs fn(result) on the I/O thread once an abandoned job is done (a lease or a
        reservation given back), never on the forward's thread."""
        pool = self._pool

        def done(f: "Future[Any]") -> None:
            try:
                r = f.result()
            except Exception:  # noqa: BLE001 - failed: nothing of it is held
                return
            try:
                if pool is not None:
                    pool.submit(fn, r)
            except RuntimeError:  # shut down: the closed connection gave it back
                pass

        fut.add_done_callback(done)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        """Starts reading this step's pages (whole pages, all layers) from kvtierd: with the
        zero-copy mapping, a MATCH with a lease and a GET by location (the pages stay where
        they lie in the mapping); else into staging buffers. wait_for_layer_load scatters each
        layer. Then, mapped, starts reserving room in the mapping for this step's saves.
        The step's waits for all of it share worker_deadline_ms; with the circuit breaker open,
        the loads are load errors at once and nothing is sent."""
        meta = self._connector_metadata
        if not isinstance(meta, KvtierConnectorMetadata) or self._layout is None:
            return
        self._waited = 0.0  # a new step: its own wait budget
        self._finish_loads()  # anything a previous step left
        sync = [t for t in meta.loads if not t.async_load]
        for t in meta.loads:
            if t.async_load and self._async_pool is not None and t.req_id not in self._async_loads:
                self._async_loads[t.req_id] = self._async_pool.submit(self._load_between, t)
        assert self._pool is not None and self._store is not None
        if sync and not self._store.up:  # kvtierd unreachable: recompute, ask nothing
            self._guard.count("short_circuited")
            for t in sync:
                self._load_errors.update(t.block_ids)
            sync = []
        # Mapped (or not known yet), no staging: the load job makes one if it finds no mapping.
        arena = None if self._zero_copy() else \
            self._arena(0, sum(len(t.keys) - t.first for t in sync))
        at = 0
        for t in sync:
            n = len(t.keys) - t.first
            ld = _Load(t, None, None if arena is None else arena[at:at + n],  # type: ignore
                       list(t.block_ids))
            at += n
            ld.future = self._pool.submit(self._load_job, ld)
            self._loads.append(ld)
        if meta.saves and self._resv_future is None and self._zero_copy():
            self._resv_future = self._pool.submit(self._reserve_job, list(meta.saves))

    def _zero_copy(self) -> bool:
        """Whether to try the mapped path (not known before the first connection)."""
        st = self._store
        return st is not None and st.keyed and bool(self._extra.get("zero_copy", True)) and \
            (st.mapped or st._client is None)

    def _load_job(self, ld: _Load) -> Any:
        """A step's load, on the I/O thread: the pages' views (mapped: _Views), or the pages
        read into staging (their count)."""
        assert self._store is not None and self._layout is not None
        t = ld.t
        got = self._store.load_views(t.keys, t.first)
        if got is None:  # not mapped
            if ld.staging is None:
                ld.staging = torch.empty((len(t.keys) - t.first, self._layout.page_bytes),
                                         dtype=torch.uint8)
            return self._store.load(t.keys, t.first, ld.staging)
        lease, items = got
        try:
            runs = self._layout.runs(items, ld.blocks[:len(items)])
        except Exception:
            if lease:
                self._store.release_views(lease)
            raise
        return _Views(lease, len(items), runs, items)

    def _reserve_job(self, saves: List[_Transfer]) -> Dict[str, Any]:
        """Reserves room in the mapping for this step's saves, on the I/O thread. Returns, per
        request, (Reservation, runs of the reserved pages, the pages to stage):
        a page without room is staged and PUT through the socket; one held already, or reserved
        by an earlier request of this step (a shared prefix), is left alone. A request missing
        from the answer is staged whole (no mapping, or its reservation failed)."""
        assert self._store is not None and self._layout is not None
        out: Dict[str, Any] = {}
        mine: Set[bytes] = set()
        for t in saves:
            try:
                got = self._store.reserve(t.keys, t.first)
            except Exception as e:  # noqa: BLE001 - staged instead
                log.info("kvtier: no reservation for %s, staging it: %s", t.req_id, e)
                continue
            if got is None:
                return out
            r, held = got
            try:
                views, vblocks, rows = [], [], []
                for j, v in enumerate(r.views):
                    p = t.first + j
                    if v is not None:
                        views.append(v)
                        vblocks.append(t.block_ids[j])
                        mine.add(t.keys[p])
                    elif t.keys[p] in mine or (held is not None and p < len(held) and held[p]):
                        pass
                    else:
                        rows.append(j)
                runs = self._layout.runs(views, vblocks)
            except Exception as e:  # noqa: BLE001
                self._guard.warn("kvtier: reservation for %s unusable, staging it: %s",
                                 t.req_id, e)
                try:
                    self._store.abort(r)
                except Exception:  # noqa: BLE001
                    pass
                continue
            out[t.req_id] = (r, runs, rows)
        return out

    def _load_between(self, t: _Transfer) -> int:
        """An asynchronous load, on its own thread: whole pages into a staging buffer of its
        own, then every layer into the blocks (which vLLM does not touch until get_finished
        reports the request). Never raises: pages that did not come are load errors."""
        assert self._layout is not None and self._async_store is not None
        got = 0
        try:
            staging = torch.empty((len(t.keys) - t.first, self._layout.page_bytes),
                                  dtype=torch.uint8)
            got = int(self._async_store.load(t.keys, t.first, staging))
            if got > 0:
                for li, name in enumerate(self._layout.names):
                    self._layout.scatter(staging[:got], li, self._kv[name], t.block_ids[:got])
                kv = self._kv[self._layout.names[0]]
                if kv.is_cuda:
                    torch.cuda.current_stream(kv.device).synchronize()
        except Exception as e:  # noqa: BLE001
            self._guard.count("failures")
            self._guard.warn("kvtier: load of %s failed, recomputing: %s", t.req_id, e)
        if got < len(t.block_ids):
            self._async_errors[t.req_id] = t.block_ids[got:]
        return got

    def _arena(self, which: int, pages: int) -> torch.Tensor:
        assert self._layout is not None
        a = self._arenas[which]
        if a.shape[0] < pages or a.dim() != 2:
            a = self._arenas[which] = torch.empty((pages, self._layout.page_bytes),
                                                  dtype=torch.uint8)
        return a

    def _resolve(self, ld: _Load) -> None:
        if ld.got >= 0:
            return
        if not self._wait(ld.future):
            # Not here by the deadline: recomputed. Its staging stays the job's (the next step
            # takes fresh memory), and a lease it gets is given back when it comes.
            self._guard.warn("kvtier: load of %s not done within worker_deadline_ms (%d ms), "
                             "recomputing it", ld.t.req_id, self._worker_deadline_ms)
            if ld.staging is not None:
                self._arenas[0] = torch.empty(0, dtype=torch.uint8)
            self._later(ld.future, self._release_late)
            ld.got = 0
        else:
            try:
                r = ld.future.result()
                if isinstance(r, _Views):
                    ld.views = r
                    ld.got = r.pages
                else:
                    ld.got = int(r)
            except Exception as e:  # noqa: BLE001
                self._guard.count("failures")
                self._guard.warn("kvtier: load of %s failed, recomputing: %s", ld.t.req_id, e)
                ld.got = 0
        if ld.got < len(ld.t.block_ids):
            self._load_errors.update(ld.t.block_ids[ld.got:])

    def _release_late(self, r: Any) -> None:
        """A load that came after its deadline: its lease given back (its views unused)."""
        if isinstance(r, _Views) and r.lease and self._store is not None:
            r.runs.clear()
            self._store.release_views(r.lease)

    def _abort_late(self, resv: Dict[str, Any]) -> None:
        """Reservations that came after their deadline: given back, nothing visible."""
        for x in resv.values():
            if x[0].id:
                self._abort(x[0])

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Scatters this layer of every page loaded this step into vLLM's blocks."""
        if not self._loads or self._layout is None:
            return
        li = self._layout.index.get(layer_name)
        if li is None:
            return
        for ld in self._loads:
            self._resolve(ld)
            if ld.got > 0 and li not in ld.layers_done:
                if ld.views is not None:  # straight from the mapping
                    self._layout.scatter_runs(ld.views.runs, li, self._kv[layer_name])
                else:
                    self._layout.scatter(ld.staging[:ld.got], li, self._kv[layer_name],
                                         ld.blocks[:ld.got])
            ld.layers_done.add(li)
            if ld.views is not None and len(ld.layers_done) == len(self._layout.names):
                self._give_back(ld)

    def _give_back(self, ld: _Load) -> None:
        """The load's pages all scattered: its lease released (on the I/O thread; the step's
        wait_for_save waits for it). Its views are not touched after this."""
        v, ld.views = ld.views, None
        if v is not None and v.lease:
            v.runs.clear()
            assert self._pool is not None and self._store is not None
            self._io_futures.append((ld.t.req_id, self._pool.submit(self._store.release_views,
                                                                     v.lease)))

    def _finish_loads(self) -> None:
        try:
            for name in self._layout.names if self._layout else ():
                self.wait_for_layer_load(name)
        finally:
            for ld in self._loads:  # a scatter that raised: the lease given back all the same
                self._give_back(ld)
            self._loads.clear()

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        """Copies this layer of each page saved this step straight into the room reserved for
        it in kvtierd's mapping (the zero-copy path), or into a staging buffer (no mapping, or
        a page the reservation gave no room); a request's last layer in, its pages are
        committed (and the staged ones PUT) on the I/O thread."""
        meta = self._connector_metadata
        if not isinstance(meta, KvtierConnectorMetadata) or self._layout is None:
            return
        li = self._layout.index.get(layer_name)
        if li is None:
            return
        if meta.saves and not self._saves_ready:
            self._lay_out_saves(meta.saves)
        for t in meta.saves:
            sv = self._saves.get(t.req_id)
            if sv is None:  # stored already this step
                continue
            if li in sv.layers_done:
                continue
            if sv.runs:
                self._layout.gather_runs(sv.runs, li, kv_layer)
            if sv.blocks:
                self._layout.gather(sv.staging, li, kv_layer, sv.blocks)
            sv.layers_done.add(li)
            if len(sv.layers_done) == len(self._layout.names):
                assert self._pool is not None
                self._save_futures.append((t, self._pool.submit(self._store_save, sv)))
                del self._saves[t.req_id]

    def _lay_out_saves(self, saves: List[_Transfer]) -> None:
        """The step's first layer: where each page saved this step goes (its reserved room,
        else a row of the staging buffer)."""
        self._saves_ready = True
        resv: Dict[str, Any] = {}
        if self._store is not None and not self._store.up:
            # kvtierd unreachable: the step's saves are dropped at once (no copy, no I/O).
            self._guard.count("short_circuited")
            self._guard.count("saves_dropped", len(saves))
            self._abort_incomplete()
            self._saves_ready = True
            return
        if self._resv_future is None and self._zero_copy():  # start_load_kv did not run
            assert self._pool is not None
            self._resv_future = self._pool.submit(self._reserve_job, list(saves))
        if self._resv_future is not None:
            f, self._resv_future = self._resv_future, None
            if not self._wait(f):  # staged instead; the reservations given back when they come
                self._guard.warn("kvtier: reservations not made within worker_deadline_ms "
                                 "(%d ms), staging the step's saves", self._worker_deadline_ms)
                self._later(f, self._abort_late)
            else:
                try:
                    resv = f.result()
                except Exception as e:  # noqa: BLE001
                    self._guard.count("failures")
                    self._guard.warn("kvtier: reservations failed, staging the step's saves: "
                                     "%s", e)
        plan = []
        for t in saves:
            x = resv.get(t.req_id)
            if x is None:
                plan.append((t, None, [], list(range(len(t.keys) - t.first)), False))
            else:
                plan.append((t, *x, True))
        rows = sum(len(p[3]) for p in plan)
        arena = self._arena(1, rows) if rows else None
        at = 0
        for t, r, runs, prow, mapped in plan:
            n = len(prow)
            staging = arena[at:at + n] if arena is not None else None
            at += n
            self._saves[t.req_id] = _Save(
                t, staging, [t.block_ids[j] for j in prow],  # type: ignore[arg-type]
                rows=prow if mapped else None, resv=r if r is not None and r.id else None,
                runs=runs)

    def _store_save(self, sv: _Save) -> int:
        """A request's pages all in, on the I/O thread: commits its reservation and PUTs its
        staged pages (runs of consecutive pages). Returns the pages stored."""
        assert self._store is not None
        t, stored, err = sv.t, 0, None
        sv.runs = []  # the views are not touched after the commit
        if sv.resv is not None:
            try:
                stored += self._store.commit(sv.resv)
            except Exception as e:  # noqa: BLE001 - the staged pages may still go
                err = e
        if sv.rows is None:
            stored += self._store.save(t.keys, t.first, sv.staging)
        else:
            i = 0
            while i < len(sv.rows):
                k = i + 1
                while k < len(sv.rows) and sv.rows[k] == sv.rows[k - 1] + 1:
                    k += 1
                a, b = t.first + sv.rows[i], t.first + sv.rows[k - 1] + 1
                stored += self._store.save(t.keys[:b], a, sv.staging[i:k])
                i = k
        if err is not None:
            raise err
        return stored

    def _abort(self, r: Reservation) -> None:
        assert self._store is not None
        try:
            self._store.abort(r)
        except Exception as e:  # noqa: BLE001 - expires in the daemon's reserve-ms, or gone
            log.info("kvtier: abort of reservation %d: %s", r.id, e)

    def wait_for_save(self) -> None:
        """Waits for this step's stores (a failed one is logged: a later miss, no error).
        Reservations of pages whose layers did not all come (another pipeline stage) are
        aborted: nothing of them becomes visible."""
        try:
            self._finish_loads()
        finally:
            self._abort_incomplete()
        for t, fut in self._save_futures:
            if not self._wait(fut):
                # Dropped: the job goes on alone (its pages stored if it ends well, else a
                # later miss) with its staging, which the next step does not reuse. vLLM's
                # blocks were copied out in save_kv_layer: none is held.
                self._guard.count("saves_dropped")
                self._guard.warn("kvtier: save of %s not done within worker_deadline_ms "
                                 "(%d ms), dropped", t.req_id, self._worker_deadline_ms)
                self._arenas[1] = torch.empty(0, dtype=torch.uint8)
                continue
            try:
                fut.result()
            except Exception as e:  # noqa: BLE001
                self._guard.count("failures")
                self._guard.count("saves_dropped")
                self._guard.warn("kvtier: save of %s failed: %s", t.req_id, e)
        self._save_futures.clear()
        for rid, fut in self._io_futures:
            if not self._wait(fut):  # a release or an abort: it runs on alone
                continue
            try:
                fut.result()
            except Exception as e:  # noqa: BLE001
                log.info("kvtier: %s: %s", rid, e)
        self._io_futures.clear()

    def _abort_incomplete(self) -> None:
        resv: List[Reservation] = []
        if self._resv_future is not None:  # reserved, and no layer of this step saved here
            f, self._resv_future = self._resv_future, None
            if not self._wait(f):
                self._later(f, self._abort_late)
            else:
                try:
                    resv = [x[0] for x in f.result().values()]
                except Exception:  # noqa: BLE001 - nothing reserved
                    pass
        for sv in self._saves.values():
            sv.runs = []
            if sv.resv is not None:
                resv.append(sv.resv)
        self._saves.clear()
        self._saves_ready = False
        for r in resv:
            if r.id:
                assert self._pool is not None
                self._io_futures.append(("abort", self._pool.submit(self._abort, r)))

    def get_finished(self, finished_req_ids: Set[str]
                     ) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        """(None, the requests whose asynchronous load is done). Their blocks that did not
        arrive are reported by the get_block_ids_with_load_errors call that follows. Saves and
        synchronous loads complete within their step: blocks are never held past it."""
        done = {rid for rid, f in self._async_loads.items() if f.done()}
        for rid in done:
            del self._async_loads[rid]
            self._load_errors.update(self._async_errors.pop(rid, ()))
        return None, (done or None)

    def get_block_ids_with_load_errors(self) -> Set[int]:
        """Blocks whose pages did not arrive this step (daemon gone, page evicted): vLLM
        recomputes them."""
        self._finish_loads()
        out, self._load_errors = self._load_errors, set()
        return out

    def shutdown(self) -> None:
        """Finishes the step's saves, stops the I/O threads, closes the connections (the
        daemon drops their leases)."""
        try:
            self.wait_for_save()
        except Exception:  # noqa: BLE001
            pass
        for pool in (self._pool, self._async_pool):
            if pool is not None:
                pool.shutdown(wait=True)
        self._pool = self._async_pool = None
        self._async_loads.clear()
        self._async_errors.clear()
        for s in (self._store, self._async_store, self._index):
            if s is not None:
                s.close()
        if self._index is not None:
            for st in self._reqs.values():
                st.lease = 0
            self._reqs.clear()
