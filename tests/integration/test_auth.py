"""API keys and session ownership on real Ray Serve: a second app with keys configured
(`ingress.api_keys_file`), driven by the official `openai` client. A session, and every
response stored in it, belongs to the key that opened it: any other key gets a 404 for it,
exactly as for an id that does not exist (issue 13, finding 2)."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.conftest import app_args, extra_app

pytestmark = pytest.mark.ray
KEYED_APP = "keyed"
ALICE, BOB = "sk-alice-0123456789", "sk-bob-9876543210"


@pytest.fixture(scope="module")
def keyed(served, tmp_path_factory):

    keys = tmp_path_factory.mktemp("keys") / "api-keys"
    keys.write_text(f"# test keys\n{ALICE}\n{BOB}\n")
    args = app_args(served["model_dir"])
    # the main app holds 1.5 of the cluster's 2 CPUs: this one must fit in the rest
    args["replica"].update(num_replicas=1, num_cpus=0.2)
    args["ingress"].update(num_replicas=1, num_cpus=0.1, api_keys_file=str(keys))
    with extra_app(served, KEYED_APP, args, wait_s=60) as base:  # /health is open
        yield base


def as_user(base: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)


def test_requests_without_a_valid_key_get_401(keyed) -> None:
    with httpx.Client(base_url=keyed, timeout=30) as http:
        for headers in ({}, {"authorization": "Bearer sk-nobody"}, {"authorization": ALICE}):
            r = http.post("/v1/sessions", json={}, headers=headers)
            assert r.status_code == 401, r.text
            assert r.json()["error"]["code"] == "invalid_api_key"
            assert ALICE not in r.text and BOB not in r.text
        assert http.get("/health").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        as_user(keyed, "sk-nobody").models.list()
    assert as_user(keyed, ALICE).models.list().data  # the official client sends the key


def test_another_key_cannot_read_continue_or_delete_a_session(keyed) -> None:
    alice, bob = as_user(keyed, ALICE), as_user(keyed, BOB)
    sid = alice.post("/sessions", body={"session_id": "alice-chat"}, cast_to=dict)["id"]
    hdr = {"x-session-id": sid}
    messages = [{"role": "user", "content": "w5 w6 w7"}]
    alice.chat.completions.create(model=None, messages=messages, max_tokens=3, extra_headers=hdr)
    for attempt in (
        lambda: bob.get(f"/sessions/{sid}", cast_to=dict),
        lambda: bob.delete(f"/sessions/{sid}", cast_to=dict),
        lambda: bob.chat.completions.create(
            model=None, messages=messages, max_tokens=3, extra_headers=hdr
        ),
        lambda: bob.completions.create(model=None, prompt="w8", max_tokens=3, extra_headers=hdr),
    ):
        with pytest.raises(openai.NotFoundError) as err:
            attempt()
        assert "does not exist" in err.value.body["message"]  # the same as an unknown id
    with pytest.raises(openai.ConflictError):  # ids are global: bob cannot take it either
        bob.post("/sessions", body={"session_id": sid}, cast_to=dict)
    view = alice.get(f"/sessions/{sid}", cast_to=dict)
    assert view["turns"] == 1  # bob changed nothing
    assert alice.delete(f"/sessions/{sid}", cast_to=dict)["deleted"] is True


def test_another_key_cannot_see_or_continue_a_stored_response(keyed) -> None:
    alice, bob = as_user(keyed, ALICE), as_user(keyed, BOB)
    first = alice.responses.create(model=None, input="w9 w10", max_output_tokens=3)
    for attempt in (
        lambda: bob.responses.retrieve(first.id),
        lambda: bob.responses.input_items.list(first.id),
        lambda: bob.responses.delete(first.id),
        lambda: bob.responses.create(
            model=None, input="w11", previous_response_id=first.id, max_output_tokens=3
        ),
    ):
        with pytest.raises(openai.NotFoundError):
            attempt()
    nxt = alice.responses.create(
        model=None, input="w11", previous_response_id=first.id, max_output_tokens=3
    )
    assert alice.responses.retrieve(nxt.id).previous_response_id == first.id
