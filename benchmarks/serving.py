"""Serving over HTTP against any OpenAI-compatible server (ours, or a peer such as vLLM), with
the official `openai` client, streaming; side by side when given several targets.

Workloads (greedy, `ignore_eos` so every server writes exactly the requested tokens):
  multiturn  C conversations taking T turns each, concurrently (~150-token user turns,
             32-token answers; each turn resends the whole history, as a chat client does)
  single     one-turn requests: a ~300-token prompt, 64 tokens, at concurrency 1 and 8
  pressure   N conversations taking turns in a random order (seeded), C at a time: with more
             live conversations than the server's KV holds, an LRU prefix cache evicts the
             histories that come back next; sessions keep them (size both servers' KV alike)
Two servers can also run one after the other: `--save a.json` on the first run, then
`--against a.json` on the second prints the ratios (this run / that run).
Every request carries `x-session-id: <conversation>` (sessionserve pins and keeps the session;
other servers ignore the header). Printed per target and workload: output tokens/s, median
and last-turn TTFT, cached prompt tokens; with two targets, the ratios first/second. Targets
run one after the other, workload by workload (alternating), so they never share the cores.

    .venv/bin/python -m benchmarks.serving --target http://127.0.0.1:8000/v1 \\
        [--target http://127.0.0.1:8001/v1] [--workloads multiturn single pressure]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field

import openai

from benchmarks.common import emit

WORDS = (
    "river stone light garden window market letter winter music paper bridge forest "
    "engine harbor village summer mountain station kitchen silver island morning "
    "theory planet signal ocean meadow copper lantern valley thunder"
).split()


@dataclass
class Turn:
    ttft_s: float
    output_tokens: int
    prompt_tokens: int
    cached_tokens: int


@dataclass
class Run:
    wall_s: float = 0.0
    turns: list[Turn] = field(default_factory=list)
    last_turn_ttft: list[float] = field(default_factory=list)  # per conversation

    @property
    def output_tok_s(self) -> float:
        return sum(t.output_tokens for t in self.turns) / self.wall_s

    def summary(self) -> dict[str, float]:
        ttft = [t.ttft_s for t in self.turns]
        return {
            "output_tok_s": round(self.output_tok_s, 2),
            "ttft_median_s": round(statistics.median(ttft), 3),
            "last_turn_ttft_s": round(statistics.median(self.last_turn_ttft), 3)
            if self.last_turn_ttft
            else None,
            "cached_frac": round(
                sum(t.cached_tokens for t in self.turns)
                / max(1, sum(t.prompt_tokens for t in self.turns)),
                3,
            ),
        }


def user_text(rng: random.Random, words: int) -> str:
    return "Please write about " + " ".join(rng.choice(WORDS) for _ in range(words)) + "."


async def one_turn(
    client: openai.AsyncOpenAI, model: str, messages: list[dict], max_tokens: int, sid: str
) -> tuple[Turn, str]:
    started = time.perf_counter()
    stream = await client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
        extra_headers={"x-session-id": sid},
    )
    ttft, text, usage = None, [], None
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            ttft = ttft if ttft is not None else time.perf_counter() - started
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    if usage is None:
        raise RuntimeError("the server sent no usage (stream_options.include_usage)")
    details = usage.prompt_tokens_details
    cached = (details.cached_tokens or 0) if details is not None else 0
    turn = Turn(ttft or 0.0, usage.completion_tokens, usage.prompt_tokens, cached)
    return turn, "".join(text)


async def conversations(
    client, model: str, order: list[int], concurrency: int, turns: int, tag: str, seed: int
) -> Run:
    """Conversation `order[i]` takes its next turn, at most `concurrency` turns in flight (a
    conversation's turns never overlap: the next waits for the answer)."""
    rng = random.Random(seed)
    histories: dict[int, list[dict]] = {}
    locks: dict[int, asyncio.Lock] = {}
    run, sem = Run(), asyncio.Semaphore(concurrency)
    taken: dict[int, int] = {}

    async def take(conv: int) -> None:
        async with sem, locks.setdefault(conv, asyncio.Lock()):
            history = histories.setdefault(conv, [])
            history.append({"role": "user", "content": user_text(rng, 100)})
            turn, answer = await one_turn(client, model, history, 32, f"{tag}-{conv}")
            history.append({"role": "assistant", "content": answer})
            run.turns.append(turn)
            taken[conv] = taken.get(conv, 0) + 1
            if taken[conv] == turns:
                run.last_turn_ttft.append(turn.ttft_s)

    started = time.perf_counter()
    pending: list[asyncio.Task] = []
    for conv in order:  # a conversation's turns queue on its lock, in order
        pending.append(asyncio.create_task(take(conv)))
        await asyncio.sleep(0)
    await asyncio.gather(*pending)
    run.wall_s = time.perf_counter() - started
    return run


async def single(client, model: str, concurrency: int, requests: int, tag: str) -> Run:
    rng, run, sem = random.Random(5), Run(), asyncio.Semaphore(concurrency)
    prompts = [user_text(rng, 200) for _ in range(requests)]

    async def one(i: int) -> None:
        async with sem:
            messages = [{"role": "user", "content": prompts[i]}]
            turn, _ = await one_turn(client, model, messages, 64, f"{tag}-single-{i}")
            run.turns.append(turn)

    started = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(requests)))
    run.wall_s = time.perf_counter() - started
    return run


