"""What reading K/V out of the paged pool costs a decode step, and what `index_select` saves.

The torch attention backend gathers each sequence's K/V rows out of the pool for every layer
of every step before SDPA (`attention/torch_backend.py`, `gather_rows`). This measures ms per
decode step of the engine (the default model, compiled forward) with B requests decoding over
L-token contexts, the gather done by `index_select` (what the backend does) against advanced
indexing (`pool[slots]`, `aten::index`, what it did before), alternating rounds in this process
on the same requests. Greedy tokens are checked to be the same both ways.

    .venv/bin/python -m benchmarks.paged_gather [--points 1x300 8x300 1x2000 4x2000]

Last line: JSON with `step_ms_{B}x{L}` (index_select), `step_ms_index_{B}x{L}` and
`gather_speedup_{B}x{L}` (ratio of the two).
"""

from __future__ import annotations

import argparse

from benchmarks.common import alternate_decode_steps, emit, engine, load, machine, setup_threads
from sessionserve.replicas.attention import torch_backend
from sessionserve.wire import SamplingParams

GATHERS = {
    "index_select": torch_backend.gather_rows,
    "index": lambda pool, index: pool[index],  # the backend's gather before
}


def step_ms(loaded, batch: int, context: int, rounds: int, steps: int) -> dict[str, float]:
    """Median ms per decode step with each gather, alternating `rounds` times."""
    eng = engine(
        loaded,
        sessions=False,
        radix=False,
        max_running=batch,
        num_slots=batch * (context + 16 + rounds * 2 * (steps + 1)) + 256,
        prefill=2048,
        compile=True,
    )
    if eng.runner.compiling is not None:
        eng.runner.compiling.join()
    params = SamplingParams(max_tokens=rounds * 2 * (steps + 1) + 8, temperature=0, ignore_eos=True)
    prompts = [[100 + (b * 7 + i) % 9000 for i in range(context)] for b in range(batch)]
    rids = [eng.submit(p, params) for p in prompts]
    variants = {
        name: (lambda gather=gather: setattr(torch_backend, "gather_rows", gather))
        for name, gather in GATHERS.items()
    }
    ms = alternate_decode_steps(eng, variants, rounds, steps)
    torch_backend.gather_rows = GATHERS["index_select"]
    for rid in rids:
        eng.abort(rid)
    eng.run_until_idle()
    return ms


def same_tokens(loaded) -> bool:
    """Both gathers give the same greedy answer (they copy the same values)."""
    outs = []
    for gather in GATHERS.values():
        torch_backend.gather_rows = gather
        eng = engine(loaded, sessions=False, radix=False, max_running=2, compile=True)
        if eng.runner.compiling is not None:
            eng.runner.compiling.join()
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        prompts = [list(range(200, 500)), list(range(900, 1000))]
        outs.append([r.output_ids for r in eng.generate(prompts, params)])
    torch_backend.gather_rows = GATHERS["index_select"]
    return outs[0] == outs[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--points", nargs="+", default=["1x300", "8x300", "1x2000", "4x2000"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    setup_threads(args.threads)
    loaded = load()
    summary = {"benchmark": "paged_gather", "machine": machine()}
    summary["identical"] = same = same_tokens(loaded)
    print(f"greedy tokens the same with both gathers: {same}")
    print(f"{'batch x context':>16} {'index_select ms':>16} {'pool[slots] ms':>15} {'speedup':>8}")
    for point in args.points:
        batch, context = (int(x) for x in point.split("x"))
        ms = step_ms(loaded, batch, context, args.rounds, args.steps)
        ratio = ms["index"] / ms["index_select"]
        print(f"{point:>16} {ms['index_select']:>16.1f} {ms['index']:>15.1f} {ratio:>7.2f}x")
        summary[f"step_ms_{point}"] = round(ms["index_select"], 2)
        summary[f"step_ms_index_{point}"] = round(ms["index"], 2)
        summary[f"gather_speedup_{point}"] = round(ratio, 3)
    emit(summary)


if __name__ == "__main__":
    main()
