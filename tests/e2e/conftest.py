"""`serve run` as a user starts it, for the end-to-end tests."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
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
    if not _port_free(PORT):
        pytest.fail(f"port {PORT} is busy: stop whatever listens there (a `make serve`?)")
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
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # serve run shuts down cleanly on SIGTERM
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        shutil.rmtree(ray_tmp, ignore_errors=True)
