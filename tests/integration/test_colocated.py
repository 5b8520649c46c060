"""`ingress.colocated`: the ingress's routes and the engine in one Serve replica, beside the
shared test app in the same cluster, driven over HTTP by the official `openai` client and
httpx. Its answers equal the two-hop app's token for token (same tiny model, fp32, greedy);
session turns reuse their KV; a client that leaves mid-stream gives back its turn and its
admission slot; a turn past the replica's limits gets Serve's 503 with an OpenAI error body;
migration is refused with what to change; the memory invariant holds (strict mode)."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from ray import serve

from tests.conftest import app_args, extra_app, replica_memory
from tests.integration.conftest import words

pytestmark = pytest.mark.ray
COLO_APP = "colo"
LONG = {"prompt": [8], "max_tokens": 1500, "temperature": 0, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def colo(served):
    args = app_args(served["model_dir"])
    # one turn at a time and none waiting: a second concurrent turn must be refused
    args["replica"].update(
        num_replicas=1, num_cpus=0.25, max_ongoing_requests=1, max_queued_requests=0
    )
    args["ingress"].update(num_replicas=1, colocated=True)
    with extra_app(served, COLO_APP, args, wait_s=60) as base:
        yield base


@pytest.fixture(autouse=True)
def idle(colo) -> None:
    """Each test starts with no turn running (an earlier one's abort may still be landing)."""
    for _ in range(100):
        if _strict_memory_holds()["live_requests"] == 0:
            return
        time.sleep(0.1)


def _strict_memory_holds() -> dict:
    (terms,) = replica_memory(COLO_APP, replicas=1).values()
    assert terms["total"] == terms["free"] + terms["evictable"] + terms["protected"] + (
        terms["held"] + terms["in_flight"]
    )
    return terms


def test_one_deployment_answers_as_the_two_hop_app_does(colo, served) -> None:
    deployments = serve.status().applications[COLO_APP].deployments
    assert set(deployments) == {"SessionReplica"}  # no separate Ingress deployment
    here = openai.OpenAI(base_url=f"{colo}/v1", api_key="x", max_retries=0)
    there = openai.OpenAI(base_url=f"{served['base']}/v1", api_key="x", max_retries=0)
    with httpx.Client(base_url=colo, timeout=60) as http:
        sid = http.post("/v1/sessions", json={}).json()["id"]
        messages = [{"role": "user", "content": words(301, 302, 303, 304)}]
        for turn in range(3):
            r = here.chat.completions.create(
                model=None,
                messages=messages,
                max_tokens=8,
                temperature=0,
                extra_headers={"x-session-id": sid},
            )
            ref = there.chat.completions.create(
                model=None, messages=messages, max_tokens=8, temperature=0
            )
            assert r.choices[0].message.content == ref.choices[0].message.content
            if turn:
                assert r.usage.prompt_tokens_details.cached_tokens > 0
            messages += [
                {"role": "assistant", "content": r.choices[0].message.content},
                {"role": "user", "content": words(310 + turn, 311 + turn)},
            ]
        view = http.get(f"/v1/sessions/{sid}").json()
        assert view["turns"] == 3 and view["held_tokens"] > 0
        assert http.delete(f"/v1/sessions/{sid}").json()["deleted"] is True
    _strict_memory_holds()


def test_streaming_and_a_client_that_leaves_gives_its_slot_back(colo) -> None:
    here = openai.OpenAI(base_url=f"{colo}/v1", api_key="x", max_retries=0)
    chunks = list(
        here.completions.create(
            model=None, prompt=words(5, 6, 7), max_tokens=6, temperature=0, stream=True
        )
    )
    assert sum(len(c.choices[0].text) > 0 for c in chunks if c.choices) >= 1
    with httpx.Client(base_url=colo, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=LONG) as running:
            lines = running.iter_lines()
            next(lines)
            next(lines)
        # the only admission slot comes back once the replica aborted the turn; a leaked
        # one would leave every later turn refused (max_queued_requests 0)
        for _ in range(100):
            r = http.post("/v1/completions", json={"prompt": [9], "max_tokens": 2})
            if r.status_code != 503:
                break
            time.sleep(0.1)
        assert r.status_code == 200, r.text
    terms = _strict_memory_holds()
    assert terms["live_requests"] == 0 and terms["in_flight"] == 0


def test_a_turn_past_the_replicas_limits_gets_a_503_with_an_openai_error_body(colo) -> None:
    with (
        httpx.Client(base_url=colo, timeout=60) as http,
        httpx.Client(base_url=colo, timeout=60) as other,
        other.stream("POST", "/v1/completions", json=LONG) as running,
    ):
        lines = running.iter_lines()  # (dropping an httpx line iterator disconnects)
        next(lines)  # the one turn the replica takes is generating
        refused = http.post("/v1/completions", json={"prompt": [9], "max_tokens": 2})
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["type"] == "overloaded_error"
        assert "Retry-After" in refused.headers
    _strict_memory_holds()


def test_migration_is_refused_with_what_to_change(colo) -> None:
    with httpx.Client(base_url=colo, timeout=60) as http:
        sid = http.post("/v1/sessions", json={}).json()["id"]
        hdr = {"x-session-id": sid}
        r = http.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2}, headers=hdr)
        assert r.status_code == 200, r.text
        moved = http.post(f"/v1/sessions/{sid}/migrate", json={})
        assert moved.status_code == 409, moved.text
        assert "ingress.colocated" in moved.json()["error"]["message"]
        again = http.post("/v1/completions", json={"prompt": [7], "max_tokens": 2}, headers=hdr)
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        http.delete(f"/v1/sessions/{sid}")
