"""test_zero_copy.py: the package's zero-copy path (docs/python.md, "Zero-copy") against a real
kvtierd: a Client on the Unix socket maps its namespace's DRAM arena by default and one over TCP
falls back, saying why; zero_copy on and off give the same results and bytes; get_views hands out
read-only views INTO the mapping (numpy over them shares the memory) for mapped pages and bytes
for pages that came through the socket; reserve gives writable views that numpy and torch write
in place, commit makes them visible, abort leaves nothing; the mapping survives many calls and
close() unmaps it; keyed calls and AsyncClient take the same path."""

import asyncio
import ctypes
import mmap
import resource

import pytest
from conftest import BLOCK, PAGE, Daemon, payload, tokens

import kvtier
from kvtier._lib import ffi, lib

np = pytest.importorskip("numpy", reason="numpy is not installed")


@pytest.fixture(scope="module")
def zd():
    d = Daemon()
    yield d
    assert d.stop() == 0


def _addr(buf) -> int:
    return int(ffi.cast("uintptr_t", ffi.from_buffer(buf)))


def _maps_at(addr: int) -> bool:
    """Whether this process has a mapping starting at addr (/proc/self/maps)."""
    with open("/proc/self/maps") as f:
        return any(int(line.split("-", 1)[0], 16) == addr for line in f)


def _inside(c: kvtier.Client, buf) -> bool:
    base, size = c._mapping()
    a = _addr(buf)
    return base <= a and a + len(memoryview(buf).cast("B")) <= base + size


def test_unix_maps_and_tcp_falls_back(zd):
    with zd.client() as c:
        assert c.zero_copy, c.zero_copy_reason
        assert c.zero_copy_reason == ""
        base, size = c._mapping()
        assert base and size >= BLOCK
    with kvtier.Client("pytest", page_size=PAGE, block_bytes=BLOCK, tcp=zd.tcp) as t:
        assert not t.zero_copy
        assert "TCP" in t.zero_copy_reason
        tok, raw = tokens(2), payload(2, 1)
        assert t.put(tok, raw).stored == 2
        m = t.match(tok, lease=True)
        assert t.get(m.lease) == raw
        views = t.get_views(m.lease)
        assert [bytes(v) for v in views] == [raw[:BLOCK], raw[BLOCK:]]
        assert all(isinstance(v, bytes) for v in views), "no mapping: every page is bytes"
        t.release(m.lease)
        with pytest.raises(kvtier.InvalidArgument):
            t.reserve(tok, 1)
    with zd.client(zero_copy=False) as off:
        assert not off.zero_copy and "off" in off.zero_copy_reason


def test_zero_copy_on_and_off_give_the_same_results_and_bytes(zd):
    with zd.client("zc-on") as on, zd.client("zc-off", zero_copy=False) as off, \
            zd.client("zc-on", zero_copy=False) as reader:
        assert on.zero_copy and not off.zero_copy
        tok = tokens(4, extra=5)
        raw = payload(4, 2)
        steps = [(0, 2), (1, 3), (0, 4), (0, 0)]
        for first, n in steps:
            data = raw[first * BLOCK:(first + n) * BLOCK] if n else None
            a = on.put(tok, data, first_page=first)
            b = off.put(tok, data, first_page=first)
            assert a == b, (first, n)
        for c in (on, off, reader):  # the zero-copy writer's pages, read both ways
            m = c.match(tok, lease=True)
            assert m.pages == 4 and all(t == kvtier.Tier.DRAM for t in m.tiers)
            out = bytearray(4 * BLOCK)
            assert c.get_into(m.lease, out) == 4
            assert bytes(out) == raw
            assert c.get(m.lease, first_page=1, npages=2) == raw[BLOCK:3 * BLOCK]
            assert c.get(m.lease) == raw
            c.release(m.lease)


