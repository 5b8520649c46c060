"""EAGLE speculative decoding in the engine: greedy output is the non-speculative output token
for token; stops, max_tokens and aborts inside a verified run are exact; the drafter's KV
holds exactly the committed positions; sessions continue from what was committed.

Every engine here runs in every-step memory checking: the busy invariant is checked after each step.
The reference system's speculation-under-overlap scenarios (sessions with EAGLE, retraction,
an abort mid-turn, max_tokens reached inside an accepted run) also run with overlap scheduling.
"""

from __future__ import annotations

import pytest
import torch

from sessionserve.replicas.speculative.draft_state import Drafting
from sessionserve.wire import FinishReason, SamplingParams
from tests.models import hf_greedy, mimic_drafter, random_drafter, tiny_engine, tiny_model
from tests.unit.replicas.test_spec_policy import FakeClock

GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


def _prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 250, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.parametrize(("page_size", "overlap"), [(1, False), (16, False), (16, True)])
def test_greedy_speculation_equals_generate_with_uneven_acceptance(
    page_size: int, overlap: bool
) -> None:
    model = tiny_model(num_hidden_layers=1, seed=3)
    prompts = _prompts(0, (5, 17, 33, 40, 61))
    spec = tiny_engine(
        model, drafter=mimic_drafter, page_size=page_size, prefill=24, overlap=overlap
    )
    results = spec.generate(prompts, GREEDY)
    for prompt, r in zip(prompts, results, strict=True):
        assert r.output_ids == hf_greedy(model, prompt, GREEDY.max_tokens)
        assert r.spec_steps > 0 and r.spec_drafted == 4 * r.spec_steps
    hist = spec.spec_stats.histogram
    assert hist.get(1, 0) > 0 and hist.get(5, 0) > 0, hist  # full rejections and full runs
    rates = {round(r.spec_accepted / r.spec_drafted, 3) for r in results}
    assert len(rates) > 1, rates  # requests in one batch accepted differently
    assert spec.spec_stats.accepted == sum(r.spec_accepted for r in results)
    # fewer target forwards than tokens: speculation did the work
    assert spec.spec_stats.steps < sum(r.completion_tokens for r in results) - len(results)
    if overlap:  # the prefill chunks overlapped; each verify waited for the step before it
        assert spec.overlap_totals["overlapped_steps"] > 0
        assert spec.overlap_totals["overlap_waits"] > 0
        spec.close()


def _recorded_chains(engine) -> list[tuple[list[int], list[float]]]:
    """Each chain the head proposes from now on (one request a step), with its drafts'
    probabilities under the head as the proposer saw them: the first from the request's
    `DraftState` (checked against the head's own softmax of its feature), the rest from the
    head's picks inside `propose`. The eager loop's picks: on a GPU the chain graphs (which
    keep their picks on the device) are turned off here; they cut chains where this loop does
    (`test_the_heads_chain_through_its_graphs_static_path_drafts_what_the_loop_drafts`)."""
    eagle = engine.speculative.eagle
    eagle.chain_graphs = None
    propose, choose = eagle.propose, eagle._choose
    chains: list[tuple[list[int], list[float]]] = []
    picks: list[float] = []

    def recording_choose(*args, **kwargs):
        picked = choose(*args, **kwargs)
        picks.extend(picked.confidence)
        return picked

    def recording_propose(reqs, lengths):
        assert len(reqs) == 1, "one request at a time: its picks are the chain's"
        draft = reqs[0].draft
        with torch.no_grad():
            own = eagle.drafter.draft_logits(draft.feature[None]).float().softmax(-1).max()
        assert draft.confidence == pytest.approx(own.item(), rel=1e-4)
        picks.clear()
        picks.append(draft.confidence)
        (chain,) = propose(reqs, lengths)
        chains.append((chain.tokens, picks[: len(chain.tokens)]))
        return [chain]

    eagle._choose, eagle.propose = recording_choose, recording_propose
    return chains


@pytest.mark.parametrize("overlap", [False, True])
def test_chains_stop_where_the_heads_confidence_falls(overlap: bool) -> None:
    """With `min_draft_confidence`, a chain drafts on past a draft only while the product of
    its drafts' probabilities under the head is at the threshold: each chain is full or ends
    at the draft that took the product below it, chains end at every length, the output is
    still generate's token for token, and the draft slots a short chain left unused are
    freed (the strict memory check runs every step)."""
    model = tiny_model(num_hidden_layers=1, seed=3, init_std=0.4)  # a head confident at times
    prompts = _prompts(0, (5, 17, 33, 40))
    k = 4

    def run(min_confidence: float):
        engine = tiny_engine(
            model,
            drafter=mimic_drafter,
            page_size=16,
            prefill=24,
            overlap=overlap,
            min_draft_confidence=min_confidence,
        )
        chains = _recorded_chains(engine)
        results = [engine.generate([p], GREEDY)[0] for p in prompts]  # one request a step
        engine.close()
        return results, chains

    _, full = run(0.0)
    assert all(len(tokens) == k for tokens, _ in full)
    # a threshold among the products the head reached at which, by the rule, chains would
    # end after one draft and run full alike (they differ little in the second run)
    running = [torch.cumprod(torch.tensor(c, dtype=torch.float64), 0) for _, c in full]

    def ends(threshold: float) -> int:
        ones = sum(float(r[0]) < threshold for r in running)
        fulls = sum(float(r[k - 2]) >= threshold for r in running)
        return min(ones, fulls)

    threshold = max((float(r[j]) for r in running for j in range(k - 1)), key=ends)
    results, chains = run(threshold)
    for prompt, r in zip(prompts, results, strict=True):
        assert r.output_ids == hf_greedy(model, prompt, GREEDY.max_tokens)
    assert sum(r.spec_drafted for r in results) == sum(len(t) for t, _ in chains)
    for tokens, conf in chains:
        running = torch.cumprod(torch.tensor(conf, dtype=torch.float64), 0)
        assert all(running[: len(tokens) - 1] >= threshold * (1 - 1e-6)), conf  # drafted on
        assert len(tokens) == k or running[-1] < threshold * (1 + 1e-6), conf  # then stopped
    lengths = {len(tokens) for tokens, _ in chains}
    assert lengths >= {1, k} and len(lengths) >= 3, lengths


