"""ttft.py: time to first token with and without kvtier, on a Llama-shaped model with random
weights made on the device (nothing downloaded). bench_ttft.py runs it; the pytest
test_ttft.py checks on the CPU that a prompt whose KV came back through kvtier gives the logits
a full prefill gives.

The model is a Llama decoder in plain torch: RMSNorm, rotary positions, grouped-query attention
(torch's scaled_dot_product_attention), a SwiGLU MLP, tied to nothing pretrained. What TTFT
measures does not depend on the weights' values, only on the shapes: the prefill's FLOPs and the
KV bytes.

A page is PAGE tokens of every layer's K and V: (layers, 2, PAGE, kv_heads, head_dim) in the
model's dtype, contiguous, so that one kvtier page is one engine page of all layers (the layout
the vLLM connector stores, docs/engines.md).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

PAGE = 16


@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    note: str = ""

    def page_bytes(self, dtype: torch.dtype) -> int:
        el = torch.empty((), dtype=dtype).element_size()
        return self.layers * 2 * PAGE * self.kv_heads * self.head_dim * el

    def params(self) -> int:
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        return self.layers * (attn + 3 * self.hidden * self.ffn + 2 * self.hidden) + \
            2 * self.vocab * self.hidden


# Llama-3-8B: 32 layers, 4096 wide, 32 query and 8 KV heads of 128, MLP 14336.
LLAMA3_8B = Shape("llama-3-8b", 32, 4096, 32, 8, 128, 14336, 128256)
# Llama-3-70B has 80 layers of 8192 (64 query and 8 KV heads of 128, MLP 28672): 140 GB of
# bf16 weights, more than one GPU holds. This is 20 of its 80 layers, at full width: a quarter
# of its prefill FLOPs and KV bytes per token, so TTFT with and without kvtier both scale by
# about 4 to the whole model (their ratio does not change).
LLAMA3_70B_QUARTER = Shape("llama-3-70b-20of80", 20, 8192, 64, 8, 128, 28672, 128256,
                           note="20 of Llama-3-70B's 80 layers at full width: x4 for the model")
# For the CPU: the same structure, small.
TINY = Shape("tiny", 2, 128, 4, 2, 32, 256, 1000)

SHAPES = {s.name: s for s in (LLAMA3_8B, LLAMA3_70B_QUARTER, TINY)}


class Model:
    """A Llama-shaped decoder with random weights (seeded) on `device`."""

    def __init__(self, shape: Shape, device: str, dtype: torch.dtype, seed: int = 1) -> None:
        self.s, self.device, self.dtype = shape, torch.device(device), dtype
        g = torch.Generator(device=self.device).manual_seed(seed)
        s = shape

        def w(*dims: int) -> torch.Tensor:
            t = torch.empty(*dims, device=self.device, dtype=dtype)
            return t.normal_(0.0, 1.0 / math.sqrt(dims[0]), generator=g)

        self.emb = w(s.vocab, s.hidden)
        self.layers = []
        for _ in range(s.layers):
            self.layers.append(dict(
                qkv=w(s.hidden, (s.heads + 2 * s.kv_heads) * s.head_dim),
                o=w(s.heads * s.head_dim, s.hidden),
                gate_up=w(s.hidden, 2 * s.ffn),
                down=w(s.ffn, s.hidden),
                n1=torch.ones(s.hidden, device=self.device, dtype=dtype),
                n2=torch.ones(s.hidden, device=self.device, dtype=dtype)))
        self.norm = torch.ones(s.hidden, device=self.device, dtype=dtype)
        inv = 1.0 / (500000.0 ** (torch.arange(0, s.head_dim, 2, device=self.device).float() /
                                  s.head_dim))
        self.inv_freq = inv

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        f = pos.float()[:, None] * self.inv_freq[None, :]  # (n, hd/2)
        cos, sin = f.cos().to(x.dtype)[:, None, :], f.sin().to(x.dtype)[:, None, :]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        out = torch.empty_like(x)
        out[..., 0::2] = x1 * cos - x2 * sin
        out[..., 1::2] = x1 * sin + x2 * cos
        return out

    @staticmethod
    def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        v = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(v + 1e-5)).to(x.dtype) * w

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, past: Optional[torch.Tensor] = None
                ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Computes the positions after `past` (a KV tensor (layers, 2, T0, kv_heads,
        head_dim), or None) for `tokens`; returns the last position's logits (float32) and the
        KV of every position, past included: (layers, 2, T0 + n, kv_heads, head_dim)."""
        s = self.s
        n = tokens.shape[0]
        t0 = 0 if past is None else past.shape[2]
        pos = torch.arange(t0, t0 + n, device=self.device)
        x = self.emb[tokens]
        kv = torch.empty(s.layers, 2, t0 + n, s.kv_heads, s.head_dim, device=self.device,
                         dtype=self.dtype)
        if past is not None:
            kv[:, :, :t0] = past
        for i, p in enumerate(self.layers):
            h = self._rms(x, p["n1"])
            qkv = h @ p["qkv"]
            q, k, v = qkv.split([s.heads * s.head_dim, s.kv_heads * s.head_dim,
                                 s.kv_heads * s.head_dim], dim=-1)
            q = self._rope(q.view(n, s.heads, s.head_dim), pos)
            kv[i, 0, t0:] = self._rope(k.view(n, s.kv_heads, s.head_dim), pos)
            kv[i, 1, t0:] = v.view(n, s.kv_heads, s.head_dim)
            kk, vv = kv[i, 0], kv[i, 1]
            # (heads, n, hd) against (kv_heads, T, hd): grouped-query attention, causal with
            # the new rows at the end.
            rep = s.heads // s.kv_heads
            kk = kk.transpose(0, 1).repeat_interleave(rep, 0)
            vv = vv.transpose(0, 1).repeat_interleave(rep, 0)
            if t0 == 0:
                a = F.scaled_dot_product_attention(q.transpose(0, 1), kk, vv, is_causal=True)
            else:
                mask = (torch.arange(t0 + n, device=self.device)[None, :] <=
                        pos[:, None])
                a = F.scaled_dot_product_attention(q.transpose(0, 1), kk, vv, attn_mask=mask)
            x = x + a.transpose(0, 1).reshape(n, -1) @ p["o"]
            h = self._rms(x, p["n2"])
            gu = h @ p["gate_up"]
            g, u = gu.split(s.ffn, dim=-1)
            x = x + (F.silu(g) * u) @ p["down"]
        last = self._rms(x[-1:], self.norm)
        return (last @ self.emb.T).float()[0], kv


