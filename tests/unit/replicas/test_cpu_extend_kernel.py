"""The hand-written CPU prefill attention (attention/cpu_extend_kernel.py): built and loaded on an
x86 CPU with AVX2 or AVX-512 and a C++ compiler, it computes what torch's attention computes
for rows of new tokens over their cached contexts read through slot tables (causal among the
new tokens, or over a sliding window), for the head layouts it supports (Gemma 3's head_dim
256 among them), contexts of any length and thread counts: in
bf16 (a CPU with AVX512-BF16) as close to the exact result as torch's own bf16 kernel, in fp32
as close as torch's fp32 attention, built for AVX-512 and for AVX2 alike; bad input is a clear
error; the torch backend takes it for prefills and session turns of bf16 and fp32 models,
whose answers stay those of the backend without it; where it cannot be used the backend keeps
torch's attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sessionserve.replicas.attention import cpu_extend_kernel
from sessionserve.replicas.attention.torch_backend import context_mask
from sessionserve.wire import SamplingParams
from tests.child_python import run_child
from tests.models import tiny_engine, tiny_model
from tests.unit.replicas.test_loader_and_backends import assert_tie_aware_equal

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, top_logprobs=2)


@pytest.fixture(scope="module")
def kernel() -> None:
    if not cpu_extend_kernel.KERNEL.load():
        pytest.skip(f"the CPU prefill kernel cannot be used here: {cpu_extend_kernel.why_not()}")


def needs(dtype: torch.dtype) -> None:
    if not cpu_extend_kernel.supports(64, 4, 2, dtype):
        pytest.skip(f"the kernel has no {dtype} path on this CPU")


def case(
    heads: int,
    kv_heads: int,
    dim: int,
    lens: list[int],
    tokens: int,
    seed: int,
    dtype: torch.dtype = torch.bfloat16,
):
    """Inputs as the torch backend hands them over: a layer's view of a [layers, S, KVH, D]
    pool in `dtype`, each row's context scattered over 16-slot pages (its new tokens' K/V its
    last `tokens` slots), the rows' queries [B * T, H, D]."""
    g = torch.Generator().manual_seed(seed)
    batch, width, slots_in_pool = len(lens), max(lens), 16384
    pools = [torch.randn(2, slots_in_pool, kv_heads, dim, generator=g).to(dtype) for _ in "kv"]
    pages = torch.randperm(slots_in_pool // 16 - 1, generator=g)[: batch * (-(-width // 16))] + 1
    slots = (pages.view(batch, -1)[..., None] * 16 + torch.arange(16)).view(batch, -1)
    slots = slots[:, :width].contiguous()
    query = torch.randn(batch * tokens, heads, dim, generator=g).to(dtype)
    return query, pools[0][1], pools[1][1], slots, torch.tensor(lens)


def attention(query, k_pool, v_pool, slots, lens, scale, dtype, window=None) -> torch.Tensor:
    """torch's attention over the gathered contexts in `dtype` (float64: the exact result),
    each token seeing only the last `window` positions where given (the backend's mask for
    sliding layers)."""
    batch, width = slots.shape
    tokens = query.shape[0] // batch
    heads, kv_heads = query.shape[1], k_pool.shape[1]
    q = query.view(batch, tokens, heads, -1).transpose(1, 2).to(dtype)
    k, v = (p[slots].transpose(1, 2).to(dtype) for p in (k_pool, v_pool))
    mask = context_mask(lens, tokens, width, window)[:, None]
    o = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=heads > kv_heads
    )
    return (
        o.transpose(1, 2).reshape(query.shape).to(query.dtype if dtype != torch.float64 else dtype)
    )


def check_a_case(
    heads, kv_heads, dim, lens, tokens, seed, dtype=torch.bfloat16, window=None
) -> None:
    """The kernel's output against the exact result, within what torch's own attention in the
    same dtype is off by on the same case. bf16: 1.25x that plus one bf16 step of the output
    (both round the softmax's weights to bf16 for the sum of V, and the output once). fp32:
    nothing is rounded but the sums, whose order differs from torch's, and both are off by
    ~1e-7: 2x torch's error plus 4 fp32 steps of the output (a wrong weight or a token seen
    that should not be is off by ~1e-2)."""
    query, k_pool, v_pool, slots, lens_t = case(heads, kv_heads, dim, lens, tokens, seed, dtype)
    scale = dim**-0.5
    got = cpu_extend_kernel.extend_attend(query, k_pool, v_pool, slots, lens_t, scale, window)
    assert got.dtype == dtype and got.shape == query.shape
    exact = attention(query, k_pool, v_pool, slots, lens_t, scale, torch.float64, window)
    torchs = attention(query, k_pool, v_pool, slots, lens_t, scale, dtype, window)
    bf16 = dtype == torch.bfloat16
    factor, step = (1.25, exact.abs() * 2**-8) if bf16 else (2.0, exact.abs() * 2**-21)
    assert (
        (got.double() - exact).abs() <= factor * (torchs.double() - exact).abs().max() + step
    ).all()


