"""The Responses API's pure parts: input items, the oldest-turn cut, item pages, events."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from sessionserve.api.responses.objects import ResponseDraft, ResponseEvents, item_page
from sessionserve.api.responses.protocol import (
    ResponseCreate,
    chat_messages,
    drop_oldest_turn,
    message_item,
    parse_input,
)
from sessionserve.errors import InvalidRequestError
from sessionserve.wire import ToolCall, ToolCallDelta, TurnDelta, TurnResult


def test_input_forms_become_message_items_and_chat_messages() -> None:
    items = parse_input(
        [
            {"role": "developer", "content": "be brief"},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}]},
            {"role": "assistant", "content": [{"type": "output_text", "text": "b"}]},
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "c"},
                    {"type": "input_text", "text": "d"},
                ],
            },
        ]
    )
    assert [it["role"] for it in items] == ["developer", "user", "assistant", "user"]
    assert items[2]["content"][0]["type"] == "output_text"  # assistant items carry output_text
    assert len({it["id"] for it in items}) == 4 and all(it["id"].startswith("msg") for it in items)
    assert chat_messages("sys", items) == [
        {"role": "system", "content": "sys"},
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "cd"},
    ]
    assert [it["role"] for it in parse_input("hello")] == ["user"]


@pytest.mark.parametrize(
    ("value", "param"),
    [
        ([], "input"),
        ([{"type": "item_reference", "id": "msg_1"}], "input[0].type"),
        ([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}], "input[1].role"),
        (
            [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}],
            "input[0].content[0].type",
        ),
        ([{"role": "user", "content": []}], "input[0].content"),
        ([{"role": "user", "content": "a", "extra": 1}], "input[0].extra"),
    ],
)
def test_bad_input_names_the_exact_place(value, param) -> None:
    with pytest.raises(InvalidRequestError) as err:
        parse_input(value)
    assert err.value.param == param


def test_unsupported_fields_are_refused_and_neutral_values_accepted() -> None:
    neutral = ResponseCreate(
        input="x",
        tools=[],
        tool_choice="none",
        parallel_tool_calls=True,
        text={"format": {"type": "text"}},
        include=[],
        service_tier="auto",
    )
    neutral.refuse_unsupported()  # what SDKs send by default passes
    for field, value in [
        ("max_tool_calls", 3),
        ("service_tier", "flex"),
        ("stream_options", {}),
    ]:
        with pytest.raises(InvalidRequestError) as err:
            ResponseCreate(input="x", **{field: value}).refuse_unsupported()
        assert err.value.param == field


def test_the_oldest_turn_goes_first_and_the_new_input_never() -> None:
    u, a = message_item("user", "u"), message_item("assistant", "a")
    items = [u, a, a, u, a, u]  # turn 1 (with two outputs), turn 2, the new input
    assert drop_oldest_turn(items, keep=1) == 3
    assert drop_oldest_turn(items[3:], keep=1) == 2
    assert drop_oldest_turn(items[5:], keep=1) == 0  # only the new input is left
    assert drop_oldest_turn([u, a, u, u], keep=2) == 2  # never into the new input


def test_item_pages_follow_order_limit_and_cursor() -> None:
    items = [message_item("user", str(i)) for i in range(5)]
    ids = [it["id"] for it in items]
    page = item_page(items, 2, "desc", None)
    assert [it["id"] for it in page["data"]] == ids[::-1][:2] and page["has_more"]
    nxt = item_page(items, 2, "desc", page["last_id"])
    assert [it["id"] for it in nxt["data"]] == ids[::-1][2:4]
    last = item_page(items, 10, "asc", ids[2])
    assert [it["id"] for it in last["data"]] == ids[3:] and not last["has_more"]
    with pytest.raises(InvalidRequestError):
        item_page(items, 2, "asc", "msg_unknown")


def test_events_are_numbered_and_carry_the_finished_response() -> None:
    draft = ResponseDraft(ResponseCreate(input="x"), "m", "s1")
    events = ResponseEvents(draft)
    final = TurnResult(
        finish_reason="stop",
        finish_message=None,
        text="ab",
        output_ids=[7, 8],
        prompt_tokens=3,
        completion_tokens=2,
        cached_tokens=1,
        cached_source="session",
        log_base=0,
        log_tail=[4, 5, 6, 7, 8],
    )
    stream = events.opening() + [events.delta(piece("a")), events.delta(piece("b"))]
    stream += events.closing(draft.object(final, "ab"))
    assert events.delta(piece("")) is None
    bodies = sse_bodies(stream)
    assert [b["type"] for b in bodies] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    done = bodies[-1]
    assert done["type"] == "response.completed" and done["response"]["status"] == "completed"
    assert done["response"]["output"][0]["content"][0]["text"] == "ab"
    assert done["response"]["usage"]["input_tokens_details"]["cached_tokens"] == 1
    cut = draft.object(replace(final, finish_reason="length"), "ab")
    assert cut["status"] == "incomplete" and cut["incomplete_details"] == {
        "reason": "max_output_tokens"
    }


def piece(text: str, calls: list[ToolCallDelta] | None = None) -> TurnDelta:
    return TurnDelta([], text, [], calls or [])


def sse_bodies(stream: list[str]) -> list[dict]:
    """The events' bodies, checking that each is numbered in order and named as its type."""
    chunks = [c for c in "".join(stream).split("event: ") if c]
    bodies = [json.loads(c.split("data: ", 1)[1]) for c in chunks]
    assert [b["sequence_number"] for b in bodies] == list(range(len(bodies)))
    assert all(c.startswith(f"{b['type']}\n") for c, b in zip(chunks, bodies, strict=True))
    return bodies


