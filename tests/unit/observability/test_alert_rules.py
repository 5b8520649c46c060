"""The alert rules pass `promtool check rules` and their `promtool test rules` unit tests."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.e2e.prometheus import ensure_prometheus

RULES_DIR = Path(__file__).resolve().parents[3] / "deploy" / "prometheus"


@pytest.fixture(scope="module")
def promtool() -> str:
    if ensure_prometheus() is None or shutil.which("promtool") is None:
        pytest.skip("promtool (Debian's prometheus package) cannot be installed here")
    return shutil.which("promtool")


def test_rules_are_valid(promtool: str) -> None:
    out = subprocess.run(
        [promtool, "check", "rules", str(RULES_DIR / "alerts.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "5 rules found" in out.stdout


def test_rules_fire_when_they_should(promtool: str) -> None:
    out = subprocess.run(
        [promtool, "test", "rules", "alerts_test.yml"],
        cwd=RULES_DIR,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr
