"""What the dashboards, alerts and docs name exists: every metric a dashboard query or an
alert rule reads is one the code defines, and every file path and `Class.member` the README
and docs/ name is in the repository. A rename that forgets them fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sessionserve.dashboards import render_all
from sessionserve.metrics import REPLICA_METRICS, ROUTER_METRICS

ROOT = Path(__file__).resolve().parents[3]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
METRIC = re.compile(r"\bray_(sessionserve_[a-z0-9_]+)")
SUFFIXES = ("_total", "_bucket", "_sum", "_count")
# a backticked path with a directory and a known extension, as the docs write them
PATH = re.compile(r"`([A-Za-z0-9_./-]+/[A-Za-z0-9_.-]+\.(?:py|md|yaml|yml|json|sh|toml))`")
MEMBER = re.compile(r"`([A-Z][a-z][A-Za-z0-9]*)\.([a-z_][a-z0-9_]*)(?:\(\))?`")
PACKAGE = ROOT / "sessionserve"


def defined(name: str) -> bool:
    names = set(REPLICA_METRICS) | set(ROUTER_METRICS)
    return name in names or any(name.endswith(s) and name[: -len(s)] in names for s in SUFFIXES)


def queries() -> list[str]:
    out = []

    def walk(node) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("expr"), str):
                out.append(node["expr"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(render_all())
    out += (ROOT / "helm/sessionserve/files/alerts.yml").read_text().splitlines()
    return out


def test_every_dashboard_and_alert_metric_is_defined() -> None:
    named = {m for q in queries() for m in METRIC.findall(q)}
    assert len(named) > 10
    unknown = sorted(n for n in named if not defined(n))
    assert not unknown, f"queried but never defined in sessionserve/metrics.py: {unknown}"


def _exists(path: str) -> bool:
    bases = (ROOT, PACKAGE, ROOT / "docs", ROOT / "helm/sessionserve")
    candidates = [base / path for base in bases]
    return any(c.exists() for c in candidates)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_file_the_docs_name_exists(doc: Path) -> None:
    text = doc.read_text()
    missing = sorted({p for p in PATH.findall(text) if not _exists(p) and "*" not in p})
    assert not missing, f"{doc.name} names files that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_class_member_the_docs_name_exists(doc: Path) -> None:
    source = "\n".join(p.read_text() for p in PACKAGE.rglob("*.py"))
    missing = []
    for cls, member in set(MEMBER.findall(doc.read_text())):
        body = re.search(rf"^class {cls}\b.*?(?=^class |\Z)", source, re.S | re.M)
        if body is None or not re.search(rf"\b{member}\b", body.group(0)):
            missing.append(f"{cls}.{member}")
    assert not missing, f"{doc.name} names members that do not exist: {sorted(missing)}"
