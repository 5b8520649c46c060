"""The compiled forward (compiled_forward.py: torch.export + AOTInductor, our attention an
opaque op) gives the eager engine's answers: greedy tokens equal token for token (and equal
transformers' `generate`), logprobs within 1e-4 (fp32; fused kernels sum in another order),
seeded samples equal, over sessions, chunked prefill and batches, for Llama, Qwen2 (q/k/v
biases) and Mistral with a sliding window (its KV kept apart). Packages are built once per
architecture into a directory shared by this module (a real build: ~25-45 s each on 2
cores; qwen2's by a build process, as `compile: auto` builds) and loaded from there by each
engine; the cache, the eager fallback and the background build
of `compile: auto` are checked on top; so is the prefill package (`compile_prefill`), which
runs the steps above compile_max_tokens, and `auto`'s timed choice of it (prefill_choice.py)."""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
import threading
from pathlib import Path

import pytest
import torch

from sessionserve.config import EngineConfig
from sessionserve.replicas import compiled_forward
from sessionserve.replicas.attention import cpu_decode_kernel
from sessionserve.wire import SamplingParams
from tests.models import hf_greedy, session_turns, tiny_engine, tiny_model

pytestmark = pytest.mark.slow  # real package builds (25-50 s each)
ARCHS = {
    "llama": {},
    "qwen2": {},
    "mistral": {"sliding_window": 12},
}
LOGPROB_ATOL = 1e-4


@pytest.fixture
def cache_dir(package_cache) -> str:
    return package_cache  # shared with the other modules' builds (tests/unit/replicas/conftest.py)


def model_for(arch: str):
    return tiny_model(arch, seed=4, **ARCHS[arch])


def compiled_engine(model, cache_dir: str, **kw):
    """An engine over `model` with the compiled forward installed (built on first use); its
    decode steps run it too (`compile_decode` off: that package's tests are
    test_compiled_decode.py; tests that fake AUTO_MIN_PARAMS would otherwise build it)."""
    kw.setdefault("compile_decode", False)
    engine = tiny_engine(model, compile=True, compile_cache_dir=cache_dir, **kw)
    assert engine.runner.compiled is not None, "the compiled forward did not install"
    # and decode rows attend over the pool in place (test_inplace_decode.py)
    assert engine.runner.backend.decode_kernel is not None
    return engine


def count_compiled_steps(engine) -> list[int]:
    """Count the forwards that ran compiled (the list's one element)."""
    calls, compiled = [0], engine.runner.compiled
    inner = compiled.run

    def counted(*args):
        calls[0] += 1
        return inner(*args)

    compiled.run = counted
    return calls


def step_sizes(runner, package) -> tuple[list[int], list[int]]:
    """The tokens of every step `runner` runs, and of those that ran `package`."""
    steps, packaged = [], []
    forward, run = runner.forward, package.run

    def counted_forward(batch):
        steps.append(len(batch.input_ids))
        return forward(batch)

    def counted_run(ids, *args):
        packaged.append(len(ids))
        return run(ids, *args)

    runner.forward, package.run = counted_forward, counted_run
    return steps, packaged


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    lengths = [5, 40, 150]  # with 40-token chunks: steps above compile_max_tokens (32) run
    # eagerly, decode steps (3 rows) compiled, in one engine
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def test_a_build_process_makes_the_package_the_engine_loads(cache_dir, capfd) -> None:
    """`build_in_subprocess` (what a background build runs): the model crosses as a file, a
    child process at idle CPU priority builds, the package loads and answers as the eager
    engine. Built under the key an engine looks for, in the run's cache: the qwen2 batch
    test below loads this package instead of building its own."""
    model = model_for("qwen2")
    max_tokens = EngineConfig().compile_max_tokens
    package = Path(cache_dir) / f"{compiled_forward.package_key(model, max_tokens)}.pt2"
    plan = compiled_forward.CompilePlan(True, "test", package, max_tokens)
    compiled_forward.build_in_subprocess(model, plan)
    assert package.exists()
    own = package.parent.glob(f"{package.stem}.*")  # the cache is shared with other builds
    assert not [p for p in own if p.name.endswith((".model.pt", ".partial.pt2"))]
    assert "the build process runs at idle (SCHED_IDLE) CPU priority" in capfd.readouterr().err
    engine = tiny_engine(model)
    engine.runner.compiled = compiled_forward.CompiledForward(package, max_tokens)
    steps = count_compiled_steps(engine)
    greedy = SamplingParams(max_tokens=10, temperature=0)
    (got,) = engine.generate([[3, 14, 15, 92]], greedy)
    (want,) = tiny_engine(model).generate([[3, 14, 15, 92]], greedy)
    assert got.output_ids == want.output_ids and steps[0] >= len(got.output_ids) - 1


