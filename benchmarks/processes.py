"""The processes of a server on this machine, and pausing them (SIGSTOP, then SIGCONT).

On a 2-core machine a server left idle beside the one being measured still takes the cores'
time (Ray's daemons wake ~2,000 times a second, docs/benchmarks.md "What an idle Ray cluster
costs the engine"), so benchmarks that compare servers or arms pause what is not measured.
Linux only (/proc)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path


def cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def parent(pid: int) -> int:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    return int(stat[stat.rindex(")") + 2 :].split()[1])


def _all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _own_line() -> set[int]:
    """This process and every process it descends from (never paused)."""
    ours, p = set(), os.getpid()
    while p > 1:
        ours.add(p)
        p = parent(p)
    return ours


def _with_descendants(roots: set[int], pids: list[int]) -> set[int]:
    found = set(roots)
    for pid in pids:
        p = parent(pid)
        while p > 1 and pid not in found:
            if p in roots:
                found.add(pid)
            p = parent(p)
    return found


def ray_processes() -> list[int]:
    """Every process of Ray on this machine: its workers and actors (`ray::...`), its daemons
    (binaries and scripts under the ray package), the dashboard's, the `serve run` or `ray`
    command that started them, and their children; never this process or one it descends
    from."""
    import ray  # here: a benchmark of another server needs no Ray unless it pauses ours

    ray_dir = str(Path(ray.__file__).parent)
    pids = _all_pids()
    roots = set()
    for pid in pids:
        args = cmdline(pid)
        if (
            args
            and (
                args[0].startswith(("ray::", "ray-dashboard-"))
                or any(ray_dir in a or a.startswith("ray.") for a in args)  # daemons, `-m ray.x`
                or any(os.path.basename(a) in ("serve", "ray") for a in args[:2])  # `serve run`
            )
        ):
            roots.add(pid)
    return sorted(_with_descendants(roots, pids) - _own_line())


def process_tree(root: int) -> list[int]:
    """`root` and every process descending from it (a server's API process and its engine
    workers), never this process or one it descends from."""
    if not Path(f"/proc/{root}").exists():
        raise ValueError(f"no process {root} on this machine")
    return sorted(_with_descendants({root}, _all_pids()) - _own_line())


def signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


@contextlib.contextmanager
def paused(pids: list[int], settle_s: float = 0.3) -> Iterator[None]:
    """`pids` stopped for the block; resumed however the block ends, a Ctrl-C included."""
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def resume_and_raise(signum: int, frame: object) -> None:
        signal_all(pids, signal.SIGCONT)
        raise KeyboardInterrupt

    for s in previous:
        signal.signal(s, resume_and_raise)
    signal_all(pids, signal.SIGSTOP)
    try:
        time.sleep(settle_s)  # let the stopped processes leave the cores
        yield
    finally:
        signal_all(pids, signal.SIGCONT)
        for s, handler in previous.items():
            signal.signal(s, handler)
