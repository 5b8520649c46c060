"""The HTTP ingress: OpenAI-compatible routes, the session API's routes, and error mapping.

FastAPI resolves the route annotations at runtime, so this module does not use
`from __future__ import annotations`.

It owns the wire only: each route validates (FastAPI, `api/protocol.py`), then hands the work
to a class with no HTTP in it: `SessionAdmin` (`api/session_admin.py`: sessions in the shared
directory), `TurnTransport` (`api/turns.py`: a turn to its replica and back, and its record
in the directory) or `ResponsesService` (`api/responses/service.py`). Tokenization and
generation happen on the replica.
"""

import logging
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Path, Query, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from ray import serve

from sessionserve.api.chat_replies import Reply
from sessionserve.api.choices import (
    check_choices,
    choice_calls,
    collect_choices,
    open_choices,
    relay_choices,
)
from sessionserve.api.errors import ERRORS, error_response, install_error_handlers, response_for
from sessionserve.api.memory_trace import MemoryTrace
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
    now,
)
from sessionserve.api.responses.protocol import ResponseCreate
from sessionserve.api.responses.service import ResponsesService
from sessionserve.api.security import (
    ApiKeyMiddleware,
    BodySizeMiddleware,
    configure,
    load_api_keys,
)
from sessionserve.api.session_admin import SessionAdmin
from sessionserve.api.turns import TurnStream, TurnTransport
from sessionserve.config import AppConfig, served_model_name
from sessionserve.directory.client import get_directory
from sessionserve.errors import UnknownModelError, UnknownSessionError
from sessionserve.wire import GenerateCall, SamplingParams, TurnDelta, TurnResult

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


def sampling(body: Any) -> SamplingParams:
    """Validated here, once: a 400 before any replica work."""
    return SamplingParams.build(**body.sampling_kwargs())


