"""What structured output costs, and why llguidance: on the default model (SmolLM2-135M, fp32,
CPU) a batch of 8 JSON-constrained requests against the same batch unconstrained (median
decode-step time, alternating rounds), then the grammar engines themselves on its tokenizer:
llguidance (what replicas/grammar.py uses) and xgrammar when it is installed (compile time of
a schema, mask time per token, both with a warm tokenizer table).

    .venv/bin/python -m benchmarks.grammar [--batch 8] [--tokens 32] [--rounds 3]

Last line: JSON with `grammar_overhead_frac_8` (constrained / free step time - 1) and the
engines' figures.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time

from benchmarks.common import emit, engine, load, machine, median, setup_threads
from sessionserve.wire import SamplingParams

# long enough to run for --tokens (an array of integers never has to end)
SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9999}}
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
    rids = [eng.submit(p, sampling) for p in prompts]
    times = []
    while eng.in_flight():
        start = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - start)
    for r in rids:
        eng.take_result(r)
    return times[1 : len(times) - 1]


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

        compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab))
        start = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(OBJECT), any_whitespace=False)
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
    ap.add_argument("--rounds", type=int, default=3)
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
    step_times(eng, prompts, constrained)  # warm: the tokenizer table, the schema compiled
    rounds = {"free": [], "constrained": []}
    for _ in range(args.rounds):  # alternating, so that drift hits both alike
        rounds["free"] += step_times(eng, prompts, free)
        rounds["constrained"] += step_times(eng, prompts, constrained)
    free_ms, json_ms = median(rounds["free"]) * 1e3, median(rounds["constrained"]) * 1e3
    print(
        f"decode step, batch {args.batch}: free {free_ms:.1f} ms, JSON-constrained {json_ms:.1f} ms"
    )
    figures = engines_on(tok, eng.vocab_size)
    for name, value in figures.items():
        print(f"{name}: {value:.1f}")
    emit(
        {
            "benchmark": "grammar",
            "batch": args.batch,
            "free_step_ms": round(free_ms, 2),
            "constrained_step_ms": round(json_ms, 2),
            f"grammar_overhead_frac_{args.batch}": round(json_ms / free_ms - 1, 4),
            **{k: round(v, 2) for k, v in figures.items()},
            "machine": machine(),
        }
    )


if __name__ == "__main__":
    main()
