"""Greedy outputs equal transformers' own `generate`, token for token."""

from __future__ import annotations

import pytest

from sessionserve.wire import FinishReason, SamplingParams
from tests.models import EOS, hf_greedy, tiny_engine, tiny_model

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
