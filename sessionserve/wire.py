"""The typed boundary between the ingress and a replica: what a request asks for
(`GenerateCall`, `SamplingParams`), what streams back (`TurnDelta`s, then one `TurnResult`) and
how it can end (`FinishReason`; errors are the typed ones of `errors.py`). No torch import: the
ingress imports this module (and errors.py), never the replica's, so an ingress process does
not load torch or transformers.
"""

from __future__ import annotations

import enum
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from sessionserve.errors import InvalidRequestError


def new_id(prefix: str) -> str:
    """An id for an API object (response, message, call): `prefix-` and 24 hex digits."""
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # client disconnect, explicit abort, shutdown
    ERROR = "error"  # this request's own sampling, stop check or finish failed (it alone)


# Bounds that keep the arithmetic finite: a top_p, temperature or repetition penalty near zero
# underflows in float32 and turns every probability into NaN. The HTTP schema publishes them.
MIN_TEMPERATURE = 1e-4  # logits / T must stay finite in float32
MIN_TOP_P = 1e-8
MIN_REPETITION_PENALTY = 0.01
SEED_RANGE = (-(2**63), 2**64 - 1)  # a 64-bit seed, signed or not


class SamplingParams(BaseModel):
    """Validated sampling knobs. temperature 0 means greedy."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_tokens: int = Field(256, ge=1, description="Tokens to generate at most.")
    temperature: float = Field(1.0, ge=0.0, le=10.0, description="0 = greedy.")
    top_p: float = Field(1.0, ge=MIN_TOP_P, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens; 0 = off.")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="Drop tokens below min_p * p_max.")
    repetition_penalty: float = Field(
        1.0, ge=MIN_REPETITION_PENALTY, le=10.0, description="HF-style, 1 = off."
    )
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="OpenAI-style.")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="OpenAI-style.")
    seed: int | None = Field(
        None, ge=SEED_RANGE[0], le=SEED_RANGE[1], description="Same seed, same output (64-bit)."
    )
    stop: tuple[str, ...] = Field((), description="Stop strings (not included in the text).")
    stop_token_ids: tuple[int, ...] = Field((), description="Token ids that end the answer.")
    ignore_eos: bool = Field(False, description="Keep generating past EOS.")
    logprobs: bool = Field(False, description="Return the sampled tokens' logprobs.")
    top_logprobs: int = Field(0, ge=0, le=20, description="Alternatives per position.")
    json_schema: str | None = Field(
        None,
        description="Constrain the answer to JSON valid for this schema (its text); "
        "the answer ends when the JSON is complete.",
    )
    lark_grammar: str | None = Field(
        None,
        description="Constrain the answer to this grammar (llguidance's Lark dialect; a "
        "replica builds it for tool calls, the JSON answer's schema inside it).",
    )

    @field_validator("temperature")
    @classmethod
    def _finite_temperature(cls, value: float) -> float:
        if 0.0 < value < MIN_TEMPERATURE:
            raise ValueError(f"use 0 for greedy decoding, or at least {MIN_TEMPERATURE}")
        return value

    @model_validator(mode="after")
    def _check(self) -> SamplingParams:
        if self.top_logprobs and not self.logprobs:
            object.__setattr__(self, "logprobs", True)
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.json_schema is not None and self.lark_grammar is not None:
            raise ValueError("json_schema and lark_grammar exclude each other")
        return self

    @classmethod
    def build(cls, **kwargs: object) -> SamplingParams:
        """Validate, turning pydantic's error into an InvalidRequestError naming the field."""
        try:
            return cls(**{k: v for k, v in kwargs.items() if v is not None})
        except ValidationError as e:
            err = e.errors()[0]
            param = ".".join(str(x) for x in err["loc"]) or None
            raise InvalidRequestError(f"{param}: {err['msg']}", param=param) from None

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )


@dataclass(frozen=True)
class ToolSpec:
    """A function the model may call (OpenAI's function tool, either API's shape)."""

    name: str
    parameters: dict[str, Any]  # a JSON schema of the arguments object
    description: str | None = None


@dataclass(frozen=True)
class ToolUse:
    """A request's tools and how they may be used: `choice` "none" (the model knows the tools
    but answers in text), "auto" (text or calls), "required" (calls only; `function` names
    the one it must call)."""

    tools: tuple[ToolSpec, ...]
    choice: Literal["none", "auto", "required"] = "auto"
    function: str | None = None
    parallel: bool = True  # more than one call in an answer


@dataclass(frozen=True)
class ToolCall:
    """A call the model made: `arguments` is the JSON text it wrote (an object)."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of a call while it streams: the first of call `index` carries its id and name,
    the rest add to its arguments text (OpenAI's `delta.tool_calls` element)."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


@dataclass
class GenerateCall:
    """What the ingress sends a replica for one request. `sampling` is validated once, where
    the call is made (a dict of SamplingParams' fields is, on construction: in-process
    callers and tests); the replica takes it as it is."""

    sampling: SamplingParams
    session_id: str | None = None
    mode: Literal["append", "chat"] = "append"
    # chat: the whole conversation; OpenAI's message fields, a tool call as a ToolCall
    messages: list[dict[str, Any]] | None = None
    tool_use: ToolUse | None = None
    prompt: str | list[int] | None = None  # completions: text or ids (appended in a session)
    # append mode: the session's failover log in the directory, its length on every turn,
    # the log itself only for a replica that asks for it (SessionLogNeededError)
    log_tokens: int = 0
    history_ids: list[int] | None = None
    rid: str | None = None
    ttl_s: float | None = None  # the session's idle TTL, for a replica that opens it
    # the Ray actor name of the ingress replica that sent it: the replica aborts the turn if
    # that process dies (replicas/caller_watch.py); None: a caller that cannot die apart
    caller: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.sampling, dict):
            self.sampling = SamplingParams.build(**self.sampling)


LogprobEntry = tuple[str, float, list[tuple[str, float]]]  # token text, logprob, top-n


@dataclass
class TurnDelta:
    """New tokens of a running request and their text (a tail that may still become a stop
    string is held back, so the deltas always add up to a prefix of the answer)."""

    token_ids: list[int]
    text: str  # the answer's text (with tools: its content, the calls apart)
    logprobs: list[LogprobEntry] = field(default_factory=list)  # when asked for
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


@dataclass
class TurnResult:
    """A request's last message: how it ended, its usage, and what the session's token log
    becomes: the log before the turn cut at `log_base`, then `log_tail` (the turn's new
    input and its answer: what the ingress commits to the directory, O(new tokens))."""

    finish_reason: str  # a FinishReason value, or "tool_calls" (the answer made calls)
    finish_message: str | None
    text: str | None  # the whole answer (with tools: its content, the calls apart)
    output_ids: list[int]
    prompt_tokens: int  # the whole input, a session's history included
    completion_tokens: int
    cached_tokens: int
    cached_source: str  # "session", "radix", "host" or "none"
    log_base: int
    log_tail: list[int]
    spec_drafted: int = 0
    spec_accepted: int = 0
    ttft_s: float | None = None
    replica: str | None = None  # who answered (the ingress adds its own id)
    ingress: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)

    @property
    def log_len(self) -> int:
        """The session's token log's length after the turn."""
        return self.log_base + len(self.log_tail)