def assert_same_answers(got, want, inputs, model) -> None:
    """Greedy tokens equal the eager engine's and transformers' `generate`'s, logprobs
    within LOGPROB_ATOL of the eager engine's."""
    for g, w, prompt in zip(got, want, inputs, strict=True):
        assert g.output_ids == w.output_ids
        assert g.output_ids == hf_greedy(model, prompt, len(g.output_ids))[: len(g.output_ids)]
        for a, b in zip(g.logprobs, w.logprobs, strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=LOGPROB_ATOL)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_compiled_batches_match_eager_and_transformers(arch, cache_dir) -> None:
    model = model_for(arch)
    compiled = compiled_engine(model, cache_dir, prefill=40)
    steps = count_compiled_steps(compiled)
    eager = tiny_engine(model, prefill=40)
    greedy = SamplingParams(max_tokens=24, temperature=0, logprobs=True)
    inputs = prompts(model.config.vocab_size)
    got = compiled.generate(inputs, greedy)
    assert_same_answers(got, eager.generate(inputs, greedy), inputs, model)
    # every decode step (at most 3 rows) ran compiled: one per token after the first, at least
    assert steps[0] >= max(len(g.output_ids) for g in got) - 1
    compiled.check_memory()


def test_compiled_session_turns_and_seeded_samples_match_eager(cache_dir) -> None:
    model = model_for("llama")
    compiled = compiled_engine(model, cache_dir, prefill=32)
    eager = tiny_engine(model, prefill=32)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(3)
    turns = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (30, 9, 70)]
    sampled = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=11)
    results = {
        name: session_turns(e, turns, sampled)
        for name, e in (("compiled", compiled), ("eager", eager))
    }
    assert results["compiled"] == results["eager"]
    assert results["compiled"][-1][1] > 0  # the last turn reused the session's KV


def test_a_second_engine_loads_the_package_without_building(cache_dir, caplog) -> None:
    model = model_for("llama")
    compiled_engine(model, cache_dir)  # built here unless an earlier test did
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=compiled_forward.__name__):
        engine = compiled_engine(model, cache_dir)
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("compile: loaded") for m in messages)
    assert not any("building" in m for m in messages)
    # another model (other weights) gets its own package
    other = tiny_model("llama", seed=5)
    assert compiled_forward.package_key(other, 64) != compiled_forward.package_key(model, 64)
    assert engine.runner.compiled.package.exists()


def test_the_package_key_follows_the_model_not_where_it_was_loaded_from() -> None:
    """A GGUF's first start loads it from the GGUF's folder and converts it, every later
    start loads the converted copy: the same model, so the same packages (a key that took the
    path in made the first start's builds, minutes each, useless to every later start)."""
    model = tiny_model("llama")
    key = compiled_forward.package_key(model, 64)
    model.config._name_or_path = "/somewhere/else"
    assert compiled_forward.package_key(model, 64) == key
    model.config.rms_norm_eps *= 2  # what the package computes does change it
    assert compiled_forward.package_key(model, 64) != key


