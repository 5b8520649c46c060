"""Sliding-window layers' KV kept apart (cache/sliding.py): a token holds a sliding slot only
while it is in some owner's window; reuse happens only where the window is resident. FakeKV
checks that every computed token's window and every reused prefix's window hold the right
tokens' KV."""

from __future__ import annotations

import pytest
import torch

from sessionserve.cache import SlidingSlots
from sessionserve.errors import KVCacheFullError

W = 24


def tokens(n: int, seed: int = 0) -> list[int]:
    return [3 + (seed * 17 + i * 7) % 40 for i in range(n)]


def test_sliding_slots_are_given_and_taken_back_per_token() -> None:
    s = SlidingSlots(num_slots=4, full_pool_slots=32, window=W)
    s.alloc(torch.tensor([5, 6, 7]))
    assert s.available_size() == 1 and s.count(torch.arange(32)) == 3
    with pytest.raises(ValueError, match="already holds"):
        s.alloc(torch.tensor([7]))
    with pytest.raises(KVCacheFullError, match="sliding-window KV full: need 2 slots, 1 free"):
        s.alloc(torch.tensor([8, 9]))
    assert s.release(torch.tensor([6, 9])) == 1  # 9 holds none
    assert s.lookup(torch.tensor([5, 6, 7])).tolist()[1] == 0
    assert s.release_pages(torch.tensor([1]), 4) == 2  # slots 4..7
    assert s.available_size() == 4 and not s.check()


def test_longest_usable_is_the_last_page_boundary_with_its_window() -> None:
    s = SlidingSlots(num_slots=64, full_pool_slots=128, window=4)
    slots = torch.arange(10, 30)  # 20 positions
    s.alloc(slots[9:15])  # positions 9..14 resident
    # an end L works if positions L-3..L-1 are resident (or L <= 3 needs 0..L-1)
    assert s.longest_usable(slots, 4) == 12
    assert s.longest_usable(slots, 1) == 15
    assert s.longest_usable(slots[:8], 4) == 0
    assert s.resident_suffix(slots[:15]) == 6


def test_an_idle_session_keeps_its_window_and_goes_on_from_it(make_rig) -> None:
    rig = make_rig(page=16, sliding_window=W)
    rig.cache.open_session("s")
    history: list[int] = []
    for turn in range(3):
        t = rig.turn("s", f"r{turn}", history + tokens(50, turn))
        rig.drive.run_turn(t, 10)
        history = t.tokens
        idle = rig.check.check_idle()
        assert idle.sliding_held == W and idle.held >= len(history) - 1
    t = rig.turn("s", "r3", history + [7])
    assert rig.drive.admit(t) == len(history) - 1 and t.req.cached_source == "session"
    rig.cache.abort(t.req, t.tokens)
    rig.all_free()


def test_a_chat_turn_going_back_past_its_window_recomputes(make_rig) -> None:
    rig = make_rig(page=16, sliding_window=W)
    rig.cache.open_session("s")
    t = rig.turn("s", "r0", tokens(100))
    rig.drive.run_turn(t, 5)
    held = t.tokens[:-1]  # the last answer token's KV is not computed yet
    one_back = rig.turn("s", "r1", held[:-1] + [9, 9], mode="chat")
    assert rig.drive.admit(one_back) == len(held) - 1  # a rewind of one: still its window
    rig.drive.complete(one_back)
    far_back = rig.turn("s", "r2", held[:-30] + [9], mode="chat")
    assert rig.drive.admit(far_back) == 0  # its window there is gone: prefilled anew
    rig.drive.complete(far_back)
    rig.all_free()


@pytest.mark.parametrize("page", [1, 16, 256])
def test_a_finished_request_is_reused_from_the_tree_at_its_last_page(make_rig, page) -> None:
    """A plain request keeps a page more than its window: it ends in the radix tree at its last
    whole page, where the next request with its prefix goes on."""
    rig = make_rig(page=page, num_slots=max(2048, 4 * page), sliding_window=W)
    first = rig.turn(None, "a", tokens(300 + page // 2))
    rig.drive.admit(first)
    rig.drive.complete(first)
    again = rig.turn(None, "b", first.tokens + [5, 6])
    want = (len(first.tokens) - 1) // page * page  # the committed KV's whole pages
    assert rig.drive.admit(again) == want > 0 and again.req.cached_source == "radix"
    rig.drive.complete(again)
    rig.all_free()


def test_the_window_runs_out_before_the_pages_do(make_rig) -> None:
    """A sliding space for one window and a bit: an idle session is evicted to make sliding
    room, and a request that cannot get it raises KVCacheFullError, changing nothing."""
    rig = make_rig(page=4, sliding_window=W, sliding_slots=W + 20)
    rig.cache.open_session("s")
    rig.drive.run_turn(rig.turn("s", "r0", tokens(40)), 3)
    busy = rig.turn(None, "p", tokens(40, seed=3))
    rig.drive.admit(busy)
    rig.drive.prefill(busy)  # needs 40 sliding slots at once: the session's window goes
    assert rig.cache.evicted_sessions_total == 1 and not rig.cache.session("s").holds_kv
    rig.busy(busy)
    other = rig.turn(None, "q", tokens(30, seed=4))
    rig.drive.admit(other)
    before = rig.busy(busy, other)
    with pytest.raises(KVCacheFullError, match="sliding-window slots"):
        rig.drive.prefill(other)
    assert rig.busy(busy, other) == before
    for t in (busy, other):
        rig.cache.abort(t.req, t.tokens)
    rig.all_free()
