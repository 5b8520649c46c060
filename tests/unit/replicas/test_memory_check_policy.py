"""`engine.memory_check`: the step loop itself checks the invariant, per policy, whether or not
metrics are exported (an in-process engine exports none)."""

from __future__ import annotations

import pytest

from sessionserve.cache.checker import MemoryInvariantError
from sessionserve.wire import SamplingParams
from tests.models import tiny_engine

P = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def engine_with(policy: str, period_s: float = 10.0, metrics=None):
    return tiny_engine(memory_check=policy, memory_check_period_s=period_s, metrics=metrics)


def steps(engine, n: int) -> None:
    engine.submit([5, 6, 7], P)
    for _ in range(n):
        engine.step()


@pytest.mark.parametrize(("policy", "checks"), [("every_step", 5), ("periodic", 1), ("off", 0)])
def test_the_step_checks_per_policy(policy, checks) -> None:
    engine = engine_with(policy)
    steps(engine, 5)
    assert engine.checker.checks == checks


def test_periodic_checks_again_once_the_period_passed(monkeypatch) -> None:
    import time

    clock = [time.monotonic()]
    monkeypatch.setattr("time.monotonic", lambda: clock[0])
    engine = engine_with("periodic", period_s=2.0)
    steps(engine, 3)
    assert engine.checker.checks == 1
    clock[0] += 2.5
    engine.step()
    engine.step()
    assert engine.checker.checks == 2


@pytest.mark.parametrize("policy", ["every_step", "periodic"])
def test_a_broken_invariant_is_caught_by_the_step(policy) -> None:
    engine = engine_with(policy)
    engine.cache.allocator.alloc_extend(None, 0, 16)  # a page nobody accounts for
    with pytest.raises(MemoryInvariantError, match="accounted"):
        steps(engine, 1)


def test_off_never_checks_from_the_step() -> None:
    engine = engine_with("off")
    engine.cache.allocator.alloc_extend(None, 0, 16)
    steps(engine, 3)  # no check, no raise
    assert engine.checker.checks == 0
    with pytest.raises(MemoryInvariantError):
        engine.check_memory()  # an explicit check still sees it


class RecordingMetrics:
    """An exporter that keeps what it was given (the base EngineMetrics records nothing)."""

    def __init__(self) -> None:
        self.gauges: dict[str, int] = {}
        self.totals: dict[str, int] = {}
        self.live = -1

    def gauges_due(self) -> bool:
        return True

    def on_step(self, terms, gauges, counter_totals) -> None:
        self.live, self.gauges, self.totals = terms.live_requests, gauges, counter_totals

    def __getattr__(self, name: str):  # on_finish, on_abort, ...: not recorded here
        return lambda *a, **k: None


def test_gauges_report_what_the_engine_holds_and_check_the_invariant() -> None:
    """Gauges are read off the engine's parts each step (a served replica exports them), and
    reporting checks the invariant even with `memory_check: off`."""
    metrics = RecordingMetrics()  # as a served replica gives its exporter
    engine = engine_with("off", metrics=metrics)
    sid = engine.open_session()
    engine.submit([5, 6, 7], P, session_id=sid)
    engine.submit([8, 9], P)
    engine.step()
    assert metrics.gauges["open_sessions"] == 1
    assert metrics.gauges["running_requests"] == metrics.live == 2
    assert metrics.totals["memory_checks"] == engine.checker.checks >= 1
    engine.run_until_idle()
    engine.report_gauges()
    assert metrics.gauges["running_requests"] == 0 and metrics.gauges["queued_requests"] == 0
