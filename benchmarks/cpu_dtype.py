"""bf16 against fp32 weights and KV on this CPU (what `model.dtype: auto` chooses between): the
default model (or `--model gemma3-270m`) in both dtypes, each in its own engine (the compiled
forward and the packages `compile: auto` builds beside it, unless `--eager`; 2 torch threads),
rounds alternating between them: prefill throughput (8 prompts of ~300 tokens, one output token
each) and decode step time at batch 1 and 8 (~200-token prompts). A CPU without native bf16 dot
products (AVX512-BF16, AMX) emulates them: expect bf16 to lose there, which is why `auto` keeps
fp32 on such CPUs.

    .venv/bin/python -m benchmarks.cpu_dtype [--rounds 3] [--eager] [--model gemma3-270m]

The last line is JSON: per measure the bf16 / fp32 speed ratio (above 1 = bf16 faster).
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from benchmarks.common import emit, engine, finish_prefills, machine, median, setup_threads
from sessionserve.config import cpu_has_native_bf16
from sessionserve.replicas.engine import Engine
from sessionserve.replicas.loader import load_model
from sessionserve.replicas.openmp import run_on_passing_thread
from sessionserve.wire import SamplingParams

WORDS = "river stone light garden window market letter winter music paper bridge forest".split()
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def prompt(rng: random.Random, tokenizer, words: int) -> list[int]:
    return tokenizer.encode(" ".join(rng.choice(WORDS) for _ in range(words)))


def prefill_tok_s(eng: Engine, rng: random.Random) -> float:
    prompts = [prompt(rng, eng.tokenizer, 300) for _ in range(8)]
    started = time.perf_counter()
    for p in prompts:
        eng.submit(p, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    while eng.has_work():
        eng.step()
    return sum(map(len, prompts)) / (time.perf_counter() - started)


def decode_ms(eng: Engine, rng: random.Random, batch: int, steps: int) -> float:
    params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
    for i in range(batch):
        eng.submit([i + 3] + prompt(rng, eng.tokenizer, 200), params)
    finish_prefills(eng)
    eng.step()
    started = time.perf_counter()
    for _ in range(steps):
        eng.step()
    ms = (time.perf_counter() - started) * 1e3 / steps
    while eng.has_work():
        eng.step()
    return ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=24, help="decode steps timed per round")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eager", action="store_true", help="without the compiled forward")
    ap.add_argument("--model", default="default", help="model.path (default, gemma3-270m)")
    args = ap.parse_args()
    setup_threads(args.threads)
    native = cpu_has_native_bf16()
    print(f"machine: {machine()}; native bf16: {native}; compiled: {not args.eager}")

    def build(dtype: torch.dtype) -> Engine:
        loaded = load_model(args.model, dtype)
        return engine(loaded, sessions=False, radix=False, max_running=8, compile=not args.eager)

    # built on threads that exit, stepped on one that does not: one OpenMP team (openmp.py)
    engines = {
        name: run_on_passing_thread(lambda d=d: build(d), name) for name, d in DTYPES.items()
    }
    results: dict[str, dict[str, list[float]]] = {name: {} for name in engines}

    def measure() -> None:
        rng = random.Random(0)
        for eng in engines.values():  # warm up: first steps of each shape
            prefill_tok_s(eng, rng)
            decode_ms(eng, rng, 8, 4)
        for r in range(args.rounds):
            for name, eng in engines.items():
                got = results[name]
                got.setdefault("prefill_tok_s", []).append(prefill_tok_s(eng, rng))
                for batch in (1, 8):
                    ms = decode_ms(eng, rng, batch, args.steps)
                    got.setdefault(f"decode_ms_{batch}", []).append(ms)
                print(
                    f"round {r + 1} {name}: "
                    + ", ".join(f"{k} {v[-1]:.1f}" for k, v in got.items())
                )

    run_on_passing_thread(measure, "measure")
    summary: dict = {"benchmark": "cpu_dtype", "machine": machine(), "native_bf16": native}
    summary["compiled"] = not args.eager
    summary["model"] = args.model
    for key in results["fp32"]:
        fp32, bf16 = median(results["fp32"][key]), median(results["bf16"][key])
        ratio = bf16 / fp32 if key.startswith("prefill") else fp32 / bf16  # speed ratio
        summary[f"{key}_fp32"], summary[f"{key}_bf16"] = round(fp32, 1), round(bf16, 1)
        summary["speedup_" + key.replace("_tok_s", "").replace("_ms", "")] = round(ratio, 2)
        print(f"{key}: fp32 {fp32:.1f}, bf16 {bf16:.1f}: bf16 {ratio:.2f}x as fast")
    emit(summary)


if __name__ == "__main__":
    main()
