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
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from sessionserve.cache.kv_pool import as_stored
from sessionserve.replicas.attention import cpu_decode_kernel


def decode_attention(
    query: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    lens: torch.Tensor,
    chunks: int = 1,
    scale: float = 1.0,
    new_key: torch.Tensor | None = None,
    new_value: torch.Tensor | None = None,
) -> torch.Tensor:
    """One new token per row. `query` [B, H, D] (multiplied by the softmax `scale` here, in
    fp32: scaling a bf16 query first would round it once more); `k_pool`, `v_pool`
    [S, KVH, D] (KVH divides H; query head h reads KV head h // (H/KVH));
    `slots` [B, L] pool rows, of which row b reads its first `lens[b]` (1..L; the rest is
    padding, any valid slot), L a multiple of `chunks`: the context is attended in that many
    parts, each with its own softmax maximum and sum, merged at the end (flash-decoding), so
    that a compiled loop over the parts keeps every thread busy even for one row. With
    `new_key`, `new_value` [B, KVH, D] (the row's own token, not yet in the pool) that token
    is one more part of one row, and `lens` may be 0: the whole decode step compiled as one
    graph (compiled_decode.py) attends before it writes the pool. Returns [B, H, D] in the
    query's dtype, computed in fp32."""
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
    best = top.amax(0)
    if new_key is not None and new_value is not None:
        own = (q[0, :, 0] * new_key.float()[:, :, None, :]).sum(-1)  # [B, KVH, G]
        best = torch.maximum(best, own)
    rescale = torch.exp(top - best)
    total = (weights.sum(2) * rescale).sum(0)  # [B, KVH, G]
    out = (partial * rescale[..., None]).sum(0)
    if new_key is not None and new_value is not None:
        own_weight = torch.exp(own - best)
        total = total + own_weight
        out = out + new_value.float()[:, :, None, :] * own_weight[..., None]
    out = out / total[..., None]
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
    # query tokens a row may have: 1 (the formula), more for the CPU kernel (a chain
    # verify's rows, each token seeing its row's context up to itself)
    max_query_tokens: int = 1

    def __call__(
        self,
        query: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        slots: torch.Tensor,
        lens: torch.Tensor,
    ) -> torch.Tensor:
        return self.run(query, k_pool, v_pool, slots, lens)


def part_padded(slots: torch.Tensor, chunks: int) -> torch.Tensor:
    """`slots` [B, L] padded with slot 0 to a width that is a multiple of `chunks`, at least
    `chunks` (every part at least one column wide: what the compiled kernels were exported
    for)."""
    width = slots.shape[1]
    return F.pad(slots, (0, max(chunks, width + -width % chunks) - width))


def padded(rows: torch.Tensor, spread: torch.Tensor) -> torch.Tensor:
    """`rows` [N, ...] laid out as `spread` [P] says (`InlineDecode.spread`): position p
    holds row spread[p], or zeros where spread[p] is N."""
    return torch.cat([rows, rows.new_zeros(1, *rows.shape[1:])])[spread]


