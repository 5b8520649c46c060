"""The Responses API's request (`ResponseCreate`) and its input items, as OpenAI's reference
shapes them: what is validated and published in the schema, what is refused with a 400 naming
the field, and how items become chat messages for a turn (see `__init__.py` for the design)."""

from __future__ import annotations

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
def text_part(kind: str, text: str) -> dict[str, Any]:
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
        "content": [text_part(kind, text)],
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
