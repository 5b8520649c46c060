"""Paging a buffer in ahead of use (cache/prefault.py): the pages become resident, what was
written into them meanwhile stays, and without the kernel's help the buffer is zeroed."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap

import pytest
import torch

from sessionserve.cache import prefault as prefault_module
from sessionserve.cache.prefault import PAGE, populate, prefault

MIB = 1 << 20


def resident_share(buffer: torch.Tensor) -> float:
    """The share of `buffer`'s pages that are in memory (mincore(2))."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    start = buffer.data_ptr() & ~(PAGE - 1)
    length = buffer.data_ptr() + buffer.numel() * buffer.element_size() - start
    pages = (length + PAGE - 1) // PAGE
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) == 0
    return sum(b & 1 for b in vec) / pages


def fresh(nbytes: int) -> tuple[mmap.mmap, torch.Tensor]:
    """A private anonymous mapping no one has written, as a tensor (keep the mapping alive
    while the tensor is used): the allocator may hand out memory written before."""
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buffer = torch.frombuffer(mapping, dtype=torch.uint8)
    assert resident_share(buffer) == 0.0
    return mapping, buffer


def test_paging_in_makes_the_pages_resident_and_keeps_what_was_written() -> None:
    _mapping, buffer = fresh(48 * MIB)
    if not populate(buffer[:PAGE]):
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
    buffer[5 * MIB : 6 * MIB] = 7  # a copy the engine made before the thread got there
    thread = prefault([buffer[: 24 * MIB], buffer[24 * MIB :]], "test")
    assert thread is not None
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert resident_share(buffer) == 1.0
    assert bool((buffer[5 * MIB : 6 * MIB] == 7).all())
    assert int(buffer[: 5 * MIB].count_nonzero()) == int(buffer[6 * MIB :].count_nonzero()) == 0


def test_without_the_kernels_help_the_buffers_are_zeroed_in_line(monkeypatch) -> None:
    monkeypatch.setattr(prefault_module, "populate", lambda buffer: False)
    buffers = [torch.full((3, 1000), 5.0), torch.full((2000,), 9, dtype=torch.int16)]
    assert prefault(buffers, "test") is None
    assert all(int(b.count_nonzero()) == 0 for b in buffers)


def test_the_host_tier_pages_its_arena_in_without_waiting_for_it() -> None:
    from sessionserve.cache import KVPool, KVShape
    from sessionserve.cache.host_tier import HostTier

    pool = KVPool(KVShape(2, 2, 64), 64, torch.float32)
    tier = HostTier(32 * MIB, [pool])
    if tier.prefaulting is None:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE: the arena was zeroed in line")
    tier.prefaulting.join(timeout=60)
    assert resident_share(tier.arenas[0]) == 1.0
