"""Picking and drawing a step's tokens on a CPU, against the path before a stop
(`--baseline`), in one process, alternating (this 2-core VM drifts by 15% within minutes).
Now: greedy picks from the sampling kernel (replicas/sampling_kernel.cpp) over the logits in
their dtype; rows with a temperature and min-p only drawn from their logits by the kernel
(`temperature_draw`, stop 111); top-k / top-p rows filtered among their 1,024 largest logits
(`sampling.draw_rows`), the inverse-CDF draw summed by the kernel (stop 110). Before stop 111
(`--baseline 111`, the default): temperature-only rows filtered by torch over an fp32 copy.
Before stop 110 (`--baseline 110`): the logits' fp32 copy, torch's `max(dim=-1).indices`, a
sort of the whole vocabulary for top-k / top-p, and the draw's [rows, V] float64 cumsum.

Greedy picks alone: `--rows` x `--vocabs` logits in fp32 and bf16, best ms a call.
Draws alone: `sample_on_device` on the model's own logits (an eager forward over a prompt;
`--rows` of its last positions) for each of `FILTERS`, best ms a call, and whether 20 seeds
draw the same tokens both ways (a draw may differ at float32 rounding edges).
In the engine: the bench configs' engine (bf16, compiled, 2 threads) for `--model` (default
gemma3-270m, a vocabulary of 262,144; `default`: SmolLM2's 49,152), `--rounds` pairs of
rounds of B requests (`--tokens` each, for each of `--modes`: greedy, seeded temperature 0.7
top-p 0.9, seeded temperature 1 (the OpenAI default); the radix cache emptied before each);
ms a decode step is the wall time of the engine's `step()` over the steps that decode only,
median of the rounds, and of that the ms in `sample_on_device` (which the VM's drift
disturbs less). Outputs are compared token for token.

    .venv/bin/python -m benchmarks.sampling [--model gemma3-270m] [--batches 1 8] [--baseline 110]

Last line: JSON with `ms_torch_<dtype>_<rows>x<vocab>`, `ms_kernel_...`, `speedup_...` for
greedy picks alone; `draw_ms_before_<filter>_<rows>`, `draw_ms_now_...`, `draw_speedup_...`,
`draw_same_...` for draws alone; `<mode>_step_ms_before_<B>`, `<mode>_step_ms_now_<B>`,
`<mode>_step_speedup_<B>`, `<mode>_pick_ms_before_<B>`, `<mode>_pick_ms_now_<B>`,
`<mode>_same_outputs_<B>` (mode: greedy, sampled, temperature) for the engine; `baseline`.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch

from benchmarks.common import bench_config_engine, best_ms, emit, load, machine, setup_threads
from benchmarks.decode_package import PROMPT_WORDS, prompts
from sessionserve.replicas import model_runner, sampling, sampling_kernel
from sessionserve.replicas.engine import Engine
from sessionserve.wire import SamplingParams

FILTERS = {
    "t0.7": SamplingParams(temperature=0.7),
    "t0.7_p0.9": SamplingParams(temperature=0.7, top_p=0.9),
    "t1.0_p0.95": SamplingParams(temperature=1.0, top_p=0.95),
    "t0.7_k40": SamplingParams(temperature=0.7, top_k=40),
    "t0.8_k50_p0.9": SamplingParams(temperature=0.8, top_k=50, top_p=0.9),
    "t0.7_minp0.05": SamplingParams(temperature=0.7, min_p=0.05),
}
# the engine's requests: greedy, a usual nucleus, and the OpenAI default (temperature 1)
MODES = {
    "greedy": SamplingParams(temperature=0),
    "sampled": SamplingParams(temperature=0.7, top_p=0.9),
    "temperature": SamplingParams(temperature=1.0),
}


@contextlib.contextmanager
def before(baseline: str) -> Iterator[None]:
    """The path before a stop. "110": the logits' fp32 copy, torch's reduction for greedy
    picks, the whole vocabulary sorted for top-k / top-p, torch's float64 cumsum for the
    draw. "111": stop 110's path: the kernel's greedy picks and draw, top-k / top-p among the
    candidates, but rows with a temperature and min-p only filtered by torch (`filter_logits`,
    softmax) over an fp32 copy of the logits."""
    sample = model_runner.sample_on_device

    def sampled(params: list[SamplingParams]) -> bool:
        return any(not p.is_greedy for p in params)

    with contextlib.ExitStack() as stack:
        patch = stack.enter_context
        patch(mock.patch.object(sampling, "_drawn_by_temperature", lambda *args: set()))
        if baseline == "110":
            patch(mock.patch.object(sampling_kernel, "takes_logits", lambda x: False))
            patch(mock.patch.object(sampling_kernel, "takes_draw", lambda x: False))
            patch(mock.patch.object(sampling, "_candidates_kept", lambda *args: {}))
            copied = lambda logits, params, *rest: sample(logits.float(), params, *rest)  # noqa: E731
        else:
            copied = lambda logits, params, *rest: sample(  # noqa: E731
                logits.float() if sampled(params) else logits, params, *rest
            )
        patch(mock.patch.object(model_runner, "sample_on_device", copied))
        yield


def greedy_alone(rows: list[int], vocabs: list[int]) -> dict[str, float]:
    out: dict[str, float] = {}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        for vocab in vocabs:
            for r in rows:
                logits = torch.randn(r, vocab).to(dtype)
                then = best_ms(lambda x=logits: x.float().max(dim=-1).indices)
                now = best_ms(lambda x=logits: sampling_kernel.greedy_tokens(x))
                key = f"{name}_{r}x{vocab}"
                out |= {f"ms_torch_{key}": round(then, 4), f"ms_kernel_{key}": round(now, 4)}
                out[f"speedup_{key}"] = round(then / now, 2)
                print(f"greedy {key}: torch {then:.3f} ms, kernel {now:.3f} ms ({then / now:.1f}x)")
    return out


@torch.inference_mode()
def model_logits(model_path: str, rows: int) -> torch.Tensor:
    """The model's own logits (bf16, as served) at the last `rows` positions of a prompt,
    from transformers' forward of a copy loaded for it."""
    loaded = load(model_path, torch.bfloat16)
    text = f"Write a short story about a winter evening in a river town. {PROMPT_WORDS}"
    ids = torch.tensor([loaded.tokenizer(text).input_ids])
    return loaded.model(ids).logits[0, -rows:].contiguous()


