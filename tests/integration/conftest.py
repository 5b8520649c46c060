"""Clients of the shared test app (`served`, tests/conftest.py) and the tiny model's words."""

from __future__ import annotations

import httpx
import openai
import pytest


def words(*ids: int) -> str:
    """Text the tests' word tokenizer reads as exactly these token ids."""
    return " ".join(f"w{i}" for i in ids)


@pytest.fixture
def client(served) -> openai.OpenAI:
    """The official `openai` client on the test app."""
    return openai.OpenAI(base_url=f"{served['base']}/v1", api_key="unused", max_retries=0)


@pytest.fixture
def http(served) -> httpx.Client:
    with httpx.Client(base_url=served["base"], timeout=60) as c:
        yield c