def test_random_drafter_on_a_deeper_model_changes_nothing() -> None:
    model = tiny_model(seed=5)  # two layers: an untrained head is nearly always wrong
    prompts = _prompts(1, (9, 30))
    spec = tiny_engine(model, drafter=random_drafter, num_drafts=3)
    for prompt, r in zip(prompts, spec.generate(prompts, GREEDY), strict=True):
        assert r.output_ids == hf_greedy(model, prompt, GREEDY.max_tokens)
    assert spec.spec_stats.drafted > 0
    assert spec.spec_stats.drafted - spec.spec_stats.accepted > 0


def test_mixed_batch_logprobs_and_penalties_match_plain_engine() -> None:
    model = tiny_model(num_hidden_layers=1, seed=3)
    prompts = _prompts(2, (12, 20, 7))
    options = [
        SamplingParams(max_tokens=16, temperature=0, logprobs=True, top_logprobs=3),
        SamplingParams(max_tokens=16, temperature=0, repetition_penalty=1.3),  # no drafts
        SamplingParams(max_tokens=16, temperature=0, stop_token_ids=(77,)),
    ]
    spec = tiny_engine(model, drafter=mimic_drafter)
    plain = tiny_engine(model)
    rids = [spec.submit(p, o) for p, o in zip(prompts, options, strict=True)]
    spec.run_until_idle()
    got = [spec.take_result(r) for r in rids]
    for prompt, opt, r in zip(prompts, options, got, strict=True):
        (ref,) = plain.generate([prompt], opt)
        assert r.output_ids == ref.output_ids and r.finish_reason == ref.finish_reason
        for a, b in zip(r.logprobs, ref.logprobs, strict=True):
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
        assert len(r.logprobs) == (len(r.output_ids) if opt.logprobs else 0)
    assert got[0].spec_steps > 0 and got[1].spec_steps == 0


def _long_run_start(engine, prompt: list[int]) -> int:
    """Output index where some verify (not the first step) emitted >= 3 tokens at once."""
    events = []
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    engine.submit(prompt, params, listener=events.append)
    engine.run_until_idle()
    done = 0
    for e in events:
        if len(e.new_token_ids) >= 3 and done > 0:
            return done
        done += len(e.new_token_ids)
    raise AssertionError("no verify accepted two drafts")


@pytest.mark.parametrize("overlap", [False, True])
def test_max_tokens_and_stop_tokens_inside_an_accepted_run_are_exact(overlap: bool) -> None:
    """The verify emits several tokens at once; the answer ends exactly where a plain engine
    stops, and the overshoot is trimmed from the tokens (and the KV: the memory check sees it)."""
    model = tiny_model(num_hidden_layers=1, seed=3)
    prompt = _prompts(3, (25,))[0]
    spec = tiny_engine(model, drafter=mimic_drafter, page_size=1, overlap=overlap)
    plain = tiny_engine(model)
    start = _long_run_start(spec, prompt)
    full = hf_greedy(model, prompt, 60)
    inside = start + 1  # a max_tokens that ends inside that accepted run
    p_len = SamplingParams(max_tokens=inside + 1, temperature=0, ignore_eos=True)
    (r,) = spec.generate([prompt], p_len)
    assert r.output_ids == full[: inside + 1] and r.finish_reason is FinishReason.LENGTH
    stop_tok = full[inside]
    first = full.index(stop_tok)
    p_stop = SamplingParams(max_tokens=60, temperature=0, stop_token_ids=(stop_tok,))
    (s,) = spec.generate([prompt], p_stop)
    (ref,) = plain.generate([prompt], p_stop)
    assert s.output_ids == ref.output_ids == full[: first + 1]
    assert s.finish_reason is FinishReason.STOP
    spec.cache.flush()
    terms = spec.checker.check_idle()
    assert terms.free == terms.total


