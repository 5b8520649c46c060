"""Paged token -> KV slot allocator.

Slots are handed out in pages of `page_size` consecutive slots. Page 0 (slots `0..page_size-1`)
is reserved as a padding dummy: attention kernels may point unused entries at slot 0, so no real
token ever lives there. Frees are by whole pages: freeing any slot frees its page, which is why
callers free tails from `ceil_align(length)` (see `ceil_align`).
"""

from __future__ import annotations

import numpy as np
import torch

from sessionserve.cache.sliding import SlidingSlots
from sessionserve.errors import DoubleFreeError, InvalidConfigError, KVCacheFullError

SUPPORTED_PAGE_SIZES_DOC = "any power of two from 1 to 1024 (1, 4, 16, 64, 256 are tested)"


def ceil_align(length: int, page_size: int) -> int:
    """Smallest multiple of `page_size` that is >= `length`."""
    return -(-length // page_size) * page_size


def floor_align(length: int, page_size: int) -> int:
    """Largest multiple of `page_size` that is <= `length`."""
    return (length // page_size) * page_size


class PagedAllocator:
    """Owns which KV slots are free. Nothing else decides that.

    Invariants: a page is either in `_free_pages` or marked allocated, never both; page 0 is
    neither. `available_size()` counts tokens, always a multiple of `page_size`.
    """

    def __init__(self, num_slots: int, page_size: int) -> None:
        if page_size < 1 or page_size > 1024 or page_size & (page_size - 1):
            raise InvalidConfigError(f"page_size={page_size}: must be {SUPPORTED_PAGE_SIZES_DOC}")
        if num_slots < page_size or num_slots % page_size:
            raise InvalidConfigError(
                f"num_slots={num_slots}: must be a positive multiple of page_size={page_size}"
            )
        self.page_size = page_size
        self.num_slots = num_slots  # usable slots, page 0 excluded
        self.num_pages = num_slots // page_size
        # Pages 1..num_pages are real; LIFO order keeps recently freed (cache-warm) pages in use.
        self._free_pages: list[int] = list(range(self.num_pages, 0, -1))
        # numpy, not torch: a decode opens or frees a page or two a step, and small numpy
        # operations cost a fraction of torch's (~64 -> ~12 us a page allocated and freed)
        self._page_allocated = np.zeros(self.num_pages + 1, dtype=np.bool_)
        # a model with sliding-window layers: freeing a page frees its tokens' sliding KV too
        self.sliding: SlidingSlots | None = None

    @property
    def pool_slots(self) -> int:
        """Slots a KV tensor needs, the reserved page 0 included."""
        return (self.num_pages + 1) * self.page_size

    def available_size(self) -> int:
        return len(self._free_pages) * self.page_size

    def pages_needed(self, prefix_len: int, extend_len: int) -> int:
        """New pages an extend of `extend_len` tokens after `prefix_len` tokens takes."""
        p = self.page_size
        return (ceil_align(prefix_len + extend_len, p) - ceil_align(prefix_len, p)) // p

    def alloc_extend(self, last_slot: int | None, prefix_len: int, extend_len: int) -> torch.Tensor:
        """Slots for positions `[prefix_len, prefix_len + extend_len)` of one sequence.

        The remainder of the prefix's last partial page is filled first (`last_slot` is the slot
        of position `prefix_len - 1`, required when `prefix_len` is not page-aligned), then whole
        new pages. All or nothing: raises KVCacheFullError without allocating anything.
        """
        if extend_len < 0 or prefix_len < 0:
            raise ValueError(f"negative length: prefix_len={prefix_len}, extend_len={extend_len}")
        p = self.page_size
        in_page = prefix_len % p
        if in_page and last_slot is None:
            raise ValueError("last_slot is required to extend a partially filled page")
        n_pages = self.pages_needed(prefix_len, extend_len)
        if n_pages > len(self._free_pages):
            raise KVCacheFullError(
                f"KV cache full: need {n_pages} pages of {p} tokens, {len(self._free_pages)} free"
            )
        parts: list[np.ndarray] = []
        if in_page:
            take = min(p - in_page, extend_len)
            if last_slot % p != in_page - 1 or not self._page_allocated[last_slot // p]:
                raise ValueError(f"last_slot={last_slot} does not end a prefix of {prefix_len}")
            parts.append(np.arange(last_slot + 1, last_slot + 1 + take, dtype=np.int64))
        if n_pages:
            pages = np.array([self._free_pages.pop() for _ in range(n_pages)], dtype=np.int64)
            self._page_allocated[pages] = True
            parts.append((pages[:, None] * p + np.arange(p, dtype=np.int64)).reshape(-1))
        if not parts:
            return torch.empty(0, dtype=torch.int64)
        flat = parts[0] if len(parts) == 1 else np.concatenate(parts)
        return torch.from_numpy(flat[:extend_len])

    def free(self, slots: torch.Tensor) -> int:
        """Free the pages holding `slots`; returns the number of tokens freed (whole pages).

        Raises DoubleFreeError, and frees nothing, if any page is not allocated.
        """
        if slots.numel() == 0:
            return 0
        pages = np.unique(slots.numpy().astype(np.int64, copy=False) // self.page_size)
        if pages[0] <= 0 or pages[-1] > self.num_pages:  # (sorted by np.unique)
            raise DoubleFreeError(
                f"slots outside the pool or in reserved page 0: pages {pages.tolist()}"
            )
        allocated = self._page_allocated[pages]
        if not allocated.all():
            bad = pages[~allocated].tolist()
            raise DoubleFreeError(f"double free: pages {bad} are not allocated")
        self._page_allocated[pages] = False
        self._free_pages.extend(pages.tolist())
        if self.sliding is not None:
            self.sliding.release_pages(torch.from_numpy(pages), self.page_size)
        return pages.size * self.page_size

    def page_allocated(self, slots) -> np.ndarray:
        """Per slot (any int array), whether its page is allocated."""
        return self._page_allocated[np.asarray(slots) // self.page_size]

    def is_allocated(self, slot: int) -> bool:
        return bool(self._page_allocated[slot // self.page_size])
