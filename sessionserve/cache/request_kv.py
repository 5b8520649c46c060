"""Per-request and per-session KV bookkeeping records (plain data; the caches change them).

Lengths count token positions of one row:
    [0, protected)          owned by the radix tree and locked (never freed by the row's owner)
    [protected, committed)  KV computed and accepted, owned by the row's owner
    [committed, allocated)  slots allocated but not (yet) valid: speculative drafts, the slot of
                            the token being fed this step
Always 0 <= protected <= committed <= allocated, protected a multiple of page_size. Pages are
owned whole, so an owner really holds `ceil_align(allocated) - protected` slots.
With sliding-window layers kept apart (cache/sliding.py), the owner's positions below
`sliding_from` have given their sliding KV back (the window has passed them).
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

from sessionserve.cache.radix import RadixNode

_lru_clock = itertools.count(1)


def lru_tick() -> int:
    """A monotonic counter for least-recently-used ordering (cheaper and steadier than time)."""
    return next(_lru_clock)


class KVState(enum.Enum):
    WAITING = "waiting"  # holds nothing: new, queued, or retracted
    LIVE = "live"  # matched: holds a row (own or borrowed) and maybe a radix lock
    DONE = "done"  # finished or aborted; holds nothing and never will again


@dataclass(eq=False)
class RequestKV:
    """The KV a request holds. `session_id` is set only for an admitted session turn."""

    rid: str
    session_id: str | None = None
    state: KVState = KVState.WAITING
    row: int | None = None
    committed_len: int = 0
    allocated_len: int = 0
    protected_len: int = 0
    sliding_from: int = 0
    lock_node: RadixNode | None = None  # a lock this request owns; None while borrowing a slot's
    prompt_len: int = 0  # tokens given to the last match()
    cached_len: int = 0  # tokens reused at the last match() (reported to the client)
    cached_source: str = "none"  # "session", "radix" or "none"

    @property
    def is_live(self) -> bool:
        return self.state is KVState.LIVE


@dataclass(eq=False)
class SessionSlot:
    """One streaming session's state between turns.

    `history` is the checkpoint: the tokens of the last successful turn (prompt and answer), the
    source of truth for re-prefill. `kv_tokens` are the tokens whose KV the row holds
    (len == committed_len); normally a prefix of `history`, longer only while a retracted turn's
    KV is parked. `turn_rid` marks the one turn in flight; `borrower` is the live request using
    the row (checked against the live batch by the memory checker, never trusted for accounting).
    The slot holds KV and what KV policy needs (the LRU tick, eviction count), nothing else:
    the session's activity clock, TTL and turn count are the session controller's
    (`replicas/sessions.py`), its failover log and committed turns the directory's.
    """

    session_id: str
    history: list[int] = field(default_factory=list)
    kv_tokens: list[int] = field(default_factory=list)
    row: int | None = None
    committed_len: int = 0
    allocated_len: int = 0
    protected_len: int = 0
    sliding_from: int = 0
    lock_node: RadixNode | None = None
    turn_rid: str | None = None
    borrower: str | None = None
    closing: bool = False
    last_used: int = field(default_factory=lru_tick)
    evictions: int = 0

    @property
    def holds_kv(self) -> bool:
        return self.row is not None