def draws_alone(model_path: str, rows: list[int], baseline: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    logits = model_logits(model_path, max(rows))
    for n in rows:
        x = logits[:n]
        for name, p in FILTERS.items():
            params = [p.model_copy(update={"seed": 1})] * n

            def run(seed: int, x: torch.Tensor = x, params: list = params) -> list[int]:
                rows = x.shape[0]
                gens = [torch.Generator().manual_seed(100 * seed + i) for i in range(rows)]
                out = model_runner.sample_on_device(x, params, [()] * rows, [()] * rows, gens)
                return out.to_host().token_ids

            with before(baseline):
                then = best_ms(lambda: run(0), calls=3)
                old = [run(s) for s in range(20)]
            now = best_ms(lambda: run(0), calls=3)
            same = sum(a == b for a, b in zip(old, [run(s) for s in range(20)], strict=True))
            key = f"{name}_{n}"
            out |= {f"draw_ms_before_{key}": round(then, 3), f"draw_ms_now_{key}": round(now, 3)}
            out |= {f"draw_speedup_{key}": round(then / now, 2), f"draw_same_{key}": same}
            print(
                f"draw {name}, {n} rows: before {then:.2f} ms, now {now:.2f} ms "
                f"({then / now:.1f}x); same tokens for {same} of 20 seeds",
                flush=True,
            )
    return out


def decode_round(
    eng: Engine, batch: int, params: SamplingParams, round_: int
) -> tuple[float, float, list]:
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
        out = eng.generate(prompts(eng, batch, round_, 0), params)
    finally:
        del runner.forward, eng.step  # the methods show through again
        model_runner.sample_on_device = sample
    ms = statistics.median(steps) * 1e3, statistics.median(picks) * 1e3
    return *ms, [r.output_ids for r in out]


def in_engine(
    eng: Engine, batches: list[int], tokens: int, rounds: int, modes: list[str], baseline: str
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in modes:
        base = MODES[mode].model_copy(update={"max_tokens": tokens, "ignore_eos": True})
        for batch in batches:
            ms: dict[str, list[float]] = {"before": [], "now": []}
            pick: dict[str, list[float]] = {"before": [], "now": []}
            same = 0
            decode_round(eng, batch, base.model_copy(update={"max_tokens": 8}), -1)  # warm-up
            for r in range(rounds):
                params = base if base.is_greedy else base.model_copy(update={"seed": r})
                outputs = {}
                for side in ("now", "before"):
                    with before(baseline) if side == "before" else contextlib.nullcontext():
                        step_ms, pick_ms, outputs[side] = decode_round(eng, batch, params, r)
                    ms[side].append(step_ms)
                    pick[side].append(pick_ms)
                pairs = zip(outputs["now"], outputs["before"], strict=True)
                same += sum(a == b for a, b in pairs)
            then, now = statistics.median(ms["before"]), statistics.median(ms["now"])
            picked = {side: statistics.median(v) for side, v in pick.items()}
            print(
                f"{mode} B={batch}: a decode step {then:.2f} ms before, {now:.2f} ms now "
                f"({then / now:.3f}x; rounds {[round(x, 2) for x in ms['before']]} / "
                f"{[round(x, 2) for x in ms['now']]}); picking {picked['before']:.3f} / "
                f"{picked['now']:.3f} ms of it; same outputs {same} of {batch * rounds}",
                flush=True,
            )
            out |= {
                f"{mode}_step_ms_before_{batch}": round(then, 3),
                f"{mode}_step_ms_now_{batch}": round(now, 3),
                f"{mode}_step_speedup_{batch}": round(then / now, 3),
                f"{mode}_pick_ms_before_{batch}": round(picked["before"], 3),
                f"{mode}_pick_ms_now_{batch}": round(picked["now"], 3),
                f"{mode}_same_outputs_{batch}": same,
            }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--vocabs", type=int, nargs="+", default=[49152, 128256, 262144])
    ap.add_argument("--model", default="gemma3-270m", help="model.path (default, gemma3-270m)")
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 8], help="none: skip the engine")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    ap.add_argument(
        "--baseline",
        choices=["110", "111"],
        default="111",
        help="'before' is the path before this stop (`before`)",
    )
    args = ap.parse_args()
    setup_threads(args.threads)
    if not sampling_kernel.load():
        why = sampling_kernel.KERNEL.why_not()
        raise SystemExit(f"the sampling kernel cannot be used here: {why}")
    result: dict[str, Any] = {"benchmark": "sampling", "machine": machine(), "model": args.model}
    result["baseline"] = args.baseline
    result |= greedy_alone(args.rows, args.vocabs)
    result |= draws_alone(args.model, [r for r in args.rows if r <= 8] or [1], args.baseline)
    if args.batches:
        eng = bench_config_engine(args.threads, "bfloat16", model_path=args.model)
        result |= in_engine(eng, args.batches, args.tokens, args.rounds, args.modes, args.baseline)
    emit(result)


if __name__ == "__main__":
    main()
