"""Why a replica builds its engine on a thread that then exits (libgomp's thread accounting).

libgomp keeps a thread's team of OpenMP workers until that thread exits, and counts every
worker of every team it holds. When it counts more threads than cores it spins only 100 times
(1,000 with OMP_WAIT_POLICY=ACTIVE) at each barrier before sleeping, instead of 300,000: every
parallel region of the forward then waits on a wake-up. Loading a model runs parallel regions,
so a replica that loaded on a long-lived thread (Serve calls the constructor on one) and decodes
on its engine thread holds two teams with torch threads filling the cores. Built on a thread
that exits, the loader's team is gone before the first step and the engine thread's team is
the only one (docs/benchmarks.md, "The loader's OpenMP team").
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def run_on_passing_thread(fn: Callable[[], T], name: str) -> T:
    """`fn()` on a new thread, joined before returning its result (or raising its error), so
    the OpenMP team it started is released with the thread."""
    result: list[T] = []
    error: list[BaseException] = []

    def work() -> None:
        try:
            result.append(fn())
        except BaseException as e:  # re-raised on the caller's thread
            error.append(e)

    thread = threading.Thread(target=work, name=name, daemon=True)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]
