"""Decode steps through the decode step package (`engine.compile_decode`: the whole step in one
graph, attention inside) against the compiled forward (attention an opaque op, called back
into Python per layer), in one process, alternating.

The engine is the bench configs' (`serve-cpu-bench-bf16.yaml`: the default model, or `--model
gemma3-270m`, compiled, 1 GiB of KV, 2 torch threads), built (or loaded) with both packages
(the decode step package even where `compile_decode: auto` would not build it; the 4-bit
package, where one installs, taken out, as it would run both sides' short steps). For each
batch size, after a warm-up, `--rounds` pairs of rounds run B requests (a short prompt,
`--tokens` greedy tokens each) with the package installed and then without it
(`runner.compiled_decode` set to None: decode steps run the compiled forward); ms a step is the
runner's `forward` over the round's pure decode steps (slot tables, forward, K/V write;
sampling and scheduling are the same either way and not counted; `--context` N gives N-token
prompts). Each pair's greedy outputs are compared: both paths round to bf16 at different
points, so near-tied logits may pick different tokens, and the script reports how many requests
matched token for token and where the first differed.

With `--against inductor_attention` the other side is a second decode step package, its
attention compiled by inductor from `inplace_decode.decode_attention` (what the package ran
before the hand-written CPU kernel, `replicas/attention/cpu_decode_kernel.py`; built here if
the cache lacks it, ~5 minutes); the engine's own package must then use the kernel.

With `--against inductor_linear` the other side is a second decode step package, its linears
inductor's GEMM template (what the package ran before the few-row fp32 kernel,
`replicas/cpu_linear.py`; the cached package of before, or built here, ~5 minutes); the
engine's own package must then use the kernel.

With `--against cxx --cxx COMPILER` the other side is the engine's decode step package built
again by another C++ compiler (inductor's `cpp.cxx`; into a scratch directory with its own
inductor cache, ~5 minutes), and the prefill package is set aside, so that every decode step
of both sides runs its package (otherwise steps of the prefill package's sizes run that one:
`prefill_choice.split_point`; the prompts then prefill without it, untimed). Why: the
package's fp32 micro-GEMMs are compiled from inductor's C++ template, and gcc 12 keeps the
8x48 register block's accumulators on the stack, storing them at every step of K
(docs/benchmarks.md, "A decode step of 8 rows"). A clang build links LLVM's OpenMP runtime
beside torch's libgomp; run the script with `LD_PRELOAD=<libomp.so>` so that one runtime
serves both, or the two teams take turns on the cores.

With `--against onednn` the other side is the engine's decode step package built again
without autotuning (~1-2 minutes, into a scratch directory; the prefill package set aside as
with `cxx`): its GEMMs oneDNN's on prepacked weights with q/k/v and gate/up merged, as the
prefill package's, its attention the same. Why: at 8 or more rows a decode step reads each
weight for several rows, and the autotuned package's micro-GEMMs, chosen at 2 rows, may lose
to oneDNN's there (on an Ice Lake Xeon by 7-14% at 8-16 rows in one run, not at all in the
next: docs/benchmarks.md, "A new box (Ice Lake Xeon) beside vLLM-CPU").

With `--verify T` it times verify steps instead (B rows of T new tokens over `--context` old
tokens each, every token's logits wanted, as a chain verify of k = T - 1 drafts), built by
hand and run through the runner's `forward` with the package (its attention the CPU kernel,
which takes rows of several tokens) and without it (the forward's package; past
`compile_max_tokens` the prefill package where one is installed, else the eager forward),
alternating. `--verify 1` times decode steps of exactly B rows the same way. With
`--drafting-rows D` only D of the B rows have T tokens and the others one, as in a step where
some requests draft: the package pads the rows to T for the attention alone (the kernel
skips the padding) and runs the linears on the step's own tokens (`CompiledDecode.takes`).

    .venv/bin/python -m benchmarks.decode_package [--batches 1 8 32] [--tokens 128] [--rounds 3]
        [--context N] [--against forward | inductor_attention | inductor_linear | onednn
        | cxx --cxx clang++-14]
        [--verify T [--drafting-rows D]]

Last line: JSON with `against`, `ms_forward_<B>` (the other side), `ms_decode_<B>` (medians)
and `speedup_<B>` (the other side's ms over the engine's package's: below 1, the other side is
faster), with `--against cxx` also `cxx`; with `--verify`: `ms_verify_decode_<B>`,
`ms_verify_forward_<B>`, `speedup_verify_<B>`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import bench_config_engine, emit, machine, setup_threads
from sessionserve.replicas.assembly import compiled_max_tokens
from sessionserve.replicas.attention.base import SeqSpec
from sessionserve.replicas.attention.cpu_decode_kernel import why_not
from sessionserve.replicas.compiled_decode import (
    CompiledDecode,
    DecodeStep,
    plan_decode_compile,
    use_attention_kernel,
)
from sessionserve.replicas.compiled_forward import (
    CompilePlan,
    build_in_process,
    build_in_subprocess,
    load_or_build,
    plan_compile,
)
from sessionserve.replicas.cpu_linear import why_not as linear_why
from sessionserve.replicas.engine import Engine
from sessionserve.replicas.step import ForwardBatch
from sessionserve.wire import SamplingParams

PROMPT_WORDS = "river stone light garden window market letter winter music paper " * 3


def prompts(eng: Engine, batch: int, round_: int, context: int = 0) -> list[list[int]]:
    """`batch` distinct prompts (a new set each round: nothing reused from a cache), short or
    of `context` tokens (the words repeated)."""
    out = []
    for i in range(batch):
        ids = eng.tokenizer(f"{round_} {i} {PROMPT_WORDS}", add_special_tokens=False).input_ids
        out.append((ids * (context // len(ids) + 1))[: max(context, len(ids))])
    return out


def timed_round(
    eng: Engine, batch: int, tokens: int, round_: int, context: int = 0
) -> tuple[float, list]:
    """ms a decode step's forward takes (the runner's `forward` over the round's pure decode
    steps: the slot tables, the forward and the K/V write; not the prompts' prefill) and the
    round's greedy outputs."""
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    ids = prompts(eng, batch, round_, context)
    runner, spent, steps = eng.runner, [0.0], [0]
    forward = runner.forward

    def timed(fb: Any) -> Any:
        started = time.perf_counter()
        try:
            return forward(fb)
        finally:
            if fb.is_decode:
                spent[0] += time.perf_counter() - started
                steps[0] += 1

    runner.forward = timed
    try:
        out = eng.generate(ids, params)
    finally:
        del runner.forward  # the method shows through again
    return spent[0] * 1e3 / max(steps[0], 1), [r.output_ids for r in out]


