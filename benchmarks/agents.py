"""Agents on sessions: N concurrent tool-calling agents x M rounds on the default model
(SmolLM2-135M, fp32, CPU), through the replica shim in-process (chat template, tool grammar,
call parsing: what a served turn does past the HTTP layer), each round's tool output ~300
tokens. Measured:

- per-round TTFT with sessions (each step prefills its tool result) against stateless requests
  (sessions and radix cache off: each step re-prefills the conversation), the same agents and
  calls (greedy, so both modes make the same calls); `ttft_ratio_round10`; and the last
  round's two prefills alone on the engine (no other agent queued, no decode), what the ratio
  is bounded by on this machine: `prefill_ratio_round10_alone`;
- what the tool-call grammar costs a decode step at batch 8 (the masking of the "auto"
  grammar, free text or a call, replayed over the calls the agents made, against a free
  batch-8 decode step); `grammar_overhead_frac_8`;
- going back to an earlier branch: a conversation of K turns forks (an edited turn K-2), runs
  a turn there, then continues its original branch: the share of that last turn's prompt
  served from cache; `branch_return_cached_frac` (before the rewound branch was kept in the
  radix tree it was the fork point's share, printed beside it).

    .venv/bin/python -m benchmarks.agents [--agents 4] [--rounds 10] [--threads 2]

Last line: JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from benchmarks.common import emit, engine, load, machine, median, setup_threads
from benchmarks.grammar import mask_time, step_times
from sessionserve.replicas.server import ReplicaServer
from sessionserve.replicas.tools.formats import tool_grammar
from sessionserve.wire import GenerateCall, SamplingParams, ToolSpec, ToolUse, TurnResult

TOOLS = (
    ToolSpec(
        "search_docs",
        {
            "type": "object",
            "properties": {"query": {"type": "string", "maxLength": 40}},
            "required": ["query"],
            "additionalProperties": False,
        },
        "Search the project's documentation.",
    ),
    ToolSpec(
        "read_file",
        {
            "type": "object",
            "properties": {"path": {"type": "string", "maxLength": 40}},
            "required": ["path"],
            "additionalProperties": False,
        },
        "Read a file of the project.",
    ),
)
TASKS = [
    "Find out how the cache evicts idle sessions.",
    "Find out which router the app uses.",
    "Find out how a session moves between replicas.",
    "Find out what the memory checker checks.",
    "Find out how tool calls are parsed.",
    "Find out how the ingress commits a turn.",
    "Find out what the host tier stores.",
    "Find out how speculative decoding verifies drafts.",
]
LINE = "line {i}: the {what} keeps its state in one place and says why in its docstring. "


def tool_output(agent: int, round_: int) -> str:
    """~300 tokens of a tool's result, different per agent and round."""
    what = ["cache", "router", "engine", "ingress"][(agent + round_) % 4]
    return "".join(LINE.format(i=i, what=what) for i in range(14)) + f"(agent {agent}, {round_})"


async def run_agent(server: ReplicaServer, agent: int, rounds: int, session: bool) -> list:
    """One agent: a call a round, its result appended; the TurnResult of every round."""
    use = ToolUse(TOOLS, "required", parallel=False)
    messages = [
        {"role": "system", "content": "You are a coding agent. Use the tools."},
        {"role": "user", "content": TASKS[agent % len(TASKS)]},
    ]
    results = []
    for r in range(rounds):
        call = GenerateCall(
            {"max_tokens": 48, "temperature": 0},
            session_id=f"agent-{agent}" if session else None,
            mode="chat",
            messages=messages,
            tool_use=use,
        )
        final = [p async for p in server.generate(call)][-1]
        assert isinstance(final, TurnResult) and final.tool_calls, final
        results.append(final)
        (made,) = final.tool_calls
        messages += [
            {"role": "assistant", "content": final.text, "tool_calls": [made]},
            {"role": "tool", "content": tool_output(agent, r), "tool_call_id": made.id},
        ]
    return results


def agents_ttft(loaded, agents: int, rounds: int, session: bool) -> tuple[list[list], float]:
    """Every agent's per-round results, concurrently on one replica; and the wall time."""
    eng = engine(loaded, sessions=session, radix=session, num_slots=32768, max_context_len=8192)
    server = ReplicaServer({}, engine=eng)
    if session:
        for a in range(agents):
            eng.open_session(f"agent-{a}")

    async def everyone():
        return await asyncio.gather(*(run_agent(server, a, rounds, session) for a in range(agents)))

    start = time.perf_counter()
    try:
        runs = asyncio.run(everyone())
    finally:
        server.shutdown()
    return runs, time.perf_counter() - start


def grammar_overhead(loaded, runs: list[list], batch: int) -> tuple[float, float]:
    """(masking ms per step, free decode step ms), both at `batch`."""
    eng = engine(loaded, sessions=False, radix=False)
    answers = [r.output_ids for run in runs for r in run][:batch]
    while len(answers) < batch:
        answers += answers[: batch - len(answers)]
    grammar = tool_grammar(ToolUse(TOOLS, "auto"), None)  # the costliest: text or a call
    prompts = [eng.tokenizer(t, add_special_tokens=False).input_ids for t in TASKS[:batch]]
    free = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    step_times(eng, prompts, free)  # warm
    free_ms = median(step_times(eng, prompts, free) + step_times(eng, prompts, free)) * 1e3
    mask_time(eng, answers, grammar, lark=True)  # warm: the tokenizer table, the compile
    mask_ms = mask_time(eng, answers, grammar, lark=True) * 1e3
    return mask_ms, free_ms


