"""The EAGLE head's chain drafting as one CUDA graph per (batch bucket, chain length, context
bucket): the k - 1 head steps after the first draft, greedy, with every draft kept on the
device until the chain ends (one read back instead of one per step).

Eagerly each head step is a Python loop over a few dozen kernels plus a read back of its
picks, so on a GPU a chain of 4 drafts costs about as much as the target's decode it is meant
to save. Replayed, the steps run back to back. What the graph needs is known before the chain
starts: each step's position and output slot are the request's next ones (the scheduler
allocated them for the verify), and its context is the one before plus that slot. Each step
also keeps its drafts' probabilities, read back with them, so a chain ends where the eager
loop's `min_confidence` stop would end it. Only
greedy requests drafting the same number of tokens take it (a sampled request keeps its draft
distributions for the acceptance test: the eager loop); the attention is the torch backend's
static decode plan, one per step, over the drafter's own pool (padding rows read and write
slot 0, as the target's decode graphs). With `capture=False` the same static path runs
eagerly: CPU tests check it against the eager loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from sessionserve.replicas.attention.base import ForwardMeta, SeqSpec, to_device
from sessionserve.replicas.attention.torch_backend import TorchPagedBackend
from sessionserve.replicas.cuda_graphs import bucket_for, capture, stage
from sessionserve.replicas.request import Request
from sessionserve.replicas.sampling import top_probability

if TYPE_CHECKING:  # the proposer holds its graphs
    from sessionserve.replicas.speculative.proposer import EagleProposer


@dataclass
class _ChainGraph:
    first_ids: torch.Tensor  # [B] each row's first draft (its pending token's guess)
    first_feature: torch.Tensor  # [B, F] the head's output that guessed it
    positions: torch.Tensor  # [S, B] step j's positions (S = chain length - 1)
    out_slots: torch.Tensor  # [S, B]
    plans: list[Any]  # step j's static decode plan over the drafter's pool
    # [2, S, B] the drafts each step picks (target vocabulary) and each one's probability
    # under the head, float64 so one read back takes both
    picks: torch.Tensor
    graph: Any = None


class ChainGraphs:
    """Graphs of the head's chain steps, captured on each shape's first use (see above)."""

    def __init__(
        self,
        proposer: EagleProposer,
        buckets: Sequence[int],
        backend: TorchPagedBackend,
        capture: bool = True,
    ) -> None:
        self.proposer, self.backend, self.capture = proposer, backend, capture
        self.buckets = tuple(sorted(buckets))
        self.graphs: dict[tuple[int, int, int], _ChainGraph] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.replays = 0

    def run(self, reqs: Sequence[Request], length: int) -> list[list[int]] | None:
        """Drafts 2..`length` for each of `reqs` (all greedy, each with a first draft), or
        None when no graph fits (the eager loop drafts them). A row's chain ends where the
        eager loop's would: at the draft that took the product of its drafts' probabilities
        below the proposer's `min_confidence` (the graph drafts every step; the drafts past
        that one are dropped, so they cost no verify column)."""
        size = bucket_for(len(reqs), self.buckets)
        if size is None or length < 2 or any(not r.sampling.is_greedy for r in reqs):
            return None
        cache, steps, n = self.proposer.cache, length - 1, len(reqs)
        # step j (0-based) writes the entry at position base + j (the pending token's is
        # base), pairing draft j + 1 with the feature before it, over the context up to it
        base = [r.num_tokens - 1 for r in reqs]
        full = [cache.slots(r.kv, 0, b + steps) for r, b in zip(reqs, base, strict=True)]
        per_step = [
            [SeqSpec(1, f[: b + j + 1]) for f, b in zip(full, base, strict=True)]
            for j in range(steps)
        ]
        width = self.backend.graph_key(per_step[-1])
        if width is None:
            return None
        g = self.graphs.get((size, steps, width)) or self._build(size, steps, width)
        dev = self.proposer.device
        pos = torch.zeros(steps, size, dtype=torch.int64)
        pos[:, :n] = torch.tensor(base)[None] + torch.arange(steps)[:, None]
        slots = torch.zeros(steps, size, dtype=torch.int64)
        slots[:, :n] = torch.stack([f[b : b + steps] for f, b in zip(full, base, strict=True)], 1)
        first = torch.zeros(size, dtype=torch.int64)
        first[:n] = torch.tensor([r.draft.token for r in reqs])
        buffers = (g.first_ids, g.positions.view(-1), g.out_slots.view(-1))
        stage(buffers, (first, pos.view(-1), slots.view(-1)), dev)
        features = torch.stack([r.draft.feature for r in reqs]).to(g.first_feature.dtype)
        g.first_feature[:n].copy_(to_device(features, dev), non_blocking=True)
        g.first_feature[n:].zero_()
        for plan, seqs in zip(g.plans, per_step, strict=True):
            self.backend.fill_decode(plan, seqs)
        if g.graph is not None:
            g.graph.replay()
        else:
            self._forward(g)
        self.replays += 1
        tokens, confidence = g.picks[:, :, :n].tolist()  # [S][n] each
        chains = []
        for i, r in enumerate(reqs):
            chain, likely = [], r.draft.confidence  # the first draft's
            for j in range(steps):
                if not self.proposer.drafts_on(likely):
                    break
                chain.append(int(tokens[j][i]))
                likely *= confidence[j][i]
            chains.append(chain)
        return chains

    @torch.inference_mode()
    def _forward(self, g: _ChainGraph) -> None:
        """The chain: each step's picks are the next step's inputs, its output the next
        step's feature, all on the device."""
        p = self.proposer
        ids, hidden = g.first_ids, g.first_feature
        for j, plan in enumerate(g.plans):
            meta = ForwardMeta(self.backend, p.pool, g.out_slots[j], plan)
            out = p.drafter.features(ids[None], hidden[None], g.positions[j][None], paged_meta=meta)
            hidden = out[0]
            logits = p.drafter.draft_logits(hidden).float()
            ids = p.drafter.to_target(logits.argmax(dim=-1))
            g.picks[0, j].copy_(ids)
            g.picks[1, j].copy_(top_probability(logits))

    @torch.inference_mode()
    def _build(self, size: int, steps: int, width: int) -> _ChainGraph:
        dev, p = self.proposer.device, self.proposer
        dtype = next(p.drafter.parameters()).dtype
        features = p.drafter.config.hidden_size
        ints = lambda *shape: torch.zeros(*shape, dtype=torch.int64, device=dev)  # noqa: E731
        g = _ChainGraph(
            ints(size),
            torch.zeros(size, features, dtype=dtype, device=dev),
            ints(steps, size),
            ints(steps, size),
            [self.backend.static_decode(size, width, dev) for _ in range(steps)],
            torch.zeros(2, steps, size, dtype=torch.float64, device=dev),
        )
        self.graphs[(size, steps, width)] = g
        if self.capture:
            for plan in g.plans:
                self.backend.fill_decode(plan, [])  # all padding: a valid plan to capture
            g.graph = capture(lambda: self._forward(g), self.pool, f"draft chain {size} x {steps}")
        return g