def test_get_views_point_into_the_mapping(zd):
    with zd.client() as c:
        tok, raw = tokens(3), payload(3, 3)
        c.put(tok, raw)
        m = c.match(tok, lease=True, lease_ms=30000)
        views = c.get_views(m.lease)
        assert len(views) == 3
        for i, v in enumerate(views):
            assert isinstance(v, memoryview) and v.readonly and v.nbytes == BLOCK
            assert _inside(c, v), "page %d is a view into the mapping, not a copy" % i
            assert bytes(v) == raw[i * BLOCK:(i + 1) * BLOCK]
            a = np.frombuffer(v, np.uint8)  # no copy: the array's memory is the mapping's
            assert a.ctypes.data == _addr(v) and a.tobytes() == bytes(v)
        part = c.get_views(m.lease, first_page=1, npages=1)
        assert len(part) == 1 and _addr(part[0]) == _addr(views[1])
        c.release(m.lease)


def test_pages_stored_before_the_mapping_come_as_bytes(zd):
    # A namespace of its own, written by an unmapped client before any client mapped it: its
    # blocks stay in the shared region and are sent through the socket.
    with zd.client("zc-before", zero_copy=False) as early:
        tok, raw = tokens(2), payload(2, 4)
        early.put(tok, raw)
        with zd.client("zc-before") as c:
            assert c.zero_copy
            m = c.match(tok, lease=True)
            views = c.get_views(m.lease)
            assert all(isinstance(v, bytes) for v in views)
            assert b"".join(views) == raw
            # New pages of that namespace now land in its arena.
            tok2, raw2 = tokens(1), payload(1, 5)
            c.put(tok2, raw2)
            m2 = c.match(tok2, lease=True)
            (v,) = c.get_views(m2.lease)
            assert isinstance(v, memoryview) and _inside(c, v) and bytes(v) == raw2
            c.release(m.lease)
            c.release(m2.lease)


def test_reserve_gives_writable_views_numpy_and_torch_write_in_place(zd):
    with zd.client() as c, zd.client(zero_copy=False) as reader:
        tok, raw = tokens(3), payload(3, 6)
        r = c.reserve(tok, 3)
        assert r.id and r.nreserved == 3 and r.pages == 3 and r.new_pages == 3
        assert all(v is not None and not v.readonly and _inside(c, v) for v in r.views)
        np.frombuffer(r.views[0], np.uint8)[:] = np.frombuffer(raw[:BLOCK], np.uint8)
        r.views[1][:] = raw[BLOCK:2 * BLOCK]
        torch = pytest.importorskip("torch", reason="torch is not installed")
        t = torch.frombuffer(r.views[2], dtype=torch.uint8)
        t.copy_(torch.frombuffer(bytearray(raw[2 * BLOCK:]), dtype=torch.uint8))
        assert reader.match(tok).tiers == (kvtier.Tier.NONE,) * 3, "invisible until commit"
        del t
        res = c.commit(r)
        assert res.stored == 3
        m = reader.match(tok, lease=True)
        assert reader.get(m.lease) == raw
        reader.release(m.lease)
        # Held already: nothing to reserve, and a commit of it sends nothing.
        r2 = c.reserve(tok, 3)
        assert r2.id == 0 and r2.nreserved == 0 and r2.views == [None] * 3
        assert c.commit(r2).stored == 0
        with pytest.raises(kvtier.NotFound):
            c.commit(r.id)  # committed already


def _populate_write_works() -> bool:
    """Whether this kernel has madvise(MADV_POPULATE_WRITE) (Linux 5.14)."""
    m = mmap.mmap(-1, 1 << 16)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
        ok = libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(1 << 16), 23) == 0
        return ok
    finally:
        m.close()

def _extra_faults_writing_fresh_memory(n, bb):
    """The page faults beyond one per 4 KiB taken by writing n fresh rows of bb bytes (a private
    mapping, no huge pages) the way the test below writes its reservation."""
    ctl = mmap.mmap(-1, n * bb)
    ctl.madvise(mmap.MADV_NOHUGEPAGE)
    view = np.frombuffer(ctl, np.uint8).reshape(n, bb)
    src = np.arange(n * bb, dtype=np.uint64).astype(np.uint8).reshape(n, bb)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for i in range(n):
        view[i] = src[i]
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    del view
    ctl.close()
    return faults - n * bb // 4096

