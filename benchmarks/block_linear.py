"""The block-quantized linear kernel (replicas/block_linear.cpp) alone, on the default model's
own weights: every linear of a decode step (the GGUF's Q4 decoder linears and Q8_0 LM head,
read as the 4-bit decode step package reads them) at 1-64 bf16 rows, through its two paths
(the rows as two int8 terms on VNNI; on CPUs with AMX, each record expanded to bf16 on
tiles), in one process, alternating round by round (this 2-core VM drifts by 15% within
minutes). How a whole step compares with the dense package: benchmarks/int4_decode.py (eager
bf16 `F.linear` of one row is no fair baseline: the packages prepack their weights).

    .venv/bin/python -m benchmarks.block_linear [--rows 1 4 8 10 12 16 32 48 64] [--rounds 5]

The last line is JSON: per row count the ms of one pass over all the linears for each path,
`ms_terms_<rows>` and `ms_tiles_<rows>`, and `tiles_over_terms_<rows>` (above 1 = tiles
faster), with `tile_rows` the default from which the op takes the tiles. Without AMX tiles it
times the terms alone.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.common import emit, load, machine, setup_threads
from sessionserve.replicas import block_linear, gguf_int4

Pass = Callable[[dict[int, torch.Tensor]], None]


def step_linears() -> list[block_linear.BlockWeight]:
    """The block weights the 4-bit package runs."""
    loaded = load("default", torch.bfloat16)
    if loaded.gguf is None:
        raise SystemExit("the default model was not loaded from a GGUF")
    model = loaded.model
    decoder = model.get_decoder()
    prefix = next(name for name, m in model.named_modules() if m is decoder)
    weights = gguf_int4.read_block_linears(
        Path(loaded.gguf), decoder, prefix, model.config, lm_head=model.lm_head
    )
    return list(weights.values())


def timed(one_pass: Pass, inputs: dict[int, torch.Tensor], passes: int) -> float:
    """The best of `passes` passes, in ms (after one untimed)."""
    one_pass(inputs)
    best = float("inf")
    for _ in range(passes):
        started = time.perf_counter()
        one_pass(inputs)
        best = min(best, time.perf_counter() - started)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 10, 12, 16, 32, 48, 64])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--passes", type=int, default=3, help="timed passes per round (the best)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    setup_threads(args.threads)
    if not block_linear.load():
        raise SystemExit(f"the block kernel cannot run here: {block_linear.why_not()}")
    blocks = step_linears()
    default = block_linear.tile_rows()
    print(
        f"{len(blocks)} linears, {sum(w.records.numel() for w in blocks) / 1e6:.1f} MB of "
        f"records; tiles from {default} rows (0: no AMX tiles here)",
        flush=True,
    )

    def block_pass(inputs: dict[int, torch.Tensor]) -> None:
        for w in blocks:
            block_linear.linear(inputs[w.in_features], w)

    result: dict[str, object] = {"benchmark": "block_linear", "machine": machine()}
    result["tile_rows"] = default
    paths = ["terms", "tiles"] if default else ["terms"]
    for rows in args.rows:
        inputs = {k: torch.randn(rows, k).bfloat16() for k in {w.in_features for w in blocks}}
        ms: dict[str, list[float]] = {p: [] for p in paths}
        for _ in range(args.rounds):
            for path in paths:
                block_linear.set_tile_rows(1 if path == "tiles" else 0)
                ms[path].append(timed(block_pass, inputs, args.passes))
        block_linear.set_tile_rows(default)
        med = {p: statistics.median(v) for p, v in ms.items()}
        line = ", ".join(f"{p} {med[p]:.2f}" for p in paths)
        ratio = f"; tiles over terms {med['terms'] / med['tiles']:.2f}x" if default else ""
        print(f"{rows} rows: {line} ms{ratio}", flush=True)
        result |= {f"ms_{p}_{rows}": round(v, 3) for p, v in med.items()}
        if default:
            result[f"tiles_over_terms_{rows}"] = round(med["terms"] / med["tiles"], 3)
    emit(result)


if __name__ == "__main__":
    main()
