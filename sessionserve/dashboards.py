"""Grafana dashboards as code: `python -m sessionserve.dashboards` writes them (into
deploy/grafana and the Helm chart's files/).

Built with Grafana's own Python SDK (`grafana-foundation-sdk`, generated from the schema
Grafana 11.6 ships), so every panel, query and variable is a typed model and the JSON is
valid by construction; this module only says *which* panels we want.

Three dashboards (overview, KV and sessions, speculative decoding), each with the Prometheus
datasource and the replica as variables, a description naming the metric on every panel, and
ratios guarded against empty denominators. Queries over counters that may not exist yet (a
counter's series appears with its first increment) end in `or vector(0)`. The committed JSON
is checked against this generator by the tests, so nobody hand-edits it.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from grafana_foundation_sdk.builders import dashboard as gd
from grafana_foundation_sdk.builders import prometheus, stat, timeseries
from grafana_foundation_sdk.builders.common import ReduceDataOptions, VizLegendOptions
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import dashboard as dm
from grafana_foundation_sdk.models.common import LegendDisplayMode

DATASOURCE = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")
R = '{replica=~"$replica"}'
W = "[5m]"


def m(name: str) -> str:
    """A metric as Ray exports it, filtered by the replica variable."""
    return f"ray_sessionserve_{name}{R}"


def rate(name: str) -> str:
    return f"sum(rate({m(name)}{W})) or vector(0)"


def quantile(q: float, name: str) -> str:
    return f"histogram_quantile({q}, sum by (le) (rate({m(name + '_bucket')}{W})))"


def ratio(num: str, den: str) -> str:
    return f"({num}) / clamp_min({den}, 1e-9)"


@dataclass
class Panel:
    """What differs between our panels; `build` turns it into the SDK's panel builder."""

    title: str
    exprs: list[tuple[str, str]]  # (PromQL, legend)
    description: str
    unit: str = "short"
    kind: str = "timeseries"  # or "stat"
    width: int = 12
    height: int = 8

    def build(self, panel_id: int) -> timeseries.Panel | stat.Panel:
        if self.kind == "stat":
            panel = stat.Panel().reduce_options(ReduceDataOptions().calcs(["lastNotNull"]))
        else:
            legend = VizLegendOptions().show_legend(True).display_mode(LegendDisplayMode.LIST)
            panel = timeseries.Panel().legend(legend)
        panel = (
            panel.id(panel_id)
            .title(self.title)
            .description(self.description)
            .datasource(DATASOURCE)
            .unit(self.unit)
            .span(self.width)
            .height(self.height)
        )
        for j, (expr, legend_format) in enumerate(self.exprs):
            query = prometheus.Dataquery().ref_id(chr(65 + j)).expr(expr)
            panel = panel.with_target(query.legend_format(legend_format).datasource(DATASOURCE))
        return panel


@dataclass
class Dashboard:
    uid: str
    title: str
    description: str
    panels: list[Panel] = field(default_factory=list)

    def build(self) -> dm.Dashboard:
        """The dashboard as the SDK's typed model (Grafana's own schema)."""
        board = (
            gd.Dashboard(self.title)
            .uid(self.uid)
            .description(self.description)
            .tags(["sessionserve"])
            .editable()
            .time("now-1h", "now")
            .refresh("10s")
            .with_variable(
                gd.DatasourceVariable("datasource").label("Data source").type("prometheus")
            )
            .with_variable(
                gd.QueryVariable("replica")
                .label("Replica")
                .datasource(DATASOURCE)
                .query("label_values(ray_sessionserve_kv_total_tokens, replica)")
                .include_all(True)
                .all_value(".*")
                .multi(True)
                .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
            )
        )
        for i, panel in enumerate(self.panels, start=1):
            board = board.with_panel(panel.build(i))
        return board.build()

    def to_json(self) -> dict:
        """Plain JSON, as Grafana imports it (the SDK's encoder, no hand-written fields)."""
        return json.loads(json.dumps(self.build(), cls=JSONEncoder))


def _stat(title: str, expr: str, desc: str, unit: str = "short") -> Panel:
    return Panel(title, [(expr, title)], desc, unit, kind="stat", width=4, height=4)


