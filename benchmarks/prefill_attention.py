"""The CPU prefill attention kernel (`attention/cpu_extend_kernel.py`) against torch's attention,
alone and in the engine's prefill steps.

Part 1, a layer's attention alone (`--model`'s head layout: the default model's 9 / 3 heads
of 64, Gemma 3 270M's 4 / 1 of 256; in `--dtype`): rows of T new tokens over H tokens of
history, through the kernel and through what the torch backend runs without it (the
context's K/V gathered out of the pool, `grouped_attention` over them with the mask; a fresh
prompt: SDPA over its new K/V, causal, or under a sliding layer's banded mask), alternating,
best of `--rounds`; ms a call and GFLOP/s. For Gemma 3 both its layers: full attention, and sliding
(each token sees the last 512 positions; over a history the backend reads only the window's
columns, kernel or not).

Part 2, the engine of the bench configs (`bench_config_engine`, `--model`, `--dtype`,
compiled, its prefill package waited for): a fresh T-token prompt and a session's T-token turn
over H tokens of history, each prefilled and one token sampled, with the backend's
`extend_kernel` on and off, alternating, median of `--rounds`.

    .venv/bin/python -m benchmarks.prefill_attention [--tokens 128 256] [--history 0 600] \
        [--dtype bfloat16 | float32] [--model default | gemma3-270m]
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
        .venv/bin/python -m benchmarks.prefill_attention --dtype float32 --skip-engine
        # torch's dispatch, its GEMMs (MKL, oneDNN) and our kernel all held to AVX2 code;
        # ATEN_CPU_CAPABILITY alone leaves MKL on AVX-512

bf16 needs a CPU with AVX512-BF16, fp32 AVX2 (it says so and stops elsewhere); on a CPU with
AMX, where the engine keeps torch's attention for bf16 by default, it sets
`SESSIONSERVE_CPU_EXTEND_KERNEL=1` unless that is set. Last line: JSON with
`kernel_speedup_<T>_over_<H>` (part 1: torch's ms over the kernel's; Gemma 3's sliding
layers `kernel_speedup_sliding_<T>_over_<H>`) and `turn_speedup_<T>_over_<H>` (part 2: the
step without the kernel over with), and the ms.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

from benchmarks.common import (
    bench_config_engine,
    best_ms,
    emit,
    machine,
    median,
    rotated,
    setup_threads,
)
from benchmarks.prefill_package import turn_ms
from sessionserve.replicas.attention import cpu_extend_kernel
from sessionserve.replicas.attention.torch_backend import (
    context_mask,
    gather_rows,
    grouped_attention,
)

# (query heads, KV heads, head_dim, sliding window or None) of each model's layer kinds
LAYERS = {
    "default": {"full": (9, 3, 64, None)},  # SmolLM2-135M
    "gemma3-270m": {"full": (4, 1, 256, None), "sliding": (4, 1, 256, 512)},
}


def layer_alone(
    tokens: int,
    history: int,
    rounds: int,
    dtype: torch.dtype,
    layer: tuple[int, int, int, int | None],
) -> dict[str, float]:
    heads, kv_heads, head_dim, window = layer
    g = torch.Generator().manual_seed(0)
    n = history + tokens
    k_pool, v_pool = (torch.randn(40000, kv_heads, head_dim, generator=g).to(dtype) for _ in "kv")
    slots = torch.randperm(40000, generator=g)[:n][None]
    if window is not None and history:  # what the backend's plan reads: the window's columns
        slots = slots[:, -(window - 1 + tokens) :]
    lens = torch.tensor([slots.shape[1]])
    query = torch.randn(tokens, heads, head_dim, generator=g).to(dtype)
    mask = context_mask(lens, tokens, slots.shape[1], window)[:, None]
    masks: dict = {}
    scale = head_dim**-0.5

    if history == 0:  # a fresh prompt's attention reads its new K/V as the layer computed
        # them, not the pool: gathered here once, outside the timing
        new_k, new_v = (gather_rows(p, slots).transpose(1, 2) for p in (k_pool, v_pool))

    def before() -> None:
        q = query.transpose(0, 1)[None]
        if history == 0:
            F.scaled_dot_product_attention(
                q,
                new_k,
                new_v,
                attn_mask=mask if window is not None else None,
                is_causal=window is None,
                scale=scale,
                enable_gqa=True,
            )
            return
        k = gather_rows(k_pool, slots).transpose(1, 2)
        v = gather_rows(v_pool, slots).transpose(1, 2)
        grouped_attention(q, k, v, mask, scale, masks)

    def kernel() -> None:
        cpu_extend_kernel.extend_attend(query, k_pool, v_pool, slots, lens, scale, window)

    times: dict[str, list[float]] = {"torch": [], "kernel": []}
    for r in range(3):
        for name, fn in rotated([("torch", before), ("kernel", kernel)], r):
            times[name].append(best_ms(fn, rounds))
    return {name: min(t) for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 256])
    ap.add_argument("--history", type=int, nargs="+", default=[0, 600])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-engine", action="store_true", help="part 1 only")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--model", choices=sorted(LAYERS), default="default")
    args = ap.parse_args()
    setup_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    # measured on a CPU with AMX too, where the engine does not take it unless told
    os.environ.setdefault(cpu_extend_kernel.DISABLE_ENV, "1")
    layers = LAYERS[args.model]
    heads, kv_heads, head_dim, _ = layers["full"]
    if not cpu_extend_kernel.usable(head_dim, heads, kv_heads, dtype):
        why = cpu_extend_kernel.why_not() or f"no {args.dtype} path on this CPU"
        sys.exit(f"the CPU prefill kernel cannot be used here: {why}")
    summary: dict = {
        "machine": machine(),
        "dtype": args.dtype,
        "model": args.model,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }
    cases = [(t, h) for t in args.tokens for h in args.history]
    print("part 1: a layer's attention alone, best ms a call", flush=True)
    for (kind, layer), (t, h) in ((item, c) for item in layers.items() for c in cases):
        ms = layer_alone(t, h, args.rounds, dtype, layer)
        window = layer[3]
        seen = sum(min(h + i + 1, window or h + i + 1) for i in range(t))  # positions scored
        flops = 4 * layer[0] * layer[2] * seen
        rate = {name: flops / v / 1e6 for name, v in ms.items()}
        print(
            f"  {kind} layer, T={t} over {h}: torch {ms['torch']:.3f} ms "
            f"({rate['torch']:.0f} GFLOP/s), kernel {ms['kernel']:.3f} ms "
            f"({rate['kernel']:.0f} GFLOP/s): {ms['torch'] / ms['kernel']:.2f}x",
            flush=True,
        )
        key = f"{t}_over_{h}" if kind == "full" else f"{kind}_{t}_over_{h}"
        summary[f"kernel_speedup_{key}"] = round(ms["torch"] / ms["kernel"], 3)
        summary[f"kernel_ms_{key}"] = round(ms["kernel"], 4)
    if args.skip_engine:
        emit(summary)
        return
    print(
        f"part 2: the engine's prefill step (bench config, {args.model}, {args.dtype}, "
        "compiled), median ms"
    )
    eng = bench_config_engine(args.threads, args.dtype, model_path=args.model)
    backend = eng.runner.backend
    if not getattr(backend, "extend_kernel", False):
        sys.exit("the bench config's backend did not take the kernel")
    g = torch.Generator().manual_seed(1)
    vocab = eng.runner.model.config.vocab_size

    def ids(n: int) -> list[int]:
        return torch.randint(100, vocab - 100, (n,), generator=g).tolist()

    for t, h in cases:
        times: dict[bool, list[float]] = {True: [], False: []}
        for r in range(args.rounds):
            for on in rotated([True, False], r):
                backend.extend_kernel = on
                times[on].append(turn_ms(eng, ids(t), ids(h) if h else None))
        on_ms, off_ms = median(times[True]), median(times[False])
        print(
            f"  T={t} over {h}: without {off_ms:.1f} ms, with the kernel {on_ms:.1f} ms: "
            f"{off_ms / on_ms:.2f}x",
            flush=True,
        )
        summary[f"turn_speedup_{t}_over_{h}"] = round(off_ms / on_ms, 3)
        summary[f"turn_ms_{t}_over_{h}"] = round(on_ms, 1)
        summary[f"turn_ms_without_{t}_over_{h}"] = round(off_ms, 1)
    backend.extend_kernel = True
    emit(summary)


if __name__ == "__main__":
    main()
