"""Attention backends behind one interface, plugged into transformers models.

`install(model)` registers our attention function with transformers' `AttentionInterface`
under ATTN_NAME and switches the model to it; each forward then passes a `ForwardMeta` as the
`paged_meta` keyword, which transformers hands through to every attention call unchanged.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
from transformers import AttentionInterface

from sessionserve.errors import InvalidConfigError
from sessionserve.replicas.attention.base import AttentionBackend, ForwardMeta, SeqSpec
from sessionserve.replicas.attention.torch_backend import TorchPagedBackend

ATTN_NAME = "sessionserve_paged"


def paged_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    paged_meta: ForwardMeta | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    if paged_meta is None:
        raise RuntimeError(
            f"the model uses {ATTN_NAME!r} attention but was called without paged_meta; "
            "run it through sessionserve's ModelRunner"
        )
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = paged_meta.backend.forward(module.layer_idx, query, key, value, paged_meta, scale)
    return out, None


AttentionInterface.register(ATTN_NAME, paged_attention)


def install(model: Any) -> None:
    model.set_attn_implementation(ATTN_NAME)


def select_backend(name: str, device: torch.device, **dims: Any) -> AttentionBackend:
    """`auto` picks FlashInfer on CUDA when it is installed, else the torch backend."""
    has_flashinfer = importlib.util.find_spec("flashinfer") is not None
    if name == "auto":
        name = "flashinfer" if device.type == "cuda" and has_flashinfer else "torch"
    if name == "torch":
        return TorchPagedBackend()
    if name == "flashinfer":
        if device.type != "cuda" or not has_flashinfer:
            raise InvalidConfigError(
                "attention backend 'flashinfer' needs a CUDA device and `pip install "
                "'sessionserve[gpu]'`; use 'torch' or 'auto' on this machine"
            )
        from sessionserve.replicas.attention.flashinfer_backend import FlashInferBackend

        return FlashInferBackend(device=device, **dims)
    raise InvalidConfigError(f"attention backend {name!r}: choose 'auto', 'torch' or 'flashinfer'")


__all__ = ["ATTN_NAME", "AttentionBackend", "ForwardMeta", "SeqSpec", "install", "select_backend"]