def test_reserved_room_is_populated_before_the_caller_writes_it(zd):
    """A RESERVE's room is made present in the client's mapping before the caller writes it
    (libkvtier's warm_room, MADV_POPULATE_WRITE): writing 8 fresh pages of 1 MiB takes a few
    page faults, not one per 4 KiB of memory as before (2048). Then the same room's bytes come
    back through another client, and a second reservation in the same memory writes without
    faults too."""
    if not _populate_write_works():
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux 5.14)")
    bb, n = 1 << 20, 8
    # What writing fresh memory costs this process beyond one fault per 4 KiB page: nothing in
    # a plain build; under AddressSanitizer (preloaded: make test's sanitizer pass) the shadow
    # memory its checked copies touch faults too, about 560 more for these 8 MiB.
    extra = max(_extra_faults_writing_fresh_memory(n, bb), 0)
    with kvtier.Client("zc-warm", page_size=PAGE, block_bytes=bb, unix_path=zd.unix) as c, \
            kvtier.Client("zc-warm", page_size=PAGE, block_bytes=bb, unix_path=zd.unix,
                          zero_copy=False) as reader:
        assert c.zero_copy, c.zero_copy_reason
        for round_ in range(2):
            tok = tokens(n)
            r = c.reserve(tok, n)
            assert r.nreserved == n
            arrs = [np.frombuffer(v, np.uint8) for v in r.views]
            src = np.arange(n * bb, dtype=np.uint64).astype(np.uint8).reshape(n, bb)
            src[:, 0] = round_ + 1
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            for a, s in zip(arrs, src):
                a[:] = s
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
            del arrs
            assert c.commit(r).stored == n
            # The 64 KiB granules wholly inside each page are populated; a page not 64 KiB
            # aligned faults on its two edges, 15 pages of 4 KiB at most each.
            assert faults <= n * 2 * 15 + 16 + extra, (round_, faults, extra)
            m = reader.match(tok, lease=True)
            assert reader.get(m.lease) == src.tobytes()
            reader.release(m.lease)
            c.remove(tok[:PAGE])


def test_reserve_with_gaps_commits_a_window_after_pages_without_bytes(zd):
    """reserve(gaps=True): the committed window is stored though the pages before it hold no
    bytes; without it the commit skips them."""
    with zd.client() as c, zd.client(zero_copy=False) as reader:
        for gaps, stored in ((False, 0), (True, 2)):
            tok, raw = tokens(5), payload(2, 8)
            r = c.reserve(tok, 2, first_page=3, gaps=gaps)
            assert r.nreserved == 2
            r.views[0][:] = raw[:BLOCK]
            r.views[1][:] = raw[BLOCK:]
            assert c.commit(r).stored == stored
        m = reader.match(tok, lease=True)
        assert m.tiers == (kvtier.Tier.NONE,) * 3 + (kvtier.Tier.DRAM,) * 2
        assert reader.get(m.lease, first_page=3) == raw
        reader.release(m.lease)


def test_commit_carries_the_pages_sums(zd):
    """commit(r, sums): the XXH3-64 of each reserved page as written go with COMMIT (SUMS) where
    the reservation is ``sealed`` (zero-copy-checksum, the default); kvt_copy_pages_xxh3 takes
    them in the copy. The daemon records them without hashing the pages itself, and a socket
    GET, which checks every page against its sum, serves them. Bad sums are refused and the
    reservation is still held: none given, or not one per reserved page (checked here, and by
    the daemon for a bare id)."""
    from kvtier._lib import lib

    with zd.client() as c, zd.client(zero_copy=False) as reader:
        tok, raw = tokens(3), payload(3, 9)
        r = c.reserve(tok, 3)
        assert r.sealed and r.nreserved == 3
        src = np.frombuffer(raw, np.uint8)
        sums = np.zeros(3, np.uint64)
        spans = np.array([[_addr(v), src.ctypes.data + i * BLOCK, BLOCK]
                          for i, v in enumerate(r.views)], dtype=np.uint64)
        assert lib.kvt_copy_pages_xxh3(ffi.cast("kvt_copy_span_t *", spans.ctypes.data), 3, 1,
                                       ffi.cast("uint64_t *", sums.ctypes.data)) == 0
        before = c.stats()
        with pytest.raises(kvtier.InvalidArgument):
            c.commit(r, sums[:2])
        with pytest.raises(kvtier.InvalidArgument):
            c.commit(r, [])
        with pytest.raises(kvtier.InvalidArgument):
            c.commit(r.id, sums[:2])  # the daemon's count check
        assert reader.match(tok).tiers == (kvtier.Tier.NONE,) * 3, "a refused commit stored"
        assert c.commit(r, sums).stored == 3
        after = c.stats()
        assert after["zero_copy_client_sums"] - before["zero_copy_client_sums"] == 3
        assert after["zero_copy_seals"] == before["zero_copy_seals"]
        m = reader.match(tok, lease=True)
        assert reader.get(m.lease) == raw
        reader.release(m.lease)
        assert c.stats()["zero_copy_scribbles"] == after["zero_copy_scribbles"]


