"""benchmarks/trace_stalls.py reads a GIL stall where a timeline has one: a torch call on the
forward thread that outlasts the threshold while the engine thread runs Python and the GPU has
nothing to run; the threads' own waits for work are not stalls."""

from __future__ import annotations

import gzip
import json

import pytest

from benchmarks import trace_stalls

ENGINE, FORWARD = 1, 2


def _py(tid: int, ts: float, dur: float, name: str) -> dict:
    return {"ph": "X", "cat": "python_function", "tid": tid, "ts": ts, "dur": dur, "name": name}


def _kernel(ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": "kernel", "tid": 7, "ts": ts, "dur": dur, "name": "gemm"}


def _timeline() -> list[dict]:
    """Two engine steps of 3,000 us; the GPU runs 0-1,000 and 2,500-6,000. In the first step
    the forward thread's graph launch takes 1,400 us (1,000-2,400) while the engine thread
    processes the last step; a wait for work (the executor's queue) and a short call are no
    stalls."""
    step = "/w/sessionserve/replicas/engine.py(290): step"
    process = "/w/sessionserve/replicas/scheduler.py(231): process"
    run = "/w/sessionserve/replicas/forward_thread.py(73): _run"
    return [
        _py(ENGINE, 0, 3000, step),
        _py(ENGINE, 3000, 3000, step),
        _py(ENGINE, 900, 1600, process),
        _py(FORWARD, 100, 2500, run),
        _py(FORWARD, 1000, 1400, "<built-in method replay of pybind11 object at 0x1>"),
        _py(FORWARD, 2600, 200, "<built-in method zeros of type object at 0x2>"),
        _py(FORWARD, 3000, 2000, "<built-in method get of _queue.SimpleQueue object at 0x3>"),
        _kernel(0, 1000),
        _kernel(2500, 3500),
        {"ph": "i", "name": "an instant event: no duration", "ts": 5},
    ]


def test_a_launch_waiting_for_the_gil_while_the_gpu_idles_is_read_as_a_stall(tmp_path) -> None:
    path = tmp_path / "trace_overlap_c2.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": _timeline()}, f)
    found = trace_stalls.analyse(trace_stalls.load(str(path)), stall_us=500)
    assert found["steps"] == 2 and found["step_ms"] == 3.0
    assert found["gpu_idle_ms"] == 0.75  # 1,000-2,500 over two steps
    assert found["stalls"] == 1 and found["stall_ms"] == 0.7  # the replay, not the queue's get
    assert found["idle_in_stalls_ms"] == 0.7  # the GPU idled through all of it
    assert found["stalled_calls"] == {"<built-in method replay": 1}
    assert found["engine_during_stalls"] == {"replicas/scheduler.py(231): process": 1}
    assert "0.70 of it while" in trace_stalls.summary_line("c=2", found)


def test_a_trace_without_an_overlapped_engine_says_so() -> None:
    events = [e for e in _timeline() if "forward_thread" not in e["name"]]
    with pytest.raises(ValueError, match="overlap on"):
        trace_stalls.analyse(events)


def test_idle_gaps_are_the_stretches_without_a_kernel() -> None:
    kernels = [trace_stalls.Span(10, 20, "k"), trace_stalls.Span(15, 30, "k")]
    assert trace_stalls.idle_gaps(kernels, 0, 50) == [(0, 10), (30, 50)]
    assert trace_stalls.idle_gaps([], 0, 5) == [(0, 5)]
