"""The EAGLE head's step compiled ahead of time (speculative/compiled_head.py): with
`engine.compile` on a CPU the head's chain steps and catch-up run from packages built and
cached as the target's are, its outputs, draft logits and the K/V it writes equal the eager
head's within fp32 fusion error, and greedy answers stay transformers' token for token. Real
builds (a one-layer head: tens of seconds each on 2 cores), into a directory this module shares.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sessionserve.replicas import block_linear, cpu_linear, gguf_int4
from sessionserve.replicas.attention import ForwardMeta, SeqSpec
from sessionserve.replicas.compiled_forward import CompilePlan, start_compile
from sessionserve.replicas.speculative.checkpoint import load_drafter
from sessionserve.replicas.speculative.compiled_head import (
    HeadStep,
    head_compile_jobs,
    head_linears,
)
from sessionserve.wire import SamplingParams
from tests.models import hf_greedy, mimic_drafter, tiny_engine, tiny_model
from tests.unit.replicas.test_eagle3 import target as eagle3_target
from tests.unit.replicas.test_eagle3 import write_published_head

pytestmark = pytest.mark.slow  # real package builds (25-60 s each)
GREEDY = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
ATOL = 1e-4  # fp32: the package's fused kernels sum in another order than eager torch


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("compiled-head"))


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(5, vocab, (n,), generator=g).tolist() for n in (6, 19, 45)]


def _count_runs(proposer) -> dict[int, int]:
    """Count each installed package's calls, by input width."""
    calls = dict.fromkeys(proposer.compiled, 0)
    for width, compiled in proposer.compiled.items():
        inner = compiled.run

        def counted(*args, _w=width, _inner=inner):
            calls[_w] += 1
            return _inner(*args)

        compiled.run = counted
    return calls


def _count_eager(proposer) -> list[int]:
    """The token counts of the head's eager forwards."""
    tokens: list[int] = []
    inner = proposer.drafter.features

    def counted(ids, *args, **kwargs):
        tokens.append(ids.shape[-1])
        return inner(ids, *args, **kwargs)

    proposer.drafter.features = counted
    return tokens


def _same_step(proposer, width: int, tokens: int, seed: int) -> None:
    """One head step through the package and eagerly, from the same inputs into the same
    fresh slots: outputs, draft logits and the K/V written agree within ATOL."""
    g = torch.Generator().manual_seed(seed)
    vocab = proposer.drafter.config.vocab_size
    ids = torch.randint(5, vocab, (tokens,), generator=g)
    hidden = torch.randn(tokens, width, generator=g)
    positions = torch.arange(tokens)
    slots = torch.arange(100, 100 + tokens)
    rows = torch.tensor([0, tokens - 1])

    def meta() -> ForwardMeta:
        plan = proposer.backend.prepare([SeqSpec(tokens, slots)], torch.device("cpu"))
        return ForwardMeta(proposer.backend, proposer.pool, slots, plan)

    with torch.inference_mode():
        step = HeadStep(proposer.drafter, width)
        eager_out = proposer.drafter.features(
            ids[None], hidden[None], positions[None], paged_meta=meta()
        )[0]
        eager_logits = step.drafter.draft_logits(eager_out[rows])
        eager_kv = proposer.pool.k[0][slots].clone()
        logits, out = proposer.compiled[width].run(ids, hidden, positions, rows, meta())
    assert torch.allclose(out, eager_out, atol=ATOL), (out - eager_out).abs().max()
    assert torch.allclose(logits, eager_logits, atol=ATOL)
    assert torch.allclose(proposer.pool.k[0][slots], eager_kv, atol=ATOL)


