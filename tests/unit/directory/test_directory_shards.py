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


def test_a_new_sessions_first_turn_costs_its_shard_one_call() -> None:
    """Implicit open (`touch_or_open`): a new id is opened and touched in one call to its
    shard, with the TTL given; a known one is only touched; another key's id is as if it did
    not exist (and stays that key's); past a key's limit, a 429 as `open`."""
    client, actors = sharded([MemoryStore() for _ in range(SHARDS)])
    home = actors[shard_of("s-new", SHARDS)]
    before = home.calls
    record = asyncio.run(client.touch_or_open("s-new", "k", 30.0))
    assert record == {"ttl_s": 30.0, "replica": None, "log_tokens": 0}
    assert home.calls == before + 1 and home.state.sessions["s-new"].owner == "k"
    asyncio.run(client.commit_turn("s-new", 0, [1, 2]))
    again = asyncio.run(client.touch_or_open("s-new", "k", 99.0))
    assert again == {"ttl_s": 30.0, "replica": None, "log_tokens": 2}  # touched, not re-opened
    assert asyncio.run(client.touch_or_open("s-new", "other", 30.0)) is None
    assert home.state.sessions["s-new"].owner == "k"
    one = DirectoryClient("test", 60.0, 1, [ShardActor(SessionDirectoryState(60.0, MemoryStore()))])
    assert asyncio.run(one.touch_or_open("a", "k", None, 1))["ttl_s"] == 60.0  # the default
    with pytest.raises(TooManySessionsError, match="holds 1 open sessions, the limit"):
        asyncio.run(one.touch_or_open("b", "k", None, 1))
    assert asyncio.run(one.touch_or_open("a", "k", None, 1)) is not None  # known: no limit


def test_implicit_open_counts_a_keys_limit_across_shards() -> None:
    """Sharded with a per-key limit: the first turn of a new session is a touch, the open
    (which counts the key's sessions on every shard) and a touch; a known one only a touch."""
    client, actors = sharded([MemoryStore() for _ in range(SHARDS)])
    by_shard: dict[int, list[str]] = {}
    for i in range(256):
        by_shard.setdefault(shard_of(f"k-{i}", SHARDS), []).append(f"k-{i}")
    ids = [by_shard[i][0] for i in range(SHARDS)]  # one id on each shard
    for sid in ids[:3]:
        assert asyncio.run(client.touch_or_open(sid, "k", None, 3))["log_tokens"] == 0
    with pytest.raises(TooManySessionsError, match="holds 3 open sessions, the limit"):
        asyncio.run(client.touch_or_open(ids[3], "k", None, 3))
    before = sum(a.calls for a in actors)
    assert asyncio.run(client.touch_or_open(ids[0], "k", None, 3)) is not None
    assert sum(a.calls for a in actors) == before + 1
