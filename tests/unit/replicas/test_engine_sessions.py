"""Session turns equal non-session requests carrying the full history (tokens exactly,
logprobs within 1e-3), and `cached_tokens` equals what the session held."""

from __future__ import annotations

import pytest

from sessionserve.cache.session_cache import MIN_BRANCH_TOKENS
from sessionserve.wire import SamplingParams
from tests.models import tiny_engine, tiny_model

GREEDY_LP = SamplingParams(
    max_tokens=10, temperature=0, logprobs=True, top_logprobs=3, ignore_eos=True
)


def _new_input(turn: int, n: int = 7) -> list[int]:
    return [3 + (turn * 17 + j * 5) % 240 for j in range(n)]


def _close(a: list, b: list, tol: float = 1e-3) -> bool:
    return all(abs(x.logprob - y.logprob) <= tol for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("page_size", [1, 16])
def test_append_turns_equal_full_history_requests(page_size: int) -> None:
    model = tiny_model()
    engine = tiny_engine(model, page_size=page_size, prefill=32)
    reference = tiny_engine(model, page_size=page_size, radix=False)
    sid = engine.open_session()
    history: list[int] = []
    previous = None
    for turn in range(4):
        new = _new_input(turn, n=7 + 9 * turn)
        (r,) = engine.generate([new], GREEDY_LP, session_id=sid)
        history += new
        (ref,) = reference.generate([history], GREEDY_LP)
        assert r.prompt_tokens == len(history) == ref.prompt_tokens
        assert r.output_ids == ref.output_ids
        assert _close(r.logprobs, ref.logprobs)
        assert [t for t, _ in r.logprobs[0].top] == [t for t, _ in ref.logprobs[0].top]
        if previous is None:
            assert r.cached_tokens == 0
        else:  # everything but the previous answer's last token (never fed back)
            assert r.cached_tokens == previous.prompt_tokens + previous.completion_tokens - 1
            assert r.cached_source == "session"
        history += r.output_ids
        held = engine.session_info(sid).held_tokens
        assert held > 0
        previous = r
    engine.close_session(sid)
    engine.checker.check_idle()


def test_chat_mode_reuses_longest_prefix_and_rewinds_on_edit() -> None:
    model = tiny_model()
    engine = tiny_engine(model, page_size=4)
    reference = tiny_engine(model, page_size=4, radix=False)
    sid = engine.open_session()
    convo = _new_input(0, 30)
    (r1,) = engine.generate([convo], GREEDY_LP, session_id=sid, mode="chat")
    convo2 = convo + r1.output_ids + _new_input(1, 30)
    (r2,) = engine.generate([convo2], GREEDY_LP, session_id=sid, mode="chat")
    assert r2.cached_tokens == len(convo) + len(r1.output_ids) - 1
    assert r2.output_ids == reference.generate([convo2], GREEDY_LP)[0].output_ids
    edited = convo2[:35] + [7, 7, 7]  # the client edited an earlier message
    (r3,) = engine.generate([edited], GREEDY_LP, session_id=sid, mode="chat")
    # the branch it left (MIN_BRANCH_TOKENS or more) went to the radix tree: its whole pages
    # before the edit are reused from there
    assert len(convo2) + len(r2.output_ids) - 35 >= MIN_BRANCH_TOKENS
    assert r3.cached_tokens == 32 and r3.cached_source == "radix"
    ref3 = reference.generate([edited], GREEDY_LP)[0]
    assert r3.output_ids == ref3.output_ids and _close(r3.logprobs, ref3.logprobs)
    back = convo2 + r2.output_ids + _new_input(2, 5)  # the client goes back to that branch
    (r4,) = engine.generate([back], GREEDY_LP, session_id=sid, mode="chat")
    assert r4.cached_tokens == 4 * ((len(convo2) + len(r2.output_ids) - 1) // 4)  # all of it
    ref4 = reference.generate([back], GREEDY_LP)[0]
    assert r4.output_ids == ref4.output_ids and _close(r4.logprobs, ref4.logprobs)
    engine.close_session(sid)
    engine.checker.check_idle()


def test_a_small_rewind_stays_in_the_session() -> None:
    """A chat turn that rewinds a few tokens (a re-rendered last answer) keeps its KV in
    the session slot, exactly, whatever the page size: nothing goes to the tree."""
    engine = tiny_engine(page_size=1)
    sid = engine.open_session()
    convo = _new_input(0, 30)
    (r1,) = engine.generate([convo], GREEDY_LP, session_id=sid, mode="chat")
    tree = engine.cache.radix.total_size()
    convo2 = convo + r1.output_ids[:-2] + _new_input(1, 6)  # two tokens rewound
    (r2,) = engine.generate([convo2], GREEDY_LP, session_id=sid, mode="chat")
    assert r2.cached_source == "session"
    assert r2.cached_tokens == len(convo) + len(r1.output_ids) - 2
    assert engine.cache.radix.total_size() == tree
    engine.close_session(sid)
    engine.checker.check_idle()


def test_seeded_sampling_in_a_session_equals_non_session() -> None:
    model = tiny_model()
    engine = tiny_engine(model)
    reference = tiny_engine(model, radix=False)
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=7)
    sid = engine.open_session()
    (r1,) = engine.generate([_new_input(0)], params, session_id=sid)
    (r2,) = engine.generate([_new_input(1)], params, session_id=sid)
    full = _new_input(0) + r1.output_ids + _new_input(1)
    assert r2.output_ids == reference.generate([full], params)[0].output_ids
    assert r2.cached_tokens == len(_new_input(0)) + len(r1.output_ids) - 1


def test_evicted_session_reprefills_from_its_token_log() -> None:
    """Under pressure an idle session's KV is evicted into the radix tree, which gives up its
    end to the big request; the next turn reuses the beginning the tree kept, re-prefills the
    rest from the token log, and still equals the full-history request."""
    model = tiny_model()
    engine = tiny_engine(model, page_size=4, num_slots=4 * 40, max_rows=8, max_context_len=150)
    reference = tiny_engine(model, radix=False)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    a = engine.open_session()
    (r1,) = engine.generate([_new_input(0, 40)], params, session_id=a)
    engine.generate([_new_input(5, 120)], params)  # a big plain request needs a's pages
    assert engine.cache.session(a).evictions == 1 and engine.session_info(a).held_tokens == 0
    (r2,) = engine.generate([_new_input(1, 5)], params, session_id=a)
    full = _new_input(0, 40) + r1.output_ids + _new_input(1, 5)
    assert r2.prompt_tokens == len(full) and r2.cached_source == "radix"
    assert 0 < r2.cached_tokens < len(_new_input(0, 40)) + len(r1.output_ids) - 4
    assert r2.output_ids == reference.generate([full], params)[0].output_ids
    engine.close_session(a)
    engine.checker.check_idle()


def test_close_is_deferred_while_a_turn_runs() -> None:
    engine = tiny_engine(tiny_model())
    sid = engine.open_session()
    rid = engine.submit(
        _new_input(0), SamplingParams(max_tokens=8, ignore_eos=True), session_id=sid
    )
    engine.step()
    assert engine.close_session(sid) is False  # deferred
    engine.run_until_idle()
    assert engine.take_result(rid).completion_tokens == 8  # the turn finished normally
    assert sid not in engine.cache.session_slots
    assert sid not in engine.sessions.records  # its clock and TTL went with its slot
    engine.cache.flush()
    terms = engine.checker.check_idle()
    assert terms.free == terms.total


def test_idle_sessions_expire_after_their_ttl(monkeypatch) -> None:
    import time as real_time

    engine = tiny_engine(tiny_model())
    sid = engine.open_session(ttl_s=5.0)
    keep = engine.open_session(ttl_s=None)
    engine.generate([_new_input(0)], SamplingParams(max_tokens=2), session_id=sid)
    now = real_time.monotonic()
    monkeypatch.setattr("time.monotonic", lambda: now + 6.0)
    engine.submit([3, 4], SamplingParams(max_tokens=1))  # any step reaps
    engine.run_until_idle()
    assert sid not in engine.cache.session_slots and keep in engine.cache.session_slots
    engine.checker.check_idle()


def test_the_ttl_a_turn_brings_is_the_one_the_replica_reaps_by(monkeypatch) -> None:
    """The directory owns a session's TTL: a served turn brings it (SessionSeed.ttl_s), and a
    changed TTL replaces the one the replica opened the session with, so the replica never
    reaps by a stale copy."""
    import time as real_time

    from sessionserve.replicas.sessions import SessionSeed

    engine = tiny_engine(tiny_model())
    sid = "s"
    short = SessionSeed(ttl_s=5.0)
    engine.generate(
        [_new_input(0)], SamplingParams(max_tokens=2), session_id=sid, open_missing=short
    )
    assert engine.session_info(sid).ttl_s == 5.0
    longer = SessionSeed(ttl_s=100.0, log_tokens=len(engine.cache.session(sid).history))
    engine.generate([[9]], SamplingParams(max_tokens=2), session_id=sid, open_missing=longer)
    assert engine.session_info(sid).ttl_s == 100.0
    now = real_time.monotonic()
    monkeypatch.setattr("time.monotonic", lambda: now + 6.0)
    engine.submit([3, 4], SamplingParams(max_tokens=1))  # any step reaps
    engine.run_until_idle()
    assert sid in engine.cache.session_slots  # 6 s idle: past the first TTL, not the second
    monkeypatch.setattr("time.monotonic", lambda: now + 101.0)
    engine.submit([3, 4], SamplingParams(max_tokens=1))
    engine.run_until_idle()
    assert sid not in engine.cache.session_slots and sid not in engine.sessions.records
    engine.checker.check_idle()


def test_a_full_replica_gives_the_least_recently_used_idle_slot_to_a_new_session() -> None:
    """Issue 13, finding 3: ids cannot pin every slot until the TTL. Served replicas (every
    turn brings its whole input) reclaim the LRU idle slot; the reclaimed session's next turn
    re-prefills and answers as before. In-process engines keep the 429."""
    from sessionserve.errors import TooManySessionsError

    model = tiny_model()
    plain = tiny_engine(model, max_sessions=2)
    for sid in ("a", "b"):
        plain.open_session(sid)
    with pytest.raises(TooManySessionsError):
        plain.open_session("c")

    engine = tiny_engine(model, max_sessions=2, reclaim_sessions_at_limit=True)
    conversation = {sid: [5 + i, 6 + i, 7 + i] for i, sid in enumerate(("a", "b"))}
    first = {}
    for sid, ids in conversation.items():  # "a" is the least recently used
        engine.open_session(sid)
        first[sid] = engine.generate([ids], GREEDY_LP, session_id=sid, mode="chat")[0]
    engine.open_session("c")  # takes a's slot
    assert set(engine.cache.session_slots) == {"b", "c"}
    assert engine.sessions.reclaimed_total == 1
    engine.checker.check_idle()
    full = conversation["a"] + first["a"].output_ids + [9]
    engine.open_session("a")  # the served replica reopens it (open_missing) and re-prefills
    again = engine.generate([full], GREEDY_LP, session_id="a", mode="chat")[0]
    reference = tiny_engine(model, radix=False).generate([full], GREEDY_LP)[0]
    assert again.output_ids == reference.output_ids
    assert set(engine.cache.session_slots) == {"a", "c"}  # b was then the LRU idle one
    busy = [engine.submit([3, 4], GREEDY_LP, session_id=sid) for sid in ("a", "c")]
    with pytest.raises(TooManySessionsError):  # every slot has a turn in flight: 429
        engine.open_session("d")
    engine.run_until_idle()
    for rid in busy:
        engine.take_result(rid)
    engine.checker.check_idle()
