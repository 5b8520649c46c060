"""Logits GEMMs (a few rows times a vocabulary-sized weight) run by oneDNN on CPU.

A decode step's logits are a few rows times a weight the size of the vocabulary (SmolLM2:
49,152 x 576, 113 MB in fp32). Eager torch sends that fp32 GEMM (`F.linear`) to MKL, which on
the AMD EPYC we measured took 1.85-3.4x longer than oneDNN for 1-32 rows
(`benchmarks/logits_head.py`). So the eager forward's LM head and the EAGLE heads' draft
logits run here; the compiled forward keeps its own head GEMM, which inductor lays out so that
it was not slow (the same ms per token either way, measured). oneDNN, bundled with x86 torch
builds, reads the model's own weight as it is, so nothing is copied, and the model's `lm_head`
module is left unchanged: only who computes its product changes. Where oneDNN does not apply
(not CPU, not fp32, autograd, a head that is not a plain linear layer) the usual path runs.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn


@functools.cache
def _onednn_present() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _onednn_product(
    rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(rows, weight, bias, "none", [], "")


def uses_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `vocab_linear(x, weight)` runs on oneDNN (not while a compiler traces it: an
    exported package lays out its own GEMM, as it does for the target's LM head)."""
    return (
        not torch.compiler.is_compiling()
        and x.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        and _onednn_present()
    )


def vocab_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` ([..., H] x [V, H] -> [..., V]), on oneDNN where it can."""
    if not uses_onednn(x, weight):
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = _onednn_product(rows, weight, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


def head_logits(head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """What `head(hidden)` returns, through `vocab_linear` when `head` is a plain linear layer."""
    if type(head) is nn.Linear:
        return vocab_linear(hidden, head.weight, head.bias)
    return head(hidden)
