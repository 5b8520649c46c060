"""`n` > 1 (api/choices.py, no HTTP): each choice a turn of its own with its own seed, their
deltas relayed as they come under their choice's index, one usage for all; a choice that
fails ends the others, a client that goes away cancels every running choice, and a session
turn takes one choice. Against fake replica streams."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from sessionserve.api.chat_replies import Reply
from sessionserve.api.choices import (
    check_choices,
    choice_calls,
    open_choices,
    relay_choices,
)
from sessionserve.errors import InvalidRequestError, KVCacheFullError
from sessionserve.wire import SEED_RANGE, GenerateCall, TurnDelta, TurnResult
from tests.unit.api.streams import PieceStream, read


def final(tokens: int, prompt: int = 7) -> TurnResult:
    return TurnResult("length", None, "", list(range(tokens)), prompt, tokens, 3, "radix", 0, [])


def answer(words: list[str], delay: float = 0.0) -> PieceStream:
    deltas = [TurnDelta([i], w) for i, w in enumerate(words)]
    return PieceStream([*deltas, final(len(words))], delay)


def events(chunks: list[str]) -> list[Any]:
    return [json.loads(c.removeprefix("data: ")) if "[DONE]" not in c else "DONE" for c in chunks]


async def relayed(opened, include_usage=True, stop_after: int | None = None) -> list[str]:
    gen = relay_choices(opened, Reply("chat", "m", False), lambda f: f, include_usage)
    return await read(gen, stop_after)


def test_each_choice_samples_with_its_own_seed_and_a_session_takes_one() -> None:
    call = GenerateCall({"temperature": 1.0, "seed": SEED_RANGE[1] - 1})
    seeds = [c.sampling.seed for c in choice_calls(call, 3)]
    assert seeds == [SEED_RANGE[1] - 1, SEED_RANGE[1], SEED_RANGE[0]]  # wrapped, all distinct
    unseeded = choice_calls(GenerateCall({"temperature": 1.0}), 2)
    assert [c.sampling.seed for c in unseeded] == [None, None]
    check_choices(1, session_named=True)
    check_choices(4, session_named=False)
    with pytest.raises(InvalidRequestError) as err:
        check_choices(2, session_named=True)
    assert err.value.param == "n" and err.value.status_code == 400


def test_choices_stream_under_their_index_and_share_one_usage() -> None:
    opened = [
        (s := answer(["a", "b", "c"], 0.002), asyncio.run(s.__anext__())),
        (t := answer(["x", "y"], 0.003), asyncio.run(t.__anext__())),
    ]
    got = events(asyncio.run(relayed(opened)))
    assert got[-1] == "DONE" and got[0]["choices"][0]["delta"]["role"] == "assistant"
    text: dict[int, str] = {0: "", 1: ""}
    finishes = []
    for e in got[:-2]:
        for c in e["choices"]:
            text[c["index"]] += c["delta"].get("content") or ""
            if c["finish_reason"]:
                finishes.append(c["index"])
    assert text == {0: "abc", 1: "xy"} and sorted(finishes) == [0, 1]
    last = got[-2]
    assert last["choices"] == [] and last["session"]["cached_source"] == "radix"
    assert last["usage"]["prompt_tokens"] == 7  # the prompt once
    assert last["usage"]["completion_tokens"] == 5 == last["usage"]["total_tokens"] - 7
    assert len({e["id"] for e in got[:-1]}) == 1
    assert not any(s.cancelled for s, _ in opened)


def test_a_failing_choice_ends_the_others_and_a_gone_client_cancels_all() -> None:
    bad = PieceStream([TurnDelta([1], "p"), RuntimeError("replica died")], 0.001)
    slow = answer(["q"] * 50, 0.01)
    opened = [(bad, TurnDelta([0], "o")), (slow, TurnDelta([0], "s"))]
    got = events(asyncio.run(relayed(opened)))
    assert got[-1] == "DONE" and got[-2]["error"]["type"]
    assert slow.cancelled and not any("usage" in e for e in got[:-1])

    a, b = answer(["u"] * 50, 0.01), answer(["v"] * 50, 0.01)
    asyncio.run(relayed([(a, TurnDelta([0], "")), (b, TurnDelta([0], ""))], stop_after=4))
    assert a.cancelled and b.cancelled


def test_a_whole_answer_whose_choice_fails_cancels_the_others() -> None:
    from sessionserve.api.choices import collect_choices
    from sessionserve.api.turns import TurnTransport

    bad = PieceStream([TurnDelta([1], "p"), RuntimeError("replica died")], 0.001)
    slow = answer(["q"] * 50, 0.01)
    with pytest.raises(RuntimeError, match="replica died"):
        asyncio.run(
            collect_choices(TurnTransport, [(bad, TurnDelta([0], "")), (slow, TurnDelta([0], ""))])
        )
    assert slow.cancelled


def test_a_choice_that_cannot_start_cancels_the_started_ones() -> None:
    started: list[PieceStream] = []

    class Turns:
        async def open(self, call: GenerateCall, owner: str | None):
            if call.sampling.seed == 12:
                raise KVCacheFullError("no KV left")
            stream = answer(["w"])
            started.append(stream)
            return stream, await stream.__anext__()

    calls = choice_calls(GenerateCall({"temperature": 1.0, "seed": 10}), 3)
    with pytest.raises(KVCacheFullError):
        asyncio.run(open_choices(Turns(), calls, None))
    assert len(started) == 2 and all(s.cancelled for s in started)


def test_each_choice_calls_the_replicas_under_a_request_id_of_its_own() -> None:
    """Serve's router places a request's pending calls by their internal request id, which a
    call inherits from the request it is made in: choices opened at once under one id were
    not all placed (they waited for ever). `own_request` gives each its own, and keeps the
    rest of the request's context (its route, its public request id)."""
    from ray.serve import context as serve_context

    from sessionserve.api.turns import own_request

    async def seen() -> Any:
        return serve_context._get_serve_request_context()

    async def scenario() -> list[Any]:
        serve_context._set_request_context(
            route="/v1/chat/completions", request_id="r1", _internal_request_id="internal-1"
        )
        return await asyncio.gather(*(own_request(seen()) for _ in range(3)))

    contexts = asyncio.run(scenario())
    ids = {c._internal_request_id for c in contexts}
    assert len(ids) == 3 and "internal-1" not in ids
    assert {(c.route, c.request_id) for c in contexts} == {("/v1/chat/completions", "r1")}
