"""A real Prometheus scrapes the running app through Ray's metrics agent (one target for the
node); after a short multi-turn workload the PromQL figures match what the workload implies."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import free_port, replica_memory
from tests.e2e.prometheus import Prometheus, ensure_prometheus

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def prom(served):
    binary = ensure_prometheus()
    if binary is None:
        pytest.skip("Debian's prometheus package cannot be installed on this machine")
    p = Prometheus(binary, f"127.0.0.1:{served['metrics_port']}", free_port())
    p.wait_ready()
    yield p
    p.stop()


def total(prom: Prometheus, metric: str) -> float:
    return prom.value(f"sum({metric})") or 0.0


def test_workload_figures_arrive_in_prometheus(served, prom) -> None:
    prom.wait_for("sum(ray_sessionserve_kv_total_tokens)", lambda v: v > 0)
    before = {
        m: total(prom, m)
        for m in (
            "ray_sessionserve_generated_tokens_total",
            'ray_sessionserve_cached_tokens_total{source="session"}',
            "ray_sessionserve_requests_total",
            "ray_sessionserve_queue_seconds_count",
        )
    }
    generated = cached = 0
    with httpx.Client(base_url=served["base"], timeout=60) as c:
        for s in range(3):
            sid = c.post("/v1/sessions", json={}).json()["id"]
            for turn in range(3):
                body = {"prompt": [60 + s, 61 + turn], "max_tokens": 4, "ignore_eos": True}
                r = c.post("/v1/completions", json=body, headers={"x-session-id": sid}).json()
                generated += r["usage"]["completion_tokens"]
                cached += r["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert generated == 36 and cached > 0
    prom.wait_for(
        "sum(ray_sessionserve_requests_total)",
        lambda v: v >= before["ray_sessionserve_requests_total"] + 9,
    )
    assert (
        total(prom, "ray_sessionserve_generated_tokens_total")
        - before["ray_sessionserve_generated_tokens_total"]
        == generated
    )
    assert (
        total(prom, 'ray_sessionserve_cached_tokens_total{source="session"}')
        - before['ray_sessionserve_cached_tokens_total{source="session"}']
        == cached
    )
    # the held-tokens gauge is the memory checker's own term: equal to what replicas report
    held = sum(t["held"] for t in replica_memory().values())
    prom.wait_for("sum(ray_sessionserve_session_held_tokens)", lambda v: v == held)
    kv_total = sum(t["total"] for t in replica_memory().values())
    assert total(prom, "ray_sessionserve_kv_total_tokens") == kv_total
    usage = prom.value(
        "1 - sum(ray_sessionserve_kv_free_tokens) / sum(ray_sessionserve_kv_total_tokens)"
    )
    assert 0 < usage < 1
    # every answered request's queue time, recorded with its finish
    assert (
        total(prom, "ray_sessionserve_queue_seconds_count")
        - before["ray_sessionserve_queue_seconds_count"]
        == 9
    )
    # cumulative buckets: a rate over a burst shorter than two scrapes can be empty (NaN)
    p50 = prom.value("histogram_quantile(0.5, sum by (le) (ray_sessionserve_ttft_seconds_bucket))")
    assert p50 is not None and 0 < p50 < 10
    # no speculative decoding configured: nothing drafted or accepted
    assert prom.value("sum(ray_sessionserve_spec_accepted_tokens_total) or vector(0)") == 0
    labels = prom.query("ray_sessionserve_session_held_tokens")[0]["metric"]
    assert {"replica", "model"} <= set(labels) and not any("session" in k for k in labels)


def test_every_dashboard_query_returns_data(served, prom) -> None:
    """Self-sufficient (no traffic from another test): a rate needs a counter to grow between
    two scrapes, so turns keep coming, one a second, until every query has data."""
    import time

    from sessionserve.dashboards import render_all

    exprs = [
        (f"{name} / {panel['title']}", target["expr"].replace("$replica", ".*"))
        for name, board in render_all().items()
        for panel in board["panels"]
        for target in panel["targets"]
    ]
    deadline = time.monotonic() + 90
    with httpx.Client(base_url=served["base"], timeout=60) as c:
        sid = c.post("/v1/sessions", json={}).json()["id"]
        turn = 0
        while True:
            c.post(
                "/v1/completions",
                json={"prompt": [70, 71 + turn % 100], "max_tokens": 3},
                headers={"x-session-id": sid},
            )
            turn += 1
            # prom.query raises if a query does not parse
            empty = [f"{where}: {expr}" for where, expr in exprs if not prom.query(expr)]
            if not empty or time.monotonic() > deadline:
                break
            time.sleep(1.0)
    assert not empty, "queries without data:\n" + "\n".join(empty)
