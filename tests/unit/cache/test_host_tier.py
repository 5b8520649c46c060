"""The host tier and session export/adopt, on the cache alone (FakeKV content is verified on
every restore: a restored slot must hold exactly the KV of its own tokens)."""

from __future__ import annotations

import pytest
import torch

from sessionserve.cache import KVPool, KVShape, ceil_align, floor_align
from sessionserve.cache.host_tier import HostTier
from sessionserve.cache.kv_snapshot import KVSnapshot
from sessionserve.errors import (
    AppendOnlyViolationError,
    IncompatibleSnapshotError,
    InvalidConfigError,
    KVCacheFullError,
    SessionBusyError,
)

TOKEN_BYTES = 16  # FakeKV's pool: one layer, one head, dim 1, int64 k and v


def _prompt(n: int, base: int = 3) -> list[int]:
    return [base + (i * 7) % 40 for i in range(n)]


def _wipe_free_slots(r) -> None:
    """Forget the KV of every free slot (as a reused slot would), so only a real copy back
    can pass the content check."""
    allocated = torch.from_numpy(r.cache.allocator._page_allocated).repeat_interleave(
        r.cache.page_size
    )
    r.drive.kv.content[~allocated] = -1


def _session_turn(r, sid: str, rid: str, tokens: list[int], n: int = 5) -> list[int]:
    t = r.turn(sid, rid, tokens)
    r.drive.run_turn(t, n)
    r.check.check_idle()
    return t.tokens


@pytest.mark.parametrize("page", [1, 16, 256])
def test_parked_session_restores_from_host_not_prefill(make_rig, page: int) -> None:
    r = make_rig(page=page, host_tier_bytes=1 << 20)
    r.cache.open_session("s")
    history = _session_turn(r, "s", "t1", _prompt(300))
    assert r.cache.park("s")
    t = r.check.check_idle()
    # whole pages of the tier: the last one partly used
    assert t.host_sessions == 1 and t.host_bytes == TOKEN_BYTES * ceil_align(
        len(history) - 1, r.cache.host_tier.page_size
    )
    assert not r.cache.session("s").holds_kv
    _wipe_free_slots(r)  # what was freed is gone: only the host copy has it
    nxt = r.turn("s", "t2", history + _prompt(4, base=9))
    cached = r.drive.admit(nxt)  # verifies every restored position's content
    assert (cached, nxt.req.cached_source) == (len(history) - 1, "host")
    # the first prompt's pages the radix tree still held are shared again, not copied
    assert nxt.req.protected_len == floor_align(300, page)
    r.busy(nxt)
    assert "s" not in r.cache.host_tier and r.cache.host_tier.restored_total == 1
    r.drive.prefill(nxt)
    r.drive.sample(nxt)
    r.cache.finish(nxt.req, nxt.tokens)
    third = r.turn("s", "t3", nxt.tokens + [5])
    assert r.drive.admit(third) == len(nxt.tokens) - 1  # resident again after the restore
    r.cache.abort(third.req, third.tokens)
    r.all_free()


def test_pressure_eviction_spills_to_host_and_restore_shares_the_radix_prefix(make_rig) -> None:
    page = 16
    r = make_rig(page=page, num_slots=64 * page, host_tier_bytes=1 << 20)
    r.cache.open_session("a")
    a_hist = _session_turn(r, "a", "a1", _prompt(500))
    # a plain request needing most of the pool evicts the idle session: spilled first
    big = r.turn(None, "big", _prompt(900, base=11))
    r.drive.run_turn(big, 2)
    assert r.cache.evicted_sessions_total == 1 and "a" in r.cache.host_tier
    r.check.check_idle()
    _wipe_free_slots(r)
    nxt = r.turn("a", "a2", a_hist + [7, 8])
    assert r.drive.admit(nxt) == len(a_hist) - 1 and nxt.req.cached_source == "host"
    r.cache.abort(nxt.req, nxt.tokens)
    r.all_free()


