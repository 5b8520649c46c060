"""Would a second compiled package, built for prefill-sized steps, beat the eager forward there?

The engine's package (`engine.compile`) is exported with a 2-token example, so its GEMMs are
tuned for few rows, and steps above `compile_max_tokens` (32) run eagerly (docs/benchmarks.md:
0.64-0.95x eager from 64 tokens on). This builds packages the same way
(`compiled_forward.build_package`) but exported with a `--example-tokens` example (default 256),
one with GEMM autotuning and one without (inductor's default kernels, the elementwise chains
still fused), and times a T-token prefill (one fresh sequence from position 0, one output
token) through each and through the eager forward, alternating, `--rounds` rounds; median ms
and eager / package ratios per T. With `--history H ...`, each T is also timed as a session's
next turn over H tokens of history (prefilled first, untimed, through the same variant): what
a session sends, whose attention reads its history. Packages go to a temporary directory
(minutes to build).

    .venv/bin/python -m benchmarks.prefill_package [--tokens 64 128 256 512] [--threads 2]
    .venv/bin/python -m benchmarks.prefill_package --dtype bfloat16 --tokens 128 256 512 \
        --history 0 600 1200 --rounds 12

Last line: JSON with `speedup_<variant>_<T>` (eager / package ms, fresh prefills) and
`speedup_<variant>_<T>_over_<H>` (turns over H tokens), `eager_ms_<T>[_over_<H>]`, and
`autotuned_over_plain_<T>[_over_<H>]` (the plain package's ms over the autotuned one's).
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
from sessionserve.replicas.engine import Engine
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
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument(
        "--history",
        type=int,
        nargs="+",
        default=[0],
        help="tokens of session history before each timed turn (0: a fresh prefill)",
    )
    args = ap.parse_args()
    setup_threads(args.threads)
    loaded = load(dtype=getattr(torch, args.dtype))
    max_tokens = max(args.tokens)
    example = min(args.example_tokens, max_tokens)  # as the engine's prefill package
    variants: dict[str, compiled_forward.CompiledForward | None] = {"eager": None}
    with tempfile.TemporaryDirectory(prefix="prefill-package-") as tmp:
        for name, autotune in (("autotuned", True), ("plain", False)):
            variants[name] = build(loaded, Path(tmp), name, max_tokens, example, autotune)
        eng = engine(
            loaded,
            sessions=max(args.history) > 0,
            radix=False,
            prefill=max_tokens,
            num_slots=max(8192, 2 * (max(args.history) + max_tokens)),
        )
        g = torch.Generator().manual_seed(0)
        vocab = loaded.model.config.vocab_size

        def random_ids(n: int) -> list[int]:
            return torch.randint(100, vocab - 100, (n,), generator=g).tolist()

        summary: dict = {
            "machine": machine(),
            "example_tokens": example,
            "dtype": args.dtype,
        }
        for n in args.tokens:
            for history in args.history:
                times: dict[str, list[float]] = {name: [] for name in variants}
                for _ in range(args.rounds):
                    for name, package in variants.items():
                        eng.runner.compiled = package
                        past = random_ids(history) if history else None
                        times[name].append(turn_ms(eng, random_ids(n), past))
                ms = {name: median(t) for name, t in times.items()}
                ratios = {name: ms["eager"] / ms[name] for name in variants if name != "eager"}
                case = f"{n}_over_{history}" if history else f"{n}"
                label = f"T={n} over {history}" if history else f"T={n}"
                print(
                    f"{label}: "
                    + ", ".join(f"{name} {v:.1f} ms" for name, v in ms.items())
                    + " | eager/package "
                    + ", ".join(f"{name} {r:.2f}x" for name, r in ratios.items())
                    + f" | autotuned/plain {ms['plain'] / ms['autotuned']:.2f}x",
                    flush=True,
                )
                for name, r in ratios.items():
                    summary[f"speedup_{name}_{case}"] = round(r, 3)
                summary[f"eager_ms_{case}"] = round(ms["eager"], 1)
                summary[f"autotuned_over_plain_{case}"] = round(ms["plain"] / ms["autotuned"], 3)
        eng.runner.compiled = None
    emit(summary)


def turn_ms(eng: Engine, ids: list[int], history: list[int] | None) -> float:
    """Milliseconds to prefill `ids` and sample one token: a fresh sequence, or, given
    `history`, a session's next turn after that history was prefilled (not timed)."""
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    if history is None:
        started = time.perf_counter()
        eng.generate([ids], one)
        return (time.perf_counter() - started) * 1000
    sid = eng.open_session()
    try:
        eng.generate([history], one, session_id=sid)
        started = time.perf_counter()
        eng.generate([ids], one, session_id=sid, mode="append")
        return (time.perf_counter() - started) * 1000
    finally:
        eng.close_session(sid)


if __name__ == "__main__":
    main()
