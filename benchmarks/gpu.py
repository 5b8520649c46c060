"""The replica engine on a GPU against transformers' own `generate`, in one run.

A random-weight Llama built from a config (default ~1.2B: hidden 2048, 16 layers, 32 heads, 8 KV
heads, intermediate 8192, vocab 128256, bf16; nothing downloaded), prompt 512 / output 128 with
EOS ignored, at each concurrency c: decode tokens/s of
  - our engine: torch and FlashInfer attention, CUDA graphs on and off (continuous batching, c
    requests in flight; the median decode-only step),
  - HF `generate` eager (sdpa) and HF `generate(cache_implementation="static")` (compiled),
    as (time for `output` tokens - time for 1 token) / (output - 1) per step, batch c.
With `--compile` (default `both`): the engine again over the compiled forward
(`engine.compile: true`: on CUDA torch.compile of the unmodified model, our attention an
opaque op, captured in the graphs; on CPU an AOTInductor package; the first compiled
engine's time, compiling included, is printed), so
`compile_speedup_<c>` compares graphs over the compiled forward with graphs over the eager
model, same backend, same run.
At c = 32 (or the largest c below it): the step-time split (schedule, batch building, forward,
sampling; with a device sync after the forward, in a separate run) and the GPU-busy share
(kernel time / step time, from torch.profiler); at the largest c the split again
(`step_split_ms_top`) and, with `--log-dir`, its host profile. Roofline: weight bytes /
measured device copy bandwidth (read + write counted) bounds a decode step from below.
Sessions: TTFT of a turn with `--held` tokens already held vs the same request stateless
(radix off). Overlap scheduling
(`engine.overlap_schedule`): the best configuration at each c again with overlap on
(`overlap_ms`, the median, and `overlap_mean_ms`, the mean step: a call to step() may leave
the forward thread's launch to the next, so a median can miss what the round cost; the mean is
what `overlap_speedup_<c>` and `ms_per_step_<c>` take; `--no-overlap` skips it), and inline
(`overlap_inline_ms`, `overlap_inline_mean_ms`: the engine thread launches each step itself,
no forward thread, the CUDA default); the overlapped engines' GPU-busy share at the middle c
(`gpu_busy_frac_32_overlap`, `gpu_busy_frac_32_inline`) and where their steps make the host
wait for the device (`syncs_per_step_32`, by calling line: torch's sync debug mode). The host's
Python speed is probed before each overlapped reading (`host_probe_ms`). `--verify-cost`:
speculative verify forwards (4 drafts a row, a random head, graphed where graphs are on)
against decode forwards in the best configuration of the middle c (`verify_cost_ratio_<c>`),
whole speculative steps (the head's chain and catch-up too) against plain decode steps
(`spec_step_ratio_<c>`), and where a speculative step waits for the device
(`verify_cost[c]["syncs_per_step"]`).
`--jit-freezing`: the compiled forward with inductor's freezing (merged q/k/v and gate/up GEMMs
on CUDA).
With `--log-dir`: profiler tables, a cProfile of the host over decode steps at the middle c
(without overlap, on a forward thread and inline), and with `--trace-steps N` a timeline of N
overlapped steps.
`--switch-intervals`: the overlapped engine at the middle and the largest c under each order
(landing the last step first, waiting for the next one's launch first: `Engine.await_launch`,
or inline) and GIL switch interval, alternating, every reading kept.

    python -m benchmarks.gpu                       # an H100: the issue's figures
    python -m benchmarks.gpu --concurrency 1 32 64 --backends flashinfer --graph-modes on \
        --hf-static-concurrency 32                 # the short run: graphs, compiled or not
    python -m benchmarks.gpu --tiny --device cpu   # a smoke run of the script itself on CPU

Last line: one JSON object (ratios vs the baselines measured in the same run).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import logging
import os
import pstats
import statistics
import sys
import time
import warnings
from collections import Counter
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks.common import emit, machine
from sessionserve.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpecConfig,
)
from sessionserve.replicas import compiled_forward
from sessionserve.replicas import model_runner as runner_module
from sessionserve.replicas.attention import flashinfer_unsupported
from sessionserve.replicas.cuda_graphs import bucket_for
from sessionserve.replicas.engine import Engine
from sessionserve.replicas.loader import LoadedModel
from sessionserve.replicas.sampling import DeviceSample
from sessionserve.wire import SamplingParams

SHAPES = {
    "1.2b": {
        "hidden": 2048,
        "layers": 16,
        "heads": 32,
        "kv_heads": 8,
        "intermediate": 8192,
        "vocab": 128256,
    },
    "tiny": {
        "hidden": 256,
        "layers": 2,
        "heads": 4,
        "kv_heads": 2,
        "intermediate": 512,
        "vocab": 1024,
    },
}


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model (smoke run)")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--output", type=int, default=128)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--backends", nargs="+", default=["torch", "flashinfer"])
    ap.add_argument("--skip-hf-static", action="store_true", help="no compiled HF baseline")
    ap.add_argument("--skip-hf", action="store_true", help="no transformers baselines at all")
    ap.add_argument(
        "--hf-static-concurrency",
        type=int,
        nargs="+",
        default=None,
        help="measure HF static+compile only at these c (each c compiles again; default: all)",
    )
    ap.add_argument(
        "--graph-modes",
        nargs="+",
        choices=["off", "on"],
        default=None,
        help="CUDA graphs off and/or on (default: both on CUDA, off elsewhere)",
    )
    ap.add_argument(
        "--compile",
        choices=["off", "on", "both"],
        default="both",
        help="measure the engine over the compiled forward (with graphs where they are on)",
    )
    ap.add_argument("--compile-cache-dir", default=None, help="where the package is kept")
    ap.add_argument(
        "--jit-freezing",
        action="store_true",
        help="CUDA's compiled forward with inductor's freezing (merged q/k/v and gate/up GEMMs:"
        " compiled_forward.JIT_OPTIONS); compare with a run without",
    )
    ap.add_argument("--held", type=int, default=8000, help="session history for the TTFT test")
    ap.add_argument("--no-overlap", action="store_true", help="skip the overlap-scheduling runs")
    ap.add_argument(
        "--verify-cost",
        action="store_true",
        help="also time speculative verify forwards (4 drafts a row) against decode forwards",
    )
    ap.add_argument(
        "--switch-intervals",
        type=float,
        nargs="*",
        default=None,
        help="also time the overlapped engine at the middle and the largest c in each order "
        "(landing the last step first; waiting for the next one's launch first, "
        "Engine.await_launch; inline, engine.overlap_schedule: inline) under Python's switch "
        "interval (0.005 s) and each of these (sys.setswitchinterval; none given: the orders "
        "only), alternating: how soon a thread gets the GIL back after each torch call",
    )
    ap.add_argument(
        "--fast-plan",
        action="store_true",
        help="also time the decode steps at the middle and the largest c with FlashInfer's "
        "plan() and with fast_decode_plan (FlashInferBackend.fast_plan, the default), "
        "alternating, overlapped inline (fast_plan_ms: mean ms a step)",
    )
    ap.add_argument(
        "--pin-threads",
        action="store_true",
        help="also time the overlapped engine at the middle c with its two threads (engine, "
        "forward) pinned to two physical cores, to two hyperthreads of one core (with SMT), "
        "and unpinned, alternating: does the OS's placement of the threads pick the step's "
        "mode (bimodal at 32 in runs J, K)?",
    )
    ap.add_argument(
        "--trace-steps",
        type=int,
        default=0,
        help="with --log-dir: a torch.profiler timeline of this many overlapped decode steps "
        "at the middle and the largest c, in both orders (trace_overlap_c<c>.json.gz, "
        "trace_overlap_await_c<c>.json.gz; host threads with Python stacks), each read for "
        "the forward thread's GIL stalls (benchmarks/trace_stalls.py, run where they land)",
    )
    ap.add_argument("--profile-steps", type=int, default=20)
    ap.add_argument("--log-dir", default=None, help="write the profiler tables here")
    return ap.parse_args()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_model(args: argparse.Namespace, device: torch.device, dtype: torch.dtype):
    s = SHAPES["tiny" if args.tiny else "1.2b"]
    cfg = LlamaConfig(
        hidden_size=s["hidden"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"],
        intermediate_size=s["intermediate"],
        vocab_size=s["vocab"],
        max_position_embeddings=16384,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype).eval()
    model.generation_config.pad_token_id = 0
    return model


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Bytes per second of a device-to-device copy, read + write counted."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    t = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    sync(device)
    return 10 * 2 * src.numel() / (time.perf_counter() - t)


def prompts(c: int, n: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(100, vocab, (c, n), generator=torch.Generator().manual_seed(seed))


# ---- transformers baselines ----
def hf_step_ms(model, c: int, args: argparse.Namespace, static: bool) -> float:
    dev = model.device
    ids = prompts(c, args.prompt, model.config.vocab_size).to(dev)
    kw: dict[str, Any] = {"do_sample": False, "attention_mask": torch.ones_like(ids)}
    if static:
        kw["cache_implementation"] = "static"

    def timed(n: int) -> float:
        sync(dev)
        t = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        sync(dev)
        return time.perf_counter() - t

    timed(args.output)  # warm-up (compiles the static path)
    full = statistics.median(timed(args.output) for _ in range(2))
    one = statistics.median(timed(1) for _ in range(2))
    return 1000 * (full - one) / (args.output - 1)


# ---- our engine ----
def make_engine(
    model,
    backend: str,
    graphs: bool,
    c: int,
    args,
    sessions: bool = True,
    extend: bool = True,
    overlap: bool | str = False,  # or "inline"
    compiled: bool = False,
    drafter: Any = None,
):
    held = args.held + 256
    slots = max(c * (args.prompt + args.output) * 2, 2 * held + 4096)
    cfg = EngineConfig(
        model=ModelConfig(device=str(model.device)),
        cache=CacheConfig(
            page_size=16,
            num_slots=slots,
            max_rows=c + 8,
            max_context_len=max(held + 64, args.prompt + args.output),
            radix_cache=sessions,
        ),
        scheduler=SchedulerConfig(max_running_requests=c, max_prefill_tokens=8192),
        attention_backend=backend,
        cuda_graphs=graphs,
        cuda_graph_max_extend=256 if extend else 0,
        overlap_schedule=overlap,
        compile=compiled,
        compile_cache_dir=args.compile_cache_dir,
        spec=SpecConfig(num_drafts=VERIFY_DRAFTS, adaptive=False),
    )
    loaded = LoadedModel(model, None, "random-llama", "benchmarks.gpu")
    eng = Engine(cfg, loaded, drafter=drafter)
    if compiled and eng.runner.compiled is None:
        raise RuntimeError("the compiled forward did not install (the log above says why)")
    return eng


Config = tuple[str, bool, bool]  # attention backend, CUDA graphs, compiled forward


def label(config: Config) -> str:
    b, g, k = config
    return f"{b}{'+graphs' if g else ''}{'+compile' if k else ''}"


def submit_round(eng: Engine, c: int, args, seed: int) -> None:
    p = SamplingParams(max_tokens=args.output, temperature=0, ignore_eos=True)
    for row in prompts(c, args.prompt, eng.vocab_size, seed).tolist():
        eng.submit(row, p)


def decode_only(eng: Engine) -> bool:
    s = eng.scheduler
    return not s.waiting and bool(s.running) and all(r.sampled for r in s.running)


def decode_steps(eng: Engine, limit: int) -> int:
    """Step while the engine only decodes, at most `limit` steps; how many ran."""
    n = 0
    while n < limit and decode_only(eng):
        eng.step()
        n += 1
    return n


def profiler_activities(eng: Engine) -> list:
    """torch.profiler's activities for `eng`'s device: the host, and the GPU where there is one."""
    from torch.profiler import ProfilerActivity

    activities = [ProfilerActivity.CPU]
    if eng.runner.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    return activities


def engine_step_ms(eng: Engine, c: int, args, steps_ms: list[float] | None = None) -> float:
    """Median wall time of the decode-only steps of one round (after a warm-up round that
    captures the graphs). A step ends on the host copy of the sampled ids, so it is synced.
    `steps_ms`: gets every measured step's time."""
    for seed in (1, 2):
        submit_round(eng, c, args, seed)
        times = []
        while eng.has_work():
            pure = decode_only(eng)
            t = time.perf_counter()
            eng.step()
            if pure:
                times.append(time.perf_counter() - t)
    if steps_ms is not None:
        steps_ms.extend(1000 * t for t in times)
    return 1000 * statistics.median(times)


