"""`sessionserve train-drafter`: an EAGLE or EAGLE-3 head for a target model, trained on a CPU.

Self-distillation in three phases, each resumable from files in the output directory:
1. generate: the target writes `self_prompts` user turns of its own (sampled from its chat
   template's empty user turn, as Magpie does: diverse prompts no file has to ship), then
   answers them and the shipped prompts (greedy, through our own engine, batched, in the
   dtype it serves in); the token sequences go to `dataset.pt`.
2. features: one target forward per sequence (in that dtype too: the head learns the states
   and greedy tokens it will meet when served; in fp32 where this CPU's fp32 GEMMs are the
   faster, as the served prefill package's layers are) gives the hidden states the head learns from
   (recomputed on resume: cheaper than storing them): the last one for EAGLE, three layers'
   concatenated for EAGLE-3.
3. train: from `(x[q+1], h[q])` the head learns token `x[q+2]` (cross-entropy over the draft
   vocabulary against the target's `soft_labels` likeliest tokens there and their
   probabilities, as EAGLE's loss uses the target's distribution; with 0, its greedy token)
   and, for EAGLE, also `h[q+1]` (smooth L1; an EAGLE-3 head's output is its own, not a
   target state, so only tokens teach it). `unroll` chain steps are trained, step 2+
   feeding the head its own output as serving does (EAGLE-3's training-time test); a
   batch of sequences goes through the head at once, its products in bf16 where the
   features phase's were; `train_state.pt` holds the optimizer and position every few
   steps, so an interrupted run continues where it stopped.
The result is a checkpoint in the published layout (`config.json`, `model.safetensors`).
"""

from __future__ import annotations

import itertools
import logging
import math
import random
import time
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from sessionserve.errors import InvalidConfigError
from sessionserve.replicas.hidden_states import decoder_features
from sessionserve.replicas.speculative.checkpoint import save_drafter
from sessionserve.replicas.speculative.drafter import DraftHead, EagleDrafter, drafter_config
from sessionserve.replicas.speculative.eagle3 import Eagle3Drafter, default_feature_layers

log = logging.getLogger(__name__)
DATASET = "dataset.pt"
STATE = "train_state.pt"
ARCHS = ("eagle", "eagle3")
FEATURE_BATCH_TOKENS = 4096  # tokens (padding included) per forward of the features phase
REFILL = 16  # generation: prompts handed to the engine at a time (`_run`)
FEATURE_GEMM_ROWS = 1024  # rows of the GEMMs timed to pick the features phase's dtype
LENGTH_POOL = 16  # training: batches' worth of sequences sorted by length together


@dataclass(frozen=True)
class TrainConfig:
    model: str = "default"
    out: str = "drafters/default"
    arch: str = "eagle"  # "eagle" (EAGLE-1/2 layout) or "eagle3"
    prompts: str | None = None  # a text file, one prompt per line; None = the shipped set
    max_prompts: int | None = None  # the first N of them (0: none, only self-written ones)
    # user turns the target writes itself, answered too: more varied than the shipped set,
    # which raised the head's tokens a verify on unseen prompts 4-7% (docs/benchmarks.md)
    self_prompts: int = 800
    max_new_tokens: int = 128
    sampled_answers: int = 0  # per prompt, at temperature 0.7, besides the greedy one
    dtype: str = "auto"  # the target's, for the text, hidden states and labels (as served)
    # 8 passes over the text: training in batches and bf16 made room, and the head read 3.5%
    # more tokens a verify than after 4 (docs/benchmarks.md); twice the text
    # (`sampled_answers=1`) over 4 passes read 5.7% more, in ~26-28 min on a bf16 CPU
    epochs: int = 8
    unroll: int = 2  # chain steps trained (step 2+ feeds the head its own output)
    lr: float = 2e-3
    batch_seqs: int = 8  # sequences per optimizer step
    draft_vocab: int = 8192  # 0 = the whole vocabulary
    token_loss_weight: float = 0.3
    noise: float = 0.2  # Gaussian noise on input hidden states, relative to their RMS
    # the target's k likeliest next tokens and their probabilities teach each draft (EAGLE's
    # loss over the target's distribution; 8: +2.5%, 32: +4% tokens a verify over the greedy
    # token alone, docs/benchmarks.md); 0: its greedy token alone
    soft_labels: int = 32
    threads: int | None = None
    seed: int = 0
    save_every: int = 25  # optimizer steps between resumable train states


def shipped_prompts() -> list[str]:
    text = resources.files("sessionserve.training").joinpath("data/train_prompts.txt")
    return [line for line in text.read_text().splitlines() if line.strip()]


