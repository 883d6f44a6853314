"""Block keys through the package (kvtier/keys.py over libkvtier's client/keys.c), against a
real kvtierd: chains share their common prefix, independent keys are found alone (a suffix
without its prefix), misses are per key, a key over KEY_MAX bytes is refused before anything is
sent, keyed and token namespaces of one model never see each other, bytes round-trip exactly,
and a small tier stays within its capacity under keyed PUTs."""

from __future__ import annotations

import asyncio
import uuid

import numpy as np
import pytest

import kvtier
from conftest import BLOCK, Daemon


def blocks(n: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, n * BLOCK, dtype=np.uint8).tobytes()


def model() -> str:
    return "keys-" + uuid.uuid4().hex[:8]


def keys(prefix: str, n: int) -> list:
    return [("%s/%d" % (prefix, i)).encode() for i in range(n)]


def stat(c: kvtier.Client, name: str) -> int:
    return c.stats()[name]


def test_chain_sharing_stores_the_common_prefix_once(daemon: Daemon) -> None:
    with daemon.client(model()) as c:
        a = keys("p", 3) + [b"a-tail"]
        b = keys("p", 3) + [b"b-tail", b"b-tail2"]
        before = stat(c, "index_blocks"), stat(c, "dram_blocks")
        r1 = c.put_keys(a, blocks(4, 1))
        assert (r1.pages, r1.new_pages, r1.stored) == (4, 4, 4)
        r2 = c.put_keys(b, blocks(5, 2))
        # the three shared pages were held already: only the two new ones are added and stored
        assert (r2.pages, r2.new_pages, r2.stored, r2.skipped) == (5, 2, 2, 3)
        after = stat(c, "index_blocks"), stat(c, "dram_blocks")
        assert after[0] - before[0] == 6 and after[1] - before[1] == 6
        assert c.exists_keys(a) == 4 and c.exists_keys(b) == 5
        assert c.exists_keys(keys("p", 3) + [b"other"]) == 3
        # the shared pages keep the first chain's bytes (a PUT never overwrites a held page)
        out = bytearray(5 * BLOCK)
        assert c.get_keys_into(b, out) == 5
        assert out[:3 * BLOCK] == blocks(4, 1)[:3 * BLOCK]
        assert out[3 * BLOCK:] == blocks(5, 2)[3 * BLOCK:]


def test_chain_put_from_first_and_get_from_first(daemon: Daemon) -> None:
    with daemon.client(model()) as c:
        ks = keys("f", 6)
        data = blocks(6, 3)
        c.put_keys(ks[:2], data[:2 * BLOCK])
        assert c.exists_keys(ks) == 2
        r = c.put_keys(ks, data[2 * BLOCK:], first=2)  # the engine computed pages 2..5
        assert (r.new_pages, r.stored) == (4, 4)
        out = np.zeros(3 * BLOCK, dtype=np.uint8)
        assert c.get_keys_into(ks, out, first=3) == 3
        assert out.tobytes() == data[3 * BLOCK:]
        # a list of buffers, gathered into one PUT
        ks2 = keys("list", 3)
        parts = [bytearray(blocks(1, 10 + i)) for i in range(3)]
        assert c.put_keys(ks2, parts).stored == 3
        back = bytearray(3 * BLOCK)
        assert c.get_keys_into(ks2, back) == 3 and bytes(back) == b"".join(parts)


def test_chain_get_stops_at_the_first_missing_key(daemon: Daemon) -> None:
    with daemon.client(model()) as c:
        ks = keys("m", 4)
        data = blocks(4, 4)
        c.put_keys(ks[:2], data[:2 * BLOCK])
        out = bytearray(b"\xee" * 4 * BLOCK)
        assert c.get_keys_into(ks, out) == 2
        assert out[:2 * BLOCK] == data[:2 * BLOCK]
        assert out[2 * BLOCK:] == b"\xee" * 2 * BLOCK  # untouched
        assert c.get_keys_into(ks, out, first=2) == 0
        # an index-only chain is no block: exists counts only pages with bytes
        c.put_keys(keys("idx", 2), None)
        assert c.exists_keys(keys("idx", 2)) == 0


