"""Where an ingress process's Python memory goes (a diagnostic, off by default).

With `SESSIONSERVE_TRACEMALLOC=N` in the ingress's environment, `tracemalloc` records N frames
of every Python allocation; `benchmarks/soak.py --trace-ingress` marks a baseline after its
warm-up and reads, at the end, which source lines hold what has grown since. tracemalloc
sees only allocations made through Python's allocator: growth it does not show is native
(gRPC, the allocator's arenas), which RSS alone cannot tell apart.
"""

from __future__ import annotations

import os
import tracemalloc
from typing import Any

ENV = "SESSIONSERVE_TRACEMALLOC"


class MemoryTrace:
    def __init__(self, frames: int) -> None:
        tracemalloc.start(frames)
        self.frames = frames
        self.base: tracemalloc.Snapshot | None = None

    @classmethod
    def from_env(cls) -> MemoryTrace | None:
        frames = int(os.environ.get(ENV, "0") or 0)
        return cls(frames) if frames > 0 else None

    def mark(self) -> int:
        """Take the baseline; returns the traced bytes now."""
        self.base = self._snapshot()
        return sum(s.size for s in self.base.statistics("filename"))

    def growth(self, top: int = 20) -> dict[str, Any]:
        """Traced bytes now and since the mark, and the `top` tracebacks that grew most."""
        if self.base is None:
            raise RuntimeError("call mark() first")
        now = self._snapshot()
        diffs = now.compare_to(self.base, "traceback")
        return {
            "traced_bytes": sum(s.size for s in now.statistics("filename")),
            "grown_bytes": sum(d.size_diff for d in diffs),
            "top": [
                {
                    "size_diff": d.size_diff,
                    "count_diff": d.count_diff,
                    "traceback": [f"{f.filename}:{f.lineno}" for f in d.traceback],
                }
                for d in diffs[:top]
            ],
        }

    @staticmethod
    def _snapshot() -> tracemalloc.Snapshot:
        return tracemalloc.take_snapshot().filter_traces(
            [tracemalloc.Filter(False, tracemalloc.__file__)]
        )
