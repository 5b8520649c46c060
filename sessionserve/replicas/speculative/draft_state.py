"""What a request carries between steps when it drafts: the drafter's next guess."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DraftState:
    """Made by the drafter's catch-up after each target forward, used by the next step.

    `token` is the first draft (the guess for the token after the pending one), `feature` the
    drafter's output that produced it (the hidden input of the next chain step), `probs` the
    distribution it was drawn from over the target vocabulary (sampled requests only).
    """

    token: int
    feature: torch.Tensor  # [H]
    probs: torch.Tensor | None = None  # [V]
