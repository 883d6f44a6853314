"""test_lmcache.py: kvtier.lmcache, the LMCache remote storage plugin, against a real kvtierd and
LMCache's own classes (LMCacheEngineConfig, LMCacheMetadata, LocalCPUBackend, MemoryObj, the
plugin loader CreateConnector and its InstrumentedRemoteConnector wrapper). Skipped, saying
why, when lmcache is not installed (scripts/engines/lmcache.sh)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Dict, Iterator, Tuple

import pytest

from conftest import BUILD_ROOT, SOURCE_ROOT, Daemon, STALL_SLACK
from relay import UnixRelay

try:
    import torch
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.memory_management import MemoryFormat
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.connector import CreateConnector
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
except Exception as e:  # noqa: BLE001: any import failure means "not installed here"
    pytest.skip("lmcache is not importable (%s: %s); scripts/engines/lmcache.sh installs it, its "
                "log is %s" % (type(e).__name__, e, os.path.join(BUILD_ROOT, "pyenv",
                                                              "engine-lmcache.log")),
                allow_module_level=True)

import kvtier  # noqa: E402
import kvtier.lmcache as klm  # noqa: E402

CHUNK = 16  # tokens per LMCache chunk
SHAPE = (2, 2, CHUNK, 2, 8)  # (layers, K/V, chunk tokens, kv heads, head size): 2 KiB in bf16
MODEL = "pytest/lmcache-model"


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """The event loop LMCache runs connector coroutines on, in a thread of its own."""
    lp = asyncio.new_event_loop()
    t = threading.Thread(target=lp.run_forever, daemon=True)
    t.start()
    yield lp
    lp.call_soon_threadsafe(lp.stop)
    t.join(5)
    lp.close()


def run(loop: asyncio.AbstractEventLoop, coro: Any, timeout: float = 20) -> Any:
    return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)


def lmc_config(daemon: Daemon, names: Tuple[str, ...] = ("kvtier",), lmc: Any = None,
               **extra: Any) -> Any:
    """LMCache's config with the plugin under each of `names` (its settings `extra` under each),
    and LMCacheEngineConfig's own settings `lmc`."""
    ec: Dict[str, Any] = {}
    for name in names:
        p = "remote_storage_plugin.%s." % name
        ec.update({p + "module_path": "kvtier.lmcache", p + "class_name": "KvtierConnector",
                   p + "unix_path": daemon.unix})
        ec.update({p + k: v for k, v in extra.items()})
    kw = dict(chunk_size=CHUNK, local_cpu=True, max_local_cpu_size=0.02)
    kw.update(lmc or {})
    return LMCacheEngineConfig.from_defaults(remote_storage_plugins=list(names), extra_config=ec,
                                             **kw)


def lmc_metadata(model: str = MODEL, worker: int = 0) -> Any:
    return LMCacheMetadata(model_name=model, world_size=2, local_world_size=2, worker_id=worker,
                           local_worker_id=worker, kv_dtype=torch.bfloat16, kv_shape=SHAPE,
                           chunk_size=CHUNK)


def connector(daemon: Daemon, loop: asyncio.AbstractEventLoop, **extra: Any) -> Tuple[Any, Any]:
    """(LMCache's wrapped connector, its LocalCPUBackend), built the way LMCache's RemoteBackend
    builds a plugin: CreateConnector("plugin://kvtier", ...) from the config alone."""
    cfg = lmc_config(daemon, **extra)
    md = lmc_metadata()
    be = LocalCPUBackend(cfg, md)
    conn = CreateConnector("plugin://kvtier", loop, be, cfg, md, plugin_name="kvtier")
    return conn, be


_hash = [0x5EED0000]


def key(model: str = MODEL, worker: int = 0, chunk_hash: int = 0) -> Any:
    if not chunk_hash:
        _hash[0] += 1
        chunk_hash = _hash[0]
    return CacheEngineKey(model, 2, worker, chunk_hash, torch.bfloat16)


def chunk(be: Any) -> Tuple[Any, bytes]:
    """A MemoryObj from the backend holding a random full chunk, and a copy of its bytes."""
    o = be.allocate([torch.Size([2, SHAPE[0], CHUNK, SHAPE[3] * SHAPE[4]])], [torch.bfloat16],
                    MemoryFormat.KV_2LTD)
    assert o is not None
    o.tensor.copy_(torch.randn(o.tensor.shape, dtype=torch.float32).to(torch.bfloat16))
    return o, bytes(o.byte_array)


def step_once(loop: asyncio.AbstractEventLoop, coro: Any) -> Tuple[bool, Any]:
    """Steps a coroutine once on the loop: (True, its result) when it ran to its end, else
    (False, None) (it awaited something: closed)."""
    async def once() -> Tuple[bool, Any]:
        try:
            coro.send(None)
        except StopIteration as e:
            return True, e.value
        coro.close()
        return False, None
    return run(loop, once())


def put(loop: asyncio.AbstractEventLoop, conn: Any, k: Any, o: Any) -> None:
    """As LMCache's RemoteBackend does: a reference for the put, which the wrapper drops."""
    o.ref_count_up()
    run(loop, conn.put(k, o))


def active(be: Any) -> int:
    """MemoryObjs the backend's allocator has out (to see that a miss frees its buffer)."""
    return int(be.memory_allocator.pin_allocator.num_active_allocations)


