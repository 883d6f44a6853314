"""kvtier.vllm.connector: KvtierConnector, the class vLLM's connector factory builds. vLLM makes
one per role (the scheduler's and each worker's); the calls of each role are in scheduler.py and
worker.py, and this file holds what both roles share: the settings (refused at start when
wrong), the guard, the namespace's identity."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Optional

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                               KVConnectorRole, SupportsHMA)

from ..guard import Guard, check_keys, flag, number
from .common import (EXTRA_KEYS, REPLACED_KEYS, WARN_INTERVAL_S, WORKER_DEADLINE_MS, _WHERE,
                     chain_root, kv_groups, load_between_steps, log, model_name, tp_replicas,
                     vllm_group_count)
from .mamba import refuse_unstorable
from .metrics import KvtierConnectorStats, KvtierPromMetrics, Tally
from .scheduler import SchedulerSide
from .worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


class KvtierConnector(SchedulerSide, WorkerSide, KVConnectorBase_V1, SupportsHMA):
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
    reported by get_finished, instead of inside the step; default False, but always on with
    several KV cache groups or a Mamba group, where false is refused: common.load_between_steps
    says why), ``api`` ("keys" or "tokens": how chains reach
    the daemon, see _PageStore), ``zero_copy`` (default True: on the Unix socket, map the
    arena and copy each layer once each way; False: the staging path), ``preempt_pause_ms``
    (the pause the "paused" hint of a preempted request announces, default 1000). Any other
    key (and the replaced ``timeout_ms`` / ``retry_ms``) is refused at start: ValueError
    naming it.
    """

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: Optional["KVCacheConfig"] = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._extra: Dict[str, Any] = dict(
            self._kv_transfer_config.kv_connector_extra_config or {})
        cc = vllm_config.cache_config
        self._block_size = int(self._extra.get("block_size") or cc.block_size)
        self._check_settings(cc, kv_cache_config)
        if (role == KVConnectorRole.SCHEDULER and
                getattr(self._kv_transfer_config, "kv_load_failure_policy", None) == "fail"):
            # vLLM's default: a failed load (the daemon gone between a lookup and its load)
            # then ends its request with an error instead of recomputing it. Said once, at
            # start: the connector cannot tell the default from a deliberate choice.
            log.warning("kvtier: vLLM's kv_load_failure_policy is \"fail\": a request whose "
                        "load from kvtierd fails ends with an error instead of being "
                        "recomputed; set \"kv_load_failure_policy\": \"recompute\" in "
                        "--kv-transfer-config (docs/engines.md)")
        # vLLM's KV cache groups (SupportsHMA: several with the hybrid manager), each with its
        # own key chain; refuses a group it cannot store (common.kv_groups).
        self._groups = kv_groups(kv_cache_config, self._block_size)
        refuse_unstorable(kv_cache_config, self._groups, self._block_size)
        self._guard = Guard(log, number(self._extra, "warn_interval_s", WARN_INTERVAL_S, _WHERE,
                                        integer=False))
        self._worker_deadline_ms = number(self._extra, "worker_deadline_ms", WORKER_DEADLINE_MS,
                                          _WHERE, minimum=1)
        self._model = model_name(vllm_config, self._extra)
        if len(self._groups) > 1 or self._groups[0].state:
            # A page of one group holds other layers than a page of the same model served
            # with the hybrid manager off (one group of every layer), a Mamba group's page a
            # state, not a block of tokens: another namespace.
            self._model = (self._model + "|groups=%d" % len(self._groups))[-255:]
        self._root = chain_root(self._model)
        pc = vllm_config.parallel_config
        self._tp_size = int(getattr(pc, "tensor_parallel_size", 1) or 1)
        self._pp_size = int(getattr(pc, "pipeline_parallel_size", 1) or 1)
        # TP ranks holding the same KV (MLA: all) share one namespace, their shard's.
        self._tp_replicas = tp_replicas(vllm_config, kv_cache_config, self._tp_size)
        self._tally = Tally(self._guard)  # this role's figures for vLLM's metrics (metrics.py)
        self._num_blocks = getattr(kv_cache_config, "num_blocks", None)
        self._vllm_groups = vllm_group_count(kv_cache_config)
        # Between steps with several groups or a Mamba group: a failed load is then reported
        # as its request, which vLLM accepts (common.load_between_steps).
        self._async = load_between_steps(self._groups, self._vllm_groups, self._extra)
        self._init_scheduler_side(role == KVConnectorRole.SCHEDULER)
        self._init_worker_side()

    @property
    def requires_kv_delivery(self) -> bool:
        """False: a best-effort cache (vLLM's own word for it). vLLM's base says True for a
        KV producer (kv_role kv_both included), and its scheduler then drops, and samples
        again, the in-flight output of every request it preempts, in case a hand-off of
        blocks the preemption freed were pending. This connector delivers nothing: a save still
        out when its request is preempted is cancelled before it reads the freed blocks (a
        later miss; worker.py), and only finished requests' blocks are held, until stored."""
        return False

    def _check_settings(self, cc: Any, kv_cache_config: Any) -> None:
        """Refuses (ValueError naming the key) a setting this connector does not know, a
        malformed number or switch, or a block size other than the engine's."""
        check_keys(self._extra, EXTRA_KEYS, _WHERE, REPLACED_KEYS)
        for k in ("scheduler_deadline_ms", "worker_deadline_ms", "probe_ms"):
            number(self._extra, k, 1, _WHERE, minimum=1)
        for k in ("lease_ms", "put_bytes", "tp_rank", "pp_rank", "preempt_pause_ms"):
            number(self._extra, k, 0, _WHERE)
        # The switches as bools from here on (the store and the worker read them with bool()).
        for k, default in (("zero_copy", True), ("load_async", False)):
            if k in self._extra:
                self._extra[k] = flag(self._extra, k, default, _WHERE)
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

    # == vLLM's KV connector metrics (metrics.py) =================================================

    def get_kv_connector_stats(self) -> Optional[KvtierConnectorStats]:
        """This role's figures since the last call (vLLM asks after every step: the workers'
        are summed, then the scheduler's added), or None when nothing happened."""
        return self._tally.take()

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[Dict[str, Any]] = None
                                 ) -> KvtierConnectorStats:
        """The figures from the dict vLLM sent to its front end (to_dict())."""
        return KvtierConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: "VllmConfig", metric_types: Dict[Any, Any],
                           labelnames: List[str], per_engine_labelvalues: Dict[int, List[object]]
                           ) -> KvtierPromMetrics:
        """The vllm:kvtier_*_total counters of vLLM's Prometheus logger."""
        return KvtierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        """Finishes the step's saves, stops the I/O threads, closes the connections (the
        daemon drops their leases)."""
        self._close_worker_side()
        self._close_scheduler_side()
