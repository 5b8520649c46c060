"""Bad input over HTTP: the right 4xx with OpenAI's error body, never a 500, and the
replicas' memory invariant still holds afterwards."""

from __future__ import annotations

import pytest
from ray import serve

from tests.conftest import replica_memory

pytestmark = pytest.mark.ray


CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "w5 w6"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
FORCE_G = {"type": "function", "function": {"name": "g"}}


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "fragment"),
    [
        (CHAT, {"messages": "w5"}, 400, "messages", "messages"),
        (CHAT, {"messages": MSG, "max_tokens": -3}, 400, "max_tokens", "greater than"),
        (CHAT, {"messages": MSG, "temperature": "hot"}, 400, "temperature", "number"),
        (CHAT, {"messages": MSG, "foo": 1}, 400, "foo", "unrecognized request argument"),
        (CHAT, {"messages": []}, 400, "messages", "at least 1"),
        (CHAT, {"messages": MSG, "n": 17}, 400, "n", "less than or equal"),
        (CHAT, {"messages": MSG, "model": "gpt-9"}, 404, "model", "does not exist"),
        (CHAT, {"messages": MSG, "session_id": "nope"}, 404, None, "'nope' does not exist"),
        (
            CHAT,
            {"messages": [{"role": "user", "content": "w5 " * 3000}]},
            400,
            "messages",
            "maximum context length",
        ),
        (
            "/v1/completions",
            {"prompt": [5, 6], "max_tokens": 5000},
            400,
            "max_tokens",
            "maximum context length",
        ),
        ("/v1/completions", {"prompt": [5, 99999]}, 400, "prompt", "outside the vocabulary"),
        ("/v1/completions", {"prompt": ""}, 400, "prompt", "empty"),
        (  # the test model's word tokenizer cannot write `{`: refused, never wedged
            CHAT,
            {"messages": MSG, "response_format": {"type": "json_object"}},
            400,
            "response_format",
            "tokenizer cannot be constrained",
        ),
        (
            "/v1/responses",
            {"input": "w5", "text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}},
            400,
            "text.format",
            "tokenizer cannot be constrained",
        ),
        # tools: what cannot be served is a 400 naming it, before any session or KV
        (
            CHAT,
            {"messages": MSG, "tools": [TOOL], "tool_choice": FORCE_G},
            400,
            "tool_choice",
            "no tool is named 'g'",
        ),
        (CHAT, {"messages": MSG, "tool_choice": "required"}, 400, "tool_choice", "needs tools"),
        (CHAT, {"messages": MSG, "tools": [TOOL, TOOL]}, 400, "tools", "two tools"),
        (
            CHAT,
            {"messages": [{"role": "tool", "content": "3"}]},
            400,
            "messages.0.tool.tool_call_id",
            "Field required",
        ),
        (  # the word tokenizer cannot write a call either
            CHAT,
            {"messages": MSG, "tools": [TOOL]},
            400,
            "tools",
            "tokenizer cannot be constrained",
        ),
        (
            "/v1/responses",
            {"input": "w5", "tools": [{"type": "web_search"}]},
            400,
            "tools[0].type",
            "'web_search' tools are not served",
        ),
        (
            "/v1/responses",
            {"input": [{"type": "function_call_output", "call_id": "c"}]},
            400,
            "input[0].output",
            "required",
        ),
    ],
)
def test_bad_requests(http, path, body, status, param, fragment) -> None:
    r = http.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert fragment in err["message"] and err["param"] == param
    assert err["type"] in ("invalid_request_error", "not_found_error")


def test_malformed_json_and_session_api_errors(http) -> None:
    r = http.post(CHAT, content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    assert http.get("/v1/sessions/ghost").status_code == 404
    assert http.delete("/v1/sessions/ghost").status_code == 404
    assert http.post("/v1/sessions", json={"session_id": "dup"}).status_code == 200
    dup = http.post("/v1/sessions", json={"session_id": "dup"})
    assert dup.status_code == 409 and dup.json()["error"]["type"] == "conflict_error"
    assert http.post("/v1/sessions", json={"ttl_s": -1}).status_code == 400
    assert http.delete("/v1/sessions/dup").status_code == 200


def test_replicas_stay_healthy_after_bad_input(served) -> None:
    seen = replica_memory()
    assert len(seen) == 2
    for terms in seen.values():
        assert terms["in_flight"] == 0 and terms["live_requests"] == 0
    status = serve.status().applications["sessionserve"].deployments["SessionReplica"]
    assert status.status == "HEALTHY" and status.replica_states == {"RUNNING": 2}
