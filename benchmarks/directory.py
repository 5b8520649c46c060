"""What a session turn costs the directory, by history length and by shard count.

Runs the real directory actors (GCS store included) in a local Ray cluster (2 CPUs,
loopback). Three measurements:
  1. per log length: `touch` (every turn) vs `log` (the token log, which an append turn
     fetches only for a replica that lacks its session), p50 of --calls each;
  2. per history length (1K, 32K, 128K tokens): one turn's commit of 64 new tokens
     (`commit_turn(sid, base, tail)`, what the ingress sends), p50 of --calls, against the
     whole-log commit the directory took before (base 0, the whole log: O(history));
  3. turns/s sustained by 1 and by --shards shards: --clients concurrent sessions, each
     turn a `touch` and a `commit_turn`, for --seconds.
Last line: JSON with commit_ms_1k, commit_ms_128k, turns_per_s_1_shard and
turns_per_s_<N>_shards (also turns_per_s_4_shards with the default --shards 4).

    .venv/bin/python -m benchmarks.directory [--calls 200] [--clients 64] [--seconds 10]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import tempfile
import time

import ray

from benchmarks.common import emit
from sessionserve.directory.client import DirectoryClient, get_directory

NEW_TOKENS = 64
HISTORIES = {"1k": 1_000, "32k": 32_000, "128k": 128_000}


async def timed(call) -> float:
    start = time.perf_counter()
    await call
    return (time.perf_counter() - start) * 1e3


async def touch_vs_log(client: DirectoryClient, tokens: list[int], calls: int) -> dict:
    out = {}
    for n in tokens:
        sid = await client.open(None, None)
        await client.commit_turn(sid, 0, list(range(n)))
        touch, log = [], []
        for _ in range(calls):
            touch.append(await timed(client.touch(sid)))
            log.append(await timed(client.log(sid)))
        out[n] = (statistics.median(touch), statistics.median(log))
        await client.close(sid)
    return out


async def commit_cost(client: DirectoryClient, calls: int) -> dict:
    """p50 ms of a 64-token commit (delta) and of the whole-log commit, per history."""
    out = {}
    for name, n in HISTORIES.items():
        sid = await client.open(None, None)
        log = list(range(n))
        await client.commit_turn(sid, 0, log)
        delta, whole = [], []
        for i in range(calls):
            tail = [i % 1000] * NEW_TOKENS
            delta.append(await timed(client.commit_turn(sid, len(log), tail)))
            log = log + tail
            log[-1] += 1  # a different last token: not a re-sent commit
            whole.append(await timed(client.commit_turn(sid, 0, log)))
        out[name] = (statistics.median(delta), statistics.median(whole))
        await client.close(sid)
    return out


async def sustained(client: DirectoryClient, clients: int, seconds: float) -> float:
    """Turns per second: `clients` sessions, each turn a touch and a 64-token commit."""
    sids = await asyncio.gather(*(client.open(None, None) for _ in range(clients)))
    done = [0]
    stop = time.monotonic() + seconds

    async def session(sid: str) -> None:
        length = 0
        while time.monotonic() < stop:
            await client.touch(sid)
            await client.commit_turn(sid, length, [length % 997] * NEW_TOKENS)
            length += NEW_TOKENS
            done[0] += 1

    start = time.monotonic()
    await asyncio.gather(*(session(s) for s in sids))
    rate = done[0] / (time.monotonic() - start)
    await asyncio.gather(*(client.close(s) for s in sids))
    return rate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[100, 4000, 32000])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--shards", type=int, default=4)
    args = ap.parse_args()
    ray_tmp = tempfile.mkdtemp(prefix="ss-", dir="/tmp")
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=ray_tmp, logging_level="ERROR")
    try:
        one = get_directory("bench-directory-1", 600.0)
        many = get_directory("bench-directory-n", 600.0, shards=args.shards)
        reads = asyncio.run(touch_vs_log(one, args.tokens, args.calls))
        commits = asyncio.run(commit_cost(one, args.calls))
        rate_1 = asyncio.run(sustained(one, args.clients, args.seconds))
        rate_n = asyncio.run(sustained(many, args.clients, args.seconds))
    finally:
        ray.shutdown()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    print(f"{'log tokens':>10} {'touch p50 ms':>13} {'log p50 ms':>11} {'log/touch':>10}")
    for n, (touch, log) in reads.items():
        print(f"{n:>10} {touch:>13.2f} {log:>11.2f} {log / touch:>10.2f}")
    print(f"\n{'history':>8} {'commit 64 new p50 ms':>21} {'whole-log commit p50 ms':>24}")
    for name, (delta, whole) in commits.items():
        print(f"{name:>8} {delta:>21.2f} {whole:>24.2f}")
    flat = commits["128k"][0] / commits["1k"][0]
    print(
        f"128k / 1k commit: {flat:.2f} (target <= 1.5); whole-log: "
        f"{commits['128k'][1] / commits['1k'][1]:.1f}"
    )
    print(
        f"\nturns/s, {args.clients} concurrent sessions: 1 shard {rate_1:.0f}, "
        f"{args.shards} shards {rate_n:.0f} ({rate_n / rate_1:.2f}x)"
    )
    emit(
        {
            "benchmark": "directory",
            "calls": args.calls,
            **{f"touch_p50_ms_{n}": round(t, 3) for n, (t, _) in reads.items()},
            **{f"log_p50_ms_{n}": round(lg, 3) for n, (_, lg) in reads.items()},
            **{f"commit_ms_{k}": round(d, 3) for k, (d, _) in commits.items()},
            **{f"whole_log_commit_ms_{k}": round(w, 3) for k, (_, w) in commits.items()},
            "commit_128k_over_1k": round(flat, 3),
            "turns_per_s_1_shard": round(rate_1, 1),
            f"turns_per_s_{args.shards}_shards": round(rate_n, 1),
            "clients": args.clients,
        }
    )


if __name__ == "__main__":
    main()
