"""The HTTP ingress: OpenAI-compatible endpoints, the session API, and error mapping.

FastAPI resolves the route annotations at runtime, so this module does not use
`from __future__ import annotations`.

It owns the wire only: it validates, looks sessions up in the shared directory, calls the
replica deployment with `session_id` set (the session router pins it), and formats results.
Tokenization and generation happen on the replica.
"""

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Path, Query, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from ray import serve

from sessionserve.api.errors import (
    ERRORS,
    error_response,
    install_error_handlers,
    response_for,
    unwrap,
)
from sessionserve.api.openapi import published_schema
from sessionserve.api.protocol import (
    SESSION_ID_PATTERN,
    SESSION_ID_RULE,
    ChatCompletionRequest,
    CompletionRequest,
    SessionCreate,
    SessionMigrate,
    SessionMigration,
    SessionView,
    check_session_id,
    now,
)
from sessionserve.api.responses import Kind, Reply
from sessionserve.api.responses_api import (
    ResponseCreate,
    ResponseDraft,
    ResponseEvents,
    chat_messages,
    drop_oldest_turn,
    item_page,
    parse_input,
)
from sessionserve.api.security import (
    ApiKeyMiddleware,
    BodySizeMiddleware,
    configure,
    load_api_keys,
)
from sessionserve.config import AppConfig, served_model_name
from sessionserve.errors import (
    ContextTooLongError,
    EngineUnavailableError,
    InvalidRequestError,
    MigrationFailedError,
    SessionExistsError,
    SessionLogNeededError,
    SessionMovedError,
    SessionNotPlacedError,
    UnknownModelError,
    UnknownResponseError,
    UnknownSessionError,
)
from sessionserve.router.directory_client import get_directory
from sessionserve.router.pin_cache import check_pin, forget_pin, rebalance_plan
from sessionserve.wire import GenerateCall, SamplingParams, ToolUse, TurnDelta, TurnResult

log = logging.getLogger(__name__)
# the schema and its docs page are routes of the Ingress: the schema states this deployment's
# limits, which it learns from a replica (sessionserve/api/openapi.py)
app = FastAPI(
    title="sessionserve",
    description="OpenAI-compatible API with streaming sessions",
    openapi_url=None,
    docs_url=None,
    redoc_url=None,
)
install_error_handlers(app)
app.add_middleware(BodySizeMiddleware)  # added last runs first: the key is checked first
app.add_middleware(ApiKeyMiddleware)

SSE_EVENT = {  # one server-sent event: `data:` holds a JSON chunk (or [DONE])
    "type": "object",
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
    "required": ["data"],
}
GENERATE = ERRORS(400, 401, 404, 409, 413, 429, 500, 503) | {
    200: {
        "description": "The answer (JSON), or with `stream: true` its server-sent events",
        "content": {"text/event-stream": {"schema": SSE_EVENT}},
    }
}
LOOKUP = ERRORS(400, 401, 404, 500, 503)  # 503: the session directory did not answer
MOVED_RETRIES = 2  # a turn routed to a replica its session just left is re-routed this often
SessionPath = Annotated[str, Path(pattern=SESSION_ID_PATTERN, description=SESSION_ID_RULE)]


def owner(request: Request) -> str | None:
    """The caller's API key fingerprint (None when the API has no keys)."""
    return getattr(request.state, "owner", None)


