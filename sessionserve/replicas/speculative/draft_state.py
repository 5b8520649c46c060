"""What a request carries between steps when it drafts: the EAGLE head's next guess, the token
log the history drafter searches, and what its recent verifies accepted."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

DraftSource = Literal["eagle", "history"]


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
    # a greedy request's best first drafts (target ids) and their log-probabilities, most
    # likely first, when the head drafts trees: the tree's first level
    candidates: tuple[list[int], list[float]] | None = None


class TokenLog:
    """A request's tokens (a session turn's whole history included) as a growing int32 array,
    so the history drafter searches it with numpy instead of Python loops. Appended as the
    request grows; built once per turn (a 100K-token history takes a few ms)."""

    def __init__(self) -> None:
        self._buf = np.empty(0, dtype=np.int32)
        self.size = 0

    def extend(self, tokens: list[int]) -> None:
        n = self.size + len(tokens)
        if n > len(self._buf):
            grown = np.empty(max(n, 2 * len(self._buf), 256), dtype=np.int32)
            grown[: self.size] = self._buf[: self.size]
            self._buf = grown
        self._buf[self.size : n] = tokens
        self.size = n

    @property
    def array(self) -> np.ndarray:
        return self._buf[: self.size]


@dataclass
class SourceRecord:
    """How one draft source has fared on one request: smoothed over its recent verifies, so a
    request that stops matching (or starts) is noticed within a few steps."""

    rate: float = 0.5  # drafts accepted / drafted
    run: float = 0.0  # drafts accepted per verify (set to the chain length at first use)
    verifies: int = 0

    def observe(self, drafted: int, accepted: int, smoothing: float = 0.5) -> None:
        if self.verifies == 0:
            self.rate, self.run = accepted / drafted, float(accepted)
        else:
            self.rate += smoothing * (accepted / drafted - self.rate)
            self.run += smoothing * (accepted - self.run)
        self.verifies += 1


@dataclass
class Drafting:
    """A request's speculation state besides the EAGLE guess: which source drafts this step,
    the history drafter's log and proposal, and each source's record."""

    source: DraftSource | None = None
    tree_depth: int = 0  # > 0: this step's EAGLE drafts are a tree this deep (else a chain)
    log: TokenLog | None = None
    history_tokens: list[int] = field(default_factory=list)
    records: dict[str, SourceRecord] = field(default_factory=dict)
    # this step's history drafts were all kept: the sequence is copying its context, so the
    # next step will draft from history again and the head's guess is not needed
    copying: bool = False
    # the EAGLE head's catch-up put off while the request does not draft: from this position,
    # with the target's hidden states since (run when drafting resumes or the request ends)
    deferred_from: int | None = None
    deferred_hidden: list[torch.Tensor] = field(default_factory=list)

    def record(self, source: DraftSource) -> SourceRecord:
        return self.records.setdefault(source, SourceRecord())

    def defer(self, start: int, hidden: torch.Tensor) -> None:
        if self.deferred_from is None:
            self.deferred_from = start
        self.deferred_hidden.append(hidden.clone())  # graph outputs are reused buffers

    def take_deferred(self, start: int, hidden: torch.Tensor) -> tuple[int, torch.Tensor]:
        """The deferred positions and this step's, as one catch-up."""
        if self.deferred_from is None:
            return start, hidden
        first, chunks = self.deferred_from, self.deferred_hidden + [hidden]
        self.drop_deferred()
        return first, torch.cat(chunks)

    def drop_deferred(self) -> None:
        """Forget a deferred catch-up (a retracted or failed request): the head's KV at those
        positions stays unwritten, which can only lower its acceptance later, never change an
        answer (every draft is verified)."""
        self.deferred_from, self.deferred_hidden = None, []