def test_function_calls_stream_as_items_whose_events_add_up_to_the_final_output() -> None:
    body = ResponseCreate(
        input="x", tools=[{"type": "function", "name": "f", "parameters": {"type": "object"}}]
    )
    draft = ResponseDraft(body, "m", "s1")
    events = ResponseEvents(draft)
    calls = [ToolCall("call_1", "f", '{"a":1}'), ToolCall("call_2", "f", "{}")]
    final = TurnResult("tool_calls", None, "hm", [], 3, 9, 0, "none", 0, [], tool_calls=calls)
    stream = events.opening() + [
        events.delta(piece("h")),
        events.delta(piece("m", [ToolCallDelta(0, "", id="call_1", name="f")])),
        events.delta(piece("", [ToolCallDelta(0, '{"a"')])),
        events.delta(piece("", [ToolCallDelta(0, ":1}"), ToolCallDelta(1, "{}", "call_2", "f")])),
    ]
    response = draft.object(final, "hm")
    stream += events.closing(response)
    bodies = sse_bodies(stream)
    kinds = [b["type"] for b in bodies]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",  # the message
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",  # call 1
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added",  # call 2
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    output = response["output"]
    assert [o["type"] for o in output] == ["message", "function_call", "function_call"]
    assert response["tool_choice"] == "auto" and response["tools"][0]["name"] == "f"
    done_items = [b["item"] for b in bodies if b["type"] == "response.output_item.done"]
    assert done_items == output  # what streamed is what the response holds
    for index, call in ((1, calls[0]), (2, calls[1])):
        args = "".join(
            b["delta"]
            for b in bodies
            if b["type"] == "response.function_call_arguments.delta" and b["output_index"] == index
        )
        assert args == call.arguments == output[index]["arguments"]
        assert output[index]["call_id"] == call.id and output[index]["id"].startswith("fc_")


def test_an_answer_of_calls_only_has_no_message_item_and_comes_back_as_tool_messages() -> None:
    draft = ResponseDraft(ResponseCreate(input="x"), "m", "s1")
    call = ToolCall("call_1", "f", '{"a":1}')
    final = TurnResult("tool_calls", None, "", [], 3, 9, 0, "none", 0, [], tool_calls=[call])
    output = draft.object(final, "")["output"]
    assert [o["type"] for o in output] == ["function_call"]
    items = parse_input(
        [
            {"role": "user", "content": "add"},
            *output,  # as an agent SDK sends the conversation back
            {"type": "function_call_output", "call_id": "call_1", "output": "2"},
        ]
    )
    assert chat_messages(None, items) == [
        {"role": "user", "content": "add"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "2", "tool_call_id": "call_1"},
    ]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{"type": "web_search_preview"}]}, "tools[0].type"),
        ({"tools": [{"type": "function"}]}, "tools[0].name"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
        (
            {
                "tools": [{"type": "function", "name": "f"}],
                "tool_choice": {"type": "function", "name": "g"},
            },
            "tool_choice",
        ),
        ({"tools": [{"type": "function", "name": "f"}] * 2}, "tools"),
    ],
)
def test_tools_that_cannot_be_served_are_a_400_naming_them(fields, param) -> None:
    with pytest.raises(InvalidRequestError) as err:
        ResponseCreate(input="x", **fields).tool_use()
    assert err.value.param == param
