"""A request whose own work fails (sampling, verifying drafts, the stop check) fails alone:
it ends with an error result and its KV is given back, while the step, the rest of the batch
and the engine go on with exactly the tokens they would have had (issue 13, finding 1). The
memory check runs after every step (tiny_engine)."""

from __future__ import annotations

import pytest

from sessionserve.replicas.stopping import StopChecker
from sessionserve.wire import FinishReason, SamplingParams
from tests.models import mimic_drafter, tiny_engine, tiny_model

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=12, temperature=0.9, seed=7, ignore_eos=True)
# bypasses validation, as a bug in sampling would: the row raises inside the batched sample
POISON = SamplingParams.model_construct(**(SEEDED.model_dump() | {"temperature": "hot"}))
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]


def run(engine, jobs):
    """Submit (prompt, sampling, session) jobs together; results by rid, in order."""
    rids = [engine.submit(p, sp, session_id=sid) for p, sp, sid in jobs]
    engine.run_until_idle()
    engine.checker.check_idle()
    return [engine.take_result(r) for r in rids]


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("speculative", [False, True])
def test_a_poisoned_request_fails_alone_in_a_healthy_batch(speculative, overlap) -> None:
    """Under overlap the next step is already scheduled with the poisoned row's pending token,
    which it never sampled: that row reads a placeholder and its result is dropped. (The clean
    engine overlaps too: with speculation a seeded row's draws depend on which steps drafted,
    and under overlap the first decode after a prefill does not.)"""
    model = tiny_model(num_hidden_layers=1)
    drafter = mimic_drafter if speculative else None
    engine = tiny_engine(model, drafter=drafter, overlap=overlap)
    clean = tiny_engine(model, drafter=drafter, overlap=overlap)
    sid = engine.open_session()
    first = engine.generate([PROMPTS[0]], GREEDY, session_id=sid)[0]
    healthy = [(PROMPTS[1], GREEDY, None), (PROMPTS[2], SEEDED, None)]
    results = run(engine, [*healthy, (first.output_ids + [20, 21], POISON, sid)])
    expected = run(clean, healthy)
    for got, want in zip(results[:2], expected, strict=True):
        assert got.finish_reason is FinishReason.LENGTH
        assert got.output_ids == want.output_ids  # seeded and greedy rows unchanged
    bad = results[2]
    assert bad.finish_reason is FinishReason.ERROR and "stopped alone" in bad.finish_message
    # the session is back at its last successful turn and serves the next one
    info = engine.session_info(sid)
    assert info.turns == 1 and not info.turn_in_flight
    nxt = engine.generate([first.output_ids + [22]], GREEDY, session_id=sid)[0]
    assert nxt.finish_reason is FinishReason.LENGTH and nxt.cached_tokens > 0
    engine.close_session(sid)
    engine.checker.check_idle()


def test_a_failing_stop_check_ends_only_its_request(monkeypatch) -> None:
    engine = tiny_engine(tiny_model())
    real = StopChecker.check
    poisoned: set[str] = set()

    def check(self, req):
        if req.rid in poisoned and len(req.output_ids) == 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "a detokenizer bug")
        return real(self, req)

    monkeypatch.setattr(StopChecker, "check", check)
    rids = [engine.submit(p, GREEDY) for p in PROMPTS]
    poisoned.add(rids[1])
    engine.run_until_idle()
    engine.checker.check_idle()
    results = [engine.take_result(r) for r in rids]
    assert [r.finish_reason for r in results] == [
        FinishReason.LENGTH,
        FinishReason.ERROR,
        FinishReason.LENGTH,
    ]
    assert [len(r.output_ids) for r in (results[0], results[2])] == [12, 12]
