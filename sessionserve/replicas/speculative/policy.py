"""When drafting pays: measured online, per batch size, on this machine now.

Whether speculation speeds decoding up depends on what a verify costs next to a plain step
(the hardware, the batch size, whether the forward is compiled or graphed) and on how much the
drafts are accepted (the model, the drafter, the workload): neither is known before serving.
So the engine measures both. Decode-only steps are timed from the first draft to the last
commit, and each step's emitted tokens per second goes into one of two running means for its
batch-size bucket: steps that verified drafts and steps that did not. The next step speculates
when that arm is the faster one, except every n-th decision in a bucket, which takes the other
arm so its mean stays current; a bucket starts by trying both. Re-checking a slower arm costs
about its gap / n, so n grows with the gap: n = max(`explore_every`, gap / `explore_loss`),
at most `max_explore_every` (a 16% gap is re-checked every 16 steps, a 50% gap every 50: about
1% of throughput either way).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Arm:
    tokens_per_s: float = 0.0
    steps: int = 0

    def observe(self, tokens_per_s: float, smoothing: float) -> None:
        if self.steps == 0:
            self.tokens_per_s = tokens_per_s
        else:
            self.tokens_per_s += smoothing * (tokens_per_s - self.tokens_per_s)
        self.steps += 1


def bucket(num_decodes: int) -> int:
    """Batch-size buckets 1, 2-3, 4-7, 8-15, ...: a verify's relative cost changes slowly
    with the batch, so powers of two share what they learn."""
    return max(1, num_decodes).bit_length()


class SpecPolicy:
    def __init__(
        self,
        clock: Callable[[], float] = time.perf_counter,
        explore_every: int = 16,
        smoothing: float = 0.2,
        warmup_steps: int = 2,
        explore_loss: float = 0.01,
        max_explore_every: int = 128,
    ) -> None:
        self.clock = clock
        self.explore_every = explore_every
        self.explore_loss = explore_loss
        self.max_explore_every = max_explore_every
        self.smoothing = smoothing
        self.warmup_steps = warmup_steps
        self.arms: dict[tuple[int, bool], Arm] = {}
        self._decisions: dict[int, int] = {}

    def arm(self, num_decodes: int, speculated: bool) -> Arm:
        return self.arms.setdefault((bucket(num_decodes), speculated), Arm())

    def choose(self, num_decodes: int) -> bool:
        """Should the next step, with about `num_decodes` decoding requests, draft?"""
        on, off = self.arm(num_decodes, True), self.arm(num_decodes, False)
        if on.steps < self.warmup_steps:
            return True
        if off.steps < self.warmup_steps:
            return False
        b = bucket(num_decodes)
        self._decisions[b] = n = self._decisions.get(b, 0) + 1
        best = on.tokens_per_s >= off.tokens_per_s
        return (not best) if n % self.recheck_every(on, off) == 0 else best

    def recheck_every(self, on: Arm, off: Arm) -> int:
        """Decisions between re-checks of the slower arm: more, the larger its gap."""
        fast, slow = max(on.tokens_per_s, off.tokens_per_s), min(on.tokens_per_s, off.tokens_per_s)
        gap = 1.0 - slow / fast if fast > 0 else 0.0
        every = max(self.explore_every, round(gap / self.explore_loss))
        return min(every, self.max_explore_every)

    def observe(self, num_decodes: int, speculated: bool, tokens: int, seconds: float) -> None:
        """One decode-only step: `tokens` emitted in `seconds`, drafts verified or not."""
        if seconds > 0 and num_decodes > 0:
            self.arm(num_decodes, speculated).observe(tokens / seconds, self.smoothing)

    def summary(self) -> dict[str, dict[str, float]]:
        """Per bucket (its smallest batch size): each arm's mean tokens/s and steps."""
        out: dict[str, dict[str, float]] = {}
        for (b, spec), arm in sorted(self.arms.items()):
            if arm.steps:
                key = "spec" if spec else "plain"
                row = out.setdefault(str(1 << (b - 1)), {})
                row[f"{key}_tokens_per_s"] = round(arm.tokens_per_s, 2)
                row[f"{key}_steps"] = arm.steps
        return out
