"""The prefill package's LM head as the GGUF's blocks (`gguf_int4.block_head`, planned where
the 4-bit decode step package runs the file's weights) against the same package with its
dense head, on this machine.

One engine of the bench config (`serve-gemma3-bench-bf16.yaml`'s shape by default; its
packages built, or loaded from the compile cache), whose prefill package reads the file's
head; beside it the same plan without the head (`head_gguf` None: built here by a build
process the first time, minutes). Per T: a T-token prefill through each package
(`prefill_choice.best_ms_by_size`: a fresh sequence over a scratch pool, alternating), and
the engine's first token of a fresh T-token prompt with each package installed in turn
(`generate` of one token: the prefill step as served, the radix cache flushed before each),
alternating, median ms, with how often the greedy first tokens agree. Ratios dense / blocks
(above 1: the file's head is faster).

    .venv/bin/python -m benchmarks.prefill_head [--model gemma3-270m] [--tokens 12 16 32 64 210]
        [--rounds 5] [--threads 2]

Last line: JSON with `package_speedup_<T>`, `first_token_speedup_<T>`,
`first_token_ms_<head>_<T>` and `same_first_tokens`.
"""

from __future__ import annotations

import argparse
import copy
import functools

from benchmarks.common import (
    bench_config_engine,
    compare_prefill_arms,
    emit,
    machine,
    setup_threads,
)
from sessionserve.replicas import compiled_forward, prefill_choice
from sessionserve.replicas.assembly import prefill_package_max_tokens
from sessionserve.replicas.compiled_forward import CompiledForward
from sessionserve.wire import SamplingParams

HEADS = ("dense", "blocks")


def dense_head_package(engine, blocks: CompiledForward) -> CompiledForward:
    """`blocks`' package as the engine planned it but without the GGUF's head (its key
    differs in that alone), built by a build process where the cache has none."""
    cfg, runner = engine.config, engine.runner
    model = runner.model
    forward = compiled_forward.plan_compile(
        True, model, runner.compiled.max_tokens, str(blocks.package.parent), runner.feature_layers
    )
    plan = compiled_forward.plan_prefill_compile(
        True,
        forward,
        model,
        prefill_package_max_tokens(cfg),
        blocks.min_tokens,
        cfg.compile_prefill_dtype,
    )
    if not plan.enabled or plan.package is None:
        raise SystemExit(f"no prefill package to compare with: {plan.reason}")
    if not plan.package.exists():
        print(f"building the dense-head prefill package {plan.package.name} (minutes)")
        build = copy.deepcopy(model)
        compiled_forward.build_once(
            plan.package, lambda: compiled_forward.build_in_subprocess(build, plan), "building"
        )
    return CompiledForward(plan.package, blocks.max_tokens, blocks.min_tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--tokens", type=int, nargs="+", default=[12, 16, 32, 64, 210])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    setup_threads(args.threads)
    print("engine (packages load, or build: minutes)")
    engine = bench_config_engine(args.threads, "bfloat16", model_path=args.model)
    runner = engine.runner
    blocks = runner.compiled_prefill
    if blocks is None or runner.compiled_int4_decode is None:
        raise SystemExit(
            "no prefill package reading the GGUF's head here (needs the 4-bit "
            "decode step package: a bf16 model from a GGUF, AVX-512 VNNI)"
        )
    packages = {"dense": dense_head_package(engine, blocks), "blocks": blocks}
    model = runner.model
    summary: dict = {"machine": machine(), "model": args.model, "threads": args.threads}
    runs = {h: p.run for h, p in packages.items()}
    best = {h: [float("inf")] * len(args.tokens) for h in HEADS}
    for _ in range(max(1, args.rounds // prefill_choice.ROUNDS)):
        ms = prefill_choice.best_ms_by_size(model, args.tokens, runs)
        best = {h: [min(a, b) for a, b in zip(best[h], ms[h], strict=True)] for h in HEADS}
    one = SamplingParams(max_tokens=1, temperature=0)

    def first_token(head: str, prompt: list[int]):
        runner.compiled_prefill = packages[head]
        engine.cache.flush()  # the other arm's prompt is no prefix to reuse
        return engine.generate([prompt], one)[0]

    arms = {h: functools.partial(first_token, h) for h in HEADS}
    vocab = model.config.vocab_size
    compare_prefill_arms(arms, best, args.tokens, args.rounds, vocab, summary)
    runner.compiled_prefill = blocks
    emit(summary)


if __name__ == "__main__":
    main()
