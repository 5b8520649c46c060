"""The checker catches what it must (leaks, double counts, stuck marks, broken ordering) and
bad input gets typed errors with messages that say what to change."""

from __future__ import annotations

import pytest
import torch

from sessionserve.cache import KVPool, KVShape, RequestKV, SessionLimits, build_session_cache
from sessionserve.errors import (
    DoubleFreeError,
    InvalidConfigError,
    MemoryInvariantError,
    SessionExistsError,
    UnknownSessionError,
)


def test_checker_reports_a_leak_with_every_term(make_rig) -> None:
    r = make_rig(page=4)
    r.cache.allocator.alloc_extend(None, 0, 5)  # slots nobody accounts for
    with pytest.raises(MemoryInvariantError) as err:
        r.check.check_idle()
    msg = str(err.value)
    for term in ("free=", "evictable=", "protected=", "held=", "in_flight=", "total="):
        assert term in msg
    assert "accounted" in msg and r.check.failures == 1


def test_borrowed_slot_counts_once_and_a_stuck_mark_is_caught(make_rig) -> None:
    """Ref #22213/#22753: during the borrow the slot and the turn share a row."""
    r = make_rig(page=4)
    r.cache.open_session("s")
    t1 = r.turn("s", "t1", list(range(3, 30)))
    r.drive.run_turn(t1, 3)
    held_before = r.check.check_idle().held
    t2 = r.turn("s", "t2", t1.tokens + [1, 2])
    r.drive.admit(t2)
    terms = r.busy(t2)
    assert terms.held == 0 and terms.in_flight == held_before  # moved, not doubled
    with pytest.raises(MemoryInvariantError, match="marks borrower 't2' but the live batch"):
        r.check.check_idle()  # the scheduler "forgot" the running turn: caught
    r.cache.abort(t2.req, t2.tokens)
    r.cache.session("s").borrower = "ghost"  # a stuck mark is caught, not trusted
    with pytest.raises(MemoryInvariantError, match="ghost"):
        r.check.check_idle()
    r.cache.session("s").borrower = None
    r.all_free()


def test_checker_catches_ordering_and_shared_rows(make_rig) -> None:
    r = make_rig(page=4)
    a = r.turn(None, "a", list(range(3, 20)))
    r.drive.admit(a)
    a.req.committed_len = a.req.allocated_len + 1
    with pytest.raises(MemoryInvariantError, match="protected .* <= committed"):
        r.check.check_busy([a.req])
    with pytest.raises(MemoryInvariantError, match="share a row"):
        r.check.check_busy([a.req, a.req])


def test_bad_input_gives_typed_errors(make_rig) -> None:
    r = make_rig(page=4)
    with pytest.raises(UnknownSessionError, match="'nope' does not exist"):
        r.cache.start_turn("nope", "x")
    with pytest.raises(UnknownSessionError):
        r.cache.close_session("nope")
    r.cache.open_session("s")
    with pytest.raises(SessionExistsError, match="already open"):
        r.cache.open_session("s")
    assert r.cache.close_session("s")
    with pytest.raises(UnknownSessionError):  # double close
        r.cache.close_session("s")
    req = RequestKV(rid="e")
    with pytest.raises(ValueError, match="empty input"):
        r.cache.match(req, [])
    assert req.state.value == "waiting"
    r.drive.admit(t := r.turn(None, "t", [5, 6, 7]))
    with pytest.raises(DoubleFreeError, match="match on request 't' in state live"):
        r.cache.match(t.req, [5, 6, 7])
    with pytest.raises(ValueError, match="commit to 99 outside"):
        r.cache.commit(t.req, 99)
    r.cache.abort(t.req, t.tokens)
    with pytest.raises(DoubleFreeError, match="already finished or aborted"):
        r.cache.abort(t.req, t.tokens)
    with pytest.raises(DoubleFreeError, match="finish on request 't' in state done"):
        r.cache.finish(t.req, t.tokens)
    r.all_free()


def test_parking_a_session_turn_needs_its_tokens(make_rig) -> None:
    r = make_rig(page=4)
    r.cache.open_session("s")
    t = r.turn("s", "t", list(range(3, 20)))
    r.drive.admit(t)
    r.drive.prefill(t)
    with pytest.raises(ValueError, match="pass the request's full token list"):
        r.cache.abort(t.req)  # tokens forgotten: refused before anything changes
    r.busy(t)
    r.cache.abort(t.req, t.tokens)
    r.all_free()


@pytest.mark.parametrize(
    ("kwargs", "msg"),
    [({"max_sessions": 0}, "max_sessions=0"), ({"max_held_tokens": -1}, "max_held_tokens=-1")],
)
def test_invalid_limits(kwargs: dict, msg: str) -> None:
    with pytest.raises(InvalidConfigError, match=msg):
        SessionLimits(**kwargs)


def test_invalid_cache_sizes() -> None:
    with pytest.raises(InvalidConfigError, match="page_size=3"):
        build_session_cache(num_slots=64, page_size=3, max_rows=2, max_context_len=8)
    with pytest.raises(InvalidConfigError, match="num_rows=0"):
        build_session_cache(num_slots=64, page_size=4, max_rows=0, max_context_len=8)


def test_kv_pool_shapes_and_writes() -> None:
    class Cfg:
        num_attention_heads, num_key_value_heads, hidden_size, num_hidden_layers = 4, 2, 64, 3

    shape = KVShape.from_hf_config(Cfg())
    assert shape == KVShape(num_layers=3, num_kv_heads=2, head_dim=16)
    drafter = KVShape(num_layers=1, num_kv_heads=2, head_dim=16)
    target_pool, draft_pool = KVPool(shape, 40), KVPool(drafter, 40)  # same slot indices
    assert target_pool.k.shape == (3, 40, 2, 16) and draft_pool.k.shape == (1, 40, 2, 16)
    assert shape.bytes_per_token(torch.float32) == 2 * 3 * 2 * 16 * 4
    slots = torch.tensor([4, 9])
    k, v = torch.randn(2, 2, 16), torch.randn(2, 2, 16)
    target_pool.write(1, slots, k, v)
    assert torch.equal(target_pool.k[1, slots], k) and torch.equal(target_pool.v[1, slots], v)
    assert target_pool.k[0].abs().sum() == 0
    with pytest.raises(InvalidConfigError):
        KVPool(KVShape(0, 1, 1), 4)