def test_a_failed_build_leaves_an_eager_engine_and_says_why(tmp_path, monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler here")

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", broken)
    model = model_for("llama")
    # what a build killed with its replica leaves: removed by the next build of the package
    key = compiled_forward.package_key(model, EngineConfig().compile_max_tokens)
    (tmp_path / f"{key}.4242.partial.pt2").write_bytes(b"half a package")
    (tmp_path / f"{key}.4242.model.pt").write_bytes(b"a model for a build process")
    with caplog.at_level(logging.WARNING, logger=compiled_forward.__name__):
        engine = tiny_engine(model, compile=True, compile_cache_dir=str(tmp_path))
    assert engine.runner.compiled is None
    assert any(
        "stays eager" in r.getMessage() and "no C++ compiler" in r.getMessage()
        for r in caplog.records
    )
    assert {p.suffix for p in tmp_path.iterdir()} <= {".lock"}  # no package, no leftovers
    # the compiled in-place kernel's build failed the same way; the hand-written CPU kernel
    # (built by g++ directly, not by inductor) is installed where it loads
    kernel = engine.runner.backend.decode_kernel
    if cpu_decode_kernel.load():
        assert kernel is not None and kernel.run.__module__ == cpu_decode_kernel.__name__
    else:
        assert kernel is None
    greedy = SamplingParams(max_tokens=8, temperature=0)
    (r,) = engine.generate([[4, 5, 6]], greedy)
    assert r.output_ids == hf_greedy(model, [4, 5, 6], 8)[: len(r.output_ids)]


def test_a_build_removes_what_killed_builds_left_and_nothing_else(tmp_path) -> None:
    """Build files name the host and process that wrote them: a dead process's on this host
    go (gigabytes of model copies otherwise stay forever), a live one's, another host's (a
    shared cache directory) and an older release's stay; the package's own always go."""
    import socket
    import subprocess
    import sys

    finished = subprocess.Popen([sys.executable, "-c", "pass"])
    finished.wait()
    host = socket.gethostname().replace(".", "_")
    package = tmp_path / "k0.pt2"
    names = {
        f"k1.{host}-{finished.pid}.model.pt": False,  # killed on this host: removed
        f"k2.{host}-{finished.pid}.partial.pt2": False,
        f"k3.{host}-{os.getpid()}.model.pt": True,  # a build still running: kept
        f"k4.other-node-{finished.pid}.model.pt": True,  # another host's: kept
        "k5.4242.model.pt": True,  # no host in the name: kept
        "k0.4242.model.pt": False,  # the package's own, under its lock: removed
        f"k0.{host}-{os.getpid()}.partial.pt2": False,
        "k6.pt2": True,  # a package
    }
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    compiled_forward.remove_stale_build_files(package)
    assert {p.name for p in tmp_path.iterdir()} == {n for n, kept in names.items() if kept}


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
def test_loading_removes_the_extractions_killed_processes_left(tmp_path) -> None:
    """torch's loader unpacks each package it loads into the temp directory and removes it
    only when the loader is destroyed: a killed process leaves it. Removed: an old extraction
    no process maps; kept: a fresh one (maybe still being unpacked), an old one a live
    process maps a file from, and anything not named like an extraction."""
    import mmap
    import time

    old = time.time() - 2 * compiled_forward.STALE_EXTRACTION_S
    dirs = {}
    for name in ("aotinductor_dead", "aotinductor_fresh", "aotinductor_live", "other_dir"):
        path = tmp_path / name / "pkg.vm-1.partial" / "data"
        path.mkdir(parents=True)
        (path / "model.so").write_bytes(b"x" * 4096)
        dirs[name] = path.parents[1]
    for name, path in dirs.items():
        if name != "aotinductor_fresh":
            os.utime(path, (old, old))
    with open(dirs["aotinductor_live"] / "pkg.vm-1.partial" / "data" / "model.so", "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            freed = compiled_forward.remove_stale_extractions(tmp_path)
        finally:
            mapped.close()
    assert freed == 4096
    assert {p.name for p in tmp_path.iterdir()} == {
        "aotinductor_fresh",
        "aotinductor_live",
        "other_dir",
    }


def test_auto_skips_tiny_models_and_builds_big_ones_in_the_background(
    cache_dir, tmp_path, monkeypatch
) -> None:
    model = model_for("llama")
    assert (
        tiny_engine(model, compile="auto", compile_cache_dir=str(tmp_path)).runner.compiled is None
    )
    assert (
        tiny_engine(model, compile="auto", compile_cache_dir=str(tmp_path)).runner.compiling is None
    )
    # a real package, built once for this module; the background "build" copies it when the
    # test lets it, so the test sees the engine serve eagerly meanwhile, then switch
    built = compiled_engine(model, cache_dir).runner.compiled.package
    release = threading.Event()

    def build_when_released(model, plan):
        assert plan.feature_layers is None  # no EAGLE-3 head: the last hidden state only
        assert plan.min_tokens == 1  # the forward's package (compile_prefill: false)
        assert release.wait(60)
        shutil.copy(built, plan.package)

    monkeypatch.setattr(compiled_forward, "AUTO_MIN_PARAMS", 0)
    monkeypatch.setattr(compiled_forward, "build_in_subprocess", build_when_released)
    engine = tiny_engine(
        model,
        compile="auto",
        compile_prefill=False,
        compile_decode=False,
        compile_cache_dir=str(tmp_path),
    )
    assert engine.runner.compiling is not None and engine.runner.compiled is None
    greedy = SamplingParams(max_tokens=10, temperature=0)
    (before,) = engine.generate([[7, 8, 9, 10]], greedy)  # served eagerly meanwhile
    release.set()
    engine.runner.compiling.join(60)
    assert engine.runner.compiled is not None
    steps = count_compiled_steps(engine)
    (after,) = engine.generate([[7, 8, 9, 10]], greedy)
    assert after.output_ids == before.output_ids and steps[0] > 0


def batches_and_turns(engine, inputs: list[list[int]], p: SamplingParams) -> list:
    """`inputs` as one batch (decode rows: the decode graphs), then a session of two turns
    (one sequence extended: the extend graphs), the strict memory check after."""
    out = engine.generate(inputs, p)
    sid = engine.open_session()
    out += engine.generate([inputs[0]], p, session_id=sid)
    out += engine.generate([out[-1].output_ids[-1:] + [9, 10, 11]], p, session_id=sid)
    engine.close_session(sid)
    engine.check_memory()
    return out


def test_graph_paths_run_the_compiled_forward_and_capture_again_when_it_arrives(cache_dir):
    """What CUDA graphs replay on a GPU with `engine.compile`, run eagerly (capture=False):
    the decode and extend graphs' static paths call the compiled package, with the eager
    engine's tokens and logprobs (within LOGPROB_ATOL) over batches and session turns. A graph
    built before the package was installed (a background build) is built again over it."""
    from sessionserve.replicas.cuda_graphs import DecodeGraphs, ExtendGraphs

    model = model_for("llama")
    p = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=True)
    inputs = prompts(model.config.vocab_size)[:2]

    eager = batches_and_turns(tiny_engine(model, page_size=4), inputs, p)
    engine = compiled_engine(model, cache_dir, page_size=4)
    compiled, runner = engine.runner.compiled, engine.runner
    runner.compiled = None  # as if a background build were still running
    runner.graphs = DecodeGraphs(runner, (1, 2, 4), capture=False)
    runner.extend_graphs = ExtendGraphs(runner, runner.backend, 64, capture=False)
    before = batches_and_turns(engine, inputs, p)
    assert {g.compiled for g in runner.graphs.graphs.values()} == {None}
    runner.compiled = compiled  # the build lands
    steps = count_compiled_steps(engine)
    after = batches_and_turns(engine, inputs, p)
    decode = runner.graphs.graphs.values()
    assert decode and all(g.compiled is runner.compiled for g in decode)
    extend = runner.extend_graphs.graphs.values()
    assert extend and all(g.compiled is runner.compiled for g in extend)
    # every step but the prompts' first chunk replayed a graph over the compiled forward
    assert steps[0] >= 2 * (p.max_tokens - 1)
    for got in (before, after):
        for g, w in zip(got, eager, strict=True):
            assert g.output_ids == w.output_ids
            for a, b in zip(g.logprobs, w.logprobs, strict=True):
                assert a.logprob == pytest.approx(b.logprob, abs=LOGPROB_ATOL)


@pytest.mark.parametrize("options", [{}, {"freezing": True}], ids=["plain", "freezing"])
def test_the_torch_compile_forward_gives_the_eager_tokens_through_the_graph_paths(options) -> None:
    """`JitForward` (what `compile: true` installs on CUDA: torch.compile of the same module,
    the attention the opaque op), run here by inductor's CPU backend through the decode and
    extend graphs' static paths: the eager engine's tokens and logprobs over batches and
    session turns; a second engine over the same model shares the compiled function. With
    freezing (`JIT_OPTIONS`: the weights folded in as constants, merged GEMMs on CUDA) too."""
    from sessionserve.replicas.compiled_forward import JitForward
    from sessionserve.replicas.cuda_graphs import DecodeGraphs, ExtendGraphs

    model = model_for("llama")
    p = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=True)
    inputs = prompts(model.config.vocab_size)[:2]

    eager = batches_and_turns(tiny_engine(model, page_size=4), inputs, p)
    engine = tiny_engine(model, page_size=4)
    runner = engine.runner
    runner.compiled = JitForward(runner.model, 256, options=options)
    same = JitForward(runner.model, 256, options=options)._fn
    assert same is runner.compiled._fn  # one compile per model and options
    runner.graphs = DecodeGraphs(runner, (1, 2, 4), capture=False)
    runner.extend_graphs = ExtendGraphs(runner, runner.backend, 64, capture=False)
    got = batches_and_turns(engine, inputs, p)
    assert runner.graphs.graphs and runner.extend_graphs.graphs
    graphs = [*runner.graphs.graphs.values(), *runner.extend_graphs.graphs.values()]
    assert all(g.compiled is runner.compiled for g in graphs)
    for g, w in zip(got, eager, strict=True):
        assert g.output_ids == w.output_ids
        for a, b in zip(g.logprobs, w.logprobs, strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=LOGPROB_ATOL)


