"""Whether the prefill package (`engine.compile_prefill: auto`) pays on this machine, and up
to which step size: prefills of a few sizes timed through it and through the eager forward,
once, the verdict kept beside the package; and from which step size it takes over from the
forward's package (`split_point`), timed likewise.

Why time it rather than decide from the CPU's name: the same package (inductor's code with
oneDNN GEMMs on weights it prepacks) was 1.22-1.55x faster than the eager forward on an AMD
EPYC with AVX-512, and on an AVX2 CPU whose eager GEMMs (MKL) are faster at a few hundred
rows 1.24x at 64 tokens, 1.07x at 128 and 0.91x at 256 (docs/benchmarks.md): which GEMM
library wins depends on the CPU and the rows, and a step of a chat turn (tens to a hundred
and some tokens) is where the package's fused elementwise chains matter most. The timing
runs one fresh sequence of each size over a scratch KV pool of its own (a background build
installs while the engine serves: its pool is not ours to write), the two forwards
alternating, and `<package>.timing.json` keeps the verdict: later starts read it and do not
even load a package that lost at every size (it would hold a second copy of the weights for
nothing). Before any of that, for a bf16 model, what the package's layers compute in
(`compute_dtype`): a layer's GEMMs timed in bf16 and in fp32, the verdict kept likewise.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from sessionserve.cache import KVPool, KVShape
from sessionserve.replicas.attention import sliding_windows
from sessionserve.replicas.attention.base import ForwardMeta, SeqSpec
from sessionserve.replicas.attention.torch_backend import TorchPagedBackend
from sessionserve.replicas.hidden_states import decoder_features
from sessionserve.replicas.logits_head import head_logits

log = logging.getLogger(__name__)
TIMED_TOKENS = (64, 128, 192, 256)  # prefill sizes timed (those within the package's range)
ROUNDS = 3  # alternating pairs after one warm-up each; the best of each compared (a
# background build installs while requests may run: interference only ever adds time)
MARGIN = 1.05  # the package must be this much faster: a tie does not pay a second weight copy

# a loaded package's forward: (ids [T], positions [T], logit rows [N], meta) -> (logits, features)
RunPackage = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, ForwardMeta], tuple[torch.Tensor, torch.Tensor]
]


class CompiledPackage(Protocol):
    """What the split timing needs of a loaded package (compiled_forward.CompiledForward)."""

    package: Path
    run: RunPackage


@dataclass(frozen=True)
class PrefillTiming:
    """Prefills of each of `tokens` (ascending) through the eager forward and the package."""

    tokens: list[int]
    eager_ms: list[float]
    package_ms: list[float]

    def speedups(self) -> list[float]:
        return [e / p for e, p in zip(self.eager_ms, self.package_ms, strict=True)]

    def largest_paying(self) -> int | None:
        """The largest size timed up to which the package was MARGIN faster at every size
        timed (None: not even at the smallest)."""
        largest = None
        for tokens, speedup in zip(self.tokens, self.speedups(), strict=True):
            if speedup < MARGIN:
                break
            largest = tokens
        return largest

    @property
    def pays(self) -> bool:
        return self.largest_paying() is not None

    def step_limit(self, max_tokens: int) -> int | None:
        """The longest step the package (exported for `max_tokens`) should take: all of them
        where it paid at every size timed, else the largest size up to which it did (steps
        between that and the next size timed stay eager); None where it never paid."""
        largest = self.largest_paying()
        return max_tokens if largest == self.tokens[-1] else largest


def timing_file(package: Path) -> Path:
    return package.with_suffix(".timing.json")


def recorded(package: Path) -> PrefillTiming | None:
    """The verdict an earlier start wrote for `package` (None: none, unreadable, or one
    timed at a single size by an older version: timed again)."""
    try:
        timing = PrefillTiming(**json.loads(timing_file(package).read_text()))
    except (OSError, ValueError, TypeError):
        return None
    columns = (timing.tokens, timing.eager_ms, timing.package_ms)
    if not all(isinstance(c, list) and c and len(c) == len(timing.tokens) for c in columns):
        return None
    return timing


def known_slower(package: Path) -> bool:
    """Whether an earlier start timed `package` and found it not worth loading."""
    timing = recorded(package)
    if timing is not None and not timing.pays:
        log.info(_verdict(timing, "recorded", None))
        return True
    return False


def step_limit(model: Any, package: Path, run_package: RunPackage, max_tokens: int) -> int | None:
    """The longest step `package` (loaded as `run_package`, exported for steps of up to
    `max_tokens`) should take instead of `model`'s eager forward (None: none): from the
    recorded verdict, else timed now and recorded."""
    timing = recorded(package)
    how = "recorded"
    if timing is None:
        how = "timed"
        timing = measure(model, run_package, sizes_to_time(max_tokens))
        try:
            timing_file(package).write_text(json.dumps(asdict(timing)))
        except OSError as e:  # a read-only cache: time again next start
            log.warning("compile: could not record the prefill timing: %r", e)
    limit = timing.step_limit(max_tokens)
    log.info(_verdict(timing, how, limit))
    return limit


def sizes_to_time(max_tokens: int) -> list[int]:
    """TIMED_TOKENS within a package exported for steps of up to `max_tokens` (that alone
    where it is shorter than them all)."""
    return [t for t in TIMED_TOKENS if t <= max_tokens] or [max_tokens]


def _verdict(timing: PrefillTiming, how: str, limit: int | None) -> str:
    if limit is None:
        choice = "prefill steps stay eager"
    elif timing.largest_paying() == timing.tokens[-1]:
        choice = "prefill steps run compiled"
    else:
        choice = f"steps of up to {limit} tokens run compiled, longer ones eagerly"
    sizes = ", ".join(
        f"{t} tokens {p:.0f} ms vs {e:.0f} ms eager ({e / p:.2f}x)"
        for t, e, p in zip(timing.tokens, timing.eager_ms, timing.package_ms, strict=True)
    )
    return (
        f"compile: the prefill package ({how} on this machine): {sizes}; needs {MARGIN:.2f}x: "
        f"{choice}"
    )


@torch.inference_mode()
def measure(model: Any, run_package: RunPackage, sizes: list[int]) -> PrefillTiming:
    """The best ms of a prefill of each of `sizes` tokens (one fresh sequence, its last row's
    logits) through the eager forward and through the package, alternating `ROUNDS` times."""
    decoder, head = model.get_decoder(), model.get_output_embeddings()

    def eager(ids: torch.Tensor, positions: torch.Tensor, last: torch.Tensor, meta: ForwardMeta):
        hidden, _ = decoder_features(decoder, ids, positions, None, paged_meta=meta)
        head_logits(head, hidden[last])

    ms = best_ms_by_size(model, sizes, {"eager": eager, "package": run_package})
    return PrefillTiming(list(sizes), ms["eager"], ms["package"])


def best_ms_by_size(
    model: Any, sizes: list[int], forwards: dict[str, Callable[..., Any]]
) -> dict[str, list[float]]:
    """`_best_ms` at each of `sizes`: each forward's list of best ms, in the order of `sizes`."""
    ms: dict[str, list[float]] = {name: [] for name in forwards}
    for tokens in sizes:
        for name, best in _best_ms(model, tokens, forwards).items():
            ms[name].append(best)
    return ms


