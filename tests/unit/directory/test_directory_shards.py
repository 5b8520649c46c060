"""A sharded directory: each session, and each of its stored responses, lives on the shard
its id hashes to; the typed client sends every call there without asking anyone, fans out
only what concerns no session, keeps an API key's session limit across shards, and a shard
restarted from its own store comes back with its sessions alone."""

from __future__ import annotations

import asyncio

import pytest

from sessionserve.directory.client import DirectoryClient, shard_of
from sessionserve.directory.state import SessionDirectoryState
from sessionserve.directory.store import MemoryStore
from sessionserve.errors import TooManySessionsError

SHARDS = 4


class ShardActor:
    """A shard in this process: `method.remote(...)` runs at once on a real state."""

    def __init__(self, state: SessionDirectoryState) -> None:
        self.state, self.calls = state, 0

    def __getattr__(self, name: str):
        actor = self

        class Method:
            @staticmethod
            def remote(*args):
                actor.calls += 1
                future = asyncio.get_event_loop().create_future()
                future.set_result(getattr(actor.state, name)(*args))
                return future

        return Method


def sharded(stores: list[MemoryStore]) -> tuple[DirectoryClient, list[ShardActor]]:
    actors = [ShardActor(SessionDirectoryState(60.0, store)) for store in stores]
    return DirectoryClient("test", 60.0, SHARDS, actors), actors


def test_sessions_and_their_responses_live_on_their_shard() -> None:
    stores = [MemoryStore() for _ in range(SHARDS)]
    client, actors = sharded(stores)

    async def scenario() -> list[str]:
        sids = [await client.open(None, None, "k") for _ in range(40)]
        for sid in sids:
            assert await client.commit_turn(sid, 0, [1, 2, 3])
            rid = client.response_id(sid)
            assert await client.store_response(sid, {"id": rid}, [], 3, [4], "k")
            assert (await client.get_response(rid, "k"))["session_id"] == sid
            assert await client.resolve_pin(sid, "replica-a", ["replica-a"]) == ("replica-a", None)
        assert (await client.counts())["sessions"] == 40
        client.drop_replica("replica-a")  # every shard forgets the dead replica's pins
        return sids

    sids = asyncio.run(scenario())
    for i, actor in enumerate(actors):
        mine = {s for s in sids if shard_of(s, SHARDS) == i}
        assert set(actor.state.sessions) == mine and mine  # spread over every shard
        assert all(rec.replica is None for rec in actor.state.sessions.values())
        assert all(shard_of(r, SHARDS) == i for r in actor.state.response_sessions)
    assert asyncio.run(client.log(sids[0], "k")) == [1, 2, 3, 4]


def test_a_restarted_shard_rebuilds_only_its_own_sessions() -> None:
    stores = [MemoryStore() for _ in range(SHARDS)]
    client, actors = sharded(stores)
    sids = [asyncio.run(client.open(None, None)) for _ in range(20)]
    for sid in sids:
        asyncio.run(client.commit_turn(sid, 0, [7, len(sid)]))
    actors[2].state = SessionDirectoryState(60.0, stores[2])  # shard 2 restarted
    assert set(actors[2].state.sessions) == {s for s in sids if shard_of(s, SHARDS) == 2}
    for sid in sids:
        assert asyncio.run(client.log(sid)) == [7, len(sid)]


def test_an_api_keys_session_limit_holds_across_shards() -> None:
    client, actors = sharded([MemoryStore() for _ in range(SHARDS)])
    # Ids chosen to land on different shards: random ones all land on one 1 time in 256.
    by_shard: dict[int, list[str]] = {}
    for i in range(256):
        by_shard.setdefault(shard_of(f"k-{i}", SHARDS), []).append(f"k-{i}")
    ids = [by_shard[i % SHARDS][i // SHARDS] for i in range(5)]
    opened = [asyncio.run(client.open(sid, None, "k", 5)) for sid in ids]
    assert opened == ids and len({shard_of(s, SHARDS) for s in opened}) == SHARDS
    with pytest.raises(TooManySessionsError, match="holds 5 open sessions, the limit"):
        asyncio.run(client.open(None, None, "k", 5))
    assert asyncio.run(client.open(None, None, "other", 5)) is not None  # per key
    asyncio.run(client.close(opened[0], "k"))
    assert asyncio.run(client.open(None, None, "k", 5)) is not None


def test_a_session_call_costs_one_shard_one_call() -> None:
    client, actors = sharded([MemoryStore() for _ in range(SHARDS)])
    sid = asyncio.run(client.open("s-1", None))
    before = [a.calls for a in actors]
    asyncio.run(client.touch(sid))
    asyncio.run(client.commit_turn(sid, 0, [1]))
    after = [a.calls for a in actors]
    home = shard_of(sid, SHARDS)
    assert [b - a for a, b in zip(before, after, strict=True)] == [
        2 if i == home else 0 for i in range(SHARDS)
    ]
