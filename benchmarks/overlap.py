"""Overlap scheduling (`engine.overlap_schedule`) on vs off: the same workload, same model, same
process, the two engines alternating `--rounds` times; tokens/s and the ratio on/off.

The workload is `benchmarks/throughput.py`'s (prompts of 50-500 tokens, 16-256 output tokens,
EOS ignored, at most c requests in flight, `max(2c, 4)` requests). Outputs are checked equal
between the two engines (greedy). `host_ms_per_step_off`: the plain engine's step time outside
the model forward (scheduling, batch building, sampling, bookkeeping): what overlap can hide
at best. `wait_ms_per_step_on`: how long the overlapped engine's thread waited for the forward
thread per step (its host work ran while the forward did). Each round builds its engine, runs
and closes it on a thread of its own that then exits, and the model is loaded on one too: so
the only OpenMP team alive while a round runs is the one doing its forwards (two teams on 2
cores made libgomp sleep between parallel regions in both arms, replicas/openmp.py).
`--history-drafts`: both engines speculate from each sequence's history (with the online
policy), so a step that verifies runs with nothing in flight and the rest overlap;
`overlapped_share_<c>` is the share of the overlapped engine's steps that overlapped.

    .venv/bin/python -m benchmarks.overlap [--concurrency 1 8 32] [--rounds 2] [--no-compile]
        [--history-drafts]
"""

from __future__ import annotations

import argparse
import functools
import time

from benchmarks.common import ForwardTimer, emit, load, machine, median, setup_threads
from benchmarks.throughput import workload
from sessionserve.config import (
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
    SessionConfig,
    SpecConfig,
)
from sessionserve.replicas.engine import Engine
from sessionserve.replicas.openmp import run_on_passing_thread
from sessionserve.wire import SamplingParams


def build(loaded, concurrency: int, compile: bool, overlap: bool, history: bool) -> Engine:
    cfg = EngineConfig(
        cache=CacheConfig(page_size=16, num_slots=16384, max_rows=concurrency + 8),
        sessions=SessionConfig(enabled=False),
        scheduler=SchedulerConfig(max_running_requests=concurrency, max_prefill_tokens=2048),
        compile=compile,
        overlap_schedule=overlap,
        spec=SpecConfig(history_drafts=history, adaptive=True),
    )
    return Engine(cfg, loaded)  # compile=True loads or builds before returning


def one_round(loaded, concurrency: int, compile: bool, overlap: bool, history: bool, reqs):
    """A fresh engine (built on a thread of its own: building runs parallel regions) warmed
    up on two requests, then `serve` of `reqs`; closed after. Also the share of its steps
    that overlapped (0 without overlap)."""
    eng = run_on_passing_thread(
        lambda: build(loaded, concurrency, compile, overlap, history), "build"
    )
    try:
        serve(eng, reqs[:2])  # warm-up
        before = dict(eng.overlap_totals)
        result = serve(eng, reqs)
        done = {k: v - before[k] for k, v in eng.overlap_totals.items()}
        share = done["overlapped_steps"] / max(1, sum(done.values()))
        return (*result, share)
    finally:
        eng.close()


def serve(eng: Engine, reqs) -> tuple[float, list[list[int]], float, float]:
    """Wall seconds, outputs, host ms per step outside the forward (plain engine) and ms per
    step spent waiting for the forward thread (overlapped engine)."""
    wait_s, steps = 0.0, 0
    forwards = ForwardTimer(eng)
    if eng.forwards is not None:
        land = eng._land

        def timed_land(batch, result):
            nonlocal wait_s
            t = time.perf_counter()
            result.exception()  # waits for the forward thread
            wait_s += time.perf_counter() - t
            return land(batch, result)

        eng._land = timed_land
    started = time.perf_counter()
    rids = [
        eng.submit(ids, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        for ids, n in reqs
    ]
    while eng.has_work():
        eng.step()
        steps += 1
    wall = time.perf_counter() - started
    outputs = [eng.take_result(r).output_ids for r in rids]
    forwards.restore()
    if eng.forwards is not None:
        del eng._land  # the class's again
    host_ms = (wall - forwards.seconds) / steps * 1000 if eng.forwards is None else float("nan")
    return wall, outputs, host_ms, wait_s / steps * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-compile", action="store_true", help="eager forwards on both sides")
    ap.add_argument("--history-drafts", action="store_true", help="both engines draft from history")
    args = ap.parse_args()
    setup_threads(args.threads)
    loaded = run_on_passing_thread(load, "load")
    vocab = loaded.model.config.vocab_size
    compile = not args.no_compile
    summary: dict = {
        "benchmark": "overlap",
        "machine": machine(),
        "compile": compile,
        "history_drafts": args.history_drafts,
    }
    for c in args.concurrency:
        reqs = workload(max(2 * c, 4), vocab, seed=c)
        tokens = sum(n for _, n in reqs)
        walls: dict[str, list[float]] = {"off": [], "on": []}
        outputs, host_ms, wait_ms, shares = {}, [], [], []
        for r in range(args.rounds):
            for name in ("off", "on") if r % 2 == 0 else ("on", "off"):
                round_ = functools.partial(
                    one_round, loaded, c, compile, name == "on", args.history_drafts, reqs
                )
                wall, out, host, wait, share = run_on_passing_thread(round_, name)
                if name == "on":
                    shares.append(share)
                walls[name].append(wall)
                outputs[name] = out
                (host_ms if name == "off" else wait_ms).append(host if name == "off" else wait)
        if outputs["on"] != outputs["off"]:
            raise SystemExit(f"c={c}: overlap changed the outputs")
        on, off = median(walls["on"]), median(walls["off"])
        print(
            f"c={c}: off {tokens / off:.1f} tok/s, on {tokens / on:.1f} tok/s, on/off "
            f"{off / on:.3f} (rounds: off {[round(w, 1) for w in walls['off']]} s, on "
            f"{[round(w, 1) for w in walls['on']]} s); host {median(host_ms):.2f} ms a step "
            f"off, waiting for the forward {median(wait_ms):.2f} ms a step on; "
            f"{median(shares):.0%} of its steps overlapped",
            flush=True,
        )
        summary[f"tok_s_off_{c}"] = round(tokens / off, 1)
        summary[f"tok_s_on_{c}"] = round(tokens / on, 1)
        summary[f"speedup_{c}"] = round(off / on, 3)
        summary[f"host_ms_per_step_off_{c}"] = round(median(host_ms), 2)
        summary[f"wait_ms_per_step_on_{c}"] = round(median(wait_ms), 2)
        summary[f"overlapped_share_{c}"] = round(median(shares), 3)
    emit(summary)


if __name__ == "__main__":
    main()
