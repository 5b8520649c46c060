"""The session controller: open/close, TTL, and how a turn's input is built.

KV and the one-turn-in-flight rule live in the cache (`SessionCache`, a `SessionSlot` per
session); this layer adds what the API needs on top: generated ids, implicit open, each
session's activity clock and the idle TTL it is read against (`ReplicaSession`), reaping idle
sessions past it, and the input of a turn: append mode adds the new tokens to the session's
history (prompts and answers so far); chat mode takes the client's whole conversation, and the
cache reuses the longest prefix it holds.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from sessionserve.cache.kv_snapshot import KVSnapshot
from sessionserve.cache.request_kv import RequestKV
from sessionserve.cache.session_cache import SessionCache, TurnMode, common_prefix_len
from sessionserve.config import SessionConfig
from sessionserve.errors import (
    InvalidConfigError,
    SessionBusyError,
    SessionLogNeededError,
    UnknownSessionError,
)
from sessionserve.replicas.retokenize import continue_history
from sessionserve.replicas.speculative.draft_state import DeferredCatchUp

log = logging.getLogger(__name__)
REAP_PERIOD_S = 1.0


@dataclass(frozen=True)
class SessionSeed:
    """How to open a session this replica does not hold, on its turn (the served app's ingress
    has checked that it exists): its idle TTL (None: the configured default) and, for append
    mode, the token log it has elsewhere (the directory's failover log), which the first turn
    here re-prefills and extends. The log is sent on demand: `log_tokens` (its length) comes
    with every turn, `history` only once a replica lacking the session has asked for it."""

    ttl_s: float | None = None
    history: list[int] | None = None
    log_tokens: int = 0

    def differs_from(self, history: list[int]) -> bool:
        """Whether the log disagrees with a replica's `history` (by length when not sent)."""
        if self.history is not None:
            return self.history != history
        return self.log_tokens != len(history)


@dataclass
class ReplicaSession:
    """What this replica keeps of a session besides its KV: the activity clock, the idle TTL it
    is read against (the directory's, which every served turn brings; refreshed then) and the
    turns run here (the in-process API's count; a served client reads the directory's count of
    committed turns, which a retried turn whose answer was lost does not inflate), and the
    EAGLE head's catch-up its last turn put off (drafting was off): the next turn takes it up,
    so the head's pass runs only if a later turn drafts. It is not exported with the session:
    a session that moves keeps the head's KV unwritten there (lower acceptance, never a
    different answer)."""

    ttl_s: float | None
    last_active: float = field(default_factory=time.monotonic)  # a turn started or ended
    turns_here: int = 0
    head_backlog: DeferredCatchUp | None = None


@dataclass(frozen=True)
class SessionInfo:
    session_id: str
    turns: int  # turns run on this replica (`ReplicaSession.turns_here`)
    history_tokens: int  # the token log: prompts and answers of every successful turn
    held_tokens: int  # KV resident for this session right now (0 after eviction)
    turn_in_flight: bool
    ttl_s: float | None
    idle_s: float


@dataclass
class SessionExport:
    """A session on its way to another replica (through Ray's object store): its token log,
    a snapshot of its KV (None: nothing resident or parked) and its counters."""

    session_id: str
    history: list[int]
    kv: KVSnapshot | None
    ttl_s: float | None
    turns: int

    @property
    def kv_bytes(self) -> int:
        return self.kv.nbytes if self.kv is not None else 0


class SessionController:
    def __init__(
        self,
        cache: SessionCache,
        config: SessionConfig,
        decode: Callable[[list[int]], str] | None = None,
        reclaim_at_limit: bool = False,
    ) -> None:
        """`decode`: the tokenizer's, keeping special tokens and spaces (chat turns keep the
        session's own tokens where the conversation's text is unchanged, retokenize.py).
        `reclaim_at_limit`: at max_sessions, give the least recently used idle session's slot
        to the new one. Only safe where every turn brings its whole input (the served
        replica: the ingress sends the conversation or the directory's token log), so a
        reclaimed session's next turn re-prefills it; an in-process caller relying on the
        slot's history keeps the 429 instead."""
        self.cache = cache
        self.config = config
        self.decode = decode
        self.reclaim_at_limit = reclaim_at_limit
        self.reclaimed_total = 0
        # one per session slot of the cache; dropped when its slot goes (a deferred close
        # completes when its turn ends)
        self.records: dict[str, ReplicaSession] = {}
        self._last_reap = time.monotonic()

    def open(self, session_id: str | None = None, ttl_s: float | None = None) -> str:
        if not self.config.enabled:
            raise InvalidConfigError("sessions are disabled on this server (sessions.enabled)")
        sid = session_id or uuid.uuid4().hex
        if ttl_s is not None and ttl_s <= 0:
            raise InvalidConfigError(f"ttl_s={ttl_s}: must be > 0 seconds")
        if self.reclaim_at_limit and len(self.cache.session_slots) >= self.config.max_sessions:
            self._reclaim_one()
        self.cache.open_session(sid)
        self.records[sid] = ReplicaSession(
            ttl_s if ttl_s is not None else self.config.default_ttl_s
        )
        return sid

    def close(self, session_id: str) -> bool:
        """True if closed now; False if deferred until the running turn ends."""
        closed = self.cache.close_session(session_id)
        if closed:
            self.records.pop(session_id, None)
        return closed

    def start_turn(
        self,
        session_id: str,
        rid: str,
        new_ids: list[int],
        mode: TurnMode,
        open_missing: SessionSeed | None = None,
    ) -> tuple[RequestKV, list[int], int]:
        """Mark the turn in flight and build its full input; also returns how much of the
        session's token log the turn keeps (the log after it is the log before it cut there,
        then the rest of its input and its answer: what the directory appends; 0 when this
        replica's history differs from the directory's log, which then gets the whole log).
        Raises (changing nothing) when the
        session is unknown (and neither implicit open nor `open_missing`), busy or closing, and
        (SessionLogNeededError) when an append turn must open it from a log it was not sent.
        Append mode extends this replica's history of the session: the slot is the source of
        truth; a log from elsewhere that disagrees is reported, never used to rewrite it."""
        seed = open_missing or SessionSeed()
        if session_id not in self.cache.session_slots:
            if not (self.config.implicit_open or open_missing):
                raise UnknownSessionError(session_id)
            if mode == "append" and seed.history is None and seed.log_tokens:
                raise SessionLogNeededError(session_id)
            self.open(session_id, seed.ttl_s)
            if mode == "append" and seed.history:
                self.cache.adopt(session_id, seed.history, None)  # KV: re-prefilled
        slot = self.cache.session(session_id)
        if mode == "append" and open_missing is not None and seed.differs_from(slot.history):
            log.warning(
                "session %s: the failover log (%d tokens) differs from this replica's history "
                "(%d tokens); the replica's is kept (the log is rewritten when the turn commits)",
                session_id,
                len(seed.history) if seed.history is not None else seed.log_tokens,
                len(slot.history),
            )
        if mode == "chat" and self.decode is not None and slot.history:
            new_ids = continue_history(slot.history, new_ids, self.decode)
        kv = self.cache.start_turn(session_id, rid)
        record = self.records[session_id]
        record.last_active = time.monotonic()
        if seed.ttl_s is not None:  # the directory's TTL, which a turn brings: it may change
            record.ttl_s = seed.ttl_s
        full = slot.history + new_ids if mode == "append" else list(new_ids)
        in_sync = open_missing is None or not seed.differs_from(slot.history)
        return kv, full, common_prefix_len(slot.history, full) if in_sync else 0

    def cancel_turn(self, session_id: str, kv: RequestKV) -> None:
        """End a turn refused before it ran (its input failed a check): the slot is untouched."""
        self.cache.abort(kv)
        self.turn_ended(session_id, success=False)

    def turn_ended(
        self, session_id: str, success: bool, head_backlog: DeferredCatchUp | None = None
    ) -> None:
        """`head_backlog`: the EAGLE head's catch-up the turn put off, kept for the next turn
        (dropped if the turn failed)."""
        if session_id not in self.cache.session_slots:  # a deferred close completed
            self.records.pop(session_id, None)
            return
        record = self.records[session_id]
        record.last_active = time.monotonic()
        record.turns_here += int(success)
        record.head_backlog = head_backlog if success else None

    def take_head_backlog(self, session_id: str) -> DeferredCatchUp | None:
        """The head's catch-up the session's last turn put off, for the turn starting now."""
        record = self.records.get(session_id)
        if record is None:
            return None
        backlog, record.head_backlog = record.head_backlog, None
        return backlog

    def head_backlog_bytes(self) -> int:
        """Memory the sessions' put-off head catch-ups hold (target hidden states, on the
        model's device)."""
        backlogs = (r.head_backlog for r in self.records.values())
        return sum(b.nbytes for b in backlogs if b is not None)

    def idle(self) -> list[str]:
        """Open sessions with no turn in flight, most recently used first."""
        slots = [s for s in self.cache.session_slots.values() if s.turn_rid is None]
        return [s.session_id for s in sorted(slots, key=lambda s: -s.last_used)]

    def info(self, session_id: str) -> SessionInfo:
        slot = self.cache.session(session_id)
        record = self.records[session_id]
        held = self.cache.slot_held_tokens(slot) if slot.holds_kv else 0
        return SessionInfo(
            session_id,
            record.turns_here,
            len(slot.history),
            held,
            slot.turn_rid is not None,
            record.ttl_s,
            time.monotonic() - record.last_active,
        )

    def export(self, session_id: str) -> SessionExport:
        """What another replica needs to take the session over (it stays here meanwhile)."""
        history, kv = self.cache.export_session(session_id)
        record = self.records[session_id]
        return SessionExport(session_id, history, kv, record.ttl_s, record.turns_here)

    def adopt(self, export: SessionExport) -> str:
        """Take over an exported session, replacing a stale copy of it here. Returns where its
        KV went ("pool", "host" or "none"; see SessionCache.adopt)."""
        sid = export.session_id
        stale = self.cache.session_slots.get(sid)
        if stale is not None and stale.turn_rid is not None:  # refused, changing nothing
            raise SessionBusyError(sid, stale.turn_rid)
        if stale is not None:
            self.close(sid)
        self.open(sid, export.ttl_s)
        try:
            where = self.cache.adopt(sid, export.history, export.kv)
        except Exception:
            self.close(sid)
            raise
        self.records[sid].turns_here = export.turns
        return where

    def _reclaim_one(self) -> None:
        """Close the least recently used session with no turn in flight (none: the cache's
        open refuses with a 429)."""
        idle = [
            slot
            for slot in self.cache.session_slots.values()
            if slot.turn_rid is None and not slot.closing
        ]
        victim = min(idle, key=lambda slot: slot.last_used, default=None)
        if victim is not None:
            self.close(victim.session_id)
            self.reclaimed_total += 1

    def reap_expired(self) -> list[str]:
        """Close sessions idle past their TTL (never one with a turn in flight), at most once
        every REAP_PERIOD_S: every engine step calls it, and so does an idle replica's tick."""
        now, closed = time.monotonic(), []
        if now - self._last_reap < REAP_PERIOD_S:
            return closed
        self._last_reap = now
        for sid in self.records.keys() - self.cache.session_slots.keys():
            del self.records[sid]  # its slot went without telling (never expected; kept tidy)
        for sid, slot in list(self.cache.session_slots.items()):
            record = self.records[sid]
            if record.ttl_s is None or slot.turn_rid is not None:
                continue
            if now - record.last_active > record.ttl_s:
                self.close(sid)
                closed.append(sid)
                log.info("session %s idle past its TTL: closed", sid)
        return closed
