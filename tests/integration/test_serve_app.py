"""The Serve application end to end over HTTP: the official `openai` client against real Ray
Serve (two replicas, our session router, our ingress) on loopback."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import replica_memory
from tests.integration.conftest import words

pytestmark = pytest.mark.ray


def open_session(http: httpx.Client, **body) -> str:
    r = http.post("/v1/sessions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["id"]


def test_models_and_health(client, http, served) -> None:
    assert http.get("/health").json() == {"status": "ok"}
    assert [m.id for m in client.models.list().data] == [served["model"]]


def test_chat_turns_stick_to_one_replica_and_reuse_kv(client, http) -> None:
    sid = open_session(http)
    hdr = {"x-session-id": sid}
    messages = [{"role": "user", "content": words(150, 151, 152, 153, 154)}]  # unused elsewhere
    first = client.chat.completions.create(
        model=None, messages=messages, max_tokens=8, temperature=0, extra_headers=hdr
    )
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    replica = http.get(f"/v1/sessions/{sid}").json()["replica"]
    assert replica
    for turn in range(3):
        messages += [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": words(20 + turn, 21 + turn)},
        ]
        nxt = client.chat.completions.create(
            model=None, messages=messages, max_tokens=8, temperature=0, extra_headers=hdr
        )
        assert nxt.usage.prompt_tokens_details.cached_tokens > 0
        first = nxt
    view = http.get(f"/v1/sessions/{sid}").json()
    assert view["replica"] == replica and view["turns"] == 4 and view["held_tokens"] > 0
    assert http.delete(f"/v1/sessions/{sid}").json()["deleted"] is True
    assert http.get(f"/v1/sessions/{sid}").status_code == 404


def test_streaming_chat_with_usage(client, http) -> None:
    sid = open_session(http)
    stream = client.chat.completions.create(
        model=None,
        messages=[{"role": "user", "content": words(11, 12, 13)}],
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"x-session-id": sid},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    usage = chunks[-1].usage
    assert finish and usage.completion_tokens > 0 and usage.prompt_tokens == 6  # w2 .. w3 w4
    plain = client.chat.completions.create(
        model=None,
        messages=[{"role": "user", "content": words(11, 12, 13)}],
        max_tokens=6,
        temperature=0,
    )
    assert text == plain.choices[0].message.content  # streamed == non-streamed, greedy
    # the last chunk carries the `session` object a non-streamed answer has
    replica = http.get(f"/v1/sessions/{sid}").json()["replica"]
    session = chunks[-1].model_extra["session"]
    assert session["replica"] == replica and session["ingress"] and session["cached_source"]
    assert all("session" not in (c.model_extra or {}) for c in chunks[:-1])
    # without include_usage the finish chunk is the last: it carries it, the KV reused
    messages = [
        {"role": "user", "content": words(11, 12, 13)},
        {"role": "assistant", "content": text},
        {"role": "user", "content": words(14)},
    ]
    chunks = list(
        client.chat.completions.create(
            model=None,
            messages=messages,
            max_tokens=3,
            temperature=0,
            stream=True,
            extra_headers={"x-session-id": sid},
        )
    )
    assert chunks[-1].choices[0].finish_reason is not None
    session = chunks[-1].model_extra["session"]
    assert session == {**session, "replica": replica, "cached_source": "session"}


def test_completions_append_mode_equals_full_history(client, http) -> None:
    sid = open_session(http)
    hdr = {"x-session-id": sid}
    t1 = client.completions.create(
        model=None,
        prompt=[5, 6, 7, 8],
        max_tokens=5,
        temperature=0,
        extra_headers=hdr,
        extra_body={"ignore_eos": True},
    )
    t2 = client.completions.create(
        model=None,
        prompt=words(30, 31),
        max_tokens=5,
        temperature=0,
        logprobs=2,
        extra_headers=hdr,
        extra_body={"ignore_eos": True},
    )
    history_len = 4 + 5 + 2
    assert t2.usage.prompt_tokens == history_len
    assert t2.usage.prompt_tokens_details.cached_tokens == 4 + 5 - 1
    t1_ids = [5, 6, 7, 8] + [int(w[1:]) for w in t1.choices[0].text.split()]
    full = client.completions.create(
        model=None,
        prompt=t1_ids + [30, 31],
        max_tokens=5,
        temperature=0,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    assert t2.choices[0].text == full.choices[0].text
    a, b = t2.choices[0].logprobs.token_logprobs, full.choices[0].logprobs.token_logprobs
    assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-3


def test_an_append_session_is_not_rewritten_by_a_diverging_log(http) -> None:
    """/v1/completions sessions are append-only end to end: the replica extends its own
    history of the session; a failover log that disagrees (rewritten here behind the ingress's
    back) neither rewinds it nor re-prefills, and the turn's commit repairs the log."""
    import ray

    from sessionserve.directory.client import directory_name
    from tests.conftest import APP

    sid = open_session(http)
    hdr = {"x-session-id": sid}
    body = {"max_tokens": 3, "temperature": 0, "ignore_eos": True}
    t1 = http.post("/v1/completions", json=body | {"prompt": [5, 6, 7, 8]}, headers=hdr)
    assert t1.status_code == 200, t1.text
    directory = ray.get_actor(directory_name(APP), namespace="sessionserve")
    assert ray.get(directory.commit_turn.remote(sid, 0, [1, 2]))
    t2 = http.post("/v1/completions", json=body | {"prompt": [30, 31]}, headers=hdr).json()
    assert t2["usage"]["prompt_tokens"] == 4 + 3 + 2  # the replica's history, not [1, 2]
    assert t2["usage"]["prompt_tokens_details"]["cached_tokens"] == 4 + 3 - 1
    assert http.get(f"/v1/sessions/{sid}").json()["history_tokens"] == 4 + 3 + 2 + 3
    http.delete(f"/v1/sessions/{sid}")


