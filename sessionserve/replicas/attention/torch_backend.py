"""Paged attention in plain torch (CPU and any device), vectorised over the batch.

Sequences with the same number of new tokens form one group and run as one padded
`scaled_dot_product_attention` call per layer: all decodes together (q_len 1), all speculative
verifies together (q_len k+1), each distinct prefill length on its own. So a decode step costs
one gather and one SDPA per layer whatever the batch size, not a Python loop per sequence.
A prefill with no cached prefix attends to its new K/V directly (causal), skipping the gather.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sessionserve.replicas.attention.base import AttentionBackend, ForwardMeta, SeqSpec


@dataclass
class _Group:
    token_idx: torch.Tensor  # [B, q] positions of the group's query tokens in the flat batch
    ctx_slots: torch.Tensor | None  # [B, Lmax] KV slots, padded with slot 0; None when fresh
    mask: torch.Tensor | None  # [B, 1, q, Lmax] True = may attend; None = no masking needed
    fresh: bool  # one sequence, no cached prefix, causal: use the new K/V directly


class TorchPagedBackend(AttentionBackend):
    name = "torch"

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
        q = seqs[0].q_len
        token_idx = torch.tensor(starts, device=device)[:, None] + torch.arange(q, device=device)
        only = seqs[0]
        if len(seqs) == 1 and only.ctx_len == q and only.tree_mask is None:
            return _Group(token_idx, None, None, fresh=True)
        lmax = max(s.ctx_len for s in seqs)
        ctx_slots = torch.zeros(len(seqs), lmax, dtype=torch.int64, device=device)
        mask = torch.zeros(len(seqs), 1, q, lmax, dtype=torch.bool, device=device)
        need_mask = False
        for b, s in enumerate(seqs):
            ctx_slots[b, : s.ctx_len] = s.ctx_slots
            prefix = s.ctx_len - q
            mask[b, 0, :, :prefix] = True  # the cached prefix is visible to every new token
            new = (
                s.tree_mask
                if s.tree_mask is not None
                else torch.ones(q, q, dtype=torch.bool, device=device).tril()
            )
            mask[b, 0, :, prefix : s.ctx_len] = new
            need_mask |= q > 1 or s.ctx_len < lmax
        return _Group(token_idx, ctx_slots, mask if need_mask else None, fresh=False)

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: ForwardMeta,
        scaling: float,
    ) -> torch.Tensor:
        pool = meta.kv_pool
        pool.write(layer, meta.out_slots, k[0].transpose(0, 1), v[0].transpose(0, 1))
        k_pool, v_pool = pool.k[layer], pool.v[layer]  # [slots, KVH, D]
        n_tokens, n_heads, head_dim = q.shape[2], q.shape[1], q.shape[3]
        out = q.new_empty(n_tokens, n_heads, head_dim)
        q_tokens = q[0].transpose(0, 1)  # [T, H, D]
        for g in meta.plan:
            if g.fresh:
                s, e = int(g.token_idx[0, 0]), int(g.token_idx[0, -1]) + 1
                o = F.scaled_dot_product_attention(
                    q[:, :, s:e],
                    k[:, :, s:e],
                    v[:, :, s:e],
                    is_causal=e - s > 1,
                    scale=scaling,
                    enable_gqa=True,
                )  # [1, H, q, D]
                out[s:e] = o[0].transpose(0, 1)
                continue
            qg = q_tokens[g.token_idx].transpose(1, 2)  # [B, H, q, D]
            kg = k_pool[g.ctx_slots].transpose(1, 2).to(q.dtype)  # [B, KVH, Lmax, D]
            vg = v_pool[g.ctx_slots].transpose(1, 2).to(q.dtype)
            o = F.scaled_dot_product_attention(
                qg, kg, vg, attn_mask=g.mask, scale=scaling, enable_gqa=True
            )  # [B, H, q, D]
            out[g.token_idx.reshape(-1)] = o.transpose(1, 2).reshape(-1, n_heads, head_dim)
        return out.unsqueeze(0)