def test_independent_keys_suffix_alone_and_per_key_misses(daemon: Daemon) -> None:
    with daemon.client(model()) as c:
        ks = [uuid.uuid4().hex.encode() for _ in range(4)]  # SGLang-style chained page hashes
        data = blocks(4, 5)
        assert c.put_keys_each(ks, data) == [True] * 4
        # the suffix, asked without its prefix
        assert c.exists_keys_each(ks[2:]) == [True, True]
        one = bytearray(BLOCK)
        assert c.get_keys_each_into([ks[3]], [one]) == [True]
        assert bytes(one) == data[3 * BLOCK:]
        # a missing key in the middle: a per-key miss, its place untouched, the rest served
        ask = [ks[0], b"missing", ks[2]]
        bufs = [bytearray(b"\x11" * BLOCK) for _ in ask]
        assert c.get_keys_each_into(ask, bufs) == [True, False, True]
        assert bytes(bufs[0]) == data[:BLOCK] and bytes(bufs[2]) == data[2 * BLOCK:3 * BLOCK]
        assert bytes(bufs[1]) == b"\x11" * BLOCK
        # one buffer for all, key i at offset i x BLOCK; str keys are UTF-8
        c.put_keys_each(["é", "ü"], blocks(2, 6))
        flat = bytearray(2 * BLOCK)
        assert c.get_keys_each_into(["é".encode(), "ü"], flat) == [True, True]
        assert bytes(flat) == blocks(2, 6)
        assert c.exists_keys_each([b"nope", ks[1]]) == [False, True]
        assert c.remove_keys_each([ks[1], b"nope"]) == [True, False]
        assert c.exists_keys_each([ks[1]]) == [False]
        # an independent key is not the same page as that key inside a chain
        assert c.exists_keys([b"x", ks[0]]) == 0
        # no leases are left behind by the gets
        assert stat(c, "leases") == 0


def test_many_independent_keys_span_several_batches(daemon: Daemon) -> None:
    with daemon.client(model(), block_bytes=64) as c:
        n = 600  # over libkvtier's 256-key chunks
        ks = [b"k%d" % i for i in range(n)]
        data = np.arange(n * 64, dtype=np.uint32).astype(np.uint8)
        assert all(c.put_keys_each(ks, data))
        out = np.zeros(n * 64, dtype=np.uint8)
        got = c.get_keys_each_into(ks[:300] + [b"absent"] + ks[300:599], out)
        assert got.count(False) == 1 and got[300] is False
        assert out[:300 * 64].tobytes() == data[:300 * 64].tobytes()
        assert out[301 * 64:].tobytes() == data[300 * 64:599 * 64].tobytes()


def test_a_key_over_key_max_is_refused_before_sending(daemon: Daemon) -> None:
    with daemon.client(model()) as c:
        assert kvtier.KEY_MAX == 1024
        ok = b"k" * kvtier.KEY_MAX
        assert c.put_keys([ok], blocks(1, 7)).stored == 1
        assert c.exists_keys([ok]) == 1
        for bad in (b"k" * (kvtier.KEY_MAX + 1), b""):
            with pytest.raises(kvtier.InvalidArgument, match="KEY_MAX"):
                c.exists_keys([ok, bad])
            with pytest.raises(kvtier.InvalidArgument, match="key 1 is"):
                c.put_keys_each([ok, bad], blocks(2, 7))
            with pytest.raises(kvtier.InvalidArgument):
                c.get_keys_each_into([bad], [bytearray(BLOCK)])
        with pytest.raises(TypeError):
            c.exists_keys(b"one key, not a list")  # type: ignore[arg-type]
        with pytest.raises(kvtier.InvalidArgument):
            c.put_keys_each([b"a", b"b"], blocks(1, 8))  # one block for two keys
        # the connection still serves after the refusals
        assert c.exists_keys_each([ok]) == [True]


def test_keyed_and_token_namespaces_do_not_see_each_other(daemon: Daemon) -> None:
    m = model()
    key = b"the-key"
    toks = list(kvtier.key_tokens(key))
    assert len(toks) == kvtier.KEY_TOKENS == 4
    # a token client of the same model whose page is exactly a key's synthetic tokens
    with daemon.client(m) as c, daemon.client(m, page_size=4) as t:
        c.put_keys_each([key], blocks(1, 9))
        assert t.match(toks).pages == 0
        t.put(toks + toks, blocks(2, 10))
        assert c.exists_keys_each([key]) == [True]
        # the chain's first page is the independent key; its second is only in the token namespace
        assert c.exists_keys([key, key]) == 1
        out = bytearray(BLOCK)
        assert c.get_keys_each_into([key], [out]) == [True]
        assert bytes(out) == blocks(1, 9)
    # another model, adapter or salt does not see the key
    for kw in ({"salt": "tenant-b"}, {"adapter": "lora-1"}):
        with daemon.client(m, **kw) as o:
            assert o.exists_keys_each([key]) == [False]
    with daemon.client(model()) as o:
        assert o.exists_keys_each([key]) == [False]


