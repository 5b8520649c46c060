"""EAGLE-3 heads (speculative/eagle3.py): the published layout loads, drafts what an
independent dense reference of that layout drafts (three target layers fused by `fc`, the
mid-layer over [embedding; hidden], the pre-norm output fed back, its own draft vocabulary),
keeps the plain engine's greedy output, and checkpoints that do not fit fail with what does
not match."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from sessionserve.replicas.speculative.checkpoint import (
    DrafterCheckpointError,
    load_drafter,
    save_drafter,
)
from sessionserve.replicas.speculative.drafter import drafter_config
from sessionserve.replicas.speculative.eagle3 import Eagle3Drafter, default_feature_layers
from sessionserve.wire import SamplingParams
from tests.models import hf_greedy, tiny_engine, tiny_model

LAYERS = 5  # default feature layers (2, 2, 2): give them distinct ones via the config
AUX_IDS = [0, 2, 3]  # layer outputs -> `output_hidden_states` indices 1, 3, 4
GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
PROMPTS = [[4, 8, 15, 16, 23, 42], [7, 7, 9, 30, 31, 2, 5, 99, 12]]


def target():
    return tiny_model(num_hidden_layers=LAYERS, seed=5)


def write_published_head(directory: Path, model, *, seed: int = 0, **edit) -> Path:
    """An EAGLE-3 head in the layout published checkpoints use (as SGLang and vLLM load it):
    `LlamaForCausalLMEagle3`, `midlayer.*`, its own `lm_head` over a draft vocabulary with
    `d2t` offsets and a `t2d` mask, random weights (std 0.1, so drafts are not ties)."""
    gen = torch.Generator().manual_seed(seed)
    h, v = model.config.hidden_size, model.config.vocab_size
    cfg = drafter_config(model.config)
    hd, nh, nkv, inter = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, 128
    cfg.intermediate_size = inter
    draft = torch.arange(3, v, 2)  # every other token (odd ids)
    rnd = lambda *shape: torch.randn(*shape, generator=gen) * 0.1  # noqa: E731
    ones = lambda n: 1 + rnd(n)  # noqa: E731
    state = {
        "fc.weight": rnd(h, 3 * h),
        "midlayer.self_attn.q_proj.weight": rnd(nh * hd, 2 * h),
        "midlayer.self_attn.k_proj.weight": rnd(nkv * hd, 2 * h),
        "midlayer.self_attn.v_proj.weight": rnd(nkv * hd, 2 * h),
        "midlayer.self_attn.o_proj.weight": rnd(h, nh * hd),
        "midlayer.mlp.gate_proj.weight": rnd(inter, h),
        "midlayer.mlp.up_proj.weight": rnd(inter, h),
        "midlayer.mlp.down_proj.weight": rnd(h, inter),
        "midlayer.input_layernorm.weight": ones(h),
        "midlayer.hidden_norm.weight": ones(h),
        "midlayer.post_attention_layernorm.weight": ones(h),
        "norm.weight": ones(h),
        "lm_head.weight": rnd(draft.numel(), h) * 10,
        "d2t": draft - torch.arange(draft.numel()),
        "t2d": torch.zeros(v, dtype=torch.bool).index_fill_(0, draft, True),
    }
    config = cfg.to_dict() | {
        "architectures": ["LlamaForCausalLMEagle3"],
        "draft_vocab_size": draft.numel(),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": AUX_IDS},
    }
    for key, value in edit.items():
        if key.startswith("cfg_"):
            config[key[4:]] = value
        elif value is None:
            state.pop(key)
        else:
            state[key] = value
    directory.mkdir(parents=True, exist_ok=True)
    save_file(state, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config))
    return directory


# ---- an independent reference of the layout: plain tensor math over the whole sequence ----
def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def reference_step(model, w: dict, cfg, ids: list[int], hidden: torch.Tensor) -> torch.Tensor:
    """EAGLE-3's mid-layer and final residual over a whole sequence (causal) of entries
    (token, fused hidden [h]), from the checkpoint's tensors: the pre-norm outputs [T, h]."""
    eps = cfg.rms_norm_eps
    emb = model.get_input_embeddings().weight[torch.tensor(ids)]
    x = torch.cat(
        (
            _rms(emb, w["midlayer.input_layernorm.weight"], eps),
            _rms(hidden, w["midlayer.hidden_norm.weight"], eps),
        ),
        -1,
    )
    t, hd = len(ids), cfg.head_dim
    proj = lambda name: (x @ w[f"midlayer.self_attn.{name}.weight"].T).view(t, -1, hd)  # noqa: E731
    q, k, v = (proj(n).transpose(0, 1)[None] for n in ("q_proj", "k_proj", "v_proj"))
    inv = 1.0 / (cfg.rope_parameters["rope_theta"] ** (torch.arange(0, hd, 2).float() / hd))
    freqs = torch.arange(t).float()[:, None] * inv[None]
    cos, sin = torch.cat((freqs, freqs), -1).cos()[None], torch.cat((freqs, freqs), -1).sin()[None]
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)[0].transpose(0, 1)
    residual = hidden + attn.reshape(t, -1) @ w["midlayer.self_attn.o_proj.weight"].T
    y = _rms(residual, w["midlayer.post_attention_layernorm.weight"], eps)
    mlp = (
        F.silu(y @ w["midlayer.mlp.gate_proj.weight"].T) * (y @ w["midlayer.mlp.up_proj.weight"].T)
    ) @ w["midlayer.mlp.down_proj.weight"].T
    return residual + mlp


