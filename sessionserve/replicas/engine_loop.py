"""The replica's engine thread: the only thread that touches the engine.

Requests arrive on the replica's asyncio loop and reach the engine as commands (submit, abort,
session calls) that this thread runs between two steps, answered through futures the asyncio
loop awaits; so that loop never waits for a forward. Routing statistics are a snapshot the
thread publishes. If the thread dies, `on_death` is told once (open streams end with a 503)
and every queued command fails; the replica's health check then reports it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from sessionserve.errors import EngineUnavailableError
from sessionserve.replicas.engine import Engine

log = logging.getLogger(__name__)
IDLE_TICK_S = 0.5  # while idle: check the idle invariant and refresh the gauges this often


class EngineLoop(threading.Thread):
    """Owns the engine: runs queued commands, then a step while there is work; while idle,
    every IDLE_TICK_S, closes sessions past their TTL and checks the idle invariant.
    Publishes `stats` for the router."""

    STATS_PERIOD_S = 0.05

    def __init__(
        self, engine: Engine, on_death: Callable[[BaseException], None] | None = None
    ) -> None:
        super().__init__(name="sessionserve-engine", daemon=True)
        self.engine = engine
        self.on_death = on_death  # told once if the thread dies (streams must not hang)
        self.commands: queue.SimpleQueue[tuple[Callable[..., Any], tuple, Future]] = (
            queue.SimpleQueue()
        )
        self.wake = threading.Event()
        self.stopping = False
        self.error: BaseException | None = None
        self.stats: dict[str, Any] = self._stats()
        self._stats_at = 0.0
        self._closed = False  # set (under _closing) once the thread stops taking commands
        self._closing = threading.Lock()

    def call(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Run `fn(*args)` on the engine thread between two steps; its result or exception
        arrives in the returned future."""
        fut: Future = Future()
        with self._closing:
            if self._closed or self.stopping or not self.is_alive():
                raise EngineUnavailableError(
                    "this replica's engine is not running; retry (another replica will answer)"
                )
            self.commands.put((fn, args, fut))
        self.wake.set()
        return fut

    def run(self) -> None:
        try:
            while not self.stopping:
                if self._drain():
                    self._publish(force=True)  # submits and aborts change what is queued
                if self.engine.has_work():
                    self.engine.step()
                    self._publish()
                    continue
                if not self.wake.wait(IDLE_TICK_S):
                    self.engine.reap_expired_sessions()  # TTLs run out on a quiet replica too
                    self.engine.report_gauges()  # checks the invariant (idle form if idle)
                    self._publish(force=True)
                self.wake.clear()
            self._drain()
            self.engine.close()  # the step in flight (overlap scheduling), the forward thread
        except BaseException as e:  # the replica reports it through check_health
            self.error = e
            log.exception("engine loop died")
            if self.on_death is not None:
                self.on_death(e)
        with self._closing:  # no command can be queued after this: none is left unanswered
            self._closed = True
        self._fail_pending()

    def _drain(self) -> int:
        """Run every queued command; returns how many ran."""
        ran = 0
        while True:
            try:
                fn, args, fut = self.commands.get_nowait()
            except queue.Empty:
                return ran
            ran += 1
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args))
                except Exception as e:  # a bad request fails its own command only
                    fut.set_exception(e)

    def _fail_pending(self) -> None:
        while True:
            try:
                _, _, fut = self.commands.get_nowait()
            except queue.Empty:
                return
            if fut.set_running_or_notify_cancel():
                fut.set_exception(EngineUnavailableError("this replica's engine stopped"))

    def _publish(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._stats_at >= self.STATS_PERIOD_S:
            self._stats_at, self.stats = now, self._stats()

    def _stats(self) -> dict[str, Any]:
        e = self.engine
        return {
            "free_kv_tokens": e.cache.reclaimable_size(),
            "held_tokens": sum(e.cache.slot_held_tokens(s) for s in e.cache.idle_slots()),
            "open_sessions": len(e.cache.session_slots),
            "queue_len": len(e.scheduler.waiting) + len(e.scheduler.running),
        }
