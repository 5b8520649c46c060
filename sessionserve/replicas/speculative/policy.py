"""When drafting pays: measured online, per batch size, on this machine now.

Whether speculation speeds decoding up depends on what a verify costs next to a plain step
(the hardware, the batch size, whether the forward is compiled or graphed) and on how much the
drafts are accepted (the model, the drafter, the workload): neither is known before serving.
So the engine measures both, per batch-size bucket, from decode-only steps timed from the first
draft to the last commit, split into the two things that vary on different time scales:
- **Yield**: tokens a step per decoding request, for each arm (1 for plain steps). A workload's
  acceptance changes slowly, one verify's varies from 1 to 5 tokens: a slow running mean
  (~200 drafting steps). A short one (~10-20) is not only noisy but low: the policy stops
  drafting when it dips and then samples drafting rarely, so it stays low for long (SmolLM2's
  head kept 1.40 tokens a verify where the short mean, averaged over decisions, read 1.30).
  Per request, because a bucket spans batch sizes (4-7, 8-15, ...) and a turn's tail shrinks
  through them.
- **Cost**: what a drafting step lasts over a plain one, from *paired* samples only: a step of
  the arm the policy is re-checking over the median of the other arm's steps just before it;
  the median of the last `COST_WINDOW` such samples. A machine's speed drifts (a shared 2-core
  VM: plain steps went from 14 to 29 ms within one run), and the arm being re-checked is
  measured every hundred steps or so: compared by their own running means, the two arms were
  measured at different speeds of the machine, and drafting that measured 1.2x faster in
  adjacent steps read 0.7x (SmolLM2, one request, bf16, docs/benchmarks.md). A ratio of
  neighbouring steps cancels the drift.
Drafting's speed over plain decoding is then (its yield / plain's) / cost. The next step
speculates when that is above 1, except every n-th decision in a bucket, which takes the other
arm so the ratio stays current; a bucket starts by trying both. A re-check of the slower arm
loses its gap (1 - slow / fast speed) of a step that lasts its own step time, so it costs
about gap * (slow step / fast step) fast steps, and re-checking every n-th step costs that / n
of throughput: n = max(`explore_every`, that / `explore_loss`), at most `max_explore_every`
decisions or, where more, `max_explore_s` of the faster arm's steps (a 16% gap at equal step
times is re-checked every 16 steps; a verify at 8 decodes that yields half the tokens/s in
steps 2.5x as long, every 125: about 1% of throughput either way). The cap bounds how stale
the ratio gets; in time rather than decisions alone because a dear re-check (below: one that
pays two steps' worth of put-off work at 32 requests) would otherwise cost 2% where
`explore_loss` aims at 1%.

A drafting step normally includes the head's pass over what it committed (the next step's
guess needs it); a re-check of drafting followed by plain steps puts that pass off, so its
time lacks it: the policy adds what that pass cost on drafting steps that ran it (per bucket),
or a re-check would make drafting look cheaper than drafting is.

The same pairs also say what one more draft costs, in rows of a plain step
(`Bucket.draft_cost`: the slope of the cost ratio less 1 over the drafting step's drafts per
request): a draft pays only if it is kept with at least that chance, since a kept draft is
worth one row's token. That floor (`draft_floor`) grows with the batch as a row's share of
the step shrinks, and the decoder stops each history chain at it (decoder.py `_cap`): on two
cores a chat's history chains, kept 55% a draft, pay at one request, where a draft costs
~0.15 of a row, and lose at 32, where it costs ~0.6 (docs/benchmarks.md); the on/off choice
above alone could only keep them whole or drop them.

Taking drafting up again has a price of its own: while requests do not draft, the head's
pass over their new positions waits (and a session turn that ends with it waiting leaves it
to the session's next turn), and taking drafting up pays for all of it (the step
before the first that drafts runs that pass, since the next step wants a guess; decoder.py:
no arm's timing includes it). So at each decision the decoder says how many
positions the decoding requests owe the head, and the policy prices them at what the head's
passes cost per extra position when drafting was taken up before (`observe_switch`,
`PassCost`): drafting is
taken up only where its gain over `explore_every` steps pays that back, and a re-check of
drafting counts it in its cost. (SmolLM2 on 2 cores, 8 requests, arms within a few percent:
without this the policy flipped between them and the deferred passes took 4-6% of decode
time, docs/benchmarks.md.) Priced from what is owed now, not from what the last switch cost:
a batch's tail, a few requests each owing its whole turn, owes far more than a re-check a few
steps after the last one.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

COST_WINDOW = 9  # the last paired samples the cost ratio is the median of
MIN_DRAFT_SAMPLES = 3  # paired samples before a draft's cost is read (`Bucket.draft_cost`)
DRAFT_COST_WINDOW = 16  # the last paired samples it is read from (and the pairs kept)
# the highest floor for drafts (`SpecPolicy.draft_floor`): chains kept nearly always (an
# agent's copies) still draft, so drafting steps go on measuring what a draft costs
MAX_DRAFT_FLOOR = 0.9


def smoothed(last: float | None, value: float, smoothing: float) -> float:
    """A running mean that starts at its first value."""
    return value if last is None else last + smoothing * (value - last)


class Sample(NamedTuple):
    """One observed step of an arm: its number in the bucket, its seconds, and the drafts it
    verified per decoding request (0 for a plain step)."""

    at: int
    seconds: float
    drafts: float


class Pair(NamedTuple):
    """A paired sample: a drafting step's seconds over a plain one's at the same speed of the
    machine, less 1 (`extra`), with the drafting step's drafts per decoding request (0 where
    the caller did not count them)."""

    drafts: float
    extra: float


@dataclass
class Arm:
    """One choice (draft, or not) in one bucket."""

    tokens: float = 0.0  # tokens a step per decoding request: a slow running mean
    step_s: float = 0.0  # what one of its steps lasts: a quick running mean
    steps: int = 0
    recent: deque[Sample] = field(default_factory=lambda: deque(maxlen=5))

    def observe(
        self,
        at: int,
        tokens: float,
        seconds: float,
        yield_smoothing: float,
        smoothing: float,
        drafts: float = 0.0,
    ) -> None:
        """Its step number `at` of the bucket: `tokens` per decoding request in `seconds`,
        `drafts` per decoding request verified."""
        self.steps += 1
        self.tokens = smoothed(
            None if self.steps == 1 else self.tokens, tokens, max(1 / self.steps, yield_smoothing)
        )
        self.step_s = smoothed(None if self.steps == 1 else self.step_s, seconds, smoothing)
        self.recent.append(Sample(at, seconds, drafts))

    def recent_steps(self, now: int, window: int) -> list[Sample]:
        """Its steps among the bucket's last `window` steps."""
        return [s for s in self.recent if now - s.at <= window]

    @property
    def last(self) -> int:
        return self.recent[-1].at if self.recent else -1