def decode_plan(
    eng: Engine, attention_kernel: bool | None = None, linear_kernel: bool | None = None
) -> tuple[CompilePlan, DecodeStep]:
    """The engine's decode step package's plan and the step it compiles (`attention_kernel`,
    `linear_kernel`: as `plan_decode_compile` takes them)."""
    runner, cfg = eng.runner, eng.config
    forward = plan_compile(
        True,
        runner.model,
        compiled_max_tokens(cfg, runner),
        cfg.compile_cache_dir,
        runner.feature_layers,
    )
    plan, step = plan_decode_compile(
        True, forward, runner.model, runner.kv_pool, attention_kernel, linear_kernel
    )
    assert step is not None
    return plan, step


def package_without(eng: Engine, kernel: str) -> CompiledDecode:
    """The engine's decode step package once more without one of its hand-written kernels
    (`kernel`: "attention", inductor's code for `decode_attention` instead of
    `cpu_decode_kernel`; "linear", inductor's GEMM template instead of `cpu_linear`), built by
    a build process if the cache lacks it. The engine's own package must use that kernel."""
    runner = eng.runner
    if kernel == "attention":
        uses, why = use_attention_kernel(runner.model, runner.kv_pool), why_not()
    else:
        uses = runner.compiled_decode is not None and runner.compiled_decode.linear_kernel
        why = linear_why()
    if not uses:
        raise SystemExit(f"the engine's package does not use the {kernel} kernel: {why}")
    plan, step = decode_plan(eng, **{f"{kernel}_kernel": False})
    compiled = load_or_build(plan, step, build_in_subprocess)
    if compiled is None:
        raise SystemExit(f"the package without the {kernel} kernel did not build (see the log)")
    return compiled  # type: ignore[return-value] - plan.loads_as is CompiledDecode


def rebuilt_package(eng: Engine, scratch: Path, how: str, **changes: Any) -> CompiledDecode:
    """The engine's decode step package built again (`how`, for the error), into `scratch`,
    its plan with `changes` (CompilePlan fields)."""
    plan, step = decode_plan(eng)
    assert plan.package is not None
    plan = dataclasses.replace(plan, package=scratch / plan.package.name, **changes)
    compiled = load_or_build(plan, step, build_in_process)
    if compiled is None:
        raise SystemExit(f"the package {how} did not build (see the log above)")
    return compiled  # type: ignore[return-value] - plan.loads_as is CompiledDecode


def onednn_package(eng: Engine, scratch: Path) -> CompiledDecode:
    """The engine's decode step package built again without autotuning, into `scratch`: its
    GEMMs oneDNN's on weights inductor prepacks, q/k/v and gate/up merged, as the prefill
    package's (`build_package`), the attention the same."""
    return rebuilt_package(eng, scratch, "without autotuning", autotune=False)


