"""The routers' local caches of session pins, and `forget_pin` to drop one process-wide.

A module of its own, not part of session_router.py, because Serve ships the router class by
value (cloudpickle): that module's globals in a router are a copy, unreachable from the
ingress. This module is imported by reference, so `forget_pin` (called by the ingress when a
session moved) reaches the caches of every router in its process.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict

_caches: weakref.WeakSet[PinCache] = weakref.WeakSet()


class PinCache(OrderedDict):
    """session id -> replica id, least recently used first, at most `limit` entries: ids
    churn without end, and a forgotten pin costs one directory call, not a wrong route."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit
        _caches.add(self)

    def put(self, session_id: str, replica: str) -> None:
        self[session_id] = replica
        self.move_to_end(session_id)
        while len(self) > self.limit:
            self.popitem(last=False)

    def drop_replica(self, replica: str) -> None:
        for sid in [s for s, r in self.items() if r == replica]:
            del self[sid]

    __hash__ = object.__hash__  # a WeakSet member (dicts are unhashable by value)


def forget_pin(session_id: str) -> None:
    """Drop a session's cached pin in every router of this process (it moved): the next
    request for it asks the directory."""
    for cache in list(_caches):
        cache.pop(session_id, None)
