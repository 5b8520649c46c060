"""CUDA graphs for decode: capture the whole decode forward once per batch-size bucket, replay it.

A decode step's shapes depend only on the batch size (and, for the torch backend, a context
bucket), so the unmodified transformers model plus our attention is captured over static
buffers: token ids, positions, output slots, and the backend's static metadata. A step pads
its batch up to the next bucket (padding rows read and write only the reserved slot 0), copies
its inputs into the buffers, re-plans the backend outside the graph, and replays. Prefill and
mixed steps run eagerly, except short single-sequence extends (a session turn, a short prompt:
`ExtendGraphs`), which replay graphs per query/context bucket over the torch backend's static
plan whatever the decode backend (FlashInfer reads the same pool layout); so do speculative
decoding's verify steps (`VerifyGraphs`: decode rows of a pending token and its drafts).

Graphs are captured lazily, on a bucket's first use, into one shared memory pool. With
`capture=False` the same static path runs eagerly: that is how CPU tests check the padding
and buffer filling that a replay relies on. A graph captures the compiled forward
(`engine.compile`, compiled_forward.py) where one runs steps of its size, else the eager
model; a graph captured before a compiled forward was installed (a background build) is
captured again on its next use.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from sessionserve.replicas.attention.base import AttentionBackend, ForwardMeta, to_device
from sessionserve.replicas.attention.torch_backend import TorchPagedBackend
from sessionserve.replicas.compiled_forward import CompiledForward
from sessionserve.replicas.model_runner import ModelRunner
from sessionserve.replicas.step import ForwardBatch

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
    sliding_out_slots: torch.Tensor  # (unread without sliding layers' KV kept apart)
    plan: Any  # the backend's static metadata
    rows: torch.Tensor  # [B] 0..B-1: every row's logits (the compiled forward's argument)
    hidden: torch.Tensor | None = None  # [B, F] the drafter's features (each replay)
    logits: torch.Tensor | None = None  # [B, V]
    graph: Any = None  # torch.cuda.CUDAGraph once captured
    compiled: CompiledForward | None = None  # the forward it captured (None: eager)


class _GraphSet:
    """What the decode and extend graphs share: a graph per key (its first element the step's
    token bucket), captured on first use and again when the forward that runs that size
    changed (a compiled forward installed since). Subclasses give `_key` and `_build`."""

    runner: ModelRunner
    capture: bool
    graphs: dict
    buckets: tuple[int, ...]

    @property
    def max_tokens(self) -> int:
        """The most tokens a step it replays holds."""
        return max(self.buckets)

    def _key(self, batch: ForwardBatch) -> tuple[int, Hashable] | None:
        raise NotImplementedError

    def _build(self, size: int, key: Any) -> Any:
        raise NotImplementedError

    def needs_capture(self, batch: ForwardBatch) -> bool:
        """Would `run(batch)` capture a graph first? (See `ModelRunner.captures`.)"""
        key = self._key(batch)
        return self.capture and key is not None and self._stale(key)

    def _stale(self, key: tuple[int, Hashable]) -> bool:
        g = self.graphs.get(key)
        return g is None or g.compiled is not self.runner.compiled_for(key[0])

    def _graph(self, key: tuple[int, Hashable]) -> Any:
        """The graph for `key`, captured (again) first where `_stale`."""
        return self._build(*key) if self._stale(key) else self.graphs[key]


class DecodeGraphs(_GraphSet):
    def __init__(self, runner: ModelRunner, buckets: Sequence[int], capture: bool = True):
        self.runner = runner
        self.buckets = tuple(sorted(buckets))
        self.capture = capture
        self.graphs: dict[tuple[int, Hashable], _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.replays = 0  # steps served by a graph (or the static path when not capturing)

    def _key(self, batch: ForwardBatch) -> tuple[int, Hashable] | None:
        """The graph that runs a pure-decode `batch`: (bucket size, backend key), or None."""
        size = bucket_for(len(batch.seqs), self.buckets)
        key = self.runner.backend.graph_key(batch.seqs) if size is not None else None
        return None if size is None or key is None else (size, key)

    def run(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Logits (and hidden states) of a pure-decode batch, or None if no bucket fits."""
        n, found = len(batch.seqs), self._key(batch)
        if found is None:
            return None
        g = self._graph(found)
        self._fill(g, batch)
        if g.graph is not None:
            g.graph.replay()
        else:
            self._forward(g)
        self.replays += 1
        hidden = g.hidden[:n] if batch.want_hidden else None
        return g.logits[:n], hidden

    def _fill(self, g: _Graph, batch: ForwardBatch) -> None:
        stage(
            (g.ids, g.positions, g.out_slots, g.sliding_out_slots),
            (batch.input_ids, batch.positions, batch.out_slots, _sliding_out(batch)),
            self.runner.device,
        )
        batch.device_ids(g.ids)
        self.runner.backend.fill_decode(g.plan, batch.seqs)

    def _forward(self, g: _Graph) -> None:
        forward_every_row(self.runner, self.runner.backend, g)

    @torch.inference_mode()
    def _build(self, size: int, key: Hashable) -> _Graph:
        dev = self.runner.device
        zeros = lambda: torch.zeros(size, dtype=torch.int64, device=dev)  # noqa: E731
        g = _Graph(
            zeros(),
            zeros(),
            zeros(),
            zeros(),
            self.runner.backend.static_decode(size, key, dev),
            torch.arange(size, device=dev),
            compiled=self.runner.compiled_for(size),
        )
        self.graphs[(size, key)] = g
        if not self.capture:
            return g
        self.runner.backend.fill_decode(g.plan, [])  # all padding: a valid plan to capture
        g.graph = capture(lambda: self._forward(g), self.pool, f"decode batch {size}, key {key}")
        return g


