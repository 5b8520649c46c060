"""What an outside user or an attacker could do to the API in one request (issue 13's
findings): every answer is a 4xx/5xx with OpenAI's error body, says nothing about our
internals, and leaves the replicas healthy."""

from __future__ import annotations

import httpx
import pytest
from ray import serve

from tests.conftest import DEGENERATE_SAMPLING, replica_memory

pytestmark = pytest.mark.ray

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "w5 w6"}]
INTERNALS = ("Traceback", 'File "', "/site-packages/", "pid=", "ActorID", "ray::")


def assert_clean_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json"), r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert not any(s in err["message"] for s in INTERNALS), err["message"]
    assert len(err["message"]) < 400, err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


@pytest.mark.parametrize(("field", "value"), DEGENERATE_SAMPLING)
def test_degenerate_sampling_values_are_refused(http, field, value) -> None:
    """Finding 1 and 5: values that make sampling produce NaN (or overflow the seed) get a
    400 naming the field, before any replica work."""
    body = {"messages": MSG, "max_tokens": 1, field: value}
    assert_clean_error(http.post(CHAT, json=body), 400, field)


def test_errors_raised_on_a_replica_carry_no_traceback(served, http) -> None:
    """Finding 4: a 409 raised inside the replica (a second turn while one runs) used to
    carry Ray's whole traceback in its message."""
    sid = http.post("/v1/sessions", json={}).json()["id"]
    body = {"prompt": [5, 6, 7], "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with (
        httpx.Client(base_url=served["base"], timeout=60) as other,
        other.stream("POST", "/v1/completions", json=body, headers={"x-session-id": sid}) as run,
    ):
        lines = run.iter_lines()  # (dropping an httpx line iterator disconnects)
        next(lines)  # the first turn is generating
        second = http.post(
            "/v1/completions", json={"prompt": [9], "max_tokens": 2}, headers={"x-session-id": sid}
        )
    err = assert_clean_error(second, 409)
    assert "already has a turn in flight" in err["message"]
    http.delete(f"/v1/sessions/{sid}")


@pytest.mark.parametrize(
    "sid",
    ["", "a/b", "x" * 129, "caf\u00e9", "a b", "../etc"],
)
def test_one_session_id_rule_on_every_route(http, sid) -> None:
    """Finding 6: ids are [A-Za-z0-9._:-]{1,128} everywhere (body, header, path)."""
    assert_clean_error(http.post("/v1/sessions", json={"session_id": sid}), 400, "session_id")
    assert_clean_error(http.post(CHAT, json={"messages": MSG, "session_id": sid}), 400)
    if sid and "/" not in sid:
        assert_clean_error(http.get(f"/v1/sessions/{sid}"), 400, "session_id")
        assert_clean_error(http.delete(f"/v1/sessions/{sid}"), 400, "session_id")


def test_a_non_ascii_session_header_is_a_400(served) -> None:
    """Finding 5/6: a header id outside the charset is a 400 naming the header. (A byte that
    is not UTF-8, e.g. latin-1, never reaches us: Ray Serve's proxy decodes `x-session-id`
    itself and answers a plain-text 500; see the README's Security section.)"""
    with httpx.Client(base_url=served["base"], timeout=60) as c:
        r = c.post(
            CHAT,
            json={"messages": MSG, "max_tokens": 1},
            headers={"x-session-id": "caf\u00e9".encode()},
        )
    assert_clean_error(r, 400, "x-session-id")


def test_an_oversized_body_is_refused_before_parsing(http, served) -> None:
    """Finding 7: a body over `ingress.max_body_bytes` gets a 413 without being read."""
    huge = b'{"messages": [{"role": "user", "content": "' + b"w5 " * 1_500_000 + b'"}]}'
    r = http.post(CHAT, content=huge, headers={"content-type": "application/json"})
    err = assert_clean_error(r, 413)
    assert "max_body_bytes" in err["message"]


def test_stop_takes_at_most_four_strings(http) -> None:
    """Finding 8 (OpenAI caps `stop` at 4)."""
    body = {"messages": MSG, "max_tokens": 1, "stop": [f"w{i}" for i in range(5, 105)]}
    assert_clean_error(http.post(CHAT, json=body), 400, "stop")


