"""Every sessionserve metric, defined once.

Exported through Ray's metrics pipeline (`ray.util.metrics`): the metrics agent of each node
(each pod on Kubernetes) serves every replica's metrics on one scrape target, the KubeRay
convention. Ray prefixes names with `ray_` and counters get `_total`, so `sessionserve_ttft_seconds`
is scraped as `ray_sessionserve_ttft_seconds_bucket` and `sessionserve_prompt_tokens` as
`ray_sessionserve_prompt_tokens_total`. Labels are bounded: `replica` and `model` (plus `phase`,
`source`); never a session id.

Per-replica gauges are the memory checker's own terms (never recomputed here), refreshed by the
engine loop at most every `GAUGE_PERIOD_S`; counters and histograms move as events happen. A
counter's series appears with its first increment (Ray refuses `inc(0)`), so queries over rare
events use `... or vector(0)`.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sessionserve.cache.checker import MemoryTerms
    from sessionserve.replicas.request import RequestResult

GAUGE_PERIOD_S = 0.5
LATENCY_BUCKETS_S = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
# Ray's exporter estimates a histogram's _sum from bucket midpoints, not from the observations:
# buckets centred on the integers (k <= 16, so lengths 1..17) keep sum/count exact
ACCEPT_LEN_BUCKETS = [n + 0.5 for n in range(18)]

# name -> (kind, description, extra label keys)
REPLICA_METRICS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "sessionserve_session_held_tokens": ("gauge", "KV tokens held by idle sessions", ()),
    "sessionserve_held_sessions": ("gauge", "Sessions whose KV is resident and idle", ()),
    "sessionserve_open_sessions": ("gauge", "Open sessions (with or without resident KV)", ()),
    "sessionserve_kv_total_tokens": ("gauge", "KV slots of the replica", ()),
    "sessionserve_kv_free_tokens": ("gauge", "KV slots free", ()),
    "sessionserve_kv_evictable_tokens": ("gauge", "KV slots in unlocked radix pages", ()),
    "sessionserve_kv_protected_tokens": ("gauge", "KV slots in locked radix pages", ()),
    "sessionserve_kv_in_flight_tokens": ("gauge", "KV slots of running requests", ()),
    "sessionserve_session_held_sliding_tokens": (
        "gauge",
        "Sliding-window layers' KV slots held by idle sessions (their windows)",
        (),
    ),
    "sessionserve_kv_sliding_total_tokens": (
        "gauge",
        "Sliding-window layers' KV slots of the replica (0: none kept apart)",
        (),
    ),
    "sessionserve_kv_sliding_free_tokens": ("gauge", "Sliding-window layers' KV slots free", ()),
    "sessionserve_running_requests": ("gauge", "Requests in the running batch", ()),
    "sessionserve_queued_requests": ("gauge", "Requests waiting for admission", ()),
    "sessionserve_host_tier_bytes": ("gauge", "Host-tier bytes of parked sessions' KV", ()),
    "sessionserve_host_tier_sessions": ("gauge", "Sessions whose KV is parked in host memory", ()),
    "sessionserve_host_tier_parks": ("counter", "Idle sessions' KV copied to the host tier", ()),
    "sessionserve_host_tier_restores": ("counter", "Sessions' KV copied back from host", ()),
    "sessionserve_host_tier_evictions": ("counter", "Parked KV dropped for the host budget", ()),
    "sessionserve_host_tier_restore_seconds": (
        "histogram",
        "Time to copy a parked session's KV back into the pool (host side)",
        (),
    ),
    "sessionserve_sessions_migrated": (
        "counter",
        "Sessions moved to another replica, by trigger (admin, shutdown, rebalance)",
        ("trigger",),
    ),
    "sessionserve_migration_seconds": (
        "histogram",
        "Export + transfer + import time of one session migration (source side)",
        (),
    ),
    "sessionserve_memory_checks": ("counter", "Memory invariant checks run", ()),
    "sessionserve_memory_check_failures": ("counter", "Memory invariant checks that failed", ()),
    "sessionserve_retractions": ("counter", "Decode requests retracted for KV", ()),
    "sessionserve_overlapped_steps": (
        "counter",
        "Steps scheduled while the previous one ran (engine.overlap_schedule)",
        (),
    ),
    "sessionserve_overlap_waits": (
        "counter",
        "Steps that waited for the previous one's results first (KV short, grammar, penalties)",
        (),
    ),
    "sessionserve_session_evictions": ("counter", "Idle sessions whose KV was evicted", ()),
    "sessionserve_aborts": ("counter", "Requests aborted, by phase", ("phase",)),
    "sessionserve_requests": ("counter", "Requests finished (aborts included)", ()),
    "sessionserve_prompt_tokens": ("counter", "Prompt tokens of finished requests", ()),
    "sessionserve_generated_tokens": ("counter", "Tokens generated", ()),
    "sessionserve_cached_tokens": ("counter", "Prompt tokens reused, by source", ("source",)),
    "sessionserve_spec_drafted_tokens": ("counter", "Speculative tokens drafted", ()),
    "sessionserve_spec_accepted_tokens": ("counter", "Speculative tokens accepted", ()),
    "sessionserve_queue_seconds": (
        "histogram",
        "Time from arrival at the replica to first admission into a batch",
        (),
    ),
    "sessionserve_ttft_seconds": ("histogram", "Time to first token", ()),
    "sessionserve_itl_seconds": ("histogram", "Mean inter-token latency per request", ()),
    "sessionserve_e2e_seconds": ("histogram", "Request latency, arrival to finish", ()),
    "sessionserve_spec_accept_length": (
        "histogram",
        "Tokens emitted per verify step (accepted drafts + 1)",
        (),
    ),
}
ROUTER_METRICS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "sessionserve_router_sticky_hits": ("counter", "Session requests sent to their pin", ()),
    "sessionserve_router_placements": ("counter", "New sessions placed on a replica", ()),
    "sessionserve_router_repins": ("counter", "Sessions moved off a dead replica", ()),
}


def _make(name: str, kind: str, desc: str, keys: tuple[str, ...]) -> Any:
    from ray.util import metrics  # Ray is only needed where metrics are exported

    if kind == "gauge":
        return metrics.Gauge(name, desc, tag_keys=keys)
    if kind == "counter":
        return metrics.Counter(name, desc, tag_keys=keys)
    buckets = ACCEPT_LEN_BUCKETS if name.endswith("accept_length") else LATENCY_BUCKETS_S
    return metrics.Histogram(name, desc, boundaries=buckets, tag_keys=keys)


class EngineMetrics:
    """What the engine reports; the base class records nothing (in-process use, tests)."""

    def gauges_due(self) -> bool:
        return False

    def on_step(
        self, terms: MemoryTerms, gauges: dict[str, int], counter_totals: dict[str, int]
    ) -> None:
        """`terms`: the checker's; `gauges`: other gauge values by short name;
        `counter_totals`: running totals kept elsewhere, exported as increments."""

    def on_finish(self, result: RequestResult) -> None:
        pass

    def on_spec_step(self, accept_len: int) -> None:
        """One verify emitted `accept_len` tokens (accepted drafts + the target's own)."""

    def on_abort(self, phase: str) -> None:
        pass

    def on_restore(self, seconds: float) -> None:
        """A parked session's KV was copied back from the host tier."""

    def on_migration(self, trigger: str, seconds: float) -> None:
        """A session moved from this replica to another (`trigger`: admin or shutdown)."""


class RayEngineMetrics(EngineMetrics):
    """Exports through Ray's metrics agent, labelled with this replica and model."""

    def __init__(self, replica: str, model: str) -> None:
        self.tags = {"replica": replica, "model": model}
        self.m = {
            n: _make(n, k, d, ("replica", "model") + x) for n, (k, d, x) in REPLICA_METRICS.items()
        }
        self._last_gauges = 0.0
        self._totals: dict[str, int] = {}

    def gauges_due(self) -> bool:
        return time.monotonic() - self._last_gauges >= GAUGE_PERIOD_S

    def on_step(
        self, terms: MemoryTerms, gauges: dict[str, int], counter_totals: dict[str, int]
    ) -> None:
        self._last_gauges = time.monotonic()
        values = gauges | {
            "session_held_tokens": terms.held,
            "held_sessions": terms.held_sessions,
            "kv_total_tokens": terms.total,
            "kv_free_tokens": terms.free,
            "kv_evictable_tokens": terms.evictable,
            "kv_protected_tokens": terms.protected,
            "kv_in_flight_tokens": terms.in_flight,
            "session_held_sliding_tokens": terms.sliding_held,
            "kv_sliding_total_tokens": terms.sliding_total,
            "kv_sliding_free_tokens": terms.sliding_free,
        }
        for key, value in values.items():
            self.m[f"sessionserve_{key}"].set(value, tags=self.tags)
        for key, total in counter_totals.items():
            delta, self._totals[key] = total - self._totals.get(key, 0), total
            if delta > 0:
                self.m[f"sessionserve_{key}"].inc(delta, tags=self.tags)

    def on_finish(self, r: RequestResult) -> None:
        t = self.tags
        self.m["sessionserve_requests"].inc(1, tags=t)
        self.m["sessionserve_prompt_tokens"].inc(r.prompt_tokens, tags=t)
        if r.completion_tokens:
            self.m["sessionserve_generated_tokens"].inc(r.completion_tokens, tags=t)
        if r.cached_tokens:
            self.m["sessionserve_cached_tokens"].inc(
                r.cached_tokens, tags=t | {"source": r.cached_source}
            )
        if r.ttft_s is not None:  # admitted and answered: its queue time is real
            self.m["sessionserve_queue_seconds"].observe(r.queue_s, tags=t)
            self.m["sessionserve_ttft_seconds"].observe(r.ttft_s, tags=t)
            self.m["sessionserve_e2e_seconds"].observe(r.ttft_s + (r.decode_s or 0.0), tags=t)
        if r.decode_s is not None and r.completion_tokens > 1:
            self.m["sessionserve_itl_seconds"].observe(
                r.decode_s / (r.completion_tokens - 1), tags=t
            )

    def on_spec_step(self, accept_len: int) -> None:
        self.m["sessionserve_spec_accept_length"].observe(accept_len, tags=self.tags)

    def on_abort(self, phase: str) -> None:
        self.m["sessionserve_aborts"].inc(1, tags=self.tags | {"phase": phase})

    def on_restore(self, seconds: float) -> None:
        self.m["sessionserve_host_tier_restore_seconds"].observe(seconds, tags=self.tags)

    def on_migration(self, trigger: str, seconds: float) -> None:
        self.m["sessionserve_sessions_migrated"].inc(1, tags=self.tags | {"trigger": trigger})
        self.m["sessionserve_migration_seconds"].observe(seconds, tags=self.tags)


class RouterMetrics:
    """Counters of one router process (each proxy and ingress replica runs one)."""

    def __init__(self, app: str) -> None:
        self.tags = {"app": app}
        self.m = {n: _make(n, k, d, ("app",)) for n, (k, d, _) in ROUTER_METRICS.items()}

    def inc(self, what: str) -> None:
        self.m[f"sessionserve_router_{what}"].inc(1, tags=self.tags)
