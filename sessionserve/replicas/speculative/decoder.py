"""Speculative decoding inside the engine's step: choose each request's drafts, propose them
before the forward, verify after it, catch the EAGLE head up on what was committed.

    ks = speculative.draft_lens(reqs)         # the scheduler allocates their draft slots
    drafts = speculative.propose(batch)       # chains/trees for the decodes that speculate
    out = runner.run_prepared(...)            # one target forward over inputs and drafts
    speculative.verify(batch, drafts, out)    # accepted runs into `out`, their KV committed
    updates = scheduler.process(batch, out)   # commits, appends, stop checks
    speculative.catch_up(batch, out, updates) # the EAGLE head over the committed positions
    scheduler.finish(updates)                 # finished requests give their KV back
    speculative.finish_step(batch, out)       # the step's cost and yield -> the policy

The engine makes every call but `draft_lens`, which the scheduler makes while it allocates.
Under overlap scheduling (`engine.overlap_schedule`) a step without drafts is proposed for
(nothing), submitted, and completed (catch-up, finish_step) when it lands, after the next step
was scheduled; a step with drafts runs with nothing in flight (the scheduler stalls for it).
So the policy's choice made when step N lands applies to the first step scheduled after it,
and a step scheduled before that choice does not make a new one when it lands.

Drafts come from an EAGLE head (proposer.py), from the sequence's own history (history.py), or
from either, per request and step: the source whose record promises more tokens, or the next
one where that source's drafts are all too unlikely to be kept. With `adaptive`, a history
chain stops where its record (how often its first draft, and a draft after a kept one, were
kept) says a draft is less likely to be kept than `min_confidence` or than what a draft costs
at this batch size (the policy's measured floor), where the head's chains stop by their own
drafts' probabilities (proposer.py), and the policy (policy.py) turns drafting off for the
batch sizes where it measures no gain. With a `tree`
shape, greedy requests that draft from the head draft a tree (proposer.py) instead of a
chain; the kept path's KV moves to its sequence's positions before it is committed.

It owns the drafters' share of the step: proposals, acceptance, committing a verify's accepted
KV and freeing the rejected drafts' slots, and the statistics.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from sessionserve.cache.kv_pool import KVPool
from sessionserve.cache.session_cache import SessionCache
from sessionserve.replicas.attention.base import to_device
from sessionserve.replicas.request import Request
from sessionserve.replicas.sampling import filtered_probs, greedy_tokens, token_logprobs
from sessionserve.replicas.speculative.acceptance import (
    accept_greedy,
    accept_greedy_tree,
    accept_sampled,
)
from sessionserve.replicas.speculative.draft_state import DraftSource
from sessionserve.replicas.speculative.history import HistoryProposer
from sessionserve.replicas.speculative.policy import SpecPolicy
from sessionserve.replicas.speculative.proposer import EagleProposer
from sessionserve.replicas.speculative.stats import SpecStats
from sessionserve.replicas.step import (
    CatchUp,
    Drafts,
    ScheduledBatch,
    ScheduledSeq,
    SeqUpdate,
    StepOutput,
)

# positions whose EAGLE catch-up may wait while a request does not draft (their hidden states
# are kept: 2.3 KB a token for SmolLM2 in fp32); past it, the catch-up runs anyway
MAX_DEFERRED = 512


@dataclass
class StepMark:
    """What the decoder notes about a step from its proposal to its end: the policy choice it
    was scheduled under, when its timing started (decode-only steps, with a policy), whether
    its catch-up paid for positions of earlier steps, and how long the head's pass took."""

    choice: int
    started: float | None
    caught_up_deferred: bool = False
    head_s: float = 0.0  # the head's catch-up pass of this step (timed with a policy)
    head_positions: int = 0  # the positions that pass covered
    put_off: int = 0  # positions committed this step whose pass waits instead


@dataclass(frozen=True)
class TreeShape:
    """EAGLE-2 trees: `topk` branches per expanded node, at most `budget` drafts verified;
    the depth is the chain length the request would draft."""

    topk: int
    budget: int


