"""`cache.kv_dtype: bfloat16` under a float32 model against the float32 pool, in one process,
alternating: the same KV bytes, so the bf16 pool holds twice the tokens.

Two engines of the bench configs (`serve-cpu-bench.yaml`: the default model in float32,
compiled, 2 torch threads; `bench_config_engine`), one with `--kv-tokens` float32 slots, the
other with twice as many bf16 slots. Rounds alternate between them, in a rotating order:
- decode steps: `--batches` requests of `--context` prompt tokens, `--tokens` greedy tokens
  each; ms a decode step's forward (`decode_package.timed_round`: the slot tables, the
  forward, the K/V write), and how many requests' greedy tokens equal the float32 pool's
  (bf16 K/V round each token's keys and values: near-ties may pick another token);
- `--workloads` (`served_gap.py`'s conversation workloads; `pressure`: 64 conversations x 4
  turns in a random order, 4 at a time): output tokens/s, median time to first token and the
  share of prompt tokens reused, with sessions on.

    .venv/bin/python -m benchmarks.kv_dtype [--kv-tokens 12800] [--batches 1 8]
        [--context 1500] [--tokens 32] [--rounds 2] [--workloads pressure]

Last line: JSON with, per batch, `ms_fp32_<B>`, `ms_bf16_<B>`, `speedup_<B>` (float32's ms
over bf16's) and `equal_<B>`; per workload `<w>_{tok_s,ttft_s,cached}_{fp32,bf16}` (medians)
and `<w>_tok_s_ratio`, `<w>_ttft_ratio` (bf16 over float32).
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from benchmarks.common import bench_config_engine, emit, machine, rotated, setup_threads
from benchmarks.decode_package import first_difference, timed_round
from benchmarks.served_gap import CONVERSATION_WORKLOADS, compared_runs, conversations
from sessionserve.replicas.engine import Engine


def decode_rounds(
    engines: dict[str, Engine], batch: int, context: int, tokens: int, rounds: int
) -> dict[str, Any]:
    for eng in engines.values():  # warm-up: first calls of this batch's sizes
        timed_round(eng, batch, 8, -1, context)
    times: dict[str, list[float]] = {name: [] for name in engines}
    equal = total = 0
    for r in range(rounds):
        outs = {}
        for name, eng in rotated(list(engines.items()), r):
            ms, outs[name] = timed_round(eng, batch, tokens, r, context)
            times[name].append(ms)
        for a, b in zip(outs["fp32"], outs["bf16"], strict=True):
            total += 1
            equal += first_difference(a, b) is None
    fp32, bf16 = statistics.median(times["fp32"]), statistics.median(times["bf16"])
    print(
        f"B={batch} x {context} tokens: ms a decode step fp32 KV {fp32:.2f} {times['fp32']}, "
        f"bf16 KV {bf16:.2f} {times['bf16']}: {fp32 / bf16:.2f}x; greedy outputs equal "
        f"{equal}/{total}",
        flush=True,
    )
    return {
        f"ms_fp32_{batch}": round(fp32, 2),
        f"ms_bf16_{batch}": round(bf16, 2),
        f"speedup_{batch}": round(fp32 / bf16, 3),
        f"equal_{batch}": equal / total,
    }


def workload_rounds(engines: dict[str, Engine], workload: str, rounds: int) -> dict[str, Any]:
    runs: dict[str, list] = {name: [] for name in engines}
    for r in range(rounds):
        for name, eng in rotated(list(engines.items()), r):
            run = conversations(eng, *CONVERSATION_WORKLOADS[workload])
            print(
                f"{workload}, {name} KV: {run.output_tok_s:.1f} output tok/s, median TTFT "
                f"{run.ttft_median_s:.3f} s, cached {run.cached_frac:.0%}",
                flush=True,
            )
            runs[name].append(run)
    return compared_runs(workload, runs, "bf16", "fp32")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--kv-tokens",
        type=int,
        default=12800,
        help="the float32 pool's tokens (the bf16 pool gets twice as many, the same bytes); "
        "12800 holds ~16 of the pressure workload's conversations at their last turn",
    )
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 8])
    parser.add_argument("--context", type=int, default=1500)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--workloads", nargs="*", choices=sorted(CONVERSATION_WORKLOADS), default=["pressure"]
    )
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    setup_threads(args.threads)
    print(machine(), flush=True)
    engines = {
        "fp32": bench_config_engine(args.threads, "float32", args.kv_tokens),
        "bf16": bench_config_engine(
            args.threads, "float32", 2 * args.kv_tokens, kv_dtype="bfloat16"
        ),
    }
    for name, eng in engines.items():
        pool = eng.runner.kv_pool
        print(
            f"{name} KV: {pool.pool_slots} slots, {pool.nbytes() / 2**20:.0f} MiB; decode step "
            f"package {'installed' if eng.runner.compiled_decode else 'missing'}",
            flush=True,
        )
    result: dict[str, Any] = {"benchmark": "kv_dtype", "kv_tokens_fp32": args.kv_tokens}
    for batch in args.batches:
        result |= decode_rounds(engines, batch, args.context, args.tokens, args.rounds)
    for workload in args.workloads:
        result |= workload_rounds(engines, workload, args.rounds)
    emit(result)


if __name__ == "__main__":
    main()
