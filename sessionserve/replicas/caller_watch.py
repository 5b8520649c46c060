"""Which running turns lost their caller, so the replica can abort them.

Ray does not cancel an actor task whose caller's process died: a turn whose ingress replica
was killed (a crash, its node lost) runs on to `max_tokens` with no one to read it, holding
its KV and its session. The client's retry, through another ingress, then meets a 409 "turn
in flight" for as long as the orphan runs (measured: a 1,500-token turn of the test model ran
on 15.7 s after its ingress was killed, the retries meeting 409s until it ended; a long answer
of a real model runs minutes). Each call names its caller (the ingress
replica's Ray actor name, `GenerateCall.caller`); `CallerWatch` keeps the running turns'
callers and asks Ray whether they still live, every `period_s` while any turn is watched and
at once when a turn of the same session arrives (see `ReplicaServer.generate`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)
SERVE_NAMESPACE = "serve"  # where Ray Serve names its replicas' actors
PERIOD_S = 1.0
ANSWER_WAIT_S = 2.0  # a liveness question Ray has not answered by then counts as alive


def serve_actor_alive(name: str) -> bool:
    """Whether Ray Serve's actor `name` lives. False only when Ray knows no actor of that name:
    Serve never restarts a replica under its name, so a dead one stays gone. Any other failure
    (the GCS restarting, say) counts as alive: aborting a live caller's turn would lose it."""
    import ray

    try:
        ray.get_actor(name, namespace=SERVE_NAMESPACE)
    except ValueError:  # "Failed to look up actor with name ..."
        return False
    except Exception as e:
        log.debug("could not tell whether %s lives (%r): taken as alive", name, e)
    return True


class CallerWatch:
    """The running turns' callers (request id to caller) and which of them died. Used from one
    event loop (the replica's); `is_alive` runs on a worker thread (it may block on Ray)."""

    def __init__(
        self, is_alive: Callable[[str], bool] = serve_actor_alive, period_s: float = PERIOD_S
    ) -> None:
        self.is_alive = is_alive
        self.period_s = period_s
        self.callers: dict[str, str] = {}
        self._sweeps: asyncio.Task | None = None

    def watch(self, rid: str, caller: str | None) -> None:
        if caller is not None:
            self.callers[rid] = caller

    def forget(self, rid: str) -> None:
        self.callers.pop(rid, None)

    async def orphaned(self, rid: str) -> str | None:
        """The caller of running turn `rid` if it died (None: alive, or not watched)."""
        caller = self.callers.get(rid)
        if caller is None or await self._lives(caller):
            return None
        return caller

    async def orphans(self) -> dict[str, list[str]]:
        """Each dead caller's running turns, one liveness question per caller."""
        by_caller: dict[str, list[str]] = {}
        for rid, caller in self.callers.items():
            by_caller.setdefault(caller, []).append(rid)
        dead = {}
        for caller, rids in by_caller.items():
            if not await self._lives(caller):
                dead[caller] = rids
        return dead

    async def _lives(self, caller: str) -> bool:
        """Asked on a worker thread, waited for at most ANSWER_WAIT_S (a GCS that is down
        would hold a 409's answer for a minute)."""
        try:
            return await asyncio.wait_for(asyncio.to_thread(self.is_alive, caller), ANSWER_WAIT_S)
        except TimeoutError:
            return True

    def start(self, abort: Callable[[str, str], Awaitable[object]]) -> None:
        """Sweep for orphans on this event loop every `period_s` (once started, until
        `stop`): `abort(rid, caller)` ends each orphaned turn."""
        loop = asyncio.get_running_loop()
        if self._sweeps is None or self._sweeps.done() or self._sweeps.get_loop() is not loop:
            self._sweeps = loop.create_task(self._sweep(abort))

    def stop(self) -> None:
        if self._sweeps is not None:
            self._sweeps.cancel()

    async def _sweep(self, abort: Callable[[str, str], Awaitable[object]]) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            if not self.callers:
                continue
            try:
                for caller, rids in (await self.orphans()).items():
                    log.warning("%d turn(s) lost their caller %s: aborted", len(rids), caller)
                    for rid in rids:
                        await abort(rid, caller)
            except Exception:  # a sweep that fails must not end the sweeps
                log.exception("looking for orphaned turns failed")
