"""Prompts computed one after another (`scheduler.prefill_batch_tokens`, 64 on a CPU) against
as many in one step as `max_prefill_tokens` holds (null), the same engine otherwise, rounds
alternating in one process: median time to first token and output tokens/s.

Workloads (greedy, EOS ignored): `burst`, 16 requests of a 300-token prompt and 64 tokens at
concurrency 8 (a finished request's place is taken at once); `turns`, 4 sessions taking 6 turns
together (~150 new tokens a turn over their held history, 32-token answers: every turn of a
round arrives at once, as in benchmarks/serving.py's multi-turn workload); `tiny`, 32 prompts of
20 tokens at once, 8 tokens each (where batching prompts pays: the limit still lets them share
steps). TTFT is measured from `submit` to the step that samples the first token.

    .venv/bin/python -m benchmarks.prefill_batching [--rounds 3] [--dtype bfloat16] [--limit N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common import emit, engine, load, machine, median, setup_threads
from sessionserve.config import ModelConfig
from sessionserve.replicas.engine import Engine
from sessionserve.replicas.openmp import run_on_passing_thread
from sessionserve.wire import SamplingParams


def drive(eng: Engine, pending: list[list[int]], params: SamplingParams, concurrency: int):
    """Serve `pending` with at most `concurrency` in flight: (output tokens/s, median TTFT s)."""
    submitted, first, rids = {}, {}, []
    pending = list(pending)
    started = time.perf_counter()
    while pending or eng.has_work():
        while pending and _live(eng) < concurrency:
            rid = eng.submit(pending.pop(0), params)
            submitted[rid] = time.perf_counter()
            rids.append(rid)
        _step(eng, first)
    wall = time.perf_counter() - started
    tokens = sum(len(eng.take_result(r).output_ids) for r in rids)
    return tokens / wall, statistics.median(first[r] - submitted[r] for r in rids)


def _live(eng: Engine) -> int:
    return len(eng.scheduler.running) + len(eng.scheduler.waiting)


def _step(eng: Engine, first: dict[str, float]) -> None:
    """One engine step; notes when each request still running has its first token (every
    workload here asks for several tokens, so a request is running when it gets its first)."""
    eng.step()
    now = time.perf_counter()
    for r in eng.scheduler.running:
        if r.sampled and r.rid not in first:
            first[r.rid] = now


def turns(eng: Engine, gen: torch.Generator, vocab: int) -> tuple[float, float]:
    """4 sessions, 6 turns each, every turn of a round submitted together."""
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    sids = [eng.open_session() for _ in range(4)]
    ttfts, tokens, started = [], 0, time.perf_counter()
    for _ in range(6):
        rids, submitted, first = [], {}, {}
        for sid in sids:
            new = torch.randint(5, vocab, (150,), generator=gen).tolist()
            rid = eng.submit(new, params, session_id=sid)
            rids.append(rid)
            submitted[rid] = time.perf_counter()
        while eng.has_work():
            _step(eng, first)
        ttfts += [first[r] - submitted[r] for r in rids]
        tokens += sum(len(eng.take_result(r).output_ids) for r in rids)
    for sid in sids:
        eng.close_session(sid)
    return tokens / (time.perf_counter() - started), statistics.median(ttfts)


def measure(engines: dict[str, Engine], vocab: int, rounds: int) -> dict[str, dict]:
    gen = torch.Generator().manual_seed(0)
    prompt = lambda n: torch.randint(5, vocab, (n,), generator=gen).tolist()  # noqa: E731
    workloads = {
        "burst": lambda e: drive(
            e,
            [prompt(300) for _ in range(16)],
            SamplingParams(max_tokens=64, temperature=0, ignore_eos=True),
            8,
        ),
        "turns": lambda e: turns(e, gen, vocab),
        "tiny": lambda e: drive(
            e,
            [prompt(20) for _ in range(32)],
            SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
            32,
        ),
    }
    got: dict[str, dict] = {w: {n: [] for n in engines} for w in workloads}
    for r in range(rounds + 1):  # round 0 warms up every shape
        for w, run in workloads.items():
            for name in sorted(engines, reverse=r % 2 == 1):  # which goes first alternates
                tok_s, ttft = run(engines[name])
                if r:
                    got[w][name].append((tok_s, ttft))
                    print(f"round {r} {w} {name}: {tok_s:.1f} tok/s, median TTFT {ttft:.3f} s")
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto")
    ap.add_argument("--limit", type=int, default=None, help="tokens (default: auto's choice)")
    args = ap.parse_args()
    setup_threads(args.threads)
    dtype = ModelConfig(dtype=args.dtype).torch_dtype()  # auto: bf16 on a CPU with native bf16
    loaded = run_on_passing_thread(lambda: load("default", dtype), "load")

    def build(limit) -> Engine:
        return engine(
            loaded,
            max_running=32,
            prefill=512,
            num_slots=32768,
            compile=True,
            prefill_batch_tokens=limit,
        )

    limits = {"limit": args.limit if args.limit is not None else "auto", "none": None}
    engines = {n: run_on_passing_thread(lambda v=v: build(v), n) for n, v in limits.items()}
    vocab = loaded.model.config.vocab_size
    got = run_on_passing_thread(lambda: measure(engines, vocab, args.rounds), "measure")
    summary: dict = {"benchmark": "prefill_batching", "machine": machine()}
    summary["dtype"] = str(loaded.model.dtype).removeprefix("torch.")
    summary["limit_tokens"] = engines["limit"].scheduler.prefill_batch_limit
    for w, by_name in got.items():
        tok = {n: median([t for t, _ in v]) for n, v in by_name.items()}
        ttft = {n: median([f for _, f in v]) for n, v in by_name.items()}
        summary[f"{w}_tok_s_ratio"] = round(tok["limit"] / tok["none"], 3)
        summary[f"{w}_ttft_ratio"] = round(ttft["limit"] / ttft["none"], 3)
        summary[f"{w}_ttft_s"] = {n: round(v, 3) for n, v in ttft.items()}
        print(
            f"{w}: tok/s limit {tok['limit']:.1f} / none {tok['none']:.1f} "
            f"({tok['limit'] / tok['none']:.2f}x); median TTFT {ttft['limit']:.3f} / "
            f"{ttft['none']:.3f} s ({ttft['limit'] / ttft['none']:.2f}x)"
        )
    emit(summary)


if __name__ == "__main__":
    main()
