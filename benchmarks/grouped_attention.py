"""The torch backend's attention over gathered K/V with a group's query heads stacked as the
rows of one query (`torch_backend.grouped_attention`) against the call it replaced
(`scaled_dot_product_attention(..., enable_gqa=True)`), in the same run.

Kernel: B rows of q new tokens over L context positions (the model's head layout, bf16,
causal mask over the context; the stacked mask built once per the model's number of layers,
as a forward does), the two calls alternating `--rounds` times, outputs checked
(bit-identical in bf16; in fp32 a single row's sums differ in order: within 1e-5); median ms
each and old / new. Engine (`--engine`): the eager engine (no
compiled forward, so decode rows take this path too; what `engine.compile: false` and the
first minutes of `compile: auto` run) decoding `--batch` requests over ~`--context` tokens,
the two calls alternating (`benchmarks.common.alternate_decode_steps`); ms per decode step.
Turns (`--turns`): the compiled engine (as `serve run` runs) prefilling session turns of 115
tokens over 1,500 and 400 held ones, the two calls alternating; median ms per turn.

    .venv/bin/python -m benchmarks.grouped_attention [--engine] [--turns] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from benchmarks.common import (
    alternate_decode_steps,
    emit,
    engine,
    load,
    machine,
    median,
    setup_threads,
)
from sessionserve.replicas.attention import torch_backend
from sessionserve.replicas.openmp import run_on_passing_thread
from sessionserve.wire import SamplingParams

SHAPES = (
    (8, 1, 400),
    (1, 1, 2000),
    (8, 5, 400),
    (1, 5, 300),
    (3, 116, 356),
    (1, 116, 600),
    (1, 115, 1615),  # a session turn over a long history
    (1, 300, 812),  # a prefill chunk after a first one of 512
    (7, 300, 300),  # prompts of one length prefilled together
)


def replaced(q, k, v, mask, scale, masks=None):
    """What the backend called before: SDPA with `enable_gqa` (one block per query head)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def per_forward(layers: int):
    """`grouped_attention` as a forward's layers call it: the stacked mask built at the first
    of every `layers` calls (a forward's plan keeps it for its layers) and reused by the rest."""
    calls, masks = 0, {}

    def call(q, k, v, mask, scale):
        nonlocal calls, masks
        if calls % layers == 0:
            masks = {}
        calls += 1
        return torch_backend.grouped_attention(q, k, v, mask, scale, masks)

    return call


