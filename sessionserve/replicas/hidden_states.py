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
    ids: torch.Tensor,
    positions: torch.Tensor,
    layers: tuple[int, ...] | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run a transformers decoder over one flat sequence [T]: (last hidden states [T, H],
    features [T, F]), the features being the last hidden states themselves when `layers` is
    None, else the `output_hidden_states` at `layers` concatenated (transformers keeps only
    the selected ones)."""
    if layers is None:
        out = decoder(input_ids=ids[None], position_ids=positions[None], use_cache=False, **kwargs)
        last = out.last_hidden_state[0]
        return last, last
    out = decoder(
        input_ids=ids[None],
        position_ids=positions[None],
        use_cache=False,
        output_hidden_states=list(layers),
        **kwargs,
    )
    return out.last_hidden_state[0], torch.cat([out.hidden_states[i][0] for i in layers], -1)
