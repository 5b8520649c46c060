"""The step's data, shared by everything that takes part in a step: what the scheduler
scheduled (`ScheduledBatch` of `ScheduledSeq`), the drafts proposed for it (`Drafts`: a chain
or a tree), the flat forward the model runner builds from them (`ForwardBatch`, `SeqLayout`),
what the forward produced (`StepOutput`), what the target committed for the drafter to catch
up on (`CatchUp`), and each request's news (`SeqUpdate`). Kept in one module below the
scheduler, the runner, the graphs and the speculative decoder so none of them imports another
for its types.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from sessionserve.replicas.attention.base import SeqSpec
from sessionserve.replicas.request import Request, TokenLogprob


@dataclass
class ScheduledSeq:
    req: Request
    start: int  # positions [start, end) of req.tokens are computed this step
    end: int
    num_drafts: int = 0  # speculative tokens verified after `end` (their slots are allocated)
    pending: int = 0  # of [start, end), the last tokens a step in flight is still sampling
    # (overlap scheduling): the forward reads them when it starts
    samples: bool = field(init=False)  # the whole input is computed after this step: a
    # token is sampled from its logits (fixed when scheduled: tokens get appended meanwhile)

    def __post_init__(self) -> None:
        self.samples = self.end == self.req.num_tokens + self.pending


@dataclass
class ScheduledBatch:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    retracted: list[Request] = field(default_factory=list)
    step: int = 0  # the scheduler's step number (what `Request.inflight_step` names)

    def __bool__(self) -> bool:
        return bool(self.seqs)


@dataclass
class SeqUpdate:
    """One request's news from a step: its new tokens (trimmed to the answer when it finished),
    and whether it finished, or failed alone (`error`; its KV is already given back)."""

    req: Request
    new_tokens: list[int] = field(default_factory=list)
    new_logprobs: list[TokenLogprob] = field(default_factory=list)
    finished: bool = False
    error: Exception | None = None


@dataclass
class CatchUp:
    """Positions [start, end) of `req` the target computed and committed this step, with the
    target's hidden states there ([end - start, H]); `wants_draft`: it decodes next step."""

    req: Request
    start: int
    end: int
    hidden: torch.Tensor
    wants_draft: bool


@dataclass
class Drafts:
    """One request's drafts for a verify: a chain (`parents` None: draft i follows draft
    i - 1), or a tree (`parents[i]`: the index of draft i's parent, -1 for the pending token;
    parents come before their children)."""

    tokens: list[int]
    probs: torch.Tensor | None  # [k, V] for sampled requests (chains only)
    parents: list[int] | None = None

    def depths(self) -> list[int]:
        """Each draft's distance from the pending token (its position is the pending
        token's plus this)."""
        if self.parents is None:
            return list(range(1, len(self.tokens) + 1))
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p < 0 else out[p] + 1)
        return out

    def tree_mask(self) -> torch.Tensor:
        """[k + 1, k + 1] bool over [pending token, drafts]: which see which (itself and its
        ancestors)."""
        k = len(self.tokens)
        mask = torch.zeros(k + 1, k + 1, dtype=torch.bool)
        mask[:, 0] = True
        for i, p in enumerate(self.parents or range(-1, k - 1)):
            mask[i + 1] = mask[p + 1]
            mask[i + 1, i + 1] = True
        return mask


@dataclass(frozen=True)
class PendingIds:
    """Input ids that the step before samples (overlap scheduling), already on the device:
    `tokens[i]` goes to position `index[i]` of the step's ids, with no wait for the host."""

    index: torch.Tensor
    tokens: torch.Tensor


@dataclass(frozen=True)
class LastSampled:
    """A step's sampled tokens on the device and each request's row among them."""

    tokens: torch.Tensor
    rows: dict[str, int]


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] (host)
    positions: torch.Tensor  # [T]
    out_slots: torch.Tensor  # [T]
    seqs: list[SeqSpec]
    logit_idx: torch.Tensor  # [N] flat token indices whose logits are needed
    want_hidden: bool = False  # also return every token's last hidden state (for EAGLE)
    sliding_out_slots: torch.Tensor | None = None  # [T] with sliding layers' KV kept apart
    pending: list[tuple[int, str]] = field(default_factory=list)  # (index in input_ids,
    # request id): tokens the previous step samples, filled in when the forward starts
    pending_ids: PendingIds | None = None  # the same, on the device (ModelRunner.run_prepared)

    def device_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """`ids` (this batch's input ids on the device, maybe padded) with the pending
        tokens written in: every forward path calls this once its ids are staged."""
        if self.pending_ids is not None:
            ids.index_copy_(0, self.pending_ids.index, self.pending_ids.tokens)
        return ids

    @property
    def is_decode(self) -> bool:
        """Every sequence adds one token and samples from it (what a decode graph runs)."""
        return len(self.logit_idx) == len(self.seqs) == len(self.input_ids) and all(
            s.tree_mask is None for s in self.seqs
        )


class SeqLayout(NamedTuple):
    """Where one scheduled sequence sits in a step's flat forward."""

    flat_start: int  # index of its first token (in the hidden states)
    logit_row: int  # its first logits row (k + 1 rows for a verify); -1 if it samples nothing


@dataclass
class StepOutput:
    """What one step's forward produced, by request id. `emitted` holds each sampled
    sequence's new tokens (the speculative decoder adds its verified runs); `errors` the
    requests whose own sampling or verify raised (they end alone, the batch goes on)."""

    logits: torch.Tensor
    hidden: torch.Tensor | None
    layout: dict[str, SeqLayout]
    emitted: dict[str, tuple[list[int], list[TokenLogprob]]] = field(default_factory=dict)
    errors: dict[str, Exception] = field(default_factory=dict)
    resolver: Callable[[], None] | None = None  # reads the sampled tokens back (ModelRunner)

    def resolve(self) -> None:
        """Fill `emitted` with the tokens sampled on the device, waiting for their copy to
        the host: at once on the synchronous path, when the step lands under overlap."""
        resolver, self.resolver = self.resolver, None
        if resolver is not None:
            resolver()
