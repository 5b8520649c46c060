from __future__ import annotations

from dataclasses import dataclass

import pytest

from sessionserve.cache import MemoryChecker, SessionCache, SessionLimits, build_session_cache
from tests.unit.cache.kvdriver import Driver, Turn


@dataclass
class Rig:
    cache: SessionCache
    check: MemoryChecker
    drive: Driver

    def turn(self, session_id: str | None, rid: str, tokens: list[int], mode: str = "append"):
        if session_id is None:
            from sessionserve.cache import RequestKV

            req = RequestKV(rid=rid)
        else:
            req = self.cache.start_turn(session_id, rid)
        return Turn(req=req, tokens=list(tokens), prompt_len=len(tokens), mode=mode)

    def busy(self, *turns: Turn):
        return self.check.check_busy([t.req for t in turns if t.req.is_live])

    def all_free(self) -> None:
        """Close every session, flush the tree: every slot and row must be free."""
        for sid in list(self.cache.session_slots):
            assert self.cache.close_session(sid), f"session {sid} still has a turn in flight"
        self.cache.flush()
        t = self.check.check_idle()
        assert t.free == t.total and t.rows_free == t.rows_total, t
        assert t.sliding_free == t.sliding_total, t


@pytest.fixture
def make_rig():
    def make(
        page: int = 4,
        num_slots: int | None = None,
        rows: int = 16,
        host_tier_bytes: int | None = None,
        sliding_window: int | None = None,
        sliding_slots: int | None = None,
        **limits,
    ) -> Rig:
        cache = build_session_cache(
            num_slots=num_slots or max(page * 64, 2048),
            page_size=page,
            max_rows=rows,
            max_context_len=4096,
            limits=SessionLimits(**limits),
            sliding_window=sliding_window,
            sliding_slots=sliding_slots,
        )
        return Rig(cache, MemoryChecker(cache), Driver(cache, host_tier_bytes=host_tier_bytes))

    return make
