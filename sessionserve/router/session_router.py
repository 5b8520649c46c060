"""Session-affinity request router (a Ray Serve `RequestRouter`).

- A request with a session id goes to that session's pinned replica alone (a one-replica first
  rank): Serve then waits for that replica's capacity rather than spilling to another, because
  only that replica holds the session's KV.
- A new session is placed on the replica with the most free KV (from `record_routing_stats`;
  ties: fewest open sessions), and the pin is recorded in the shared directory by
  compare-and-set, so every router process (each proxy, each ingress replica) agrees.
- If the pinned replica is gone (died, scaled down), the session is re-pinned to a live one; its
  next turn re-prefills from the token log in the directory.
- Requests without a session: power of two choices by queue length and free KV.
- Calls addressed to a replica (a migration's steps): keyword `replica=` goes to that replica,
  `avoid=[...]` to the one with the most free KV among the others. If there is no such replica the
  call lands on another, which refuses it by name (UnknownReplicaError), never silently.
- It records the replicas' latest stats where the ingress's rebalancing reads them
  (`pin_cache.rebalance_plan`): a migration cannot run inside a routing decision (it is a
  request through this same router).
Routing stats are used to *place*; a pin never moves on a guess. A
session's pin changes when its replica dies or it is migrated: the migrating process calls
`forget_pin`, any other finds out from the old replica (SessionMovedError) and does the same.
"""

from __future__ import annotations

import logging
import random

from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from sessionserve.directory.client import get_directory
from sessionserve.metrics import RouterMetrics
from sessionserve.router.pin_cache import PinCache, forget_replica

log = logging.getLogger(__name__)


class SessionAffinityRouter(RequestRouter):
    def initialize_state(
        self,
        tokens_per_new_session: int = 512,
        max_cached_pins: int = 65536,
        directory_shards: int = 1,
        **kwargs,
    ) -> None:
        self._pins = PinCache(max_cached_pins)  # a local cache of the directory's pins
        self._directory = None
        self._directory_shards = directory_shards
        # Stats arrive every ~second; placements made since then are counted here so that a
        # burst of new sessions does not all land on the replica that looked freest.
        self._tokens_per_new_session = tokens_per_new_session
        self._recent: dict[str, tuple[float, int]] = {}  # replica -> (stats time, placed since)
        self.sticky_hits = 0
        self.placements = 0
        self.repins = 0
        try:
            self._metrics: RouterMetrics | None = RouterMetrics(self.app_name)
        except Exception:  # no Ray metrics here (a unit test)
            self._metrics = None

    def _count(self, what: str) -> None:
        setattr(self, what, getattr(self, what) + 1)
        if self._metrics is not None:
            self._metrics.inc(what)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        self._pins.note_loads(candidate_replicas)  # for the ingress's rebalancing
        kwargs = pending_request.kwargs if pending_request else {}
        if candidate_replicas and (kwargs.get("replica") or kwargs.get("avoid")):
            return self._addressed(candidate_replicas, kwargs.get("replica"), kwargs.get("avoid"))
        session_id = pending_request.metadata.session_id if pending_request else None
        if not session_id or not candidate_replicas:
            return self._two_choices(candidate_replicas)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        pinned = self._pins.get(session_id)
        if pinned in by_id:  # the common case: no remote call at all
            self._pins.move_to_end(session_id)
            self._count("sticky_hits")
            return [[by_id[pinned]]]
        choice = self._most_free_kv(candidate_replicas)
        winner, previous = await self._dir().resolve_pin(
            session_id, choice.replica_id.unique_id, list(by_id)
        )
        if previous == winner:  # pinned earlier (through another router process), still there
            self._count("sticky_hits")
        else:  # our choice became the pin: a new session, or one whose replica is gone
            self._note_placement(choice)
            if previous is None:
                self._count("placements")
            else:
                self._count("repins")
                log.warning("session %s re-pinned from %s to %s", session_id, previous, winner)
        self._pins.put(session_id, winner)
        return [[by_id[winner]]]

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        dead = replica_id.unique_id
        forget_replica(dead)  # this router's pins and the loads the ingress reads
        self._dir().drop_replica(dead)

    # ---- internals ----
    def _addressed(
        self, replicas: list[RunningReplica], replica: str | None, avoid: list[str] | None
    ) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in replicas}
        if replica in by_id:
            return [[by_id[replica]]]
        others = [r for r in replicas if r.replica_id.unique_id not in (avoid or ())] or replicas
        return [[self._most_free_kv(others)]]

    def _dir(self):
        if self._directory is None:
            self._directory = get_directory(self.app_name, shards=self._directory_shards)
        return self._directory

    def _placed_since_stats(self, r: RunningReplica) -> int:
        stamp = (r.routing_stats or {}).get("ts", 0.0)
        seen_stamp, placed = self._recent.get(r.replica_id.unique_id, (stamp, 0))
        return placed if seen_stamp == stamp else 0

    def _note_placement(self, r: RunningReplica) -> None:
        stamp = (r.routing_stats or {}).get("ts", 0.0)
        self._recent[r.replica_id.unique_id] = (stamp, self._placed_since_stats(r) + 1)

    def _most_free_kv(self, replicas: list[RunningReplica]) -> RunningReplica:
        """Free KV is compared in units of one new session's expected size: replicas within
        one unit of each other tie, and the tie goes to the fewest open sessions (else a few
        tokens of difference would send every new session to the same replica)."""
        unit = self._tokens_per_new_session

        def key(r: RunningReplica) -> tuple[float, float, float]:
            stats, placed = r.routing_stats or {}, self._placed_since_stats(r)
            free_units = stats.get("free_kv_tokens", 0) // unit - placed
            return (-free_units, stats.get("open_sessions", 0) + placed, random.random())

        return min(replicas, key=key)

    @staticmethod
    def _two_choices(replicas: list[RunningReplica]) -> list[list[RunningReplica]]:
        """Two random replicas in one rank: Serve sends to the one with the shorter queue."""
        return [random.sample(replicas, min(2, len(replicas)))]
