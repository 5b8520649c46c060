"""The host tier: where an idle session's KV goes when the device pool evicts it.

Without it, an evicted session keeps only its token log and its next turn re-prefills the
whole history. With it, eviction first copies the KV out into host memory; the next turn
copies it back and prefills only the new tokens. Least recently parked goes first when the
tier is full; a session dropped from the tier falls back to re-prefill, as before.

The tier's memory is allocated once, when the replica starts, and paged in then (by a thread,
so that startup does not wait: cache/prefault.py), as pages of `page_size` tokens (its own,
not the pool's) of every pool's full-attention layers
(`[pages, 2, layers, page_size, kv_heads, head_dim]` a pool, pinned on CUDA): a spill copies
a session's KV into free pages, a restore copies them back, an eviction frees them. Why not
a tensor a parked session, as before: memory a process has not written before costs a page
fault per 4 KiB on its first write, taken on the engine thread while a turn waits (on the
VMs we measure, ~0.4 GB/s: a 12 MB spill took 26 ms into new memory, 1.7 ms into memory
written before), and pinned memory is slow to allocate on a GPU host. SGLang's HiCache and
vLLM's CPU offload preallocate theirs too. Sliding-window layers' KV (a window per session,
cache/sliding.py) stays one tensor a parked session, within the same byte budget. Plain data
and bookkeeping: the session cache decides what goes in and comes out, the memory checker
proves the pages and the byte count.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from sessionserve.cache.kv_pool import KVPool
from sessionserve.cache.kv_snapshot import (
    KVSnapshot,
    copy_in,
    copy_out,
    gather_window,
    scatter_window,
    whole_pages,
)
from sessionserve.cache.prefault import prefault
from sessionserve.cache.sliding import SlidingSlots
from sessionserve.errors import InvalidConfigError

logger = logging.getLogger(__name__)

# tokens a host page holds, whatever the pool's page size: small enough that a short session
# wastes little of its last page, big enough that a page is one copy of ~0.4 MB (SmolLM2)
HOST_PAGE_TOKENS = 16


@dataclass
class ParkedKV:
    """A session's KV in the tier: position p of `tokens` in page `pages[p // page_size]`, row
    `p % page_size`; the sliding layers' KV of positions `[sliding_from, len)` as KVSnapshot
    holds it (one tensor per pool; empty without sliding layers kept apart)."""

    tokens: list[int]
    pages: list[int]
    sliding_kv: list[torch.Tensor] = field(default_factory=list)
    sliding_from: int = 0
    nbytes: int = 0  # its pages' bytes and its sliding KV's: what it takes of the budget

    def __len__(self) -> int:
        return len(self.tokens)


class HostTier:
    def __init__(
        self, budget_bytes: int, pools: Sequence[KVPool], page_size: int = HOST_PAGE_TOKENS
    ) -> None:
        """Allocates `budget_bytes // page_bytes` pages now, paged in by a thread meanwhile
        (`prefaulting`; both costs logged), for `pools`: the ones the session cache copies
        (target, drafter), the only ones this tier copies from and to."""
        if budget_bytes < 1:
            raise InvalidConfigError(f"host tier budget {budget_bytes} bytes: must be >= 1")
        if not pools or page_size < 1:
            raise ValueError("a host tier needs the KV pools and a page size >= 1")
        self.budget_bytes = budget_bytes
        self.page_size = page_size
        self.page_bytes = page_size * sum(_token_bytes(pool) for pool in pools)
        num_pages = budget_bytes // self.page_bytes
        if num_pages < 1:
            raise InvalidConfigError(
                f"host tier budget {budget_bytes} bytes holds no page of {page_size} tokens "
                f"({self.page_bytes} bytes of KV): give sessions.host_tier_bytes at least that"
            )
        started = time.perf_counter()
        pinned = any(pool.k.is_cuda for pool in pools)
        self.pools = list(pools)
        self.arenas = [_arena(pool, num_pages, page_size, pinned) for pool in pools]
        # pinned memory is resident once allocated; pageable memory is paged in meanwhile
        self.prefaulting = None if pinned else prefault(self.arenas, "host tier")
        self.free_pages: list[int] = list(range(num_pages - 1, -1, -1))  # pop: lowest first
        self.entries: OrderedDict[str, ParkedKV] = OrderedDict()  # least recent first
        self.bytes_in_use = 0
        self.parked_total = 0  # copies stored
        self.restored_total = 0  # copies taken back into the pool
        self.evicted_total = 0  # copies dropped for the budget (or too big to keep)
        self.restore_seconds: deque[float] = deque(maxlen=1024)  # drained by the metrics
        self._staging_buffers: list[torch.Tensor | None] = [None] * len(pools)
        logger.info(
            "host tier: %.2f GiB of %s host memory as %d pages of %d tokens, in %.1f s",
            num_pages * self.page_bytes / 2**30,
            "pinned" if pinned else "pageable",
            num_pages,
            page_size,
            time.perf_counter() - started,
        )

    @property
    def num_pages(self) -> int:
        return self.arenas[0].shape[0]

    def pages_for(self, tokens: int) -> int:
        """Pages a copy of `tokens` positions holds."""
        return -(-tokens // self.page_size)

    def totals(self) -> dict[str, int]:
        """Running totals, by the short names the metrics export."""
        return {
            "host_tier_parks": self.parked_total,
            "host_tier_restores": self.restored_total,
            "host_tier_evictions": self.evicted_total,
        }

    def note_restore(self, seconds: float) -> None:
        self.restored_total += 1
        self.restore_seconds.append(seconds)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, session_id: str) -> ParkedKV | None:
        return self.entries.get(session_id)

    # ---- in ----
    def park(
        self,
        session_id: str,
        slots: torch.Tensor,
        tokens: Sequence[int],
        pool_page_size: int,
        sliding: SlidingSlots | None = None,
    ) -> bool:
        """Copy the KV of `tokens` at pool `slots` (pages of `pool_page_size`) into the tier
        (replacing the session's older copy), dropping the least recently parked until it
        fits; False if it alone does not fit (nothing kept)."""
        if slots.numel() != len(tokens):
            raise ValueError(f"{slots.numel()} slots for {len(tokens)} tokens")
        start, window = gather_window(self.pools, slots, sliding)
        pool_pages, n = self._same_pages(slots, pool_page_size), len(tokens)

        def write(pages: list[int]) -> None:
            for i, (pool, arena) in enumerate(zip(self.pools, self.arenas, strict=True)):
                if pool_pages is not None:  # page to page, no copy between
                    _copy_pages(pool, pool_pages, arena, pages, n, to_pool=False)
                    continue
                kv = copy_out(pool.k, pool.v, slots, pool_page_size, self._staging(i, n, pool))
                _write_pages(arena, pages, kv)

        return self._keep(session_id, list(tokens), write, window, start)

    def store(self, session_id: str, snap: KVSnapshot, upto: int) -> bool:
        """Keep positions `[0, upto)` of a snapshot (a migrated session the pool had no room
        for); as `park`."""
        start, window = _window_prefix(snap.sliding_kv, snap.sliding_from, upto)

        def write(pages: list[int]) -> None:
            for arena, kv in zip(self.arenas, snap.kv, strict=True):
                _write_pages(arena, pages, kv[:, :, :upto])

        return self._keep(session_id, snap.tokens[:upto], write, window, start)

    def _keep(
        self,
        session_id: str,
        tokens: list[int],
        write: Callable[[list[int]], None],
        window: list[torch.Tensor],
        sliding_from: int,
    ) -> bool:
        self.drop(session_id)
        npages = self.pages_for(len(tokens))
        nbytes = npages * self.page_bytes + sum(t.nbytes for t in window)
        if not self._make_room(npages, nbytes):
            self.evicted_total += 1
            return False
        pages = [self.free_pages.pop() for _ in range(npages)]
        try:
            write(pages)
        except BaseException:
            self.free_pages.extend(reversed(pages))
            raise
        self.entries[session_id] = ParkedKV(tokens, pages, window, sliding_from, nbytes)
        self.bytes_in_use += nbytes
        self.parked_total += 1
        return True

    def _make_room(self, npages: int, nbytes: int) -> bool:
        """Evict the least recently parked until `npages` pages and `nbytes` of the budget
        are free; False if that is more than the tier holds (nothing evicted), or more than
        it can free while a copy being restored keeps its pages."""
        if npages > self.num_pages or nbytes > self.budget_bytes:
            return False
        while len(self.free_pages) < npages or self.bytes_in_use + nbytes > self.budget_bytes:
            if not self.entries:  # the rest is out with a restore in progress
                return False
            _, old = self.entries.popitem(last=False)
            self.bytes_in_use -= old.nbytes
            self.release(old)
            self.evicted_total += 1
        return True

    # ---- out ----
    def take(self, session_id: str) -> ParkedKV | None:
        """Remove the session's copy from the tier, keeping its pages until `release` (being
        restored: what the restore makes room for may park others meanwhile) or `put_back`."""
        parked = self.entries.pop(session_id, None)
        if parked is not None:
            self.bytes_in_use -= parked.nbytes
        return parked

    def release(self, parked: ParkedKV) -> None:
        """Give a taken copy's pages back."""
        self._free(parked.pages)
        parked.pages = []

    def _free(self, pages: list[int]) -> None:
        self.free_pages.extend(sorted(pages, reverse=True))  # the lowest are reused first

    def put_back(self, session_id: str, parked: ParkedKV) -> None:
        """A taken copy goes back, unchanged, as the most recently parked (evicting what
        others parked meanwhile beyond the budget: its pages it kept)."""
        self._make_room(0, parked.nbytes)
        self.bytes_in_use += parked.nbytes
        self.entries[session_id] = parked

    def drop(self, session_id: str) -> bool:
        """Forget the session's copy (closed, or its KV is back in the pool)."""
        parked = self.take(session_id)
        if parked is None:
            return False
        self.release(parked)
        return True

    def truncate(self, session_id: str, keep: int) -> None:
        """Cut the session's copy to its first `keep` positions (a retracted turn's KV parked
        with the session's goes back to the checkpoint); 0 drops it."""
        parked = self.entries.get(session_id)
        if parked is None or keep >= len(parked):
            return
        if keep == 0:
            self.drop(session_id)
            return
        npages = self.pages_for(keep)
        self._free(parked.pages[npages:])
        start, window = _window_prefix(parked.sliding_kv, parked.sliding_from, keep)
        nbytes = npages * self.page_bytes + sum(t.nbytes for t in window)
        self.bytes_in_use += nbytes - parked.nbytes
        parked.tokens, parked.pages = parked.tokens[:keep], parked.pages[:npages]
        parked.sliding_kv, parked.sliding_from, parked.nbytes = window, start, nbytes

    def restore(
        self,
        parked: ParkedKV,
        start: int,
        end: int,
        slots: torch.Tensor,
        pool_page_size: int,
        window: tuple[int, torch.Tensor] | None = None,
    ) -> None:
        """Write positions `[start, end)` of a copy into pool `slots` (in pages of
        `pool_page_size`), and with `window` (as `kv_snapshot.scatter`'s) its sliding
        layers' KV."""
        if slots.numel() != end - start:
            raise ValueError(f"{slots.numel()} slots for positions [{start}, {end})")
        for pool in self.pools:
            pool.fence()
        ps = self.page_size
        pool_pages = self._same_pages(slots, pool_page_size) if start % ps == 0 else None
        for i, (pool, arena) in enumerate(zip(self.pools, self.arenas, strict=True)):
            if pool_pages is not None:  # page to page, no copy between
                pages = parked.pages[start // ps :]
                _copy_pages(pool, pool_pages, arena, pages, end - start, to_pool=True)
                continue
            out = self._staging(i, end - start, pool)
            part = _read_pages(arena, parked.pages, start, end, pool.k.device, out)
            copy_in(pool.k, pool.v, part, slots, pool_page_size)
        scatter_window(self.pools, parked.sliding_kv, parked.sliding_from, end, window)

    def _same_pages(self, slots: torch.Tensor, pool_page_size: int) -> list[int] | None:
        """The pool pages holding `slots` when they can be copied page to page with the
        tier's: host pools, pages of the tier's size, `slots` whole pages in order (but the
        last); else None."""
        if pool_page_size != self.page_size or self.pools[0].k.is_cuda:
            return None
        pages = whole_pages(slots, pool_page_size)
        return None if pages is None else pages.tolist()

    def _staging(self, i: int, n: int, pool: KVPool) -> torch.Tensor | None:
        """A reused buffer `[2, layers, n, heads, dim]` for pool `i`'s copies on the host (None
        on CUDA: the caching allocator reuses device memory), as long as the longest copy yet
        (at most the context length). Why: a fresh one a copy was freshly mapped memory,
        each copy paying its page faults again."""
        if pool.k.is_cuda:
            return None
        buf = self._staging_buffers[i]
        if buf is None or buf.shape[2] < n:
            layers, _, heads, dim = pool.k.shape
            size = max(n, 0 if buf is None else buf.shape[2] * 3 // 2)
            buf = torch.zeros((2, layers, size, heads, dim), dtype=pool.dtype)
            self._staging_buffers[i] = buf
        return buf[:, :, :n]

    def export(self, session_id: str) -> KVSnapshot | None:
        """The session's copy as a snapshot of its own (host) memory, for another replica."""
        parked = self.entries.get(session_id)
        if parked is None:
            return None
        if any(arena.is_pinned() for arena in self.arenas):
            torch.cuda.synchronize()  # the spill's copies into the pinned pages have landed
        n, cpu = len(parked), torch.device("cpu")
        kv = [_read_pages(arena, parked.pages, 0, n, cpu) for arena in self.arenas]
        window = [t.clone() for t in parked.sliding_kv]
        return KVSnapshot(list(parked.tokens), kv, window, parked.sliding_from)


def _window_prefix(
    sliding_kv: list[torch.Tensor], sliding_from: int, n: int
) -> tuple[int, list[torch.Tensor]]:
    """The sliding KV of a copy cut to its first `n` positions, copied (a view would keep the
    whole tensor alive), and the first position it holds."""
    start = min(sliding_from, n)
    return start, [t[:, :, : n - start].clone() for t in sliding_kv]


def _token_bytes(pool: KVPool) -> int:
    """Bytes of one token's K and V in the pool's full-attention layers."""
    return 2 * pool.k[:, 0].numel() * pool.k.element_size()


def _arena(pool: KVPool, num_pages: int, page_size: int, pinned: bool) -> torch.Tensor:
    layers, _, heads, dim = pool.k.shape
    shape = (num_pages, 2, layers, page_size, heads, dim)
    return torch.empty(shape, dtype=pool.dtype, pin_memory=pinned)


def _copy_pages(
    pool: KVPool,
    pool_pages: Sequence[int],
    arena: torch.Tensor,
    pages: Sequence[int],
    n: int,
    to_pool: bool,
) -> None:
    """The first `n` positions between pool pages and tier pages of the same size, page by
    page (each a strided copy of every layer's rows): into the pool when `to_pool`."""
    layers, _, heads, dim = pool.k.shape
    ps = arena.shape[3]
    k = pool.k.view(layers, -1, ps, heads, dim)
    v = pool.v.view(layers, -1, ps, heads, dim)
    for j, (ours, theirs) in enumerate(zip(pool_pages, pages, strict=False)):
        rows = min(ps, n - j * ps)
        if rows <= 0:
            break
        if to_pool:
            k[:, ours, :rows] = arena[theirs, 0, :, :rows]
            v[:, ours, :rows] = arena[theirs, 1, :, :rows]
        else:
            arena[theirs, 0, :, :rows] = k[:, ours, :rows]
            arena[theirs, 1, :, :rows] = v[:, ours, :rows]


def _runs(pages: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """(index in `pages`, first page, count) for each run of consecutive page numbers."""
    i = 0
    while i < len(pages):
        j = i + 1
        while j < len(pages) and pages[j] == pages[j - 1] + 1:
            j += 1
        yield i, pages[i], j - i
        i = j


def _write_pages(arena: torch.Tensor, pages: Sequence[int], kv: torch.Tensor) -> None:
    """Positions `[0, n)` of `kv` (`[2, layers, n, heads, dim]`, any device) into `pages`."""
    ps = arena.shape[3]
    n = kv.shape[2]
    if kv.device != arena.device:  # to page order on the device: one copy a run of pages
        kv = _page_major(kv, ps)
        for i, first, count in _runs(pages):
            arena[first : first + count].copy_(kv[i : i + count], non_blocking=True)
        return
    for i, first, count in _runs(pages):
        lo, hi = i * ps, min(n, (i + count) * ps)
        full = (hi - lo) // ps
        if full:
            dest = arena[first : first + full].permute(1, 2, 0, 3, 4, 5)
            dest.copy_(kv[:, :, lo : lo + full * ps].unflatten(2, (full, ps)))
        if hi > lo + full * ps:  # the last, partial page
            arena[first + full, :, :, : hi - lo - full * ps] = kv[:, :, lo + full * ps : hi]


def _read_pages(
    arena: torch.Tensor,
    pages: Sequence[int],
    start: int,
    end: int,
    device: torch.device,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Positions `[start, end)` held in `pages` as `[2, layers, end - start, heads, dim]` on
    `device` (in `out`, on the host, when given)."""
    ps = arena.shape[3]
    first_page = start // ps
    chosen = pages[first_page : -(-end // ps)]
    _, two, layers, _, heads, dim = arena.shape
    if device == arena.device:  # page by page into token order: no temporary
        if out is None:
            out = torch.empty((two, layers, end - start, heads, dim), dtype=arena.dtype)
        for j, page in enumerate(chosen):
            at = (first_page + j) * ps  # the page's first position
            lo, hi = max(start, at), min(end, at + ps)
            out[:, :, lo - start : hi - start] = arena[page, :, :, lo - at : hi - at]
        return out
    # to the device a run of pages a copy, into token order there
    block = torch.empty((len(chosen), *arena.shape[1:]), dtype=arena.dtype, device=device)
    for i, first, count in _runs(chosen):
        block[i : i + count].copy_(arena[first : first + count], non_blocking=True)
    tokens = block.permute(1, 2, 0, 3, 4, 5).flatten(2, 3)  # a copy, in token order
    lo = start - first_page * ps
    return tokens[:, :, lo : lo + end - start]


def _page_major(kv: torch.Tensor, ps: int) -> torch.Tensor:
    """`[2, layers, n, heads, dim]` as `[pages, 2, layers, ps, heads, dim]` (the last page
    padded), on kv's device."""
    two, layers, n, heads, dim = kv.shape
    full = n // ps
    out = torch.zeros((-(-n // ps), two, layers, ps, heads, dim), dtype=kv.dtype, device=kv.device)
    view = out.permute(1, 2, 0, 3, 4, 5)  # [2, layers, pages, ps, ...], writes land in `out`
    if full:
        view[:, :, :full] = kv[:, :, : full * ps].unflatten(2, (full, ps))
    if n > full * ps:
        view[:, :, full, : n - full * ps] = kv[:, :, full * ps :]
    return out
