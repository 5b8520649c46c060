"""Shared by the benchmark scripts: model loading, engine construction, timing decode steps
under alternating variants, machine facts."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch

from sessionserve.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SessionConfig,
)
from sessionserve.replicas.engine import Engine
from sessionserve.replicas.loader import LoadedModel, load_model


def setup_threads(threads: int) -> None:
    """Also shows sessionserve's own progress lines (a compiled forward's build) on stderr."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    logging.basicConfig(format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("sessionserve").setLevel(logging.INFO)


class ForwardTimer:
    """Sums the seconds `eng`'s model forwards take (`seconds`) until `restore()`: the share of
    a step that is not host work."""

    def __init__(self, eng: Engine) -> None:
        self.eng, self.inner, self.seconds = eng, eng.runner.forward, 0.0
        eng.runner.forward = self._timed

    def _timed(self, batch: Any) -> Any:
        started = time.perf_counter()
        try:
            return self.inner(batch)
        finally:
            self.seconds += time.perf_counter() - started

    def restore(self) -> None:
        self.eng.runner.forward = self.inner


def load(path: str = "default", dtype: torch.dtype = torch.float32) -> LoadedModel:
    return load_model(path, dtype)


def bench_config_engine(
    threads: int,
    dtype: str,
    kv_tokens: int | None = None,
    max_running: int = 32,
    kv_dtype: str = "auto",
    model_path: str = "default",
    compile_decode: bool | str = "auto",
    compile_prefill_dtype: str = "auto",
) -> Engine:
    """The engine of `serve-cpu-bench*.yaml` in this process: the default model (or
    `model_path`) in `dtype`, compiled (the build waited for; `compile_decode` as
    `engine.compile_decode`, the prefill package's layers as `compile_prefill_dtype`), `threads`
    torch threads, `kv_tokens` of KV or 1 GiB of the
    default model's (in `kv_dtype`, `cache.kv_dtype`), `max_running` requests a step (the
    configs' 32)."""
    model = ModelConfig(path=model_path, torch_threads=threads, dtype=dtype)
    kv = CacheConfig(kv_dtype=kv_dtype).kv_torch_dtype(model.torch_dtype())
    cfg = EngineConfig(
        model=model,
        cache=CacheConfig(
            num_slots=kv_tokens or 23296 * 4 // kv.itemsize,
            max_rows=96,
            max_context_len=4096,
            kv_dtype=kv_dtype,
        ),
        scheduler=SchedulerConfig(max_running_requests=max_running, max_prefill_tokens=512),
        compile=True,
        compile_decode=compile_decode,
        compile_prefill_dtype=compile_prefill_dtype,
    )
    eng = Engine(cfg, load(model_path, model.torch_dtype()))
    if eng.runner.compiling is not None:
        eng.runner.compiling.join()
    return eng


def engine(
    loaded: LoadedModel,
    *,
    sessions: bool = True,
    radix: bool = True,
    num_slots: int = 8192,
    max_running: int = 64,
    prefill: int = 1024,
    host_tier_bytes: int | None = None,
    max_context_len: int = 8192,
    sliding_window_kv: bool = True,
    sliding_slots: int | None = None,
    compile: bool = False,
    prefill_batch_tokens: int | str | None = "auto",
) -> Engine:
    cfg = EngineConfig(
        cache=CacheConfig(
            page_size=16,
            num_slots=num_slots,
            max_rows=max_running + 8,
            max_context_len=min(num_slots, max_context_len),
            radix_cache=radix,
            sliding_window_kv=sliding_window_kv,
            sliding_slots=sliding_slots,
        ),
        sessions=SessionConfig(enabled=sessions, host_tier_bytes=host_tier_bytes),
        scheduler=SchedulerConfig(
            max_running_requests=max_running,
            max_prefill_tokens=prefill,
            prefill_batch_tokens=prefill_batch_tokens,
        ),
        compile=compile,
    )
    return Engine(cfg, loaded)


def finish_prefills(eng: Engine) -> None:
    """Step `eng` until every request it holds is decoding (prompts computed, a token sampled):
    what is timed after this is decode steps only."""
    while eng.scheduler.waiting or not all(r.sampled for r in eng.scheduler.running):
        eng.step()


def alternate_decode_steps(
    eng: Engine, variants: dict[str, Callable[[], None]], rounds: int, steps: int
) -> dict[str, float]:
    """Median ms per decode step of what `eng` is decoding under each variant (a function
    that switches the engine to it), prefills first done, variants alternating `rounds` times
    so drift on a shared machine falls on all of them; the first step after a switch is not
    timed."""
    finish_prefills(eng)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, switch in variants.items():
            switch()
            eng.step()
            t = time.perf_counter()
            for _ in range(steps):
                eng.step()
            times[name].append((time.perf_counter() - t) / steps * 1e3)
    return {name: median(ts) for name, ts in times.items()}


