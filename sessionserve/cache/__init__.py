"""Memory: everything that owns KV slots, and nothing else.

`build_session_cache` wires the parts: a paged allocator (who owns which slot), request rows
(position -> slot), the radix prefix cache (shared prefixes), and the session cache (streaming
sessions) on top; with a sliding window, a second slot space for the sliding-window layers'
recent KV (`SlidingSlots`); `MemoryChecker` proves the accounting after every step.
"""

from __future__ import annotations

from sessionserve.cache.allocator import PagedAllocator, ceil_align, floor_align
from sessionserve.cache.checker import CheckSchedule, MemoryChecker, MemoryTerms
from sessionserve.cache.kv_pool import KVPool, KVShape
from sessionserve.cache.radix import RadixCache
from sessionserve.cache.req_to_token import RequestRows
from sessionserve.cache.request_kv import KVState, RequestKV, SessionSlot
from sessionserve.cache.session_cache import SessionCache, SessionLimits, TurnMode
from sessionserve.cache.sliding import SlidingSlots


def build_session_cache(
    num_slots: int,
    page_size: int,
    max_rows: int,
    max_context_len: int,
    radix_enabled: bool = True,
    limits: SessionLimits | None = None,
    sliding_window: int | None = None,
    sliding_slots: int | None = None,
) -> SessionCache:
    """`sliding_window` (with `sliding_slots`, default `num_slots`): keep the sliding-window
    layers' KV apart, only for each sequence's last `sliding_window` tokens."""
    allocator = PagedAllocator(num_slots, page_size)
    if sliding_window is not None:
        allocator.sliding = SlidingSlots(
            sliding_slots or num_slots, allocator.pool_slots, sliding_window
        )
    rows = RequestRows(max_rows, max_context_len)
    return SessionCache(allocator, rows, RadixCache(allocator, radix_enabled), limits=limits)


__all__ = [
    "KVPool",
    "KVShape",
    "KVState",
    "CheckSchedule",
    "MemoryChecker",
    "MemoryTerms",
    "PagedAllocator",
    "RadixCache",
    "RequestKV",
    "RequestRows",
    "SessionCache",
    "SessionLimits",
    "SessionSlot",
    "SlidingSlots",
    "TurnMode",
    "build_session_cache",
    "ceil_align",
    "floor_align",
]
