"""Builds an engine's parts from its config: the session cache, the model runner (KV pool,
attention backend, CUDA graphs) and, with a drafter, the speculative decoder. Kept apart from
the engine so the engine reads as the step loop and its API."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from sessionserve.cache import KVPool, KVShape, SessionLimits, build_session_cache
from sessionserve.cache.allocator import floor_align
from sessionserve.cache.host_tier import HostTier
from sessionserve.cache.session_cache import SessionCache
from sessionserve.config import EngineConfig
from sessionserve.errors import InvalidConfigError
from sessionserve.replicas import prefill_choice, sampling_kernel
from sessionserve.replicas.attention import (
    AttentionBackend,
    attention_scale,
    check_supported,
    cpu_extend_kernel,
    select_backend,
    sliding_layers,
    sliding_windows,
)
from sessionserve.replicas.attention.torch_backend import TorchPagedBackend
from sessionserve.replicas.compiled_attention import HeadLayout, decode_kernel_for
from sessionserve.replicas.compiled_decode import (
    dense_step_declines,
    plan_decode_compile,
    plan_int4_decode_compile,
)
from sessionserve.replicas.compiled_forward import (
    CompiledForward,
    CompileJob,
    JitForward,
    auto_declines,
    plan_compile,
    plan_prefill_compile,
    start_compile,
)
from sessionserve.replicas.cuda_graphs import (
    DecodeGraphs,
    ExtendGraphs,
    VerifyGraphs,
    buckets_up_to,
)
from sessionserve.replicas.model_runner import ModelRunner
from sessionserve.replicas.speculative.catch_up_graphs import CatchUpGraphs
from sessionserve.replicas.speculative.chain_graphs import ChainGraphs
from sessionserve.replicas.speculative.checkpoint import load_drafter
from sessionserve.replicas.speculative.compiled_head import head_compile_jobs
from sessionserve.replicas.speculative.decoder import SpeculativeDecoder, TreeShape
from sessionserve.replicas.speculative.drafter import DraftHead
from sessionserve.replicas.speculative.history import HistoryProposer
from sessionserve.replicas.speculative.policy import SpecPolicy
from sessionserve.replicas.speculative.proposer import EagleProposer

log = logging.getLogger(__name__)


def build_cache(cfg: EngineConfig, model_config: Any = None) -> SessionCache:
    """The session cache; for a model with sliding-window layers (and
    `cache.sliding_window_kv`), with their KV kept apart for each sequence's last window."""
    c, s = cfg.cache, cfg.sessions
    windows = sliding_windows(model_config) if model_config is not None else ()
    return build_session_cache(
        num_slots=floor_align(c.num_slots, c.page_size),
        page_size=c.page_size,
        max_rows=c.max_rows,
        max_context_len=c.max_context_len,
        radix_enabled=c.radix_cache,
        limits=SessionLimits(s.max_sessions, s.max_held_tokens, s.max_session_tokens),
        sliding_window=windows[0] if windows and c.sliding_window_kv else None,
        sliding_slots=c.sliding_slots,
    )


def context_limit(cfg: EngineConfig, cache: SessionCache) -> int:
    """The most tokens one sequence may hold: the configured context, or the whole pool."""
    return min(cfg.cache.max_context_len, cache.allocator.num_slots)