CASES = [
    ([2], 2),  # a fresh two-token prompt
    ([37], 37),  # a fresh prompt, blocks and a partial one
    ([20, 17], 3),  # short turns over short contexts
    ([16, 32, 48], 16),  # block-aligned
    ([700], 150),  # a turn over a long history: several tiles, many blocks
    ([300, 45, 161], 45),  # rows of unequal contexts
]
LAYOUTS = [
    (4, 2, 16),
    (9, 3, 64),
    (8, 2, 128),
    (4, 4, 32),
    (6, 1, 80),
    (16, 2, 96),
    (4, 1, 256),  # Gemma 3 270M's
]
WINDOW_CASES = [  # (lens, tokens, window): sliding-window layers
    ([37], 37, 8),  # a fresh prompt longer than its window
    ([700], 150, 64),  # a turn over a long history: the window starts mid-block
    ([300, 45, 161], 45, 100),  # rows the window cuts and one it covers
    ([40, 55], 40, 1),  # each token sees itself only
    ([512], 256, 512),  # a window that covers every context: as full attention
]
WINDOW_LAYOUTS = [(9, 3, 64), (4, 1, 256), (8, 8, 32)]


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads,kv_heads,dim", LAYOUTS)
def test_the_kernel_computes_torchs_attention(heads, kv_heads, dim, dtype, threads) -> None:
    needs(dtype)
    for seed, (lens, tokens) in enumerate(CASES):
        check_a_case(heads, kv_heads, dim, lens, tokens, seed, dtype)


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads,kv_heads,dim", WINDOW_LAYOUTS)
def test_the_kernel_computes_sliding_window_attention(heads, kv_heads, dim, dtype, threads) -> None:
    """A sliding-window layer's attention (each token seeing the last `window` positions,
    itself included), as torch's over the backend's banded mask."""
    needs(dtype)
    for seed, (lens, tokens, window) in enumerate(WINDOW_CASES):
        check_a_case(heads, kv_heads, dim, lens, tokens, seed, dtype, window)


AVX2_SCRIPT = """
    import torch
    from sessionserve.replicas.attention import cpu_extend_kernel
    from tests.unit.replicas.test_cpu_extend_kernel import (
        CASES, LAYOUTS, WINDOW_CASES, WINDOW_LAYOUTS, case, check_a_case,
    )

    assert torch.backends.cpu.get_cpu_capability() == "AVX2"
    assert cpu_extend_kernel.KERNEL.load(), cpu_extend_kernel.why_not()
    assert not cpu_extend_kernel.supports(64, 4, 2, torch.bfloat16)
    torch.set_num_threads(2)
    for heads, kv_heads, dim in LAYOUTS:
        for seed, (lens, tokens) in enumerate(CASES):
            check_a_case(heads, kv_heads, dim, lens, tokens, seed, torch.float32)
    for heads, kv_heads, dim in WINDOW_LAYOUTS:
        for seed, (lens, tokens, window) in enumerate(WINDOW_CASES):
            check_a_case(heads, kv_heads, dim, lens, tokens, seed, torch.float32, window)
    try:
        cpu_extend_kernel.extend_attend(*case(4, 2, 16, [3], 3, 0), 0.25)
    except RuntimeError as e:
        assert "bf16 needs a CPU with AVX512-BF16" in str(e), e
    else:
        raise AssertionError("a bf16 call to the AVX2 build did not fail")
    print("AVX2 OK")
"""