def other_compiler_package(eng: Engine, cxx: str, scratch: Path) -> CompiledDecode:
    """The engine's decode step package built again by the C++ compiler `cxx`, into `scratch`
    (the package and inductor's own cache there: a kernel gcc built is not taken from the
    usual cache)."""
    usual_cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(scratch / "inductor")
    import torch._inductor.config as inductor_config
    from torch._inductor import cpp_builder

    def forget_the_compiler() -> None:  # inductor caches which compiler family it uses
        for cached in (cpp_builder.is_gcc, cpp_builder.is_clang, cpp_builder.is_intel_compiler):
            cached.cache_clear()

    with inductor_config.patch({"cpp.cxx": (None, cxx)}):
        forget_the_compiler()
        try:
            return rebuilt_package(eng, scratch, f"with {cxx}")
        finally:
            forget_the_compiler()
            if usual_cache is None:
                del os.environ["TORCHINDUCTOR_CACHE_DIR"]
            else:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = usual_cache


def verify_batch(
    eng: Engine, batch: int, width: int, context: int, seed: int, drafting: int | None = None
) -> ForwardBatch:
    """A step of `batch` rows of `width` new tokens each (a chain verify's k + 1: every token's
    logits and features wanted) over `context` old tokens a row, on random distinct slots of
    the engine's pool (the runner alone: nothing else uses this pool meanwhile). With
    `drafting`, only that many rows have `width` tokens and the rest one (a verify where some
    rows draft: the decode package pads them all to `width`)."""
    g = torch.Generator().manual_seed(seed)
    widths = [width] * batch if drafting is None else [width] * drafting + [1] * (batch - drafting)
    total = sum(context + w for w in widths)
    slots = torch.randperm(eng.runner.kv_pool.k.shape[1] - 1, generator=g)[:total] + 1
    seqs, ids, positions, out_slots, at = [], [], [], [], 0
    for w in widths:
        ctx = slots[at : at + context + w]
        at += context + w
        seqs.append(SeqSpec(w, ctx))
        ids.append(torch.randint(100, 20000, (w,), generator=g))
        positions.append(torch.arange(context, context + w))
        out_slots.append(ctx[context:])
    n = sum(widths)
    return ForwardBatch(
        torch.cat(ids), torch.cat(positions), torch.cat(out_slots), seqs, torch.arange(n), True
    )


