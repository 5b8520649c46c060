"""The ingress and the engine in one Serve replica (`ingress.colocated: true`).

On one node with one model replica, a turn otherwise crosses three processes: Serve's proxy,
the ingress and the model replica, and every streamed message is a Ray call between the last
two. On a small CPU machine those hops' CPU comes out of the forward's cores (measured in
docs/benchmarks.md, "The ingress inside the replica"). Here the ingress's routes call the
replica's `ReplicaServer` in the same process through `LocalReplica`, which answers the few
handle calls the ingress makes (`options(...)`, `method.remote(...)`, a stream's `__anext__`
and `cancel`), pins each session to this replica in the directory as the session router does
(so session views, failover logs and a restarted replica work as in the other topology), and
applies the replica deployment's admission limits, so that both topologies behave the same to
a client. There is no migration: no other replica to move a session to.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any

from ray.serve.exceptions import BackPressureError

from sessionserve.api.ingress import Ingress
from sessionserve.config import AppConfig
from sessionserve.directory.client import DirectoryClient
from sessionserve.errors import UnknownReplicaError
from sessionserve.replicas.server import ReplicaServer
from sessionserve.router.pin_cache import PinCache
from sessionserve.wire import TurnDelta, TurnResult

NO_OTHER_REPLICA = "this application runs one replica with its ingress (ingress.colocated)"
PINS_CACHED = 65536  # sessions whose pin this process remembers (as a router's max_cached_pins)


class Admission:
    """The replica deployment's limits on turns: `max_ongoing` run at once, `max_queued` more
    wait (-1: any number), the rest are refused as Serve's handle refuses them
    (`BackPressureError`, a 503 with an OpenAI error body)."""

    def __init__(self, max_ongoing: int, max_queued: int) -> None:
        self.max_queued = max_queued
        self.waiting = 0
        self._slots = asyncio.Semaphore(max_ongoing)

    async def enter(self) -> None:
        if self._slots.locked() and 0 <= self.max_queued <= self.waiting:
            raise BackPressureError(self.waiting, self.max_queued)
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1

    def leave(self) -> None:
        self._slots.release()


class LocalStream:
    """A turn's stream from the replica in this process (what `TurnStream` asks for)."""

    def __init__(self, pieces: AsyncIterator[TurnDelta | TurnResult]) -> None:
        self._pieces = pieces
        self._closing: asyncio.Task | None = None

    def __anext__(self) -> Awaitable[TurnDelta | TurnResult]:
        return self._pieces.__anext__()

    def cancel(self) -> None:
        """The client went away: close the turn (the replica aborts it, keeping what its
        session committed), as cancelling a Serve stream does."""
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._pieces.aclose())  # type: ignore[attr-defined]


class _Method:
    def __init__(self, owner: LocalReplica, name: str, call: _Call) -> None:
        self.owner, self.name, self.call = owner, name, call

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        sid = self.call.session_id
        if self.call.stream:
            return LocalStream(self.owner.stream(sid, self.name, *args, **kwargs))
        return asyncio.ensure_future(self.owner.call(sid, self.name, *args, **kwargs))


@dataclass(frozen=True)
class _Call:
    """What `options(...)` set: a streaming method, and the session the call is for."""

    stream: bool = False
    session_id: str | None = None


class LocalReplica:
    """A deployment handle's shape over the `ReplicaServer` in this process. `directory`: the
    app's, where each session a call names is pinned to this replica (`pins`: this process's
    cache of those, as a router keeps; the ingress's `forget_pin` reaches it)."""

    def __init__(
        self,
        server: ReplicaServer,
        admission: Admission,
        directory: DirectoryClient | None,
        pins: PinCache | None = None,
        call: _Call = _Call(),
    ) -> None:
        self.server, self.admission, self.directory = server, admission, directory
        self.pins = PinCache(PINS_CACHED) if pins is None else pins
        self._call = call

    def options(
        self, *, stream: bool = False, session_id: str | None = None, **_: Any
    ) -> LocalReplica:
        """`stream`: the method yields; `session_id`: the session it is for (pinned here)."""
        return LocalReplica(
            self.server, self.admission, self.directory, self.pins, _Call(stream, session_id)
        )

    def __getattr__(self, name: str) -> _Method:
        if name.startswith("_"):
            raise AttributeError(name)
        return _Method(self, name, self._call)

    async def call(self, session_id: str | None, name: str, *args: Any, **kwargs: Any) -> Any:
        if name in ("migrate_session", "import_session"):
            raise UnknownReplicaError(f"no other replica to move a session to: {NO_OTHER_REPLICA}")
        await self._pin(session_id)
        result = getattr(self.server, name)(*args, **kwargs)
        return await result if inspect.isawaitable(result) else result

    async def stream(
        self, session_id: str | None, name: str, *args: Any, **kwargs: Any
    ) -> AsyncIterator[Any]:
        """The replica's stream, inside an admission slot that is free again as soon as the
        turn's final record comes (the ingress reads no further; Serve would drive the
        replica's generator to its end) or the stream is closed early."""
        await self._pin(session_id)
        await self.admission.enter()
        pieces = getattr(self.server, name)(*args, **kwargs)
        ended = False
        try:
            async for piece in pieces:
                if isinstance(piece, TurnResult):
                    ended = True
                    await self._end(pieces)
                yield piece
        finally:  # closed early (the client went away): the replica's turn ends now
            if not ended:
                await self._end(pieces)

    async def _end(self, pieces: Any) -> None:
        try:
            await pieces.aclose()
        finally:
            self.admission.leave()

    async def _pin(self, session_id: str | None) -> None:
        """The directory's pin of the session is this replica (as `SessionAffinityRouter`
        makes it): asked once per session and process, then cached."""
        here = self.server.replica_id
        if session_id is None or self.directory is None or self.pins.get(session_id) == here:
            return
        winner, _ = await self.directory.resolve_pin(session_id, here, [here])
        self.pins.put(session_id, winner)


class ColocatedServer(Ingress):
    """The Serve deployment of `ingress.colocated`: the ingress's routes over a replica built
    in this process. Named SessionReplica (as the model replicas of the other topology), it
    also answers the replica calls operators and tests make on that deployment's handle."""

    async def __init__(self, engine_config: dict[str, Any], config: dict[str, Any]) -> None:
        cfg = AppConfig.model_validate(config)
        self.server = ReplicaServer(
            engine_config,
            directory_shards=cfg.directory.shards,
            stream_interval_ms=cfg.replica.stream_interval_ms,
            stream_messages_per_s=cfg.stream_message_budget(),
        )
        admission = Admission(cfg.replica.max_ongoing_requests, cfg.replica.max_queued_requests)
        local = LocalReplica(self.server, admission, directory=None)
        await super().__init__(local, config)
        local.directory = self.turns.directory  # the ingress's client: one in this process

    def _caller_name(self, context: Any) -> str | None:
        return None  # the engine is in this process: it dies with its caller

    # ---- the replica's handle calls (no routes) ----
    async def memory_check(self) -> dict[str, Any]:
        return await self.server.memory_check()

    async def model_limits(self) -> dict[str, int]:
        return await self.server.model_limits()

    # ---- Serve hooks ----
    def check_health(self) -> None:
        self.server.check_health()

    async def __del__(self) -> None:
        """Stop the engine (its streams end with finish_reason "abort"; no other replica
        takes the sessions), then the ingress's ASGI app."""
        server = getattr(self, "server", None)
        if server is not None:
            server.shutdown()
        await super().__del__()
