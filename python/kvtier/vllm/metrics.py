"""kvtier.vllm.metrics: the connector's figures in vLLM's own KV connector metrics.

vLLM asks each worker's connector for ``get_kv_connector_stats()`` after every step, sums the
workers' answers with ``aggregate`` (KVOutputAggregator), adds the scheduler's connector's own
(``Scheduler.update_from_output``), and sends ``to_dict()`` to its front end, where
``build_kv_connector_stats`` turns the dict back into this class for the periodic log line
("KV Transfer metrics: ...", ``reduce``) and ``build_prom_metrics`` records it as Prometheus
counters (``vllm:kvtier_*_total``, with vLLM's ``model_name`` and ``engine`` labels). Every
figure is a counter over the interval since the last call; the names and their meaning are
defined once, in FIGURES.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from ..guard import Guard

# (name, side that counts it, what it counts). The Prometheus counter is vllm:kvtier_<name>_total.
FIGURES = (
    ("lookups", "scheduler", "requests the scheduler looked up in kvtierd"),
    ("hit_pages", "scheduler", "pages kvtierd held beyond those vLLM had computed (hits)"),
    ("miss_pages", "scheduler", "pages looked up that kvtierd did not hold, nor vLLM (misses)"),
    ("load_pages", "worker", "pages loaded into vLLM's blocks"),
    ("load_bytes", "worker", "bytes loaded into vLLM's blocks"),
    ("load_seconds", "worker", "seconds the worker's I/O threads spent reading pages"),
    ("load_errors", "worker", "blocks whose pages did not arrive (recomputed by vLLM)"),
    ("save_pages", "worker", "pages stored in kvtierd"),
    ("save_bytes", "worker", "bytes stored in kvtierd"),
    ("save_seconds", "worker", "seconds the worker's I/O thread spent reserving and storing"),
    ("failures", "both", "calls to kvtierd that failed"),
    ("saves_dropped", "worker", "saves not stored: failed, breaker open, or past the deadline"),
    ("deadline_misses", "both", "waits for kvtierd cut at the deadline"),
    ("short_circuited", "both", "calls answered at once while the circuit breaker was open"),
    ("trips", "both", "times the circuit breaker opened"),
)
NAMES = tuple(f[0] for f in FIGURES)
# Figures taken from the connector's guard (kvtier/guard.py COUNTERS), as their increase.
_FROM_GUARD = ("failures", "saves_dropped", "deadline_misses", "short_circuited", "trips")


@dataclass
class KvtierConnectorStats(KVConnectorStats):
    """One interval's figures: ``data`` maps a name of FIGURES to its increase (a number; names
    with no increase are absent), a plain dict that vLLM serialises between processes."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "KvtierConnectorStats":
        """Adds ``other``'s figures to these (another worker's, or the scheduler's)."""
        for k, v in (other.data or {}).items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> Dict[str, Any]:
        """The interval's figures for vLLM's log line, with the hit rate (hits over pages
        looked up) and the load and save rates (GB/s of the I/O threads' time)."""
        out: Dict[str, Any] = {k: self.data[k] for k in NAMES if self.data.get(k)}
        for k in ("load_seconds", "save_seconds"):
            if k in out:
                out[k] = round(out[k], 6)
        asked = self.data.get("hit_pages", 0) + self.data.get("miss_pages", 0)
        if asked:
            out["hit_rate"] = round(self.data.get("hit_pages", 0) / asked, 4)
        for what in ("load", "save"):
            s = self.data.get(what + "_seconds", 0)
            if s > 0:
                out[what + "_GBps"] = round(self.data.get(what + "_bytes", 0) / s / 1e9, 3)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


class Tally:
    """What a connector counts between two get_kv_connector_stats calls (thread-safe: the
    forward's thread and the I/O threads add to it)."""

    def __init__(self, guard: Guard) -> None:
        self._guard = guard
        self._lock = threading.Lock()
        self._data: Dict[str, float] = {}
        self._seen = guard.stats()  # the guard's counters at the last take()

    def add(self, name: str, n: float = 1) -> None:
        if n:
            with self._lock:
                self._data[name] = self._data.get(name, 0) + n

    def timer(self, name: str) -> "_Timer":
        """``with tally.timer("load_seconds"):`` adds the block's wall time."""
        return _Timer(self, name)

    def take(self) -> Optional[KvtierConnectorStats]:
        """The figures since the last take (None when nothing happened), and starts afresh."""
        now = self._guard.stats()
        with self._lock:
            data, self._data = self._data, {}
            for k in _FROM_GUARD:
                d = now.get(k, 0) - self._seen.get(k, 0)
                if d:
                    data[k] = data.get(k, 0) + d
            self._seen = now
        return KvtierConnectorStats(data=data) if data else None


class _Timer:
    def __init__(self, tally: Tally, name: str) -> None:
        self._tally, self._name, self._t0 = tally, name, 0.0

    def __enter__(self) -> None:
        self._t0 = time.perf_counter()

    def __exit__(self, *exc: Any) -> None:
        self._tally.add(self._name, time.perf_counter() - self._t0)


class KvtierPromMetrics(KVConnectorPromMetrics):
    """vLLM's Prometheus logger's view of the figures: one counter per name of FIGURES,
    ``vllm:kvtier_<name>_total``, per engine (vLLM's labels)."""

    def __init__(self, vllm_config: Any, metric_types: Dict[Any, Any], labelnames: List[str],
                 per_engine_labelvalues: Dict[int, List[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: Dict[str, Dict[int, Any]] = {}
        for name, side, doc in FIGURES:
            c = self._counter_cls(name="vllm:kvtier_%s_total" % name,
                                  documentation="kvtier connector (%s): %s" % (side, doc),
                                  labelnames=labelnames)
            self._counters[name] = {i: c.labels(*v) for i, v in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: Dict[str, Any], engine_idx: int = 0) -> None:
        for k, v in (transfer_stats_data or {}).items():
            per_engine = self._counters.get(k)
            if per_engine is not None and v > 0:
                per_engine[engine_idx].inc(v)
