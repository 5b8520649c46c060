"""Serving over HTTP against any OpenAI-compatible server (ours, or a peer such as vLLM), with
the official `openai` client, streaming; side by side when given several targets.

Workloads (greedy unless `--temperature` and `--top-p` say otherwise, each request then
seeded by its place in the workload; `ignore_eos` so every server writes exactly the
requested tokens):
  multiturn  C conversations taking T turns each, concurrently (~150-token user turns,
             32-token answers; each turn resends the whole history, as a chat client does)
  single     one-turn requests: a ~300-token prompt, 64 tokens, at concurrency 1 and 8
  pressure   N conversations taking turns in a random order (seeded), C at a time: with more
             live conversations than the server's KV holds, an LRU prefix cache evicts the
             histories that come back next; sessions keep them (size both servers' KV alike:
             for ~16 of the 64 conversations, ~730 tokens each at their end, as
             serve-cpu-bench-bf16-pressure.yaml and vLLM's --num-gpu-blocks-override 92 do;
             1 GiB of bf16 KV holds them all)
`--api completions` drives `/v1/completions` instead (a base model, such as Gemma 3 270M, has
no chat template): a conversation is one text, each turn adding "User: <message>" and
"Assistant:" lines and the answer. A server that says it is sessionserve (`owned_by` in
/v1/models) is sent each turn's new text alone, under the conversation's session (append
mode, as a session client sends it); any other server the whole text so far, as a client
of a stateless server resends it (its prefix cache reuses what it can). The two then
tokenize the history in pieces and whole, which may differ at a boundary: prompt lengths
agree within a few tokens, not exactly.
Two servers can also run one after the other: `--save a.json` on the first run, then
`--against a.json` on the second prints the ratios (this run / that run).
Every request carries `x-session-id: <conversation>` (sessionserve pins and keeps the session;
other servers ignore the header). Printed per target and workload: output tokens/s, median
and last-turn TTFT, median time per output token after the first (TPOT: the decode's pace),
cached prompt tokens; with two targets, the ratios first/second. Targets
run one after the other, workload by workload (alternating), so they never share the cores.

Two servers up side by side on a small machine still share it: the idle one's timers and
daemons take the cores' time (Ray's ~0.2 of a core on 2 cores). `--server-pid` names each
target's processes (`ray`: every Ray process on the machine; or the PID of the command that
started the server, `vllm serve`'s, whose process tree is its server) and pauses the other
targets' (SIGSTOP, resumed after; a few minutes is within Ray's and vLLM's timeouts) while
one is measured. `--rounds N` repeats the whole alternation, each round with new prompts
(the same for every target) and the first target first in even rounds, last in odd ones, so
a machine whose speed drifts within the hour (these VMs' does) is read in the same minutes
for both; figures are the rounds' medians, and each round's ratio is printed as well.
`--first-round K` starts at round K's prompts: a server measured before holds the earlier
rounds' in its prefix cache, and would answer them faster.

    .venv/bin/python -m benchmarks.serving --target http://127.0.0.1:8000/v1 \\
        [--target http://127.0.0.1:8001/v1] [--workloads multiturn single pressure] \\
        [--server-pid ray --server-pid <vllm serve PID> --rounds 3] [--api completions]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import time
import zlib
from dataclasses import dataclass, field

import openai

from benchmarks.common import emit
from benchmarks.processes import paused, process_tree, ray_processes

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
    tpot_s: float | None = None  # time per output token after the first (the decode's pace)


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
        tpot = [t.tpot_s for t in self.turns if t.tpot_s is not None]
        return {
            "output_tok_s": round(self.output_tok_s, 2),
            "ttft_median_s": round(statistics.median(ttft), 3),
            "last_turn_ttft_s": round(statistics.median(self.last_turn_ttft), 3)
            if self.last_turn_ttft
            else None,
            "tpot_median_s": round(statistics.median(tpot), 4) if tpot else None,
            "cached_frac": round(
                sum(t.cached_tokens for t in self.turns)
                / max(1, sum(t.prompt_tokens for t in self.turns)),
                3,
            ),
        }


def user_text(rng: random.Random, words: int) -> str:
    return "Please write about " + " ".join(rng.choice(WORDS) for _ in range(words)) + "."


@dataclass
class Target:
    """A server under test: its client, its model, and how a conversation is sent to it."""

    url: str
    client: openai.AsyncOpenAI
    model: str
    api: str = "chat"  # or "completions" (`--api`)
    appends: bool = False  # completions: each turn's new text alone, under its session
    temperature: float = 0.0  # `--temperature`, `--top-p`: sampled requests, seeded
    top_p: float = 1.0


async def one_turn(
    target: Target, prompt: list[dict] | str, max_tokens: int, sid: str
) -> tuple[Turn, str]:
    """One streamed request: chat `messages`, or a completions prompt's text."""
    started = time.perf_counter()
    common: dict = {
        "model": target.model,
        "max_tokens": max_tokens,
        "temperature": target.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        "extra_body": {"ignore_eos": True},
        "extra_headers": {"x-session-id": sid},
    }
    if target.temperature > 0:  # the same seed for a request on every server
        common |= {"top_p": target.top_p, "seed": zlib.crc32(f"{sid}{prompt}".encode())}
    if isinstance(prompt, str):
        stream = await target.client.completions.create(prompt=prompt, **common)
    else:
        stream = await target.client.chat.completions.create(messages=prompt, **common)
    ttft, text, usage = None, [], None
    async for chunk in stream:
        piece = None
        if chunk.choices:
            choice = chunk.choices[0]
            piece = choice.text if isinstance(prompt, str) else choice.delta.content
        if piece:
            ttft = ttft if ttft is not None else time.perf_counter() - started
            text.append(piece)
        if chunk.usage is not None:
            usage = chunk.usage
    if usage is None:
        raise RuntimeError("the server sent no usage (stream_options.include_usage)")
    details = usage.prompt_tokens_details
    cached = (details.cached_tokens or 0) if details is not None else 0
    ended = time.perf_counter()
    tpot = None
    if ttft is not None and usage.completion_tokens > 1:
        tpot = (ended - started - ttft) / (usage.completion_tokens - 1)
    turn = Turn(ttft or 0.0, usage.completion_tokens, usage.prompt_tokens, cached, tpot)
    return turn, "".join(text)


