"""The hand-written CPU decode attention (attention/cpu_decode_kernel.py): built and loaded on a
machine with AVX-512 or AVX2 and a C++ compiler, it computes what
`inplace_decode.decode_attention` computes (the row's own token merged in), for any head layout
it supports, fp32 and bf16 pools, empty and long contexts (split into parts across threads),
strided pool views; bad input is a clear error; where it cannot be used, the decode step package
keeps inductor's formula and says why. Its use inside a built package is checked in
test_compiled_decode.py."""

from __future__ import annotations

import pytest
import torch

from sessionserve.replicas.attention import cpu_decode_kernel
from sessionserve.replicas.attention.inplace_decode import decode_attention, part_padded
from sessionserve.replicas.compiled_decode import plan_decode_compile, use_attention_kernel
from sessionserve.replicas.compiled_forward import CompilePlan
from sessionserve.wire import SamplingParams
from tests.child_python import run_child
from tests.models import hf_greedy, tiny_engine, tiny_model


@pytest.fixture(scope="module")
def kernel() -> None:
    if not cpu_decode_kernel.load():
        pytest.skip(f"the CPU decode kernel cannot be used here: {cpu_decode_kernel.why_not()}")


def case(heads: int, kv_heads: int, dim: int, lens: list[int], dtype: torch.dtype, seed: int):
    """Inputs as the decode step hands them over: a layer's view of a [layers, S, KVH, D]
    pool, each row's context scattered over 16-slot pages, new K/V as transposed views."""
    g = torch.Generator().manual_seed(seed)
    batch, width, slots_in_pool = len(lens), max(max(lens), 1), 16384
    pools = [torch.randn(2, slots_in_pool, kv_heads, dim, generator=g).to(dtype) for _ in "kv"]
    pages = torch.randperm(slots_in_pool // 16 - 1, generator=g)[: batch * (-(-width // 16))] + 1
    slots = (pages.view(batch, -1)[..., None] * 16 + torch.arange(16)).view(batch, -1)
    slots = slots[:, :width].contiguous()
    query = torch.randn(1, heads, batch, dim, generator=g).to(dtype)[0].transpose(0, 1)
    new = [torch.randn(1, kv_heads, batch, dim, generator=g).to(dtype) for _ in "kv"]
    new_k, new_v = (t[0].transpose(0, 1) for t in new)
    return query, pools[0][1], pools[1][1], slots, torch.tensor(lens), new_k, new_v


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "heads,kv_heads,dim",
    [(4, 2, 16), (9, 3, 64), (8, 2, 128), (4, 4, 32), (6, 1, 80), (16, 1, 96), (4, 1, 256)],
)
def test_the_kernel_computes_the_formula(heads, kv_heads, dim, dtype, threads) -> None:
    for seed, lens in enumerate([[0], [1], [15, 16, 17], [700, 3], [0, 1500, 40, 1]]):
        check_a_case(heads, kv_heads, dim, lens, dtype, seed)


def check_a_case(heads: int, kv_heads: int, dim: int, lens: list[int], dtype, seed: int) -> None:
    """The kernel against `decode_attention` on one `case` (also the AVX2 child's check)."""
    query, k_pool, v_pool, slots, lens_t, new_k, new_v = case(
        heads, kv_heads, dim, lens, dtype, seed
    )
    scale = dim**-0.5
    got = cpu_decode_kernel.decode_attend(query, k_pool, v_pool, slots, lens_t, new_k, new_v, scale)
    want = decode_attention(
        query, k_pool, v_pool, part_padded(slots, 4), lens_t, 4, scale, new_k, new_v
    )
    assert got.dtype == dtype and got.shape == query.shape
    assert_matches_formula(got, want)


def assert_matches_formula(got: torch.Tensor, want: torch.Tensor) -> None:
    """The kernel's tolerance: in fp32 only the order of the sums differs; in bf16 both are
    computed in fp32 and rounded once, so at most one bf16 step apart."""
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)
    else:
        torch.testing.assert_close(got.float(), want.float(), atol=1e-3, rtol=2**-7)


