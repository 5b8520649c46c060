"""Decode attention over the pool in place (attention/inplace_decode.py) and its compiled
kernel (compiled_attention.py) give what the copying path gives: the formula equals SDPA over
gathered K/V for any head grouping, padding and number of parts; the AOTInductor kernel equals
the formula for every batch and width (one package, no recompiles), is cached and falls back
with a warning; and an engine whose torch backend runs decode rows through it answers as the
engine that copies, and as transformers' `generate`, over sessions and sliding windows (KV kept
apart), with the strict memory check after every step. The compiled forward's own tests
(test_compiled_forward.py) run with the kernel installed, as a compiled engine has it."""

from __future__ import annotations

import functools
import logging

import pytest
import torch
import torch.nn.functional as F

from sessionserve.cache import KVShape
from sessionserve.replicas import compiled_attention
from sessionserve.replicas.attention import attention_scale, cpu_decode_kernel
from sessionserve.replicas.attention.inplace_decode import DecodeKernel, decode_attention
from sessionserve.replicas.attention.torch_backend import gather_rows
from sessionserve.wire import SamplingParams
from tests.models import hf_greedy, tiny_engine, tiny_model

LAYOUT = compiled_attention.HeadLayout(4, 2, 16, "torch.float32", 0.25)  # the tiny models'


def sdpa_reference(query, k_pool, v_pool, slots, lens, scale: float = 1.0) -> torch.Tensor:
    """What the torch backend's copying path computes for decode rows."""
    width = slots.shape[1]
    keys = gather_rows(k_pool, slots).transpose(1, 2).float()
    values = gather_rows(v_pool, slots).transpose(1, 2).float()
    mask = (torch.arange(width)[None, :] < lens[:, None])[:, None, None, :]
    out = F.scaled_dot_product_attention(
        query.float()[:, :, None], keys, values, attn_mask=mask, scale=scale, enable_gqa=True
    )
    return out[:, :, 0]


def random_case(batch, width, heads, kv_heads, dim=16, pool_slots=300, dtype=torch.float32):
    g = torch.Generator().manual_seed(batch * 1000 + width * 10 + heads + kv_heads)
    k_pool = torch.randn(pool_slots, kv_heads, dim, generator=g).to(dtype)
    v_pool = torch.randn(pool_slots, kv_heads, dim, generator=g).to(dtype)
    query = torch.randn(batch, heads, dim, generator=g).to(dtype)
    slots = torch.randint(0, pool_slots, (batch, width), generator=g)
    lens = torch.randint(1, width + 1, (batch,), generator=g)
    lens[0] = width  # one row without padding, the others with some
    return query, k_pool, v_pool, slots, lens


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 1), (4, 4), (9, 3)])
@pytest.mark.parametrize("chunks", [1, 4])
@pytest.mark.parametrize("batch,width", [(1, 8), (3, 24), (5, 64)])
def test_the_formula_equals_sdpa_over_gathered_kv(heads, kv_heads, chunks, batch, width):
    case = random_case(batch, width, heads, kv_heads)
    got = decode_attention(*case, chunks=chunks, scale=0.3)
    assert got.shape == case[0].shape
    torch.testing.assert_close(got, sdpa_reference(*case, scale=0.3), atol=1e-5, rtol=1e-5)


def test_parts_with_nothing_to_see_weigh_nothing() -> None:
    """Rows padded over whole parts (a 1-token context in 8 parts of 4) keep exact answers,
    no NaN from a part whose maximum is -inf."""
    query, k_pool, v_pool, slots, _ = random_case(3, 32, 4, 2)
    lens = torch.tensor([1, 5, 32])
    got = decode_attention(query, k_pool, v_pool, slots, lens, chunks=8)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, sdpa_reference(query, k_pool, v_pool, slots, lens))
    # a row that sees one slot answers that slot's value (per KV head)
    want = v_pool[slots[0, 0]].repeat_interleave(2, dim=0)
    torch.testing.assert_close(got[0], want)


def test_bf16_is_computed_in_fp32() -> None:
    """A bf16 query is scaled after its conversion to fp32, and the answer rounded once."""
    query, k_pool, v_pool, slots, lens = random_case(2, 16, 4, 2, dtype=torch.bfloat16)
    got = decode_attention(query, k_pool, v_pool, slots, lens, chunks=2, scale=0.25)
    assert got.dtype == torch.bfloat16  # the query's
    want = sdpa_reference(query, k_pool, v_pool, slots, lens, scale=0.25)
    torch.testing.assert_close(got, want.to(torch.bfloat16), atol=0, rtol=0)


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("kernels")