def test_the_openapi_schema_declares_every_error_status(http) -> None:
    """Finding 8: the schema documents the statuses each route returns, with the error body."""
    paths = http.get("/openapi.json").json()["paths"]
    chat = paths["/v1/chat/completions"]["post"]["responses"]
    for status in ("400", "401", "404", "409", "413", "429", "500", "503"):
        assert status in chat, sorted(chat)
        schema = chat[status]["content"]["application/json"]["schema"]
        assert schema["$ref"].endswith("/ErrorResponse")
    assert "422" not in chat  # validation errors are 400s here
    for path in ("/v1/sessions/{session_id}", "/v1/responses/{response_id}"):
        assert "404" in paths[path]["get"]["responses"]


def test_a_session_deleted_during_its_turn_stays_deleted_and_its_kv_is_freed(served, http):
    """DELETE while a streamed turn runs: the turn still answers, then the session is gone
    everywhere: no record (404 for a view and for a turn naming it), nothing held on any
    replica (the deferred close ran), and no turn count or log came back with the commit."""
    import json
    import time

    def held() -> int:
        return sum(t["held_sessions"] for t in replica_memory().values())

    before = held()
    sid = http.post("/v1/sessions", json={}).json()["id"]
    body = {"prompt": [5, 6, 7], "max_tokens": 300, "ignore_eos": True, "stream": True}
    with (
        httpx.Client(base_url=served["base"], timeout=60) as other,
        other.stream("POST", "/v1/completions", json=body, headers={"x-session-id": sid}) as run,
    ):
        lines = run.iter_lines()
        next(lines)  # the turn is generating
        assert http.delete(f"/v1/sessions/{sid}").json()["deleted"] is True
        rest = [line for line in lines if line]  # (blank lines separate the events)
    events = [json.loads(x[len("data: ") :]) for x in rest if x.startswith("data: {")]
    reasons = [c["choices"][0]["finish_reason"] for c in events if c.get("choices")]
    assert rest[-1] == "data: [DONE]" and reasons[-1] == "length"  # the turn ran to its end
    assert_clean_error(http.get(f"/v1/sessions/{sid}"), 404)
    turn = {"prompt": [9], "max_tokens": 2}
    assert_clean_error(http.post("/v1/completions", json=turn, headers={"x-session-id": sid}), 404)
    deadline = time.monotonic() + 10
    while held() != before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert held() == before


def test_replicas_are_healthy_after_the_abuse(served) -> None:
    for terms in replica_memory().values():
        assert terms["in_flight"] == 0 and terms["live_requests"] == 0
    status = serve.status().applications["sessionserve"].deployments["SessionReplica"]
    assert status.status == "HEALTHY"


def test_a_session_view_shows_the_history_only_when_asked(http) -> None:
    sid = http.post("/v1/sessions", json={}).json()["id"]
    turn = http.post(
        "/v1/completions",
        json={"prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0},
        headers={"x-session-id": sid},
    ).json()
    view = http.get(f"/v1/sessions/{sid}").json()
    assert view["history"] is None and view["history_tokens"] == 5
    full = http.get(f"/v1/sessions/{sid}", params={"include_history": "true"}).json()
    assert full["history"][:3] == [5, 6, 7] and len(full["history"]) == 5
    assert turn["usage"]["completion_tokens"] == 2
    http.delete(f"/v1/sessions/{sid}")


def test_echo_is_refused_rather_than_ignored(http) -> None:
    body = {"prompt": [5, 6], "max_tokens": 1, "echo": True}
    assert_clean_error(http.post("/v1/completions", json=body), 400, "echo")
    ok = http.post("/v1/completions", json=body | {"echo": False})
    assert ok.status_code == 200, ok.text


def test_a_session_opened_over_http_gets_this_deployments_default_ttl(http, served) -> None:
    """The directory actor outlives redeploys: the TTL comes from the deployment that opens
    the session, not from whichever config created the actor."""
    sid = http.post("/v1/sessions", json={}).json()["id"]
    assert http.get(f"/v1/sessions/{sid}").json()["ttl_s"] == 600  # tests/conftest.py
    custom = http.post("/v1/sessions", json={"ttl_s": 42}).json()
    assert custom["ttl_s"] == 42
    for s in (sid, custom["id"]):
        http.delete(f"/v1/sessions/{s}")
