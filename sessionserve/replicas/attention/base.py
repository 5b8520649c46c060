"""The attention backend interface and the per-forward metadata it consumes.

A forward runs the tokens of every scheduled sequence flattened into one row ([1, T]); each
sequence contributes `q_len` new tokens that attend to its `ctx_len` context tokens (the cached
prefix plus the new tokens themselves). The model runner describes the batch with `SeqSpec`s,
the backend turns them into whatever its kernels need (`prepare`, once per forward, built on the
host and copied to the device once), and `forward` is then called once per layer from inside the
transformers model, after the new K/V have been written to the pool.

Pure-decode batches can also run on *static* metadata (`static_decode` / `fill_decode`): buffers
of a fixed batch size (padding rows point at the reserved slot 0), so the whole forward can be
captured once in a CUDA graph and replayed (see cuda_graphs.py); rows of several new tokens
(short extends, speculative verifies) likewise (`static_extend` / `fill_rows`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch

from sessionserve.cache.kv_pool import KVPool


@dataclass(frozen=True)
class SeqSpec:
    q_len: int  # new tokens of this sequence in this forward
    ctx_slots: torch.Tensor  # [ctx_len] KV slots of positions 0..ctx_len-1 (new ones included)
    tree_mask: torch.Tensor | None = None  # [q_len, q_len] bool: which new tokens see which
    # (speculative tree verification); None = causal among the new tokens
    sliding_slots: torch.Tensor | None = None  # when the cache keeps sliding layers' KV apart:
    # the sliding slots of the last `window - 1 + q_len` context positions (all, if fewer)

    @property
    def ctx_len(self) -> int:
        return self.ctx_slots.numel()


@dataclass
class ForwardMeta:
    """Handed to every layer through the model's kwargs (`paged_meta=`)."""

    backend: AttentionBackend
    kv_pool: KVPool
    out_slots: torch.Tensor  # [T] slot each new token's K/V is written to
    plan: Any  # backend-specific, built by `prepare` (or static, from `static_decode`)
    sliding_out_slots: torch.Tensor | None = None  # [T] the same in the sliding slots


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """One host-to-device copy that does not stall the host (pinned source on CUDA); a tensor
    already on a GPU is only moved (if need be) to `device`."""
    if device.type != "cuda" or host.is_cuda:
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class AttentionBackend(ABC):
    name: str

    @abstractmethod
    def prepare(self, seqs: list[SeqSpec], device: torch.device) -> Any:
        """Index and mask tensors for one forward (shared by all layers)."""

    @abstractmethod
    def forward(
        self,
        layer: int,
        q: torch.Tensor,  # [1, H, T, D]
        k: torch.Tensor,  # [1, KVH, T, D] new tokens only (already written to the pool)
        v: torch.Tensor,
        meta: ForwardMeta,
        scaling: float,
        window: int | None = None,
    ) -> torch.Tensor:
        """Attend over the pool; returns [1, T, H, D] as transformers expects. `window`: a
        sliding-window layer's W (a token sees itself and the W - 1 positions before it, as
        transformers' `sliding_window_overlay`); None for full attention."""

    # ---- static decode metadata (CUDA graphs) ----
    def graph_key(self, seqs: list[SeqSpec]) -> Hashable | None:
        """Besides the batch size, what a static decode plan's shapes depend on (None: this
        batch cannot run on static metadata, e.g. a context beyond every bucket)."""
        return 0

    def static_decode(self, batch_size: int, key: Hashable, device: torch.device) -> Any:
        """Buffers of a decode plan for `batch_size` one-token sequences."""
        raise NotImplementedError(f"the {self.name} backend has no static decode path")

    def fill_decode(self, static: Any, seqs: list[SeqSpec]) -> None:
        """Write this step's sequences into `static` (rows past len(seqs) become padding that
        reads and writes only slot 0)."""
        raise NotImplementedError(f"the {self.name} backend has no static decode path")

    # ---- static rows of several tokens (CUDA graphs of extends and verifies) ----
    def static_extend(
        self, q_len: int, width: Hashable, device: torch.device, rows: int = 1
    ) -> Any:
        """Buffers of a plan for `rows` sequences of `q_len` new tokens each (padded), row b's
        queries being flat tokens b * q_len ..; `width` is `graph_key`'s context bucket."""
        raise NotImplementedError(f"the {self.name} backend has no static rows path")

    def fill_rows(self, static: Any, seqs: list[SeqSpec]) -> None:
        """Write this step's sequences (each at most q_len new tokens) into `static`'s first
        rows; their padding queries and the rows past them are discarded."""
        raise NotImplementedError(f"the {self.name} backend has no static rows path")
