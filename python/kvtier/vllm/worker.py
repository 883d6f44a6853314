"""kvtier.vllm.worker: the connector's worker side. It runs in each of vLLM's workers, in the
forward pass: reads the step's pages from kvtierd, and its I/O thread copies them layer by layer
into vLLM's paged tensors while the forward computes the earlier layers. Saves are asynchronous:
a job per request and group goes to the I/O thread at the group's first layer of the step and
reserves room in kvtierd's mapping while the forward computes the rest; once the group's last layer
is in, it copies the request's blocks out of vLLM's tensors and commits (or PUTs staged pages); the
forward never waits for it. Each group (SupportsHMA: full
attention, sliding window) has its own layout and key chain. The blocks a job still has to read are
held: a finished request's by vLLM until get_finished reports it, a preempted request's saves are
cancelled before vLLM can hand its blocks on, and a sliding-window group's jobs have read their
blocks before the next step writes any (vLLM frees blocks that left the window). A load waits at
most what is left of the step's worker_deadline_ms; a save not stored within that long after its
step is dropped and its blocks handed back."""

from __future__ import annotations

import itertools
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Set, Tuple

import torch

from ..client import Reservation
from .common import (KvtierConnectorMetadata, _Transfer, failures_per_request, log, rank_salt,
                     worker_ranks)
from .layout import _Layout, _Plan, _Views, page_sums
from .store import _PageStore

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext


@dataclass
class _Load:
    """A step's load. Its job (_load_job, on the I/O thread) reads the pages (GET), sets
    ``fetched``, then copies them into vLLM's blocks one layer after another, marking each
    layer done, so that the forward computes a layer while the next ones are copied; then it
    releases the lease. The forward waits for ``fetched`` within the step's deadline (the
    daemon), then for its layer (memory only): a layer done costs it no lock; one not done
    yet, where the copies are CPU ones (``help``), it helps with, copying the next layer no
    one has taken (``claim``) until its own is done, and sleeps only when every layer is
    taken. ``lock`` is held while the I/O thread copies a layer: a load the forward gives up
    on (its deadline, before ``fetched``, so before any copy) is cancelled under it, and
    copies nothing more into blocks that vLLM will recompute."""

    t: _Transfer
    future: "Future[Any]"
    staging: Optional[torch.Tensor]
    blocks: List[int]
    nlayers: int
    help: bool = False  # the forward may copy layers itself (CPU copies)
    fetched: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    cv: threading.Condition = field(default_factory=threading.Condition)  # a layer done
    done: List[bool] = field(default_factory=list)  # per layer: copied, or never will be
    waiters: int = 0  # threads waiting on cv (none: a layer done notifies no one)
    claim: Iterator[int] = field(default_factory=itertools.count)  # the next layer to take
    views: Optional[_Views] = None  # what the GET got (set before ``fetched``)
    n: int = 0  # pages to copy (set before ``fetched``; 0: none)
    cancelled: bool = False
    pages: int = 0  # pages read by the job (set before ``fetched``)
    error: Optional[BaseException] = None  # the GET's, or a copy's
    got: int = -1  # pages the forward takes, once resolved

    def __post_init__(self) -> None:
        self.done = [False] * self.nlayers

    def mark(self, li: int) -> None:
        """Layer ``li`` is done: the threads waiting are told (none: no lock taken)."""
        self.done[li] = True  # one store: both threads mark (a counter would lose updates)
        if self.waiters:
            with self.cv:
                self.cv.notify_all()

    def wait(self, li: int) -> None:
        """Until layer ``li`` is done (li -1: every layer)."""
        with self.cv:
            self.waiters += 1
            try:
                while not (self.done[li] if li >= 0 else all(self.done)):
                    self.cv.wait()
            finally:
                self.waiters -= 1


# How many of a step's save jobs in a group, and how many bytes of their pages, reserve before
# the group's last layer (_save_group).
_AHEAD_JOBS = 16
_AHEAD_BYTES = 256 << 20


@dataclass
class _SaveJob:
    """One request's saves of one step in one KV cache group, on the I/O thread (_save_job).
    ``lock`` is held while the job copies vLLM's blocks out (memory only, never across a call to
    kvtierd): taking it is how the forward's thread cancels a job before vLLM reuses the blocks."""

    t: _Transfer
    deadline: float  # time.monotonic() by which it is stored, or dropped
    event: Any = None  # a CUDA event after the step's last layer: the blocks are written
    lock: threading.Lock = field(default_factory=threading.Lock)
    cancelled: bool = False  # not to read the blocks (preempted, or past its deadline)
    copied: bool = False  # the blocks are read: vLLM may reuse them
    future: Optional["Future[int]"] = None
    read: threading.Event = field(default_factory=threading.Event)  # copied, or never will
    # Submitted at the group's first layer (its RESERVE made while the forward computes the
    # rest): set once the group's last layer is in (``event`` then recorded), or the job is
    # dropped. None: submitted at the last layer.
    go: Optional[threading.Event] = None
    # _save_prep's result when _save_group made it ahead (taken by _save); False: not made.
    prep: Any = False


