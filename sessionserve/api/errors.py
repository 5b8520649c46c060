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
from starlette.routing import Match

from sessionserve.api.protocol import SESSION_ID_ERROR, SESSION_ID_PATTERN, ErrorResponse
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


REQUEST_PARTS = ("body", "path", "query", "header")
PATTERN_RULES = {SESSION_ID_PATTERN: SESSION_ID_ERROR}  # what a pattern means, in words


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    err = exc.errors()[0]
    loc = list(err.get("loc", ()))
    if loc and loc[0] in REQUEST_PARTS:  # the field's name, wherever it came from
        loc = loc[1:]
    param = ".".join(str(x) for x in loc) or None
    if err.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    if err.get("type") == "extra_forbidden":
        return f"unrecognized request argument supplied: {param}", param
    if err.get("type") == "string_pattern_mismatch":
        rule = PATTERN_RULES.get(err.get("ctx", {}).get("pattern"))
        if rule:
            return f"{param}: {rule}", param
    return (f"{param}: {err.get('msg')}" if param else str(err.get("msg"))), param


def allowed_methods(request: Request) -> list[str]:
    """The methods the app serves on this request's path (each method of a path may be a
    route of its own, e.g. GET and DELETE /v1/sessions/{id})."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        match, _ = route.matches(request.scope)
        if match != Match.NONE:
            methods |= getattr(route, "methods", None) or set()
    return sorted(methods)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(400, message, "invalid_request_error", param)

    @app.exception_handler(SessionServeError)
    async def _ours(_: Request, exc: SessionServeError) -> JSONResponse:
        return response_for(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """Starlette's own 404/405 (no such route, undeclared method): 405 keeps its `Allow`
        header (RFC 9110 requires it)."""
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        answer = error_response(exc.status_code, str(exc.detail), kind)
        answer.headers.update(exc.headers or {})
        if exc.status_code == 405:  # every method of the path, not just the first route's
            answer.headers["Allow"] = ", ".join(allowed_methods(request))
        return answer
