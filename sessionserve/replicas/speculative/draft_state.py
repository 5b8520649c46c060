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
    # the head's probability of `token` (1.0 where not measured: a CUDA catch-up graph);
    # a chain drafts on from it while its drafts' product stays at `min_confidence`
    confidence: float = 1.0


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
    # the EAGLE head's catch-up put off while the request does not draft (run when drafting
    # resumes or the request ends; a session turn may leave it to the session's next turn)
    deferred: DeferredCatchUp | None = None

    def record(self, source: DraftSource) -> SourceRecord:
        return self.records.setdefault(source, SourceRecord())

    def deferred_len(self, start: int) -> int:
        """Positions put off before `start` (before `resume_at(start)` too: what lies past it
        is not counted)."""
        d = self.deferred
        return 0 if d is None else max(0, min(d.end, start) - d.start)

    def resume_at(self, start: int) -> None:
        """Keep only the put-off positions before `start`, where this step's computing begins:
        a backlog carried from a session's last turn is contiguous with the new turn only where
        the turn kept that much of the session's KV (a chat turn may rewrite the history's
        tail; a session that lost its KV re-prefills from 0)."""
        d = self.deferred
        if d is not None:  # a gap after it cannot be bridged: dropped then
            self.deferred = d.cut(start) if start <= d.end else None

    def defer(self, start: int, hidden: torch.Tensor) -> None:
        if self.deferred is None:
            self.deferred = DeferredCatchUp(start, start)
        self.deferred.append(start, hidden.clone())  # graph outputs are reused buffers

    def take_deferred(self, start: int, hidden: torch.Tensor) -> tuple[int, torch.Tensor]:
        """The deferred positions and this step's, as one catch-up."""
        if self.deferred is None:
            return start, hidden
        first, chunks = self.deferred.start, self.deferred.hidden + [hidden]
        self.drop_deferred()
        return first, torch.cat(chunks)

    def drop_deferred(self) -> None:
        """Forget a deferred catch-up (a retracted or failed request): the head's KV at those
        positions stays unwritten, which can only lower its acceptance later, never change an
        answer (every draft is verified)."""
        self.deferred = None


@dataclass
class DeferredCatchUp:
    """The EAGLE head's pass over positions `start` to `end`, put off: the target's hidden
    states there, one chunk per step (the head's KV at those positions is unwritten)."""

    start: int
    end: int
    hidden: list[torch.Tensor] = field(default_factory=list)
    nbytes: int = 0  # the hidden states' memory

    def append(self, start: int, hidden: torch.Tensor) -> None:
        if start != self.end:
            raise ValueError(f"put-off positions end at {self.end}, not {start}")
        self.hidden.append(hidden)
        self.end += len(hidden)
        self.nbytes += hidden.numel() * hidden.element_size()

    def cut(self, end: int) -> DeferredCatchUp | None:
        """The positions before `end` (None if none)."""
        if end <= self.start:
            return None
        if end >= self.end:
            return self
        kept = DeferredCatchUp(self.start, self.start)
        for h in self.hidden:
            if kept.end < end:
                kept.append(kept.end, h[: end - kept.end])
        return kept
