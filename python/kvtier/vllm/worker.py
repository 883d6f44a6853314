"""kvtier.vllm.worker: the connector's worker side. It runs in each of vLLM's workers, in the
forward pass: reads the step's pages from kvtierd and scatters them layer by layer into vLLM's
paged tensors, and copies the step's saved blocks layer by layer into pages that its I/O thread
stores. No wait on the daemon exceeds what is left of the step's worker_deadline_ms."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Set, Tuple

import torch

from ..client import Reservation
from .common import KvtierConnectorMetadata, _Transfer, log, rank_salt, worker_ranks
from .layout import _Layout, _Run, _Views
from .store import _PageStore

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext


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


class WorkerSide:
    """The worker role's calls of KVConnectorBase_V1, mixed into KvtierConnector (which sets
    the shared state: settings, guard, model, sizes, deadline)."""

    def _init_worker_side(self) -> None:
        self._waited = 0.0  # seconds this step's forward has waited for the worker's I/O
        self._saves_here = True  # False on a TP rank whose KV another rank saves (MLA)
        self._layout: Optional[_Layout] = None  # group 0's (the only one without the HMA)
        self._layouts: Dict[int, _Layout] = {}  # per KV cache group (vLLM's gid)
        self._layer_at: Dict[str, Tuple[int, int]] = {}  # layer -> (group, index in its page)
        self._kv: Dict[str, torch.Tensor] = {}
        self._store: Optional[_PageStore] = None
        self._pool: Optional[ThreadPoolExecutor] = None
        self._loads: List[_Load] = []
        self._saves: Dict[Tuple[str, int], _Save] = {}  # per (request, group)
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

    def register_kv_caches(self, kv_caches: Dict[str, torch.Tensor]) -> None:
        """Learns the paged layout; the worker's namespace is its shard's: its TP rank's, or
        with TP replicas (MLA) the one shared by the ranks holding the same KV, where only the
        first of them saves and all load."""
        self._close_worker_side()  # registered again (a restored cache): start afresh
        self._kv = dict(kv_caches)
        self._layouts, self._layer_at = {}, {}
        for g in self._groups:
            names = [n for n in self._kv if g.layers is None or n in g.layers]
            self._layouts[g.gid] = _Layout({n: self._kv[n] for n in names}, self._num_blocks)
            for i, n in enumerate(names):
                self._layer_at.setdefault(n, (g.gid, i))
        # One namespace, one page size: a group with a smaller page pads it to the largest.
        page = max(lay.page_bytes for lay in self._layouts.values())
        for lay in self._layouts.values():
            lay.page_bytes = page
        self._layout = self._layouts[self._groups[0].gid]
        tp_rank, pp_rank = worker_ranks(self._extra, self._tp_size, self._pp_size)
        rep = self._tp_replicas
        self._saves_here = tp_rank % rep == 0
        self._store = _PageStore(self._extra, self._model,
                                 rank_salt(tp_rank // rep, self._tp_size // rep, pp_rank,
                                           self._pp_size),
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
        # A group with no layer in this worker (another pipeline stage's) has nothing to load.
        loads = [t for t in meta.loads if self._layouts.get(t.group) is not None and
                 self._layouts[t.group].names]
        sync = [t for t in loads if not t.async_load]
        between: Dict[str, List[_Transfer]] = {}
        for t in loads:
            if t.async_load and self._async_pool is not None and t.req_id not in self._async_loads:
                between.setdefault(t.req_id, []).append(t)
        for rid, ts in between.items():  # one job per request: all its groups
            self._async_loads[rid] = self._async_pool.submit(self._load_between, ts)
        assert self._pool is not None and self._store is not None
        if sync and not self._store.up:  # kvtierd unreachable: recompute, ask nothing
            self._guard.count("short_circuited")
            for t in sync:
                self._load_errors.update(t.block_ids)
                self._tally.add("load_errors", len(t.block_ids))
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
        if meta.saves and self._saves_here and self._resv_future is None and \
                self._zero_copy():
            self._resv_future = self._pool.submit(self._reserve_job, self._my_saves(meta))

    def _my_saves(self, meta: KvtierConnectorMetadata) -> List[_Transfer]:
        """The step's saves of groups with layers in this worker (another pipeline stage
        saves the rest)."""
        return [t for t in meta.saves if self._layouts.get(t.group) is not None and
                self._layouts[t.group].names]

    def _zero_copy(self) -> bool:
        """Whether to try the mapped path (not known before the first connection)."""
        st = self._store
        return st is not None and st.keyed and bool(self._extra.get("zero_copy", True)) and \
            (st.mapped or st._client is None)

    def _load_job(self, ld: _Load) -> Any:
        """A step's load, on the I/O thread: the pages' views (mapped: _Views), or the pages
        read into staging (their count)."""
        with self._tally.timer("load_seconds"):
            return self._load(ld)

    def _load(self, ld: _Load) -> Any:
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
            runs = self._layouts[t.group].runs(items, ld.blocks[:len(items)])
        except Exception:
            if lease:
                self._store.release_views(lease)
            raise
        return _Views(lease, len(items), runs, items)

    def _reserve_job(self, saves: List[_Transfer]) -> Dict[str, Any]:
        with self._tally.timer("save_seconds"):
            return self._reserve(saves)

    def _reserve(self, saves: List[_Transfer]) -> Dict[str, Any]:
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
                runs = self._layouts[t.group].runs(views, vblocks)
            except Exception as e:  # noqa: BLE001
                self._guard.warn("kvtier: reservation for %s unusable, staging it: %s",
                                 t.req_id, e)
                try:
                    self._store.abort(r)
                except Exception:  # noqa: BLE001
                    pass
                continue
            out[(t.req_id, t.group)] = (r, runs, rows)
        return out

    def _load_between(self, ts: List[_Transfer]) -> int:
        """An asynchronous load of one request (each of its groups), on its own thread: whole
        pages into a staging buffer of its own, then every layer into the blocks (which vLLM
        does not touch until get_finished reports the request). Never raises: pages that did
        not come are load errors."""
        assert self._layout is not None and self._async_store is not None
        total = 0
        for t in ts:
            lay, got = self._layouts[t.group], 0
            try:
                staging = torch.empty((len(t.keys) - t.first, lay.page_bytes),
                                      dtype=torch.uint8)
                with self._tally.timer("load_seconds"):
                    got = int(self._async_store.load(t.keys, t.first, staging))
                if got > 0:
                    for li, name in enumerate(lay.names):
                        lay.scatter(staging[:got], li, self._kv[name], t.block_ids[:got])
                    kv = self._kv[lay.names[0]]
                    if kv.is_cuda:
                        torch.cuda.current_stream(kv.device).synchronize()
            except Exception as e:  # noqa: BLE001
                self._guard.count("failures")
                self._guard.warn("kvtier: load of %s failed, recomputing: %s", t.req_id, e)
            self._count_load(got, len(t.block_ids))
            if got < len(t.block_ids):
                self._async_errors.setdefault(t.req_id, []).extend(t.block_ids[got:])
            total += got
        return total

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
        self._count_load(ld.got, len(ld.t.block_ids))
        if ld.got < len(ld.t.block_ids):
            self._load_errors.update(ld.t.block_ids[ld.got:])

    def _count_load(self, got: int, blocks: int) -> None:
        assert self._layout is not None
        self._tally.add("load_pages", got)
        self._tally.add("load_bytes", got * self._layout.page_bytes)
        self._tally.add("load_errors", blocks - got)

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
        at = self._layer_at.get(layer_name)
        if at is None:
            return
        gid, li = at
        lay = self._layouts[gid]
        for ld in self._loads:
            if ld.t.group != gid:
                continue
            self._resolve(ld)
            if ld.got > 0 and li not in ld.layers_done:
                if ld.views is not None:  # straight from the mapping
                    lay.scatter_runs(ld.views.runs, li, self._kv[layer_name])
                else:
                    lay.scatter(ld.staging[:ld.got], li, self._kv[layer_name],
                                ld.blocks[:ld.got])
            ld.layers_done.add(li)
            if ld.views is not None and len(ld.layers_done) == len(lay.names):
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
            for name in list(self._layer_at):
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
        if not isinstance(meta, KvtierConnectorMetadata) or self._layout is None or \
                not self._saves_here:  # another TP rank saves the KV this one holds too
            return
        at = self._layer_at.get(layer_name)
        if at is None:
            return
        gid, li = at
        lay = self._layouts[gid]
        if meta.saves and not self._saves_ready:
            self._lay_out_saves(self._my_saves(meta))
        for t in meta.saves:
            if t.group != gid:
                continue
            sv = self._saves.get((t.req_id, gid))
            if sv is None:  # stored already this step
                continue
            if li in sv.layers_done:
                continue
            if sv.runs:
                lay.gather_runs(sv.runs, li, kv_layer)
            if sv.blocks:
                lay.gather(sv.staging, li, kv_layer, sv.blocks)
            sv.layers_done.add(li)
            if len(sv.layers_done) == len(lay.names):
                assert self._pool is not None
                self._save_futures.append((t, self._pool.submit(self._store_save, sv)))
                del self._saves[(t.req_id, gid)]

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
            x = resv.get((t.req_id, t.group))
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
            self._saves[(t.req_id, t.group)] = _Save(
                t, staging, [t.block_ids[j] for j in prow],  # type: ignore[arg-type]
                rows=prow if mapped else None, resv=r if r is not None and r.id else None,
                runs=runs)

    def _store_save(self, sv: _Save) -> int:
        """A request's pages all in, on the I/O thread: commits its reservation and PUTs its
        staged pages (runs of consecutive pages). Returns the pages stored."""
        assert self._store is not None and self._layout is not None
        stored = [0]
        try:
            with self._tally.timer("save_seconds"):
                return self._store_pages(sv, stored)
        finally:  # what did go, even when a part failed
            self._tally.add("save_pages", stored[0])
            self._tally.add("save_bytes", stored[0] * self._layout.page_bytes)

    def _store_pages(self, sv: _Save, stored: List[int]) -> int:
        """_store_save's work; ``stored[0]`` counts the pages stored as they go."""
        assert self._store is not None
        t, err = sv.t, None
        sv.runs = []  # the views are not touched after the commit
        if sv.resv is not None:
            try:
                stored[0] += self._store.commit(sv.resv)
            except Exception as e:  # noqa: BLE001 - the staged pages may still go
                err = e
        if sv.rows is None:
            stored[0] += self._store.save(t.keys, t.first, sv.staging)
        else:
            i = 0
            while i < len(sv.rows):
                k = i + 1
                while k < len(sv.rows) and sv.rows[k] == sv.rows[k - 1] + 1:
                    k += 1
                a, b = t.first + sv.rows[i], t.first + sv.rows[k - 1] + 1
                stored[0] += self._store.save(t.keys[:b], a, sv.staging[i:k])
                i = k
        if err is not None:
            raise err
        return stored[0]

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

    def _close_worker_side(self) -> None:
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
        for s in (self._store, self._async_store):
            if s is not None:
                s.close()
