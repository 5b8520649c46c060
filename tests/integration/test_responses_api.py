"""OpenAI's Responses API over sessions, driven by the official `openai` client against real
Ray Serve (two replicas, our router and ingress) on loopback: chains reuse the KV their
replica holds and answer exactly as the equivalent chat completion; forks; stored responses,
their input items, 404s; unsupported fields; streaming; a client disconnect."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.conftest import replica_memory
from tests.integration.conftest import words

pytestmark = pytest.mark.ray
PAGE = 4  # the test app's KV page size (tests/conftest.py)


def respond(client: openai.OpenAI, text: str, previous=None, **kw):
    """One greedy response; `previous` is a response or a response id."""
    previous_id = getattr(previous, "id", previous)
    return client.responses.create(
        model=None,
        input=text,
        previous_response_id=previous_id if previous_id is not None else openai.omit,
        temperature=0,
        max_output_tokens=kw.pop("max_output_tokens", 6),
        **kw,
    )


def chat_text(client: openai.OpenAI, messages: list[dict], max_tokens: int = 6) -> str:
    """The same conversation as a stateless chat completion (the reference)."""
    out = client.chat.completions.create(
        model=None, messages=messages, max_tokens=max_tokens, temperature=0
    )
    return out.choices[0].message.content


def session_of(response) -> dict:
    return response.model_extra["session"]


def test_a_four_turn_chain_reuses_kv_and_equals_the_chat_completion(client) -> None:
    inputs = [words(160, 161, 162, 163), words(164, 165), words(166, 167, 168), words(169)]
    chain, messages = [], []
    for text in inputs:
        chain.append(respond(client, text, chain[-1] if chain else None))
        messages.append({"role": "user", "content": text})
        assert chain[-1].status in ("completed", "incomplete")
        assert chain[-1].output_text == chat_text(client, messages)  # token for token
        messages.append({"role": "assistant", "content": chain[-1].output_text})
    cached = [r.usage.input_tokens_details.cached_tokens for r in chain]
    assert cached[0] == 0 and all(b > a for a, b in zip(cached, cached[1:], strict=False)), cached
    assert len({session_of(r)["replica"] for r in chain}) == 1  # one pinned replica
    assert len({session_of(r)["id"] for r in chain}) == 1  # one session
    assert chain[-1].previous_response_id == chain[-2].id
    # the stored response and its input items: the whole conversation it answered
    stored = client.responses.retrieve(chain[-1].id)
    assert stored.id == chain[-1].id and stored.output_text == chain[-1].output_text
    items = client.responses.input_items.list(chain[-1].id, order="asc")
    roles = [it.role for it in items.data]
    assert roles == ["user", "assistant"] * 3 + ["user"]
    assert [it.content[0].text for it in items.data][::2] == inputs
    newest_first = client.responses.input_items.list(chain[-1].id, limit=2)
    assert [it.id for it in newest_first.data] == [it.id for it in items.data][::-1][:2]
    assert newest_first.has_more is True


def test_instructions_apply_to_their_response_only(client) -> None:
    first = respond(client, words(170, 171), instructions=words(172, 173))
    system = {"role": "system", "content": words(172, 173)}
    user = {"role": "user", "content": words(170, 171)}
    assert first.output_text == chat_text(client, [system, user])
    second = respond(client, words(174), first)  # OpenAI does not carry instructions over
    assistant = {"role": "assistant", "content": first.output_text}
    assert second.output_text == chat_text(
        client, [user, assistant, {"role": "user", "content": words(174)}]
    )


def test_two_responses_forking_from_one_do_not_corrupt_each_other(client) -> None:
    root_words = words(*range(180, 190))
    root = respond(client, root_words)
    left = respond(client, words(190, 191), root)
    right = respond(client, words(192, 193), root)  # a fork: the session rewinds to root
    # root's prompt minus its generation prompt is the shared prefix (whole KV pages of it
    # reused, from the session or the radix cache it shares its first prompt with)
    shared = (root.usage.input_tokens - 1) // PAGE * PAGE
    for branch in (left, right):
        assert branch.usage.input_tokens_details.cached_tokens >= shared > 0
        assert session_of(branch)["cached_source"] in ("session", "radix")
    left2 = respond(client, words(194), left)  # back on the first branch
    base = [
        {"role": "user", "content": root_words},
        {"role": "assistant", "content": root.output_text},
    ]
    right_msgs = base + [{"role": "user", "content": words(192, 193)}]
    left_msgs = base + [
        {"role": "user", "content": words(190, 191)},
        {"role": "assistant", "content": left.output_text},
        {"role": "user", "content": words(194)},
    ]
    assert right.output_text == chat_text(client, right_msgs)
    assert left2.output_text == chat_text(client, left_msgs)  # right's tokens never leaked in
    assert left2.usage.input_tokens_details.cached_tokens >= shared
    left_items = client.responses.input_items.list(left2.id, order="asc").data
    assert words(192, 193) not in [it.content[0].text for it in left_items]


def test_unknown_deleted_unstored_and_closed_responses_are_404(client, http) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        respond(client, words(5), "resp_doesnotexist")
    body = err.value.body
    assert body["param"] == "previous_response_id" and body["code"] == "previous_response_not_found"

    unstored = respond(client, words(190, 191), store=False)
    assert unstored.status == "completed" and session_of(unstored)["id"] is None
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError):
        respond(client, words(5), unstored)

    first = respond(client, words(192, 193))
    second = respond(client, words(194), first)
    client.responses.delete(first.id)
    for call in (
        lambda: client.responses.retrieve(first.id),
        lambda: client.responses.delete(first.id),
        lambda: client.responses.input_items.list(first.id),
        lambda: respond(client, words(5), first),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    # a chain survives deleting its parent: its child still continues the conversation
    third = respond(client, words(195), second)
    assert third.usage.input_tokens_details.cached_tokens > 0

    # closing the session deletes its stored responses and frees its KV
    sid = session_of(third)["id"]
    assert http.get(f"/v1/sessions/{sid}").json()["turns"] == 3
    assert http.delete(f"/v1/sessions/{sid}").status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(third.id)
    with pytest.raises(openai.NotFoundError):
        respond(client, words(5), third)


def test_a_store_false_turn_keeps_nothing(client, http) -> None:
    first = respond(client, words(196, 197))
    sid = session_of(first)["id"]
    side = respond(client, words(198), first, store=False)  # continues, then is forgotten
    assert side.usage.input_tokens_details.cached_tokens > 0
    view = http.get(f"/v1/sessions/{sid}").json()
    assert view["turns"] == 1  # not committed to the session's log
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(side.id)
    http.delete(f"/v1/sessions/{sid}")


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"background": True}, "background"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"text": {"verbosity": "low"}}, "text.verbosity"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"no_such_field": 1}, "no_such_field"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input[0].output"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, None),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"input": []}, "input"),
        ({"temperature": 3}, "temperature"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
    ],
)
def test_unsupported_or_invalid_fields_get_a_400_naming_them(http, extra, param) -> None:
    body = {"input": words(5, 6), **extra}
    r = http.post("/v1/responses", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == (param or "input[0].type"), error


def test_the_official_client_sees_unsupported_features_refused(client) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=None, input=words(5), tools=[{"type": "web_search"}])
    body = err.value.body
    assert body["param"] == "tools[0].type" and "not served here" in body["message"]
    # a function tool is served, but not on a model whose tokenizer cannot write its calls
    tool = {"type": "function", "name": "lookup", "parameters": {"type": "object"}}
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=None, input=words(5), tools=[tool])
    body = err.value.body
    assert body["param"] == "tools" and "cannot be constrained" in body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(
            model=None,
            input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}],
        )
    assert err.value.body["param"] == "input[0].content[0].type"


def test_streaming_sends_the_event_sequence_and_equals_the_plain_response(client) -> None:
    prompt = words(228)  # the tiny test model answers it with 3 words and EOS
    with client.responses.stream(
        model=None, input=prompt, temperature=0, max_output_tokens=16
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    plain = respond(client, prompt, store=False, max_output_tokens=16)
    assert final.status == "completed" and final.usage.output_tokens < 16
    assert deltas == final.output_text == plain.output_text
    assert final.usage.output_tokens == plain.usage.output_tokens > 0
    assert client.responses.retrieve(final.id).output_text == final.output_text
    # stream=True on create, continuing the streamed response
    chunks = list(
        client.responses.create(
            model=None,
            input=words(203),
            previous_response_id=final.id,
            temperature=0,
            max_output_tokens=4,
            stream=True,
        )
    )
    done = chunks[-1].response
    assert chunks[-1].type in ("response.completed", "response.incomplete")
    assert done.usage is not None and done.previous_response_id == final.id
    messages = [
        {"role": "user", "content": prompt},
        {"role": "assistant", "content": final.output_text},
        {"role": "user", "content": words(203)},
    ]
    streamed = "".join(c.delta for c in chunks if c.type == "response.output_text.delta")
    assert streamed == done.output_text == chat_text(client, messages, max_tokens=4)


def test_a_disconnect_aborts_the_turn_and_keeps_the_last_completed_response(served, client) -> None:
    first = respond(client, words(210, 211, 212))
    body = {
        "input": words(213),
        "previous_response_id": first.id,
        "max_output_tokens": 1500,
        "temperature": 0,
        "stream": True,
    }
    with (
        httpx.Client(base_url=served["base"], timeout=60) as other,
        other.stream("POST", "/v1/responses", json=body) as running,
    ):
        lines = running.iter_lines()
        created = json.loads(next(ln for ln in lines if ln.startswith("data: "))[6:])
        next(lines)
    aborted_id = created["response"]["id"]
    for _ in range(50):  # the server notices the disconnect and aborts the turn
        try:
            nxt = respond(client, words(214), first)
            break
        except openai.ConflictError:
            continue
    # the aborted turn is not in the conversation: the same tokens as the chat without it
    messages = [
        {"role": "user", "content": words(210, 211, 212)},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": words(214)},
    ]
    ref = client.chat.completions.create(model=None, messages=messages, max_tokens=6, temperature=0)
    assert nxt.output_text == ref.choices[0].message.content
    assert nxt.usage.input_tokens == ref.usage.prompt_tokens
    # the session kept its KV: all of the first prompt but its generation-prompt token
    assert nxt.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 1
    assert session_of(nxt)["cached_source"] == "session"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(aborted_id)
    for replica, terms in replica_memory().items():  # nothing leaked by the aborted turn
        assert terms["total"] == terms["free"] + terms["evictable"] + terms["protected"] + (
            terms["held"] + terms["in_flight"]
        ), replica


def test_a_stream_cut_by_max_output_tokens_ends_incomplete(client) -> None:
    events = list(
        client.responses.create(
            model=None, input=words(205, 206), max_output_tokens=2, temperature=0, stream=True
        )
    )
    last = events[-1]
    assert last.type == "response.incomplete" and last.response.status == "incomplete"
    assert last.response.incomplete_details.reason == "max_output_tokens"
    assert last.response.usage.output_tokens == 2
    assert client.responses.retrieve(last.response.id).status == "incomplete"


def long_text(n: int, start: int = 0) -> str:
    return words(*(5 + (start + i) % 250 for i in range(n)))


def test_truncation_disabled_refuses_overflow_and_auto_drops_the_oldest_turns(client) -> None:
    first = respond(client, long_text(1200), max_output_tokens=4)  # context: 2048 tokens
    second_input = long_text(900, start=7)
    with pytest.raises(openai.BadRequestError) as err:  # truncation defaults to "disabled"
        respond(client, second_input, first, max_output_tokens=4)
    assert "maximum context length" in err.value.body["message"]
    cut = respond(client, second_input, first, max_output_tokens=4, truncation="auto")
    assert session_of(cut)["truncated_items"] == 2  # the first turn: its input and output
    assert cut.truncation == "auto"
    alone = [{"role": "user", "content": second_input}]
    assert cut.output_text == chat_text(client, alone, max_tokens=4)
    assert [it.content[0].text for it in client.responses.input_items.list(cut.id).data] == [
        second_input
    ]
    with pytest.raises(openai.BadRequestError):  # the new input alone does not fit: no cut helps
        respond(client, long_text(2100), first, truncation="auto")


def test_function_call_items_carry_a_conversation_through_previous_response_id(client) -> None:
    """An agent SDK's conversation: a call and its output as input items (here with
    tool_choice none: the test model's word tokenizer cannot write a constrained call); they
    are stored as sent and the chain goes on in the same session."""
    tool = {"type": "function", "name": "f", "parameters": {"type": "object"}}
    items = [
        {"role": "user", "content": words(5, 6)},
        {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": words(7)},
    ]
    first = client.responses.create(
        model=None,
        input=items,
        tools=[tool],
        tool_choice="none",
        temperature=0,
        max_output_tokens=4,
    )
    assert first.tools[0].name == "f" and first.tool_choice == "none"
    assert [o.type for o in first.output] == ["message"]
    stored = client.responses.input_items.list(first.id, order="asc").data
    assert [it.type for it in stored] == ["message", "function_call", "function_call_output"]
    assert stored[1].call_id == "call_1" and stored[2].output == words(7)
    second = client.responses.create(
        model=None,
        previous_response_id=first.id,
        input=words(8),
        tools=[tool],
        tool_choice="none",
        temperature=0,
        max_output_tokens=4,
    )
    assert session_of(second)["id"] == session_of(first)["id"]
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 1
