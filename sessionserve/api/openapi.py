"""The published OpenAPI schema: FastAPI's own, made to state what this deployment enforces.

A schema-valid request must never be refused for a reason the schema does not state. The
request models (protocol.py, responses/protocol.py) carry the fixed rules; this module adds what
only the running deployment knows, once, when the schema is first asked for:
- the session header (its name is configurable) on the routes that read it, with the id rule;
- the largest `max_tokens` the context allows (the rule "input + max_tokens fits the context"
  depends on the input, so the descriptions say it);
- the largest token id of the served model's vocabulary in `prompt`;
restores the 64-bit seed's bounds exactly, and drops FastAPI's 422 (validation errors are 400s
here, OpenAI's convention).
"""

from __future__ import annotations

import copy
from typing import Any

from sessionserve.api.protocol import SESSION_ID_PATTERN, SESSION_ID_RULE
from sessionserve.wire import SEED_RANGE

SESSION_ROUTES = ("/v1/chat/completions", "/v1/completions")  # read the session header
MAX_TOKEN_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


def published_schema(
    generated: dict[str, Any], session_header: str, context_limit: int, vocab_size: int
) -> dict[str, Any]:
    """`generated` (FastAPI's schema, left unchanged) with this deployment's rules."""
    spec = copy.deepcopy(generated)
    for path, item in spec.get("paths", {}).items():
        for op in item.values():
            op.get("responses", {}).pop("422", None)
            for param in op.get("parameters", []):  # we set none; a Serve-pickled FastAPI
                param.pop("example", None)  # parameter renders its unset example as {}
            if path in SESSION_ROUTES:
                op.setdefault("parameters", []).append(_session_header(session_header))
    components = spec.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    for model in components.values():
        props = model.get("properties", {})
        for field in MAX_TOKEN_FIELDS:
            if field in props:
                _bound(props[field], context_limit - 1)
                props[field]["description"] = (
                    f"Tokens to generate at most. The input (a session's history included) "
                    f"plus this must fit the context of {context_limit} tokens (else 400)."
                )
        if "seed" in props:  # FastAPI's schema models hold bounds as floats: 2**64 - 1
            _bound(props["seed"], SEED_RANGE[1], SEED_RANGE[0])  # would read as 2**64
    prompt = components.get("CompletionRequest", {}).get("properties", {}).get("prompt")
    if prompt is not None:
        for branch in prompt["anyOf"]:
            if branch.get("type") == "array":
                branch["items"]["maximum"] = vocab_size - 1
    return spec


def _session_header(name: str) -> dict[str, Any]:
    return {
        "name": name,
        "in": "header",
        "required": False,
        "description": "The streaming session of this turn (or `session_id` in the body).",
        "schema": {"type": "string", "pattern": SESSION_ID_PATTERN, "description": SESSION_ID_RULE},
    }


def _bound(prop: dict[str, Any], maximum: int, minimum: int | None = None) -> None:
    """Set the bounds of the integer branch of an optional integer field's schema."""
    for branch in prop.get("anyOf", [prop]):
        if branch.get("type") == "integer":
            branch["maximum"] = maximum
            if minimum is not None:
                branch["minimum"] = minimum
