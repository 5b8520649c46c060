"""The in-place decode attention kernel (attention/inplace_decode.py), compiled ahead of time.

One AOTInductor package per head layout (heads, head size, dtype, softmax scale), thread
count and CPU ISA, generic in the batch, the context width and the pool size (exported with
those dimensions dynamic, so no shape ever recompiles), built in seconds on first use and
cached beside the compiled forward's packages. It is installed on the torch backend where
the compiled forward is (CPU): decode rows then attend over the pool without copying their
K/V out of it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import sessionserve
from sessionserve.replicas.attention import cpu_decode_kernel
from sessionserve.replicas.attention.inplace_decode import DecodeAttention, DecodeKernel
from sessionserve.replicas.compiled_forward import build_once, builder_tag, load_flat

log = logging.getLogger(__name__)
KERNEL_FORMAT = 4  # bump when inplace_decode.decode_attention or the export example changes
CHUNKS_PER_THREAD = 4  # the context's parts per thread (decode_attention's `chunks`)
# The export example: inductor decides which loops run on every thread from these sizes, and
# from a toy example (2 rows of 2 slots a part, as before) it ran the softmax's loops on one
# thread and split the scores only over rows (one thread for one row). A decode batch of 16
# over 96 slots a part is a size it sees in service. Sizes 0 and 1 would be specialized.
EXAMPLE_ROWS = 16
EXAMPLE_PART_WIDTH = 96
EXAMPLE_POOL_SLOTS = 4096


@dataclass(frozen=True)
class HeadLayout:
    """What the kernel's code depends on besides the machine."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # the query's and the pool's ("torch.float32")
    scale: float  # the layers' softmax scale (attention.attention_scale)


def kernel_path(cache_dir: Path, layout: HeadLayout) -> Path:
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    facts = {
        **asdict(layout),
        "threads": torch.get_num_threads(),
        "isa": str(pick_vec_isa()),
        "versions": [torch.__version__, sessionserve.__version__],
        "format": KERNEL_FORMAT,
    }
    key = hashlib.blake2b(json.dumps(facts, sort_keys=True).encode(), digest_size=16)
    return cache_dir / f"decode-attention-{key.hexdigest()}.pt2"


def kernel_chunks() -> int:
    return CHUNKS_PER_THREAD * torch.get_num_threads()


def build_kernel(
    path: Path,
    layout: HeadLayout,
    module: torch.nn.Module | None = None,
    example_rows: int = EXAMPLE_ROWS,
    example_part_width: int = EXAMPLE_PART_WIDTH,
) -> None:
    """Export `decode_attention` (or `module`, called the same way: benchmarks compare
    formulations) with the batch, context width (a multiple of `kernel_chunks()`) and pool size
    dynamic, and compile it into a package written atomically to `path`."""
    dtype, chunks = getattr(torch, layout.dtype.removeprefix("torch.")), kernel_chunks()
    heads, kv_heads, dim = layout.num_heads, layout.num_kv_heads, layout.head_dim
    pool = torch.zeros(EXAMPLE_POOL_SLOTS, kv_heads, dim, dtype=dtype)
    example_width = example_part_width * chunks
    example = (  # the shapes inductor sizes its loops' threading for (all stay dynamic)
        torch.zeros(example_rows, heads, dim, dtype=dtype),
        pool,
        pool.clone(),
        torch.zeros(example_rows, example_width, dtype=torch.int64),
        torch.full((example_rows,), example_width, dtype=torch.int64),
    )
    rows, slots = torch.export.Dim("rows", min=1), torch.export.Dim("pool_slots", min=2)
    width = chunks * torch.export.Dim("chunk_width", min=1)
    started = time.monotonic()
    program = torch.export.export(
        module or DecodeAttention(chunks, layout.scale),
        example,
        dynamic_shapes=({0: rows}, {0: slots}, {0: slots}, {0: rows, 1: width}, {0: rows}),
    )
    partial = path.with_suffix(f".{builder_tag()}.partial.pt2")
    try:
        torch._inductor.aoti_compile_and_package(
            program, package_path=str(partial), inductor_configs={"compile_threads": 1}
        )
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    log.info("compile: built %s in %.0f s", path.name, time.monotonic() - started)


def decode_kernel_for(
    layout: HeadLayout, cache_dir: Path, query_dtype: torch.dtype | None = None
) -> DecodeKernel | None:
    """What decode rows attend with in place: the hand-written CPU kernel where it is usable
    here (attention/cpu_decode_kernel.py, 1.42-1.50x the compiled formula over multi-turn
    contexts: docs/benchmarks.md; it also takes chain verifies' rows), else the compiled
    formula (`load_decode_kernel`), which is built for queries in the pool's dtype only:
    under `cache.kv_dtype` another `query_dtype` keeps copying K/V."""
    dtype = getattr(torch, layout.dtype.removeprefix("torch."))
    heads, kv_heads = layout.num_heads, layout.num_kv_heads
    if cpu_decode_kernel.usable(layout.head_dim, heads, kv_heads, dtype):
        log.info("compile: decode rows attend over the KV pool in place (the CPU kernel)")
        run = cpu_decode_kernel.over_the_pool(layout.scale)
        tokens = cpu_decode_kernel.max_query_tokens(heads, kv_heads)
        return DecodeKernel(run, kernel_chunks(), layout.scale, tokens)
    if query_dtype is not None and query_dtype != dtype:
        log.info(
            "compile: decode attention keeps copying K/V: the CPU kernel is not usable here "
            "and the compiled formula needs queries in the KV's dtype (%s)",
            layout.dtype,
        )
        return None
    return load_decode_kernel(layout, cache_dir)


def load_decode_kernel(layout: HeadLayout, cache_dir: Path) -> DecodeKernel | None:
    """The kernel for `layout`, built first (under a file lock, others wait) if the cache
    lacks it. None, with a warning that says why, when building or loading fails: decode
    rows then copy their K/V out of the pool as before."""
    path = kernel_path(cache_dir, layout)
    try:
        build_once(
            path,
            lambda: build_kernel(path, layout),
            f"compile: building the in-place decode attention for {layout} (first start with "
            f"this head layout, threads and CPU; cached at {path})",
            log,
        )
        package = load_flat(path)
        kernel = DecodeKernel(lambda *args: package(*args)[0], kernel_chunks(), layout.scale)
        log.info("compile: decode rows attend over the KV pool in place (%s)", path.name)
        return kernel
    except Exception as e:  # noqa: BLE001 - any failure leaves the copying path working
        log.warning("compile: decode attention keeps copying K/V, because compiling failed: %r", e)
        return None
