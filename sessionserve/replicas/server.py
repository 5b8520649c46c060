"""The Serve replica deployment: a thin adapter between the wire (`sessionserve/wire.py`) and
an `Engine`, like Ray Serve LLM's `LLMServer`.

The engine runs on its own thread (`engine_loop.EngineLoop`); calls reach it as queued
commands. Tokens stream back through an asyncio queue fed by the engine's listener. A cancelled
stream (client disconnect) aborts its request, which keeps what the session has committed.
Tokenization happens here, next to the model's tokenizer. Sessions move between replicas
through `migration.SessionMover` (an admin call, or this replica being stopped). Its Serve
deployment options come from the app config in `sessionserve/app.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from sessionserve.config import EngineConfig, served_model_name
from sessionserve.errors import (
    EngineUnavailableError,
    MemoryInvariantError,
    SessionBusyError,
    UnknownReplicaError,
)
from sessionserve.faults import fault_point
from sessionserve.metrics import RayEngineMetrics
from sessionserve.replicas import client_error_logs, native_kernel
from sessionserve.replicas.caller_watch import CallerWatch
from sessionserve.replicas.engine import Engine
from sessionserve.replicas.engine_loop import EngineLoop
from sessionserve.replicas.migration import SessionMover
from sessionserve.replicas.openmp import run_on_passing_thread
from sessionserve.replicas.outputs import StepEvent
from sessionserve.replicas.prompts import chat_input_ids, prompt_ids
from sessionserve.replicas.sessions import SessionExport, SessionSeed
from sessionserve.replicas.tools.formats import call_syntax, tool_grammar
from sessionserve.replicas.tools.parser import ToolCallParser
from sessionserve.replicas.turn_output import TurnOutput, merged
from sessionserve.wire import (
    GenerateCall,
    SamplingParams,
    TurnDelta,
    TurnResult,
)

log = logging.getLogger(__name__)


class ReplicaServer:
    def __init__(
        self,
        engine_config: dict[str, Any],
        engine: Engine | None = None,
        directory_shards: int = 1,
        stream_interval_ms: float = 0.0,
        stream_messages_per_s: float = 0.0,
    ) -> None:
        """`engine`: one built by the caller (tests, scripts), used as it is; else one from
        `engine_config`, exporting its metrics when in Serve. `directory_shards`: the app's
        `directory.shards` (a migration re-pins there). `stream_interval_ms`: the app's
        `replica.stream_interval_ms` (how often a stream sends after its first token) and
        `replica.stream_messages_per_s` (what all streams together send at most)."""
        self.directory_shards = directory_shards
        self.stream_interval_s = stream_interval_ms / 1000
        self.stream_messages_per_s = stream_messages_per_s
        self.replica_id, self.app_name, self.deployment = _serve_identity()
        client_error_logs.show_our_logs()  # before the engine: its build logs progress
        if self.app_name is not None:
            client_error_logs.install()  # Serve's "Request failed." for a 4xx: one INFO line
        self.engine = engine or self._build_engine(EngineConfig.model_validate(engine_config))
        self.streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.loop = EngineLoop(self.engine, on_death=self._end_streams)
        self.loop.start()
        self.mover = SessionMover(self.engine, self._run, self.replica_id)
        self.tool_syntax = call_syntax(self.engine.tokenizer)  # how this model writes calls
        self._peer_handles: tuple[Any, Any] | None = None
        self._stopped = self._stopping = False
        self.callers = CallerWatch()  # each turn's ingress: a turn it no longer reads ends

    def _build_engine(self, cfg: EngineConfig) -> Engine:
        """Every call brings its whole input (see GenerateCall), so a full replica may give an
        idle session's slot to a new one: that session's next turn re-prefills."""
        served = self.app_name is not None  # else: outside Serve, no metrics export
        metrics = (
            RayEngineMetrics(self.replica_id, served_model_name(cfg.model)) if served else None
        )
        if cfg.model.device_type == "cpu" and cfg.compile is not False:
            # the kernels its dtype runs build while the model loads
            native_kernel.prefetch(cfg.model.torch_dtype())
        # on a thread that exits: its OpenMP team must not outlive the build (replicas/openmp.py)
        return run_on_passing_thread(
            lambda: Engine(cfg, metrics=metrics, reclaim_sessions_at_limit=True),
            "sessionserve-build",
        )

    # ---- generation ----
    async def generate(self, call: GenerateCall) -> AsyncIterator[TurnDelta | TurnResult]:
        """Stream `TurnDelta`s, then one `TurnResult` with the usage."""
        arrived = time.monotonic()  # its waits from here on count in its TTFT and queue time
        ids = self._input_ids(call)
        sampling = self._sampling(call)
        tools = ToolCallParser(self.tool_syntax) if sampling.lark_grammar is not None else None
        events: asyncio.Queue[StepEvent | Exception] = asyncio.Queue()
        ended = asyncio.Event()  # the final event is queued
        aio = asyncio.get_running_loop()

        def deliver(event: StepEvent) -> None:  # on this event loop, from the engine thread
            events.put_nowait(event)
            if event.result is not None:
                ended.set()

        def listener(event: StepEvent) -> None:  # on the engine thread
            with contextlib.suppress(RuntimeError):  # that loop is closed: no one reads it
                aio.call_soon_threadsafe(deliver, event)

        rid = call.rid or uuid.uuid4().hex
        # Chat mode brings the whole conversation (the cache reuses the longest prefix it
        # holds); append mode brings the new prompt, extending this replica's history of the
        # session (the directory's failover log goes to a replica lacking it, on its demand).
        seed = SessionSeed(call.ttl_s, call.history_ids, call.log_tokens)
        output = TurnOutput(self.engine.tokenizer, sampling, tools, self.replica_id)
        await self.mover.admit_turn(call.session_id)  # moved elsewhere: the ingress re-routes
        self.streams[rid] = (aio, events)  # before submitting: a death in between is seen
        submit = functools.partial(
            self._run,
            self.engine.submit,
            ids,
            sampling,
            session_id=call.session_id,
            mode=call.mode,
            rid=rid,
            listener=listener,
            open_missing=seed,
            arrived_at=arrived,
        )
        try:
            try:
                await submit()
            except SessionBusyError as busy:  # a retry whose first try lost its ingress?
                if not await self._abort_if_orphaned(busy.running_rid):
                    raise
                await submit()  # that turn is over: this one takes the session
            self._watch_caller(rid, call.caller)
            sent_at = None  # when the last message went (None: none yet)
            while not output.done:
                batch = [await events.get()]
                if sent_at is not None:  # the first token goes alone, at once; then batched
                    interval = stream_interval(
                        self.stream_interval_s, len(self.streams), self.stream_messages_per_s
                    )
                    wait = sent_at + interval - aio.time()
                    if wait > 0 and not ended.is_set():
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(ended.wait(), wait)
                    while not events.empty():
                        batch.append(events.get_nowait())
                pieces: list[TurnDelta | TurnResult] = []
                for event in batch:
                    if isinstance(event, Exception):  # the engine thread died
                        raise event
                    pieces += output.feed(event)
                for piece in merged(pieces):
                    yield piece
                sent_at = aio.time()
        finally:
            self.streams.pop(rid, None)
            self.callers.forget(rid)
            if not output.done and self.loop.error is None:
                # the caller went away: abort, keeping what the session committed
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await self._run(self.engine.abort, rid, "client disconnected")

    def _watch_caller(self, rid: str, caller: str | None) -> None:
        """Abort turn `rid` if its caller dies (Ray would let it run to its end)."""
        if caller is not None and not self._stopped:
            self.callers.watch(rid, caller)
            self.callers.start(self._abort_orphan)

    async def _abort_if_orphaned(self, rid: str) -> bool:
        """Abort running turn `rid` if its caller died; whether it did."""
        caller = await self.callers.orphaned(rid)
        if caller is None:
            return False
        log.warning("turn %s lost its caller %s: aborted for its session's next turn", rid, caller)
        return await self._abort_orphan(rid, caller)

    async def _abort_orphan(self, rid: str, caller: str) -> bool:
        self.callers.forget(rid)
        return await self._run(self.engine.abort, rid, f"its caller {caller} died")

    async def _run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`fn` on the engine thread: queued at once, and run even if this caller is cancelled
        meanwhile (shielded: the engine loop skips a command whose future was cancelled, and
        a client that goes away must not drop the abort or the close its cleanup queues; under
        anyio's cancel scopes, as in an ASGI app, every await of a cancelled task is
        cancelled again, the cleanup's included)."""
        done = asyncio.wrap_future(self.loop.call(functools.partial(fn, *args, **kwargs)))
        done.add_done_callback(_retrieved)  # a caller that left does not read its error
        return await asyncio.shield(done)

    def _sampling(self, call: GenerateCall) -> SamplingParams:
        """The call's sampling; with tools, the grammar of the calls (and of a JSON answer)."""
        sampling = call.sampling
        grammar = tool_grammar(call.tool_use, sampling.json_schema, self.tool_syntax)
        if grammar is None:
            return sampling
        return sampling.model_copy(update={"lark_grammar": grammar, "json_schema": None})

    def _input_ids(self, call: GenerateCall) -> list[int]:
        """Chat mode: the whole conversation; append mode: only the new tokens (the session's
        come before them; a call whose session has none yet, `log_tokens` 0, or that has no
        session starts the sequence)."""
        tok = self.engine.tokenizer
        if call.messages is not None:
            return chat_input_ids(tok, self.engine.model_name, call.messages, call.tool_use)
        return prompt_ids(tok, call.prompt, starts=call.log_tokens == 0)

    # ---- sessions ----
    async def close_session(self, session_id: str, replica: str | None = None) -> bool:
        self._check_addressed(replica)
        try:
            return await self._run(self.engine.close_session, session_id)
        except KeyError:
            return True  # never reached this replica (or expired here): nothing held

    async def session_held_tokens(self, session_id: str) -> int | None:
        try:
            return (await self._run(self.engine.session_info, session_id)).held_tokens
        except KeyError:
            return None

    async def park_session(self, session_id: str) -> bool:
        """Move an idle session's KV to the host tier now (True if kept there)."""
        try:
            return await self._run(self.engine.park_session, session_id)
        except KeyError:  # never reached this replica (or expired here): nothing held
            return False

    # ---- migration (`replica=`/`avoid=` address the call: see SessionAffinityRouter) ----
    async def migrate_session(
        self,
        session_id: str,
        target: str | None = None,
        replica: str | None = None,
        trigger: str = "admin",
    ) -> dict[str, Any]:
        """Move one of this replica's idle sessions to `target` (None: the freest other);
        `trigger` (admin or rebalance) labels the metric."""
        self._check_addressed(replica)
        handle, directory = self._peers()
        return (await self.mover.move(session_id, handle, directory, target, trigger)).as_dict()

    async def import_session(
        self,
        export: SessionExport,
        replica: str | None = None,
        avoid: list[str] | None = None,
    ) -> dict[str, str]:
        """Take over a session another replica exported (the target side of a migration)."""
        self._check_addressed(replica, avoid)
        if self._stopping:  # Serve is stopping this one too (a rolling update)
            raise UnknownReplicaError(f"replica {self.replica_id!r} is stopping", self.replica_id)
        self.mover.arrived(export.session_id)
        kv = await self._run(self.engine.import_session, export)
        fault_point("import_session")  # chaos tests: the target dies mid-migration
        return {"replica": self.replica_id, "kv": kv}

    def _check_addressed(self, replica: str | None, avoid: list[str] | None = None) -> None:
        """The router sends an addressed call to that replica when it runs; otherwise it
        lands elsewhere and is refused here, naming the problem."""
        if replica is not None and replica != self.replica_id:
            raise UnknownReplicaError(f"replica {replica!r} is not running")
        if avoid and self.replica_id in avoid:
            raise UnknownReplicaError("no other replica is running to take the session")

    def _peers(self) -> tuple[Any, Any]:
        """This deployment's handle (to reach the other replicas) and the directory."""
        if self._peer_handles is None:
            from ray import serve

            from sessionserve.directory.client import get_directory

            handle = serve.get_deployment_handle(self.deployment, self.app_name)
            directory = get_directory(self.app_name, shards=self.directory_shards)
            self._peer_handles = (handle, directory)
        return self._peer_handles

    async def model_limits(self) -> dict[str, int]:
        """What the published API schema states of the served model: the longest context a
        request may fill (input + max_tokens) and the vocabulary's size (token ids below it)."""
        return {"context_limit": self.engine.context_limit, "vocab_size": self.engine.vocab_size}

    async def memory_check(self) -> dict[str, Any]:
        """Run the memory invariant now (idle or busy form) and return its terms."""
        terms = await self._run(self.engine.check_memory)
        return {"replica": self.replica_id, "node": _node_id(), **terms._asdict()}

    # ---- Serve hooks ----
    def check_health(self) -> None:
        if self.loop.error is not None:
            raise RuntimeError(f"engine loop died: {self.loop.error!r}")
        if not self.loop.is_alive():
            raise RuntimeError("engine loop is not running")
        if self.engine.checker.failures:
            raise MemoryInvariantError("the memory invariant failed on this replica")

    def record_routing_stats(self) -> dict[str, Any]:
        """The engine thread's latest snapshot (never waits for a step)."""
        # ts lets the router tell a fresh report from a repeated one
        return {"ts": time.time(), **self.loop.stats}

    def __del__(self) -> Awaitable[None] | None:
        """Serve calls this after its graceful drain (in-flight requests get
        `graceful_shutdown_timeout_s` to finish) and awaits what it returns: idle sessions
        move to live replicas for up to `sessions.migrate_on_shutdown_s` (the rest re-prefill
        on their next turn), then the engine stops. Called by the garbage collector (or with
        no event loop running), it just stops the engine."""
        if getattr(self, "_stopped", True):  # stopped already, or __init__ never finished
            return None
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            self.shutdown()
            return None
        self._stopping = True  # from now on, sessions leave and none arrive
        return self._move_sessions_then_stop()

    async def _move_sessions_then_stop(self) -> None:
        budget = self.engine.config.sessions.migrate_on_shutdown_s
        if budget > 0 and self.app_name is not None and self.loop.is_alive():
            try:
                if not self._app_is_deleted():
                    await self.mover.move_all(*self._peers(), budget)
            except Exception:  # moving is best effort: the sessions can re-prefill
                log.exception("moving sessions off this replica failed")
        self.shutdown()

    def _app_is_deleted(self) -> bool:
        """The whole application is going (no replica will take sessions): don't try."""
        from ray import serve

        app = serve.status().applications.get(self.app_name)
        return app is None or app.status == "DELETING"

    def shutdown(self) -> None:
        """Stop the engine: whatever is still running is aborted, so streams end with
        finish_reason "abort" and sessions keep their committed turns."""
        self._stopped = True
        if hasattr(self, "callers"):
            self.callers.stop()
        loop = getattr(self, "loop", None)
        if loop is None or loop.stopping:
            return
        with contextlib.suppress(EngineUnavailableError):
            loop.call(self._abort_all, "replica shutting down")
        loop.stopping = True  # the thread runs the queued aborts, then exits
        loop.wake.set()

    def _end_streams(self, cause: BaseException) -> None:
        """On the engine thread's death: every open stream ends now with a 503."""
        for aio, events in list(self.streams.values()):
            err = EngineUnavailableError(f"this replica's engine failed ({cause!r}); retry")
            with contextlib.suppress(RuntimeError):  # that event loop is already closed
                aio.call_soon_threadsafe(events.put_nowait, err)

    def _abort_all(self, message: str) -> None:
        for rid in self.engine.in_flight():
            try:
                self.engine.abort(rid, message)
            except RuntimeError:  # the replica's event loop is already closed
                pass


def _retrieved(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


def stream_interval(base_s: float, live_streams: int, messages_per_s: float) -> float:
    """How long a stream waits between messages after its first: `base_s`, stretched so that
    `live_streams` streams send about `messages_per_s` messages a second together (0: no
    budget). Why: each message is work for the replica, the ingress and the proxy, which on
    a small machine share the forward's cores (docs/benchmarks.md)."""
    if messages_per_s <= 0:
        return base_s
    return max(base_s, live_streams / messages_per_s)


def _serve_identity() -> tuple[str, str | None, str | None]:
    """This replica's id, app and deployment names; ("local", None, None) outside Serve
    (tests, scripts)."""
    try:
        from ray import serve

        context = serve.get_replica_context()
    except Exception:
        return "local", None, None
    return context.replica_id.unique_id, context.app_name, context.deployment


def _node_id() -> str | None:
    """This process's Ray node, None outside Ray (asking Ray's runtime context there would
    start a local Ray cluster)."""
    import ray

    if not ray.is_initialized():
        return None
    return ray.get_runtime_context().get_node_id()
