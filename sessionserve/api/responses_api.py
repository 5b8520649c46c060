"""OpenAI's Responses API over sessions: the request, its input items, the response object and
the stream events.

A chain of responses linked by `previous_response_id` is one session: the new response is sent
to the session's pinned replica as a chat-mode turn over the whole conversation (the chain's
earlier inputs and outputs plus the new input), so the replica reuses the KV it still holds
and prefills only what is new. Two responses naming the same previous response fork the
conversation: each is a turn over its own full conversation, so the session rewinds to the
shared point (its KV reused) and neither branch sees the other's tokens.

Function tools work as in chat completions (the replica constrains and parses the calls): a
call is a `function_call` output item, its result comes back as a `function_call_output` input
item (through `previous_response_id`, or with the whole conversation in `input`, as agent SDKs
send it). Field names, objects and events follow OpenAI's API reference. What we do not serve
(built-in tools, files, images, reasoning options, background runs, ...) is refused with a 400
naming the field, never accepted and ignored; the published schema lists, for each such field,
only the values that mean "not used" (what SDKs send by default), so a schema-valid request is
served.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, WithJsonSchema

from sessionserve.api.protocol import (
    FUNCTION_NAME,
    MAX_TOOLS,
    TEMPERATURE_SCHEMA,
    TOOLS_RULE,
    JsonObjectFormat,
    JsonSchemaSpec,
    RequestBody,
    TextFormat,
    constraint,
    nullable,
    tool_use,
)
from sessionserve.errors import InvalidRequestError
from sessionserve.wire import (
    MIN_TOP_P,
    ToolCall,
    ToolSpec,
    ToolUse,
    TurnDelta,
    TurnResult,
    new_id,
)

INPUT_ROLES = ("user", "assistant", "system", "developer")
TEXT_PART_TYPES = ("input_text", "output_text")


def _text_or_list(item: dict[str, Any]) -> dict[str, Any]:
    """A string, or a non-empty list of `item`s (both `input` and a message's `content`)."""
    return {"anyOf": [{"type": "string"}, {"type": "array", "minItems": 1, "items": item}]}


TEXT_PART_SCHEMA = {
    "type": "object",
    "properties": {"type": {"enum": list(TEXT_PART_TYPES)}, "text": {"type": "string"}},
    "required": ["type", "text"],
}
MESSAGE_ITEM_SCHEMA = {
    "type": "object",
    "properties": {
        "type": {"const": "message"},
        "role": {"enum": list(INPUT_ROLES)},
        "content": _text_or_list(TEXT_PART_SCHEMA),
        "id": {},
        "status": {},
    },
    "required": ["role", "content"],
    "additionalProperties": False,
}
ITEM_KEYS = set(MESSAGE_ITEM_SCHEMA["properties"])  # a message item's fields, no other
FUNCTION_CALL_ITEM_SCHEMA = {
    "type": "object",
    "properties": {
        "type": {"const": "function_call"},
        "call_id": {"type": "string", "minLength": 1},
        "name": {"type": "string"},
        "arguments": {"type": "string"},
        "id": {},
        "status": {},
    },
    "required": ["type", "call_id", "name", "arguments"],
    "additionalProperties": False,
}
INPUT_TEXT_PART = TEXT_PART_SCHEMA | {
    "properties": {"type": {"const": "input_text"}, "text": {"type": "string"}}
}
FUNCTION_OUTPUT_ITEM_SCHEMA = {
    "type": "object",
    "properties": {
        "type": {"const": "function_call_output"},
        "call_id": {"type": "string", "minLength": 1},
        "output": _text_or_list(INPUT_TEXT_PART),
        "id": {},
        "status": {},
    },
    "required": ["type", "call_id", "output"],
    "additionalProperties": False,
}
ITEM_SCHEMAS = {
    "message": MESSAGE_ITEM_SCHEMA,
    "function_call": FUNCTION_CALL_ITEM_SCHEMA,
    "function_call_output": FUNCTION_OUTPUT_ITEM_SCHEMA,
}
# What `parse_input` accepts, published as the schema of `input` (a unit test holds the two
# together): a string, or text messages, function calls and their outputs; other item and
# part types are refused.
INPUT_SCHEMA = _text_or_list({"anyOf": list(ITEM_SCHEMAS.values())}) | {
    "description": "A string (one user message), or text messages, function_call items and "
    "function_call_output items; earlier turns come through previous_response_id or here."
}
NOT_SERVED = "Not supported by this server: only the value that means 'not used' is accepted."


def not_served(*accepted: dict[str, Any]) -> WithJsonSchema:
    """The published schema of a field we do not serve: null, or `accepted` (its neutral
    values, which `refuse_unsupported` lets through)."""
    return WithJsonSchema({"anyOf": [*accepted, {"type": "null"}], "description": NOT_SERVED})


EMPTY_LIST = {"type": "array", "maxItems": 0}


class ResponsesJsonSchema(JsonSchemaSpec):
    """`text.format` of type json_schema: chat's `json_schema` object, flattened."""

    type: Literal["json_schema"]


class ResponseText(RequestBody):
    """`text`: the answer's format; a json_schema or json_object answer is constrained to it
    (constrained decoding). `verbosity` is not supported (an unrecognized argument)."""

    format: (
        Annotated[TextFormat | JsonObjectFormat | ResponsesJsonSchema, Field(discriminator="type")]
        | None
    ) = None


class FunctionTool(RequestBody):
    """A function tool of the Responses API (chat's function object, flattened)."""

    type: Literal["function"]
    name: str = FUNCTION_NAME
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def spec(self) -> ToolSpec:
        return ToolSpec(self.name, self.parameters or {}, self.description)


FUNCTION_TOOL_SCHEMA = FunctionTool.model_json_schema()
TOOLS_SCHEMA = {
    "anyOf": [
        {"type": "array", "items": FUNCTION_TOOL_SCHEMA, "maxItems": MAX_TOOLS},
        {"type": "null"},
    ],
    "description": TOOLS_RULE + " Built-in tools (web search, file search, ...) are a 400.",
}
TOOL_CHOICE_SCHEMA = {
    "anyOf": [
        {"enum": ["none", "auto", "required"]},
        {
            "type": "object",
            "properties": {"type": {"const": "function"}, "name": {"type": "string"}},
            "required": ["type", "name"],
            "additionalProperties": False,
        },
        {"type": "null"},
    ],
    "description": "none, auto (the default with tools), required, or the function to call "
    "(it must be in tools: else a 400).",
}
MetadataKey = Annotated[str, Field(max_length=64)]
MetadataValue = Annotated[str, Field(max_length=512)]


class ResponseCreate(RequestBody):
    """`POST /v1/responses`. Fields we do not support are declared so that they get a clear
    400 (see `refuse_unsupported`) rather than "unrecognized argument"."""

    model: str | None = None
    input: Annotated[str | list[dict[str, Any]], WithJsonSchema(INPUT_SCHEMA)]
    instructions: str | None = None
    previous_response_id: str | None = Field(None, min_length=1, max_length=128)
    store: bool = True
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: Annotated[float | None, nullable(TEMPERATURE_SCHEMA)] = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=MIN_TOP_P, le=1.0)
    stream: bool = False
    metadata: dict[MetadataKey, MetadataValue] | None = Field(None, max_length=16)
    truncation: Literal["disabled", "auto"] = "disabled"
    user: str | None = None
    safety_identifier: str | None = None
    tools: Annotated[list[Any] | None, WithJsonSchema(TOOLS_SCHEMA)] = None
    tool_choice: Annotated[Any, WithJsonSchema(TOOL_CHOICE_SCHEMA)] = None
    parallel_tool_calls: bool | None = None
    text: ResponseText | None = None
    # accepted only with the value that means "not used"
    reasoning: Annotated[Any, not_served()] = None
    background: Annotated[bool | None, not_served({"const": False})] = None
    include: Annotated[list[Any] | None, not_served(EMPTY_LIST)] = None
    top_logprobs: Annotated[int | None, not_served({"const": 0})] = None
    max_tool_calls: Annotated[int | None, not_served()] = None
    prompt: Annotated[Any, not_served()] = None
    conversation: Annotated[Any, not_served()] = None
    prompt_cache_key: Annotated[Any, not_served()] = None
    service_tier: Annotated[Any, not_served({"enum": ["auto", "default"]})] = None
    stream_options: Annotated[Any, not_served()] = None

    def refuse_unsupported(self) -> None:
        """400 naming the first field that asks for something this server does not do."""
        refused = {
            "reasoning": self.reasoning is not None,
            "background": bool(self.background),
            "include": bool(self.include),
            "top_logprobs": bool(self.top_logprobs),
            "max_tool_calls": self.max_tool_calls is not None,
            "prompt": self.prompt is not None,
            "conversation": self.conversation is not None,
            "prompt_cache_key": self.prompt_cache_key is not None,
            "service_tier": self.service_tier not in (None, "auto", "default"),
            "stream_options": self.stream_options is not None,
        }
        for name, bad in refused.items():
            if bad:
                raise InvalidRequestError(
                    f"{name}: not supported by this server (text in, text out; conversation "
                    "state through previous_response_id); remove the field",
                    param=name,
                )

    def tool_use(self) -> ToolUse | None:
        """The function tools and tool choice, checked: a built-in tool is a 400 naming it."""
        tools = [_function_tool(i, t) for i, t in enumerate(self.tools or [])]
        choice, forced = self.tool_choice, None
        if isinstance(choice, dict):
            if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
                raise InvalidRequestError(
                    f"tool_choice: {choice.get('type')!r} is not served here: choose none, "
                    'auto, required or {"type": "function", "name": ...}',
                    "tool_choice",
                )
            choice, forced = None, choice["name"]
        elif choice not in (None, "none", "auto", "required"):
            raise InvalidRequestError(
                "tool_choice: none, auto, required or a function", "tool_choice"
            )
        return tool_use(tools, choice, forced, self.parallel_tool_calls)

    def tools_view(self) -> list[dict[str, Any]]:
        """The tools as a response object reports them."""
        return [FunctionTool.model_validate(t).model_dump() for t in self.tools or []]

    def sampling_kwargs(self) -> dict[str, Any]:
        kwargs = {
            "max_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "json_schema": constraint(self.text.format if self.text else None),
        }
        return {k: v for k, v in kwargs.items() if v is not None}

    def text_format(self) -> dict[str, Any]:
        """The `text.format` a response object reports (as asked; plain text by default)."""
        fmt = self.text.format if self.text else None
        return fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}


