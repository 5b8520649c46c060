"""How the ingress records a finished session turn: shielded from client disconnects, and a
turn whose session was closed meanwhile is freed on its replica (not kept, not resurrected).
The ingress's own methods run against a real directory state and a fake replica handle."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from sessionserve.api.ingress import Ingress
from sessionserve.errors import SessionLogNeededError, UnknownSessionError
from sessionserve.router import pin_cache
from sessionserve.router.directory import SessionDirectoryState
from sessionserve.router.directory_client import DirectoryClient
from sessionserve.wire import GenerateCall, TurnResult


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


def ingress_with(state: SessionDirectoryState) -> SimpleNamespace:
    fake = SimpleNamespace(replica=FakeReplicaHandle(), directory=SlowDirectory(state))
    fake._kept_or_freed = lambda *a: Ingress._kept_or_freed(fake, *a)
    return fake


def final(ids: list[int]) -> TurnResult:  # a session's first turn: the whole log is new
    return TurnResult("length", None, "", ids[-1:], len(ids) - 1, 1, 0, "none", 0, ids)


def test_a_client_disconnect_during_the_commit_does_not_lose_the_turn() -> None:
    state = SessionDirectoryState()
    sid = state.open("s", None)
    ingress = ingress_with(state)

    async def scenario() -> None:
        call = GenerateCall({}, sid)
        handler = asyncio.create_task(Ingress._commit(ingress, call, final([5, 6, 7])))
        await asyncio.sleep(0.01)  # the commit is waiting on the directory
        handler.cancel()  # the client went away: the request handler is cancelled
        await asyncio.sleep(0.01)
        ingress.directory.release.set()
        await asyncio.sleep(0.01)  # the shielded commit completes on its own

    asyncio.run(scenario())
    assert state.log(sid) == [5, 6, 7] and state.info(sid)["turns"] == 1
    assert ingress.replica.closed == []  # kept: nothing freed


def test_a_turn_of_a_session_closed_meanwhile_is_freed_on_its_replica() -> None:
    state = SessionDirectoryState()
    sid = state.open("s", None)
    state.resolve_pin(sid, "replica-a", ["replica-a"])
    cache = pin_cache.PinCache(10)  # a router's cached pin in this process
    cache.put(sid, "replica-a")
    ingress = ingress_with(state)
    assert state.close(sid) == "replica-a"  # DELETE while the turn ran

    async def scenario() -> None:
        ingress.directory.release.set()
        await Ingress._commit(ingress, GenerateCall({}, sid), final([5, 6, 7]))

    asyncio.run(scenario())
    assert ingress.replica.closed == [sid]  # its KV on the replica is freed
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
    from sessionserve.config import AppConfig

    state = SessionDirectoryState(default_ttl_s=600.0)
    state.open("long-lived", 3600.0)
    sessions = {"default_ttl_s": 30.0, "implicit_open": True}
    cfg = AppConfig.model_validate({"engine": {"sessions": sessions}})
    fake = SimpleNamespace(cfg=cfg, directory=DirectoryCalls(state), model="m")
    fake._check_model = lambda model: None
    fake._open = lambda *a: Ingress._open(fake, *a)
    request = SimpleNamespace(headers={}, state=SimpleNamespace())

    async def session(sid: str):
        return await Ingress._session(fake, request, sid, None)

    assert asyncio.run(session("long-lived")) == {
        "session_id": "long-lived",
        "ttl_s": 3600.0,
        "log_tokens": 0,
    }
    assert asyncio.run(session("implicit"))["ttl_s"] == 30.0
    assert state.info("implicit")["ttl_s"] == 30.0
    assert asyncio.run(session(None)) == {}  # no session fields at all


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
    from sessionserve.config import AppConfig

    state = SessionDirectoryState()
    sid = state.open("s", None, "key-a")
    assert state.commit_turn(sid, 0, [5, 6, 7, 8])
    assert state.touch(sid, "key-a")["log_tokens"] == 4
    replica = LogDemandingReplica()
    fake = SimpleNamespace(cfg=AppConfig(), directory=DirectoryCalls(state), replica=replica)
    fake._session_log = lambda *a: Ingress._session_log(fake, *a)
    call = GenerateCall({}, sid, "append", prompt=[9], log_tokens=4)

    _, first = asyncio.run(Ingress._open_stream(fake, call, "key-a"))
    assert first == "first piece"
    assert [c.history_ids for c in replica.calls] == [None, [5, 6, 7, 8]]

    replica.calls.clear()  # a replica that holds the session is never sent the log
    held = GenerateCall({}, sid, "append", prompt=[9], log_tokens=0)
    asyncio.run(Ingress._open_stream(fake, held, "key-a"))
    assert [c.history_ids for c in replica.calls] == [None]

    state.close(sid, "key-a")  # deleted before the log was read: a 404, not a retry loop
    replica.calls.clear()
    with pytest.raises(UnknownSessionError):
        asyncio.run(Ingress._open_stream(fake, call, "key-a"))
    assert len(replica.calls) == 1


@pytest.mark.parametrize("router", ["session_affinity", "power_of_two"])
def test_without_a_sticky_router_the_log_goes_with_every_append_turn(router) -> None:
    """With Ray's default router (the baseline) most turns land on a replica that does not
    hold the session: asking for the log there would add a round trip to nearly every turn."""
    from sessionserve.api.protocol import CompletionRequest
    from sessionserve.config import AppConfig

    state = SessionDirectoryState()
    sid = state.open("s", None)
    assert state.commit_turn(sid, 0, [5, 6, 7])
    cfg = AppConfig.model_validate({"replica": {"request_router": router}})
    fake = SimpleNamespace(cfg=cfg, directory=DirectoryCalls(state), model="m")
    fake._check_model = lambda model: None
    fake._sampling = lambda body: Ingress._sampling(body)
    fake._session = lambda *a: Ingress._session(fake, *a)
    fake._session_log = lambda *a: Ingress._session_log(fake, *a)
    sent: list[GenerateCall] = []

    async def serve(call, *rest):
        sent.append(call)

    fake._serve = serve
    request = SimpleNamespace(headers={"x-session-id": sid}, state=SimpleNamespace())
    body = CompletionRequest(prompt=[9], max_tokens=2)
    asyncio.run(Ingress.completions(fake, body, request))
    (call,) = sent
    assert call.log_tokens == 3
    assert call.history_ids == (None if router == "session_affinity" else [5, 6, 7])