def test_byte_exact_round_trips_of_numpy_and_torch(daemon: Daemon) -> None:
    torch = pytest.importorskip("torch")
    with daemon.client(model()) as c:
        ks = keys("t", 4)
        src = torch.randint(-2**15, 2**15, (4, BLOCK // 2), dtype=torch.int16)
        assert c.put_keys(ks, src).stored == 4
        dst = torch.zeros_like(src)
        assert c.get_keys_into(ks, dst) == 4
        assert torch.equal(src, dst)
        # independent keys into rows of a numpy array
        arr = np.random.default_rng(11).integers(0, 2**31, (3, BLOCK // 4), dtype=np.int32)
        ik = [b"np0", b"np1", b"np2"]
        assert c.put_keys_each(ik, [arr[i] for i in range(3)]) == [True] * 3
        back = np.zeros_like(arr)
        assert c.get_keys_each_into(ik[::-1], [back[i] for i in range(3)]) == [True] * 3
        assert np.array_equal(back, arr[::-1])


def test_async_client_has_the_keyed_calls(daemon: Daemon) -> None:
    async def main() -> None:
        async with kvtier.AsyncClient(model(), page_size=16, block_bytes=BLOCK,
                                      unix_path=daemon.unix) as c:
            ks = keys("aio", 2)
            await c.put_keys(ks, blocks(2, 12))
            assert await c.exists_keys(ks) == 2
            out = bytearray(2 * BLOCK)
            assert await c.get_keys_into(ks, out) == 2 and bytes(out) == blocks(2, 12)
            assert await c.exists_keys_each([ks[0], b"x"]) == [True, False]
            await c.remove_keys(ks)
            assert await c.exists_keys(ks) == 1

    asyncio.run(main())


def test_eviction_under_a_small_tier_keeps_within_capacity() -> None:
    d = Daemon("--dram-bytes", "256K", "--nvme-bytes", "0")
    try:
        with d.client(model()) as c:
            cap = stat(c, "dram_capacity_bytes")
            for i in range(40):  # 40 chains x 4 pages x 4 KiB = 640 KiB through a 256 KiB tier
                ks = keys("shared", 2) + keys("ev%d" % i, 2)
                c.put_keys(ks, blocks(4, 100 + i))
                assert stat(c, "dram_used_bytes") <= cap
            # leaf-first: the shared prefix, used by every chain, is still there
            assert c.exists_keys(keys("shared", 2)) == 2
            last = keys("shared", 2) + keys("ev39", 2)
            out = bytearray(4 * BLOCK)
            assert c.get_keys_into(last, out) == 4
            # the shared pages hold the first chain's bytes, the leaves the last one's
            assert bytes(out) == blocks(4, 100)[:2 * BLOCK] + blocks(4, 139)[2 * BLOCK:]
            assert c.exists_keys(keys("shared", 2) + keys("ev0", 2)) < 4  # evicted
            assert stat(c, "dram_used_bytes") <= cap
        # a block no tier has room for: the PUT skips it, and the key is reported not stored
        with d.client(model(), block_bytes=512 * 1024) as big:
            assert big.put_keys_each([b"big", b"big2"], bytes(1024 * 1024)) == [False, False]
            assert big.exists_keys_each([b"big"]) == [False]
    finally:
        assert d.stop() == 0


def test_chain_put_with_gaps_stores_a_window_alone(daemon: Daemon) -> None:
    """put_keys(gaps=True): the blocks of keys [first, ...) stored though the keys before them
    hold none (a sliding-window layer's window); without it they are skipped."""
    with daemon.client(model()) as c:
        ks, data = keys("w", 6), blocks(2, 3)
        assert c.put_keys(ks, data, 4).stored == 0
        ks = keys("g", 6)
        assert c.put_keys(ks, data, 4, gaps=True).stored == 2
        buf = bytearray(2 * BLOCK)
        assert c.get_keys_into(ks, buf, 4) == 2
        assert buf == data
        assert c.exists_keys(ks) == 0, "a chain's exists counts its leading blocks"
