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
    want_hidden: bool = False  # also return every token's last hidden state (for EAGLE)


class ModelRunner:
    def __init__(self, model: Any, kv_pool: KVPool, backend: AttentionBackend) -> None:
        self.model = model
        self.kv_pool = kv_pool
        self.backend = backend
        self.device = next(model.parameters()).device
        self.decoder = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        install(model)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [N, V] for `batch.logit_idx`, and with `want_hidden` the last hidden state
        (after the final norm) of every token [T, H]; K/V of every new token is written to the
        pool. The decoder and the LM head run separately so the hidden states come for free."""
        dev = self.device
        meta = ForwardMeta(
            backend=self.backend,
            kv_pool=self.kv_pool,
            out_slots=batch.out_slots.to(dev),
            plan=self.backend.prepare(batch.seqs, dev),
        )
        hidden = self.decoder(
            input_ids=batch.input_ids.to(dev)[None],
            position_ids=batch.positions.to(dev)[None],
            use_cache=False,
            paged_meta=meta,
        ).last_hidden_state[0]
        logits = self.lm_head(hidden[batch.logit_idx.to(dev)])
        return logits, hidden if batch.want_hidden else None
