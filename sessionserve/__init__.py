"""sessionserve: LLM serving on Ray Serve with streaming sessions.

A multi-turn conversation is pinned to one replica, which keeps the conversation's KV cache
resident between turns, so turn N prefills only what is new. See README.md and
docs/architecture.md.
"""

__version__ = "0.1.0"
