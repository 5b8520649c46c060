"""The GGUF's own quantized weights (gguf_int4.py, `engine.gguf_int4_decode`): ggml's blocks
unpack to the file's weights exactly; a GGUF written here with gguf's own writer and quantizer
(Q4_1 and Q4_0 linears, Llama's q/k rows permuted as llama.cpp's converter does, a Q8_0 LM
head) is read back onto a transformers model by name, each weight checked against the dense
one (a weight that differs stays dense); the plan says when the 4-bit package applies; and an
engine whose runner runs the 4-bit `DecodeStep` eagerly takes the steps of up to `MAX_TOKENS`
tokens through it and answers as the plain engine and transformers, with the strict memory
check after every step. Then one real AOTInductor build (a tiny bf16 Llama): the package's
greedy tokens and logprobs match the eager 4-bit step's, tie-aware. The block kernel's own
arithmetic is tested in test_block_linear.py; where it cannot run, so is everything here that
runs it."""

from __future__ import annotations

import copy
import logging

import gguf
import numpy as np
import pytest
import torch

from sessionserve.replicas import block_linear, compiled_forward, gguf_int4
from sessionserve.replicas.attention import install
from sessionserve.replicas.block_linear import BlockLinear
from sessionserve.replicas.compiled_decode import DecodeStep, plan_int4_decode_compile
from sessionserve.replicas.compiled_forward import CompilePlan
from sessionserve.wire import SamplingParams
from tests.models import hf_greedy, tiny_engine, tiny_model
from tests.unit.replicas.test_compiled_decode import (
    CHUNKS,
    EagerDecode,
    inputs_for,
    recorded_shapes,
)
from tests.unit.replicas.test_loader_and_backends import assert_tie_aware_equal

KINDS = {
    "Q4_1": gguf.GGMLQuantizationType.Q4_1,
    "Q4_0": gguf.GGMLQuantizationType.Q4_0,
    "Q8_0": gguf.GGMLQuantizationType.Q8_0,
    "Q5_0": gguf.GGMLQuantizationType.Q5_0,
    "Q5_1": gguf.GGMLQuantizationType.Q5_1,
}
needs_kernel = pytest.mark.skipif(
    not block_linear.load(), reason=f"the block kernel cannot run here: {block_linear.why_not()}"
)


def quantized(weight: np.ndarray, kind: str) -> np.ndarray:
    """`weight` [N, K] fp32 as ggml's blocks [N, K / 32 * block bytes] (gguf's quantizer)."""
    return gguf.quants.quantize(weight.astype(np.float32), KINDS[kind])


@pytest.mark.parametrize("kind", ["Q4_1", "Q4_0", "Q8_0", "Q5_0", "Q5_1"])
def test_blocks_unpack_to_ggmls_own_dequantization(kind) -> None:
    weight = np.random.default_rng(1).normal(0, 0.05, (48, 96)).astype(np.float32)
    raw = quantized(weight, kind)
    u, d, m = gguf_int4.unpack_blocks(raw, kind)
    top = {"Q8_0": 255, "Q5_0": 31, "Q5_1": 31}.get(kind, 15)
    assert u.shape == (48, 96) and u.min() >= 0 and u.max() <= top
    want = torch.from_numpy(gguf.quants.dequantize(raw, KINDS[kind]))
    assert torch.equal(gguf_int4.dequantized(u, d, m), want)


def random_q4_k(n: int, supers: int) -> np.ndarray:
    """Q4_K rows [n, supers * 144]: gguf's writer cannot quantize K-quants, so random
    super-blocks (fp16 d and dmin of a weight's size, any scale, min and nibble bytes)."""
    rng = np.random.default_rng(6)
    raw = rng.integers(0, 256, (n, supers, 144), dtype=np.uint8)
    for offset in (0, 2):  # d, dmin
        half = rng.uniform(1e-4, 2e-3, (n, supers)).astype(np.float16)
        raw[..., offset : offset + 2] = half.view(np.uint8).reshape(n, supers, 2)
    return raw.reshape(n, -1)


