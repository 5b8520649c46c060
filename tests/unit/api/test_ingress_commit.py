"""How the ingress records a finished session turn: shielded from client disconnects, and a
turn whose session was closed meanwhile is freed on its replica (not kept, not resurrected).
The ingress's own methods run against a real directory state and a fake replica handle."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from sessionserve.api.ingress import Ingress
from sessionserve.router import pin_cache
from sessionserve.router.directory import SessionDirectoryState
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
    """`commit_turn.remote` waits for `release` before recording (a slow directory call)."""

    def __init__(self, state: SessionDirectoryState) -> None:
        self.state, self.release = state, asyncio.Event()

    @property
    def commit_turn(self) -> SimpleNamespace:
        async def remote(sid: str, ids: list[int]) -> bool:
            await self.release.wait()
            return self.state.commit_turn(sid, ids)

        return SimpleNamespace(remote=remote)


def ingress_with(state: SessionDirectoryState) -> SimpleNamespace:
    fake = SimpleNamespace(replica=FakeReplicaHandle(), directory=SlowDirectory(state))
    fake._kept_or_freed = lambda *a: Ingress._kept_or_freed(fake, *a)
    return fake


def final(ids: list[int]) -> TurnResult:
    return TurnResult("length", None, "", ids[-1:], len(ids) - 1, 1, 0, "none", ids)


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


class DirectoryCalls:
    """The directory's methods as `.remote` coroutines over a real state."""

    def __init__(self, state: SessionDirectoryState) -> None:
        self.state = state

    def __getattr__(self, name: str) -> SimpleNamespace:
        async def remote(*args):
            return getattr(self.state, name)(*args)

        return SimpleNamespace(remote=remote)


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

    assert asyncio.run(session("long-lived")) == ("long-lived", 3600.0)
    assert asyncio.run(session("implicit")) == ("implicit", 30.0)
    assert state.info("implicit")["ttl_s"] == 30.0
    assert asyncio.run(session(None)) == (None, None)