@pytest.mark.parametrize(
    ("verify_cost", "with_history", "tree_topk", "overlap"),
    [
        (None, False, 1, False),
        (8.0, False, 1, False),
        (None, True, 1, False),
        (None, False, 2, False),
        (8.0, False, 1, True),
        (None, True, 1, True),
    ],
)
def test_drafter_kv_holds_exactly_the_committed_positions(
    verify_cost: float | None, with_history: bool, tree_topk: int, overlap: bool, monkeypatch
) -> None:
    """After a session's turns, the drafter's K at every parked slot equals what a fresh
    prefill of the whole history computes: the catch-up wrote every committed position with
    the target's hidden states (no guessed chain entry survives). Also with the policy on and
    verifies made dear (fake clock): most steps do not draft and put their catch-up off, which
    runs when a step drafts again or the turn ends; and with history drafts beside the head,
    whose fully kept runs put the head's catch-up off too; and with draft trees, whose
    expanded nodes' entries sit in slots past the committed ones until the catch-up. Under
    overlap scheduling too, where the steps that do not draft land (and catch up) while the
    next one computes."""
    model = tiny_model(num_hidden_layers=1, seed=3)
    noise = 0.3 if with_history else 0.05  # a worse head: history drafts win some steps
    engine = tiny_engine(
        model,
        drafter=lambda m: mimic_drafter(m, noise=noise),
        page_size=1,
        adaptive=verify_cost is not None,
        history_drafts=with_history,
        tree_topk=tree_topk,
        overlap=overlap,
    )
    deferred, defer = [], Drafting.defer
    monkeypatch.setattr(Drafting, "defer", lambda d, *a: (deferred.append(1), defer(d, *a)))
    if verify_cost is not None:
        FakeClock(engine, plain=1.0, verify=verify_cost)
    fresh = tiny_engine(model, drafter=lambda m: mimic_drafter(m, noise=noise), page_size=1)
    sid = engine.open_session()
    history: list[int] = []
    turn_ends = []
    for turn, n in enumerate((14, 9, 21)):
        new = _prompts(10 + turn, (n,))[0]
        (r,) = engine.generate([new], GREEDY, session_id=sid)
        history += new + r.output_ids
        turn_ends.append(len(history) - 1)
    slot = engine.cache.session(sid)
    kept = len(slot.kv_tokens)
    assert slot.kv_tokens == history[:kept]
    (ref,) = fresh.generate([history], SamplingParams(max_tokens=1, temperature=0))
    # every position but a turn's last answer token: when a verify ran past max_tokens the
    # target's KV there is kept (the reference's trim), and the head's entry pairs it with the
    # model's own next token, not the next turn's first (a known gap: acceptance only, the
    # answers are verified); and the last parked position pairs with the token after it,
    # which only this session knows
    # and the positions whose catch-up the last turn left to the next (drafting was off)
    backlog = engine.sessions.records[sid].head_backlog
    carried = range(backlog.start, backlog.end) if backlog is not None else range(0)
    check = [p for p in range(kept - 1) if p not in turn_ends and p not in carried]
    ours = engine.speculative.eagle.pool.k[0][engine.cache.rows.read(slot.row, 0, kept - 1)]
    match = fresh.cache.radix.match_prefix(history[:kept])
    theirs = fresh.speculative.eagle.pool.k[0][match.slots[: kept - 1]]
    torch.testing.assert_close(ours[check], theirs[check], atol=1e-4, rtol=1e-4)
    if verify_cost is not None:
        arms = engine.speculative.policy.summary()["1"]
        assert arms["plain_steps"] > arms["spec_steps"] > 0
    if verify_cost is not None:
        assert len(deferred) > 5, deferred  # catch-ups were put off, then run
    if with_history:
        assert deferred  # after fully kept history runs
        assert set(engine.speculative.by_source) == {"eagle", "history"}
    engine.close_session(sid)
    engine.cache.flush()
    terms = engine.checker.check_idle()
    assert terms.free == terms.total


def _head_passes(engine) -> list[tuple[int, int]]:
    """The (start, end) of every position range the EAGLE head catches up on, from now on."""
    passes, catch_up = [], engine.speculative.eagle.catch_up

    def counted(entries):
        passes.extend((e.start, e.end) for e in entries if e.end > e.start)
        catch_up(entries)

    engine.speculative.eagle.catch_up = counted
    return passes


@pytest.mark.parametrize("overlap", [False, True])
def test_a_turn_leaves_the_heads_put_off_catch_up_to_the_sessions_next_turn(
    monkeypatch, overlap: bool
) -> None:
    """With drafting off (the policy's choice, forced here) the head's catch-up waits; a
    session turn that ends so leaves it to the session's next turn instead of paying it
    (a session's last turn never pays it). When the next turn drafts, one pass covers the
    carried positions and the new ones, and the head's KV then equals a fresh prefill's at
    every position, its drafts the same as an engine that caught up when the turn ended
    (`carried_catch_up_mib: 0`). A failed turn drops what it carried. (An untrained head:
    unlike the mimic head it reads the target's hidden states, so their order matters.)"""
    model = tiny_model(seed=3)
    first, second = _prompts(21, (14, 9))
    runs = {}
    for mib in (64.0, 0.0):
        engine = tiny_engine(
            model,
            drafter=random_drafter,
            page_size=1,
            adaptive=True,
            carried_catch_up_mib=mib,
            overlap=overlap,
        )
        drafting = [False]
        monkeypatch.setattr(engine.speculative.policy, "choose", lambda n, owed, d=drafting: d[0])
        passes = _head_passes(engine)
        sid = engine.open_session()
        (r1,) = engine.generate([first], GREEDY, session_id=sid)
        committed = len(first) + len(r1.output_ids) - 1  # the last answer token is pending
        backlog = engine.sessions.records[sid].head_backlog
        if mib:
            assert passes == [] and r1.spec_steps == 0
            assert (backlog.start, backlog.end) == (0, committed)
            assert engine.sessions.head_backlog_bytes() == backlog.nbytes > 0
        else:
            assert backlog is None and passes == [(0, committed)]
        passes.clear()
        drafting[0] = True
        (r2,) = engine.generate([second], GREEDY, session_id=sid)
        history = first + r1.output_ids + second
        assert r2.output_ids == hf_greedy(model, history, GREEDY.max_tokens)
        assert r2.spec_steps > 0
        assert passes[0] == ((0 if mib else committed), committed + 1 + len(second))
        runs[mib] = (engine, sid, r2, history + r2.output_ids, committed)
    (engine, sid, r2, history, turn_end), (_, _, p2, _, _) = runs[64.0], runs[0.0]
    assert (r2.spec_drafted, r2.spec_accepted) == (p2.spec_drafted, p2.spec_accepted)
    fresh = tiny_engine(model, drafter=random_drafter, page_size=1)
    slot = engine.cache.session(sid)
    kept = len(slot.kv_tokens)
    fresh.generate([history[:kept]], SamplingParams(max_tokens=1, temperature=0))
    check = [p for p in range(kept - 1) if p != turn_end]  # see the test above
    ours = engine.speculative.eagle.pool.k[0][engine.cache.rows.read(slot.row, 0, kept - 1)]
    match = fresh.cache.radix.match_prefix(history[:kept])
    theirs = fresh.speculative.eagle.pool.k[0][match.slots[: kept - 1]]
    torch.testing.assert_close(ours[check], theirs[check], atol=1e-4, rtol=1e-4)
    # a turn that fails drops what it carried: nothing waits for a session whose turn failed
    monkeypatch.setattr(engine.speculative.policy, "choose", lambda n, owed: False)
    engine.generate([_prompts(22, (6,))[0]], GREEDY, session_id=sid)
    assert engine.sessions.records[sid].head_backlog is not None
    rid = engine.submit(_prompts(23, (6,))[0], GREEDY, session_id=sid)
    engine.step()
    assert engine.abort(rid)
    assert engine.sessions.records[sid].head_backlog is None
    assert engine.sessions.head_backlog_bytes() == 0
    engine.close_session(sid)
    engine.cache.flush()
    terms = engine.checker.check_idle()
    assert terms.free == terms.total


