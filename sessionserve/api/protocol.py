"""Request and response models of the HTTP API (OpenAI's shapes, plus sessions).

Unknown fields are rejected (400 naming the field), as OpenAI does. Field names follow OpenAI;
`session_id` may also come in a header (`x-session-id` by default).

The published schema states every rule the server enforces on a field. Where a rule is
enforced by a check rather than by the field's type (the engine's sampling bounds, a non-empty
prompt), the field carries the rule as `WithJsonSchema`; what depends on the deployment (the
context length, the vocabulary, the session header's name) is added when the schema is served
(sessionserve/api/openapi.py).
"""

from __future__ import annotations

import json
import re
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator, model_validator

from sessionserve.errors import InvalidRequestError
from sessionserve.wire import (
    MIN_REPETITION_PENALTY,
    MIN_TEMPERATURE,
    MIN_TOP_P,
    SEED_RANGE,
    ToolCall,
    ToolSpec,
    ToolUse,
)

# One rule for session ids wherever they appear (body, header, path): safe in a URL path, a
# log line and a metric-free label, and bounded.
SESSION_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"
SESSION_ID_RULE = "1 to 128 characters of A-Z a-z 0-9 . _ : - starting with a letter or digit"
SESSION_ID_ERROR = f"a session id is {SESSION_ID_RULE}"
SessionId = Annotated[str, Field(pattern=SESSION_ID_PATTERN, description=SESSION_ID_RULE)]
MAX_STOP = 4  # as OpenAI
MAX_TEMPERATURE = 2.0  # as OpenAI


def nullable(schema: dict[str, Any]) -> WithJsonSchema:
    """Publish `schema` (or null) for an optional field whose rule a check enforces."""
    return WithJsonSchema({"anyOf": [schema, {"type": "null"}]})


# 0 (greedy) or at least MIN_TEMPERATURE: the engine's check (SamplingParams), stated here
TEMPERATURE_SCHEMA = {
    "anyOf": [
        {"type": "number", "minimum": 0, "maximum": 0},
        {"type": "number", "minimum": MIN_TEMPERATURE, "maximum": MAX_TEMPERATURE},
    ],
    "description": f"0 for greedy decoding, else {MIN_TEMPERATURE} to {MAX_TEMPERATURE}.",
}
STOP_STRING = {"type": "string", "minLength": 1}
STOP_SCHEMA = {
    "anyOf": [STOP_STRING, {"type": "array", "items": STOP_STRING, "maxItems": MAX_STOP}],
    "description": f"Up to {MAX_STOP} non-empty stop strings (not included in the text).",
}
# a non-empty prompt: the replica's check (check_prompt_ids); the ids' upper bound, the
# model's vocabulary, is added when the schema is served
TOKEN_ID = {"type": "integer", "minimum": 0}
PROMPT_SCHEMA = {
    "anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "items": TOKEN_ID, "minItems": 1},
    ],
    "description": "Text, or token ids of the served model's vocabulary; never empty.",
}


def check_session_id(value: str, param: str) -> str:
    """`value` if it is a valid session id, else a 400 naming `param`."""
    if not re.fullmatch(SESSION_ID_PATTERN, value):
        raise InvalidRequestError(f"{param}: {SESSION_ID_ERROR}", param=param)
    return value


class RequestBody(BaseModel):
    """A request body, typed as JSON Schema types it (the published schema's dialect):
    unknown fields and values of another JSON type (`"1"` or `true` for an integer, `0` for a
    boolean) are 400s; `1.0` is the integer 1, as JSON does not tell the two apart."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _json_integers(cls, data: Any) -> Any:
        return integral_floats_as_ints(data)


def integral_floats_as_ints(value: Any) -> Any:
    """`value` (parsed JSON) with every float that has no fraction as an int."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [integral_floats_as_ints(v) for v in value]
    if isinstance(value, dict):
        return {k: integral_floats_as_ints(v) for k, v in value.items()}
    return value


# the one rule on a structured answer's schema that a schema cannot state: it is compiled
CLOSED_RULE = (
    "An object that lists its properties takes only those keys unless the schema says what "
    "else it takes (additionalProperties, patternProperties, $ref; parts under allOf, "
    "if/then/else, not and dependentSchemas stay open, as do objects that have them)."
)
SCHEMA_RULE = (
    "A JSON schema ({} = any JSON). One the grammar engine cannot compile, or any JSON format "
    "on a model whose tokenizer cannot be constrained, is a 400 naming response_format. "
    + CLOSED_RULE
)


