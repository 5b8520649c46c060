"""What the prefill package's layers should compute in for a bf16 model
(`engine.compile_prefill_dtype`): the same prefills through a package computing in bf16 and
one computing in fp32, on this machine.

Two engines of the bench config (`serve-gemma3-bench-bf16.yaml`'s shape by default; packages
built, or loaded from the compile cache, by the engines themselves), one with
`compile_prefill_dtype: model`, one with `float32`. Reported: one decoder layer's GEMMs of 256
rows in each dtype (what `auto` times, `prefill_choice.time_gemms`); per T, a T-token prefill
through each package (`prefill_choice.best_ms_by_size`: a fresh sequence over a scratch pool,
alternating); and the engines' first token of a fresh T-token prompt (`generate` of one
token: the prefill step as served, scheduling and sampling included), alternating, median ms,
with how often the two engines' greedy first tokens agree. Ratios model / float32 (above 1:
fp32 is faster).

    .venv/bin/python -m benchmarks.prefill_dtype [--model gemma3-270m] [--tokens 64 128 210 256]
        [--rounds 5] [--threads 2]

Last line: JSON with `gemm_ratio`, `package_speedup_<T>`, `first_token_speedup_<T>`,
`first_token_ms_<dtype>_<T>` and `same_first_tokens`.
"""

from __future__ import annotations

import argparse

from benchmarks.common import (
    bench_config_engine,
    compare_prefill_arms,
    emit,
    machine,
    setup_threads,
)
from sessionserve.replicas import prefill_choice
from sessionserve.wire import SamplingParams

DTYPES = ("model", "float32")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 128, 210, 256])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    setup_threads(args.threads)
    engines = {}
    for dtype in DTYPES:
        print(f"engine computing prefills in {dtype} (packages load, or build: minutes)")
        engines[dtype] = bench_config_engine(
            args.threads, "bfloat16", model_path=args.model, compile_prefill_dtype=dtype
        )
        if engines[dtype].runner.compiled_prefill is None:
            raise SystemExit(f"the {dtype} prefill package did not build or load: see the log")
    model = engines["model"].runner.model
    summary: dict = {"machine": machine(), "model": args.model, "threads": args.threads}
    gemms = prefill_choice.time_gemms(model, 256)
    summary["gemm_ratio"] = round(gemms.model_ms / gemms.float32_ms, 3)
    print(
        f"a layer's GEMMs of 256 rows: {gemms.model_ms:.1f} ms in {gemms.dtype}, "
        f"{gemms.float32_ms:.1f} ms in float32 ({summary['gemm_ratio']:.2f}x)"
    )
    runs = {d: e.runner.compiled_prefill.run for d, e in engines.items()}
    best = {d: [float("inf")] * len(args.tokens) for d in DTYPES}
    for _ in range(max(1, args.rounds // prefill_choice.ROUNDS)):
        ms = prefill_choice.best_ms_by_size(model, args.tokens, runs)
        best = {d: [min(a, b) for a, b in zip(best[d], ms[d], strict=True)] for d in DTYPES}
    one = SamplingParams(max_tokens=1, temperature=0)
    arms = {d: lambda prompt, e=engines[d]: e.generate([prompt], one)[0] for d in DTYPES}
    vocab = model.config.vocab_size
    compare_prefill_arms(arms, best, args.tokens, args.rounds, vocab, summary)
    emit(summary)


if __name__ == "__main__":
    main()
