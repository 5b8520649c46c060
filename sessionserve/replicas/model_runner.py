"""Runs one step's forward: `prepare(batch, drafts)` builds the flat inputs, then
`run_prepared` runs the model over the paged KV pool and samples the sequences that end their
input this step (-> StepOutput); under overlap scheduling the two run on different threads.

`prepare` reads the scheduled sequences' tokens and slot tables (never writes KV bookkeeping: the
scheduler commits). `forward` sees only tensors: token ids, positions, the slot each new token's
KV goes to, and one `SeqSpec` per sequence (its new-token count and context slots). The batch
goes to the device in one copy. Pure-decode batches replay a CUDA graph when `graphs` is set,
short single-sequence extends when `extend_graphs` is, speculative decoding's verifies when
`verify_graphs` is (see cuda_graphs.py); other steps of up
to `engine.compile_max_tokens` tokens run the compiled forward when one is installed
(compiled_forward.py; decode steps the decode step package, compiled_decode.py, where
`engine.compile_decode` installed one, and through the CPU kernel verifies and short turns
too), longer ones the prefill package when
`engine.compile_prefill` installed one; the rest run eagerly.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import torch

from sessionserve.cache.kv_pool import KVPool
from sessionserve.cache.session_cache import SessionCache
from sessionserve.replicas.attention import AttentionBackend, ForwardMeta, SeqSpec, install
from sessionserve.replicas.attention.base import to_device
from sessionserve.replicas.compiled_decode import CompiledDecode
from sessionserve.replicas.compiled_forward import CompiledForward
from sessionserve.replicas.grammar import apply_masks, consume
from sessionserve.replicas.hidden_states import decoder_features
from sessionserve.replicas.logits_head import head_logits
from sessionserve.replicas.sampling import DeviceSample, sample_on_device
from sessionserve.replicas.step import (
    Drafts,
    ForwardBatch,
    LastSampled,
    PendingIds,
    ScheduledBatch,
    ScheduledSeq,
    SeqLayout,
    StepOutput,
)

if TYPE_CHECKING:  # the graphs hold the runner they replay for
    from sessionserve.replicas.cuda_graphs import DecodeGraphs, ExtendGraphs, VerifyGraphs


class ModelRunner:
    def __init__(
        self, model: Any, kv_pool: KVPool, backend: AttentionBackend, cache: SessionCache
    ) -> None:
        self.model = model
        self.cache = cache  # read for slot tables only
        self.kv_pool = kv_pool
        self.backend = backend
        self.device = next(model.parameters()).device
        self.decoder = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        self.graphs: DecodeGraphs | None = None  # set by assembly.py on CUDA
        self.extend_graphs: ExtendGraphs | None = None
        self.verify_graphs: VerifyGraphs | None = None  # speculative decoding's verifies
        self.compiled: CompiledForward | None = None  # installed by compiled_forward.py
        self.compiled_prefill: CompiledForward | None = None  # the longer steps' package
        self.compiled_decode: CompiledDecode | None = None  # pure decode steps, whole
        # the same with the GGUF's 4-bit linears, for steps of a few tokens (gguf_int4.py)
        self.compiled_int4_decode: CompiledDecode | None = None
        # which target hidden states the drafter reads (set by assembly.py before graphs are
        # captured): None = the last, after the final norm; else `output_hidden_states`
        # indices, concatenated (an EAGLE-3 head's three layers)
        self.feature_layers: tuple[int, ...] | None = None
        self.compiling: threading.Thread | None = None  # a background build, while it runs
        self.last_sampled: LastSampled | None = None  # the last step's tokens, on the
        # device: what the next step's pending positions read (overlap scheduling)
        self._arange = torch.arange(256, device=self.device)  # views: _index_on_device
        install(model)

    def run_prepared(
        self,
        batch: ScheduledBatch,
        fb: ForwardBatch,
        layout: dict[str, SeqLayout],
        defer: bool = False,
    ) -> StepOutput:
        """Forward `prepare`'s batch and sample one token for each sequence that samples
        without drafts (a verify's rows are the speculative decoder's). Under overlap
        scheduling, on the forward thread: the tokens the previous step sampled are filled in
        on the device first (it ran before this one), and with `defer` this step's tokens are
        only copied towards the host: `StepOutput.resolve` (the engine thread, when the step
        lands) waits for them, so nothing here waits for the device and the next step can
        be launched while this one computes."""
        if fb.pending:
            fb.pending_ids = self._pending_ids(fb.pending)
        logits, hidden = self.forward(fb)
        out = StepOutput(logits, hidden, layout)
        plain = [s for s in batch.seqs if s.samples and s.num_drafts == 0]
        self.last_sampled = None
        if plain:
            self._sample(plain, out)
        if not defer:
            out.resolve()
        return out

    def _pending_ids(self, pending: list[tuple[int, str]]) -> PendingIds:
        """Where the previous step's tokens go in this step's input ids, taken from that
        step's sampled tokens on the device (a request it did not sample reads 0). A steady
        decode batch (the same requests in the same order, a token each) takes views instead
        of copies: this runs on the forward thread before every launch, and each torch call
        it skips is one point fewer where it waits for the GIL (docs/benchmarks.md)."""
        last = self.last_sampled
        rows = last.rows if last is not None else {}
        index, rids = zip(*pending, strict=True)
        picks = [rows.get(r, len(rows)) for r in rids]  # (len(rows): not sampled, reads 0)
        if last is not None and len(picks) <= len(rows) and picks == list(range(len(picks))):
            tokens = last.tokens[: len(picks)]
        else:
            zero = torch.zeros(1, dtype=torch.int64, device=self.device)
            source = torch.cat([last.tokens, zero]) if last is not None else zero
            tokens = source.index_select(0, to_device(torch.tensor(picks), self.device))
        return PendingIds(self._index_on_device(index), tokens)

    def _index_on_device(self, index: tuple[int, ...]) -> torch.Tensor:
        """`index` on the device: a view of a kept arange where it is a run of consecutive
        positions (a decode batch's pending tokens), else a copy up."""
        first, n = index[0], len(index)
        if index[-1] - first == n - 1 and index == tuple(range(first, first + n)):
            if self._arange.numel() < first + n:  # (grown by doubling)
                size = max(first + n, 2 * self._arange.numel())
                self._arange = torch.arange(size, device=self.device)
            return self._arange[first : first + n]
        return to_device(torch.tensor(index), self.device)

    def prepare(
        self, batch: ScheduledBatch, drafts: dict[str, Drafts], want_hidden: bool
    ) -> tuple[ForwardBatch, dict[str, SeqLayout]]:
        """The flat forward (drafts after their sequence's pending token), and where each
        sequence sits in it."""
        ids, pos, out_slots, seqs, logit_idx, layout, n = [], [], [], [], [], {}, 0
        pending: list[tuple[int, str]] = []
        sliding = self.cache.allocator.sliding if self.kv_pool.has_sliding else None
        for s in batch.seqs:
            kv, chain = s.req.kv, drafts.get(s.req.rid)
            if chain is None and sliding is None and s.end - s.start == 1:  # a plain decode
                if s.pending:  # (its one token: the one the step in flight samples)
                    pending.append((len(ids), s.req.rid))
                    ids.append(0)
                else:
                    ids.append(s.req.token_at(s.start))
                pos.append(s.start)
                ctx = self.cache.slots(kv, 0, s.end)
                out_slots.append(self.cache.slot_at(kv, s.start))
                seqs.append(SeqSpec(1, ctx))
                layout[s.req.rid] = SeqLayout(n, len(logit_idx) if s.samples else -1)
                if s.samples:
                    logit_idx.append(n)
                n += 1
                continue
            extra = chain.tokens if chain else []
            end = s.end + len(extra)
            ids.extend(s.req.token_slice(s.start, s.end - s.pending))
            for _ in range(s.pending):  # sampled by the step in flight: read at the start
                pending.append((len(ids), s.req.rid))
                ids.append(0)
            ids.extend(extra)
            pos.extend(range(s.start, s.end))
            tree = None
            if chain is not None and chain.parents is not None:  # a draft's slot is its index's,
                pos.extend(s.end - 1 + d for d in chain.depths())  # its position its depth's
                tree = chain.tree_mask()
            else:
                pos.extend(range(s.end, end))
            out_slots.extend(self.cache.slot_list(kv, s.start, end))
            ctx = self.cache.slots(kv, 0, end)
            window = None
            if sliding is not None:  # what the sliding layers read: the window's columns
                window = sliding.lookup(ctx[-(sliding.window - 1 + end - s.start) :])
            seqs.append(SeqSpec(end - s.start, ctx, tree_mask=tree, sliding_slots=window))
            layout[s.req.rid] = SeqLayout(n, len(logit_idx) if s.samples else -1)
            n += end - s.start
            if s.samples:
                logit_idx.extend(range(n - 1 - len(extra), n))
        out = torch.tensor(out_slots)
        fb = ForwardBatch(
            torch.tensor(ids),
            torch.tensor(pos),
            out,
            seqs,
            torch.tensor(logit_idx, dtype=torch.int64),
            want_hidden=want_hidden,
            sliding_out_slots=sliding.lookup(out) if sliding is not None else None,
            pending=pending,
        )
        return fb, layout

    def _sample(self, seqs: list[ScheduledSeq], out: StepOutput) -> None:
        """One token for each of `seqs`, batched, left on the device with its copy to the host
        started (`out.resolve` reads it); if the batch raises, each row again alone (its
        seeded generator rewound first), so a request that cannot be sampled fails by itself
        and the others get exactly the tokens they would have had."""
        rows = [out.layout[s.req.rid].logit_row for s in seqs]
        seeded = {  # greedy rows draw nothing: only sampled, seeded rows need rewinding
            s.req.rid: s.req.generator.get_state()
            for s in seqs
            if s.req.sampling.seed is not None and not s.req.sampling.is_greedy
        }
        try:
            if rows == list(range(len(rows))) and all(s.req.grammar is None for s in seqs):
                picked = out.logits[: len(rows)]  # (a decode's rows: a view, masked nowhere)
            else:  # a copy, as a grammar masks its rows in place
                picked = out.logits.index_select(
                    0, to_device(torch.tensor(rows), out.logits.device)
                )
            groups = [(seqs, _sample_rows(seqs, picked))]
        except Exception:
            groups = []
            for s, row in zip(seqs, rows, strict=True):
                if s.req.rid in seeded:
                    s.req.generator.set_state(seeded[s.req.rid])
                try:
                    groups.append(([s], _sample_rows([s], out.logits[[row]])))
                except Exception as e:
                    out.errors[s.req.rid] = e
        for _, sampled in groups:
            sampled.start_copy()
        if groups:  # (several when rows were sampled alone: their tokens in one vector)
            parts = [sampled.tokens for _, sampled in groups]
            tokens = parts[0] if len(parts) == 1 else torch.cat(parts)
            rids = [s.req.rid for group, _ in groups for s in group]
            self.last_sampled = LastSampled(tokens, {r: i for i, r in enumerate(rids)})
        out.resolver = lambda: _read_samples(groups, out)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [N, V] for `batch.logit_idx`, and with `want_hidden` the drafter's features
        of every token [T, F] (`decode_hidden`); K/V of every new token is written to the
        pool. The decoder and the LM head run separately so the hidden states come for free."""
        for graphs in self._graph_sets(batch):
            out = graphs.run(batch)
            if out is not None:
                return out
        n = len(batch.input_ids)
        sliding = batch.sliding_out_slots
        parts = [batch.input_ids, batch.positions, batch.out_slots, batch.logit_idx]
        packed = to_device(
            torch.cat(parts + ([sliding] if sliding is not None else [])), self.device
        )
        ids, pos, slots, logit_idx, *window = packed.split(
            [n, n, n, len(batch.logit_idx)] + [n] * (sliding is not None)
        )
        ids = batch.device_ids(ids)
        for decode in (self.compiled_int4_decode, self.compiled_decode):
            if decode is not None and self._takes_decode_package(decode, batch):
                logits, hidden = decode.run(
                    batch.seqs, ids, pos, slots, logit_idx, self.kv_pool, *window
                )
                return logits, hidden if batch.want_hidden else None
        meta = ForwardMeta(
            self.backend,
            self.kv_pool,
            slots,
            self.backend.prepare(batch.seqs, self.device),
            window[0] if window else None,
        )
        compiled = self.compiled_for(n)
        if compiled is not None:
            logits, hidden = compiled.run(ids, pos, logit_idx, meta)  # its own LM head GEMM
        else:
            last, hidden = self.decode_hidden(ids, pos, meta)
            logits = head_logits(self.lm_head, last[logit_idx])  # oneDNN on CPU
        return logits, hidden if batch.want_hidden else None

    def _takes_decode_package(self, decode: CompiledDecode, batch: ForwardBatch) -> bool:
        """Whether `batch` runs the decode step package (decode steps; through the CPU kernel
        also verifies and short turns, `CompiledDecode.takes`) in place of the
        forward's package: every step the forward's package would run, and, where the
        package's linears are a kernel that reads each weight once for all rows (the few-row
        fp32 kernel, the 4-bit package's block kernel: `reads_weights_once`), also longer ones
        that would run eagerly or in the prefill package; otherwise not where the prefill
        package was timed faster for steps this long (prefill_choice.split_point). The
        package's linears run on the step's own tokens (rows of unequal widths are padded for
        the attention alone), so what decides is how many tokens the step has, not how many
        padded.

        Why such a kernel changes the choice: on 2 AVX2 cores (fp32, 300-token contexts) the
        few-row kernel's package ran decode steps of 24-64 rows 1.28-1.37x faster than the
        prefill package, verifies of 6-12 rows of 5 tokens 1.40-1.44x; on 2 cores of an AMD
        EPYC Zen 4 (bf16), where the prefill package takes steps from 5 tokens on, the 4-bit
        package ran a one-request k = 4 verify 1.89x faster than it, decode steps of 8 and 12
        requests 1.43x and 1.23x (docs/benchmarks.md). Without such a kernel the package's
        GEMMs are the forward's package's, tuned for 2 rows, which the split timing compared."""
        if not decode.takes(batch.seqs, batch.sliding_out_slots is not None):
            return False
        runs = self.compiled_for(len(batch.input_ids))
        yields_to = (None, self.compiled_prefill) if decode.reads_weights_once else (None,)
        return runs is self.compiled or any(runs is p for p in yields_to)

    def captures(self, batch: ForwardBatch) -> bool:
        """Would `forward(batch)` capture a CUDA graph first? While a stream captures, no
        other thread may use the device (the EAGLE head's catch-up and history drafts run on
        the engine thread), so under overlap scheduling such a step runs alone (engine.py)."""
        return any(graphs.needs_capture(batch) for graphs in self._graph_sets(batch))

    def _graph_sets(self, batch: ForwardBatch) -> list[DecodeGraphs | ExtendGraphs | VerifyGraphs]:
        """The graphs that may replay `batch`, in the order they are tried (each declines a
        batch it has no graph shape for): decode graphs for pure decodes, else the extend
        graphs (one short extend) and the verify graphs (speculative decoding; with history
        drafts alone both exist)."""
        if batch.is_decode:
            return [self.graphs] if self.graphs is not None else []
        return [g for g in (self.extend_graphs, self.verify_graphs) if g is not None]

    def compiled_for(self, num_tokens: int) -> CompiledForward | None:
        """The installed package that runs a step of `num_tokens` tokens (None: eager): the
        prefill package from its `min_tokens` on, else the forward's package."""
        for compiled in (self.compiled_prefill, self.compiled):
            if compiled is not None and compiled.accepts(num_tokens):
                return compiled
        return None

    def widest_compiled_step(self) -> int | None:
        """The most tokens a step runs through a compiled package, where the longer ones run
        eagerly (the speculative decoder keeps a verify within it: decoder.py `draft_lens`).
        None where nothing is compiled (yet: a package may still be building), where the
        prefill package runs every longer step too, as no step then falls off a cliff, and on
        a GPU, whose verifies replay their own graphs (`verify_graphs`; the cut was measured
        on CPUs only). A prefill package `limited` to the shorter prefills it was timed
        faster on leaves the cut where it was measured: at the other packages' range."""
        prefill = self.compiled_prefill
        if self.device.type != "cpu" or self.compiled is None:
            return None
        if prefill is not None and not prefill.limited:
            return None
        packages = (self.compiled, self.compiled_decode)
        return max(p.max_tokens for p in packages if p is not None)

    def decode_hidden(
        self, ids: torch.Tensor, positions: torch.Tensor, meta: ForwardMeta
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder over device tensors [T]: the last hidden states [T, H] (after the final
        norm, what the LM head reads) and the drafter's features [T, F]."""
        return decoder_features(self.decoder, ids, positions, self.feature_layers, paged_meta=meta)


def _read_samples(groups: list[tuple[list[ScheduledSeq], DeviceSample]], out: StepOutput) -> None:
    """The sampled tokens on the host, into `out.emitted` (a grammar's matcher consumes its
    token here: after sampling, so a retried batch consumes once)."""
    for group, sampled in groups:
        host = sampled.to_host()
        for i, s in enumerate(group):
            token = host.token_ids[i]
            if s.req.grammar is not None:
                try:
                    consume(s.req.grammar, token)
                except Exception as e:
                    out.errors[s.req.rid] = e
                    continue
            lp = host.logprobs[i] if host.logprobs and s.req.sampling.logprobs else None
            out.emitted[s.req.rid] = ([token], [lp] if lp else [])


def _sample_rows(seqs: list[ScheduledSeq], logits: torch.Tensor) -> DeviceSample:
    """Sample `seqs` from their rows of `logits` (a copy: constrained rows are masked in
    place first; their matchers consume the tokens when the step resolves)."""
    apply_masks(logits, [s.req.grammar for s in seqs])
    return sample_on_device(
        logits,
        [s.req.sampling for s in seqs],
        [s.req.tokens if s.req.sampling.repetition_penalty != 1.0 else () for s in seqs],
        [s.req.output_ids for s in seqs],
        [s.req.generator for s in seqs],
    )
