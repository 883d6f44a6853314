"""test_aio.py: AsyncClient and AsyncBatch on an asyncio loop: every call awaited, calls on
several connections at once, errors raised in the awaiting task, the loop free while a call
waits."""

import asyncio

import pytest
from conftest import BLOCK, PAGE, payload, tokens

import kvtier


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def connect(daemon, **kw):
    return kvtier.AsyncClient("pytest", page_size=PAGE, block_bytes=BLOCK, unix_path=daemon.unix,
                              **kw)


def test_every_call_awaited(daemon):
    async def main():
        async with connect(daemon) as c:
            assert await c.ping() > 0
            tok = tokens(3)
            r = await c.put(tok, payload(3, 40))
            assert r.stored == 3
            m = await c.match(tok, lease=True)
            assert m.pages == 3
            out = bytearray(3 * BLOCK)
            assert await c.get_into(m.lease, out) == 3 and out == payload(3, 40)
            assert await c.get(m.lease, first_page=2) == payload(3, 40)[2 * BLOCK:]
            assert await c.release(m.lease) is True
            assert (await c.prefetch(tok, kvtier.Tier.DRAM, deadline_ms=500)).resident == 3
            assert "index_blocks" in await c.stats()
            with c.batch() as b:
                b.match(tok)
                b.ping()
                b.remove(tok)
                res = await b.run()
            assert res[0].pages == 3 and res[1:] == [None, None]
            with pytest.raises(kvtier.NotFound):
                await c.remove(tok)
            tok = tokens(4)  # a window after a gap (docs/protocol.md, "Chains with gaps")
            assert (await c.put(tok, payload(1, 41), first_page=3, gaps=True)).stored == 1
            ks = [b"aio-gap-%d" % i for i in range(4)]
            assert (await c.put_keys(ks, payload(1, 42), 3, gaps=True)).stored == 1
    run(main())


def test_connections_work_side_by_side_and_the_loop_keeps_running(daemon):
    async def main():
        clients = [await connect(daemon).connect() for _ in range(3)]
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        t = asyncio.ensure_future(ticker())
        toks = [tokens(2) for _ in clients]
        await asyncio.gather(*(c.put(tok, payload(2, 41 + i))
                               for i, (c, tok) in enumerate(zip(clients, toks))))
        ms = await asyncio.gather(*(c.match(tok, lease=True) for c, tok in zip(clients, toks)))
        outs = await asyncio.gather(*(c.get(m.lease) for c, m in zip(clients, ms)))
        assert outs == [payload(2, 41 + i) for i in range(3)]
        t.cancel()
        assert ticks > 0
        for c in clients:
            await c.close()
    run(main())


def test_errors_raise_in_the_awaiting_task(daemon, tmp_path):
    async def main():
        async with connect(daemon) as c:
            with pytest.raises(kvtier.NotFound):
                await c.get_into(42, bytearray(BLOCK))
            assert await c.ping() > 0
        with pytest.raises(kvtier.ConnectError):
            await kvtier.AsyncClient("m", unix_path=str(tmp_path / "none.sock")).connect()
        with pytest.raises(RuntimeError):
            await kvtier.AsyncClient("m").ping()
    run(main())


def test_a_batch_recorded_while_a_call_runs_on_the_same_connection(daemon):
    async def main():
        async with connect(daemon) as c:
            tok = tokens(4)
            await c.put(tok, payload(4, 50))
            m = await c.match(tok, lease=True)
            big = bytearray(4 * BLOCK)
            b = c.batch()
            for _ in range(50):
                # A GET runs in the worker while the loop records requests: request ids are
                # taken only in the worker, so the two never share one.
                get = asyncio.ensure_future(c.get_into(m.lease, big))
                d = b.match(tok)
                p = b.ping()
                assert len(b) >= 2
                with pytest.raises(RuntimeError):
                    d.result()
                res = await b.run()
                assert await get == 4 and big == payload(4, 50)
                assert res[-2].pages == 4 and d.result().pages == 4 and p.status == 0
            first = b.remove(tok)
            bad = b.put(tok, b"x")  # not whole blocks: raised by run(), before anything is sent
            with pytest.raises(kvtier.InvalidArgument):
                await b.run()
            assert not bad.done and not first.done and len(b) == 0
            assert (await c.match(tok)).pages == 4, "the REMOVE queued before it did not go out"
            b.close()
    run(main())