def host_probe_ms() -> float:
    """ms this process's Python takes to sum range(10**6) (best of three): a host-bound step
    scales with it, and a run's host can slow down partway (runs S and T, docs/benchmarks.md),
    so each overlapped reading carries the probe taken just before it (`host_probe_ms`)."""
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        sum(range(10**6))
        best = min(best, time.perf_counter() - t)
    return round(1000 * best, 2)


def quantiles_ms(steps_ms: list[float]) -> list[float]:
    """p10, p50, p90 of step times (a bimodal step shows as a wide spread)."""
    q = statistics.quantiles(steps_ms, n=10)
    return [round(q[0], 3), round(statistics.median(steps_ms), 3), round(q[-1], 3)]


def cpu_pairs() -> dict[str, tuple[int, int]]:
    """Two CPUs this process may use on two physical cores, and two hyperthreads of one core
    where the machine has SMT (from sysfs; the last cores, away from CPU 0's interrupts)."""
    by_core: dict[tuple[str, str], list[int]] = {}
    for cpu in sorted(os.sched_getaffinity(0)):
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            key = ((topo / "physical_package_id").read_text(), (topo / "core_id").read_text())
        except OSError:
            key = ("?", str(cpu))
        by_core.setdefault(key, []).append(cpu)
    cores = list(by_core.values())
    pairs: dict[str, tuple[int, int]] = {}
    if len(cores) >= 2:
        pairs["two_cores"] = (cores[-2][0], cores[-1][0])
    smt = [c for c in cores if len(c) >= 2]
    if smt:
        pairs["one_core_two_hyperthreads"] = (smt[-1][0], smt[-1][1])
    return pairs


