"""A decode step compiled whole on CPU: the unmodified transformers decoder and LM head with
each layer's attention inside the graph, not an opaque op (`engine.compile_decode`).

Why: in the compiled forward (compiled_forward.py) attention is `sessionserve::paged_attention`,
a call back into Python at every layer. On a CPU each call ran ~0.1 ms of Python (the pool's
views, the K/V write, the in-place kernel's call) on caches the layer's GEMMs had just
flushed, 30 times a step for SmolLM2 (docs/benchmarks.md: the attention op took 3.4 ms of an
18 ms step at one request). Here a decode step is exported as one graph over the pool: each
layer's attention is `inplace_decode.decode_attention` over the row's old context (its slots
and lengths, inputs of the package) with the row's own new K/V merged in as one more part, so
the pool is only read; the graph returns every layer's new K/V and `CompiledDecode.run` writes
them with one copy (`KVPool.write_layers`). Inductor fuses the attention's loops with the rest.

Where the layers attend through the hand-written CPU kernel (cpu_decode_kernel.py), a row may
have several new tokens, each seeing its row's context and its row's tokens up to itself: a
chain verify's k + 1 tokens, a short session turn. The same package then runs those steps
instead of the compiled forward, whose attention calls back into Python at every layer. Rows
of unequal widths (a verify where some rows draft fewer tokens, or none) are padded to the
widest for the attention alone, whose kernel skips the padding; the linears and everything
else run on the real tokens. (Before, the whole step was padded, or, past twice its tokens,
ran the compiled forward: a verify of 8 requests where a few drafted cost 2.1x a decode step,
docs/benchmarks.md.) Mixed steps with longer prefill chunks and tree verifies keep the
compiled forward. The package holds its own copy of the weights (frozen, as the forward's):
one more copy of the model in memory.

A model with sliding-window layers (Gemma 3, Mistral) has the package too: those layers
attend over each row's window, the last window - 1 old positions, given as a context of their
own (slots and lengths, in the sliding slot space where the pool keeps their KV apart, whose
K and V are then inputs as well). A row of several new tokens runs it only where no window
cuts its context (each token's window would start elsewhere); the others keep the forward.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence

from sessionserve.cache.kv_pool import KVPool, KVShape, stack_layout
from sessionserve.replicas import block_linear, cpu_linear, gguf_int4
from sessionserve.replicas.aoti_call import load_releasing_gil
from sessionserve.replicas.attention import (
    cpu_decode_kernel,
    install,
    sliding_layers,
    sliding_windows,
)
from sessionserve.replicas.attention.base import SeqSpec, to_device
from sessionserve.replicas.attention.inplace_decode import InlineDecode, part_padded
from sessionserve.replicas.compiled_attention import kernel_chunks
from sessionserve.replicas.compiled_forward import (
    CompiledForward,
    CompilePlan,
    auto_declines,
    package_key,
)
from sessionserve.replicas.hidden_states import decoder_features
from sessionserve.replicas.native_kernel import SHIMS_CONFIG

DECODE_FORMAT = 3  # bump when DecodeStep's inputs or InlineDecode's formula change
EXAMPLE_POOL_SLOTS = 4096  # the export example's pool (its size stays dynamic)
# the example's context columns per part (dynamic too, but inductor sizes the attention's
# loops' threading from it: compiled_attention.py's reason for serving-sized examples)
EXAMPLE_PART_WIDTH = 96
# with its linears the few-row kernel, the package runs steps up to this many tokens even past
# the forward's package (verifies of 8 rows of 5, decode steps of 33+ requests), which would
# run eagerly: the kernel streams each weight once for all the rows (docs/benchmarks.md)
KERNEL_MAX_TOKENS = 64
log = logging.getLogger(__name__)


class DecodeStep(torch.nn.Module):
    """What is exported: token ids and positions [N] (the rows' new tokens one row after
    another; one a row without the CPU kernel), the pool's K and V [layers, S, KVH, D], each
    row's old context slots [B, W] (W a multiple of `chunks`) and lengths [B], the tokens
    whose logits are wanted [R], and where the attention's rows padded to one width T take
    the tokens from (`InlineDecode.spread` [B * T], `kept` [N]; unused without the kernel)
    -> logits [R, V], the drafter's features [N, F] (as `_DecoderAndHead`) and the new K and
    V of every layer [layers, N, KVH, D]."""

    # Inductor inlines a pointwise chain into each loop that reads it unless the chain has
    # more ops than this (50 on a CPU by default): the query's rotary (cos, sin of the
    # positions) was then computed again for every context row a query meets, inside the
    # loop that gathers the keys. At 16 the rotated query is computed once per layer and
    # the gather loops only load it (SmolLM2's first 4 layers, 32 rows over 304 tokens:
    # 18.0 vs 25.9 ms a step).
    BASE_INDUCTOR_CONFIGS = {"realize_opcount_threshold": 16}

    def __init__(
        self,
        model: Any,
        chunks: int,
        feature_layers: tuple[int, ...] | None = None,
        attention_kernel: bool = False,
        linear_kernel: bool = False,
        kv_dtype: torch.dtype | None = None,
        int4_source: tuple[Path, str] | None = None,
        sliding_apart: bool = False,
    ) -> None:
        super().__init__()
        self.config = model.config  # for `package_key`
        # a model with sliding-window layers (Gemma 3): they attend over each row's window,
        # inputs of their own (`window_slots`, `window_lens`), and with `sliding_apart` over
        # the pool's sliding stacks (cache/sliding.py), which the new K/V's order follows
        windows = sliding_windows(self.config)
        self.window = windows[0] if windows else None
        self.sliding_apart = sliding_apart and self.window is not None
        apart = sliding_layers(self.config) if self.sliding_apart else ()
        layers = KVShape.from_hf_config(self.config).num_layers
        self.stack_order, kv_index = stack_layout(layers, apart)
        self.kv_index = kv_index if self.sliding_apart else None  # None: one pool
        # the pool's dtype (`cache.kv_dtype`; None: the model's), an input the package is
        # exported for
        self.kv_dtype = kv_dtype
        self.decoder = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        self.chunks = chunks
        self.feature_layers = feature_layers
        # the layers attend through the hand-written CPU kernel (cpu_decode_kernel.py)
        # instead of inductor's code for `decode_attention`
        self.attention_kernel = attention_kernel
        # the linears run the few-row GEMM kernel (cpu_linear.py) instead of inductor's
        # template: swapped in on the copy that is exported (`export_inputs`)
        self.linear_kernel = linear_kernel
        # the GGUF the decoder was loaded from and the decoder's name in the model: its 4-bit
        # linears and Q8_0 LM head replace the dense ones in the copy that is exported
        # (gguf_int4.py)
        self.int4_source = int4_source
        # new tokens a row may have: the kernel's limit (T * G query rows), 1 for the formula
        shape = KVShape.from_hf_config(self.config)
        self.query_tokens = (
            cpu_decode_kernel.max_query_tokens(self.config.num_attention_heads, shape.num_kv_heads)
            if attention_kernel
            else 1
        )

    @property
    def inductor_configs(self) -> dict[str, Any]:
        """What `build_package` compiles this step with: the C functions of the kernels it
        calls (a build process loads them here)."""
        shims: dict[object, list[str]] = {}
        if self.attention_kernel:
            shims |= cpu_decode_kernel.c_shims()
        if self.linear_kernel:
            shims |= cpu_linear.c_shims()
        if self.int4_source is not None:
            shims |= block_linear.c_shims()
        return {**self.BASE_INDUCTOR_CONFIGS, **({SHIMS_CONFIG: shims} if shims else {})}

    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        slots: torch.Tensor,
        lens: torch.Tensor,
        logit_idx: torch.Tensor,
        spread: torch.Tensor,
        kept: torch.Tensor,
        window_slots: torch.Tensor | None = None,
        window_lens: torch.Tensor | None = None,
        sliding_k: torch.Tensor | None = None,
        sliding_v: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        kernel = self.attention_kernel  # only the kernel takes rows of several tokens
        inline = InlineDecode(
            k_pool,
            v_pool,
            slots,
            lens,
            self.chunks,
            kernel,
            spread if kernel else None,
            kept if kernel else None,
            window_slots,
            window_lens,
            sliding_k,
            sliding_v,
            self.kv_index,
        )
        last, features = decoder_features(
            self.decoder, ids, positions, self.feature_layers, inline_decode=inline
        )
        logits = self.lm_head(last[logit_idx])
        new_k = torch.stack([inline.new_k[i] for i in self.stack_order])
        new_v = torch.stack([inline.new_v[i] for i in self.stack_order])
        return logits, features, new_k, new_v

    def export_inputs(
        self, example_tokens: int, max_tokens: int, device: torch.device
    ) -> tuple[tuple[torch.Tensor, ...], tuple[dict[int, Any], ...]]:
        """Example arguments and their dynamic dimensions: the tokens (up to `max_tokens`),
        the rows (their own dimension where a row may have several tokens), the pool's
        slots, the context width (a multiple of `chunks`) and the logits' rows; for a model
        with sliding windows also the window's slots and lengths, and where the pool keeps
        those layers apart their K and V. Called before
        export: the decoder is switched to our attention function (which takes
        `inline_decode`), whatever it came with, as `build_package` does for the forward's
        package."""
        install(self.decoder)
        if self.linear_kernel:
            cpu_linear.swap_linears(self)  # the decoder's and the LM head's
        if self.int4_source is not None:
            gguf, prefix = self.int4_source
            weights = gguf_int4.read_block_linears(
                gguf, self.decoder, prefix, self.config, lm_head=self.lm_head
            )
            if not weights:
                raise ValueError(f"none of {gguf.name}'s quantized tensors is a linear here")
            # names in this module: the decoder's linears and the LM head
            ours = {k if k == "lm_head" else f"decoder.{k}": w for k, w in weights.items()}
            gguf_int4.swap_block_linears(self, ours)
        shape = KVShape.from_hf_config(self.config)
        dtype = self.kv_dtype or next(self.parameters()).dtype
        n, width = example_tokens, EXAMPLE_PART_WIDTH * self.chunks
        sliding = len(sliding_layers(self.config)) if self.sliding_apart else 0
        heads = (shape.num_kv_heads, shape.head_dim)
        pool = torch.zeros(shape.num_layers - sliding, EXAMPLE_POOL_SLOTS, *heads, dtype=dtype)
        context = (torch.arange(n * width).view(n, width) + 1, torch.full((n,), width))
        example = (
            torch.zeros(n, dtype=torch.int64),
            torch.arange(n) + width,
            pool,
            pool.clone(),
            *context,
            torch.arange(n),
            torch.arange(n),
            torch.arange(n),
        )
        # the example's sizes stay the decode step's (n tokens, n rows: the GEMMs are laid out
        # for them); the dimensions are distinct symbols all the same
        tokens = torch.export.Dim("tokens", min=1, max=max_tokens)
        several = self.query_tokens > 1
        rows = torch.export.Dim("rows", min=1, max=max_tokens) if several else tokens
        # the rows' tokens padded to one width for the attention (`InlineDecode.spread`)
        padded = (
            torch.export.Dim("padded", min=1, max=max_tokens * self.query_tokens)
            if several
            else tokens
        )
        logit_rows = torch.export.Dim("logit_rows", min=1, max=max_tokens)
        pool_slots = torch.export.Dim("pool_slots", min=2)
        columns = self.chunks * torch.export.Dim("part_width", min=1)
        dynamic: tuple[dict[int, Any], ...] = (
            {0: tokens},
            {0: tokens},
            {1: pool_slots},
            {1: pool_slots},
            {0: rows, 1: columns},
            {0: rows},
            {0: logit_rows},
            {0: padded},
            {0: tokens},
        )
        if self.window is not None:  # the windows: a context of their own
            example += tuple(t.clone() for t in context)
            window_columns = self.chunks * torch.export.Dim("window_part_width", min=1)
            dynamic += ({0: rows, 1: window_columns}, {0: rows})
        if self.sliding_apart:
            sliding_pool = torch.zeros(sliding, EXAMPLE_POOL_SLOTS, *heads, dtype=dtype)
            example += (sliding_pool, sliding_pool.clone())
            sliding_slots = torch.export.Dim("sliding_slots", min=2)
            dynamic += ({1: sliding_slots}, {1: sliding_slots})
        return tuple(t.to(device) for t in example), dynamic

    def key_facts(self) -> dict[str, Any]:
        """What the package depends on besides the weights and the config (`package_key`)."""
        return {
            "decode_step": DECODE_FORMAT,
            "chunks": self.chunks,
            "example_part_width": EXAMPLE_PART_WIDTH,
            "inductor_configs": self.BASE_INDUCTOR_CONFIGS,
            "feature_layers": list(self.feature_layers or ()),
            "query_tokens": self.query_tokens,
            # the C function the package calls by name (its code lives in the kernel's
            # library, rebuilt on its own when its source changes)
            "attention_kernel": self.attention_kernel and cpu_decode_kernel.C_SHIM,
            # only where used: packages built before stay valid
            **({"linear_kernel": cpu_linear.key_fact()} if self.linear_kernel else {}),
            **({"kv_dtype": str(self.kv_dtype)} if self.kv_dtype is not None else {}),
            **(
                {"gguf_int4": [gguf_int4.INT4_FORMAT, *block_linear.key_fact()]}
                if self.int4_source is not None
                else {}
            ),
            **(
                {"window": self.window, "sliding_apart": self.sliding_apart}
                if self.window is not None
                else {}
            ),
        }


class CompiledDecode(CompiledForward):
    """A loaded decode-step package: `run(seqs, ids, positions, out_slots, logit_idx, pool)`
    for a step of rows of at most `query_tokens` new tokens each, `min_tokens..max_tokens`
    tokens in all (`takes` says whether a step is one)."""

    # no Python runs inside this package: called holding the GIL, it would stop the
    # replica's other threads for the whole step (aoti_call.py)
    load = staticmethod(load_releasing_gil)

    def __init__(
        self,
        package: Path,
        max_tokens: int,
        min_tokens: int = 1,
        query_tokens: int = 1,
        linear_kernel: bool = False,
        block_kernel: bool = False,
        window: int | None = None,
        sliding_apart: bool = False,
        block_decoder: bool = True,
    ) -> None:
        # a package built with a CPU kernel calls it by name: the op must exist first
        # (where it cannot be loaded, no package here was built with it)
        cpu_decode_kernel.load()
        if linear_kernel:
            cpu_linear.load()
        if block_kernel:
            block_linear.load()
        super().__init__(package, max_tokens, min_tokens)
        self.chunks = kernel_chunks()  # what it was exported for (the key has the threads)
        self.query_tokens = query_tokens  # DecodeStep.query_tokens of its build
        self.linear_kernel = linear_kernel  # DecodeStep.linear_kernel of its build
        self.block_kernel = block_kernel  # its linears the GGUF's blocks (the 4-bit package)
        # ... its decoder's linears mostly so, not only its LM head (BlockSummary)
        self.block_decoder = block_kernel and block_decoder
        self.window = window  # DecodeStep.window of its build (its sliding layers' window)
        self.sliding_apart = sliding_apart  # DecodeStep.sliding_apart of its build

    @property
    def reads_weights_once(self) -> bool:
        """Its linears are a hand-written kernel that reads each weight once for all of a
        step's rows (the few-row fp32 kernel, or the block kernel on the GGUF's 4-bit
        weights), not the forward's GEMMs tuned for 2 rows that the split timing weighed
        against the prefill package's: so it takes the steps in its range from the prefill
        package too (`ModelRunner._takes_decode_package`; measured faster there on the
        boxes docs/benchmarks.md names, not on every CPU). Not where the block kernel has
        the LM head alone (Gemma 3's file): its decoder's dense GEMMs lost to the prefill
        package's at 8 and 12 requests (0.89x, 0.78x; docs/benchmarks.md)."""
        return self.linear_kernel or self.block_decoder

    def takes(self, seqs: list[SeqSpec], sliding: bool = False) -> bool:
        """Whether this package runs a step of these rows: rows adding 1..query_tokens tokens
        causally (no tree), at most `max_tokens` tokens of their own in all (the forward's
        package's range, or more with the linear kernels), sliding slots (`sliding`) where it
        was built for them. How far the rows pad for the attention does not matter: at most
        `max_tokens` rows of `query_tokens`, what the package was exported for, and the
        kernel skips the padding. With sliding windows, rows of several tokens only where no
        window cuts their context (each token's window starts elsewhere, and a row's
        attention reads one context)."""
        widest = max(s.q_len for s in seqs)
        return not (
            sliding != self.sliding_apart
            or widest > self.query_tokens
            or not self.accepts(sum(s.q_len for s in seqs))
            or any(s.tree_mask is not None for s in seqs)
            or (
                self.window is not None
                and widest > 1
                and any(s.ctx_len > self.window for s in seqs)
            )
        )

    def run(  # type: ignore[override] - a decode step reads the pool and the slot tables
        self,
        seqs: list[SeqSpec],
        ids: torch.Tensor,
        positions: torch.Tensor,
        out_slots: torch.Tensor,
        logit_idx: torch.Tensor,
        pool: KVPool,
        sliding_out_slots: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [R, V] of the tokens `logit_idx` [R] and every token's features [N, F];
        every layer's new K/V written to `pool` at `out_slots` (device tensors [N] for ids,
        positions and out_slots: the rows' tokens one row after another), the sliding
        layers' kept apart at `sliding_out_slots`."""
        old = [s.ctx_slots[: s.ctx_len - s.q_len] for s in seqs]  # the new tokens' are last
        slots = part_padded(pad_sequence(old, batch_first=True), self.chunks)
        lens = torch.tensor([len(o) for o in old])
        device = ids.device
        windows: list[torch.Tensor] = []
        if self.window is not None:  # each row's old tokens its new token's window holds
            if self.sliding_apart:  # (a row's sliding slots: the window's, new ones last)
                seen = [s.sliding_slots[: len(s.sliding_slots) - s.q_len] for s in seqs]
            else:
                seen = [o[max(0, len(o) - (self.window - 1)) :] for o in old]
            window_slots = part_padded(pad_sequence(seen, batch_first=True), self.chunks)
            windows += [window_slots, torch.tensor([len(w) for w in seen])]
            windows = [to_device(t, device) for t in windows]
        if self.sliding_apart:
            windows += [pool.sliding_k, pool.sliding_v]
        widths = [s.q_len for s in seqs]
        n = len(ids)
        # rows of unequal widths attend padded to the widest; the rest of the step (the
        # linears above all) runs on the n real tokens
        kept = padded_rows(widths)
        if kept is None:
            kept = spread = torch.arange(n)
        else:
            spread = torch.full((len(seqs) * max(widths),), n).index_copy_(0, kept, torch.arange(n))
        wanted = len(logit_idx)  # none: a prefill chunk alone (the package returns >= 1)
        logits, features, new_k, new_v = self._fn(
            ids,
            positions,
            pool.k,
            pool.v,
            to_device(slots, device),
            to_device(lens, device),
            logit_idx if wanted else logit_idx.new_zeros(1),
            to_device(spread, device),
            to_device(kept, device),
            *windows,
        )
        logits = logits[:wanted]
        pool.write_layers(out_slots, new_k, new_v, sliding_out_slots)
        return logits, features


def padded_rows(widths: list[int]) -> torch.Tensor | None:
    """Where each of the rows' tokens (row b has `widths[b]`) sits once every row is padded
    to the widest: indices into [B * max(widths)]; None when the rows are equal (no padding)."""
    width = max(widths)
    if all(w == width for w in widths):
        return None
    columns = torch.arange(width)
    starts = torch.arange(len(widths)) * width
    return (starts[:, None] + columns)[columns < torch.tensor(widths)[:, None]]


def plan_decode_compile(
    mode: bool | str,
    forward: CompilePlan,
    model: Any,
    pool: KVPool,
    attention_kernel: bool | None = None,
    linear_kernel: bool | None = None,
) -> tuple[CompilePlan, DecodeStep | None]:
    """Resolve `engine.compile_decode` (auto | true | false) beside the compiled forward
    `forward`: a package for decode steps of up to its `max_tokens` rows, or
    KERNEL_MAX_TOKENS with the linear kernel (and, through the CPU attention kernel,
    verifies and short turns: `DecodeStep.query_tokens`), where the
    forward is an AOTInductor package (CPU); sliding-window layers over their windows, in
    the sliding slot space where `pool` keeps their KV apart. auto: for models of
    AUTO_MIN_PARAMS+ parameters.
    Returns the plan and, when enabled, the step it compiles (the one its key was taken
    from). `attention_kernel` None: the CPU kernel where `use_attention_kernel` says so;
    `linear_kernel` None: the few-row GEMM kernel where `cpu_linear.usable_for` says so
    (benchmarks and tests pick)."""
    if not forward.enabled or mode is False:
        why = "engine.compile_decode is false or the forward is not compiled"
        return CompilePlan(False, why), None
    if forward.package is None:
        return CompilePlan(False, "on CUDA decode steps replay CUDA graphs"), None
    if mode == "auto" and (why := auto_declines(model)):
        return CompilePlan(False, why), None
    if attention_kernel is None:
        attention_kernel = use_attention_kernel(model, pool)
    if linear_kernel is None:
        linear_kernel = cpu_linear.usable_for(model)
    model_dtype = next(model.parameters()).dtype
    step = DecodeStep(
        model,
        kernel_chunks(),
        forward.feature_layers,
        attention_kernel,
        linear_kernel,
        kv_dtype=pool.dtype if pool.dtype != model_dtype else None,
        sliding_apart=pool.has_sliding,
    )
    max_tokens = max(forward.max_tokens, KERNEL_MAX_TOKENS if linear_kernel else 0)
    key = package_key(step, max_tokens, weights=forward.weights)
    plan = CompilePlan(
        True,
        "engine.compile_decode",
        Path(forward.package).parent / f"{key}.pt2",
        max_tokens,
        forward.feature_layers,
        role="decode step package",
        loads_as=functools.partial(
            CompiledDecode,
            query_tokens=step.query_tokens,
            linear_kernel=step.linear_kernel,
            window=step.window,
            sliding_apart=step.sliding_apart,
        ),
    )
    return plan, step


def dense_step_declines(mode: bool | str, model: Any) -> str | None:
    """Why `engine.compile_decode: auto` builds no dense decode step package for `model`
    (None: it does). A bf16 model with sliding-window layers keeps the compiled forward for
    its decode steps: on the Zen 4 box Gemma 3's package ran them 0.96-1.08x as fast as the
    forward (its 262K-row LM head is most of a step, and the package's bf16 GEMMs are no
    faster than the forward's), and its 4-bit package, whose blocks (the Q8_0 head, Q5_0 and
    Q4_K and re-blocked Q6_K linears) read half the bytes, takes those steps (1.22-1.64x at 1-12
    requests), exported from the same step all the same. In fp32 the
    package's linears are the few-row kernel, which reads each weight once for all rows: 8
    requests 1.52x, 1-4 requests 0.95-0.96x (docs/benchmarks.md), so it is built. `true`
    builds it in either dtype."""
    dtype = next(model.parameters()).dtype
    if mode == "auto" and sliding_windows(model.config) and dtype == torch.bfloat16:
        return "a bf16 model with sliding-window layers: its dense package measured no faster"
    return None


def plan_int4_decode_compile(
    mode: bool | str,
    forward: CompilePlan,
    decode: CompilePlan,
    dense: DecodeStep | None,
    model: Any,
    source: str | None,
) -> tuple[CompilePlan, DecodeStep | None]:
    """Resolve `engine.gguf_int4_decode` (auto | true | false) beside the decode step package
    (`decode`, exported from `dense`; `forward`: the compiled forward's plan): a second
    decode step package whose decoder linears and LM head are the quantized weights of the
    GGUF the model was loaded from (`source`), run by the block-quantized kernel
    (block_linear.py), for steps of up to `gguf_int4.MAX_TOKENS` tokens (48: its int8 terms,
    or on AMX CPUs its tiles, beat the dense packages' GEMMs there), where such steps read
    weights more than they compute.
    Only for a bf16 model (the kernel's int8 pairs hold a row about as finely as bf16, not as
    fp32), whose GGUF stores linears or the LM head quantized (as stored where the kernel
    reads the kind, re-blocked as 8-bit where not: gguf_int4.py), on a CPU with AVX-512 VNNI;
    auto and
    true differ only in that true logs why it cannot be had. Its attention and KV are the
    dense package's."""

    def declined(why: str) -> tuple[CompilePlan, None]:
        if mode is True:
            log.warning("engine.gguf_int4_decode: not used, because %s", why)
        return CompilePlan(False, why), None

    if mode is False:
        return CompilePlan(False, "engine.gguf_int4_decode is false"), None
    if not decode.enabled or dense is None or decode.package is None:
        return declined(f"there is no decode step package ({decode.reason})")
    if next(model.parameters()).dtype not in block_linear.MODEL_DTYPES:
        return declined("the model is not served in bf16")
    gguf = Path(source) if source else None
    if gguf is None or gguf.suffix != ".gguf" or not gguf.is_file():
        return declined("the model was not loaded from a GGUF file")
    decoder = model.get_decoder()
    prefix = next(name for name, m in model.named_modules() if m is decoder)
    step = DecodeStep(
        model,
        dense.chunks,
        dense.feature_layers,
        dense.attention_kernel,
        kv_dtype=dense.kv_dtype,
        int4_source=(gguf, prefix),
        sliding_apart=dense.sliding_apart,
    )

    def package_for(max_tokens: int) -> Path:
        key = package_key(step, max_tokens, weights=forward.weights)
        return decode.package.parent / f"{key}.pt2"

    stat = gguf.stat()  # what the file holds, read once per file (its name, size and time)
    record = decode.package.parent / f"{gguf.name}-{stat.st_size}-{stat.st_mtime_ns}.blocks.json"
    blocks = gguf_int4.block_summary(gguf, record)
    if not blocks.tensors:
        return declined(f"{gguf.name} stores no quantized tensor the package could read")
    # after the file's check: building the kernel (once per machine) is for files it serves
    if not block_linear.load():
        return declined(f"the block-quantized kernel cannot run here: {block_linear.why_not()}")
    max_tokens = gguf_int4.MAX_TOKENS
    plan = CompilePlan(
        True,
        "engine.gguf_int4_decode",
        package_for(max_tokens),
        max_tokens,
        dense.feature_layers,
        role="4-bit decode step package",
        loads_as=functools.partial(
            CompiledDecode,
            query_tokens=step.query_tokens,
            block_kernel=True,
            block_decoder=blocks.decoder_blocks,
            window=step.window,
            sliding_apart=step.sliding_apart,
        ),
    )
    return plan, step


def use_attention_kernel(model: Any, pool: KVPool) -> bool:
    """Whether the decode step attends through the hand-written CPU kernel
    (`cpu_decode_kernel.usable`: the layout and dtype supported, the kernel built and loaded
    here; otherwise the reason is logged). 1.42-1.50x inductor's code for the same attention
    over multi-turn contexts (docs/benchmarks.md)."""
    shape = KVShape.from_hf_config(model.config)
    heads = model.config.num_attention_heads
    return cpu_decode_kernel.usable(shape.head_dim, heads, shape.num_kv_heads, pool.k.dtype)
