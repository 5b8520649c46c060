"""Where an overlapped step's GPU waits, read from a `benchmarks/gpu.py --trace-steps` timeline.

Under overlap scheduling two Python threads share the GIL: the engine thread lands step N and
schedules N+2 while the forward thread prepares and launches N+1. A torch call releases the
GIL while it runs; if the engine thread takes it then, the forward thread gets it back only
when the engine thread blocks or at Python's switch interval (5 ms), and the graph it was about
to launch waits. On the H200 (2026-12-04, runs N and P) such waits were half the traced steps'
forward-thread time, with no kernel on the GPU meanwhile. This reads a timeline for them:

- GPU idle: the gaps between kernels inside the traced steps, per step;
- stalls: calls into torch on the forward thread that took longer than `--stall-us` (the
  thread's own waits for work excluded), per step, how much GPU idle time lies inside them,
  and what the engine thread ran meanwhile (its innermost sessionserve function at each
  stall's start).

    python -m benchmarks.trace_stalls trace_overlap_c64.json.gz [--stall-us 500]

Last line: JSON (`steps`, `step_ms`, `gpu_idle_ms`, `stalls`, `stall_ms`, `idle_in_stalls_ms`,
`engine_during_stalls`). The profiler stretches Python, so read the figures as shares.
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import Counter
from dataclasses import dataclass
from typing import Any

from benchmarks.common import emit

ENGINE_STEP = "sessionserve/replicas/engine.py"  # + "): step": the engine thread's step
FORWARD_RUN = "sessionserve/replicas/forward_thread.py"  # + "): _run": the forward thread's
# a thread waiting for work or for another thread: not a stall
WAITS = ("acquire of _thread.lock", "get of _queue.SimpleQueue", "wait of", "synchronize")


@dataclass(frozen=True, order=True)
class Span:
    start: float  # us
    end: float
    name: str

    @property
    def dur(self) -> float:
        return self.end - self.start


def load(path: str) -> list[dict[str, Any]]:
    """The complete ('X') events of a chrome trace, gzipped or not."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def _spans(events: list[dict[str, Any]], **match: Any) -> list[Span]:
    return sorted(
        Span(e["ts"], e["ts"] + e["dur"], e["name"])
        for e in events
        if all(e.get(k) == v for k, v in match.items())
    )


def _thread_of(events: list[dict[str, Any]], marker: str, function: str) -> Any:
    """The thread id of the Python events naming `marker`'s `function`."""
    for e in events:
        name = e["name"]
        if e.get("cat") == "python_function" and marker in name and name.endswith(function):
            return e["tid"]
    raise ValueError(f"no {marker} {function} in the trace: was it taken with overlap on?")


def idle_gaps(kernels: list[Span], start: float, end: float) -> list[tuple[float, float]]:
    """The stretches of [start, end] in which no kernel runs."""
    gaps, at = [], start
    for k in kernels:
        if k.end <= at:
            continue
        if k.start > at:
            gaps.append((at, min(k.start, end)))
        at = max(at, k.end)
        if at >= end:
            break
    if at < end:
        gaps.append((at, end))
    return [(a, b) for a, b in gaps if b > a]


def _overlap(gaps: list[tuple[float, float]], start: float, end: float) -> float:
    return sum(max(0.0, min(b, end) - max(a, start)) for a, b in gaps)


def _innermost(spans: list[Span], at: float) -> str:
    """The deepest sessionserve function running at `at` (the shortest span around it)."""
    around = [s for s in spans if s.start <= at < s.end and "sessionserve/" in s.name]
    if not around:
        return "(not in sessionserve)"
    name = min(around, key=lambda s: s.dur).name
    return name.split("sessionserve/", 1)[1]


def analyse(events: list[dict[str, Any]], stall_us: float = 500.0) -> dict[str, Any]:
    engine = _thread_of(events, ENGINE_STEP, "): step")
    forward = _thread_of(events, FORWARD_RUN, "): _run")
    steps = [
        s
        for s in _spans(events, tid=engine)
        if ENGINE_STEP in s.name and s.name.endswith("): step")
    ]
    if not steps:
        raise ValueError("no engine steps in the trace")
    start, end = steps[0].start, steps[-1].end
    kernels = _spans(events, cat="kernel")
    gaps = idle_gaps(kernels, start, end)
    engine_py = _spans(events, tid=engine, cat="python_function")
    stalls = [
        s
        for s in _spans(events, tid=forward, cat="python_function")
        if s.name.startswith("<built-in")
        and s.dur > stall_us
        and start <= s.start < end
        and not any(w in s.name for w in WAITS)
    ]
    during = Counter(_innermost(engine_py, s.start) for s in stalls)
    n = len(steps)
    return {
        "steps": n,
        "step_ms": round((end - start) / n / 1000, 3),
        "gpu_idle_ms": round(sum(b - a for a, b in gaps) / n / 1000, 3),
        "stalls": len(stalls),
        "stall_ms": round(sum(s.dur for s in stalls) / n / 1000, 3),
        "idle_in_stalls_ms": round(
            sum(_overlap(gaps, s.start, s.end) for s in stalls) / n / 1000, 3
        ),
        "stalled_calls": dict(Counter(s.name.split(" of ")[0] for s in stalls).most_common(6)),
        "engine_during_stalls": dict(during.most_common(6)),
    }


def summary_line(name: str, result: dict[str, Any]) -> str:
    return (
        f"{name}: {result['steps']} steps of {result['step_ms']:.2f} ms (profiled); GPU idle "
        f"{result['gpu_idle_ms']:.2f} ms a step, {result['idle_in_stalls_ms']:.2f} of it while "
        f"the forward thread waited {result['stall_ms']:.2f} ms a step in {result['stalls']} "
        f"torch calls; the engine thread meanwhile: {result['engine_during_stalls']}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace", help="a trace_*.json(.gz) from benchmarks/gpu.py --trace-steps")
    ap.add_argument("--stall-us", type=float, default=500.0, help="a call this long stalls")
    args = ap.parse_args()
    result = analyse(load(args.trace), args.stall_us)
    print(summary_line(args.trace, result))
    emit({"benchmark": "trace_stalls", "trace": args.trace, **result})


if __name__ == "__main__":
    main()