def _best_ms(model: Any, tokens: int, forwards: dict[str, Callable[..., Any]]) -> dict[str, float]:
    """The best ms of each forward over one fresh `tokens`-token sequence (its last row's
    logits), over a scratch KV pool of its own, alternating `ROUNDS` times after a warm-up."""
    param = next(model.parameters())
    pool = KVPool(KVShape.from_hf_config(model.config), tokens + 1, param.dtype, param.device)
    backend = TorchPagedBackend(tokens, sliding_windows(model.config))
    slots = torch.arange(1, tokens + 1, device=param.device)  # slot 0: reserved, as in ours
    meta = ForwardMeta(
        backend, pool, slots, backend.prepare([SeqSpec(tokens, slots.cpu())], param.device)
    )
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (tokens,), generator=g).to(param.device)
    positions = torch.arange(tokens, device=param.device)
    last = positions[-1:]
    times: dict[str, list[float]] = {name: [] for name in forwards}
    for _ in range(ROUNDS):
        for name, forward in forwards.items():
            if len(times[name]) == 0:
                forward(ids, positions, last, meta)  # warm-up: first calls allocate and load
            started = time.perf_counter()
            forward(ids, positions, last, meta)
            times[name].append(1000 * (time.perf_counter() - started))
    return {name: round(min(t), 2) for name, t in times.items()}


