"""The session directory: one named Ray actor per application, shared by every router and
ingress replica, so a session reaches the same replica whichever process routes it.

It holds, per session: the pinned replica, the token log (prompts and answers of every
successful turn: the source of truth for re-prefill after a failover), the turn count, the
idle TTL, and the stored responses of the Responses API (a chain of responses is one session;
they expire and are deleted with it). Pins change only inside the actor (`resolve_pin`), so
two routers placing the same session concurrently agree on one replica.
"""

from __future__ import annotations

import time
import uuid
from array import array
from dataclasses import dataclass, field

import ray

from sessionserve.errors import TooManySessionsError

NAMESPACE = "sessionserve"
REAP_PERIOD_S = 1.0


@dataclass
class StoredResponse:
    """A Responses API response kept for `previous_response_id`, retrieval and its input
    items (the whole conversation it answered, so a chain survives deleting its parents)."""

    response: dict
    items: list[dict]


@dataclass
class SessionRecord:
    session_id: str
    ttl_s: float | None
    replica: str | None = None
    log: array = field(default_factory=lambda: array("I"))
    turns: int = 0
    last_active: float = field(default_factory=lambda: time.monotonic())
    responses: dict[str, StoredResponse] = field(default_factory=dict)
    owner: str | None = None  # the API key fingerprint that opened it (None: no auth)


