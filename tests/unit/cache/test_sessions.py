"""Session cache scenarios. Each names the reference scenario (streaming-sessions.md s.6) or the
reference bug (s.8) it covers; every one would fail on the buggy behaviour it describes."""

from __future__ import annotations

import pytest

from sessionserve.cache import RequestKV, ceil_align, floor_align
from sessionserve.errors import (
    KVCacheFullError,
    SessionBusyError,
    SessionClosingError,
    TooManySessionsError,
)


def _prompt(n: int, base: int = 3) -> list[int]:
    return [base + (i * 7) % 40 for i in range(n)]


def _snapshot(slot) -> dict:
    d = dict(vars(slot))
    d["history"], d["kv_tokens"] = list(slot.history), list(slot.kv_tokens)
    return d


@pytest.mark.parametrize("page", [1, 16, 256])
def test_s1_kv_inheritance_and_radix_after_close(make_rig, page: int) -> None:
    r = make_rig(page=page)
    r.cache.open_session("s")
    p1 = _prompt(300)
    t1 = r.turn("s", "t1", p1)
    r.drive.run_turn(t1, 12)
    assert t1.req.cached_len == 0
    history = t1.tokens
    for k in (2, 3):
        t = r.turn("s", f"t{k}", history + _prompt(5, base=k))
        cached = r.drive.admit(t)
        # the last sampled token was never fed back: it is recomputed in this turn's extend
        assert cached == len(history) - 1 and t.req.cached_source == "session"
        r.drive.prefill(t)
        r.busy(t)
        r.drive.sample(t)
        r.drive.decode(t)
        r.cache.finish(t.req, t.tokens)
        r.check.check_idle()
        history = t.tokens
    assert r.cache.session("s").history == history
    assert r.cache.close_session("s")
    # after close, turn 1's prompt is still shared through the radix tree (page-aligned)
    again = r.turn(None, "plain", p1)
    assert r.drive.admit(again) == floor_align(len(p1) - 1, page)
    r.cache.abort(again.req, again.tokens)
    r.all_free()
    after_flush = r.turn(None, "plain2", p1)
    assert r.drive.admit(after_flush) == 0
    r.cache.abort(after_flush.req)
    r.all_free()


def test_bug1_rejected_concurrent_turn_changes_nothing(make_rig) -> None:
    """Ref s.8.1: a rejected second turn cleared the running turn's in-flight mark and, on the
    first-turn variant, nuked the real slot."""
    r = make_rig(page=4)
    r.cache.open_session("s")
    t1 = r.turn("s", "t1", _prompt(20))
    r.drive.admit(t1)
    with pytest.raises(SessionBusyError, match="already has a turn in flight"):
        r.cache.start_turn("s", "intruder")  # first-turn variant: no slot KV yet
    r.drive.complete(t1)
    t2 = r.turn("s", "t2", t1.tokens + [9, 9])
    r.drive.admit(t2)
    before = _snapshot(r.cache.session("s"))
    with pytest.raises(SessionBusyError):
        r.cache.start_turn("s", "intruder2")
    forged = RequestKV(rid="intruder2", session_id="s")  # even a forged record cannot end it
    with pytest.raises(SessionBusyError):
        r.cache.abort(forged)
    assert _snapshot(r.cache.session("s")) == before
    with pytest.raises(SessionBusyError):  # the mark is still set: a third turn is refused too
        r.cache.start_turn("s", "third")
    r.drive.prefill(t2)
    r.busy(t2)
    r.drive.sample(t2)
    r.cache.finish(t2.req, t2.tokens)
    assert r.cache.session("s").history == t2.tokens
    r.all_free()


def test_bug2_abort_while_queued_ends_turn_and_deferred_close_completes(make_rig) -> None:
    """Ref s.8.2: a queued abort never finalised the turn; the deferred close looped forever."""
    r = make_rig(page=4)
    r.cache.open_session("s")
    queued = r.turn("s", "q", _prompt(10))
    assert r.cache.close_session("s") is False  # deferred: the turn is in flight
    with pytest.raises(SessionClosingError):
        r.cache.start_turn("s", "late")
    r.cache.abort(queued.req)
    assert "s" not in r.cache.session_slots  # the close completed when the turn ended
    r.cache.open_session("s2")
    q2 = r.turn("s2", "q2", _prompt(10))
    r.cache.abort(q2.req)
    t = r.turn("s2", "next", _prompt(10))  # the turn ended: the next one is accepted
    r.drive.run_turn(t, 3)
    r.all_free()


