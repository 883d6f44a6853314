"""test_vllm_keep.py: kvtier.vllm's worker names the tokens its load's MATCH kept (MATCH KEEP,
docs/protocol.md "Handles") in the PUT of the pages it computed after them, so that the PUT
sends only the new pages' tokens; and when the daemon no longer holds the handle, the PUT goes
again with all of them. The same for the mapped set-up (the Unix socket, vLLM's default), whose
saves are RESERVEs. Through vLLM's own connector classes, a real kvtierd, and a relay (loopback
TCP, or a Unix socket that passes the mapping's descriptor on) that reads the frames the worker
sends (the only place a PUT's or RESERVE's token count shows).
"""

from __future__ import annotations

import signal
import time
from typing import Any, List

import pytest
import torch

from conftest import Daemon
from relay import Relay, UnixRelay

# test_vllm skips this module too where vLLM is not importable.
from test_vllm import (BS, Engine, blocks, finish, load_between_steps, pages_of, prompt,
                       request, run_step, save_prompt, schedule)

MATCH_F_KEEP = 1 << 4
PUT_F_HANDLE = 1
KEY_TOKENS = 8  # api "tokens": a page's key is sent as 8 token ids


def through(d: Daemon, relay: Relay, seed: Any, **extra: Any) -> Engine:
    """An engine on the token calls, whose connections go through the relay."""
    return Engine(d, seed=seed, api="tokens", unix_path=None, tcp=relay.addr, **extra)


def partial_hit_step(b: Engine, toks: List[int], ids: List[int], hit: int,
                     before_save: Any = None) -> Any:
    """A request whose first ``hit`` pages kvtierd holds: the step loads them and computes
    (and saves) the rest. ``before_save`` runs between the loads and the saves."""
    r = request(toks)
    n, meta = schedule(b.sched, r, ids)
    assert n == hit * BS
    assert [(t.first, len(t.keys)) for t in meta.saves] == [(hit, len(ids) - 1)]
    b.worker.bind_connector_metadata(meta)
    b.worker.start_load_kv(None)
    for name in b.kv:
        b.worker.wait_for_layer_load(name)
    if before_save is not None:
        before_save()
    for name, t in b.kv.items():
        b.worker.save_kv_layer(name, t, None)
    b.worker.wait_for_save()
    assert b.worker.get_block_ids_with_load_errors() == set()
    b.worker.clear_connector_metadata()
    assert finish(b, r, ids)
    return r


def loads_back(d: Daemon, toks: List[int], b: Engine, ids: List[int], api: str = "tokens"
               ) -> None:
    """A fresh engine (on the Unix socket) loads every page of ``toks`` byte for byte as
    ``b`` holds them in blocks ``ids``."""
    c = Engine(d, seed=None, api=api)
    try:
        r = request(toks)
        mine = [24 + i for i in range(len(ids))]  # of NBLOCKS (32)
        n, meta = schedule(c.sched, r, mine)
        assert n == (len(ids) - 1) * BS
        assert run_step(c.worker, c.kv, meta) == set()
        for x, y in zip(pages_of(b.kv, ids[:-1]), pages_of(c.kv, mine[:-1])):
            assert torch.equal(x.view(torch.int16), y.view(torch.int16))
        c.sched.request_finished(r, mine)
    finally:
        c.close()


# api "tokens" (a page's key sent as 8 token ids): the PUT names the load's MATCH. api "keys"
# without the mapping (TCP, 4 synthetic tokens a key): the load's get_keys_kept_into keeps the
# keys it read, and the save's put_keys names them (kvt_keys_chain_put_kept).
@pytest.mark.parametrize("api,key_tokens", [("tokens", KEY_TOKENS), ("keys", 4)])
def test_save_after_load_sends_only_the_new_pages_tokens(api: str, key_tokens: int) -> None:
    d = Daemon()
    relay = Relay(d.tcp)
    try:
        a = Engine(d, seed=1, api=api)
        b = Engine(d, seed=2, api=api, unix_path=None, tcp=relay.addr)
        toks = prompt(5)  # 5 whole pages and 5 tokens
        save_prompt(a, request(toks[:3 * BS + 1]), [4, 9, 2, 7])  # its first 3 pages
        ids = [11, 3, 30, 5, 20, 21]
        relay.matches.clear()
        partial_hit_step(b, toks, ids, hit=3)
        # The scheduler's lookup keeps nothing (no PUT follows it on its connection); the
        # worker's load does.
        assert [f & MATCH_F_KEEP for f in relay.matches].count(MATCH_F_KEEP) == 1, relay.matches
        # One PUT, of pages 3 and 4: it names the load's MATCH (pages 0-2 kept) and carries
        # only the tokens of pages 3 and 4.
        assert len(relay.puts) == 1, relay.puts
        flags, ntokens, first, npayload, handle = relay.puts[0]
        assert flags & PUT_F_HANDLE and handle != 0
        assert (ntokens, first, npayload) == (2 * key_tokens, 3, 2)
        loads_back(d, toks, b, ids, api=api)
        a.close()
        b.close()
    finally:
        relay.close()
        d.stop(signal.SIGKILL)