def pin_threads(eng: Engine, cpus: tuple[int, int] | None, allowed: set[int]) -> None:
    """The engine thread (this one) on cpus[0] and the forward thread on cpus[1]; None: both
    back on `allowed`."""
    assert eng.forwards is not None
    mine, theirs = ({cpus[0]}, {cpus[1]}) if cpus else (allowed, allowed)
    os.sched_setaffinity(0, mine)  # (0: the calling thread)
    eng.forwards.call(os.sched_setaffinity, 0, theirs)


def trace_steps(eng: Engine, c: int, args, name: str) -> None:
    """With `--log-dir` and `--trace-steps N`: a torch.profiler timeline (host threads with
    Python stacks, and the GPU's kernels) of N decode steps, `trace_<name>.json.gz`, for
    chrome://tracing or Perfetto: where a step waits, on which thread. Read overlapped ones
    with `benchmarks/trace_stalls.py` where they land (it takes seconds a trace: not on the
    lent GPU's clock)."""
    if not args.log_dir or not args.trace_steps:
        return
    import gzip
    import shutil

    from torch.profiler import profile

    steady_decode(eng, c, args, 5)
    with profile(activities=profiler_activities(eng), with_stack=True) as prof:
        decode_steps(eng, args.trace_steps)
        sync(eng.runner.device)
    eng.run_until_idle()
    raw = f"{args.log_dir}/trace_{name}.json"
    prof.export_chrome_trace(raw)
    with open(raw, "rb") as src, gzip.open(f"{raw}.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.remove(raw)


@contextmanager
def timed_parts(eng: Engine, device: torch.device, speculative: bool = False):
    """Accumulate the time of each part of a step (the forward synced so its GPU time counts
    as forward, not as sampling); `speculative`: also the speculative decoder's parts, each
    synced (drafting, the acceptance test, the head's catch-up)."""
    parts = {"schedule": 0.0, "batch": 0.0, "forward": 0.0, "sample": 0.0}
    if speculative:
        parts |= {"propose": 0.0, "verify": 0.0, "catch_up": 0.0}
    saved = []

    def wrap(obj: Any, name: str, part: str, synced: bool = False) -> None:
        inner: Callable = getattr(obj, name)
        saved.append((obj, name, inner))

        def timed(*a, **kw):
            t = time.perf_counter()
            out = inner(*a, **kw)
            if synced:
                sync(device)
            parts[part] += time.perf_counter() - t
            return out

        setattr(obj, name, timed)

    wrap(eng.scheduler, "schedule", "schedule")
    wrap(eng.runner, "prepare", "batch")
    wrap(eng.runner, "forward", "forward", synced=True)
    wrap(runner_module, "sample_on_device", "sample")  # its kernels queued
    wrap(DeviceSample, "to_host", "sample")  # the tokens read back
    if speculative:
        for name in ("propose", "verify", "catch_up"):
            wrap(eng.speculative, name, name, synced=True)
    try:
        yield parts
    finally:
        for obj, name, inner in reversed(saved):
            if obj is runner_module or isinstance(obj, type):
                setattr(obj, name, inner)
            else:
                delattr(obj, name)  # back to the class attribute


def steady_decode(eng: Engine, c: int, args, seed: int, warm_steps: int = 3) -> None:
    """Submit a round and step past its prefills and first decodes (which capture graphs), so
    what is measured next are ordinary decode steps."""
    submit_round(eng, c, args, seed)
    while eng.has_work() and not decode_only(eng):
        eng.step()
    for _ in range(warm_steps):
        eng.step()
    sync(eng.runner.device)


def step_split(eng: Engine, c: int, args, speculative: bool = False) -> dict[str, float]:
    """ms per decode step of each part, and the rest (bookkeeping, stops, events)."""
    steady_decode(eng, c, args, 3)
    n, total = 0, 0.0
    with timed_parts(eng, eng.runner.device, speculative) as parts:
        while decode_only(eng) and n < 50:
            t = time.perf_counter()
            eng.step()
            total += time.perf_counter() - t
            n += 1
    eng.run_until_idle()
    split = {k: 1000 * v / n for k, v in parts.items()}
    split["other"] = 1000 * total / n - sum(split.values())
    return split


VERIFY_DRAFTS = 4  # `--verify-cost`: drafts per row, a chain (verifies of 5 tokens a row)


def forward_ms(eng: Engine, c: int, args, verifying: bool) -> tuple[float, float]:
    """`engine_step_ms` (whole decode steps: drafting, verifying and the head's catch-up
    included), and the median device time of the target forwards (synced around each) of
    verify steps (rows with drafts) when `verifying`, else of plain decodes, over both of its
    rounds (the few that capture a graph are outliers the median leaves out)."""
    runner, forwards = eng.runner, []
    inner = runner.forward

    def timed(batch):
        sync(runner.device)
        t = time.perf_counter()
        out = inner(batch)
        sync(runner.device)
        drafts = len(batch.input_ids) > len(batch.seqs)
        if drafts == verifying and len(batch.logit_idx) == len(batch.input_ids):
            forwards.append(time.perf_counter() - t)
        return out

    runner.forward = timed
    try:
        step = engine_step_ms(eng, c, args)
    finally:
        del runner.forward
    return 1000 * statistics.median(forwards), step


def verify_costs(model, config: Config, args) -> dict[int, dict[str, float]]:
    """What a verify of VERIFY_DRAFTS drafts a row costs against a plain decode, per c, in the
    best configuration: target forwards only (the head's own steps are eager and not counted;
    a random head, so its drafts are rejected and every step verifies). With the acceptance
    a real head reaches (measured on a CPU, docs/benchmarks.md), this bounds what speculation
    can gain here: speedup ~ accepted tokens per verify / verify cost ratio."""
    from sessionserve.replicas.speculative.drafter import EagleDrafter, drafter_config

    out = {}
    b, g, k = config
    param = next(model.parameters())
    for c in args.concurrency:
        head = EagleDrafter(drafter_config(model.config)).to(param.device, param.dtype)
        spec = make_engine(model, b, g, c, args, compiled=k, drafter=head.eval().attach(model))
        plain = make_engine(model, b, g, c, args, compiled=k)
        (verify, spec_step), (decode, step) = (
            forward_ms(spec, c, args, True),
            forward_ms(plain, c, args, False),
        )
        split = {k: round(v, 3) for k, v in step_split(spec, c, args, speculative=True).items()}
        profile_spec_steps(spec, c, args)
        syncs = sync_sites(spec, c, args, f"spec_c{c}")
        graphs = spec.runner.verify_graphs
        chain = spec.speculative.eagle.chain_graphs
        catch_ups = spec.speculative.eagle.catch_up_graphs
        out[c] = {
            "verify_ms": round(verify, 3),
            "decode_ms": round(decode, 3),
            "ratio": round(verify / decode, 3),
            "spec_step_ms": round(spec_step, 3),
            "step_ms": round(step, 3),
            "step_ratio": round(spec_step / step, 3),
            "verify_graph_replays": graphs.replays if graphs is not None else 0,
            "chain_graph_replays": chain.replays if chain is not None else 0,
            "catch_up_graph_replays": catch_ups.replays if catch_ups is not None else 0,
            "spec_step_split_ms": split,
            "syncs_per_step": syncs,
        }
        print(
            f"c={c:3d} {label(config)}: verify of {VERIFY_DRAFTS} drafts a row {verify:.2f} ms, "
            f"decode {decode:.2f} ms (forwards only): {verify / decode:.2f}x; whole steps "
            f"(drafting and the head's catch-up too) {spec_step:.2f} vs {step:.2f} ms: "
            f"{spec_step / step:.2f}x",
            flush=True,
        )
        print(
            f"c={c:3d} speculative step split (ms) "
            + ", ".join(f"{k} {v:.2f}" for k, v in split.items()),
            flush=True,
        )
        spec.close()
        plain.close()
    return out


def sync_sites(eng: Engine, c: int, args, name: str) -> dict[str, float] | None:
    """Where decode steps make the host wait for the device (CUDA only): torch's sync debug
    mode warns at each synchronizing torch operation (a read back, a copy from pageable
    memory), and each warning names the Python line that called it. Per step, by site, to
    `syncs_<name>.txt` in `--log-dir`; `total` is all of them. Event waits (landing a step)
    are not such operations. A diagnostic: a failure is printed, not raised."""
    if eng.runner.device.type != "cuda":
        return None
    try:
        steady_decode(eng, c, args, 3)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                n = decode_steps(eng, args.profile_steps)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        eng.run_until_idle()
    except Exception as e:  # noqa: BLE001 (a diagnostic must not end the run)
        print(f"c={c:3d} sync sites ({name}): failed, {e!r}", flush=True)
        return None
    found = Counter(
        f"{Path(w.filename).name}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)
    )
    per_step = {site: round(k / max(n, 1), 2) for site, k in found.most_common()}
    per_step["total"] = round(sum(found.values()) / max(n, 1), 2)
    if args.log_dir:
        with open(f"{args.log_dir}/syncs_{name}.txt", "w") as f:
            f.write(f"{n} decode steps at c={c}; synchronizing torch calls a step, by site\n")
            f.writelines(f"{v:8.2f}  {site}\n" for site, v in per_step.items())
    print(f"c={c:3d} sync sites ({name}): {per_step['total']} a step, {per_step}", flush=True)
    return per_step


def profile_spec_steps(eng: Engine, c: int, args) -> None:
    """With `--log-dir`: torch.profiler tables (device time, then host time) of speculative
    decode steps, to read where a step that drafts spends what a plain one does not."""
    if not args.log_dir:
        return
    from torch.profiler import profile

    steady_decode(eng, c, args, 3)
    with profile(activities=profiler_activities(eng)) as prof:
        t = time.perf_counter()
        n = decode_steps(eng, args.profile_steps)
        sync(eng.runner.device)
        wall = time.perf_counter() - t
    eng.run_until_idle()
    averages = prof.key_averages()
    with open(f"{args.log_dir}/profile_spec_c{c}.txt", "w") as f:
        f.write(f"{n} speculative decode steps, wall {1000 * wall:.1f} ms\n")
        if eng.runner.device.type == "cuda":
            f.write(averages.table(sort_by="self_device_time_total", row_limit=30) + "\n")
        f.write(averages.table(sort_by="self_cpu_time_total", row_limit=40) + "\n")


def host_profile(eng: Engine, c: int, args, name: str) -> None:
    """With `--log-dir`: cProfile of the engine thread over decode steps (what the host does
    each step, by function: a GPU step at 32 is host-bound), to `host_profile_<name>.txt`."""
    if not args.log_dir:
        return
    steady_decode(eng, c, args, 3)
    t = time.perf_counter()
    n, stats = cprofiled(lambda: decode_steps(eng, 50))
    wall = time.perf_counter() - t
    eng.run_until_idle()
    stats.sort_stats("tottime").print_stats(40)
    stats.sort_stats("cumulative").print_stats("sessionserve", 60)
    with open(f"{args.log_dir}/host_profile_{name}.txt", "w") as f:
        f.write(
            f"{n} decode steps at c={c}, wall {1000 * wall / max(n, 1):.2f} ms a step (profiled)\n"
        )
        f.write(stats.stream.getvalue())


def cprofiled(run: Callable[[], Any]) -> tuple[Any, pstats.Stats]:
    """`run()`'s result and its cProfile statistics, printing into their own text stream."""
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        result = run()
    finally:
        profiler.disable()
    return result, pstats.Stats(profiler, stream=io.StringIO())


def gpu_busy(eng: Engine, c: int, args, tag: str = "") -> tuple[float | None, float | None]:
    """GPU-busy share of a decode step at concurrency `c`, two ways (CUDA only):
    - replay: the GPU time of the step's decode graph replayed back to back (no host work in
      between; CUDA events) over the wall time of a real step (the median; under overlap the
      mean, as a step() call may leave work to the next): what share of a step the GPU
      computes. Needs graphs.
    - profiler: kernel time / wall time over decode steps (torch.profiler). Its table goes to
      `--log-dir` for reading; it may not see every kernel inside graph replays."""
    if eng.runner.device.type != "cuda":
        return None, None
    from torch.profiler import ProfilerActivity, profile

    steady_decode(eng, c, args, 4)
    walls = []
    for _ in range(args.profile_steps):
        t = time.perf_counter()
        eng.step()
        walls.append(time.perf_counter() - t)
    step_ms = 1000 * (statistics.mean if eng.forwards else statistics.median)(walls)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        n = decode_steps(eng, args.profile_steps)
        sync(eng.runner.device)
        wall = time.perf_counter() - t
    kernel_us = sum(e.self_device_time_total for e in prof.key_averages())
    if args.log_dir:
        table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=40)
        cpu = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
        with open(f"{args.log_dir}/profile_{tag}c{c}.txt", "w") as f:
            f.write(f"{n} decode steps, wall {1000 * wall:.1f} ms\n{table}\n{cpu}\n")
    replay = graph_replay_ms(eng, c)
    eng.run_until_idle()
    if replay is not None:
        print(f"c={c}: decode graph replay {replay:.2f} ms of GPU time, step {step_ms:.2f} ms")
    by_replay = None if replay is None else replay / step_ms
    return by_replay, kernel_us / 1e6 / wall