@pytest.mark.parametrize("page", [1, 16])
def test_bug3_retract_parks_kv_without_moving_checkpoint(make_rig, page: int) -> None:
    """Ref s.8.3 (and #22862's tail leak): retract made the partial turn the checkpoint and
    cleared the in-flight mark; the retried turn leaked a stale tail."""
    r = make_rig(page=page)
    r.cache.open_session("s")
    t1 = r.turn("s", "t1", _prompt(37))
    r.drive.run_turn(t1, 6)
    history = list(t1.tokens)
    t2 = r.turn("s", "t2", history + _prompt(9, base=5))
    r.drive.admit(t2)
    r.drive.prefill(t2)  # committed == len(tokens): a retry's key is one shorter (stale tail)
    r.cache.retract(t2.req, t2.tokens)
    slot = r.cache.session("s")
    assert slot.history == history and slot.committed_len == len(t2.tokens)
    r.check.check_idle()
    with pytest.raises(SessionBusyError):
        r.cache.start_turn("s", "sneak")  # the turn is still in flight
    assert r.drive.admit(t2) == len(t2.tokens) - 1  # retried turn reuses the parked KV
    r.busy(t2)
    r.drive.prefill(t2)
    r.drive.sample(t2)
    r.drive.decode(t2)
    r.cache.retract(t2.req, t2.tokens)  # again, mid-decode
    r.drive.admit(t2)
    r.drive.decode(t2)
    r.cache.finish(t2.req, t2.tokens)
    assert r.cache.session("s").history == t2.tokens
    r.check.check_idle()
    r.all_free()


def test_bug3_abort_of_retracted_turn_rolls_back_to_checkpoint(make_rig) -> None:
    r = make_rig(page=16)
    r.cache.open_session("s")
    t1 = r.turn("s", "t1", _prompt(50))
    r.drive.run_turn(t1, 4)
    t2 = r.turn("s", "t2", t1.tokens + _prompt(30, base=9))
    r.drive.admit(t2)
    r.drive.prefill(t2)
    r.drive.sample(t2)
    r.cache.retract(t2.req, t2.tokens)
    r.cache.abort(t2.req)  # aborted while queued after the retract
    slot = r.cache.session("s")
    # the aborted turn computed the checkpoint's last token: that KV is valid and kept
    assert slot.kv_tokens == t1.tokens and slot.turn_rid is None
    t3 = r.turn("s", "t3", t1.tokens + [4, 4])
    assert r.drive.admit(t3) == len(t1.tokens)
    r.cache.abort(t3.req, t3.tokens)
    r.all_free()


@pytest.mark.parametrize("page", [1, 4, 64])
def test_s4_nth_mid_abort_keeps_committed_checkpoint(make_rig, page: int) -> None:
    """Ref S4 / s.8.4: abort mid-decode (client disconnect) keeps the last successful turn."""
    r = make_rig(page=page)
    r.cache.open_session("s")
    t1 = r.turn("s", "t1", _prompt(70))
    r.drive.run_turn(t1, 16)
    t2 = r.turn("s", "t2", t1.tokens + _prompt(11, base=8))
    r.drive.admit(t2)
    r.drive.prefill(t2, chunk=5)
    r.drive.prefill(t2)
    r.drive.sample(t2)
    for _ in range(9):
        r.drive.decode(t2)
    r.busy(t2)
    r.cache.abort(t2.req, t2.tokens)
    r.check.check_idle()
    slot = r.cache.session("s")
    assert slot.history == t1.tokens and slot.turn_rid is None
    t3 = r.turn("s", "t3", t1.tokens + [5, 6, 7])
    # the aborted context is gone; everything of the checkpoint is reused (its last token
    # too: the aborted turn's extend computed it)
    assert r.drive.admit(t3) == len(t1.tokens)
    r.drive.complete(t3)
    r.all_free()


