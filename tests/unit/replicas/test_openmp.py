"""The replica builds its engine on a thread that exits before serving (replicas/openmp.py):
libgomp frees a thread's OpenMP team only when that thread ends."""

from __future__ import annotations

import threading

import pytest

from sessionserve.config import EngineConfig
from sessionserve.errors import InvalidConfigError
from sessionserve.replicas import server as server_module
from sessionserve.replicas.loader import ModelNotFoundError
from sessionserve.replicas.openmp import run_on_passing_thread
from sessionserve.replicas.server import ReplicaServer
from tests.models import save_tiny_model


def test_runs_on_another_thread_that_is_gone_when_it_returns() -> None:
    seen: list[threading.Thread] = []

    def build() -> int:
        seen.append(threading.current_thread())
        return 7

    assert run_on_passing_thread(build, "builder") == 7
    (thread,) = seen
    assert thread is not threading.current_thread()
    assert thread.name == "builder"
    assert not thread.is_alive()


def test_the_builders_error_reaches_the_caller() -> None:
    def build() -> None:
        raise InvalidConfigError("this is what to change")

    with pytest.raises(InvalidConfigError, match="what to change"):
        run_on_passing_thread(build, "builder")


def test_a_replica_builds_its_engine_off_the_serving_threads(tmp_path, monkeypatch) -> None:
    save_tiny_model(tmp_path)
    builders: list[threading.Thread] = []
    real_engine = server_module.Engine

    def recording_engine(*args, **kwargs):
        builders.append(threading.current_thread())
        return real_engine(*args, **kwargs)

    monkeypatch.setattr(server_module, "Engine", recording_engine)
    srv = ReplicaServer({"model": {"path": str(tmp_path)}, "memory_check": "every_step"})
    try:
        (builder,) = builders
        assert builder is not threading.current_thread()
        assert builder is not srv.loop  # the engine thread is not the builder either
        assert not builder.is_alive()  # its OpenMP team went with it
        assert srv.loop.is_alive()
    finally:
        srv.shutdown()


@pytest.mark.parametrize("compile_setting", ["auto", False])
def test_a_cpu_replica_that_may_compile_starts_its_kernels_builds_first(
    compile_setting, tmp_path, monkeypatch
) -> None:
    """Before its model loads (the kernels' builds overlap it), unless it never compiles."""
    save_tiny_model(tmp_path)
    events: list[str] = []
    real_engine = server_module.Engine
    monkeypatch.setattr(
        server_module.native_kernel, "prefetch", lambda dtype: events.append(f"kernels {dtype}")
    )

    def recording_engine(*args, **kwargs):
        events.append("engine")
        return real_engine(*args, **kwargs)

    monkeypatch.setattr(server_module, "Engine", recording_engine)
    srv = ReplicaServer({"model": {"path": str(tmp_path)}, "compile": compile_setting})
    try:
        # the dtype `auto` resolves to on this CPU: prefetch builds the kernels it runs
        dtype = EngineConfig.model_validate({"model": {"path": str(tmp_path)}}).model.torch_dtype()
        assert events == ([f"kernels {dtype}", "engine"] if compile_setting else ["engine"])
    finally:
        srv.shutdown()


def test_a_replica_that_cannot_build_says_why(tmp_path) -> None:
    with pytest.raises(ModelNotFoundError, match="not a local model directory"):
        ReplicaServer({"model": {"path": str(tmp_path / "missing")}})
