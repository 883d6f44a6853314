"""test_hints.py: engine hints as explicit calls (kvtier/hints.py: Client.session_paused,
request_finished, prioritize) against a real kvtierd: they reach the daemon (it validates
them), and its cost policy keeps or drops the hinted pages under pressure as docs/policy.md
says. The daemon counts the hints it receives by kind (kvtier_hints_total; STATS hints_paused,
hints_finished, hints_priority): each call moves its own counter."""

from __future__ import annotations

import math
from typing import Iterator, List, Tuple

import pytest

from conftest import Daemon, payload, tokens

import kvtier

N = 8  # pages per session


@pytest.fixture
def small() -> Iterator[Daemon]:
    """A daemon whose DRAM holds 256 blocks and that has no NVMe tier: pages it evicts are
    gone (their tier 0), which a probe MATCH shows without counting as a use. Its watermarks
    at 1: a page goes only when a store needs its room, so the first session to lose one is the
    policy's first victim (at the default marks a round frees the tier down to 90 %, more than
    both sessions hold: unhinted the two oldest, they went in one round)."""
    d = Daemon("--dram-bytes", "1M", "--nvme-bytes", "0", "--policy", "cost", "--policy-high", "1",
               "--policy-low", "1")
    yield d
    assert d.stop() == 0


def held(c: kvtier.Client, t: List[int]) -> int:
    return sum(1 for x in c.match(t, probe=True).tiers if x != 0)


def pressure(c: kvtier.Client, a: List[int], b: List[int]) -> Tuple[int, int]:
    """Stores new sessions until the daemon evicts a page of a or b; returns how many pages of
    each it still holds then."""
    for i in range(400):
        c.put(tokens(N), payload(N, 100 + i))
        ha, hb = held(c, a), held(c, b)
        if ha < N or hb < N:
            return ha, hb
    pytest.fail("400 sessions of pressure evicted neither session")


def two_sessions(c: kvtier.Client) -> Tuple[List[int], List[int]]:
    a, b = tokens(N), tokens(N)
    c.put(a, payload(N, 1))
    c.put(b, payload(N, 2))
    assert held(c, a) == N and held(c, b) == N
    return a, b


def test_hints_reach_the_daemon(client: kvtier.Client) -> None:
    t = tokens(2)
    client.put(t, payload(2, 3))
    assert client.session_paused(t, 1.5, priority=10, engine_request_id=77) == 2
    assert client.request_finished(t, engine_request_id=77) == 2
    assert client.prioritize(t, 250) == 2
    assert client.session_paused(tokens(2), 1.0) == 0  # nothing cached there
    # The daemon checks the hint block: contradictory flags are its EPROTO, and the
    # connection stays usable.
    with pytest.raises(kvtier.ProtocolError):
        client.match(t, hints=kvtier.Hints(paused=True, finished=True))
    assert client.match(t).pages == 2


HINT_STATS = ("hints_paused", "hints_finished", "hints_priority")


def hint_counts(c: kvtier.Client) -> Tuple[int, ...]:
    st = c.stats()
    return tuple(st[k] for k in HINT_STATS)


def test_each_hint_call_moves_its_counter(client: kvtier.Client) -> None:
    """An operator reads from these counters whether an engine's connector sends hints: each
    call counts once under its own kind, and a MATCH without hints under none."""
    t = tokens(2)
    client.put(t, payload(2, 4))
    before = hint_counts(client)
    client.match(t)
    assert hint_counts(client) == before
    steps = [
        (lambda: client.session_paused(t, 1.0), (1, 0, 0)),
        (lambda: client.request_finished(t), (0, 1, 0)),
        (lambda: client.prioritize(t, 50), (0, 0, 1)),
        (lambda: client.session_paused(t, 1.0, priority=10), (1, 0, 1)),
    ]
    for call, moved in steps:
        was = hint_counts(client)
        call()
        now = hint_counts(client)
        assert tuple(b - a for a, b in zip(was, now)) == moved, (HINT_STATS, was, now)


def test_bad_arguments(client: kvtier.Client) -> None:
    t = tokens(1)
    for bad in (-1.0, math.nan):
        with pytest.raises(kvtier.InvalidArgument):
            client.session_paused(t, bad)
    with pytest.raises(kvtier.InvalidArgument):
        client.prioritize(t, 70000)
    with pytest.raises(kvtier.InvalidArgument):
        client.request_finished()  # neither tokens nor keys
    with pytest.raises(kvtier.InvalidArgument):
        client.request_finished(t, keys=[b"k"])  # both


def test_control_without_hints_the_older_goes_first(small: Daemon) -> None:
    """The tests below flip this outcome with a hint: unhinted, the session used earlier (a)
    is evicted before the one used later (b)."""
    with small.client() as c:
        a, b = two_sessions(c)
        c.match(a)
        c.match(b)
        ha, hb = pressure(c, a, b)
        assert ha < N and hb == N


def test_paused_session_outlives_an_unhinted_one(small: Daemon) -> None:
    """Session a is the older (without hints it goes first: the control above); paused for
    a tool call, it is kept while the unhinted session b is evicted."""
    with small.client() as c:
        a, b = two_sessions(c)
        c.session_paused(a, 2.0)
        c.match(b)
        ha, hb = pressure(c, a, b)
        assert ha == N and hb < N


def test_finished_session_goes_first(small: Daemon) -> None:
    """Session b is the newer (kept longer without hints); finished, it goes first."""
    with small.client() as c:
        a, b = two_sessions(c)
        c.match(a)
        c.request_finished(b)
        ha, hb = pressure(c, a, b)
        assert ha == N and hb < N


def test_priority_keeps_a_session(small: Daemon) -> None:
    with small.client() as c:
        a, b = two_sessions(c)
        c.prioritize(a, 300)
        c.match(b)
        ha, hb = pressure(c, a, b)
        assert ha == N and hb < N


def test_keyed_pages(client: kvtier.Client) -> None:
    chain = [b"hint-chain-%d" % i for i in range(3)]
    blocks = bytearray(payload(3, 5))
    client.put_keys(chain, blocks)
    assert client.session_paused(keys=chain, expected_pause_s=1.0) == 3
    assert client.request_finished(keys=chain[:2]) == 2
    each = [b"hint-each-%d" % i for i in range(4)]
    client.put_keys_each(each[:3], [bytes(payload(1, i)) for i in range(3)])
    assert client.session_paused(keys=each, expected_pause_s=1.0, independent=True) == 3
    assert client.prioritize(keys=each[:1], priority=200, independent=True) == 1


def test_async_forms(daemon: Daemon) -> None:
    import asyncio

    t = tokens(2)

    async def main() -> None:
        async with kvtier.AsyncClient("pytest", page_size=16, block_bytes=4096,
                                      unix_path=daemon.unix) as c:
            await c.put(t, payload(2, 9))
            assert await c.session_paused(t, 1.0, engine_request_id=5) == 2
            assert await c.prioritize(t, 120) == 2
            assert await c.request_finished(t) == 2

    asyncio.run(main())
