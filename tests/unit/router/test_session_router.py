"""The session router's decisions and the directory's pin rules, without a Ray cluster."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from sessionserve.directory.client import DirectoryClient
from sessionserve.directory.state import SessionDirectoryState
from sessionserve.router.session_router import SessionAffinityRouter


@dataclass
class FakeReplica:
    name: str
    routing_stats: dict = field(default_factory=dict)

    @property
    def replica_id(self):
        return SimpleNamespace(unique_id=self.name)


class _Remote:
    """`actor.method.remote(...)` awaitable, backed by the plain directory state."""

    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        fut = asyncio.get_event_loop().create_future()
        fut.set_result(self.fn(*args))
        return fut


class FakeDirectoryActor:
    def __init__(self, state: SessionDirectoryState):
        self.state = state
        self.calls = 0

    def __getattr__(self, name):
        self.calls += 1
        return _Remote(getattr(self.state, name))


def opened(*session_ids: str) -> SessionDirectoryState:
    """A directory holding these sessions, opened as the ingress opens them before routing."""
    state = SessionDirectoryState()
    for sid in session_ids:
        state.open(sid, None)
    return state


def make_router(directory: FakeDirectoryActor) -> SessionAffinityRouter:
    """A router whose directory client (the real one) talks to `directory` as its actor;
    `router.fake` is that actor, counting the calls."""
    router = object.__new__(SessionAffinityRouter)  # skip Serve's constructor
    router.initialize_state(tokens_per_new_session=100)
    router._directory = DirectoryClient("test", actors=[directory])
    router.fake = directory
    return router


def route(router, replicas, session_id, **kwargs):
    pending = SimpleNamespace(metadata=SimpleNamespace(session_id=session_id), kwargs=kwargs)
    ranks = asyncio.run(router.choose_replicas(replicas, pending))
    return ranks


def test_addressed_calls_go_to_the_named_replica_or_avoid_one() -> None:
    router = make_router(FakeDirectoryActor(SessionDirectoryState()))
    a = FakeReplica("a", {"free_kv_tokens": 9000, "ts": 1.0})
    b = FakeReplica("b", {"free_kv_tokens": 10, "ts": 1.0})
    c = FakeReplica("c", {"free_kv_tokens": 5000, "ts": 1.0})
    assert route(router, [a, b, c], None, replica="b") == [[b]]
    assert route(router, [a, b, c], None, replica=None, avoid=["a"]) == [[c]]  # freest other
    assert route(router, [a, b, c], None, avoid=["a", "c"]) == [[b]]
    # a named replica that is not running: the call lands elsewhere and is refused there
    assert route(router, [a, b], None, replica="gone") == [[a]]
    assert route(router, [a], None, avoid=["a"]) == [[a]]  # nowhere else: refused by a itself
    assert router.fake.calls == 0  # addressed calls never ask the directory


def test_forget_pin_makes_the_next_request_ask_the_directory() -> None:
    from sessionserve.router.pin_cache import forget_pin

    state = opened("s")
    router = make_router(FakeDirectoryActor(state))
    a = FakeReplica("a", {"free_kv_tokens": 9000, "ts": 1.0})
    b = FakeReplica("b", {"free_kv_tokens": 10, "ts": 1.0})
    assert route(router, [a, b], "s") == [[a]]
    assert state.move_pin("s", "a", "b") and not state.move_pin("s", "a", "b")
    assert route(router, [a, b], "s") == [[a]]  # the cached pin: stale until forgotten
    forget_pin("s")
    assert route(router, [a, b], "s") == [[b]]
    assert not state.move_pin("unknown", "a", "b")


def test_a_session_reopened_elsewhere_does_not_follow_its_old_cached_pin() -> None:
    """Closed through another ingress process (this one's routers keep the pin) and opened
    again under the same id: the ingress checks its routers' pin against the directory's
    (touch returns it) before routing, so the turn is placed by the directory, which then
    knows where the session's KV is (a view names it, DELETE frees it)."""
    from sessionserve.router.pin_cache import check_pin

    state = opened("s")
    router = make_router(FakeDirectoryActor(state))
    a = FakeReplica("a", {"free_kv_tokens": 10, "ts": 1.0})
    b = FakeReplica("b", {"free_kv_tokens": 9000, "ts": 1.0})
    assert route(router, [a, b], "s") == [[b]]
    state.close("s")  # through another process: nothing here hears of it
    state.open("s", None)
    a.routing_stats, b.routing_stats = {"free_kv_tokens": 9000, "ts": 2.0}, {"free_kv_tokens": 10}
    check_pin("s", state.touch("s")["replica"])
    assert route(router, [a, b], "s") == [[a]]  # placed anew, not sent after the old pin
    assert state.touch("s")["replica"] == "a"
    check_pin("s", "a")  # agrees: kept, no directory call
    calls = router.fake.calls
    assert route(router, [a, b], "s") == [[a]] and router.fake.calls == calls


def test_sessions_stick_and_new_ones_go_where_kv_is_free() -> None:
    state = SessionDirectoryState()
    d = FakeDirectoryActor(state)
    router = make_router(d)
    a = FakeReplica("a", {"free_kv_tokens": 1000, "ts": 1.0})
    b = FakeReplica("b", {"free_kv_tokens": 5000, "ts": 1.0})
    (rank,) = route(router, [a, b], "s1")
    assert [r.name for r in rank] == ["b"]  # the most free KV
    b.routing_stats = {"free_kv_tokens": 10, "ts": 2.0}  # b fills up: s1 stays anyway
    for _ in range(5):
        assert route(router, [a, b], "s1") == [[b]]
    calls = d.calls
    route(router, [a, b], "s1")
    assert d.calls == calls  # a pinned session costs no remote call
    assert router.sticky_hits == 6 and router.placements == 1


def test_a_burst_of_new_sessions_spreads_despite_stale_stats() -> None:
    router = make_router(FakeDirectoryActor(SessionDirectoryState()))
    a = FakeReplica("a", {"free_kv_tokens": 1000, "ts": 1.0})
    b = FakeReplica("b", {"free_kv_tokens": 1050, "ts": 1.0})
    placed = [route(router, [a, b], f"s{i}")[0][0].name for i in range(10)]
    assert placed.count("a") == 5 and placed.count("b") == 5


def test_near_equal_free_kv_ties_and_fewest_sessions_wins() -> None:
    """A few tokens of free-KV difference must not draw every new session to one replica
    (fresh stats each time, so no placement penalty is in play)."""
    router = make_router(FakeDirectoryActor(SessionDirectoryState()))
    placed = []
    sessions = {"a": 0, "b": 0}
    for i in range(10):
        a = FakeReplica(
            "a", {"free_kv_tokens": 1008, "ts": float(i), "open_sessions": sessions["a"]}
        )
        b = FakeReplica(
            "b", {"free_kv_tokens": 1000, "ts": float(i), "open_sessions": sessions["b"]}
        )
        name = route(router, [a, b], f"s{i}")[0][0].name
        sessions[name] += 1
        placed.append(name)
    assert placed.count("a") == 5 and placed.count("b") == 5


def test_a_pin_is_shared_between_router_processes() -> None:
    state = opened("s")
    one, two = make_router(FakeDirectoryActor(state)), make_router(FakeDirectoryActor(state))
    a = FakeReplica("a", {"free_kv_tokens": 100, "ts": 1.0})
    b = FakeReplica("b", {"free_kv_tokens": 990, "ts": 1.0})
    assert route(one, [a, b], "s") == [[b]]
    # the other router sees stats where a looks freer, but the pin wins
    a2 = FakeReplica("a", {"free_kv_tokens": 10_000, "ts": 2.0})
    assert route(two, [a2, b], "s") == [[b]]


def test_dead_replica_sessions_are_repinned() -> None:
    state = opened("s")
    router = make_router(FakeDirectoryActor(state))
    a, b = FakeReplica("a", {"free_kv_tokens": 900}), FakeReplica("b", {"free_kv_tokens": 100})
    assert route(router, [a, b], "s") == [[a]]
    router._pins.clear()  # as on_replica_actor_died does for a's pins
    assert route(router, [b], "s") == [[b]]  # a is gone from the candidates
    assert router.repins == 1 and state.repins == 1
    assert state.get_pin("s") == "b"


def test_requests_without_session_use_two_random_choices() -> None:
    router = make_router(FakeDirectoryActor(SessionDirectoryState()))
    reps = [FakeReplica(n) for n in "abcd"]
    seen = set()
    for _ in range(50):
        (rank,) = route(router, reps, None)
        assert len(rank) == 2 and rank[0] is not rank[1]
        seen.update(r.name for r in rank)
    assert seen == set("abcd")


def test_directory_registry_log_and_ttl(monkeypatch) -> None:
    state = SessionDirectoryState(default_ttl_s=10.0)
    sid = state.open(None, None)
    assert state.open(sid, None) is None  # taken
    state.commit_turn(sid, 0, [1, 2, 3, 70000])
    assert state.log(sid) == [1, 2, 3, 70000]
    assert state.info(sid) == {"replica": None, "turns": 1, "history_tokens": 4, "ttl_s": 10.0}
    import time

    now = time.monotonic()
    monkeypatch.setattr("time.monotonic", lambda: now + 11)
    assert not state.touch(sid) and state.log(sid) is None  # expired
    assert state.close("ghost") is None
    other = state.open("x", None)
    assert state.close(other) == ""  # existed, never pinned


def test_a_closed_session_is_not_brought_back_by_routing_or_a_late_commit() -> None:
    """A DELETE racing a turn: the router may still route the turn (to its choice), but the
    directory registers nothing, and the turn's commit says the session is gone (the ingress
    then frees the replica's copy) instead of recreating it without an owner."""
    state = SessionDirectoryState(default_ttl_s=60.0)
    sid = state.open("s", None, "alice")
    assert state.resolve_pin(sid, "a", ["a"]) == ("a", None)
    assert state.commit_turn(sid, 0, [5, 6, 7]) and state.commit_turn(sid, 0, [5, 6, 7])
    assert state.close(sid, "alice") == "a"
    assert state.resolve_pin(sid, "b", ["a", "b"]) == ("b", None)
    assert not state.commit_turn(sid, 3, [8, 9])
    assert state.sessions == {} and state.info(sid) is None and state.info(sid, "bob") is None
    assert state.get_pin(sid) is None and state.counts()["sessions"] == 0
    assert state.open(sid, None, "bob") == sid  # the id is free again, for a new session


@pytest.mark.parametrize("alive", [["a"], []])
def test_resolve_pin_keeps_a_live_pin(alive) -> None:
    state = opened("s")
    assert state.resolve_pin("s", "a", ["a"]) == ("a", None)
    replica, previous = state.resolve_pin("s", "b", alive)
    assert (replica, previous) == (("a", "a") if alive else ("b", "a"))


def test_a_pin_seen_through_a_second_router_is_a_sticky_hit_not_a_repin() -> None:
    """A second router process that picks the session's own replica as its choice must not
    count (or log) a re-pin: the pin did not move."""
    state = opened("s")
    one, two = make_router(FakeDirectoryActor(state)), make_router(FakeDirectoryActor(state))
    a, b = FakeReplica("a", {"free_kv_tokens": 900}), FakeReplica("b", {"free_kv_tokens": 100})
    assert route(one, [a, b], "s") == [[a]]
    assert route(two, [a, b], "s") == [[a]]  # two's own choice is a as well
    assert (two.repins, two.placements, two.sticky_hits) == (0, 0, 1)
    assert state.repins == 0


def test_stored_responses_live_and_die_with_their_session(monkeypatch) -> None:
    state = SessionDirectoryState(default_ttl_s=10.0)
    sid = state.open(None, None)
    items = [{"id": "msg_1", "role": "user"}]
    assert state.store_response(sid, {"id": "resp_1"}, items, 0, [5, 6, 7])
    assert state.store_response(sid, {"id": "resp_2"}, items, 3, [8])
    assert state.get_response("resp_1") == {
        "session_id": sid,
        "response": {"id": "resp_1"},
        "items": items,
    }
    assert state.info(sid)["turns"] == 2 and state.log(sid) == [5, 6, 7, 8]  # committed turns
    assert state.delete_response("resp_1") and not state.delete_response("resp_1")
    assert state.get_response("resp_1") is None and state.get_response("resp_2") is not None
    assert state.close(sid) == ""
    assert state.get_response("resp_2") is None and state.response_sessions == {}
    assert not state.store_response(sid, {"id": "resp_3"}, items, 0, [1])  # session gone
    # expiry: the session's idle TTL takes its responses along
    sid2 = state.open(None, None)
    state.store_response(sid2, {"id": "resp_4"}, items, 0, [1])
    import time

    now = time.monotonic()
    monkeypatch.setattr("time.monotonic", lambda: now + 11)
    assert state.get_response("resp_4") is None and state.response_sessions == {}


def test_the_router_pin_cache_is_bounded_and_a_forgotten_pin_still_routes() -> None:
    state = opened("s-0")
    router = object.__new__(SessionAffinityRouter)
    router.initialize_state(tokens_per_new_session=100, max_cached_pins=1000)
    router._directory = DirectoryClient("test", actors=[FakeDirectoryActor(state)])
    a, b = FakeReplica("a", {"free_kv_tokens": 900}), FakeReplica("b", {"free_kv_tokens": 800})
    first = route(router, [a, b], "s-0")[0][0].name
    for i in range(1, 30_000):  # id churn
        route(router, [a, b], f"s-{i}")
    assert len(router._pins) == 1000 and "s-0" not in router._pins
    assert route(router, [a, b], "s-0")[0][0].name == first  # the directory still knows it


def test_directory_memory_does_not_grow_with_session_churn(monkeypatch) -> None:
    """Tens of thousands of sessions opened, used and closed or left to expire leave nothing
    behind: no record, no response index entry, no per-key count."""
    import time
    import tracemalloc

    state = SessionDirectoryState(default_ttl_s=5.0)
    clock = [time.monotonic()]
    monkeypatch.setattr("time.monotonic", lambda: clock[0])

    def churn(n: int, owner: str | None) -> None:
        for i in range(n):
            sid = state.open(None, None, owner)
            state.resolve_pin(sid, "a", ["a"])
            state.store_response(sid, {"id": f"r-{owner}-{i}"}, [], 0, [5, 6, 7], owner)
            if i % 2:
                state.close(sid, owner)
        clock[0] += 6.0  # the other half expires
        state.touch("any")

    churn(20_000, "k1")  # the first wave sizes the tables (dicts keep their peak size)
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    for wave in range(3):  # more waves of the same size: nothing more may stay
        churn(20_000, f"k{wave + 2}")
        churn(20_000, None)
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    grown = sum(d.size_diff for d in after.compare_to(before, "filename"))
    assert state.sessions == {} and state.response_sessions == {} and state.owner_sessions == {}
    # dict tables keep their peak size (a few hundred KB here); a leak of even 20 bytes a
    # session would be 2.4 MB over these 120,000
    assert grown < 2 << 20, f"the directory kept {grown} bytes after 120,000 more sessions"


def test_an_api_key_may_hold_a_bounded_number_of_sessions() -> None:
    from sessionserve.errors import TooManySessionsError

    state = SessionDirectoryState()
    held = [state.open(None, None, "k", owner_limit=2) for _ in range(2)]
    with pytest.raises(TooManySessionsError, match="max_sessions_per_key") as err:
        state.open(None, None, "k", owner_limit=2)
    assert err.value.status_code == 429
    assert state.open(None, None, "other", owner_limit=2)  # per key
    state.close(held[0], "k")
    assert state.open(None, None, "k", owner_limit=2)


def test_a_restarted_directory_rebuilds_everything_from_its_store() -> None:
    """What a killed directory actor comes back with: every open session (owner, pin, token
    log, turns, TTL), every stored response; nothing that was closed, deleted or expired."""
    from sessionserve.directory.store import MemoryStore

    store = MemoryStore()
    state = SessionDirectoryState(default_ttl_s=60.0, store=store)
    kept = state.open("kept", None, "k1")
    state.resolve_pin(kept, "replica-a", ["replica-a"])
    state.commit_turn(kept, 0, [5, 6, 7])
    state.store_response(kept, {"id": "resp-1"}, [{"id": "m1"}], 3, [8], "k1")
    state.store_response(kept, {"id": "resp-2"}, [], 4, [9], "k1")
    state.delete_response("resp-2", "k1")
    gone = state.open("gone", None)
    state.store_response(gone, {"id": "resp-3"}, [], 0, [1], None)
    state.close(gone)
    state.drop_replica("replica-b")  # no effect on kept

    again = SessionDirectoryState(default_ttl_s=60.0, store=store)  # the restarted actor
    assert set(again.sessions) == {"kept"} and again.touch("kept", "k1")
    assert not again.touch("kept", "k2")  # ownership survives
    assert again.get_pin("kept") == "replica-a"
    assert again.log("kept", "k1") == [5, 6, 7, 8, 9] and again.info("kept", "k1")["turns"] == 3
    assert again.get_response("resp-1", "k1")["items"] == [{"id": "m1"}]
    assert again.get_response("resp-2", "k1") is None and again.get_response("resp-3") is None
    assert again.owner_sessions == {"k1": 1}
    assert set(store.data) == {"s/kept", "r/resp-1", *(f"l/kept/{i}" for i in range(3))}


def test_rebalance_plan_moves_a_session_off_a_saturated_replica() -> None:
    from sessionserve.router import pin_cache

    state = SessionDirectoryState()
    router = make_router(FakeDirectoryActor(state))
    a = FakeReplica("rb-a", {"free_kv_tokens": 9000, "queue_len": 0, "ts": 1.0})
    b = FakeReplica("rb-b", {"free_kv_tokens": 10, "queue_len": 0, "ts": 1.0})
    c = FakeReplica("rb-c", {"free_kv_tokens": 5000, "queue_len": 6, "ts": 1.0})
    for sid in ("rb-s1", "rb-s2"):
        assert route(router, [a, b, c], sid) == [[a]]
    assert pin_cache.rebalance_plan("rb-s1", 8) is None  # a is not saturated
    a.routing_stats = {"free_kv_tokens": 100, "queue_len": 8, "ts": 2.0}
    route(router, [a, b, c], "rb-s1")  # the router sees the new stats
    assert pin_cache.rebalance_plan("rb-s1", 8) == ("rb-a", "rb-b")  # c: 6 > 8 // 2
    # one move per report: a second session waits for a fresh report still saying "busy"
    assert pin_cache.rebalance_plan("rb-s2", 8) is None
    a.routing_stats = dict(a.routing_stats, ts=3.0)
    route(router, [a, b, c], "rb-s2")
    assert pin_cache.rebalance_plan("rb-s2", 8) == ("rb-a", "rb-b")
    assert pin_cache.rebalance_plan("rb-unknown", 8) is None  # no pin here: nothing to move
    b.routing_stats = {"free_kv_tokens": 10, "queue_len": 7, "ts": 3.0}
    c.routing_stats = {"free_kv_tokens": 10, "queue_len": 9, "ts": 3.0}
    a.routing_stats = dict(a.routing_stats, ts=4.0)
    route(router, [a, b, c], "rb-s2")
    assert pin_cache.rebalance_plan("rb-s2", 8) is None  # nobody is calm
