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

from sessionserve.api.protocol import ErrorResponse
from sessionserve.errors import SessionServeError, unwrap

log = logging.getLogger(__name__)
RETRY_AFTER_S = "1"
STATUS_TEXT = {
    400: "Bad input; `param` names the field",
    401: "Missing or invalid API key (only when keys are configured)",
    404: "Unknown model, session or response (or one of another API key)",
    409: "The session already has a turn in flight, or the id is taken",
    413: "The request body exceeds ingress.max_body_bytes",
    429: "Too many sessions; retry after Retry-After",
    500: "A bug on our side (the body never carries internals)",
    503: "Overloaded or a replica went away; retry after Retry-After",
}


def ERRORS(*statuses: int) -> dict[int | str, dict[str, Any]]:  # noqa: N802 (reads as a constant)
    """The OpenAPI `responses` of a route: each status it can answer, with the error body."""
    return {s: {"model": ErrorResponse, "description": STATUS_TEXT[s]} for s in statuses}


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


def _openapi_without_422(app: FastAPI) -> None:
    """Validation errors are 400s here (OpenAI's convention): drop FastAPI's generated 422."""
    default = app.openapi

    def schema() -> dict[str, Any]:
        if app.openapi_schema is None:
            spec = default()
            for path in spec.get("paths", {}).values():
                for op in path.values():
                    op.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                spec.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = schema


def install_error_handlers(app: FastAPI) -> None:
    _openapi_without_422(app)

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
