"""Sliding-window attention (Gemma 3, Mistral): each layer attends as transformers' own layer
does, its window from the model's config. Greedy tokens equal `transformers.generate` and each
sampled token's logprob equals the one transformers' forward gives it (within 1e-4, fp32),
for prompts several windows long, paged at 1 and 16, prefilled whole or in chunks shorter than
the window, plain, as session turns, and on the padded static plans CUDA graphs replay."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma2Config, Gemma2ForCausalLM

from sessionserve.errors import InvalidConfigError
from sessionserve.replicas.attention import flashinfer_unsupported, sliding_windows
from sessionserve.replicas.attention.base import SeqSpec
from sessionserve.replicas.attention.torch_backend import TorchPagedBackend, context_mask
from sessionserve.replicas.cuda_graphs import DecodeGraphs, ExtendGraphs
from sessionserve.wire import FinishReason, SamplingParams
from tests.models import GEMMA3_SHAPE, hf_greedy, mimic_drafter, tiny_engine, tiny_model

WINDOW = GEMMA3_SHAPE["sliding_window"]
PROMPT_LENS = (3, 5 * WINDOW, 9, 3 * WINDOW + 5, WINDOW)  # below, at and past the window
GREEDY = SamplingParams(max_tokens=2 * WINDOW, temperature=0, ignore_eos=True, logprobs=True)


def prompts(seed: int = 0) -> list[list[int]]:
    return [
        [2 + (seed * 31 + i * 7 + j * 13) % 250 for j in range(n)]
        for i, n in enumerate(PROMPT_LENS)
    ]


def hf_logprobs(model, ids: list[int], n_new: int) -> list[float]:
    """What transformers' forward gives each of the last `n_new` tokens of `ids`."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    start = len(ids) - n_new
    return [lp[p - 1, ids[p]].item() for p in range(start, len(ids))]


def assert_like_transformers(model, prompt: list[int], result) -> None:
    want = hf_greedy(model, prompt, len(result.output_ids))
    assert result.output_ids == want
    ref = hf_logprobs(model, prompt + result.output_ids, len(result.output_ids))
    got = [lp.logprob for lp in result.logprobs]
    assert max(abs(a - b) for a, b in zip(got, ref, strict=True)) < 1e-4, (got, ref)


@pytest.fixture(scope="module")
def gemma3():
    return tiny_model("gemma3", seed=1)


def test_the_windows_come_from_the_config(gemma3) -> None:
    assert sliding_windows(gemma3.config) == (WINDOW,)
    assert sliding_windows(tiny_model("llama").config) == ()
    assert sliding_windows(tiny_model("qwen2").config) == ()  # use_sliding_window is off
    assert sliding_windows(tiny_model("mistral", sliding_window=6).config) == (6,)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("prefill", [512, WINDOW - 3])  # whole, or chunks below the window
def test_gemma3_matches_transformers_past_the_window(gemma3, page_size, prefill) -> None:
    engine = tiny_engine(gemma3, page_size=page_size, prefill=prefill)
    batch = prompts()
    for prompt, result in zip(batch, engine.generate(batch, GREEDY), strict=True):
        assert_like_transformers(gemma3, prompt, result)
    engine.checker.check_idle()


def test_mistral_sliding_window_matches_transformers() -> None:
    model = tiny_model("mistral", seed=3, sliding_window=6)
    engine = tiny_engine(model, page_size=4, prefill=16)
    batch = prompts(seed=2)[:4]
    for prompt, result in zip(batch, engine.generate(batch, GREEDY), strict=True):
        assert_like_transformers(model, prompt, result)


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_session_longer_than_the_window_equals_full_history(gemma3, page_size) -> None:
    """Four append turns: each equals a stateless request over the whole history (and
    transformers on it), reusing the session's KV."""
    engine = tiny_engine(gemma3, page_size=page_size, prefill=WINDOW + 3)
    sid = engine.open_session()
    history: list[int] = []
    for turn in range(4):
        new = [3 + (turn * 17 + j * 5) % 240 for j in range(WINDOW + 7 * turn)]
        (r,) = engine.generate([new], GREEDY, session_id=sid)
        history += new
        assert r.prompt_tokens == len(history)
        assert r.cached_tokens == (0 if turn == 0 else len(history) - len(new) - 1)
        assert_like_transformers(gemma3, history, r)
        history += r.output_ids
    assert len(history) > 6 * WINDOW
    engine.close_session(sid)
    engine.checker.check_idle()


def test_the_static_plans_give_the_eager_tokens(gemma3) -> None:
    """The padded plans CUDA graphs replay (decode and short extends), run eagerly here."""
    results = {}
    for static in (False, True):
        engine = tiny_engine(gemma3, page_size=4, prefill=16)
        if static:
            runner = engine.runner
            runner.graphs = DecodeGraphs(runner, (1, 2, 4, 8), capture=False)
            runner.extend_graphs = ExtendGraphs(runner, runner.backend, 64, capture=False)
        batch = prompts(seed=4)
        results[static] = engine.generate(batch, GREEDY)  # decode batches
        results[static] += [engine.generate([x], GREEDY)[0] for x in batch]  # one at a time
        if static:
            assert engine.runner.graphs.replays > 10 and engine.runner.extend_graphs.replays > 0
    for eager, static in zip(results[False], results[True], strict=True):
        assert static.output_ids == eager.output_ids
        for a, b in zip(eager.logprobs, static.logprobs, strict=True):
            assert abs(a.logprob - b.logprob) < 1e-4
    assert_like_transformers(gemma3, prompts(seed=4)[1], results[True][1])


