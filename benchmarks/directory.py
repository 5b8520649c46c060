"""What a session turn pays the directory actor: `touch` (every turn) vs `log` (the token log,
which an append turn fetches only for a replica that lacks its session), by log length.

Runs the real directory actor in a local Ray cluster (2 CPUs, loopback); per log length, --calls
alternating `touch` / `log` calls, p50 of each. Last line: JSON with log/touch ratios.

    .venv/bin/python -m benchmarks.directory [--tokens 100 4000 32000] [--calls 200]
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
from sessionserve.router.directory import get_directory


async def timed(call) -> float:
    start = time.perf_counter()
    await call
    return (time.perf_counter() - start) * 1e3


async def measure(tokens: list[int], calls: int) -> dict[int, tuple[float, float]]:
    client = get_directory("bench-directory", 600.0)
    out = {}
    for n in tokens:
        sid = await client.open.remote(None, None)
        await client.commit_turn.remote(sid, list(range(n)))
        touch, log = [], []
        for _ in range(calls):
            touch.append(await timed(client.touch.remote(sid)))
            log.append(await timed(client.log.remote(sid)))
        out[n] = (statistics.median(touch), statistics.median(log))
        await client.close.remote(sid)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[100, 4000, 32000])
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    ray_tmp = tempfile.mkdtemp(prefix="ss-", dir="/tmp")
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=ray_tmp, logging_level="ERROR")
    try:
        results = asyncio.run(measure(args.tokens, args.calls))
    finally:
        ray.shutdown()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    print(f"{'log tokens':>10} {'touch p50 ms':>13} {'log p50 ms':>11} {'log/touch':>10}")
    for n, (touch, log) in results.items():
        print(f"{n:>10} {touch:>13.2f} {log:>11.2f} {log / touch:>10.2f}")
    emit(
        {
            "benchmark": "directory",
            "calls": args.calls,
            **{f"touch_p50_ms_{n}": round(t, 3) for n, (t, _) in results.items()},
            **{f"log_p50_ms_{n}": round(lg, 3) for n, (_, lg) in results.items()},
            **{f"log_over_touch_{n}": round(lg / t, 2) for n, (t, lg) in results.items()},
        }
    )


if __name__ == "__main__":
    main()
