"""EAGLE checkpoints on disk: the public layout, loaded and saved.

A directory with `config.json` (a one-layer Llama config) and the head's weights in
`model.safetensors` or `pytorch_model.bin`: `fc.weight` (+ `fc.bias`), `layers.0.*`, and
optionally `embed_tokens.weight` (the head's own embeddings), `norm.weight` and `d2t` (a draft
vocabulary). That is what published EAGLE heads for Llama targets ship, and what
`sessionserve train-drafter` writes, so a GPU user can point `spec.drafter_path` at either.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from sessionserve.errors import InvalidConfigError
from sessionserve.replicas.speculative.drafter import EagleDrafter

WEIGHTS = "model.safetensors"
LEGACY_WEIGHTS = "pytorch_model.bin"
_OPTIONAL = ("fc.bias", "embed_tokens.weight", "norm.weight", "d2t", "t2d")


class DrafterCheckpointError(InvalidConfigError):
    """The drafter directory is missing, malformed, or does not fit the target model."""


def load_drafter(path: str | Path, target: Any) -> EagleDrafter:
    """Load an EAGLE head from a local directory and attach it to `target` (a transformers
    causal LM), in the target's dtype and device."""
    directory = Path(path).expanduser()
    config = _read_config(directory)
    weights = _read_weights(directory)
    _check_fits(directory, config, weights, target.config)
    d2t = weights.pop("d2t", None)
    weights.pop("t2d", None)
    drafter = EagleDrafter(
        config,
        fc_bias="fc.bias" in weights,
        input_norm="layers.0.input_layernorm.weight" in weights,
        final_norm="norm.weight" in weights,
        own_embeddings="embed_tokens.weight" in weights,
        draft_vocab=None if d2t is None else d2t.long() + torch.arange(d2t.numel()),
    )
    missing, unexpected = drafter.load_state_dict(weights, strict=False)
    missing = [k for k in missing if not k.startswith("rotary.") and k != "d2t"]
    if missing or unexpected:
        raise DrafterCheckpointError(
            f"{directory}: weights do not match a one-layer EAGLE head; missing {missing[:6]}, "
            f"unexpected {unexpected[:6]}"
        )
    param = next(target.parameters())
    return drafter.to(device=param.device, dtype=param.dtype).eval().attach(target)


def save_drafter(drafter: EagleDrafter, directory: str | Path, **meta: Any) -> Path:
    """Write `config.json` + `model.safetensors` (the head's own weights only)."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    state = {
        k: v.detach().to("cpu", torch.float32 if v.is_floating_point() else v.dtype).contiguous()
        for k, v in drafter.state_dict().items()
        if not k.startswith("rotary.")
    }
    tmp = out / (WEIGHTS + ".tmp")
    save_file(state, str(tmp), metadata={"format": "pt"})
    tmp.replace(out / WEIGHTS)
    config = drafter.config.to_dict() | {"architectures": ["EagleDrafter"]}
    config["eagle"] = meta
    (out / "config.json").write_text(json.dumps(config, indent=2, default=str))
    return out


def _read_config(directory: Path) -> LlamaConfig:
    cfg_file = directory / "config.json"
    if not cfg_file.is_file():
        raise DrafterCheckpointError(
            f"drafter path {str(directory)!r} has no config.json: point spec.drafter_path at a "
            "directory holding an EAGLE head (config.json + model.safetensors or "
            "pytorch_model.bin), e.g. one written by `sessionserve train-drafter`"
        )
    try:
        raw = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise DrafterCheckpointError(f"{cfg_file}: not valid JSON ({e})") from None
    raw.pop("eagle", None)
    raw["num_hidden_layers"] = 1
    return LlamaConfig(**{k: v for k, v in raw.items() if k != "architectures"})


def _read_weights(directory: Path) -> dict[str, torch.Tensor]:
    if (directory / WEIGHTS).is_file():
        return load_file(str(directory / WEIGHTS))
    if (directory / LEGACY_WEIGHTS).is_file():
        return torch.load(directory / LEGACY_WEIGHTS, map_location="cpu", weights_only=True)
    raise DrafterCheckpointError(
        f"drafter path {str(directory)!r} has no {WEIGHTS} or {LEGACY_WEIGHTS}"
    )


def _check_fits(
    directory: Path, config: LlamaConfig, weights: dict[str, torch.Tensor], target: Any
) -> None:
    foreign = [k for k in weights if not (k.startswith(("fc.", "layers.0.")) or k in _OPTIONAL)]
    if foreign:
        hint = (
            " (an EAGLE-3 head? only the EAGLE-1/2 layout is supported)"
            if any(k.startswith("midlayer.") for k in foreign)
            else ""
        )
        raise DrafterCheckpointError(
            f"{directory}: unexpected weights {foreign[:6]}{hint}; an EAGLE head has fc.* and "
            "layers.0.* (plus optional embed_tokens/norm/d2t)"
        )
    if "fc.weight" not in weights:
        raise DrafterCheckpointError(f"{directory}: no fc.weight; this is not an EAGLE head")
    h = target.hidden_size
    problems = []
    if config.hidden_size != h:
        problems.append(f"hidden size {config.hidden_size} != target's {h}")
    if tuple(weights["fc.weight"].shape) != (h, 2 * h):
        problems.append(f"fc.weight is {tuple(weights['fc.weight'].shape)}, needs ({h}, {2 * h})")
    if config.vocab_size != target.vocab_size:
        problems.append(f"vocab size {config.vocab_size} != target's {target.vocab_size}")
    emb = weights.get("embed_tokens.weight")
    if emb is not None and tuple(emb.shape) != (target.vocab_size, h):
        problems.append(f"embed_tokens.weight is {tuple(emb.shape)}")
    if problems:
        raise DrafterCheckpointError(
            f"drafter {str(directory)!r} does not fit the target model: {'; '.join(problems)}. "
            "Use a head trained for this model (`sessionserve train-drafter --model ...`)"
        )
