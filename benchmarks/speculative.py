"""Speculative decoding on the default model: decode tokens/s with and without it.

Two workloads, each run plain and speculative in the same process on the same forward
(compiled, as `serve run` decodes on this machine, unless --no-compile):
- chat: sessions answer prompts that are not in the drafter's training set (two greedy turns
  each: a question, then a follow-up). Drafts from the EAGLE head (`--drafter`); also with the
  history drafter beside it (`chat_head_history_<c>`, at each --agent-concurrency).
- agent: sessions are handed a tool's output (a config file, a JSON listing, a log, code) and
  asked to give it back edited, then edited again: what agents do. As agent frameworks do, the
  answer is started for the model (the code fence and the file's first line) and stops at the
  closing fence. Drafts from the session's own history (no head).
At concurrency c, c sessions run at once (continuous batching; sessions repeat the prompt list
when c is larger). By default each group of c sessions starts its turns together, so a turn's
batch shrinks to its slowest answers at the end, where speculation that speeds some answers
up leaves the rest less batched; --refill submits the next turn as soon as one ends, as a
busy server sees it (with --sessions above c, the batch stays full until the work runs out).
Decode tokens/s counts the tokens of decode-only steps over those steps' time (prefill steps
are the same work in both runs and are left out); with --refill, every step's (turns arrive
while others decode, so their prompts ride in decode steps, and which steps are decode-only
differs between the engines: counted alone, at 32 requests they held 24,800-27,200 of the
speculative engine's tokens against 27,200 of the plain one's, docs/benchmarks.md). Greedy
output is identical with and without speculation (checked here). Speculation runs with the
online policy (`spec.adaptive`, the default) unless --no-adaptive; --forced-too adds a third
engine that drafts on every step, so the policy and what the drafts are worth are read in the
same rounds.
The engines are built side by side, the speculative ones running the plain engine's loaded
compiled packages where they load the same files (`share_packages`; --own-packages: a copy
each, as before 2026-12-03), and their measured passes take turns a step each
(`--repeats` rounds, 2 by default, their order rotating; --passes-apart: whole passes one after
the other, as before 2026-12-01), so this machine's drifting speed meets them alike, each
engine having served the workload once unmeasured first, as a serving replica long has
(--cold: not).

    .venv/bin/sessionserve train-drafter            # once: writes drafters/default
    .venv/bin/python -m benchmarks.speculative [--drafter drafters/default] [--num-drafts 4]
        [--tree-topk 2 --tree-budget 8]    # EAGLE-2 trees from the head (greedy requests)
        [--dtype bfloat16]                 # weights and KV in bf16 (default float32)
        [--forced-too]                     # and drafting forced on, in the same rounds
        [--refill --sessions 24]           # turns submitted as others end: a busy server

Last line: JSON with accept_len (mean tokens per verify step, EAGLE's tau, head, chat, first
concurrency), speedup_1/_8/_32 (head, chat: decode tokens/s with / without speculation),
speedup_agent_1 (history drafter, agent workload), with --forced-too the same keys prefixed
forced_ (speedup_forced_1, ...), the policy's per-bucket measurements and
the speculative engine's forwards timed by kind (`forward_ms_<point>`: ms a decode, a verify
and a prompt step, and `verify_over_decode`, what a verify costs over a decode here; and the
plain engine's decode step, `plain_engine_decode`, with `decode_over_plain_engine`: where
that is well above 1, the speculative engine's plain steps ran slower than the plain
engine's in the same rounds, which no drafting explains).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from benchmarks.common import emit, load, machine, rotated, setup_threads
from sessionserve.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from sessionserve.replicas.engine import Engine
from sessionserve.replicas.speculative.stats import SpecStats
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


@dataclass(frozen=True)
class Turn:
    user: str
    answer_start: str = ""  # the assistant's answer begins with this (the agent's prefill)


@dataclass(frozen=True)
class Workload:
    name: str
    tasks: list[tuple[Turn, Turn]]  # one session each: two turns
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # every answer runs to max_tokens (--ignore-eos)


# An agent's file-editing step: a tool's output in the context, then the edited file written
# back. Like agent frameworks do, the answer is started for the model (the fence and the
# file's first line) and stopped at the closing fence.
_FILES = [
    (
        "I ran `cat deploy/app.yaml` and got:",
        "yaml",
        "name: checkout-service\nreplicas: 2\nimage: registry.local/checkout:1.4.2\nports:\n"
        "  - 8080\n  - 9090\nenv:\n  LOG_LEVEL: info\n  DB_HOST: db.internal\n"
        "  DB_PORT: 5432\n  CACHE_TTL_SECONDS: 300\nresources:\n  cpu: 500m\n"
        "  memory: 512Mi",
        "Print the whole file again with replicas set to 4.",
        "Now print the whole file again with LOG_LEVEL set to debug.",
    ),
    (
        "The tool `list_orders` returned:",
        "json",
        '[{"id": 1041, "customer": "Ada Park", "total": 42.50, "status": "shipped"},\n'
        ' {"id": 1042, "customer": "Ben Ortiz", "total": 17.25, "status": "pending"},\n'
        ' {"id": 1043, "customer": "Chloe Wu", "total": 88.00, "status": "shipped"},\n'
        ' {"id": 1044, "customer": "Dev Shah", "total": 5.75, "status": "cancelled"}]',
        "Repeat this JSON exactly, but with the status of order 1042 set to shipped.",
        "Now repeat the JSON again, without the cancelled order.",
    ),
    (
        "Here is utils.py:",
        "python",
        "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n"
        "    return total / len(values)\n\n\ndef clamp(x, low, high):\n    if x < low:\n"
        "        return low\n    if x > high:\n        return high\n    return x",
        "Rewrite the whole file, renaming `mean` to `average`.",
        "Now write the whole file again with a docstring in each function.",
    ),
    (
        "`tail -n 6 server.log` printed:",
        "",
        "2026-11-20 10:01:02 INFO request id=81 path=/health status=200 ms=3\n"
        "2026-11-20 10:01:05 INFO request id=82 path=/orders status=200 ms=41\n"
        "2026-11-20 10:01:07 WARN request id=83 path=/orders status=429 ms=2\n"
        "2026-11-20 10:01:09 INFO request id=84 path=/orders status=200 ms=38\n"
        "2026-11-20 10:01:12 ERROR request id=85 path=/pay status=500 ms=120\n"
        "2026-11-20 10:01:15 INFO request id=86 path=/health status=200 ms=2",
        "Copy the lines that are not INFO, exactly as they are.",
        "Now copy every line with path=/orders, exactly as they are.",
    ),
]


def _agent_task(intro: str, lang: str, body: str, first: str, second: str) -> tuple[Turn, Turn]:
    start = f"```{lang}\n{body.splitlines()[0]}\n"
    return (Turn(f"{intro}\n```{lang}\n{body}\n```\n{first}", start), Turn(second, start))


AGENT = Workload("agent", [_agent_task(*f) for f in _FILES], stop=("```",))


def build(loaded, spec: SpecConfig, concurrency: int, compile: bool, eager_head: bool) -> Engine:
    """An engine for one side of a comparison, its compiled packages loaded."""
    cfg = EngineConfig(
        cache=CacheConfig(num_slots=32768, max_rows=64, max_context_len=4096),
        scheduler=SchedulerConfig(max_running_requests=max(concurrency, 1)),
        spec=spec,
        compile=compile,
    )
    eng = Engine(cfg, loaded)
    if eng.runner.compiling is not None:
        eng.runner.compiling.join()
    spec_dec = eng.speculative
    if eager_head and spec_dec is not None and spec_dec.eagle is not None:
        spec_dec.eagle.compiled.clear()  # the head's steps run eagerly, as before it compiled
    return eng


def share_packages(source: Engine, engines: list[Engine]) -> None:
    """`engines` run the target's steps through `source`'s loaded packages. Each engine loads
    its own copy of a package's weights; two copies of the same weights ran decode steps up
    to ~10% apart on this VM (`decode_over_plain_engine`: 0.94-1.12 over runs), which the
    speedup then read as drafting's gain or loss. A package is a pure function of its inputs
    (the KV pool among them), so one copy serves every engine that loaded the same file
    (an engine whose head reads other layers' features loads another); the engines take
    turns on one thread."""
    for eng in engines:
        shared = []
        for name in ("compiled", "compiled_decode", "compiled_int4_decode", "compiled_prefill"):
            mine, theirs = getattr(eng.runner, name), getattr(source.runner, name)
            if mine is not None and theirs is not None and mine.package == theirs.package:
                setattr(eng.runner, name, theirs)
                shared.append(name)
        print(f"packages shared with the plain engine: {shared or 'none'}")


def time_drafting(eng: Engine) -> dict[str, float]:
    """Seconds the decoder spends choosing each step's drafts (`draft_lens`, called by the
    scheduler: the policy, history lookups, the records of offered chains), proposing (head
    chains, history drafts), verifying and catching the head up, summed from now on: where a
    speculative engine's time goes when the policy keeps drafting off (the methods wrapped
    on this engine only)."""
    spec_dec = eng.speculative
    spent = {"draft_lens": 0.0, "propose": 0.0, "verify": 0.0, "catch_up": 0.0}
    owners = dict.fromkeys(spent, spec_dec) | {"draft_lens": eng.scheduler}
    for name, owner in owners.items():
        method = getattr(owner, name)

        def timed(*args, _method=method, _name=name):
            t = time.perf_counter()
            try:
                return _method(*args)
            finally:
                spent[_name] += time.perf_counter() - t

        setattr(owner, name, timed)
    return spent


def time_forwards(runner) -> dict[str, list[float]]:
    """Seconds and count of the runner's forwards by kind, summed from now on: `decode` (one
    new token a request), `verify` (several sampled positions a request: drafts checked) and
    `other` (prompts). With the decode step package both run that package where its
    attention is the CPU kernel (else a verify runs the forward's; compiled_decode.py), so
    their ratio is what a verify costs here."""
    spent = {"decode": [0.0, 0], "verify": [0.0, 0], "other": [0.0, 0]}
    forward = runner.forward

    def kind(batch) -> str:
        if batch.is_decode:
            return "decode"
        return "verify" if len(batch.logit_idx) > len(batch.seqs) else "other"

    def timed(batch):
        t = time.perf_counter()
        try:
            return forward(batch)
        finally:
            seconds_calls = spent[kind(batch)]
            seconds_calls[0] += time.perf_counter() - t
            seconds_calls[1] += 1

    runner.forward = timed
    return spent


class Pass:
    """One engine's pass over a workload (each task's two turns on its own session,
    `concurrency` sessions at a time), a step at a time: `advance` runs one engine step, so
    several engines' passes can take turns step by step (`run_side_by_side`). When it is done,
    `result` holds its decode-only seconds (with `refill`: every step's), their tokens, and the
    answers. By default the sessions run in groups whose turns start together, so a turn's
    batch shrinks as its answers end; with `refill` a session's next turn (or the next session)
    is submitted as soon as a turn ends, keeping `concurrency` answers in flight as a busy
    server does. `sessions` (default: one a task, at least `concurrency`) cycle through the
    tasks."""

    def __init__(
        self,
        eng: Engine,
        work: Workload,
        concurrency: int,
        max_tokens: int,
        refill: bool = False,
        sessions: int | None = None,
    ) -> None:
        self.result: tuple | None = None
        self._steps = self._run(eng, work, concurrency, max_tokens, refill, sessions)

    def advance(self) -> bool:
        """One engine step (and what the workload does around it); False once it is done."""
        try:
            next(self._steps)
            return True
        except StopIteration as done:
            self.result = done.value
            return False

    @staticmethod
    def _run(
        eng: Engine,
        work: Workload,
        concurrency: int,
        max_tokens: int,
        refill: bool,
        sessions: int | None,
    ) -> Iterator[None]:
        tok = eng.tokenizer
        params = SamplingParams(
            max_tokens=max_tokens, temperature=0, stop=work.stop, ignore_eos=work.ignore_eos
        )
        decode_s, decode_tokens, outputs = 0.0, 0, {}
        count = sessions or max(len(work.tasks), concurrency)
        opened = [(i, eng.open_session()) for i in range(count)]
        history = {sid: [] for _, sid in opened}

        def submit(i: int, sid: str, turn: int) -> str:
            step = work.tasks[i % len(work.tasks)][turn]
            history[sid].append({"role": "user", "content": step.user})
            messages = history[sid]
            if step.answer_start:
                messages = messages + [{"role": "assistant", "content": step.answer_start}]
            ids = tok.apply_chat_template(
                messages,
                add_generation_prompt=not step.answer_start,
                continue_final_message=bool(step.answer_start),
                tokenize=True,
                return_dict=False,
            )
            return eng.submit(ids, params, session_id=sid, mode="chat")

        def take(rid: str, i: int, sid: str, turn: int) -> None:
            r = eng.take_result(rid)
            outputs[(i, turn)] = r.output_ids
            step = work.tasks[i % len(work.tasks)][turn]
            answer = step.answer_start + r.text + "".join(work.stop[:1])
            history[sid].append({"role": "assistant", "content": answer})

        def run_steps(until_one_ends: bool) -> Iterator[None]:
            """Step until no work is left (or, with `until_one_ends`, a request ended),
            yielding after each step: returns the ids of the requests that ended."""
            nonlocal decode_s, decode_tokens
            ended: list[str] = []
            while eng.has_work() and not (until_one_ends and ended):
                sched = eng.scheduler
                decode_only = not sched.waiting and all(r.sampled for r in sched.running)
                t = time.perf_counter()
                events = eng.step()
                dt = time.perf_counter() - t
                if decode_only or refill:
                    decode_s += dt
                    decode_tokens += sum(len(e.new_token_ids) for e in events)
                ended += [e.rid for e in events if e.result is not None]
                yield
            return ended

        if refill:
            queue = [(i, sid, 0) for i, sid in opened]
            flying: dict[str, tuple[int, str, int]] = {}
            while queue or flying:
                while queue and len(flying) < concurrency:
                    i, sid, turn = queue.pop(0)
                    flying[submit(i, sid, turn)] = (i, sid, turn)
                for rid in (yield from run_steps(until_one_ends=True)):
                    i, sid, turn = flying.pop(rid)
                    take(rid, i, sid, turn)
                    if turn == 0:
                        queue.insert(0, (i, sid, 1))
        else:
            for group_start in range(0, len(opened), concurrency):
                group = opened[group_start : group_start + concurrency]
                for turn in range(2):
                    rids = {submit(i, sid, turn): (i, sid) for i, sid in group}
                    yield from run_steps(until_one_ends=False)
                    for rid, (i, sid) in rids.items():
                        take(rid, i, sid, turn)
        for _, sid in opened:
            eng.close_session(sid)
        return decode_s, decode_tokens, outputs


def serve(
    eng: Engine,
    work: Workload,
    concurrency: int,
    max_tokens: int,
    refill: bool = False,
    sessions: int | None = None,
) -> tuple:
    """One engine's whole `Pass`: (seconds, tokens, answers)."""
    run = Pass(eng, work, concurrency, max_tokens, refill, sessions)
    run_side_by_side([run])
    return run.result


def run_side_by_side(passes: list[Pass]) -> None:
    """The engines take turns a step each until every pass is done: a machine whose speed
    drifts by 10-30% within a minute (this 2-core VM) then drifts under all of them alike,
    where whole passes one after the other each met a different speed (SmolLM2 at 32
    requests: the plain engine's passes of one run read 241-341 tok/s, docs/benchmarks.md)."""
    live = list(passes)
    while live:
        live = [p for p in live if p.advance()]


def compare(name: str, loaded, spec: SpecConfig, c: int, args, work: Workload, summary: dict):
    """The plain and the speculative engine side by side in this process, their measured
    passes taking turns a step each (`run_side_by_side`; `--passes-apart`: whole passes one
    after the other), `--repeats` rounds, the engines' order rotating: this machine's speed
    drifts by more than the gaps "never a loss" is about, and whole runs one after the other
    read that drift as a speedup or a loss (SmolLM2, fp32, 8 requests: pairs of runs 0.92 and
    0.98, interleaved passes in one process 1.03, docs/benchmarks.md). With `--forced-too` a
    third engine drafts on every step (the policy off) in the same rounds: what the drafts are
    worth next to what the policy makes of them. Records `speedup_{name}` (and
    `speedup_forced_{name}`): the median of the rounds' ratios over the plain engine's pass
    of the same round. With `--warm` (the default) each engine first serves the workload once
    unmeasured, as a serving replica long has."""
    if args.only and name not in args.only:
        return
    configs = {"plain": SpecConfig(), "spec": spec}
    if args.forced_too and spec.adaptive:
        configs["forced"] = spec.model_copy(update={"adaptive": False})
    arms = {
        k: _Arm(build(loaded, cfg, c, args.compile, args.eager_head)) for k, cfg in configs.items()
    }
    speculative = {k: a for k, a in arms.items() if k != "plain"}
    if args.share_packages:
        share_packages(arms["plain"].engine, [a.engine for a in speculative.values()])
    if args.warm:
        for arm in arms.values():
            serve(arm.engine, work, c, args.max_tokens, args.refill, args.sessions)
        for arm in speculative.values():  # the measured passes' only
            arm.engine.speculative.stats, arm.engine.speculative.by_source = SpecStats(), {}
    for arm in speculative.values():
        arm.spent = time_drafting(arm.engine)
    for arm in arms.values():
        arm.forwards = time_forwards(arm.engine.runner)
    for i in range(args.repeats):
        keys = rotated(list(arms), i)
        runs = [
            Pass(arms[k].engine, work, c, args.max_tokens, args.refill, args.sessions) for k in keys
        ]
        for together in [runs] if args.side_by_side else [[run] for run in runs]:
            run_side_by_side(together)
        passes = {k: arms[k].add(run.result) for k, run in zip(keys, runs, strict=True)}
        p_s, p_tokens, p_out = passes["plain"]
        for k, arm in speculative.items():
            s_s, s_tokens, s_out = passes[k]
            arm.same = arm.same and p_out == s_out
            arm.ratios.append((s_tokens / s_s) / (p_tokens / p_s))
    plain_tps = arms["plain"].tokens_per_s
    summary[f"plain_tps_{name}"] = round(plain_tps, 2)
    for k, arm in speculative.items():
        _report(name if k == "spec" else f"forced_{name}", arm, arms["plain"], summary)


@dataclass
class _Arm:
    """One engine of a comparison and what its measured passes added up to."""

    engine: Engine
    seconds: float = 0.0  # decode-only seconds over the measured passes
    tokens: int = 0
    ratios: list[float] = field(default_factory=list)  # its speed over plain's, per round
    same: bool = True  # its outputs equal plain's in every round
    spent: dict[str, float] = field(default_factory=dict)  # time_drafting's
    forwards: dict[str, list[float]] = field(default_factory=dict)  # time_forwards'

    def add(self, out: tuple) -> tuple:
        """A measured pass's (seconds, tokens, answers), after the strict memory check."""
        self.engine.check_memory()
        self.seconds += out[0]
        self.tokens += out[1]
        return out

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def _report(key: str, arm: _Arm, plain: _Arm, summary: dict) -> None:
    """Print and record one speculative engine's figures against the plain engine's. The two
    engines' decode steps (one token a row) are compared too: where the speculative engine's
    plain steps run slower than the plain engine's in the same rounds, the gap is that
    engine's, not drafting's (with `--own-packages` each engine runs its own copy of the
    packages, whose steps ran up to ~10% apart: `share_packages`)."""
    plain_tps = plain.tokens_per_s
    spec_dec = arm.engine.speculative
    spec_tps = arm.tokens_per_s
    speedup = statistics.median(arm.ratios)
    if len(arm.ratios) > 1:
        rounds = [round(r, 3) for r in arm.ratios]
        print(f"{key}: speedups of the {len(rounds)} rounds {rounds}")
        summary[f"speedups_{key}"] = rounds
    s = arm.engine.spec_stats.as_dict()
    by_source = {k: v.as_dict()["mean_accept_len"] for k, v in spec_dec.by_source.items()}
    policy = spec_dec.policy.summary() if spec_dec.policy else {}
    share = {k: round(v / arm.seconds, 4) for k, v in arm.spent.items()}
    print(
        f"{key}: decode {plain_tps:.1f} tok/s plain, {spec_tps:.1f} tok/s speculative -> "
        f"{speedup:.2f}x; mean acceptance length {s['mean_accept_len']:.2f} "
        f"(accepted {s['accepted']}/{s['drafted']} drafts in {s['verify_steps']} verifies); "
        f"histogram {s['accept_len_histogram']}; by source {by_source}; "
        f"outputs identical: {arm.same}"
    )
    if policy:
        print(f"  policy per batch bucket: {policy}")
    print(f"  the decoder's own work, share of decode time: {share}")
    ms = {k: round(1e3 * t / n, 2) for k, (t, n) in arm.forwards.items() if n}
    if "decode" in ms and "verify" in ms:
        ms["verify_over_decode"] = round(ms["verify"] / ms["decode"], 3)
    print(f"  the speculative engine's forwards, ms a step by kind: {ms}")
    t, n = plain.forwards["decode"]
    if n and "decode" in ms:
        ms["plain_engine_decode"] = round(1e3 * t / n, 2)
        ms["decode_over_plain_engine"] = round(ms["decode"] / ms["plain_engine_decode"], 3)
        print(
            f"  decode steps: {ms['decode']} ms in the speculative engine, "
            f"{ms['plain_engine_decode']} in the plain one "
            f"({ms['decode_over_plain_engine']}x; batches differ where drafting ends turns early)"
        )
    summary[f"speedup_{key}"] = round(speedup, 3)
    summary[f"spec_tps_{key}"] = round(spec_tps, 2)
    summary[f"accept_len_{key}"] = s["mean_accept_len"]
    summary[f"verifies_{key}"] = s["verify_steps"]
    summary[f"histogram_{key}"] = s["accept_len_histogram"]
    summary[f"identical_{key}"] = arm.same
    summary[f"policy_{key}"] = policy
    summary[f"drafting_share_{key}"] = share
    summary[f"forward_ms_{key}"] = ms


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", default="drafters/default", help="EAGLE head directory")
    ap.add_argument("--num-drafts", type=int, default=4, help="chain length k (tree depth)")
    ap.add_argument("--tree-topk", type=int, default=1, help="EAGLE-2 trees above 1 (head)")
    ap.add_argument("--tree-budget", type=int, default=8, help="tree drafts verified")
    ap.add_argument(
        "--min-confidence",
        type=float,
        default=SpecConfig().min_draft_confidence,
        help="the head's chains stop below this product of their drafts' probabilities (0: k)",
    )
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument(
        "--agent-concurrency",
        type=int,
        nargs="+",
        default=[1, 8],
        help="concurrencies of the history drafter's points (agent_<c>, chat_history_<c>, and "
        "with the head beside it agent_head_history_<c>, chat_head_history_<c>)",
    )
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument(
        "--repeats", type=int, default=2, help="interleaved plain/speculative rounds per point"
    )
    ap.add_argument("--only", nargs="*", help="run only these points (e.g. agent_1 8 32)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--no-compile", dest="compile", action="store_false")
    ap.add_argument(
        "--eager-head",
        action="store_true",
        help="run the EAGLE head's steps eagerly (its compiled steps are what --compile adds)",
    )
    ap.add_argument("--no-adaptive", dest="adaptive", action="store_false")
    ap.add_argument(
        "--forced-too",
        action="store_true",
        help="also run each point drafting on every step, interleaved with plain and the policy",
    )
    ap.add_argument(
        "--cold",
        dest="warm",
        action="store_false",
        help="no unmeasured pass first: the first round measures each engine's first pass",
    )
    ap.add_argument("--skip-head", action="store_true", help="only the history drafter runs")
    ap.add_argument(
        "--own-packages",
        dest="share_packages",
        action="store_false",
        help="each engine loads its own copy of the target's compiled packages (by default "
        "the speculative engines run the plain engine's: `share_packages`)",
    )
    ap.add_argument(
        "--passes-apart",
        dest="side_by_side",
        action="store_false",
        help="run each round's passes one after the other, not a step each in turn",
    )
    ap.add_argument(
        "--refill",
        action="store_true",
        help="submit a session's next turn (or the next session) as soon as a turn ends, "
        "keeping the concurrency busy, instead of starting each group's turns together",
    )
    ap.add_argument(
        "--ignore-eos",
        action="store_true",
        help="run every answer to --max-tokens (stop strings still end the agent's): in "
        "bf16 the engines' greedy answers can part at near-ties and end at other lengths, "
        "so their passes do different work; this gives both the same tokens to write",
    )
    ap.add_argument(
        "--sessions",
        type=int,
        help="sessions a pass serves, cycling through the tasks (default: one a task, at "
        "least the concurrency); with --refill, more than the concurrency keeps the batch full",
    )
    ap.add_argument(
        "--seen-prompts",
        action="store_true",
        help="use 8 of the drafter's training prompts instead (how much it memorised)",
    )
    args = ap.parse_args()
    if not args.skip_head and not (Path(args.drafter) / "config.json").exists():
        print(
            f"no drafter at {args.drafter}: train one first with "
            f"`.venv/bin/sessionserve train-drafter --out {args.drafter}` (about 20 min here), "
            "or pass --skip-head",
            file=sys.stderr,
        )
        return 2
    assert not set(EVAL_PROMPTS) & set(shipped_prompts()), "eval prompts must be unseen"
    prompts = shipped_prompts()[: len(EVAL_PROMPTS)] if args.seen_prompts else EVAL_PROMPTS
    chat = Workload(
        "chat", [(Turn(p), Turn(FOLLOW_UP)) for p in prompts], ignore_eos=args.ignore_eos
    )
    agent = replace(AGENT, ignore_eos=args.ignore_eos)
    setup_threads(args.threads)
    loaded = load(dtype=getattr(torch, args.dtype))
    tree = f" tree {args.tree_topk}/{args.tree_budget}" if args.tree_topk > 1 else ""
    print(f"machine: {machine()}  drafter: {args.drafter}  k={args.num_drafts}{tree}")
    summary: dict = {
        "k": args.num_drafts,
        "tree_topk": args.tree_topk,
        "tree_budget": args.tree_budget,
        "min_confidence": args.min_confidence,
        "max_tokens": args.max_tokens,
        "prompts": "seen" if args.seen_prompts else "unseen",
        "compile": args.compile,
        "head_compiled": args.compile and not args.eager_head,
        "adaptive": args.adaptive,
        "warm": args.warm,
        "ignore_eos": args.ignore_eos,
    }
    cost = verify_cost(loaded)
    print(
        "forward of n new tokens (transformers, 200-token cache): "
        + ", ".join(f"n={n}: {ms:.1f} ms ({ms / cost[1]:.2f}x)" for n, ms in cost.items())
    )
    summary["verify_cost_ratio"] = {n: round(ms / cost[1], 3) for n, ms in cost.items()}
    k, adaptive = args.num_drafts, args.adaptive
    history = SpecConfig(num_drafts=k, history_drafts=True, adaptive=adaptive)
    for c in args.agent_concurrency:
        compare(f"agent_{c}", loaded, history, c, args, agent, summary)
    for c in args.agent_concurrency:  # history drafts are `serve run`'s default on chat too
        compare(f"chat_history_{c}", loaded, history, c, args, chat, summary)
    if not args.skip_head:
        head = SpecConfig(
            drafter_path=args.drafter,
            num_drafts=k,
            adaptive=adaptive,
            tree_topk=args.tree_topk,
            tree_budget=args.tree_budget,
            min_draft_confidence=args.min_confidence,
        )
        for c in args.concurrency:
            compare(str(c), loaded, head, c, args, chat, summary)
        both = head.model_copy(update={"history_drafts": True})
        for c in args.agent_concurrency:
            compare(f"agent_head_history_{c}", loaded, both, c, args, agent, summary)
            compare(f"chat_head_history_{c}", loaded, both, c, args, chat, summary)
        summary["accept_len"] = summary.get(f"accept_len_{args.concurrency[0]}")
    emit(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