class SpeculativeDecoder:
    def __init__(
        self,
        cache: SessionCache,
        on_verify: Callable[[int], None],
        limit: int,
        eagle: EagleProposer | None = None,
        history: HistoryProposer | None = None,
        policy: SpecPolicy | None = None,
        tree: TreeShape | None = None,
        target_pool: KVPool | None = None,
        min_confidence: float = 0.0,
    ) -> None:
        if eagle is None and history is None:
            raise ValueError("speculative decoding needs an EAGLE head or history drafts")
        self.eagle = eagle
        self.history = history
        self.cache = cache
        self.on_verify = on_verify  # told each verify's acceptance length (metrics)
        self.limit = limit  # the context limit: no drafts past it
        self.policy = policy  # None: always draft, full chains
        # with a policy, a history chain's drafts stop where their chance of being kept falls
        # below this (`_cap`); the head's chains stop there by their own probabilities
        self.min_confidence = min_confidence
        if tree is not None and (eagle is None or target_pool is None):
            raise ValueError("tree drafts need an EAGLE head and the target's KV pool")
        self.tree = tree
        self.target_pool = target_pool  # a kept tree path's KV moves within it
        self.stats = SpecStats()
        self.by_source: dict[str, SpecStats] = {}
        self.drafting = True  # the policy's choice for the coming step
        self.draft_floor = 0.0  # the policy's measured floor for the coming step's drafts
        self.choices = 0  # how many choices the policy made (a step's mark names the last)
        self._marks: dict[int, StepMark] = {}  # by step number, from propose to finish_step
        self._last_end: float | None = None  # when the last step ended (with a policy)
        # whether a session turn may leave a put-off catch-up of this many more bytes to its
        # next turn (the engine sets it from the sessions' memory budget; engine.py)
        self.may_carry: Callable[[int], bool] = lambda nbytes: False
        # the most tokens a step runs compiled, longer ones eagerly (None: no such edge; the
        # runner's `widest_compiled_step`, set by assembly.py): `draft_lens` keeps verifies in it
        self.widest_step: Callable[[], int | None] = lambda: None

    @property
    def wants_hidden(self) -> bool:
        """The EAGLE head drafts from the target's hidden states."""
        return self.eagle is not None

    # ---- before the forward ----
    def draft_lens(self, reqs: list[Request]) -> list[int]:
        """The draft slots each of a step's decodes needs (`draft_len`), cut where the verify
        would fall off the compiled packages (`widest_step`, in the step's own tokens: the
        decode step package pads rows of unequal widths for its attention alone). A verify
        past the packages' tokens runs eagerly, where it costs more than the drafts a shorter
        chain verifies within them (SmolLM2 on 2 AVX2 cores, the agent workload at 32
        requests: at 16-31 rows, 5-token chains cost 4.2x a decode step eagerly and the policy
        stopped drafting there; cut to the decode package's 64 tokens, 1-2 drafts a row cost
        1.6x and drafting paid 1.36x there, docs/benchmarks.md). So chains are cut to the
        longest that keeps the step within the widest, where that leaves at least one draft;
        where it does not, the drafts stay as they are and the policy weighs what they cost.
        Not cut: trees (their shape is drawn before), and a seeded sampled request's chain,
        whose length must not depend on the load (`_may_draft`)."""
        wanted = [self.draft_len(r) for r in reqs]
        widest = self.widest_step()
        if widest is None or len(reqs) + sum(wanted) <= widest:
            return wanted
        if any(r.drafting.tree_depth for r in reqs):
            return wanted
        seeded = [self._seeded(r) for r in reqs]
        for room in range(max(wanted) - 1, 0, -1):  # drafts a row may verify
            cut = [k if s else min(k, room) for s, k in zip(seeded, wanted, strict=True)]
            if len(reqs) + sum(cut) <= widest:
                return cut
        return wanted

    def draft_len(self, req: Request) -> int:
        """Drafts the scheduler allocates slots for in `req`'s next decode step, and from which
        source; none for a constrained request (its drafts would have to pass its grammar's
        mask too) or one with penalties (they depend on every earlier token, drafts included)."""
        d = req.drafting
        d.source, d.copying, d.tree_depth = None, False, 0
        p = req.sampling
        if req.grammar is not None or p.has_penalties:
            return 0
        if not self._may_draft(req):
            return 0
        offers: list[tuple[float, int, DraftSource]] = []
        if self.history is not None:
            self._judge_offered(req)
            n = self.history.draft_len(req, self.limit)
            if n:
                offers.append((self._expected(req, "history", n), n, "history"))
                d.offered.append((req.num_tokens, d.history_tokens[:n]))
        if self.eagle is not None:
            n = self.eagle.draft_len(req, self.limit)
            if n:
                offers.append((self._expected(req, "eagle", n), n, "eagle"))
        for _, offered, source in sorted(offers, reverse=True):
            n = self._cap(req, source, offered)
            if n:  # (0: its drafts are too unlikely to be kept; the next source may draft)
                d.source = source
                break
        else:
            return 0
        if d.source == "eagle" and self._drafts_tree(req, n):
            d.tree_depth = n
            return self.eagle.scratch_slots(n, self.tree.budget)
        return n

    def _drafts_tree(self, req: Request, depth: int) -> bool:
        """A greedy request with the head's first-level candidates, room for the tree's
        slots, and a tree worth more than a chain (deeper than one level)."""
        if self.tree is None or depth < 2 or not req.sampling.is_greedy:
            return False
        if req.draft is None or req.draft.candidates is None:
            return False
        return req.num_tokens + self.eagle.scratch_slots(depth, self.tree.budget) <= self.limit

    def _judge_offered(self, req: Request) -> None:
        """The history chains offered at earlier steps are judged by the tokens the sequence
        made at their positions, as a verify of the whole chain would have judged them (for a
        sampled request a draft equal to the token made is kept with the chance its verify
        keeps it), and the record learns from that: so a chain that `_cap` cut short, or a
        request that drafts nothing because its drafts are unlikely to be kept, still learns
        how far its chains would have been kept (a record fed by verifies alone learns nothing
        past a cut, and a request that stopped drafting would never draft again). A chain
        stays undecided while every token made so far agrees and it goes on past them."""
        d = req.drafting
        undecided = []
        for at, drafts in d.offered:
            made = req.token_slice(at, min(req.num_tokens, at + len(drafts)))
            kept = 0
            while kept < len(made) and made[kept] == drafts[kept]:
                kept += 1
            if kept == len(made) < len(drafts):
                undecided.append((at, drafts))
            else:
                d.record("history").observe(len(drafts), kept)
        d.offered = undecided

    def _may_draft(self, req: Request) -> bool:
        """The policy's choice, except for a seeded sampled request: a timing-driven choice
        would make its answer depend on the load, so it drafts by its own record only."""
        return self.drafting or self._seeded(req)

    @staticmethod
    def _seeded(req: Request) -> bool:
        p = req.sampling
        return p.seed is not None and not p.is_greedy

    def _floor(self, req: Request) -> float:
        """The policy's measured floor for `req`'s drafts (none for a seeded sampled request:
        how many drafts it verifies must not depend on timing, as `_may_draft` says)."""
        return 0.0 if self._seeded(req) else self.draft_floor

    def _expected(self, req: Request, source: DraftSource, n: int) -> float:
        """Drafts expected to be kept from a chain of `n` by this source's recent record."""
        return req.drafting.record(source).expected(n)

    def _cap(self, req: Request, source: DraftSource, n: int) -> int:
        """Of `n` drafts offered, how many to verify (0: none). With a policy, a history chain
        stops where its drafts' chance of being kept (by its record:
        `SourceRecord.kept_through`) falls below `min_confidence`, the floor the head's chains
        stop at by their own probabilities (proposer.py), or below what a draft costs at this
        batch size, in rows of a plain step (`SpecPolicy.draft_floor`), where that is more: a
        draft unlikely to be kept costs a verify column, and at 32 requests a column costs
        ~0.6 of a row, so a chain that pays at one request loses there. The head's chains
        are left to their own probabilities, which tell a likely run from an unlikely one at
        each step where a record knows only the recent past (the measured floor is not put
        on them: a head's probabilities need not be calibrated, and the tiny test heads keep
        most drafts they give 0.02). A source declined here leaves the request to the next
        most promising one. (Capped at what recent
        verifies kept on average, plus one, as before, the chains of an answer that loops,
        kept all or nothing, were cut short: 2.41x against 3.52x on the agent workload at one
        request, SmolLM2 bf16, docs/benchmarks.md.)"""
        record = req.drafting.record(source)
        if self.policy is None or record.verifies == 0 or source == "eagle":
            return n
        return record.likely_len(n, max(self.min_confidence, self._floor(req)))

    def propose(self, batch: ScheduledBatch) -> dict[str, Drafts]:
        """Drafts (chains, or trees) for the decodes that speculate this step (by request id);
        called for every step, with drafts or not, once it is scheduled."""
        started = None
        if self.policy is not None and all(  # a decode-only step: timed for the policy
            s.end - s.start == 1 and s.samples for s in batch.seqs
        ):
            started = self.policy.clock()
        self._marks[batch.step] = StepMark(self.choices, started)
        seqs = [s for s in batch.seqs if s.num_drafts]
        chains: dict[str, Drafts] = {}
        for s in seqs:
            if s.req.drafting.source == "history":
                chains[s.req.rid] = self.history.propose(s.req, s.num_drafts)
        heads = [s for s in seqs if s.req.drafting.source == "eagle"]
        trees = [s for s in heads if s.req.drafting.tree_depth]
        heads = [s for s in heads if not s.req.drafting.tree_depth]
        if heads:
            proposed = self.eagle.propose([s.req for s in heads], [s.num_drafts for s in heads])
            chains.update((s.req.rid, c) for s, c in zip(heads, proposed, strict=True))
        if trees:
            assert self.tree is not None
            depths = [s.req.drafting.tree_depth for s in trees]
            grown = self.eagle.propose_tree([s.req for s in trees], depths, self.tree.budget)
            chains.update((s.req.rid, t) for s, t in zip(trees, grown, strict=True))
        return chains

    # ---- after the forward ----
    def verify(self, batch: ScheduledBatch, drafts: dict[str, Drafts], out: StepOutput) -> None:
        """Each speculating sequence keeps the drafts the target agrees with, plus the target's
        own next token; a verify that raises ends that request alone. The target's argmax
        over every logits row is taken once for the step's greedy rows (one read back)."""
        verifying = [s for s in batch.seqs if s.num_drafts]
        greedy = any(s.req.sampling.is_greedy for s in verifying)
        best = greedy_tokens(out.logits).tolist() if greedy else []
        for s in verifying:
            try:
                out.emitted[s.req.rid] = self._verify(s, drafts[s.req.rid], out, best)
            except Exception as e:
                out.errors[s.req.rid] = e

    def _verify(
        self, s: ScheduledSeq, chain: Drafts, out: StepOutput, best: list[int]
    ) -> tuple[list, list]:
        """Accept a prefix of the chain (a path of the tree); commit its KV (and the pending
        token's), free the rejected drafts' slots now. `best`: the target's argmax at every
        logits row of the step (greedy rows read theirs)."""
        req, k, row = s.req, len(chain.tokens), out.layout[s.req.rid].logit_row
        target = out.logits[row : row + k + 1]
        p = req.sampling
        rows = None  # the logits rows of the kept tokens, where not the first ones
        if chain.parents is not None:
            verdict, path = accept_greedy_tree(best[row : row + k + 1], chain.tokens, chain.parents)
            self._keep_path(s, path, out)
            rows = [0] + [1 + i for i in path]
            depth = max(chain.depths())
        elif p.is_greedy:
            verdict, depth = accept_greedy(best[row : row + k + 1], chain.tokens), k
        else:
            probs = filtered_probs(target.float(), p)
            verdict = accept_sampled(probs, chain.probs, chain.tokens, req.generator)
            depth = k
        self.cache.commit(req.kv, s.end + verdict.accepted)
        self.cache.free_overallocation(req.kv)
        source = req.drafting.source or "eagle"
        if source == "eagle":  # (a history chain's record learns from `_judge_offered`)
            req.drafting.record(source).observe(depth, verdict.accepted)
        req.drafting.copying = source == "history" and verdict.accepted == k
        req.spec.record(k, verdict.accepted)
        self.stats.record(k, verdict.accepted)
        self.by_source.setdefault(source, SpecStats()).record(k, verdict.accepted)
        self.on_verify(verdict.accepted + 1)
        kept = target[: len(verdict.tokens)] if rows is None else target[rows]
        lps = token_logprobs(kept.float(), verdict.tokens, p.top_logprobs) if p.logprobs else []
        return verdict.tokens, lps

    @torch.inference_mode()
    def _keep_path(self, s: ScheduledSeq, path: list[int], out: StepOutput) -> None:
        """Move a verified tree path's K/V (and hidden states, which the catch-up reads) from
        its drafts' slots and rows to those of the positions it now holds: draft `path[j]`
        becomes position `s.end + j`."""
        moves = [(i, j) for j, i in enumerate(path) if i != j]
        if not moves:
            return
        assert self.target_pool is not None
        slots = self.cache.slots(s.req.kv, s.end, s.end + max(i for i, _ in moves) + 1)
        moved = torch.tensor(moves).T  # [2, n]: drafts' offsets, then the positions'
        first = out.layout[s.req.rid].flat_start + 1 if out.hidden is not None else 0
        # the pool's slots and the hidden rows, both ways, in one pinned copy up: a pageable
        # one would make the host wait for the device
        host = torch.cat((slots[moved].to(moved.dtype), first + moved))
        up = to_device(host, self.target_pool.k.device)
        self.target_pool.copy_slots(up[0], up[1])
        if out.hidden is not None:
            out.hidden[up[3]] = out.hidden[up[2]]

    def catch_up(self, batch: ScheduledBatch, out: StepOutput, updates: list[SeqUpdate]) -> None:
        """Decide whether the next step drafts; then the EAGLE head's pass over every position
        committed this step (see proposer.py), before finished requests give their KV back.
        Requests that go on decoding get a guess when the next step drafts from the head; when
        it does not (the policy turned drafting off, the request copies its history, or it
        cannot draft), their pass waits (with the hidden states) until a guess is wanted or
        the request ends, so the head costs nothing on steps that do not use it; a session
        turn that ends with it waiting leaves it to the session's next turn. Skipped:
        failed requests, and (overlap scheduling) requests that ended while this step ran:
        their KV is gone, and its slots may be another request's."""
        skip = {u.req.rid for u in updates if u.error}
        decoding = {u.req.rid for u in updates if not (u.error or u.finished)}
        mark = self._marks.get(batch.step)
        # a step after which nothing decodes leaves the choice as it was: made for no one, it
        # would count as a re-check and decide whether an ending turn catches the head up
        if self.policy is not None and decoding and (mark is None or mark.choice == self.choices):
            owed = sum(self._owed(s) for s in batch.seqs if s.req.rid in decoding)
            self.drafting = self.policy.choose(len(decoding), owed)
            self.draft_floor = self.policy.draft_floor(len(decoding)) or 0.0
            self.choices += 1
        if self.eagle is None or out.hidden is None:
            return
        entries = []
        for s in batch.seqs:
            req, d = s.req, s.req.drafting
            if req.rid in skip or not req.kv.is_live:
                d.drop_deferred()
                continue
            first, end = out.layout[req.rid].flat_start, req.kv.committed_len
            hidden: torch.Tensor = out.hidden[first : first + end - s.start]
            going_on = req.rid in decoding
            wants = going_on and self._may_draft(req) and self.eagle.eligible(req)
            wants = wants and not d.copying
            d.resume_at(s.start)
            puts_off = (going_on and not wants) or (
                not going_on and self._leaves_to_next_turn(req, hidden)
            )
            if puts_off and d.deferred_len(s.start) < MAX_DEFERRED:
                d.defer(s.start, hidden)  # no guess needed next step: catch up when one is
                req.draft = None
                if mark is not None:
                    mark.put_off += end - s.start
                continue
            start, hidden = d.take_deferred(s.start, hidden)
            if mark is not None:
                mark.caught_up_deferred |= start < s.start
            entries.append(CatchUp(req, start, end, hidden, wants))
        policy = self.policy if mark is not None else None
        started = policy.clock() if policy is not None else 0.0
        self.eagle.catch_up(entries)
        if policy is not None and mark is not None:
            mark.head_s = policy.clock() - started
            mark.head_positions = sum(e.end - e.start for e in entries)
            if mark.caught_up_deferred:  # what taking drafting up again costs (policy.py):
                # the head's pass over the positions deferred while the batch did not draft
                policy.observe_switch(mark.head_positions, mark.head_s)

    def _owed(self, s: ScheduledSeq) -> int:
        """Positions before this step whose head pass `s`'s request put off and would pay
        if it drafted from the head next (none for one that cannot, or copies its history)."""
        req, d = s.req, s.req.drafting
        if self.eagle is None or d.copying or not self.eagle.eligible(req):
            return 0
        return d.deferred_len(s.start)

    def _leaves_to_next_turn(self, req: Request, hidden: torch.Tensor) -> bool:
        """Whether a session turn ending with a put-off catch-up leaves it to the session's
        next turn (its owner carries `req.drafting.deferred` there): the pass then runs only
        if a later turn drafts from the head, and never for a session's last turn. Within
        `may_carry`'s memory budget. Also where the coming step drafts: a turn that ends as
        its batch shrinks to sizes where drafting pays would otherwise pay for the positions
        it put off while the batch was larger, for no step of its own (8 requests, SmolLM2:
        half the head's put-off passes, docs/benchmarks.md)."""
        d = req.drafting
        if req.session_id is None or d.deferred is None:
            return False
        return self.may_carry(d.deferred.nbytes + hidden.numel() * hidden.element_size())

    def finish_step(self, batch: ScheduledBatch, out: StepOutput) -> None:
        """Tell the policy what a decode-only step cost and yielded: from its proposal, or
        from the end of the step before it if that was later (under overlap scheduling a step
        is proposed while the previous one computes: what it adds is the time between their
        ends), to now. Not counted: steps with prefill chunks (other work), and drafting
        steps whose catch-up included positions deferred from earlier steps: that work is owed
        whichever way this step went, and a re-check that paid for a whole prompt would make
        drafting look several times dearer than it is. A plain step is timed without the
        head's pass, whatever it covered: plain decoding owes the head nothing (the pass it
        ran is the price of the drafting step after it, `observe_switch`). Excluding such a
        step instead left the plain figure unmeasured while drafting led: a plain re-check
        between drafting steps always pays the pass over the step before it (its positions
        wait because the re-check does not draft), so no re-check ever updated it. A drafting
        step whose own positions' pass waits (the next step does not draft) says so, and the
        policy prices that pass in."""
        mark = self._marks.pop(batch.step, None)
        if self.policy is None or mark is None:
            return
        now, last_end = self.policy.clock(), self._last_end
        self._last_end = now
        speculated = any(s.num_drafts for s in batch.seqs)
        if mark.started is None or (speculated and mark.caught_up_deferred):
            return
        started = mark.started if last_end is None else max(mark.started, last_end)
        seconds = now - started - (0.0 if speculated else mark.head_s)
        tokens = sum(len(emitted[0]) for emitted in out.emitted.values())
        self.policy.observe(
            len(batch.seqs),
            speculated,
            tokens,
            seconds,
            mark.head_s,
            mark.head_positions,
            mark.put_off,
            sum(s.num_drafts for s in batch.seqs),
        )
