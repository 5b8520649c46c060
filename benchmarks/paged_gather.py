"""What reading K/V out of the paged pool costs a decode step, and what reading it in place saves.

The torch attention backend's general path gathers each sequence's K/V rows out of the pool
for every layer of every step before SDPA (`attention/torch_backend.py`, `gather_rows`);
where the compiled forward runs, decode rows instead call the compiled in-place kernel
(`attention/inplace_decode.py`, `replicas/compiled_attention.py`). This measures ms per decode
step of the engine (the default model, compiled forward) with B requests decoding over
L-token contexts, the kernel installed ("in place") and not ("gather": `index_select` + SDPA),
alternating rounds in this process on the same requests; the greedy tokens of both are
checked to be the same.

    .venv/bin/python -m benchmarks.paged_gather [--points 1x300 8x300 1x2000 4x2000]

Last line: JSON with `step_ms_inplace_{B}x{L}`, `step_ms_gather_{B}x{L}` and
`inplace_speedup_{B}x{L}` (gather / in place).
"""

from __future__ import annotations

import argparse

from benchmarks.common import alternate_decode_steps, emit, engine, load, machine, setup_threads
from sessionserve.replicas.engine import Engine
from sessionserve.wire import SamplingParams


def compiled_engine(loaded, **kw) -> Engine:
    eng = engine(loaded, sessions=False, radix=False, compile=True, **kw)
    if eng.runner.compiling is not None:
        eng.runner.compiling.join()
    if eng.runner.backend.decode_kernel is None:
        raise SystemExit("the in-place decode kernel did not install (see the log above)")
    return eng


def step_ms(loaded, batch: int, context: int, rounds: int, steps: int) -> dict[str, float]:
    """Median ms per decode step with and without the kernel, alternating `rounds` times."""
    eng = compiled_engine(
        loaded,
        max_running=batch,
        num_slots=batch * (context + 16 + rounds * 2 * (steps + 1)) + 256,
        prefill=2048,
    )
    backend, kernel = eng.runner.backend, eng.runner.backend.decode_kernel
    params = SamplingParams(max_tokens=rounds * 2 * (steps + 1) + 8, temperature=0, ignore_eos=True)
    prompts = [[100 + (b * 7 + i) % 9000 for i in range(context)] for b in range(batch)]
    rids = [eng.submit(p, params) for p in prompts]
    variants = {
        "in place": lambda: setattr(backend, "decode_kernel", kernel),
        "gather": lambda: setattr(backend, "decode_kernel", None),
    }
    ms = alternate_decode_steps(eng, variants, rounds, steps)
    for rid in rids:
        eng.abort(rid)
    eng.run_until_idle()
    eng.close()
    return ms


def same_tokens(loaded) -> bool:
    """Both paths give the same greedy answer."""
    eng = compiled_engine(loaded, max_running=2)
    kernel = eng.runner.backend.decode_kernel
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = [list(range(200, 500)), list(range(900, 1000))]
    outs = []
    for installed in (kernel, None):
        eng.runner.backend.decode_kernel = installed
        outs.append([r.output_ids for r in eng.generate(prompts, params)])
    eng.close()
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
    print(f"greedy tokens the same both ways: {same}")
    print(f"{'batch x context':>16} {'in place ms':>12} {'gather ms':>10} {'speedup':>8}")
    for point in args.points:
        batch, context = (int(x) for x in point.split("x"))
        ms = step_ms(loaded, batch, context, args.rounds, args.steps)
        ratio = ms["gather"] / ms["in place"]
        print(f"{point:>16} {ms['in place']:>12.1f} {ms['gather']:>10.1f} {ratio:>7.2f}x")
        summary[f"step_ms_inplace_{point}"] = round(ms["in place"], 2)
        summary[f"step_ms_gather_{point}"] = round(ms["gather"], 2)
        summary[f"inplace_speedup_{point}"] = round(ratio, 3)
    emit(summary)


if __name__ == "__main__":
    main()
