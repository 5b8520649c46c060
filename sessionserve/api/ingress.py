"""The HTTP ingress: OpenAI-compatible endpoints, the session API, and error mapping.

FastAPI resolves the route annotations at runtime, so this module does not use
`from __future__ import annotations`.

It owns the wire only: it validates, looks sessions up in the shared directory, calls the
replica deployment with `session_id` set (the session router pins it), and formats results.
Tokenization and generation happen on the replica.
"""

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve

from sessionserve.api.errors import error_response, install_error_handlers, response_for
from sessionserve.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SessionCreate,
    SessionView,
    now,
)
from sessionserve.api.responses import Kind, Reply
from sessionserve.config import AppConfig, served_model_name
from sessionserve.errors import SessionExistsError, UnknownModelError, UnknownSessionError
from sessionserve.replicas.request import SamplingParams
from sessionserve.replicas.server import GenerateCall
from sessionserve.router.directory import get_directory

log = logging.getLogger(__name__)
app = FastAPI(title="sessionserve", description="OpenAI-compatible API with streaming sessions")
install_error_handlers(app)


@serve.ingress(app)
class Ingress:
    def __init__(self, replica: Any, config: dict[str, Any]) -> None:
        self.cfg = AppConfig.model_validate(config)
        self.replica = replica
        self.model = served_model_name(self.cfg.engine.model)
        context = serve.get_replica_context()
        self.ingress_id = context.replica_id.unique_id
        app_name = context.app_name
        self.directory = get_directory(app_name, self.cfg.engine.sessions.default_ttl_s)

    # ---- plain endpoints ----
    @app.get("/health")
    async def health(self) -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {"id": self.model, "object": "model", "created": now(), "owned_by": "sessionserve"}
            ],
        }

    # ---- sessions ----
    @app.post("/v1/sessions")
    async def open_session(self, body: SessionCreate | None = None) -> SessionView:
        body = body or SessionCreate()
        sid = await self.directory.open.remote(body.session_id, body.ttl_s)
        if sid is None:
            raise SessionExistsError(body.session_id or "")
        return await self._view(sid)

    @app.get("/v1/sessions/{session_id}")
    async def get_session(self, session_id: str) -> SessionView:
        return await self._view(session_id)

    @app.delete("/v1/sessions/{session_id}")
    async def close_session(self, session_id: str) -> dict[str, Any]:
        replica = await self.directory.close.remote(session_id)
        if replica is None:
            raise UnknownSessionError(session_id)
        if replica:  # frees its KV there (deferred while a turn runs)
            await self.replica.options(session_id=session_id).close_session.remote(session_id)
        return {"id": session_id, "object": "session.deleted", "deleted": True}

    async def _view(self, sid: str) -> SessionView:
        info = await self.directory.info.remote(sid)
        if info is None:
            raise UnknownSessionError(sid)
        held = None
        if info["replica"] is not None:
            held = await self.replica.options(session_id=sid).session_held_tokens.remote(sid)
        return SessionView(id=sid, held_tokens=held, **info)

    # ---- generation ----
    @app.post("/v1/chat/completions")
    async def chat(self, body: ChatCompletionRequest, request: Request):
        sid = await self._session(request, body.session_id, body.model)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        call = GenerateCall(self._sampling(body), sid, "chat", messages=messages)
        return await self._serve(call, body, "chat", bool(body.logprobs))

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest, request: Request):
        sid = await self._session(request, body.session_id, body.model)
        history = None
        if sid is not None:  # append mode: the new prompt extends the session's token log
            history = await self.directory.log.remote(sid)
        call = GenerateCall(
            self._sampling(body), sid, "append", prompt=body.prompt, history_ids=history
        )
        return await self._serve(call, body, "completion", body.logprobs is not None)

    # ---- internals ----
    async def _session(
        self, request: Request, body_sid: str | None, model: str | None
    ) -> str | None:
        if model is not None and model != self.model:
            raise UnknownModelError(model, self.model)
        sid = request.headers.get(self.cfg.session_header) or body_sid
        if sid is None:
            return None
        if not await self.directory.touch.remote(sid):
            if not self.cfg.engine.sessions.implicit_open:
                raise UnknownSessionError(sid)
            await self.directory.open.remote(sid, None)
        return sid

    @staticmethod
    def _sampling(body: Any) -> dict[str, Any]:
        kwargs = {k: v for k, v in body.sampling_kwargs().items() if v is not None}
        SamplingParams.build(**kwargs)  # validate here: a 400 before any replica work
        return kwargs

    async def _serve(self, call: GenerateCall, body: Any, kind: Kind, want_lp: bool):
        handle = self.replica.options(stream=True, session_id=call.session_id)
        stream = handle.generate.remote(call)
        try:
            first = await stream.__anext__()  # errors before any token become a proper 4xx
        except Exception as e:
            return response_for(e)
        reply = Reply(kind, self.model, want_lp)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                self._sse(stream, first, reply, call, include_usage), media_type="text/event-stream"
            )
        text, logprobs, piece = [], [], first
        while "final" not in piece:
            text.append(piece["text"])
            logprobs += piece.get("logprobs") or []
            piece = await stream.__anext__()
        await self._commit(call, piece["final"])
        final = piece["final"] | {"ingress": self.ingress_id}
        return JSONResponse(reply.response("".join(text), logprobs, final))

    async def _sse(
        self,
        stream: Any,
        first: dict[str, Any],
        reply: Reply,
        call: GenerateCall,
        include_usage: bool,
    ) -> AsyncIterator[str]:
        finished = False
        try:
            opening = reply.opening()
            if opening:
                yield opening
            piece = first
            while "final" not in piece:
                chunk = reply.delta(piece)
                if chunk:
                    yield chunk
                piece = await stream.__anext__()
            finished = True
            await self._commit(call, piece["final"])
            for chunk in reply.closing(piece["final"], include_usage):
                yield chunk
        except Exception as e:  # a failure mid-stream: tell the client in-band
            finished = True
            yield Reply._sse(json.loads(response_for(e).body))
            yield "data: [DONE]\n\n"
        finally:
            if not finished:  # the client disconnected: abort the turn on the replica
                stream.cancel()

    async def _commit(self, call: GenerateCall, final: dict[str, Any]) -> None:
        if call.session_id is not None and final["finish_reason"] != "abort":
            await self.directory.commit_turn.remote(call.session_id, final["full_ids"])


__all__ = ["Ingress", "app", "error_response"]