def build_runner(
    cfg: EngineConfig,
    model: Any,
    cache: SessionCache,
    on_verify: Callable[[int], None],
    drafter: DraftHead | None = None,
    weights_source: str | None = None,
) -> tuple[ModelRunner, SpeculativeDecoder | None]:
    """The runner and, when a drafter is given or configured or history drafts are on, the
    speculative decoder (which reports each verify's acceptance length to `on_verify`); both KV
    pools are attached to the cache (the drafter's KV parks and moves with the target's).
    `weights_source`: the GGUF the model's weights were read from (`LoadedModel.gguf`), whose
    4-bit linears its few-row decode steps may keep (`engine.gguf_int4_decode`)."""
    if drafter is None and cfg.spec.drafter_path is not None:
        drafter = load_drafter(cfg.spec.drafter_path, model)
    runner = ModelRunner(model, *pool_and_backend(cfg, model, cache), cache)
    if runner.device.type == "cpu":  # built now, not by the first request's step
        sampling_kernel.load()
    if drafter is not None:  # before graphs are captured and the forward compiled
        runner.feature_layers = drafter.feature_layers
    if cfg.cuda_graphs and runner.device.type == "cuda":
        most = min(cfg.scheduler.max_running_requests, cfg.cuda_graph_max_batch)
        runner.graphs = DecodeGraphs(runner, buckets_up_to(most))
    speculative = build_speculative(cfg, model, cache, runner, on_verify, drafter)
    if drafter is None and runner.graphs is not None and cfg.cuda_graph_max_extend > 1:
        # short extends replay graphs too, unless a drafter needs every hidden state; over the
        # torch backend's static plan whatever the decode backend (the pool layout is shared)
        backend = runner.backend
        if not isinstance(backend, TorchPagedBackend):
            backend = TorchPagedBackend(cfg.cache.max_context_len, sliding_windows(model.config))
        runner.extend_graphs = ExtendGraphs(runner, backend, cfg.cuda_graph_max_extend)
    if speculative is not None and runner.graphs is not None:
        # verifies replay graphs over the decode backend's static rows: FlashInfer's paged
        # prefill (each row's pages read in place) or the torch backend's gather
        backend = runner.backend
        runner.verify_graphs = VerifyGraphs(
            runner, backend, runner.graphs.buckets, cfg.spec.num_drafts + 1
        )
        if speculative.eagle is not None:  # the head's chain and catch-up, greedy rows
            head_backend, eagle = TorchPagedBackend(cfg.cache.max_context_len), speculative.eagle
            eagle.chain_graphs = ChainGraphs(eagle, runner.graphs.buckets, head_backend)
            eagle.catch_up_graphs = CatchUpGraphs(
                eagle, runner.graphs.buckets, head_backend, cfg.spec.num_drafts + 1
            )
    eagle = speculative.eagle if speculative else None
    compile_forwards(cfg, model, runner, eagle, weights_source)
    if speculative is not None:  # read at each step: packages built in the background land late
        speculative.widest_step = runner.widest_compiled_step
    pools = [runner.kv_pool] + ([eagle.pool] if eagle else [])
    s = cfg.sessions
    tier = HostTier(s.host_tier_bytes, pools) if s.host_tier_bytes else None
    cache.attach_kv(pools, tier)
    return runner, speculative