def machine() -> dict[str, Any]:
    return {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }


T = TypeVar("T")


def rotated(items: Sequence[T], r: int) -> list[T]:
    """`items` in round `r`'s order: alternating contenders, each round starting with
    another, so that each sees the same drift and none always follows the same one."""
    shift = r % len(items)
    return [*items[shift:], *items[:shift]]


def best_ms(call: Callable[[], Any], rounds: int = 5, calls: int = 10) -> float:
    """The best of `rounds` rounds of `calls` calls, in ms a call (after one untimed call):
    the least the VM's other work added."""
    call()
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - started) / calls)
    return best * 1e3


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def first_token_ms(
    arms: dict[str, Callable[[list[int]], Any]],
    tokens: int,
    rounds: int,
    vocab: int,
    g: torch.Generator,
) -> tuple[dict[str, float], int]:
    """Each arm's median ms to answer a fresh `tokens`-token prompt (an arm: a function of
    the prompt that generates its first token, returning the result with `output_ids`), over
    `rounds` rounds after one warm-up round, the arms' order alternating round by round; and
    in how many of the `rounds + 1` rounds all arms' tokens were equal."""
    names = list(arms)
    ms: dict[str, list[float]] = {name: [] for name in names}
    agree = 0
    for r in range(rounds + 1):  # a fresh prompt each round: no prefix is reused
        prompt = torch.randint(3, vocab, (tokens,), generator=g).tolist()
        answers = {}
        for name in names if r % 2 == 0 else names[::-1]:
            started = time.perf_counter()
            answers[name] = arms[name](prompt)
            if r > 0:  # the first round warms up
                ms[name].append(1000 * (time.perf_counter() - started))
        agree += len({tuple(a.output_ids) for a in answers.values()}) == 1
    return {name: median(v) for name, v in ms.items()}, agree


def compare_prefill_arms(
    arms: dict[str, Callable[[list[int]], Any]],
    package_ms: dict[str, list[float]],
    tokens: list[int],
    rounds: int,
    vocab: int,
    summary: dict[str, Any],
) -> None:
    """Two arms' prefills, per T of `tokens`: their packages' best ms (`package_ms`, in the
    order of `tokens`) and their first tokens (`first_token_ms`, fresh seeded prompts), printed
    with ratios first arm / second (above 1: the second is faster) and put in `summary`:
    `package_speedup_<T>`, `first_token_speedup_<T>`, `first_token_ms_<arm>_<T>`,
    `same_first_tokens`."""
    a, b = arms
    g = torch.Generator().manual_seed(0)
    print(
        f"{'T':>5} {'package ' + a:>14} {b:>8} {'ratio':>6} {'first token ' + a:>18} "
        f"{b:>8} {'ratio':>6}"
    )
    agree = 0
    for i, t in enumerate(tokens):
        served, same = first_token_ms(arms, t, rounds, vocab, g)
        agree += same
        package = package_ms[a][i] / package_ms[b][i]
        ratio = served[a] / served[b]
        print(
            f"{t:>5} {package_ms[a][i]:>14.1f} {package_ms[b][i]:>8.1f} {package:>6.2f} "
            f"{served[a]:>18.1f} {served[b]:>8.1f} {ratio:>6.2f}"
        )
        summary[f"package_speedup_{t}"] = round(package, 3)
        summary[f"first_token_speedup_{t}"] = round(ratio, 3)
        for arm in arms:
            summary[f"first_token_ms_{arm}_{t}"] = round(served[arm], 2)
    total = len(tokens) * (rounds + 1)
    summary["same_first_tokens"] = f"{agree}/{total}"
    print(f"greedy first tokens equal on {agree} of {total} prompts")


def emit(summary: dict[str, Any]) -> None:
    """The last line of every benchmark: one JSON object."""
    print(json.dumps(summary, sort_keys=True))


@contextlib.contextmanager
def local_serve(port: int, **model_shape: int) -> Iterator[str]:
    """Ray (2 CPUs, its own temp dir) and Serve on loopback `port`, with a tiny random-weight
    model (of `model_shape`, e.g. hidden_size) saved for the app; yields the model's
    directory. Everything goes away after."""
    import ray
    from ray import serve

    from tests.models import save_tiny_model

    model_dir = tempfile.mkdtemp(prefix="ss-model-")
    save_tiny_model(model_dir, **model_shape)
    ray_tmp = tempfile.mkdtemp(prefix="ss-", dir="/tmp")
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=ray_tmp, logging_level="ERROR")
    serve.start(
        http_options={"host": "127.0.0.1", "port": port},
        logging_config={"enable_access_log": False, "log_level": "WARNING"},
    )
    try:
        yield model_dir
    finally:
        serve.shutdown()
        ray.shutdown()
        shutil.rmtree(ray_tmp, ignore_errors=True)
        shutil.rmtree(model_dir, ignore_errors=True)