def test_abort_leaves_nothing_visible(zd):
    with zd.client() as c:
        tok = tokens(2)
        used = c.stats()["dram_used_bytes"]
        r = c.reserve(tok, 2)
        assert r.nreserved == 2
        r.views[0][:10] = b"x" * 10
        c.abort(r)
        assert c.match(tok).tiers == (kvtier.Tier.NONE,) * 2
        assert c.stats()["dram_used_bytes"] == used
        with pytest.raises(kvtier.NotFound):
            c.abort(r.id)
        with pytest.raises(kvtier.NotFound):
            c.commit(0x5EED)


def test_the_mapping_survives_many_calls_and_close_unmaps_it(zd):
    c = zd.client()
    base, size = c._mapping()
    assert _maps_at(base)
    tok, raw = tokens(2), payload(2, 7)
    c.put(tok, raw)
    out = np.zeros(2 * BLOCK, np.uint8)
    for _ in range(300):
        m = c.match(tok, lease=True)
        assert c.get_into(m.lease, out) == 2
        views = c.get_views(m.lease)
        assert _addr(views[0]) >= base
        c.release(m.lease)
    assert out.tobytes() == raw
    assert c.zero_copy and c._mapping() == (base, size)
    with open("/proc/self/maps") as f:
        assert sum(int(line.split("-", 1)[0], 16) == base for line in f) == 1
    c.close()
    assert not _maps_at(base), "close() unmapped the arena"


def test_keyed_calls_take_the_same_path(zd):
    with zd.client("zc-keys") as c, zd.client("zc-keys", zero_copy=False) as plain:
        keys = [b"k/%d" % i for i in range(3)]
        raw = payload(3, 8)
        r = c.put_keys(keys, raw)
        assert r.stored == 3
        for cl in (c, plain):
            out = bytearray(3 * BLOCK)
            assert cl.get_keys_into(keys, out) == 3
            assert bytes(out) == raw