@pytest.fixture(scope="module")
def kernel(kernel_dir) -> DecodeKernel:
    built = compiled_attention.load_decode_kernel(LAYOUT, kernel_dir)
    assert built is not None, "the kernel did not build"
    return built


@pytest.fixture(scope="module", params=["compiled", "cpu_kernel"])
def any_kernel(request, kernel_dir) -> DecodeKernel:
    """The compiled formula's package, and the hand-written CPU kernel where this machine
    builds it (what `decode_kernel_for` installs on such a machine)."""
    if request.param == "compiled":
        return request.getfixturevalue("kernel")
    if not cpu_decode_kernel.load():
        pytest.skip(f"the CPU decode kernel cannot be used here: {cpu_decode_kernel.why_not()}")
    chosen = compiled_attention.decode_kernel_for(LAYOUT, kernel_dir)
    assert chosen is not None and chosen.run.__module__ == cpu_decode_kernel.__name__
    return chosen


@pytest.mark.parametrize("batch,parts", [(1, 1), (2, 1), (1, 3), (7, 5), (16, 12)])
def test_the_compiled_kernel_equals_the_formula_at_any_shape(kernel, batch, parts) -> None:
    """One package for every batch and width (exported with both dynamic, from 1 up)."""
    width = parts * kernel.chunks
    query, k_pool, v_pool, slots, lens = random_case(batch, width, 4, 2, pool_slots=700)
    got = kernel(query, k_pool, v_pool, slots, lens)
    want = decode_attention(query, k_pool, v_pool, slots, lens, kernel.chunks, LAYOUT.scale)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    reference = sdpa_reference(query, k_pool, v_pool, slots, lens, LAYOUT.scale)
    torch.testing.assert_close(got, reference)


def test_the_flat_call_equals_the_packaged_models_own_call(kernel, kernel_dir, monkeypatch) -> None:
    """`load_flat` calls the package's runner without its pytree wrapper; a torch whose loaded
    package has no runner to reach gets the plain call, with the same flat outputs."""
    from sessionserve.replicas.compiled_forward import load_flat

    path = compiled_attention.kernel_path(kernel_dir, LAYOUT)
    case = random_case(3, 2 * kernel.chunks, 4, 2)
    model = torch._inductor.aoti_load_package(str(path))
    want = model(*case)
    (got,) = load_flat(path)(*case)
    torch.testing.assert_close(got, want, atol=0, rtol=0)

    class Wrapped:  # what another torch's loader might hand back: callable, nothing else
        def __init__(self, inner) -> None:
            self.inner = inner

        def __call__(self, *args):
            return self.inner(*args)

    real_load = torch._inductor.aoti_load_package
    monkeypatch.setattr(torch._inductor, "aoti_load_package", lambda p: Wrapped(real_load(p)))
    (plain,) = load_flat(path)(*case)
    torch.testing.assert_close(plain, want, atol=0, rtol=0)


def test_the_kernel_loads_from_the_cache_and_a_failed_build_says_why(
    kernel, kernel_dir, tmp_path, monkeypatch, caplog
) -> None:
    path = compiled_attention.kernel_path(kernel_dir, LAYOUT)
    assert path.exists()
    built_at = path.stat().st_mtime_ns
    with caplog.at_level(logging.INFO, logger=compiled_attention.__name__):
        again = compiled_attention.load_decode_kernel(LAYOUT, kernel_dir)
    assert again is not None and path.stat().st_mtime_ns == built_at
    assert not any("building" in r.getMessage() for r in caplog.records)
    # another layout (or scale) is another package
    for other in (
        compiled_attention.HeadLayout(4, 4, 16, "torch.float32", 0.25),
        compiled_attention.HeadLayout(4, 2, 16, "torch.float32", 0.125),
    ):
        assert compiled_attention.kernel_path(kernel_dir, other) != path

    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler here")

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", broken)
    with caplog.at_level(logging.WARNING, logger=compiled_attention.__name__):
        assert compiled_attention.load_decode_kernel(LAYOUT, tmp_path) is None
    assert any(
        "keeps copying" in r.getMessage() and "no C++ compiler" in r.getMessage()
        for r in caplog.records
    )
    assert [p.suffix for p in tmp_path.iterdir()] == [".lock"]  # no half-written package


def with_kernel(engine, kernel: DecodeKernel) -> list[int]:
    """Install `kernel` on the engine's backend, counting its calls (the list's element)."""
    calls = [0]

    def counted(*args):
        calls[0] += 1
        return kernel(*args)

    engine.runner.backend.decode_kernel = DecodeKernel(counted, kernel.chunks, kernel.scale)
    return calls