def test_s5_first_mid_abort_leaves_session_usable_and_prompt_shareable(make_rig) -> None:
    r = make_rig(page=4)
    r.cache.open_session("s")
    p1 = _prompt(41)
    t1 = r.turn("s", "t1", p1)
    r.drive.admit(t1)
    r.drive.prefill(t1)
    r.drive.sample(t1)
    r.drive.decode(t1)
    r.cache.abort(t1.req, t1.tokens)
    slot = r.cache.session("s")
    assert slot.history == [] and not slot.holds_kv and slot.turn_rid is None
    r.check.check_idle()
    retry = r.turn("s", "retry", p1)  # the computed prompt went to the radix tree
    assert r.drive.admit(retry) == floor_align(len(p1) - 1, 4)
    assert retry.req.cached_source == "radix"
    r.drive.complete(retry)
    r.all_free()


def test_s6_preabort_detaches_and_preserves_slot(make_rig) -> None:
    """Ref S6 and unit test_preabort_detaches_session_and_preserves_slot."""
    r = make_rig(page=16)
    r.cache.open_session("s")
    t1 = r.turn("s", "t1", _prompt(48))
    r.drive.run_turn(t1, 5)
    before = _snapshot(r.cache.session("s"))
    bad = r.turn("s", "too-long", t1.tokens + [1] * 10)
    r.cache.abort(bad.req)  # rejected by validation before it was matched
    after = _snapshot(r.cache.session("s"))
    before.pop("turn_rid"), before.pop("last_used"), after.pop("turn_rid"), after.pop("last_used")
    assert after == before
    t3 = r.turn("s", "t3", t1.tokens + [2])
    assert r.drive.admit(t3) == len(t1.tokens) - 1
    r.cache.abort(t3.req, t3.tokens)
    r.all_free()


def test_speculative_overshoot_is_trimmed_from_tokens_and_kv(make_rig) -> None:
    """Ref unit test_trim_overshoot_postcondition and #22897: prompt 26, finished at 12 output
    tokens while speculation committed past it."""
    r = make_rig(page=1)
    r.cache.open_session("s")
    t = r.turn("s", "t1", _prompt(26))
    r.drive.admit(t)
    r.drive.prefill(t)
    r.drive.sample(t)
    while len(t.tokens) < 26 + 14:
        r.drive.spec_step(t, k=4, accept=4)
        r.busy(t)
    assert t.req.committed_len > 38
    r.drive.spec_step(t, k=4, accept=1)
    r.cache.allocate(t.req, t.req.committed_len + 5)  # the next round's drafts, then it stops
    final = t.tokens[:38]
    r.cache.finish(t.req, final)
    slot = r.cache.session("s")
    assert slot.allocated_len == slot.committed_len == 38 and slot.kv_tokens == final
    assert slot.history == final
    terms = r.check.check_idle()
    assert terms.held == 38 - slot.protected_len
    t2 = r.turn("s", "t2", final + [8, 9])
    assert r.drive.admit(t2) == 38
    r.cache.abort(t2.req, t2.tokens)
    r.all_free()


def test_abort_mid_verify_frees_drafts(make_rig) -> None:
    r = make_rig(page=4)
    r.cache.open_session("s")
    t1 = r.turn("s", "t1", _prompt(30))
    r.drive.run_turn(t1, 3)
    t2 = r.turn("s", "t2", t1.tokens + [3, 4, 5])
    r.drive.admit(t2)
    r.drive.prefill(t2)
    r.drive.sample(t2)
    r.drive.spec_step(t2, k=3, accept=2)
    r.cache.allocate(t2.req, t2.req.committed_len + 4)  # drafts allocated, verify never ran
    r.busy(t2)
    r.cache.abort(t2.req, t2.tokens)
    assert r.cache.session("s").kv_tokens == t1.tokens
    r.all_free()


