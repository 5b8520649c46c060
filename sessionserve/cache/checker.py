"""The memory invariant (docs/architecture.md, "The memory invariant"): no KV slot lost, none
counted twice.

    free + evictable + protected + held + in_flight == total

The host tier is checked too: its byte count equals the sum of its parked snapshots, within
budget, and every snapshot belongs to an open session whose KV is not resident as well.

`held` is the idle session slots' `ceil_align(allocated) - protected`; `in_flight` the same over
the live requests the scheduler passes in. A slot whose row a live request borrows counts once,
as in-flight. With sliding-window layers kept apart, the sliding slots are checked the same way:
each held by the owner of its token's slot, so

    sliding_free + sliding_tree + sliding_held + sliding_in_flight == sliding_total

and the space itself is consistent (cache/sliding.py). Which rows are borrowed is computed from
the live batch at every check, never from a stored flag; the slots' `borrower` marks are only
*checked* against it, so a stuck mark is caught instead of trusted. Metrics read the same terms
(`terms()`), so they cannot drift."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Literal, NamedTuple

from sessionserve.cache.allocator import ceil_align
from sessionserve.cache.request_kv import RequestKV
from sessionserve.cache.session_cache import SessionCache
from sessionserve.errors import MemoryInvariantError


class MemoryTerms(NamedTuple):
    total: int
    free: int
    evictable: int
    protected: int
    held: int  # idle session slots' KV
    in_flight: int  # live requests' own KV
    held_sessions: int  # idle slots holding KV
    live_requests: int
    rows_total: int
    rows_free: int
    rows_used: int  # distinct rows of live requests and slots
    host_bytes: int = 0  # the host tier's parked KV
    host_sessions: int = 0
    # sliding-window layers' slots (all 0 when the cache keeps no sliding KV apart)
    sliding_total: int = 0
    sliding_free: int = 0
    sliding_tree: int = 0  # tokens of the radix tree's (locked or not)
    sliding_held: int = 0  # idle session slots'
    sliding_in_flight: int = 0  # live requests'

    @property
    def accounted(self) -> int:
        return self.free + self.evictable + self.protected + self.held + self.in_flight

    @property
    def sliding_accounted(self) -> int:
        return self.sliding_free + self.sliding_tree + self.sliding_held + self.sliding_in_flight

    def __str__(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self._asdict().items()) + f" sum={self.accounted}"


class CheckSchedule:
    """When a step loop runs the check: every step, at most once per `period_s` (the first
    call is due), or never."""

    def __init__(self, policy: Literal["every_step", "periodic", "off"], period_s: float) -> None:
        self.policy, self.period_s, self._next = policy, period_s, 0.0

    def due(self) -> bool:
        if self.policy != "periodic":
            return self.policy == "every_step"
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + self.period_s
        return True


class MemoryChecker:
    def __init__(self, cache: SessionCache) -> None:
        self.cache = cache
        self.checks = 0  # busy and idle checks run (the failures are counted in terms())
        self.failures = 0

    def terms(self, live: Sequence[RequestKV] = ()) -> MemoryTerms:
        c, p = self.cache, self.cache.page_size
        problems: list[str] = []
        live_rows = {r.row: r for r in live}
        if len(live_rows) != len(live):
            problems.append("two live requests share a row")
        in_flight = sliding_in_flight = 0
        for r in live:
            if not r.is_live or r.row is None:
                problems.append(f"request {r.rid!r} passed as live but is {r.state.value}")
                continue
            problems += _ordering(f"request {r.rid!r}", r, p)
            in_flight += ceil_align(r.allocated_len, p) - r.protected_len
            sliding_in_flight += self._sliding_of(r)
        held = held_sessions = sliding_held = 0
        slot_rows: set[int] = set()
        for s in c.session_slots.values():
            if s.row is None:
                if s.borrower is not None:
                    problems.append(f"session {s.session_id!r} lent no row but marks a borrower")
                continue
            slot_rows.add(s.row)
            problems += _ordering(f"session {s.session_id!r}", s, p)
            borrower = live_rows.get(s.row)
            if (borrower.rid if borrower else None) != s.borrower:
                problems.append(
                    f"session {s.session_id!r} marks borrower {s.borrower!r} but the live batch "
                    f"has {borrower.rid if borrower else None!r} on row {s.row}"
                )
            if borrower is None:
                if len(s.kv_tokens) != s.committed_len:
                    problems.append(f"session {s.session_id!r}: kv_tokens != committed_len")
                held += ceil_align(s.allocated_len, p) - s.protected_len
                held_sessions += 1
                sliding_held += self._sliding_of(s)
        host_bytes, host_sessions = self._host_tier(problems)
        rows_used = len(slot_rows | set(live_rows))
        t = MemoryTerms(
            total=c.allocator.num_slots,
            free=c.allocator.available_size(),
            evictable=c.radix.evictable_size(),
            protected=c.radix.protected_size(),
            held=held,
            in_flight=in_flight,
            held_sessions=held_sessions,
            live_requests=len(live),
            rows_total=c.rows.num_rows,
            rows_free=c.rows.num_free(),
            rows_used=rows_used,
            host_bytes=host_bytes,
            host_sessions=host_sessions,
            **self._sliding_terms(problems, sliding_held, sliding_in_flight),
        )
        if t.accounted != t.total:
            problems.append(f"slots: accounted {t.accounted} != total {t.total}")
        if t.sliding_accounted != t.sliding_total:
            problems.append(
                f"sliding slots: accounted {t.sliding_accounted} != total {t.sliding_total}"
            )
        if t.rows_free + t.rows_used != t.rows_total:
            problems.append(f"rows: free {t.rows_free} + used {t.rows_used} != {t.rows_total}")
        if problems:
            self.failures += 1
            raise MemoryInvariantError(
                "memory invariant broken: " + "; ".join(problems) + f" [{t}]"
            )
        return t

    def _sliding_of(self, owner) -> int:
        """Sliding slots an owner holds: those of its own positions (its row's slots past
        the tree's prefix; positions of its last partial page past `allocated` hold none)."""
        sliding = self.cache.allocator.sliding
        if sliding is None or owner.allocated_len <= owner.protected_len:
            return 0
        return sliding.count(
            self.cache.rows.read(owner.row, owner.protected_len, owner.allocated_len)
        )

    def _sliding_terms(self, problems: list[str], held: int, in_flight: int) -> dict[str, int]:
        sliding = self.cache.allocator.sliding
        if sliding is None:
            return {}
        problems += sliding.check()
        allocator = self.cache.allocator
        mapped = sliding.mapped_full_slots()
        if mapped.size and not bool(allocator.page_allocated(mapped).all()):
            problems.append("sliding-window KV held by a token whose slot is free")
        tree = sum(sliding.count(node.slots) for node in self.cache.radix.nodes())
        return {
            "sliding_total": sliding.num_slots,
            "sliding_free": sliding.available_size(),
            "sliding_tree": tree,
            "sliding_held": held,
            "sliding_in_flight": in_flight,
        }

    def _host_tier(self, problems: list[str]) -> tuple[int, int]:
        tier = self.cache.host_tier
        if tier is None:
            return 0, 0
        total, seen = 0, list(tier.free_pages)
        for sid, parked in tier.entries.items():
            slot = self.cache.session_slots.get(sid)
            if slot is None:
                problems.append(f"host tier keeps KV of session {sid!r}, which is not open")
            elif slot.holds_kv:
                problems.append(f"session {sid!r} is resident and parked in the host tier")
            if len(parked.pages) != tier.pages_for(len(parked.tokens)) or any(
                t.shape[2] != len(parked.tokens) - parked.sliding_from for t in parked.sliding_kv
            ):
                problems.append(f"host tier: session {sid!r}'s KV length != its tokens")
            nbytes = len(parked.pages) * tier.page_bytes
            if parked.nbytes != nbytes + sum(t.nbytes for t in parked.sliding_kv):
                problems.append(f"host tier: session {sid!r} counts {parked.nbytes} bytes")
            seen += parked.pages
            total += parked.nbytes
        if sorted(seen) != list(range(tier.num_pages)):
            problems.append(
                f"host tier: {len(seen)} pages free or held, {len(set(seen))} of them distinct, "
                f"of {tier.num_pages} (a page lost or given twice)"
            )
        if total != tier.bytes_in_use:
            problems.append(f"host tier: counts {tier.bytes_in_use} bytes, holds {total}")
        if tier.bytes_in_use > tier.budget_bytes:
            problems.append(f"host tier: {tier.bytes_in_use} bytes over its budget")
        return total, len(tier.entries)

    def check_busy(self, live: Iterable[RequestKV]) -> MemoryTerms:
        """After every scheduler step: `live` is every request holding KV (running, prefilling)."""
        self.checks += 1
        return self.terms(list(live))

    def check_idle(self) -> MemoryTerms:
        """When nothing runs: no in-flight KV, and no slot may claim a borrower."""
        self.checks += 1
        return self.terms(())

    def held_tokens(self, live: Sequence[RequestKV] = ()) -> int:
        return self.terms(live).held

    def held_sessions(self, live: Sequence[RequestKV] = ()) -> int:
        return self.terms(live).held_sessions


def _ordering(who: str, o, page_size: int) -> list[str]:
    out = []
    if not 0 <= o.protected_len <= o.committed_len <= o.allocated_len:
        out.append(
            f"{who}: expected 0 <= protected {o.protected_len} <= committed "
            f"{o.committed_len} <= allocated {o.allocated_len}"
        )
    if o.protected_len % page_size:
        out.append(f"{who}: protected {o.protected_len} not page-aligned ({page_size})")
    return out
