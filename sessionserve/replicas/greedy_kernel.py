"""Each row's greedy token on a CPU (`greedy_kernel.cpp`): `max(dim=-1).indices` in two vector
passes over parts of the rows spread over the threads.

Why: torch's CPU reduction with an index costs ~1.3 cycles a logit, so with the vocabularies
of current models (Gemma 3: 262,144; Llama 3: 128,256) picking the tokens took ~5% of a decode
step of 8 requests (docs/benchmarks.md). The kernel reads fp32 or bf16 logits as they are, so
greedy steps skip their fp32 copy too. Built and loaded once per machine by
`native_kernel.NativeKernel` when an engine on a CPU starts (`load`); `takes` never builds.
`SESSIONSERVE_GREEDY_KERNEL=0` turns it off.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from sessionserve.replicas.native_kernel import NativeKernel

SOURCE = Path(__file__).with_name("greedy_kernel.cpp")
DISABLE_ENV = "SESSIONSERVE_GREEDY_KERNEL"  # "0": torch's reduction instead
DTYPES = (torch.float32, torch.bfloat16)
log = logging.getLogger(__name__)


def _register_fake() -> None:
    @torch.library.register_fake("sessionserve::greedy_tokens")
    def _(logits):  # noqa: ANN001, ANN202 (torch's signature)
        return logits.new_empty(logits.shape[:1], dtype=torch.int64)


KERNEL = NativeKernel(SOURCE, DISABLE_ENV, "the CPU greedy-token kernel", _register_fake, log)
# build (once per machine) and load the op; False, with the reason logged once, where it
# cannot be used here
load = KERNEL.load


def takes(logits: torch.Tensor) -> bool:
    """Whether `greedy_tokens` computes these logits: [rows, V > 0] fp32 or bf16 on a CPU, each
    row contiguous, with the kernel already loaded (this never builds it)."""
    return (
        logits.device.type == "cpu"
        and logits.dim() == 2
        and logits.shape[1] > 0
        and logits.dtype in DTYPES
        and logits.stride(1) == 1
        and KERNEL.loaded()
    )


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The index of each row's largest logit [rows] int64: the first on a tie, the first NaN
    where a row holds one, as `logits.max(dim=-1).indices` (for logits `takes`)."""
    return torch.ops.sessionserve.greedy_tokens(logits)
