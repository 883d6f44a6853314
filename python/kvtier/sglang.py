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

# Batches remembered for get_stats between two calls (SGLang calls it every scheduler step when
# --enable-metrics is on; the cap bounds the memory should nothing call it).
_OPS_KEPT = 4096


def __getattr__(name: str) -> Any:
    if name == "KvtierStorage":
        if name not in _built:
            _built[name] = _build()
        return _built[name]
    raise AttributeError("module %r has no attribute %r" % (__name__, name))


def _shard(cfg: Any) -> str:
    """The part of the namespace that names this rank's shard of the KV."""
    s = "mla" if getattr(cfg, "is_mla_model", False) else "tp%d-%d" % (cfg.tp_rank, cfg.tp_size)
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


def _build() -> Any:
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

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
            self._probe_key: Optional[Tuple[str, int]] = None  # the connection the probe makes
            self._closed = False
            self.extra = extra
            self.model = str(extra.get("model") or storage_config.model_name or "sglang")
            self.shard = _shard(storage_config)
            self.writer = bool(getattr(storage_config, "is_storage_writer", True))
            self.interface_v1 = bool(extra.get("interface_v1", 0))
            self._conn = dict(unix_path=extra.get("unix_path"), tcp=extra.get("tcp"),
                              secret=extra.get("secret"), salt=extra.get("salt"),
                              timeout_ms=self.deadline_ms)
            self._adapter = extra.get("adapter")
            self._clients: Dict[Tuple[str, int], kvtier.Client] = {}
            self._lock = threading.Lock()
            self.flat_bytes = 0  # bytes of one flat data page (get/set), once known
            self._v1_page_bytes = 0  # bytes of one page's buffer segments (the v1 calls)
            self.layout = "flat"
            self.mem_pool_host = None
            self.stats = {"errors": 0, "get_hits": 0, "get_misses": 0, "set_pages": 0}
            # Per batch, for get_stats (SGLang's StorageMetrics): (pages moved, GiB/s), reads
            # (prefetch) and writes (backup); kept only with SGLang's enable_storage_metrics.
            self._metrics = bool(getattr(storage_config, "enable_storage_metrics", False))
            self._ops: Dict[str, Deque[Tuple[int, float]]] = {
                "prefetch": deque(maxlen=_OPS_KEPT), "backup": deque(maxlen=_OPS_KEPT)}
            self._ops_lock = threading.Lock()

        # -- host pool --------------------------------------------------------------------

        def register_mem_pool_host(self, mem_pool_host: Any) -> None:
            """SGLang's host KV pool: its page layout names the namespace, its memory is where
            batch_get_v1/batch_set_v1 read and write."""
            super().register_mem_pool_host(mem_pool_host)
            self.layout = str(getattr(mem_pool_host, "layout", "flat"))
            page = mem_pool_host.get_dummy_flat_data_page()
            self.flat_bytes = page.numel() * page.element_size()

        # -- connections ------------------------------------------------------------------

        def _connect(self, key: Tuple[str, int]) -> Any:
            form, nbytes = key
            adapter = "sglang/%s/%dB/%s" % (form, nbytes, self.shard)
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

        def _client(self, form: str, nbytes: int) -> Any:
            """The connection for blocks of nbytes in this form; None (a miss, at once)
            while the circuit breaker is open."""
            key = (form, nbytes)
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

        def _note(self, kind: str, pages: int, nbytes: int, t0: float) -> None:
            """One batch for get_stats: pages moved and their rate in GiB/s over the call."""
            if self._metrics:
                dt = time.perf_counter() - t0
                with self._ops_lock:
                    self._ops[kind].append((pages, nbytes / (1 << 30) / dt if dt > 0 else 0.0))

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
                self._note("prefetch", sum(ok), nbytes * sum(ok), t0)
                self.stats["get_hits"] += sum(ok)
                self.stats["get_misses"] += len(ok) - sum(ok)
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
                self._note("backup", sum(ok), nbytes * sum(ok), t0)
                self.stats["set_pages"] += sum(ok)
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
            ptrs, sizes = host.get_page_buffer_meta(host_indices)
            n = len(keys)
            nseg = len(ptrs) // n if n else 0
            if n == 0 or nseg * n != len(ptrs):
                raise RuntimeError("kvtier: %d buffer segments for %d keys" % (len(ptrs), n))
            ok = [True] * n
            self._v1_page_bytes = sum(int(sizes[s]) for s in range(nseg))
            for s in range(nseg):
                size = int(sizes[s])
                c = self._client("v1-%s-%d" % (self.layout, s), size)
                if c is None:
                    return [False] * n
                # The host pool's own memory, borrowed: no copy in Python.
                bufs = [ffi.buffer(ffi.cast("char *", int(ptrs[p * nseg + s])), size)
                        for p in range(n)]
                got = c.put_keys_each(keys, bufs) if write else c.get_keys_each_into(keys, bufs)
                ok = [a and b for a, b in zip(ok, got)]
            return ok

        def batch_get_v1(self, keys: List[str], host_indices: Any,
                         extra_info: Any = None) -> List[bool]:
            """Each key's page straight into the host pool at host_indices (page_size
            indices per key); per key, whether it was read."""
            if not keys:
                return []

            def run() -> List[bool]:
                t0 = time.perf_counter()
                ok = self._v1(keys, host_indices, False)
                self._note("prefetch", sum(ok), sum(ok) * self._v1_page_bytes, t0)
                self.stats["get_hits"] += sum(ok)
                self.stats["get_misses"] += len(ok) - sum(ok)
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
                self._note("backup", sum(ok), sum(ok) * self._v1_page_bytes, t0)
                self.stats["set_pages"] += sum(ok)
                return ok

            return list(self._guard(run, [False] * len(keys)))

        # -- the rest ---------------------------------------------------------------------

        def clear(self) -> None:
            """kvtierd is shared with other engines and has no per-namespace clear: a no-op
            (pages leave by the daemon's own eviction)."""

        def get_stats(self) -> Any:
            """SGLang's own ``StorageMetrics`` (what its scheduler loop logs with
            --enable-metrics), holding each batch since the last call: pages read and their
            GiB/s (``prefetch_pgs``, ``prefetch_bandwidth``: batch_get, get, batch_get_v1),
            pages written and their GiB/s (``backup_pgs``, ``backup_bandwidth``: batch_set,
            set, batch_set_v1). Batches are kept only with SGLang's enable_storage_metrics.
            None (the base class's answer) where that class does not import. The running
            counters (errors, hits, misses, pages set) are the ``stats`` dict."""
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
