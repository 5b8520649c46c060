"""The replica's gauges and counters, read off its parts for the metrics exporter.

Counters are kept as running totals where they happen (scheduler, cache, checker, speculative
decoder); the exporter turns totals into increments, so nothing here keeps state.
"""

from __future__ import annotations

from sessionserve.cache import MemoryChecker, MemoryTerms
from sessionserve.metrics import EngineMetrics
from sessionserve.replicas.scheduler import Scheduler
from sessionserve.replicas.speculative.stats import SpecStats


def export_gauges(
    metrics: EngineMetrics,
    terms: MemoryTerms,
    scheduler: Scheduler,
    checker: MemoryChecker,
    spec: SpecStats,
    overlap_totals: dict[str, int] | None = None,
) -> None:
    """Export the memory checker's `terms`, the queue figures and the running totals
    (`overlap_totals`: the engine's overlapped_steps and overlap_waits)."""
    cache = scheduler.cache
    tier = cache.host_tier
    while tier is not None and tier.restore_seconds:
        metrics.on_restore(tier.restore_seconds.popleft())
    metrics.on_step(
        terms,
        gauges={
            "running_requests": terms.live_requests,
            "queued_requests": len(scheduler.waiting),
            "open_sessions": len(cache.session_slots),
            "host_tier_bytes": terms.host_bytes,
            "host_tier_sessions": terms.host_sessions,
        },
        counter_totals={
            "memory_checks": checker.checks,
            "memory_check_failures": checker.failures,
            "retractions": scheduler.retractions_total,
            "session_evictions": cache.evicted_sessions_total,
            "spec_drafted_tokens": spec.drafted,
            "spec_accepted_tokens": spec.accepted,
            **(tier.totals() if tier is not None else {}),
            **(overlap_totals or {}),
        },
    )