class JsonSchemaSpec(RequestBody):
    """OpenAI's `json_schema` object. The answer is constrained to the schema whether or not
    `strict` is set (constrained decoding: every answer that ends parses and validates)."""

    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema", description=SCHEMA_RULE)
    strict: bool | None = None


class TextFormat(RequestBody):
    type: Literal["text"]


class JsonObjectFormat(RequestBody):
    type: Literal["json_object"]


class JsonSchemaFormat(RequestBody):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[
    TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")
]
ANY_OBJECT = {"type": "object"}  # what json_object asks for


def constraint(fmt: Any) -> str | None:
    """The JSON schema text an answer in `fmt` must satisfy (None: free text)."""
    if isinstance(fmt, JsonObjectFormat):
        return json.dumps(ANY_OBJECT)
    if isinstance(fmt, JsonSchemaFormat):
        fmt = fmt.json_schema
    return json.dumps(fmt.schema_) if isinstance(fmt, JsonSchemaSpec) else None


class StreamOptions(RequestBody):
    include_usage: bool = False


class TextPart(RequestBody):
    type: Literal["text"]
    text: str


# ---- tools ----
FUNCTION_NAME = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$", description="As OpenAI: a-z A-Z 0-9 _ -")
MAX_TOOLS = 128  # as OpenAI
TOOLS_RULE = (
    "Function tools the model may call. The answer is constrained so that every call names "
    "one of them and its arguments validate against its parameters; parameters the grammar "
    "engine cannot compile are a 400 naming tools."
)


class FunctionSpec(RequestBody):
    name: str = FUNCTION_NAME
    description: str | None = None
    parameters: dict[str, Any] | None = Field(
        None,
        description="A JSON schema of the arguments object (omitted: any object). " + CLOSED_RULE,
    )
    strict: bool | None = Field(None, description="Calls always follow the schema.")

    def spec(self) -> ToolSpec:
        return ToolSpec(self.name, self.parameters or {}, self.description)


class ChatTool(RequestBody):
    type: Literal["function"]
    function: FunctionSpec


class FunctionName(RequestBody):
    name: str = FUNCTION_NAME


class NamedToolChoice(RequestBody):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def tool_use(
    tools: list[ToolSpec] | None, choice: str | None, forced: str | None, parallel: bool | None
) -> ToolUse | None:
    """A request's tools and tool choice, checked (either API's fields, made alike)."""
    if not tools:
        if forced is not None or choice == "required":
            raise InvalidRequestError("tool_choice: needs tools to choose from", "tool_choice")
        return None
    names = [t.name for t in tools]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise InvalidRequestError(f"tools: two tools are named {duplicate!r}", "tools")
    if forced is not None and forced not in names:
        raise InvalidRequestError(
            f"tool_choice: no tool is named {forced!r} (tools: {', '.join(names)})", "tool_choice"
        )
    mode = "required" if forced is not None else (choice or "auto")
    return ToolUse(tuple(tools), mode, forced, True if parallel is None else parallel)


class CallFunction(RequestBody):
    name: str
    arguments: str = Field(description="The JSON text of the arguments, as the model wrote it.")


class MessageToolCall(RequestBody):
    id: str = Field(min_length=1)
    type: Literal["function"]
    function: CallFunction


class _Message(RequestBody):
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(p.text for p in self.content)

    def wire(self) -> dict[str, Any]:
        """The message as a replica takes it (calls as `ToolCall`s)."""
        return {"role": self.role, "content": self.text()}


class SystemMessage(_Message):
    role: Literal["system", "developer"]


class UserMessage(_Message):
    role: Literal["user"]


class AssistantMessage(_Message):
    role: Literal["assistant"]
    content: str | list[TextPart] | None = Field(None, description="null beside tool_calls.")
    tool_calls: list[MessageToolCall] | None = Field(None, description="The calls it made.")

    def wire(self) -> dict[str, Any]:
        calls = [
            ToolCall(c.id, c.function.name, c.function.arguments) for c in self.tool_calls or []
        ]
        return super().wire() | ({"tool_calls": calls} if calls else {})


class ToolMessage(_Message):
    role: Literal["tool"]
    tool_call_id: str = Field(description="The id of the call this is the result of.")

    def wire(self) -> dict[str, Any]:
        return super().wire() | {"tool_call_id": self.tool_call_id}


ChatMessage = Annotated[
    SystemMessage | UserMessage | AssistantMessage | ToolMessage, Field(discriminator="role")
]


MAX_CHOICES = 16  # `n` at most: each choice holds a batch row and its KV like a request