class WorkerSide:
    """The worker role's calls of KVConnectorBase_V1, mixed into KvtierConnector (which sets
    the shared state: settings, guard, model, sizes, deadline)."""

    def _init_worker_side(self) -> None:
        self._waited = 0.0  # seconds this step's forward has waited for the worker's I/O
        self._begun: Any = None  # the metadata of the step _begin_step began
        self._saves_here = True  # False on a TP rank whose KV another rank saves (MLA)
        self._layout: Optional[_Layout] = None  # group 0's (the only one without the HMA)
        self._layouts: Dict[int, _Layout] = {}  # per KV cache group (vLLM's gid)
        self._layer_at: Dict[str, Tuple[int, int]] = {}  # layer -> (group, index in its page)
        self._windows: Set[int] = set()  # the sliding-window and Mamba groups
        self._states: Set[int] = set()  # the Mamba groups (saved at wait_for_save)
        self._states_saved: Any = None  # the step's metadata whose Mamba saves went
        self._kv: Dict[str, torch.Tensor] = {}
        self._store: Optional[_PageStore] = None
        self._pool: Optional[ThreadPoolExecutor] = None
        self._loads: List[_Load] = []
        self._load_errors: Set[int] = set()
        # Asynchronous saves: the step's layers computed so far and the groups whose jobs went
        # (a group's go once all its layers here are in), each request's jobs not yet stored
        # (nor dropped), the requests the scheduler planned saves for (it holds their blocks
        # when they finish: request_finished), and those finished whose jobs are still out
        # (reported by get_finished once they are not).
        self._layers_in: Dict[int, Set[int]] = {}  # per group, its layers' indices
        self._submitted: Set[int] = set()
        self._early: Dict[int, List[_SaveJob]] = {}  # per group, jobs waiting for its last layer
        self._jobs: Dict[str, List[_SaveJob]] = {}
        self._saving_reqs: Set[str] = set()
        self._finishing: Set[str] = set()
        self._io_futures: List[Tuple[str, "Future[Any]"]] = []  # load jobs (their releases)
        # Loads between steps (load_async): their own connection and thread, so that a step's
        # saves never queue behind them; reported by get_finished once done.
        self._async_store: Optional[_PageStore] = None
        self._async_pool: Optional[ThreadPoolExecutor] = None
        self._async_loads: Dict[str, "Future[int]"] = {}
        self._async_errors: Dict[str, List[int]] = {}
        # Requests whose asynchronous load failed, reported as a whole (failed_recving):
        # where vLLM cannot take failed blocks (common.failures_per_request).
        self._failed_recving: Set[str] = set()
        # Requests the scheduler could not plan a load for (the metadata's ``unplanned``): vLLM
        # waits for them, so get_finished reports them loaded, and failed (failed_recving).
        self._unplanned_recving: Set[str] = set()
        # Staging memory kept from step to step (a fresh 64 MiB tensor each step costs its page
        # faults on every load and save): [0] the step's loads; the save jobs take theirs from
        # a free list (_staging_free), as they outlive their step. _staged counts the rows of
        # staging the saves ever made (0: every save went through the mapping).
        self._arenas: List[torch.Tensor] = [torch.empty(0, dtype=torch.uint8)]
        self._staging_free: List[torch.Tensor] = []
        self._staging_lock = threading.Lock()
        self._staged = 0

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
        # Groups storing some pages of their chain: sliding windows and Mamba states (saved
        # as chains with gaps, read before the next step: _window_saves_read).
        self._windows = {g.gid for g in self._groups if g.gaps}
        self._states = {g.gid for g in self._groups if g.state}
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
                                           self._layout.page_bytes, keep=False,
                                           **self._worker_store(" (async loads)"))
            self._async_pool = ThreadPoolExecutor(1, thread_name_prefix="kvtier-vllm-load")
        # Set-up that would otherwise fall on the first step's load and save: the I/O threads
        # (an executor starts its thread at the first job: 7-100 ms to the job's start on this
        # loaded 2-core VM, 0.02 after), the connections (and the arena's mapping), and each
        # layout's view of vLLM's tensors (_Layout.plan's).
        for pool in (self._pool, self._async_pool):
            if pool is not None:
                pool.submit(int).result()
        for st in (self._store, self._async_store):
            if st is not None:
                st.connect()
        for lay in self._layouts.values():
            lay.prepare(self._kvs(lay))

    def _worker_store(self, what: str = "") -> Dict[str, Any]:
        return dict(guard=self._guard, deadline_ms=self._worker_deadline_ms,
                    what="vllm worker" + what)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        """Starts reading this step's pages (whole pages, all layers) from kvtierd: with the
        zero-copy mapping, a MATCH with a lease and a GET by location (the pages stay where
        they lie in the mapping); else into staging buffers. wait_for_layer_load scatters each
        layer. The step's waits for them share worker_deadline_ms; with the circuit breaker
        open, the loads are load errors at once and nothing is sent. First, before the step
        writes any block: the saves of requests vLLM preempted (their blocks freed) that have
        not read their blocks yet are cancelled."""
        meta = self._connector_metadata
        if not isinstance(meta, KvtierConnectorMetadata):
            return
        self._unplanned_recving.update(meta.unplanned)
        # Loads in the step the scheduler could not plan: vLLM counts their tokens computed,
        # so their blocks are this step's load errors on every worker (vLLM recomputes them).
        self._load_errors.update(meta.load_errors)
        self._tally.add("load_errors", len(meta.load_errors))
        if self._layout is None:
            return
        if self._begun is not meta:  # a vLLM that does not call handle_preemptions first
            self._begin_step(meta)
        self._finish_loads()  # anything a previous step left
        # Every request among the saves, whichever group: vLLM frees a held request's blocks
        # once every worker reported it in finished_sending, this one even with none of its
        # groups' layers (another pipeline stage's).
        self._saving_reqs.update(t.req_id for t in meta.saves)
        self._sweep_saves()
        # A group with no layer in this worker (another pipeline stage's) has nothing to load.
        loads = [t for t in meta.loads if self._here(t)]
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
            lay = self._layouts[t.group]
            ld = _Load(t, None, None if arena is None else arena[at:at + n],  # type: ignore
                       list(t.block_ids), len(lay.names),
                       help=not self._kv[lay.names[0]].is_cuda)
            at += n
            ld.future = self._pool.submit(self._load_job, ld)
            self._loads.append(ld)

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        """vLLM 0.34's model runner calls this before the step's forward, and start_load_kv
        before it only when the step loads in it (``has_sync_kv_loads``), else after it: what
        must come before the forward writes any block is done here (_begin_step), or by
        start_load_kv for a vLLM that does not call this."""
        if isinstance(kv_connector_metadata, KvtierConnectorMetadata) and \
                self._layout is not None:
            self._begin_step(kv_connector_metadata)

    def _begin_step(self, meta: KvtierConnectorMetadata) -> None:
        """Before the step writes any block, once a step (handle_preemptions, else
        start_load_kv): its wait budget starts; the saves of requests vLLM preempted (their
        blocks freed, maybe handed to another request this step) that have not read their
        blocks yet are cancelled, and the sliding-window groups' have read theirs (after the
        forward, this step's own window saves would be among them)."""
        self._begun = meta
        self._waited = 0.0
        for rid in meta.preempted:
            for job in self._jobs.pop(rid, ()):
                self._cancel(job, "its request was preempted")
        self._window_saves_read()

    def _window_saves_read(self) -> None:
        """Before this step writes any block: the save jobs of sliding-window groups have read
        their blocks, or never will. vLLM frees a running request's blocks that left its
        window when it schedules the next step (the request is not finished: nothing holds
        them) and may hand them to another request this very step; a job that has not read
        them by the step's deadline is cancelled (a later miss, never wrong KV). Full-attention
        blocks need no wait: vLLM frees them only when the request finishes (held until its
        saves are done) or is preempted (its saves cancelled above)."""
        if not self._windows:
            return
        for jobs in self._jobs.values():
            for job in jobs:
                if job.t.group in self._windows and not job.read.is_set() and \
                        not self._wait_event(job.read):
                    self._cancel(job, "its window's blocks not read before the next step")

    def _here(self, t: _Transfer) -> bool:
        """Whether ``t``'s group has layers in this worker (another pipeline stage moves the
        rest)."""
        lay = self._layouts.get(t.group)
        return lay is not None and bool(lay.names)

    def _my_saves(self, meta: KvtierConnectorMetadata) -> List[_Transfer]:
        """The step's saves of groups with layers in this worker."""
        return [t for t in meta.saves if self._here(t)]

    def _zero_copy(self) -> bool:
        """Whether to try the mapped path (not known before the first connection)."""
        st = self._store
        return st is not None and st.keyed and bool(self._extra.get("zero_copy", True)) and \
            (st.mapped or st._client is None)

    def _load_job(self, ld: _Load) -> None:
        """A step's load, on the I/O thread: the pages read (GET by location into the mapping,
        or into staging), then copied into vLLM's blocks layer by layer (see _Load), the
        forward taking some where it helps, then the lease released once every layer is in.
        Never raises: a failure is ld.error."""
        assert self._store is not None
        try:
            try:
                with self._tally.timer("load_seconds"):
                    r = self._load(ld)
                if isinstance(r, _Views):
                    ld.views, ld.pages = r, r.pages
                else:
                    ld.pages = int(r)
            except Exception as e:  # noqa: BLE001 - the forward recomputes
                ld.error = e
            finally:
                ld.n = ld.pages if ld.error is None else 0
                ld.fetched.set()
            for li in ld.claim:
                if li >= ld.nlayers:
                    break
                try:
                    with ld.lock:
                        if ld.n > 0 and not ld.cancelled and ld.error is None:
                            self._copy_layer(ld, li)
                except Exception as e:  # noqa: BLE001 - the forward reports load errors
                    ld.error = e
                finally:
                    ld.mark(li)
            if not all(ld.done):  # the forward still copies a layer it took from the views
                ld.wait(-1)
        finally:
            views = ld.views
            if views is not None and views.lease:  # its views not touched after this
                views.runs.clear()
                views.plan = None
                self._store.release_views(views.lease)

    def _copy_layer(self, ld: _Load, li: int) -> None:
        """Layer ``li`` of the load's pages into vLLM's blocks (the I/O thread's, or the
        forward's where it helps)."""
        lay = self._layouts[ld.t.group]
        kv = self._kv[lay.names[li]]
        if ld.views is not None:  # straight from the mapping (one C call with a plan)
            lay.scatter_runs(ld.views.runs, li, kv, ld.views.plan)
        else:
            lay.scatter(ld.staging[:ld.n], li, kv, ld.blocks[:ld.n])  # type: ignore
        if kv.is_cuda:  # in the blocks before the forward reads them
            torch.cuda.current_stream(kv.device).synchronize()

    def _help(self, ld: _Load, li: int) -> None:
        """The forward's wait for layer ``li`` of a load that has its pages: rather than
        sleeping until the I/O thread has copied it (a wake-up per layer, and the GIL handed
        back and forth with the copying thread), it copies the next layers no one has taken
        until ``li`` is done (at most one layer past the I/O thread's), then sleeps only if
        the I/O thread still copies ``li``. The forward only reaches here before any layer is
        cancelled (it cancels before ``fetched``), so its copies need not take ``lock``."""
        if ld.help:
            while not ld.done[li]:
                k = next(ld.claim)
                if k >= ld.nlayers:
                    break
                try:
                    if ld.n > 0 and ld.error is None:
                        self._copy_layer(ld, k)
                except Exception as e:  # noqa: BLE001 - the whole load is recomputed
                    ld.error = e
                finally:
                    ld.mark(k)
        if not ld.done[li]:
            ld.wait(li)

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
            lay = self._layouts[t.group]
            runs = lay.runs(items, ld.blocks[:len(items)])
            plan = lay.plan(runs, self._kvs(lay), True)
        except Exception:
            if lease:
                self._store.release_views(lease)
            raise
        return _Views(lease, len(items), runs, items, plan)

    def _kvs(self, lay: _Layout) -> List[torch.Tensor]:
        """The registered tensors of ``lay``'s layers, in its layer order (_Layout.plan's)."""
        return [self._kv[n] for n in lay.names]

    def _load_between(self, ts: List[_Transfer]) -> int:
        """An asynchronous load of one request (each of its groups), on its own thread: every
        layer into the blocks (which vLLM does not touch until get_finished reports the
        request), straight from the pages where they lie in the mapping (a MATCH with a lease
        and locations, the lease released once all layers are in), or without the mapping
        through a staging buffer of its own. Never raises: pages that did not come are load
        errors."""
        total = 0
        for t in ts:
            got = self._load_group_between(t)
            self._count_load(got, len(t.block_ids))
            if got < len(t.block_ids):
                self._async_errors.setdefault(t.req_id, []).extend(t.block_ids[got:])
            total += got
        return total

    def _load_group_between(self, t: _Transfer) -> int:
        """_load_between's work for one group: the pages copied in (0 on a failure)."""
        assert self._async_store is not None
        lay, got = self._layouts[t.group], 0
        try:
            with self._tally.timer("load_seconds"):
                views = self._async_store.load_views(t.keys, t.first) \
                    if self._async_store.keyed and self._extra.get("zero_copy", True) else None
            if views is not None:
                lease, items = views
                try:
                    if items:
                        runs = lay.runs(items, t.block_ids[:len(items)])
                        plan = lay.plan(runs, self._kvs(lay), True)
                        for li, name in enumerate(lay.names):
                            lay.scatter_runs(runs, li, self._kv[name], plan)
                        runs.clear()
                        plan = None
                        got = len(items)
                finally:
                    if lease:
                        self._async_store.release_views(lease)
            else:
                staging = torch.empty((len(t.keys) - t.first, lay.page_bytes),
                                      dtype=torch.uint8)
                with self._tally.timer("load_seconds"):
                    got = int(self._async_store.load(t.keys, t.first, staging))
                if got > 0:
                    for li, name in enumerate(lay.names):
                        lay.scatter(staging[:got], li, self._kv[name], t.block_ids[:got])
            kv = self._kv[lay.names[0]]
            if got > 0 and kv.is_cuda:
                torch.cuda.current_stream(kv.device).synchronize()
        except Exception as e:  # noqa: BLE001
            got = 0
            self._guard.count("failures")
            self._guard.warn("kvtier: load of %s failed, recomputing: %s", t.req_id, e)
        return got

    def _arena(self, which: int, pages: int) -> torch.Tensor:
        assert self._layout is not None
        a = self._arenas[which]
        if a.shape[0] < pages or a.dim() != 2:
            a = self._arenas[which] = torch.empty((pages, self._layout.page_bytes),
                                                  dtype=torch.uint8)
        return a

    def _wait_event(self, ev: threading.Event) -> bool:
        """Waits for an I/O job's event within what is left of this step's
        worker_deadline_ms. False (counted) when it is not set by then: the forward goes on
        without it."""
        if ev.is_set():
            return True
        left = self._worker_deadline_ms / 1000.0 - self._waited
        t0 = time.monotonic()
        if left > 0:
            ev.wait(left)
        self._waited += time.monotonic() - t0
        if ev.is_set():
            return True
        self._guard.count("deadline_misses")
        return False

    def _resolve(self, ld: _Load) -> None:
        """Waits for the load's GET within the step's deadline: its pages, or none (cancelled:
        its job copies nothing into the blocks, which vLLM recomputes)."""
        if ld.got >= 0:
            return
        if not self._wait_event(ld.fetched):
            # Not here by the deadline: recomputed. Its staging stays the job's (the next step
            # takes fresh memory); its job gives the lease back when it comes.
            with ld.lock:
                ld.cancelled = True
            self._guard.warn("kvtier: load of %s not done within worker_deadline_ms (%d ms), "
                             "recomputing it", ld.t.req_id, self._worker_deadline_ms)
            if ld.staging is not None:
                self._arenas[0] = torch.empty(0, dtype=torch.uint8)
            ld.got = 0
        elif ld.error is not None:
            self._guard.count("failures")
            self._guard.warn("kvtier: load of %s failed, recomputing: %s", ld.t.req_id,
                             ld.error)
            ld.got = 0
        else:
            ld.got = ld.pages
        self._count_load(ld.got, len(ld.t.block_ids))
        if ld.got < len(ld.t.block_ids):
            self._load_errors.update(ld.t.block_ids[ld.got:])

    def _count_load(self, got: int, blocks: int) -> None:
        assert self._layout is not None
        self._tally.add("load_pages", got)
        self._tally.add("load_bytes", got * self._layout.page_bytes)
        self._tally.add("load_errors", blocks - got)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Waits until this layer of every page loaded this step is in vLLM's blocks (the I/O
        thread copies the layers in order while the forward computes the earlier ones)."""
        if not self._loads or self._layout is None:
            return
        at = self._layer_at.get(layer_name)
        if at is None:
            return
        gid, li = at
        for ld in self._loads:
            if ld.t.group != gid:  # another group's layers: waited for at its own
                continue
            self._resolve(ld)
            if ld.got > 0:
                if not ld.done[li]:  # a copy in memory: the GET is done
                    self._help(ld, li)
                if ld.error is not None:  # a copy failed: the whole load is recomputed
                    self._load_errors.update(ld.t.block_ids)

    def _finish_loads(self) -> None:
        """The step's loads all in (or given up): every layer copied, before the step ends.
        The jobs release their leases on the I/O thread (not waited for)."""
        try:
            for name in list(self._layer_at):
                self.wait_for_layer_load(name)
        finally:
            for ld in self._loads:
                if ld.future is not None:
                    self._io_futures.append((ld.t.req_id, ld.future))
            self._loads.clear()

    # == saves: asynchronous, off the forward's thread ============================================

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        """Notes that this layer of the step is computed. At a KV cache group's first layer of
        the step, one save job per request of that group goes to the I/O thread (_save_job),
        which reserves the room; after its last layer (_go) the jobs copy the blocks out and
        store them. Nothing here waits for kvtierd, nor copies."""
        meta = self._connector_metadata
        if not isinstance(meta, KvtierConnectorMetadata) or self._layout is None or \
                not meta.saves:
            return
        self._saving_reqs.update(t.req_id for t in meta.saves)
        if not self._saves_here:  # another TP rank saves the KV this one holds too (MLA)
            return
        at = self._layer_at.get(layer_name)
        if at is None:
            return
        gid, li = at
        if gid in self._states:  # saved at wait_for_save (vLLM's Mamba layers do not call)
            return
        done = self._layers_in.setdefault(gid, set())
        done.add(li)
        if gid in self._submitted:
            return
        last = len(done) == len(self._layouts[gid].names)
        if last:
            self._submitted.add(gid)
            early = self._early.pop(gid, None)
            if early is not None:
                self._go(early)
            else:
                saves = [t for t in self._my_saves(meta) if t.group == gid]
                bad = [t for t in saves if self._on_failed_load(t)]
                if bad:
                    self._guard.count("saves_dropped", len(bad))
                    self._guard.warn("kvtier: %d saves dropped: their pages were computed on "
                                     "blocks whose load failed", len(bad))
                self._submit_saves([t for t in saves if t not in bad])
        elif len(done) == 1 and gid not in self._early:
            # The group's first layer: its jobs go to the I/O thread now and make their
            # RESERVE while the forward computes the other layers; each copies once the last
            # is in (_go). bench_vllm's warm save: RESERVE 0.12-0.15 ms and the hand-off to the
            # I/O thread no longer after the last layer (docs/benchmarks.md).
            self._early[gid] = self._submit_saves(
                [t for t in self._my_saves(meta) if t.group == gid], early=True)

    def _go(self, jobs: List[_SaveJob]) -> None:
        """The group's last layer is in: its early jobs may read the blocks once written (the
        CUDA event recorded now) and have worker_deadline_ms from now to be stored."""
        if not jobs:
            return
        event = None
        if self._kv[self._layouts[jobs[0].t.group].names[0]].is_cuda:
            event = torch.cuda.Event()
            event.record()
        deadline = time.monotonic() + self._worker_deadline_ms / 1000.0
        for job in jobs:
            if self._on_failed_load(job.t):
                self._cancel(job, "its pages were computed on blocks whose load failed")
            job.event, job.deadline = event, deadline
            assert job.go is not None
            job.go.set()

    def _on_failed_load(self, t: _Transfer) -> bool:
        """Whether save ``t``'s pages were computed on a block whose load failed this step
        (its ``reads``; the group's last layer is in, so every load error of its layers is
        known): such pages hold KV computed on garbage, never to be stored."""
        return bool(t.reads) and not self._load_errors.isdisjoint(t.reads)

    def _submit_saves(self, saves: List[_Transfer], early: bool = False) -> List[_SaveJob]:
        """The save jobs of ``saves`` (one group's) to the I/O thread; ``early`` (the group's
        first layer): each waits for _go before it reads the blocks. Returns the jobs."""
        assert self._store is not None and self._pool is not None
        if not saves:
            return []
        if not self._store.up:
            # kvtierd unreachable: the step's saves are dropped at once (no copy, no I/O).
            self._guard.count("short_circuited")
            self._guard.count("saves_dropped", len(saves))
            return []
        event = None
        lay = self._layouts[saves[0].group]
        if not early and self._kv[lay.names[0]].is_cuda:  # read the blocks once written
            event = torch.cuda.Event()
            event.record()
        deadline = time.monotonic() + self._worker_deadline_ms / 1000.0
        go = threading.Event() if early else None  # one for the group's jobs
        jobs = []
        for t in saves:
            job = _SaveJob(t, deadline, event, go=go)
            if early:  # set by _save_group
                job.future = Future()
            else:
                job.future = self._pool.submit(self._save_job, job)
            self._jobs.setdefault(t.req_id, []).append(job)
            jobs.append(job)
        if early:
            self._pool.submit(self._save_group, jobs)
        return jobs

    def _save_group(self, jobs: List[_SaveJob]) -> None:
        """An early group's jobs (one per request) on the I/O thread: every job's RESERVE and
        plan first, while the forward computes the group's other layers, then each one's copies
        and COMMIT once the last layer is in (_save_job). As one executor job each, the first
        waited for the last layer before the second made its RESERVE: every request after the
        first reserved and planned after the last layer (0.15-0.25 ms each, bench_vllm's
        geometry). Up to _AHEAD_JOBS jobs and _AHEAD_BYTES of pages reserve ahead: the daemon
        bounds what one connection's reservations hold (max-reservations 64, max-reserved-bytes
        1 GiB by default), and room held ahead would leave the next jobs less; the others
        reserve in their turn. Sets each job's future as the executor would."""
        assert self._layout is not None
        errs: List[Optional[BaseException]] = []  # each job's failure before its turn
        ahead = held = 0
        for job in jobs:
            n = (len(job.t.keys) - job.t.first) * self._layout.page_bytes
            if ahead >= _AHEAD_JOBS or (ahead and held + n > _AHEAD_BYTES):
                errs.append(None)  # _save_job reserves it in its turn
                continue
            ahead, held = ahead + 1, held + n
            try:
                with self._tally.timer("save_seconds"):
                    job.prep = self._save_prep(job)
            except BaseException as e:  # noqa: BLE001 - the job's future carries it
                job.read.set()
                errs.append(e)
                continue
            errs.append(None)
        for job, err in zip(jobs, errs):
            assert job.future is not None
            if err is not None:
                job.future.set_exception(err)
                continue
            try:
                job.future.set_result(self._save_job(job))
            except BaseException as e:  # noqa: BLE001
                job.future.set_exception(e)

    def _save_job(self, job: _SaveJob) -> int:
        """A request's saves of one step in one group, on the I/O thread: mapped, RESERVE of
        its pages (the group's chain), the blocks copied straight into the reserved room (on
        the CPU one numpy copy per run of blocks and layer) and COMMIT; pages without room (or
        not mapped) copied into staging and PUT. A page held already is left alone. Returns the
        pages stored (0: cancelled before it read the blocks)."""
        assert self._store is not None and self._layout is not None
        stored = [0]
        try:
            with self._tally.timer("save_seconds"):
                return self._save(job, stored)
        finally:  # what did go, even when a part failed
            job.read.set()
            self._tally.add("save_pages", stored[0])
            self._tally.add("save_bytes", stored[0] * self._layout.page_bytes)

    def _save_prep(self, job: _SaveJob) -> Optional[Tuple[Optional[Reservation], List[Any],
                                                           Optional[_Plan], List[int]]]:
        """A save job's part before it reads the blocks: mapped, the RESERVE of its pages and
        the plan of its copies. Returns (the reservation or None, runs, plan, the rows to
        stage), or None: cancelled already."""
        assert self._store is not None
        t = job.t
        lay = self._layouts[t.group]
        if job.cancelled:
            return None
        resv: Optional[Reservation] = None
        runs: List[Any] = []
        plan: Optional[_Plan] = None  # the runs' copies in C (None: numpy's)
        rows = list(range(len(t.keys) - t.first))  # the pages to stage (from t.first)
        got = None
        if self._zero_copy():
            try:
                got = self._store.reserve(t.keys, t.first, gaps=t.group in self._windows)
            except Exception as e:  # noqa: BLE001 - staged instead
                if not self._store.up:
                    raise
                log.info("kvtier: no reservation for %s, staging it: %s", t.req_id, e)
        if got is not None:
            resv, held = got
            try:
                views, vblocks, addrs, rows = [], [], [], []
                for j, v in enumerate(resv.views):
                    p = t.first + j
                    if v is not None:
                        views.append(v)
                        vblocks.append(t.block_ids[j])
                        addrs.append(resv.addrs[j])
                    elif not (held is not None and p < len(held) and held[p]):
                        rows.append(j)
                # Sealed: the copies go page by page (copy_sums), planned straight from the
                # room's addresses, without runs (save_plan); else, or where it gives no plan,
                # by runs. A page-ordered plan copies only through copy_sums: it is taken only
                # where seal (below) will hold.
                if resv.sealed and vblocks and len(vblocks) == resv.nreserved:
                    plan = lay.save_plan(addrs, vblocks, self._kvs(lay))
                if plan is None:
                    runs = lay.runs(views, vblocks)
                    plan = lay.plan(runs, self._kvs(lay), False) if runs else None
            except Exception as e:  # noqa: BLE001
                self._guard.warn("kvtier: reservation for %s unusable, staging it: %s",
                                 t.req_id, e)
                self._abort(resv)
                resv, runs, rows = None, [], list(range(len(t.keys) - t.first))
                plan = None
        return resv, runs, plan, rows

    def _save(self, job: _SaveJob, stored: List[int]) -> int:
        assert self._store is not None
        t = job.t
        lay = self._layouts[t.group]
        got, job.prep = (self._save_prep(job) if job.prep is False else job.prep), False
        if got is None:
            return 0
        resv, runs, plan, rows = got
        # An early job (submitted at the group's first layer) reads the blocks once the last
        # layer is in; RESERVE and the plan went before. Not let go by its deadline: dropped.
        if job.go is not None and not job.go.wait(max(0.0, job.deadline - time.monotonic())):
            with job.lock:
                job.cancelled = job.cancelled or not job.copied
        if job.event is not None and not job.cancelled:  # the blocks written (CUDA)
            job.event.synchronize()
        staging = self._take_staging(len(rows)) if rows else None
        # Where the daemon seals committed pages, the copies into its room take each page's
        # checksum in the same pass (all layers of a page, then the next) and COMMIT carries
        # them: else the daemon hashes the pages itself right after COMMIT's reply, on its loop
        # thread, and the next lookup waits behind it (docs/engines.md).
        seal = resv is not None and resv.sealed and plan is not None and plan.sums and \
            plan.pages == resv.nreserved  # one sum per reserved page, in page order
        sums = None
        try:
            with job.lock:  # the forward's thread cancels under it: the blocks are not read
                if not job.cancelled:
                    blocks = [t.block_ids[j] for j in rows]
                    if seal:
                        sums = plan.copy_sums()  # type: ignore[union-attr]
                    if blocks or not seal:
                        for li, name in enumerate(lay.names):
                            kv = self._kv[name]
                            if runs and not seal:
                                lay.gather_runs(runs, li, kv, plan)
                            if blocks:
                                lay.gather(staging, li, kv, blocks)  # type: ignore
                    job.copied = True
            job.read.set()
            copied_runs = bool(runs) and not seal
            runs, plan = [], None  # the views are not touched after this
            if not job.copied:
                if resv is not None and resv.id:
                    self._abort(resv)
                return 0
            if copied_runs and resv is not None and resv.id and resv.sealed:
                sums = self._sums_of(resv)
            return self._store_pages(t, resv, rows, staging, stored, sums)
        except Exception:
            if not job.copied and resv is not None and resv.id:  # a copy failed part-way:
                self._abort(resv)  # none of its pages becomes visible, half-written or not
            raise
        finally:
            if staging is not None:
                self._give_staging(staging)

    def _sums_of(self, resv: Reservation) -> Optional[Any]:
        """The sums of a sealed reservation's pages copied without them (numpy's copies, a
        CUDA tensor's: no page-ordered span plan): hashed here, on the I/O thread, rather than
        by the daemon on its loop after COMMIT's reply, where the next lookup would wait
        behind it. None (the daemon hashes them) where a page of it got no copy or libkvtier
        cannot hash."""
        assert self._store is not None
        addrs = [a for a, v in zip(resv.addrs, resv.views) if v is not None]
        if len(addrs) != resv.nreserved:
            return None
        return page_sums(addrs, self._store.block_bytes)

    def _store_pages(self, t: _Transfer, resv: Optional[Reservation], rows: List[int],
                     staging: Optional[torch.Tensor], stored: List[int],
                     sums: Optional[Any] = None) -> int:
        """Commits the reservation (with its pages' ``sums`` when the copies took them) and
        PUTs the staged rows (runs of consecutive pages). ``stored[0]`` counts the pages
        stored as they go."""
        assert self._store is not None
        err = None
        if resv is not None and resv.id:
            try:
                stored[0] += self._store.commit(resv, sums)
            except Exception as e:  # noqa: BLE001 - the staged pages may still go
                err = e
        i = 0
        while i < len(rows):
            k = i + 1
            while k < len(rows) and rows[k] == rows[k - 1] + 1:
                k += 1
            a, b = t.first + rows[i], t.first + rows[k - 1] + 1
            stored[0] += self._store.save(t.keys[:b], a, staging[i:k],  # type: ignore
                                          gaps=t.group in self._windows)
            i = k
        if err is not None:
            raise err
        return stored[0]

    def _take_staging(self, rows: int) -> torch.Tensor:
        """Staging rows for a save job: a buffer a finished job gave back, else a new one."""
        assert self._layout is not None
        with self._staging_lock:
            for i, a in enumerate(self._staging_free):
                if a.shape[0] >= rows:
                    return self._staging_free.pop(i)[:rows]
            self._staged += rows
        return torch.empty((rows, self._layout.page_bytes), dtype=torch.uint8)

    def _give_staging(self, a: torch.Tensor) -> None:
        base = a._base if a._base is not None else a  # the whole buffer, not the job's rows
        with self._staging_lock:
            if len(self._staging_free) < 4:
                self._staging_free.append(base)

    def _abort(self, r: Reservation) -> None:
        assert self._store is not None
        try:
            self._store.abort(r)
        except Exception as e:  # noqa: BLE001 - expires in the daemon's reserve-ms, or gone
            log.info("kvtier: abort of reservation %d: %s", r.id, e)

    def _cancel(self, job: _SaveJob, why: str, late: bool = False) -> None:
        """On the forward's thread: the job is not to read vLLM's blocks any more (they are
        freed, or handed back). Waits only for a copy in progress (memory, never kvtierd). A
        job that has read them goes on alone: its pages are stored if it ends well (``late``:
        counted as dropped all the same, it is no longer waited for)."""
        with job.lock:
            if job.copied and not late:
                return
            job.cancelled = not job.copied
        self._guard.count("saves_dropped")
        self._guard.warn("kvtier: save of %s dropped: %s", job.t.req_id, why)

    def _sweep_saves(self) -> None:
        """Settles the save jobs that are done (a failure counted and logged: a later miss),
        and drops those past their deadline (worker_deadline_ms after their step): their
        blocks are handed back, whatever the daemon does."""
        now = time.monotonic()
        for rid in list(self._jobs):
            keep = []
            for job in self._jobs[rid]:
                f = job.future
                if f is not None and f.done():
                    try:
                        f.result()
                    except Exception as e:  # noqa: BLE001
                        self._guard.count("failures")
                        self._guard.count("saves_dropped")
                        self._guard.warn("kvtier: save of %s failed: %s", rid, e)
                elif now >= job.deadline:
                    self._guard.count("deadline_misses")
                    self._cancel(job, "not stored within worker_deadline_ms (%d ms)"
                                 % self._worker_deadline_ms, late=True)
                else:
                    keep.append(job)
            if keep:
                self._jobs[rid] = keep
            else:
                del self._jobs[rid]

    def saves_in_flight(self) -> int:
        """Save jobs neither stored nor dropped yet (settling those that are)."""
        self._sweep_saves()
        return sum(len(j) for j in self._jobs.values())

    def wait_saves(self, req_ids: Optional[Set[str]] = None,
                   timeout: Optional[float] = None) -> bool:
        """Blocks until the save jobs of ``req_ids`` (every request's when None) are done:
        stored, failed or cancelled, each woken by its job's end, not polled. Returns whether
        they all are, ``timeout`` seconds at most (None: no limit; a job past its
        worker_deadline_ms is not waited for: get_finished drops it). vLLM never calls it (its
        steps call get_finished); a benchmark or a shutdown that needs the pages stored before
        a lookup does, then get_finished hands the finished requests back at once. On the
        forward's thread, as get_finished."""
        futs = [j.future for rid, jobs in self._jobs.items()
                if req_ids is None or rid in req_ids for j in jobs if j.future is not None]
        if futs:
            # The deadline bounds the wait as it bounds the job (a job past it is dropped).
            limit = max(j.deadline for jobs in self._jobs.values() for j in jobs) - \
                time.monotonic()
            limit = max(0.0, limit if timeout is None else min(timeout, limit))
            wait_futures(futs, timeout=limit)
        self._sweep_saves()
        return not any(req_ids is None or rid in req_ids for rid in self._jobs)

    def wait_for_save(self) -> None:
        """Ends the step without waiting for kvtierd: the step's save jobs are on the I/O
        thread (a step whose layers did not all come to this worker, as with another pipeline
        stage holding the rest, saves nothing), and the loads' leases are released there."""
        try:
            self._finish_loads()
        finally:
            self._layers_in.clear()
            self._submitted.clear()
            # Groups whose last layer did not come to this worker: their early jobs read
            # nothing and give their reservations back (as before they were early, such a
            # step saves nothing, and counts nothing dropped).
            for jobs in self._early.values():
                for job in jobs:
                    with job.lock:
                        job.cancelled = True
                    assert job.go is not None
                    job.go.set()
            self._early.clear()
            self._save_states()
        self._sweep_saves()
        pending = []
        for rid, fut in self._io_futures:
            if not fut.done():
                pending.append((rid, fut))
                continue
            try:
                fut.result()
            except Exception as e:  # noqa: BLE001
                log.info("kvtier: %s: %s", rid, e)
        self._io_futures = pending

    def _save_states(self) -> None:
        """The step's saves of Mamba groups, once its forward is done: vLLM's Mamba layers
        call neither save_kv_layer nor wait_for_layer_load (mamba.py)."""
        meta = self._connector_metadata
        if not self._states or not self._saves_here or meta is self._states_saved or \
                not isinstance(meta, KvtierConnectorMetadata):
            return
        self._states_saved = meta  # once a step, however often wait_for_save is called
        for gid in self._states:
            self._submit_saves([t for t in self._my_saves(meta) if t.group == gid])

    def get_finished(self, finished_req_ids: Set[str]
                     ) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        """(Finished requests whose blocks vLLM may free now: their saves stored, failed or
        dropped at their deadline; the requests whose asynchronous load is done). A finished
        request is held (request_finished returned True) exactly when the scheduler planned
        a save for it, which is when this worker saw it among a step's saves; one that also
        waits for its load between steps is reported with that load only. The blocks of
        asynchronous loads that did not arrive are reported by the
        get_block_ids_with_load_errors call that follows."""
        self._sweep_saves()
        for rid in finished_req_ids or ():
            if rid in self._saving_reqs:
                self._saving_reqs.discard(rid)
                # Finished while it waits for its load between steps (resumed after a
                # preemption, its saves planned before it): vLLM holds its blocks for that load
                # too and frees them at the first report of either; reported in both, it frees
                # them twice (an assertion). Its load's report frees them.
                if rid in self._async_loads or rid in self._unplanned_recving:
                    continue
                self._finishing.add(rid)
        sending = {rid for rid in self._finishing if rid not in self._jobs}
        self._finishing -= sending
        done = {rid for rid, f in self._async_loads.items() if f.done()}
        for rid in done:
            del self._async_loads[rid]
            errors = self._async_errors.pop(rid, ())
            if errors and failures_per_request(self._groups, self._vllm_groups):
                self._failed_recving.add(rid)
            else:
                self._load_errors.update(errors)
        # An unplanned load is its request's failure whatever the groups: no block of it was
        # planned, and vLLM 0.34 takes failed_recving for any request that waits for its load.
        unplanned, self._unplanned_recving = self._unplanned_recving, set()
        done |= unplanned
        self._failed_recving |= unplanned
        return (sending or None), (done or None)

    def get_transfer_results(self, finished_req_ids: Set[str]) -> Any:
        """vLLM's KVConnectorTransferResults: get_finished's, with the requests whose
        asynchronous load failed as a whole (failed_recving, among finished_recving too) where
        blocks cannot be reported (common.failures_per_request): vLLM recomputes them from
        their first token."""
        from vllm.distributed.kv_transfer.kv_connector.v1.base import \
            KVConnectorTransferResults

        sending, recving = self.get_finished(finished_req_ids)
        failed, self._failed_recving = self._failed_recving, set()
        return KVConnectorTransferResults(finished_sending=set(sending or ()),
                                          finished_recving=set(recving or ()),
                                          failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> Set[int]:
        """Blocks whose pages did not arrive this step (daemon gone, page evicted, a load the
        scheduler could not plan): vLLM recomputes them."""
        self._finish_loads()
        out, self._load_errors = self._load_errors, set()
        return out

    def _close_worker_side(self) -> None:
        """Ends the step, lets the save jobs out finish (each call to kvtierd is bounded by
        worker_deadline_ms), stops the I/O threads, closes the connections (the daemon drops
        their leases)."""
        try:
            self.wait_for_save()
        except Exception:  # noqa: BLE001
            pass
        for pool in (self._pool, self._async_pool):
            if pool is not None:
                pool.shutdown(wait=True)
        self._pool = self._async_pool = None
        self._sweep_saves()
        self._jobs.clear()
        self._io_futures.clear()
        self._async_loads.clear()
        self._async_errors.clear()
        for s in (self._store, self._async_store):
            if s is not None:
                s.close()
