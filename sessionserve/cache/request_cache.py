"""KV for ordinary requests: rows and slots over the radix prefix cache.

Lifecycle of a request's KV (`RequestKV`):
    match -> allocate/commit ... -> finish | abort | retract
`match` admits the request (it becomes LIVE: it holds a row and maybe a radix lock). Each exit
gives everything back exactly once: the committed, page-aligned prefix goes into the radix tree
(evictable, so a retry or a sibling request with the same prefix reuses it) and the rest is freed.
`SessionCache` layers streaming sessions on top of this class.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sessionserve.cache.allocator import PagedAllocator, ceil_align, floor_align
from sessionserve.cache.radix import RadixCache
from sessionserve.cache.req_to_token import RequestRows
from sessionserve.cache.request_kv import KVState, RequestKV, SessionSlot
from sessionserve.errors import DoubleFreeError, KVCacheFullError, NoFreeRowError


class RequestCache:
    def __init__(self, allocator: PagedAllocator, rows: RequestRows, radix: RadixCache) -> None:
        self.allocator = allocator
        self.rows = rows
        self.radix = radix
        self.page_size = allocator.page_size
        # A shortfall evicts at least this many tokens from the radix tree (1/64 of the pool,
        # whole pages): an eviction costs ~10-20 us a call whatever its size (the tree's heap,
        # the allocator's checks), and with the pool full of cached prefixes, a server's steady
        # state, every decode that starts a page would otherwise pay one (4 a step at 64
        # requests of pages of 16: a fifth of scheduling them, on a 2-core Zen 3).
        self.evict_ahead = floor_align(allocator.num_pages * self.page_size // 64, self.page_size)

    # ---- admission ----
    def match(self, req: RequestKV, tokens: Sequence[int]) -> int:
        """Admit `req` for input `tokens`; returns the number of cached (reused) tokens.

        At least the last token is always left to compute, so it has logits. Raises
        NoFreeRowError, with nothing changed, when no request row can be freed.
        """
        self._expect(req, KVState.WAITING, "match")
        if not tokens:
            raise ValueError(f"request {req.rid!r}: empty input; send at least one token")
        return self._match_radix(req, tokens)

    def _match_radix(self, req: RequestKV, tokens: Sequence[int]) -> int:
        row = self._alloc_row()
        m = self.radix.match_prefix(tokens[:-1])
        sliding = self.allocator.sliding
        if sliding is not None:  # go on only from where the sliding layers' window is resident
            usable = sliding.longest_usable(m.slots, self.page_size)
            if usable < m.length:
                m = self.radix.match_prefix(tokens[:usable])
        self.radix.lock(m.node)
        self.rows.write(row, 0, m.slots)
        req.row, req.lock_node, req.state = row, m.node, KVState.LIVE
        req.committed_len = req.allocated_len = req.protected_len = m.length
        req.sliding_from = m.length
        self._set_cached(req, len(tokens), m.length, "radix")
        return m.length

    # ---- growth ----
    def allocate(self, req: RequestKV, new_len: int) -> None:
        """Give positions [allocated, new_len) slots. All or nothing.

        Evicts radix pages and idle sessions first; raises KVCacheFullError if still short.
        With sliding-window layers kept apart, each new position also gets a sliding slot.
        """
        self._expect(req, KVState.LIVE, "allocate")
        start = req.allocated_len
        extend, in_page = new_len - start, start % self.page_size
        if extend <= 0:
            return
        sliding = self.allocator.sliding
        if in_page and extend <= self.page_size - in_page:
            # the request's partial last page has room: no page is taken
            if sliding is not None:
                self.make_room(0, extend)
            self.rows.write_run(req.row, start, self.rows.last_slot(req.row, start) + 1, extend)
        else:
            pages = self.allocator.pages_needed(start, extend)
            self.make_room(pages * self.page_size, extend if sliding is not None else 0)
            slots = self.allocator.alloc_extend(self.rows.last_slot(req.row, start), start, extend)
            self.rows.write(req.row, start, slots)
        if sliding is not None:  # room was made above: this cannot fail
            sliding.alloc(self.rows.read(req.row, start, new_len))
        req.allocated_len = new_len

    def commit(self, req: RequestKV, committed_len: int) -> None:
        """Positions [0, committed_len) now hold valid KV (computed and accepted)."""
        self._expect(req, KVState.LIVE, "commit")
        if not req.committed_len <= committed_len <= req.allocated_len:
            raise ValueError(
                f"request {req.rid!r}: commit to {committed_len} outside "
                f"[{req.committed_len}, {req.allocated_len}]"
            )
        req.committed_len = committed_len
        self._slide(req)

    def free_overallocation(self, req: RequestKV) -> None:
        """Free slots past `committed` (rejected drafts) the same step; the partial page stays."""
        self._expect(req, KVState.LIVE, "free_overallocation")
        self._free_tail(req, req.committed_len)

    def slots(self, req: RequestKV, start: int, end: int) -> torch.Tensor:
        return self.rows.read(req.row, start, end)

    def slot_at(self, req: RequestKV, position: int) -> int:
        """The slot of one position (a decode's new token)."""
        return self.rows.slot_at(req.row, position)

    def slot_list(self, req: RequestKV, start: int, end: int) -> list[int]:
        """`slots` as host ints (cheaper for a few positions, e.g. a decode's one)."""
        return self.rows.read_list(req.row, start, end)

    # ---- exits (ordinary requests) ----
    def finish(self, req: RequestKV, final_tokens: Sequence[int]) -> None:
        """Normal finish. `final_tokens` is prompt + answer, already truncated to what the answer
        really contains: KV past it (speculative overshoot) is trimmed."""
        self._expect(req, KVState.LIVE, "finish")
        self._free_tail(req, min(req.allocated_len, len(final_tokens)))
        self._release_to_radix(req, final_tokens)
        req.state = KVState.DONE

    def abort(self, req: RequestKV, tokens: Sequence[int] = ()) -> None:
        """Abort in any phase; committed KV is kept in the radix tree (evictable)."""
        if req.state is KVState.DONE:
            raise DoubleFreeError(f"request {req.rid!r} already finished or aborted")
        if req.is_live:
            self._release_to_radix(req, tokens)
        req.state = KVState.DONE

    def retract(self, req: RequestKV, tokens: Sequence[int]) -> None:
        """Preempt a live request: give its KV back; it can be matched again later."""
        self._expect(req, KVState.LIVE, "retract")
        self._release_to_radix(req, tokens)
        req.state = KVState.WAITING

    # ---- sizes ----
    def reclaimable_size(self) -> int:
        """Tokens an admission can count on: free plus evictable radix pages."""
        return self.allocator.available_size() + self.radix.evictable_size()

    def flush(self) -> int:
        return self.radix.flush()

    # ---- shared internals ----
    def _expect(self, req: RequestKV, state: KVState, op: str) -> None:
        if req.state is not state:
            raise DoubleFreeError(f"{op} on request {req.rid!r} in state {req.state.value}")

    def _set_cached(self, req: RequestKV, prompt_len: int, cached: int, source: str) -> None:
        req.prompt_len, req.cached_len = prompt_len, cached
        req.cached_source = source if cached else "none"

    def _alloc_row(self) -> int:
        while self.rows.num_free() == 0:
            if not self._evict_idle_session():
                raise NoFreeRowError(
                    f"all {self.rows.num_rows} request rows are held by running requests and "
                    "busy sessions; raise cache.max_rows or lower concurrency"
                )
        return self.rows.alloc()

    def make_room(self, num_tokens: int, sliding_tokens: int = 0) -> None:
        """Evict radix pages, then idle sessions (least recently used first), until
        `num_tokens` slots (and `sliding_tokens` sliding slots) are free; raises
        KVCacheFullError if that is impossible."""
        sliding = self.allocator.sliding
        while True:
            short = num_tokens - self.allocator.available_size()
            sliding_short = sliding_tokens - sliding.available_size() if sliding else 0
            if short <= 0 and sliding_short <= 0:
                return
            want = max(short, self.page_size if sliding_short > 0 else 0)
            if short > 0:  # take a batch while at it (`evict_ahead`)
                want = max(want, min(self.evict_ahead, self.radix.evictable_size()))
            if self.radix.evict(want) == 0 and not self._evict_idle_session():
                what = f"{num_tokens} slots, {self.allocator.available_size()} free"
                if sliding_short > 0:
                    what = (
                        f"{sliding_tokens} sliding-window slots, {sliding.available_size()} "
                        "free (raise cache.sliding_slots)"
                    )
                raise KVCacheFullError(f"KV cache full: need {what}, and nothing left to evict")

    def _evict_idle_session(self) -> bool:
        """Overridden by SessionCache; an ordinary cache has no sessions to evict."""
        return False

    def _free_tail(self, owner: RequestKV | SessionSlot, new_len: int) -> None:
        """Shrink `owner` (a request or a slot, same row) to `new_len` positions.

        Frees the whole pages from `ceil_align(new_len)` on: the partial page up to it stays
        attached and is refilled by the next extend (the allocator fills it first).
        """
        if new_len < owner.protected_len:
            raise ValueError(f"tail free to {new_len} below protected {owner.protected_len}")
        start = ceil_align(new_len, self.page_size)
        sliding = self.allocator.sliding
        if sliding is not None and owner.allocated_len > new_len:  # the kept page's cut tail
            sliding.release(self.rows.read(owner.row, new_len, min(start, owner.allocated_len)))
        if owner.allocated_len > start:
            self.allocator.free(self.rows.read(owner.row, start, owner.allocated_len))
        owner.allocated_len = min(owner.allocated_len, new_len)
        owner.committed_len = min(owner.committed_len, new_len)
        owner.sliding_from = min(owner.sliding_from, new_len)

    def _slide(self, owner: RequestKV | SessionSlot) -> None:
        """Give back the sliding KV of the owner's positions its window has passed (what the
        radix tree holds below `protected` is the tree's). A plain request keeps a page more:
        it ends in the tree at its last whole page, which must have its window to be reused."""
        sliding = self.allocator.sliding
        if sliding is None:
            return
        keep = sliding.keep + (0 if owner.session_id is not None else self.page_size - 1)
        lo = max(owner.sliding_from, owner.protected_len)
        hi = owner.committed_len - keep
        if hi > lo:
            sliding.release(self.rows.read(owner.row, lo, hi))
            owner.sliding_from = hi

    def _window_resident(self, row: int, length: int) -> bool:
        """Whether the sequence in `row` can go on from `length` (always, without sliding
        layers kept apart): the window its next token sees holds its sliding KV."""
        sliding = self.allocator.sliding
        if sliding is None or length == 0:
            return True
        return sliding.all_resident(
            self.rows.read(row, max(0, length - sliding.window + 1), length)
        )

    def _insert_prefix(self, req: RequestKV, tokens: Sequence[int], length: int) -> None:
        """Move the page-aligned `tokens[:length]` of req's row into the radix tree and lock it.

        Pages another request inserted meanwhile are the tree's: ours are freed and the row is
        pointed at the tree's. Afterwards `req.protected_len == length` (or unchanged if the
        tree is disabled or nothing new).
        """
        if not self.radix.enabled or length <= req.protected_len:
            return
        prev = req.protected_len
        existing = self.radix.insert(tokens[:length], self.rows.read(req.row, 0, length))
        m = self.radix.match_prefix(tokens[:length])
        if existing > prev:
            self.allocator.free(self.rows.read(req.row, prev, existing).clone())
            self.rows.write(req.row, prev, m.slots[prev:existing])
        self.radix.lock(m.node)
        if req.lock_node is not None:
            self.radix.unlock(req.lock_node)
        req.lock_node, req.protected_len = m.node, m.length

    def _release_to_radix(self, req: RequestKV, tokens: Sequence[int]) -> None:
        """Give back everything `req` holds: committed whole pages into the tree, rest freed."""
        keep = floor_align(min(req.committed_len, len(tokens)), self.page_size)
        self._insert_prefix(req, tokens, keep)
        if req.allocated_len > req.protected_len:
            self.allocator.free(self.rows.read(req.row, req.protected_len, req.allocated_len))
        if req.lock_node is not None:
            self.radix.unlock(req.lock_node)
        self.rows.free(req.row)
        self._reset(req)

    @staticmethod
    def _reset(req: RequestKV) -> None:
        req.row, req.lock_node = None, None
        req.committed_len = req.allocated_len = req.protected_len = req.sliding_from = 0
