"""test_client.py: every call of kvtier.Client against a real kvtierd: HELLO (and AUTH),
PING, MATCH with and without a lease, PUT, GET (into a buffer and as bytes, whole and in part),
PREFETCH (waited for and started), RELEASE, REMOVE (waited for and not), STATS, hints, and the
token forms the calls take."""

import array

import pytest
from conftest import BLOCK, PAGE, payload, tokens

import kvtier


def test_hello_reports_the_daemons_tiers_and_ping_round_trips(client):
    assert kvtier.Tier.DRAM in client.tiers and kvtier.Tier.NVME in client.tiers
    assert kvtier.Tier.HBM not in client.tiers, "started with --hbm-bytes 0"
    assert client.ns_seed != 0
    assert client.ping() > 0, "a round trip in nanoseconds"


def test_namespaces_are_separate(daemon):
    tok = tokens(2)
    with daemon.client("ns-a") as a, daemon.client("ns-a", salt="tenant-2") as b:
        a.put(tok, payload(2, 1))
        assert a.match(tok).pages == 2
        assert b.match(tok).pages == 0, "another tenant's salt sees nothing"
        assert a.ns_seed != b.ns_seed


def test_put_match_get_release_round_trip(client):
    tok = tokens(4, extra=5)  # 4 whole pages and a partial one
    data = payload(4, 1)
    r = client.put(tok, data)
    assert (r.pages, r.new_pages, r.stored, r.skipped) == (4, 4, 4, 0)
    m = client.match(tok, lease=True)
    assert (m.pages, m.tokens, m.remote_pages) == (4, 4 * PAGE, 0)
    assert list(m.tiers) == [kvtier.Tier.DRAM] * 4
    assert m.lease != 0
    out = bytearray(4 * BLOCK)
    tiers = bytearray(4)
    assert client.get_into(m.lease, out, tiers=tiers) == 4
    assert out == data and list(tiers) == [kvtier.Tier.DRAM] * 4
    assert client.get(m.lease) == data, "to the lease's end"
    assert client.get(m.lease, first_page=1, npages=2) == data[BLOCK:3 * BLOCK]
    part = bytearray(BLOCK)
    assert client.get_into(m.lease, part, first_page=3) == 1
    assert part == data[3 * BLOCK:]
    assert client.release(m.lease) is True
    assert client.release(m.lease) is False, "releasing twice is not an error"


def test_put_the_rest_after_a_match_and_pages_stored_keep_their_bytes(client):
    tok = tokens(6)
    client.put(tok[:2 * PAGE], payload(2, 2))
    m = client.match(tok)
    assert m.pages == 2 and m.lease == 0, "no lease unless asked for"
    r = client.put(tok, payload(4, 3), first_page=m.pages)
    assert (r.pages, r.new_pages, r.stored) == (6, 4, 4)
    r = client.put(tok[:2 * PAGE], payload(2, 9))
    assert (r.stored, r.skipped) == (0, 2)
    m = client.match(tok, lease=True)
    assert client.get(m.lease) == payload(2, 2) + payload(4, 3)
    client.release(m.lease)


def test_index_only_put_and_probe_match(client):
    tok = tokens(3)
    r = client.put(tok)
    assert (r.pages, r.stored) == (3, 0)
    m = client.match(tok, probe=True)
    assert m.pages == 3 and list(m.tiers) == [kvtier.Tier.NONE] * 3


def test_match_names_each_pages_tier(client):
    tok = tokens(4)
    client.put(tok[:2 * PAGE], payload(2, 7))
    client.put(tok, first_page=2)  # pages 2 and 3 indexed with no bytes
    m = client.match(tok, probe=True)
    D, N = kvtier.Tier.DRAM, kvtier.Tier.NONE
    assert m.tiers == (D, D, N, N) and all(type(t) is kvtier.Tier for t in m.tiers)
    assert "Tier.DRAM" in repr(m) and "Tier.NONE" in repr(m), "a person reads names"
    assert [t.name for t in m.tiers] == ["DRAM", "DRAM", "NONE", "NONE"]
    assert m.tiers_raw == bytes([2, 2, 0, 0]), "the wire's numbers, one byte a page"
    assert [i for i, t in enumerate(m.tiers) if t] == [0, 1], "IntEnum: NONE is falsy"
    with client.batch() as b:
        p = b.match(tok, probe=True)
        b.run()
    assert p.result().tiers == m.tiers