@dataclass
class Bucket:
    """One batch-size bucket's record: both arms, and their paired samples."""

    on: Arm = field(default_factory=Arm)
    off: Arm = field(default_factory=Arm)
    # appended through `add_pair`, which drops what is derived from them
    pairs: deque[Pair] = field(default_factory=lambda: deque(maxlen=DRAFT_COST_WINDOW))
    head_pass_s: float | None = None  # the head's pass on drafting steps that ran it
    since_recheck: int = 0  # decisions since its last re-check

    @property
    def observed(self) -> int:
        """Steps observed in this bucket (a step's number in it: `Arm.recent`)."""
        return self.on.steps + self.off.steps

    def add_pair(self, pair: Pair) -> None:
        """A new paired sample: what the pairs say (`cost_ratio`, `draft_cost`) is read again
        on next use, not at every step (the policy asks each step, and pairs come from its
        re-checks, tens of steps apart; `draft_cost`'s slopes took ~0.2 ms of Python a call,
        0.2-0.7% of decode time on 2 cores, docs/benchmarks.md)."""
        self.pairs.append(pair)
        for derived in ("cost_ratio", "draft_cost"):
            self.__dict__.pop(derived, None)

    @functools.cached_property
    def cost_ratio(self) -> float | None:
        """What a drafting step lasts over a plain one, at the same speed of the machine: the
        median of the last paired samples (a re-check that lands just after the machine
        changed speed is paired across the change, off by that much: the median ignores it,
        and follows a real change within a few re-checks)."""
        recent = list(self.pairs)[-COST_WINDOW:]
        return 1.0 + statistics.median(p.extra for p in recent) if recent else None

    @functools.cached_property
    def draft_cost(self) -> float | None:
        """What one more draft adds to a step, in rows of a plain step (its seconds over its
        decoding requests), from the paired samples: the slope of (cost ratio - 1) over
        drafts per request (Theil-Sen: the median of the slopes between pairs of samples, so
        a pair read across a change of the machine's speed does not tilt it), at most their
        ratio. A drafting step may cost something whatever its drafts (on a CPU a step past
        `compile_prefill_min_tokens` tokens runs the other compiled package): the ratio of
        one sample spreads that over its drafts, and read 1.1 a draft at 4-7 requests where
        the slope is ~0.2. Where the samples' drafts are all about one number there is no
        slope to read, and the ratio (their median weighted by drafts, an upper bound)
        stands in. None before `MIN_DRAFT_SAMPLES` pairs that counted their drafts."""
        samples = [p for p in self.pairs if p.drafts > 0]
        if len(samples) < MIN_DRAFT_SAMPLES:
            return None
        ordered = sorted((extra / drafts, drafts) for drafts, extra in samples)
        half, seen, ratio = sum(w for _, w in ordered) / 2, 0.0, ordered[-1][0]
        for per_draft, weight in ordered:
            seen += weight
            if seen >= half:
                ratio = per_draft
                break
        drafts = [d for d, _ in samples]
        mean = statistics.fmean(drafts)
        if statistics.pvariance(drafts) < (0.25 * mean) ** 2:
            return max(0.0, ratio)
        slopes = [
            (e2 - e1) / (d2 - d1)
            for i, (d1, e1) in enumerate(samples)
            for d2, e2 in samples[i + 1 :]
            if abs(d2 - d1) > 0.1 * mean
        ]
        slope = statistics.median(slopes) if slopes else ratio
        return max(0.0, min(slope, ratio))

    def speed_ratio(self) -> float | None:
        """Drafting's decode speed over plain decoding's."""
        cost = self.cost_ratio
        if cost is None or self.off.tokens <= 0:
            return None
        return self.on.tokens / self.off.tokens / cost

    def step_s(self, speculated: bool) -> float:
        """A step of that arm at the machine's speed now: the arm measured last, the other
        from it by the cost ratio."""
        fresh = self.on if self.on.last >= self.off.last else self.off
        cost = self.cost_ratio or 1.0
        if speculated == (fresh is self.on):
            return fresh.step_s
        return fresh.step_s * cost if speculated else fresh.step_s / cost