def forward_every_row(runner: ModelRunner, backend: Any, g: _Graph | _VerifyGraph) -> None:
    """A graph's forward over its static buffers (what is captured): the logits and the
    drafter's features of every row, through the compiled forward where the graph has one."""
    meta = ForwardMeta(backend, runner.kv_pool, g.out_slots, g.plan, g.sliding_out_slots)
    if g.compiled is not None:
        g.logits, g.hidden = g.compiled.run(g.ids, g.positions, g.rows, meta)
        return
    last, g.hidden = runner.decode_hidden(g.ids, g.positions, meta)
    g.logits = runner.lm_head(last)


def stage(buffers: Sequence[torch.Tensor], rows: Sequence[torch.Tensor], device) -> None:
    """Host rows into a graph's static int64 buffers with one host-to-device copy; each
    buffer's tail past its row is zero (padding: token 0 at position 0, slot 0). The rows are
    gathered in numpy, into memory pinned from the start (on CUDA): the forward thread stages
    a decode graph's inputs every step, and each torch call skipped is one point fewer where it
    may wait for the GIL before the launch."""
    width = max(b.numel() for b in buffers)
    pinned = torch.device(device).type == "cuda"
    host = torch.zeros(len(buffers), width, dtype=torch.int64, pin_memory=pinned)
    table = host.numpy()
    for i, row in enumerate(rows):
        table[i, : row.numel()] = row.numpy()
    staged = host.to(device, non_blocking=True) if pinned else host.to(device)
    for buf, row in zip(buffers, staged, strict=True):
        buf.copy_(row[: buf.numel()], non_blocking=True)


def row_places(counts: Sequence[int], q: int) -> torch.Tensor:
    """Where each of a step's flat tokens sits in a graph whose rows hold `q` tokens each
    (row b's `counts[b]` tokens first, padding after them)."""
    return torch.cat([b * q + torch.arange(n) for b, n in enumerate(counts)])


def stage_rows(
    buffers: Sequence[torch.Tensor],
    place: torch.Tensor,
    flat: Sequence[torch.Tensor],
    device,
) -> None:
    """A step's flat int64 inputs placed in a padded-row graph's static buffers (`place`:
    `row_places`), padding zero (token 0 at position 0, slot 0), with one copy up."""
    padded = [torch.zeros(b.numel(), dtype=torch.int64) for b in buffers]
    for buf, values in zip(padded, flat, strict=True):
        buf[place] = values
    stage(buffers, padded, device)


def capture(forward: Callable[[], None], pool: Any, what: str) -> Any | None:
    """A CUDA graph of `forward` (after two warm-up runs on a side stream, which allocate
    outside the graph) in the shared memory `pool`; None, with a warning, if the capture
    fails: the caller then runs that shape's static path eagerly (slower, still served), as
    it does without graphs. (On an H100 a tiny Gemma 3's verify graph failed to capture in
    cuBLAS, fp32, after its warm-up runs had passed: docs/benchmarks.md, 2026-11-27.)"""
    t0 = time.perf_counter()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, pool=pool):
            forward()
    except RuntimeError as e:  # (torch.AcceleratorError is one)
        log.warning("could not capture a CUDA graph (%s), it runs eagerly: %s", what, e)
        return None
    log.info("captured a CUDA graph (%s) in %.0f ms", what, 1000 * (time.perf_counter() - t0))
    return graph


