"""Starting the tests' in-process Ray node, once more when it misses Ray's startup wait.

`ray.init` gives its raylet a hard-coded 30 s to register with the GCS. One CI run (a fresh
2-core machine, after the `serve run` and two-node tests) missed it, and since `served` is
session-scoped, every Ray test after it errored on that one timeout. A second start in a new
temp dir is cheap beside that; the first attempt's Ray logs go into a warning (and into the
error if the second attempt fails too) so that the cause can be read from CI's output. The
tests that start Ray in another process (`serve run`, the two-node scenario) retry the same way,
through `once_more_on_startup_timeout`."""

from __future__ import annotations

import shutil
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import psutil

STARTUP_TIMEOUT = "timed out during startup"  # Ray's message when the raylet never registers
LOGS = ("raylet.err", "raylet.out", "gcs_server.err", "gcs_server.out")
T = TypeVar("T")


def once_more_on_startup_timeout(
    start: Callable[[], tuple[T, str | None]],
    what: str,
    attempts: int = 2,
    shown: int | None = 2000,
) -> tuple[T, str | None]:
    """Call `start`, which returns its result and why it failed (None: it worked), again while
    the failure shows Ray's startup wait missed, `attempts` calls in all, with a warning that
    carries the failure's last `shown` characters (None: all of it) each time; returns the
    last call's result and failure. Any other failure is returned at once: only that timeout
    is worth a retry."""
    for attempt in range(1, attempts + 1):
        result, failure = start()
        if failure is None or attempt == attempts or STARTUP_TIMEOUT not in failure:
            return result, failure
        tail = failure if shown is None else failure[-shown:]
        warnings.warn(f"{what} did not start its Ray node; again: {tail}", stacklevel=2)
    raise ValueError(f"attempts must be at least 1, not {attempts}")


def init_local_ray(attempts: int = 2, **init_kwargs) -> str:
    """`ray.init(**init_kwargs)` on a new local node whose temp dir is a fresh short one under
    /tmp (Ray's socket paths must be short); returns that dir. A start that times out is
    cleaned up (its processes killed, its dir removed) and tried again, `attempts` in all."""
    import ray

    failures: list[str] = []

    def start() -> tuple[str, str | None]:
        temp_dir = tempfile.mkdtemp(prefix="ss-", dir="/tmp")
        started = time.time()
        try:
            ray.init(_temp_dir=temp_dir, **init_kwargs)
        except Exception as e:
            if STARTUP_TIMEOUT not in str(e):
                raise
            failures.append(f"attempt {len(failures) + 1}: {e}\n{log_tails(temp_dir)}")
            kill_children_started_since(started)
            shutil.rmtree(temp_dir, ignore_errors=True)
            return temp_dir, failures[-1]
        return temp_dir, None

    # the warning carries the whole of the failed attempt's log tails (`log_tails`)
    temp_dir, failure = once_more_on_startup_timeout(start, "Ray's local node", attempts, None)
    if failure is not None:
        raise RuntimeError("Ray's local node never started:\n" + "\n".join(failures))
    return temp_dir


def log_tails(temp_dir: str, lines: int = 15) -> str:
    """The last `lines` lines of the raylet's and the GCS's logs under `temp_dir`, their
    periodic state dumps left out, each line cut to 300 characters."""
    parts = []
    for name in LOGS:
        for path in sorted(Path(temp_dir).glob(f"session_*/logs/{name}")):
            text = path.read_text(errors="replace").splitlines()
            tail = [line[:300] for line in text if not line.startswith("[state-dump]")][-lines:]
            if tail:
                parts.append(f"--- {name}\n" + "\n".join(tail))
    return "\n".join(parts) or f"(no Ray logs under {temp_dir})"


def kill_children_started_since(started: float) -> None:
    """Kill this process's descendants started at or after `started` (epoch seconds): the
    processes of a failed `ray.init`, which no `ray.shutdown` knows of (it never returned a
    node), would otherwise hold CPUs and ports for the rest of the run."""
    procs = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.create_time() >= started - 1:
                child.kill()
                procs.append(child)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)
