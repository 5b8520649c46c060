"""KV an idle sliding-window session holds: sliding layers' KV kept apart vs every layer full.

Gemma 3 270M (18 layers, 5 of every 6 sliding over 512 tokens) holds a session of --tokens
tokens (built in --turns append turns, each a prompt and one greedy answer token), once with
the sliding layers' KV kept apart (`cache.sliding_window_kv: true`, the default) and once
with every layer keeping every token (`false`, what sessionserve did before). The KV bytes the
idle session holds come from the memory checker's terms (full-attention slots x the layers
that use them + sliding slots x the sliding layers). Also timed per mode: the decode rate of a
32-token answer on top of the held history (sliding layers then read their window only).
The answers must be the same tokens in both modes.

    .venv/bin/python -m benchmarks.sliding_kv [--tokens 8192] [--turns 4] [--threads 2]
        [--model gemma3-270m] [--pool-gib 8]

Last line: JSON with `held_kv_ratio_8k` (apart / full) and the sessions of that length a pool
of --pool-gib GiB fits in each mode (from the measured bytes per session).
"""

from __future__ import annotations

import argparse
import time

from benchmarks.common import emit, engine, load, machine, setup_threads
from sessionserve.wire import SamplingParams

ONE = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
ANSWER = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)


def prompt(turn: int, n: int, vocab: int) -> list[int]:
    return [100 + (turn * 7919 + i * 104729) % (vocab - 200) for i in range(n)]


def run(loaded, apart: bool, tokens: int, turns: int) -> dict:
    eng = engine(
        loaded,
        num_slots=tokens + 1024,
        max_context_len=tokens + 512,
        prefill=1024,
        sliding_window_kv=apart,
    )
    sid = eng.open_session()
    per_turn = tokens // turns - 1  # + one answer token each; the last is not fed yet,
    started = time.perf_counter()  # so the first prompt has one token more
    for t in range(turns):
        new = prompt(t, per_turn + (t == 0), eng.vocab_size)
        eng.generate([new], ONE, session_id=sid)
        print(f"  {'apart' if apart else 'full '}: turn {t + 1}/{turns} done", flush=True)
    build_s = time.perf_counter() - started
    terms = eng.checker.check_idle()
    pool = eng.runner.kv_pool
    per_layer = pool.k[0, 0].nbytes * 2 if pool.k.shape[0] else pool.sliding_k[0, 0].nbytes * 2
    # the session's own KV and the radix pages it locks (with every layer kept whole, its
    # first prompt is shared into the tree; apart, it is not)
    full_slots, sliding_slots = (
        terms.held + terms.protected,
        terms.sliding_held + terms.sliding_tree,
    )
    held = full_slots * pool.k.shape[0] * per_layer
    held += sliding_slots * pool.sliding_k.shape[0] * per_layer
    session_len = eng.cache.session(sid).committed_len
    started = time.perf_counter()
    (r,) = eng.generate([[101, 102]], ANSWER, session_id=sid)
    decode_s = time.perf_counter() - started - r.ttft_s
    eng.close_session(sid)
    eng.checker.check_idle()
    return {
        "session_tokens": session_len,
        "held_bytes": held,
        "held_full_slots": full_slots,
        "held_sliding_slots": sliding_slots,
        "build_s": build_s,
        "decode_tok_s": (len(r.output_ids) - 1) / decode_s,
        "answer": r.output_ids,
        "layers": (pool.k.shape[0], pool.sliding_k.shape[0]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--pool-gib", type=float, default=8.0)
    args = ap.parse_args()
    setup_threads(args.threads)
    loaded = load(args.model)
    apart = run(loaded, True, args.tokens, args.turns)
    full = run(loaded, False, args.tokens, args.turns)
    if apart["answer"] != full["answer"]:
        raise SystemExit("the two modes answered differently: the sliding KV is wrong")
    ratio = apart["held_bytes"] / full["held_bytes"]
    pool = args.pool_gib * 2**30
    fits = {k: int(pool // m["held_bytes"]) for k, m in (("apart", apart), ("full", full))}
    f_layers, s_layers = apart["layers"]
    bound = (f_layers + s_layers * min(512, args.tokens) / args.tokens) / (f_layers + s_layers)
    print(f"model {args.model}: {f_layers} full-attention + {s_layers} sliding layers")
    for name, m in (("apart", apart), ("full", full)):
        print(
            f"{name:>5}: session of {m['session_tokens']} tokens holds "
            f"{m['held_bytes'] / 2**20:.1f} MiB ({m['held_full_slots']} full slots, "
            f"{m['held_sliding_slots']} sliding slots); built in {m['build_s']:.1f} s; "
            f"decode on top {m['decode_tok_s']:.1f} tok/s; {fits[name]} such sessions fit "
            f"{args.pool_gib:g} GiB"
        )
    print(f"held KV ratio apart/full: {ratio:.4f} (1/6 + 5/6 x 512/{args.tokens} = {bound:.4f})")
    emit(
        {
            "bench": "sliding_kv",
            "model": args.model,
            "session_tokens": apart["session_tokens"],
            "held_kv_ratio_8k": round(ratio, 4),
            "ratio_bound": round(bound, 4),
            "held_mib_apart": round(apart["held_bytes"] / 2**20, 2),
            "held_mib_full": round(full["held_bytes"] / 2**20, 2),
            "sessions_fit_apart": fits["apart"],
            "sessions_fit_full": fits["full"],
            "pool_gib": args.pool_gib,
            "decode_tok_s_apart": round(apart["decode_tok_s"], 2),
            "decode_tok_s_full": round(full["decode_tok_s"], 2),
            "decode_speedup": round(apart["decode_tok_s"] / full["decode_tok_s"], 3),
            "same_answers": True,
            **machine(),
        }
    )


if __name__ == "__main__":
    main()
