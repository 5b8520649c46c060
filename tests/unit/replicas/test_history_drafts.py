"""Drafts from the sequence's own history (n-gram lookup), alone and beside an EAGLE head:
greedy output is the plain engine's token for token, sampled output keeps the target's
distribution, sessions search their whole history, and the KV invariant holds after every step
(every engine here checks memory each step).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sessionserve.cache.request_kv import RequestKV
from sessionserve.config import SpecConfig
from sessionserve.replicas.request import Request
from sessionserve.replicas.speculative.history import continuation
from sessionserve.replicas.stopping import StopChecker
from sessionserve.wire import FinishReason, SamplingParams
from tests.models import EOS, hf_greedy, mimic_drafter, tiny_engine, tiny_model, word_tokenizer
from tests.unit.replicas.test_speculative_sampling import (
    ALPHA,
    _exact_marginals,
    chi_square_p_value,
)

GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


def _look(tokens: list[int], k: int = 4, lo: int = 2, hi: int = 4) -> list[int]:
    return continuation(np.array(tokens, dtype=np.int32), k, lo, hi).tolist()


def test_continuation_follows_the_longest_match() -> None:
    # "1 2" occurs twice, followed by 3 and by 7: a tie, which the most recent one breaks
    assert _look([1, 2, 3, 4, 1, 2, 7, 8, 9, 1, 2]) == [7, 8, 9, 1]
    # the 3-token suffix "5 1 2" is preferred to the more recent "1 2"
    assert _look([5, 1, 2, 6, 6, 1, 2, 8, 5, 1, 2]) == [6, 6, 1, 2]
    assert _look([5, 1, 2, 6, 6, 1, 2, 8, 5, 1, 2], k=2) == [6, 6]
    # a continuation running into the suffix itself stops at the end
    assert _look([3, 4, 3, 4]) == [3, 4]
    assert _look([1, 2, 3, 4]) == []  # no earlier occurrence
    assert _look([9, 1, 2, 1]) == []  # "2 1" never occurred; one token is below min_match
    assert _look([9, 1, 2, 1], lo=1) == [2, 1]
    assert _look([7]) == [] and _look([]) == []


def test_continuation_takes_what_most_occurrences_agree_on() -> None:
    # "1 2" was followed by 3 twice and by 4 once (the most recent): 3; then of the two
    # occurrences followed by 3, one went on with 5 and the most recent with 6 (a tie): 6
    assert _look([1, 2, 3, 5, 1, 2, 3, 6, 1, 2, 4, 9, 1, 2]) == [3, 6, 1, 2]
    # depth by depth among the occurrences that agreed so far: 3 (three of five), then 8 (two
    # of those three), though the most recent occurrence went on with 4 and its 3 with 5
    assert _look([1, 2, 4, 7, 1, 2, 3, 8, 1, 2, 3, 8, 1, 2, 3, 5, 1, 2, 4, 9, 1, 2], k=2) == [3, 8]
    # a longer suffix still wins over a more frequent shorter one
    assert _look([5, 1, 2, 6, 1, 2, 3, 1, 2, 3, 5, 1, 2]) == [6, 1, 2, 3]


def _loops(model, n: int = 6) -> list[list[int]]:
    """Prompts whose greedy answers on this random model repeat themselves (checked)."""
    gen = torch.Generator().manual_seed(4)
    return [torch.randint(5, 250, (12 + 7 * i,), generator=gen).tolist() for i in range(n)]


@pytest.mark.parametrize(("page_size", "overlap"), [(1, False), (16, False), (16, True)])
def test_history_drafts_alone_equal_generate(page_size: int, overlap: bool) -> None:
    model = tiny_model(num_hidden_layers=1, seed=3)
    prompts = _loops(model)
    engine = tiny_engine(
        model, history_drafts=True, page_size=page_size, prefill=24, overlap=overlap
    )
    assert engine.speculative.eagle is None and not engine.speculative.wants_hidden
    results = engine.generate(prompts, GREEDY)
    for prompt, r in zip(prompts, results, strict=True):
        assert r.output_ids == hf_greedy(model, prompt, GREEDY.max_tokens)
    stats = engine.spec_stats
    assert 0 < stats.accepted < stats.drafted, stats  # kept and rejected drafts
    assert stats.histogram.get(5, 0) > 0  # whole chains kept (the answers loop)
    assert stats.steps < sum(r.completion_tokens for r in results) - len(results)
    engine.cache.flush()
    terms = engine.checker.check_idle()
    assert terms.free == terms.total and terms.rows_free == terms.rows_total


def test_a_session_turn_drafts_from_an_earlier_turn() -> None:
    """The second turn asks for what the first turn's answer holds: drafts come from the
    session's history (not the new input), and the answer equals a plain engine's; max_tokens
    and a stop token landing inside accepted runs end exactly, with a forced retraction."""
    model = tiny_model(num_hidden_layers=1, seed=3)
    engine = tiny_engine(model, history_drafts=True, retract_every=4, page_size=1)
    plain = tiny_engine(model, radix=False)
    sid = engine.open_session()
    first = _loops(model, 1)[0]
    (r1,) = engine.generate([first], GREEDY, session_id=sid)
    history = first + r1.output_ids
    before = engine.spec_stats.accepted
    # the new input repeats the start of the first answer: its continuation is in history
    new = r1.output_ids[:3]
    for turn in range(3):
        params = GREEDY
        if turn == 1:
            params = SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)
        if turn == 2:  # stop at a token the plain answer reaches after a few steps
            (probe,) = plain.generate([history + new], GREEDY)
            stop = probe.output_ids[-1]  # the answer loops: it ends inside a repeated run
            params = SamplingParams(max_tokens=40, temperature=0, stop_token_ids=(stop,))
        (ref,) = plain.generate([history + new], params)
        kept = len(engine.cache.session(sid).kv_tokens)  # all but the last answer token
        (r,) = engine.generate([new], params, session_id=sid)
        assert r.output_ids == ref.output_ids and r.finish_reason == ref.finish_reason
        assert r.cached_tokens == kept >= len(history) - 1
        if params is GREEDY:  # the long answer: it loops back into the first one
            assert r.spec_accepted > 0
        history += new + r.output_ids
    assert engine.spec_stats.accepted > before
    assert r.finish_reason is FinishReason.STOP
    assert engine.scheduler.retractions_total > 0
    engine.close_session(sid)
    engine.cache.flush()
    terms = engine.checker.check_idle()
    assert terms.free == terms.total and terms.rows_free == terms.rows_total


def test_history_and_eagle_drafts_together_equal_generate() -> None:
    model = tiny_model(num_hidden_layers=1, seed=3)
    prompts = _loops(model, 4)
    engine = tiny_engine(model, drafter=lambda m: mimic_drafter(m, noise=0.3), history_drafts=True)
    results = engine.generate(prompts, GREEDY)
    for prompt, r in zip(prompts, results, strict=True):
        assert r.output_ids == hf_greedy(model, prompt, GREEDY.max_tokens)
    by_source = engine.speculative.by_source
    assert set(by_source) == {"eagle", "history"}, by_source  # each won some steps
    assert all(s.steps > 0 for s in by_source.values())
    assert engine.spec_stats.steps == sum(s.steps for s in by_source.values())


def test_sampled_history_drafts_keep_the_target_distribution() -> None:
    """Point-mass proposals through rejection sampling: each of the first three tokens is
    distributed as the target's exact marginal (chi-square, alpha 0.01)."""
    vocab, runs = 12, 2_400
    model = tiny_model(num_hidden_layers=1, seed=11, vocab_size=vocab, init_std=0.2)
    engine = tiny_engine(model, history_drafts=True, history_min_match=1, num_drafts=3)
    prompt = [3, 7, 2, 9, 4, 3, 7, 2, 0, 1, 5, 6, 8, 10, 11, 3]
    counts = torch.zeros(3, vocab)
    for batch in range(runs // 48):
        params = [
            SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True, seed=i)
            for i in range(batch * 48, (batch + 1) * 48)
        ]
        rids = [engine.submit(prompt, p) for p in params]
        engine.run_until_idle()
        for rid in rids:
            for pos, tok in enumerate(engine.take_result(rid).output_ids):
                counts[pos, tok] += 1
    stats = engine.spec_stats
    assert 0 < stats.accepted < stats.drafted
    for pos, exact in enumerate(_exact_marginals(model, prompt, 1.0)):
        p_value = chi_square_p_value(counts[pos], exact)
        assert p_value > ALPHA, (pos, p_value, counts[pos], exact)


