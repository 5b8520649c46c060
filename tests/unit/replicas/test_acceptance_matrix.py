"""The reference acceptance matrix (streaming-sessions.md s.6.1) on six configurations, two of
them with EAGLE speculative decoding (drafts allocated, verified, rejected, trimmed every step).

Every engine checks memory every step (busy invariant after every step, idle invariant when
drained); every scenario ends with all sessions closed and every KV slot and row free.
"""

from __future__ import annotations

import pytest

from sessionserve.errors import ContextTooLongError, SessionBusyError
from sessionserve.wire import FinishReason, SamplingParams
from tests.models import mimic_drafter, tiny_engine, tiny_model

CONFIGS = {
    "plain": {"page_size": 16},
    "retract-small-chunks": {"page_size": 16, "retract_every": 3, "prefill": 16},
    "large-page": {"page_size": 64, "num_slots": 64 * 64},
    "tiny-pool": {"page_size": 4, "num_slots": 4 * 96, "max_rows": 8, "max_context_len": 320},
    "spec-page1": {"page_size": 1, "drafter": mimic_drafter},
    "spec-retract-tiny-pool": {
        "page_size": 4,
        "num_slots": 4 * 110,
        "max_rows": 8,
        "max_context_len": 320,
        "retract_every": 4,
        "prefill": 16,
        "drafter": mimic_drafter,
    },
}
# what each configuration is there to exercise; asserted after its run so it cannot go quiet
EXERCISES = {
    "retract-small-chunks": ["retractions"],
    "tiny-pool": ["evictions"],
    "spec-page1": ["accepted_drafts", "rejected_drafts"],
    "spec-retract-tiny-pool": ["accepted_drafts", "rejected_drafts", "retractions", "evictions"],
}
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(params=list(CONFIGS), scope="module")
def engine(request):
    cfg = CONFIGS[request.param]
    model = tiny_model(num_hidden_layers=1) if "drafter" in cfg else tiny_model()
    eng = tiny_engine(model, **cfg)
    yield eng
    spec = eng.spec_stats
    counters = {
        "retractions": eng.scheduler.retractions_total,
        "evictions": eng.cache.evicted_sessions_total,
        "accepted_drafts": spec.accepted,
        "rejected_drafts": spec.drafted - spec.accepted,
    }
    for what in EXERCISES.get(request.param, []):
        assert counters[what] > 0, counters
    for sid in list(eng.cache.session_slots):
        eng.close_session(sid)
    eng.cache.flush()
    terms = eng.checker.check_idle()
    assert terms.free == terms.total and terms.rows_free == terms.rows_total, terms


def _ids(seed: int, n: int) -> list[int]:
    return [2 + (seed * 37 + j * 11) % 250 for j in range(n)]


def _drain_and_check(engine) -> None:
    engine.run_until_idle()
    engine.checker.check_idle()


def test_s1_kv_cache_inheritance(engine) -> None:
    sid = engine.open_session()
    prev, held = None, 0
    for turn in range(3):
        (r,) = engine.generate([_ids(turn, 20)], GREEDY, session_id=sid)
        if prev is None:
            assert r.cached_tokens == 0
        else:  # exactly what the last turn committed and parked
            assert r.cached_tokens == held
            assert r.prompt_tokens == prev.prompt_tokens + prev.completion_tokens + 20
        held = len(engine.cache.session(sid).kv_tokens)  # KV the session keeps
        # all but the last answer token (never fed back), or all of it when a verify
        # overshot past max_tokens and the KV of that token was computed and kept
        full = r.prompt_tokens + r.completion_tokens
        assert held == full - 1 or (held == full and engine.speculative is not None)
        prev = r
    assert engine.close_session(sid)
    _drain_and_check(engine)


@pytest.mark.parametrize("logprobs", [False, True])
def test_s2_concurrent_sessions_with_logprobs(engine, logprobs: bool) -> None:
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=logprobs, ignore_eos=True)
    sids = [engine.open_session() for _ in range(4)]
    for turn in range(3):
        rids = [
            engine.submit(_ids(turn * 4 + i, 10), params, session_id=s) for i, s in enumerate(sids)
        ]
        engine.run_until_idle()
        for rid in rids:
            r = engine.take_result(rid)
            assert r.finish_reason is FinishReason.LENGTH
            assert len(r.logprobs) == (6 if logprobs else 0)
    for s in sids:
        engine.close_session(s)
    _drain_and_check(engine)


