"""`serve run` as a user starts it, for the end-to-end tests.

The deploy configs all listen on port 8000, so one `serve run` runs at a time. Consecutive
tests that use the same config share it (a start costs 20-35 s on 2 cores); it is stopped
after the last of them, or when a test stops it (Ctrl-C), so nothing of it runs beside tests
that do not use it and any order of tests still gets a server.

Each runs the shipped config with one change: `engine.compile: false`. With `auto`, a first
start on a new machine builds the model's compiled packages in the background, minutes of
CPU that no test here waits for (the server stops first: the build never ends) and that
slowed these tests by a third even at idle priority (tests/e2e/test_agents.py: 157 s with
the build, 102 s without, one run each). The compiled forward has its own tests
(tests/unit/replicas/test_compiled_*.py), the background build included."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.http_wait import wait_healthy
from tests.process_group import stop_group
from tests.ray_start import once_more_on_startup_timeout

ROOT = Path(__file__).resolve().parents[2]
PORT = 8000  # fixed by deploy/serve-cpu.yaml
LOG_NAME = "serve.log"  # in the server's Ray temp dir
DEFAULT_CONFIG = "deploy/serve-cpu.yaml"
GEMMA3_CONFIG = "deploy/serve-gemma3-cpu.yaml"
FIXTURE_CONFIGS = {  # which server each fixture below hands out
    "serve_run": DEFAULT_CONFIG,
    "served_default_model": DEFAULT_CONFIG,
    "serve_run_gemma3": GEMMA3_CONFIG,
}


@dataclass
class ServeRun:
    """One `serve run` process: its config, base URL, process and log (in its Ray temp dir)."""

    config: str
    base: str
    proc: subprocess.Popen
    ray_tmp: str

    @property
    def log_path(self) -> Path:
        return Path(self.ray_tmp) / LOG_NAME

    def running(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        """Stop the process group, Ray's own processes included, and remove its temp dir."""
        stop_group(self.proc)
        shutil.rmtree(self.ray_tmp, ignore_errors=True)


class ServeRuns:
    """The end-to-end tests' one `serve run` at a time: `get` hands out the server of a config
    (the running one, or a new one after stopping another), `stop` ends it."""

    def __init__(self) -> None:
        self.current: ServeRun | None = None

    def get(self, config: str) -> ServeRun:
        if self.current is not None and self.current.config == config and self.current.running():
            return self.current
        self.stop()
        self.current = _start_healthy(config)
        return self.current

    def stop(self) -> None:
        server, self.current = self.current, None
        if server is not None:
            server.stop()


SERVERS = ServeRuns()


def pytest_runtest_teardown(item, nextitem) -> None:
    """Stop the server unless the next test uses the same one."""
    current = SERVERS.current
    if current is not None and _config_of(nextitem) != current.config:
        SERVERS.stop()


def pytest_sessionfinish(session) -> None:
    SERVERS.stop()


def _config_of(item) -> str | None:
    names = getattr(item, "fixturenames", ())
    return next((config for name, config in FIXTURE_CONFIGS.items() if name in names), None)


@pytest.fixture
def serve_run() -> ServeRun:
    """The default config served (the test may stop it: the next test gets a new one)."""
    return SERVERS.get(DEFAULT_CONFIG)


@pytest.fixture
def serve_run_gemma3() -> ServeRun:
    return SERVERS.get(GEMMA3_CONFIG)


@pytest.fixture
def served_default_model() -> str:
    """The default config served: its base URL."""
    return SERVERS.get(DEFAULT_CONFIG).base


def _start_healthy(config: str) -> ServeRun:
    """`serve run config` as a user starts it, once healthy. A start whose raylet missed
    Ray's startup wait (tests/ray_start.py) is stopped and made once more."""
    deadline = time.monotonic() + 60  # a server stopped by the test before may still be going
    while not _port_free(PORT):
        if time.monotonic() > deadline:
            pytest.fail(f"port {PORT} is busy: stop whatever listens there (a `make serve`?)")
        time.sleep(0.5)
    base = f"http://127.0.0.1:{PORT}"

    def start() -> tuple[ServeRun, str | None]:
        ray_tmp = tempfile.mkdtemp(prefix="ss-", dir="/tmp")  # Ray's socket paths must be short
        server = ServeRun(config, base, _start_serve_run(config, ray_tmp), ray_tmp)
        if wait_healthy(base, 240, alive=server.running):
            return server, None
        log = server.log_path.read_text()  # (before `stop`, which removes its dir)
        server.stop()
        return server, log

    server, failure = once_more_on_startup_timeout(start, f"`serve run {config}`")
    if failure is not None:
        pytest.fail(f"`serve run {config}` never answered /health:\n{failure[-3000:]}")
    return server


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def eager_copy(config: str, folder: str) -> Path:
    """`config` with `engine.compile: false` in every application, written into `folder`."""
    import yaml

    spec = yaml.safe_load((ROOT / config).read_text())
    for application in spec["applications"]:
        application["args"]["engine"]["compile"] = False
    path = Path(folder) / Path(config).name
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def _start_serve_run(config: str, ray_tmp: str) -> subprocess.Popen:
    env = os.environ | {
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_TMPDIR": ray_tmp,
        "PYTHONUNBUFFERED": "1",
    }
    serve_bin = Path(sys.executable).with_name("serve")
    with (Path(ray_tmp) / LOG_NAME).open("w") as log:
        return subprocess.Popen(
            [str(serve_bin), "run", str(eager_copy(config, ray_tmp))],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, as a terminal's foreground job
            # Ctrl-C reaches it as in a terminal even if this test runs with SIGINT ignored (a
            # shell's background job): a process that inherits SIG_IGN never sees Ctrl-C
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
