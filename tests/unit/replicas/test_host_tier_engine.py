"""The host tier and session migration through the engine with a real (tiny) model: a session
parked in host memory, or moved to another engine, answers its next turn exactly as if its KV
had stayed resident (same tokens, logprobs within 1e-5: the same KV values are copied back),
and reports where its cached tokens came from."""

from __future__ import annotations

import pytest
import torch

from sessionserve.errors import IncompatibleSnapshotError, SessionBusyError
from sessionserve.wire import SamplingParams
from tests.models import mimic_drafter, tiny_engine, tiny_model

GREEDY_LP = SamplingParams(
    max_tokens=10, temperature=0, logprobs=True, top_logprobs=3, ignore_eos=True
)
TIER = 64 << 20


def _input(turn: int, n: int) -> list[int]:
    return [3 + (turn * 13 + j * 7) % 240 for j in range(n)]


def _same(r, ref, tol: float = 1e-5) -> None:
    assert r.output_ids == ref.output_ids
    assert all(
        abs(a.logprob - b.logprob) <= tol for a, b in zip(r.logprobs, ref.logprobs, strict=True)
    )


@pytest.mark.parametrize("page_size", [1, 16, 256])
def test_a_parked_session_answers_as_if_resident(page_size: int) -> None:
    model = tiny_model()
    resident = tiny_engine(model, page_size=page_size)
    tiered = tiny_engine(model, page_size=page_size, host_tier_bytes=TIER)
    sids = {e: e.open_session("s") for e in (resident, tiered)}
    for turn, n in enumerate((300, 9, 17)):
        if turn:
            assert tiered.park_session("s")
            assert tiered.session_info("s").held_tokens == 0
            assert tiered.checker.check_idle().host_sessions == 1
        (ref,) = resident.generate([_input(turn, n)], GREEDY_LP, session_id=sids[resident])
        (r,) = tiered.generate([_input(turn, n)], GREEDY_LP, session_id=sids[tiered])
        _same(r, ref)
        assert r.cached_tokens == ref.cached_tokens
        assert r.cached_source == ("host" if turn else "none")
    assert tiered.cache.host_tier.restored_total == 2
    for e in (resident, tiered):
        e.close_session("s")
        assert e.checker.check_idle().host_bytes == 0


def test_pressure_spills_to_host_and_the_turn_prefills_only_new_tokens() -> None:
    model = tiny_model()
    plain = tiny_engine(model, radix=False)
    tiered = tiny_engine(model, page_size=16, num_slots=640, host_tier_bytes=TIER)
    sid = tiered.open_session()
    first = _input(0, 400)
    (r1,) = tiered.generate([first], GREEDY_LP, session_id=sid)
    (other,) = tiered.generate([_input(5, 500)], GREEDY_LP)  # needs the session's pages
    assert tiered.cache.evicted_sessions_total == 1 and sid in tiered.cache.host_tier
    new = _input(1, 11)
    (r2,) = tiered.generate([new], GREEDY_LP, session_id=sid)
    assert r2.cached_source == "host" and r2.cached_tokens == len(first) + len(r1.output_ids) - 1
    (ref,) = plain.generate([first + r1.output_ids + new], GREEDY_LP)
    _same(r2, ref, tol=1e-3)  # vs a from-scratch prefill: the usual tolerance
    tiered.close_session(sid)
    tiered.checker.check_idle()


def test_drafter_kv_parks_and_returns_with_the_target() -> None:
    model = tiny_model(num_hidden_layers=1, seed=3)
    engine = tiny_engine(model, drafter=mimic_drafter, page_size=4, host_tier_bytes=TIER)
    plain = tiny_engine(model, radix=False)
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    sid = engine.open_session()
    (r1,) = engine.generate([_input(0, 40)], greedy, session_id=sid)
    slot = engine.cache.session(sid)
    rows = engine.cache.rows.read(slot.row, 0, slot.committed_len)
    drafter_k = engine.speculative.eagle.pool.k[:, rows].clone()
    engine.park_session(sid)
    (r2,) = engine.generate([_input(1, 8)], greedy, session_id=sid)
    assert r2.cached_source == "host"
    restored = engine.cache.rows.read(slot.row, 0, drafter_k.shape[1])
    drafter_pool = engine.speculative.eagle.pool
    torch.testing.assert_close(drafter_pool.k[:, restored], drafter_k, atol=0, rtol=0)
    (ref,) = plain.generate([_input(0, 40) + r1.output_ids + _input(1, 8)], greedy)
    assert r2.output_ids == ref.output_ids and r2.spec_accepted > 0
    engine.close_session(sid)
    engine.checker.check_idle()


@pytest.mark.parametrize("parked", [False, True])
def test_export_import_moves_a_session_between_engines(parked: bool) -> None:
    model = tiny_model()
    source = tiny_engine(model, page_size=16, host_tier_bytes=TIER)
    target = tiny_engine(model, page_size=4)
    resident = tiny_engine(model, page_size=16)
    for e in (source, resident):
        e.open_session("s", ttl_s=120)
    for turn, n in enumerate((50, 8)):
        (ref,) = resident.generate([_input(turn, n)], GREEDY_LP, session_id="s")
        (r,) = source.generate([_input(turn, n)], GREEDY_LP, session_id="s")
        _same(r, ref)
    if parked:
        source.park_session("s")
    export = source.export_session("s")
    assert export.turns == 2 and export.ttl_s == 120 and export.kv_bytes > 0
    assert target.import_session(export) == "pool"
    assert target.session_info("s").turns == 2 and target.session_info("s").ttl_s == 120
    (ref,) = resident.generate([_input(2, 6)], GREEDY_LP, session_id="s")
    (r,) = target.generate([_input(2, 6)], GREEDY_LP, session_id="s")
    _same(r, ref)
    assert r.cached_source == "session" and r.cached_tokens == ref.cached_tokens
    source.close_session("s")  # the move committed: the source lets go
    target.close_session("s")
    for e in (source, target):
        t = e.checker.check_idle()
        assert t.host_bytes == 0 and t.held == 0


def test_export_refuses_a_busy_session_and_import_another_model() -> None:
    source = tiny_engine(tiny_model(), page_size=4)
    other = tiny_engine(tiny_model(num_hidden_layers=1), page_size=4)
    sid = source.open_session()
    source.generate([_input(0, 20)], GREEDY_LP, session_id=sid)
    rid = source.submit(_input(1, 5), GREEDY_LP, session_id=sid)
    with pytest.raises(SessionBusyError):
        source.export_session(sid)
    source.abort(rid)
    source.take_result(rid)
    export = source.export_session(sid)
    with pytest.raises(IncompatibleSnapshotError):
        other.import_session(export)
    assert sid not in other.cache.session_slots  # nothing half-imported
    other.checker.check_idle()
    source.close_session(sid)
    source.checker.check_idle()


def test_an_import_over_a_busy_copy_is_refused_and_changes_nothing() -> None:
    model = tiny_model()
    source, target = tiny_engine(model, page_size=4), tiny_engine(model, page_size=4)
    for e in (source, target):
        e.open_session("s")
        e.generate([_input(0, 20)], GREEDY_LP, session_id="s")
    export = source.export_session("s")
    rid = target.submit(_input(1, 5), GREEDY_LP, session_id="s")  # a turn runs there
    with pytest.raises(SessionBusyError):
        target.import_session(export)
    assert not target.cache.session("s").closing  # the running turn's session stays open
    target.run_until_idle()
    assert target.take_result(rid).finish_reason.value == "length"
    assert "s" in target.cache.session_slots
    for e in (source, target):
        e.close_session("s")
        e.checker.check_idle()
