"""The Responses API's calls, with no HTTP in it: make a response (a turn of its chain's
session), store it with its conversation, read and delete stored ones.

A response whose chain is new opens a session for it (unless `store: false`: nothing is
kept); one that names `previous_response_id` continues (or forks) that response's session,
sending the whole conversation as a chat-mode turn through the shared `TurnTransport`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from sessionserve.api.responses.objects import ResponseDraft, ResponseEvents, item_page
from sessionserve.api.responses.protocol import (
    ResponseCreate,
    chat_messages,
    drop_oldest_turn,
    parse_input,
)
from sessionserve.api.session_admin import SessionAdmin
from sessionserve.api.turns import TurnStream, TurnTransport
from sessionserve.errors import (
    ContextTooLongError,
    EngineUnavailableError,
    InvalidRequestError,
    UnknownResponseError,
)
from sessionserve.wire import GenerateCall, SamplingParams, ToolUse, TurnDelta, TurnResult


class ResponsesService:
    def __init__(self, transport: TurnTransport, sessions: SessionAdmin, model: str) -> None:
        self.transport = transport
        self.sessions = sessions
        self.directory = transport.directory
        self.model = model

    async def create(
        self, body: ResponseCreate, sampling: SamplingParams, owner: str | None
    ) -> dict[str, Any] | AsyncIterator[str]:
        """`POST /v1/responses`: the finished response object, or (`stream: true`) its
        server-sent events. A first response that fails leaves no session behind."""
        body.refuse_unsupported()
        tools = body.tool_use()
        new_items = parse_input(body.input)
        earlier: list[dict[str, Any]] = []
        if body.previous_response_id is not None:  # continue (or fork) its conversation
            prev = await self.stored(body.previous_response_id, owner, "previous_response_id")
            sid = prev["session_id"]
            earlier = prev["items"] + prev["response"]["output"]
        else:  # a new conversation: a new session, unless nothing is to be kept
            sid = await self.sessions.open(None, None, owner) if body.store else None
        draft = ResponseDraft(body, self.model, sid, new_session=body.previous_response_id is None)
        draft.owner = owner
        if sid is not None:  # stored on its session's directory shard
            draft.id = self.directory.response_id(sid)
        try:
            stream, first, items = await self._start(
                draft, sampling, tools, earlier + new_items, len(new_items)
            )
            if body.stream:
                return self._events(stream, first, draft, items)
            _, _, final = await self.transport.collect(stream, first)
            return await self._finish(draft, items, final)
        except Exception:
            await self._failed(draft)
            raise

    async def stored(
        self, response_id: str, owner: str | None, param: str | None = None
    ) -> dict[str, Any]:
        """A stored response with its input items and session (404 if there is none)."""
        stored = await self.directory.get_response(response_id, owner)
        if stored is None:
            raise UnknownResponseError(response_id, param)
        return stored

    async def delete(self, response_id: str, owner: str | None) -> None:
        if not await self.directory.delete_response(response_id, owner):
            raise UnknownResponseError(response_id)

    async def input_items(
        self, response_id: str, owner: str | None, limit: int, order: str, after: str | None
    ) -> dict[str, Any]:
        return item_page((await self.stored(response_id, owner))["items"], limit, order, after)

    async def _start(
        self,
        draft: ResponseDraft,
        sampling: SamplingParams,
        tools: ToolUse | None,
        items: list[dict],
        keep: int,
    ) -> tuple[TurnStream, TurnDelta | TurnResult, list[dict]]:
        """Open the turn; with `truncation: auto`, drop the oldest turns (never the new input)
        until the conversation fits the context, counting what went in the draft."""
        while True:
            messages = chat_messages(draft.body.instructions, items)
            call = GenerateCall(
                sampling, draft.session_id, "chat", messages=messages, tool_use=tools
            )
            try:
                stream, first = await self.transport.open(call)
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

    async def _finish(
        self, draft: ResponseDraft, items: list[dict], final: TurnResult
    ) -> dict[str, Any]:
        """The finished response object, stored with its conversation unless `store: false`
        (then nothing is kept, not even in the session's failover log)."""
        if final.finish_reason == "abort":
            raise EngineUnavailableError(f"the turn was aborted ({final.finish_message}); retry")
        response = draft.object(self.transport.stamped(final), final.text or "")
        if draft.body.store and draft.session_id is not None:
            stored = self.directory.store_response(
                draft.session_id, response, items, final.log_base, final.log_tail, draft.owner
            )
            await asyncio.shield(self.transport.kept_or_freed(draft.session_id, stored))
        return response

    async def _failed(self, draft: ResponseDraft) -> None:
        """A first response that never completed leaves no empty conversation behind."""
        if draft.new_session and draft.session_id is not None:
            await self.sessions.close(draft.session_id, draft.owner)

    def _events(
        self,
        stream: TurnStream,
        first: TurnDelta | TurnResult,
        draft: ResponseDraft,
        items: list[dict],
    ) -> AsyncIterator[str]:
        events = ResponseEvents(draft)

        async def finish(final: TurnResult) -> list[str]:
            return events.closing(await self._finish(draft, items, final))

        async def fail(body: dict[str, Any]) -> list[str]:
            await self._failed(draft)
            return [events.error(body)]

        return self.transport.relay(stream, first, events.opening(), events.delta, finish, fail)