PREFILL_CHUNK = 40  # the prefill package's tests: chunks above compile_max_tokens (32)


def prefill_engine(model, cache_dir: str, **kw):
    """An engine with both packages installed (built on first use, shared by the tests)."""
    engine = compiled_engine(model, cache_dir, prefill=PREFILL_CHUNK, compile_prefill=True, **kw)
    assert engine.runner.compiled_prefill is not None, "the prefill package did not install"
    return engine


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_the_prefill_package_runs_the_long_steps_as_eager_and_transformers(arch, cache_dir):
    """Steps above compile_max_tokens (prefill chunks of 40, the middle ones wanting no
    logits) run through the prefill package, decode steps through the forward's package; the
    tokens are the eager engine's and transformers', logprobs within LOGPROB_ATOL; a session
    turn (a 40-token extend over a held history) and seeded samples agree too. Mistral: a
    12-token sliding window, its KV kept apart, so chunks read a cut window."""
    model = model_for(arch)
    compiled = prefill_engine(model, cache_dir)
    runner = compiled.runner
    assert runner.compiled_prefill.min_tokens == 6  # the default for an fp32 model
    long_steps, no_logits = [0], [0]
    inner = runner.compiled_prefill.run

    def counted(ids, positions, logit_idx, meta):
        long_steps[0] += 1
        no_logits[0] += logit_idx.numel() == 0
        return inner(ids, positions, logit_idx, meta)

    runner.compiled_prefill.run = counted
    eager = tiny_engine(model, prefill=PREFILL_CHUNK)
    greedy = SamplingParams(max_tokens=16, temperature=0, logprobs=True)
    inputs = prompts(model.config.vocab_size)
    got = compiled.generate(inputs, greedy)
    assert_same_answers(got, eager.generate(inputs, greedy), inputs, model)
    assert long_steps[0] >= 4
    # alone, a 130-token prompt's first three chunks want no logits (no decode rides along)
    solo = torch.randint(3, model.config.vocab_size, (130,), generator=torch.Generator()).tolist()
    (g,) = compiled.generate([solo], greedy)
    (w,) = eager.generate([solo], greedy)
    assert g.output_ids == w.output_ids and no_logits[0] == 3
    compiled.check_memory()
    sampled = SamplingParams(max_tokens=10, temperature=0.8, seed=5)
    g = torch.Generator().manual_seed(9)
    turns = [
        torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist() for n in (60, 40)
    ]
    results = {
        name: session_turns(e, turns, sampled)
        for name, e in (("compiled", compiled), ("eager", eager))
    }
    assert results["compiled"] == results["eager"]
    assert results["compiled"][-1][1] > 0


