"""kvtier.vllm.common: what both sides of the connector share: its settings and their defaults,
the identity of pages (the namespace's model and rank salt, the key chain of vLLM block hashes),
and the metadata the scheduler hands the workers each step."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.utils.hashing import sha256_cbor
from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, hash_block_tokens

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request

log = logging.getLogger("kvtier.vllm")
_WHERE = "kvtier.vllm: kv_connector_extra_config"

# Deadlines (docs/engines.md, "Deadlines and the circuit breaker", says why these values). The
# scheduler's calls run on vLLM's scheduler thread, between steps: a MATCH answers in tens of
# microseconds, and 20 ms is a fraction of one decode step. The worker's calls run on its I/O
# thread while the forward waits for them: 100 ms bounds what a step waits in all (a few
# hundred MiB of pages at the mapping's or the socket's rate), and each call to kvtierd.
SCHEDULER_DEADLINE_MS = 20
WORKER_DEADLINE_MS = 100
PROBE_MS = 200  # while the breaker is open: a background connection attempt this often
WARN_INTERVAL_S = 10.0  # at most one warning line this often (all counted)
# The pause a preempted request's "paused" hint announces: vLLM does not say when it resumes
# one (when blocks free up: a few steps, typically well under a second to a few seconds).
# The cost policy's raise lasts twice the pause and falls with the time left (docs/policy.md).
PREEMPT_PAUSE_MS = 1000

# kv_connector_extra_config keys this connector reads; any other is refused at start.
EXTRA_KEYS = ("unix_path", "tcp", "secret", "model", "lease_ms", "tp_rank", "pp_rank",
              "put_bytes", "load_async", "api", "zero_copy", "block_size",
              "scheduler_deadline_ms", "worker_deadline_ms", "probe_ms", "warn_interval_s",
              "preempt_pause_ms")
REPLACED_KEYS = {"timeout_ms": "scheduler_deadline_ms and worker_deadline_ms",
                 "retry_ms": "probe_ms (a background probe instead of a retry on the engine's "
                             "thread)"}


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
    """The namespace's salt: the shard a page holds. With TP replicas (tp_replicas), pass
    the shard (tp_rank // replicas) and the shards (tp_size // replicas)."""
    return "vllm tp%d/%d pp%d/%d" % (tp_rank, tp_size, pp_rank, pp_size)


def tp_replicas(vllm_config: "VllmConfig", kv_cache_config: Any, tp_size: int) -> int:
    """How many consecutive tensor-parallel ranks hold identical KV (1: each its own shard).

    vLLM's own figure where it gives one: ``kv_cache_config.kv_tp_replicas`` (vLLM 0.34
    computes it from each layer's ``max_tp_shards``: an MLA layer's latent KV is one shard,
    held whole by every rank, so all ``tp_size`` ranks are replicas; decode context parallelism
    shards it again, and then it is 1). Without a KV cache config (a connector built outside
    vLLM's engine): ``tp_size`` when the model config says ``use_mla``, else 1. A figure that
    does not divide ``tp_size`` is not trusted (1)."""
    r = getattr(kv_cache_config, "kv_tp_replicas", None) if kv_cache_config is not None \
        else None
    if r is None:
        mc = getattr(vllm_config, "model_config", None)
        r = tp_size if mc is not None and getattr(mc, "use_mla", False) else 1
    r = int(r)
    return r if 1 <= r <= tp_size and tp_size % r == 0 else 1


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


# -- KV cache groups (vLLM's hybrid KV cache manager, SupportsHMA) ----------------------------


@dataclass(frozen=True)
class KvGroup:
    """One of vLLM's KV cache groups whose pages the connector stores.

    ``gid`` is vLLM's index of the group (the index into a request's per-group block ids);
    ``layers`` its layer names (None: every layer the worker registers, for a configuration
    with one group or none); ``retained``, for a sliding-window group, how many tokens below
    the next position its attention still reads (vLLM's ``num_retained_tokens``: window - 1,
    plus any extra retained tokens), 0 for full attention; ``state`` True for a Mamba group,
    whose block holds a request's recurrent state at a page boundary (mamba.py)."""

    gid: int
    layers: Optional[Tuple[str, ...]] = None
    retained: int = 0
    state: bool = False

    @property
    def gaps(self) -> bool:
        """Whether the group stores only some pages of its chain (a window, or the states at
        the boundaries steps ended on): its saves go as chains with gaps, and vLLM frees its
        blocks while the request runs, so its save jobs read them before the next step."""
        return bool(self.retained) or self.state

    def window_start(self, pages: int, block_size: int) -> int:
        """The first page a prefix of ``pages`` pages needs in this group: 0 for full
        attention; for a sliding window, the page holding the oldest token the next position
        still attends (pages before it are vLLM's null blocks: neither loaded nor stored)."""
        if not self.retained:
            return 0
        return max(0, pages * block_size - self.retained) // block_size


def kv_groups(kv_cache_config: Any, block_size: int) -> List[KvGroup]:
    """The groups of vLLM's KV cache config that the connector stores, in vLLM's order.

    One group or none (the hybrid manager off, or a model with one kind of attention): one
    group of every registered layer, whatever its spec (today's pages), but for a model of
    Mamba layers only: its one group is a state group (mamba.py). Several (the hybrid
    manager on): full attention (FullAttentionSpec, MLAAttentionSpec) and sliding-window
    (SlidingWindowSpec, SlidingWindowMLASpec) groups, each with its own key chain; a group
    vLLM marks as not transferred (``enable_kv_transfer`` False) is left to vLLM, which
    rebuilds it. A Mamba group (MambaSpec) stores its state at page boundaries (mamba.py,
    whose refuse_unstorable refuses the configurations it cannot store). Any other spec
    (chunked local attention, cross attention, ...) raises ValueError naming the group: its
    state is not a page per block of tokens, and storing it as one would load wrong KV. A
    group whose block size is not ``block_size`` raises ValueError too."""
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, MambaSpec, MLAAttentionSpec,
                                            SlidingWindowMLASpec, SlidingWindowSpec)

    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    if len(groups) <= 1:
        if groups and type(groups[0].kv_cache_spec) is MambaSpec:  # a model of SSM layers only
            return [KvGroup(0, tuple(groups[0].layer_names), state=True)]
        return [KvGroup(0)]
    out = []
    for gid, g in enumerate(groups):
        if not getattr(g, "enable_kv_transfer", True):
            continue
        spec = g.kv_cache_spec
        kind = type(spec)
        state = kind is MambaSpec
        if state:
            retained = 0
        elif kind in (SlidingWindowSpec, SlidingWindowMLASpec):
            retained = int(spec.num_retained_tokens)
        elif kind in (FullAttentionSpec, MLAAttentionSpec):
            retained = 0
        else:
            raise ValueError(
                "kvtier.vllm: KV cache group %d (%s, layers %s) is not supported: kvtier stores "
                "full-attention, sliding-window and Mamba groups only (start vLLM with "
                "--disable-hybrid-kv-cache-manager for a model whose other layers it can merge, "
                "or serve this model without the kvtier connector)"
                % (gid, kind.__name__, ", ".join(list(g.layer_names)[:4])))
        if int(spec.block_size) != block_size:
            raise ValueError("%s: setting 'block_size': %d tokens, but KV cache group %d has "
                             "blocks of %d tokens" % (_WHERE, block_size, gid, spec.block_size))
        out.append(KvGroup(gid, tuple(g.layer_names), retained, state))
    return out