def kernel_points(config, dtype: torch.dtype, rounds: int) -> dict[str, float]:
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = config.hidden_size // heads
    out: dict[str, float] = {}
    for b, q_len, ctx in SHAPES:
        q = torch.randn(b, q_len, heads, dim, dtype=dtype).transpose(1, 2)
        k, v = (torch.randn(b, kv_heads, ctx, dim, dtype=dtype) for _ in range(2))
        last = torch.arange(ctx - q_len, ctx)
        mask = (torch.arange(ctx)[None, :] <= last[:, None]).expand(b, 1, q_len, ctx)
        calls = {"old": replaced, "new": per_forward(config.num_hidden_layers)}
        results = {n: f(q, k, v, mask, dim**-0.5) for n, f in calls.items()}
        diff = (results["old"].float() - results["new"].float()).abs().max().item()
        if diff > (0.0 if dtype == torch.bfloat16 else 1e-5):
            raise SystemExit(f"{b} x {q_len} over {ctx}: the outputs differ by {diff}")
        times: dict[str, list[float]] = {n: [] for n in calls}
        reps = max(5, 2000 // (b * q_len * ctx // 1000 + 1))
        for _ in range(rounds):
            for name, fn in calls.items():
                started = time.perf_counter()
                for _ in range(reps):
                    fn(q, k, v, mask, dim**-0.5)
                times[name].append((time.perf_counter() - started) / reps * 1e3)
        old, new = median(times["old"]), median(times["new"])
        print(f"{b} x {q_len} over {ctx}: old {old:.3f} ms, new {new:.3f} ms, {old / new:.2f}x")
        out[f"speedup_{b}x{q_len}x{ctx}"] = round(old / new, 3)
    return out


def engine_point(loaded, batch: int, context: int, rounds: int) -> dict[str, float]:
    eng = engine(loaded, sessions=False, radix=False, max_running=batch, num_slots=16384)
    params = SamplingParams(max_tokens=4000, temperature=0, ignore_eos=True)
    vocab = loaded.model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    for _ in range(batch):
        eng.submit(torch.randint(5, vocab, (context,), generator=gen).tolist(), params)
    new = torch_backend.grouped_attention

    def use(fn):
        return lambda: setattr(torch_backend, "grouped_attention", fn)

    try:
        ms = alternate_decode_steps(eng, {"old": use(replaced), "new": use(new)}, rounds, 8)
    finally:
        torch_backend.grouped_attention = new
    print(
        f"eager engine, {batch} decodes over ~{context}: old {ms['old']:.1f} ms a step, "
        f"new {ms['new']:.1f} ms, {ms['old'] / ms['new']:.2f}x"
    )
    return {f"engine_step_speedup_{batch}x{context}": round(ms["old"] / ms["new"], 3)}


def turn_point(loaded, history: int, new_tokens: int, rounds: int) -> dict[str, float]:
    """A session turn of `new_tokens` over a held history of `history` tokens (one output token:
    the turn's prefill) in the compiled engine, as `serve run` prefills it, with the stacked
    mask built once per forward (new) or SDPA with `enable_gqa` (old). Each round opens a
    session with a fresh history and takes two turns, one with each call, which goes first
    alternating (the second turn sees `new_tokens + 1` more context)."""
    eng = engine(loaded, sessions=True, radix=False, max_running=4, num_slots=16384, compile=True)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    vocab = loaded.model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    tokens = lambda n: torch.randint(5, vocab, (n,), generator=gen).tolist()  # noqa: E731
    new = torch_backend.grouped_attention
    calls = {"old": replaced, "new": new}
    times: dict[str, list[float]] = {n: [] for n in calls}
    try:
        for r in range(rounds + 1):  # the first round warms up the shapes
            sid = eng.open_session()
            eng.generate([tokens(history)], params, session_id=sid)
            for name in sorted(calls, reverse=r % 2 == 1):
                torch_backend.grouped_attention = calls[name]
                started = time.perf_counter()
                eng.generate([tokens(new_tokens)], params, session_id=sid)
                if r:
                    times[name].append((time.perf_counter() - started) * 1e3)
            eng.close_session(sid)
    finally:
        torch_backend.grouped_attention = new
    old, got = median(times["old"]), median(times["new"])
    print(
        f"compiled engine, turns of {new_tokens} over {history}: old {old:.1f} ms a turn, "
        f"new {got:.1f} ms, {old / got:.2f}x"
    )
    return {f"turn_speedup_{new_tokens}x{history}": round(old / got, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--engine", action="store_true", help="also the eager engine's decode step")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=400)
    ap.add_argument(
        "--turns", action="store_true", help="also session turns in the compiled engine"
    )
    args = ap.parse_args()
    setup_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    loaded = run_on_passing_thread(lambda: load("default", dtype), "load")
    summary: dict = {"benchmark": "grouped_attention", "machine": machine(), "dtype": args.dtype}
    config = loaded.model.config  # each part on a thread that exits (replicas/openmp.py)
    summary |= run_on_passing_thread(lambda: kernel_points(config, dtype, args.rounds), "kernel")
    if args.engine:
        point = run_on_passing_thread(
            lambda: engine_point(loaded, args.batch, args.context, max(2, args.rounds // 2)),
            "engine",
        )
        summary |= point
    if args.turns:
        for history, new_tokens in ((1500, 115), (400, 115)):
            summary |= run_on_passing_thread(
                lambda h=history, n=new_tokens: turn_point(loaded, h, n, args.rounds), "turns"
            )
    emit(summary)


if __name__ == "__main__":
    main()