@serve.ingress(app)
class Ingress:
    def __init__(self, replica: Any, config: dict[str, Any]) -> None:
        self.cfg = AppConfig.model_validate(config)
        self.replica = replica
        self.model = served_model_name(self.cfg.engine.model)
        context = serve.get_replica_context()
        self.ingress_id = context.replica_id.unique_id
        app_name = context.app_name
        self.directory = get_directory(
            app_name, self.cfg.engine.sessions.default_ttl_s, self.cfg.directory.shards
        )
        keys = load_api_keys(self.cfg.ingress.api_keys_file)
        configure(app, keys, self.cfg.ingress.max_body_bytes)
        log.info("API keys: %s", f"{len(keys)} configured" if keys else "none (open API)")
        self._schema: dict[str, Any] | None = None

    # ---- the published contract ----
    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(self) -> JSONResponse:
        """The OpenAPI schema with this deployment's limits (context, vocabulary, session
        header), read once from a replica."""
        if self._schema is None:
            try:
                limits = await self.replica.model_limits.remote()
            except Exception as e:  # no replica is up yet
                return response_for(e)
            self._schema = published_schema(app.openapi(), self.cfg.session_header, **limits)
        return JSONResponse(self._schema)

    @app.get("/docs", include_in_schema=False)
    async def docs(self) -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="openapi.json", title=f"{app.title} - docs")

    # ---- plain endpoints ----
    @app.get("/health")
    async def health(self) -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models", responses=ERRORS(401, 500))
    async def models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {"id": self.model, "object": "model", "created": now(), "owned_by": "sessionserve"}
            ],
        }

    # ---- sessions ----
    @app.post("/v1/sessions", responses=ERRORS(400, 401, 409, 413, 429, 500, 503))
    async def open_session(
        self, request: Request, body: SessionCreate | None = None
    ) -> SessionView:
        body = body or SessionCreate()
        sid = await self._open(body.session_id, body.ttl_s, owner(request))
        if sid is None:
            raise SessionExistsError(body.session_id or "")
        return await self._view(sid, owner(request))

    @app.get("/v1/sessions/{session_id}", responses=LOOKUP)
    async def get_session(
        self, session_id: SessionPath, request: Request, include_history: bool = False
    ) -> SessionView:
        return await self._view(session_id, owner(request), include_history)

    @app.delete("/v1/sessions/{session_id}", responses=LOOKUP)
    async def close_session(self, session_id: SessionPath, request: Request) -> dict[str, Any]:
        if not await self._close(session_id, owner(request)):
            raise UnknownSessionError(session_id)
        return {"id": session_id, "object": "session.deleted", "deleted": True}

    @app.post("/v1/sessions/{session_id}/migrate", responses=ERRORS(400, 401, 404, 409, 500, 503))
    async def migrate_session(
        self, session_id: SessionPath, request: Request, body: SessionMigrate | None = None
    ) -> SessionMigration:
        """Move an idle session (its token log and KV) to another replica; its turns follow.
        409 while a turn runs; on any failure it stays, intact, where it was."""
        info = await self._info(session_id, owner(request))
        source, target = info["replica"], (body.target_replica if body else None)
        if source is None:
            raise SessionNotPlacedError(session_id)
        if target == source:
            raise InvalidRequestError(
                f"session {session_id!r} is on replica {target!r} already", param="target_replica"
            )
        result = await self.replica.migrate_session.remote(session_id, target, replica=source)
        forget_pin(session_id)
        if result["target"] is None:
            raise MigrationFailedError(
                f"session {session_id!r} was not moved ({result['error']}); it is unchanged on "
                "its replica"
            )
        return SessionMigration(id=session_id, **{k: v for k, v in result.items() if k != "error"})

    @app.post("/v1/sessions/{session_id}/park", responses=LOOKUP | ERRORS(409))
    async def park_session(self, session_id: SessionPath, request: Request) -> dict[str, Any]:
        """Move an idle session's KV out of device memory now (to the host tier when the
        replica has one; else it is dropped and the next turn re-prefills)."""
        info = await self._info(session_id, owner(request))
        parked = False
        if info["replica"] is not None:
            parked = await self.replica.options(session_id=session_id).park_session.remote(
                session_id
            )
        return {"id": session_id, "object": "session.parked", "host_tier": parked}

    async def _open(self, sid: str | None, ttl_s: float | None, owner_id: str | None):
        """Register a session in the directory (None: the id is taken); 429 past the key's
        `ingress.max_sessions_per_key`."""
        limit = self.cfg.ingress.max_sessions_per_key
        if ttl_s is None:  # this deployment's default (the directory may predate a redeploy)
            ttl_s = self.cfg.engine.sessions.default_ttl_s
        return await self.directory.open(sid, ttl_s, owner_id, limit)

    async def _close(self, session_id: str, owner_id: str | None) -> bool:
        """Forget the session (and its stored responses); free its KV on its replica."""
        replica = await self.directory.close(session_id, owner_id)
        if replica:  # frees its KV there (deferred while a turn runs)
            await self.replica.options(session_id=session_id).close_session.remote(session_id)
            forget_pin(session_id)  # this process's routers drop the closed session's pin
        return replica is not None

    async def _info(self, sid: str, owner_id: str | None, history: bool = False) -> dict:
        """The directory's record of a session of this caller's (404 if there is none)."""
        info = await self.directory.info(sid, owner_id, history)
        if info is None:
            raise UnknownSessionError(sid)
        return info

    async def _view(self, sid: str, owner_id: str | None, history: bool = False) -> SessionView:
        info = await self._info(sid, owner_id, history)
        held = None
        if info["replica"] is not None:
            held = await self.replica.options(session_id=sid).session_held_tokens.remote(sid)
        return SessionView(id=sid, held_tokens=held, **info)

    # ---- generation ----
    @app.post("/v1/chat/completions", responses=GENERATE)
    async def chat(self, body: ChatCompletionRequest, request: Request):
        tools = body.tool_use()  # checked before a session is touched
        session = await self._session(request, body.session_id, body.model)
        messages = [m.wire() for m in body.messages]
        call = GenerateCall(
            self._sampling(body), mode="chat", messages=messages, tool_use=tools, **session
        )
        return await self._serve(call, body, "chat", bool(body.logprobs))

    @app.post("/v1/completions", responses=GENERATE)
    async def completions(self, body: CompletionRequest, request: Request):
        session = await self._session(request, body.session_id, body.model)
        # append mode: the new prompt extends the replica's history of the session
        call = GenerateCall(self._sampling(body), mode="append", prompt=body.prompt, **session)
        if call.log_tokens and self.cfg.replica.request_router != "session_affinity":
            # no stickiness: most turns land where the session is not held, so no asking
            call.history_ids = await self._session_log(call.session_id, owner(request))
        want_lp = body.logprobs is not None
        return await self._serve(call, body, "completion", want_lp, owner(request))

    # ---- Responses API: a chain of responses is a session ----
    @app.post("/v1/responses", responses=GENERATE)
    async def create_response(self, body: ResponseCreate, request: Request):
        self._check_model(body.model)
        body.refuse_unsupported()
        tools = body.tool_use()
        sampling = self._sampling(body)
        new_items = parse_input(body.input)
        earlier: list[dict[str, Any]] = []
        if body.previous_response_id is not None:  # continue (or fork) its conversation
            prev = await self.directory.get_response(body.previous_response_id, owner(request))
            if prev is None:
                raise UnknownResponseError(body.previous_response_id, "previous_response_id")
            sid = prev["session_id"]
            earlier = prev["items"] + prev["response"]["output"]
        else:  # a new conversation: a new session, unless nothing is to be kept
            sid = await self._open(None, None, owner(request)) if body.store else None
        draft = ResponseDraft(body, self.model, sid, new_session=body.previous_response_id is None)
        draft.owner = owner(request)
        if sid is not None:  # stored on its session's directory shard
            draft.id = self.directory.response_id(sid)
        try:
            stream, first, items = await self._start_response(
                draft, sampling, tools, earlier + new_items, len(new_items)
            )
        except Exception as e:
            await self._response_failed(draft)
            return response_for(e)
        if body.stream:
            return StreamingResponse(
                self._response_sse(stream, first, draft, items), media_type="text/event-stream"
            )
        try:
            _, _, final = await self._collect(stream, first)
            response = await self._finish_response(draft, items, final)
        except Exception as e:
            await self._response_failed(draft)
            return response_for(e)
        return JSONResponse(response)

    @app.get("/v1/responses/{response_id}", responses=LOOKUP)
    async def get_response(self, response_id: str, request: Request) -> JSONResponse:
        stored = await self.directory.get_response(response_id, owner(request))
        if stored is None:
            raise UnknownResponseError(response_id)
        return JSONResponse(stored["response"])

    @app.delete("/v1/responses/{response_id}", responses=LOOKUP)
    async def delete_response(self, response_id: str, request: Request) -> dict[str, Any]:
        if not await self.directory.delete_response(response_id, owner(request)):
            raise UnknownResponseError(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    @app.get("/v1/responses/{response_id}/input_items", responses=LOOKUP)
    async def response_input_items(
        self,
        response_id: str,
        request: Request,
        limit: int = Query(20, ge=1, le=100),
        order: Literal["asc", "desc"] = "desc",
        after: str | None = Query(
            None, description="An item id of this response: the page starts after it (else 400)."
        ),
    ) -> dict[str, Any]:
        stored = await self.directory.get_response(response_id, owner(request))
        if stored is None:
            raise UnknownResponseError(response_id)
        return item_page(stored["items"], limit, order, after)

    async def _start_response(
        self,
        draft: ResponseDraft,
        sampling: SamplingParams,
        tools: ToolUse | None,
        items: list[dict],
        keep: int,
    ) -> tuple[Any, TurnDelta | TurnResult, list[dict]]:
        """Open the turn; with `truncation: auto`, drop the oldest turns (never the new input)
        until the conversation fits the context, counting what went in the draft."""
        while True:
            messages = chat_messages(draft.body.instructions, items)
            call = GenerateCall(
                sampling, draft.session_id, "chat", messages=messages, tool_use=tools
            )
            try:
                stream, first = await self._open_stream(call)
                return stream, first, items
            except ContextTooLongError:
                drop = drop_oldest_turn(items, keep) if draft.body.truncation == "auto" else 0
                if drop == 0:
                    raise
                items, draft.truncated_items = items[drop:], draft.truncated_items + drop
            except InvalidRequestError as e:
                if e.param != "response_format":
                    raise
                raise InvalidRequestError(str(e), param="text.format") from None  # its name here

    async def _finish_response(
        self, draft: ResponseDraft, items: list[dict], final: TurnResult
    ) -> dict[str, Any]:
        """The finished response object, stored with its conversation unless `store: false`
        (then nothing is kept, not even in the session's failover log)."""
        if final.finish_reason == "abort":
            raise EngineUnavailableError(f"the turn was aborted ({final.finish_message}); retry")
        response = draft.object(replace(final, ingress=self.ingress_id), final.text or "")
        if draft.body.store and draft.session_id is not None:
            stored = self.directory.store_response(
                draft.session_id, response, items, final.log_base, final.log_tail, draft.owner
            )
            await asyncio.shield(self._kept_or_freed(draft.session_id, stored))
        return response

    async def _response_failed(self, draft: ResponseDraft) -> None:
        """A first response that never completed leaves no empty conversation behind."""
        if draft.new_session and draft.session_id is not None:
            await self._close(draft.session_id, draft.owner)

    def _response_sse(
        self, stream: Any, first: TurnDelta | TurnResult, draft: ResponseDraft, items: list[dict]
    ) -> AsyncIterator[str]:
        events = ResponseEvents(draft)

        async def finish(final: TurnResult) -> list[str]:
            return events.closing(await self._finish_response(draft, items, final))

        async def fail(body: dict[str, Any]) -> list[str]:
            await self._response_failed(draft)
            return [events.error(body)]

        return self._relay(stream, first, events.opening(), events.delta, finish, fail)

    # ---- internals ----
    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model:
            raise UnknownModelError(model, self.model)

    async def _session(
        self, request: Request, body_sid: str | None, model: str | None
    ) -> dict[str, Any]:
        """The turn's `GenerateCall` session fields (none without a session): its id (header
        or body), its idle TTL, which the replica applies if it opens the session (its first
        turn there), and the length of its failover log (the log goes on demand)."""
        self._check_model(model)
        header = request.headers.get(self.cfg.session_header)
        if header is not None:
            check_session_id(header, self.cfg.session_header)
        sid = header or body_sid
        if sid is None:
            return {}
        record = await self.directory.touch(sid, owner(request))
        if record is None:
            if not self.cfg.engine.sessions.implicit_open:
                raise UnknownSessionError(sid)
            if await self._open(sid, None, owner(request)) is None:
                raise UnknownSessionError(sid)  # taken by another key: as if it did not exist
            ttl_s = self.cfg.engine.sessions.default_ttl_s
            record = {"ttl_s": ttl_s, "replica": None, "log_tokens": 0}
        check_pin(sid, record["replica"])  # this process's routers follow the directory
        return {"session_id": sid, "ttl_s": record["ttl_s"], "log_tokens": record["log_tokens"]}

    @staticmethod
    def _sampling(body: Any) -> SamplingParams:
        """Validated here, once: a 400 before any replica work."""
        return SamplingParams.build(**body.sampling_kwargs())

    async def _open_stream(
        self, call: GenerateCall, owner_id: str | None = None
    ) -> tuple[Any, TurnDelta | TurnResult]:
        """Start the turn on its replica and wait for the first piece, so that errors before
        any token (bad input, busy session, overload) raise here and become a proper 4xx.
        Re-sent once with the session's token log to a replica that lacks the session, and
        to the new replica of a session that moved."""
        if call.session_id is not None and self.cfg.replica.rebalance_queue_len is not None:
            await self._rebalance(call.session_id, self.cfg.replica.rebalance_queue_len)
        attempt = 0
        while True:
            handle = self.replica.options(stream=True, session_id=call.session_id)
            stream = handle.generate.remote(call)
            try:
                return stream, await stream.__anext__()
            except Exception as e:
                err = unwrap(e)
                if isinstance(err, SessionLogNeededError) and call.history_ids is None:
                    history = await self._session_log(call.session_id, owner_id)
                    call = replace(call, history_ids=history)
                    continue
                if not isinstance(err, SessionMovedError) or attempt == MOVED_RETRIES:
                    raise err from None
            forget_pin(call.session_id)  # migrated: the directory names the new replica
            attempt += 1

    async def _session_log(self, session_id: str, owner_id: str | None) -> list[int]:
        """The session's failover token log, for a replica that does not hold the session."""
        history = await self.directory.log(session_id, owner_id)
        if history is None:  # deleted or expired since this turn's touch
            raise UnknownSessionError(session_id)
        return history

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

    @staticmethod
    async def _collect(stream: Any, piece: TurnDelta | TurnResult) -> tuple[str, list, TurnResult]:
        """The rest of a non-streamed turn: its text, logprob entries and final record."""
        text, logprobs = [], []
        while not isinstance(piece, TurnResult):
            text.append(piece.text)
            logprobs += piece.logprobs
            piece = await stream.__anext__()
        return "".join(text), logprobs, piece

    async def _serve(
        self, call: GenerateCall, body: Any, kind: Kind, want_lp: bool, owner_id: str | None = None
    ):
        try:
            stream, first = await self._open_stream(call, owner_id)
        except Exception as e:
            return response_for(e)
        reply = Reply(kind, self.model, want_lp)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                self._sse(stream, first, reply, call, include_usage), media_type="text/event-stream"
            )
        text, logprobs, final = await self._collect(stream, first)
        await self._commit(call, final)
        final = replace(final, ingress=self.ingress_id)
        return JSONResponse(reply.response(text, logprobs, final))

    def _sse(
        self,
        stream: Any,
        first: TurnDelta | TurnResult,
        reply: Reply,
        call: GenerateCall,
        include_usage: bool,
    ) -> AsyncIterator[str]:
        async def finish(final: TurnResult) -> list[str]:
            await self._commit(call, final)
            return reply.closing(replace(final, ingress=self.ingress_id), include_usage)

        async def fail(body: dict[str, Any]) -> list[str]:
            return [Reply._sse(body), "data: [DONE]\n\n"]

        opening = [chunk for chunk in (reply.opening(),) if chunk]
        return self._relay(stream, first, opening, reply.delta, finish, fail)

    @staticmethod
    async def _relay(
        stream: Any,
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

    async def _commit(self, call: GenerateCall, final: TurnResult) -> None:
        """Record a finished session turn in the failover log. Shielded: a client that
        disconnects meanwhile must not leave the replica holding a turn the log lacks."""
        if call.session_id is not None and final.finish_reason != "abort":
            recorded = self.directory.commit_turn(call.session_id, final.log_base, final.log_tail)
            await asyncio.shield(self._kept_or_freed(call.session_id, recorded))

    async def _kept_or_freed(self, session_id: str, recorded: Awaitable[bool]) -> None:
        """A turn's record went to the directory; if the session was gone there (deleted or
        expired while the turn ran), free what the turn left on its replica."""
        if not await recorded:
            log.info("session %s was closed during its turn: its replica copy is freed", session_id)
            await self.replica.options(session_id=session_id).close_session.remote(session_id)
            forget_pin(session_id)


__all__ = ["Ingress", "app", "error_response"]