def train_drafter(cfg: TrainConfig) -> DraftHead:
    """Run (or resume) all phases; writes the checkpoint to `cfg.out` and returns the head
    (attached to its target, eval mode)."""
    from sessionserve.replicas.loader import load_model

    if cfg.arch not in ARCHS:
        raise InvalidConfigError(f"--arch {cfg.arch!r}: choose one of {', '.join(ARCHS)}")
    if cfg.self_prompts < 0 or cfg.sampled_answers < 0:
        raise InvalidConfigError("--self-prompts and --sampled-answers count prompts: >= 0")
    if cfg.soft_labels < 0:
        raise InvalidConfigError("--soft-labels counts tokens a position keeps: >= 0")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    loaded = load_model(cfg.model)  # fp32: the head trains beside it (its embedding, LM head)
    model = loaded.model
    served = _in_serving_dtype(cfg, loaded)
    print(
        f"target {loaded.name}: loaded in {time.monotonic() - t0:.1f} s; its answers written "
        f"in {str(served.model.dtype).removeprefix('torch.')}; output in {out}"
    )
    seqs, vocab = _dataset(cfg, out, served)
    layers = (
        default_feature_layers(model.config.num_hidden_layers) if cfg.arch == "eagle3" else None
    )
    if layers is not None and not all(0 <= i < model.config.num_hidden_layers for i in layers):
        raise InvalidConfigError(
            f"EAGLE-3 reads the target's layers {list(layers)}: it needs at least 3 layers"
        )
    torch.manual_seed(cfg.seed)  # the head's initial weights
    if layers is None:
        drafter: DraftHead = initial_drafter(model, vocab)
    else:
        drafter = initial_eagle3(model, vocab, layers)
    features_from = _feature_model(served.model, model)
    feats, labels, soft = target_features(
        features_from,
        seqs,
        layers,
        (drafter.draft_ids, cfg.soft_labels) if cfg.soft_labels else None,
    )
    matmuls = next(features_from.parameters()).dtype  # bf16 where its GEMMs are the faster
    _train(cfg, out, drafter, model, seqs, feats, labels, soft, matmuls)
    meta = {
        "target": loaded.name,
        "train_config": asdict(cfg),
        "sequences": len(seqs),
        "tokens": sum(len(s) for s in seqs),
        "train_seconds": round(time.monotonic() - t0, 1),
    }
    save_drafter(drafter, out, **meta)
    kind = "EAGLE-3" if layers is not None else "EAGLE"
    print(f"wrote the {kind} head to {out} ({time.monotonic() - t0:.0f} s in all)")
    print(f"serve with it: engine.spec.drafter_path: {out.resolve()}")
    return drafter


def _in_serving_dtype(cfg: TrainConfig, loaded: Any) -> Any:
    """The target in `cfg.dtype`, which generates the text and gives the hidden states and
    labels: the head then learns what it will meet when served in that dtype (and bf16 runs
    ~1.5-2x faster than fp32 on a CPU with AMX). `loaded` itself where that is fp32."""
    from sessionserve.config import ModelConfig
    from sessionserve.replicas.loader import load_model

    try:
        dtype = ModelConfig(path=cfg.model, dtype=cfg.dtype).torch_dtype()  # type: ignore[arg-type]
    except ValueError as e:
        raise InvalidConfigError(f"--dtype {cfg.dtype!r}: auto, float32 or bfloat16") from e
    return loaded if dtype == loaded.model.dtype else load_model(cfg.model, dtype=dtype)


# ---- phase 1: responses ----
def _dataset(cfg: TrainConfig, out: Path, loaded: Any) -> tuple[list[list[int]], torch.Tensor]:
    path = out / DATASET
    prompts = _prompts(cfg)
    made_for: dict[str, Any] = {
        "target": loaded.name,
        "prompts": len(prompts),
        "max_new_tokens": cfg.max_new_tokens,
        "sampled_answers": cfg.sampled_answers,
        "draft_vocab": cfg.draft_vocab,
    }
    # (a dataset saved before these options existed resumes as it was made: --self-prompts 0
    # --sampled-answers 1 --dtype float32, its train state with --epochs 5)
    if cfg.self_prompts:
        made_for |= {"self_prompts": cfg.self_prompts, "seed": cfg.seed}
    if loaded.model.dtype != torch.float32:
        made_for["dtype"] = str(loaded.model.dtype).removeprefix("torch.")
    if path.exists():
        data = torch.load(path, weights_only=True)
        _same_run(path, data.get("made_for"), made_for)
        print(f"generate: reusing {len(data['seqs'])} sequences from {path}")
        return data["seqs"], data["vocab"]
    if not prompts and not cfg.self_prompts:
        raise InvalidConfigError("no prompts to answer: --max-prompts 0 needs --self-prompts N")
    seqs = _generate(cfg, loaded, prompts)
    vocab = _draft_vocab(seqs, loaded.model.config.vocab_size, cfg.draft_vocab, loaded)
    torch.save({"seqs": seqs, "vocab": vocab, "made_for": made_for}, path)
    return seqs, vocab