MULTITURN_SEED, PRESSURE_SEED = 1, 2  # the user messages' words (`user_text`)
MULTITURN_SHAPE = (4, 10)  # conversations, turns each (all at once)
PRESSURE_SHAPE = (64, 4, 4)  # conversations, turns each, turns at a time


def multiturn_order(conversations: int, turns: int) -> list[int]:
    """Which conversation takes each turn: all of them in lockstep, turn after turn."""
    return [c for _ in range(turns) for c in range(conversations)]


def pressure_order(conversations: int, turns: int) -> list[int]:
    """Each conversation's `turns` turns in a seeded random order, so that one comes back
    after many others have been served."""
    order = [c for c in range(conversations) for _ in range(turns)]
    random.Random(3).shuffle(order)
    return order


async def workload(name: str, client, model: str, args, tag: str) -> dict[str, Run]:
    if name == "multiturn":
        order = multiturn_order(args.conversations, args.turns)
        return {
            "multiturn": await conversations(
                client, model, order, args.conversations, args.turns, tag, seed=MULTITURN_SEED
            )
        }
    if name == "single":
        return {
            f"single_c{c}": await single(client, model, c, max(4, 2 * c), f"{tag}-c{c}")
            for c in (1, 8)
        }
    if name == "pressure":
        order = pressure_order(args.pressure_conversations, args.pressure_turns)
        run = await conversations(
            client,
            model,
            order,
            args.pressure_concurrency,
            args.pressure_turns,
            tag,
            seed=PRESSURE_SEED,
        )
        return {"pressure": run}
    raise ValueError(f"unknown workload {name!r}")


async def main_async(args) -> None:
    targets = []
    for url in args.target:
        client = openai.AsyncOpenAI(base_url=url, api_key=args.api_key, timeout=600)
        model = (await client.models.list()).data[0].id
        targets.append((url, client, model))
    results: dict[str, dict[str, dict]] = {url: {} for url, _, _ in targets}
    tag = f"bench-{int(time.time())}"
    for name in args.workloads:
        for i, (url, client, model) in enumerate(targets):
            for key, run in (await workload(name, client, model, args, f"{tag}-{i}")).items():
                s = run.summary()
                results[url][key] = s
                print(f"{key:>12} {url}: {s}", flush=True)
    summary: dict = {"benchmark": "serving", "targets": args.target, "results": results}
    if args.save:  # this run only, before anything is compared with it
        with open(args.save, "w") as f:
            json.dump(summary, f)
    pair = list(results.values())
    if args.against:  # a run saved earlier (another server, started alone on these cores; or
        # the same URL before a change): kept apart, so it never replaces this run's figures
        with open(args.against) as f:
            saved = json.load(f)["results"]
        summary["against"] = saved
        pair = [pair[0], next(iter(saved.values()))]
    if len(pair) == 2:
        this, that = pair
        for key in this.keys() & that.keys():
            summary[f"tok_s_ratio_{key}"] = round(
                this[key]["output_tok_s"] / that[key]["output_tok_s"], 2
            )
            summary[f"ttft_ratio_{key}"] = round(
                this[key]["ttft_median_s"] / that[key]["ttft_median_s"], 2
            )
    emit(summary)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", action="append", required=True, help="an OpenAI base URL")
    ap.add_argument("--workloads", nargs="+", default=["multiturn", "single", "pressure"])
    ap.add_argument("--conversations", type=int, default=MULTITURN_SHAPE[0])
    ap.add_argument("--turns", type=int, default=MULTITURN_SHAPE[1])
    ap.add_argument("--pressure-conversations", type=int, default=PRESSURE_SHAPE[0])
    ap.add_argument("--pressure-turns", type=int, default=PRESSURE_SHAPE[1])
    ap.add_argument("--pressure-concurrency", type=int, default=PRESSURE_SHAPE[2])
    ap.add_argument("--api-key", default="unused")
    ap.add_argument("--save", help="also write this run's JSON here")
    ap.add_argument(
        "--against",
        help="compare with a run saved by --save (ratios: this run's first target / that run's)",
    )
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()
