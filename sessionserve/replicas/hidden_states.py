"""Which of the target's hidden states a forward returns beside its logits.

An EAGLE head drafts from the last hidden state (after the final norm); an EAGLE-3 head from
three layers' states concatenated. Both come from transformers' own `output_hidden_states`
(which keeps only the selected indices), so the eager forward, the CUDA graphs and the
compiled package return the same features through one function.
"""

from __future__ import annotations

from typing import Any

import torch


def decoder_features(
    decoder: Any,
    ids: torch.Tensor | None,
    positions: torch.Tensor,
    layers: tuple[int, ...] | None,
    *,
    inputs_embeds: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run a transformers decoder over one flat sequence [T] (or a batch [B, T]): (last hidden
    states [T, H], features [T, F]; [B, T, ...] for a batch), the features being the last
    hidden states themselves when `layers` is None, else the `output_hidden_states` at
    `layers` concatenated (transformers keeps only the selected ones). `inputs_embeds` [T, H]
    (or [B, T, H]) instead of `ids`: the embeddings looked up already."""
    flat = positions.dim() == 1
    if flat:
        positions = positions[None]
        if inputs_embeds is not None:
            inputs_embeds = inputs_embeds[None]
        elif ids is not None:
            ids = ids[None]
    out = decoder(
        input_ids=ids if inputs_embeds is None else None,
        inputs_embeds=inputs_embeds,
        position_ids=positions,
        use_cache=False,
        **({} if layers is None else {"output_hidden_states": list(layers)}),
        **kwargs,
    )
    last = out.last_hidden_state
    feats = last if layers is None else torch.cat([out.hidden_states[i] for i in layers], -1)
    return (last[0], feats[0]) if flat else (last, feats)
