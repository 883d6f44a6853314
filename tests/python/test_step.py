"""test_step.py: one round trip per engine step through the package (docs/protocol.md, "One round
trip per step"; docs/python.md) against a real kvtierd: match(lease=True, locate=True) hands out
read-only views of the hit pages where they lie, the same bytes get_into() reads; match(keep=True)
then put(..., after=match) stores what a put of all the tokens stores, sending only the tokens
past the kept ones, and reserve(..., after=match) likewise; a Match whose handle the daemon no longer holds (expired) still stores, by
the whole tokens; release_later() gives the lease back with the next call."""

import asyncio
import time

import pytest
from conftest import BLOCK, PAGE, Daemon, payload, tokens

import kvtier


@pytest.fixture(scope="module")
def sd():
    d = Daemon()
    yield d
    assert d.stop() == 0


def test_locate_views_are_the_stored_bytes(sd):
    with sd.client() as c:
        assert c.zero_copy, c.zero_copy_reason
        t = tokens(3)
        c.put(t, payload(3, 5))
        before = time.monotonic_ns()
        m = c.match(t, lease=True, lease_ms=5000, locate=True)
        assert m.pages == 3 and m.lease
        assert m.views is not None and len(m.views) == 3
        assert before + 5000 * 10**6 <= m.valid_until_ns <= time.monotonic_ns() + 5000 * 10**6
        want = payload(3, 5)
        for i, v in enumerate(m.views):
            assert v is not None and v.readonly and len(v) == BLOCK
            assert bytes(v) == want[i * BLOCK:(i + 1) * BLOCK], "page %d" % i
        buf = bytearray(3 * BLOCK)
        assert c.get_into(m.lease, buf) == 3 and bytes(buf) == want
        c.release_later(m.lease)
        assert c.stats()["leases"] == 0, "the RELEASE went out with the STATS"


def test_locate_needs_lease(sd):
    with sd.client() as c:
        with pytest.raises(kvtier.InvalidArgument):
            c.match(tokens(1), locate=True)


def test_locate_without_mapping_locates_nothing(sd):
    with sd.client(zero_copy=False) as c:
        t = tokens(2)
        c.put(t, payload(2, 1))
        m = c.match(t, lease=True, locate=True)
        assert m.pages == 2 and m.views == (None, None)
        assert c.release(m.lease)


def test_put_after_keep_sends_the_rest(sd):
    with sd.client() as c, sd.client() as other:
        t = tokens(4, extra=1)  # 4 pages and a token of the next
        c.put(t[:2 * PAGE], payload(2, 8))  # the prompt's cached part
        m = c.match(t[:2 * PAGE + 1], keep=True)
        assert m.pages == 2 and m.handle != 0 and m.kept == 2 * PAGE + 1
        # The engine computed pages 2 and 3 (the prompt's last token and the decoded ones).
        r = c.put(t, payload(2, 9), first_page=2, after=m)
        assert (r.pages, r.new_pages, r.stored) == (4, 2, 2)
        # What it stored is what a put of all the tokens names, for any client.
        got = other.match(t, lease=True)
        assert got.pages == 4
        assert other.get(got.lease, first_page=2, npages=2) == payload(2, 9)
        other.release(got.lease)
        with pytest.raises(kvtier.InvalidArgument):
            c.put(t[:PAGE], after=m)  # fewer tokens than the match kept


def test_put_after_an_expired_keep_sends_all(sd):
    with sd.client() as c:
        t = tokens(2)
        m = c.match(t, keep=True, lease_ms=20)
        assert m.handle
        time.sleep(0.1)
        r = c.put(t, payload(2, 3), after=m)
        assert (r.pages, r.stored) == (2, 2)
        assert c.match(t).pages == 2


def test_put_after_a_match_without_keep(sd):
    with sd.client() as c:
        t = tokens(1)
        m = c.match(t)
        assert m.handle == 0 and m.kept == 0
        assert c.put(t, payload(1, 2), after=m).stored == 1


def write_commit(c, r, data):
    """Writes data (whole blocks, one per view) into a Reservation's views and commits it."""
    assert r.nreserved == len(r.views) == len(data) // BLOCK
    for i, v in enumerate(r.views):
        v[:] = data[i * BLOCK:(i + 1) * BLOCK]
    return c.commit(r)


