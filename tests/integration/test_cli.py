"""The `sessionserve` command line against the served app."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray
CLI = [str(Path(sys.executable).with_name("sessionserve"))]


def test_chat_holds_a_multi_turn_conversation(served) -> None:
    out = subprocess.run(
        CLI + ["chat", "--url", served["base"], "--max-tokens", "6"],
        input="w5 w6 w7\nw8 w9\n\n",
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    turns = [ln for ln in out.splitlines() if " reused" in ln]
    assert len(turns) == 2
    assert turns[0].endswith(" 0 reused]")  # a new session's first turn: nothing to reuse
    assert turns[1].endswith(" reused from the session]") and " 0 reused" not in turns[1]
    assert "session closed" in out


def test_config_schema_is_json_with_descriptions() -> None:
    out = subprocess.run(
        CLI + ["config-schema"], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    schema = json.loads(out)
    assert {"engine", "replica", "ingress", "session_header"} <= set(schema["properties"])
    cache = schema["$defs"]["CacheConfig"]["properties"]
    assert all(field.get("description") for field in cache.values())
