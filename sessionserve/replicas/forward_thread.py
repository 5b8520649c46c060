"""Where overlapped steps run: one thread that runs prepared steps in the order they were
submitted, as a device stream runs its kernels (overlap scheduling, `engine.overlap_schedule`).

The engine thread schedules and prepares step N+1 and processes step N-1's results while this
thread runs step N's forward and sampling. Order is what makes that safe: step N+1 starts
after step N has sampled, so it reads N's tokens (`ModelRunner.last_sampled`, on the device),
and every KV write of step N lands before any of N+1's. Nothing here waits for the device: a
step's tokens are copied to the host in the background and read when the engine thread lands it
(`StepOutput.resolve`), so on a GPU this thread launches step N+1 while step N still runs.
A copy into the pool from the engine thread (a parked session restored) is not in that order:
it waits for the submitted steps first (`KVPool.fence`, set to `wait`). A step that verifies
drafts runs here too, with nothing before it, and the engine waits for it (every target
forward runs on this thread); the EAGLE head's catch-up runs on the engine thread, over its
own KV pool.

`inline` (`engine.overlap_schedule: inline`) keeps the order and drops the thread: a step runs
on the caller's thread when it is submitted, so the engine thread launches step N+1 before it
lands step N, as SGLang's event loop does. On a GPU the two threads share one GIL: the H200
runs of 2026-12-04 found the forward thread's launch waiting for it while the engine thread
landed the last step, and the overlapped step no faster than the host work of both threads
together (docs/benchmarks.md); inline, the same step measured 1.58 / 3.04 / 4.01 ms at 1 / 32 /
64 requests against the thread's 1.80 / 3.65-4.15 / 4.71-4.99 (run S; run T: 1.98 / 2.48 at
32 / 64 against 2.75 / 3.68), so `auto` picks it on a GPU.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from typing import Any, TypeVar

import torch

from sessionserve.replicas.model_runner import ModelRunner
from sessionserve.replicas.step import ForwardBatch, ScheduledBatch, SeqLayout, StepOutput

log = logging.getLogger(__name__)
T = TypeVar("T")


class ForwardThread:
    def __init__(self, runner: ModelRunner, inline: bool = False) -> None:
        self.runner = runner
        self._thread: threading.Thread | None = None  # the executor's one thread, once started
        self._last: Future[StepOutput] | None = None
        self._pool: ThreadPoolExecutor | None = None  # None: inline, steps run as submitted
        if inline:
            return
        threads = torch.get_num_threads()  # the engine's (a new thread may not inherit them)
        # libgomp counts both threads' teams; more threads than cores: it barely spins
        if 2 * threads > (os.cpu_count() or 1) and "OMP_WAIT_POLICY" not in os.environ:
            log.warning(
                "overlap scheduling runs forwards on a second thread; with %d torch threads on "
                "%s cores, OpenMP then sleeps between parallel regions while another thread's "
                "team is alive: build the engine on a thread that exits "
                "(sessionserve.replicas.openmp.run_on_passing_thread, as served replicas do), "
                "run no large torch op on the thread that steps it, and start Python with "
                "OMP_WAIT_POLICY=ACTIVE GOMP_SPINCOUNT=300000 (served replicas get them)",
                threads,
                os.cpu_count(),
            )
        self._pool = ThreadPoolExecutor(
            1,
            thread_name_prefix="sessionserve-forward",
            initializer=lambda: self._start(threads, runner.device),
        )

    @property
    def inline(self) -> bool:
        """Whether steps run on the caller's thread as they are submitted."""
        return self._pool is None

    def _start(self, threads: int, device: torch.device) -> None:
        self._thread = threading.current_thread()
        torch.set_num_threads(threads)
        if device.type == "cuda":  # the current device is per thread
            torch.cuda.set_device(device)

    def submit(
        self, batch: ScheduledBatch, fb: ForwardBatch, layout: dict[str, SeqLayout]
    ) -> Future[StepOutput]:
        """Run `batch` (already prepared) after every step submitted before it (inline: now,
        its error, if any, kept in the future as the thread's would be)."""
        self._last = self._do(self._run, batch, fb, layout)
        return self._last

    def _do(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        if self._pool is not None:
            return self._pool.submit(fn, *args)
        done: Future[T] = Future()
        try:
            done.set_result(fn(*args))
        except Exception as e:
            done.set_exception(e)
        return done

    def _run(
        self, batch: ScheduledBatch, fb: ForwardBatch, layout: dict[str, SeqLayout]
    ) -> StepOutput:
        out = self.runner.run_prepared(batch, fb, layout, defer=True)
        if out.hidden is not None:  # the drafter's features may sit in a decode graph's
            out.hidden = out.hidden.clone()  # buffer, which the next replay overwrites, maybe
            # before this step lands
        return out

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on this thread, after the steps submitted before it: for what is set
        per thread (its CPU affinity, in `benchmarks/gpu.py --pin-threads`)."""
        return self._do(fn, *args).result()

    def wait(self) -> None:
        """Return once every submitted step has finished (its error, if any, stays in its
        future for whoever processes that step)."""
        last = self._last
        if last is not None and threading.current_thread() is not self._thread:
            wait_for([last])

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