def overview() -> Dashboard:
    reusable = f"sum({m('kv_free_tokens')}) + sum({m('kv_evictable_tokens')})"
    usage = "1 - " + ratio(reusable, f"sum({m('kv_total_tokens')})")
    sticky = ratio(
        f"sum(rate(ray_sessionserve_router_sticky_hits_total{W})) or vector(0)",
        f"(sum(rate(ray_sessionserve_router_sticky_hits_total{W})) or vector(0)) + "
        f"(sum(rate(ray_sessionserve_router_placements_total{W})) or vector(0)) + "
        f"(sum(rate(ray_sessionserve_router_repins_total{W})) or vector(0))",
    )
    return Dashboard(
        "sessionserve-overview",
        "sessionserve: overview",
        "KPIs of the streaming-session server; see docs/observability.md.",
        [
            _stat(
                "Open sessions",
                f"sum({m('open_sessions')})",
                "ray_sessionserve_open_sessions: sessions open on the selected replicas.",
            ),
            _stat(
                "Session-held tokens",
                f"sum({m('session_held_tokens')})",
                "ray_sessionserve_session_held_tokens: KV resident for idle sessions.",
            ),
            _stat(
                "KV usage",
                usage,
                "1 - (ray_sessionserve_kv_free_tokens + kv_evictable_tokens)"
                " / kv_total_tokens: the share of KV that cannot be reused at once.",
                "percentunit",
            ),
            _stat(
                "TTFT p50",
                quantile(0.5, "ttft_seconds"),
                "ray_sessionserve_ttft_seconds: median time to first token over 5 min.",
                "s",
            ),
            _stat(
                "TTFT p99",
                quantile(0.99, "ttft_seconds"),
                "ray_sessionserve_ttft_seconds: p99 time to first token over 5 min.",
                "s",
            ),
            _stat(
                "Tokens/s",
                rate("generated_tokens_total"),
                "ray_sessionserve_generated_tokens_total: generated tokens per second.",
            ),
            Panel(
                "Sticky-hit rate",
                [(sticky, "sticky hits")],
                "ray_sessionserve_router_{sticky_hits,placements,repins}_total: share of session "
                "requests sent to their pinned replica (placements are new sessions).",
                "percentunit",
            ),
            Panel(
                "Time to first token",
                [
                    (quantile(0.5, "ttft_seconds"), "p50"),
                    (quantile(0.99, "ttft_seconds"), "p99"),
                    (quantile(0.5, "queue_seconds"), "queued p50"),
                ],
                "ray_sessionserve_ttft_seconds histogram: p50 and p99 over 5 min, from arrival at "
                "the replica; queued p50 (ray_sessionserve_queue_seconds) is the part spent "
                "waiting to be admitted into a batch.",
                "s",
            ),
            Panel(
                "Prompt tokens reused",
                [(ratio(rate("cached_tokens_total"), rate("prompt_tokens_total")), "cached share")],
                "ray_sessionserve_cached_tokens_total / ray_sessionserve_prompt_tokens_total: "
                "prompt tokens served from a session or the radix cache.",
                "percentunit",
            ),
            Panel(
                "Requests and tokens",
                [
                    (rate("requests_total"), "requests/s"),
                    (rate("generated_tokens_total"), "tokens/s"),
                ],
                "ray_sessionserve_requests_total and ray_sessionserve_generated_tokens_total "
                "per second.",
            ),
        ],
    )


