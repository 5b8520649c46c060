"""Admission, batching and the step's bookkeeping: which tokens of which requests run in the
next forward (`schedule`), and what their results do to KV and requests (`process`).

One step holds every running decode (one token each) and then prefill chunks up to the
`max_prefill_tokens` budget: first requests whose prefill is already under way, then new ones in
arrival order while KV allows (free + evictable radix pages + idle sessions, minus a reserve for
the running decodes) and the step's prompts hold fewer than `prefill_batch_tokens` (on a CPU,
where a step costs what its tokens cost, a burst's prompts then run one after another and the
first ones answer sooner). When a decode cannot get a slot, the youngest decode request is
retracted: its KV goes back to the cache (a session turn's is parked in its slot) and it waits to be
re-admitted ahead of new requests. After the forward, `process` commits each sequence's KV,
appends its tokens and checks stops, and `finish` ends what is done: besides admission, the
only code that changes a request's KV (a verify's commit is the speculative decoder's).

Under overlap scheduling (`schedule(overlap=True)`) the previous step is still running: a
request it samples for decodes from that pending token (its position allocated now, the token
read by the forward when it starts), a request whose pending token ends it (max_tokens, the
context) is left out, and a chunked prefill continues where the running chunk ends. What
would need a retraction raises `OverlapStall` instead: the engine processes the running step
first and schedules again, so a request is never retracted while a step computes for it. So
does a decode that would draft: its drafts follow the token the running step samples, and how
many of them a verify keeps decides where the next step starts, so a step that verifies runs
with nothing in flight (speculation's accounting is the plain engine's by construction).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from sessionserve.cache.request_kv import KVState
from sessionserve.cache.session_cache import SessionCache
from sessionserve.config import SchedulerConfig
from sessionserve.errors import KVCacheFullError
from sessionserve.replicas.request import Request, TokenLogprob
from sessionserve.replicas.step import ScheduledBatch, ScheduledSeq, SeqUpdate, StepOutput
from sessionserve.replicas.stopping import StopChecker


class OverlapStall(Exception):
    """The next step needs what the step in flight produces (KV its finishing requests free,
    or a retraction): process that step first, then schedule without overlap."""


class Scheduler:
    def __init__(
        self,
        cache: SessionCache,
        config: SchedulerConfig,
        stopper: StopChecker,
        draft_lens: Callable[[list[Request]], list[int]] | None = None,
        prefill_batch_limit: int | None = None,
    ) -> None:
        """`draft_lens`: the draft slots each of the step's decodes needs (the speculative
        decoder's choice, made for the step's decodes together; None: no speculation).
        `prefill_batch_limit`: `EngineConfig.prefill_batch_limit` (a step starts no further
        prompt once its prompts hold this many tokens; None: no limit)."""
        self.cache = cache
        self.config = config
        self.prefill_batch_limit = prefill_batch_limit
        self.stopper = stopper
        self.draft_lens = draft_lens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.retractions_total = 0
        self.steps = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def live(self) -> list[Request]:
        """Requests holding KV: what the memory checker must be shown."""
        return [r for r in self.running if r.kv.is_live]

    def remove(self, req: Request) -> None:
        """Forget a finished or aborted request (its KV was already given back)."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    def release(self, req: Request) -> None:
        """Give back what an aborted or failed request holds and forget it; a session turn
        keeps what is committed (the session continues from its last successful turn)."""
        if req.kv.state is not KVState.DONE:
            self.cache.abort(req.kv, req.tokens)
        self.remove(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ----
    def schedule(self, overlap: bool = False) -> ScheduledBatch:
        """The next step. `overlap`: the previous one is still running (see the module doc);
        raises OverlapStall, retracting nothing, where it would have to wait for it."""
        self.steps += 1
        try:
            return self._schedule(ScheduledBatch(step=self.steps), overlap)
        except OverlapStall:
            self.steps -= 1  # the step is scheduled again once the running one is processed
            raise

    def _schedule(self, batch: ScheduledBatch, overlap: bool) -> ScheduledBatch:
        prefilling = self._schedule_decodes(batch, overlap)
        budget = self.config.max_prefill_tokens
        for req in prefilling:  # chunked prefills
            budget = self._schedule_prefill(req, budget, batch, overlap)
        while (
            self.waiting
            and budget > 0
            and len(self.running) < self.config.max_running_requests
            and self._starts_another_prompt(budget)
        ):
            req = self.waiting[0]
            if not self._admit(req, budget):
                break
            self.waiting.popleft()
            self.running.append(req)
            budget = self._schedule_prefill(req, budget, batch, overlap)
        for s in batch.seqs:
            req = s.req
            req.inflight_step, req.inflight_end, req.inflight_samples = batch.step, s.end, s.samples
        return batch

    def _starts_another_prompt(self, budget: int) -> bool:
        """Below `prefill_batch_limit` prompt tokens this step, a waiting prompt may join."""
        return (
            self.prefill_batch_limit is None
            or self.config.max_prefill_tokens - budget < self.prefill_batch_limit
        )

    def _ends_with_pending(self, req: Request) -> bool:
        """The token the step in flight samples for `req` (one with a pending token) ends it
        whatever it is (max_tokens or the context reached): nothing to schedule after it."""
        n = len(req.output_ids) + 1
        return n >= req.sampling.max_tokens or req.num_tokens + 1 >= self.stopper.max_context_len

    def _schedule_decodes(self, batch: ScheduledBatch, overlap: bool) -> list[Request]:
        """Schedule the running requests that decode (oldest first); the ones that prefill
        instead are returned, in running order (one pass over the batch: this runs every
        step for every request)."""
        decodes, prefilling = [], []
        for r in self.running:
            pending = r.pending_tokens
            if not (r.sampled or pending):  # its input is not all computed (nor in flight)
                prefilling.append(r)
            elif not (pending and self._ends_with_pending(r)):
                decodes.append(r)
        decodes.sort(key=lambda r: r.timings.arrival)
        every = self.config.force_retract_every
        if every and decodes and self.steps % every == 0:
            if overlap:
                raise OverlapStall("a forced retraction")
            self._retract(decodes.pop(), batch)
        wanted = self.draft_lens(decodes) if self.draft_lens else [0] * len(decodes)
        if overlap and any(wanted):
            raise OverlapStall("a decode drafts")
        i = 0
        while i < len(decodes):  # (a retraction pops the youngest: never one scheduled here)
            req, k = decodes[i], wanted[i]
            pending = req.pending_tokens
            n = req.num_tokens + pending  # the pending token's slot is the 'bonus slot'
            try:  # slots for the pending token and its drafts (a failed verify's are freed)
                self.cache.allocate(req.kv, n + k)
            except KVCacheFullError:
                try:  # no room for the drafts: decode one token this step
                    k = 0
                    self.cache.allocate(req.kv, n)
                except KVCacheFullError:
                    if overlap:
                        raise OverlapStall("no KV for a decode") from None
                    self._retract(decodes.pop(), batch)  # the youngest; maybe `req` itself
                    wanted.pop()
                    continue
            batch.seqs.append(ScheduledSeq(req, n - 1, n, k, pending=pending))
            i += 1
        return prefilling

    def _schedule_prefill(
        self, req: Request, budget: int, batch: ScheduledBatch, overlap: bool
    ) -> int:
        if budget <= 0:
            return budget
        start = req.inflight_end if req.inflight_step is not None else req.kv.committed_len
        end = min(req.num_tokens, start + budget)
        if end <= start:  # (a prefill whose last chunk is in flight: it decodes after that)
            return budget
        try:
            self.cache.allocate(req.kv, end)
        except KVCacheFullError:
            if overlap:
                raise OverlapStall("no KV for a prefill chunk") from None
            self._retract(req, batch)
            return 0
        batch.seqs.append(ScheduledSeq(req, start, end))
        return budget - (end - start)

    def _admit(self, req: Request, budget: int) -> bool:
        """Match the request's prefix if KV allows; False leaves it waiting, holding nothing."""
        reserve = self.config.decode_reserve_tokens * len(self.running)
        need = min(budget, req.num_tokens) + reserve
        if self.cache.reclaimable_size() < need and self.running:
            return False
        try:
            self.cache.match(req.kv, req.tokens, req.mode)
        except KVCacheFullError:  # no request row could be freed
            return False
        if req.timings.scheduled is None:  # first admission: what usage reports
            req.timings.scheduled = time.monotonic()
            req.cached_tokens, req.cached_source = req.kv.cached_len, req.kv.cached_source
        return True

    def _retract(self, req: Request, batch: ScheduledBatch) -> None:
        self.cache.retract(req.kv, req.tokens)
        req.sampled = False
        req.draft = None
        req.drafting.drop_deferred()
        req.retractions += 1
        self.retractions_total += 1
        self.running.remove(req)
        self.waiting.appendleft(req)
        batch.retracted.append(req)

    # ---- after the forward ----
    def process(self, batch: ScheduledBatch, out: StepOutput) -> list[SeqUpdate]:
        """Commit the step's KV, append the sampled tokens and check stops. A request whose
        own sampling or stop check raised ends alone (KV given back); the batch goes on.
        `finish` then ends what is done (after the drafter's catch-up, which reads the KV of
        requests that finish this step)."""
        seqs = [s for s in batch.seqs if self._landed(s.req, batch.step)]
        for s in seqs:  # a verify committed only what it accepted
            if not s.num_drafts:
                self.cache.commit(s.req.kv, s.end)
        updates, now = [], time.monotonic()
        for s in seqs:
            req = s.req
            if req.rid in out.errors:
                updates.append(self._fail(req, out.errors[req.rid]))
            elif req.rid in out.emitted:  # (a prefill chunk samples nothing)
                updates.append(self._append(req, *out.emitted[req.rid], now))
        return updates

    @staticmethod
    def _landed(req: Request, step: int) -> bool:
        """Whether step `step`'s results still concern `req`, and clear its in-flight mark.
        Under overlap a request can end (stop, abort, failure) while a later step computes for
        it: that step's token is dropped, and its slot was given back when it ended."""
        if req.inflight_step == step:
            req.inflight_step = None
        return not req.finished and req.kv.is_live

    def finish(self, updates: list[SeqUpdate]) -> list[SeqUpdate]:
        """End the requests `process` found finished (a failed finish ends that one alone)."""
        return [self._finish(u) if u.finished else u for u in updates]

    def _append(
        self, req: Request, tokens: list[int], logprobs: list[TokenLogprob], now: float
    ) -> SeqUpdate:
        req.output_ids.extend(tokens)
        req.logprobs.extend(logprobs)
        req.sampled = True
        if req.timings.first_token is None:
            req.timings.first_token = now
        try:
            finished = self.stopper.check(req)
        except Exception as e:
            return self._fail(req, e)
        return SeqUpdate(req, tokens, logprobs, finished)

    def _finish(self, u: SeqUpdate) -> SeqUpdate:
        """Trim the output to the answer (a verify may overshoot a stop), save the KV."""
        req = u.req
        before = len(req.output_ids) - len(u.new_tokens)
        n = req.finished_len if req.finished_len is not None else len(req.output_ids)
        del req.output_ids[n:], req.logprobs[n:]
        try:
            self.cache.finish(req.kv, req.tokens)
        except Exception as e:
            return self._fail(req, e)
        self.remove(req)
        return SeqUpdate(req, req.output_ids[before:], req.logprobs[before:], finished=True)

    def _fail(self, req: Request, error: Exception) -> SeqUpdate:
        self.release(req)
        return SeqUpdate(req, error=error)