def _same_run(path: Path, saved: Any, wanted: dict[str, Any]) -> None:
    """Resuming only makes sense with the settings the saved work was made with."""
    if saved != wanted:
        raise InvalidConfigError(
            f"{path} was made with {saved}, this run asks for {wanted}: re-run with the same "
            "options to resume, or choose another --out (or delete the file) to start afresh"
        )


def _prompts(cfg: TrainConfig) -> list[str]:
    if cfg.prompts:
        p = Path(cfg.prompts).expanduser()
        if not p.is_file():
            raise InvalidConfigError(f"--prompts {str(p)!r} is not a file (one prompt per line)")
        prompts = [line for line in p.read_text().splitlines() if line.strip()]
    else:
        prompts = shipped_prompts()
    if not prompts:
        raise InvalidConfigError("the prompt file has no prompts")
    return prompts[: cfg.max_prompts] if cfg.max_prompts is not None else prompts


def _generate(cfg: TrainConfig, loaded: Any, prompts: list[str]) -> list[list[int]]:
    """The sequences to learn from: a chat-templated prompt and the target's answer each."""
    from sessionserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from sessionserve.replicas.engine import Engine
    from sessionserve.wire import SamplingParams

    tok = loaded.tokenizer
    # decode steps of up to 48 rows through the 4-bit package where the model has one (a
    # bf16 model read from a GGUF): 2.9x the eager forward's tokens a second on 2 cores, its
    # first build ~2 min (docs/benchmarks.md); every other model's steps eager, as before
    packaged = _has_4bit_package(loaded)
    if packaged:
        print(
            "generate: loading the 4-bit decode step package for the answers (its first "
            "build takes ~2 min on 2 cores; cached after)"
        )
    t0 = time.monotonic()
    engine = Engine(
        EngineConfig(
            cache=CacheConfig(num_slots=32768, max_rows=80),
            # prompts handed over together start together (`_run`), in one wider step
            scheduler=SchedulerConfig(
                max_running_requests=48, max_prefill_tokens=1024, prefill_batch_tokens=None
            ),
            compile=packaged,
            gguf_int4_decode_only=True,
        ),
        loaded,
    )
    if packaged:
        ready = engine.runner.compiled_int4_decode is not None
        print(
            f"generate: the 4-bit decode step package {'ready' if ready else 'unavailable'} "
            f"in {time.monotonic() - t0:.0f} s{'' if ready else ' (answers run eagerly)'}"
        )
    if cfg.self_prompts:
        prompts = prompts + _self_prompts(engine, tok, cfg.self_prompts, cfg.seed, set(prompts))
    if not prompts:
        raise InvalidConfigError("no prompts to answer: give a prompt file (--prompts FILE)")
    inputs = [_chat_ids(tok, p) for p in prompts]
    # greedy answers are what greedy serving meets; sampled ones widen the data (labels are
    # the target's argmax either way, see `target_features`)
    jobs = [(ids, SamplingParams(max_tokens=cfg.max_new_tokens, temperature=0)) for ids in inputs]
    for n in range(cfg.sampled_answers):
        jobs += [
            (
                ids,
                SamplingParams(
                    max_tokens=cfg.max_new_tokens, temperature=0.7, seed=n * 100_003 + i
                ),
            )
            for i, ids in enumerate(inputs)
        ]
    answers = _run(engine, jobs, "answers")
    return [ids + answer.output_ids for (ids, _), answer in zip(jobs, answers, strict=True)]


def _has_4bit_package(loaded: Any) -> bool:
    """Whether the engine could run `loaded`'s decode steps through the 4-bit package (a bf16
    model read from a GGUF, on a CPU; `compiled_decode.plan_int4_decode_compile` decides the
    rest, among it the CPU's VNNI): no other model builds anything for the answers."""
    from sessionserve.replicas import block_linear

    param = next(loaded.model.parameters())
    return (
        loaded.gguf is not None
        and param.device.type == "cpu"
        and param.dtype in block_linear.MODEL_DTYPES
    )


def _run(engine: Any, jobs: list[tuple[list[int], Any]], desc: str) -> list[Any]:
    """Every job through `engine` (batched by its scheduler), with a progress bar; their
    results in the jobs' order.

    Jobs are handed over REFILL at a time, once that many running ones have ended, not one
    as each ends: a step that starts a prompt is a prefill step, which the 4-bit decode
    package does not run, so a prompt joining the batch at every other step kept most steps
    off it; sixteen prompts at once cost one or two such steps (wider GEMMs, too)."""
    bar = tqdm(total=len(jobs), desc=desc, unit="seq", dynamic_ncols=True)
    done: dict[str, Any] = {}
    rids: list[str] = []
    most = engine.config.scheduler.max_running_requests
    generated = 0
    while len(rids) < len(jobs) or engine.has_work():
        if len(rids) < len(jobs) and len(rids) - len(done) <= most - min(REFILL, most):
            take = jobs[len(rids) : len(rids) + most - (len(rids) - len(done))]
            rids += [engine.submit(ids, params) for ids, params in take]
        for event in engine.step():
            generated += len(event.new_token_ids)
            if event.result is not None:
                done[event.rid] = event.result
                bar.update(1)
        bar.set_postfix(tokens=generated)
    bar.close()
    return [done[r] for r in rids]


