"""Runs the transformers model on a flattened batch over the paged KV pool.

It sees only tensors: token ids, positions, the slot each new token's KV goes to, and one
`SeqSpec` per sequence (its new-token count and context slots). It never sees requests or
sessions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from sessionserve.cache.kv_pool import KVPool
from sessionserve.replicas.attention import (
    AttentionBackend,
    ForwardMeta,
    SeqSpec,
    install,
)


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    out_slots: torch.Tensor  # [T]
    seqs: list[SeqSpec]
    logit_idx: torch.Tensor  # [N] flat token indices whose logits are needed


class ModelRunner:
    def __init__(self, model: Any, kv_pool: KVPool, backend: AttentionBackend) -> None:
        self.model = model
        self.kv_pool = kv_pool
        self.backend = backend
        self.device = next(model.parameters()).device
        install(model)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [N, V] for `batch.logit_idx`; K/V of every new token written to the pool."""
        dev = self.device
        meta = ForwardMeta(
            backend=self.backend,
            kv_pool=self.kv_pool,
            out_slots=batch.out_slots.to(dev),
            plan=self.backend.prepare(batch.seqs, dev),
        )
        out = self.model(
            input_ids=batch.input_ids.to(dev)[None],
            position_ids=batch.positions.to(dev)[None],
            use_cache=False,
            paged_meta=meta,
            logits_to_keep=batch.logit_idx.to(dev),
        )
        return out.logits[0]
