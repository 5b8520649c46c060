"""Where the prefill package should take over from the compiled forward's package: decode
steps of B requests run through each, alternating, in one engine.

The forward's package (`engine.compile`) has its GEMMs autotuned for 2 rows; the prefill
package (`engine.compile_prefill`) keeps oneDNN GEMMs on prepacked weights, laid out for 256
rows. A decode step of B requests is a B-row forward, so from some B on the second wins:
`engine.compile_prefill_min_tokens` is set from this. Both packages are built (or loaded from
the cache) by the engine itself, with `compile_prefill: true`. Per B: B requests with
`--prompt`-token prompts are prefilled, then `--rounds` rounds of `--steps` decode steps
through each package, alternating; median ms a step and the ratio forward's / prefill's
(above 1: the prefill package is faster).

    .venv/bin/python -m benchmarks.package_split [--batches 1 2 4 8 16] [--threads 2]
        [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from benchmarks.common import emit, load, machine, median, setup_threads
from sessionserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from sessionserve.replicas.engine import Engine
from sessionserve.wire import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 6, 8, 16])
    ap.add_argument("--prompt", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = ap.parse_args()
    setup_threads(args.threads)
    chunk = 512
    cfg = EngineConfig(
        model=ModelConfig(path="default", torch_threads=args.threads, dtype=args.dtype),
        cache=CacheConfig(num_slots=23296, max_rows=96, max_context_len=4096),
        scheduler=SchedulerConfig(max_running_requests=32, max_prefill_tokens=chunk),
        compile=True,
        compile_prefill=True,
    )
    eng = Engine(cfg, load("default", cfg.model.torch_dtype()))
    runner = eng.runner
    forward, prefill = runner.compiled, runner.compiled_prefill
    if forward is None or prefill is None:
        raise SystemExit("a package did not build or load: see the log above")
    vocab = runner.model.config.vocab_size
    g = torch.Generator().manual_seed(0)

    def route(name: str) -> None:  # every decode step through `name`'s package
        prefill.min_tokens = 1 if name == "prefill" else forward.max_tokens + 1

    summary: dict = {"machine": machine(), "prompt": args.prompt, "dtype": args.dtype}
    for batch in args.batches:
        route("forward")
        params = SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True)
        rids = [
            eng.submit(
                torch.randint(100, vocab - 100, (args.prompt,), generator=g).tolist(), params
            )
            for _ in range(batch)
        ]
        for _ in range(math.ceil(batch * args.prompt / chunk) + 2):  # prefilled, then decoding
            eng.step()
        ms: dict[str, list[float]] = {"forward": [], "prefill": []}
        for _ in range(args.rounds):
            for name, times in ms.items():
                route(name)
                eng.step()  # the first step after a switch is not timed
                started = time.perf_counter()
                for _ in range(args.steps):
                    eng.step()
                times.append(1000 * (time.perf_counter() - started) / args.steps)
        for rid in rids:
            eng.abort(rid)
        eng.run_until_idle()
        eng.check_memory()
        a, b = median(ms["forward"]), median(ms["prefill"])
        print(
            f"batch {batch}: forward's package {a:.1f} ms, prefill package {b:.1f} ms, "
            f"ratio {a / b:.2f}",
            flush=True,
        )
        summary[f"forward_ms_{batch}"], summary[f"prefill_ms_{batch}"] = round(a, 1), round(b, 1)
        summary[f"ratio_{batch}"] = round(a / b, 3)
    route("forward")
    emit(summary)


if __name__ == "__main__":
    main()
