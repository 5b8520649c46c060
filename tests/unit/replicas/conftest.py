"""Fixtures shared by the engine tests' modules."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def package_cache(tmp_path_factory) -> str:
    """One directory of compiled packages for the whole run, every xdist worker's modules
    included. A package's name is the key of everything it depends on
    (`compiled_forward.package_key`), so a module finds another's build of the same model as a
    replica finds its peer's, and `build_once`'s file lock makes a second builder wait for the
    first instead of building again (each build takes 25-60 s here)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # each worker's base is under the run's
        root = root.parent
    path = root / "packages"
    path.mkdir(exist_ok=True)
    return str(path)
