"""FlashInfer paged attention for CUDA (imported lazily; cannot run on a CPU-only machine).

Our pool stores one layer's K as [slots, KVH, D]; with `page_size` consecutive slots per page
this is exactly FlashInfer's "NHD" paged layout [num_pages, page_size, KVH, D], so the pool is
viewed, never copied. One `BatchPrefillWithPagedKVCacheWrapper` plan per forward serves every
layer, and handles prefill, decode and chain verification alike (causal over ragged queries).
Tree-shaped speculative verification is not wired for this backend (chain drafting only).
"""

from __future__ import annotations

from typing import Any

import torch

from sessionserve.replicas.attention.base import AttentionBackend, ForwardMeta, SeqSpec

WORKSPACE_BYTES = 128 * 1024 * 1024


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"

    def __init__(
        self,
        page_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scaling: float,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        import flashinfer  # lazy: only CUDA deployments install it (extra "gpu")

        self.page_size, self.scaling, self.dtype = page_size, scaling, dtype
        self.dims = (num_heads, num_kv_heads, head_dim)
        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")

    def prepare(self, seqs: list[SeqSpec], device: torch.device) -> Any:
        if any(s.tree_mask is not None for s in seqs):
            raise NotImplementedError("tree verification needs the torch backend; use chain")
        p = self.page_size
        qo, kv_ptr, pages, last = [0], [0], [], []
        for s in seqs:
            page_ids = s.ctx_slots[::p] // p  # positions are laid out page by page
            qo.append(qo[-1] + s.q_len)
            kv_ptr.append(kv_ptr[-1] + page_ids.numel())
            pages.append(page_ids)
            last.append(s.ctx_len - (page_ids.numel() - 1) * p)
        as_i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
        self.wrapper.plan(
            as_i32(qo),
            as_i32(kv_ptr),
            torch.cat(pages).to(device=device, dtype=torch.int32),
            as_i32(last),
            *self.dims,
            p,
            causal=True,
            sm_scale=self.scaling,
            q_data_type=self.dtype,
            kv_data_type=self.dtype,
        )
        return None

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
        _, kv_heads, head_dim = self.dims
        paged = (
            pool.k[layer].view(-1, self.page_size, kv_heads, head_dim),
            pool.v[layer].view(-1, self.page_size, kv_heads, head_dim),
        )
        out = self.wrapper.run(q[0].transpose(0, 1).contiguous(), paged)  # [T, H, D]
        return out.unsqueeze(0)
