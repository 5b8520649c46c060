"""Speculative decoding inside the engine's step: propose before the forward, verify after it,
catch the drafter up on what was committed.

    drafts = speculative.propose(batch)       # chains for the decodes that speculate
    out = runner.run(batch, drafts)           # one target forward over inputs and drafts
    speculative.verify(batch, drafts, out)    # accepted runs into `out`, their KV committed
    scheduler.process(batch, out)             # stops, then `catch_up`, then finishes

It owns the drafter's share of the step: the proposer, acceptance, committing a verify's
accepted KV and freeing the rejected drafts' slots, and the statistics.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import torch

from sessionserve.cache.session_cache import SessionCache
from sessionserve.replicas.request import Request
from sessionserve.replicas.sampling import filter_logits, token_logprobs
from sessionserve.replicas.speculative.acceptance import accept_greedy, accept_sampled
from sessionserve.replicas.speculative.proposer import EagleProposer
from sessionserve.replicas.speculative.stats import SpecStats
from sessionserve.replicas.step import (
    CatchUp,
    ChainDrafts,
    ScheduledBatch,
    ScheduledSeq,
    StepOutput,
)


class SpeculativeDecoder:
    def __init__(
        self,
        proposer: EagleProposer,
        cache: SessionCache,
        on_verify: Callable[[int], None],
        limit: int,
    ) -> None:
        self.proposer = proposer
        self.cache = cache
        self.on_verify = on_verify  # told each verify's acceptance length (metrics)
        self.limit = limit  # the context limit: no drafts past it
        self.stats = SpecStats()

    def draft_len(self, req: Request) -> int:
        """Drafts the scheduler allocates slots for in `req`'s next decode step (none for a
        constrained request: its drafts would have to pass its grammar's mask too)."""
        if req.grammar is not None:
            return 0
        return self.proposer.draft_len(req, self.limit)

    def propose(self, batch: ScheduledBatch) -> dict[str, ChainDrafts]:
        """Draft chains for the decodes that speculate this step (by request id)."""
        seqs = [s for s in batch.seqs if s.num_drafts]
        if not seqs:
            return {}
        chains = self.proposer.propose([s.req for s in seqs], [s.num_drafts for s in seqs])
        return {s.req.rid: c for s, c in zip(seqs, chains, strict=True)}

    def verify(
        self, batch: ScheduledBatch, drafts: dict[str, ChainDrafts], out: StepOutput
    ) -> None:
        """Each speculating sequence keeps the drafts the target agrees with, plus the target's
        own next token; a verify that raises ends that request alone."""
        for s in batch.seqs:
            if s.num_drafts:
                try:
                    out.emitted[s.req.rid] = self._verify(s, drafts[s.req.rid], out)
                except Exception as e:
                    out.errors[s.req.rid] = e

    def _verify(self, s: ScheduledSeq, chain: ChainDrafts, out: StepOutput) -> tuple[list, list]:
        """Accept a prefix of the chain; commit its KV (and the pending token's), free the
        rejected drafts' slots now."""
        req, k, row = s.req, len(chain.tokens), out.layout[s.req.rid].logit_row
        target = out.logits[row : row + k + 1].float()
        p = req.sampling
        if p.is_greedy:
            verdict = accept_greedy(target, chain.tokens)
        else:
            probs = filter_logits(target, p).softmax(-1)
            verdict = accept_sampled(probs, chain.probs, chain.tokens, req.generator)
        self.cache.commit(req.kv, s.end + verdict.accepted)
        self.cache.free_overallocation(req.kv)
        req.spec.record(k, verdict.accepted)
        self.stats.record(k, verdict.accepted)
        self.on_verify(verdict.accepted + 1)
        lps = (
            token_logprobs(target[: len(verdict.tokens)], verdict.tokens, p.top_logprobs)
            if p.logprobs
            else []
        )
        return verdict.tokens, lps

    def catch_up(
        self,
        batch: ScheduledBatch,
        out: StepOutput,
        decoding: Collection[str],
        skip: Collection[str],
    ) -> None:
        """The drafter's pass over every position committed this step (see proposer.py);
        `decoding`: requests that go on decoding (they get a guess); `skip`: requests that
        failed this step (their KV is gone)."""
        if out.hidden is None:
            return
        entries = []
        for s in batch.seqs:
            req = s.req
            if req.rid in skip:
                continue
            first, end = out.layout[req.rid].flat_start, req.kv.committed_len
            wants = req.rid in decoding and self.proposer.eligible(req)
            hidden: torch.Tensor = out.hidden[first : first + end - s.start]
            entries.append(CatchUp(req, s.start, end, hidden, wants))
        self.proposer.catch_up(entries)
