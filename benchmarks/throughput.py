"""Decode throughput: the engine vs transformers' `generate` in static batches, same model.

A workload of requests with prompt lengths 50-500 and output lengths 16-256 (fixed seed). For
concurrency c in --concurrency, the engine serves `max(2c, 4)` requests with at most c in flight
(continuous batching: a finished request's place is taken at once); `generate` serves the same
requests in static batches of c (left padding; a batch runs until its longest member is done).
Both generate exactly the requested number of tokens (EOS ignored). tokens/s counts requested
output tokens only. `engine_overhead_frac` is the share of the engine's step time spent outside
the model forward (scheduling, batch building, sampling, bookkeeping) over decode-only steps.

The engine runs with `engine.compile: true` (its package built on the first run, then loaded
from the cache) unless `--no-compile`; the same engine with its packages taken out (the
compiled forward's, the decode step's, the prefill package) gives the eager figures.
`compile_speedup_B`: eager / compiled milliseconds per decode step with B requests decoding
(300-token prompts), both measured in this process, alternating.

    .venv/bin/python -m benchmarks.throughput [--concurrency 1 8 32] [--threads 2] [--no-compile]
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

import torch

from benchmarks.common import (
    ForwardTimer,
    alternate_decode_steps,
    emit,
    engine,
    load,
    machine,
    setup_threads,
)
from sessionserve.wire import SamplingParams


def workload(n: int, vocab: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(100, vocab) for _ in range(rng.randint(50, 500))], rng.randint(16, 256))
        for _ in range(n)
    ]


def build_engine(loaded, concurrency: int, compile: bool):
    return engine(
        loaded,
        sessions=False,
        radix=False,
        max_running=concurrency,
        num_slots=16384,
        prefill=2048,
        compile=compile,
    )


def decode_step_ms(eng, batch: int, rounds: int = 3, steps: int = 8) -> tuple[float, float]:
    """Median ms per decode step of `batch` requests: eager (every package taken out: the
    compiled forward's, the decode step's and the prefill package; with the decode step
    package left in, decode steps still ran it), then compiled, alternating `rounds` times."""
    runner = eng.runner
    packages = (runner.compiled, runner.compiled_decode, runner.compiled_prefill)
    rids = [
        eng.submit(
            list(range(100 + b, 400 + b)),
            SamplingParams(max_tokens=4096, temperature=0, ignore_eos=True),
        )
        for b in range(batch)
    ]

    def install(installed: tuple[Any, Any, Any]) -> None:
        runner.compiled, runner.compiled_decode, runner.compiled_prefill = installed

    variants = {
        "eager": lambda: install((None, None, None)),
        "compiled": lambda: install(packages),
    }
    ms = alternate_decode_steps(eng, variants, rounds, steps)
    install(packages)
    for rid in rids:
        eng.abort(rid)
    eng.run_until_idle()
    return ms["eager"], ms["compiled"]


def run_engine(eng, reqs) -> tuple[float, float]:
    step_s = 0.0
    forwards = ForwardTimer(eng)
    t0 = time.perf_counter()
    for ids, n_out in reqs:
        eng.submit(ids, SamplingParams(max_tokens=n_out, temperature=0, ignore_eos=True))
    decode_forward, decode_step = 0.0, 0.0
    while eng.has_work():
        before_f, t = forwards.seconds, time.perf_counter()
        is_decode_only = not eng.scheduler.waiting and all(r.sampled for r in eng.scheduler.running)
        eng.step()
        dt = time.perf_counter() - t
        step_s += dt
        if is_decode_only and eng.scheduler.running:
            decode_forward += forwards.seconds - before_f
            decode_step += dt
    wall = time.perf_counter() - t0
    overhead = 1 - decode_forward / decode_step if decode_step else float("nan")
    return wall, overhead


def run_generate(model, reqs, batch: int) -> float:
    t0 = time.perf_counter()
    for i in range(0, len(reqs), batch):
        group = reqs[i : i + batch]
        width = max(len(ids) for ids, _ in group)
        ids = torch.zeros(len(group), width, dtype=torch.int64)
        mask = torch.zeros_like(ids)
        for row, (p, _) in enumerate(group):
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=mask,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=None,
                max_new_tokens=max(n for _, n in group),
                min_new_tokens=max(n for _, n in group),
            )
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-compile", action="store_true", help="the eager engine only")
    args = ap.parse_args()
    setup_threads(args.threads)
    ref = load()  # generate runs on a model with transformers' own (sdpa) attention
    ours = load()
    vocab = ref.model.config.vocab_size
    compile = not args.no_compile
    t = time.perf_counter()
    run_engine(build_engine(ours, 2, compile), workload(2, vocab, seed=99))  # warm-up
    summary = {"benchmark": "throughput", "machine": machine(), "compile": compile}
    print(f"engine ready (compiled forward built or loaded) in {time.perf_counter() - t:.0f} s")
    if compile:
        for b in (1, 8):
            eager_ms, compiled_ms = decode_step_ms(build_engine(ours, b, True), b)
            print(f"decode step, batch {b}: eager {eager_ms:.1f} ms, compiled {compiled_ms:.1f} ms")
            summary[f"decode_ms_eager_{b}"] = round(eager_ms, 2)
            summary[f"decode_ms_compiled_{b}"] = round(compiled_ms, 2)
            summary[f"compile_speedup_{b}"] = round(eager_ms / compiled_ms, 2)
    print(
        f"{'c':>3} {'requests':>8} {'tokens':>7} {'engine tok/s':>13} {'generate tok/s':>15} "
        f"{'ratio':>6} {'overhead':>9}"
    )
    for c in args.concurrency:
        reqs = workload(max(2 * c, 4), vocab, seed=c)
        tokens = sum(n for _, n in reqs)
        wall_e, overhead = run_engine(build_engine(ours, c, compile), reqs)
        wall_g = run_generate(ref.model, reqs, c)
        ratio = wall_g / wall_e
        print(
            f"{c:>3} {len(reqs):>8} {tokens:>7} {tokens / wall_e:>13.1f} "
            f"{tokens / wall_g:>15.1f} {ratio:>6.2f} {overhead:>9.2f}",
            flush=True,
        )
        summary[f"engine_tok_s_{c}"] = round(tokens / wall_e, 1)
        summary[f"generate_tok_s_{c}"] = round(tokens / wall_g, 1)
        summary[f"ratio_vs_generate_{c}"] = round(ratio, 2)
        summary[f"engine_overhead_frac_{c}"] = round(overhead, 3)
    emit(summary)


if __name__ == "__main__":
    main()
