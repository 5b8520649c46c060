"""Logits GEMMs on oneDNN (replicas/logits_head.py): the same products as `F.linear`, used by
the engine's forward on CPU, and the usual path wherever oneDNN does not apply."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sessionserve.replicas import logits_head
from sessionserve.replicas.logits_head import head_logits, uses_onednn, vocab_linear
from sessionserve.wire import SamplingParams
from tests.models import hf_greedy, tiny_engine, tiny_model

needs_onednn = pytest.mark.skipif(
    not logits_head._onednn_present(), reason="this torch build has no oneDNN"
)


@needs_onednn
@pytest.mark.parametrize("rows", [0, 1, 3, 8, 33])
def test_the_same_product_as_f_linear(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 48, generator=g)
    w = torch.randn(1000, 48, generator=g)
    b = torch.randn(1000, generator=g)
    assert uses_onednn(x, w)
    for bias in (None, b):
        got = vocab_linear(x, w, bias)
        assert got.shape == (rows, 1000)
        torch.testing.assert_close(got, F.linear(x, w, bias), rtol=1e-5, atol=1e-4)


@needs_onednn
def test_leading_dimensions_and_strided_rows() -> None:
    x = torch.randn(2, 5, 32)
    w = torch.randn(300, 32)
    torch.testing.assert_close(vocab_linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)
    every_other = torch.randn(10, 32)[::2]  # not contiguous
    torch.testing.assert_close(
        vocab_linear(every_other, w), F.linear(every_other, w), rtol=1e-5, atol=1e-4
    )


def test_where_onednn_does_not_apply_the_usual_path_runs() -> None:
    w = torch.randn(50, 16, requires_grad=True)
    x = torch.randn(3, 16)
    assert not uses_onednn(x, w)  # autograd: training a drafter needs the gradient
    vocab_linear(x, w).sum().backward()
    assert w.grad is not None and w.grad.abs().sum() > 0
    with torch.no_grad():
        assert uses_onednn(x, w) == logits_head._onednn_present()
    assert not uses_onednn(x.bfloat16(), w.detach().bfloat16())  # measured for fp32 only

    class Scaled(nn.Module):  # not a plain linear layer: called as it is
        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return h * 2

    h = torch.randn(2, 4)
    torch.testing.assert_close(head_logits(Scaled(), h), h * 2)


@needs_onednn
def test_the_engine_computes_its_logits_there(monkeypatch) -> None:
    """Greedy tokens equal transformers' own generate while the engine's logits GEMMs go
    through oneDNN (counted)."""
    calls = []
    real = logits_head._onednn_product

    def counting(rows, weight, bias):
        calls.append(rows.shape[0])
        return real(rows, weight, bias)

    monkeypatch.setattr(logits_head, "_onednn_product", counting)
    model = tiny_model()
    engine = tiny_engine(model)
    prompt = [3, 17, 42, 7, 99, 5]
    (out,) = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0))
    assert out.output_ids == hf_greedy(model, prompt, 12)
    assert len(calls) >= 12  # one logits GEMM per step
