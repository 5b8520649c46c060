"""FlashInfer paged attention for CUDA (imported lazily; cannot run on a CPU-only machine).

Our pool stores one layer's K as [slots, KVH, D]; with `page_size` consecutive slots per page
this is exactly FlashInfer's "NHD" paged layout [num_pages, page_size, KVH, D], so the pool is
viewed, never copied. One plan per forward serves every layer: a pure-decode batch uses the
decode wrapper, anything else (prefill chunks, chain verifies, mixed batches) the prefill
wrapper (causal over ragged queries). For CUDA graphs each batch-size bucket gets its own
decode wrapper in graph mode over fixed buffers (`static_decode`), re-planned before every
replay; so do speculative decoding's verify steps, over a prefill wrapper in graph mode whose
rows all hold the graph's query length (`static_extend`, `fill_rows`: a row's padding queries
come after its real ones and attend over as many padding positions after its context, so its
real queries see exactly their causal context).

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

import functools
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np
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
    q_len: int = 1  # static plans: the query tokens of every row (padding included)
    # a static decode plan's buffers, in one device tensor: kv_indptr [B+1], last_page_len
    # [B], then page ids (`fast_fill`); planned: the wrapper has had one regular plan
    meta: torch.Tensor | None = None
    planned: bool = False


def _meta_offsets(rows: int) -> tuple[int, int]:
    """Where a `_Plan.meta`'s last_page_len and page ids start: each 16-byte aligned (int32s
    in fours), as a buffer allocated alone would be."""
    last_at = -(-(rows + 1) // 4) * 4
    return last_at, last_at + -(-rows // 4) * 4


def meta_views(meta: Any, rows: int) -> tuple[Any, ...]:
    """`_Plan.meta`'s (or its host copy's, torch or numpy) kv_indptr [rows+1], last_page_len
    [rows] and page ids."""
    last_at, pages_at = _meta_offsets(rows)
    return meta[: rows + 1], meta[last_at : last_at + rows], meta[pages_at:]


def meta_size(rows: int, pages: int) -> int:
    """int32s in a `_Plan.meta` of `rows` rows with room for `pages` page ids."""
    return _meta_offsets(rows)[1] + pages


def fast_fill(
    indptr: torch.Tensor, pages: torch.Tensor, last: torch.Tensor, pin: bool
) -> torch.Tensor:
    """A static decode plan's three host tables laid out as `_Plan.meta` (`meta_views`), in
    one (pinned) host tensor, filled in numpy: one copy fills all three buffers."""
    rows = last.numel()
    host = torch.zeros(meta_size(rows, pages.numel()), dtype=torch.int32, pin_memory=pin)
    for view, table in zip(meta_views(host.numpy(), rows), (indptr, last, pages), strict=True):
        view[:] = table.numpy()
    return host


def page_table(
    seqs: list[SeqSpec], page_size: int, rows: int | None = None
) -> tuple[torch.Tensor, ...]:
    """Host int32 (kv_indptr [B+1], page ids [sum pages], last_page_len [B]) of `seqs`, whose
    positions are laid out page by page (slot // page_size is the page), and of `rows` - B
    padding rows after them (a decode graph's fixed batch), each one page, page 0 (reserved),
    holding one token: `padded_rows_page_table`'s one-query rows, without its per-row padding
    (a decode's rows need none). Built in numpy over views of the rows' slots: the forward
    thread builds one every decode step, and torch's per-row slicing cost 220 us at 32 rows
    against 80 (a 2-core Zen 3; the H200 run's forward thread spent most of an overlapped step
    at 32 here, docs/benchmarks.md)."""
    pad = (len(seqs) if rows is None else rows) - len(seqs)
    if pad < 0:
        raise ValueError(f"{len(seqs)} sequences in a plan of {rows} rows")
    lens = np.ones(len(seqs) + pad, dtype=np.int32)
    lens[: len(seqs)] = np.fromiter((s.ctx_len for s in seqs), dtype=np.int32, count=len(seqs))
    indptr, last = _kv_indptr_and_last(lens, page_size)
    pages = [s.ctx_slots.numpy()[::page_size] for s in seqs] + [np.zeros(pad, dtype=np.int64)]
    return _as_torch(indptr, _page_ids(pages, page_size), last)


def padded_rows_page_table(
    seqs: list[SeqSpec], q_len: int, rows: int, page_size: int
) -> tuple[torch.Tensor, ...]:
    """Host int32 (qo_indptr [rows+1], kv_indptr [rows+1], page ids, last_page_len [rows]) for
    `rows` rows of `q_len` query tokens each, the first `len(seqs)` holding `seqs` (each at
    most `q_len` new tokens, its padding queries after them). FlashInfer aligns a row's causal
    mask at the end of its KV (query i sees the first `kv_len - q_len + i + 1` positions), so a
    row of `n` real tokens gets `q_len - n` padding positions after its context: its real
    queries then see exactly their context, its padding queries (discarded) the padding too.
    Padding positions past the row's last page read page 0 (reserved); padding rows are
    `q_len` positions of page 0."""
    lens, pages = [], []
    for s in seqs:
        if s.q_len > q_len:
            raise ValueError(f"a row of {s.q_len} new tokens in a plan of {q_len} a row")
        padded = s.ctx_len + q_len - s.q_len
        real = s.ctx_slots.numpy()[::page_size]
        pages += [real, np.zeros(-(-padded // page_size) - len(real), dtype=real.dtype)]
        lens.append(padded)
    pad = rows - len(seqs)
    if pad < 0:
        raise ValueError(f"{len(seqs)} sequences in a plan of {rows} rows")
    lens += [q_len] * pad
    pages.append(np.zeros(pad * -(-q_len // page_size), dtype=np.int64))
    kv_indptr, last = _kv_indptr_and_last(np.array(lens, dtype=np.int32), page_size)
    qo_indptr = np.arange(rows + 1, dtype=np.int32) * q_len
    return _as_torch(qo_indptr, kv_indptr, _page_ids(pages, page_size), last)


def _kv_indptr_and_last(lens: np.ndarray, page_size: int) -> tuple[np.ndarray, np.ndarray]:
    """int32 kv_indptr [B+1] and last_page_len [B] of rows holding `lens` positions."""
    counts = (lens + page_size - 1) // page_size
    indptr = np.zeros(len(lens) + 1, dtype=np.int32)
    np.cumsum(counts, out=indptr[1:])
    return indptr, (lens - (counts - 1) * page_size).astype(np.int32)


def _page_ids(first_slots: list[np.ndarray], page_size: int) -> np.ndarray:
    """int32 page ids of each row's page-first slots, rows concatenated."""
    if not first_slots:
        return np.zeros(0, dtype=np.int32)
    return (np.concatenate(first_slots) // page_size).astype(np.int32)


def _as_torch(*arrays: np.ndarray) -> tuple[torch.Tensor, ...]:
    return tuple(torch.from_numpy(a) for a in arrays)


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"
    # A decode graph's plan fills the wrapper's buffers itself, with one copy, and re-plans
    # through FlashInfer's `fast_decode_plan` (SGLang's), which skips `plan()`'s argument
    # handling and its three buffer copies: 2-4% off a decode step at 32 and 64 requests on an
    # H200 (2026-12-04 run S; benchmarks/gpu.py --fast-plan keeps the A/B). Set it before the
    # first decode step: a graph's buffers are laid out when it is built.
    fast_plan = True

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
        max_context_len: int | None = None,
    ) -> None:
        import flashinfer  # lazy: only CUDA deployments install it (extra "gpu")

        self._fi = flashinfer
        self.page_size, self.scaling, self.dtype, self.device = page_size, scaling, dtype, device
        self.dims = (num_heads, num_kv_heads, head_dim)
        self.num_pages = num_pages
        self.max_context_len = max_context_len
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
        self._plan_prefill(self.prefill, qo.pin_memory(), indptr, pages, last)
        return _Plan(self.prefill)

    def _plan_prefill(self, wrapper: Any, qo: Any, indptr: Any, pages: Any, last: Any) -> None:
        """Causal attention of each row's queries over its pages (the last `qo` lengths of
        its KV)."""
        self.fence.before(wrapper)
        wrapper.plan(
            qo,
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
        self.fence.after(wrapper)

    def _plan_decode(
        self, wrapper: Any, indptr: Any, pages: Any, last: Any, fast: bool = False
    ) -> None:
        """`fast`: through FlashInfer's `fast_decode_plan`, the graph's buffers already filled
        (`_fast_plan_decode`); else `plan()`, which fills them."""
        plan = functools.partial(self._fi.fast_decode_plan, wrapper) if fast else wrapper.plan
        self.fence.before(wrapper)
        plan(
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
        rows, capacity, i32 = batch_size, self._page_capacity(batch_size, 1), torch.int32
        meta = None
        if self.fast_plan:  # the three buffers in one tensor, filled by one copy
            meta = torch.zeros(meta_size(rows, capacity), dtype=i32, device=device)
            indptr, last, pages = meta_views(meta, rows)
            last.fill_(1)
        else:
            indptr = torch.zeros(rows + 1, dtype=i32, device=device)
            last = torch.ones(rows, dtype=i32, device=device)
            pages = torch.zeros(capacity, dtype=i32, device=device)
        wrapper = self._fi.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace,
            "NHD",
            use_cuda_graph=True,
            use_tensor_cores=self.tensor_cores,
            paged_kv_indptr_buffer=indptr,
            paged_kv_indices_buffer=pages,
            paged_kv_last_page_len_buffer=last,
        )
        return _Plan(wrapper, batch_size, meta=meta)

    def fill_decode(self, static: _Plan, seqs: list[SeqSpec]) -> None:
        """Padding rows get one page, page 0 (reserved), holding one token (`page_table`)."""
        indptr, pages, last = page_table(seqs, self.page_size, static.batch_size)
        if self.fast_plan and static.planned and static.meta is not None:
            self._fast_plan_decode(static, indptr, pages, last)
            return
        pages = to_device(pages, self.device)  # its copy into the fixed buffer: device to device
        self._plan_decode(static.wrapper, indptr.pin_memory(), pages, last.pin_memory())
        static.planned = True  # (`fast_decode_plan` reuses what this plan set up)

    def _fast_plan_decode(
        self, static: _Plan, indptr: torch.Tensor, pages: torch.Tensor, last: torch.Tensor
    ) -> None:
        """`fill_decode` through `fast_decode_plan`: the buffers filled here, with one copy
        queued behind the step in flight (which reads them), and the host schedule planned
        from the host tables."""
        assert static.meta is not None
        host = fast_fill(indptr, pages, last, pin=self.device.type == "cuda")
        static.meta[: host.numel()].copy_(host, non_blocking=True)
        indptr, last, pages = meta_views(host, static.batch_size)  # (host: what it plans from)
        self._plan_decode(static.wrapper, indptr, pages, last, fast=True)

    def _page_capacity(self, rows: int, q_len: int) -> int:
        """Page ids a static plan of `rows` rows of `q_len` new tokens may list: each row's own
        pages (its context, at most `max_context_len` positions, plus a verify row's padding).
        Not bounded by the pool's pages: rows sharing a prefix (a system prompt held once in
        the radix tree) list its pages once each."""
        per_row = self.num_pages
        if self.max_context_len is not None:
            per_row = min(per_row, -(-(self.max_context_len + q_len) // self.page_size))
        return rows * (per_row + 1)

    # ---- static rows: verify steps (CUDA graphs; `graph_key` is the base's one bucket, as
    # FlashInfer reads each row's pages wherever they are, whatever the context's length) ----
    def static_extend(
        self, q_len: int, width: Hashable, device: torch.device, rows: int = 1
    ) -> _Plan:
        """A prefill wrapper in graph mode for `rows` rows of `q_len` query tokens each (row
        b's queries are flat tokens b * q_len ..), over fixed buffers; `width` (the torch
        backend's context bucket) is unused."""
        i32 = {"dtype": torch.int32, "device": device}
        wrapper = self._fi.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace,
            "NHD",
            use_cuda_graph=True,
            qo_indptr_buf=torch.arange(rows + 1, **i32) * q_len,
            paged_kv_indptr_buf=torch.zeros(rows + 1, **i32),
            paged_kv_indices_buf=torch.zeros(self._page_capacity(rows, q_len), **i32),
            paged_kv_last_page_len_buf=torch.ones(rows, **i32),
        )
        return _Plan(wrapper, rows, q_len)

    def fill_rows(self, static: _Plan, seqs: list[SeqSpec]) -> None:
        """Plan `static` for `seqs` in its first rows (`padded_rows_page_table`); every plan
        has the same rows and query tokens, as a graph-mode wrapper requires."""
        qo, indptr, pages, last = padded_rows_page_table(
            seqs, static.q_len, static.batch_size, self.page_size
        )
        pages = to_device(pages, self.device)  # its copy into the fixed buffer: device to device
        qo, indptr, last = (t.pin_memory() for t in (qo, indptr, last))
        self._plan_prefill(static.wrapper, qo, indptr, pages, last)

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
