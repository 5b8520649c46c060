"""Speculation figures: tokens drafted and accepted, and how many tokens each verify yields."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    """Counts over verify steps. The acceptance length of a step is the tokens it emits:
    accepted drafts plus the one the target adds (EAGLE's tau), so it is at least 1."""

    drafted: int = 0
    accepted: int = 0
    steps: int = 0
    histogram: dict[int, int] = field(default_factory=dict)  # acceptance length -> steps

    def record(self, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted
        self.steps += 1
        self.histogram[accepted + 1] = self.histogram.get(accepted + 1, 0) + 1

    @property
    def mean_accept_len(self) -> float:
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def as_dict(self) -> dict[str, object]:
        return {
            "drafted": self.drafted,
            "accepted": self.accepted,
            "verify_steps": self.steps,
            "mean_accept_len": round(self.mean_accept_len, 4),
            "accept_len_histogram": dict(sorted(self.histogram.items())),
        }