class PassCost:
    """What one more position adds to the head's pass: the slope of seconds over positions
    through recent passes (decayed sums, a weighted least-squares line). A pass has a fixed
    cost (one head forward, its next guess) that a ratio of seconds to positions spreads over
    the positions: most passes when drafting is taken up again cover a few positions (a plain
    re-check between drafting steps), so that ratio priced a 200-position backlog at 0.6 ms a
    position, 6 plain steps, and re-checks of drafting after plain runs came every 1,500
    steps (SmolLM2, one request, bf16). Where the passes seen are all about one size the
    slope is unknown, and the ratio (an upper bound) stands in."""

    def __init__(self, smoothing: float) -> None:
        self.decay = 1.0 - smoothing
        self.w = self.x = self.y = self.xx = self.xy = 0.0

    def observe(self, positions: int, seconds: float) -> None:
        d = self.decay
        self.w = d * self.w + 1.0
        self.x = d * self.x + positions
        self.y = d * self.y + seconds
        self.xx = d * self.xx + positions * positions
        self.xy = d * self.xy + positions * seconds

    def per_position(self) -> float:
        """Seconds a position (0 before any pass was seen)."""
        if self.w <= 0 or self.x <= 0:
            return 0.0
        mean_x, mean_y = self.x / self.w, self.y / self.w
        ratio = mean_y / mean_x
        var = self.xx / self.w - mean_x * mean_x
        if var < (0.5 * mean_x) ** 2:  # passes of about one size: no slope to read
            return ratio
        slope = (self.xy / self.w - mean_x * mean_y) / var
        return ratio if slope < 0 else min(slope, ratio)  # (below 0: the machine's drift)


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
        yield_smoothing: float = 0.005,
        pair_window: int = 8,
    ) -> None:
        self.clock = clock
        self.explore_every = explore_every
        self.explore_loss = explore_loss
        self.max_explore_every = max_explore_every
        self.max_explore_s = max_explore_s
        self.smoothing = smoothing
        self.yield_smoothing = yield_smoothing  # (a running mean of all steps until 1/n < it)
        self.pair_window = pair_window  # a pair's steps are at most this many steps apart
        self.warmup_steps = warmup_steps
        self.buckets: dict[int, Bucket] = {}
        self.passes = PassCost(smoothing)  # the head's passes when drafting was taken up

    def bucket(self, num_decodes: int) -> Bucket:
        return self.buckets.setdefault(bucket(num_decodes), Bucket())

    def choose(self, num_decodes: int, owed_positions: int = 0) -> bool:
        """Should the next step, with about `num_decodes` decoding requests that owe the head
        `owed_positions` put-off positions between them, draft?"""
        b = self.bucket(num_decodes)
        if b.on.steps < self.warmup_steps or b.off.steps < self.warmup_steps:
            return b.on.steps < self.warmup_steps  # drafting's warm-up first
        speed = b.speed_ratio()
        if speed is None:  # (no pair yet: the arms' steps were never neighbours)
            return b.on.last < b.off.last  # take the one measured longest ago
        b.since_recheck += 1
        owed_s = self.owed_s(owed_positions)
        best = self._drafting_pays(b, speed, owed_s)
        owed = 0.0 if best else owed_s  # a re-check of drafting pays it
        choice = best if b.since_recheck < self.recheck_every(b, owed) else not best
        if choice != best:
            b.since_recheck = 0
        return choice

    def owed_s(self, positions: int) -> float:
        """What the head's pass over `positions` put-off positions costs, as measured (nothing
        before the first measurement: taking drafting up once measures it)."""
        return positions * self.passes.per_position()

    def _drafting_pays(self, b: Bucket, speed: float, owed_s: float) -> bool:
        """Drafting is the faster, by enough to pay back the head's pass it owes (`owed_s`)
        within `explore_every` steps."""
        if speed < 1.0:
            return False
        if owed_s <= 0:
            return True
        gain = (1.0 - 1.0 / speed) * b.step_s(True) * self.explore_every
        return gain >= owed_s

    def recheck_every(self, b: Bucket, owed_s: float = 0.0) -> int:
        """Decisions between re-checks of the other arm: more, the more one costs (its speed
        gap, in steps as long as its own, plus `owed_s` of work it pays first, counted in the
        faster arm's steps)."""
        speed = b.speed_ratio()
        if speed is None or speed <= 0:
            return self.explore_every
        fast_s, slow_s = b.step_s(speed >= 1.0), b.step_s(speed < 1.0)
        if fast_s <= 0:
            return self.explore_every
        gap = 1.0 - min(speed, 1.0 / speed)
        cost = (gap * slow_s + owed_s) / fast_s  # fast steps lost per re-check
        every = max(self.explore_every, round(cost / self.explore_loss))
        cap = max(self.max_explore_every, int(self.max_explore_s / fast_s))
        return min(every, cap)

    def observe_switch(self, positions: int, seconds: float) -> None:
        """Taking drafting up again made the head catch up on `positions` positions (put off
        and new) in `seconds`."""
        if positions > 0 and seconds > 0:
            self.passes.observe(positions, seconds)

    def observe(
        self,
        num_decodes: int,
        speculated: bool,
        tokens: int,
        seconds: float,
        head_s: float = 0.0,
        head_positions: int = 0,
        put_off_positions: int = 0,
        drafts: int = 0,
    ) -> None:
        """One decode-only step of `num_decodes` requests: `tokens` emitted in `seconds`,
        `drafts` verified (0: a plain step). A drafting step's `seconds` include the head's
        pass over the `head_positions` it committed (`head_s` of them); `put_off_positions`
        of them waited instead (the next step does not draft), and are priced at what the
        pass cost. (A plain step's are timed without its pass: the decoder's `finish_step`.)"""
        if seconds <= 0 or num_decodes <= 0:
            return
        b = self.bucket(num_decodes)
        if speculated and put_off_positions == 0 and head_positions > 0:
            b.head_pass_s = smoothed(b.head_pass_s, head_s, self.smoothing)
        elif speculated and put_off_positions > 0 and b.head_pass_s:
            share = put_off_positions / (put_off_positions + head_positions)
            seconds += b.head_pass_s * share
        now = b.observed + 1  # this step's number in the bucket
        arm, other = (b.on, b.off) if speculated else (b.off, b.on)
        neighbours = other.recent_steps(now, self.pair_window)
        mine = arm.recent_steps(now, self.pair_window)
        per_request = drafts / num_decodes
        if neighbours and len(neighbours) >= len(mine):
            # the other arm ran just before, and more often: a step of this one next to the
            # median of those is a paired sample (a plain step after a drafting re-check is
            # not: paired with that one step, it would count the re-check's noise twice)
            paired = statistics.median(s.seconds for s in neighbours)
            cost = seconds / paired if speculated else paired / seconds
            spec_drafts = (
                per_request if speculated else statistics.median(s.drafts for s in neighbours)
            )
            b.add_pair(Pair(spec_drafts, cost - 1.0))
        arm.observe(
            now, tokens / num_decodes, seconds, self.yield_smoothing, self.smoothing, per_request
        )

    def draft_floor(self, num_decodes: int) -> float | None:
        """The chance of being kept below which a draft slows a step of about `num_decodes`
        requests down: what it adds to the step, in rows of a plain step (a kept draft is one
        more token, as a row's is), at most `MAX_DRAFT_FLOOR` (None: not measured yet). A
        draft's cost grows with the batch as a row's share of the step shrinks (SmolLM2,
        fp32, 2 cores: ~0.15 of a row at one request, ~0.4 at 8, ~0.6 at 32,
        docs/benchmarks.md), so chains that pay at one request lose at 32 unless cut where
        their drafts become unlikely."""
        cost = self.bucket(num_decodes).draft_cost
        return None if cost is None else min(cost, MAX_DRAFT_FLOOR)

    def summary(self) -> dict[str, dict[str, float]]:
        """Per bucket (its smallest batch size): each arm's tokens/s per decoding request at
        the machine's speed now (the arm measured last by its own steps, the other through
        the paired cost ratio) and its steps, and drafting's cost and speed over plain."""
        out: dict[str, dict[str, float]] = {}
        for b, rec in sorted(self.buckets.items()):
            row: dict[str, float] = {}
            for key, arm, speculated in (("plain", rec.off, False), ("spec", rec.on, True)):
                if arm.steps:
                    step_s = rec.step_s(speculated)
                    row[f"{key}_request_tokens_per_s"] = round(arm.tokens / step_s, 2)
                    row[f"{key}_steps"] = arm.steps
            speed = rec.speed_ratio()
            if rec.draft_cost is not None:
                row["draft_cost"] = round(rec.draft_cost, 3)
            if speed is not None:
                row["cost_ratio"] = round(rec.cost_ratio or 0.0, 3)
                row["speed_ratio"] = round(speed, 3)
            if row:
                out[str(1 << (b - 1))] = row
        return out