def sse(chunks: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(chunks, media_type="text/event-stream")


@serve.ingress(app)
class Ingress:
    def __init__(self, replica: Any, config: dict[str, Any]) -> None:
        self.cfg = AppConfig.model_validate(config)
        self.replica = replica
        self.model = served_model_name(self.cfg.engine.model)
        context = serve.get_replica_context()
        directory = get_directory(
            context.app_name, self.cfg.engine.sessions.default_ttl_s, self.cfg.directory.shards
        )
        self.turns = TurnTransport(
            replica,
            directory,
            context.replica_id.unique_id,
            self.cfg.replica.rebalance_queue_len,
            caller=self._caller_name(context),
        )
        self.sessions = SessionAdmin(self.turns, self.cfg)
        self.responses = ResponsesService(self.turns, self.sessions, self.model)
        keys = load_api_keys(self.cfg.ingress.api_keys_file)
        configure(app, keys, self.cfg.ingress.max_body_bytes)
        log.info("API keys: %s", f"{len(keys)} configured" if keys else "none (open API)")
        self._schema: dict[str, Any] | None = None
        self._memory_trace = MemoryTrace.from_env()  # a diagnostic (benchmarks/soak.py)

    def _caller_name(self, context: Any) -> str | None:
        """This replica's Ray actor name: a model replica aborts the turns of a dead one."""
        return context.replica_id.to_full_id_str()

    def memory_trace(self, action: Literal["mark", "growth"], top: int = 20) -> Any:
        """A deployment-handle call (no route): the ingress's Python allocations, when
        `SESSIONSERVE_TRACEMALLOC` is set (sessionserve/api/memory_trace.py)."""
        if self._memory_trace is None:
            raise RuntimeError("start the ingress with SESSIONSERVE_TRACEMALLOC=<frames>")
        if action == "mark":
            return self._memory_trace.mark()
        return self._memory_trace.growth(top)

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
        model = {"id": self.model, "object": "model", "created": now(), "owned_by": "sessionserve"}
        return {"object": "list", "data": [model]}

    # ---- sessions ----
    @app.post("/v1/sessions", responses=ERRORS(400, 401, 409, 413, 429, 500, 503))
    async def open_session(
        self, request: Request, body: SessionCreate | None = None
    ) -> SessionView:
        body = body or SessionCreate()
        return await self.sessions.create(body.session_id, body.ttl_s, owner(request))

    @app.get("/v1/sessions/{session_id}", responses=LOOKUP)
    async def get_session(
        self, session_id: SessionPath, request: Request, include_history: bool = False
    ) -> SessionView:
        return await self.sessions.view(session_id, owner(request), include_history)

    @app.delete("/v1/sessions/{session_id}", responses=LOOKUP)
    async def close_session(self, session_id: SessionPath, request: Request) -> dict[str, Any]:
        if not await self.sessions.close(session_id, owner(request)):
            raise UnknownSessionError(session_id)
        return {"id": session_id, "object": "session.deleted", "deleted": True}

    @app.post("/v1/sessions/{session_id}/migrate", responses=ERRORS(400, 401, 404, 409, 500, 503))
    async def migrate_session(
        self, session_id: SessionPath, request: Request, body: SessionMigrate | None = None
    ) -> SessionMigration:
        """Move an idle session (its token log and KV) to another replica; its turns follow.
        409 while a turn runs; on any failure it stays, intact, where it was."""
        target = body.target_replica if body else None
        return await self.sessions.migrate(session_id, target, owner(request))

    @app.post("/v1/sessions/{session_id}/park", responses=LOOKUP | ERRORS(409))
    async def park_session(self, session_id: SessionPath, request: Request) -> dict[str, Any]:
        """Move an idle session's KV out of device memory now (to the host tier when the
        replica has one; else it is dropped and the next turn re-prefills)."""
        parked = await self.sessions.park(session_id, owner(request))
        return {"id": session_id, "object": "session.parked", "host_tier": parked}

    # ---- generation ----
    @app.post("/v1/chat/completions", responses=GENERATE)
    async def chat(self, body: ChatCompletionRequest, request: Request):
        tools = body.tool_use()  # checked before a session is touched
        check_choices(body.n, self._names_session(request, body.session_id))
        session = await self._session_fields(request, body.session_id, body.model)
        messages = [m.wire() for m in body.messages]
        call = GenerateCall(
            sampling(body), mode="chat", messages=messages, tool_use=tools, **session
        )
        return await self._answer(call, body, Reply("chat", self.model, bool(body.logprobs)))

    @app.post("/v1/completions", responses=GENERATE)
    async def completions(self, body: CompletionRequest, request: Request):
        check_choices(body.n, self._names_session(request, body.session_id))
        session = await self._session_fields(request, body.session_id, body.model)
        # append mode: the new prompt extends the replica's history of the session
        call = GenerateCall(sampling(body), mode="append", prompt=body.prompt, **session)
        if call.log_tokens and self.cfg.replica.request_router != "session_affinity":
            # no stickiness: most turns land where the session is not held, so no asking
            call.history_ids = await self.turns.session_log(call, owner(request))
        reply = Reply("completion", self.model, body.logprobs is not None)
        return await self._answer(call, body, reply, owner(request))

    # ---- Responses API: a chain of responses is a session ----
    @app.post("/v1/responses", responses=GENERATE)
    async def create_response(self, body: ResponseCreate, request: Request):
        self._check_model(body.model)
        try:
            made = await self.responses.create(body, sampling(body), owner(request))
        except Exception as e:
            return response_for(e)
        return sse(made) if body.stream else JSONResponse(made)

    @app.get("/v1/responses/{response_id}", responses=LOOKUP)
    async def get_response(self, response_id: str, request: Request) -> JSONResponse:
        return JSONResponse((await self.responses.stored(response_id, owner(request)))["response"])

    @app.delete("/v1/responses/{response_id}", responses=LOOKUP)
    async def delete_response(self, response_id: str, request: Request) -> dict[str, Any]:
        await self.responses.delete(response_id, owner(request))
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
        return await self.responses.input_items(response_id, owner(request), limit, order, after)

    # ---- internals ----
    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model:
            raise UnknownModelError(model, self.model)

    def _names_session(self, request: Request, body_sid: str | None) -> bool:
        return body_sid is not None or self.cfg.session_header in request.headers

    async def _session_fields(
        self, request: Request, body_sid: str | None, model: str | None
    ) -> dict[str, Any]:
        """The turn's session fields (`SessionAdmin.turn_fields`), the model checked first."""
        self._check_model(model)
        header = request.headers.get(self.cfg.session_header)
        return await self.sessions.turn_fields(header, body_sid, owner(request))

    async def _answer(
        self, call: GenerateCall, body: Any, reply: Reply, owner_id: str | None = None
    ):
        """A chat or completion turn: one body, or (`stream: true`) its chunks; the finished
        turn recorded in the directory either way. `n` > 1: `_choices`."""
        if body.n > 1:
            return await self._choices(call, body, reply, owner_id)
        try:
            stream, first = await self.turns.open(call, owner_id)
        except Exception as e:
            return response_for(e)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return sse(self._chunks(stream, first, reply, call, include_usage))
        text, logprobs, final = await self.turns.collect(stream, first)
        await self.turns.commit(call, final)
        return JSONResponse(reply.response(text, logprobs, self.turns.stamped(final)))

    async def _choices(self, call: GenerateCall, body: Any, reply: Reply, owner_id: str | None):
        """`n` sessionless turns (api/choices.py) as one answer's choices."""
        try:
            opened = await open_choices(self.turns, choice_calls(call, body.n), owner_id)
        except Exception as e:
            return response_for(e)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return sse(relay_choices(opened, reply, self.turns.stamped, include_usage))
        answers = await collect_choices(self.turns, opened)
        stamped = [(text, lps, self.turns.stamped(final)) for text, lps, final in answers]
        return JSONResponse(reply.choices_response(stamped))

    def _chunks(
        self,
        stream: TurnStream,
        first: TurnDelta | TurnResult,
        reply: Reply,
        call: GenerateCall,
        include_usage: bool,
    ) -> AsyncIterator[str]:
        async def finish(final: TurnResult) -> list[str]:
            await self.turns.commit(call, final)
            return reply.closing(self.turns.stamped(final), include_usage)

        async def fail(body: dict[str, Any]) -> list[str]:
            return [Reply._sse(body), "data: [DONE]\n\n"]

        opening = [chunk for chunk in (reply.opening(),) if chunk]
        return self.turns.relay(stream, first, opening, reply.delta, finish, fail)


__all__ = ["Ingress", "app", "error_response"]