def _self_prompts(engine: Any, tokenizer: Any, n: int, seed: int, taken: set[str]) -> list[str]:
    """`n` user turns sampled from the target itself: its chat template up to where a user's
    message begins, continued until the turn ends (Magpie's pre-query template). An
    instruction-tuned model writes varied requests there, and an answer to each is what the
    head meets when serving. Turns cut off at the length limit, empty ones and repeats are
    dropped, so a few fewer may come back. A model without a chat template (a base model)
    has no user turn to continue: none, with a line that says so."""
    from sessionserve.wire import FinishReason, SamplingParams

    if not getattr(tokenizer, "chat_template", None):
        print("self-prompts: none (the model has no chat template, so no user turn to write)")
        return []
    prefix, end = _user_turn_template(tokenizer)
    stop_ids = tokenizer.encode(end, add_special_tokens=False) if end else []
    special = set(getattr(tokenizer, "all_special_ids", []))
    by_token = len(stop_ids) > 0 and stop_ids[0] in special
    ids = tokenizer.encode(prefix, add_special_tokens=False)
    jobs = [
        (
            ids,
            SamplingParams(
                max_tokens=96,
                temperature=1.0,  # top_p 1: no per-row sort of the vocabulary (2x faster here)
                seed=seed * 1_000_003 + i,
                stop_token_ids=(stop_ids[0],) if by_token else (),
                stop=(end,) if end and not by_token else (),
            ),
        )
        for i in range(n)
    ]
    kept: list[str] = []
    for result in _run(engine, jobs, "self-prompts"):
        text = (result.text or "").strip()  # special tokens skipped, cut before a stop string
        if result.finish_reason == FinishReason.STOP and text and text not in taken:
            taken.add(text)
            kept.append(text)
    print(f"self-prompts: kept {len(kept)} of {n} (the rest ran past 96 tokens or repeated)")
    return kept


def _user_turn_template(tokenizer: Any) -> tuple[str, str]:
    """(the template's text before a user's message, the text that ends the message)."""
    marker = "\u2063SELF-PROMPT\u2063"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": marker}], add_generation_prompt=False, tokenize=False
    )
    prefix, _, after = text.partition(marker)
    return prefix, after.strip()


def _chat_ids(tokenizer: Any, prompt: str) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        return list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
        )
    return list(tokenizer.encode(prompt))


def _draft_vocab(seqs: list[list[int]], vocab_size: int, size: int, loaded: Any) -> torch.Tensor:
    """The `size` most frequent tokens of the data (plus special ones), sorted; all if 0."""
    if not size or size >= vocab_size:
        return torch.arange(vocab_size)
    counts = torch.bincount(torch.tensor([t for s in seqs for t in s]), minlength=vocab_size)
    special = [t for t in getattr(loaded.tokenizer, "all_special_ids", []) if t < vocab_size]
    counts[special] = counts.max() + 1
    vocab = torch.topk(counts.float(), size).indices.sort().values
    covered = counts[vocab].sum().item() / max(1, counts.sum().item())
    print(f"draft vocabulary: {size} of {vocab_size} tokens, covering {covered:.1%} of the data")
    return vocab


# ---- phase 2: target hidden states ----
def _feature_model(served: Any, fp32: Any) -> Any:
    """The target whose forward gives the hidden states and labels: the one in the serving
    dtype, or its fp32 copy (the one the head trains beside) where this CPU's fp32 GEMMs beat
    that dtype's by the margin at which the served prefill package computes its layers in
    fp32 too (`prefill_choice.time_gemms`, timed here in about a second). An Intel Xeon with
    AVX512-BF16 and no AMX took this phase in 4 min 14 s in fp32 against 5 min 37 s in bf16;
    states a bf16 rounding apart did not move what the head learns (docs/benchmarks.md)."""
    from sessionserve.replicas import prefill_choice

    param = next(served.parameters())
    if param.dtype == torch.float32 or param.device.type != "cpu":  # (served is then fp32)
        return served
    timing = prefill_choice.time_gemms(served, FEATURE_GEMM_ROWS)
    if not timing.float32_pays:
        return served
    print(
        f"features: in float32, whose GEMMs ran {timing.model_ms / timing.float32_ms:.2f}x as "
        f"fast as {timing.dtype}'s on this CPU"
    )
    return fp32


