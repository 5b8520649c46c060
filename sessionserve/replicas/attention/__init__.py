"""Attention backends behind one interface, plugged into transformers models.

`install(model)` registers our attention function with transformers' `AttentionInterface`
under ATTN_NAME and switches the model to it; each forward then passes a `ForwardMeta` as the
`paged_meta` keyword, which transformers hands through to every attention call unchanged.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

import torch
from transformers import AttentionInterface

from sessionserve.errors import InvalidConfigError
from sessionserve.replicas.attention.base import AttentionBackend, ForwardMeta, SeqSpec
from sessionserve.replicas.attention.inplace_decode import InlineDecode
from sessionserve.replicas.attention.paged_op import attend, paged_attention_op
from sessionserve.replicas.attention.torch_backend import TorchPagedBackend

ATTN_NAME = "sessionserve_paged"
BACKENDS = ("auto", "torch", "flashinfer")
log = logging.getLogger(__name__)


def paged_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    paged_meta: ForwardMeta | None = None,
    inline_decode: InlineDecode | None = None,
    attention_dtype: torch.dtype | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Write the new tokens' K/V into the pool, then let the backend attend over it: with the
    `paged_meta` the caller passed (eager), or, inside a compiled forward, through the opaque
    op that reads the forward context (paged_op.py). With `inline_decode` (the decode step
    exported whole, compiled_decode.py), the attention is plain torch ops in the graph. With
    `attention_dtype` (a forward whose layers compute in fp32 beside a bf16 model's pool and
    backend: the prefill package of `compiled_forward._DecoderAndHead`'s `compute_dtype`),
    q/k/v are cast to it and the output back,
    so the pool holds, and the backend computes, what the model's own dtype would."""
    if attention_dtype is not None and query.dtype != attention_dtype:
        out, _ = paged_attention(
            module,
            query.to(attention_dtype),
            key.to(attention_dtype),
            value.to(attention_dtype),
            attention_mask,
            scaling,
            dropout,
            paged_meta,
            inline_decode,
            **kwargs,
        )
        return out.to(query.dtype), None
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    window = kwargs.get("sliding_window")  # transformers passes it for sliding layers
    layer = module.layer_idx
    if inline_decode is not None:
        return inline_decode.attend(layer, query, key, value, scale, window), None
    if paged_meta is not None:
        return attend(paged_meta, layer, query, key, value, scale, window), None
    if torch.compiler.is_compiling():
        return paged_attention_op(query, key, value, layer, scale, window or 0), None
    raise RuntimeError(
        f"the model uses {ATTN_NAME!r} attention but was called without paged_meta; "
        "run it through sessionserve's ModelRunner"
    )


AttentionInterface.register(ATTN_NAME, paged_attention)


def install(model: Any) -> None:
    model.set_attn_implementation(ATTN_NAME)


def attention_scale(model: Any, head_dim: int) -> float:
    """The softmax scale the model's attention layers pass in (`module.scaling`), which is
    not always head_dim**-0.5 (e.g. Gemma's query_pre_attn_scalar)."""
    for m in model.modules():
        scale = getattr(m, "scaling", None)
        if hasattr(m, "layer_idx") and isinstance(scale, float):
            return scale
    return head_dim**-0.5


def sliding_windows(config: Any) -> tuple[int, ...]:
    """The sliding windows the model's layers use (empty: full attention everywhere). Read
    from the config the way transformers' layers read it: `sliding_window`, on the layers
    `layer_types` marks `sliding_attention` (all layers where a model has no `layer_types`,
    as Mistral)."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if not window or (types is not None and "sliding_attention" not in types):
        return ()
    return (int(window),)


def sliding_layers(config: Any) -> tuple[int, ...]:
    """The layers that attend over a sliding window (all of them where a model has a window
    and no `layer_types`, as Mistral)."""
    if not sliding_windows(config):
        return ()
    types = getattr(config, "layer_types", None)
    if types is None:
        return tuple(range(config.num_hidden_layers))
    return tuple(i for i, t in enumerate(types) if t == "sliding_attention")


def check_supported(config: Any) -> None:
    """Refuse, at load, a model whose attention our backends would compute wrongly."""
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap is not None:
        raise InvalidConfigError(
            f"the model soft-caps its attention logits (attn_logit_softcapping={softcap}, "
            "Gemma 2): sessionserve's attention backends do not, so its answers would be "
            "wrong; serve a model without it (Gemma 3 has none)"
        )


def flashinfer_unsupported(
    device: torch.device,
    dtype: torch.dtype | None,
    head_dim: int | None,
    windows: tuple[int, ...] = (),
) -> str | None:
    """Why FlashInfer cannot serve this model here, or None if it can."""
    from sessionserve.replicas.attention import flashinfer_backend as fib

    if windows:
        return f"our FlashInfer plans have no sliding window yet (the model's: {windows})"
    if device.type != "cuda":
        return "it needs a CUDA device"
    if importlib.util.find_spec("flashinfer") is None:
        return "it is not installed (pip install 'sessionserve[gpu]')"
    if dtype is not None and dtype not in fib.SUPPORTED_DTYPES:
        return f"it has no {dtype} kernels (set model.dtype to bfloat16 or float16)"
    if head_dim is not None and head_dim not in fib.SUPPORTED_HEAD_DIMS:
        return f"it has no kernels for head dim {head_dim} (only {fib.SUPPORTED_HEAD_DIMS})"
    return None


def select_backend(name: str, device: torch.device, **dims: Any) -> AttentionBackend:
    """`auto` picks FlashInfer when it can serve the model (CUDA, installed, fp16/bf16, a head
    dim it has kernels for) and says why not otherwise; an explicit `flashinfer` that cannot
    work fails here, at startup, not inside the first forward."""
    if name not in BACKENDS:
        raise InvalidConfigError(
            f"attention backend {name!r}: choose 'auto', 'torch' or 'flashinfer'"
        )
    windows = dims.get("windows", ())
    torch_backend = TorchPagedBackend(dims.get("max_context_len"), windows)
    if name == "torch":
        return torch_backend
    why = flashinfer_unsupported(device, dims.get("dtype"), dims.get("head_dim"), windows)
    if why is not None:
        if name == "auto":
            (log.info if device.type == "cuda" else log.debug)(
                "attention backend auto: using torch, not FlashInfer, because %s", why
            )
            return torch_backend
        raise InvalidConfigError(
            f"attention backend 'flashinfer' cannot serve this model: {why}. "
            "Use attention_backend 'torch' or 'auto'"
        )
    from sessionserve.replicas.attention.flashinfer_backend import FlashInferBackend

    fi_dims = {k: v for k, v in dims.items() if k != "windows"}
    return FlashInferBackend(device=device, **fi_dims)


__all__ = [
    "ATTN_NAME",
    "AttentionBackend",
    "ForwardMeta",
    "SeqSpec",
    "attention_scale",
    "check_supported",
    "flashinfer_unsupported",
    "install",
    "select_backend",
    "sliding_layers",
    "sliding_windows",
]
