"""Schemathesis hooks for tests/integration/test_schema_fuzz.py (loaded by the CLI through
SCHEMATHESIS_HOOKS): bound the work a generated request asks of the tiny model, never what
is validated. A schema-valid body keeps a schema-valid `max_tokens` (at most 16, so that a
turn stays short and fits the context whatever its input), and asks for plain text: a JSON
answer format depends on what no schema can state (a compilable schema, a tokenizer that can
write JSON; the test model's word tokenizer cannot), as the field's description says, and so
without tools (their calls are constrained the same way; a named tool_choice must name one of
the tools, which no schema can state); those 400s are tested on their own. A session turn
asks for one choice: `n` > 1 beside a session (named by the header or the body) is a 400, a
rule between a header and a body field that the schema states in words only (`n`'s
description; tests/integration/test_serve_app.py checks it). Other bodies are sent as made."""

from __future__ import annotations

import schemathesis

MAX_NEW_TOKENS = 16
TOKEN_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


@schemathesis.hook
def before_call(context, case, kwargs) -> None:
    body = case.body
    if not isinstance(body, dict) or case.meta is None:
        return
    if not case.meta.generation.mode.is_positive:
        return
    present = [f for f in TOKEN_FIELDS if isinstance(body.get(f), int)]
    for field in present:
        body[field] = min(body[field], MAX_NEW_TOKENS)
    if not present:  # the default would be the rest of the context
        field = "max_output_tokens" if case.operation.path == "/v1/responses" else "max_tokens"
        body[field] = MAX_NEW_TOKENS
    for field in ("tools", "tool_choice"):
        body.pop(field, None)
    headers = {k.lower() for k in (case.headers or {})}
    session = body.get("session_id") is not None or "x-session-id" in headers
    if session and isinstance(body.get("n"), int | float) and body["n"] is not True:
        body["n"] = 1  # (5.0 is a valid n as well)
    if isinstance(body.get("response_format"), dict):
        body["response_format"] = {"type": "text"}
    if isinstance(body.get("text"), dict) and isinstance(body["text"].get("format"), dict):
        body["text"]["format"] = {"type": "text"}
