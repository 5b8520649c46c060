from __future__ import annotations

import pytest
import torch

from sessionserve.cache import PagedAllocator, RadixCache
from sessionserve.cache.sliding import SlidingSlots
from sessionserve.errors import DoubleFreeError


def _cache(page: int, num_slots: int = 256) -> RadixCache:
    return RadixCache(PagedAllocator(num_slots, page))


def _insert(radix: RadixCache, tokens: list[int]) -> torch.Tensor:
    slots = radix.allocator.alloc_extend(None, 0, len(tokens))
    existing = radix.insert(tokens, slots)
    n = len(tokens) // radix.page_size * radix.page_size
    # the caller frees what the tree did not take: duplicates and the unaligned tail
    radix.allocator.free(torch.cat([slots[:existing], slots[n:]]))
    return slots


@pytest.mark.parametrize("page", [1, 4, 16])
def test_match_is_page_aligned_and_returns_inserted_slots(page: int) -> None:
    radix = _cache(page)
    tokens = list(range(100, 100 + 2 * page + 3))
    slots = _insert(radix, tokens)
    aligned = len(tokens) // page * page
    m = radix.match_prefix(tokens + [1, 2])
    assert m.length == aligned
    assert torch.equal(m.slots, slots[:aligned])
    assert radix.match_prefix(tokens[: page - 1] if page > 1 else []).length == 0
    # a divergence inside the second page matches only the first page (and splits the node)
    other = tokens[:page] + [0] * page
    assert radix.match_prefix(other).length == page
    assert radix.match_prefix(tokens).length == aligned  # the split kept the whole path
    assert radix.total_size() == aligned


def test_shared_system_prompt_is_stored_once() -> None:
    radix = _cache(4)
    system = list(range(1, 17))
    _insert(radix, system + [50, 51, 52, 53])
    before = radix.allocator.available_size()
    existing = radix.insert(system + [60, 61, 62, 63], torch.arange(200, 220))
    assert existing == 16  # the system prompt was already cached: the caller keeps its copy
    assert radix.total_size() == 24
    assert radix.allocator.available_size() == before


def test_locked_nodes_are_protected_and_survive_eviction_and_splits() -> None:
    radix = _cache(4)
    a = list(range(1, 13))
    _insert(radix, a)
    m = radix.match_prefix(a)
    radix.lock(m.node)
    assert (radix.protected_size(), radix.evictable_size()) == (12, 0)
    _insert(radix, a[:4] + [99, 98, 97, 96])  # splits the locked node above it
    assert (radix.protected_size(), radix.evictable_size()) == (12, 4)
    assert radix.evict(100) == 4  # only the unlocked branch goes
    assert radix.match_prefix(a).length == 12
    radix.unlock(m.node)
    assert (radix.protected_size(), radix.evictable_size()) == (0, 12)
    with pytest.raises(DoubleFreeError, match="not locked"):
        radix.unlock(m.node)
    assert radix.flush() == 12
    assert radix.allocator.available_size() == radix.allocator.num_slots


def test_eviction_is_least_recently_used_first() -> None:
    radix = _cache(4)
    old, new = [1] * 8, [2] * 8
    _insert(radix, old)
    _insert(radix, new)
    radix.match_prefix(old)  # touch: now `new` is the least recently used
    assert radix.evict(8) == 8
    assert radix.match_prefix(old).length == 8
    assert radix.match_prefix(new).length == 0


def test_eviction_takes_a_leaf_s_end_first_and_keeps_its_beginning() -> None:
    radix = _cache(4)
    system, older, newer = [1] * 8, list(range(10, 18)), list(range(20, 32))
    _insert(radix, system + older)
    _insert(radix, system + newer)
    free = radix.allocator.available_size()
    assert radix.evict(5) == 8  # two pages: the fewest that cover 5
    assert radix.allocator.available_size() == free + 8
    assert radix.match_prefix(system + older).length == 8  # the older branch's end went
    assert radix.match_prefix(system + newer).length == 20  # untouched
    assert radix.evict(4) == 4  # the older branch is used up: the next leaf's last page
    assert radix.match_prefix(system + newer).length == 16
    assert radix.evictable_size() == 16 and radix.total_size() == 16
    assert radix.flush() == 16
    assert radix.allocator.available_size() == radix.allocator.num_slots


def test_with_sliding_layers_kept_apart_whole_leaves_go() -> None:
    """A cut prefix would end where no sliding KV is resident: useless, so not kept."""
    allocator = PagedAllocator(256, 4)
    allocator.sliding = SlidingSlots(256, allocator.pool_slots, window=8)
    radix = RadixCache(allocator)
    _insert(radix, list(range(1, 25)))
    assert radix.evict(5) == 24
    assert radix.total_size() == 0


def test_disabled_tree_caches_nothing() -> None:
    radix = RadixCache(PagedAllocator(64, 4), enabled=False)
    assert radix.insert(list(range(8)), torch.arange(4, 12)) == 0
    assert radix.match_prefix(list(range(8))).length == 0
    assert radix.total_size() == 0