def test_q4_k_super_blocks_unpack_to_ggmls_own_dequantization() -> None:
    """Each sub-block of 32 as u in 0..15 with its own scale and offset, equal to ggml's
    dequantization exactly (in fp32): read as stored, not re-blocked."""
    raw = random_q4_k(6, 3)
    u, d, m = gguf_int4.unpack_blocks(raw, "Q4_K")
    assert u.shape == (6, 768) and d.shape == m.shape == (6, 24)
    assert u.min() >= 0 and u.max() <= 15 and gguf_int4.BITS["Q4_K"] == 4
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_K)
    assert np.array_equal(gguf_int4.dequantized(u, d, m).numpy(), want)
    assert not gguf_int4.reblocks("Q4_K") and gguf_int4.reblocks("Q6_K")


@needs_kernel
def test_the_block_linear_computes_with_q4_ks_weights() -> None:
    """The records round each sub-block's scale and offset to fp16 (2^-11 of each)."""
    u, d, m = gguf_int4.unpack_blocks(random_q4_k(32, 2), "Q4_K")
    exact = gguf_int4.dequantized(u, d, m)
    x = torch.randn(4, exact.shape[1])
    got = BlockLinear(block_linear.pack(u, d, m, 4), None, torch.float32)(x)
    want = torch.nn.functional.linear(x, exact)
    torch.testing.assert_close(got, want, atol=2e-3 * want.abs().max().item(), rtol=2e-3)


def test_eight_bit_blocks_hold_each_weight_within_half_a_step() -> None:
    """A K-quant's dense weight re-blocked: each weight within d / 2 of its block's, d the
    block's range / 255 (up to fp16's rounding of d and m, taken outward); a block of one value
    exactly; u within the records' 8 bits."""
    rng = np.random.default_rng(4)
    weight = torch.from_numpy(rng.normal(0, 0.05, (32, 128)).astype(np.float32)).bfloat16()
    weight[3, 32:64] = 0.0123  # a block of one value
    weight[5, :32] = torch.linspace(-0.2, 0.1, 32)  # a wide one
    u, d, m = gguf_int4.eight_bit_blocks(weight)
    assert u.shape == (32, 128) and u.min() >= 0 and u.max() <= 255
    assert np.array_equal(d, d.astype(np.float16)) and np.array_equal(m, m.astype(np.float16))
    back = gguf_int4.dequantized(u, d, m).reshape(32, 4, 32)
    dense = weight.float().reshape(32, 4, 32)
    worst = (back - dense).abs().amax(-1).numpy()
    assert (worst <= d / 2 * (1 + 1e-3) + 1e-12).all()
    assert torch.equal(back[3, 1], dense[3, 1])
    lo, hi = dense.amin(-1).numpy(), dense.amax(-1).numpy()
    assert (d >= (hi - lo) / 255).all() and (d <= (hi - lo) / 255 * (1 + 2**-9) + 1e-12).all()


@needs_kernel
@pytest.mark.parametrize("kind", ["Q4_1", "Q4_0", "Q8_0", "Q5_0"])
def test_the_block_linear_computes_with_the_files_weights(kind) -> None:
    """Within the kernel's rounding of the rows (int8 pairs, ~bf16's) in fp32 and bf16. Any
    leading dims, a bias."""
    rng = np.random.default_rng(2)
    raw = quantized(rng.normal(0, 0.05, (32, 64)).astype(np.float32), kind)
    u, d, m = gguf_int4.unpack_blocks(raw, kind)
    exact = gguf_int4.dequantized(u, d, m)
    bias = torch.randn(32)
    x = torch.randn(2, 3, 64)
    want = torch.nn.functional.linear(x, exact, bias)
    weight = block_linear.pack(u, d, m, gguf_int4.BITS[kind])
    fp32 = BlockLinear(weight, bias, torch.float32)
    torch.testing.assert_close(fp32(x), want, atol=2e-3, rtol=2e-3)
    got = BlockLinear(weight, bias, torch.bfloat16)(x.bfloat16())
    assert got.dtype == torch.bfloat16 and got.shape == (2, 3, 32)
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)


