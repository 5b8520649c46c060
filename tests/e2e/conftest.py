"""`serve run` as a user starts it, for the end-to-end tests."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import pytest

from tests.http_wait import wait_healthy
from tests.process_group import stop_group
from tests.ray_start import STARTUP_TIMEOUT

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
    """`serve run config` as a user starts it; yields (base URL, process) once healthy. A start
    whose raylet missed Ray's startup wait (tests/ray_start.py) is stopped and made once more."""
    deadline = time.monotonic() + 60  # a server stopped by the test before may still be going
    while not _port_free(PORT):
        if time.monotonic() > deadline:
            pytest.fail(f"port {PORT} is busy: stop whatever listens there (a `make serve`?)")
        time.sleep(0.5)
    base = f"http://127.0.0.1:{PORT}"
    log_path = tmp_path / "serve.log"
    for attempt in (1, 2):
        ray_tmp = tempfile.mkdtemp(prefix="ss-", dir="/tmp")  # Ray's socket paths must be short
        proc = _start_serve_run(config, ray_tmp, log_path)
        healthy = wait_healthy(base, 240, alive=lambda p=proc: p.poll() is None)
        log = log_path.read_text()
        if healthy or attempt == 2 or STARTUP_TIMEOUT not in log:
            break
        warnings.warn(f"`serve run` did not start its Ray node; again: {log[-2000:]}", stacklevel=2)
        stop_group(proc)
        shutil.rmtree(ray_tmp, ignore_errors=True)
    try:
        assert healthy, log[-3000:]
        yield base, proc
    finally:
        stop_group(proc)
        shutil.rmtree(ray_tmp, ignore_errors=True)


def _start_serve_run(config: str, ray_tmp: str, log_path: Path) -> subprocess.Popen:
    env = os.environ | {
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_TMPDIR": ray_tmp,
        "PYTHONUNBUFFERED": "1",
    }
    serve_bin = Path(sys.executable).with_name("serve")
    with log_path.open("w") as log:
        return subprocess.Popen(
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
