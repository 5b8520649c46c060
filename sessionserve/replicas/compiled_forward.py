"""The model's forward compiled ahead of time: the unmodified transformers decoder and LM head,
exported with `torch.export` and compiled by AOTInductor into a package cached on disk.

Why this shape (measured on 2 AVX2 cores, SmolLM2-135M fp32, docs/benchmarks.md): a decode
step is bound by reading the weights, and the eager GEMV (MKL at one row) reads them on one
core at ~15 GB/s while two cores reach ~32. Inductor's C++ GEMM templates (max-autotune, with
the weights frozen into the graph) use both and fuse the norms, rotary and activations
around them; attention stays our op (`attention/paged_op.py`), opaque to the compiler. JIT
`torch.compile` gets the same kernels but cannot cache them (the frozen, prepacked weights
bypass inductor's FX graph cache), so every start would pay minutes; an AOTInductor package
is built once per model, thread count and CPU, and loads in seconds after.

One package serves every step of 1..max_tokens tokens (one dynamic dimension for the tokens,
one for the rows whose logits are wanted): its GEMMs are autotuned for a few rows, and from
~50 rows on they lose to eager MKL. Longer steps (prefill chunks, long verifies) run eagerly
or, with `engine.compile_prefill`, through a second package exported for 256 rows without
autotuning (inductor then keeps oneDNN GEMMs on weights it prepacks, and still fuses what is
around them): on an AMD EPYC with AVX-512 that one is 1.2-1.5x faster than eager, on an AVX2
CPU 0.73-0.92x slower from 128 tokens on (docs/benchmarks.md), so `auto` times it once on the
machine (prefill_choice.py) and keeps it only where it pays.

On CUDA the same module is compiled by `torch.compile` instead (`JitForward`: dynamo and
inductor, Triton kernels around cuBLAS GEMMs, the attention still the opaque op) and the CUDA
graphs replay it: a GPU needs no frozen, prepacked weights, so inductor's FX graph cache keeps
the kernels on disk across restarts, and loading an AOTInductor CUDA package segfaulted on the
H100 this was measured on (torch 2.11).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import sessionserve
from sessionserve.replicas import block_linear, build_lock, gguf_int4, prefill_choice
from sessionserve.replicas.attention import install
from sessionserve.replicas.attention.base import ForwardMeta
from sessionserve.replicas.attention.paged_op import forward_context
from sessionserve.replicas.hidden_states import decoder_features
from sessionserve.replicas.loader import cache_root
from sessionserve.replicas.native_kernel import SHIMS_CONFIG

log = logging.getLogger(__name__)
AUTO_MIN_PARAMS = 50_000_000  # `compile: auto` skips smaller models (tests' tiny ones): a
# build costs minutes, and a forward that small is bound by Python, not by weight reads
HEARTBEAT_S = 30.0
JIT_LOG_S = 2.0  # a JitForward call this long compiled (a compiled CUDA forward takes ms)
PACKAGE_FORMAT = 1  # bump when what is exported changes (_DecoderAndHead, the attention op)
DECODE_EXAMPLE_TOKENS = 2  # the decode package's export example: its GEMMs' tuning shape
PREFILL_EXAMPLE_TOKENS = 256  # the prefill package's (at most its largest step)


def default_cache_dir() -> Path:
    """`$SESSIONSERVE_CACHE/compiled`, else `~/.cache/sessionserve/compiled`."""
    return cache_root() / "compiled"


class _DecoderAndHead(torch.nn.Module):
    """What is exported: token ids and positions [T], the rows wanted [N] -> logits [N, V]
    and the drafter's features [T, F] (the last hidden states after the final norm, or the
    `feature_layers` concatenated: what an EAGLE / EAGLE-3 head reads).

    With `compute_dtype` (the prefill package's GEMMs in fp32 beside a bf16 model,
    `engine.compile_prefill_dtype`; the model given already `in_compute_dtype`), the
    embeddings are looked up in the model's dtype and the layers run in `compute_dtype`;
    attention, the KV written, the LM head, the logits and the features stay in the model's
    dtype, so the package's outputs are those of the bf16 forward it stands in for, computed
    with fewer roundings.

    With `head` (a `BlockLinear`: the GGUF's own LM head, `gguf_int4.block_head`), the logits
    come from the file's blocks through the block kernel, as the 4-bit decode step package's
    do: a prefill step's few rows of logits read the whole head, Gemma 3's 262,144 x 640 at
    1.06 bytes a weight instead of bf16's 2."""

    def __init__(
        self,
        model: Any,
        feature_layers: tuple[int, ...] | None = None,
        compute_dtype: torch.dtype | None = None,
        head: torch.nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.decoder = model.get_decoder()
        self.lm_head = head if head is not None else model.get_output_embeddings()
        self.feature_layers = feature_layers
        self.compute_dtype = compute_dtype

    @property
    def inductor_configs(self) -> dict[str, Any]:
        """The block kernel's C function where the head is the file's blocks (`build_package`
        compiles with what a module asks for)."""
        if isinstance(self.lm_head, block_linear.BlockLinear):
            return {SHIMS_CONFIG: block_linear.c_shims()}
        return {}

    def forward(
        self, ids: torch.Tensor, positions: torch.Tensor, logit_idx: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.compute_dtype is None:
            last, features = decoder_features(self.decoder, ids, positions, self.feature_layers)
            return self.lm_head(last[logit_idx]), features
        embeddings = self.decoder.get_input_embeddings()
        stored = embeddings.weight.dtype
        last, features = decoder_features(
            self.decoder,
            None,
            positions,
            self.feature_layers,
            inputs_embeds=embeddings(ids).to(self.compute_dtype),
            attention_dtype=stored,
        )
        return self.lm_head(last[logit_idx].to(stored)), features.to(stored)

    @staticmethod
    def export_inputs(
        example_tokens: int, max_tokens: int, device: torch.device
    ) -> tuple[tuple[torch.Tensor, ...], tuple[dict[int, Any], ...]]:
        """Example arguments and their dynamic dimensions: tokens, and rows of logits (the
        example's last two: one would specialize to a constant)."""
        tokens, rows = token_dims(max_tokens)
        n = example_tokens
        example = (torch.zeros(n, dtype=torch.int64), torch.arange(n), torch.arange(n - 2, n))
        return tuple(t.to(device) for t in example), ({0: tokens}, {0: tokens}, {0: rows})


def in_compute_dtype(model: Any, dtype: torch.dtype) -> Any:
    """`model` (a copy to export) with its decoder's layers, norms and rotary tables in
    `dtype`, its input embeddings and LM head as they were (`_DecoderAndHead`'s
    `compute_dtype`): a bf16 prefill package's GEMMs then run in fp32 for a second copy of
    the layers' weights (4 bytes a weight, not 2), the embedding table (Gemma 3's is most
    of its weights) kept at 2."""
    decoder = model.get_decoder()
    embeddings = decoder.get_input_embeddings()
    for child in decoder.children():
        if child is not embeddings:
            child.to(dtype)
    return model


def token_dims(max_tokens: int) -> tuple[Any, Any]:
    """An exported step's dynamic dimensions: its tokens, and the rows whose logits it returns."""
    return (
        torch.export.Dim("tokens", min=1, max=max_tokens),
        torch.export.Dim("rows", min=1, max=max_tokens),
    )


def load_flat(package: Path) -> Callable[..., list[torch.Tensor]]:
    """An AOTInductor package as a function of its positional tensors, returning its flat
    list of output tensors. `AOTICompiledModel.__call__` parses the package's input and
    output tree specs from JSON and flattens its arguments on every call (~12 us on this
    project's CPU, 30 times per decode step for the attention kernel); our packages take
    positional tensors and return tensors, so calling the loader's `boxed_run` is the same
    call without that."""
    remove_stale_extractions()
    model = torch._inductor.aoti_load_package(str(package))
    loader = getattr(model, "loader", None)
    if loader is None or not hasattr(loader, "boxed_run"):  # another torch: the plain call

        def call(*args: torch.Tensor) -> list[torch.Tensor]:
            out = model(*args)
            return list(out) if isinstance(out, (tuple, list)) else [out]

        return call
    return lambda *args: loader.boxed_run(list(args))


class CompiledForward:
    """A loaded package: `run(ids, positions, logit_idx, meta)` as `ModelRunner.forward`'s
    eager path computes it, for steps of `min_tokens..max_tokens` tokens."""

    # how the package is loaded (the decode step package's: without holding the GIL)
    load: Callable[[Path], Callable[..., list[torch.Tensor]]] = staticmethod(load_flat)

    def __init__(self, package: Path, max_tokens: int, min_tokens: int = 1) -> None:
        self.package = package
        self.max_tokens = max_tokens
        self.min_tokens = min_tokens
        self._fn = self.load(package)

    limited = False  # steps its range holds run eagerly past `max_tokens` (`limit_to`)

    def accepts(self, num_tokens: int) -> bool:
        return self.min_tokens <= num_tokens <= self.max_tokens

    def limit_to(self, max_tokens: int) -> None:
        """Take steps of at most `max_tokens` where the package, exported for longer ones,
        was timed slower than the eager forward past it (prefill_choice.step_limit)."""
        if max_tokens < self.max_tokens:
            self.max_tokens, self.limited = max_tokens, True

    def run(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        logit_idx: torch.Tensor,
        meta: ForwardMeta,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [N, V] and features [T, F]. A step that wants no logits (a prefill chunk
        before the prompt's last) computes one row, dropped: the package's logits dimension
        starts at 1."""
        wanted = logit_idx if logit_idx.numel() else logit_idx.new_zeros(1)
        with forward_context(meta):
            logits, features = self._fn(ids, positions, wanted)
        return (logits if logit_idx.numel() else logits[:0]), features


class JitForward(CompiledForward):
    """`CompiledForward` on CUDA: `_DecoderAndHead` under `torch.compile` (fullgraph, dynamic
    shapes), compiled on its first call of each shape class (a decode batch of one, of more,
    a single extend: on an H100 the 1.2B benchmark model's first two shapes and two rounds of
    decoding took 22-26 s; kernels then come from inductor's on-disk cache) and replayed by
    the CUDA graphs that capture it. Engines over the same model object share one compiled
    function, so a second engine in a process (a benchmark, a test) does not trace again."""

    def __init__(
        self,
        model: Any,
        max_tokens: int,
        feature_layers: tuple[int, ...] | None = None,
        options: Mapping[str, Any] | None = None,
    ) -> None:
        self.package = None
        self.max_tokens = max_tokens
        self.min_tokens = 1
        self._fn = _jit_compiled(model, feature_layers, JIT_OPTIONS if options is None else options)

    def run(
        self, ids: torch.Tensor, positions: torch.Tensor, logit_idx: torch.Tensor, meta: ForwardMeta
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As `CompiledForward.run`; a call that compiled (it took seconds: a CUDA forward
        returns once its kernels are queued) is logged, so a first request's wait is explained."""
        started = time.monotonic()
        out = super().run(ids, positions, logit_idx, meta)
        if (took := time.monotonic() - started) > JIT_LOG_S:
            log.info(
                "compile: torch.compile compiled the forward for %d tokens in %.0f s",
                len(ids),
                took,
            )
        return out


_jit: weakref.WeakKeyDictionary[Any, dict] = weakref.WeakKeyDictionary()

# inductor options for `JitForward` (torch.compile's `options`). {"freezing": True} folds the
# weights in as constants, and on CUDA inductor's freezing passes then merge the GEMMs that
# share an input (q/k/v, gate/up) into one each, keeping a merged copy of those weights beside
# the model's. Measured on an H100 (run G, docs/benchmarks.md; `benchmarks/gpu.py
# --jit-freezing`): 2.81 vs 2.77 ms a decode step at 1 request, 4.28 vs 4.30 at 32: no gain, off.
JIT_OPTIONS: dict[str, Any] = {}


def _jit_compiled(
    model: Any, feature_layers: tuple[int, ...] | None, options: Mapping[str, Any]
) -> Callable[..., Any]:
    compiled = _jit.setdefault(model, {})
    key = (feature_layers, tuple(sorted(options.items())))
    if key not in compiled:
        install(model)  # the compiled trace calls our paged attention as the opaque op
        module = _DecoderAndHead(model, feature_layers).eval()
        compiled[key] = torch.compile(
            module, dynamic=True, fullgraph=True, options=dict(options) or None
        )
    return compiled[key]


def weights_digest(model: Any) -> str:
    """A hash of every parameter and buffer (names and bytes): reading them all takes about a
    second per few hundred MB, so a start hashes them once for both packages' keys."""
    digest = hashlib.blake2b(digest_size=16)
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def package_key(
    model: Any,
    max_tokens: int,
    feature_layers: tuple[int, ...] | None = None,
    example_tokens: int = DECODE_EXAMPLE_TOKENS,
    autotune: bool = True,
    weights: str | None = None,
    compute_dtype: torch.dtype | None = None,
    gguf_head: bool = False,
) -> str:
    """What a package's code and constants depend on: the weights (`weights_digest`, unless
    given), the model config (not the path it was loaded from), dtype and device, the token
    limit, the hidden states it returns, the shape its GEMMs are laid out for and whether
    they were autotuned, the dtype its layers compute in where not the model's, whether its
    LM head is the GGUF's blocks (`gguf_head`: the kernel's format), the thread count and CPU
    ISA the kernels were tuned for, and the torch, transformers and sessionserve versions."""
    import transformers
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    digest = hashlib.blake2b(digest_size=16)
    digest.update((weights or weights_digest(model)).encode())
    param = next(model.parameters())
    config = json.loads(model.config.to_json_string(use_diff=False))
    # where the model was loaded from is no part of it: a GGUF's first start (converting it)
    # and every later start (the converted copy) must find the same packages
    config.pop("_name_or_path", None)
    facts = {
        "config": config,
        "dtype": str(param.dtype),
        "device": param.device.type,
        "max_tokens": max_tokens,
        "threads": torch.get_num_threads(),
        "isa": str(pick_vec_isa()),
        "versions": [torch.__version__, transformers.__version__, sessionserve.__version__],
        "format": PACKAGE_FORMAT,
    }
    if feature_layers is not None:  # only then: packages built before stay valid
        facts["feature_layers"] = list(feature_layers)
    if (example_tokens, autotune) != (DECODE_EXAMPLE_TOKENS, True):  # likewise
        facts["example_tokens"], facts["autotune"] = example_tokens, autotune
    if not autotune:  # such packages merge the GEMMs that share an input (build_package)
        facts["concat_linear"] = True
    if compute_dtype is not None:  # likewise
        facts["compute_dtype"] = str(compute_dtype)
    if gguf_head:  # likewise
        facts["gguf_head"] = [gguf_int4.INT4_FORMAT, *block_linear.key_fact()]
    if hasattr(model, "key_facts"):  # what else a module's package depends on (its layout)
        facts.update(model.key_facts())
    digest.update(json.dumps(facts, sort_keys=True).encode())
    return digest.hexdigest()


def build_package(
    model: Any,
    path: Path,
    max_tokens: int,
    feature_layers: tuple[int, ...] | None = None,
    *,
    example_tokens: int = DECODE_EXAMPLE_TOKENS,
    autotune: bool = True,
    compute_dtype: torch.dtype | None = None,
    head_gguf: Path | None = None,
) -> None:
    """Export and compile (minutes on a small CPU; a heartbeat logs progress), writing the
    package atomically to `path`. `model` must not run forwards meanwhile: export swaps its
    parameters for fake ones while it traces (callers pass a copy). The GEMMs are laid out
    (with `autotune`, autotuned) for `example_tokens` rows (2: decode steps; 256: the prefill
    package). `model` is a transformers model (exported as `_DecoderAndHead`, its layers
    converted to `compute_dtype` where given, its LM head the blocks of the GGUF `head_gguf`
    where given) or a module that says how it is exported (`export_inputs`, as the EAGLE
    head's step does)."""
    device = next(model.parameters()).device
    if hasattr(model, "export_inputs"):
        module = model.eval()
    else:
        install(model)  # whatever it came with, the package runs our paged attention
        head = gguf_int4.block_head(head_gguf, model) if head_gguf is not None else None
        if head_gguf is not None and head is None:
            log.info("compile: %s's LM head is not blocks the kernel reads: dense", head_gguf.name)
        if compute_dtype is not None:
            in_compute_dtype(model, compute_dtype)
        module = _DecoderAndHead(model, feature_layers, compute_dtype, head).eval()
    example, dynamic = module.export_inputs(example_tokens, max_tokens, device)
    started = time.monotonic()
    with torch.inference_mode(), _heartbeat(path, started):
        program = torch.export.export(module, example, dynamic_shapes=dynamic)
        log.info("compile: exported in %.1f s; compiling (AOTInductor)", time.monotonic() - started)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{builder_tag()}.partial.pt2")
        try:
            torch._inductor.aoti_compile_and_package(
                program,
                package_path=str(partial),
                # in-process compiles: no worker pool left behind a replica that stops
                inductor_configs={
                    "freezing": True,
                    "max_autotune": autotune,
                    "compile_threads": 1,
                    # without autotuning (the prefill package: oneDNN GEMMs, ~10 us of
                    # overhead a call) q/k/v and gate/up become one GEMM each: 121 calls a
                    # step, not 211, 1.05x a decode step of 8 or 16 rows in bf16 (ad hoc);
                    # the autotuned package's templates lost with it (0.87-0.93x)
                    "cpp.enable_concat_linear": not autotune,
                    **getattr(module, "inductor_configs", {}),  # what a module asks for
                },
            )
            os.replace(partial, path)
        finally:
            partial.unlink(missing_ok=True)
    log.info("compile: built %s in %.0f s", path, time.monotonic() - started)


@contextlib.contextmanager
def _heartbeat(path: Path, started: float) -> Iterator[None]:
    """Log every HEARTBEAT_S while a build runs, so a first start does not look hung."""
    done = threading.Event()

    def beat() -> None:
        while not done.wait(HEARTBEAT_S):
            log.info("compile: still building %s (%.0f s)", path.name, time.monotonic() - started)

    thread = threading.Thread(target=beat, name="compile-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()


@dataclass(frozen=True)
class CompilePlan:
    """What `engine.compile` (or `engine.compile_prefill`) resolved to for this model: whether
    to compile, where the package is kept, and which steps it runs."""

    enabled: bool
    reason: str
    package: Path | None = None
    max_tokens: int = 0
    feature_layers: tuple[int, ...] | None = None  # what the drafter reads (model_runner.py)
    min_tokens: int = 1
    example_tokens: int = DECODE_EXAMPLE_TOKENS
    autotune: bool = True
    only_if_faster: bool = False  # `compile_prefill: auto`: timed against eager first
    weights: str | None = None  # `weights_digest` of the model, for the next plan's key
    compute_dtype: torch.dtype | None = None  # the layers' dtype where not the model's
    head_gguf: Path | None = None  # the GGUF whose LM head blocks the package's head runs
    role: str = "forward"  # what the log calls it ("prefill package": compile_prefill's)
    # (package, max_tokens, min_tokens) -> the loaded package; the EAGLE head's: CompiledHead
    loads_as: Callable[[Path, int, int], CompiledForward] = CompiledForward


def plan_compile(
    mode: bool | str,
    model: Any,
    max_tokens: int,
    cache_dir: str | None,
    feature_layers: tuple[int, ...] | None = None,
) -> CompilePlan:
    """Resolve `engine.compile` (auto | true | false) for `model`: auto compiles on CPU and
    on CUDA for a model of at least AUTO_MIN_PARAMS parameters. On CUDA the plan has no
    package: `JitForward` compiles (measured on an H100: decode steps 1.22-1.50x faster inside
    the CUDA graphs, docs/benchmarks.md)."""
    if mode is False:
        return CompilePlan(False, "engine.compile is false")
    if mode == "auto" and (why := auto_declines(model)):
        return CompilePlan(False, why)
    if next(model.parameters()).device.type == "cuda":
        return CompilePlan(
            True, "engine.compile (torch.compile on CUDA)", None, max_tokens, feature_layers
        )
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    weights = weights_digest(model)
    package = root / f"{package_key(model, max_tokens, feature_layers, weights=weights)}.pt2"
    return CompilePlan(True, "engine.compile", package, max_tokens, feature_layers, weights=weights)


def auto_declines(model: Any) -> str | None:
    """Why `auto` does not compile `model` (None: it does): only on CPU and CUDA, only for
    models of AUTO_MIN_PARAMS+ parameters."""
    device = next(model.parameters()).device
    if device.type not in ("cpu", "cuda"):
        return f"auto on {device.type}: not measured there"
    params = sum(p.numel() for p in model.parameters())
    if params < AUTO_MIN_PARAMS:
        return f"auto: a {params:,}-parameter model is not worth it"
    return None


def plan_prefill_compile(
    mode: bool | str,
    forward: CompilePlan,
    model: Any,
    max_tokens: int,
    min_tokens: int,
    dtype_mode: str = "model",
    head_gguf: Path | None = None,
) -> CompilePlan:
    """Resolve `engine.compile_prefill` (auto | true | false) beside the compiled forward
    `forward`: a package for the steps of `min_tokens .. max_tokens` tokens (the forward's
    package keeps the shorter ones: `min_tokens` is at most one past its limit), its
    GEMMs laid out for PREFILL_EXAMPLE_TOKENS rows and not autotuned (as fast here, and built
    in less time). auto: for models of AUTO_MIN_PARAMS+ parameters on CPU, kept only where
    it is timed faster than the eager forward (prefill_choice.py). `dtype_mode`
    (`engine.compile_prefill_dtype`: auto | model | float32) says what its layers compute
    in (`prefill_choice.compute_dtype`). `head_gguf`: the GGUF whose LM head the package
    reads as blocks (where the 4-bit decode step package runs the file's weights: the
    first token's logits then come from the same head as the later tokens')."""
    if not forward.enabled or mode is False:
        return CompilePlan(False, "engine.compile_prefill is false or the forward is not compiled")
    if forward.package is None:
        return CompilePlan(
            False,
            "on CUDA the compiled forward runs steps of any length up to engine.compile_max_tokens",
        )
    if max_tokens <= forward.max_tokens:
        return CompilePlan(False, "no step is longer than engine.compile_max_tokens")
    if mode == "auto" and (why := auto_declines(model)):
        return CompilePlan(False, why)
    assert forward.package is not None
    example = min(PREFILL_EXAMPLE_TOKENS, max_tokens)
    key = package_key(
        model, max_tokens, forward.feature_layers, example, autotune=False, weights=forward.weights
    )
    compute = prefill_choice.compute_dtype(
        dtype_mode,
        model,
        example,
        forward.package.parent / f"{key}.gemm.json",
        auto_declines(model) is None,
    )
    if compute is not None or head_gguf is not None:
        key = package_key(
            model,
            max_tokens,
            forward.feature_layers,
            example,
            autotune=False,
            weights=forward.weights,
            compute_dtype=compute,
            gguf_head=head_gguf is not None,
        )
    return CompilePlan(
        True,
        "engine.compile_prefill",
        forward.package.parent / f"{key}.pt2",
        max_tokens,
        forward.feature_layers,
        min_tokens=min(min_tokens, forward.max_tokens + 1),
        example_tokens=example,
        autotune=False,
        only_if_faster=mode == "auto",
        role="prefill package",
        compute_dtype=compute,
        head_gguf=head_gguf,
    )


def build_in_process(model: Any, plan: CompilePlan) -> None:
    """`build_package` for `plan` in this process, on a copy of the model."""
    assert plan.package is not None
    build_package(
        copy.deepcopy(model),
        plan.package,
        plan.max_tokens,
        plan.feature_layers,
        example_tokens=plan.example_tokens,
        autotune=plan.autotune,
        compute_dtype=plan.compute_dtype,
        head_gguf=plan.head_gguf,
    )


def build_in_subprocess(model: Any, plan: CompilePlan) -> None:
    """`build_package` in a child process at the lowest CPU priority: inductor's lowering is
    Python, and in a thread beside a serving engine it held the GIL enough to make requests
    ~3x slower while it ran (measured: the end-to-end suite took 5:20 instead of 3:04). The
    model travels as a `torch.save` file next to the package; the child logs to our stderr."""
    path = plan.package
    assert path is not None
    path.parent.mkdir(parents=True, exist_ok=True)
    model_file = path.with_suffix(f".{builder_tag()}.model.pt")
    layers = plan.feature_layers
    try:
        torch.save(model, model_file)
        argv = [str(model_file), str(path), str(plan.max_tokens), str(torch.get_num_threads())]
        argv.append(",".join(map(str, layers)) if layers is not None else "-")
        argv += [str(plan.example_tokens), str(int(plan.autotune))]
        argv.append(str(plan.compute_dtype).removeprefix("torch.") if plan.compute_dtype else "-")
        argv.append(str(plan.head_gguf) if plan.head_gguf is not None else "-")
        # `nice`, not a preexec_fn: forking a threaded process must not run Python in the child
        command = [sys.executable, "-m", __name__, *argv]
        if shutil.which("nice"):
            command = ["nice", "-n", "19", *command]
        child = subprocess.run(command, check=False)
    finally:
        model_file.unlink(missing_ok=True)
    if child.returncode != 0:
        raise RuntimeError(f"the build process exited with {child.returncode} (its log says why)")


def _child_main(
    model_file: str,
    path: str,
    max_tokens: str,
    threads: str,
    layers: str,
    example_tokens: str,
    autotune: str,
    compute_dtype: str,
    head_gguf: str,
) -> None:
    logging.basicConfig(format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("sessionserve").setLevel(logging.INFO)
    log.info("compile: the build process runs at %s CPU priority", _idle_priority())
    torch.set_num_threads(int(threads))  # the kernels are tuned for the parent's threads
    model = torch.load(model_file, weights_only=False)
    feature_layers = None if layers == "-" else tuple(int(i) for i in layers.split(","))
    build_package(
        model,
        Path(path),
        int(max_tokens),
        feature_layers,
        example_tokens=int(example_tokens),
        autotune=autotune == "1",
        compute_dtype=None if compute_dtype == "-" else getattr(torch, compute_dtype),
        head_gguf=None if head_gguf == "-" else Path(head_gguf),
    )


def _idle_priority() -> str:
    """Put this process (and the threads it starts) under SCHED_IDLE where Linux has it: it
    then runs only on CPU time nothing else wants. `nice 19` alone is not enough beside a
    Ray replica, which Ray starts at nice 15: CFS still gives the build ~30% of a core both
    want (weights 15 vs 36), slowing the requests it is meant to speed up (the end-to-end
    tests, whose `serve run`s each start a build: one run each, 228 s at nice 19, 185 s idle)."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        return "idle (SCHED_IDLE)"
    except (AttributeError, OSError):  # not Linux, or not allowed: nice 19 from the parent
        return f"nice {os.nice(0)}"


BUILD_FILES = ("*.partial.pt2", "*.model.pt")  # what a build leaves if it is killed


def builder_tag() -> str:
    """Who writes a build file, in its name (host and process): see remove_stale_build_files."""
    return f"{_host()}-{os.getpid()}"


def _host() -> str:
    return socket.gethostname().replace(".", "_")  # a file name's dots separate its fields


def remove_stale_build_files(package: Path) -> None:
    """Remove what killed builds left beside `package` (a copy of the model, hundreds of MB,
    or a half-written package). Called under `package`'s lock, where no other build of it
    runs: any of its own are stale. Another package's are stale once the process named in
    the file's name is gone from this host; a file from another host (a cache directory
    shared between nodes) or from an older release (no host in its name) is left alone."""
    host = _host()
    for pattern in BUILD_FILES:
        for path in package.parent.glob(pattern):
            key, _, rest = path.name.partition(".")
            owner_host, _, pid = rest.split(".", 1)[0].rpartition("-")
            if key == package.stem or (owner_host == host and not _process_alive(pid)):
                path.unlink(missing_ok=True)


def _process_alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError):  # someone else's process, or not a pid
        return True
    return True


EXTRACTION_PREFIX = "aotinductor_"  # torch's package loader unpacks each load to such a dir
STALE_EXTRACTION_S = 600.0  # an extraction younger than this may still be being unpacked


def remove_stale_extractions(root: Path | None = None) -> int:
    """Remove the package extractions killed processes left in the temp directory `root`
    (default: the system's); returns the bytes freed. torch's loader unpacks the whole package
    (hundreds of MB) for every load and removes it when the loader is destroyed, which a
    killed process (a replica Ray stops, a test run cut short) never does: each replica start
    left ~0.6 GB behind, until /tmp filled. Removed: this user's `aotinductor_*` directories
    older than STALE_EXTRACTION_S in which no process maps a file (a live loader maps its
    library from there). Linux only (/proc); elsewhere nothing is removed."""
    import shutil
    import tempfile
    import time

    proc = Path("/proc")
    if not proc.is_dir():
        return 0
    root = root or Path(tempfile.gettempdir())
    now, uid = time.time(), os.getuid()
    stale = []
    for path in root.glob(EXTRACTION_PREFIX + "*"):
        try:
            info = path.stat()
        except OSError:
            continue
        if path.is_dir() and info.st_uid == uid and now - info.st_mtime > STALE_EXTRACTION_S:
            stale.append(path)
    if not stale:
        return 0
    in_use = _mapped_dirs(proc, root)
    freed = 0
    for path in stale:
        if path.name in in_use:
            continue
        freed += sum(_size(f) for f in path.rglob("*"))
        shutil.rmtree(path, ignore_errors=True)
    if freed:
        log.info(
            "compile: removed %.1f GB of package extractions killed processes left in %s",
            freed / 1e9,
            root,
        )
    return freed


def _size(path: Path) -> int:
    try:
        return path.stat().st_size if path.is_file() else 0
    except OSError:
        return 0


def _mapped_dirs(proc: Path, root: Path) -> set[str]:
    """Names of the extraction directories under `root` some process maps a file from."""
    prefix = f"{root}/{EXTRACTION_PREFIX}"
    names = set()
    for maps in proc.glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:  # gone, or another user's
            continue
        for line in text.splitlines():
            at = line.find(prefix)
            if at >= 0:
                names.add(line[at + len(str(root)) + 1 :].split("/", 1)[0])
    return names


def build_once(
    package: Path, build: Callable[[], None], announce: str, logger: logging.Logger = log
) -> None:
    """`build_lock.build_once` for a package: `build` writes `package` unless it exists, once
    among the replicas sharing a cache, after removing what killed builds left beside it."""
    build_lock.build_once(
        package, build, announce, logger, before_build=lambda: remove_stale_build_files(package)
    )


def load_or_build(
    plan: CompilePlan,
    model: Any,
    build: Callable[[Any, CompilePlan], None] = build_in_process,
) -> CompiledForward | None:
    """The compiled forward for `plan`: loaded from the cache, or built first by `build`
    while others wait on a file lock, then load its package. None, with a warning that says
    why, when building or loading fails: those steps then stay eager."""
    assert plan.package is not None
    try:
        build_once(
            plan.package,
            lambda: build(model, plan),
            f"compile: building the {plan.role} for steps of {plan.min_tokens}-"
            f"{plan.max_tokens} tokens (first start with this model, threads and CPU; cached "
            f"at {plan.package})",
        )
        started = time.monotonic()
        compiled = plan.loads_as(plan.package, plan.max_tokens, plan.min_tokens)
        log.info("compile: loaded %s in %.1f s", plan.package, time.monotonic() - started)
        return compiled
    except Exception as e:  # noqa: BLE001 - any failure leaves a working eager engine
        log.warning("compile: the %s stays eager, because compiling failed: %r", plan.role, e)
        return None


Install = Callable[[CompiledForward], None]


@dataclass(frozen=True)
class CompileJob:
    """A package to load or build (`plan`), what it compiles (`model`: the target, or the
    EAGLE head's step), and where it goes once loaded (`install`)."""

    plan: CompilePlan
    install: Install
    model: Any


# a background build's package serving its first step (benchmarks/first_start.py reads it)
INSTALLED_LOG = "compile: steps of %d-%d tokens of the %s now run compiled"


def start_compile(jobs: list[CompileJob], background: bool) -> threading.Thread | None:
    """Load or build each job's package in turn and install it (a prefill package with
    `only_if_faster` only where prefill_choice.py times it faster than eager, and for the
    step sizes where it does). Cached
    packages load at once; a build blocks unless `background` (then a daemon thread waits
    for build processes at the lowest CPU priority, `build_in_subprocess`, one at a time,
    the replica serving eagerly meanwhile, and installs each package when it is done: the
    next step runs compiled). Returns that thread, or None."""

    def load(job: CompileJob, build: Callable[[Any, CompilePlan], None]) -> None:
        plan = job.plan
        assert plan.package is not None
        if plan.only_if_faster and prefill_choice.known_slower(plan.package):
            return
        compiled = load_or_build(plan, job.model, build)
        if compiled is None:
            return
        if plan.only_if_faster:
            limit = prefill_choice.step_limit(
                job.model, plan.package, compiled.run, plan.max_tokens
            )
            if limit is None:
                return
            compiled.limit_to(limit)
        job.install(compiled)
        if build is build_in_subprocess:
            log.info(  # the installed range: installing may move its start (split_point)
                INSTALLED_LOG,
                compiled.min_tokens,
                compiled.max_tokens,
                plan.role,
            )

    later = []
    for job in jobs:
        assert job.plan.package is not None
        if background and not job.plan.package.exists():
            later.append(job)
        else:
            load(job, build_in_process)
    if not later:
        return None

    def work() -> None:
        for job in later:
            load(job, build_in_subprocess)

    thread = threading.Thread(target=work, name="compile-forward", daemon=True)
    thread.start()
    return thread


if __name__ == "__main__":  # the build process of `build_in_subprocess`
    # through the imported module, not this `__main__` copy: its logger is then
    # "sessionserve.replicas.compiled_forward", which _child_main sets to INFO (a "__main__"
    # logger stayed at WARNING and the build's progress lines never showed)
    from sessionserve.replicas import compiled_forward

    compiled_forward._child_main(*sys.argv[1:])
