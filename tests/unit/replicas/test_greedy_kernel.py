"""The CPU greedy-token kernel (replicas/greedy_kernel.cpp): on an x86 CPU with AVX2 or
AVX-512 and a C++ compiler, each row's greedy token is `argmax(-1)`'s on every case a
shortcut could get wrong (ties, -inf, +inf, NaN, rows not packed together, rows longer than
its parts), built for AVX-512 and for AVX2 alike; what it does not take is torch's, and the op
refuses it with what it needs."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from sessionserve.replicas import greedy_kernel
from sessionserve.replicas.sampling import greedy_tokens
from tests.unit.replicas.test_sampling import argmax_cases


@pytest.fixture(scope="module")
def kernel() -> None:
    if not greedy_kernel.load():
        pytest.skip(f"the greedy kernel cannot be built here: {greedy_kernel.KERNEL.why_not()}")


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_kernel_is_argmax_on_every_case(dtype, threads) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for logits in argmax_cases(dtype):
            assert greedy_kernel.takes(logits)
            assert torch.equal(greedy_kernel.greedy_tokens(logits), logits.argmax(dim=-1))
            assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1))
    finally:
        torch.set_num_threads(before)


@pytest.mark.usefixtures("kernel")
def test_what_the_kernel_does_not_take_is_torchs_and_the_op_says_why() -> None:
    """fp16, one-dimensional, empty and column-strided logits are torch's: `greedy_tokens`
    still gives argmax, and the op refuses them with what it needs."""
    logits = torch.randn(4, 300)
    for other in (logits.half(), logits[:, ::2], logits.T, logits[0], logits[:, :0]):
        assert not greedy_kernel.takes(other)
        if other.numel():
            assert torch.equal(greedy_tokens(other), other.argmax(dim=-1))
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        greedy_kernel.greedy_tokens(logits.half())
    with pytest.raises(RuntimeError, match="contiguous"):
        greedy_kernel.greedy_tokens(logits[:, ::2])
    with pytest.raises(RuntimeError, match="empty vocabulary"):
        greedy_kernel.greedy_tokens(logits[:, :0])
    assert greedy_kernel.greedy_tokens(logits[:0]).shape == (0,)


def test_an_engine_on_a_cpu_loads_the_kernel_and_off_it_stays_torchs() -> None:
    """An engine built on a CPU loads the kernel before its first step; with
    SESSIONSERVE_GREEDY_KERNEL=0 it is never built and greedy answers are the same."""
    script = """
        import torch
        from sessionserve.replicas import greedy_kernel
        from sessionserve.wire import SamplingParams
        from tests.models import tiny_engine, tiny_model

        assert not greedy_kernel.KERNEL.loaded()
        engine = tiny_engine(tiny_model())
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        print("loaded", greedy_kernel.KERNEL.loaded())
        print("tokens", engine.generate([[5, 9, 13, 17]], params)[0].output_ids)
    """
    out = {}
    for setting in ("1", "0"):
        env = {**os.environ, "SESSIONSERVE_GREEDY_KERNEL": setting}
        done = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(script)],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        out[setting] = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    if greedy_kernel.load():
        assert out["1"]["loaded"] == "True"
    assert out["0"]["loaded"] == "False"
    assert out["1"]["tokens"] == out["0"]["tokens"]


AVX2_SCRIPT = """
    import torch
    from sessionserve.replicas import greedy_kernel
    from tests.unit.replicas.test_sampling import argmax_cases

    assert torch.backends.cpu.get_cpu_capability() == "AVX2"
    assert greedy_kernel.load(), greedy_kernel.KERNEL.why_not()
    torch.set_num_threads(2)
    for dtype in (torch.float32, torch.bfloat16):
        for logits in argmax_cases(dtype):
            assert torch.equal(greedy_kernel.greedy_tokens(logits), logits.argmax(dim=-1))
    print("AVX2 OK")
"""


@pytest.mark.usefixtures("kernel")
def test_the_avx2_build_is_argmax_too() -> None:
    """The same cases through the kernel built for AVX2 (torch told its CPU is AVX2: 8-lane
    vectors), in a process of its own."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512", "AMX"):
        pytest.skip("this CPU runs no AVX2 code")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(AVX2_SCRIPT)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0 and "AVX2 OK" in done.stdout, done.stderr[-3000:]
