"""Stopping a process started in its own process group, with every process it started."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time


def stop_group(proc: subprocess.Popen, grace_s: float = 60) -> None:
    """SIGTERM `proc`'s process group (`serve run` shuts down cleanly on it) and wait until
    every process of the group is gone, Ray's own included: one left behind keeps a port (or
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