def compile_forwards(
    cfg: EngineConfig,
    model: Any,
    runner: ModelRunner,
    eagle: EagleProposer | None = None,
    weights_source: str | None = None,
) -> None:
    """Install the compiled forward (`engine.compile`), the decode step package
    (`engine.compile_decode`) and its 4-bit sibling for a GGUF's few-row steps
    (`engine.gguf_int4_decode`), the prefill package (`engine.compile_prefill`) and, on CPU,
    the EAGLE head's compiled steps that the config asks for, at once or from a background
    build (the head's after the target's)."""
    plan = plan_compile(
        cfg.compile,
        model,
        compiled_max_tokens(cfg, runner),
        cfg.compile_cache_dir,
        runner.feature_layers,
    )
    if not plan.enabled:
        log.debug("compile: the forward runs eagerly (%s)", plan.reason)
        return
    if plan.package is None:  # CUDA: torch.compile, on the first steps of each shape
        runner.compiled = JitForward(model, plan.max_tokens, plan.feature_layers)
        log.info(
            "compile: steps of up to %d tokens run the forward under torch.compile, compiled "
            "on the first steps of each shape (tens of seconds; inductor caches its kernels "
            "on disk)",
            plan.max_tokens,
        )
        return
    if runner.device.type == "cpu":  # decode rows attend over the pool in place
        install_decode_kernel(runner.backend, model, runner.kv_pool, plan.package.parent)
        if eagle is not None:  # the head's chain steps and catch-ups too
            install_decode_kernel(eagle.backend, eagle.drafter, eagle.pool, plan.package.parent)
    decode, step = plan_decode_compile(cfg.compile_decode, plan, model, runner.kv_pool)
    # the 4-bit package is exported from the dense step, whether or not that one is built
    int4, int4_step = plan_int4_decode_compile(
        cfg.gguf_int4_decode, plan, decode, step, model, weights_source
    )
    prefill = plan_prefill_compile(
        cfg.compile_prefill,
        plan,
        model,
        prefill_package_max_tokens(cfg),
        cfg.prefill_package_min_tokens(next(model.parameters()).dtype),
        cfg.compile_prefill_dtype,
        # where the later tokens' logits come from the file's LM head, so do the first's
        head_gguf=int4_step.int4_source[0] if int4_step and int4_step.int4_source else None,
    )

    def settle_split() -> None:
        """Where `compile_prefill_min_tokens` is not set, the prefill package takes the steps
        from where it was timed faster than the forward's package on this machine (for
        models `compile: auto` would compile; a tiny model's timings mean nothing). Timed
        once both are installed, whichever came second; until then the prefill package
        takes every step from its plan's `min_tokens` on."""
        prefill_package, forward = runner.compiled_prefill, runner.compiled
        if (
            prefill_package is not None
            and forward is not None
            and cfg.compile_prefill_min_tokens is None
            and auto_declines(model) is None
        ):
            prefill_package.min_tokens = prefill_choice.split_point(
                model, forward, prefill_package, plan.max_tokens
            )

    def install_forward(compiled: CompiledForward) -> None:
        runner.compiled = compiled
        settle_split()

    def install_prefill(compiled: CompiledForward) -> None:
        runner.compiled_prefill = compiled
        settle_split()

    # In the order a first start gains most from (each is a build of minutes there, the
    # replica serving eagerly meanwhile): decode steps are most steps, and the fastest
    # package for them goes first; then the prefill package (first tokens); then the
    # packages that take what those leave: rows the 4-bit package declines (the dense decode
    # step's), steps too short for the prefill package (the forward's).
    first: list[CompileJob] = []
    last: list[CompileJob] = []
    int4_job = None
    if int4_step is not None:
        install_int4 = functools.partial(setattr, runner, "compiled_int4_decode")
        int4_job = CompileJob(int4, install_int4, int4_step)
        first.append(int4_job)
    else:
        log.debug("compile: no 4-bit decode step package (%s)", int4.reason)
    dense_declined = dense_step_declines(cfg.compile_decode, model)
    if step is not None and dense_declined is None:
        install_decode = functools.partial(setattr, runner, "compiled_decode")
        (last if first else first).append(CompileJob(decode, install_decode, step))
    else:
        log.debug(
            "compile: decode steps run the compiled forward (%s)", dense_declined or decode.reason
        )
    if prefill.enabled:
        first.append(CompileJob(prefill, install_prefill, model))
    else:
        log.debug("compile: longer steps run eagerly (%s)", prefill.reason)
    jobs = [*first, *last, CompileJob(plan, install_forward, model)]
    if cfg.gguf_int4_decode_only:  # batch generation: its decode steps, nothing else
        if int4_job is None:
            log.info("compile: no 4-bit decode step package (%s): every step eager", int4.reason)
        jobs = [int4_job] if int4_job is not None else []
    if eagle is not None:
        eagle.compiled_max_tokens = plan.max_tokens
        eagle.pieces_past_package = next(eagle.drafter.parameters()).dtype != torch.float32
        if not cfg.gguf_int4_decode_only:
            jobs += head_compile_jobs(plan, eagle.drafter, model.config, eagle.compiled)
    runner.compiling = start_compile(jobs, background=cfg.compile == "auto")


def install_decode_kernel(
    backend: AttentionBackend, model: Any, pool: KVPool, cache_dir: Path
) -> None:
    """Give a torch backend the in-place decode attention kernel for `model`'s head layout
    (the CPU kernel, or the compiled formula built once per layout, threads and CPU; the
    head's layout is the target's, so it shares the target's kernel)."""
    if not isinstance(backend, TorchPagedBackend):
        return
    shape = KVShape.from_hf_config(model.config)
    layout = HeadLayout(
        model.config.num_attention_heads,
        shape.num_kv_heads,
        shape.head_dim,
        str(pool.dtype),
        attention_scale(model, shape.head_dim),
    )
    backend.decode_kernel = decode_kernel_for(layout, cache_dir, next(model.parameters()).dtype)


def prefill_package_max_tokens(cfg: EngineConfig) -> int:
    """The longest step the prefill package is exported for: a full prefill chunk beside a
    decode row per request, rounded up to a power of two so that configs differing a little
    share one package (each is a build)."""
    longest = cfg.scheduler.max_prefill_tokens + cfg.scheduler.max_running_requests
    return 1 << (longest - 1).bit_length()


