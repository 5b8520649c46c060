"""EAGLE checkpoints on disk: the public layouts, loaded and saved.

A directory with `config.json` (a one-layer Llama config) and the head's weights in
`model.safetensors` or `pytorch_model.bin`, in one of two layouts:
- EAGLE-1/2: `fc.weight` [h, 2h] (+ `fc.bias`), `layers.0.*`, optionally `embed_tokens.weight`,
  `norm.weight` and `d2t` (a draft vocabulary over the target's LM head);
- EAGLE-3 (config architecture `LlamaForCausalLMEagle3`): `fc.weight` [h, 3h], `midlayer.*`,
  `norm.weight`, optionally `lm_head.weight` with `d2t`/`t2d` (its own draft vocabulary) and
  `embed_tokens.weight`; `eagle_config.eagle_aux_hidden_state_layer_ids` may name the target
  layers it reads.
That is what published EAGLE heads for Llama targets ship, and what `sessionserve
train-drafter` writes, so a GPU user can point `spec.drafter_path` at either.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from sessionserve.errors import InvalidConfigError
from sessionserve.replicas.speculative.drafter import DraftHead, EagleDrafter
from sessionserve.replicas.speculative.eagle3 import (
    Eagle3Drafter,
    default_feature_layers,
    feature_layers_from_ids,
)

WEIGHTS = "model.safetensors"
LEGACY_WEIGHTS = "pytorch_model.bin"
EAGLE3_ARCH = "LlamaForCausalLMEagle3"
_OPTIONAL = ("fc.bias", "embed_tokens.weight", "norm.weight", "d2t", "t2d")
_OPTIONAL3 = ("fc.bias", "embed_tokens.weight", "lm_head.weight", "d2t", "t2d")


class DrafterCheckpointError(InvalidConfigError):
    """The drafter directory is missing, malformed, or does not fit the target model."""


def load_drafter(path: str | Path, target: Any) -> DraftHead:
    """Load an EAGLE head (either layout) from a local directory and attach it to `target` (a
    transformers causal LM), in the target's dtype and device."""
    directory = Path(path).expanduser()
    raw = _read_config(directory)
    weights = _read_weights(directory)
    if _is_eagle3(raw, weights):
        drafter: DraftHead = _eagle3_head(directory, raw, weights, target.config)
    else:
        drafter = _eagle_head(directory, raw, weights, target.config)
    missing, unexpected = drafter.load_state_dict(weights, strict=False)
    missing = [k for k in missing if not k.startswith("rotary.") and k != "d2t"]
    if missing or unexpected:
        kind = "EAGLE-3" if isinstance(drafter, Eagle3Drafter) else "one-layer EAGLE"
        raise DrafterCheckpointError(
            f"{directory}: weights do not match a {kind} head; missing {missing[:6]}, "
            f"unexpected {unexpected[:6]}"
        )
    param = next(target.parameters())
    return drafter.to(device=param.device, dtype=param.dtype).eval().attach(target)


def _eagle_head(
    directory: Path, raw: dict[str, Any], weights: dict[str, torch.Tensor], target: Any
) -> EagleDrafter:
    config = _llama_config(raw)
    _check_fits(directory, config, weights, target)
    draft_vocab = _take_draft_vocab(weights)
    return EagleDrafter(
        config,
        fc_bias="fc.bias" in weights,
        input_norm="layers.0.input_layernorm.weight" in weights,
        final_norm="norm.weight" in weights,
        own_embeddings="embed_tokens.weight" in weights,
        draft_vocab=draft_vocab,
    )


def _eagle3_head(
    directory: Path, raw: dict[str, Any], weights: dict[str, torch.Tensor], target: Any
) -> Eagle3Drafter:
    config = _llama_config(raw)
    ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    layers = (
        feature_layers_from_ids(ids)
        if ids is not None
        else default_feature_layers(target.num_hidden_layers)
    )
    _check_fits3(directory, config, layers, weights, target)
    draft_vocab = _take_draft_vocab(weights)
    return Eagle3Drafter(
        config,
        layers,
        target_hidden_size=target.hidden_size,
        fc_bias="fc.bias" in weights,
        own_embeddings="embed_tokens.weight" in weights,
        own_head="lm_head.weight" in weights,
        draft_vocab=draft_vocab,
    )


