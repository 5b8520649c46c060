"""What structured output costs, and why llguidance: on the default model (SmolLM2-135M, fp32,
CPU) a batch of 8 JSON-constrained requests against the same batch unconstrained (median
decode-step time, alternating rounds), then the grammar engines themselves on its tokenizer:
llguidance (what replicas/grammar.py uses) and xgrammar when it is installed (compile time of
a schema, mask time per token, both with a warm tokenizer table).

    .venv/bin/python -m benchmarks.grammar [--batch 8] [--tokens 32] [--rounds 5]

Last line: JSON with `grammar_overhead_frac_8` (the masking's own time per step, measured
alone, over the free step's), `step_ab_ratio` (constrained / free step, within the machine's
noise) and the engines' figures.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time

import torch

from benchmarks.common import emit, engine, load, machine, median, setup_threads
from sessionserve.wire import SamplingParams

# an array that cannot close within --tokens: every constrained row decodes to the end, as
# the free rows do, so the two batches stay the same size
SCHEMA = {
    "type": "array",
    "items": {"type": "integer", "minimum": 0, "maximum": 9999},
    "minItems": 64,
}
OBJECT = {  # for the engines' compile and mask figures: an object with a few fields
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
ANSWER = json.dumps({"name": "Ann", "age": 3, "tags": ["a", "b"]}, separators=(",", ":"))


def step_times(eng, prompts: list[list[int]], sampling: SamplingParams) -> list[float]:
    """Seconds of every step that decodes the whole batch (prefill steps left out)."""
    return run(eng, prompts, sampling)[0]


def run(eng, prompts: list[list[int]], sampling: SamplingParams) -> tuple[list[float], list]:
    """The batch to its end: decode-step seconds (prefill steps left out) and the answers."""
    rids = [eng.submit(p, sampling) for p in prompts]
    times = []
    while eng.in_flight():
        start = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - start)
    answers = [eng.take_result(r).output_ids for r in rids]
    return times[1 : len(times) - 1], answers


def mask_time(eng, answers: list[list[int]], grammar: str, lark: bool = False) -> float:
    """Seconds per step that masking costs a batch: each step, every row's mask filled and
    applied to [batch, vocab] logits, then the sampled token consumed, replaying `answers`
    (what the constrained rows sampled). Timed alone: the step-time A/B above is within this
    machine's noise. `grammar`: a JSON schema's text, or with `lark` a Lark grammar."""
    from sessionserve.replicas.grammar import apply_masks, consume

    matchers = [eng.grammars().matcher(grammar, lark=lark) for _ in answers]
    logits = torch.randn(len(answers), eng.vocab_size)
    steps = min(len(a) for a in answers)
    start = time.perf_counter()
    for i in range(steps):
        apply_masks(logits.clone(), matchers)
        for m, answer in zip(matchers, answers, strict=True):
            consume(m, answer[i])
    return (time.perf_counter() - start) / steps


def engines_on(tokenizer, vocab: int) -> dict[str, float]:
    out = {}
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    ids = tokenizer(ANSWER, add_special_tokens=False).input_ids
    info = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    start = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(OBJECT), defaults={"whitespace_flexible": False}
    )
    matcher = llguidance.LLMatcher(info, grammar)
    out["llguidance_compile_ms"] = (time.perf_counter() - start) * 1e3
    mask = lt.allocate_token_bitmask(1, vocab)
    start = time.perf_counter()
    for t in ids:
        lt.fill_next_token_bitmask(matcher, mask, 0)
        assert matcher.consume_token(t), matcher.get_error()
    out["llguidance_mask_us"] = (time.perf_counter() - start) / len(ids) * 1e6
    if importlib.util.find_spec("xgrammar") is not None:
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
        compiler = xgr.GrammarCompiler(info)
        start = time.perf_counter()
        compiled = compiler.compile_json_schema(
            json.dumps(OBJECT), any_whitespace=False, separators=(",", ":")
        )
        out["xgrammar_compile_ms"] = (time.perf_counter() - start) * 1e3
        matcher, mask = xgr.GrammarMatcher(compiled), xgr.allocate_token_bitmask(1, vocab)
        start = time.perf_counter()
        for t in ids:
            matcher.fill_next_token_bitmask(mask, 0)
            assert matcher.accept_token(t)
        out["xgrammar_mask_us"] = (time.perf_counter() - start) / len(ids) * 1e6
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    setup_threads(args.threads)
    loaded = load()
    eng = engine(loaded, sessions=False, radix=False)
    tok = loaded.tokenizer
    prompts = [
        tok(f"List {i + 3} numbers as a JSON array:", add_special_tokens=False).input_ids
        for i in range(args.batch)
    ]
    free = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    constrained = free.model_copy(update={"json_schema": json.dumps(SCHEMA)})
    _, answers = run(eng, prompts, constrained)  # warm: tokenizer table, schema compiled
    rounds = {"free": [], "constrained": []}
    for _ in range(args.rounds):  # alternating, so that drift hits both alike
        rounds["free"] += step_times(eng, prompts, free)
        rounds["constrained"] += step_times(eng, prompts, constrained)
    free_ms, json_ms = median(rounds["free"]) * 1e3, median(rounds["constrained"]) * 1e3
    print(
        f"decode step, batch {args.batch}: free {free_ms:.1f} ms, JSON-constrained {json_ms:.1f} ms"
    )
    mask_ms = mask_time(eng, answers, constrained.json_schema) * 1e3
    print(f"masking a batch of {args.batch}: {mask_ms:.2f} ms per step")
    figures = engines_on(tok, eng.vocab_size)
    for name, value in figures.items():
        print(f"{name}: {value:.1f}")
    emit(
        {
            "benchmark": "grammar",
            "batch": args.batch,
            "free_step_ms": round(free_ms, 2),
            "constrained_step_ms": round(json_ms, 2),
            "mask_ms_per_step": round(mask_ms, 3),
            f"grammar_overhead_frac_{args.batch}": round(mask_ms / free_ms, 4),
            "step_ab_ratio": round(json_ms / free_ms, 4),
            **{k: round(v, 2) for k, v in figures.items()},
            "machine": machine(),
        }
    )


if __name__ == "__main__":
    main()