class SessionDirectoryState:
    """The directory's state and logic (plain Python; `SessionDirectory` is its Ray actor)."""

    def __init__(self, default_ttl_s: float | None = None) -> None:
        self.sessions: dict[str, SessionRecord] = {}
        self.response_sessions: dict[str, str] = {}  # response id -> its session
        self.owner_sessions: dict[str | None, int] = {}  # open sessions per API key
        self._next_sweep = 0.0
        self.default_ttl_s = default_ttl_s
        self.repins = 0

    # ---- registry ----
    # Every call from the API names the caller's `owner` (its API key's fingerprint, None
    # without keys): a session of another owner is reported exactly as one that does not
    # exist, so ids reveal nothing across keys.
    def open(
        self,
        session_id: str | None,
        ttl_s: float | None,
        owner: str | None = None,
        owner_limit: int | None = None,
    ) -> str | None:
        """Register a session; None if the id is taken (by anyone). An API key (`owner`) may
        hold at most `owner_limit` open sessions: beyond, a 429."""
        self._reap()
        sid = session_id or uuid.uuid4().hex
        if sid in self.sessions:
            return None
        held = self.owner_sessions.get(owner, 0)
        if owner is not None and owner_limit is not None and held >= owner_limit:
            raise TooManySessionsError(
                f"this API key holds {held} open sessions, the limit "
                f"(ingress.max_sessions_per_key) is {owner_limit}; close some (DELETE "
                "/v1/sessions/{id}) or let them expire"
            )
        ttl = ttl_s if ttl_s is not None else self.default_ttl_s
        self.sessions[sid] = SessionRecord(sid, ttl, owner=owner)
        self.owner_sessions[owner] = held + 1
        return sid

    def touch(self, session_id: str, owner: str | None = None) -> bool:
        """Whether the session exists (marking it active): the per-request check, which
        ships no token log."""
        return self._live(session_id, owner) is not None

    def log(self, session_id: str, owner: str | None = None) -> list[int] | None:
        """The token log, for an append-mode turn (None if the session does not exist)."""
        rec = self._live(session_id, owner)
        return rec.log.tolist() if rec is not None else None

    def info(
        self, session_id: str, owner: str | None = None, with_history: bool = False
    ) -> dict | None:
        rec = self._live(session_id, owner)
        if rec is None:
            return None
        return {
            "replica": rec.replica,
            "turns": rec.turns,
            "history_tokens": len(rec.log),
            "ttl_s": rec.ttl_s,
        } | ({"history": rec.log.tolist()} if with_history else {})

    def close(self, session_id: str, owner: str | None = None) -> str | None:
        """Forget the session; returns its replica pin ("" if it never ran a turn), None if
        it did not exist."""
        if self._live(session_id, owner) is None:
            return None
        rec = self._forget(session_id)
        return None if rec is None else (rec.replica or "")

    def commit_turn(self, session_id: str, full_ids: list[int]) -> None:
        """A turn succeeded: its input and answer are now the session's token log."""
        rec = self.sessions.get(session_id)
        if rec is not None:
            rec.log = array("I", full_ids)  # 4 bytes a token: logs of many long sessions
            rec.turns, rec.last_active = rec.turns + 1, time.monotonic()

    # ---- stored responses (Responses API) ----
    def store_response(
        self,
        session_id: str,
        response: dict,
        items: list[dict],
        full_ids: list[int],
        owner: str | None = None,
    ) -> bool:
        """Keep a finished response, a committed turn of its session (one call, so the two
        never disagree); False if the session is gone (closed or expired)."""
        if self._live(session_id, owner) is None:
            return False
        self.commit_turn(session_id, full_ids)
        self.sessions[session_id].responses[response["id"]] = StoredResponse(response, items)
        self.response_sessions[response["id"]] = session_id
        return True

    def get_response(self, response_id: str, owner: str | None = None) -> dict | None:
        """{"session_id", "response", "items"} (marking the session active), or None."""
        session_id = self.response_sessions.get(response_id)
        rec = self._live(session_id, owner) if session_id is not None else None
        stored = rec.responses.get(response_id) if rec is not None else None
        if stored is None:
            return None
        return {"session_id": session_id, "response": stored.response, "items": stored.items}

    def delete_response(self, response_id: str, owner: str | None = None) -> bool:
        if self.get_response(response_id, owner) is None:
            return False
        session_id = self.response_sessions.pop(response_id)
        return self.sessions[session_id].responses.pop(response_id, None) is not None

    def _forget(self, session_id: str) -> SessionRecord | None:
        rec = self.sessions.pop(session_id, None)
        if rec is None:
            return None
        for response_id in rec.responses:
            self.response_sessions.pop(response_id, None)
        left = self.owner_sessions.get(rec.owner, 0) - 1
        if left > 0:
            self.owner_sessions[rec.owner] = left
        else:
            self.owner_sessions.pop(rec.owner, None)
        return rec

    def _live(self, session_id: str, owner: str | None) -> SessionRecord | None:
        self._reap()
        rec, now = self.sessions.get(session_id), time.monotonic()
        if rec is not None and _expired(rec, now):
            self._forget(session_id)
            return None
        if rec is None or rec.owner != owner:
            return None
        rec.last_active = now
        return rec

    # ---- pins ----
    def get_pin(self, session_id: str) -> str | None:
        rec = self.sessions.get(session_id)
        return rec.replica if rec else None

    def resolve_pin(self, session_id: str, choice: str, alive: list[str]) -> tuple[str, str | None]:
        """The session's replica: its pin if that replica is alive, else `choice`, which
        becomes the pin. Returns (replica, previous pin). One call, atomic in this actor, so
        routers placing the same session concurrently agree. A session the registry does not
        know (no explicit open) is pinned all the same."""
        rec = self.sessions.get(session_id)
        if rec is None:
            rec = self.sessions[session_id] = SessionRecord(session_id, self.default_ttl_s)
            self.owner_sessions[None] = self.owner_sessions.get(None, 0) + 1
        previous = rec.replica
        if previous not in alive:
            rec.replica = choice
            self.repins += previous is not None
        return rec.replica, previous

    def drop_replica(self, replica: str) -> int:
        """A replica died: forget its pins (its sessions are re-placed on their next turn)."""
        n = 0
        for rec in self.sessions.values():
            if rec.replica == replica:
                rec.replica, n = None, n + 1
        return n

    def counts(self) -> dict[str, int]:
        return {"sessions": len(self.sessions), "repins": self.repins}

    def _reap(self) -> None:
        """Forget expired sessions: a full sweep at most once a second (it is O(sessions));
        `_live` checks the one it is asked about in between."""
        now = time.monotonic()
        if now < self._next_sweep:
            return
        self._next_sweep = now + REAP_PERIOD_S
        for sid, rec in list(self.sessions.items()):
            if _expired(rec, now):
                self._forget(sid)


def _expired(rec: SessionRecord, now: float) -> bool:
    return rec.ttl_s is not None and now - rec.last_active > rec.ttl_s


SessionDirectory = ray.remote(num_cpus=0)(SessionDirectoryState)


def directory_name(app_name: str) -> str:
    return f"session-directory-{app_name or 'default'}"


def get_directory(app_name: str, default_ttl_s: float | None = None):
    """The application's directory actor, created on first use (detached: it must outlive any
    one router or ingress replica, and it dies with the cluster)."""
    return SessionDirectory.options(
        name=directory_name(app_name),
        namespace=NAMESPACE,
        get_if_exists=True,
        lifetime="detached",
    ).remote(default_ttl_s)