def group_chain(base: List[bytes], gid: int, have: List[bytes], pages: int) -> List[bytes]:
    """Extends ``have`` (group ``gid``'s keys so far) to ``pages`` keys. Group 0's chain is
    the base chain itself (the pages of a model with one group keep their names); another
    group's key of a page is sha256 of the group and the base key, so that each still covers
    its whole prefix and the groups' pages never share a name."""
    if gid == 0:
        return base
    tag = b"kvtier vllm group\0%d\0" % gid
    while len(have) < pages:
        have.append(hashlib.sha256(tag + base[len(have)]).digest())
    return have



def vllm_group_count(kv_cache_config: Any) -> int:
    """How many KV cache groups vLLM's ``kv_cache_config`` has, those the connector leaves to
    vLLM (``enable_kv_transfer`` False) included: vLLM's scheduler counts them all when it
    decides whether failed blocks can be reported (failures_per_request)."""
    return len(getattr(kv_cache_config, "kv_cache_groups", None) or ())


def failures_per_request(groups: List[KvGroup], vllm_groups: int) -> bool:
    """Whether a failed load is reported as its request (get_transfer_results's
    failed_recving: vLLM recomputes the request from its first token) instead of as its blocks
    (get_block_ids_with_load_errors). vLLM 0.34's scheduler raises RuntimeError at blocks
    reported with several KV cache groups (``vllm_groups``, vLLM's count: a block id names a
    block of one group only), and with a Mamba group it would recompute from the first failed
    block, whose state before it no block holds (vLLM's null blocks): both need the request.
    vLLM takes failed_recving only for a request waiting for an asynchronous load
    (WAITING_FOR_REMOTE_KVS), so such a connector loads between steps (load_between_steps)."""
    return vllm_groups > 1 or any(g.state for g in groups)


