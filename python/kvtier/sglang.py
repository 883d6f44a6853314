"""sglang.py: kvtier as SGLang's HiCache storage backend (the L3 tier under HiCache's host
memory), over the package's keyed calls (kvtier/keys.py).

Loading (docs/engines.md)::

    python -m sglang.launch_server --model-path MODEL --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "kvtier",
            "module_path": "kvtier.sglang", "class_name": "KvtierStorage",
            "unix_path": "/run/kvtier/kvtierd.sock", "interface_v1": 1}'

SGLang builds the backend as ``KvtierStorage(storage_config, kwargs)`` and hands it its host KV
pool later (``register_mem_pool_host``). sglang is imported when ``KvtierStorage`` is first
looked up in this module (module ``__getattr__``), never by ``import kvtier``.

Mapping: SGLang names each page by a key (a hash chained over the page's prefix), so every page
is an independent kvtier key: ``batch_exists`` is ``exists_keys_each`` counting the leading
hits, ``batch_get``/``get`` are ``get_keys_each_into`` into the caller's tensors, ``batch_set``/
``set`` are ``put_keys_each``; the zero-copy ``batch_get_v1``/``batch_set_v1`` read and write
the host pool's memory in place at the pointers its ``get_page_buffer_meta`` gives, one kvtier
key per (page, buffer segment) (an MHA page is a K and a V segment; an MLA page one). Identity:
the namespace is the model (``model`` in the extra config, else SGLang's model name), and the
adapter field names the byte layout and the shard: ``sglang/<form>/<bytes>B/<shard>`` with
shard ``tp<rank>-<size>`` (``mla`` for MLA, whose KV every TP rank holds whole; only the
storage-writer rank writes it), plus ``-pp<r>-<n>`` / ``-cp<r>-<n>`` / ``-dcp<r>-<n>`` when
those are in use: another model, TP rank, layout or page size never hits.

Hybrid models (Mamba, sliding-window, DSA): SGLang hands each host pool over with
``register_mem_host_pool_v2`` and moves its pages with ``batch_*_v2``, one ``PoolTransfer`` per
pool; each pool's pages are kvtier keys of their own (form ``v2-<pool>-...``; the KV pool keeps
the forms above), a sliding-window or Mamba pool only the trailing pages SGLang gives it, and
``batch_exists_v2`` applies SGLang's hit policies. Mamba state is split across TP ranks even
in an MLA model: keyed per rank (``tp<rank>-<size>``).

Metrics: ``get_stats`` returns SGLang's ``StorageMetrics`` and, with SGLang's storage metrics
on, adds the backend's counters (``stats``, the guard's) to SGLang's metric system as
``kvtier_sglang_<name>_total``.

Failures never reach the engine: every call catches kvtier's errors (and any other), logs them
(rate-limited: kvtier/guard.py) and answers as a miss (False, None, 0). Each call to kvtierd is
bounded by ``deadline_ms`` (100). A transport failure (the daemon gone, a missed deadline) closes
the connections and opens the backend's circuit breaker: calls then answer misses at once,
without touching a socket, while a background thread connects again every ``probe_ms`` (200);
once it reaches the daemon, calls go to it again. An unknown extra-config key is refused at
start (ValueError naming it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any, Deque, Dict, List, Optional, Tuple

__all__ = ["KvtierStorage"]

logger = logging.getLogger(__name__)

# Extra-config keys this backend reads (beside SGLang's backend_name/module_path/class_name and
# interface_v1): where the daemon is, the namespace's model/adapter/salt, deadlines.
CONFIG_KEYS = ("unix_path", "tcp", "secret", "model", "adapter", "salt", "deadline_ms",
               "probe_ms", "warn_interval_s")
# Keys SGLang itself reads from the same extra config (sglang 0.5.23: the dynamic loader,
# HiCacheController, the prefetch settings, HiCacheFile's metadata cache).
SGLANG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size",
               "prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token",
               "hicache_storage_pass_prefix_keys", "enable_metadata_cache", "metadata_ttl")
REPLACED_KEYS = {"timeout_ms": "deadline_ms", "reconnect_s": "probe_ms (a background probe)"}
# Why 100 ms: docs/engines.md, "Deadlines and the circuit breaker". SGLang calls the backend
# from its prefetch and backup threads; a page of a few MiB moves in about a millisecond.
DEADLINE_MS = 100
PROBE_MS = 200
WARN_INTERVAL_S = 10.0
_WHERE = "kvtier.sglang: hicache-storage-backend-extra-config"

_built: Dict[str, Any] = {}

# The backend's running counters (KvtierStorage.stats): name -> what it counts. With SGLang's
# metrics on, get_stats() adds each (but errors, which is the guard's failures) and the guard's
# counters (kvtier/guard.py COUNTERS) to SGLang's metrics as kvtier_sglang_<name>_total.
STATS = {
    "get_hits": "pages read from kvtierd (batch_get, get, batch_get_v1, batch_get_v2)",
    "get_misses": "pages asked for that kvtierd did not have",
    "get_bytes": "bytes read from kvtierd",
    "get_seconds": "seconds spent reading from kvtierd",
    "set_pages": "pages stored in kvtierd (batch_set, set, batch_set_v1, batch_set_v2)",
    "set_failed": "pages kvtierd did not store (refused)",
    "set_bytes": "bytes stored in kvtierd",
    "set_seconds": "seconds spent storing in kvtierd",
    "errors": "calls that failed and answered as misses",
}
GUARD_HELP = {
    "failures": "calls that failed and answered as misses (any error)",
    "trips": "times the circuit breaker opened (kvtierd gone, stopped or not up)",
    "recoveries": "times the background probe reached kvtierd again",
    "probes_failed": "background connection attempts that did not reach kvtierd",
    "short_circuited": "calls answered as misses at once while the breaker was open",
    "deadline_misses": "calls that stopped waiting for kvtierd at their deadline",
    "saves_dropped": "saves not stored: failed, breaker open, or past the deadline",
    "warnings": "warnings raised (logged or held back by the rate limit)",
    "warnings_logged": "warning lines written",
}
# The labels of SGLang's own storage metrics that name a rank, and the model.
METRIC_LABELS = ("storage_backend", "model", "tp_rank", "dp_rank", "pp_rank")

# Batches remembered for get_stats between two calls (SGLang calls it every scheduler step when
# --enable-metrics is on; the cap bounds the memory should nothing call it).
_OPS_KEPT = 4096


def __getattr__(name: str) -> Any:
    if name == "KvtierStorage":
        if name not in _built:
            _built[name] = _build()
        return _built[name]
    raise AttributeError("module %r has no attribute %r" % (__name__, name))


def _shard(cfg: Any, per_rank: bool = False) -> str:
    """The part of the namespace that names this rank's shard of the KV (per_rank: of a pool
    split across TP ranks even in an MLA model, as Mamba state is)."""
    mla = getattr(cfg, "is_mla_model", False) and not per_rank
    s = "mla" if mla else "tp%d-%d" % (cfg.tp_rank, cfg.tp_size)
    if getattr(cfg, "pp_size", 1) > 1:
        s += "-pp%d-%d" % (cfg.pp_rank, cfg.pp_size)
    if getattr(cfg, "attn_cp_size", 1) > 1:
        s += "-cp%d-%d" % (cfg.attn_cp_rank, cfg.attn_cp_size)
    if getattr(cfg, "dcp_size", 1) > 1:
        s += "-dcp%d-%d" % (cfg.dcp_rank, cfg.dcp_size)
    return s


def _storage_metrics_class() -> Any:
    """SGLang's StorageMetrics (its module moved between releases), or None."""
    if "StorageMetrics" not in _built:
        cls = None
        for mod in ("sglang.srt.observability.metrics_collector", "sglang.srt.metrics.collector"):
            try:
                cls = getattr(__import__(mod, fromlist=["StorageMetrics"]), "StorageMetrics")
                break
            except Exception:  # noqa: BLE001 - not this release's module, or it fails to import
                continue
        _built["StorageMetrics"] = cls
    return _built["StorageMetrics"]