class _SamplingFields(RequestBody):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: Annotated[float | None, nullable(TEMPERATURE_SCHEMA)] = Field(
        None, ge=0.0, le=MAX_TEMPERATURE
    )
    top_p: float | None = Field(None, ge=MIN_TOP_P, le=1.0)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, ge=MIN_REPETITION_PENALTY, le=10.0)
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: Annotated[str | list[str] | None, nullable(STOP_SCHEMA)] = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    n: int = Field(
        1,
        ge=1,
        le=MAX_CHOICES,
        description="Choices to sample, each a request of its own (with a seed, choice i "
        "samples with seed + i). A session turn takes n = 1 (its next turn continues one "
        "answer): n > 1 with a session is a 400.",
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    session_id: SessionId | None = Field(None, description="Streaming session (or the header).")
    response_format: ResponseFormat | None = Field(
        None,
        description="json_object or json_schema: the answer is constrained to it (it ends "
        "when the JSON is complete). " + SCHEMA_RULE,
    )

    @field_validator("stop")
    @classmethod
    def _at_most_four(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        return value

    def sampling_kwargs(self) -> dict[str, Any]:
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        return {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "repetition_penalty": self.repetition_penalty,
            "seed": self.seed,
            "stop": tuple(stop) if stop else None,
            "stop_token_ids": tuple(self.stop_token_ids) if self.stop_token_ids else None,
            "ignore_eos": self.ignore_eos,
            "json_schema": constraint(self.response_format),
        }


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[ChatTool] | None = Field(None, max_length=MAX_TOOLS, description=TOOLS_RULE)
    tool_choice: ToolChoice | None = Field(
        None,
        description="none (text only), auto (text or calls; the default with tools), "
        "required (calls only), or a function that must be called. Naming a function "
        "that is not in tools, or choosing without tools, is a 400.",
    )
    parallel_tool_calls: bool | None = Field(None, description="More than one call (default).")

    def tool_use(self) -> ToolUse | None:
        choice = self.tool_choice
        forced = choice.function.name if isinstance(choice, NamedToolChoice) else None
        mode = choice if isinstance(choice, str) else None
        tools = [t.function.spec() for t in self.tools or []]
        return tool_use(tools, mode, forced, self.parallel_tool_calls)

    def sampling_kwargs(self) -> dict[str, Any]:
        kw = super().sampling_kwargs()
        kw["max_tokens"] = self.max_completion_tokens or self.max_tokens
        kw["logprobs"] = self.logprobs
        kw["top_logprobs"] = self.top_logprobs
        return kw


class CompletionRequest(_SamplingFields):
    prompt: Annotated[str | list[int], WithJsonSchema(PROMPT_SCHEMA)]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: Annotated[bool, WithJsonSchema({"const": False})] = Field(
        False, description="Not supported: only false is accepted."
    )

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        if value:  # Literal[False] would let 0 through: 0 == False
            raise ValueError("not supported: only false is accepted")
        return value

    def sampling_kwargs(self) -> dict[str, Any]:
        kw = super().sampling_kwargs()
        if self.logprobs is not None:
            kw["logprobs"], kw["top_logprobs"] = True, self.logprobs
        return kw


class SessionCreate(RequestBody):
    session_id: SessionId | None = Field(None, description="Omit it for a server-made id.")
    ttl_s: float | None = Field(
        None, ge=1.0, le=30 * 86400, description="Idle seconds before the session expires."
    )


class SessionMigrate(RequestBody):
    target_replica: str | None = Field(
        None,
        max_length=128,
        description="The replica id to move to (as `session.replica` reports it), not the "
        "one the session is on (400); omitted: the other replica with the most free KV.",
    )


class SessionMigration(BaseModel):
    id: str
    object: Literal["session.migration"] = "session.migration"
    source: str = Field(description="The replica the session left.")
    target: str = Field(description="The replica that holds it now.")
    kv: Literal["pool", "host", "none"] = Field(
        description="Where its KV went: the target's pool, its host tier (no room), or "
        "nowhere (the next turn re-prefills the history)."
    )
    kv_bytes: int
    history_tokens: int
    seconds: float


class SessionView(BaseModel):
    id: str
    object: Literal["session"] = "session"
    replica: str | None
    turns: int
    history_tokens: int
    held_tokens: int | None
    ttl_s: float | None
    history: list[int] | None = Field(
        None, description="The token log; only with ?include_history=true."
    )


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error body: every non-2xx answer of the API has this shape."""

    error: ErrorDetail


def now() -> int:
    return int(time.time())
