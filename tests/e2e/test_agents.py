"""Agents on the default model, served by `serve run` as a user starts it: the official
`openai` client's tool calls (chat, streamed and not, parsed by its own helpers; Responses
function calls continued through previous_response_id), the `openai-agents` SDK running a
two-tool agent for six tool rounds through either API, and JSON answers for a randomized set
of schemas. Every call parses and validates, and every later step reuses the KV of the steps
before it (cached tokens)."""

from __future__ import annotations

import asyncio
import json
import random
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pydantic
import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]
MODEL = "SmolLM2-135M-Instruct"
ROUNDS = 6


class GetWeather(pydantic.BaseModel):
    """The current weather in a city."""

    model_config = pydantic.ConfigDict(extra="forbid")  # no other keys (the schema says so)
    city: str = pydantic.Field(max_length=30)
    unit: str = pydantic.Field(pattern="^(celsius|fahrenheit)$")


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=1, timeout=120)


def test_chat_tool_calls_parse_with_the_official_clients_helpers(served_default_model) -> None:
    c = client(served_default_model)
    tool = openai.pydantic_function_tool(GetWeather)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    ask = {
        "model": MODEL,
        "messages": messages,
        "tools": [tool],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_tokens": 64,
        "temperature": 0,
    }
    parsed = c.chat.completions.parse(**ask, extra_headers={"x-session-id": "e2e-tools"})
    choice = parsed.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert isinstance(call.function.parsed_arguments, GetWeather)  # the client validated it
    # streamed: the official stream helper assembles the deltas into the same kind of call
    with c.chat.completions.stream(**ask) as stream:
        kinds = {event.type for event in stream}
        streamed = stream.get_final_completion()
    assert "tool_calls.function.arguments.delta" in kinds
    (scall,) = streamed.choices[0].message.tool_calls
    assert isinstance(scall.function.parsed_arguments, GetWeather)
    assert scall.function.arguments == call.function.arguments  # greedy: the same call
    # the result goes back in the session: the whole last step is reused
    messages += [
        {
            "role": "assistant",
            "content": choice.message.content,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"},
    ]
    after = c.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=[tool],
        max_tokens=24,
        temperature=0,
        extra_headers={"x-session-id": "e2e-tools"},
    )
    usage = after.usage
    step = parsed.usage.prompt_tokens + parsed.usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens >= step - 1  # all but the last token
    assert usage.prompt_tokens - usage.prompt_tokens_details.cached_tokens < 70  # the result


def test_responses_function_calls_continue_through_previous_response_id(
    served_default_model,
) -> None:
    c = client(served_default_model)
    tools = [
        {
            "type": "function",
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": GetWeather.model_json_schema(),
            "strict": True,
        }
    ]
    first = c.responses.create(
        model=MODEL,
        input="What is the weather in Rome?",
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=64,
        temperature=0,
    )
    (call,) = [item for item in first.output if item.type == "function_call"]
    GetWeather.model_validate_json(call.arguments)
    assert first.status == "completed" and first.tools[0].name == "get_weather"
    second = c.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Rainy."}],
        tools=tools,
        max_output_tokens=24,
        temperature=0,
    )
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    # streamed, the events carry the call as it is made
    events = list(
        c.responses.create(
            model=MODEL,
            input="What is the weather in Oslo?",
            tools=tools,
            tool_choice={"type": "function", "name": "get_weather"},
            parallel_tool_calls=False,
            max_output_tokens=64,
            temperature=0,
            stream=True,
        )
    )
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert "".join(deltas) == done.arguments
    GetWeather.model_validate_json(done.arguments)
    assert events[-1].type == "response.completed"


async def run_agent(base: str, api: str) -> tuple[list[tuple[str, int, int]], list]:
    """A two-tool agent for ROUNDS tool rounds (the model must call a tool each step; the
    agent ends after the sixth call): the calls its tools received and the model's raw
    responses."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        ToolsToFinalOutputResult,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    calls: list[tuple[str, int, int]] = []

    @function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        calls.append(("add", a, b))
        return a + b

    @function_tool
    def multiply(a: int, b: int) -> int:
        """Multiply two integers."""
        calls.append(("multiply", a, b))
        return a * b

    async def six_rounds(ctx, results) -> ToolsToFinalOutputResult:
        done = len(calls) >= ROUNDS
        return ToolsToFinalOutputResult(done, str(results[-1].output) if done else None)

    aclient = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", timeout=120)
    settings = {"tool_choice": "required", "parallel_tool_calls": False, "temperature": 0}
    if api == "responses":
        model = OpenAIResponsesModel(MODEL, aclient)
    else:  # chat completions keep their KV in a session named by the header
        model = OpenAIChatCompletionsModel(MODEL, aclient)
        settings["extra_headers"] = {"x-session-id": "e2e-agent-chat"}
    agent = Agent(
        name="calculator",
        instructions="You are a calculator. Use the tools to work out the answer.",
        tools=[add, multiply],
        model=model,
        model_settings=ModelSettings(max_tokens=64, **settings),
        reset_tool_choice=False,
        tool_use_behavior=six_rounds,
    )
    result = await Runner.run(
        agent,
        "What is (2 + 3) * 4?",
        max_turns=ROUNDS + 2,
        auto_previous_response_id=api == "responses",  # the chain is one session
    )
    await aclient.close()
    assert result.final_output is not None
    return calls, result.raw_responses


@pytest.mark.parametrize("api", ["responses", "chat"])
def test_an_openai_agents_sdk_agent_runs_six_tool_rounds(served_default_model, api) -> None:
    calls, responses = asyncio.run(run_agent(served_default_model, api))
    assert len(calls) == ROUNDS == len(responses)  # a call a step, each one run
    assert all(name in ("add", "multiply") and isinstance(a, int) for name, a, _ in calls)
    cached = [r.usage.input_tokens_details.cached_tokens for r in responses]
    inputs = [r.usage.input_tokens for r in responses]
    for step in range(1, ROUNDS):  # each step prefills the tool result, not the history
        assert cached[step] >= inputs[step - 1], (cached, inputs)


def random_schema(rng: random.Random) -> dict:
    leaves = [
        {"type": "integer", "minimum": 0, "maximum": 100},
        {"type": "boolean"},
        {"type": "string", "maxLength": 12},
        {"enum": ["red", "green", "blue"]},
        {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3},
        {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
    ]  # bounded: every answer can end within max_tokens
    names = rng.sample(["name", "age", "color", "ok", "tags", "score", "city"], rng.randint(1, 4))
    props = {n: rng.choice(leaves) for n in names}
    return {
        "type": "object",
        "properties": props,
        "required": sorted(props),
        "additionalProperties": False,
    }


def test_json_schema_answers_validate_for_random_schemas(served_default_model) -> None:
    c = client(served_default_model)
    rng = random.Random(26)
    schemas = [random_schema(rng) for _ in range(8)]

    def ask(i_schema):
        i, schema = i_schema
        return c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"Describe a person, as JSON ({i})."}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": f"s{i}", "schema": schema, "strict": True},
            },
            max_tokens=160,
            temperature=0.8,
            seed=i,
        )

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, enumerate(schemas)))
    for schema, answer in zip(schemas, answers, strict=True):
        choice = answer.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), schema)
