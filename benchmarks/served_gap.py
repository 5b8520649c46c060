"""What serving costs a request: the same prompt and answer length decoded by the engine in
this process, then streamed from a running server over HTTP (the official `openai` client).

Run the server first (e.g. `serve run benchmarks/serve-cpu-bench.yaml`), alone on the
machine; this script builds the in-process engine only after the served requests are done, so
the two never decode at once (the idle server's processes stay up meanwhile; `--local-only`
with the server stopped measures the engine with no Ray on the machine). Per request: time
to first token and the mean gap per token after it; the ratios served / in-process. The
in-process engine uses the bench config's shape (compiled forward, 2 torch threads).

    .venv/bin/python -m benchmarks.served_gap --target http://127.0.0.1:8000/v1 [--requests 4]
    .venv/bin/python -m benchmarks.served_gap --local-only     # the server stopped: no Ray up
    .venv/bin/python -m benchmarks.served_gap --local-only --batch 8   # also 8 requests at once
    .venv/bin/python -m benchmarks.served_gap --local-only --workloads multiturn pressure \\
        pressure_radix   # serving.py's conversation workloads (pressure_radix: no sessions)

The conversation workloads also say where their time went: per compiled package (the
forward's, the decode step's, the prefill's) its calls, ms a call and share of the wall time.
The last line is JSON: ttft_s and ms_per_token for both sides, and their ratios (with
--local-only, the in-process figures, and per workload round `ms_<package>` and
`share_<package>`).
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

import openai

from benchmarks.common import bench_config_engine, emit, machine, setup_threads
from benchmarks.serving import (
    MULTITURN_SEED,
    MULTITURN_SHAPE,
    PRESSURE_SEED,
    PRESSURE_SHAPE,
    multiturn_order,
    pressure_order,
    turn_text,
    user_text,
)
from benchmarks.step_phases import timed
from sessionserve.replicas.engine import Engine
from sessionserve.replicas.prompts import chat_input_ids
from sessionserve.wire import SamplingParams

# serving.py's conversation workloads at its defaults: (order, concurrency, seed, sessions);
# pressure_radix sends each turn as a plain request with the whole conversation, which only
# the radix prefix cache (an LRU, as vLLM's) can reuse: the sessions' baseline, same engine
_PRESSURE = (pressure_order(*PRESSURE_SHAPE[:2]), PRESSURE_SHAPE[2], PRESSURE_SEED)
CONVERSATION_WORKLOADS = {
    "multiturn": (multiturn_order(*MULTITURN_SHAPE), MULTITURN_SHAPE[0], MULTITURN_SEED, True),
    "pressure": (*_PRESSURE, True),
    "pressure_radix": (*_PRESSURE, False),
}

WORDS = ("river stone light garden window market letter winter music paper " * 30).split()


def prompt(i: int, words: int) -> str:
    return " ".join(WORDS[i : i + words])


def served(target: str, model: str | None, n: int, words: int, tokens: int) -> list[tuple]:
    client = openai.OpenAI(base_url=target, api_key="unused")
    model = model or client.models.list().data[0].id
    out = []
    for i in range(n):
        t0, arrivals = time.perf_counter(), []
        stream = client.completions.create(
            model=model,
            prompt=prompt(i, words),
            max_tokens=tokens,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        for _ in stream:
            arrivals.append(time.perf_counter() - t0)
        # ignore_eos: exactly `tokens` tokens, however many chunks they came in
        out.append((arrivals[0], (arrivals[-1] - arrivals[0]) / (tokens - 1)))
    return out


def in_process(
    n: int,
    words: int,
    tokens: int,
    threads: int,
    dtype: str,
    batch: int = 0,
    batch_rates: list[float] | None = None,
    workloads: dict[str, list[ConversationsRun]] | None = None,
    kv_tokens: int | None = None,
    kv_dtype: str = "auto",
    model_path: str = "default",
) -> list[tuple]:
    """`n` requests one after another (TTFT, ms per token each), then with `batch` the
    `batched` rounds, whose rates go to `batch_rates`, then two rounds of each
    `serving.py` conversation workload named in `workloads` (its runs go there). KV:
    `kv_tokens` (in `kv_dtype`), or 1 GiB as the bench configs. The model: `model_path`
    (`model.path`: match the server's)."""
    batch_rates = batch_rates if batch_rates is not None else []
    setup_threads(threads)
    eng = bench_config_engine(threads, dtype, kv_tokens, kv_dtype=kv_dtype, model_path=model_path)
    out = [decode_one(eng, prompt(i, words), tokens) for i in range(n)]
    for rate in batched(eng, batch, words, tokens):
        print(f"in-process, {batch} requests at once: {rate:.1f} output tok/s", flush=True)
        batch_rates.append(rate)
    for name, runs in (workloads or {}).items():
        for _ in range(2):
            run = conversations(eng, *CONVERSATION_WORKLOADS[name])
            split = ", ".join(
                f"{label} {n} x {ms:.1f} ms ({share:.0%})"
                for label, (n, ms, share) in run.packages.items()
            )
            print(
                f"in-process {name}: {run.output_tok_s:.1f} output tok/s, median TTFT "
                f"{run.ttft_median_s:.3f} s, cached {run.cached_frac:.0%}; packages: {split}",
                flush=True,
            )
            runs.append(run)
    return out


def decode_one(eng: Engine, text: str, tokens: int) -> tuple[float, float]:
    """One request of `tokens` tokens (greedy, EOS ignored) stepped to its end, alone on the
    engine: its time to first token and mean seconds per token after it."""
    ids = eng.tokenizer(text, add_special_tokens=False).input_ids
    rid = eng.submit(ids, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    t0, first = time.perf_counter(), None
    while eng.has_work():
        events = eng.step()
        if first is None and any(e.new_token_ids for e in events):
            first = time.perf_counter() - t0
    total = time.perf_counter() - t0
    eng.take_result(rid)
    assert first is not None, "the request gave no token"
    return first, (total - first) / (tokens - 1)


def batched(
    eng: Engine,
    n: int,
    words: int,
    tokens: int,
    rounds: int = 2,
    seed: int = 11,
    warm_up: bool = True,
) -> list[float]:
    """Output tokens/s of `rounds` rounds of `n` requests submitted together, after a warm-up
    round (unless not `warm_up`); none when `n` is 0. The prompts are `benchmarks/serving.py`'s
    single workload's (a chat-templated request of `words` random words, each one new; from
    `seed`, so calls with other seeds meet no cached prefix), so this is what that workload at
    concurrency n asks of a server, without the server."""
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    rng, rates = random.Random(seed), []
    for r in range(rounds + warm_up if n else 0):
        ids = [single_prompt_ids(eng, user_text(rng, words)) for _ in range(n)]
        started = time.perf_counter()
        eng.generate(ids, params)
        if r >= warm_up:  # the first round is the warm-up
            rates.append(n * tokens / (time.perf_counter() - started))
    return rates


def single_prompt_ids(eng: Engine, message: str) -> list[int]:
    """`message` as serving.py's single workload sends it: a chat request, or for a base model
    (no chat template) the `--api completions` prompt."""
    if eng.tokenizer.chat_template is None:
        return eng.tokenizer(turn_text(message, first=True)).input_ids
    return chat_input_ids(eng.tokenizer, "", [{"role": "user", "content": message}])


@dataclass
class ConversationsRun:
    output_tok_s: float
    ttft_median_s: float
    cached_frac: float  # prompt tokens reused from a session or the radix cache
    # per compiled package that ran (forward, decode, prefill): calls, ms a call, share of
    # the run's wall time (what a turn's time goes to: decode steps or prefills)
    packages: dict[str, tuple[int, float, float]] = field(default_factory=dict)


def compared_runs(
    workload: str, runs: dict[str, list[ConversationsRun]], new: str, base: str
) -> dict[str, Any]:
    """Each contender's medians over its rounds of `workload` (`<w>_tok_s_<name>`,
    `<w>_ttft_s_<name>`, `<w>_cached_<name>`) and `new`'s over `base`'s (`<w>_tok_s_ratio`,
    `<w>_ttft_ratio`): the JSON of the scripts that alternate two engines on one workload."""
    out: dict[str, Any] = {}
    for name, got in runs.items():
        out[f"{workload}_tok_s_{name}"] = round(statistics.median(x.output_tok_s for x in got), 1)
        out[f"{workload}_ttft_s_{name}"] = round(statistics.median(x.ttft_median_s for x in got), 3)
        out[f"{workload}_cached_{name}"] = round(statistics.median(x.cached_frac for x in got), 3)
    for measure, key in (("tok_s", "tok_s_ratio"), ("ttft_s", "ttft_ratio")):
        ratio = out[f"{workload}_{measure}_{new}"] / out[f"{workload}_{measure}_{base}"]
        out[f"{workload}_{key}"] = round(ratio, 3)
    return out


def conversations(
    eng: Engine,
    order: list[int],
    concurrency: int,
    seed: int,
    sessions: bool = True,
    answer: int = 32,
) -> ConversationsRun:
    """`benchmarks/serving.py`'s `conversations` without the server: conversation `order[i]`
    takes its next chat turn (a ~150-token user message, `answer` tokens back, the whole
    conversation sent in chat mode as the served app sends it, in a session), at most
    `concurrency` turns holding a slot, in order: as there, a turn takes a slot first and then
    waits for its conversation's previous turn. A turn starts as soon as it can, as its
    client would. Times to first token count from submission (no HTTP in them). Without
    `sessions` each turn is a plain request (the radix cache reuses what it still holds). The
    radix cache is emptied first, so a round does not reuse an earlier round's prompts."""
    params = SamplingParams(max_tokens=answer, temperature=0, ignore_eos=True)
    rng = random.Random(seed)
    history: dict[int, list[dict[str, str]]] = {}
    sids: dict[int, str] = {}
    queue = deque(order)
    waiting: deque[int] = deque()  # turns holding a slot, their conversation's turn running
    live: dict[str, tuple[int, float]] = {}  # request -> conversation, submitted at
    ttfts: list[float] = []
    generated = prompt = cached = 0

    def take(conv: int) -> None:
        turns = history.setdefault(conv, [])
        turns.append({"role": "user", "content": user_text(rng, 100)})
        ids = chat_input_ids(eng.tokenizer, "", turns)
        if not sessions:
            rid = eng.submit(ids, params)
        else:
            if conv not in sids:
                sids[conv] = eng.open_session()
            rid = eng.submit(ids, params, session_id=sids[conv], mode="chat")
        live[rid] = (conv, time.perf_counter())

    def admit() -> None:
        while queue and len(live) + len(waiting) < concurrency:
            conv = queue.popleft()
            if any(c == conv for c, _ in live.values()):
                waiting.append(conv)
            else:
                take(conv)

    eng.cache.flush()
    seconds: Counter = Counter()
    calls: Counter = Counter()
    runner = eng.runner
    packages = {
        "forward": runner.compiled,
        "decode": runner.compiled_decode,
        "prefill": runner.compiled_prefill,
    }
    timers = contextlib.ExitStack()
    for label, package in packages.items():
        if package is not None:
            timers.enter_context(timed(package, "run", label, seconds, calls))
    started = time.perf_counter()
    admit()
    seen: set[str] = set()
    with timers:
        while live:
            events = eng.step()
            now = time.perf_counter()
            for e in events:
                if e.new_token_ids and e.rid not in seen:
                    seen.add(e.rid)
                    ttfts.append(now - live[e.rid][1])
                if e.result is not None:
                    conv, _ = live.pop(e.rid)
                    r = e.result
                    generated += len(r.output_ids)
                    prompt, cached = prompt + r.prompt_tokens, cached + r.cached_tokens
                    answer_text = eng.tokenizer.decode(r.output_ids)
                    history[conv].append({"role": "assistant", "content": answer_text})
                    if conv in waiting:  # its next turn held a slot: it goes first
                        waiting.remove(conv)
                        take(conv)
            admit()
    wall = time.perf_counter() - started
    for sid in sids.values():
        eng.close_session(sid)
    shares = {k: (calls[k], 1e3 * seconds[k] / calls[k], seconds[k] / wall) for k in calls}
    return ConversationsRun(
        generated / wall, statistics.median(ttfts), cached / max(1, prompt), shares
    )


def medians(rows: list[tuple]) -> tuple[float, float]:
    """Median TTFT and per-token gap, leaving out the first request (it pays first-call costs)."""
    return statistics.median(r[0] for r in rows[1:]), statistics.median(r[1] for r in rows[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", help="the running server's OpenAI base URL")
    ap.add_argument(
        "--local-only",
        action="store_true",
        help="only the in-process engine (run with no server up: what the cores give alone)",
    )
    ap.add_argument("--model", help="model id (default: the server's first)")
    ap.add_argument(
        "--model-path",
        default="default",
        help="the in-process engine's model.path (match the server's: e.g. gemma3-270m for "
        "serve-gemma3-bench-bf16.yaml)",
    )
    ap.add_argument(
        "--requests",
        type=int,
        default=4,
        help="one after another on each side; the first is a warm-up, so at least 2",
    )
    ap.add_argument("--words", type=int, default=250, help="prompt length in words")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--batch",
        type=int,
        default=0,
        help="with --local-only: also time rounds of this many requests at once in process "
        "(serving.py's single-workload prompts, with --words 200 as there)",
    )
    ap.add_argument(
        "--workloads",
        nargs="*",
        choices=sorted(CONVERSATION_WORKLOADS),
        default=[],
        help="with --local-only: also run these serving.py workloads in process, two rounds "
        "each (multiturn: 4 sessions x 10 turns; pressure: 64 x 4 turns in a random order, 4 "
        "at a time, over the bench configs' 1 GiB of KV; pressure_radix: the same as plain "
        "requests, reused by the radix cache only)",
    )
    ap.add_argument(
        "--kv-tokens",
        type=int,
        help="the in-process engine's KV pool in tokens (default: 1 GiB, the bench configs'); "
        "e.g. 12800 holds ~16 of the pressure workload's conversations at their last turn",
    )
    ap.add_argument(
        "--kv-dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="the in-process engine's cache.kv_dtype (with --kv-tokens, give bfloat16 twice "
        "float32's tokens for the same bytes)",
    )
    ap.add_argument(
        "--dtype",
        default="auto",
        help="the in-process model's (match the server's: auto is bfloat16 on CPUs with native "
        "bf16, as serve-cpu-bench-bf16.yaml; serve-cpu-bench.yaml is float32)",
    )
    args = ap.parse_args()
    if args.requests < 2:
        ap.error("--requests must be at least 2: the first request is a warm-up, left out")
    if args.tokens < 2:
        ap.error("--tokens must be at least 2 (the gap after the first token is what is timed)")
    if not args.local_only and not args.target:
        ap.error("give --target (a running server) or --local-only")
    if args.local_only:
        rates: list[float] = []
        workloads: dict[str, list[ConversationsRun]] = {w: [] for w in args.workloads}
        local = in_process(
            args.requests,
            args.words,
            args.tokens,
            args.threads,
            args.dtype,
            args.batch,
            rates,
            workloads,
            args.kv_tokens,
            args.kv_dtype,
            args.model_path,
        )
        ttft, gap = medians(local)
        print(f"machine: {machine()}; in-process TTFT {ttft:.3f} s, {1000 * gap:.1f} ms/token")
        emit(
            {
                "benchmark": "served_gap",
                "local_ttft_s": round(ttft, 3),
                "local_ms_per_token": round(1000 * gap, 1),
                **(
                    {f"local_tok_s_batch_{args.batch}": [round(r, 1) for r in rates]}
                    if rates
                    else {}
                ),
                **{
                    f"local_{name}": [
                        {
                            "output_tok_s": round(r.output_tok_s, 1),
                            "ttft_median_s": round(r.ttft_median_s, 3),
                            "cached_frac": round(r.cached_frac, 3),
                            **{
                                f"ms_{label}": round(ms, 2)
                                for label, (_, ms, _) in r.packages.items()
                            },
                            **{
                                f"share_{label}": round(share, 3)
                                for label, (_, _, share) in r.packages.items()
                            },
                        }
                        for r in runs
                    ]
                    for name, runs in workloads.items()
                },
            }
        )
        return
    remote = served(args.target, args.model, args.requests, args.words, args.tokens)
    local = in_process(
        args.requests, args.words, args.tokens, args.threads, args.dtype, model_path=args.model_path
    )
    print(f"machine: {machine()}")
    print(
        f"{'request':>7} {'served TTFT s':>14} {'served ms/tok':>14} {'local TTFT s':>13} "
        f"{'local ms/tok':>13}"
    )
    for i, ((st, sg), (lt, lg)) in enumerate(zip(remote, local, strict=True)):
        print(f"{i + 1:>7} {st:>14.3f} {1000 * sg:>14.1f} {lt:>13.3f} {1000 * lg:>13.1f}")
    s_ttft, s_gap = medians(remote)
    l_ttft, l_gap = medians(local)
    emit(
        {
            "benchmark": "served_gap",
            "served_ttft_s": round(s_ttft, 3),
            "local_ttft_s": round(l_ttft, 3),
            "served_ms_per_token": round(1000 * s_gap, 1),
            "local_ms_per_token": round(1000 * l_gap, 1),
            "ttft_ratio_served_over_local": round(s_ttft / l_ttft, 2),
            "step_ratio_served_over_local": round(s_gap / l_gap, 2),
        }
    )


if __name__ == "__main__":
    main()
