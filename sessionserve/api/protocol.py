"""Request and response models of the HTTP API (OpenAI's shapes, plus sessions).

Unknown fields are rejected (400 naming the field), as OpenAI does. Field names follow OpenAI;
`session_id` may also come in a header (`x-session-id` by default).
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from sessionserve.errors import InvalidRequestError

# One rule for session ids wherever they appear (body, header, path): safe in a URL path, a
# log line and a metric-free label, and bounded.
SESSION_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"
SESSION_ID_RULE = "1 to 128 characters of A-Z a-z 0-9 . _ : - starting with a letter or digit"
SessionId = Annotated[str, Field(pattern=SESSION_ID_PATTERN, description=SESSION_ID_RULE)]
MAX_STOP = 4  # as OpenAI


def check_session_id(value: str, param: str) -> str:
    """`value` if it is a valid session id, else a 400 naming `param`."""
    if not re.fullmatch(SESSION_ID_PATTERN, value):
        raise InvalidRequestError(f"{param}: a session id is {SESSION_ID_RULE}", param=param)
    return value


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Body):
    include_usage: bool = False


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class _SamplingFields(_Body):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    n: int = Field(1, ge=1, le=1, description="Only n=1 is supported.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    session_id: SessionId | None = Field(None, description="Streaming session (or the header).")

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
        }


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    def sampling_kwargs(self) -> dict[str, Any]:
        kw = super().sampling_kwargs()
        kw["max_tokens"] = self.max_completion_tokens or self.max_tokens
        kw["logprobs"] = self.logprobs
        kw["top_logprobs"] = self.top_logprobs
        return kw


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] = Field(description="Text, or token ids.")
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: Literal[False] = Field(False, description="Not supported: only false is accepted.")

    def sampling_kwargs(self) -> dict[str, Any]:
        kw = super().sampling_kwargs()
        if self.logprobs is not None:
            kw["logprobs"], kw["top_logprobs"] = True, self.logprobs
        return kw


class SessionCreate(_Body):
    session_id: SessionId | None = Field(None, description="Omit it for a server-made id.")
    ttl_s: float | None = Field(
        None, ge=1.0, le=30 * 86400, description="Idle seconds before the session expires."
    )


class SessionMigrate(_Body):
    target_replica: str | None = Field(
        None,
        max_length=128,
        description="The replica id to move to (as `session.replica` reports it); omitted: "
        "the other replica with the most free KV.",
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


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())
