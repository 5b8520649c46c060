"""Router rebalancing: migrate a session off a saturated replica, or let its turn wait there.

Two replicas of a small random model (4 layers, hidden 256; one torch thread each) on loopback.
--sessions sessions take one turn each; those pinned to the first session's replica A are
split into hogs and probes. The hogs start long turns on A (--hog-prompt tokens of prompt,
--hog-tokens of answer each, all at once)
and, while they run, each probe sends one short turn, one after the other; its latency is
recorded. Replica B is idle all along. Two variants of the same app:
  off: `replica.rebalance_queue_len: null` (the default): a probe's turn waits in A's batch
  on:  `replica.rebalance_queue_len: --threshold`: the router migrates the probe's session
       (token log + KV) to B before the turn, which then runs there
    probe_p50_gain = p50(off) / p50(on)        (> 1: rebalancing pays)
plus the hogs' decode throughput in both (rebalancing must not cost A's running work).

    .venv/bin/python -m benchmarks.rebalance [--sessions 40] [--hog-prompt 2] [--hog-tokens 300]
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


def app_args(model_dir: str, threshold: int | None) -> dict:
    return {
        "engine": {
            "model": {"path": model_dir, "torch_threads": 1},
            "cache": {"page_size": 4, "num_slots": 16384, "max_rows": 128, "max_context_len": 1024},
            "sessions": {"implicit_open": True},
        },
        "replica": {
            "num_replicas": 2,
            "num_cpus": 0.5,
            "max_ongoing_requests": 64,
            "routing_stats_period_s": 0.25,
            "rebalance_queue_len": threshold,
        },
        "ingress": {"num_cpus": 0.25, "max_ongoing_requests": 1024},
    }


async def run(base: str, args) -> dict:
    async with httpx.AsyncClient(base_url=base, timeout=300) as c:

        async def turn(sid: str, prompt: list[int], max_tokens: int) -> tuple[float, dict]:
            body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
            t0 = time.perf_counter()
            r = await c.post(
                "/v1/completions", json=body | {"ignore_eos": True}, headers={"x-session-id": sid}
            )
            r.raise_for_status()
            return time.perf_counter() - t0, r.json()

        tag = time.monotonic_ns()
        sids = [f"rb-{tag}-{i}" for i in range(args.sessions)]
        opening = [turn(s, [5 + i % 200, 6, 7] * 20, 2) for i, s in enumerate(sids)]
        first = await asyncio.gather(*opening)
        home = {s: out["session"]["replica"] for s, (_, out) in zip(sids, first, strict=True)}
        on_a = [s for s in sids if home[s] == home[sids[0]]]
        hogs, probes = on_a[: args.hogs], on_a[args.hogs :][: args.probes]
        if len(probes) < args.probes:
            raise SystemExit(f"only {len(on_a)} sessions landed on one replica: raise --sessions")
        started = time.perf_counter()
        hog_prompt = [9 + i % 200 for i in range(args.hog_prompt)]
        hog_tasks = [asyncio.ensure_future(turn(s, hog_prompt, args.hog_tokens)) for s in hogs]
        await asyncio.sleep(1.0)  # A is busy and its stats say so
        latencies, moved = [], 0
        for s in probes:
            lat, out = await turn(s, [11, 12, 13], 1)
            latencies.append(lat)
            moved += out["session"]["replica"] != home[s]
        hog_out = await asyncio.gather(*hog_tasks)
        hog_s = time.perf_counter() - started
        tokens = sum(o["usage"]["completion_tokens"] for _, o in hog_out)
        return {
            "probe_p50_ms": 1000 * statistics.median(latencies),
            "probe_max_ms": 1000 * max(latencies),
            "probes": len(probes),
            "probes_moved": moved,
            "hog_tokens_per_s": tokens / hog_s,
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", type=int, default=40)
    ap.add_argument("--hogs", type=int, default=8)
    ap.add_argument("--probes", type=int, default=4)
    ap.add_argument("--hog-tokens", type=int, default=300)
    ap.add_argument("--hog-prompt", type=int, default=2, help="tokens of each hog's prompt")
    ap.add_argument("--threshold", type=int, default=4)
    ap.add_argument("--port", type=int, default=8391)
    args = ap.parse_args()
    from ray import serve

    from sessionserve.app import build_app

    results = {}
    shape = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4}
    with local_serve(args.port, **shape) as model_dir:
        for name, threshold in (("off", None), ("on", args.threshold)):
            serve.run(build_app(app_args(model_dir, threshold)), name="bench", route_prefix="/")
            results[name] = asyncio.run(run(f"http://127.0.0.1:{args.port}", args))
            serve.delete("bench")
            print(f"rebalancing {name:>3}: {results[name]}", flush=True)
    off, on = results["off"], results["on"]
    emit(
        {
            "benchmark": "rebalance",
            "threshold": args.threshold,
            "hog_prompt": args.hog_prompt,
            "hog_tokens": args.hog_tokens,
            "probe_p50_ms_off": round(off["probe_p50_ms"], 1),
            "probe_p50_ms_on": round(on["probe_p50_ms"], 1),
            "probes_moved_on": on["probes_moved"],
            "probe_p50_gain": round(off["probe_p50_ms"] / on["probe_p50_ms"], 2),
            "hog_tokens_per_s_off": round(off["hog_tokens_per_s"], 1),
            "hog_tokens_per_s_on": round(on["hog_tokens_per_s"], 1),
        }
    )


if __name__ == "__main__":
    main()
