"""What the ingress checks before it reads a request: the API key and the body's size.

Both are plain ASGI middleware on the FastAPI app, so a refused request costs no parsing,
no tokenization and no replica work. Keys come from `SESSIONSERVE_API_KEYS` (comma-separated)
and/or the file named by `ingress.api_keys_file` (one key per line, `#` comments); with no
key configured the API is open (local development). A key is never logged or stored: the
session directory records only its fingerprint, as the owner of the sessions it opens.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from pathlib import Path
from typing import Any

from sessionserve.api.errors import error_body
from sessionserve.errors import InvalidConfigError

KEYS_ENV = "SESSIONSERVE_API_KEYS"
Scope = dict[str, Any]


def load_api_keys(keys_file: str | None) -> tuple[str, ...]:
    """The configured keys (environment first, then the file); empty means no auth."""
    keys = [k.strip() for k in os.environ.get(KEYS_ENV, "").split(",")]
    if keys_file:
        path = Path(keys_file)
        if not path.is_file():
            raise InvalidConfigError(f"ingress.api_keys_file: {keys_file!r} is not a file")
        lines = (ln.split("#", 1)[0].strip() for ln in path.read_text().splitlines())
        keys += list(lines)
    return tuple(dict.fromkeys(k for k in keys if k))  # unique, order kept


def owner_of(key: str) -> str:
    """A key's fingerprint: what owns its sessions (the key itself is never kept)."""
    return hashlib.sha256(key.encode()).hexdigest()[:32]


async def _send_error(send, status: int, message: str, type_: str, code: str | None) -> None:
    """OpenAI's error body, sent before the app runs (Retry-After etc. are not needed here)."""
    body = json.dumps(error_body(message, type_, None, code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def configure(app, keys: tuple[str, ...], max_body_bytes: int) -> None:
    """Give the middleware below its settings (read per request from the app's state: the
    Ingress deployment knows its config only once it is constructed)."""
    app.state.api_keys = tuple(k.encode() for k in keys)
    app.state.max_body_bytes = max_body_bytes


def _setting(scope: Scope, name: str, default: Any) -> Any:
    app = scope.get("app")
    return getattr(app.state, name, default) if app is not None else default


def _api_path(scope: Scope) -> str:
    """The path inside the app (an app served under a route prefix sees it in root_path)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


class ApiKeyMiddleware:
    """Every `/v1/*` request needs `Authorization: Bearer <key>` when keys are configured
    (401 otherwise; `/health` and the schema stay open). On success the key's fingerprint is
    `scope["state"]["owner"]`. Every configured key is compared, in constant time."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive, send) -> None:
        keys = _setting(scope, "api_keys", ())
        if scope["type"] != "http" or not keys or not _api_path(scope).startswith("/v1/"):
            return await self.app(scope, receive, send)
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, given = header.partition(b" ")
        matched = None
        for key in keys:  # no early exit: the time does not say which key matched
            if hmac.compare_digest(given.strip(), key) and scheme.lower() == b"bearer":
                matched = key
        if matched is None:
            return await _send_error(
                send,
                401,
                "missing or invalid API key: send 'Authorization: Bearer <key>'",
                "invalid_request_error",
                "invalid_api_key",
            )
        scope.setdefault("state", {})["owner"] = owner_of(matched.decode())
        return await self.app(scope, receive, send)


class BodyTooLarge(Exception):
    pass


class BodySizeMiddleware:
    """A body over `max_bytes` gets a 413 before it is parsed: refused at once when its
    Content-Length says so, else as soon as the bytes read pass the limit."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive, send) -> None:
        limit = _setting(scope, "max_body_bytes", None)
        if scope["type"] != "http" or limit is None:
            return await self.app(scope, receive, send)
        message = (
            f"the request body exceeds ingress.max_body_bytes ({limit} bytes); send less "
            "(a session keeps the earlier turns on the server)"
        )
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return await _send_error(send, 413, message, "invalid_request_error", None)
        seen, started = 0, False

        async def counted_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge
            return message

        async def tracked_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except BodyTooLarge:
            if not started:
                await _send_error(send, 413, message, "invalid_request_error", None)