def reference_chain(model, directory: Path, tokens: list[int], n: int) -> list[int]:
    """The `n` drafts after `tokens` (whose last token is not yet in the target's KV): the
    target's layer inputs at indices 1, 3, 4 captured by pre-hooks (not transformers' output
    capturing), then one step at a time, each draft's pre-norm output fed back."""
    from safetensors.torch import load_file

    w = load_file(str(directory / "model.safetensors"))
    cfg = drafter_config(model.config)
    captured: dict[int, torch.Tensor] = {}
    layers = model.get_decoder().layers
    hooks = [
        layers[i].register_forward_pre_hook(lambda m, a, i=i: captured.__setitem__(i, a[0][0]))
        for i in (1, 3, 4)
    ]
    try:
        with torch.no_grad():
            model(torch.tensor([tokens[:-1]]))
    finally:
        for hook in hooks:
            hook.remove()
    hidden = torch.cat([captured[1], captured[3], captured[4]], -1) @ w["fc.weight"].T
    ids, drafts = list(tokens[1:]), []
    with torch.no_grad():
        for _ in range(n):
            out = reference_step(model, w, cfg, ids, hidden)
            logits = _rms(out[-1], w["norm.weight"], cfg.rms_norm_eps) @ w["lm_head.weight"].T
            pick = int(logits.argmax())
            token = pick + int(w["d2t"][pick])
            drafts.append(token)
            # the next entry: the draft as token, the last pre-norm output as its hidden
            ids.append(token)
            hidden = torch.cat((hidden, out[-1:]))
    return drafts


def test_the_published_layout_drafts_what_a_dense_reference_drafts(tmp_path) -> None:
    model = target()
    head_dir = write_published_head(tmp_path / "eagle3", model)
    engine = tiny_engine(model, drafter=lambda m: load_drafter(head_dir, m), num_drafts=4)
    proposer = engine.speculative.eagle
    assert proposer.drafter.feature_layers == (1, 3, 4)
    seen: list[tuple[list[int], list[int]]] = []
    inner = proposer.propose

    def recording(reqs, lengths):
        chains = inner(reqs, lengths)
        seen.extend((list(r.tokens), c.tokens) for r, c in zip(reqs, chains, strict=True))
        return chains

    proposer.propose = recording
    engine.generate(PROMPTS, GREEDY)
    for prompt in PROMPTS:  # its first proposal: after the prefill and its first token
        tokens, chain = next((t, c) for t, c in seen if t[:-1] == prompt)
        assert len(chain) == 4
        assert chain == reference_chain(model, head_dir, tokens, len(chain))
    assert len({t for _, c in seen for t in c} & set(range(0, 256, 2))) == 0  # draft vocab only


def test_greedy_output_with_an_eagle3_head_is_the_targets(tmp_path) -> None:
    model = target()
    head_dir = write_published_head(tmp_path / "eagle3", model, seed=1)
    spec = tiny_engine(model, drafter=lambda m: load_drafter(head_dir, m), num_drafts=3)
    results = spec.generate(PROMPTS, GREEDY)
    for prompt, result in zip(PROMPTS, results, strict=True):
        assert result.output_ids == hf_greedy(model, prompt, GREEDY.max_tokens)
    assert spec.speculative.stats.steps > 0


