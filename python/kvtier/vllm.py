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
stages each layer as vLLM saves it and stores the page when its last layer is staged; a load
reads whole pages and scatters them layer by layer into vLLM's paged tensors. docs/engines.md
says why (measured) rather than one PUT per layer.

Failures never reach the engine: a daemon that is down makes the scheduler see 0 hits; a load
that fails or comes back short (daemon killed, page evicted) reports its blocks through
``get_block_ids_with_load_errors`` so vLLM recomputes them; a failed save is logged and dropped.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Set, Tuple

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.utils.hashing import sha256_cbor
from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, hash_block_tokens

from .client import Client, Hints
from .errors import ECLOSED, Error, error_for

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["KvtierConnector", "KvtierConnectorMetadata"]

log = logging.getLogger("kvtier.vllm")

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

    Every method raises kvtier.Error on failure; a transport failure closes the client and the
    next call reconnects (no sooner than ``retry_ms`` after the failure).
    """

    def __init__(self, conf: Dict[str, Any], model: str, salt: str, block_bytes: int) -> None:
        self._conf = conf
        self._model = model
        self._salt = salt
        self.block_bytes = block_bytes
        api = conf.get("api", "keys" if _HAVE_KEYS else "tokens")
        if api not in ("keys", "tokens") or (api == "keys" and not _HAVE_KEYS):
            raise ValueError("kvtier.vllm: api %r: 'keys' (needs the package's keyed calls) or "
                             "'tokens'" % api)
        self.keyed = api == "keys"
        self._client: Optional[Client] = None
        self._down_until = 0.0
        self._lock = threading.Lock()

    def _c(self) -> Client:
        c = self._client
        if c is not None and not c.closed:
            return c
        if time.monotonic() < self._down_until:
            raise error_for(ECLOSED, "kvtierd unreachable; not retried before retry_ms")
        kw: Dict[str, Any] = dict(
            block_bytes=self.block_bytes, unix_path=self._conf.get("unix_path"),
            tcp=self._conf.get("tcp"), secret=self._conf.get("secret"), salt=self._salt,
            timeout_ms=int(self._conf.get("timeout_ms", 5000)))
        try:
            if self.keyed and not self.block_bytes:
                # The scheduler: token calls on the keyed namespace itself (index only).
                c = Client(self._model, page_size=KEY_TOKENS, adapter=KEYS_TAG, **kw)
            elif self.keyed:
                c = Client(self._model, **kw)  # keyed calls open the keyed namespace
            else:
                c = Client(self._model, page_size=KEY_BYTES // 4, **kw)
        except Error:
            self._down_until = time.monotonic() + int(self._conf.get("retry_ms", 1000)) / 1000
            raise
        self._client = c
        return c

    def _failed(self, e: Error) -> None:
        c = self._client
        if c is None:
            return
        if not c.closed and (e.code in _TRANSPORT or e.code > -30800):  # > -30800: -errno
            c.close()
        if c.closed:  # a transport failure: reconnect later
            self._client = None
            self._down_until = time.monotonic() + int(self._conf.get("retry_ms", 1000)) / 1000

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
                if self.keyed:
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
                    if self.keyed:
                        r = c.put_keys(keys[:b], buf[a - first:b - first], a)
                    else:
                        r = c.put(self.tokens(keys[:b]), buf[a - first:b - first], first_page=a)
                    stored += r.stored
            except Error as e:
                self._failed(e)
                raise
        return stored

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
            if self._client is not None:
                self._client.close()
                self._client = None


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


@dataclass
class _Load:
    t: _Transfer
    future: "Future[int]"
    staging: torch.Tensor
    blocks: List[int]
    got: int = -1  # pages read, once the future is done
    layers_done: Set[int] = field(default_factory=set)


@dataclass
class _Save:
    t: _Transfer
    staging: torch.Tensor
    blocks: List[int]
    layers_done: Set[int] = field(default_factory=set)


# -- the connector ----------------------------------------------------------------------------


class KvtierConnector(KVConnectorBase_V1):
    """vLLM KV connector (v1) storing pages in kvtierd and loading them back.

    ``kv_connector_extra_config`` keys: ``unix_path`` (the daemon's Unix socket) or ``tcp``
    ("host:port"), ``secret``, ``model`` (the namespace's model; default: vLLM's model and KV
    dtype), ``timeout_ms`` (per call, default 5000), ``retry_ms`` (after a failure, no call to
    the daemon for this long, default 1000), ``lease_ms`` (the scheduler's lease, 0: the
    daemon's default), ``tp_rank`` / ``pp_rank`` (this worker's ranks, default: vLLM's),
    ``put_bytes`` (payload bytes per PUT, default 16 MiB), ``load_async`` (load between steps,
    reported by get_finished, instead of inside the step; default False), ``api`` ("keys" or
    "tokens": how chains reach the daemon, see _PageStore).
    """

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: Optional["KVCacheConfig"] = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._extra: Dict[str, Any] = dict(
            self._kv_transfer_config.kv_connector_extra_config or {})
        cc = vllm_config.cache_config
        self._block_size = int(self._extra.get("block_size") or cc.block_size)
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
            self._index = _PageStore(self._extra, self._model,
                                     rank_salt(0, self._tp_size, 0, self._pp_size), 0)

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
            log.warning("kvtier: lookup of %s failed, computing it: %s", request.request_id, e)
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
            log.warning("kvtier: no load planned for %s: %s", request.request_id, e)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        """This step's loads (planned by update_state_after_alloc) and saves (each request's
        full pages whose KV this step completes and kvtierd did not hold)."""
        meta = KvtierConnectorMetadata(loads=list(self._pending_loads.values()))
        self._pending_loads.clear()
        try:
            self._plan_saves(scheduler_output, meta)
        except Exception as e:  # noqa: BLE001
            log.warning("kvtier: saves of this step not planned: %s", e)
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
        tp_rank = self._extra.get("tp_rank")
        if tp_rank is None:
            try:
                from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

                tp_rank = get_tensor_model_parallel_rank()
            except Exception:  # noqa: BLE001 - no distributed state: one rank
                tp_rank = 0
        pp_rank = int(self._extra.get("pp_rank", 0))
        self._store = _PageStore(self._extra, self._model,
                                 rank_salt(int(tp_rank), self._tp_size, pp_rank, self._pp_size),
                                 self._layout.page_bytes)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvtier-vllm")
        if self._async:
            self._async_store = _PageStore(self._extra, self._model, self._store._salt,
                                           self._layout.page_bytes)
            self._async_pool = ThreadPoolExecutor(1, thread_name_prefix="kvtier-vllm-load")

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        """Starts reading this step's pages (whole pages, all layers) from kvtierd into staging
        buffers; wait_for_layer_load scatters each layer."""
        meta = self._connector_metadata
        if not isinstance(meta, KvtierConnectorMetadata) or self._layout is None:
            return
        self._finish_loads()  # anything a previous step left
        sync = [t for t in meta.loads if not t.async_load]
        for t in meta.loads:
            if t.async_load and self._async_pool is not None and t.req_id not in self._async_loads:
                self._async_loads[t.req_id] = self._async_pool.submit(self._load_between, t)
        arena = self._arena(0, sum(len(t.keys) - t.first for t in sync))
        at = 0
        for t in sync:
            n = len(t.keys) - t.first
            staging = arena[at:at + n]
            at += n
            assert self._pool is not None and self._store is not None
            fut = self._pool.submit(self._store.load, t.keys, t.first, staging)
            self._loads.append(_Load(t, fut, staging, list(t.block_ids)))

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
            log.warning("kvtier: load of %s failed, recomputing: %s", t.req_id, e)
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
        try:
            ld.got = int(ld.future.result())
        except Exception as e:  # noqa: BLE001
            log.warning("kvtier: load of %s failed, recomputing: %s", ld.t.req_id, e)
            ld.got = 0
        if ld.got < len(ld.t.block_ids):
            self._load_errors.update(ld.t.block_ids[ld.got:])

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
                self._layout.scatter(ld.staging[:ld.got], li, self._kv[layer_name],
                                     ld.blocks[:ld.got])
            ld.layers_done.add(li)

    def _finish_loads(self) -> None:
        for name in self._layout.names if self._layout else ():
            self.wait_for_layer_load(name)
        self._loads.clear()

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        """Stages this layer of each page saved this step; a page's last layer staged, its
        store to kvtierd starts."""
        meta = self._connector_metadata
        if not isinstance(meta, KvtierConnectorMetadata) or self._layout is None:
            return
        li = self._layout.index.get(layer_name)
        if li is None:
            return
        if meta.saves and not self._saves and not self._save_futures:
            # The step's first layer: the staging of every page saved this step.
            arena = self._arena(1, sum(len(t.keys) - t.first for t in meta.saves))
            at = 0
            for t in meta.saves:
                n = len(t.keys) - t.first
                self._saves[t.req_id] = _Save(t, arena[at:at + n], list(t.block_ids))
                at += n
        for t in meta.saves:
            sv = self._saves.get(t.req_id)
            if sv is None:  # stored already this step
                continue
            if li in sv.layers_done:
                continue
            self._layout.gather(sv.staging, li, kv_layer, sv.blocks)
            sv.layers_done.add(li)
            if len(sv.layers_done) == len(self._layout.names):
                assert self._pool is not None and self._store is not None
                self._save_futures.append(
                    (t, self._pool.submit(self._store.save, t.keys, t.first, sv.staging)))
                del self._saves[t.req_id]

    def wait_for_save(self) -> None:
        """Waits for this step's stores (a failed one is logged: a later miss, no error)."""
        self._finish_loads()
        self._saves.clear()  # pages whose layers did not all come (another pipeline stage)
        for t, fut in self._save_futures:
            try:
                fut.result()
            except Exception as e:  # noqa: BLE001
                log.warning("kvtier: save of %s failed: %s", t.req_id, e)
        self._save_futures.clear()

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
