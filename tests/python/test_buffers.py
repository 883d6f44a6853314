"""test_buffers.py: payloads of every kind the package takes (bytes, bytearray, memoryview,
array.array, numpy arrays of any dtype, read-only ones included, CPU torch tensors, pinned or
not), and that neither PUT nor GET copies in Python: GET's bytes land in the caller's own
memory (a numpy array, a slice of one, a torch tensor) in place, and neither call allocates a
payload-sized buffer (tracemalloc sees numpy's and Python's allocations)."""

import array
import os
import tracemalloc

import pytest
from conftest import BLOCK, payload, tokens

import kvtier

np = pytest.importorskip("numpy", reason="numpy is not installed")


def round_trip(client, pages, data, seed):
    tok = tokens(pages)
    assert client.put(tok, data).stored == pages
    m = client.match(tok, lease=True)
    got = client.get(m.lease)
    client.release(m.lease)
    return got


@pytest.mark.parametrize("kind", ["bytes", "bytearray", "memoryview", "array", "numpy-u8",
                                  "numpy-f16-2d", "numpy-readonly"])
def test_put_takes_any_buffer(client, kind):
    raw = payload(2, 11)
    data = {
        "bytes": lambda: raw,
        "bytearray": lambda: bytearray(raw),
        "memoryview": lambda: memoryview(raw),
        "array": lambda: array.array("B", raw),
        "numpy-u8": lambda: np.frombuffer(raw, np.uint8).copy(),
        "numpy-f16-2d": lambda: np.frombuffer(raw, np.float16).reshape(2, -1).copy(),
        "numpy-readonly": lambda: np.frombuffer(raw, np.uint8),  # read-only view of bytes
    }[kind]()
    assert round_trip(client, 2, data, 11) == raw


def test_get_into_writes_into_the_callers_numpy_array_in_place(client):
    tok = tokens(3)
    raw = payload(3, 12)
    client.put(tok, np.frombuffer(raw, np.uint8))
    m = client.match(tok, lease=True)
    # A bigger array, read into its middle through a slice (a view): if the package copied,
    # the array itself would not change.
    big = np.zeros(5 * BLOCK, np.uint8)
    addr = big.ctypes.data
    view = big[BLOCK:4 * BLOCK]
    assert client.get_into(m.lease, view) == 3
    assert big.ctypes.data == addr
    assert big[BLOCK:4 * BLOCK].tobytes() == raw
    assert not big[:BLOCK].any() and not big[4 * BLOCK:].any(), "nothing outside the view"
    # Any dtype and shape: only the size in bytes counts.
    f32 = np.zeros((3, BLOCK // 4), np.float32)
    assert client.get_into(m.lease, f32) == 3 and f32.tobytes() == raw
    client.release(m.lease)


def test_put_and_get_into_allocate_no_payload_sized_buffer(client):
    pages = 64  # 256 KiB: a copy would stand out against the package's few hundred bytes
    tok = tokens(pages)
    src = np.frombuffer(payload(pages, 13), np.uint8).copy()
    dst = np.zeros_like(src)
    tracemalloc.start()
    try:
        client.put(tok, src)
        m = client.match(tok, lease=True)
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        assert client.get_into(m.lease, dst) == pages
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak - base < BLOCK, "get_into allocated %d bytes" % (peak - base)
    assert np.array_equal(src, dst)
    client.release(m.lease)


def test_buffers_that_cannot_be_used_are_refused(client):
    tok = tokens(2)
    with pytest.raises(kvtier.InvalidArgument) as e:
        client.put(tok, b"x" * (BLOCK + 1))
    assert isinstance(e.value, ValueError) and e.value.code == -30800
    strided = np.zeros(4 * BLOCK, np.uint8)[::2]
    with pytest.raises((BufferError, ValueError)):
        client.put(tok, strided)
    client.put(tok, payload(2, 14))
    m = client.match(tok, lease=True)
    with pytest.raises(TypeError):
        client.get_into(m.lease, bytes(2 * BLOCK))  # read-only
    with pytest.raises(kvtier.InvalidArgument):
        client.get_into(m.lease, bytearray(BLOCK), npages=2)  # under 2 pages
    with pytest.raises(kvtier.TooBig):
        client.get_into(m.lease, bytearray(BLOCK))  # the lease's 2 pages do not fit
    client.release(m.lease)


torch = None
try:
    import torch  # noqa: F811
except ImportError:
    pass

needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")


@needs_torch
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "uint8"])
def test_torch_cpu_tensors_put_and_get_into_in_place(client, dtype):
    dt = getattr(torch, dtype)
    tok = tokens(2)
    raw = payload(2, 15)
    src = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dt).reshape(2, -1)
    assert client.put(tok, src).stored == 2
    m = client.match(tok, lease=True)
    dst = torch.zeros(2, BLOCK // src.element_size(), dtype=dt)
    ptr = dst.data_ptr()
    assert client.get_into(m.lease, dst) == 2
    assert dst.data_ptr() == ptr and torch.equal(dst.view(torch.uint8), src.view(torch.uint8))
    client.release(m.lease)


@needs_torch
def test_pinned_torch_tensor(client):
    if os.environ.get("KVT_PYTEST_SANITIZED"):
        pytest.skip("sanitizer build: pin_memory() throws a C++ exception on a CPU-only torch, "
                    "and the preloaded libasan's __cxa_throw interceptor aborts on it")
    try:
        src = torch.zeros(BLOCK, dtype=torch.uint8).pin_memory()
    except (RuntimeError, AssertionError) as e:
        pytest.skip("pin_memory() needs an accelerator on this torch build: %s" % e)
    src.copy_(torch.frombuffer(bytearray(payload(1, 16)), dtype=torch.uint8))
    tok = tokens(1)
    client.put(tok, src)
    m = client.match(tok, lease=True)
    dst = torch.empty(BLOCK, dtype=torch.uint8).pin_memory()
    assert client.get_into(m.lease, dst) == 1 and torch.equal(src, dst)
    client.release(m.lease)


@needs_torch
def test_non_contiguous_and_non_cpu_tensors_are_refused(client):
    t = torch.zeros(2, 2 * BLOCK, dtype=torch.uint8)[:, ::2]
    with pytest.raises(kvtier.InvalidArgument):
        client.put(tokens(1), t)
    meta = torch.empty(BLOCK, dtype=torch.uint8, device="meta")
    with pytest.raises(kvtier.InvalidArgument):
        client.put(tokens(1), meta)