def test_host_tier_lru_falls_back_to_reprefill(make_rig) -> None:
    r = make_rig(page=4, host_tier_bytes=TOKEN_BYTES * 150)
    hist = {}
    for sid in ("a", "b"):
        r.cache.open_session(sid)
        hist[sid] = _session_turn(r, sid, f"{sid}1", _prompt(100, base=len(sid) + ord(sid) % 5))
    assert r.cache.park("a")
    assert r.cache.park("b")  # does not fit beside a's copy: a (least recent) is dropped
    assert "a" not in r.cache.host_tier and "b" in r.cache.host_tier
    assert r.cache.host_tier.evicted_total == 1
    r.check.check_idle()
    a2 = r.turn("a", "a2", hist["a"] + [5])
    assert r.drive.admit(a2) < len(hist["a"]) - 1 and a2.req.cached_source != "host"
    r.cache.abort(a2.req, a2.tokens)
    r.all_free()


def test_a_copy_bigger_than_the_budget_is_not_kept(make_rig) -> None:
    r = make_rig(page=4, host_tier_bytes=TOKEN_BYTES * 32)  # 2 pages of 16 tokens
    r.cache.open_session("s")
    _session_turn(r, "s", "t1", _prompt(40))
    assert not r.cache.park("s")
    assert len(r.cache.host_tier) == 0 and r.cache.host_tier.evicted_total == 1
    r.check.check_idle()
    r.all_free()


def test_park_refuses_a_busy_session_and_close_drops_the_copy(make_rig) -> None:
    r = make_rig(page=4, host_tier_bytes=1 << 20)
    r.cache.open_session("s")
    hist = _session_turn(r, "s", "t1", _prompt(30))
    t = r.turn("s", "t2", hist + [4])
    with pytest.raises(SessionBusyError):
        r.cache.park("s")
    r.cache.abort(t.req, t.tokens)
    assert r.cache.park("s")
    assert r.cache.close_session("s")
    assert len(r.cache.host_tier) == 0 and r.cache.host_tier.bytes_in_use == 0
    r.all_free()


def test_append_mode_may_not_rewrite_parked_history(make_rig) -> None:
    r = make_rig(page=4, host_tier_bytes=1 << 20)
    r.cache.open_session("s")
    hist = _session_turn(r, "s", "t1", _prompt(30))
    r.cache.park("s")
    t = r.turn("s", "t2", [99] + hist[1:] + [4], mode="append")
    with pytest.raises(AppendOnlyViolationError):
        r.drive.admit(t)
    assert "s" in r.cache.host_tier  # refused before anything changed
    r.cache.abort(t.req, t.tokens)
    r.check.check_idle()
    r.all_free()


def test_chat_mode_restores_only_the_shared_prefix(make_rig) -> None:
    r = make_rig(page=4, host_tier_bytes=1 << 20)
    r.cache.open_session("s")
    hist = _session_turn(r, "s", "t1", _prompt(60))
    r.cache.park("s")
    rewound = hist[:25] + [41, 42, 43]
    t = r.turn("s", "t2", rewound, mode="chat")
    assert r.drive.admit(t) == 25 and t.req.cached_source == "host"
    r.busy(t)
    r.cache.abort(t.req, t.tokens)
    r.all_free()


def test_export_then_adopt_moves_a_session_between_caches(make_rig) -> None:
    src, dst = make_rig(page=16, host_tier_bytes=1 << 20), make_rig(page=4)
    src.cache.open_session("s")
    hist = _session_turn(src, "s", "t1", _prompt(200))
    history, snap = src.cache.export_session("s")
    assert history == hist and len(snap) == len(hist) - 1
    assert src.cache.session("s").holds_kv  # the source keeps it until the move commits
    dst.cache.open_session("s")
    assert dst.cache.adopt("s", history, snap) == "pool"
    dst.check.check_idle()
    t = dst.turn("s", "t2", hist + [6, 7])
    assert dst.drive.admit(t) == len(hist) - 1 and t.req.cached_source == "session"
    dst.cache.abort(t.req, t.tokens)
    assert src.cache.close_session("s")
    src.all_free()
    dst.all_free()


