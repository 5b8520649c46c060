"""The in-place decode attention kernel alone: today's formulation against another one.

`replicas/compiled_attention.py` compiles `decode_attention` (`attention/inplace_decode.py`)
with AOTInductor. Until 2026-11-25 it was exported from a toy example (2 rows of 2 slots a
part), from which inductor split the scores' loop over rows only and ran the softmax's loops
on one thread, and its scores broadcast the query over the group of query heads sharing a KV
head, which inductor compiled into a loop that loads and converts each K row once per query
head. This builds both kernels in this run (seconds each, in a temporary directory), calls
them on the same pool (random 16-slot pages) and rows, rounds alternating, and checks that
they agree. `--against` picks the other formulation: `broadcast` (the one before, default),
`matmul` (scores and weighted sum as batched matmuls over the gathered rows, which inductor
hands to oneDNN), `sdpa` (torch's SDPA over the gathered rows, with a length mask) or
`page_transposed` (the K pool stored with each page's keys transposed, so scores can run
across a page's tokens; the kernel alone, the pool converted once outside the timing) or
`cpu_kernel` (not a formulation: the hand-written AVX-512 kernel the decode step package
calls, replicas/attention/cpu_decode_kernel.py; a speedup under 1 means it is faster).

With `--engine-points`, the same two kernels also take turns inside the engine (the default
model, compiled forward, in the same dtype): ms per decode step of B requests over L-token
contexts, alternating rounds on the same requests (what a served decode step gains).

    .venv/bin/python -m benchmarks.decode_attention [--points 1x300 8x300 1x2000 8x2000]
        [--engine-points 1x300 8x300 4x1000]
        [--against broadcast | matmul | sdpa | page_transposed | cpu_kernel]
        [--model default | gemma3-270m]

Defaults: SmolLM2-135M's head layout (9 query heads, 3 KV heads, 64 wide) in bf16; with
`--model gemma3-270m` Gemma 3 270M's (4 query heads, 1 KV head, 256 wide) and that model in
the engine points (every layer, sliding ones included, takes the kernel under test: a
sliding layer's rows read only their window's slots).
Last line: JSON with `against`, `us_now_{B}x{L}`, `us_before_{B}x{L}` (the other formulation)
and `speedup_{B}x{L}` (the kernel alone), and `step_ms_now_{B}x{L}`, `step_ms_before_{B}x{L}`,
`step_speedup_{B}x{L}`.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import (
    alternate_decode_steps,
    emit,
    load,
    machine,
    median,
    setup_threads,
)
from benchmarks.paged_gather import compiled_engine
from sessionserve.replicas.attention import cpu_decode_kernel
from sessionserve.replicas.attention.inplace_decode import DecodeKernel
from sessionserve.replicas.compiled_attention import HeadLayout, build_kernel, kernel_chunks
from sessionserve.replicas.compiled_forward import load_flat
from sessionserve.wire import SamplingParams

PAGE = 16


class BroadcastGroup(torch.nn.Module):
    """The formulation before 2026-11-25: the group's query heads broadcast against each K
    and V row (the rest as `decode_attention`)."""

    def __init__(self, chunks: int, scale: float) -> None:
        super().__init__()
        self.chunks, self.scale = chunks, scale

    def forward(self, query, k_pool, v_pool, slots, lens):  # noqa: ANN001, ANN201 - as the kernel
        batch, width = slots.shape
        kv_heads, head_dim = k_pool.shape[1], k_pool.shape[2]
        parts = slots.view(batch, self.chunks, -1).transpose(0, 1)
        q = (query.float() * self.scale).view(1, batch, 1, kv_heads, -1, head_dim)
        scores = (q * k_pool[parts].float()[..., None, :]).sum(-1)
        position = torch.arange(width, device=slots.device).view(self.chunks, 1, -1)
        seen = position < lens[None, :, None]
        scores = scores.masked_fill(~seen[..., None, None], float("-inf"))
        top = scores.amax(2, keepdim=True).clamp(min=torch.finfo(torch.float32).min)
        weights = torch.exp(scores - top)
        partial = (weights[..., None] * v_pool[parts].float()[..., None, :]).sum(2)
        top = top[:, :, 0]
        rescale = torch.exp(top - top.amax(0))
        total = (weights.sum(2) * rescale).sum(0)
        out = (partial * rescale[..., None]).sum(0) / total[..., None]
        return out.reshape(query.shape).to(query.dtype)


class GatheredMatmul(torch.nn.Module):
    """Each row's K and V rows gathered, then scores and the weighted sum as batched matmuls
    (GEMMs with the tokens as one side, no per-token horizontal sums) and a masked softmax."""

    def __init__(self, chunks: int, scale: float) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, query, k_pool, v_pool, slots, lens):  # noqa: ANN001, ANN201 - as the kernel
        batch, width = slots.shape
        kv_heads, head_dim = k_pool.shape[1], k_pool.shape[2]
        keys = k_pool[slots].permute(0, 2, 1, 3)  # [B, KVH, W, D]
        values = v_pool[slots].permute(0, 2, 1, 3)
        q = (query.float() * self.scale).to(query.dtype).view(batch, kv_heads, -1, head_dim)
        scores = torch.matmul(q, keys.transpose(-1, -2)).float()  # [B, KVH, G, W]
        seen = torch.arange(width, device=slots.device)[None, :] < lens[:, None]
        scores = scores.masked_fill(~seen[:, None, None, :], float("-inf"))
        out = torch.matmul(torch.softmax(scores, -1).to(values.dtype), values)
        return out.reshape(query.shape).to(query.dtype)


class GatheredSdpa(torch.nn.Module):
    """Each row's K and V rows gathered, then torch's SDPA with a length mask (the torch
    backend's general path, in one graph)."""

    def __init__(self, chunks: int, scale: float) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, query, k_pool, v_pool, slots, lens):  # noqa: ANN001, ANN201 - as the kernel
        width = slots.shape[1]
        keys, values = k_pool[slots].transpose(1, 2), v_pool[slots].transpose(1, 2)
        seen = torch.arange(width, device=slots.device)[None, :] < lens[:, None]
        out = F.scaled_dot_product_attention(
            query[:, :, None], keys, values, seen[:, None, None], scale=self.scale, enable_gqa=True
        )
        return out.reshape(query.shape)