def graph_replay_ms(eng: Engine, c: int, reps: int = 50) -> float | None:
    """GPU time of one replay of the decode graph that serves `c` sequences (None without
    graphs). Its buffers still hold the last step's inputs: replays rewrite those KV slots with
    the same values."""
    graphs = eng.runner.graphs
    size = bucket_for(c, graphs.buckets) if graphs is not None else None
    found = [g for (b, _), g in graphs.graphs.items() if b == size and g.graph] if size else []
    if not found:
        return None
    graph = found[-1].graph
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def ttft(eng: Engine, ids: list[int], **kw: Any) -> float:
    sync(eng.runner.device)
    t = time.perf_counter()
    eng.generate([ids], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True), **kw)
    return time.perf_counter() - t


def session_ttft(model, backend: str, args) -> tuple[dict[str, float], dict[str, Any]]:
    """TTFT (s) of a 32-token turn after `args.held` held tokens: in a session (the median of
    three turns; each adds ~33 tokens to what it holds), with its extend replayed as a CUDA
    graph and eagerly, and the same whole request stateless (radix off). Also what explains
    it: every turn's ms and the extend graphs' replays over the timed turns (an H200 run read
    23.8 ms at 8k, the H100 runs ~7: was the graph used?), and with `--log-dir` a cProfile of
    one more graphed turn (`host_profile_session_turn.txt`)."""
    history = prompts(1, args.held, model.config.vocab_size, 5)[0].tolist()
    turn = prompts(1, 32, model.config.vocab_size, 6)[0].tolist()
    out: dict[str, float] = {}
    detail: dict[str, Any] = {}
    for name, extend in (("session", True), ("session_eager_extend", False)):
        eng = make_engine(model, backend, True, 4, args, sessions=True, extend=extend)
        ttft(eng, turn)  # warm-up
        sid = eng.open_session()
        first = eng.generate(
            [history], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True), session_id=sid
        )[0]
        graphs = eng.runner.extend_graphs
        before = graphs.replays if graphs is not None else 0
        turns = [ttft(eng, turn, session_id=sid) for _ in range(3)]
        out[name] = statistics.median(turns)
        detail[name] = {
            "turn_ms": [round(1000 * t, 2) for t in turns],
            "extend_graph_replays": None if graphs is None else graphs.replays - before,
            "extend_graphs": None if graphs is None else len(graphs.graphs),
        }
        if extend and args.log_dir:
            profile_turn(eng, turn, sid, f"{args.log_dir}/host_profile_session_turn.txt")
    full = history + first.output_ids + turn
    plain = make_engine(model, backend, True, 4, args, sessions=False)
    ttft(plain, turn)
    out["stateless"] = statistics.median(ttft(plain, full) for _ in range(2))
    return out, detail


