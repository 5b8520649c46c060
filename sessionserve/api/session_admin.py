"""The session API's work, with no HTTP in it: open, look up, close, move and park a session,
and the session fields a turn carries to its replica.

The directory (`directory/state.py`) owns what a session is: its owner, TTL, pin, token log
and committed-turn count; this class asks it, and reaches the session's replica through the
deployment handle (the session router pins the call) for what only the replica knows (the KV
it holds) or does (move, park, free).
"""

from __future__ import annotations

from typing import Any

from sessionserve.api.protocol import SessionMigration, SessionView, check_session_id
from sessionserve.api.turns import TurnTransport
from sessionserve.config import AppConfig
from sessionserve.errors import (
    InvalidRequestError,
    MigrationFailedError,
    SessionExistsError,
    SessionNotPlacedError,
    UnknownSessionError,
)
from sessionserve.router.pin_cache import check_pin, forget_pin


class SessionAdmin:
    def __init__(self, transport: TurnTransport, cfg: AppConfig) -> None:
        self.transport = transport
        self.directory = transport.directory
        self.replica = transport.replica
        self.cfg = cfg

    async def open(self, sid: str | None, ttl_s: float | None, owner: str | None) -> str | None:
        """Register a session in the directory (None: the id is taken); 429 past the key's
        `ingress.max_sessions_per_key`."""
        limit = self.cfg.ingress.max_sessions_per_key
        if ttl_s is None:  # this deployment's default (the directory may predate a redeploy)
            ttl_s = self.cfg.engine.sessions.default_ttl_s
        return await self.directory.open(sid, ttl_s, owner, limit)

    async def create(self, sid: str | None, ttl_s: float | None, owner: str | None) -> SessionView:
        """`POST /v1/sessions`: 409 when the id is taken."""
        opened = await self.open(sid, ttl_s, owner)
        if opened is None:
            raise SessionExistsError(sid or "")
        return await self.view(opened, owner)

    async def close(self, sid: str, owner: str | None) -> bool:
        """Forget the session (and its stored responses); free its KV on its replica."""
        replica = await self.directory.close(sid, owner)
        if replica:  # frees its KV there (deferred while a turn runs)
            await self.transport.free(sid)
        return replica is not None

    async def info(self, sid: str, owner: str | None, history: bool = False) -> dict[str, Any]:
        """The directory's record of a session of this caller's (404 if there is none)."""
        info = await self.directory.info(sid, owner, history)
        if info is None:
            raise UnknownSessionError(sid)
        return info

    async def view(self, sid: str, owner: str | None, history: bool = False) -> SessionView:
        """The directory's record and the KV its replica holds for it now."""
        info = await self.info(sid, owner, history)
        held = None
        if info["replica"] is not None:
            held = await self.replica.options(session_id=sid).session_held_tokens.remote(sid)
        return SessionView(id=sid, held_tokens=held, **info)

    async def migrate(self, sid: str, target: str | None, owner: str | None) -> SessionMigration:
        """Move an idle session (its token log and KV) to `target` (None: the freest other
        replica). 409 while a turn runs; on any failure it stays, intact, where it was."""
        source = (await self.info(sid, owner))["replica"]
        if source is None:
            raise SessionNotPlacedError(sid)
        if target == source:
            raise InvalidRequestError(
                f"session {sid!r} is on replica {target!r} already", param="target_replica"
            )
        result = await self.replica.migrate_session.remote(sid, target, replica=source)
        forget_pin(sid)
        if result["target"] is None:
            raise MigrationFailedError(
                f"session {sid!r} was not moved ({result['error']}); it is unchanged on its replica"
            )
        return SessionMigration(id=sid, **{k: v for k, v in result.items() if k != "error"})

    async def park(self, sid: str, owner: str | None) -> bool:
        """Move an idle session's KV out of device memory now; True if the host tier keeps it
        (else it is dropped and the next turn re-prefills)."""
        if (await self.info(sid, owner))["replica"] is None:
            return False
        return await self.replica.options(session_id=sid).park_session.remote(sid)

    async def turn_fields(
        self, header_sid: str | None, body_sid: str | None, owner: str | None
    ) -> dict[str, Any]:
        """A turn's `GenerateCall` session fields (none without a session): its id (the
        header's, else the body's), its idle TTL, which the replica applies if it opens the
        session (its first turn there), and the length of its failover log (the log goes on
        demand). An unknown id is opened when `engine.sessions.implicit_open` says so."""
        if header_sid is not None:
            check_session_id(header_sid, self.cfg.session_header)
        sid = header_sid or body_sid
        if sid is None:
            return {}
        sessions = self.cfg.engine.sessions
        if sessions.implicit_open:  # one call, a new session's first turn too
            limit = self.cfg.ingress.max_sessions_per_key
            record = await self.directory.touch_or_open(sid, owner, sessions.default_ttl_s, limit)
        else:
            record = await self.directory.touch(sid, owner)
        if record is None:  # unknown, or taken by another key: as if it did not exist
            raise UnknownSessionError(sid)
        check_pin(sid, record["replica"])  # this process's routers follow the directory
        return {"session_id": sid, "ttl_s": record["ttl_s"], "log_tokens": record["log_tokens"]}