class PageTransposedKeys(torch.nn.Module):
    """The K pool stored [pages, KVH, D, PAGE] (each page's keys transposed, as CPU attention
    kernels lay them out) so that a page's 16 scores can be computed across its tokens, with
    no per-token horizontal sum; V stays [S, KVH, D]. Takes each row's pages, not slots."""

    def __init__(self, chunks: int, scale: float) -> None:
        super().__init__()
        self.chunks, self.scale = chunks, scale

    def forward(self, query, kt_pool, v_pool, pages, lens):  # noqa: ANN001, ANN201 - as the kernel
        batch, kv_heads, head_dim = pages.shape[0], kt_pool.shape[1], kt_pool.shape[2]
        parts = pages.view(batch, self.chunks, -1).transpose(0, 1)  # [C, B, NP/C]
        q = (query.float() * self.scale).view(1, batch, 1, kv_heads, -1, head_dim)
        group = q.shape[4]
        keys = kt_pool[parts].float()  # [C, B, NP/C, KVH, D, PAGE]
        scores = torch.stack([(q[..., g, :, None] * keys).sum(-2) for g in range(group)], -1)
        chunks, _, per_part = scores.shape[:3]  # [C, B, NP/C, KVH, PAGE, G] -> token order
        scores = scores.permute(0, 1, 2, 4, 3, 5).reshape(chunks, batch, -1, kv_heads, group)
        position = torch.arange(scores.shape[2] * chunks, device=pages.device)
        seen = position.view(chunks, 1, -1) < lens[None, :, None]
        scores = scores.masked_fill(~seen[..., None, None], float("-inf"))
        top = scores.amax(2, keepdim=True).clamp(min=torch.finfo(torch.float32).min)
        weights = torch.exp(scores - top)
        slots = parts[..., None] * PAGE + torch.arange(PAGE, device=pages.device)
        values = v_pool[slots.reshape(chunks, batch, per_part * PAGE)].float()
        partial = torch.stack([(weights[..., g, None] * values).sum(2) for g in range(group)], 3)
        top = top[:, :, 0]
        rescale = torch.exp(top - top.amax(0))
        total = (weights.sum(2) * rescale).sum(0)
        out = (partial * rescale[..., None]).sum(0) / total[..., None]
        return out.reshape(query.shape).to(query.dtype)