def test_a_turn_that_ends_keeps_the_policys_choice_and_its_backlog(monkeypatch) -> None:
    """After a step nothing decodes after (the turn's last), the policy is not asked: a
    choice made for no one would say "draft" wherever drafting measured faster and nothing
    is owed, and make the ending turn catch the head up on every position it put off."""
    model = tiny_model(seed=3)
    engine = tiny_engine(model, drafter=random_drafter, page_size=1, adaptive=True)
    asked: list[int] = []

    def choose(num_decodes: int, owed: int) -> bool:
        asked.append(num_decodes)
        return num_decodes == 0  # as the policy did for no one with drafting the faster arm

    monkeypatch.setattr(engine.speculative.policy, "choose", choose)
    passes = _head_passes(engine)
    sid = engine.open_session()
    (prompt,) = _prompts(24, (14,))
    (r1,) = engine.generate([prompt], GREEDY, session_id=sid)
    assert asked and 0 not in asked
    committed = len(prompt) + len(r1.output_ids) - 1
    backlog = engine.sessions.records[sid].head_backlog
    assert passes == [] and (backlog.start, backlog.end) == (0, committed)
    engine.close_session(sid)
    engine.cache.flush()
    terms = engine.checker.check_idle()
    assert terms.free == terms.total


@pytest.mark.parametrize("overlap", [False, True])
def test_a_turn_ending_as_drafting_resumes_carries_its_backlog(monkeypatch, overlap) -> None:
    """Drafting off while two turns decode, on once one is left (as the policy turns it on
    where a batch's tail is small): the turn that ends then leaves its put-off pass to its
    session's next turn instead of paying it, and the one that goes on pays its own. The
    next turn that drafts catches up the carried positions with its prompt and answers as
    transformers does."""
    model = tiny_model(seed=3)
    engine = tiny_engine(model, drafter=random_drafter, page_size=1, adaptive=True, overlap=overlap)
    monkeypatch.setattr(engine.speculative.policy, "choose", lambda n, owed: n < 2)
    passes = _head_passes(engine)
    short, long = engine.open_session(), engine.open_session()
    first, other, second = _prompts(25, (12, 10, 7))
    rs = engine.submit(first, SamplingParams(max_tokens=6, temperature=0), session_id=short)
    rl = engine.submit(other, SamplingParams(max_tokens=20, temperature=0), session_id=long)
    engine.run_until_idle()
    r1, r2 = engine.take_result(rs), engine.take_result(rl)
    assert r2.spec_steps > 0  # the long turn drafted once it decoded alone
    committed = len(first) + len(r1.output_ids) - 1
    backlog = engine.sessions.records[short].head_backlog
    assert backlog is not None and (backlog.start, backlog.end) == (0, committed)
    assert (0, committed) not in passes  # the short turn did not pay it
    assert any(start == 0 for start, _ in passes)  # the long one paid its own
    passes.clear()
    (r3,) = engine.generate([second], GREEDY, session_id=short)
    history = first + r1.output_ids + second
    assert r3.output_ids == hf_greedy(model, history, GREEDY.max_tokens)
    assert passes[0] == (0, committed + 1 + len(second))
    assert engine.sessions.records[short].head_backlog is None
    for sid in (short, long):
        engine.close_session(sid)
    engine.cache.flush()
    terms = engine.checker.check_idle()
    assert terms.free == terms.total


def test_a_carried_catch_up_keeps_only_what_the_next_turn_kept() -> None:
    """The next turn computes from where its KV reuse ends: a chat turn that rewrote the
    history's tail cuts the carried positions there (mid-chunk too), a turn that kept none of
    them (or left a gap after them) drops them; contiguous steps extend them."""
    steps = [torch.randn(n, 4) for n in (5, 1, 1, 3)]

    def carried() -> Drafting:
        d, pos = Drafting(), 10
        for h in steps:
            d.defer(pos, h)
            pos += len(h)
        return d

    whole = torch.cat(steps)
    d = carried()
    d.resume_at(20)  # the next turn kept everything
    assert (d.deferred.start, d.deferred.end, d.deferred.nbytes) == (10, 20, whole.nbytes)
    d.resume_at(16)  # it rewrote positions 16 onwards (inside the last step's chunk)
    assert (d.deferred.start, d.deferred.end) == (10, 16)
    assert d.deferred.nbytes == 6 * 4 * whole.element_size()
    start, hidden = d.take_deferred(16, torch.ones(2, 4))
    assert start == 10 and torch.equal(hidden, torch.cat((whole[:6], torch.ones(2, 4))))
    assert d.deferred is None
    for at in (10, 3, 21):  # nothing of it kept, or a gap after it
        d = carried()
        d.resume_at(at)
        assert d.deferred is None
    with pytest.raises(ValueError, match="end at 20, not 22"):
        carried().deferred.append(22, torch.ones(1, 4))