def _take_draft_vocab(weights: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """Remove `d2t` (draft id + d2t[id] = target id) and `t2d` (its inverse mask, unused) from
    `weights`; the draft vocabulary's target ids, or None for the whole vocabulary."""
    d2t = weights.pop("d2t", None)
    weights.pop("t2d", None)
    return None if d2t is None else d2t.long() + torch.arange(d2t.numel())


def _is_eagle3(raw: dict[str, Any], weights: dict[str, torch.Tensor]) -> bool:
    return EAGLE3_ARCH in (raw.get("architectures") or []) or any(
        k.startswith("midlayer.") for k in weights
    )


def save_drafter(drafter: DraftHead, directory: str | Path, **meta: Any) -> Path:
    """Write `config.json` + `model.safetensors` (the head's own weights only), in the public
    layout of its kind (an EAGLE-3 head also gets `t2d` and its layer ids, as published heads
    carry them)."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    state = {
        k: v.detach().to("cpu", torch.float32 if v.is_floating_point() else v.dtype).contiguous()
        for k, v in drafter.state_dict().items()
        if not k.startswith("rotary.")
    }
    config = drafter.config.to_dict() | {"architectures": ["EagleDrafter"]}
    if isinstance(drafter, Eagle3Drafter):
        config["architectures"] = [EAGLE3_ARCH]
        config["eagle_config"] = {
            "eagle_aux_hidden_state_layer_ids": [i - 1 for i in drafter.feature_layers]
        }
        ids = drafter.draft_ids
        if ids is not None:
            config["draft_vocab_size"] = ids.numel()
            t2d = torch.zeros(drafter.config.vocab_size, dtype=torch.bool)
            t2d[ids.cpu()] = True
            state["t2d"] = t2d
    tmp = out / (WEIGHTS + ".tmp")
    save_file(state, str(tmp), metadata={"format": "pt"})
    tmp.replace(out / WEIGHTS)
    config["eagle"] = meta
    (out / "config.json").write_text(json.dumps(config, indent=2, default=str))
    return out


def _read_config(directory: Path) -> dict[str, Any]:
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
    if not isinstance(raw, dict):
        raise DrafterCheckpointError(f"{cfg_file}: not a JSON object")
    return raw


_NOT_LLAMA = ("architectures", "eagle", "eagle_config", "draft_vocab_size", "target_hidden_size")


def _llama_config(raw: dict[str, Any]) -> LlamaConfig:
    """The head's one decoder layer as a Llama config (the layout's own keys left out)."""
    fields = {k: v for k, v in raw.items() if k not in _NOT_LLAMA}
    return LlamaConfig(**(fields | {"num_hidden_layers": 1}))


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
        raise DrafterCheckpointError(
            f"{directory}: unexpected weights {foreign[:6]}; an EAGLE-1/2 head has fc.* and "
            "layers.0.* (plus optional embed_tokens/norm/d2t), an EAGLE-3 head fc.*, "
            "midlayer.* and norm.*"
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


def _check_fits3(
    directory: Path,
    config: LlamaConfig,
    layers: tuple[int, ...],
    weights: dict[str, torch.Tensor],
    target: Any,
) -> None:
    foreign = [
        k
        for k in weights
        if not (k.startswith(("fc.", "midlayer.")) or k == "norm.weight" or k in _OPTIONAL3)
    ]
    if foreign:
        raise DrafterCheckpointError(
            f"{directory}: unexpected weights {foreign[:6]} in an EAGLE-3 head (fc.*, "
            "midlayer.*, norm.weight, optional lm_head/embed_tokens/d2t/t2d)"
        )
    if "fc.weight" not in weights:
        raise DrafterCheckpointError(f"{directory}: no fc.weight; this is not an EAGLE head")
    h, ht, n = config.hidden_size, target.hidden_size, target.num_hidden_layers
    problems = []
    outside = [i for i in layers if not 0 <= i < n]
    if outside:
        problems.append(
            f"it reads the inputs of layers {list(layers)} (outputs of "
            f"{[i - 1 for i in layers]}) but the target has {n} layers"
        )
    fc = tuple(weights["fc.weight"].shape)
    if fc != (h, len(layers) * ht):
        problems.append(
            f"fc.weight is {fc}, needs ({h}, {len(layers) * ht}) for {len(layers)} target "
            f"layers of width {ht}"
        )
    if config.vocab_size != target.vocab_size:
        problems.append(f"vocab size {config.vocab_size} != target's {target.vocab_size}")
    emb = weights.get("embed_tokens.weight")
    if emb is None and h != ht:
        problems.append(f"hidden size {h} != target's {ht} and no embed_tokens of its own")
    elif emb is not None and tuple(emb.shape) != (target.vocab_size, h):
        problems.append(f"embed_tokens.weight is {tuple(emb.shape)}")
    head, d2t = weights.get("lm_head.weight"), weights.get("d2t")
    if head is None and h != ht:
        problems.append(f"hidden size {h} != target's {ht} and no lm_head of its own")
    if head is not None and head.shape[-1] != h:
        problems.append(f"lm_head.weight is {tuple(head.shape)}, its width must be {h}")
    if d2t is None and head is not None and head.shape[0] != target.vocab_size:
        problems.append(
            f"lm_head.weight has {head.shape[0]} rows but no d2t says which target tokens"
        )
    if d2t is not None:
        if head is None or d2t.numel() != head.shape[0]:
            problems.append(
                f"d2t has {d2t.numel()} entries for an lm_head of "
                f"{None if head is None else head.shape[0]} rows"
            )
        elif int((d2t.long() + torch.arange(d2t.numel())).max()) >= target.vocab_size:
            problems.append("d2t maps draft tokens past the target's vocabulary")
    if problems:
        raise DrafterCheckpointError(
            f"EAGLE-3 drafter {str(directory)!r} does not fit the target model: "
            f"{'; '.join(problems)}. Use a head trained for this model "
            "(`sessionserve train-drafter --arch eagle3 --model ...`)"
        )
