"""`serve run` from this repository, as a user starts it: the default model on two replicas
(deploy/serve-cpu.yaml) answers a two-turn chat over HTTP, reusing the session's KV, and the
server stops within seconds of Ctrl-C, leaving no process behind; its JSON answers (the
official client's structured-output helpers, the Responses API's text.format) parse; Gemma 3 270M, a
sliding-window base model (deploy/serve-gemma3-cpu.yaml), continues a completions session past
its window on the KV it holds and refuses chat with a 400 that says why (its exactness against
transformers is tests/unit/replicas/test_gemma3_model.py's)."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import httpx
import openai
import pydantic
import pytest

from tests.markers import needs_gemma3
from tests.process_group import group_gone

pytestmark = [pytest.mark.ray, pytest.mark.slow]
CTRL_C_EXIT_S = 20  # measured ~9 s on 2 cores: replicas stop, then Ray shuts down


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=24)
    country: str = pydantic.Field(max_length=24)


def ctrl_c(proc: subprocess.Popen) -> float:
    """Send SIGINT to the server's process group, as Ctrl-C in its terminal does; the
    seconds until `serve run` exited and every process of its group was gone."""
    started = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    proc.wait(CTRL_C_EXIT_S)
    if not group_gone(proc.pid, CTRL_C_EXIT_S - (time.monotonic() - started)):
        raise AssertionError(
            f"processes of the server's group outlived Ctrl-C by {CTRL_C_EXIT_S} s"
        )
    return time.monotonic() - started


def test_serve_run_answers_a_two_turn_chat_and_stops_on_ctrl_c(serve_run) -> None:
    base, proc = serve_run.base, serve_run.proc
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=2, timeout=120)
    hdr = {"x-session-id": "e2e-chat"}
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    first = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=messages,
        max_tokens=32,
        temperature=0,
        extra_headers=hdr,
    )
    assert "Paris" in first.choices[0].message.content
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And what is the capital of Germany?"},
    ]
    second = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=messages,
        max_tokens=32,
        temperature=0,
        extra_headers=hdr,
    )
    assert "Berlin" in second.choices[0].message.content
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    # structured output, as the official client's helpers ask for it: every answer parses
    city = client.chat.completions.parse(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "Name the capital of Italy and its country."}],
        response_format=City,
        max_tokens=48,
        temperature=0,
    )
    assert city.choices[0].finish_reason == "stop"
    assert isinstance(city.choices[0].message.parsed, City)
    fmt = {"type": "json_schema", "name": "city", "schema": City.model_json_schema()}
    answer = client.responses.create(
        model="SmolLM2-135M-Instruct",
        input="Name the capital of Spain and its country.",
        text={"format": fmt},
        max_output_tokens=48,
        temperature=0,
    )
    City.model_validate_json(answer.output_text)
    assert answer.text.format.type == "json_schema"
    seconds = ctrl_c(proc)
    print(f"serve run stopped {seconds:.1f} s after Ctrl-C")
    log = serve_run.log_path.read_text()
    assert proc.returncode == 0, log[-3000:]
    assert "Got KeyboardInterrupt, shutting down" in log


@needs_gemma3
def test_gemma3_serves_a_completions_session_past_its_window(serve_run_gemma3) -> None:
    base = serve_run_gemma3.base
    httpx.get(f"{base}/openapi.json", timeout=400).raise_for_status()  # a replica is up
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)
    hdr = {"x-session-id": "e2e-gemma"}
    text = "The history of the river town, told by its oldest boatman. " * 60  # > 512 tokens
    first = client.completions.create(
        model="gemma-3-270m", prompt=text, max_tokens=8, temperature=0, extra_headers=hdr
    )
    assert first.usage.prompt_tokens > 512 and first.choices[0].text
    second = client.completions.create(
        model="gemma-3-270m", prompt=" And then", max_tokens=8, temperature=0, extra_headers=hdr
    )
    held = first.usage.prompt_tokens + first.usage.completion_tokens
    assert (
        second.usage.prompt_tokens > held
        and second.usage.prompt_tokens_details.cached_tokens >= held - 1
    )
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="gemma-3-270m", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
    assert err.value.body["param"] == "messages" and "chat template" in err.value.body["message"]
