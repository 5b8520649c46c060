"""Drafting inside the engine's step: chain proposals before the verify, catch-up after it.

Per step, for requests that draft:
1. `propose`: the first draft comes from the request's `DraftState`; k-1 more drafter forwards
   (one token each, batched over requests) extend the chain. Entry q of the drafter writes its
   K/V to the request's slot q, inside the slots the scheduler allocated for the verify.
2. The engine verifies all drafts in one target forward and keeps the accepted prefix.
3. `catch_up`: one drafter forward over every position the target just committed, paired with
   the target's real hidden states; it overwrites the chain's guessed entries, so the drafter's
   KV holds exactly the committed positions, and its last output is the next first draft.
Prefill chunks go through step 3 too, so a session's parked KV is complete in both pools.

A greedy request may draft a tree instead (`propose_tree`, EAGLE-2's dynamic tree): each
level expands the `topk` most likely nodes so far (by the product of their path's draft
probabilities) into their `topk` best next tokens, and the `budget` most likely nodes of all
levels are verified. Each expanded node is one drafter entry attending to the committed
entries and its ancestors' (its own context list); entries use the request's allocated slots
past the committed ones as scratch, which the catch-up then overwrites.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sessionserve.cache.kv_pool import KVPool
from sessionserve.cache.session_cache import SessionCache
from sessionserve.replicas.attention import ATTN_NAME, AttentionBackend, ForwardMeta, SeqSpec
from sessionserve.replicas.attention.base import to_device
from sessionserve.replicas.request import Request
from sessionserve.replicas.sampling import draw, greedy_tokens, top_probability, uniforms
from sessionserve.replicas.speculative.draft_state import DraftState
from sessionserve.replicas.speculative.drafter import DraftHead
from sessionserve.replicas.step import CatchUp, Drafts

if TYPE_CHECKING:  # built by assembly.py, over this proposer
    from sessionserve.replicas.speculative.catch_up_graphs import CatchUpGraphs
    from sessionserve.replicas.speculative.chain_graphs import ChainGraphs
    from sessionserve.replicas.speculative.compiled_head import CompiledHead


def catch_up_pieces(entries: Sequence[CatchUp], limit: int) -> list[list[CatchUp]]:
    """`entries` cut into forwards of at most `limit` positions, in order. A long entry's
    spans go one per forward, each after the one that writes the K/V it attends to, and only
    its last span asks for the next guess."""
    pieces: list[list[CatchUp]] = [[]]
    used = 0
    for e in entries:
        for start in range(e.start, e.end, limit):
            end = min(start + limit, e.end)
            span = CatchUp(
                e.req,
                start,
                end,
                e.hidden[start - e.start : end - e.start],
                e.wants_draft and end == e.end,
            )
            if used + end - start > limit:
                pieces.append([])
                used = 0
            pieces[-1].append(span)
            used += end - start
    return pieces


class EagleProposer:
    def __init__(
        self,
        drafter: DraftHead,
        pool: KVPool,
        backend: AttentionBackend,
        cache: SessionCache,
        num_drafts: int,
        vocab_size: int,
        tree_topk: int = 1,
        min_confidence: float = 0.0,
    ) -> None:
        self.drafter = drafter
        self.pool = pool
        self.backend = backend
        self.cache = cache
        self.num_drafts = num_drafts
        self.vocab_size = vocab_size
        self.tree_topk = tree_topk
        # a chain goes on past a draft only while the product of its drafts' probabilities
        # under the head (what EAGLE-2 ranks tree nodes by: it tracks their acceptance) is at
        # least this: a draft unlikely to be kept costs a head step and a verify column
        self.min_confidence = min_confidence
        self.grows_trees = tree_topk > 1  # greedy requests keep their best first drafts
        self.device = next(drafter.parameters()).device
        drafter.config._attn_implementation = ATTN_NAME
        self.chain_graphs: ChainGraphs | None = None  # on CUDA (assembly.py)
        self.catch_up_graphs: CatchUpGraphs | None = None  # on CUDA (assembly.py)
        # whether a graph may be captured now: under overlap scheduling a catch-up runs when
        # a step lands, maybe beside the next step's forward, and a stream capture forbids
        # other threads' device work (the engine sets it; engine.py)
        self.may_capture: Callable[[], bool] = lambda: True
        # on CPU, the head's step compiled per input width (compiled_head.py), installed by
        # assembly.py (or its background build) for steps of up to `compiled_max_tokens`
        self.compiled: dict[int, CompiledHead] = {}
        self.compiled_max_tokens = 0
        # a catch-up past `compiled_max_tokens` runs as compiled pieces of that many positions
        # instead of one eager forward (assembly.py: in bf16 on a CPU, whose eager GEMMs
        # oneDNN builds for each new row count, and every catch-up's count is new: 100-300
        # positions took 50-90 ms eagerly while serving, 7-23 ms in pieces; in fp32 one eager
        # forward is 2-2.7x faster than the pieces, docs/benchmarks.md)
        self.pieces_past_package = False

    @staticmethod
    def eligible(req: Request) -> bool:
        """Penalties depend on every earlier output token, drafts included: such requests
        decode one token at a time (still in the same batch)."""
        return not req.sampling.has_penalties

    def drafts_on(self, likely: float) -> bool:
        """A chain drafts past a draft while the product of its drafts' probabilities under
        the head (`likely`) is at `min_confidence`: the one rule of the eager loop and the
        chain graphs (chain_graphs.py), so both cut a chain at the same draft."""
        return likely >= self.min_confidence

    def draft_len(self, req: Request, limit: int) -> int:
        """Drafts for `req`'s next step: k, fewer near the context limit, 0 without a guess."""
        if req.draft is None or not self.eligible(req):
            return 0
        return max(0, min(self.num_drafts, limit - req.num_tokens))

    # ---- 1. chain ----
    @torch.inference_mode()
    def propose(self, reqs: Sequence[Request], lengths: Sequence[int]) -> list[Drafts]:
        """`lengths[i]` drafts for `reqs[i]` (each has a DraftState; its pending token is at
        position num_tokens - 1, and slots up to num_tokens - 1 + lengths[i] are allocated)."""
        if self.chain_graphs is not None and len(set(lengths)) == 1:
            rest = self.chain_graphs.run(reqs, lengths[0])
            if rest is not None:  # greedy rows, drafted on the device in one graph
                pairs = zip(reqs, rest, strict=True)
                return [Drafts([r.draft.token, *more], None) for r, more in pairs]
        chains = [[r.draft.token] for r in reqs]
        probs = [[r.draft.probs] for r in reqs]
        feats = [r.draft.feature for r in reqs]
        confidence = [r.draft.confidence for r in reqs]  # of each chain so far
        for j in range(1, max(lengths, default=0)):
            active = [i for i, n in enumerate(lengths) if n > j and self.drafts_on(confidence[i])]
            if not active:
                break
            ids, pos, out_slots, seqs = [], [], [], []
            for i in active:
                r = reqs[i]
                q = r.num_tokens - 1 + j - 1  # the entry pairs draft j with the feature before it
                ids.append(chains[i][-1])
                pos.append(q)
                out_slots.append(self.cache.slots(r.kv, q, q + 1))
                seqs.append(SeqSpec(1, self.cache.slots(r.kv, 0, q + 1)))
            hidden = torch.stack([feats[i] for i in active])
            rows = list(range(len(active)))
            out, logits = self._forward(ids, hidden, pos, torch.cat(out_slots), seqs, rows)
            picked = self._choose(out, [reqs[i] for i in active], logits)
            for row, i in enumerate(active):
                chains[i].append(picked.tokens[row])
                probs[i].append(picked.dists[row])
                feats[i] = out[row]
                confidence[i] *= picked.confidence[row]
        result = []
        for i, r in enumerate(reqs):
            n = min(lengths[i], len(chains[i]))  # a chain its confidence stopped is shorter
            p = None if r.sampling.is_greedy else torch.stack(probs[i][:n])
            result.append(Drafts(chains[i][:n], p))
        return result

    # ---- 1b. tree ----
    @torch.inference_mode()
    def propose_tree(
        self, reqs: Sequence[Request], depths: Sequence[int], budget: int
    ) -> list[Drafts]:
        """A tree of at most `budget` drafts, `depths[i]` levels deep, for each greedy
        request (its DraftState has `candidates`; slots for `scratch_slots(depth, budget)`
        drafts past its pending token are allocated). With `min_confidence` the tree stops
        where the chain would: only nodes whose path is that likely are expanded, and a
        node is verified if it is its parent's best child or is that likely itself (with
        `tree_topk` 1, exactly the chain), so an unsure step verifies a few drafts, not the
        whole budget."""
        floor = math.log(self.min_confidence) if self.min_confidence > 0 else -math.inf
        trees, committed = [], []  # committed: the entries every node of a request sees
        for r, depth in zip(reqs, depths, strict=True):  # a scratch slot per expanded node
            first = r.num_tokens - 1
            scratch = self.cache.slots(r.kv, first, first + self.tree_topk * (depth - 1))
            trees.append(_Tree.first_level(r.draft, self.tree_topk, scratch))
            committed.append(self.cache.slots(r.kv, 0, first))
        for level in range(1, max(depths, default=0)):
            rows = [
                (i, node)
                for i, t in enumerate(trees)
                if depths[i] > level
                for node in t.frontier(level, self.tree_topk, floor)
            ]
            if not rows:
                break
            ids, hidden, pos, out_slots, seqs = [], [], [], [], []
            for i, node in rows:
                r, t = reqs[i], trees[i]
                slot = t.claim_entry(node)
                ids.append(t.tokens[node])
                hidden.append(t.input_feature(node, r.draft.feature))
                pos.append(r.num_tokens - 1 + level - 1)
                out_slots.append(slot)
                seqs.append(SeqSpec(1, torch.cat((committed[i], t.context_slots(node)))))
            every = list(range(len(rows)))
            out, logits = self._forward(
                ids, torch.stack(hidden), pos, torch.cat(out_slots), seqs, every
            )
            if logits is None:
                logits = self.drafter.draft_logits(out)
            logp = logits.float().log_softmax(-1)
            top = logp.topk(self.tree_topk, dim=-1)
            picks = self.drafter.to_target(top.indices).tolist()
            for row, (i, node) in enumerate(rows):
                trees[i].expand(node, out[row], picks[row], top.values[row].tolist())
        return [t.select(budget, floor) for t in trees]

    def scratch_slots(self, depth: int, budget: int) -> int:
        """Draft slots a tree `depth` levels deep needs past the pending token: its
        `budget` verified drafts, and one drafter entry per expanded node (the pending
        token's slot is one of them)."""
        return max(budget, self.tree_topk * (depth - 1) - 1)

    # ---- 3. catch-up ----
    @torch.inference_mode()
    def catch_up(self, entries: Sequence[CatchUp]) -> None:
        """Write the drafter's K/V for committed positions; refresh each request's guess.
        A catch-up longer than the compiled head step takes (a prompt, or the positions put
        off while drafting was off) runs eagerly, or with `pieces_past_package` as several
        compiled forwards (see there)."""
        entries = [e for e in entries if e.end > e.start]
        if not entries:
            return
        if self.catch_up_graphs is not None and self.catch_up_graphs.run(entries):
            return  # replayed: every entry has its guess
        width = entries[0].hidden.shape[-1]
        limit = self.compiled_max_tokens
        if not self.pieces_past_package or self.compiled.get(width) is None or limit <= 0:
            self._catch_up(entries)
            return
        for piece in catch_up_pieces(entries, limit):
            self._catch_up(piece)

    def _catch_up(self, entries: list[CatchUp]) -> None:
        """One drafter forward over `entries` (each request at most once)."""
        ids, pos, out_slots, seqs, hidden, last = [], [], [], [], [], []
        for e in entries:
            n = e.end - e.start
            ids.extend(e.req.token_slice(e.start + 1, e.end + 1))
            pos.extend(range(e.start, e.end))
            out_slots.append(self.cache.slots(e.req.kv, e.start, e.end))
            seqs.append(SeqSpec(n, self.cache.slots(e.req.kv, 0, e.end)))
            hidden.append(e.hidden)
            last.append(len(ids) - 1)
        wanting = [i for i, e in enumerate(entries) if e.wants_draft]
        rows = [last[i] for i in wanting]
        out, logits = self._forward(ids, torch.cat(hidden), pos, torch.cat(out_slots), seqs, rows)
        for e in entries:
            e.req.draft = None
        if not wanting:
            return
        feats = out.index_select(0, to_device(torch.tensor(rows), out.device))
        reqs = [entries[i].req for i in wanting]
        picked = self._choose(feats, reqs, logits)
        for row, r in enumerate(reqs):
            r.draft = DraftState(
                picked.tokens[row],
                feats[row],
                picked.dists[row],
                picked.candidates[row],
                picked.confidence[row],
            )

    # ---- internals ----
    def _forward(
        self,
        ids: list[int],
        hidden: torch.Tensor,
        positions: list[int],
        out_slots: torch.Tensor,
        seqs: list[SeqSpec],
        logit_rows: list[int],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The head's output [T, h] and, where its compiled step ran, the draft logits of
        `logit_rows` (else None: the caller scores the rows it needs eagerly)."""
        dev, n = self.device, len(ids)
        # one copy up, from pinned memory on a GPU: a copy from pageable memory would first
        # wait for everything the device has queued (three such a forward, before)
        host = torch.cat((torch.tensor(ids), torch.tensor(positions), out_slots))
        ids_t, pos_t, slots = to_device(host, dev).split((n, n, len(out_slots)))
        meta = ForwardMeta(
            backend=self.backend,
            kv_pool=self.pool,
            out_slots=slots,
            plan=self.backend.prepare(seqs, dev),
        )
        hidden = hidden.to(dev)
        compiled = self.compiled.get(hidden.shape[-1])
        if compiled is not None and n <= self.compiled_max_tokens:
            rows = torch.tensor(logit_rows, dtype=torch.int64, device=dev)  # (CPU only)
            logits, out = compiled.run(ids_t, hidden, pos_t, rows, meta)
            return out, logits
        out = self.drafter.features(ids_t[None], hidden[None], pos_t[None], paged_meta=meta)
        return out[0], None

    def _choose(
        self,
        feats: torch.Tensor,
        reqs: Sequence[Request],
        logits: torch.Tensor | None = None,
    ) -> HeadPicks:
        """Greedy requests take the argmax; sampled ones draw from softmax(logits / T) and
        keep that distribution (over the target vocabulary) for the acceptance test. With
        trees, each greedy request's `tree_topk` best tokens and their log-probabilities too.
        `logits`: the draft logits of `feats` where the compiled step already computed them."""
        logits = (self.drafter.draft_logits(feats) if logits is None else logits).float()
        picks = greedy_tokens(logits)
        confidence = top_probability(logits).tolist()  # the argmax's probability
        dist: list[torch.Tensor | None] = [None] * len(reqs)
        for i, r in enumerate(reqs):
            if not r.sampling.is_greedy:
                p = (logits[i] / r.sampling.temperature).softmax(-1)
                picks[i] = draw(p[None], uniforms([r.draft_generator]))[0]
                confidence[i] = p[picks[i]].item()  # the drawn token's
                dist[i] = self.drafter.target_probs(p, self.vocab_size)
        candidates: list[tuple[list[int], list[float]] | None] = [None] * len(reqs)
        if self.grows_trees:
            top = logits.log_softmax(-1).topk(self.tree_topk, dim=-1)
            ids, scores = self.drafter.to_target(top.indices).tolist(), top.values.tolist()
            for i, r in enumerate(reqs):
                if r.sampling.is_greedy:
                    candidates[i] = (ids[i], scores[i])
        return HeadPicks(self.drafter.to_target(picks).tolist(), dist, candidates, confidence)


@dataclass
class HeadPicks:
    """The head's choice for each row: the token (a target id), the distribution a sampled
    row drew it from (over the target vocabulary; None for greedy rows), a greedy row's best
    first-level candidates when growing trees, and the chosen token's probability."""

    tokens: list[int]
    dists: list[torch.Tensor | None]
    candidates: list[tuple[list[int], list[float]] | None]
    confidence: list[float]


@dataclass
class _Tree:
    """One request's tree while it grows: every node drafted so far (token, parent, level,
    score = log-probability of its path, rank among its siblings), and for expanded nodes
    their drafter entry's slot and output (the input feature of their children)."""

    tokens: list[int]
    parents: list[int]
    levels: list[int]
    scores: list[float]
    ranks: list[int]
    scratch: torch.Tensor  # the slots expanded nodes' entries take, in order
    entry_slot: dict[int, torch.Tensor]
    output: dict[int, torch.Tensor]
    used: int = 0

    @classmethod
    def first_level(cls, draft: DraftState, topk: int, scratch: torch.Tensor) -> _Tree:
        assert draft.candidates is not None, "a tree needs the head's first-level candidates"
        ids, scores = draft.candidates
        ids, scores = ids[:topk], scores[:topk]
        n = len(ids)
        return cls(list(ids), [-1] * n, [1] * n, list(scores), list(range(n)), scratch, {}, {})

    def frontier(self, level: int, topk: int, floor: float = -math.inf) -> list[int]:
        """The `topk` most likely nodes of `level` whose path's log-probability is at least
        `floor` (those expanded next)."""
        nodes = [i for i, lv in enumerate(self.levels) if lv == level and self.scores[i] >= floor]
        return sorted(nodes, key=lambda i: -self.scores[i])[:topk]

    def claim_entry(self, node: int) -> torch.Tensor:
        """The next scratch slot for `node`'s drafter entry (the pending token's slot first,
        then the draft slots past it)."""
        slot = self.scratch[self.used : self.used + 1]
        self.used += 1
        self.entry_slot[node] = slot
        return slot

    def input_feature(self, node: int, root_feature: torch.Tensor) -> torch.Tensor:
        parent = self.parents[node]
        return root_feature if parent < 0 else self.output[parent]

    def context_slots(self, node: int) -> torch.Tensor:
        """The entries `node`'s entry attends to past the committed ones: its ancestors'
        and its own, root first."""
        chain, i = [], node
        while i >= 0:
            chain.append(self.entry_slot[i])
            i = self.parents[i]
        return torch.cat(chain[::-1])

    def expand(self, node: int, output: torch.Tensor, tokens: list[int], logps: list[float]):
        self.output[node] = output
        for rank, (token, lp) in enumerate(zip(tokens, logps, strict=True)):
            self.ranks.append(rank)
            self.tokens.append(token)
            self.parents.append(node)
            self.levels.append(self.levels[node] + 1)
            self.scores.append(self.scores[node] + min(lp, 0.0))  # never above the parent

    def select(self, budget: int, floor: float = -math.inf) -> Drafts:
        """The `budget` most likely nodes among those worth verifying (each its parent's best
        child, or at least `floor` likely: a node's parent was expanded, so it was that
        likely), parents before children. A child is never likelier than its parent, and ties
        go to the shallower node, so the set keeps every kept node's ancestors."""
        worth = [
            i for i in range(len(self.tokens)) if self.ranks[i] == 0 or self.scores[i] >= floor
        ]
        best = sorted(worth, key=lambda i: (-self.scores[i], self.levels[i]))
        kept = sorted(best[:budget], key=lambda i: (self.levels[i], i))
        index = {node: j for j, node in enumerate(kept)}
        parents = [-1 if self.parents[n] < 0 else index[self.parents[n]] for n in kept]
        return Drafts([self.tokens[n] for n in kept], None, parents)