def to_pages(kv: torch.Tensor, npages: int) -> torch.Tensor:
    """The first npages pages of a KV tensor as kvtier pages: (npages, layers, 2, PAGE, kvh, hd)
    contiguous."""
    L, _, _, kvh, hd = kv.shape
    x = kv[:, :, :npages * PAGE].reshape(L, 2, npages, PAGE, kvh, hd)
    return x.permute(2, 0, 1, 3, 4, 5).contiguous()


def from_pages(pages: torch.Tensor) -> torch.Tensor:
    """The inverse: (npages, layers, 2, PAGE, kvh, hd) -> (layers, 2, npages * PAGE, kvh, hd)."""
    n, L, _, _, kvh, hd = pages.shape
    return pages.permute(1, 2, 0, 3, 4, 5).reshape(L, 2, n * PAGE, kvh, hd)


def prompt(n: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def save(client, model: Model, toks: torch.Tensor) -> Tuple[torch.Tensor, int]:
    """Prefills toks and stores its whole pages in kvtier; returns the full prefill's logits
    and the pages stored."""
    logits, kv = model.forward(toks.to(model.device))
    npages = toks.shape[0] // PAGE
    host = to_pages(kv, npages).cpu()
    r = client.put(toks.tolist(), host.view(torch.uint8).reshape(npages, -1).numpy())
    return logits, r.stored


def load_and_finish(client, model: Model, toks: torch.Tensor, host: torch.Tensor
                    ) -> Tuple[torch.Tensor, int, float, float]:
    """TTFT through kvtier: MATCH with a lease, GET the pages into `host` (pinned on a GPU
    machine), copy them to the device, compute the tokens after the cached pages. Returns the
    logits, the pages loaded, the seconds the load took (MATCH + GET + copy to the device) and
    the seconds in all."""
    t0 = time.perf_counter()
    m = client.match(toks.tolist(), lease=True)
    try:
        got = client.get_into(m.lease, host[:m.pages].view(torch.uint8).reshape(m.pages, -1)
                              .numpy()) if m.pages else 0
    finally:
        if m.lease:
            client.release(m.lease)
    dev = host[:got].to(model.device, non_blocking=True)
    sync(model.device)
    t_load = time.perf_counter() - t0
    past = from_pages(dev) if got else None
    logits, _ = model.forward(toks[got * PAGE:].to(model.device), past)
    sync(model.device)
    return logits, got, t_load, time.perf_counter() - t0


def recompute(model: Model, toks: torch.Tensor) -> Tuple[torch.Tensor, float]:
    t0 = time.perf_counter()
    logits, _ = model.forward(toks.to(model.device))
    sync(model.device)
    return logits, time.perf_counter() - t0


def copy_ceiling(host: torch.Tensor, device: torch.device, reps: int = 3) -> float:
    """Seconds of the plainest copy of the same bytes to where the model runs: one pinned
    host-to-device copy on a GPU, one memcpy-class tensor copy on the CPU. The median."""
    times: List[float] = []
    dst = torch.empty_like(host, device=device)
    for _ in range(reps + 1):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(host, non_blocking=True)
        sync(device)
        times.append(time.perf_counter() - t0)
    times = sorted(times[1:])
    return times[len(times) // 2]
