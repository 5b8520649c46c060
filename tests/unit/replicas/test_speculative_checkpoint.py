"""EAGLE checkpoints: the public EAGLE-1 layout loads and drafts like the target alone, and
checkpoints that do not fit the target give clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from sessionserve.config import EngineConfig, SpecConfig
from sessionserve.replicas.engine import Engine
from sessionserve.replicas.speculative.checkpoint import DrafterCheckpointError, load_drafter
from sessionserve.replicas.speculative.drafter import EagleDrafter, drafter_config
from sessionserve.wire import SamplingParams
from tests.models import tiny_engine, tiny_model

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def _eagle1_checkpoint(directory: Path, model, fmt: str = "bin") -> None:
    """The public EAGLE-1 layout: no input norm in layer 0, the head's own embeddings,
    `pytorch_model.bin`, a plain Llama config.json."""
    cfg = drafter_config(model.config)
    head = EagleDrafter(cfg, input_norm=False, own_embeddings=True)
    state = {k: v for k, v in head.state_dict().items() if not k.startswith("rotary.")}
    state["embed_tokens.weight"] = model.get_input_embeddings().weight.detach().clone()
    directory.mkdir(parents=True, exist_ok=True)
    torch.save(state, directory / "pytorch_model.bin")
    raw = cfg.to_dict() | {"architectures": ["LlamaForCausalLM"]}
    (directory / "config.json").write_text(json.dumps(raw))


def test_public_eagle1_layout_loads_from_bin(tmp_path) -> None:
    model = tiny_model(seed=2)
    _eagle1_checkpoint(tmp_path / "eagle1", model)
    head = load_drafter(tmp_path / "eagle1", model)
    assert isinstance(head.layers[0].input_layernorm, torch.nn.Identity)
    assert head.embed_tokens is not None
    spec = tiny_engine(model, drafter=lambda m: load_drafter(tmp_path / "eagle1", m))
    plain = tiny_engine(model)
    prompts = [[4, 8, 15, 16, 23, 42]]
    assert (
        spec.generate(prompts, GREEDY)[0].output_ids
        == plain.generate(prompts, GREEDY)[0].output_ids
    )


def test_checkpoints_that_do_not_fit_give_clear_errors(tmp_path) -> None:
    model = tiny_model(seed=2)
    with pytest.raises(DrafterCheckpointError, match="no config.json"):
        load_drafter(tmp_path / "missing", model)
    _eagle1_checkpoint(tmp_path / "small", tiny_model(hidden_size=32))
    with pytest.raises(DrafterCheckpointError, match="hidden size 32 != target's 64"):
        load_drafter(tmp_path / "small", model)
    _eagle1_checkpoint(tmp_path / "vocab", tiny_model(vocab_size=300))
    with pytest.raises(DrafterCheckpointError, match="vocab size 300 != target's 256"):
        load_drafter(tmp_path / "vocab", model)
    _eagle1_checkpoint(tmp_path / "eagle3", model)
    state = torch.load(tmp_path / "eagle3" / "pytorch_model.bin")
    state["midlayer.self_attn.q_proj.weight"] = state.pop("layers.0.self_attn.q_proj.weight")
    torch.save(state, tmp_path / "eagle3" / "pytorch_model.bin")
    with pytest.raises(DrafterCheckpointError, match="EAGLE-3"):
        load_drafter(tmp_path / "eagle3", model)
    with pytest.raises(DrafterCheckpointError, match="no config.json"):
        Engine(
            EngineConfig(spec=SpecConfig(drafter_path=str(tmp_path / "missing"))),
            loaded=load_model_stub(model),
        )


def load_model_stub(model):
    from sessionserve.replicas.loader import LoadedModel
    from tests.models import word_tokenizer

    return LoadedModel(model, word_tokenizer(), "tiny", "tests")