def test_auto_keeps_the_prefill_package_only_where_it_was_timed_faster(
    cache_dir, monkeypatch, caplog
) -> None:
    """`compile_prefill: auto` times the package once at the sizes within its range
    (`prefill_choice.measure`, faked here: tests do not time things) and keeps the verdict
    beside it: a package timed slower at every size is not installed, nor loaded again by the
    next engine (which does not time it again); one recorded faster at every size takes all
    its steps; one faster at the shorter sizes only takes the steps up to the last of them,
    and the longer ones run eagerly; a verdict of the old single-size form is timed again."""
    from sessionserve.replicas import prefill_choice

    model = model_for("llama")
    package = prefill_engine(model, cache_dir).runner.compiled_prefill.package  # built once
    record = prefill_choice.timing_file(package)
    record.unlink(missing_ok=True)
    monkeypatch.setattr(compiled_forward, "AUTO_MIN_PARAMS", 0)
    timed = []

    def slower(model, run_package, sizes):
        timed.append(sizes)
        return prefill_choice.PrefillTiming(sizes, [100.0] * len(sizes), [99.0] * len(sizes))

    monkeypatch.setattr(prefill_choice, "measure", slower)
    auto = {"prefill": PREFILL_CHUNK, "compile_prefill": "auto"}
    assert compiled_engine(model, cache_dir, **auto).runner.compiled_prefill is None
    assert timed == [[64, 128]]  # the package's range: 40 + 64 rows, to a power of 2
    want = prefill_choice.PrefillTiming([64, 128], [100.0, 100.0], [99.0, 99.0])
    assert prefill_choice.recorded(package) == want
    loads = []
    monkeypatch.setattr(compiled_forward, "CompiledForward", _counting(loads))
    with caplog.at_level(logging.INFO, logger=prefill_choice.__name__):
        again = compiled_engine(model, cache_dir, **auto)
    assert again.runner.compiled_prefill is None and len(timed) == 1
    assert [p for p in loads if p == package] == []  # a package that lost is not loaded
    assert any("prefill steps stay eager" in r.getMessage() for r in caplog.records)

    def verdict(package_ms: list[float]) -> None:
        timing = {"tokens": [64, 128], "eager_ms": [120.0, 200.0], "package_ms": package_ms}
        record.write_text(json.dumps(timing))

    verdict([100.0, 180.0])
    auto["compile_prefill_min_tokens"] = 33  # the split (timed for a model this size) set
    faster = compiled_engine(model, cache_dir, **auto).runner.compiled_prefill
    assert (faster.min_tokens, faster.max_tokens, faster.limited) == (33, 128, False)
    assert len(timed) == 1
    verdict([100.0, 195.0])  # 1.2x at 64 tokens, 1.03x at 128: short of MARGIN
    # chunks of 64: steps of a chunk beside decode rows pass 64 (the same package: 64 + 64)
    limited = compiled_engine(model, cache_dir, **(auto | {"prefill": 64}))
    prefill = limited.runner.compiled_prefill
    assert (prefill.max_tokens, prefill.limited, len(timed)) == (64, True, 1)
    routed = [limited.runner.compiled_for(n) for n in (32, 33, 64, 65, 128)]
    assert routed == [limited.runner.compiled, prefill, prefill, None, None]
    steps, packaged = step_sizes(limited.runner, prefill)
    greedy = SamplingParams(max_tokens=4, temperature=0)
    g = torch.Generator().manual_seed(3)
    inputs = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (50, 70, 90)]
    got = limited.generate(inputs, greedy)
    for prompt, result in zip(inputs, got, strict=True):
        assert result.output_ids == hf_greedy(model, prompt, 4)
    longer = [n for n in steps if n > 64]
    assert longer and packaged and max(packaged) <= 64  # the longer steps ran eagerly
    limited.check_memory()
    record.write_text(json.dumps({"tokens": 256, "eager_ms": 120.0, "package_ms": 100.0}))
    assert compiled_engine(model, cache_dir, **auto).runner.compiled_prefill is None
    assert timed == [[64, 128]] * 2  # the old form was timed again (slower: not installed)
    record.unlink()


def test_the_prefill_verdict_keeps_the_sizes_up_to_the_first_that_lost(tmp_path) -> None:
    """The package takes the steps up to the largest size at which it, and every smaller size
    timed, was MARGIN faster: a later size that paid again does not count past one that lost;
    all of its range where every size paid; none where the smallest lost. A record whose
    columns do not line up is no verdict (timed again)."""
    from sessionserve.replicas import prefill_choice

    timing = prefill_choice.PrefillTiming
    sizes = [64, 128, 192, 256]
    gap = timing(sizes, [100.0] * 4, [80.0, 99.0, 80.0, 80.0])  # 1.25x, 1.01x, 1.25x, 1.25x
    assert (gap.largest_paying(), gap.step_limit(1024), gap.pays) == (64, 64, True)
    every = timing(sizes, [100.0] * 4, [80.0] * 4)
    assert every.step_limit(1024) == 1024
    first_lost = timing(sizes, [100.0] * 4, [99.0, 80.0, 80.0, 80.0])
    assert (first_lost.step_limit(1024), first_lost.pays) == (None, False)
    assert prefill_choice.sizes_to_time(128) == [64, 128]
    assert prefill_choice.sizes_to_time(40) == [40]
    package = tmp_path / "p.pt2"
    record = prefill_choice.timing_file(package)
    record.write_text(json.dumps({"tokens": [64, 128], "eager_ms": [1.0], "package_ms": [1.0]}))
    assert prefill_choice.recorded(package) is None