def test_save_after_an_expired_keep_sends_all_tokens() -> None:
    # The daemon's default lease time (the load's MATCH asks for no other) is 150 ms: the
    # handle is gone when the save comes 400 ms later.
    d = Daemon("--lease-ms", "150")
    relay = Relay(d.tcp)
    try:
        a, b = Engine(d, seed=1, api="tokens"), through(d, relay, seed=2)
        toks = prompt(5)
        save_prompt(a, request(toks[:3 * BS + 1]), [4, 9, 2, 7])
        ids = [11, 3, 30, 5, 20, 21]
        partial_hit_step(b, toks, ids, hit=3, before_save=lambda: time.sleep(0.4))
        # The PUT naming the handle is answered ENOENT and changes nothing; libkvtier sends it
        # again with the tokens of all 5 pages, which stores pages 3 and 4.
        assert [(f & PUT_F_HANDLE, n, first, np) for f, n, first, np, _ in relay.puts] == [
            (PUT_F_HANDLE, 2 * KEY_TOKENS, 3, 2), (0, 5 * KEY_TOKENS, 3, 2)], relay.puts
        loads_back(d, toks, b, ids)
        with d.client() as c:
            assert c.stats()["leases"] == 0
        a.close()
        b.close()
    finally:
        relay.close()
        d.stop(signal.SIGKILL)


def test_asynchronous_loads_keep_nothing() -> None:
    # load_async: the loads between steps have a connection of their own, which never PUTs:
    # their MATCH keeps no tokens (the daemon would hold them for nothing).
    d = Daemon()
    relay = Relay(d.tcp)
    try:
        a = Engine(d, seed=1, api="tokens")
        b = through(d, relay, seed=None, load_async=True)
        toks = prompt(3)
        save_prompt(a, request(toks), [4, 9, 2, 7])
        r = request(toks)
        assert b.sched.get_num_new_matched_tokens(r, 0) == (3 * BS, True)
        b.sched.update_state_after_alloc(r, blocks([11, 3, 30, 5]), 3 * BS)
        relay.matches.clear()
        assert load_between_steps(b, r) == set()
        assert relay.matches and not any(f & MATCH_F_KEEP for f in relay.matches), relay.matches
        for x, y in zip(pages_of(a.kv, [4, 9, 2]), pages_of(b.kv, [11, 3, 30])):
            assert torch.equal(x.view(torch.int16), y.view(torch.int16))
        b.sched.request_finished(r, [11, 3, 30, 5])
        a.close()
        b.close()
    finally:
        relay.close()
        d.stop(signal.SIGKILL)


# The mapped set-up is the keyed calls' (api "keys", the default) on the Unix socket: its
# client is a token client of the keyed namespace, a page's key sent as 4 synthetic token ids
# (kvt_key_tokens). With api "tokens" the worker maps nothing (its saves are PUTs, above).
MAPPED_PAGE_TOKENS = 4


def test_mapped_save_after_load_reserves_only_the_new_pages_tokens() -> None:
    # vLLM's default set-up: the Unix socket and the daemon's arena mapped, where a save is a
    # RESERVE, the pages written in the mapping, and a COMMIT.
    d = Daemon()
    relay = UnixRelay(d.unix)
    try:
        a = Engine(d, seed=1)
        b = Engine(d, seed=2, unix_path=relay.addr)
        toks = prompt(5)
        save_prompt(a, request(toks[:3 * BS + 1]), [4, 9, 2, 7])
        ids = [11, 3, 30, 5, 20, 21]
        relay.matches.clear()
        partial_hit_step(b, toks, ids, hit=3)
        assert b.worker._store.mapped, "the worker did not map the arena"
        # The load's MATCH keeps its tokens; the save's RESERVE (of pages 3 and 4) names them
        # and carries only the tokens of pages 3 and 4; nothing goes by a PUT.
        assert any(f & MATCH_F_KEEP for f in relay.matches), relay.matches
        assert len(relay.reserves) == 1 and not relay.puts, (relay.reserves, relay.puts)
        flags, ntokens, first, npages, handle = relay.reserves[0]
        assert flags & PUT_F_HANDLE and handle != 0
        assert (ntokens, first, npages) == (2 * MAPPED_PAGE_TOKENS, 3, 2)
        loads_back(d, toks, b, ids, api="keys")
        a.close()
        b.close()
    finally:
        relay.close()
        d.stop(signal.SIGKILL)


def test_mapped_save_after_an_expired_keep_reserves_all_tokens() -> None:
    d = Daemon("--lease-ms", "150")
    relay = UnixRelay(d.unix)
    try:
        a = Engine(d, seed=1)
        b = Engine(d, seed=2, unix_path=relay.addr)
        toks = prompt(5)
        save_prompt(a, request(toks[:3 * BS + 1]), [4, 9, 2, 7])
        ids = [11, 3, 30, 5, 20, 21]
        partial_hit_step(b, toks, ids, hit=3, before_save=lambda: time.sleep(0.4))
        assert b.worker._store.mapped, "the worker did not map the arena"
        # The RESERVE naming the handle is answered ENOENT and changes nothing; libkvtier sends
        # it again with the tokens of all 5 pages, which reserves pages 3 and 4.
        per = MAPPED_PAGE_TOKENS
        assert [(f & PUT_F_HANDLE, n, first, np) for f, n, first, np, _ in relay.reserves] == [
            (PUT_F_HANDLE, 2 * per, 3, 2), (0, 5 * per, 3, 2)], relay.reserves
        loads_back(d, toks, b, ids, api="keys")
        with d.client() as c:
            assert c.stats()["leases"] == 0
        a.close()
        b.close()
    finally:
        relay.close()
        d.stop(signal.SIGKILL)