AVX2_BUILD_CHECK = """
import torch
torch.backends.cpu.get_cpu_capability = lambda: "AVX2"  # build the 8-lane form here
from sessionserve.replicas.attention import cpu_decode_kernel
from tests.unit.replicas.test_cpu_decode_kernel import check_a_case
assert cpu_decode_kernel.load(), cpu_decode_kernel.why_not()
for dtype in (torch.float32, torch.bfloat16):
    for heads, kv_heads, dim in [(9, 3, 64), (6, 1, 80), (4, 1, 256)]:
        for seed, lens in enumerate([[1], [15, 16, 17], [0, 1500, 40, 1]]):
            check_a_case(heads, kv_heads, dim, lens, dtype, seed)
print("AVX2 build ok")
"""


@pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() not in ("AVX512", "AMX"),
    reason="no AVX-512 here: where the kernel builds at all, the tests above run its AVX2 form",
)
def test_the_avx2_form_computes_the_formula_on_an_avx512_cpu(tmp_path) -> None:
    """The 8-lane primitives (the .cpp's AVX2 branch) run on every x86 CI machine: built in a
    child process told the CPU is AVX2, into its own cache (the op can be loaded once per
    process)."""
    run_child(AVX2_BUILD_CHECK, "AVX2 build ok", SESSIONSERVE_CACHE=str(tmp_path))
    assert any(tmp_path.glob("kernels/cpu_decode_attention-*.so"))


@pytest.mark.usefixtures("kernel")
def test_bad_input_is_a_clear_error() -> None:
    query, k_pool, v_pool, slots, lens, new_k, new_v = case(4, 2, 16, [5, 9], torch.float32, 0)
    with pytest.raises(RuntimeError, match="lens must lie in"):
        cpu_decode_kernel.decode_attend(
            query, k_pool, v_pool, slots, lens + 100, new_k, new_v, 0.25
        )
    outside = slots.clone()
    outside[1, 3] = k_pool.shape[0]  # one past the pool
    with pytest.raises(RuntimeError, match="slot 16384 of row 1 is outside the pool"):
        cpu_decode_kernel.decode_attend(query, k_pool, v_pool, outside, lens, new_k, new_v, 0.25)
    odd = torch.randn(k_pool.shape[0], 2, 24)
    with pytest.raises(RuntimeError, match="head_dim 24 is not supported"):
        cpu_decode_kernel.decode_attend(
            torch.randn(2, 4, 24), odd, odd, slots, lens, new_k[..., :8].repeat(1, 1, 3),
            new_v[..., :8].repeat(1, 1, 3), 0.25,
        )  # fmt: skip
    with pytest.raises(RuntimeError, match="K/V dtypes differ"):
        cpu_decode_kernel.decode_attend(
            query, k_pool, v_pool.to(torch.bfloat16), slots, lens, new_k, new_v, 0.25
        )
    assert not cpu_decode_kernel.supports(24, 4, 2, torch.float32)
    assert not cpu_decode_kernel.supports(64, 80, 2, torch.float32)  # 40 heads per KV head
    assert not cpu_decode_kernel.supports(64, 4, 2, torch.float16)


