"""How a turn crosses from the ingress to its replica and back, with no HTTP in it.

`TurnTransport` starts a turn on its replica and waits for the first piece (so errors before
any token become a proper 4xx), re-sends it with the session's token log to a replica that
asks for it and re-routes it after its session moved; collects or relays the rest; and
records the finished turn in the directory's failover log, shielded from a client that goes
away. The routes (`api/ingress.py`) and the Responses API (`api/responses/service.py`) both
use it; tests drive it with fake handles.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any, Protocol, TypeVar

from sessionserve.api.errors import response_for
from sessionserve.directory.client import DirectoryClient
from sessionserve.errors import (
    SessionLogNeededError,
    SessionMovedError,
    UnknownSessionError,
    unwrap,
)
from sessionserve.router.pin_cache import forget_pin, rebalance_plan
from sessionserve.wire import GenerateCall, TurnDelta, TurnResult

log = logging.getLogger(__name__)
MOVED_RETRIES = 2  # a turn routed to a replica its session just left is re-routed this often
T = TypeVar("T")


class TurnStream(Protocol):
    """What a streaming replica call returns (Serve's `DeploymentResponseGenerator`)."""

    def __anext__(self) -> Awaitable[TurnDelta | TurnResult]: ...

    def cancel(self) -> None: ...


def own_request(coro: Awaitable[T]) -> asyncio.Task[T]:
    """`coro` as a task whose Serve handle calls carry an internal request id of their own.
    A handle call inherits the id of the request it is made in, and Serve's router indexes
    the calls it has yet to place by that id (`RequestRouter._pending_requests_by_id`): of
    several calls made at once within one request (`n` choices), only the first was placed,
    and the others waited for ever while the router probed replicas' queues."""
    from ray.serve import context as serve_context
    from ray.serve._private.utils import generate_request_id

    def fresh_id() -> None:
        current = serve_context._get_serve_request_context()
        own = replace(current, _internal_request_id=generate_request_id())
        serve_context._serve_request_context.set(own)

    context = contextvars.copy_context()
    context.run(fresh_id)
    return asyncio.get_running_loop().create_task(coro, context=context)


class TurnTransport:
    def __init__(
        self,
        replica: Any,
        directory: DirectoryClient,
        ingress_id: str,
        rebalance_queue_len: int | None = None,
        caller: str | None = None,
    ) -> None:
        """`replica`: the replica deployment's handle; `rebalance_queue_len`: the app's
        `replica.rebalance_queue_len` (None: no rebalancing before a turn); `caller`: this
        process's Ray actor name, sent with each call so that a replica aborts the turns of an
        ingress that died (None: the replica runs in this process)."""
        self.replica = replica
        self.directory = directory
        self.ingress_id = ingress_id
        self.rebalance_queue_len = rebalance_queue_len
        self.caller = caller

    async def open(
        self, call: GenerateCall, owner_id: str | None = None
    ) -> tuple[TurnStream, TurnDelta | TurnResult]:
        """Start the turn on its replica and wait for the first piece: errors before any
        token (bad input, busy session, overload) raise here. Re-sent once with the session's
        token log to a replica that lacks the session, and to the new replica of a session
        that moved (up to MOVED_RETRIES times)."""
        if call.session_id is not None and self.rebalance_queue_len is not None:
            await self._rebalance(call.session_id, self.rebalance_queue_len)
        call = replace(call, caller=self.caller)
        attempt = 0
        while True:
            handle = self.replica.options(stream=True, session_id=call.session_id)
            stream = handle.generate.remote(call)
            try:
                return stream, await stream.__anext__()
            except Exception as e:
                err = unwrap(e)
                if isinstance(err, SessionLogNeededError) and call.history_ids is None:
                    call = replace(call, history_ids=await self.session_log(call, owner_id))
                    continue
                if not isinstance(err, SessionMovedError) or attempt == MOVED_RETRIES:
                    raise err from None
            forget_pin(call.session_id)  # migrated: the directory names the new replica
            attempt += 1

    async def session_log(self, call: GenerateCall, owner_id: str | None) -> list[int]:
        """The session's failover token log, for a replica that does not hold the session."""
        assert call.session_id is not None
        history = await self.directory.log(call.session_id, owner_id)
        if history is None:  # deleted or expired since this turn's touch
            raise UnknownSessionError(call.session_id)
        return history

    def stamped(self, final: TurnResult) -> TurnResult:
        """The final record as the client sees it: which ingress served it."""
        return replace(final, ingress=self.ingress_id)

    @staticmethod
    async def collect(
        stream: TurnStream, piece: TurnDelta | TurnResult
    ) -> tuple[str, list, TurnResult]:
        """The rest of a non-streamed turn: its text, logprob entries and final record."""
        text, logprobs = [], []
        while not isinstance(piece, TurnResult):
            text.append(piece.text)
            logprobs += piece.logprobs
            piece = await stream.__anext__()
        return "".join(text), logprobs, piece

    @staticmethod
    async def relay(
        stream: TurnStream,
        first: TurnDelta | TurnResult,
        opening: list[str],
        delta: Callable[[TurnDelta], str | None],
        finish: Callable[[TurnResult], Awaitable[list[str]]],
        fail: Callable[[dict[str, Any]], Awaitable[list[str]]],
    ) -> AsyncIterator[str]:
        """Relay a turn to an SSE client: the opening chunks, a chunk per delta, then what
        `finish` makes of the final record. A failure mid-stream is told in-band (`fail`
        gets the error body); a client that goes away aborts the turn on the replica, which
        keeps what its session committed."""
        finished = False
        try:
            for chunk in opening:
                yield chunk
            piece = first
            while not isinstance(piece, TurnResult):
                chunk = delta(piece)
                if chunk:
                    yield chunk
                piece = await stream.__anext__()
            finished = True
            for chunk in await finish(piece):
                yield chunk
        except Exception as e:
            finished = True
            for chunk in await fail(json.loads(response_for(e).body)):
                yield chunk
        finally:
            if not finished:  # the client disconnected
                stream.cancel()

    async def commit(self, call: GenerateCall, final: TurnResult) -> None:
        """Record a finished session turn in the failover log (what the turn added to it).
        Shielded: a client that disconnects meanwhile must not leave the replica holding a
        turn the log lacks."""
        if call.session_id is not None and final.finish_reason != "abort":
            recorded = self.directory.commit_turn(call.session_id, final.log_base, final.log_tail)
            await asyncio.shield(self.kept_or_freed(call.session_id, recorded))

    async def kept_or_freed(self, session_id: str, recorded: Awaitable[bool]) -> None:
        """A turn's record went to the directory; if the session was gone there (deleted or
        expired while the turn ran), free what the turn left on its replica."""
        if not await recorded:
            log.info("session %s was closed during its turn: its replica copy is freed", session_id)
            await self.free(session_id)

    async def free(self, session_id: str) -> None:
        """Free a closed session's KV on its replica (deferred there while a turn runs) and
        drop this process's routers' pin of it."""
        await self.replica.options(session_id=session_id).close_session.remote(session_id)
        forget_pin(session_id)

    async def _rebalance(self, session_id: str, queue_len: int) -> None:
        """Before a turn: move its session off a saturated replica to a calm one (its KV
        moves; `replica.rebalance_queue_len`). Best effort: on any failure the turn simply
        runs where the session is."""
        plan = rebalance_plan(session_id, queue_len)
        if plan is None:
            return
        source, target = plan
        try:
            result = await self.replica.migrate_session.remote(
                session_id, target, replica=source, trigger="rebalance"
            )
        except Exception as e:  # a turn in flight, or a replica went away
            log.info("session %s not rebalanced off %s: %s", session_id, source, unwrap(e))
            return
        if result["target"] is not None:
            forget_pin(session_id)
