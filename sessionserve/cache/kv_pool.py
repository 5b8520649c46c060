"""The KV tensors, indexed by the allocator's slots.

The target model and the EAGLE drafter each get a pool with their own layer count and head shape,
but both are indexed by the *same* slot numbers: a token's slot is allocated once and holds that
token's K/V in every layer of both models. So the allocator (and the memory invariant) covers the
drafter's KV for free, and freeing a slot frees it in both pools.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from sessionserve.errors import InvalidConfigError


@dataclass(frozen=True)
class KVShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def from_hf_config(cls, config: Any) -> KVShape:
        """Read the shape from a transformers config (Llama, Qwen2, Mistral and the like)."""
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        return cls(config.num_hidden_layers, num_kv_heads, head_dim)

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        elem = torch.empty(0, dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem


class KVPool:
    """Per layer: `k[layer]` and `v[layer]` of shape [pool_slots, num_kv_heads, head_dim]."""

    def __init__(
        self,
        shape: KVShape,
        pool_slots: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if min(shape.num_layers, shape.num_kv_heads, shape.head_dim, pool_slots) < 1:
            raise InvalidConfigError(f"invalid KV pool shape {shape} with {pool_slots} slots")
        self.shape = shape
        self.dtype = dtype
        dims = (shape.num_layers, pool_slots, shape.num_kv_heads, shape.head_dim)
        self.k = torch.zeros(dims, dtype=dtype, device=device)
        self.v = torch.zeros(dims, dtype=dtype, device=device)

    @property
    def pool_slots(self) -> int:
        return self.k.shape[1]

    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new K/V ([n, num_kv_heads, head_dim]) of one layer at `slots` ([n])."""
        self.k[layer].index_copy_(0, slots, k.to(self.dtype))
        self.v[layer].index_copy_(0, slots, v.to(self.dtype))