def test_engine_compile_builds_the_heads_step_and_answers_stay_exact(cache_dir) -> None:
    """`engine.compile` with an EAGLE head: the target's package and the head's (one: its
    inputs, the target's last hidden state and its own output, are both h wide) are built and
    installed (their linears the few-row GEMM kernel's where it builds, cpu_linear.py); every
    chain step and catch-up (prefill chunks of 24 tokens included: the package
    takes up to compile_max_tokens, 32) runs the head's package, none eagerly; the head's
    decode rows attend over its pool in place with the target's kernel (same head layout)."""
    model = tiny_model(num_hidden_layers=1, seed=3)
    spec = tiny_engine(
        model, drafter=mimic_drafter, compile=True, compile_cache_dir=cache_dir, prefill=24
    )
    proposer = spec.speculative.eagle
    h = model.config.hidden_size
    assert set(proposer.compiled) == {h}
    assert proposer.compiled_max_tokens == spec.runner.compiled.max_tokens
    assert proposer.backend.decode_kernel is not None
    calls, eager = _count_runs(proposer), _count_eager(proposer)
    prompts = _prompts(model.config.vocab_size)
    results = spec.generate(prompts, GREEDY)
    for prompt, result in zip(prompts, results, strict=True):
        assert result.output_ids == hf_greedy(model, prompt, GREEDY.max_tokens)
    assert spec.speculative.stats.steps > 0 and calls[h] > 0 and eager == [], (calls, eager)
    assert spec.speculative.stats.mean_accept_len > 2  # the mimic head drafts the target's
    _same_step(proposer, h, tokens=7, seed=1)
    # a second engine over the same model loads the cached packages: nothing is rebuilt
    built = sorted(Path(cache_dir).glob("*.pt2"))
    again = tiny_engine(
        model, drafter=mimic_drafter, compile=True, compile_cache_dir=cache_dir, prefill=24
    )
    assert set(again.speculative.eagle.compiled) == {h}
    assert sorted(Path(cache_dir).glob("*.pt2")) == built