@dataclass
class InlineDecode:
    """A decode step's attention inside one compiled graph (compiled_decode.py): handed to
    every layer through transformers' attention kwargs (`inline_decode=`), it attends each
    row's new token over its old context in the pool (`slots`, `lens`) plus the token itself,
    and collects the new K/V instead of writing them, so the graph has no side effects and
    the caller writes every layer's rows with one copy after it."""

    k_pool: torch.Tensor  # [layers, S, KVH, D]
    v_pool: torch.Tensor
    slots: torch.Tensor  # [B, W] each row's old context, part-padded
    lens: torch.Tensor  # [B] how many of them it reads (0..W)
    chunks: int
    # attend with the hand-written CPU kernel (cpu_decode_kernel.py), an opaque op in the
    # graph, instead of `decode_attention`'s formula compiled by inductor
    kernel: bool = False
    # with the kernel, rows of several tokens (a verify where some rows draft fewer tokens,
    # a short turn beside decodes) attend padded to one width while everything else in the
    # step runs on the real tokens only: `spread` [B * T] is, for each padded position, its
    # token's index among the step's N real ones (N: a padding position, given zeros), and
    # `kept` [N] each real token's padded position. None: the tokens are the rows, as they are
    spread: torch.Tensor | None = None
    kept: torch.Tensor | None = None
    # a model with sliding-window layers: what those layers read instead of `slots`, `lens`,
    # each row's old context within its new token's window (the last window - 1 positions)
    window_slots: torch.Tensor | None = None  # [B, W'] part-padded
    window_lens: torch.Tensor | None = None  # [B]
    # where the pool keeps the sliding layers' KV apart (cache/sliding.py): their K and V
    # [sliding layers, S', KVH, D], `window_slots` indexing them, and each model layer's index
    # in its own stack (`k_pool`'s for full layers, `sliding_k`'s for sliding ones)
    sliding_k: torch.Tensor | None = None
    sliding_v: torch.Tensor | None = None
    kv_index: tuple[int, ...] | None = None
    new_k: list[torch.Tensor] = field(default_factory=list)  # per layer [N, KVH, D]
    new_v: list[torch.Tensor] = field(default_factory=list)
    widths: torch.Tensor | None = field(init=False, default=None)  # per row, its real tokens

    def __post_init__(self) -> None:
        if self.spread is not None and self.kept is not None:  # the kernel skips the padding
            real = self.kept.shape[0]  # (not len(): a traced size would become a constant)
            self.widths = (self.spread.view(self.slots.shape[0], -1) < real).sum(1)

    def layer_context(
        self, layer: int, window: int | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The K and V a layer reads, and its rows' context slots and lengths: the window's
        for a sliding layer (`window`: transformers' `sliding_window` for the layer)."""
        if not window:
            full = layer if self.kv_index is None else self.kv_index[layer]
            return self.k_pool[full], self.v_pool[full], self.slots, self.lens
        if self.window_slots is None or self.window_lens is None:
            raise NotImplementedError(
                f"layer {layer} slides over {window} tokens, and this decode step was not "
                "built with its rows' windows"
            )
        if self.kv_index is None:  # the sliding layers' KV in the one pool
            k_pool, v_pool = self.k_pool[layer], self.v_pool[layer]
        else:
            if self.sliding_k is None or self.sliding_v is None:
                raise ValueError("kv_index given without the sliding layers' K and V")
            k_pool, v_pool = (t[self.kv_index[layer]] for t in (self.sliding_k, self.sliding_v))
        return k_pool, v_pool, self.window_slots, self.window_lens

    def attend(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        """[1, B, H, D] from transformers' q [1, H, B, D] and k/v [1, KVH, B, D]."""
        if layer != len(self.new_k):
            raise RuntimeError(f"layer {layer} attended out of order (expected {len(self.new_k)})")
        k_pool, v_pool, slots, lens = self.layer_context(layer, window)
        q = query[0].transpose(0, 1)
        dtype = self.k_pool.dtype  # the new K/V as the pool will hold them (as_stored)
        k, v = as_stored(key[0].transpose(0, 1), dtype), as_stored(value[0].transpose(0, 1), dtype)
        self.new_k.append(k)
        self.new_v.append(v)
        if self.kernel:
            spread = self.spread
            qp, kp, vp = (q, k, v) if spread is None else (padded(t, spread) for t in (q, k, v))
            out = cpu_decode_kernel.decode_attend(
                qp,
                k_pool,
                v_pool,
                slots,
                lens,
                kp,
                vp,
                scale,
                self.widths,
            )
            return (out if self.kept is None else out[self.kept])[None]
        out = decode_attention(
            q,
            k_pool,
            v_pool,
            slots,
            lens,
            self.chunks,
            scale,
            k,
            v,
        )
        return out[None]
