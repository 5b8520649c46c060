"""Sliding-window layers' KV: a second, smaller slot space that holds only recent tokens.

A model like Gemma 3 has full-attention layers, which need every token's KV, and
sliding-window layers, which need only the last `window` tokens' KV. Every token has a slot
in the paged allocator (the full layers' KV, the row tables and the radix tree all use it);
while it is recent, it also has a *sliding slot* (the sliding layers' KV), found through
`slot_map` (full slot -> sliding slot, 0 = none). Ownership follows the full slot: whoever owns
a token's slot owns its sliding slot too, so the memory invariant of one space carries over.

Sliding slots are taken one per token (no pages: a token leaves the window alone) and given
back three ways: the owner slides its window forward (`release` of positions older than
`keep`), a tail is cut (`release`), or the full slot's page is freed (the allocator calls
`release_pages`). Slot 0 is the reserved dummy, as page 0 of the main space: positions
outside the window read it and are masked.
"""

from __future__ import annotations

import numpy as np
import torch

from sessionserve.errors import InvalidConfigError, KVCacheFullError


class SlidingSlots:
    def __init__(self, num_slots: int, full_pool_slots: int, window: int) -> None:
        if num_slots < 1 or window < 1:
            raise InvalidConfigError(
                f"sliding-window KV: num_slots={num_slots}, window={window}: both must be >= 1"
            )
        self.num_slots = num_slots  # usable slots, slot 0 excluded
        self.window = window
        # positions an owner keeps: the next token sees itself and the window - 1 before it;
        # one more lets a chat turn rewind the last token (an answer's end rendered otherwise)
        self.keep = window
        self._map = np.zeros(full_pool_slots, dtype=np.int64)
        self.slot_map = torch.from_numpy(self._map)  # a view: lookups without a copy
        self._free: list[int] = list(range(num_slots, 0, -1))

    @property
    def pool_slots(self) -> int:
        """Slots a sliding layer's KV tensor needs, the reserved slot 0 included."""
        return self.num_slots + 1

    def available_size(self) -> int:
        return len(self._free)

    def alloc(self, full_slots: torch.Tensor) -> None:
        """Give each of `full_slots` (none holding one yet) a sliding slot. All or nothing."""
        n = full_slots.numel()
        if n == 0:
            return
        idx = full_slots.numpy()
        if n > len(self._free):
            raise KVCacheFullError(
                f"sliding-window KV full: need {n} slots, {len(self._free)} free"
            )
        if self._map[idx].any():
            raise ValueError("a slot already holds sliding-window KV")
        taken = self._free[-n:]
        del self._free[-n:]
        self._map[idx] = taken[::-1]

    def release(self, full_slots: torch.Tensor) -> int:
        """Give back the sliding slots of `full_slots` that hold one; returns how many."""
        if full_slots.numel() == 0:
            return 0
        idx = full_slots.numpy()
        held = self._map[idx]
        mine = held[held > 0]
        if mine.size:
            self._free.extend(mine.tolist())
            self._map[idx] = 0
        return int(mine.size)

    def release_pages(self, pages: torch.Tensor, page_size: int) -> int:
        """Whole pages of the main space are being freed: their tokens' sliding slots too."""
        slots = (pages[:, None] * page_size + torch.arange(page_size)).reshape(-1)
        return self.release(slots)

    def lookup(self, full_slots: torch.Tensor) -> torch.Tensor:
        """The sliding slots of `full_slots` (0 where a token holds none)."""
        return torch.from_numpy(self._map[full_slots.numpy()])

    def count(self, full_slots: torch.Tensor) -> int:
        return int(np.count_nonzero(self._map[full_slots.numpy()])) if full_slots.numel() else 0

    def all_resident(self, full_slots: torch.Tensor) -> bool:
        """Whether every one of `full_slots` holds sliding KV."""
        return bool(self._map[full_slots.numpy()].all())

    def longest_usable(self, slots: torch.Tensor, page_size: int) -> int:
        """The longest page-aligned prefix of `slots` (a radix match) a request can go on
        from: its window resident. 0 always qualifies."""
        n = slots.numel()
        if n == 0:
            return 0
        missing = np.concatenate(([0], np.cumsum(self._map[slots.numpy()] == 0)))
        ends = np.arange(n - n % page_size, 0, -page_size)
        starts = np.maximum(0, ends - self.window + 1)
        ok = missing[ends] == missing[starts]
        return int(ends[ok.argmax()]) if ok.any() else 0

    def resident_suffix(self, slots: torch.Tensor) -> int:
        """How many of the last positions of `slots` hold sliding KV, without a gap."""
        held = self._map[slots.numpy()] > 0
        gaps = np.flatnonzero(~held)
        return int(held.size - (gaps[-1] + 1)) if gaps.size else int(held.size)

    # ---- for the memory checker ----
    def mapped_full_slots(self) -> np.ndarray:
        return np.flatnonzero(self._map)

    def check(self) -> list[str]:
        """The space's own consistency: each sliding slot free or held by exactly one token."""
        held = self._map[self._map > 0]
        problems = []
        if np.unique(held).size != held.size:
            problems.append("sliding-window KV: two tokens share a sliding slot")
        if held.size + len(self._free) != self.num_slots:
            problems.append(
                f"sliding-window KV: {held.size} held + {len(self._free)} free != {self.num_slots}"
            )
        if set(self._free) & set(held.tolist()):
            problems.append("sliding-window KV: a slot is both free and held")
        return problems
