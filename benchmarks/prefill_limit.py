"""Conversation turns with the prefill package as `compile_prefill: auto` installs it (for the
step sizes where `prefill_choice.step_limit` timed it faster than eager) against none, in one
process, alternating.

One engine of the bench configs (`serve-cpu-bench.yaml`: the default model in float32,
compiled, 2 torch threads, 1 GiB of KV; `bench_config_engine`). Building it times the prefill
package at `prefill_choice.TIMED_TOKENS` once (or reads the verdict an earlier start kept) and
logs it. Rounds of `served_gap.py`'s conversation workloads (`multiturn`: 4 conversations x
10 turns of ~150 new tokens; `pressure`: 64 conversations x 4 turns in a random order, 4 at
a time) then alternate, in a rotating order, between the engine with its prefill package
installed and the same engine with none (`runner.compiled_prefill` None: those steps run
eagerly): output tokens/s, median time to first token, and how many steps ran the package.

    .venv/bin/python -m benchmarks.prefill_limit [--workloads multiturn pressure] [--rounds 2]

Last line: JSON with the package's installed range (`min_tokens`, `max_tokens`) and, per
workload, `<w>_{tok_s,ttft_s,cached}_{package,eager}` (medians) and `<w>_tok_s_ratio`,
`<w>_ttft_ratio` (with the package over without).
"""

from __future__ import annotations

import argparse
from typing import Any

from benchmarks.common import bench_config_engine, emit, machine, rotated, setup_threads
from benchmarks.served_gap import CONVERSATION_WORKLOADS, compared_runs, conversations
from sessionserve.replicas.engine import Engine


def workload_rounds(eng: Engine, workload: str, rounds: int) -> dict[str, Any]:
    runner = eng.runner
    package = runner.compiled_prefill
    runs: dict[str, list] = {"package": [], "eager": []}
    for r in range(rounds):
        for name in rotated(list(runs), r):
            runner.compiled_prefill = package if name == "package" else None
            got = conversations(eng, *CONVERSATION_WORKLOADS[workload])
            calls, ms, share = got.packages.get("prefill", (0, 0.0, 0.0))
            print(
                f"{workload}, {name}: {got.output_tok_s:.1f} output tok/s, median TTFT "
                f"{got.ttft_median_s:.3f} s; {calls} steps through the prefill package "
                f"({ms:.0f} ms a step, {share:.0%} of the time)",
                flush=True,
            )
            runs[name].append(got)
    runner.compiled_prefill = package
    return compared_runs(workload, runs, "package", "eager")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--workloads", nargs="+", default=["multiturn", "pressure"], choices=CONVERSATION_WORKLOADS
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    setup_threads(args.threads)
    print(machine(), flush=True)
    eng = bench_config_engine(args.threads, "float32")
    package = eng.runner.compiled_prefill
    if package is None:
        raise SystemExit("the prefill package was not installed here (see the log above)")
    print(f"the prefill package takes steps of {package.min_tokens}-{package.max_tokens} tokens")
    result: dict[str, Any] = {
        "min_tokens": package.min_tokens,
        "max_tokens": package.max_tokens,
        "limited": package.limited,
    }
    for workload in args.workloads:
        result |= workload_rounds(eng, workload, args.rounds)
    emit(result)


if __name__ == "__main__":
    main()
