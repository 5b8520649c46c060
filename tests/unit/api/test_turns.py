"""How a turn crosses the ingress (`TurnTransport`, `SessionAdmin`: no HTTP in either): the
finished turn is recorded shielded from client disconnects, a turn whose session was closed
meanwhile is freed on its replica (not kept, not resurrected), the token log goes only to a
replica that asks, a moved session's turn is re-routed, and a relayed stream is cancelled when
its client goes away. They run against a real directory state and fake replica handles."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from sessionserve.api.session_admin import SessionAdmin
from sessionserve.api.turns import MOVED_RETRIES, TurnTransport
from sessionserve.config import AppConfig
from sessionserve.directory.client import DirectoryClient
from sessionserve.directory.state import SessionDirectoryState
from sessionserve.errors import SessionLogNeededError, SessionMovedError, UnknownSessionError
from sessionserve.router import pin_cache
from sessionserve.wire import GenerateCall, TurnResult
from tests.unit.api.streams import PieceStream, read


class FakeReplicaHandle:
    def __init__(self) -> None:
        self.closed: list[str] = []

    def options(self, session_id: str | None = None, **_: object) -> SimpleNamespace:
        async def close_session(sid: str) -> bool:
            self.closed.append(sid)
            return True

        return SimpleNamespace(close_session=SimpleNamespace(remote=close_session))


class SlowDirectory:
    """`commit_turn` waits for `release` before recording (a slow directory call)."""

    def __init__(self, state: SessionDirectoryState) -> None:
        self.state, self.release = state, asyncio.Event()

    async def commit_turn(self, sid: str, base: int, tail: list[int]) -> bool:
        await self.release.wait()
        return self.state.commit_turn(sid, base, tail)


def transport_with(state: SessionDirectoryState) -> TurnTransport:
    return TurnTransport(FakeReplicaHandle(), SlowDirectory(state), "ingress-1")


def final(ids: list[int]) -> TurnResult:  # a session's first turn: the whole log is new
    return TurnResult("length", None, "", ids[-1:], len(ids) - 1, 1, 0, "none", 0, ids)


def test_a_client_disconnect_during_the_commit_does_not_lose_the_turn() -> None:
    state = SessionDirectoryState()
    sid = state.open("s", None)
    turns = transport_with(state)

    async def scenario() -> None:
        call = GenerateCall({}, sid)
        handler = asyncio.create_task(turns.commit(call, final([5, 6, 7])))
        await asyncio.sleep(0.01)  # the commit is waiting on the directory
        handler.cancel()  # the client went away: the request handler is cancelled
        await asyncio.sleep(0.01)
        turns.directory.release.set()
        await asyncio.sleep(0.01)  # the shielded commit completes on its own

    asyncio.run(scenario())
    assert state.log(sid) == [5, 6, 7] and state.info(sid)["turns"] == 1
    assert turns.replica.closed == []  # kept: nothing freed


def test_a_turn_of_a_session_closed_meanwhile_is_freed_on_its_replica() -> None:
    state = SessionDirectoryState()
    sid = state.open("s", None)
    state.resolve_pin(sid, "replica-a", ["replica-a"])
    cache = pin_cache.PinCache(10)  # a router's cached pin in this process
    cache.put(sid, "replica-a")
    turns = transport_with(state)
    assert state.close(sid) == "replica-a"  # DELETE while the turn ran

    async def scenario() -> None:
        turns.directory.release.set()
        await turns.commit(GenerateCall({}, sid), final([5, 6, 7]))

    asyncio.run(scenario())
    assert turns.replica.closed == [sid]  # its KV on the replica is freed
    assert sid not in cache and state.sessions == {}  # nothing brings it back


class StateActor:
    """A directory actor in this process: `method.remote(...)` runs on a real state."""

    def __init__(self, state: SessionDirectoryState) -> None:
        self.state = state

    def __getattr__(self, name: str) -> SimpleNamespace:
        async def remote(*args):
            return getattr(self.state, name)(*args)

        return SimpleNamespace(remote=remote)


def DirectoryCalls(state: SessionDirectoryState) -> DirectoryClient:  # noqa: N802
    """The real directory client over a state in this process."""
    return DirectoryClient("test", actors=[StateActor(state)])


def test_a_turn_carries_its_sessions_ttl_to_the_replica() -> None:
    """A TTL given at `POST /v1/sessions` goes with every turn (GenerateCall.ttl_s), so a
    replica that opens the session applies it, not its own default; an implicitly opened
    session gets this deployment's default."""
    state = SessionDirectoryState(default_ttl_s=600.0)
    state.open("long-lived", 3600.0)
    sessions = {"default_ttl_s": 30.0, "implicit_open": True}
    cfg = AppConfig.model_validate({"engine": {"sessions": sessions}})
    admin = SessionAdmin(TurnTransport(FakeReplicaHandle(), DirectoryCalls(state), "i"), cfg)

    def fields(sid: str | None, header: str | None = None):
        return asyncio.run(admin.turn_fields(header, sid, None))

    assert fields("long-lived") == {"session_id": "long-lived", "ttl_s": 3600.0, "log_tokens": 0}
    assert fields("implicit")["ttl_s"] == 30.0
    assert state.info("implicit")["ttl_s"] == 30.0
    assert fields(None) == {}  # no session fields at all
    assert fields("body-id", header="long-lived")["session_id"] == "long-lived"  # header wins


