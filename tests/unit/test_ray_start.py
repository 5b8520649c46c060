"""The suite's one retry of a Ray start (tests/ray_start.py `once_more_on_startup_timeout`),
which the in-process node, `serve run` and the two-node scenario share. A real missed startup
wait is rare (one CI run in many), so its path is checked here with starts that fail on cue."""

from __future__ import annotations

import pytest

from tests.ray_start import STARTUP_TIMEOUT, once_more_on_startup_timeout


def starts(*failures: str | None):
    """A start that returns its call number and the next of `failures`; and its calls."""
    calls: list[int] = []

    def start() -> tuple[int, str | None]:
        calls.append(len(calls) + 1)
        return calls[-1], failures[len(calls) - 1]

    return start, calls


def test_a_start_that_missed_ray_s_startup_wait_is_made_once_more() -> None:
    start, calls = starts(f"raylet {STARTUP_TIMEOUT} after 30 s", None)
    with pytest.warns(UserWarning, match="serve run.*did not start its Ray node; again"):
        assert once_more_on_startup_timeout(start, "`serve run`") == (2, None)
    assert calls == [1, 2]


def test_the_warning_carries_the_failure_s_tail() -> None:
    start, _ = starts("head of the log " + STARTUP_TIMEOUT + " end of the log", None)
    with pytest.warns(UserWarning) as warned:
        once_more_on_startup_timeout(start, "x", shown=len("end of the log"))
    assert str(warned[0].message).endswith("again: end of the log")
    start, _ = starts("head of the log " + STARTUP_TIMEOUT, None)
    with pytest.warns(UserWarning) as warned:
        once_more_on_startup_timeout(start, "x", shown=None)
    assert str(warned[0].message).endswith("again: head of the log " + STARTUP_TIMEOUT)


def test_other_failures_and_successes_are_returned_at_once() -> None:
    start, calls = starts("Traceback: ValueError: bad config")
    assert once_more_on_startup_timeout(start, "x") == (1, "Traceback: ValueError: bad config")
    start, calls = starts(None)
    assert once_more_on_startup_timeout(start, "x") == (1, None)
    assert calls == [1]


def test_the_last_attempt_s_failure_is_returned() -> None:
    start, calls = starts(*[STARTUP_TIMEOUT] * 3)
    with pytest.warns(UserWarning):
        result, failure = once_more_on_startup_timeout(start, "x", attempts=3)
    assert (result, failure, calls) == (3, STARTUP_TIMEOUT, [1, 2, 3])
