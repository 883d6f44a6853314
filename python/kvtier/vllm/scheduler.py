"""kvtier.vllm.scheduler: the connector's scheduler side. It runs on vLLM's scheduler thread:
asks kvtierd how much of a request's prefix it holds (leased until the request finishes), and
plans each step's loads and saves into the metadata the workers receive."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Optional, Set, Tuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from ..client import Hints
from ..guard import number
from .common import (PREEMPT_PAUSE_MS, SCHEDULER_DEADLINE_MS, _WHERE, KvGroup,
                     KvtierConnectorMetadata, _ReqState, _Transfer, group_chain, key_chain, log,
                     rank_salt)
from .mamba import state_hit, state_load, state_save
from .store import _PageStore, _stored

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


def _window_hit(tiers: bytes, g: KvGroup, block_size: int) -> int:
    """The longest prefix (pages) a sliding-window group can load from a chain whose pages
    hold bytes where ``tiers`` is not 0: the largest ``h`` whose window pages
    ``[g.window_start(h), h)`` all hold bytes (its chain has gaps: docs/protocol.md, "Chains
    with gaps"; pages before the window are vLLM's null blocks), 0 when none."""
    best = run = 0
    for h in range(1, len(tiers) + 1):
        run = run + 1 if tiers[h - 1] else 0  # pages with bytes ending at page h - 1
        if h - run <= g.window_start(h, block_size):
            best = h
    return best


class SchedulerSide:
    """The scheduler role's calls of KVConnectorBase_V1, mixed into KvtierConnector (which
    sets the shared state: settings, guard, model, root, sizes)."""

    def _init_scheduler_side(self, scheduler: bool) -> None:
        self._reqs: Dict[str, _ReqState] = {}
        self._pending_loads: Dict[str, List[_Transfer]] = {}  # one per group
        # Requests vLLM waits for (an asynchronous load) whose load was not planned: the next
        # step's metadata lists them, and each worker reports them as failed loads.
        self._unplanned_reqs: List[str] = []
        # The blocks of loads in the step that were not planned: the step's metadata lists
        # them, and each worker reports them as load errors.
        self._unplanned_blocks: List[int] = []
        # Blocks a load in the step failed into that no step has been scheduled to write again
        # since (policy "recompute": vLLM rewound one request holding each to write it, the
        # others holding it count it computed): _hand_over_failed.
        self._failed: Set[int] = set()
        self._recompute = getattr(self._kv_transfer_config, "kv_load_failure_policy",
                                  None) == "recompute"
        self._index: Optional[_PageStore] = None
        self._pause_ms = number(self._extra, "preempt_pause_ms", PREEMPT_PAUSE_MS, _WHERE)
        if not scheduler:
            return
        # Index-only (block_bytes 0) in rank 0's namespace: all ranks store the same pages.
        self._index = _PageStore(
            self._extra, self._model,
            rank_salt(0, self._tp_size // self._tp_replicas, 0, self._pp_size), 0,
            guard=self._guard, what="vllm scheduler",
            deadline_ms=number(self._extra, "scheduler_deadline_ms", SCHEDULER_DEADLINE_MS,
                               _WHERE, minimum=1))

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
        hints = None
        if st is None:
            st = self._reqs[request.request_id] = _ReqState(request)
        else:
            # Asked again: vLLM asks only for waiting requests, so this one was not scheduled
            # last time (no blocks for it) or was preempted. It waits: its lookups carry the
            # "paused" hint (expected back in preempt_pause_ms), no extra round trip.
            hints = self._paused_hints()
            if st.leases:  # a fresh answer, fresh leases
                self._release_leases(st)
        st.hit_pages = 0
        bs = self._block_size
        max_pages = max(request.num_tokens - 1, 0) // bs
        computed = num_computed_tokens // bs
        st.computed_pages = computed
        if max_pages <= computed or st.recompute:
            return 0
        keys = key_chain(request, bs, self._root, st.keys, max_pages)
        self._tally.add("lookups")
        try:
            hit = self._lookup_groups(st, keys, max_pages, computed, hints)
        except Exception:
            self._release_leases(st)
            self._tally.add("miss_pages", max_pages - computed)  # answered 0: all missed
            raise
        st.hit_pages = hit
        self._tally.add("hit_pages", max(hit - computed, 0))
        self._tally.add("miss_pages", max_pages - max(hit, computed))
        if hit <= computed:
            self._release_leases(st)
            return 0
        return hit * bs - num_computed_tokens

    def _lookup_groups(self, st: _ReqState, keys: List[bytes], max_pages: int,
                       computed: int, hints: Optional[Hints] = None) -> int:
        """The longest prefix (pages) every group holds, each group's chain looked up with a lease
        (held in ``st.leases`` until released); ``hints`` ride on each group's MATCH. A
        full-attention group holds a prefix of ``h`` pages when its first ``h`` pages hold bytes;
        a sliding-window group, which stores only its windows (_plan_saves: its chain has
        gaps), when the pages of the window of ``h`` do (_window_hit). The window of a shorter
        prefix than one group's answer is other pages, so the window groups are asked again
        for the hit the others cut it to, until all agree. A Mamba group holds a prefix of
        ``h`` pages when it holds the state at exactly ``h`` (its page ``h - 1``: state_hit),
        so it too is asked again for a shorter hit."""
        assert self._index is not None
        hit = max_pages
        windows: List[Tuple[KvGroup, bytes]] = []
        states: List[bytes] = []
        for g in self._groups:
            if hit <= computed:
                break
            if len(self._groups) == 1 and not g.gaps:
                got, lease = self._index.lookup(keys[:hit], lease=True, hints=hints)
            else:
                tiers, lease = self._index.match_tiers(self._chain(st, g.gid, hit)[:hit],
                                                       hints=hints)
                if g.retained:
                    got = _window_hit(tiers, g, self._block_size)
                    windows.append((g, tiers))
                elif g.state:
                    got = state_hit(tiers, hit)
                    states.append(tiers)
                else:
                    got = _stored(tiers)
            if lease:
                st.leases.append(lease)
            hit = min(hit, got)
        while (windows or states) and hit > computed:
            h = hit
            for g, t in windows:
                h = min(h, _window_hit(t[:h], g, self._block_size))
            for t in states:
                h = state_hit(t, h)
            if h == hit:
                break
            hit = h
        return hit

    def _chain(self, st: _ReqState, gid: int, pages: int) -> List[bytes]:
        """Group ``gid``'s keys of the request's first ``pages`` pages (the base chain
        extended first)."""
        base = key_chain(st.request, self._block_size, self._root, st.keys, pages)
        return group_chain(base, gid, st.group_keys.setdefault(gid, []), pages)

    def _own_chains(self, st: _ReqState) -> List[List[bytes]]:
        """The request's own chain in each group that has keys so far (group 0's is the base
        chain): the hints go to every one, so that no group's pages go first."""
        out = [st.keys] if st.keys else []
        for g in self._groups:
            if g.gid != 0 and st.group_keys.get(g.gid):
                out.append(st.group_keys[g.gid])
        return out

    def _release_leases(self, st: _ReqState) -> None:
        leases, st.leases = st.leases, []
        assert self._index is not None
        for lease in leases:
            self._index.release(lease)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        """Records the loads of the request's hit (_plan_loads) for the step's metadata.

        An asynchronous answer makes vLLM wait for the request (WAITING_FOR_REMOTE_KVS) until
        a worker reports it in ``finished_recving``: where its load cannot be planned (planning
        raises, or leaves a page vLLM counts as loaded unloaded: no block for a Mamba state,
        nothing in a window), it goes in the step's metadata as unplanned, and each worker
        reports it at once as a failed load (``failed_recving``: vLLM recomputes it, from its
        start) rather than never; its next lookup answers 0 (the same plan would fail again).
        A load in the step (one group, ``load_async`` off) that cannot be planned: vLLM counts
        the hit's tokens as computed and runs the request in this very step, so the hit's
        blocks go in the step's metadata as load errors (_unplanned_blocks): each worker
        reports them (get_block_ids_with_load_errors) and vLLM rewinds the request to the
        first of them and recomputes from there, never using KV nothing wrote.
        With no external tokens (vLLM took none of the hit: a request that skips cache reads,
        or a hit within its own local one) vLLM loads nothing and clears its
        ``load_kv_async``: the request does not wait, nothing is reported (vLLM asserts that a
        request reported loaded waits for its load or is finished), and the lookup's leases
        are released now rather than when the request finishes."""
        rid = request.request_id
        st = self._reqs.get(rid)
        if st is None:
            return
        if num_external_tokens <= 0:
            if st.leases:
                try:
                    self._release_leases(st)
                except Exception as e:  # noqa: BLE001 - the daemon drops them with the link
                    log.debug("kvtier: leases of %s: %s", rid, e)
            return
        try:
            loads = self._plan_loads(st, blocks, num_external_tokens)
        except Exception as e:  # noqa: BLE001 - nothing may escape into the scheduler
            self._guard.count("failures")
            self._guard.warn("kvtier: no load planned for %s, recomputing it: %s", rid, e)
            loads = []
        if loads:
            self._pending_loads[rid] = loads
            return
        st.recompute = True
        if self._async:
            self._unplanned_reqs.append(rid)
            return
        try:
            self._unplanned_blocks.extend(self._hit_blocks(st, blocks, num_external_tokens))
        except Exception as e:  # noqa: BLE001 - nothing may escape into the scheduler
            self._guard.warn("kvtier: blocks of %s not reported, it runs on KV not loaded: %s",
                             rid, e)

    def _hit_blocks(self, st: _ReqState, blocks: "KVCacheBlocks",
                    num_external_tokens: int) -> List[int]:
        """The blocks of the pages vLLM counts as loaded for the request (its computed tokens
        and ``num_external_tokens``, beyond the pages it had itself), in every group, never
        vLLM's null block (block 0: pages a sliding window no longer holds, shared by every
        request). Loads in the step come with one group only (common.load_between_steps)."""
        ids = blocks.get_block_ids()
        first = st.computed_pages
        need = -(-(first * self._block_size + num_external_tokens) // self._block_size)
        out = [b for gids in ids for b in list(gids)[first:need] if b != 0]
        if not out:
            raise ValueError("no block for pages [%d, %d)" % (first, need))
        return out

    def _plan_loads(self, st: _ReqState, blocks: "KVCacheBlocks",
                    num_external_tokens: int) -> List[_Transfer]:
        """The loads of a hit of ``st.hit_pages`` pages: in each group, pages [computed, hit)
        into the request's blocks at those positions (a sliding window's from its window's
        first block on, never into vLLM's null block; a Mamba group's state at the hit: one
        page). ValueError where a page vLLM counts as loaded (its computed tokens and
        ``num_external_tokens``) gets no load: no block for it, no Mamba state at the hit
        (vLLM took fewer tokens than the answer, or gave no block), nothing to load at all."""
        ids = blocks.get_block_ids()
        bs = self._block_size
        first, hit = st.computed_pages, st.hit_pages
        end = first * bs + num_external_tokens  # the tokens vLLM counts as computed
        need = min(hit, -(-end // bs))  # the pages holding them
        loads = []
        for g in self._groups:
            gids = list(ids[g.gid]) if g.gid < len(ids) else []
            if g.state:  # the state at the hit's boundary, one page
                t = state_load(st.request.request_id, self._chain(st, g.gid, hit), gids, hit,
                               self._async, g.gid)
                if t is None or end != hit * bs:
                    raise ValueError("no Mamba state for %d tokens (group %d)" % (end, g.gid))
                loads.append(t)
                continue
            a = max(first, g.window_start(hit, bs))
            last = min(hit, len(gids))
            if last < need:
                raise ValueError("%d blocks for the %d pages loaded (group %d)"
                                 % (len(gids), need, g.gid))
            if g.retained:  # never into vLLM's null block (pages outside the window)
                while a < last and gids[a] == 0:
                    a += 1
            if last > a:
                loads.append(_Transfer(st.request.request_id,
                                       list(self._chain(st, g.gid, last)[:last]), a,
                                       gids[a:last], self._async, g.gid))
        if not loads:
            raise ValueError("nothing to load")
        return loads

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        """This step's loads (planned by update_state_after_alloc) and saves (each request's
        full pages whose KV this step completes and kvtierd did not hold)."""
        meta = KvtierConnectorMetadata(loads=[t for ts in self._pending_loads.values()
                                              for t in ts], unplanned=self._unplanned_reqs,
                                       load_errors=self._unplanned_blocks)
        self._pending_loads.clear()
        self._unplanned_reqs = []
        self._unplanned_blocks = []
        try:
            self._plan_saves(scheduler_output, meta)
            self._mark_reads(meta)
        except Exception as e:  # noqa: BLE001
            self._guard.warn("kvtier: saves of this step not planned: %s", e)
        if self._failed:
            try:
                self._forget_written(scheduler_output)
            except Exception as e:  # noqa: BLE001 - nothing may escape into the scheduler
                self._guard.warn("kvtier: failed blocks not followed: %s", e)
        return meta

    def _forget_written(self, so: "SchedulerOutput") -> None:
        """Drops from ``_failed`` the blocks this step writes: those of the pages each
        scheduled request completes in it, from its first page not computed (a request
        rewound to a failed block starts there) to the last its step fills. (A request
        finishing after this step was scheduled counts them computed already: vLLM advances
        its computed tokens when it schedules it. This keeps ``_failed`` to blocks still
        unwritten, not ids vLLM has since given to other requests.)"""
        assert self._kv_cache_manager is not None
        bs = self._block_size
        cr = so.scheduled_cached_reqs
        steps = [(nr.req_id, nr.num_computed_tokens) for nr in so.scheduled_new_reqs]
        steps += list(zip(cr.req_ids, cr.num_computed_tokens))
        for rid, computed in steps:
            end = computed + so.num_scheduled_tokens.get(rid, 0)
            for ids in self._kv_cache_manager.get_block_ids(rid):
                self._failed.difference_update(ids[computed // bs:end // bs])

    def _mark_reads(self, meta: KvtierConnectorMetadata) -> None:
        """Each save's ``reads``: the blocks this step loads in the step (or reports as
        load errors) among the request's blocks up to its last page. Its pages are computed
        on them in this very step (or are them: a request whose own lookup found less than
        the blocks it took), its own hit's or another request's that it took from vLLM's
        prefix cache (vLLM caches a hit's blocks when it allocates them, before the load): a
        worker whose load of one of them fails stores none of those pages (garbage KV), and
        vLLM recomputes them (_handle_invalid_blocks rewinds every running request holding a
        failed block)."""
        loaded = {b for t in meta.loads if not t.async_load for b in t.block_ids}
        loaded.update(meta.load_errors)
        if not loaded:
            return
        for t in meta.saves:
            st = self._reqs.get(t.req_id)
            if st is not None:
                ids = st.block_ids.get(t.group, ())[:t.first + len(t.block_ids)]
                t.reads = [b for b in ids if b in loaded]

    def _plan_saves(self, so: "SchedulerOutput", meta: KvtierConnectorMetadata) -> None:
        bs = self._block_size
        steps: List[Tuple[str, Optional[Tuple[List[int], ...]], int]] = []
        # Preempted first: vLLM lists a request preempted since the last step here, and a
        # request it resumes among the new ones, both in the same output when it resumes at
        # once (reset_prefix_cache preempts between steps and the next step resumes). Taken
        # after the new ones, a resumed request was marked preempted for good: never saved
        # again.
        for rid in so.preempted_req_ids or ():
            meta.preempted.append(rid)  # the workers cancel its saves not yet copied out
            st = self._reqs.get(rid)
            if st is not None:  # its blocks are gone: nothing saved until it is listed afresh
                st.no_save = True
                st.block_ids = {}
                self._paused(st)
        for nr in so.scheduled_new_reqs:
            st = self._reqs.get(nr.req_id)
            if st is not None:
                # New, or resumed after a preemption (vLLM sends it in full again, with the
                # blocks it now has, after asking get_num_new_matched_tokens afresh): saved
                # from the pages kvtierd held at that lookup on.
                st.block_ids = {}
                st.saved_pages = max(st.hit_pages, 0)
                st.no_save = False
            steps.append((nr.req_id, tuple(nr.block_ids or ()), nr.num_computed_tokens))
        cr = so.scheduled_cached_reqs
        for i, rid in enumerate(cr.req_ids):
            computed = cr.num_computed_tokens[i]
            st = self._reqs.get(rid)
            if st is not None and computed // bs < st.saved_pages:
                # vLLM rewound it (load errors: _handle_invalid_blocks), its pages from there
                # computed again: saved again, those a failed step computed having been
                # dropped (a page kvtierd holds already is left alone).
                st.saved_pages = computed // bs
            steps.append((rid, tuple(cr.new_block_ids[i] or ()), computed))
        for rid, new_ids, computed in steps:
            st = self._reqs.get(rid)
            if st is None or st.no_save:
                continue
            for g in self._groups:
                if g.gid < len(new_ids) and new_ids[g.gid]:
                    st.block_ids.setdefault(g.gid, []).extend(new_ids[g.gid])
            done = computed + so.num_scheduled_tokens.get(rid, 0)
            pages = min(done, st.request.num_tokens) // bs
            for g in self._groups:
                pages = min(pages, len(st.block_ids.get(g.gid, ())))
            if pages <= st.saved_pages:
                continue
            for g in self._groups:
                if g.state:  # the state where the step ends, if that is a page boundary
                    t = state_save(rid, self._chain(st, g.gid, pages),
                                   st.block_ids.get(g.gid, []), min(done, st.request.num_tokens),
                                   bs, st.saved_pages, g.gid)
                    if t is not None:
                        meta.saves.append(t)
                        st.saving = True
                    continue
                # A sliding-window group stores only the pages its window keeps: those a hit
                # of these pages loads, or of one page less (a prompt ending on a page boundary
                # is hit one page short, vLLM computing its last token), stored after a gap
                # (docs/protocol.md, "Chains with gaps"). Pages saved complete within this step,
                # and vLLM frees a window's blocks only in a later step; a null block (none
                # expected) ends the group's save.
                first = st.saved_pages
                if g.retained:
                    first = max(first, g.window_start(pages - 1, bs))
                ids = st.block_ids[g.gid][first:pages]
                if g.retained and 0 in ids:
                    ids = ids[:ids.index(0)]
                if ids:
                    end = first + len(ids)
                    meta.saves.append(_Transfer(rid, list(self._chain(st, g.gid, end)[:end]),
                                                first, ids, group=g.gid))
                    # request_finished holds its blocks until the workers report it (they
                    # track every request among a step's saves, whichever group).
                    st.saving = True
            st.saved_pages = pages

    def _paused_hints(self) -> Hints:
        return Hints(paused=True,  # resume_ms is a u32 on the wire
                     resume_ms=min(int(self._pause_ms), 0xFFFFFFFF))

    def _paused(self, st: _ReqState) -> None:
        """A preempted request waits for blocks: its chain gets the policy's "paused" hint,
        expected back in preempt_pause_ms (vLLM gives no figure), so that its pages outlive
        colder ones until it resumes and loads them. Bounded by scheduler_deadline_ms."""
        if self._index is None or not st.keys or not self._index.up:
            return
        try:
            for chain in self._own_chains(st):
                self._index.hint(chain, self._paused_hints())
        except Exception as e:  # noqa: BLE001 - a lost hint costs retention quality only
            self._guard.count("failures")
            self._guard.warn("kvtier: paused hint for %s not sent: %s",
                             st.request.request_id, e)

    def update_connector_output(self, connector_output: Any) -> None:
        """The workers' output of a step, after vLLM took it: blocks whose load in the step
        failed (``invalid_block_ids``) leave vLLM's prefix cache (_evict_failed)."""
        bad = set(getattr(connector_output, "invalid_block_ids", None) or ())
        if bad and self._kv_cache_manager is not None:
            if self._recompute:
                self._failed |= bad
            try:
                self._evict_failed(bad)
            except Exception as e:  # noqa: BLE001 - nothing may escape into the scheduler
                self._guard.warn("kvtier: failed blocks left in vLLM's prefix cache: %s", e)

    def _evict_failed(self, bad: Set[int]) -> None:
        """Takes the blocks ``bad`` (a load in the step failed into them) out of vLLM's prefix
        cache, and with them every block after the first of them in each request holding one
        (computed on them, or loaded after them). vLLM caches a hit's blocks when it allocates
        them, and with "recompute" keeps them cached after the failure (its
        _handle_invalid_blocks evicts only with "fail"), counting on the requests it rewound to
        write them again the next step: were they all aborted first, a later request of that
        prefix would take them from its prefix cache as computed, KV nothing wrote. Evicted,
        the blocks stay with the requests holding them (vLLM's KVCacheManager.evict_blocks
        drops only their hashes); the price is that a request arriving before they are
        written again computes that prefix itself. Loads in the step come with one KV cache
        group only (common.load_between_steps): a block id names one block."""
        assert self._kv_cache_manager is not None
        drop = set(bad)
        for rid in self._reqs:
            for ids in self._kv_cache_manager.get_block_ids(rid):
                at = next((i for i, b in enumerate(ids) if b in bad), None)
                if at is not None:
                    drop.update(ids[at:])
        drop.discard(0)  # vLLM's null block is never cached
        self._kv_cache_manager.evict_blocks(drop)

    def _hand_over_failed(self, request: "Request") -> None:
        """``request`` finishes. Of the failed blocks it was rewound to write again (at or
        after its computed tokens, not written since: ``_failed``), those another request
        still holds go in the next step's metadata as load errors: vLLM 0.34 rewinds only the
        first request holding a failed block to write it, the others counting it computed
        (_update_requests_with_invalid_blocks' marked_invalid_block_ids), so that once that
        request is gone no one would write it, and they would compute on KV nothing wrote,
        their pages stored as good. Reported, vLLM rewinds them, and the workers drop the
        saves of that step computed on those blocks (their ``reads``)."""
        assert self._kv_cache_manager is not None
        first = request.num_computed_tokens // self._block_size
        mine = {b for ids in self._kv_cache_manager.get_block_ids(request.request_id)
                for b in ids[first:] if b in self._failed}
        if not mine:
            return
        self._failed -= mine  # its blocks go back to vLLM's pool
        held = {b for rid in self._reqs for ids in self._kv_cache_manager.get_block_ids(rid)
                for b in ids if b in mine}
        self._unplanned_blocks.extend(sorted(held))

    def request_finished(self, request: "Request",
                         block_ids: List[int]) -> Tuple[bool, Optional[Dict[str, Any]]]:
        """Finished or aborted: releases the request's leases and sends the policy's "finished" hint
        for its own chain in each group (a MATCH that counts as a use: the daemon ignores a probe's
        hints). Returns True (vLLM holds the blocks) when a save was planned for the request: the
        workers copy saved blocks out after the step (asynchronous saves, worker.py) and report the
        request in get_finished's finished_sending once its saves are stored, or dropped at their
        deadline; else False (freed at once)."""
        st = self._reqs.pop(request.request_id, None)
        if self._failed:
            try:
                self._hand_over_failed(request)
            except Exception as e:  # noqa: BLE001 - nothing may escape into the scheduler
                self._guard.warn("kvtier: failed blocks of %s not handed over: %s",
                                 request.request_id, e)
        # A load planned but not sent yet (vLLM's deferred loads start it a step late): vLLM
        # holds the blocks of a request finished while it waits for its load until a worker
        # reports it, so it goes out unplanned (reported at once, nothing loaded), not dropped.
        if self._pending_loads.pop(request.request_id, None) and self._async:
            self._unplanned_reqs.append(request.request_id)
        if st is None:
            return False, None
        if self._index is not None:
            try:
                self._release_leases(st)
                if self._index.up:
                    for chain in self._own_chains(st):
                        self._index.hint(chain, Hints(finished=True))
            except Exception as e:  # noqa: BLE001
                log.debug("kvtier: finish of %s: %s", request.request_id, e)
        return st.saving, None

    def request_finished_all_groups(self, request: "Request", block_ids: Tuple[List[int], ...]
                                    ) -> Tuple[bool, Optional[Dict[str, Any]]]:
        """vLLM's SupportsHMA call (the hybrid KV cache manager on): request_finished, with
        every group's blocks; the same answer for all of them."""
        return self.request_finished(request, list(block_ids[0]) if block_ids else [])

    def _close_scheduler_side(self) -> None:
        """Closes the index's connection (the daemon drops its leases)."""
        if self._index is not None:
            self._index.close()
            for st in self._reqs.values():
                st.leases = []
            self._reqs.clear()
