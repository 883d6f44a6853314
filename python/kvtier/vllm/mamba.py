"""kvtier.vllm.mamba: a Mamba (SSM, GDN) group of vLLM's hybrid KV cache manager. Its block
holds a request's recurrent state after a number of tokens, not the KV of a page of tokens:
with vLLM's ``mamba_cache_mode`` "align", the state after ``p`` whole pages lies in the
request's Mamba block ``p - 1``, written by the step whose computed tokens end there (vLLM
ends prefill chunks on page boundaries for it). kvtier stores that block as page ``p - 1`` of
the group's own key chain (a chain with gaps: only the boundaries a step ended on), and a hit
of ``h`` pages needs the state at exactly ``h``: the one page loaded (docs/engines.md, "Hybrid
models"). The connector, the scheduler and the worker call the functions here; the worker
treats the group as a sliding-window one (saves read before the next step, chains with gaps),
but saves it at wait_for_save. common.py, which this module imports, marks the group
(KvGroup.state) without importing it."""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

from .common import KvGroup, _Transfer, _WHERE


def refuse_unstorable(kv_cache_config: Any, groups: List[KvGroup], block_size: int) -> None:
    """Raises ValueError naming a Mamba group of ``groups`` (common.kv_groups's, from vLLM's
    ``kv_cache_config``) whose state the connector cannot store: a ``mamba_cache_mode`` other
    than "align" (vLLM's prefix caching off: vLLM then keeps one running state per request, at
    no page boundary), speculative blocks or prefill checkpoint blocks (vLLM moves a state
    into other blocks than its boundary's), or blocks of another size than the other
    groups'."""
    for g in groups:
        if not g.state:
            continue
        spec = kv_cache_config.kv_cache_groups[g.gid].kv_cache_spec
        mode = getattr(spec, "mamba_cache_mode", "none")
        why = None
        if mode != "align":
            why = "mamba_cache_mode %r: kvtier stores the state at page boundaries, which " \
                  "vLLM keeps in mode 'align' only, that is with prefix caching on " \
                  "(--enable-prefix-caching)" % mode
        elif int(getattr(spec, "num_speculative_blocks", 0) or 0):
            why = "speculative decoding's state blocks (num_speculative_blocks %d) are not " \
                  "supported" % spec.num_speculative_blocks
        elif int(getattr(spec, "num_prefill_checkpoint_blocks", 0) or 0):
            why = "prefill checkpoint blocks (num_prefill_checkpoint_blocks %d) are not " \
                  "supported" % spec.num_prefill_checkpoint_blocks
        if why is not None:
            raise ValueError("kvtier.vllm: KV cache group %d (MambaSpec, layers %s): %s"
                             % (g.gid, ", ".join(list(g.layers or ())[:4]), why))
        if int(spec.block_size) != block_size:
            raise ValueError("%s: setting 'block_size': %d tokens, but KV cache group %d has "
                             "blocks of %d tokens" % (_WHERE, block_size, g.gid,
                                                      spec.block_size))


def state_hit(tiers: Sequence[int], limit: int) -> int:
    """The longest prefix (pages, at most ``limit``) whose state the group's chain holds: the
    largest ``h`` whose page ``h - 1`` holds bytes (``tiers`` not 0), 0 when none."""
    for h in range(min(limit, len(tiers)), 0, -1):
        if tiers[h - 1]:
            return h
    return 0


def state_load(rid: str, chain: List[bytes], block_ids: List[int], hit: int,
               async_load: bool, gid: int) -> Optional[_Transfer]:
    """The load of a hit of ``hit`` pages in a Mamba group: page ``hit - 1`` of its ``chain``
    (the state after those pages) into the request's block ``hit - 1``, which vLLM gives a
    request with ``hit`` pages of external tokens (the blocks before it are its null block).
    ValueError where that block is the null block: the state has nowhere to go."""
    if hit <= 0:
        return None
    if hit > len(block_ids) or block_ids[hit - 1] == 0:
        raise ValueError("no block for the Mamba state at page %d (group %d)" % (hit, gid))
    return _Transfer(rid, list(chain[:hit]), hit - 1, [block_ids[hit - 1]], async_load, gid)


def state_save(rid: str, chain: List[bytes], block_ids: List[int], done: int,
               block_size: int, saved: int, gid: int) -> Optional[_Transfer]:
    """The save of a step whose computed tokens end at ``done``: where that is a page
    boundary ``p`` beyond the pages kvtierd holds already (``saved``), the state after ``p``
    pages, which lies in the request's block ``p - 1`` once the step's forward is done, as
    page ``p - 1`` of the chain (stored after a gap). None otherwise: a step ending inside a
    page leaves no state at a boundary."""
    if done <= 0 or done % block_size:
        return None
    p = done // block_size
    if p <= saved or p > min(len(block_ids), len(chain)) or block_ids[p - 1] == 0:
        return None
    return _Transfer(rid, list(chain[:p]), p - 1, [block_ids[p - 1]], group=gid)