def _metric_counters() -> Optional[Dict[str, Any]]:
    """One counter per exported name (STATS but errors, then the guard's), made once per
    process in the metric system SGLang's storage collector uses (its registered stat logger's
    counter class, e.g. Ray's; else prometheus_client's, whose registry SGLang's /metrics
    serves, across processes with PROMETHEUS_MULTIPROC_DIR); None when neither imports."""
    if "counters" not in _built:
        got: Optional[Dict[str, Any]] = None
        try:
            cls = None
            try:
                from sglang.srt.observability.metrics_collector import (
                    STAT_LOGGER_ROLE_STORAGE,
                    StorageMetricsCollector,
                    resolve_collector_class,
                )
                cls = resolve_collector_class(STAT_LOGGER_ROLE_STORAGE,
                                              StorageMetricsCollector)._counter_cls
            except Exception:  # noqa: BLE001 - no such hook in this release, or no context
                cls = None
            if cls is None:
                from prometheus_client import Counter as cls  # type: ignore[no-redef]
            helps = {k: v for k, v in STATS.items() if k != "errors"}
            helps.update(GUARD_HELP)
            got = {k: cls(name="kvtier_sglang_" + k, documentation="kvtier: " + doc,
                          labelnames=list(METRIC_LABELS)) for k, doc in helps.items()}
        except Exception as e:  # noqa: BLE001 - no metric system: nothing exported
            logger.warning("kvtier.sglang: counters not exported to SGLang's metrics (%s: %s)",
                           type(e).__name__, e)
            got = None
        _built["counters"] = got
    return _built["counters"]