def test_import_needs_no_engine() -> None:
    code = ("import sys; sys.path.insert(0, %r); import kvtier, kvtier.lmcache; "
            "assert 'lmcache' not in sys.modules, 'kvtier.lmcache imported lmcache'"
            % os.path.join(SOURCE_ROOT, "python"))
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_loaded_from_config(daemon: Daemon, loop: asyncio.AbstractEventLoop) -> None:
    conn, be = connector(daemon, loop)
    inner = conn._connector  # LMCache's InstrumentedRemoteConnector wraps every connector
    assert type(inner).__name__ == "KvtierConnector"
    assert type(inner).__module__ == "kvtier.lmcache"
    assert inner.block_bytes == 2 * SHAPE[0] * CHUNK * SHAPE[3] * SHAPE[4] * 2
    assert inner.kvtier_model == "lmcache/%s/KV_2LTD/%d" % (MODEL, inner.block_bytes)
    assert run(loop, conn.ping()) == 0
    assert run(loop, conn.list()) == []
    run(loop, conn.close())


def test_put_get_byte_exact(daemon: Daemon, loop: asyncio.AbstractEventLoop) -> None:
    conn, be = connector(daemon, loop)
    k = key()
    assert not run(loop, conn.exists(k))
    o, want = chunk(be)
    put(loop, conn, k, o)
    # The wrapper dropped the put's reference and the connector none: the caller's is left.
    assert o.get_ref_count() == 1
    assert run(loop, conn.exists(k)) and conn.exists_sync(k)
    got = run(loop, conn.get(k))
    assert got is not None and got is not o
    assert got.get_ref_count() == 1
    assert got.raw_data.data_ptr() != o.raw_data.data_ptr()
    assert bytes(got.byte_array) == want
    assert torch.equal(got.tensor, o.tensor)
    assert got.meta.fmt == MemoryFormat.KV_2LTD and got.meta.dtype == torch.bfloat16
    o.ref_count_down()
    got.ref_count_down()
    assert o.get_ref_count() == 0 and got.get_ref_count() == 0
    run(loop, conn.close())


def test_other_model_or_worker_misses(daemon: Daemon, loop: asyncio.AbstractEventLoop) -> None:
    conn, be = connector(daemon, loop)
    k = key()
    o, _ = chunk(be)
    put(loop, conn, k, o)
    o.ref_count_down()
    before = active(be)
    for other in (key(model="pytest/another-model", chunk_hash=k.chunk_hash),
                  key(worker=1, chunk_hash=k.chunk_hash),
                  CacheEngineKey(MODEL, 2, 0, k.chunk_hash, torch.float16)):
        assert not run(loop, conn.exists(other))
        assert run(loop, conn.get(other)) is None
    assert active(be) == before, "a miss left its MemoryObj allocated"
    assert run(loop, conn.exists(k))
    run(loop, conn.close())


def test_batched(daemon: Daemon, loop: asyncio.AbstractEventLoop) -> None:
    conn, be = connector(daemon, loop)
    inner = conn._connector
    assert inner.support_batched_put() and inner.support_batched_get()
    assert inner.support_batched_contains() and inner.support_batched_async_contains()
    ks = [key() for _ in range(4)]
    objs = [chunk(be) for _ in range(4)]
    stored = [0, 1, 3]  # key 2 is never stored
    for i in stored:
        objs[i][0].ref_count_up()
    run(loop, conn.batched_put([ks[i] for i in stored], [objs[i][0] for i in stored]))
    assert all(o.get_ref_count() == 1 for o, _ in objs)
    assert inner.batched_contains(ks) == 2
    assert run(loop, conn.batched_async_contains("lookup-1", ks)) == 2
    before = active(be)
    got = run(loop, conn.batched_get(ks))
    assert [g is not None for g in got] == [True, True, False, True]
    for i in stored:
        assert bytes(got[i].byte_array) == objs[i][1]
        got[i].ref_count_down()
    assert active(be) == before, "the miss's MemoryObj was not freed"
    assert inner.remove_sync(ks[0]) and not run(loop, conn.exists(ks[0]))
    for o, _ in objs:
        o.ref_count_down()
    run(loop, conn.close())


def test_calls_run_on_lmcaches_loop(daemon: Daemon, loop: asyncio.AbstractEventLoop) -> None:
    """The connector's coroutines (put, get, contains, ping) do their work on the thread that
    awaits them, LMCache's event loop, starting no thread of their own: a hop to an executor
    and back cost two wake-ups a call (docs/benchmarks.md, "LMCache's thread hops")."""
    conn, be = connector(daemon, loop)
    ks = [key(), key()]
    objs = [chunk(be) for _ in ks]
    before = set(threading.enumerate())
    for o, _ in objs:
        o.ref_count_up()
    run(loop, conn.batched_put(ks, [o for o, _ in objs]))
    put(loop, conn, ks[0], objs[0][0])
    assert run(loop, conn.batched_async_contains("lookup-t", ks)) == 2
    assert run(loop, conn.exists(ks[1]))
    assert run(loop, conn.ping()) == 0
    got = run(loop, conn.batched_get(ks))
    assert [bytes(g.byte_array) for g in got] == [want for _, want in objs]
    started = [t.name for t in set(threading.enumerate()) - before]
    assert started == [], "the connector's calls started threads: %s" % started
    for g in got:
        g.ref_count_down()
    for o, _ in objs:
        o.ref_count_down()
    run(loop, conn.close())


