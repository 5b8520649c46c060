"""Where a decode step's time goes, in one process: the step, the compiled forward, the layers'
attention op (and inside it the decode kernel and the K/V write), sampling, and the host's
other phases, in ms a step.

The engine is the bench configs' (`serve-cpu-bench-bf16.yaml`: the default model, compiled, 1
GiB of KV, 2 torch threads). Each batch size runs `--requests` rounds of B requests with a
short prompt decoding `--tokens` tokens each, after a warm-up round; every phase is timed by
wrapping the object that runs it (instance attributes and `paged_op.attend`, put back
afterwards), so the figures include the wrappers' own ~1 us a call. On a CPU the layers'
attention op runs Python between compiled pieces, 30 times a step for SmolLM2: this shows
what that costs next to the kernel it calls (docs/benchmarks.md, "Where a decode step's time
goes in process").

    .venv/bin/python -m benchmarks.step_phases [--batches 1 8] [--tokens 200] [--dtype bfloat16]

Last line: JSON with `ms_<phase>_<B>` for each phase and batch size.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from benchmarks.common import bench_config_engine, emit, machine, setup_threads
from sessionserve.replicas.attention import paged_op
from sessionserve.replicas.engine import Engine
from sessionserve.wire import SamplingParams

PROMPT_WORDS = "river stone light garden window market letter winter music paper " * 4


@contextlib.contextmanager
def timed(
    owner: Any, name: str, label: str, totals: Counter, calls: Counter | None = None
) -> Iterator[None]:
    """`owner.name` adds its seconds to `totals[label]` (and a call to `calls[label]`) until
    the block ends."""
    inner: Callable[..., Any] = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            totals[label] += time.perf_counter() - started
            if calls is not None:
                calls[label] += 1

    own = name in vars(owner)  # an instance's (or module's) own attribute, not a method
    setattr(owner, name, wrapper)
    try:
        yield
    finally:
        if own:
            setattr(owner, name, inner)
        else:
            delattr(owner, name)  # the class's method shows through again


def phases(eng: Engine, batch: int, tokens: int, rounds: int) -> dict[str, float]:
    """ms a step of each phase over `rounds` rounds of `batch` requests, and the host's other
    work (the step less the forward, sampling and the named host phases)."""
    runner, backend = eng.runner, eng.runner.backend
    prompt = eng.tokenizer(PROMPT_WORDS, add_special_tokens=False).input_ids
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    eng.generate([prompt] * batch, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    totals: Counter = Counter()
    wrapped = [
        (eng, "step", "step"),
        (eng.scheduler, "schedule", "schedule"),
        (runner, "prepare", "prepare"),
        (backend, "prepare", "plan"),
        (runner, "_sample", "sample"),
        (paged_op, "attend", "attend"),
        (runner.kv_pool, "write", "kv_write"),
    ]
    if runner.compiled is not None:
        wrapped.append((runner.compiled, "run", "forward"))
    if backend.decode_kernel is not None:
        wrapped.append((backend.decode_kernel, "run", "kernel"))
    steps = 0
    with contextlib.ExitStack() as stack:
        for owner, name, label in wrapped:
            stack.enter_context(timed(owner, name, label, totals))
        for r in range(rounds):
            before = eng.scheduler.steps
            # a different first token each round: the radix cache does not skip the prompt
            eng.generate([[prompt[0] + r + 1, *prompt[1:]]] * batch, params)
            steps += eng.scheduler.steps - before
    out = {label: 1e3 * seconds / steps for label, seconds in totals.items()}
    named = sum(out.get(k, 0.0) for k in ("forward", "sample", "schedule", "prepare", "plan"))
    out["host_other"] = out["step"] - named
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--requests", type=int, default=2, help="rounds per batch size")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    setup_threads(args.threads)
    eng = bench_config_engine(args.threads, args.dtype)
    result: dict[str, Any] = {"benchmark": "step_phases", "machine": machine()}
    order = ["step", "forward", "attend", "kernel", "kv_write", "sample", "host_other"]
    for batch in args.batches:
        ms = phases(eng, batch, args.tokens, args.requests)
        cells = "  ".join(f"{k} {ms[k]:.2f}" for k in order if k in ms)
        print(f"B={batch}: ms a step: {cells}", flush=True)
        result.update({f"ms_{k}_{batch}": round(v, 3) for k, v in ms.items()})
    result["dtype"] = args.dtype
    emit(result)


if __name__ == "__main__":
    main()
