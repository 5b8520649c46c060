"""The hand-written CPU prefill attention (`cpu_extend_attention.cpp`): built once per machine,
loaded as the op `torch.ops.sessionserve.extend_attend`.

Why it exists: a turn over a session's history (or a prompt after a radix hit, or a long
prompt's later chunk) attended through torch's flash attention after gathering the context's
K/V out of the pool; on 2 cores of an EPYC Zen 4 in bf16 that ran at ~110 GFLOP/s, a third of
a 128-token turn over 600 tokens, where the step's GEMMs run at ~280 (docs/benchmarks.md,
stop 104), and in fp32 at ~113. A sliding-window layer's ran under a banded mask, every block
of the context computed (stop 107). The kernel reads the pool in place, and on sliding layers
computes only each token's window. In bf16 it computes the
scores and the weighted sum with AVX512-BF16's dot products, as torch's kernel does in bf16
(fp32 sums, the softmax's weights rounded to bf16); in fp32 (what `model.dtype: auto` serves
on CPUs without bf16 arithmetic: AVX2, and AVX-512 before AVX512-BF16) with fp32 FMAs on
AVX-512 or AVX2 vectors. It needs a C++ compiler and an x86 CPU with AVX2 at least, bf16 pools
AVX512-BF16; where one is missing, `load()` says why once and the backend keeps torch's
attention, as it does where the kernel was not measured faster (`measured_faster`: bf16 on a
CPU with AMX, fp32 on AVX2) unless told otherwise (`told_to_use`).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from sessionserve.replicas.native_kernel import NativeKernel, needs_avx512

SOURCE = Path(__file__).with_name("cpu_extend_attention.cpp")
HEAD_DIMS = (16, 32, 64, 80, 96, 128, 256)  # what the kernel is instantiated for
DISABLE_ENV = "SESSIONSERVE_CPU_EXTEND_KERNEL"  # "0": keep torch's attention for prefills;
# "1": use the kernel also where it was not measured faster (`told_to_use`)
log = logging.getLogger(__name__)
_said_why = False


def _register_fake() -> None:
    @torch.library.register_fake("sessionserve::extend_attend")
    def _(query, k_pool, v_pool, slots, lens, scale, window=0):  # noqa: ANN001, ANN202
        return torch.empty_like(query)


def has_bf16() -> bool:
    """Whether the kernel is built with its bf16 path here: a CPU with AVX512-BF16."""
    return not needs_avx512("AVX512-BF16", "_is_avx512_bf16_supported")()


BF16_BUILT = has_bf16()  # whether this process builds (and loads) the bf16 path
KERNEL = NativeKernel(
    SOURCE,
    DISABLE_ENV,
    "the CPU prefill attention kernel",
    _register_fake,
    log,
    extra_flags=("-mavx512bf16",) if BF16_BUILT else (),
)
why_not = KERNEL.why_not


def supports(head_dim: int, heads: int, kv_heads: int, dtype: torch.dtype) -> bool:
    """Whether the kernel computes this attention layout and dtype (the model's and the
    pool's) on this CPU."""
    dtypes = (torch.float32, torch.bfloat16) if BF16_BUILT else (torch.float32,)
    return head_dim in HEAD_DIMS and heads % kv_heads == 0 and dtype in dtypes


def told_to_use() -> bool:
    """Whether the backend is told (`SESSIONSERVE_CPU_EXTEND_KERNEL=1`) to take the kernel
    where it was not measured faster (`measured_faster`): bf16 on a CPU with AMX, fp32 on
    AVX2."""
    return os.environ.get(DISABLE_ENV) == "1"


def usable(head_dim: int, heads: int, kv_heads: int, dtype: torch.dtype) -> bool:
    """Whether the torch backend takes the kernel for a model with this attention layout and
    dtype here: `supports` it, the kernel built and loaded, where it was measured faster than
    torch's attention (`measured_faster`) or told (`told_to_use`: the same switch)."""
    if not supports(head_dim, heads, kv_heads, dtype):
        return False
    if not measured_faster(dtype) and not told_to_use():
        return False
    return KERNEL.load()


def measured_faster(dtype: torch.dtype) -> bool:
    """Where the kernel beat torch's attention (docs/benchmarks.md): bf16 on AVX512-BF16
    without AMX (stop 104), fp32 on AVX-512 (stop 106). Not on a CPU with AMX in bf16, where
    torch's flash attention computes its blocks on tiles and the kernel was not measured
    against it; not on AVX2, where the build (8-lane vectors, 16 registers) ran turns over a
    history at 0.72-1.06x torch's path on the Zen 4 box (stops 106-107), both held to AVX2,
    and no AVX2-only CPU has measured the two. Says once in the log why not."""
    global _said_why
    capability = torch.backends.cpu.get_cpu_capability()
    if dtype == torch.bfloat16 and capability == "AMX":
        why = "this CPU has AMX tiles, which torch's attention uses for bf16"
    elif dtype == torch.float32 and capability == "AVX2":
        why = "on AVX2 it was not measured faster than torch's attention in fp32"
    else:
        return True
    if not _said_why:
        _said_why = True
        log.info("%s not used: %s (%s=1 uses the kernel)", KERNEL.what, why, DISABLE_ENV)
    return False


def extend_attend(
    query: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Rows of T new tokens (query [B * T, H, D], a row's tokens consecutive) over their
    contexts (slots [B, W] int64, lens [B]; pools [S, KVH, D]; all fp32, or all bf16 where
    `BF16_BUILT`), each row's new tokens the last T of its context, already in the pool: token
    t of row b sees positions 0..lens[b] - T + t, on a sliding-window layer (`window`) only
    the last `window` of those, itself included. Returns [B * T, H, D] in their dtype. Loads
    the op first if this process has not."""
    KERNEL.require()
    return torch.ops.sessionserve.extend_attend(
        query, k_pool, v_pool, slots, lens, scale, window or 0
    )
