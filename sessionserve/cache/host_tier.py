"""The host tier: where an idle session's KV goes when the device pool evicts it.

Without it, an evicted session keeps only its token log and its next turn re-prefills the
whole history. With it, eviction first copies the KV out (`kv_snapshot.gather`) into host
memory under a byte budget of its own; the next turn copies it back and prefills only the new
tokens. Least recently parked goes first when the budget is short; a session dropped from
the tier falls back to re-prefill, as before. Plain data and bookkeeping: the session cache
decides what goes in and comes out, the memory checker proves the byte count.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from sessionserve.cache.kv_snapshot import KVSnapshot
from sessionserve.errors import InvalidConfigError


class HostTier:
    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 1:
            raise InvalidConfigError(f"host tier budget {budget_bytes} bytes: must be >= 1")
        self.budget_bytes = budget_bytes
        self.entries: OrderedDict[str, KVSnapshot] = OrderedDict()  # least recent first
        self.bytes_in_use = 0
        self.parked_total = 0  # snapshots stored
        self.restored_total = 0  # snapshots taken back into the pool
        self.evicted_total = 0  # snapshots dropped for the budget (or too big to keep)
        self.restore_seconds: deque[float] = deque(maxlen=1024)  # drained by the metrics

    def totals(self) -> dict[str, int]:
        """Running totals, by the short names the metrics export."""
        return {
            "host_tier_parks": self.parked_total,
            "host_tier_restores": self.restored_total,
            "host_tier_evictions": self.evicted_total,
        }

    def note_restore(self, seconds: float) -> None:
        self.restored_total += 1
        self.restore_seconds.append(seconds)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def put(self, session_id: str, snap: KVSnapshot) -> bool:
        """Keep `snap` (replacing the session's older one), dropping the least recently
        parked snapshots until it fits; False if it alone exceeds the budget (not kept)."""
        self.drop(session_id)
        if snap.nbytes > self.budget_bytes:
            self.evicted_total += 1
            return False
        while self.bytes_in_use + snap.nbytes > self.budget_bytes:
            _, old = self.entries.popitem(last=False)
            self.bytes_in_use -= old.nbytes
            self.evicted_total += 1
        self.entries[session_id] = snap
        self.bytes_in_use += snap.nbytes
        self.parked_total += 1
        return True

    def get(self, session_id: str) -> KVSnapshot | None:
        return self.entries.get(session_id)

    def take(self, session_id: str) -> KVSnapshot | None:
        """Remove and return the session's snapshot (it is being restored or exported)."""
        snap = self.entries.pop(session_id, None)
        if snap is not None:
            self.bytes_in_use -= snap.nbytes
        return snap

    def drop(self, session_id: str) -> bool:
        """Forget the session's snapshot (closed, or its KV is back in the pool)."""
        return self.take(session_id) is not None