def prefill_bound(
    loaded, stateless: TurnResult, cached: int, repeats: int = 3
) -> tuple[float, float]:
    """(ms to prefill the last step's new tokens onto its `cached` history, ms to prefill its
    whole prompt), one request alone on the engine: the ratio a step's TTFT could reach here
    without queueing behind other agents, medians of `repeats`. `stateless`: the step without
    a session (its token log is all new: the whole prompt and answer)."""
    prompt = stateless.log_tail[: stateless.prompt_tokens]
    history, new = prompt[:cached], prompt[cached:]
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    session_ms, stateless_ms = [], []
    for _ in range(repeats):
        eng = engine(loaded)
        sid = eng.open_session()
        eng.generate([history], one, session_id=sid)
        start = time.perf_counter()
        eng.generate([new], one, session_id=sid)
        session_ms.append((time.perf_counter() - start) * 1e3)
        eng = engine(loaded, sessions=False, radix=False)
        start = time.perf_counter()
        eng.generate([prompt], one)
        stateless_ms.append((time.perf_counter() - start) * 1e3)
    return median(session_ms), median(stateless_ms)


def branch_return(loaded, turns: int = 6) -> tuple[float, float]:
    """(cached share of the return turn's prompt, the fork point's share of it)."""
    eng = engine(loaded)
    tok = eng.tokenizer
    sid = eng.open_session()
    answer = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)

    def user(text: str) -> list[int]:
        return tok(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n").input_ids

    convo: list[int] = []
    marks = []
    for t in range(turns):
        marks.append(len(convo))
        convo += user(tool_output(t, t))
        (r,) = eng.generate([convo], answer, session_id=sid, mode="chat")
        convo += r.output_ids
    fork = marks[-2]  # the client edits turn K-1 and runs it
    edited = convo[:fork] + user("Something else entirely. " * 20)
    eng.generate([edited], answer, session_id=sid, mode="chat")
    back = convo + user("Back on the first branch: go on.")
    (r,) = eng.generate([back], answer, session_id=sid, mode="chat")
    eng.close_session(sid)
    eng.checker.check_idle()
    return r.cached_tokens / r.prompt_tokens, fork / r.prompt_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--agents", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    setup_threads(args.threads)
    loaded = load()
    agents_ttft(loaded, 1, 2, True)  # warm-up: the tokenizer table, the grammar compile
    modes = {}
    for session in (True, False):
        runs, wall = agents_ttft(loaded, args.agents, args.rounds, session)
        modes[session] = runs
        name = "sessions" if session else "stateless"
        print(f"[{name}] {args.agents} agents x {args.rounds} rounds in {wall:.1f} s", flush=True)
    same_calls = all(
        [c.arguments for r in a for c in r.tool_calls]
        == [c.arguments for r in b for c in r.tool_calls]
        for a, b in zip(modes[True], modes[False], strict=True)
    )
    print(f"\nmachine: {machine()}")
    print(
        f"{'round':>5} {'prompt':>7} {'cached':>7} {'session ms':>11} "
        f"{'stateless ms':>13} {'ratio':>6}"
    )
    ratios = []
    for r in range(args.rounds):
        s = median([run[r].ttft_s for run in modes[True]]) * 1e3
        b = median([run[r].ttft_s for run in modes[False]]) * 1e3
        prompt = median([run[r].prompt_tokens for run in modes[True]])
        cached = median([run[r].cached_tokens for run in modes[True]])
        ratios.append(b / s)
        print(f"{r + 1:>5} {prompt:>7.0f} {cached:>7.0f} {s:>11.1f} {b:>13.1f} {b / s:>6.2f}")
    print(f"both modes made the same calls: {same_calls}")
    alone_s, alone_b = prefill_bound(loaded, modes[False][0][-1], modes[True][0][-1].cached_tokens)
    print(
        f"round {args.rounds} alone (no other agent, no decode): prefill of the new tokens "
        f"{alone_s:.0f} ms vs the whole prompt {alone_b:.0f} ms: {alone_b / alone_s:.2f}x"
    )
    mask_ms, free_ms = grammar_overhead(loaded, modes[True], args.batch)
    print(
        f"tool grammar masking, batch {args.batch}: {mask_ms:.2f} ms per step; "
        f"free step {free_ms:.1f} ms"
    )
    returned, fork_share = branch_return(loaded)
    print(
        f"branch return: {returned:.1%} of the prompt cached "
        f"(the fork point alone: {fork_share:.1%})"
    )
    emit(
        {
            "benchmark": "agents",
            "agents": args.agents,
            "rounds": args.rounds,
            f"ttft_ratio_round{args.rounds}": round(ratios[-1], 2),
            "ttft_ms_session_last": round(median([run[-1].ttft_s for run in modes[True]]) * 1e3, 1),
            "ttft_ms_stateless_last": round(
                median([run[-1].ttft_s for run in modes[False]]) * 1e3, 1
            ),
            "same_calls": same_calls,
            f"prefill_ratio_round{args.rounds}_alone": round(alone_b / alone_s, 2),
            f"grammar_overhead_frac_{args.batch}": round(mask_ms / free_ms, 4),
            "free_step_ms": round(free_ms, 2),
            "mask_ms_per_step": round(mask_ms, 3),
            "branch_return_cached_frac": round(returned, 3),
            "fork_point_frac": round(fork_share, 3),
            "machine": machine(),
        }
    )


if __name__ == "__main__":
    main()
