"""Where the session directory keeps a copy of its state, so that a directory actor that is
killed or loses its node comes back with every session: Ray's GCS key-value store, the store
Serve's own controller checkpoints to (it outlives a head-node restart where the cluster runs
GCS fault tolerance with Redis; without it, it lives as long as the cluster).

One key per session record and one per stored response, written on each change that matters
(open, pin, committed turn, response stored or deleted, close). `last_active` is not written
on every touch: a rebuilt directory restarts each session's idle clock.
"""

from __future__ import annotations

import pickle
from typing import Protocol

NAMESPACE = "sessionserve"


class SessionStore(Protocol):
    def put(self, key: str, value: object) -> None: ...

    def delete(self, key: str) -> None: ...

    def load(self) -> dict[str, object]: ...


class MemoryStore:
    """A store in this process (tests; a directory that needs no recovery)."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def put(self, key: str, value: object) -> None:
        self.data[key] = pickle.dumps(value)

    def delete(self, key: str) -> None:
        self.data.pop(key, None)

    def load(self) -> dict[str, object]:
        return {k: pickle.loads(v) for k, v in self.data.items()}


class GcsStore:
    """Ray's GCS key-value store, under one prefix per application. Ray has no public API for
    it: this is the store Serve's own controller checkpoints through (its GCS client's
    `internal_kv_*`), reached through `ray.experimental.internal_kv`; kept to this one class,
    so another store (Redis, etcd) implements `SessionStore` and drops in."""

    def __init__(self, app_name: str, shard_prefix: str = "") -> None:
        from ray.experimental import internal_kv

        self.kv = internal_kv
        self.prefix = f"directory/{app_name or 'default'}/{shard_prefix}"

    def put(self, key: str, value: object) -> None:
        self.kv._internal_kv_put(
            self.prefix + key, pickle.dumps(value), overwrite=True, namespace=NAMESPACE
        )

    def delete(self, key: str) -> None:
        self.kv._internal_kv_del(self.prefix + key, namespace=NAMESPACE)

    def load(self) -> dict[str, object]:
        out = {}
        for full in self.kv._internal_kv_list(self.prefix, namespace=NAMESPACE):
            value = self.kv._internal_kv_get(full, namespace=NAMESPACE)
            if value is not None:  # deleted since it was listed
                out[full.decode()[len(self.prefix) :]] = pickle.loads(value)
        return out

    def clear(self) -> None:
        self.kv._internal_kv_del(self.prefix, del_by_prefix=True, namespace=NAMESPACE)
