"""Greedy tokens on a CPU: the greedy kernel (replicas/greedy_kernel.cpp) against torch's
`max(dim=-1).indices` over the logits' fp32 copy (the path before it), alone and in the
engine's decode steps, in one process, alternating (this 2-core VM drifts by 15% within
minutes).

Alone: `--rows` x `--vocabs` logits in fp32 and bf16, best ms a call of each.
In the engine: the bench configs' engine (bf16, compiled, 2 threads) for `--model` (default
gemma3-270m, a vocabulary of 262,144; `default`: SmolLM2's 49,152), `--rounds` pairs of
rounds of B greedy requests (`--tokens` each, the radix cache emptied before each) with the
kernel and without; ms a decode step is the wall time of the engine's `step()` over the steps
that decode only (forward, sampling and the step's host work), median of the rounds, and of
that the ms in `sample_on_device` (the pick itself, which the VM's drift disturbs less).
Greedy outputs are compared token for token.

    .venv/bin/python -m benchmarks.greedy_tokens [--model gemma3-270m] [--batches 1 8]

Last line: JSON with `ms_torch_<dtype>_<rows>x<vocab>`, `ms_kernel_...`, `speedup_...` for
the op alone and `step_ms_torch_<B>`, `step_ms_kernel_<B>`, `step_speedup_<B>`,
`pick_ms_torch_<B>`, `pick_ms_kernel_<B>`, `same_outputs_<B>` for the engine.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from benchmarks.common import bench_config_engine, emit, machine, setup_threads
from benchmarks.decode_package import prompts
from sessionserve.replicas import greedy_kernel, model_runner
from sessionserve.replicas.engine import Engine
from sessionserve.wire import SamplingParams


@contextlib.contextmanager
def torch_greedy() -> Iterator[None]:
    """The path before the kernel: sampling takes the logits' fp32 copy and torch's
    reduction picks the tokens."""
    takes, sample = greedy_kernel.takes, model_runner.sample_on_device
    greedy_kernel.takes = lambda logits: False
    model_runner.sample_on_device = lambda logits, *rest: sample(logits.float(), *rest)
    try:
        yield
    finally:
        greedy_kernel.takes, model_runner.sample_on_device = takes, sample


def best_ms(call: Callable[[], Any], repeats: int = 5, calls: int = 20) -> float:
    call()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - started) / calls)
    return best * 1e3


def alone(rows: list[int], vocabs: list[int]) -> dict[str, float]:
    out: dict[str, float] = {}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        for vocab in vocabs:
            for r in rows:
                logits = torch.randn(r, vocab).to(dtype)
                before = best_ms(lambda x=logits: x.float().max(dim=-1).indices)
                after = best_ms(lambda x=logits: greedy_kernel.greedy_tokens(x))
                key = f"{name}_{r}x{vocab}"
                out |= {f"ms_torch_{key}": round(before, 4), f"ms_kernel_{key}": round(after, 4)}
                out[f"speedup_{key}"] = round(before / after, 2)
                ratio = before / after
                print(f"{key}: torch {before:.3f} ms, kernel {after:.3f} ms ({ratio:.1f}x)")
    return out


def decode_round(eng: Engine, batch: int, tokens: int, round_: int) -> tuple[float, float, list]:
    """ms a decode-only step takes (its `step()`'s wall time), ms of it picking the tokens
    (`sample_on_device`), medians over the round's decode steps, and the round's outputs."""
    runner, decoding, picking = eng.runner, [False], [0.0]
    forward, step, sample = runner.forward, eng.step, model_runner.sample_on_device
    steps, picks = [], []

    def watched(fb: Any) -> Any:
        decoding[0] = fb.is_decode
        return forward(fb)

    def timed_sample(*args: Any) -> Any:
        started = time.perf_counter()
        try:
            return sample(*args)
        finally:
            picking[0] += time.perf_counter() - started

    def timed() -> Any:
        decoding[0], picking[0] = False, 0.0
        started = time.perf_counter()
        events = step()
        if decoding[0]:
            steps.append(time.perf_counter() - started)
            picks.append(picking[0])
        return events

    eng.cache.flush()  # both arms prefill the round's prompts afresh (no radix hit)
    runner.forward, eng.step = watched, timed
    model_runner.sample_on_device = timed_sample
    try:
        params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
        out = eng.generate(prompts(eng, batch, round_, 0), params)
    finally:
        del runner.forward, eng.step  # the methods show through again
        model_runner.sample_on_device = sample
    ms = statistics.median(steps) * 1e3, statistics.median(picks) * 1e3
    return *ms, [r.output_ids for r in out]


def in_engine(eng: Engine, batches: list[int], tokens: int, rounds: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for batch in batches:
        ms: dict[str, list[float]] = {"torch": [], "kernel": []}
        pick: dict[str, list[float]] = {"torch": [], "kernel": []}
        same = 0
        decode_round(eng, batch, 8, -1)  # warm-up
        for r in range(rounds):
            outputs = {}
            for side in ("kernel", "torch"):
                with torch_greedy() if side == "torch" else contextlib.nullcontext():
                    step_ms, pick_ms, outputs[side] = decode_round(eng, batch, tokens, r)
                ms[side].append(step_ms)
                pick[side].append(pick_ms)
            same += sum(a == b for a, b in zip(outputs["kernel"], outputs["torch"], strict=True))
        before, after = statistics.median(ms["torch"]), statistics.median(ms["kernel"])
        picked = {side: statistics.median(v) for side, v in pick.items()}
        print(
            f"B={batch}: a decode step {before:.2f} ms with torch's pick, {after:.2f} ms with the "
            f"kernel ({before / after:.3f}x; rounds {[round(x, 2) for x in ms['torch']]} / "
            f"{[round(x, 2) for x in ms['kernel']]}); picking {picked['torch']:.3f} / "
            f"{picked['kernel']:.3f} ms of it; same greedy outputs {same} of {batch * rounds}",
            flush=True,
        )
        out |= {
            f"step_ms_torch_{batch}": round(before, 3),
            f"step_ms_kernel_{batch}": round(after, 3),
            f"step_speedup_{batch}": round(before / after, 3),
            f"pick_ms_torch_{batch}": round(picked["torch"], 3),
            f"pick_ms_kernel_{batch}": round(picked["kernel"], 3),
            f"same_outputs_{batch}": same,
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--vocabs", type=int, nargs="+", default=[49152, 128256, 262144])
    ap.add_argument("--model", default="gemma3-270m", help="model.path (default, gemma3-270m)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    setup_threads(args.threads)
    if not greedy_kernel.load():
        raise SystemExit(f"the greedy kernel cannot be used here: {greedy_kernel.KERNEL.why_not()}")
    result: dict[str, Any] = {"benchmark": "greedy_tokens", "machine": machine()}
    result |= alone(args.rows, args.vocabs)
    if args.batches:
        result["model"] = args.model
        eng = bench_config_engine(args.threads, "bfloat16", model_path=args.model)
        result |= in_engine(eng, args.batches, args.tokens, args.rounds)
    emit(result)


if __name__ == "__main__":
    main()
