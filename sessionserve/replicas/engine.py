"""The replica's engine: the step loop and the in-process API (no Ray needed).

    batch = scheduler.schedule()                 # admission, chunked prefill, retraction
    drafts = speculative.propose(batch)          # EAGLE / history drafts (when speculating)
    output = runner.run_prepared(batch, *runner.prepare(batch, drafts))  # forward, sampling
    speculative.verify(batch, drafts, output)    # accepted drafts, their KV committed
    updates = scheduler.process(batch, output)   # commit, append, stop checks
    speculative.catch_up(batch, output, updates) # the EAGLE head over what was committed
    events <- scheduler.finish(updates)          # trim, save the KV, end
    speculative.finish_step(batch, output)       # the step's cost and yield, for the policy
    -> events to listeners (outputs.py); the memory check per the `memory_check` policy

With `engine.overlap_schedule` the same parts run in another order: step N+1 is scheduled and
prepared, then submitted behind step N (forward_thread.py: on a forward thread, or inline,
what `auto` picks on CUDA: launched at once from this thread), and only then are step N's
results processed (verify has nothing to do: such a step has no drafts),
while N+1 computes. A step that cannot be scheduled before N's results are known
(`OverlapStall`: a retraction, a decode that drafts; or a request with a grammar or
penalties) processes N first; a step with drafts, or one that captures a CUDA graph (a
stream capture forbids device work on other threads, such as the EAGLE head's catch-up), then
runs on the forward thread with nothing else in flight and is processed at once.

Thread model: every public method takes `self.lock`, so in-process callers may call `submit`,
`abort` and the session calls from one thread while another runs `step()`; KV state is only
ever touched under the lock. The served replica (server.py) goes further: only its engine
thread calls the engine (other calls arrive as queued commands), so the lock is never
contended there and the replica's event loop never waits for a forward. Listeners are called
after the lock is released.
"""

from __future__ import annotations

import itertools
import secrets
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from sessionserve.cache import CheckSchedule, MemoryChecker, MemoryTerms
from sessionserve.cache.request_kv import RequestKV
from sessionserve.cache.session_cache import TurnMode
from sessionserve.config import EngineConfig
from sessionserve.errors import InvalidRequestError
from sessionserve.metrics import EngineMetrics
from sessionserve.replicas.assembly import build_cache, build_runner, context_limit
from sessionserve.replicas.forward_thread import ForwardThread
from sessionserve.replicas.gauges import export_gauges
from sessionserve.replicas.grammar import Grammars
from sessionserve.replicas.loader import LoadedModel, eos_token_ids, load_model
from sessionserve.replicas.outputs import Listener, OutputProcessor, StepEvent
from sessionserve.replicas.request import Request, RequestResult, check_context, check_prompt_ids
from sessionserve.replicas.scheduler import OverlapStall, Scheduler
from sessionserve.replicas.sessions import (
    SessionController,
    SessionExport,
    SessionInfo,
    SessionSeed,
)
from sessionserve.replicas.speculative.drafter import DraftHead
from sessionserve.replicas.speculative.stats import SpecStats
from sessionserve.replicas.step import Drafts, ForwardBatch, ScheduledBatch, SeqLayout, StepOutput
from sessionserve.replicas.stopping import StopChecker
from sessionserve.wire import SamplingParams

if TYPE_CHECKING:
    from concurrent.futures import Future

_rid_counter = itertools.count(1)


def draft_seed(seed: int) -> int:
    """The EAGLE head's seed beside `seed` (a request's or the engine's): a stream apart."""
    return (seed * 0x9E3779B97F4A7C15 + 1) % (1 << 63)