def timed_verifies(
    eng: Engine,
    package: CompiledDecode,
    batch: int,
    width: int,
    context: int,
    rounds: int,
    drafting: int | None = None,
) -> dict[str, Any]:
    """ms a verify step's forward takes with the package installed (where the runner gives
    it the step: `ModelRunner._takes_decode_package`) and without it (the forward's package,
    or the prefill package past its limit, else eagerly), alternating, `rounds` pairs of 8
    steps after a warm-up. (The step's inputs are random tokens over zeroed K/V: their
    logits are no test of agreement; tests/unit/replicas/test_compiled_decode.py checks
    that.)"""
    runner = eng.runner
    fb = verify_batch(eng, batch, width, context, seed=batch * 100 + width, drafting=drafting)
    times: dict[str, list[float]] = {"decode": [], "forward": []}
    for r in range(rounds + 1):
        for name, installed in (("decode", package), ("forward", None)):
            runner.compiled_decode = installed
            started = time.perf_counter()
            for _ in range(8):
                runner.forward(fb)
            if r:  # the first pair warms up
                times[name].append((time.perf_counter() - started) * 1e3 / 8)
    runner.compiled_decode = package
    dec, fwd = statistics.median(times["decode"]), statistics.median(times["forward"])
    rows = f"{batch}" if drafting is None else f"{batch} ({drafting} of them)"
    print(
        f"verify B={rows} x {width} over {context} ({len(fb.input_ids)} tokens): with the "
        f"package {dec:.2f} ms/step "
        f"{[round(t, 2) for t in times['decode']]}, without {fwd:.2f} "
        f"{[round(t, 2) for t in times['forward']]}: {fwd / dec:.2f}x",
        flush=True,
    )
    return {
        f"ms_verify_decode_{batch}": round(dec, 2),
        f"ms_verify_forward_{batch}": round(fwd, 2),
        f"speedup_verify_{batch}": round(fwd / dec, 3),
    }


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--context", type=int, default=0, help="prompt tokens (default: a ~35-token prompt)"
    )
    parser.add_argument(
        "--against",
        choices=["forward", "inductor_attention", "inductor_linear", "cxx", "onednn"],
        default="forward",
    )
    parser.add_argument("--cxx", help="with --against cxx: the other package's C++ compiler")
    parser.add_argument(
        "--verify",
        type=int,
        default=0,
        metavar="T",
        help="time verify steps of T tokens a row (over --context tokens, default 300) instead",
    )
    parser.add_argument(
        "--drafting-rows",
        type=int,
        metavar="D",
        help="with --verify: only D of each batch's rows have T tokens, the rest one",
    )
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default="default", help="model.path (default, gemma3-270m)")
    args = parser.parse_args()
    if (args.against == "cxx") != (args.cxx is not None):
        parser.error("--against cxx and --cxx COMPILER go together")
    if args.cxx is not None and shutil.which(args.cxx) is None:
        parser.error(f"--cxx {args.cxx!r} is not on PATH")
    if args.drafting_rows is not None and not args.verify:
        parser.error("--drafting-rows goes with --verify T")
    if args.verify and args.against != "forward":
        parser.error("--verify times the decode package against the forward's: no --against")
    setup_threads(args.threads)
    print(machine(), flush=True)
    # room for batches past the configs' 32 requests (past the forward's package's range)
    eng = bench_config_engine(
        args.threads,
        args.dtype,
        max_running=max(32, *args.batches),
        model_path=args.model,
        compile_decode=True,  # built even where `auto` would not (Gemma 3: measured here)
    )
    package = eng.runner.compiled_decode
    if package is None:
        raise SystemExit("the decode step package did not install (see the log above)")
    # the 4-bit package would run the steps of up to 12 tokens on both sides
    eng.runner.compiled_int4_decode = None
    if args.verify:
        if package.query_tokens < args.verify:
            raise SystemExit(
                f"the package takes rows of at most {package.query_tokens} tokens "
                f"(the CPU kernel: {why_not() or 'loaded'})"
            )
        verify: dict[str, Any] = {"verify_tokens": args.verify}
        for batch in args.batches:
            drafting = None if args.drafting_rows is None else min(args.drafting_rows, batch)
            verify |= timed_verifies(
                eng, package, batch, args.verify, args.context or 300, args.rounds, drafting
            )
        emit(verify)
        return
    scratch = None
    if args.against in ("cxx", "onednn"):
        scratch = tempfile.TemporaryDirectory(prefix=f"decode-package-{args.against}-")  # ~650 MB
        other: CompiledDecode | None = (
            other_compiler_package(eng, args.cxx, Path(scratch.name))
            if args.against == "cxx"
            else onednn_package(eng, Path(scratch.name))
        )
        # without the prefill package no step size is routed to it (`compiled_for`), so each
        # decode step runs the decode package installed (the prompts prefill without it)
        eng.runner.compiled_prefill = None
    elif args.against in ("inductor_attention", "inductor_linear"):
        other = package_without(eng, args.against.removeprefix("inductor_"))
    else:
        other = None
    result: dict[str, Any] = {"against": args.against}
    for batch in args.batches:
        eng.runner.compiled_decode = package
        timed_round(eng, batch, 16, -1)  # warm-up: both paths' first calls
        eng.runner.compiled_decode = other
        timed_round(eng, batch, 16, -1)
        times: dict[str, list[float]] = {"decode": [], "forward": []}
        matched = total = 0
        differs: list[int] = []
        for r in range(args.rounds):
            outs = {}
            for name, installed in (("decode", package), ("forward", other)):
                eng.runner.compiled_decode = installed
                ms, outs[name] = timed_round(eng, batch, args.tokens, r, args.context)
                times[name].append(ms)
            for a, b in zip(outs["decode"], outs["forward"], strict=True):
                total += 1
                at = first_difference(a, b)
                matched += at is None
                if at is not None:
                    differs.append(at)
        dec, fwd = statistics.median(times["decode"]), statistics.median(times["forward"])
        print(
            f"B={batch}: decode package {dec:.2f} ms/step {times['decode']}, {args.against} "
            f"{fwd:.2f} {times['forward']}: {fwd / dec:.2f}x; greedy outputs equal "
            f"{matched}/{total} (first differences at tokens {sorted(differs)[:8]})",
            flush=True,
        )
        result |= {  # "forward": the other side
            f"ms_decode_{batch}": round(dec, 2),
            f"ms_forward_{batch}": round(fwd, 2),
            f"speedup_{batch}": round(fwd / dec, 3),
            f"equal_{batch}": matched / total,
        }
    eng.runner.compiled_decode = package
    if args.against == "cxx":
        result["cxx"] = args.cxx
    if scratch is not None:
        scratch.cleanup()
    emit(result)


if __name__ == "__main__":
    main()