def kv_and_sessions() -> Dashboard:
    return Dashboard(
        "sessionserve-kv",
        "sessionserve: KV cache and sessions",
        "Where every KV slot is, per replica: the memory invariant's terms.",
        [
            Panel(
                "Session-held tokens per replica",
                [(f"sum by (replica) ({m('session_held_tokens')})", "{{replica}}")],
                "ray_sessionserve_session_held_tokens: KV held by idle sessions.",
            ),
            Panel(
                "KV slots by state",
                [
                    (f"sum({m('kv_free_tokens')})", "free"),
                    (f"sum({m('kv_evictable_tokens')})", "evictable (radix)"),
                    (f"sum({m('kv_protected_tokens')})", "protected (radix, locked)"),
                    (f"sum({m('session_held_tokens')})", "held (idle sessions)"),
                    (f"sum({m('kv_in_flight_tokens')})", "in flight (running)"),
                ],
                "ray_sessionserve_kv_{free,evictable,protected,in_flight}_tokens and "
                "session_held_tokens: the terms of the memory invariant; they sum to "
                "kv_total_tokens.",
            ),
            Panel(
                "Sliding-window KV slots (Gemma 3, Mistral)",
                [
                    (f"sum({m('kv_sliding_free_tokens')})", "free"),
                    (f"sum({m('session_held_sliding_tokens')})", "held (idle sessions' windows)"),
                    (f"sum({m('kv_sliding_total_tokens')})", "total"),
                ],
                "ray_sessionserve_kv_sliding_{free,total}_tokens and "
                "session_held_sliding_tokens: the sliding-window layers' own slots, which hold "
                "each sequence's last window only (0 for a model without sliding layers).",
            ),
            Panel(
                "Sessions",
                [
                    (f"sum({m('open_sessions')})", "open"),
                    (f"sum({m('held_sessions')})", "holding KV, idle"),
                ],
                "ray_sessionserve_open_sessions and ray_sessionserve_held_sessions.",
            ),
            Panel(
                "Evictions and retractions",
                [
                    (rate("session_evictions_total"), "evictions/s"),
                    (rate("retractions_total"), "retractions/s"),
                ],
                "ray_sessionserve_session_evictions_total (idle sessions losing KV) and "
                "ray_sessionserve_retractions_total (decodes preempted for KV), per second.",
            ),
            Panel(
                "Host tier",
                [
                    (f"sum({m('host_tier_bytes')})", "bytes parked"),
                    (f"sum({m('host_tier_sessions')})", "sessions parked"),
                ],
                "ray_sessionserve_host_tier_bytes and host_tier_sessions: idle sessions' KV "
                "copied to host memory (engine.sessions.host_tier_bytes), restored by their "
                "next turn instead of a re-prefill.",
            ),
            Panel(
                "Host tier traffic",
                [
                    (rate("host_tier_parks_total"), "parks/s"),
                    (rate("host_tier_restores_total"), "restores/s"),
                    (rate("host_tier_evictions_total"), "host evictions/s"),
                    (f"{quantile(0.5, 'host_tier_restore_seconds')} or vector(0)", "restore p50 s"),
                ],
                "ray_sessionserve_host_tier_{parks,restores,evictions}_total per second "
                "(evictions: parked KV dropped for the budget, that session re-prefills) and "
                "the median of ray_sessionserve_host_tier_restore_seconds.",
            ),
            Panel(
                "Session migrations",
                [
                    (
                        f"sum by (trigger) (rate({m('sessions_migrated_total')}{W})) or vector(0)",
                        "{{trigger}}",
                    ),
                    (f"{quantile(0.5, 'migration_seconds')} or vector(0)", "move p50 s"),
                ],
                "ray_sessionserve_sessions_migrated_total by trigger (admin: POST "
                "/v1/sessions/{id}/migrate; shutdown: a stopping replica; rebalance: off a "
                "saturated one) per second, and the "
                "median of ray_sessionserve_migration_seconds (export + transfer + import).",
            ),
            Panel(
                "Memory checks",
                [
                    (rate("memory_checks_total"), "checks/s"),
                    (
                        f"sum(increase({m('memory_check_failures_total')}{W})) or vector(0)",
                        "failures (5 min)",
                    ),
                ],
                "ray_sessionserve_memory_checks_total and memory_check_failures_total: any "
                "failure is a lost or double-counted KV slot.",
            ),
            Panel(
                "Batch",
                [
                    (f"sum({m('running_requests')})", "running"),
                    (f"sum({m('queued_requests')})", "queued"),
                ],
                "ray_sessionserve_running_requests and ray_sessionserve_queued_requests.",
            ),
            Panel(
                "Aborts by phase",
                [(f"sum by (phase) (rate({m('aborts_total')}{W})) or vector(0)", "{{phase}}")],
                "ray_sessionserve_aborts_total by phase (queued, prefill, decode): client "
                "disconnects and explicit aborts.",
            ),
        ],
    )


def speculative() -> Dashboard:
    accept = ratio(rate("spec_accept_length_sum"), rate("spec_accept_length_count"))
    return Dashboard(
        "sessionserve-spec",
        "sessionserve: speculative decoding",
        "EAGLE drafting: how many drafted tokens the target accepts.",
        [
            Panel(
                "Mean acceptance length",
                [(accept, "tokens per verify")],
                "ray_sessionserve_spec_accept_length histogram: tokens accepted per verify "
                "step (the bonus token included).",
            ),
            Panel(
                "Drafted and accepted tokens/s",
                [
                    (rate("spec_drafted_tokens_total"), "drafted"),
                    (rate("spec_accepted_tokens_total"), "accepted"),
                ],
                "ray_sessionserve_spec_drafted_tokens_total and spec_accepted_tokens_total.",
            ),
            Panel(
                "Acceptance rate",
                [
                    (
                        ratio(
                            rate("spec_accepted_tokens_total"), rate("spec_drafted_tokens_total")
                        ),
                        "accepted/drafted",
                    )
                ],
                "ray_sessionserve_spec_accepted_tokens_total / spec_drafted_tokens_total.",
                "percentunit",
            ),
        ],
    )


DASHBOARDS = {
    "overview.json": overview,
    "kv-and-sessions.json": kv_and_sessions,
    "speculative.json": speculative,
}


def render_all() -> dict[str, dict]:
    return {name: build().to_json() for name, build in DASHBOARDS.items()}


def write(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, board in render_all().items():
        (directory / name).write_text(json.dumps(board, indent=2, sort_keys=True) + "\n")


# the Helm chart ships a copy (Helm can only read files inside the chart)
DEFAULT_DIRS = ("deploy/grafana", "helm/sessionserve/files")

if __name__ == "__main__":
    for target in sys.argv[1:] or DEFAULT_DIRS:
        write(Path(target))
