"""EAGLE speculative decoding on the default model: decode tokens/s with and without it.

Sessions answer prompts that are not in the drafter's training set (two greedy turns each:
a question, then a follow-up on the same session). At concurrency c, c sessions run at once
(continuous batching); c=1 runs them one after another. Decode tokens/s counts the tokens
emitted by decode-only steps over those steps' time (prefill steps are the same work in both
runs and are left out). Greedy output is identical with and without speculation (checked
here), so both runs produce the same tokens.

    .venv/bin/sessionserve train-drafter            # once: writes drafters/default
    .venv/bin/python -m benchmarks.speculative [--drafter drafters/default] [--num-drafts 4]

Last line: JSON with accept_len (mean tokens per verify step, EAGLE's tau, at k=num_drafts),
speedup_1 and speedup_8 (decode tokens/s with / without speculation).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from benchmarks.common import emit, load, machine, setup_threads
from sessionserve.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from sessionserve.replicas.engine import Engine
from sessionserve.training.drafter import shipped_prompts
from sessionserve.wire import SamplingParams

# written for this benchmark; none of them is in the training prompt set
EVAL_PROMPTS = [
    "What are the main differences between a frog and a toad?",
    "Write a short note inviting my neighbours to a garden party on Saturday.",
    "Explain how a rainbow forms after a storm.",
    "Give me four tips for studying for a history exam.",
    "What is the difference between a virus and a bacterium?",
    "Describe a busy train station in the morning.",
    "Write a Python function that returns the largest number in a list.",
    "Why do leaves change colour in autumn?",
]
FOLLOW_UP = "Thank you. Can you say more about that?"


def verify_cost(loaded, lengths=(1, 2, 3, 5, 8), reps: int = 12) -> dict[int, float]:
    """Median ms of transformers' own forward of `n` new tokens over a 200-token cache: what a
    verify of n - 1 drafts costs on this machine next to a decode step (n = 1)."""
    import copy

    import torch

    model = loaded.model
    model.set_attn_implementation("sdpa")  # the stock path, not ours
    gen = torch.Generator().manual_seed(0)
    ctx = torch.randint(100, 10_000, (1, 200), generator=gen)
    out: dict[int, float] = {}
    with torch.no_grad():
        cache = model(ctx, use_cache=True).past_key_values
        for n in lengths:
            times = []
            for _ in range(reps):
                c = copy.deepcopy(cache)
                x = torch.randint(100, 10_000, (1, n), generator=gen)
                t = time.perf_counter()
                model(x, past_key_values=c, use_cache=True)
                times.append(time.perf_counter() - t)
            out[n] = 1000 * sorted(times)[reps // 2]
    return out


def run(
    loaded, drafter: str | None, k: int, concurrency: int, max_tokens: int, prompts: list[str]
) -> dict:
    cfg = EngineConfig(
        cache=CacheConfig(num_slots=16384, max_rows=32, max_context_len=4096),
        scheduler=SchedulerConfig(max_running_requests=max(concurrency, 1)),
        spec=SpecConfig(drafter_path=drafter, num_drafts=k),
        compile=False,  # speculation is measured on the eager forward (both arms alike)
    )
    eng = Engine(cfg, loaded)
    tok = eng.tokenizer
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    decode_s, decode_tokens, outputs = 0.0, 0, {}
    sessions = [(i, eng.open_session()) for i in range(len(prompts))]
    history = {sid: [] for _, sid in sessions}
    for group_start in range(0, len(sessions), concurrency):
        group = sessions[group_start : group_start + concurrency]
        for turn in range(2):
            rids = {}
            for i, sid in group:
                content = prompts[i] if turn == 0 else FOLLOW_UP
                history[sid].append({"role": "user", "content": content})
                ids = tok.apply_chat_template(
                    history[sid], add_generation_prompt=True, tokenize=True, return_dict=False
                )
                rids[eng.submit(ids, params, session_id=sid, mode="chat")] = (i, sid)
            while eng.has_work():
                sched = eng.scheduler
                decode_only = not sched.waiting and all(r.sampled for r in sched.running)
                t = time.perf_counter()
                events = eng.step()
                dt = time.perf_counter() - t
                if decode_only:
                    decode_s += dt
                    decode_tokens += sum(len(e.new_token_ids) for e in events)
            for rid, (i, sid) in rids.items():
                r = eng.take_result(rid)
                outputs[(i, turn)] = r.output_ids
                history[sid].append({"role": "assistant", "content": r.text})
    for _, sid in sessions:
        eng.close_session(sid)
    eng.check_memory()
    return {
        "decode_tps": decode_tokens / decode_s,
        "decode_tokens": decode_tokens,
        "outputs": outputs,
        "spec": eng.spec_stats.as_dict(),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", default="drafters/default", help="EAGLE head directory")
    ap.add_argument("--num-drafts", type=int, default=4, help="chain length k")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--seen-prompts",
        action="store_true",
        help="use 8 of the drafter's training prompts instead (how much it memorised)",
    )
    args = ap.parse_args()
    if not (Path(args.drafter) / "config.json").exists():
        print(
            f"no drafter at {args.drafter}: train one first with "
            f"`.venv/bin/sessionserve train-drafter --out {args.drafter}` (about 20 min here)",
            file=sys.stderr,
        )
        return 2
    assert not set(EVAL_PROMPTS) & set(shipped_prompts()), "eval prompts must be unseen"
    prompts = shipped_prompts()[: len(EVAL_PROMPTS)] if args.seen_prompts else EVAL_PROMPTS
    setup_threads(args.threads)
    loaded = load()
    print(f"machine: {machine()}  drafter: {args.drafter}  k={args.num_drafts}")
    summary: dict = {
        "k": args.num_drafts,
        "max_tokens": args.max_tokens,
        "prompts": "seen" if args.seen_prompts else "unseen",
    }
    cost = verify_cost(loaded)
    print(
        "forward of n new tokens (transformers, 200-token cache): "
        + ", ".join(f"n={n}: {ms:.1f} ms ({ms / cost[1]:.2f}x)" for n, ms in cost.items())
    )
    summary["verify_cost_ratio"] = {n: round(ms / cost[1], 3) for n, ms in cost.items()}
    for c in args.concurrency:
        base = run(loaded, None, args.num_drafts, c, args.max_tokens, prompts)
        spec = run(loaded, args.drafter, args.num_drafts, c, args.max_tokens, prompts)
        same = base["outputs"] == spec["outputs"]
        speedup = spec["decode_tps"] / base["decode_tps"]
        s = spec["spec"]
        print(
            f"concurrency {c}: decode {base['decode_tps']:.1f} tok/s plain, "
            f"{spec['decode_tps']:.1f} tok/s speculative -> {speedup:.2f}x; "
            f"mean acceptance length {s['mean_accept_len']:.2f} "
            f"(accepted {s['accepted']}/{s['drafted']} drafts); "
            f"histogram {s['accept_len_histogram']}; outputs identical: {same}"
        )
        summary[f"speedup_{c}"] = round(speedup, 3)
        summary[f"plain_tps_{c}"] = round(base["decode_tps"], 2)
        summary[f"spec_tps_{c}"] = round(spec["decode_tps"], 2)
        summary[f"accept_len_{c}"] = s["mean_accept_len"]
        summary[f"identical_{c}"] = same
    summary["accept_len"] = summary[f"accept_len_{args.concurrency[0]}"]
    emit(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
