"""Paged attention as one opaque torch op, so a compiler can take the rest of the model.

`torch.compile` cannot trace our attention (Python plans, a pool indexed by slot lists), and a
graph break per layer would leave the model in 60 pieces. So under compilation each layer's
attention is a single call of `sessionserve::paged_attention(q, k, v, layer, scaling, window)`,
a `torch.library` custom op: inductor treats it as a kernel it cannot see into and fuses
everything around it (norms, rotary, activations, the GEMMs' epilogues). The op takes only
tensors and numbers; the forward's metadata (pool, plan, slots) is the one `ForwardMeta` the
caller makes current with `forward_context` for the duration of the forward, as vLLM's
forward context does. Its body is the eager path: write the new K/V, run the backend.

The current metadata is the calling thread's: a package's ops run on the thread that runs it,
and two threads may run forwards at once (the engine's step, and a first start's background
thread timing two packages against each other, `prefill_choice.split_point`, over a scratch
pool of its own). One metadata for the process let each thread's attention read the other's
pool and slots.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

from sessionserve.cache.kv_pool import as_stored
from sessionserve.replicas.attention.base import ForwardMeta

_current = threading.local()  # .meta: the ForwardMeta of the forward this thread runs


@contextlib.contextmanager
def forward_context(meta: ForwardMeta) -> Iterator[None]:
    """Make `meta` the metadata every `paged_attention` op of this forward reads."""
    previous = current_meta()
    _current.meta = meta
    try:
        yield
    finally:
        _current.meta = previous


def current_meta() -> ForwardMeta | None:
    """The metadata `forward_context` made current on this thread (None: outside one)."""
    return getattr(_current, "meta", None)


def attend(
    meta: ForwardMeta,
    layer: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float,
    window: int | None,
) -> torch.Tensor:
    """Write the new tokens' K/V into the pool, then let the backend attend over it (the new
    K/V as the pool holds them): [1, T, H, D] from q [1, H, T, D] and k/v [1, KVH, T, D]."""
    pool = meta.kv_pool
    pool.write(
        layer,
        meta.out_slots,
        key[0].transpose(0, 1),
        value[0].transpose(0, 1),
        meta.sliding_out_slots,
    )
    key, value = as_stored(key, pool.dtype), as_stored(value, pool.dtype)
    return meta.backend.forward(layer, query, key, value, meta, scaling, window)


@torch.library.custom_op("sessionserve::paged_attention", mutates_args=())
def paged_attention_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer: int,
    scaling: float,
    window: int,
) -> torch.Tensor:
    """`attend` with the current forward's metadata (`window` 0: full attention). The pool
    write is a side effect the compiler does not see; it stays ordered because each layer's
    op consumes the previous layer's output."""
    meta = current_meta()
    if meta is None:
        raise RuntimeError("sessionserve::paged_attention ran outside forward_context")
    return attend(meta, layer, query, key, value, scaling, window or None)


@paged_attention_op.register_fake
def _(query, key, value, layer, scaling, window):  # noqa: ANN001, ANN202 (torch's signature)
    _, heads, tokens, head_dim = query.shape
    return query.new_empty(1, tokens, heads, head_dim)