def test_eviction_keeps_its_heap_while_only_eviction_changed_the_tree(monkeypatch) -> None:
    """A full pool evicts a page per page a decode opens; walking every node each time was
    the cost. The heap is rebuilt only after something else touched the tree."""
    radix = _cache(4)
    for i in range(6):
        _insert(radix, [i + 1] * 12)
    walks = []
    iter_nodes = radix._iter_nodes
    monkeypatch.setattr(radix, "_iter_nodes", lambda: (walks.append(1), iter_nodes())[1])
    assert radix.evict(4) == 4
    assert radix.evict(4) == 4  # nothing between: the heap the first left
    assert len(walks) == 1
    radix.lock(radix.match_prefix([2] * 12).node)
    assert radix.evict(4) == 4
    assert len(walks) == 2


@pytest.mark.parametrize("seed", range(4))
def test_eviction_with_the_kept_heap_frees_what_a_rebuilt_heap_frees(seed: int) -> None:
    """Random inserts, matches, locks, unlocks and evictions on two trees, one of which
    rebuilds its heap before every eviction: the same tokens freed, the same prefixes kept."""
    import random

    rng = random.Random(seed)
    kept, rebuilt = _cache(4, 512), _cache(4, 512)
    seqs: list[list[int]] = []
    locks: list[tuple] = []
    for _ in range(300):
        op = rng.random()
        if op < 0.3 and kept.allocator.available_size() > 64:
            base = rng.choice(seqs)[: rng.randrange(0, 20)] if seqs and rng.random() < 0.5 else []
            seq = base + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 30))]
            seqs.append(seq)
            for radix in (kept, rebuilt):
                _insert(radix, seq)
        elif op < 0.45 and seqs:
            seq = rng.choice(seqs)
            assert kept.match_prefix(seq).length == rebuilt.match_prefix(seq).length
        elif op < 0.55 and seqs:
            seq = rng.choice(seqs)
            pair = tuple(r.match_prefix(seq).node for r in (kept, rebuilt))
            for radix, node in zip((kept, rebuilt), pair, strict=True):
                radix.lock(node)
            locks.append(pair)
        elif op < 0.65 and locks:
            pair = locks.pop(rng.randrange(len(locks)))
            for radix, node in zip((kept, rebuilt), pair, strict=True):
                radix.unlock(node)
        else:
            n = rng.randrange(1, 40)
            rebuilt._eviction_heap = None
            assert kept.evict(n) == rebuilt.evict(n)
        assert kept.evictable_size() == rebuilt.evictable_size()
        assert kept.allocator.available_size() == rebuilt.allocator.available_size()
    for seq in seqs:
        assert kept.match_prefix(seq).length == rebuilt.match_prefix(seq).length


@pytest.mark.parametrize("evictable_pages", [40, 2])
def test_a_shortfall_evicts_a_batch_so_the_next_pages_find_room(monkeypatch, evictable_pages):
    """With the pool full of cached prefixes (a server's steady state), the first decode that
    needs a page evicts `evict_ahead` tokens (1/64 of the pool, whole pages) at once, so the
    next pages need no eviction; with less evictable than that, what there is goes and the
    decode still gets its page. The memory check holds after every step."""
    from sessionserve.cache import MemoryChecker, RequestKV, build_session_cache

    page = 4
    cache = build_session_cache(num_slots=1024, page_size=page, max_rows=8, max_context_len=1024)
    check = MemoryChecker(cache)
    assert cache.evict_ahead == 16  # 1024 // 64: four pages
    # a live request holds what the tree does not: the tree ends up with `evictable_pages`
    holder = RequestKV(rid="holder")
    cache.match(holder, list(range(10_000, 10_008)))
    cache.allocate(holder, cache.allocator.available_size() - evictable_pages * page)
    for i in range(evictable_pages // 2):  # finished requests of two pages each: the tree's
        req = RequestKV(rid=f"done{i}")
        tokens = [100 * i + j for j in range(2 * page + 1)]
        cache.match(req, tokens)
        cache.allocate(req, 2 * page)
        cache.commit(req, 2 * page)
        cache.finish(req, tokens[: 2 * page])
    assert cache.allocator.available_size() == 0
    assert cache.radix.evictable_size() == evictable_pages * page
    check.check_busy([holder])

    evictions: list[int] = []
    evict = cache.radix.evict
    monkeypatch.setattr(cache.radix, "evict", lambda n: evictions.append(evict(n)) or evictions[-1])
    decoding = RequestKV(rid="decoding")
    cache.match(decoding, [7])
    pages = min(8, evictable_pages)  # a decode, one position a step
    for length in range(1, pages * page + 1):
        cache.allocate(decoding, length)
        cache.commit(decoding, length)
        check.check_busy([holder, decoding])
    # four pages at a time (twice for eight), or all there was (two pages, in one eviction)
    assert evictions == ([16, 16] if evictable_pages == 40 else [2 * page])
    assert cache.allocator.available_size() == 0  # what was evicted ahead, the decode took
