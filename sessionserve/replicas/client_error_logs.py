"""A replica's log under Serve: client errors as one INFO line, not an ERROR traceback
(`install`), and sessionserve's own INFO lines shown beside Serve's (`show_our_logs`).

Ray Serve logs every exception a replica method raises with `logger.exception("Request
failed.")`. For our typed 4xx errors (context too long, a session busy or unknown, bad
input) that is noise that buries real failures: the caller already gets a clear 4xx. So are
the signals the ingress answers by re-sending the turn (a session that moved, a token log a
replica asks for). The filter rewrites those records in place; other 5xx and foreign
exceptions keep their traceback.
"""

from __future__ import annotations

import logging

from sessionserve.errors import SessionServeError, unwrap

RAY_SERVE_LOGGER = "ray.serve"


class ClientErrorsAsInfo(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        err = unwrap(exc) if exc is not None else None
        if isinstance(err, SessionServeError) and (err.status_code < 500 or err.retried_by_ingress):
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.msg = "request refused (%d %s): %s"
            record.args = (err.status_code, type(err).__name__, err)
            record.exc_info, record.exc_text = None, None
        return True


def show_our_logs() -> None:
    """Send the `sessionserve` loggers' INFO lines (a compiled forward's build progress, the
    attention backend chosen) to the handlers Serve gave `ray.serve` in this process: the
    replica's log file and the console of `serve run`. Without it Python drops them (no
    handler below WARNING). A no-op outside Serve (no such handlers) and when done already."""
    ours, serve = logging.getLogger("sessionserve"), logging.getLogger(RAY_SERVE_LOGGER)
    if ours.handlers or not serve.handlers:
        return
    ours.setLevel(logging.INFO)
    for handler in serve.handlers:
        ours.addHandler(handler)
    ours.propagate = False


def install() -> None:
    """Once per process (idempotent)."""
    logger = logging.getLogger(RAY_SERVE_LOGGER)
    if not any(isinstance(f, ClientErrorsAsInfo) for f in logger.filters):
        logger.addFilter(ClientErrorsAsInfo())
