"""Would a second compiled package, built for prefill-sized steps, beat the eager forward there?

The engine's package (`engine.compile`) is exported with a 2-token example, so its GEMMs are
tuned for few rows, and steps above `compile_max_tokens` (32) run eagerly (docs/benchmarks.md:
0.64-0.95x eager from 64 tokens on). This builds packages the same way
(`compiled_forward.build_package`) but exported with a `--example-tokens` example (default 256),
one with GEMM autotuning and one without (inductor's default kernels, the elementwise chains
still fused), and times a T-token prefill (one fresh sequence from position 0, one output
token) through each and through the eager forward, alternating, `--rounds` rounds; median ms
and eager / package ratios per T. Packages go to a temporary directory (minutes to build).

    .venv/bin/python -m benchmarks.prefill_package [--tokens 64 128 256 512] [--threads 2]
"""

from __future__ import annotations

import argparse
import copy
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import emit, engine, load, machine, median, setup_threads
from sessionserve.replicas import compiled_forward
from sessionserve.wire import SamplingParams


def build(loaded, directory: Path, name: str, max_tokens: int, example: int, autotune: bool):
    path = directory / f"{name}.pt2"
    started = time.monotonic()
    compiled_forward.build_package(
        copy.deepcopy(loaded.model), path, max_tokens, example_tokens=example, autotune=autotune
    )
    print(f"{name}: built in {time.monotonic() - started:.0f} s", flush=True)
    return compiled_forward.CompiledForward(path, max_tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 128, 256, 512])
    ap.add_argument("--example-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    setup_threads(args.threads)
    loaded = load()
    max_tokens = max(args.tokens)
    variants: dict[str, compiled_forward.CompiledForward | None] = {"eager": None}
    with tempfile.TemporaryDirectory(prefix="prefill-package-") as tmp:
        for name, autotune in (("autotuned", True), ("plain", False)):
            variants[name] = build(
                loaded, Path(tmp), name, max_tokens, args.example_tokens, autotune
            )
        eng = engine(loaded, sessions=False, radix=False, prefill=max_tokens)
        one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        g = torch.Generator().manual_seed(0)
        vocab = loaded.model.config.vocab_size
        summary: dict = {"machine": machine(), "example_tokens": args.example_tokens}
        for n in args.tokens:
            times: dict[str, list[float]] = {name: [] for name in variants}
            for _ in range(args.rounds):
                for name, package in variants.items():
                    eng.runner.compiled = package
                    ids = torch.randint(100, vocab - 100, (n,), generator=g).tolist()
                    started = time.perf_counter()
                    eng.generate([ids], one)
                    times[name].append((time.perf_counter() - started) * 1000)
            ms = {name: median(t) for name, t in times.items()}
            ratios = {name: ms["eager"] / ms[name] for name in variants if name != "eager"}
            print(
                f"T={n}: "
                + ", ".join(f"{name} {v:.1f} ms" for name, v in ms.items())
                + " | eager/package "
                + ", ".join(f"{name} {r:.2f}x" for name, r in ratios.items()),
                flush=True,
            )
            for name, r in ratios.items():
                summary[f"speedup_{name}_{n}"] = round(r, 3)
            summary[f"eager_ms_{n}"] = round(ms["eager"], 1)
        eng.runner.compiled = None
    emit(summary)


if __name__ == "__main__":
    main()
