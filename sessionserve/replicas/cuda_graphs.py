"""CUDA graphs for decode: capture the whole decode forward once per batch-size bucket, replay it.

A decode step's shapes depend only on the batch size (and, for the torch backend, a context
bucket), so the unmodified transformers model plus our attention is captured over static
buffers: token ids, positions, output slots, and the backend's static metadata. A step pads
its batch up to the next bucket (padding rows read and write only the reserved slot 0), copies
its inputs into the buffers, re-plans the backend outside the graph, and replays. Prefill,
mixed and verify steps run eagerly.

Graphs are captured lazily, on a bucket's first use, into one shared memory pool. With
`capture=False` the same static path runs eagerly: that is how CPU tests check the padding
and buffer filling that a replay relies on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from sessionserve.replicas.attention.base import ForwardMeta
from sessionserve.replicas.model_runner import ForwardBatch, ModelRunner

log = logging.getLogger(__name__)
DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)


def buckets_up_to(max_batch: int, buckets: Sequence[int] = DEFAULT_BUCKETS) -> tuple[int, ...]:
    """The bucket sizes a runner with at most `max_batch` running requests can use (the
    largest is `max_batch` itself when it falls between two buckets)."""
    kept = tuple(b for b in sorted(set(buckets)) if b < max_batch)
    return (*kept, max_batch)


def bucket_for(n: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket holding `n` sequences, None when none does."""
    return next((b for b in buckets if b >= n), None)


@dataclass
class _Graph:
    ids: torch.Tensor  # [B] static inputs
    positions: torch.Tensor
    out_slots: torch.Tensor
    plan: Any  # the backend's static metadata
    hidden: torch.Tensor | None = None  # [B, H] outputs (written by each replay)
    logits: torch.Tensor | None = None  # [B, V]
    graph: Any = None  # torch.cuda.CUDAGraph once captured


class DecodeGraphs:
    def __init__(self, runner: ModelRunner, buckets: Sequence[int], capture: bool = True):
        self.runner = runner
        self.buckets = tuple(sorted(buckets))
        self.capture = capture
        self.graphs: dict[tuple[int, Hashable], _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.replays = 0  # steps served by a graph (or the static path when not capturing)

    def run(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Logits (and hidden states) of a pure-decode batch, or None if no bucket fits."""
        n = len(batch.seqs)
        size = bucket_for(n, self.buckets)
        key = self.runner.backend.graph_key(batch.seqs) if size is not None else None
        if size is None or key is None:
            return None
        g = self.graphs.get((size, key)) or self._build(size, key)
        self._fill(g, batch)
        if g.graph is not None:
            g.graph.replay()
        else:
            self._forward(g)
        self.replays += 1
        hidden = g.hidden[:n] if batch.want_hidden else None
        return g.logits[:n], hidden

    def _fill(self, g: _Graph, batch: ForwardBatch) -> None:
        n, size = len(batch.seqs), g.ids.numel()
        host = torch.zeros(3, size, dtype=torch.int64)  # padding: token 0 at position 0, slot 0
        host[0, :n], host[1, :n], host[2, :n] = batch.input_ids, batch.positions, batch.out_slots
        dev = self.runner.device
        staged = host.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else host
        g.ids.copy_(staged[0], non_blocking=True)
        g.positions.copy_(staged[1], non_blocking=True)
        g.out_slots.copy_(staged[2], non_blocking=True)
        self.runner.backend.fill_decode(g.plan, batch.seqs)

    def _forward(self, g: _Graph) -> None:
        r = self.runner
        meta = ForwardMeta(r.backend, r.kv_pool, g.out_slots, g.plan)
        g.hidden = r.decode_hidden(g.ids, g.positions, meta)
        g.logits = r.lm_head(g.hidden)

    @torch.inference_mode()
    def _build(self, size: int, key: Hashable) -> _Graph:
        dev = self.runner.device
        zeros = lambda: torch.zeros(size, dtype=torch.int64, device=dev)  # noqa: E731
        g = _Graph(zeros(), zeros(), zeros(), self.runner.backend.static_decode(size, key, dev))
        self.graphs[(size, key)] = g
        if not self.capture:
            return g
        t0 = time.perf_counter()
        self.runner.backend.fill_decode(g.plan, [])  # all padding: a valid plan to capture
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up runs allocate outside the graph
            for _ in range(2):
                self._forward(g)
        torch.cuda.current_stream().wait_stream(side)
        g.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g.graph, pool=self.pool):
            self._forward(g)
        log.info(
            "captured a decode CUDA graph: batch %d, key %s, in %.0f ms",
            size,
            key,
            1000 * (time.perf_counter() - t0),
        )
        return g