def profile_turn(eng: Engine, turn: list[int], sid: str, path: str) -> None:
    """cProfile of one session turn (TTFT: max_tokens 1), by cumulative time, to `path`."""
    seconds, stats = cprofiled(lambda: ttft(eng, turn, session_id=sid))
    stats.sort_stats("cumulative").print_stats(50)
    stats.sort_stats("tottime").print_stats(25)
    with open(path, "w") as f:
        f.write(f"one session turn, {1000 * seconds:.2f} ms (profiled)\n{stats.stream.getvalue()}")


def main() -> None:
    args = parse()
    device = torch.device(args.device)
    dtype = (
        getattr(torch, args.dtype) if args.dtype else ModelConfig(device=args.device).torch_dtype()
    )
    if args.tiny:
        args.held = min(args.held, 1000)
    logging.basicConfig(format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("sessionserve.replicas.compiled_forward").setLevel(logging.INFO)
    if args.jit_freezing:
        compiled_forward.JIT_OPTIONS["freezing"] = True
    model = build_model(args, device, dtype)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bw = copy_bandwidth(device)
    roofline_ms = 1000 * weight_bytes / bw
    print(
        f"model {weight_bytes / 1e9:.2f} GB {dtype} on {device}; copy bandwidth "
        f"{bw / 1e12:.2f} TB/s -> roofline {roofline_ms:.3f} ms/step",
        flush=True,
    )
    backends = []
    for b in args.backends:
        why = flashinfer_unsupported(device, dtype, model.config.head_dim) if b != "torch" else None
        print(f"backend {b}: skipped, {why}" if why else f"backend {b}: measured", flush=True)
        backends += [] if why else [b]
    modes = args.graph_modes or (["off", "on"] if device.type == "cuda" else ["off"])
    graph_modes = [m == "on" for m in modes]
    if device.type != "cuda" and any(graph_modes):
        raise SystemExit("--graph-modes on needs CUDA")
    compile_modes = {"off": [False], "on": [True], "both": [False, True]}[args.compile]
    static_at = args.hf_static_concurrency or args.concurrency

    hf: dict[str, dict[int, float]] = {"eager": {}, "static": {}}
    for c in [] if args.skip_hf else args.concurrency:  # first: the engine re-wires attention
        model.set_attn_implementation("sdpa")
        hf["eager"][c] = hf_step_ms(model, c, args, static=False)
        if not args.skip_hf_static and c in static_at:
            hf["static"][c] = hf_step_ms(model, c, args, static=True)
        print(
            f"c={c:3d} HF eager {hf['eager'][c]:.2f} ms/step, static "
            f"{hf['static'].get(c, float('nan')):.2f} ms/step",
            flush=True,
        )

    probes = {"start": host_probe_ms()}  # host_probe_ms: the host's Python speed, by reading
    ours: dict[Config, dict[int, float]] = {}
    kept: dict[tuple[Config, int], Engine] = {}  # c_mid's engines, for the step split
    c_mid = max((c for c in args.concurrency if c <= 32), default=args.concurrency[0])
    build_s = None
    for backend in backends:
        for graphs in graph_modes:
            for compiled in compile_modes:
                ms = ours.setdefault((backend, graphs, compiled), {})
                for c in args.concurrency:
                    started = time.perf_counter()
                    eng = make_engine(model, backend, graphs, c, args, compiled=compiled)
                    ms[c] = engine_step_ms(eng, c, args)
                    if compiled and build_s is None:  # the first compiles (or builds) it
                        build_s = time.perf_counter() - started
                        print(
                            f"first compiled engine: built, compiled and ran two rounds in "
                            f"{build_s:.0f} s",
                            flush=True,
                        )
                    if c == c_mid:
                        kept[((backend, graphs, compiled), c)] = eng
                    else:
                        eng.close()
                    print(
                        f"c={c:3d} engine {label((backend, graphs, compiled)):26s} "
                        f"{ms[c]:.2f} ms/step ({c / ms[c] * 1000:.0f} tok/s)",
                        flush=True,
                    )

    def best(c: int) -> tuple[Config, float]:
        return min(((k, v[c]) for k, v in ours.items()), key=lambda kv: kv[1])

    def engine_for(config: Config, c: int, **kw: Any) -> Engine:
        b, g, k = config
        return make_engine(model, b, g, c, args, compiled=k, **kw)

    def compile_speedup(c: int) -> float | None:
        """The best configuration's backend and graphs: the eager model's step over the
        compiled forward's."""
        (b, g, _), _ = best(c)
        on, off = ours.get((b, g, True)), ours.get((b, g, False))
        return round(off[c] / on[c], 3) if on and off else None

    def overlapped_reading(c: int, mode: bool | str, tag: str) -> tuple[float, float]:
        """The best configuration at `c` again, overlapped (`mode`: engine.overlap_schedule):
        the median and the mean step (under overlap a call to step() may leave work to the
        next one, so a median can miss what a round costs: the mean does not), printed with
        the host probe taken before it; at c_mid also its GPU-busy share and host profile."""
        config, plain_ms = best(c)
        probes[f"{tag}_c{c}"] = host_probe_ms()
        eng = engine_for(config, c, overlap=mode)
        steps: list[float] = []
        median = engine_step_ms(eng, c, args, steps)
        mean = round(statistics.mean(steps), 3)
        if c == c_mid:
            busy[tag], _ = gpu_busy(eng, c, args, f"{tag}_")
            host_profile(eng, c, args, f"{tag}_c{c}")
            syncs[tag] = sync_sites(eng, c, args, f"{tag}_c{c}")
        eng.close()
        share = busy.get(tag) if c == c_mid else None
        print(
            f"c={c:3d} engine {label(config):26s} {tag} {median:.2f} ms/step median; mean "
            f"{mean:.2f} ({plain_ms / mean:.2f}x without)"
            + (f"; GPU busy {share:.0%}" if share else "")
            + f" (host probe {probes[f'{tag}_c{c}']} ms)",
            flush=True,
        )
        return median, mean

    # the best configuration again with overlap on a forward thread, then inline (no forward
    # thread, engine.overlap_schedule: inline); busy: at c_mid, what share of each the GPU
    # computes
    overlapped: dict[int, float] = {}
    overlapped_mean: dict[int, float] = {}
    inline: dict[int, float] = {}
    inline_mean: dict[int, float] = {}
    busy: dict[str, float | None] = {}
    syncs: dict[str, dict[str, float] | None] = {}  # at c_mid: where a step waits (sync_sites)
    for c in [] if args.no_overlap else args.concurrency:
        overlapped[c], overlapped_mean[c] = overlapped_reading(c, True, "overlap")
        inline[c], inline_mean[c] = overlapped_reading(c, "inline", "inline")
    busy_overlap, busy_inline = busy.get("overlap"), busy.get("inline")

    # overlapped ms a step at c_mid and c_top, each reading: order x switch interval (the
    # order: land the last step first, wait for the next one's launch first, or inline)
    c_top = max(args.concurrency)
    variants: dict[str, list[float]] = {}
    variant_quantiles: dict[str, list[list[float]]] = {}  # each reading's p10 / p50 / p90
    variant_means: dict[str, list[float]] = {}
    for c in [] if args.switch_intervals is None or args.no_overlap else sorted({c_mid, c_top}):
        default = sys.getswitchinterval()
        engines = {
            "thread": engine_for(best(c)[0], c, overlap=True),
            "inline": engine_for(best(c)[0], c, overlap="inline"),
        }
        intervals = sorted({default, *args.switch_intervals})
        orders = [("land_first", "thread", False), ("await_launch", "thread", True)]
        orders.append(("inline", "inline", False))
        grid = [(o, i) for o in orders for i in intervals]
        for (order, kind, await_launch), interval in [*grid, *grid]:  # twice: drift shows
            eng = engines[kind]
            eng.await_launch = await_launch
            sys.setswitchinterval(interval)
            steps: list[float] = []
            ms = engine_step_ms(eng, c, args, steps)
            key = f"c={c},order={order},switch_interval={interval:g}"
            spread = quantiles_ms(steps)
            variants.setdefault(key, []).append(round(ms, 3))
            variant_quantiles.setdefault(key, []).append(spread)
            variant_means.setdefault(key, []).append(mean := round(statistics.mean(steps), 3))
            print(
                f"overlap, {key}: {ms:.2f} ms/step (p10 / p50 / p90 {spread}, mean {mean})",
                flush=True,
            )
        sys.setswitchinterval(default)
        for eng in engines.values():
            eng.close()
    # FlashInfer's decode plan: plan() against fast_decode_plan over buffers we fill, on one
    # engine overlapped inline (the CUDA default: where the plan's host work is the step's;
    # without overlap, run S: 2-4%), alternating, three readings each
    fast_plan: dict[int, dict[str, list[float]]] = {}
    for c in sorted({c_mid, c_top}) if args.fast_plan else []:
        probes[f"fast_plan_c{c}"] = host_probe_ms()
        eng = engine_for(best(c)[0], c, overlap="inline")
        if eng.runner.backend.name != "flashinfer":
            eng.close()
            continue
        eng.runner.backend.fast_plan = True  # its graphs' buffers laid out for it when built
        engine_step_ms(eng, c, args)
        for _ in range(3):
            for fast in (False, True):
                eng.runner.backend.fast_plan = fast
                steps: list[float] = []
                engine_step_ms(eng, c, args, steps)
                mean = round(statistics.mean(steps), 3)
                name = "fast" if fast else "plan"
                fast_plan.setdefault(c, {}).setdefault(name, []).append(mean)
                print(f"c={c:3d} decode plan {name}: {mean:.3f} ms/step (mean)", flush=True)
        eng.close()
    pinning: dict[str, list[float]] = {}
    pinning_quantiles: dict[str, list[list[float]]] = {}
    if args.pin_threads and not args.no_overlap:
        allowed, pairs = set(os.sched_getaffinity(0)), cpu_pairs()
        print(f"thread pinning: CPU pairs {pairs}", flush=True)
        eng = engine_for(best(c_mid)[0], c_mid, overlap=True)
        for _ in range(3):  # alternating, so drift shows as a spread, not a difference
            for name, cpus in [("unpinned", None), *pairs.items()]:
                pin_threads(eng, cpus, allowed)
                steps = []
                ms = engine_step_ms(eng, c_mid, args, steps)
                spread = quantiles_ms(steps)
                pinning.setdefault(name, []).append(round(ms, 3))
                pinning_quantiles.setdefault(name, []).append(spread)
                print(
                    f"c={c_mid:3d} overlap, threads {name} {cpus or ''}: {ms:.2f} ms/step "
                    f"(p10 / p50 / p90 {spread})",
                    flush=True,
                )
        pin_threads(eng, None, allowed)
        eng.close()
    for c in [] if not args.trace_steps or args.no_overlap else sorted({c_mid, c_top}):
        eng = engine_for(best(c)[0], c, overlap=True)
        for await_launch, name in [(False, f"overlap_c{c}"), (True, f"overlap_await_c{c}")]:
            eng.await_launch = await_launch
            trace_steps(eng, c, args, name)
        eng.close()

    verify = verify_costs(model, best(c_mid)[0], args) if args.verify_cost else {}
    mid, _ = best(c_mid)
    probes["step_split"] = host_probe_ms()
    split = step_split(kept[(mid, c_mid)], c_mid, args)  # idle after its rounds
    busy, busy_profiler = gpu_busy(kept[(mid, c_mid)], c_mid, args)
    host_profile(kept[(mid, c_mid)], c_mid, args, f"c{c_mid}")
    for eng in kept.values():
        eng.close()
    print(
        f"c={c_mid} {label(mid)}: step split (ms) "
        + ", ".join(f"{k} {v:.2f}" for k, v in split.items())
        + (f"; GPU busy {busy:.0%} (graph replay time / step)" if busy is not None else "")
        + (f", {busy_profiler:.0%} (profiler kernels)" if busy_profiler is not None else ""),
        flush=True,
    )
    # the largest c's split and host profile too: where a host-bound step's time goes
    split_top: dict[str, float] = {}
    if c_top != c_mid:
        eng = engine_for(best(c_top)[0], c_top)
        split_top = step_split(eng, c_top, args)
        host_profile(eng, c_top, args, f"c{c_top}")
        eng.close()
        print(
            f"c={c_top} step split (ms) " + ", ".join(f"{k} {v:.2f}" for k, v in split_top.items()),
            flush=True,
        )
    # eager extends / graphs, not compiled
    t, turns = session_ttft(model, best(min(args.concurrency))[0][0], args)
    print(
        f"TTFT with {args.held} tokens held: session {1000 * t['session']:.1f} ms (eager "
        f"extend {1000 * t['session_eager_extend']:.1f} ms), stateless "
        f"{1000 * t['stateless']:.1f} ms; turns {turns}",
        flush=True,
    )

    def best_ms(c: int) -> float:
        """The best configuration's step at c, overlap included: an overlapped step by its
        mean (its calls are bimodal: a median can miss what the round cost)."""
        means = (overlapped_mean.get(c, float("inf")), inline_mean.get(c, float("inf")))
        return min(best(c)[1], *means)

    def ratio(base: dict[int, float], c: int) -> float | None:
        return round(base[c] / best_ms(c), 3) if c in base else None  # tok/s ratio = ms ratio

    emit(
        {
            "benchmark": "gpu",
            "machine": machine()
            | {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"},
            "model_bytes": weight_bytes,
            "dtype": str(dtype),
            "jit_options": dict(compiled_forward.JIT_OPTIONS),
            "overlap_ms_variants": variants,
            "overlap_ms_variant_quantiles": variant_quantiles,
            "overlap_ms_variant_means": variant_means,
            "overlap_ms_pinning": pinning,
            "overlap_ms_pinning_quantiles": pinning_quantiles,
            "verify_cost": verify,
            **{f"verify_cost_ratio_{c}": v["ratio"] for c, v in verify.items()},
            **{f"spec_step_ratio_{c}": v["step_ratio"] for c, v in verify.items()},
            "prompt": args.prompt,
            "output": args.output,
            "hf_eager_ms": hf["eager"],
            "hf_static_ms": hf["static"],
            "engine_ms": {label(k): v for k, v in ours.items()},
            "best_config": {c: label(best(c)[0]) for c in args.concurrency},
            "compile_build_s": None if build_s is None else round(build_s, 1),
            **{f"compile_speedup_{c}": compile_speedup(c) for c in args.concurrency},
            "overlap_ms": overlapped,
            "overlap_mean_ms": overlapped_mean,
            "overlap_inline_ms": inline,
            "overlap_inline_mean_ms": inline_mean,
            "fast_plan_ms": fast_plan,
            "host_probe_ms": probes,
            **{
                f"overlap_speedup_{c}": round(best(c)[1] / ms, 3)
                for c, ms in overlapped_mean.items()
            },
            **{f"ms_per_step_{c}": round(best_ms(c), 3) for c in args.concurrency},
            "step_split_ms": {k: round(v, 3) for k, v in split.items()},
            "step_split_ms_top": {k: round(v, 3) for k, v in split_top.items()},
            "ratio_vs_hf_static_1": ratio(hf["static"], 1),
            "ratio_vs_hf_static_32": ratio(hf["static"], c_mid),
            "ratio_vs_hf_eager_32": ratio(hf["eager"], c_mid),
            "gpu_busy_frac_32": None if busy is None else round(busy, 3),
            "gpu_busy_frac_32_overlap": None if busy_overlap is None else round(busy_overlap, 3),
            "gpu_busy_frac_32_inline": None if busy_inline is None else round(busy_inline, 3),
            "syncs_per_step_32": syncs,
            "gpu_busy_frac_32_profiler": None if busy_profiler is None else round(busy_profiler, 3),
            "roofline_frac_64": round(roofline_ms / best_ms(c_top), 3),
            "ttft_ms_8k": {k: round(1000 * v, 2) for k, v in t.items()},
            "ttft_ratio_8k": round(t["stateless"] / t["session"], 2),
            "ttft_turns_8k": turns,
        }
    )


if __name__ == "__main__":
    main()