@needs_kernel
def test_a_dense_weight_as_eight_bit_records_or_none_where_they_cannot_hold_it() -> None:
    """`eight_bit_weight` (an EAGLE head's linears): the records compute with the re-blocked
    weights; a shape that does not fill whole records, or a block whose least weight is past
    fp16's range, gives None (the linear stays dense)."""
    rng = np.random.default_rng(6)
    weight = torch.from_numpy(rng.normal(0, 0.05, (32, 64)).astype(np.float32)).bfloat16()
    bias = torch.randn(32).bfloat16()
    records = gguf_int4.eight_bit_weight(weight)
    assert records is not None and records.bits == 8
    linear = BlockLinear(records, bias, torch.bfloat16)
    x = torch.randn(3, 64).bfloat16()
    rounded = gguf_int4.dequantized(*gguf_int4.eight_bit_blocks(weight))
    want = torch.nn.functional.linear(x.float(), rounded, bias.float())
    torch.testing.assert_close(linear(x).float(), want, atol=3e-2, rtol=3e-2)
    assert gguf_int4.eight_bit_weight(weight[:24]) is None  # 24 outputs: not whole
    assert gguf_int4.eight_bit_weight(weight[:, :48]) is None  # 48 inputs: likewise
    wide = weight.float().clone()
    wide[0, :32] = -1e6  # a block's least weight past fp16's 65504
    assert gguf_int4.eight_bit_weight(wide) is None


