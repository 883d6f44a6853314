"""test_devices.py: Client(device=...) against a real kvtierd with an HBM pool per device
(hbm-devices 0,1, the host backend standing in for two GPUs: docs/gpu.md, "Several GPUs"): a
client on device 1 stores its pages in device 1's pool and one on device 0 (the default) in
device 0's, each reads the other's, and a device that is no CUDA ordinal is refused before
anything is sent."""

import time

import pytest
from conftest import Daemon, payload, tokens

import kvtier


@pytest.fixture(scope="module")
def two():
    d = Daemon("--hbm-backend", "host", "--hbm-devices", "0,1", "--hbm-bytes", "1M",
               "--policy-high", "1", "--policy-low", "1")
    yield d
    assert d.stop() == 0


def _pools(c: kvtier.Client):
    s = c.stats()
    return s.get("hbm_pool_blocks_0"), s.get("hbm_pool_blocks_1")


def test_pages_go_to_the_pool_of_the_client_s_device(two):
    # zero_copy off: a zero-copy PUT writes into the client's DRAM arena, never HBM.
    with two.client(device=1, zero_copy=False) as c1, two.client(zero_copy=False) as c0:
        assert c1.device == 1 and c0.device == 0
        s = c0.stats()
        assert s["hbm_capacity_bytes"] == 2 << 20, "hbm-bytes is each device's pool"
        assert s["hbm_pool_capacity_bytes_0"] == s["hbm_pool_capacity_bytes_1"] == 1 << 20
        # The pools' gauges are refreshed every tick: STATS reads them as they are now.
        b0, b1 = _pools(c0)
        t1, t0 = tokens(3), tokens(2)
        assert c1.put(t1, payload(3, 1)).stored == 3
        assert c0.put(t0, payload(2, 2)).stored == 2
        for _ in range(500):
            if _pools(c0) == (b0 + 2, b1 + 3):
                break
            time.sleep(0.01)
        assert _pools(c0) == (b0 + 2, b1 + 3)
        # Across devices: each reads the other's pages from HBM.
        for c, t, pages, seed in ((c0, t1, 3, 1), (c1, t0, 2, 2)):
            m = c.match(t, lease=True)
            assert m.pages == pages and all(x == kvtier.Tier.HBM for x in m.tiers)
            assert c.get(m.lease) == payload(pages, seed)
            c.release(m.lease)


@pytest.mark.parametrize("bad", [-1, 65536, 1.0, "1", True])
def test_a_device_that_is_no_ordinal_is_refused(two, bad):
    with pytest.raises(kvtier.InvalidArgument):
        two.client(device=bad)


def test_old_daemon_behaviour_without_hbm_devices(daemon):
    # A daemon without HBM takes any device: it only chooses an HBM pool.
    with daemon.client(device=7) as c:
        t = tokens(1)
        assert c.put(t, payload(1, 3)).stored == 1
        m = c.match(t, lease=True)
        assert c.get(m.lease) == payload(1, 3)
        c.release(m.lease)