def test_batched_calls_cost_what_the_keyed_calls_cost(daemon: Daemon,
                                                      loop: asyncio.AbstractEventLoop) -> None:
    """Issue 35: the connector's batched_put and batched_get of 8 chunks, through a relay that
    counts the round trips, take the same round trips as the package's keyed calls of the same
    bytes under the same key strings (Client.put_keys_each, get_keys_each_into): no lookup
    (MATCH) before the put, nothing per chunk. And each coroutine finishes without suspending
    (stepped once, it returns): no hop to a thread of the connector's own on LMCache's loop."""
    assert daemon.unix
    relay = UnixRelay(daemon.unix)
    try:
        conn, be = connector(daemon, loop, unix_path=relay.addr)
        inner = conn._connector
        n = 8
        ks = [key() for _ in range(n)]
        objs = [chunk(be) for _ in range(n)]
        assert not run(loop, conn.exists(ks[0]))  # connects (and maps the arena) first
        for o, _ in objs:
            o.ref_count_up()
        relay.turns, relay.matches = 0, []
        run(loop, conn.batched_put(ks, [o for o, _ in objs]))
        put_turns, put_matches = relay.turns, list(relay.matches)
        relay.turns = 0
        got = run(loop, conn.batched_get(ks))
        get_turns = relay.turns
        assert [bytes(g.byte_array) for g in got] == [want for _, want in objs]
        for g in got:
            g.ref_count_down()

        # The same calls of the package, their bytes and key strings, in a namespace of its
        # own on the same relay.
        names = [klm.key_string(k) for k in ks]
        with kvtier.Client("pytest/lmcache-keyed", page_size=kvtier.KEY_TOKENS,
                           block_bytes=inner.block_bytes, unix_path=relay.addr,
                           timeout_ms=10000) as c:
            assert c.exists_keys_each(names[:1]) == [False]
            relay.turns, relay.matches = 0, []
            assert c.put_keys_each(names, [want for _, want in objs]) == [True] * n
            keyed_put_turns, keyed_put_matches = relay.turns, list(relay.matches)
            out = [bytearray(inner.block_bytes) for _ in range(n)]
            relay.turns = 0
            assert c.get_keys_each_into(names, out) == [True] * n
            keyed_get_turns = relay.turns
        assert put_turns == keyed_put_turns, (put_turns, keyed_put_turns)
        assert put_matches == keyed_put_matches == [], "a lookup before the put"
        assert get_turns == keyed_get_turns, (get_turns, keyed_get_turns)

        # Stepped once on LMCache's loop, each coroutine runs to its end (inner's, without
        # LMCache's wrapper, which would drop the put's references).
        done, _ = step_once(loop, inner.batched_put(ks, [o for o, _ in objs]))
        assert done, "batched_put suspended: it waits for another thread"
        done, got = step_once(loop, inner.batched_get(ks))
        assert done, "batched_get suspended: it waits for another thread"
        assert [bytes(g.byte_array) for g in got] == [want for _, want in objs]
        for g in got:
            g.ref_count_down()
        for o, _ in objs:
            o.ref_count_down()
        run(loop, conn.close())
    finally:
        relay.close()


def test_allocator_close_waits_for_the_call_in_progress(loop: asyncio.AbstractEventLoop) -> None:
    """LMCache closes LocalCPUBackend's allocator (freeing every MemoryObj's memory) from its
    own thread while a get may be running on its event loop: the close waits for that call
    (here held by a SIGSTOPped daemon until its deadline), which gives back its MemoryObjs
    first; later calls answer misses without touching the freed memory."""
    d = Daemon()
    try:
        conn, be = connector(d, loop, deadline_ms=400, probe_ms=50)
        ks = [key(), key()]
        for k in ks:
            o, _ = chunk(be)
            put(loop, conn, k, o)
            o.ref_count_down()
        d.freeze()
        try:
            fut = asyncio.run_coroutine_threadsafe(conn.batched_get(ks), loop)
            # Until the get holds the connector's work lock: it is waiting for the daemon.
            assert _wait_until(conn._connector._work.locked, 5)
            t0 = time.perf_counter()
            be.memory_allocator.close()
            waited = time.perf_counter() - t0
            # The get waits for the daemon until its deadline, 0.4 s from its start, just
            # before the close: the close waited for it.
            assert waited >= 0.2, "the allocator closed while a get was using its memory"
            assert fut.result(5) == [None, None]
            assert run(loop, conn.batched_get(ks)) == [None, None]
        finally:
            os.kill(d.proc.pid, signal.SIGCONT)
        run(loop, conn.close())
    finally:
        d.stop(signal.SIGKILL)