def _function_tool(i: int, tool: Any) -> ToolSpec:
    where = f"tools[{i}]"
    kind = tool.get("type") if isinstance(tool, dict) else None
    if kind != "function":
        raise InvalidRequestError(
            f"{where}.type: {kind!r} tools are not served here (no built-in OpenAI tools): "
            "send function tools, which your code runs",
            f"{where}.type",
        )
    try:
        return FunctionTool.model_validate(tool).spec()
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join([where, *(str(x) for x in err["loc"])])
        raise InvalidRequestError(f"{param}: {err['msg']}", param) from None


# ---- input items ----
def _text_part(kind: str, text: str) -> dict[str, Any]:
    return (
        {"type": kind, "text": text, "annotations": []}
        if kind == "output_text"
        else {
            "type": kind,
            "text": text,
        }
    )


def message_item(role: str, text: str, item_id: str | None = None) -> dict[str, Any]:
    """A message in the Responses API's item shape (input messages carry `input_text` parts,
    assistant messages `output_text` ones)."""
    kind = "output_text" if role == "assistant" else "input_text"
    return {
        "id": item_id or new_id("msg"),
        "type": "message",
        "role": role,
        "status": "completed",
        "content": [_text_part(kind, text)],
    }


def parse_input(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's `input` as message items with ids. Text messages only; anything else is
    a 400 naming the exact place (`input[2].content[0].type`)."""
    if isinstance(value, str):
        return [message_item("user", value)]
    if not value:
        raise InvalidRequestError("input: send a string or at least one message", "input")
    return [_parse_item(i, item) for i, item in enumerate(value)]


def _parse_item(i: int, item: dict[str, Any]) -> dict[str, Any]:
    where = f"input[{i}]"
    kind = item.get("type", "message")
    if kind not in ITEM_SCHEMAS:
        raise InvalidRequestError(
            f"{where}.type: {kind!r} items are not supported; send text messages, "
            "function_call and function_call_output items",
            param=f"{where}.type",
        )
    schema = ITEM_SCHEMAS[kind]
    extra = set(item) - set(schema["properties"])
    if extra:
        raise InvalidRequestError(
            f"{where}: unrecognized field {sorted(extra)[0]!r}", param=f"{where}.{sorted(extra)[0]}"
        )
    if kind != "message":
        return _parse_function_item(where, item, schema)
    role = item.get("role")
    if role not in INPUT_ROLES:
        raise InvalidRequestError(
            f"{where}.role: must be one of {', '.join(INPUT_ROLES)}", param=f"{where}.role"
        )
    content = item.get("content")
    if isinstance(content, str):
        return message_item(role, content)
    if not isinstance(content, list) or not content:
        raise InvalidRequestError(
            f"{where}.content: a string or a list of text parts", param=f"{where}.content"
        )
    texts = []
    for j, part in enumerate(content):
        part_type = part.get("type") if isinstance(part, dict) else None
        if part_type not in TEXT_PART_TYPES or not isinstance(part.get("text"), str):
            raise InvalidRequestError(
                f"{where}.content[{j}].type: {part_type!r} is not supported (text parts only: "
                "input_text, or output_text in assistant messages)",
                param=f"{where}.content[{j}].type",
            )
        texts.append(part["text"])
    return message_item(role, "".join(texts))


def _parse_function_item(where: str, item: dict[str, Any], schema: dict) -> dict[str, Any]:
    for key in schema["required"]:
        if key not in item:
            raise InvalidRequestError(f"{where}.{key}: required", param=f"{where}.{key}")
    if not isinstance(item["call_id"], str) or not item["call_id"]:
        raise InvalidRequestError(f"{where}.call_id: a non-empty string", f"{where}.call_id")
    if item["type"] == "function_call":
        for key in ("name", "arguments"):
            if not isinstance(item[key], str):
                raise InvalidRequestError(f"{where}.{key}: a string", param=f"{where}.{key}")
        return function_call_item(ToolCall(item["call_id"], item["name"], item["arguments"]))
    output = item["output"]
    if isinstance(output, list) and output:
        parts = [p for p in output if isinstance(p, dict) and p.get("type") == "input_text"]
        if len(parts) == len(output) and all(isinstance(p.get("text"), str) for p in parts):
            output = "".join(p["text"] for p in parts)
    if not isinstance(output, str):
        raise InvalidRequestError(
            f"{where}.output: a string or a list of input_text parts", f"{where}.output"
        )
    return {
        "id": new_id("fco"),
        "type": "function_call_output",
        "call_id": item["call_id"],
        "output": output,
        "status": "completed",
    }


def function_call_item(call: ToolCall, status: str = "completed") -> dict[str, Any]:
    """A call as an output (or input) item; its item id follows from the call id."""
    return {
        "id": "fc_" + call.id.removeprefix("call_"),
        "type": "function_call",
        "status": status,
        "arguments": call.arguments,
        "call_id": call.id,
        "name": call.name,
    }


def item_text(item: dict[str, Any]) -> str:
    return "".join(part["text"] for part in item["content"])


def chat_messages(instructions: str | None, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation as chat messages for the model's template: a run of function calls
    joins the assistant message before it (they were one answer), an output is a tool
    message. `instructions` apply to this response only (OpenAI does not carry them over a
    previous_response_id)."""
    out = [{"role": "system", "content": instructions}] if instructions else []
    for it in items:
        kind = it["type"]
        if kind == "function_call":
            call = ToolCall(it["call_id"], it["name"], it["arguments"])
            if not (out and out[-1]["role"] == "assistant"):
                out.append({"role": "assistant", "content": ""})
            out[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            out.append({"role": "tool", "content": it["output"], "tool_call_id": it["call_id"]})
        else:
            out.append({"role": it["role"], "content": item_text(it)})
    return out


def drop_oldest_turn(items: list[dict[str, Any]], keep: int) -> int:
    """How many leading items make up the oldest turn (a run of non-user items after the
    first user message), never touching the last `keep` items (the new input); 0 if nothing
    can go."""
    droppable = len(items) - keep
    n = 1
    while n < droppable and items[n].get("role") != "user":
        n += 1
    return min(n, droppable) if droppable > 0 else 0


# ---- the response object ----
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
        content = [_text_part("output_text", text)] if status != "in_progress" else []
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
            part = _text_part("output_text", "")
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
                    part=_text_part("output_text", text),
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
