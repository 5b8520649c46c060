"""The published contract: what the OpenAPI schema says a request may hold is what the server
accepts. Each body below is judged twice, by the published schema (jsonschema, the schema's
own dialect) and by the server's checks (the request model, then the checks behind it:
the engine's sampling bounds, the prompt check, the Responses API's refusals and input
parsing); the two verdicts must agree."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import ValidationError

from sessionserve.api.errors import install_error_handlers
from sessionserve.api.ingress import app
from sessionserve.api.openapi import published_schema
from sessionserve.api.protocol import ChatCompletionRequest, CompletionRequest
from sessionserve.api.responses.protocol import ResponseCreate, parse_input
from sessionserve.errors import InvalidRequestError
from sessionserve.replicas.request import check_prompt_ids
from sessionserve.wire import SamplingParams

CONTEXT, VOCAB, HEADER = 1000, 50, "x-sid"  # the default max_tokens (256) fits
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def spec() -> dict[str, Any]:
    return published_schema(app.openapi(), HEADER, context_limit=CONTEXT, vocab_size=VOCAB)


def schema_accepts(spec: dict[str, Any], model: str, body: dict[str, Any]) -> bool:
    root = {"$ref": f"#/components/schemas/{model}", "components": spec["components"]}
    return jsonschema.Draft202012Validator(root).is_valid(body)


def server_accepts(model: str, body: dict[str, Any]) -> bool:
    """The ingress's checks, then the replica's prompt check (a text prompt is tokenized
    there: only its emptiness is judged here)."""
    try:
        if model == "ResponseCreate":
            request = ResponseCreate.model_validate(body)
            request.refuse_unsupported()
            request.tool_use()
            parse_input(request.input)
        else:
            request = {"ChatCompletionRequest": ChatCompletionRequest}.get(
                model, CompletionRequest
            ).model_validate(body)
            if model == "ChatCompletionRequest":
                request.tool_use()
        kwargs = {k: v for k, v in request.sampling_kwargs().items() if v is not None}
        sampling = SamplingParams.build(**kwargs)
        if model == "CompletionRequest":
            prompt = request.prompt
            check_prompt_ids(prompt if isinstance(prompt, list) else [0] * len(prompt), VOCAB)
        if sampling.max_tokens >= CONTEXT:  # the context check with a 1-token input
            return False
    except (ValidationError, InvalidRequestError):
        return False
    return True


CASES = [
    # chat: the engine's sampling bounds
    ("ChatCompletionRequest", {"temperature": 0}, True),
    ("ChatCompletionRequest", {"temperature": 1e-5}, False),  # below MIN_TEMPERATURE
    ("ChatCompletionRequest", {"temperature": 1e-4}, True),
    ("ChatCompletionRequest", {"temperature": 2.5}, False),
    ("ChatCompletionRequest", {"top_p": 1e-9}, False),
    ("ChatCompletionRequest", {"repetition_penalty": 0.001}, False),
    ("ChatCompletionRequest", {"seed": 2**64}, False),
    ("ChatCompletionRequest", {"seed": 2**64 - 1}, True),
    ("ChatCompletionRequest", {"stop": ""}, False),
    ("ChatCompletionRequest", {"stop": ["a", ""]}, False),
    ("ChatCompletionRequest", {"stop": ["a"] * 5}, False),
    ("ChatCompletionRequest", {"stop": ["a"] * 4}, True),
    ("ChatCompletionRequest", {"max_tokens": CONTEXT - 1}, True),
    ("ChatCompletionRequest", {"max_tokens": CONTEXT}, False),
    ("ChatCompletionRequest", {"max_completion_tokens": CONTEXT}, False),
    # types are strict, as the schema says
    ("ChatCompletionRequest", {"top_logprobs": 1.5}, False),
    ("ChatCompletionRequest", {"top_logprobs": 1.0, "logprobs": True}, True),  # JSON: 1.0 == 1
    ("ChatCompletionRequest", {"logprobs": 1}, False),
    ("ChatCompletionRequest", {"max_tokens": "3"}, False),
    ("ChatCompletionRequest", {"max_tokens": True}, False),
    ("CompletionRequest", {"prompt": [1.0, 2]}, True),
    ("ChatCompletionRequest", {"session_id": "a b"}, False),
    ("ChatCompletionRequest", {"session_id": "chat-1:2"}, True),
    # structured output: OpenAI's response_format shapes
    ("ChatCompletionRequest", {"response_format": {"type": "json_object"}}, True),
    ("ChatCompletionRequest", {"response_format": {"type": "text"}}, True),
    ("ChatCompletionRequest", {"response_format": {"type": "xml"}}, False),
    (
        "ChatCompletionRequest",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "r", "strict": True}}},
        True,
    ),
    (
        "CompletionRequest",
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
        False,  # a json_schema has a name
    ),
    # completions: a non-empty prompt of the vocabulary's ids
    ("CompletionRequest", {"prompt": ""}, False),
    ("CompletionRequest", {"prompt": []}, False),
    ("CompletionRequest", {"prompt": [VOCAB - 1]}, True),
    ("CompletionRequest", {"prompt": [VOCAB]}, False),
    ("CompletionRequest", {"prompt": [-1]}, False),
    ("CompletionRequest", {"prompt": "x", "echo": 0}, False),
    # Responses: unsupported fields only with their "not used" values
    ("ResponseCreate", {"tools": [], "tool_choice": "auto", "include": []}, True),
    ("ResponseCreate", {"service_tier": "default", "background": False}, True),
    ("ResponseCreate", {"text": {"format": {"type": "text"}}, "top_logprobs": 0}, True),
    ("ResponseCreate", {"text": {"format": {"type": "json_object"}}}, True),
    ("ResponseCreate", {"text": {"format": {"type": "json_schema", "name": "a"}}}, True),
    ("ResponseCreate", {"text": {"format": {"type": "json_schema", "name": "a b"}}}, False),
    ("ResponseCreate", {"text": {"format": {"type": "json_schema"}}}, False),  # no name
    # Responses: function tools; built-in ones and other choices are refused
    ("ResponseCreate", {"tools": [{"type": "function", "name": "f"}]}, True),
    ("ResponseCreate", {"tools": [{"type": "function", "name": "f g"}]}, False),
    ("ResponseCreate", {"tools": [{"type": "function", "name": "f", "x": 1}]}, False),
    ("ResponseCreate", {"tools": [{"type": "web_search"}]}, False),
    ("ResponseCreate", {"tool_choice": {"type": "web_search"}}, False),
    ("ResponseCreate", {"tool_choice": "sometimes"}, False),
    ("ResponseCreate", {"parallel_tool_calls": 1}, False),
    # chat: function tools, and the calls and results of earlier turns
    ("ChatCompletionRequest", {"tools": [{"type": "function", "function": {"name": "f"}}]}, True),
    ("ChatCompletionRequest", {"tools": [{"type": "custom", "custom": {"name": "f"}}]}, False),
    ("ChatCompletionRequest", {"tool_choice": "sometimes"}, False),
    (
        "ChatCompletionRequest",
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c",
                            "type": "function",
                            "function": {"name": "f", "arguments": "{}"},
                        }
                    ],
                },
                {"role": "tool", "content": "3", "tool_call_id": "c"},
            ]
        },
        True,
    ),
    ("ChatCompletionRequest", {"messages": [{"role": "tool", "content": "3"}]}, False),
    ("ChatCompletionRequest", {"messages": [{"role": "user", "content": None}]}, False),
    (
        "ChatCompletionRequest",
        {"messages": [{"role": "user", "content": "a", "tool_calls": []}]},
        False,
    ),
    ("ResponseCreate", {"text": {"verbosity": "low"}}, False),
    ("ResponseCreate", {"text": {"format": "text"}}, False),
    ("ResponseCreate", {"background": True}, False),
    ("ResponseCreate", {"reasoning": {}}, False),
    ("ResponseCreate", {"conversation": "c"}, False),
    ("ResponseCreate", {"service_tier": "flex"}, False),
    ("ResponseCreate", {"top_logprobs": 2}, False),
    ("ResponseCreate", {"metadata": {"k" * 65: "v"}}, False),
    ("ResponseCreate", {"metadata": {"k": "v" * 513}}, False),
    ("ResponseCreate", {"metadata": {"k" * 64: "v" * 512}}, True),
    ("ResponseCreate", {"temperature": 1e-5}, False),
    ("ResponseCreate", {"max_output_tokens": CONTEXT}, False),
]
# Responses input: text messages, function calls and their outputs
INPUTS = [
    ("", True),
    ([], False),
    ([{"role": "user", "content": "a"}], True),
    ([{"type": "message", "role": "developer", "content": "a", "id": 3, "status": None}], True),
    ([{"role": "assistant", "content": [{"type": "output_text", "text": "b"}]}], True),
    ([{"role": "user", "content": [{"type": "input_text", "text": "b", "x": 1}]}], True),
    ([{"role": "user", "content": []}], False),
    ([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}], False),
    ([{"role": "user", "content": [{"type": "input_text"}]}], False),
    ([{"role": "user", "content": ["a"]}], False),
    ([{"role": "robot", "content": "a"}], False),
    ([{"role": "user"}], False),
    ([{"content": "a"}], False),
    ([{"type": "function_call_output", "call_id": "c", "output": "o"}], True),
    (
        [
            {
                "type": "function_call_output",
                "call_id": "c",
                "output": [{"type": "input_text", "text": "o"}],
            }
        ],
        True,
    ),
    ([{"type": "function_call_output", "call_id": "", "output": "o"}], False),
    ([{"type": "function_call_output", "call_id": "c"}], False),
    ([{"type": "function_call_output", "call_id": "c", "output": 3}], False),
    ([{"type": "function_call_output", "call_id": "c", "output": "o", "x": 1}], False),
    (
        [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}", "id": "fc_1"}],
        True,
    ),
    ([{"type": "function_call", "call_id": "c", "name": "f"}], False),
    ([{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}], False),
    ([{"type": "item_reference", "id": "msg_1"}], False),
    ([{"role": "user", "content": "a", "extra": 1}], False),
]


@pytest.mark.parametrize(("model", "fields", "accepted"), CASES)
def test_the_schema_and_the_server_agree_on_a_body(spec, model, fields, accepted) -> None:
    base = {"ResponseCreate": {"input": "hi"}, "CompletionRequest": {"prompt": [1]}}
    body = {**base.get(model, {"messages": MSG}), **fields}
    assert server_accepts(model, body) is accepted, body
    assert schema_accepts(spec, model, body) is accepted, body


@pytest.mark.parametrize(("value", "accepted"), INPUTS)
def test_the_schema_and_the_server_agree_on_responses_input(spec, value, accepted) -> None:
    body = {"input": value}
    assert server_accepts("ResponseCreate", body) is accepted, body
    assert schema_accepts(spec, "ResponseCreate", body) is accepted, body


def test_the_deployments_limits_and_session_header_are_published(spec) -> None:
    paths = spec["paths"]
    for path in ("/v1/chat/completions", "/v1/completions"):
        (header,) = [p for p in paths[path]["post"]["parameters"] if p["in"] == "header"]
        assert header["name"] == HEADER and not header["required"]
        assert header["schema"]["pattern"].startswith("^[A-Za-z0-9]")
    assert "parameters" not in paths["/v1/responses"]["post"]  # no session header there
    for path in ("/v1/sessions/{session_id}", "/v1/sessions/{session_id}/park"):
        for op in paths[path].values():
            (param,) = [p for p in op["parameters"] if p["name"] == "session_id"]
            assert param["schema"]["pattern"] and "example" not in param
    max_tokens = spec["components"]["schemas"]["CompletionRequest"]["properties"]["max_tokens"]
    assert str(CONTEXT) in max_tokens["description"]
    for op in (op for item in paths.values() for op in item.values()):
        assert "422" not in op["responses"]  # validation errors are 400s
    assert "HTTPValidationError" not in spec["components"]["schemas"]
    assert "422" in app.openapi()["paths"]["/v1/completions"]["post"]["responses"]  # a copy


def test_an_undeclared_method_is_a_405_that_lists_every_method_of_the_path() -> None:
    api = FastAPI()
    install_error_handlers(api)
    api.get("/items/{i}")(lambda i: {})
    api.delete("/items/{i}")(lambda i: {})
    with TestClient(api) as client:
        for method in ("POST", "PUT", "TRACE", "OPTIONS"):
            r = client.request(method, "/items/1")
            assert r.status_code == 405 and r.headers["allow"] == "DELETE, GET", method
            assert r.json()["error"]["type"] == "invalid_request_error"
        assert "allow" not in client.get("/nowhere").headers  # a 404 names no methods
