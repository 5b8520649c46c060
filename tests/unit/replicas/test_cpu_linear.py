"""The few-row fp32 linear (replicas/cpu_linear.py): built and loaded on a machine with AVX-512
or AVX2 and a C++ compiler, it computes `F.linear` from a packed weight for any number of rows
(blocks of registers, the rest in further passes), any K, with and without a bias, on one
thread or several; a transformers model with its linears swapped answers as before; bad input
is a clear error; where it cannot be used, the decode step package keeps inductor's GEMMs and
says why. Its use inside a built package is checked in test_compiled_decode.py."""

from __future__ import annotations

import copy

import pytest
import torch

from sessionserve.replicas import cpu_linear
from sessionserve.replicas.compiled_decode import plan_decode_compile
from sessionserve.replicas.compiled_forward import CompilePlan
from tests.models import tiny_engine, tiny_model


@pytest.fixture(scope="module")
def kernel() -> int:
    if not cpu_linear.load():
        pytest.skip(f"the CPU linear kernel cannot be used here: {cpu_linear.why_not()}")
    return cpu_linear.panel_width()


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("in_features", [1, 7, 64, 130])
def test_it_computes_f_linear_for_any_rows(kernel, threads, bias, in_features) -> None:
    """Every row count from 0 to past the kernel's three regimes (AVX2: up to 6 rows two
    panels at a time, 7-12 one panel at a time, then two at a time in passes of 6; AVX-512:
    12, 24), an odd number of panels (a pair and one left over), and panels split between
    threads: within fp32 rounding of `F.linear` (sums in another order)."""
    g = torch.Generator().manual_seed(in_features)
    out_features = 3 * kernel
    lin = torch.nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(out_features, in_features, generator=g))
        if bias:
            lin.bias.copy_(torch.randn(out_features, generator=g))
    packed = cpu_linear.pack(lin.weight)
    assert packed.shape == (3, in_features, kernel)
    for rows in range(0, 27):
        x = torch.randn(rows, in_features, generator=g)
        got = cpu_linear.linear(x, packed, lin.bias)
        want = torch.nn.functional.linear(x, lin.weight, lin.bias)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * in_features**0.5)


def test_a_packed_linear_takes_any_leading_dimensions(kernel) -> None:
    lin = torch.nn.Linear(24, 2 * kernel)
    x = torch.randn(2, 3, 24)
    packed = cpu_linear.PackedLinear(lin.weight, lin.bias)
    torch.testing.assert_close(packed(x), lin(x), rtol=1e-5, atol=1e-5)
    strided = torch.randn(24, 5).t()  # rows not contiguous
    torch.testing.assert_close(packed(strided), lin(strided), rtol=1e-5, atol=1e-5)


def test_a_model_with_its_linears_swapped_answers_as_before(kernel) -> None:
    """The decode step package's copy of the model: every linear whose outputs fill whole
    panels becomes a `PackedLinear` (the LM head too, where the vocabulary does), the rest stay
    `nn.Linear`; the logits match the original's within fp32 rounding."""
    model = tiny_model("llama", seed=3)
    assert cpu_linear.usable_for(model)
    assert not cpu_linear.usable_for(copy.deepcopy(model).bfloat16())  # fp32 only
    swapped = copy.deepcopy(model)
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    fits = [m for m in linears if m.out_features % kernel == 0]
    assert cpu_linear.swap_linears(swapped) == len(fits) > 0
    left = [m for m in swapped.modules() if type(m) is torch.nn.Linear]
    assert len(left) == len(linears) - len(fits)
    assert all(m.out_features % kernel for m in left)
    ids = torch.randint(0, model.config.vocab_size, (1, 21))
    with torch.no_grad():
        torch.testing.assert_close(swapped(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-4)


def test_what_it_does_not_take_is_a_clear_error(kernel) -> None:
    lin = torch.nn.Linear(16, kernel)
    packed = cpu_linear.pack(lin.weight)
    x = torch.randn(4, 16)
    with pytest.raises(RuntimeError, match="fp32 only"):
        cpu_linear.linear(x.bfloat16(), packed)
    with pytest.raises(RuntimeError, match="packed for this CPU's panels"):
        cpu_linear.linear(x, lin.weight.detach())
    with pytest.raises(RuntimeError, match="x has 8 features, the weight 16"):
        cpu_linear.linear(torch.randn(4, 8), packed)
    with pytest.raises(RuntimeError, match="the bias must be empty or"):
        cpu_linear.linear(x, packed, torch.zeros(kernel + 1))
    with pytest.raises(ValueError, match="do not fill fp32 panels"):
        cpu_linear.pack(torch.randn(kernel + 1, 16))
    assert not cpu_linear.supports(torch.nn.Linear(16, kernel + 1))
    assert not cpu_linear.supports(torch.nn.Linear(16, kernel).bfloat16())
    assert cpu_linear.supports(torch.nn.Linear(16, kernel))


def test_without_the_kernel_the_step_keeps_inductors_gemms(monkeypatch, caplog, tmp_path):
    """Disabled (or unbuildable), `load()` says why once and the decode step package is
    planned without it; the plan's key differs, so packages do not mix."""
    monkeypatch.setattr(cpu_linear.KERNEL, "_state", {})
    monkeypatch.setenv(cpu_linear.DISABLE_ENV, "0")
    model = tiny_model("llama")
    pool = tiny_engine(model).runner.kv_pool
    forward = CompilePlan(True, "test", tmp_path / "forward.pt2", 32)
    with caplog.at_level("WARNING", logger=cpu_linear.__name__):
        assert not cpu_linear.usable_for(model)
    assert f"{cpu_linear.DISABLE_ENV}=0" in cpu_linear.why_not()
    assert "linear kernel not used" in caplog.text
    plan, step = plan_decode_compile(True, forward, model, pool)
    assert step is not None and not step.linear_kernel
    assert "linear_kernel" not in step.key_facts()  # packages built before stay valid
    with_kernel, step_k = plan_decode_compile(True, forward, model, pool, linear_kernel=True)
    assert step_k is not None and step_k.linear_kernel
    assert with_kernel.package != plan.package
    assert with_kernel.loads_as.keywords["linear_kernel"] is True
    with pytest.raises(RuntimeError, match="not available"):
        cpu_linear.linear(torch.randn(2, 16), torch.zeros(1, 16, 16))
