"""Draft heads: what every layout offers (`DraftHead`), and the EAGLE-1/2 head
(`fc(concat(embed(token), target_hidden)) -> one decoder layer`); EAGLE-3's is in eagle3.py.

Its output is a *predicted target hidden state*; the target's own LM head turns it into draft
logits. Entry `q` of a sequence pairs token `x[q+1]` with the target's hidden state `h[q]` and
lives at KV slot `q` of the drafter's pool (the slot the target used for position `q`), so the
drafter's KV covers exactly the target's committed slots and is freed with them.

An optional draft vocabulary (`d2t`, as in EAGLE-3 checkpoints: draft id + d2t[id] = target id)
restricts drafting to the most frequent tokens: the head's matmul is most of a draft step's cost
on a small model, and a draft outside it only costs acceptance, never correctness.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)

from sessionserve.replicas.logits_head import vocab_linear


class DraftHead(nn.Module):
    """What the proposer and the trainer need of a draft head, whatever its layout.

    `features(ids, hidden, positions)` -> the head's output per position, which is fed back as
    the next draft step's `hidden`; `draft_logits(features)` scores the draft vocabulary. A
    draft vocabulary (`d2t`: draft id + d2t[id] = target id) restricts drafting to the most
    frequent tokens. `feature_layers` names the target hidden states the head reads (indices
    into transformers' `output_hidden_states`, concatenated), or None for the last one after
    the final norm. The target's embedding (and LM head, for heads without one) are borrowed,
    not parameters, so a saved checkpoint holds only the head's own weights.
    """

    feature_layers: tuple[int, ...] | None = None
    config: LlamaConfig
    d2t: torch.Tensor | None
    embed_tokens: nn.Embedding | None

    def _init_vocab(self, draft_vocab: torch.Tensor | None) -> None:
        if draft_vocab is not None:
            self.register_buffer("d2t", draft_vocab - torch.arange(draft_vocab.numel()))
        else:
            self.d2t = None
        self._target: tuple[nn.Module, nn.Module] | None = None  # (embedding, lm_head)

    # ---- wiring to the target ----
    def attach(self, target: Any) -> DraftHead:
        """Borrow `target`'s input embedding and LM head (checked for shape by the loader)."""
        self._target = (target.get_input_embeddings(), target.get_output_embeddings())
        return self

    def _borrowed(self) -> tuple[nn.Module, nn.Module]:
        if self._target is None:
            raise RuntimeError(f"{type(self).__name__}.attach(target_model) must come first")
        return self._target

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        table = self.embed_tokens if self.embed_tokens is not None else self._borrowed()[0]
        return table(input_ids)

    # ---- the draft vocabulary ----
    @property
    def draft_ids(self) -> torch.Tensor | None:
        """Target ids of the draft vocabulary, or None when drafting over the whole vocab."""
        if self.d2t is None:
            return None
        return self.d2t + torch.arange(self.d2t.numel(), device=self.d2t.device)

    def to_target(self, draft_idx: torch.Tensor) -> torch.Tensor:
        return draft_idx if self.d2t is None else draft_idx + self.d2t[draft_idx]

    def target_probs(self, draft_probs: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Spread draft-vocabulary probabilities ([..., Vd]) over the target vocabulary."""
        if self.d2t is None:
            return draft_probs
        full = draft_probs.new_zeros(*draft_probs.shape[:-1], vocab_size)
        full[..., self.draft_ids] = draft_probs
        return full

    # ---- compute (per layout) ----
    def features(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        **attn_kwargs: Any,
    ) -> torch.Tensor:
        raise NotImplementedError

    def draft_logits(self, features: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class EagleDrafter(DraftHead):
    """The EAGLE-1/2 layout. Weights: `fc.*`, `layers.0.*`, optionally `embed_tokens.weight`,
    `norm.weight`, `d2t`; it scores drafts with the target's own LM head."""

    def __init__(
        self,
        config: LlamaConfig,
        *,
        fc_bias: bool = True,
        input_norm: bool = True,
        final_norm: bool = False,
        own_embeddings: bool = False,
        draft_vocab: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        h = config.hidden_size
        self.config = config
        self.fc = nn.Linear(2 * h, h, bias=fc_bias)
        layer = LlamaDecoderLayer(config, layer_idx=0)
        if not input_norm:  # the EAGLE-1 layout: the first layer has no input norm
            layer.input_layernorm = nn.Identity()
        self.layers = nn.ModuleList([layer])
        self.norm = LlamaRMSNorm(h, eps=config.rms_norm_eps) if final_norm else None
        self.embed_tokens = nn.Embedding(config.vocab_size, h) if own_embeddings else None
        self.rotary = LlamaRotaryEmbedding(config)
        self._init_vocab(draft_vocab)
        self._head_weight: torch.Tensor | None = None

    def attach(self, target: Any) -> EagleDrafter:
        super().attach(target)
        self._head_weight = None
        return self

    def head_weight(self) -> torch.Tensor:
        """The LM head's rows the drafter scores (all, or the draft vocabulary's)."""
        if self._head_weight is None or self.training:
            w = self._borrowed()[1].weight
            ids = self.draft_ids
            w = w if ids is None else w[ids.to(w.device)]
            if self.training:
                return w
            self._head_weight = w.detach()
        return self._head_weight

    # ---- compute ----
    def features(
        self,
        input_ids: torch.Tensor,  # [B, T]
        hidden: torch.Tensor,  # [B, T, H] the target's (or the drafter's own) hidden states
        position_ids: torch.Tensor,  # [B, T]
        **attn_kwargs: Any,
    ) -> torch.Tensor:
        """Predicted next hidden states [B, T, H]. `attn_kwargs` reach the attention function
        (`paged_meta=` when serving, an attention mask when training)."""
        x = self.fc(torch.cat((self.embed(input_ids).to(hidden.dtype), hidden), dim=-1))
        pos_emb = self.rotary(x, position_ids)
        for layer in self.layers:
            x = layer(x, position_ids=position_ids, position_embeddings=pos_emb, **attn_kwargs)
        return self.norm(x) if self.norm is not None else x

    def draft_logits(self, features: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary ([..., Vd]); map choices back with `to_target`."""
        return vocab_linear(features, self.head_weight())


def drafter_config(target_config: Any, **overrides: Any) -> LlamaConfig:
    """A one-layer Llama config shaped like the target (what `train-drafter` builds)."""
    t = target_config
    fields = {
        "vocab_size": t.vocab_size,
        "hidden_size": t.hidden_size,
        "intermediate_size": t.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": t.num_attention_heads,
        "num_key_value_heads": getattr(t, "num_key_value_heads", None) or t.num_attention_heads,
        "head_dim": getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads,
        "rms_norm_eps": t.rms_norm_eps,
        "max_position_embeddings": t.max_position_embeddings,
        "hidden_act": getattr(t, "hidden_act", "silu"),
        "rope_parameters": getattr(t, "rope_parameters", None),
        "tie_word_embeddings": False,
    }
    fields.update(overrides)
    return LlamaConfig(**{k: v for k, v in fields.items() if v is not None})
