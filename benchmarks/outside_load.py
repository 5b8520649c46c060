"""What CPU time taken by other processes costs the engine's forward: the engine in this
process, rounds of N requests at once (served_gap.py's single-workload rounds), alternating
quiet rounds with rounds beside processes that each spin a share of one core in short bursts
(busy-wait BUSY ms, sleep the rest of PERIOD ms), as a server's other processes (Serve's
proxy and controller, the GCS, the client) wake up beside it.

    .venv/bin/python -m benchmarks.outside_load --model-path gemma3-270m --dtype bfloat16 \\
        --load 0.25/1 --load 0.15/1,0.15/1
    # the priorities of a served replica (a Ray worker, nice 15) and of what runs beside it
    .venv/bin/python -m benchmarks.outside_load ... --engine-nice 15 --spinner-priority 19

Why: a forward's OpenMP threads wait for each other at every parallel region's end, so a
burst that preempts one of them can hold both; on 2 cores the serving processes took
~0.15-0.25 of a core beside a served replica (docs/benchmarks.md). Run it alone on the
machine. Prints tok/s per round and arm; the last line is JSON: per load, the median quiet
and loaded tok/s and `ratio` (loaded / quiet).
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from benchmarks.common import bench_config_engine, emit, machine, setup_threads
from benchmarks.served_gap import batched

SPIN = """
import os, sys, time
busy, period = float(sys.argv[1]) / 1e3, float(sys.argv[2]) / 1e3
if sys.argv[3] == "idle":
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
elif sys.argv[3] != "normal":
    os.nice(int(sys.argv[3]))
while True:
    started = time.perf_counter()
    while time.perf_counter() - started < busy:
        pass
    time.sleep(period - busy)
"""


def parse_load(text: str) -> list[tuple[float, float]]:
    """ "0.25/1,0.15/1": one spinning process per comma, each BUSY/PERIOD in ms."""
    bursts = []
    for part in text.split(","):
        busy, _, period = part.partition("/")
        b, p = float(busy), float(period)
        if not 0 < b < p:
            raise argparse.ArgumentTypeError(f"{part!r}: BUSY/PERIOD in ms, 0 < BUSY < PERIOD")
        bursts.append((b, p))
    return bursts


def parse_priority(text: str) -> str:
    """normal, idle or a niceness increment (an int): what SPIN takes as its third argument."""
    if text not in ("normal", "idle"):
        try:
            int(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{text!r}: normal, idle or an int") from e
    return text


@contextmanager
def spinning(bursts: list[tuple[float, float]], priority: str) -> Iterator[None]:
    procs = [
        subprocess.Popen([sys.executable, "-c", SPIN, str(b), str(p), priority]) for b, p in bursts
    ]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--load",
        action="append",
        type=parse_load,
        required=True,
        help="BUSY/PERIOD ms per spinning process, commas for several; repeatable",
    )
    ap.add_argument(
        "--spinner-priority",
        default="normal",
        type=parse_priority,
        help="the spinning processes' CPU priority: normal, idle (SCHED_IDLE) or a niceness "
        "increment (e.g. 19)",
    )
    ap.add_argument(
        "--engine-nice",
        type=int,
        default=0,
        help="raise this process's niceness by this much first (a Ray worker, a served "
        "replica included, runs at nice 15)",
    )
    ap.add_argument("--model-path", default="default")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--requests", type=int, default=8, help="requests at once per round")
    ap.add_argument("--words", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--pairs", type=int, default=3, help="quiet and loaded rounds, alternating")
    args = ap.parse_args()
    os.nice(args.engine_nice)
    setup_threads(2)
    eng = bench_config_engine(2, args.dtype, model_path=args.model_path)
    seeds = itertools.count(1000)  # new prompts every round: no cached prefix

    def one_round() -> float:
        (rate,) = batched(
            eng, args.requests, args.words, args.tokens, 1, seed=next(seeds), warm_up=False
        )
        return rate

    one_round()  # warm-up
    summary: dict = {"benchmark": "outside_load", "machine": machine()}
    for bursts in args.load:
        name = ",".join(f"{b:g}/{p:g}" for b, p in bursts)
        quiet, loaded = [], []
        for _ in range(args.pairs):
            quiet.append(one_round())
            with spinning(bursts, args.spinner_priority):
                loaded.append(one_round())
            print(f"load {name}: quiet {quiet[-1]:.1f}, loaded {loaded[-1]:.1f} tok/s", flush=True)
        q, lo = statistics.median(quiet), statistics.median(loaded)
        share = sum(b / p for b, p in bursts)
        print(f"load {name} ({share:.2f} of a core): {lo / q:.2f}x the quiet rounds' tok/s")
        summary[name] = {
            "quiet_tok_s": round(q, 1),
            "loaded_tok_s": round(lo, 1),
            "ratio": round(lo / q, 3),
            "cores_taken": round(share, 3),
        }
    emit(summary)


if __name__ == "__main__":
    main()
