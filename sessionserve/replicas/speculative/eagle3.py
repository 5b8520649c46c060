"""The EAGLE-3 draft head: it reads three of the target's layers, not only the last.

`fc` fuses the target's hidden states from three layers ([T, 3h] -> [T, h]; by default the
inputs of layers 2, L//2 and L-3, or the checkpoint's `eagle_aux_hidden_state_layer_ids`, which
name layer outputs). One decoder layer (`midlayer`) attends over [norm(embedding); norm(hidden)]
(width 2h) with the hidden state as its residual stream, and the head scores its own draft
vocabulary (`lm_head` [Vd, h], `d2t` maps draft ids to target ids). A chained draft step feeds
back the layer's output before the final norm (width h, so `fc` is skipped); the draft logits
come from after it. This is the layout published EAGLE-3 heads ship (config architecture
`LlamaForCausalLMEagle3`), built from unmodified transformers Llama parts, so our paged
attention plugs into its attention as it does into the target's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)

from sessionserve.replicas.logits_head import head_logits
from sessionserve.replicas.speculative.drafter import DraftHead


def default_feature_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's default: the inputs of layers 2, L//2 and L-3 (transformers'
    `output_hidden_states` indices, where index i is the input of layer i)."""
    return (2, num_layers // 2, num_layers - 3)


def feature_layers_from_ids(layer_ids: Sequence[int]) -> tuple[int, ...]:
    """`eagle_aux_hidden_state_layer_ids` name the layers whose *outputs* are read: the output
    of layer i is the input of layer i + 1."""
    return tuple(int(i) + 1 for i in layer_ids)


class Eagle3MidLayer(nn.Module):
    """One decoder layer over [input_layernorm(embedding); hidden_norm(hidden)], its residual
    stream the hidden state (not the concatenation)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = LlamaAttention(config, layer_idx=0)
        for name in ("q_proj", "k_proj", "v_proj"):  # the attention reads width 2h
            proj = getattr(self.self_attn, name)
            setattr(
                self.self_attn,
                name,
                nn.Linear(2 * h, proj.out_features, bias=proj.bias is not None),
            )
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(h, eps=eps)
        self.hidden_norm = LlamaRMSNorm(h, eps=eps)
        self.post_attention_layernorm = LlamaRMSNorm(h, eps=eps)

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        **attn_kwargs: Any,
    ) -> torch.Tensor:
        x = torch.cat((self.input_layernorm(embeds), self.hidden_norm(hidden)), dim=-1)
        attn, _ = self.self_attn(x, position_embeddings=position_embeddings, **attn_kwargs)
        residual = hidden + attn
        return residual + self.mlp(self.post_attention_layernorm(residual))


class Eagle3Drafter(DraftHead):
    """Weights: `fc.weight` (+ `fc.bias`), `midlayer.*`, `norm.weight`, optionally
    `lm_head.weight` (else the target's, over its whole vocabulary), `embed_tokens.weight`
    (else the target's), `d2t` (with `lm_head`: its rows' target ids)."""

    def __init__(
        self,
        config: LlamaConfig,
        feature_layers: Sequence[int],
        *,
        target_hidden_size: int | None = None,
        fc_bias: bool = False,
        own_embeddings: bool = False,
        own_head: bool = True,
        draft_vocab: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        h = config.hidden_size
        if draft_vocab is not None and not own_head:
            raise ValueError("a draft vocabulary needs the head's own lm_head")
        self.config = config
        self.feature_layers = tuple(feature_layers)
        self.fc = nn.Linear(len(self.feature_layers) * (target_hidden_size or h), h, bias=fc_bias)
        self.midlayer = Eagle3MidLayer(config)
        self.norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.embed_tokens = nn.Embedding(config.vocab_size, h) if own_embeddings else None
        rows = config.vocab_size if draft_vocab is None else draft_vocab.numel()
        self.lm_head = nn.Linear(h, rows, bias=False) if own_head else None
        self.rotary = LlamaRotaryEmbedding(config)
        self._init_vocab(draft_vocab)

    def features(
        self,
        input_ids: torch.Tensor,  # [B, T]
        hidden: torch.Tensor,  # [B, T, 3h] the target's layers, or [B, T, h] the head's own
        position_ids: torch.Tensor,  # [B, T]
        **attn_kwargs: Any,
    ) -> torch.Tensor:
        """The layer's output before the final norm [B, T, h]: what a chained step reads."""
        if hidden.shape[-1] != self.config.hidden_size:
            hidden = self.fc(hidden)
        embeds = self.embed(input_ids).to(hidden.dtype)
        pos_emb = self.rotary(hidden, position_ids)
        return self.midlayer(embeds, hidden, pos_emb, position_ids=position_ids, **attn_kwargs)

    def draft_logits(self, features: torch.Tensor) -> torch.Tensor:
        x = self.norm(features)
        head = self.lm_head if self.lm_head is not None else self._borrowed()[1]
        return head_logits(head, x)