def formula_kernel(model, chunks: int) -> DecodeKernel:
    """The eager formula as the kernel, with `model`'s softmax scale."""
    scale = attention_scale(model, KVShape.from_hf_config(model.config).head_dim)
    run = functools.partial(decode_attention, chunks=chunks, scale=scale)
    return DecodeKernel(run, chunks, scale)


@pytest.mark.parametrize(
    "arch,kw",
    [("llama", {}), ("mistral", {"sliding_window": 12})],
    ids=["llama", "mistral-window-apart"],
)
def test_an_engine_decoding_in_place_answers_as_the_copying_engine(arch, kw, any_kernel) -> None:
    """Batches of decode rows of different lengths, then session turns, through the compiled
    kernel or the CPU kernel: greedy tokens equal the copying engine's and transformers';
    logprobs within 1e-5; the strict memory check after every step (tiny_engine's default)."""
    model = tiny_model(arch, seed=6, **kw)
    in_place, copying = tiny_engine(model, prefill=40), tiny_engine(model, prefill=40)
    calls = with_kernel(in_place, any_kernel)
    greedy = SamplingParams(max_tokens=20, temperature=0, logprobs=True)
    g = torch.Generator().manual_seed(3)
    inputs = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (3, 30, 70)]
    got, want = in_place.generate(inputs, greedy), copying.generate(inputs, greedy)
    for a, b, prompt in zip(got, want, inputs, strict=True):
        assert a.output_ids == b.output_ids == hf_greedy(model, prompt, 20)[: len(a.output_ids)]
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert x.logprob == pytest.approx(y.logprob, abs=1e-5)
    assert calls[0] >= 19 * model.config.num_hidden_layers  # every decode step, every layer
    history: list[int] = []
    sid = in_place.open_session()
    for turn in range(3):
        new = torch.randint(3, 200, (9,), generator=g).tolist()
        (r,) = in_place.generate([new], SamplingParams(max_tokens=6, temperature=0), session_id=sid)
        history += new
        assert r.output_ids == hf_greedy(model, history, 6)[: len(r.output_ids)], turn
        history += r.output_ids
    in_place.check_memory()


def test_verify_rows_keep_the_copying_path() -> None:
    """Only one-token rows go through the kernel: with history drafts, the verify steps (k+1
    tokens a row) that happened still answer as transformers with the kernel installed."""
    model = tiny_model("llama", seed=6)
    engine = tiny_engine(model, history_drafts=True)
    with_kernel(engine, formula_kernel(model, 4))
    prompt = [5, 6, 7, 8] * 6
    (r,) = engine.generate([prompt], SamplingParams(max_tokens=16, temperature=0))
    assert r.output_ids == hf_greedy(model, prompt, 16)[: len(r.output_ids)]
    assert engine.spec_stats.steps > 0 and engine.spec_stats.drafted > 0
    engine.check_memory()


def test_the_formula_as_the_kernel_over_a_window_kept_apart() -> None:
    """The backend pads each group's slots to the kernel's parts and hands it the sliding
    layers' own slots and lengths: with the eager formula installed (no build), a Mistral
    with its window's KV apart decodes past the window as transformers does."""
    model = tiny_model("mistral", seed=2, sliding_window=8)
    engine = tiny_engine(model)
    calls = with_kernel(engine, formula_kernel(model, 3))
    prompt = list(range(10, 31))
    (r,) = engine.generate([prompt], SamplingParams(max_tokens=14, temperature=0))
    assert r.output_ids == hf_greedy(model, prompt, 14)[: len(r.output_ids)]
    assert calls[0] >= 13 * model.config.num_hidden_layers
    engine.check_memory()


def test_a_kernel_for_another_scale_is_not_used() -> None:
    """The kernel's softmax scale is compiled in: layers with another scale keep copying."""
    model = tiny_model("llama", seed=6)
    engine = tiny_engine(model)
    right = formula_kernel(model, 4)
    wrong = DecodeKernel(
        functools.partial(decode_attention, chunks=4, scale=2 * right.scale), 4, 2 * right.scale
    )
    calls = with_kernel(engine, wrong)
    (r,) = engine.generate([[4, 5, 6, 7]], SamplingParams(max_tokens=8, temperature=0))
    assert r.output_ids == hf_greedy(model, [4, 5, 6, 7], 8)[: len(r.output_ids)]
    assert calls[0] == 0