def test_the_prefill_package_takes_the_steps_from_where_it_was_timed_faster(
    cache_dir, monkeypatch
) -> None:
    """With `compile_prefill_min_tokens` unset, the split between the two packages is timed
    once at each size up to compile_max_tokens (`prefill_choice._best_ms`, faked here: tests
    do not time things) and kept beside the prefill package: the prefill package takes the
    steps from the first size from which it was faster at every size timed (12 here, though
    faster at 5 too), a later engine reads the record and does not time again; where it was
    never faster the forward's package keeps every step up to compile_max_tokens; a set
    `compile_prefill_min_tokens` is used as it is, untimed. Tiny models are never timed."""
    from sessionserve.replicas import prefill_choice

    model = model_for("llama")
    untimed = prefill_engine(model, cache_dir).runner.compiled_prefill  # built once
    assert untimed.min_tokens == 6  # fp32's default: a tiny model's timings mean nothing
    split = prefill_choice.split_file(untimed.package)
    split.unlink(missing_ok=True)
    monkeypatch.setattr(compiled_forward, "AUTO_MIN_PARAMS", 0)
    timed: list[int] = []

    def faster_from_12(model, tokens, forwards):
        timed.append(tokens)
        assert set(forwards) == {"forward", "package"}
        return {"forward": 10.0, "package": 9.0 if tokens >= 12 or tokens == 5 else 11.0}

    monkeypatch.setattr(prefill_choice, "_best_ms", faster_from_12)
    engine = prefill_engine(model, cache_dir)
    assert timed == [4, 5, 6, 8, 12, 16, 24, 32]  # compile_max_tokens: 32
    assert engine.runner.compiled_prefill.min_tokens == 12
    forward_package = engine.runner.compiled.package
    assert prefill_choice.recorded_split(untimed.package, forward_package).min_tokens(32) == 12
    assert prefill_engine(model, cache_dir).runner.compiled_prefill.min_tokens == 12
    assert len(timed) == 8  # read from the record
    split.unlink()
    monkeypatch.setattr(
        prefill_choice, "_best_ms", lambda model, tokens, forwards: {"forward": 9, "package": 10}
    )
    assert prefill_engine(model, cache_dir).runner.compiled_prefill.min_tokens == 33
    split.unlink()
    fixed = prefill_engine(model, cache_dir, compile_prefill_min_tokens=8)
    assert fixed.runner.compiled_prefill.min_tokens == 8 and not split.exists()


def test_a_first_start_builds_the_prefill_package_first_and_splits_when_both_are_in(
    cache_dir, tmp_path, monkeypatch
) -> None:
    """On a first start (`compile: auto`, builds in the background) the prefill package is
    built before the forward's, which takes only the steps too short for it. Until the
    forward's arrives the prefill package takes every step from its plan's start (6 tokens)
    and nothing is timed; when it arrives the split is timed (faked: tests do not time
    things) and moves the prefill package's start, and both serve the eager tokens."""
    from sessionserve.replicas import prefill_choice

    model = model_for("llama")
    built = prefill_engine(model, cache_dir).runner  # real packages, built once
    packages = {
        "prefill package": built.compiled_prefill.package,
        "forward": built.compiled.package,
    }
    order: list[str] = []
    forward_started, release_forward = threading.Event(), threading.Event()

    def build(model, plan):
        order.append(plan.role)
        if plan.role == "forward":
            forward_started.set()
            assert release_forward.wait(60)
        shutil.copy(packages[plan.role], plan.package)

    timed: list[int] = []

    def faster_from_12(model, tokens, forwards):
        timed.append(tokens)
        return {"forward": 10.0, "package": 9.0 if tokens >= 12 else 11.0}

    monkeypatch.setattr(compiled_forward, "AUTO_MIN_PARAMS", 0)
    monkeypatch.setattr(compiled_forward, "build_in_subprocess", build)
    monkeypatch.setattr(prefill_choice, "_best_ms", faster_from_12)
    engine = tiny_engine(
        model,
        compile="auto",
        compile_decode=False,
        compile_prefill=True,
        prefill=PREFILL_CHUNK,
        compile_cache_dir=str(tmp_path),
    )
    greedy = SamplingParams(max_tokens=8, temperature=0)
    inputs = prompts(model.config.vocab_size)
    want = tiny_engine(model).generate(inputs, greedy)  # eager
    assert forward_started.wait(60)  # the prefill package is in, the forward's building
    runner = engine.runner
    assert order == ["prefill package", "forward"]
    assert runner.compiled is None and runner.compiled_prefill.min_tokens == 6 and not timed
    steps, packaged = step_sizes(runner, runner.compiled_prefill)
    meanwhile = engine.generate(inputs, greedy)
    assert [s for s in steps if s >= 6] == packaged and packaged  # from 6 tokens on
    release_forward.set()
    runner.compiling.join(60)
    assert runner.compiled is not None and timed == [4, 5, 6, 8, 12, 16, 24, 32]
    assert runner.compiled_prefill.min_tokens == 12
    after = engine.generate(inputs, greedy)
    engine.check_memory()
    for got in (meanwhile, after):
        assert [o.output_ids for o in got] == [o.output_ids for o in want]


