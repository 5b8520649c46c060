"""`ingress.colocated` without Ray: the config's rules, the one deployment's Serve options, and
`LocalReplica`, the handle-shaped bridge from the ingress's `TurnTransport` to a replica in the
same process (admission limits, a closed stream's turn and slot, errors as the replica raised
them). The app itself runs in Serve in tests/integration/test_colocated.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from pydantic import ValidationError
from ray.serve.exceptions import BackPressureError

from sessionserve.app import colocated_app
from sessionserve.colocated import Admission, LocalReplica
from sessionserve.config import REPLICA_ENV_DEFAULTS, AppConfig
from sessionserve.errors import InvalidRequestError, UnknownReplicaError
from sessionserve.router.pin_cache import forget_pin
from sessionserve.wire import TurnResult

ONE = {"replica": {"num_replicas": 1}, "ingress": {"colocated": True}}


def test_colocated_needs_one_replica_and_says_what_to_set() -> None:
    AppConfig.model_validate(ONE)
    for args, fragment in [
        ({"ingress": {"colocated": True}}, "replica.num_replicas: 1 (now 2)"),
        (
            {"replica": {"num_replicas": 1}, "ingress": {"colocated": True, "num_replicas": 2}},
            "ingress.num_replicas: 1 (now 2)",
        ),
        (
            {
                "replica": {"num_replicas": 1, "autoscaling": {"max_replicas": 3}},
                "ingress": {"colocated": True},
            },
            "replica.autoscaling: null",
        ),
    ]:
        with pytest.raises(ValidationError, match="ingress.colocated") as e:
            AppConfig.model_validate(args)
        assert fragment in str(e.value)


def test_one_deployment_with_the_replicas_resources_and_the_ingress_request_limit() -> None:
    args = {
        "replica": {"num_replicas": 1, "num_cpus": 1.5, "env_vars": {"X": "1"}},
        "ingress": {"colocated": True, "max_ongoing_requests": 300},
    }
    deployment = colocated_app(AppConfig.model_validate(args))._bound_deployment
    assert deployment.name == "SessionReplica"
    assert deployment.num_replicas == 1 and deployment.max_ongoing_requests == 300
    actor = deployment.ray_actor_options
    assert actor["num_cpus"] == 1.5
    assert actor["runtime_env"]["env_vars"] == REPLICA_ENV_DEFAULTS | {"X": "1"}


class FakeServer:
    """A replica's methods as the ingress calls them."""

    replica_id = "r1"

    def __init__(self) -> None:
        self.closed: list[str] = []
        self.release = asyncio.Event()

    async def generate(self, call: str) -> AsyncIterator[str | TurnResult]:
        try:
            if call == "bad":
                raise InvalidRequestError("bad input", param="prompt")
            yield f"{call}:first"
            await self.release.wait()
            yield f"{call}:last"
            if call == "final":
                yield TurnResult("stop", None, "", [], 1, 1, 0, "none", 0, [])
                yield "never read"
        finally:
            self.closed.append(call)

    async def model_limits(self) -> dict[str, int]:
        return {"context_limit": 7}


def test_turns_past_the_limits_wait_then_are_refused_as_serve_refuses_them() -> None:
    async def scenario() -> None:
        server = FakeServer()
        replica = LocalReplica(server, Admission(max_ongoing=1, max_queued=1), None)
        first = replica.options(stream=True, session_id="s").generate.remote("a")
        assert await first.__anext__() == "a:first"
        queued = replica.options(stream=True).generate.remote("b")
        waiting = asyncio.ensure_future(queued.__anext__())
        await asyncio.sleep(0)
        assert not waiting.done()  # the one slot is taken: it waits
        refused = replica.options(stream=True).generate.remote("c")
        with pytest.raises(BackPressureError):
            await refused.__anext__()
        server.release.set()
        assert await first.__anext__() == "a:last"
        with pytest.raises(StopAsyncIteration):
            await first.__anext__()
        assert await waiting == "b:first"  # the finished turn's slot went to the waiting one

    asyncio.run(scenario())


def test_a_cancelled_stream_closes_the_turn_and_frees_its_slot() -> None:
    async def scenario() -> None:
        server = FakeServer()
        replica = LocalReplica(server, Admission(max_ongoing=1, max_queued=0), None)
        stream = replica.options(stream=True).generate.remote("a")
        assert await stream.__anext__() == "a:first"
        stream.cancel()
        for _ in range(10):
            await asyncio.sleep(0)
        assert server.closed == ["a"]
        again = replica.options(stream=True).generate.remote("b")
        assert await again.__anext__() == "b:first"  # not refused: the slot came back

    asyncio.run(scenario())


def test_a_turns_slot_is_free_once_its_final_record_comes() -> None:
    """The ingress reads a turn up to its final record and no further: the slot (and the
    replica's generator, whose end Serve would drive) must not wait for the stream's GC."""

    async def scenario() -> None:
        server = FakeServer()
        server.release.set()
        replica = LocalReplica(server, Admission(max_ongoing=1, max_queued=0), None)
        stream = replica.options(stream=True).generate.remote("final")
        pieces = [await stream.__anext__() for _ in range(3)]
        assert isinstance(pieces[-1], TurnResult)
        assert server.closed == ["final"]  # the replica's generator ran its cleanup
        nxt = replica.options(stream=True).generate.remote("b")
        assert await nxt.__anext__() == "b:first"  # not refused while `stream` lives on

    asyncio.run(scenario())


def test_errors_come_as_raised_and_migration_is_refused() -> None:
    async def scenario() -> None:
        server = FakeServer()
        replica = LocalReplica(server, Admission(max_ongoing=1, max_queued=0), None)
        with pytest.raises(InvalidRequestError, match="bad input"):
            await replica.options(stream=True).generate.remote("bad").__anext__()
        assert server.closed == ["bad"]
        assert await replica.model_limits.remote() == {"context_limit": 7}
        with pytest.raises(UnknownReplicaError, match="ingress.colocated"):
            await replica.migrate_session.remote("s", None, replica="r")
        ok = replica.options(stream=True).generate.remote("a")  # the failed turn's slot is free
        assert await ok.__anext__() == "a:first"

    asyncio.run(scenario())


class FakeDirectory:
    def __init__(self) -> None:
        self.asked: list[tuple[str, str, list[str]]] = []

    async def resolve_pin(self, sid: str, choice: str, alive: list[str]) -> tuple[str, None]:
        self.asked.append((sid, choice, alive))
        return choice, None


def test_sessions_are_pinned_here_in_the_directory_once_as_a_router_pins_them() -> None:
    async def scenario() -> None:
        server, directory = FakeServer(), FakeDirectory()
        server.release.set()
        replica = LocalReplica(server, Admission(max_ongoing=4, max_queued=0), directory)
        for _ in range(2):
            stream = replica.options(stream=True, session_id="s").generate.remote("a")
            assert await stream.__anext__() == "a:first"
        assert await replica.options(session_id="s").model_limits.remote() == {"context_limit": 7}
        assert directory.asked == [("s", "r1", ["r1"])]  # cached after the first
        await replica.options(stream=True).generate.remote("b").__anext__()  # no session
        forget_pin("s")  # what the ingress does when a session is closed
        await replica.options(stream=True, session_id="s").generate.remote("c").__anext__()
        assert len(directory.asked) == 2

    asyncio.run(scenario())
