"""Streaming sessions over the request cache: a session's KV stays resident between turns.

The rules (docs/architecture.md, "What a session promises"), each closing a bug the reference
system had:
- One turn in flight: `start_turn` raises SessionBusyError *before* creating anything, so a
  rejected turn never carries the session and can never clear the running turn's mark or touch
  its slot. Only the request that owns the turn ends it.
- Abort (queued, pre-abort, mid-abort) keeps what is committed: the slot is rolled back to its
  checkpoint (`history`), the turn ends, and the session stays usable.
- Retract parks the KV in the slot but never moves the checkpoint or ends the turn; the retried
  turn restores the parked KV (stale tail freed page-aligned).
- Finish trims speculative overshoot (tokens and KV) before the save.
- Append mode is append-only (AppendOnlyViolationError); chat mode may rewind to the divergence.
  A rewind of MIN_BRANCH_TOKENS or more (an edited history, a fork) moves the branch it leaves
  into the radix tree, so that going back to it reuses it (until the tree evicts it).
- Idle sessions are evicted LRU under pressure: the KV's whole pages go to the radix tree
  (evictable, ends first), the rest is freed, `history` is kept; the next turn reuses what the
  tree still holds and re-prefills the rest. With a host tier attached, the KV is first copied
  there, and the next turn copies back what the tree lost (`cached_source == "host"`).
- A session moves between replicas as its history plus a snapshot of its KV: `export_session`
  on the source (which keeps it until the move commits), `adopt` on the target.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from sessionserve.cache.allocator import ceil_align, floor_align
from sessionserve.cache.host_tier import HostTier, ParkedKV
from sessionserve.cache.kv_pool import KVPool
from sessionserve.cache.kv_snapshot import KVSnapshot, check_compatible, gather, scatter
from sessionserve.cache.request_cache import RequestCache
from sessionserve.cache.request_kv import KVState, RequestKV, SessionSlot, lru_tick
from sessionserve.errors import (
    AppendOnlyViolationError,
    InvalidConfigError,
    KVCacheFullError,
    SessionBusyError,
    SessionClosingError,
    SessionExistsError,
    TooManySessionsError,
    UnknownSessionError,
)

TurnMode = Literal["append", "chat"]
MIN_BRANCH_TOKENS = 32  # a rewound tail at least this long is kept in the radix tree


@dataclass(frozen=True)
class SessionLimits:
    max_sessions: int = 1024  # open sessions per replica (with or without resident KV)
    max_held_tokens: int | None = None  # held KV of idle sessions, replica-wide
    max_session_tokens: int | None = None  # held KV one session keeps between turns (the
    # radix-shared first prompt is not held); the rest is re-prefilled next turn

    def __post_init__(self) -> None:
        for name in ("max_sessions", "max_held_tokens", "max_session_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise InvalidConfigError(f"{name}={value}: must be >= 1 (or None for no limit)")


class SessionCache(RequestCache):
    def __init__(self, *args, limits: SessionLimits | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits or SessionLimits()
        self.session_slots: dict[str, SessionSlot] = {}
        self.evicted_sessions_total = 0
        self.kv_pools: list[KVPool] = []  # what a snapshot copies: the target's, the drafter's
        self.host_tier: HostTier | None = None

    def attach_kv(self, pools: Sequence[KVPool], host_tier: HostTier | None = None) -> None:
        """The KV tensors behind the slots (needed to park, restore and migrate sessions) and
        the host tier parked sessions go to (None: eviction drops the KV, as without), made
        for the same pools."""
        if host_tier is not None and host_tier.pools != list(pools):
            raise ValueError("the host tier was made for other KV pools")
        self.kv_pools, self.host_tier = list(pools), host_tier

    # ---- session lifecycle ----
    def open_session(self, session_id: str) -> SessionSlot:
        if session_id in self.session_slots:
            raise SessionExistsError(session_id)
        if len(self.session_slots) >= self.limits.max_sessions:
            raise TooManySessionsError(
                f"{len(self.session_slots)} sessions are open, the limit (max_sessions) is "
                f"{self.limits.max_sessions}; close idle sessions or raise the limit"
            )
        slot = self.session_slots[session_id] = SessionSlot(session_id)
        return slot

    def close_session(self, session_id: str) -> bool:
        """Close and free everything. Deferred while a turn runs: returns False, and the session
        is released when that turn ends; new turns are refused meanwhile."""
        slot = self.session(session_id)
        if slot.turn_rid is not None:
            slot.closing = True
            return False
        self._release_slot_kv(slot)
        self._forget(slot)
        return True

    def session(self, session_id: str) -> SessionSlot:
        slot = self.session_slots.get(session_id)
        if slot is None:
            raise UnknownSessionError(session_id)
        return slot

    def start_turn(self, session_id: str, rid: str) -> RequestKV:
        """Mark a turn in flight and return its KV record. Raises, changing nothing, if busy."""
        slot = self.session(session_id)
        if slot.closing:
            raise SessionClosingError(session_id)
        if slot.turn_rid is not None:
            raise SessionBusyError(session_id, slot.turn_rid)
        slot.turn_rid = rid
        slot.last_used = lru_tick()
        return RequestKV(rid=rid, session_id=session_id)

    # ---- admission ----
    def match(self, req: RequestKV, tokens: Sequence[int], mode: TurnMode = "append") -> int:
        """Admit `req`. A session turn restores its slot's KV (the longest prefix of `tokens`
        the slot holds; chat mode may rewind, append mode must extend); otherwise radix match."""
        self._expect(req, KVState.WAITING, "match")
        if not tokens:
            raise ValueError(f"request {req.rid!r}: empty input; send at least one token")
        slot = self._turn_slot(req) if req.session_id else None
        key = tokens[:-1]  # the last token is always computed: it yields the next logits
        source = "session"
        if slot is not None and not slot.holds_kv and self._restore_parked(slot, key, mode):
            source = "host"
        if slot is None or not slot.holds_kv:
            return self._match_radix(req, tokens)
        prefix_len = common_prefix_len(slot.kv_tokens, key)
        if mode == "append" and prefix_len < min(slot.committed_len, len(key)):
            raise AppendOnlyViolationError(
                f"session {slot.session_id!r}: append-mode input diverges from the held KV at "
                f"token {prefix_len} (holds {slot.committed_len})"
            )
        if mode == "chat" and self._leaves_a_branch(slot, prefix_len):
            # the branch being left goes to the radix tree (evictable, like any cached
            # prefix): this turn reuses its start from there, and a return to it reuses it all
            self._insert_prefix(
                slot, slot.kv_tokens, floor_align(slot.committed_len, self.page_size)
            )
        if prefix_len < slot.protected_len or not self._window_resident(slot.row, prefix_len):
            # diverged inside the tree-shared part, or so far back that the sliding layers'
            # window there is gone: start over from what the radix tree can give
            self._release_slot_kv(slot)
            return self._match_radix(req, tokens)
        self._free_tail(slot, prefix_len)
        del slot.kv_tokens[prefix_len:]
        slot.borrower = req.rid
        req.row, req.lock_node, req.state = slot.row, None, KVState.LIVE
        req.committed_len, req.allocated_len = slot.committed_len, slot.allocated_len
        req.protected_len, req.sliding_from = slot.protected_len, slot.sliding_from
        self._set_cached(req, len(tokens), prefix_len, source)
        return prefix_len

    def _leaves_a_branch(self, slot: SessionSlot, prefix_len: int) -> bool:
        """Whether a chat turn diverging at `prefix_len` leaves a branch worth keeping (an
        edited history, a fork): MIN_BRANCH_TOKENS or more, a whole page of them past the
        divergence. Shorter rewinds (a last answer's end rendered otherwise) drop their tail
        and keep the slot's exact reuse."""
        page = self.page_size
        return (
            self.radix.enabled
            and slot.committed_len - prefix_len >= MIN_BRANCH_TOKENS
            and floor_align(slot.committed_len, page) >= ceil_align(prefix_len, page) + page
        )

    # ---- host tier and migration ----
    def park(self, session_id: str) -> bool:
        """Move an idle session's KV out of the pool now (into the host tier when there is
        one and it fits); True if a copy is parked. Its next turn restores or re-prefills."""
        slot = self.session(session_id)
        if slot.turn_rid is not None:
            raise SessionBusyError(session_id, slot.turn_rid)
        if not slot.holds_kv:
            return self.host_tier is not None and session_id in self.host_tier
        parked = self._spill(slot)
        self._release_slot_kv(slot)
        return parked

    def export_session(self, session_id: str) -> tuple[list[int], KVSnapshot | None]:
        """An idle session's token log and a snapshot of the KV it holds (resident or parked;
        None if neither). The session stays here, unchanged, until the caller closes it."""
        slot = self.session(session_id)
        if slot.turn_rid is not None:
            raise SessionBusyError(session_id, slot.turn_rid)
        if slot.holds_kv and slot.committed_len:
            return list(slot.history), self._snapshot(slot)
        parked = self.host_tier.export(session_id) if self.host_tier is not None else None
        return list(slot.history), parked

    def adopt(self, session_id: str, history: Sequence[int], snap: KVSnapshot | None) -> str:
        """Give an open, idle session (just opened here: a migration's target) the history and
        KV another replica exported. Returns where the KV went: "pool", "host" (no room in the
        pool) or "none" (nothing usable: the next turn re-prefills from the history)."""
        slot = self.session(session_id)
        if slot.turn_rid is not None or slot.holds_kv:
            raise SessionBusyError(session_id, slot.turn_rid or "<holds KV>")
        if snap is not None:
            check_compatible(self.kv_pools, snap)  # before anything changes
        slot.history = list(history)
        upto = self._usable_len(snap, common_prefix_len(snap.tokens, history)) if snap else 0
        if upto == 0:
            return "none"
        try:
            self._restore(slot, snap, upto)
            return "pool"
        except KVCacheFullError:  # parked as a copy of our own (not the sender's buffers)
            if self.host_tier is not None and self.host_tier.store(session_id, snap, upto):
                return "host"
            return "none"

    # ---- exits ----
    def finish(self, req: RequestKV, final_tokens: Sequence[int]) -> None:
        if req.session_id is None:
            return super().finish(req, final_tokens)
        self._expect(req, KVState.LIVE, "finish")
        slot = self._turn_slot(req)
        self._free_tail(req, min(req.allocated_len, len(final_tokens)))  # speculative overshoot
        self._park(req, slot, final_tokens)
        slot.history = list(final_tokens)
        self._end_turn(req, slot)

    def abort(self, req: RequestKV, tokens: Sequence[int] = ()) -> None:
        if req.session_id is None or req.state is KVState.DONE:
            return super().abort(req, tokens)
        slot = self._turn_slot(req)
        if req.is_live:
            self._park(req, slot, tokens)
        self._rollback(slot)
        self._end_turn(req, slot)

    def retract(self, req: RequestKV, tokens: Sequence[int]) -> None:
        if req.session_id is None:
            return super().retract(req, tokens)
        self._expect(req, KVState.LIVE, "retract")
        self._park(req, self._turn_slot(req), tokens)
        req.state = KVState.WAITING

    # ---- sizes ----
    def idle_slots(self) -> Iterator[SessionSlot]:
        """Slots holding KV that no live request borrows."""
        return (s for s in self.session_slots.values() if s.holds_kv and s.borrower is None)

    def slot_held_tokens(self, slot: SessionSlot) -> int:
        return ceil_align(slot.allocated_len, self.page_size) - slot.protected_len

    def reclaimable_size(self) -> int:
        idle = sum(self.slot_held_tokens(s) for s in self.idle_slots())
        return super().reclaimable_size() + idle

    # ---- internals ----
    def _turn_slot(self, req: RequestKV) -> SessionSlot:
        slot = self.session(req.session_id)
        if slot.turn_rid != req.rid:
            raise SessionBusyError(req.session_id, slot.turn_rid or "<none>")
        return slot

    def _park(self, req: RequestKV, slot: SessionSlot, tokens: Sequence[int]) -> None:
        """Move req's committed KV into the slot; req ends up holding nothing."""
        if len(tokens) < min(req.committed_len, req.allocated_len):
            raise ValueError(
                f"request {req.rid!r} holds KV for {req.committed_len} tokens but only "
                f"{len(tokens)} were passed: pass the request's full token list"
            )
        self._free_tail(req, req.committed_len)
        if not slot.holds_kv:  # first turn (or after eviction): the slot adopts req's row
            # the prompt becomes shareable; not with sliding layers kept apart, whose window
            # at the prompt's end the session gives back as it goes on (and held only once)
            if self.allocator.sliding is None:
                prompt = floor_align(min(req.committed_len, req.prompt_len), self.page_size)
                self._insert_prefix(req, tokens, prompt)
            slot.row, slot.lock_node, slot.protected_len = req.row, req.lock_node, req.protected_len
        slot.committed_len, slot.allocated_len = req.committed_len, req.allocated_len
        slot.sliding_from = req.sliding_from
        slot.kv_tokens = list(tokens[: req.committed_len])
        slot.borrower = None
        self._reset(req)
        self._enforce_limits(slot)

    def _rollback(self, slot: SessionSlot) -> None:
        """Drop KV of an unfinished turn: keep only what matches the checkpoint."""
        if not slot.holds_kv:
            self._rollback_parked(slot)
            return
        keep = common_prefix_len(slot.kv_tokens, slot.history)
        if keep == 0 or keep < slot.protected_len:
            self._release_slot_kv(slot)
            return
        self._free_tail(slot, keep)
        del slot.kv_tokens[keep:]

    def _end_turn(self, req: RequestKV, slot: SessionSlot) -> None:
        slot.turn_rid = None
        slot.last_used = lru_tick()
        req.state = KVState.DONE
        if slot.closing:
            self._release_slot_kv(slot)
            self._forget(slot)

    def _forget(self, slot: SessionSlot) -> None:
        """A closed session leaves nothing: no slot, no parked copy."""
        del self.session_slots[slot.session_id]
        if self.host_tier is not None:
            self.host_tier.drop(slot.session_id)

    def _release_slot_kv(self, slot: SessionSlot) -> None:
        """The only place a slot's row and `[protected, allocated)` are freed."""
        if not slot.holds_kv:
            return
        if slot.allocated_len > slot.protected_len:
            rows = self.rows.read(slot.row, slot.protected_len, slot.allocated_len)
            self.allocator.free(rows)
        if slot.lock_node is not None:
            self.radix.unlock(slot.lock_node)
        self.rows.free(slot.row)
        slot.row, slot.lock_node, slot.borrower = None, None, None
        slot.committed_len = slot.allocated_len = slot.protected_len = slot.sliding_from = 0
        slot.kv_tokens = []

    def _evict_idle_session(self) -> bool:
        victim = min(self.idle_slots(), key=lambda s: s.last_used, default=None)
        if victim is None:
            return False
        self._spill(victim)
        self._hand_to_tree(victim)
        self._release_slot_kv(victim)
        victim.evictions += 1
        self.evicted_sessions_total += 1
        return True

    def _hand_to_tree(self, slot: SessionSlot) -> None:
        """An evicted slot's committed whole pages go to the radix tree, unlocked, instead of
        being freed: the tree gives up their ends first (`RadixCache.evict`), so a session
        that comes back under pressure still reuses its beginning (`cached_source ==
        "radix"`) rather than re-prefilling all of it, and a parked copy restores only what
        the tree no longer holds. With sliding-window layers kept apart, only a prefix whose
        window is still resident is worth keeping (the slot holds just its last window)."""
        length = floor_align(slot.committed_len, self.page_size)
        sliding = self.allocator.sliding
        if sliding is not None:
            length = sliding.longest_usable(self.rows.read(slot.row, 0, length), self.page_size)
        self._insert_prefix(slot, slot.kv_tokens, length)

    def _spill(self, slot: SessionSlot) -> bool:
        """Copy an idle slot's committed KV into the host tier (before it is freed)."""
        if self.host_tier is None or slot.committed_len == 0:
            return False
        slots, sliding = self._committed_slots(slot), self.allocator.sliding
        return self.host_tier.park(slot.session_id, slots, slot.kv_tokens, self.page_size, sliding)

    def _snapshot(self, slot: SessionSlot) -> KVSnapshot:
        slots, sliding = self._committed_slots(slot), self.allocator.sliding
        return gather(self.kv_pools, slots, slot.kv_tokens, self.page_size, sliding)

    def _committed_slots(self, slot: SessionSlot) -> torch.Tensor:
        return self.rows.read(slot.row, 0, slot.committed_len)

    def _usable_len(self, snap: KVSnapshot | ParkedKV, upto: int) -> int:
        """How much of `snap[:upto]` a session can go on from: all of it, or nothing when the
        sliding layers' window at `upto` is not in the snapshot."""
        sliding = self.allocator.sliding
        if sliding is None or snap.sliding_from <= max(0, upto - sliding.window + 1):
            return upto
        return 0

    def _restore_parked(self, slot: SessionSlot, key: Sequence[int], mode: TurnMode) -> bool:
        """Bring a parked session's KV back for the prefix `key` shares with it. False (the
        turn re-prefills) when nothing is parked or shared. No room in the pool raises
        KVCacheFullError with the copy back in the tier: the turn waits for room, as any
        admission does, rather than recompute what is parked."""
        tier = self.host_tier
        parked = tier.get(slot.session_id) if tier is not None else None
        if parked is None:
            return False
        upto = common_prefix_len(parked.tokens, key)
        if mode == "append" and upto < min(len(parked), len(key)):
            raise AppendOnlyViolationError(
                f"session {slot.session_id!r}: append-mode input diverges from the parked KV "
                f"at token {upto} (holds {len(parked)})"
            )
        tier.take(slot.session_id)  # out of the tier, pages kept: the restore may spill others
        upto = self._usable_len(parked, upto)
        if upto == 0:
            tier.release(parked)
            return False
        started = time.perf_counter()
        try:
            self._restore(slot, parked, upto)
        except BaseException:  # no room (the turn waits), or a failure: the copy stays
            tier.put_back(slot.session_id, parked)
            raise
        tier.release(parked)
        tier.note_restore(time.perf_counter() - started)
        return True

    def _rollback_parked(self, slot: SessionSlot) -> None:
        """A retracted turn's KV may have been parked with the session's: cut it back to
        the checkpoint, as `_rollback` does for resident KV."""
        parked = self.host_tier.get(slot.session_id) if self.host_tier is not None else None
        if parked is not None:
            self.host_tier.truncate(slot.session_id, common_prefix_len(parked.tokens, slot.history))

    def _restore(self, slot: SessionSlot, snap: KVSnapshot | ParkedKV, upto: int) -> None:
        """Make `snap[:upto]` the slot's resident KV: the prefix the radix tree still holds
        is shared (locked, as a first turn's prompt), the rest gets new slots and is copied
        in; with sliding layers kept apart, nothing is shared and the window gets sliding
        slots. All or nothing: raises KVCacheFullError (or what a failed copy raised) having
        kept nothing."""
        sliding = self.allocator.sliding
        row = self._alloc_row()
        m = self.radix.match_prefix(snap.tokens[:upto] if sliding is None else [])
        window_from = upto if sliding is None else max(snap.sliding_from, upto - sliding.keep)
        self.radix.lock(m.node)
        self.rows.write(row, 0, m.slots)
        try:
            pages = self.allocator.pages_needed(m.length, upto - m.length)
            self.make_room(pages * self.page_size, upto - window_from)
            last = self.rows.last_slot(row, m.length)
            slots = self.allocator.alloc_extend(last, m.length, upto - m.length)
        except KVCacheFullError:
            self.radix.unlock(m.node)
            self.rows.free(row)
            raise
        self.rows.write(row, m.length, slots)
        try:
            window = None
            if sliding is not None:
                sliding.alloc(slots[window_from:])
                window = (window_from, sliding.lookup(slots[window_from:]))
            if isinstance(snap, ParkedKV):
                self.host_tier.restore(snap, m.length, upto, slots, self.page_size, window)
            else:
                scatter(self.kv_pools, snap, m.length, upto, slots, self.page_size, window)
        except BaseException:  # a failed copy holds nothing either
            self.allocator.free(slots)
            self.radix.unlock(m.node)
            self.rows.free(row)
            raise
        slot.row, slot.lock_node, slot.protected_len = row, m.node, m.length
        slot.committed_len = slot.allocated_len = upto
        slot.sliding_from = window_from
        slot.kv_tokens = list(snap.tokens[:upto])
        slot.borrower = None

    def _enforce_limits(self, slot: SessionSlot) -> None:
        cap = self.limits.max_session_tokens
        if cap is not None and self.slot_held_tokens(slot) > cap:
            keep = slot.protected_len + floor_align(cap, self.page_size)  # shared part is free
            self._free_tail(slot, keep)
            del slot.kv_tokens[keep:]
        limit = self.limits.max_held_tokens
        if limit is not None:
            while sum(self.slot_held_tokens(s) for s in self.idle_slots()) > limit:
                self._evict_idle_session()


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):  # the usual case, at C speed
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i