def _counting(loads: list):
    real = compiled_forward.CompiledForward

    def load(package, *args):
        loads.append(package)
        return real(package, *args)

    return load


def test_the_timing_runs_a_real_prefill_through_both_forwards(cache_dir) -> None:
    """What `prefill_choice.measure` times is a prefill: over its scratch pool the package's
    last-row logits are transformers' own for those tokens (what it returns is only timings,
    not asserted: tests do not time things)."""
    from sessionserve.replicas import prefill_choice

    model = model_for("llama")
    package = prefill_engine(model, cache_dir).runner.compiled_prefill
    seen = []

    def run(ids, positions, logit_idx, meta):
        logits, features = package.run(ids, positions, logit_idx, meta)
        seen.append((ids.clone(), logits))
        return logits, features

    ours = tiny_engine(model).runner.model  # with our paged attention installed, as served
    timing = prefill_choice.measure(ours, run, [48])
    assert timing.tokens == [48] and len(seen) == prefill_choice.ROUNDS + 1
    ids, logits = seen[-1]
    with torch.inference_mode():
        want = model(ids[None]).logits[0, -1:]  # transformers' own attention
    torch.testing.assert_close(logits, want, atol=LOGPROB_ATOL, rtol=0)


def test_plan_prefill_compile_resolves_the_config(cache_dir) -> None:
    model = model_for("llama")
    forward = compiled_forward.plan_compile(True, model, 32, cache_dir)
    plan = compiled_forward.plan_prefill_compile(True, forward, model, 576, 64)
    assert (plan.enabled, plan.min_tokens, plan.max_tokens) == (True, 33, 576)  # at most 33
    plan = compiled_forward.plan_prefill_compile(True, forward, model, 576, 8)
    assert (plan.enabled, plan.min_tokens, plan.max_tokens) == (True, 8, 576)
    assert (plan.example_tokens, plan.autotune, plan.only_if_faster) == (256, False, False)
    assert plan.package != forward.package and plan.package.parent == forward.package.parent
    assert compiled_forward.plan_prefill_compile("auto", forward, model, 576, 8).enabled is False
    assert compiled_forward.plan_prefill_compile(False, forward, model, 576, 8).enabled is False
    assert compiled_forward.plan_prefill_compile(True, forward, model, 32, 8).enabled is False
    off = compiled_forward.plan_compile(False, model, 32, cache_dir)
    assert compiled_forward.plan_prefill_compile(True, off, model, 576, 8).enabled is False
    # a CUDA plan (package None: torch.compile) runs every step size itself
    jit = compiled_forward.CompilePlan(True, "test", None, 256)
    assert compiled_forward.plan_prefill_compile(True, jit, model, 576, 8).enabled is False
    meta = tiny_model().to("meta")  # auto compiles on CPU and CUDA only
    assert "not measured" in compiled_forward.plan_compile("auto", meta, 32, cache_dir).reason


