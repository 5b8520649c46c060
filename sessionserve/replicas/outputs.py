"""Where a request's output goes: step events to its listener, a result kept until taken, and
the end of a request (its session turn closed, its metrics recorded), whichever way it ends.

The engine registers each submitted request here and hands every step's `SeqUpdate`s in; this
is the one place a request leaves the engine, so a finished, failed or aborted request always
ends its session turn exactly once and never lingers in `requests`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sessionserve.metrics import EngineMetrics
from sessionserve.replicas.request import Request, RequestResult, TokenLogprob
from sessionserve.replicas.sessions import SessionController
from sessionserve.replicas.step import SeqUpdate
from sessionserve.replicas.stopping import answer_text
from sessionserve.wire import FinishReason

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepEvent:
    rid: str
    new_token_ids: list[int]
    result: RequestResult | None = None  # set on the request's last event
    new_logprobs: list[TokenLogprob] = field(default_factory=list)  # when requested
    text: str | None = None  # the answer's text so far, where the engine decodes it anyway
    # (stop strings): the replica shim then streams it instead of decoding a second time


Listener = Callable[[StepEvent], None]


class OutputProcessor:
    def __init__(
        self,
        tokenizer: Any | None,
        sessions: SessionController,
        release: Callable[[Request], None],
        metrics: EngineMetrics,
    ) -> None:
        """`release` gives a request's KV back (the scheduler's one abort/fail path)."""
        self.tokenizer = tokenizer
        self.sessions = sessions
        self.release = release
        self.metrics = metrics
        self.requests: dict[str, Request] = {}  # submitted and not yet ended
        self.listeners: dict[str, Listener] = {}
        self.results: dict[str, RequestResult] = {}  # ended, no listener, not yet taken

    def add(self, req: Request, listener: Listener | None) -> None:
        self.requests[req.rid] = req
        if listener is not None:
            self.listeners[req.rid] = listener

    def take(self, rid: str) -> RequestResult:
        return self.results.pop(rid)

    def events(self, updates: list[SeqUpdate]) -> list[StepEvent]:
        return [self._event(u) for u in updates]

    def abort(self, rid: str, message: str) -> StepEvent | None:
        """End a request in any phase (None: it had already ended)."""
        req = self.requests.get(rid)
        if req is None:
            return None
        phase = "decode" if req.sampled else ("prefill" if req.kv.is_live else "queued")
        self.release(req)
        req.finish_reason, req.finish_message = FinishReason.ABORT, message
        self.metrics.on_abort(phase)
        return self._close(req, success=False)

    def dispatch(self, events: list[StepEvent]) -> None:
        """Call the listeners (outside the engine's lock); a result event is a listener's last."""
        for e in events:
            listener = self.listeners.get(e.rid)
            if listener is not None:
                if e.result is not None:
                    self.listeners.pop(e.rid, None)
                listener(e)

    def _event(self, u: SeqUpdate) -> StepEvent:
        """A request's step update as its listener sees it; a finished one carries its result."""
        if u.error is not None:
            return self._fail(u.req, u.error)
        if not u.finished:
            text = u.req.stop_text.text if u.req.stop_text is not None else None
            return StepEvent(u.req.rid, u.new_tokens, None, u.new_logprobs, text)
        try:
            result = self._close(u.req, success=True).result
        except Exception as e:
            return self._fail(u.req, e)
        return StepEvent(u.req.rid, u.new_tokens, result, u.new_logprobs)

    def _fail(self, req: Request, exc: Exception) -> StepEvent:
        """End one request whose own sampling, stop check or finish raised (the scheduler has
        given its KV back, as for an abort): its caller gets an error result, and the step,
        the batch and the replica go on."""
        log.error("request %s failed and was stopped alone: %r", req.rid, exc, exc_info=exc)
        self.release(req)  # a no-op unless closing the finished request raised
        req.finish_reason = FinishReason.ERROR
        req.finish_message = (
            f"generating this request failed on the replica ({type(exc).__name__}); it was "
            "stopped alone and its KV freed; retry it"
        )
        self.metrics.on_abort("decode" if req.sampled else "prefill")
        return self._close(req, success=False, text="")

    def _close(self, req: Request, success: bool, text: str | None = None) -> StepEvent:
        req.timings.finished = time.monotonic()
        if req.session_id is not None and req.rid in self.requests:
            backlog, req.drafting.deferred = req.drafting.deferred, None  # the session's now
            self.sessions.turn_ended(req.session_id, success, backlog)
        self.requests.pop(req.rid, None)
        result = RequestResult.of(req, answer_text(self.tokenizer, req) if text is None else text)
        self.metrics.on_finish(result)
        if req.rid not in self.listeners:  # a listener gets it in its last event instead
            self.results[req.rid] = result
        return StepEvent(req.rid, [], result)