def compiled_max_tokens(cfg: EngineConfig, runner: ModelRunner) -> int:
    """The longest step the compiled forward runs: `engine.compile_max_tokens`, and on CUDA at
    least the largest CUDA graph's step (the graphs replay the compiled forward; on a GPU its
    GEMMs are cuBLAS's whatever the rows, so nothing is lost running larger steps through
    it)."""
    sets = (runner.graphs, runner.extend_graphs, runner.verify_graphs)
    return max([cfg.compile_max_tokens] + [g.max_tokens for g in sets if g is not None])


def build_speculative(
    cfg: EngineConfig,
    model: Any,
    cache: SessionCache,
    runner: ModelRunner,
    on_verify: Callable[[int], None],
    drafter: DraftHead | None,
) -> SpeculativeDecoder | None:
    """The speculative decoder over the EAGLE head and/or history drafts that `cfg.spec`
    asks for (None: neither)."""
    spec = cfg.spec
    if drafter is None and not spec.enabled:
        return None
    vocab = model.config.vocab_size
    eagle = history = None
    tree = tree_shape(cfg, model, drafter, runner.backend)
    if drafter is not None:
        eagle = EagleProposer(
            drafter,
            *pool_and_backend(cfg, drafter, cache),
            cache,
            spec.num_drafts,
            vocab,
            tree_topk=tree.topk if tree else 1,
            min_confidence=spec.min_draft_confidence,
        )
    if spec.history_drafts:
        history = HistoryProposer(
            spec.num_drafts, spec.history_min_match, spec.history_max_match, vocab, runner.device
        )
    policy = SpecPolicy() if spec.adaptive else None
    return SpeculativeDecoder(
        cache,
        on_verify,
        context_limit(cfg, cache),
        eagle,
        history,
        policy,
        tree=tree,
        target_pool=runner.kv_pool,
        min_confidence=spec.min_draft_confidence,
    )


def tree_shape(
    cfg: EngineConfig, model: Any, drafter: DraftHead | None, backend: AttentionBackend
) -> TreeShape | None:
    """`spec.tree_topk` > 1 as a TreeShape, or a clear error where trees cannot run."""
    spec = cfg.spec
    if spec.tree_topk == 1:
        return None
    problem = None
    if drafter is None:
        problem = "it needs an EAGLE head (spec.drafter_path)"
    elif not isinstance(backend, TorchPagedBackend):
        problem = f"the {backend.name} backend has no tree mask yet; use attention_backend: torch"
    elif sliding_windows(model.config):
        problem = "this model has sliding-window layers, which tree verification does not mask"
    if problem:
        raise InvalidConfigError(f"spec.tree_topk {spec.tree_topk}: {problem} (or tree_topk: 1)")
    return TreeShape(spec.tree_topk, spec.tree_budget)


def pool_and_backend(
    cfg: EngineConfig, model: Any, cache: SessionCache
) -> tuple[KVPool, AttentionBackend]:
    """A KV pool shaped for `model` (the target or the drafter) over the shared slots, and an
    attention backend for its head layout."""
    check_supported(model.config)
    param, shape, c = next(model.parameters()), KVShape.from_hf_config(model.config), cfg.cache
    sliding = cache.allocator.sliding
    pool = KVPool(
        shape,
        cache.allocator.pool_slots,
        dtype=c.kv_torch_dtype(param.dtype),
        device=param.device,
        sliding_layers=sliding_layers(model.config) if sliding is not None else (),
        sliding_slots=sliding.pool_slots if sliding is not None else 0,
    )
    backend = select_backend(
        cfg.attention_backend,
        param.device,
        page_size=c.page_size,
        num_heads=model.config.num_attention_heads,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        scaling=attention_scale(model, shape.head_dim),
        dtype=param.dtype,
        num_pages=cache.allocator.pool_slots // c.page_size,
        max_context_len=c.max_context_len,
        windows=sliding_windows(model.config),
    )
    if pool.dtype != param.dtype and not isinstance(backend, TorchPagedBackend):
        raise InvalidConfigError(
            f"cache.kv_dtype {c.kv_dtype} under a {param.dtype} model: the {backend.name} "
            "backend reads the KV in the model's dtype; use attention_backend: torch, or "
            "kv_dtype: auto"
        )
    if isinstance(backend, TorchPagedBackend) and param.device.type == "cpu":
        heads = model.config.num_attention_heads
        backend.extend_kernel = pool.dtype == param.dtype and cpu_extend_kernel.usable(
            shape.head_dim, heads, shape.num_kv_heads, pool.dtype
        )
    return pool, backend
