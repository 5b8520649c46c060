"""Tiny random-weight models built from configs (no downloads), shared by tests and benchmarks."""

from __future__ import annotations

import copy
import os
from typing import Literal

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from sessionserve.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SessionConfig,
    SpecConfig,
)
from sessionserve.replicas.engine import Engine
from sessionserve.replicas.loader import LoadedModel

VOCAB = 256
EOS = 1
_SHAPE = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
}
ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM),
}
# Gemma 3's layout in small: sliding layers (window 8) around a full-attention one, one KV
# head, its query pre-scaling; transformers' Gemma 3 code unchanged (RoPE bases per layer kind,
# scaled embeddings, tied head)
GEMMA3_SHAPE = {
    "num_hidden_layers": 3,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "sliding_window": 8,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    "query_pre_attn_scalar": 16,
}


def engine_device() -> str:
    """Where engine tests put their models: `pytest --device cuda` (default cpu)."""
    return os.environ.get("SESSIONSERVE_TEST_DEVICE", "cpu")


def word_tokenizer() -> PreTrainedTokenizerFast:
    """Token i is the word `w{i}` (0 is <unk>, 1 is </s>): readable text, exact decode."""
    # 0 and 1 get names that are no prefix of a word: special tokens match inside raw text
    vocab = {f"w{i}": i for i in range(VOCAB)} | {"<unk>": 0, "</s>": EOS}
    del vocab["w0"], vocab[f"w{EOS}"]
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>")
    # each message: w2 <content words> w3; the generation prompt is w4
    fast.chat_template = (
        "{% for m in messages %}w2 {{ m['content'] }} w3 {% endfor %}"
        "{% if add_generation_prompt %}w4{% endif %}"
    )
    return fast


BYTE_EOS = 256


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level (GPT-2 style) with no merges: token i < 256 is one byte, 256 is EOS. Any
    text, JSON included, is expressible: what grammar-constrained tests need."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)} | {"<|eos|>": BYTE_EOS}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|eos|>")
    fast.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    return fast


def save_tiny_model(directory, seed: int = 0, **shape) -> None:
    """A tiny model and its tokenizer as a local HF directory (what a replica loads)."""
    tiny_model(seed=seed, **shape).save_pretrained(directory)
    word_tokenizer().save_pretrained(directory)


def tiny_model(arch: str = "llama", seed: int = 0, init_std: float = 0.08, **shape):
    """A 2-layer model whose logits are peaked enough that greedy ties do not happen."""
    config_cls, model_cls = ARCHS[arch]
    torch.manual_seed(seed)
    base = _SHAPE | (GEMMA3_SHAPE if arch == "gemma3" else {}) | {"eos_token_id": EOS}
    cfg = config_cls(**(base | shape), initializer_range=init_std)
    model = model_cls(cfg).eval()
    if arch == "gemma3":  # its norms start at zero (scale 1 + w): make them differ per layer
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.normal_(0.0, 0.1)
    model.generation_config.eos_token_id = cfg.eos_token_id
    return model


def tiny_engine(
    model=None,
    *,
    page_size: int = 16,
    num_slots: int = 4096,
    max_rows: int = 32,
    max_context_len: int = 1024,
    prefill: int = 512,
    prefill_batch_tokens: int | str | None = "auto",
    retract_every: int | None = None,
    radix: bool = True,
    backend: str = "torch",
    drafter=None,
    num_drafts: int = 4,
    tree_topk: int = 1,
    tree_budget: int = 8,
    history_drafts: bool = False,
    history_min_match: int = 2,
    adaptive: bool = False,
    min_draft_confidence: float = 0.0,
    carried_catch_up_mib: float = 64.0,
    device: str | None = None,
    cuda_graphs: bool = True,
    memory_check: str = "every_step",
    memory_check_period_s: float = 10.0,
    tokenizer=None,
    sliding_window_kv: bool = True,
    sliding_slots: int | None = None,
    kv_dtype: str = "auto",
    compile: bool | str = False,
    compile_prefill: bool | str = "auto",
    compile_prefill_dtype: str = "auto",
    compile_decode: bool | str = "auto",
    compile_prefill_min_tokens: int | None = None,
    compile_cache_dir: str | None = None,
    overlap: bool | Literal["auto"] = False,
    metrics=None,
    reclaim_sessions_at_limit: bool = False,
    seed: int | None = None,
    **session_kw,
) -> Engine:
    """An engine (checking memory every step unless told otherwise) around a (copy of a) tiny
    model, on `device` (default: the test device). `drafter`: a function making an EAGLE head
    for the copied model (e.g. `mimic_drafter`), to speculate (`tree_topk` > 1: trees of
    `tree_budget` drafts). `history_drafts`: draft from each sequence's own history too;
    `adaptive`: the online drafting policy (off here, so a test's drafts do not depend on
    timing); `min_draft_confidence`: 0 here, so the head's chains are full (a tiny random
    head is rarely confident). `overlap`: `engine.overlap_schedule`. `metrics`,
    `reclaim_sessions_at_limit`: as `Engine` takes them (a served replica's exporter; its
    session reclaiming). `kv_dtype`: `cache.kv_dtype`. `seed`: `engine.seed`."""
    device = device or engine_device()
    model = copy.deepcopy(model) if model is not None else tiny_model()
    head = drafter(model) if drafter is not None else None  # built on CPU, moved with it
    model = model.to(device)
    head = head.to(device) if head is not None else None
    cfg = EngineConfig(
        model=ModelConfig(device=device),
        cache=CacheConfig(
            page_size=page_size,
            num_slots=num_slots,
            max_rows=max_rows,
            max_context_len=max_context_len,
            radix_cache=radix,
            sliding_window_kv=sliding_window_kv,
            sliding_slots=sliding_slots,
            kv_dtype=kv_dtype,
        ),
        scheduler=SchedulerConfig(
            max_prefill_tokens=prefill,
            force_retract_every=retract_every,
            prefill_batch_tokens=prefill_batch_tokens,
        ),
        sessions=SessionConfig(**session_kw),
        spec=SpecConfig(
            num_drafts=num_drafts,
            tree_topk=tree_topk,
            tree_budget=tree_budget,
            history_drafts=history_drafts,
            history_min_match=history_min_match,
            adaptive=adaptive,
            min_draft_confidence=min_draft_confidence,
            carried_catch_up_mib=carried_catch_up_mib,
        ),
        attention_backend=backend,
        cuda_graphs=cuda_graphs,
        memory_check=memory_check,
        memory_check_period_s=memory_check_period_s,
        seed=seed,
        compile=compile,
        compile_prefill=compile_prefill,
        compile_prefill_dtype=compile_prefill_dtype,
        compile_decode=compile_decode,
        compile_prefill_min_tokens=compile_prefill_min_tokens,
        compile_cache_dir=compile_cache_dir,
        overlap_schedule=overlap,
    )
    tokenizer = tokenizer or word_tokenizer()
    loaded = LoadedModel(model, tokenizer, "tiny", "tests")
    return Engine(
        cfg,
        loaded,
        metrics=metrics,
        drafter=head,
        reclaim_sessions_at_limit=reclaim_sessions_at_limit,
    )