@pytest.mark.parametrize(
    ("page_size", "tree_topk", "overlap"),
    [(1, 1, False), (16, 1, False), (16, 2, False), (16, 1, True)],
)
def test_session_turns_with_speculation_equal_plain_requests(
    page_size: int, tree_topk: int, overlap: bool
) -> None:
    """Multi-turn with forced retraction, a turn aborted mid-verify, a max_tokens and a stop
    token that land inside verified runs: each answer equals a plain engine's on the full
    history; the next turn reuses exactly what the last one committed."""
    model = tiny_model(num_hidden_layers=1, seed=3)
    engine = tiny_engine(
        model,
        drafter=mimic_drafter,
        page_size=page_size,
        retract_every=5,
        tree_topk=tree_topk,
        overlap=overlap,
    )
    plain = tiny_engine(model, radix=False)
    sid = engine.open_session()
    history: list[int] = []
    for turn in range(6):
        new = _prompts(20 + turn, (6 + 5 * turn,))[0]
        if turn == 2:  # abort mid-verify: the turn disappears, the session continues
            rid = engine.submit(new, GREEDY, session_id=sid)
            req = engine.outputs.requests[rid]
            for i in range(30):  # 4 steps (under overlap: until a step is in flight after
                engine.step()  # a verify)
                if not overlap and i == 3:
                    break
                if overlap and req.spec.steps > 0 and engine._in_flight is not None:
                    break
            assert not overlap or engine._in_flight is not None
            assert req.spec.steps > 0 and not req.finished
            engine.abort(rid)
            engine.take_result(rid)
            continue
        params = GREEDY
        if turn == 1:
            params = SamplingParams(max_tokens=7, temperature=0, ignore_eos=True)
        if turn == 3:  # stop at a token the plain answer reaches after a few steps
            (probe,) = plain.generate([history + new], GREEDY)
            params = SamplingParams(
                max_tokens=40, temperature=0, stop_token_ids=(probe.output_ids[6],)
            )
        kept = len(engine.cache.session(sid).kv_tokens) if history else 0
        (r,) = engine.generate([new], params, session_id=sid)
        history += new
        (ref,) = plain.generate([history], params)
        assert r.output_ids == ref.output_ids and r.finish_reason == ref.finish_reason
        assert r.cached_tokens == kept
        # (under overlap the first decode after the prefill is scheduled before the head's
        # guess exists: an answer of two tokens verifies nothing)
        assert r.spec_steps > 0 or (overlap and len(r.output_ids) <= 2)
        history += r.output_ids
    assert engine.scheduler.retractions_total > 0 and engine.spec_stats.accepted > 0
    engine.close_session(sid)
    engine.cache.flush()
    terms = engine.checker.check_idle()
    assert terms.free == terms.total and terms.rows_free == terms.rows_total


def test_each_verify_reaches_the_metrics_the_engine_has_now() -> None:
    """The served replica swaps its exporter in after building the engine: every verify's
    acceptance length must still reach it (the histogram on the dashboards)."""
    from sessionserve.metrics import EngineMetrics

    class Recorder(EngineMetrics):
        def __init__(self) -> None:
            self.lengths: list[int] = []

        def on_spec_step(self, accept_len: int) -> None:
            self.lengths.append(accept_len)

    recorder = Recorder()
    engine = tiny_engine(
        tiny_model(num_hidden_layers=1, seed=3), drafter=mimic_drafter, metrics=recorder
    )
    (r,) = engine.generate(_prompts(0, (9,)), GREEDY)
    assert len(recorder.lengths) == r.spec_steps > 0
    assert sum(recorder.lengths) == r.spec_accepted + r.spec_steps


def _verify_shapes(engine) -> list[tuple[int, int]]:
    """Each drafting step's (decode rows, drafts of its longest chain) from now on."""
    spec, shapes = engine.speculative, []
    propose = spec.propose

    def recording(batch):
        drafts = [s.num_drafts for s in batch.seqs if s.end - s.start == 1]
        if any(drafts):
            shapes.append((len(drafts), max(drafts)))
        return propose(batch)

    spec.propose = recording
    return shapes


@pytest.mark.parametrize("widest", [None, 12, 6])
def test_chains_are_cut_so_a_verify_stays_within_the_compiled_steps(widest) -> None:
    """Past the compiled packages' widest step a verify runs eagerly, dearer than the drafts
    it adds: the step's chains are cut to the longest that keeps it within that step (4 rows,
    12 tokens: 2 drafts a row), where one draft a row still fits; where none does (6 tokens)
    they are left whole. The answers are the plain greedy ones whatever the cut."""
    model = tiny_model(num_hidden_layers=1, seed=3)
    prompts = _prompts(1, (6, 11, 19, 27))
    engine = tiny_engine(model, drafter=mimic_drafter)
    engine.speculative.widest_step = lambda: widest
    shapes = _verify_shapes(engine)
    results = engine.generate(prompts, GREEDY)
    for prompt, r in zip(prompts, results, strict=True):
        assert r.output_ids == hf_greedy(model, prompt, GREEDY.max_tokens)
    at_four = {k for rows, k in shapes if rows == 4}
    if widest == 12:
        assert at_four == {2}, shapes
        assert all(rows * (k + 1) <= 12 for rows, k in shapes), shapes
    else:  # no edge, or one where not even a draft a row fits: the whole chains
        assert at_four == {4}, shapes
    engine.cache.flush()  # (the radix tree keeps the answers, evictable)
    terms = engine.checker.check_idle()
    assert terms.free == terms.total