def test_an_unknown_session_is_a_404_without_implicit_open() -> None:
    state = SessionDirectoryState()
    cfg = AppConfig.model_validate({"engine": {"sessions": {"implicit_open": False}}})
    admin = SessionAdmin(TurnTransport(FakeReplicaHandle(), DirectoryCalls(state), "i"), cfg)
    with pytest.raises(UnknownSessionError):
        asyncio.run(admin.turn_fields(None, "nobody", None))
    assert state.sessions == {}  # nothing opened


class FakeStream:
    def __init__(self, error: Exception | None, piece: object) -> None:
        self.error, self.piece = error, piece

    async def __anext__(self) -> object:
        if self.error is not None:
            raise self.error
        return self.piece


class LogDemandingReplica:
    """Answers like a replica that does not hold the session: an append turn without the
    token log is refused (SessionLogNeededError) until it comes with it."""

    def __init__(self) -> None:
        self.calls: list[GenerateCall] = []

    def options(self, **_: object) -> SimpleNamespace:
        def remote(call: GenerateCall) -> FakeStream:
            self.calls.append(call)
            if call.log_tokens and call.history_ids is None:
                return FakeStream(SessionLogNeededError(call.session_id), None)
            return FakeStream(None, "first piece")

        return SimpleNamespace(generate=SimpleNamespace(remote=remote))


def test_an_append_turn_ships_the_token_log_only_to_a_replica_that_asks() -> None:
    """Every append turn carries the log's length, not the log (one directory call fewer and
    no O(history) transfer per turn); a replica lacking the session asks for the log, and the
    ingress resends the turn with it, read under the caller's key."""
    state = SessionDirectoryState()
    sid = state.open("s", None, "key-a")
    assert state.commit_turn(sid, 0, [5, 6, 7, 8])
    assert state.touch(sid, "key-a")["log_tokens"] == 4
    replica = LogDemandingReplica()
    turns = TurnTransport(replica, DirectoryCalls(state), "i", caller="SERVE_REPLICA::app#I#i")
    call = GenerateCall({}, sid, "append", prompt=[9], log_tokens=4)

    _, first = asyncio.run(turns.open(call, "key-a"))
    assert first == "first piece"
    assert [c.history_ids for c in replica.calls] == [None, [5, 6, 7, 8]]
    # each call names this ingress, so a replica can abort it if this process dies
    assert {c.caller for c in replica.calls} == {"SERVE_REPLICA::app#I#i"}

    replica.calls.clear()  # a replica that holds the session is never sent the log
    held = GenerateCall({}, sid, "append", prompt=[9], log_tokens=0)
    asyncio.run(turns.open(held, "key-a"))
    assert [c.history_ids for c in replica.calls] == [None]

    state.close(sid, "key-a")  # deleted before the log was read: a 404, not a retry loop
    replica.calls.clear()
    with pytest.raises(UnknownSessionError):
        asyncio.run(turns.open(call, "key-a"))
    assert len(replica.calls) == 1


