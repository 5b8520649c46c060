"""Decode attention over the paged pool in place: the formula a compiler turns into a kernel.

The torch backend's general path copies every sequence's K/V rows out of the pool
(`gather_rows`) for each layer of each step, then runs SDPA over the copy: a decode step of
4 sequences over 2,000-token contexts moves the K/V three times (read, write, read again),
and in a served multi-turn run the copy and the SDPA together took a third of the engine
thread (py-spy). A decode row's attention is small enough to write as plain torch ops over
the pool and its slot table (scores, masked softmax, weighted sum); inductor compiles that
into loops that load each K/V row through its slot, with no copy (`replicas/compiled_attention.py`
builds it ahead of time). The function itself is also the readable definition the tests
compare the compiled kernel and the SDPA path against.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


def decode_attention(
    query: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    lens: torch.Tensor,
    chunks: int = 1,
    scale: float = 1.0,
) -> torch.Tensor:
    """One new token per row. `query` [B, H, D] (multiplied by the softmax `scale` here, in
    fp32: scaling a bf16 query first would round it once more); `k_pool`, `v_pool`
    [S, KVH, D] (KVH divides H; query head h reads KV head h // (H/KVH));
    `slots` [B, L] pool rows, of which row b reads its first `lens[b]` (1..L; the rest is
    padding, any valid slot), L a multiple of `chunks`: the context is attended in that many
    parts, each with its own softmax maximum and sum, merged at the end (flash-decoding), so
    that a compiled loop over the parts keeps every thread busy even for one row. Returns
    [B, H, D] in the query's dtype, computed in fp32."""
    batch, width = slots.shape
    kv_heads, head_dim = k_pool.shape[1], k_pool.shape[2]
    parts = slots.view(batch, chunks, -1).transpose(0, 1)  # [C, B, L/C]
    q = (query.float() * scale).view(1, batch, 1, kv_heads, -1, head_dim)  # [1,B,1,KVH,G,D]
    group = q.shape[4]  # query heads per KV head
    keys = k_pool[parts].float()  # [C, B, L/C, KVH, D]: indexing a compiler fuses into loads
    # One reduction per query head of the group, stacked (not one broadcast over the group):
    # inductor then fuses them into one loop that loads and converts each K row once, not
    # once per query head (with compiled_attention's export sizes, the kernel is 1.4-2.1x the
    # broadcast form's on an AVX-512 CPU: benchmarks/decode_attention.py)
    scores = torch.stack([(q[..., g, :] * keys).sum(-1) for g in range(group)], -1)
    position = torch.arange(width, device=slots.device).view(chunks, 1, -1)
    seen = position < lens[None, :, None]  # [C, B, L/C]
    scores = scores.masked_fill(~seen[..., None, None], float("-inf"))
    # a part with nothing to see has maximum -inf: clamped, its weights below are all 0
    top = scores.amax(2, keepdim=True).clamp(min=torch.finfo(torch.float32).min)
    weights = torch.exp(scores - top)
    values = v_pool[parts].float()
    # [C, B, KVH, G, D], likewise one V row load for the whole group
    partial = torch.stack([(weights[..., g, None] * values).sum(2) for g in range(group)], 3)
    top = top[:, :, 0]  # [C, B, KVH, G]
    rescale = torch.exp(top - top.amax(0))
    total = (weights.sum(2) * rescale).sum(0)  # [B, KVH, G]
    out = (partial * rescale[..., None]).sum(0) / total[..., None]
    return out.reshape(query.shape).to(query.dtype)


class DecodeAttention(torch.nn.Module):
    """`decode_attention` with a fixed number of parts and scale, as a module for
    `torch.export`."""

    def __init__(self, chunks: int, scale: float) -> None:
        super().__init__()
        self.chunks, self.scale = chunks, scale

    def forward(
        self,
        query: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        slots: torch.Tensor,
        lens: torch.Tensor,
    ) -> torch.Tensor:
        return decode_attention(query, k_pool, v_pool, slots, lens, self.chunks, self.scale)


@dataclass
class DecodeKernel:
    """A compiled `DecodeAttention`: called as `decode_attention` without `chunks` and `scale`
    (the slots' width a multiple of `chunks`; only for layers whose softmax scale is `scale`)."""

    run: Callable[..., torch.Tensor]
    chunks: int
    scale: float

    def __call__(
        self,
        query: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        slots: torch.Tensor,
        lens: torch.Tensor,
    ) -> torch.Tensor:
        return self.run(query, k_pool, v_pool, slots, lens)
