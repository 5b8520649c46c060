"""`benchmarks/processes.py` pauses a server's processes while another is measured: it must find
the whole tree, never the caller, and always resume what it stopped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.processes import parent, paused, process_tree

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="Linux /proc only")


def state(pid: int) -> str:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2]


def wait_for_state(pid: int, wanted: set[str], timeout_s: float = 10.0) -> str:
    deadline = time.monotonic() + timeout_s
    while (s := state(pid)) not in wanted and time.monotonic() < deadline:
        time.sleep(0.02)
    return s


@pytest.fixture
def server_tree():
    """A parent that starts a child and waits: a server's API process and its engine."""
    code = (
        "import subprocess, sys, time; "
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        "print(c.pid, flush=True); time.sleep(60)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    child = int(proc.stdout.readline())
    yield proc.pid, child
    for pid in (child, proc.pid):
        try:
            os.kill(pid, signal.SIGCONT)  # first: a stopped process dies only once resumed
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def test_a_tree_holds_its_root_and_descendants_and_never_the_caller(server_tree):
    root, child = server_tree
    assert parent(child) == root
    assert process_tree(root) == sorted([root, child])
    assert os.getpid() not in process_tree(os.getppid())  # an ancestor's tree, without us


def test_a_missing_root_is_a_clear_error():
    with pytest.raises(ValueError, match="no process"):
        process_tree(2**22 + 7)  # above Linux's default pid_max


def test_paused_stops_the_tree_and_resumes_it_even_when_the_block_fails(server_tree):
    pids = process_tree(server_tree[0])
    with pytest.raises(RuntimeError), paused(pids, settle_s=0.0):
        assert all(wait_for_state(p, {"T"}) == "T" for p in pids)
        raise RuntimeError("the measured run failed")
    assert all(wait_for_state(p, {"S", "R"}) in ("S", "R") for p in pids)