def load_between_steps(groups: List[KvGroup], vllm_groups: int, extra: Dict[str, Any]) -> bool:
    """Whether loads go between steps (``load_async``). Always where a failed load must be
    reported as its request (failures_per_request): vLLM 0.34 ignores a running request in
    failed_recving (it would run on blocks that never arrived), and raises RuntimeError at
    failed blocks with several groups, so a load in the step has no way to fail that vLLM
    accepts (a daemon killed mid-load would crash the engine). With a Mamba group also because
    vLLM copies a request's state from its hit's block into the block the step computes in
    before the forward (before start_load_kv), and its Mamba layers never call
    wait_for_layer_load, so the state must be in before the request's first step.
    ``load_async`` set false there raises ValueError naming why."""
    asked = bool(extra.get("load_async", False))
    if not failures_per_request(groups, vllm_groups):
        return asked
    if "load_async" in extra and not asked:
        if any(g.state for g in groups):
            why = "a Mamba group's state is loaded between steps only"
        else:
            why = ("with %d KV cache groups a load goes between steps only: vLLM 0.34 takes a "
                   "load that fails inside a step only as its failed blocks, and raises "
                   "RuntimeError at failed blocks with several groups" % vllm_groups)
        raise ValueError("%s: setting 'load_async': false, but %s" % (_WHERE, why))
    return True


# -- metadata: what the scheduler tells the workers each step ---------------------------------


@dataclass
class _Transfer:
    req_id: str
    keys: List[bytes]  # the chain up to the last page moved
    first: int  # the first page moved (pages before it are not)
    block_ids: List[int]  # the engine's block of each page moved
    async_load: bool = False  # a load between steps, reported by get_finished
    group: int = 0  # vLLM's KV cache group (keys are that group's chain)
    # A save's: the blocks up to its last page that this step loads (in the step), which its
    # pages were computed on: where one of them fails to load, the pages are not stored.
    reads: List[int] = field(default_factory=list)



@dataclass
class KvtierConnectorMetadata(KVConnectorMetadata):
    loads: List[_Transfer] = field(default_factory=list)
    saves: List[_Transfer] = field(default_factory=list)
    # Requests vLLM preempted since the last step: their blocks are freed (and may be handed
    # to another request this very step), so their saves not yet copied out are cancelled.
    preempted: List[str] = field(default_factory=list)
    # Requests vLLM waits for (an asynchronous load) whose load the scheduler could not plan:
    # each worker reports them as failed loads (get_transfer_results) in this step.
    unplanned: List[str] = field(default_factory=list)
    # The blocks of this step's loads in the step (one KV cache group) that the scheduler could
    # not plan: vLLM counts their tokens as computed, so each worker reports them as load
    # errors (get_block_ids_with_load_errors) and vLLM recomputes from the first of them.
    load_errors: List[int] = field(default_factory=list)


@dataclass
class _ReqState:
    request: "Request"
    keys: List[bytes] = field(default_factory=list)  # the base chain (group 0's)
    group_keys: Dict[int, List[bytes]] = field(default_factory=dict)  # other groups' chains
    leases: List[int] = field(default_factory=list)  # one per group looked up
    hit_pages: int = 0  # pages kvtierd held at lookup, in every group (stored already)
    computed_pages: int = 0  # pages vLLM had itself at lookup
    block_ids: Dict[int, List[int]] = field(default_factory=dict)  # per group, vLLM's gid
    saved_pages: int = 0  # pages [0, saved_pages) stored or known to be there
    no_save: bool = False
    # A save was planned for it: request_finished holds its blocks until the workers report
    # the request in get_finished's finished_sending (asynchronous saves, worker.py).
    saving: bool = False
    # Its load could not be planned (reported failed, or its blocks as load errors): its
    # lookups answer 0.
    recompute: bool = False