def bf16_attention_reference(model):
    """`model` (bf16) as transformers runs it with its layers in fp32 (its weights and
    embeddings widened exactly) and each attention on q/k/v rounded to bf16, the rounded K
    of each layer kept: what a prefill package computing in fp32 stands for."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    keys: dict[int, torch.Tensor] = {}

    def attention(module, q, k, v, mask, **kw):
        keys[module.layer_idx] = k.bfloat16()
        out, weights = sdpa_attention_forward(
            module, q.bfloat16(), k.bfloat16(), v.bfloat16(), mask, **kw
        )
        return out.to(q.dtype), weights

    AttentionInterface.register("test_bf16_attention", attention)
    AttentionMaskInterface.register("test_bf16_attention", sdpa_mask)
    reference = copy.deepcopy(model).float()
    reference.set_attn_implementation("test_bf16_attention")
    return reference, keys


def test_a_bf16_prefill_package_computing_in_fp32_is_the_fp32_layers_with_bf16_attention(
    cache_dir,
) -> None:
    """`compile_prefill_dtype: float32` for a bf16 model (Gemma 3: sliding windows, scaled
    embeddings): the package's layers run in fp32 and its attention on q/k/v rounded to bf16
    (the pool's dtype), so a 48-token prefill's logits and the K it writes are transformers'
    layers in fp32 with bf16 attention (`bf16_attention_reference`): every logit within one
    bf16 rounding and at most 5% of them not equal, where the bf16 model's own logits differ
    from that on more than half (what a package computing in bf16 would show)."""
    from sessionserve.cache import KVPool, KVShape
    from sessionserve.replicas.attention import sliding_windows
    from sessionserve.replicas.attention.base import ForwardMeta, SeqSpec
    from sessionserve.replicas.attention.torch_backend import TorchPagedBackend

    model = tiny_model("gemma3", seed=4, sliding_window=12).to(torch.bfloat16)
    engine = prefill_engine(model, cache_dir, compile_prefill_dtype="float32")
    package = engine.runner.compiled_prefill
    tokens = 48
    pool = KVPool(KVShape.from_hf_config(model.config), tokens + 1, torch.bfloat16)
    backend = TorchPagedBackend(tokens, sliding_windows(model.config))
    slots = torch.arange(1, tokens + 1)
    meta = ForwardMeta(
        backend, pool, slots, backend.prepare([SeqSpec(tokens, slots)], torch.device("cpu"))
    )
    ids = torch.randint(3, model.config.vocab_size, (tokens,), generator=torch.Generator())
    positions = torch.arange(tokens)
    with torch.inference_mode():
        logits, _ = package.run(ids, positions, positions[-1:], meta)
        reference, keys = bf16_attention_reference(model)
        hidden = reference.get_decoder()(ids[None]).last_hidden_state[0, -1:]
        want = model.get_output_embeddings()(hidden.bfloat16())
        bf16 = model(ids[None]).logits[0, -1:]
    assert logits.dtype == torch.bfloat16
    torch.testing.assert_close(logits, want, rtol=2**-7, atol=2**-7)
    assert (logits != want).float().mean() <= 0.05
    assert (bf16 != want).float().mean() > 0.5  # the comparison tells the dtypes apart
    for layer, k in keys.items():
        stored = pool.layer_kv(layer)[0][slots]  # [T, KVH, D]
        assert (stored != k[0].transpose(0, 1)).float().mean() <= 0.05
        torch.testing.assert_close(stored, k[0].transpose(0, 1), rtol=2**-7, atol=2**-7)


def test_an_engine_serves_through_a_prefill_package_computing_in_fp32(cache_dir) -> None:
    """Served through the fp32-computing prefill package (Gemma 3's layout, bf16), greedy
    answers are the eager bf16 engine's up to a near tie (where they part, the eager engine's
    top two logprobs lie within 0.1), its long steps ran the package, and session turns and
    seeded samples go through under the strict memory check."""
    model = tiny_model("gemma3", seed=4, sliding_window=12).to(torch.bfloat16)
    compiled = prefill_engine(model, cache_dir, compile_prefill_dtype="float32")
    steps, packaged = step_sizes(compiled.runner, compiled.runner.compiled_prefill)
    eager = tiny_engine(model, prefill=PREFILL_CHUNK)
    greedy = SamplingParams(max_tokens=16, temperature=0, logprobs=True, top_logprobs=2)
    inputs = prompts(model.config.vocab_size)
    for got, want in zip(
        compiled.generate(inputs, greedy), eager.generate(inputs, greedy), strict=True
    ):
        for ours, theirs, lp in zip(got.output_ids, want.output_ids, want.logprobs, strict=False):
            if ours != theirs:
                (_, first), (_, second) = lp.top[:2]
                assert first - second < 0.1, (got.output_ids, want.output_ids)
                break
    assert any(n > 32 for n in packaged)
    compiled.check_memory()
    g = torch.Generator().manual_seed(9)
    turns = [
        torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist() for n in (60, 40)
    ]
    answers = session_turns(compiled, turns, SamplingParams(max_tokens=10, temperature=0.8, seed=5))
    assert all(1 <= len(a[0]) <= 10 for a in answers) and answers[-1][1] > 0


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "flashinfer"])
def test_compiled_forward_replayed_in_cuda_graphs_on_cuda(backend, cache_dir) -> None:
    """On a GPU, `compile: true` installs the torch.compile forward (JitForward), which the
    decode and extend graphs capture: greedy answers over batches and session turns equal the
    eager graphs' tie-aware in bf16 (fused kernels sum in another order; the bounds of the
    SmolLM2-shaped default-config test), with every-step memory checks."""
    if backend == "flashinfer":
        pytest.importorskip("flashinfer")
    from tests.unit.replicas.test_loader_and_backends import assert_tie_aware_equal

    model = tiny_model(hidden_size=256, num_attention_heads=4).to("cuda", torch.bfloat16)
    inputs = [[5 + (7 * i) % 200 for i in range(n)] for n in (3, 20, 41, 70)]
    p = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, top_logprobs=2)
    outs, engines = {}, {}
    for name, compiled in (("eager", False), ("compiled", True)):
        engine = tiny_engine(
            model,
            page_size=16,
            backend=backend,
            device="cuda",
            compile=compiled,
            compile_cache_dir=cache_dir,
        )
        outs[name] = engine.generate(inputs, p)
        sid = engine.open_session()
        first = engine.generate([inputs[1]], p, session_id=sid)[0]
        outs[name] += [first, engine.generate([[9, 10, 11]], p, session_id=sid)[0]]
        engine.close_session(sid)
        engine.check_memory()
        engines[name] = engine
    runner = engines["compiled"].runner
    assert runner.compiled is not None and runner.graphs.replays > 0
    assert runner.extend_graphs.replays > 0
    decode = runner.graphs.graphs.values()
    assert decode and all(g.graph is not None and g.compiled is runner.compiled for g in decode)
    assert all(g.compiled is runner.compiled for g in runner.extend_graphs.graphs.values())
    assert assert_tie_aware_equal(outs["eager"], outs["compiled"], 0.5, 0.25) > 100
