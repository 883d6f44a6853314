"""test_keys_pipeline.py: put_keys_each through the zero-copy mapping pipelines its keys
(client/each.h): a group of keys' RESERVEs go out together and are answered together, then
their COMMITs, so that 32 keys cost a few round trips where a PUT per key cost two each (the
keyed PUT of bench_sglang/bench_lmcache, issue 35). Against a real kvtierd, through a relay on
a Unix socket that forwards the descriptors the daemon passes (its MAP reply's memfd), so the
client maps its arena as it does on the daemon's own socket, and that counts the turns of the
conversation: each time the client sends after the daemon has answered, the client waited for
that answer (a round trip)."""

from __future__ import annotations

import uuid

import numpy as np

import kvtier
from conftest import BLOCK, Daemon
from relay import UnixRelay
from kvtier._lib import lib


def keyed_mapped(c: kvtier.Client) -> bool:
    """Whether c's keyed connection maps its arena (opened by then)."""
    return bool(lib.kvt_client_zero_copy(lib.kvt_keys_client(c._kh)))


def test_put_keys_each_through_the_mapping_takes_a_few_round_trips(daemon: Daemon) -> None:
    assert daemon.unix
    relay = UnixRelay(daemon.unix)
    n = 32
    rng = np.random.default_rng(35)
    src = rng.integers(0, 256, (n, BLOCK), dtype=np.uint8)
    out = np.zeros_like(src)
    names = [b"pipe-%s-%d" % (uuid.uuid4().hex[:8].encode(), i) for i in range(n)]
    try:
        with kvtier.Client("keys-pipe-" + uuid.uuid4().hex[:8], page_size=16, block_bytes=BLOCK,
                           unix_path=relay.addr, timeout_ms=10000) as c:
            assert c.exists_keys_each(names[:1]) == [False]  # opens the keyed connection
            assert keyed_mapped(c), "the keyed connection maps through the relay"
            relay.turns = 0
            assert c.put_keys_each(names, list(src)) == [True] * n
            turns = relay.turns
            assert c.get_keys_each_into(names, list(out)) == [True] * n
            assert np.array_equal(src, out), "each key's own bytes"
            # Held already: RESERVE gives no room, the probe shows the bytes, nothing is sent.
            relay.turns = 0
            assert c.put_keys_each(names, list(src)) == [True] * n
            again = relay.turns
    finally:
        relay.close()
    # A PUT per key (RESERVE with its probe, then COMMIT) was 2 round trips a key: 64 here.
    assert turns <= 4, "%d round trips for %d keys" % (turns, n)
    assert again <= 4, "%d round trips for %d held keys" % (again, n)


def test_put_keys_each_groups_past_max_reservations_still_store_every_key() -> None:
    """With fewer reservations a connection may hold than a group has keys, the RESERVEs past
    them get ENOSPC: those keys go by a socket PUT each, and every key's own bytes are stored
    (2 MiB blocks, as the connector benchmarks move)."""
    big = 2 << 20
    n = 20
    d = Daemon("--dram-bytes", "64M", "--max-reservations", "5")
    assert d.unix
    rng = np.random.default_rng(37)
    src = rng.integers(0, 256, (n, big), dtype=np.uint8)
    out = np.zeros_like(src)
    names = [b"few-%d" % i for i in range(n)]
    try:
        with kvtier.Client("keys-few-" + uuid.uuid4().hex[:8], page_size=16, block_bytes=big,
                           unix_path=d.unix, timeout_ms=20000) as c:
            assert c.exists_keys_each(names[:1]) == [False]
            assert keyed_mapped(c)
            assert c.put_keys_each(names, list(src)) == [True] * n
            assert c.get_keys_each_into(names, list(out)) == [True] * n
            assert np.array_equal(src, out), "each key's own bytes"
    finally:
        assert d.stop() == 0
