"""A response while it is made and what it becomes: OpenAI's response object, its stream events
(`ResponseEvents`: one `response.*` event per change, in the order OpenAI's reference gives)
and the pages of a stored response's input items."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from sessionserve.api.responses.protocol import (
    ResponseCreate,
    function_call_item,
    text_part,
)
from sessionserve.errors import InvalidRequestError
from sessionserve.wire import ToolCall, TurnDelta, TurnResult, new_id


def usage(final: TurnResult) -> dict[str, Any]:
    return {
        "input_tokens": final.prompt_tokens,
        "input_tokens_details": {"cached_tokens": final.cached_tokens},
        "output_tokens": final.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": final.prompt_tokens + final.completion_tokens,
    }


@dataclass
class ResponseDraft:
    """One response while it is made: everything the object says besides the output."""

    body: ResponseCreate
    model: str
    session_id: str | None
    new_session: bool = False  # opened for this response (closed again if it fails)
    owner: str | None = None  # the caller's API key fingerprint (None without keys)
    id: str = field(default_factory=lambda: new_id("resp"))
    message_id: str = field(default_factory=lambda: new_id("msg"))
    created_at: int = field(default_factory=lambda: int(time.time()))
    truncated_items: int = 0

    def message(self, text: str, status: str) -> dict[str, Any]:
        content = [text_part("output_text", text)] if status != "in_progress" else []
        return {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": content,
        }

    def output(self, final: TurnResult, text: str) -> list[dict[str, Any]]:
        """The output items: the message (unless the answer is only calls), then each call."""
        status = "incomplete" if final.finish_reason == "length" else "completed"
        calls = [function_call_item(c, status) for c in final.tool_calls]
        return ([self.message(text, status)] if text or not calls else []) + calls

    def object(self, final: TurnResult | None = None, text: str = "") -> dict[str, Any]:
        """The response object: in progress without `final`, else completed or incomplete."""
        status, incomplete, output = "in_progress", None, []
        if final is not None:
            status = "incomplete" if final.finish_reason == "length" else "completed"
            if status == "incomplete":
                incomplete = {"reason": "max_output_tokens"}
            output = self.output(final, text)
        b = self.body
        choice = b.tool_choice if b.tool_choice is not None else ("auto" if b.tools else "none")
        obj: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens,
            "metadata": b.metadata or {},
            "model": self.model,
            "output": output,
            "parallel_tool_calls": b.parallel_tool_calls is not False,
            "previous_response_id": b.previous_response_id,
            "reasoning": None,
            "store": b.store,
            "temperature": b.temperature if b.temperature is not None else 1.0,
            "text": {"format": b.text_format()},
            "tool_choice": choice,
            "tools": b.tools_view(),
            "top_p": b.top_p if b.top_p is not None else 1.0,
            "truncation": b.truncation,
            "usage": usage(final) if final is not None else None,
            "user": b.user,
        }
        # not OpenAI's: where the KV came from, and what `truncation: auto` dropped
        obj["session"] = {
            "id": self.session_id,
            "cached_source": final.cached_source if final else None,
            "replica": final.replica if final else None,
            "ingress": final.ingress if final else None,
            "truncated_items": self.truncated_items,
        }
        return obj


class ResponseEvents:
    """The Responses API's server-sent events for one response, numbered in order. Output
    items open as the answer reaches them (the message at its first text, a function call at
    its name) and close when the next one opens or the response ends, so the events of each
    item are contiguous, as OpenAI's are."""

    def __init__(self, draft: ResponseDraft) -> None:
        self.draft = draft
        self.seq = 0
        self.text = ""
        self.items: list[dict[str, Any]] = []  # opened, in output order
        self.open = False  # the last item is still streaming

    def _event(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(body)}\n\n"

    def _where(self, index: int) -> dict[str, Any]:
        return {"item_id": self.items[index]["id"], "output_index": index}

    def opening(self) -> list[str]:
        d = self.draft
        return [
            self._event("response.created", response=d.object()),
            self._event("response.in_progress", response=d.object()),
        ]

    def _add(self, item: dict[str, Any]) -> list[str]:
        self.items.append(item)
        self.open = True
        out = [
            self._event("response.output_item.added", output_index=len(self.items) - 1, item=item)
        ]
        if item["type"] == "message":
            part = text_part("output_text", "")
            out.append(self._event("response.content_part.added", **self._text_where(), part=part))
        return out

    def _text_where(self) -> dict[str, Any]:
        return self._where(len(self.items) - 1) | {"content_index": 0}

    def delta(self, piece: TurnDelta) -> str | None:
        """The events of a piece of the answer (None: nothing to send)."""
        out: list[str] = []
        if piece.text:
            if not self.items:
                out += self._add(self.draft.message("", "in_progress"))
            self.text += piece.text
            out.append(
                self._event(
                    "response.output_text.delta",
                    **self._text_where(),
                    delta=piece.text,
                    logprobs=[],
                )
            )
        for c in piece.tool_calls:
            if c.id is not None:  # a new call: what was streaming is done
                out += self._close(self._streamed(len(self.items) - 1)) if self.open else []
                call = ToolCall(c.id, c.name or "", "")
                out += self._add(function_call_item(call, "in_progress"))
            if c.arguments:
                self.items[-1]["arguments"] += c.arguments
                out.append(
                    self._event(
                        "response.function_call_arguments.delta",
                        **self._where(len(self.items) - 1),
                        delta=c.arguments,
                    )
                )
        return "".join(out) or None

    def _streamed(self, index: int) -> dict[str, Any]:
        """An item as streamed so far, completed (the final object has the same)."""
        item = self.items[index]
        if item["type"] == "message":
            return self.draft.message(self.text, "completed")
        return item | {"status": "completed"}

    def _close(self, item: dict[str, Any]) -> list[str]:
        """The events that end the last item, `item` as it ends."""
        index, self.open = len(self.items) - 1, False
        if item["type"] == "message":
            text = item["content"][0]["text"]
            out = [
                self._event(
                    "response.output_text.done", **self._text_where(), text=text, logprobs=[]
                ),
                self._event(
                    "response.content_part.done",
                    **self._text_where(),
                    part=text_part("output_text", text),
                ),
            ]
        else:
            out = [
                self._event(
                    "response.function_call_arguments.done",
                    **self._where(index),
                    name=item["name"],
                    arguments=item["arguments"],
                )
            ]
        return [*out, self._event("response.output_item.done", output_index=index, item=item)]

    def closing(self, response: dict[str, Any]) -> list[str]:
        """The closing events, around the finished (and already stored) response object:
        the end of each item not yet done, as the response has it (one never opened, an
        empty answer's message, is opened first)."""
        out: list[str] = []
        for index, item in enumerate(response["output"]):
            if index >= len(self.items):
                opened = item | {"status": "in_progress"}
                out += self._add(opened | ({"content": []} if item["type"] == "message" else {}))
            elif index < len(self.items) - 1 or not self.open:
                continue  # done already
            out += self._close(item)
        done = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return [*out, self._event(done, response=response)]

    def error(self, body: dict[str, Any]) -> str:
        err = body["error"]
        return self._event(
            "error",
            code=err.get("code") or err["type"],
            message=err["message"],
            param=err.get("param"),
        )


def item_page(
    items: list[dict[str, Any]], limit: int, order: str, after: str | None
) -> dict[str, Any]:
    """`GET /v1/responses/{id}/input_items`: a cursor page (OpenAI's list object)."""
    ordered = items if order == "asc" else items[::-1]
    if after is not None:
        ids = [it["id"] for it in ordered]
        if after not in ids:
            raise InvalidRequestError(f"after: no input item {after!r} in this response", "after")
        ordered = ordered[ids.index(after) + 1 :]
    page = ordered[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(ordered) > limit,
    }