def turn_text(message: str, first: bool) -> str:
    """A completions conversation's new text for a user's message (`--api completions`)."""
    return f"{'' if first else chr(10) * 2}User: {message}\nAssistant:"


async def conversations(
    target: Target, order: list[int], concurrency: int, turns: int, tag: str, seed: int
) -> Run:
    """Conversation `order[i]` takes its next turn, at most `concurrency` turns in flight (a
    conversation's turns never overlap: the next waits for the answer)."""
    rng = random.Random(seed)
    histories: dict[int, list[dict]] = {}
    texts: dict[int, str] = {}  # completions: each conversation's text so far
    locks: dict[int, asyncio.Lock] = {}
    run, sem = Run(), asyncio.Semaphore(concurrency)
    taken: dict[int, int] = {}

    async def take(conv: int) -> None:
        async with sem, locks.setdefault(conv, asyncio.Lock()):
            message, sid = user_text(rng, 100), f"{tag}-{conv}"
            if target.api == "completions":
                new = turn_text(message, conv not in texts)
                so_far = texts.get(conv, "")
                turn, answer = await one_turn(
                    target, new if target.appends else so_far + new, 32, sid
                )
                texts[conv] = so_far + new + answer
            else:
                history = histories.setdefault(conv, [])
                history.append({"role": "user", "content": message})
                turn, answer = await one_turn(target, history, 32, sid)
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


async def single(target: Target, concurrency: int, requests: int, tag: str, seed: int = 5) -> Run:
    rng, run, sem = random.Random(seed), Run(), asyncio.Semaphore(concurrency)
    prompts = [user_text(rng, 200) for _ in range(requests)]

    async def one(i: int) -> None:
        async with sem:
            prompt: list[dict] | str = [{"role": "user", "content": prompts[i]}]
            if target.api == "completions":
                prompt = turn_text(prompts[i], first=True)
            turn, _ = await one_turn(target, prompt, 64, f"{tag}-single-{i}")
            run.turns.append(turn)

    started = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(requests)))
    run.wall_s = time.perf_counter() - started
    return run


MULTITURN_SEED, PRESSURE_SEED, SINGLE_SEED = 1, 2, 5  # the user messages' words (`user_text`)
ROUND_SEED_STEP = 1000  # round r's seeds: these + r * ROUND_SEED_STEP (round 0: the seeds above)
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


async def workload(name: str, target: Target, args, tag: str, round_: int = 0) -> dict[str, Run]:
    shift = round_ * ROUND_SEED_STEP  # new prompts each round, the same for every target
    if name == "multiturn":
        order = multiturn_order(args.conversations, args.turns)
        return {
            "multiturn": await conversations(
                target,
                order,
                args.conversations,
                args.turns,
                tag,
                seed=MULTITURN_SEED + shift,
            )
        }
    if name == "single":
        return {
            f"single_c{c}": await single(
                target, c, max(4, 2 * c), f"{tag}-c{c}", seed=SINGLE_SEED + shift
            )
            for c in (1, 8)
        }
    if name == "pressure":
        order = pressure_order(args.pressure_conversations, args.pressure_turns)
        run = await conversations(
            target,
            order,
            args.pressure_concurrency,
            args.pressure_turns,
            tag,
            seed=PRESSURE_SEED + shift,
        )
        return {"pressure": run}
    raise ValueError(f"unknown workload {name!r}")


