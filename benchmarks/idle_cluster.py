"""What an idle Ray cluster costs the engine on this machine: the engine in this process decodes
one request at a time beside a running server that has no requests, in rounds that alternate
every Ray process on the machine running (as when serving) and paused (SIGSTOP, then SIGCONT).

On a small CPU machine the forward's OpenMP threads fill the cores and wait for each other at
every parallel region, so each wake-up of Ray's daemons and workers (their timers, health checks,
control loops) stalls the whole step, not just the thread it lands on. This script measures
that cost directly, with the same engine, prompts and answers in both arms; the running arm is
what a served request gets at best (`benchmarks/served_gap.py` compares it with serving itself).
Linux only; run the server first and send it nothing meanwhile:

    serve run benchmarks/serve-cpu-bench.yaml        # wait for it to answer, then
    .venv/bin/python -m benchmarks.idle_cluster --dtype float32 [--rounds 5]

Each pause lasts one arm (a few seconds, all of Ray at once, resumed in a `finally` and on
SIGINT/SIGTERM); that is shorter than Ray's health-check timeouts, so the server keeps serving
afterwards. Before the rounds it reports the idle cluster's processes, CPU and wake-ups a second
(voluntary context switches, summed over every thread, from /proc). The last line is JSON:
median ms per token and TTFT in each arm and `running_over_paused`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import time
from pathlib import Path

from benchmarks.common import bench_config_engine, emit, machine, setup_threads
from benchmarks.processes import paused, ray_processes
from benchmarks.served_gap import decode_one
from benchmarks.serving import user_text


def _counters(pids: list[int]) -> tuple[int, int]:
    """CPU clock ticks and voluntary context switches, summed over every thread of `pids`."""
    ticks = switches = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError, ValueError):
                    stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
                    fields = stat[stat.rindex(")") + 2 :].split()
                    ticks += int(fields[11]) + int(fields[12])
                    status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
                    switches += int(status.split("voluntary_ctxt_switches:")[1].split()[0])
    return ticks, switches


def idle_load(pids: list[int], seconds: float = 5.0) -> tuple[float, float]:
    """(cores, wake-ups a second) the processes take over `seconds` while nothing else runs."""
    t0, (ticks0, sw0) = time.perf_counter(), _counters(pids)
    time.sleep(seconds)
    elapsed, (ticks1, sw1) = time.perf_counter() - t0, _counters(pids)
    return (ticks1 - ticks0) / os.sysconf("SC_CLK_TCK") / elapsed, (sw1 - sw0) / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=2, help="requests per arm in each round")
    ap.add_argument("--words", type=int, default=200, help="prompt length in words")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--dtype", default="auto", help="match the server's (float32 for serve-cpu-bench.yaml)"
    )
    args = ap.parse_args()
    if args.tokens < 2:
        ap.error("--tokens must be at least 2 (the gap after the first token is what is timed)")
    pids = ray_processes()
    if not pids:
        raise SystemExit(
            "no Ray process on this machine: start the server first "
            "(serve run benchmarks/serve-cpu-bench.yaml) and send it nothing while this runs"
        )
    cores, wakeups = idle_load(pids)
    print(
        f"idle Ray: {len(pids)} processes, {cores:.3f} cores, {wakeups:.0f} wake-ups/s",
        flush=True,
    )
    setup_threads(args.threads)
    eng = bench_config_engine(args.threads, args.dtype)
    # a new prompt of random words per request (serving.py's single workload's), so every
    # request prefills in full, as a new conversation's first turn does
    rng = random.Random(7)
    decode_one(eng, user_text(rng, args.words), args.tokens)  # first-call costs, in neither arm
    arms: dict[str, list[tuple[float, float]]] = {"running": [], "paused": []}
    for r in range(args.rounds):
        order = ("running", "paused") if r % 2 == 0 else ("paused", "running")
        for arm in order:
            texts = [user_text(rng, args.words) for _ in range(args.requests)]
            with paused(pids) if arm == "paused" else contextlib.nullcontext():
                rows = [decode_one(eng, t, args.tokens) for t in texts]
            arms[arm] += rows
            per_token = " ".join(f"{1000 * gap:.1f}" for _, gap in rows)
            print(f"round {r} {arm:>7}: ms/token {per_token}", flush=True)
    ms = {a: 1000 * statistics.median(g for _, g in rows) for a, rows in arms.items()}
    ttft = {a: statistics.median(t for t, _ in rows) for a, rows in arms.items()}
    ratio = ms["running"] / ms["paused"]
    print(
        f"machine: {machine()}; ms/token with Ray running {ms['running']:.1f}, paused "
        f"{ms['paused']:.1f} (x{ratio:.2f}); TTFT {ttft['running']:.3f} / {ttft['paused']:.3f} s"
    )
    emit(
        {
            "benchmark": "idle_cluster",
            "ray_processes": len(pids),
            "idle_ray_cores": round(cores, 3),
            "idle_ray_wakeups_per_s": round(wakeups),
            "ms_per_token_running": round(ms["running"], 1),
            "ms_per_token_paused": round(ms["paused"], 1),
            "ttft_running_s": round(ttft["running"], 3),
            "ttft_paused_s": round(ttft["paused"], 3),
            "running_over_paused": round(ratio, 3),
        }
    )


if __name__ == "__main__":
    main()
