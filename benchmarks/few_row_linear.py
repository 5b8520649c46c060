"""The few-row linear kernel (replicas/cpu_linear.cpp) alone: every linear of a decode step of
the default model (the decoder's and the LM head, packed as the decode step package packs
them) at 1-48 rows, against torch's `F.linear` (MKL for fp32 on x86), and optionally against
another version of the kernel's source, built beside it under another op name: the way to
tell whether a change to the kernel pays, in one process, the versions alternating round by
round (this 2-core VM drifts by 15% within minutes; separate processes compare the drift).

    .venv/bin/python -m benchmarks.few_row_linear [--rows 1 4 8 16 32] [--rounds 5]
    git show HEAD~1:sessionserve/replicas/cpu_linear.cpp > /tmp/before.cpp
    .venv/bin/python -m benchmarks.few_row_linear --against-source /tmp/before.cpp

The last line is JSON: per row count the ms of one pass over all the linears for each, and
`speedup_vs_mkl_<rows>` (and `speedup_vs_source_<rows>`: above 1 = this tree's kernel faster).
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import emit, load, machine, median, rotated, setup_threads
from sessionserve.replicas import cpu_linear
from sessionserve.replicas.native_kernel import NativeKernel

OTHER_NAMESPACE = "sessionserve_before"  # the other source's op: torch.ops.<this>.cpu_linear
# an op of cpu_linear's signature: (x, packed weight, bias or empty) -> y
Linear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# what each contender is timed as: (x, weight, packed weight) -> y
Contender = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
NO_BIAS = torch.empty(0)


def load_other_source(source: Path, workdir: Path) -> Linear:
    """Build `source` (a version of cpu_linear.cpp) with its op and C function renamed, so
    that it loads beside this tree's, and return its op."""
    text = source.read_text()
    for old, new in (
        ("TORCH_LIBRARY_FRAGMENT(sessionserve,", f"TORCH_LIBRARY_FRAGMENT({OTHER_NAMESPACE},"),
        ("TORCH_LIBRARY_IMPL(sessionserve,", f"TORCH_LIBRARY_IMPL({OTHER_NAMESPACE},"),
        ("aoti_torch_cpu_cpu_linear", f"aoti_torch_cpu_{OTHER_NAMESPACE}_linear"),
    ):
        if old not in text:
            raise SystemExit(f"{source} has no {old!r}: not a version of cpu_linear.cpp")
        text = text.replace(old, new)
    renamed = workdir / "cpu_linear_before.cpp"
    renamed.write_text(text)
    kernel = NativeKernel(renamed, "", "the other kernel source", lambda: None, logging.getLogger())
    if not kernel.load():
        raise SystemExit(f"could not build {source}: {kernel.why_not()}")
    return getattr(torch.ops, OTHER_NAMESPACE).cpu_linear


def step_weights(model: torch.nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(weight, packed) of every linear the decode step package runs through the kernel,
    in the model's order (its LM head last)."""
    linears = [m for m in model.modules() if cpu_linear.supports(m)]
    return [(m.weight.detach(), cpu_linear.pack(m.weight.detach())) for m in linears]


def on_panels(op: Linear) -> Contender:
    return lambda x, weight, panels: op(x, panels, NO_BIAS)


def one_pass(contender: Contender, weights, inputs: dict[int, torch.Tensor]) -> float:
    """Seconds for every linear once (each fed an input of its width, as a step feeds it)."""
    started = time.perf_counter()
    for weight, panels in weights:
        contender(inputs[weight.shape[1]], weight, panels)
    return time.perf_counter() - started


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 6, 8, 12, 16, 32, 48])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--passes", type=int, default=3, help="timed passes per round (the best)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--against-source", type=Path, help="another version of cpu_linear.cpp to compare"
    )
    args = ap.parse_args()
    setup_threads(args.threads)
    if not cpu_linear.load():
        raise SystemExit(f"the kernel cannot be used here: {cpu_linear.why_not()}")
    weights = step_weights(load().model)
    contenders: dict[str, Contender] = {
        # the op itself, as the other source's is called (not `cpu_linear.linear`, whose
        # Python costs ~1 ms over a step's 211 calls)
        "kernel": on_panels(torch.ops.sessionserve.cpu_linear),
        "mkl": lambda x, weight, panels: F.linear(x, weight),
    }
    with tempfile.TemporaryDirectory() as tmp:
        if args.against_source:
            contenders["source"] = on_panels(load_other_source(args.against_source, Path(tmp)))
        print(
            f"machine: {machine()}; {len(weights)} linears, {sum(w.numel() for w, _ in weights):,}"
            f" fp32 weights; contenders {list(contenders)}"
        )
        summary: dict = {"benchmark": "few_row_linear", "machine": machine()}
        for rows in args.rows:
            inputs = {k: torch.randn(rows, k) for k in {w.shape[1] for w, _ in weights}}
            for weight, panels in weights[:2]:  # every contender computes the same thing
                x = inputs[weight.shape[1]]
                for contender in contenders.values():
                    got = contender(x, weight, panels)
                    torch.testing.assert_close(got, F.linear(x, weight), rtol=1e-4, atol=1e-4)
            times: dict[str, list[float]] = {name: [] for name in contenders}
            for r in range(args.rounds):
                for name in rotated(list(contenders), r):
                    contender = contenders[name]
                    one_pass(contender, weights, inputs)  # warm
                    best = min(one_pass(contender, weights, inputs) for _ in range(args.passes))
                    times[name].append(best * 1e3)
            ms = {name: median(t) for name, t in times.items()}
            line = f"rows {rows:2d}: " + ", ".join(f"{n} {v:.2f} ms" for n, v in ms.items())
            for name in contenders:
                summary[f"ms_{name}_{rows}"] = round(ms[name], 3)
                if name != "kernel":
                    summary[f"speedup_vs_{name}_{rows}"] = round(ms[name] / ms["kernel"], 3)
                    line += f"; kernel {ms[name] / ms['kernel']:.3f}x {name}"
            print(line, flush=True)
    emit(summary)


if __name__ == "__main__":
    main()
