"""Running a test's Python script in a process of its own: a kernel built for another ISA
(torch reads ATEN_CPU_CAPABILITY once, and an op loads once per process), or a setting read
when a module is first used."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).parents[1]  # the repository: the script imports `tests` and `sessionserve`


def run_child(script: str, marker: str | None = None, timeout_s: float = 600, **env: str) -> str:
    """`script` (dedented) under this Python, from the repository root, with `env` added to
    this process's environment; asserts it exits 0 (and printed `marker`), showing the tail of
    its stderr where not; returns its stdout."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert marker is None or marker in done.stdout, (done.stdout[-2000:], done.stderr[-3000:])
    return done.stdout