# ---- where the prefill package takes over from the forward's ----
SPLIT_TOKENS = (4, 5, 6, 8, 12, 16, 24, 32, 48, 64)  # step sizes timed (up to the forward's max)


@dataclass(frozen=True)
class SplitTiming:
    """Steps of `tokens` through the forward's package and through the prefill package."""

    forward_package: str  # the forward's package file this was timed against
    tokens: list[int]
    forward_ms: list[float]
    package_ms: list[float]

    def min_tokens(self, forward_max: int) -> int:
        """The smallest step the prefill package takes: the first timed size from which it
        was faster at every size timed; past the forward's largest step if it never was."""
        start = forward_max + 1
        pairs = zip(self.tokens, self.forward_ms, self.package_ms, strict=True)
        for tokens, forward_ms, package_ms in reversed(list(pairs)):
            if package_ms >= forward_ms:
                break
            start = tokens
        return start


def split_file(package: Path) -> Path:
    return package.with_suffix(".split.json")


def split_point(
    model: Any,
    forward: CompiledPackage,
    prefill: CompiledPackage,
    forward_max: int,
) -> int:
    """The smallest step (tokens) the prefill package `prefill` should run instead of the
    forward's package `forward` on this machine: recorded beside the prefill package, else
    timed now (both packages over the same fresh sequences, alternating) and recorded.

    Why time it: which package wins at a few to a few dozen rows depends on the CPU. On an
    AMD EPYC with AVX-512 in bf16 the prefill package (oneDNN GEMMs) was 1.19x faster from 5
    rows on; on an Intel Xeon with AMX the forward's (autotuned AMX micro-GEMMs) was faster
    at every size up to 32, by 6-22% (benchmarks/package_split.py, docs/benchmarks.md)."""
    timing = recorded_split(prefill.package, forward.package)
    how = "recorded"
    if timing is None:
        how = "timed"
        sizes = [t for t in SPLIT_TOKENS if t <= forward_max]
        ms = best_ms_by_size(model, sizes, {"forward": forward.run, "package": prefill.run})
        timing = SplitTiming(forward.package.name, sizes, ms["forward"], ms["package"])
        try:
            split_file(prefill.package).write_text(json.dumps(asdict(timing)))
        except OSError as e:  # a read-only cache: time again next start
            log.warning("compile: could not record the package split timing: %r", e)
    start = timing.min_tokens(forward_max)
    where = (
        f"steps of {start}+ tokens run the prefill package"
        if start <= forward_max
        else f"the forward's package keeps every step of up to {forward_max} tokens"
    )
    ratios = ", ".join(
        f"{t}: {f / p:.2f}x"
        for t, f, p in zip(timing.tokens, timing.forward_ms, timing.package_ms, strict=True)
    )
    log.info(
        "compile: the prefill package's speed over the forward's (%s): %s; %s", how, ratios, where
    )
    return start


def recorded_split(prefill_package: Path, forward_package: Path) -> SplitTiming | None:
    """The split an earlier start timed between these two packages (None: none, another
    forward's package, or unreadable)."""
    try:
        timing = SplitTiming(**json.loads(split_file(prefill_package).read_text()))
    except (OSError, ValueError, TypeError):
        return None
    return timing if timing.forward_package == forward_package.name else None


# ---- what the prefill package's layers compute in ----
GEMM_ROUNDS = 5  # alternating rounds of a layer's GEMMs in each dtype, after a warm-up each
GEMM_MARGIN = 1.15  # fp32 must be this much faster: its package holds the layers at 4 bytes


@dataclass(frozen=True)
class GemmTiming:
    """One decoder layer's GEMMs at `rows` rows, best ms in the model's dtype and in fp32, on
    the CPU `cpu` (the verdict is timed again on another)."""

    cpu: str
    dtype: str
    rows: int
    model_ms: float
    float32_ms: float

    @property
    def float32_pays(self) -> bool:
        return self.model_ms >= GEMM_MARGIN * self.float32_ms