def test_reserve_after_keep_sends_the_rest(sd):
    with sd.client() as c, sd.client() as other:
        assert c.zero_copy, c.zero_copy_reason
        t = tokens(4, extra=1)
        c.put(t[:2 * PAGE], payload(2, 21))
        m = c.match(t[:2 * PAGE + 1], keep=True)
        assert m.handle and m.kept == 2 * PAGE + 1
        # The kept tokens the caller passes are not sent: scrambled here, a RESERVE that sent
        # them would cache another chain (4 new pages, and none of t's).
        sent = [7] * m.kept + t[m.kept:]
        r = c.reserve(sent, 2, first_page=2, after=m)
        assert (r.pages, r.new_pages, r.nreserved) == (4, 2, 2)
        assert write_commit(c, r, payload(2, 22)).stored == 2
        got = other.match(t, lease=True)
        assert got.pages == 4
        assert other.get(got.lease, first_page=2, npages=2) == payload(2, 22)
        other.release(got.lease)
        blocks = c.stats()["index_blocks"]
        with pytest.raises(kvtier.InvalidArgument):
            c.reserve(t[:PAGE], 1, after=m)  # fewer tokens than the match kept
        assert c.stats()["index_blocks"] == blocks


def test_reserve_after_an_expired_keep_sends_all(sd):
    with sd.client() as c:
        t = tokens(2)
        m = c.match(t, keep=True, lease_ms=20)
        assert m.handle
        time.sleep(0.1)
        r = c.reserve(t, 2, after=m)
        assert (r.pages, r.new_pages, r.nreserved) == (2, 2, 2)
        assert write_commit(c, r, payload(2, 23)).stored == 2
        assert c.match(t).pages == 2


def test_async_client_takes_the_same_step(sd):
    async def main():
        async with kvtier.AsyncClient("pytest", page_size=PAGE, block_bytes=BLOCK,
                                      unix_path=sd.unix) as c:
            t = tokens(2)
            m = await c.match(t, keep=True)
            assert m.handle
            assert (await c.put(t, payload(2, 6), after=m)).stored == 2
            t2 = t + tokens(1)
            r = await c.reserve([7] * m.kept + t2[m.kept:], 1, first_page=2, after=m)
            assert (r.pages, r.new_pages) == (3, 1)
            for v in r.views:
                v[:] = payload(1, 7)
            assert (await c.commit(r)).stored == 1
            assert (await c.match(t2)).pages == 3
            m = await c.match(t, lease=True, locate=True)
            assert [bytes(v) for v in m.views] == [payload(2, 6)[:BLOCK], payload(2, 6)[BLOCK:]]
            await c.release_later(m.lease)
            assert (await c.stats())["leases"] == 0
    asyncio.run(asyncio.wait_for(main(), 30))


def test_vllm_load_views_takes_no_get(sd):
    """The vLLM worker's zero-copy load: its MATCH locates the pages, no GET goes out."""
    pytest.importorskip("vllm", reason="vLLM is not installed")
    np = pytest.importorskip("numpy", reason="numpy is not installed")
    import hashlib
    import logging

    from kvtier.guard import Guard
    from kvtier.vllm.store import _PageStore

    store = _PageStore({"unix_path": sd.unix}, "pytest-vllm", "", BLOCK,
                       guard=Guard(logging.getLogger("test_step")), deadline_ms=5000,
                       what="worker")
    try:
        keys = [hashlib.sha256(b"step%d" % i).digest() for i in range(3)]
        pages = np.frombuffer(payload(3, 11), np.uint8).reshape(3, BLOCK)
        assert store.save(keys, 0, pages) == 3
        assert store.mapped, "the worker's store did not map the arena"
        with sd.client() as c:
            gets = c.stats()["requests_get"]
            lease, items = store.load_views(keys, 1)
            assert lease and len(items) == 2
            assert all(isinstance(v, memoryview) for v in items)
            assert b"".join(bytes(v) for v in items) == payload(3, 11)[BLOCK:]
            assert c.stats()["requests_get"] == gets, "the load sent a GET"
            store.release_views(lease)
    finally:
        store.close()
