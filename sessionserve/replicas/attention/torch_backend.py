"""Paged attention in plain torch (CPU and any device), vectorised over the batch.

Sequences with the same number of new tokens form one group and run as one padded
`scaled_dot_product_attention` call per layer: all decodes together (q_len 1), all speculative
verifies together (q_len k+1), each distinct prefill length on its own. So a decode step costs
one gather and one SDPA per layer whatever the batch size, not a Python loop per sequence.
A prefill with no cached prefix attends to its new K/V directly (causal), skipping the gather.
Sliding-window layers (Gemma 3, Mistral) get a mask of their own per group, built with the
others once per forward: a token sees itself and the `window - 1` positions before it.

Metadata is built on the host with whole-tensor ops and copied to the device once per group
(no per-sequence device writes, no device-to-host reads inside the layers).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from sessionserve.replicas.attention.base import AttentionBackend, ForwardMeta, SeqSpec, to_device

MIN_STATIC_CTX = 64  # smallest context bucket of a static decode plan


@dataclass
class _Group:
    token_idx: torch.Tensor  # [B, q] positions of the group's query tokens in the flat batch
    ctx_slots: torch.Tensor | None  # [B, Lmax] KV slots, padded with slot 0; None when fresh
    mask: torch.Tensor | None  # [B, 1, q, Lmax] True = may attend; None = no masking needed
    fresh: tuple[int, int] | None = None  # one sequence, no cached prefix, causal: its flat
    # token range [start, end) (host ints), using the new K/V directly
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)  # per sliding window:
    # its layers' mask, where it differs from `mask` (absent: the window covers every context)


def context_mask(
    ctx_lens: torch.Tensor, q: int, width: int, window: int | None = None
) -> torch.Tensor:
    """[B, q, width] bool: new token i of row b (its last q context positions) sees positions
    0..ctx_len - q + i: the cached prefix, then causally among the new tokens; with a
    `window`, only the last `window` of those (itself included)."""
    last_seen = (ctx_lens - q)[:, None, None] + torch.arange(q)[None, :, None]
    cols = torch.arange(width)[None, None, :]
    mask = cols <= last_seen
    if window is not None:
        mask &= cols > last_seen - window
    return mask


class TorchPagedBackend(AttentionBackend):
    name = "torch"

    def __init__(self, max_context_len: int | None = None, windows: tuple[int, ...] = ()) -> None:
        self.max_context_len = max_context_len  # the largest static context bucket
        self.windows = windows  # the model's sliding windows (attention.sliding_windows)

    def prepare(self, seqs: list[SeqSpec], device: torch.device) -> list[_Group]:
        starts, pos = [], 0
        for s in seqs:
            starts.append(pos)
            pos += s.q_len
        by_len: dict[int, list[int]] = defaultdict(list)
        for i, s in enumerate(seqs):
            by_len[s.q_len].append(i)
        return [
            self._group([seqs[i] for i in idx], [starts[i] for i in idx], device)
            for idx in by_len.values()
        ]

    def _group(self, seqs: list[SeqSpec], starts: list[int], device: torch.device) -> _Group:
        q, only = seqs[0].q_len, seqs[0]
        lens = torch.tensor([s.ctx_len for s in seqs])
        windows = [w for w in self.windows if int(lens.max()) > w]  # those that cut something
        if windows and any(s.tree_mask is not None for s in seqs):
            raise NotImplementedError("tree verification over sliding-window layers; use chain")
        if len(seqs) == 1 and only.ctx_len == q and only.tree_mask is None:
            fresh = _Group(torch.empty(0), None, None, fresh=(starts[0], starts[0] + q))
            for w in windows:  # causal alone is not enough past the window
                fresh.window_masks[w] = to_device(context_mask(lens, q, q, w)[:, None], device)
            return fresh
        token_idx = torch.tensor(starts)[:, None] + torch.arange(q)
        ctx_slots = pad_sequence([s.ctx_slots for s in seqs], batch_first=True)
        width = ctx_slots.shape[1]
        mask = None
        if q > 1 or int(lens.min()) < width:
            mask = context_mask(lens, q, width)
            for b, s in enumerate(seqs):
                if s.tree_mask is not None:
                    mask[b, :, s.ctx_len - q : s.ctx_len] = s.tree_mask
            mask = to_device(mask[:, None], device)
        group = _Group(to_device(token_idx, device), to_device(ctx_slots, device), mask)
        for w in windows:
            group.window_masks[w] = to_device(context_mask(lens, q, width, w)[:, None], device)
        return group

    # ---- static decode (CUDA graphs) ----
    def graph_key(self, seqs: list[SeqSpec]) -> int | None:
        """The context bucket: a power of two >= the longest context (at least 64)."""
        longest = max(s.ctx_len for s in seqs)
        width = max(MIN_STATIC_CTX, 1 << (longest - 1).bit_length())
        if self.max_context_len is not None and width > self.max_context_len:
            width = self.max_context_len if longest <= self.max_context_len else 0
        return width or None

    def static_decode(self, batch_size: int, key: int, device: torch.device) -> list[_Group]:
        """One decode group of fixed shape [batch_size, key] (a plan `forward` runs as is)."""
        group = _Group(
            token_idx=torch.arange(batch_size, device=device)[:, None],
            ctx_slots=torch.zeros(batch_size, key, dtype=torch.int64, device=device),
            mask=torch.zeros(batch_size, 1, 1, key, dtype=torch.bool, device=device),
        )
        group.window_masks = {w: torch.zeros_like(group.mask) for w in self.windows}
        return [group]

    def fill_decode(self, static: list[_Group], seqs: list[SeqSpec]) -> None:
        (static,) = static
        batch_size, width = static.ctx_slots.shape
        ctx = torch.zeros(batch_size, width, dtype=torch.int64)
        lens = torch.ones(batch_size, dtype=torch.int64)  # padding rows see slot 0 only
        if seqs:
            packed = pad_sequence([s.ctx_slots for s in seqs], batch_first=True)
            ctx[: len(seqs), : packed.shape[1]] = packed
            lens[: len(seqs)] = torch.tensor([s.ctx_len for s in seqs])
        static.ctx_slots.copy_(to_device(ctx, static.ctx_slots.device), non_blocking=True)
        for target, window in [
            (static.mask, None),
            *[(m, w) for w, m in static.window_masks.items()],
        ]:
            mask = context_mask(lens, 1, width, window)  # [B, 1, width]
            target.copy_(to_device(mask[:, None], target.device), non_blocking=True)

    def static_extend(self, q_len: int, width: int, device: torch.device) -> list[_Group]:
        """One group of fixed shape: `q_len` query tokens of one sequence over a context of
        `width` columns (CUDA graphs for short extends, see cuda_graphs.ExtendGraphs)."""
        group = _Group(
            token_idx=torch.arange(q_len, device=device)[None],
            ctx_slots=torch.zeros(1, width, dtype=torch.int64, device=device),
            mask=torch.zeros(1, 1, q_len, width, dtype=torch.bool, device=device),
        )
        group.window_masks = {w: torch.zeros_like(group.mask) for w in self.windows}
        return [group]

    def fill_extend(self, static: list[_Group], seq: SeqSpec | None) -> None:
        """Write `seq` (at most q_len new tokens) into `static`; query rows past its tokens are
        padding that sees only column 0 (slot 0, never read by a real row)."""
        (static,) = static
        q_len, width = static.mask.shape[2], static.mask.shape[3]
        ctx = torch.zeros(1, width, dtype=torch.int64)
        if seq is not None:
            ctx[0, : seq.ctx_len] = seq.ctx_slots
        static.ctx_slots.copy_(to_device(ctx, static.ctx_slots.device), non_blocking=True)
        for target, window in [
            (static.mask, None),
            *[(m, w) for w, m in static.window_masks.items()],
        ]:
            mask = torch.zeros(q_len, width, dtype=torch.bool)
            mask[:, 0] = True
            if seq is not None:
                lens = torch.tensor([seq.ctx_len])
                mask[: seq.q_len] = context_mask(lens, seq.q_len, width, window)[0]
            target.copy_(to_device(mask[None, None], target.device), non_blocking=True)

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: ForwardMeta,
        scaling: float,
        window: int | None = None,
    ) -> torch.Tensor:
        if window is not None and window not in self.windows:
            raise RuntimeError(f"layer {layer}'s sliding window {window} was not planned for")
        k_pool, v_pool = meta.kv_pool.k[layer], meta.kv_pool.v[layer]  # [slots, KVH, D]
        n_tokens, n_heads, head_dim = q.shape[2], q.shape[1], q.shape[3]
        out = q.new_empty(n_tokens, n_heads, head_dim)
        q_tokens = q[0].transpose(0, 1)  # [T, H, D]
        for g in meta.plan:
            banded = g.window_masks.get(window) if window is not None else None
            if g.fresh is not None:
                s, e = g.fresh
                o = F.scaled_dot_product_attention(
                    q[:, :, s:e],
                    k[:, :, s:e],
                    v[:, :, s:e],
                    attn_mask=banded,
                    is_causal=banded is None and e - s > 1,
                    scale=scaling,
                    enable_gqa=True,
                )  # [1, H, q, D]
                out[s:e] = o[0].transpose(0, 1)
                continue
            qg = q_tokens[g.token_idx].transpose(1, 2)  # [B, H, q, D]
            kg = k_pool[g.ctx_slots].transpose(1, 2).to(q.dtype)  # [B, KVH, Lmax, D]
            vg = v_pool[g.ctx_slots].transpose(1, 2).to(q.dtype)
            mask = g.mask if banded is None else banded
            o = F.scaled_dot_product_attention(
                qg, kg, vg, attn_mask=mask, scale=scaling, enable_gqa=True
            )  # [B, H, q, D]
            out[g.token_idx.reshape(-1)] = o.transpose(1, 2).reshape(-1, n_heads, head_dim)
        return out.unsqueeze(0)
