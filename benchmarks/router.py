"""Router overhead and stickiness: the session router vs Ray's default router, same app.

Deploys the application twice in one Ray cluster on loopback, one variant after the other:
`request_router: session_affinity` (ours) and `power_of_two` (Ray's default, the baseline).
Each serves the same workload: --sessions concurrent sessions, --turns tiny turns each
(completions, 4-token prompts, 1 output token, a tiny random model so the engine's share is
small), with at most --in-flight requests outstanding so that the figures measure routing, not
the queueing of a saturated 2-core machine. Per request the client records the latency and
which replica answered.

    router_p50_overhead_ms = p50(session router) - p50(default router)   (same for p99)
    stickiness = fraction of turns served by the replica that served the session's first turn

    .venv/bin/python -m benchmarks.router [--sessions 100] [--turns 5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import httpx  # noqa: E402

from benchmarks.common import emit, local_serve  # noqa: E402


def app_args(model_dir: str, router: str) -> dict:
    return {
        "engine": {
            "model": {"path": model_dir, "torch_threads": 1},
            "cache": {"page_size": 4, "num_slots": 16384, "max_rows": 256, "max_context_len": 256},
            "sessions": {"implicit_open": True},
        },
        "replica": {
            "num_replicas": 2,
            "num_cpus": 0.5,
            "max_ongoing_requests": 128,
            "routing_stats_period_s": 1.0,
            "request_router": router,
        },
        "ingress": {"num_cpus": 0.25, "max_ongoing_requests": 1024},
    }


async def workload(
    base: str, sessions: int, turns: int, tag: str, in_flight: int
) -> tuple[list[float], float]:
    latencies: list[float] = []
    sticky = total = 0
    gate = asyncio.Semaphore(in_flight)
    limits = httpx.Limits(max_connections=sessions, max_keepalive_connections=sessions)
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as client:

        async def conversation(i: int) -> None:
            nonlocal sticky, total
            sid, first = f"{tag}-{i}", None
            for t in range(turns):
                body = {"prompt": [5 + (i + t) % 200, 6, 7, 8], "max_tokens": 1, "temperature": 0}
                async with gate:
                    t0 = time.perf_counter()
                    r = await client.post(
                        "/v1/completions", json=body, headers={"x-session-id": sid}
                    )
                    latencies.append(time.perf_counter() - t0)
                r.raise_for_status()
                replica = r.json()["session"]["replica"]
                first = first or replica
                sticky += replica == first
                total += 1

        await asyncio.gather(*(conversation(i) for i in range(sessions)))
    return latencies, sticky / total


def pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100)[int(q) - 1] * 1000 if len(xs) > 1 else xs[0] * 1000


def run_variant(model_dir: str, router: str, args) -> tuple[list[float], float]:
    from ray import serve

    from sessionserve.app import build_app

    serve.run(build_app(app_args(model_dir, router)), name="bench", route_prefix="/")
    base = f"http://127.0.0.1:{args.port}"
    tag = f"{router}-{time.monotonic_ns()}"
    asyncio.run(workload(base, 10, 2, f"warm-{tag}", args.in_flight))  # warm-up
    lat, stickiness = asyncio.run(workload(base, args.sessions, args.turns, tag, args.in_flight))
    serve.delete("bench")
    return lat, stickiness


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", type=int, default=100)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds per variant")
    ap.add_argument(
        "--in-flight",
        type=int,
        default=1,
        help="requests in flight at once (the sessions interleave)",
    )
    ap.add_argument("--port", type=int, default=8123)
    args = ap.parse_args()
    with local_serve(args.port) as model_dir:
        results: dict[str, tuple[list[float], list[float]]] = {
            "power_of_two": ([], []),
            "session_affinity": ([], []),
        }
        for _ in range(args.rounds):  # alternate, so drift hits both variants alike
            for router, (lat, stick) in results.items():
                more_lat, more_stick = run_variant(model_dir, router, args)
                lat += more_lat
                stick.append(more_stick)
        results = {r: (lat, statistics.mean(st)) for r, (lat, st) in results.items()}
    print(f"{'router':>18} {'requests':>8} {'p50 ms':>8} {'p99 ms':>8} {'stickiness':>10}")
    for name, (lat, stick) in results.items():
        print(f"{name:>18} {len(lat):>8} {pct(lat, 50):>8.1f} {pct(lat, 99):>8.1f} {stick:>10.3f}")
    (ours, stick), (base, base_stick) = results["session_affinity"], results["power_of_two"]
    emit(
        {
            "benchmark": "router",
            "sessions": args.sessions,
            "turns": args.turns,
            "in_flight": args.in_flight,
            "rounds": args.rounds,
            "router_p50_ms": round(pct(ours, 50), 2),
            "default_p50_ms": round(pct(base, 50), 2),
            "router_p99_ms": round(pct(ours, 99), 2),
            "default_p99_ms": round(pct(base, 99), 2),
            "router_p50_overhead_ms": round(pct(ours, 50) - pct(base, 50), 2),
            "router_p99_overhead_ms": round(pct(ours, 99) - pct(base, 99), 2),
            "stickiness": round(stick, 4),
            "default_stickiness": round(base_stick, 4),
        }
    )


if __name__ == "__main__":
    main()
