"""Request (what the scheduler sees), its timings, and the result a request ends with.
SamplingParams and FinishReason are the wire's (`sessionserve/wire.py`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from sessionserve.cache.request_kv import RequestKV
from sessionserve.errors import ContextTooLongError, InvalidRequestError
from sessionserve.replicas.detokenize import IncrementalText
from sessionserve.replicas.speculative.draft_state import Drafting, DraftState
from sessionserve.replicas.speculative.stats import SpecStats
from sessionserve.wire import FinishReason, SamplingParams


@dataclass
class Timings:
    # when the request reached the replica: `Engine.submit`, or earlier where the caller says
    # (`arrived_at`: a served request's wait for the engine thread counts)
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
    log_base: int = 0  # a session turn: the positions of its token log it keeps
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
    # the EAGLE head's draws for a sampled request: apart from `generator`, because the head
    # draws while a step is caught up on the engine thread and, under overlap scheduling, the
    # next step may be sampling on the forward thread at that moment: two threads drawing from
    # one generator would make a seeded answer depend on their timing
    draft_generator: torch.Generator | None = None
    timings: Timings = field(default_factory=Timings)
    draft: DraftState | None = None  # the drafter's next guess (speculative decoding)
    drafting: Drafting = field(default_factory=Drafting)  # draft sources, history log
    spec: SpecStats = field(default_factory=SpecStats)
    grammar: Any = None  # the JSON schema's matcher (replicas/grammar.py): masks each sample
    # overlap scheduling (the scheduler's): the latest scheduled step not yet processed that
    # computes for this request, the end of what it computes, and whether it samples a token
    inflight_step: int | None = None
    inflight_end: int = 0
    inflight_samples: bool = False

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

    def token_at(self, i: int) -> int:
        """`tokens[i]` without building the whole history."""
        n = len(self.input_ids)
        return self.input_ids[i] if i < n else self.output_ids[i - n]

    def token_slice(self, start: int, end: int) -> list[int]:
        """`tokens[start:end]` without building the whole history."""
        n = len(self.input_ids)
        if start >= n:
            return self.output_ids[start - n : end - n]
        return self.input_ids[start:end] + self.output_ids[: max(0, end - n)]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def pending_tokens(self) -> int:
        """Tokens a step in flight samples for it that are not appended yet (0 or 1)."""
        return int(self.inflight_step is not None and self.inflight_samples)

    @property
    def overlappable(self) -> bool:
        """Its next step can be scheduled before its last token is known: sampling reads no
        history (penalties) and no grammar state the pending token would change."""
        return self.grammar is None and not self.sampling.has_penalties


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
    input_ids: list[int] = field(default_factory=list)  # the whole input, history included
    log_base: int = 0  # a session turn: its token log's positions it kept (the rest is new)

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
            input_ids=list(req.input_ids),
            log_base=req.log_base,
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
