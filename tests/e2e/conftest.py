"""`serve run` as a user starts it, for the end-to-end tests."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.http_wait import wait_healthy

ROOT = Path(__file__).resolve().parents[2]
PORT = 8000  # fixed by deploy/serve-cpu.yaml


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


@pytest.fixture
def serve_run(tmp_path):
    yield from _serve_run("deploy/serve-cpu.yaml", tmp_path)


@pytest.fixture
def serve_run_gemma3(tmp_path):
    yield from _serve_run("deploy/serve-gemma3-cpu.yaml", tmp_path)


@pytest.fixture(scope="module")
def served_default_model(tmp_path_factory):
    """The default config served once for a module's tests: its base URL."""
    for base, _ in _serve_run("deploy/serve-cpu.yaml", tmp_path_factory.mktemp("serve")):
        yield base


def _serve_run(config: str, tmp_path):
    """`serve run config` as a user starts it; yields (base URL, process) once healthy."""
    deadline = time.monotonic() + 60  # a server stopped by the test before may still be going
    while not _port_free(PORT):
        if time.monotonic() > deadline:
            pytest.fail(f"port {PORT} is busy: stop whatever listens there (a `make serve`?)")
        time.sleep(0.5)
    ray_tmp = tempfile.mkdtemp(prefix="ss-", dir="/tmp")  # Ray's socket paths must be short
    env = os.environ | {
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_TMPDIR": ray_tmp,
        "PYTHONUNBUFFERED": "1",
    }
    log = (tmp_path / "serve.log").open("w")
    serve_bin = Path(sys.executable).with_name("serve")
    proc = subprocess.Popen(
        [str(serve_bin), "run", config],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group, as a terminal's foreground job
        # Ctrl-C reaches it as in a terminal even if this test runs with SIGINT ignored (a
        # shell's background job): a process that inherits SIG_IGN never sees Ctrl-C
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    base = f"http://127.0.0.1:{PORT}"
    healthy = wait_healthy(base, 240, alive=lambda: proc.poll() is None)
    try:
        assert healthy, (tmp_path / "serve.log").read_text()[-3000:]
        yield base, proc
    finally:
        _stop_group(proc)
        shutil.rmtree(ray_tmp, ignore_errors=True)


def _stop_group(proc: subprocess.Popen, grace_s: float = 60) -> None:
    """SIGTERM `serve run`'s process group (it shuts down cleanly on it) and wait until every
    process of the group is gone, Ray's own included: one left behind keeps port 8000 (or its
    CPUs) from the next test. SIGKILL what outlives `grace_s`."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        deadline = time.monotonic() + grace_s
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace_s)  # reaped, or the group would never look empty
        if group_gone(proc.pid, deadline - time.monotonic()):
            return
        grace_s = 10


def group_gone(pgid: int, timeout_s: float) -> bool:
    """Whether every process of group `pgid` (Ray's own included) is gone within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)