def test_partial_chunk_is_a_failed_put(daemon: Daemon, loop: asyncio.AbstractEventLoop) -> None:
    """A partial chunk is not stored, and says so: put raises PutFailed (LMCache's failure
    path), the connector counts it; the wrapper still drops the put's reference."""
    conn, be = connector(daemon, loop)
    o = be.allocate([torch.Size([2, SHAPE[0], CHUNK // 2, SHAPE[3] * SHAPE[4]])],
                    [torch.bfloat16], MemoryFormat.KV_2LTD)
    k = key()
    with pytest.raises(klm.PutFailed, match="not a full chunk") as ei:
        put(loop, conn, k, o)
    assert ei.value.chunks == 1 and conn._connector.failed_puts == 1
    assert o.get_ref_count() == 1
    assert not run(loop, conn.exists(k))
    o.ref_count_down()
    run(loop, conn.close())


def test_daemon_dies_mid_get(loop: asyncio.AbstractEventLoop) -> None:
    """A daemon that stops answering during a get, then dies: every call answers a miss (no
    exception reaches LMCache), the MemoryObj allocated for the get is freed."""
    d = Daemon()
    try:
        conn, be = connector(d, loop, deadline_ms=300, probe_ms=100)
        ks = [key(), key()]
        objs = [chunk(be) for _ in ks]
        for k, (o, _) in zip(ks, objs):
            put(loop, conn, k, o)
            o.ref_count_down()
        assert conn._connector.batched_contains(ks) == 2
        before = active(be)
        d.freeze()  # mid-get: the daemon takes the request, never answers
        try:
            assert run(loop, conn.get(ks[0])) is None
            assert run(loop, conn.batched_get(ks)) == [None, None]
        finally:
            os.kill(d.proc.pid, signal.SIGKILL)
            os.kill(d.proc.pid, signal.SIGCONT)
            d.proc.wait(10)
        assert active(be) == before, "a failed get left its MemoryObj allocated"
        assert not run(loop, conn.exists(ks[0]))
        assert not conn._connector.exists_sync(ks[0])
        assert conn._connector.batched_contains(ks) == 0
        assert run(loop, conn.ping()) != 0
        o, _ = chunk(be)
        with pytest.raises(klm.PutFailed):  # not stored: LMCache counts a failed put
            put(loop, conn, ks[0], o)
        assert o.get_ref_count() == 1
        o.ref_count_down()
        assert conn._connector.remove_sync(ks[0]) is False
        run(loop, conn.close())
    finally:
        d.stop(signal.SIGKILL)


def test_reconnects_after_restart(loop: asyncio.AbstractEventLoop) -> None:
    d = Daemon()
    conn = None
    try:
        conn, be = connector(d, loop, probe_ms=50)
        assert run(loop, conn.ping()) == 0
        unix = d.unix
        d.stop(signal.SIGKILL)
        assert run(loop, conn.ping()) != 0
        d = Daemon()
        # The config names the old socket path: point the connector at the new daemon.
        conn._connector.settings["unix_path"] = d.unix
        assert unix != d.unix
        deadline = 50
        while run(loop, conn.ping()) != 0 and deadline:
            deadline -= 1
            threading.Event().wait(0.05)
        assert run(loop, conn.ping()) == 0
        k = key()
        o, want = chunk(be)
        put(loop, conn, k, o)
        o.ref_count_down()
        got = run(loop, conn.get(k))
        assert got is not None and bytes(got.byte_array) == want
        got.ref_count_down()
    finally:
        if conn is not None:
            run(loop, conn.close())
        d.stop(signal.SIGKILL)


def test_no_daemon_no_exception(loop: asyncio.AbstractEventLoop, tmp_path: Any) -> None:
    class Nowhere:
        unix = str(tmp_path / "no-such.sock")
    conn, be = connector(Nowhere(), loop)  # type: ignore[arg-type]
    k = key()
    assert not run(loop, conn.exists(k))
    assert run(loop, conn.get(k)) is None
    assert run(loop, conn.batched_get([k, key()])) == [None, None]
    run(loop, conn.close())


def test_settings_defaults() -> None:
    class Cfg:
        extra_config = {"remote_storage_plugin.kvtier.tcp": "127.0.0.1:7000",
                        "remote_storage_plugin.kvtier.deadline_ms": "250"}
    s = klm.settings(Cfg())
    assert s["tcp"] == "127.0.0.1:7000" and s["deadline_ms"] == 250
    assert s["unix_path"] is None and s["namespace"] == "lmcache" and s["probe_ms"] == 200
    long_key = CacheEngineKey("m" * 2000, 1, 0, 7, torch.bfloat16)
    assert klm.key_string(long_key).startswith("sha256:")
    assert klm.key_string(key(chunk_hash=0xabc)) == "%s@2@0@%s@bfloat16" % (
        MODEL, key(chunk_hash=0xabc).chunk_hash_hex)


# -- end to end: LMCacheEngine with the plugin loaded from its config ----------------------------

L, KVH, HD = SHAPE[0], SHAPE[3], SHAPE[4]


def _gpu_connector(shape: Tuple[int, ...] = SHAPE) -> Any:
    """LMCache's GPUConnectorInterface for a KV cache that is one CPU tensor kv[layer, K/V,
    token, head, dim]: the engine side of LMCache (its own connectors are CUDA kernels for
    vLLM's or SGLang's paged GPU memory). It copies between that tensor and LMCache's chunk
    MemoryObjs ([K/V, layer, token, head x dim], KV_2LTD)."""
    from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface

    L, KVH, HD = shape[0], shape[3], shape[4]

    class CPUConnector(GPUConnectorInterface):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            self.kvcaches = None

        def from_gpu(self, o: Any, start: int, end: int, **kw: Any) -> None:
            kv = kw["kvcaches"][:, :, start:end]
            o.tensor.copy_(kv.permute(1, 0, 2, 3, 4).reshape(o.tensor.shape))

        def to_gpu(self, o: Any, start: int, end: int, **kw: Any) -> None:
            t = o.tensor.reshape(2, L, end - start, KVH, HD).permute(1, 0, 2, 3, 4)
            kw["kvcaches"][:, :, start:end] = t

        def batched_from_gpu(self, objs: Any, starts: Any, ends: Any, **kw: Any) -> None:
            for o, s, e in zip(objs, starts, ends):
                self.from_gpu(o, s, e, **kw)

        def batched_to_gpu(self, objs: Any, starts: Any, ends: Any, **kw: Any) -> None:
            for o, s, e in zip(objs, starts, ends):
                self.to_gpu(o, s, e, **kw)

        def get_shape(self, num_tokens: int) -> Any:
            return torch.Size([2, L, num_tokens, KVH * HD])

    return CPUConnector()


_engines = [0]


def lmcache_engine(daemon: Daemon, shape: Tuple[int, ...] = SHAPE,
                   names: Tuple[str, ...] = ("kvtier",), md_chunk: Any = CHUNK,
                   lmc: Any = None, **extra: Any) -> Tuple[str, Any]:
    """A fresh LMCacheEngine (its own StorageManager and LocalCPUBackend) whose remote backend
    is the kvtier plugin, named in the config only (under each of `names`). `md_chunk` is the
    metadata's chunk_size; None leaves LMCacheMetadata's default, as LMCache's SGLang adapter
    does. These engines check what is stored and loaded, not timing: each call gets a deadline
    of 2 s unless `extra` names one (the stall tests check the 100 ms default), so that a loaded
    2-core machine turns no put into a dropped one."""
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    extra.setdefault("deadline_ms", 2000)

    _engines[0] += 1
    iid = "pytest-kvtier-%d-%d" % (os.getpid(), _engines[0])
    kw = {} if md_chunk is None else {"chunk_size": md_chunk}
    md = LMCacheMetadata(model_name=MODEL, world_size=1, local_world_size=1, worker_id=0,
                         local_worker_id=0, kv_dtype=torch.bfloat16, kv_shape=shape, **kw)
    e = LMCacheEngineBuilder.get_or_create(iid, lmc_config(daemon, names, lmc, **extra), md,
                                           _gpu_connector(shape), lambda t, r: None,
                                           lambda o, r: o)
    e.post_init()
    for name in names:
        assert "RemoteBackend-" + name in e.storage_manager.storage_backends
    return iid, e


def remote(e: Any, name: str = "kvtier") -> Any:
    """The engine's RemoteBackend of plugin `name`."""
    return e.storage_manager.storage_backends["RemoteBackend-" + name]


def destroy(iid: str) -> None:
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    LMCacheEngineBuilder.destroy(iid)


def wait_remote(e: Any, tokens: Any, want: int, name: str = "kvtier") -> int:
    """Waits (2 s at most) until the engine's remote backend holds `want` tokens of the prompt:
    LMCache's puts to remote storage are asynchronous."""
    n = 0
    for _ in range(40):
        n = e.lookup(tokens, search_range=["RemoteBackend-" + name])
        if n >= want:
            break
        threading.Event().wait(0.05)
    return int(n)


def test_engine_store_then_retrieve(daemon: Daemon) -> None:
    """A prompt's KV stored through one LMCacheEngine is retrieved byte-exact by another (its
    own, empty local CPU cache: the bytes come from kvtierd) into a different KV tensor; a
    prompt differing in its first token retrieves nothing."""
    T = 4 * CHUNK
    tokens = torch.arange(50_000, 50_000 + T)
    kv = torch.randn(L, 2, T, KVH, HD).to(torch.bfloat16)
    a, ea = lmcache_engine(daemon)
    try:
        ea.store(tokens, kvcaches=kv)
        assert wait_remote(ea, tokens, T) == T
    finally:
        destroy(a)
    b, eb = lmcache_engine(daemon)
    try:
        assert eb.lookup(tokens) == T
        kv2 = torch.zeros_like(kv)
        got = eb.retrieve(tokens, kvcaches=kv2)
        assert int(got.sum()) == T
        assert torch.equal(kv2, kv)
        other = tokens.clone()
        other[0] += 1
        kv3 = torch.zeros_like(kv)
        assert eb.lookup(other) == 0
        assert int(eb.retrieve(other, kvcaches=kv3).sum()) == 0
        assert not kv3.any()
    finally:
        destroy(b)


def test_engine_daemon_gone(loop: asyncio.AbstractEventLoop) -> None:
    """kvtierd killed between store and retrieve: LMCache is told nothing is there, retrieves
    nothing, raises nothing, and leaves the KV tensor as it was (the engine recomputes)."""
    d = Daemon()
    T = 2 * CHUNK
    tokens = torch.arange(60_000, 60_000 + T)
    kv = torch.randn(L, 2, T, KVH, HD).to(torch.bfloat16)
    try:
        a, ea = lmcache_engine(d)
        try:
            ea.store(tokens, kvcaches=kv)
            assert wait_remote(ea, tokens, T) == T
        finally:
            destroy(a)
        b, eb = lmcache_engine(d)
        try:
            d.proc.send_signal(signal.SIGKILL)
            d.proc.wait(10)
            kv2 = torch.zeros_like(kv)
            assert eb.lookup(tokens) == 0
            assert int(eb.retrieve(tokens, kvcaches=kv2).sum()) == 0
            assert not kv2.any()
        finally:
            destroy(b)
    finally:
        d.stop(signal.SIGKILL)


def test_engine_closed_with_puts_queued(daemon: Daemon) -> None:
    """LMCache closes LocalCPUBackend (freeing every MemoryObj's memory) before its remote
    backends; the plugin's puts still queued then must not read freed memory (a segfault of
    the whole process before the plugin held the allocator's close for them)."""
    for i in range(2):
        T = 8 * CHUNK
        tokens = torch.arange(70_000 + i * T, 70_000 + (i + 1) * T)
        kv = torch.randn(L, 2, T, KVH, HD).to(torch.bfloat16)
        a, ea = lmcache_engine(daemon)
        ea.store(tokens, kvcaches=kv)
        destroy(a)  # at once: puts are in flight


def test_the_readme_config(daemon: Daemon, loop: asyncio.AbstractEventLoop, tmp_path: Any) -> None:
    """The README's LMCache config block, as a file LMCache reads (LMCacheEngineConfig.from_file),
    with the daemon's socket put in, selects and builds the plugin."""
    import re

    import yaml

    text = open(os.path.join(os.path.dirname(__file__), "..", "..", "README.md")).read()
    block = re.search(r"```yaml\n(.*?)```", text[text.index("remote storage plugin"):], re.S)
    assert block is not None
    conf = yaml.safe_load(block.group(1))
    conf["extra_config"]["remote_storage_plugin.kvtier.unix_path"] = daemon.unix
    conf.update(chunk_size=CHUNK, max_local_cpu_size=0.02)
    path = tmp_path / "lmcache.yaml"
    path.write_text(yaml.safe_dump(conf))
    cfg = LMCacheEngineConfig.from_file(str(path))
    md = lmc_metadata()
    be = LocalCPUBackend(cfg, md)
    conn = CreateConnector("plugin://kvtier", loop, be, cfg, md, plugin_name="kvtier")
    assert type(conn._connector).__name__ == "KvtierConnector"
    assert run(loop, conn.ping()) == 0
    run(loop, conn.close())


def test_engine_end_to_end_tiny_model(daemon: Daemon) -> None:
    """The tiny model's prompt KV, gathered from its paged KV after the prefill, is stored by one
    LMCacheEngine; another (its own, empty local CPU cache: the bytes come from kvtierd)
    retrieves the prompt's whole chunks into a fresh KV tensor, which fills fresh paged KV; the
    model computes only the rest: the same greedy output as everything recomputed."""
    import tiny_model as tm

    assert tm.BS == CHUNK
    shape = (tm.LAYERS, 2, CHUNK, tm.HEADS, tm.HEAD)
    model = tm.TinyModel(seed=13)
    toks = [80_000 + i for i in range(3 * CHUNK + 9)]  # 3 whole chunks and a partial one
    T, steps = len(toks), 6
    table_a, table_b = [6, 13, 0, 21, 9], [18, 2, 27, 5, 11]
    ref = tm.generate(model, toks, steps, table_a)

    def tokens_kv(kvc: Any, table: Any, n: int) -> torch.Tensor:
        """The first n positions of the paged KV as the engine's KV tensor (layer, K/V, token,
        head, dim)."""
        at = tm.slots(table, n)
        return torch.stack([c.view(2, tm.NBLOCKS * tm.BS, tm.HEADS, tm.HEAD)[:, at]
                            for c in kvc.values()])

    # Run A: prefill, store the prompt's KV (LMCache keeps its whole chunks), decode.
    a, ea = lmcache_engine(daemon, shape)
    try:
        kvc = tm.paged_kv(None)
        logits = model.forward(toks, 0, kvc, table_a)
        ea.store(torch.tensor(toks), kvcaches=tokens_kv(kvc, table_a, T))
        assert wait_remote(ea, torch.tensor(toks), 3 * CHUNK) == 3 * CHUNK
        assert tm.same_output(tm.decode(model, logits, T, kvc, table_a, steps), ref)
    finally:
        destroy(a)
    # Run B: another engine, fresh KV; retrieves the whole chunks, computes the rest.
    b, eb = lmcache_engine(daemon, shape)
    try:
        hit = int(eb.lookup(torch.tensor(toks)))
        assert hit == 3 * CHUNK
        kv = torch.zeros(tm.LAYERS, 2, hit, tm.HEADS, tm.HEAD, dtype=tm.DTYPE)
        assert int(eb.retrieve(torch.tensor(toks[:hit]), kvcaches=kv).sum()) == hit
        kvc = tm.paged_kv(None)
        at = tm.slots(table_b, hit)
        for c, layer in zip(kvc.values(), kv):
            c.view(2, tm.NBLOCKS * tm.BS, tm.HEADS, tm.HEAD)[:, at] = layer
        logits = model.forward(toks[hit:], hit, kvc, table_b)
        assert tm.same_output(tm.decode(model, logits, T, kvc, table_b, steps), ref)
    finally:
        destroy(b)


# -- never stall the engine: deadlines, the circuit breaker, settings refused ----------------


def _wait_until(cond: Any, timeout: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _calls(loop: asyncio.AbstractEventLoop, conn: Any, be: Any, ks: list) -> Tuple[float, tuple]:
    """LMCache's lookups (on its caller's thread), a get and a put: (seconds, answers)."""
    o, _ = chunk(be)
    t0 = time.perf_counter()
    a = conn._connector.exists_sync(ks[0])
    n = conn._connector.batched_contains(ks)
    got = run(loop, conn.batched_get(ks))
    o.ref_count_up()
    try:
        run(loop, conn.put(key(), o))
    except klm.PutFailed:
        pass  # a chunk not stored is a failed put: LMCache's own failure path
    took = time.perf_counter() - t0
    o.ref_count_down()
    for g in got:
        if g is not None:
            g.ref_count_down()
    return took, (a, n, sum(g is not None for g in got))


def test_calls_bounded_when_daemon_hangs(loop: asyncio.AbstractEventLoop, tmp_path: Any) -> None:
    """The daemon SIGSTOPped: with the default deadline (deadline_ms 100), LMCache's calls take
    no longer than with no daemon, plus the deadline, plus 20 ms, and answer misses (the
    breaker answers later calls at once); after SIGCONT the background probe reconnects and
    the chunks are hits again."""
    class Nowhere:
        unix = str(tmp_path / "no-such.sock")
    d = Daemon()
    try:
        none, nbe = connector(Nowhere(), loop)  # type: ignore[arg-type]
        ks = [key(), key()]
        base = max(_calls(loop, none, nbe, ks)[0] for _ in range(3))
        run(loop, none.close())
        conn, be = connector(d, loop, probe_ms=20)
        assert conn._connector.settings["deadline_ms"] == 100
        for k in ks:
            o, _ = chunk(be)
            put(loop, conn, k, o)
            o.ref_count_down()
        assert conn._connector.batched_contains(ks) == 2
        before = active(be)
        d.freeze()
        try:
            for _ in range(3):
                took, answers = _calls(loop, conn, be, ks)
                assert answers == (False, 0, 0)
                assert took <= base + 0.100 + STALL_SLACK, (took, base)
            st = conn._connector.kvtier_stats()
            assert st["trips"] == 1 and st["short_circuited"] >= 3
        finally:
            os.kill(d.proc.pid, signal.SIGCONT)
        assert active(be) == before, "a get that missed left its MemoryObj allocated"
        assert _wait_until(lambda: conn._connector.batched_contains(ks) == 2)
        assert conn._connector.kvtier_stats()["recoveries"] == 1
        run(loop, conn.close())
    finally:
        d.stop(signal.SIGKILL)


def test_daemon_not_up_at_start(loop: asyncio.AbstractEventLoop, tmp_path: Any,
                                caplog: Any) -> None:
    """The connector built before kvtierd: misses with one warning line however many calls
    (all counted), and hits once the daemon is up, reached by the background probe."""
    class Later:
        unix = str(tmp_path / "later.sock")
    with caplog.at_level("WARNING", logger="kvtier.lmcache"):
        conn, be = connector(Later(), loop, probe_ms=20)  # type: ignore[arg-type]
        k = key()
        for _ in range(10):
            o, _ = chunk(be)
            with pytest.raises(klm.PutFailed):  # not stored: a failed put, no stall
                put(loop, conn, k, o)
            o.ref_count_down()
            assert not conn._connector.exists_sync(k)
    lines = [r for r in caplog.records if r.name == "kvtier.lmcache"]
    assert len(lines) == 1, [r.getMessage() for r in lines]
    assert conn._connector.kvtier_stats()["trips"] == 1
    d = Daemon("--unix", Later.unix)
    try:
        assert _wait_until(lambda: conn._connector.kvtier_stats()["recoveries"] == 1)
        o, want = chunk(be)
        put(loop, conn, k, o)
        o.ref_count_down()
        got = run(loop, conn.get(k))
        assert got is not None and bytes(got.byte_array) == want
        got.ref_count_down()
        run(loop, conn.close())
    finally:
        d.stop(signal.SIGKILL)


@pytest.mark.parametrize("bad, names", [
    ({"unix_pth": "/x"}, "'unix_pth'"),
    ({"timeout_ms": 5000}, "deadline_ms"),
    ({"retry_ms": 0}, "probe_ms"),
    ({"deadline_ms": "soon"}, "deadline_ms"),
    ({"probe_ms": 0}, "probe_ms"),
])
def test_wrong_settings_refused_at_start(loop: asyncio.AbstractEventLoop, tmp_path: Any,
                                         bad: dict, names: str) -> None:
    """A key under remote_storage_plugin.kvtier. that the plugin does not read (a typo, or a
    replaced one), or a malformed number: LMCache's plugin loader fails with the key named."""
    class Nowhere:
        unix = str(tmp_path / "no-such.sock")
    with pytest.raises(ValueError, match=names):
        connector(Nowhere(), loop, **bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["kvt", "kvtier.a"])
def test_plugin_under_another_name(daemon: Daemon, name: str) -> None:
    """The plugin named anything LMCache accepts (`kvt`; LMCache's `type.instance` form
    `kvtier.a`) reads its settings under that name: an engine's prompt reaches kvtierd (its
    pages there, no failed put) and another engine retrieves it byte-exact."""
    T = 3 * CHUNK
    tokens = torch.arange(90_000 + len(name) * 1000, 90_000 + len(name) * 1000 + T)
    kv = torch.randn(L, 2, T, KVH, HD).to(torch.bfloat16)
    a, ea = lmcache_engine(daemon, names=(name,), namespace="ns-" + name)
    try:
        with daemon.client() as c:
            before = c.stats()["put_pages_stored"]
        ea.store(tokens, kvcaches=kv)
        assert wait_remote(ea, tokens, T, name) == T
        inner = remote(ea, name).connection.getWrappedConnector()
        assert inner.plugin_name == name and inner.settings["unix_path"] == daemon.unix
        assert inner.kvtier_model.startswith("ns-%s/" % name)
        with daemon.client() as c:
            assert c.stats()["put_pages_stored"] >= before + 3
        assert remote(ea, name).put_failed_count == 0 and inner.failed_puts == 0
    finally:
        destroy(a)
    b, eb = lmcache_engine(daemon, names=(name,), namespace="ns-" + name)
    try:
        kv2 = torch.zeros_like(kv)
        assert int(eb.retrieve(tokens, kvcaches=kv2).sum()) == T
        assert torch.equal(kv2, kv)
    finally:
        destroy(b)


def test_two_instances_of_the_plugin(daemon: Daemon) -> None:
    """One config, the plugin twice (`kvtier.a`, `kvtier.b`, other namespaces): LMCache passes
    neither name to the connector, and each connector still takes its own settings."""
    a, ea = lmcache_engine(daemon, names=("kvtier.a", "kvtier.b"))
    try:
        for name in ("kvtier.a", "kvtier.b"):
            inner = remote(ea, name).connection.getWrappedConnector()
            assert inner.plugin_name == name
    finally:
        destroy(a)
    cfg = lmc_config(daemon, ("kvtier.a", "kvtier.b"))
    with pytest.raises(ValueError, match="kvtier.a, kvtier.b"):
        klm.find_plugin_name(cfg, klm.KvtierConnector)  # from outside LMCache's loader
    assert klm.find_plugin_name(cfg, klm.KvtierConnector, "kvtier.b") == "kvtier.b"


def test_chunk_size_from_what_lmcache_hands(daemon: Daemon) -> None:
    """The metadata's chunk_size left at LMCacheMetadata's default (256), as LMCache's SGLang
    adapter builds it, while the config's (and the KV's) is CHUNK: full chunks are stored (pages
    in kvtierd, no failed put) and another engine loads them back byte-exact. With
    save_unfull_chunk, the prompt's partial tail chunk, which the connector cannot store, is a
    failed put: counted by the connector, and by LMCache's RemoteBackend for a single put."""
    T = 3 * CHUNK + 5  # 3 whole chunks and a partial one
    tokens = torch.arange(95_000, 95_000 + T)
    kv = torch.randn(L, 2, T, KVH, HD).to(torch.bfloat16)
    a, ea = lmcache_engine(daemon, md_chunk=None, lmc={"save_unfull_chunk": True})
    try:
        assert ea.metadata.chunk_size == 256 and ea.config.chunk_size == CHUNK
        with daemon.client() as c:
            before = c.stats()["put_pages_stored"]
        ea.store(tokens, kvcaches=kv)
        assert wait_remote(ea, tokens, 3 * CHUNK) == 3 * CHUNK
        with daemon.client() as c:
            assert c.stats()["put_pages_stored"] >= before + 3
        inner = remote(ea).connection.getWrappedConnector()
        assert inner.block_bytes == 2 * L * CHUNK * KVH * HD * 2
        for _ in range(40):  # the partial chunk's put: asynchronous
            if inner.failed_puts:
                break
            threading.Event().wait(0.05)
        assert inner.failed_puts == 1
        # A single put of a chunk it cannot store: LMCache's own count of failed puts.
        rb = remote(ea)
        o = ea.storage_manager.allocate(ea.metadata.get_shapes(5), ea.metadata.get_dtypes(),
                                        fmt=MemoryFormat.KV_2LTD)
        assert rb.put_failed_count == 0
        with pytest.raises(klm.PutFailed, match="not a full chunk"):
            rb.submit_put_task(key(), o).result(10)
        for _ in range(40):  # the callback that counts runs after the future completes
            if rb.put_failed_count:
                break
            threading.Event().wait(0.05)
        assert rb.put_failed_count == 1 and inner.failed_puts == 2
        o.ref_count_down()
    finally:
        destroy(a)
    b, eb = lmcache_engine(daemon, md_chunk=None)
    try:
        assert eb.lookup(tokens) == 3 * CHUNK
        kv2 = torch.zeros(L, 2, 3 * CHUNK, KVH, HD, dtype=torch.bfloat16)
        assert int(eb.retrieve(tokens[:3 * CHUNK], kvcaches=kv2).sum()) == 3 * CHUNK
        assert torch.equal(kv2, kv[:, :, :3 * CHUNK])
    finally:
        destroy(b)
