"""test_ttft.py: the TTFT benchmark's model and load path (bench/ttft.py) on the CPU: a prompt
whose whole pages come back from kvtierd (MATCH, GET into a buffer, the tokens after them
computed over that KV) gives the logits a full prefill gives, in float32; the page layout is one
engine page of every layer; a missing prefix (a daemon that lost the pages) is recomputed."""

import os
import sys

import pytest

torch = pytest.importorskip("torch")

from conftest import SOURCE_ROOT  # noqa: E402

sys.path.insert(0, os.path.join(SOURCE_ROOT, "bench"))
import ttft  # noqa: E402

SHAPE = ttft.TINY


@pytest.fixture(scope="module")
def model():
    return ttft.Model(SHAPE, "cpu", torch.float32, seed=3)


def test_pages_round_trip(model):
    toks = ttft.prompt(70, SHAPE.vocab, seed=1)
    _, kv = model.forward(toks)
    pages = ttft.to_pages(kv, 4)
    assert pages.shape == (4, SHAPE.layers, 2, ttft.PAGE, SHAPE.kv_heads, SHAPE.head_dim)
    assert pages.numel() * 4 == 4 * SHAPE.page_bytes(torch.float32)
    assert torch.equal(ttft.from_pages(pages), kv[:, :, :64])
    # page 2 of layer 1's V is positions 32..47 of that layer's V
    assert torch.equal(pages[2, 1, 1], kv[1, 1, 32:48])


def test_cached_prefix_gives_the_full_prefill_logits(daemon, model):
    toks = ttft.prompt(16 * 9 + 5, SHAPE.vocab, seed=2)  # 9 whole pages and 5 tokens
    pb = SHAPE.page_bytes(torch.float32)
    with daemon.client("ttft-test", page_size=ttft.PAGE, block_bytes=pb) as c:
        ref, stored = ttft.save(c, model, toks)
        assert stored == 9
        host = torch.empty(9, SHAPE.layers, 2, ttft.PAGE, SHAPE.kv_heads, SHAPE.head_dim)
        logits, got, t_load, t_all = ttft.load_and_finish(c, model, toks, host)
    assert got == 9
    assert 0 < t_load <= t_all
    assert torch.allclose(logits, ref, rtol=0, atol=1e-4), float((logits - ref).abs().max())
    # and not by accident: other KV gives other logits
    wrong, _ = model.forward(toks[9 * ttft.PAGE:], torch.zeros_like(ttft.from_pages(host)))
    assert not torch.allclose(wrong, ref, rtol=0, atol=1e-2)


def test_nothing_cached_is_a_full_prefill(daemon, model):
    toks = ttft.prompt(40, SHAPE.vocab, seed=4)
    pb = SHAPE.page_bytes(torch.float32)
    with daemon.client("ttft-test-empty", page_size=ttft.PAGE, block_bytes=pb) as c:
        host = torch.empty(2, SHAPE.layers, 2, ttft.PAGE, SHAPE.kv_heads, SHAPE.head_dim)
        logits, got, _, _ = ttft.load_and_finish(c, model, toks, host)
    ref, _ = ttft.recompute(model, toks)
    assert got == 0
    assert torch.allclose(logits, ref, rtol=0, atol=1e-5)


def test_shapes_are_the_models_they_name():
    s = ttft.LLAMA3_8B
    assert s.page_bytes(torch.bfloat16) == 2 << 20  # 32 layers x K,V x 16 x 8 x 128 x 2 B
    assert 7.9e9 < s.params() < 8.2e9, s.params()
    q = ttft.LLAMA3_70B_QUARTER
    assert 4 * (q.params() - 2 * q.vocab * q.hidden) + 2 * q.vocab * q.hidden > 69e9
