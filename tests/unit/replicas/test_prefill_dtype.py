"""What the prefill package's layers compute in (`engine.compile_prefill_dtype`,
`prefill_choice.compute_dtype`): the modes, auto's verdict timed once per CPU and kept (the
timing faked: tests do not time things), and the package key that follows the choice."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from sessionserve.replicas import compiled_forward, prefill_choice
from tests.models import tiny_model


@pytest.fixture
def bf16_model():
    return tiny_model().to(torch.bfloat16)


def faked_timing(monkeypatch, model_ms: float, float32_ms: float) -> list[int]:
    """`time_gemms` returning these timings; the list counts its calls."""
    calls: list[int] = []

    def timed(model, rows):
        calls.append(rows)
        return prefill_choice.GemmTiming(
            prefill_choice._cpu(), "bfloat16", rows, model_ms, float32_ms
        )

    monkeypatch.setattr(prefill_choice, "time_gemms", timed)
    return calls


def test_the_modes_resolve_for_the_models_dtype(bf16_model, tmp_path, monkeypatch) -> None:
    calls = faked_timing(monkeypatch, 20.0, 10.0)
    record = tmp_path / "k.gemm.json"
    resolve = prefill_choice.compute_dtype
    assert resolve("float32", bf16_model, 256, record, False) == torch.float32
    assert resolve("float32", tiny_model().half(), 256, record, False) == torch.float32
    assert resolve("model", bf16_model, 256, record, True) is None
    fp32 = tiny_model()
    assert resolve("float32", fp32, 256, record, True) is None  # fp32 already
    assert resolve("auto", fp32, 256, record, True) is None
    # auto does not time models `compile: auto` would not compile (the tests' tiny ones)
    assert resolve("auto", bf16_model, 256, record, False) is None
    assert calls == [] and not record.exists()


def test_auto_times_once_per_cpu_and_keeps_the_verdict(
    bf16_model, tmp_path, monkeypatch, caplog
) -> None:
    """fp32 where the model's dtype was GEMM_MARGIN slower; the verdict is read back by the
    next start (not timed again) unless it was timed on another CPU or for other rows."""
    record = tmp_path / "k.gemm.json"
    calls = faked_timing(monkeypatch, 16.0, 10.0)  # 1.6x
    with caplog.at_level(logging.INFO, logger=prefill_choice.__name__):
        assert prefill_choice.compute_dtype("auto", bf16_model, 256, record, True) == torch.float32
    assert calls == [256] and json.loads(record.read_text())["float32_ms"] == 10.0
    assert any("computes in float32" in r.getMessage() for r in caplog.records)
    calls = faked_timing(monkeypatch, 10.0, 10.0)
    assert prefill_choice.compute_dtype("auto", bf16_model, 256, record, True) == torch.float32
    assert calls == []  # recorded
    assert prefill_choice.compute_dtype("auto", bf16_model, 128, record, True) is None
    assert calls == [128]  # other rows: timed again, and a tie keeps the model's dtype
    kept = json.loads(record.read_text())
    record.write_text(json.dumps(kept | {"cpu": "another CPU", "rows": 256}))
    calls = faked_timing(monkeypatch, 11.0, 10.0)  # 1.1x: short of GEMM_MARGIN
    assert prefill_choice.compute_dtype("auto", bf16_model, 256, record, True) is None
    assert calls == [256]
    record.write_text("not json")
    assert prefill_choice.compute_dtype("auto", bf16_model, 256, record, True) is None
    assert calls == [256, 256]


def test_the_gemm_timing_times_the_decoders_linears(bf16_model) -> None:
    """What `time_gemms` reports: the model's dtype, the rows, this CPU, two timings (their
    values are not asserted: tests do not time things)."""
    timing = prefill_choice.time_gemms(bf16_model, 8)
    assert (timing.dtype, timing.rows, timing.cpu) == ("bfloat16", 8, prefill_choice._cpu())
    assert timing.model_ms > 0 and timing.float32_ms > 0


def test_the_prefill_plan_keys_its_package_by_what_its_layers_compute_in(
    bf16_model, tmp_path
) -> None:
    forward = compiled_forward.plan_compile(True, bf16_model, 32, str(tmp_path))
    model_dtype = compiled_forward.plan_prefill_compile(True, forward, bf16_model, 576, 8)
    fp32 = compiled_forward.plan_prefill_compile(True, forward, bf16_model, 576, 8, "float32")
    assert (model_dtype.compute_dtype, fp32.compute_dtype) == (None, torch.float32)
    assert fp32.package != model_dtype.package and fp32.package.parent == tmp_path
    again = compiled_forward.plan_prefill_compile(True, forward, bf16_model, 576, 8, "model")
    assert again.package == model_dtype.package  # packages built before keep their key


def test_a_build_process_is_told_what_the_layers_compute_in(
    bf16_model, tmp_path, monkeypatch
) -> None:
    """`build_in_subprocess` hands the plan's compute dtype and the GGUF whose LM head it
    reads to the child's `build_package` (the child run in this process from the argv the
    parent would start it with)."""
    forward = compiled_forward.plan_compile(True, bf16_model, 32, str(tmp_path))
    gguf = tmp_path / "model.gguf"
    plan = compiled_forward.plan_prefill_compile(
        True, forward, bf16_model, 576, 8, "float32", head_gguf=gguf
    )
    built = []

    def child(command, check):
        argv = command[command.index(compiled_forward.__name__) + 1 :]
        compiled_forward._child_main(*argv)
        return type("Done", (), {"returncode": 0})()

    def build(model, path, max_tokens, layers, **kw):
        built.append((path, max_tokens, next(model.parameters()).dtype, kw))

    monkeypatch.setattr(compiled_forward.subprocess, "run", child)
    monkeypatch.setattr(compiled_forward, "build_package", build)
    compiled_forward.build_in_subprocess(bf16_model, plan)
    ((path, max_tokens, dtype, kw),) = built
    assert (path, max_tokens, dtype) == (plan.package, 576, torch.bfloat16)
    assert kw == {
        "example_tokens": 256,
        "autotune": False,
        "compute_dtype": torch.float32,
        "head_gguf": gguf,
    }