def test_s3_stress_sessions_with_plain_traffic(engine) -> None:
    sids = [engine.open_session() for _ in range(4)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for turn in range(3):
        rids = [engine.submit(_ids(turn + i, 40), params, session_id=s) for i, s in enumerate(sids)]
        rids += [engine.submit(_ids(100 + turn * 2 + j, 50), params) for j in range(2)]
        engine.run_until_idle()
        assert all(engine.take_result(r).completion_tokens == 8 for r in rids)
    for s in sids:
        engine.close_session(s)
    results = engine.generate([_ids(200 + i, 30) for i in range(3)], params)
    assert all(r.completion_tokens == 8 for r in results)
    _drain_and_check(engine)


def test_s4_nth_mid_abort_recovery(engine) -> None:
    sid = engine.open_session()
    (t1,) = engine.generate([_ids(1, 16)], GREEDY, session_id=sid)
    long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    rid = engine.submit(_ids(2, 8), long, session_id=sid)
    for _ in range(6):
        engine.step()
    with pytest.raises(SessionBusyError):
        engine.submit(_ids(9, 3), GREEDY, session_id=sid)  # refused, changes nothing
    assert engine.abort(rid, "client disconnected")
    assert engine.take_result(rid).finish_reason is FinishReason.ABORT
    (t3,) = engine.generate([_ids(3, 5)], GREEDY, session_id=sid)
    assert t3.prompt_tokens == t1.prompt_tokens + t1.completion_tokens + 5  # aborted turn gone
    assert t3.cached_tokens >= t1.prompt_tokens + t1.completion_tokens - 1  # KV kept
    engine.close_session(sid)
    _drain_and_check(engine)


def test_s5_first_mid_abort_recovery(engine) -> None:
    sid = engine.open_session()
    rid = engine.submit(
        _ids(4, 16), SamplingParams(max_tokens=200, temperature=0, ignore_eos=True), session_id=sid
    )
    for _ in range(5):
        engine.step()
    engine.abort(rid)
    engine.take_result(rid)
    (t2,) = engine.generate([_ids(5, 9)], GREEDY, session_id=sid)
    assert t2.prompt_tokens == 9  # no inherited context
    engine.close_session(sid)
    _drain_and_check(engine)


def test_s6_preabort_recovery(engine) -> None:
    sid = engine.open_session()
    (t1,) = engine.generate([_ids(6, 12)], GREEDY, session_id=sid)
    too_long = _ids(7, engine.config.cache.max_context_len)
    with pytest.raises(ContextTooLongError, match="maximum context length"):
        engine.submit(too_long, GREEDY, session_id=sid)
    (t3,) = engine.generate([_ids(8, 4)], GREEDY, session_id=sid)
    assert t3.prompt_tokens == t1.prompt_tokens + t1.completion_tokens + 4
    assert t3.cached_tokens > 0
    engine.close_session(sid)
    _drain_and_check(engine)


def test_abort_heavy_chunked_prefill_does_not_leak(engine) -> None:
    sids = [engine.open_session() for _ in range(4)]
    warm = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    for i, s in enumerate(sids):
        engine.generate([_ids(i, 20)], warm, session_id=s)
    limit = engine.config.cache.max_context_len
    for rnd in range(3):
        rids = [
            engine.submit(_ids(rnd * 8 + i, 30), warm, session_id=s) for i, s in enumerate(sids)
        ]
        rids += [engine.submit(_ids(50 + rnd * 2 + j, 40), warm) for j in range(2)]
        for _ in range(3):
            engine.step()
        for rid in rids[::2]:  # abort half of them wherever they are: queued, prefill, decode
            engine.abort(rid)
        engine.run_until_idle()
        for rid in rids:
            engine.take_result(rid)
        for s in sids:  # too-long turns: rejected up front, the session untouched
            with pytest.raises(ContextTooLongError):
                engine.submit(_ids(9, limit), warm, session_id=s)
        for s in sids:  # recovery turns reuse the session's KV (unless pressure evicted it)
            (r,) = engine.generate([_ids(rnd, 5)], warm, session_id=s)
            assert r.cached_tokens > 0 or engine.cache.session(s).evictions > 0
    for s in sids:
        engine.close_session(s)
    engine.generate([_ids(300 + i, 10) for i in range(3)], warm)
    _drain_and_check(engine)
