"""The ingress's, the routers' and the replicas' handle on the session directory: one typed
method per directory call, each routed to the shard that holds its session.

With `directory.shards: N` the directory is N actors; a session lives on shard
`crc32(session_id) % N` (its record, pin, token log and stored responses), and a response id
is drawn so that it hashes to its session's shard, so every call goes to one actor without
asking anyone. Calls about no session (a dead replica's pins, counts) go to every shard.
Each shard is its own detached actor on the head node, restarted by Ray and rebuilt from its
own store prefix. The shard count is fixed for the life of the application's sessions: a
session stays on the shard its id hashed to when it was opened.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
import zlib
from typing import Any

from sessionserve.directory.state import SessionDirectory, too_many_sessions
from sessionserve.directory.store import NAMESPACE
from sessionserve.errors import DirectoryUnavailableError
from sessionserve.wire import new_id

log = logging.getLogger(__name__)

HEAD_NODE_RESOURCE = "node:__internal_head__"  # Ray gives the head node this resource
CALL_TIMEOUT_S = 30.0  # a directory call waits this long for a restarting actor


def directory_name(app_name: str, shard: int = 0, shards: int = 1) -> str:
    base = f"session-directory-{app_name or 'default'}"
    return base if shards == 1 else f"{base}-{shard}-of-{shards}"


def shard_of(key: str, shards: int) -> int:
    """Stable across processes (Python's own hash of a str is salted per process)."""
    return zlib.crc32(key.encode()) % shards if shards > 1 else 0


def _acquire(app_name: str, default_ttl_s: float | None, shard: int, shards: int) -> Any:
    """Get or create one shard's actor, on the head node: the node that lives as long as the
    cluster (a GPU worker may be scaled away or drained)."""
    prefix = "" if shards == 1 else f"shard-{shard}-of-{shards}/"
    return SessionDirectory.options(
        name=directory_name(app_name, shard, shards),
        namespace=NAMESPACE,
        get_if_exists=True,
        lifetime="detached",
        resources={HEAD_NODE_RESOURCE: 0.001},
    ).remote(app_name, default_ttl_s, prefix)


class DirectoryClient:
    """A restarting shard makes calls wait (Ray retries them); one that is gone for good
    (killed without restart) is looked up again, which creates it anew from its store, and
    the call is retried once. Still failing, the caller gets Ray's actor error (a 503 with
    Retry-After at the API); a shard that does not answer within CALL_TIMEOUT_S is a
    DirectoryUnavailableError (a 503): never a hang, never a wrong answer. `actors`: the
    shards' handles (tests pass fakes); by default they are looked up or created."""

    def __init__(
        self,
        app_name: str,
        default_ttl_s: float | None = None,
        shards: int = 1,
        actors: list[Any] | None = None,
    ) -> None:
        if shards < 1:
            raise ValueError(f"directory shards={shards}: must be >= 1")
        self.app_name, self.default_ttl_s, self.shards = app_name, default_ttl_s, shards
        self.actors = actors or [
            _acquire(app_name, default_ttl_s, i, shards) for i in range(shards)
        ]

    # ---- sessions ----
    async def open(
        self,
        session_id: str | None,
        ttl_s: float | None,
        owner: str | None = None,
        owner_limit: int | None = None,
    ) -> str | None:
        """Register a session (a new id when None); None if the id is taken. An API key may
        hold `owner_limit` sessions (across shards: counted before the open, so concurrent
        opens of one key on different shards may pass it by up to shards - 1)."""
        sid = session_id or uuid.uuid4().hex
        if self.shards > 1 and owner is not None and owner_limit is not None:
            held = sum(await self._everywhere("owner_count", owner))
            if held >= owner_limit:
                raise too_many_sessions(held, owner_limit)
            owner_limit = None
        return await self._session(sid, "open", ttl_s, owner, owner_limit)

    async def touch(self, session_id: str, owner: str | None = None) -> dict | None:
        return await self._session(session_id, "touch", owner)

    async def touch_or_open(
        self,
        session_id: str,
        owner: str | None,
        ttl_s: float | None,
        owner_limit: int | None = None,
    ) -> dict | None:
        """`touch`, opening the session where it does not exist (implicit open): one call to
        its shard. Where a key's limit is counted across shards (`open`), a touch and, for a
        new session only, an open and a touch."""
        if self.shards > 1 and owner is not None and owner_limit is not None:
            record = await self.touch(session_id, owner)
            if record is None and await self.open(session_id, ttl_s, owner, owner_limit):
                record = await self.touch(session_id, owner)
            return record
        return await self._session(session_id, "touch_or_open", owner, ttl_s, owner_limit)

    async def log(self, session_id: str, owner: str | None = None) -> list[int] | None:
        return await self._session(session_id, "log", owner)

    async def info(
        self, session_id: str, owner: str | None = None, with_history: bool = False
    ) -> dict | None:
        return await self._session(session_id, "info", owner, with_history)

    async def close(self, session_id: str, owner: str | None = None) -> str | None:
        return await self._session(session_id, "close", owner)

    async def commit_turn(self, session_id: str, base: int, tail: list[int]) -> bool:
        return await self._session(session_id, "commit_turn", base, tail)

    # ---- stored responses ----
    def response_id(self, session_id: str) -> str:
        """A new response id that lives on its session's shard."""
        want = shard_of(session_id, self.shards)
        while True:
            rid = new_id("resp")
            if shard_of(rid, self.shards) == want:
                return rid

    async def store_response(
        self,
        session_id: str,
        response: dict,
        items: list[dict],
        base: int,
        tail: list[int],
        owner: str | None = None,
    ) -> bool:
        return await self._session(session_id, "store_response", response, items, base, tail, owner)

    async def get_response(self, response_id: str, owner: str | None = None) -> dict | None:
        return await self._call(
            shard_of(response_id, self.shards), "get_response", response_id, owner
        )

    async def delete_response(self, response_id: str, owner: str | None = None) -> bool:
        shard = shard_of(response_id, self.shards)
        return await self._call(shard, "delete_response", response_id, owner)

    # ---- pins ----
    async def resolve_pin(
        self, session_id: str, choice: str, alive: list[str]
    ) -> tuple[str, str | None]:
        return await self._session(session_id, "resolve_pin", choice, alive)

    async def move_pin(self, session_id: str, source: str, target: str) -> bool:
        return await self._session(session_id, "move_pin", source, target)

    def drop_replica(self, replica: str) -> None:
        """A replica died: every shard forgets its pins (fire and forget: routers call this
        from Serve's synchronous callback)."""
        for actor in self.actors:
            actor.drop_replica.remote(replica)

    async def counts(self) -> dict[str, int]:
        parts = await self._everywhere("counts")
        return {k: sum(p[k] for p in parts) for k in parts[0]}

    # ---- transport ----
    async def _everywhere(self, method: str, *args: Any) -> list[Any]:
        return await asyncio.gather(*(self._call(i, method, *args) for i in range(self.shards)))

    async def _session(self, session_id: str, method: str, *args: Any) -> Any:
        return await self._call(shard_of(session_id, self.shards), method, session_id, *args)

    async def _call(self, shard: int, method: str, *args: Any) -> Any:
        from ray.exceptions import RayActorError

        try:
            return await self._once(shard, method, args)
        except RayActorError:
            log.warning(
                "session directory %s shard %d is gone: looking it up again", self.app_name, shard
            )
            self.actors[shard] = _acquire(self.app_name, self.default_ttl_s, shard, self.shards)
            return await self._once(shard, method, args)

    async def _once(self, shard: int, method: str, args: tuple) -> Any:
        """One call, bounded: a directory that cannot come back is a 503, never a hang."""
        ref = getattr(self.actors[shard], method).remote(*args)
        try:
            return await asyncio.wait_for(asyncio.ensure_future(ref), CALL_TIMEOUT_S)
        except TimeoutError:
            raise DirectoryUnavailableError(
                f"the session directory did not answer within {CALL_TIMEOUT_S:.0f} s "
                "(restarting?); retry shortly"
            ) from None


def get_directory(
    app_name: str, default_ttl_s: float | None = None, shards: int = 1
) -> DirectoryClient:
    """The application's directory, created on first use (detached: it outlives every router
    and ingress replica; its state outlives the actor itself, in the GCS store)."""
    return DirectoryClient(app_name, default_ttl_s, shards)
