"""A session's KV out of the pool: the unit of the host tier and of live migration.

A snapshot holds the KV of positions `[0, len(tokens))` of one session, for every pool that
shares the allocator's slots (the target model's and the EAGLE drafter's), as one contiguous
tensor per pool: `[2 (k, v), num_layers, len, num_kv_heads, head_dim]`. Contiguous, because it
is copied as a whole (device -> pinned host memory on CUDA) and sent as a whole (Ray's object
store, zero-copy for tensors); independent of page size and slot numbers, because the replica
that restores it allocates its own slots.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sessionserve.cache.kv_pool import KVPool
from sessionserve.errors import IncompatibleSnapshotError


@dataclass
class KVSnapshot:
    tokens: list[int]  # position i holds the KV of tokens[i]
    kv: list[torch.Tensor]  # one per pool: [2, num_layers, len(tokens), num_kv_heads, head_dim]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.kv)

    def __len__(self) -> int:
        return len(self.tokens)

    def prefix(self, n: int) -> KVSnapshot:
        """The first `n` positions, copied (a view would keep the whole buffer alive)."""
        return KVSnapshot(self.tokens[:n], [t[:, :, :n].clone() for t in self.kv])


def gather(pools: Sequence[KVPool], slots: torch.Tensor, tokens: Sequence[int]) -> KVSnapshot:
    """Copy the KV at `slots` (one per token) out of every pool. On CUDA the copy lands in
    pinned host memory without blocking the host: it is ordered before any later kernel on the
    stream (so the freed slots can be reused at once); `synchronize` before reading it on the
    host (export does)."""
    if slots.numel() != len(tokens):
        raise ValueError(f"{slots.numel()} slots for {len(tokens)} tokens")
    out = []
    for pool in pools:
        idx = slots.to(pool.k.device)
        both = torch.stack((pool.k.index_select(1, idx), pool.v.index_select(1, idx)))
        if both.device.type == "cuda":
            host = torch.empty(both.shape, dtype=both.dtype, pin_memory=True)
            host.copy_(both, non_blocking=True)
            both = host
        out.append(both)
    return KVSnapshot(list(tokens), out)


def scatter(
    pools: Sequence[KVPool], snap: KVSnapshot, start: int, end: int, slots: torch.Tensor
) -> None:
    """Write positions `[start, end)` of `snap` into `slots` of every pool (host -> device
    asynchronously on CUDA, ordered before the forward that reads them)."""
    check_compatible(pools, snap)
    if slots.numel() != end - start:
        raise ValueError(f"{slots.numel()} slots for positions [{start}, {end})")
    for pool, t in zip(pools, snap.kv, strict=True):
        part = t[:, :, start:end].to(pool.k.device, non_blocking=True)
        idx = slots.to(pool.k.device)
        pool.k.index_copy_(1, idx, part[0])
        pool.v.index_copy_(1, idx, part[1])


def check_compatible(pools: Sequence[KVPool], snap: KVSnapshot) -> None:
    """A snapshot restores only into pools of the same models, dtype and drafter."""
    if len(snap.kv) != len(pools):
        raise IncompatibleSnapshotError(
            f"the snapshot has KV of {len(snap.kv)} model(s), this replica {len(pools)} "
            "(one with an EAGLE drafter and one without?)"
        )
    for pool, t in zip(pools, snap.kv, strict=True):
        s = pool.shape
        want = (2, s.num_layers, len(snap.tokens), s.num_kv_heads, s.head_dim)
        if tuple(t.shape) != want or t.dtype != pool.dtype:
            raise IncompatibleSnapshotError(
                f"snapshot KV {tuple(t.shape)} {t.dtype} does not fit this replica's pool "
                f"{want} {pool.dtype}: the replicas serve different models or dtypes"
            )
