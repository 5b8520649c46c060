"""The host tier: where an idle session's KV goes when the device pool evicts it.

Without it, an evicted session keeps only its token log and its next turn re-prefills the
whole history. With it, eviction first copies the KV out (`kv_snapshot.gather`) into host
memory under a byte budget of its own; the next turn copies it back and prefills only the new
tokens. Least recently parked goes first when the budget is short; a session dropped from
the tier falls back to re-prefill, as before. Plain data and bookkeeping: the session cache
decides what goes in and comes out, the memory checker proves the byte count.

With pools in host memory the tier also lends the buffers snapshots are copied into
(`buffer`) and takes them back when a snapshot leaves (restored, dropped or evicted): a
spilled session then lands in memory the process has touched before. Fresh memory costs its
page faults, which on a VM can be 20-50x the copy itself (docs/benchmarks.md). The budget
bounds what the tier holds: parked snapshots' buffers and the spare ones together. (On CUDA
the snapshots are pinned memory, which torch's host allocator already recycles.)
"""

from __future__ import annotations

from collections import OrderedDict, deque

import torch

from sessionserve.cache.kv_snapshot import KVSnapshot
from sessionserve.errors import InvalidConfigError

REUSE_SLACK = 1.25  # a spare buffer serves a snapshot of at least 1/1.25 of its size


class HostTier:
    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 1:
            raise InvalidConfigError(f"host tier budget {budget_bytes} bytes: must be >= 1")
        self.budget_bytes = budget_bytes
        self.entries: OrderedDict[str, KVSnapshot] = OrderedDict()  # least recent first
        self.bytes_in_use = 0  # the parked snapshots' KV bytes
        self.entry_capacity = 0  # the memory they hold (a reused buffer may be larger)
        self.spares: list[torch.Tensor] = []  # buffers no snapshot uses, kept for the next ones
        self.spare_bytes = 0
        self.parked_total = 0  # snapshots stored
        self.restored_total = 0  # snapshots taken back into the pool
        self.evicted_total = 0  # snapshots dropped for the budget (or too big to keep)
        self.reused_total = 0  # buffers lent again rather than allocated
        self.restore_seconds: deque[float] = deque(maxlen=1024)  # drained by the metrics

    @property
    def held_bytes(self) -> int:
        """Host memory the tier holds: parked snapshots' buffers and spare buffers."""
        return self.entry_capacity + self.spare_bytes

    def totals(self) -> dict[str, int]:
        """Running totals, by the short names the metrics export."""
        return {
            "host_tier_parks": self.parked_total,
            "host_tier_restores": self.restored_total,
            "host_tier_evictions": self.evicted_total,
            "host_tier_buffer_reuses": self.reused_total,
        }

    def note_restore(self, seconds: float) -> None:
        self.restored_total += 1
        self.restore_seconds.append(seconds)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def buffer(self, nbytes: int) -> torch.Tensor | None:
        """A flat uint8 buffer of at least `nbytes` for a snapshot about to be `put` here,
        with room made for it: the least recently parked snapshots are dropped until it fits
        beside the others (their buffers become spares), then the smallest spare that fits
        is lent, or spares are freed for a new buffer. None when `nbytes` alone exceeds the
        budget (the snapshot is then copied into memory of its own, and `put` refuses it)."""
        if nbytes > self.budget_bytes:
            return None
        while self.entries and self.entry_capacity + nbytes > self.budget_bytes:
            self._evict_least_recent()
        fits = [b for b in self.spares if nbytes <= b.numel() <= nbytes * REUSE_SLACK]
        if fits:
            best = min(fits, key=lambda b: b.numel())
            self._unspare(best)
            self.reused_total += 1
            return best
        while self.spares and self.held_bytes + nbytes > self.budget_bytes:
            self._unspare(max(self.spares, key=lambda b: b.numel()))
        return torch.empty(nbytes, dtype=torch.uint8)

    def put(self, session_id: str, snap: KVSnapshot) -> bool:
        """Keep `snap` (replacing the session's older one), dropping spare buffers, then the
        least recently parked snapshots, until it fits; False if it alone exceeds the budget
        (not kept)."""
        old = self.take(session_id)
        if old is not None and old is not snap:
            self.recycle(old)
        if snap.capacity > self.budget_bytes:
            self.evicted_total += 1
            return False
        while self.held_bytes + snap.capacity > self.budget_bytes:
            if self.spares:
                self._unspare(self.spares[0])
            else:
                self._evict_least_recent()
        self.entries[session_id] = snap
        self.bytes_in_use += snap.nbytes
        self.entry_capacity += snap.capacity
        self.parked_total += 1
        return True

    def get(self, session_id: str) -> KVSnapshot | None:
        return self.entries.get(session_id)

    def take(self, session_id: str) -> KVSnapshot | None:
        """Remove and return the session's snapshot (it is being restored): the caller owns
        it, and gives it back with `recycle` once its KV is copied out."""
        snap = self.entries.pop(session_id, None)
        if snap is not None:
            self.bytes_in_use -= snap.nbytes
            self.entry_capacity -= snap.capacity
        return snap

    def drop(self, session_id: str) -> bool:
        """Forget the session's snapshot (closed, or its KV is back in the pool)."""
        snap = self.take(session_id)
        if snap is not None:
            self.recycle(snap)
        return snap is not None

    def recycle(self, snap: KVSnapshot) -> None:
        """A snapshot that left the tier is done with: its buffer (if the tier lent it) is
        kept for the next one, within the budget. The snapshot is emptied, so a late use of
        it fails instead of reading KV another session's copy overwrote."""
        buffer = snap.buffer
        snap.kv, snap.sliding_kv, snap.buffer = [], [], None
        if buffer is None:
            return
        self.spares.append(buffer)
        self.spare_bytes += buffer.numel()
        while self.spares and self.held_bytes > self.budget_bytes:
            self._unspare(self.spares[0])

    def _evict_least_recent(self) -> None:
        session_id = next(iter(self.entries))
        self.drop(session_id)
        self.evicted_total += 1

    def _unspare(self, buffer: torch.Tensor) -> None:
        """Take `buffer` off the spares (lent, or freed for room)."""
        del self.spares[next(i for i, b in enumerate(self.spares) if b is buffer)]
        self.spare_bytes -= buffer.numel()
