"""What the routers of this process know, reachable from the ingress: their caches of session
pins (`forget_pin` drops one everywhere) and of their replicas' latest loads
(`rebalance_plan`).

A module of its own, not part of session_router.py, because Serve ships the router class by
value (cloudpickle): that module's globals in a router are a copy, unreachable from the
ingress. This module is imported by reference, so the ingress reaches the caches of every
router in its process.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Any

_caches: weakref.WeakSet[PinCache] = weakref.WeakSet()
_rebalanced: dict[str, Any] = {}  # source replica -> the stats report its last move used


class PinCache(OrderedDict):
    """session id -> replica id, least recently used first, at most `limit` entries: ids
    churn without end, and a forgotten pin costs one directory call, not a wrong route."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit
        self.loads: dict[str, dict[str, Any]] = {}  # the router's replicas -> routing stats
        _caches.add(self)

    def put(self, session_id: str, replica: str) -> None:
        self[session_id] = replica
        self.move_to_end(session_id)
        while len(self) > self.limit:
            self.popitem(last=False)

    def note_loads(self, replicas: list[Any]) -> None:
        """The replicas the router routes to now, with their stats (for `rebalance_plan`)."""
        self.loads = {r.replica_id.unique_id: r.routing_stats or {} for r in replicas}

    def drop_replica(self, replica: str) -> None:
        for sid in [s for s, r in self.items() if r == replica]:
            del self[sid]
        self.loads.pop(replica, None)

    __hash__ = object.__hash__  # a WeakSet member (dicts are unhashable by value)


def forget_pin(session_id: str) -> None:
    """Drop a session's cached pin in every router of this process (it moved): the next
    request for it asks the directory."""
    for cache in list(_caches):
        cache.pop(session_id, None)


def check_pin(session_id: str, replica: str | None) -> None:
    """The directory pins the session to `replica` (None: not placed): drop a cached pin that
    says otherwise. A session closed through another ingress process and opened again under
    the same id would else follow a dead pin, past the directory, to its old replica."""
    for cache in list(_caches):
        if cache.get(session_id, replica) != replica:
            del cache[session_id]


def forget_replica(replica: str) -> None:
    """A replica died: no router here pins to it, or rebalances to it, any more."""
    _rebalanced.pop(replica, None)
    for cache in list(_caches):
        cache.drop_replica(replica)


def rebalance_plan(session_id: str, queue_len: int) -> tuple[str, str] | None:
    """(source, target) when the session's replica reports at least `queue_len` requests
    queued or running and another of the same router reports at most half as many (the one
    with the most free KV among those); else None. One move per source per stats report: a
    stale report cannot move a crowd of sessions."""
    cache = next((c for c in list(_caches) if session_id in c), None)
    if cache is None:
        return None
    source, loads = cache[session_id], cache.loads
    stats = loads.get(source)
    if stats is None or stats.get("queue_len", 0) < queue_len:
        return None
    if _rebalanced.get(source) == stats.get("ts"):
        return None
    calm = [
        (r, s) for r, s in loads.items() if r != source and s.get("queue_len", 0) <= queue_len // 2
    ]
    if not calm:
        return None
    target = max(calm, key=lambda rs: rs[1].get("free_kv_tokens", 0))[0]
    _rebalanced[source] = stats.get("ts")
    return source, target