def test_the_window_mask_keeps_the_last_w_positions() -> None:
    # two new tokens at positions 8 and 9 of a 10-token context, window 3
    mask = context_mask(torch.tensor([10]), 2, 12, window=3)[0]
    assert [c for c in range(12) if mask[0, c]] == [6, 7, 8]
    assert [c for c in range(12) if mask[1, c]] == [7, 8, 9]
    backend = TorchPagedBackend(windows=(3,))
    (g,) = backend.static_decode(2, 8, torch.device("cpu"))
    backend.fill_decode([g], [SeqSpec(1, torch.arange(16, 21))])
    assert g.mask[:, 0, 0].sum(-1).tolist() == [5, 1]
    slots, mask = g.windowed[3]  # the sliding layers read the last 3 positions only
    assert slots.tolist() == [[18, 19, 20], [0, 0, 0]]
    assert mask[:, 0, 0].tolist() == [[True] * 3, [True, False, False]]  # padding: slot 0


def test_flashinfer_is_not_chosen_for_a_sliding_window_model() -> None:
    why = flashinfer_unsupported(torch.device("cuda"), torch.bfloat16, 64, (512,))
    assert why is not None and "sliding window" in why


def test_a_model_with_attention_soft_capping_is_refused_at_load() -> None:
    cfg = Gemma2Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        sliding_window=8,
    )
    assert cfg.attn_logit_softcapping is not None  # Gemma 2 soft-caps attention logits
    with pytest.raises(InvalidConfigError, match="soft-caps"):
        tiny_engine(Gemma2ForCausalLM(cfg).eval())


# ---- the reference system's SWA session scenarios, on the tiny Gemma 3 ----
def test_retraction_with_a_large_page_mid_chunked_prefill_stays_exact(gemma3) -> None:
    """A 64-token page (8 windows), prefill chunks below the window and a retraction every
    third step: each retracted request re-prefills past the window and still equals
    transformers."""
    engine = tiny_engine(gemma3, page_size=64, num_slots=64 * 64, prefill=5, retract_every=3)
    batch = prompts(seed=5)
    for prompt, result in zip(batch, engine.generate(batch, GREEDY), strict=True):
        assert_like_transformers(gemma3, prompt, result)
    assert engine.scheduler.retractions_total > 0
    terms = engine.checker.check_idle()
    assert terms.in_flight == 0


def test_an_aborted_turn_leaks_nothing_and_the_session_continues_exactly(gemma3) -> None:
    engine = tiny_engine(gemma3, page_size=16, prefill=WINDOW - 3)
    sid = engine.open_session()
    first = [3 + (j * 7) % 240 for j in range(3 * WINDOW)]
    (r1,) = engine.generate([first], GREEDY, session_id=sid)
    rid = engine.submit([9, 10, 11], GREEDY, session_id=sid)  # aborted mid-decode
    for _ in range(4):
        engine.step()
    assert engine.abort(rid)
    engine.run_until_idle()
    engine.checker.check_idle()  # nothing of the aborted turn is held past its session
    history = first + r1.output_ids
    new = [12, 13, 14, 15]
    (r3,) = engine.generate([new], GREEDY, session_id=sid)  # from the last good turn
    assert r3.prompt_tokens == len(history) + len(new)
    assert_like_transformers(gemma3, history + new, r3)
    engine.close_session(sid)
    engine.checker.check_idle()


# ---- the sliding layers' KV kept apart: the last window only ----
def test_an_idle_session_holds_only_its_window_in_the_sliding_layers(gemma3) -> None:
    """The same turns with the sliding KV kept apart and kept whole: the same tokens; apart,
    the idle session holds every token in the full layer and its last window in the sliding
    ones, and a turn reads nothing else of them."""
    runs = {}
    for apart in (True, False):
        engine = tiny_engine(gemma3, page_size=4, prefill=WINDOW + 3, sliding_window_kv=apart)
        sid = engine.open_session()
        out, held = [], []
        for turn in range(3):
            new = [3 + (turn * 11 + j * 7) % 240 for j in range(2 * WINDOW + turn)]
            (r,) = engine.generate([new], GREEDY, session_id=sid)
            out.append(r.output_ids)
            terms = engine.checker.check_idle()
            # kept whole, the first prompt is shared into the radix tree (protected)
            held.append((terms.held + terms.protected, terms.sliding_held, terms.sliding_total))
        runs[apart] = (out, held)
        engine.close_session(sid)
        engine.cache.flush()
        terms = engine.checker.check_idle()
        assert terms.free == terms.total and terms.sliding_free == terms.sliding_total
    assert runs[True][0] == runs[False][0]
    for apart, whole in zip(runs[True][1], runs[False][1], strict=True):
        (full_held, sliding_held, _), (whole_held, nothing, total) = apart, whole
        assert full_held == whole_held > 2 * WINDOW and sliding_held == WINDOW
        assert nothing == total == 0  # kept whole: no sliding slots at all
    assert runs[True][1][-1][0] > 9 * WINDOW  # the last idle session: nine windows long


