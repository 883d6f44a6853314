"""test_keys_keep.py: the keyed chain calls send a chain's tokens once (MATCH KEEP,
docs/protocol.md "Handles" and "Keyed blocks"): exists_keys_kept / get_keys_kept_into keep the
keys' tokens on the daemon, and put_keys(..., after=) names them, so that the PUT carries only
the tokens of the keys past them; what it stores is what a PUT of every key's tokens stores; a
handle the daemon no longer holds (replaced by newer ones) makes the PUT go again with all of
them. Against a real kvtierd, through a loopback TCP relay that reads the frames the client
sends (the only place a PUT's token count shows), and on the Unix socket with the zero-copy
mapping (where the PUT is a RESERVE and COMMIT)."""

from __future__ import annotations

from typing import List

import pytest
from conftest import BLOCK, PAGE, Daemon, payload
from relay import Relay

import kvtier

MATCH_F_KEEP = 1 << 4
PUT_F_HANDLE = 1
KT = kvtier.KEY_TOKENS

_n = [0]


def chain(n: int) -> List[bytes]:
    """n keys of a chain no other test uses."""
    _n[0] += 1
    return [b"keep-%d-%d" % (_n[0], i) for i in range(n)]


@pytest.fixture(scope="module")
def sd():
    d = Daemon()
    yield d
    assert d.stop() == 0


@pytest.fixture
def relayed(sd):
    """A keyed client on the socket (no mapping) through a relay, and the relay."""
    relay = Relay(sd.tcp)
    c = kvtier.Client("pytest", tcp=relay.addr, page_size=PAGE, block_bytes=BLOCK)
    yield c, relay
    c.close()
    relay.close()


def test_put_after_a_kept_read_sends_only_the_new_keys(sd, relayed):
    c, relay = relayed
    keys = chain(6)
    data = payload(6, 11)
    c.put_keys(keys[:2], data[:2 * BLOCK])  # the cached part
    buf = bytearray(6 * BLOCK)
    kk = c.get_keys_kept_into(keys, buf)  # the engine's load: 2 keys hit
    assert kk.hits == 2 and bytes(buf[:2 * BLOCK]) == data[:2 * BLOCK]
    assert kk.handle != 0 and kk.keys == 6, "the read's MATCH named (and kept) all 6 keys"
    assert relay.matches[-1] & MATCH_F_KEEP
    before = len(relay.puts)
    # The engine computed keys 2..5: the PUT names the kept chain and sends no token.
    r = c.put_keys(keys, data[2 * BLOCK:], 2, after=kk)
    assert (r.pages, r.new_pages, r.stored, r.skipped) == (6, 4, 4, 0)
    assert relay.puts[before:] == [(PUT_F_HANDLE, 0, 2, 4, kk.handle)]
    # The index is what a PUT of every key's tokens makes: any client finds the whole chain,
    # byte-exact, and a PUT of all of them again adds nothing.
    with sd.client() as other:
        assert other.exists_keys(keys) == 6
        got = bytearray(6 * BLOCK)
        assert other.get_keys_into(keys, got) == 6 and bytes(got) == data
        assert other.put_keys(keys, None).new_pages == 0


def test_put_after_a_kept_lookup_sends_the_keys_past_it(relayed):
    c, relay = relayed
    keys = chain(5)
    data = payload(5, 12)
    c.put_keys(keys[:1], data[:BLOCK])
    kk = c.exists_keys_kept(keys[:3])  # the prompt so far: 3 keys, 1 cached
    assert kk.hits == 1 and kk.handle != 0 and kk.keys == 3
    before = len(relay.puts)
    # The chain grew by 2 keys since (decoded): only their tokens go.
    r = c.put_keys(keys, [data[i * BLOCK:(i + 1) * BLOCK] for i in range(1, 5)], 1, after=kk)
    assert (r.pages, r.new_pages, r.stored) == (5, 4, 4)
    assert relay.puts[before:] == [(PUT_F_HANDLE, 2 * KT, 1, 4, kk.handle)]
    got = bytearray(5 * BLOCK)
    assert c.get_keys_into(keys, got) == 5 and bytes(got) == data


def test_put_after_a_replaced_handle_sends_every_key(relayed):
    c, relay = relayed
    keys = chain(3)
    data = payload(3, 13)
    kk = c.exists_keys_kept(keys)
    assert kk.hits == 0 and kk.handle
    for _ in range(16):  # a connection keeps 16 handles: these replace kk's
        assert c.exists_keys_kept(chain(1)).handle
    before = len(relay.puts)
    r = c.put_keys(keys, data, after=kk)
    assert (r.pages, r.new_pages, r.stored) == (3, 3, 3)
    # The daemon answered ENOENT to the PUT naming it, and libkvtier sent every key's tokens.
    assert relay.puts[before:] == [(PUT_F_HANDLE, 0, 0, 3, kk.handle), (0, 3 * KT, 0, 3, 0)]
    got = bytearray(3 * BLOCK)
    assert c.get_keys_into(keys, got) == 3 and bytes(got) == data


def test_put_after_nothing_kept_sends_every_key(relayed):
    c, relay = relayed
    keys = chain(2)
    before = len(relay.puts)
    r = c.put_keys(keys, payload(2, 14), after=kvtier.KeptKeys(hits=0))  # handle 0: none kept
    assert r.stored == 2
    assert relay.puts[before:] == [(0, 2 * KT, 0, 2, 0)]


def test_put_after_more_keys_than_given_is_refused_and_sends_nothing(relayed):
    c, relay = relayed
    keys = chain(4)
    kk = c.exists_keys_kept(keys)
    before = len(relay.puts)
    with pytest.raises(kvtier.InvalidArgument, match="kept 4 keys, more than the 2 given"):
        c.put_keys(keys[:2], payload(2, 15), after=kk)
    assert len(relay.puts) == before
    assert c.exists_keys(keys[:2]) == 0, "nothing stored"


def test_mapped_put_after_a_kept_read(sd):
    # On the Unix socket with the mapping, the keyed PUT is a RESERVE naming the handle, the
    # copies into the mapping and a COMMIT: the same index and bytes.
    with sd.client() as c:
        keys = chain(4)
        data = payload(4, 16)
        c.put_keys(keys[:1], data[:BLOCK])
        buf = bytearray(4 * BLOCK)
        kk = c.get_keys_kept_into(keys, buf)
        assert kk.hits == 1 and kk.handle and kk.keys == 4
        r = c.put_keys(keys, [data[i * BLOCK:(i + 1) * BLOCK] for i in range(1, 4)], 1,
                       after=kk)
        assert (r.pages, r.new_pages, r.stored) == (4, 3, 3)
        with sd.client(zero_copy=False) as other:
            got = bytearray(4 * BLOCK)
            assert other.get_keys_into(keys, got) == 4 and bytes(got) == data


def test_async_client_keeps_too(sd):
    import asyncio

    async def main():
        async with kvtier.AsyncClient("pytest", unix_path=sd.unix, page_size=PAGE,
                                      block_bytes=BLOCK) as c:
            keys = chain(2)
            kk = await c.exists_keys_kept(keys)
            assert kk.handle and kk.keys == 2
            r = await c.put_keys(keys, payload(2, 17), after=kk)
            assert r.stored == 2
            got = bytearray(2 * BLOCK)
            kk2 = await c.get_keys_kept_into(keys, got)
            assert kk2.hits == 2 and bytes(got) == payload(2, 17)

    asyncio.run(main())