@pytest.mark.usefixtures("kernel")
def test_the_avx2_build_computes_fp32_attention_and_refuses_bf16() -> None:
    """The same cases through the kernel built for AVX2 (torch told its CPU is AVX2, so the
    kernel builds with -mavx2 -mfma: 8-lane blocks, four rows a pass), in a process of its own;
    bf16 is a clear error there."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512", "AMX"):
        pytest.skip("this CPU runs no AVX2 code")
    run_child(AVX2_SCRIPT, "AVX2 OK", ATEN_CPU_CAPABILITY="avx2")


@pytest.mark.usefixtures("kernel")
def test_a_token_sees_nothing_after_itself() -> None:
    """Changing the K/V of a row's later tokens leaves its earlier tokens' outputs as they
    were, bit for bit, and changes the later ones."""
    query, k_pool, v_pool, slots, lens = case(9, 3, 64, [90], 40, 3)
    before = cpu_extend_kernel.extend_attend(query, k_pool, v_pool, slots, lens, 0.125)
    k2, v2 = k_pool.clone(), v_pool.clone()
    later = slots[0, 70:90]  # the K/V of new tokens 20..39
    k2[later], v2[later] = k2[later] * -3, v2[later] + 1
    after = cpu_extend_kernel.extend_attend(query, k2, v2, slots, lens, 0.125)
    assert torch.equal(before[:20], after[:20])
    assert not torch.equal(before[20:], after[20:])


@pytest.mark.usefixtures("kernel")
def test_bad_input_is_a_clear_error() -> None:
    query, k_pool, v_pool, slots, lens = case(4, 2, 16, [5, 9], 4, 0)
    with pytest.raises(RuntimeError, match="lens must lie in 4"):
        cpu_extend_kernel.extend_attend(query, k_pool, v_pool, slots, lens - 2, 0.25)
    outside = slots.clone()
    outside[1, 3] = k_pool.shape[0]  # one past the pool
    with pytest.raises(RuntimeError, match="slot 16384 of row 1 is outside the pool"):
        cpu_extend_kernel.extend_attend(query, k_pool, v_pool, outside, lens, 0.25)
    with pytest.raises(RuntimeError, match="must all be float32, or all bf16"):
        cpu_extend_kernel.extend_attend(query.float(), k_pool, v_pool, slots, lens, 0.25)
    odd = torch.randn(k_pool.shape[0], 2, 24).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="head_dim 24 is not supported"):
        cpu_extend_kernel.extend_attend(torch.randn(8, 4, 24).bfloat16(), odd, odd, slots, lens, 1)
    assert not cpu_extend_kernel.usable(24, 4, 2, torch.bfloat16)
    assert not cpu_extend_kernel.usable(64, 4, 2, torch.float16)


def _spied(monkeypatch) -> list[tuple[int, int | None]]:
    """The kernel's calls from here on: each one's query tokens and window."""
    calls: list[tuple[int, int | None]] = []
    run = cpu_extend_kernel.extend_attend

    def spy(query, *args):  # noqa: ANN001, ANN202
        calls.append((query.shape[0], args[5] if len(args) > 5 else None))
        return run(query, *args)

    monkeypatch.setattr(cpu_extend_kernel, "extend_attend", spy)
    return calls


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "arch,apart", [("llama", True), ("qwen2", True), ("gemma3", True), ("gemma3", False)]
)
def test_session_turns_through_the_kernel_answer_as_without_it(
    monkeypatch, arch, apart, dtype
) -> None:
    """A bf16 or fp32 model's prompts and session turns (turns of several lengths, then two
    prompts in one step) attend through the kernel and answer, tie-aware, as the same engine
    without it, token for token where no near-tie decides. Gemma 3's sliding layers (window
    8, which every prompt and turn here outgrows) take it too: over their window's columns,
    from the sliding slots where the cache keeps those layers' KV apart (`apart`), else the
    whole context banded by the kernel."""
    needs(dtype)
    monkeypatch.setenv(cpu_extend_kernel.DISABLE_ENV, "1")  # on a CPU with AMX too
    model = tiny_model(arch).to(dtype)
    calls = _spied(monkeypatch)
    engine, without = (tiny_engine(model, sliding_window_kv=apart) for _ in "ab")
    without.runner.backend.extend_kernel = False
    assert engine.runner.backend.extend_kernel
    results = {}
    for name, e in (("kernel", engine), ("without", without)):
        sid = e.open_session()
        turns = []
        for turn, n in enumerate((40, 3, 70)):
            new = [3 + (turn * 17 + j * 5) % 240 for j in range(n)]
            turns += e.generate([new], GREEDY, session_id=sid)
        turns += e.generate([[9] * 33, list(range(5, 60))], GREEDY)  # two prompts, one step
        e.close_session(sid)
        e.checker.check_idle()
        results[name] = turns
        if name == "kernel":
            # the 70-token turn, after the last answer's final token (its K/V not written yet)
            assert any(tokens == 71 for tokens, _ in calls)
            windows = {w for _, w in calls}
            assert windows == ({None, 8} if arch == "gemma3" else {None})
            calls.clear()
    assert not calls  # the engine without it never called it
    assert assert_tie_aware_equal(results["without"], results["kernel"]) >= 3 * GREEDY.max_tokens


def test_where_it_cannot_be_used_the_backend_keeps_torchs_attention(monkeypatch) -> None:
    """The kernel turned off: the backend does not take it, and says why."""
    monkeypatch.setattr(cpu_extend_kernel.KERNEL, "_state", {})
    monkeypatch.setenv(cpu_extend_kernel.DISABLE_ENV, "0")
    engine = tiny_engine(tiny_model().to(torch.bfloat16))
    assert not engine.runner.backend.extend_kernel
    assert f"{cpu_extend_kernel.DISABLE_ENV}=0" in cpu_extend_kernel.why_not()
    calls = _spied(monkeypatch)
    (r,) = engine.generate([list(range(3, 40))], GREEDY)
    assert len(r.output_ids) == GREEDY.max_tokens and not calls
    with pytest.raises(RuntimeError, match="not available"):
        cpu_extend_kernel.extend_attend(*case(4, 2, 16, [3], 3, 0), 0.25)


@pytest.mark.usefixtures("kernel")
def test_on_a_cpu_with_amx_the_backend_takes_it_only_when_told(monkeypatch, caplog) -> None:
    """Where torch's attention runs on AMX tiles the kernel was not measured against it: the
    backend keeps torch's attention there (said once) unless SESSIONSERVE_CPU_EXTEND_KERNEL=1."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AMX")
    monkeypatch.setattr(cpu_extend_kernel, "_said_why", False)
    monkeypatch.delenv(cpu_extend_kernel.DISABLE_ENV, raising=False)
    with caplog.at_level("INFO", logger=cpu_extend_kernel.__name__):
        assert not cpu_extend_kernel.usable(64, 9, 3, torch.bfloat16)
        assert not tiny_engine(tiny_model().to(torch.bfloat16)).runner.backend.extend_kernel
        # fp32 is not computed on tiles: the kernel is taken there
        assert cpu_extend_kernel.usable(64, 9, 3, torch.float32)
        assert tiny_engine(tiny_model()).runner.backend.extend_kernel
    assert caplog.text.count("this CPU has AMX tiles") == 1
    monkeypatch.setenv(cpu_extend_kernel.DISABLE_ENV, "1")
    assert cpu_extend_kernel.usable(64, 9, 3, torch.bfloat16)
    assert tiny_engine(tiny_model().to(torch.bfloat16)).runner.backend.extend_kernel


