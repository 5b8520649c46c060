"""Schemathesis (its CLI, as a user runs it) over the running app's own OpenAPI schema
(`/openapi.json`): the coverage phase (boundary values, undeclared methods, missing
parameters) and a bounded fuzzing phase, positive and negative data. It fails on:
- a 5xx, or an answer the schema does not declare (status, content type, body shape);
- a schema-valid request refused (`positive_data_acceptance`: the schema must state every
  rule the server enforces) or a schema-invalid one served (`negative_data_rejection`);
- an undeclared method not answered 405 with `Allow`, or an `Allow` that lists other
  methods than the schema (`unsupported_method`, `allow_header_conformance`).
Generated turns are kept short by tests/integration/schemathesis_hooks.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import schemathesis
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

pytestmark = pytest.mark.ray
HERE = Path(__file__).resolve().parent
MAX_EXAMPLES = 12  # fuzzed cases per operation and mode (the coverage phase adds its own)
CHECKS = [
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_schema_conformance",
    "positive_data_acceptance",
    "negative_data_rejection",
    "unsupported_method",
    "allow_header_conformance",
    "missing_required_header",
]


def test_the_schema_states_what_the_server_does(served, tmp_path) -> None:
    """Every operation of the schema, the same generated cases every run (fixed seed)."""
    cli = Path(sys.executable).with_name("schemathesis")
    env = os.environ | {"SCHEMATHESIS_HOOKS": str(HERE / "schemathesis_hooks.py")}
    proc = subprocess.run(
        [
            str(cli),
            "--no-color",
            "run",
            f"{served['base']}/openapi.json",
            "--checks",
            ",".join(CHECKS),
            "--phases",
            "coverage,fuzzing",
            "--max-examples",
            str(MAX_EXAMPLES),
            "--seed",
            "1",
            "--workers",
            "1",
            "--request-timeout",
            "60",
            "--output-truncate",
            "false",
        ],
        cwd=tmp_path,  # its report folder lands there
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    out = proc.stdout + proc.stderr
    print(out[-1500:])  # the run's summary: phases, cases, failures
    assert proc.returncode == 0, out[-20000:]
    assert "Tested: 13" in out, out[-3000:]  # every operation was exercised


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
    checks = [status_code_conformance, content_type_conformance, response_schema_conformance]
    case.validate_response(response, checks=checks)
