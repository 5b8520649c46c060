"""OpenAI-style error bodies, and the mapping from our typed errors to HTTP statuses.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens",
               "code": null}}
Bad input is always a 4xx naming the field; a 500 means a bug on our side.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from sessionserve.errors import SessionServeError

log = logging.getLogger(__name__)
RETRY_AFTER_S = "1"


def error_body(
    message: str, type_: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(
    status: int, message: str, type_: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    headers = {"Retry-After": RETRY_AFTER_S} if status in (429, 503) else None
    return JSONResponse(
        error_body(message, type_, param, code), status_code=status, headers=headers
    )


def unwrap(exc: BaseException) -> BaseException:
    """Ray wraps a replica's exception (RayTaskError); the original is its `cause`."""
    seen = 0
    while seen < 5 and not isinstance(exc, SessionServeError):
        cause = getattr(exc, "cause", None) or exc.__cause__
        if cause is None:
            break
        exc, seen = cause, seen + 1
    return exc


def response_for(exc: BaseException) -> JSONResponse:
    """The HTTP answer for an exception raised while serving a request."""
    exc = unwrap(exc)
    if isinstance(exc, SessionServeError):
        return error_response(
            exc.status_code,
            str(exc),
            exc.error_type,
            getattr(exc, "param", None),
            getattr(exc, "code", None),
        )
    name = type(exc).__name__
    if name in ("BackPressureError", "DeploymentUnavailableError"):
        return error_response(
            503, f"the server is overloaded ({name}); retry shortly", "overloaded_error"
        )
    if name in ("ActorDiedError", "RayActorError", "ActorUnavailableError"):
        return error_response(
            503,
            "the replica serving this request died; retry the turn "
            "(the session continues on another replica)",
            "overloaded_error",
        )
    log.exception("internal error", exc_info=exc)
    return error_response(500, f"internal error: {name}", "internal_error")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    err = exc.errors()[0]
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    param = ".".join(loc) or None
    if err.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    if err.get("type") == "extra_forbidden":
        return f"unrecognized request argument supplied: {param}", param
    return (f"{param}: {err.get('msg')}" if param else str(err.get("msg"))), param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(400, message, "invalid_request_error", param)

    @app.exception_handler(SessionServeError)
    async def _ours(_: Request, exc: SessionServeError) -> JSONResponse:
        return response_for(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, str(exc.detail), kind)