class MovingReplica:
    """Answers SessionMovedError for the first `moves` calls (the session left each replica
    the turn reached), then the first piece."""

    def __init__(self, moves: int) -> None:
        self.moves, self.calls = moves, 0

    def options(self, **_: object) -> SimpleNamespace:
        def remote(call: GenerateCall) -> FakeStream:
            self.calls += 1
            if self.calls <= self.moves:
                return FakeStream(SessionMovedError(call.session_id), None)
            return FakeStream(None, "first piece")

        return SimpleNamespace(generate=SimpleNamespace(remote=remote))


def test_a_turn_follows_its_moved_session_a_bounded_number_of_times() -> None:
    state = SessionDirectoryState()
    sid = state.open("s", None)
    cache = pin_cache.PinCache(10)
    cache.put(sid, "replica-a")
    replica = MovingReplica(moves=MOVED_RETRIES)
    turns = TurnTransport(replica, DirectoryCalls(state), "i")
    _, first = asyncio.run(turns.open(GenerateCall({}, sid)))
    assert first == "first piece" and replica.calls == MOVED_RETRIES + 1
    assert sid not in cache  # the stale pin was dropped: the router asks the directory again

    replica = MovingReplica(moves=MOVED_RETRIES + 1)  # still moving: the error reaches the client
    with pytest.raises(SessionMovedError):
        asyncio.run(TurnTransport(replica, DirectoryCalls(state), "i").open(GenerateCall({}, sid)))
    assert replica.calls == MOVED_RETRIES + 1


def relayed(stream: PieceStream, take: int | None = None) -> list[str]:
    """The chunks a client reads from `TurnTransport.relay` (all, or the first `take`)."""
    first = asyncio.run(stream.__anext__())

    async def finish(result: TurnResult) -> list[str]:
        return [f"end:{result.finish_reason}"]

    async def fail(body: dict) -> list[str]:
        return [f"error:{body['error']['type']}"]

    chunks = TurnTransport.relay(stream, first, ["open"], lambda d: d.text, finish, fail)
    return asyncio.run(read(chunks, take))


def test_relay_streams_deltas_then_the_end_and_cancels_on_disconnect() -> None:
    from sessionserve.wire import TurnDelta

    def pieces() -> list[object]:
        return [TurnDelta([1], "a", [], []), TurnDelta([2], "b", [], []), final([1, 2])]

    whole = PieceStream(pieces())
    assert relayed(whole) == ["open", "a", "b", "end:length"] and not whole.cancelled
    cut = PieceStream(pieces())
    assert relayed(cut, take=2) == ["open", "a"] and cut.cancelled  # the replica aborts it
    broken = PieceStream([TurnDelta([1], "a", [], []), UnknownSessionError("s")])
    assert relayed(broken) == ["open", "a", "error:not_found_error"]  # told in-band
    assert not broken.cancelled


@pytest.mark.parametrize("router", ["session_affinity", "power_of_two"])
def test_without_a_sticky_router_the_log_goes_with_every_append_turn(router) -> None:
    """With Ray's default router (the baseline) most turns land on a replica that does not
    hold the session: asking for the log there would add a round trip to nearly every turn."""
    from sessionserve.api.ingress import Ingress
    from sessionserve.api.protocol import CompletionRequest

    state = SessionDirectoryState()
    sid = state.open("s", None)
    assert state.commit_turn(sid, 0, [5, 6, 7])
    cfg = AppConfig.model_validate({"replica": {"request_router": router}})
    routes = Ingress.__mro__[1]  # the class serve.ingress wrapped: its routes, no Serve
    ingress = object.__new__(routes)
    ingress.cfg, ingress.model = cfg, "m"
    ingress.turns = TurnTransport(FakeReplicaHandle(), DirectoryCalls(state), "i")
    ingress.sessions = SessionAdmin(ingress.turns, cfg)
    sent: list[GenerateCall] = []

    async def answer(call, *rest):
        sent.append(call)

    ingress._answer = answer
    request = SimpleNamespace(headers={"x-session-id": sid}, state=SimpleNamespace())
    body = CompletionRequest(prompt=[9], max_tokens=2)
    asyncio.run(ingress.completions(body, request))
    (call,) = sent
    assert call.log_tokens == 3
    assert call.history_ids == (None if router == "session_affinity" else [5, 6, 7])