def test_chains_are_cut_by_the_steps_own_tokens_not_its_padded_rows() -> None:
    """Rows of unequal chains pad for the attention alone (compiled_decode.py), so the cut
    counts the step's own tokens: 6 rows wanting 4, 0, 0, 4, 1, 0 drafts (15 tokens) within
    12 keep 2 drafts a chain (11 tokens), where a cut to 12 padded tokens left one."""
    from types import SimpleNamespace

    spec = tiny_engine(tiny_model(num_hidden_layers=1, seed=3), drafter=mimic_drafter).speculative
    wanted = [4, 0, 0, 4, 1, 0]
    reqs = [SimpleNamespace(drafting=SimpleNamespace(tree_depth=0), k=k) for k in wanted]
    spec.draft_len = lambda r: r.k
    spec._seeded = lambda r: False
    spec.widest_step = lambda: 12
    assert spec.draft_lens(reqs) == [2, 0, 0, 2, 1, 0]
    spec.widest_step = lambda: 15
    assert spec.draft_lens(reqs) == wanted
    spec.widest_step = lambda: 8  # not even a draft a chain fits: left whole
    assert spec.draft_lens(reqs) == wanted


def test_a_seeded_sampled_chain_is_not_cut_by_the_load() -> None:
    """How many drafts a seeded sampled request verifies decides which random numbers its
    answer draws, so the compiled steps' edge, which depends on how many requests decode
    together, must not cut its chain: the same answers with and without the edge."""
    model = tiny_model(num_hidden_layers=1, seed=3)
    prompts = _prompts(2, (7, 13, 21, 30))
    params = SamplingParams(max_tokens=30, temperature=0.8, seed=5, ignore_eos=True)
    answers, shapes = [], []
    for widest in (None, 12):
        engine = tiny_engine(model, drafter=mimic_drafter)
        engine.speculative.widest_step = lambda widest=widest: widest
        shapes.append(_verify_shapes(engine))
        answers.append([r.output_ids for r in engine.generate(prompts, params)])
    assert answers[0] == answers[1]
    assert shapes[0] == shapes[1] and (4, 4) in shapes[1], shapes


def test_the_decoder_reads_the_runners_compiled_edge_at_each_step() -> None:
    """The packages may land after the engine serves (built in the background): the decoder
    asks the runner each time. The edge is the widest package's, and there is none where the
    prefill package runs every longer step (not only the prefills it was timed faster on),
    nor on a GPU."""
    from types import SimpleNamespace

    engine = tiny_engine(tiny_model(num_hidden_layers=1, seed=3), drafter=mimic_drafter)
    runner, spec = engine.runner, engine.speculative
    assert spec.widest_step() is None  # nothing compiled
    runner.device = torch.device("cpu")  # (the rule by device; the suite may run on CUDA)
    runner.compiled = SimpleNamespace(max_tokens=32)
    runner.compiled_decode = SimpleNamespace(max_tokens=48)
    assert spec.widest_step() == 48
    runner.compiled_prefill = SimpleNamespace(max_tokens=1024, limited=False)
    assert spec.widest_step() is None
    # one limited to the prefills it was timed faster on: the longer verifies run eagerly
    runner.compiled_prefill = SimpleNamespace(max_tokens=128, limited=True)
    assert spec.widest_step() == 48
    runner.compiled_prefill = None
    runner.device = torch.device("cuda")  # a GPU's verifies replay graphs: no edge there
    assert spec.widest_step() is None


@pytest.mark.parametrize("drafts", ["eagle", "eagle+history", "history", "history-gemma3"])
def test_verifies_through_the_verify_graphs_static_path(drafts: str) -> None:
    """`VerifyGraphs` (on a GPU the graphs that speculative decoding's verify steps replay;
    here their static path runs eagerly: rows padded to num_drafts + 1 tokens and to the batch
    bucket, every token's logits and the drafter's features mapped back to the step's flat
    order) gives transformers' greedy tokens with uneven acceptance and, with history drafts,
    uneven draft lengths; the head reads the features it returns, so every request accepts
    exactly what it does without the graphs (a feature in the wrong row changes the head's
    next drafts). The runner holds extend graphs too (with history drafts alone the engine
    builds both): they decline verify steps, which go on to the verify graphs. On a
    sliding-window model (Gemma 3, window 8) the windowed layers' static columns and masks
    are filled per row, each with its own number of new tokens."""
    from sessionserve.replicas.cuda_graphs import DecodeGraphs, ExtendGraphs, VerifyGraphs

    if drafts.endswith("gemma3"):
        model = tiny_model("gemma3")
    else:
        model = tiny_model(num_hidden_layers=1, seed=3)
    prompts = _prompts(0, (5, 17, 33, 40, 61))
    history = "history" in drafts

    def reads_features(m):  # mimic_drafter's `fc` ignores the target's features: not this one
        head = mimic_drafter(m, noise=0.3 if history else 0.05)
        h = m.config.hidden_size
        with torch.no_grad():
            head.fc.weight[:, h:] = 0.2 * torch.randn(
                h, h, generator=torch.Generator().manual_seed(1)
            )
        return head

    def engine(graphs: bool):
        drafter = reads_features if "eagle" in drafts else None
        e = tiny_engine(model, drafter=drafter, prefill=24, history_drafts=history)
        if graphs:
            r = e.runner
            r.graphs = DecodeGraphs(r, (1, 2, 4, 8), capture=False)
            r.extend_graphs = ExtendGraphs(r, r.backend, 64, capture=False)
            r.verify_graphs = VerifyGraphs(r, r.backend, (1, 2, 4, 8), 5, capture=False)
            assert r.backend.windows == ((8,) if drafts.endswith("gemma3") else ())
        return e

    plain, graphed = engine(False), engine(True)
    verify_steps = []  # steps whose every token is sampled, some row with drafts
    forward = graphed.runner.forward

    def counted(batch):
        q = max(s.q_len for s in batch.seqs)
        verify_steps.append(len(batch.logit_idx) == len(batch.input_ids) and q > 1)
        return forward(batch)

    graphed.runner.forward = counted
    want, got = plain.generate(prompts, GREEDY), graphed.generate(prompts, GREEDY)
    for prompt, r, w in zip(prompts, got, want, strict=True):
        assert r.output_ids == hf_greedy(model, prompt, GREEDY.max_tokens)
        assert (r.spec_steps, r.spec_drafted, r.spec_accepted) == (
            w.spec_steps,
            w.spec_drafted,
            w.spec_accepted,
        )
    verify = graphed.runner.verify_graphs
    assert verify.replays == sum(verify_steps) > 0  # every verify step went through it
    shapes = {key for _, key in verify.graphs}
    assert len({b for b, _ in shapes}) > 1  # batch buckets, padding rows among them
    if history:  # some rows drafted fewer than 4 (history runs), padded to 5 tokens
        assert graphed.spec_stats.drafted < 4 * graphed.spec_stats.steps
    graphed.checker.check_idle()


