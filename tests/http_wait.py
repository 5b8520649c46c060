"""Waiting for a server under test to answer /health."""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx


def wait_healthy(base: str, timeout_s: float, alive: Callable[[], bool] = lambda: True) -> bool:
    """Poll `base`/health until it answers 200 (True), time runs out or `alive()` turns false."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and alive():
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    return False