def test_zero_copy_false_never_maps_in_any_call_form(zd):
    """A Client made with zero_copy=False never maps its arena, in any call form: its token
    calls (put, get, get_into, get_views), its keyed chain calls (put_keys, get_keys_into,
    get_keys_kept_into), its independent keys (put_keys_each, get_keys_each_into) and
    AsyncClient's keyed calls take no MAP and read no page by location, even pages a mapped
    client stored in the arena: every read is a socket GET, which checks the page's checksum.
    The same calls on a default client are the mapped path (the keyed calls' connection is
    libkvtier's kvt_keys_connect, which takes conf.zero_copy from the Client's conf)."""
    def stats():  # an observer that maps nothing itself
        with zd.client(zero_copy=False) as c:
            return c.stats()

    def delta(before):
        now = stats()
        return {k: now.get(k, 0) - before.get(k, 0) for k in
                ("zero_copy_maps_dram", "zero_copy_pages_get", "zero_copy_pages_reserve",
                 "requests_get")}

    def chunks(raw):
        return [raw[i:i + BLOCK] for i in range(0, len(raw), BLOCK)]

    def store(c, tag, raw):
        tok, keys = tokens(3), [b"%s/%d" % (tag, i) for i in range(3)]
        each = [b"%s/each/%d" % (tag, i) for i in range(3)]
        assert c.put(tok, raw).stored == 3
        assert c.put_keys(keys, raw).stored == 3
        assert c.put_keys_each(each, chunks(raw)) == [True] * 3
        return tok, keys, each, raw

    def read(c, tok, keys, each, raw):
        m = c.match(tok, lease=True)
        assert c.get(m.lease) == raw
        buf = bytearray(len(raw))
        assert c.get_into(m.lease, buf) == 3 and bytes(buf) == raw
        assert [bytes(v) for v in c.get_views(m.lease)] == chunks(raw)
        c.release(m.lease)
        for get in (c.get_keys_into, lambda k, b: c.get_keys_kept_into(k, b).hits):
            buf = bytearray(len(raw))
            assert get(keys, buf) == 3 and bytes(buf) == raw
        buf = bytearray(len(raw))
        assert c.get_keys_each_into(each, buf) == [True] * 3 and bytes(buf) == raw

    async def read_async(keys, raw):
        async with kvtier.AsyncClient("zc-never", unix_path=zd.unix, page_size=PAGE,
                                      block_bytes=BLOCK, zero_copy=False) as ac:
            assert not ac.zero_copy
            buf = bytearray(len(raw))
            assert await ac.get_keys_into(keys, buf) == 3 and bytes(buf) == raw

    with zd.client("zc-never") as on:  # the arenas exist, the mapped client's pages in them
        mapped = store(on, b"zc-never/on", payload(3, 61))
        before = stats()
        with zd.client("zc-never", zero_copy=False) as off:
            assert not off.zero_copy and "off" in off.zero_copy_reason
            plain = store(off, b"zc-never/off", payload(3, 62))
            for stored in (mapped, plain):
                read(off, *stored)
            assert off._kh is not None and not lib.kvt_client_zero_copy(
                lib.kvt_keys_client(off._kh)), "the keyed connection did not map"
        asyncio.run(read_async(mapped[1], mapped[3]))
        d = delta(before)
        assert d["zero_copy_maps_dram"] == 0 and d["zero_copy_pages_get"] == 0 and \
            d["zero_copy_pages_reserve"] == 0, d
        assert d["requests_get"] >= 2 * 6 + 1, d  # every read a socket GET
        before = stats()
        read(on, *mapped)
        d = delta(before)
        assert d["zero_copy_pages_get"] >= 3 * 6, d  # the default: read where the pages lie


def test_async_client_views_and_reservations(zd):
    async def main():
        async with kvtier.AsyncClient("pytest", unix_path=zd.unix, page_size=PAGE,
                                      block_bytes=BLOCK) as ac:
            assert ac.zero_copy
            tok, raw = tokens(2), payload(2, 9)
            r = await ac.reserve(tok, 2)
            for i, v in enumerate(r.views):
                v[:] = raw[i * BLOCK:(i + 1) * BLOCK]
            assert (await ac.commit(r)).stored == 2
            m = await ac.match(tok, lease=True)
            views = await ac.get_views(m.lease)
            assert b"".join(bytes(v) for v in views) == raw
            await ac.release(m.lease)
            r = await ac.reserve(tokens(1), 1)
            await ac.abort(r)
            # commit with sums, as Client.commit(r, sums)
            from kvtier._lib import lib

            r = await ac.reserve(tokens(1), 1)
            src, sums = np.frombuffer(raw[:BLOCK], np.uint8), np.zeros(1, np.uint64)
            span = np.array([[_addr(r.views[0]), src.ctypes.data, BLOCK]], dtype=np.uint64)
            assert lib.kvt_copy_pages_xxh3(ffi.cast("kvt_copy_span_t *", span.ctypes.data), 1,
                                           1, ffi.cast("uint64_t *", sums.ctypes.data)) == 0
            before = (await ac.stats())["zero_copy_client_sums"]
            assert (await ac.commit(r, sums)).stored == 1
            assert (await ac.stats())["zero_copy_client_sums"] == before + 1

    asyncio.run(main())
