"""Runs the transformers model on a flattened batch over the paged KV pool.

It sees only tensors: token ids, positions, the slot each new token's KV goes to, and one
`SeqSpec` per sequence (its new-token count and context slots). It never sees requests or
sessions. The batch arrives as host tensors and goes to the device in one copy. Pure-decode
batches replay a CUDA graph when `graphs` is set, short single-sequence extends when
`extend_graphs` is (see cuda_graphs.py); the rest run eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from sessionserve.cache.kv_pool import KVPool
from sessionserve.replicas.attention import AttentionBackend, ForwardMeta, SeqSpec, install
from sessionserve.replicas.attention.base import to_device

if TYPE_CHECKING:
    from sessionserve.replicas.cuda_graphs import DecodeGraphs, ExtendGraphs


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] (host)
    positions: torch.Tensor  # [T]
    out_slots: torch.Tensor  # [T]
    seqs: list[SeqSpec]
    logit_idx: torch.Tensor  # [N] flat token indices whose logits are needed
    want_hidden: bool = False  # also return every token's last hidden state (for EAGLE)

    @property
    def is_decode(self) -> bool:
        """Every sequence adds one token and samples from it (what a decode graph runs)."""
        return len(self.logit_idx) == len(self.seqs) == len(self.input_ids) and all(
            s.tree_mask is None for s in self.seqs
        )


class ModelRunner:
    def __init__(self, model: Any, kv_pool: KVPool, backend: AttentionBackend) -> None:
        self.model = model
        self.kv_pool = kv_pool
        self.backend = backend
        self.device = next(model.parameters()).device
        self.decoder = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        self.graphs: DecodeGraphs | None = None  # set by the engine on CUDA
        self.extend_graphs: ExtendGraphs | None = None
        install(model)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [N, V] for `batch.logit_idx`, and with `want_hidden` the last hidden state
        (after the final norm) of every token [T, H]; K/V of every new token is written to the
        pool. The decoder and the LM head run separately so the hidden states come for free."""
        if self.graphs is not None and batch.is_decode:
            out = self.graphs.run(batch)
            if out is not None:
                return out
        elif self.extend_graphs is not None:
            out = self.extend_graphs.run(batch)
            if out is not None:
                return out
        n = len(batch.input_ids)
        packed = to_device(
            torch.cat([batch.input_ids, batch.positions, batch.out_slots, batch.logit_idx]),
            self.device,
        )
        ids, pos, slots, logit_idx = packed.split([n, n, n, len(batch.logit_idx)])
        meta = ForwardMeta(
            self.backend, self.kv_pool, slots, self.backend.prepare(batch.seqs, self.device)
        )
        hidden = self.decode_hidden(ids, pos, meta)
        logits = self.lm_head(hidden[logit_idx])
        return logits, hidden if batch.want_hidden else None

    def decode_hidden(
        self, ids: torch.Tensor, positions: torch.Tensor, meta: ForwardMeta
    ) -> torch.Tensor:
        """The decoder over device tensors [T]: last hidden states [T, H]."""
        return self.decoder(
            input_ids=ids[None], position_ids=positions[None], use_cache=False, paged_meta=meta
        ).last_hidden_state[0]