def compute_dtype(
    mode: str, model: Any, rows: int, record: Path, timed_models: bool
) -> torch.dtype | None:
    """`engine.compile_prefill_dtype` resolved for `model`: the dtype the prefill package's
    layers compute in where it is not the model's (None: the model's). float32: fp32 for a
    bf16 or fp16 model. auto (for models `timed_models` says are worth timing, on CPU): fp32
    where a layer's GEMMs of `rows` rows ran GEMM_MARGIN faster in fp32 than in the model's
    dtype on this machine, timed once and kept in `record`.

    Why time it: prefill is bound by the GEMMs' arithmetic, and a CPU's bf16 arithmetic is
    not always its fastest. With AVX512-BF16 but no AMX, an Intel Xeon's bf16 dot products
    run on one port where its fp32 FMAs run on two: its bf16 GEMMs reached 113-149 GFLOP/s
    on 2 threads there, fp32 185-252, and Gemma 3's first token of a 210-token prompt came in
    272 ms through a package computing in fp32 against 375 in bf16 (docs/benchmarks.md). An
    AMD EPYC Zen 4 ran bf16 1.5-1.7x faster than fp32; AMX tiles faster still."""
    param = next(model.parameters())
    if mode == "model" or param.dtype not in (torch.bfloat16, torch.float16):
        return None
    if mode == "float32":
        return torch.float32
    if not timed_models or param.device.type != "cpu":
        return None
    timing = _recorded_gemms(record)
    how = "recorded"
    if timing is None or timing.cpu != _cpu() or timing.rows != rows:
        how = "timed"
        timing = time_gemms(model, rows)
        try:
            record.parent.mkdir(parents=True, exist_ok=True)
            record.write_text(json.dumps(asdict(timing)))
        except OSError as e:  # a read-only cache: time again next start
            log.warning("compile: could not record the GEMM timing: %r", e)
    choice = "float32 (its layers' weights at 4 bytes)" if timing.float32_pays else timing.dtype
    log.info(
        "compile: a layer's GEMMs of %d rows (%s on this machine): %.1f ms in %s, %.1f ms in "
        "float32 (%.2fx; needs %.2fx): the prefill package computes in %s",
        rows,
        how,
        timing.model_ms,
        timing.dtype,
        timing.float32_ms,
        timing.model_ms / timing.float32_ms,
        GEMM_MARGIN,
        choice,
    )
    return torch.float32 if timing.float32_pays else None


def _recorded_gemms(record: Path) -> GemmTiming | None:
    try:
        return GemmTiming(**json.loads(record.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def _cpu() -> str:
    """This CPU as /proc/cpuinfo names it (vendor, family, model, model name), with torch's
    view of its vector unit; where there is no /proc, torch's view alone."""
    fields = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("vendor_id", "cpu family", "model", "model name") and key not in fields:
                fields[key] = value.strip()
    parts = [fields[k] for k in ("vendor_id", "cpu family", "model", "model name") if k in fields]
    return " / ".join([*parts, torch.backends.cpu.get_cpu_capability()])


@torch.inference_mode()
def time_gemms(model: Any, rows: int) -> GemmTiming:
    """The best ms of one decoder layer's GEMMs (each distinct linear shape of the decoder
    once) on `rows` random rows, in the model's dtype and in fp32, alternating."""
    dtype = next(model.parameters()).dtype
    shapes = sorted(
        {
            (m.in_features, m.out_features)
            for m in model.get_decoder().modules()
            if isinstance(m, torch.nn.Linear)
        }
    )
    g = torch.Generator().manual_seed(0)
    operands = {
        d: [
            (torch.randn(rows, i, generator=g).to(d), torch.randn(o, i, generator=g).to(d) / i)
            for i, o in shapes
        ]
        for d in (dtype, torch.float32)
    }
    times: dict[torch.dtype, list[float]] = {d: [] for d in operands}
    for _ in range(GEMM_ROUNDS + 1):  # the first round warms up (oneDNN builds its kernels)
        for d, pairs in operands.items():
            started = time.perf_counter()
            for x, w in pairs:
                torch.nn.functional.linear(x, w)
            times[d].append(1000 * (time.perf_counter() - started))
    best = {d: round(min(t[1:]), 3) for d, t in times.items()}
    return GemmTiming(
        _cpu(), str(dtype).removeprefix("torch."), rows, best[dtype], best[torch.float32]
    )
