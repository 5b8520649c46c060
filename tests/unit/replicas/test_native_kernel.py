"""How a hand-written kernel's build is keyed: its source and every header it includes by a
quoted path, followed from each including file's folder, so a change to any of them builds
it again (and a header it does not include does not)."""

from __future__ import annotations

import os
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


def test_every_shipped_kernel_is_one_prefetch_builds() -> None:
    from sessionserve.replicas import block_linear, cpu_linear, native_kernel, sampling_kernel
    from sessionserve.replicas.attention import cpu_decode_kernel, cpu_extend_kernel

    shipped = [cpu_decode_kernel, cpu_extend_kernel, block_linear, cpu_linear, sampling_kernel]
    assert all(any(m.KERNEL is k for k in native_kernel.KERNELS) for m in shipped)


def test_prefetch_builds_the_kernels_at_once_each_on_a_thread_of_its_own(monkeypatch) -> None:
    """Each fake kernel's build waits until all have started: built one after another, the
    first would wait alone and the barrier break."""
    import threading

    from sessionserve.replicas import native_kernel

    started = threading.Barrier(3)
    builders: list[threading.Thread] = []

    class Fake:
        def __init__(self, name: str) -> None:
            self.source = Path(f"{name}.cpp")

        def load(self) -> bool:
            started.wait(10)
            builders.append(threading.current_thread())
            return True

    monkeypatch.setattr(native_kernel, "KERNELS", [Fake("a"), Fake("b"), Fake("c")])
    threads = native_kernel.prefetch()
    for thread in threads:
        thread.join(20)
    assert len(set(builders)) == 3 and threading.current_thread() not in builders
    assert sorted(t.name for t in threads) == ["kernel-a", "kernel-b", "kernel-c"]


def test_prefetch_builds_only_the_kernels_a_models_dtype_runs(monkeypatch) -> None:
    """A bf16 model never runs the few-row fp32 linear, an fp32 model never the 4-bit
    package's block kernel: a first start does not spend a core on building them."""
    import torch

    from sessionserve.replicas import block_linear, cpu_linear, native_kernel

    built: list[str] = []
    for kernel in native_kernel.KERNELS:
        monkeypatch.setattr(kernel, "load", lambda k=kernel: built.append(k.source.stem))

    def prefetched(dtype: torch.dtype | None) -> set[str]:
        built.clear()
        for thread in native_kernel.prefetch(dtype):
            thread.join(10)
        return set(built)

    every = {k.source.stem for k in native_kernel.KERNELS}  # the five shipped (test above)
    linear, blocks = cpu_linear.KERNEL.source.stem, block_linear.KERNEL.source.stem
    assert prefetched(torch.bfloat16) == every - {linear}
    assert prefetched(torch.float32) == every - {blocks}
    assert prefetched(None) == every


def test_a_load_under_way_fills_the_state_it_read_not_one_swapped_in_meanwhile(
    monkeypatch, tmp_path
) -> None:
    """Tests ask a kernel afresh by swapping in an empty state (with the kernel disabled,
    say) while a replica's `prefetch` may still be loading it: that load must not answer
    them."""
    import logging
    import threading

    from sessionserve.replicas import native_kernel

    monkeypatch.setattr(native_kernel, "KERNELS", [])  # this one is not the process's
    kernel = native_kernel.NativeKernel(
        tmp_path / "k.cpp", "SS_TEST_KERNEL", "a test kernel", lambda: None, logging.getLogger()
    )
    building, finish = threading.Event(), threading.Event()

    def slow_build() -> str:
        building.set()
        assert finish.wait(10)
        return ""  # built and loaded

    monkeypatch.setattr(
        kernel, "_unavailable", lambda: "off" if os.environ.get("SS_TEST_KERNEL") == "0" else ""
    )
    monkeypatch.setattr(kernel, "_build_and_load", slow_build)
    first: list[bool] = []
    prefetching = threading.Thread(target=lambda: first.append(kernel.load()))
    prefetching.start()
    assert building.wait(10)
    monkeypatch.setattr(kernel, "_state", {})
    monkeypatch.setenv("SS_TEST_KERNEL", "0")
    finish.set()
    assert kernel.load() is False and kernel.why_not() == "off"  # asked afresh
    prefetching.join(10)
    assert first == [True]
