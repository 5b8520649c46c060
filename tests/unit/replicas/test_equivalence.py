"""Greedy outputs equal transformers' own `generate`, token for token."""

from __future__ import annotations

import pytest

from sessionserve.wire import FinishReason, SamplingParams
from tests.models import EOS, engine_device, hf_greedy, tiny_engine, tiny_model

PROMPT_LENS = (3, 17, 40, 9, 64)


def _prompts(seed: int = 0) -> list[list[int]]:
    return [
        [2 + (seed * 31 + i * 7 + j * 13) % 250 for j in range(n)]
        for i, n in enumerate(PROMPT_LENS)
    ]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("prefill_budget", [512, 24])  # 24 forces several chunks per prompt
def test_batched_greedy_matches_generate(page_size: int, prefill_budget: int) -> None:
    model = tiny_model()
    prompts = _prompts()
    want = [hf_greedy(model, p, 24) for p in prompts]
    engine = tiny_engine(model, page_size=page_size, prefill=prefill_budget)
    results = engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0))
    for r, w in zip(results, want, strict=True):
        got = r.output_ids
        assert got == w[: len(got)], (got, w)
        if EOS in w:
            assert r.finish_reason is FinishReason.STOP and got == w[: w.index(EOS) + 1]
        else:
            assert r.finish_reason is FinishReason.LENGTH and got == w
    engine.checker.check_idle()


@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_other_architectures_match_generate(arch: str) -> None:
    model = tiny_model(arch, seed=3)
    prompts = _prompts(seed=1)[:3]
    want = [hf_greedy(model, p, 12) for p in prompts]
    engine = tiny_engine(model, page_size=4, prefill=16)
    results = engine.generate(
        prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    )
    assert [r.output_ids for r in results] == want


def test_requests_joining_mid_flight_do_not_change_outputs() -> None:
    """Continuous batching: a request admitted while others decode gets the same tokens."""
    model = tiny_model()
    prompts = _prompts()
    want = [hf_greedy(model, p, 16) for p in prompts]
    engine = tiny_engine(model, page_size=4, prefill=32)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    rids = [engine.submit(prompts[0], params)]
    for p in prompts[1:]:
        engine.step()
        engine.step()
        rids.append(engine.submit(p, params))
    engine.run_until_idle()
    assert [engine.take_result(r).output_ids for r in rids] == want


def _submit_and_step(engine, prompts, params, steps: int) -> tuple[list[str], list[bool]]:
    """Submit `prompts`, run `steps` steps: their ids, and which have sampled a token."""
    rids = [engine.submit(p, params) for p in prompts]
    for _ in range(steps):
        engine.step()
    sampled = {r.rid for r in engine.scheduler.running if r.sampled}
    return rids, [rid in sampled for rid in rids]


def test_a_burst_of_long_prompts_is_computed_one_after_another() -> None:
    """`prefill_batch_tokens` (64 on a CPU by default): prompts of 300 tokens arriving together
    start one a step, the first answering after one step instead of all after one long one;
    with no limit, the step computes all three. Either way the answers are transformers'."""
    model = tiny_model()
    prompts = [[2 + (i * 37 + j * 11) % 250 for j in range(300)] for i in range(3)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    want = [hf_greedy(model, p, 8) for p in prompts]
    if engine_device() == "cpu":  # on a GPU auto sets no limit
        assert tiny_engine(model, prefill_batch_tokens="auto").scheduler.prefill_batch_limit == 64
    for limit, first_step in ((64, [True, False, False]), (None, [True] * 3)):
        engine = tiny_engine(model, prefill=1024, prefill_batch_tokens=limit)
        assert engine.scheduler.prefill_batch_limit == limit
        rids, sampled = _submit_and_step(engine, prompts, params, 1)
        assert sampled == first_step
        if limit is not None:
            engine.step()
            assert [r.rid for r in engine.scheduler.running if r.sampled] == rids[:2]
        engine.run_until_idle()
        assert [engine.take_result(r).output_ids for r in rids] == want
        engine.checker.check_idle()


def test_short_prompts_share_a_step_until_the_limit() -> None:
    """Prompts shorter than the limit join one step until it holds the limit: 20-token prompts
    with a limit of 128 start seven in the first step (120 tokens before the seventh), then
    the rest; no limit takes all ten."""
    model = tiny_model()
    prompts = [[3 + (i * 13 + j * 7) % 250 for j in range(20)] for i in range(10)]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    for limit, started in ((128, 7), (None, 10)):
        engine = tiny_engine(model, prefill_batch_tokens=limit)
        rids, sampled = _submit_and_step(engine, prompts, params, 1)
        assert sum(sampled) == started and all(sampled[:started])
        engine.run_until_idle()
        assert all(len(engine.take_result(r).output_ids) == 4 for r in rids)
        engine.checker.check_idle()


def test_prefill_batch_tokens_is_checked_and_resolved_per_device() -> None:
    from pydantic import ValidationError

    from sessionserve.config import EngineConfig, ModelConfig, SchedulerConfig

    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        SchedulerConfig(prefill_batch_tokens=0)
    with pytest.raises(ValidationError):
        SchedulerConfig(prefill_batch_tokens="fast")
    cpu, gpu = (EngineConfig(model=ModelConfig(device=d)) for d in ("cpu", "cuda:0"))
    assert (cpu.prefill_batch_limit(), gpu.prefill_batch_limit()) == (64, None)
    pinned = EngineConfig(scheduler=SchedulerConfig(prefill_batch_tokens=300))
    assert pinned.prefill_batch_limit() == 300
