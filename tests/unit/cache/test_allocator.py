from __future__ import annotations

import pytest
import torch

from sessionserve.cache import PagedAllocator, RequestRows, ceil_align, floor_align
from sessionserve.errors import (
    DoubleFreeError,
    InvalidConfigError,
    KVCacheFullError,
    NoFreeRowError,
)

PAGE_SIZES = [1, 4, 16, 64, 256]


@pytest.mark.parametrize("page", PAGE_SIZES)
def test_extend_fills_partial_page_then_whole_pages(page: int) -> None:
    alloc = PagedAllocator(num_slots=page * 8, page_size=page)
    first = alloc.alloc_extend(None, 0, page + 1)  # one page and one slot of the next
    assert first.numel() == page + 1
    assert alloc.available_size() == page * 6
    second = alloc.alloc_extend(int(first[-1]), page + 1, page)  # fills the partial page first
    fill = page - 1
    assert torch.equal(second[:fill], first[-1] + 1 + torch.arange(fill))
    assert alloc.available_size() == page * 5  # the second call took exactly one new page
    assert (torch.cat([first, second]) // page >= 1).all(), "page 0 is reserved"
    # every slot is distinct
    both = torch.cat([first, second])
    assert both.unique().numel() == both.numel()


@pytest.mark.parametrize("page", PAGE_SIZES)
def test_decode_allocates_one_slot_and_frees_whole_pages(page: int) -> None:
    alloc = PagedAllocator(num_slots=page * 4, page_size=page)
    slots = alloc.alloc_extend(None, 0, 1)
    for length in range(1, page + 1):
        slots = torch.cat([slots, alloc.alloc_extend(int(slots[-1]), length, 1)])
    assert slots.numel() == page + 1
    assert alloc.available_size() == page * 2
    assert alloc.free(slots[-1:]) == page  # a page is freed whole
    assert alloc.free(slots[:1]) == page
    assert alloc.available_size() == page * 4


def test_double_free_raises_and_frees_nothing() -> None:
    alloc = PagedAllocator(num_slots=64, page_size=16)
    a = alloc.alloc_extend(None, 0, 16)
    b = alloc.alloc_extend(None, 0, 16)
    alloc.free(a)
    before = alloc.available_size()
    with pytest.raises(DoubleFreeError, match="double free"):
        alloc.free(torch.cat([b, a]))
    assert alloc.available_size() == before
    assert alloc.is_allocated(int(b[0]))
    with pytest.raises(DoubleFreeError, match="reserved page 0"):
        alloc.free(torch.tensor([0]))


def test_full_pool_is_all_or_nothing() -> None:
    alloc = PagedAllocator(num_slots=48, page_size=16)
    alloc.alloc_extend(None, 0, 20)
    with pytest.raises(KVCacheFullError, match="need 2 pages of 16 tokens, 1 free"):
        alloc.alloc_extend(None, 0, 17)
    assert alloc.available_size() == 16  # nothing was taken by the failed call


@pytest.mark.parametrize(
    ("num_slots", "page", "msg"),
    [
        (64, 3, "page_size=3"),
        (64, 0, "page_size=0"),
        (60, 16, "multiple of page_size"),
        (0, 1, "num_slots=0"),
        (64, 2048, "page_size=2048"),
    ],
)
def test_invalid_sizes(num_slots: int, page: int, msg: str) -> None:
    with pytest.raises(InvalidConfigError, match=msg):
        PagedAllocator(num_slots, page)


def test_extend_needs_anchor_for_partial_page() -> None:
    alloc = PagedAllocator(num_slots=64, page_size=16)
    with pytest.raises(ValueError, match="last_slot is required"):
        alloc.alloc_extend(None, 5, 3)
    s = alloc.alloc_extend(None, 0, 5)
    with pytest.raises(ValueError, match="does not end a prefix"):
        alloc.alloc_extend(int(s[1]), 5, 3)


def test_align_helpers() -> None:
    assert [ceil_align(x, 4) for x in (0, 1, 4, 5)] == [0, 4, 4, 8]
    assert [floor_align(x, 4) for x in (0, 3, 4, 7)] == [0, 0, 4, 4]


def test_rows_alloc_free_and_reuse() -> None:
    rows = RequestRows(num_rows=2, max_context_len=8)
    a, b = rows.alloc(), rows.alloc()
    assert {a, b} == {0, 1}
    with pytest.raises(NoFreeRowError, match="all 2 request rows"):
        rows.alloc()
    rows.write(a, 0, torch.tensor([5, 6, 7]))
    assert rows.read(a, 0, 3).tolist() == [5, 6, 7]
    assert rows.last_slot(a, 3) == 7 and rows.last_slot(a, 0) is None
    rows.free(a)
    with pytest.raises(DoubleFreeError, match="row 0"):
        rows.free(a)
    assert rows.alloc() == a  # a freed row is reused
    with pytest.raises(ValueError, match="max_context_len=8"):
        rows.write(b, 6, torch.tensor([1, 2, 3]))
    with pytest.raises(InvalidConfigError):
        RequestRows(0, 8)
