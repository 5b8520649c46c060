"""The attention backend interface and the per-forward metadata it consumes.

A forward runs the tokens of every scheduled sequence flattened into one row ([1, T]); each
sequence contributes `q_len` new tokens that attend to its `ctx_len` context tokens (the cached
prefix plus the new tokens themselves). The model runner describes the batch with `SeqSpec`s,
the backend turns them into whatever its kernels need (`prepare`, once per forward), and
`forward` is then called once per layer from inside the transformers model.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
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

    @property
    def ctx_len(self) -> int:
        return self.ctx_slots.numel()


@dataclass
class ForwardMeta:
    """Handed to every layer through the model's kwargs (`paged_meta=`)."""

    backend: AttentionBackend
    kv_pool: KVPool
    out_slots: torch.Tensor  # [T] slot each new token's K/V is written to
    plan: Any  # backend-specific, built by `prepare`


class AttentionBackend(ABC):
    name: str

    @abstractmethod
    def prepare(self, seqs: list[SeqSpec], device: torch.device) -> Any:
        """Precompute index and mask tensors for one forward (shared by all layers)."""

    @abstractmethod
    def forward(
        self,
        layer: int,
        q: torch.Tensor,  # [1, H, T, D]
        k: torch.Tensor,  # [1, KVH, T, D] new tokens only
        v: torch.Tensor,
        meta: ForwardMeta,
        scaling: float,
    ) -> torch.Tensor:
        """Write the new K/V into the pool at `meta.out_slots`, then attend; returns
        [1, T, H, D] as transformers expects from an attention function."""
