"""The EAGLE head's catch-up after a step as one CUDA graph per (batch bucket, context bucket,
input width): the head over each request's newly committed positions (its pending token and
the drafts a verify accepted: 1 to `max_query` tokens a row), then, for each row's last one,
its draft logits and greedy pick: the next step's first draft, its probability under the head
(where a chain's `min_confidence` stop starts from) and the feature the chain continues from,
kept on the device but for the picks' one read back.

Eagerly this pass is a Python loop of a few dozen kernels, a plan built on the host and three
reads back; on an H100 it cost 3.8 ms of a 10.2 ms speculative step at one request (run H,
docs/benchmarks.md), more than the target's decode it is meant to save. What the graph needs
is known when the step lands: the committed tokens, their positions and slots, the target's
hidden states there. Rows are padded to `max_query` tokens (padding reads and writes slot 0,
as the verify graphs' do) over the torch backend's static plan on the drafter's own pool.
Only steps whose every row wants a greedy guess take it (a sampled request keeps its draft
distribution for the acceptance test, a tree its candidates, a deferred catch-up may be
longer: the eager pass), and a new shape is captured only while no other step runs
(`EagleProposer.may_capture`: under overlap scheduling a catch-up runs when its step lands,
maybe beside the next one's forward; until then that shape goes eagerly). A graph that
fails to build (never yet run on a GPU) is logged and every catch-up goes eagerly. With
`capture=False` the same static path runs eagerly: CPU tests check it against the eager pass.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from sessionserve.replicas.attention.base import ForwardMeta, SeqSpec, to_device
from sessionserve.replicas.attention.torch_backend import TorchPagedBackend
from sessionserve.replicas.cuda_graphs import (
    bucket_for,
    capture,
    row_places,
    stage,
    stage_rows,
)
from sessionserve.replicas.sampling import top_probability
from sessionserve.replicas.speculative.draft_state import DraftState
from sessionserve.replicas.step import CatchUp

if TYPE_CHECKING:  # the proposer holds its graphs
    from sessionserve.replicas.speculative.proposer import EagleProposer

log = logging.getLogger(__name__)


@dataclass
class _CatchUpGraph:
    ids: torch.Tensor  # [B * Q] each committed position's next token (padding: 0)
    positions: torch.Tensor  # [B * Q]
    out_slots: torch.Tensor  # [B * Q] where the head's K/V goes (padding: slot 0)
    hidden: torch.Tensor  # [B * Q, F] the target's hidden states there
    last: torch.Tensor  # [B] each row's last real token, a flat index
    plan: Any
    features: torch.Tensor | None = None  # [B, h] the head's output at `last`
    # [2, B] its greedy draft (target vocabulary) and that draft's probability under the
    # head (what a chain's `min_confidence` stop reads), float64 so one read back takes both
    picks: torch.Tensor | None = None
    graph: Any = None


class CatchUpGraphs:
    """Graphs of the head's catch-up, captured on each shape's first use (see above)."""

    def __init__(
        self,
        proposer: EagleProposer,
        buckets: Sequence[int],
        backend: TorchPagedBackend,
        max_query: int,
        capture: bool = True,
    ) -> None:
        self.proposer, self.backend, self.capture = proposer, backend, capture
        self.buckets = tuple(sorted(buckets))
        self.max_query = max_query
        self.graphs: dict[tuple[int, int, int], _CatchUpGraph] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.replays = 0
        self.failed: str | None = None  # why a graph could not be built: all go eagerly

    def run(self, entries: Sequence[CatchUp]) -> bool:
        """Catch the head up on `entries` (each with at least one position) and give each its
        guess; False when no graph fits (the eager pass does it)."""
        p, q = self.proposer, self.max_query
        counts = [e.end - e.start for e in entries]
        if (
            p.grows_trees
            or not entries
            or max(counts) > q
            or any(not e.wants_draft or not e.req.sampling.is_greedy for e in entries)
        ):
            return False
        size = bucket_for(len(entries), self.buckets)
        seqs = [
            SeqSpec(n, p.cache.slots(e.req.kv, 0, e.end))
            for e, n in zip(entries, counts, strict=True)
        ]
        width = self.backend.graph_key(seqs)
        if size is None or width is None:
            return False
        features = entries[0].hidden.shape[-1]  # the target's (EAGLE-3: three layers')
        g = self.graphs.get((size, width, features))
        if g is None:
            if self.failed is not None or not p.may_capture():  # (may: no forward beside it)
                return False
            try:
                g = self._build(size, width, features)
            except Exception as exc:  # noqa: BLE001 - the eager pass still works
                self.failed = f"{type(exc).__name__}: {exc}"
                log.warning("the EAGLE head's catch-up runs eagerly: its graph failed (%s)", exc)
                return False
        place, dev = row_places(counts, q), p.device
        flat = (
            torch.tensor([t for e in entries for t in e.req.token_slice(e.start + 1, e.end + 1)]),
            torch.cat([torch.arange(e.start, e.end) for e in entries]),
            torch.cat([p.cache.slots(e.req.kv, e.start, e.end) for e in entries]),
        )
        stage_rows((g.ids, g.positions, g.out_slots), place, flat, dev)
        last = torch.tensor([b * q + n - 1 for b, n in enumerate(counts)])
        stage((g.last,), (last,), dev)  # padding rows: 0
        hidden = torch.cat([e.hidden for e in entries]).to(g.hidden.dtype)
        g.hidden.zero_()
        g.hidden.index_copy_(0, to_device(place, dev), to_device(hidden, dev))
        self.backend.fill_rows(g.plan, seqs)
        if g.graph is not None:
            g.graph.replay()
        else:
            self._forward(g)
        self.replays += 1
        assert g.features is not None and g.picks is not None
        n = len(entries)
        feats = g.features[:n].clone()  # the next replay rewrites the graph's buffer
        tokens, confidence = g.picks[:, :n].tolist()
        for e, token, p_token, feat in zip(entries, tokens, confidence, feats, strict=True):
            e.req.draft = DraftState(int(token), feat, confidence=p_token)
        return True

    @torch.inference_mode()
    def _forward(self, g: _CatchUpGraph) -> None:
        p = self.proposer
        meta = ForwardMeta(self.backend, p.pool, g.out_slots, g.plan)
        out = p.drafter.features(g.ids[None], g.hidden[None], g.positions[None], paged_meta=meta)
        g.features = out[0].index_select(0, g.last)
        logits = p.drafter.draft_logits(g.features).float()
        picks = logits.argmax(dim=-1)
        confidence = top_probability(logits)
        g.picks = torch.stack((p.drafter.to_target(picks).double(), confidence.double()))

    @torch.inference_mode()
    def _build(self, size: int, width: int, features: int) -> _CatchUpGraph:
        dev, p, q = self.proposer.device, self.proposer, self.max_query
        dtype = next(p.drafter.parameters()).dtype
        ints = lambda n: torch.zeros(n, dtype=torch.int64, device=dev)  # noqa: E731
        g = _CatchUpGraph(
            ints(size * q),
            ints(size * q),
            ints(size * q),
            torch.zeros(size * q, features, dtype=dtype, device=dev),
            torch.arange(size, device=dev) * q,
            self.backend.static_extend(q, width, dev, rows=size),
        )
        self.graphs[(size, width, features)] = g
        if self.capture:
            self.backend.fill_rows(g.plan, [])  # all padding: a valid plan to capture
            g.graph = capture(lambda: self._forward(g), self.pool, f"head catch-up {size} x {q}")
        return g
