"""Live session migration, the replica side: a session leaves as its token log and KV.

The source replica runs the protocol, whoever asked (the admin API, or Serve stopping it):
  1. export: the session must be idle; it is marked *moving*, so a turn that reaches this
     replica now waits for the outcome instead of starting (it can never run on both);
  2. import on the target, through a Serve handle call: Ray moves the export (its KV is one
     contiguous tensor per model) through the object store;
  3. the directory re-pins the session from source to target, compare-and-set (a session
     closed or re-pinned meanwhile is not moved: the target's copy is closed again);
  4. end: moved, the session is closed here and remembered as moved (a waiting or late turn
     gets SessionMovedError, which the ingress answers by re-routing); not moved, the mark is
     lifted and waiting turns run here as if nothing happened. A target that dies mid-import
     is "not moved": the session keeps its KV here.
A mark whose protocol never ends (its caller died) is lifted after HOLD_S.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from sessionserve.errors import (
    SessionBusyError,
    SessionMovedError,
    UnknownReplicaError,
    unwrap,
)
from sessionserve.replicas.engine import Engine
from sessionserve.replicas.sessions import SessionExport

log = logging.getLogger(__name__)
HOLD_S = 30.0  # longest a session stays marked moving
MOVED_MEMORY = 65536  # sessions remembered as moved (a stale route past that re-prefills here)
SHUTDOWN_CONCURRENCY = 4
IMPORT_TRIES = 3  # replicas tried for an import without an explicit target


@dataclass
class MoveResult:
    session_id: str
    source: str
    target: str | None  # None: not moved
    kv: str  # where the KV went on the target: "pool", "host" or "none"
    kv_bytes: int
    history_tokens: int
    seconds: float
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return dict(vars(self))


class SessionMover:
    def __init__(self, engine: Engine, run: Callable[..., Awaitable[Any]], replica_id: str) -> None:
        self.engine = engine
        self._run = run  # runs an engine call on the engine thread
        self.replica_id = replica_id
        self.moving: dict[str, asyncio.Event] = {}
        self.moved: OrderedDict[str, None] = OrderedDict()

    # ---- turns ----
    async def admit_turn(self, session_id: str | None) -> None:
        """Before a turn starts here: wait out a migration of its session; raise
        SessionMovedError if the session lives elsewhere now. Returns without suspending in
        the common case, so the caller queues its submit before any later export."""
        if session_id is None:
            return
        event = self.moving.get(session_id)
        if event is not None:
            await event.wait()
        if session_id in self.moved:
            raise SessionMovedError(session_id)

    def arrived(self, session_id: str) -> None:
        """The session was imported here (it may have lived here before)."""
        self.moved.pop(session_id, None)

    # ---- the protocol, source side ----
    async def move(
        self,
        session_id: str,
        handle: Any,
        directory: Any,
        target: str | None = None,
        trigger: str = "admin",
    ) -> MoveResult:
        """Move one idle session to `target` (None: the replica with the most free KV).
        Raises SessionBusyError (a turn in flight) or UnknownSessionError before anything
        changed; any later failure leaves the session here, intact."""
        started = time.monotonic()
        export = await self._export(session_id)
        result = MoveResult(
            session_id, self.replica_id, None, "none", export.kv_bytes, len(export.history), 0.0
        )
        try:
            placed = await self._import(handle, export, target)
            if await directory.move_pin(session_id, self.replica_id, placed["replica"]):
                result.target, result.kv = placed["replica"], placed["kv"]
            else:  # closed or re-pinned meanwhile: the copy there must not linger
                result.error = "the session was closed or re-pinned during the move"
                await handle.close_session.remote(session_id, replica=placed["replica"])
        except Exception as e:  # the target died, refused, or the directory did not answer
            result.error = f"{type(e).__name__}: {e}"
            log.warning("session %s not moved: %s", session_id, result.error)
        finally:
            result.seconds = time.monotonic() - started
            await self._end(session_id, result.target is not None)
        if result.target is not None:
            self.engine.metrics.on_migration(trigger, result.seconds)
        return result

    async def _import(self, handle: Any, export: SessionExport, target: str | None) -> dict:
        """Import on `target`, or on the freest other replica: one that refuses (it is
        stopping too, as in a rolling update) is avoided on the next try."""
        avoid = [self.replica_id]
        for attempt in range(IMPORT_TRIES):
            try:
                return await handle.import_session.remote(export, replica=target, avoid=avoid)
            except Exception as e:
                err = unwrap(e)
                if target is not None or attempt == IMPORT_TRIES - 1:
                    raise
                if not isinstance(err, UnknownReplicaError) or not err.replica:
                    raise
                avoid.append(err.replica)
        raise AssertionError("unreachable")

    async def move_all(self, handle: Any, directory: Any, budget_s: float) -> list[MoveResult]:
        """Serve is stopping this replica: move every idle session to live replicas within
        `budget_s`, most recently used first; the rest re-prefill on their next turn."""
        started = time.monotonic()
        sids = await self._run(self.engine.idle_sessions)
        gate = asyncio.Semaphore(SHUTDOWN_CONCURRENCY)
        results: list[MoveResult] = []

        async def one(sid: str) -> None:
            async with gate:
                with contextlib.suppress(Exception):  # busy or gone: nothing to move
                    results.append(await self.move(sid, handle, directory, trigger="shutdown"))

        tasks = [asyncio.ensure_future(one(sid)) for sid in sids]
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=budget_s)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        moved = [r for r in results if r.target is not None]
        log.warning(
            "replica stopping: moved %d of %d sessions to live replicas in %.1f s (KV: %s)",
            len(moved),
            len(sids),
            time.monotonic() - started,
            dict(Counter(r.kv for r in moved)),
        )
        return results

    async def _export(self, session_id: str) -> SessionExport:
        if session_id in self.moving:
            raise SessionBusyError(session_id, "<a migration>")
        event = self.moving[session_id] = asyncio.Event()  # before any suspension: see admit
        asyncio.get_running_loop().call_later(HOLD_S, self._lift, session_id, event)
        try:
            return await self._run(self.engine.export_session, session_id)
        except BaseException:
            self._lift(session_id, event)
            raise

    async def _end(self, session_id: str, moved: bool) -> None:
        if moved:
            self.moved[session_id] = None
            while len(self.moved) > MOVED_MEMORY:
                self.moved.popitem(last=False)
            with contextlib.suppress(KeyError):  # gone already: nothing held
                await asyncio.shield(self._run(self.engine.close_session, session_id))
        event = self.moving.get(session_id)
        if event is not None:
            self._lift(session_id, event)

    def _lift(self, session_id: str, event: asyncio.Event) -> None:
        if self.moving.get(session_id) is event:
            del self.moving[session_id]
        event.set()