@pytest.mark.usefixtures("kernel")
def test_on_avx2_the_backend_takes_it_for_fp32_only_when_told(monkeypatch, caplog) -> None:
    """On AVX2 the fp32 build was not measured faster than torch's attention: the backend keeps
    torch's there (said once) unless SESSIONSERVE_CPU_EXTEND_KERNEL=1."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    monkeypatch.setattr(cpu_extend_kernel, "_said_why", False)
    monkeypatch.delenv(cpu_extend_kernel.DISABLE_ENV, raising=False)
    with caplog.at_level("INFO", logger=cpu_extend_kernel.__name__):
        assert not cpu_extend_kernel.usable(64, 9, 3, torch.float32)
        assert not tiny_engine(tiny_model()).runner.backend.extend_kernel
    assert caplog.text.count("on AVX2 it was not measured faster") == 1
    monkeypatch.setenv(cpu_extend_kernel.DISABLE_ENV, "1")
    assert tiny_engine(tiny_model()).runner.backend.extend_kernel


def test_the_bf16_path_is_built_only_on_a_cpu_with_avx512_bf16(monkeypatch) -> None:
    """AVX-512 with BF16: both paths (the build adds -mavx512bf16); without BF16, or AVX2 only:
    fp32 alone, and a bf16 model keeps torch's attention."""
    built = "-mavx512bf16" in cpu_extend_kernel.KERNEL.extra_flags
    assert built == cpu_extend_kernel.BF16_BUILT == cpu_extend_kernel.has_bf16()
    assert cpu_extend_kernel.supports(64, 9, 3, torch.bfloat16) == built
    assert cpu_extend_kernel.supports(64, 9, 3, torch.float32)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    assert not cpu_extend_kernel.has_bf16()
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert not cpu_extend_kernel.has_bf16()
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert cpu_extend_kernel.has_bf16()
