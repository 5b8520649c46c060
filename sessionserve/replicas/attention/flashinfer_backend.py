"""FlashInfer paged attention for CUDA (imported lazily; cannot run on a CPU-only machine).

Our pool stores one layer's K as [slots, KVH, D]; with `page_size` consecutive slots per page
this is exactly FlashInfer's "NHD" paged layout [num_pages, page_size, KVH, D], so the pool is
viewed, never copied. One plan per forward serves every layer: a pure-decode batch uses the
decode wrapper, anything else (prefill chunks, chain verifies, mixed batches) the prefill
wrapper (causal over ragged queries). For CUDA graphs each batch-size bucket gets its own
decode wrapper in graph mode over fixed buffers (`static_decode`), re-planned before every
replay.

Planning never waits for the device, so under overlap scheduling the forward thread plans step
N+1 while step N runs: `plan()` is fed pinned host tensors (a copy from pageable memory waits
for the stream), a graph wrapper its page ids already on the device (FlashInfer copies host
page ids into its fixed buffer with a blocking copy), and a wrapper is not planned again before
the device has taken its previous plan (`_PlanFence`: a plan writes its schedule into one
pinned buffer per wrapper and copies it to the device asynchronously).
Tree-shaped speculative verification is not wired for this backend (chain drafting only).

Limits (FlashInfer 0.7): fp16/bf16 only, head dims 64/128/256; `select_backend` checks them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from sessionserve.replicas.attention.base import AttentionBackend, ForwardMeta, SeqSpec, to_device

WORKSPACE_BYTES = 128 * 1024 * 1024
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
SUPPORTED_HEAD_DIMS = (64, 128, 256)


class _PlanFence:
    """One CUDA event per wrapper, recorded after its plan's copies were queued: the next plan
    of that wrapper waits for it before overwriting the pinned buffer they copy from (only
    while the device has not yet reached the previous step's forward)."""

    def __init__(self) -> None:
        self._events: dict[int, Any] = {}

    def before(self, wrapper: Any) -> None:
        event = self._events.get(id(wrapper))
        if event is not None:
            event.synchronize()

    def after(self, wrapper: Any) -> None:
        event = self._events.get(id(wrapper))
        if event is None:  # one per wrapper, recorded again each plan
            event = self._events[id(wrapper)] = torch.cuda.Event()
        event.record()


@dataclass
class _Plan:
    wrapper: Any  # the planned wrapper whose `run` every layer calls
    batch_size: int = 0  # static plans: the fixed batch size (padding included)


def page_table(seqs: list[SeqSpec], page_size: int) -> tuple[torch.Tensor, ...]:
    """Host int32 (kv_indptr [B+1], page ids [sum pages], last_page_len [B]) of `seqs`, whose
    positions are laid out page by page (slot // page_size is the page)."""
    lens = torch.tensor([s.ctx_len for s in seqs], dtype=torch.int32)
    counts = (lens + page_size - 1) // page_size
    indptr = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    torch.cumsum(counts, 0, out=indptr[1:])
    last = lens - (counts - 1) * page_size
    if not seqs:
        return indptr, torch.zeros(0, dtype=torch.int32), last
    flat = torch.cat([s.ctx_slots[::page_size] for s in seqs]) // page_size
    return indptr, flat.to(torch.int32), last


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
        num_pages: int,
    ) -> None:
        import flashinfer  # lazy: only CUDA deployments install it (extra "gpu")

        self._fi = flashinfer
        self.page_size, self.scaling, self.dtype, self.device = page_size, scaling, dtype, device
        self.dims = (num_heads, num_kv_heads, head_dim)
        self.num_pages = num_pages
        self.tensor_cores = num_heads // num_kv_heads > 4  # large GQA groups: decode on MMA
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self.tensor_cores
        )
        self.fence = _PlanFence()

    def prepare(self, seqs: list[SeqSpec], device: torch.device) -> _Plan:
        if any(s.tree_mask is not None for s in seqs):
            raise NotImplementedError("tree verification needs the torch backend; use chain")
        indptr, pages, last = (t.pin_memory() for t in page_table(seqs, self.page_size))
        if all(s.q_len == 1 for s in seqs):
            self._plan_decode(self.decode, indptr, pages, last)
            return _Plan(self.decode)
        qo = torch.zeros(len(seqs) + 1, dtype=torch.int32)
        torch.cumsum(torch.tensor([s.q_len for s in seqs], dtype=torch.int32), 0, out=qo[1:])
        self.fence.before(self.prefill)
        self.prefill.plan(
            qo.pin_memory(),
            indptr,
            pages,
            last,
            *self.dims,
            self.page_size,
            causal=True,
            sm_scale=self.scaling,
            q_data_type=self.dtype,
            kv_data_type=self.dtype,
        )
        self.fence.after(self.prefill)
        return _Plan(self.prefill)

    def _plan_decode(self, wrapper: Any, indptr: Any, pages: Any, last: Any) -> None:
        self.fence.before(wrapper)
        wrapper.plan(
            indptr,
            pages,
            last,
            *self.dims,
            self.page_size,
            sm_scale=self.scaling,
            q_data_type=self.dtype,
            kv_data_type=self.dtype,
        )
        self.fence.after(wrapper)

    # ---- static decode (CUDA graphs) ----
    def static_decode(self, batch_size: int, key: Any, device: torch.device) -> _Plan:
        i32 = {"dtype": torch.int32, "device": device}
        wrapper = self._fi.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace,
            "NHD",
            use_cuda_graph=True,
            use_tensor_cores=self.tensor_cores,
            paged_kv_indptr_buffer=torch.zeros(batch_size + 1, **i32),
            paged_kv_indices_buffer=torch.zeros(self.num_pages + batch_size, **i32),
            paged_kv_last_page_len_buffer=torch.ones(batch_size, **i32),
        )
        return _Plan(wrapper, batch_size)

    def fill_decode(self, static: _Plan, seqs: list[SeqSpec]) -> None:
        """Padding rows get one page, page 0 (reserved), holding one token."""
        pad = static.batch_size - len(seqs)
        indptr, pages, last = page_table(seqs, self.page_size)
        if pad:
            tail = indptr[-1] + torch.arange(1, pad + 1, dtype=torch.int32)
            indptr = torch.cat([indptr, tail])
            pages = torch.cat([pages, torch.zeros(pad, dtype=torch.int32)])
            last = torch.cat([last, torch.ones(pad, dtype=torch.int32)])
        pages = to_device(pages, self.device)  # its copy into the fixed buffer: device to device
        self._plan_decode(static.wrapper, indptr.pin_memory(), pages, last.pin_memory())

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
        if window is not None:  # select_backend never picks FlashInfer for such a model
            raise RuntimeError(f"layer {layer} has a sliding window ({window}): not planned")
        if abs(scaling - self.scaling) > 1e-6 * self.scaling:
            raise RuntimeError(
                f"layer {layer} asks for attention scale {scaling}, but FlashInfer was planned "
                f"with {self.scaling}; use attention_backend 'torch' for this model"
            )
        pool, (_, kv_heads, head_dim) = meta.kv_pool, self.dims
        paged = (
            pool.k[layer].view(-1, self.page_size, kv_heads, head_dim),
            pool.v[layer].view(-1, self.page_size, kv_heads, head_dim),
        )
        out = meta.plan.wrapper.run(q[0].transpose(0, 1).contiguous(), paged)  # [T, H, D]
        return out.unsqueeze(0)