def test_a_small_sliding_space_evicts_and_retracts_and_stays_exact(gemma3) -> None:
    """Sliding slots for little more than two requests' windows and chunks: idle sessions
    lose their KV and running requests are retracted for sliding room, not for full slots,
    and every answer still equals transformers."""
    engine = tiny_engine(gemma3, page_size=4, prefill=WINDOW, sliding_slots=3 * WINDOW + 6)
    sids = [engine.open_session() for _ in range(3)]
    for sid, prompt in zip(sids, prompts(seed=7)[1:4], strict=True):
        (r,) = engine.generate([prompt], GREEDY, session_id=sid)
        assert_like_transformers(gemma3, prompt, r)
    assert engine.cache.evicted_sessions_total > 0  # sliding room, the full space is large
    batch = prompts(seed=8)
    for prompt, result in zip(batch, engine.generate(batch, GREEDY), strict=True):
        assert_like_transformers(gemma3, prompt, result)
    assert engine.scheduler.retractions_total > 0
    terms = engine.checker.check_idle()
    assert terms.free + terms.held + terms.evictable == terms.total


@pytest.mark.parametrize("page_size", [1, 16])
def test_speculation_past_the_window_stops_exactly_and_trims_both_spaces(page_size) -> None:
    """A one-layer Mistral (every layer slides over 6 tokens) with an EAGLE head that mimics
    it: greedy output equals transformers; a max_tokens that ends inside an accepted run
    stops exactly there, its overshoot trimmed in the full and the sliding slots alike."""
    model = tiny_model("mistral", seed=3, num_hidden_layers=1, sliding_window=6)
    spec = tiny_engine(model, drafter=mimic_drafter, page_size=page_size, prefill=5)
    inside = None
    for prompt in prompts(seed=1):  # one with a verify past the window that accepts 2+
        events = []
        spec.submit(prompt, GREEDY, listener=events.append)
        spec.run_until_idle()
        full = [t for e in events for t in e.new_token_ids]
        assert full == hf_greedy(model, prompt, len(full))
        done = 0
        for e in events:  # an output index inside a verify that emitted 3+ tokens at once
            if len(e.new_token_ids) >= 3 and len(prompt) + done > 6:
                inside = done + 1
                break
            done += len(e.new_token_ids)
        if inside is not None:
            break
    assert inside is not None, "no verify past the window accepted two drafts"
    params = SamplingParams(max_tokens=inside + 1, temperature=0, ignore_eos=True)
    sid = spec.open_session()
    (r,) = spec.generate([prompt], params, session_id=sid)
    assert r.output_ids == full[: inside + 1] and r.finish_reason is FinishReason.LENGTH
    slot = spec.cache.session(sid)
    # the verify computed KV past the answer's end (the rest of its accepted run): trimmed
    assert slot.committed_len == len(prompt) + len(r.output_ids) == len(slot.history)
    terms = spec.checker.check_idle()
    assert terms.sliding_held == spec.cache.allocator.sliding.keep  # trimmed: the window only
    spec.close_session(sid)
    spec.cache.flush()
    terms = spec.checker.check_idle()
    assert terms.free == terms.total and terms.sliding_free == terms.sliding_total


def test_a_parked_and_a_moved_session_carry_their_window(gemma3) -> None:
    """Parked in the host tier, or exported to another engine, a session past the window
    takes its full layer's KV and its sliding layers' window along, and its next turn equals
    transformers on the whole history, reusing it all."""
    source = tiny_engine(gemma3, page_size=4, prefill=WINDOW + 3, host_tier_bytes=1 << 20)
    target = tiny_engine(gemma3, page_size=16, prefill=WINDOW + 3)
    source.open_session("s", ttl_s=60)
    history: list[int] = []
    for turn, how in enumerate(("parked", "moved", "resident")):
        new = [5 + (turn * 13 + j * 3) % 240 for j in range(3 * WINDOW)]
        engine = target if how == "resident" else source
        (r,) = engine.generate([new], GREEDY, session_id="s")
        history += new
        assert r.cached_tokens == (len(history) - len(new) - 1 if turn else 0)
        assert_like_transformers(gemma3, history, r)
        history += r.output_ids
        if how == "parked":
            assert source.park_session("s")
            snap = source.cache.host_tier.get("s")
            assert len(snap) == len(history) - 1 and snap.sliding_from == len(snap) - WINDOW
            assert snap.sliding_kv[0].shape[2] == WINDOW  # the window only
        elif how == "moved":
            assert target.import_session(source.export_session("s")) == "pool"
            source.close_session("s")
    assert r.cached_source == "session"
    target.close_session("s")
    for e in (source, target):
        terms = e.checker.check_idle()
        assert terms.host_bytes == 0 and terms.held == 0 and terms.sliding_held == 0
