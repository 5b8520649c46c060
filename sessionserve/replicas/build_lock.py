"""What a replica makes once per machine (a converted model, a compiled package, a kernel),
made by one process while the others wait for it.

Why a file lock: the replicas of one machine share the cache root and start together (`make
serve` starts two); without it each makes its own copy, and on 2 cores two GGUF conversions
or two package builds at once take each other's cores for nothing. The lock is the target's
path plus ".lock" (`filelock`, an OS lock: released when its holder dies).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)


def build_once(
    target: Path,
    build: Callable[[], None],
    announce: str,
    logger: logging.Logger = log,
    before_build: Callable[[], None] | None = None,
    level: int = logging.INFO,
) -> None:
    """Run `build`, which must make `target` appear whole (an atomic rename), unless `target`
    exists; under its file lock, so that processes sharing a cache build it once: the others
    wait (saying so), then find it. `before_build` runs under the lock first (removing what a
    killed build left: none of this target's builds runs then). `announce` goes to `logger`
    when this process builds, and the wait when another does, at `level`."""
    from filelock import FileLock, Timeout

    if target.exists():
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(target) + ".lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        logger.log(level, "waiting for another process that is making %s", target)
        lock.acquire()
    try:
        if target.exists():
            return
        if before_build is not None:
            before_build()
        logger.log(level, "%s", announce)
        build()
    finally:
        lock.release()