def permuted(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order (transformers' GGUF loader reverses it)."""
    n = weight.shape[0]
    return weight.reshape(heads, 2, n // heads // 2, -1).swapaxes(1, 2).reshape(weight.shape)


def write_gguf(
    path, model, kind: str = "Q4_1", dense: tuple[str, ...] = (), head: str | None = "Q8_0"
) -> None:
    """`model`'s decoder linears into a GGUF at `path` as llama.cpp writes a Llama (rows of
    q/k permuted), quantized to `kind` ("F32": none) except the GGUF names in `dense` (F32),
    and its LM head as `output.weight` in `head` (None: not written); the model's weights
    become the file's dequantized ones, as loading the file gives them."""
    writer = gguf.GGUFWriter(str(path), "llama")
    cfg = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    linears = [(f"model.{n}", m) for n, m in model.get_decoder().named_modules()]
    for name, linear in [*linears, ("lm_head", model.lm_head)]:
        if not isinstance(linear, torch.nn.Linear) or (name == "lm_head" and head is None):
            continue
        gguf_name = names.get_name(name) + ".weight"
        as_kind = head if name == "lm_head" else kind
        heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}
        heads = heads.get(name.rsplit(".", 1)[-1])
        weight = linear.weight.detach().float().numpy()
        stored = permuted(weight, heads) if heads else weight
        if gguf_name in dense or as_kind == "F32":
            writer.add_tensor(gguf_name, stored)
            continue
        raw = quantized(stored, as_kind)
        writer.add_tensor(gguf_name, raw, raw_dtype=KINDS[as_kind])
        back = gguf.quants.dequantize(raw, KINDS[as_kind])
        if heads:  # transformers' reverse permutation
            n = back.shape[0]
            back = back.reshape(heads, n // heads // 2, 2, -1).swapaxes(2, 1).reshape(back.shape)
        with torch.no_grad():
            linear.weight.copy_(torch.from_numpy(back))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def linear_names(model) -> set[str]:
    return {n for n, m in model.get_decoder().named_modules() if isinstance(m, torch.nn.Linear)}


@needs_kernel
@pytest.mark.parametrize("kind", ["Q4_1", "Q4_0"])
def test_a_written_gguf_is_read_back_onto_the_model(tmp_path, kind, caplog) -> None:
    model = tiny_model("llama", seed=3)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, model, kind, dense=("blk.1.ffn_up.weight",))
    with torch.no_grad():  # a weight that is not the file's: must stay dense
        model.get_decoder().layers[0].mlp.down_proj.weight[0, 0] += 1.0
    decoder = model.get_decoder()
    with caplog.at_level(logging.WARNING, logger="sessionserve.replicas.gguf_int4"):
        taken = gguf_int4.read_block_linears(
            path, decoder, "model", model.config, lm_head=model.lm_head
        )
    kept = linear_names(model) - {"layers.1.mlp.up_proj", "layers.0.mlp.down_proj"}
    assert set(taken) == kept | {"lm_head"}
    assert taken["lm_head"].bits == 8 and taken["layers.0.mlp.up_proj"].bits == 4
    assert "does not match the loaded weight of layers.0.mlp.down_proj" in caplog.text
    for name, weight in taken.items():  # q/k rows in transformers' order
        linear = model.get_submodule(name if name == "lm_head" else f"model.{name}")
        x = torch.randn(5, linear.in_features)
        got = BlockLinear(weight, linear.bias, torch.float32)(x)
        torch.testing.assert_close(got, linear(x), atol=2e-3, rtol=2e-3)
    record = tmp_path / "tiny.blocks.json"
    summary = gguf_int4.block_summary(path, record)
    assert summary.tensors == len(linear_names(model))  # the Q8_0 head, not the F32 up_proj
    up = model.get_decoder().layers[1].mlp.up_proj.weight.numel()
    every = sum(model.get_submodule(f"model.{n}").weight.numel() for n in linear_names(model))
    assert summary.decoder_share == pytest.approx(1 - up / every) and summary.decoder_blocks
    # kept: read back from the record without opening the file again
    path.unlink()
    assert gguf_int4.block_summary(path, record) == summary


@needs_kernel
def test_q5_is_read_as_stored_and_other_quantized_kinds_are_reblocked(
    tmp_path, monkeypatch, caplog
) -> None:
    """Gemma 3's Q4_K_M stores its decoder as Q5_0 and K-quants. Q5_0 is read as stored, in
    8-bit records, exactly the loaded weight; a quantized kind the kernel does not read (here
    Q5_1, taken out of the kinds it reads, as gguf's writer cannot make K-quants) is re-blocked
    from the loaded weight; an unquantized tensor (F32) stays dense either way."""
    model = tiny_model("llama", seed=5)
    path = tmp_path / "q5.gguf"
    write_gguf(path, model, "Q5_0", dense=("blk.0.ffn_up.weight",))
    decoder = model.get_decoder()
    taken = gguf_int4.read_block_linears(path, decoder, "model", model.config, model.lm_head)
    assert set(taken) == linear_names(model) - {"layers.0.mlp.up_proj"} | {"lm_head"}
    for name, weight in taken.items():
        linear = model.get_submodule(name if name == "lm_head" else f"model.{name}")
        assert weight.bits == 8
        x = torch.randn(3, linear.in_features)
        got = BlockLinear(weight, linear.bias, torch.float32)(x)
        torch.testing.assert_close(got, linear(x), atol=2e-3, rtol=2e-3)

    other = tmp_path / "q5_1.gguf"
    write_gguf(other, model, "Q5_1", dense=("blk.0.ffn_up.weight",), head="Q8_0")
    monkeypatch.delitem(gguf_int4.BLOCK_BYTES, "Q5_1")
    assert gguf_int4.reblocks("Q5_1") and not gguf_int4.reblocks("F32")
    with caplog.at_level(logging.INFO, logger="sessionserve.replicas.gguf_int4"):
        taken = gguf_int4.read_block_linears(other, decoder, "model", model.config, model.lm_head)
    decoder_linears = linear_names(model) - {"layers.0.mlp.up_proj"}
    assert set(taken) == decoder_linears | {"lm_head"}
    assert (
        f"re-blocked as 8-bit from the loaded weights: {len(decoder_linears)} Q5_1" in caplog.text
    )
    for name in decoder_linears:
        linear = model.get_submodule(f"model.{name}")
        want = gguf_int4.dequantized(*gguf_int4.eight_bit_blocks(linear.weight))
        x = torch.randn(3, linear.in_features)
        got = BlockLinear(taken[name], linear.bias, torch.float32)(x)
        want = torch.nn.functional.linear(x, want, linear.bias)
        torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)  # the rows' int8 pairs
        # within the blocks' half steps of the file's weight
        torch.testing.assert_close(got, linear(x), atol=2e-2, rtol=1e-2)
    summary = gguf_int4.block_summary(other, tmp_path / "q5_1.blocks.json")
    up = decoder.layers[0].mlp.up_proj.weight.numel()
    every = sum(decoder.get_submodule(n).weight.numel() for n in linear_names(model))
    assert summary.decoder_share == pytest.approx(1 - up / every) and summary.decoder_blocks
    # a record of another format is read again
    record = tmp_path / "old.blocks.json"
    record.write_text('{"tensors": 1, "decoder_share": 0.01}')
    assert gguf_int4.block_summary(other, record) == summary


@needs_kernel
def test_the_plan_says_when_the_4bit_package_applies(tmp_path, caplog, monkeypatch) -> None:
    model = tiny_model("llama", seed=3).to(torch.bfloat16)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, model)
    engine = tiny_engine(model)
    forward = CompilePlan(True, "test", tmp_path / "forward.pt2", 32, weights="w")
    decode = CompilePlan(True, "test", tmp_path / "decode.pt2", 32)
    dense = DecodeStep(model, CHUNKS)
    plan, step = plan_int4_decode_compile(True, forward, decode, dense, model, str(path))
    assert plan.enabled and step is not None and step.int4_source == (path, "model")
    assert plan.max_tokens == gguf_int4.MAX_TOKENS and plan.package.parent == tmp_path
    assert step.key_facts()["gguf_int4"][0] == gguf_int4.INT4_FORMAT
    assert "gguf_int4" not in dense.key_facts()
    for mode in (True, "auto"):
        assert plan_int4_decode_compile(mode, forward, decode, dense, model, str(path))[0].enabled
    # a file whose LM head alone is a kind the kernel reads (Gemma 3's Q4_K_M: a Q8_0 head)
    head_only = tmp_path / "head.gguf"
    write_gguf(head_only, copy.deepcopy(model), "F32")
    got, head_step = plan_int4_decode_compile(True, forward, decode, dense, model, str(head_only))
    assert got.enabled and head_step is not None
    # ... whose decoder's dense GEMMs leave longer steps to the prefill package
    assert got.loads_as.keywords["block_decoder"] is False
    assert plan.loads_as.keywords["block_decoder"] is True
    # a decoder of a quantized kind the kernel does not read as stored (Gemma 3's K-quants;
    # here Q5_1 taken out of the kinds read as stored): re-blocked, so the package has it
    reblocked = tmp_path / "reblocked.gguf"
    write_gguf(reblocked, copy.deepcopy(model), "Q5_1")
    with monkeypatch.context() as patched:
        patched.delitem(gguf_int4.BLOCK_BYTES, "Q5_1")
        got, _ = plan_int4_decode_compile(True, forward, decode, dense, model, str(reblocked))
    assert got.enabled and got.loads_as.keywords["block_decoder"] is True
    declines = {
        "engine.gguf_int4_decode is false": (False, decode, dense, model, str(path)),
        "no decode step package": (True, CompilePlan(False, "off"), None, model, str(path)),
        "not served in bf16": (True, decode, dense, tiny_model("llama"), str(path)),
        "not loaded from a GGUF": (True, decode, dense, model, str(tmp_path)),
    }
    no_q4 = tmp_path / "dense.gguf"
    write_gguf(no_q4, copy.deepcopy(model), "F32", head="F32")
    declines["stores no quantized tensor"] = (True, decode, dense, model, str(no_q4))
    for why, (mode, dec, step_, m, source) in declines.items():
        with caplog.at_level(logging.WARNING):
            got, none = plan_int4_decode_compile(mode, forward, dec, step_, m, source)
        assert not got.enabled and none is None and why in got.reason
    # a CPU without the kernel (no AVX-512 VNNI): declined, saying why
    monkeypatch.setattr(block_linear, "load", lambda: False)
    monkeypatch.setattr(block_linear, "why_not", lambda: "it needs AVX-512 VNNI")
    got, none = plan_int4_decode_compile(True, forward, decode, dense, model, str(path))
    assert not got.enabled and none is None
    assert got.reason == "the block-quantized kernel cannot run here: it needs AVX-512 VNNI"
    engine.check_memory()