def test_concurrent_turn_is_refused_with_409(served, http) -> None:
    sid = open_session(http)
    body = {
        "prompt": [5, 6, 7],
        "max_tokens": 1500,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with (
        httpx.Client(base_url=served["base"], timeout=60) as other,
        other.stream(
            "POST", "/v1/completions", json=body, headers={"x-session-id": sid}
        ) as running,
    ):
        lines_iter = running.iter_lines()  # (dropping an httpx line iterator disconnects)
        next(lines_iter)  # the first turn is generating
        second = http.post(
            "/v1/completions", json={"prompt": [9], "max_tokens": 2}, headers={"x-session-id": sid}
        )
        assert second.status_code == 409, second.text
        assert "already has a turn in flight" in second.json()["error"]["message"]
        lines = [ln for ln in lines_iter if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    nxt = http.post(
        "/v1/completions", json={"prompt": [9], "max_tokens": 2}, headers={"x-session-id": sid}
    )
    assert nxt.status_code == 200 and nxt.json()["usage"]["prompt_tokens"] == 3 + 1500 + 1


def test_twenty_sessions_stick_through_two_ingress_replicas(served, http) -> None:
    from concurrent.futures import ThreadPoolExecutor

    sids = [open_session(http) for _ in range(20)]

    def conversation(i: int) -> list[dict]:
        turns = []
        with httpx.Client(base_url=served["base"], timeout=60) as c:
            for t in range(5):
                body = {"prompt": [10 + i, 11 + t], "max_tokens": 3, "temperature": 0}
                r = c.post("/v1/completions", json=body, headers={"x-session-id": sids[i]})
                assert r.status_code == 200, r.text
                turns.append(r.json())
        return turns

    with ThreadPoolExecutor(10) as pool:
        results = list(pool.map(conversation, range(20)))
    first_replicas = []
    ingresses = set()
    for turns in results:
        replicas = {t["session"]["replica"] for t in turns}
        assert len(replicas) == 1  # every turn of a session on the same model replica
        first_replicas.append(replicas.pop())
        ingresses |= {t["session"]["ingress"] for t in turns}
        cached = [t["usage"]["prompt_tokens_details"]["cached_tokens"] for t in turns]
        assert all(b > a for a, b in zip(cached, cached[1:], strict=False)), cached
    assert len(ingresses) == 2  # the turns went through both ingress replicas (two routers)
    # placement used both replicas; how evenly depends on the sessions and KV other tests
    # left on each (the policy itself is tested in tests/unit/router)
    assert len(set(first_replicas)) == 2, first_replicas


def test_client_disconnect_aborts_the_turn_and_keeps_the_session(served, http) -> None:
    sid = open_session(http)
    hdr = {"x-session-id": sid}
    t1 = http.post(
        "/v1/completions",
        json={"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0},
        headers=hdr,
    ).json()
    long = {"prompt": [8], "max_tokens": 1500, "temperature": 0, "ignore_eos": True, "stream": True}
    with (
        httpx.Client(base_url=served["base"], timeout=60) as other,
        other.stream("POST", "/v1/completions", json=long, headers=hdr) as running,
    ):
        lines = running.iter_lines()
        next(lines)
        next(lines)
    # the server noticed the disconnect and aborted the turn: the next one is accepted
    for _ in range(50):
        t3 = http.post("/v1/completions", json={"prompt": [9], "max_tokens": 2}, headers=hdr)
        if t3.status_code != 409:
            break
    assert t3.status_code == 200, t3.text
    usage = t3.json()["usage"]
    turn1_total = t1["usage"]["prompt_tokens"] + t1["usage"]["completion_tokens"]
    assert usage["prompt_tokens"] == turn1_total + 1  # the aborted turn is not in the history
    assert usage["prompt_tokens_details"]["cached_tokens"] >= turn1_total - 1
    for replica, terms in replica_memory().items():  # nothing leaked by the aborted turn
        assert terms["total"] == terms["free"] + terms["evictable"] + terms["protected"] + (
            terms["held"] + terms["in_flight"]
        ), replica


def test_replica_death_repins_the_session_and_loses_no_turn(client, served, http) -> None:
    """Runs last: it kills a replica (Serve starts a replacement)."""
    import time

    import ray

    sid = open_session(http)
    hdr = {"x-session-id": sid}
    first_prompt = [140, 141, 142, 143]  # used nowhere else: no radix hit elsewhere
    t1 = client.completions.create(
        model=None,
        prompt=first_prompt,
        max_tokens=5,
        temperature=0,
        extra_headers=hdr,
        extra_body={"ignore_eos": True},
    )
    dead = http.get(f"/v1/sessions/{sid}").json()["replica"]
    actor = ray.get_actor(f"SERVE_REPLICA::sessionserve#SessionReplica#{dead}", namespace="serve")
    ray.kill(actor, no_restart=True)
    deadline = time.monotonic() + 60
    while True:
        r = http.post(
            "/v1/completions",
            json={"prompt": [30, 31], "max_tokens": 5, "temperature": 0, "ignore_eos": True},
            headers=hdr,
        )
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        assert r.status_code == 503, r.text  # a clean "retry" while Serve notices the death
        time.sleep(0.5)
    assert r.status_code == 200, r.text
    t2 = r.json()
    history = first_prompt + [int(w[1:]) for w in t1.choices[0].text.split()] + [30, 31]
    assert t2["usage"]["prompt_tokens"] == len(history)  # re-prefilled from the token log
    assert t2["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert t2["session"]["cached_source"] == "none"
    assert http.get(f"/v1/sessions/{sid}").json()["replica"] not in (None, dead)
    ref = client.completions.create(
        model=None, prompt=history, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    assert t2["choices"][0]["text"] == ref.choices[0].text
    t3 = http.post("/v1/completions", json={"prompt": [32], "max_tokens": 2}, headers=hdr).json()
    assert t3["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # held again, new replica


def test_n_choices_answer_as_single_requests_with_their_seeds(client) -> None:
    """`n` > 1 through the official client: choice i is what one request with seed + i
    answers (whole and streamed), the usage counts the prompt once and every choice's
    tokens, completions take n too; a session turn asks for one choice (a 400 naming n)."""
    import openai

    messages = [{"role": "user", "content": words(31, 32, 33)}]
    kw = {"model": None, "messages": messages, "max_tokens": 6, "temperature": 1.0}
    many = client.chat.completions.create(n=3, seed=40, **kw)
    singles = [client.chat.completions.create(seed=40 + i, **kw) for i in range(3)]
    assert [c.index for c in many.choices] == [0, 1, 2]
    want = [s.choices[0].message.content for s in singles]
    assert [c.message.content for c in many.choices] == want
    assert many.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert many.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    stream = client.chat.completions.create(
        n=3, seed=40, stream=True, stream_options={"include_usage": True}, **kw
    )
    text, usage = ["", "", ""], None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            text[c.index] += c.delta.content or ""
    assert text == want and usage.completion_tokens == many.usage.completion_tokens
    plain = client.completions.create(
        model=None, prompt=words(31, 32), max_tokens=5, temperature=1.0, seed=7, n=2
    )
    assert [c.index for c in plain.choices] == [0, 1]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(n=2, extra_headers={"x-session-id": "any"}, **kw)
    assert err.value.body["param"] == "n"
