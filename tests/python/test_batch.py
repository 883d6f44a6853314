"""test_batch.py: Client.batch(): requests queued, sent pipelined in one run(), each with its
own result or error."""

import pytest
from conftest import BLOCK, payload, tokens

import kvtier


def test_a_batch_of_every_request(client):
    a, b = tokens(2), tokens(3)
    with client.batch() as batch:
        pa = batch.put(a, payload(2, 30))
        pb = batch.put(b, bytearray(payload(3, 31)))
        batch.ping()
        assert len(batch) == 3
        with pytest.raises(RuntimeError):
            pa.result()
        assert len(batch.run()) == 3 and len(batch) == 0
        assert pa.result().stored == 2 and pb.result().stored == 3
        # The batch runs again with more requests. (Pipelined behind a PUT in the same run, a
        # MATCH or PREFETCH may see pages whose bytes have not landed yet: hence two runs.)
        ma = batch.match(a, lease=True)
        mb = batch.match(b)
        pf = batch.prefetch(b, kvtier.Tier.DRAM, deadline_ms=1000)
        pfs = batch.prefetch(b, kvtier.Tier.DRAM, deadline_ms=1000, wait=False)
        out = batch.run()
        assert out == [ma.result(), mb.result(), pf.result(), pfs.result()]
        assert ma.result().pages == 2 and ma.result().lease != 0
        assert mb.result().pages == 3 and list(mb.result().tiers) == [kvtier.Tier.DRAM] * 3
        assert pf.result().resident == 3 and pfs.result().resident == 3
        assert client.get(ma.result().lease) == payload(2, 30)
        rel = batch.release(ma.result().lease)
        rm = batch.remove(b, wait=False)
        rm2 = batch.remove(a)
        assert batch.run() == [None, None, None]
        assert rel.status == 0 and rm.status == 0 and rm2.status == 0
    assert client.match(a).pages == 1 and client.match(b).pages == 2, "each lost its last page"


def test_one_failed_request_does_not_fail_the_others(client):
    tok = tokens(1)
    batch = client.batch()
    ok = batch.put(tok, payload(1, 32))
    bad = batch.remove(tokens(1))  # nothing cached there
    hbm = batch.prefetch(tok, kvtier.Tier.HBM, deadline_ms=100)
    with pytest.raises(kvtier.NotFound):
        batch.run()
    assert ok.result().stored == 1 and bad.status == -30802
    with pytest.raises(kvtier.Unavailable):
        hbm.result()
    batch.match(tok)
    batch.remove(tokens(1))
    res = batch.run(raise_on_error=False)
    assert res[0].pages == 1 and isinstance(res[1], kvtier.NotFound)
    batch.close()


def test_a_batch_copies_its_payloads_when_queued(client):
    tok = tokens(1)
    buf = bytearray(payload(1, 33))
    batch = client.batch()
    batch.put(tok, buf)
    buf[:] = bytes(BLOCK)  # reused at once: the batch holds its own copy
    batch.run()
    m = client.match(tok, lease=True)
    assert client.get(m.lease) == payload(1, 33)


def test_a_batch_on_a_closed_client_or_closed_itself(daemon):
    c = daemon.client()
    b = c.batch()
    b.ping()
    c.close()
    with pytest.raises(kvtier.ConnectionClosed):
        b.run()
    with pytest.raises(kvtier.ConnectionClosed):
        b.ping()
    b.close()
    with pytest.raises(RuntimeError):
        b.run()
