"""Request, SamplingParams, FinishReason and the result a request ends with."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from sessionserve.cache.request_kv import RequestKV
from sessionserve.errors import SessionServeError
from sessionserve.replicas.detokenize import IncrementalText
from sessionserve.replicas.speculative.draft_state import DraftState
from sessionserve.replicas.speculative.stats import SpecStats


class InvalidRequestError(SessionServeError, ValueError):
    """Bad input from a client; `param` names the offending field (OpenAI's error shape)."""

    status_code = 400
    error_type = "invalid_request_error"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ContextTooLongError(InvalidRequestError):
    pass


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # client disconnect, explicit abort, shutdown
    ERROR = "error"  # this request's own sampling, stop check or finish failed (it alone)


MIN_TEMPERATURE = 1e-4  # logits / T must stay finite in float32


class SamplingParams(BaseModel):
    """Validated sampling knobs. temperature 0 means greedy."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_tokens: int = Field(256, ge=1, description="Tokens to generate at most.")
    # Bounds keep the arithmetic finite: a top_p, temperature or repetition penalty near zero
    # underflows in float32 and turns every probability into NaN.
    temperature: float = Field(1.0, ge=0.0, le=10.0, description="0 = greedy.")
    top_p: float = Field(1.0, ge=1e-8, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens; 0 = off.")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="Drop tokens below min_p * p_max.")
    repetition_penalty: float = Field(1.0, ge=0.01, le=10.0, description="HF-style, 1 = off.")
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="OpenAI-style.")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="OpenAI-style.")
    seed: int | None = Field(
        None, ge=-(2**63), le=2**64 - 1, description="Same seed, same output (64-bit)."
    )
    stop: tuple[str, ...] = Field((), description="Stop strings (not included in the text).")
    stop_token_ids: tuple[int, ...] = Field((), description="Token ids that end the answer.")
    ignore_eos: bool = Field(False, description="Keep generating past EOS.")
    logprobs: bool = Field(False, description="Return the sampled tokens' logprobs.")
    top_logprobs: int = Field(0, ge=0, le=20, description="Alternatives per position.")

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


@dataclass
class Timings:
    arrival: float = field(default_factory=time.monotonic)
    scheduled: float | None = None  # first admitted into a batch
    first_token: float | None = None
    finished: float | None = None

    @property
    def queue_s(self) -> float:
        return (self.scheduled or self.arrival) - self.arrival

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def decode_s(self) -> float | None:
        if self.first_token is None or self.finished is None:
            return None
        return self.finished - self.first_token


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(eq=False)
class Request:
    """One generation request as the scheduler sees it (a session turn or a plain request)."""

    rid: str
    input_ids: list[int]  # the whole input: for a session turn, history + new input
    sampling: SamplingParams
    kv: RequestKV
    mode: Literal["append", "chat"] = "append"
    eos_token_ids: frozenset[int] = frozenset()
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    finish_message: str | None = None
    finished_len: int | None = None  # output tokens that belong to the answer
    sampled: bool = False  # input computed and a token pending: ready to decode
    stop_checked: int = 0  # output tokens the stop checker has seen
    stop_text: IncrementalText | None = None  # the answer's text, for stop strings
    cached_tokens: int = 0  # reused at first admission (what usage reports)
    cached_source: str = "none"
    retractions: int = 0
    generator: torch.Generator | None = None
    timings: Timings = field(default_factory=Timings)
    draft: DraftState | None = None  # the drafter's next guess (speculative decoding)
    spec: SpecStats = field(default_factory=SpecStats)

    @property
    def session_id(self) -> str | None:
        return self.kv.session_id

    @property
    def tokens(self) -> list[int]:
        """Input and output (a new list: use `num_tokens` / `token_slice` on hot paths)."""
        return self.input_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        """`tokens[start:end]` without building the whole history."""
        n = len(self.input_ids)
        if start >= n:
            return self.output_ids[start - n : end - n]
        return self.input_ids[start:end] + self.output_ids[: max(0, end - n)]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class RequestResult:
    """What a finished request reports (the API's `usage` and `choices` come from this)."""

    rid: str
    session_id: str | None
    output_ids: list[int]
    text: str | None
    finish_reason: FinishReason
    finish_message: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cached_source: str  # "session", "radix" or "none"
    logprobs: list[TokenLogprob]
    queue_s: float
    ttft_s: float | None
    decode_s: float | None
    retractions: int
    spec_drafted: int = 0  # speculative tokens proposed for this request
    spec_accepted: int = 0  # of which the target accepted
    spec_steps: int = 0  # verify steps (mean acceptance length = (accepted + steps) / steps)

    @classmethod
    def of(cls, req: Request, text: str | None) -> RequestResult:
        t = req.timings
        return cls(
            rid=req.rid,
            session_id=req.session_id,
            output_ids=list(req.output_ids),
            text=text,
            finish_reason=req.finish_reason,
            finish_message=req.finish_message,
            prompt_tokens=len(req.input_ids),
            completion_tokens=len(req.output_ids),
            cached_tokens=req.cached_tokens,
            cached_source=req.cached_source,
            logprobs=list(req.logprobs),
            queue_s=t.queue_s,
            ttft_s=t.ttft_s,
            decode_s=t.decode_s,
            retractions=req.retractions,
            spec_drafted=req.spec.drafted,
            spec_accepted=req.spec.accepted,
            spec_steps=req.spec.steps,
        )


def check_prompt_ids(ids: list[int], vocab_size: int) -> None:
    if not ids:
        raise InvalidRequestError("the prompt is empty: send at least one token", "prompt")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(
            f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})", "prompt"
        )


def check_context(full: list[int], sampling: SamplingParams, limit: int) -> None:
    """`full` (a session's history included) and max_tokens must fit the context."""
    want = len(full) + sampling.max_tokens
    if want > limit:
        raise ContextTooLongError(
            f"this model's maximum context length is {limit} tokens; the request needs "
            f"{len(full)} input tokens (the session history included) + max_tokens "
            f"{sampling.max_tokens} = {want}. Shorten the input, lower max_tokens, or "
            "start a new session",
            param="max_tokens" if len(full) < limit else "messages",
        )