class Engine:
    def __init__(
        self,
        config: EngineConfig | None = None,
        loaded: LoadedModel | None = None,
        metrics: EngineMetrics | None = None,
        drafter: DraftHead | None = None,
        reclaim_sessions_at_limit: bool = False,
    ):
        """`metrics`: where the engine reports (a served replica's exporter; default: nowhere).
        `drafter`: an EAGLE head already attached to the model (tests build one in memory);
        otherwise `config.spec.drafter_path` is loaded when set. `reclaim_sessions_at_limit`:
        at `sessions.max_sessions`, a new session takes the least recently used idle one's
        slot (`SessionController`; the served replica, whose turns bring their whole input)."""
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
        self.cache = build_cache(cfg, model.config)
        on_verify = self.metrics.on_spec_step
        self.runner, self.speculative = build_runner(
            cfg, model, self.cache, on_verify, drafter, self.loaded.gguf
        )
        self.context_limit = context_limit(cfg, self.cache)
        self.stopper = StopChecker(self.tokenizer, cfg.cache.max_context_len)
        spec = self.speculative
        self.scheduler = Scheduler(
            self.cache,
            cfg.scheduler,
            self.stopper,
            spec.draft_lens if spec else None,
            cfg.prefill_batch_limit(),
        )
        self.sessions = SessionController(
            self.cache, cfg.sessions, self._decode_verbatim(), reclaim_sessions_at_limit
        )
        self.outputs = OutputProcessor(
            self.tokenizer, self.sessions, self.scheduler.release, self.metrics
        )
        if spec is not None:  # a session turn's put-off head catch-up, within its budget
            budget = int(cfg.spec.carried_catch_up_mib * 2**20)
            spec.may_carry = lambda n: self.sessions.head_backlog_bytes() + n <= budget
        self.checker = MemoryChecker(self.cache)
        self.check_schedule = CheckSchedule(cfg.memory_check, cfg.memory_check_period_s)
        self.eos_ids = eos_token_ids(model, self.tokenizer)
        # unseeded requests draw from these; the head's own stream (Request's doc)
        seed = cfg.seed if cfg.seed is not None else secrets.randbits(63)
        self.generator = torch.Generator().manual_seed(seed)
        self.draft_generator = torch.Generator().manual_seed(draft_seed(seed))
        self.lock = threading.RLock()
        self._grammars: Grammars | None = None
        self.forwards: ForwardThread | None = None  # overlap scheduling's forward thread
        self._in_flight: tuple[ScheduledBatch, Future[StepOutput]] | None = None
        # steps scheduled while the previous one ran / that waited for it first
        self.overlap_totals = {"overlapped_steps": 0, "overlap_waits": 0}
        # An experiment kept for benchmarks/gpu.py (`--switch-intervals`): the engine thread
        # waits for the step it submitted to be launched before it lands the one before. The
        # two threads share the GIL, and landing a host-bound step never blocks, so the forward
        # thread may get the GIL back only at Python's switch interval and launch late. Off: on
        # an H100 at 32 requests both orders read 2.2-3.6 ms a step, bimodal, the wait's median
        # no better (docs/benchmarks.md, 2026-11-27 runs I-K), nor its mean on an H200 at 32
        # and 64 (2026-12-04 run R). `overlap_schedule: inline` is the same order, one thread.
        self.await_launch = False
        if (overlap := cfg.overlap_mode()) != "off":
            self.forwards = ForwardThread(self.runner, inline=overlap == "inline")
            self.runner.kv_pool.fence = self.forwards.wait
            if self.speculative is not None and self.speculative.eagle is not None:
                # the head's catch-up lands beside the next step's forward: no capture then
                self.speculative.eagle.may_capture = lambda: self._in_flight is None

    def grammars(self) -> Grammars:
        """The JSON-schema compiler, built by the first constrained request (reading the
        tokenizer's vocabulary takes ~0.5 s, which unconstrained replicas never pay)."""
        if self._grammars is None:
            self._grammars = Grammars(self.tokenizer, self.vocab_size)
        return self._grammars

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

    def _decode_verbatim(self) -> Callable[[list[int]], str] | None:
        """The tokenizer's decode with special tokens and spaces as they are (None: none)."""
        tok = self.tokenizer
        if tok is None:
            return None
        return lambda ids: tok.decode(
            ids, skip_special_tokens=False, clean_up_tokenization_spaces=False
        )

    def session_info(self, session_id: str) -> SessionInfo:
        with self.lock:
            return self.sessions.info(session_id)

    def idle_sessions(self) -> list[str]:
        with self.lock:
            return self.sessions.idle()

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
        arrived_at: float | None = None,
    ) -> str:
        """Queue a request; returns its id. Raises a typed error, changing nothing, on bad
        input, a busy or closing session, or an input beyond the context. `open_missing` opens
        a session this replica does not hold, from its TTL and token log (the served app's
        ingress has already checked it exists). `arrived_at` (`time.monotonic()`): when the
        request reached the replica, if before this call; its queue time and time to first
        token count from then (a served request's submit waits for the step in flight, ~70 ms
        of a multi-turn turn's 244 on 2 cores, docs/benchmarks.md)."""
        sampling = sampling or SamplingParams()
        rid = rid or f"req-{next(_rid_counter)}"
        check_prompt_ids(input_ids, self.vocab_size)
        # compiled before the lock (a new schema takes ms), a 400 if it cannot
        grammar = None
        if sampling.json_schema is not None or sampling.lark_grammar is not None:
            grammar = self.grammars().for_sampling(sampling)
        with self.lock:
            if rid in self.outputs.requests:
                raise InvalidRequestError(f"request id {rid!r} is already in use", param="rid")
            if session_id is None:
                kv, full, log_base = RequestKV(rid=rid), list(input_ids), 0
            else:
                kv, full, log_base = self.sessions.start_turn(
                    session_id, rid, list(input_ids), mode, open_missing
                )
            try:  # anything raising from here on (a bad seed too) must end the turn
                check_context(full, sampling, self.context_limit)
                gen, draft_gen = self.generator, self.draft_generator
                if sampling.seed is not None:
                    gen = torch.Generator().manual_seed(sampling.seed)
                    draft_gen = torch.Generator().manual_seed(draft_seed(sampling.seed))
                req = Request(
                    rid,
                    full,
                    sampling,
                    kv,
                    mode,
                    self.eos_ids,
                    generator=gen,
                    draft_generator=draft_gen,
                )
                req.log_base = log_base
                req.grammar = grammar
                if arrived_at is not None:
                    req.timings.arrival = min(arrived_at, req.timings.arrival)
                if session_id is not None:
                    req.drafting.deferred = self.sessions.take_head_backlog(session_id)
            except Exception:
                if session_id is not None:
                    self.sessions.cancel_turn(session_id, kv)
                raise
            self.outputs.add(req, listener)
            self.scheduler.add(req)
        return rid

    def abort(self, rid: str, message: str = "aborted") -> bool:
        """Abort in any phase; False if the request already finished. Session turns keep what
        is committed (the session continues from its last successful turn)."""
        with self.lock:
            event = self.outputs.abort(rid, message)
        if event is None:
            return False
        self.outputs.dispatch([event])
        return True

    def take_result(self, rid: str) -> RequestResult:
        """The result of a finished request submitted without a listener (kept until taken)."""
        with self.lock:
            return self.outputs.take(rid)

    def in_flight(self) -> list[str]:
        """Ids of the requests submitted and not yet ended."""
        with self.lock:
            return list(self.outputs.requests)

    # ---- the loop ----
    def step(self) -> list[StepEvent]:
        if self.forwards is not None:
            return self._step_overlapped()
        with self.lock:
            self.reap_expired_sessions()
            batch = self.scheduler.schedule()
            events = self._run_step(batch) if batch else []
            self._checks_due()
        self.outputs.dispatch(events)
        return events

    def _run_step(self, batch: ScheduledBatch) -> list[StepEvent]:
        """Propose, run and process `batch` now (on the forward thread if there is one)."""
        drafts, (fb, layout) = self._prepare(batch)
        if self.forwards is not None:
            output = self.forwards.submit(batch, fb, layout).result()
        else:
            output = self.runner.run_prepared(batch, fb, layout)
        return self._complete(batch, drafts, output)

    def _prepare(
        self, batch: ScheduledBatch
    ) -> tuple[dict[str, Drafts], tuple[ForwardBatch, dict[str, SeqLayout]]]:
        """The step's drafts and its flat forward."""
        spec = self.speculative
        drafts = spec.propose(batch) if spec else {}
        hidden = spec is not None and spec.wants_hidden
        return drafts, self.runner.prepare(batch, drafts, want_hidden=hidden)

    def _complete(
        self, batch: ScheduledBatch, drafts: dict[str, Drafts], output: StepOutput
    ) -> list[StepEvent]:
        """Everything after a step's forward: verify, commit and append, the drafter's
        catch-up, finishing, the policy's figures."""
        output.resolve()  # the sampled tokens to the host (waits for them under overlap)
        spec = self.speculative
        if spec:
            spec.verify(batch, drafts, output)
        updates = self.scheduler.process(batch, output)
        if spec:
            spec.catch_up(batch, output, updates)
        events = self.outputs.events(self.scheduler.finish(updates))
        if spec:
            spec.finish_step(batch, output)
        return events

    def _checks_due(self) -> None:
        """After a step: the memory check and the gauges, when their periods say so."""
        if self.check_schedule.due():
            self.check_memory()
        if self.metrics.gauges_due():
            self.report_gauges()

    def _step_overlapped(self) -> list[StepEvent]:
        """Schedule and submit the next step, then process the one in flight (its events are
        what this call returns). One step is in flight between calls."""
        assert self.forwards is not None
        events: list[StepEvent] = []
        with self.lock:
            self.reap_expired_sessions()
            running, self._in_flight = self._in_flight, None
            totals = self.overlap_totals
            if running is not None and not self._overlappable():
                events += self._land(*running)
                running = None
                totals["overlap_waits"] += 1
            try:
                batch = self.scheduler.schedule(overlap=running is not None)
            except OverlapStall:
                events += self._land(*running)  # type: ignore[misc]  (it raises only then)
                running = None
                totals["overlap_waits"] += 1
                batch = self.scheduler.schedule()
            if batch and any(s.num_drafts for s in batch.seqs):  # scheduled with none in flight
                events += self._run_step(batch)
            elif batch:
                drafts, (fb, layout) = self._prepare(batch)
                assert not drafts  # (a decode that drafts stalls an overlapped schedule)
                if self.runner.captures(fb):  # a CUDA graph capture: nothing may run beside it
                    if running is not None:
                        events += self._land(*running)
                        running = None
                        totals["overlap_waits"] += 1
                    events += self._complete(
                        batch, drafts, self.forwards.submit(batch, fb, layout).result()
                    )
                else:
                    self._in_flight = (batch, self.forwards.submit(batch, fb, layout))
                    if self.await_launch:
                        self.forwards.wait()  # (the step just submitted is the last)
            if running is not None:
                totals["overlapped_steps"] += bool(batch)
                events += self._land(*running)
            self._checks_due()
        self.outputs.dispatch(events)
        return events

    def _land(self, batch: ScheduledBatch, result: Future[StepOutput]) -> list[StepEvent]:
        """Process a step the forward thread ran (waiting for it if it still runs)."""
        return self._complete(batch, {}, result.result())

    def _overlappable(self) -> bool:
        """Every request's next step can be scheduled before its last token is known."""
        s = self.scheduler
        return all(r.overlappable for r in s.running) and all(r.overlappable for r in s.waiting)

    def close(self) -> None:
        """Process the step in flight and stop the forward thread (overlap scheduling)."""
        if self.forwards is None:
            return
        events: list[StepEvent] = []
        with self.lock:
            if self._in_flight is not None:
                events = self._land(*self._in_flight)
                self._in_flight = None
        self.outputs.dispatch(events)
        self.forwards.close()

    def reap_expired_sessions(self) -> None:
        """Close sessions idle past their TTL (throttled: every step calls it, and so does the
        served replica's engine thread while it has no work)."""
        with self.lock:
            self.sessions.reap_expired()

    def check_memory(self) -> MemoryTerms:
        """The memory invariant now: the busy form over the live batch, or the idle form
        (rows too; no slot may claim a borrower) when nothing is queued or running."""
        with self.lock:
            if self.scheduler.has_work():
                return self.checker.check_busy([r.kv for r in self.scheduler.live()])
            return self.checker.check_idle()

    def report_gauges(self) -> None:
        """Export the memory terms, queue figures and totals (also checks the invariant, in
        any `memory_check` mode: a broken one raises here)."""
        with self.lock:
            terms = self.check_memory()
            overlap = self.overlap_totals if self.forwards is not None else None
            export_gauges(
                self.metrics, terms, self.scheduler, self.checker, self.spec_stats, overlap
            )

    def has_work(self) -> bool:
        with self.lock:
            return self.scheduler.has_work() or self._in_flight is not None

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
