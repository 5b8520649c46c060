"""Taking a buffer's first-write page faults ahead of its use, without holding up startup.

Memory a process has not written costs a page fault per 4 KiB on its first write. On the VMs
we run on (Firecracker guests) that first touch is slow and erratic: 1 GiB of fresh memory
took 0.5 s to write in one process and 8.6-10 s in each of `make serve`'s two replicas,
started together. The host tier writes its arena through at startup so that no turn takes
those faults (cache/host_tier.py); done in line, that held every replica's startup for
those seconds. `MADV_POPULATE_WRITE` (Linux 5.14) faults the pages in without writing them:
run from a thread, it cannot race with a copy the engine makes into a page meanwhile (that
page's contents stay as they are), and its system call releases the GIL. Where the kernel
lacks it, the buffer is zeroed in line, as before.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence

import torch

logger = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23  # linux/mman.h
PAGE = 4096


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        fn = ctypes.CDLL(name, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


def populate(buffer: torch.Tensor) -> bool:
    """Fault in every page of `buffer` (contiguous, on the host) for writing, leaving its
    contents as they are; False where this kernel or libc cannot (nothing done then)."""
    if buffer.numel() == 0:
        return True
    madvise = _madvise()
    start = buffer.data_ptr() & ~(PAGE - 1)
    end = buffer.data_ptr() + buffer.numel() * buffer.element_size()
    return madvise is not None and madvise(start, end - start, MADV_POPULATE_WRITE) == 0


def prefault(buffers: Sequence[torch.Tensor], what: str) -> threading.Thread | None:
    """Take `buffers`' first-write page faults now: in a thread where the kernel populates
    pages without writing them (the thread, to join in tests; its end is logged), else by
    zeroing them here (None). Buffers must be contiguous host memory that only this module
    and copies of data into them touch."""
    if not buffers:
        return None
    probe = buffers[0].view(-1)[: PAGE // buffers[0].element_size()]
    if not populate(probe):
        started = time.perf_counter()
        for buffer in buffers:
            buffer.zero_()
        logger.info("%s: written through in %.1f s", what, time.perf_counter() - started)
        return None

    def run() -> None:
        started = time.perf_counter()
        done = all(populate(buffer) for buffer in buffers)
        if done:
            logger.info("%s: paged in, in %.1f s", what, time.perf_counter() - started)
        else:  # the memory is still usable: its pages fault in when first written
            logger.warning("%s: paging in failed; first writes will take the page faults", what)

    thread = threading.Thread(target=run, name="prefault", daemon=True)
    thread.start()
    return thread
