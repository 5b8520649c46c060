"""Drafts from the sequence's own earlier tokens (n-gram or "prompt lookup" drafting).

The longest recent suffix of the sequence (`max_match` tokens, down to `min_match`) is looked
up in everything before it, and the drafts are what followed its earlier occurrences: token by
token, the one most of the occurrences agreeing so far went on with (the most recent breaks
ties), as suffix decoding weighs continuations by how often they occurred. Neither the most
recent occurrence alone (this drafter before) nor the earliest (vLLM's `ngram`) does as well
across workloads: an agent's edit follows the latest copy of its file, a chat's repeated
phrases their usual continuation (docs/benchmarks.md). No weights and no forward: it costs a
few vectorised scans of the request's token log per step. It pays where output repeats what
the context holds, which is what agents do (tool output quoted back, code edited in place,
JSON keys) and what a session holds the most of: its whole history is on the replica, so
every earlier turn is searchable. Snowflake's suffix trees (`arctic-inference`) ship as a
source build against vLLM, and transformers' `PromptLookupCandidateGenerator` takes the
leftmost match of a batch-1 tensor, so neither is used here.

Sampled requests verify these drafts as proposals from a point mass (q = 1 on the draft), which
the rejection-sampling acceptance (acceptance.py) keeps distribution-preserving.
"""

from __future__ import annotations

import numpy as np
import torch

from sessionserve.replicas.request import Request
from sessionserve.replicas.speculative.draft_state import TokenLog
from sessionserve.replicas.step import Drafts


def continuation(tokens: np.ndarray, max_drafts: int, min_match: int, max_match: int) -> np.ndarray:
    """What followed the earlier occurrences of the longest suffix of `tokens` (between
    `min_match` and `max_match` long) that occurred before, at most `max_drafts` tokens: at each
    depth the token most of the occurrences still agreeing so far continue with (ties: the most
    recent one's); empty when no suffix of `min_match` tokens occurred before."""
    begins = _after_occurrences(tokens, min_match, max_match)
    n, drafts = len(tokens), []
    while len(drafts) < max_drafts:
        begins = begins[begins + len(drafts) < n]  # a continuation may run into the suffix
        if len(begins) <= 1:  # one occurrence left (most matches): the rest is its own
            if len(begins):
                start = int(begins[0]) + len(drafts)
                drafts.extend(tokens[start : start + max_drafts - len(drafts)])
            break
        following = tokens[begins + len(drafts)]
        agree = following == following[-1]
        if agree.all():  # all of them (a loop): no vote to count
            pick = following[-1]
        else:
            values, counts = np.unique(following, return_counts=True)
            tied = values[counts == counts.max()]
            # ties: the most recent occurrence's (begins ascend)
            pick = following[np.flatnonzero(np.isin(following, tied))[-1]]
            agree = following == pick
        drafts.append(pick)
        begins = begins[agree]
    return np.asarray(drafts, dtype=tokens.dtype)


def _after_occurrences(tokens: np.ndarray, min_match: int, max_match: int) -> np.ndarray:
    """Where each earlier occurrence of the longest suffix of `tokens` (`max_match` down to
    `min_match` tokens) that occurred before ends, ascending; empty when none did."""
    n = len(tokens)
    for size in range(min(max_match, n - 1), min_match - 1, -1):
        suffix = tokens[n - size :]
        # occurrences starting at i < n - size, so at least one token follows each
        starts = np.flatnonzero(tokens[: n - size] == suffix[0])
        for j in range(1, size):
            if not len(starts):
                break
            starts = starts[tokens[starts + j] == suffix[j]]
        if len(starts):
            return starts + size
    return np.empty(0, dtype=np.int64)


class HistoryProposer:
    def __init__(
        self, num_drafts: int, min_match: int, max_match: int, vocab_size: int, device
    ) -> None:
        self.num_drafts = num_drafts
        self.min_match = min_match
        self.max_match = max_match
        self.vocab_size = vocab_size
        self.device = torch.device(device)

    def draft_len(self, req: Request, limit: int) -> int:
        """Looks the request's suffix up and keeps the proposal for `propose`; returns how many
        drafts it has (0: no earlier occurrence)."""
        d = req.drafting
        if d.log is None:
            d.log = TokenLog()
        d.log.extend(req.token_slice(d.log.size, req.num_tokens))  # the tokens since last step
        room = max(0, min(self.num_drafts, limit - req.num_tokens))
        found = continuation(d.log.array, room, self.min_match, self.max_match) if room else []
        d.history_tokens = [int(t) for t in found]
        return len(d.history_tokens)

    def propose(self, req: Request, length: int) -> Drafts:
        """The first `length` tokens of the proposal `draft_len` found; sampled requests get
        the point-mass distributions the acceptance test divides by."""
        tokens = req.drafting.history_tokens[:length]
        probs = None
        if not req.sampling.is_greedy:
            probs = torch.zeros(length, self.vocab_size, device=self.device)
            rows = torch.arange(length, device=self.device)
            probs[rows, torch.tensor(tokens, device=self.device)] = 1.0
        return Drafts(tokens, probs)