@pytest.mark.gpu
def test_verify_graphs_replay_on_cuda() -> None:
    """On a GPU the verify steps replay captured graphs (`VerifyGraphs`, built by the engine
    when speculation and CUDA graphs are both on), so do the head's chain steps
    (`ChainGraphs`) and its catch-ups after a verify (`CatchUpGraphs`), and the answers stay
    transformers'."""
    model = tiny_model(num_hidden_layers=1, seed=3)
    prompts = _prompts(0, (5, 17, 33, 40, 61))
    spec = tiny_engine(model, drafter=mimic_drafter, prefill=24, device="cuda")
    verify = spec.runner.verify_graphs
    assert verify is not None
    for prompt, r in zip(prompts, spec.generate(prompts, GREEDY), strict=True):
        assert r.output_ids == hf_greedy(model, prompt, GREEDY.max_tokens)
    assert verify.replays > 0 and all(g.graph is not None for g in verify.graphs.values())
    chain = spec.speculative.eagle.chain_graphs
    assert chain is not None and chain.replays > 0
    assert all(g.graph is not None for g in chain.graphs.values())
    catch_ups = spec.speculative.eagle.catch_up_graphs
    assert catch_ups is not None and catch_ups.replays > 0
    assert all(g.graph is not None for g in catch_ups.graphs.values())


@pytest.mark.gpu
def test_verify_graphs_over_flashinfer_match_the_torch_backends() -> None:
    """With FlashInfer decoding, verify steps replay graphs over its paged prefill in graph
    mode (every row padded to num_drafts + 1 queries with as many padding positions after its
    context, `padded_rows_page_table`), not over the torch backend's padded gather. History
    drafts of uneven lengths (rows with padding queries), bf16: the tokens equal the torch
    backend's engine's, tie-aware as the backends' own comparison, and every verify replayed
    a captured graph."""
    pytest.importorskip("flashinfer")
    from tests.unit.replicas.test_loader_and_backends import assert_tie_aware_equal

    model = tiny_model(hidden_size=256, num_attention_heads=4, num_hidden_layers=1, seed=3)
    model = model.to(torch.bfloat16)
    prompts = [p * 3 for p in _prompts(4, (6, 9, 12, 15, 20))]  # repeats: history drafts
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, top_logprobs=2)
    outs = {}
    for backend in ("torch", "flashinfer"):
        e = tiny_engine(model, device="cuda", backend=backend, prefill=24, history_drafts=True)
        verify = e.runner.verify_graphs
        assert verify is not None and verify.backend.name == backend
        outs[backend] = e.generate(prompts, params)
        assert verify.replays > 0 and all(g.graph is not None for g in verify.graphs.values())
        stats = e.spec_stats
        assert 0 < stats.drafted < 4 * stats.steps  # some rows drafted fewer: padded queries
        e.checker.check_idle()
    assert assert_tie_aware_equal(outs["torch"], outs["flashinfer"]) > 100


def _reads_features(model):
    """A head whose drafts depend on its input feature (the target's hidden state when it
    catches up, its own output when it chains): one given to the wrong row or step changes
    them."""
    head = mimic_drafter(model, noise=0.05)
    h = model.config.hidden_size
    with torch.no_grad():
        head.fc.weight[:, h:] = torch.eye(h)
    return head


@pytest.mark.parametrize(("history", "min_confidence"), [(False, 0.0), (True, 0.0), (False, 0.3)])
def test_the_heads_chain_through_its_graphs_static_path_drafts_what_the_loop_drafts(
    history: bool, min_confidence: float
) -> None:
    """`ChainGraphs` (on a GPU one graph of the head's k - 1 chain steps for greedy rows; here
    its static path runs eagerly: per-step static plans over the drafter's pool, padding rows,
    the picks and features fed back on the device) proposes, step by step, exactly the drafts
    the eager loop proposes, and the answers stay transformers'. The head's input is its
    token's embedding plus the feature before it, so a feature given to the wrong row or step
    changes the drafts. With history drafts beside it, steps whose rows draft unequal chains
    take the loop. With `min_confidence` the graph's chains end where the loop's do (the
    graph drafts every step and keeps each draft's probability: a chain is cut at the draft
    that took their product below it), so some chains are shorter than asked."""
    from sessionserve.replicas.attention.torch_backend import TorchPagedBackend
    from sessionserve.replicas.speculative.chain_graphs import ChainGraphs

    confident_at_times = {"init_std": 0.4} if min_confidence else {}
    model = tiny_model(num_hidden_layers=1, seed=3, **confident_at_times)
    prompts = _prompts(2, (6, 19, 33, 47, 70))

    def engine(graphs: bool):
        e = tiny_engine(
            model,
            drafter=_reads_features,
            prefill=24,
            history_drafts=history,
            min_draft_confidence=min_confidence,
        )
        eagle, proposed = e.speculative.eagle, []
        # on a GPU (`--device cuda`) the graphs are captured and replayed; the loop runs eagerly
        captured = eagle.device.type == "cuda"
        eagle.chain_graphs = (
            ChainGraphs(eagle, (1, 2, 4, 8), TorchPagedBackend(), captured) if graphs else None
        )
        propose = eagle.propose

        def logged(reqs, lengths):
            drafts = propose(reqs, lengths)
            proposed.append([d.tokens for d in drafts])
            return drafts

        eagle.propose = logged
        return e, proposed

    (plain, want_drafts), (graphed, got_drafts) = engine(False), engine(True)
    want, got = plain.generate(prompts, GREEDY), graphed.generate(prompts, GREEDY)
    for prompt, r, w in zip(prompts, got, want, strict=True):
        assert r.output_ids == w.output_ids == hf_greedy(model, prompt, GREEDY.max_tokens)
    assert got_drafts == want_drafts and len(want_drafts) > 10
    lengths = {len(c) for step in got_drafts for c in step}
    assert lengths == ({1, 2, 3, 4} if min_confidence else {4}), lengths  # cut at every length
    chain = graphed.speculative.eagle.chain_graphs
    assert chain.replays > 0 and len({size for size, _, _ in chain.graphs}) > 1
    graphed.checker.check_idle()


