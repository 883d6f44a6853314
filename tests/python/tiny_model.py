"""tiny_model.py: a small attention model for the connectors' end-to-end tests: its generated
tokens with KV loaded through a connector must equal those with the KV recomputed.

A decoder (embeddings, multi-head causal attention over a paged KV cache, MLP), fixed seed, CPU,
float32 compute and bfloat16 KV. The KV cache is one tensor per layer in vLLM's paged layout
(2, num_blocks, block_size, kv_heads, head_size), addressed by a block table; the SGLang and
LMCache tests copy pages between it and their engine's own layouts.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

BS = 16  # tokens per block (page)
LAYERS = 3
HEADS = 2
HEAD = 8
NBLOCKS = 32
DTYPE = torch.bfloat16


def paged_kv(seed: Optional[int] = None) -> Dict[str, torch.Tensor]:
    """A fresh paged KV cache, one tensor per layer, named as vLLM names attention layers;
    random contents (seed) or zeros (None)."""
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    out = {}
    for i in range(LAYERS):
        shape = (2, NBLOCKS, BS, HEADS, HEAD)
        t = torch.randn(*shape, generator=g) if g is not None else torch.zeros(*shape)
        out["model.layers.%d.self_attn.attn" % i] = t.to(DTYPE)
    return out


class TinyModel:
    """The forward calls a vLLM-style worker connector where vLLM's attention layers do, when one
    is given: wait_for_layer_load before a layer reads its KV, save_kv_layer after it wrote the
    step's K and V."""

    VOCAB = 101
    DIM = 32

    def __init__(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)

        def w(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g) / shape[0] ** 0.5

        d, a = self.DIM, HEADS * HEAD
        self.emb = w(self.VOCAB, d)
        self.pos = w(512, d)
        self.layers = [dict(q=w(d, a), k=w(d, a), v=w(d, a), o=w(a, d), up=w(d, 4 * d),
                            down=w(4 * d, d)) for _ in range(LAYERS)]

    def forward(self, toks: List[int], start: int, kvc: Dict[str, torch.Tensor],
                table: List[int], worker: Any = None, meta: Any = None) -> torch.Tensor:
        """Computes positions [start, start + len(toks)) with the KV of [0, start) read from the
        paged cache; returns the last position's logits."""
        if worker is not None:
            worker.bind_connector_metadata(meta)
            worker.start_load_kv(None)
        n = len(toks)
        end = start + n
        pos = torch.arange(start, end)
        x = self.emb[torch.tensor(toks) % self.VOCAB] + self.pos[pos]
        slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(end)])
        causal = torch.arange(end)[None, :] <= pos[:, None]
        for (name, cache), p in zip(kvc.items(), self.layers):
            if worker is not None:
                worker.wait_for_layer_load(name)
            h = torch.nn.functional.layer_norm(x, (self.DIM,))
            q = (h @ p["q"]).view(n, HEADS, HEAD)
            flat = cache.view(2, NBLOCKS * BS, HEADS, HEAD)
            flat[0, slots[start:]] = (h @ p["k"]).view(n, HEADS, HEAD).to(DTYPE)
            flat[1, slots[start:]] = (h @ p["v"]).view(n, HEADS, HEAD).to(DTYPE)
            if worker is not None:
                worker.save_kv_layer(name, cache, None)
            k, v = flat[0, slots].float(), flat[1, slots].float()
            att = torch.einsum("qhd,khd->hqk", q, k) / HEAD ** 0.5
            att = att.masked_fill(~causal[None], float("-inf")).softmax(-1)
            x = x + torch.einsum("hqk,khd->qhd", att, v).reshape(n, -1) @ p["o"]
            h = torch.nn.functional.layer_norm(x, (self.DIM,))
            x = x + torch.nn.functional.gelu(h @ p["up"]) @ p["down"]
        if worker is not None:
            worker.wait_for_save()
            assert worker.get_block_ids_with_load_errors() == set()
            worker.clear_connector_metadata()
        return x[-1] @ self.emb.T


def decode(model: TinyModel, logits: torch.Tensor, ntok: int, kvc: Dict[str, torch.Tensor],
           table: List[int], steps: int) -> Tuple[List[int], List[torch.Tensor]]:
    """Greedy decoding of `steps` tokens after a prefill of `ntok` tokens that returned
    `logits`, without a connector; `table` must hold blocks for ntok + steps - 1 tokens.
    Returns the tokens and each step's logits."""
    out: List[int] = []
    seen: List[torch.Tensor] = []
    for i in range(steps):
        seen.append(logits)
        t = int(logits.argmax())
        out.append(t)
        if i == steps - 1:
            break
        logits = model.forward([t], ntok + i, kvc, table)
    return out, seen


def generate(model: TinyModel, toks: List[int], steps: int,
             table: List[int]) -> Tuple[List[int], List[torch.Tensor]]:
    """Everything recomputed in fresh paged tensors: the reference output."""
    kvc = paged_kv(None)
    return decode(model, model.forward(list(toks), 0, kvc, table), len(toks), kvc, table, steps)


def same_output(got: Tuple[List[int], List[torch.Tensor]],
                want: Tuple[List[int], List[torch.Tensor]]) -> bool:
    """The same tokens from the same logits, up to float summation order (a run that loaded
    KV computes fewer rows)."""
    return got[0] == want[0] and len(got[1]) == len(want[1]) and all(
        torch.allclose(x, y, rtol=0, atol=1e-4) for x, y in zip(got[1], want[1]))


def slots(table: List[int], ntok: int) -> torch.Tensor:
    """The flat slot (block * BS + offset) of each of the first ntok positions."""
    return torch.tensor([table[p // BS] * BS + p % BS for p in range(ntok)])