def test_a_parked_session_exports_its_host_copy(make_rig) -> None:
    src, dst = make_rig(page=4, host_tier_bytes=1 << 20), make_rig(page=4)
    src.cache.open_session("s")
    hist = _session_turn(src, "s", "t1", _prompt(50))
    src.cache.park("s")
    _, snap = src.cache.export_session("s")
    parked = src.cache.host_tier.get("s")
    assert snap.tokens == parked.tokens and snap.kv[0].shape[2] == len(parked)
    assert snap.kv[0].data_ptr() != src.cache.host_tier.arenas[0].data_ptr()  # its own copy
    dst.cache.open_session("s")
    assert dst.cache.adopt("s", hist, snap) == "pool"
    t = dst.turn("s", "t2", hist + [6])
    assert dst.drive.admit(t) == len(hist) - 1
    dst.cache.abort(t.req, t.tokens)
    src.all_free()
    dst.all_free()


def test_adopt_without_room_parks_in_the_host_tier_or_keeps_only_history(make_rig) -> None:
    src = make_rig(page=4)
    src.cache.open_session("s")
    hist = _session_turn(src, "s", "t1", _prompt(200))
    _, snap = src.cache.export_session("s")
    for tier, where in ((1 << 20, "host"), (None, "none")):
        dst = make_rig(page=4, num_slots=64, host_tier_bytes=tier)
        dst.cache.open_session("s")
        assert dst.cache.adopt("s", hist, snap) == where
        dst.check.check_idle()
        assert dst.cache.session("s").history == hist and not dst.cache.session("s").holds_kv
        dst.all_free()
    src.all_free()


def test_adopt_refuses_a_snapshot_of_another_model(make_rig) -> None:
    dst = make_rig(page=4)
    dst.cache.open_session("s")
    other = KVSnapshot([5, 6], [torch.zeros(2, 3, 2, 1, 1, dtype=torch.int64)])
    with pytest.raises(IncompatibleSnapshotError, match="different models"):
        dst.cache.adopt("s", [5, 6, 7], other)
    assert dst.cache.session("s").history == []
    dst.all_free()


