"""Every Serve config the repository ships (`deploy/`, `benchmarks/`) builds a valid app: its
args pass `AppConfig`'s validation, as `serve run` would check them only at startup."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from sessionserve.config import AppConfig

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted([*ROOT.glob("deploy/*.yaml"), *ROOT.glob("benchmarks/*.yaml")])


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_shipped_serve_config_validates(path: Path) -> None:
    apps = yaml.safe_load(path.read_text())["applications"]
    assert apps, f"{path} names no application"
    for app in apps:
        assert app["import_path"] == "sessionserve.app:build_app"
        AppConfig.model_validate(app.get("args") or {})