@needs_kernel
def test_int4_decode_only_builds_the_4bit_package_alone(tmp_path, monkeypatch) -> None:
    """`engine.gguf_int4_decode_only` (what `train-drafter` generates with): of the packages
    `compile: true` plans for a bf16 model read from a GGUF, only the 4-bit decode step
    package is loaded or built; without the flag the prefill, decode step and forward
    packages come too; a model with no 4-bit package (fp32) builds nothing with it."""
    from sessionserve.config import EngineConfig
    from sessionserve.replicas import assembly

    started: list[list[str]] = []
    monkeypatch.setattr(
        assembly,
        "start_compile",
        lambda jobs, background: started.append([job.plan.role for job in jobs]),
    )
    bf16 = tiny_model("llama", seed=3).to(torch.bfloat16)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, bf16)
    fp32 = tiny_model("llama", seed=3)
    for model, only in ((bf16, True), (bf16, False), (fp32, True)):
        cfg = EngineConfig(  # (auto declines a tiny model's packages)
            compile=True,
            compile_decode=True,
            compile_prefill=True,
            gguf_int4_decode_only=only,
            compile_cache_dir=str(tmp_path / "pkg"),
        )
        assembly.compile_forwards(cfg, model, tiny_engine(model).runner, None, str(path))
    int4_alone, everything, nothing = started
    assert int4_alone == ["4-bit decode step package"]
    assert everything[0] == "4-bit decode step package"
    assert {"prefill package", "decode step package", "forward"} <= set(everything)
    assert nothing == []
    assert not list((tmp_path / "pkg").glob("*.pt2"))  # nothing built by the plans alone


