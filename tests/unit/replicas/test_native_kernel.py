"""How a hand-written kernel's build is keyed: its source and every header it includes by a
quoted path, followed from each including file's folder, so a change to any of them builds
it again (and a header it does not include does not)."""

from __future__ import annotations

from pathlib import Path

from sessionserve.replicas.native_kernel import local_includes


def test_a_kernels_headers_are_those_it_includes_and_theirs(tmp_path: Path) -> None:
    (tmp_path / "attention").mkdir()
    (tmp_path / "attention" / "vector.h").write_text('#pragma once\n#include "vector_exp.h"\n')
    (tmp_path / "attention" / "vector_exp.h").write_text("#pragma once\n")
    (tmp_path / "attention" / "unrelated.h").write_text("#pragma once\n")
    (tmp_path / "other.h").write_text("#pragma once\n")
    source = tmp_path / "kernel.cpp"
    source.write_text(
        '#include <ATen/ATen.h>\n  #  include "attention/vector.h"  // primitives\n'
        '#include "missing.h"\nint main() { return 0; }\n'
    )
    got = [p.relative_to(tmp_path.resolve()) for p in local_includes(source)]
    assert got == [Path("attention/vector.h"), Path("attention/vector_exp.h")]


def test_the_shipped_kernels_include_the_vector_primitives() -> None:
    replicas = Path(__file__).parents[3] / "sessionserve" / "replicas"
    for source in ("sampling_kernel.cpp", "attention/cpu_decode_attention.cpp"):
        names = [p.name for p in local_includes(replicas / source)]
        assert names == ["cpu_vector.h", "cpu_vector_exp.h"], (source, names)
    assert local_includes(replicas / "block_linear.cpp") == []
