"""`benchmarks/first_start.py` reads when each package serves from the replica's own log
line, for every package a replica builds."""

from __future__ import annotations

import dataclasses
import inspect
import re

from benchmarks.first_start import INSTALLED, UNTIL
from sessionserve.replicas import compiled_decode, compiled_forward


def test_it_waits_for_every_package_by_the_line_its_install_logs() -> None:
    (default,) = [
        f.default for f in dataclasses.fields(compiled_forward.CompilePlan) if f.name == "role"
    ]
    source = inspect.getsource(compiled_forward) + inspect.getsource(compiled_decode)
    roles = {default, *re.findall(r'role="([^"]+)"', source)}
    assert set(UNTIL["all"]) == roles
    lines = "\n".join(compiled_forward.INSTALLED_LOG % (1, 48, role) for role in UNTIL["all"])
    assert INSTALLED.findall(lines) == list(UNTIL["all"])
