"""When drafting pays: measured online, per batch size, on this machine now.

Whether speculation speeds decoding up depends on what a verify costs next to a plain step
(the hardware, the batch size, whether the forward is compiled or graphed) and on how much the
drafts are accepted (the model, the drafter, the workload): neither is known before serving.
So the engine measures both. Decode-only steps are timed from the first draft to the last
commit, and each step's emitted tokens per second per decoding request goes into one of two
running means for its batch-size bucket: steps that verified drafts and steps that did not.
Per request, because a bucket spans batch sizes (4-7, 8-15, ...) and a turn's tail shrinks
through them: per step, an arm last measured at 7 requests would read 7/4 of one measured at
4 for the same speed (SmolLM2 on 2 cores, 8 requests, bf16: drafting took 70 of ~195 steps at
4-7, each 37-43 ms against plain steps' 28-30, and lost). The next step speculates
when that arm is the faster one, except every n-th decision in a bucket, which takes the other
arm so its mean stays current; a bucket starts by trying both. A re-check of the slower arm
loses its gap (1 - slow / fast tokens/s) of a step that lasts its own step time, so it costs
about gap * (slow step / fast step) fast steps, and re-checking every n-th step costs that / n
of throughput: n = max(`explore_every`, that / `explore_loss`), at most `max_explore_every`
decisions or, where more, `max_explore_s` of the faster arm's steps (a 16% gap at equal step
times is re-checked every 16 steps; a verify at 8 decodes that yields half the tokens/s in
steps 2.5x as long, every 125: about 1% of throughput either way). The cap bounds how stale
the other arm gets; in time rather than decisions alone because a dear re-check (below: one
that pays two steps' worth of put-off work at 32 requests) would otherwise cost 2% where
`explore_loss` aims at 1%.

Taking drafting up again has a price of its own: while requests do not draft, the head's
pass over their new positions waits (and a session turn that ends without drafting leaves its
pass to the session's next turn), and taking drafting up pays for all of it (the step
before the first that drafts runs that pass, since the next step wants a guess; decoder.py:
no arm's timing includes it). So at each decision the decoder says how many
positions the decoding requests owe the head, and the policy prices them at what the head's
passes cost per position when drafting was taken up before (`observe_switch`): drafting is
taken up only where its gain over `explore_every` steps pays that back, and a re-check of
drafting counts it in its cost. (SmolLM2 on 2 cores, 8 requests, arms within a few percent:
without this the policy flipped between them and the deferred passes took 4-6% of decode
time, docs/benchmarks.md.) Priced from what is owed now, not from what the last switch cost:
a batch's tail, a few requests each owing its whole turn, owes far more than a re-check a few
steps after the last one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


def smoothed(last: float | None, value: float, smoothing: float) -> float:
    """A running mean that starts at its first value."""
    return value if last is None else last + smoothing * (value - last)


@dataclass
class Arm:
    request_tokens_per_s: float = 0.0  # tokens a second per decoding request
    step_s: float = 0.0  # what one of its steps lasts: a re-check's cost scales with it
    steps: int = 0

    def observe(self, tokens: float, seconds: float, smoothing: float) -> None:
        """One step's `tokens` per decoding request in `seconds`."""
        first = self.steps == 0
        self.request_tokens_per_s = smoothed(
            None if first else self.request_tokens_per_s, tokens / seconds, smoothing
        )
        self.step_s = smoothed(None if first else self.step_s, seconds, smoothing)
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
        max_explore_s: float = 30.0,
    ) -> None:
        self.clock = clock
        self.explore_every = explore_every
        self.explore_loss = explore_loss
        self.max_explore_every = max_explore_every
        self.max_explore_s = max_explore_s
        self.smoothing = smoothing
        self.warmup_steps = warmup_steps
        self.arms: dict[tuple[int, bool], Arm] = {}
        self._since_recheck: dict[int, int] = {}
        # the head's passes when drafting was taken up again: running means of their seconds
        # and positions (their ratio weighs big passes most, where a pass's fixed cost fades)
        self._switch_s: float | None = None
        self._switch_positions: float | None = None

    def arm(self, num_decodes: int, speculated: bool) -> Arm:
        return self.arms.setdefault((bucket(num_decodes), speculated), Arm())

    def choose(self, num_decodes: int, owed_positions: int = 0) -> bool:
        """Should the next step, with about `num_decodes` decoding requests that owe the head
        `owed_positions` put-off positions between them, draft?"""
        on, off, b = self.arm(num_decodes, True), self.arm(num_decodes, False), bucket(num_decodes)
        if on.steps < self.warmup_steps or off.steps < self.warmup_steps:
            return on.steps < self.warmup_steps  # drafting's warm-up first
        # decisions since this bucket's last re-check
        self._since_recheck[b] = n = self._since_recheck.get(b, 0) + 1
        owed_s = self.owed_s(owed_positions)
        best = self._drafting_pays(on, off, owed_s)
        owed = 0.0 if best else owed_s  # a re-check of drafting pays it
        choice = best if n < self.recheck_every(on, off, owed) else not best
        if choice != best:
            self._since_recheck[b] = 0
        return choice

    def owed_s(self, positions: int) -> float:
        """What the head's pass over `positions` put-off positions costs, as measured (nothing
        before the first measurement: taking drafting up once measures it)."""
        if not self._switch_s or not self._switch_positions:
            return 0.0
        return positions * self._switch_s / self._switch_positions

    def _drafting_pays(self, on: Arm, off: Arm, owed_s: float) -> bool:
        """Drafting's tokens/s is the higher, by enough to pay back the head's pass it owes
        (`owed_s`) within `explore_every` steps."""
        if on.request_tokens_per_s < off.request_tokens_per_s:
            return False
        if owed_s <= 0 or on.request_tokens_per_s <= 0:
            return True
        gain = (
            (1.0 - off.request_tokens_per_s / on.request_tokens_per_s)
            * on.step_s
            * self.explore_every
        )
        return gain >= owed_s

    def recheck_every(self, on: Arm, off: Arm, owed_s: float = 0.0) -> int:
        """Decisions between re-checks of the other arm: more, the more one costs (its
        tokens/s gap, in steps as long as its own, plus `owed_s` of work it pays first,
        counted in the faster arm's steps)."""
        fast, slow = (on, off) if on.request_tokens_per_s >= off.request_tokens_per_s else (off, on)
        if fast.request_tokens_per_s <= 0 or fast.step_s <= 0:
            return self.explore_every
        gap = 1.0 - slow.request_tokens_per_s / fast.request_tokens_per_s
        cost = (gap * slow.step_s + owed_s) / fast.step_s  # fast steps lost per re-check
        every = max(self.explore_every, round(cost / self.explore_loss))
        cap = max(self.max_explore_every, int(self.max_explore_s / fast.step_s))
        return min(every, cap)

    def observe_switch(self, positions: int, seconds: float) -> None:
        """Taking drafting up again made the head catch up on `positions` positions (put off
        and new) in `seconds`."""
        if positions > 0 and seconds > 0:
            self._switch_s = smoothed(self._switch_s, seconds, self.smoothing)
            self._switch_positions = smoothed(self._switch_positions, positions, self.smoothing)

    def observe(self, num_decodes: int, speculated: bool, tokens: int, seconds: float) -> None:
        """One decode-only step of `num_decodes` requests: `tokens` emitted in `seconds`,
        drafts verified or not."""
        if seconds > 0 and num_decodes > 0:
            arm = self.arm(num_decodes, speculated)
            arm.observe(tokens / num_decodes, seconds, self.smoothing)

    def summary(self) -> dict[str, dict[str, float]]:
        """Per bucket (its smallest batch size): each arm's mean tokens/s per decoding
        request, and its steps."""
        out: dict[str, dict[str, float]] = {}
        for (b, spec), arm in sorted(self.arms.items()):
            if arm.steps:
                key = "spec" if spec else "plain"
                row = out.setdefault(str(1 << (b - 1)), {})
                row[f"{key}_request_tokens_per_s"] = round(arm.request_tokens_per_s, 2)
                row[f"{key}_steps"] = arm.steps
        return out
