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
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sessionserve.cache.kv_pool import KVPool
from sessionserve.cache.session_cache import SessionCache
from sessionserve.replicas.attention import ATTN_NAME, AttentionBackend, ForwardMeta, SeqSpec
from sessionserve.replicas.request import Request
from sessionserve.replicas.sampling import draw, uniforms
from sessionserve.replicas.speculative.draft_state import DraftState
from sessionserve.replicas.speculative.drafter import DraftHead
from sessionserve.replicas.step import CatchUp, ChainDrafts


class EagleProposer:
    def __init__(
        self,
        drafter: DraftHead,
        pool: KVPool,
        backend: AttentionBackend,
        cache: SessionCache,
        num_drafts: int,
        vocab_size: int,
    ) -> None:
        self.drafter = drafter
        self.pool = pool
        self.backend = backend
        self.cache = cache
        self.num_drafts = num_drafts
        self.vocab_size = vocab_size
        self.device = next(drafter.parameters()).device
        drafter.config._attn_implementation = ATTN_NAME

    @staticmethod
    def eligible(req: Request) -> bool:
        """Penalties depend on every earlier output token, drafts included: such requests
        decode one token at a time (still in the same batch)."""
        return not req.sampling.has_penalties

    def draft_len(self, req: Request, limit: int) -> int:
        """Drafts for `req`'s next step: k, fewer near the context limit, 0 without a guess."""
        if req.draft is None or not self.eligible(req):
            return 0
        return max(0, min(self.num_drafts, limit - req.num_tokens))

    # ---- 1. chain ----
    @torch.inference_mode()
    def propose(self, reqs: Sequence[Request], lengths: Sequence[int]) -> list[ChainDrafts]:
        """`lengths[i]` drafts for `reqs[i]` (each has a DraftState; its pending token is at
        position num_tokens - 1, and slots up to num_tokens - 1 + lengths[i] are allocated)."""
        chains = [[r.draft.token] for r in reqs]
        probs = [[r.draft.probs] for r in reqs]
        feats = [r.draft.feature for r in reqs]
        for j in range(1, max(lengths, default=0)):
            active = [i for i, n in enumerate(lengths) if n > j]
            ids, pos, out_slots, seqs = [], [], [], []
            for i in active:
                r = reqs[i]
                q = r.num_tokens - 1 + j - 1  # the entry pairs draft j with the feature before it
                ids.append(chains[i][-1])
                pos.append(q)
                out_slots.append(self.cache.slots(r.kv, q, q + 1))
                seqs.append(SeqSpec(1, self.cache.slots(r.kv, 0, q + 1)))
            hidden = torch.stack([feats[i] for i in active])
            out = self._forward(ids, hidden, pos, torch.cat(out_slots), seqs)
            tokens, dist = self._choose(out, [reqs[i] for i in active])
            for row, i in enumerate(active):
                chains[i].append(tokens[row])
                probs[i].append(dist[row])
                feats[i] = out[row]
        result = []
        for i, r in enumerate(reqs):
            n = lengths[i]
            p = None if r.sampling.is_greedy else torch.stack(probs[i][:n])
            result.append(ChainDrafts(chains[i][:n], p))
        return result

    # ---- 3. catch-up ----
    @torch.inference_mode()
    def catch_up(self, entries: Sequence[CatchUp]) -> None:
        """Write the drafter's K/V for committed positions; refresh each request's guess."""
        entries = [e for e in entries if e.end > e.start]
        if not entries:
            return
        ids, pos, out_slots, seqs, hidden, last = [], [], [], [], [], []
        for e in entries:
            n = e.end - e.start
            ids.extend(e.req.token_slice(e.start + 1, e.end + 1))
            pos.extend(range(e.start, e.end))
            out_slots.append(self.cache.slots(e.req.kv, e.start, e.end))
            seqs.append(SeqSpec(n, self.cache.slots(e.req.kv, 0, e.end)))
            hidden.append(e.hidden)
            last.append(len(ids) - 1)
        out = self._forward(ids, torch.cat(hidden), pos, torch.cat(out_slots), seqs)
        wanting = [i for i, e in enumerate(entries) if e.wants_draft]
        for e in entries:
            e.req.draft = None
        if not wanting:
            return
        feats = out[[last[i] for i in wanting]]
        reqs = [entries[i].req for i in wanting]
        tokens, dist = self._choose(feats, reqs)
        for row, r in enumerate(reqs):
            r.draft = DraftState(tokens[row], feats[row], dist[row])

    # ---- internals ----
    def _forward(
        self,
        ids: list[int],
        hidden: torch.Tensor,
        positions: list[int],
        out_slots: torch.Tensor,
        seqs: list[SeqSpec],
    ) -> torch.Tensor:
        dev = self.device
        meta = ForwardMeta(
            backend=self.backend,
            kv_pool=self.pool,
            out_slots=out_slots.to(dev),
            plan=self.backend.prepare(seqs, dev),
        )
        out = self.drafter.features(
            torch.tensor([ids], device=dev),
            hidden.to(dev)[None],
            torch.tensor([positions], device=dev),
            paged_meta=meta,
        )
        return out[0]

    def _choose(
        self, feats: torch.Tensor, reqs: Sequence[Request]
    ) -> tuple[list[int], list[torch.Tensor | None]]:
        """Greedy requests take the argmax; sampled ones draw from softmax(logits / T) and
        keep that distribution (over the target vocabulary) for the acceptance test; the
        second list holds it per request (None for greedy ones)."""
        logits = self.drafter.draft_logits(feats).float()
        picks = logits.argmax(dim=-1)
        dist: list[torch.Tensor | None] = [None] * len(reqs)
        for i, r in enumerate(reqs):
            if not r.sampling.is_greedy:
                p = (logits[i] / r.sampling.temperature).softmax(-1)
                picks[i] = draw(p[None], uniforms([r.generator]))[0]
                dist[i] = self.drafter.target_probs(p, self.vocab_size)
        return self.drafter.to_target(picks).tolist(), dist