def test_without_the_kernel_the_step_keeps_inductors_formula(monkeypatch, caplog, tmp_path):
    """Disabled (or unbuildable), `load()` says why once and the decode step package is
    planned with the compiled formula; the plan's key differs, so packages do not mix."""
    monkeypatch.setattr(cpu_decode_kernel.KERNEL, "_state", {})
    monkeypatch.setenv(cpu_decode_kernel.DISABLE_ENV, "0")
    model = tiny_model("llama")
    pool = tiny_engine(model).runner.kv_pool
    forward = CompilePlan(True, "test", tmp_path / "forward.pt2", 32)
    with caplog.at_level("WARNING", logger=cpu_decode_kernel.__name__):
        assert not use_attention_kernel(model, pool)
    assert f"{cpu_decode_kernel.DISABLE_ENV}=0" in cpu_decode_kernel.why_not()
    assert "kernel not used" in caplog.text
    plan, step = plan_decode_compile(True, forward, model, pool)
    assert step is not None and not step.attention_kernel
    with_kernel, step_k = plan_decode_compile(True, forward, model, pool, attention_kernel=True)
    assert step_k is not None and step_k.attention_kernel
    assert with_kernel.package != plan.package
    with pytest.raises(RuntimeError, match="not available"):
        cpu_decode_kernel.decode_attend(*case(4, 2, 16, [3], torch.float32, 0), 0.25)


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_without_an_own_token_it_computes_the_formula_over_the_pool(dtype) -> None:
    """Empty new K/V: every row's token is in its context already (the compiled forward's
    decode rows, whose K/V were written first); a row must then read at least one slot."""
    query, k_pool, v_pool, slots, lens, _, _ = case(9, 3, 64, [1, 300, 17], dtype, 5)
    none = query.new_empty(0)
    got = cpu_decode_kernel.decode_attend(query, k_pool, v_pool, slots, lens, none, none, 0.125)
    want = decode_attention(query, k_pool, v_pool, part_padded(slots, 4), lens, 4, 0.125)
    assert_matches_formula(got, want)
    with pytest.raises(RuntimeError, match="under the row's tokens only with its own"):
        cpu_decode_kernel.decode_attend(query, k_pool, v_pool, slots, lens * 0, none, none, 0.1)


