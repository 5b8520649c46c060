"""The committed Grafana dashboards are exactly what the generator makes, and well formed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sessionserve.dashboards import DASHBOARDS, render_all

GRAFANA = Path(__file__).resolve().parents[3] / "deploy" / "grafana"


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_committed_json_matches_the_generator(name: str) -> None:
    committed = json.loads((GRAFANA / name).read_text())
    assert committed == render_all()[name], "regenerate: python -m sessionserve.dashboards"


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_dashboard_structure(name: str) -> None:
    board = render_all()[name]
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and "replica" in variables
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)) and len(ids) <= 20
    for p in board["panels"]:
        assert p["datasource"]["uid"] == "${datasource}"  # no hard-coded datasource
        assert "ray_sessionserve_" in p["description"] or "sessionserve_" in p["description"]
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}" and t["expr"].strip()
            if " / " in t["expr"]:
                assert "clamp_min(" in t["expr"], f"unguarded ratio in {p['title']}"


def test_overview_has_the_kpi_strip() -> None:
    titles = [p["title"] for p in render_all()["overview.json"]["panels"]]
    for kpi in (
        "Open sessions",
        "Session-held tokens",
        "KV usage",
        "TTFT p50",
        "TTFT p99",
        "Tokens/s",
        "Sticky-hit rate",
    ):
        assert kpi in titles


def _paths(obj: object, prefix: str = "") -> dict[str, object]:
    """Every leaf of a JSON document, keyed by its path."""
    if isinstance(obj, dict):
        return {k: v for key, val in obj.items() for k, v in _paths(val, f"{prefix}.{key}").items()}
    if isinstance(obj, list):
        return {k: v for i, val in enumerate(obj) for k, v in _paths(val, f"{prefix}[{i}]").items()}
    return {prefix: obj}


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_committed_json_round_trips_through_grafanas_typed_model(name: str) -> None:
    """Decoding the committed JSON into the SDK's `Dashboard` model (Grafana's schema) and
    encoding it again keeps every field and value: nothing outside the schema was written."""
    from grafana_foundation_sdk.cog import plugins
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.dashboard import Dashboard

    plugins.register_default_plugins()  # panel options and queries decode to typed models
    committed = json.loads((GRAFANA / name).read_text())
    again = json.loads(json.dumps(Dashboard.from_json(committed), cls=JSONEncoder))
    before, after = _paths(committed), _paths(again)
    lost = {k: v for k, v in before.items() if after.get(k, object()) != v}
    assert not lost, f"fields the schema does not know or changed: {sorted(lost)[:5]}"