def test_chat_mode_rewinds_inside_held_region(make_rig) -> None:
    r = make_rig(page=4)
    r.cache.open_session("s")
    t1 = r.turn("s", "t1", _prompt(40), mode="chat")
    r.drive.run_turn(t1, 10)
    diverge = 45  # inside the answer: the client edited the assistant's reply
    edited = t1.tokens[:diverge] + [1, 2, 3, 4, 5]
    t2 = r.turn("s", "t2", edited, mode="chat")
    assert r.drive.admit(t2) == diverge and t2.req.cached_source == "session"
    r.busy(t2)
    r.drive.complete(t2)
    assert r.cache.session("s").history == t2.tokens
    r.all_free()


def test_chat_mode_divergence_below_protected_starts_fresh(make_rig) -> None:
    r = make_rig(page=4)
    r.cache.open_session("s")
    p1 = _prompt(40)
    t1 = r.turn("s", "t1", p1, mode="chat")
    r.drive.run_turn(t1, 4)
    assert r.cache.session("s").protected_len == 40  # the whole first prompt is shared
    t2 = r.turn("s", "t2", p1[:10] + [1] * 20, mode="chat")  # a different system prompt
    assert r.drive.admit(t2) == 8  # the radix tree still matches whole pages of what it can
    assert t2.req.cached_source == "radix"
    r.drive.complete(t2)
    r.all_free()


def test_append_mode_is_append_only(make_rig) -> None:
    from sessionserve.errors import AppendOnlyViolationError

    r = make_rig(page=4)
    r.cache.open_session("s")
    t1 = r.turn("s", "t1", _prompt(20))
    r.drive.run_turn(t1, 4)
    before = _snapshot(r.cache.session("s"))
    bad = r.turn("s", "t2", t1.tokens[:10] + [1] * 20)
    with pytest.raises(AppendOnlyViolationError, match="diverges from the held KV at token 10"):
        r.drive.admit(bad)
    after = _snapshot(r.cache.session("s"))
    assert {k: v for k, v in after.items() if k not in ("turn_rid", "last_used")} == {
        k: v for k, v in before.items() if k not in ("turn_rid", "last_used")
    }
    r.cache.abort(bad.req)
    r.all_free()


def test_idle_sessions_are_evicted_lru_and_reprefill(make_rig) -> None:
    """Ref s.8.5: pinned session KV exhausted the pool and deadlocked."""
    r = make_rig(page=4, num_slots=4 * 40)
    turns = {}
    for sid in ("a", "b", "c"):
        r.cache.open_session(sid)
        turns[sid] = r.turn(sid, f"{sid}1", _prompt(40, base=ord(sid)))
        r.drive.run_turn(turns[sid], 4)
    r.cache.start_turn("c", "c2")  # c has a turn in flight but is still idle KV-wise
    big = r.turn(None, "big", _prompt(100, base=1))
    r.drive.admit(big)
    r.drive.prefill(big)  # needs room: the least recently used idle session goes first
    assert not r.cache.session("a").holds_kv and r.cache.session("a").evictions == 1
    assert r.cache.session("a").history == turns["a"].tokens  # the token log is kept
    r.busy(big)
    r.cache.finish(big.req, big.tokens)
    t = r.turn("a", "a2", turns["a"].tokens + [1, 2])  # re-prefill transparently
    cached = r.drive.admit(t)
    assert t.req.cached_source in ("radix", "none") and cached <= 36
    r.drive.complete(t)
    r.cache.abort(RequestKV(rid="c2", session_id="c"))
    r.all_free()