def int4_step(model, gguf_path) -> DecodeStep:
    """The 4-bit `DecodeStep` of `model`, its linears swapped as the build's export does."""
    ours = copy.deepcopy(model)
    install(ours)  # our attention function (the runner's model has it)
    step = DecodeStep(ours, CHUNKS, int4_source=(gguf_path, "model")).eval()
    weights = gguf_int4.read_block_linears(
        gguf_path, step.decoder, "model", model.config, lm_head=step.lm_head
    )
    ours = {k if k == "lm_head" else f"decoder.{k}": w for k, w in weights.items()}
    assert gguf_int4.swap_block_linears(step, ours) == len(linear_names(model)) + 1
    return step


@needs_kernel
@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_steps_of_a_few_rows_run_the_4bit_step_and_answer_as_the_plain_engine(
    tmp_path, overlap
) -> None:
    """fp32, so that the file's weights give the dense model's answers up to the kernel's
    rounding of the rows (~bf16's; the served package is bf16, its build is checked below):
    steps of up to MAX_TOKENS tokens run the 4-bit step, wider ones not."""
    model = tiny_model("llama", seed=6)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, model)
    engine = tiny_engine(model, prefill=40, overlap=overlap)
    four = EagerDecode(int4_step(model, path), max_tokens=gguf_int4.MAX_TOKENS, block_kernel=True)
    engine.runner.compiled_int4_decode = four
    widths: list[int] = []
    inner = four._fn
    four._fn = lambda *a: widths.append(len(a[0])) or inner(*a)
    plain = tiny_engine(model, prefill=40, overlap=overlap)
    greedy = SamplingParams(max_tokens=12, temperature=0, logprobs=True)
    inputs = inputs_for(model.config.vocab_size)
    wide = inputs * (gguf_int4.MAX_TOKENS // len(inputs) + 1)
    for batch in (wide, inputs):  # more requests than MAX_TOKENS (wider steps), then 3
        before = len(widths)
        got, want = engine.generate(batch, greedy), plain.generate(batch, greedy)
        for a, b, prompt in zip(got, want, batch, strict=True):
            assert a.output_ids == b.output_ids
            assert a.output_ids == hf_greedy(model, prompt, len(a.output_ids))
            for x, y in zip(a.logprobs, b.logprobs, strict=True):
                assert x.logprob == pytest.approx(y.logprob, abs=2e-3)
        assert all(w <= gguf_int4.MAX_TOKENS for w in widths)
        engine.check_memory()
    steps = max(len(r.output_ids) for r in got) - 1  # the 3 requests' decode steps
    assert len(widths) - before >= steps > 0


@needs_kernel
@pytest.mark.slow
def test_the_built_4bit_package_matches_the_eager_step(tmp_path, package_cache) -> None:
    """A real AOTInductor build of the 4-bit step (a tiny bf16 Llama, by a build process as
    `compile: auto` builds it): its logits equal the eager 4-bit step's within bf16."""
    model = tiny_model("llama", seed=7).to(torch.bfloat16)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, model)
    model = model.to(torch.bfloat16)  # the file's weights, rounded as loading in bf16 does
    engine = tiny_engine(model, prefill=40)
    runner = engine.runner
    forward = compiled_forward.plan_compile(True, model, 32, package_cache)
    dense = DecodeStep(model, CHUNKS)
    decode = CompilePlan(True, "test", forward.package.parent / "dense.pt2", 32)
    plan, step = plan_int4_decode_compile(True, forward, decode, dense, model, str(path))
    assert plan.enabled and step is not None
    build = copy.deepcopy(step)
    compiled_forward.build_once(
        plan.package, lambda: compiled_forward.build_in_subprocess(build, plan), "building"
    )
    built = plan.loads_as(plan.package, plan.max_tokens)
    assert built.reads_weights_once  # it may take steps the prefill package would run
    runner.compiled_int4_decode = built
    shapes = recorded_shapes(built)
    eager = EagerDecode(int4_step(model, path), max_tokens=gguf_int4.MAX_TOKENS, block_kernel=True)
    greedy = SamplingParams(max_tokens=10, temperature=0, logprobs=True, top_logprobs=2)
    inputs = inputs_for(model.config.vocab_size)
    got = engine.generate(inputs, greedy)
    runner.compiled_int4_decode = eager
    want = engine.generate(inputs, greedy)
    assert len(shapes) >= 9 and eager.calls >= 9  # every decode step, through each
    assert all(tokens <= plan.max_tokens for tokens, _ in shapes)
    # tie-aware: equal tokens up to a split at a near-tie, logprobs within 5e-2
    assert assert_tie_aware_equal(want, got, margin=0.1, logprob_tol=5e-2) >= 9
    engine.check_memory()


