"""A packaged model's first load: its GGUF converted to fp32 safetensors in a fresh cache
(what a new machine, and every clean CI run, pays once per model), with the file parsed by
one `gguf.GGUFReader` for the tokenizer, the config and the weights
(`loader.one_gguf_reader`), against transformers' own three parses, alternating, in one
process. Each conversion goes to its own temporary cache, removed afterwards.

    python -m benchmarks.model_conversion                       # both packaged models, 2 rounds
    python -m benchmarks.model_conversion --models default --rounds 3

Last line: one JSON object (`speedup_<model>`: the three parses' seconds over the one's).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import time
from unittest import mock

import torch

from benchmarks.common import emit, machine, median, setup_threads
from sessionserve.replicas import loader


def converted_seconds(model: str, shared: bool) -> float:
    """Seconds to load `model` into an empty cache (converting it)."""
    with tempfile.TemporaryDirectory(prefix="ss-conversion-") as cache:
        off = mock.patch.object(loader, "one_gguf_reader", contextlib.nullcontext)
        with mock.patch.dict(os.environ, {"SESSIONSERVE_CACHE_DIR": cache}):
            with contextlib.nullcontext() if shared else off:
                gguf = loader.PACKAGED_GGUF[model]()  # (Gemma's assembled file: cached once)
                t = time.perf_counter()
                loader._load_gguf(gguf, torch.float32)
                return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=list(loader.PACKAGED_GGUF))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    setup_threads(args.threads)
    results: dict[str, dict[str, list[float]]] = {}
    for model in args.models:
        loader.PACKAGED_GGUF[model]()  # assemble Gemma's chunks before anything is timed
        runs = results.setdefault(model, {"three_parses": [], "one_parse": []})
        for r in range(args.rounds):
            order = [False, True] if r % 2 == 0 else [True, False]
            for shared in order:
                s = converted_seconds(model, shared)
                runs["one_parse" if shared else "three_parses"].append(round(s, 1))
                print(f"{model}: {'one parse' if shared else 'three parses'} {s:.1f} s", flush=True)
    summary = {"benchmark": "model_conversion", "machine": machine(), "seconds": results}
    for model, runs in results.items():
        summary[f"speedup_{model}"] = round(
            median(runs["three_parses"]) / median(runs["one_parse"]), 2
        )
    emit(summary)


if __name__ == "__main__":
    main()