@pytest.mark.parametrize("sliding_window", [None, 8])
def test_an_evicted_session_goes_to_the_tree_which_gives_up_its_end_first(
    make_rig, sliding_window: int | None
) -> None:
    """Eviction hands the session's whole pages to the radix tree instead of freeing them;
    the pressure that caused it takes only the pages it needs, from the end, so the returning
    turn reuses the beginning (content verified by the driver). With sliding layers kept
    apart only a prefix whose window is resident could be kept: the slot holds just its last
    window, so the turn goes on from at most what is usable, its window checked."""
    page = 4
    r = make_rig(page=page, num_slots=160, sliding_window=sliding_window)
    r.cache.open_session("a")
    a1 = r.turn("a", "a1", _prompt(40, base=5))
    r.drive.run_turn(a1, 30)  # 69 committed: 40 shared with the tree, 32 held
    slot = r.cache.session("a")
    assert (slot.committed_len, r.check.check_idle().free) == (69, 160 - 72)
    big = r.turn(None, "big", _prompt(100, base=1))
    r.drive.admit(big)
    r.drive.prefill(big)  # 100 slots, 88 free: a is evicted, then 12 more are needed
    assert slot.evictions == 1 and not slot.holds_kv
    terms = r.busy(big)
    nxt = r.turn("a", "a2", a1.tokens + [7, 8])
    if sliding_window is None:
        # 68 whole pages into the tree, the partial one (4 slots) freed, 8 more cut off the end
        assert terms.evictable == 60 and r.cache.radix.match_prefix(a1.tokens).length == 60
        assert r.drive.admit(nxt) == 60 and nxt.req.cached_source == "radix"
    else:
        cached = r.drive.admit(nxt)  # the driver checks the window it goes on from
        assert cached % page == 0 and cached <= 40
    r.drive.sample(big)
    r.cache.finish(big.req, big.tokens)
    r.drive.complete(nxt)
    r.all_free()


def test_borrowed_slot_is_never_evicted_and_full_pool_is_clean_error(make_rig) -> None:
    r = make_rig(page=4, num_slots=4 * 20)
    r.cache.open_session("a")
    a1 = r.turn("a", "a1", _prompt(30))
    r.drive.run_turn(a1, 2)
    a2 = r.turn("a", "a2", a1.tokens + [1])
    r.drive.admit(a2)
    hog = r.turn(None, "hog", _prompt(70, base=2))
    r.drive.admit(hog)
    with pytest.raises(KVCacheFullError, match="nothing left to evict"):
        r.drive.prefill(hog)
    assert r.cache.session("a").holds_kv  # the running turn's slot was not touched
    r.busy(a2, hog)
    r.cache.abort(hog.req, hog.tokens)
    r.drive.complete(a2)
    r.all_free()


def test_limits(make_rig) -> None:
    r = make_rig(page=4, max_sessions=2, max_session_tokens=20, max_held_tokens=40)
    r.cache.open_session("a")
    r.cache.open_session("b")
    with pytest.raises(TooManySessionsError, match="max_sessions"):
        r.cache.open_session("c")
    a1 = r.turn("a", "a1", _prompt(10))
    r.drive.run_turn(a1, 30)
    slot = r.cache.session("a")
    assert slot.protected_len == 8  # the first prompt is shared, not held
    assert slot.allocated_len == 28 and slot.kv_tokens == a1.tokens[:28]  # 20 held at most
    a2 = r.turn("a", "a2", a1.tokens + [1])
    assert r.drive.admit(a2) == 28
    r.drive.complete(a2)
    r.all_free()


def test_replica_held_limit_evicts_least_recently_used(make_rig) -> None:
    r = make_rig(page=4, max_held_tokens=40)
    for sid in ("a", "b", "c"):  # each holds 16 tokens of its own after its turn
        r.cache.open_session(sid)
        t = r.turn(sid, f"{sid}1", _prompt(8, base=ord(sid)))
        r.drive.run_turn(t, 17)
        assert r.check.check_idle().held <= 40
    assert [s.evictions for s in r.cache.session_slots.values()] == [1, 0, 0]
    assert r.check.check_idle().held == 32
    r.all_free()


def test_ordinary_requests_share_prefixes_through_the_radix_tree(make_rig) -> None:
    r = make_rig(page=4)
    system = _prompt(32)
    a = r.turn(None, "a", system + [1, 2, 3])
    r.drive.run_turn(a, 5)
    b = r.turn(None, "b", system + [4, 5, 6])
    assert r.drive.admit(b) == 32
    c = r.turn(None, "c", system + [7])
    assert r.drive.admit(c) == 32  # both running, prefix stored once and locked
    terms = r.busy(b, c)
    assert terms.protected == 32
    r.cache.retract(c.req, c.tokens)
    r.drive.complete(b)
    r.drive.admit(c)
    r.drive.complete(c)
    r.all_free()
    assert ceil_align(1, 4) == 4