@needs_kernel
def test_the_prefill_package_reads_the_files_lm_head(tmp_path, package_cache) -> None:
    """Where the 4-bit decode step package runs a GGUF's weights, the prefill package's LM
    head is the file's Q8_0 blocks too (a real AOTInductor build by a build process, a tiny
    bf16 Llama): keyed apart from the dense-head package, its logits are exactly the block
    kernel's over its own last hidden states and within bf16 of the dense head's, and an
    engine prefilling through it answers as the eager engine up to a near tie, under the
    strict memory check."""
    from sessionserve.cache import KVPool, KVShape
    from sessionserve.replicas.attention.base import ForwardMeta, SeqSpec
    from sessionserve.replicas.attention.torch_backend import TorchPagedBackend

    model = tiny_model("llama", seed=7).to(torch.bfloat16)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, model)
    model = model.to(torch.bfloat16)  # the file's weights, rounded as loading in bf16 does
    forward = compiled_forward.plan_compile(True, model, 16, package_cache)
    dense = compiled_forward.plan_prefill_compile(True, forward, model, 64, 17)
    plan = compiled_forward.plan_prefill_compile(True, forward, model, 64, 17, head_gguf=path)
    assert plan.enabled and plan.head_gguf == path and plan.package != dense.package
    build = copy.deepcopy(model)
    compiled_forward.build_once(
        plan.package, lambda: compiled_forward.build_in_subprocess(build, plan), "building"
    )
    built = plan.loads_as(plan.package, plan.max_tokens, plan.min_tokens)
    tokens = 40
    pool = KVPool(KVShape.from_hf_config(model.config), tokens + 1, torch.bfloat16)
    backend = TorchPagedBackend(tokens)
    slots = torch.arange(1, tokens + 1)
    spec = [SeqSpec(tokens, slots)]
    meta = ForwardMeta(backend, pool, slots, backend.prepare(spec, torch.device("cpu")))
    ids = torch.randint(3, model.config.vocab_size, (tokens,), generator=torch.Generator())
    positions = torch.arange(tokens)
    rows = positions[-3:]
    with torch.inference_mode():
        logits, last = built.run(ids, positions, rows, meta)
        head = gguf_int4.block_head(path, model)
        assert head is not None
        assert torch.equal(logits, head(last[rows]))
        want = model.lm_head(last[rows])
    torch.testing.assert_close(logits.float(), want.float(), rtol=2**-6, atol=2e-2)

    engine = tiny_engine(model, prefill=40)
    engine.runner.compiled_prefill = built
    calls, run = [0], built.run

    def counted(*args):
        calls[0] += 1
        return run(*args)

    built.run = counted
    eager = tiny_engine(model, prefill=40)
    greedy = SamplingParams(max_tokens=8, temperature=0, logprobs=True, top_logprobs=2)
    inputs = [[(7 * i + j) % 90 + 3 for j in range(n)] for i, n in enumerate((30, 45, 60))]
    answers = engine.generate(inputs, greedy)
    assert calls[0] >= 3  # each prompt's first chunk at least
    for got, ref in zip(answers, eager.generate(inputs, greedy), strict=True):
        for ours, theirs, lp in zip(got.output_ids, ref.output_ids, ref.logprobs, strict=False):
            if ours != theirs:
                (_, first), (_, second) = lp.top[:2]
                assert first - second < 0.1, (got.output_ids, ref.output_ids)
                break
    engine.check_memory()
