"""Bad input: typed errors that name what to change, no KV leaked, the engine keeps serving."""

from __future__ import annotations

import pytest

from sessionserve.errors import (
    ContextTooLongError,
    InvalidRequestError,
    SessionBusyError,
    UnknownSessionError,
)
from sessionserve.wire import SamplingParams
from tests.conftest import DEGENERATE_SAMPLING
from tests.models import tiny_engine, tiny_model

OK = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine():
    return tiny_engine(tiny_model(), implicit_open=False, max_context_len=128)


def _still_serving(engine) -> None:
    engine.run_until_idle()
    engine.checker.check_idle()
    assert engine.generate([[3, 4, 5]], OK)[0].completion_tokens == 4


def test_empty_prompt(engine) -> None:
    with pytest.raises(InvalidRequestError, match="prompt is empty") as e:
        engine.submit([], OK)
    assert e.value.param == "prompt" and e.value.status_code == 400
    _still_serving(engine)


def test_token_outside_vocabulary(engine) -> None:
    with pytest.raises(InvalidRequestError, match=r"outside the vocabulary \[0, 256\)"):
        engine.submit([3, 999], OK)
    _still_serving(engine)


def test_prompt_longer_than_context(engine) -> None:
    with pytest.raises(ContextTooLongError, match="maximum context length is 128 tokens"):
        engine.submit(list(range(3, 130)), OK)
    with pytest.raises(ContextTooLongError, match="max_tokens 100") as e:
        engine.submit(list(range(3, 40)), OK.model_copy(update={"max_tokens": 100}))
    assert e.value.param == "max_tokens"
    _still_serving(engine)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -1.0),
        ("top_p", 0.0),
        ("max_tokens", 0),
        ("top_k", -3),
        ("min_p", 1.5),
        ("top_logprobs", 50),
        ("bogus", 1),
    ],
)
def test_invalid_sampling_values_name_the_field(field: str, value: object) -> None:
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams.build(**{field: value})
    assert e.value.param == field and field in str(e.value)


def test_unknown_session_and_busy_session(engine) -> None:
    with pytest.raises(UnknownSessionError, match="'ghost' does not exist") as e:
        engine.submit([3, 4], OK, session_id="ghost")
    assert e.value.status_code == 404
    sid = engine.open_session("real")
    rid = engine.submit([3, 4, 5], OK.model_copy(update={"max_tokens": 30}), session_id=sid)
    engine.step()
    with pytest.raises(SessionBusyError, match="already has a turn in flight") as busy:
        engine.submit([6], OK, session_id=sid)
    assert busy.value.status_code == 409
    engine.run_until_idle()
    first = engine.take_result(rid)
    assert first.completion_tokens == 30  # the running turn was not disturbed
    (nxt,) = engine.generate([[7]], OK, session_id=sid)
    assert nxt.cached_tokens == 3 + 30 - 1
    assert engine.close_session(sid)
    with pytest.raises(UnknownSessionError):
        engine.close_session(sid)
    _still_serving(engine)


def test_duplicate_request_id_and_unknown_abort(engine) -> None:
    engine.submit([3, 4], OK, rid="dup")
    with pytest.raises(InvalidRequestError, match="'dup' is already in use"):
        engine.submit([3, 4], OK, rid="dup")
    assert engine.abort("nope") is False
    engine.run_until_idle()
    engine.take_result("dup")
    _still_serving(engine)


@pytest.mark.parametrize(("field", "value"), DEGENERATE_SAMPLING)
def test_degenerate_sampling_values_are_refused_by_name(field, value) -> None:
    """Values that underflow to NaN probabilities (or overflow the 64-bit seed)."""
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams.build(**{field: value})
    assert e.value.param == field
    for edge in (2**64 - 1, -(2**63)):  # the whole 64-bit range is fine
        assert SamplingParams.build(seed=edge).seed == edge


def test_a_turn_that_fails_while_queued_leaves_its_session_usable(engine) -> None:
    """Anything failing in submit after the turn started (here an unchecked seed) ends the
    turn: no slot stays busy, no KV leaks."""
    sid = engine.open_session()
    bad = SamplingParams.model_construct(**(OK.model_dump() | {"seed": 2**64}))
    with pytest.raises(ValueError):
        engine.submit([3, 4, 5], bad, session_id=sid)
    engine.checker.check_idle()
    (r,) = engine.generate([[3, 4, 5]], OK, session_id=sid)  # not "busy"
    assert r.completion_tokens == 4
    engine.close_session(sid)
    _still_serving(engine)