def per_token_reference(query, k_pool, v_pool, slots, lens, tokens, scale, new_k=None, new_v=None):
    """Rows of `tokens` query tokens, each token as its own row of the formula: its row's
    context, then the row's tokens up to itself (written to spare slots when given apart)."""
    batch = slots.shape[0]
    if new_k is not None:  # the reference reads them from the pool, after the context
        k_pool, v_pool = k_pool.clone(), v_pool.clone()
        spare = torch.arange(k_pool.shape[0] - batch * tokens, k_pool.shape[0])
        k_pool[spare], v_pool[spare] = new_k, new_v
        wide = torch.cat([slots, torch.zeros(batch, tokens, dtype=slots.dtype)], 1)
        for b in range(batch):
            wide[b, lens[b] : lens[b] + tokens] = spare[b * tokens : (b + 1) * tokens]
        slots, lens = wide, lens + tokens
    rows = slots.repeat_interleave(tokens, 0)
    seen = (lens - tokens).repeat_interleave(tokens) + torch.arange(tokens).repeat(batch) + 1
    return decode_attention(query, k_pool, v_pool, part_padded(rows, 4), seen, 4, scale)


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("tail", ["in_pool", "given"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tokens", [2, 5])
def test_rows_of_several_tokens_attend_causally(tokens, dtype, tail) -> None:
    """A chain verify's rows (k + 1 tokens each, consecutive): every token sees its row's
    context and the row's tokens up to itself, read from the pool (the torch backend's
    verify rows) or given as new K/V."""
    g = torch.Generator().manual_seed(tokens)
    lens = [tokens, 40, 700]
    query, k_pool, v_pool, slots, lens_t, _, _ = case(9, 3, 64, lens, dtype, tokens)
    batch = len(lens)
    query = torch.randn(batch * tokens, 9, 64, generator=g).to(dtype)
    if tail == "given":
        new_k, new_v = (torch.randn(batch * tokens, 3, 64, generator=g).to(dtype) for _ in "kv")
        got = cpu_decode_kernel.decode_attend(
            query, k_pool, v_pool, slots, lens_t, new_k, new_v, 0.125
        )
        want = per_token_reference(
            query, k_pool, v_pool, slots, lens_t, tokens, 0.125, new_k, new_v
        )
    else:
        none = query.new_empty(0)
        got = cpu_decode_kernel.decode_attend(
            query, k_pool, v_pool, slots, lens_t, none, none, 0.125
        )
        want = per_token_reference(query, k_pool, v_pool, slots, lens_t, tokens, 0.125)
    assert got.shape == query.shape
    assert_matches_formula(got, want)
    too_many = cpu_decode_kernel.max_query_tokens(9, 3) + 1
    wide_query = torch.zeros(batch * too_many, 9, 64, dtype=dtype)
    with pytest.raises(RuntimeError, match="at most 32"):
        none = query.new_empty(0)
        cpu_decode_kernel.decode_attend(
            wide_query, k_pool, v_pool, slots, lens_t, none, none, 0.125
        )


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("tail", ["in_pool", "given"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rows_padded_to_one_width_compute_their_real_tokens_alone(dtype, tail) -> None:
    """`widths`: rows of 5, 1, 3 and 5 real tokens padded to 5 (a verify where rows draft
    unequally): each row's real tokens equal the row computed alone at its own width, the
    padding's outputs are zeros whatever its query, and bad widths are a clear error."""
    g = torch.Generator().manual_seed(11)
    tokens, real, lens = 5, [5, 1, 3, 5], [5, 40, 700, 9]
    query, k_pool, v_pool, slots, lens_t, _, _ = case(9, 3, 64, lens, dtype, 3)
    batch = len(lens)
    query = torch.randn(batch * tokens, 9, 64, generator=g).to(dtype)
    new_k, new_v = (torch.randn(batch * tokens, 3, 64, generator=g).to(dtype) for _ in "kv")
    given = tail == "given"
    none = query.new_empty(0)
    widths = torch.tensor(real)
    args = (new_k, new_v) if given else (none, none)
    if not given:  # a row's real tokens are the last of its context
        lens_t = lens_t - tokens + widths
    got = cpu_decode_kernel.decode_attend(
        query, k_pool, v_pool, slots, lens_t, *args, 0.125, widths
    )
    assert got.shape == query.shape
    for b, w in enumerate(real):
        rows = slice(b * tokens, b * tokens + w)
        want = per_token_reference(
            query[rows], k_pool, v_pool, slots[b : b + 1], lens_t[b : b + 1], w, 0.125,
            *((new_k[rows], new_v[rows]) if given else ()),
        )  # fmt: skip
        assert_matches_formula(got[rows], want)
        assert not got[b * tokens + w : (b + 1) * tokens].any()  # the padding: zeros
    for bad, match in [(torch.tensor([5, 0, 3, 5]), "widths must lie in 1..5"),
                       (torch.tensor([5, 6, 3, 5]), "widths must lie in 1..5"),
                       (torch.tensor([5, 1]), r"widths must be \[B\] or empty")]:  # fmt: skip
        with pytest.raises(RuntimeError, match=match):
            cpu_decode_kernel.decode_attend(query, k_pool, v_pool, slots, lens_t, *args, 0.125, bad)


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_verify_rows_through_the_kernel_answer_as_transformers(arch, tmp_path) -> None:
    """With the CPU kernel installed as the torch backend's decode kernel, history drafts'
    verify steps (k + 1 tokens a row) and short session turns go through it: greedy outputs
    equal transformers', with the strict memory check after every step."""
    from sessionserve.replicas.assembly import install_decode_kernel

    model = tiny_model(arch, seed=6)
    engine = tiny_engine(model, history_drafts=True)
    runner = engine.runner
    install_decode_kernel(runner.backend, runner.model, runner.kv_pool, tmp_path)
    kernel = runner.backend.decode_kernel
    assert kernel is not None and kernel.max_query_tokens > 1
    widths: list[int] = []

    def counted(query, *rest):
        widths.append(query.shape[0] // rest[2].shape[0])  # query tokens a row
        return kernel.run(query, *rest)

    runner.backend.decode_kernel = type(kernel)(
        counted, kernel.chunks, kernel.scale, kernel.max_query_tokens
    )
    prompts = [[5, 6, 7, 8] * 6, [9, 10, 11] * 5 + [12]]
    for prompt in prompts:
        (r,) = engine.generate([prompt], SamplingParams(max_tokens=16, temperature=0))
        assert r.output_ids == hf_greedy(model, prompt, 16)[: len(r.output_ids)]
    assert engine.spec_stats.steps > 0 and max(widths) > 1  # verifies went through it
    history: list[int] = []
    sid = engine.open_session()
    for turn in range(3):
        new = [20 + turn, 21, 22]  # short turns: prefill chunks of 3 over the history
        (r,) = engine.generate([new], SamplingParams(max_tokens=5, temperature=0), session_id=sid)
        history += new
        assert r.output_ids == hf_greedy(model, history, 5)[: len(r.output_ids)], turn
        history += r.output_ids
    engine.check_memory()
