"""Admission and batching: which tokens of which requests run in the next forward.

One step holds every running decode (one token each) and then prefill chunks up to the
`max_prefill_tokens` budget: first requests whose prefill is already under way, then new ones in
arrival order while KV allows (free + evictable radix pages + idle sessions, minus a reserve for
the running decodes). When a decode cannot get a slot, the youngest decode request is retracted:
its KV goes back to the cache (a session turn's is parked in its slot) and it waits to be
re-admitted ahead of new requests.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from sessionserve.cache.session_cache import SessionCache
from sessionserve.config import SchedulerConfig
from sessionserve.errors import KVCacheFullError
from sessionserve.replicas.request import Request


@dataclass
class ScheduledSeq:
    req: Request
    start: int  # positions [start, end) of req.tokens are computed this step
    end: int
    num_drafts: int = 0  # speculative tokens verified after `end` (their slots are allocated)

    @property
    def samples(self) -> bool:
        """The whole input is computed after this step: a token is sampled from its logits."""
        return self.end == self.req.num_tokens


@dataclass
class ScheduledBatch:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    retracted: list[Request] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    def __init__(
        self,
        cache: SessionCache,
        config: SchedulerConfig,
        draft_len: Callable[[Request], int] | None = None,
    ) -> None:
        self.cache = cache
        self.config = config
        self.draft_len = draft_len or (lambda req: 0)
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

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ----
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        self._schedule_decodes(batch)
        budget = self.config.max_prefill_tokens
        for req in [r for r in self.running if not r.sampled]:  # chunked prefills under way
            budget = self._schedule_prefill(req, budget, batch)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_running_requests:
            req = self.waiting[0]
            if not self._admit(req, budget):
                break
            self.waiting.popleft()
            self.running.append(req)
            budget = self._schedule_prefill(req, budget, batch)
        return batch

    def _schedule_decodes(self, batch: ScheduledBatch) -> None:
        decodes = sorted((r for r in self.running if r.sampled), key=lambda r: r.timings.arrival)
        self.steps += 1
        every = self.config.force_retract_every
        if every and decodes and self.steps % every == 0:
            self._retract(decodes.pop(), batch)
        i, drafts = 0, []
        while i < len(decodes):
            req = decodes[i]
            k = self.draft_len(req)
            try:
                self._allocate_decode(req, k)
            except KVCacheFullError:
                try:  # no room for the drafts: decode one token this step
                    k = 0
                    self._allocate_decode(req, k)
                except KVCacheFullError:
                    self._retract(decodes.pop(), batch)  # the youngest; maybe `req` itself
                    continue
            drafts.append(k)
            i += 1
        batch.seqs.extend(
            ScheduledSeq(r, r.num_tokens - 1, r.num_tokens, k)
            for r, k in zip(decodes, drafts, strict=True)
        )

    def _allocate_decode(self, req: Request, num_drafts: int) -> None:
        """Slots for the pending token and its drafts; the pending token's is the 'bonus slot',
        claimed before the step. Drafts a failed verify leaves over are freed by the engine."""
        self.cache.allocate(req.kv, req.num_tokens + num_drafts)

    def _schedule_prefill(self, req: Request, budget: int, batch: ScheduledBatch) -> int:
        if budget <= 0:
            return budget
        start = req.kv.committed_len
        end = min(req.num_tokens, start + budget)
        try:
            self.cache.allocate(req.kv, end)
        except KVCacheFullError:
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
        req.retractions += 1
        self.retractions_total += 1
        self.running.remove(req)
        self.waiting.appendleft(req)
        batch.retracted.append(req)