def test_a_catch_up_longer_than_the_package_runs_as_compiled_pieces(cache_dir) -> None:
    """A prompt of 75 tokens in one prefill chunk: with `pieces_past_package` (set in bf16,
    the test's fp32 model sets it by hand) the head's catch-up over it runs as forwards of at
    most compile_max_tokens (32, 32, 11) through the package, none eagerly, and writes the
    K/V, output and next guess one eager forward over all 75 writes (what fp32 runs)."""
    model = tiny_model(num_hidden_layers=1, seed=3)
    prompt = torch.randint(
        5, model.config.vocab_size, (75,), generator=torch.Generator().manual_seed(4)
    )
    heads = {}
    for compiled in (True, False):
        engine = tiny_engine(
            model,
            drafter=mimic_drafter,
            compile=True,
            compile_prefill=False,
            compile_cache_dir=cache_dir,
        )
        proposer = engine.speculative.eagle
        assert proposer.pieces_past_package is False  # fp32
        proposer.pieces_past_package = compiled
        calls, eager = _count_runs(proposer), _count_eager(proposer)
        rid = engine.submit(prompt.tolist(), GREEDY)
        engine.step()  # the prompt's prefill, and the head's catch-up over it
        req = next(r for r in engine.scheduler.running if r.rid == rid)
        slots = engine.cache.slots(req.kv, 0, 75)
        heads[compiled] = (proposer.pool.k[0][slots].clone(), req.draft.token, req.draft.feature)
        if compiled:
            assert sum(calls.values()) == 3 and eager == [], (calls, eager)
        else:
            assert sum(calls.values()) == 0 and eager == [75], (calls, eager)
        result = engine.generate([prompt.tolist()], GREEDY)[0]  # the same prompt, to the end
        assert result.output_ids == hf_greedy(model, prompt.tolist(), GREEDY.max_tokens)
    (k, token, feature), (eager_k, eager_token, eager_feature) = heads[True], heads[False]
    torch.testing.assert_close(k, eager_k, atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(feature, eager_feature, atol=ATOL, rtol=ATOL)
    assert token == eager_token


def test_an_eagle3_head_gets_a_package_for_each_input_width(cache_dir, tmp_path) -> None:
    """An EAGLE-3 head reads three target layers (3h) when catching up and its own output (h)
    when chaining: a package each, both used, answers still the target's. Built as
    `compile: auto` builds, in the background by build processes (the head crosses to them
    as a file, with the target's embedding it borrows)."""
    model = eagle3_target()
    head_dir = write_published_head(tmp_path / "eagle3", model, seed=1)
    spec = tiny_engine(model, drafter=lambda m: load_drafter(head_dir, m), num_drafts=3)
    proposer = spec.speculative.eagle
    h = model.config.hidden_size
    forward = CompilePlan(True, "test", Path(cache_dir) / "target.pt2", 32)
    jobs = head_compile_jobs(forward, proposer.drafter, model.config, proposer.compiled)
    assert [job.plan.role for job in jobs] == [
        f"EAGLE head ({h}-wide inputs)",
        f"EAGLE head ({3 * h}-wide inputs)",
    ]
    # where the machine builds it, the head's linears run the few-row GEMM kernel
    assert all(job.model.linears == ("packed" if cpu_linear.load() else "dense") for job in jobs)
    building = start_compile(jobs, background=True)
    assert building is not None
    building.join(timeout=600)
    proposer.compiled_max_tokens = forward.max_tokens
    assert set(proposer.compiled) == {h, 3 * h}
    calls, eager = _count_runs(proposer), _count_eager(proposer)
    prompts = _prompts(model.config.vocab_size)
    results = spec.generate(prompts, GREEDY)
    for prompt, result in zip(prompts, results, strict=True):
        assert result.output_ids == hf_greedy(model, prompt, GREEDY.max_tokens)
    # chains ran on the h-wide package, catch-ups on the 3h-wide one; only the prefill step's
    # catch-up (70 tokens: past the packages' 32) ran eagerly (fp32: one eager forward)
    assert calls[h] > 0 and calls[3 * h] > 0, calls
    assert all(n > forward.max_tokens for n in eager), eager
    _same_step(proposer, 3 * h, tokens=5, seed=2)
    _same_step(proposer, h, tokens=3, seed=3)


@pytest.mark.skipif(
    not block_linear.load(), reason=f"the block kernel cannot run here: {block_linear.why_not()}"
)
def test_a_bf16_heads_linears_run_as_eight_bit_blocks(cache_dir) -> None:
    """A bf16 head on a CPU with the block kernel: its package's linears and draft-vocabulary
    GEMM are 8-bit records of its weights. A step's outputs and logits are an eager head's
    whose weights are those records' (within bf16 rounding; the dense head's differ more),
    every chain step and catch-up runs the package, the drafts stay good (the mimic head's
    acceptance), and answers are the plain engine's, compared tie-aware in bf16."""
    from tests.unit.replicas.test_loader_and_backends import assert_tie_aware_equal

    model = tiny_model(num_hidden_layers=1, seed=3).to(torch.bfloat16)

    def bf16_head(target):
        return mimic_drafter(target).to(torch.bfloat16)

    spec = tiny_engine(
        model, drafter=bf16_head, compile=True, compile_cache_dir=cache_dir, prefill=24
    )
    proposer = spec.speculative.eagle
    h = model.config.hidden_size
    assert head_linears(proposer.drafter) == "blocks"
    assert set(proposer.compiled) == {h}
    calls, eager = _count_runs(proposer), _count_eager(proposer)
    prompts = _prompts(model.config.vocab_size)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, top_logprobs=2)
    got = spec.generate(prompts, params)
    assert calls[h] > 0 and eager == [], (calls, eager)
    assert spec.speculative.stats.mean_accept_len > 2
    plain = tiny_engine(model, compile=True, compile_cache_dir=cache_dir, prefill=24)
    assert assert_tie_aware_equal(plain.generate(prompts, params), got) > 60

    # one step against eager heads: one with the records' weights, one with the dense ones
    def records(weight: torch.Tensor) -> torch.Tensor:
        return gguf_int4.dequantized(*gguf_int4.eight_bit_blocks(weight)).bfloat16()

    blocks = bf16_head(model)
    blocks.config._attn_implementation = proposer.drafter.config._attn_implementation  # paged
    with torch.no_grad():
        for module in blocks.modules():
            if type(module) is torch.nn.Linear:
                module.weight.copy_(records(module.weight))
    head = records(proposer.drafter.head_weight())  # the target's LM head, borrowed
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(5, model.config.vocab_size, (6,), generator=g)
    hidden = torch.randn(6, h, generator=g).bfloat16()
    positions, slots, rows = torch.arange(6), torch.arange(200, 206), torch.tensor([0, 5])

    def run(step) -> tuple[torch.Tensor, torch.Tensor]:
        plan = proposer.backend.prepare([SeqSpec(6, slots)], torch.device("cpu"))
        meta = ForwardMeta(proposer.backend, proposer.pool, slots, plan)
        if step is None:
            return proposer.compiled[h].run(ids, hidden, positions, rows, meta)
        out = step.features(ids[None], hidden[None], positions[None], paged_meta=meta)[0]
        weight = head if step is blocks else step.head_weight()
        return torch.nn.functional.linear(out[rows], weight), out

    with torch.inference_mode():
        (logits, out), (ref_logits, ref_out) = run(None), run(blocks)
        dense_logits, dense_out = run(proposer.drafter)
    scale = ref_logits.float().abs().max().item()
    assert (logits.float() - ref_logits.float()).abs().max().item() < 0.03 * scale
    torch.testing.assert_close(out.float(), ref_out.float(), atol=0.05, rtol=0.05)

    def apart(a: torch.Tensor, b: torch.Tensor) -> float:
        return (a.float() - b.float()).abs().mean().item()

    # the records' rounding is about bf16's here (0.0054 against 0.0093 on the Zen 4 box):
    # a package that ran the dense weights would sit as far from the reference as they do
    assert apart(out, ref_out) < 0.75 * apart(dense_out, ref_out)