EXTEND_BUCKETS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


@dataclass
class _ExtendGraph:
    ids: torch.Tensor  # [Q] static inputs (padding: token 0 at position 0, slot 0)
    positions: torch.Tensor
    out_slots: torch.Tensor
    sliding_out_slots: torch.Tensor
    logit_row: torch.Tensor  # [1] index of the last real token
    plan: Any
    logits: torch.Tensor | None = None  # [1, V]
    graph: Any = None
    compiled: CompiledForward | None = None  # as _Graph's


class ExtendGraphs(_GraphSet):
    """One sequence extended by 2..`max_tokens` new tokens, at most one sampled (a session
    turn or a short prompt; no drafter): a graph per (query bucket, context bucket). Eagerly
    such a forward is bound by launching a few hundred kernels from Python, whatever its
    size; replayed, it costs what its kernels cost."""

    def __init__(
        self, runner: ModelRunner, backend: TorchPagedBackend, max_tokens: int, capture=True
    ):
        self.runner, self.backend, self.capture = runner, backend, capture
        self.buckets = buckets_up_to(max_tokens, EXTEND_BUCKETS)
        self.graphs: dict[tuple[int, int], _ExtendGraph] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.replays = 0

    def _key(self, batch: ForwardBatch) -> tuple[int, int] | None:
        """The graph that runs `batch`: (query bucket, context bucket), or None when it is no
        single short extend."""
        if len(batch.seqs) != 1 or batch.want_hidden or len(batch.logit_idx) > 1:
            return None
        (seq,) = batch.seqs
        n = seq.q_len
        if n < 2 or seq.tree_mask is not None or (batch.logit_idx.tolist() not in ([], [n - 1])):
            return None
        size, width = bucket_for(n, self.buckets), self.backend.graph_key([seq])
        return None if size is None or width is None else (size, width)

    def run(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        found = self._key(batch)
        if found is None:
            return None
        (seq,) = batch.seqs
        n = seq.q_len
        g = self._graph(found)
        stage(
            (g.ids, g.positions, g.out_slots, g.sliding_out_slots, g.logit_row),
            (
                batch.input_ids,
                batch.positions,
                batch.out_slots,
                _sliding_out(batch),
                torch.tensor([n - 1]),
            ),
            self.runner.device,
        )
        batch.device_ids(g.ids)
        self.backend.fill_rows(g.plan, [seq])
        if g.graph is not None:
            g.graph.replay()
        else:
            self._forward(g)
        self.replays += 1
        return g.logits[: len(batch.logit_idx)], None

    def _forward(self, g: _ExtendGraph) -> None:
        r = self.runner
        meta = ForwardMeta(self.backend, r.kv_pool, g.out_slots, g.plan, g.sliding_out_slots)
        if g.compiled is not None:
            g.logits, _ = g.compiled.run(g.ids, g.positions, g.logit_row, meta)
            return
        last, _ = r.decode_hidden(g.ids, g.positions, meta)
        g.logits = r.lm_head(last[g.logit_row])

    @torch.inference_mode()
    def _build(self, size: int, width: int) -> _ExtendGraph:
        dev = self.runner.device
        zeros = lambda n: torch.zeros(n, dtype=torch.int64, device=dev)  # noqa: E731
        plan = self.backend.static_extend(size, width, dev)
        g = _ExtendGraph(zeros(size), zeros(size), zeros(size), zeros(size), zeros(1), plan)
        g.compiled = self.runner.compiled_for(size)
        self.graphs[(size, width)] = g
        if self.capture:
            self.backend.fill_rows(g.plan, [])  # all padding: a valid plan to capture
            g.graph = capture(lambda: self._forward(g), self.pool, f"extend {size} x {width}")
        return g


@dataclass
class _VerifyGraph:
    ids: torch.Tensor  # [B * Q] static inputs, row b's tokens at b * Q .. (padding: slot 0)
    positions: torch.Tensor
    out_slots: torch.Tensor
    sliding_out_slots: torch.Tensor
    rows: torch.Tensor  # [B * Q] 0..B*Q-1: every token's logits
    plan: Any
    logits: torch.Tensor | None = None  # [B * Q, V]
    hidden: torch.Tensor | None = None  # [B * Q, F]
    graph: Any = None
    compiled: CompiledForward | None = None  # as _Graph's


class VerifyGraphs(_GraphSet):
    """Decode steps that verify drafts (speculative decoding): every sequence adds its pending
    token and up to `max_query - 1` drafts (a chain) and samples all of them. Eagerly such a
    step launches every kernel from Python, so on a GPU it cost ~4x a replayed decode and a
    verify could not pay; replayed, a 5-token verify costs ~1.1x a decode (measured with a
    manual graph, docs/benchmarks.md). A graph per (batch bucket, context bucket) over the
    decode backend's static rows (FlashInfer's paged prefill: one context bucket; the torch
    backend's gather, as `ExtendGraphs`), every row padded to `max_query` tokens
    (padding tokens read and write slot 0): one query length, not one graph per draft count,
    since each graph keeps its own logits buffer (B x max_query x vocab) in the graph pool. It
    returns every token's logits and the drafter's features in the step's own flat order."""

    def __init__(
        self,
        runner: ModelRunner,
        backend: AttentionBackend,
        buckets: Sequence[int],
        max_query: int,
        capture: bool = True,
    ):
        self.runner, self.backend, self.capture = runner, backend, capture
        self.buckets = tuple(sorted(buckets))
        self.max_query = max_query
        self.graphs: dict[tuple[int, Hashable], _VerifyGraph] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.replays = 0

    @property
    def max_tokens(self) -> int:
        return max(self.buckets) * self.max_query

    def _key(self, batch: ForwardBatch) -> tuple[int, Hashable] | None:
        """(B * max_query tokens, (B, context bucket)) for a batch whose every token is sampled
        and whose longest row has 2..max_query tokens (chains only), else None."""
        seqs = batch.seqs
        if not seqs or len(batch.logit_idx) != len(batch.input_ids):
            return None
        longest = max(s.q_len for s in seqs)
        if not 2 <= longest <= self.max_query or any(s.tree_mask is not None for s in seqs):
            return None
        size, width = bucket_for(len(seqs), self.buckets), self.backend.graph_key(seqs)
        return None if size is None or width is None else (size * self.max_query, (size, width))

    def run(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        found = self._key(batch)
        if found is None:
            return None
        q = self.max_query
        g = self._graph(found)
        place = row_places([s.q_len for s in batch.seqs], q)
        flat = (batch.input_ids, batch.positions, batch.out_slots, _sliding_out(batch))
        dev = self.runner.device
        stage_rows((g.ids, g.positions, g.out_slots, g.sliding_out_slots), place, flat, dev)
        place = to_device(place, dev)
        if batch.pending_ids is not None:  # their places in the graph's rows
            where = place.index_select(0, batch.pending_ids.index)
            g.ids.index_copy_(0, where, batch.pending_ids.tokens)
        self.backend.fill_rows(g.plan, batch.seqs)
        if g.graph is not None:
            g.graph.replay()
        else:
            self._forward(g)
        self.replays += 1
        logits = g.logits.index_select(0, place.index_select(0, to_device(batch.logit_idx, dev)))
        hidden = g.hidden.index_select(0, place) if batch.want_hidden else None
        return logits, hidden

    def _forward(self, g: _VerifyGraph) -> None:
        forward_every_row(self.runner, self.backend, g)

    @torch.inference_mode()
    def _build(self, tokens: int, key: tuple[int, int]) -> _VerifyGraph:
        (size, width), q = key, self.max_query
        dev = self.runner.device
        zeros = lambda: torch.zeros(tokens, dtype=torch.int64, device=dev)  # noqa: E731
        plan = self.backend.static_extend(q, width, dev, rows=size)
        rows = torch.arange(tokens, device=dev)
        g = _VerifyGraph(zeros(), zeros(), zeros(), zeros(), rows, plan)
        g.compiled = self.runner.compiled_for(tokens)
        self.graphs[(tokens, key)] = g
        if self.capture:
            self.backend.fill_rows(g.plan, [])  # all padding: a valid plan to capture
            g.graph = capture(lambda: self._forward(g), self.pool, f"verify {size} x {q}")
        return g


def _sliding_out(batch: ForwardBatch) -> torch.Tensor:
    """The batch's sliding out slots, or zeros (slot 0) when nothing is kept apart."""
    if batch.sliding_out_slots is not None:
        return batch.sliding_out_slots
    return torch.zeros_like(batch.out_slots)