def session_turns(engine, turns: list[list[int]], sampled) -> list[tuple]:
    """One session's turns through `engine` (the strict memory check after each): each
    turn's (output ids, cached tokens)."""
    sid, history, outs = engine.open_session(), [], []
    for turn in turns:
        history += turn
        (r,) = engine.generate([history], sampled, session_id=sid)
        history += r.output_ids
        outs.append((r.output_ids, r.cached_tokens))
        engine.check_memory()
    return outs


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own generate, the reference for token-exact comparisons."""
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def over_rounded_kv(model, kv_dtype: torch.dtype):
    """`cache.kv_dtype`'s reference: a copy of `model` whose attention reads every K/V
    rounded to `kv_dtype` (transformers' SDPA behind that rounding, registered with its
    `AttentionInterface`)."""
    reference = copy.deepcopy(model)
    reference.set_attn_implementation(kv_rounded_attention(kv_dtype))
    return reference


def kv_rounded_attention(kv_dtype: torch.dtype) -> str:
    """The name of transformers' SDPA attention over K/V rounded to `kv_dtype`, registered
    with its SDPA mask too (without, a forward over a whole sequence builds no sliding
    window for a name transformers does not know)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def attend(module, query, key, value, *args, **kwargs):  # noqa: ANN001, ANN202
        key, value = key.to(kv_dtype).to(key.dtype), value.to(kv_dtype).to(value.dtype)
        return sdpa_attention_forward(module, query, key, value, *args, **kwargs)

    name = f"sdpa_kv_{str(kv_dtype).removeprefix('torch.')}"
    AttentionInterface.register(name, attend)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


def mimic_drafter(model, noise: float = 0.0, seed: int = 0):
    """An EAGLE head that imitates a one-layer target: `fc` passes the token embedding, the
    layer and final norm are the target's. It sees the context shifted by one token (no
    first token), so it agrees with the target often but not always; `noise` perturbs it
    further. Acceptance is then high and uneven, what the speculative tests need."""
    from sessionserve.replicas.speculative.drafter import EagleDrafter, drafter_config

    if model.config.num_hidden_layers != 1:
        raise ValueError("mimic_drafter needs a one-layer target (tiny_model(num_hidden_layers=1))")
    drafter = EagleDrafter(drafter_config(model.config), fc_bias=False, final_norm=True)
    drafter.layers[0].load_state_dict(model.model.layers[0].state_dict())
    drafter.norm.load_state_dict(model.model.norm.state_dict())
    h = model.config.hidden_size
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        drafter.fc.weight.zero_()
        drafter.fc.weight[:, :h] = torch.eye(h)
        for p in drafter.layers.parameters():
            p.add_(noise * torch.randn(p.shape, generator=gen))
    return drafter.eval().attach(model)


def random_drafter(model, seed: int = 0):
    """An untrained EAGLE head for any tiny target (acceptance near zero)."""
    from sessionserve.replicas.speculative.drafter import EagleDrafter, drafter_config

    torch.manual_seed(seed)
    cfg = drafter_config(model.config, initializer_range=0.08)
    drafter = EagleDrafter(cfg)
    for m in drafter.modules():
        if isinstance(m, torch.nn.Linear):
            torch.nn.init.normal_(m.weight, std=0.08)
    return drafter.eval().attach(model)
