"""`served`: a real Ray Serve application (2 replicas of a tiny model, our router and ingress)
on loopback, started once for the integration and e2e tests that need it and shut down after
them. Ray's metrics agent exports on a known port every second (for the Prometheus test)."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
from collections.abc import Iterator

import pytest

from tests.http_wait import wait_healthy
from tests.ray_start import init_local_ray

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # keep Ray on 127.0.0.1
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

APP = "sessionserve"
# sampling values that underflow to NaN probabilities or overflow the 64-bit seed: each must be
# a 400 naming its field (the engine's validation and the HTTP API alike)
DEGENERATE_SAMPLING = [
    ("top_p", 5e-324),
    ("repetition_penalty", 5e-324),
    ("temperature", 1e-300),
    ("seed", 2**64),
    ("seed", -(2**63) - 1),
]


def pytest_addoption(parser) -> None:
    parser.addoption(
        "--device",
        default=os.environ.get("SESSIONSERVE_TEST_DEVICE", "cpu"),
        help="torch device for the engine tests' models (e.g. cuda); also "
        "SESSIONSERVE_TEST_DEVICE. Reference models (transformers' generate) stay on CPU.",
    )


def pytest_configure(config) -> None:
    import torch

    device = config.getoption("--device")
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError(f"--device {device}: CUDA is not available on this machine")
    os.environ["SESSIONSERVE_TEST_DEVICE"] = device  # read by tests.models.engine_device()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # `make test` runs the unit tests two at a time:
        torch.set_num_threads(1)  # one core each (tiny models gain nothing from a second)


def pytest_collection_modifyitems(config, items) -> None:
    import torch

    _order_modules(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _order_modules(items: list) -> None:
    """A stable reorder of whole modules (so module fixtures are set up once):
    - Modules marked `slow` first. `make test` hands the tests without Ray to two workers a
      module at a time in this order (`--no-loadscope-reorder`); started last, one module of
      2-3 minutes left a worker busy long after the other ran out of work (xdist's own
      order, by number of tests, put them at the end: 660 s against 631 s in one hour).
    - Every module that uses `served` last. `served` is session-scoped: once started, its Ray
      cluster (Serve controller, proxy, four replicas polled every second) lives until the
      run ends, taking CPU from every later test and its driver threads from the pytest
      process. Started last, nothing runs beside it that does not need it."""
    uses = {item.path for item in items if "served" in item.fixturenames}
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: (item.path in uses, item.path not in slow))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def app_args(model_dir: str) -> dict:
    return {
        "engine": {
            # fp32 whatever `auto` picks on this CPU: the tests compare tokens exactly
            "model": {"path": model_dir, "torch_threads": 1, "dtype": "float32"},
            "cache": {"page_size": 4, "num_slots": 8192, "max_rows": 64, "max_context_len": 2048},
            "sessions": {"implicit_open": False, "default_ttl_s": 600},
            "scheduler": {"max_prefill_tokens": 64},
            "memory_check": "every_step",
        },
        "replica": {
            "num_replicas": 2,
            "num_cpus": 0.5,
            "routing_stats_period_s": 0.5,
            "health_check_period_s": 1.0,
            "max_ongoing_requests": 16,
        },
        "ingress": {"num_replicas": 2, "num_cpus": 0.25},  # two routers share the pins
    }


@pytest.fixture(scope="session")
def served(tmp_path_factory):
    import ray
    from ray import serve

    from sessionserve.app import build_app
    from tests.models import save_tiny_model

    model_dir = tmp_path_factory.mktemp("tiny-model")
    # big enough that a long turn stays in flight for seconds (a 409 needs a running turn)
    save_tiny_model(model_dir, hidden_size=256, intermediate_size=512, num_hidden_layers=4)
    metrics_port = free_port()
    ray_tmp = init_local_ray(
        num_cpus=2,
        include_dashboard=False,
        _metrics_export_port=metrics_port,
        _system_config={"metrics_report_interval_ms": 1000},
        logging_level="WARNING",
        configure_logging=False,
    )
    port = free_port()
    serve.start(
        http_options={"host": "127.0.0.1", "port": port},
        logging_config={"enable_access_log": False},
    )
    serve.run(build_app(app_args(str(model_dir))), name=APP, route_prefix="/")
    base = f"http://127.0.0.1:{port}"
    assert wait_healthy(base, 60), "the application never answered /health"
    yield {
        "base": base,
        "model": os.path.basename(model_dir),
        "model_dir": str(model_dir),
        "metrics_port": metrics_port,
    }
    serve.shutdown()
    ray.shutdown()
    shutil.rmtree(ray_tmp, ignore_errors=True)


@contextlib.contextmanager
def extra_app(served: dict, name: str, args: dict, wait_s: float = 90) -> Iterator[str]:
    """Another application beside `served`, at route prefix `/{name}`; yields its base URL.
    Deleted however the block ends, its start included: an app left behind holds CPUs that
    every later app's `serve.run` waits for (forever)."""
    from ray import serve

    from sessionserve.app import build_app

    try:
        serve.run(build_app(args), name=name, route_prefix=f"/{name}")
        base = f"{served['base']}/{name}"
        assert wait_healthy(base, wait_s), f"the {name} app never answered /health"
        yield base
    finally:
        serve.delete(name)


def serve_actor_names(prefix: str) -> list[str]:
    """Names of Serve's named actors (namespace "serve") that start with `prefix`, sorted:
    `SERVE_REPLICA::<app>#<deployment>#` for a deployment's replicas, `SERVE_PROXY_ACTOR` for
    the proxies."""
    import ray

    return sorted(
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == "serve" and a["name"].startswith(prefix)
    )


def replica_memory(app: str = APP, replicas: int = 2) -> dict[str, dict]:
    """Each model replica's memory-invariant terms (it raises if the invariant is broken).
    Unpinned calls spread at random, so enough of them reach every replica. Waits first for
    `replicas` running replicas: an earlier test may have killed one, which Serve restarts."""
    import time

    from ray import serve

    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        states = serve.status().applications[app].deployments["SessionReplica"].replica_states
        if states == {"RUNNING": replicas}:
            break
        time.sleep(0.5)
    handle = serve.get_deployment_handle("SessionReplica", app_name=app)
    seen: dict[str, dict] = {}
    for _ in range(40):
        terms = handle.memory_check.remote().result(timeout_s=30)
        seen[terms["replica"]] = terms
        if len(seen) == replicas:
            break
    return seen


@pytest.fixture
def threads(request):
    """torch's thread count set to the test's parameter (`indirect=True`), restored after."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)