@dataclass
class SoftLabels:
    """The target's `k` likeliest next tokens within a draft vocabulary at each position of
    a sequence, and their probabilities renormalised over those `k`: EAGLE's loss teaches a
    draft the target's distribution, not only its argmax (`TrainConfig.soft_labels`)."""

    draft_ids: torch.Tensor  # (positions, k) int32, ids in the draft vocabulary
    probs: torch.Tensor  # (positions, k) float16, each row sums to 1


@torch.no_grad()
def target_features(
    model: Any,
    seqs: list[list[int]],
    layers: tuple[int, ...] | None,
    soft: tuple[torch.Tensor | None, int] | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[SoftLabels] | None]:
    """What the head reads at every position (the target's last hidden state after its final
    norm, or `layers`' states concatenated: what serving hands it, `decoder_features`), and
    the target's greedy next token there: what a draft must match to be accepted. With
    `soft` = (the draft vocabulary's target ids or None for all, k), also each sequence's
    `SoftLabels`, from the same logits (else None)."""
    model.set_attn_implementation("sdpa")  # the engine switched it to paged attention
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    # What the phase keeps goes into one buffer each, allocated up front; a sequence's share
    # is a view. Kept in tensors of their own, a sequence's small results sat between the
    # freed logits of ever longer sequences, and glibc reused none of that heap: with soft
    # labels ~15 MB a sequence, killed for memory at 1,600 of them (24 GiB).
    ends = list(itertools.accumulate(len(s) for s in seqs))
    spans = [slice(end - len(s), end) for s, end in zip(seqs, ends, strict=True)]
    total = ends[-1] if ends else 0
    feat_store = torch.empty(total, model.config.hidden_size * (len(layers) if layers else 1))
    label_store = torch.empty(total, dtype=torch.long)
    vocab, k = soft if soft is not None else (None, 0)
    k = min(k, model.config.vocab_size if vocab is None else vocab.numel())
    ids_store = torch.empty(total, k, dtype=torch.int32)
    probs_store = torch.empty(total, k, dtype=torch.float16)
    bar = tqdm(total=len(seqs), desc="features", unit="seq", dynamic_ncols=True)
    for batch in _length_batches(seqs, FEATURE_BATCH_TOKENS):
        # right-padded: under the causal mask a sequence's own positions never see the pad
        width = max(len(seqs[i]) for i in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        for row, i in enumerate(batch):
            ids[row, : len(seqs[i])] = torch.tensor(seqs[i])
        positions = torch.arange(width).expand(len(batch), width)
        last, feat = decoder_features(decoder, ids, positions, layers)
        for row, i in enumerate(batch):
            n, at = len(seqs[i]), spans[i]
            feat_store[at] = feat[row, :n]
            logits = head(last[row, :n])
            label_store[at] = logits.argmax(-1)
            if k:
                within = logits.float() if vocab is None else logits.float()[:, vocab]
                top, top_ids = within.topk(k, dim=-1)
                ids_store[at] = top_ids
                probs_store[at] = torch.softmax(top, dim=-1)
        bar.update(len(batch))
    bar.close()
    feats = [feat_store[at] for at in spans]
    labels = [label_store[at] for at in spans]
    if soft is None:
        return feats, labels, None
    return feats, labels, [SoftLabels(ids_store[at], probs_store[at]) for at in spans]


def _length_batches(seqs: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Indices of `seqs` grouped by length (little padding), at most `max_tokens` a batch."""
    batches: list[list[int]] = []
    for i in sorted(range(len(seqs)), key=lambda i: len(seqs[i])):
        if batches and (len(batches[-1]) + 1) * len(seqs[i]) <= max_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


# ---- phase 3: train ----
def initial_drafter(target: Any, vocab: torch.Tensor) -> EagleDrafter:
    """Start from the target's last layer and an `fc` that passes the hidden state through:
    at step 0 the head already behaves like a re-applied last layer, not like noise."""
    cfg = drafter_config(target.config)
    full = vocab.numel() == target.config.vocab_size
    drafter = EagleDrafter(cfg, draft_vocab=None if full else vocab)
    last = target.get_decoder().layers[-1]
    drafter.layers[0].load_state_dict(last.state_dict())
    h = cfg.hidden_size
    with torch.no_grad():  # residual branches off: the layer starts as the identity
        drafter.layers[0].self_attn.o_proj.weight.zero_()
        drafter.layers[0].mlp.down_proj.weight.zero_()
        drafter.fc.weight.normal_(0.0, 0.01)
        drafter.fc.weight[:, h:] += torch.eye(h)
        drafter.fc.bias.zero_()
    return _ready_to_train(drafter, target)


def initial_eagle3(target: Any, vocab: torch.Tensor, layers: tuple[int, ...]) -> Eagle3Drafter:
    """An EAGLE-3 head that starts as the logit lens of its deepest layer: `fc` passes that
    layer's state through, the mid-layer's residual branches are off (its attention and MLP
    start from the target's last layer, reading the hidden half), and the final norm and
    `lm_head` are the target's (its rows for the draft vocabulary)."""
    cfg = drafter_config(target.config)
    full = vocab.numel() == target.config.vocab_size
    drafter = Eagle3Drafter(cfg, layers, draft_vocab=None if full else vocab)
    last, mid, h = target.get_decoder().layers[-1], drafter.midlayer, cfg.hidden_size
    mid.mlp.load_state_dict(last.mlp.state_dict())
    mid.post_attention_layernorm.load_state_dict(last.post_attention_layernorm.state_dict())
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj"):
            src, dst = getattr(last.self_attn, name), getattr(mid.self_attn, name)
            dst.weight.normal_(0.0, 0.01)
            dst.weight[:, h:] = src.weight
            if dst.bias is not None and src.bias is not None:
                dst.bias.copy_(src.bias)
        mid.self_attn.o_proj.weight.zero_()
        mid.mlp.down_proj.weight.zero_()
        drafter.fc.weight.normal_(0.0, 0.01)
        drafter.fc.weight[:, -h:] += torch.eye(h)
        drafter.norm.weight.copy_(target.get_decoder().norm.weight)
        head = target.get_output_embeddings().weight
        drafter.lm_head.weight.copy_(head if full else head[vocab])
    return _ready_to_train(drafter, target)


def _ready_to_train(drafter: DraftHead, target: Any) -> Any:
    drafter.config._attn_implementation = "sdpa"
    for p in target.parameters():
        p.requires_grad_(False)
    return drafter.attach(target)


def _train(
    cfg: TrainConfig,
    out: Path,
    drafter: DraftHead,
    target: Any,
    seqs: list[list[int]],
    feats: list[torch.Tensor],
    labels: list[torch.Tensor],
    soft: list[SoftLabels] | None,
    matmuls: torch.dtype = torch.float32,
) -> None:
    """The optimizer's loop over `cfg.epochs` of the sequences (5% held out), the head's
    matrix products in `matmuls` (`_mixed_precision`)."""
    order = list(range(len(seqs)))
    random.Random(cfg.seed).shuffle(order)
    n_val = max(1, len(order) // 20)
    val, train = order[:n_val], order[n_val:]
    steps_per_epoch = math.ceil(len(train) / cfg.batch_seqs)
    total = steps_per_epoch * cfg.epochs
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _warmup_cosine(total))
    step, state_path = 0, out / STATE
    schedule = {"total_steps": total, "batch_seqs": cfg.batch_seqs, "lr": cfg.lr}
    if cfg.arch != "eagle":  # (states saved before EAGLE-3 existed stay resumable)
        schedule["arch"] = cfg.arch
    if cfg.soft_labels:  # (likewise states saved before soft labels existed)
        schedule["soft_labels"] = cfg.soft_labels
    if state_path.exists():
        state = torch.load(state_path, weights_only=False)
        _same_run(state_path, state.get("schedule"), schedule)
        drafter.load_state_dict(state["drafter"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        step = state["step"]
        print(f"train: resuming at step {step}/{total} from {state_path}")
    t2d = target_to_draft(drafter, target.config.vocab_size)
    gen = torch.Generator().manual_seed(cfg.seed)  # input noise; saved with the state
    if state_path.exists():
        gen.set_state(state["noise_rng"])
    bar = tqdm(total=total, initial=step, desc="train", unit="step", dynamic_ncols=True)
    drafter.train()
    lengths = [len(s) for s in seqs]
    batches: dict[int, list[list[int]]] = {}  # this epoch's
    while step < total:
        epoch, i = divmod(step, steps_per_epoch)
        if epoch not in batches:
            batches = {epoch: _epoch_batches(train, lengths, cfg.batch_seqs, cfg.seed + epoch)}
        batch = batches[epoch][i]
        opt.zero_grad(set_to_none=True)
        examples = [(seqs[j], feats[j], labels[j], soft[j] if soft else None) for j in batch]
        with _mixed_precision(matmuls):
            loss, stats = _batch_loss(cfg, drafter, examples, t2d, gen)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        step += 1
        bar.update(1)
        bar.set_postfix(
            epoch=epoch + 1, loss=f"{stats[0] / stats[2]:.3f}", acc=f"{stats[1] / stats[2]:.2f}"
        )
        if step % cfg.save_every == 0 or step == total:
            _save_state(state_path, drafter, opt, sched, step, gen, schedule)
        if step % steps_per_epoch == 0 or step == total:
            held_out = [(seqs[j], feats[j], labels[j], None) for j in val]
            acc = _validate(cfg, drafter, held_out, t2d)
            bar.write(f"epoch {epoch + 1}: held-out next-token accuracy {acc:.3f}")
    bar.close()
    drafter.eval()


def _mixed_precision(matmuls: torch.dtype) -> torch.autocast:
    """The head's matrix products in bf16 (weights, gradients and optimizer state stay fp32)
    where the target's were timed faster so (`_feature_model`): its training steps ran 1.49x
    as fast on 2 cores of an AMD EPYC Zen 4, and the head scored within what two fp32
    trainings differ by (docs/benchmarks.md)."""
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=matmuls == torch.bfloat16)


def _epoch_batches(
    order: list[int], lengths: list[int], batch_seqs: int, seed: int
) -> list[list[int]]:
    """One epoch's batches of `order`'s sequences: shuffled, then within each pool of
    `LENGTH_POOL` batches' worth sorted by length and cut into batches (a batch is padded to
    its longest sequence: similar lengths waste little), the batches shuffled again. The
    same `seed` gives the same batches, so a resumed run continues with the batch it left."""
    rng = random.Random(seed)
    shuffled = order[:]
    rng.shuffle(shuffled)
    pool = batch_seqs * LENGTH_POOL
    batches = []
    for at in range(0, len(shuffled), pool):
        group = sorted(shuffled[at : at + pool], key=lambda j: lengths[j])
        batches += [group[b : b + batch_seqs] for b in range(0, len(group), batch_seqs)]
    rng.shuffle(batches)
    return batches


# a sequence for `_batch_loss`: its tokens, the target's features and greedy tokens, its soft
# labels (None: greedy tokens alone)
Example = tuple[list[int], torch.Tensor, torch.Tensor, SoftLabels | None]


def _batch_loss(
    cfg: TrainConfig,
    drafter: DraftHead,
    examples: list[Example],
    t2d: torch.Tensor,
    gen: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE's loss over a batch of sequences, `cfg.unroll` chain steps, one forward of the
    head per step for the whole batch; returns (loss, [loss sum, correct first drafts,
    count]). The loss is each sequence's mean over its positions, weighted by its positions.

    Step 1 pairs token x[q+1] with the target's h[q] and learns the target's next token after
    x[q+1] (and, for an EAGLE head, h[q+1]). Step j > 1 replaces h with the head's own step
    j-1 output, as chained drafting at serving time does (training on true features only
    leaves later drafts poor). Sequences are right-padded: under the head's causal attention
    a sequence's positions never see its padding, whose losses are masked out. (One
    sequence at a time, as before, took 1.27x as long on 2 cores: docs/benchmarks.md.)
    """
    regress = not isinstance(drafter, Eagle3Drafter)  # its outputs are not target states
    token_weight = cfg.token_loss_weight if regress else 1.0
    steps = max(1, cfg.unroll)
    rows = len(examples)
    n = torch.tensor([len(seq) - 1 for seq, *_ in examples])  # positions step 1 trains
    width = int(n.max())
    padded = width + 1 + steps  # every step's window [1 + step, 1 + step + width) exists
    feat_dim = examples[0][1].shape[-1]
    ids = torch.zeros(rows, padded, dtype=torch.long)
    greedy = torch.zeros(rows, padded, dtype=torch.long)
    feat = torch.zeros(rows, padded, feat_dim)
    soft = [s for *_, s in examples]
    k = soft[0].draft_ids.shape[1] if soft[0] is not None else 0
    soft_ids = torch.zeros(rows, padded, k, dtype=torch.long)
    soft_probs = torch.zeros(rows, padded, k)
    for r, (seq, f, y, labels) in enumerate(examples):
        ids[r, : len(seq)] = torch.tensor(seq)
        greedy[r, : len(seq)] = y
        feat[r, : len(seq)] = f
        if labels is not None:
            soft_ids[r, : len(seq)] = labels.draft_ids.long()
            soft_probs[r, : len(seq)] = labels.probs.float()
    # regress in units of each sequence's RMS (over its own positions, not the padding)
    scale = (feat.pow(2).sum((1, 2)) / ((n + 1) * feat_dim)).sqrt()[:, None, None]
    hidden = feat[:, :width]
    if gen is not None and cfg.noise:
        hidden = hidden + cfg.noise * scale * torch.randn(hidden.shape, generator=gen)
    at = torch.arange(width)
    row_loss = torch.zeros(rows)
    correct = count = torch.zeros(rows)
    for step in range(steps):
        live = n - step  # positions this step trains per sequence (one fewer each step)
        mask = (at[None] < live[:, None]) & (live[:, None] >= 2)
        if not bool(mask.any()):
            break
        window = slice(1 + step, 1 + step + width)
        positions = (step + at)[None].expand(rows, width)
        f = drafter.features(ids[:, window], hidden, positions)
        logits = drafter.draft_logits(f)
        labels = t2d[greedy[:, window]].masked_fill(~mask, -100)  # -100: not trained
        if k:
            logq = F.log_softmax(logits.float(), dim=-1).gather(-1, soft_ids[:, window])
            token = -(soft_probs[:, window] * logq).sum(-1)
            counted = mask
        else:
            token = F.cross_entropy(
                logits.flatten(0, 1).float(),
                labels.flatten(),
                ignore_index=-100,
                reduction="none",
            ).view(rows, width)
            counted = labels >= 0
        loss = token_weight * _row_mean(token, counted)
        if regress:
            l1 = F.smooth_l1_loss(f / scale, feat[:, window] / scale, reduction="none")
            loss = loss + _row_mean(l1.mean(-1), mask)
        row_loss = row_loss + loss  # (0 for a sequence this step has no positions of)
        if step == 0:
            valid = labels >= 0
            correct = ((logits.argmax(-1) == labels) & valid).sum(1).float()
            count = valid.sum(1).clamp(min=1).float()
        hidden = f
    total = (row_loss * n).sum() / n.sum()
    row_loss = row_loss.detach()
    return total, torch.stack([(row_loss * count).sum(), correct.sum(), count.sum()])


def _row_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each row's mean of `values` [rows, T] where `mask` holds (0 for a row with none)."""
    kept = torch.where(mask, values, 0.0)
    return kept.sum(1) / mask.sum(1).clamp(min=1)


@torch.no_grad()
def _validate(
    cfg: TrainConfig, drafter: DraftHead, data: list[Example], t2d: torch.Tensor
) -> float:
    """Held-out first-draft accuracy (teacher-forced)."""
    drafter.eval()
    correct = count = 0.0
    for at in range(0, len(data), cfg.batch_seqs):
        _, s = _batch_loss(cfg, drafter, data[at : at + cfg.batch_seqs], t2d, None)
        correct, count = correct + s[1].item(), count + s[2].item()
    drafter.train()
    return correct / max(1.0, count)


@torch.no_grad()
def chain_acceptance(
    drafter: DraftHead,
    seq: list[int],
    feat: torch.Tensor,
    greedy: torch.Tensor,
    answer_start: int,
    k: int,
    t2d: torch.Tensor,
) -> list[int]:
    """Tokens a verify would commit for a chain of `k` drafts started at each position of
    `seq`'s answer (which begins at `answer_start`) that leaves room for all `k`: 1 + the
    drafts in a row that equal the target's greedy tokens (`greedy` and `feat` from
    `target_features`; `t2d` from `target_to_draft`). The chain is training's unrolled
    formulation (`_batch_loss`): the first draft reads the target's states, each next one
    the head's previous outputs at every row; offline it ranked heads as serving measured
    them (docs/benchmarks.md)."""
    ids, hidden = torch.tensor(seq), feat[:-1]
    hits = []
    for step in range(k):
        n = hidden.shape[0]
        if n < 1:
            return []
        f = drafter.features(
            ids[None, 1 + step : 1 + step + n], hidden[None], torch.arange(step, step + n)[None]
        )[0]
        hits.append(drafter.draft_logits(f).argmax(-1) == t2d[greedy[1 + step : 1 + step + n]])
        hidden = f[:-1]
    # row i's chain is verified after token i + 1, an answer token from row answer_start - 1
    runs = []
    for i in range(max(0, answer_start - 1), hits[-1].shape[0]):
        run = 0
        while run < k and bool(hits[run][i]):
            run += 1
        runs.append(run + 1)
    return runs


def target_to_draft(drafter: DraftHead, vocab_size: int) -> torch.Tensor:
    """Each target token's id in the head's draft vocabulary (-100: not in it)."""
    ids = drafter.draft_ids
    t2d = torch.full((vocab_size,), -100, dtype=torch.long)
    if ids is None:
        return torch.arange(vocab_size)
    t2d[ids] = torch.arange(ids.numel())
    return t2d


def _warmup_cosine(total: int, warmup_frac: float = 0.05):
    warmup = max(1, int(total * warmup_frac))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def _save_state(
    path: Path,
    drafter: DraftHead,
    opt: Any,
    sched: Any,
    step: int,
    gen: torch.Generator,
    schedule: dict[str, Any],
) -> None:
    """Everything the loop needs to continue bit for bit: weights, optimizer, schedule, the
    noise generator and the step (epoch shuffles are seeded by epoch)."""
    tmp = path.with_suffix(".tmp")
    state = {
        "drafter": drafter.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "step": step,
        "noise_rng": gen.get_state(),
        "schedule": schedule,
    }
    torch.save(state, tmp)
    tmp.replace(path)