def test_penalties_and_grammars_never_draft_from_history() -> None:
    model = tiny_model(num_hidden_layers=1, seed=3)
    engine = tiny_engine(model, history_drafts=True)
    prompt = _loops(model, 1)[0]
    params = SamplingParams(max_tokens=20, temperature=0, repetition_penalty=1.3)
    (r,) = engine.generate([prompt], params)
    (ref,) = tiny_engine(model).generate([prompt], params)
    assert r.output_ids == ref.output_ids and r.spec_steps == 0


def test_the_match_range_is_checked() -> None:
    with pytest.raises(ValueError, match="history_min_match"):
        SpecConfig(history_drafts=True, history_min_match=4, history_max_match=3)


def test_a_stop_string_before_an_eos_in_one_verified_run_ends_the_answer_there() -> None:
    """A verify emits several tokens at once: the earliest end among them wins, as if they
    had come one at a time (a stop string completed before an EOS or max_tokens in the
    same run ends the answer at the stop string, and the other way round)."""
    tok = word_tokenizer()

    def checked(run: list[int], **params) -> Request:
        req = Request("r", [5, 6], SamplingParams(**params), RequestKV(rid="r"))
        req.eos_token_ids = frozenset({EOS})
        checker = StopChecker(tok, 1024)
        req.output_ids += [7, 8]
        assert not checker.check(req)
        req.output_ids += run
        assert checker.check(req)
        return req

    req = checked([9, 10, EOS, 12], max_tokens=20, stop=("w9 w10",))
    assert (req.finish_reason, req.finished_len) == (FinishReason.STOP, 4)
    req = checked([9, EOS, 10, 12], max_tokens=20, stop=("w9 w10",))
    assert (req.finish_reason, req.finished_len) == (FinishReason.STOP, 4)  # the EOS
    req = checked([9, 10, 11, 12], max_tokens=3, stop=("w10",))
    assert (req.finish_reason, req.finished_len) == (FinishReason.LENGTH, 3)
    req = checked([9, 10, 11, 12], max_tokens=4, stop=("w10",))
    assert (req.finish_reason, req.finished_len) == (FinishReason.STOP, 4)  # both: the string


def test_stop_strings_inside_accepted_history_runs_equal_plain_decoding() -> None:
    model = tiny_model(num_hidden_layers=1, seed=3)
    engine = tiny_engine(model, history_drafts=True)
    plain = tiny_engine(model)
    for prompt in _loops(model, 3):
        (probe,) = plain.generate([prompt], GREEDY)
        words = probe.text.split()
        stop = f"{words[-3]} {words[-2]}"  # the answer loops: first met inside a run
        params = SamplingParams(max_tokens=40, temperature=0, stop=(stop,))
        (r,), (ref,) = engine.generate([prompt], params), plain.generate([prompt], params)
        assert r.output_ids == ref.output_ids and r.text == ref.text
        assert r.finish_reason == ref.finish_reason == FinishReason.STOP
    assert engine.spec_stats.accepted > 0