def server_processes(spec: str) -> list[int]:
    """`--server-pid`'s value: `ray` (every Ray process here) or the PID a server's process
    tree starts from."""
    if spec == "ray":
        return ray_processes()
    return process_tree(int(spec))


def others_paused(specs: list[str], measured: int, settle_s: float):
    """Every target's processes but `measured`'s stopped for the block (none named: nothing)."""
    if not specs:
        return contextlib.nullcontext()
    pids = [p for j, spec in enumerate(specs) if j != measured for p in server_processes(spec)]
    return paused(pids, settle_s=settle_s)


def median_summary(rounds: list[dict]) -> dict:
    """The rounds' medians, key by key (a key a round lacks, e.g. no last turns, is left out),
    with each round's own figures under `rounds` when there were several."""
    keys = [k for k in rounds[0] if all(r.get(k) is not None for r in rounds)]
    out: dict = {k: round(statistics.median(r[k] for r in rounds), 4) for k in keys}
    if len(rounds) > 1:
        out["rounds"] = rounds
    return out


async def main_async(args) -> None:
    if args.rounds < 1 or args.first_round < 0:
        raise SystemExit("--rounds must be at least 1 and --first-round at least 0")
    if args.server_pid and len(args.server_pid) != len(args.target):
        raise SystemExit("give one --server-pid per --target (in the same order), or none")
    for spec in args.server_pid or []:
        server_processes(spec)  # fails now, not after the first target's run, on a bad PID
    targets = []
    for url in args.target:
        client = openai.AsyncOpenAI(base_url=url, api_key=args.api_key, timeout=600)
        model = (await client.models.list()).data[0]
        appends = args.api == "completions" and model.owned_by == "sessionserve"
        targets.append(
            Target(url, client, model.id, args.api, appends, args.temperature, args.top_p)
        )
        if args.api == "completions":
            how = "each turn's new text (append mode)" if appends else "the whole text"
            print(f"{url}: completions, sending {how}", flush=True)
    per_round: dict[str, dict[str, list[dict]]] = {t.url: {} for t in targets}
    tag = f"bench-{int(time.time())}"
    for r in range(args.first_round, args.first_round + args.rounds):
        for name in args.workloads:
            order = list(enumerate(targets))
            if r % 2:
                order.reverse()  # drift within the hour falls on both sides alike
            for i, target in order:
                with others_paused(args.server_pid or [], i, args.settle_s):
                    runs = await workload(name, target, args, f"{tag}-{i}-r{r}", r)
                for key, run in runs.items():
                    s = run.summary()
                    per_round[target.url].setdefault(key, []).append(s)
                    label = f"round {r} " if args.rounds > 1 or args.first_round else ""
                    print(f"{label}{key:>12} {target.url}: {s}", flush=True)
    results = {
        url: {key: median_summary(rounds) for key, rounds in keys.items()}
        for url, keys in per_round.items()
    }
    if args.rounds > 1:
        for url, keys in results.items():
            for key, s in keys.items():
                shown = {k: v for k, v in s.items() if k != "rounds"}
                print(f"median of {args.rounds} {key:>12} {url}: {shown}", flush=True)
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
            if this[key].get("tpot_median_s") and that[key].get("tpot_median_s"):
                summary[f"tpot_ratio_{key}"] = round(
                    this[key]["tpot_median_s"] / that[key]["tpot_median_s"], 2
                )
            if "rounds" in this[key] and "rounds" in that[key]:  # paired: the same round's
                summary[f"tok_s_ratio_{key}_rounds"] = [
                    round(a["output_tok_s"] / b["output_tok_s"], 2)
                    for a, b in zip(this[key]["rounds"], that[key]["rounds"], strict=False)
                ]
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
    ap.add_argument(
        "--temperature", type=float, default=0.0, help="above 0: sampled requests, seeded"
    )
    ap.add_argument("--top-p", type=float, default=1.0, help="with --temperature")
    ap.add_argument(
        "--api",
        choices=["chat", "completions"],
        default="chat",
        help="completions: for a base model (sessionserve targets get append-mode turns)",
    )
    ap.add_argument("--save", help="also write this run's JSON here")
    ap.add_argument(
        "--rounds", type=int, default=1, help="repeat the alternation, new prompts each round"
    )
    ap.add_argument(
        "--first-round",
        type=int,
        default=0,
        help="start at this round's prompts (a server measured before still holds round 0's)",
    )
    ap.add_argument(
        "--server-pid",
        action="append",
        help="per --target, in order: `ray` or the PID of the command that started it; the "
        "other targets' processes are paused while one is measured",
    )
    ap.add_argument(
        "--settle-s",
        type=float,
        default=2.0,
        help="after pausing the others, wait this long (the measured one catches up its timers)",
    )
    ap.add_argument(
        "--against",
        help="compare with a run saved by --save (ratios: this run's first target / that run's)",
    )
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()