def test_a_trained_head_saves_in_the_published_layout_and_loads_back(tmp_path) -> None:
    model = target()
    cfg = drafter_config(model.config)
    torch.manual_seed(0)
    head = Eagle3Drafter(cfg, (1, 3, 4), draft_vocab=torch.arange(10, 200)).attach(model)
    save_drafter(head, tmp_path / "saved", target="tiny")
    raw = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLMEagle3"]
    assert raw["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": AUX_IDS}
    assert raw["draft_vocab_size"] == 190
    loaded = load_drafter(tmp_path / "saved", model)
    assert isinstance(loaded, Eagle3Drafter) and loaded.feature_layers == (1, 3, 4)
    for key, value in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    assert torch.equal(loaded.draft_ids, torch.arange(10, 200))


def test_default_feature_layers_are_eagle3s() -> None:
    assert default_feature_layers(32) == (2, 16, 29)  # Llama-3.1-8B: inputs of 2, 16, 29


def test_eagle3_heads_that_do_not_fit_say_what_does_not_match(tmp_path) -> None:
    model = target()
    h = model.config.hidden_size
    cases = {
        "layers": (
            {"cfg_eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 2, 7]}},
            r"outputs of \[0, 2, 7\]\) but the target has 5 layers",
        ),
        "fc": (
            {"fc.weight": torch.zeros(h, 2 * h)},
            r"fc.weight is \(64, 128\), needs \(64, 192\)",
        ),
        "d2t": ({"d2t": torch.zeros(10, dtype=torch.long)}, "d2t has 10 entries"),
        "no_d2t": ({"d2t": None}, "no d2t says which target tokens"),
        "foreign": ({"layers.0.mlp.up_proj.weight": torch.zeros(1)}, "unexpected weights"),
        "missing": ({"midlayer.hidden_norm.weight": None}, "missing.*hidden_norm"),
    }
    for name, (edit, message) in cases.items():
        head_dir = write_published_head(tmp_path / name, model, **edit)
        with pytest.raises(DrafterCheckpointError, match=message):
            load_drafter(head_dir, model)
    # the default layers of a 2-layer target (2, 1, -1) do not exist
    small = tiny_model(seed=5)
    head_dir = write_published_head(tmp_path / "small", small, cfg_eagle_config=None)
    with pytest.raises(DrafterCheckpointError, match="the target has 2 layers"):
        load_drafter(head_dir, small)


def test_the_exported_forward_returns_the_heads_layers(tmp_path) -> None:
    """What `engine.compile` packages (`_DecoderAndHead` through `torch.export`; AOTInductor
    then compiles that program) returns the three layers' states too: run as the engine's
    forward, it gives the eager engine's proposals and tokens. (The AOTInductor build itself
    is exercised for plain heads in test_compiled_forward.py; ~45 s per build on 2 cores.)"""
    model = target()
    head_dir = write_published_head(tmp_path / "eagle3", model)
    runs, calls = [], []
    for exported in (False, True):
        engine = tiny_engine(model, drafter=lambda m: load_drafter(head_dir, m))
        if exported:
            engine.runner.compiled = exported_forward(engine.runner, calls)
        proposals = record_proposals(engine)
        outputs = [r.output_ids for r in engine.generate(PROMPTS, GREEDY)]
        runs.append((outputs, proposals))
    assert runs[1] == runs[0]
    assert len(runs[0][1]) > 5 and len(calls) > 5  # proposals made, forwards run exported


def exported_forward(runner, calls: list):
    """`_DecoderAndHead` through `torch.export`, standing in for its compiled package (each
    call counted in `calls`)."""
    from sessionserve.replicas import compiled_forward

    module = compiled_forward._DecoderAndHead(runner.model, runner.feature_layers).eval()
    tokens = torch.export.Dim("tokens", min=1, max=64)
    rows = torch.export.Dim("rows", min=1, max=64)
    example = (torch.zeros(2, dtype=torch.int64), torch.arange(2), torch.arange(2))
    with torch.inference_mode():
        program = torch.export.export(
            module, example, dynamic_shapes=({0: tokens}, {0: tokens}, {0: rows})
        )
    fn = program.module()
    forward = compiled_forward.CompiledForward.__new__(compiled_forward.CompiledForward)
    forward.package, forward.max_tokens, forward.min_tokens = None, 64, 1
    forward._fn = lambda *args: (calls.append(1), fn(*args))[1]
    return forward


def record_proposals(engine) -> list[list[list[int]]]:
    """Each `propose` call's chains, as they are made."""
    seen: list[list[list[int]]] = []
    inner = engine.speculative.eagle.propose

    def recording(reqs, lengths):
        chains = inner(reqs, lengths)
        seen.append([c.tokens for c in chains])
        return chains

    engine.speculative.eagle.propose = recording
    return seen
