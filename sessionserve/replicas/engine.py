"""The replica's engine: the step loop and the in-process API (no Ray needed).

    batch = scheduler.schedule()                 # admission, chunked prefill, retraction
    drafts = speculative.propose(batch)          # EAGLE chains (with a drafter)
    output = runner.run(batch, drafts)           # inputs, forward, sampling
    speculative.verify(batch, drafts, output)    # accepted drafts, their KV committed
    updates = scheduler.process(batch, output)   # commit, stop, catch-up, finish
    -> events to listeners; the memory check per the `memory_check` policy

Thread model: every public method takes `self.lock`, so in-process callers may call `submit`,
`abort` and the session calls from one thread while another runs `step()`; KV state is only
ever touched under the lock. The served replica (server.py) goes further: only its engine
thread calls the engine (other calls arrive as queued commands), so the lock is never
contended there and the replica's event loop never waits for a forward. Listeners are called
after the lock is released.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from sessionserve.cache import CheckSchedule, MemoryChecker, MemoryTerms
from sessionserve.cache.request_kv import RequestKV
from sessionserve.cache.session_cache import TurnMode
from sessionserve.config import EngineConfig
from sessionserve.errors import InvalidRequestError
from sessionserve.metrics import EngineMetrics
from sessionserve.replicas.assembly import build_cache, build_runner, context_limit
from sessionserve.replicas.loader import LoadedModel, eos_token_ids, load_model
from sessionserve.replicas.request import (
    Request,
    RequestResult,
    TokenLogprob,
    check_context,
    check_prompt_ids,
)
from sessionserve.replicas.scheduler import Scheduler, SeqUpdate
from sessionserve.replicas.sessions import (
    SessionController,
    SessionExport,
    SessionInfo,
    SessionSeed,
)
from sessionserve.replicas.speculative.drafter import EagleDrafter
from sessionserve.replicas.speculative.stats import SpecStats
from sessionserve.replicas.stopping import StopChecker, answer_text
from sessionserve.wire import FinishReason, SamplingParams

log = logging.getLogger(__name__)
Listener = Callable[["StepEvent"], None]
_rid_counter = itertools.count(1)


@dataclass(frozen=True)
class StepEvent:
    rid: str
    new_token_ids: list[int]
    result: RequestResult | None = None  # set on the request's last event
    new_logprobs: list[TokenLogprob] = field(default_factory=list)  # when requested
    text: str | None = None  # the answer's text so far, where the engine decodes it anyway
    # (stop strings): the replica shim then streams it instead of decoding a second time


class Engine:
    def __init__(
        self,
        config: EngineConfig | None = None,
        loaded: LoadedModel | None = None,
        metrics: EngineMetrics | None = None,
        drafter: EagleDrafter | None = None,
    ):
        """`drafter`: an EAGLE head already attached to the model (tests build one in memory);
        otherwise `config.spec.drafter_path` is loaded when set."""
        self.config = cfg = config or EngineConfig()
        if cfg.model.torch_threads:
            torch.set_num_threads(cfg.model.torch_threads)
        self.loaded = loaded or load_model(
            cfg.model.path, cfg.model.torch_dtype(), cfg.model.device
        )
        model, self.tokenizer = self.loaded.model, self.loaded.tokenizer
        self.model_name = cfg.model.served_name or self.loaded.name
        self.vocab_size = model.config.vocab_size
        self.metrics = metrics or EngineMetrics()
        self.cache = build_cache(cfg)
        # metrics are looked up at each verify: the served replica swaps in its exporter later
        on_verify = lambda n: self.metrics.on_spec_step(n)  # noqa: E731
        self.runner, self.speculative = build_runner(cfg, model, self.cache, on_verify, drafter)
        self.context_limit = context_limit(cfg, self.cache)
        self.stopper = StopChecker(self.tokenizer, cfg.cache.max_context_len)
        self.scheduler = Scheduler(self.cache, cfg.scheduler, self.stopper, self.speculative)
        self.sessions = SessionController(self.cache, cfg.sessions)
        self.checker = MemoryChecker(self.cache)
        self.check_schedule = CheckSchedule(cfg.memory_check, cfg.memory_check_period_s)
        self.eos_ids = eos_token_ids(model, self.tokenizer)
        self.requests: dict[str, Request] = {}
        self.listeners: dict[str, Listener] = {}
        self.results: dict[str, RequestResult] = {}
        self.generator = torch.Generator().manual_seed(0)
        self.lock = threading.RLock()
        self._last_reap = time.monotonic()

    @property
    def spec_stats(self) -> SpecStats:
        """Speculation figures (all zero without a drafter)."""
        return self.speculative.stats if self.speculative else SpecStats()

    # ---- sessions ----
    def open_session(self, session_id: str | None = None, ttl_s: float | None = None) -> str:
        with self.lock:
            return self.sessions.open(session_id, ttl_s)

    def close_session(self, session_id: str) -> bool:
        with self.lock:
            return self.sessions.close(session_id)

    def session_info(self, session_id: str) -> SessionInfo:
        with self.lock:
            return self.sessions.info(session_id)

    def park_session(self, session_id: str) -> bool:
        """Move an idle session's KV to the host tier now (True if kept there)."""
        with self.lock:
            return self.cache.park(session_id)

    def export_session(self, session_id: str) -> SessionExport:
        """An idle session's token log and KV, ready to leave this process."""
        with self.lock:
            export = self.sessions.export(session_id)
        if self.runner.device.type == "cuda":  # the device -> pinned host copies landed
            torch.cuda.synchronize(self.runner.device)
        return export

    def import_session(self, export: SessionExport) -> str:
        """Take over a session another replica exported; returns where its KV went."""
        with self.lock:
            return self.sessions.adopt(export)

    def idle_sessions(self) -> list[str]:
        """Open sessions with no turn in flight, most recently used first."""
        with self.lock:
            slots = [s for s in self.cache.session_slots.values() if s.turn_rid is None]
            return [s.session_id for s in sorted(slots, key=lambda s: -s.last_used)]

    # ---- requests ----
    def submit(
        self,
        input_ids: list[int],
        sampling: SamplingParams | None = None,
        *,
        session_id: str | None = None,
        mode: TurnMode = "append",
        rid: str | None = None,
        listener: Listener | None = None,
        open_missing: SessionSeed | None = None,
    ) -> str:
        """Queue a request; returns its id. Raises a typed error, changing nothing, on bad
        input, a busy or closing session, or an input beyond the context. `open_missing` opens
        a session this replica does not hold, from its TTL and token log (the served app's
        ingress has already checked it exists)."""
        sampling = sampling or SamplingParams()
        rid = rid or f"req-{next(_rid_counter)}"
        check_prompt_ids(input_ids, self.vocab_size)
        with self.lock:
            if rid in self.requests:
                raise InvalidRequestError(f"request id {rid!r} is already in use", param="rid")
            if session_id is None:
                kv, full = RequestKV(rid=rid), list(input_ids)
            else:
                kv, full = self.sessions.start_turn(
                    session_id, rid, list(input_ids), mode, open_missing
                )
            try:  # anything raising from here on (a bad seed too) must end the turn
                check_context(full, sampling, self.context_limit)
                gen = self.generator
                if sampling.seed is not None:
                    gen = torch.Generator().manual_seed(sampling.seed)
                req = Request(rid, full, sampling, kv, mode, self.eos_ids, generator=gen)
            except Exception:
                if session_id is not None:  # pre-abort: the turn ends, the slot is untouched
                    self.cache.abort(kv)
                    self.sessions.turn_ended(session_id, success=False)
                raise
            self.requests[rid] = req
            if listener is not None:
                self.listeners[rid] = listener
            self.scheduler.add(req)
        return rid

    def abort(self, rid: str, message: str = "aborted") -> bool:
        """Abort in any phase; False if the request already finished. Session turns keep what
        is committed (the session continues from its last successful turn)."""
        with self.lock:
            req = self.requests.get(rid)
            if req is None:
                return False
            phase = "decode" if req.sampled else ("prefill" if req.kv.is_live else "queued")
            self.scheduler.release(req)
            req.finish_reason, req.finish_message = FinishReason.ABORT, message
            self.metrics.on_abort(phase)
            event = self._close(req, success=False)
        self._dispatch([event])
        return True

    def take_result(self, rid: str) -> RequestResult:
        """The result of a finished request submitted without a listener (kept until taken)."""
        with self.lock:
            return self.results.pop(rid)

    # ---- the loop ----
    def step(self) -> list[StepEvent]:
        with self.lock:
            self.reap_expired_sessions()
            batch = self.scheduler.schedule()
            events = []
            if batch:
                drafts = self.speculative.propose(batch) if self.speculative else {}
                output = self.runner.run(batch, drafts, want_hidden=self.speculative is not None)
                if self.speculative:
                    self.speculative.verify(batch, drafts, output)
                events = [self._event(u) for u in self.scheduler.process(batch, output)]
            if self.check_schedule.due():
                self.check_memory()
            if self.metrics.gauges_due():
                self.report_gauges()
        self._dispatch(events)
        return events

    def reap_expired_sessions(self) -> None:
        """Close sessions idle past their TTL (at most once a second; every step calls it,
        and so does the served replica's engine thread while it has no work)."""
        with self.lock:
            now = time.monotonic()
            if now - self._last_reap < 1.0:
                return
            self._last_reap = now
            for sid in self.sessions.reap_expired():
                log.info("session %s idle past its TTL: closed", sid)

    def check_memory(self) -> MemoryTerms:
        """The memory invariant now: the busy form over the live batch, or the idle form
        (rows too; no slot may claim a borrower) when nothing is queued or running."""
        with self.lock:
            if self.scheduler.has_work():
                return self.checker.check_busy([r.kv for r in self.scheduler.live()])
            return self.checker.check_idle()

    def report_gauges(self) -> None:
        """Export the memory checker's terms and the queue figures (also checks the invariant,
        in any mode: a broken one raises here)."""
        with self.lock:
            terms = self.check_memory()
            tier = self.cache.host_tier
            while tier is not None and tier.restore_seconds:
                self.metrics.on_restore(tier.restore_seconds.popleft())
            self.metrics.on_step(
                terms,
                gauges={
                    "running_requests": terms.live_requests,
                    "queued_requests": len(self.scheduler.waiting),
                    "open_sessions": len(self.cache.session_slots),
                    "host_tier_bytes": terms.host_bytes,
                    "host_tier_sessions": terms.host_sessions,
                },
                counter_totals={
                    "memory_checks": self.checker.checks,
                    "memory_check_failures": self.checker.failures,
                    "retractions": self.scheduler.retractions_total,
                    "session_evictions": self.cache.evicted_sessions_total,
                    "spec_drafted_tokens": self.spec_stats.drafted,
                    "spec_accepted_tokens": self.spec_stats.accepted,
                    **(tier.totals() if tier is not None else {}),
                },
            )

    def has_work(self) -> bool:
        with self.lock:
            return self.scheduler.has_work()

    def run_until_idle(self, max_steps: int = 1_000_000) -> None:
        for _ in range(max_steps):
            if not self.has_work():
                return
            self.step()
        raise RuntimeError(f"engine still busy after {max_steps} steps")

    def generate(
        self, inputs: list[list[int]], sampling: SamplingParams | None = None, **kwargs: Any
    ) -> list[RequestResult]:
        """Submit every input (same options), run to completion, return results in order."""
        rids = [self.submit(ids, sampling, **kwargs) for ids in inputs]
        self.run_until_idle()
        return [self.take_result(r) for r in rids]

    # ---- internals ----
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
        self.scheduler.release(req)  # a no-op unless closing the finished request raised
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
            self.sessions.turn_ended(req.session_id, success)
        self.requests.pop(req.rid, None)
        result = RequestResult.of(req, answer_text(self.tokenizer, req) if text is None else text)
        self.metrics.on_finish(result)
        if req.rid not in self.listeners:  # a listener gets it in its last event instead
            self.results[req.rid] = result
        return StepEvent(req.rid, [], result)

    def _dispatch(self, events: list[StepEvent]) -> None:
        for e in events:
            listener = self.listeners.get(e.rid)
            if listener is not None:
                if e.result is not None:
                    self.listeners.pop(e.rid, None)
                listener(e)
