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
