"""The session directory: one named Ray actor per application, shared by every router and
ingress replica, so a session reaches the same replica whichever process routes it.

It holds, per session: the pinned replica, the token log (prompts and answers of every
successful turn: the source of truth for re-prefill after a failover), the turn count, the
idle TTL, and the stored responses of the Responses API (a chain of responses is one session;
they expire and are deleted with it). Pins change only inside the actor (`resolve_pin`), so
two routers placing the same session concurrently agree on one replica.

A turn costs the directory what it adds, not the session's length: a commit sends the new
tokens and where they go (`commit_turn(sid, base, tail)`: the log is cut at `base`, then
`tail` follows), and the store keeps each log as append-only chunks (one write per turn,
compacted into one chunk every `MAX_LOG_CHUNKS` turns).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from array import array
from dataclasses import dataclass, field

import ray

from sessionserve.directory.store import GcsStore, SessionStore
from sessionserve.errors import TooManySessionsError

log = logging.getLogger(__name__)

REAP_PERIOD_S = 1.0
MAX_LOG_CHUNKS = 64  # a log stored in more chunks is rewritten as one (amortized O(new))


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
    turns: int = 0  # committed turns: a log committed again (a retry) counts once
    last_active: float = field(default_factory=lambda: time.monotonic())
    responses: dict[str, StoredResponse] = field(default_factory=dict)
    owner: str | None = None  # the API key fingerprint that opened it (None: no auth)
    # the log in the store: chunks `first_chunk .. first_chunk + chunks - 1` (see _log_key)
    first_chunk: int = 0
    chunks: int = 0


class SessionDirectoryState:
    """The directory's state and logic (plain Python; `SessionDirectory` is its Ray actor)."""

    def __init__(
        self, default_ttl_s: float | None = None, store: SessionStore | None = None
    ) -> None:
        self.sessions: dict[str, SessionRecord] = {}
        self.response_sessions: dict[str, str] = {}  # response id -> its session
        self.owner_sessions: dict[str | None, int] = {}  # open sessions per API key
        self._next_sweep = 0.0
        self.default_ttl_s = default_ttl_s
        self.repins = 0
        self.mismatches = 0  # commits refused: they followed a longer log than the one here
        self.store = store
        if store is not None:
            self._restore(store)

    # ---- persistence: a copy of every record in the store ----
    def _restore(self, store: SessionStore) -> None:
        """Rebuild from the store (a restarted directory): records first, then responses."""
        saved = store.load()
        now = time.monotonic()
        for key, rec in saved.items():
            if key.startswith("s/"):
                rec.last_active = now  # idle clocks restart: touches are not written
                rec.log = array("I")
                for i in range(rec.first_chunk, rec.first_chunk + rec.chunks):
                    base, tail = saved[_log_key(rec.session_id, i)]
                    del rec.log[base:]
                    rec.log.extend(tail)
                self._register(rec)
        for key, (session_id, stored) in ((k, v) for k, v in saved.items() if k[:2] == "r/"):
            rec = self.sessions.get(session_id)
            if rec is None:  # its session went while the response was written
                store.delete(key)
                continue
            rec.responses[stored.response["id"]] = stored
            self.response_sessions[stored.response["id"]] = session_id
        if saved:
            log.warning(
                "session directory rebuilt from the store: %d sessions, %d responses",
                len(self.sessions),
                len(self.response_sessions),
            )

    def _save(self, rec: SessionRecord) -> None:
        """The record, without its log and responses (they have keys of their own)."""
        if self.store is not None:
            empty = array("I")
            self.store.put(f"s/{rec.session_id}", dataclasses.replace(rec, responses={}, log=empty))

    def _save_log(self, rec: SessionRecord, base: int, tail: array) -> None:
        """Append one chunk (cut at `base`, then `tail`), or, every MAX_LOG_CHUNKS, one chunk
        holding the whole log; the record is written after the chunk it names, and chunks it
        no longer names are deleted after it, so a directory dying in between loses nothing."""
        if self.store is None:
            return
        old = range(rec.first_chunk, rec.first_chunk + rec.chunks)
        if rec.chunks + 1 >= MAX_LOG_CHUNKS:
            new = rec.first_chunk + rec.chunks
            self.store.put(_log_key(rec.session_id, new), (0, rec.log))
            rec.first_chunk, rec.chunks = new, 1
            self._save(rec)
            for i in old:
                self.store.delete(_log_key(rec.session_id, i))
            return
        self.store.put(_log_key(rec.session_id, rec.first_chunk + rec.chunks), (base, tail))
        rec.chunks += 1
        self._save(rec)

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
            raise too_many_sessions(held, owner_limit)
        ttl = ttl_s if ttl_s is not None else self.default_ttl_s
        self._save(self._register(SessionRecord(sid, ttl, owner=owner)))
        return sid

    def owner_count(self, owner: str | None) -> int:
        """Open sessions of an API key here (a sharded directory sums its shards')."""
        self._reap()
        return self.owner_sessions.get(owner, 0)

    def touch(self, session_id: str, owner: str | None = None) -> dict | None:
        """The per-request check (marking the session active; ships no token log): None if
        the session does not exist, else its pin (for the ingress to check its routers'
        cached one) and what a replica needs to open it (its TTL; its log's length: a replica
        lacking the session asks for the log itself)."""
        rec = self._live(session_id, owner)
        if rec is None:
            return None
        return {"ttl_s": rec.ttl_s, "replica": rec.replica, "log_tokens": len(rec.log)}

    def touch_or_open(
        self,
        session_id: str,
        owner: str | None,
        ttl_s: float | None,
        owner_limit: int | None = None,
    ) -> dict | None:
        """`touch`, opening the session first where it does not exist (implicit open): a new
        session's first turn costs the ingress one call here, not a touch and an open. None
        if the id is another key's; 429 past `owner_limit` as `open`."""
        record = self.touch(session_id, owner)
        if record is None and self.open(session_id, ttl_s, owner, owner_limit) is not None:
            record = self.touch(session_id, owner)
        return record

    def log(self, session_id: str, owner: str | None = None) -> list[int] | None:
        """The token log, for an append-mode turn on a replica that lacks the session (None if
        the session does not exist)."""
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

    def commit_turn(self, session_id: str, base: int, tail: list[int]) -> bool:
        """A turn succeeded: the session's token log is now the log cut at `base`, then `tail`
        (its new input and answer; `base` 0 and the whole log when the replica's history and
        this log differed). False: the session is gone (closed or expired while the turn
        ran), nothing is kept. Idempotent: Ray re-sends a call the actor died answering, and
        the same turn committed twice (the same log) counts once. A commit that follows more
        log than this one has is refused and reported (a logged warning and `mismatches`),
        never used to rewrite the log. Costs O(len(tail) + what is cut), not O(log)."""
        rec = self.sessions.get(session_id)
        if rec is None:
            return False
        new = array("I", tail)  # 4 bytes a token: logs of many long sessions
        if base + len(new) == len(rec.log) and rec.log[base:] == new:
            return True  # committed already
        if base > len(rec.log):
            self.mismatches += 1
            log.warning(
                "session %s: a turn followed %d tokens of log, the directory holds %d; "
                "its commit is refused (the failover log stays as it is)",
                session_id,
                base,
                len(rec.log),
            )
            return True
        del rec.log[base:]
        rec.log.extend(new)
        rec.turns, rec.last_active = rec.turns + 1, time.monotonic()
        self._save_log(rec, base, new)
        return True

    # ---- stored responses (Responses API) ----
    def store_response(
        self,
        session_id: str,
        response: dict,
        items: list[dict],
        base: int,
        tail: list[int],
        owner: str | None = None,
    ) -> bool:
        """Keep a finished response, a committed turn of its session (one call, so the two
        never disagree); False if the session is gone (closed or expired)."""
        if self._live(session_id, owner) is None:
            return False
        if response["id"] in self.response_sessions:  # a re-sent call: stored already
            return True
        self.commit_turn(session_id, base, tail)
        stored = self.sessions[session_id].responses[response["id"]] = StoredResponse(
            response, items
        )
        self.response_sessions[response["id"]] = session_id
        if self.store is not None:
            self.store.put(f"r/{response['id']}", (session_id, stored))
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
        if self.store is not None:
            self.store.delete(f"r/{response_id}")
        return self.sessions[session_id].responses.pop(response_id, None) is not None

    def _register(self, rec: SessionRecord) -> SessionRecord:
        """A session enters the registry (`_forget` is the way out): counted for its owner."""
        self.sessions[rec.session_id] = rec
        self.owner_sessions[rec.owner] = self.owner_sessions.get(rec.owner, 0) + 1
        return rec

    def _forget(self, session_id: str) -> SessionRecord | None:
        rec = self.sessions.pop(session_id, None)
        if rec is None:
            return None
        for response_id in rec.responses:
            self.response_sessions.pop(response_id, None)
            if self.store is not None:
                self.store.delete(f"r/{response_id}")
        if self.store is not None:
            self.store.delete(f"s/{session_id}")
            for i in range(rec.first_chunk, rec.first_chunk + rec.chunks):
                self.store.delete(_log_key(session_id, i))
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
        know (closed or expired after the ingress checked it) is routed to `choice` but not
        registered: a DELETE racing a turn must not bring the session back, ownerless; the
        ingress frees what that turn left on the replica (`commit_turn` says it is gone)."""
        rec = self.sessions.get(session_id)
        if rec is None:
            return choice, None
        previous = rec.replica
        if previous not in alive:
            rec.replica = choice
            self.repins += previous is not None
            self._save(rec)
        return rec.replica, previous

    def move_pin(self, session_id: str, source: str, target: str) -> bool:
        """A migration's commit: the session's pin goes from `source` to `target` only if it
        still is `source` (False: closed, expired or re-pinned meanwhile; nothing changed)."""
        rec = self.sessions.get(session_id)
        if rec is None or rec.replica != source:
            return False
        rec.replica = target
        self._save(rec)
        return True

    def drop_replica(self, replica: str) -> int:
        """A replica died: forget its pins (its sessions are re-placed on their next turn)."""
        n = 0
        for rec in self.sessions.values():
            if rec.replica == replica:
                rec.replica, n = None, n + 1
                self._save(rec)
        return n

    def counts(self) -> dict[str, int]:
        return {
            "sessions": len(self.sessions),
            "repins": self.repins,
            "log_mismatches": self.mismatches,
        }

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


def too_many_sessions(held: int, limit: int) -> TooManySessionsError:
    return TooManySessionsError(
        f"this API key holds {held} open sessions, the limit (ingress.max_sessions_per_key) "
        f"is {limit}; close some (DELETE /v1/sessions/{{id}}) or let them expire"
    )


def _log_key(session_id: str, chunk: int) -> str:
    return f"l/{session_id}/{chunk}"


def _expired(rec: SessionRecord, now: float) -> bool:
    return rec.ttl_s is not None and now - rec.last_active > rec.ttl_s


class SessionDirectoryActor(SessionDirectoryState):
    """The directory (one shard of it) as a Ray actor, backed by the GCS store under its own
    prefix: restarted by Ray when killed or when its node goes (calls made meanwhile wait and
    are retried), and rebuilt from the store when it starts, so no session, pin, failover log
    or stored response is lost."""

    def __init__(
        self, app_name: str, default_ttl_s: float | None = None, store_prefix: str = ""
    ) -> None:
        super().__init__(default_ttl_s, GcsStore(app_name, store_prefix))


SessionDirectory = ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)(
    SessionDirectoryActor
)