def test_host_tier_budget_is_validated_and_counted() -> None:
    pool = KVPool(KVShape(1, 1, 1), 16, dtype=torch.int64)
    with pytest.raises(InvalidConfigError, match="must be >= 1"):
        HostTier(0, [pool], 2)
    with pytest.raises(InvalidConfigError, match="holds no page of 4 tokens"):
        HostTier(TOKEN_BYTES * 3, [pool], 4)
    tier = HostTier(TOKEN_BYTES * 6, [pool], 2)  # 3 pages of 2 tokens
    assert tier.num_pages == 3 and tier.page_bytes == 2 * TOKEN_BYTES
    pool.k[0, :, 0, 0] = torch.arange(16)
    pool.v[0, :, 0, 0] = -torch.arange(16)
    assert tier.park("a", torch.tensor([5, 9, 2]), [1, 2, 3], 1)
    assert tier.bytes_in_use == tier.get("a").nbytes == 2 * tier.page_bytes
    assert tier.park("a", torch.tensor([5, 9]), [1, 2], 1)  # replaced, not added
    assert tier.bytes_in_use == tier.page_bytes and len(tier.free_pages) == 2
    assert tier.park("b", torch.tensor([7, 8, 3, 4]), [3, 4, 5, 6], 1)
    assert tier.park("c", torch.tensor([1, 0]), [7, 8], 1)  # the least recent goes: "a"
    assert "a" not in tier and tier.evicted_total == 1 and tier.free_pages == []
    assert not tier.park("d", torch.arange(8), list(range(8)), 1)  # bigger than the tier
    assert "b" in tier and "c" in tier and tier.evicted_total == 2  # nothing evicted for it
    snap = tier.export("b")
    assert snap.kv[0][0, 0, :, 0, 0].tolist() == [7, 8, 3, 4]
    assert snap.kv[0][1, 0, :, 0, 0].tolist() == [-7, -8, -3, -4]
    into = torch.tensor([11, 12, 13])
    tier.restore(tier.get("b"), 1, 4, into, 1)  # positions 1-3 only
    assert pool.k[0, 11:14, 0, 0].tolist() == [8, 3, 4]
    tier.truncate("b", 1)
    assert tier.get("b").tokens == [3] and tier.bytes_in_use == 2 * tier.page_bytes
    taken = tier.take("c")
    assert "c" not in tier and len(tier.free_pages) == 1  # its pages kept while it is out
    assert tier.park("e", torch.tensor([6]), [1], 1)
    tier.put_back("c", taken)
    assert list(tier.entries) == ["b", "e", "c"] and tier.free_pages == []
    assert tier.drop("c") and tier.drop("e") and tier.drop("b") and not tier.drop("e")
    assert tier.bytes_in_use == 0 and sorted(tier.free_pages) == [0, 1, 2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_host_pages_keep_every_position_through_fragmented_pages(dtype: torch.dtype) -> None:
    """Copies whose pages are not consecutive (the free list after evictions), ragged last
    pages, and restores of any range: each position comes back as it went in."""
    shape = KVShape(3, 2, 4)
    pool = KVPool(shape, 128, dtype=dtype)  # copies from slots 0-63, restores into 64-127
    pool.k.copy_(torch.randn(pool.k.shape).to(dtype))
    pool.v.copy_(torch.randn(pool.v.shape).to(dtype))
    tier = HostTier(16 * shape.bytes_per_token(dtype), [pool], 4)  # 4 pages of 4 tokens
    gen = torch.Generator().manual_seed(0)
    held: dict[str, torch.Tensor] = {}
    for i, n in enumerate([3, 5, 2, 7, 9, 1, 4]):
        slots = torch.randperm(64, generator=gen)[:n]
        assert tier.park(f"s{i}", slots, list(range(n)), 1)
        held[f"s{i}"] = slots
        for sid in list(held):
            if sid not in tier:
                del held[sid]
        for sid, slots in held.items():
            snap = tier.export(sid)
            assert torch.equal(snap.kv[0][0], pool.k[:, slots])
            assert torch.equal(snap.kv[0][1], pool.v[:, slots])
    sid, slots = next(iter(held.items()))
    n = slots.numel()
    for start in range(n):
        into = torch.arange(64, 64 + n - start)
        pool.k[:, 64:] = 0
        tier.restore(tier.get(sid), start, n, into, 1)
        assert torch.equal(pool.k[:, into], pool.k[:, slots[start:]])
        assert torch.equal(pool.v[:, into], pool.v[:, slots[start:]])


def test_an_aborted_turn_parked_by_pressure_leaves_only_the_checkpoint(make_rig) -> None:
    """A retracted turn's KV sits in the slot; evicted then, it is parked with the session's.
    The turn's abort must cut the parked copy back to the checkpoint (found by the state
    machine: the next append turn was refused as rewriting history)."""
    r = make_rig(page=4, host_tier_bytes=1 << 20)
    r.cache.open_session("s")
    hist = _session_turn(r, "s", "t1", _prompt(30))
    t = r.turn("s", "t2", hist + [4, 5, 6])
    r.drive.admit(t)
    r.drive.prefill(t)
    r.cache.retract(t.req, t.tokens)
    r.cache.make_room(r.cache.allocator.num_slots)  # pressure: everything idle is evicted
    assert len(r.cache.host_tier.get("s")) == len(hist) + 3
    r.cache.abort(t.req, t.tokens)
    assert r.cache.host_tier.get("s").tokens == hist
    r.check.check_idle()
    t3 = r.turn("s", "t3", hist + [9])
    assert r.drive.admit(t3) == len(hist) and t3.req.cached_source == "host"
    r.cache.abort(t3.req, t3.tokens)
    r.all_free()


def test_a_restore_without_room_waits_with_the_copy_kept(make_rig) -> None:
    """No room to copy the parked KV back: the admission fails as any admission without room
    does (the scheduler retries it), keeping the copy, instead of re-prefilling it."""
    r = make_rig(page=4, num_slots=256, host_tier_bytes=1 << 20)
    r.cache.open_session("s")
    hist = _session_turn(r, "s", "t1", _prompt(100))
    r.cache.park("s")
    hog = r.turn(None, "hog", _prompt(220, base=5))
    r.drive.admit(hog)
    r.drive.prefill(hog)  # a running request holds most of the pool
    t2 = r.turn("s", "t2", hist + [5])
    with pytest.raises(KVCacheFullError):
        r.drive.admit(t2)
    assert "s" in r.cache.host_tier and t2.req.row is None
    r.busy(hog)
    r.drive.sample(hog)
    r.cache.finish(hog.req, hog.tokens)
    assert r.drive.admit(t2) == len(hist) - 1 and t2.req.cached_source == "host"
    r.cache.abort(t2.req, t2.tokens)
    r.all_free()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_snapshot_pickles_as_raw_buffers_and_back(dtype: torch.dtype) -> None:
    import pickle

    kv = torch.randn(2, 3, 5, 2, 4).to(dtype)
    snap = KVSnapshot([1, 2, 3, 4, 5], [kv, kv[:, :1].clone()])
    state = snap.__getstate__()
    assert all(raw.dtype.name == "uint8" for raw, _, _ in state["kv"])  # numpy: zero-copy
    back = pickle.loads(pickle.dumps(snap, protocol=5))
    assert back.tokens == snap.tokens and back.nbytes == snap.nbytes
    for a, b in zip(back.kv, snap.kv, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_a_tier_serves_only_the_pools_it_was_made_for(make_rig) -> None:
    r = make_rig(page=4)
    other = KVPool(KVShape(1, 1, 1), 64, dtype=torch.int64)
    with pytest.raises(ValueError, match="other KV pools"):
        r.cache.attach_kv(r.cache.kv_pools, HostTier(1 << 12, [other]))


@pytest.mark.gpu
def test_pinned_pages_park_and_restore_a_cuda_pool() -> None:
    """On CUDA the pages are pinned host memory and the copies asynchronous: what goes in
    comes back, restored into the pool and exported to the host."""
    shape = KVShape(4, 2, 8)
    pool = KVPool(shape, 256, dtype=torch.bfloat16, device="cuda")
    pool.k.copy_(torch.randn(pool.k.shape, device="cuda").to(torch.bfloat16))
    pool.v.copy_(torch.randn(pool.v.shape, device="cuda").to(torch.bfloat16))
    tier = HostTier(64 * shape.bytes_per_token(torch.bfloat16), [pool])
    assert all(arena.is_pinned() for arena in tier.arenas)
    slots = torch.cat((torch.arange(16, 48), torch.tensor([70, 3, 99])))  # pages, then ragged
    assert tier.park("s", slots, list(range(35)), 16)
    snap = tier.export("s")
    assert torch.equal(snap.kv[0][0], pool.k[:, slots].cpu())
    into = torch.arange(128, 128 + 30)
    tier.restore(tier.get("s"), 5, 35, into, 16)
    assert torch.equal(pool.k[:, into], pool.k[:, slots[5:].cuda()])
    assert torch.equal(pool.v[:, into], pool.v[:, slots[5:].cuda()])


def test_a_restore_that_fails_keeps_the_copy_and_its_pages(make_rig, monkeypatch) -> None:
    """A copy back that raises (not for want of room) leaves the parked copy in the tier,
    every page accounted, and the next turn restores it."""
    r = make_rig(page=16, host_tier_bytes=1 << 20)
    r.cache.open_session("s")
    hist = _session_turn(r, "s", "t1", _prompt(100))
    r.cache.park("s")
    tier = r.cache.host_tier
    copy_back = tier.restore

    def broken(*args, **kwargs):
        raise RuntimeError("copy failed")

    monkeypatch.setattr(tier, "restore", broken)
    t2 = r.turn("s", "t2", hist + [5])
    with pytest.raises(RuntimeError, match="copy failed"):
        r.drive.admit(t2)
    r.cache.abort(t2.req, t2.tokens)
    assert "s" in tier and len(tier.get("s")) == len(hist) - 1
    r.check.check_idle()  # every page free or held once, the bytes counted
    monkeypatch.setattr(tier, "restore", copy_back)
    t3 = r.turn("s", "t3", hist + [5])
    assert r.drive.admit(t3) == len(hist) - 1 and t3.req.cached_source == "host"
    r.cache.abort(t3.req, t3.tokens)
    r.all_free()