def test_prefetch_waited_for_and_started(client):
    tok = tokens(3)
    client.put(tok, payload(3, 4))
    for wait in (True, False):
        r = client.prefetch(tok, kvtier.Tier.DRAM, deadline_ms=1000, wait=wait)
        assert (r.pages, r.resident, r.moved, r.failed) == (3, 3, 0, 0)
    with pytest.raises(kvtier.Unavailable) as e:
        client.prefetch(tok, kvtier.Tier.HBM, deadline_ms=1000)
    assert e.value.name == "EUNAVAIL" and e.value.code == -30808


def test_remove_waited_for_and_not_and_busy_under_a_lease(client):
    tok = tokens(3)
    client.put(tok, payload(3, 5))
    client.remove(tok, wait=False)  # the last whole page and what is beneath it
    assert client.match(tok).pages == 2
    m = client.match(tok, lease=True)
    with pytest.raises(kvtier.Busy):
        client.remove(tok[:PAGE])
    client.release(m.lease)
    client.remove(tok[:PAGE])
    assert client.match(tok).pages == 0
    with pytest.raises(kvtier.NotFound):
        client.remove(tok)


def test_stats_names_the_daemons_counters(client):
    client.put(tokens(2), payload(2, 6))
    s = client.stats()
    for name in ("index_blocks", "leases", "connections", "lookups"):
        assert isinstance(s[name], int)
    assert s["index_blocks"] >= 2 and s["connections"] >= 1


def test_hints_are_sent_and_contradictory_ones_refused(client):
    tok = tokens(2)
    h = kvtier.Hints(engine_request_id=7, priority=3, paused=True, resume_ms=1500)
    assert client.put(tok, payload(2, 7), hints=h).pages == 2
    assert client.match(tok, hints=kvtier.Hints(finished=True)).pages == 2
    with pytest.raises(kvtier.ProtocolError) as e:
        client.match(tok, hints=kvtier.Hints(paused=True, finished=True))
    assert e.value.code == -30807 and e.value.message, "with the daemon's message"
    assert client.ping() > 0, "the connection goes on"


def test_tokens_as_list_array_numpy_and_torch(client):
    np = pytest.importorskip("numpy", reason="numpy is not installed")
    tok = tokens(2)
    client.put(tok, payload(2, 8))
    forms = [tok, tuple(tok), array.array("I", tok), np.array(tok, np.uint32),
             np.array(tok, np.int32), np.array(tok, np.int64)]
    try:
        import torch
        forms += [torch.tensor(tok, dtype=torch.int32), torch.tensor(tok, dtype=torch.int64)]
    except ImportError:
        pass
    for f in forms:
        assert client.match(f).pages == 2, type(f)


def test_tcp_connection(daemon):
    with kvtier.Client("pytest", page_size=PAGE, block_bytes=BLOCK, tcp=daemon.tcp) as c:
        tok = tokens(1)
        c.put(tok, payload(1, 9))
        m = c.match(tok, lease=True)
        assert c.get(m.lease) == payload(1, 9)


def test_a_window_is_stored_after_pages_without_bytes_with_gaps(client):
    """put(gaps=True) (docs/protocol.md, "Chains with gaps"): a sliding-window layer's window
    alone; without it the daemon skips pages after pages without bytes, as before."""
    tok, data = tokens(6), payload(2, 4)
    assert client.put(tok, data, first_page=4).stored == 0
    tok = tokens(6)
    r = client.put(tok, data, first_page=4, gaps=True)
    assert (r.pages, r.new_pages, r.stored, r.skipped) == (6, 6, 2, 0)
    m = client.match(tok, lease=True)
    assert m.pages == 6
    assert list(m.tiers) == [kvtier.Tier.NONE] * 4 + [kvtier.Tier.DRAM] * 2
    assert client.get(m.lease, first_page=4) == data
    client.release(m.lease)
    r = client.put(tokens(6), data, first_page=4)
    assert r.stored == 0, "the flag was for that call only"
