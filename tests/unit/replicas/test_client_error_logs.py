"""A replica's client errors (4xx) are logged by Ray Serve's logger as one INFO line; real
failures keep their ERROR level and traceback."""

from __future__ import annotations

import logging

import pytest

from sessionserve.errors import (
    ContextTooLongError,
    EngineUnavailableError,
    SessionLogNeededError,
    SessionMovedError,
)
from sessionserve.replicas import client_error_logs


class WrappedLikeRay(Exception):
    """Ray's RayTaskError carries the original exception as `cause`."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__("Traceback (most recent call last): ...")
        self.cause = cause


def log_failure(exc: BaseException) -> None:
    try:
        raise exc
    except Exception:
        logging.getLogger(client_error_logs.RAY_SERVE_LOGGER).exception("Request failed.")


@pytest.mark.parametrize("wrap", [False, True])
def test_a_client_error_is_one_info_line(caplog, wrap) -> None:
    client_error_logs.install()
    client_error_logs.install()  # idempotent
    serve_logger = logging.getLogger(client_error_logs.RAY_SERVE_LOGGER)
    assert (
        sum(isinstance(f, client_error_logs.ClientErrorsAsInfo) for f in serve_logger.filters) == 1
    )
    err = ContextTooLongError("the request needs 9000 tokens; the limit is 4096", "max_tokens")
    with caplog.at_level(logging.INFO, logger=client_error_logs.RAY_SERVE_LOGGER):
        log_failure(WrappedLikeRay(err) if wrap else err)
        log_failure(RuntimeError("a real bug"))
    refused, failed = caplog.records
    assert refused.levelno == logging.INFO and refused.exc_info is None
    assert refused.getMessage() == (
        "request refused (400 ContextTooLongError): the request needs 9000 tokens; the limit "
        "is 4096"
    )
    assert "Traceback" not in caplog.handler.format(refused)
    assert failed.levelno == logging.ERROR and failed.exc_info is not None


def test_a_signal_the_ingress_retries_is_one_info_line_too(caplog) -> None:
    """Every failover or migration raises one of these on a replica: expected, not a bug."""
    client_error_logs.install()
    with caplog.at_level(logging.INFO, logger=client_error_logs.RAY_SERVE_LOGGER):
        log_failure(WrappedLikeRay(SessionLogNeededError("s1")))
        log_failure(SessionMovedError("s2"))
        log_failure(EngineUnavailableError("the engine died"))  # a 503 that is not a signal
    log_needed, moved, died = caplog.records
    assert log_needed.levelno == moved.levelno == logging.INFO
    assert log_needed.getMessage().startswith("request refused (503 SessionLogNeededError)")
    assert died.levelno == logging.ERROR and died.exc_info is not None


def test_our_info_lines_reach_serves_handlers_once_and_only_under_serve() -> None:
    ours, serve = logging.getLogger("sessionserve"), logging.getLogger("ray.serve")
    saved = (ours.handlers[:], ours.level, ours.propagate, serve.handlers[:])
    seen: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    try:
        ours.handlers, serve.handlers = [], []
        client_error_logs.show_our_logs()  # outside Serve: nothing to attach to
        assert ours.handlers == []
        serve.handlers = [Collect()]
        client_error_logs.show_our_logs()
        client_error_logs.show_our_logs()  # idempotent: one line, not two
        logging.getLogger("sessionserve.replicas.compiled_forward").info("compile: loaded x")
        assert seen == ["compile: loaded x"]
    finally:
        ours.handlers, _, ours.propagate, serve.handlers = saved
        ours.setLevel(saved[1])  # clears the loggers' cached levels too