def build_page_transposed(path: Path, layout: HeadLayout) -> Callable[..., torch.Tensor]:
    """`PageTransposedKeys` exported as the kernel is (rows, pages and pool dynamic), called
    with the kernel's arguments: the pool is transposed and the slots turned into pages once
    per pool (outside the timed calls; a real pool would be written in that layout)."""
    dtype, chunks = getattr(torch, layout.dtype.removeprefix("torch.")), kernel_chunks()
    kv_heads, dim, pages = layout.num_kv_heads, layout.head_dim, 4096
    example = (
        torch.zeros(2, layout.num_heads, dim, dtype=dtype),
        torch.zeros(pages, kv_heads, dim, PAGE, dtype=dtype),
        torch.zeros(pages * PAGE, kv_heads, dim, dtype=dtype),
        torch.zeros(2, chunks * 6, dtype=torch.int64),
        torch.full((2,), chunks * 6 * PAGE),
    )
    rows, n_pages = torch.export.Dim("rows", min=1), torch.export.Dim("pages", min=2)
    n_slots, width = torch.export.Dim("slots", min=2), chunks * torch.export.Dim("width", min=1)
    program = torch.export.export(
        PageTransposedKeys(chunks, layout.scale),
        example,
        dynamic_shapes=({0: rows}, {0: n_pages}, {0: n_slots}, {0: rows, 1: width}, {0: rows}),
    )
    torch._inductor.aoti_compile_and_package(
        program, package_path=str(path), inductor_configs={"compile_threads": 1}
    )
    package = load_flat(path)
    converted: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def run(query, k_pool, v_pool, slots, lens):  # noqa: ANN001, ANN202 - as the kernel
        if id(k_pool) not in converted:  # whole pages only (inputs() gives every row pages)
            shape = (k_pool.shape[0] // PAGE, PAGE, kv_heads, dim)
            kt_pool = k_pool.view(shape).permute(0, 2, 3, 1).contiguous()
            width = -(-slots.shape[1] // (PAGE * chunks)) * PAGE * chunks
            padded = torch.nn.functional.pad(slots, (0, width - slots.shape[1]))
            converted[id(k_pool)] = kt_pool, padded[:, ::PAGE] // PAGE
        kt_pool, pages_ = converted[id(k_pool)]
        return package(query, kt_pool, v_pool, pages_, lens)[0]

    return run


def cpu_kernel_as_kernel(layout: HeadLayout) -> Callable[..., torch.Tensor]:
    """The hand-written CPU kernel (replicas/attention/cpu_decode_kernel.py) as the engine's torch
    backend calls it: no own token, the rows' K/V in the pool."""
    if not cpu_decode_kernel.load():
        raise SystemExit(f"the CPU decode kernel is not usable: {cpu_decode_kernel.why_not()}")
    return cpu_decode_kernel.over_the_pool(layout.scale)


# (query heads, KV heads, head_dim); both models' scale is head_dim ** -0.5 (Gemma 3's
# query_pre_attn_scalar is its head_dim)
HEAD_LAYOUTS = {"default": (9, 3, 64), "gemma3-270m": (4, 1, 256)}

AGAINST = {
    "broadcast": BroadcastGroup,
    "matmul": GatheredMatmul,
    "sdpa": GatheredSdpa,
    "page_transposed": PageTransposedKeys,
    "cpu_kernel": None,  # not a formulation: the hand-written kernel
}


def build_both(layout: HeadLayout, where: Path, against: str = "broadcast") -> dict[str, object]:
    started = time.monotonic()
    now_path, before_path = where / "now.pt2", where / "before.pt2"
    build_kernel(now_path, layout)

    def load(path: Path):  # noqa: ANN202 - called as the engine's DecodeKernel calls it
        package = load_flat(path)
        return lambda *args: package(*args)[0]

    if against == "page_transposed":  # its own inputs: exported apart
        other = build_page_transposed(before_path, layout)
    elif against == "cpu_kernel":
        other = cpu_kernel_as_kernel(layout)
    else:
        baseline = AGAINST[against](kernel_chunks(), layout.scale)
        if against == "broadcast":  # built from the toy example it was built from then
            build_kernel(before_path, layout, baseline, example_rows=2, example_part_width=2)
        else:
            build_kernel(before_path, layout, baseline)
        other = load(before_path)
    print(f"built both kernels in {time.monotonic() - started:.0f} s", flush=True)
    return {"now": load(now_path), "before": other}


def inputs(layout: HeadLayout, batch: int, context: int, pool_slots: int, seed: int):
    """A query, the pools, and each row's slots: `context` tokens on random pages, padded to
    a multiple of the kernel's parts."""
    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, layout.dtype.removeprefix("torch."))
    shape = (pool_slots, layout.num_kv_heads, layout.head_dim)
    k_pool = torch.randn(shape, generator=gen).to(dtype)
    v_pool = torch.randn(shape, generator=gen).to(dtype)
    query = torch.randn(batch, layout.num_heads, layout.head_dim, generator=gen).to(dtype)
    chunks = kernel_chunks()
    width = -(-context // chunks) * chunks
    pages_each = -(-width // PAGE)
    pages = torch.randperm(pool_slots // PAGE, generator=gen)[: batch * pages_each]
    slots = (pages.view(batch, pages_each, 1) * PAGE + torch.arange(PAGE)).view(batch, -1)
    lens = torch.full((batch,), context, dtype=torch.int64)
    return query, k_pool, v_pool, slots[:, :width].contiguous(), lens


def time_point(kernels: dict, args_: tuple, rounds: int, calls: int) -> dict[str, float]:
    """Median us per call of each kernel over `rounds` alternating rounds of `calls` calls."""
    times: dict[str, list[float]] = {name: [] for name in kernels}
    for _ in range(rounds):
        for name, kernel in kernels.items():
            kernel(*args_)
            started = time.perf_counter()
            for _ in range(calls):
                kernel(*args_)
            times[name].append((time.perf_counter() - started) / calls * 1e6)
    return {name: median(ts) for name, ts in times.items()}


def engine_step_ms(
    loaded, kernels: dict, scale: float, batch: int, context: int, rounds: int, steps: int
) -> dict[str, float]:
    """Median ms per decode step of the compiled engine with each kernel installed."""
    tokens = rounds * len(kernels) * (steps + 1) + 8
    eng = compiled_engine(
        loaded, max_running=batch, num_slots=batch * (context + tokens + 16) + 256, prefill=2048
    )
    backend = eng.runner.backend
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    for b in range(batch):
        eng.submit([100 + (b * 7 + i) % 9000 for i in range(context)], params)
    installed = {
        name: DecodeKernel(kernel, kernel_chunks(), scale) for name, kernel in kernels.items()
    }
    variants = {
        name: (lambda k=k: setattr(backend, "decode_kernel", k)) for name, k in installed.items()
    }
    ms = alternate_decode_steps(eng, variants, rounds, steps)
    eng.close()
    return ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--points", nargs="+", default=["1x300", "1x2000", "4x1000", "8x300", "8x2000"])
    ap.add_argument("--engine-points", nargs="*", default=[])
    ap.add_argument("--engine-rounds", type=int, default=4)
    ap.add_argument("--engine-steps", type=int, default=8)
    ap.add_argument("--model", choices=sorted(HEAD_LAYOUTS), default="default")
    ap.add_argument("--heads", type=int, help="default: --model's")
    ap.add_argument("--kv-heads", type=int, help="default: --model's")
    ap.add_argument("--head-dim", type=int, help="default: --model's")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--pool-slots", type=int, default=65536)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--against", choices=sorted(AGAINST), default="broadcast")
    args = ap.parse_args()
    if args.engine_points and args.against == "page_transposed":
        ap.error("page_transposed is timed alone: the engine's pool is not stored that way")
    setup_threads(args.threads)
    model_heads = HEAD_LAYOUTS[args.model]
    heads, kv_heads, head_dim = (
        given or default
        for given, default in zip(
            (args.heads, args.kv_heads, args.head_dim), model_heads, strict=True
        )
    )
    layout = HeadLayout(heads, kv_heads, head_dim, f"torch.{args.dtype}", head_dim**-0.5)
    summary = {
        "benchmark": "decode_attention",
        "machine": machine(),
        "dtype": args.dtype,
        "model": args.model,
        "layout": [heads, kv_heads, head_dim],
        "against": args.against,
    }
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        kernels = build_both(layout, Path(tmp), args.against)
        header = ("batch x context", "now us", f"{args.against} us", "speedup", "max diff")
        print("{:>16} {:>8} {:>10} {:>8} {:>9}".format(*header))
        for i, point in enumerate(args.points):
            batch, context = (int(x) for x in point.split("x"))
            args_ = inputs(layout, batch, context, args.pool_slots, seed=i)
            diff = (kernels["now"](*args_).float() - kernels["before"](*args_).float()).abs()
            us = time_point(kernels, args_, args.rounds, args.calls)
            ratio = us["before"] / us["now"]
            print(
                f"{point:>16} {us['now']:>8.0f} {us['before']:>10.0f} {ratio:>7.2f}x "
                f"{diff.max().item():>9.1e}",
                flush=True,
            )
            summary[f"us_now_{point}"] = round(us["now"], 1)
            summary[f"us_before_{point}"] = round(us["before"], 1)
            summary[f"speedup_{point}"] = round(ratio, 3)
            summary[f"max_diff_{point}"] = diff.max().item()
        if args.engine_points:
            loaded = load(args.model, getattr(torch, args.dtype))
            other = f"{args.against} ms"
            print(f"{'engine B x L':>16} {'now ms':>8} {other:>10} {'speedup':>8}")
        for point in args.engine_points:
            batch, context = (int(x) for x in point.split("x"))
            ms = engine_step_ms(
                loaded, kernels, layout.scale, batch, context, args.engine_rounds, args.engine_steps
            )
            ratio = ms["before"] / ms["now"]
            print(f"{point:>16} {ms['now']:>8.1f} {ms['before']:>10.1f} {ratio:>7.2f}x", flush=True)
            summary[f"step_ms_now_{point}"] = round(ms["now"], 2)
            summary[f"step_ms_before_{point}"] = round(ms["before"], 2)
            summary[f"step_speedup_{point}"] = round(ratio, 3)
    emit(summary)


if __name__ == "__main__":
    main()
