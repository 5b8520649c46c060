"""The hand-written CPU prefill attention (`cpu_extend_attention.cpp`): built once per machine,
loaded as the op `torch.ops.sessionserve.extend_attend`.

Why it exists: a turn over a session's history (or a prompt after a radix hit, or a long
prompt's later chunk) attended through torch's flash attention after gathering the context's
K/V out of the pool; on 2 cores of an EPYC Zen 4 in bf16 that ran at ~110 GFLOP/s, a third of
a 128-token turn over 600 tokens, where the step's GEMMs run at ~280 (docs/benchmarks.md,
stop 104). The kernel reads the pool in place and computes the scores and the weighted sum
with AVX512-BF16's dot products, as torch's kernel does in bf16 (fp32 sums, the softmax's
weights rounded to bf16). It needs a bf16 model and pool, a CPU with AVX512-BF16 and a C++
compiler; where one is missing, `load()` says why once and the backend keeps torch's
attention, as it does on a CPU with AMX unless told otherwise (`wanted_on_amx`).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from sessionserve.replicas.native_kernel import NativeKernel, needs_avx512

SOURCE = Path(__file__).with_name("cpu_extend_attention.cpp")
HEAD_DIMS = (16, 32, 64, 80, 96, 128)  # what the kernel is instantiated for
DISABLE_ENV = "SESSIONSERVE_CPU_EXTEND_KERNEL"  # "0": keep torch's attention for prefills;
# "1": use the kernel on a CPU with AMX too (`wanted_on_amx`)
log = logging.getLogger(__name__)
_said_amx = False


def _register_fake() -> None:
    @torch.library.register_fake("sessionserve::extend_attend")
    def _(query, k_pool, v_pool, slots, lens, scale):  # noqa: ANN001, ANN202
        return torch.empty_like(query)


KERNEL = NativeKernel(
    SOURCE,
    DISABLE_ENV,
    "the CPU prefill attention kernel",
    _register_fake,
    log,
    extra_flags=("-mavx512bf16",),
    needs=needs_avx512("AVX512-BF16", "_is_avx512_bf16_supported"),
)
why_not = KERNEL.why_not


def supports(head_dim: int, heads: int, kv_heads: int, dtype: torch.dtype) -> bool:
    """Whether the kernel computes this attention layout and dtype (the model's and the
    pool's)."""
    return head_dim in HEAD_DIMS and heads % kv_heads == 0 and dtype == torch.bfloat16


def wanted_on_amx() -> bool:
    """Whether the backend is told (`SESSIONSERVE_CPU_EXTEND_KERNEL=1`) to take the kernel on
    a CPU with AMX; it does not otherwise: there torch's flash attention computes its bf16
    blocks on AMX tiles, and the kernel (AVX512-BF16 dot products) was measured only against
    torch's kernel on a CPU without them (docs/benchmarks.md, stop 104)."""
    return os.environ.get(DISABLE_ENV) == "1"


def usable(head_dim: int, heads: int, kv_heads: int, dtype: torch.dtype) -> bool:
    """Whether the torch backend takes the kernel for a model with this attention layout and
    dtype here: `supports` it, the kernel built and loaded, and not on an AMX CPU unless
    told (`wanted_on_amx`; said once in the log)."""
    global _said_amx
    if not supports(head_dim, heads, kv_heads, dtype):
        return False
    if torch.backends.cpu.get_cpu_capability() == "AMX" and not wanted_on_amx():
        if not _said_amx:
            _said_amx = True
            log.info(
                "%s not used: this CPU has AMX tiles, which torch's attention uses "
                "(%s=1 uses the kernel)",
                KERNEL.what,
                DISABLE_ENV,
            )
        return False
    return KERNEL.load()


def extend_attend(
    query: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Rows of T new tokens (query [B * T, H, D] bf16, a row's tokens consecutive) over their
    contexts (slots [B, W] int64, lens [B]; pools [S, KVH, D] bf16), each row's new tokens the
    last T of its context, already in the pool: token t of row b sees positions
    0..lens[b] - T + t. Returns [B * T, H, D] bf16. Loads the op first if this process has
    not."""
    KERNEL.require()
    return torch.ops.sessionserve.extend_attend(query, k_pool, v_pool, slots, lens, scale)
