"""The CPU sampling kernel (replicas/sampling_kernel.cpp): on an x86 CPU with AVX2 or AVX-512
and a C++ compiler, each row's greedy token is `argmax(-1)`'s on every case a shortcut could
get wrong (ties, -inf, +inf, NaN, rows not packed together, rows longer than its parts), and
each row's inverse-CDF draw is the float64 cumsum-and-searchsorted pick, built for AVX-512
and for AVX2 alike; what it does not take is torch's, and the ops refuse it with what they
need; an engine on a CPU loads it."""

from __future__ import annotations

import pytest
import torch

from sessionserve.replicas import sampling_kernel
from sessionserve.replicas.sampling import draw, greedy_tokens
from tests.child_python import run_child
from tests.unit.replicas.test_sampling import argmax_cases


@pytest.fixture(scope="module")
def kernel() -> None:
    if not sampling_kernel.load():
        pytest.skip(f"the sampling kernel cannot be built here: {sampling_kernel.KERNEL.why_not()}")


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_kernel_is_argmax_on_every_case(dtype, threads) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for logits in argmax_cases(dtype):
            assert sampling_kernel.takes_greedy(logits)
            assert torch.equal(sampling_kernel.greedy_tokens(logits), logits.argmax(dim=-1))
            assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1))
    finally:
        torch.set_num_threads(before)


@pytest.mark.usefixtures("kernel")
def test_what_the_kernel_does_not_take_is_torchs_and_the_op_says_why() -> None:
    """fp16, one-dimensional, empty and column-strided logits are torch's: `greedy_tokens`
    still gives argmax, and the op refuses them with what it needs."""
    logits = torch.randn(4, 300)
    for other in (logits.half(), logits[:, ::2], logits.T, logits[0], logits[:, :0]):
        assert not sampling_kernel.takes_greedy(other)
        if other.numel():
            assert torch.equal(greedy_tokens(other), other.argmax(dim=-1))
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        sampling_kernel.greedy_tokens(logits.half())
    with pytest.raises(RuntimeError, match="contiguous"):
        sampling_kernel.greedy_tokens(logits[:, ::2])
    with pytest.raises(RuntimeError, match="empty vocabulary"):
        sampling_kernel.greedy_tokens(logits[:, :0])
    assert sampling_kernel.greedy_tokens(logits[:0]).shape == (0,)


def torch_draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """`sampling.draw`'s pick as torch computes it: the float64 CDF, then searchsorted."""
    cdf = probs.double().cumsum(-1)
    target = u.reshape(-1, 1) * cdf[:, -1:]
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_max(probs.shape[-1] - 1)


def draw_cases() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Probabilities and uniforms: normalised and not, with zero runs (a filtered row), one
    token, rows not packed together, and the uniforms' ends (0, and just under 1)."""
    gen = torch.Generator().manual_seed(1)
    cases = []
    for rows, vocab in [(1, 1), (1, 7), (3, 1000), (8, 49152), (2, 262144)]:
        probs = (torch.randn(rows, vocab, generator=gen) * 3).softmax(-1)
        probs[0, ::5] = 0.0
        for s in range(6):
            u = torch.rand(rows, dtype=torch.float64, generator=gen)
            u[0] = 0.0 if s == 0 else u[0]
            u[-1] = 1.0 - 2.0**-53 if s == 1 else u[-1]
            cases.append((probs, u))
        cases.append((probs * 7.5, u))  # unnormalised
        wide = torch.rand(rows, vocab + 5, generator=gen)
        cases.append((wide[:, 5:], u))
    return cases


@pytest.mark.usefixtures("kernel")
def test_the_draw_is_torchs_float64_cdf_pick_on_every_case() -> None:
    for probs, u in draw_cases():
        assert sampling_kernel.takes_draw(probs)
        want = torch_draw(probs, u)
        assert torch.equal(sampling_kernel.inverse_cdf(probs, u), want)
        assert torch.equal(draw(probs, u[:, None]), want)
        live = probs.sum(-1) > 0  # (a row of one token, zeroed, has nothing to draw)
        assert bool((probs.gather(1, want[:, None])[live] > 0).all())  # no zero-probability pick


@pytest.mark.usefixtures("kernel")
def test_what_the_draw_does_not_take_is_torchs_and_the_op_says_why() -> None:
    probs, u = torch.rand(3, 50).softmax(-1), torch.rand(3, dtype=torch.float64)
    for other in (probs.double(), probs[:, ::2], probs.t().contiguous().t()):
        assert not sampling_kernel.takes_draw(other)
        assert torch.equal(draw(other, u[:, None]), torch_draw(other, u))
    with pytest.raises(RuntimeError, match="fp32 probabilities"):
        sampling_kernel.inverse_cdf(probs.double(), u)
    with pytest.raises(RuntimeError, match="one float64 uniform a row"):
        sampling_kernel.inverse_cdf(probs, u.float())
    with pytest.raises(RuntimeError, match="one float64 uniform a row"):
        sampling_kernel.inverse_cdf(probs, u[:2])
    with pytest.raises(RuntimeError, match="contiguous"):
        sampling_kernel.inverse_cdf(probs[:, ::2], u)


def test_an_engine_on_a_cpu_loads_the_kernel_and_off_it_stays_torchs() -> None:
    """An engine built on a CPU loads the kernel before its first step; with
    SESSIONSERVE_SAMPLING_KERNEL=0 it is never built and greedy answers are the same."""
    script = """
        import torch
        from sessionserve.replicas import sampling_kernel
        from sessionserve.wire import SamplingParams
        from tests.models import tiny_engine, tiny_model

        assert not sampling_kernel.KERNEL.loaded()
        engine = tiny_engine(tiny_model())
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        print("loaded", sampling_kernel.KERNEL.loaded())
        print("tokens", engine.generate([[5, 9, 13, 17]], params)[0].output_ids)
    """
    out = {}
    for setting in ("1", "0"):
        stdout = run_child(script, SESSIONSERVE_SAMPLING_KERNEL=setting)
        out[setting] = dict(line.split(" ", 1) for line in stdout.splitlines())
    if sampling_kernel.load():
        assert out["1"]["loaded"] == "True"
    assert out["0"]["loaded"] == "False"
    assert out["1"]["tokens"] == out["0"]["tokens"]


AVX2_SCRIPT = """
    import torch
    from sessionserve.replicas import sampling_kernel
    from tests.unit.replicas.test_sampling import argmax_cases
    from tests.unit.replicas.test_sampling_kernel import draw_cases, torch_draw

    assert torch.backends.cpu.get_cpu_capability() == "AVX2"
    assert sampling_kernel.load(), sampling_kernel.KERNEL.why_not()
    torch.set_num_threads(2)
    for dtype in (torch.float32, torch.bfloat16):
        for logits in argmax_cases(dtype):
            assert torch.equal(sampling_kernel.greedy_tokens(logits), logits.argmax(dim=-1))
    for probs, u in draw_cases():
        assert torch.equal(sampling_kernel.inverse_cdf(probs, u), torch_draw(probs, u))
    print("AVX2 OK")
"""


@pytest.mark.usefixtures("kernel")
def test_the_avx2_build_picks_and_draws_the_same() -> None:
    """The same cases through the kernel built for AVX2 (torch told its CPU is AVX2: 8-lane
    vectors), in a process of its own."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512", "AMX"):
        pytest.skip("this CPU runs no AVX2 code")
    run_child(AVX2_SCRIPT, "AVX2 OK", ATEN_CPU_CAPABILITY="avx2")