def _build() -> Any:
    import torch
    from sglang.srt.mem_cache.hicache_storage import (
        HiCacheStorage,
        PoolHitPolicy,
        PoolName,
        PoolTransferResult,
    )

    import kvtier
    from kvtier._lib import ffi
    from kvtier.guard import Guard, check_keys, number

    transport = (kvtier.ConnectError, kvtier.ConnectionClosed, kvtier.Timeout,
                 kvtier.ProtocolError)

    class KvtierStorage(HiCacheStorage):
        """SGLang HiCache storage backend on kvtierd (see kvtier/sglang.py's docstring)."""

        def __init__(self, storage_config: Any, kwargs: Optional[dict] = None) -> None:
            self.storage_config = storage_config
            extra = dict(getattr(storage_config, "extra_config", None) or {})
            check_keys(extra, CONFIG_KEYS + SGLANG_KEYS, _WHERE, REPLACED_KEYS)
            self.deadline_ms = number(extra, "deadline_ms", DEADLINE_MS, _WHERE, minimum=1)
            self.guard = Guard(logger, number(extra, "warn_interval_s", WARN_INTERVAL_S, _WHERE,
                                              integer=False))
            self.breaker = self.guard.breaker(
                "sglang", self._probe, self._install,
                number(extra, "probe_ms", PROBE_MS, _WHERE, minimum=1))
            self._probe_key: Optional[Tuple[str, int, str]] = None  # what the probe connects
            self._closed = False
            self.extra = extra
            self.model = str(extra.get("model") or storage_config.model_name or "sglang")
            self.shard = _shard(storage_config)
            self.rank_shard = _shard(storage_config, per_rank=True)
            self.writer = bool(getattr(storage_config, "is_storage_writer", True))
            self.interface_v1 = bool(extra.get("interface_v1", 0))
            self._conn = dict(unix_path=extra.get("unix_path"), tcp=extra.get("tcp"),
                              secret=extra.get("secret"), salt=extra.get("salt"),
                              timeout_ms=self.deadline_ms)
            self._adapter = extra.get("adapter")
            self._clients: Dict[Tuple[str, int, str], kvtier.Client] = {}
            # Per v2 pool name: the (form, bytes) namespaces one of its pages is stored in.
            self._forms: Dict[str, List[Tuple[str, int]]] = {}
            self._lock = threading.Lock()
            self.flat_bytes = 0  # bytes of one flat data page (get/set), once known
            self._v1_page_bytes = 0  # bytes of one page's buffer segments (the v1 calls)
            self.layout = "flat"
            self.mem_pool_host = None
            # Running counters (STATS), also exported to SGLang's metrics by get_stats.
            self.stats: Dict[str, Any] = dict.fromkeys(STATS, 0)
            # Per batch, for get_stats (SGLang's StorageMetrics): (pages moved, GiB/s), reads
            # (prefetch) and writes (backup); kept only with SGLang's enable_storage_metrics.
            self._metrics = bool(getattr(storage_config, "enable_storage_metrics", False))
            self._ops: Dict[str, Deque[Tuple[int, float]]] = {
                "prefetch": deque(maxlen=_OPS_KEPT), "backup": deque(maxlen=_OPS_KEPT)}
            self._ops_lock = threading.Lock()
            self._labels = {"storage_backend": "kvtier", "model": self.model,
                            "tp_rank": str(storage_config.tp_rank),
                            "dp_rank": str(getattr(storage_config, "dp_rank", 0)),
                            "pp_rank": str(getattr(storage_config, "pp_rank", 0))}
            self._exported: Dict[str, Any] = {}  # counter values already added to SGLang's

        # -- host pool --------------------------------------------------------------------

        def register_mem_pool_host(self, mem_pool_host: Any) -> None:
            """SGLang's host KV pool: its page layout names the namespace, its memory is where
            batch_get_v1/batch_set_v1 read and write."""
            super().register_mem_pool_host(mem_pool_host)
            self.layout = str(getattr(mem_pool_host, "layout", "flat"))
            page = mem_pool_host.get_dummy_flat_data_page()
            self.flat_bytes = page.numel() * page.element_size()

        # -- connections ------------------------------------------------------------------

        def _connect(self, key: Tuple[str, int, str]) -> Any:
            form, nbytes, shard = key
            adapter = "sglang/%s/%dB/%s" % (form, nbytes, shard)
            if self._adapter:
                adapter += "/" + str(self._adapter)
            return kvtier.Client(self.model, page_size=kvtier.KEY_TOKENS, block_bytes=nbytes,
                                 adapter=adapter, **self._conn)

        def _probe(self) -> Any:
            """The breaker's background attempt: the connection whose failure opened it."""
            key = self._probe_key
            assert key is not None
            return key, self._connect(key)

        def _install(self, got: Any) -> bool:
            key, c = got
            with self._lock:
                if self._closed or key in self._clients:
                    c.close()
                else:
                    self._clients[key] = c
            return True

        def _client(self, form: str, nbytes: int, shard: Optional[str] = None) -> Any:
            """The connection for blocks of nbytes in this form (of this rank's shard, by
            default the model's); None (a miss, at once) while the circuit breaker is open."""
            key = (form, nbytes, shard or self.shard)
            with self._lock:
                c = self._clients.get(key)
                if c is not None:
                    self._probe_key = key
                    return c
                if not self.breaker.allow():
                    return None
                self._probe_key = key
                try:
                    c = self._connect(key)
                except Exception as e:
                    self._failed(e)
                    return None
                self._clients[key] = c
                return c

        def _failed(self, e: BaseException) -> None:
            """Counts and logs a failure (rate-limited) and, for a transport one, closes the
            connections and opens the circuit breaker."""
            self.stats["errors"] += 1
            self.guard.count("failures")
            if isinstance(e, transport) and self._probe_key is not None:
                clients, self._clients = self._clients, {}
                for c in clients.values():
                    try:
                        c.close()
                    except Exception:
                        pass
                self.breaker.trip(e)
            else:
                self.guard.warn("kvtier: %s: %s (answering misses)", type(e).__name__, e)

        def _guard(self, fn: Any, miss: Any) -> Any:
            try:
                return fn()
            except Exception as e:
                with self._lock:
                    self._failed(e)
                return miss

        def _done(self, write: bool, ok: List[bool], page_bytes: int, t0: float) -> None:
            """One batch that reached kvtierd (ok: per page, whether it moved) into the
            running counters (stats) and, for get_stats, its pages and GiB/s over the call."""
            dt = time.perf_counter() - t0
            moved = sum(ok)
            nbytes = moved * page_bytes
            kind = "set" if write else "get"
            with self._ops_lock:
                st = self.stats
                st["set_pages" if write else "get_hits"] += moved
                st["set_failed" if write else "get_misses"] += len(ok) - moved
                st[kind + "_bytes"] += nbytes
                st[kind + "_seconds"] += dt
                if self._metrics:
                    self._ops["backup" if write else "prefetch"].append(
                        (moved, nbytes / (1 << 30) / dt if dt > 0 else 0.0))

        def _flat(self, nbytes: int) -> Any:
            if not self.flat_bytes:
                self.flat_bytes = nbytes
            return self._client("flat-" + self.layout, nbytes)

        # -- the tensor interface (a copy through the caller's tensors) -------------------

        def exists(self, key: str) -> bool:
            return self.batch_exists([key]) == 1

        def batch_exists(self, keys: List[str], extra_info: Any = None) -> int:
            """How many leading keys are stored (SGLang's prefetch asks this first)."""
            if not keys:
                return 0

            def run() -> int:
                found = self._exists_each(keys)
                return found.index(False) if False in found else len(found)

            return int(self._guard(run, 0))

        def _exists_each(self, keys: List[str]) -> List[bool]:
            if self.interface_v1 and self.mem_pool_host is not None:
                seg = self._segments()
                if seg is None:
                    return [False] * len(keys)
                sizes = seg
                found = [True] * len(keys)
                for s, size in enumerate(sizes):
                    c = self._client("v1-%s-%d" % (self.layout, s), size)
                    if c is None:
                        return [False] * len(keys)
                    for i, ok in enumerate(c.exists_keys_each(keys)):
                        found[i] = found[i] and ok
                return found
            if not self.flat_bytes:
                return [False] * len(keys)  # nothing stored or asked for through this backend
            c = self._flat(self.flat_bytes)
            return c.exists_keys_each(keys) if c is not None else [False] * len(keys)

        def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
            return self.batch_get([key], [target_location] if target_location is not None
                                  else None)[0]

        def batch_get(self, keys: List[str], target_locations: Any = None,
                      target_sizes: Any = None) -> List[Any]:
            """Each key's page into its target tensor (a flat data page; allocated when
            None); None for a miss."""
            if not keys:
                return []
            if target_locations is None:
                if not self.flat_bytes:
                    return [None] * len(keys)
                target_locations = [torch.empty(self.flat_bytes, dtype=torch.uint8)
                                    for _ in keys]
            targets = list(target_locations)

            def run() -> List[Any]:
                nbytes = targets[0].numel() * targets[0].element_size()
                c = self._flat(nbytes)
                if c is None:
                    return [None] * len(keys)
                t0 = time.perf_counter()
                ok = c.get_keys_each_into(keys, targets)
                self._done(False, ok, nbytes, t0)
                return [t if hit else None for t, hit in zip(targets, ok)]

            return list(self._guard(run, [None] * len(keys)))

        def set(self, key: str, value: Any = None, target_location: Any = None,
                target_sizes: Any = None) -> bool:
            return self.batch_set([key], [value])

        def batch_set(self, keys: List[str], values: Any = None, target_locations: Any = None,
                      target_sizes: Any = None) -> bool:
            """Stores each value (a flat data page tensor) under its key; True when all are
            stored."""
            if not keys:
                return True
            vals = [v.contiguous() for v in values]
            if not self.flat_bytes:
                self.flat_bytes = vals[0].numel() * vals[0].element_size()
            if not self.writer:
                return True  # MLA: another rank writes the shared page

            def run() -> bool:
                nbytes = vals[0].numel() * vals[0].element_size()
                c = self._flat(nbytes)
                if c is None:
                    return False
                t0 = time.perf_counter()
                ok = c.put_keys_each(keys, vals)
                self._done(True, ok, nbytes, t0)
                return all(ok)

            return bool(self._guard(run, False))

        # -- zero copy into the host pool -------------------------------------------------

        def _segments(self) -> Optional[List[int]]:
            """The byte sizes of one page's buffer segments in the host pool."""
            host = self.mem_pool_host
            ps = int(getattr(host, "page_size", 1) or 1)
            meta = host.get_page_buffer_meta(torch.arange(ps, dtype=torch.int64))
            if not meta:
                return None
            return [int(s) for s in meta[1]]

        def _v1(self, keys: List[str], host_indices: Any, write: bool) -> List[bool]:
            host = self.mem_pool_host
            if host is None:
                raise RuntimeError("kvtier: batch_%s_v1 before register_mem_pool_host" %
                                   ("set" if write else "get"))
            ok, self._v1_page_bytes = self._segments_io(host, "v1-" + self.layout, self.shard,
                                                        keys, host_indices, write)
            return ok

        def _segments_io(self, host: Any, prefix: str, shard: str, keys: List[str],
                         host_indices: Any, write: bool) -> Tuple[List[bool], int]:
            """Each key's page between kvtierd and the host pool's memory at host_indices,
            one key per buffer segment (get_page_buffer_meta) in namespace prefix-<segment>;
            per key, whether every segment moved, and the bytes of one page."""
            ptrs, sizes = host.get_page_buffer_meta(host_indices)
            n = len(keys)
            nseg = len(ptrs) // n if n else 0
            if n == 0 or nseg * n != len(ptrs):
                raise RuntimeError("kvtier: %d buffer segments for %d keys" % (len(ptrs), n))
            ok = [True] * n
            page_bytes = sum(int(sizes[s]) for s in range(nseg))
            for s in range(nseg):
                size = int(sizes[s])
                c = self._client("%s-%d" % (prefix, s), size, shard)
                if c is None:
                    return [False] * n, page_bytes
                # The host pool's own memory, borrowed: no copy in Python.
                bufs = [ffi.buffer(ffi.cast("char *", int(ptrs[p * nseg + s])), size)
                        for p in range(n)]
                got = c.put_keys_each(keys, bufs) if write else c.get_keys_each_into(keys, bufs)
                ok = [a and b for a, b in zip(ok, got)]
            return ok, page_bytes

        def batch_get_v1(self, keys: List[str], host_indices: Any,
                         extra_info: Any = None) -> List[bool]:
            """Each key's page straight into the host pool at host_indices (page_size
            indices per key); per key, whether it was read."""
            if not keys:
                return []

            def run() -> List[bool]:
                t0 = time.perf_counter()
                ok = self._v1(keys, host_indices, False)
                self._done(False, ok, self._v1_page_bytes, t0)
                return ok

            return list(self._guard(run, [False] * len(keys)))

        def batch_set_v1(self, keys: List[str], host_indices: Any,
                         extra_info: Any = None) -> List[bool]:
            """Each key's page from the host pool at host_indices; per key, whether it is
            stored."""
            if not keys:
                return []
            if not self.writer:
                return [True] * len(keys)

            def run() -> List[bool]:
                t0 = time.perf_counter()
                ok = self._v1(keys, host_indices, True)
                self._done(True, ok, self._v1_page_bytes, t0)
                return ok

            return list(self._guard(run, [False] * len(keys)))

        # -- hybrid models: one host pool per component (the v2 calls) --------------------

        def _v2_host(self, name: str) -> Any:
            host = (getattr(self, "registered_pools", None) or {}).get(name)
            if host is None and name == PoolName.KV.value:
                host = self.mem_pool_host
            if host is None:
                raise ValueError("kvtier: pool %r was never registered "
                                 "(register_mem_host_pool_v2)" % name)
            return host

        def _v2_shard(self, name: str) -> str:
            """Mamba state is split across TP ranks even where the model's MLA KV is
            replicated (SGLang writes it from every rank): keyed per rank."""
            return self.rank_shard if name == PoolName.MAMBA.value else self.shard

        def _v2_forms(self, name: str) -> List[Tuple[str, int]]:
            """The (form, bytes) namespaces one page of pool `name` lives in: with
            interface_v1 and a pool whose get_page_buffer_meta describes it, one per buffer
            segment (zero copy); else one whole flat data page. The KV pool uses the
            namespaces of the v1 and flat calls, so either path finds what the other
            stored; every other pool its own (v2-<pool>-...)."""
            got = self._forms.get(name)
            if got is not None:
                return got
            host = self._v2_host(name)
            ps = int(getattr(host, "page_size", 1) or 1)
            layout = str(getattr(host, "layout", "flat"))
            tag = "" if name == PoolName.KV.value else "v2-%s-" % name
            forms: List[Tuple[str, int]] = []
            if self.interface_v1:
                try:
                    meta = host.get_page_buffer_meta(torch.arange(ps, dtype=torch.int64))
                    forms = [("%sv1-%s-%d" % (tag, layout, i), int(n))
                             for i, n in enumerate(meta[1])]
                except (NotImplementedError, ValueError, AttributeError, AssertionError):
                    forms = []  # no zero-copy description (e.g. Mamba side states)
            if not forms:
                page = host.get_dummy_flat_data_page()
                forms = [("%sflat-%s" % (tag, layout), page.numel() * page.element_size())]
            self._forms[name] = forms
            return forms

        def _v2_exists(self, name: str, keys: List[str]) -> List[bool]:
            found = [True] * len(keys)
            if not keys:
                return found
            for form, nbytes in self._v2_forms(name):
                c = self._client(form, nbytes, self._v2_shard(name))
                if c is None:
                    return [False] * len(keys)
                found = [a and b for a, b in zip(found, c.exists_keys_each(keys))]
            return found

        def _v2_io(self, t: Any, write: bool) -> List[bool]:
            """One PoolTransfer: its keys' pages between kvtierd and its pool at its
            host_indices (the pool's page_size indices per key)."""
            name = str(getattr(t.name, "value", t.name))
            keys = list(t.keys or [])
            n = len(keys)
            if n == 0:
                return []
            host = self._v2_host(name)
            ps = int(getattr(host, "page_size", 1) or 1)
            idx = t.host_indices
            if idx is None or idx.numel() != n * ps:
                raise ValueError("kvtier: pool %s: %s host indices for %d keys of %d slots" % (
                    name, "no" if idx is None else idx.numel(), n, ps))
            if write and not self.writer and self._v2_shard(name) == self.shard:
                return [True] * n  # MLA: the storage writer stores the replicated pools
            forms = self._v2_forms(name)
            shard = self._v2_shard(name)
            t0 = time.perf_counter()
            if "flat-" in forms[0][0]:
                form, nbytes = forms[0]
                c = self._client(form, nbytes, shard)
                if c is None:
                    return [False] * n
                at = [int(a) for a in idx[::ps].tolist()]
                if write:
                    ok = c.put_keys_each(keys, [host.get_data_page(a, flat=True).contiguous()
                                                for a in at])
                else:
                    bufs = [host.get_dummy_flat_data_page() for _ in keys]
                    ok = c.get_keys_each_into(keys, bufs)
                    for a, b, hit in zip(at, bufs, ok):
                        if hit:
                            host.set_from_flat_data_page(a, b)
            else:
                prefix = forms[0][0].rsplit("-", 1)[0]
                ok, nbytes = self._segments_io(host, prefix, shard, keys, idx, write)
            self._done(write, ok, nbytes, t0)
            return ok

        def batch_exists_v2(self, keys: List[str], pool_transfers: Any = None,
                            extra_info: Any = None) -> Any:
            """The usable prefix of keys (pages) for a hybrid model: the KV pages' leading
            hits, cut where another pool cannot restore it: an ALL_PAGES pool needs every
            page of the prefix, a TRAILING_PAGES pool (Mamba state, a sliding window) only
            the last len(transfer.keys) pages before the prefix's end. A PoolTransferResult
            with each pool's own boundary and every restorable prefix length (SGLang
            intersects those across ranks)."""

            def run() -> Any:
                kv = 0
                if keys:
                    found = self._exists_each(keys)
                    kv = found.index(False) if False in found else len(found)
                hits: Dict[Any, int] = {PoolName.KV: kv} if kv else {}
                restorable = list(range(1, kv + 1))
                for t in pool_transfers or []:
                    if not restorable:
                        break
                    name = str(getattr(t.name, "value", t.name))
                    have = self._v2_exists(name, list(keys[:kv]))
                    if t.hit_policy == PoolHitPolicy.ALL_PAGES:
                        edge = have.index(False) if False in have else kv
                        can = set(range(1, edge + 1))
                    elif t.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                        window = max(1, len(t.keys or []))
                        can = {p for p in range(1, kv + 1)
                               if all(have[max(0, p - window):p])}
                        edge = max(can, default=0)
                    else:
                        raise ValueError("kvtier: pool %s: hit policy %s is not supported" %
                                         (name, t.hit_policy))
                    if edge:
                        hits[t.name] = edge
                    restorable = [p for p in restorable if p in can]
                return PoolTransferResult(restorable[-1] if restorable else 0, hits,
                                          restorable)

            return self._guard(run, PoolTransferResult(0, {}, []))

        def batch_get_v2(self, transfers: List[Any],
                         extra_info: Any = None) -> Dict[Any, List[bool]]:
            """Each transfer's pages from kvtierd into its pool at its host_indices; per
            pool name, whether each key's page arrived (a miss leaves its slot as it was).
            A failing pool answers all False and does not stop the others."""
            return {t.name: list(self._guard(lambda t=t: self._v2_io(t, False),
                                             [False] * len(t.keys or [])))
                    for t in transfers}

        def batch_set_v2(self, transfers: List[Any],
                         extra_info: Any = None) -> Dict[Any, List[bool]]:
            """Each transfer's pages from its pool at its host_indices into kvtierd, each
            component under its own keys (a sliding-window or Mamba pool gets only the
            trailing pages SGLang hands it); per pool name, whether each page is stored."""
            return {t.name: list(self._guard(lambda t=t: self._v2_io(t, True),
                                             [False] * len(t.keys or [])))
                    for t in transfers}

        # -- the rest ---------------------------------------------------------------------

        def clear(self) -> None:
            """kvtierd is shared with other engines and has no per-namespace clear: a no-op
            (pages leave by the daemon's own eviction)."""

        def get_stats(self) -> Any:
            """SGLang's own ``StorageMetrics`` (what its scheduler loop logs with
            --enable-metrics), holding each batch since the last call: pages read and their
            GiB/s (``prefetch_pgs``, ``prefetch_bandwidth``: batch_get, get, batch_get_v1,
            batch_get_v2), pages written and their GiB/s (``backup_pgs``,
            ``backup_bandwidth``: batch_set, set, batch_set_v1, batch_set_v2). Batches are
            kept only with SGLang's enable_storage_metrics. None (the base class's answer)
            where that class does not import. The running counters (STATS: hits, misses,
            bytes, seconds, failures) are the ``stats`` dict; with enable_storage_metrics
            each call also adds what they and the guard's counters gained to SGLang's
            metrics (kvtier_sglang_<name>_total, labelled by rank), which StorageMetrics has
            no fields for."""
            if self._metrics:
                try:
                    self._export()
                except Exception as e:  # never into the scheduler's loop
                    self.guard.warn("kvtier: metrics not exported: %s: %s", type(e).__name__, e)
            cls = _storage_metrics_class()
            if cls is None:
                return None
            with self._ops_lock:
                ops = {k: list(d) for k, d in self._ops.items()}
                for d in self._ops.values():
                    d.clear()
            m = cls()
            m.prefetch_pgs.extend(p for p, _ in ops["prefetch"])
            m.prefetch_bandwidth.extend(bw for _, bw in ops["prefetch"])
            m.backup_pgs.extend(p for p, _ in ops["backup"])
            m.backup_bandwidth.extend(bw for _, bw in ops["backup"])
            return m

        def _export(self) -> None:
            """Adds what each counter gained since the last call to SGLang's metrics."""
            counters = _metric_counters()
            if counters is None:
                return
            now = self.guard.stats()
            with self._ops_lock:
                now.update((k, v) for k, v in self.stats.items() if k != "errors")
                for k, c in counters.items():
                    gained = now.get(k, 0) - self._exported.get(k, 0)
                    if gained > 0:
                        c.labels(**self._labels).inc(gained)
                    self._exported[k] = now.get(k, 0)

        def kvtier_stats(self) -> Dict[str, int]:
            """The backend's guard counters (kvtier/guard.py COUNTERS)."""
            return self.guard.stats()

        def close(self) -> None:
            """Closes the connections (the daemon keeps the pages) and stops the probe."""
            with self._lock:
                self._closed = True
                clients, self._clients = self._clients, {}
            for c in clients.values():
                c.close()
            self.breaker.close()

    return KvtierStorage
