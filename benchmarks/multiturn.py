"""Multi-turn TTFT: streaming sessions vs stateless re-prefill vs radix prefix cache.

One conversation of --turns turns grows to 2k+ tokens (each turn adds a ~180-token user message
and a fixed-length greedy answer, so all three modes see the same tokens). Per turn, the time
to first token of:
  (a) session:   a session turn (append mode): only the new tokens are prefilled
  (b) stateless: a plain request carrying the whole history, sessions and radix cache off
  (c) radix:     a plain request carrying the whole history, radix prefix cache on
Each mode runs the whole conversation --repeats times (fresh engine each time); per-turn figures
are medians. Last line: JSON with the final turn's ratios.

    .venv/bin/python -m benchmarks.multiturn [--turns 12] [--repeats 3] [--threads 2]
        [--model default | gemma3-270m | a local path]
"""

from __future__ import annotations

import argparse

from benchmarks.common import emit, engine, load, machine, median, setup_threads
from sessionserve.wire import SamplingParams

TOPICS = [
    "the history of bridges",
    "how bees communicate",
    "the rules of chess",
    "volcanoes in Iceland",
    "the first computers",
    "tides and the moon",
    "how bread rises",
    "the Silk Road",
    "deep sea fish",
    "solar panels",
    "the Roman calendar",
    "glaciers",
    "jazz in the 1920s",
    "paper making",
]


def user_message(tok, turn: int) -> list[int]:
    topic = TOPICS[turn % len(TOPICS)]
    body = (f"Turn {turn}. Please think about {topic}. " * 14).strip()
    text = f"<|im_start|>user\n{body}<|im_end|>\n<|im_start|>assistant\n"
    return tok(text, add_special_tokens=False).input_ids


def run_mode(loaded, mode: str, turns: int, answer: SamplingParams) -> list[float]:
    eng = engine(loaded, sessions=mode == "session", radix=mode != "stateless")
    history: list[int] = []
    sid = eng.open_session() if mode == "session" else None
    ttfts = []
    for t in range(turns):
        new = user_message(eng.tokenizer, t)
        if sid is not None:
            (r,) = eng.generate([new], answer, session_id=sid)
        else:
            (r,) = eng.generate([history + new], answer)
        history += new + r.output_ids
        ttfts.append(r.ttft_s)
    return ttfts, len(history)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--turns", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--answer-tokens", type=int, default=16)
    ap.add_argument("--model", default="default", help="model.path (default: SmolLM2)")
    args = ap.parse_args()
    setup_threads(args.threads)
    loaded = load(args.model)
    answer = SamplingParams(max_tokens=args.answer_tokens, temperature=0, ignore_eos=True)
    run_mode(loaded, "session", 2, answer)  # warm-up
    modes = ("session", "stateless", "radix")
    per_mode: dict[str, list[float]] = {}
    history_tokens = 0
    for mode in modes:
        runs = []
        for rep in range(args.repeats):
            ttfts, history_tokens = run_mode(loaded, mode, args.turns, answer)
            runs.append(ttfts)
            print(
                f"[{mode} run {rep + 1}/{args.repeats}] final TTFT {1000 * ttfts[-1]:.1f} ms",
                flush=True,
            )
        per_mode[mode] = [median([r[t] for r in runs]) for t in range(args.turns)]
    print(f"\nmachine: {machine()}")
    print(
        f"{'turn':>4} {'session ms':>11} {'stateless ms':>13} {'radix ms':>9} "
        f"{'stateless/session':>18} {'radix/session':>14}"
    )
    for t in range(args.turns):
        s, b, c = (per_mode[m][t] * 1000 for m in modes)
        print(f"{t + 1:>4} {s:>11.1f} {b:>13.1f} {c:>9.1f} {b / s:>18.2f} {c / s:>14.2f}")
    s, b, c = (per_mode[m][-1] for m in modes)
    emit(
        {
            "benchmark": "multiturn",
            "model": loaded.name,
            "turns": args.turns,
            "history_tokens": history_tokens,
            "ttft_ms_session": round(1000 * s, 1),
            "ttft_ms_stateless": round(1000 * b, 1),
            "ttft_ms_radix": round(1000 * c, 1),
            "ttft_ratio_stateless_over_session": round(b / s, 2),
            "ttft_ratio_radix_over_session": round(c / s, 2),
        }
    )


if __name__ == "__main__":
    main()