@pytest.mark.parametrize("history", [False, True])
def test_the_heads_catch_up_through_its_graphs_static_path_guesses_what_the_eager_pass_does(
    history: bool,
) -> None:
    """`CatchUpGraphs` (on a GPU one graph of the head's pass over each request's newly
    committed positions, rows padded to num_drafts + 1 tokens, and each row's next first
    draft; here its static path runs eagerly) gives every request the guess and the feature
    the eager pass gives, and writes the head K/V the eager pass writes (later guesses read
    it), so the drafts and answers stay the same. Prefill chunks (longer than a row) and,
    with history drafts beside it, steps where a request copies its history take the eager
    pass."""
    from sessionserve.replicas.attention.torch_backend import TorchPagedBackend
    from sessionserve.replicas.speculative.catch_up_graphs import CatchUpGraphs

    model = tiny_model(num_hidden_layers=1, seed=3)
    prompts = _prompts(4, (6, 19, 33, 47, 70))

    def engine(graphs: bool):
        e = tiny_engine(model, drafter=_reads_features, prefill=24, history_drafts=history)
        eagle, guesses, graphed = e.speculative.eagle, [], []
        # on a GPU (`--device cuda`) the graphs are captured and replayed; the pass runs eagerly
        captured, rows = eagle.device.type == "cuda", eagle.num_drafts + 1
        eagle.catch_up_graphs = (
            CatchUpGraphs(eagle, (1, 2, 4, 8), TorchPagedBackend(), rows, captured)
            if graphs
            else None
        )
        catch_up = eagle.catch_up

        def logged(entries):
            replays = eagle.catch_up_graphs.replays if graphs else 0
            catch_up(entries)
            graphed.append(graphs and eagle.catch_up_graphs.replays > replays)
            drafts = [e.req.draft for e in entries if e.end > e.start]
            guesses.append([(d.token, d.feature, d.confidence) for d in drafts if d is not None])

        eagle.catch_up = logged
        return e, guesses, graphed

    (plain, want, _), (graphs, got, replayed) = engine(False), engine(True)
    answers, expected = graphs.generate(prompts, GREEDY), plain.generate(prompts, GREEDY)
    for prompt, r, w in zip(prompts, answers, expected, strict=True):
        assert r.output_ids == w.output_ids == hf_greedy(model, prompt, GREEDY.max_tokens)
    assert len(got) == len(want) > 10
    for step_got, step_want in zip(got, want, strict=True):
        assert [t for t, _, _ in step_got] == [t for t, _, _ in step_want]
        for (_, f, p), (_, w, q) in zip(step_got, step_want, strict=True):
            assert torch.allclose(f, w, atol=1e-5), (f - w).abs().max()
            assert p == pytest.approx(q, rel=1e-5) and p < 1  # where a chain's stop starts
    catch_ups = graphs.speculative.eagle.catch_up_graphs
    assert catch_ups.replays == sum(replayed) > 0 and not all(replayed)  # prefills: eager
    assert len({size for size, _, _ in catch_ups.graphs}) > 1  # batch buckets, padding rows
    graphs.checker.check_idle()


def test_a_catch_up_graph_that_fails_to_build_leaves_the_eager_pass(caplog) -> None:
    """A `CatchUpGraphs` shape that cannot be built (a failed capture) is logged once, and
    from then on every catch-up runs eagerly: answers stay transformers'."""
    from sessionserve.replicas.attention.torch_backend import TorchPagedBackend
    from sessionserve.replicas.speculative.catch_up_graphs import CatchUpGraphs

    model = tiny_model(num_hidden_layers=1, seed=3)
    prompts = _prompts(6, (9, 30))
    spec = tiny_engine(model, drafter=mimic_drafter, prefill=24)
    eagle = spec.speculative.eagle
    graphs = eagle.catch_up_graphs = CatchUpGraphs(
        eagle, (1, 2, 4), TorchPagedBackend(), eagle.num_drafts + 1, capture=False
    )
    builds = []

    def broken(*args):
        builds.append(args)
        raise RuntimeError("operation not permitted when stream is capturing")

    graphs._build = broken
    with caplog.at_level("WARNING"):
        results = spec.generate(prompts, GREEDY)
    for prompt, r in zip(prompts, results, strict=True):
        assert r.output_ids == hf_greedy(model, prompt, GREEDY.max_tokens)
    assert len(builds) == 1 and graphs.replays == 0 and "stream is capturing" in graphs.failed
    assert sum("catch-up runs eagerly" in m for m in caplog.messages) == 1
    assert spec.speculative.stats.steps > 0
    spec.checker.check_idle()
