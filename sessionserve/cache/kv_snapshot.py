"""A session's KV out of the pool: the unit of the host tier and of live migration.

A snapshot holds the KV of positions `[0, len(tokens))` of one session, for every pool that
shares the allocator's slots (the target model's and the EAGLE drafter's), as one contiguous
tensor per pool: `[2 (k, v), num_layers, len, num_kv_heads, head_dim]`. Contiguous, because it
is copied as a whole (device -> pinned host memory on CUDA) and sent as a whole (Ray's object
store, zero-copy for tensors); independent of page size and slot numbers, because the replica
that restores it allocates its own slots.

With sliding-window layers kept apart (cache/sliding.py), `kv` holds the full-attention layers
and `sliding_kv` the sliding layers' KV of the positions `[sliding_from, len)` only: the window
the session goes on from, which is all the replica holds of them.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from sessionserve.cache.kv_pool import KVPool
from sessionserve.cache.sliding import SlidingSlots
from sessionserve.errors import IncompatibleSnapshotError


@dataclass
class KVSnapshot:
    tokens: list[int]  # position i holds the KV of tokens[i]
    kv: list[torch.Tensor]  # one per pool: [2, num_layers, len(tokens), num_kv_heads, head_dim]
    # one per pool when sliding layers are kept apart: [2, sliding_layers, len - sliding_from,
    # num_kv_heads, head_dim]; empty otherwise
    sliding_kv: list[torch.Tensor] = field(default_factory=list)
    sliding_from: int = 0

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.kv) + sum(t.nbytes for t in self.sliding_kv)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getstate__(self) -> dict:
        """Pickled (Ray's object store), the tensors travel as raw numpy bytes: the store
        maps those without a copy, where a pickled torch tensor is copied twice each way."""
        return {
            "tokens": self.tokens,
            "kv": [(_raw(t), t.dtype, tuple(t.shape)) for t in self.kv],
            "sliding_kv": [(_raw(t), t.dtype, tuple(t.shape)) for t in self.sliding_kv],
            "sliding_from": self.sliding_from,
        }

    def __setstate__(self, state: dict) -> None:
        self.tokens = state["tokens"]
        self.kv = [_from_raw(raw, dtype, shape) for raw, dtype, shape in state["kv"]]
        self.sliding_kv = [_from_raw(r, dtype, shape) for r, dtype, shape in state["sliding_kv"]]
        self.sliding_from = state["sliding_from"]


def _raw(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(-1).view(torch.uint8).numpy()  # any dtype, bf16 included


def _from_raw(raw: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    with warnings.catch_warnings():  # a read-only buffer (the object store's): only read
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(raw).view(dtype).view(shape)


def gather(
    pools: Sequence[KVPool],
    slots: torch.Tensor,
    tokens: Sequence[int],
    page_size: int = 1,
    sliding: SlidingSlots | None = None,
) -> KVSnapshot:
    """Copy the KV at `slots` (one per token) out of every pool (and, with `sliding`, the
    sliding layers' KV of the window the positions end with). On CUDA the copy lands in
    pinned host memory without blocking the host: it is ordered before any later kernel on the
    stream (so the freed slots can be reused at once); `synchronize` before reading it on the
    host (export does)."""
    if slots.numel() != len(tokens):
        raise ValueError(f"{slots.numel()} slots for {len(tokens)} tokens")
    kv = [to_host(copy_out(pool.k, pool.v, slots, page_size)) for pool in pools]
    start, window = gather_window(pools, slots, sliding)
    return KVSnapshot(list(tokens), kv, window, start)


def gather_window(
    pools: Sequence[KVPool], slots: torch.Tensor, sliding: SlidingSlots | None
) -> tuple[int, list[torch.Tensor]]:
    """The sliding layers' KV of the window positions `[0, len(slots))` end with, in host
    memory, and the first position it holds: (0, []) without sliding layers kept apart."""
    if sliding is None or not any(pool.has_sliding for pool in pools):
        return 0, []
    start = slots.numel() - min(sliding.resident_suffix(slots), sliding.keep)
    where = sliding.lookup(slots[start:])
    return start, [to_host(copy_out(p.sliding_k, p.sliding_v, where, 1)) for p in pools]


def copy_out(
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    page_size: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`[2, layers, len(slots), heads, dim]`: K and V at `slots`, on the pool's device (in
    `out` when given: each layer's rows contiguous, as a slice of a longer buffer's are)."""
    idx = slots.to(k.device)
    layers, _, heads, dim = k.shape
    both = out
    if both is None:
        both = torch.empty((2, layers, idx.numel(), heads, dim), dtype=k.dtype, device=k.device)
    _read(k, idx, page_size, both[0])
    _read(v, idx, page_size, both[1])
    return both


def to_host(t: torch.Tensor) -> torch.Tensor:
    """`t` in host memory: on CUDA copied into pinned memory without blocking the host."""
    if t.device.type != "cuda":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


def scatter(
    pools: Sequence[KVPool],
    snap: KVSnapshot,
    start: int,
    end: int,
    slots: torch.Tensor,
    page_size: int = 1,
    window: tuple[int, torch.Tensor] | None = None,
) -> None:
    """Write positions `[start, end)` of `snap` into `slots` of every pool (host -> device
    asynchronously on CUDA, ordered before the forward that reads them); `window`: the first
    position of `[.., end)` whose sliding layers' KV goes in too, and the sliding slots it
    goes to."""
    check_compatible(pools, snap)
    if slots.numel() != end - start:
        raise ValueError(f"{slots.numel()} slots for positions [{start}, {end})")
    for pool in pools:
        pool.fence()
    for pool, t in zip(pools, snap.kv, strict=True):
        copy_in(pool.k, pool.v, t[:, :, start:end], slots, page_size)
    scatter_window(pools, snap.sliding_kv, snap.sliding_from, end, window)


def scatter_window(
    pools: Sequence[KVPool],
    sliding_kv: Sequence[torch.Tensor],
    sliding_from: int,
    end: int,
    window: tuple[int, torch.Tensor] | None,
) -> None:
    """Write the sliding layers' KV of positions `[window[0], end)` (held from `sliding_from`
    on, one tensor per pool) into the sliding slots `window[1]`; nothing when `window` is None
    or no sliding KV is held."""
    if window is None or not sliding_kv:
        return
    first, where = window
    if first < sliding_from or where.numel() != end - first:
        raise ValueError(f"the snapshot holds sliding KV from {sliding_from}, not {first}")
    lo, hi = first - sliding_from, end - sliding_from
    for pool, t in zip(pools, sliding_kv, strict=True):
        copy_in(pool.sliding_k, pool.sliding_v, t[:, :, lo:hi], where, 1)


def copy_in(
    k: torch.Tensor, v: torch.Tensor, part: torch.Tensor, slots: torch.Tensor, page_size: int
) -> None:
    """`k[:, slots], v[:, slots] = part[0], part[1]` (`part`: `[2, layers, len(slots), ...]`)."""
    part = part.to(k.device, non_blocking=True)
    idx = slots.to(k.device)
    _write(k, idx, part[0], page_size)
    _write(v, idx, part[1], page_size)


def whole_pages(slots: torch.Tensor, page_size: int) -> torch.Tensor | None:
    """The pages holding `slots` if they are whole pages in order (positions of a row from a
    page boundary always are, but a last partial page), else None: then copies go page by
    page (a few hundred copies) instead of token by token (thousands per layer)."""
    n = slots.numel()
    if page_size == 1 or n < page_size:
        return None
    pages = slots[::page_size] // page_size
    expect = (pages[:, None] * page_size + torch.arange(page_size, device=slots.device)).flatten()
    return pages if torch.equal(expect[:n], slots) else None


def _read(t: torch.Tensor, slots: torch.Tensor, page_size: int, out: torch.Tensor) -> None:
    """`out[:] = t[:, slots]` for a pool tensor [layers, pool_slots, heads, dim], straight
    into `out` (contiguous [layers, len(slots), heads, dim]): no temporary copy."""
    pages = whole_pages(slots, page_size)
    if pages is None:
        torch.index_select(t, 1, slots, out=out)
        return
    n, full = slots.numel(), slots.numel() // page_size
    layers, _, heads, dim = t.shape
    paged = t.view(layers, -1, page_size, heads, dim)
    for layer in range(layers):  # each layer's rows of `out` are contiguous
        dest = out[layer, : full * page_size].view(full, page_size, heads, dim)
        torch.index_select(paged[layer], 0, pages[:full], out=dest)
    if n > full * page_size:  # the last, partial page
        out[:, full * page_size :] = t.index_select(1, slots[full * page_size :])


def _write(t: torch.Tensor, slots: torch.Tensor, values: torch.Tensor, page_size: int) -> None:
    """`t[:, slots] = values` for a pool tensor [layers, pool_slots, heads, dim]."""
    pages = whole_pages(slots, page_size)
    if pages is None:
        t.index_copy_(1, slots, values)
        return
    full = slots.numel() // page_size
    layers, _, heads, dim = t.shape
    if full:
        block = values[:, : full * page_size].reshape(layers, full, page_size, heads, dim)
        t.view(layers, -1, page_size, heads, dim).index_copy_(1, pages[:full], block)
    if slots.numel() > full * page_size:  # the last, partial page
        t.index_copy_(1, slots[full * page_size :], values[:, full * page_size :])


def check_compatible(pools: Sequence[KVPool], snap: KVSnapshot) -> None:
    """A snapshot restores only into pools of the same models, dtype and drafter."""
    if len(snap.kv) != len(pools):
        raise IncompatibleSnapshotError(
            f"the snapshot has KV of {len(snap.kv)} model(s), this replica {len(pools)} "
            "(one with an EAGLE drafter and one without?)"
        )
    if bool(snap.sliding_kv) != any(pool.has_sliding for pool in pools):
        raise IncompatibleSnapshotError(
            "one replica keeps the sliding-window layers' KV apart and the other does not "
            "(cache.sliding_window_kv differs)"
        )
    for i, pool in enumerate(pools):
        parts = [(snap.kv[i], pool.k, len(snap.tokens))]
        if snap.sliding_kv:
            parts.append((snap.sliding_kv[i], pool.sliding_k, len(snap.tokens) - snap.sliding_from))
        for t, ours, length in parts:
            want = (2, ours.shape[0], length, *ours.shape[2:])
            if tuple(t.shape) != want or t.dtype != pool.dtype:
                raise IncompatibleSnapshotError(
                    f"snapshot KV {tuple(t.shape)} {t.dtype} does not fit this replica's pool "
                    f"{want} {pool.dtype}: the replicas serve different models or dtypes"
                )
