"""The logits GEMM on oneDNN (replicas/logits_head.py) against torch's default (`F.linear`,
MKL for fp32 on x86): first the default model's LM head alone for 1-32 rows, then whole decode
steps of the engine's eager forward (2 torch threads; where the logits take this path: the
compiled forward keeps its own head GEMM) at batch 1 and 8 with each, the two alternating on
the same running requests (`benchmarks.common.alternate_decode_steps`).

    .venv/bin/python -m benchmarks.logits_head [--rounds 3] [--steps 16]

The last line is JSON: per row count the GEMM ratio, per batch the decode-step ratio
(torch's time / oneDNN's: above 1 = oneDNN faster).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from benchmarks.common import (
    alternate_decode_steps,
    emit,
    engine,
    load,
    machine,
    median,
    setup_threads,
)
from sessionserve.replicas import model_runner
from sessionserve.replicas.logits_head import head_logits, uses_onednn, vocab_linear
from sessionserve.replicas.openmp import run_on_passing_thread
from sessionserve.wire import SamplingParams


def gemm_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=16, help="decode steps timed per round")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    setup_threads(args.threads)
    loaded = load()
    weight = loaded.model.get_output_embeddings().weight.detach()
    summary: dict = {"benchmark": "logits_head", "machine": machine(), "vocab": weight.shape[0]}
    print(f"machine: {machine()}; LM head {tuple(weight.shape)} fp32")
    for rows in (1, 2, 4, 8, 16, 32):
        x = torch.randn(rows, weight.shape[1])
        assert uses_onednn(x, weight)
        torch.testing.assert_close(vocab_linear(x, weight), F.linear(x, weight))
        base = gemm_ms(lambda x=x: F.linear(x, weight), 20)
        ours = gemm_ms(lambda x=x: vocab_linear(x, weight), 20)
        print(f"{rows:>3} rows: torch {base:6.2f} ms, oneDNN {ours:6.2f} ms, {base / ours:.2f}x")
        summary[f"gemm_ratio_{rows}"] = round(base / ours, 2)
    # an engine thread that did not load the model: one OpenMP team (replicas/openmp.py)
    eng = run_on_passing_thread(
        lambda: engine(loaded, sessions=False, max_running=8, compile=False), "build"
    )
    variants = {
        "torch": lambda: setattr(model_runner, "head_logits", lambda head, h: head(h)),
        "onednn": lambda: setattr(model_runner, "head_logits", head_logits),
    }
    for batch in (1, 8):
        rids = [
            eng.submit(
                list(range(100 + 40 * i, 164 + 40 * i)),
                SamplingParams(max_tokens=4_000, temperature=0, ignore_eos=True),
            )
            for i in range(batch)
        ]
        ms = alternate_decode_steps(eng, variants, args.rounds, args.steps)
        for rid in rids:
            eng.abort(rid)
        while eng.has_work():
            eng.step()
        ratio = ms["torch"] / ms["onednn"]
        print(
            f"batch {batch}: decode step torch {ms['torch']:.1f} ms, oneDNN {ms['onednn']:.1f}"
            f" ms, {ratio:.2f}x"
        )
        summary[f"step_ms_torch_{batch}"] = round(ms["torch"], 1)
        summary[f"step_ms_onednn_{batch}"] = round(ms["onednn"], 1)
        summary[f"step_ratio_{batch}"] = round(ratio, 2)
    model_runner.head_logits = head_logits
    emit(summary)


if __name__ == "__main__":
    main()
