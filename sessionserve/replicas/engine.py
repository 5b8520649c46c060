"""The replica's engine: the step loop and the in-process API (no Ray needed).

    batch = scheduler.schedule() -> logits = runner.forward(batch) -> sample -> process
    -> events to listeners -> check_memory() (per the `memory_check` policy)

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
from typing import Any, NamedTuple

import torch

from sessionserve.cache import (
    KVPool,
    KVShape,
    MemoryChecker,
    MemoryTerms,
    SessionLimits,
    build_session_cache,
)
from sessionserve.cache.allocator import floor_align
from sessionserve.cache.host_tier import HostTier
from sessionserve.cache.request_kv import KVState, RequestKV
from sessionserve.cache.session_cache import TurnMode
from sessionserve.config import EngineConfig
from sessionserve.metrics import EngineMetrics
from sessionserve.replicas.attention import (
    AttentionBackend,
    SeqSpec,
    attention_scale,
    select_backend,
)
from sessionserve.replicas.attention.torch_backend import TorchPagedBackend
from sessionserve.replicas.cuda_graphs import DecodeGraphs, ExtendGraphs, buckets_up_to
from sessionserve.replicas.loader import LoadedModel, load_model
from sessionserve.replicas.model_runner import ForwardBatch, ModelRunner
from sessionserve.replicas.request import (
    ContextTooLongError,
    FinishReason,
    InvalidRequestError,
    Request,
    RequestResult,
    SamplingParams,
    TokenLogprob,
)
from sessionserve.replicas.sampling import SampleOutput, filter_logits, sample, token_logprobs
from sessionserve.replicas.scheduler import ScheduledBatch, ScheduledSeq, Scheduler
from sessionserve.replicas.sessions import SessionController, SessionExport, SessionInfo
from sessionserve.replicas.spec.acceptance import accept_greedy, accept_sampled
from sessionserve.replicas.spec.checkpoint import load_drafter
from sessionserve.replicas.spec.drafter import EagleDrafter
from sessionserve.replicas.spec.proposer import CatchUp, ChainDrafts, EagleProposer
from sessionserve.replicas.spec.stats import SpecStats
from sessionserve.replicas.stopping import StopChecker, answer_text

log = logging.getLogger(__name__)
Listener = Callable[["StepEvent"], None]
_rid_counter = itertools.count(1)


@dataclass(frozen=True)
class StepEvent:
    rid: str
    new_token_ids: list[int]
    result: RequestResult | None = None  # set on the request's last event
    new_logprobs: list[TokenLogprob] = field(default_factory=list)  # when requested


class SeqLayout(NamedTuple):
    """Where one scheduled sequence sits in a step's flat forward."""

    flat_start: int  # index of its first token (in the hidden states)
    logit_row: int  # its first logits row (k + 1 rows for a verify); -1 if it samples nothing


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
        c, s = cfg.cache, cfg.sessions
        self.cache = build_session_cache(
            num_slots=floor_align(c.num_slots, c.page_size),
            page_size=c.page_size,
            max_rows=c.max_rows,
            max_context_len=c.max_context_len,
            radix_enabled=c.radix_cache,
            limits=SessionLimits(s.max_sessions, s.max_held_tokens, s.max_session_tokens),
        )
        self.runner = ModelRunner(model, *self._pool_and_backend(model))
        if cfg.cuda_graphs and self.runner.device.type == "cuda":
            most = min(cfg.scheduler.max_running_requests, cfg.cuda_graph_max_batch)
            self.runner.graphs = DecodeGraphs(self.runner, buckets_up_to(most))
        self.proposer = self._build_proposer(cfg, model, drafter)
        # short extends replay graphs too, unless a drafter needs every hidden state
        extend = cfg.cuda_graph_max_extend > 1 and self.proposer is None
        if self.runner.graphs is not None and extend:
            self.runner.extend_graphs = ExtendGraphs(
                self.runner, self._extend_backend(), cfg.cuda_graph_max_extend
            )
        pools = [self.runner.kv_pool] + ([self.proposer.pool] if self.proposer else [])
        tier = HostTier(s.host_tier_bytes) if s.host_tier_bytes else None
        self.cache.attach_kv(pools, tier)  # the drafter's KV parks and moves with the target's
        self.spec_stats = SpecStats()
        limit = min(c.max_context_len, self.cache.allocator.num_slots)
        self.scheduler = Scheduler(
            self.cache,
            cfg.scheduler,
            None if self.proposer is None else lambda r: self.proposer.draft_len(r, limit),
        )
        self.sessions = SessionController(self.cache, s)
        self.checker = MemoryChecker(self.cache)
        self.stopper = StopChecker(self.tokenizer, c.max_context_len)
        self.eos_ids = _eos_ids(model, self.tokenizer)
        self.requests: dict[str, Request] = {}
        self.listeners: dict[str, Listener] = {}
        self.results: dict[str, RequestResult] = {}
        self.generator = torch.Generator().manual_seed(0)
        self.lock = threading.RLock()
        self._last_reap = time.monotonic()
        self._next_memory_check = 0.0  # periodic policy: the first step checks
        self.metrics = metrics or EngineMetrics()

    def _build_proposer(
        self, cfg: EngineConfig, model: Any, drafter: EagleDrafter | None
    ) -> EagleProposer | None:
        if drafter is None and cfg.spec.drafter_path is None:
            return None
        if drafter is None:
            drafter = load_drafter(cfg.spec.drafter_path, model)
        pool, backend = self._pool_and_backend(drafter)
        return EagleProposer(
            drafter, pool, backend, self.cache, cfg.spec.num_drafts, model.config.vocab_size
        )

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
        open_missing: bool = False,
    ) -> str:
        """Queue a request; returns its id. Raises a typed error, changing nothing, on bad
        input, a busy or closing session, or an input beyond the context. `open_missing` opens
        an unknown session (the served app's ingress has already checked it exists)."""
        sampling = sampling or SamplingParams()
        rid = rid or f"req-{next(_rid_counter)}"
        self._validate_ids(input_ids)
        with self.lock:
            if rid in self.requests:
                raise InvalidRequestError(f"request id {rid!r} is already in use", param="rid")
            if session_id is None:
                kv, full = RequestKV(rid=rid), list(input_ids)
            else:
                kv, full = self.sessions.start_turn(
                    session_id, rid, list(input_ids), mode, open_missing
                )
            try:
                self._validate_length(full, sampling)
                gen = (
                    torch.Generator().manual_seed(sampling.seed)
                    if sampling.seed is not None
                    else self.generator
                )
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
            self.cache.abort(req.kv, req.tokens)
            self.scheduler.remove(req)
            req.finish_reason, req.finish_message = FinishReason.ABORT, message
            self.metrics.on_abort(phase)
            event = self._close_request(req, success=False)
        self._dispatch([event])
        return True

    def take_result(self, rid: str) -> RequestResult:
        """The result of a finished request submitted without a listener (kept until taken)."""
        with self.lock:
            return self.results.pop(rid)

    # ---- the loop ----
    def step(self) -> list[StepEvent]:
        with self.lock:
            self._maybe_reap()
            batch = self.scheduler.schedule()
            events = self._run(batch) if batch else []
            if self._memory_check_due():
                self.check_memory()
            if self.metrics.gauges_due():
                self.report_gauges()
        self._dispatch(events)
        return events

    def _memory_check_due(self) -> bool:
        """The `memory_check` policy, applied by the step itself (not by metrics export)."""
        policy = self.config.memory_check
        if policy != "periodic":
            return policy == "every_step"
        now = time.monotonic()
        if now < self._next_memory_check:
            return False
        self._next_memory_check = now + self.config.memory_check_period_s
        return True

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
                    **self._host_tier_totals(),
                },
            )

    def _host_tier_totals(self) -> dict[str, int]:
        tier = self.cache.host_tier
        if tier is None:
            return {}
        while tier.restore_seconds:
            self.metrics.on_restore(tier.restore_seconds.popleft())
        return {
            "host_tier_parks": tier.parked_total,
            "host_tier_restores": tier.restored_total,
            "host_tier_evictions": tier.evicted_total,
        }

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
    def _run(self, batch: ScheduledBatch) -> list[StepEvent]:
        drafts = self._propose(batch)
        fb, layout = self._forward_batch(batch, drafts)
        logits, hidden = self.runner.forward(fb)
        emitted: list[tuple[ScheduledSeq, list[int], list[TokenLogprob]]] = []
        plain = [s for s in batch.seqs if s.samples and s.num_drafts == 0]
        for s in batch.seqs:  # a verify commits only what it accepts (`_verify`)
            if not s.num_drafts:
                self.cache.commit(s.req.kv, s.end)
        failed: list[StepEvent] = []  # requests whose own work raised: they end alone
        if plain:
            emitted += self._sample(plain, logits, layout, failed)
        for s in batch.seqs:
            if s.num_drafts:
                try:
                    emitted.append(self._verify(s, drafts[id(s)], logits, layout[id(s)].logit_row))
                except Exception as e:
                    failed.append(self._fail(s.req, e))
        if not emitted:
            self._catch_up(batch, hidden, layout, decoding=set(), skip={e.rid for e in failed})
            return failed
        now, finished, stopped_ok = time.monotonic(), set(), []
        for s, tokens, lps in emitted:
            req = s.req
            req.output_ids.extend(tokens)
            req.logprobs.extend(lps)
            req.sampled = True
            if req.timings.first_token is None:
                req.timings.first_token = now
            try:
                if self.stopper.check(req):
                    finished.add(id(s))
            except Exception as e:
                failed.append(self._fail(req, e))
                continue
            stopped_ok.append((s, tokens))
        live = {id(s) for s, _ in stopped_ok} - finished
        self._catch_up(batch, hidden, layout, live, skip={e.rid for e in failed})
        events = failed
        for s, tokens in stopped_ok:
            req = s.req
            before = len(req.output_ids) - len(tokens)
            try:
                result = self._finish(req) if id(s) in finished else None
            except Exception as e:
                events.append(self._fail(req, e))
                continue
            events.append(
                StepEvent(req.rid, req.output_ids[before:], result, req.logprobs[before:])
            )
        return events

    def _sample(
        self,
        seqs: list[ScheduledSeq],
        logits: torch.Tensor,
        layout: dict[int, SeqLayout],
        failed: list[StepEvent],
    ) -> list[tuple[ScheduledSeq, list[int], list[TokenLogprob]]]:
        """One token for each of `seqs`, batched; if the batch raises, each row again alone
        (its seeded generator rewound first), so a request that cannot be sampled fails by
        itself and the others get exactly the tokens they would have had."""
        rows = [layout[id(s)].logit_row for s in seqs]
        seeded = {  # greedy rows draw nothing: only sampled, seeded rows need rewinding
            id(s): s.req.generator.get_state()
            for s in seqs
            if s.req.sampling.seed is not None and not s.req.sampling.is_greedy
        }
        try:
            outs = [self._sample_rows(seqs, logits[rows])]
            groups = [seqs]
        except Exception:
            outs, groups = [], []
            for s, row in zip(seqs, rows, strict=True):
                if id(s) in seeded:
                    s.req.generator.set_state(seeded[id(s)])
                try:
                    outs.append(self._sample_rows([s], logits[[row]]))
                    groups.append([s])
                except Exception as e:
                    failed.append(self._fail(s.req, e))
        emitted = []
        for group, out in zip(groups, outs, strict=True):
            for i, s in enumerate(group):
                lp = out.logprobs[i] if out.logprobs and s.req.sampling.logprobs else None
                emitted.append((s, [out.token_ids[i]], [lp] if lp else []))
        return emitted

    @staticmethod
    def _sample_rows(seqs: list[ScheduledSeq], logits: torch.Tensor) -> SampleOutput:
        return sample(
            logits,
            [s.req.sampling for s in seqs],
            [s.req.tokens if s.req.sampling.repetition_penalty != 1.0 else () for s in seqs],
            [s.req.output_ids for s in seqs],
            [s.req.generator for s in seqs],
        )

    def _fail(self, req: Request, exc: Exception) -> StepEvent:
        """End one request whose own sampling, stop check or finish raised: its KV goes back
        as for an abort (a session keeps its last successful turn), its caller gets an error
        result, and the step, the batch and the replica go on."""
        log.error("request %s failed and was stopped alone: %r", req.rid, exc, exc_info=exc)
        phase = "decode" if req.sampled else "prefill"
        if req.kv.state is not KVState.DONE:
            self.cache.abort(req.kv, req.tokens)
        self.scheduler.remove(req)
        req.finish_reason = FinishReason.ERROR
        req.finish_message = (
            f"generating this request failed on the replica ({type(exc).__name__}); it was "
            "stopped alone and its KV freed; retry it"
        )
        self.metrics.on_abort(phase)
        return self._close_request(req, success=False, text="")

    def _propose(self, batch: ScheduledBatch) -> dict[int, ChainDrafts]:
        """Draft chains for the decodes that speculate this step (keyed by id(seq))."""
        seqs = [s for s in batch.seqs if s.num_drafts]
        if not seqs or self.proposer is None:
            return {}
        chains = self.proposer.propose([s.req for s in seqs], [s.num_drafts for s in seqs])
        return {id(s): c for s, c in zip(seqs, chains, strict=True)}

    def _forward_batch(
        self, batch: ScheduledBatch, drafts: dict[int, ChainDrafts]
    ) -> tuple[ForwardBatch, dict[int, SeqLayout]]:
        """The flat forward, and where each sequence (by id) sits in it."""
        ids, pos, out_slots, seqs, logit_idx, layout, n = [], [], [], [], [], {}, 0
        for s in batch.seqs:
            kv, chain = s.req.kv, drafts.get(id(s))
            extra = chain.tokens if chain else []
            end = s.end + len(extra)
            ids.extend(s.req.token_slice(s.start, s.end))
            ids.extend(extra)
            pos.extend(range(s.start, end))
            out_slots.extend(self.cache.slot_list(kv, s.start, end))
            seqs.append(SeqSpec(end - s.start, self.cache.slots(kv, 0, end)))
            layout[id(s)] = SeqLayout(n, len(logit_idx) if s.samples else -1)
            n += end - s.start
            if s.samples:
                logit_idx.extend(range(n - 1 - len(extra), n))
        fb = ForwardBatch(
            torch.tensor(ids),
            torch.tensor(pos),
            torch.tensor(out_slots),
            seqs,
            torch.tensor(logit_idx, dtype=torch.int64),
            want_hidden=self.proposer is not None,
        )
        return fb, layout

    def _verify(
        self, s: ScheduledSeq, chain: ChainDrafts, logits: torch.Tensor, row: int
    ) -> tuple[ScheduledSeq, list[int], list[TokenLogprob]]:
        """Keep the drafts the target agrees with; commit their KV (and the pending token's),
        free the rejected drafts' slots now."""
        req, k = s.req, len(chain.tokens)
        target = logits[row : row + k + 1].float()
        p = req.sampling
        if p.is_greedy:
            verdict = accept_greedy(target, chain.tokens)
        else:
            probs = filter_logits(target, p).softmax(-1)
            verdict = accept_sampled(probs, chain.probs, chain.tokens, req.generator)
        self.cache.commit(req.kv, s.end + verdict.accepted)
        self.cache.free_overallocation(req.kv)
        req.spec.record(k, verdict.accepted)
        self.spec_stats.record(k, verdict.accepted)
        self.metrics.on_spec_step(verdict.accepted + 1)
        lps = (
            token_logprobs(target[: len(verdict.tokens)], verdict.tokens, p.top_logprobs)
            if p.logprobs
            else []
        )
        return s, verdict.tokens, lps

    def _catch_up(
        self,
        batch: ScheduledBatch,
        hidden: torch.Tensor | None,
        layout: dict[int, SeqLayout],
        decoding: set[int],
        skip: frozenset[str] | set[str] = frozenset(),
    ) -> None:
        """The drafter's pass over every position committed this step (see spec/proposer);
        `decoding`: ids of the sequences that sampled and go on decoding (they get a guess);
        `skip`: requests that failed this step (their KV is gone)."""
        if self.proposer is None or hidden is None:
            return
        entries = []
        for s in batch.seqs:
            if s.req.rid in skip:
                continue
            req, first = s.req, layout[id(s)].flat_start
            end = req.kv.committed_len
            wants = id(s) in decoding and self.proposer.eligible(req)
            hid = hidden[first : first + end - s.start]
            entries.append(CatchUp(req, s.start, end, hid, wants))
        self.proposer.catch_up(entries)

    def _finish(self, req: Request) -> RequestResult:
        """Trim the output to the answer (speculative overshoot), save the KV, report."""
        n = req.finished_len if req.finished_len is not None else len(req.output_ids)
        del req.output_ids[n:], req.logprobs[n:]
        self.cache.finish(req.kv, req.tokens)
        self.scheduler.remove(req)
        return self._close_request(req, success=True).result

    def _close_request(self, req: Request, success: bool, text: str | None = None) -> StepEvent:
        req.timings.finished = time.monotonic()
        if req.session_id is not None:
            self.sessions.turn_ended(req.session_id, success)
        self.requests.pop(req.rid, None)
        t = req.timings
        result = RequestResult(
            rid=req.rid,
            session_id=req.session_id,
            output_ids=list(req.output_ids),
            text=answer_text(self.tokenizer, req) if text is None else text,
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

    def _validate_ids(self, ids: list[int]) -> None:
        if not ids:
            raise InvalidRequestError("the prompt is empty: send at least one token", "prompt")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})", "prompt"
            )

    def _validate_length(self, full: list[int], sampling: SamplingParams) -> None:
        limit = min(self.config.cache.max_context_len, self.cache.allocator.num_slots)
        want = len(full) + sampling.max_tokens
        if want > limit:
            raise ContextTooLongError(
                f"this model's maximum context length is {limit} tokens; the request needs "
                f"{len(full)} input tokens (the session history included) + max_tokens "
                f"{sampling.max_tokens} = {want}. Shorten the input, lower max_tokens, or "
                "start a new session",
                param="max_tokens" if len(full) < limit else "messages",
            )

    def _maybe_reap(self) -> None:
        now = time.monotonic()
        if now - self._last_reap >= 1.0:
            self._last_reap = now
            for sid in self.sessions.reap_expired():
                log.info("session %s idle past its TTL: closed", sid)

    def _pool_and_backend(self, model: Any) -> tuple[KVPool, AttentionBackend]:
        """A KV pool shaped for `model` (the target or the drafter) over the shared slots, and
        an attention backend for its head layout."""
        param = next(model.parameters())
        pool = KVPool(
            KVShape.from_hf_config(model.config),
            self.cache.allocator.pool_slots,
            dtype=param.dtype,
            device=param.device,
        )
        backend = select_backend(
            self.config.attention_backend, param.device, **self._backend_dims(model)
        )
        return pool, backend

    def _extend_backend(self) -> TorchPagedBackend:
        """Short extends replay graphs over the torch backend's static plan (any decode
        backend: the pool layout is shared)."""
        backend = self.runner.backend
        if isinstance(backend, TorchPagedBackend):
            return backend
        return TorchPagedBackend(self.config.cache.max_context_len)

    def _backend_dims(self, model: Any) -> dict[str, Any]:
        shape, cfg, c = KVShape.from_hf_config(model.config), model.config, self.config.cache
        return {
            "page_size": c.page_size,
            "num_heads": cfg.num_attention_heads,
            "num_kv_heads": shape.num_kv_heads,
            "head_dim": shape.head_dim,
            "scaling": attention_scale(model, shape.head_dim),
            "dtype": next(model.parameters()).dtype,
            "num_pages": self.cache.allocator.pool_slots // c.page_size,
            "max_context_len": c.max_context_len,
        }


def _eos_ids(model: Any, tokenizer: Any | None) -> frozenset[int]:
    ids: set[int] = set()
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for source in (gen_eos, getattr(tokenizer, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, list | tuple):
            ids.update(source)
    return frozenset(ids)
