"""Schemathesis over the running app's own OpenAPI schema (`/openapi.json`): a bounded number
of generated requests per operation, valid and invalid. No answer may be a 5xx, and every
answer must conform to the schema: a documented status, the documented content type, a body
of the documented shape (errors included: OpenAI's error body)."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

pytestmark = pytest.mark.ray
MAX_EXAMPLES = 12
CHECKS = [
    schemathesis.checks.not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


def bounded(case) -> None:
    """Bound the work a generated request asks of the tiny model (not what is validated)."""
    if isinstance(case.body, dict):
        for field in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            value = case.body.get(field)
            if isinstance(value, int) and value > 16:
                case.body[field] = 16


def test_no_5xx_and_every_answer_conforms(served) -> None:
    """Each operation of the schema in turn, `MAX_EXAMPLES` generated cases each (the same
    ones every run), driven through Hypothesis directly."""
    api = schemathesis.openapi.from_url(f"{served['base']}/openapi.json")
    operations = [result.ok() for result in api.get_all_operations()]
    assert len(operations) == 13, [op.label for op in operations]
    calls: dict[str, int] = {}
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(
            max_examples=MAX_EXAMPLES,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def check(case) -> None:
            bounded(case)
            case.call_and_validate(checks=CHECKS, timeout=60)
            calls[case.operation.label] = calls.get(case.operation.label, 0) + 1

        check()
    # every operation was exercised (parameterless ones have a single distinct case)
    assert all(calls.get(op.label, 0) >= 1 for op in operations), calls
    assert sum(calls.values()) >= 8 * (len(operations) - 2), calls


def test_a_streamed_answer_conforms(served) -> None:
    """A streamed chat completion (what the fuzz above may or may not generate) against the
    documented text/event-stream 200: every event validated."""
    api = schemathesis.openapi.from_url(f"{served['base']}/openapi.json")
    operation = api["/v1/chat/completions"]["POST"]
    body = {"messages": [{"role": "user", "content": "w5 w6"}], "max_tokens": 4, "stream": True}
    case = operation.Case(body=body, media_type="application/json")
    response = case.call(timeout=60)
    assert response.status_code == 200
    assert response.headers["content-type"][0].startswith("text/event-stream")
    case.validate_response(response, checks=CHECKS)
