"""The hand-written CPU decode attention (`cpu_decode_attention.cpp`): built once per machine,
loaded as the op `torch.ops.sessionserve.decode_attend`.

Why it exists: the decode step package (compiled_decode.py) had its attention compiled by
inductor from `inplace_decode.decode_attention`, which over multi-turn contexts took 40-50% of a
step; no formulation inductor compiles did better (docs/benchmarks.md, stop 57). The kernel
computes the same thing (the row's own new token included) in one pass per block of 16 tokens (8
on AVX2). It needs an x86 CPU with AVX-512 or AVX2 (built for the wider one it has) and a C++
compiler, as inductor's CPU backend does; where either is missing, or the build fails, `load()`
says why once and callers keep the compiled formula. The shared library is cached under the
cache root (`kernels/`), keyed by the source, torch's version and the flags, so a restart does
not rebuild it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch

from sessionserve.replicas.native_kernel import NativeKernel

SOURCE = Path(__file__).with_name("cpu_decode_attention.cpp")
HEAD_DIMS = (16, 32, 64, 80, 96, 128, 256)  # what the kernel is instantiated for
MAX_GROUP = 32  # query heads per KV head, times the query tokens per row
DTYPES = (torch.float32, torch.bfloat16)  # the pool's
DISABLE_ENV = "SESSIONSERVE_CPU_DECODE_KERNEL"  # "0": keep inductor's formula everywhere
log = logging.getLogger(__name__)


def _register_fake() -> None:
    @torch.library.register_fake("sessionserve::decode_attend")
    def _(query, k_pool, v_pool, slots, lens, new_key, new_value, scale, widths):  # noqa: ANN001, ANN202, E501
        return torch.empty_like(query)


KERNEL = NativeKernel(SOURCE, DISABLE_ENV, "the CPU decode attention kernel", _register_fake, log)
# build (once per machine) and load the op; False, with the reason logged once and in
# `why_not()`, where it cannot be used here
load = KERNEL.load
why_not = KERNEL.why_not


def supports(head_dim: int, heads: int, kv_heads: int, dtype: torch.dtype) -> bool:
    """Whether a model with this attention layout can use the kernel (once it is loaded)."""
    return (
        head_dim in HEAD_DIMS
        and heads % kv_heads == 0
        and heads // kv_heads <= MAX_GROUP
        and dtype in DTYPES
    )


def usable(head_dim: int, heads: int, kv_heads: int, dtype: torch.dtype) -> bool:
    """`supports` the layout and `load()`s here (built first if needed)."""
    return supports(head_dim, heads, kv_heads, dtype) and load()


def max_query_tokens(heads: int, kv_heads: int) -> int:
    """How many query tokens a row may have (a chain verify's k + 1)."""
    return MAX_GROUP // (heads // kv_heads)


def decode_attend(
    query: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    lens: torch.Tensor,
    new_key: torch.Tensor,
    new_value: torch.Tensor,
    scale: float,
    widths: torch.Tensor | None = None,
) -> torch.Tensor:
    """`inplace_decode.decode_attention` for rows of T query tokens (query [B * T, H, D],
    a row's tokens consecutive; T = 1 for decode, k + 1 for a chain verify), each token
    seeing its row's context (slots [B, W], lens [B]; pools [S, KVH, D]) and its row's tokens
    up to itself: their K/V `new_key`, `new_value` [B * T, KVH, D] after the row's lens[b]
    slots, or, given empty, the row's last T context slots. `widths` [B] (1..T): a row's
    real tokens, its first; the rest are padding, not computed (zeros; a verify's rows
    padded to one width: the kernel's work grows with the tokens, T = 5 cost 3.3x T = 1,
    docs/benchmarks.md); None: all T. Loads the op first if this process has not (a
    package's build process, tests)."""
    KERNEL.require()
    if widths is None:
        widths = slots.new_empty(0, dtype=torch.int64)
    return torch.ops.sessionserve.decode_attend(
        query, k_pool, v_pool, slots, lens, new_key, new_value, scale, widths
    )


C_SHIM = (
    "AOTITorchError aoti_torch_cpu_decode_attend(AtenTensorHandle, AtenTensorHandle, "
    "AtenTensorHandle, AtenTensorHandle, AtenTensorHandle, AtenTensorHandle, AtenTensorHandle, "
    "double, AtenTensorHandle, AtenTensorHandle*)"
)


def c_shims() -> dict[object, list[str]]:
    """The op's C function, for a package that calls it (inductor's
    `native_kernel.SHIMS_CONFIG`): AOTInductor would otherwise route a custom op
    through a proxy executor, which a package run from its C entry points does not have.
    Loads the op, raising where it cannot be used here."""
    KERNEL.require()
    return {torch.ops.sessionserve.decode_attend.default: [C_SHIM]}


def over_the_pool(scale: float) -> Callable[..., torch.Tensor]:
    """The kernel called as `inplace_decode.DecodeKernel` calls a kernel: (query, k_pool,
    v_pool, slots, lens), every row's new tokens the last of its context already (the torch
    backend's decode and chain-verify rows, whose K/V were written before the layer
    attends)."""

    def run(query, k_pool, v_pool, slots, lens):  # noqa: ANN001, ANN202 - as DecodeKernel
        none = query.new_empty(0)
        return decode_attend(query, k_pool, v_pool, slots, lens, none, none, scale)

    return run
