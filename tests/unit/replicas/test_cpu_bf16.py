"""bf16 weights and KV on the CPU, what `model.dtype: auto` picks where the CPU has native bf16
(AVX512-BF16, AMX; elsewhere bf16 is emulated, slowly, and these tests still hold). bf16 sums
depend on the batch's shape, so greedy answers are compared tie-aware (as on a GPU): tokens
equal until the reference's top two are within a margin, logprobs within a bound."""

from __future__ import annotations

import torch

from sessionserve.wire import SamplingParams
from tests.models import hf_greedy, tiny_engine, tiny_model
from tests.unit.replicas.test_loader_and_backends import assert_tie_aware_equal

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, top_logprobs=2)
PROMPTS = [[5 + (7 * i) % 200 for i in range(n)] for n in (3, 20, 41, 70)]


def _bf16_model():
    return tiny_model().to(torch.bfloat16)


def test_batched_bf16_answers_equal_one_at_a_time_and_transformers() -> None:
    model = _bf16_model()
    alone = tiny_engine(model, radix=False)
    ref = [alone.generate([p], GREEDY)[0] for p in PROMPTS]
    batched = tiny_engine(model).generate(PROMPTS, GREEDY)
    assert next(alone.runner.model.parameters()).dtype is torch.bfloat16
    assert alone.runner.kv_pool.dtype is torch.bfloat16
    assert assert_tie_aware_equal(ref, batched) >= len(PROMPTS) * GREEDY.max_tokens // 2
    for p, r in zip(PROMPTS, ref, strict=True):  # transformers' own generate, same dtype
        hf = hf_greedy(model, p, GREEDY.max_tokens)
        for i, (ours, theirs) in enumerate(zip(r.output_ids, hf, strict=True)):
            if ours != theirs:
                top = r.logprobs[i].top
                assert top[0][1] - top[1][1] < 0.1, f"differs from generate at a clear top-1 ({i})"
                break
    alone.check_memory()


def test_bf16_session_turns_equal_full_history_requests() -> None:
    model = _bf16_model()
    engine, plain = tiny_engine(model), tiny_engine(model, radix=False)
    sid = engine.open_session()
    history: list[int] = []
    compared = 0
    for turn in range(3):
        new = [3 + (turn * 17 + j * 5) % 240 for j in range(9 + 11 * turn)]
        (r,) = engine.generate([new], GREEDY, session_id=sid)
        history += new
        (ref,) = plain.generate([history], GREEDY)
        assert r.cached_tokens == (len(history) - len(new) - 1 if turn else 0)
        compared += assert_tie_aware_equal([ref], [r])
        if r.output_ids != ref.output_ids:  # a near-tie took another path: histories differ
            break
        history += r.output_ids
    assert compared >= GREEDY.max_tokens
    engine.close_session(sid)
    engine.checker.check_idle()
