"""The KV tensors, indexed by the allocator's slots.

The target model and the EAGLE drafter each get a pool with their own layer count and head shape,
but both are indexed by the *same* slot numbers: a token's slot is allocated once and holds that
token's K/V in every layer of both models. So the allocator (and the memory invariant) covers the
drafter's KV for free, and freeing a slot frees it in both pools.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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


def as_stored(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` (new K or V) as attention reads it back from a pool of `dtype`, in `t`'s own dtype:
    rounded where the pool stores fewer bits (`cache.kv_dtype`), so a token's own step
    attends to the same K/V as every later step, on every path (eager, fresh prefill, the
    compiled decode step)."""
    return t if t.dtype == dtype else t.to(dtype).to(t.dtype)


def stack_layout(
    num_layers: int, sliding_layers: Sequence[int]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A pool's stacks for a model whose `sliding_layers` are kept apart: its layers in the
    stacks' order (the full layers' stack, then the sliding layers'), and each layer's index
    in its own stack."""
    sliding = sorted(set(sliding_layers))
    full = [i for i in range(num_layers) if i not in sliding]
    index = {layer: i for stack in (full, sliding) for i, layer in enumerate(stack)}
    return (*full, *sliding), tuple(index[layer] for layer in range(num_layers))


class KVPool:
    """Full-attention layers: `k[i]` and `v[i]` of shape [pool_slots, num_kv_heads, head_dim],
    indexed by the allocator's slots. Sliding-window layers, when the cache keeps their KV
    apart (`sliding_layers`), get `sliding_k` / `sliding_v` of [sliding_slots, ...] indexed by
    the sliding slots (cache/sliding.py); `layer_kv` says which a model layer uses. Without
    sliding layers, `k[layer]` is the model's layer itself."""

    def __init__(
        self,
        shape: KVShape,
        pool_slots: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        sliding_layers: Sequence[int] = (),
        sliding_slots: int = 0,
    ) -> None:
        if min(shape.num_layers, shape.num_kv_heads, shape.head_dim, pool_slots) < 1:
            raise InvalidConfigError(f"invalid KV pool shape {shape} with {pool_slots} slots")
        if sliding_layers and sliding_slots < 1:
            raise InvalidConfigError("sliding-window layers need sliding_slots >= 1")
        self.shape = shape
        self.dtype = dtype
        sliding = set(sliding_layers)
        # how a forward that returns every layer's new K/V at once lays them out
        # (`write_layers`), and where each layer's KV is in its stack
        self.stack_order, self.kv_index = stack_layout(shape.num_layers, sliding_layers)
        heads = (shape.num_kv_heads, shape.head_dim)
        full = shape.num_layers - len(sliding)
        self.k = torch.zeros((full, pool_slots, *heads), dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.sliding_k = torch.zeros(
            (len(sliding), sliding_slots, *heads), dtype=dtype, device=device
        )
        self.sliding_v = torch.zeros_like(self.sliding_k)
        # each model layer's (K, V, sliding), made once: a forward asks for them per layer,
        # and on a CPU that call runs with caches the weights just streamed through, where
        # slicing the pool again took ~6 us a layer (SmolLM2's 30 layers: 0.2 ms a step)
        self._layers = {
            layer: (
                (self.sliding_k[i], self.sliding_v[i], True)
                if layer in sliding
                else (self.k[i], self.v[i], False)
            )
            for layer, i in enumerate(self.kv_index)
        }
        # waits for forwards that may still be writing this pool (an overlapped step runs on
        # another thread): a copy into the pool from the host calls it first, so a slot freed
        # while such a forward wrote it cannot be overwritten by that forward after the copy
        self.fence: Callable[[], None] = _no_writers

    @property
    def pool_slots(self) -> int:
        return self.k.shape[1]

    @property
    def has_sliding(self) -> bool:
        return self.sliding_k.shape[0] > 0

    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes + self.sliding_k.nbytes + self.sliding_v.nbytes

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """The K and V tensors model layer `layer` reads, and whether they are the sliding
        ones (indexed by sliding slots)."""
        return self._layers[layer]

    def write(
        self,
        layer: int,
        slots: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sliding_slots: torch.Tensor | None = None,
    ) -> None:
        """Store new K/V ([n, num_kv_heads, head_dim]) of one layer at `slots` ([n]), or at
        `sliding_slots` for a sliding layer kept apart."""
        k_pool, v_pool, sliding = self._layers[layer]
        where = sliding_slots if sliding else slots
        if k.dtype != self.dtype or v.dtype != self.dtype:  # (a no-op `to` costs ~8 us here)
            k, v = k.to(self.dtype), v.to(self.dtype)
        k_pool.index_copy_(0, where, k)
        v_pool.index_copy_(0, where, v)

    def write_layers(
        self,
        slots: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sliding_slots: torch.Tensor | None = None,
    ) -> None:
        """Store new K/V of every layer at once ([num_layers, n, num_kv_heads, head_dim], the
        layers in `stack_order`, at `slots` [n], and at `sliding_slots` [n] for the sliding
        layers kept apart): one copy a stack for a forward whose layers did not write as they
        ran (a decode step compiled whole)."""
        if k.dtype != self.dtype or v.dtype != self.dtype:
            k, v = k.to(self.dtype), v.to(self.dtype)
        full = self.k.shape[0]
        self.k.index_copy_(1, slots, k[:full])
        self.v.index_copy_(1, slots, v[:full])
        if self.has_sliding:
            if sliding_slots is None:
                raise ValueError("the pool keeps sliding layers apart: give their slots")
            self.sliding_k.index_copy_(1, sliding_slots, k[full:])
            self.sliding_v.index_copy_(1, sliding_slots, v[full:])

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every full-attention layer's K/V at `src` to `dst` (a verified tree's kept
        path moving to its sequence's positions; all rows are read before any is written)."""
        self.fence()
        if self.has_sliding:
            raise NotImplementedError("moving KV rows kept in sliding slots")
        src, dst = src.to(self.k.device), dst.to(self.k.device)
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]


def _no_writers() -> None:
    """`KVPool.fence` when only the caller's own thread runs forwards."""
