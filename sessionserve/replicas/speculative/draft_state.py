"""What a request carries between steps when it drafts: the EAGLE head's next guess, the token
log the history drafter searches, and what its recent verifies accepted."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

DraftSource = Literal["eagle", "history"]

# what a source record's counts keep of themselves at each verify or judged chain (about the
# last ten count), and the weight of the even odds each of its probabilities starts from:
# light next to that, so a draft that keeps failing reads as unlikely (SourceRecord)
RECORD_DECAY = 0.9
RECORD_PRIOR = 0.25


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
    # the head's probability of `token`; a chain drafts on from it while its drafts'
    # product stays at `min_confidence`
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
    """How one draft source has fared on one request, as a chain: how often its first draft
    is kept, and how often a draft is kept after the one before it was. A source that repeats
    a loop keeps all of a chain or none of it (SmolLM2's chat answers: history chains of 4
    kept whole in 46% of verifies, none in 31%), which one acceptance rate reads as ~55% a
    draft and so stops its chains short. Counts decay by `RECORD_DECAY` a verify, so a
    request that stops matching (or starts) is noticed within a few steps. (A history chain
    counts as verified whole, cut short or not verified at all: the tokens the sequence made
    judge it, decoder.py `_judge_offered`.)"""

    verifies: int = 0
    first_kept: float = 0.0
    first_tried: float = 0.0
    next_kept: float = 0.0
    next_tried: float = 0.0

    def observe(self, drafted: int, accepted: int) -> None:
        """One verify: `accepted` of a chain of `drafted` drafts kept (the first `accepted`)."""
        # the drafts after the first were judged while the ones before them held: up to the
        # first rejected one, or the chain's end
        judged = min(accepted + 1, drafted) - 1 if accepted else 0
        d = RECORD_DECAY
        self.first_kept = d * self.first_kept + (accepted > 0)
        self.first_tried = d * self.first_tried + 1
        self.next_kept = d * self.next_kept + max(accepted - 1, 0)
        self.next_tried = d * self.next_tried + judged
        self.verifies += 1

    @property
    def first(self) -> float:
        """The chance the first draft is kept."""
        return (self.first_kept + RECORD_PRIOR / 2) / (self.first_tried + RECORD_PRIOR)

    @property
    def then(self) -> float:
        """The chance a draft is kept when the one before it was."""
        return (self.next_kept + RECORD_PRIOR / 2) / (self.next_tried + RECORD_PRIOR)

    def kept_through(self, n: int) -> float:
        """The chance a chain's first `n` drafts are all kept."""
        return self.first * self.then ** (n - 1) if n > 0 else 1.0

    def expected(self, n: int) -> float:
        """Drafts expected to be kept of a chain of `n`."""
        return sum(self.kept_through(j) for j in range(1, n + 1))

    def likely_len(self, n: int, floor: float) -> int:
        """How many of `n` drafts to verify: those kept with a chance of at least `floor`
        (none, where the first is less likely than that)."""
        return sum(1 for j in range(1, n + 1) if self.kept_through(j) >= floor)


@dataclass
class Drafting:
    """A request's speculation state besides the EAGLE guess: which source drafts this step,
    the history drafter's log and proposal, and each source's record."""

    source: DraftSource | None = None
    tree_depth: int = 0  # > 0: this step's EAGLE drafts are a tree this deep (else a chain)
    log: TokenLog | None = None
    history_tokens: list[int] = field(default_factory=list)
    records: dict[str, SourceRecord] = field(default_factory=dict)
    # the history chains offered at recent steps, whether verified, cut short or declined:
    # (the position of the first draft, the drafts), oldest first; the tokens the sequence
    # makes there judge each as a verify of the whole chain would (decoder.py)
    offered: list[tuple[int, list[int]]] = field(default_factory=list)
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
