"""How many tokens a verify would commit with an EAGLE head, measured offline, per turn.

`benchmarks/speculative.py` measures a head while serving: minutes of decoding per figure,
and its speed depends on the machine. This reads only the head's quality, in a couple of
minutes: the target answers `speculative.py`'s unseen prompts and their follow-up greedily
(our engine, `--dtype`), then the head drafts a chain of `--k` from every answer position
(`training.drafter.chain_acceptance`: training's unrolled formulation, teacher-forced) and
each chain counts 1 + its drafts in a row that match the target's greedy tokens. Offline,
the same measure read 1.50 tokens a verify for the head serving measured at 1.48 (stop 60,
docs/benchmarks.md). `--baseline` scores a second head on the same answers, in the same run.

    .venv/bin/python -m benchmarks.drafter_quality --drafter drafters/default
    .venv/bin/python -m benchmarks.drafter_quality --drafter NEW --baseline drafters/default

Last line (JSON): `accept_len` (both turns), `accept_len_turn1`, `accept_len_turn2`,
`first_draft` (the share of chains whose first draft is right), `hist` (chains committing 1,
2, ... k + 1 tokens), the same for the baseline, and `ratio_vs_baseline` (accept_len's).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from benchmarks.common import emit, engine, load, machine, setup_threads
from benchmarks.speculative import EVAL_PROMPTS, FOLLOW_UP
from sessionserve.replicas.speculative.checkpoint import load_drafter
from sessionserve.training.drafter import chain_acceptance, target_features, target_to_draft
from sessionserve.wire import SamplingParams


def answered(loaded: Any, max_tokens: int) -> tuple[list[list[int]], list[int], list[int]]:
    """Each prompt's chat and its greedy answer, then the follow-up turn over that answer:
    the token sequences, where each answer starts, and each sequence's turn (1 or 2)."""
    tok = loaded.tokenizer
    eng = engine(loaded, sessions=False, max_running=len(EVAL_PROMPTS))
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0)

    def chat_ids(messages: list[dict[str, str]]) -> list[int]:
        ids = tok.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        return list(ids)

    firsts = [[{"role": "user", "content": p}] for p in EVAL_PROMPTS]
    prompts1 = [chat_ids(m) for m in firsts]
    answers1 = [r.output_ids for r in eng.generate(prompts1, greedy)]
    seconds = [
        m + [{"role": "assistant", "content": tok.decode(a, skip_special_tokens=True)}]
        for m, a in zip(firsts, answers1, strict=True)
    ]
    prompts2 = [chat_ids(m + [{"role": "user", "content": FOLLOW_UP}]) for m in seconds]
    answers2 = [r.output_ids for r in eng.generate(prompts2, greedy)]
    prompts, answers = prompts1 + prompts2, answers1 + answers2
    seqs = [p + a for p, a in zip(prompts, answers, strict=True)]
    return seqs, [len(p) for p in prompts], [1] * len(prompts1) + [2] * len(prompts2)


def score(
    path: str,
    served: Any,
    fp32: Any,
    seqs: list[list[int]],
    starts: list[int],
    turns: list[int],
    k: int,
    states: dict[Any, tuple[list, list]],
) -> dict[str, Any]:
    """A head's chains over the answers: mean tokens a verify, per turn and in all. The
    target's states come from `served` (the dtype it answers in), once for each set of layers
    a head reads (`states`, shared by the heads scored); the head is attached to the fp32
    copy `fp32`, as training attaches it."""
    head = load_drafter(path, fp32.model).eval()
    layers = head.feature_layers
    if layers not in states:
        states[layers] = target_features(served.model, seqs, layers)[:2]
    feats, labels = states[layers]
    t2d = target_to_draft(head, fp32.model.config.vocab_size)
    runs: dict[int, list[int]] = {1: [], 2: []}
    for seq, feat, greedy, start, turn in zip(seqs, feats, labels, starts, turns, strict=True):
        runs[turn] += chain_acceptance(head, seq, feat, greedy, start, k, t2d)
    every = runs[1] + runs[2]
    return {
        "accept_len": round(sum(every) / len(every), 3),
        "accept_len_turn1": round(sum(runs[1]) / len(runs[1]), 3),
        "accept_len_turn2": round(sum(runs[2]) / len(runs[2]), 3),
        "first_draft": round(sum(r > 1 for r in every) / len(every), 3),
        "hist": [every.count(n) for n in range(1, k + 2)],
        "chains": len(every),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafter", required=True, help="the head to score (a directory)")
    ap.add_argument("--baseline", help="a second head, scored on the same answers")
    ap.add_argument("--model", default="default", help="the target (default: SmolLM2-135M)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--k", type=int, default=4, help="drafts a chain (default 4)")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens an answer at most")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    setup_threads(args.threads)
    started = time.monotonic()
    loaded = load(args.model, getattr(torch, args.dtype))
    fp32 = load(args.model) if args.dtype != "float32" else loaded
    seqs, starts, turns = answered(loaded, args.max_tokens)
    print(
        f"answers: {sum(len(s) - p for s, p in zip(seqs, starts, strict=True))} tokens "
        f"({time.monotonic() - started:.0f} s)"
    )
    heads = {"drafter": args.drafter} | ({"baseline": args.baseline} if args.baseline else {})
    results, states = {}, {}
    print(
        f"{'head':<10} {'tokens a verify':>16} {'turn 1':>7} {'turn 2':>7} {'first draft':>12}"
        "  histogram (1 .. k+1 tokens)"
    )
    for name, path in heads.items():
        r = score(path, loaded, fp32, seqs, starts, turns, args.k, states)
        results[name] = r
        print(
            f"{name:<10} {r['accept_len']:>16.3f} {r['accept_len_turn1']:>7.3f} "
            f"{r['accept_len_turn2']:>7.3f} {r['first_draft']:>12.3f}  {r['hist']}"
        )
    summary: dict[str, Any] = {
        "model": loaded.name,
        "dtype": args.dtype,
        "k": args.k,
        "drafter": args.drafter,
        **results["drafter"],
        "machine": machine(),
        "seconds": round(time.monotonic() - started, 1),
    }
    if "baseline" in results:
        base = results["baseline"]
        summary |= {f"baseline_{key}": value for key, value in base.items()}
        summary["baseline"] = args.baseline
        summary["ratio_vs_baseline"] = round(
            results["drafter"]["accept_len"] / base["accept_len"], 3
        )
    emit(summary)


if __name__ == "__main__":
    main()
